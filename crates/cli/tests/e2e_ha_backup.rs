//! End-to-end Pico HA, backup death (issue 4 acceptance): r1 serves downloads, protected to r2
//! and r3 (chords, 1 kHz). r2 hangs (SIGSTOP: it still accepts connections, so the controller
//! only learns of it from missed heartbeats, seconds later). r1's group backed by r2 stops
//! getting acknowledgements; after its retry timeout r1 runs it unprotected (`needs_backup`,
//! held output released) and the downloads carry on; then the controller re-protects r1 on the
//! survivors (all groups `up`, r2 no longer a backup). The downloads complete intact, the
//! output audit is clean, and the hung r2 is fenced (failed over by its missed heartbeats).
//!
//! Needs root (skips otherwise). Run in release:
//! `cargo test --release -p pliant-cli --test e2e_ha_backup -- --test-threads=1 --nocapture`.

mod common;
use common::ha::*;
use common::wait_for;
use pliant_lab::PliantNf;
use std::time::{Duration, Instant};

#[test]
fn dead_backup_leaves_the_primary_unprotected_then_reprotected() {
    let Some(mut run) = ha_up("backup", PliantNf::nat(), &[("16M.bin", 16 << 20)]) else {
        return;
    };
    let f = run.lab().served_file("16M.bin").expect("file").clone();
    let mut next = 41_000u16;
    let ports = run.sports_for(1, 80, 2, &mut next);
    let rate = format!("{}", f.size_bytes / 8);
    let mut dls: Vec<Download> = ports
        .iter()
        .enumerate()
        .map(|(i, p)| run.curl(&f.url, *p, &rate, &format!("b{i}")))
        .collect();
    wait_for("r1's flows in standby", Duration::from_secs(15), || {
        standby_flows(&run, 1) >= 2
    });
    let r1 = run.lab().run_dir().join("r1.sock");
    // Hang the backup r2.
    let pid2 = run.replica_pid(2);
    run.stopped.push(pid2);
    // SAFETY: SIGSTOP to a replica of this test's own lab, by recorded PID.
    let stopped_unix_ms = unix_ms();
    assert_eq!(unsafe { libc::kill(pid2, libc::SIGSTOP) }, 0);
    let t0 = Instant::now();
    // The primary notices on its own (no answer from the controller needed): a group goes
    // unprotected and asks for a backup.
    let mut saw_unprotected = None;
    while t0.elapsed() < Duration::from_secs(10) {
        if let Ok(v) = ha_status(&r1) {
            let gs = v["groups"].as_array().cloned().unwrap_or_default();
            if gs
                .iter()
                .any(|g| g["needs_backup"] == true || g["state"] == "unprotected")
            {
                saw_unprotected = Some((t0.elapsed(), v));
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let (after, v) = saw_unprotected.unwrap_or_else(|| {
        panic!(
            "r1 never reported a group without its backup: {:?}",
            ha_status(&r1)
        )
    });
    eprintln!(
        "r1 ran unprotected {} ms after r2 hung: {v}",
        after.as_millis()
    );
    // The controller fails r2 over (missed heartbeats) and re-protects r1 on r3.
    let rec = run.wait_failover(2, stopped_unix_ms, Duration::from_secs(20));
    assert!(
        rec["evidence"]
            .as_str()
            .is_some_and(|e| e.contains("heartbeat")),
        "{rec}"
    );
    let ha = run.wait_protected(Duration::from_secs(15));
    let r1v = ha["replicas"]
        .as_array()
        .and_then(|a| a.iter().find(|r| r["index"] == 1))
        .expect("r1")
        .clone();
    let backups: Vec<&str> = r1v["ha_status"]["groups"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[])
        .iter()
        .filter_map(|g| g["backup"].as_str())
        .collect();
    assert!(
        !backups.is_empty() && backups.iter().all(|b| *b == "r3"),
        "r1 re-protected on the survivor only: {r1v:#}"
    );
    eprintln!(
        "re-protected {} ms after r2 hung (controller reprotects: {})",
        t0.elapsed().as_millis(),
        ha["summary"]["counters"]["reprotects"]
    );
    // The primary kept serving throughout.
    for d in dls.iter_mut() {
        d.finish(&f.sha256, "backup death");
    }
    let (checked, violations, per) = run.audit();
    assert_eq!(violations, 0, "{per:?}");
    assert!(checked > 0, "{per:?}");
}
