//! Elasticity policy: pure decisions over a load snapshot, so every rule is unit-testable and
//! deterministic (same snapshot + policy -> same decision, ties broken by replica index).
//!
//! Order of precedence in [`decide`]: scale out (average load above the high-water mark) beats
//! scale in (average below the low-water mark, and merging one replica would not push the
//! survivors over the high-water mark: hysteresis), which beats hotspot rebalancing (move flows
//! from the hottest to the coldest replicas until the spread is within `imbalance_flows`).
//!
//! High availability sets a floor under scale-in: a protected primary needs its backup (or
//! FTMB logger) on another replica, so with HA on the policy never merges below
//! `ha::ha_min_replicas` replicas whatever `min_replicas` says ([`Policy::floor`]), and
//! [`Policy::check`] refuses a `min_replicas` below it.

use serde::{Deserialize, Serialize};

/// Thresholds (`pliant policy show|set k=v`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Policy {
    /// Run the policy loop automatically (false: only explicit API/CLI actions).
    pub auto: bool,
    /// Scale out when the replicas hold more than this many flows each on average.
    pub high_water_flows: u64,
    /// Scale in when the average flows per replica drops below this.
    pub low_water_flows: u64,
    /// Scale out when the replicas receive more packets per second than this each on average
    /// (0 = off).
    pub high_water_pps: u64,
    /// Never scale in below this many replicas (raised to the HA floor when HA is on).
    pub min_replicas: u32,
    pub max_replicas: u32,
    /// Rebalance hotspots automatically.
    pub rebalance: bool,
    /// Tolerated flow-count spread between the hottest and coldest replica.
    pub imbalance_flows: u64,
    /// Quiet time after any action before the next (lets load and steering settle).
    pub cooldown_ms: u64,
    /// Flows moved per migration batch at most.
    pub max_batch: u64,
}

