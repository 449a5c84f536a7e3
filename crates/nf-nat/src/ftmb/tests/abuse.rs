//! Flood defences of the FTMB NAT: embryonic timeout, eviction of embryonic mappings under
//! pool pressure, the per-host quota, and that all of them replay identically.

use super::*;

const HOST_B: Ipv4Addr = Ipv4Addr::new(10, 77, 1, 3);
const HOST_C: Ipv4Addr = Ipv4Addr::new(10, 77, 1, 4);

/// TCP from inside `host`:`sport` to the server's port 80.
fn tcp_from(host: Ipv4Addr, sport: u16, flags: u8) -> Vec<u8> {
    build::tcp(
        MAC_A,
        MAC_B,
        v4(host),
        sport,
        v4(SERVER),
        80,
        flags,
        1,
        0,
        b"",
    )
}

/// The first TCP source port from `from` on whose flow from `host` lands on worker `q`.
fn tcp_port_on(r: &Rig, host: Ipv4Addr, q: usize, from: u16) -> u16 {
    (from..)
        .find(|&p| r.queue(Side::Inside, &tcp_from(host, p, tcp_flags::SYN)) == q)
        .unwrap()
}

/// A SYN from `host`:`sport` and the server's SYN-ACK; returns the external port.
fn syn_answered(r: &mut Rig, host: Ipv4Addr, sport: u16) -> u16 {
    let ext = r
        .one(Side::Inside, &tcp_from(host, sport, tcp_flags::SYN))
        .1
        .sport;
    r.one(
        Side::Outside,
        &tcp_in(ext, tcp_flags::SYN | tcp_flags::ACK, b""),
    );
    ext
}

/// Opens and establishes (SYN, SYN-ACK, ACK) a connection from `host`:`sport`; returns its
/// external port.
fn establish(r: &mut Rig, host: Ipv4Addr, sport: u16) -> u16 {
    let ext = syn_answered(r, host, sport);
    r.one(Side::Inside, &tcp_from(host, sport, tcp_flags::ACK));
    ext
}

#[test]
fn a_syn_flood_evicts_embryonic_mappings_and_spares_established_ones() {
    // 20 ports: 10 per worker.
    let mut r = Rig::new(cfg_blocks(30000, 30019));
    let ext_b = establish(&mut r, HOST_B, 5000);
    // 200 SYNs from one host: 19 free ports, then each new SYN takes the port of an older
    // unanswered one instead of being refused.
    for sport in 10000..10200u16 {
        r.one(Side::Inside, &tcp_from(CLIENT, sport, tcp_flags::SYN));
    }
    assert_eq!(r.count("nat_port_exhausted"), 0);
    assert_eq!(r.count("nat_evicted_embryonic"), 200 - 19);
    let evicted: u64 = r.locals.iter().map(|l| l.stats.evicted).sum();
    assert_eq!(evicted, 181);
    assert_eq!(r.in_use(proto::TCP), 20);
    // B's established connection survived the flood.
    let (_, p, _) = r.one(Side::Outside, &tcp_in(ext_b, tcp_flags::ACK, b"x"));
    assert_eq!((p.dst, p.dport), (v4(HOST_B), 5000));
    // Another host still gets a mapping (one more flood mapping goes).
    let p = r
        .one(Side::Inside, &tcp_from(HOST_C, 6000, tcp_flags::SYN))
        .1;
    assert!((30000..=30019).contains(&p.sport));
    assert_eq!(r.count("nat_evicted_embryonic"), 182);
    let hosts = |h| r.locals.iter().map(|l| l.host_mappings(h)).sum::<u32>();
    assert_eq!((hosts(HOST_B), hosts(HOST_C), hosts(CLIENT)), (1, 1, 18));
    assert_pools_match_mappings(&r.nat, &r.sh, &r.locals);

    // Nothing evictable (every mapping of the worker established): refused.
    let mut r = Rig::new(cfg_blocks(30000, 30003)); // 2 ports per worker
    let a = tcp_port_on(&r, CLIENT, 0, 1000);
    let b = tcp_port_on(&r, CLIENT, 0, a + 1);
    establish(&mut r, CLIENT, a);
    establish(&mut r, CLIENT, b);
    let c = tcp_port_on(&r, CLIENT, 0, b + 1);
    r.none(Side::Inside, &tcp_from(CLIENT, c, tcp_flags::SYN));
    assert_eq!(r.count("nat_port_exhausted"), 1);
    assert_eq!(r.count("nat_evicted_embryonic"), 0);
    assert_eq!(r.locals[0].evictable(), 0);
}

#[test]
fn unanswered_syns_expire_after_the_embryonic_timeout() {
    let mut cfg = cfg_blocks(30000, 30999);
    cfg.tcp_embryonic_timeout_s = 5;
    let mut r = Rig::new(cfg);
    let a = tcp_port_on(&r, CLIENT, 0, 1000);
    let b = tcp_port_on(&r, CLIENT, 0, a + 1);
    r.one(Side::Inside, &tcp_from(CLIENT, a, tcp_flags::SYN));
    // B's SYN is answered: still opening (transitory timeout, 60 s), no longer embryonic.
    syn_answered(&mut r, CLIENT, b);
    assert_eq!(r.locals[0].evictable(), 2, "opening TCP is evictable");
    age(&mut r.locals[0], 6_000);
    let c = tcp_port_on(&r, CLIENT, 0, b + 1);
    r.one(Side::Inside, &tcp_from(CLIENT, c, tcp_flags::SYN)); // reads the clock, sweeps
    assert!(r.locals[0].mapping(&tcp_key(a)).is_none(), "A expired");
    assert!(
        r.locals[0].mapping(&tcp_key(b)).is_some(),
        "B answered: kept"
    );
    assert_eq!(r.counters().mappings_expired, 1);
    assert_eq!(r.in_use(proto::TCP), 2);
    assert_eq!(r.locals[0].host_mappings(CLIENT), 2);
    assert_eq!(r.locals[0].evictable(), 2);
}

