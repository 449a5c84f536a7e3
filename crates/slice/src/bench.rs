//! `pliant bench slice`: live TCP session moves between two instances, measured on the real
//! kernel in a network namespace of the bench's own (created on a thread of its own and gone
//! with it, even when the bench fails).
//!
//! 1. Streaming: `streams` clients stream short lines (every reply checks the whole stream)
//!    while their sessions move A -> B -> A ..., `migrations` moves in all; each session moves
//!    again only after its client saw a new reply. Pause per move, client-observed gaps.
//! 2. Bulk: one client sends 64 KiB lines as fast as they are answered; after a second of
//!    transfer its session moves mid-transfer, `bulk_moves` times; the dip is the throughput
//!    over the `dip_window_ms` from the move start against the second before it.
//! 3. Drain: `drain_sessions` idle sessions, each with a line in flight, move A -> B in one
//!    batch ([`Instance::drain_to`]); then every session is checked.
//!
//! 4. Failover: `failover_sessions` idle sessions on a primary instance *process* (`slice
//!    serve`, started with `serve_cmd`) that replicates them to an in-process backup; each
//!    has a line in flight when the primary is SIGKILLed and sends another right after;
//!    recovery is the kill to the last of those lines answered (every reply checked).
//!
//! Resets are the namespace's `OutRsts` (the only traffic in it is the bench's) plus sessions
//! that ended on a socket error; corrupted bytes are the lines whose reply did not match.

use crate::demo::LineApp;
use crate::instance::{Config, Instance};
use crate::load::{IdleSessions, StreamClient};
use pliant_wire::{role, Ca, Endpoint, Security};
use serde::Serialize;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct BenchOpts {
    pub migrations: usize,
    pub streams: usize,
    pub bulk_moves: usize,
    pub dip_window_ms: u64,
    pub drain_sessions: usize,
    /// Give up the streaming phase after this long (what was measured is reported).
    pub budget: Duration,
    /// Sessions of the failover phase (0 skips it).
    pub failover_sessions: usize,
    /// The program and the first arguments that run `slice serve` (the primary of the
    /// failover phase, a process so that it can be SIGKILLed); `None`: the phase reports why
    /// it did not run.
    pub serve_cmd: Option<(std::path::PathBuf, Vec<String>)>,
}

impl Default for BenchOpts {
    fn default() -> Self {
        BenchOpts {
            migrations: 2000,
            streams: 4,
            bulk_moves: 5,
            dip_window_ms: 200,
            drain_sessions: 1000,
            budget: Duration::from_secs(60),
            failover_sessions: 1000,
            serve_cmd: None,
        }
    }
}

/// Client-observed gaps at least this long count as a retransmission-timeout stall (Linux's
/// minimum RTO).
const RTO_STALL: Duration = Duration::from_millis(200);

#[derive(Debug, Default, Serialize)]
pub struct Failover {
    /// Why the phase did not run or did not finish; `None` when it measured.
    pub error: Option<String>,
    /// The backup's takeover: the primary's death seen -> every session served.
    pub takeover_ms: Option<f64>,
    pub takeover_failed: Option<u64>,
    /// Output that left beyond what the backup held (must be 0).
    pub commit_violations: Option<u64>,
    /// RSTs of the dying primary's kernel kept from the clients.
    pub resets_kept: Option<u64>,
}

