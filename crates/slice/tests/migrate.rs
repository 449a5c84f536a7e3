//! Live sessions moved between two running instances, each test in its own network namespace
//! (its TCP counters count only its own segments; nftables tables die with it).

mod common;

use common::{private_netns, start_client, tcp_counter, tcpext_counter, wait_until, Client};
use pliant_slice::demo::LineApp;
use pliant_slice::instance::{Config, Instance, SessionApp};
use pliant_slice::migrate::MigrateError;
use pliant_wire::{role, Ca, ConnError, Endpoint, Security};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

fn instance<A: SessionApp>(ca: &Ca, name: &str) -> Instance<A> {
    instance_at(ca, name, Endpoint::Tcp("127.0.0.1:0".into()))
}

fn instance_at<A: SessionApp>(ca: &Ca, name: &str, peer: Endpoint) -> Instance<A> {
    instance_on(ca, name, "127.0.0.1:0", peer)
}

fn instance_on<A: SessionApp>(ca: &Ca, name: &str, clients: &str, peer: Endpoint) -> Instance<A> {
    let id = ca.issue(name, role::REPLICA, 3600).unwrap();
    Instance::start(Config {
        name: name.into(),
        clients: clients.parse().unwrap(),
        peer,
        security: Security::new(id),
        control: None,
        backup: None,
    })
    .unwrap()
}

fn client_addr<A: SessionApp>(i: &Instance<A>) -> String {
    match i.client_endpoint() {
        Endpoint::Tcp(a) => a.clone(),
        e => panic!("client endpoint {e:?}"),
    }
}

/// Instances `slice-a` and `slice-b` of one CA, and `n` streaming clients served by `slice-a`.
fn two_instances_with_clients(n: usize) -> (Instance<LineApp>, Instance<LineApp>, Vec<Client>) {
    let ca = Ca::generate(None).unwrap();
    let a: Instance<LineApp> = instance(&ca, "slice-a");
    let b: Instance<LineApp> = instance(&ca, "slice-b");
    let addr = client_addr(&a);
    let clients: Vec<Client> = (0..n).map(|c| start_client(&addr, c)).collect();
    assert!(wait_until(Duration::from_secs(5), || a.session_ids().len() == n));
    (a, b, clients)
}

fn pct(v: &mut [Duration], p: f64) -> Duration {
    v.sort_unstable();
    v[((v.len() - 1) as f64 * p).round() as usize]
}

