//! Messages of the replication channel (primary -> backup: `Hello`, `Checkpoint`, `Heartbeat`;
//! backup -> primary: `Welcome`, `Ack`, `Refused`). Each frame on the stream is a 4-byte
//! little-endian length followed by a postcard-encoded [`ReplMsg`]; frames above
//! [`MAX_FRAME`] are refused (the connection is closed and the error counted).

use pliant_state::FlowKey;
use serde::{Deserialize, Serialize};

/// Largest frame accepted (a checkpoint of many flows is split by the sender below this).
pub const MAX_FRAME: usize = 8 << 20;

/// Replication group id; 0 is the default (unprotected) group.
pub type GroupId = u32;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ReplMsg {
    /// First frame from the primary after the session handshake (`pliant_wire::session`).
    /// `token` is the primary's ownership epoch (fencing, invariant 7): a backup that has
    /// activated a primary's flows under a newer token refuses an older one.
    Hello {
        primary: String,
        token: u64,
    },
    /// Backup's answer to `Hello`: what it already holds of this primary, per group (highest
    /// applied checkpoint seq), so a reconnecting primary knows whether deltas still apply.
    Welcome {
        held: Vec<(GroupId, u64)>,
    },
    Checkpoint(Checkpoint),
    /// Sent on an idle channel so both ends detect a dead peer within a few intervals.
    Heartbeat {
        at_us: u64,
    },
    Ack(Ack),
    /// The backup will not take checkpoints from this primary (stale token, over a bound...).
    Refused {
        reason: String,
    },
}

/// One epoch of one group: every flow of the group modified since the previous checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Checkpoint {
    pub group: GroupId,
    /// Per-group epoch number, strictly increasing by 1 on one connection.
    pub seq: u64,
    /// When `true` the backup replaces everything it holds for this group with `flows`
    /// (first checkpoint after (re)connecting, Remus-mode epochs); otherwise `flows` are
    /// changes on top of what it holds.
    pub full: bool,
    pub flows: Vec<FlowUpdate>,
    /// Opaque whole-replica state that is not per flow (Remus mode: shared store export; the
    /// NF's non-flow state). `None` leaves the previous value in place.
    pub shared: Option<Vec<u8>>,
}

impl Checkpoint {
    /// The first key carried twice in `flows`, if any. A checkpoint carries each flow at most
    /// once: the primary builds it so (asserted where it is sent), and a backup refuses one
    /// that does not (its bound arithmetic would count the key's old record twice).
    pub fn duplicate_key(&self) -> Option<FlowKey> {
        use foldhash::{HashSet, HashSetExt};
        let mut seen = HashSet::with_capacity(self.flows.len());
        self.flows.iter().map(|u| u.key).find(|k| !seen.insert(*k))
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlowUpdate {
    pub key: FlowKey,
    /// The flow's version (`FlowTable::version`) this update brings the backup to.
    pub version: u64,
    pub body: UpdateBody,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum UpdateBody {
    /// A whole export record (`FlowTable::snapshot_flow`).
    Full(Vec<u8>),
    /// [`crate::delta`] against the record of version `base_version` the backup holds.
    Delta { base_version: u64, bytes: Vec<u8> },
    /// The flow ended on the primary: forget it.
    Deleted,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ack {
    pub group: GroupId,
    /// Highest checkpoint seq of `group` the backup has applied (acks are cumulative).
    pub seq: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("frame of {0} bytes is over the {max} byte bound", max = MAX_FRAME)]
    TooLarge(usize),
    #[error("undecodable frame: {0}")]
    Decode(String),
    #[error("could not encode: {0}")]
    Encode(String),
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
}

/// Length-prefixed postcard encoding of one message.
pub fn encode_frame(m: &ReplMsg) -> Result<Vec<u8>, WireError> {
    let body = postcard::to_allocvec(m).map_err(|e| WireError::Encode(e.to_string()))?;
    if body.len() > MAX_FRAME {
        return Err(WireError::TooLarge(body.len()));
    }
    let mut out = Vec::with_capacity(4 + body.len());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&body);
    Ok(out)
}

/// Reads one frame (blocking on `r`).
pub fn read_frame<R: std::io::Read>(r: &mut R) -> Result<ReplMsg, WireError> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let n = u32::from_le_bytes(len) as usize;
    if n > MAX_FRAME {
        return Err(WireError::TooLarge(n));
    }
    let mut body = vec![0u8; n];
    r.read_exact(&mut body)?;
    postcard::from_bytes(&body).map_err(|e| WireError::Decode(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_bounds_hold() {
        let (k, _) = FlowKey::v4(6, [10, 0, 0, 1].into(), 1000, [10, 0, 0, 2].into(), 80);
        let m = ReplMsg::Checkpoint(Checkpoint {
            group: 3,
            seq: 7,
            full: false,
            flows: vec![FlowUpdate {
                key: k,
                version: 9,
                body: UpdateBody::Delta {
                    base_version: 8,
                    bytes: vec![1, 2, 3],
                },
            }],
            shared: None,
        });
        let f = encode_frame(&m).unwrap();
        assert_eq!(read_frame(&mut &f[..]).unwrap(), m);
        let mut big = (MAX_FRAME as u32 + 1).to_le_bytes().to_vec();
        big.extend_from_slice(&[0; 8]);
        assert!(matches!(
            read_frame(&mut &big[..]),
            Err(WireError::TooLarge(_))
        ));
        let junk = [3u8, 0, 0, 0, 0xff, 0xff, 0xff];
        assert!(matches!(
            read_frame(&mut &junk[..]),
            Err(WireError::Decode(_))
        ));
    }
}
