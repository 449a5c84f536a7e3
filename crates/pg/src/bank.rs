//! Bank-transfer workload and kill trials: the correctness check of commit protection.
//!
//! Each worker session runs `BEGIN; debit; credit; INSERT transfers(sid, seq); COMMIT` through
//! the proxy and logs what the proxy told it about every transaction. After each failover
//! the workers pause and the database is compared with the logs:
//! - the total balance is conserved;
//! - every acknowledged COMMIT is visible (no acked commit lost);
//! - no transaction whose COMMIT was never sent is visible;
//! - every COMMIT reported as rolled back is absent (reported outcome matches the database).
//!
//! The workers read COMMIT's answer as most drivers do (psycopg, many ORMs): success unless it
//! is an error, whatever the command tag. So a COMMIT that PostgreSQL answers with the tag
//! `ROLLBACK` and no error — what it does inside a block failover aborted, if the proxy let
//! the COMMIT through — counts as acknowledged, and the "no acked commit lost" check catches
//! it; such answers are also counted apart (`Workload::commit_tags_not_commit`).

use crate::client::{Client, ClientError, Dial};
use crate::cluster::Cluster;
use crate::proxy::Proxy;
use crate::tls::TlsClient;
use serde::Serialize;
use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub const ACCOUNTS: i64 = 100;
pub const START_BALANCE: i64 = 1000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Failed before COMMIT was sent.
    NoCommit,
    Acked,
    /// COMMIT answered with an error saying it rolled back.
    ReportedAborted,
    /// COMMIT answered with "outcome unknown" or the connection was lost.
    Unknown,
}

#[derive(Default)]
struct Log {
    done: Vec<(u32, u32, Outcome)>,
}

struct Shared {
    log: Mutex<Log>,
    pause: AtomicBool,
    paused: AtomicU64,
    stop: AtomicBool,
    /// Transactions that began at or after this (ms since `t0`) count for `first_ack_ms`.
    mark_ms: AtomicU64,
    /// Earliest acknowledgement (ms since `t0`) of a transaction begun after `mark_ms`.
    first_ack_ms: AtomicU64,
    t0: Instant,
    reconnects: AtomicU64,
    commits: AtomicU64,
    /// COMMITs answered without an error but with another tag than `COMMIT`.
    odd_tags: AtomicU64,
}

/// Creates the schema (on the primary, through any connection).
pub fn setup(c: &mut Client) -> Result<(), ClientError> {
    c.query(
        "DROP TABLE IF EXISTS accounts, transfers; \
         CREATE TABLE accounts(id int PRIMARY KEY, bal bigint NOT NULL); \
         CREATE TABLE transfers(sid int, seq int, PRIMARY KEY (sid, seq));",
    )?;
    c.query(&format!(
        "INSERT INTO accounts SELECT g, {START_BALANCE} FROM generate_series(1, {ACCOUNTS}) g"
    ))?;
    Ok(())
}

pub struct Workload {
    sh: Arc<Shared>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

fn xorshift(s: &mut u64) -> u64 {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    *s
}

impl Workload {
    /// Workers through one address (the proxy), 10 s connect and I/O timeouts.
    pub fn start(addr: SocketAddr, user: &str, pw: &str, sessions: u32) -> Workload {
        Self::start_with(
            vec![addr],
            user,
            pw,
            sessions,
            Duration::from_secs(10),
            None,
        )
    }

