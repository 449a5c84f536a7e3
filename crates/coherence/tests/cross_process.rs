//! The hub in a child process (this test binary re-run with an env var, so no other binary
//! has to be built) with its own identity directory, two stores in this process with
//! identities of the same CA, and shutdown by SIGTERM.

mod common;

use common::*;
use pliant_coherence::{run_hub_until_signal, store_with_options, HubConfig, HubStats};
use pliant_state::{GetFlags, PutFlags, SharedConfig, StateError};
use pliant_wire::{role, Encrypt, Endpoint, Security};
use std::io::Read;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const HUB_SOCKET_ENV: &str = "PLIANT_COHERENCE_TEST_HUB_SOCKET";
const HUB_IDENTITY_ENV: &str = "PLIANT_COHERENCE_TEST_HUB_IDENTITY";
const STATS_PREFIX: &str = "HUB_STATS ";

/// Entry point of the child: runs a hub until SIGTERM, then prints its counters. Ignored in
/// normal runs; without the env vars it does nothing.
#[test]
#[ignore = "run by cross_process_hub_serves_two_stores in a child process"]
fn child_hub_entry() {
    let (Ok(sock), Ok(id)) = (
        std::env::var(HUB_SOCKET_ENV),
        std::env::var(HUB_IDENTITY_ENV),
    ) else {
        return;
    };
    // Loaded from files, as `pliant hub --identity` does (key mode and owner checked).
    let sec = Security::load(Path::new(&id), Encrypt::Auto).expect("hub identity");
    let ep = Endpoint::Unix(sock.into());
    let stats = run_hub_until_signal(&ep, sec, HubConfig::default()).expect("hub");
    println!("{STATS_PREFIX}{}", serde_json::to_string(&stats).unwrap());
}

/// Kills the child (by its pid, SIGKILL) if the test ends before it exited.
struct ChildGuard(Option<Child>);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[test]
fn cross_process_hub_serves_two_stores() {
    let d = TempDir::new("xproc");
    let sock = d.join("hub.sock");
    let id_dir = d.join("hub-id");
    ca().issue_to(&id_dir, "hub", role::SERVICE, 3600).unwrap();
    let child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_hub_entry",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(HUB_SOCKET_ENV, &sock)
        .env(HUB_IDENTITY_ENV, &id_dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let mut guard = ChildGuard(Some(child));
    wait_until("the child hub's socket", || sock.exists());

    let ep = Endpoint::Unix(sock.clone());
    let cfg = SharedConfig::default;
    let (mut a, ca) = store_with_options("r1", &ep, replica_sec("r1"), cfg(), opts()).unwrap();
    let (mut b, cb) = store_with_options("r2", &ep, replica_sec("r2"), cfg(), opts()).unwrap();
    assert!(
        ca.connected() && cb.connected(),
        "store_for connects at once"
    );
    assert_ne!(a.replica(), b.replica());
    // Combiner key: both contribute, both see the sum.
    for s in [&mut a, &mut b] {
        s.create_counter("alerts").unwrap();
    }
    a.counter_add("alerts", 4, PutFlags::Push).unwrap();
    b.counter_add("alerts", 6, PutFlags::Push).unwrap();
    assert_eq!(a.counter_read("alerts", GetFlags::Pull).unwrap(), 10);
    assert_eq!(b.counter_read("alerts", GetFlags::Pull).unwrap(), 10);
    // Strong key: a's SYNCH write is what b reads next; b is refused while a holds the lock.
    for s in [&mut a, &mut b] {
        s.create_shared("limit", b"100".to_vec(), None).unwrap();
    }
    a.set_now(Instant::now());
    let r = a.get_shared("limit", GetFlags::Synch).unwrap();
    b.set_now(Instant::now());
    assert_eq!(
        b.get_shared("limit", GetFlags::Synch).unwrap_err(),
        StateError::Locked("limit".into())
    );
    *a.value_mut(&r) = b"250".to_vec();
    a.put_shared(r, PutFlags::Synch).unwrap();
    let r = b.get_shared("limit", GetFlags::Synch).unwrap();
    assert_eq!(b.value(&r), b"250");
    b.put_shared(r, PutFlags::Synch).unwrap();
    // Merge on destruction across the process boundary.
    let export = b.retire().unwrap();
    a.merge_from(&export).unwrap();
    assert_eq!(a.counter_read("alerts", GetFlags::Local).unwrap(), 10);
    assert_eq!(a.counter_read("alerts", GetFlags::Pull).unwrap(), 10);
    let hub = ca.hub_stats().unwrap();
    assert_eq!(hub.replicas, 2);
    assert_eq!(hub.lock_refused, 1);

    // SIGTERM stops the hub cleanly: it exits 0, unlinks its socket and reports its counters.
    // SAFETY: `pid` is our own child, still running (the guard has not reaped it).
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGTERM) }, 0);
    let mut child = guard.0.take().unwrap();
    let mut out = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    let status = child.wait().unwrap();
    assert!(status.success(), "hub child: {status}\n{out}");
    assert!(!sock.exists(), "socket unlinked on shutdown");
    let line = out
        .lines()
        // libtest prints "test child_hub_entry ... " on the same line.
        .find_map(|l| l.find(STATS_PREFIX).map(|i| &l[i + STATS_PREFIX.len()..]))
        .unwrap_or_else(|| panic!("no stats line in: {out}"));
    let stats: HubStats = serde_json::from_str(line).unwrap();
    assert_eq!(stats.connections, 2);
    assert_eq!(stats.auth_failures, 0);
    assert!(stats.frames >= 10, "{stats:?}");
    // With the hub gone, calls fail with a clear error within the timeout.
    let t0 = Instant::now();
    let e = a.counter_read("alerts", GetFlags::Pull).unwrap_err();
    assert!(matches!(e, StateError::Coherence { .. }), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(30));
}
