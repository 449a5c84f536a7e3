//! The real FTMB NAT (`pliant_nf_nat::ftmb::FtmbNat`) on the runtime's FTMB mode, two engines
//! on in-memory ports in one process (no root, no namespaces): the primary logs to a logger
//! hosted by the second engine over a real unix socket, its output leaves through the second
//! engine; the primary dies; the second engine recovers it by replay and translates the
//! recovered flows both ways with their original external ports, releasing nothing twice.
//! The lab-based end-to-end test with SIGKILL is `e2e_ftmb.rs`.

use pliant_io::MemPort;
use pliant_nf_nat::ftmb::FtmbNat;
use pliant_runtime::config::Cidr;
use pliant_runtime::control::Cmd;
use pliant_runtime::engine::{Engine, EngineOptions};
use pliant_runtime::ftmb::{self, FtmbOptions, FtmbShell};
use pliant_runtime::net::{arp, build, Frame, Parsed};
use pliant_runtime::route::SideNet;
use pliant_runtime::Side;
use serde_json::Value;
use std::collections::HashSet;
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const IN_MAC: [u8; 6] = [0x02, 0, 0, 0, 1, 1];
const OUT_MAC: [u8; 6] = [0x02, 0, 0, 0, 2, 1];
const CLIENT_MAC: [u8; 6] = [0x02, 0, 0, 0, 1, 2];
const SERVER_MAC: [u8; 6] = [0x02, 0, 0, 0, 2, 2];
const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 0, 1, 2);
const SERVER: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 2);
const EXT: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 1);

type E = Engine<FtmbShell<FtmbNat>, MemPort>;

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Replica `name`'s identity from the test's CA (the logger requires the replica role and
/// that each master logs under its own certified name).
fn sec(name: &str) -> pliant_wire::Security {
    static CA: std::sync::OnceLock<pliant_wire::Ca> = std::sync::OnceLock::new();
    let ca = CA.get_or_init(|| pliant_wire::Ca::generate(None).unwrap());
    pliant_wire::Security::new(ca.issue(name, pliant_wire::role::REPLICA, 3600).unwrap())
}

fn engine(name: &str, ports: (u16, u16), host: &Path) -> E {
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
    let mut cfg = pliant_nf_nat::Config::with_external_ip(EXT);
    cfg.port_blocks = vec![ports];
    let mut o = FtmbOptions::new(name, 2);
    o.security = Some(sec(name));
    o.host_socket = Some(pliant_wire::Endpoint::Unix(host.to_path_buf()));
    // Long: everything after the protect's full snapshot is recovered by replay.
    o.snapshot_every = Duration::from_secs(30);
    e.set_ftmb(ftmb::start(FtmbNat::new(cfg).unwrap(), o).unwrap());
    e.port_mut(Side::Inside).inject(&arp::request(
        CLIENT_MAC,
        CLIENT,
        Ipv4Addr::new(10, 0, 1, 1),
        None,
    ));
    e.port_mut(Side::Outside)
        .inject(&arp::request(SERVER_MAC, SERVER, EXT, None));
    e.poll_once(Instant::now());
    e.port_mut(Side::Inside).take_tx();
    e.port_mut(Side::Outside).take_tx();
    e
}

fn parsed(f: &[u8]) -> Parsed {
    match pliant_runtime::net::parse(f) {
        Ok(Frame::Ip(p)) => p,
        other => panic!("not IP: {other:?}"),
    }
}

fn tx(e: &mut E, s: Side) -> Vec<Vec<u8>> {
    e.port_mut(s)
        .take_tx()
        .into_iter()
        .map(|r| r.frame)
        .collect()
}

/// Polls the engines until `n` frames left `e[which]` on `side`; a hang guard, not a timing
/// assertion.
fn collect(es: &mut [&mut E], which: usize, side: Side, n: usize) -> Vec<Vec<u8>> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut got = Vec::new();
    while got.len() < n {
        assert!(
            Instant::now() < deadline,
            "only {} of {n} frames",
            got.len()
        );
        for e in es.iter_mut() {
            e.poll_once(Instant::now());
        }
        got.extend(tx(es[which], side));
        std::thread::sleep(Duration::from_micros(200));
    }
    got
}

