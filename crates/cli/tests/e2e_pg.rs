//! End-to-end tests of `pliant pg`: a real PostgreSQL 15 primary and synchronous
//! standby in namespaces, the pliant proxy in front, failures injected for real.
//!
//! Run serially (`--test-threads=1`; a lock enforces it too). Needs root, PostgreSQL 15 and psql
//! (`pliant_testkit`: a test fails without them unless PLIANT_ALLOW_SKIP=1).

use pliant_pg::bank;
use pliant_pg::bench::{cluster_tls, proxy_config, require_tls};
use pliant_pg::client::{Client, Dial};
use pliant_pg::cluster::{Cluster, ClusterConfig};
use pliant_pg::proto;
use pliant_pg::proxy::{AuthMethod, ClusterOps, Proxy, ProxyConfig, UpstreamTls};
use pliant_pg::tls::{make_demo_pki, DemoPki};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::Ordering::SeqCst;
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

static SERIAL: Mutex<()> = Mutex::new(());

/// `false`: the test was skipped under PLIANT_ALLOW_SKIP=1 and must return.
fn usable() -> bool {
    pliant_testkit::require_root()
        && pliant_testkit::require_tool("/usr/lib/postgresql/15/bin/postgres", "postgresql-15")
        && pliant_testkit::require_tool("psql", "postgresql-client-15")
}

/// Cluster + proxy, torn down on drop (also when an assertion fails).
struct Lab {
    cl: Arc<Cluster>,
    proxy: Option<Proxy>,
}

