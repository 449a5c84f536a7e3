//! End-to-end tests of `pliant pg` (issue 5): a real PostgreSQL 15 primary and synchronous
//! standby in namespaces, the pliant proxy in front, failures injected for real.
//!
//! Run serially (`--test-threads=1`; a lock enforces it too). Skipped with a message when
//! PostgreSQL 15 is not installed or not running as root.

use pliant_pg::bank;
use pliant_pg::bench::proxy_config;
use pliant_pg::client::Client;
use pliant_pg::cluster::{Cluster, ClusterConfig};
use pliant_pg::proto;
use pliant_pg::proxy::{ClusterOps, Proxy};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::Ordering::SeqCst;
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

static SERIAL: Mutex<()> = Mutex::new(());

fn usable() -> bool {
    let ok = std::path::Path::new("/usr/lib/postgresql/15/bin/postgres").exists()
        && unsafe { libc_geteuid() } == 0;
    if !ok {
        eprintln!("skipping: needs root and postgresql-15 (scripts/install-deps.sh)");
    }
    ok
}

extern "C" {
    #[link_name = "geteuid"]
    fn libc_geteuid() -> u32;
}

/// Cluster + proxy, torn down on drop (also when an assertion fails).
struct Lab {
    cl: Arc<Cluster>,
    proxy: Option<Proxy>,
}

impl Lab {
    fn up() -> Lab {
        let cl = Arc::new(Cluster::create(ClusterConfig::default()).expect("create namespaces"));
        let mut lab = Lab {
            cl: cl.clone(),
            proxy: None,
        };
        cl.init_primary().expect("primary");
        cl.add_standby(1, 0).expect("standby");
        cl.protect(0, 1).expect("sync standby");
        let ops: Arc<dyn ClusterOps> = cl.clone();
        lab.proxy = Some(Proxy::start(proxy_config(&cl, 0), true, Some(ops)).expect("proxy"));
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
        let a = lab.proxy().addr;
        let mut child = Command::new("psql")
            .env("PGPASSWORD", &lab.cl.cfg.password)
            .args([
                "-h",
                &a.ip().to_string(),
                "-p",
                &a.port().to_string(),
                "-U",
                &lab.cl.cfg.user,
            ])
            .args(["-X", "-q", "-A", "-t", "postgres"])
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
                .args([
                    "-c",
                    "4",
                    "-j",
                    "2",
                    "-T",
                    &secs.to_string(),
                    "-M",
                    "prepared",
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
        assert!(
            !stderr.contains("aborted in command"),
            "a pgbench client was dropped: {stderr}"
        );
        assert!(
            stdout.contains("number of clients: 4"),
            "pgbench ran: {stdout}"
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
    let lab = Lab::up();
    // Wrong password: psql shows PostgreSQL's message.
    let a = lab.proxy().addr;
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
