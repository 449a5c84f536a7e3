//! NAT unit tests on the runtime's test harness (no I/O, fake clock).

use super::*;
use crate::testutil::*;
use pliant_net::build::{self, tcp_flags, MAC_A, MAC_B};
use pliant_runtime::testing::Harness;
use std::collections::HashSet;

fn nat(cfg: Config) -> Harness<Nat> {
    Harness::new(Nat::new(cfg).expect("valid config"))
}

fn default_nat() -> Harness<Nat> {
    nat(Config::with_external_ip(EXT))
}

fn one_output(h: &mut Harness<Nat>) -> (Side, Vec<u8>) {
    let mut out = h.take_output();
    assert_eq!(out.len(), 1, "expected exactly one output frame");
    out.remove(0)
}

#[test]
fn tcp_translated_both_ways_with_valid_checksums() {
    let mut h = default_nat();
    h.inject(Side::Inside, &tcp_out(40000, tcp_flags::SYN, b""))
        .unwrap();
    let (side, f) = one_output(&mut h);
    assert_eq!(side, Side::Outside);
    let p = check(&f);
    assert_eq!((p.src, p.dst, p.dport), (v4(EXT), v4(SERVER), 80));
    let ext = p.sport;
    assert!((20000..=59999).contains(&ext));

    h.inject(
        Side::Outside,
        &tcp_in(ext, tcp_flags::SYN | tcp_flags::ACK, b"hello"),
    )
    .unwrap();
    let (side, f) = one_output(&mut h);
    assert_eq!(side, Side::Inside);
    let p = check(&f);
    assert_eq!(
        (p.src, p.sport, p.dst, p.dport),
        (v4(SERVER), 80, v4(CLIENT), 40000)
    );
    assert_eq!(&f[usize::from(p.payload_off)..], b"hello");

    // Later packets of the flow reuse the mapping.
    h.inject(Side::Inside, &tcp_out(40000, tcp_flags::ACK, b"data"))
        .unwrap();
    let p = check(&one_output(&mut h).1);
    assert_eq!(p.sport, ext);
    assert_eq!(h.counter("nat_mappings_created"), 1);
    assert_eq!(h.ctx.flows.len(), 1);
}

#[test]
fn udp_translated_both_ways() {
    let mut h = default_nat();
    let f = build::udp(MAC_A, MAC_B, v4(CLIENT), 5353, v4(SERVER), 53, b"query");
    h.inject(Side::Inside, &f).unwrap();
    let p = check(&one_output(&mut h).1);
    assert_eq!(p.src, v4(EXT));
    let reply = build::udp(MAC_B, MAC_A, v4(SERVER), 53, v4(EXT), p.sport, b"answer");
    h.inject(Side::Outside, &reply).unwrap();
    let p = check(&one_output(&mut h).1);
    assert_eq!((p.dst, p.dport), (v4(CLIENT), 5353));
}

#[test]
fn icmp_echo_identifier_translated() {
    let mut h = default_nat();
    let req = build::icmp_echo(
        MAC_A,
        MAC_B,
        v4(CLIENT),
        v4(SERVER),
        0x1234,
        1,
        true,
        b"ping",
    );
    h.inject(Side::Inside, &req).unwrap();
    let p = check(&one_output(&mut h).1);
    assert_eq!(p.src, v4(EXT));
    assert_ne!(p.sport, 0x1234, "identifier must be translated");
    let id = p.sport;
    let reply = build::icmp_echo(MAC_B, MAC_A, v4(SERVER), v4(EXT), id, 1, false, b"ping");
    h.inject(Side::Outside, &reply).unwrap();
    let p = check(&one_output(&mut h).1);
    assert_eq!(
        (p.dst, p.sport, p.icmp_type),
        (v4(CLIENT), 0x1234, ICMP_ECHO_REPLY)
    );
}

#[test]
fn thousand_concurrent_flows_get_distinct_mappings() {
    let mut h = default_nat();
    let mut ext = HashSet::new();
    for i in 0..1500u16 {
        h.inject(Side::Inside, &tcp_out(10000 + i, tcp_flags::SYN, b""))
            .unwrap();
        let p = check(&one_output(&mut h).1);
        assert_eq!(p.src, v4(EXT));
        assert!(
            ext.insert(p.sport),
            "external port {} handed out twice",
            p.sport
        );
    }
    assert_eq!(h.ctx.flows.len(), 1500);
    // Every reply reaches its own client port.
    for (i, port) in ext.iter().enumerate().take(50) {
        h.inject(Side::Outside, &tcp_in(*port, tcp_flags::ACK, b""))
            .unwrap();
        let p = check(&one_output(&mut h).1);
        assert!(
            (10000..11500).contains(&p.dport),
            "reply {i} went to port {}",
            p.dport
        );
    }
    assert_eq!(h.query()["mappings"], 1500);
    let q = h.query();
    let sample = q["sample"].as_array().expect("sample");
    assert_eq!(sample.len(), 16, "bounded sample");
    assert!(sample
        .iter()
        .all(|m| m["external"].as_str().unwrap().starts_with("10.77.2.1:")));
    assert_eq!(h.query()["pools"]["tcp"]["in_use"], 1500);
}

#[test]
fn idle_mappings_expire_and_return_their_ports() {
    let mut cfg = Config::with_external_ip(EXT);
    cfg.udp_timeout_s = 30;
    let mut h = nat(cfg);
    let f = build::udp(MAC_A, MAC_B, v4(CLIENT), 5353, v4(SERVER), 53, b"q");
    h.inject(Side::Inside, &f).unwrap();
    let ext = check(&one_output(&mut h).1).sport;
    assert_eq!(h.query()["pools"]["udp"]["in_use"], 1);

    // Traffic at 20 s keeps it alive past the first deadline (lazy re-arm).
    h.advance(Duration::from_secs(20));
    h.inject(Side::Inside, &f).unwrap();
    h.take_output();
    h.advance(Duration::from_secs(20));
    assert_eq!(
        h.ctx.flows.len(),
        1,
        "refreshed mapping must survive its first deadline"
    );
    assert_eq!(h.counter("nat_mappings_expired"), 0);

    h.advance(Duration::from_secs(11));
    assert_eq!(h.ctx.flows.len(), 0);
    assert_eq!(h.counter("nat_mappings_expired"), 1);
    assert_eq!(h.query()["pools"]["udp"]["in_use"], 0);
    // The reply now finds nothing.
    let reply = build::udp(MAC_B, MAC_A, v4(SERVER), 53, v4(EXT), ext, b"late");
    h.inject(Side::Outside, &reply).unwrap();
    assert!(h.take_output().is_empty());
    assert_eq!(h.drop_count("nat_no_mapping"), 1);
}

