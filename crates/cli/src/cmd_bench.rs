//! `pliant bench forward|pg|migrate|scale-in|ha|kv|slice`: forward is kernel forwarding vs kernel NAT
//! vs pliant NAT on the lab topology; the others live next to their crates.
//! Progress goes to stderr; the last line of stdout is one JSON object.

use clap::{Args, Subcommand};
use pliant_bench::{chart, run_forward, ForwardOpts};
use std::path::PathBuf;

#[derive(Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    cmd: BenchCmd,
}

#[derive(Subcommand)]
enum BenchCmd {
    /// Forwarding/NAT throughput (iperf3), 64-byte packet rate (trafgen) and RTT (ping) for
    /// kernel forwarding, kernel nftables NAT and pliant NAT, measured in one run.
    Forward(ForwardArgs),
    /// PostgreSQL HA: pgbench TPS/latency unprotected vs synchronous replication vs through the
    /// pliant proxy, plus failover trials (failover_ms, sessions kept, acked commits lost).
    Pg(PgBenchArgs),
    /// Live flow migration: pause per flow (suspend to resume) for one flow and a batch of
    /// 1000, packets lost/reordered and TCP resets counted on the wire.
    Migrate(crate::cmd_bench_elastic::MigrateArgs),
    /// Consolidation after the seed: 4 replicas, flows expiring round-robin; time to release
    /// the first replica with pliant merging vs waiting for it to empty (kill-based).
    ScaleIn(crate::cmd_bench_elastic::ScaleInArgs),
    /// High availability: no HA vs Pico at 1 kHz and 10 kHz vs Remus mode at 40 Hz vs the kernel
    /// peer (nftables NAT pair with conntrackd + keepalived), plus a failover experiment.
    Ha(crate::cmd_bench_ha::HaArgs),
    /// Redis state machine replication: redis-benchmark SET/GET unreplicated vs pliant smr
    /// (3 replicas) vs Redis replication with WAIT 1 0 vs Redis + Sentinel, at 1, 4 and 8
    /// clients, plus failover trials (failover_ms, acked writes lost, connections kept).
    Smr(SmrBenchArgs),
    /// Elastic Redis Cluster under the seed's sine load, compressed: the offline, online and
    /// greedy planners and `redis-cli --cluster rebalance` against a fully scaled-out cluster
    /// (data moved, throughput, host-seconds, moves, acknowledged writes lost), plus the online
    /// MILP's solve time on 256 partitions.
    Kv(KvBenchArgs),
    /// Live TCP session moves between two instances (pliant-slice): pause per move, resets,
    /// corrupted bytes, client retransmission stalls, the throughput dip of a bulk flow moved
    /// mid-transfer and the drain of 1,000 sessions.
    Slice(crate::cmd_bench_slice::SliceArgs),
}

#[derive(Args)]
struct SmrBenchArgs {
    /// Print only the JSON object on stdout.
    #[arg(long)]
    json: bool,
    /// Seconds of load per system and client count (1..=120).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=120))]
    duration: u32,
    /// One second per run and 1 and 4 clients only (development).
    #[arg(long)]
    quick: bool,
    /// Client counts (comma-separated, each 1..=256).
    #[arg(long, value_delimiter = ',', default_value = "1,4,8",
          value_parser = clap::value_parser!(u32).range(1..=256))]
    clients: Vec<u32>,
    /// Replicas of the pliant smr group (1..=7).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=7))]
    replicas: u64,
    /// Skip the failover trials.
    #[arg(long)]
    no_failover: bool,
}