impl Default for Policy {
    fn default() -> Self {
        // The seed's burst experiment: split above 60 flows per replica, merge below 40.
        Policy {
            auto: true,
            high_water_flows: 60,
            low_water_flows: 40,
            high_water_pps: 0,
            min_replicas: 1,
            max_replicas: 8,
            rebalance: true,
            imbalance_flows: 1,
            cooldown_ms: 1000,
            max_batch: 1000,
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PolicyError {
    #[error("unknown policy key {0:?} (known: {KNOWN})")]
    UnknownKey(String),
    #[error("policy {key}={value:?}: {reason}")]
    BadValue {
        key: String,
        value: String,
        reason: String,
    },
    #[error("inconsistent policy: {0}")]
    Inconsistent(String),
}

const KNOWN: &str = "auto, high_water_flows, low_water_flows, high_water_pps, min_replicas, \
max_replicas, rebalance, imbalance_flows, cooldown_ms, max_batch";

impl Policy {
    /// Applies one `key=value` assignment (validated as a whole afterwards by [`check`]).
    ///
    /// [`check`]: Policy::check
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), PolicyError> {
        let bad = |reason: &str| PolicyError::BadValue {
            key: key.to_string(),
            value: value.chars().take(40).collect(),
            reason: reason.to_string(),
        };
        let num = || {
            value
                .trim()
                .parse::<u64>()
                .map_err(|_| bad("not a non-negative integer"))
        };
        let boolean = || match value.trim() {
            "true" | "on" | "1" | "yes" => Ok(true),
            "false" | "off" | "0" | "no" => Ok(false),
            _ => Err(bad("not a boolean (true/false)")),
        };
        let small = |v: u64| u32::try_from(v).map_err(|_| bad("too large"));
        match key {
            "auto" => self.auto = boolean()?,
            "high_water_flows" => self.high_water_flows = num()?,
            "low_water_flows" => self.low_water_flows = num()?,
            "high_water_pps" => self.high_water_pps = num()?,
            "min_replicas" => self.min_replicas = small(num()?)?,
            "max_replicas" => self.max_replicas = small(num()?)?,
            "rebalance" => self.rebalance = boolean()?,
            "imbalance_flows" => self.imbalance_flows = num()?,
            "cooldown_ms" => self.cooldown_ms = num()?,
            "max_batch" => self.max_batch = num()?,
            other => return Err(PolicyError::UnknownKey(other.chars().take(40).collect())),
        }
        Ok(())
    }

    /// Whether the policy is consistent, with `ha_floor` the fewest replicas HA protection
    /// needs (`ha::ha_min_replicas`; 1 with HA off). A `min_replicas` or `max_replicas` below
    /// the floor is refused rather than silently raised: it says the operator expects the
    /// policy to go where HA cannot follow.
    pub fn check(&self, ha_floor: u32) -> Result<(), PolicyError> {
        let inc = |m: &str| Err(PolicyError::Inconsistent(m.to_string()));
        if self.min_replicas == 0 {
            return inc("min_replicas must be >= 1");
        }
        if self.max_replicas < ha_floor {
            return Err(PolicyError::Inconsistent(format!(
                "max_replicas = {} is below {ha_floor}, the fewest replicas HA needs (every \
                 primary needs its backup or logger on another replica)",
                self.max_replicas
            )));
        }
        if self.max_replicas < self.min_replicas {
            return inc("max_replicas < min_replicas");
        }
        if self.min_replicas < ha_floor {
            return Err(PolicyError::Inconsistent(format!(
                "min_replicas = {} is below {ha_floor}, the fewest replicas HA needs (every \
                 primary needs its backup or logger on another replica); set min_replicas >= \
                 {ha_floor} or turn HA off",
                self.min_replicas
            )));
        }
        if self.max_replicas > 63 {
            return inc("max_replicas > 63 (steering has 64 replica slots)");
        }
        if self.high_water_flows == 0 {
            return inc("high_water_flows must be >= 1");
        }
        if self.low_water_flows >= self.high_water_flows {
            return inc("low_water_flows must be below high_water_flows");
        }
        if self.max_batch == 0 {
            return inc("max_batch must be >= 1");
        }
        Ok(())
    }

    /// The fewest replicas the policy may leave: `min_replicas`, raised to the HA floor
    /// (`ha_floor`, 1 with HA off). [`decide`] uses this, so a stored policy from before HA
    /// was turned on cannot take the replicas below what protection needs either.
    pub fn floor(&self, ha_floor: u32) -> u32 {
        self.min_replicas.max(ha_floor).max(1)
    }
}

/// One replica's load as the heartbeat last saw it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaLoad {
    pub index: u32,
    pub flows: u64,
    pub pps: u64,
}

/// A planned flow move: `count` flows from `from` to `to`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Move {
    pub from: u32,
    pub to: u32,
    pub count: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum Decision {
    Nothing,
    ScaleOut {
        reason: String,
    },
    /// Merge `victim`'s flows into the survivors (`moves`), then destroy it.
    ScaleIn {
        victim: u32,
        moves: Vec<Move>,
    },
    Rebalance {
        moves: Vec<Move>,
    },
}

/// Plans moves that even out `loads` (flow counts) as far as integer division allows, moving
/// from the most loaded to the least loaded; ties by replica index. At most `max_batch` flows
/// per move.
pub fn plan_even(loads: &[ReplicaLoad], max_batch: u64) -> Vec<Move> {
    if loads.len() < 2 {
        return Vec::new();
    }
    let mut v: Vec<(u32, u64)> = loads.iter().map(|l| (l.index, l.flows)).collect();
    v.sort_by_key(|&(i, _)| i);
    let n = v.len() as u64;
    let total: u64 = v.iter().map(|&(_, f)| f).sum();
    let (base, extra) = (total / n, total % n);
    // Targets: the `extra` replicas that already hold the most keep one more (fewest moves).
    let mut order: Vec<usize> = (0..v.len()).collect();
    order.sort_by(|&a, &b| v[b].1.cmp(&v[a].1).then(v[a].0.cmp(&v[b].0)));
    let mut target = vec![base; v.len()];
    for &i in order.iter().take(extra as usize) {
        target[i] += 1;
    }
    let mut surplus: Vec<(u32, u64)> = Vec::new();
    let mut deficit: Vec<(u32, u64)> = Vec::new();
    for (i, &(idx, f)) in v.iter().enumerate() {
        if f > target[i] {
            surplus.push((idx, f - target[i]));
        } else if f < target[i] {
            deficit.push((idx, target[i] - f));
        }
    }
    // Hottest first, coldest first.
    surplus.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    deficit.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut moves = Vec::new();
    let (mut si, mut di) = (0, 0);
    while si < surplus.len() && di < deficit.len() {
        let c = surplus[si].1.min(deficit[di].1).min(max_batch.max(1));
        moves.push(Move {
            from: surplus[si].0,
            to: deficit[di].0,
            count: c,
        });
        surplus[si].1 -= c;
        deficit[di].1 -= c;
        if surplus[si].1 == 0 {
            si += 1;
        }
        if deficit[di].1 == 0 {
            di += 1;
        }
    }
    moves
}

/// Plans moving all of `victim`'s flows into `survivors`, least loaded first, keeping the
/// survivors as even as possible.
pub fn plan_merge(victim: &ReplicaLoad, survivors: &[ReplicaLoad], max_batch: u64) -> Vec<Move> {
    let mut s: Vec<(u32, u64)> = survivors.iter().map(|l| (l.index, l.flows)).collect();
    if s.is_empty() {
        return Vec::new();
    }
    let mut give: Vec<u64> = vec![0; s.len()];
    for _ in 0..victim.flows {
        // Water-filling one flow at a time: O(flows x replicas), both small and bounded.
        let (k, _) = s
            .iter()
            .enumerate()
            .min_by(|a, b| (a.1 .1, a.1 .0).cmp(&(b.1 .1, b.1 .0)))
            .map(|(k, x)| (k, *x))
            .unwrap_or((0, (0, 0)));
        s[k].1 += 1;
        give[k] += 1;
    }
    let mut moves = Vec::new();
    for (k, &(idx, _)) in s.iter().enumerate() {
        let mut left = give[k];
        while left > 0 {
            let c = left.min(max_batch.max(1));
            moves.push(Move {
                from: victim.index,
                to: idx,
                count: c,
            });
            left -= c;
        }
    }
    moves
}

/// The decision for this snapshot. `ha_floor` is the fewest replicas HA protection needs
/// (`ha::ha_min_replicas`; 1 with HA off): never scaled in below, whatever `min_replicas`
/// says. `since_last_action_ms` is the time since the controller last changed the replica
/// set or moved flows (None: never).
pub fn decide(
    p: &Policy,
    ha_floor: u32,
    loads: &[ReplicaLoad],
    since_last_action_ms: Option<u64>,
) -> Decision {
    if loads.is_empty() {
        return Decision::Nothing;
    }
    if since_last_action_ms.is_some_and(|t| t < p.cooldown_ms) {
        return Decision::Nothing;
    }
    let n = loads.len() as u64;
    let total: u64 = loads.iter().map(|l| l.flows).sum();
    // Scale out: the average load is over a high-water mark (the replicas together lack
    // capacity), and there is room for one more. One hot replica among cool ones is a hotspot
    // for rebalancing below, not a reason to add a replica.
    let total_pps: u64 = loads.iter().map(|l| l.pps).sum();
    if (n as u32) < p.max_replicas {
        if total > p.high_water_flows * n {
            return Decision::ScaleOut {
                reason: format!(
                    "{total} flows on {n} replica(s) > high_water_flows {} per replica",
                    p.high_water_flows
                ),
            };
        }
        if p.high_water_pps > 0 && total_pps > p.high_water_pps * n {
            return Decision::ScaleOut {
                reason: format!(
                    "{total_pps} pps on {n} replica(s) > high_water_pps {} per replica",
                    p.high_water_pps
                ),
            };
        }
    }
    // Scale in: average under the low-water mark, and the survivors would stay under the
    // high-water mark (otherwise the next tick would scale straight back out).
    if n as u32 > p.floor(ha_floor) && n >= 2 && total < p.low_water_flows * n {
        let survivors_avg_ceil = total.div_ceil(n - 1);
        if survivors_avg_ceil <= p.high_water_flows {
            // Victim: fewest flows (cheapest to merge); ties to the highest index, so the
            // original replicas are the last to go.
            let victim = loads
                .iter()
                .min_by(|a, b| a.flows.cmp(&b.flows).then(b.index.cmp(&a.index)))
                .cloned();
            if let Some(v) = victim {
                let survivors: Vec<ReplicaLoad> = loads
                    .iter()
                    .filter(|l| l.index != v.index)
                    .cloned()
                    .collect();
                return Decision::ScaleIn {
                    moves: plan_merge(&v, &survivors, p.max_batch),
                    victim: v.index,
                };
            }
        }
    }
    if p.rebalance && n >= 2 {
        let max = loads.iter().map(|l| l.flows).max().unwrap_or(0);
        let min = loads.iter().map(|l| l.flows).min().unwrap_or(0);
        if max - min > p.imbalance_flows {
            let moves = plan_even(loads, p.max_batch);
            if !moves.is_empty() {
                return Decision::Rebalance { moves };
            }
        }
    }
    Decision::Nothing
}

#[cfg(test)]
mod tests {
    use super::*;