#[test]
fn tcp_fin_shortens_the_timeout() {
    let mut cfg = Config::with_external_ip(EXT);
    cfg.tcp_established_timeout_s = 1000;
    cfg.tcp_closing_timeout_s = 5;
    let mut h = nat(cfg);
    h.inject(Side::Inside, &tcp_out(40000, tcp_flags::SYN, b""))
        .unwrap();
    let ext = check(&one_output(&mut h).1).sport;
    h.inject(
        Side::Outside,
        &tcp_in(ext, tcp_flags::SYN | tcp_flags::ACK, b""),
    )
    .unwrap();
    h.inject(Side::Inside, &tcp_out(40000, tcp_flags::ACK, b""))
        .unwrap();
    h.advance(Duration::from_secs(100));
    assert_eq!(
        h.ctx.flows.len(),
        1,
        "established flow outlives the transitory timeout"
    );
    h.inject(
        Side::Inside,
        &tcp_out(40000, tcp_flags::FIN | tcp_flags::ACK, b""),
    )
    .unwrap();
    h.advance(Duration::from_secs(6));
    assert_eq!(
        h.ctx.flows.len(),
        0,
        "closing flow expires after the closing timeout"
    );
}

/// Opens a TCP mapping from the client's `sport` and completes the handshake through it
/// (SYN, SYN-ACK, ACK): established, so never evicted. Returns the external port.
fn established(h: &mut Harness<Nat>, sport: u16) -> u16 {
    h.inject(Side::Inside, &tcp_out(sport, tcp_flags::SYN, b""))
        .unwrap();
    let ext = check(&one_output(h).1).sport;
    h.inject(
        Side::Outside,
        &tcp_in(ext, tcp_flags::SYN | tcp_flags::ACK, b""),
    )
    .unwrap();
    one_output(h);
    h.inject(Side::Inside, &tcp_out(sport, tcp_flags::ACK, b""))
        .unwrap();
    one_output(h);
    ext
}

/// Sends a UDP answer to external port `ext` (the mapping is answered: not evictable).
fn answer_udp(h: &mut Harness<Nat>, ext: u16) {
    h.inject(Side::Outside, &udp_in(ext)).unwrap();
    one_output(h);
}

#[test]
fn exhaustion_is_a_counted_refusal() {
    let mut cfg = Config::with_external_ip(EXT);
    cfg.port_min = 30000;
    cfg.port_max = 30003;
    let mut h = nat(cfg);
    for i in 0..4u16 {
        established(&mut h, 10000 + i);
    }
    // Every mapping established: nothing may give way.
    for i in 4..6u16 {
        h.inject(Side::Inside, &tcp_out(10000 + i, tcp_flags::SYN, b""))
            .unwrap();
    }
    assert!(h.take_output().is_empty());
    assert_eq!(h.drop_count("nat_port_exhausted"), 2);
    assert_eq!(h.query()["pools"]["tcp"]["exhausted"], 2);
    // UDP has its own pool.
    let f = build::udp(MAC_A, MAC_B, v4(CLIENT), 5353, v4(SERVER), 53, b"q");
    h.inject(Side::Inside, &f).unwrap();
    assert_eq!(h.take_output().len(), 1);
}

#[test]
fn unknown_inbound_is_dropped() {
    let mut h = default_nat();
    h.inject(Side::Outside, &tcp_in(25000, tcp_flags::SYN, b""))
        .unwrap();
    let stray = build::tcp(
        MAC_B,
        MAC_A,
        v4(SERVER),
        80,
        v4(CLIENT),
        40000,
        tcp_flags::SYN,
        1,
        0,
        b"",
    );
    h.inject(Side::Outside, &stray).unwrap();
    assert!(h.take_output().is_empty());
    assert_eq!(h.drop_count("nat_no_mapping"), 1);
    assert_eq!(h.drop_count("nat_not_external_ip"), 1);
    assert_eq!(h.ctx.flows.len(), 0);
}

#[test]
fn inbound_to_a_mapped_port_of_another_remote_is_dropped() {
    let mut h = default_nat();
    h.inject(Side::Inside, &tcp_out(40000, tcp_flags::SYN, b""))
        .unwrap();
    let ext = check(&one_output(&mut h).1).sport;
    let other = Ipv4Addr::new(10, 77, 2, 3);
    let f = build::tcp(
        MAC_B,
        MAC_A,
        v4(other),
        80,
        v4(EXT),
        ext,
        tcp_flags::SYN,
        1,
        0,
        b"",
    );
    h.inject(Side::Outside, &f).unwrap();
    assert!(h.take_output().is_empty(), "endpoint-dependent filtering");
    assert_eq!(h.drop_count("nat_no_mapping"), 1);
}

#[test]
fn ipv6_and_other_protocols_are_counted_drops() {
    let mut h = default_nat();
    let a: IpAddr = "fd00::2".parse().unwrap();
    let b: IpAddr = "fd00:1::2".parse().unwrap();
    h.inject(Side::Inside, &build::udp(MAC_A, MAC_B, a, 1, b, 2, b"x"))
        .unwrap();
    let gre = build::raw_ip(MAC_A, MAC_B, v4(CLIENT), v4(SERVER), 47, &[0; 8]);
    h.inject(Side::Inside, &gre).unwrap();
    assert!(h.take_output().is_empty());
    assert_eq!(h.drop_count("nat_ipv6_unsupported"), 1);
    assert_eq!(h.drop_count("nat_unsupported_proto"), 1);
}

#[test]
fn bad_configs_are_refused() {
    let mut c = Config::with_external_ip(EXT);
    c.port_min = 100;
    c.port_max = 99;
    assert!(Nat::new(c).is_err());
    let mut c = Config::with_external_ip(EXT);
    c.udp_timeout_s = 0;
    assert!(Nat::new(c).is_err());
    assert!(Nat::new(Config::with_external_ip(Ipv4Addr::UNSPECIFIED)).is_err());
}

/// The IP header + L4 bytes of an Ethernet frame (what an ICMP error quotes).
fn ip_part(frame: &[u8]) -> Vec<u8> {
    frame[14..].to_vec()
}

/// Re-frames a quoted IP packet so it can be parsed and its checksums checked.
fn reframe(quoted: &[u8]) -> Vec<u8> {
    let mut f = vec![0u8; 12];
    f.extend_from_slice(&[0x08, 0x00]);
    f.extend_from_slice(quoted);
    f
}

