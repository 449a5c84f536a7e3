//! The pure decisions of delivery: which committed entries reach the server, and what each
//! event does to the replica's local connections. No I/O here, so they are tested alone
//! (seeded, with duplicates and restarts) and every replica makes the same decisions from the
//! same log.

use crate::event::{Event, Kind};
use std::collections::HashSet;

/// Exactly-once, in-order admission of committed entries by index.
///
/// Raft hands a replica committed entries in order, but a restart hands them all again from
/// the first (the server restarts empty, so the cursor does too), and a bug upstream must not
/// turn into a double delivery or a skipped command.
#[derive(Debug, Clone, Default)]
pub struct Cursor {
    applied: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// The next entry: deliver it.
    Deliver,
    /// Delivered already: skip it.
    Duplicate,
    /// An entry after a missing one: delivery cannot go on (the caller stops the replica's
    /// delivery rather than run the server on a different input).
    Gap { expected: u64 },
}

impl Cursor {
    /// A cursor for a server that has seen entries up to `applied`.
    pub fn new(applied: u64) -> Cursor {
        Cursor { applied }
    }

    pub fn applied(&self) -> u64 {
        self.applied
    }

    pub fn admit(&mut self, index: u64) -> Admit {
        if index <= self.applied {
            Admit::Duplicate
        } else if index == self.applied + 1 {
            self.applied = index;
            Admit::Deliver
        } else {
            Admit::Gap {
                expected: self.applied + 1,
            }
        }
    }
}

/// What an event does to the local connection of its id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Open a connection to the server.
    Open,
    /// Write the event's bytes to it.
    Write,
    /// Half-close it (the client's FIN): the server still answers what it read.
    HalfClose,
    /// Drop it (a reset: the client is gone; the server still reads what it was sent).
    Drop,
    /// Nothing: the event names a connection that is not open (a duplicate connect, bytes
    /// after a close, the second close of a connection closed twice).
    Ignore,
}

/// The connections open on the server, by id, as the log says.
#[derive(Debug, Clone, Default)]
pub struct Table {
    open: HashSet<u64>,
}

impl Table {
    pub fn decide(&mut self, ev: &Event) -> Action {
        match ev.kind {
            Kind::Connect if self.open.insert(ev.conn) => Action::Open,
            Kind::Data if self.open.contains(&ev.conn) => Action::Write,
            Kind::Close if self.open.remove(&ev.conn) => Action::HalfClose,
            Kind::Reset if self.open.remove(&ev.conn) => Action::Drop,
            _ => Action::Ignore,
        }
    }

    pub fn is_open(&self, conn: u64) -> bool {
        self.open.contains(&conn)
    }

    /// Open connection ids, sorted (for the orphan reaping of a new leader).
    pub fn open_ids(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self.open.iter().copied().collect();
        v.sort_unstable();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{self, conn_id};
    use pliant_testkit::XorShift;

    /// A random log of events over a few connections, some of them nonsensical (bytes after a
    /// close, duplicate connects): what a buggy or malicious leader could commit.
    fn random_log(rng: &mut XorShift, n: usize) -> Vec<Vec<u8>> {
        (0..n)
            .map(|i| {
                let conn = conn_id(1 + rng.below(2), rng.below(4) as u32);
                match rng.below(10) {
                    0 => Vec::new(),
                    1 => event::encode(conn, Kind::Connect, b""),
                    2 => event::encode(conn, Kind::Close, b""),
                    3 => event::encode(conn, Kind::Reset, b""),
                    _ => event::encode(conn, Kind::Data, format!("{i};").as_bytes()),
                }
            })
            .collect()
    }

    /// The reference: the log applied once, in order.
    fn reference(log: &[Vec<u8>]) -> Vec<(u64, Action, Vec<u8>)> {
        let mut t = Table::default();
        let mut out = Vec::new();
        for d in log {
            if let Some(ev) = event::decode(d) {
                out.push((ev.conn, t.decide(&ev), ev.bytes));
            }
        }
        out
    }

    /// Entries arrive in batches that overlap (re-deliveries), and the replica restarts at
    /// random points (a fresh server: cursor and table start over and Raft hands the log from
    /// the first entry again). Whatever the schedule, the server of each life sees a prefix of
    /// the reference actions, exactly once and in order, and the last life sees all of them.
    #[test]
    fn delivery_is_exactly_once_in_order_across_overlaps_and_restarts() {
        for seed in 1..=300u64 {
            let mut rng = XorShift(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
            let n = 1 + rng.below(200) as usize;
            let log = random_log(&mut rng, n);
            let want = reference(&log);
            let mut lives = 0;
            'life: loop {
                lives += 1;
                let (mut cur, mut table, mut got) = (Cursor::new(0), Table::default(), Vec::new());
                let mut next = 1u64; // next index Raft hands out
                while next <= log.len() as u64 {
                    // A batch may start before `next` (a re-delivery) but never after it.
                    let start = next.saturating_sub(rng.below(3)).max(1);
                    let end = (start + rng.below(8)).min(log.len() as u64);
                    for idx in start..=end {
                        match cur.admit(idx) {
                            Admit::Deliver => {
                                if let Some(ev) = event::decode(&log[idx as usize - 1]) {
                                    got.push((ev.conn, table.decide(&ev), ev.bytes));
                                }
                            }
                            Admit::Duplicate => {}
                            Admit::Gap { .. } => panic!("seed {seed}: gap in an ordered stream"),
                        }
                    }
                    next = next.max(end + 1);
                    assert_eq!(got[..], want[..got.len()], "seed {seed} life {lives}");
                    if lives < 4 && rng.below(40) == 0 {
                        continue 'life;
                    }
                }
                assert_eq!(got, want, "seed {seed}: the last life saw the whole log");
                break;
            }
        }
    }

    #[test]
    fn a_gap_is_refused_and_does_not_move_the_cursor() {
        let mut c = Cursor::new(4);
        assert_eq!(c.admit(6), Admit::Gap { expected: 5 });
        assert_eq!(c.applied(), 4);
        assert_eq!(c.admit(4), Admit::Duplicate);
        assert_eq!(c.admit(5), Admit::Deliver);
        assert_eq!(c.applied(), 5);
    }

    #[test]
    fn events_of_closed_or_unknown_connections_are_ignored() {
        let mut t = Table::default();
        let ev = |kind| Event {
            conn: 9,
            kind,
            bytes: Vec::new(),
        };
        assert_eq!(t.decide(&ev(Kind::Data)), Action::Ignore);
        assert_eq!(t.decide(&ev(Kind::Connect)), Action::Open);
        assert_eq!(t.decide(&ev(Kind::Connect)), Action::Ignore);
        assert_eq!(t.decide(&ev(Kind::Data)), Action::Write);
        assert_eq!(t.open_ids(), vec![9]);
        assert_eq!(t.decide(&ev(Kind::Close)), Action::HalfClose);
        assert_eq!(t.decide(&ev(Kind::Data)), Action::Ignore);
        assert_eq!(t.decide(&ev(Kind::Reset)), Action::Ignore);
        assert!(!t.is_open(9));
    }
}