    fn l(index: u32, flows: u64) -> ReplicaLoad {
        ReplicaLoad {
            index,
            flows,
            pps: 0,
        }
    }

    fn p() -> Policy {
        Policy {
            high_water_flows: 100,
            low_water_flows: 40,
            max_replicas: 4,
            cooldown_ms: 0,
            ..Policy::default()
        }
    }

    #[test]
    fn scale_out_above_high_water_only() {
        assert_eq!(decide(&p(), 1, &[l(1, 100)], None), Decision::Nothing);
        assert!(matches!(
            decide(&p(), 1, &[l(1, 101)], None),
            Decision::ScaleOut { .. }
        ));
        // At max_replicas: no scale-out, rebalance instead.
        let full = [l(1, 200), l(2, 101), l(3, 101), l(4, 101)];
        assert!(matches!(
            decide(&p(), 1, &full, None),
            Decision::Rebalance { .. }
        ));
        // One hot replica while the average is fine: a hotspot, rebalanced, no new replica.
        assert!(matches!(
            decide(&p(), 1, &[l(1, 150), l(2, 10)], None),
            Decision::Rebalance { .. }
        ));
    }

    #[test]
    fn scale_out_on_pps_when_configured() {
        let mut pol = p();
        let hot = ReplicaLoad {
            index: 1,
            flows: 3,
            pps: 50_000,
        };
        assert_eq!(
            decide(&pol, 1, std::slice::from_ref(&hot), None),
            Decision::Nothing
        );
        pol.high_water_pps = 10_000;
        assert!(matches!(
            decide(&pol, 1, &[hot], None),
            Decision::ScaleOut { .. }
        ));
    }

