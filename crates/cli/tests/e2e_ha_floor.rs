//! End-to-end: the elasticity policy with HA on. A 3-replica HA lab (NAT) and the controller
//! with the example ctl.toml's `[policy]` (auto on, no `min_replicas`) and no traffic: the
//! policy scales in while the replicas are idle, but never below the 2 replicas Pico
//! protection needs, and each one left is protected by the other; `policy set
//! min_replicas=1` is refused. Then one of them is
//! SIGKILLed: the survivor is failed over to and runs alone, and `pliant status` /
//! `pliant ha status` warn that it is unprotected.
//!
//! Needs root (`pliant_testkit::require_root`). Run in release:
//! `cargo test --release -p pliant-cli --test e2e_ha_floor -- --nocapture`.

mod common;
use common::ha::*;
use pliant_lab::PliantNf;
use serde_json::{json, Value};
use std::process::Command;
use std::time::Duration;

/// `pliant <args>` against the run's controller, as a person reads it (no `--json`).
fn text(run: &HaRun, args: &[&str]) -> String {
    let out = controller_cli(&run.dir, args);
    assert!(
        out.status.success(),
        "pliant {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn idle_ha_lab_keeps_two_protected_replicas_and_warns_when_one_is_left_alone() {
    // The example ctl.toml's [policy]: thresholds only, auto on, min_replicas not set.
    let Some(run) = ha_up_with(
        "floor",
        PliantNf::nat(),
        &[],
        pliant_lab::mgmt::Transport::Unix,
        "high_water_flows = 60\nlow_water_flows = 40\n",
    ) else {
        return;
    };
    let policy = run.cli(&["policy", "show"]);
    assert_eq!(policy["policy"]["auto"], true, "{policy}");
    assert_eq!(policy["policy"]["min_replicas"], 2, "{policy}");
    // Idle: the policy (every 500 ms, 1 s cooldown) merges one replica away...
    common::wait_for(
        "the idle policy's scale-in",
        Duration::from_secs(10),
        || run.cli(&["status"])["counters"]["scale_ins"].as_u64() >= Some(1),
    );
    // ...and has had several chances to merge another in the next ~3 s (it did not).
    std::thread::sleep(Duration::from_secs(3));
    let st = run.cli(&["status"]);
    assert_eq!(st["counters"]["scale_ins"], 1, "{st:#}");
    // A forced evaluation decides nothing either.
    let d = run.cli(&["policy", "evaluate"]);
    assert_eq!(d["decision"]["action"], "nothing", "{d}");
    let members = run.members();
    assert_eq!(members.len(), 2, "{st:#}");
    // Each protected by the other, and the controller sees no unprotected replica.
    run.wait_protected(Duration::from_secs(10));
    common::wait_for("no unprotected replica", Duration::from_secs(5), || {
        run.cli(&["status"])["unprotected"] == json!([])
    });
    assert!(!text(&run, &["status"]).contains("WARNING"));
    // Asking for fewer through the API is refused, naming both numbers.
    let out = Command::new(common::pliant())
        .args(["policy", "set", "min_replicas=1", "--api"])
        .arg(run.dir.join("api.sock"))
        .arg("--token-file")
        .arg(run.dir.join("token"))
        .output()
        .expect("run pliant");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "policy set min_replicas=1 accepted");
    assert!(err.contains("min_replicas = 1 is below 2"), "{err}");
    assert_eq!(run.cli(&["policy", "show"])["policy"]["min_replicas"], 2);

    // The survivor's only backup dies: it is failed over to and left alone.
    let (alone, victim) = (members[0], members[1]);
    let k = run.kill(victim);
    run.wait_failover(victim, k.unix_ms, Duration::from_secs(10));
    common::wait_for(
        "the survivor reported unprotected",
        Duration::from_secs(5),
        || run.cli(&["status"])["unprotected"] == json!([alone]),
    );
    let st = run.cli(&["status"]);
    assert_eq!(st["ha"]["unprotected_replicas"], 1, "{st:#}");
    let ha: Value = run.ha();
    assert_eq!(ha["unprotected"], json!([alone]), "{ha:#}");
    let want = format!("WARNING: HA is on but r{alone} runs unprotected");
    for args in [&["status"][..], &["ha", "status"][..]] {
        let out = text(&run, args);
        assert!(out.contains(&want), "pliant {args:?}:\n{out}");
    }
}