impl Lab {
    fn up() -> Lab {
        Lab::up_with(|_| {})
    }
    /// Like `up`, with the proxy configuration adjusted by `f`.
    fn up_with(f: impl FnOnce(&mut ProxyConfig)) -> Lab {
        Lab::up_cfg(ClusterConfig::default(), f)
    }
    /// Like `up_with`, with the servers' configuration given.
    fn up_cfg(cc: ClusterConfig, f: impl FnOnce(&mut ProxyConfig)) -> Lab {
        Lab::start(Cluster::create(cc).expect("create namespaces"), f)
    }
    /// TLS everywhere, as `pliant pg up --tls`: servers with ssl = on and hostssl-only
    /// access, the proxy requiring TLS of its clients and verifying the servers.
    fn up_tls() -> (Lab, DemoPki) {
        Lab::up_tls_with(|_| {})
    }
    /// Like `up_tls`, with the proxy configuration adjusted by `f`.
    fn up_tls_with(f: impl FnOnce(&mut ProxyConfig)) -> (Lab, DemoPki) {
        let mut cl = Cluster::create(ClusterConfig::default()).expect("create namespaces");
        let dir = cl.dir.join("pki");
        let pki = cluster_tls(&mut cl, &dir).expect("server TLS");
        let lab = Lab::start(cl, |pc| {
            require_tls(pc, &pki);
            f(pc);
        });
        (lab, pki)
    }
    fn start(cl: Cluster, f: impl FnOnce(&mut ProxyConfig)) -> Lab {
        let cl = Arc::new(cl);
        let mut lab = Lab {
            cl: cl.clone(),
            proxy: None,
        };
        cl.init_primary().expect("primary");
        cl.add_standby(1, 0).expect("standby");
        cl.protect(0, 1).expect("sync standby");
        let ops: Arc<dyn ClusterOps> = cl.clone();
        let mut pc = proxy_config(&cl, 0);
        f(&mut pc);
        lab.proxy = Some(Proxy::start(pc, true, Some(ops)).expect("proxy"));
        lab
    }
    fn proxy(&self) -> &Proxy {
        self.proxy.as_ref().expect("proxy started")
    }
    fn client(&self) -> Client {
        Client::connect(
            self.proxy().addr,
            &self.cl.cfg.user,
            &self.cl.cfg.password,
            "postgres",
            Duration::from_secs(10),
        )
        .expect("connect through proxy")
    }
    fn wait_protected(&self) {
        let t = Instant::now();
        while !self.proxy().shared.protected.load(SeqCst) {
            assert!(
                t.elapsed() < Duration::from_secs(90),
                "not re-protected: {}",
                self.proxy().stats_json()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    /// SIGKILL the primary and cut its link; returns once the proxy has failed over.
    fn kill_primary(&self) {
        let p = self.proxy();
        let before = p.shared.stats.failovers.load(SeqCst);
        let i = p.shared.primary.load(SeqCst);
        self.cl
            .inject_failure(i, true, true)
            .expect("inject failure");
        let t = Instant::now();
        while p.shared.stats.failovers.load(SeqCst) == before {
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "no failover: {}",
                p.stats_json()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        if let Some(p) = self.proxy.take() {
            p.stop();
        }
        self.cl.teardown();
    }
}

#[test]
fn pg_kill_trials_lose_no_acknowledged_commit() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !usable() {
        return;
    }
    let lab = Lab::up();
    let t0 = Instant::now();
    let rep = bank::run_trials(&lab.cl, lab.proxy(), 8, 20, &mut |s| eprintln!("{s}"))
        .expect("trials ran");
    eprintln!("{}", serde_json::to_string(&rep).unwrap_or_default());
    eprintln!("proxy: {}", lab.proxy().stats_json());
    eprintln!("20 trials in {:?}", t0.elapsed());
    assert_eq!(rep.failovers, 20, "every trial failed over");
    assert!(
        rep.failures.is_empty(),
        "invariant violations: {:?}",
        rep.failures
    );
    assert_eq!(rep.acked_commits_lost, 0);
    assert_eq!(rep.uncommitted_visible, 0);
    assert_eq!(rep.outcome_mismatch, 0);
    assert!(rep.total_conserved);
    assert!(
        rep.acked_commits > 100,
        "the workload made progress: {}",
        rep.acked_commits
    );
    assert_eq!(
        rep.reprotect_ms.len(),
        19,
        "each later trial ran after re-protection"
    );
    // Sessions survive: no bank session had to reconnect.
    assert_eq!(rep.sessions_dropped, 0, "bank sessions dropped");
    let st = &lab.proxy().shared.stats;
    assert_eq!(st.sessions_dropped_other.load(SeqCst), 0);
}

/// A line-oriented psql coprocess.
struct Psql {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Psql {
    fn start(lab: &Lab) -> Psql {
        Psql::start_with(lab, "")
    }
    /// With more libpq connection parameters (`sslmode=...`).
    fn start_with(lab: &Lab, conninfo: &str) -> Psql {
        let a = lab.proxy().addr;
        let mut child = Command::new("psql")
            .env("PGPASSWORD", &lab.cl.cfg.password)
            .args(["-X", "-q", "-A", "-t"])
            .arg(format!(
                "host={} port={} user={} dbname=postgres {conninfo}",
                a.ip(),
                a.port(),
                lab.cl.cfg.user
            ))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("psql");
        let (tx, rx) = mpsc::channel();
        let out = child.stdout.take().expect("stdout");
        let err = child.stderr.take().expect("stderr");
        let tx2 = tx.clone();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(l);
            }
        });
        std::thread::spawn(move || {
            for l in BufReader::new(err).lines().map_while(Result::ok) {
                let _ = tx2.send(format!("stderr: {l}"));
            }
        });
        Psql { child, lines: rx }
    }
    fn ask(&mut self, sql: &str) -> String {
        let stdin = self.child.stdin.as_mut().expect("stdin");
        let _ = writeln!(stdin, "{sql}");
        let _ = stdin.flush();
        self.lines
            .recv_timeout(Duration::from_secs(20))
            .unwrap_or_else(|_| "<no answer>".into())
    }
}

impl Drop for Psql {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A primary that answers nothing for a while (every process SIGSTOPped: its kernel still
/// completes TCP handshakes, PostgreSQL is silent, as when pgbench saturates the CPUs) is not
/// failed over if it answers again within `probe_dead_after_ms`, and the session on it goes
/// on; one that stays silent longer is failed over after that window; a SIGKILLed one is
/// still failed over without waiting for it.
#[test]
fn pg_busy_primary_is_not_failed_over_but_a_hung_or_killed_one_is() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !usable() {
        return;
    }
    let lab = Lab::up_with(|pc| pc.probe_dead_after_ms = 2_000);
    let (to_ms, dead_ms) = {
        let c = &lab.proxy().shared.cfg;
        (c.probe_timeout_ms, c.probe_dead_after_ms)
    };
    let failovers = || lab.proxy().shared.stats.failovers.load(SeqCst);
    // Time from `t` until the failover after the `before`-th (`what` names the case).
    let failed_over = |before: u64, t: Instant, what: &str| {
        while failovers() == before {
            assert!(
                t.elapsed() < Duration::from_millis(dead_ms * 5),
                "{what} not failed over: {}",
                lab.proxy().stats_json()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        t.elapsed()
    };
    let mut c = lab.client();
    c.query("CREATE TABLE busy (i int)").expect("create");
    let i = lab.proxy().shared.primary.load(SeqCst);
    // A backend the server ends on its own (pg_terminate_backend: FATAL 57P01) is not a
    // failover: the session gets the server's own error once a probe shows the primary is
    // up, and the primary stays.
    let mut v = lab.client();
    let pid = v
        .scalar("SELECT pg_backend_pid()")
        .expect("pid")
        .expect("a pid");
    let mut d = lab.cl.client(i, Duration::from_secs(10)).expect("direct");
    d.query(&format!("SELECT pg_terminate_backend({pid})"))
        .expect("terminate");
    let t = Instant::now();
    let e = v
        .query("SELECT 1")
        .expect_err("a terminated session")
        .to_string();
    assert!(e.contains("57P01") && e.contains("administrator"), "{e}");
    let terminated = t.elapsed();
    drop(v);
    assert_eq!(failovers(), 0, "{}", lab.proxy().stats_json());
    // Silent for half the window: several probe timeouts (the old policy failed over after
    // two), but not the window.
    let freeze = Duration::from_millis(dead_ms / 2);
    assert!(freeze > Duration::from_millis(to_ms * 3));
    lab.cl.pause(i, true);
    std::thread::sleep(freeze);
    lab.cl.pause(i, false);
    c.query("INSERT INTO busy VALUES (1)")
        .expect("the session survives a busy primary");
    // Give the controller time to see the answer before judging.
    std::thread::sleep(Duration::from_millis(to_ms * 2));
    assert_eq!(failovers(), 0, "{}", lab.proxy().stats_json());
    assert_eq!(lab.proxy().shared.primary.load(SeqCst), i);
    // Silent for good: a hung primary is failed over once the window has passed.
    let t = Instant::now();
    lab.cl.pause(i, true);
    let hung = failed_over(0, t, "hung primary");
    assert!(hung >= Duration::from_millis(dead_ms), "after {hung:?}");
    assert_eq!(
        c.scalar("SELECT count(*) FROM busy")
            .expect("moved session"),
        Some("1".into())
    );
    // Killed: failed over without waiting out the window.
    lab.wait_protected();
    let t = Instant::now();
    lab.kill_primary();
    let killed = t.elapsed();
    assert!(killed < Duration::from_millis(dead_ms), "after {killed:?}");
    // Every backend killed while the postmaster still holds the port (stopped): a fresh probe
    // login is accepted by the kernel and never answered, but the sessions saw their backends
    // vanish without a word — dead, failed over without waiting out the window.
    lab.wait_protected();
    let before = failovers();
    let i = lab.proxy().shared.primary.load(SeqCst);
    // The session must be on the new primary for its backend to vanish there: after the kill
    // it moves when the proxy gets to it, which a quiet client does not hurry (a run saw the
    // window's slow path, 2.06 s, with no session left to see its backend die).
    assert_eq!(
        c.scalar("SELECT count(*) FROM busy")
            .expect("session on the new primary"),
        Some("1".into())
    );
    let t = Instant::now();
    lab.cl.orphan_port(i).expect("orphan the port");
    let orphaned = failed_over(before, t, "orphaned port");
    assert!(
        orphaned < Duration::from_millis(dead_ms),
        "a primary whose backends all died was failed over only after {orphaned:?}, the \
         slow window"
    );
    assert_eq!(
        c.scalar("SELECT count(*) FROM busy")
            .expect("the session moved again"),
        Some("1".into())
    );
    // A fresh probe login caught between a kill and a link cut: every backend dies (the probe
    // sees EOF), the probe logs in again at once and the kernel of the still-listening
    // postmaster completes the handshake; then the link is cut, so that login is never
    // answered. No session is left to see a backend vanish: only the probe's retry decides,
    // and it must not wait out the window for that login (the CI run where this took 5.4 s
    // and closed every session).
    drop(c);
    lab.wait_protected();
    let before = failovers();
    let i = lab.proxy().shared.primary.load(SeqCst);
    let t = Instant::now();
    lab.cl.orphan_port(i).expect("orphan the port");
    let node = &lab.cl.nodes[i];
    let queued = || {
        let out = Command::new("ip")
            .args([
                "netns",
                "exec",
                &node.ns,
                "ss",
                "-Htn",
                "state",
                "established",
            ])
            .arg(format!("( sport = :5432 and dst {} )", lab.cl.host_ip))
            .output()
            .expect("ss");
        !String::from_utf8_lossy(&out.stdout).trim().is_empty()
    };
    // Every connection the killed processes held is closed: an established one from the
    // proxy's address is a login waiting in the stopped postmaster's accept queue.
    while !queued() {
        assert!(
            t.elapsed() < Duration::from_secs(3),
            "the probe did not log in again: {}",
            lab.proxy().stats_json()
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    lab.cl.set_link(i, false).expect("cut the link");
    let caught = failed_over(before, t, "a caught login");
    assert!(
        caught < Duration::from_millis(dead_ms),
        "a login caught between the kill and the cut held the verdict for {caught:?}, the \
         slow window"
    );
    eprintln!(
        "a terminated backend's error passed on after {terminated:?}; \
         hung primary failed over after {hung:?}, killed one after {killed:?}, one whose \
         backends died under a stopped postmaster after {orphaned:?}, one whose probe login \
         was caught between kill and cut after {caught:?}"
    );
}

/// A primary that keeps serving the proxy's sessions is not failed over however long the
/// probes go unanswered: its postmaster and the controller's probe backend are SIGSTOPped
/// (a fresh probe login is accepted by the kernel and then waits, the open probe gets no
/// answer) for twice `probe_dead_after_ms`, while a session runs queries on its backend.
#[test]
fn pg_primary_serving_sessions_is_not_failed_over_while_probes_are_late() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !usable() {
        return;
    }
    let lab = Lab::up_with(|pc| pc.probe_dead_after_ms = 1_500);
    let dead_ms = lab.proxy().shared.cfg.probe_dead_after_ms;
    let failovers = || lab.proxy().shared.stats.failovers.load(SeqCst);
    let i = lab.proxy().shared.primary.load(SeqCst);
    let mut c = lab.client();
    c.query("SET application_name = 'busy-session'")
        .expect("set");
    // The controller's probe backend (application_name 'pliant', not this lookup's own).
    let mut direct = lab.cl.client(i, Duration::from_secs(5)).expect("direct");
    let probe_pid: i32 = direct
        .scalar(
            "SELECT pid FROM pg_stat_activity WHERE application_name = 'pliant' \
             AND backend_type = 'client backend' AND pid <> pg_backend_pid()",
        )
        .expect("probe backend")
        .expect("one probe backend")
        .parse()
        .expect("pid");
    drop(direct);
    let pm =
        std::fs::read_to_string(lab.cl.nodes[i].data.join("postmaster.pid")).expect("pid file");
    let postmaster: i32 = pm
        .lines()
        .next()
        .expect("pid line")
        .trim()
        .parse()
        .expect("pid");
    let stop = |sig| {
        for pid in [postmaster, probe_pid] {
            // SAFETY: signals to processes of the cluster this test started.
            unsafe { libc::kill(pid, sig) };
        }
    };
    stop(libc::SIGSTOP);
    let t = Instant::now();
    let mut served = 0u64;
    while t.elapsed() < Duration::from_millis(dead_ms * 2) {
        let r = c.query("SELECT count(*) FROM pg_class");
        if r.is_err() {
            stop(libc::SIGCONT);
        }
        r.expect("the session is served while probes are late");
        served += 1;
    }
    stop(libc::SIGCONT);
    // The controller's view once the probes are answered again.
    std::thread::sleep(Duration::from_millis(
        lab.proxy().shared.cfg.probe_timeout_ms * 4,
    ));
    assert_eq!(failovers(), 0, "{}", lab.proxy().stats_json());
    assert_eq!(lab.proxy().shared.primary.load(SeqCst), i);
    c.query("SELECT 1").expect("still served");
    eprintln!(
        "{served} queries served while the probes were late for {:?}",
        t.elapsed()
    );
}

#[test]
fn pg_sessions_survive_failover_and_reprotection() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !usable() {
        return;
    }
    let lab = Lab::up();
    let a = lab.proxy().addr;
    let pw = lab.cl.cfg.password.clone();
    let user = lab.cl.cfg.user.clone();
    let init = Command::new("/usr/lib/postgresql/15/bin/pgbench")
        .env("PGPASSWORD", &pw)
        .args([
            "-h",
            &a.ip().to_string(),
            "-p",
            &a.port().to_string(),
            "-U",
            &user,
            "-i",
            "-q",
            "-s",
            "1",
            "postgres",
        ])
        .output()
        .expect("pgbench -i");
    assert!(
        init.status.success(),
        "pgbench -i: {}",
        String::from_utf8_lossy(&init.stderr)
    );
    // psql sessions with session state (SET) that must survive.
    let mut psqls: Vec<Psql> = (0..4).map(|_| Psql::start(&lab)).collect();
    for (i, p) in psqls.iter_mut().enumerate() {
        // (SET prints nothing under -q: ask it together with the SELECT.)
        let ans = p.ask(&format!(
            "SET application_name = 'psql{i}'; SELECT current_setting('application_name');"
        ));
        assert_eq!(ans, format!("psql{i}"));
    }
    // An unreplayable session (temporary table): must be closed with a clear error.
    let mut tmp = lab.client();
    tmp.query("CREATE TEMP TABLE t(a int)").expect("temp table");
    // pgbench with prepared statements (extended protocol, named statements replayed).
    let run_pgbench = |secs: u32| {
        let (a, pw, user) = (a, pw.clone(), user.clone());
        std::thread::spawn(move || {
            Command::new("/usr/lib/postgresql/15/bin/pgbench")
                .env("PGPASSWORD", &pw)
                .args([
                    "-h",
                    &a.ip().to_string(),
                    "-p",
                    &a.port().to_string(),
                    "-U",
                    &user,
                    "-n",
                ])
                // --max-tries 2: the failover aborts a transaction in flight inside a block
                // with 40001 (see crates/pg/README.md), which pgbench retries once instead of
                // counting it failed.
                .args([
                    "-c",
                    &PGBENCH_CLIENTS.to_string(),
                    "-j",
                    "2",
                    "-T",
                    &secs.to_string(),
                    "-M",
                    "prepared",
                    "--max-tries",
                    "2",
                    "postgres",
                ])
                .output()
                .expect("pgbench")
        })
    };
    for round in 0..2 {
        lab.wait_protected();
        let h = run_pgbench(6);
        std::thread::sleep(Duration::from_secs(2));
        lab.kill_primary();
        let out = h.join().expect("pgbench thread");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        eprintln!("round {round} pgbench:\n{stdout}\n{stderr}");
        // A client whose session died aborts, and pgbench then exits non-zero ("Run was
        // aborted"); a transaction that failed (an error other than the failover's 40001, or a
        // 40001 again on its retry) is counted in its report. Neither may happen across the
        // failover. Each client has at most one transaction in flight when the primary dies,
        // so at most one retry per client: more would be aborts the failover did not cause.
        assert!(
            out.status.success(),
            "round {round}: pgbench exited with {}: a client was dropped: {stderr}",
            out.status
        );
        assert!(
            !stderr.contains("aborted in command"),
            "a pgbench client was dropped: {stderr}"
        );
        assert!(
            stdout.contains(&format!("number of clients: {PGBENCH_CLIENTS}")),
            "pgbench ran: {stdout}"
        );
        assert_eq!(
            pgbench_count(&stdout, "number of failed transactions:"),
            0,
            "round {round}: transactions failed across the failover: {stdout}"
        );
        let retried = pgbench_count(&stdout, "number of transactions retried:");
        assert!(
            retried <= PGBENCH_CLIENTS,
            "round {round}: {retried} transactions retried, more than one per client: {stdout}"
        );
        assert!(
            pgbench_count(&stdout, "number of transactions actually processed:") > 0,
            "round {round}: no transaction processed: {stdout}"
        );
        for (i, p) in psqls.iter_mut().enumerate() {
            let ans = p.ask(
                "SELECT current_setting('application_name') || ':' || pg_is_in_recovery()::text;",
            );
            assert_eq!(
                ans,
                format!("psql{i}:false"),
                "psql session {i} after failover {round}"
            );
        }
        if round == 0 {
            match tmp.query("SELECT count(*) FROM t") {
                Err(e) => assert!(
                    e.to_string().contains("temporary table"),
                    "clear error: {e}"
                ),
                Ok(_) => panic!("a session with a temporary table cannot have been moved"),
            }
        }
    }
    let st = lab.proxy().stats_json();
    eprintln!("proxy: {st}");
    assert_eq!(st["sessions_dropped_unreplayable"], 1);
    assert_eq!(st["sessions_dropped_other"], 0);
    assert_eq!(st["failovers"], 2);
}

/// Clients of the pgbench run across each failover.
const PGBENCH_CLIENTS: u64 = 4;

/// The count after `label` in pgbench's report ("number of failed transactions: 0 (0.000%)"),
/// panicking if the report has no such line (a count that is not there is not 0).
fn pgbench_count(report: &str, label: &str) -> u64 {
    report
        .lines()
        .find_map(|l| l.trim().strip_prefix(label))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.split('/').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no {label:?} count in pgbench's report: {report}"))
}

#[test]
fn pgbench_counts_are_read_from_its_report() {
    let r = "number of transactions actually processed: 5127\n\
             number of failed transactions: 3 (0.058%)\nlatency average = 4.6 ms\n";
    assert_eq!(pgbench_count(r, "number of failed transactions:"), 3);
    assert_eq!(
        pgbench_count(r, "number of transactions actually processed:"),
        5127
    );
    // With -t the processed count reads "done/planned".
    let t = "number of transactions actually processed: 40/40\n";
    assert_eq!(
        pgbench_count(t, "number of transactions actually processed:"),
        40
    );
    let missing = std::panic::catch_unwind(|| pgbench_count("tps = 1\n", "number of failed:"));
    assert!(missing.is_err());
}

fn raw_login(lab: &Lab, password: &str) -> TcpStream {
    let mut s = TcpStream::connect(lab.proxy().addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let params = vec![
        ("user".to_string(), lab.cl.cfg.user.clone()),
        ("database".to_string(), "postgres".to_string()),
    ];
    s.write_all(&proto::startup_message(&params))
        .expect("startup");
    let f = proto::read_frame(&mut s)
        .expect("auth request")
        .expect("frame");
    assert_eq!(f.tag, b'R');
    let salt: [u8; 4] = f.body[4..8].try_into().expect("salt");
    let pw = proto::md5_password(&lab.cl.cfg.user, password, &salt);
    proto::write_frames(&mut s, &[proto::password_message(&pw)]).expect("password");
    s
}

/// Reads frames until an ErrorResponse; returns its SQLSTATE.
fn error_code(s: &mut TcpStream) -> String {
    loop {
        match proto::read_frame(s) {
            Ok(Some(f)) if f.tag == b'E' => {
                return proto::error_field(&f.body, b'C').unwrap_or_default()
            }
            Ok(Some(_)) => continue,
            other => return format!("no error response: {other:?}"),
        }
    }
}

#[test]
fn pg_bad_input_gets_postgres_errors() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !usable() {
        return;
    }
    // md5 here (raw_login speaks it); SCRAM is covered by pg_scram_auth_and_cancel_forwarding.
    let lab = Lab::up_with(|pc| pc.auth = AuthMethod::Md5);
    let a = lab.proxy().addr;
    // md5 keeps working with psql.
    let ok = psql_c(&lab, &lab.cl.cfg.password, "SELECT 40 + 2");
    assert!(ok.status.success(), "psql over md5: {ok:?}");
    assert_eq!(String::from_utf8_lossy(&ok.stdout).trim(), "42");
    // Wrong password: psql shows PostgreSQL's message.
    let out = Command::new("psql")
        .env("PGPASSWORD", "wrong")
        .args([
            "-h",
            &a.ip().to_string(),
            "-p",
            &a.port().to_string(),
            "-U",
            &lab.cl.cfg.user,
            "-c",
            "select 1",
            "postgres",
        ])
        .output()
        .expect("psql");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("password authentication failed for user"),
        "{err}"
    );
    let mut s = raw_login(&lab, "wrong");
    assert_eq!(error_code(&mut s), "28P01");
    // Garbage startup packets.
    for bad in [
        vec![0xffu8, 0xff, 0xff, 0xff],
        vec![0, 0, 0, 8, 0, 2, 0, 0],
        vec![0, 0, 0, 9, 0, 3, 0, 0, b'x'],
    ] {
        let mut s = TcpStream::connect(a).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        s.write_all(&bad).expect("write");
        let code = error_code(&mut s);
        assert!(
            code == "08P01" || code == "0A000",
            "startup {bad:?}: {code}"
        );
    }
    // After login: a message of unknown type, then one with an impossible length.
    let mut s = raw_login(&lab, &lab.cl.cfg.password.clone());
    loop {
        let f = proto::read_frame(&mut s).expect("read").expect("frame");
        if f.tag == b'Z' {
            break;
        }
    }
    s.write_all(&[b'y', 0, 0, 0, 4]).expect("write");
    assert_eq!(error_code(&mut s), "08P01");
    let mut s = raw_login(&lab, &lab.cl.cfg.password.clone());
    s.write_all(&[b'Q', 0, 0, 0, 1]).expect("write");
    assert_eq!(error_code(&mut s), "08P01");
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    // A truncated message followed by a hang-up must not disturb anyone else.
    let mut s = raw_login(&lab, &lab.cl.cfg.password.clone());
    s.write_all(&[b'Q', 0, 0, 0, 100, b's']).expect("write");
    drop(s);
    // The proxy still serves.
    let mut c = lab.client();
    assert_eq!(
        c.scalar("SELECT 41 + 1").expect("query").as_deref(),
        Some("42")
    );
    let st = lab.proxy().stats_json();
    assert!(st["protocol_errors"].as_u64().unwrap_or(0) >= 5, "{st}");
    assert!(st["auth_failures"].as_u64().unwrap_or(0) >= 2, "{st}");
}

fn rss_kb() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

/// All sessions share one relay loop here: a client that asks for ~200 MB of rows and then
/// stops reading must stall only itself (its server is not read past a bounded outbox), and
/// get every row once it reads again. In plaintext and over TLS (where output waits inside
/// the TLS connection too).
#[test]
fn pg_a_client_that_stops_reading_stalls_nobody_else() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !usable() {
        return;
    }
    {
        let lab = Lab::up_with(|pc| pc.relay_threads = 1);
        slow_reader_stalls_only_itself(&lab);
    }
    let (lab, _pki) = Lab::up_tls_with(|pc| pc.relay_threads = 1);
    slow_reader_stalls_only_itself(&lab);
}

fn slow_reader_stalls_only_itself(lab: &Lab) {
    let dial = || {
        Client::dial(&Dial {
            addr: lab.proxy().addr,
            user: &lab.cl.cfg.user,
            password: &lab.cl.cfg.password,
            database: "postgres",
            connect_timeout: Duration::from_secs(10),
            timeout: Duration::from_secs(10),
            tls: lab.cl.tls_client(),
        })
        .expect("connect through the proxy")
    };
    let tls = lab.cl.tls_client().is_some();
    let mut slow = dial();
    let rss0 = rss_kb();
    let rows = 20_000u64;
    proto::write_frames(
        slow.stream(),
        &[proto::query(&format!(
            "SELECT repeat('x', 10000) FROM generate_series(1, {rows})"
        ))],
    )
    .expect("write");
    // The server produces far more than the socket buffers and the outbox hold.
    std::thread::sleep(Duration::from_millis(1500));
    let mut fast = dial();
    for i in 0..50 {
        assert_eq!(
            fast.scalar(&format!("SELECT {i} + 1"))
                .expect("query")
                .as_deref(),
            Some((i + 1).to_string().as_str()),
            "another session on the same loop is served (tls: {tls})"
        );
    }
    let grown_mb = rss_kb().saturating_sub(rss0) / 1024;
    eprintln!("tls {tls}: the proxy process grew {grown_mb} MB while its client held back ~200 MB");
    assert!(
        grown_mb < 64,
        "back-pressure (tls: {tls}): the proxy buffered {grown_mb} MB for a client that does not read"
    );
    // The slow client reads everything, intact.
    let mut got = 0u64;
    loop {
        let f = proto::read_frame(slow.stream())
            .expect("read")
            .expect("frame");
        match f.tag {
            b'D' => {
                let cols = proto::data_row_columns(&f.body).expect("row");
                assert_eq!(cols[0].as_deref().map(str::len), Some(10_000));
                got += 1;
            }
            b'E' => panic!("error: {:?}", proto::error_field(&f.body, b'M')),
            b'Z' => break,
            _ => {}
        }
    }
    assert_eq!(got, rows, "tls: {tls}");
    assert_eq!(
        slow.scalar("SELECT 1").expect("query").as_deref(),
        Some("1")
    );
}

/// Reads up to ReadyForQuery: the SQLSTATEs of the errors on the way and the status.
fn until_ready(s: &mut TcpStream) -> (Vec<String>, u8) {
    let mut codes = Vec::new();
    loop {
        match proto::read_frame(s) {
            Ok(Some(f)) if f.tag == b'E' => {
                codes.push(proto::error_field(&f.body, b'C').unwrap_or_default())
            }
            Ok(Some(f)) if f.tag == b'Z' => return (codes, f.body[0]),
            Ok(Some(_)) => {}
            other => panic!("no ReadyForQuery: {other:?}"),
        }
    }
}

/// A simple query on a raw session.
fn raw_query(s: &mut TcpStream, sql: &str) -> (Vec<String>, u8) {
    proto::write_frames(s, &[proto::query(sql)]).expect("write");
    until_ready(s)
}

/// `sql` with the extended protocol (unnamed Parse, Bind, Execute, Sync), as pgJDBC runs
/// its commit().
fn raw_extended(s: &mut TcpStream, sql: &str) -> (Vec<String>, u8) {
    let mut p = Vec::new();
    proto::put_cstr(&mut p, "");
    proto::put_cstr(&mut p, sql);
    p.extend([0, 0]);
    let b = vec![0, 0, 0, 0, 0, 0, 0, 0];
    let e = vec![0, 0, 0, 0, 0];
    proto::write_frames(
        s,
        &[
            proto::Frame::new(b'P', p),
            proto::Frame::new(b'B', b),
            proto::Frame::new(b'E', e),
            proto::Frame::new(b'S', vec![]),
        ],
    )
    .expect("write");
    until_ready(s)
}

/// The SQLSTATE and message of a failed query (panics if it did not fail).
fn failure(
    r: Result<(pliant_pg::client::Rows, String), pliant_pg::client::ClientError>,
) -> (String, String) {
    match r {
        Err(pliant_pg::client::ClientError::Server { code, message }) => (code, message),
        other => panic!("expected a server error, got {other:?}"),
    }
}

/// The failover fixes of the session state machine, several sessions across one failover:
/// COMMIT of a transaction the failover aborted fails (simple and extended protocol) and the
/// session goes on; set_config, savepoints, DEALLOCATE and PREPARE in a rolled-back block are
/// replayed right; WITH HOLD cursors and unreadable set_config close the session with 57P01.
/// Then admission: more clients than max_connections get the server's 53300 at once, and a
/// client that sends nothing is closed after the (shortened) startup timeout.
#[test]
fn pg_failover_session_state_lost_commits_and_admission() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !usable() {
        return;
    }
    let cc = ClusterConfig {
        max_connections: 20,
        ..ClusterConfig::default()
    };
    let lab = Lab::up_cfg(cc, |pc| {
        pc.auth = AuthMethod::Md5;
        pc.startup_timeout_ms = 1000;
    });
    let pw = lab.cl.cfg.password.clone();
    let mut setup = lab.client();
    setup.query("CREATE TABLE t(a int)").expect("table");
    let ok = |c: &mut Client, sql: &str| c.query(sql).unwrap_or_else(|e| panic!("{sql}: {e}"));
    // 1. Idle inside a block when the primary fails, then COMMIT: simple protocol (first
    // statement after the failover, and after an earlier 40001), extended protocol.
    let mut lost = lab.client();
    ok(&mut lost, "BEGIN");
    ok(&mut lost, "INSERT INTO t VALUES (1)");
    let mut lost2 = lab.client();
    ok(&mut lost2, "BEGIN");
    ok(&mut lost2, "INSERT INTO t VALUES (2)");
    let mut lost3 = raw_login(&lab, &pw);
    until_ready(&mut lost3);
    assert_eq!(raw_query(&mut lost3, "BEGIN"), (vec![], b'T'));
    assert_eq!(
        raw_query(&mut lost3, "INSERT INTO t VALUES (3)"),
        (vec![], b'T')
    );
    // 2-5. Session state.
    let mut st = lab.client();
    for sql in [
        "SELECT set_config('myapp.tenant', 'x', false)",
        "BEGIN",
        "SELECT set_config('myapp.tenant', 'local', true)",
        "SELECT set_config('myapp.other', 'rolled-back', false)",
        "ROLLBACK",
        "BEGIN",
        "SET application_name = 'sp-kept'",
        "SAVEPOINT sp",
        "SET work_mem = '7MB'",
        "ROLLBACK TO SAVEPOINT sp",
        "COMMIT",
        "PREPARE q AS SELECT 1",
        "DEALLOCATE q",
        "PREPARE q AS SELECT 2",
        "BEGIN",
        "PREPARE r AS SELECT 5",
        "ROLLBACK",
    ] {
        ok(&mut st, sql);
    }
    // 6. State that cannot move.
    let mut hold = lab.client();
    ok(&mut hold, "BEGIN");
    ok(&mut hold, "DECLARE c CURSOR WITH HOLD FOR SELECT 1");
    ok(&mut hold, "COMMIT");
    let mut setcfg = lab.client();
    ok(
        &mut setcfg,
        "SELECT set_config('myapp.user', current_user, false)",
    );

