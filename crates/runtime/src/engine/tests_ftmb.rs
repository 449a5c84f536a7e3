//! FTMB mode with in-memory ports: packets through the workers, output released only by a
//! logger, snapshots to a logger server over a real unix socket, recovery on another engine.

use super::*;
use crate::config::Cidr;
use crate::ftmb::testnf::{TestNat, EXT_IP, FIN, PORT_BASE};
use crate::ftmb::{self, FtmbOptions, FtmbShell};
use pliant_io::MemPort;
use pliant_net::{build, Parsed};
use std::net::Ipv4Addr;

const IN_MAC: [u8; 6] = [0x02, 0, 0, 0, 1, 1];
const OUT_MAC: [u8; 6] = [0x02, 0, 0, 0, 2, 1];
const CLIENT_MAC: [u8; 6] = [0x02, 0, 0, 0, 1, 2];
const SERVER_MAC: [u8; 6] = [0x02, 0, 0, 0, 2, 2];
const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 0, 1, 2);
const SERVER: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 2);

type E = Engine<FtmbShell<TestNat>, MemPort>;

fn engine(name: &str, opts: FtmbOptions) -> E {
    let nets = [
        SideNet {
            ifname: "in0".into(),
            addrs: vec![Cidr::parse("10.0.1.1/24").unwrap()],
            gateway: None,
        },
        SideNet {
            ifname: "out0".into(),
            addrs: vec![Cidr::parse("10.0.2.1/24").unwrap()],
            gateway: None,
        },
    ];
    let mut e = Engine::new(
        name,
        FtmbShell::default(),
        [MemPort::new(IN_MAC), MemPort::new(OUT_MAC)],
        nets,
        EngineOptions::default(),
        Instant::now(),
    );
    e.set_ftmb(ftmb::start(TestNat, opts).expect("ftmb mode starts"));
    // Neighbours learned from their ARP requests, so output is sent at once.
    e.port_mut(Side::Inside).inject(&arp::request(
        CLIENT_MAC,
        CLIENT,
        Ipv4Addr::new(10, 0, 1, 1),
        None,
    ));
    e.port_mut(Side::Outside).inject(&arp::request(
        SERVER_MAC,
        SERVER,
        Ipv4Addr::new(10, 0, 2, 1),
        None,
    ));
    e.poll_once(Instant::now());
    e.port_mut(Side::Inside).take_tx();
    e.port_mut(Side::Outside).take_tx();
    e
}

fn udp_out(sport: u16) -> Vec<u8> {
    build::udp(
        CLIENT_MAC,
        IN_MAC,
        CLIENT.into(),
        sport,
        SERVER.into(),
        53,
        b"q",
    )
}

fn udp_back(ext_port: u16) -> Vec<u8> {
    build::udp(
        SERVER_MAC,
        OUT_MAC,
        SERVER.into(),
        53,
        EXT_IP.into(),
        ext_port,
        b"r",
    )
}

fn parsed(f: &[u8]) -> Parsed {
    match pliant_net::parse(f) {
        Ok(Frame::Ip(p)) => p,
        other => panic!("not IP: {other:?}"),
    }
}