#[derive(Args)]
struct KvBenchArgs {
    /// Print only the JSON object on stdout.
    #[arg(long)]
    json: bool,
    /// Seconds of sine load per system (five systems run: about 5 × (this + 40 s) in all).
    #[arg(long, value_parser = clap::value_parser!(u32).range(20..=600))]
    duration: Option<u32>,
    /// Short run: 60 s per system.
    #[arg(long)]
    quick: bool,
    /// Sine periods per run.
    #[arg(long, default_value_t = 1.0)]
    periods: f64,
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=64))]
    partitions: u32,
    #[arg(long, default_value_t = 2)]
    min_hosts: usize,
    #[arg(long, default_value_t = 4)]
    max_hosts: usize,
    /// CPU quota of every host, percent of one core.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=400))]
    cpu_quota_pct: u32,
    /// Trough and peak of the sine, ops/s (calibrated on the baseline cluster when not given).
    #[arg(long)]
    low_ops: Option<f64>,
    #[arg(long)]
    high_ops: Option<f64>,
    /// Writer threads.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=64))]
    writers: u32,
    /// One MILP solver run, seconds.
    #[arg(long, default_value_t = 15.0)]
    time_limit_s: f64,
    /// Steps of the offline planner's horizon over the run.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=32))]
    offline_steps: u32,
    /// Run only these systems (comma-separated: offline,online,greedy,redis_rebalance); the
    /// fully scaled-out baseline always runs.
    #[arg(long, value_delimiter = ',', value_parser = pliant_kv::bench::SYSTEMS)]
    only: Vec<String>,
    /// Skip the 256-partition solve-time measurement.
    #[arg(long)]
    no_p256: bool,
    /// Spread the writes evenly over the partitions instead of the seed's temporally skewed
    /// normal load (a hot spot sliding once over every partition during the run).
    #[arg(long)]
    even: bool,
    /// Also write a PNG chart: offered and achieved writes/s, hosts in use and data moved over
    /// time, one line per system.
    #[arg(long)]
    png: Option<PathBuf>,
}

#[derive(Args)]
struct PgBenchArgs {
    /// Print only the JSON object on stdout.
    #[arg(long)]
    json: bool,
    /// pgbench scale factor.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=1000))]
    scale: u32,
    /// pgbench clients (sessions).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=200))]
    clients: u32,
    /// Seconds per pgbench run (1..=300).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=300))]
    duration: u32,
    /// Kill trials under the bank workload (each is a failover plus re-protection).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(0..=1000))]
    trials: u32,
    /// Leader kills of the Patroni + etcd peer (ttl 5, loop_wait 1); 0 skips the peer.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(0..=100))]
    patroni_trials: u32,
    /// TLS everywhere (servers hostssl-only with a private CA; pgbench with sslmode=require
    /// against the servers, the proxy and pgbouncer; the proxy verifies the servers): the
    /// ratios then compare TLS with TLS. The Patroni peer runs without.
    #[arg(long)]
    tls: bool,
}

#[derive(Args)]
struct ForwardArgs {
    /// Print only the JSON object on stdout (no human-readable table before it).
    #[arg(long)]
    json: bool,
    /// Also draw a bar chart to this PNG file.
    #[arg(long)]
    png: Option<PathBuf>,
    /// Seconds per iperf3 run and per packet-rate window (1..=60).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=60))]
    duration: u32,
    /// Distinct UDP flows (source ports) in the 64-byte test.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u16).range(1..=50000))]
    flows: u16,
    /// Run only these systems (comma-separated: kernel_forward,kernel_nat,pliant_nat).
    #[arg(long, value_delimiter = ',', value_parser = pliant_bench::forward::SYSTEMS)]
    only: Vec<String>,
    /// Turn off checksum/segmentation offloads in every lab (same for all systems).
    #[arg(long)]
    disable_offloads: bool,
}

pub fn run(a: BenchArgs) -> Result<(), String> {
    match a.cmd {
        BenchCmd::Forward(f) => forward(f),
        BenchCmd::Pg(p) => pg(p),
        BenchCmd::Migrate(m) => crate::cmd_bench_elastic::migrate(m),
        BenchCmd::ScaleIn(s) => crate::cmd_bench_elastic::scale_in(s),
        BenchCmd::Ha(h) => crate::cmd_bench_ha::run(h),
        BenchCmd::Smr(s) => smr(s),
        BenchCmd::Kv(k) => kv(k),
        BenchCmd::Slice(s) => crate::cmd_bench_slice::run(s),
    }
}