    #[test]
    fn hotspot_after_scale_out_rebalances_to_even_split() {
        // The seed's hotspot: 100 flows on r1, the new replica got 1.
        let d = decide(&p(), 1, &[l(1, 100), l(2, 1)], None);
        assert_eq!(
            d,
            Decision::Rebalance {
                moves: vec![Move {
                    from: 1,
                    to: 2,
                    count: 49
                }]
            }
        );
        // After the move: 51/50 is within the tolerance.
        assert_eq!(
            decide(&p(), 1, &[l(1, 51), l(2, 50)], None),
            Decision::Nothing
        );
    }

    #[test]
    fn scale_in_below_low_water_merges_the_emptiest() {
        let d = decide(&p(), 1, &[l(1, 30), l(2, 10), l(3, 20)], None);
        assert_eq!(
            d,
            Decision::ScaleIn {
                victim: 2,
                // Water-filling: r3 (20) is topped up to r1's 30 first.
                moves: vec![Move {
                    from: 2,
                    to: 3,
                    count: 10
                }]
            }
        );
        let d = decide(&p(), 1, &[l(1, 10), l(2, 10), l(3, 10)], None);
        assert_eq!(
            d,
            Decision::ScaleIn {
                victim: 3,
                moves: vec![
                    Move {
                        from: 3,
                        to: 1,
                        count: 5
                    },
                    Move {
                        from: 3,
                        to: 2,
                        count: 5
                    }
                ]
            }
        );
        // Never below min_replicas.
        assert_eq!(decide(&p(), 1, &[l(1, 0)], None), Decision::Nothing);
    }

