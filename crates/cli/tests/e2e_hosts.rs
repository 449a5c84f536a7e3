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

#[test]
fn a_whole_host_lost_mid_transfer_keeps_every_connection_and_a_process_death_is_not_a_host_death() {
    let hosts = pliant_lab::agents::hosts_section(3, 20, 400);
    let Some(mut run) = ha_up_spec(
        "hosts",
        PliantNf::nat(),
        &[("32M.bin", 32 << 20)],
        pliant_lab::mgmt::Transport::Tcp,
        true,
        "auto = false\nmax_replicas = 60\n",
        "",
        &hosts,
    ) else {
        return;
    };
    // Every host up, each agent running its replica, under the controller's term.
    let st = wait_host_state(&run, "h3", "up");
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
