//! `pliant kv up|status|plan|scale|auto|down`: an elastic partitioned in-memory database on Redis
//! Cluster, in lab hosts (see crates/kv/README.md).
use clap::{Args, Subcommand};
use pliant_kv::scale::{self, ScaleOpts};
use pliant_kv::{Kv, Monitor, Planner, UpOpts};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[derive(Args)]
pub struct KvArgs {
    #[command(subcommand)]
    cmd: KvCmd,
    /// Directory of the cluster's state.json, password file and server directories.
    #[arg(long, global = true, default_value = "/run/pliant/kv")]
    dir: PathBuf,
}

#[derive(Args, Clone)]
struct PlannerArgs {
    /// Which planner decides placement: online (the MILP, CBC) or greedy (first-fit).
    #[arg(long, default_value = "online")]
    planner: String,
    /// Time limit of one MILP solver run, seconds.
    #[arg(long, default_value_t = 15.0)]
    time_limit_s: f64,
    /// Moves of different partitions at once (one partition's moves stay in order).
    #[arg(long, default_value_t = pliant_kv::moves::PARALLEL)]
    parallel: usize,
}

impl PlannerArgs {
    fn planner(&self) -> Result<Planner, String> {
        Planner::parse(&self.planner, self.time_limit_s)
    }
}

#[derive(Subcommand)]
enum KvCmd {
    /// Create hosts (namespaces with CPU quotas) and the cluster: P partitions, k replicas each.
    Up {
        #[arg(long, default_value_t = 3)]
        hosts: usize,
        #[arg(long, default_value_t = 8)]
        partitions: usize,
        #[arg(long, default_value_t = 1)]
        k: usize,
        /// CPU quota of each host, percent of one core.
        #[arg(long, default_value_t = 50)]
        cpu_quota_pct: u32,
        #[command(flatten)]
        planner: PlannerArgs,
    },
    /// Per partition: hosts, slots, ops/s, CPU, memory; per host: CPU against its quota.
    Status {
        #[arg(long)]
        json: bool,
    },
    /// Print the plan to reach N hosts without executing it.
    Plan {
        #[arg(long)]
        to: usize,
        #[command(flatten)]
        planner: PlannerArgs,
    },
    /// Add hosts (`out`) or empty and remove hosts (`in`), moving copies with k+1 kept.
    Scale {
        #[command(subcommand)]
        dir: ScaleDir,
    },
    /// The automatic loop: measure every interval, scale out when the hosts are busy and in
    /// when they stay idle, with the chosen planner; a line per round (`--json`: one JSON
    /// object per round, then a summary object). Runs for `--duration-s` or until Ctrl-C.
    Auto {
        #[arg(long, default_value_t = 600)]
        duration_s: u64,
        /// Measurement window of one round, seconds.
        #[arg(long, default_value_t = 2.0)]
        interval_s: f64,
        /// Scale out above this utilisation of the hosts' CPU quota.
        #[arg(long, default_value_t = 0.8)]
        high: f64,
        /// Scale in below this utilisation (for `--in-after` rounds in a row).
        #[arg(long, default_value_t = 0.45)]
        low: f64,
        /// The utilisation a scale aims at.
        #[arg(long, default_value_t = 0.65)]
        target: f64,
        #[arg(long, default_value_t = 1)]
        min_hosts: usize,
        #[arg(long, default_value_t = 8)]
        max_hosts: usize,
        #[arg(long, default_value_t = 3)]
        in_after: u32,
        /// Never move copies without a scale (by default a host above `--high` while the
        /// cluster has room sheds copies: a rebalance on the same hosts).
        #[arg(long)]
        no_rebalance: bool,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        planner: PlannerArgs,
    },
    /// Run the TPC-C-like mix (Redis Functions, one warehouse per transaction) against the
    /// cluster, then check it: every acknowledged transaction recorded, every warehouse
    /// consistent. Loads the library and creates missing warehouses first. Non-zero exit if a
    /// transaction was lost or a warehouse is inconsistent.
    Tpcc {
        #[arg(long, default_value_t = 8)]
        warehouses: usize,
        /// Client threads.
        #[arg(long, default_value_t = 4)]
        clients: usize,
        #[arg(long, default_value_t = 30)]
        duration_s: u64,
        /// Print only the JSON report.
        #[arg(long)]
        json: bool,
    },
    /// Run Debian's redis-benchmark in cluster mode against the cluster, as a temporary ACL
    /// user limited to the benchmark's commands and key names (redis-benchmark takes passwords
    /// only on its command line, so it never gets the cluster's); the user is deleted from every
    /// node afterwards. Run it on a cluster at rest: a node started during the run lacks the user.
    RedisBenchmark {
        /// Requests per test.
        #[arg(long, default_value_t = 100_000)]
        requests: u64,
        #[arg(long, default_value_t = 50)]
        clients: u32,
        /// Requests per round trip.
        #[arg(long, default_value_t = 1)]
        pipeline: u32,
        /// Comma-separated redis-benchmark tests (set, get, incr, lpush, ...).
        #[arg(long, default_value = "set,get")]
        tests: String,
        /// Random keys drawn from this many.
        #[arg(long, default_value_t = 100_000)]
        keyspace: u64,
        /// Print only a JSON array (one object per test).
        #[arg(long)]
        json: bool,
    },
    /// Stop every server it started (by PID) and delete the namespaces and cgroups.
    Down,
}

