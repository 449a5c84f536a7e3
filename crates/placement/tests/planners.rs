//! The planners against each other on seeded random instances: the MILPs reach the exhaustive
//! optimum, every plan passes the validator, greedy is never better than the MILP.

use pliant_placement::instances::{random_problem, Shape};
use pliant_placement::plan::{check, Plan};
use pliant_placement::{brute, greedy, milp, PlanError, Problem};

/// Exact: the objectives must match the exhaustive optimum to the last bit of balance.
fn opts() -> milp::MilpOptions {
    milp::MilpOptions {
        exact_balance: true,
        ..milp::MilpOptions::default()
    }
}

fn same(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-6 * a.abs().max(b.abs()).max(1.0)
}

/// An online instance: copies placed first-fit on one load, then the load changes.
fn online_instance(seed: u64, partitions: usize, k: usize, fill_hosts: f64) -> Option<Problem> {
    let shape = Shape {
        partitions,
        max_hosts: 4,
        k,
        horizon: 2,
        fill_hosts,
    };
    let mut p = random_problem(seed, shape, true);
    p.current.as_ref()?;
    for part in &mut p.partitions {
        part.load.remove(0);
    }
    Some(p)
}

fn offline_instance(
    seed: u64,
    partitions: usize,
    k: usize,
    horizon: usize,
    current: bool,
) -> Problem {
    let fill_hosts = 1.0 + (seed % 3) as f64 * 0.6;
    random_problem(
        seed,
        Shape {
            partitions,
            max_hosts: 4,
            k,
            horizon,
            fill_hosts,
        },
        current,
    )
}

/// Both optimal with the same host counts and objective (true), or both infeasible (false).
fn same_optimum(
    label: &str,
    p: &Problem,
    exact: Result<Plan, PlanError>,
    solved: Result<Plan, PlanError>,
) -> bool {
    match (exact, solved) {
        (Ok(e), Ok(m)) => {
            check(p, &m).unwrap();
            check(p, &e).unwrap();
            let used = |plan: &Plan| plan.steps.iter().map(|s| s.hosts_used).collect::<Vec<_>>();
            eprintln!(
                "{label}: hosts {:?} moved {} objective {} (milp {:?}, brute {:?})",
                used(&m),
                m.bytes_moved,
                m.objective,
                m.solve_time,
                e.solve_time
            );
            // Online, the host count comes first; offline it is part of the objective.
            assert!(
                m.attempts.is_empty() || used(&m) == used(&e),
                "{label}: host count"
            );
            assert!(
                same(m.objective, e.objective),
                "{label}: milp {} brute {}",
                m.objective,
                e.objective
            );
            true
        }
        (
            Err(PlanError::NoFeasiblePlacement { .. }),
            Err(PlanError::NoFeasiblePlacement { .. }),
        ) => false,
        (e, m) => panic!("{label}: brute {e:?} milp {m:?}"),
    }
}

fn hosts(plan: &Plan) -> usize {
    plan.steps[0].hosts_used
}

#[test]
fn online_milp_reaches_the_exhaustive_optimum() {
    let mut compared = 0;
    for seed in 0..40u64 {
        let partitions = 3 + (seed as usize % 6);
        let k = (seed as usize / 6) % 2;
        let fill = 1.0 + (seed % 4) as f64 * 0.5;
        let Some(mut p) = online_instance(seed, partitions, k, fill) else {
            continue;
        };
        if seed % 5 == 4 {
            // Nothing placed yet: every copy is new, all hosts are interchangeable.
            p.current = None;
        }
        let exact = brute::plan_online(&p);
        let solved = milp::plan_online(&p, &opts());
        let label = format!("online seed {seed}: {partitions}x4 k={k}");
        // The default options stop once the bytes moved are proven minimal.
        if let (Ok(e), Ok(m)) = (&exact, milp::plan_online(&p, &milp::MilpOptions::default())) {
            check(&p, &m).unwrap();
            assert_eq!(
                (hosts(&m), m.bytes_moved),
                (hosts(e), e.bytes_moved),
                "{label}: default options"
            );
            assert!(
                m.objective >= e.objective - 1e-9,
                "{label}: below the optimum"
            );
        }
        if same_optimum(&label, &p, exact, solved) {
            compared += 1;
        }
        if compared >= 14 {
            break;
        }
    }
    assert!(compared >= 10, "only {compared} instances compared");
}

#[test]
fn offline_milp_reaches_the_exhaustive_optimum() {
    let cases: &[(usize, usize, usize)] = &[
        (4, 0, 3),
        (6, 0, 3),
        (8, 0, 2),
        (4, 1, 3),
        (6, 1, 2),
        (8, 1, 2),
    ];
    let mut compared = 0;
    for (n, &(partitions, k, horizon)) in cases.iter().enumerate() {
        for round in 0..2u64 {
            let seed = 100 + 10 * n as u64 + round;
            let p = offline_instance(seed, partitions, k, horizon, round == 1);
            let exact = brute::plan_offline(&p);
            let solved = milp::plan_offline(&p, &opts());
            let label = format!("offline seed {seed}: {partitions}x4 k={k} T={horizon}");
            if same_optimum(&label, &p, exact, solved) {
                compared += 1;
            }
        }
    }
    assert!(compared >= 8, "only {compared} instances compared");
}

#[test]
fn greedy_is_never_better_than_the_milp() {
    let mut compared = 0;
    for seed in 200..230u64 {
        let partitions = 4 + (seed as usize % 5);
        let k = seed as usize % 2;
        if let Some(p) = online_instance(seed, partitions, k, 1.5 + (seed % 3) as f64 * 0.5) {
            if let (Ok(g), Ok(m)) = (greedy::plan_online(&p), milp::plan_online(&p, &opts())) {
                check(&p, &g).unwrap();
                let better = hosts(&g) < hosts(&m)
                    || (hosts(&g) == hosts(&m) && g.objective < m.objective - 1e-6);
                assert!(
                    !better,
                    "seed {seed}: greedy {} hosts {} < milp {} hosts {}",
                    hosts(&g),
                    g.objective,
                    hosts(&m),
                    m.objective
                );
                compared += 1;
            }
        }
        let p = offline_instance(seed, partitions, k, 3, seed % 2 == 0);
        if let (Ok(g), Ok(m)) = (greedy::plan_offline(&p), milp::plan_offline(&p, &opts())) {
            check(&p, &g).unwrap();
            assert!(
                g.objective >= m.objective - 1e-6,
                "seed {seed}: greedy {} < milp {}",
                g.objective,
                m.objective
            );
            compared += 1;
        }
    }
    assert!(compared >= 30, "only {compared} comparisons");
}
