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
    /// `seq`: this queue's PAL sequence number (1-based, contiguous).
    Pal { seq: u64, pal: Pal },
    /// An output packet and its VOR: for every queue u, the highest PAL seq u had enqueued when
    /// the packet was written. Released once every queue's contiguous logged seq reaches it.
    Output {
        id: OutputId,
        vor: Vec<u64>,
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

#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("frame of {0} bytes is over the {max} byte bound", max = MAX_FRAME)]
    TooLarge(usize),
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
}
