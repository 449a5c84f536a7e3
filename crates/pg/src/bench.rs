//! `pliant bench pg`: pgbench TPS/latency for an unprotected primary, synchronous replication
//! direct, and through the pliant proxy with protection; then failover runs (failover_ms,
//! sessions kept, acked commits lost), all in one run on one cluster.

use crate::bank;
use crate::client::{Client, Dial};
use crate::cluster::{Cluster, ClusterConfig, ClusterTls};
use crate::proxy::{AuthMethod, ClusterOps, ListenTls, Proxy, ProxyConfig, UpstreamTls};
use crate::tls::DemoPki;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;
use std::time::{Duration, Instant};

const PGBENCH: &str = "/usr/lib/postgresql/15/bin/pgbench";

#[derive(Clone, Debug)]
pub struct BenchOpts {
    pub scale: u32,
    pub clients: u32,
    pub duration_s: u32,
    /// Kill trials under the bank workload (each is a failover + re-protection).
    pub trials: u32,
    pub fsync: bool,
    /// Leader kills of the Patroni peer (0 = do not run it).
    pub patroni_trials: u32,
    /// Rounds of the protected measurements: each round runs syncrep directly, the pliant
    /// proxy and pgbouncer back to back (TPC-B, then select-only), so that the neighbours'
    /// load drifts over all three alike; the TPS figures are means over the rounds.
    pub rounds: u32,
    /// TLS everywhere: the servers (`hostssl` only), pgbench against them and against the
    /// proxy and pgbouncer (`sslmode=require`), the proxy to the servers (verified), the bank
    /// and idle sessions; the Patroni peer runs without.
    pub tls: bool,
    /// pgbench `-R`: a fixed transaction rate instead of as fast as possible (CPU per
    /// transaction is then comparable between systems on a noisy machine).
    pub rate: Option<u32>,
}

impl Default for BenchOpts {
    fn default() -> Self {
        BenchOpts {
            scale: 10,
            clients: 8,
            duration_s: 10,
            trials: 5,
            fsync: true,
            patroni_trials: 3,
            rounds: 2,
            tls: false,
            rate: None,
        }
    }
}

/// One pgbench measurement.
#[derive(Debug, Clone, Copy, Default)]
pub struct Run {
    pub tps: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub failed: u64,
    pub aborted_clients: u32,
    /// Transactions in pgbench's per-transaction log.
    pub transactions: u64,
}

fn progress(s: &str) {
    eprintln!("bench pg: {s}");
}

/// What pgbench itself does before a TPC-B run unless told not to (`-n`, which the runs use
/// because they go through proxies): vacuum the small hot tables and empty the history, so
/// every run starts from the same database. Run directly on the primary, not timed.
pub fn reset_tpcb(cl: &Cluster, primary: usize) -> Result<(), String> {
    let mut c = cl.client(primary, Duration::from_secs(60))?;
    for sql in [
        "VACUUM pgbench_branches",
        "VACUUM pgbench_tellers",
        "TRUNCATE pgbench_history",
    ] {
        c.query(sql)
            .map_err(|e| format!("before a TPC-B run, {sql}: {e}"))?;
    }
    Ok(())
}

