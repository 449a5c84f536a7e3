//! Replicas on hosts with agents: a TCP lab whose every replica namespace is a host (its own
//! network and mount namespace, private `/run`) running `pliant agent`, which starts the
//! host's replica; the controller lists the agents (`[hosts]`) and reaches everything over the
//! management network with identities.
//!
//! 1. Whole-host loss mid-transfer: downloads and an iperf3 stream through r1, checkpointed to
//!    backups on other hosts; host 1's links cut, then its replica and its agent SIGKILLed.
//!    The controller declares host h1 dead, fails r1 over; every connection completes with the
//!    served sha256, the server sees the same peers, no output left before its checkpoint
//!    was acknowledged (audit). Recovery printed (detect and kill -> steered).
//! 2. Process death on a live host: r2's process SIGKILLed (its host and agent alive); the
//!    agent's report ("killed by signal 9") is an event, r2 fails over, and the controller
//!    keeps host h2 `up` — a process death is not a host death.
//!
//! Needs root. `cargo test --release -p pliant-cli --test e2e_hosts -- --nocapture`.

mod common;
use common::ha::*;
use pliant_lab::PliantNf;
use serde_json::Value;
use std::collections::BTreeSet;
use std::time::Duration;

fn host<'a>(st: &'a Value, name: &str) -> &'a Value {
    st["hosts"]
        .as_array()
        .and_then(|a| a.iter().find(|h| h["name"] == name))
        .unwrap_or_else(|| panic!("no host {name}: {st}"))
}

