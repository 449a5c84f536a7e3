//! `pliant bench ha`: HA systems side by side on the same workloads, plus failover. Progress goes
//! to stderr; the last line of stdout is one JSON object (see `pliant_bench::ha`).

use clap::Args;
use pliant_bench::ha::{run_ha, HaOpts, HaReport, FAILOVER_SYSTEMS, SYSTEMS};

#[derive(Args)]
pub struct HaArgs {
    /// Print only the JSON object on stdout.
    #[arg(long)]
    pub json: bool,
    /// Seconds per txload window and per iperf3 run (1..=120).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=120))]
    pub duration: u32,
    /// Persistent TCP connections of the transaction workload.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub connections: u32,
    /// Request size in bytes (the seed's flowgrind set-up: 1400).
    #[arg(long, default_value_t = 1400, value_parser = clap::value_parser!(u32).range(8..=1048576))]
    pub request_bytes: u32,
    /// Response size in bytes.
    #[arg(long, default_value_t = 1400, value_parser = clap::value_parser!(u32).range(0..=1048576))]
    pub response_bytes: u32,
    /// Lognormal request/response sizes with the sizes above as medians and this sigma (the
    /// seed's HTTP-like model), clamped to 64 B..=64 KiB; 0 = fixed sizes.
    #[arg(long, default_value_t = 0.0)]
    pub size_sigma: f64,
    /// Run only these systems (comma-separated: no_ha,pico_1k,pico_10k,remus_40,ftmb,
    /// kernel_conntrackd).
    #[arg(long, value_delimiter = ',', value_parser = SYSTEMS)]
    pub only: Vec<String>,
    /// Skip the failover experiments.
    #[arg(long)]
    pub no_failover: bool,
    /// The pliant system whose primary is killed for the top-level `failover` section.
    #[arg(long, default_value = "pico_1k", value_parser = FAILOVER_SYSTEMS)]
    pub failover_system: String,
    /// Failover trials on the pliant system, each in a fresh lab (1..=200).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=200))]
    pub trials: u32,
    /// Measurement rounds: every system once per round, the order reversed every other
    /// round; each reports its median round (the failovers run in the first round only).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=15))]
    pub rounds: u32,
    /// With --hosts: the hosts' replica ports are VXLAN tunnels over their management links
    /// (`pliant lab up --tunnels`) instead of veths.
    #[arg(long, requires = "hosts")]
    pub tunnels: bool,
    /// UDP probe flows timing the failover (every 2 ms each).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..=256))]
    pub probe_flows: u16,
    /// Keep checksum/segmentation offloads on in the pliant labs (default: off, as the e2e
    /// tests run the user-space path).
    #[arg(long)]
    pub keep_offloads: bool,
    /// How the pliant replicas reach each other: unix sockets (one host), tcp (a management
    /// network between the replica namespaces, as between hosts), or both (everything over
    /// tcp, plus ftmb over unix for `ftmb_tcp_vs_unix`).
    #[arg(long, default_value = "unix", value_parser = ["unix", "tcp", "both"])]
    pub transport: String,
    /// Put each pliant replica on a host of its own (3 hosts, each with its own network and
    /// mount namespace and a `pliant agent`; everything over TCP) and lose a whole host in the
    /// failover (links cut, replica and agent SIGKILLed), as the kernel peer loses its master.
    #[arg(long, value_parser = clap::value_parser!(u8).range(3..=3))]
    pub hosts: Option<u8>,
}

fn fmt(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "-".to_string(), |x| format!("{x:.digits$}"))
}

