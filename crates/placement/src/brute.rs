//! Exhaustive search, the reference the MILPs are tested against on small instances. Every
//! partition's copies take one of the C(max_hosts, k + 1) host subsets, so a step has
//! C(max_hosts, k + 1)^partitions states; the search refuses more than [`STATE_LIMIT`].

use std::time::Instant;

use crate::model::{HostId, Placement, Problem, LOAD_TOLERANCE};
use crate::plan::{chain, step, Objective, Plan, PlanError, SolveStatus};

/// Largest number of states per step the search takes on (8 partitions × C(4, 2) = 6^8 fit).
pub const STATE_LIMIT: u128 = 1 << 22;

struct Space {
    subsets: Vec<Vec<HostId>>,
    parts: usize,
    states: usize,
}

impl Space {
    fn new(problem: &Problem) -> Result<Self, PlanError> {
        let mut subsets = Vec::new();
        let mut cur = Vec::new();
        fn rec(
            start: usize,
            left: usize,
            n: usize,
            cur: &mut Vec<HostId>,
            out: &mut Vec<Vec<HostId>>,
        ) {
            if left == 0 {
                out.push(cur.clone());
                return;
            }
            for h in start..n {
                cur.push(h);
                rec(h + 1, left - 1, n, cur, out);
                cur.pop();
            }
        }
        rec(
            0,
            problem.copies(),
            problem.max_hosts,
            &mut cur,
            &mut subsets,
        );
        let parts = problem.partitions.len();
        if problem.max_hosts > 64 {
            // Host sets are bitmasks of 64 bits.
            return Err(PlanError::TooBigForBruteForce {
                states: u128::MAX,
                limit: STATE_LIMIT,
            });
        }
        let states = (subsets.len() as u128)
            .checked_pow(parts as u32)
            .unwrap_or(u128::MAX);
        if states > STATE_LIMIT {
            return Err(PlanError::TooBigForBruteForce {
                states,
                limit: STATE_LIMIT,
            });
        }
        Ok(Space {
            subsets,
            parts,
            states: states as usize,
        })
    }

    fn digits(&self, mut x: usize) -> Vec<usize> {
        let q = self.subsets.len();
        (0..self.parts)
            .map(|_| {
                let d = x % q;
                x /= q;
                d
            })
            .collect()
    }

    fn placement(&self, x: usize) -> Placement {
        Placement::new(
            self.digits(x)
                .into_iter()
                .map(|d| self.subsets[d].clone())
                .collect(),
        )
    }

    /// Hosts used, or `None` if the state breaks CPU or memory at `step`.
    fn used(
        &self,
        problem: &Problem,
        x: usize,
        step: usize,
        totals: &mut [(f64, u64)],
    ) -> Option<usize> {
        totals.fill((0.0, 0));
        for (i, d) in self.digits(x).into_iter().enumerate() {
            let p = &problem.partitions[i];
            for &h in &self.subsets[d] {
                totals[h].0 += p.load[step];
                totals[h].1 += p.bytes;
            }
        }
        let over = totals.iter().any(|&(l, b)| {
            l > problem.host.cpu_capacity + LOAD_TOLERANCE || b > problem.host.memory_bytes
        });
        (!over).then(|| self.placement_hosts(x))
    }

    fn placement_hosts(&self, x: usize) -> usize {
        let mut seen = 0u64;
        for d in self.digits(x) {
            for &h in &self.subsets[d] {
                seen |= 1 << h;
            }
        }
        seen.count_ones() as usize
    }

    /// Bytes copied going from subset `a` to subset `b` for a partition of `bytes`.
    fn subset_moved(&self, a: usize, b: usize, bytes: u64) -> u64 {
        self.subsets[b]
            .iter()
            .filter(|h| !self.subsets[a].contains(h))
            .count() as u64
            * bytes
    }

    /// Bytes copied between state `x` and `other`: into `x` when `x` is the target, out of it
    /// into `other` otherwise.
    fn moved(&self, problem: &Problem, x: usize, other: &Placement, x_is_target: bool) -> u64 {
        self.digits(x)
            .into_iter()
            .enumerate()
            .map(|(i, d)| {
                let (from, to) = (&other.copies[i], &self.subsets[d]);
                let (from, to) = if x_is_target { (from, to) } else { (to, from) };
                to.iter().filter(|h| !from.contains(h)).count() as u64 * problem.partitions[i].bytes
            })
            .sum()
    }

    /// Bytes moved from the current placement + ε × mean absolute deviation of the used hosts' load.
    fn online_value(&self, problem: &Problem, x: usize, totals: &mut [(f64, u64)]) -> f64 {
        totals.fill((0.0, 0));
        let mut used = 0u64;
        let mut moved = 0u64;
        for (i, d) in self.digits(x).into_iter().enumerate() {
            let p = &problem.partitions[i];
            for &h in &self.subsets[d] {
                totals[h].0 += p.load[0];
                used |= 1 << h;
                if !matches!(&problem.current, Some(c) if c.has(i, h)) {
                    moved += p.bytes;
                }
            }
        }
        let n = used.count_ones() as f64;
        let hosts = (0..totals.len()).filter(|&h| used & (1 << h) != 0);
        let mean = hosts.clone().map(|h| totals[h].0).sum::<f64>() / n;
        let dev = hosts.map(|h| (totals[h].0 - mean).abs()).sum::<f64>() / n;
        moved as f64 + problem.costs.epsilon * dev
    }
}

