//! End-to-end steering through a real fabric namespace: frames injected on the client or server
//! side with AF_PACKET, arrival observed with AF_PACKET sockets on each replica's ports.
//! Root only (loads BPF, creates namespaces).

mod common;

use common::{count_marked, Fixture, Port};
use pliant_net::build;
use pliant_state::key::proto;
use pliant_state::FlowKey;
use pliant_steer::lab::lab_ports;
use pliant_steer::layout::Stat;
use pliant_steer::{Steer, SteerOptions};
use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

const CMAC: [u8; 6] = [2, 0x70, 0x6c, 0, 1, 2];
const GMAC: [u8; 6] = [2, 0x70, 0x6c, 0, 1, 1];
const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 77, 1, 2);
const SERVER: Ipv4Addr = Ipv4Addr::new(10, 77, 2, 2);
const NAT: Ipv4Addr = Ipv4Addr::new(10, 77, 2, 1);
const WAIT: Duration = Duration::from_millis(80);

struct Rig {
    steer: Steer,
    client: Port,
    server: Port,
    rin: Vec<Port>,
    rout: Vec<Port>,
    // Last: namespaces go after the sockets and the steering that live in them.
    _fx: Fixture,
}

fn rig(n: u8) -> Rig {
    let fx = Fixture::new(n);
    let mut steer =
        Steer::attach(&fx.fabric(), &lab_ports(n), &SteerOptions::default()).expect("attach");
    let live: Vec<u32> = (1..=u32::from(n)).collect();
    steer.set_ring_maglev(&live, 4099).expect("ring");
    let client = Port::open(&fx.client(), "client0");
    let server = Port::open(&fx.server(), "server0");
    let rin = (1..=n)
        .map(|i| Port::open(&fx.replica(i), &format!("r{i}in")))
        .collect();
    let rout = (1..=n)
        .map(|i| Port::open(&fx.replica(i), &format!("r{i}out")))
        .collect();
    Rig {
        steer,
        client,
        server,
        rin,
        rout,
        _fx: fx,
    }
}

fn marker(tag: &str, n: u32) -> Vec<u8> {
    format!("PLIANT-STEER-{tag}-{n:08}").into_bytes()
}

/// Replica numbers (1-based) whose ports in `ports` received a frame carrying `m`.
fn arrived(ports: &[Port], m: &[u8]) -> Vec<u32> {
    let mut out = Vec::new();
    for (i, p) in ports.iter().enumerate() {
        let got = count_marked(&p.recv_for(WAIT), m);
        for _ in 0..got {
            out.push(i as u32 + 1);
        }
    }
    out
}

fn c2s(sport: u16, dport: u16, m: &[u8]) -> Vec<u8> {
    build::udp(
        CMAC,
        GMAC,
        IpAddr::V4(CLIENT),
        sport,
        IpAddr::V4(SERVER),
        dport,
        m,
    )
}

fn s2c(sport: u16, dport: u16, m: &[u8]) -> Vec<u8> {
    build::udp(
        GMAC,
        CMAC,
        IpAddr::V4(SERVER),
        sport,
        IpAddr::V4(CLIENT),
        dport,
        m,
    )
}

fn key(sport: u16, dport: u16) -> FlowKey {
    FlowKey::v4(proto::UDP, CLIENT, sport, SERVER, dport).0
}

#[test]
fn ring_default_spreads_flows_and_both_directions_meet_at_one_replica() {
    if !pliant_testkit::require_root() {
        return;
    }
    let r = rig(3);
    let mut used = std::collections::BTreeSet::new();
    for f in 0..24u32 {
        let sport = 20_000 + f as u16;
        let m = marker("ring", f);
        r.client.send(&c2s(sport, 53, &m));
        let want = r.steer.ring_owner(&key(sport, 53)).expect("ring owner");
        let got = arrived(&r.rin, &m);
        assert_eq!(got, vec![want.expect("owned")], "flow {f} client->server");
        assert_eq!(r.steer.conn_owner(&key(sport, 53)).expect("conn"), want);
        used.insert(got[0]);
        let m2 = marker("ring-back", f);
        r.server.send(&s2c(53, sport, &m2));
        assert_eq!(arrived(&r.rout, &m2), got, "flow {f} server->client");
    }
    assert!(used.len() >= 2, "24 flows all on {used:?}");
    let st = r.steer.stats().expect("stats");
    assert_eq!(st.get(Stat::Ring), 24);
    assert_eq!(st.get(Stat::Conn), 24, "return packets hit the conn pin");
}