#[derive(Subcommand)]
enum ScaleDir {
    Out {
        /// Hosts after the scale (default: one more).
        #[arg(long)]
        to: Option<usize>,
        #[command(flatten)]
        planner: PlannerArgs,
    },
    In {
        /// Hosts after the scale (default: one fewer).
        #[arg(long)]
        to: Option<usize>,
        #[command(flatten)]
        planner: PlannerArgs,
    },
}

/// Loads are measured over this window before planning.
const PLAN_WINDOW: Duration = Duration::from_secs(1);

pub fn run(a: KvArgs) -> Result<(), String> {
    match a.cmd {
        KvCmd::Up {
            hosts,
            partitions,
            k,
            cpu_quota_pct,
            planner,
        } => {
            let kv = Kv::up(&UpOpts {
                hosts,
                partitions,
                k,
                cpu_quota_pct,
                dir: a.dir.clone(),
                planner: planner.planner()?,
            })?;
            println!(
                "up: {} hosts, {} partitions, k = {}, {} redis-servers; state in {}",
                kv.state.hosts.len(),
                partitions,
                k,
                kv.state.nodes.len(),
                kv.state.dir.display()
            );
            Ok(())
        }
        KvCmd::Status { json } => status(&a.dir, json),
        KvCmd::Plan { to, planner } => {
            let kv = Kv::open(&a.dir)?;
            let p = scale::plan(&kv, &opts(to, &planner)?)?;
            println!("plan to {to} hosts: {}", p.summary());
            for (i, s) in p.steps.iter().enumerate() {
                println!("  {}: {}", i + 1, p.describe(s));
            }
            Ok(())
        }
        KvCmd::Scale { dir } => {
            let mut kv = Kv::open(&a.dir)?;
            let now = kv.state.hosts.len();
            let (to, planner, out) = match dir {
                ScaleDir::Out { to, planner } => (to.unwrap_or(now + 1), planner, true),
                ScaleDir::In { to, planner } => {
                    (to.unwrap_or(now.saturating_sub(1)), planner, false)
                }
            };
            if out && to <= now || !out && to >= now {
                return Err(format!(
                    "scale {}: --to {to} with {now} hosts now",
                    if out {
                        "out needs more"
                    } else {
                        "in needs fewer"
                    }
                ));
            }
            let t0 = Instant::now();
            let done = scale::scale(&mut kv, &opts(to, &planner)?, &mut |l| println!("{l}"))?;
            println!(
                "scaled to {} hosts: {} moves in {:.1} s",
                kv.state.hosts.len(),
                done.len(),
                t0.elapsed().as_secs_f64()
            );
            Ok(())
        }
        KvCmd::Auto {
            duration_s,
            interval_s,
            high,
            low,
            target,
            min_hosts,
            max_hosts,
            in_after,
            no_rebalance,
            json,
            planner,
        } => {
            let o = pliant_kv::autoscale::AutoOpts {
                high,
                low,
                target,
                min_hosts,
                max_hosts,
                in_after,
                interval: Duration::try_from_secs_f64(interval_s)
                    .map_err(|e| format!("--interval-s {interval_s}: {e}"))?,
                rebalance: !no_rebalance,
            };
            o.validate()?;
            let planner = planner.planner()?;
            let mut kv = Kv::open(&a.dir)?;
            pliant_lab::cmd::defer_interrupts();
            let t0 = Instant::now();
            let rounds = pliant_kv::autoscale::run(
                &mut kv,
                &o,
                planner,
                Duration::from_secs(duration_s),
                &pliant_lab::cmd::interrupted,
                &mut |r| {
                    if json {
                        println!("{}", serde_json::to_string(r).unwrap_or_default());
                    } else {
                        println!("{r}");
                    }
                },
                &mut |l| eprintln!("kv auto: {l}"),
            )?;
            let scales = rounds
                .iter()
                .filter(|r| r.decision != pliant_kv::autoscale::Decision::Hold)
                .count();
            let summary = serde_json::json!({
                "rounds": rounds.len(),
                "scales": scales,
                "failed_scales": rounds.iter().filter(|r| r.error.is_some()).count(),
                "moves": rounds.iter().map(|r| r.moves).sum::<usize>(),
                "bytes_moved": rounds.iter().map(|r| r.bytes_moved).sum::<u64>(),
                "hosts": kv.state.hosts.len(),
                "elapsed_s": t0.elapsed().as_secs_f64(),
            });
            if json {
                println!("{summary}");
            } else {
                println!(
                    "auto: {} rounds, {scales} scales, {} moves; {} hosts now",
                    rounds.len(),
                    summary["moves"],
                    kv.state.hosts.len()
                );
            }
            Ok(())
        }
        KvCmd::Tpcc {
            warehouses,
            clients,
            duration_s,
            json,
        } => tpcc(
            &a.dir,
            &pliant_kv::tpcc::TpccOpts {
                warehouses,
                clients,
                ..Default::default()
            },
            Duration::from_secs(duration_s),
            json,
        ),
        KvCmd::RedisBenchmark {
            requests,
            clients,
            pipeline,
            tests,
            keyspace,
            json,
        } => {
            let o = pliant_kv::redis_bench::Opts {
                requests,
                clients,
                pipeline,
                tests,
                keyspace,
                ..Default::default()
            };
            pliant_kv::redis_bench::validate(&o)?;
            let kv = Kv::open(&a.dir)?;
            if !json {
                println!(
                    "redis-benchmark: {} requests per test ({}), {} clients, pipeline {}, on {} masters",
                    o.requests,
                    o.tests,
                    o.clients,
                    o.pipeline,
                    kv.state.partitions
                );
            }
            let rows = pliant_kv::redis_bench::run(&kv, &o)?;
            if json {
                println!(
                    "{}",
                    serde_json::to_string(&rows).map_err(|e| e.to_string())?
                );
            } else {
                for r in &rows {
                    println!(
                        "{:<12} {:>10.0} req/s  latency ms: avg {:.3} p50 {:.3} p95 {:.3} p99 {:.3} max {:.3}",
                        r.test, r.rps, r.avg_ms, r.p50_ms, r.p95_ms, r.p99_ms, r.max_ms
                    );
                }
            }
            Ok(())
        }
        KvCmd::Down => {
            let st = pliant_kv::state::KvState::load(&a.dir)?;
            let left = pliant_kv::cluster::teardown(&st);
            if left.is_empty() {
                println!(
                    "down: {} servers stopped, {} hosts removed",
                    st.nodes.len(),
                    st.hosts.len()
                );
                Ok(())
            } else {
                Err(format!("down left: {}", left.join("; ")))
            }
        }
    }
}

