//! Replicated sessions: a primary demo process replicates its sessions to a backup process
//! with output commit; the primary is SIGKILLed under traffic and every session continues on
//! the backup, byte-exact, with no reset, and no output released beyond what the backup held.

mod common;

use common::{private_netns, start_client, tcpext_counter, wait_until, Demo};
use pliant_slice::load::IdleSessions;
use pliant_slice::replicate::field;
use std::process::Command;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

fn replication(d: &mut Demo) -> String {
    let l = d.cmd("replication").remove(0);
    assert!(l.starts_with("replication "), "{l}");
    l
}

fn get(line: &str, key: &str) -> u64 {
    field(line, key).unwrap_or_else(|| panic!("no {key} in {line}"))
}

/// A backup demo process `rep-b` and a primary `rep-p` replicating to it (identities in the
/// returned directory).
fn replicated_pair(prefix: &str) -> (pliant_testkit::TempDir, Demo, Demo) {
    let dir = pliant_testkit::TempDir::new(prefix);
    let st = Command::new(env!("CARGO_BIN_EXE_pliant-slice-demo"))
        .arg("keys")
        .arg(&dir.0)
        .args(["rep-p", "rep-b"])
        .status()
        .unwrap();
    assert!(st.success());
    let b = Demo::start(&dir.0, "rep-b", &[]);
    let p = Demo::start(
        &dir.0,
        "rep-p",
        &["--backup", &b.peer, "--backup-name", "rep-b"],
    );
    (dir, b, p)
}