#[derive(Debug, Default, Serialize)]
pub struct BenchReport {
    /// "slice".
    pub bench: &'static str,
    /// Moves done in the streaming phase (all moves: `migrations_total`).
    pub migrations: usize,
    pub migrations_total: usize,
    pub migrations_failed: usize,
    pub resets: u64,
    pub bytes_corrupted: u64,
    pub pause_us_p50: Option<f64>,
    pub pause_us_p99: Option<f64>,
    pub pause_us_max: Option<f64>,
    /// Gaps between two replies of one streaming client of at least 200 ms.
    pub rto_stalls: usize,
    /// Longest gap between two replies of a streaming client.
    pub client_gap_ms_max: Option<f64>,
    /// Retransmission timeouts the streaming clients' sockets counted (tcpi_total_rto).
    pub client_rtos: u64,
    pub client_retransmits: u64,
    pub lines_checked: u64,
    /// Median over the bulk moves.
    pub iperf_dip_pct: Option<f64>,
    pub iperf_dip_pct_each: Vec<f64>,
    pub bulk_mbps_before: Option<f64>,
    /// Pause of each bulk move.
    pub bulk_pause_us_each: Vec<f64>,
    /// Retransmission timeouts and retransmissions of the bulk client's socket.
    pub bulk_client_rtos: u64,
    pub bulk_client_retransmits: u64,
    pub dip_window_ms: u64,
    pub drain_sessions: usize,
    /// Time of the drain of `drain_sessions` sessions (named for the goal's 1,000).
    pub drain_1000_ms: Option<f64>,
    pub drain_moved: usize,
    pub failover_recovery_ms: Option<f64>,
    pub failover_sessions_kept: Option<u64>,
    pub failover_sessions_total: Option<u64>,
    pub failover: Failover,
    /// How the instances held packets during moves: queue or drop.
    pub hold: String,
    pub hold_fallback: Option<String>,
    pub hold_reinjected: u64,
    pub hold_over_limit: u64,
    pub loadavg_start: String,
    pub loadavg_end: String,
    pub total_s: f64,
    pub errors: Vec<String>,
}

fn pct(v: &mut [Duration], p: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_unstable();
    let d = v[((v.len() - 1) as f64 * p).round() as usize];
    Some(d.as_secs_f64() * 1e6)
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// A `Tcp:` counter of the calling thread's network namespace.
fn tcp_counter(name: &str) -> Option<u64> {
    crate::load::net_counter("snmp", "Tcp:", name)
}

/// A new network namespace for the calling thread (and what it starts), loopback up.
fn private_netns() -> Result<(), String> {
    // SAFETY: unshare(CLONE_NEWNET) affects only the calling thread.
    if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
        return Err(format!(
            "unshare(CLONE_NEWNET): {} (the bench needs root)",
            std::io::Error::last_os_error()
        ));
    }
    let st = std::process::Command::new("ip")
        .args(["link", "set", "lo", "up"])
        .status()
        .map_err(|e| format!("ip link set lo up: {e}"))?;
    if !st.success() {
        return Err("ip link set lo up failed".into());
    }
    Ok(())
}

/// Runs the bench (see the module); progress on stderr.
pub fn run(o: &BenchOpts) -> Result<BenchReport, String> {
    let o = o.clone();
    std::thread::spawn(move || {
        private_netns()?;
        Ok(run_here(&o))
    })
    .join()
    .map_err(|_| "bench thread panicked".to_string())?
}

fn instance(ca: &Ca, name: &str) -> Result<Instance<LineApp>, String> {
    let id = ca
        .issue(name, role::REPLICA, 3600)
        .map_err(|e| format!("identity: {e}"))?;
    Instance::start(Config {
        name: name.into(),
        clients: "127.0.0.1:0".parse().expect("an address"),
        peer: Endpoint::Tcp("127.0.0.1:0".into()),
        security: Security::new(id),
        control: None,
        backup: None,
    })
    .map_err(|e| format!("instance {name}: {e}"))
}

