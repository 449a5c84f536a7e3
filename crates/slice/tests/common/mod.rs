//! Helpers of the kernel-level tests: a private network namespace per test thread and its TCP
//! counters.
#![allow(dead_code)]

use std::process::Command;
use std::time::{Duration, Instant};

/// Moves the calling thread (and every thread and process it starts from now on) into a new,
/// unnamed network namespace with its loopback up. Nothing to clean up: the namespace goes
/// away with its last socket and thread, even when the test fails, and other tests' traffic
/// never shows in its counters. `false`: no root and the skip was allowed.
pub fn private_netns() -> bool {
    if !pliant_testkit::require_root() {
        return false;
    }
    // SAFETY: unshare(CLONE_NEWNET) affects only the calling thread.
    let r = unsafe { libc::unshare(libc::CLONE_NEWNET) };
    assert_eq!(
        r,
        0,
        "unshare(CLONE_NEWNET): {}",
        std::io::Error::last_os_error()
    );
    let st = Command::new("ip")
        .args(["link", "set", "lo", "up"])
        .status()
        .expect("run ip");
    assert!(st.success(), "ip link set lo up");
    true
}

/// A `Tcp:` counter of /proc/net/snmp in the calling thread's namespace (`OutRsts`, `OutSegs`,
/// `EstabResets`, ...).
pub fn tcp_counter(name: &str) -> u64 {
    let text = std::fs::read_to_string("/proc/thread-self/net/snmp").expect("read snmp");
    let mut lines = text.lines().filter(|l| l.starts_with("Tcp:"));
    let (names, values) = (
        lines.next().expect("Tcp header"),
        lines.next().expect("Tcp values"),
    );
    let i = names
        .split_whitespace()
        .position(|n| n == name)
        .unwrap_or_else(|| panic!("no Tcp counter {name}"));
    values
        .split_whitespace()
        .nth(i)
        .expect("value")
        .parse()
        .expect("number")
}

/// Polls `cond` until it holds or `limit` passes.
pub fn wait_until(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + limit;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() > end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}