#[test]
fn icmp_errors_about_mapped_flows_are_translated_with_their_quote() {
    let mut h = default_nat();
    let f = build::udp(MAC_A, MAC_B, v4(CLIENT), 5353, v4(SERVER), 53, b"query");
    h.inject(Side::Inside, &f).unwrap();
    let sent = one_output(&mut h).1;
    let ext = check(&sent).sport;
    assert_ne!(ext, 5353);
    // A router on the way reports "port unreachable", quoting the translated datagram.
    let router = Ipv4Addr::new(10, 77, 2, 254);
    let err = port_unreachable(Side::Outside, router, EXT, &ip_part(&sent));
    h.inject(Side::Outside, &err).unwrap();
    let (side, out) = one_output(&mut h);
    assert_eq!(side, Side::Inside);
    let p = check(&out);
    assert_eq!((p.src, p.dst, p.icmp_type), (v4(router), v4(CLIENT), 3));
    // The quote now shows the client's own datagram, with valid checksums.
    let quoted = reframe(&out[usize::from(p.l4_off) + 8..]);
    let q = check(&quoted);
    assert_eq!(
        (q.src, q.sport, q.dst, q.dport),
        (v4(CLIENT), 5353, v4(SERVER), 53)
    );
    assert_eq!(
        quoted,
        reframe(&ip_part(&f)),
        "quote restored to the original bytes"
    );
    assert_eq!(h.counter("nat_icmp_errors_translated"), 1);

    // An error about a packet we never sent is dropped.
    let mut stray = ip_part(&sent);
    stray[20..22].copy_from_slice(&(ext.wrapping_add(1)).to_be_bytes());
    let err = port_unreachable(Side::Outside, router, EXT, &stray);
    h.inject(Side::Outside, &err).unwrap();
    assert!(h.take_output().is_empty());
    assert_eq!(h.drop_count("nat_no_mapping"), 1);
}

#[test]
fn outbound_icmp_errors_hide_the_inside_address() {
    let mut h = default_nat();
    h.inject(
        Side::Inside,
        &build::udp(MAC_A, MAC_B, v4(CLIENT), 5353, v4(SERVER), 53, b"q"),
    )
    .unwrap();
    let ext = check(&one_output(&mut h).1).sport;
    let reply = build::udp(MAC_B, MAC_A, v4(SERVER), 53, v4(EXT), ext, b"late answer");
    h.inject(Side::Outside, &reply).unwrap();
    let delivered = one_output(&mut h).1;
    // The client's port is closed by now: it reports the delivered reply.
    let err = port_unreachable(Side::Inside, CLIENT, SERVER, &ip_part(&delivered));
    h.inject(Side::Inside, &err).unwrap();
    let out = one_output(&mut h).1;
    let p = check(&out);
    assert_eq!((p.src, p.dst), (v4(EXT), v4(SERVER)));
    let q = check(&reframe(&out[usize::from(p.l4_off) + 8..]));
    assert_eq!(
        (q.src, q.sport, q.dst, q.dport),
        (v4(SERVER), 53, v4(EXT), ext)
    );
    assert_eq!(
        reframe(&out[usize::from(p.l4_off) + 8..]),
        reframe(&ip_part(&reply))
    );
}

#[test]
fn port_blocks_bound_allocation_and_keep_ports_in_use() {
    let mut h = default_nat();
    h.inject(Side::Inside, &udp_out(1000)).unwrap();
    let first = check(&one_output(&mut h).1).sport;
    assert_eq!(first, 20000);
    answer_udp(&mut h, first);
    let v =
        h.nf.set_port_blocks(&mut h.ctx, &[(20000, 20001)])
            .expect("valid blocks");
    assert_eq!(v["udp_in_use"], 1, "{v}");
    h.inject(Side::Inside, &udp_out(1001)).unwrap();
    assert_eq!(check(&one_output(&mut h).1).sport, 20001);
    answer_udp(&mut h, 20001);
    h.inject(Side::Inside, &udp_out(1002)).unwrap();
    assert_eq!(h.drop_count("nat_port_exhausted"), 1);
    assert!(h.nf.set_port_blocks(&mut h.ctx, &[(5, 1)]).is_err());
    assert!(h.nf.set_port_blocks(&mut h.ctx, &[]).is_err());
    // From config as well.
    let mut cfg = Config::with_external_ip(EXT);
    cfg.port_blocks = vec![(40000, 40000), (41000, 41001)];
    let mut h = nat(cfg);
    let mut got = HashSet::new();
    for s in 0..3 {
        h.inject(Side::Inside, &udp_out(2000 + s)).unwrap();
        got.insert(check(&one_output(&mut h).1).sport);
    }
    assert_eq!(got, HashSet::from([40000, 41000, 41001]));
    let mut bad = Config::with_external_ip(EXT);
    bad.port_blocks = vec![(0, 10)];
    assert!(Nat::new(bad).is_err());
}

#[test]
fn a_migrated_mapping_keeps_its_port_and_its_idle_budget() {
    let wall = 1_700_000_000_000;
    let mut c1 = Config::with_external_ip(EXT);
    c1.port_blocks = vec![(30000, 30009)];
    c1.udp_timeout_s = 30;
    let mut c2 = c1.clone();
    c2.port_blocks = vec![(30010, 30019)];
    // Replica 1 has run for an hour when the flow starts.
    let mut h1 = Harness::new(Nat::with_clock(c1, Instant::now(), wall).unwrap());
    h1.advance(Duration::from_secs(3600));
    h1.inject(Side::Inside, &udp_out(5353)).unwrap();
    assert_eq!(check(&one_output(&mut h1).1).sport, 30000);
    h1.inject(Side::Inside, &udp_out(5354)).unwrap();
    let ext = check(&one_output(&mut h1).1).sport;
    assert_eq!(ext, 30001);
    h1.advance(Duration::from_secs(10));
    let quiet = FlowKey::v4(proto::UDP, CLIENT, 5353, SERVER, 53).0;
    let busy = FlowKey::v4(proto::UDP, CLIENT, 5354, SERVER, 53).0;
    let recs: Vec<Vec<u8>> = [quiet, busy]
        .iter()
        .map(|k| h1.ctx.flows.export_flow(k, h1.now()).expect("export"))
        .collect();
    // Replica 2 just started; its clock reads the same wall time as replica 1's now.
    let mut h2 = Harness::new(Nat::with_clock(c2, Instant::now(), wall + 3_610_000).unwrap());
    for r in &recs {
        h2.ctx.flows.import_flow(r, h2.now()).expect("import");
    }
    // Return traffic to the lent port is translated by the new owner.
    let reply = build::udp(MAC_B, MAC_A, v4(SERVER), 53, v4(EXT), ext, b"r");
    h2.inject(Side::Outside, &reply).unwrap();
    let (side, f) = one_output(&mut h2);
    assert_eq!((side, check(&f).dst), (Side::Inside, v4(CLIENT)));
    // The owner keeps the lent ports reserved: a new flow there gets another one.
    h1.inject(Side::Inside, &udp_out(6000)).unwrap();
    assert_eq!(check(&one_output(&mut h1).1).sport, 30002);
    // Replica 2 allocates from its own block.
    h2.inject(Side::Inside, &udp_out(7000)).unwrap();
    assert_eq!(check(&one_output(&mut h2).1).sport, 30010);
    // Idle budget: the quiet flow was last seen 10 s before the move, so it expires 20 s
    // after it (with a replica-relative stamp it would live on for another 30 s).
    h2.advance(Duration::from_secs(21));
    assert!(!h2.ctx.flows.contains(&quiet), "quiet flow expired on time");
    assert!(h2.ctx.flows.contains(&busy), "refreshed flow lives on");
    h2.advance(Duration::from_secs(10));
    assert!(!h2.ctx.flows.contains(&busy));
    assert_eq!(h2.counter("nat_foreign_port_ended"), 2);
    // Its own flow (created at the same time) expired too and returned its own port only.
    assert_eq!(h2.counter("nat_mappings_expired"), 3);
    assert_eq!(h2.query()["pools"]["udp"]["in_use"], 0);
}