#[test]
fn exception_overrides_conn_pin_and_ring() {
    if !pliant_testkit::require_root() {
        return;
    }
    let mut r = rig(3);
    let k = key(30_000, 80);
    r.client.send(&c2s(30_000, 80, &marker("exc", 0)));
    let first = arrived(&r.rin, &marker("exc", 0));
    assert_eq!(first.len(), 1);
    let other = if first[0] == 3 { 1 } else { first[0] + 1 };
    r.steer.set_exception(&k, other).expect("exception");
    r.client.send(&c2s(30_000, 80, &marker("exc", 1)));
    assert_eq!(arrived(&r.rin, &marker("exc", 1)), vec![other]);
    r.server.send(&s2c(80, 30_000, &marker("exc", 2)));
    assert_eq!(arrived(&r.rout, &marker("exc", 2)), vec![other]);
    assert!(r.steer.remove_exception(&k).expect("remove"));
    assert!(!r.steer.remove_exception(&k).expect("remove again"));
    r.client.send(&c2s(30_000, 80, &marker("exc", 3)));
    assert_eq!(
        arrived(&r.rin, &marker("exc", 3)),
        first,
        "back to the pinned owner"
    );
    assert_eq!(r.steer.stats().expect("stats").get(Stat::Exception), 2);
}

#[test]
fn conn_pins_survive_a_ring_change_and_new_flows_follow_the_new_ring() {
    if !pliant_testkit::require_root() {
        return;
    }
    let mut r = rig(3);
    r.client.send(&c2s(31_000, 80, &marker("pin", 0)));
    let old = arrived(&r.rin, &marker("pin", 0));
    assert_eq!(old.len(), 1);
    let only = if old[0] == 1 { 2 } else { 1 };
    r.steer.set_ring_maglev(&[only], 4099).expect("new ring");
    r.client.send(&c2s(31_000, 80, &marker("pin", 1)));
    assert_eq!(
        arrived(&r.rin, &marker("pin", 1)),
        old,
        "existing flow stays"
    );
    for f in 0..5u32 {
        let m = marker("pin-new", f);
        r.client.send(&c2s(32_000 + f as u16, 80, &m));
        assert_eq!(arrived(&r.rin, &m), vec![only], "new flow {f}");
    }
    // Flushing the old owner's pins lets its flows follow the ring again.
    assert!(r.steer.flush_conn_for(old[0]).expect("flush") >= 1);
    r.client.send(&c2s(31_000, 80, &marker("pin", 2)));
    assert_eq!(arrived(&r.rin, &marker("pin", 2)), vec![only]);
}

#[test]
fn nat_return_traffic_is_steered_by_port_owner() {
    if !pliant_testkit::require_root() {
        return;
    }
    let mut r = rig(3);
    r.steer.add_nat_addr(IpAddr::V4(NAT)).expect("nat addr");
    r.steer
        .set_port_owner(40_000..=40_999, Some(2))
        .expect("block 2");
    r.steer
        .set_port_owner(41_000..=41_999, Some(3))
        .expect("block 3");
    assert_eq!(r.steer.port_owner(40_500).expect("po"), Some(2));
    assert_eq!(r.steer.port_owner(39_999).expect("po"), None);
    for (i, (port, want)) in [(40_000u16, 2u32), (40_999, 2), (41_234, 3), (40_777, 2)]
        .into_iter()
        .enumerate()
    {
        let m = marker("nat", i as u32);
        let f = build::udp(
            GMAC,
            GMAC,
            IpAddr::V4(SERVER),
            80,
            IpAddr::V4(NAT),
            port,
            &m,
        );
        r.server.send(&f);
        assert_eq!(arrived(&r.rout, &m), vec![want], "port {port}");
    }
    assert_eq!(r.steer.stats().expect("stats").get(Stat::Port), 4);
    // An ICMP error about a translated packet (NAT:41_500 -> server) goes to the port's owner.
    let orig = build::udp(
        GMAC,
        GMAC,
        IpAddr::V4(NAT),
        41_500,
        IpAddr::V4(SERVER),
        80,
        b"q",
    );
    let mut inner = orig[14..14 + 28].to_vec();
    let m = marker("nat-icmp", 0);
    inner.extend_from_slice(&m);
    let err = build::icmp(
        GMAC,
        GMAC,
        IpAddr::V4(SERVER),
        IpAddr::V4(NAT),
        proto::ICMP,
        3,
        3,
        [0, 0],
        &inner,
    );
    r.server.send(&err);
    assert_eq!(
        arrived(&r.rout, &m),
        vec![3],
        "ICMP error to the NAT port's owner"
    );
    // Non-NAT destination with the same port: ring, not port_owner.
    let m = marker("nat", 9);
    r.server.send(&s2c(80, 40_000, &m));
    let want = r.steer.ring_owner(&key(40_000, 80)).expect("owner");
    assert_eq!(arrived(&r.rout, &m), vec![want.expect("owned")]);
}

