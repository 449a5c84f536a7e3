//! When a (re-)protection may start and which replicas it may name as backups: a pure
//! decision over what the controller knows, so the order of membership changes can be
//! property-tested without processes.
//!
//! The rules, each one a defect seen when they did not hold:
//! - a replica that is suspected (a peer reported its replication link to it dead, or it
//!   missed a heartbeat), being failed over, or gone is never named as a backup: a primary
//!   protected by a dead backup holds its output until that link times out, and its flows
//!   wait behind it;
//! - the periodic poll starts no protection while a failover runs (the failover re-protects
//!   the survivors itself, as its last step; a poll that interleaves with it protects twice,
//!   or with a member list taken before the failure);
//! - no second protection of the same replica starts while one is in flight, and a poll
//!   whose status was read before the replica's last protection started does not act on it
//!   (it describes the replica before that protection);
//! - a replica that is not live itself is not protected.
//!
//! Per replica the controller's view is a small state machine ([`Liveness`]) with named
//! transitions ([`Liveness::on`]); transitions that make no sense (a gone replica becoming
//! suspected) leave the state as it is.

use std::collections::{BTreeMap, BTreeSet};

/// What the controller believes of one replica.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Liveness {
    /// Answering, no evidence against it.
    Live,
    /// Evidence against it (a peer's link to it died, a missed heartbeat), not yet confirmed
    /// or cleared by a probe.
    Suspected,
    /// Its failover has started (fenced; its flows are being activated elsewhere).
    FailingOver,
    /// Failed over or left.
    Gone,
}

/// Evidence and actions that change a replica's [`Liveness`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Evidence {
    /// A peer's replication link to it died, or it missed a heartbeat.
    Suspect,
    /// A probe or heartbeat found it answering after the evidence.
    Answered,
    /// Its failover started.
    FailoverStarted,
    /// Its failover finished, or it left by scale-in.
    Removed,
}

impl Liveness {
    /// The named transitions.
    pub fn on(self, e: Evidence) -> Liveness {
        use Evidence::*;
        use Liveness::*;
        match (self, e) {
            (Live | Suspected, Suspect) => Suspected,
            (Suspected | Live, Answered) => Live,
            (Live | Suspected, FailoverStarted) => FailingOver,
            (_, Removed) => Gone,
            // A failover or a departure is final: late evidence does not revive it.
            (s @ (FailingOver | Gone), _) => s,
        }
    }
}

/// Who asks for a protection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Caller {
    /// The periodic status poll (a replica needs a backup, or was never protected).
    Poll,
    /// The last step of a failover, which holds the HA lock (re-protects the survivors).
    Failover,
    /// An operator's request through the API.
    Api,
}

/// What the decision looks at.
#[derive(Clone, Debug, Default)]
pub struct Facts {
    pub members: BTreeMap<u32, Liveness>,
    /// Replicas whose protection is in flight.
    pub protecting: BTreeSet<u32>,
    /// Replicas whose failover has started and not finished.
    pub failing_over: BTreeSet<u32>,
    /// Poll only: the replica's status was read before its last protection started.
    pub stale_status: bool,
}

/// Why a protection does not start now.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Defer {
    NotLive,
    FailoverRunning,
    ProtectionRunning,
    StaleStatus,
    /// A suspected member might be the one that died: wait until it is cleared or failed
    /// over rather than protect around it and move flows twice.
    SuspectMember,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Protect with a policy over these replicas (may be empty: unprotected, alone).
    Protect {
        backups: Vec<u32>,
    },
    Defer(Defer),
}