/// HA activation (and migration) on a replica sharing the port range: the imported mapping's
/// external port counts as in use, so no new local flow gets it while the mapping lives.
#[test]
fn an_imported_mapping_reserves_its_port_in_a_shared_range() {
    let mut cfg = Config::with_external_ip(EXT);
    cfg.port_blocks = vec![(30000, 30001)];
    let mut h1 = nat(cfg.clone());
    h1.inject(Side::Inside, &udp_out(5353)).unwrap();
    assert_eq!(check(&one_output(&mut h1).1).sport, 30000);
    answer_udp(&mut h1, 30000);
    let k = FlowKey::v4(proto::UDP, CLIENT, 5353, SERVER, 53).0;
    let rec = h1.ctx.flows.snapshot_flow(&k, h1.now()).expect("snapshot");
    // The backup uses the same block (no port blocks per replica).
    let mut h2 = nat(cfg);
    let key = h2.ctx.flows.import_flow(&rec, h2.now()).expect("import");
    h2.nf.on_import(&mut h2.ctx, key);
    assert_eq!(h2.counter("nat_imported_ports_reserved"), 1);
    h2.inject(Side::Inside, &udp_out(6000)).unwrap();
    assert_eq!(
        check(&one_output(&mut h2).1).sport,
        30001,
        "the activated mapping's port is not handed out again"
    );
    answer_udp(&mut h2, 30001);
    h2.inject(Side::Inside, &udp_out(6001)).unwrap();
    assert_eq!(h2.drop_count("nat_port_exhausted"), 1);
}

/// A SYN flood from one inside host fills the pool; new flows of anyone still get ports by
/// evicting the oldest unanswered mappings, established ones are never touched.
#[test]
fn a_syn_flood_evicts_its_own_embryonic_mappings_not_established_ones() {
    let mut cfg = Config::with_external_ip(EXT);
    cfg.port_blocks = vec![(30000, 30007)];
    let mut h = nat(cfg);
    let kept = established(&mut h, 999);
    let flooder = Ipv4Addr::new(10, 0, 1, 66);
    let syn = |sport: u16| syn_to_server(flooder, sport, 80);
    for i in 0..40u16 {
        h.inject(Side::Inside, &syn(1000 + i)).unwrap();
    }
    assert_eq!(h.take_output().len(), 40, "every flood SYN got a port");
    assert_eq!(h.counter("nat_evicted_embryonic"), 33);
    assert_eq!(h.drop_count("nat_port_exhausted"), 0);
    // The other host: its established flow still works, and a new flow gets a port at once.
    h.inject(Side::Outside, &tcp_in(kept, tcp_flags::ACK, b"x"))
        .unwrap();
    assert_eq!(check(&one_output(&mut h).1).dport, 999);
    let ext = established(&mut h, 2000);
    h.inject(Side::Outside, &tcp_in(ext, tcp_flags::ACK, b"y"))
        .unwrap();
    assert_eq!(check(&one_output(&mut h).1).dport, 2000);
    // The flood went on: the newest flood mappings are still there, the oldest are gone.
    let fk = |sport| FlowKey::v4(proto::TCP, flooder, sport, SERVER, 80).0;
    assert!(h.ctx.flows.contains(&fk(1039)));
    assert!(!h.ctx.flows.contains(&fk(1000)));
    let q = h.query();
    assert_eq!(q["abuse"]["evicted_embryonic"], 34, "{q}");
    assert_eq!(q["abuse"]["top_hosts"][0]["host"], "10.0.1.66");
    assert_eq!(q["pools"]["tcp"]["exhausted"], 0);
    // With both established mappings and six flood mappings the pool is full; all flood
    // mappings answered by the server (SYN-ACK) and reset by the flooder stay evictable.
    let flood_ext: Vec<u16> = (1034..1040)
        .filter_map(|s| h.ctx.flows.peek(&fk(s)).map(|m| m.external_port))
        .collect();
    assert_eq!(flood_ext.len(), 6);
    for e in flood_ext {
        h.inject(
            Side::Outside,
            &tcp_in(e, tcp_flags::SYN | tcp_flags::ACK, b""),
        )
        .unwrap();
    }
    for i in 1034..1040u16 {
        let rst = build::tcp(
            MAC_A,
            MAC_B,
            v4(flooder),
            i,
            v4(SERVER),
            80,
            tcp_flags::RST,
            1,
            0,
            b"",
        );
        h.inject(Side::Inside, &rst).unwrap();
    }
    h.take_output();
    established(&mut h, 2001);
    assert_eq!(h.counter("nat_evicted_embryonic"), 35);
}

#[test]
fn unanswered_syns_expire_after_the_embryonic_timeout() {
    let mut cfg = Config::with_external_ip(EXT);
    cfg.tcp_embryonic_timeout_s = 5;
    let mut h = nat(cfg);
    h.inject(Side::Inside, &tcp_out(1000, tcp_flags::SYN, b""))
        .unwrap();
    h.take_output();
    let answered = established(&mut h, 1001);
    h.inject(Side::Inside, &tcp_out(1002, tcp_flags::SYN, b""))
        .unwrap();
    let half = check(&one_output(&mut h).1).sport;
    // Answered but not yet acknowledged: the transitory timeout (60 s), not the embryonic one.
    h.inject(
        Side::Outside,
        &tcp_in(half, tcp_flags::SYN | tcp_flags::ACK, b""),
    )
    .unwrap();
    h.take_output();
    h.advance(Duration::from_secs(6));
    let k = |s| FlowKey::v4(proto::TCP, CLIENT, s, SERVER, 80).0;
    assert!(!h.ctx.flows.contains(&k(1000)), "unanswered SYN expired");
    assert!(h.ctx.flows.contains(&k(1001)) && h.ctx.flows.contains(&k(1002)));
    assert_eq!(h.query()["pools"]["tcp"]["in_use"], 2);
    let _ = answered;
    let mut bad = Config::with_external_ip(EXT);
    bad.tcp_embryonic_timeout_s = 0;
    assert!(Nat::new(bad).is_err());
}

