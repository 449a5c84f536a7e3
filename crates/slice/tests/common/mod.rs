//! Helpers of the kernel-level tests: a private network namespace per test thread and its TCP
//! counters.
#![allow(dead_code)]

pub use pliant_slice::load::Retrans;
use pliant_slice::load::StreamClient;
use std::io::{BufRead, BufReader, Lines, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
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
    pliant_slice::load::net_counter("snmp", "Tcp:", name)
        .unwrap_or_else(|| panic!("no Tcp counter {name}"))
}

/// A `TcpExt:` counter of /proc/net/netstat in the calling thread's namespace
/// (`TCPTimeouts`, `TCPLossProbes`, ...).
pub fn tcpext_counter(name: &str) -> u64 {
    pliant_slice::load::net_counter("netstat", "TcpExt:", name)
        .unwrap_or_else(|| panic!("no TcpExt counter {name}"))
}

/// How many hold programs (`pliant_slice_hold`; BPF program names keep 15 characters) filter
/// `dev`'s ingress in the calling thread's namespace: TCX links, or classic tc filters where
/// the kernel has no TCX.
pub fn hold_programs(dev: &str) -> usize {
    use aya::programs::tc::{SchedClassifier, TcAttachType};
    let tcx = SchedClassifier::query_tcx(dev, TcAttachType::Ingress)
        .map(|(_, progs)| {
            progs
                .iter()
                .filter(|p| {
                    p.name_as_str()
                        .is_some_and(|n| n.starts_with("pliant_slice_ho"))
                })
                .count()
        })
        .unwrap_or(0);
    let out = Command::new("tc")
        .args(["filter", "show", "dev", dev, "ingress"])
        .output()
        .expect("run tc");
    tcx + String::from_utf8_lossy(&out.stdout)
        .matches("pliant_slice_hold")
        .count()
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

/// One streaming client connection (pliant_slice::load::StreamClient: a writer streaming
/// numbered lines, at most 2,000 unanswered, a reader checking every reply against the hash of
/// everything sent before it).
pub struct Client(StreamClient);

impl std::ops::Deref for Client {
    type Target = StreamClient;
    fn deref(&self) -> &StreamClient {
        &self.0
    }
}

pub fn start_client(addr: &str, c: usize) -> Client {
    Client(StreamClient::start(addr, c, 0, 2000).unwrap())
}

impl Client {
    /// The client socket's retransmissions so far.
    pub fn retrans(&self) -> Retrans {
        self.0.retrans().unwrap()
    }

    /// Stops streaming, checks every line was answered byte-exact and the server closed;
    /// returns the lines answered.
    pub fn finish(self) -> u64 {
        let out = self.0.finish();
        assert_eq!(out.error, None, "stream");
        assert_eq!(out.corrupted_bytes, 0);
        out.lines
    }

    /// [`Client::finish`], also returning the longest gap between two replies.
    pub fn finish_gap(self) -> (u64, Duration) {
        let out = self.0.finish();
        assert_eq!(out.error, None, "stream");
        assert_eq!(out.corrupted_bytes, 0);
        (out.lines, out.gaps.into_iter().max().unwrap_or_default())
    }

    /// Waits until `more` further replies arrived (the session is being served).
    pub fn progresses(&self, more: u64) -> bool {
        self.0.progresses(more, Duration::from_secs(10))
    }
}

/// A demo process, killed (by its own pid) and reaped when dropped, even when the test fails.
pub struct Demo {
    pub child: Child,
    stdin: ChildStdin,
    out: Lines<BufReader<ChildStdout>>,
    pub clients: String,
    pub peer: String,
}

impl Demo {
    /// `pliant-slice-demo serve` as `name` (identity `dir/name`) with `extra` arguments.
    pub fn start(dir: &std::path::Path, name: &str, extra: &[&str]) -> Demo {
        let mut child = Command::new(env!("CARGO_BIN_EXE_pliant-slice-demo"))
            .args(["serve", "--name", name, "--identity"])
            .arg(dir.join(name))
            .args(extra)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap()).lines();
        let ready = out.next().unwrap().unwrap();
        let pliant_slice::demo::Ready { clients, peer, .. } =
            pliant_slice::demo::parse_ready(&ready).unwrap_or_else(|| panic!("{ready:?}"));
        Demo {
            child,
            stdin,
            out,
            clients,
            peer,
        }
    }

    /// Sends a command, returns the answer lines (up to `done` for a move).
    pub fn cmd(&mut self, c: &str) -> Vec<String> {
        writeln!(self.stdin, "{c}").unwrap();
        let mut v = Vec::new();
        for l in self.out.by_ref() {
            let l = l.unwrap();
            let last = !c.starts_with("move") || l == "done";
            v.push(l);
            if last {
                break;
            }
        }
        v
    }
}

impl Drop for Demo {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