fn ask(e: &mut E, cmd: Cmd) -> Value {
    e.answer(cmd, Instant::now())
}

#[test]
fn ftmb_nat_recovers_on_the_logger_host_with_the_same_ports() {
    let dir = TempDir(std::env::temp_dir().join(format!("pliant-ftmb-nat-{}", std::process::id())));
    std::fs::create_dir_all(&dir.0).unwrap();
    let (sa, sb) = (dir.0.join("a.ftmb.sock"), dir.0.join("b.ftmb.sock"));
    let mut a = engine("r1", (20000, 20999), &sa);
    let mut b = engine("r2", (30000, 30999), &sb);
    let udp = |sport: u16, tag: u8| {
        build::udp(
            CLIENT_MAC,
            IN_MAC,
            CLIENT.into(),
            sport,
            SERVER.into(),
            53,
            &[tag],
        )
    };
    // Four flows before protection (in the full snapshot), eight after (replayed).
    for sport in 6000..6004 {
        a.port_mut(Side::Inside).inject(&udp(sport, 0));
    }
    let first = collect(&mut [&mut a], 0, Side::Outside, 4);
    let v = ask(
        &mut a,
        Cmd::FtmbProtect {
            logger: sb.to_str().unwrap().into(),
            host: Some("r2".into()),
        },
    );
    assert_eq!(v["ok"], true, "{v}");
    for sport in 6000..6012 {
        a.port_mut(Side::Inside).inject(&udp(sport, 1));
    }
    // Released by r2's logger, sent by the primary itself (output held by the logger host
    // would die with it).
    let second = collect(&mut [&mut a, &mut b], 0, Side::Outside, 12);
    assert!(
        tx(&mut b, Side::Outside).is_empty(),
        "the logger host sends none of the primary's output"
    );
    let mut port_of = std::collections::HashMap::new();
    for f in first.iter().chain(&second) {
        let p = parsed(f);
        assert_eq!(p.src, IpAddr::V4(EXT));
        assert!((20000..=20999).contains(&p.sport), "port from r1's block");
        port_of.entry(p.sport).or_insert(p.sport);
    }
    assert_eq!(port_of.len(), 12, "12 flows, 12 ports");
    drop(a);
    let v = ask(
        &mut b,
        Cmd::FtmbActivate {
            primary: "r1".into(),
        },
    );
    assert_eq!(v["ok"], true, "{v}");
    assert_eq!(v["activated"], 12, "{v}");
    assert_eq!(v["replayed_packets"], 12, "{v}");
    assert_eq!(v["suppressed"], 12, "{v}");
    b.poll_once(Instant::now());
    assert!(
        tx(&mut b, Side::Outside).is_empty(),
        "nothing released twice"
    );
    // Replies to the recovered ports reach the client's original ports.
    for &port in port_of.keys() {
        let f = build::udp(
            SERVER_MAC,
            OUT_MAC,
            SERVER.into(),
            53,
            EXT.into(),
            port,
            b"r",
        );
        b.port_mut(Side::Outside).inject(&f);
    }
    let back = collect(&mut [&mut b], 0, Side::Inside, 12);
    let got: HashSet<u16> = back.iter().map(|f| parsed(f).dport).collect();
    assert_eq!(got, (6000..6012).collect::<HashSet<u16>>());
    // New packets of the recovered flows keep their ports; a new flow takes one of r2's.
    for sport in 6000..6013 {
        b.port_mut(Side::Inside).inject(&udp(sport, 2));
    }
    let again = collect(&mut [&mut b], 0, Side::Outside, 13);
    let mut fresh = 0;
    for f in &again {
        let p = parsed(f);
        if p.sport >= 30000 {
            fresh += 1;
        } else {
            assert!(
                port_of.contains_key(&p.sport),
                "a recovered flow got a new port"
            );
        }
    }
    assert_eq!(fresh, 1, "only the new flow allocates from r2's block");
}
