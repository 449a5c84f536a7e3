//! `pliant bench migrate` and `pliant bench scale-in` (elasticity benchmarks). Progress goes to
//! stderr; the last line of stdout is one JSON object.

use clap::Args;
use pliant_bench::migrate::{run_migrate, MigrateOpts};
use pliant_bench::scale_in::{run_scale_in, ScaleInOpts};
use std::time::Duration;

#[derive(Args)]
pub struct MigrateArgs {
    /// Print only the JSON object on stdout.
    #[arg(long)]
    pub json: bool,
    /// Back-and-forth moves of each single flow (one UDP, one TCP).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub rounds: u32,
    /// Flows moved in one request in the batch phase (0 skips it).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(0..=10000))]
    pub batch_flows: u32,
    /// Datagrams per second of the single UDP flow.
    #[arg(long, default_value_t = 5000, value_parser = clap::value_parser!(u32).range(1..=200000))]
    pub single_pps: u32,
    /// Datagrams per second of each batch flow.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub batch_pps: u32,
    /// Steering at scale: concurrent flows through the fabric (0 skips the measurement).
    #[arg(long, default_value_t = 100_000, value_parser = clap::value_parser!(u32).range(0..=110_000))]
    pub steering_flows: u32,
    /// Steering exceptions (moved flows) installed for the second window.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u32).range(0..=60_000))]
    pub steering_exceptions: u32,
    /// Seconds per steering-scale window.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=60))]
    pub steering_window: u32,
    /// SCHED_FIFO priority of the replicas and of the thread that orchestrates the moves
    /// (0: the normal scheduler).
    #[arg(long, default_value_t = pliant_bench::migrate::DEFAULT_REALTIME_PRIORITY as u32,
          value_parser = clap::value_parser!(u32).range(0..=99))]
    pub realtime_priority: u32,
    /// How the two replicas reach each other: unix sockets (one host) or tcp (a management
    /// network between private host views, as between machines).
    #[arg(long, default_value = "unix", value_parser = ["unix", "tcp"])]
    pub transport: String,
}

#[derive(Args)]
pub struct ScaleInArgs {
    /// Print only the JSON object on stdout.
    #[arg(long)]
    pub json: bool,
    /// Flows per replica at the start (4 replicas; the merge policy's high-water mark).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(2..=2000))]
    pub per_replica: u32,
    /// Milliseconds between two flows ending (round-robin over the replicas).
    #[arg(long, default_value_t = 250, value_parser = clap::value_parser!(u64).range(10..=60000))]
    pub interval_ms: u64,
    /// The NAT's UDP mapping timeout in seconds (state of an ended flow lingers that long).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=600))]
    pub udp_timeout_s: u64,
    /// Skip the kill-based run (no speedup then).
    #[arg(long)]
    pub skip_kill_based: bool,
}

fn pliant_bin() -> Result<std::path::PathBuf, String> {
    std::env::current_exe().map_err(|e| format!("cannot find the pliant binary: {e}"))
}

fn print_json(v: &impl serde::Serialize) -> Result<(), String> {
    let json = serde_json::to_string(v).map_err(|e| format!("report to JSON: {e}"))?;
    println!("{json}");
    if pliant_lab::cmd::interrupted() {
        return Err("interrupted: the report above is partial".into());
    }
    Ok(())
}

fn opt(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |x| format!("{x:.1}"))
}

pub fn migrate(a: MigrateArgs) -> Result<(), String> {
    let mut o = MigrateOpts::new(pliant_bin()?);
    o.rounds = a.rounds;
    o.batch_flows = a.batch_flows as usize;
    o.single_pps = f64::from(a.single_pps);
    o.batch_pps_per_flow = f64::from(a.batch_pps);
    o.gap = Duration::from_millis(150);
    o.steering_flows = a.steering_flows;
    o.steering_exceptions = a.steering_exceptions;
    o.steering_window_s = a.steering_window;
    o.realtime_priority = u8::try_from(a.realtime_priority).ok().filter(|&p| p > 0);
    o.transport = pliant_lab::mgmt::Transport::parse(&a.transport)
        .ok_or_else(|| format!("--transport {}: unix or tcp", a.transport))?;
    pliant_lab::cmd::defer_interrupts();
    let r = run_migrate(&o);
    if !a.json {
        println!(
            "[{}] moves {} ({} failed), flows migrated {}; pause us p50 {} p99 {} max {}; \
             receiver gap us p50 {} p99 {} (baseline p99 {}); batch of {}: {} ms; lost {:?} \
             reordered {:?} tcp resets {:?}",
            r.transport,
            r.migrations,
            r.migrations_failed,
            r.flows_migrated,
            opt(r.pause_us_p50),
            opt(r.pause_us_p99),
            opt(r.pause_us_max),
            opt(r.receiver_gap_us_p50),
            opt(r.receiver_gap_us_p99),
            opt(r.baseline_gap_us_p99),
            r.batch_flows,
            opt(r.batch_1000_ms),
            r.packets_lost,
            r.packets_reordered,
            r.tcp_resets
        );
        for e in &r.errors {
            println!("error: {e}");
        }
    }
    print_json(&r)?;
    if r.errors.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "{} error(s), see \"errors\" in the JSON",
            r.errors.len()
        ))
    }
}

pub fn scale_in(a: ScaleInArgs) -> Result<(), String> {
    let mut o = ScaleInOpts::new(pliant_bin()?);
    o.per_replica = a.per_replica as usize;
    o.interval = Duration::from_millis(a.interval_ms);
    o.udp_timeout_s = a.udp_timeout_s;
    o.skip_kill_based = a.skip_kill_based;
    pliant_lab::cmd::defer_interrupts();
    let r = run_scale_in(&o);
    if !a.json {
        println!(
            "first replica released: pliant {} s, kill-based {} s, speedup {}; lost {:?} \
             reordered {:?}",
            opt(r.pliant_first_release_s),
            opt(r.kill_based_first_release_s),
            r.speedup_vs_kill_based
                .map_or_else(|| "-".into(), |x| format!("{x:.2}x")),
            r.packets_lost,
            r.packets_reordered
        );
    }
    let errors = r.pliant.errors.len() + r.kill_based.as_ref().map_or(0, |k| k.errors.len());
    print_json(&r)?;
    if errors == 0 {
        Ok(())
    } else {
        Err(format!("{errors} error(s), see \"errors\" in the JSON"))
    }
}
