//! Records exchanged between the master, the loggers and the standby: ids, PALs, the per-queue
//! log stream, the logger's feedback, snapshots. All serde (postcard bodies).
//!
//! Between processes every [`NetMsg`] is one pliant-wire frame of kind
//! `pliant_wire::kinds::FTMB`, sealed with the connection's session ([`seal_frame`],
//! [`open_front`], [`read_msg`]): the same framing, authentication and replay protection as
//! every other channel between pliant processes, instead of a length prefix of our own. The
//! bounds stay ours: [`MAX_FRAME`] for a queue stream's frames, `net::MAX_SNAPSHOT_FRAME` for
//! the session stream's.

use pliant_wire::frame::{self as wire_frame, FrameError, HEADER_LEN, TAG_LEN};
use pliant_wire::kinds;
use pliant_wire::session::{Opener, Sealer};
use serde::{Deserialize, Serialize};

/// A worker queue (one worker thread per queue; input queue q is processed by worker q and its
/// log stream is output-logger queue q, one to one as in the paper).
pub type QueueId = u16;
/// A shared variable, named by the NF at declaration.
pub type VarId = u32;

/// Bound on the number of queues (VORs carry one entry per queue).
pub const MAX_QUEUES: usize = 256;
/// Largest frame body (an encoded [`NetMsg`]) on a queue stream, either way.
pub const MAX_FRAME: usize = 1 << 20;

/// An input packet: its queue and its per-queue input sequence number (assigned by the input
/// logger, 0-based, gapless).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct PacketId {
    pub queue: QueueId,
    pub seq: u64,
}

/// The `index`-th output packet written while processing input `packet`. Deterministic replay
/// regenerates the same ids, which is how the output logger recognises output it already
/// released.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct OutputId {
    pub packet: PacketId,
    pub index: u32,
}

/// What a PAL records.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PalKind {
    /// Access number `access` (1-based, gapless per variable) to shared variable `var`.
    Var { var: VarId, access: u64 },
    /// A clock read returned `value` (ns since the master's clock origin).
    Clock { value: u64 },
    /// A random read returned `value`.
    Random { value: u64 },
}

/// Packet access log record (paper §4.2): packet `packet`'s `n`-th determinant (1-based count of
/// shared accesses and value reads made so far by this packet). The per-queue PAL sequence
/// number travels beside it in [`LogMsg::Pal`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pal {
    pub packet: PacketId,
    pub n: u32,
    pub kind: PalKind,
}

/// One record of a queue's stream to the output logger. Order within a queue matters: a
/// packet's PALs always precede it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum LogMsg {
    /// Input-log record (paper §5.1, the input logger's copy of the packet): sent on the
    /// queue's stream *before* the packet's PALs, so a logger that logged a packet's PALs also
    /// holds its input and can hand it to a replaying standby. The output logger ignores it
    /// (the network logger strips it into its per-queue input log, see `server`).
    Input {
        id: PacketId,
        #[serde(with = "bytes")]
        frame: Vec<u8>,
    },
    /// `seq`: this queue's PAL sequence number (1-based, contiguous).
    Pal { seq: u64, pal: Pal },
    /// An output packet and its VOR: for every queue u, the highest PAL seq u had enqueued when
    /// the packet was written. Released once every queue's contiguous logged seq reaches it.
    Output {
        id: OutputId,
        vor: Vec<u64>,
        #[serde(with = "bytes")]
        payload: Vec<u8>,
    },
}

/// What one worker hands its transport at once (batching amortises the hop, paper §4.4).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogBatch {
    pub queue: QueueId,
    /// The master generation that wrote it (0 for the first master, +1 per recovery): the
    /// output logger refuses batches of any other generation, so a dead master's stragglers
    /// cannot be taken for the new master's records (fencing, design invariant 7).
    pub epoch: u64,
    pub msgs: Vec<LogMsg>,
}

/// Output logger -> worker of one queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Feedback {
    /// Every PAL of this queue up to `upto` is logged (cumulative): the worker may forget them.
    Logged { upto: u64 },
    /// PALs `from..=to` of this queue are missing: send them again.
    Resend { from: u64, to: u64 },
    /// Every output of this queue up to `upto` is released (cumulative; release is FIFO per
    /// queue): a master that transmits its own output (`NetTransport::releasing`) sends it
    /// now. Only a server with `ServerOptions::release_to_master` sends it.
    Released { upto: OutputId },
}