#[test]
fn a_per_host_quota_refuses_only_that_host() {
    let mut cfg = Config::with_external_ip(EXT);
    cfg.max_mappings_per_host = 3;
    cfg.udp_timeout_s = 10;
    let mut h = nat(cfg);
    for s in 0..5u16 {
        h.inject(Side::Inside, &udp_out(1000 + s)).unwrap();
    }
    assert_eq!(h.take_output().len(), 3);
    assert_eq!(h.drop_count("nat_host_quota"), 2);
    let other = build::udp(
        MAC_A,
        MAC_B,
        v4(Ipv4Addr::new(10, 0, 1, 9)),
        5,
        v4(SERVER),
        53,
        b"q",
    );
    h.inject(Side::Inside, &other).unwrap();
    assert_eq!(h.take_output().len(), 1);
    let q = h.query();
    assert_eq!(q["abuse"]["host_quota_refused"], 2, "{q}");
    assert_eq!(q["abuse"]["hosts"], 2);
    // Mappings that expire give the quota back.
    h.advance(Duration::from_secs(11));
    h.inject(Side::Inside, &udp_out(2000)).unwrap();
    assert_eq!(h.take_output().len(), 1);
    // Flows that leave unseen (exported by a migration) are noticed: counts rebuilt.
    let k = FlowKey::v4(proto::UDP, CLIENT, 2000, SERVER, 53).0;
    h.ctx.flows.export_flow(&k, h.now()).expect("export");
    for s in 0..3u16 {
        h.inject(Side::Inside, &udp_out(3000 + s)).unwrap();
    }
    assert_eq!(h.take_output().len(), 3);
    assert_eq!(h.query()["abuse"]["host_counts_rebuilt"], 1);
}

// ---- External ports shared across remote endpoints, port preservation, EIM ----

const HOST_B: Ipv4Addr = Ipv4Addr::new(10, 77, 1, 3);
const SERVER_2: Ipv4Addr = Ipv4Addr::new(10, 77, 2, 3);

/// UDP from inside `src`:`sport` to `dst`:`dport`.
fn udp_from(src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16) -> Vec<u8> {
    build::udp(MAC_A, MAC_B, v4(src), sport, v4(dst), dport, b"q")
}

/// UDP reply from `remote`:`rport` to the external address's `ext`.
fn udp_reply(remote: Ipv4Addr, rport: u16, ext: u16) -> Vec<u8> {
    build::udp(MAC_B, MAC_A, v4(remote), rport, v4(EXT), ext, b"a")
}

/// Sends `frame` from inside and returns the external source port it left with.
fn out_port(h: &mut Harness<Nat>, frame: &[u8]) -> u16 {
    h.inject(Side::Inside, frame).unwrap();
    let (side, f) = one_output(h);
    assert_eq!(side, Side::Outside);
    let p = check(&f);
    assert_eq!(p.src, v4(EXT));
    p.sport
}

/// Sends a reply from outside and returns where it was delivered (inside address, port).
fn delivered_to(h: &mut Harness<Nat>, frame: &[u8]) -> (IpAddr, u16) {
    h.inject(Side::Outside, frame).unwrap();
    let (side, f) = one_output(h);
    assert_eq!(side, Side::Inside);
    let p = check(&f);
    (p.dst, p.dport)
}

fn one_port_nat(port: u16) -> Harness<Nat> {
    let mut cfg = Config::with_external_ip(EXT);
    cfg.port_blocks = vec![(port, port)];
    nat(cfg)
}

/// Checks the pools against the table: no two live mappings share an outside tuple, and each
/// owned port's reference count is the number of live mappings on it.
fn check_pools(h: &Harness<Nat>) {
    let mut tuples = HashSet::new();
    let mut per_port: std::collections::HashMap<(u8, u16), u32> = Default::default();
    for k in h.ctx.flows.keys() {
        let m = h.ctx.flows.peek(&k).expect("listed key");
        assert!(
            tuples.insert((m.proto, m.external_port, m.remote_addr, m.remote_port)),
            "two live mappings share {m:?}'s outside tuple"
        );
        *per_port.entry((m.proto, m.external_port)).or_default() += 1;
    }
    for p in [proto::TCP, proto::UDP, proto::ICMP] {
        let pool = h.nf.port_pool(p);
        let mut ports = 0;
        let mut mappings = 0;
        for port in pool.in_use_ports() {
            let n = per_port.get(&(p, port)).copied().unwrap_or(0);
            assert_eq!(pool.refs(port), n, "proto {p} port {port}");
            ports += 1;
            mappings += n as usize;
        }
        let owned_live: u32 = per_port
            .iter()
            .filter(|((q, port), _)| *q == p && pool.owns(*port))
            .map(|(_, n)| *n)
            .sum();
        assert_eq!(
            mappings, owned_live as usize,
            "proto {p}: every mapping counted"
        );
        assert_eq!(pool.in_use(), ports, "proto {p}: ports in use");
        assert_eq!(pool.mappings(), mappings, "proto {p}: pool mapping count");
    }
}

#[test]
fn more_flows_than_ports_succeed_towards_distinct_destinations() {
    let mut cfg = Config::with_external_ip(EXT);
    cfg.port_blocks = vec![(30000, 30003)];
    let mut h = nat(cfg);
    let mut ext = Vec::new();
    for i in 0..12u16 {
        ext.push(out_port(
            &mut h,
            &udp_from(CLIENT, 1000 + i, SERVER, 5000 + i),
        ));
    }
    assert_eq!(h.ctx.flows.len(), 12);
    assert_eq!(h.drop_count("nat_port_exhausted"), 0);
    assert_eq!(h.counter("nat_port_shared"), 8);
    let q = h.query();
    assert_eq!(q["pools"]["udp"]["in_use"], 4, "{q}");
    assert_eq!(q["pools"]["udp"]["mappings"], 12, "{q}");
    // Each reply reaches its own flow through the shared ports.
    for (i, e) in ext.iter().enumerate() {
        let i = i as u16;
        assert_eq!(
            delivered_to(&mut h, &udp_reply(SERVER, 5000 + i, *e)),
            (v4(CLIENT), 1000 + i)
        );
    }
    check_pools(&h);
}

#[test]
fn one_destination_never_gets_two_mappings_on_one_port() {
    let mut cfg = Config::with_external_ip(EXT);
    cfg.port_blocks = vec![(30000, 30001)];
    let mut h = nat(cfg);
    for s in [1000, 1001] {
        let e = out_port(&mut h, &udp_out(s));
        answer_udp(&mut h, e);
    }
    // Both ports carry a mapping to SERVER:53: a third flow there has no tuple left.
    h.inject(Side::Inside, &udp_out(1002)).unwrap();
    assert!(h.take_output().is_empty());
    assert_eq!(h.drop_count("nat_port_exhausted"), 1);
    assert_eq!(h.query()["pools"]["udp"]["exhausted"], 1);
    // Another destination port of the same server is another tuple: it shares a port.
    let e = out_port(&mut h, &udp_from(CLIENT, 1002, SERVER, 54));
    assert!((30000..=30001).contains(&e));
    assert_eq!(h.counter("nat_port_shared"), 1);
    check_pools(&h);
}

