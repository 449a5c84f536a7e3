//! What a planner returns, the objectives every planner is scored by, the validator, and the
//! copy-before-drop order in which a plan is carried out.

use std::time::Duration;

use crate::model::{HostId, ModelError, Placement, Problem, LOAD_TOLERANCE};

/// One copy of a partition changing host. `from: None` is a fresh copy (nothing was placed yet).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Move {
    pub partition: usize,
    pub from: Option<HostId>,
    pub to: HostId,
    pub bytes: u64,
}

/// One primitive step of carrying a plan out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Create a copy of `partition` on `to`, streamed from `from` (any live copy would do; the
    /// one about to be dropped is named so that the source host is the one losing the partition).
    Copy {
        partition: usize,
        from: Option<HostId>,
        to: HostId,
        bytes: u64,
    },
    /// Drop the copy of `partition` on `host`.
    Drop { partition: usize, host: HostId },
}

/// The placement at one time step and how it is reached from the previous one.
#[derive(Clone, Debug, PartialEq)]
pub struct StepPlan {
    pub placement: Placement,
    pub hosts_used: usize,
    pub moves: Vec<Move>,
    pub bytes_moved: u64,
}

/// How a plan was obtained.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SolveStatus {
    /// The MILP solver proved it optimal.
    Optimal,
    /// Online, without `exact_balance`: the host count and bytes moved are proven minimal; the
    /// balance term is the best found, within the solver's gap.
    OptimalMoves,
    /// The solver's time limit ran out with a feasible placement, not proven optimal.
    TimeLimit,
    /// Greedy first-fit: feasible, no optimality claim.
    Heuristic,
    /// Exhaustive search: optimal by enumeration.
    Exhaustive,
}

/// What one online solve at a fixed host count gave.
#[derive(Clone, Debug, PartialEq)]
pub enum AttemptOutcome {
    /// Proven optimal (online without `exact_balance`: in bytes moved).
    Optimal,
    TimeLimitFeasible,
    /// The time limit ran out before any feasible placement was found.
    TimeLimitNoSolution,
    Infeasible,
    SolverError(String),
}

#[derive(Clone, Debug, PartialEq)]
pub struct Attempt {
    pub hosts: usize,
    pub outcome: AttemptOutcome,
    pub solve_time: Duration,
}

/// A planner's answer: one step (online: the target placement) or one per time step (offline).
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    pub steps: Vec<StepPlan>,
    pub bytes_moved: u64,
    /// The objective of the planner that produced it (offline or online), in the problem's units.
    pub objective: f64,
    pub solve_time: Duration,
    pub status: SolveStatus,
    /// Online MILP: every host count tried, in order. Empty otherwise.
    pub attempts: Vec<Attempt>,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
    #[error("invalid problem: {0}")]
    Model(#[from] ModelError),
    #[error(
        "no feasible placement within the pool of {max_hosts} hosts (tried from {from_hosts})"
    )]
    NoFeasiblePlacement { from_hosts: usize, max_hosts: usize },
    #[error("the solver failed: {0}")]
    Solver(String),
    #[error("the solver's time limit ({time_limit_s} s) ran out before it found a feasible plan")]
    TimeLimitNoSolution { time_limit_s: f64 },
    #[error("the planner produced an invalid plan: {0}")]
    Invalid(#[from] Violation),
    #[error("exhaustive search is limited to {limit} states per step, this problem has {states}")]
    TooBigForBruteForce { states: u128, limit: u128 },
}

/// A broken constraint in a plan.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Violation {
    #[error("the plan has {len} steps, the horizon is {expected}")]
    Steps { len: usize, expected: usize },
    #[error("step {step}: the placement lists {len} partitions, the problem has {expected}")]
    Partitions {
        step: usize,
        len: usize,
        expected: usize,
    },
    #[error("step {step}: partition {partition} has {len} copies, needs {copies}")]
    Replication {
        step: usize,
        partition: usize,
        len: usize,
        copies: usize,
    },
    #[error(
        "step {step}: partition {partition} has a copy on host {host}, outside the pool or twice"
    )]
    BadHost {
        step: usize,
        partition: usize,
        host: HostId,
    },
    #[error("step {step}: host {host} carries load {load}, capacity {capacity}")]
    Cpu {
        step: usize,
        host: HostId,
        load: f64,
        capacity: f64,
    },
    #[error("step {step}: host {host} holds {bytes} bytes, capacity {capacity}")]
    Memory {
        step: usize,
        host: HostId,
        bytes: u64,
        capacity: u64,
    },
    #[error("step {step}: hosts_used says {said}, the placement uses {actual}")]
    HostsUsed {
        step: usize,
        said: usize,
        actual: usize,
    },
    #[error("step {step}: the moves do not turn the previous placement into this one")]
    Moves { step: usize },
    #[error("bytes_moved says {said}, the moves add up to {actual}")]
    BytesMoved { said: u64, actual: u64 },
}

