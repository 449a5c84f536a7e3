//! The peer of `pliant bench pg`: Patroni (Debian package) with a one-member etcd, in
//! namespaces this module creates (two PostgreSQL nodes and one etcd namespace on a bridge),
//! synchronous mode on, `ttl`/`loop_wait`/`retry_timeout` as configured (5/1/2, the settings of
//! the published reference figures).
//!
//! Patroni has no proxy: clients (the bank workload) connect to whichever node is a primary
//! and reconnect after a failure, as a libpq client with several hosts and
//! `target_session_attrs=read-write` would. A trial SIGKILLs the leader's Patroni and
//! PostgreSQL processes by PID and cuts its link, then measures the time to the first
//! acknowledged transaction begun after the kill, counts sessions that survived (Patroni
//! keeps none: every connection to the dead leader is gone) and checks that no acknowledged
//! commit is missing on the new leader. The old node then returns (link up, Patroni
//! restarted: it rewinds and follows) before the next trial.

use crate::bank;
use crate::client::Client;
use crate::cluster::{Cluster, ClusterConfig, PG_PORT};
use serde_json::{json, Value};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::process::{Child, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

const PG_BIN: &str = "/usr/lib/postgresql/15/bin";
const SUPERUSER: &str = "postgres";
const PASSWORD: &str = "patroni-pw";

#[derive(Clone, Debug)]
pub struct PatroniOpts {
    pub clients: u32,
    pub trials: u32,
    pub ttl: u32,
    pub loop_wait: u32,
    pub retry_timeout: u32,
    pub fsync: bool,
    /// Connect and read timeout of the workload's clients: how fast a client notices a dead
    /// server (Patroni gives clients nothing better than their own timeouts).
    pub client_timeout: Duration,
}

impl Default for PatroniOpts {
    fn default() -> Self {
        PatroniOpts {
            clients: 8,
            trials: 3,
            ttl: 5,
            loop_wait: 1,
            retry_timeout: 2,
            fsync: true,
            client_timeout: Duration::from_secs(1),
        }
    }
}

/// True if the Patroni and etcd binaries are installed.
pub fn available() -> bool {
    ["/usr/bin/patroni", "/usr/bin/etcd"]
        .iter()
        .all(|p| std::path::Path::new(p).exists())
}

fn progress(s: &str) {
    eprintln!("bench pg (patroni): {s}");
}

struct Lab {
    cl: Arc<Cluster>,
    etcd: Option<Child>,
    patroni: [Option<Child>; 2],
    etcd_addr: Ipv4Addr,
    scope: String,
}

impl Drop for Lab {
    fn drop(&mut self) {
        // Cluster teardown SIGKILLs every process of the namespaces (Patroni, PostgreSQL,
        // etcd) by PID; then the children we spawned are reaped.
        self.cl.teardown();
        for c in self.patroni.iter_mut().flatten() {
            let _ = c.wait();
        }
        if let Some(c) = self.etcd.as_mut() {
            let _ = c.wait();
        }
    }
}

fn nix_id(flag: &str) -> Result<u32, String> {
    let out = std::process::Command::new("id")
        .args([flag, "postgres"])
        .output()
        .map_err(|e| format!("id: {e}"))?;
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .map_err(|_| "no postgres user".to_string())
}

impl Lab {
    fn node_addr(&self, i: usize) -> SocketAddr {
        self.cl.nodes[i].addr()
    }

    fn config(&self, i: usize, o: &PatroniOpts) -> String {
        let nd = &self.cl.nodes[i];
        let net = format!("10.213.{}.0/24", self.cl.host_ip.octets()[2]);
        let (ip, sock) = (nd.ip, nd.sock.display());
        let lines = [
            format!("scope: {}", self.scope),
            format!("name: {}", nd.name),
            "log:".into(),
            "  level: INFO".into(),
            "restapi:".into(),
            format!("  listen: {ip}:8008"),
            format!("  connect_address: {ip}:8008"),
            "etcd3:".into(),
            format!("  hosts: {}:2379", self.etcd_addr),
            "bootstrap:".into(),
            "  dcs:".into(),
            format!("    ttl: {}", o.ttl),
            format!("    loop_wait: {}", o.loop_wait),
            format!("    retry_timeout: {}", o.retry_timeout),
            "    maximum_lag_on_failover: 1048576".into(),
            "    synchronous_mode: true".into(),
            "    postgresql:".into(),
            "      use_pg_rewind: true".into(),
            "      use_slots: true".into(),
            "      parameters:".into(),
            "        wal_level: replica".into(),
            "        hot_standby: 'on'".into(),
            "        max_wal_senders: 6".into(),
            "        max_replication_slots: 6".into(),
            "        wal_log_hints: 'on'".into(),
            "        wal_keep_size: 64MB".into(),
            format!("        fsync: '{}'", if o.fsync { "on" } else { "off" }),
            "        shared_buffers: 128MB".into(),
            "        max_connections: 120".into(),
            "        password_encryption: md5".into(),
            "  initdb:".into(),
            "  - encoding: UTF8".into(),
            "  - locale: C".into(),
            "postgresql:".into(),
            format!("  listen: {ip}:{PG_PORT}"),
            format!("  connect_address: {ip}:{PG_PORT}"),
            format!("  data_dir: {}", nd.data.display()),
            format!("  bin_dir: {PG_BIN}"),
            // Patroni writes it: somewhere the postgres user owns.
            format!("  pgpass: {sock}/pgpass"),
            "  remove_data_directory_on_rewind_failure: true".into(),
            "  remove_data_directory_on_diverged_timelines: true".into(),
            "  pg_hba:".into(),
            "  - local all all trust".into(),
            "  - host all all 127.0.0.1/32 md5".into(),
            format!("  - host all all {net} md5"),
            format!("  - host replication all {net} md5"),
            "  authentication:".into(),
            "    superuser:".into(),
            format!("      username: {SUPERUSER}"),
            format!("      password: {PASSWORD}"),
            "    replication:".into(),
            "      username: replicator".into(),
            format!("      password: {PASSWORD}"),
            "  parameters:".into(),
            format!("    unix_socket_directories: '{sock}'"),
        ];
        let mut s = lines.join("\n");
        s.push('\n');
        s
    }

    fn start_patroni(&mut self, i: usize, o: &PatroniOpts) -> Result<(), String> {
        let conf = self.cl.dir.join(format!("patroni{}.yml", i + 1));
        // It holds the superuser and replication passwords: 0600, owned by postgres.
        crate::secrets::write_private_owned(
            &conf,
            self.config(i, o).as_bytes(),
            Some((nix_id("-u")?, nix_id("-g")?)),
        )?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.cl.dir.join(format!("patroni{}.log", i + 1)))
            .map_err(|e| e.to_string())?;
        let log2 = log.try_clone().map_err(|e| e.to_string())?;
        let child = self
            .cl
            .command_in(&self.cl.nodes[i].ns, "/usr/bin/patroni", true)
            .arg(&conf)
            .env("HOME", &self.cl.dir)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2)
            .spawn()
            .map_err(|e| format!("patroni: {e}"))?;
        if let Some(mut old) = self.patroni[i].replace(child) {
            let _ = old.kill();
            let _ = old.wait();
        }
        Ok(())
    }

    /// Role of node `i`: Some(true) = primary, Some(false) = standby, None = not answering.
    fn is_primary(&self, i: usize) -> Option<bool> {
        let mut c = Client::connect(
            self.node_addr(i),
            SUPERUSER,
            PASSWORD,
            "postgres",
            Duration::from_millis(500),
        )
        .ok()?;
        c.scalar("SELECT pg_is_in_recovery()")
            .ok()
            .flatten()
            .map(|r| r == "f")
    }

    /// True if node `i`'s Patroni REST API answers `GET path` with 200.
    fn rest_ok(&self, i: usize, path: &str) -> bool {
        use std::io::{Read, Write};
        let a = SocketAddr::V4(SocketAddrV4::new(self.cl.nodes[i].ip, 8008));
        let Ok(mut s) = std::net::TcpStream::connect_timeout(&a, Duration::from_millis(500)) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        if s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {a}\r\n\r\n").as_bytes())
            .is_err()
        {
            return false;
        }
        let mut head = [0u8; 12];
        s.read_exact(&mut head).is_ok() && head.starts_with(b"HTTP/1.") && &head[9..12] == b"200"
    }

    /// Waits until one node is primary with the other as its synchronous standby, in
    /// PostgreSQL's view and in Patroni's.
    fn wait_healthy(&self, timeout: Duration) -> Result<usize, String> {
        let t0 = Instant::now();
        while t0.elapsed() < timeout {
            for i in 0..2 {
                if self.is_primary(i) != Some(true) {
                    continue;
                }
                let sync = Client::connect(
                    self.node_addr(i),
                    SUPERUSER,
                    PASSWORD,
                    "postgres",
                    Duration::from_secs(1),
                )
                .ok()
                .and_then(|mut c| {
                    c.scalar(
                        "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync' AND state = 'streaming'",
                    )
                    .ok()
                    .flatten()
                });
                // Patroni promotes only the member its DCS `/sync` key names, which it
                // updates a loop after PostgreSQL reports the standby synchronous: until then
                // a leader kill leaves the cluster without a primary (by design).
                if sync.as_deref() == Some("1") && self.rest_ok(1 - i, "/sync") {
                    return Ok(i);
                }
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        Err(format!(
            "Patroni cluster not healthy after {timeout:?} (logs in {})",
            self.cl.dir.display()
        ))
    }
}

/// Sets up etcd + two Patroni nodes, runs `o.trials` leader kills under the bank workload.
pub fn run(o: &PatroniOpts) -> Result<Value, String> {
    let cl = Arc::new(Cluster::create(ClusterConfig {
        fsync: o.fsync,
        ..Default::default()
    })?);
    let (etcd_ns, etcd_addr) = cl.add_aux_namespace(1, 13)?;
    let mut lab = Lab {
        scope: format!("pliant-{}", cl.tag),
        cl: cl.clone(),
        etcd: None,
        patroni: [None, None],
        etcd_addr,
    };
    let etcd_dir = cl.dir.join("etcd");
    std::fs::create_dir_all(&etcd_dir).map_err(|e| e.to_string())?;
    let log = std::fs::File::create(cl.dir.join("etcd.log")).map_err(|e| e.to_string())?;
    let log2 = log.try_clone().map_err(|e| e.to_string())?;
    let url = |p: u16| format!("http://{etcd_addr}:{p}");
    lab.etcd = Some(
        cl.command_in(&etcd_ns, "/usr/bin/etcd", false)
            .args(["--name", "e1", "--data-dir"])
            .arg(&etcd_dir)
            .args(["--listen-client-urls", &url(2379)])
            .args(["--advertise-client-urls", &url(2379)])
            .args(["--listen-peer-urls", &url(2380)])
            .args(["--initial-advertise-peer-urls", &url(2380)])
            .args(["--initial-cluster", &format!("e1={}", url(2380))])
            .args(["--initial-cluster-state", "new", "--log-level", "warn"])
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2)
            .spawn()
            .map_err(|e| format!("etcd: {e}"))?,
    );
    let t0 = Instant::now();
    while std::net::TcpStream::connect_timeout(
        &SocketAddr::V4(SocketAddrV4::new(etcd_addr, 2379)),
        Duration::from_millis(200),
    )
    .is_err()
    {
        if t0.elapsed() > Duration::from_secs(20) {
            return Err("etcd did not start (etcd.log)".into());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    for i in 0..2 {
        cl.prep_dirs(i)?;
        // Patroni initialises (node 0 wins the race more often, either is fine).
        lab.start_patroni(i, o)?;
        if i == 0 {
            std::thread::sleep(Duration::from_secs(2));
        }
    }
    let leader = lab.wait_healthy(Duration::from_secs(120))?;
    progress(&format!(
        "up in {:?}, leader {}",
        t0.elapsed(),
        cl.nodes[leader].name
    ));
    let mut c = Client::connect(
        lab.node_addr(leader),
        SUPERUSER,
        PASSWORD,
        "postgres",
        Duration::from_secs(10),
    )
    .map_err(|e| e.to_string())?;
    bank::setup(&mut c).map_err(|e| format!("bank setup: {e}"))?;
    drop(c);
    let wl = bank::Workload::start_with(
        vec![lab.node_addr(0), lab.node_addr(1)],
        SUPERUSER,
        PASSWORD,
        o.clients,
        o.client_timeout,
        None,
    );
    let mut failover_ms = Vec::new();
    let mut dropped = 0u64;
    let mut lost = 0u64;
    let mut acked = 0u64;
    let mut unknown = 0u64;
    let mut unknown_committed = 0u64;
    let mut total_ok = true;
    let mut failures = Vec::new();
    for t in 0..o.trials {
        let leader = lab.wait_healthy(Duration::from_secs(120))?;
        std::thread::sleep(Duration::from_millis(1500));
        let r0 = wl.reconnects();
        let origin = Instant::now();
        // Patroni and PostgreSQL of the leader by PID (every process of its namespace),
        // then its link.
        cl.inject_failure(leader, true, true)?;
        wl.arm();
        let ms = wl.first_ack_after_arm(origin);
        let new = 1 - leader;
        let mut dc = Client::connect(
            lab.node_addr(new),
            SUPERUSER,
            PASSWORD,
            "postgres",
            Duration::from_secs(10),
        )
        .map_err(|e| format!("new leader: {e}"))?;
        let r = wl.check(&mut dc)?;
        let d = (wl.reconnects() - r0).min(o.clients as u64);
        progress(&format!(
            "trial {}/{}: failover {} ms, sessions dropped {d}/{}, acked {} lost {} unknown {}",
            t + 1,
            o.trials,
            ms.map_or("-".into(), |m| m.to_string()),
            o.clients,
            r.acked,
            r.acked_lost,
            r.unknown
        ));
        match ms {
            Some(m) => failover_ms.push(m),
            None => failures.push(format!("trial {t}: no commit within 30 s of the kill")),
        }
        if !r.ok() {
            failures.push(format!("trial {t}: {r:?}"));
        }
        dropped += d;
        lost = lost.max(r.acked_lost);
        acked = r.acked;
        unknown = r.unknown;
        unknown_committed = r.unknown_visible;
        total_ok &= r.total_ok;
        // The old leader returns: link up, Patroni restarted (rewinds and follows).
        cl.kill(leader);
        if let Some(mut ch) = lab.patroni[leader].take() {
            let _ = ch.wait();
        }
        cl.set_link(leader, true)?;
        lab.start_patroni(leader, o)?;
    }
    wl.stop();
    let mut sorted = failover_ms.clone();
    sorted.sort_unstable();
    let total = o.clients as u64 * o.trials as u64;
    Ok(json!({
        "version": patroni_version(),
        "ttl": o.ttl, "loop_wait": o.loop_wait, "retry_timeout": o.retry_timeout,
        "synchronous_mode": true,
        "client_timeout_ms": o.client_timeout.as_millis() as u64,
        "failover_ms": sorted.get(sorted.len() / 2).copied(),
        "failover_ms_all": failover_ms,
        "failover_ms_max": sorted.last().copied(),
        "sessions_kept": total - dropped.min(total),
        "sessions_total": total,
        "acked_commits_lost": lost,
        "acked_commits": acked,
        "outcomes_unknown": unknown,
        // COMMITs whose client saw an error or a lost connection but that did commit.
        "outcomes_unknown_committed": unknown_committed,
        "total_conserved": total_ok,
        "trials": o.trials,
        "failures": failures,
    }))
}

fn patroni_version() -> String {
    std::process::Command::new("/usr/bin/patroni")
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}
