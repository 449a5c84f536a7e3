//! The per-flow TCP state machine of MBServ, as an explicit enum with named transitions.
//!
//! It follows the connection as a middlebox sees it (both directions), loosely: sequence
//! numbers are tracked per direction as "highest byte seen" so retransmissions can be told
//! apart from new data, and a FIN counts as acknowledged once the peer's ACK passes it.
//!
//! ```text
//!              SYN (initiator)
//!   (none) ----------------------> SynSent
//!   SynSent      --SYN+ACK (responder)--> SynReceived        "syn_ack"
//!   SynReceived  --ACK (initiator)-----> Established         "handshake_done"
//!   Established  --FIN (either)--------> FinWait{closer}     "close_started"
//!   FinWait      --FIN (other side)----> Closing             "close_both"
//!   Closing      --both FINs acked-----> TimeWait            "close_done"
//!   any          --RST-----------------> Closed              "reset"
//!   TimeWait|Closed --SYN (initiator)--> SynSent             "reopen" (5-tuple reuse)
//! ```
//! Anything else that contradicts the state (e.g. data before the handshake completes, a SYN
//! from the responder's side on an established flow) is *invalid* and the packet is dropped.

use serde::{Deserialize, Serialize};

pub const FIN: u8 = 0x01;
pub const SYN: u8 = 0x02;
pub const RST: u8 = 0x04;
pub const ACK: u8 = 0x10;

/// Which end of the connection a packet comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Role {
    Initiator,
    Responder,
}

impl Role {
    pub fn other(self) -> Role {
        match self {
            Role::Initiator => Role::Responder,
            Role::Responder => Role::Initiator,
        }
    }
    fn idx(self) -> usize {
        match self {
            Role::Initiator => 0,
            Role::Responder => 1,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum TcpState {
    SynSent,
    SynReceived,
    Established,
    /// One side (`closer`) sent FIN; the other may still send data.
    FinWait {
        closer: Role,
    },
    /// Both sides sent FIN; waiting for the last one to be acknowledged.
    Closing,
    TimeWait,
    /// Reset.
    Closed,
}

impl TcpState {
    /// Stable snake_case name (metrics, query output).
    pub fn name(&self) -> &'static str {
        match self {
            TcpState::SynSent => "syn_sent",
            TcpState::SynReceived => "syn_received",
            TcpState::Established => "established",
            TcpState::FinWait { .. } => "fin_wait",
            TcpState::Closing => "closing",
            TcpState::TimeWait => "time_wait",
            TcpState::Closed => "closed",
        }
    }
}

/// Sequence progress of one direction.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirTrack {
    /// One past the highest sequence number seen (`None` before this side's SYN).
    pub next_seq: Option<u32>,
    /// Sequence number of this side's FIN.
    pub fin_seq: Option<u32>,
    /// The peer acknowledged that FIN.
    pub fin_acked: bool,
}

/// Signed distance from `base` to `seq` in sequence space.
pub fn rel(seq: u32, base: u32) -> i64 {
    i64::from(seq.wrapping_sub(base) as i32)
}

/// Further than this from the highest byte seen, a sequence number cannot belong to the
/// connection (no TCP window is that large).
pub const MAX_SEQ_DISTANCE: i64 = 1 << 30;

/// The fields of a TCP segment the state machine looks at.
#[derive(Clone, Copy, Debug)]
pub struct Segment {
    pub role: Role,
    pub flags: u8,
    pub seq: u32,
    pub ack: u32,
    pub len: u32,
}

/// What a segment did to the connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Accepted; `transition` names the state change, if any. `new_bytes` is how many payload
    /// bytes (at the end of the segment) were not seen before, `contiguous` whether they
    /// follow the previously seen bytes directly (so a match may straddle the boundary).
    Accepted {
        transition: Option<&'static str>,
        new_bytes: u32,
        contiguous: bool,
    },
    /// The segment contradicts the state: drop it.
    Invalid(&'static str),
}

/// Connection state of one flow.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Conn {
    pub state: TcpState,
    /// Indexed by `Role::idx`.
    pub dirs: [DirTrack; 2],
}

impl Conn {
    /// A connection opened by the initiator's SYN with sequence number `isn`.
    pub fn open(isn: u32) -> Conn {
        let mut dirs = [DirTrack::default(), DirTrack::default()];
        dirs[0].next_seq = Some(isn.wrapping_add(1));
        Conn {
            state: TcpState::SynSent,
            dirs,
        }
    }

    fn dir(&self, r: Role) -> &DirTrack {
        &self.dirs[r.idx()]
    }

    fn dir_mut(&mut self, r: Role) -> &mut DirTrack {
        &mut self.dirs[r.idx()]
    }