/// A server's packet to a NAT port nobody owns goes by the ring but leaves no pin: when the
/// port's block is given to a replica later (a failed replica's index reused), that replica's
/// return traffic for the port reaches it by port owner instead of following the stray packet.
#[test]
fn a_packet_to_an_unowned_nat_port_leaves_no_pin() {
    if !pliant_testkit::require_root() {
        return;
    }
    let mut r = rig(3);
    r.steer.add_nat_addr(IpAddr::V4(NAT)).expect("nat addr");
    let port = 42_424u16;
    let k = FlowKey::v4(proto::UDP, SERVER, 80, NAT, port).0;
    let to_nat =
        |m: &[u8]| build::udp(GMAC, GMAC, IpAddr::V4(SERVER), 80, IpAddr::V4(NAT), port, m);
    let by_ring = r.steer.ring_owner(&k).expect("ring").expect("owned");
    let m = marker("stray", 0);
    r.server.send(&to_nat(&m));
    assert_eq!(
        arrived(&r.rout, &m),
        vec![by_ring],
        "an unowned port goes by the ring"
    );
    assert!(
        !r.steer
            .conn_entries()
            .expect("conn")
            .iter()
            .any(|(c, _)| *c == k),
        "an unowned NAT port was pinned"
    );
    let owner = (1..=3).find(|i| *i != by_ring).expect("another replica");
    r.steer
        .set_port_owner(42_000..=42_999, Some(owner))
        .expect("block");
    let m = marker("owned", 0);
    r.server.send(&to_nat(&m));
    assert_eq!(arrived(&r.rout, &m), vec![owner], "the block's new owner");
}

/// `frame` (IPv4, DF clear) with IP id `id`, cut into fragments of at most 1500 bytes.
fn fragments(mut frame: Vec<u8>, id: u16) -> Vec<Vec<u8>> {
    frame[18..20].copy_from_slice(&id.to_be_bytes());
    frame[20..22].copy_from_slice(&[0, 0]); // DF clear
    pliant_net::checksum::set_ipv4_header_checksum(&mut frame[14..34]);
    let Ok(pliant_net::Frame::Ip(p)) = pliant_net::parse(&frame) else {
        panic!("not IP");
    };
    pliant_net::frag::fragment_v4(&frame, &p, 1500).expect("fragment")
}