    /// Workers that (re)connect to whichever of `targets` is a primary (what a libpq client
    /// with several hosts and `target_session_attrs=read-write` does: the Patroni peer has
    /// no proxy). `io_timeout` bounds every connect and read.
    pub fn start_with(
        targets: Vec<SocketAddr>,
        user: &str,
        pw: &str,
        sessions: u32,
        io_timeout: Duration,
        tls: Option<TlsClient>,
    ) -> Workload {
        let sh = Arc::new(Shared {
            log: Mutex::new(Log::default()),
            pause: AtomicBool::new(false),
            paused: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            mark_ms: AtomicU64::new(u64::MAX),
            first_ack_ms: AtomicU64::new(u64::MAX),
            t0: Instant::now(),
            reconnects: AtomicU64::new(0),
            commits: AtomicU64::new(0),
            odd_tags: AtomicU64::new(0),
        });
        let threads = (0..sessions)
            .map(|sid| {
                let sh = sh.clone();
                let (u, p) = (user.to_string(), pw.to_string());
                let t = targets.clone();
                let tls = tls.clone();
                std::thread::spawn(move || worker(sid, &t, &u, &p, io_timeout, tls.as_ref(), &sh))
            })
            .collect();
        Workload { sh, threads }
    }

    pub fn commits(&self) -> u64 {
        self.sh.commits.load(SeqCst)
    }
    pub fn reconnects(&self) -> u64 {
        self.sh.reconnects.load(SeqCst)
    }
    /// COMMITs answered without an error but with another tag (counted as acknowledged).
    pub fn commit_tags_not_commit(&self) -> u64 {
        self.sh.odd_tags.load(SeqCst)
    }

    /// Starts a failover measurement now (call right after the failure is injected).
    pub fn arm(&self) {
        self.sh.first_ack_ms.store(u64::MAX, SeqCst);
        self.sh
            .mark_ms
            .store(self.sh.t0.elapsed().as_millis() as u64, SeqCst);
    }