    lab.kill_primary();

    let (code, msg) = failure(lost.query("COMMIT"));
    assert_eq!(code, "40001", "COMMIT of a lost transaction: {msg}");
    assert!(msg.contains("failed over"), "{msg}");
    assert_eq!(lost.status, b'I', "idle after the failed COMMIT");
    let (code, _) = failure(lost2.query("INSERT INTO t VALUES (22)"));
    assert_eq!(code, "40001");
    assert_eq!(failure(lost2.query("COMMIT")).0, "40001");
    let (codes, status) = raw_extended(&mut lost3, "COMMIT");
    assert_eq!(
        (codes, status),
        (vec!["40001".to_string()], b'I'),
        "extended COMMIT"
    );
    // The sessions go on normally; nothing of the lost transactions exists.
    for c in [&mut lost, &mut lost2] {
        ok(c, "BEGIN");
        ok(c, "INSERT INTO t VALUES (10)");
        ok(c, "COMMIT");
    }
    assert_eq!(
        raw_extended(&mut lost3, "INSERT INTO t VALUES (10)"),
        (vec![], b'I')
    );
    let n = setup
        .scalar("SELECT string_agg(a::text, ',' ORDER BY a) FROM t")
        .expect("count");
    assert_eq!(
        n.as_deref(),
        Some("10,10,10"),
        "only the transactions after the failover"
    );
    let rows = |c: &mut Client, sql: &str| {
        c.scalar(sql)
            .unwrap_or_else(|e| panic!("after failover, {sql}: {e}"))
            .unwrap_or_default()
    };
    assert_eq!(rows(&mut st, "SELECT current_setting('myapp.tenant')"), "x");
    assert_eq!(
        rows(
            &mut st,
            "SELECT coalesce(current_setting('myapp.other', true), '')"
        ),
        ""
    );
    assert_eq!(rows(&mut st, "SHOW application_name"), "sp-kept");
    assert_eq!(rows(&mut st, "SHOW work_mem"), "4MB");
    assert_eq!(rows(&mut st, "EXECUTE q"), "2");
    assert_eq!(rows(&mut st, "EXECUTE r"), "5");
    for (c, what) in [(&mut hold, "WITH HOLD"), (&mut setcfg, "set_config")] {
        let (code, msg) = failure(c.query("SELECT 1"));
        assert_eq!(code, "57P01", "{msg}");
        assert!(msg.contains(what), "{msg}");
    }
    let stats = lab.proxy().stats_json();
    assert_eq!(stats["sessions_dropped_unreplayable"], 2, "{stats}");
    assert_eq!(stats["sessions_dropped_other"], 0, "{stats}");