#[test]
fn streaming_sessions_move_back_and_forth_without_a_reset_or_a_lost_byte() {
    if !private_netns() {
        return;
    }
    let (a, b, clients) = two_instances_with_clients(4);
    for c in &clients {
        assert!(c.progresses(100));
    }

    let target: usize = std::env::var("SLICE_MIGRATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    // SLICE_MIGRATIONS / SLICE_BUDGET_SECS raise both for a long run (the goal is 10,000).
    let budget = Duration::from_secs(
        std::env::var("SLICE_BUDGET_SECS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(60),
    );
    let started = Instant::now();
    let mut pauses = Vec::new();
    let mut phases = Vec::new();
    // The slowest move's steps, to tell where an outlier spent its time.
    let mut slowest = None;
    let mut abandoned = 0;
    let mut gaps = Vec::new();
    let (mut src, mut dst) = (&a, &b);
    while pauses.len() < target && started.elapsed() < budget {
        for (id, peer) in src.sessions() {
            let c = clients
                .iter()
                .find(|c| Some(c.local) == peer)
                .expect("a session of an unknown client");
            let before = c.checked.load(Ordering::Relaxed);
            let t = Instant::now();
            match src.migrate(id, dst.peer_endpoint(), dst.name()) {
                Ok(m) => {
                    let o = m.options;
                    assert!(
                        o.sack && o.timestamps && o.wscale.is_some(),
                        "options {o:?}"
                    );
                    if pauses.iter().all(|p| *p < m.pause) {
                        slowest = Some(m.clone());
                    }
                    pauses.push(m.pause);
                    phases.push(m.phases);
                }
                // A segment slipped past the hold's installation: the move is given up and
                // the session stays (correct, and counted).
                Err(MigrateError::CaptureRaced { .. }) => abandoned += 1,
                Err(e) => panic!("migration {}: {e}", pauses.len()),
            }
            // The next move of this session waits for its client to see a new reply: what the
            // client saw of the move (freeze to the next byte) is the gap, and a session is
            // never moved again while its client still recovers segments the hold dropped.
            let progressed = || c.checked.load(Ordering::Relaxed) > before;
            assert!(
                wait_until(Duration::from_secs(10), progressed),
                "migration {}: client {} saw no reply for 10 s",
                pauses.len(),
                c.local
            );
            gaps.push(t.elapsed());
        }
        std::mem::swap(&mut src, &mut dst);
    }
    let elapsed = started.elapsed();
    // Still streaming after the last move.
    for c in &clients {
        assert!(c.progresses(100));
    }
    let client_retrans =
        clients
            .iter()
            .map(Client::retrans)
            .fold(common::Retrans::default(), |a, b| common::Retrans {
                total_retrans: a.total_retrans + b.total_retrans,
                rto: a.rto + b.rto,
            });
    let lines: u64 = clients.into_iter().map(Client::finish).sum();
    let rsts = tcp_counter("OutRsts");
    let n = pauses.len();
    let (p50, p99, max) = (
        pct(&mut pauses, 0.5),
        pct(&mut pauses, 0.99),
        pct(&mut pauses, 1.0),
    );
    let (g50, g99, gmax) = (
        pct(&mut gaps, 0.5),
        pct(&mut gaps, 0.99),
        pct(&mut gaps, 1.0),
    );
    let stalls = gaps
        .iter()
        .filter(|g| **g >= Duration::from_millis(200))
        .count();
    eprintln!("slice e2e clients: {client_retrans:?}; gaps >= 200 ms: {stalls}");
    eprintln!(
        "slice e2e client-observed gap (move start to next reply): p50 {g50:?} p99 {g99:?} \
         max {gmax:?}"
    );
    eprintln!(
        "slice e2e: {n} migrations in {elapsed:.2?} ({abandoned} abandoned), pause p50 {p50:?} \
         p99 {p99:?} max {max:?}; {lines} lines answered byte-exact; OutRsts {rsts}"
    );
    let p = |f: fn(&pliant_slice::migrate::Phases) -> Duration| {
        pct(&mut phases.iter().map(f).collect::<Vec<_>>(), 0.5)
    };
    eprintln!(
        "slice e2e phases (p50, from the freeze request): frozen {:?} ready {:?} held {:?} \
         captured+closed {:?} restored {:?} released {:?} serving {p50:?}",
        p(|x| x.frozen),
        p(|x| x.ready),
        p(|x| x.held),
        p(|x| x.captured),
        p(|x| x.restored),
        p(|x| x.released),
    );
    eprintln!("slice e2e slowest move: {slowest:?}");
    if std::env::var("SLICE_NETSTAT").is_ok() {
        eprintln!(
            "{}",
            std::fs::read_to_string("/proc/thread-self/net/netstat").unwrap()
        );
    }
    eprintln!(
        "slice e2e hold: {} (fallback: {:?}), queue a {:?} b {:?}; kernel: TCPTimeouts {} \
         TCPLossProbes {} TCPLossProbeRecovery {} RetransSegs {} TCPSpuriousRTOs {}",
        a.hold().mode().as_str(),
        a.hold().fallback_reason(),
        a.hold().queue_stats(),
        b.hold().queue_stats(),
        tcpext_counter("TCPTimeouts"),
        tcpext_counter("TCPLossProbes"),
        tcpext_counter("TCPLossProbeRecovery"),
        tcp_counter("RetransSegs"),
        tcpext_counter("TCPSpuriousRTOs"),
    );
    assert!(n >= 100, "only {n} migrations in {budget:?}");
    assert_eq!(rsts, 0, "a RST left this namespace");
    for i in [&a, &b] {
        assert_eq!(i.stats().session_errors.load(Ordering::Relaxed), 0);
    }
}

/// An application whose capsules another build cannot read.
struct Incompatible;

impl SessionApp for Incompatible {
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
fn a_refused_capsule_or_an_unauthenticated_peer_leaves_the_session_where_it_was() {
    if !private_netns() {
        return;
    }
    let ca = Ca::generate(None).unwrap();
    let a: Instance<LineApp> = instance(&ca, "slice-a");
    let other: Instance<Incompatible> = instance(&ca, "slice-other");
    let rogue_ca = Ca::generate(None).unwrap();
    let rogue: Instance<LineApp> = instance(&rogue_ca, "slice-b");

    let c = start_client(&client_addr(&a), 0);
    assert!(wait_until(Duration::from_secs(5), || a.session_ids().len() == 1));
    let id = a.session_ids()[0];
    assert!(c.progresses(100));

    // A destination of another CA cannot prove the name asked for: refused before the freeze.
    match a.migrate(id, rogue.peer_endpoint(), "slice-b") {
        Err(MigrateError::Connect(ConnError::Handshake { .. })) => {}
        other => panic!("expected a refused handshake, got {other:?}"),
    }
    assert_eq!(a.session_ids(), vec![id]);
    assert!(c.progresses(100));

    // A source of another CA sending to `a`: refused at `a`'s handshake, its session stays.
    let rc = start_client(&client_addr(&rogue), 1);
    assert!(wait_until(Duration::from_secs(5), || rogue
        .session_ids()
        .len()
        == 1));
    let rid = rogue.session_ids()[0];
    let e = rogue
        .migrate(rid, a.peer_endpoint(), "slice-a")
        .unwrap_err();
    assert!(matches!(e, MigrateError::Connect(_)), "{e}");
    assert!(e.to_string().contains("certificate"), "unclear error: {e}");
    // Whichever side first meets the other's foreign certificate ends the handshake (here the
    // rogue, verifying `a`'s); `a` counts a refused or a broken-off handshake, and no capsule
    // ever reached it.
    assert!(wait_until(Duration::from_secs(5), || {
        let st = a.stats();
        st.refused_peers.load(Ordering::Relaxed) + st.aborted_handshakes.load(Ordering::Relaxed)
            == 1
    }));
    assert_eq!(a.stats().moved_in.load(Ordering::Relaxed), 0);
    assert!(rc.progresses(100));

    // An authenticated destination that cannot take the capsule: the session is resumed at the
    // source, frozen and captured as it was, and goes on.
    let e = a
        .migrate(id, other.peer_endpoint(), "slice-other")
        .unwrap_err();
    match &e {
        MigrateError::Refused(why) => assert!(why.contains("application capsule"), "{why}"),
        other => panic!("expected a refusal, got {other}"),
    }
    assert_eq!(a.session_ids(), vec![id]);
    assert!(c.progresses(100));
    c.finish();
    rc.finish();
    assert_eq!(tcp_counter("OutRsts"), 0);
}

/// Runs `f` on a thread of its own (whose namespace or capabilities it may change, and which
/// the threads it starts inherit) and returns what it made.
fn on_a_thread<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|t| t.spawn(f).join().unwrap())
}

/// A client's session on `a` fails to move to `b` (`check` looks at why), stays on `a`, and
/// its stream goes on, with no RST.
fn failed_move_keeps_the_session(
    a: &Instance<LineApp>,
    b: &Instance<LineApp>,
    check: impl FnOnce(MigrateError),
) {
    let c = start_client(&client_addr(a), 0);
    assert!(wait_until(Duration::from_secs(5), || a.session_ids().len() == 1));
    let id = a.session_ids()[0];
    assert!(c.progresses(100));
    match a.migrate(id, b.peer_endpoint(), b.name()) {
        Ok(m) => panic!("moved: {m:?}"),
        Err(e) => check(e),
    }
    assert_eq!(a.session_ids(), vec![id]);
    assert!(c.progresses(100));
    c.finish();
    assert_eq!(tcp_counter("OutRsts"), 0);
}

/// Drops CAP_NET_ADMIN from the calling thread's effective capabilities (threads it starts
/// inherit that; processes it starts as root get them back at exec).
fn drop_net_admin_in_this_thread() {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    const CAP_NET_ADMIN: u32 = 12;
    let mut h = Header {
        version: 0x2008_0522, // _LINUX_CAPABILITY_VERSION_3
        pid: 0,
    };
    let mut d = [Data::default(); 2];
    // SAFETY: capget/capset read and write one header and two data structs of the v3 layout;
    // pid 0 is the calling thread.
    unsafe {
        assert_eq!(libc::syscall(libc::SYS_capget, &mut h, d.as_mut_ptr()), 0);
        d[0].effective &= !(1 << CAP_NET_ADMIN);
        assert_eq!(libc::syscall(libc::SYS_capset, &mut h, d.as_ptr()), 0);
    }
}

#[test]
fn a_destination_that_cannot_restore_after_the_close_leaves_the_session_restored_at_the_source() {
    if !private_netns() {
        return;
    }
    let ca = Ca::generate(None).unwrap();
    let a: Instance<LineApp> = instance(&ca, "slice-a");
    // The destination's threads run without CAP_NET_ADMIN: it decodes the capsule and says
    // Ready, the source closes, and then its TCP_REPAIR is refused.
    let b: Instance<LineApp> = on_a_thread(|| {
        drop_net_admin_in_this_thread();
        instance(&ca, "slice-b")
    });
    // The source restored its own capsule: same session, same connection, still answering.
    failed_move_keeps_the_session(&a, &b, |e| match e {
        MigrateError::DestRestore(why) => assert!(why.contains("TCP_REPAIR"), "{why}"),
        other => panic!("expected the destination's restore to fail, got {other:?}"),
    });
    assert_eq!(b.stats().refused_capsules.load(Ordering::Relaxed), 1);
}

#[test]
fn a_destination_in_another_network_namespace_is_refused_before_the_source_lets_go() {
    if !private_netns() {
        return;
    }
    let ca = Ca::generate(None).unwrap();
    let a: Instance<LineApp> = instance(&ca, "slice-a");
    // In a namespace of its own, the destination would restore the socket without an error
    // (its kernel has no such connection to refuse it) and never see its packets. Its peer
    // endpoint is a unix socket, reachable from any namespace.
    let dir = std::env::temp_dir().join(format!("pliant-slice-ns-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    struct Rm(std::path::PathBuf);
    impl Drop for Rm {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let _rm = Rm(dir.clone());
    let peer = Endpoint::Unix(dir.join("b.sock"));
    let b: Instance<LineApp> = on_a_thread(|| {
        assert!(private_netns());
        instance_at(&ca, "slice-b", peer)
    });
    failed_move_keeps_the_session(&a, &b, |e| match e {
        MigrateError::Refused(why) => assert!(why.contains("network namespace"), "{why}"),
        other => panic!("expected a refusal, got {other:?}"),
    });
}

#[test]
fn an_ipv6_session_moves_back_and_forth() {
    if !private_netns() {
        return;
    }
    let ca = Ca::generate(None).unwrap();
    let tcp = || Endpoint::Tcp("127.0.0.1:0".into());
    let a: Instance<LineApp> = instance_on(&ca, "slice-a", "[::1]:0", tcp());
    let b: Instance<LineApp> = instance_on(&ca, "slice-b", "[::1]:0", tcp());
    let c = start_client(&client_addr(&a), 0);
    assert!(c.local.is_ipv6());
    assert!(wait_until(Duration::from_secs(5), || a.session_ids().len() == 1));
    let (mut src, mut dst) = (&a, &b);
    for _ in 0..50 {
        let id = src.session_ids()[0];
        let m = src.migrate(id, dst.peer_endpoint(), dst.name()).unwrap();
        assert!(m.options.sack && m.options.timestamps && m.options.wscale.is_some());
        assert!(c.progresses(10));
        std::mem::swap(&mut src, &mut dst);
    }
    c.finish();
    assert_eq!(tcp_counter("OutRsts"), 0);
}

#[test]
fn migrate_each_moves_sessions_over_one_channel_and_goes_on_after_a_failure() {
    if !private_netns() {
        return;
    }
    let (a, b, clients) = two_instances_with_clients(3);
    let here = a.session_ids();
    // A session that is not here between two that are: it fails, the channel is opened again
    // and the next one moves.
    let ids = [here[0], 0xdead, here[1], here[2]];
    let mut seen = Vec::new();
    a.migrate_each(&ids, b.peer_endpoint(), "slice-b", |id, r| {
        seen.push((id, r.map(|m| m.capsule_bytes)));
        true
    });
    assert_eq!(seen.len(), 4);
    for (i, (id, r)) in seen.iter().enumerate() {
        assert_eq!(*id, ids[i]);
        match (i, r) {
            (1, Err(MigrateError::NoSession(0xdead))) => {}
            (1, r) => panic!("unknown session: {r:?}"),
            (_, Ok(bytes)) => assert!(*bytes > 0),
            (_, Err(e)) => panic!("session {id:x}: {e}"),
        }
    }
    assert!(a.session_ids().is_empty());
    assert_eq!(b.session_ids(), here);
    for c in &clients {
        assert!(c.progresses(100), "a moved session stalled");
    }
    // `false` stops before the next session.
    let mut calls = 0;
    b.migrate_each(&here, a.peer_endpoint(), "slice-a", |_, r| {
        assert!(r.is_ok());
        calls += 1;
        false
    });
    assert_eq!(calls, 1);
    assert_eq!(a.session_ids().len(), 1);
    assert_eq!(b.session_ids().len(), 2);
    for c in clients {
        c.finish();
    }
    assert_eq!(tcp_counter("OutRsts"), 0);
}
