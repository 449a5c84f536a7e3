//! End-to-end Pico HA, backup death: r1 serves downloads, protected to r2
//! and r3 (chords, 1 kHz). r2 hangs (SIGSTOP: it still accepts connections, so the controller
//! only learns of it from missed heartbeats, seconds later). r1's group backed by r2 stops
//! getting acknowledgements; after its retry timeout r1 runs it unprotected (`needs_backup`,
//! held output released) and the downloads carry on; then the controller re-protects r1 on the
//! survivors (all groups `up`, r2 no longer a backup). The downloads complete intact, the
//! output audit is clean, and the hung r2 is fenced: failed over by its missed heartbeats, and
//! once resumed (SIGCONT) the frames it writes on its ports are dropped by the fabric (the
//! fence counter grows by at least their number) and never reach the client, while the same
//! frame written by the live r3 does (the control that the injection path works).
//!
//! Needs root (`pliant_testkit::require_root`). Run in release:
//! `cargo test --release -p pliant-cli --test e2e_ha_backup -- --test-threads=1 --nocapture`.

mod common;
use common::ha::*;
use common::wait_for;
use pliant_lab::{PliantNf, Role, CLIENT_IP, SERVER_IP};
use std::net::UdpSocket;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// The client's UDP port the fencing check writes to.
const FENCE_PORT: u16 = 9700;
const FROM_R2: &[u8] = b"FROM-FENCED-R2";
const FROM_R3: &[u8] = b"FROM-LIVE-R3";

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
    // A connection through r2 as well: it keeps r2's failed-over state (and so r2's ports)
    // in place while the fencing is checked (the controller retires a failed replica, namespace
    // and all, once none of its flows are left), and r2, resumed, holds output of its own.
    let perf_port = run.sports_for(2, 5201, 1, &mut next)[0];
    let mut perf = run.iperf3(perf_port, 20, "20M");
    wait_for("r1's flows in standby", Duration::from_secs(15), || {
        standby_flows(&run, 1) >= 2
    });
    wait_for("r2's flow in standby", Duration::from_secs(15), || {
        standby_flows(&run, 2) >= 1
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
    // Fencing: r2 resumes and writes frames on both its ports, as its output would leave.
    let (ready_tx, ready_rx) = mpsc::sync_channel(1);
    let (got_tx, got_rx) = mpsc::channel::<Vec<u8>>();
    let stop = Arc::new(AtomicBool::new(false));
    let stop_rx = stop.clone();
    let listener = pliant_bench::flowgen::spawn_in_netns(
        &run.lab().netns(Role::Client),
        "fence-rx",
        move || {
            let s = UdpSocket::bind((CLIENT_IP, FENCE_PORT)).expect("bind in the client");
            s.set_read_timeout(Some(Duration::from_millis(50)))
                .expect("timeout");
            ready_tx.send(()).expect("ready");
            let mut b = [0u8; 256];
            while !stop_rx.load(Ordering::SeqCst) {
                if let Ok(n) = s.recv(&mut b) {
                    let _ = got_tx.send(b[..n].to_vec());
                }
            }
        },
    )
    .expect("client listener");
    ready_rx
        .recv_timeout(Duration::from_secs(5))
        .expect("client listener ready");
    let fenced_before = run.steer_counter("drop_fenced");
    // SAFETY: SIGCONT to the replica this test stopped, by recorded PID.
    assert_eq!(unsafe { libc::kill(pid2, libc::SIGCONT) }, 0);
    let to_client = (CLIENT_IP, FENCE_PORT);
    emit_udp_frames(&run, 2, Side::Inside, (SERVER_IP, 9), to_client, FROM_R2, 5);
    emit_udp_frames(
        &run,
        2,
        Side::Outside,
        ("10.77.2.1", 20999),
        (SERVER_IP, 9),
        FROM_R2,
        5,
    );
    // Written after r2's, along the same fabric path to the client: once it arrived, r2's
    // would have too.
    emit_udp_frames(&run, 3, Side::Inside, (SERVER_IP, 9), to_client, FROM_R3, 1);
    let mut got = Vec::new();
    while !got.iter().any(|p: &Vec<u8>| p == FROM_R3) {
        let p = got_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the live r3's frame never reached the client: the check cannot see a leak");
        got.push(p);
    }
    stop.store(true, Ordering::SeqCst);
    listener
        .join()
        .expect("listener thread")
        .expect("listener in the client namespace");
    assert!(
        !got.iter().any(|p| p == FROM_R2),
        "the resumed, fenced r2 reached the client: {got:?}"
    );
    let fenced = run.steer_counter("drop_fenced") - fenced_before;
    assert!(
        fenced >= 10,
        "the fence dropped {fenced} of the 10 frames the resumed r2 wrote"
    );
    let got: Vec<String> = got
        .iter()
        .map(|p| String::from_utf8_lossy(p).into_owned())
        .collect();
    eprintln!("fence: dropped {fenced} frames from the resumed r2; the client got {got:?}");
    // The primary kept serving throughout; r2's connection survived its failover.
    for d in dls.iter_mut() {
        d.finish(&f.sha256, "backup death");
    }
    perf.finish("iperf3 through r2 across its failover");
    let (checked, violations, per) = run.audit();
    assert_eq!(violations, 0, "{per:?}");
    assert!(checked > 0, "{per:?}");
}
