//! End-to-end: two controllers share one etcd (a real one, mutual TLS), one leads. A 3-replica HA lab (NAT)
//! with a download through it:
//!
//! 1. controller `a` leads, `b` waits as a standby (its API answers 503 naming the leader);
//! 2. `a` is SIGKILLed mid-download: `b` sees `a`'s API refuse connections, revokes its lease
//!    and leads in a higher term well inside the lease's TTL; the replicas keep forwarding (the
//!    download completes intact) and follow the new term: a request of `a`'s term is refused
//!    and counted by the replica;
//! 3. `a` comes back as a standby; `b` is SIGSTOPped (alive but silent: no proof of death), so
//!    `a` leads only once `b`'s lease expired; on SIGCONT, `b` finds its leadership over and
//!    stands by without acting;
//! 4. etcd is SIGKILLed for 10 s under a download: every controller stands down (none can
//!    prove it still leads), the replicas forward on, the download completes; once etcd is
//!    back a controller leads again with the whole replica set and a scale-out goes through.
//! 5. the leader is SIGKILLed in the middle of a scale-out under a download: the standby leads
//!    within the takeover bound, the cut-short scale-out is settled (every replica it knows
//!    alive and protected), and the download completes intact — the fabric kept steering with
//!    everything it learned (a controller that stands down leaves its steering in place; the
//!    successor adopts it), so the ring change re-homed no live flow.
//! 6. the leader is SIGKILLed in the middle of a migration whose destination replica is
//!    SIGSTOPped (the move cannot finish first): a third controller, standing by, leads within
//!    the takeover bound, the move is settled (the flow on exactly one replica, its source or
//!    its destination), and the moved flow's download completes intact after the destination
//!    resumes.
//!
//! Needs root and etcd (`pliant_testkit`). Run in release:
//! `cargo test --release -p pliant-cli --test e2e_controller_ha -- --nocapture`.

mod common;
use common::ha::*;
use pliant_lab::etcd::EtcdServer;
use pliant_lab::PliantNf;
use pliant_proto::{ControlError, Request};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// A controller process this test started (SIGKILLed by PID when dropped).
struct Ctl {
    child: Option<Child>,
    dir: PathBuf,
}

impl Ctl {
    fn pid(&self) -> i32 {
        self.child.as_ref().expect("running").id() as i32
    }
    fn signal(&self, sig: i32) {
        // SAFETY: a signal to a controller process this test spawned and has not reaped.
        unsafe {
            libc::kill(self.pid(), sig);
        }
    }
}