/// The copies that change host from `from` to `to`, partition by partition, each removed host
/// paired with an added one (both ascending). With `from = None` every copy of `to` is fresh.
pub fn diff(problem: &Problem, from: Option<&Placement>, to: &Placement) -> Vec<Move> {
    let mut out = Vec::new();
    for (i, new) in to.copies.iter().enumerate() {
        let bytes = problem.partitions[i].bytes;
        let old: &[HostId] = from.map_or(&[], |f| &f.copies[i]);
        let mut added: Vec<HostId> = new.iter().copied().filter(|h| !old.contains(h)).collect();
        let mut removed: Vec<HostId> = old.iter().copied().filter(|h| !new.contains(h)).collect();
        added.sort_unstable();
        removed.sort_unstable();
        for (n, &to) in added.iter().enumerate() {
            out.push(Move {
                partition: i,
                from: removed.get(n).copied(),
                to,
                bytes,
            });
        }
    }
    out
}

/// The primitive steps that turn placement `from` into `to`, ordered so that no partition ever has
/// fewer copies than it has in `from` (k + 1 for a valid placement): see [`order`].
pub fn moves(problem: &Problem, from: Option<&Placement>, to: &Placement) -> Vec<Op> {
    order(&diff(problem, from, to))
}

/// Orders `moves` into primitive steps: each move's copy is created before the copy it replaces
/// is dropped, one move at a time, so a partition holds at most one extra copy at any moment.
pub fn order(moves: &[Move]) -> Vec<Op> {
    let mut ops = Vec::with_capacity(moves.len() * 2);
    for m in moves {
        debug_assert!(m.from != Some(m.to), "a move to the host it leaves: {m:?}");
        ops.push(Op::Copy {
            partition: m.partition,
            from: m.from,
            to: m.to,
            bytes: m.bytes,
        });
        if let Some(host) = m.from {
            ops.push(Op::Drop {
                partition: m.partition,
                host,
            });
        }
    }
    ops
}

/// Builds a step from the previous placement.
pub fn step(problem: &Problem, prev: Option<&Placement>, placement: Placement) -> StepPlan {
    let moves = diff(problem, prev, &placement);
    StepPlan {
        hosts_used: placement.hosts_used(),
        bytes_moved: moves.iter().map(|m| m.bytes).sum(),
        moves,
        placement,
    }
}

/// Steps through `placements` in order, from the problem's current placement.
pub fn chain(problem: &Problem, placements: impl IntoIterator<Item = Placement>) -> Vec<StepPlan> {
    let mut prev = problem.current.clone();
    placements
        .into_iter()
        .map(|placement| {
            let s = step(problem, prev.as_ref(), placement);
            prev = Some(s.placement.clone());
            s
        })
        .collect()
}

/// Which objective a plan is scored by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Objective {
    Offline,
    Online,
}

impl Plan {
    /// A plan from its steps, scored, timed from `started`, and checked.
    pub fn assemble(
        problem: &Problem,
        steps: Vec<StepPlan>,
        objective: Objective,
        status: SolveStatus,
        started: std::time::Instant,
        attempts: Vec<Attempt>,
    ) -> Result<Plan, PlanError> {
        let objective = match objective {
            Objective::Offline => offline_objective(problem, &steps),
            Objective::Online => steps.first().map_or(0.0, |s| online_objective(problem, s)),
        };
        let plan = Plan {
            bytes_moved: steps.iter().map(|s| s.bytes_moved).sum(),
            objective,
            steps,
            solve_time: started.elapsed(),
            status,
            attempts,
        };
        check(problem, &plan)?;
        Ok(plan)
    }
}

/// Offline objective: S × host-steps + I × bytes moved (the first step's copies count only when a
/// current placement exists).
pub fn offline_objective(problem: &Problem, steps: &[StepPlan]) -> f64 {
    let host_steps: usize = steps.iter().map(|s| s.hosts_used).sum();
    let bytes: u64 = steps.iter().map(|s| s.bytes_moved).sum();
    problem.costs.host_step * host_steps as f64 + problem.costs.per_byte_moved * bytes as f64
}