/// Every fragment of a datagram reaches the replica its first fragment went to (the later ones
/// carry no ports, so the flow's key cannot steer them), in both directions; a later fragment
/// whose first one was never seen is counted and steered by its ports-less key.
#[test]
fn every_fragment_of_a_datagram_follows_the_first_one() {
    if !pliant_testkit::require_root() {
        return;
    }
    let mut r = rig(3);
    r.steer.add_nat_addr(IpAddr::V4(NAT)).expect("nat addr");
    r.steer
        .set_port_owner(40_000..=40_999, Some(3))
        .expect("block 3");
    let big = vec![0x5au8; 4000];
    let mut owners = std::collections::BTreeSet::new();
    let mut later = 0u64;
    for f in 0..12u32 {
        let sport = 30_000 + f as u16;
        let want = r
            .steer
            .ring_owner(&key(sport, 53))
            .expect("ring")
            .expect("owned");
        owners.insert(want);
        // The marker sits at the end of the payload: only the last fragment carries it.
        let mut payload = big.clone();
        let m = marker("frag", f);
        payload.extend_from_slice(&m);
        let frags = fragments(c2s(sport, 53, &payload), 0x1000 + f as u16);
        assert_eq!(frags.len(), 3);
        later += frags.len() as u64 - 1;
        for fr in &frags {
            r.client.send(fr);
        }
        assert_eq!(
            arrived(&r.rin, &m),
            vec![want],
            "datagram {f}: last fragment"
        );
    }
    assert!(owners.len() >= 2, "12 flows all on {owners:?}");
    // Return traffic to the NAT address: the first fragment by its port's owner, the rest
    // after it.
    let mut payload = big.clone();
    let m = marker("frag-back", 0);
    payload.extend_from_slice(&m);
    let back = build::udp(
        GMAC,
        GMAC,
        IpAddr::V4(SERVER),
        53,
        IpAddr::V4(NAT),
        40_123,
        &payload,
    );
    for fr in fragments(back, 0x2000) {
        r.server.send(&fr);
    }
    later += 2;
    assert_eq!(
        arrived(&r.rout, &m),
        vec![3],
        "return datagram's last fragment"
    );
    let st = r.steer.stats().expect("stats");
    assert_eq!(st.get(Stat::FragFirst), 13);
    assert_eq!(st.get(Stat::FragTracked), later);
    assert_eq!(st.get(Stat::FragUntracked), 0);
    // A later fragment alone (its first one lost): counted, steered by the ports-less key.
    let mut payload = big.clone();
    let m = marker("frag-orphan", 0);
    payload.extend_from_slice(&m);
    let frags = fragments(c2s(31_000, 53, &payload), 0x3000);
    r.client.send(frags.last().expect("last"));
    let ports_less = FlowKey::v4(proto::UDP, CLIENT, 0, SERVER, 0).0;
    let want = r
        .steer
        .ring_owner(&ports_less)
        .expect("ring")
        .expect("owned");
    assert_eq!(arrived(&r.rin, &m), vec![want]);
    assert_eq!(r.steer.stats().expect("stats").get(Stat::FragUntracked), 1);
}

#[test]
fn arp_is_cloned_to_every_live_replica_only() {
    if !pliant_testkit::require_root() {
        return;
    }
    let mut r = rig(3);
    let req = pliant_net::arp::request(CMAC, CLIENT, Ipv4Addr::new(10, 77, 1, 1), None);
    r.client.send(&req);
    let tag = &req[6..12]; // sender MAC in the Ethernet header
    let mut got: Vec<usize> = r
        .rin
        .iter()
        .map(|p| count_marked(&p.recv_for(WAIT), tag))
        .collect();
    assert_eq!(got, vec![1, 1, 1], "client ARP at every in-port");
    r.steer.set_replica_live(2, false).expect("kill 2");
    let sreq = pliant_net::arp::request(GMAC, SERVER, NAT, None);
    r.server.send(&sreq);
    got = r
        .rout
        .iter()
        .map(|p| count_marked(&p.recv_for(WAIT), &sreq[6..12]))
        .collect();
    assert_eq!(got, vec![1, 0, 1], "server ARP at live out-ports only");
    let st = r.steer.stats().expect("stats");
    assert_eq!(st.get(Stat::NonIpCloned), 2);
    assert_eq!(st.get(Stat::CloneCopies), 5);
}

#[test]
fn replica_output_returns_to_the_opposite_outer_port() {
    if !pliant_testkit::require_root() {
        return;
    }
    let r = rig(2);
    let m = marker("out", 1);
    r.rin[1].send(&s2c(80, 33_000, &m));
    assert_eq!(
        count_marked(&r.client.recv_for(WAIT), &m),
        1,
        "in-port -> client"
    );
    assert_eq!(count_marked(&r.server.recv_for(WAIT), &m), 0);
    let m = marker("out", 2);
    r.rout[0].send(&c2s(33_000, 80, &m));
    assert_eq!(
        count_marked(&r.server.recv_for(WAIT), &m),
        1,
        "out-port -> server"
    );
    assert_eq!(count_marked(&r.client.recv_for(WAIT), &m), 0);
    assert_eq!(r.steer.stats().expect("stats").get(Stat::ReplicaOut), 2);
}