    #[test]
    fn scale_in_has_hysteresis() {
        // Average 39 < 40, but merging two replicas of 39 gives 78 <= 100: allowed.
        assert!(matches!(
            decide(&p(), 1, &[l(1, 39), l(2, 39)], None),
            Decision::ScaleIn { .. }
        ));
        // With a high-water mark of 60, merging would overflow the survivor: refused.
        let mut pol = p();
        pol.high_water_flows = 60;
        assert_eq!(
            decide(&pol, 1, &[l(1, 39), l(2, 39)], None),
            Decision::Nothing
        );
    }

    #[test]
    fn cooldown_suppresses_actions() {
        let mut pol = p();
        pol.cooldown_ms = 1000;
        assert_eq!(decide(&pol, 1, &[l(1, 500)], Some(999)), Decision::Nothing);
        assert!(matches!(
            decide(&pol, 1, &[l(1, 500)], Some(1000)),
            Decision::ScaleOut { .. }
        ));
    }

    #[test]
    fn plan_even_is_even_and_conserves_flows() {
        let loads = [l(1, 10), l(2, 0), l(3, 0), l(4, 1)];
        let moves = plan_even(&loads, 1000);
        let mut f: std::collections::BTreeMap<u32, i64> =
            loads.iter().map(|x| (x.index, x.flows as i64)).collect();
        for m in &moves {
            *f.get_mut(&m.from).unwrap() -= m.count as i64;
            *f.get_mut(&m.to).unwrap() += m.count as i64;
        }
        let vals: Vec<i64> = f.values().copied().collect();
        assert_eq!(vals.iter().sum::<i64>(), 11);
        assert!(
            vals.iter().max().unwrap() - vals.iter().min().unwrap() <= 1,
            "{vals:?}"
        );
        // Deterministic.
        assert_eq!(moves, plan_even(&loads, 1000));
        // Batches are bounded.
        assert!(plan_even(&[l(1, 10), l(2, 0)], 2)
            .iter()
            .all(|m| m.count <= 2));
    }

    #[test]
    fn policy_set_validates() {
        let mut pol = Policy::default();
        pol.set("high_water_flows", "100").unwrap();
        pol.set("auto", "off").unwrap();
        assert_eq!(pol.high_water_flows, 100);
        assert!(!pol.auto);
        assert!(matches!(
            pol.set("nope", "1"),
            Err(PolicyError::UnknownKey(_))
        ));
        assert!(matches!(
            pol.set("max_batch", "-3"),
            Err(PolicyError::BadValue { .. })
        ));
        assert!(matches!(
            pol.set("auto", "maybe"),
            Err(PolicyError::BadValue { .. })
        ));
        pol.set("low_water_flows", "100").unwrap();
        assert!(pol.check(1).is_err());
        pol.set("low_water_flows", "10").unwrap();
        assert!(pol.check(1).is_ok());
    }