/// A snapshot of the NF at a quiescent point (every worker between packets): the NF's own
/// serialised state plus what is needed to resume and to truncate the logs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Snapshot {
    /// The NF's shared and per-worker state, serialised by the NF (opaque here).
    #[serde(with = "bytes")]
    pub nf_state: Vec<u8>,
    /// Per queue: the first input seq the snapshot does *not* cover (replay starts here; the
    /// input logger may drop everything below).
    pub input_next: Vec<u64>,
    /// Per shared variable: accesses made before the snapshot (the replayed accesses continue
    /// from here).
    pub var_accesses: Vec<(VarId, u64)>,
    /// Per queue: the PAL seq reached at the snapshot (the output logger may drop PALs up to it).
    pub pal_seq: Vec<u64>,
}

/// A flow record's change in a snapshot: (key, `Some(record)` | `None` = deleted); both are
/// the NF's own encoding, opaque here.
pub type RecordDelta = (Vec<u8>, Option<Vec<u8>>);

/// One snapshot as the primary ships it to its logger on the session stream
/// (`net::SnapshotLink`): metadata + shared variables' image, and per queue the flow records
/// changed since the previous snapshot (`full`: every record, replacing the image).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotMsg {
    /// Strictly increasing per session; the logger acks the highest applied.
    pub id: u64,
    /// True: replaces the image; false: a delta on top of the previous snapshot.
    pub full: bool,
    /// `pal_seq`, `var_accesses`, `input_next`; `meta.nf_state` = the shared variables' image.
    pub meta: Snapshot,
    /// Per queue: key -> `Some(record)` (created/changed) or `None` (deleted).
    pub locals: Vec<Vec<RecordDelta>>,
}

/// `Vec<u8>` fields as serde byte strings. serde's default treats a `Vec<u8>` as a sequence
/// and postcard then encodes and decodes it one `u8` call at a time: packet frames and
/// payloads made that the top entry of the FTMB profile (~20% of a replica's CPU). As bytes,
/// postcard writes the same wire image (varint length + the raw bytes, since a `u8` element
/// is one raw byte), so both encodings interoperate, but copies it in one `memcpy`.
/// Self-describing formats that hand back an array (serde_json) still decode via `visit_seq`.
pub(crate) mod bytes {
    use serde::de::{Deserializer, Error, SeqAccess, Visitor};
    use serde::Serializer;
    use std::fmt;

    pub fn serialize<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(v)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        d.deserialize_byte_buf(BytesVisitor)
    }

    struct BytesVisitor;

    impl<'de> Visitor<'de> for BytesVisitor {
        type Value = Vec<u8>;

        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a byte string")
        }

        fn visit_bytes<E: Error>(self, v: &[u8]) -> Result<Vec<u8>, E> {
            Ok(v.to_vec())
        }

        fn visit_byte_buf<E: Error>(self, v: Vec<u8>) -> Result<Vec<u8>, E> {
            Ok(v)
        }

        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u8>, A::Error> {
            // Bounded by what the input holds: the hint is not trusted for the allocation.
            let mut v = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
            while let Some(b) = seq.next_element::<u8>()? {
                v.push(b);
            }
            Ok(v)
        }
    }
}

/// Which stream of a master a connection carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum StreamKind {
    /// One worker queue's log stream (inputs, PALs, outputs; feedback comes back).
    Queue(QueueId),
    /// The session stream: snapshots go, snapshot acks come back. Declares the worker count;
    /// it opens (or replaces) the master's logs, so it connects before the queues.
    Session { workers: u16 },
}

/// Frames of the network logger protocol (`net`, `server`), after the pliant-wire handshake.
/// Each is one sealed frame of kind `kinds::FTMB` ([`seal_frame`], [`open_front`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum NetMsg {
    /// Client's first frame: the master (replica name), its session generation (fencing:
    /// older ones are refused once a newer session or a recovery happened) and the stream.
    Hello {
        master: String,
        epoch: u64,
        stream: StreamKind,
    },
    /// Server's answer to an accepted `Hello`.
    Welcome,
    /// Server's answer to a refused `Hello` (fenced, unknown session, over a bound); the
    /// connection is closed after it.
    Refused { reason: String },
    /// Queue stream, client -> server.
    Batch(LogBatch),
    /// Queue stream, server -> client.
    Feedback(Feedback),
    /// Session stream, client -> server.
    Snapshot(SnapshotMsg),
    /// Session stream, server -> client: snapshot `id` is applied (logs truncated).
    SnapshotAck { id: u64 },
}

/// Encodes as `NetMsg::Snapshot(snapshot)` without copying the snapshot into a `NetMsg`
/// (a full snapshot can be megabytes). The variant index must match [`NetMsg`]'s order; a
/// test compares both encodings.
pub struct SnapshotFrame<'a>(pub &'a SnapshotMsg);

