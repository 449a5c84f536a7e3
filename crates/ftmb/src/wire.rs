//! Records exchanged between the master, the loggers and the standby: ids, PALs, the per-queue
//! log stream, the logger's feedback, snapshots. All serde so the stream can later run over
//! the pliant-ha authenticated channel ([`encode_batch`]/[`decode_batch`] frame it the same way
//! as `pliant_ha::wire`: 4-byte little-endian length + postcard, bounded by [`MAX_FRAME`]).

use serde::{Deserialize, Serialize};

/// A worker queue (one worker thread per queue; input queue q is processed by worker q and its
/// log stream is output-logger queue q, one to one as in the paper).
pub type QueueId = u16;
/// A shared variable, named by the NF at declaration.
pub type VarId = u32;

/// Bound on the number of queues (VORs carry one entry per queue).
pub const MAX_QUEUES: usize = 256;
/// Largest encoded batch accepted by [`decode_batch`].
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

/// Frames of the network logger protocol (`net`, `server`), after the `pliant_ha::auth`
/// handshake. Framed by [`encode_frame`]/[`decode_frame`] (4-byte LE length + postcard).
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
    #[error("frame of {0} bytes is over the {max} byte bound", max = MAX_FRAME)]
    TooLarge(usize),
    #[error("frame of {len} bytes is over the {max} byte bound of its stream")]
    OverBound { len: usize, max: usize },
    #[error("frame is shorter than its {0}-byte length prefix says")]
    Truncated(usize),
    #[error("undecodable frame: {0}")]
    Decode(String),
    #[error("could not encode: {0}")]
    Encode(String),
}

/// Length-prefixed postcard encoding of one batch.
pub fn encode_batch(b: &LogBatch) -> Result<Vec<u8>, WireError> {
    let body = postcard::to_allocvec(b).map_err(|e| WireError::Encode(e.to_string()))?;
    if body.len() > MAX_FRAME {
        return Err(WireError::TooLarge(body.len()));
    }
    let mut out = Vec::with_capacity(4 + body.len());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&body);
    Ok(out)
}

/// Decodes one frame from the front of `buf`; returns the batch and the bytes consumed.
pub fn decode_batch(buf: &[u8]) -> Result<(LogBatch, usize), WireError> {
    let Some(len) = buf.get(..4) else {
        return Err(WireError::Truncated(4));
    };
    let n = u32::from_le_bytes([len[0], len[1], len[2], len[3]]) as usize;
    if n > MAX_FRAME {
        return Err(WireError::TooLarge(n));
    }
    let Some(body) = buf.get(4..4 + n) else {
        return Err(WireError::Truncated(n));
    };
    let b = postcard::from_bytes(body).map_err(|e| WireError::Decode(e.to_string()))?;
    Ok((b, 4 + n))
}

/// Length-prefixed postcard encoding of any record, bounded by `max` bytes of body.
pub fn encode_frame<T: Serialize>(m: &T, max: usize) -> Result<Vec<u8>, WireError> {
    let mut out = vec![0u8; 4];
    let mut out = postcard::to_extend(m, std::mem::take(&mut out))
        .map_err(|e| WireError::Encode(e.to_string()))?;
    let n = out.len() - 4;
    if n > max {
        return Err(WireError::OverBound { len: n, max });
    }
    out[..4].copy_from_slice(&(n as u32).to_le_bytes());
    Ok(out)
}

/// [`encode_frame`] into `out` (cleared first), so a caller that sends frames in a loop
/// reuses one allocation instead of growing a fresh `Vec` by doubling for every frame.
pub fn encode_frame_into<T: Serialize>(
    m: &T,
    max: usize,
    out: &mut Vec<u8>,
) -> Result<(), WireError> {
    let mut buf = std::mem::take(out);
    buf.clear();
    buf.extend_from_slice(&[0; 4]);
    let mut buf = match postcard::to_extend(m, buf) {
        Ok(b) => b,
        Err(e) => return Err(WireError::Encode(e.to_string())),
    };
    let n = buf.len() - 4;
    if n > max {
        buf.clear();
        *out = buf;
        return Err(WireError::OverBound { len: n, max });
    }
    buf[..4].copy_from_slice(&(n as u32).to_le_bytes());
    *out = buf;
    Ok(())
}

