//! The offline and online placement MILPs (see the crate README for the formulations), solved by
//! CBC through `good_lp`.

use std::collections::HashMap;
use std::time::Instant;

use good_lp::solvers::coin_cbc::{coin_cbc, CoinCbcProblem};
use good_lp::{
    constraint, variable, Expression, ProblemVariables, ResolutionError, Solution, SolutionStatus,
    SolverModel, Variable, WithInitialSolution, WithTimeLimit,
};

use crate::model::{Placement, Problem};
use crate::plan::{
    chain, check_placement, Attempt, AttemptOutcome, Objective, Plan, PlanError, SolveStatus,
};

/// Solver settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MilpOptions {
    /// Limit of one solver run, seconds (CBC counts CPU seconds, rounded up to a whole second).
    pub time_limit_s: f64,
    /// Online: prove the balance term optimal too (`SolveStatus::Optimal`). Off (the default),
    /// the solver stops once the bytes moved are proven minimal (`SolveStatus::OptimalMoves`):
    /// proving the last bit of balance is what takes the time on large instances.
    pub exact_balance: bool,
}

impl Default for MilpOptions {
    fn default() -> Self {
        MilpOptions {
            time_limit_s: 15.0,
            exact_balance: false,
        }
    }
}

/// A binary above this is taken as 1.
const ONE: f64 = 0.5;

/// The objectives are divided by this before the solver sees them, so that byte counts in the
/// billions do not swamp the solver's tolerances; the argmin does not change.
fn objective_scale(problem: &Problem, per_byte: f64, per_host: f64) -> f64 {
    let max_bytes = problem
        .partitions
        .iter()
        .map(|p| p.bytes)
        .max()
        .unwrap_or(0) as f64;
    let scale = (per_byte * max_bytes).max(per_host);
    if scale > 0.0 {
        1.0 / scale
    } else {
        1.0
    }
}

fn solver(vars: ProblemVariables, objective: Expression, opts: &MilpOptions) -> CoinCbcProblem {
    let mut model = vars.minimise(objective).using(coin_cbc);
    model.set_parameter("log", "0");
    model.set_parameter("slogLevel", "0");
    model.with_time_limit(opts.time_limit_s.max(1.0))
}

/// Pairs of consecutive hosts that held nothing at the start: these are interchangeable, so the
/// solver may be told to use the lower index first. Hosts that hold copies now are not.
fn symmetric_pairs(problem: &Problem) -> Vec<(usize, usize)> {
    let empty = problem.empty_hosts();
    empty.windows(2).map(|w| (w[0], w[1])).collect()
}

fn read_placement<S: Solution>(sol: &S, a: &[Vec<Variable>]) -> Placement {
    Placement::new(
        a.iter()
            .map(|row| {
                row.iter()
                    .enumerate()
                    .filter(|(_, &v)| sol.value(v) > ONE)
                    .map(|(j, _)| j)
                    .collect()
            })
            .collect(),
    )
}