fn tpcc(
    dir: &Path,
    o: &pliant_kv::tpcc::TpccOpts,
    duration: Duration,
    json: bool,
) -> Result<(), String> {
    use pliant_kv::tpcc;
    if o.warehouses == 0 || o.clients == 0 {
        return Err("--warehouses and --clients must be at least 1".into());
    }
    let kv = Kv::open(dir)?;
    tpcc::install(&kv)?;
    let created = tpcc::populate(&kv, o)?;
    eprintln!(
        "[tpcc] library loaded; {created} of {} warehouses created",
        o.warehouses
    );
    pliant_lab::cmd::defer_interrupts();
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64);
    let mix = tpcc::Mix::start(dir, o, seed);
    let t0 = Instant::now();
    let mut last = 0;
    while t0.elapsed() < duration && !pliant_lab::cmd::interrupted() {
        std::thread::sleep(Duration::from_secs(1).min(duration.saturating_sub(t0.elapsed())));
        let n = mix.committed();
        eprintln!(
            "[tpcc] {:>4.0} s: {n} committed ({}/s)",
            t0.elapsed().as_secs_f64(),
            n - last
        );
        last = n;
    }
    let (report, acked) = mix.finish();
    // The placement as it is now: a scale during the run moved copies.
    let kv = Kv::open(dir)?;
    let check = tpcc::check(&kv, o, &acked)?;
    let out = serde_json::json!({"mix": report, "check": check});
    if json {
        println!("{out}");
    } else {
        println!(
            "{:.0} s: {} acknowledged writing transactions ({:.0}/s, {:.0} new orders/min), \
             {} rollbacks, {} retries, {} given up; check: {} ids recorded, {} lost, {} \
             violations",
            report.seconds,
            acked.len(),
            report.acked_per_s,
            report.new_orders_per_min,
            report.rollbacks,
            report.retries,
            report.unknown,
            check.recorded,
            check.lost,
            check.violations.len()
        );
        for v in &check.violations {
            println!("  {v}");
        }
    }
    if check.lost > 0 || !check.violations.is_empty() {
        return Err(format!(
            "{} acknowledged transactions lost, {} violations",
            check.lost,
            check.violations.len()
        ));
    }
    Ok(())
}

