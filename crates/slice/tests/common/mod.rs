//! Helpers of the kernel-level tests: a private network namespace per test thread and its TCP
//! counters.
#![allow(dead_code)]

use pliant_slice::demo::reply;
use pliant_slice::format::{fnv1a, FNV_OFFSET};
use std::io::{BufRead, BufReader, Write};
use std::net::{Shutdown, TcpStream};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
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

/// Line `n` of connection `c` (deterministic, so the reader knows what the writer sent).
fn line(c: usize, n: u64) -> String {
    format!("{c} {n} {}\n", "x".repeat((n % 97) as usize))
}

/// One client connection: a writer streaming numbered lines, a reader checking every reply
/// against the hash of everything sent before it.
pub struct Client {
    /// The client's own address (the session's remote end at the server).
    pub local: std::net::SocketAddr,
    pub checked: Arc<AtomicU64>,
    sent: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    writer: std::thread::JoinHandle<()>,
    reader: std::thread::JoinHandle<Result<(), String>>,
}

const WINDOW: u64 = 2000;

pub fn start_client(addr: &str, c: usize) -> Client {
    let s = TcpStream::connect(addr).unwrap();
    let local = s.local_addr().unwrap();
    let (sent, checked, stop) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicBool::new(false)),
    );
    let mut w = s.try_clone().unwrap();
    let (sent_w, checked_w, stop_w) = (sent.clone(), checked.clone(), stop.clone());
    let writer = std::thread::spawn(move || {
        let mut n = 0u64;
        while !stop_w.load(Ordering::Relaxed) {
            if n - checked_w.load(Ordering::Relaxed) >= WINDOW {
                // Pacing of the load only (a window of unanswered lines keeps capsules small
                // and leaves the 2 cores to the instances); nothing waits on it for
                // correctness.
                std::thread::sleep(Duration::from_micros(200));
                continue;
            }
            let mut batch = String::new();
            for _ in 0..16 {
                batch.push_str(&line(c, n));
                n += 1;
            }
            w.write_all(batch.as_bytes()).unwrap();
            sent_w.store(n, Ordering::Release);
        }
        w.shutdown(Shutdown::Write).unwrap();
    });
    let checked_r = checked.clone();
    let reader = std::thread::spawn(move || {
        let mut r = BufReader::new(s);
        let (mut hash, mut n) = (FNV_OFFSET, 0u64);
        let mut got = String::new();
        loop {
            got.clear();
            match r.read_line(&mut got) {
                Ok(0) => return Ok(()),
                Ok(_) => {}
                Err(e) => return Err(format!("connection {c}: read after {n} replies: {e}")),
            }
            hash = fnv1a(hash, line(c, n).as_bytes());
            n += 1;
            let want = reply(n, hash);
            if got != want {
                return Err(format!(
                    "connection {c}: reply {n} is {got:?}, expected {want:?}"
                ));
            }
            checked_r.store(n, Ordering::Relaxed);
        }
    });
    Client {
        local,
        sent,
        checked,
        stop,
        writer,
        reader,
    }
}

impl Client {
    /// Stops streaming, and checks every line was answered byte-exact and the server closed.
    pub fn finish(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        self.writer.join().unwrap();
        let res = self.reader.join().unwrap();
        res.unwrap();
        let sent = self.sent.load(Ordering::Acquire);
        assert_eq!(
            self.checked.load(Ordering::Relaxed),
            sent,
            "lines unanswered"
        );
        sent
    }

    /// Waits until `more` further replies arrived (the session is being served).
    pub fn progresses(&self, more: u64) -> bool {
        let from = self.checked.load(Ordering::Relaxed);
        wait_until(Duration::from_secs(10), || {
            self.checked.load(Ordering::Relaxed) >= from + more
        })
    }
}
