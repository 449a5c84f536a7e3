//! `pliant bench smr`: Redis throughput and latency unreplicated, through pliant-smr (three
//! replicas), with Redis replication plus `WAIT 1 0` after each write, and with Redis
//! replication under Sentinel (asynchronous); then a failover trial for pliant-smr and for
//! Sentinel (SIGKILL of the leader/primary under a write load of unique keys). Everything in
//! one run, at several client counts, interleaved (for each client count every system in
//! turn, so a neighbour's load drifting over the run touches every system alike).
//!
//! Everything runs on loopback in a private network namespace this process enters first
//! (`unshare(CLONE_NEWNET)`, unnamed: it ends with the process, nothing to remove). Servers
//! are children killed by their PID when their handles drop, on success or failure; the
//! scratch directory is removed the same way.

pub mod load;
pub mod report;

use crate::child::{redis_argv, ServerChild};
use crate::group::{free_port, LocalGroup};
use crate::Limits;
use report::{info_u64, parse_benchmark_csv, report_json, system_json, Failover, Measure};
use serde_json::{json, Map};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct BenchOpts {
    /// Client counts, each measured for every system.
    pub clients: Vec<u32>,
    /// The client count whose figures head each system (the others are under `by_clients`).
    pub headline: u32,
    /// Seconds of load per system and client count (writes and reads together).
    pub duration: Duration,
    pub replicas: u64,
    /// Run the failover trials.
    pub failover: bool,
    /// Connections of the failover load.
    pub failover_conns: u32,
    /// Sentinel's `down-after-milliseconds`.
    pub sentinel_down_ms: u64,
    pub redis_server: String,
    pub redis_benchmark: String,
    /// Polled between measurements: true stops the bench (what is measured is reported, the
    /// rest is an error "interrupted"), and everything is torn down as usual.
    pub interrupted: fn() -> bool,
}

impl Default for BenchOpts {
    fn default() -> Self {
        BenchOpts {
            clients: vec![1, 4, 8],
            headline: 4,
            duration: Duration::from_secs(5),
            replicas: 3,
            failover: true,
            failover_conns: 4,
            sentinel_down_ms: 1000,
            redis_server: "redis-server".into(),
            redis_benchmark: "redis-benchmark".into(),
            interrupted: || false,
        }
    }
}

const SYSTEMS: [&str; 4] = [
    "unreplicated",
    "pliant_smr",
    "redis_wait1",
    "redis_sentinel",
];

fn progress(s: &str) {
    eprintln!("bench smr: {s}");
}

/// The 1-minute load average, as `uptime` shows it.
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// Moves the calling thread (and every thread and process it starts afterwards) into a new,
/// unnamed network namespace with its loopback up. Call before any other thread starts.
pub fn enter_private_netns() -> Result<(), String> {
    // SAFETY: unshare has no memory effects; it changes this thread's namespace.
    if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
        return Err(format!(
            "unshare(CLONE_NEWNET): {} (the bench needs CAP_SYS_ADMIN for its private network \
             namespace)",
            std::io::Error::last_os_error()
        ));
    }
    let st = Command::new("ip")
        .args(["link", "set", "lo", "up"])
        .status()
        .map_err(|e| format!("ip link set lo up: {e}"))?;
    if !st.success() {
        return Err(format!("ip link set lo up: {st}"));
    }
    Ok(())
}

/// A scratch directory removed on drop.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A redis-server child working in `dir` (a replica writes the RDB it syncs from there).
fn redis(o: &BenchOpts, dir: &Path, extra: &[&str]) -> Result<ServerChild, String> {
    let port = free_port().map_err(|e| e.to_string())?;
    let mut argv = redis_argv(&o.redis_server, port);
    argv.extend(["--dir".to_string(), dir.display().to_string()]);
    argv.extend(extra.iter().map(|s| s.to_string()));
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    ServerChild::spawn(&argv, addr, Duration::from_secs(10)).map_err(|e| e.to_string())
}

/// Redis primary, its replica, and (started later) three sentinels watching them.
struct Replicated {
    primary: ServerChild,
    replica: ServerChild,
    sentinels: Vec<ServerChild>,
}