    /// Runs one segment through the state machine.
    pub fn on_segment(&mut self, s: &Segment) -> Outcome {
        let syn = s.flags & SYN != 0;
        let ack = s.flags & ACK != 0;
        let pure_syn = syn && !ack && s.flags & RST == 0;

        if s.flags & RST != 0 {
            let changed = self.state != TcpState::Closed;
            self.state = TcpState::Closed;
            return Outcome::Accepted {
                transition: changed.then_some("reset"),
                new_bytes: 0,
                contiguous: false,
            };
        }
        // Sanity of the sequence number against what this side sent so far.
        if let Some(next) = self.dir(s.role).next_seq {
            if !syn && rel(s.seq, next).abs() > MAX_SEQ_DISTANCE {
                return Outcome::Invalid("mbserv_bad_seq");
            }
        }

        let mut transition = None;
        match (self.state, s.role) {
            (TcpState::TimeWait | TcpState::Closed, Role::Initiator) if pure_syn => {
                *self = Conn::open(s.seq);
                return Outcome::Accepted {
                    transition: Some("reopen"),
                    new_bytes: 0,
                    contiguous: false,
                };
            }
            // Only an RST leads to Closed. Segments the peer had in flight when the RST crossed
            // them are normal at the end of a connection (iperf3's server resets the data
            // connection while the client is still sending), so they get their own drop reason
            // and `mbserv_invalid` stays a signal of real contradictions.
            (TcpState::Closed, _) => return Outcome::Invalid("mbserv_after_reset"),
            (TcpState::SynSent, Role::Initiator) if pure_syn => {}
            (TcpState::SynSent, Role::Responder) if syn && ack => {
                self.dir_mut(Role::Responder).next_seq = Some(s.seq.wrapping_add(1));
                self.state = TcpState::SynReceived;
                transition = Some("syn_ack");
            }
            (TcpState::SynSent, _) => return Outcome::Invalid("mbserv_invalid"),
            (TcpState::SynReceived, Role::Responder) if syn && ack => {}
            (TcpState::SynReceived, Role::Initiator) if pure_syn => {}
            (TcpState::SynReceived, Role::Initiator) if ack && !syn => {
                self.state = TcpState::Established;
                transition = Some("handshake_done");
            }
            (TcpState::SynReceived, _) => return Outcome::Invalid("mbserv_invalid"),
            // A retransmitted SYN-ACK (the initiator's ACK was lost) is legitimate; any other
            // SYN after the handshake is not.
            (_, Role::Responder) if syn && ack => {}
            (_, _) if syn => return Outcome::Invalid("mbserv_invalid"),
            _ => {}
        }

        // Data bytes: everything after the SYN flag's sequence number.
        let data_seq = if syn { s.seq.wrapping_add(1) } else { s.seq };
        let (new_bytes, contiguous) = self.advance(s.role, data_seq, s.len);

        if s.flags & FIN != 0 {
            let fin_seq = data_seq.wrapping_add(s.len);
            let d = self.dir_mut(s.role);
            if d.fin_seq.is_none() {
                d.fin_seq = Some(fin_seq);
                let end = fin_seq.wrapping_add(1);
                if !matches!(d.next_seq, Some(n) if rel(end, n) <= 0) {
                    d.next_seq = Some(end);
                }
            }
        }
        if ack {
            // The ACK may acknowledge the peer's FIN.
            let peer = self.dir_mut(s.role.other());
            if let Some(f) = peer.fin_seq {
                if rel(s.ack, f.wrapping_add(1)) >= 0 {
                    peer.fin_acked = true;
                }
            }
        }
        let fins = (
            self.dirs[0].fin_seq.is_some(),
            self.dirs[1].fin_seq.is_some(),
        );
        let next = match (self.state, fins) {
            (TcpState::Established, (true, false)) => TcpState::FinWait {
                closer: Role::Initiator,
            },
            (TcpState::Established, (false, true)) => TcpState::FinWait {
                closer: Role::Responder,
            },
            (TcpState::Established | TcpState::FinWait { .. }, (true, true)) => TcpState::Closing,
            (s, _) => s,
        };
        let next = if next == TcpState::Closing && self.dirs.iter().all(|d| d.fin_acked) {
            TcpState::TimeWait
        } else {
            next
        };
        if next != self.state {
            transition = Some(match next {
                TcpState::FinWait { .. } => "close_started",
                TcpState::Closing => "close_both",
                TcpState::TimeWait => "close_done",
                _ => "other",
            });
            self.state = next;
        }
        Outcome::Accepted {
            transition,
            new_bytes,
            contiguous,
        }
    }