impl Serialize for SnapshotFrame<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_newtype_variant("NetMsg", 5, "Snapshot", self.0)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("undecodable record: {0}")]
    Decode(String),
    #[error("could not encode: {0}")]
    Encode(String),
}

/// Seals `m` as one frame of kind `kinds::FTMB` appended to `out`. The body is encoded into
/// `body` (a scratch buffer the caller reuses) and checked against `max` *before* the sealer
/// is used: every sealed frame takes the next sequence number of the direction, so a frame
/// sealed and then not sent (over a bound, or dropped by a full queue) would make every later
/// frame fail its tag at the peer. Refusing first keeps the link usable, as an oversized batch
/// did before (the worker reports it and goes on). The price is one copy of the body.
pub fn seal_frame<T: Serialize>(
    tx: &mut Sealer,
    m: &T,
    max: usize,
    body: &mut Vec<u8>,
    out: &mut Vec<u8>,
) -> Result<(), FrameError> {
    body.clear();
    *body = wire_frame::encode_body(m, std::mem::take(body))?;
    if body.len() > max {
        return Err(FrameError::TooLarge {
            len: body.len(),
            max,
        });
    }
    tx.seal_bytes(kinds::FTMB, body, out)
}

/// Bytes a sealed frame adds to its body (header and tag).
pub const FRAME_OVERHEAD: usize = HEADER_LEN + TAG_LEN;

fn decode_msg(kind: u16, body: &[u8]) -> Result<NetMsg, FrameError> {
    // A frame of another channel's kind is refused: a message cannot be replayed into the
    // wrong protocol even with a valid tag.
    if kind != kinds::FTMB {
        return Err(FrameError::UnexpectedKind(kind));
    }
    wire_frame::decode_body(body)
}

/// Opens the first frame of `buf` if it is complete (`Ok(None)` if not): the message and the
/// bytes consumed. For the non-blocking readers, which buffer what the socket had. The
/// opener's bound (`Opener::set_max_body`) is checked on the header, before the body is
/// waited for. Any error (bad tag: tampered, replayed, reordered or injected; other version,
/// kind or an undecodable body) means the stream must be closed.
pub fn open_front(rx: &mut Opener, buf: &mut [u8]) -> Result<Option<(NetMsg, usize)>, FrameError> {
    let Some((kind, body, used)) = rx.open_front(buf)? else {
        return Ok(None);
    };
    Ok(Some((decode_msg(kind, &buf[body])?, used)))
}

/// Reads and opens one frame from a blocking reader (the hello and its answer).
pub fn read_msg<R: std::io::Read + ?Sized>(
    rx: &mut Opener,
    r: &mut R,
    buf: &mut Vec<u8>,
) -> Result<NetMsg, FrameError> {
    let (kind, body) = rx.read(r, buf)?;
    decode_msg(kind, &buf[body])
}

impl Snapshot {
    pub fn to_bytes(&self) -> Result<Vec<u8>, WireError> {
        postcard::to_allocvec(self).map_err(|e| WireError::Encode(e.to_string()))
    }