fn run_here(o: &BenchOpts) -> BenchReport {
    let started = Instant::now();
    let mut r = BenchReport {
        bench: "slice",
        dip_window_ms: o.dip_window_ms,
        drain_sessions: o.drain_sessions,
        loadavg_start: loadavg(),
        ..BenchReport::default()
    };
    let setup = (|| -> Result<_, String> {
        let ca = Ca::generate(None).map_err(|e| format!("CA: {e}"))?;
        Ok((instance(&ca, "bench-a")?, instance(&ca, "bench-b")?))
    })();
    let (a, b) = match setup {
        Ok(x) => x,
        Err(e) => {
            r.errors.push(e);
            return r;
        }
    };
    r.hold = a.hold().mode().as_str().into();
    r.hold_fallback = a.hold().fallback_reason().map(str::to_string);
    eprintln!("[slice] hold: {} ({:?})", r.hold, r.hold_fallback);
    if let Err(e) = streaming(o, &a, &b, &mut r) {
        r.errors.push(format!("streaming: {e}"));
    }
    if o.bulk_moves > 0 {
        if let Err(e) = bulk(o, &a, &b, &mut r) {
            r.errors.push(format!("bulk: {e}"));
        }
    }
    if o.drain_sessions > 0 {
        if let Err(e) = drain(o, &a, &b, &mut r) {
            r.errors.push(format!("drain: {e}"));
        }
    }
    for i in [&a, &b] {
        r.resets += i.stats().session_errors.load(Ordering::Relaxed);
        if let Some(q) = i.hold().queue_stats() {
            r.hold_reinjected += q.reinjected;
            r.hold_over_limit += q.over_limit;
        }
    }
    r.resets += tcp_counter("OutRsts").unwrap_or(0);
    drop((a, b));
    if o.failover_sessions > 0 {
        if let Err(e) = failover(o, &mut r) {
            r.failover.error = Some(e);
        }
    } else {
        r.failover.error = Some("skipped (failover sessions 0)".into());
    }
    r.loadavg_end = loadavg();
    r.total_s = started.elapsed().as_secs_f64();
    r
}