#[test]
fn dead_replica_drops_are_counted_never_redirected() {
    if !pliant_testkit::require_root() {
        return;
    }
    let mut r = rig(2);
    let k = key(34_000, 80);
    r.steer.set_exception(&k, 2).expect("exception");
    r.steer.set_replica_live(2, false).expect("dead");
    let before = r.steer.stats().expect("stats");
    for i in 0..3 {
        r.client.send(&c2s(34_000, 80, &marker("dead", i)));
    }
    for i in 0..3 {
        assert!(arrived(&r.rin, &marker("dead", i)).is_empty());
    }
    let d = r.steer.stats().expect("stats").since(&before);
    assert_eq!(d.get(Stat::DropDead), 3);
    // Absent replica index (never configured) behaves the same.
    r.steer.set_exception(&k, 9).expect("exception to 9");
    r.client.send(&c2s(34_000, 80, &marker("dead", 7)));
    assert!(arrived(&r.rin, &marker("dead", 7)).is_empty());
    assert_eq!(
        r.steer
            .stats()
            .expect("stats")
            .since(&before)
            .get(Stat::DropDead),
        4
    );
    assert!(
        r.steer.set_exception(&k, 64).is_err(),
        "index beyond MAX_REPLICAS refused"
    );
}

/// Invariant 7: a fenced replica's output is dropped in the fabric (counted), nothing is steered
/// to it, a liveness flip does not lift the fence, and unfencing restores both directions.
#[test]
fn fenced_replica_output_is_dropped_and_counted() {
    if !pliant_testkit::require_root() {
        return;
    }
    let mut r = rig(2);
    let k = key(35_000, 80);
    r.steer.set_exception(&k, 2).expect("exception");
    r.steer.set_replica_fenced(2, true).expect("fence");
    assert_eq!(r.steer.fenced_replicas().expect("list"), vec![2]);
    // A revived old owner marked live again stays fenced.
    r.steer.set_replica_live(2, true).expect("live");
    let before = r.steer.stats().expect("stats");
    // Output from both of r2's ports: dropped, never at the outer ports.
    let (m1, m2) = (marker("fence", 1), marker("fence", 2));
    r.rin[1].send(&s2c(80, 35_000, &m1));
    r.rout[1].send(&c2s(35_000, 80, &m2));
    assert_eq!(count_marked(&r.client.recv_for(WAIT), &m1), 0);
    assert_eq!(count_marked(&r.server.recv_for(WAIT), &m2), 0);
    // Input for a flow excepted to r2: not delivered to the fenced replica.
    let m3 = marker("fence", 3);
    r.client.send(&c2s(35_000, 80, &m3));
    assert!(arrived(&r.rin, &m3).is_empty());
    // r1 (not fenced) still forwards.
    let m4 = marker("fence", 4);
    r.rin[0].send(&s2c(80, 35_001, &m4));
    assert_eq!(count_marked(&r.client.recv_for(WAIT), &m4), 1);
    let d = r.steer.stats().expect("stats").since(&before);
    assert_eq!(
        d.get(Stat::DropFenced),
        3,
        "two output frames + one input frame"
    );
    assert_eq!(d.get(Stat::ReplicaOut), 1, "only r1's frame left");
    // Unfenced: r2's output flows again, and the exception reaches it.
    r.steer.set_replica_fenced(2, false).expect("unfence");
    assert!(r.steer.fenced_replicas().expect("list").is_empty());
    let m5 = marker("fence", 5);
    r.rin[1].send(&s2c(80, 35_000, &m5));
    assert_eq!(count_marked(&r.client.recv_for(WAIT), &m5), 1);
    let m6 = marker("fence", 6);
    r.client.send(&c2s(35_000, 80, &m6));
    assert_eq!(arrived(&r.rin, &m6), vec![2]);
    // A new replica in the slot (set_replica) starts unfenced.
    r.steer.set_replica_fenced(1, true).expect("fence r1");
    let s = r.steer.replica(1).expect("slot");
    r.steer
        .set_replica(1, s.in_ifindex, s.out_ifindex, true)
        .expect("reset");
    assert!(r.steer.fenced_replicas().expect("list").is_empty());
    assert!(r.steer.set_replica_fenced(64, true).is_err());
}

