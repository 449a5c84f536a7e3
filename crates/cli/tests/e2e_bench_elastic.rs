//! End-to-end: `pliant bench migrate --json` and `pliant bench scale-in --json`, run briefly
//! (few moves, a small batch, few flows per replica), through the real binary. Checks the JSON
//! contract (the last stdout line is one object with the promised fields) and that the runs
//! measured what they claim: moves happened and succeeded, nothing was lost or reordered at the
//! receiver (`packets_reordered` = 0 is the end-to-end check of DESIGN invariant 5), nothing
//! duplicated, no TCP reset, no pliant drop (any reason that could be a moved flow's packet),
//! no source that had to export before its own output left the kernel (`tx_settle_timeouts`),
//! and the scale-in runs released a replica.
//!
//! Needs root (`pliant_testkit::require_root`). Run in release (the unoptimised runtime is slow):
//! `cargo test --release -p pliant-cli --test e2e_bench_elastic -- --test-threads=1 --nocapture`.

mod common;

use common::pliant;
use serde_json::Value;
use std::process::Command;

fn bench(args: &[&str]) -> Value {
    let out = Command::new(pliant())
        .arg("bench")
        .args(args)
        .arg("--json")
        .output()
        .expect("run pliant bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout.lines().last().unwrap_or("");
    let v: Value = serde_json::from_str(last).unwrap_or_else(|e| {
        panic!(
            "bench {args:?}: last line is not JSON ({e}): {last}\nstderr: {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    assert!(
        out.status.success(),
        "bench {args:?} failed: {v:#}\nstderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    v
}

fn num(v: &Value, k: &str) -> f64 {
    v[k].as_f64()
        .unwrap_or_else(|| panic!("{k} missing or not a number: {v:#}"))
}

#[test]
fn bench_migrate_reports_loss_free_moves() {
    if !pliant_testkit::require_root() {
        return;
    }
    let v = bench(&[
        "migrate",
        "--rounds",
        "3",
        "--batch-flows",
        "200",
        "--steering-flows",
        "2000",
        "--steering-exceptions",
        "200",
        "--steering-window",
        "1",
    ]);
    for k in [
        "packets_lost",
        "packets_reordered",
        "tcp_resets",
        "pause_us_p50",
        "pause_us_p99",
        "batch_1000_ms",
        "flows_migrated",
    ] {
        assert!(v.get(k).is_some(), "missing {k}: {v:#}");
    }
    assert_eq!(v["errors"], serde_json::json!([]), "{v:#}");
    // 3 rounds x (UDP + TCP) single moves + 2 batch moves of 200.
    assert_eq!(num(&v, "migrations"), 8.0, "{v:#}");
    assert_eq!(num(&v, "migrations_failed"), 0.0, "{v:#}");
    assert_eq!(num(&v, "flows_migrated"), 6.0 + 400.0, "{v:#}");
    assert_eq!(num(&v, "packets_lost"), 0.0, "{v:#}");
    assert_eq!(num(&v, "packets_reordered"), 0.0, "{v:#}");
    assert_eq!(num(&v, "packets_duplicated"), 0.0, "{v:#}");
    assert_eq!(num(&v, "tcp_resets"), 0.0, "{v:#}");
    // Traffic really flowed through the moves.
    assert!(num(&v["single"]["udp"], "received") > 1000.0, "{v:#}");
    assert!(num(&v["batch"]["udp"], "received") > 200.0, "{v:#}");
    assert_eq!(v["tcp"]["complete"], true, "{v:#}");
    assert!(num(&v, "pause_us_p50") > 0.0, "{v:#}");
    assert!(num(&v, "pause_us_p50") <= num(&v, "pause_us_p99"), "{v:#}");
    assert!(num(&v, "batch_1000_ms") > 0.0, "{v:#}");
    // Every drop reason of both replicas except those that cannot be a moved flow's packet
    // (the bench's DROPS_NOT_OF_MOVED_FLOWS), plus r*.migration.tx_settle_timeouts: a source
    // that exported while its own last output was still queued in the kernel (the destination
    // could have overtaken it).
    for (k, n) in v["pliant_drops"].as_object().expect("pliant_drops") {
        assert_eq!(n, 0, "pliant dropped packets ({k}): {v:#}");
    }
    for r in ["r1", "r2"] {
        // Present (so the loop above saw it) and 0.
        assert_eq!(
            v["pliant_drops"][format!("{r}.migration.tx_settle_timeouts")],
            0,
            "{v:#}"
        );
    }
    // No wait timed out, so every wait for the source's output ended by the output leaving,
    // before the bound; and a longest wait exists only if some export waited.
    let (waits, wait_max) = (
        num(&v, "source_output_waits"),
        num(&v, "source_output_wait_us_max"),
    );
    let bound_us = pliant_runtime::migrate::TX_SETTLE_WAIT.as_micros() as f64;
    assert!(wait_max < bound_us, "{v:#}");
    assert_eq!(waits == 0.0, wait_max == 0.0, "{v:#}");
    for (k, n) in v["fabric_drops"].as_object().expect("fabric_drops") {
        assert_eq!(n, 0, "the fabric dropped packets ({k}): {v:#}");
    }
    // The replicas' packet threads run under the policy the bench asked for, and the
    // machine's scheduling floor was measured beside the moves.
    assert_eq!(num(&v, "realtime_priority"), 20.0, "{v:#}");
    for r in ["r1", "r2"] {
        assert_eq!(v["replica_sched"][r], "fifo:20", "{v:#}");
    }
    assert!(num(&v["sched_probe"], "samples") > 100.0, "{v:#}");
    // Steering at scale ran for real: traffic was received and the exceptions were consulted.
    let s = &v["steering_scale"];
    assert_eq!(s["measured"], true, "{s:#}");
    assert!(num(s, "pps_no_exceptions") > 0.0, "{s:#}");
    assert!(num(s, "pps_with_exceptions") > 0.0, "{s:#}");
    assert!(num(s, "exception_hits") > 0.0, "{s:#}");
}

#[test]
fn bench_scale_in_merges_before_the_kill_based_release() {
    if !pliant_testkit::require_root() {
        return;
    }
    let v = bench(&[
        "scale-in",
        "--per-replica",
        "4",
        "--interval-ms",
        "200",
        "--udp-timeout-s",
        "1",
    ]);
    // Both runs released a replica, and the speedup is exactly their ratio.
    let (p, k) = (
        num(&v, "pliant_first_release_s"),
        num(&v, "kill_based_first_release_s"),
    );
    assert!(p > 0.0 && k > 0.0, "{v:#}");
    let speedup = num(&v, "speedup_vs_kill_based");
    assert!((speedup - k / p).abs() <= 1e-9 * speedup, "{v:#}");
    assert_eq!(v["pliant"]["errors"], serde_json::json!([]), "{v:#}");
    assert_eq!(v["kill_based"]["errors"], serde_json::json!([]), "{v:#}");
    // The merge moved the victim's remaining flows; kill-based moved none.
    assert!(num(&v["pliant"], "flows_migrated") >= 1.0, "{v:#}");
    assert_eq!(num(&v["kill_based"], "flows_migrated"), 0.0, "{v:#}");
    assert_eq!(num(&v, "packets_lost"), 0.0, "{v:#}");
    assert_eq!(num(&v, "packets_reordered"), 0.0, "{v:#}");
    assert_eq!(num(&v, "packets_duplicated"), 0.0, "{v:#}");
    // Merging cannot be slower than waiting for the replica to empty.
    assert!(
        num(&v, "speedup_vs_kill_based") > 1.0,
        "pliant merging not faster than kill-based: {v:#}"
    );
}