#[test]
fn replies_on_a_shared_port_reach_the_right_inside_host() {
    let mut h = one_port_nat(30000);
    assert_eq!(out_port(&mut h, &udp_from(CLIENT, 1111, SERVER, 53)), 30000);
    assert_eq!(
        out_port(&mut h, &udp_from(HOST_B, 2222, SERVER_2, 53)),
        30000
    );
    assert_eq!(
        delivered_to(&mut h, &udp_reply(SERVER_2, 53, 30000)),
        (v4(HOST_B), 2222)
    );
    assert_eq!(
        delivered_to(&mut h, &udp_reply(SERVER, 53, 30000)),
        (v4(CLIENT), 1111)
    );
    // TCP too: two hosts, one port, two servers.
    let syn = |src, sport, dst| {
        build::tcp(
            MAC_A,
            MAC_B,
            v4(src),
            sport,
            v4(dst),
            80,
            tcp_flags::SYN,
            1,
            0,
            b"",
        )
    };
    let synack = |src| {
        build::tcp(
            MAC_B,
            MAC_A,
            v4(src),
            80,
            v4(EXT),
            30000,
            tcp_flags::SYN | tcp_flags::ACK,
            1,
            2,
            b"",
        )
    };
    assert_eq!(out_port(&mut h, &syn(CLIENT, 3333, SERVER)), 30000);
    assert_eq!(out_port(&mut h, &syn(HOST_B, 4444, SERVER_2)), 30000);
    assert_eq!(delivered_to(&mut h, &synack(SERVER)), (v4(CLIENT), 3333));
    assert_eq!(delivered_to(&mut h, &synack(SERVER_2)), (v4(HOST_B), 4444));
    // Address-and-port-dependent filtering: a third remote finds nothing on the shared port.
    let stray = Ipv4Addr::new(10, 77, 2, 9);
    h.inject(Side::Outside, &udp_reply(stray, 53, 30000))
        .unwrap();
    assert!(h.take_output().is_empty());
    assert_eq!(h.drop_count("nat_no_mapping"), 1);
    check_pools(&h);
}

#[test]
fn a_shared_port_is_freed_only_when_its_last_mapping_ends() {
    let mut cfg = Config::with_external_ip(EXT);
    cfg.port_blocks = vec![(30000, 30000)];
    cfg.udp_timeout_s = 30;
    let mut h = nat(cfg);
    let a = udp_from(CLIENT, 1111, SERVER, 53);
    assert_eq!(out_port(&mut h, &a), 30000);
    assert_eq!(
        out_port(&mut h, &udp_from(HOST_B, 2222, SERVER_2, 53)),
        30000
    );
    h.advance(Duration::from_secs(20));
    assert_eq!(out_port(&mut h, &a), 30000, "refreshes the first mapping");
    h.advance(Duration::from_secs(11));
    // The second mapping expired, the first lives: the port stays in use with one mapping.
    assert_eq!(h.ctx.flows.len(), 1);
    let q = h.query();
    assert_eq!(
        (&q["pools"]["udp"]["in_use"], &q["pools"]["udp"]["mappings"]),
        (&serde_json::json!(1), &serde_json::json!(1)),
        "{q}"
    );
    assert_eq!(h.nf.port_pool(proto::UDP).refs(30000), 1);
    check_pools(&h);
    h.advance(Duration::from_secs(20));
    assert_eq!(h.ctx.flows.len(), 0);
    assert_eq!(h.query()["pools"]["udp"]["in_use"], 0);
    assert_eq!(h.nf.port_pool(proto::UDP).refs(30000), 0);
    // Free again: a new flow takes it from the free list (not shared).
    assert_eq!(out_port(&mut h, &udp_from(HOST_B, 5, SERVER, 53)), 30000);
    assert_eq!(h.counter("nat_port_shared"), 1);
    assert_eq!(h.nf.port_pool(proto::UDP).bad_release, 0);
}

/// Migration of two mappings sharing one port: the importer translates replies of both by
/// the whole tuple; the owner keeps the port lent (taking no new mapping, though a new
/// remote's tuple would be free) and gets it back when both mappings return and end.
#[test]
fn two_mappings_sharing_a_port_migrate_and_come_back() {
    let wall = 1_700_000_000_000;
    let mut c1 = Config::with_external_ip(EXT);
    c1.port_blocks = vec![(30000, 30000)];
    let mut c2 = c1.clone();
    c2.port_blocks = vec![(30010, 30019)];
    let epoch = Instant::now();
    let mut h1 = Harness::new(Nat::with_clock(c1, epoch, wall).unwrap());
    let mut h2 = Harness::new(Nat::with_clock(c2, epoch, wall).unwrap());
    assert_eq!(
        out_port(&mut h1, &udp_from(CLIENT, 1111, SERVER, 53)),
        30000
    );
    assert_eq!(
        out_port(&mut h1, &udp_from(HOST_B, 2222, SERVER_2, 53)),
        30000
    );
    let ka = FlowKey::v4(proto::UDP, CLIENT, 1111, SERVER, 53).0;
    let kb = FlowKey::v4(proto::UDP, HOST_B, 2222, SERVER_2, 53).0;
    let move_flow = |from: &mut Harness<Nat>, to: &mut Harness<Nat>, k: &FlowKey| {
        let rec = from.ctx.flows.export_flow(k, from.now()).expect("export");
        let key = to.ctx.flows.import_flow(&rec, to.now()).expect("import");
        assert_eq!(
            to.ctx.flows.keys_of(&key).expect("imported").len(),
            2,
            "the alias (outside tuple) travels with the mapping"
        );
        to.nf.on_import(&mut to.ctx, key);
    };
    move_flow(&mut h1, &mut h2, &ka);
    move_flow(&mut h1, &mut h2, &kb);
    assert_eq!(
        delivered_to(&mut h2, &udp_reply(SERVER, 53, 30000)),
        (v4(CLIENT), 1111)
    );
    assert_eq!(
        delivered_to(&mut h2, &udp_reply(SERVER_2, 53, 30000)),
        (v4(HOST_B), 2222)
    );
    // The owner: both references are lent now; a flow to a third remote is refused rather
    // than sharing a port whose other tuples it no longer knows.
    let c = Ipv4Addr::new(10, 77, 1, 4);
    h1.inject(
        Side::Inside,
        &udp_from(c, 7, Ipv4Addr::new(10, 77, 2, 9), 53),
    )
    .unwrap();
    assert!(h1.take_output().is_empty());
    assert_eq!(h1.drop_count("nat_port_exhausted"), 1);
    assert_eq!(h1.counter("nat_pool_resyncs"), 1);
    let pool = h1.nf.port_pool(proto::UDP);
    assert_eq!((pool.refs(30000), pool.lent(30000)), (0, 2));
    // Both come back and end here: the port is free again (no leak).
    move_flow(&mut h2, &mut h1, &ka);
    move_flow(&mut h2, &mut h1, &kb);
    assert_eq!(
        delivered_to(&mut h1, &udp_reply(SERVER_2, 53, 30000)),
        (v4(HOST_B), 2222)
    );
    check_pools(&h1);
    h1.advance(Duration::from_secs(31));
    assert_eq!(h1.ctx.flows.len(), 0);
    let pool = h1.nf.port_pool(proto::UDP);
    assert_eq!((pool.in_use(), pool.lent(30000)), (0, 0));
    assert_eq!(out_port(&mut h1, &udp_from(c, 7, SERVER, 53)), 30000);
}

