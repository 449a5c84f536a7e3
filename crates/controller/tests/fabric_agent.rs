//! A controller on another host than the fabric steers through the fabric host's agent
//! (`[lab] steering = "agent"`): every `Steering` operation goes over the authenticated link
//! under the controller's term, large exception sets in pieces, and the agent's fence refuses a
//! deposed leader's changes. The agent holds in-memory steering here (the tc-BPF fabric behind
//! the same requests is exercised by the lab's e2e tests).

use pliant_agent::config::{AgentConfig, AgentSection, FabricSection};
use pliant_agent::fabric::Fabric;
use pliant_agent::testing::RunningAgent;
use pliant_controller::steering::{RemoteSteering, Steering};
use pliant_state::FlowKey;
use pliant_wire::{role, Ca, Security};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

struct Dir(PathBuf);
impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn agent(d: &Path, ca: &Ca, name: &str, fabric: Option<Arc<Fabric>>) -> RunningAgent {
    agent_on(d, ca, name, fabric, "127.0.0.1:0")
}

fn agent_on(
    d: &Path,
    ca: &Ca,
    name: &str,
    fabric: Option<Arc<Fabric>>,
    listen: &str,
) -> RunningAgent {
    let id = d.join(format!("id-{name}"));
    if !id.exists() {
        ca.issue_to(&id, name, role::AGENT, 3600).unwrap();
    }
    let cfg = AgentConfig {
        agent: AgentSection {
            name: name.into(),
            socket: None,
            listen: listen.into(),
            identity: Some(id),
            encrypt: None,
            state_dir: d.join(format!("state-{name}")),
            probe_ms: 5,
            serve_probe_every: 4,
            start_timeout_ms: 10_000,
            stop_grace_ms: 2_000,
        },
        replica: Vec::new(),
        fabric: fabric.as_ref().map(|_| FabricSection {
            netns: "unused".into(),
        }),
    };
    RunningAgent::start_with(cfg, fabric)
}

fn key(i: u32) -> FlowKey {
    format!(
        "tcp 10.77.1.{}:{} <-> 10.77.2.2:80",
        2 + i / 50_000,
        1024 + i % 50_000
    )
    .parse()
    .unwrap()
}

#[test]
fn a_remote_controller_steers_through_the_fabric_agent_under_its_term() {
    let d = Dir(std::env::temp_dir().join(format!("pliant-ctl-fabric-{}", std::process::id())));
    let _ = std::fs::remove_dir_all(&d.0);
    std::fs::create_dir_all(&d.0).unwrap();
    let ca = Ca::generate(None).unwrap();
    let fabric = Arc::new(Fabric::memory());
    let fab = agent(&d.0, &ca, "fabric", Some(fabric.clone()));
    let ep = fab.ep.to_string().trim_start_matches("tcp:").to_string();
    let ctl = Security::new(ca.issue("ctl-a", role::CONTROLLER, 3600).unwrap());
    let term = Arc::new(AtomicU64::new(5));
    let remote = |term: &Arc<AtomicU64>, name: &str| {
        RemoteSteering::attach(
            &ep,
            name,
            Some(ctl.clone()),
            term.clone(),
            Duration::from_secs(5),
            &[1, 2, 3],
            Some("10.77.2.1".parse().unwrap()),
        )
    };
    // The agent must prove the name the controller expects.
    let e = remote(&term, "h1").err().expect("another name refused").0;
    assert!(e.contains("fabric agent h1"), "{e}");
    let mut a = remote(&term, "fabric").expect("attach");
    assert_eq!(
        a.nat_addrs(),
        vec!["10.77.2.1".parse::<std::net::IpAddr>().unwrap()]
    );
    a.set_ring(&[1, 2]).unwrap();
    a.add_replica(4).unwrap();
    a.set_live(4, false).unwrap();
    // More exceptions than one request carries: sent in pieces, all applied, all read back.
    let many: Vec<(FlowKey, u32)> = (0..9_000).map(|i| (key(i), 1 + i % 3)).collect();
    a.set_exceptions(&many).unwrap();
    let mut back = a.exceptions().unwrap();
    back.sort();
    let mut want = many.clone();
    want.sort();
    assert_eq!(back, want);
    let gone: Vec<FlowKey> = many[..5_000].iter().map(|(k, _)| *k).collect();
    assert_eq!(a.remove_exceptions(&gone).unwrap(), 5_000);
    assert_eq!(a.remove_exceptions(&gone).unwrap(), 0, "already removed");
    assert_eq!(a.demote_exceptions(&many[5_000..5_010]).unwrap(), 10);
    assert_eq!(a.exceptions().unwrap().len(), 3_990);
    assert_eq!(
        a.flush_pins(1).unwrap() + a.flush_pins(2).unwrap() + a.flush_pins(3).unwrap(),
        10
    );
    a.set_port_owner(20_000..=23_999, Some(2)).unwrap();
    a.set_fenced(3, true).unwrap();
    let st = a.stats();
    assert_eq!(st["backend"], "memory", "{st}");
    assert_eq!(st["fenced"], serde_json::json!([3]), "{st}");
    assert_eq!(st["ring"], serde_json::json!([1, 2]), "{st}");
    assert_eq!(st["agent"], "fabric", "{st}");
    // A new leader (term 6) attaches; the deposed one's changes are refused and counted, and
    // change nothing.
    let t6 = Arc::new(AtomicU64::new(6));
    let mut b = remote(&t6, "fabric").expect("the new leader attaches");
    let before = b.stats();
    let e = a.set_ring(&[3]).unwrap_err().0;
    assert!(
        e.contains("deposed controller") && e.contains("term 6"),
        "{e}"
    );
    assert!(a.set_fenced(1, true).is_err());
    assert_eq!(b.stats()["ring"], before["ring"]);
    assert_eq!(b.stats()["fenced"], before["fenced"]);
    // The deposed controller learns the new term (it would lead again only with a higher one).
    term.store(7, Ordering::SeqCst);
    a.set_ring(&[3])
        .expect("a term above the fence is admitted");
    assert!(b.set_ring(&[1]).is_err(), "now b is the deposed one");
    let status = fabric.status();
    assert!(status["ops"].as_u64().unwrap() >= 10, "{status}");
    assert_eq!(status["attached"], true);
    // An ordinary host's agent steers nothing.
    let h1 = agent(&d.0, &ca, "h1", None);
    let ep1 = h1.ep.to_string().trim_start_matches("tcp:").to_string();
    let e = RemoteSteering::attach(
        &ep1,
        "h1",
        Some(ctl.clone()),
        Arc::new(AtomicU64::new(1)),
        Duration::from_secs(5),
        &[1],
        None,
    )
    .err()
    .expect("no fabric there")
    .0;
    assert!(e.contains("steers no fabric"), "{e}");
    // A replica's certificate cannot steer the fabric (refused in the handshake).
    let r1 = Security::new(ca.issue("r1", role::REPLICA, 3600).unwrap());
    assert!(RemoteSteering::attach(
        &ep,
        "fabric",
        Some(r1),
        Arc::new(AtomicU64::new(9)),
        Duration::from_secs(5),
        &[1],
        None,
    )
    .is_err());
    let st = a.stats();
    assert_eq!(
        st["ring"],
        serde_json::json!([3]),
        "nothing changed by the replica: {st}"
    );
    let st = b.stats();
    assert!(
        st["error"].as_str().unwrap_or("").contains("deposed"),
        "{st}"
    );
}