fn wait_host_state(run: &HaRun, name: &str, state: &str) -> Value {
    let t = std::time::Instant::now();
    loop {
        let st = run.cli(&["status"]);
        if host(&st, name)["state"] == state {
            return st;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "host {name} not {state}: {}",
            st["hosts"]
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A TCP NAT lab of three hosts with agents (one replica each, HA on, no automatic scaling)
/// serving `file`; `None` when the test cannot run here.
fn three_hosts(tag: &str, file: (&str, u64), links: Tunnels) -> Option<HaRun> {
    let hosts = pliant_lab::agents::hosts_section(3, 20, 400);
    ha_up_spec(
        tag,
        PliantNf::nat(),
        &[file],
        pliant_lab::mgmt::Transport::Tcp,
        Some(links),
        "auto = false\nmax_replicas = 60\n",
        "",
        &hosts,
    )
}

#[test]
fn a_whole_host_lost_mid_transfer_keeps_every_connection_and_a_process_death_is_not_a_host_death() {
    let Some(mut run) = three_hosts("hosts", ("32M.bin", 32 << 20), Tunnels::Veth) else {
        return;
    };
    // Every host up, each agent running its replica, under the controller's term.
    let st = wait_host_state(&run, "h3", "up");
    // The controller steers through the fabric host's agent (the tc-BPF maps live there).
    let steer = &st["steering"];
    assert_eq!(steer["agent"], "fabric", "{steer}");
    assert_eq!(steer["backend"], "tc-bpf", "{steer}");
    let fab: pliant_proto::agent::AgentStatus =
        pliant_lab::agents::fabric_client(&run.lab().state().run_dir)
            .ask(&pliant_proto::AgentRequest::AgentStatus)
            .expect("the fabric agent answers");
    let f = fab.fabric.expect("it holds the fabric");
    assert_eq!(f["attached"], true, "{f}");
    assert!(f["ops"].as_u64() > Some(3), "{f}");
    for n in 1..=3 {
        let h = host(&st, &format!("h{n}"));
        assert_eq!(h["state"], "up", "{h}");
        let slots = h["replicas"].as_array().expect("slots");
        assert_eq!(slots.len(), 1, "{h}");
        assert_eq!(slots[0]["replica"], format!("r{n}"));
        assert_eq!(slots[0]["state"], "running", "{h}");
    }

    // 1. Whole-host loss under load.
    let f = run.lab().served_file("32M.bin").expect("file").clone();
    let mut next = 40_000u16;
    let web = run.sports_for(1, 80, 3, &mut next);
    let perf = run.sports_for(1, 5201, 1, &mut next)[0];
    let rate = format!("{}", f.size_bytes / 10);
    let mut dls: Vec<Download> = web
        .iter()
        .enumerate()
        .map(|(i, p)| run.curl(&f.url, *p, &rate, &format!("h{i}")))
        .collect();
    let mut perf3 = run.iperf3(perf, 10, "50M");
    common::wait_for(
        "r1's connections checkpointed to backups on other hosts",
        Duration::from_secs(15),
        || standby_flows(&run, 1) >= 4,
    );
    std::thread::sleep(Duration::from_millis(1000));
    let web_before = run.server_peer_ports(80);
    let perf_before = run.server_peer_ports(5201);
    assert_eq!(web_before.len(), 3, "{web_before:?}");
    let killed = run.kill_host(1);
    let rec = run.wait_failover(1, killed.unix_ms, Duration::from_secs(10));
    let st = wait_host_state(&run, "h1", "dead");
    eprintln!("host h1: {}", host(&st, "h1"));
    // People see it too: `pliant status` warns of the dead host, the metrics count it.
    let text = controller_cli(&run.dir, &["status"]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("WARNING: host h1 dead"), "{text}");
    assert!(text.contains("host h2 up"), "{text}");
    eprintln!("failover record: {rec}");
    let detect_ms = rec["detected_unix_ms"].as_f64().unwrap_or(f64::NAN) - killed.unix_ms;
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        run.server_peer_ports(80),
        web_before,
        "HTTP connections/mappings changed by the host's loss"
    );
    let perf_after = run.server_peer_ports(5201);
    assert!(
        perf_before.is_subset(&perf_after),
        "{perf_before:?} -> {perf_after:?}"
    );
    for d in dls.iter_mut() {
        d.finish(&f.sha256, "after the host's loss");
    }
    perf3.finish("after the host's loss");
    let log = run.lab().access_log().expect("access log");
    let req = "GET /32M.bin HTTP/1.1";
    let ports: BTreeSet<u16> = log
        .iter()
        .filter(|e| e.request == req && e.status == 200 && e.body_bytes == f.size_bytes)
        .map(|e| e.remote_port)
        .collect();
    assert_eq!(ports, web_before, "nginx saw other peers: {log:?}");
    let (checked, violations, per) = run.audit();
    assert_eq!(
        violations, 0,
        "output before its checkpoint was acked: {per:?}"
    );
    assert!(checked > 0, "{per:?}");
    eprintln!(
        "host death: kill -> detected {detect_ms:.0} ms ({}), then failed over in {} ms",
        rec["evidence"], rec["failover_ms"]
    );

    // 2. A process death on a live host: the agent's report, not a host death.
    let killed = run.kill(2);
    let rec = run.wait_failover(2, killed.unix_ms, Duration::from_secs(10));
    let detect_ms = rec["detected_unix_ms"].as_f64().unwrap_or(f64::NAN) - killed.unix_ms;
    let t = std::time::Instant::now();
    let st = loop {
        let st = run.cli(&["status"]);
        let reported = st["events"].as_array().is_some_and(|e| {
            e.iter().any(|e| {
                e["event"] == "process_died"
                    && e["detail"]["evidence"]
                        .as_str()
                        .is_some_and(|w| w.contains("host h2: killed by signal 9"))
            })
        });
        if reported {
            break st;
        }
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "no process_died report from h2's agent: {}",
            st["events"]
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let h2 = host(&st, "h2");
    assert_eq!(
        h2["state"], "up",
        "a process death is not a host death: {h2}"
    );
    let slot = &h2["replicas"][0];
    assert_eq!(slot["state"], "died", "{slot}");
    assert_eq!(slot["exit"], "killed by signal 9", "{slot}");
    assert_eq!(host(&st, "h1")["state"], "dead");
    assert_eq!(host(&st, "h3")["state"], "up");
    eprintln!(
        "process death: kill -> detected {detect_ms:.0} ms ({}), then failed over in {} ms",
        rec["evidence"], rec["failover_ms"]
    );
}

/// The controller's event `kind` about replica `n` (its `replica` detail), once it appears.
fn wait_event(run: &HaRun, kind: &str, n: u32, limit: Duration) -> Value {
    let t = std::time::Instant::now();
    loop {
        let st = run.cli(&["status"]);
        let found = st["events"].as_array().and_then(|e| {
            e.iter()
                .find(|e| e["event"] == kind && e["detail"]["replica"] == n)
                .cloned()
        });
        if let Some(e) = found {
            return e;
        }
        assert!(
            t.elapsed() < limit,
            "no {kind} event for r{n} in {limit:?}: {}\ncontroller log: {}",
            st["events"],
            run.log_tail()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Backups named in replica `i`'s groups.
fn backups_of(run: &HaRun, i: u32) -> Vec<String> {
    ha_status(&run.lab().control_socket_of(i as u8))
        .map(|v| {
            v["groups"]
                .as_array()
                .map(Vec::as_slice)
                .unwrap_or(&[])
                .iter()
                .filter_map(|g| g["backup"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// A partition, in a lab whose hosts reach the fabric through VXLAN tunnels over their one
/// management link: host h1's links go down with every process on it alive. The controller
/// declares the host dead and fails r1 over (its downloads continue on their backups on
/// other hosts, byte-exact, same peers at the server, each served once); r1 keeps running,
/// cut off. Its links return while its agent is stopped (the host still looks dead): frames
/// from r1's ports are dropped by the fabric's fence. Once the agent answers, r1 — the same
/// process — rejoins: it drops everything it held (the flows that failed over and the output it held for them; the fabric fenced it
/// until then), is unfenced, protected again, serves a new download and is a backup of the
/// other replicas; the output audit stays clean.
#[test]
fn a_partitioned_host_fails_over_and_its_replica_rejoins_as_a_backup_without_a_restart() {
    let Some(mut run) = three_hosts("hostsp", ("16M.bin", 16 << 20), Tunnels::Vxlan) else {
        return;
    };
    wait_host_state(&run, "h3", "up");
    let f = run.lab().served_file("16M.bin").expect("file").clone();
    let mut next = 41_000u16;
    let web = run.sports_for(1, 80, 3, &mut next);
    let rate = format!("{}", f.size_bytes / 8);
    let mut dls: Vec<Download> = web
        .iter()
        .enumerate()
        .map(|(i, p)| run.curl(&f.url, *p, &rate, &format!("p{i}")))
        .collect();
    common::wait_for(
        "r1's connections checkpointed to backups on other hosts",
        Duration::from_secs(15),
        || standby_flows(&run, 1) >= 3,
    );
    std::thread::sleep(Duration::from_millis(500));
    let web_before = run.server_peer_ports(80);
    assert_eq!(web_before.len(), 3, "{web_before:?}");
    let pid = run.replica_pid(1);

    // The partition.
    let cut_ms = unix_ms();
    pliant_lab::agents::set_host_links(run.lab(), 1, false).expect("cut h1's links");
    let rec = run.wait_failover(1, cut_ms, Duration::from_secs(10));
    wait_host_state(&run, "h1", "dead");
    eprintln!("failover of the cut-off r1: {rec}");
    // SAFETY: signal 0 only checks that the process (this lab's replica) exists.
    assert_eq!(unsafe { libc::kill(pid, 0) }, 0, "r1 must still run");
    std::thread::sleep(Duration::from_millis(500));

    // The links return while h1's agent is stopped (so the host still looks dead and r1
    // stays failed over): r1 is fenced, and what its ports emit never leaves the fabric.
    let agent = pliant_lab::agents::agent_pid(run.lab(), 1).expect("h1's agent");
    // SAFETY: SIGSTOP/SIGCONT to the agent process this test's lab started, by its PID.
    assert_eq!(unsafe { libc::kill(agent, libc::SIGSTOP) }, 0);
    pliant_lab::agents::set_host_links(run.lab(), 1, true).expect("restore h1's links");
    let fenced_before = run.steer_counter("drop_fenced");
    let since = std::time::Instant::now();
    let fenced = loop {
        emit_from_replica(&run, 1, 5);
        std::thread::sleep(Duration::from_millis(300));
        let fenced = run.steer_counter("drop_fenced") - fenced_before;
        // Right after the links return, the tunnel's underlay may still be resolving its
        // neighbour and lose the first frames before they reach the fabric (a fresh-clone run
        // counted 0 of 5 at 300 ms): emit again until frames arrive, bounded.
        if fenced >= 5 || since.elapsed() > Duration::from_secs(5) {
            break fenced;
        }
    };
    assert!(
        fenced >= 5,
        "the cut-off r1's frames left the fabric ({fenced} dropped)"
    );
    assert_eq!(host(&run.cli(&["status"]), "h1")["state"], "dead");
    // The agent answers again: r1 rejoins, the same process.
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(agent, libc::SIGCONT) }, 0);
    let ev = wait_event(&run, "rejoined", 1, Duration::from_secs(10));
    eprintln!("rejoin: {ev}");
    assert_eq!(run.replica_pid(1), pid, "rejoined without a restart");
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, 0) }, 0);
    let dropped = &ev["detail"]["dropped"];
    assert!(
        dropped["flows_dropped"].as_u64().unwrap_or(0) >= 3,
        "r1 dropped the flows that failed over: {dropped}"
    );
    let st = wait_host_state(&run, "h1", "up");
    assert!(run.members().contains(&1), "r1 is a member again: {st}");

    // The downloads that failed over finish where they went, byte-exact; the server saw the
    // same peers and served each once.
    for d in dls.iter_mut() {
        d.finish(&f.sha256, "after the partition and the rejoin");
    }
    let log = run.lab().access_log().expect("access log");
    let served: Vec<u16> = log
        .iter()
        .filter(|e| e.request == "GET /16M.bin HTTP/1.1")
        .map(|e| e.remote_port)
        .collect();
    let mut unique = served.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(
        unique.len(),
        served.len(),
        "a download was served twice: {log:?}"
    );
    assert_eq!(
        unique.into_iter().collect::<BTreeSet<u16>>(),
        web_before,
        "nginx saw other peers: {log:?}"
    );
    let full = log
        .iter()
        .filter(|e| e.status == 200 && e.body_bytes == f.size_bytes)
        .count();
    assert_eq!(full, 3, "{log:?}");

    // A member again: protected, a backup of the others, and it serves new flows.
    run.wait_protected(Duration::from_secs(10));
    common::wait_for(
        "r1 named as a backup by another replica",
        Duration::from_secs(10),
        || (2..=3).any(|i| backups_of(&run, i).iter().any(|b| b == "r1")),
    );
    let fresh = run.sports_for(1, 80, 1, &mut next);
    let mut d = run.curl(&f.url, fresh[0], &format!("{}", f.size_bytes * 4), "after");
    d.finish(&f.sha256, "a new download through the rejoined r1");
    let (checked, violations, per) = run.audit();
    assert_eq!(
        violations, 0,
        "output before its checkpoint was acked: {per:?}"
    );
    assert!(checked > 0, "{per:?}");
}

/// 3. The control plane on hosts of its own (`LabSpec::controllers`): etcd in its own
///    namespace, two controllers each on a host with nothing but the management network and a
///    private view of the run directory, steering through the fabric host's agent. The
///    leader's host is lost as a whole mid-download (link cut, controller SIGKILLed): the
///    standby leads once the lease expires, the download (which never needed a controller)
///    completes, and the new leader then fails a replica host over — a controller on another
///    host than the fabric, the replicas and etcd doing all of it.
#[test]
fn controllers_on_hosts_of_their_own_survive_the_leaders_host_and_fail_a_replica_host_over() {
    if !pliant_testkit::require_root()
        || !pliant_testkit::require_tool("etcd", "etcd-server")
        || !pliant_testkit::require_tool("etcdctl", "etcd-client")
    {
        return;
    }
    use pliant_lab::control;
    let mut spec = pliant_lab::LabSpec::new(pliant_lab::ReplicaMode::Pliant {
        config: PliantNf::nat(),
    });
    spec.pliant_bin = Some(std::path::PathBuf::from(common::pliant()));
    spec.disable_offloads = true;
    spec.replicas = 3;
    spec.ha = true;
    spec.transport = pliant_lab::mgmt::Transport::Tcp;
    spec.agents = true;
    spec.controllers = 2;
    spec.spare_hosts = 1;
    spec = spec.with_file("16M.bin", 16 << 20);
    let lab = pliant_lab::Lab::up(spec).unwrap_or_else(|e| panic!("lab up: {e}"));
    let run_dir = lab.state().run_dir.clone();
    let first = control::leader(&run_dir, 2).expect("a leader after lab up");
    let other = 3 - first;
    let mut run = HaRun {
        dir: control::dir(&run_dir, &control::controller_host(first)),
        controller: None,
        lab: Some(lab),
        procs: Vec::new(),
        stopped: Vec::new(),
        nat: true,
    };
    run.wait_protected(Duration::from_secs(20));
    let st = run.cli(&["status"]);
    assert_eq!(
        st["controller"]["name"],
        control::controller_host(first),
        "{st}"
    );
    assert_eq!(st["store"]["backend"], "etcd", "{st}");
    assert_eq!(st["store"]["ok"], true, "{st}");
    assert_eq!(st["steering"]["agent"], "fabric", "{st}");
    for n in 1..=3 {
        assert_eq!(host(&st, &format!("h{n}"))["state"], "up", "{st}");
    }
    // A controller's host holds only its own files: no replica's socket, key or config, no
    // etcd server key, nothing of the other controller.
    let mine = control::dir(&run_dir, &control::controller_host(first));
    let names: BTreeSet<String> = std::fs::read_dir(&mine)
        .expect("controller host dir")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .collect();
    for n in ["ctl.toml", "id", "etcd", "api.sock", "token"] {
        assert!(names.contains(n), "{n} missing from {names:?}");
    }
    assert!(
        names.iter().all(|n| !n.starts_with('r') && n != "hosts"),
        "{names:?}"
    );

    // 1. The leader's host is lost mid-download.
    let f = run.lab().served_file("16M.bin").expect("file").clone();
    let mut next = 42_000u16;
    let sports = run.sports_for(1, 80, 2, &mut next);
    let rate = format!("{}", f.size_bytes / 8);
    let mut dls: Vec<Download> = sports
        .iter()
        .enumerate()
        .map(|(i, p)| run.curl(&f.url, *p, &rate, &format!("c{i}")))
        .collect();
    common::wait_for(
        "r1's downloads checkpointed to backups on other hosts",
        Duration::from_secs(15),
        || standby_flows(&run, 1) >= 2,
    );
    let mut cut = std::time::Instant::now();
    let what =
        control::kill_controller_host(run.lab(), first, &mut || cut = std::time::Instant::now())
            .expect("kill the leader's host");
    eprintln!("{what}");
    let took = loop {
        if control::leader(&run_dir, 2) == Some(other) {
            break cut.elapsed();
        }
        assert!(
            cut.elapsed() < Duration::from_secs(10),
            "c{other} did not take over: {:?}",
            control::api_status(&run_dir, other)
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    eprintln!(
        "leader c{first}'s host lost: c{other} leads after {} ms (the lease's TTL: its host \
         went silent, nothing refused)",
        took.as_millis()
    );
    run.dir = control::dir(&run_dir, &control::controller_host(other));
    let st = run.cli(&["status"]);
    assert_eq!(
        st["controller"]["name"],
        control::controller_host(other),
        "{st}"
    );
    let fab: pliant_proto::agent::AgentStatus = pliant_lab::agents::fabric_client(&run_dir)
        .ask(&pliant_proto::AgentRequest::AgentStatus)
        .expect("the fabric agent answers");
    assert!(
        fab.term >= st["controller"]["term"].as_u64().unwrap_or(u64::MAX),
        "the fabric follows the new leader's term: {fab:?} / {}",
        st["controller"]
    );

    // 2. The new leader fails a replica host over (through the fabric agent's steering).
    let killed = run.kill_host(1);
    let rec = run.wait_failover(1, killed.unix_ms, Duration::from_secs(10));
    eprintln!(
        "host h1 lost under c{other}: detected by {} , failed over in {} ms",
        rec["evidence"], rec["failover_ms"]
    );
    for d in dls.iter_mut() {
        d.finish(
            &f.sha256,
            "across the leader's host loss and r1's host loss",
        );
    }

    // 3. Back to three replicas on the spare host: the new leader scales out, the only stopped
    //    slot on a host that runs none is r4 on h4; r4 joins the ring, is protected, serves.
    let st = run.cli(&["status"]);
    assert_eq!(host(&st, "h4")["state"], "up", "{st}");
    let out = controller_cli(&run.dir, &["scale", "out", "--json"]);
    assert!(
        out.status.success(),
        "scale out onto the spare host: {} {}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let t = std::time::Instant::now();
    loop {
        let st = run.cli(&["status"]);
        let h4 = host(&st, "h4");
        let alive = st["replicas"]
            .as_array()
            .is_some_and(|rs| rs.iter().any(|r| r["name"] == "r4" && r["alive"] == true));
        if alive && h4["replicas"][0]["state"] == "running" {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "r4 not running on the spare host: {st}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let ha = run.wait_protected(Duration::from_secs(20));
    let members = run.members();
    assert_eq!(members, vec![2, 3, 4], "{ha}");
    eprintln!(
        "after the scale-out onto h4: members {members:?}, unprotected {}",
        ha["summary"]["unprotected"]
    );
    let mut dl = run.curl(&f.url, next, &format!("{}", f.size_bytes * 4), "spare");
    dl.finish(
        &f.sha256,
        "a new download after the scale-out onto the spare host",
    );
    let (checked, violations, per) = run.audit();
    assert_eq!(
        violations, 0,
        "output before its checkpoint was acked: {per:?}"
    );
    assert!(checked > 0, "{per:?}");
}