impl Replicated {
    fn start(o: &BenchOpts, dir: &Path) -> Result<Replicated, String> {
        let primary = redis(o, dir, &[])?;
        let (h, p) = (
            primary.addr.ip().to_string(),
            primary.addr.port().to_string(),
        );
        let replica = redis(o, dir, &["--replicaof", &h, &p])?;
        let t0 = Instant::now();
        loop {
            let i = load::info(&replica.addr.to_string())?;
            if i.contains("master_link_status:up") {
                break;
            }
            if t0.elapsed() > Duration::from_secs(10) {
                return Err("the Redis replica did not sync with its primary in 10 s".into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(Replicated {
            primary,
            replica,
            sentinels: Vec::new(),
        })
    }

    /// Three sentinels, quorum 2, each knowing the others and the replica before it returns.
    fn start_sentinels(&mut self, o: &BenchOpts, dir: &Path) -> Result<(), String> {
        for i in 0..3 {
            let port = free_port().map_err(|e| e.to_string())?;
            let conf = dir.join(format!("sentinel-{i}.conf"));
            let text = format!(
                "port {port}\nbind 127.0.0.1\ndir {}\nsentinel monitor bench 127.0.0.1 {} 2\n\
                 sentinel down-after-milliseconds bench {}\nsentinel failover-timeout bench \
                 10000\nsentinel parallel-syncs bench 1\n",
                dir.display(),
                self.primary.addr.port(),
                o.sentinel_down_ms
            );
            std::fs::write(&conf, text).map_err(|e| format!("{}: {e}", conf.display()))?;
            let argv = [
                o.redis_server.clone(),
                conf.display().to_string(),
                "--sentinel".into(),
            ];
            let addr = SocketAddr::from(([127, 0, 0, 1], port));
            self.sentinels.push(
                ServerChild::spawn(&argv, addr, Duration::from_secs(10))
                    .map_err(|e| format!("sentinel: {e}"))?,
            );
        }
        let t0 = Instant::now();
        loop {
            let ready = self.sentinels.iter().all(|s| {
                sentinel_master(&s.addr.to_string()).is_ok_and(|m| {
                    field(&m, "num-other-sentinels") == Some(2)
                        && field(&m, "num-slaves") >= Some(1)
                })
            });
            if ready {
                return Ok(());
            }
            if t0.elapsed() > Duration::from_secs(20) {
                return Err("the sentinels did not find each other and the replica in 20 s".into());
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// `SENTINEL MASTER bench` as name/value pairs.
fn sentinel_master(addr: &str) -> Result<Vec<(String, String)>, String> {
    let mut c = load::connect(addr, Duration::from_secs(1)).map_err(|e| e.to_string())?;
    let v: Vec<String> = redis::cmd("SENTINEL")
        .arg("MASTER")
        .arg("bench")
        .query(&mut c)
        .map_err(|e| e.to_string())?;
    Ok(v.chunks(2)
        .filter(|p| p.len() == 2)
        .map(|p| (p[0].clone(), p[1].clone()))
        .collect())
}

fn field(pairs: &[(String, String)], name: &str) -> Option<u64> {
    pairs
        .iter()
        .find(|(k, _)| k == name)
        .and_then(|(_, v)| v.parse().ok())
}

/// `redis-benchmark -t set,get` against `addr`: `n` requests per test.
fn benchmark(o: &BenchOpts, addr: SocketAddr, n: u64, clients: u32) -> Result<String, String> {
    let out = Command::new(&o.redis_benchmark)
        .args(["-h", &addr.ip().to_string(), "-p", &addr.port().to_string()])
        .args(["-t", "set,get", "-r", "100000", "-P", "1", "--csv"])
        .args(["-n", &n.to_string(), "-c", &clients.to_string()])
        .output()
        .map_err(|e| format!("{}: {e}", o.redis_benchmark))?;
    if !out.status.success() {
        return Err(format!(
            "redis-benchmark: {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A redis-benchmark run sized to take about `o.duration`: a short probe gives the rate.
fn measure_benchmark(
    o: &BenchOpts,
    addr: SocketAddr,
    clients: u32,
    replicated: impl Fn() -> Option<u64>,
) -> Result<Measure, String> {
    let probe_n = 100 * u64::from(clients);
    let probe = parse_benchmark_csv(&benchmark(o, addr, probe_n, clients)?)?;
    let m = Measure::from_benchmark(clients, probe_n, &probe, None)?;
    let n = ((m.ops_per_s() * o.duration.as_secs_f64() / 2.0) as u64).clamp(200, 2_000_000);
    let before = replicated();
    let lines = parse_benchmark_csv(&benchmark(o, addr, n, clients)?)?;
    let bytes = match (before, replicated()) {
        (Some(a), Some(b)) => Some(b.saturating_sub(a)),
        _ => None,
    };
    Measure::from_benchmark(clients, n, &lines, bytes)
}

fn repl_offset(addr: SocketAddr) -> Option<u64> {
    load::info(&addr.to_string())
        .ok()
        .and_then(|i| info_u64(&i, "master_repl_offset"))
}

/// Results gathered per system.
#[derive(Default)]
struct Acc {
    runs: Vec<Measure>,
    errors: Vec<String>,
    failover: Option<Failover>,
}

impl Acc {
    fn push(&mut self, what: String, r: Result<Measure, String>) {
        match r {
            Ok(m) => {
                progress(&format!(
                    "{what}: {:.0} ops/s, p50 {:.0} us, p99 {:.0} us, {:.1} B/op (load {})",
                    m.ops_per_s(),
                    m.p50_us,
                    m.p99_us,
                    m.bytes_per_op(),
                    loadavg()
                ));
                self.runs.push(m);
            }
            Err(e) => {
                progress(&format!("{what}: {e}"));
                self.errors.push(format!("{what}: {e}"));
            }
        }
    }
}

/// Runs the whole bench; the report is the JSON object `pliant bench smr` prints. A system
/// that cannot be set up or measured reports its error and `null` figures; the others go on.
pub fn run(o: &BenchOpts) -> Result<serde_json::Value, String> {
    if o.clients.is_empty() || o.clients.contains(&0) {
        return Err("client counts must be at least 1".into());
    }
    if o.replicas == 0 {
        return Err("at least one replica".into());
    }
    for tool in [&o.redis_server, &o.redis_benchmark] {
        if Command::new(tool).arg("--version").output().is_err() {
            return Err(format!(
                "{tool} not found (Debian: redis-server, redis-tools)"
            ));
        }
    }
    let load_start = loadavg();
    let dir = std::env::temp_dir().join(format!("pliant-bench-smr-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let scratch = Scratch(dir);
    let mut acc: Vec<Acc> = SYSTEMS.iter().map(|_| Acc::default()).collect();

    progress("starting: a redis-server alone, a 3-replica pliant-smr group, a Redis pair");
    let single = redis(o, &scratch.0, &[]);
    let argv_server = o.redis_server.clone();
    let group = LocalGroup::start(
        scratch.0.join("smr"),
        o.replicas,
        false,
        Limits::default(),
        Box::new(move |p| redis_argv(&argv_server, p)),
    )
    .map_err(|e| e.to_string())
    .and_then(|g| {
        let l = g
            .wait_leader(Duration::from_secs(10))
            .map_err(|e| e.to_string())?;
        Ok((g, l))
    });
    let mut pair = Replicated::start(o, &scratch.0);
    let sentinels = match pair.as_mut() {
        Ok(p) => p.start_sentinels(o, &scratch.0),
        Err(e) => Err(e.clone()),
    };

    let stop = || (o.interrupted)().then(|| Err::<Measure, _>("interrupted".to_string()));
    for &c in &o.clients {
        // unreplicated
        if let Some(e) = stop() {
            for (a, name) in acc.iter_mut().zip(SYSTEMS) {
                a.push(format!("{name}, {c} clients"), e.clone());
            }
            continue;
        }
        let r = single
            .as_ref()
            .map_err(Clone::clone)
            .and_then(|s| measure_benchmark(o, s.addr, c, || None));
        acc[0].push(format!("unreplicated, {c} clients"), r);
        // pliant_smr
        let r = group.as_ref().map_err(Clone::clone).and_then(|(g, l)| {
            let front: SocketAddr = g
                .front_addr(*l)
                .ok_or("the leader has no front")?
                .parse()
                .map_err(|e| format!("front address: {e}"))?;
            let rep = g.replica(*l).ok_or("the leader is gone")?;
            measure_benchmark(o, front, c, || {
                Some(rep.status().log_bytes.load(Ordering::Relaxed))
            })
        });
        acc[1].push(format!("pliant_smr, {c} clients"), r);
        // redis_wait1
        let r = pair.as_ref().map_err(Clone::clone).and_then(|p| {
            let before = repl_offset(p.primary.addr);
            let mut m = load::wait1(&p.primary.addr.to_string(), c, o.duration)?;
            m.replicated = before
                .zip(repl_offset(p.primary.addr))
                .map(|(a, b)| b.saturating_sub(a));
            Ok(m)
        });
        acc[2].push(format!("redis_wait1, {c} clients"), r);
        // redis_sentinel
        let r = pair.as_ref().map_err(Clone::clone).and_then(|p| {
            sentinels.clone()?;
            measure_benchmark(o, p.primary.addr, c, || repl_offset(p.primary.addr))
        });
        acc[3].push(format!("redis_sentinel, {c} clients"), r);
    }

    if o.failover && !(o.interrupted)() {
        let warm = Duration::from_secs(1);
        let within = Duration::from_secs(30);
        acc[1].failover = Some(match group {
            Ok((mut g, leader)) => {
                let fronts: Vec<String> =
                    (1..=o.replicas).filter_map(|i| g.front_addr(i)).collect();
                progress(&format!(
                    "pliant_smr failover: replica {leader} killed under load"
                ));
                let f = load::failover(&fronts, o.failover_conns, warm, within, || g.kill(leader));
                report_failover("pliant_smr", &f);
                f
            }
            Err(e) => failed(e),
        });
        acc[3].failover = Some(match (pair.as_mut(), &sentinels) {
            (Ok(p), Ok(())) => {
                let cands = vec![p.primary.addr.to_string(), p.replica.addr.to_string()];
                progress("redis_sentinel failover: primary SIGKILLed under load");
                let f = load::failover(&cands, o.failover_conns, warm, within, || p.primary.kill());
                report_failover("redis_sentinel", &f);
                f
            }
            (Err(e), _) => failed(e.clone()),
            (_, Err(e)) => failed(e.clone()),
        });
    }

    let mut systems = Map::new();
    for (name, a) in SYSTEMS.iter().zip(&acc) {
        let v = system_json(&a.runs, &a.errors, a.failover.as_ref(), o.headline);
        systems.insert(name.to_string(), v);
    }
    let meta = json!({
        "clients": o.clients,
        "headline_clients": o.headline,
        "duration_s_per_run": o.duration.as_secs_f64(),
        "replicas": o.replicas,
        "workload": "redis-benchmark -t set,get -r 100000 -P 1 (redis_wait1: SET+WAIT 1 0 pipelined, then GET, own load generator); ops_per_s over both tests, latency of the write",
        "sentinel_down_after_ms": o.sentinel_down_ms,
        "failover_conns": o.failover_conns,
        "load_average_start": load_start,
        "load_average_end": loadavg(),
        "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
    });
    Ok(report_json(systems, meta))
}

fn failed(e: String) -> Failover {
    Failover {
        error: Some(e),
        ..Failover::default()
    }
}

fn report_failover(name: &str, f: &Failover) {
    progress(&format!(
        "{name} failover: {} ms, {} acked, {} acked lost, {}/{} connections kept{} (load {})",
        f.failover_ms.map_or("-".into(), |v| format!("{v:.0}")),
        f.acked_writes,
        f.acked_writes_lost,
        f.connections_kept,
        f.connections_total,
        f.error.as_ref().map_or(String::new(), |e| format!(", {e}")),
        loadavg()
    ));
}