#[test]
fn an_agent_steers_only_after_an_attach() {
    let d = Dir(std::env::temp_dir().join(format!("pliant-ctl-fabric2-{}", std::process::id())));
    let _ = std::fs::remove_dir_all(&d.0);
    std::fs::create_dir_all(&d.0).unwrap();
    let ca = Ca::generate(None).unwrap();
    let fab = agent(&d.0, &ca, "fabric", Some(Arc::new(Fabric::memory())));
    let c = pliant_proto::Client::new(
        fab.ep.clone(),
        Some(Security::new(
            ca.issue("ctl", role::CONTROLLER, 3600).unwrap(),
        )),
    )
    .expecting("fabric")
    .expecting_role(role::AGENT)
    .with_timeout(Duration::from_secs(5));
    let e = c
        .call(&pliant_proto::AgentRequest::Steer {
            op: pliant_proto::agent::SteerOp::SetRing { live: vec![1] },
        })
        .unwrap_err()
        .to_string();
    assert!(e.contains("no steering attached"), "{e}");
    let st: pliant_proto::agent::AgentStatus =
        c.ask(&pliant_proto::AgentRequest::AgentStatus).unwrap();
    let f = st.fabric.expect("the fabric's status");
    assert_eq!(f["attached"], false, "{f}");
    assert_eq!(f["op_errors"], 1, "{f}");
}

/// A fabric agent that restarted holds no steering (the maps stay pinned, its hold on them is
/// gone): the leader's next operation is refused with "no steering attached", and the leader
/// attaches again with every replica it knows and its last ring, then retries — the operation
/// succeeds and the fabric has the leader's ring, not the attach list's.
#[test]
fn a_restarted_fabric_agent_is_attached_again_with_the_last_ring() {
    let d = Dir(std::env::temp_dir().join(format!("pliant-ctl-fabric3-{}", std::process::id())));
    let _ = std::fs::remove_dir_all(&d.0);
    std::fs::create_dir_all(&d.0).unwrap();
    let ca = Ca::generate(None).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let listen = format!("127.0.0.1:{port}");
    let first = Arc::new(Fabric::memory());
    let fab = agent_on(&d.0, &ca, "fabric", Some(first.clone()), &listen);
    let ctl = Security::new(ca.issue("ctl", role::CONTROLLER, 3600).unwrap());
    let mut s = RemoteSteering::attach(
        &listen,
        "fabric",
        Some(ctl),
        Arc::new(AtomicU64::new(3)),
        Duration::from_secs(5),
        &[1, 2, 3],
        None,
    )
    .expect("attach");
    s.add_replica(4).unwrap();
    s.set_ring(&[2, 3, 4]).unwrap();
    drop(fab);
    let second = Arc::new(Fabric::memory());
    let _fab = agent_on(&d.0, &ca, "fabric", Some(second.clone()), &listen);
    assert_eq!(second.status()["attached"], false);
    s.set_fenced(1, true).expect("attached again, then applied");
    let st = s.stats();
    assert_eq!(st["ring"], serde_json::json!([2, 3, 4]), "{st}");
    assert_eq!(st["fenced"], serde_json::json!([1]), "{st}");
    let f = second.status();
    assert_eq!(f["attached"], true, "{f}");
    assert_eq!(
        f["op_errors"], 1,
        "the one refusal that triggered the attach: {f}"
    );
}