/// THE DECISION: may replica `r` be protected now by `caller`, and over which backups?
pub fn decide(f: &Facts, r: u32, caller: Caller) -> Decision {
    if f.members.get(&r) != Some(&Liveness::Live) {
        return Decision::Defer(Defer::NotLive);
    }
    if f.protecting.contains(&r) {
        return Decision::Defer(Defer::ProtectionRunning);
    }
    if caller != Caller::Failover && !f.failing_over.is_empty() {
        return Decision::Defer(Defer::FailoverRunning);
    }
    if caller == Caller::Poll {
        if f.stale_status {
            return Decision::Defer(Defer::StaleStatus);
        }
        if f.members.values().any(|l| *l == Liveness::Suspected) {
            return Decision::Defer(Defer::SuspectMember);
        }
    }
    let backups = f
        .members
        .iter()
        .filter(|(i, l)| **i != r && **l == Liveness::Live)
        .map(|(i, _)| *i)
        .collect();
    Decision::Protect { backups }
}

/// What the controller last learnt of one member's protection.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Cover {
    /// The replicas its state is protected to: its backups as its last `protect` answer named
    /// them (Pico, Remus), or the host of its FTMB logger. Empty: none.
    pub backups: Vec<u32>,
    /// Its last `ha_status` had a group that lost its backup (`needs_backup`).
    pub lost_backup: bool,
}