/// Mean absolute deviation of the used hosts' load (step `step`) from their mean.
pub fn load_deviation(problem: &Problem, placement: &Placement, step: usize) -> f64 {
    let n = placement.hosts_used();
    if n == 0 {
        return 0.0;
    }
    let totals = placement.host_totals(problem, step);
    let used = used_hosts(placement, problem.max_hosts);
    let target = used.iter().map(|&h| totals[h].0).sum::<f64>() / n as f64;
    used.iter()
        .map(|&h| (totals[h].0 - target).abs())
        .sum::<f64>()
        / n as f64
}

/// Online objective: bytes moved + ε × mean absolute load deviation.
pub fn online_objective(problem: &Problem, step: &StepPlan) -> f64 {
    step.bytes_moved as f64 + problem.costs.epsilon * load_deviation(problem, &step.placement, 0)
}

fn used_hosts(placement: &Placement, max_hosts: usize) -> Vec<HostId> {
    let mut used = vec![false; max_hosts];
    for &h in placement.copies.iter().flatten() {
        if h < max_hosts {
            used[h] = true;
        }
    }
    (0..max_hosts).filter(|&h| used[h]).collect()
}

/// Checks a plan against every constraint: replication (k + 1 distinct hosts in the pool), CPU and
/// memory at every step, the step bookkeeping, and that the moves lead from the current placement
/// through every step.
pub fn check(problem: &Problem, plan: &Plan) -> Result<(), Violation> {
    let expected = problem.horizon();
    if plan.steps.len() != expected {
        return Err(Violation::Steps {
            len: plan.steps.len(),
            expected,
        });
    }
    let mut prev = problem.current.clone();
    let mut total = 0u64;
    for (t, s) in plan.steps.iter().enumerate() {
        check_placement(problem, &s.placement, t)?;
        let actual = s.placement.hosts_used();
        if s.hosts_used != actual {
            return Err(Violation::HostsUsed {
                step: t,
                said: s.hosts_used,
                actual,
            });
        }
        let mut reached: Vec<Vec<HostId>> = match &prev {
            Some(p) => p.copies.clone(),
            None => vec![Vec::new(); problem.partitions.len()],
        };
        for op in order(&s.moves) {
            match op {
                Op::Copy { partition, to, .. } => reached[partition].push(to),
                Op::Drop { partition, host } => reached[partition].retain(|&h| h != host),
            }
        }
        if Placement::new(reached) != Placement::new(s.placement.copies.clone())
            || s.moves.iter().map(|m| m.bytes).sum::<u64>() != s.bytes_moved
            || s.moves
                .iter()
                .any(|m| m.bytes != problem.partitions[m.partition].bytes)
        {
            return Err(Violation::Moves { step: t });
        }
        total += s.bytes_moved;
        prev = Some(s.placement.clone());
    }
    if total != plan.bytes_moved {
        return Err(Violation::BytesMoved {
            said: plan.bytes_moved,
            actual: total,
        });
    }
    Ok(())
}