    /// Records payload `[seq, seq+len)` of `role`; returns the new bytes at the segment's end
    /// and whether they directly follow the bytes seen before.
    fn advance(&mut self, role: Role, seq: u32, len: u32) -> (u32, bool) {
        if len == 0 {
            return (0, false);
        }
        let end = seq.wrapping_add(len);
        let d = self.dir_mut(role);
        match d.next_seq {
            None => {
                d.next_seq = Some(end);
                (len, false)
            }
            Some(next) => {
                let ahead = rel(end, next);
                if ahead <= 0 {
                    // Entirely seen before: a retransmission (or a late hole fill).
                    return (0, false);
                }
                d.next_seq = Some(end);
                let start = rel(seq, next);
                if start <= 0 {
                    (ahead as u32, true)
                } else {
                    // A hole before this segment: its bytes are new but not contiguous.
                    (len, false)
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Role::*;

    fn seg(role: Role, flags: u8, seq: u32, ack: u32, len: u32) -> Segment {
        Segment {
            role,
            flags,
            seq,
            ack,
            len,
        }
    }

    fn transition(o: Outcome) -> Option<&'static str> {
        match o {
            Outcome::Accepted { transition, .. } => transition,
            Outcome::Invalid(r) => panic!("unexpected invalid: {r}"),
        }
    }

    #[test]
    fn full_lifecycle() {
        let mut c = Conn::open(1000);
        assert_eq!(c.state, TcpState::SynSent);
        assert_eq!(
            transition(c.on_segment(&seg(Responder, SYN | ACK, 5000, 1001, 0))),
            Some("syn_ack")
        );
        assert_eq!(
            transition(c.on_segment(&seg(Initiator, ACK, 1001, 5001, 0))),
            Some("handshake_done")
        );
        let o = c.on_segment(&seg(Initiator, ACK, 1001, 5001, 10));
        assert_eq!(
            o,
            Outcome::Accepted {
                transition: None,
                new_bytes: 10,
                contiguous: true
            }
        );
        // Retransmission: nothing new.
        let o = c.on_segment(&seg(Initiator, ACK, 1001, 5001, 10));
        assert_eq!(
            o,
            Outcome::Accepted {
                transition: None,
                new_bytes: 0,
                contiguous: false
            }
        );
        // Partial overlap: 5 new bytes, contiguous.
        let o = c.on_segment(&seg(Initiator, ACK, 1006, 5001, 10));
        assert_eq!(
            o,
            Outcome::Accepted {
                transition: None,
                new_bytes: 5,
                contiguous: true
            }
        );
        assert_eq!(
            transition(c.on_segment(&seg(Initiator, FIN | ACK, 1016, 5001, 0))),
            Some("close_started")
        );
        assert_eq!(c.state, TcpState::FinWait { closer: Initiator });
        assert_eq!(
            transition(c.on_segment(&seg(Responder, FIN | ACK, 5001, 1017, 0))),
            Some("close_both")
        );
        assert_eq!(
            transition(c.on_segment(&seg(Initiator, ACK, 1017, 5002, 0))),
            Some("close_done")
        );
        assert_eq!(c.state, TcpState::TimeWait);
        assert_eq!(
            transition(c.on_segment(&seg(Initiator, SYN, 90_000, 0, 0))),
            Some("reopen")
        );
        assert_eq!(c.state, TcpState::SynSent);
    }

    #[test]
    fn contradictions_are_invalid() {
        let mut c = Conn::open(1);
        assert_eq!(
            c.on_segment(&seg(Initiator, ACK, 2, 0, 5)),
            Outcome::Invalid("mbserv_invalid")
        );
        assert_eq!(
            c.on_segment(&seg(Responder, ACK, 9, 2, 0)),
            Outcome::Invalid("mbserv_invalid")
        );
        c.on_segment(&seg(Responder, SYN | ACK, 100, 2, 0));
        c.on_segment(&seg(Initiator, ACK, 2, 101, 0));
        assert_eq!(c.state, TcpState::Established);
        assert_eq!(
            c.on_segment(&seg(Initiator, SYN, 2, 0, 0)),
            Outcome::Invalid("mbserv_invalid")
        );
        assert_eq!(
            c.on_segment(&seg(Initiator, ACK, 2u32.wrapping_add(1 << 31), 101, 1)),
            Outcome::Invalid("mbserv_bad_seq")
        );
        assert_eq!(
            transition(c.on_segment(&seg(Responder, RST, 101, 0, 0))),
            Some("reset")
        );
        assert_eq!(
            c.on_segment(&seg(Initiator, ACK, 2, 101, 3)),
            Outcome::Invalid("mbserv_after_reset")
        );
    }

    #[test]
    fn hole_then_fill() {
        let mut c = Conn::open(0);
        c.on_segment(&seg(Responder, SYN | ACK, 0, 1, 0));
        c.on_segment(&seg(Initiator, ACK, 1, 1, 0));
        let o = c.on_segment(&seg(Initiator, ACK, 11, 1, 10));
        assert_eq!(
            o,
            Outcome::Accepted {
                transition: None,
                new_bytes: 10,
                contiguous: false
            }
        );
        let o = c.on_segment(&seg(Initiator, ACK, 1, 1, 10));
        assert_eq!(
            o,
            Outcome::Accepted {
                transition: None,
                new_bytes: 0,
                contiguous: false
            }
        );
    }
}