fn kv(k: KvBenchArgs) -> Result<(), String> {
    let d = pliant_kv::bench::BenchOpts::default();
    let opts = pliant_kv::bench::BenchOpts {
        duration_s: f64::from(k.duration.unwrap_or(if k.quick { 60 } else { 120 })),
        periods: k.periods,
        partitions: k.partitions as usize,
        min_hosts: k.min_hosts,
        max_hosts: k.max_hosts,
        cpu_quota_pct: k.cpu_quota_pct,
        low_ops: k.low_ops,
        high_ops: k.high_ops,
        writers: k.writers as usize,
        time_limit_s: k.time_limit_s,
        offline_steps: k.offline_steps as usize,
        only: k.only,
        p256: !k.no_p256,
        skewed: !k.even,
        ..d
    };
    // Ctrl-C ends the current run between its steps; its cluster is torn down and the partial
    // report printed.
    pliant_lab::cmd::defer_interrupts();
    let report = pliant_kv::bench::run(&opts)?;
    if let Some(p) = &k.png {
        match chart::draw_lines_png(
            &format!(
                "pliant bench kv ({} partitions, k = {}, {:.0} s per system, {} load)",
                opts.partitions,
                opts.k,
                opts.duration_s,
                if opts.skewed { "skewed" } else { "even" }
            ),
            "seconds into the run",
            &kv_panels(&kv_timelines(&report)),
            p,
        ) {
            Ok(()) => eprintln!("[bench kv] chart written to {}", p.display()),
            Err(e) => eprintln!("[bench kv] chart not written: {e}"),
        }
    }
    if !k.json {
        eprintln!(
            "{:<16} {:>14} {:>9} {:>10} {:>6} {:>6}",
            "system", "data_moved_B", "tput_%", "host_s", "moves", "lost"
        );
        let p = &report.planners;
        for (name, r) in [
            ("full", &report.full),
            ("offline", &p.offline),
            ("online", &p.online),
            ("greedy", &p.greedy),
            ("redis_rebalance", &p.redis_rebalance),
        ] {
            if let Some(r) = r {
                eprintln!(
                    "{name:<16} {:>14} {:>9} {:>10.0} {:>6} {:>6}",
                    r.data_moved_bytes,
                    fmt(r.throughput_vs_full_pct, 1),
                    r.host_seconds,
                    r.moves,
                    r.acked_lost
                );
            }
        }
    }
    let json = serde_json::to_string(&report).map_err(|e| format!("report to JSON: {e}"))?;
    println!("{json}");
    if pliant_lab::cmd::interrupted() {
        return Err("interrupted: the report above is partial".into());
    }
    Ok(())
}

/// Each system's timeline in a bench kv report, baseline first.
fn kv_timelines(r: &pliant_kv::bench::Report) -> Vec<(&'static str, &[pliant_kv::bench::Sample])> {
    let p = &r.planners;
    [
        ("full", &r.full),
        ("offline", &p.offline),
        ("online", &p.online),
        ("greedy", &p.greedy),
        ("redis_rebalance", &p.redis_rebalance),
    ]
    .into_iter()
    .filter_map(|(n, s)| s.as_ref().map(|s| (n, s.timeline.as_slice())))
    .collect()
}