impl Drop for Ctl {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Starts `pliant controller` with the config `text` in `dir` (the lab's way of running it).
fn start(run: &HaRun, dir: &Path, text: &str) -> Ctl {
    std::fs::create_dir_all(dir).expect("mkdir");
    Ctl {
        child: Some(run.spawn_controller(dir, text)),
        dir: dir.to_path_buf(),
    }
}

/// `pliant status --json` against the controller whose API socket and token are in `dir`:
/// the status, or the error text (a standby answers 503).
fn status(dir: &Path) -> Result<Value, String> {
    let out = controller_cli(dir, &["status", "--json"]);
    if out.status.success() {
        serde_json::from_slice(&out.stdout).map_err(|e| e.to_string())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// Waits until the controller in `dir` leads; returns its status and how long that took.
fn wait_leading(dir: &Path, limit: Duration) -> (Value, Duration) {
    let t = Instant::now();
    loop {
        if let Ok(v) = status(dir) {
            if v["controller"]["role"] == "leader" {
                return (v, t.elapsed());
            }
        }
        assert!(
            t.elapsed() < limit,
            "{} does not lead after {limit:?}: {:?}\n{}",
            dir.display(),
            status(dir),
            pliant_lab::log_tail(&dir.join("controller.log"), 20)
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("port")
        .port()
}

fn term_of(v: &Value) -> u64 {
    v["controller"]["term"].as_u64().expect("a leader's term")
}

#[test]
fn a_standby_controller_takes_over_and_a_deposed_leader_is_refused() {
    if !pliant_testkit::require_root()
        || !pliant_testkit::require_tool("etcd", "etcd-server")
        || !pliant_testkit::require_tool("etcdctl", "etcd-client")
    {
        return;
    }
    // etcd as across hosts: mutual TLS, only certified clients served.
    let etcd = EtcdServer::scratch_tls("e2e-ctlha").expect("etcd");
    let pki = etcd.spec.tls.clone().expect("pki");
    let (port_a, port_b) = (free_port(), free_port());
    let store = format!(
        "[store]\nbackend = \"etcd\"\nendpoints = [\"{}\"]\nprefix = \"/pliant/e2e-{}/\"\n\
         ca_file = \"{}\"\ncert_file = \"{}\"\nkey_file = \"{}\"\n",
        etcd.spec.client_url(),
        std::process::id(),
        pki.ca.display(),
        pki.client_cert.display(),
        pki.client_key.display()
    );
    let Some(mut run) = ha_up_full(
        "ctlha",
        PliantNf::nat(),
        &[("16M.bin", 16 << 20)],
        pliant_lab::mgmt::Transport::Unix,
        "auto = false\nmax_replicas = 60\n",
        &format!("name = \"a\"\napi_tcp = \"127.0.0.1:{port_a}\"\n"),
        &store,
    ) else {
        return;
    };
    // 1. a leads, on etcd.
    let (st, _) = wait_leading(&run.dir, Duration::from_secs(10));
    assert_eq!(st["controller"]["name"], "a", "{st}");
    assert_eq!(st["store"]["backend"], "etcd", "{st}");
    assert_eq!(st["store"]["ok"], true, "{st}");
    let term_a = term_of(&st);
    let cfg_a = std::fs::read_to_string(run.dir.join("ctl.toml")).expect("a's config");
    // `--check` asks etcd too (over its TLS).
    let out = Command::new(common::pliant())
        .args(["controller", "--check", "--config"])
        .arg(run.dir.join("ctl.toml"))
        .output()
        .expect("pliant controller --check");
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && said.contains("answers") && said.contains("mutual TLS"),
        "{said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dir_b = run.dir.join("b");
    let cfg_b = cfg_a
        .replace(
            &format!("{}/api.sock", run.dir.display()),
            &format!("{}/api.sock", dir_b.display()),
        )
        .replace(
            &format!("{}/token", run.dir.display()),
            &format!("{}/token", dir_b.display()),
        )
        .replace("name = \"a\"", "name = \"b\"")
        .replace(&format!(":{port_a}\""), &format!(":{port_b}\""));
    assert_ne!(cfg_a, cfg_b);
    let b = start(&run, &dir_b, &cfg_b);
    common::wait_for("b's API", Duration::from_secs(10), || {
        dir_b.join("token").exists() && dir_b.join("api.sock").exists()
    });
    // The standby answers, and says who leads.
    common::wait_for(
        "b reports a as leader",
        Duration::from_secs(5),
        || matches!(status(&dir_b), Err(e) if e.contains("standby") && e.contains("\"a\"")),
    );

    // 2. a dies mid-download.
    let f = run.lab().served_file("16M.bin").expect("file").clone();
    let rate = format!("{}", f.size_bytes / 6);
    let mut dl = run.curl(&f.url, 41_000, &rate, "ctlha");
    std::thread::sleep(Duration::from_millis(1500));
    let mut a = run.controller.take().expect("a runs");
    let killed = Instant::now();
    a.kill().expect("SIGKILL a");
    let _ = a.wait();
    let (st, took) = wait_leading(&dir_b, Duration::from_secs(10));
    let takeover = killed.elapsed().min(took);
    let term_b = term_of(&st);
    eprintln!(
        "takeover: b leads {} ms after a's SIGKILL (term {term_a} -> {term_b})",
        takeover.as_millis()
    );
    assert!(term_b > term_a, "terms only grow: {term_a} -> {term_b}");
    // The lease's TTL is 2 s: well before it, b acted on the proof that a was gone.
    assert!(
        takeover < Duration::from_millis(1500),
        "takeover took {takeover:?}: waited for the lease instead of deposing"
    );
    let alive = |v: &Value| {
        v["replicas"]
            .as_array()
            .map(|rs| rs.iter().filter(|r| r["alive"] == true).count())
            .unwrap_or(0)
    };
    assert_eq!(alive(&st), 3, "b took over the replica set: {st}");
    dl.finish(&f.sha256, "download across the controller takeover");

    // The replicas follow b's term; a request of a's term is refused and counted.
    let sock = run.lab().control_socket_of(1);
    let client = pliant_lab::ha::control_client(&sock);
    common::wait_for("r1 follows b's term", Duration::from_secs(5), || {
        client
            .call(&Request::Stats)
            .map(|v| v["engine"]["control_term"].as_u64() == Some(term_b))
            .unwrap_or(false)
    });
    match client.clone().with_term(term_a).call(&Request::Stats) {
        Err(ControlError::Refused { error, .. }) => {
            assert!(error.contains("deposed"), "{error}")
        }
        other => panic!("a request of the deposed term {term_a}: {other:?}"),
    }
    let v = client.call(&Request::Stats).expect("stats");
    assert!(
        v["engine"]["control_deposed_refused"].as_u64() >= Some(1),
        "{}",
        v["engine"]
    );

    // 3. b alive but frozen: a (back as a standby) must wait for b's lease.
    let a2 = start(
        &run,
        &run.dir.join("a2"),
        &cfg_a.replace(
            &run.dir.display().to_string(),
            &run.dir.join("a2").display().to_string(),
        ),
    );
    common::wait_for(
        "a2 waits as a standby",
        Duration::from_secs(10),
        || matches!(status(&a2.dir), Err(e) if e.contains("standby")),
    );
    b.signal(libc::SIGSTOP);
    let frozen = Instant::now();
    let (st, _) = wait_leading(&a2.dir, Duration::from_secs(10));
    let waited = frozen.elapsed();
    let term_a2 = term_of(&st);
    eprintln!(
        "b frozen: a leads again after {} ms (lease expiry), term {term_a2}",
        waited.as_millis()
    );
    assert!(term_a2 > term_b);
    assert!(
        waited >= Duration::from_millis(1000),
        "a frozen leader is no proof of death: a2 must wait for the lease ({waited:?})"
    );
    b.signal(libc::SIGCONT);
    // b finds its leadership over and stands by (its process lives on, its API says who leads).
    common::wait_for(
        "b back to standby",
        Duration::from_secs(5),
        || matches!(status(&dir_b), Err(e) if e.contains("standby") && e.contains("\"a\"")),
    );
    assert!(
        std::fs::read_to_string(dir_b.join("controller.log"))
            .unwrap_or_default()
            .contains(&format!("leadership of term {term_b} ended")),
        "{}",
        pliant_lab::log_tail(&dir_b.join("controller.log"), 10)
    );

    // 4. etcd gone for 10 s under traffic: no controller may lead (none can prove it still
    // does), the replicas forward on; when etcd returns, one leads again and acts.
    let mut etcd = etcd;
    let mut dl = run.curl(
        &f.url,
        41_100,
        &format!("{}", f.size_bytes / 8),
        "etcd-gone",
    );
    std::thread::sleep(Duration::from_millis(1000));
    etcd.kill();
    let gone = Instant::now();
    common::wait_for(
        "no controller leads without etcd",
        Duration::from_secs(5),
        || {
            [&a2.dir, &dir_b]
                .iter()
                .all(|d| matches!(status(d), Err(e) if e.contains("the store does not answer")))
        },
    );
    eprintln!(
        "etcd gone: leaders stood down after {} ms",
        gone.elapsed().as_millis()
    );
    for n in 1..=3u8 {
        let v = pliant_lab::ha::control_client(&run.lab().control_socket_of(n))
            .call(&Request::Stats)
            .expect("a replica answers while no controller leads");
        assert!(v["engine"]["rounds"].as_u64() > Some(0));
    }
    std::thread::sleep(Duration::from_secs(10).saturating_sub(gone.elapsed()));
    etcd.restart().expect("etcd back");
    let back = Instant::now();
    let leader_dir = loop {
        if let Some(d) = [&a2.dir, &dir_b]
            .into_iter()
            .find(|d| status(d).is_ok_and(|v| v["controller"]["role"] == "leader"))
        {
            break d.clone();
        }
        assert!(
            back.elapsed() < Duration::from_secs(15),
            "nobody leads after etcd returned"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    eprintln!(
        "etcd back: a controller leads after {} ms",
        back.elapsed().as_millis()
    );
    dl.finish(&f.sha256, "download across 10 s without etcd");
    let st = status(&leader_dir).expect("status");
    assert_eq!(alive(&st), 3, "{st}");
    assert!(term_of(&st) > term_a2);
    // Placement changes resume: a scale-out goes through.
    let out = controller_cli(&leader_dir, &["scale", "out", "--json"]);
    assert!(
        out.status.success(),
        "scale out after etcd returned: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(alive(&status(&leader_dir).expect("status")), 4);

    // 5. The leader dies in the middle of a scale-out (under a download): the standby leads
    // within the takeover bound and settles the half-done operation — the new replica is
    // either a live, protected member or gone — and no flow is lost.
    let (leader, standby) = if leader_dir == a2.dir {
        (a2, b)
    } else {
        (b, a2)
    };
    let mut dl = run.curl(
        &f.url,
        41_200,
        &format!("{}", f.size_bytes / 6),
        "mid-scale",
    );
    std::thread::sleep(Duration::from_millis(500));
    let mut scaling = Command::new(common::pliant())
        .args(["scale", "out", "--json", "--api"])
        .arg(leader.dir.join("api.sock"))
        .arg("--token-file")
        .arg(leader.dir.join("token"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("pliant scale out");
    std::thread::sleep(Duration::from_millis(250));
    let killed = Instant::now();
    leader.signal(libc::SIGKILL);
    let _ = scaling.wait();
    let (_, took) = wait_leading(&standby.dir, Duration::from_secs(10));
    let takeover = killed.elapsed().min(took);
    eprintln!(
        "leader killed mid-scale-out: the standby leads after {} ms",
        takeover.as_millis()
    );
    assert!(
        takeover < Duration::from_millis(1500),
        "takeover took {takeover:?}"
    );
    // Settled: every replica the new leader knows is alive and protected, whatever the
    // scale-out had reached (4 or 5 replicas).
    let settled = Instant::now();
    let st = loop {
        let st = status(&standby.dir).expect("status");
        let rs = st["replicas"].as_array().cloned().unwrap_or_default();
        let all_alive = rs.iter().all(|r| r["alive"] == true);
        let unprotected = st["ha"]["unprotected"].as_array().map_or(1, Vec::len);
        if all_alive && unprotected == 0 && (4..=5).contains(&rs.len()) {
            break st;
        }
        assert!(
            settled.elapsed() < Duration::from_secs(20),
            "the cut-short scale-out was not settled: {st}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    eprintln!(
        "scale-out cut short settled in {} ms with {} replicas",
        settled.elapsed().as_millis(),
        alive(&st)
    );
    dl.finish(&f.sha256, "download across a leader's death mid-scale-out");
    drop(leader);

    // 6. The leader dies in the middle of a migration whose destination hangs (SIGSTOPped, so
    // the move cannot finish before the kill): a new standby leads within the takeover bound
    // and settles the move — the flow ends on exactly one replica, the source or the
    // destination — the destination resumes, and the moved flow's download completes intact.
    let leader = standby;
    let dir_c = run.dir.join("c");
    let port_c = free_port();
    let cfg_c = cfg_a
        .replace(&run.dir.display().to_string(), &dir_c.display().to_string())
        .replace("name = \"a\"", "name = \"c\"")
        .replace(&format!(":{port_a}\""), &format!(":{port_c}\""));
    let standby = start(&run, &dir_c, &cfg_c);
    common::wait_for(
        "c waits as a standby",
        Duration::from_secs(10),
        || matches!(status(&dir_c), Err(e) if e.contains("standby")),
    );
    let mut dl = run.curl(
        &f.url,
        41_300,
        &format!("{}", f.size_bytes / 10),
        "mid-move",
    );
    let flows_of = |dir: &Path| -> Vec<(u64, Vec<String>)> {
        let out = controller_cli(dir, &["flows", "--json"]);
        let v: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
        v["replicas"]
            .as_array()
            .map(|rs| {
                rs.iter()
                    .filter(|r| r["alive"] == true)
                    .map(|r| {
                        let keys = r["flows"]
                            .as_array()
                            .map(|fs| {
                                fs.iter()
                                    .filter_map(|f| f["key"].as_str().map(String::from))
                                    .collect()
                            })
                            .unwrap_or_default();
                        (r["replica"].as_u64().unwrap_or(0), keys)
                    })
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut found = None;
    common::wait_for(
        "the download's flow on a replica",
        Duration::from_secs(10),
        || {
            found = flows_of(&leader.dir).into_iter().find_map(|(r, keys)| {
                keys.into_iter()
                    .find(|k| k.contains(":41300 "))
                    .map(|k| (r, k))
            });
            found.is_some()
        },
    );
    let (from, key) = found.expect("flow found");
    let to = (1..=3u8)
        .find(|n| u64::from(*n) != from)
        .expect("a destination");
    let to_pid = run.lab().replica_pid(to).expect("destination's PID");
    run.stopped.push(to_pid);
    std::thread::sleep(Duration::from_millis(700));
    // SAFETY: a replica process of this test's own lab, by PID.
    unsafe { libc::kill(to_pid, libc::SIGSTOP) };
    let mut moving = Command::new(common::pliant())
        .args([
            "migrate",
            "--json",
            "--flow",
            &key,
            "--to",
            &format!("r{to}"),
        ])
        .arg("--api")
        .arg(leader.dir.join("api.sock"))
        .arg("--token-file")
        .arg(leader.dir.join("token"))
        .stdout(std::fs::File::create(run.dir.join("migrate.out")).expect("file"))
        .stderr(std::fs::File::create(run.dir.join("migrate.err")).expect("file"))
        .spawn()
        .expect("pliant migrate");
    // The kill must come while the move runs: once its intent is in etcd (written before the
    // destination is asked anything), not while the request is still being looked up.
    let intent_key = format!("/pliant/e2e-{}/intent/migration", std::process::id());
    let spawned = Instant::now();
    loop {
        let out = Command::new("etcdctl")
            .args([
                "--endpoints",
                &etcd.spec.client_url(),
                "--command-timeout",
                "1s",
            ])
            .arg(format!("--cacert={}", pki.ca.display()))
            .arg(format!("--cert={}", pki.client_cert.display()))
            .arg(format!("--key={}", pki.client_key.display()))
            .args(["get", "--print-value-only", &intent_key])
            .output()
            .expect("etcdctl");
        if !out.stdout.is_empty() {
            break;
        }
        assert!(
            matches!(moving.try_wait(), Ok(None)) && spawned.elapsed() < Duration::from_secs(10),
            "the move's intent never appeared in etcd ({:?}): {} {}",
            spawned.elapsed(),
            std::fs::read_to_string(run.dir.join("migrate.out")).unwrap_or_default(),
            std::fs::read_to_string(run.dir.join("migrate.err")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    eprintln!(
        "the move's intent is in etcd {} ms after the request",
        spawned.elapsed().as_millis()
    );
    let killed = Instant::now();
    leader.signal(libc::SIGKILL);
    let _ = moving.wait();
    let (_, took) = wait_leading(&dir_c, Duration::from_secs(10));
    let takeover = killed.elapsed().min(took);
    // SAFETY: as above.
    unsafe { libc::kill(to_pid, libc::SIGCONT) };
    eprintln!(
        "leader killed mid-migration (r{from} -> r{to}, r{to} hung): c leads after {} ms",
        takeover.as_millis()
    );
    assert!(
        takeover < Duration::from_millis(1500),
        "takeover took {takeover:?}"
    );
    // Settled: every replica alive and protected, and the move's intent (left in the store
    // by the dead leader: the move was under way) resolved by the new leader. The flow has at
    // most one owner all along, its source or its destination (none once the download ended).
    let settled = Instant::now();
    let log_c = dir_c.join("controller.log");
    loop {
        let st = status(&dir_c).expect("status");
        let rs = st["replicas"].as_array().cloned().unwrap_or_default();
        let all_alive = rs.iter().all(|r| r["alive"] == true);
        let unprotected = st["ha"]["unprotected"].as_array().map_or(1, Vec::len);
        let owners: Vec<u64> = flows_of(&dir_c)
            .into_iter()
            .filter(|(_, keys)| keys.contains(&key))
            .map(|(r, _)| r)
            .collect();
        assert!(
            owners.len() <= 1 && owners.iter().all(|o| *o == from || *o == u64::from(to)),
            "the flow's owners: {owners:?} (from r{from}, to r{to})"
        );
        let log = std::fs::read_to_string(&log_c).unwrap_or_default();
        let resolved = log
            .lines()
            .find(|l| l.contains("intent_resolved"))
            .map(String::from);
        if all_alive && unprotected == 0 {
            if let Some(r) = resolved {
                assert!(
                    (r.contains("rolled_back") || r.contains("completed"))
                        && r.contains(&format!("\"from\":{from}"))
                        && r.contains(&format!("\"to\":{to}")),
                    "{r}"
                );
                eprintln!(
                    "migration cut short settled in {} ms (flow on {owners:?}): {r}",
                    settled.elapsed().as_millis()
                );
                break;
            }
        }
        assert!(
            settled.elapsed() < Duration::from_secs(20),
            "the cut-short migration was not settled: {st}\n{}",
            pliant_lab::log_tail(&log_c, 20)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    dl.finish(&f.sha256, "download across a leader's death mid-migration");
    drop(leader);
    drop(standby);
    drop(etcd);
}