/// Replication, host range, CPU and memory of one placement at step `step`.
pub fn check_placement(
    problem: &Problem,
    placement: &Placement,
    step: usize,
) -> Result<(), Violation> {
    if placement.copies.len() != problem.partitions.len() {
        return Err(Violation::Partitions {
            step,
            len: placement.copies.len(),
            expected: problem.partitions.len(),
        });
    }
    for (i, hosts) in placement.copies.iter().enumerate() {
        if hosts.len() != problem.copies() {
            return Err(Violation::Replication {
                step,
                partition: i,
                len: hosts.len(),
                copies: problem.copies(),
            });
        }
        for (n, &h) in hosts.iter().enumerate() {
            if h >= problem.max_hosts || hosts[..n].contains(&h) {
                return Err(Violation::BadHost {
                    step,
                    partition: i,
                    host: h,
                });
            }
        }
    }
    for (host, (load, bytes)) in placement.host_totals(problem, step).into_iter().enumerate() {
        if load > problem.host.cpu_capacity + LOAD_TOLERANCE {
            return Err(Violation::Cpu {
                step,
                host,
                load,
                capacity: problem.host.cpu_capacity,
            });
        }
        if bytes > problem.host.memory_bytes {
            return Err(Violation::Memory {
                step,
                host,
                bytes,
                capacity: problem.host.memory_bytes,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::instances::{random_placement, Rng};
    use crate::model::{Costs, HostSpec, Partition};

    fn problem(parts: usize, hosts: usize, k: usize) -> Problem {
        Problem {
            partitions: (0..parts)
                .map(|i| Partition {
                    bytes: 10 + i as u64,
                    load: vec![1.0],
                })
                .collect(),
            host: HostSpec {
                cpu_capacity: 100.0,
                memory_bytes: 10_000,
            },
            max_hosts: hosts,
            k,
            current: None,
            costs: Costs::default(),
        }
    }

    /// Property: carrying out `moves(a, b)` one op at a time never leaves a partition with
    /// fewer than k + 1 copies or more than k + 2, never puts two copies on one host, and ends at b.
    #[test]
    fn moves_keep_every_partition_replicated() {
        let mut rng = Rng::new(7);
        for _ in 0..2000 {
            let hosts = 1 + rng.below(8);
            let k = rng.below(hosts.min(3));
            let parts = rng.below(10);
            let p = problem(parts, hosts, k);
            let a = random_placement(&mut rng, parts, hosts, k + 1);
            let b = random_placement(&mut rng, parts, hosts, k + 1);
            let mv = diff(&p, Some(&a), &b);
            assert_eq!(moves(&p, Some(&a), &b), order(&mv));
            let mut live = a.copies.clone();
            for op in order(&mv) {
                match op {
                    Op::Copy {
                        partition,
                        from,
                        to,
                        bytes,
                    } => {
                        assert!(
                            !live[partition].contains(&to),
                            "copy onto a host that has one"
                        );
                        assert!(
                            from.is_some_and(|f| live[partition].contains(&f)),
                            "source is live"
                        );
                        assert_eq!(bytes, p.partitions[partition].bytes);
                        live[partition].push(to);
                    }
                    Op::Drop { partition, host } => {
                        assert!(live[partition].contains(&host));
                        live[partition].retain(|&h| h != host);
                    }
                }
                for c in &live {
                    assert!(c.len() > k && c.len() <= k + 2, "{c:?} with k = {k}");
                }
            }
            assert_eq!(Placement::new(live), b);
            let moved: u64 = mv.iter().map(|m| m.bytes).sum();
            let expect: u64 = (0..parts)
                .map(|i| {
                    b.copies[i]
                        .iter()
                        .filter(|h| !a.copies[i].contains(h))
                        .count() as u64
                        * p.partitions[i].bytes
                })
                .sum();
            assert_eq!(moved, expect);
        }
    }

    #[test]
    fn check_reports_each_broken_constraint() {
        let mut p = problem(2, 4, 1);
        p.host.cpu_capacity = 1.5;
        p.host.memory_bytes = 20;
        let ok = Placement::new(vec![vec![0, 1], vec![2, 3]]);
        let plan = |pl: Placement| Plan {
            steps: vec![step(&p, None, pl)],
            bytes_moved: 0,
            objective: 0.0,
            solve_time: Duration::ZERO,
            status: SolveStatus::Heuristic,
            attempts: vec![],
        };
        let mut good = plan(ok.clone());
        good.bytes_moved = good.steps[0].bytes_moved;
        assert_eq!(check(&p, &good), Ok(()));
        let mut bad = good.clone();
        bad.bytes_moved += 1;
        assert!(matches!(check(&p, &bad), Err(Violation::BytesMoved { .. })));
        let short = Placement::new(vec![vec![0], vec![1, 2]]);
        assert!(matches!(
            check_placement(&p, &short, 0),
            Err(Violation::Replication { .. })
        ));
        let twice = Placement {
            copies: vec![vec![0, 0], vec![1, 2]],
        };
        assert!(matches!(
            check_placement(&p, &twice, 0),
            Err(Violation::BadHost { .. })
        ));
        let outside = Placement::new(vec![vec![0, 4], vec![1, 2]]);
        assert!(matches!(
            check_placement(&p, &outside, 0),
            Err(Violation::BadHost { .. })
        ));
        let hot = Placement::new(vec![vec![0, 1], vec![0, 1]]);
        assert!(matches!(
            check_placement(&p, &hot, 0),
            Err(Violation::Cpu { .. })
        ));
        p.host.cpu_capacity = 5.0;
        assert!(matches!(
            check_placement(&p, &hot, 0),
            Err(Violation::Memory { .. })
        ));
        let mut lying = good.clone();
        lying.steps[0].hosts_used = 3;
        assert!(matches!(
            check(&p, &lying),
            Err(Violation::HostsUsed { .. })
        ));
        let mut unexplained = good;
        unexplained.steps[0].moves.pop();
        assert!(matches!(
            check(&p, &unexplained),
            Err(Violation::Moves { .. })
        ));
    }
}