/// bench kv's charts: writes/s (the offered sine, then each system's achieved), hosts in use
/// and data moved, over the run.
fn kv_panels(systems: &[(&str, &[pliant_kv::bench::Sample])]) -> Vec<chart::Panel> {
    use pliant_kv::bench::Sample;
    let series = |get: fn(&Sample) -> f64| -> Vec<chart::Series> {
        systems
            .iter()
            .map(|(n, tl)| chart::Series {
                name: n.to_string(),
                points: tl.iter().map(|s| (s.t_s, get(s))).collect(),
            })
            .collect()
    };
    // The offered load is the same sine for every system: drawn once, first (black).
    let offered = chart::Series {
        name: "offered".into(),
        points: systems
            .iter()
            .map(|(_, tl)| *tl)
            .max_by_key(|tl| tl.len())
            .unwrap_or_default()
            .iter()
            .map(|s| (s.t_s, s.offered_ops_per_s))
            .collect(),
    };
    // The last sample of each timeline comes after the load (when the scaler's last operation
    // ended, offered and achieved 0): not a write rate.
    let writes: Vec<chart::Series> = std::iter::once(offered)
        .chain(series(|s| s.achieved_ops_per_s))
        .map(|mut w| {
            w.points.pop();
            w
        })
        .collect();
    // Hosts and data moved change at one instant within a sample's second: drawn as steps.
    let stepped = |mut v: Vec<chart::Series>| {
        for s in &mut v {
            let mut out: Vec<(f64, f64)> = Vec::with_capacity(s.points.len() * 2);
            for &(t, y) in &s.points {
                if let Some(&(_, prev)) = out.last() {
                    out.push((t, prev));
                }
                out.push((t, y));
            }
            s.points = out;
        }
        v
    };
    vec![
        chart::Panel {
            title: "acknowledged writes/s (offered: the sine)".into(),
            series: writes,
        },
        chart::Panel {
            title: "hosts in use".into(),
            series: stepped(series(|s| s.hosts as f64)),
        },
        chart::Panel {
            title: "data moved (MB)".into(),
            series: stepped(series(|s| s.data_moved_bytes as f64 / 1e6)),
        },
    ]
}

fn fmt(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "-".to_string(), |x| format!("{x:.digits$}"))
}

fn forward(f: ForwardArgs) -> Result<(), String> {
    let opts = ForwardOpts {
        duration_s: f.duration,
        flows: f.flows,
        pliant_bin: std::env::current_exe().ok(),
        only: f.only,
        disable_offloads: f.disable_offloads,
    };
    // Ctrl-C stops the current measurement; labs are torn down and the partial report printed.
    pliant_lab::cmd::defer_interrupts();
    let report = run_forward(&opts);
    if let Some(p) = &f.png {
        match chart::draw_png(&report, p) {
            Ok(()) => eprintln!("[bench] chart written to {}", p.display()),
            Err(e) => eprintln!("[bench] chart not written: {e}"),
        }
    }
    if !f.json {
        println!(
            "{:<15} {:>9} {:>9} {:>10} {:>9} {:>9}  note",
            "system", "gbps_1st", "gbps_4st", "kpps_64b", "rtt_p50", "rtt_p99"
        );
        for (name, s) in report.systems() {
            let note = s
                .error
                .clone()
                .or_else(|| (!s.errors.is_empty()).then(|| format!("{:?}", s.errors)))
                .unwrap_or_default();
            println!(
                "{name:<15} {:>9} {:>9} {:>10} {:>9} {:>9}  {note}",
                fmt(s.gbps_1stream, 2),
                fmt(s.gbps_4streams, 2),
                fmt(s.pps_64b.map(|p| p / 1e3), 1),
                fmt(s.rtt_us_p50, 1),
                fmt(s.rtt_us_p99, 1),
            );
        }
        println!(
            "pliant vs kernel NAT: pps x{}, gbps(1 stream) x{}, added rtt p50 {} us",
            fmt(report.ratio_pps_vs_kernel_nat, 2),
            fmt(report.ratio_gbps_vs_kernel_nat, 2),
            fmt(report.added_rtt_us_p50, 1)
        );
    }
    let json = serde_json::to_string(&report).map_err(|e| format!("report to JSON: {e}"))?;
    println!("{json}");
    if pliant_lab::cmd::interrupted() {
        return Err("interrupted: the report above is partial".into());
    }
    Ok(())
}

fn pg(p: PgBenchArgs) -> Result<(), String> {
    let opts = pliant_pg::bench::BenchOpts {
        scale: p.scale,
        clients: p.clients,
        duration_s: p.duration,
        trials: p.trials,
        patroni_trials: p.patroni_trials,
        tls: p.tls,
        ..pliant_pg::bench::BenchOpts::default()
    };
    let report = pliant_pg::bench::run(opts)?;
    if !p.json {
        eprintln!("[bench pg] done");
    }
    // The JSON contract: one object on the last line of stdout.
    println!("{report}");
    if pliant_lab::cmd::interrupted() {
        return Err("interrupted: the report above is partial".into());
    }
    Ok(())
}

