//! Output-commit audit (design invariant 3), computed independently of the decision it audits.
//!
//! The [`gate`](crate::gate) decides when a packet may leave from the output rule and its own
//! open/acked seqs. This audit does not look at either. It is fed three kinds of facts by the
//! runtime, at the places where they happen:
//!
//! - **what left**: every packet of a protected flow at the moment it is handed to its port,
//!   whatever path it took (released on an ack, the clean-flow bypass, a hold refused as
//!   already acked, a fallback), with the flow it was written for, that flow's version after
//!   the batch that wrote it, and the round it was written in ([`Exit`]);
//! - **what was sent**: the content of every checkpoint as it was put on the link (per flow:
//!   the version carried, or a deletion; whether it replaces the group);
//! - **what was acknowledged**: each ack as it arrived from the backup (and the `Welcome` a
//!   reconnecting backup sends, which says what it still holds).
//!
//! From the last two it keeps, per flow, the version the backup has acknowledged holding; a
//! packet that leaves is a **violation** when the backup had not acknowledged its flow at the
//! packet's version or later (for a flow the batch deleted: when the backup still holds or may
//! still apply a copy of it). In Remus mode every packet waits for the epoch: it is a violation
//! when no acknowledged checkpoint was taken at or after the round that wrote it.
//!
//! Exempt by design (counted apart, never checked): `pkt_write_direct` output outside Remus
//! mode, and output of flows whose group is unprotected (group 0, or its backup died). The
//! caller says which; the audit does not re-derive it.
//!
//! Known blind spot: flow versions restart at 0 when a flow is deleted and re-created. If both
//! happen between two checkpoints, a packet of the new flow at version `v` is judged against
//! the acknowledged version of the old one; an early release of such a packet would be missed
//! (never the reverse: the audit does not report violations that did not happen).

use crate::wire::{Checkpoint, GroupId, UpdateBody};
use foldhash::HashMap;
use pliant_state::FlowKey;
use std::collections::VecDeque;

/// Violation records kept for inspection (the counters cover all).
pub const MAX_VIOLATION_RECORDS: usize = 256;

/// A packet that left, as the audit needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Exit {
    /// The flow's primary key (`None`: direct output, only audited in Remus mode).
    pub key: Option<FlowKey>,
    /// The flow's version after the batch that wrote the packet (`None`: no such flow).
    pub version: Option<u64>,
    /// The group whose protection the packet relies on (Remus: the epoch group).
    pub group: GroupId,
    /// The round the packet was written in (the caller's clock, never decreasing).
    pub written: u64,
    /// Written under Remus (every packet waits for the epoch) rather than Pico.
    pub remus: bool,
}

/// One audited release that broke output commit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Violation {
    pub group: GroupId,
    pub version: Option<u64>,
    /// The version the backup had acknowledged for this flow when the packet left (`None`:
    /// none). Remus: the newest acknowledged epoch's round.
    pub acked: Option<u64>,
    pub written: u64,
    pub left: u64,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct AuditStats {
    /// Packets checked against the acknowledgements.
    pub checked: u64,
    /// Checked packets that left before the backup acknowledged what they depended on.
    pub violations: u64,
    /// Packets that left exempt by design (direct output, unprotected groups).
    pub exempt: u64,
    /// Acks for a seq the audit never saw sent (ignored).
    pub unknown_acks: u64,
}

/// A checkpoint on the link, not yet acknowledged.
struct Sent {
    seq: u64,
    full: bool,
    /// Round it was taken in (Remus: every flow as of the end of that round).
    taken: u64,
    /// (flow, version) carried; `None`: deleted.
    carried: Vec<(FlowKey, Option<u64>)>,
}

#[derive(Default)]
struct GroupAudit {
    pending: VecDeque<Sent>,
    acked_seq: u64,
    /// Remus: round of the newest acknowledged epoch.
    acked_taken: Option<u64>,
}

/// See the module documentation.
#[derive(Default)]
pub struct ExitAudit {
    groups: HashMap<GroupId, GroupAudit>,
    /// flow -> (group, version) the backup acknowledged holding.
    acked: HashMap<FlowKey, (GroupId, u64)>,
    /// flow -> number of sent, unacknowledged checkpoints carrying a version of it.
    in_flight: HashMap<FlowKey, u32>,
    pub stats: AuditStats,
    violations: VecDeque<Violation>,
}

impl ExitAudit {
    pub fn new() -> Self {
        Self::default()
    }