/// The offline optimum by dynamic programming over the steps; the transition minimum is taken one
/// partition at a time (the bytes moved add up over partitions), so a step costs
/// states × C(max_hosts, k + 1) × partitions.
pub fn plan_offline(problem: &Problem) -> Result<Plan, PlanError> {
    problem.validate()?;
    let started = Instant::now();
    let space = Space::new(problem)?;
    let (q, n) = (space.subsets.len(), space.states);
    let (s_cost, i_cost) = (problem.costs.host_step, problem.costs.per_byte_moved);
    let mut totals = vec![(0.0, 0u64); problem.max_hosts];
    let mut values: Vec<Vec<f64>> = Vec::with_capacity(problem.horizon());
    for t in 0..problem.horizon() {
        let mut v: Vec<f64> = match values.last() {
            None => (0..n)
                .map(|x| {
                    problem
                        .current
                        .as_ref()
                        .map_or(0.0, |c| i_cost * space.moved(problem, x, c, true) as f64)
                })
                .collect(),
            Some(prev) => {
                let mut w = prev.clone();
                let mut stride = 1;
                for part in &problem.partitions {
                    let cost: Vec<Vec<f64>> = (0..q)
                        .map(|a| {
                            (0..q)
                                .map(|b| i_cost * space.subset_moved(a, b, part.bytes) as f64)
                                .collect()
                        })
                        .collect();
                    let mut next = vec![f64::INFINITY; n];
                    for base in (0..n).filter(|x| (x / stride) % q == 0) {
                        for b in 0..q {
                            next[base + b * stride] = (0..q)
                                .map(|a| w[base + a * stride] + cost[a][b])
                                .fold(f64::INFINITY, f64::min);
                        }
                    }
                    w = next;
                    stride *= q;
                }
                w
            }
        };
        for (x, value) in v.iter_mut().enumerate() {
            *value += match space.used(problem, x, t, &mut totals) {
                Some(used) => s_cost * used as f64,
                None => f64::INFINITY,
            };
        }
        values.push(v);
    }
    let argmin = |v: &[f64]| {
        (0..v.len())
            .min_by(|&a, &b| v[a].total_cmp(&v[b]))
            .filter(|&x| v[x].is_finite())
    };
    let infeasible = || PlanError::NoFeasiblePlacement {
        from_hosts: 1,
        max_hosts: problem.max_hosts,
    };
    let mut chosen = vec![argmin(values.last().expect("horizon >= 1")).ok_or_else(infeasible)?];
    for t in (0..values.len() - 1).rev() {
        let next = space.placement(*chosen.last().expect("one chosen"));
        let back: Vec<f64> = (0..n)
            .map(|y| values[t][y] + i_cost * space.moved(problem, y, &next, false) as f64)
            .collect();
        chosen.push(argmin(&back).ok_or_else(infeasible)?);
    }
    chosen.reverse();
    let steps = chain(problem, chosen.into_iter().map(|x| space.placement(x)));
    Plan::assemble(
        problem,
        steps,
        Objective::Offline,
        SolveStatus::Exhaustive,
        started,
        Vec::new(),
    )
}

/// The online optimum with the online planner's rule for the host count: the smallest N from the
/// lower bound up that has a feasible placement using exactly N hosts, then the least
/// bytes moved + ε × mean absolute load deviation among those.
pub fn plan_online(problem: &Problem) -> Result<Plan, PlanError> {
    problem.validate_snapshot()?;
    let started = Instant::now();
    let space = Space::new(problem)?;
    let mut totals = vec![(0.0, 0u64); problem.max_hosts];
    let used: Vec<Option<usize>> = (0..space.states)
        .map(|x| space.used(problem, x, 0, &mut totals))
        .collect();
    let from_hosts = problem.hosts_lower_bound(0);
    for n in from_hosts..=problem.max_hosts {
        let best = (0..space.states)
            .filter(|&x| used[x] == Some(n))
            .map(|x| (space.online_value(problem, x, &mut totals), x))
            .min_by(|a, b| a.0.total_cmp(&b.0));
        if let Some((_, x)) = best {
            let s = step(problem, problem.current.as_ref(), space.placement(x));
            return Plan::assemble(
                problem,
                vec![s],
                Objective::Online,
                SolveStatus::Exhaustive,
                started,
                Vec::new(),
            );
        }
    }
    Err(PlanError::NoFeasiblePlacement {
        from_hosts,
        max_hosts: problem.max_hosts,
    })
}
