//! `pliant bench smr` for real, short: one client, one second per run, failover trials on.
//! Checks the JSON contract on the last stdout line and that the figures are measured (no
//! timing thresholds: this machine's load decides the numbers).
//!
//! Needs root (the bench's private network namespace), redis-server and redis-benchmark.
//! `cargo test --release -p pliant-cli --test e2e_bench_smr -- --nocapture`.

use serde_json::Value;
use std::process::Command;

fn num(v: &Value, what: &str) -> f64 {
    v.as_f64()
        .unwrap_or_else(|| panic!("{what} must be a measured number, got {v}"))
}

#[test]
fn bench_smr_reports_every_system_and_both_failovers() {
    if !pliant_testkit::require_root()
        || !pliant_testkit::require_tool("redis-server", "redis-server")
        || !pliant_testkit::require_tool("redis-benchmark", "redis-tools")
    {
        return;
    }
    let out = Command::new(env!("CARGO_BIN_EXE_pliant"))
        .args([
            "bench",
            "smr",
            "--json",
            "--duration",
            "1",
            "--clients",
            "1",
        ])
        .output()
        .expect("run pliant bench smr");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench smr failed: {stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout.lines().last().expect("a JSON line on stdout");
    let r: Value = serde_json::from_str(last).unwrap_or_else(|e| panic!("{e}: {last}"));
    eprintln!("{last}");
    assert_eq!(r["bench"], "smr");
    for sys in [
        "unreplicated",
        "pliant_smr",
        "redis_wait1",
        "redis_sentinel",
    ] {
        let s = &r["systems"][sys];
        assert_eq!(s["errors"], serde_json::json!([]), "{sys}: {s}");
        assert_eq!(s["clients"], 1, "{sys}: the only client count heads it");
        assert!(num(&s["ops_per_s"], "ops_per_s") > 0.0, "{sys}: {s}");
        let (p50, p99) = (
            num(&s["latency_us_p50"], "p50"),
            num(&s["latency_us_p99"], "p99"),
        );
        assert!(0.0 < p50 && p50 <= p99, "{sys}: {p50} {p99}");
        let bytes = num(&s["bytes_replicated_per_op"], "bytes_replicated_per_op");
        if sys == "unreplicated" {
            assert_eq!(bytes, 0.0);
        } else {
            assert!(bytes > 0.0, "{sys} replicated nothing: {s}");
        }
        assert!(s["by_clients"]["1"].is_object(), "{sys}: {s}");
    }
    for sys in ["pliant_smr", "redis_sentinel"] {
        let s = &r["systems"][sys];
        assert!(s["failover_error"].is_null(), "{sys}: {s}");
        assert!(num(&s["failover_ms"], "failover_ms") > 0.0, "{sys}: {s}");
        assert!(num(&s["acked_writes"], "acked_writes") > 0.0, "{sys}: {s}");
        assert!(
            num(&s["acked_writes_lost"], "lost") <= num(&s["acked_writes"], "acked"),
            "{sys}: {s}"
        );
        assert_eq!(s["connections_total"], 4, "{sys}: {s}");
    }
    // A leader's acknowledgement means a majority has the write on disk.
    assert_eq!(r["systems"]["pliant_smr"]["acked_writes_lost"], 0);
    assert!(num(&r["ratio_ops_vs_unreplicated"], "ratio") > 0.0);
    assert!(num(&r["ratio_latency_p50_vs_unreplicated"], "ratio") > 0.0);
}
