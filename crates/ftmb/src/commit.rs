//! The output-commit audit (design invariant 4: a packet leaves only after every PAL in its VOR
//! is logged), kept apart from the release decision so that it can disagree with it.
//!
//! [`OutputLogger`](crate::logger::OutputLogger) decides a release from its queue bookkeeping
//! (`logged`); an audit that re-reads that bookkeeping at the same moment restates the
//! decision and cannot fail. This ledger is instead fed by the storage events themselves: the
//! seq of each PAL as it is appended to a queue's log, the snapshot position a log starts
//! from, and the cut a recovery keeps. From those seqs alone it keeps, per queue, the highest
//! seq up to which every PAL is on the log. The release code never reads it; the logger checks
//! each released output against it when the output is handed out for transmission
//! (`OutputLogger::drain_released`, the only way output leaves a logger), not when the release
//! is decided. A release decided too early is therefore counted unless the missing PALs
//! happened to arrive before the hand-out, in which case the packet did not leave early.
//!
//! Cost on the hot path: one compare-and-store per stored PAL and one pass over the VOR (at
//! most `MAX_QUEUES` entries) per released output; no allocation.

pub(crate) struct CommitLedger {
    /// Per queue: every PAL with seq `1..=stored_upto[q]` is on the log, or covered by the
    /// snapshot the log started from (`based`).
    stored_upto: Vec<u64>,
}

impl CommitLedger {
    pub fn new(queues: usize) -> CommitLedger {
        CommitLedger {
            stored_upto: vec![0; queues],
        }
    }

    /// PAL `seq` of queue `q` was appended to the log.
    pub fn stored(&mut self, q: usize, seq: u64) {
        let upto = &mut self.stored_upto[q];
        if seq == *upto + 1 {
            *upto = seq;
        } else {
            // The log appends in seq order without gaps; anything else is a logger bug. In a
            // release build the ledger stays where it was (it under-reports what is stored,
            // so a dependent release is flagged rather than excused).
            debug_assert!(
                seq <= *upto,
                "queue {q}: PAL {seq} stored after {upto} (a gap on the log)"
            );
        }
    }

    /// The log of queue `q` starts after `seq`: PALs up to it are covered by the snapshot the
    /// logger started from (`OutputLogger::start_at`).
    pub fn based(&mut self, q: usize, seq: u64) {
        let upto = &mut self.stored_upto[q];
        *upto = (*upto).max(seq);
    }

    /// A recovery dropped every PAL past `cut[q]`.
    pub fn cut(&mut self, cut: &[u64]) {
        debug_assert_eq!(cut.len(), self.stored_upto.len());
        for (upto, &c) in self.stored_upto.iter_mut().zip(cut) {
            *upto = (*upto).min(c);
        }
    }

    /// Whether every PAL `vor` names is stored. A VOR of the wrong shape is not covered.
    pub fn covers(&self, vor: &[u64]) -> bool {
        vor.len() == self.stored_upto.len()
            && vor.iter().zip(&self.stored_upto).all(|(&v, &s)| s >= v)
    }

    #[cfg(test)]
    pub fn stored_upto(&self, q: usize) -> u64 {
        self.stored_upto[q]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ledger_follows_stored_seqs_snapshot_bases_and_cuts() {
        let mut l = CommitLedger::new(2);
        assert!(l.covers(&[0, 0]));
        assert!(!l.covers(&[1, 0]));
        l.stored(0, 1);
        l.stored(0, 2);
        assert!(l.covers(&[2, 0]));
        assert!(!l.covers(&[3, 0]));
        assert!(!l.covers(&[2, 1]));
        // A re-stored seq (the log never does that, but it must not move the ledger back).
        l.stored(0, 1);
        assert_eq!(l.stored_upto(0), 2);
        l.based(1, 5);
        assert!(l.covers(&[2, 5]));
        l.stored(1, 6);
        assert_eq!(l.stored_upto(1), 6);
        // A base below what is stored leaves it alone.
        l.based(1, 3);
        assert_eq!(l.stored_upto(1), 6);
        l.cut(&[1, 6]);
        assert!(!l.covers(&[2, 6]));
        assert!(l.covers(&[1, 6]));
        assert!(!l.covers(&[1]), "wrong shape");
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "a gap on the log")]
    fn a_gap_on_the_log_is_a_bug() {
        let mut l = CommitLedger::new(1);
        l.stored(0, 2);
    }
}