/// Offline: one placement per step of the predicted horizon, minimising
/// S × host-steps + I × bytes copied.
pub fn plan_offline(problem: &Problem, opts: &MilpOptions) -> Result<Plan, PlanError> {
    problem.validate()?;
    let started = Instant::now();
    let (p, h, horizon, c) = (
        problem.partitions.len(),
        problem.max_hosts,
        problem.horizon(),
        problem.copies(),
    );
    if let Some(t) = (0..horizon).find(|&t| problem.hosts_lower_bound(t) > h) {
        return Err(PlanError::NoFeasiblePlacement {
            from_hosts: problem.hosts_lower_bound(t),
            max_hosts: h,
        });
    }
    let scale = objective_scale(
        problem,
        problem.costs.per_byte_moved,
        problem.costs.host_step,
    );
    let mut vars = ProblemVariables::new();
    let a: Vec<Vec<Vec<Variable>>> = (0..horizon)
        .map(|_| {
            (0..p)
                .map(|_| vars.add_vector(variable().binary(), h))
                .collect()
        })
        .collect();
    let x: Vec<Vec<Variable>> = (0..horizon)
        .map(|_| vars.add_vector(variable().binary(), h))
        .collect();
    // d[t][i][j] ≥ a[t][i][j] − a[t−1][i][j]: a copy of i created on j at step t (t ≥ 1).
    let d: Vec<Vec<Vec<Variable>>> = (1..horizon)
        .map(|_| {
            (0..p)
                .map(|_| vars.add_vector(variable().min(0.0), h))
                .collect()
        })
        .collect();

    let mut objective = Expression::with_capacity(horizon * h * (p + 1));
    for xt in &x {
        for &v in xt {
            objective.add_mul(problem.costs.host_step * scale, v);
        }
    }
    let byte_cost = problem.costs.per_byte_moved * scale;
    if let Some(cur) = &problem.current {
        for (i, part) in problem.partitions.iter().enumerate() {
            for j in (0..h).filter(|&j| !cur.has(i, j)) {
                objective.add_mul(byte_cost * part.bytes as f64, a[0][i][j]);
            }
        }
    }
    for dt in &d {
        for (i, part) in problem.partitions.iter().enumerate() {
            for &v in &dt[i] {
                objective.add_mul(byte_cost * part.bytes as f64, v);
            }
        }
    }

    let mut model = solver(vars, objective, opts);
    for t in 0..horizon {
        for i in 0..p {
            let copies: Expression = a[t][i].iter().sum();
            model.add_constraint(constraint!(copies == c as f64));
            for j in 0..h {
                model.add_constraint(constraint!(a[t][i][j] <= x[t][j]));
                if t > 0 {
                    model
                        .add_constraint(constraint!(d[t - 1][i][j] >= a[t][i][j] - a[t - 1][i][j]));
                }
            }
        }
        for j in 0..h {
            let mut cpu = Expression::with_capacity(p);
            let mut mem = Expression::with_capacity(p);
            for (i, part) in problem.partitions.iter().enumerate() {
                cpu.add_mul(part.load[t], a[t][i][j]);
                mem.add_mul(part.bytes as f64, a[t][i][j]);
            }
            model.add_constraint(constraint!(cpu <= problem.host.cpu_capacity * x[t][j]));
            model.add_constraint(constraint!(
                mem <= problem.host.memory_bytes as f64 * x[t][j]
            ));
        }
    }
    // Initially empty hosts are interchangeable: order them by the number of steps they are used.
    for (lo, hi) in symmetric_pairs(problem) {
        let used_lo: Expression = x.iter().map(|xt| xt[lo]).sum();
        let used_hi: Expression = x.iter().map(|xt| xt[hi]).sum();
        model.add_constraint(constraint!(used_lo >= used_hi));
    }

    // Greedy's plan is feasible: the answer is never worse than it. (Handing it to CBC as a start
    // made its search worse in a trial at 128 partitions, so it is only compared with.)
    let greedy = crate::greedy::repair_offline(problem).ok();

    let sol = match model.solve() {
        Ok(sol) => sol,
        Err(ResolutionError::Infeasible) => {
            return Err(PlanError::NoFeasiblePlacement {
                from_hosts: 1,
                max_hosts: h,
            });
        }
        Err(e) => return Err(PlanError::Solver(e.to_string())),
    };
    let status = match sol.status() {
        SolutionStatus::Optimal => SolveStatus::Optimal,
        _ => SolveStatus::TimeLimit,
    };
    let steps = chain(problem, a.iter().map(|at| read_placement(&sol, at)));
    let greedy_instead = |g: Plan| {
        Plan::assemble(
            problem,
            g.steps,
            Objective::Offline,
            status,
            started,
            Vec::new(),
        )
    };
    match Plan::assemble(
        problem,
        steps,
        Objective::Offline,
        status,
        started,
        Vec::new(),
    ) {
        // At the time limit with no incumbent, CBC's C interface hands back its last relaxation.
        Err(PlanError::Invalid(_)) if status == SolveStatus::TimeLimit => greedy
            .map(&greedy_instead)
            .unwrap_or(Err(PlanError::TimeLimitNoSolution {
                time_limit_s: opts.time_limit_s,
            })),
        Ok(plan) => match greedy {
            Some(g) if g.objective < plan.objective - 1e-9 * plan.objective.abs().max(1.0) => {
                greedy_instead(g)
            }
            _ => Ok(plan),
        },
        Err(e) => Err(e),
    }
}

