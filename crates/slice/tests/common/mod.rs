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

/// A `TcpExt:` counter of /proc/net/netstat in the calling thread's namespace
/// (`TCPTimeouts`, `TCPLossProbes`, ...).
pub fn tcpext_counter(name: &str) -> u64 {
    let text = std::fs::read_to_string("/proc/thread-self/net/netstat").expect("read netstat");
    let mut lines = text.lines().filter(|l| l.starts_with("TcpExt:"));
    let (names, values) = (
        lines.next().expect("TcpExt header"),
        lines.next().expect("TcpExt values"),
    );
    let i = names
        .split_whitespace()
        .position(|n| n == name)
        .unwrap_or_else(|| panic!("no TcpExt counter {name}"));
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
    /// The client's socket, for its TCP_INFO.
    sock: TcpStream,
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
    let sock = s.try_clone().unwrap();
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
        sock,
        sent,
        checked,
        stop,
        writer,
        reader,
    }
}

/// What a client socket's TCP_INFO says about its retransmissions.
#[derive(Debug, Default, Clone, Copy)]
pub struct Retrans {
    pub total_retrans: u64,
    /// Retransmission timeouts that fired (tcpi_total_rto, Linux 6.7+).
    pub rto: u64,
    /// Time spent in RTO recovery, ms (tcpi_total_rto_time).
    pub rto_ms: u64,
}

impl std::ops::Add for Retrans {
    type Output = Retrans;
    fn add(self, o: Retrans) -> Retrans {
        Retrans {
            total_retrans: self.total_retrans + o.total_retrans,
            rto: self.rto + o.rto,
            rto_ms: self.rto_ms + o.rto_ms,
        }
    }
}

/// TCP_INFO of `s` (offsets of struct tcp_info, linux/tcp.h).
pub fn retrans(s: &TcpStream) -> Retrans {
    let mut b = [0u8; 256];
    let mut len = b.len() as libc::socklen_t;
    // SAFETY: `b` is writable for `len` bytes.
    let r = unsafe {
        libc::getsockopt(
            std::os::fd::AsRawFd::as_raw_fd(s),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            b.as_mut_ptr().cast(),
            &mut len,
        )
    };
    assert_eq!(r, 0, "TCP_INFO");
    let u32_at = |o: usize| u64::from(u32::from_ne_bytes(b[o..o + 4].try_into().unwrap()));
    Retrans {
        total_retrans: u32_at(100),
        rto: if len >= 248 {
            u64::from(u16::from_ne_bytes([b[240], b[241]]))
        } else {
            0
        },
        rto_ms: if len >= 248 { u32_at(244) } else { 0 },
    }
}

impl Client {
    /// The client socket's retransmissions so far.
    pub fn retrans(&self) -> Retrans {
        retrans(&self.sock)
    }

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