/// HA activation into a replica sharing the range: the imported mapping adds a reference to
/// a port a local mapping to another remote already holds.
#[test]
fn an_imported_mapping_shares_a_port_held_by_a_local_one() {
    let mut cfg = Config::with_external_ip(EXT);
    cfg.port_blocks = vec![(30000, 30000)];
    let mut h1 = nat(cfg.clone());
    let mut h2 = nat(cfg);
    assert_eq!(
        out_port(&mut h1, &udp_from(CLIENT, 1111, SERVER, 53)),
        30000
    );
    assert_eq!(
        out_port(&mut h2, &udp_from(HOST_B, 2222, SERVER_2, 53)),
        30000
    );
    let k = FlowKey::v4(proto::UDP, CLIENT, 1111, SERVER, 53).0;
    let rec = h1.ctx.flows.snapshot_flow(&k, h1.now()).expect("snapshot");
    let key = h2.ctx.flows.import_flow(&rec, h2.now()).expect("import");
    h2.nf.on_import(&mut h2.ctx, key);
    assert_eq!(
        h2.counter("nat_imported_ports_reserved"),
        0,
        "already in use"
    );
    assert_eq!(h2.nf.port_pool(proto::UDP).refs(30000), 2);
    assert_eq!(
        delivered_to(&mut h2, &udp_reply(SERVER, 53, 30000)),
        (v4(CLIENT), 1111)
    );
    check_pools(&h2);
}

#[test]
fn the_inside_source_port_is_preserved_when_free() {
    let mut h = default_nat();
    assert_eq!(
        out_port(&mut h, &udp_from(CLIENT, 40000, SERVER, 53)),
        40000
    );
    assert_eq!(h.counter("nat_port_preserved"), 1);
    // Outside the blocks: from the free list.
    assert_eq!(out_port(&mut h, &udp_from(CLIENT, 5000, SERVER, 53)), 20000);
    // Another inside host with the same source port gets another port while ports are free
    // (sharing would break endpoint-independence once both talk to one remote).
    let e = out_port(&mut h, &udp_from(HOST_B, 40000, SERVER_2, 53));
    assert_ne!(e, 40000);
    // TCP and ICMP identifiers are preserved too.
    let syn = build::tcp(
        MAC_A,
        MAC_B,
        v4(CLIENT),
        41000,
        v4(SERVER),
        80,
        tcp_flags::SYN,
        1,
        0,
        b"",
    );
    assert_eq!(out_port(&mut h, &syn), 41000);
    let ping = build::icmp_echo(MAC_A, MAC_B, v4(CLIENT), v4(SERVER), 42000, 1, true, b"p");
    assert_eq!(out_port(&mut h, &ping), 42000);
    assert_eq!(h.counter("nat_port_preserved"), 3);
    // Under pressure the source port is preserved if free for that destination (shared).
    let mut h = one_port_nat(30000);
    assert_eq!(
        out_port(&mut h, &udp_from(CLIENT, 30000, SERVER, 53)),
        30000
    );
    assert_eq!(
        out_port(&mut h, &udp_from(HOST_B, 30000, SERVER_2, 53)),
        30000
    );
    assert_eq!(h.counter("nat_port_preserved"), 2);
    check_pools(&h);
}

/// RFC 4787 REQ-1 / RFC 5382 REQ-1: one inside endpoint, one external endpoint, whatever the
/// destination, while its mappings live.
#[test]
fn an_inside_endpoint_keeps_its_external_port_for_every_destination() {
    let mut h = default_nat();
    let e = out_port(&mut h, &udp_from(CLIENT, 5000, SERVER, 53));
    assert_eq!(out_port(&mut h, &udp_from(CLIENT, 5000, SERVER, 54)), e);
    assert_eq!(out_port(&mut h, &udp_from(CLIENT, 5000, SERVER_2, 53)), e);
    // Another endpoint of the same host gets another port.
    assert_ne!(out_port(&mut h, &udp_from(CLIENT, 5001, SERVER, 53)), e);
    assert_eq!(
        delivered_to(&mut h, &udp_reply(SERVER_2, 53, e)),
        (v4(CLIENT), 5000)
    );
    assert_eq!(h.query()["pools"]["udp"]["in_use"], 2);
    check_pools(&h);
    // The limit of sharing: B shares A's port for R2 (no free port); when A then talks to
    // R2 that tuple is B's, so A cannot keep its port (counted), and with no other port the
    // flow is refused.
    let mut h = one_port_nat(30000);
    assert_eq!(out_port(&mut h, &udp_from(CLIENT, 1, SERVER, 53)), 30000);
    assert_eq!(out_port(&mut h, &udp_from(HOST_B, 2, SERVER_2, 53)), 30000);
    // Both answered: neither may be evicted to make room.
    answer_udp(&mut h, 30000);
    delivered_to(&mut h, &udp_reply(SERVER_2, 53, 30000));
    h.inject(Side::Inside, &udp_from(CLIENT, 1, SERVER_2, 53))
        .unwrap();
    assert!(h.take_output().is_empty());
    assert_eq!(h.counter("nat_eim_conflict"), 1);
    assert_eq!(h.drop_count("nat_port_exhausted"), 1);
}