    // 7. More clients than max_connections: the server's own 53300, at once.
    let mut held = Vec::new();
    let refused = loop {
        let t = Instant::now();
        match Client::connect(
            lab.proxy().addr,
            &lab.cl.cfg.user,
            &pw,
            "postgres",
            Duration::from_secs(30),
        ) {
            Ok(c) => held.push(c),
            Err(e) => break (e, t.elapsed()),
        }
        assert!(
            held.len() < 40,
            "max_connections = 20 never refused a login"
        );
    };
    let (e, took) = refused;
    assert_eq!(e.sqlstate(), Some("53300"), "{e}");
    assert!(e.to_string().contains("too many clients"), "{e}");
    assert!(took < Duration::from_secs(2), "refused after {took:?}");
    drop(held);
    // 8. A client that sends nothing: closed after the startup timeout, saying so.
    let mut idle = TcpStream::connect(lab.proxy().addr).expect("connect");
    idle.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let t = Instant::now();
    let f = proto::read_frame(&mut idle).expect("read").expect("frame");
    let took = t.elapsed();
    assert_eq!(f.tag, b'E');
    assert_eq!(
        proto::error_field(&f.body, b'M').as_deref(),
        Some("timeout waiting for startup packet")
    );
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(5),
        "{took:?}"
    );
    let stats = lab.proxy().stats_json();
    eprintln!("proxy: {stats}");
    assert!(
        stats["logins_refused_by_server"].as_u64().unwrap_or(0) >= 1,
        "{stats}"
    );
    assert_eq!(stats["startup_timeouts"], 1, "{stats}");
}