/// Online: the target placement for the load snapshot, minimising bytes copied + ε × mean absolute
/// load deviation with exactly N hosts used, N rising from the lower bound until a run of the
/// solver finds a placement within its time limit.
pub fn plan_online(problem: &Problem, opts: &MilpOptions) -> Result<Plan, PlanError> {
    problem.validate_snapshot()?;
    let started = Instant::now();
    if problem.partitions.is_empty() {
        let steps = chain(problem, [Placement::new(Vec::new())]);
        return Plan::assemble(
            problem,
            steps,
            Objective::Online,
            SolveStatus::Optimal,
            started,
            Vec::new(),
        );
    }
    let from_hosts = problem.hosts_lower_bound(0);
    let most = problem
        .max_hosts
        .min(problem.partitions.len() * problem.copies());
    let mut attempts = Vec::new();
    for n in from_hosts..=most {
        let t0 = Instant::now();
        let (outcome, found) = solve_online_at(problem, n, opts);
        attempts.push(Attempt {
            hosts: n,
            outcome: outcome.clone(),
            solve_time: t0.elapsed(),
        });
        let Some(placement) = found else { continue };
        let status = match outcome {
            AttemptOutcome::Optimal if opts.exact_balance => SolveStatus::Optimal,
            AttemptOutcome::Optimal => SolveStatus::OptimalMoves,
            _ => SolveStatus::TimeLimit,
        };
        let steps = chain(problem, [placement]);
        return Plan::assemble(problem, steps, Objective::Online, status, started, attempts);
    }
    Err(PlanError::NoFeasiblePlacement {
        from_hosts,
        max_hosts: problem.max_hosts,
    })
}

/// A feasible placement on exactly `n` hosts to start the solver from, if an obvious one exists:
/// the current placement, or greedy first-fit from it. Hosts are renumbered so that the
/// start respects the symmetry breaking (empty hosts in use take the lowest empty indices).
fn warm_start(problem: &Problem, n: usize) -> Option<Placement> {
    let candidates = [
        problem.current.clone(),
        crate::greedy::repair_online(problem)
            .ok()
            .map(|p| p.steps[0].placement.clone()),
    ];
    candidates
        .into_iter()
        .flatten()
        .find(|c| c.hosts_used() == n && check_placement(problem, c, 0).is_ok())
        .map(|c| {
            // Renumber the initially empty hosts this start uses onto the lowest empty indices.
            let empty = problem.empty_hosts();
            let mut used_empty: Vec<usize> = empty
                .iter()
                .copied()
                .filter(|&h| c.copies.iter().any(|cp| cp.contains(&h)))
                .collect();
            used_empty.sort_unstable();
            let map = |h: usize| {
                used_empty
                    .iter()
                    .position(|&u| u == h)
                    .map_or(h, |n| empty[n])
            };
            Placement::new(
                c.copies
                    .iter()
                    .map(|cp| cp.iter().map(|&h| map(h)).collect())
                    .collect(),
            )
        })
}

