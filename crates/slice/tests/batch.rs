//! Many sessions moved in batches (a drain), in a network namespace of the test's own.

mod common;

use common::{private_netns, tcp_counter, wait_until};
use pliant_slice::demo::LineApp;
use pliant_slice::instance::{Config, Instance};
use pliant_slice::load::IdleSessions;
use pliant_wire::{role, Ca, Endpoint, Security};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

fn instance(ca: &Ca, name: &str) -> Instance<LineApp> {
    let id = ca.issue(name, role::REPLICA, 3600).unwrap();
    Instance::start(Config {
        name: name.into(),
        clients: "127.0.0.1:0".parse().unwrap(),
        peer: Endpoint::Tcp("127.0.0.1:0".into()),
        security: Security::new(id),
        control: None,
        backup: None,
    })
    .unwrap()
}

#[test]
fn a_thousand_sessions_drain_in_batches_with_every_stream_intact() {
    if !private_netns() {
        return;
    }
    let n: usize = std::env::var("SLICE_DRAIN_SESSIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let ca = Ca::generate(None).unwrap();
    let a = instance(&ca, "slice-a");
    let b = instance(&ca, "slice-b");
    let Endpoint::Tcp(addr) = a.client_endpoint().clone() else {
        panic!("client endpoint");
    };
    let mut clients = IdleSessions::connect(&addr, n, Duration::from_secs(10)).unwrap();
    clients.round().unwrap();
    assert!(wait_until(Duration::from_secs(10), || a
        .session_ids()
        .len()
        == n));

    // Every session has a line in flight, unanswered, while it moves.
    clients.send_all().unwrap();
    let t = Instant::now();
    let m = a.drain_to(b.peer_endpoint(), b.name(), n).unwrap();
    let one_batch = t.elapsed();
    eprintln!(
        "slice drain: {} sessions in one batch in {one_batch:?} (capsules {} bytes, hold {}); \
         steps from the freeze request: {:?}",
        m.moved.len(),
        m.capsule_bytes,
        a.hold().mode().as_str(),
        m.phases
    );
    assert_eq!(m.stayed, Vec::<(u64, String)>::new());
    assert_eq!(m.moved.len(), n);
    clients.check_all().unwrap();
    clients.round().unwrap();
    assert!(a.session_ids().is_empty());
    assert_eq!(b.session_ids().len(), n);

    // Back, in batches of 64 (the last one partial).
    clients.send_all().unwrap();
    let t = Instant::now();
    let m = b.drain_to(a.peer_endpoint(), a.name(), 64).unwrap();
    eprintln!(
        "slice drain: {} sessions back in batches of 64 in {:?}",
        m.moved.len(),
        t.elapsed()
    );
    assert_eq!(m.moved.len(), n);
    assert!(m.stayed.is_empty(), "{:?}", m.stayed);
    clients.check_all().unwrap();
    clients.round().unwrap();
    assert_eq!(a.session_ids().len(), n);
    assert_eq!(tcp_counter("OutRsts"), 0, "a RST left this namespace");
    for i in [&a, &b] {
        assert_eq!(i.stats().session_errors.load(Ordering::Relaxed), 0);
    }
    // Five lines per connection, each answered and checked.
    assert_eq!(clients.lines(), 5 * n as u64);
}

/// An application whose capsules another build cannot read.
struct Incompatible;

impl pliant_slice::instance::SessionApp for Incompatible {
    fn new_session() -> Self {
        Incompatible
    }
    fn on_input(&mut self, _: &[u8], _: &mut Vec<u8>) {}
    fn save(&self) -> Vec<u8> {
        Vec::new()
    }
    fn load(_: &[u8]) -> Result<Self, String> {
        Err("this build reads no line-app state".into())
    }
}

#[test]
fn a_refused_batch_stays_whole_where_it_was() {
    if !private_netns() {
        return;
    }
    let ca = Ca::generate(None).unwrap();
    let a = instance(&ca, "slice-a");
    let id = ca.issue("slice-other", role::REPLICA, 3600).unwrap();
    let other: Instance<Incompatible> = Instance::start(Config {
        name: "slice-other".into(),
        clients: "127.0.0.1:0".parse().unwrap(),
        peer: Endpoint::Tcp("127.0.0.1:0".into()),
        security: Security::new(id),
        control: None,
        backup: None,
    })
    .unwrap();
    let Endpoint::Tcp(addr) = a.client_endpoint().clone() else {
        panic!("client endpoint");
    };
    let mut clients = IdleSessions::connect(&addr, 20, Duration::from_secs(10)).unwrap();
    clients.round().unwrap();
    assert!(wait_until(Duration::from_secs(5), || a.session_ids().len() == 20));
    let before = a.session_ids();
    clients.send_all().unwrap();
    match a.drain_to(other.peer_endpoint(), other.name(), 8) {
        Err(pliant_slice::migrate::MigrateError::Refused(why)) => {
            assert!(why.contains("application capsule"), "{why}")
        }
        r => panic!("expected a refusal, got {r:?}"),
    }
    assert_eq!(a.session_ids(), before);
    clients.check_all().unwrap();
    clients.round().unwrap();
    assert_eq!(tcp_counter("OutRsts"), 0);
}