/// Runs rounds of the engines until `done` says so; a hang guard, not a timing assertion.
#[track_caller]
fn pump(es: &mut [&mut E], mut done: impl FnMut(&mut [&mut E]) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done(es) {
        if Instant::now() >= deadline {
            let st: Vec<Value> = es.iter_mut().map(|e| answer(e, Cmd::FtmbStatus)).collect();
            panic!("condition not reached (hang guard); status: {st:?}");
        }
        for e in es.iter_mut() {
            e.poll_once(Instant::now());
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

fn tx(e: &mut E, s: Side, into: &mut Vec<Vec<u8>>) {
    into.extend(e.port_mut(s).take_tx().into_iter().map(|r| r.frame));
}

fn answer(e: &mut E, cmd: Cmd) -> Value {
    e.answer(cmd, Instant::now())
}

#[test]
fn packets_flow_through_workers_and_come_out_translated() {
    let mut opts = FtmbOptions::new("r1", 3);
    opts.batch_packets = 4;
    let mut e = engine("r1", opts);
    for sport in 1000..1030u16 {
        e.port_mut(Side::Inside).inject(&udp_out(sport));
    }
    let mut out = Vec::new();
    pump(&mut [&mut e], |es| {
        tx(es[0], Side::Outside, &mut out);
        out.len() >= 30
    });
    assert_eq!(out.len(), 30);
    let mut ports = std::collections::HashSet::new();
    for f in &out {
        let p = parsed(f);
        assert_eq!(p.src, IpAddr::V4(EXT_IP));
        assert_eq!((p.dst_mac, p.src_mac, p.ttl), (SERVER_MAC, OUT_MAC, 63));
        assert!(pliant_net::l4_checksum_ok(f, &p));
        assert!(p.sport >= PORT_BASE);
        assert!(ports.insert(p.sport), "two flows share port {}", p.sport);
    }
    // Replies find their mapping on the worker that owns the port.
    for &port in &ports {
        e.port_mut(Side::Outside).inject(&udp_back(port));
    }
    let mut back = Vec::new();
    pump(&mut [&mut e], |es| {
        tx(es[0], Side::Inside, &mut back);
        back.len() >= 30
    });
    let mut sports: Vec<u16> = back
        .iter()
        .map(|f| {
            let p = parsed(f);
            assert_eq!(p.dst, IpAddr::V4(CLIENT));
            p.dport
        })
        .collect();
    sports.sort_unstable();
    assert_eq!(sports, (1000..1030).collect::<Vec<_>>());
    let st = answer(&mut e, Cmd::FtmbStatus);
    assert_eq!(st["mode"], "ftmb");
    assert_eq!(st["workers"], 3);
    assert_eq!(st["protected"], false);
    assert_eq!(st["dispatch"]["dispatched"], 60);
    assert_eq!(st["release"]["released"], 60);
    // Unprotected: the in-process logger released all of it, each output audited.
    assert_eq!(st["local_audit"]["audit_checked"], 60, "{st}");
    assert_eq!(st["local_audit"]["audit_violations"], 0, "{st}");
    let busy = st["worker_stats"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|w| w["packets"].as_u64() > Some(0))
        .count();
    assert!(busy >= 2, "flows spread over the workers: {st}");
    assert_eq!(answer(&mut e, Cmd::HaStatus)["mode"], "ftmb");
    // `flows` lists the workers' flows (not the engine's empty table).
    let v = answer(&mut e, Cmd::Flows);
    assert_eq!(v["ok"], true, "{v}");
    assert_eq!(v["total"], 30, "{v}");
    assert_eq!(listed(&v), inside_keys(1000..1030));
    // The other flow-table requests stay refused.
    let refused = answer(&mut e, Cmd::SharedExport);
    assert_eq!(refused["ok"], false);
    assert!(refused["error"]
        .as_str()
        .unwrap()
        .contains("not supported in ftmb mode"));
}

/// The inside key of the test flow from client port `sport` (as `flows` lists it).
fn inside_key(sport: u16) -> String {
    FlowKey::new(proto::UDP, CLIENT.into(), sport, SERVER.into(), 53)
        .0
        .to_string()
}

fn inside_keys(sports: std::ops::Range<u16>) -> std::collections::BTreeSet<String> {
    sports.map(inside_key).collect()
}

/// The keys of a `flows` answer.
fn listed(v: &Value) -> std::collections::BTreeSet<String> {
    v["flows"]
        .as_array()
        .unwrap_or_else(|| panic!("no flows in {v}"))
        .iter()
        .map(|f| f["key"].as_str().unwrap().to_string())
        .collect()
}

/// A reply on external port `ext_port` that ends its flow at the NAT.
fn udp_fin(ext_port: u16) -> Vec<u8> {
    build::udp(
        SERVER_MAC,
        OUT_MAC,
        SERVER.into(),
        53,
        EXT_IP.into(),
        ext_port,
        FIN,
    )
}

/// A private temp dir for logger sockets, removed on drop (also when a test fails).
struct TempDir(std::path::PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let nonce = Instant::now().elapsed().as_nanos() ^ u128::from(std::process::id());
        let p = std::env::temp_dir().join(format!(
            "pliant-ftmb-rt-{tag}-{}-{nonce:x}",
            std::process::id()
        ));
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }

    fn sock(&self, name: &str) -> std::path::PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Replica `name`'s identity, issued by one CA per test process (the deployment's).
fn sec(name: &str) -> pliant_wire::Security {
    static CA: std::sync::OnceLock<pliant_wire::Ca> = std::sync::OnceLock::new();
    let ca = CA.get_or_init(|| pliant_wire::Ca::generate(None).unwrap());
    pliant_wire::Security::new(ca.issue(name, pliant_wire::role::REPLICA, 3600).unwrap())
}

/// Options of a replica `name` (with its own identity) that hosts a logger at `host` and
/// snapshots every `snap_ms`.
fn hosting(name: &str, host: &std::path::Path, snap_ms: u64) -> FtmbOptions {
    let mut o = FtmbOptions::new(name, 3);
    o.security = Some(sec(name));
    o.host_socket = Some(pliant_wire::Endpoint::Unix(host.to_path_buf()));
    o.snapshot_every = Duration::from_millis(snap_ms);
    o.batch_packets = 4;
    o
}

fn protect(e: &mut E, logger: &std::path::Path) {
    let v = answer(
        e,
        Cmd::FtmbProtect {
            logger: logger.to_str().unwrap().into(),
            host: None,
        },
    );
    assert_eq!(v["ok"], true, "{v}");
}

/// `ftmb_protect` with `host`: the logger must prove it is that replica. And a replica logs
/// only as itself: one whose identity is another replica's is refused by the logger.
#[test]
fn protect_checks_the_named_logger_host_and_the_logger_checks_the_master() {
    let dir = TempDir::new("ident");
    let sb = dir.sock("b.ftmb.sock");
    let mut a = engine("r1", hosting("r1", &dir.sock("a.ftmb.sock"), 10));
    let mut b = engine("r2", hosting("r2", &sb, 10));
    let logger = sb.to_str().unwrap().to_string();
    let ask = |e: &mut E, host: Option<&str>| {
        answer(
            e,
            Cmd::FtmbProtect {
                logger: logger.clone(),
                host: host.map(str::to_string),
            },
        )
    };
    let v = ask(&mut a, Some("r3"));
    assert_eq!(v["ok"], false, "{v}");
    assert!(
        v["error"].as_str().unwrap().contains("expected \"r3\""),
        "{v}"
    );
    assert_eq!(answer(&mut a, Cmd::FtmbStatus)["protected"], false);
    // A replica named r3 holding r1's identity: refused by the logger, counted there.
    let mut opts = hosting("r3", &dir.sock("c.ftmb.sock"), 10);
    opts.security = Some(sec("r1"));
    let mut c = engine("r3", opts);
    let v = ask(&mut c, Some("r2"));
    assert_eq!(v["ok"], false, "{v}");
    assert!(v["error"].as_str().unwrap().contains("certificate"), "{v}");
    let mut mismatches = Value::Null;
    pump(&mut [&mut b], |es| {
        mismatches =
            answer(es[0], Cmd::FtmbStatus)["hosting"]["server"]["identity_mismatch"].clone();
        mismatches.as_u64() >= Some(1)
    });
    assert_eq!(mismatches, 1);
    // The right host: protected.
    let v = ask(&mut a, Some("r2"));
    assert_eq!(v["ok"], true, "{v}");
}

/// External ports of translated inside->outside frames.
fn ext_ports(frames: &[Vec<u8>]) -> Vec<u16> {
    frames
        .iter()
        .map(|f| {
            let p = parsed(f);
            assert_eq!(p.src, IpAddr::V4(EXT_IP));
            p.sport
        })
        .collect()
}

#[test]
fn protected_output_is_released_by_the_logger_sent_by_its_master_and_snapshots_arrive() {
    let dir = TempDir::new("rel");
    let (sa, sb) = (dir.sock("a.ftmb.sock"), dir.sock("b.ftmb.sock"));
    let mut a = engine("r1", hosting("r1", &sa, 10));
    let mut b = engine("r2", hosting("r2", &sb, 10));
    protect(&mut a, &sb);
    for sport in 2000..2020u16 {
        a.port_mut(Side::Inside).inject(&udp_out(sport));
    }
    let mut at_b = Vec::new();
    let mut at_a = Vec::new();
    pump(&mut [&mut a, &mut b], |es| {
        tx(es[0], Side::Outside, &mut at_a);
        tx(es[1], Side::Outside, &mut at_b);
        at_a.len() >= 20
    });
    assert_eq!(at_a.len(), 20);
    assert!(
        at_b.is_empty(),
        "the logger host releases (confirms) a's output, a transmits it"
    );
    let ports: std::collections::HashSet<u16> = ext_ports(&at_a).into_iter().collect();
    assert_eq!(ports.len(), 20);
    // Deltas keep coming and the logger applies them.
    pump(&mut [&mut a, &mut b], |es| {
        let st = answer(es[0], Cmd::FtmbStatus);
        st["last_snapshot_acked"].as_u64().unwrap_or(0) >= 3
    });
    let st = answer(&mut a, Cmd::FtmbStatus);
    assert_eq!(st["protected"], true, "{st}");
    assert_eq!(st["logger"], sb.to_str().unwrap());
    assert!(st["snapshots"].as_u64().unwrap() >= 3, "{st}");
    assert_eq!(
        st["full_snapshots"], 1,
        "one full snapshot, then deltas: {st}"
    );
    // Protecting again to the same logger over a healthy session changes nothing: no new
    // epoch, no second full snapshot (a retry or a raced re-protection is harmless).
    let epoch = st["session_epoch"].clone();
    let again = answer(
        &mut a,
        Cmd::FtmbProtect {
            logger: sb.to_str().unwrap().into(),
            host: None,
        },
    );
    assert_eq!(again["unchanged"], true, "{again}");
    assert_eq!(again["epoch"], epoch, "{again}");
    let st = answer(&mut a, Cmd::FtmbStatus);
    assert_eq!(st["full_snapshots"], 1, "{st}");
    assert!(st["snapshot_pause_us_p50"].is_u64(), "{st}");
    assert!(st["snapshot_pause_us_p99"].is_u64(), "{st}");
    // b's `hosting` is the coordinator's cached copy of its server's status, refreshed
    // every tick: under load it may still be the one from before r1's session was up.
    // The 20 outputs b released for r1 were audited by b's logger as it confirmed them.
    let mut hosted = Value::Null;
    pump(&mut [&mut a, &mut b], |es| {
        hosted = answer(es[1], Cmd::FtmbStatus)["hosting"]["masters"]["r1"]["logger"].clone();
        hosted["audit_checked"].as_u64() >= Some(20)
    });
    assert_eq!(hosted["audit_violations"], 0, "{hosted}");
    assert_eq!(
        answer(&mut a, Cmd::FtmbStatus)["local_audit"]["audit_checked"],
        0,
        "nothing left through a's own logger"
    );
    let (checked, violations) = ftmb::audit_totals(&answer(&mut b, Cmd::FtmbStatus));
    assert!(checked >= 20 && violations == 0, "{checked} {violations}");
}

#[test]
fn recovery_on_the_logger_host_brings_the_flows_back_without_duplicates() {
    let dir = TempDir::new("rec");
    let (sa, sb) = (dir.sock("a.ftmb.sock"), dir.sock("b.ftmb.sock"));
    // Long snapshot interval: everything after the protect's full snapshot is replayed.
    let mut a = engine("r1", hosting("r1", &sa, 10_000));
    let mut b = engine("r2", hosting("r2", &sb, 10_000));
    // Five flows before the logger exists: released locally, carried by the full snapshot.
    for sport in 3000..3005u16 {
        a.port_mut(Side::Inside).inject(&udp_out(sport));
    }
    let mut at_a = Vec::new();
    pump(&mut [&mut a], |es| {
        tx(es[0], Side::Outside, &mut at_a);
        at_a.len() >= 5
    });
    protect(&mut a, &sb);
    // Ten new flows and a second packet of the first five: logged input, released by b's
    // logger, sent by a.
    for sport in 3000..3015u16 {
        a.port_mut(Side::Inside).inject(&udp_out(sport));
    }
    let mut at_b = Vec::new();
    pump(&mut [&mut a, &mut b], |es| {
        tx(es[0], Side::Outside, &mut at_b);
        at_b.len() >= 15
    });
    let old_ports: std::collections::HashSet<u16> = ext_ports(&at_a)
        .into_iter()
        .chain(ext_ports(&at_b))
        .collect();
    assert_eq!(old_ports.len(), 15, "15 flows, 15 external ports");
    // The primary dies.
    drop(a);
    let v = answer(
        &mut b,
        Cmd::FtmbActivate {
            primary: "r1".into(),
        },
    );
    assert_eq!(v["ok"], true, "{v}");
    assert_eq!(v["activated"], 15, "{v}");
    assert_eq!(v["replayed_packets"], 15, "{v}");
    assert_eq!(
        v["suppressed"], 15,
        "every replayed output was released before: {v}"
    );
    let flows = v["flows"].as_array().unwrap();
    assert!(flows
        .iter()
        .all(|f| f["aliases"].as_array().map(Vec::len) == Some(1)));
    // The host lists the recovered flows under the keys it handed over for steering (what
    // the controller's exception GC compares with): at once, no snapshot of b's own needed.
    let listing = answer(&mut b, Cmd::Flows);
    assert_eq!(listing["total"], 15, "{listing}");
    assert_eq!(listed(&listing), listed(&v));
    assert_eq!(listed(&v), inside_keys(3000..3015));
    let aliases = |v: &Value| -> std::collections::BTreeSet<String> {
        v["flows"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|f| f["aliases"].as_array().unwrap().clone())
            .map(|a| a.as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(aliases(&listing), aliases(&v));
    // Whatever the replay released is in b's release queue by now: one round sends it.
    b.poll_once(Instant::now());
    let mut dup = Vec::new();
    tx(&mut b, Side::Outside, &mut dup);
    assert!(
        dup.is_empty(),
        "no output released twice ({} frames)",
        dup.len()
    );
    // Replies reach the clients through the recovered mappings, on b's workers.
    for &port in &old_ports {
        b.port_mut(Side::Outside).inject(&udp_back(port));
    }
    let mut back = Vec::new();
    pump(&mut [&mut b], |es| {
        tx(es[0], Side::Inside, &mut back);
        back.len() >= 15
    });
    let mut sports: Vec<u16> = back.iter().map(|f| parsed(f).dport).collect();
    sports.sort_unstable();
    assert_eq!(sports, (3000..3015).collect::<Vec<_>>());
    // New packets of recovered flows keep their external port.
    for sport in 3000..3015u16 {
        b.port_mut(Side::Inside).inject(&udp_out(sport));
    }
    let mut again = Vec::new();
    pump(&mut [&mut b], |es| {
        tx(es[0], Side::Outside, &mut again);
        again.len() >= 15
    });
    for f in &again {
        assert!(
            old_ports.contains(&parsed(f).sport),
            "a recovered flow got a new port"
        );
    }
    let st = answer(&mut b, Cmd::FtmbStatus);
    assert_eq!(st["recoveries"][0]["primary"], "r1", "{st}");
    assert_eq!(st["recoveries"][0]["flows"], 15, "{st}");
    // b's in-process loggers released the 15 replies and the 15 new packets (the replay's
    // output was all suppressed; the recovered logger's earlier counts stay r1's).
    assert_eq!(st["local_audit"]["audit_checked"], 30, "{st}");
    assert_eq!(st["local_audit"]["audit_violations"], 0, "{st}");
    // A second activation of the same primary is refused (fenced, logs taken).
    let again = answer(
        &mut b,
        Cmd::FtmbActivate {
            primary: "r1".into(),
        },
    );
    assert_eq!(again["ok"], false, "{again}");
}

#[test]
fn a_lost_logger_falls_back_to_local_release_and_can_be_replaced() {
    let dir = TempDir::new("lost");
    let (sa, sb, sc) = (
        dir.sock("a.ftmb.sock"),
        dir.sock("b.ftmb.sock"),
        dir.sock("c.ftmb.sock"),
    );
    let mut a = engine("r1", hosting("r1", &sa, 10));
    let b = engine("r2", hosting("r2", &sb, 10));
    protect(&mut a, &sb);
    let first = answer(&mut a, Cmd::FtmbStatus)["session_epoch"]
        .as_u64()
        .expect("session epoch");
    // A process's first generation lies above any earlier process's (see front.rs).
    assert!(first > 1_000_000, "{first}");
    // The logger host dies: a notices (session stream closed) and releases output itself
    // (what b confirmed while it was going away was sent by a already).
    drop(b);
    let mut at_a = Vec::new();
    let mut sport = 4000u16;
    pump(&mut [&mut a], |es| {
        es[0].port_mut(Side::Inside).inject(&udp_out(sport));
        sport += 1;
        tx(es[0], Side::Outside, &mut at_a);
        // Output held when the logger died is released unaudited at the fallback; keep
        // sending until the fallback logger itself has released (and audited) some.
        let st = answer(es[0], Cmd::FtmbStatus);
        !at_a.is_empty()
            && st["fallbacks"] == 1
            && st["local_audit"]["audit_checked"].as_u64() >= Some(1)
    });
    let st = answer(&mut a, Cmd::FtmbStatus);
    assert_eq!(st["protected"], false, "{st}");
    assert_eq!(st["fallbacks"], 1, "{st}");
    assert!(st["logger"].is_null(), "{st}");
    // The fallback logger starts at the workers' PAL positions; its output is audited.
    assert!(
        st["local_audit"]["audit_checked"].as_u64() >= Some(1),
        "{st}"
    );
    assert_eq!(st["local_audit"]["audit_violations"], 0, "{st}");
    // A new logger: protected again, output is released there (and sent by a).
    let mut c = engine("r3", hosting("r3", &sc, 10));
    protect(&mut a, &sc);
    pump(&mut [&mut a, &mut c], |es| {
        tx(es[0], Side::Outside, &mut Vec::new());
        tx(es[1], Side::Outside, &mut Vec::new());
        answer(es[0], Cmd::FtmbStatus)["protected"] == true
    });
    a.port_mut(Side::Inside).inject(&udp_out(9999));
    let mut at_a = Vec::new();
    pump(&mut [&mut a, &mut c], |es| {
        tx(es[0], Side::Outside, &mut at_a);
        at_a.iter().any(|f| {
            let p = parsed(f);
            p.src == IpAddr::V4(EXT_IP) && p.dport == 53 && p.sport != 0
        }) && answer(es[1], Cmd::FtmbStatus)["hosting"]["masters"]["r1"]["logger"]["audit_checked"]
            .as_u64()
            >= Some(1)
    });
    let st = answer(&mut a, Cmd::FtmbStatus);
    assert_eq!(st["session_epoch"], first + 1, "{st}");
}

/// UDP from the client on `sport` carrying `n` (to check order and exactly-once).
fn udp_out_n(sport: u16, n: u32) -> Vec<u8> {
    build::udp(
        CLIENT_MAC,
        IN_MAC,
        CLIENT.into(),
        sport,
        SERVER.into(),
        53,
        &n.to_be_bytes(),
    )
}

/// The product's rule for a failover: flows of replicas that did not fail lose nothing. Here
/// the logger host dies with all of a's protected output in flight — a's batches sit unread
/// in its sockets (its input-log bound of 0 bytes keeps it from reading a queue stream), so
/// it has released none of them — and a has no other logger to go to. Every one of those
/// outputs must still leave a, exactly once, in each flow's order, after a falls back; and
/// none may leave before (the logger did not have their log). Before the master held its
/// own output, the host's death took them all with it (this waited for them in vain).
#[test]
fn output_in_flight_at_a_dying_logger_host_is_sent_once_in_order() {
    let dir = TempDir::new("inflight");
    let (sa, sb) = (dir.sock("a.ftmb.sock"), dir.sock("b.ftmb.sock"));
    let mut a = engine("r1", hosting("r1", &sa, 10_000));
    let mut ob = hosting("r2", &sb, 10_000);
    ob.host_options.max_input_bytes_per_queue = 0;
    let mut b = engine("r2", ob);
    protect(&mut a, &sb);
    // Three flows (on whatever queues they hash to), ten packets each, numbered.
    let (flows, per_flow) = (5000..5003u16, 10u32);
    for n in 0..per_flow {
        for sport in flows.clone() {
            a.port_mut(Side::Inside).inject(&udp_out_n(sport, n));
        }
    }
    let total = u64::from(per_flow) * flows.len() as u64;
    let mut at_a = Vec::new();
    let mut at_b = Vec::new();
    pump(&mut [&mut a, &mut b], |es| {
        tx(es[0], Side::Outside, &mut at_a);
        tx(es[1], Side::Outside, &mut at_b);
        let st = answer(es[0], Cmd::FtmbStatus);
        let ws = st["worker_stats"].as_array().cloned().unwrap_or_default();
        ws.iter()
            .map(|w| w["outputs"].as_u64().unwrap_or(0))
            .sum::<u64>()
            >= total
    });
    // Give the logger every chance to (wrongly) release: nothing may leave anywhere.
    for _ in 0..20 {
        a.poll_once(Instant::now());
        b.poll_once(Instant::now());
        std::thread::sleep(Duration::from_millis(1));
    }
    tx(&mut a, Side::Outside, &mut at_a);
    tx(&mut b, Side::Outside, &mut at_b);
    assert!(
        at_a.is_empty(),
        "{} sent before the logger released them",
        at_a.len()
    );
    assert!(
        at_b.is_empty(),
        "the logger host sent {} of a's outputs",
        at_b.len()
    );
    // The logger host dies.
    drop(b);
    pump(&mut [&mut a], |es| {
        tx(es[0], Side::Outside, &mut at_a);
        at_a.len() as u64 >= total
    });
    // A little longer: a duplicate would show up now.
    for _ in 0..20 {
        a.poll_once(Instant::now());
        std::thread::sleep(Duration::from_millis(1));
    }
    tx(&mut a, Side::Outside, &mut at_a);
    let mut seen: std::collections::BTreeMap<u16, Vec<u32>> = Default::default();
    let mut ports = std::collections::BTreeSet::new();
    for f in &at_a {
        let p = parsed(f);
        assert_eq!(p.src, IpAddr::V4(EXT_IP));
        ports.insert(p.sport);
        let off = usize::from(p.payload_off);
        let pl = &f[off..off + 4];
        seen.entry(p.sport)
            .or_default()
            .push(u32::from_be_bytes(pl.try_into().unwrap()));
    }
    assert_eq!(
        ports.len(),
        flows.len(),
        "one external port per flow: {seen:?}"
    );
    for (port, ns) in &seen {
        assert_eq!(
            ns,
            &(0..per_flow).collect::<Vec<_>>(),
            "flow on port {port}: every output once, in order"
        );
    }
    let st = answer(&mut a, Cmd::FtmbStatus);
    assert_eq!(st["fallbacks"], 1, "{st}");
    assert_eq!(st["held_released_at_fallback"], total, "{st}");
    assert_eq!(st["protected"], false, "{st}");
}

#[test]
fn packets_arriving_during_a_recovery_are_held_then_processed_in_order() {
    let dir = TempDir::new("hold");
    let mut b = engine("r2", hosting("r2", &dir.sock("b.ftmb.sock"), 10_000));
    // Keep the coordinator busy: a "logger" that accepts and never answers the handshake
    // (the protect attempt ends at the connect timeout), so the activation queued behind it
    // cannot have finished while the packets below arrive.
    let silent = dir.sock("silent.sock");
    let _listener = std::os::unix::net::UnixListener::bind(&silent).unwrap();
    let (ptx, prx) = std::sync::mpsc::sync_channel(1);
    b.submit(
        Cmd::FtmbProtect {
            logger: silent.to_str().unwrap().into(),
            host: None,
        },
        ptx,
        Instant::now(),
    );
    let (atx, arx) = std::sync::mpsc::sync_channel(1);
    b.submit(
        Cmd::FtmbActivate {
            primary: "nobody".into(),
        },
        atx,
        Instant::now(),
    );
    // One flow, ten packets numbered in their payload.
    for i in 0..10u8 {
        let f = build::udp(
            CLIENT_MAC,
            IN_MAC,
            CLIENT.into(),
            5000,
            SERVER.into(),
            53,
            &[i],
        );
        b.port_mut(Side::Inside).inject(&f);
    }
    b.poll_once(Instant::now());
    let st = answer(&mut b, Cmd::FtmbStatus);
    assert_eq!(st["dispatch"]["held_now"], 10, "{st}");
    assert_eq!(st["dispatch"]["recovering"], 1, "{st}");
    let mut out = Vec::new();
    pump(&mut [&mut b], |es| {
        tx(es[0], Side::Outside, &mut out);
        out.len() >= 10
    });
    // Both requests failed (no logger there, no logs of "nobody"), and nothing was lost.
    assert_eq!(prx.recv().unwrap()["ok"], false);
    let v = arx.recv().unwrap();
    assert_eq!(v["ok"], false);
    assert!(v["error"].as_str().unwrap().contains("nobody"), "{v}");
    let order: Vec<u8> = out
        .iter()
        .map(|f| f[usize::from(parsed(f).payload_off)])
        .collect();
    assert_eq!(
        order,
        (0..10).collect::<Vec<u8>>(),
        "held packets keep their order"
    );
    let st = answer(&mut b, Cmd::FtmbStatus);
    assert_eq!(st["dispatch"]["held"], 10, "{st}");
    assert_eq!(st["dispatch"]["held_dispatched"], 10, "{st}");
    assert_eq!(st["dispatch"]["held_now"], 0, "{st}");
}

#[test]
fn ha_status_and_metrics_show_the_ftmb_mode() {
    let mut e = engine("r1", FtmbOptions::new("r1", 2));
    e.port_mut(Side::Inside).inject(&udp_out(7000));
    let mut out = Vec::new();
    pump(&mut [&mut e], |es| {
        tx(es[0], Side::Outside, &mut out);
        !out.is_empty()
    });
    let v = answer(&mut e, Cmd::HaStatus);
    assert_eq!(v["mode"], "ftmb");
    assert_eq!(v["ftmb"]["workers"], 2, "{v}");
    let m = e.metrics(Instant::now());
    assert!(
        m.contains("pliant_ftmb_released_total{replica=\"r1\"} 1"),
        "{m}"
    );
    assert!(m.contains("pliant_ftmb_protected{replica=\"r1\"} 0"), "{m}");
    // Not in ftmb mode: the FTMB commands are refused, nothing else changes.
    let t0 = Instant::now();
    let nets = [
        SideNet {
            ifname: "in0".into(),
            addrs: vec![Cidr::parse("10.0.1.1/24").unwrap()],
            gateway: None,
        },
        SideNet {
            ifname: "out0".into(),
            addrs: vec![Cidr::parse("10.0.2.1/24").unwrap()],
            gateway: None,
        },
    ];
    let mut plain = Engine::new(
        "p",
        crate::forward::Forward::default(),
        [MemPort::new(IN_MAC), MemPort::new(OUT_MAC)],
        nets,
        EngineOptions::default(),
        t0,
    );
    let v = plain.answer(Cmd::FtmbStatus, t0);
    assert_eq!(v["ok"], false);
    assert!(
        v["error"].as_str().unwrap().contains("not in ftmb mode"),
        "{v}"
    );
    assert!(!plain.metrics(t0).contains("pliant_ftmb_"));
}

#[test]
fn flows_carried_by_deltas_are_recovered_without_replay() {
    let dir = TempDir::new("delta");
    let (sa, sb) = (dir.sock("a.ftmb.sock"), dir.sock("b.ftmb.sock"));
    let mut a = engine("r1", hosting("r1", &sa, 10));
    let mut b = engine("r2", hosting("r2", &sb, 10));
    protect(&mut a, &sb);
    for sport in 8000..8010u16 {
        a.port_mut(Side::Inside).inject(&udp_out(sport));
    }
    // Released by b's logger, sent by a.
    let mut at_b = Vec::new();
    pump(&mut [&mut a, &mut b], |es| {
        tx(es[0], Side::Outside, &mut at_b);
        at_b.len() >= 10
    });
    // Two more snapshots applied after the traffic: the flows are in the logger's image.
    let acked = |e: &mut E| answer(e, Cmd::FtmbStatus)["last_snapshot_acked"].as_u64();
    let base = acked(&mut a).unwrap_or(0);
    pump(&mut [&mut a, &mut b], |es| {
        acked(es[0]).unwrap_or(0) >= base + 2
    });
    drop(a);
    let v = answer(
        &mut b,
        Cmd::FtmbActivate {
            primary: "r1".into(),
        },
    );
    assert_eq!(v["ok"], true, "{v}");
    assert_eq!(v["activated"], 10, "{v}");
    assert_eq!(
        v["replayed_packets"], 0,
        "everything was in the snapshot: {v}"
    );
    for port in ext_ports(&at_b) {
        b.port_mut(Side::Outside).inject(&udp_back(port));
    }
    let mut back = Vec::new();
    pump(&mut [&mut b], |es| {
        tx(es[0], Side::Inside, &mut back);
        back.len() >= 10
    });
    let mut sports: Vec<u16> = back.iter().map(|f| parsed(f).dport).collect();
    sports.sort_unstable();
    assert_eq!(sports, (8000..8010).collect::<Vec<_>>());
}

#[test]
fn flows_lists_the_workers_flows_and_forgets_the_ended_ones_protected_or_not() {
    let dir = TempDir::new("flows");
    let (sa, sb) = (dir.sock("a.ftmb.sock"), dir.sock("b.ftmb.sock"));
    let mut a = engine("r1", hosting("r1", &sa, 10));
    let mut b = engine("r2", hosting("r2", &sb, 10));
    // Unprotected (no snapshots): `flows` takes the workers' deltas itself.
    assert_eq!(answer(&mut a, Cmd::Flows)["total"], 0);
    for sport in 6000..6008u16 {
        a.port_mut(Side::Inside).inject(&udp_out(sport));
    }
    let mut out = Vec::new();
    pump(&mut [&mut a], |es| {
        tx(es[0], Side::Outside, &mut out);
        out.len() >= 8
    });
    let ports: Vec<u16> = ext_ports(&out);
    let v = answer(&mut a, Cmd::Flows);
    assert_eq!(
        (v["ok"].clone(), v["total"].clone()),
        (json!(true), json!(8)),
        "{v}"
    );
    assert_eq!(v["listed"], 8, "{v}");
    assert_eq!(listed(&v), inside_keys(6000..6008));
    // Each flow's alias is its outside tuple (what replies arrive with).
    let outside = |p: u16| FlowKey::new(proto::UDP, EXT_IP.into(), p, SERVER.into(), 53).0;
    let by_alias: std::collections::HashMap<String, String> = v["flows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            (
                f["aliases"][0].as_str().unwrap_or("").to_string(),
                f["key"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    for f in v["flows"].as_array().unwrap() {
        let al = f["aliases"].as_array().unwrap();
        assert_eq!(al.len(), 1, "{f}");
        let alias: FlowKey = al[0].as_str().unwrap().parse().unwrap();
        assert!(ports.iter().any(|p| outside(*p) == alias), "{f}");
    }
    // Two flows end: they leave the listing.
    for &p in &ports[..2] {
        a.port_mut(Side::Outside).inject(&udp_fin(p));
    }
    let mut back = Vec::new();
    pump(&mut [&mut a], |es| {
        tx(es[0], Side::Inside, &mut back);
        back.len() >= 2
    });
    let ended: std::collections::BTreeSet<String> =
        back.iter().map(|f| inside_key(parsed(f).dport)).collect();
    pump(&mut [&mut a], |es| answer(es[0], Cmd::Flows)["total"] == 6);
    let v = answer(&mut a, Cmd::Flows);
    let left = listed(&v);
    assert_eq!(left.len(), 6);
    assert!(left.is_disjoint(&ended), "{v}");
    // The engine's own bound on listed flows applies.
    a.opts.max_listed_flows = 4;
    let v = answer(&mut a, Cmd::Flows);
    assert_eq!(
        (v["total"].clone(), v["listed"].clone()),
        (json!(6), json!(4)),
        "{v}"
    );
    a.opts.max_listed_flows = 1000;
    // Protected: the periodic snapshots' deltas keep the listing current.
    protect(&mut a, &sb);
    assert_eq!(answer(&mut a, Cmd::Flows)["total"], 6);
    a.port_mut(Side::Inside).inject(&udp_out(6100));
    let fin_port = ports[2];
    a.port_mut(Side::Outside).inject(&udp_fin(fin_port));
    let fin_key = &by_alias[&outside(fin_port).to_string()];
    let want: std::collections::BTreeSet<String> = left
        .iter()
        .filter(|k| *k != fin_key)
        .cloned()
        .chain([inside_key(6100)])
        .collect();
    let mut keys = std::collections::BTreeSet::new();
    pump(&mut [&mut a, &mut b], |es| {
        tx(es[1], Side::Outside, &mut Vec::new());
        tx(es[1], Side::Inside, &mut Vec::new());
        keys = listed(&answer(es[0], Cmd::Flows));
        keys == want
    });
    let st = answer(&mut a, Cmd::FtmbStatus);
    assert_eq!(
        st["full_snapshots"], 1,
        "listing never forces a full snapshot: {st}"
    );
}

/// Recoveries chain: a host that recovered a primary's flows keeps them through its own
/// logger's death, a fallback, a new logger and then its own death — the next host brings
/// every one of them back with its external port (they reached the new logger only through
/// the host's full snapshots, never as logged input of a packet that created them).
#[test]
fn flows_a_host_recovered_survive_its_own_recovery_after_a_new_logger() {
    let dir = TempDir::new("chain");
    let s = |n: &str| dir.sock(&format!("{n}.ftmb.sock"));
    let mut a = engine("r1", hosting("r1", &s("a"), 10));
    let mut b = engine("r2", hosting("r2", &s("b"), 10));
    let mut c = engine("r3", hosting("r3", &s("c"), 10));
    protect(&mut a, &s("b"));
    protect(&mut b, &s("c"));
    for sport in 5000..5010u16 {
        a.port_mut(Side::Inside).inject(&udp_out(sport));
    }
    // Released by b's logger, sent by a (the name says whose logger released it).
    let mut at_b = Vec::new();
    pump(&mut [&mut a, &mut b, &mut c], |es| {
        tx(es[0], Side::Outside, &mut at_b);
        at_b.len() >= 10
    });
    let ports: std::collections::BTreeSet<u16> = ext_ports(&at_b).into_iter().collect();
    assert_eq!(ports.len(), 10);
    drop(a);
    let v = answer(
        &mut b,
        Cmd::FtmbActivate {
            primary: "r1".into(),
        },
    );
    assert_eq!(v["activated"], 10, "{v}");
    // Traffic on the recovered flows through b (released by b's logger host c, sent by b).
    let mut at_c = Vec::new();
    for sport in 5000..5010u16 {
        b.port_mut(Side::Inside).inject(&udp_out(sport));
    }
    pump(&mut [&mut b, &mut c], |es| {
        tx(es[0], Side::Outside, &mut at_c);
        at_c.len() >= 10
    });
    // b's logger host dies: b falls back, then logs to a new host d.
    drop(c);
    let mut at_b2 = Vec::new();
    pump(&mut [&mut b], |es| {
        es[0].port_mut(Side::Inside).inject(&udp_out(5000));
        tx(es[0], Side::Outside, &mut at_b2);
        !at_b2.is_empty()
    });
    let mut d = engine("r4", hosting("r4", &s("d"), 10));
    protect(&mut b, &s("d"));
    let mut at_d = Vec::new();
    for sport in 5000..5010u16 {
        b.port_mut(Side::Inside).inject(&udp_out(sport));
    }
    pump(&mut [&mut b, &mut d], |es| {
        tx(es[0], Side::Outside, &mut at_d);
        at_d.len() >= 10
    });
    for f in at_c.iter().chain(&at_b2).chain(&at_d) {
        assert!(
            ports.contains(&parsed(f).sport),
            "a recovered flow got a new port"
        );
    }
    drop(b);
    let v = answer(
        &mut d,
        Cmd::FtmbActivate {
            primary: "r2".into(),
        },
    );
    assert_eq!(v["ok"], true, "{v}");
    assert_eq!(v["activated"], 10, "{v}");
    for &port in &ports {
        d.port_mut(Side::Outside).inject(&udp_back(port));
    }
    let mut back = Vec::new();
    pump(&mut [&mut d], |es| {
        tx(es[0], Side::Inside, &mut back);
        back.len() >= 10
    });
    let mut sports: Vec<u16> = back.iter().map(|f| parsed(f).dport).collect();
    sports.sort_unstable();
    assert_eq!(sports, (5000..5010).collect::<Vec<_>>());
}

/// `ftmb_hold` (sent by the controller before it re-homes the primary's traffic here) holds
/// packets until the activation of that primary, which takes the hold over; a hold whose
/// activation never comes ends after `hold_limit`. Either way nothing is lost or reordered.
#[test]
fn a_hold_before_the_activation_keeps_packets_until_it_ends() {
    let dir = TempDir::new("prehold");
    let mut opts = hosting("r2", &dir.sock("b.ftmb.sock"), 10_000);
    opts.hold_limit = Duration::from_millis(50);
    let mut b = engine("r2", opts);
    let numbered = |i: u8| {
        build::udp(
            CLIENT_MAC,
            IN_MAC,
            CLIENT.into(),
            5100,
            SERVER.into(),
            53,
            &[i],
        )
    };
    let order = |out: &[Vec<u8>]| -> Vec<u8> {
        out.iter()
            .map(|f| f[usize::from(parsed(f).payload_off)])
            .collect()
    };
    // 1. Hold, packets arrive, the activation (of a primary with no logs here: it fails)
    //    takes the hold over and its end releases them.
    let v = answer(
        &mut b,
        Cmd::FtmbHold {
            primary: "r7".into(),
        },
    );
    assert_eq!(v["ok"], true, "{v}");
    for i in 0..5u8 {
        b.port_mut(Side::Inside).inject(&numbered(i));
    }
    b.poll_once(Instant::now());
    let st = answer(&mut b, Cmd::FtmbStatus);
    assert_eq!(st["dispatch"]["held_now"], 5, "{st}");
    assert_eq!(st["dispatch"]["recovering"], 1, "{st}");
    let v = answer(
        &mut b,
        Cmd::FtmbActivate {
            primary: "r7".into(),
        },
    );
    assert_eq!(v["ok"], false, "{v}");
    let mut out = Vec::new();
    pump(&mut [&mut b], |es| {
        tx(es[0], Side::Outside, &mut out);
        out.len() >= 5
    });
    assert_eq!(order(&out), (0..5).collect::<Vec<u8>>());
    let st = answer(&mut b, Cmd::FtmbStatus);
    assert_eq!(
        st["dispatch"]["recovering"], 0,
        "the activation took the hold: {st}"
    );
    assert_eq!(st["dispatch"]["holds"], 1, "{st}");
    assert_eq!(st["dispatch"]["holds_expired"], 0, "{st}");
    // 2. A hold whose activation never comes ends by itself.
    let v = answer(
        &mut b,
        Cmd::FtmbHold {
            primary: "r8".into(),
        },
    );
    assert_eq!(v["ok"], true, "{v}");
    for i in 5..10u8 {
        b.port_mut(Side::Inside).inject(&numbered(i));
    }
    let mut out = Vec::new();
    pump(&mut [&mut b], |es| {
        tx(es[0], Side::Outside, &mut out);
        out.len() >= 5
    });
    assert_eq!(order(&out), (5..10).collect::<Vec<u8>>());
    let st = answer(&mut b, Cmd::FtmbStatus);
    assert_eq!(st["dispatch"]["holds_expired"], 1, "{st}");
    assert_eq!(st["dispatch"]["recovering"], 0, "{st}");
    assert_eq!(st["dispatch"]["held"], 10, "{st}");
}
