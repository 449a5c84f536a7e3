//! The agent against real processes: a stand-in replica (a python3 process serving a unix
//! socket, as a replica serves its control socket) started, watched, killed and stopped through
//! the agent's control link, unix and TCP with identities.

use pliant_agent::config::{AgentConfig, AgentSection};
use pliant_agent::testing::{fake_slot, RunningAgent};
use pliant_proto::agent::{AgentRequest, AgentStatus, SlotState};
use pliant_proto::Client;
use pliant_wire::{role, Ca, Security};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

struct Dir(PathBuf);
impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn dir(tag: &str) -> Dir {
    let d = std::env::temp_dir().join(format!(
        "pliant-agent-{tag}-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    Dir(d)
}

fn config(d: &Path, listen: &str, identity: Option<PathBuf>) -> AgentConfig {
    let c = AgentConfig {
        agent: AgentSection {
            name: "h1".into(),
            socket: None,
            listen: listen.into(),
            identity,
            encrypt: None,
            state_dir: d.join("state"),
            probe_ms: 5,
            serve_probe_every: 4,
            start_timeout_ms: 10_000,
            stop_grace_ms: 2_000,
        },
        replica: ["r1", "r2"]
            .iter()
            .map(|n| fake_slot(d, n, Some(d.join(format!("{n}.log")))))
            .collect(),
        fabric: None,
    };
    c.check().unwrap();
    c
}

fn status(c: &Client) -> AgentStatus {
    c.ask(&AgentRequest::AgentStatus).unwrap()
}

fn stop_all(c: &Client) {
    for r in ["r1", "r2"] {
        let _ = c.call(&AgentRequest::Stop { replica: r.into() });
    }
}

#[test]
fn a_replica_is_started_watched_and_its_death_reported_exactly() {
    if !pliant_testkit::require_tool("python3", "python3") {
        return;
    }
    let d = dir("life");
    let sock = d.0.join("agent.sock").display().to_string();
    let a = RunningAgent::start(config(&d.0, &sock, None));
    let c = Client::new(a.ep.clone(), None);
    let st = status(&c);
    assert_eq!(st.agent, "h1");
    assert!(st.slots.iter().all(|s| s.state == SlotState::Stopped));

    let st: AgentStatus = c
        .ask(&AgentRequest::Start {
            replica: "r1".into(),
        })
        .unwrap();
    let r1 = st.slot("r1").unwrap().clone();
    assert_eq!(r1.state, SlotState::Running);
    assert!(r1.serving, "start answers once the control socket serves");
    let pid = r1.pid.unwrap();
    // The PID file lets a later agent adopt it; private to the agent.
    let pf = d.0.join("state/r1.pid");
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&pf).unwrap().permissions().mode() & 0o777,
        0o600
    );

    // Starting a running replica starts nothing.
    let again: AgentStatus = c
        .ask(&AgentRequest::Start {
            replica: "r1".into(),
        })
        .unwrap();
    assert_eq!(again.slot("r1").unwrap().pid, Some(pid));

    // SIGKILL: reported as a death with the signal, within a few probe periods.
    // SAFETY: the process the agent started for this test.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    let t0 = Instant::now();
    let died = loop {
        let s = status(&c);
        let r1 = s.slot("r1").unwrap().clone();
        if r1.state == SlotState::Died {
            break r1;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "death not seen: {r1:?}"
        );
        std::thread::sleep(Duration::from_millis(2));
    };
    assert_eq!(died.exit.as_deref(), Some("killed by signal 9"));
    assert_eq!(died.deaths, 1);
    assert!(!died.serving);
    assert!(!pf.exists(), "a dead replica's PID file is removed");

    // Restarted on request; stopped on request (not a death).
    let st: AgentStatus = c
        .ask(&AgentRequest::Start {
            replica: "r1".into(),
        })
        .unwrap();
    let pid2 = st.slot("r1").unwrap().pid.unwrap();
    assert_ne!(pid2, pid);
    let st: AgentStatus = c
        .ask(&AgentRequest::Stop {
            replica: "r1".into(),
        })
        .unwrap();
    let r1 = st.slot("r1").unwrap();
    assert_eq!(r1.state, SlotState::Stopped);
    assert_eq!(r1.deaths, 1, "a requested stop is not a death");
    assert!(!Path::new(&format!("/proc/{pid2}")).exists() || zombie_or_gone(pid2));

    // Unknown slot and bad input: clear errors, counted; the agent keeps serving.
    let e = c
        .call(&AgentRequest::Start {
            replica: "r9".into(),
        })
        .unwrap_err()
        .to_string();
    assert!(e.contains("no replica \"r9\""), "{e}");
    stop_all(&c);
}

