//! End-to-end: a SYN flood from one inside host through the NAT while a second inside host keeps
//! fetching over HTTP, against the kernel NAT (nftables masquerade) and the pliant NAT in the
//! same run, one lab each (the flood code is `pliant_bench::flood`, also used by
//! `pliant bench forward`).
//!
//! Asserts for pliant: at least 95% of the other host's fetches during the flood succeed, the
//! other host is served again within 100 ms after the flood — or, when the machine is so busy
//! that the kernel NAT in the same run needed longer, no later than the kernel NAT — and the
//! replica's peak RSS stays below a fixed cap. The kernel NAT's numbers are printed. The pliant
//! replica runs with `realtime_priority = 10` (see `flood`). Needs root.

use pliant_bench::flood::{measure_flood, FloodOpts, FloodReport};
use pliant_lab::{Lab, LabSpec, PliantNf, ReplicaMode};
use std::path::PathBuf;

/// Peak RSS cap of the pliant replica, MiB: the flood asks for 100k mappings; the flow table
/// is bounded, an unbounded one keeping every SYN's mapping (and its queue entries) would not
/// stay under this.
const RSS_CAP_MB: f64 = 256.0;

/// SYN rate of the test: `PLIANT_FLOOD_PPS`, default 10000/s (the bench runs 25000/s). At
/// 25000/s on a loaded 2-core machine the replica's inside RX ring (512 slots, ~20 ms at that
/// rate) overflows whenever the replica waits for a CPU, and the other host's fetches then
/// measure ring losses more than NAT state (at load ~9.5, normal scheduler: 84.6% at 25000/s,
/// 93.8% (15/16) at 10000/s; SCHED_FIFO: 100% at 25000/s).
fn flood_opts() -> FloodOpts {
    let rate_pps = std::env::var("PLIANT_FLOOD_PPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    FloodOpts {
        rate_pps,
        ..FloodOpts::default()
    }
}

fn flood(mode: ReplicaMode) -> FloodReport {
    let mut spec = LabSpec::new(mode);
    spec.pliant_bin = Some(PathBuf::from(env!("CARGO_BIN_EXE_pliant")));
    spec.progress = false;
    // The replica under SCHED_FIFO (`PLIANT_FLOOD_RT`: a priority, or `off`): the kernel NAT
    // it is compared with runs in softirq context, ahead of every task; a replica under the
    // normal scheduler on this loaded machine loses the other host's packets at its RX ring
    // while it waits for a CPU (see `flood_opts`).
    spec.realtime_priority = match std::env::var("PLIANT_FLOOD_RT") {
        Ok(v) => v.parse().ok(),
        Err(_) => Some(10),
    };
    let lab = Lab::up(spec).unwrap_or_else(|e| panic!("lab up: {e}"));
    let r = measure_flood(&lab, &flood_opts());
    if let Err(e) = lab.down() {
        eprintln!("teardown: {e}");
    }
    r
}

#[test]
fn other_host_keeps_fetching_through_a_syn_flood() {
    if !pliant_testkit::require_root()
        || !pliant_testkit::require_tool("trafgen", "netsniff-ng")
        || !pliant_testkit::require_tool("curl", "curl")
        || !pliant_testkit::require_tool("nginx", "nginx-light")
    {
        return;
    }
    let kernel = flood(ReplicaMode::KernelNat);
    // A 10000-port pool: the replica gets through ~8-9k new mappings/s on a 2-core machine
    // (the rest of the 25k SYN/s overflow its RX ring), so the default 40000-port pool would
    // not run dry within the flood and the eviction path would go untested.
    let mut nf = PliantNf::nat();
    let nat = nf.sections["nat"].as_table_mut().expect("[nat]");
    nat.insert("port_min".into(), 20000.into());
    nat.insert("port_max".into(), 29999.into());
    let pliant = flood(ReplicaMode::Pliant { config: nf });
    for (name, r) in [("kernel_nat", &kernel), ("pliant_nat", &pliant)] {
        eprintln!("flood {name}: {}", serde_json::to_string(r).expect("json"));
    }
    assert_eq!(pliant.error, None, "pliant flood run failed");
    let ok = pliant.other_host_fetch_ok_pct.expect("fetch ok pct");
    assert!(
        ok >= 95.0,
        "only {ok:.1}% of the other host's fetches succeeded: {pliant:?}"
    );
    let recovery = pliant
        .recovery_ms
        .unwrap_or_else(|| panic!("no fetch after the flood: {pliant:?}"));
    let bar = kernel.recovery_ms.map_or(100.0, |k| k.max(100.0));
    assert!(
        recovery <= bar,
        "served again {recovery:.0} ms after the flood (bar {bar:.0} ms: 100 ms, or the kernel \
         NAT's {:?} ms in this run): {pliant:?}",
        kernel.recovery_ms
    );
    let evicted = pliant.replica_counters.as_ref().expect("replica counters")["abuse"]
        ["evicted_embryonic"]
        .as_u64()
        .unwrap_or(0);
    assert!(evicted > 0, "the pool never ran dry: {pliant:?}");
    let rss = pliant.rss_mb_max.expect("replica peak RSS");
    assert!(
        rss < RSS_CAP_MB,
        "replica peak RSS {rss:.0} MiB: {pliant:?}"
    );
}