/// The members running unprotected (index order): serving (live or suspected, not failing
/// over or gone) yet with no backup, a backup that is no longer a member (failed over, gone,
/// leaving), or a group that reported its backup lost. With HA on each of these loses flows
/// if it dies, so the controller warns about them (status, `ha status`). A suspected backup
/// still counts: suspicion is not death, and warning on every missed heartbeat would flap.
pub fn unprotected(members: &BTreeMap<u32, Liveness>, cover: &BTreeMap<u32, Cover>) -> Vec<u32> {
    let serving = |i: &u32| matches!(members.get(i), Some(Liveness::Live | Liveness::Suspected));
    members
        .keys()
        .filter(|i| serving(i))
        .filter(|i| match cover.get(i) {
            None => true,
            Some(c) => {
                c.lost_backup
                    || c.backups.is_empty()
                    || c.backups.iter().any(|b| *b == **i || !serving(b))
            }
        })
        .copied()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(members: &[(u32, Liveness)]) -> Facts {
        Facts {
            members: members.iter().copied().collect(),
            ..Facts::default()
        }
    }

    #[test]
    fn transitions_by_name() {
        use Evidence::*;
        use Liveness::*;
        assert_eq!(Live.on(Suspect), Suspected);
        assert_eq!(Suspected.on(Answered), Live);
        assert_eq!(Suspected.on(FailoverStarted), FailingOver);
        assert_eq!(FailingOver.on(Answered), FailingOver, "no revival");
        assert_eq!(FailingOver.on(Suspect), FailingOver);
        assert_eq!(FailingOver.on(Removed), Gone);
        assert_eq!(Gone.on(Answered), Gone);
        assert_eq!(Gone.on(FailoverStarted), Gone);
    }

    #[test]
    fn case_by_case() {
        use Liveness::*;
        let mut f = facts(&[(1, Live), (2, Live), (3, Suspected), (4, FailingOver)]);
        assert_eq!(decide(&f, 3, Caller::Api), Decision::Defer(Defer::NotLive));
        f.failing_over.insert(4);
        assert_eq!(
            decide(&f, 1, Caller::Poll),
            Decision::Defer(Defer::FailoverRunning)
        );
        assert_eq!(
            decide(&f, 1, Caller::Failover),
            Decision::Protect { backups: vec![2] },
            "never the suspect or the failing replica"
        );
        f.failing_over.clear();
        assert_eq!(
            decide(&f, 1, Caller::Poll),
            Decision::Defer(Defer::SuspectMember)
        );
        f.members.insert(3, Live);
        f.protecting.insert(1);
        assert_eq!(
            decide(&f, 1, Caller::Api),
            Decision::Defer(Defer::ProtectionRunning)
        );
        f.protecting.clear();
        f.stale_status = true;
        assert_eq!(
            decide(&f, 1, Caller::Poll),
            Decision::Defer(Defer::StaleStatus)
        );
        assert_eq!(
            decide(&f, 1, Caller::Api),
            Decision::Protect {
                backups: vec![2, 3]
            }
        );
    }

    /// Deterministic so a failure reproduces.
    use pliant_testkit::XorShift as Rng;

    /// A simulated controller applying the decision to random interleavings of kills (the
    /// truth, unseen), link-death reports, probes, heartbeats, failovers started and finished
    /// (a kill can land during a failover or during a protection), polls and protections
    /// started and finished. Properties: (1) no protection is decided, by anyone, naming a
    /// replica whose death the controller had evidence of; (2) a poll never starts one while a
    /// failover runs, and no replica has two in flight; (3) once every kill is seen and
    /// failed over, the polls leave every live replica protected by live replicas only.
    #[test]
    fn random_event_orders_never_name_a_dead_backup() {
        for seed in 1..=500u64 {
            let mut r = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
            let n = 3 + r.below(3) as u32;
            let mut f = facts(&(1..=n).map(|i| (i, Liveness::Live)).collect::<Vec<_>>());
            let mut dead: BTreeSet<u32> = BTreeSet::new();
            // Replicas the controller had evidence against when they were already dead.
            let mut seen_dead: BTreeSet<u32> = BTreeSet::new();
            let mut protected: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
            // Protections in flight: (replica, backups).
            let mut in_flight: Vec<(u32, Vec<u32>)> = Vec::new();
            let mut stale: BTreeSet<u32> = BTreeSet::new();
            let start = |f: &mut Facts,
                         i: u32,
                         caller: Caller,
                         seen_dead: &BTreeSet<u32>,
                         in_flight: &mut Vec<(u32, Vec<u32>)>| {
                if let Decision::Protect { backups } = decide(f, i, caller) {
                    assert!(
                        backups.iter().all(|b| !seen_dead.contains(b)),
                        "seed {seed}: r{i} protected by {backups:?}, dead seen {seen_dead:?}"
                    );
                    assert!(
                        caller != Caller::Poll || f.failing_over.is_empty(),
                        "seed {seed}: a poll protected during a failover"
                    );
                    assert!(
                        f.protecting.insert(i),
                        "seed {seed}: two protections of r{i}"
                    );
                    in_flight.push((i, backups));
                }
            };
            for _ in 0..300 {
                let x = 1 + r.below(u64::from(n)) as u32;
                match r.below(9) {
                    0 if r.below(4) == 0 => {
                        dead.insert(x);
                    }
                    // A peer's link to x died (only if x is dead), or a heartbeat missed.
                    1 if dead.contains(&x) || r.below(5) == 0 => {
                        let l = f.members[&x].on(Evidence::Suspect);
                        f.members.insert(x, l);
                        if dead.contains(&x) {
                            seen_dead.insert(x);
                        }
                    }
                    // A probe: answered if alive; dead starts its failover.
                    2 => {
                        if dead.contains(&x) {
                            seen_dead.insert(x);
                            if matches!(f.members[&x], Liveness::Live | Liveness::Suspected) {
                                f.members
                                    .insert(x, f.members[&x].on(Evidence::FailoverStarted));
                                f.failing_over.insert(x);
                            }
                        } else {
                            f.members.insert(x, f.members[&x].on(Evidence::Answered));
                        }
                    }
                    // A failover finishes: its last step re-protects every live survivor.
                    3 if f.failing_over.contains(&x) => {
                        let live: Vec<u32> = f
                            .members
                            .iter()
                            .filter(|(_, l)| **l == Liveness::Live)
                            .map(|(i, _)| *i)
                            .collect();
                        for i in live {
                            start(&mut f, i, Caller::Failover, &seen_dead, &mut in_flight);
                        }
                        f.failing_over.remove(&x);
                        f.members.insert(x, Liveness::Gone);
                        protected.remove(&x);
                    }
                    // A protection answers (a dead primary's never does).
                    4 | 5 if !in_flight.is_empty() => {
                        let k = r.below(in_flight.len() as u64) as usize;
                        let (i, backups) = in_flight.remove(k);
                        f.protecting.remove(&i);
                        if !dead.contains(&i) {
                            protected.insert(i, backups);
                            stale.insert(i);
                        }
                    }
                    // A poll: the status was read now, or (stale) before the last protection.
                    _ => {
                        let needs = protected
                            .get(&x)
                            .is_none_or(|b| b.iter().any(|b| dead.contains(b)));
                        if needs {
                            f.stale_status = stale.remove(&x) && r.below(2) == 0;
                            start(&mut f, x, Caller::Poll, &seen_dead, &mut in_flight);
                            f.stale_status = false;
                        }
                    }
                }
            }
            // Quiesce: every kill is seen and failed over, every answer arrives, polls run.
            for x in dead.clone() {
                seen_dead.insert(x);
                if matches!(f.members[&x], Liveness::Live | Liveness::Suspected) {
                    f.members.insert(x, Liveness::FailingOver);
                    f.failing_over.insert(x);
                }
            }
            for x in f.failing_over.clone() {
                f.failing_over.remove(&x);
                f.members.insert(x, Liveness::Gone);
                protected.remove(&x);
            }
            for (i, backups) in in_flight.drain(..) {
                f.protecting.remove(&i);
                if !dead.contains(&i) {
                    protected.insert(i, backups);
                }
            }
            for l in f.members.values_mut() {
                if *l == Liveness::Suspected {
                    *l = Liveness::Live; // probes answer: the suspicion was wrong
                }
            }
            for _ in 0..2 {
                for x in 1..=n {
                    let needs = protected
                        .get(&x)
                        .is_none_or(|b| b.iter().any(|b| dead.contains(b)));
                    if needs && !dead.contains(&x) {
                        start(&mut f, x, Caller::Poll, &seen_dead, &mut in_flight);
                    }
                    for (i, backups) in in_flight.drain(..) {
                        f.protecting.remove(&i);
                        protected.insert(i, backups);
                    }
                }
            }
            for x in (1..=n).filter(|x| !dead.contains(x)) {
                let b = &protected[&x];
                assert!(
                    b.iter().all(|b| !dead.contains(b)),
                    "seed {seed}: r{x} left protected by {b:?}, dead {dead:?}"
                );
            }
        }
    }

    #[test]
    fn unprotected_members_are_those_without_a_serving_backup() {
        use Liveness::*;
        let members: BTreeMap<u32, Liveness> = [
            (1, Live),
            (2, Live),
            (3, Suspected),
            (4, Gone),
            (5, Live),
            (6, Live),
        ]
        .into_iter()
        .collect();
        let c = |backups: &[u32], lost_backup: bool| Cover {
            backups: backups.to_vec(),
            lost_backup,
        };
        let cover: BTreeMap<u32, Cover> = [
            (1, c(&[2, 3], false)), // a suspected backup is not a dead one
            (2, c(&[4], false)),    // its only backup failed over
            (3, c(&[], false)),     // alone when last protected
            (4, c(&[], false)),     // gone: not serving, not reported
            (5, c(&[1], true)),     // a group lost its backup
                                    // 6: never protected
        ]
        .into_iter()
        .collect();
        assert_eq!(unprotected(&members, &cover), vec![2, 3, 5, 6]);
        // A lone member is unprotected whatever it was protected to before.
        let alone: BTreeMap<u32, Liveness> = [(1, Live)].into_iter().collect();
        assert_eq!(unprotected(&alone, &cover), vec![1]);
        // Everyone covered by a serving other member: no warning.
        let pair: BTreeMap<u32, Liveness> = [(1, Live), (2, Live)].into_iter().collect();
        let both: BTreeMap<u32, Cover> = [(1, c(&[2], false)), (2, c(&[1], false))]
            .into_iter()
            .collect();
        assert!(unprotected(&pair, &both).is_empty());
    }
}