#[test]
fn batch_exceptions_install_and_remove() {
    if !pliant_testkit::require_root() {
        return;
    }
    let mut r = rig(2);
    let entries: Vec<(FlowKey, u32)> = (0..5000u16)
        .map(|p| (key(p, 443), 1 + u32::from(p % 2)))
        .collect();
    r.steer.set_exceptions(&entries).expect("batch");
    assert_eq!(r.steer.exceptions().expect("list").len(), 5000);
    assert_eq!(r.steer.exception(&key(7, 443)).expect("get"), Some(2));
    let keys: Vec<FlowKey> = entries.iter().map(|(k, _)| *k).collect();
    assert_eq!(r.steer.remove_exceptions(&keys[..100]).expect("rm"), 100);
    assert_eq!(r.steer.remove_exceptions(&keys[..200]).expect("rm"), 100);
    assert_eq!(r.steer.exceptions().expect("list").len(), 4800);
    // One exception still steers real traffic.
    let m = marker("batch", 0);
    r.client.send(&c2s(4321, 443, &m));
    assert_eq!(arrived(&r.rin, &m), vec![2]);
}

#[test]
fn filters_are_visible_to_tc_and_removed_on_detach() {
    if !pliant_testkit::require_root() {
        return;
    }
    let mut r = rig(1);
    let ns = r.steer.netns().to_string();
    let show = || {
        let o = std::process::Command::new("ip")
            .args([
                "netns",
                "exec",
                &ns,
                "tc",
                "filter",
                "show",
                "dev",
                "fabclient",
                "ingress",
            ])
            .output()
            .expect("tc");
        String::from_utf8_lossy(&o.stdout).to_string()
    };
    assert!(show().contains("pliant_steer"), "{}", show());
    r.steer.detach().expect("detach");
    assert!(!show().contains("pliant_steer"), "{}", show());
}

/// Three replicas, steering pinned under the lab's pin directory: the fixture, that directory,
/// the options naming it, the client's port and the replicas' inside ports.
fn pinned_three() -> (Fixture, std::path::PathBuf, SteerOptions, Port, Vec<Port>) {
    let fx = Fixture::new(3);
    let dir = pliant_steer::lab::pin_dir(&fx.fabric());
    let opts = SteerOptions {
        pin_dir: Some(dir.clone()),
        ..Default::default()
    };
    let client = Port::open(&fx.client(), "client0");
    let rin: Vec<Port> = (1..=3)
        .map(|i| Port::open(&fx.replica(i), &format!("r{i}in")))
        .collect();
    (fx, dir, opts, client, rin)
}

#[test]
fn a_second_owner_takes_over_pinned_maps_without_rehoming_flows() {
    if !pliant_testkit::require_root() {
        return;
    }
    let (fx, dir, opts, client, rin) = pinned_three();
    let mut a = Steer::attach(&fx.fabric(), &lab_ports(3), &opts).expect("attach a");
    a.set_ring_maglev(&[1, 2, 3], 4099).expect("ring");
    client.send(&c2s(35_000, 80, &marker("take", 0)));
    let first = arrived(&rin, &marker("take", 0));
    assert_eq!(first.len(), 1);
    a.set_exception(&key(35_001, 80), 3).expect("exception");
    // The lab process exits: filters and pins stay.
    let _maps = a.persist();
    assert!(dir.join("conn").exists());

    // The controller takes over with a fresh load and moves every new flow to one replica.
    let mut b = Steer::attach(&fx.fabric(), &lab_ports(3), &opts).expect("attach b");
    assert_eq!(
        b.conn_owner(&key(35_000, 80)).expect("conn"),
        Some(first[0])
    );
    assert_eq!(b.exception(&key(35_001, 80)).expect("exc"), Some(3));
    let only = if first[0] == 1 { 2 } else { 1 };
    b.set_ring_maglev(&[only], 4099).expect("ring");
    client.send(&c2s(35_000, 80, &marker("take", 1)));
    assert_eq!(arrived(&rin, &marker("take", 1)), first, "pinned flow kept");
    client.send(&c2s(35_001, 80, &marker("take", 2)));
    assert_eq!(arrived(&rin, &marker("take", 2)), vec![3], "exception kept");
    // Only b's filter is on the port, and b's counters saw the packets.
    assert_eq!(b.stats().expect("stats").get(Stat::Conn), 1);
    let out = std::process::Command::new("ip")
        .args([
            "netns",
            "exec",
            &fx.fabric(),
            "tc",
            "filter",
            "show",
            "dev",
            "fabclient",
            "ingress",
        ])
        .output()
        .expect("tc");
    let shown = String::from_utf8_lossy(&out.stdout);
    let filters = shown.lines().filter(|l| l.contains("pliant_steer")).count();
    assert_eq!(filters, 1, "{shown}");
    drop(b);
    assert!(!dir.exists(), "pins removed with their last owner");
}