/// A random statement that changes session state (all allowed on a hot standby); in a
/// failed block (`status` E) mostly one that ends or recovers it.
fn random_state_statement(r: &mut pliant_testkit::XorShift, status: u8) -> String {
    fn pick(r: &mut pliant_testkit::XorShift, xs: &[&'static str]) -> &'static str {
        xs[r.below(xs.len() as u64) as usize]
    }
    let key = pick(r, &["pl.a", "pl.b", "work_mem"]);
    let val = if key == "work_mem" {
        pick(r, &["1MB", "2MB", "3MB"])
    } else {
        pick(r, &["v1", "v2", "v3"])
    };
    let sp = pick(r, &["s1", "s2"]);
    let p = pick(r, &["p1", "p2", "p3"]);
    let choice = pick(r, &["DEALLOCATE ALL", "DISCARD PLANS", "DISCARD ALL"]);
    let end = pick(r, &["COMMIT", "END"]);
    if status == b'E' && r.below(3) > 0 {
        return pick(
            r,
            &[
                "ROLLBACK",
                "ROLLBACK TO SAVEPOINT s1",
                "ROLLBACK TO s2",
                "COMMIT",
            ],
        )
        .into();
    }
    match r.below(24) {
        0 | 1 => format!("SET {key} = '{val}'"),
        2 => format!("SET SESSION {key} TO '{val}'"),
        3 => format!("SET LOCAL {key} = '{val}'"),
        4 => format!("SELECT set_config('{key}', '{val}', false)"),
        5 => format!("SELECT set_config('{key}', '{val}', true)"),
        6 => format!("RESET {key}"),
        7 => "RESET ALL".into(),
        8 | 9 => format!("SAVEPOINT {sp}"),
        10 => format!("RELEASE SAVEPOINT {sp}"),
        11 => format!("ROLLBACK TO SAVEPOINT {sp}"),
        12 | 13 => format!("PREPARE {p} AS SELECT 1"),
        14 => format!("DEALLOCATE {p}"),
        15 => choice.into(),
        16 | 17 => "BEGIN".into(),
        18 => end.into(),
        19 | 20 => "ROLLBACK".into(),
        21 => "SELECT 1/0".into(),
        _ => format!("SHOW {key}"),
    }
}

/// The session state a client can observe: the settings touched, the prepared statements
/// (NULL and '' alike: a placeholder setting once SET reads '' after a rollback).
fn observed_state(c: &mut Client) -> String {
    c.scalar(
        "SELECT concat_ws('|', coalesce(current_setting('pl.a', true), ''), \
         coalesce(current_setting('pl.b', true), ''), current_setting('work_mem'), \
         (SELECT string_agg(name, ',' ORDER BY name) FROM pg_prepared_statements))",
    )
    .unwrap_or_else(|e| panic!("observe: {e}"))
    .unwrap_or_default()
}

/// A random sequence of session-state statements runs on a direct session (on the standby:
/// hot standby allows all of them, and the session survives the promotion) and through the
/// proxy; the primary fails at a random point. After every statement both give the same
/// outcome (SQLSTATE) and transaction status, and the same observable state. At the
/// failover an open block is lost through the proxy (its COMMIT must fail with 40001) and
/// rolled back on the direct session. PLIANT_PG_STATE_SEED=N reruns one seed.
#[test]
fn pg_random_session_state_matches_postgres_across_failover() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !usable() {
        return;
    }
    let seed = std::env::var("PLIANT_PG_STATE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
                | 1
        });
    eprintln!("PLIANT_PG_STATE_SEED={seed}");
    let mut r = pliant_testkit::XorShift(seed);
    let lab = Lab::up();
    let mut proxied = lab.client();
    let standby = 1 - lab.proxy().shared.primary.load(SeqCst);
    let mut direct = lab
        .cl
        .client(standby, Duration::from_secs(10))
        .expect("standby");
    let outcome = |c: &mut Client, sql: &str| match c.query(sql) {
        Ok(_) => String::new(),
        Err(e) => e.sqlstate().unwrap_or("no sqlstate").to_string(),
    };
    let n = 100;
    // From a random point on, the first time the session is inside a live block (the
    // interesting case), or 15 statements later.
    let fail_from = 10 + r.below(n - 30);
    let mut failed_over = false;
    let mut log = Vec::new();
    for i in 0..n {
        if !failed_over && i >= fail_from && (proxied.status == b'T' || i >= fail_from + 15) {
            failed_over = true;
            log.push(format!("-- failover (status {})", proxied.status as char));
            lab.kill_primary();
            match proxied.status {
                b'T' => {
                    let e = proxied.query("COMMIT").map(|_| ()).err();
                    let code = e.as_ref().and_then(|e| e.sqlstate());
                    assert_eq!(code, Some("40001"), "lost COMMIT, seed {seed}: {log:?}");
                    direct.query("ROLLBACK").expect("direct rollback");
                }
                b'E' => {
                    proxied.query("ROLLBACK").expect("proxied rollback");
                    direct.query("ROLLBACK").expect("direct rollback");
                }
                _ => {}
            }
            assert_eq!(proxied.status, b'I', "seed {seed}: {log:?}");
            assert_eq!(
                observed_state(&mut proxied),
                observed_state(&mut direct),
                "state after the failover, seed {seed}: {log:?}"
            );
        }
        let k = 1 + usize::from(r.below(4) == 0) + usize::from(r.below(8) == 0);
        let sql: Vec<String> = (0..k)
            .map(|_| random_state_statement(&mut r, proxied.status))
            .collect();
        let sql = sql.join("; ");
        let (a, b) = (outcome(&mut proxied, &sql), outcome(&mut direct, &sql));
        log.push(format!("{sql} -> {a:?}/{}", proxied.status as char));
        assert_eq!(a, b, "outcome of {sql:?}, seed {seed}: {log:?}");
        assert_eq!(
            proxied.status, direct.status,
            "status, seed {seed}: {log:?}"
        );
        if proxied.status != b'E' {
            assert_eq!(
                observed_state(&mut proxied),
                observed_state(&mut direct),
                "state after {sql:?}, seed {seed}: {log:?}"
            );
        }
    }
    eprintln!("{}", log.join("\n"));
    let st = lab.proxy().stats_json();
    assert_eq!(st["failovers"], 1, "{st}");
    assert_eq!(st["sessions_dropped_other"], 0, "{st}");
    assert_eq!(st["sessions_dropped_unreplayable"], 0, "{st}");
}

/// A child process fed lines on stdin and read line by line; killed on drop.
struct Coproc {
    child: Child,
    stdin: Option<std::process::ChildStdin>,
    lines: mpsc::Receiver<String>,
    timeout: Duration,
}

impl Coproc {
    fn spawn(cmd: &mut Command, timeout: Duration) -> Coproc {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
        let stdin = child.stdin.take();
        let (tx, lines) = mpsc::channel();
        let out = child.stdout.take().expect("stdout");
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(l);
            }
        });
        Coproc {
            child,
            stdin,
            lines,
            timeout,
        }
    }
    fn send(&mut self, line: &str) {
        let i = self.stdin.as_mut().expect("stdin open");
        writeln!(i, "{line}").expect("to the child");
    }
    /// Ends its input (it finishes its loop).
    fn close(&mut self) {
        self.stdin = None;
    }
    /// Its next line; on a timeout, "<no answer>" and what it wrote to stderr.
    fn next(&mut self) -> String {
        self.lines.recv_timeout(self.timeout).unwrap_or_else(|_| {
            let _ = self.child.kill();
            let mut e = String::new();
            if let Some(mut se) = self.child.stderr.take() {
                let _ = se.read_to_string(&mut e);
            }
            format!("<no answer> {e}")
        })
    }
}

impl Drop for Coproc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `psql -c sql` through the proxy with `password`; -qAt output.
fn psql_c(lab: &Lab, password: &str, sql: &str) -> std::process::Output {
    let a = lab.proxy().addr;
    Command::new("psql")
        .env("PGPASSWORD", password)
        .args([
            "-h",
            &a.ip().to_string(),
            "-p",
            &a.port().to_string(),
            "-U",
            &lab.cl.cfg.user,
            "-X",
            "-qAt",
            "-c",
            sql,
            "postgres",
        ])
        .output()
        .expect("psql")
}

fn pgbench(lab: &Lab, args: &[&str]) -> std::process::Output {
    let a = lab.proxy().addr;
    Command::new("/usr/lib/postgresql/15/bin/pgbench")
        .env("PGPASSWORD", &lab.cl.cfg.password)
        .args([
            "-h",
            &a.ip().to_string(),
            "-p",
            &a.port().to_string(),
            "-U",
            &lab.cl.cfg.user,
        ])
        .args(args)
        .arg("postgres")
        .output()
        .expect("pgbench")
}