    /// A checkpoint was put on its group's link in round `taken` (`remus`: an epoch of Remus
    /// mode, audited by round; its content, every flow, is not recorded).
    pub fn sent(&mut self, cp: &Checkpoint, taken: u64, remus: bool) {
        let carried: Vec<(FlowKey, Option<u64>)> = if remus {
            Vec::new() // Remus epochs are audited by round; their content is everything.
        } else {
            cp.flows
                .iter()
                .map(|f| {
                    let v = match f.body {
                        UpdateBody::Deleted => None,
                        _ => Some(f.version),
                    };
                    (f.key, v)
                })
                .collect()
        };
        for (k, v) in &carried {
            if v.is_some() {
                *self.in_flight.entry(*k).or_insert(0) += 1;
            }
        }
        self.groups
            .entry(cp.group)
            .or_default()
            .pending
            .push_back(Sent {
                seq: cp.seq,
                full: cp.full,
                taken,
                carried,
            });
    }

    /// The checkpoint `seq` of `group` recorded by [`Self::sent`] could not be queued after all.
    pub fn withdraw(&mut self, group: GroupId, seq: u64) {
        let Some(ga) = self.groups.get_mut(&group) else {
            return;
        };
        if ga.pending.back().is_some_and(|s| s.seq == seq) {
            if let Some(s) = ga.pending.pop_back() {
                for (k, v) in s.carried {
                    if v.is_some() {
                        self.leave_flight(&k);
                    }
                }
            }
        }
    }

    /// The backup acknowledged every checkpoint of `group` up to `seq` (acks are cumulative).
    pub fn acked(&mut self, group: GroupId, seq: u64) {
        let Some(ga) = self.groups.get_mut(&group) else {
            self.stats.unknown_acks += 1;
            return;
        };
        if seq <= ga.acked_seq {
            return;
        }
        if !ga.pending.iter().any(|s| s.seq == seq) {
            self.stats.unknown_acks += 1;
            return;
        }
        ga.acked_seq = seq;
        let mut applied = Vec::new();
        while ga.pending.front().is_some_and(|s| s.seq <= seq) {
            applied.extend(ga.pending.pop_front());
        }
        for s in applied {
            self.apply(group, s);
        }
    }

    fn apply(&mut self, group: GroupId, s: Sent) {
        if let Some(ga) = self.groups.get_mut(&group) {
            ga.acked_taken = Some(ga.acked_taken.map_or(s.taken, |t| t.max(s.taken)));
        }
        if s.full {
            // The backup replaced what it held of this group with the checkpoint's content.
            self.acked.retain(|_, (g, _)| *g != group);
        }
        for (k, v) in s.carried {
            match v {
                Some(v) => {
                    self.leave_flight(&k);
                    self.acked.insert(k, (group, v));
                }
                None => {
                    if self.acked.get(&k).is_some_and(|(g, _)| *g == group) {
                        self.acked.remove(&k);
                    }
                }
            }
        }
    }

    fn leave_flight(&mut self, k: &FlowKey) {
        if let Some(n) = self.in_flight.get_mut(k) {
            *n -= 1;
            if *n == 0 {
                self.in_flight.remove(k);
            }
        }
    }

    /// A (re)connected backup said it holds `group` up to `held_seq` (0: nothing). What it
    /// applied up to there is acknowledged; checkpoints sent after it were lost with the old
    /// connection; if it holds less than it had acknowledged, it lost that state.
    pub fn welcome(&mut self, group: GroupId, held_seq: u64) {
        let Some(ga) = self.groups.get(&group) else {
            return;
        };
        let lost_acked = held_seq < ga.acked_seq;
        if held_seq > ga.acked_seq {
            self.acked(group, held_seq);
        }
        let Some(ga) = self.groups.get_mut(&group) else {
            return;
        };
        let lost: Vec<Sent> = ga.pending.drain(..).collect();
        if lost_acked {
            ga.acked_seq = held_seq;
            ga.acked_taken = None;
        }
        for s in lost {
            for (k, v) in s.carried {
                if v.is_some() {
                    self.leave_flight(&k);
                }
            }
        }
        if lost_acked {
            self.acked.retain(|_, (g, _)| *g != group);
        }
    }

    /// `group` is gone (its backup died, or it left): nothing it held protects anything.
    pub fn forget_group(&mut self, group: GroupId) {
        if let Some(ga) = self.groups.remove(&group) {
            for s in ga.pending {
                for (k, v) in s.carried {
                    if v.is_some() {
                        self.leave_flight(&k);
                    }
                }
            }
        }
        self.acked.retain(|_, (g, _)| *g != group);
    }

    /// An exempt packet left (direct output, unprotected group).
    pub fn exempt(&mut self) {
        self.stats.exempt += 1;
    }