/// A process killed (SIGKILL, by its own pid) and reaped when dropped.
struct Reaped(std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A directory of the bench's own (mode 0700: it holds private keys), removed when dropped.
struct KeyDir(std::path::PathBuf);

impl KeyDir {
    fn new() -> Result<KeyDir, String> {
        use std::os::unix::fs::DirBuilderExt;
        static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let p = std::env::temp_dir().join(format!(
            "pliant-bench-slice-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&p)
            .map_err(|e| format!("{}: {e}", p.display()))?;
        Ok(KeyDir(p))
    }
}

impl Drop for KeyDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn failover(o: &BenchOpts, r: &mut BenchReport) -> Result<(), String> {
    use std::io::BufRead;
    let (prog, pre) = o
        .serve_cmd
        .as_ref()
        .ok_or("no command to start a primary instance process")?;
    let dir = KeyDir::new()?;
    let names = ["bench-fp".to_string(), "bench-fb".to_string()];
    crate::demo::keys(&dir.0, &names)?;
    let security = Security::load(&dir.0.join("bench-fb"), Default::default())
        .map_err(|e| format!("backup identity: {e}"))?;
    let backup: Instance<LineApp> = Instance::start(Config {
        name: "bench-fb".into(),
        clients: "127.0.0.1:0".parse().expect("an address"),
        peer: Endpoint::Tcp("127.0.0.1:0".into()),
        security,
        control: None,
        backup: None,
    })
    .map_err(|e| format!("backup instance: {e}"))?;
    let mut child = std::process::Command::new(prog)
        .args(pre)
        .args(["--name", "bench-fp", "--identity"])
        .arg(dir.0.join("bench-fp"))
        .args(["--backup", &backup.peer_endpoint().to_string()])
        .args(["--backup-name", "bench-fb"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| format!("starting {}: {e}", prog.display()))?;
    let out = child.stdout.take().ok_or("no stdout")?;
    let mut child = Reaped(child);
    let mut line = String::new();
    std::io::BufReader::new(out)
        .read_line(&mut line)
        .map_err(|e| format!("primary's ready line: {e}"))?;
    let ready = crate::demo::parse_ready(line.trim())
        .ok_or_else(|| format!("primary's ready line: {line:?}"))?;
    let n = o.failover_sessions;
    let mut s = IdleSessions::connect(&ready.clients, n, Duration::from_secs(10))
        .map_err(|e| format!("connect: {e}"))?;
    s.round()?;
    s.round()?;
    let protected = || backup.hold().commit_stats().map_or(0, |c| c.protected);
    let end = Instant::now() + Duration::from_secs(10);
    while protected() < n as u64 {
        if Instant::now() > end {
            return Err(format!("{} of {n} sessions protected", protected()));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    eprintln!("[slice] failover: {n} sessions protected; SIGKILL of the primary");
    // A line in flight on each session when the primary dies, and one more sent right after
    // (to a dead process): only the backup can answer that one.
    s.send_all().map_err(|e| format!("write: {e}"))?;
    let ext = |n: &str| crate::load::net_counter("netstat", "TcpExt:", n).unwrap_or(0);
    let names = [
        "TCPTimeouts",
        "TCPLossProbes",
        "PAWSEstab",
        "TCPDSACKRecv",
        "TCPFastRetrans",
    ];
    let before: Vec<u64> = names.iter().map(|n| ext(n)).collect();
    let t0 = Instant::now();
    child.0.kill().map_err(|e| format!("kill: {e}"))?;
    s.send_all().map_err(|e| format!("write: {e}"))?;
    let (kept, err) = s.check_each();
    let recovery = t0.elapsed();
    let _ = child.0.wait();
    let after: Vec<String> = names
        .iter()
        .zip(before)
        .map(|(n, b)| format!("{n} +{}", ext(n) - b))
        .collect();
    eprintln!("[slice] failover: namespace TcpExt {}", after.join(", "));
    let rep = backup.replication();
    let g = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    // The backup's own record is written once its takeover is over.
    let end = Instant::now() + Duration::from_secs(10);
    while g(&rep.failovers) == 0 || g(&rep.last_failover_us) == 0 {
        if Instant::now() > end {
            return Err("the backup did not take over".into());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    r.failover_recovery_ms = Some(recovery.as_secs_f64() * 1e3);
    r.failover_sessions_kept = Some(kept as u64);
    r.failover_sessions_total = Some(n as u64);
    r.bytes_corrupted += s.corrupted_bytes();
    r.failover = Failover {
        error: err.map(|e| format!("a session did not continue: {e}")),
        takeover_ms: Some(g(&rep.last_failover_us) as f64 / 1e3),
        takeover_failed: Some(g(&rep.takeover_failed)),
        commit_violations: Some(g(&rep.commit_violations)),
        resets_kept: backup.hold().commit_stats().map(|c| c.resets),
    };
    eprintln!(
        "[slice] failover: {kept} of {n} sessions kept, recovery {:.1} ms (takeover {:.1} ms), \
         {} violations",
        recovery.as_secs_f64() * 1e3,
        g(&rep.last_failover_us) as f64 / 1e3,
        g(&rep.commit_violations)
    );
    Ok(())
}

fn client_addr(i: &Instance<LineApp>) -> Result<String, String> {
    match i.client_endpoint() {
        Endpoint::Tcp(a) => Ok(a.clone()),
        e => Err(format!("client endpoint {e:?}")),
    }
}

fn streaming(
    o: &BenchOpts,
    a: &Instance<LineApp>,
    b: &Instance<LineApp>,
    r: &mut BenchReport,
) -> Result<(), String> {
    let addr = client_addr(a)?;
    let mut clients = Vec::new();
    for c in 0..o.streams {
        clients.push(StreamClient::start(&addr, c, 0, 2000).map_err(|e| format!("connect: {e}"))?);
    }
    let end = Instant::now() + Duration::from_secs(5);
    while a.session_ids().len() < o.streams && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut pauses = Vec::new();
    let (mut src, mut dst) = (a, b);
    let t = Instant::now();
    'moves: while pauses.len() < o.migrations && t.elapsed() < o.budget {
        let sessions = src.sessions();
        if sessions.is_empty() {
            return Err("no sessions left to move".into());
        }
        for (id, peer) in sessions {
            let Some(c) = clients.iter().find(|c| Some(c.local) == peer) else {
                continue;
            };
            let before = c.checked.load(Ordering::Relaxed);
            match src.migrate(id, dst.peer_endpoint(), dst.name()) {
                Ok(m) => pauses.push(m.pause),
                Err(e) => {
                    r.migrations_failed += 1;
                    if r.errors.len() < 10 {
                        r.errors.push(format!("move: {e}"));
                    }
                }
            }
            let end = Instant::now() + Duration::from_secs(10);
            while c.checked.load(Ordering::Relaxed) <= before {
                if Instant::now() > end {
                    r.errors
                        .push(format!("client {} saw no reply for 10 s", c.local));
                    break 'moves;
                }
                std::thread::sleep(Duration::from_micros(200));
            }
            if pauses.len() >= o.migrations {
                break;
            }
        }
        std::mem::swap(&mut src, &mut dst);
        if pauses.len() % 500 < o.streams {
            eprintln!("[slice] {} moves", pauses.len());
        }
    }
    r.migrations = pauses.len();
    r.migrations_total += pauses.len();
    r.pause_us_p50 = pct(&mut pauses, 0.5);
    r.pause_us_p99 = pct(&mut pauses, 0.99);
    r.pause_us_max = pct(&mut pauses, 1.0);
    let mut max_gap = Duration::ZERO;
    for c in clients {
        if let Ok(x) = c.retrans() {
            r.client_rtos += x.rto;
            r.client_retransmits += x.total_retrans;
        }
        let out = c.finish();
        r.lines_checked += out.lines;
        r.bytes_corrupted += out.corrupted_bytes;
        r.rto_stalls += out.gaps.iter().filter(|g| **g >= RTO_STALL).count();
        max_gap = out.gaps.iter().copied().fold(max_gap, Duration::max);
        if let Some(e) = out.error {
            r.errors.push(e);
        }
    }
    r.client_gap_ms_max = Some(max_gap.as_secs_f64() * 1e3);
    eprintln!(
        "[slice] streaming: {} moves ({} failed), pause us p50 {:.0} p99 {:.0}, rto stalls {}, \
         client RTOs {}, longest client gap {:.1} ms",
        r.migrations,
        r.migrations_failed,
        r.pause_us_p50.unwrap_or(f64::NAN),
        r.pause_us_p99.unwrap_or(f64::NAN),
        r.rto_stalls,
        r.client_rtos,
        max_gap.as_secs_f64() * 1e3
    );
    Ok(())
}

/// Bytes answered over `d` from now.
fn rate(c: &StreamClient, d: Duration) -> f64 {
    let b0 = c.answered_bytes.load(Ordering::Relaxed);
    let t0 = Instant::now();
    std::thread::sleep(d);
    let b1 = c.answered_bytes.load(Ordering::Relaxed);
    (b1 - b0) as f64 / t0.elapsed().as_secs_f64()
}

fn bulk(
    o: &BenchOpts,
    a: &Instance<LineApp>,
    b: &Instance<LineApp>,
    r: &mut BenchReport,
) -> Result<(), String> {
    let before_ids = a.session_ids();
    let addr = client_addr(a)?;
    // 64 KiB lines, at most 64 of them (4 MiB) unanswered: the window TCP would keep full.
    let c = StreamClient::start(&addr, 1000, 64 << 10, 64).map_err(|e| format!("connect: {e}"))?;
    let end = Instant::now() + Duration::from_secs(5);
    let id = loop {
        if let Some(id) = a
            .session_ids()
            .into_iter()
            .find(|i| !before_ids.contains(i))
        {
            break id;
        }
        if Instant::now() > end {
            return Err("the bulk session never appeared".into());
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    let (mut src, mut dst) = (a, b);
    let mut dips = Vec::new();
    let mut before_sum = 0.0;
    for _ in 0..o.bulk_moves {
        let before = rate(&c, Duration::from_secs(1));
        let b0 = c.answered_bytes.load(Ordering::Relaxed);
        let t0 = Instant::now();
        let moved = src.migrate(id, dst.peer_endpoint(), dst.name());
        let window = Duration::from_millis(o.dip_window_ms);
        if let Some(rest) = window.checked_sub(t0.elapsed()) {
            std::thread::sleep(rest);
        }
        let during =
            (c.answered_bytes.load(Ordering::Relaxed) - b0) as f64 / t0.elapsed().as_secs_f64();
        match moved {
            Ok(m) => {
                r.bulk_pause_us_each.push(m.pause.as_secs_f64() * 1e6);
                r.migrations_total += 1;
                if before > 0.0 {
                    dips.push(100.0 * (1.0 - during / before));
                }
                before_sum += before;
                std::mem::swap(&mut src, &mut dst);
            }
            Err(e) => {
                r.migrations_failed += 1;
                r.errors.push(format!("bulk move: {e}"));
            }
        }
    }
    if let Ok(x) = c.retrans() {
        r.bulk_client_rtos = x.rto;
        r.bulk_client_retransmits = x.total_retrans;
    }
    let out = c.finish();
    r.bytes_corrupted += out.corrupted_bytes;
    r.lines_checked += out.lines;
    if let Some(e) = out.error {
        r.errors.push(e);
    }
    if !dips.is_empty() {
        r.bulk_mbps_before = Some(before_sum / dips.len() as f64 * 8.0 / 1e6);
        r.iperf_dip_pct_each = dips.clone();
        dips.sort_by(f64::total_cmp);
        r.iperf_dip_pct = Some(dips[dips.len() / 2]);
    }
    eprintln!(
        "[slice] bulk: {:.0} Mbit/s before, dip over {} ms from the move start: {:?} %, pauses \
         us {:?}, client RTOs {} retransmits {}",
        r.bulk_mbps_before.unwrap_or(f64::NAN),
        o.dip_window_ms,
        r.iperf_dip_pct_each,
        r.bulk_pause_us_each,
        r.bulk_client_rtos,
        r.bulk_client_retransmits
    );
    Ok(())
}

fn drain(
    o: &BenchOpts,
    a: &Instance<LineApp>,
    b: &Instance<LineApp>,
    r: &mut BenchReport,
) -> Result<(), String> {
    let addr = client_addr(a)?;
    let mut idle = IdleSessions::connect(&addr, o.drain_sessions, Duration::from_secs(10))
        .map_err(|e| format!("connect: {e}"))?;
    idle.round()?;
    let end = Instant::now() + Duration::from_secs(10);
    while a.session_ids().len() < o.drain_sessions && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(1));
    }
    idle.send_all().map_err(|e| format!("write: {e}"))?;
    let t = Instant::now();
    let m = a
        .drain_to(b.peer_endpoint(), b.name(), o.drain_sessions.max(1))
        .map_err(|e| e.to_string())?;
    let ms = t.elapsed().as_secs_f64() * 1e3;
    r.migrations_total += m.moved.len();
    r.drain_moved = m.moved.len();
    r.migrations_failed += m.stayed.len();
    for (id, why) in m.stayed.iter().take(10) {
        r.errors
            .push(format!("drain: session {id:#x} stayed: {why}"));
    }
    r.drain_1000_ms = Some(ms);
    if let Err(e) = idle.check_all().and_then(|_| idle.round()) {
        r.errors.push(format!("drain: {e}"));
    }
    r.bytes_corrupted += idle.corrupted_bytes();
    eprintln!(
        "[slice] drain: {} of {} sessions in {ms:.1} ms ({:?})",
        m.moved.len(),
        o.drain_sessions,
        m.phases
    );
    Ok(())
}