    /// Milliseconds from `origin` (when the failure injection began) to the first
    /// acknowledged commit of a transaction that began after `arm` (once the old primary was
    /// dead or cut): the failure-to-first-successful-transaction time (waits up to 30 s).
    pub fn first_ack_after_arm(&self, origin: Instant) -> Option<u64> {
        let origin_ms = origin.saturating_duration_since(self.sh.t0).as_millis() as u64;
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(30) {
            let a = self.sh.first_ack_ms.load(SeqCst);
            if a != u64::MAX {
                return Some(a.saturating_sub(origin_ms));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        None
    }

    /// Pauses all workers between transactions.
    fn pause(&self, n: usize) -> Result<(), String> {
        self.sh.pause.store(true, SeqCst);
        let t = Instant::now();
        while (self.sh.paused.load(SeqCst) as usize) < n {
            if t.elapsed() > Duration::from_secs(30) {
                return Err("workers did not pause".into());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(())
    }
    fn resume(&self) {
        self.sh.pause.store(false, SeqCst);
    }

    /// Pauses the workload, compares the database (via `c`) with the logs, resumes.
    pub fn check(&self, c: &mut Client) -> Result<CheckReport, String> {
        self.pause(self.threads.len())?;
        let r = self.check_paused(c);
        self.resume();
        r
    }

    fn check_paused(&self, c: &mut Client) -> Result<CheckReport, String> {
        let (rows, _) = c
            .query("SELECT (SELECT sum(bal) FROM accounts)::text, sid, seq FROM transfers UNION ALL SELECT (SELECT sum(bal) FROM accounts)::text, -1, -1")
            .map_err(|e| format!("check query: {e}"))?;
        let mut total = None;
        let mut seen = HashSet::new();
        for r in rows {
            let f = |i: usize| r.get(i).cloned().flatten().unwrap_or_default();
            total = f(0).parse::<i64>().ok();
            let (sid, seq) = (
                f(1).parse::<i64>().unwrap_or(-1),
                f(2).parse::<i64>().unwrap_or(-1),
            );
            if sid >= 0 {
                seen.insert((sid as u32, seq as u32));
            }
        }
        let log = self.sh.log.lock().map_err(|_| "log poisoned")?;
        let mut rep = CheckReport {
            total_ok: total == Some(ACCOUNTS * START_BALANCE),
            ..Default::default()
        };
        for &(sid, seq, o) in &log.done {
            let vis = seen.contains(&(sid, seq));
            match o {
                Outcome::Acked => {
                    rep.acked += 1;
                    if !vis {
                        rep.acked_lost += 1;
                    }
                }
                Outcome::NoCommit => {
                    if vis {
                        rep.uncommitted_visible += 1;
                    }
                }
                Outcome::ReportedAborted => {
                    rep.reported_aborted += 1;
                    if vis {
                        rep.outcome_mismatch += 1;
                    }
                }
                Outcome::Unknown => {
                    rep.unknown += 1;
                    if vis {
                        rep.unknown_visible += 1;
                    }
                }
            }
        }
        let logged: HashSet<(u32, u32)> = log.done.iter().map(|&(a, b, _)| (a, b)).collect();
        rep.visible_not_logged = seen.iter().filter(|k| !logged.contains(k)).count() as u64;
        Ok(rep)
    }

    pub fn stop(mut self) {
        self.sh.stop.store(true, SeqCst);
        self.sh.pause.store(false, SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for Workload {
    fn drop(&mut self) {
        self.sh.stop.store(true, SeqCst);
        self.sh.pause.store(false, SeqCst);
    }
}

#[derive(Debug, Default, Clone, Serialize)]
pub struct CheckReport {
    pub total_ok: bool,
    pub acked: u64,
    pub acked_lost: u64,
    pub uncommitted_visible: u64,
    pub reported_aborted: u64,
    pub outcome_mismatch: u64,
    pub unknown: u64,
    pub unknown_visible: u64,
    pub visible_not_logged: u64,
}

impl CheckReport {
    pub fn ok(&self) -> bool {
        self.total_ok
            && self.acked_lost == 0
            && self.uncommitted_visible == 0
            && self.outcome_mismatch == 0
            && self.visible_not_logged == 0
    }
}

/// Connects to the first of `targets` that is a primary (no check with a single target).
fn connect_primary(
    targets: &[SocketAddr],
    user: &str,
    pw: &str,
    t: Duration,
    tls: Option<&TlsClient>,
) -> Option<Client> {
    for a in targets {
        let Ok(mut c) = Client::dial(&Dial {
            addr: *a,
            user,
            password: pw,
            database: "postgres",
            connect_timeout: t,
            timeout: t,
            tls,
        }) else {
            continue;
        };
        if targets.len() == 1
            || c.scalar("SELECT pg_is_in_recovery()")
                .ok()
                .flatten()
                .as_deref()
                == Some("f")
        {
            return Some(c);
        }
    }
    None
}

fn worker(
    sid: u32,
    targets: &[SocketAddr],
    user: &str,
    pw: &str,
    io_timeout: Duration,
    tls: Option<&TlsClient>,
    sh: &Shared,
) {
    let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ ((sid as u64 + 1) << 32);
    let mut seq = 0u32;
    let mut conn: Option<Client> = None;
    while !sh.stop.load(SeqCst) {
        if sh.pause.load(SeqCst) {
            sh.paused.fetch_add(1, SeqCst);
            while sh.pause.load(SeqCst) && !sh.stop.load(SeqCst) {
                std::thread::sleep(Duration::from_millis(2));
            }
            sh.paused.fetch_sub(1, SeqCst);
            continue;
        }
        let c = match conn.as_mut() {
            Some(c) => c,
            None => match connect_primary(targets, user, pw, io_timeout, tls) {
                Some(c) => conn.insert(c),
                None => {
                    std::thread::sleep(Duration::from_millis(50));
                    continue;
                }
            },
        };
        seq += 1;
        let started_ms = sh.t0.elapsed().as_millis() as u64;
        let a = xorshift(&mut rng) % ACCOUNTS as u64 + 1;
        let b = (a + xorshift(&mut rng) % (ACCOUNTS as u64 - 1)) % ACCOUNTS as u64 + 1;
        let amt = xorshift(&mut rng) % 50 + 1;
        let body = [
            "BEGIN".to_string(),
            format!("UPDATE accounts SET bal = bal - {amt} WHERE id = {a}"),
            format!("UPDATE accounts SET bal = bal + {amt} WHERE id = {b}"),
            format!("INSERT INTO transfers VALUES ({sid}, {seq})"),
        ];
        let mut failed = false;
        let mut drop_conn = false;
        for q in &body {
            if let Err(e) = c.query(q) {
                if std::env::var_os("PLIANT_PG_DEBUG").is_some()
                    && !matches!(e, ClientError::Server { .. })
                {
                    eprintln!("worker {sid}: {q}: {e}");
                }
                failed = true;
                if matches!(e, ClientError::Server { .. }) {
                    let _ = c.query("ROLLBACK");
                } else {
                    drop_conn = true;
                }
                break;
            }
        }
        let outcome = if failed {
            Outcome::NoCommit
        } else {
            let r = c.query("COMMIT");
            if let (Err(e), true) = (&r, std::env::var_os("PLIANT_PG_DEBUG").is_some()) {
                eprintln!("worker {sid}: COMMIT: {e}");
            }
            match r {
                Ok((_, tag)) => {
                    // Tag-blind, like the drivers above.
                    if tag != "COMMIT" {
                        sh.odd_tags.fetch_add(1, SeqCst);
                    }
                    Outcome::Acked
                }
                Err(ClientError::Server { code, .. }) if code == "40001" => {
                    Outcome::ReportedAborted
                }
                Err(ClientError::Server { .. }) => Outcome::Unknown,
                Err(_) => {
                    drop_conn = true;
                    Outcome::Unknown
                }
            }
        };
        if drop_conn {
            conn = None;
            sh.reconnects.fetch_add(1, SeqCst);
        }
        if outcome == Outcome::Acked {
            sh.commits.fetch_add(1, SeqCst);
            if started_ms >= sh.mark_ms.load(SeqCst) {
                sh.first_ack_ms
                    .fetch_min(sh.t0.elapsed().as_millis() as u64, SeqCst);
            }
        }
        if let Ok(mut l) = sh.log.lock() {
            l.done.push((sid, seq, outcome));
        }
    }
}

/// Result of a series of kill trials.
#[derive(Debug, Default, Clone, Serialize)]
pub struct TrialsReport {
    pub trials: u32,
    pub failovers: u64,
    pub failover_ms: Vec<u64>,
    pub reprotect_ms: Vec<u64>,
    pub acked_commits: u64,
    pub acked_commits_lost: u64,
    pub uncommitted_visible: u64,
    pub outcome_mismatch: u64,
    pub outcomes_unknown: u64,
    pub reported_aborted: u64,
    /// COMMITs answered without an error but not with the tag `COMMIT` (each one is an
    /// acknowledgement to a tag-blind driver; a failure of the run).
    pub commit_tags_not_commit: u64,
    pub total_conserved: bool,
    pub sessions_total: u64,
    pub sessions_dropped: u64,
    pub failures: Vec<String>,
}

/// Runs `trials` failovers under the bank workload: each trial waits for protection, lets
/// the workload run a random while, kills the primary (every third trial: only cuts its
/// link, so the proxy must detect by timeout and fence it), and checks the invariants.
pub fn run_trials(
    cluster: &Cluster,
    proxy: &Proxy,
    sessions: u32,
    trials: u32,
    progress: &mut dyn FnMut(&str),
) -> Result<TrialsReport, String> {
    let user = cluster.cfg.user.clone();
    let pw = cluster.cfg.password.clone();
    // Over TLS when the cluster's servers speak it (the proxy then requires it of clients).
    let tls = cluster.tls_client();
    let mut c = Client::dial(&Dial {
        addr: proxy.addr,
        user: &user,
        password: &pw,
        database: "postgres",
        connect_timeout: Duration::from_secs(10),
        timeout: Duration::from_secs(10),
        tls,
    })
    .map_err(|e| e.to_string())?;
    setup(&mut c).map_err(|e| format!("bank setup: {e}"))?;
    let wl = Workload::start_with(
        vec![proxy.addr],
        &user,
        &pw,
        sessions,
        Duration::from_secs(10),
        tls.cloned(),
    );
    let mut rep = TrialsReport {
        trials,
        total_conserved: true,
        sessions_total: sessions as u64,
        ..Default::default()
    };
    let mut rng = 0x1234_5678_9abc_def1u64 ^ std::process::id() as u64;
    for t in 0..trials {
        let tp = Instant::now();
        while !proxy.shared.protected.load(SeqCst) {
            if tp.elapsed() > Duration::from_secs(90) {
                return Err(format!(
                    "trial {t}: not re-protected after 90 s: {}",
                    proxy.stats_json()
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let reprot = tp.elapsed().as_millis() as u64;
        if t > 0 {
            rep.reprotect_ms.push(reprot);
        }
        std::thread::sleep(Duration::from_millis(200 + xorshift(&mut rng) % 600));
        let before = proxy.shared.stats.failovers.load(SeqCst);
        let primary = proxy.shared.primary.load(SeqCst);
        let cut_only = t % 3 == 2;
        let origin = Instant::now();
        cluster.inject_failure(primary, !cut_only, true)?;
        wl.arm();
        if std::env::var_os("PLIANT_PG_DEBUG").is_some() {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default();
            eprintln!(
                "{}.{:03} trial: failure injected",
                t.as_secs() % 1000,
                t.subsec_millis()
            );
        }
        let fo = wl.first_ack_after_arm(origin);
        let waited = Instant::now();
        while proxy.shared.stats.failovers.load(SeqCst) == before {
            if waited.elapsed() > Duration::from_secs(30) {
                return Err(format!("trial {t}: no failover: {}", proxy.stats_json()));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let Some(ms) = fo else {
            return Err(format!(
                "trial {t}: no commit acknowledged after the kill: {}",
                proxy.stats_json()
            ));
        };
        rep.failover_ms.push(ms);
        // Check on the new primary directly (not through the proxy, to not depend on it).
        let np = proxy.shared.primary.load(SeqCst);
        let mut dc = cluster.client(np, Duration::from_secs(10))?;
        let r = wl.check(&mut dc)?;
        progress(&format!(
            "trial {}/{} ({}): failover {} ms, acked {} lost {} mismatch {} unknown {} total_ok {}",
            t + 1,
            trials,
            if cut_only { "link cut" } else { "SIGKILL" },
            ms,
            r.acked,
            r.acked_lost,
            r.outcome_mismatch,
            r.unknown,
            r.total_ok
        ));
        if !r.ok() {
            rep.failures.push(format!("trial {t}: {r:?}"));
        }
        let odd = wl.commit_tags_not_commit();
        if odd > rep.commit_tags_not_commit {
            rep.failures.push(format!(
                "trial {t}: {} COMMIT(s) answered without an error but not with the tag COMMIT",
                odd - rep.commit_tags_not_commit
            ));
            rep.commit_tags_not_commit = odd;
        }
        rep.acked_commits = r.acked;
        rep.acked_commits_lost = rep.acked_commits_lost.max(r.acked_lost);
        rep.uncommitted_visible = rep.uncommitted_visible.max(r.uncommitted_visible);
        rep.outcome_mismatch = rep.outcome_mismatch.max(r.outcome_mismatch);
        rep.outcomes_unknown = r.unknown;
        rep.reported_aborted = r.reported_aborted;
        rep.total_conserved &= r.total_ok;
    }
    rep.failovers = proxy.shared.stats.failovers.load(SeqCst);
    rep.sessions_dropped = wl.reconnects();
    wl.stop();
    Ok(rep)
}