fn table(r: &HaReport) {
    println!(
        "{:<18} {:>9} {:>8} {:>8} {:>8} {:>6} {:>7} {:>11}  note",
        "system", "txn/s", "p50_us", "p95_us", "p99_us", "gbps", "cpu_%", "repl_B/s"
    );
    for (name, s) in r.systems() {
        let note = s
            .error
            .clone()
            .or_else(|| (!s.errors.is_empty()).then(|| format!("{:?}", s.errors)))
            .unwrap_or_default();
        println!(
            "{name:<18} {:>9} {:>8} {:>8} {:>8} {:>6} {:>7} {:>11}  {note}",
            fmt(s.transactions_per_s, 0),
            fmt(s.latency_us_p50, 0),
            fmt(s.latency_us_p95, 0),
            fmt(s.latency_us_p99, 0),
            fmt(s.gbps, 2),
            fmt(s.cpu_pct, 1),
            fmt(s.repl_bytes_per_s, 0),
        );
    }
    let fo = |label: &str, f: &pliant_bench::ha::FailoverReport| {
        println!(
            "failover {label}: recovery {} ms, tcp stall {} ms, flows survived {}/{}{}",
            fmt(f.recovery_ms, 1),
            fmt(f.tcp_stall_ms, 1),
            f.flows_survived.map_or("-".into(), |v| v.to_string()),
            f.flows_total.map_or("-".into(), |v| v.to_string()),
            f.error
                .as_ref()
                .map(|e| format!(" ({e})"))
                .unwrap_or_default()
        );
    };
    fo(&r.failover.primary.system, &r.failover.primary);
    if let Some(f) = r
        .ftmb
        .failover
        .as_ref()
        .filter(|_| r.failover.primary.system != "ftmb")
    {
        fo("ftmb", f);
    }
    println!("transport between replicas: {}", r.transport);
    if let Some(u) = &r.ftmb_unix {
        println!(
            "ftmb over unix: {} txn/s; ftmb tcp/unix ratio {}",
            fmt(u.transactions_per_s, 0),
            fmt(r.ftmb_tcp_vs_unix, 3)
        );
    }
    if let Some(d) = &r.ftmb.ftmb_detail {
        println!(
            "ftmb: output audit {} released outputs checked, {} violations",
            d["audit_checked"], d["audit_violations"]
        );
    }
    let t = &r.failover_trials;
    if t.trials > 1 {
        println!(
            "failover trials: {}/{} completed, flows survived {}/{}, resets {}, recovery p50 {} \
             max {} ms, stall max {} ms",
            t.trials_completed,
            t.trials,
            t.flows_survived,
            t.flows_total,
            t.resets,
            fmt(t.recovery_ms_p50, 1),
            fmt(t.recovery_ms_max, 1),
            fmt(t.tcp_stall_ms_max, 1)
        );
    }
    if t.udp_trials > 0 {
        println!(
            "failover UDP flows ({} trials): reordered {}, lost on other replicas {} / on the \
             failed one {}; other replicas' stall during the failover max {} ms vs their \
             pre-kill gap max {} ms (over it in {} trials; their largest gap after the kill, \
             failover or not: {} ms); failed replica's stall max {} ms",
            t.udp_trials,
            t.reordered,
            t.udp_lost_other_replicas,
            t.udp_lost_failed_replica,
            fmt(t.other_replica_stall_ms_max, 1),
            fmt(t.pre_kill_gap_ms_max, 1),
            t.trials_other_stall_over_pre_kill_gap,
            fmt(t.other_replica_max_gap_ms_max, 1),
            fmt(t.failed_replica_stall_ms_max, 1)
        );
    }
    if let Some(f) = &r.kernel_conntrackd.failover {
        fo("kernel_conntrackd", f);
    }
}

pub fn run(a: HaArgs) -> Result<(), String> {
    if !(a.size_sigma.is_finite() && (0.0..=4.0).contains(&a.size_sigma)) {
        return Err(format!("--size-sigma must be 0..=4, got {}", a.size_sigma));
    }
    let opts = HaOpts {
        duration_s: a.duration,
        connections: a.connections,
        request_bytes: a.request_bytes,
        response_bytes: a.response_bytes,
        size_sigma: a.size_sigma,
        pliant_bin: std::env::current_exe().ok(),
        only: a.only,
        failover: !a.no_failover,
        failover_system: a.failover_system,
        probe_flows: a.probe_flows,
        trials: a.trials,
        disable_offloads: !a.keep_offloads,
        // Hosts talk over TCP.
        transport: if a.transport == "unix" && a.hosts.is_none() {
            pliant_lab::mgmt::Transport::Unix
        } else {
            pliant_lab::mgmt::Transport::Tcp
        },
        ftmb_on_unix_too: a.transport == "both",
        hosts: a.hosts.is_some(),
        rounds: a.rounds,
        tunnels: a.tunnels,
        ..HaOpts::default()
    };
    // Ctrl-C stops between measurements; labs are torn down and the partial report printed.
    pliant_lab::cmd::defer_interrupts();
    let report = run_ha(&opts);
    if !a.json {
        table(&report);
    }
    let json = serde_json::to_string(&report).map_err(|e| format!("report to JSON: {e}"))?;
    println!("{json}");
    if pliant_lab::cmd::interrupted() {
        return Err("interrupted: the report above is partial".into());
    }
    Ok(())
}