/// Decodes one frame from the front of `buf`: `Ok(None)` if it is not complete yet, else the
/// record and the bytes consumed. A length over `max` is an error before anything is read.
pub fn decode_frame<T: for<'de> Deserialize<'de>>(
    buf: &[u8],
    max: usize,
) -> Result<Option<(T, usize)>, WireError> {
    let Some(len) = buf.get(..4) else {
        return Ok(None);
    };
    let n = u32::from_le_bytes([len[0], len[1], len[2], len[3]]) as usize;
    if n > max {
        return Err(WireError::OverBound { len: n, max });
    }
    let Some(body) = buf.get(4..4 + n) else {
        return Ok(None);
    };
    let m = postcard::from_bytes(body).map_err(|e| WireError::Decode(e.to_string()))?;
    Ok(Some((m, 4 + n)))
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
    fn batches_round_trip_and_bounds_hold() {
        let p = PacketId { queue: 1, seq: 7 };
        let b = LogBatch {
            queue: 1,
            epoch: 2,
            msgs: vec![
                LogMsg::Pal {
                    seq: 3,
                    pal: Pal {
                        packet: p,
                        n: 1,
                        kind: PalKind::Var { var: 2, access: 9 },
                    },
                },
                LogMsg::Output {
                    id: OutputId {
                        packet: p,
                        index: 0,
                    },
                    vor: vec![0, 3],
                    payload: vec![1, 2, 3],
                },
            ],
        };
        let f = encode_batch(&b).unwrap();
        let (back, used) = decode_batch(&f).unwrap();
        assert_eq!(back, b);
        assert_eq!(used, f.len());
        assert!(matches!(
            decode_batch(&f[..f.len() - 1]),
            Err(WireError::Truncated(_))
        ));
        let mut big = (MAX_FRAME as u32 + 1).to_le_bytes().to_vec();
        big.extend_from_slice(&[0; 8]);
        assert!(matches!(decode_batch(&big), Err(WireError::TooLarge(_))));
        assert!(matches!(
            decode_batch(&[2, 0, 0, 0, 0xff, 0xff]),
            Err(WireError::Decode(_))
        ));
    }

    #[test]
    fn net_frames_round_trip_wait_for_more_and_respect_their_bound() {
        let m = NetMsg::Batch(LogBatch {
            queue: 0,
            epoch: 0,
            msgs: vec![LogMsg::Input {
                id: PacketId { queue: 0, seq: 4 },
                frame: vec![9; 100],
            }],
        });
        let f = encode_frame(&m, MAX_FRAME).unwrap();
        let (back, used) = decode_frame::<NetMsg>(&f, MAX_FRAME).unwrap().unwrap();
        assert_eq!((back, used), (m.clone(), f.len()));
        // Incomplete: wait for more, at every cut.
        for cut in 0..f.len() {
            assert!(decode_frame::<NetMsg>(&f[..cut], MAX_FRAME)
                .unwrap()
                .is_none());
        }
        assert!(matches!(
            encode_frame(&m, 50),
            Err(WireError::OverBound { max: 50, .. })
        ));
        // The reusing encoder writes the same bytes over whatever the buffer held.
        let mut reused = vec![0xAA; 7];
        encode_frame_into(&m, MAX_FRAME, &mut reused).unwrap();
        assert_eq!(reused, f);
        assert!(matches!(
            encode_frame_into(&m, 50, &mut reused),
            Err(WireError::OverBound { max: 50, .. })
        ));
        assert!(matches!(
            decode_frame::<NetMsg>(&f, 50),
            Err(WireError::OverBound { max: 50, .. })
        ));
        assert!(matches!(
            decode_frame::<NetMsg>(&[2, 0, 0, 0, 0xff, 0xff], MAX_FRAME),
            Err(WireError::Decode(_))
        ));
    }

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
        let owned = encode_frame(&NetMsg::Snapshot(s.clone()), MAX_FRAME).unwrap();
        assert_eq!(encode_frame(&SnapshotFrame(&s), MAX_FRAME).unwrap(), owned);
    }
}