fn zombie_or_gone(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| s.contains(") Z "))
        .unwrap_or(true)
}

#[test]
fn a_restarted_agent_adopts_running_replicas_instead_of_starting_copies() {
    if !pliant_testkit::require_tool("python3", "python3") {
        return;
    }
    let d = dir("adopt");
    let sock = d.0.join("agent.sock").display().to_string();
    let pid = {
        let mut a = RunningAgent::start(config(&d.0, &sock, None));
        let c = Client::new(a.ep.clone(), None);
        let st: AgentStatus = c
            .ask(&AgentRequest::Start {
                replica: "r2".into(),
            })
            .unwrap();
        // The agent ends here; its replica keeps running (the next agent's guard ends it).
        a.leave_replicas = true;
        st.slot("r2").unwrap().pid.unwrap()
    };
    assert!(Path::new(&format!("/proc/{pid}")).exists());
    let a = RunningAgent::start(config(&d.0, &sock, None));
    let c = Client::new(a.ep.clone(), None);
    let r2 = status(&c).slot("r2").unwrap().clone();
    assert_eq!((r2.state, r2.pid), (SlotState::Running, Some(pid)));
    // An adopted replica's death is seen too (without its exit status).
    // SAFETY: the process this test's agent started.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    let t0 = Instant::now();
    loop {
        let r2 = status(&c).slot("r2").unwrap().clone();
        if r2.state == SlotState::Died {
            assert!(r2.exit.unwrap().contains("adopted"));
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "{r2:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
    stop_all(&c);
}

#[test]
fn over_tcp_only_controllers_are_served_and_a_deposed_term_is_refused() {
    if !pliant_testkit::require_tool("python3", "python3") {
        return;
    }
    let d = dir("tcp");
    let ca = Ca::generate(None).unwrap();
    let id = d.0.join("id-h1");
    ca.issue_to(&id, "h1", role::AGENT, 3600).unwrap();
    let a = RunningAgent::start(config(&d.0, "127.0.0.1:0", Some(id)));
    let as_ = |name: &str, roles: u32| {
        Client::new(
            a.ep.clone(),
            Some(Security::new(ca.issue(name, roles, 3600).unwrap())),
        )
        .expecting("h1")
        .expecting_role(role::AGENT)
        .with_timeout(Duration::from_secs(5))
    };
    let ctl = as_("ctl", role::CONTROLLER);
    assert_eq!(status(&ctl).agent, "h1");
    // A replica's certificate is not a controller's: refused in the handshake.
    let e = as_("r1", role::REPLICA)
        .call(&AgentRequest::AgentStatus)
        .unwrap_err();
    assert!(matches!(e, pliant_proto::ControlError::Io { .. }), "{e}");
    // Dialing the agent as if it were a replica: the agent cannot prove REPLICA.
    let wrong = Client::new(
        a.ep.clone(),
        Some(Security::new(
            ca.issue("c2", role::CONTROLLER, 3600).unwrap(),
        )),
    )
    .with_timeout(Duration::from_secs(5));
    assert!(wrong.call(&AgentRequest::AgentStatus).is_err());
    // Terms: a later controller's term raises the fence; the earlier one is refused, counted.
    let t5 = ctl.clone().with_term(5);
    let t4 = ctl.clone().with_term(4);
    assert_eq!(status(&t5).term, 5);
    let e = t4
        .call(&AgentRequest::Start {
            replica: "r1".into(),
        })
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("deposed controller") && e.contains("term 5"),
        "{e}"
    );
    let st = status(&ctl);
    assert_eq!(st.deposed_refused, 1);
    assert_eq!(
        st.slot("r1").unwrap().state,
        SlotState::Stopped,
        "nothing started"
    );
}