/// A JDBC client (pgJDBC from Debian's libpostgresql-jdbc-java, run as a single-file Java
/// program): SCRAM login through the proxy, ApplicationName and a SET as session state, a
/// server-side prepared statement (prepareThreshold=1, so the extended protocol with a named
/// statement), a transaction; once per line read from stdin, on the same connection.
const JDBC_JAVA: &str = r#"
import java.io.*;
import java.sql.*;
import java.util.Properties;
public class JdbcCheck {
    public static void main(String[] a) throws Exception {
        Properties p = new Properties();
        p.setProperty("user", a[2]);
        p.setProperty("password", a[3]);
        p.setProperty("ApplicationName", "jdbc-test");
        p.setProperty("prepareThreshold", "1");
        if (a.length > 4) {
            // TLS as a pgJDBC user sets it: ssl=true, the server verified against a CA file.
            p.setProperty("ssl", "true");
            p.setProperty("sslmode", "verify-full");
            p.setProperty("sslrootcert", a[4]);
        }
        Connection c = DriverManager.getConnection("jdbc:postgresql://" + a[0] + ":" + a[1] + "/postgres", p);
        try (Statement st = c.createStatement()) { st.execute("SET search_path TO public, pg_catalog"); }
        PreparedStatement ps = c.prepareStatement("SELECT ?::int + 1, current_setting('application_name'), current_setting('search_path')");
        System.out.println("READY");
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in));
        while (in.readLine() != null) {
            StringBuilder out = new StringBuilder("OK");
            c.setAutoCommit(false);
            for (int i = 0; i < 3; i++) {
                ps.setInt(1, 41 + i);
                try (ResultSet r = ps.executeQuery()) {
                    r.next();
                    if (i == 2) out.append(" ").append(r.getInt(1)).append(" ").append(r.getString(2)).append(" ").append(r.getString(3).replace(" ", ""));
                }
            }
            c.commit();
            c.setAutoCommit(true);
            System.out.println(out);
        }
        c.close();
    }
}
"#;

/// psycopg2 session (Debian's /usr/bin/python3) that runs `SELECT pg_sleep(30)` and cancels it
/// from another thread with `conn.cancel()` (a real CancelRequest on a new connection), once
/// per line read from stdin; prints one result line per round.
const CANCEL_PY: &str = r#"
import sys, time, threading, psycopg2
host, port, user, pw = sys.argv[1:5]
conn = psycopg2.connect(host=host, port=int(port), user=user, password=pw, dbname="postgres")
conn.autocommit = True
cur = conn.cursor()
cur.execute("SET application_name = 'cancel-test'")
print("READY", flush=True)
for line in sys.stdin:
    t = threading.Timer(1.0, conn.cancel)
    t.start()
    t0 = time.time()
    try:
        cur.execute("SELECT pg_sleep(30)")
        res = "NOT_CANCELLED"
    except psycopg2.extensions.QueryCanceledError:
        res = "CANCELLED"
    except Exception as e:
        res = "ERROR " + type(e).__name__ + " " + str(e).replace("\n", " ")
    t.join()
    cur.execute("SHOW application_name")
    print("%s %.1f %s" % (res, time.time() - t0, cur.fetchone()[0]), flush=True)
"#;

#[test]
fn pg_scram_auth_and_cancel_forwarding() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !usable() {
        return;
    }
    let lab = Lab::up();
    let a = lab.proxy().addr;
    let (user, pw) = (lab.cl.cfg.user.clone(), lab.cl.cfg.password.clone());
    // The proxy asks for SCRAM-SHA-256 (AuthenticationSASL listing the mechanism).
    let mut s = TcpStream::connect(a).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let params = vec![
        ("user".to_string(), user.clone()),
        ("database".to_string(), "postgres".to_string()),
    ];
    s.write_all(&proto::startup_message(&params))
        .expect("startup");
    let f = proto::read_frame(&mut s).expect("read").expect("frame");
    assert_eq!(f.tag, b'R');
    assert_eq!(&f.body[..4], &10u32.to_be_bytes(), "AuthenticationSASL");
    assert_eq!(&f.body[4..], b"SCRAM-SHA-256\0\0");
    // A garbage SASLInitialResponse gets a protocol error, not a crash.
    proto::write_frames(
        &mut s,
        &[proto::Frame::new(
            b'p',
            b"SCRAM-SHA-256\0\0\0\0\x05n,,x".to_vec(),
        )],
    )
    .expect("write");
    assert_eq!(error_code(&mut s), "08P01");
    // psql (libpq answers SCRAM) with the right and a wrong password.
    let ok = psql_c(&lab, &pw, "SELECT 40 + 2");
    assert!(ok.status.success(), "psql over SCRAM: {ok:?}");
    assert_eq!(String::from_utf8_lossy(&ok.stdout).trim(), "42");
    let bad = psql_c(&lab, "wrong", "SELECT 1");
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(
        !bad.status.success() && err.contains("password authentication failed for user"),
        "{err}"
    );
    // pgbench initialises and runs over SCRAM (8 logins).
    let init = pgbench(&lab, &["-i", "-q", "-s", "1"]);
    assert!(init.status.success(), "pgbench -i: {init:?}");
    let run = pgbench(&lab, &["-n", "-c", "8", "-j", "2", "-T", "3"]);
    let out = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success() && out.contains("number of failed transactions: 0"),
        "pgbench over SCRAM: {out} {}",
        String::from_utf8_lossy(&run.stderr)
    );
    let st = lab.proxy().stats_json();
    assert!(st["auth_failures"].as_u64().unwrap_or(0) >= 1, "{st}");

    // Query cancel: psycopg2's conn.cancel() sends a CancelRequest with the key the proxy gave
    // it; the proxy forwards it to the backend serving the session, before and after a failover.
    let mut py = Coproc::spawn(
        Command::new("/usr/bin/python3").args([
            "-c",
            CANCEL_PY,
            &a.ip().to_string(),
            &a.port().to_string(),
            &user,
            &pw,
        ]),
        Duration::from_secs(40),
    );
    assert_eq!(py.next(), "READY");
    // JDBC: pgJDBC logs in over SCRAM and uses named prepared statements; the same connection
    // is used again after the failover below.
    let java_src = std::env::temp_dir().join(format!("JdbcCheck-{}.java", std::process::id()));
    std::fs::write(&java_src, JDBC_JAVA).expect("write java");
    let mut jv = Coproc::spawn(
        Command::new("java")
            .args(["-cp", "/usr/share/java/postgresql.jar"])
            .arg(&java_src)
            .args([&a.ip().to_string(), &a.port().to_string(), &user, &pw]),
        Duration::from_secs(60),
    );
    assert_eq!(jv.next(), "READY", "JDBC client did not connect");
    jv.send("go");
    assert_eq!(
        jv.next(),
        "OK 44 jdbc-test public,pg_catalog",
        "JDBC before failover"
    );
    for round in 0..2 {
        if round == 1 {
            lab.wait_protected();
            lab.kill_primary();
        }
        py.send("go");
        let l = py.next();
        let mut w = l.split_whitespace();
        // CANCELLED is the proof the cancel arrived: uncancelled, pg_sleep(30) ends normally
        // (NOT_CANCELLED). The seconds it ran are only shown.
        assert_eq!(w.next(), Some("CANCELLED"), "round {round}: {l}");
        let _secs = w.next();
        assert_eq!(w.next(), Some("cancel-test"), "session kept: {l}");
    }
    py.close();
    // The JDBC session outlived the failover: same connection, session state replayed
    // (ApplicationName, search_path, the named prepared statement).
    jv.send("go");
    assert_eq!(
        jv.next(),
        "OK 44 jdbc-test public,pg_catalog",
        "JDBC after failover"
    );
    jv.close();
    let _ = std::fs::remove_file(&java_src);
    // A CancelRequest with a wrong key is dropped and counted.
    let mut s = TcpStream::connect(a).expect("connect");
    let mut pkt = 16u32.to_be_bytes().to_vec();
    pkt.extend(proto::CANCEL_REQUEST.to_be_bytes());
    pkt.extend(1u32.to_be_bytes());
    pkt.extend(0u32.to_be_bytes());
    s.write_all(&pkt).expect("cancel");
    let _ = s.read_to_end(&mut Vec::new());
    let st = lab.proxy().stats_json();
    eprintln!("proxy: {st}");
    assert_eq!(st["cancels_forwarded"], 2, "{st}");
    assert!(st["cancels_unmatched"].as_u64().unwrap_or(0) >= 1, "{st}");
    assert_eq!(st["failovers"], 1);
}

