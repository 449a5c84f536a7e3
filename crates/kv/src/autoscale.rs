//! The automatic loop: scale out and in from measured load with the chosen planner.
//!
//! Every interval the loop measures the cluster (the CPU of every host's redis-servers, masters
//! and replicas, against the hosts' quotas, [`crate::monitor::measure`]) and asks [`decide`], a
//! pure function, for a host count:
//!
//! - the load needs `need = ceil(load / (quota × target))` hosts, within `[floor, max_hosts]`
//!   where `floor = max(min_hosts, k + 1)` (a partition's copies sit on distinct hosts);
//! - **out** when the utilisation (load over the hosts' quota) is above `high` and `need` is
//!   more hosts than now — at once: a saturated cluster loses throughput every second. A
//!   saturated host cannot show more load than its quota, so measured utilisation near 1.0
//!   understates the demand; `need` then still grows the cluster by `high / target` at least,
//!   and the next rounds keep growing it while it stays saturated;
//! - **in** when the utilisation stayed below `low` for `in_after` consecutive rounds and
//!   `need` is fewer hosts than now — slowly: scaling in moves data and a dip may be noise;
//! - otherwise hold (and a round that is not low resets the streak).
//!
//! The same load never flips the decision: after scaling to `need`, the next round at that
//! load computes the same `need`, which is neither more nor fewer hosts than there are (tested
//! as a property, with `low < target < high`).

use crate::cluster::Kv;
use crate::monitor;
use crate::planning::Planner;
use crate::scale::{self, ScaleOpts};
use serde::Serialize;
use std::time::{Duration, Instant};

#[derive(Clone, Debug, PartialEq)]
pub struct AutoOpts {
    /// Scale out above this utilisation (load / quota of all hosts).
    pub high: f64,
    /// Scale in below this utilisation (for `in_after` rounds in a row).
    pub low: f64,
    /// The utilisation a scale aims at.
    pub target: f64,
    pub min_hosts: usize,
    pub max_hosts: usize,
    /// Low rounds in a row before a scale in.
    pub in_after: u32,
    /// One measurement window (a round).
    pub interval: Duration,
    /// Move copies without changing the host count when one host runs above `high` while the
    /// cluster as a whole does not ([`imbalanced`]): a hot partition's host sheds copies.
    pub rebalance: bool,
}

impl Default for AutoOpts {
    fn default() -> Self {
        AutoOpts {
            high: 0.8,
            low: 0.45,
            target: 0.65,
            min_hosts: 1,
            max_hosts: 8,
            in_after: 3,
            interval: Duration::from_secs(2),
            rebalance: true,
        }
    }
}

impl AutoOpts {
    /// The thresholds must leave a band between them that a scale lands in.
    pub fn validate(&self) -> Result<(), String> {
        if !(0.0 < self.low
            && self.low < self.target
            && self.target < self.high
            && self.high <= 1.0)
        {
            return Err(format!(
                "autoscale thresholds: need 0 < low ({}) < target ({}) < high ({}) <= 1",
                self.low, self.target, self.high
            ));
        }
        if self.min_hosts > self.max_hosts || self.max_hosts == 0 {
            return Err(format!(
                "autoscale hosts: need 1 <= min_hosts ({}) <= max_hosts ({})",
                self.min_hosts, self.max_hosts
            ));
        }
        if self.in_after == 0 || self.interval < Duration::from_millis(200) {
            return Err("autoscale: in_after >= 1 and an interval of at least 200 ms".into());
        }
        Ok(())
    }
}

/// What the loop does this round.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "action", content = "to", rename_all = "snake_case")]
pub enum Decision {
    Hold,
    Out(usize),
    In(usize),
    /// Plan again on the same hosts (this many): the load is badly spread.
    Rebalance(usize),
}