/// Runs pgbench against `addr`; `select_only` = built-in select-only script (-S).
pub fn pgbench(
    addr: SocketAddr,
    user: &str,
    pw: &str,
    o: &BenchOpts,
    select_only: bool,
    dir: &Path,
) -> Result<Run, String> {
    let logdir = dir.join(format!("pgbench-{}", rand_tag()?));
    std::fs::create_dir_all(&logdir).map_err(|e| e.to_string())?;
    let mut cmd = Command::new(PGBENCH);
    cmd.env("PGPASSWORD", pw)
        .args([
            "-h",
            &addr.ip().to_string(),
            "-p",
            &addr.port().to_string(),
            "-U",
            user,
            "-n",
        ])
        .args([
            "-c",
            &o.clients.to_string(),
            "-j",
            "2",
            "-T",
            &o.duration_s.to_string(),
        ])
        .arg("-l")
        .arg(format!("--log-prefix={}", logdir.join("tx").display()));
    if select_only {
        cmd.arg("-S");
    }
    if let Some(r) = o.rate {
        cmd.args(["-R", &r.to_string()]);
    }
    if o.tls {
        cmd.env("PGSSLMODE", "require");
    }
    cmd.arg("postgres");
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("pgbench: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let tps = stdout
        .lines()
        .find(|l| l.starts_with("tps = "))
        .and_then(|l| l.split_whitespace().nth(2))
        .and_then(|v| v.parse::<f64>().ok())
        .ok_or_else(|| format!("pgbench gave no tps: {stdout} {stderr}"))?;
    let failed = stdout
        .lines()
        .find(|l| l.starts_with("number of failed transactions"))
        .and_then(|l| l.split(':').nth(1))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let aborted_clients = stderr
        .lines()
        .filter(|l| l.contains("aborted in command"))
        .count() as u32;
    let mut lat = Vec::new();
    for e in std::fs::read_dir(&logdir)
        .map_err(|e| e.to_string())?
        .flatten()
    {
        let s = std::fs::read_to_string(e.path()).unwrap_or_default();
        for l in s.lines() {
            if let Some(us) = l
                .split_whitespace()
                .nth(2)
                .and_then(|v| v.parse::<u64>().ok())
            {
                lat.push(us);
            }
        }
    }
    let _ = std::fs::remove_dir_all(&logdir);
    lat.sort_unstable();
    let pct = |p: f64| -> f64 {
        if lat.is_empty() {
            return 0.0;
        }
        let i = ((lat.len() as f64 - 1.0) * p).round() as usize;
        lat[i.min(lat.len() - 1)] as f64 / 1000.0
    };
    Ok(Run {
        tps,
        p50_ms: pct(0.5),
        p99_ms: pct(0.99),
        failed,
        aborted_clients,
        transactions: lat.len() as u64,
    })
}

/// A random tag for a log directory; an error rather than one name for every run.
fn rand_tag() -> Result<String, String> {
    crate::secrets::random_bytes::<4>()
        .map(|b| b.iter().map(|x| format!("{x:02x}")).collect())
        .map_err(|e| e.to_string())
}

/// Tears the cluster down even on early return.
struct Guard(Arc<Cluster>);
impl Drop for Guard {
    fn drop(&mut self) {
        self.0.teardown();
    }
}

/// Default of `async_fallback_ms`: long enough that a busy standby is not mistaken for a lost
/// one, short enough that clients see a stall rather than an outage.
pub const DEFAULT_ASYNC_FALLBACK_MS: u64 = 3000;

pub fn proxy_config(c: &Cluster, primary: usize) -> ProxyConfig {
    ProxyConfig {
        listen: SocketAddr::new(c.host_ip.into(), 6432),
        user: c.cfg.user.clone(),
        password: c.cfg.password.clone(),
        nodes: [c.nodes[0].addr(), c.nodes[1].addr()],
        primary,
        probe_interval_ms: 100,
        probe_timeout_ms: 250,
        probe_dead_after_ms: crate::proxy::DEFAULT_PROBE_DEAD_AFTER_MS,
        max_sessions: 500,
        auto_reprotect: true,
        auth: AuthMethod::ScramSha256,
        async_fallback_ms: Some(DEFAULT_ASYNC_FALLBACK_MS),
        startup_timeout_ms: crate::proxy::DEFAULT_STARTUP_TIMEOUT_MS,
        tls: None,
        server_tls: None,
        relay_threads: 0,
    }
}

/// Switches the cluster's servers to TLS (before `init_primary`) with a demo PKI made in
/// `dir` that names the cluster's addresses.
pub fn cluster_tls(cl: &mut Cluster, dir: &Path) -> Result<DemoPki, String> {
    let pki = crate::tls::make_demo_pki(dir, &cl.addresses())?;
    cl.set_tls(ClusterTls {
        cert: pki.cert.clone(),
        key: pki.key.clone(),
        ca: pki.ca.clone(),
    })?;
    Ok(pki)
}

/// TLS on both sides of the proxy with `pki`: clients must use TLS (the proxy presents the
/// PKI's server certificate), servers are verified against its CA.
pub fn require_tls(pc: &mut ProxyConfig, pki: &DemoPki) {
    pc.tls = Some(ListenTls {
        cert: pki.cert.clone(),
        key: pki.key.clone(),
        allow_plaintext: false,
    });
    pc.server_tls = Some(UpstreamTls {
        ca: pki.ca.clone(),
        server_name: None,
        allow_cleartext_password: false,
    });
}

/// `pgbench -i -s scale` on the first server (direct, before the proxy exists; over TLS when
/// the servers speak it).
pub fn pgbench_init(cl: &Cluster, scale: u32) -> Result<(), String> {
    let (u, pw) = (&cl.cfg.user, &cl.cfg.password);
    let mut cmd = Command::new(PGBENCH);
    if cl.cfg.tls.is_some() {
        cmd.env("PGSSLMODE", "require");
    }
    let out = cmd
        .env("PGPASSWORD", pw)
        .args([
            "-h",
            &cl.nodes[0].ip.to_string(),
            "-U",
            u,
            "-i",
            "-q",
            "-s",
            &scale.to_string(),
            "postgres",
        ])
        .output()
        .map_err(|e| format!("pgbench -i: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "pgbench -i: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(())
}

/// The whole benchmark; returns the JSON object (progress on stderr).
pub fn run(o: BenchOpts) -> Result<Value, String> {
    let mut c = Cluster::create(ClusterConfig {
        fsync: o.fsync,
        shared_buffers_mb: 128,
        ..Default::default()
    })?;
    let pki = if o.tls {
        let d = c.dir.join("pki");
        let made = std::fs::create_dir_all(&d)
            .map_err(|e| format!("mkdir {}: {e}", d.display()))
            .and_then(|()| cluster_tls(&mut c, &d));
        match made {
            Ok(p) => Some(p),
            Err(e) => {
                drop(Guard(Arc::new(c)));
                return Err(e);
            }
        }
    } else {
        None
    };
    let cl = Arc::new(c);
    let guard = Guard(cl.clone());
    let (u, pw) = (cl.cfg.user.clone(), cl.cfg.password.clone());
    cl.init_primary()?;
    progress(&format!("pgbench -i -s {}", o.scale));
    pgbench_init(&cl, o.scale)?;
    let direct = cl.nodes[0].addr();
    let measure = |name: &str, addr: SocketAddr, select_only: bool| -> Result<Run, String> {
        let r = pgbench(addr, &u, &pw, &o, select_only, &cl.dir)?;
        progress(&format!(
            "{name} {}: {:.0} tps p50 {:.2} ms p99 {:.2} ms",
            if select_only { "select-only" } else { "tpcb" },
            r.tps,
            r.p50_ms,
            r.p99_ms
        ));
        Ok(r)
    };
    reset_tpcb(&cl, 0)?;
    let un = [measure("unprotected", direct, false)?];
    let un_s = [measure("unprotected", direct, true)?];
    cl.add_standby(1, 0)?;
    cl.protect(0, 1)?;
    let ops: Arc<dyn ClusterOps> = cl.clone();
    let mut pc = proxy_config(&cl, 0);
    if let Some(p) = &pki {
        require_tls(&mut pc, p);
    }
    let proxy = Proxy::start(pc, true, Some(ops))?;
    let mut bouncer = Pgbouncer::start(&cl, direct);
    let failovers_before = proxy.shared.stats.failovers.load(SeqCst);
    // Per mode: TPC-B runs, select-only runs (one per round).
    let (mut sy, mut pl, mut pb) = (Vec::new(), Vec::new(), Vec::new());
    let (mut sy_s, mut pl_s, mut pb_s) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..o.rounds.max(1) {
        for sel in [false, true] {
            // After a (spurious) failover: measure the new primary once it is protected again,
            // with pgbouncer pointed at it (counted in `failovers_during_tps`).
            wait_protected(&proxy);
            let direct = cl.nodes[proxy.shared.primary.load(SeqCst)].addr();
            if bouncer.as_ref().is_ok_and(|b| b.primary != direct) {
                drop(bouncer);
                bouncer = Pgbouncer::start(&cl, direct);
            }
            let (a, b, c) = if sel {
                (&mut sy_s, &mut pl_s, &mut pb_s)
            } else {
                (&mut sy, &mut pl, &mut pb)
            };
            // Each system in turn, from the same starting point, the order reversed every
            // other round: TPC-B slows down as its tables bloat over a run's updates, so
            // back-to-back runs in a fixed order handed every later system a slower database
            // (in one measured run the three ranked by position, not by system).
            let mut order: Vec<(&str, SocketAddr, &mut Vec<Run>)> =
                vec![("syncrep", direct, a), ("pliant", proxy.addr, b)];
            if let Ok(pgb) = &bouncer {
                order.push(("pgbouncer", pgb.addr, c));
            }
            if round % 2 == 1 {
                order.reverse();
            }
            for (name, addr, runs) in order {
                if !sel {
                    reset_tpcb(&cl, proxy.shared.primary.load(SeqCst))?;
                }
                runs.push(measure(name, addr, sel)?);
            }
        }
    }
    let failovers_during_tps = proxy.shared.stats.failovers.load(SeqCst) - failovers_before;
    let mut res = serde_json::Map::new();
    let mean = |v: &[Run], f: fn(&Run) -> f64| -> f64 {
        v.iter().map(f).sum::<f64>() / (v.len().max(1) as f64)
    };
    let tps = |v: &[Run]| mean(v, |r| r.tps);
    let ratio = |a: &[Run], b: &[Run]| tps(a) / tps(b).max(1e-9);
    // Same-round ratios, to show the spread.
    let per_round = |a: &[Run], b: &[Run]| -> Value {
        json!(a
            .iter()
            .zip(b)
            .map(|(x, y)| x.tps / y.tps.max(1e-9))
            .collect::<Vec<_>>())
    };
    let mode = |t: &[Run], s: &[Run]| -> Value {
        json!({"tpcb": {"tps": tps(t), "p50_ms": mean(t, |r| r.p50_ms), "p99_ms": mean(t, |r| r.p99_ms),
                        "tps_rounds": t.iter().map(|r| r.tps).collect::<Vec<_>>()},
               "select_only": {"tps": tps(s), "p50_ms": mean(s, |r| r.p50_ms), "p99_ms": mean(s, |r| r.p99_ms),
                               "tps_rounds": s.iter().map(|r| r.tps).collect::<Vec<_>>()}})
    };
    res.insert("tls".into(), o.tls.into());
    res.insert(
        "proxy_relay_threads".into(),
        crate::proxy::default_relay_threads().into(),
    );
    res.insert("tps_unprotected".into(), tps(&un).into());
    res.insert("tps_syncrep".into(), tps(&sy).into());
    res.insert("tps_pliant".into(), tps(&pl).into());
    res.insert("ratio_vs_unprotected".into(), ratio(&pl, &un).into());
    res.insert("ratio_vs_syncrep".into(), ratio(&pl, &sy).into());
    res.insert("ratio_vs_syncrep_rounds".into(), per_round(&pl, &sy));
    res.insert("ratio_select_vs_syncrep".into(), ratio(&pl_s, &sy_s).into());
    res.insert(
        "ratio_select_vs_syncrep_rounds".into(),
        per_round(&pl_s, &sy_s),
    );
    res.insert("rounds".into(), o.rounds.max(1).into());
    res.insert("failovers_during_tps".into(), failovers_during_tps.into());
    res.insert(
        "latency_ms_p50".into(),
        json!({"unprotected": un[0].p50_ms, "syncrep": mean(&sy, |r| r.p50_ms), "pliant": mean(&pl, |r| r.p50_ms)}),
    );
    res.insert(
        "latency_ms_p99".into(),
        json!({"unprotected": un[0].p99_ms, "syncrep": mean(&sy, |r| r.p99_ms), "pliant": mean(&pl, |r| r.p99_ms)}),
    );
    res.insert(
        "select_only".into(),
        json!({"tps_unprotected": tps(&un_s), "tps_syncrep": tps(&sy_s), "tps_pliant": tps(&pl_s),
               "ratio_vs_syncrep": ratio(&pl_s, &sy_s),
               "latency_ms_p50": {"unprotected": un_s[0].p50_ms, "syncrep": mean(&sy_s, |r| r.p50_ms), "pliant": mean(&pl_s, |r| r.p50_ms)},
               "latency_ms_p99": {"unprotected": un_s[0].p99_ms, "syncrep": mean(&sy_s, |r| r.p99_ms), "pliant": mean(&pl_s, |r| r.p99_ms)}}),
    );
    let pgbouncer = match &bouncer {
        Ok(b) => {
            json!({"version": b.version, "pool_mode": POOL_MODE, "default_pool_size": PGBOUNCER_POOL_SIZE,
                   "tps": tps(&pb), "select_only_tps": tps(&pb_s),
                   "ratio_vs_syncrep": ratio(&pb, &sy), "ratio_select_vs_syncrep": ratio(&pb_s, &sy_s),
                   "pliant_ratio_vs_pgbouncer": ratio(&pl, &pb),
                   "pliant_ratio_select_vs_pgbouncer": ratio(&pl_s, &pb_s),
                   "runs": mode(&pb, &pb_s)})
        }
        Err(e) => json!({ "error": e }),
    };
    drop(bouncer);
    res.insert("pgbouncer".into(), pgbouncer);
    res.insert(
        "runs".into(),
        json!({"unprotected": mode(&un, &un_s), "syncrep": mode(&sy, &sy_s), "pliant": mode(&pl, &pl_s)}),
    );

    // Failover with pgbench sessions and idle psql-like sessions through the proxy.
    progress("failover under pgbench");
    let fo = failover_with_pgbench(&cl, &proxy, &o)?;
    progress(&format!("pgbench failover: {fo}"));
    // Kill trials under the bank workload.
    let tr = bank::run_trials(&cl, &proxy, o.clients, o.trials, &mut |s| progress(s))?;
    let mut fms = tr.failover_ms.clone();
    fms.sort_unstable();
    let median = fms.get(fms.len() / 2).copied().unwrap_or(0);
    let kept = fo["sessions_kept"].as_u64().unwrap_or(0)
        + tr.sessions_total.saturating_sub(tr.sessions_dropped);
    let total = fo["sessions_total"].as_u64().unwrap_or(0) + tr.sessions_total;
    res.insert("failover_ms".into(), median.into());
    res.insert("failover_ms_all".into(), json!(tr.failover_ms));
    res.insert(
        "failover_ms_max".into(),
        fms.last().copied().unwrap_or(0).into(),
    );
    res.insert("reprotect_ms".into(), json!(tr.reprotect_ms));
    res.insert("sessions_kept".into(), kept.into());
    res.insert("sessions_total".into(), total.into());
    res.insert("acked_commits_lost".into(), tr.acked_commits_lost.into());
    res.insert("acked_commits".into(), tr.acked_commits.into());
    res.insert("outcome_mismatch".into(), tr.outcome_mismatch.into());
    res.insert("outcomes_unknown".into(), tr.outcomes_unknown.into());
    res.insert("total_conserved".into(), tr.total_conserved.into());
    res.insert("trials".into(), (tr.trials + 1).into());
    res.insert("pgbench_failover".into(), fo);
    res.insert("proxy".into(), proxy.stats_json());
    proxy.stop();
    drop(guard);
    // The peer, measured in the same run once pliant's cluster is gone (CPU is shared).
    let patroni = if o.patroni_trials == 0 {
        json!({"error": "not run (--patroni-trials 0)"})
    } else if !crate::patroni::available() {
        json!({"error": "not run: patroni or etcd is not installed (scripts/install-deps.sh)"})
    } else {
        progress("Patroni + etcd peer");
        let po = crate::patroni::PatroniOpts {
            clients: o.clients,
            trials: o.patroni_trials,
            fsync: o.fsync,
            ..Default::default()
        };
        crate::patroni::run(&po).unwrap_or_else(|e| json!({ "error": e }))
    };
    if let Some(pf) = patroni["failover_ms"].as_u64().filter(|_| median > 0) {
        res.insert(
            "failover_speedup_vs_patroni".into(),
            (pf as f64 / median as f64).into(),
        );
    }
    res.insert("patroni".into(), patroni);
    Ok(Value::Object(res))
}

/// pgbouncer's pooling mode in the bench: what a user putting it in front of PostgreSQL for
/// pgbench-like clients (simple protocol, no session state) would pick.
pub const POOL_MODE: &str = "transaction";

/// Debian's pgbouncer in front of the primary (host namespace, as the proxy), run as
/// `postgres` in the foreground; stopped on drop.
struct Pgbouncer {
    child: std::process::Child,
    addr: SocketAddr,
    primary: SocketAddr,
    version: String,
}

const PGBOUNCER: &str = "/usr/sbin/pgbouncer";
/// Server connections per pool: more than the bench's clients, so none waits for one.
const PGBOUNCER_POOL_SIZE: u32 = 100;

impl Pgbouncer {
    fn start(cl: &Cluster, primary: SocketAddr) -> Result<Pgbouncer, String> {
        if !Path::new(PGBOUNCER).exists() {
            return Err("not run: pgbouncer is not installed (apt-get install pgbouncer)".into());
        }
        let version = Command::new(PGBOUNCER)
            .arg("--version")
            .output()
            .map(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .lines()
                    .next()
                    .unwrap_or("")
                    .to_string()
            })
            .unwrap_or_default();
        let dir = cl.dir.join("pgbouncer");
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let addr = SocketAddr::new(cl.host_ip.into(), 6433);
        let (u, pw) = (&cl.cfg.user, &cl.cfg.password);
        // pgbouncer (running as postgres) reads the password from it: 0600, owned by postgres.
        crate::secrets::write_private_owned(
            &dir.join("userlist.txt"),
            format!("\"{u}\" \"{pw}\"\n").as_bytes(),
            Some(crate::cluster::postgres_ids()?),
        )?;
        let mut ini = format!(
            "[databases]\npostgres = host={} port={} dbname=postgres\n\n[pgbouncer]\n\
             listen_addr = {}\nlisten_port = {}\nunix_socket_dir =\n\
             auth_type = md5\nauth_file = {}\npool_mode = {POOL_MODE}\n\
             default_pool_size = {PGBOUNCER_POOL_SIZE}\nmax_client_conn = 1000\n",
            primary.ip(),
            primary.port(),
            addr.ip(),
            addr.port(),
            dir.join("userlist.txt").display()
        );
        // TLS as the proxy has it: clients must use it (the servers' certificate, which names
        // this address too), the servers' certificates verified against the CA.
        if let Some(t) = &cl.cfg.tls {
            ini.push_str(&format!(
                "client_tls_sslmode = require\nclient_tls_cert_file = {}\n\
                 client_tls_key_file = {}\nserver_tls_sslmode = verify-ca\n\
                 server_tls_ca_file = {}\n",
                t.cert.display(),
                t.key.display(),
                t.ca.display()
            ));
        }
        std::fs::write(dir.join("pgbouncer.ini"), ini).map_err(|e| e.to_string())?;
        let child = Command::new("setpriv")
            .args(["--reuid=postgres", "--regid=postgres", "--init-groups"])
            .arg(PGBOUNCER)
            .arg(dir.join("pgbouncer.ini"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(
                std::fs::File::create(dir.join("pgbouncer.log")).map_err(|e| e.to_string())?,
            ))
            .spawn()
            .map_err(|e| format!("pgbouncer: {e}"))?;
        let b = Pgbouncer {
            child,
            addr,
            primary,
            version,
        };
        let t0 = Instant::now();
        loop {
            if Client::dial(&Dial {
                addr,
                user: u,
                password: pw,
                database: "postgres",
                connect_timeout: Duration::from_secs(2),
                timeout: Duration::from_secs(2),
                tls: cl.tls_client(),
            })
            .and_then(|mut c| c.query("SELECT 1").map(|_| ()))
            .is_ok()
            {
                return Ok(b);
            }
            if t0.elapsed() > Duration::from_secs(10) {
                let log = std::fs::read_to_string(dir.join("pgbouncer.log")).unwrap_or_default();
                return Err(format!("pgbouncer did not come up: {log}"));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Pgbouncer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// pgbench (TPC-B, `clients` sessions) plus 4 idle sessions through the proxy; the primary is
/// SIGKILLed mid-run. Counts sessions that stayed connected.
/// Waits (up to 60 s) until the proxy's primary has a synchronous standby.
fn wait_protected(proxy: &Proxy) {
    let t0 = Instant::now();
    while !proxy.shared.protected.load(SeqCst) && t0.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn failover_with_pgbench(cl: &Arc<Cluster>, proxy: &Proxy, o: &BenchOpts) -> Result<Value, String> {
    wait_protected(proxy);
    let (u, pw) = (cl.cfg.user.clone(), cl.cfg.password.clone());
    let mut idle: Vec<Client> = (0..4)
        .map(|_| {
            Client::dial(&Dial {
                addr: proxy.addr,
                user: &u,
                password: &pw,
                database: "postgres",
                connect_timeout: Duration::from_secs(5),
                timeout: Duration::from_secs(5),
                tls: cl.tls_client(),
            })
        })
        .collect::<Result<_, _>>()
        .map_err(|e| e.to_string())?;
    for c in idle.iter_mut() {
        c.query("SET application_name = 'idle-session'")
            .map_err(|e| e.to_string())?;
    }
    let addr = proxy.addr;
    let dir = cl.dir.clone();
    let mut po = o.clone();
    po.duration_s = 8;
    let h = std::thread::spawn(move || pgbench(addr, &u, &pw, &po, false, &dir));
    std::thread::sleep(Duration::from_secs(3));
    let p = proxy.shared.primary.load(SeqCst);
    let before = proxy.shared.stats.failovers.load(SeqCst);
    let tk = Instant::now();
    cl.inject_failure(p, true, true)?;
    while proxy.shared.stats.failovers.load(SeqCst) == before
        && tk.elapsed() < Duration::from_secs(30)
    {
        std::thread::sleep(Duration::from_millis(5));
    }
    let detect_promote_ms = tk.elapsed().as_millis() as u64;
    let run = h.join().map_err(|_| "pgbench thread panicked")??;
    let mut idle_kept = 0u64;
    for c in idle.iter_mut() {
        if c.scalar("SHOW application_name").ok().flatten().as_deref() == Some("idle-session") {
            idle_kept += 1;
        }
    }
    let total = o.clients as u64 + idle.len() as u64;
    let kept = o.clients.saturating_sub(run.aborted_clients) as u64 + idle_kept;
    Ok(
        json!({"sessions_total": total, "sessions_kept": kept, "pgbench_clients_aborted": run.aborted_clients,
              "pgbench_failed_txns": run.failed, "pgbench_tps": run.tps, "idle_sessions_kept": idle_kept,
              "detect_and_promote_ms": detect_promote_ms}),
    )
}
