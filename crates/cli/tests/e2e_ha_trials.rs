//! Repeated kill trials (issue 4 acceptance: >= 20 in the suite with zero connection resets).
//! One HA lab (NAT, three replicas, the controller protecting each with chords at 1 kHz); per
//! trial: two rate-limited downloads through the current lowest replica A (source ports the
//! ring maps to A), wait until they are checkpointed, SIGKILL A by PID, wait for the failover,
//! add a replica (`pliant scale out`: the lab agent, fabric ports, port block, protection) so
//! the next trial has three again, and require both downloads to complete with the served
//! sha256 (a reset or a torn state fails curl or the checksum). Prints per-trial failover
//! timings and their maxima.
//!
//! Needs root (`pliant_testkit::require_root`). Run in release:
//! `cargo test --release -p pliant-cli --test e2e_ha_trials -- --test-threads=1 --nocapture`.

mod common;
use common::ha::*;
use pliant_lab::PliantNf;
use std::time::{Duration, Instant};

const TRIALS: usize = 20;

/// One trial's failover, as the controller recorded it (detect: kill to detection, wall clock).
struct Row {
    detect_ms: f64,
    activated: u64,
    activate_ms: f64,
    steer_ms: f64,
    failover_ms: f64,
}

#[test]
fn twenty_kill_trials_without_a_connection_reset() {
    let Some(mut run) = ha_up("trials", PliantNf::nat(), &[("4M.bin", 4 << 20)]) else {
        return;
    };
    let f = run.lab().served_file("4M.bin").expect("file").clone();
    let mut next = 42_000u16;
    let mut rows = Vec::new();
    let mut duplicates = 0usize;
    let t_all = Instant::now();
    for trial in 0..TRIALS {
        let members = run.members();
        assert_eq!(members.len(), 3, "trial {trial}: {members:?}");
        let a = members[0];
        let ports = run.sports_for(a, 80, 2, &mut next);
        // ~2 s each.
        let rate = format!("{}", f.size_bytes / 2);
        let mut dls: Vec<Download> = ports
            .iter()
            .enumerate()
            .map(|(i, p)| run.curl(&f.url, *p, &rate, &format!("t{trial}-{i}")))
            .collect();
        // Their state acknowledged by the backups (older standby state does not count).
        wait_checkpointed(&run, a, &ports, Duration::from_secs(10));
        // Into the transfers.
        std::thread::sleep(Duration::from_millis(200));
        let killed = run.kill(a);
        let rec = run.wait_failover(a, killed.unix_ms, Duration::from_secs(5));
        let seen_ms = killed.at.elapsed().as_secs_f64() * 1e3;
        let detect_ms = rec["detected_unix_ms"].as_f64().unwrap_or(f64::NAN) - killed.unix_ms;
        let added = run.cli(&["scale", "out"]);
        for d in dls.iter_mut() {
            d.finish(&f.sha256, &format!("trial {trial} (killed r{a})"));
        }
        let row = Row {
            detect_ms,
            activated: rec["activated"].as_u64().unwrap_or(0),
            activate_ms: rec["activate_ms"].as_f64().unwrap_or(f64::NAN),
            steer_ms: rec["steer_ms"].as_f64().unwrap_or(f64::NAN),
            failover_ms: rec["failover_ms"].as_f64().unwrap_or(f64::NAN),
        };
        eprintln!(
            "trial {trial:2}: killed r{a}: detect {:.1} ms, {} flows activated, activate {:.2} \
             ms, steer {:.2} ms, failover {:.2} ms, kill->record seen {seen_ms:.0} ms; added \
             r{}; by replica {}",
            row.detect_ms,
            row.activated,
            row.activate_ms,
            row.steer_ms,
            row.failover_ms,
            added["replica"],
            rec["by_replica"]
        );
        if let Some(d) = rec["duplicates"].as_array().filter(|d| !d.is_empty()) {
            // Design invariant 1: a flow activated on two survivors would have two live copies
            // (a stale standby left on a backup the flow's group no longer uses).
            eprintln!("trial {trial}: flows activated twice: {d:?}");
            duplicates += d.len();
        }
        assert!(row.activated >= 2, "trial {trial}: {rec}");
        rows.push(row);
        // The new replica must be protected (and protect others) before the next kill.
        run.wait_protected(Duration::from_secs(15));
    }
    assert_eq!(
        duplicates, 0,
        "flows activated on two replicas (invariant 1)"
    );
    let (checked, violations, per) = run.audit();
    assert_eq!(violations, 0, "{per:?}");
    assert!(checked > 0, "{per:?}");
    let stat = |f: fn(&Row) -> f64| {
        let mut v: Vec<f64> = rows.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        (v[v.len() / 2], v[v.len() - 1])
    };
    let (d50, dmax) = stat(|r| r.detect_ms);
    let (a50, amax) = stat(|r| r.activate_ms);
    let (s50, smax) = stat(|r| r.steer_ms);
    let (f50, fmax) = stat(|r| r.failover_ms);
    eprintln!(
        "{TRIALS} trials in {:.0} s, zero resets. median/max: detect {d50:.1}/{dmax:.1} ms, \
         activate {a50:.2}/{amax:.2} ms, steer {s50:.2}/{smax:.2} ms, failover {f50:.2}/{fmax:.2} ms",
        t_all.elapsed().as_secs_f64(),
    );
}