/// One solver run of the online MILP with exactly `n` hosts used.
fn solve_online_at(
    problem: &Problem,
    n: usize,
    opts: &MilpOptions,
) -> (AttemptOutcome, Option<Placement>) {
    let (p, h, c) = (
        problem.partitions.len(),
        problem.max_hosts,
        problem.copies(),
    );
    let scale = objective_scale(problem, 1.0, 0.0);
    let target = problem.partitions.iter().map(|q| q.load[0]).sum::<f64>() * c as f64 / n as f64;
    let mut vars = ProblemVariables::new();
    let a: Vec<Vec<Variable>> = (0..p)
        .map(|_| vars.add_vector(variable().binary(), h))
        .collect();
    let x = vars.add_vector(variable().binary(), h);
    let dev = vars.add_vector(variable().min(0.0), h);

    let mut objective = Expression::with_capacity(p * h + h);
    for (i, part) in problem.partitions.iter().enumerate() {
        for j in (0..h).filter(|&j| !matches!(&problem.current, Some(cur) if cur.has(i, j))) {
            objective.add_mul(part.bytes as f64 * scale, a[i][j]);
        }
    }
    for &v in &dev {
        objective.add_mul(problem.costs.epsilon * scale / n as f64, v);
    }

    let mut model = solver(vars, objective.clone(), opts);
    if !opts.exact_balance {
        // Bytes are whole, so two placements' bytes moved differ by 0 or at least one byte
        // (`scale` in solver units), and ε × the mean absolute deviation stays below ε × 2λ. A
        // solver that stops within this gap of its bound has proven the bytes moved minimal
        // (0.9: margin for the solver's tolerances). See the README.
        let gap = 0.9 * scale * (1.0 - 2.0 * problem.costs.epsilon * target);
        if gap > 0.0 {
            model.set_parameter("allowableGap", &gap.to_string());
        }
    }
    for row in &a {
        let copies: Expression = row.iter().sum();
        model.add_constraint(constraint!(copies == c as f64));
        for j in 0..h {
            model.add_constraint(constraint!(row[j] <= x[j]));
        }
    }
    for j in 0..h {
        let mut cpu = Expression::with_capacity(p);
        let mut mem = Expression::with_capacity(p);
        let mut count = Expression::with_capacity(p);
        for (i, part) in problem.partitions.iter().enumerate() {
            cpu.add_mul(part.load[0], a[i][j]);
            mem.add_mul(part.bytes as f64, a[i][j]);
            count.add_mul(1.0, a[i][j]);
        }
        model.add_constraint(constraint!(cpu.clone() <= problem.host.cpu_capacity * x[j]));
        model.add_constraint(constraint!(mem <= problem.host.memory_bytes as f64 * x[j]));
        model.add_constraint(constraint!(count >= x[j]));
        model.add_constraint(constraint!(dev[j] >= cpu.clone() - target * x[j]));
        model.add_constraint(constraint!(dev[j] >= target * x[j] - cpu));
    }
    let used: Expression = x.iter().sum();
    model.add_constraint(constraint!(used == n as f64));
    for (lo, hi) in symmetric_pairs(problem) {
        model.add_constraint(constraint!(x[lo] >= x[hi]));
    }
    let start = warm_start(problem, n);
    let mut start_objective = f64::INFINITY;
    if let Some(start) = &start {
        let totals = start.host_totals(problem, 0);
        let mut values = Vec::with_capacity(p * h + 2 * h);
        for (i, row) in a.iter().enumerate() {
            values.extend(
                row.iter()
                    .enumerate()
                    .map(|(j, &v)| (v, if start.has(i, j) { 1.0 } else { 0.0 })),
            );
        }
        for j in 0..h {
            let used = totals[j].1 > 0 || start.copies.iter().any(|c| c.contains(&j));
            values.push((x[j], if used { 1.0 } else { 0.0 }));
            values.push((
                dev[j],
                if used {
                    (totals[j].0 - target).abs()
                } else {
                    0.0
                },
            ));
        }
        start_objective =
            objective.eval_with(&values.iter().copied().collect::<HashMap<Variable, f64>>());
        model = model.with_initial_solution(values);
    }

    match model.solve() {
        Ok(sol) => {
            let valid =
                |p: &Placement| check_placement(problem, p, 0).is_ok() && p.hosts_used() == n;
            let mut placement = read_placement(&sol, &a);
            // When CBC stops at its root because the start is already optimal, its C interface
            // hands back the root relaxation instead of the incumbent: the incumbent is the start.
            if !valid(&placement) {
                let incumbent = sol.model().obj_value();
                if let Some(start) =
                    start.filter(|_| start_objective <= incumbent + 1e-9 * incumbent.abs().max(1.0))
                {
                    placement = start;
                }
            }
            let feasible = valid(&placement);
            match (sol.status(), feasible) {
                (SolutionStatus::Optimal | SolutionStatus::GapLimit, true) => {
                    (AttemptOutcome::Optimal, Some(placement))
                }
                (SolutionStatus::Optimal, false) => (
                    AttemptOutcome::SolverError("optimal solution breaks a constraint".into()),
                    None,
                ),
                (_, true) => (AttemptOutcome::TimeLimitFeasible, Some(placement)),
                (_, false) => (AttemptOutcome::TimeLimitNoSolution, None),
            }
        }
        Err(ResolutionError::Infeasible) => (AttemptOutcome::Infeasible, None),
        Err(e) => (AttemptOutcome::SolverError(e.to_string()), None),
    }
}