/// An owner that stands down (a controller losing its leadership) drops its `Steer` kept with
/// `keep_on_drop`: the fabric goes on steering with the same filter and maps (a pinned flow's
/// next packet still reaches its replica), the pins stay, and the next owner adopts the pin
/// and the exception, so a ring change after the takeover re-homes no live flow.
#[test]
fn an_owner_kept_on_drop_leaves_the_fabric_steering_for_its_successor() {
    if !pliant_testkit::require_root() {
        return;
    }
    let (fx, dir, opts, client, rin) = pinned_three();
    let mut a = Steer::attach(&fx.fabric(), &lab_ports(3), &opts).expect("attach a");
    a.keep_on_drop();
    a.set_ring_maglev(&[1, 2, 3], 4099).expect("ring");
    client.send(&c2s(36_000, 80, &marker("keep", 0)));
    let first = arrived(&rin, &marker("keep", 0));
    assert_eq!(first.len(), 1);
    a.set_exception(&key(36_001, 80), 3).expect("exception");
    drop(a);
    assert!(dir.join("conn").exists(), "pins kept");
    client.send(&c2s(36_000, 80, &marker("keep", 1)));
    assert_eq!(
        arrived(&rin, &marker("keep", 1)),
        first,
        "still steered after the drop"
    );

    let mut b = Steer::attach(&fx.fabric(), &lab_ports(3), &opts).expect("attach b");
    assert_eq!(
        b.conn_owner(&key(36_000, 80)).expect("conn"),
        Some(first[0])
    );
    assert_eq!(b.exception(&key(36_001, 80)).expect("exc"), Some(3));
    let only = if first[0] == 1 { 2 } else { 1 };
    b.set_ring_maglev(&[only], 4099).expect("ring");
    client.send(&c2s(36_000, 80, &marker("keep", 2)));
    assert_eq!(
        arrived(&rin, &marker("keep", 2)),
        first,
        "pinned flow kept across owners"
    );
    drop(b);
    assert!(
        !dir.exists(),
        "pins removed with their last (not kept) owner"
    );
}

#[test]
fn steering_takes_precedence_over_the_labs_mirred_patch_panel() {
    if !pliant_testkit::require_root() {
        return;
    }
    let fx = Fixture::new(2);
    // The single-replica patch panel pliant-lab installs (client -> r1 in-port).
    for argv in [
        vec!["tc", "qdisc", "add", "dev", "fabclient", "clsact"],
        vec![
            "tc",
            "filter",
            "add",
            "dev",
            "fabclient",
            "ingress",
            "protocol",
            "all",
            "u32",
            "match",
            "u32",
            "0",
            "0",
            "action",
            "mirred",
            "egress",
            "redirect",
            "dev",
            "fabr1in",
        ],
    ] {
        let st = std::process::Command::new("ip")
            .args(["netns", "exec", &fx.fabric()])
            .args(&argv)
            .status()
            .expect("tc");
        assert!(st.success(), "{argv:?}");
    }
    let client = Port::open(&fx.client(), "client0");
    let rin: Vec<Port> = (1..=2)
        .map(|i| Port::open(&fx.replica(i), &format!("r{i}in")))
        .collect();
    client.send(&c2s(36_000, 80, &marker("mirred", 0)));
    assert_eq!(
        arrived(&rin, &marker("mirred", 0)),
        vec![1],
        "patch panel works"
    );
    let mut s = Steer::attach(&fx.fabric(), &lab_ports(2), &SteerOptions::default())
        .expect("attach over the patch panel");
    s.set_ring_maglev(&[2], 4099).expect("ring");
    client.send(&c2s(36_001, 80, &marker("mirred", 1)));
    assert_eq!(
        arrived(&rin, &marker("mirred", 1)),
        vec![2],
        "steering wins"
    );
    s.detach().expect("detach");
    client.send(&c2s(36_002, 80, &marker("mirred", 2)));
    assert_eq!(
        arrived(&rin, &marker("mirred", 2)),
        vec![1],
        "patch panel again"
    );
}
