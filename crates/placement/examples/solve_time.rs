//! Online solve time at scale: one JSON line per partition count.
//!
//! `cargo run --release -p pliant-placement --example solve_time [-- [--fill=0.6] [--exact] 256 512]`
//!
//! `--offline=T`: the offline planner instead, over T predicted steps after the first-fit one,
//! next to greedy first-fit and the repair heuristic on the same steps.
//!
//! The instance: k = 1 (two copies), a pool of partitions / 8 hosts, the copies placed first-fit
//! on one load, then a new load snapshot (each partition's load redrawn) to plan for. The total
//! load averages `fill` × the pool's CPU. Sizes are 1..8 units; the fixed seed makes every run
//! solve the same instance.

use pliant_placement::instances::at_scale;
use pliant_placement::milp::{plan_offline, plan_online, MilpOptions};
use pliant_placement::plan::check;
use pliant_placement::{greedy, Plan, Problem};

fn main() {
    let mut fill = 0.6;
    let mut opts = MilpOptions::default();
    let mut offline: Option<usize> = None;
    let mut sizes: Vec<usize> = Vec::new();
    for arg in std::env::args().skip(1) {
        if let Some(t) = arg.strip_prefix("--offline=") {
            offline = Some(t.parse().expect("--offline=<steps>"));
            continue;
        }
        match arg.strip_prefix("--fill=") {
            Some(f) => fill = f.parse().expect("--fill=<fraction of the pool>"),
            None if arg == "--exact" => opts.exact_balance = true,
            None => sizes.push(arg.parse().expect("a partition count")),
        }
    }
    let sizes = if sizes.is_empty() {
        vec![256, 512]
    } else {
        sizes
    };
    for partitions in sizes {
        let max_hosts = partitions / 8;
        let problem = at_scale(partitions, fill, offline.unwrap_or(1));
        let hosts_before = problem.current.as_ref().map_or(0, |c| c.hosts_used());
        if offline.is_some() {
            println!("{}", offline_line(&problem, &opts));
            continue;
        }
        let line = match plan_online(&problem, &opts) {
            Ok(plan) => {
                check(&problem, &plan).expect("a valid plan");
                let attempts: Vec<serde_json::Value> = plan
                    .attempts
                    .iter()
                    .map(|a| {
                        serde_json::json!({
                            "hosts": a.hosts,
                            "outcome": format!("{:?}", a.outcome),
                            "solve_s": a.solve_time.as_secs_f64(),
                        })
                    })
                    .collect();
                serde_json::json!({
                    "partitions": partitions,
                    "fill": fill,
                    "exact_balance": opts.exact_balance,
                    "max_hosts": max_hosts,
                    "hosts_before": hosts_before,
                    "hosts": plan.steps[0].hosts_used,
                    "solve_s": plan.solve_time.as_secs_f64(),
                    "status": format!("{:?}", plan.status),
                    "bytes_moved": plan.bytes_moved,
                    "moves": plan.steps[0].moves.len(),
                    "attempts": attempts,
                })
            }
            Err(e) => serde_json::json!({ "partitions": partitions, "error": e.to_string() }),
        };
        println!("{line}");
    }
}

fn offline_line(problem: &Problem, opts: &MilpOptions) -> serde_json::Value {
    let summary = |plan: &Plan| {
        serde_json::json!({
            "hosts_per_step": plan.steps.iter().map(|s| s.hosts_used).collect::<Vec<_>>(),
            "bytes_moved": plan.bytes_moved,
            "objective": plan.objective,
            "solve_s": plan.solve_time.as_secs_f64(),
            "status": format!("{:?}", plan.status),
        })
    };
    let result = |plan: Result<Plan, pliant_placement::PlanError>| match plan {
        Ok(plan) => {
            check(problem, &plan).expect("a valid plan");
            summary(&plan)
        }
        Err(e) => serde_json::json!({ "error": e.to_string() }),
    };
    serde_json::json!({
        "partitions": problem.partitions.len(),
        "max_hosts": problem.max_hosts,
        "horizon": problem.horizon(),
        "milp": result(plan_offline(problem, opts)),
        "greedy": result(greedy::plan_offline(problem)),
        "repair": result(greedy::repair_offline(problem)),
    })
}