/// Sessions (streaming and idle) of a SIGKILLed primary continue on its backup.
#[test]
fn sessions_of_a_killed_primary_continue_on_its_backup_without_a_reset() {
    if !private_netns() {
        return;
    }
    let streams: usize = std::env::var("SLICE_REP_STREAMS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4);
    let idle: usize = std::env::var("SLICE_REP_IDLE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(996);
    let (_dir, mut b, mut p) = replicated_pair("pliant-slice-rep");
    let clients: Vec<_> = (0..streams).map(|c| start_client(&p.clients, c)).collect();
    let mut sessions = IdleSessions::connect(&p.clients, idle, Duration::from_secs(10)).unwrap();
    for _ in 0..3 {
        sessions.round().unwrap();
    }
    for (i, c) in clients.iter().enumerate() {
        if !c.progresses(500) {
            panic!(
                "stream {i} does not progress at the primary ({} replies)\nprimary: {}\nbackup: {}",
                c.checked.load(Ordering::Relaxed),
                replication(&mut p),
                replication(&mut b)
            );
        }
    }
    let total = (streams + idle) as u64;
    let pl = replication(&mut p);
    assert_eq!(get(&pl, "protected"), total, "{pl}");
    assert_eq!(get(&pl, "unprotected"), 0, "{pl}");
    let bl = replication(&mut b);
    assert_eq!(get(&bl, "commit_protected"), total, "{bl}");
    assert!(
        get(&bl, "commit_released") + get(&bl, "commit_passed") > 0,
        "{bl}"
    );
    eprintln!("primary: {pl}\nbackup before: {bl}");

    // Half of the idle sessions have a line in flight when the primary dies.
    sessions.send_every(2).unwrap();
    // How long each stream waits, from the kill, for 2,100 more replies: more than it can
    // have unanswered (2,000), so some were answered after the takeover (measured apart from
    // the test's own polling).
    let marks: Vec<_> = clients
        .iter()
        .map(|c| (c.checked.clone(), c.checked.load(Ordering::Relaxed)))
        .collect();
    const COUNTERS: [&str; 6] = [
        "PAWSEstab",
        "TCPTimeouts",
        "TCPLossProbes",
        "TCPSackRecoveryFail",
        "TCPDSACKRecv",
        "TCPFastRetrans",
    ];
    let before: Vec<u64> = COUNTERS.iter().map(|c| tcpext_counter(c)).collect();
    let killed = Instant::now();
    let watcher = std::thread::spawn(move || {
        marks
            .into_iter()
            .map(|(n, from)| {
                wait_until(Duration::from_secs(20), || {
                    n.load(Ordering::Relaxed) >= from + 2100
                })
                .then(|| killed.elapsed())
            })
            .collect::<Vec<_>>()
    });
    assert_eq!(common::hold_programs("lo"), 2, "the two instances' holds");
    p.child.kill().unwrap(); // SIGKILL
    p.child.wait().unwrap();
    // The killed primary's program went with it (TCX links): nothing of it diverts segments.
    assert_eq!(
        common::hold_programs("lo"),
        1,
        "the killed primary's hold stayed"
    );
    assert!(
        wait_until(Duration::from_secs(10), || get(
            &replication(&mut b),
            "failovers"
        ) == 1),
        "the backup did not take over"
    );
    // The clients' own acknowledgments, read while they were held at the takeover: none
    // beyond the output the backup held.
    let audit = replication(&mut b);
    assert_eq!(get(&audit, "commit_violations"), 0, "{audit}");
    let stalls = watcher.join().unwrap();
    for (i, st) in stalls.iter().enumerate() {
        if st.is_none() {
            let c = &clients[i];
            panic!(
                "stream {i} stalled after the failover ({} replies, {:?})\nbackup: {}\n{}",
                c.checked.load(Ordering::Relaxed),
                c.retrans(),
                replication(&mut b),
                std::fs::read_to_string("/proc/thread-self/net/tcp").unwrap_or_default()
            );
        }
    }
    let longest = stalls.iter().flatten().max().copied().unwrap_or_default();
    sessions.check_all().unwrap();
    for _ in 0..3 {
        sessions.round().unwrap();
    }
    let deltas: Vec<String> = COUNTERS
        .iter()
        .zip(before)
        .map(|(c, b)| format!("{c} +{}", tcpext_counter(c) - b))
        .collect();
    eprintln!("namespace TcpExt over the failover: {}", deltas.join(", "));
    let bl = replication(&mut b);
    eprintln!(
        "backup after: {bl}\nevery stream 2,100 replies further {:.1} ms after the kill",
        longest.as_secs_f64() * 1e3
    );
    assert_eq!(get(&bl, "taken_over"), total, "{bl}");
    assert_eq!(get(&bl, "takeover_failed"), 0, "{bl}");
    assert_eq!(get(&bl, "commit_violations"), 0, "{bl}");
    // The dead primary's kernel reset every session (SO_LINGER 0); none of those left.
    assert!(get(&bl, "commit_resets") >= total, "{bl}");
    assert_eq!(get(&bl, "commit_protected"), 0, "{bl}");
    for c in clients {
        let r = c.retrans();
        let (lines, gap) = c.finish_gap();
        eprintln!(
            "stream: {lines} lines, longest gap {:.1} ms, {r:?}",
            gap.as_secs_f64() * 1e3
        );
    }
    assert_eq!(sessions.corrupted_bytes(), 0);
    let s = b.cmd("stats").remove(0);
    assert!(s.contains("session_errors=0"), "{s}");
}

/// The backup dies instead: the primary's sessions go on (unprotected, and told so), nothing
/// of the dead backup's hold diverts their output.
#[test]
fn sessions_go_on_when_the_backup_is_killed() {
    if !private_netns() {
        return;
    }
    let (_dir, mut b, mut p) = replicated_pair("pliant-slice-rep-b");
    let clients: Vec<_> = (0..2).map(|c| start_client(&p.clients, c)).collect();
    let mut sessions = IdleSessions::connect(&p.clients, 50, Duration::from_secs(10)).unwrap();
    sessions.round().unwrap();
    for c in &clients {
        assert!(c.progresses(500));
    }
    let bl = replication(&mut b);
    assert_eq!(get(&bl, "commit_protected"), 52, "{bl}");
    b.child.kill().unwrap(); // SIGKILL
    b.child.wait().unwrap();
    assert_eq!(
        common::hold_programs("lo"),
        1,
        "the killed backup's hold stayed"
    );
    for (i, c) in clients.iter().enumerate() {
        assert!(
            c.progresses(2100),
            "stream {i} stalled after the backup died"
        );
    }
    for _ in 0..3 {
        sessions.round().unwrap();
    }
    let pl = replication(&mut p);
    assert_eq!(get(&pl, "backup_lost"), 1, "{pl}");
    // A session started now runs unprotected, and says so.
    let mut late = IdleSessions::connect(&p.clients, 1, Duration::from_secs(10)).unwrap();
    late.round().unwrap();
    let pl = replication(&mut p);
    assert_eq!(get(&pl, "unprotected"), 1, "{pl}");
    for c in clients {
        c.finish();
    }
}