    /// A packet of a protected group left in round `now`. Returns false on a violation.
    pub fn left(&mut self, e: &Exit, now: u64) -> bool {
        self.stats.checked += 1;
        let (ok, acked) = if e.remus {
            let t = self.groups.get(&e.group).and_then(|g| g.acked_taken);
            (t.is_some_and(|t| t >= e.written), t)
        } else {
            match e.key {
                // Direct output is exempt outside Remus: the caller should not ask.
                None => (true, None),
                Some(k) => {
                    let acked = self.acked.get(&k).map(|(_, v)| *v);
                    let ok = match e.version {
                        Some(v) => acked.is_some_and(|a| a >= v),
                        // The flow is gone: nothing of it may remain for a failover to revive.
                        None => acked.is_none() && !self.in_flight.contains_key(&k),
                    };
                    (ok, acked)
                }
            }
        };
        if !ok {
            self.stats.violations += 1;
            if self.violations.len() >= MAX_VIOLATION_RECORDS {
                self.violations.pop_front();
            }
            self.violations.push_back(Violation {
                group: e.group,
                version: e.version,
                acked,
                written: e.written,
                left: now,
            });
        }
        ok
    }

    /// The most recent violations (oldest first).
    pub fn violations(&self) -> impl Iterator<Item = &Violation> {
        self.violations.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::FlowUpdate;
    use pliant_state::FlowKey;

    fn key(n: u16) -> FlowKey {
        FlowKey::v4(6, [10, 0, 0, 1].into(), n, [10, 0, 0, 2].into(), 80).0
    }

    fn cp(group: GroupId, seq: u64, full: bool, flows: &[(u16, Option<u64>)]) -> Checkpoint {
        Checkpoint {
            group,
            seq,
            full,
            flows: flows
                .iter()
                .map(|&(n, v)| FlowUpdate {
                    key: key(n),
                    version: v.unwrap_or(0),
                    body: match v {
                        Some(_) => UpdateBody::Full(vec![1]),
                        None => UpdateBody::Deleted,
                    },
                })
                .collect(),
            shared: None,
        }
    }

    fn exit(n: u16, v: Option<u64>) -> Exit {
        Exit {
            key: Some(key(n)),
            version: v,
            group: 1,
            written: 0,
            remus: false,
        }
    }

    #[test]
    fn a_packet_needs_its_version_acknowledged() {
        let mut a = ExitAudit::new();
        a.sent(&cp(1, 1, true, &[(1, Some(3))]), 1, false);
        assert!(!a.left(&exit(1, Some(3)), 1), "sent, not acked");
        a.acked(1, 1);
        assert!(a.left(&exit(1, Some(3)), 2));
        assert!(a.left(&exit(1, Some(2)), 2), "an older state is covered");
        assert!(!a.left(&exit(1, Some(4)), 2), "a newer state is not");
        assert!(!a.left(&exit(2, Some(0)), 2), "never shipped");
        assert_eq!(a.stats.checked, 5);
        assert_eq!(a.stats.violations, 3);
        assert_eq!(a.violations().count(), 3);
        assert_eq!(a.violations().next().unwrap().acked, None);
    }

    #[test]
    fn deleted_flows_wait_until_the_backup_forgot_them() {
        let mut a = ExitAudit::new();
        // Never shipped and gone: nothing replicated depends on it.
        assert!(a.left(&exit(1, None), 1));
        a.sent(&cp(1, 1, true, &[(1, Some(0))]), 1, false);
        assert!(!a.left(&exit(1, None), 1), "a copy is in flight");
        a.acked(1, 1);
        assert!(!a.left(&exit(1, None), 2), "the backup holds it");
        a.sent(&cp(1, 2, false, &[(1, None)]), 2, false);
        assert!(!a.left(&exit(1, None), 2), "deletion not acked");
        a.acked(1, 2);
        assert!(a.left(&exit(1, None), 3));
    }

    #[test]
    fn full_checkpoints_replace_and_acks_are_cumulative() {
        let mut a = ExitAudit::new();
        a.sent(&cp(1, 1, true, &[(1, Some(1)), (2, Some(1))]), 1, false);
        a.sent(&cp(1, 2, false, &[(1, Some(2))]), 2, false);
        a.acked(1, 2);
        assert!(a.left(&exit(1, Some(2)), 3));
        assert!(a.left(&exit(2, Some(1)), 3));
        // A full checkpoint without flow 2 drops it from the backup.
        a.sent(&cp(1, 3, true, &[(1, Some(2))]), 3, false);
        assert!(a.left(&exit(2, Some(1)), 3), "not applied yet");
        a.acked(1, 3);
        assert!(!a.left(&exit(2, Some(1)), 4));
        // An ack for a seq never sent is ignored.
        a.acked(1, 9);
        assert_eq!(a.stats.unknown_acks, 1);
        a.acked(7, 1);
        assert_eq!(a.stats.unknown_acks, 2);
    }

    #[test]
    fn a_backup_that_lost_state_or_died_protects_nothing() {
        let mut a = ExitAudit::new();
        a.sent(&cp(1, 1, true, &[(1, Some(1))]), 1, false);
        a.acked(1, 1);
        a.sent(&cp(1, 2, false, &[(1, Some(2))]), 2, false);
        // Reconnected backup holds seq 1: seq 2 was lost, seq 1's content stays.
        a.welcome(1, 1);
        assert!(a.left(&exit(1, Some(1)), 3));
        a.acked(1, 2);
        assert!(
            !a.left(&exit(1, Some(2)), 3),
            "seq 2 was lost, its ack is unknown"
        );
        // Restarted backup: holds nothing.
        a.welcome(1, 0);
        assert!(!a.left(&exit(1, Some(1)), 3));
        // Welcome ahead of the acks: acknowledged.
        a.sent(&cp(1, 3, true, &[(1, Some(5))]), 3, false);
        a.welcome(1, 3);
        assert!(a.left(&exit(1, Some(5)), 4));
        a.forget_group(1);
        assert!(!a.left(&exit(1, Some(5)), 4));
    }

    #[test]
    fn a_flow_acked_in_another_group_is_not_deleted_by_the_old_one() {
        let mut a = ExitAudit::new();
        a.sent(&cp(1, 1, true, &[(1, Some(1))]), 1, false);
        a.acked(1, 1);
        a.sent(&cp(2, 1, true, &[(1, Some(1))]), 2, false);
        a.acked(2, 1);
        a.sent(&cp(1, 2, false, &[(1, None)]), 3, false);
        a.acked(1, 2);
        assert!(a.left(&exit(1, Some(1)), 4), "group 2 still holds it");
    }

    #[test]
    fn remus_packets_wait_for_an_epoch_taken_after_them() {
        let mut a = ExitAudit::new();
        let e = |written| Exit {
            key: None,
            version: None,
            group: 1,
            written,
            remus: true,
        };
        a.sent(&cp(1, 1, true, &[]), 5, true);
        assert!(!a.left(&e(5), 5));
        a.acked(1, 1);
        assert!(a.left(&e(5), 6));
        assert!(a.left(&e(4), 6));
        assert!(!a.left(&e(6), 6));
        assert_eq!(a.stats.violations, 2);
    }

    /// Deterministic so a failure reproduces.
    use pliant_testkit::XorShift as Rng;

    /// Property: under random writes, checkpoints and cumulative acks, a packet released by a
    /// correct rule (its version carried by an acked checkpoint) is never a violation, and one
    /// released as soon as it is written while its version is not acked always is.
    #[test]
    fn random_histories_agree_with_a_model() {
        for seed in 1..=100u64 {
            let mut r = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
            let mut a = ExitAudit::new();
            let mut version = [0u64; 4];
            let mut sent_v: Vec<Vec<(u16, u64)>> = vec![Vec::new()];
            let mut acked_upto = 0usize;
            let mut model_acked = [None::<u64>; 4];
            let mut seq = 0u64;
            let mut expect_violations = 0u64;
            for round in 0..300u64 {
                match r.below(4) {
                    0 => {
                        let f = r.below(4) as usize;
                        version[f] += 1;
                    }
                    1 => {
                        seq += 1;
                        let flows: Vec<(u16, Option<u64>)> =
                            (0..4u16).map(|f| (f, Some(version[f as usize]))).collect();
                        a.sent(&cp(1, seq, false, &flows), round, false);
                        sent_v.push(flows.iter().map(|&(f, v)| (f, v.unwrap())).collect());
                    }
                    2 if (acked_upto as u64) < seq => {
                        let s = acked_upto as u64 + 1 + r.below(seq - acked_upto as u64);
                        for cpv in &sent_v[acked_upto + 1..=s as usize] {
                            for &(f, v) in cpv {
                                model_acked[f as usize] = Some(v);
                            }
                        }
                        acked_upto = s as usize;
                        a.acked(1, s);
                    }
                    _ => {
                        let f = r.below(4) as usize;
                        let ok = model_acked[f].is_some_and(|v| v >= version[f]);
                        if !ok {
                            expect_violations += 1;
                        }
                        assert_eq!(
                            a.left(&exit(f as u16, Some(version[f])), round),
                            ok,
                            "seed {seed} round {round}"
                        );
                    }
                }
            }
            assert_eq!(a.stats.violations, expect_violations, "seed {seed}");
        }
    }
}
