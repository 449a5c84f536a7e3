//! `pliant bench slice` for real, short: few moves, one bulk move, a drain of 100 sessions, a
//! failover of 100 replicated sessions.
//! Checks the JSON contract on the last stdout line, that nothing was reset or corrupted and
//! that the figures are measured (no timing thresholds: this machine's load decides them).
//!
//! Needs root (the bench's private network namespace, TCP_REPAIR, tc-BPF).
//! `cargo test --release -p pliant-cli --test e2e_bench_slice -- --nocapture`.

use serde_json::Value;
use std::process::Command;

fn num(v: &Value, what: &str) -> f64 {
    v.as_f64()
        .unwrap_or_else(|| panic!("{what} must be a measured number, got {v}"))
}

#[test]
fn bench_slice_reports_moves_without_a_reset_or_a_corrupted_byte() {
    if !pliant_testkit::require_root() {
        return;
    }
    let out = Command::new(env!("CARGO_BIN_EXE_pliant"))
        .args([
            "bench",
            "slice",
            "--json",
            "--migrations",
            "100",
            "--streams",
            "2",
            "--bulk-moves",
            "1",
            "--drain-sessions",
            "100",
            "--budget-s",
            "20",
            "--failover-sessions",
            "100",
        ])
        .output()
        .expect("run pliant bench slice");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench slice failed: {stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout.lines().last().expect("a JSON line on stdout");
    let r: Value = serde_json::from_str(last).unwrap_or_else(|e| panic!("{e}: {last}"));
    eprintln!("{last}");
    assert_eq!(r["bench"], "slice");
    assert_eq!(r["errors"], serde_json::json!([]), "{r}");
    assert_eq!(r["resets"], 0, "{r}");
    assert_eq!(r["bytes_corrupted"], 0, "{r}");
    assert_eq!(r["migrations"], 100, "{r}");
    assert_eq!(r["migrations_failed"], 0, "{r}");
    let (p50, p99) = (
        num(&r["pause_us_p50"], "pause_us_p50"),
        num(&r["pause_us_p99"], "pause_us_p99"),
    );
    assert!(0.0 < p50 && p50 <= p99, "{p50} {p99}");
    assert!(r["rto_stalls"].is_u64(), "{r}");
    num(&r["iperf_dip_pct"], "iperf_dip_pct");
    assert!(num(&r["bulk_mbps_before"], "bulk_mbps_before") > 0.0);
    assert!(num(&r["drain_1000_ms"], "drain_1000_ms") > 0.0);
    assert_eq!(r["drain_moved"], 100, "{r}");
    assert!(num(&r["lines_checked"], "lines_checked") > 0.0);
    // The SIGKILLed primary's sessions, every one continued on the backup.
    assert!(r["failover"]["error"].is_null(), "{r}");
    assert_eq!(r["failover_sessions_total"], 100, "{r}");
    assert_eq!(r["failover_sessions_kept"], 100, "{r}");
    assert!(num(&r["failover_recovery_ms"], "failover_recovery_ms") > 0.0);
    assert!(num(&r["failover"]["takeover_ms"], "takeover_ms") > 0.0);
    assert_eq!(r["failover"]["takeover_failed"], 0, "{r}");
    assert_eq!(r["failover"]["commit_violations"], 0, "{r}");
    assert!(
        num(&r["failover"]["resets_kept"], "resets_kept") >= 100.0,
        "{r}"
    );
    assert!(r["hold"] == "queue" || r["hold"] == "drop", "{r}");
}