    pub fn from_bytes(bytes: &[u8]) -> Result<Snapshot, WireError> {
        postcard::from_bytes(bytes).map_err(|e| WireError::Decode(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_fields_keep_the_sequence_wire_image_both_ways() {
        // The same record with its bytes as a plain `Vec<u8>` sequence (serde's default).
        #[derive(Serialize, Deserialize, PartialEq, Debug)]
        enum SeqMsg {
            Input { id: PacketId, frame: Vec<u8> },
        }
        let frame: Vec<u8> = (0..=255u8).chain(0..40).collect();
        let id = PacketId { queue: 2, seq: 300 };
        let ours = postcard::to_allocvec(&LogMsg::Input {
            id,
            frame: frame.clone(),
        })
        .unwrap();
        let seq = postcard::to_allocvec(&SeqMsg::Input {
            id,
            frame: frame.clone(),
        })
        .unwrap();
        assert_eq!(ours, seq);
        assert_eq!(
            postcard::from_bytes::<SeqMsg>(&ours).unwrap(),
            SeqMsg::Input {
                id,
                frame: frame.clone()
            }
        );
        // A self-describing format hands the bytes back as an array: still accepted.
        let out = LogMsg::Output {
            id: OutputId {
                packet: id,
                index: 1,
            },
            vor: vec![1, 2],
            payload: vec![7, 8, 9],
        };
        let j = serde_json::to_string(&out).unwrap();
        assert!(j.contains("[7,8,9]"), "{j}");
        assert_eq!(serde_json::from_str::<LogMsg>(&j).unwrap(), out);
        // A length past the end is an error, not a panic or a huge allocation.
        let mut cut = ours.clone();
        cut.truncate(ours.len() - 10);
        assert!(postcard::from_bytes::<LogMsg>(&cut).is_err());
    }

    #[test]
    fn a_borrowed_snapshot_frame_encodes_like_the_owned_message() {
        let s = SnapshotMsg {
            id: 3,
            full: false,
            meta: Snapshot {
                nf_state: vec![1, 2],
                input_next: vec![4],
                var_accesses: vec![(1, 9)],
                pal_seq: vec![7],
            },
            locals: vec![vec![(vec![1], None), (vec![2], Some(vec![3]))]],
        };
        let owned = postcard::to_allocvec(&NetMsg::Snapshot(s.clone())).unwrap();
        assert_eq!(postcard::to_allocvec(&SnapshotFrame(&s)).unwrap(), owned);
    }

    /// A session pair over a socket pair (the handshake is pliant-wire's; tested there).
    fn sessions() -> (pliant_wire::Session, pliant_wire::Session) {
        use pliant_wire::{role, session, Ca, Stream};
        let ca = Ca::generate(None).unwrap();
        let a = ca.issue("r1", role::REPLICA, 3600).unwrap();
        let b = ca.issue("r2", role::REPLICA, 3600).unwrap();
        let (x, y) = std::os::unix::net::UnixStream::pair().unwrap();
        let srv = std::thread::spawn(move || {
            session::server(&Stream::Unix(y), &b, &Default::default()).unwrap()
        });
        let c = session::client(&Stream::Unix(x), &a, &Default::default()).unwrap();
        (c, srv.join().unwrap())
    }

    #[test]
    fn sealed_frames_round_trip_wait_for_more_and_keep_their_bounds() {
        let (mut c, mut s) = sessions();
        let m = NetMsg::Batch(LogBatch {
            queue: 0,
            epoch: 0,
            msgs: vec![LogMsg::Input {
                id: PacketId { queue: 0, seq: 4 },
                frame: vec![9; 100],
            }],
        });
        let (mut body, mut f) = (Vec::new(), Vec::new());
        // Over the bound: refused before sealing, so the sequence is not spent and the next
        // frame still opens at the peer (sealing first would break the link here).
        assert!(matches!(
            seal_frame(&mut c.tx, &m, 50, &mut body, &mut f),
            Err(FrameError::TooLarge { max: 50, .. })
        ));
        assert!(f.is_empty());
        seal_frame(&mut c.tx, &m, MAX_FRAME, &mut body, &mut f).unwrap();
        assert_eq!(f.len(), body.len() + FRAME_OVERHEAD);
        // Incomplete: wait for more, at every cut (nothing is consumed meanwhile).
        for cut in 0..f.len() {
            let mut part = f[..cut].to_vec();
            assert!(open_front(&mut s.rx, &mut part).unwrap().is_none());
        }
        let mut whole = f.clone();
        whole.extend_from_slice(&[0xAA; 3]);
        let (back, used) = open_front(&mut s.rx, &mut whole).unwrap().unwrap();
        assert_eq!((back, used), (m.clone(), f.len()));
        // The same frame again is a replay: its tag fails under the next sequence number.
        let mut again = f.clone();
        assert!(matches!(
            open_front(&mut s.rx, &mut again),
            Err(FrameError::BadTag)
        ));
    }

    #[test]
    fn another_channels_kind_and_an_over_bound_header_are_refused() {
        let (mut c, mut s) = sessions();
        let mut f = Vec::new();
        c.tx.seal_msg(pliant_wire::kinds::REPL, &NetMsg::Welcome, &mut f)
            .unwrap();
        assert!(matches!(
            open_front(&mut s.rx, &mut f),
            Err(FrameError::UnexpectedKind(k)) if k == pliant_wire::kinds::REPL
        ));
        // A header declaring more than the opener's bound is refused from the header alone.
        s.rx.set_max_body(64);
        let (mut body, mut f) = (Vec::new(), Vec::new());
        let big = NetMsg::Refused {
            reason: "x".repeat(200),
        };
        seal_frame(&mut c.tx, &big, MAX_FRAME, &mut body, &mut f).unwrap();
        assert!(matches!(
            open_front(&mut s.rx, &mut f[..HEADER_LEN]),
            Err(FrameError::TooLarge { .. })
        ));
    }
}