    #[test]
    fn the_ha_floor_stops_scale_in_where_min_replicas_alone_would_not() {
        // Idle: with min_replicas = 1 and HA off the policy merges down to one replica.
        let idle2 = [l(1, 0), l(2, 0)];
        assert!(matches!(
            decide(&p(), 1, &idle2, None),
            Decision::ScaleIn { .. }
        ));
        // With an HA floor of 2 the same snapshot is left alone...
        assert_eq!(decide(&p(), 2, &idle2, None), Decision::Nothing);
        // ...but a third replica above the floor may still go.
        assert!(matches!(
            decide(&p(), 2, &[l(1, 0), l(2, 0), l(3, 0)], None),
            Decision::ScaleIn { victim: 3, .. }
        ));
        // A higher min_replicas still wins over a lower floor.
        let pol = Policy {
            min_replicas: 3,
            ..p()
        };
        assert_eq!(pol.floor(2), 3);
        assert_eq!(
            decide(&pol, 2, &[l(1, 0), l(2, 0), l(3, 0)], None),
            Decision::Nothing
        );
    }

    /// Property: for any snapshot, policy and floor, a scale-in leaves at least
    /// `max(min_replicas, ha_floor)` replicas.
    #[test]
    fn no_snapshot_scales_in_below_the_floor() {
        use pliant_testkit::XorShift as Rng;
        let (mut scale_ins, mut to_the_floor, mut held_by_ha) = (0, 0, 0);
        for seed in 1..=20_000u64 {
            let mut r = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
            let high = 1 + r.below(200);
            let pol = Policy {
                auto: true,
                high_water_flows: high,
                low_water_flows: r.below(high),
                high_water_pps: r.below(3) * 1000,
                min_replicas: 1 + r.below(4) as u32,
                max_replicas: 4 + r.below(6) as u32,
                rebalance: r.below(2) == 0,
                imbalance_flows: r.below(5),
                cooldown_ms: 0,
                max_batch: 1 + r.below(50),
            };
            let ha_floor = 1 + r.below(3) as u32;
            let n = 1 + r.below(8) as u32;
            let loads: Vec<ReplicaLoad> = (1..=n)
                .map(|i| ReplicaLoad {
                    index: i,
                    flows: r.below(2 * high),
                    pps: r.below(5000),
                })
                .collect();
            let d = decide(&pol, ha_floor, &loads, None);
            let floor = pol.min_replicas.max(ha_floor);
            if !matches!(d, Decision::ScaleIn { .. })
                && matches!(decide(&pol, 1, &loads, None), Decision::ScaleIn { .. })
            {
                held_by_ha += 1;
            }
            if let Decision::ScaleIn { victim, moves } = d {
                scale_ins += 1;
                if n - 1 == floor {
                    to_the_floor += 1;
                }
                assert!(
                    n > floor,
                    "seed {seed}: {n} -> {} replicas, floor {floor} (min_replicas {}, HA {ha_floor})",
                    n - 1,
                    pol.min_replicas
                );
                assert!(moves.iter().all(|m| m.from == victim && m.to != victim));
            }
        }
        // The property is not vacuous: many snapshots did scale in, some down to the floor
        // exactly, and the HA floor (not min_replicas) stopped others.
        assert!(scale_ins > 200, "{scale_ins}");
        assert!(to_the_floor > 20, "{to_the_floor}");
        assert!(held_by_ha > 20, "{held_by_ha}");
    }

    #[test]
    fn check_refuses_min_replicas_below_the_ha_floor_naming_both() {
        let pol = Policy::default();
        assert_eq!(pol.check(1), Ok(()));
        let e = pol.check(2).unwrap_err().to_string();
        assert!(
            e.contains("min_replicas = 1") && e.contains("below 2"),
            "{e}"
        );
        let pol = Policy {
            min_replicas: 2,
            ..Policy::default()
        };
        assert_eq!(pol.check(2), Ok(()));
        // max_replicas below the floor cannot pass either (max >= min >= floor).
        let pol = Policy {
            min_replicas: 1,
            max_replicas: 1,
            ..Policy::default()
        };
        assert!(pol.check(1).is_ok());
        let e = pol.check(2).unwrap_err().to_string();
        assert!(e.contains("max_replicas = 1 is below 2"), "{e}");
    }
}
