//! The controller's side of host agents, against real agents (pliant-agent, in threads, over
//! TCP with identities) running stand-in replicas (python3 processes serving a unix socket as
//! a replica serves its control socket): replicas placed across hosts, a process death
//! reported with its exit status, an agent that is gone (refused) told from a host that is
//! silent (dead after `dead_after_ms`, unreachable while one of its replicas answers).

use pliant_agent::config::{AgentConfig, AgentSection};
use pliant_agent::testing::{fake_slot, RunningAgent};
use pliant_controller::agent::Agent;
use pliant_controller::hosts::{
    AgentEntry, HostEvent, HostState, HostWatch, HostsSection, RemoteAgents,
};
use pliant_wire::{role, Ca, Security};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant};

struct Dir(PathBuf);
impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The agent's TCP address as a `[[hosts.agent]]` endpoint (`host:port`).
fn tcp_addr(a: &RunningAgent) -> String {
    a.ep.to_string().trim_start_matches("tcp:").to_string()
}

fn agent(d: &Path, ca: &Ca, host: &str, slots: &[&str]) -> RunningAgent {
    let id = d.join(format!("id-{host}"));
    ca.issue_to(&id, host, role::AGENT, 3600).unwrap();
    let cfg = AgentConfig {
        agent: AgentSection {
            name: host.into(),
            socket: None,
            listen: "127.0.0.1:0".into(),
            identity: Some(id),
            encrypt: None,
            state_dir: d.join(format!("state-{host}")),
            probe_ms: 5,
            serve_probe_every: 4,
            start_timeout_ms: 10_000,
            stop_grace_ms: 2_000,
        },
        replica: slots.iter().map(|n| fake_slot(d, n, None)).collect(),
        fabric: None,
    };
    RunningAgent::start(cfg)
}

#[test]
fn replicas_spread_over_hosts_and_process_agent_and_host_failures_are_told_apart() {
    if !pliant_testkit::require_tool("python3", "python3") {
        return;
    }
    let d = Dir(std::env::temp_dir().join(format!("pliant-ctl-hosts-{}", std::process::id())));
    let _ = std::fs::remove_dir_all(&d.0);
    std::fs::create_dir_all(&d.0).unwrap();
    let ca = Ca::generate(None).unwrap();
    let h1 = agent(&d.0, &ca, "h1", &["r1", "r3"]);
    let h2 = agent(&d.0, &ca, "h2", &["r2", "r4"]);
    // h3: a port bound but not listening (the host's kernel refuses: no agent runs); h4: an
    // endpoint whose SYNs are dropped (a silent host).
    let (_held, refused_port) = pliant_testkit::sockets::bound_not_listening();
    let (l, _filler) = pliant_testkit::sockets::silent_tcp_endpoint("127.0.0.1:0".parse().unwrap());
    let silent = l.local_addr().unwrap().to_string();
    let cfg = HostsSection {
        poll_ms: 20,
        dead_after_ms: 300,
        poll_timeout_ms: 100,
        agent: vec![
            AgentEntry {
                name: "h1".into(),
                endpoint: tcp_addr(&h1),
            },
            AgentEntry {
                name: "h2".into(),
                endpoint: tcp_addr(&h2),
            },
            AgentEntry {
                name: "h3".into(),
                endpoint: format!("127.0.0.1:{refused_port}"),
            },
            AgentEntry {
                name: "h4".into(),
                endpoint: silent,
            },
        ],
    };
    cfg.check(true).unwrap();
    let me = Security::new(ca.issue("ctl", role::CONTROLLER, 3600).unwrap());
    let watch = Arc::new(HostWatch::new(cfg, Some(me), Arc::new(AtomicU64::new(3))));
    let mut agents = RemoteAgents {
        watch: watch.clone(),
    };

    // Placement: each new replica on the reachable host running the fewest.
    assert!(
        agents.existing().is_err(),
        "h3 and h4 do not answer: the listing says so"
    );
    let a = agents.add_replica().unwrap();
    let b = agents.add_replica().unwrap();
    assert_eq!((a.index, b.index), (1, 2), "r1 on h1, then r2 on h2");
    assert!(a.socket.ends_with("r1.sock") && b.socket.ends_with("r2.sock"));
    let c = agents.add_replica().unwrap();
    assert_eq!(c.index, 3);

    // Polls: h1, h2 up; h3's kernel refuses (agent down, host up); h4 silent -> unreachable,
    // then dead after 300 ms (none of its replicas answers; it runs none we know of).
    let nobody = |_: u32| false;
    let mut events = Vec::new();
    let t0 = Instant::now();
    while watch.state_of("h4") != Some(HostState::Dead) {
        events.extend(watch.poll_once(&nobody));
        assert!(t0.elapsed() < Duration::from_secs(10), "{}", watch.status());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        t0.elapsed() >= Duration::from_millis(300),
        "dead only after dead_after_ms"
    );
    assert_eq!(watch.state_of("h1"), Some(HostState::Up));
    assert_eq!(watch.state_of("h3"), Some(HostState::AgentDown));
    assert!(
        events
            .iter()
            .any(|e| matches!(e, HostEvent::HostDead { host, .. } if host == "h4")),
        "{events:?}"
    );
    assert!(!events
        .iter()
        .any(|e| matches!(e, HostEvent::ProcessDied { .. })));
    let st = watch.status();
    assert_eq!(
        st[0]["agent_term"], 3,
        "the agent follows the controller's term: {st}"
    );

    // A process death: reported once, with how it ended, by the host that ran it.
    let pid = st[0]["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["replica"] == "r1")
        .and_then(|s| s["pid"].as_u64())
        .unwrap();
    // SAFETY: a process the test's agent started.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    let t0 = Instant::now();
    let died = loop {
        let ev = watch.poll_once(&nobody);
        if let Some(e) = ev
            .into_iter()
            .find(|e| matches!(e, HostEvent::ProcessDied { .. }))
        {
            break e;
        }
        assert!(t0.elapsed() < Duration::from_secs(5));
        std::thread::sleep(Duration::from_millis(5));
    };
    assert_eq!(
        died,
        HostEvent::ProcessDied {
            host: "h1".into(),
            replica: 1,
            exit: "killed by signal 9".into()
        }
    );
    for _ in 0..5 {
        assert!(watch.poll_once(&nobody).is_empty(), "reported once");
    }
    assert_eq!(watch.host_of(2).as_deref(), Some("h2"));

    // Scale-in through the agent; then stop everything this test started.
    agents.remove_replica(2).unwrap();
    watch.poll_once(&nobody);
    let listed: Vec<u32> = watch.status()[1]["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["state"] == "running")
        .filter_map(|s| s["replica"].as_str()?.strip_prefix('r')?.parse().ok())
        .collect();
    assert!(!listed.contains(&2), "{listed:?}");
    agents.remove_replica(3).unwrap();
    assert!(agents.remove_replica(9).is_err());
}