#[test]
fn pg_async_fallback_when_standby_dies() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !usable() {
        return;
    }
    let fallback_ms = 1500;
    let lab = Lab::up_with(|pc| pc.async_fallback_ms = Some(fallback_ms));
    let p = lab.proxy();
    let (user, pw) = (lab.cl.cfg.user.clone(), lab.cl.cfg.password.clone());
    let mut c = lab.client();
    bank::setup(&mut c).expect("bank schema");
    let wl = bank::Workload::start(p.addr, &user, &pw, 8);
    std::thread::sleep(Duration::from_secs(1));
    assert!(wl.commits() > 0, "workload runs");
    // Keep the standby away until the test has seen commits continue without it.
    p.shared.reprotect_hold.store(true, SeqCst);
    let primary = p.shared.primary.load(SeqCst);
    let standby = 1 - primary;
    let t_kill = Instant::now();
    lab.cl
        .inject_failure(standby, true, true)
        .expect("kill standby");
    while p.shared.stats.async_fallbacks.load(SeqCst) == 0 {
        assert!(
            t_kill.elapsed() < Duration::from_secs(30),
            "no async fallback: {}",
            p.stats_json()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let fell_back_after = t_kill.elapsed();
    eprintln!("async fallback after {fell_back_after:?}");
    // (A commit may have started waiting a few ms before t_kill was taken and the standby
    // died: allow that much.)
    assert!(
        fell_back_after >= Duration::from_millis(fallback_ms - 100),
        "fell back before the timeout: {fell_back_after:?}"
    );
    let st = p.stats_json();
    assert_eq!(st["protected"], false, "{st}");
    assert_eq!(st["degraded"], true, "{st}");
    assert_eq!(p.shared.primary.load(SeqCst), primary, "no failover");
    // Commits continue, unprotected (how fast is the machine's business, not this test's:
    // the sleep only makes the unprotected time checked below at least 2 s).
    let c0 = wl.commits();
    std::thread::sleep(Duration::from_secs(2));
    let t_more = Instant::now();
    while wl.commits() <= c0 + 20 {
        assert!(
            t_more.elapsed() < Duration::from_secs(60),
            "commits stopped after the fallback: {c0} -> {}",
            wl.commits()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let c1 = wl.commits();
    let mut dc = lab
        .cl
        .client(primary, Duration::from_secs(10))
        .expect("primary");
    let r = wl.check(&mut dc).expect("check");
    assert!(r.ok(), "while unprotected: {r:?}");
    // The standby returns; protection resumes.
    p.shared.reprotect_hold.store(false, SeqCst);
    lab.wait_protected();
    let st = p.stats_json();
    eprintln!("after restore: {st}");
    assert_eq!(st["standby_restores"], 1, "{st}");
    assert_eq!(st["degraded"], false, "{st}");
    assert!(
        st["unprotected_ms_total"].as_u64().unwrap_or(0) >= 2000,
        "{st}"
    );
    // Nothing lost: the restored standby holds every commit acknowledged while it was gone,
    // shown by failing over to it.
    std::thread::sleep(Duration::from_millis(500));
    lab.kill_primary();
    let np = p.shared.primary.load(SeqCst);
    assert_eq!(np, standby);
    let mut dc = lab
        .cl
        .client(np, Duration::from_secs(10))
        .expect("new primary");
    let r = wl.check(&mut dc).expect("check");
    eprintln!("after failover to the restored standby: {r:?}");
    assert!(r.ok(), "after failover: {r:?}");
    assert!(r.acked > c1, "acked commits counted: {r:?}");
    assert_eq!(r.acked_lost, 0);
    assert!(wl.commits() > c1, "commits continue after the failover");
    wl.stop();
}

/// Runs `pliant pg ...` with its run directory redirected.
fn pliant_pg(run_dir: &std::path::Path, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_pliant"))
        .env("PLIANT_PG_RUN_DIR", run_dir)
        .arg("pg")
        .args(args)
        .output()
        .expect("pliant pg")
}

#[test]
fn pg_up_status_down_leaves_nothing_behind() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !usable() {
        return;
    }
    let run_dir = std::env::temp_dir().join(format!("pliant-pg-run-{}", std::process::id()));
    struct Down(std::path::PathBuf);
    impl Drop for Down {
        fn drop(&mut self) {
            let _ = pliant_pg(&self.0, &["down"]);
        }
    }
    let _down = Down(run_dir.clone());
    let up = pliant_pg(&run_dir, &["up", "--async-fallback-ms", "2000"]);
    assert!(up.status.success(), "pliant pg up: {up:?}");
    let state: serde_json::Value =
        serde_json::from_slice(&up.stdout).expect("up prints its state as JSON");
    let dir = state["dir"].as_str().expect("dir").to_string();
    let bridge = state["bridge"].as_str().expect("bridge").to_string();
    let nss: Vec<String> = state["nodes"]
        .as_array()
        .expect("nodes")
        .iter()
        .map(|n| n["ns"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(nss.len(), 2);
    // psql through the proxy with what `up` printed (SCRAM by default).
    let proxy: std::net::SocketAddr = state["proxy"]
        .as_str()
        .expect("proxy")
        .parse()
        .expect("addr");
    // The password is neither printed nor needed on a command line: the passfile (0600) is.
    let default_pw = ClusterConfig::default().password;
    assert!(
        !String::from_utf8_lossy(&up.stdout).contains(&default_pw),
        "up printed the password"
    );
    let passfile = state["passfile"].as_str().expect("passfile").to_string();
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&passfile)
        .expect("passfile")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "{passfile}");
    assert!(state["connect"]
        .as_str()
        .is_some_and(|c| c.starts_with(&format!("PGPASSFILE={passfile} psql"))));
    let out = Command::new("psql")
        .env("PGPASSFILE", &passfile)
        .env_remove("PGPASSWORD")
        .args([
            "-h",
            &proxy.ip().to_string(),
            "-p",
            &proxy.port().to_string(),
        ])
        .args(["-U", state["user"].as_str().unwrap_or_default()])
        .args(["-X", "-qAt", "-c", "SELECT 6 * 7", "postgres"])
        .output()
        .expect("psql");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "42", "{out:?}");
    let t = Instant::now();
    let status = loop {
        let st = pliant_pg(&run_dir, &["status"]);
        assert!(st.status.success(), "status: {st:?}");
        let v: serde_json::Value = serde_json::from_slice(&st.stdout).expect("status JSON");
        if v["sessions_total"].as_u64().unwrap_or(0) >= 1 || t.elapsed() > Duration::from_secs(5) {
            break v;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(status["running"], true, "{status}");
    assert_eq!(status["protected"], true, "{status}");
    assert_eq!(status["async_fallback_ms"], 2000, "{status}");
    assert_eq!(status["async_fallbacks"], 0, "{status}");
    assert_eq!(status["auth"], "ScramSha256", "{status}");
    assert!(status["roles"].is_object(), "{status}");
    let down = pliant_pg(&run_dir, &["down"]);
    assert!(down.status.success(), "down: {down:?}");
    assert!(
        !run_dir.exists(),
        "run directory left behind: {:?}",
        std::fs::read_dir(&run_dir).map(|d| d.flatten().map(|e| e.path()).collect::<Vec<_>>())
    );
    assert!(!std::path::Path::new(&dir).exists(), "data left in {dir}");
    let netns = Command::new("ip")
        .args(["netns", "list"])
        .output()
        .expect("ip");
    let netns = String::from_utf8_lossy(&netns.stdout);
    for ns in &nss {
        assert!(!netns.contains(ns.as_str()), "namespace {ns} left behind");
    }
    let br = Command::new("ip")
        .args(["link", "show", &bridge])
        .output()
        .expect("ip");
    assert!(!br.status.success(), "bridge {bridge} left behind");
    // A second `down` says so instead of failing silently.
    let again = pliant_pg(&run_dir, &["down"]);
    assert!(!again.status.success(), "down without a cluster: {again:?}");
    assert!(!run_dir.exists());
}

/// psycopg2 with the given sslmode: SET state, then per line from stdin its application_name,
/// whether its own connection uses TLS, and whether the server backend serving it (behind
/// the proxy) sees TLS.
const TLS_PY: &str = r#"
import sys, psycopg2
host, port, user, pw, mode = sys.argv[1:6]
conn = psycopg2.connect(host=host, port=int(port), user=user, password=pw, dbname="postgres", sslmode=mode)
conn.autocommit = True
cur = conn.cursor()
cur.execute("SET application_name = 'tls-py'")
print("READY", flush=True)
for line in sys.stdin:
    cur.execute("SELECT current_setting('application_name'), ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
    app, backend_ssl = cur.fetchone()
    print(app, conn.info.ssl_in_use, backend_ssl, flush=True)
"#;

/// `psql -c sql` through the proxy with a libpq connection string; (success, stdout, stderr).
fn psql_conninfo(lab: &Lab, conninfo: &str, sql: &str) -> (bool, String, String) {
    let a = lab.proxy().addr;
    let out = Command::new("psql")
        .env("PGPASSWORD", &lab.cl.cfg.password)
        .args(["-X", "-qAt", "-c", sql])
        .arg(format!(
            "host={} port={} user={} dbname=postgres {conninfo}",
            a.ip(),
            a.port(),
            lab.cl.cfg.user
        ))
        .output()
        .expect("psql");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).trim().to_string(),
        String::from_utf8_lossy(&out.stderr).trim().to_string(),
    )
}

#[test]
fn pg_tls_clients_channel_binding_and_failover() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !usable() {
        return;
    }
    let t0 = Instant::now();
    let (lab, pki) = Lab::up_tls();
    let a = lab.proxy().addr;
    let ca = pki.ca.display().to_string();
    // psql: verify-full against the demo CA (the certificate names the proxy's IP) and
    // channel binding required (SCRAM-SHA-256-PLUS with the certificate's hash).
    let strict = format!("sslmode=verify-full sslrootcert={ca} channel_binding=require");
    let mut psql = Psql::start_with(&lab, &strict);
    let q = "SET application_name = 'tls-psql'; \
             SELECT current_setting('application_name') || ' ' || ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid();";
    assert_eq!(
        psql.ask(q),
        "tls-psql true",
        "psql over TLS, server side over TLS"
    );
    // psycopg2 with sslmode=require.
    let mut py = Coproc::spawn(
        Command::new("/usr/bin/python3").args([
            "-c",
            TLS_PY,
            &a.ip().to_string(),
            &a.port().to_string(),
            &lab.cl.cfg.user,
            &lab.cl.cfg.password,
            "require",
        ]),
        Duration::from_secs(30),
    );
    assert_eq!(py.next(), "READY");
    py.send("go");
    assert_eq!(
        py.next(),
        "tls-py True True",
        "psycopg2 before the failover"
    );
    // pgJDBC with ssl=true (verify-full against the demo CA), named prepared statements.
    let java_src = std::env::temp_dir().join(format!("JdbcCheck-tls-{}.java", std::process::id()));
    std::fs::write(&java_src, JDBC_JAVA).expect("write java");
    let mut jv = Coproc::spawn(
        Command::new("java")
            .args(["-cp", "/usr/share/java/postgresql.jar"])
            .arg(&java_src)
            .args([
                &a.ip().to_string(),
                &a.port().to_string(),
                &lab.cl.cfg.user,
                &lab.cl.cfg.password,
                &ca,
            ]),
        Duration::from_secs(60),
    );
    assert_eq!(jv.next(), "READY", "pgJDBC over TLS did not connect");
    jv.send("go");
    assert_eq!(
        jv.next(),
        "OK 44 jdbc-test public,pg_catalog",
        "pgJDBC over TLS before the failover"
    );
    // The sessions move at a failover and stay encrypted on both sides.
    lab.kill_primary();
    jv.send("go");
    assert_eq!(
        jv.next(),
        "OK 44 jdbc-test public,pg_catalog",
        "pgJDBC over TLS after the failover"
    );
    jv.close();
    let _ = std::fs::remove_file(&java_src);
    assert_eq!(
        psql.ask("SELECT current_setting('application_name') || ' ' || ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid();"),
        "tls-psql true",
        "psql after the failover"
    );
    py.send("go");
    assert_eq!(py.next(), "tls-py True True", "psycopg2 after the failover");
    py.close();
    let st = lab.proxy().stats_json();
    assert_eq!(st["failovers"], 1, "{st}");
    assert_eq!(st["sessions_dropped_other"], 0, "{st}");
    assert_eq!(st["tls"], "required", "{st}");
    // The bank workload over TLS through the proxy (what `pliant bench pg --tls` runs), two
    // more failovers: no acknowledged commit lost, no session dropped.
    let rep = bank::run_trials(&lab.cl, lab.proxy(), 4, 2, &mut |s| eprintln!("{s}"))
        .expect("bank trials over TLS");
    assert_eq!(rep.failover_ms.len(), 2, "{rep:?}");
    assert!(rep.failures.is_empty(), "{:?}", rep.failures);
    assert_eq!(rep.acked_commits_lost, 0);
    assert!(rep.acked_commits > 10, "{}", rep.acked_commits);
    assert_eq!(rep.sessions_dropped, 0, "bank sessions over TLS dropped");
    // A plaintext client is refused (TLS required), with a reason.
    let (ok, _, err) = psql_conninfo(&lab, "sslmode=disable", "SELECT 1");
    assert!(!ok && err.contains("TLS is required"), "plaintext: {err}");
    // A client trusting another CA refuses the proxy's certificate.
    let other = make_demo_pki(&lab.cl.dir.join("other-ca"), &lab.cl.addresses()).expect("pki");
    let (ok, _, err) = psql_conninfo(
        &lab,
        &format!("sslmode=verify-full sslrootcert={}", other.ca.display()),
        "SELECT 1",
    );
    assert!(
        !ok && err.contains("certificate verify failed"),
        "wrong CA: {err}"
    );
    // verify-full with the right CA but another host name than the certificate has.
    let (ok, _, err) = psql_conninfo(
        &lab,
        &format!(
            "sslmode=verify-full sslrootcert={ca} hostaddr={} host=elsewhere.invalid",
            a.ip()
        ),
        "SELECT 1",
    );
    assert!(
        !ok && err.contains("does not match host name"),
        "wrong name: {err}"
    );
    // SSLRequest, then garbage instead of a ClientHello: closed, nothing else happens.
    let mut s = TcpStream::connect(a).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let mut req = 8u32.to_be_bytes().to_vec();
    req.extend(proto::SSL_REQUEST.to_be_bytes());
    s.write_all(&req).expect("SSLRequest");
    let mut b = [0u8; 1];
    s.read_exact(&mut b).expect("answer");
    assert_eq!(b[0], b'S');
    s.write_all(&proto::startup_message(&[("user".into(), "x".into())]))
        .expect("garbage");
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    assert!(rest.len() < 64, "only a TLS alert at most: {rest:?}");
    // GSSENCRequest still gets N.
    let mut s = TcpStream::connect(a).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let mut req = 8u32.to_be_bytes().to_vec();
    req.extend(proto::GSSENC_REQUEST.to_be_bytes());
    s.write_all(&req).expect("GSSENCRequest");
    s.read_exact(&mut b).expect("answer");
    assert_eq!(b[0], b'N');
    // Towards the servers: a proxy trusting another CA refuses them (and says why).
    let mut pc = proxy_config(&lab.cl, lab.proxy().shared.primary.load(SeqCst));
    pc.listen.set_port(6433);
    pc.server_tls = Some(UpstreamTls {
        ca: other.ca.clone(),
        server_name: None,
        allow_cleartext_password: false,
    });
    // Unprotected and without cluster hooks: its controller never fails over.
    let bad = Proxy::start(pc, false, None).expect("second proxy");
    let e = Client::connect(
        bad.addr,
        &lab.cl.cfg.user,
        &lab.cl.cfg.password,
        "postgres",
        Duration::from_secs(10),
    )
    .err()
    .map(|e| e.to_string())
    .unwrap_or_default();
    bad.stop();
    assert!(
        e.contains("28000") && e.contains("certificate"),
        "upstream with the wrong CA: {e}"
    );
    let st = lab.proxy().stats_json();
    assert!(st["plaintext_refused"].as_u64().unwrap_or(0) >= 1, "{st}");
    assert!(
        st["tls_handshake_failures"].as_u64().unwrap_or(0) >= 2,
        "{st}"
    );
    eprintln!("TLS test body took {:?}", t0.elapsed());
}

/// What psycopg2 users do, in threads: explicit transactions (two inserts, sometimes idle in
/// the block for a few ms, then `conn.commit()`, which does not look at the command tag) and
/// autocommit inserts; on an error, `rollback()` (or a new connection) and go on. Prints READY,
/// runs until a line on stdin, then prints one JSON line: every `(tid, seq)` whose commit (or
/// autocommit insert) returned normally, and the errors by SQLSTATE.
const PSYCOPG_LOAD_PY: &str = r#"
import json, random, sys, threading, time
import psycopg2
host, port, user, pw, n = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
stop = threading.Event()
lock = threading.Lock()
acked, codes = [], {}
def connect():
    return psycopg2.connect(host=host, port=port, user=user, password=pw, dbname="postgres",
                            connect_timeout=10)
def run(tid):
    rnd = random.Random(tid)
    c, seq = None, 0
    while not stop.is_set():
        try:
            if c is None or c.closed:
                c = connect()
            seq += 1
            if seq % 4 == 0:
                c.autocommit = True
                with c.cursor() as cur:
                    cur.execute("INSERT INTO ledger VALUES (%s, %s)", (tid, seq))
                c.autocommit = False
            else:
                with c.cursor() as cur:
                    cur.execute("INSERT INTO ledger VALUES (%s, %s)", (tid, seq))
                    if rnd.random() < 0.5:
                        time.sleep(rnd.random() * 0.01)
                    cur.execute("INSERT INTO ledger VALUES (%s, %s)", (tid, -seq))
                c.commit()
            with lock:
                acked.append([tid, seq])
        except psycopg2.Error as e:
            with lock:
                k = e.pgcode or type(e).__name__
                codes[k] = codes.get(k, 0) + 1
            try:
                c.rollback()
                c.autocommit = False
            except Exception:
                c = None
ts = [threading.Thread(target=run, args=(t,)) for t in range(n)]
for t in ts:
    t.start()
print("READY", flush=True)
sys.stdin.readline()
stop.set()
for t in ts:
    t.join()
print(json.dumps({"acked": acked, "codes": codes}), flush=True)
"#;

/// psycopg2 across three failovers (each after re-protection), under explicit transactions
/// and autocommit inserts from 4 threads: every `commit()` that returned normally is in the
/// database afterwards with both of its rows, and no transaction is half there. psycopg2
/// ignores command tags, so a COMMIT answered `ROLLBACK` without an error would be a lost
/// acknowledged commit here.
#[test]
fn pg_psycopg_commits_that_returned_survive_failovers() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !usable() {
        return;
    }
    let lab = Lab::up();
    lab.client()
        .query("CREATE TABLE ledger(tid int, seq int, PRIMARY KEY (tid, seq))")
        .expect("table");
    let a = lab.proxy().addr;
    let (user, pw) = (lab.cl.cfg.user.clone(), lab.cl.cfg.password.clone());
    let mut py = Coproc::spawn(
        Command::new("/usr/bin/python3").args([
            "-c",
            PSYCOPG_LOAD_PY,
            &a.ip().to_string(),
            &a.port().to_string(),
            &user,
            &pw,
            "4",
        ]),
        Duration::from_secs(60),
    );
    assert_eq!(py.next(), "READY");
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(1500));
        lab.kill_primary();
        lab.wait_protected();
    }
    std::thread::sleep(Duration::from_millis(1000));
    py.send("stop");
    let line = py.next();
    let v: serde_json::Value =
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("psycopg load: {e}: {line}"));
    let acked: Vec<(i64, i64)> = v["acked"]
        .as_array()
        .expect("acked")
        .iter()
        .map(|p| (p[0].as_i64().unwrap(), p[1].as_i64().unwrap()))
        .collect();
    // Directly on the primary the proxy now uses, not through the proxy.
    let np = lab.proxy().shared.primary.load(SeqCst);
    let mut dc = lab.cl.client(np, Duration::from_secs(10)).expect("primary");
    let (rows, _) = dc.query("SELECT tid, seq FROM ledger").expect("ledger");
    let present: std::collections::BTreeSet<(i64, i64)> = rows
        .iter()
        .map(|r| {
            let f = |i: usize| r[i].as_deref().unwrap_or("0").parse::<i64>().unwrap();
            (f(0), f(1))
        })
        .collect();
    let lost: Vec<&(i64, i64)> = acked
        .iter()
        .filter(|&&(t, s)| {
            !present.contains(&(t, s)) || (s % 4 != 0 && !present.contains(&(t, -s)))
        })
        .collect();
    let half: Vec<&(i64, i64)> = present
        .iter()
        .filter(|&&(t, s)| s % 4 != 0 && !present.contains(&(t, -s)))
        .collect();
    eprintln!(
        "psycopg2: {} commits returned normally, {} rows, errors by SQLSTATE {}, proxy {}",
        acked.len(),
        present.len(),
        v["codes"],
        lab.proxy().stats_json()
    );
    assert!(acked.len() > 100, "too little load: {}", acked.len());
    assert!(
        lost.is_empty(),
        "commits that returned normally are missing: {lost:?}"
    );
    assert!(half.is_empty(), "transactions half there: {half:?}");
    assert!(
        lab.proxy().shared.stats.failovers.load(SeqCst) >= 3,
        "{}",
        lab.proxy().stats_json()
    );
}
