//! `pliant bench slice`: live TCP session moves (pliant-slice). Progress goes to stderr; the
//! last line of stdout is one JSON object.

use clap::Args;
use pliant_slice::bench::{self, BenchOpts};
use std::time::Duration;

#[derive(Args)]
pub struct SliceArgs {
    /// Print only the JSON object on stdout.
    #[arg(long)]
    pub json: bool,
    /// Moves of the streaming sessions.
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub migrations: u32,
    /// Streaming client connections.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub streams: u32,
    /// Moves of the bulk flow, each mid-transfer (0 skips the bulk phase).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(0..=100))]
    pub bulk_moves: u32,
    /// Window after a bulk move's start over which its throughput is measured.
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u64).range(10..=10_000))]
    pub dip_window_ms: u64,
    /// Sessions moved in one batch in the drain phase (0 skips it).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(0..=5000))]
    pub drain_sessions: u32,
    /// Seconds after which the streaming phase stops moving (what was measured is reported).
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub budget_s: u64,
    /// Sessions of the failover phase: a primary `pliant slice serve` process replicating
    /// them to a backup is SIGKILLed (0 skips it).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(0..=5000))]
    pub failover_sessions: u32,
}

fn opt(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |x| format!("{x:.1}"))
}

pub fn run(a: SliceArgs) -> Result<(), String> {
    let o = BenchOpts {
        migrations: a.migrations as usize,
        streams: a.streams as usize,
        bulk_moves: a.bulk_moves as usize,
        dip_window_ms: a.dip_window_ms,
        drain_sessions: a.drain_sessions as usize,
        budget: Duration::from_secs(a.budget_s),
        failover_sessions: a.failover_sessions as usize,
        // This very binary's `slice serve` is the primary process.
        serve_cmd: std::env::current_exe()
            .ok()
            .map(|p| (p, vec!["slice".to_string(), "serve".to_string()])),
    };
    let r = bench::run(&o)?;
    if !a.json {
        println!(
            "[slice] hold {}; moves {} ({} failed); resets {}; bytes corrupted {}; pause us p50 {} \
             p99 {} max {}; rto stalls {} (client RTOs {}); bulk dip {} % over {} ms; drain of \
             {} sessions {} ms; load {} -> {}",
            r.hold,
            r.migrations_total,
            r.migrations_failed,
            r.resets,
            r.bytes_corrupted,
            opt(r.pause_us_p50),
            opt(r.pause_us_p99),
            opt(r.pause_us_max),
            r.rto_stalls,
            r.client_rtos,
            opt(r.iperf_dip_pct),
            r.dip_window_ms,
            r.drain_sessions,
            opt(r.drain_1000_ms),
            r.loadavg_start,
            r.loadavg_end
        );
        match &r.failover.error {
            Some(e) => println!("[slice] failover: {e}"),
            None => println!(
                "[slice] failover: {} of {} sessions kept, recovery {} ms (takeover {} ms), {} \
                 output-commit violations",
                r.failover_sessions_kept.unwrap_or(0),
                r.failover_sessions_total.unwrap_or(0),
                opt(r.failover_recovery_ms),
                opt(r.failover.takeover_ms),
                r.failover.commit_violations.unwrap_or(0)
            ),
        }
        for e in &r.errors {
            println!("error: {e}");
        }
    }
    let json = serde_json::to_string(&r).map_err(|e| format!("report to JSON: {e}"))?;
    println!("{json}");
    Ok(())
}