fn smr(a: SmrBenchArgs) -> Result<(), String> {
    use pliant_smr::bench;
    let mut o = bench::BenchOpts {
        clients: a.clients,
        duration: std::time::Duration::from_secs(u64::from(a.duration)),
        replicas: a.replicas,
        failover: !a.no_failover,
        interrupted: pliant_lab::cmd::interrupted,
        ..bench::BenchOpts::default()
    };
    if a.quick {
        o.duration = std::time::Duration::from_secs(1);
        o.clients.retain(|&c| c <= 4);
        if o.clients.is_empty() {
            o.clients = vec![1, 4];
        }
    }
    o.headline = if o.clients.contains(&4) {
        4
    } else {
        o.clients[0]
    };
    // Before any thread starts: every thread and child after this is in the namespace.
    bench::enter_private_netns()?;
    // Ctrl-C / SIGTERM stop the bench between measurements; servers are then killed and the
    // scratch directory removed as on success, and the partial report printed.
    pliant_lab::cmd::defer_interrupts();
    let report = bench::run(&o)?;
    if !a.json {
        println!(
            "{:<15} {:>10} {:>8} {:>8} {:>8} {:>11} {:>6}",
            "system", "ops/s", "p50_us", "p99_us", "B/op", "failover_ms", "lost"
        );
        for (name, s) in report["systems"].as_object().into_iter().flatten() {
            let num = |k: &str, d: usize| fmt(s[k].as_f64(), d);
            println!(
                "{name:<15} {:>10} {:>8} {:>8} {:>8} {:>11} {:>6}",
                num("ops_per_s", 0),
                num("latency_us_p50", 0),
                num("latency_us_p99", 0),
                num("bytes_replicated_per_op", 1),
                num("failover_ms", 0),
                num("acked_writes_lost", 0),
            );
        }
        println!(
            "pliant_smr vs unreplicated: ops x{}, p50 latency x{}",
            fmt(report["ratio_ops_vs_unreplicated"].as_f64(), 3),
            fmt(report["ratio_latency_p50_vs_unreplicated"].as_f64(), 2)
        );
    }
    // The JSON contract: one object on the last line of stdout.
    println!("{report}");
    if pliant_lab::cmd::interrupted() {
        return Err("interrupted: the report above is partial".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use pliant_kv::bench::Sample;

    fn sample(t_s: f64, achieved: f64, hosts: usize, moved: u64) -> Sample {
        Sample {
            t_s,
            offered_ops_per_s: if achieved > 0.0 { 100.0 } else { 0.0 },
            achieved_ops_per_s: achieved,
            hosts,
            data_moved_bytes: moved,
        }
    }

    #[test]
    fn kv_panels_leave_out_the_post_load_sample_and_step_hosts_and_data() {
        let online = [
            sample(1.0, 90.0, 2, 0),
            sample(2.0, 95.0, 3, 2_000_000),
            // After the load: the scaler's last operation ended.
            sample(5.0, 0.0, 2, 5_000_000),
        ];
        let full = [sample(1.0, 100.0, 4, 0), sample(2.0, 0.0, 4, 0)];
        let p = kv_panels(&[("full", &full), ("online", &online)]);
        assert_eq!(p.len(), 3);
        let names: Vec<&str> = p[0].series.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["offered", "full", "online"]);
        // No write rate of 0 from the post-load sample.
        assert_eq!(p[0].series[0].points, [(1.0, 100.0), (2.0, 100.0)]);
        assert_eq!(p[0].series[1].points, [(1.0, 100.0)]);
        assert_eq!(p[0].series[2].points, [(1.0, 90.0), (2.0, 95.0)]);
        // Hosts as steps, to the end of the scaler's work.
        assert_eq!(
            p[1].series[1].points,
            [(1.0, 2.0), (2.0, 2.0), (2.0, 3.0), (5.0, 3.0), (5.0, 2.0)]
        );
        assert_eq!(p[2].series[1].points.last(), Some(&(5.0, 5.0)));
    }
}