/// The decision for one round: `hosts` now, `load` (cores) measured, `quota` cores per host,
/// `k` replicas per partition, `low_streak` rounds below `low` before this one. Returns the
/// decision and the streak to carry into the next round.
pub fn decide(
    o: &AutoOpts,
    hosts: usize,
    load: f64,
    quota: f64,
    k: usize,
    low_streak: u32,
) -> (Decision, u32) {
    let floor = o.min_hosts.max(k + 1).min(o.max_hosts.max(k + 1));
    let ceil = o.max_hosts.max(floor);
    let load = if load.is_finite() { load.max(0.0) } else { 0.0 };
    let raw = (load / (quota * o.target)).ceil();
    let need = if raw.is_finite() {
        (raw as usize).clamp(floor, ceil)
    } else {
        ceil
    };
    let util = load / (quota * hosts.max(1) as f64);
    // Outside the bounds (a cluster made by hand, or bounds changed): straight to what the
    // load needs, which is inside them.
    if hosts < floor {
        return (Decision::Out(need), 0);
    }
    if hosts > ceil {
        return (Decision::In(need), 0);
    }
    if util > o.high && need > hosts {
        return (Decision::Out(need), 0);
    }
    if util < o.low {
        let streak = low_streak + 1;
        if streak >= o.in_after && need < hosts {
            return (Decision::In(need), 0);
        }
        return (Decision::Hold, streak);
    }
    (Decision::Hold, 0)
}

/// Whether a round that keeps the host count should move copies: some host above `high` of
/// its quota while the whole cluster is not (the capacity is there, the load is badly spread:
/// more hosts would not be needed), and at least `in_after` rounds since the last scale or
/// rebalance (the moves settle and the measurement shows their effect first).
pub fn imbalanced(o: &AutoOpts, host_cpus: &[f64], quota: f64, rounds_since_move: u32) -> bool {
    if !o.rebalance || host_cpus.is_empty() || quota <= 0.0 || rounds_since_move < o.in_after {
        return false;
    }
    let total: f64 = host_cpus.iter().map(|c| c.max(0.0)).sum();
    let hottest = host_cpus.iter().copied().fold(0.0f64, f64::max);
    hottest > o.high * quota && total <= o.high * quota * host_cpus.len() as f64
}

/// One round of the loop, for the event log (`pliant kv auto --json`) and benchmarks.
#[derive(Clone, Debug, Serialize)]
pub struct Round {
    /// Seconds since the loop started.
    pub t_s: f64,
    pub hosts: usize,
    pub load_cores: f64,
    pub utilisation: f64,
    pub ops_per_s: f64,
    pub decision: Decision,
    /// Copies moved and bytes they held (0 when holding).
    pub moves: usize,
    pub bytes_moved: u64,
    /// Seconds the scale took (0 when holding).
    pub scale_s: f64,
    pub error: Option<String>,
}

impl std::fmt::Display for Round {
    /// One line: time, hosts, load, throughput, decision, error.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:>7.1} s  {} hosts  load {:.2} cores ({:>3.0}%)  {:>8.0} ops/s  {:?}",
            self.t_s,
            self.hosts,
            self.load_cores,
            self.utilisation * 100.0,
            self.ops_per_s,
            self.decision
        )?;
        match &self.error {
            Some(e) => write!(f, "  error: {e}"),
            None => Ok(()),
        }
    }
}

/// What one scale did, for its round.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Scaled {
    pub moves: usize,
    pub bytes_moved: u64,
}

/// The scaler of the loop: takes the cluster to the given host count.
pub type Scaler<'a> =
    dyn FnMut(&mut Kv, usize, &mut dyn FnMut(&str)) -> Result<Scaled, String> + 'a;

/// A scale with `planner`: `scale::plan` then `scale::execute` (every step keeps k + 1 copies).
pub fn plan_and_execute(
    kv: &mut Kv,
    to: usize,
    planner: Planner,
    progress: &mut dyn FnMut(&str),
) -> Result<Scaled, String> {
    let so = ScaleOpts {
        target: to,
        planner,
        window: Duration::from_millis(500),
        parallel: crate::moves::PARALLEL,
    };
    let p = scale::plan(kv, &so)?;
    progress(&format!("plan: {}", p.summary()));
    let done = scale::execute(kv, &p, progress)?;
    Ok(Scaled {
        moves: done.len(),
        bytes_moved: p.bytes_moved,
    })
}