#[test]
fn the_host_quota_is_split_among_the_workers() {
    let mut cfg = cfg_blocks(30000, 30999);
    cfg.max_mappings_per_host = 4; // 2 per worker
    let mut r = Rig::new(cfg);
    let mut translated = 0;
    for sport in 20000..20040u16 {
        translated += r.inject(Side::Inside, &udp_out(sport)).1.len();
    }
    assert_eq!(translated, 4);
    assert_eq!(r.count("nat_host_quota"), 36);
    for l in &r.locals {
        assert_eq!(l.host_mappings(CLIENT), 2);
    }
    // Refusals took no shared access: one pool access per mapping.
    assert_eq!(r.sh.pools.accesses().unwrap(), 4);
    // Another host is not affected.
    let f = build::udp(MAC_A, MAC_B, v4(HOST_B), 7, v4(SERVER), 53, b"q");
    r.one(Side::Inside, &f);
    // Expired mappings give the quota back.
    age(&mut r.locals[0], 31_000);
    let s = udp_port_on(&r, 0, 21000);
    r.one(Side::Inside, &udp_out(s));
    assert_eq!(r.locals[0].host_mappings(CLIENT), 1);
}

/// Two hosts flood SYNs at pools too small for them while a third holds established
/// connections: evictions, quota refusals and expiries happen after a snapshot, and a standby
/// replaying from that snapshot makes every decision again the same way (outputs, shared
/// pools, every mapping record).
#[test]
fn flood_evictions_and_quota_refusals_replay_identically() {
    let mut cfg = cfg_blocks(30000, 30039); // 20 ports per worker
    cfg.max_mappings_per_host = 24; // 12 per worker
    let (logger, _released) = audited_logger();
    let nat = FtmbNat::new(cfg.clone()).unwrap();
    let (m, sh, mut ws, mut locals, mut il) = logged_primary(&nat, &logger);

    // Phase A: B opens 4 connections (established next), the flood begins.
    let b_syns = (7000..7004).map(|p| (HOST_B, p));
    for (h, sport) in b_syns.chain((8000..8010).map(|p| (CLIENT, p))) {
        append(
            &mut il,
            &nat,
            Side::Inside,
            &tcp_from(h, sport, tcp_flags::SYN),
        );
    }
    run_threads(&nat, &sh, &mut ws, &mut locals, &il, &[0, 0]);
    let mut b_ext: Vec<(u16, u16)> = locals
        .iter()
        .flat_map(|l| l.mappings())
        .filter(|m| m.inside_addr == HOST_B)
        .map(|m| (m.inside_port, m.external_port))
        .collect();
    b_ext.sort_unstable();
    assert_eq!(b_ext.len(), 4);
    let from: Vec<u64> = (0..W).map(|q| il.next_seq(q as QueueId).unwrap()).collect();
    for &(sport, ext) in &b_ext {
        let syn_ack = tcp_in(ext, tcp_flags::SYN | tcp_flags::ACK, b"");
        append(&mut il, &nat, Side::Outside, &syn_ack);
        let ack = tcp_from(HOST_B, sport, tcp_flags::ACK);
        append(&mut il, &nat, Side::Inside, &ack);
    }
    run_threads(&nat, &sh, &mut ws, &mut locals, &il, &from);

    let (snap, recs) = snapshot_now(&nat, &sh, &m, &mut locals, &logger, &mut il);

    // Phase B: both flooders, interleaved with B's traffic both ways.
    for i in 0..150u16 {
        for h in [CLIENT, HOST_C] {
            let syn = tcp_from(h, 9000 + i, tcp_flags::SYN);
            append(&mut il, &nat, Side::Inside, &syn);
        }
        let (sport, ext) = b_ext[usize::from(i) % 4];
        append(
            &mut il,
            &nat,
            Side::Inside,
            &tcp_from(HOST_B, sport, tcp_flags::ACK),
        );
        append(
            &mut il,
            &nat,
            Side::Outside,
            &tcp_in(ext, tcp_flags::ACK, b"r"),
        );
    }
    let b = run_threads(&nat, &sh, &mut ws, &mut locals, &il, &snap.input_next);
    logger.with(|_| ()).unwrap();
    let count = |ls: &[Local], r: &str| ls.iter().map(|l| l.count_of(r)).sum::<u64>();
    assert!(count(&locals, "nat_evicted_embryonic") > 0, "evictions");
    assert!(count(&locals, "nat_host_quota") > 0, "quota refusals");
    assert_eq!(count(&locals, "nat_port_exhausted"), 0);
    let b_out = |ls: &[Local]| ls.iter().map(|l| l.host_mappings(HOST_B)).sum::<u32>();
    assert_eq!(b_out(&locals), 4, "B's established connections survived");
    let translated_in: u64 = locals.iter().map(|l| l.stats.translated_in).sum();
    assert_eq!(translated_in, 4 + 150, "every reply to B translated");
    drop(ws);

    let primary = (b, &nat, &sh, locals.as_mut_slice());
    let sb = replay_and_compare(&logger, &snap, cfg, &recs, &il, primary);
    for r in ["nat_evicted_embryonic", "nat_host_quota"] {
        assert_eq!(count(&sb.locals, r), count(&locals, r), "{r}");
    }
    drop(sb.ws);
    logger.join().unwrap();
}
