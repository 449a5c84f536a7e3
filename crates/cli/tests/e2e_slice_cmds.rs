//! `pliant slice serve | list | stats | migrate` for real: two `pliant slice serve` processes
//! (one with its control channel on a unix socket, one on TCP), streaming clients speaking the
//! demo line protocol, sessions listed and moved through the authenticated control channel.
//! Identities come from `pliant keys`.
//!
//! Needs root (a private network namespace, TCP_REPAIR, tc-BPF). Everything runs in a network
//! namespace this test creates for its thread (unshare): the servers, the clients and the
//! commands, so nothing reaches the host's network and the namespace goes with the test.
//! `cargo test --release -p pliant-cli --test e2e_slice_cmds -- --nocapture`.

use pliant_slice::demo::parse_ready;
use pliant_slice::load::{net_counter, IdleSessions, StreamClient};
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn pliant() -> &'static str {
    env!("CARGO_BIN_EXE_pliant")
}

/// A `pliant slice serve` process, stopped (SIGTERM, then SIGKILL, by its own pid) and reaped
/// when dropped, also when the test fails.
struct Server {
    child: Child,
    /// Kept open: the server may print more.
    stdout: BufReader<std::process::ChildStdout>,
    clients: String,
    peer: String,
    control: String,
}

impl Server {
    fn start(dir: &Path, name: &str, control: &str) -> Server {
        let mut child = Command::new(pliant())
            .args(["slice", "serve", "--name", name, "--identity"])
            .arg(dir.join(name))
            .args(["--control", control])
            .stdout(Stdio::piped())
            .spawn()
            .expect("run pliant slice serve");
        let out = BufReader::new(child.stdout.take().expect("stdout"));
        // Built first: a failure below still stops the process.
        let mut s = Server {
            child,
            stdout: out,
            clients: String::new(),
            peer: String::new(),
            control: String::new(),
        };
        let mut ready = String::new();
        let read = s.stdout.read_line(&mut ready);
        assert!(
            matches!(read, Ok(n) if n > 0),
            "{name}: no ready line ({read:?})"
        );
        let r = parse_ready(&ready).unwrap_or_else(|| panic!("{name}: {ready:?}"));
        s.clients = r.clients;
        s.peer = r.peer;
        s.control = r.control.unwrap_or_else(|| panic!("control= in {ready:?}"));
        s
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let pid = self.child.id() as libc::pid_t;
        // SAFETY: signals our own child, which is not reaped yet (the pid is still its).
        unsafe { libc::kill(pid, libc::SIGTERM) };
        let end = Instant::now() + Duration::from_secs(5);
        while Instant::now() < end {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A new network namespace for the calling thread (and what it starts), loopback up.
fn private_netns() {
    // SAFETY: unshare(CLONE_NEWNET) affects only the calling thread.
    let r = unsafe { libc::unshare(libc::CLONE_NEWNET) };
    assert_eq!(r, 0, "unshare: {}", std::io::Error::last_os_error());
    let st = Command::new("ip")
        .args(["link", "set", "lo", "up"])
        .status()
        .expect("run ip");
    assert!(st.success(), "ip link set lo up");
}

fn run(args: &[&str]) -> Output {
    let t = Instant::now();
    let out = Command::new(pliant())
        .args(args)
        .output()
        .expect("run pliant");
    eprintln!(
        "pliant {} -> {} in {:?}",
        args.join(" "),
        out.status,
        t.elapsed()
    );
    if !out.status.success() {
        eprintln!("  {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    out
}

fn ok_json(args: &[&str]) -> Value {
    let out = run(args);
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "pliant {args:?}: {se}");
    serde_json::from_str(so.trim()).unwrap_or_else(|e| panic!("{e}: {so}"))
}

fn keys(dir: &Path, name: &str, role: &str) {
    let out = run(&[
        "keys",
        "issue",
        "--ca",
        dir.to_str().unwrap(),
        "--name",
        name,
        "--role",
        role,
        "--out",
        dir.join(name).to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{out:?}");
}

/// `pliant slice CMD --instance CONTROL --identity ID REST...`.
fn slice(cmd: &str, control: &str, id: &str, rest: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = ["slice", cmd, "--instance", control, "--identity", id]
        .iter()
        .map(|s| s.to_string())
        .collect();
    v.extend(rest.iter().map(|s| s.to_string()));
    v
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// The session ids `pliant slice list --json` shows on `control`, with their clients.
fn list(control: &str, op: &str) -> Vec<(String, String)> {
    let v = ok_json(&strs(&slice("list", control, op, &["--json"])));
    v["sessions"]
        .as_array()
        .unwrap_or_else(|| panic!("sessions in {v}"))
        .iter()
        .map(|s| {
            (
                s["id"].as_str().unwrap().to_string(),
                s["client"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect()
}

/// Idle sessions drained in the last step.
const IDLE: usize = 400;

/// A child killed (by its own pid) and reaped when dropped, also when the test fails.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Every client gets 50 more replies (its session is served, wherever it is now).
fn all_progress(clients: &[StreamClient]) {
    for c in clients {
        assert!(
            c.progresses(50, Duration::from_secs(10)),
            "a client stalled"
        );
    }
}

#[test]
fn slice_commands_list_and_migrate_live_sessions_over_the_control_channel() {
    if !pliant_testkit::require_root() {
        return;
    }
    let started = Instant::now();
    private_netns();
    let dir = pliant_testkit::TempDir::new("pliant-slice-cmds");
    let d = dir.path();
    let out = run(&["keys", "ca", "--dir", d.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    keys(d, "slice-a", "replica");
    keys(d, "slice-b", "replica");
    keys(d, "op", "admin");
    keys(d, "intruder", "replica");
    let op = d.join("op");
    let op = op.to_str().unwrap();
    let a_ctl = d.join("a.ctl");
    let a = Server::start(d, "slice-a", a_ctl.to_str().unwrap());
    let b = Server::start(d, "slice-b", "127.0.0.1:0");
    assert!(a.control.starts_with("unix:"), "{}", a.control);
    assert!(b.control.starts_with("tcp:"), "{}", b.control);

    // `pliant slice migrate` from A to B.
    let to_b = |rest: &[&str]| {
        let mut v = slice("migrate", &a.control, op, &["--to", &b.peer, "--to-name"]);
        v.push("slice-b".into());
        v.extend(rest.iter().map(|s| s.to_string()));
        v
    };
    let clients: Vec<StreamClient> = (0..3)
        .map(|c| StreamClient::start(&a.clients, c, 0, 200).expect("client"))
        .collect();
    all_progress(&clients);
    let listed = list(&a.control, op);
    assert_eq!(listed.len(), 3, "{listed:?}");
    let mut addrs: Vec<String> = listed.iter().map(|s| s.1.clone()).collect();
    let mut want: Vec<String> = clients.iter().map(|c| c.local.to_string()).collect();
    addrs.sort();
    want.sort();
    assert_eq!(addrs, want, "list shows the clients' addresses");
    assert!(list(&b.control, op).is_empty());

    // One session by id.
    let first = &listed[0].0;
    let m = ok_json(&strs(&to_b(&["--session", first, "--json"])));
    assert_eq!(m["moved"], 1, "{m}");
    assert_eq!(m["failed"], 0, "{m}");
    assert_eq!(m["sessions"][0]["id"], first.as_str(), "{m}");
    assert!(m["sessions"][0]["pause_us"].as_u64().unwrap() > 0, "{m}");
    assert!(
        m["sessions"][0]["capsule_bytes"].as_u64().unwrap() > 0,
        "{m}"
    );
    assert!(m["pause_us_p50"].as_u64().is_some(), "{m}");
    let on_b = list(&b.control, op);
    assert_eq!(on_b.len(), 1);
    assert_eq!(&on_b[0].0, first);
    assert_eq!(list(&a.control, op).len(), 2);
    all_progress(&clients);

    // An unknown id (next to a known one) is an error naming it; nothing moves.
    let known = &listed[1].0;
    let out = run(&strs(&to_b(&["--session", known, "deadbeef"])));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("no session deadbeef") && err.contains("nothing was moved"),
        "{err}"
    );
    assert_eq!(list(&a.control, op).len(), 2, "the known session stayed");

    // A non-admin identity of the same CA is refused, saying why.
    let intruder = d.join("intruder");
    let out = run(&strs(&slice(
        "list",
        &b.control,
        intruder.to_str().unwrap(),
        &[],
    )));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("refused this identity") && err.contains("admin or controller"),
        "{err}"
    );
    assert!(out.stdout.is_empty());

    // Unreachable instance.
    let gone = d.join("nothing.ctl");
    let out = run(&strs(&slice("stats", gone.to_str().unwrap(), op, &[])));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("cannot reach"), "{err}");

    // The rest: all.
    let out = run(&strs(&to_b(&["--all"])));
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{se}");
    assert_eq!(
        so.lines().filter(|l| l.starts_with("moved ")).count(),
        2,
        "{so}"
    );
    assert!(so.contains("done: moved 2, failed 0, pause p50"), "{so}");
    assert!(list(&a.control, op).is_empty());
    assert_eq!(list(&b.control, op).len(), 3);
    all_progress(&clients);

    let sb = ok_json(&strs(&slice("stats", &b.control, op, &["--json"])));
    assert_eq!(sb["moved_in"], 3, "{sb}");
    assert_eq!(sb["sessions"], 3, "{sb}");
    assert_eq!(sb["session_errors"], 0, "{sb}");
    assert!(sb["refused_controls"].as_u64().unwrap() >= 1, "{sb}");
    let sa = ok_json(&strs(&slice("stats", &a.control, op, &["--json"])));
    assert_eq!(sa["moved_out"], 3, "{sa}");
    assert_eq!(sa["session_errors"], 0, "{sa}");

    // A longer drain back, B -> A: the 3 streams and 400 idle sessions, one at a time; `list`
    // on another connection is answered meanwhile, showing the drain half done.
    let mut idle =
        IdleSessions::connect(&b.clients, IDLE, Duration::from_secs(10)).expect("idle sessions");
    idle.round()
        .expect("idle sessions answered before the drain");
    let t = Instant::now();
    while list(&b.control, op).len() < IDLE + 3 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "idle sessions listed"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let drain_args = slice(
        "migrate",
        &b.control,
        op,
        &["--to", &a.peer, "--to-name", "slice-a", "--all", "--json"],
    );
    let t = Instant::now();
    let mut drain = Reaped(
        Command::new(pliant())
            .args(&drain_args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run pliant slice migrate"),
    );
    let mut lists = Vec::new();
    while drain.0.try_wait().expect("drain status").is_none() {
        let l = Instant::now();
        let n = list(&b.control, op).len();
        lists.push((l.elapsed(), n));
    }
    let drain_took = t.elapsed();
    let out = std::mem::replace(&mut drain.0, Command::new("true").spawn().expect("true"))
        .wait_with_output()
        .expect("drain output");
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    eprintln!(
        "drain of {} in {drain_took:?}; lists meanwhile {lists:?}",
        IDLE + 3
    );
    assert!(out.status.success(), "{se}");
    let d: Value = serde_json::from_str(so.trim()).unwrap_or_else(|e| panic!("{e}: {so}"));
    assert_eq!(d["moved"], IDLE as u64 + 3, "{d}");
    assert_eq!(d["failed"], 0, "{d}");
    assert!(
        lists.iter().any(|(_, n)| 0 < *n && *n < IDLE + 3),
        "a list answered in the middle of the drain: {lists:?}"
    );
    assert!(
        lists.iter().all(|(took, _)| *took < Duration::from_secs(5)),
        "{lists:?}"
    );
    if drain_took > Duration::from_millis(1500) {
        assert!(
            se.contains(&format!("/{} done", IDLE + 3)),
            "progress: {se}"
        );
    }
    assert!(list(&b.control, op).is_empty());
    idle.round()
        .expect("idle sessions answered after the drain");
    assert_eq!(idle.corrupted_bytes(), 0);
    all_progress(&clients);

    for c in clients {
        let o = c.finish();
        assert_eq!(o.error, None, "stream");
        assert_eq!(o.corrupted_bytes, 0);
        assert!(o.lines > 150, "{o:?}");
    }
    assert_eq!(net_counter("snmp", "Tcp:", "OutRsts"), Some(0), "no reset");
    drop((a, b));
    eprintln!("took {:?}", started.elapsed());
}