fn opts(to: usize, p: &PlannerArgs) -> Result<ScaleOpts, String> {
    if p.parallel == 0 {
        return Err("--parallel 0: at least one move must run".into());
    }
    Ok(ScaleOpts {
        target: to,
        planner: p.planner()?,
        window: PLAN_WINDOW,
        parallel: p.parallel,
    })
}

fn status(dir: &Path, json: bool) -> Result<(), String> {
    let m = Monitor::start(dir, Duration::from_millis(500))?;
    let t0 = Instant::now();
    let snap = loop {
        if let Some(s) = m.latest() {
            break s;
        }
        if t0.elapsed() > Duration::from_secs(10) {
            return Err("no sample from the cluster within 10 s".into());
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&snap).map_err(|e| e.to_string())?
        );
        return Ok(());
    }
    println!("partition  slots         master  replicas   ops/s   cpu(master)  used_memory");
    for p in &snap.partitions {
        println!(
            "{:>9}  {:>5}-{:<5}  {:>6}  {:<9}  {:>6.0}  {:>11.3}  {:>11}",
            p.partition,
            p.slots.0,
            p.slots.1,
            p.master_host.map_or("-".into(), |h| format!("h{h}")),
            p.replica_hosts
                .iter()
                .map(|h| format!("h{h}"))
                .collect::<Vec<_>>()
                .join(","),
            p.ops_per_s,
            p.master_cpu,
            p.used_memory
        );
    }
    println!("host  cpu(cores)  quota  util   partitions (masters)");
    for h in &snap.hosts {
        println!(
            "h{:<3}  {:>10.3}  {:>5.2}  {:>4.0}%  {:?} ({:?})",
            h.host,
            h.cpu,
            h.quota_cores,
            h.utilisation * 100.0,
            h.partitions,
            h.masters
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(subcommand)]
        cmd: Top,
    }

    #[derive(Subcommand)]
    enum Top {
        Kv(KvArgs),
    }

    fn parse(args: &[&str]) -> KvArgs {
        let mut argv = vec!["pliant", "kv"];
        argv.extend(args);
        let Top::Kv(a) = Cli::try_parse_from(argv).expect("parses").cmd;
        a
    }

    #[test]
    fn kv_flags_parse_with_their_defaults() {
        let a = parse(&[
            "scale",
            "out",
            "--to",
            "4",
            "--planner",
            "greedy",
            "--dir",
            "/tmp/x",
        ]);
        assert_eq!(a.dir, PathBuf::from("/tmp/x"));
        let KvCmd::Scale {
            dir: ScaleDir::Out { to, planner },
        } = a.cmd
        else {
            panic!("not scale out")
        };
        assert_eq!(to, Some(4));
        assert_eq!(planner.planner().unwrap(), Planner::Greedy);
        let a = parse(&["up"]);
        assert_eq!(a.dir, PathBuf::from("/run/pliant/kv"));
        let KvCmd::Up {
            hosts,
            partitions,
            k,
            cpu_quota_pct,
            planner,
        } = a.cmd
        else {
            panic!("not up")
        };
        assert_eq!((hosts, partitions, k, cpu_quota_pct), (3, 8, 1, 50));
        assert_eq!(
            planner.planner().unwrap(),
            Planner::Online { time_limit_s: 15.0 }
        );
        let KvCmd::Scale {
            dir: ScaleDir::In { to: None, .. },
        } = parse(&["scale", "in"]).cmd
        else {
            panic!("not scale in")
        };
        let KvCmd::Auto {
            duration_s,
            high,
            low,
            in_after,
            json,
            ..
        } = parse(&["auto", "--duration-s", "30", "--json"]).cmd
        else {
            panic!("not auto")
        };
        assert_eq!(
            (duration_s, high, low, in_after, json),
            (30, 0.8, 0.45, 3, true)
        );
        let KvCmd::Tpcc {
            warehouses,
            clients,
            duration_s,
            json,
        } = parse(&["tpcc"]).cmd
        else {
            panic!("not tpcc")
        };
        assert_eq!((warehouses, clients, duration_s, json), (8, 4, 30, false));
        let KvCmd::RedisBenchmark {
            requests,
            clients,
            pipeline,
            tests,
            ..
        } = parse(&["redis-benchmark", "--tests", "set,incr"]).cmd
        else {
            panic!("not redis-benchmark")
        };
        assert_eq!(
            (requests, clients, pipeline, tests.as_str()),
            (100_000, 50, 1, "set,incr")
        );
        let bad = parse(&["plan", "--to", "3", "--planner", "cplex"]);
        let KvCmd::Plan { planner, .. } = bad.cmd else {
            panic!("not plan")
        };
        assert!(planner.planner().unwrap_err().contains("cplex"));
    }
}