/// splitmix64: a seeded, deterministic generator for the randomized test.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Random opens (UDP and TCP SYNs, some with preservable source ports), answers, closes (TCP
/// RST) and clock steps over a 6-port pool: after every step no two live mappings share an
/// outside tuple, every answer reaches the mapping's inside endpoint, and the pools' counts
/// match the table. The pool is small enough that ports are shared and mappings evicted.
#[test]
fn randomized_open_close_keeps_tuples_unique_and_pools_exact() {
    for seed in 1..=8u64 {
        let mut rng = Rng(seed);
        let mut cfg = Config::with_external_ip(EXT);
        cfg.port_blocks = vec![(30000, 30005)];
        cfg.udp_timeout_s = 30;
        cfg.tcp_embryonic_timeout_s = 20;
        let mut h = nat(cfg);
        let hosts = [CLIENT, HOST_B, Ipv4Addr::new(10, 77, 1, 4)];
        let remotes = [SERVER, SERVER_2, Ipv4Addr::new(10, 77, 2, 4)];
        let sports = [1000, 1001, 30001, 30004];
        let mut peak = 0;
        for _ in 0..400 {
            let host = hosts[rng.below(3) as usize];
            let sport = sports[rng.below(4) as usize];
            let remote = remotes[rng.below(3) as usize];
            let rport = 50 + rng.below(3) as u16;
            let tcp = rng.below(2) == 0;
            let flags = |f| {
                build::tcp(
                    MAC_A,
                    MAC_B,
                    v4(host),
                    sport,
                    v4(remote),
                    rport,
                    f,
                    1,
                    0,
                    b"",
                )
            };
            match rng.below(10) {
                0..=4 => {
                    let f = if tcp {
                        flags(tcp_flags::SYN)
                    } else {
                        udp_from(host, sport, remote, rport)
                    };
                    h.inject(Side::Inside, &f).unwrap();
                    h.take_output();
                }
                5..=6 => {
                    // Answer a live mapping: the reply must reach its inside endpoint.
                    let keys = h.ctx.flows.keys();
                    if !keys.is_empty() {
                        let k = keys[rng.below(keys.len() as u64) as usize];
                        let m = h.ctx.flows.peek(&k).unwrap().clone();
                        let f = if m.proto == proto::TCP {
                            build::tcp(
                                MAC_B,
                                MAC_A,
                                v4(m.remote_addr),
                                m.remote_port,
                                v4(EXT),
                                m.external_port,
                                tcp_flags::SYN | tcp_flags::ACK,
                                1,
                                2,
                                b"",
                            )
                        } else {
                            udp_reply(m.remote_addr, m.remote_port, m.external_port)
                        };
                        assert_eq!(
                            delivered_to(&mut h, &f),
                            (v4(m.inside_addr), m.inside_port),
                            "seed {seed}"
                        );
                    }
                }
                7 => {
                    h.inject(Side::Inside, &flags(tcp_flags::RST)).unwrap();
                    h.take_output();
                }
                _ => h.advance(Duration::from_secs(rng.below(15))),
            }
            peak = peak.max(h.ctx.flows.len());
            check_pools(&h);
        }
        assert!(
            peak > 12,
            "seed {seed}: never more mappings than ports per protocol ({peak})"
        );
        assert!(h.counter("nat_port_shared") > 0, "seed {seed}");
    }
}

/// A mapping that migrates away and straight back (no new flow in between) and then ends
/// frees its port: its reference is counted once, not lent forever.
#[test]
fn a_mapping_that_migrates_back_and_ends_frees_its_port() {
    let mut h1 = one_port_nat(30000);
    let mut h2 = one_port_nat(30010);
    assert_eq!(
        out_port(&mut h1, &udp_from(CLIENT, 1111, SERVER, 53)),
        30000
    );
    let k = FlowKey::v4(proto::UDP, CLIENT, 1111, SERVER, 53).0;
    let rec = h1.ctx.flows.export_flow(&k, h1.now()).expect("export");
    let key = h2.ctx.flows.import_flow(&rec, h2.now()).expect("import");
    h2.nf.on_import(&mut h2.ctx, key);
    let rec = h2.ctx.flows.export_flow(&k, h2.now()).expect("export back");
    let key = h1
        .ctx
        .flows
        .import_flow(&rec, h1.now())
        .expect("import back");
    h1.nf.on_import(&mut h1.ctx, key);
    check_pools(&h1);
    h1.advance(Duration::from_secs(31));
    assert_eq!(h1.ctx.flows.len(), 0);
    let pool = h1.nf.port_pool(proto::UDP);
    assert_eq!(
        (pool.in_use(), pool.refs(30000), pool.lent(30000)),
        (0, 0, 0)
    );
    assert_eq!(out_port(&mut h1, &udp_from(HOST_B, 5, SERVER, 53)), 30000);
}

#[test]
fn scan_backoff_doubles_per_failed_scan_and_resets_on_success() {
    let r80 = (proto::TCP, SERVER, 80);
    let r443 = (proto::TCP, SERVER, 443);
    let mut b = ScanBackoff::default();
    assert!(!b.evict_first(r80), "nothing failed yet");
    let mut skipped = Vec::new();
    for _ in 0..13 {
        b.failed(r80);
        let mut n = 0;
        while b.evict_first(r80) {
            n += 1;
        }
        skipped.push(n);
    }
    assert_eq!(
        skipped,
        [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 1024, 1024]
    );
    // Another remote is not affected, and its own failure starts over.
    b.failed(r80);
    assert!(!b.evict_first(r443));
    b.found(r443);
    assert!(
        b.evict_first(r80),
        "a success elsewhere keeps this remote's back-off"
    );
    b.failed(r443);
    assert!(b.evict_first(r443));
    assert!(!b.evict_first(r443));
    assert!(!b.evict_first(r80), "one remote at a time");
    b.failed(r80);
    b.found(r80);
    assert!(!b.evict_first(r80), "a scan that found a port resets");
}

#[test]
fn a_flood_towards_one_server_skips_the_sharing_scan_and_still_places_every_flow() {
    let mut cfg = Config::with_external_ip(EXT);
    cfg.port_blocks = vec![(30000, 30007)];
    let mut h = nat(cfg);
    let flooder = Ipv4Addr::new(10, 0, 1, 66);
    let syn = |sport: u16, dport: u16| syn_to_server(flooder, sport, dport);
    for i in 0..500u16 {
        h.inject(Side::Inside, &syn(1000 + i, 80)).unwrap();
    }
    assert_eq!(h.take_output().len(), 500, "every flood SYN got a port");
    assert_eq!(h.counter("nat_evicted_embryonic"), 492);
    assert_eq!(h.drop_count("nat_port_exhausted"), 0);
    // Every port holds a tuple towards SERVER:80, so each scan failed: after the first
    // failures almost every SYN went to eviction without one.
    let skipped = h.counter("nat_share_scan_skipped");
    assert!(skipped >= 480, "scans skipped: {skipped}");
    // A new remote is scanned at once and shares a port (no eviction for it).
    h.inject(Side::Inside, &syn(7000, 443)).unwrap();
    assert_eq!(h.take_output().len(), 1);
    assert_eq!(h.counter("nat_port_shared"), 1);
    assert_eq!(h.counter("nat_evicted_embryonic"), 492);
}

/// A SYN from inside host `src`:`sport` to SERVER:`dport` (what a flooder sends).
fn syn_to_server(src: Ipv4Addr, sport: u16, dport: u16) -> Vec<u8> {
    build::tcp(
        MAC_A,
        MAC_B,
        v4(src),
        sport,
        v4(SERVER),
        dport,
        tcp_flags::SYN,
        1,
        0,
        b"",
    )
}