/// Runs the loop for `duration` (or until `stop` says so), reporting every round to
/// `on_round` and every move to `progress`. A failed scale is reported in its round and the
/// loop goes on: every step of a scale keeps k + 1 copies, so a half-done plan is a valid
/// cluster and the next round plans from there.
pub fn run(
    kv: &mut Kv,
    o: &AutoOpts,
    planner: Planner,
    duration: Duration,
    stop: &dyn Fn() -> bool,
    on_round: &mut dyn FnMut(&Round),
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<Round>, String> {
    let mut scaler = |kv: &mut Kv, to: usize, progress: &mut dyn FnMut(&str)| {
        plan_and_execute(kv, to, planner, progress)
    };
    run_with(kv, o, duration, stop, on_round, progress, &mut scaler)
}

/// [`run`] with any scaler: the same measurements and decisions, another way of moving data
/// (benchmarks drive a peer's tool with it).
pub fn run_with(
    kv: &mut Kv,
    o: &AutoOpts,
    duration: Duration,
    stop: &dyn Fn() -> bool,
    on_round: &mut dyn FnMut(&Round),
    progress: &mut dyn FnMut(&str),
    scaler: &mut Scaler<'_>,
) -> Result<Vec<Round>, String> {
    o.validate()?;
    let quota = f64::from(kv.state.cpu_quota_pct) / 100.0;
    let t0 = Instant::now();
    let mut streak = 0;
    let mut since_move = 0u32;
    let mut rounds = Vec::new();
    while t0.elapsed() < duration && !stop() {
        let snap = monitor::measure(&kv.state, kv.password(), o.interval);
        // Every process of every host counts (replicas apply each write too): the quota
        // limits all of them.
        let load: f64 = snap.hosts.iter().map(|h| h.cpu).sum();
        let ops: f64 = snap.partitions.iter().map(|p| p.ops_per_s).sum();
        let hosts = kv.state.hosts.len();
        let (mut d, s) = decide(o, hosts, load, quota, kv.state.k, streak);
        streak = s;
        let cpus: Vec<f64> = snap.hosts.iter().map(|h| h.cpu).collect();
        if d == Decision::Hold && imbalanced(o, &cpus, quota, since_move) {
            d = Decision::Rebalance(hosts);
        }
        since_move = if d == Decision::Hold {
            since_move.saturating_add(1)
        } else {
            0
        };
        let mut r = Round {
            t_s: t0.elapsed().as_secs_f64(),
            hosts,
            load_cores: load,
            utilisation: load / (quota * hosts.max(1) as f64),
            ops_per_s: ops,
            decision: d,
            moves: 0,
            bytes_moved: 0,
            scale_s: 0.0,
            error: None,
        };
        if let Decision::Out(to) | Decision::In(to) | Decision::Rebalance(to) = d {
            if matches!(d, Decision::Rebalance(_)) {
                progress(&format!(
                    "hottest host at {:.0}% of its quota, {:.0}% on average: rebalance on {to} \
                     hosts",
                    cpus.iter().copied().fold(0.0f64, f64::max) / quota * 100.0,
                    r.utilisation * 100.0
                ));
            } else {
                progress(&format!(
                    "load {load:.2} cores on {hosts} hosts ({:.0}% of quota): scale to {to}",
                    r.utilisation * 100.0
                ));
            }
            let ts = Instant::now();
            match scaler(kv, to, progress) {
                Ok(done) => {
                    r.moves = done.moves;
                    r.bytes_moved = done.bytes_moved;
                }
                Err(e) => r.error = Some(e),
            }
            r.scale_s = ts.elapsed().as_secs_f64();
            if let Some(e) = &r.error {
                progress(&format!(
                    "scale to {to} failed (next round plans again): {e}"
                ));
            }
        }
        on_round(&r);
        rounds.push(r);
    }
    Ok(rounds)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn o() -> AutoOpts {
        AutoOpts {
            max_hosts: 6,
            ..AutoOpts::default()
        }
    }

    #[test]
    fn saturated_clusters_grow_idle_ones_shrink_after_a_streak_and_bounds_hold() {
        let o = o();
        // 3 hosts of 0.5 core, all busy: out, by high/target at least.
        assert_eq!(decide(&o, 3, 1.5, 0.5, 1, 0), (Decision::Out(5), 0));
        // Busy but inside the band: hold.
        assert_eq!(decide(&o, 3, 1.0, 0.5, 1, 2), (Decision::Hold, 0));
        // Idle: in only on the in_after-th low round, to what the load needs (>= k + 1).
        assert_eq!(decide(&o, 4, 0.1, 0.5, 1, 0), (Decision::Hold, 1));
        assert_eq!(decide(&o, 4, 0.1, 0.5, 1, 1), (Decision::Hold, 2));
        assert_eq!(decide(&o, 4, 0.1, 0.5, 1, 2), (Decision::In(2), 0));
        // Never below k + 1 hosts, never above max.
        assert_eq!(decide(&o, 3, 0.0, 0.5, 2, 5), (Decision::Hold, 6));
        assert_eq!(decide(&o, 6, 3.0, 0.5, 1, 0), (Decision::Hold, 0));
        assert_eq!(decide(&o, 8, 3.0, 0.5, 1, 0), (Decision::In(6), 0));
        assert_eq!(decide(&o, 8, 0.6, 0.5, 1, 0), (Decision::In(2), 0));
        assert_eq!(decide(&o, 1, 0.0, 0.5, 1, 0), (Decision::Out(2), 0));
        // Garbage measurements do not panic or scale wildly.
        assert_eq!(decide(&o, 3, f64::NAN, 0.5, 1, 0).0, Decision::Hold);
    }

    #[test]
    fn a_hot_host_on_a_cluster_with_room_rebalances_an_overloaded_or_settling_one_does_not() {
        let o = o();
        let q = 1.0;
        // One host at 95 %, the cluster at 55 %: rebalance (once the last moves settled).
        assert!(imbalanced(&o, &[0.95, 0.3, 0.4], q, o.in_after));
        assert!(!imbalanced(&o, &[0.95, 0.3, 0.4], q, o.in_after - 1));
        // Every host busy: more hosts, not moves, are the answer (decide's business).
        assert!(!imbalanced(&o, &[0.95, 0.9, 0.85], q, 10));
        // Nobody above `high`.
        assert!(!imbalanced(&o, &[0.79, 0.2, 0.2], q, 10));
        assert!(!imbalanced(
            &AutoOpts {
                rebalance: false,
                ..o.clone()
            },
            &[0.95, 0.3],
            q,
            10
        ));
        assert!(!imbalanced(&o, &[], q, 10));
    }

    #[test]
    fn thresholds_are_checked() {
        assert!(AutoOpts::default().validate().is_ok());
        let bad = AutoOpts {
            low: 0.7,
            ..AutoOpts::default()
        };
        assert!(bad.validate().unwrap_err().contains("low"));
        let bad = AutoOpts {
            min_hosts: 9,
            ..AutoOpts::default()
        };
        assert!(bad.validate().unwrap_err().contains("min_hosts"));
    }

    /// Seeded: for random opts, host counts, loads and streaks, the decision stays within
    /// bounds, scales out only when busy and in only after a low streak, and the same load
    /// after the scale is a hold (no flapping).
    #[test]
    fn decisions_stay_in_bounds_and_never_flap_at_a_steady_load() {
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        for _ in 0..20_000 {
            let low = 0.2 + next(30) as f64 / 100.0; // 0.20..0.49
            let target = low + 0.05 + next(20) as f64 / 100.0;
            let high = (target + 0.05 + next(20) as f64 / 100.0).min(1.0);
            let max_hosts = 1 + next(10) as usize;
            let o = AutoOpts {
                high,
                low,
                target,
                min_hosts: 1 + next(max_hosts as u64) as usize,
                max_hosts,
                in_after: 1 + next(4) as u32,
                interval: Duration::from_secs(1),
                rebalance: true,
            };
            assert!(o.validate().is_ok(), "{o:?}");
            let k = next(3) as usize;
            let quota = 0.25 + next(8) as f64 / 4.0;
            let hosts = 1 + next(12) as usize;
            let load = next(4000) as f64 / 1000.0 * hosts as f64 * quota / 3.0;
            let streak = next(5) as u32;
            let floor = o.min_hosts.max(k + 1).min(o.max_hosts.max(k + 1));
            let ceil = o.max_hosts.max(floor);
            let util = load / (quota * hosts as f64);
            let (d, s) = decide(&o, hosts, load, quota, k, streak);
            match d {
                Decision::Out(n) => {
                    assert!(n > hosts && n <= ceil, "{d:?} {hosts} {o:?}");
                    assert!(hosts < floor || util > o.high, "out when not busy: {util}");
                }
                Decision::In(n) => {
                    assert!(n < hosts && n >= floor, "{d:?} {hosts} {o:?}");
                    assert!(hosts > ceil || streak + 1 >= o.in_after && util < o.low);
                }
                Decision::Hold => assert!(s <= streak + 1),
                Decision::Rebalance(_) => panic!("decide never rebalances (imbalanced does)"),
            }
            if let Decision::Out(n) | Decision::In(n) = d {
                // The same load on the new host count: nothing more to do.
                let (again, _) = decide(&o, n, load, quota, k, o.in_after);
                assert_eq!(
                    again,
                    Decision::Hold,
                    "flaps: {d:?} then {again:?}, {o:?} load {load}"
                );
            }
        }
    }
}
