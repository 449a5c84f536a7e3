//! Engine tests with in-memory ports: router role, output path, drops, control answers.

use super::*;
use crate::config::Cidr;
use crate::forward::Forward;
use crate::nf::{Counters, DROP_OUTPUT_FULL};
use pliant_io::MemPort;
use pliant_net::build;
use pliant_net::Parsed;
use std::net::Ipv4Addr;

const IN_MAC: [u8; 6] = [0x02, 0, 0, 0, 1, 1];
const OUT_MAC: [u8; 6] = [0x02, 0, 0, 0, 2, 1];
const CLIENT_MAC: [u8; 6] = [0x02, 0, 0, 0, 1, 2];
const SERVER_MAC: [u8; 6] = [0x02, 0, 0, 0, 2, 2];

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn engine() -> (Engine<Forward, MemPort>, Instant) {
    engine_of(Forward::default(), EngineOptions::default())
}

fn engine_of<N: NetworkFunction>(nf: N, opts: EngineOptions) -> (Engine<N, MemPort>, Instant) {
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
            gateway: Some(ip("10.0.2.254")),
        },
    ];
    let e = Engine::new(
        "t",
        nf,
        [MemPort::new(IN_MAC), MemPort::new(OUT_MAC)],
        nets,
        opts,
        t0,
    );
    (e, t0)
}

/// The value of one sample in the engine's Prometheus text: `name{replica="t",labels} value`.
fn metric_value<N: NetworkFunction>(
    e: &Engine<N, MemPort>,
    now: Instant,
    name: &str,
    labels: &str,
) -> Option<u64> {
    let text = e.metrics(now);
    let prefix = format!("{name}{{replica=\"t\",{labels}}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .map(|v| v.parse().expect("integer sample"))
}

fn tx(e: &mut Engine<Forward, MemPort>, s: Side) -> Vec<Vec<u8>> {
    e.port_mut(s)
        .take_tx()
        .into_iter()
        .map(|r| r.frame)
        .collect()
}

fn parsed(f: &[u8]) -> Parsed {
    match pliant_net::parse(f) {
        Ok(Frame::Ip(p)) => p,
        other => panic!("not IP: {other:?}"),
    }
}

fn arp_of(f: &[u8]) -> ArpInfo {
    match pliant_net::parse(f) {
        Ok(Frame::Arp(a)) => a,
        other => panic!("not ARP: {other:?}"),
    }
}

/// The server's answer to our ARP request for 10.0.2.2.
fn server_arp_reply() -> Vec<u8> {
    arp::reply(
        SERVER_MAC,
        Ipv4Addr::new(10, 0, 2, 2),
        OUT_MAC,
        Ipv4Addr::new(10, 0, 2, 1),
        None,
    )
}

fn client_udp(ttl_dst: &str) -> Vec<u8> {
    build::udp(
        CLIENT_MAC,
        IN_MAC,
        ip("10.0.1.2"),
        1000,
        ip(ttl_dst),
        53,
        b"hi",
    )
}

#[test]
fn answers_arp_for_own_addresses_only() {
    let (mut e, t0) = engine();
    let who = |t: &str| {
        arp::request(
            CLIENT_MAC,
            Ipv4Addr::new(10, 0, 1, 2),
            t.parse().unwrap(),
            None,
        )
    };
    e.port_mut(Side::Inside).inject(&who("10.0.1.1"));
    e.port_mut(Side::Inside).inject(&who("10.0.1.77"));
    e.poll_once(t0);
    let out = tx(&mut e, Side::Inside);
    assert_eq!(out.len(), 1, "one reply, for our address only");
    let a = arp_of(&out[0]);
    assert_eq!(
        (a.op, a.sender_mac, a.sender_ip),
        (2, IN_MAC, Ipv4Addr::new(10, 0, 1, 1))
    );
    assert_eq!(a.target_mac, CLIENT_MAC);
    // The requester was learned.
    assert_eq!(
        e.neighbours(Side::Inside).lookup(ip("10.0.1.2")),
        Some(CLIENT_MAC)
    );
    assert_eq!(e.stats().inside.arp_replies_sent, 1);
}

#[test]
fn resolves_next_hop_holds_frames_then_forwards_with_router_rewrites() {
    let (mut e, t0) = engine();
    let f = client_udp("10.0.2.2");
    e.port_mut(Side::Inside).inject(&f);
    e.port_mut(Side::Inside).inject(&f);
    e.poll_once(t0);
    let out = tx(&mut e, Side::Outside);
    assert_eq!(out.len(), 1, "one ARP request, both frames held");
    let req = arp_of(&out[0]);
    assert_eq!(
        (req.op, req.target_ip, req.sender_ip),
        (1, Ipv4Addr::new(10, 0, 2, 2), Ipv4Addr::new(10, 0, 2, 1))
    );

    e.port_mut(Side::Outside).inject(&server_arp_reply());
    e.poll_once(t0 + Duration::from_millis(1));
    let out = tx(&mut e, Side::Outside);
    assert_eq!(out.len(), 2, "held frames released");
    for o in &out {
        let p = parsed(o);
        assert_eq!((p.dst_mac, p.src_mac, p.ttl), (SERVER_MAC, OUT_MAC, 63));
        assert!(pliant_net::ipv4_header_ok(o, &p));
        assert!(pliant_net::l4_checksum_ok(o, &p));
    }
    // Now known: the next frame goes straight out.
    e.port_mut(Side::Inside).inject(&f);
    e.poll_once(t0 + Duration::from_millis(2));
    assert_eq!(tx(&mut e, Side::Outside).len(), 1);
    assert_eq!(e.stats().outside.frames_out, 4);
}

#[test]
fn answers_pings_of_its_inside_address() {
    let (mut e, t0) = engine();
    let req = build::icmp_echo(
        CLIENT_MAC,
        IN_MAC,
        ip("10.0.1.2"),
        ip("10.0.1.1"),
        7,
        3,
        true,
        b"abc",
    );
    e.port_mut(Side::Inside).inject(&req);
    e.poll_once(t0);
    let out = tx(&mut e, Side::Inside);
    assert_eq!(out.len(), 1);
    let p = parsed(&out[0]);
    assert_eq!(
        (p.src, p.dst, p.icmp_type, p.sport),
        (ip("10.0.1.1"), ip("10.0.1.2"), 0, 7)
    );
    assert_eq!((p.src_mac, p.dst_mac), (IN_MAC, CLIENT_MAC));
    assert!(pliant_net::l4_checksum_ok(&out[0], &p));
    assert_eq!(
        &out[0][usize::from(p.l4_off) + 6..],
        &[0, 3, b'a', b'b', b'c']
    );
    assert_eq!(e.stats().inside.echo_replies_sent, 1);
}

#[test]
fn off_subnet_destinations_go_to_the_gateway() {
    let (mut e, t0) = engine();
    e.port_mut(Side::Inside).inject(&client_udp("192.0.2.9"));
    e.poll_once(t0);
    let out = tx(&mut e, Side::Outside);
    assert_eq!(arp_of(&out[0]).target_ip, Ipv4Addr::new(10, 0, 2, 254));
    // Inside has no gateway: unroutable.
    let back = build::udp(
        SERVER_MAC,
        OUT_MAC,
        ip("10.0.2.2"),
        53,
        ip("192.0.2.1"),
        1,
        b"x",
    );
    e.port_mut(Side::Outside).inject(&back);
    e.poll_once(t0);
    assert_eq!(e.ctx.drops().get("no_route"), 1);
}

#[test]
fn bad_and_foreign_frames_are_counted_drops() {
    let (mut e, t0) = engine();
    let mut ttl1 = client_udp("10.0.2.2");
    let p = parsed(&ttl1);
    // Set TTL to 1 and fix the header checksum by recomputation.
    ttl1[usize::from(p.l3_off) + 8] = 1;
    let mut p = parsed(&ttl1);
    p.ttl = 1;
    assert!(pliant_net::recompute_checksums(&mut ttl1, &p));
    let port = e.port_mut(Side::Inside);
    port.inject(&ttl1);
    port.inject(&[0u8; 10]);
    let mut other = vec![0u8; 60];
    other[12..14].copy_from_slice(&0x88ccu16.to_be_bytes()); // LLDP
    port.inject(&other);
    port.inject(&client_udp("10.0.2.1")); // to the router's outside address, via the NF
    port.inject(&client_udp("10.0.1.1")); // to the router's inside address: never the NF
    e.poll_once(t0);
    assert!(tx(&mut e, Side::Outside).is_empty());
    let d = e.ctx.drops();
    assert_eq!(d.get("ttl_exceeded"), 1);
    assert_eq!(d.get("not_ip"), 1);
    assert_eq!(d.get("local_destination"), 1);
    assert_eq!(d.get("to_router"), 1);
    assert_eq!(d.total(), 5, "{:?}", d.snapshot());
}

#[test]
fn control_answers_carry_counters() {
    let (mut e, t0) = engine();
    e.port_mut(Side::Inside).inject(&[0u8; 3]);
    e.poll_once(t0);
    let s = e.answer(Cmd::Stats, t0);
    assert_eq!(s["ok"], true);
    assert_eq!(s["engine"]["inside"]["frames_in"], 1);
    let m = e.answer(Cmd::Metrics, t0);
    let text = m["metrics"].as_str().unwrap();
    assert!(
        text.contains("pliant_frames_in_total{replica=\"t\",port=\"inside\"} 1"),
        "{text}"
    );
    assert!(text.contains("pliant_drops_total{replica=\"t\",reason=\""));
    assert_eq!(e.answer(Cmd::Flows, t0)["total"], 0);
    assert!(!e.stop_requested());
    e.answer(Cmd::Shutdown, t0);
    assert!(e.stop_requested());
}

/// An idle engine with its control socket and peer channel sleeps in poll(2) instead of
/// spinning: every fd it polls stays quiet until something arrives. (A closed wake-up pair once
/// left an fd readable for ever; under SCHED_FIFO two such replicas starved the machine.) A
/// request through the socket still wakes it and is answered.
#[test]
fn an_idle_engine_sleeps_and_a_control_request_wakes_it() {
    let dir = std::env::temp_dir().join(format!("pliant-idle-{}", std::process::id()));
    let ctl = dir.join("r.sock");
    let peer = dir.join("r.peer.sock");
    let (mut e, _) = engine();
    let (_server, handle) = crate::control::start(&crate::control::ControlOptions {
        socket: ctl.to_str().unwrap().into(),
        ..Default::default()
    })
    .unwrap();
    e.set_control(handle);
    let (_ps, link) =
        crate::peer::start(peer.to_str().unwrap(), crate::peer::test_security("r")).unwrap();
    e.set_peer(link);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = stop.clone();
    let max_sleep = EngineOptions::default().max_sleep;
    let started = Instant::now();
    let t = std::thread::spawn(move || {
        e.run_paced(&flag, Duration::ZERO).unwrap();
        e
    });
    std::thread::sleep(3 * max_sleep);
    let c = crate::control::client(ctl.to_str().unwrap(), None).unwrap();
    let v = c.call(&pliant_proto::Request::Stats).unwrap();
    // The typed part the controller's heartbeat reads decodes from the real answer.
    let brief: pliant_proto::reply::Stats = pliant_proto::reply::decode(&v).unwrap();
    assert_eq!(brief.replica, v["replica"].as_str().unwrap());
    let idle = started.elapsed();
    assert_eq!(v["ok"], true, "{v}");
    let rounds = v["engine"]["rounds"].as_u64().unwrap();
    // A sleeping engine runs about one round per poll timeout (plus the one the request
    // woke), a spinning one thousands. Counted against the time that really passed, so a
    // stalled test thread only allows more rounds.
    let timeouts = (idle.as_micros() / max_sleep.as_micros()) as u64;
    assert!(
        rounds <= 2 * timeouts + 5,
        "an idle engine ran {rounds} rounds in {idle:?} ({timeouts} poll timeouts)"
    );
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    // The stop flag is read after the next wake-up (at most the poll timeout).
    let e = t.join().unwrap();
    assert!(e.stats().sleeps >= 2, "{:?}", e.stats().sleeps);
    let _ = std::fs::remove_dir_all(dir);
}

/// Invariant 8: no input crashes the packet path. Random bytes and randomly mutated valid
/// frames (IP, ARP) on both ports; every frame is accounted for as processed or dropped.
#[test]
fn random_and_mutated_frames_never_panic() {
    let (mut e, t0) = engine();
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut rnd = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let seeds = [
        client_udp("10.0.2.2"),
        build::tcp(
            CLIENT_MAC,
            IN_MAC,
            ip("10.0.1.2"),
            1,
            ip("10.0.2.2"),
            2,
            0x02,
            1,
            0,
            b"abc",
        ),
        arp::request(
            CLIENT_MAC,
            Ipv4Addr::new(10, 0, 1, 2),
            Ipv4Addr::new(10, 0, 1, 1),
            None,
        ),
        build::udp(
            CLIENT_MAC,
            IN_MAC,
            ip("fd00::2"),
            1,
            ip("fd00:1::2"),
            2,
            b"v6",
        ),
    ];
    let mut n = 0u64;
    for round in 0..200u32 {
        for _ in 0..32 {
            let r = rnd();
            let mut f = if r % 4 == 0 {
                (0..(rnd() % 128) as usize)
                    .map(|_| rnd() as u8)
                    .collect::<Vec<u8>>()
            } else {
                let mut f = seeds[(r as usize / 4) % seeds.len()].clone();
                for _ in 0..(rnd() % 4) {
                    let i = (rnd() as usize) % f.len();
                    f[i] = rnd() as u8;
                }
                let cut = (rnd() as usize) % (f.len() + 1);
                if rnd() % 3 == 0 {
                    f.truncate(cut);
                }
                f
            };
            if f.is_empty() {
                f.push(0);
            }
            let side = if r & 1 == 0 {
                Side::Inside
            } else {
                Side::Outside
            };
            assert!(e.port_mut(side).inject(&f));
            n += 1;
        }
        e.poll_once(t0 + Duration::from_millis(u64::from(round)));
    }
    let st = e.stats();
    assert_eq!(st.inside.frames_in + st.outside.frames_in, n);
    assert!(
        e.ctx.drops().total() > 0,
        "malformed input must show up as drops"
    );
}

/// Test NF: rewrites the source address (like a NAT would) with the Full-mode rewrite helpers.
struct SrcRewrite(IpAddr);

impl NetworkFunction for SrcRewrite {
    type Flow = ();
    const NAME: &'static str = "src_rewrite";
    fn process(&mut self, ctx: &mut Ctx<()>, mut pkt: Packet) {
        pliant_net::rewrite::set_src_ip(&mut pkt.buf, &mut pkt.meta, self.0).unwrap();
        ctx.pkt_write_direct(pkt);
    }
}

/// Partial checksums and GSO super-frames pass through as one unit: the output carries the same
/// GSO metadata and a partial checksum recomputed for the rewritten addresses; a port without
/// offloads gets a software-completed checksum instead.
#[test]
fn offloads_are_carried_through_and_checksums_restored() {
    use pliant_io::{Gso, GsoKind};
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
    let mut ports = [MemPort::new(IN_MAC), MemPort::new(OUT_MAC)];
    ports[0].set_offloads(true);
    ports[1].set_offloads(true);
    let nat_ip = ip("10.0.2.1");
    let mut e = Engine::new(
        "t",
        SrcRewrite(nat_ip),
        ports,
        nets,
        EngineOptions::default(),
        t0,
    );
    // Learn the server so output goes straight out.
    let hello = build::udp(
        SERVER_MAC,
        OUT_MAC,
        ip("10.0.2.2"),
        1,
        ip("10.0.2.9"),
        2,
        b"x",
    );
    e.port_mut(Side::Outside).inject(&hello);
    e.poll_once(t0);
    e.port_mut(Side::Outside).take_tx();

    let mut f = client_tcp(0x18, 1, &[0xab; 3000]);
    let p = parsed(&f);
    let l4_len = (p.l4_end() - usize::from(p.l4_off)) as u32;
    let off = usize::from(p.l4_off) + 16;
    let gso = Gso {
        kind: GsoKind::TcpV4,
        segment_size: 1448,
        header_len: 54,
        ecn: false,
    };
    let meta = as_tso(&mut f, gso);
    e.port_mut(Side::Inside).inject_meta(&f, meta);
    e.poll_once(t0);
    let out = e.port_mut(Side::Outside).take_tx();
    assert_eq!(out.len(), 1, "drops: {:?}", e.ctx.drops().snapshot());
    let o = &out[0];
    assert_eq!(o.offload.gso, Some(gso));
    assert_eq!(
        o.offload.csum_partial,
        Some(CsumPartial {
            start: p.l4_off,
            offset: 16
        })
    );
    let q = parsed(&o.frame);
    assert_eq!(q.src, nat_ip);
    let want = pliant_net::checksum::fold(pliant_net::checksum::pseudo_header_sum(
        nat_ip, q.dst, 6, l4_len,
    ));
    assert_eq!(&o.frame[off..off + 2], &want.to_be_bytes());
    assert!(pliant_net::ipv4_header_ok(&o.frame, &q));
    // Completing the partial sum over the segment gives a valid checksum, as the peer would.
    let mut done = o.frame.clone();
    let full = pliant_net::checksum::finish(pliant_net::checksum::sum(
        &done[usize::from(q.l4_off)..q.l4_end()],
        0,
    ));
    done[off..off + 2].copy_from_slice(&full.to_be_bytes());
    assert!(pliant_net::l4_checksum_ok(&done, &q));
}

/// The output queue bound (`max_output` packets written per round): the NF's writes past it
/// are dropped and counted as `output_queue_full` (in `drops` of the stats JSON and in
/// Prometheus), the packets within it leave, and the next round has the whole bound again.
#[test]
fn output_past_the_per_round_bound_is_dropped_and_counted() {
    let opts = EngineOptions {
        max_output: 4,
        ..EngineOptions::default()
    };
    let (mut e, t0) = engine_of(Forward::default(), opts);
    e.port_mut(Side::Outside).inject(&server_arp_reply());
    e.poll_once(t0);
    for _ in 0..10 {
        e.port_mut(Side::Inside).inject(&client_udp("10.0.2.2"));
    }
    e.poll_once(t0);
    assert_eq!(tx(&mut e, Side::Outside).len(), 4);
    assert_eq!(e.ctx.drops().get(DROP_OUTPUT_FULL), 6);
    let s = e.answer(Cmd::Stats, t0);
    assert_eq!(s["drops"][DROP_OUTPUT_FULL], 6, "{}", s["drops"]);
    assert_eq!(
        metric_value(&e, t0, "pliant_drops_total", "reason=\"output_queue_full\""),
        Some(6)
    );
    // The bound is per round: three frames in the next round all leave.
    for _ in 0..3 {
        e.port_mut(Side::Inside).inject(&client_udp("10.0.2.2"));
    }
    e.poll_once(t0);
    assert_eq!(tx(&mut e, Side::Outside).len(), 3);
    assert_eq!(e.ctx.drops().total(), 6);
    assert_eq!(e.stats().inside.frames_in, 13);
}

/// Test NF: drops every packet, and counts it, under a label chosen by its UDP source port
/// (an NF that invents labels without bound, as a buggy one would).
struct Labeller(Vec<&'static str>);

impl NetworkFunction for Labeller {
    type Flow = ();
    const NAME: &'static str = "labeller";
    fn process(&mut self, ctx: &mut Ctx<()>, pkt: Packet) {
        let label = self.0[usize::from(pkt.meta.sport) % self.0.len()];
        ctx.count(label, 1);
        ctx.pkt_drop(pkt, label);
    }
}

/// The label bound (`Counters::MAX_LABELS` per counter set): labels past it are counted under
/// `other`, which the stats JSON (`drops`, `nf_counters`) and Prometheus both report, so the
/// reported values still add up to every packet; labels already known keep counting.
#[test]
fn labels_past_the_bound_are_counted_under_other() {
    let n = Counters::MAX_LABELS + 72;
    let labels: Vec<&'static str> = (0..n)
        .map(|i| &*Box::leak(format!("label_{i:03}").into_boxed_str()))
        .collect();
    let (mut e, t0) = engine_of(Labeller(labels.clone()), EngineOptions::default());
    let frame = |sport: usize| {
        build::udp(
            CLIENT_MAC,
            IN_MAC,
            ip("10.0.1.2"),
            u16::try_from(sport).unwrap(),
            ip("10.0.2.2"),
            53,
            b"x",
        )
    };
    for chunk in (0..n).collect::<Vec<_>>().chunks(50) {
        for &i in chunk {
            e.port_mut(Side::Inside).inject(&frame(i));
        }
        e.poll_once(t0);
    }
    let over = (n - Counters::MAX_LABELS) as u64;
    assert_eq!(e.ctx.drops().overflow, over);
    let s = e.answer(Cmd::Stats, t0);
    for map in ["drops", "nf_counters"] {
        let m = s[map].as_object().expect("a map");
        assert_eq!(m.len(), Counters::MAX_LABELS + 1, "{map}: {m:?}");
        assert_eq!(m["other"], over, "{map}");
        assert_eq!(m[labels[0]], 1, "{map}");
        assert!(
            m.get(labels[n - 1]).is_none(),
            "{map}: a label past the bound"
        );
        let sum: u64 = m.values().map(|v| v.as_u64().unwrap()).sum();
        assert_eq!(sum, n as u64, "{map}: every packet is in the map");
    }
    assert_eq!(
        metric_value(&e, t0, "pliant_drops_total", "reason=\"other\""),
        Some(over)
    );
    assert_eq!(
        metric_value(&e, t0, "pliant_nf_other_total", "nf=\"labeller\""),
        Some(over)
    );
    // A known label keeps its own count; a new one still goes to `other`.
    e.port_mut(Side::Inside).inject(&frame(5));
    e.port_mut(Side::Inside).inject(&frame(n - 1));
    e.poll_once(t0);
    let s = e.answer(Cmd::Stats, t0);
    assert_eq!(s["drops"][labels[5]], 2);
    assert_eq!(s["drops"]["other"], over + 1);
}

/// The control request queue (`CHANNEL_BOUND` requests the packet thread has not taken): one
/// more is refused at once, neither queued nor waited for, and counted in `control_errors`
/// (stats JSON and Prometheus); the packet thread then serves the queued ones, at most
/// `CONTROL_PER_ROUND` a round, and the queue takes requests again.
#[test]
fn a_full_control_queue_refuses_and_counts() {
    use crate::control::CHANNEL_BOUND;
    let (mut e, t0) = engine();
    let (sh, handle) = crate::control::channel().unwrap();
    e.set_control(handle);
    let waiting: Vec<_> = (0..CHANNEL_BOUND)
        .map(|_| sh.enqueue(Cmd::Query).expect("room in the queue"))
        .collect();
    let refused = sh.ask(Cmd::Query);
    assert_eq!(refused["ok"], false, "{refused}");
    assert!(
        refused["error"].as_str().unwrap().contains("busy"),
        "{refused}"
    );
    let mut answered = 0;
    let mut rounds = 0;
    while answered < CHANNEL_BOUND {
        e.poll_once(t0);
        rounds += 1;
        let now = waiting.iter().filter(|r| r.try_recv().is_ok()).count();
        assert_eq!(now, CONTROL_PER_ROUND.min(CHANNEL_BOUND - answered));
        answered += now;
    }
    assert_eq!(rounds, CHANNEL_BOUND.div_ceil(CONTROL_PER_ROUND));
    let s = e.answer(Cmd::Stats, t0);
    assert_eq!(s["engine"]["control_errors"], 1);
    assert_eq!(s["engine"]["control_requests"], CHANNEL_BOUND as u64);
    assert_eq!(
        metric_value(&e, t0, "pliant_control_errors_total", "nf=\"forward\""),
        Some(1)
    );
    let again = sh.enqueue(Cmd::Query).expect("room again once served");
    e.poll_once(t0);
    assert_eq!(again.try_recv().unwrap()["ok"], true);
}

/// Forwards like `Forward` and counts what it was given: proves a frame never reached the NF.
#[derive(Default)]
struct Seen {
    n: usize,
}

impl NetworkFunction for Seen {
    type Flow = ();
    const NAME: &'static str = "seen";
    fn process(&mut self, ctx: &mut Ctx<()>, pkt: Packet) {
        self.n += 1;
        ctx.pkt_write_direct(pkt);
    }
}

/// `client_udp` with one byte of the IPv4 header changed and the checksum fixed (or not).
fn client_udp_with(dst: &str, at: usize, val: u8, fix_csum: bool) -> Vec<u8> {
    let mut f = client_udp(dst);
    let p = parsed(&f);
    f[usize::from(p.l3_off) + at] = val;
    if fix_csum {
        let l3 = usize::from(p.l3_off);
        f[l3 + 10..l3 + 12].fill(0);
        let c = pliant_net::checksum::checksum(&f[l3..l3 + 20]);
        f[l3 + 10..l3 + 12].copy_from_slice(&c.to_be_bytes());
    }
    f
}

#[test]
fn router_checks_run_before_the_nf_and_are_counted() {
    let (mut e, t0) = engine_of(Seen::default(), EngineOptions::default());
    let port = e.port_mut(Side::Inside);
    // A bad header checksum (TTL changed, checksum not fixed).
    port.inject(&client_udp_with("10.0.2.2", 8, 9, false));
    // A unicast frame for another MAC.
    let mut foreign = client_udp("10.0.2.2");
    foreign[..6].copy_from_slice(&[0x02, 9, 9, 9, 9, 9]);
    port.inject(&foreign);
    // A multicast source address.
    let mut mc = client_udp("10.0.2.2");
    let l3 = usize::from(parsed(&mc).l3_off);
    mc[l3 + 12] = 224;
    let l3c = l3 + 10;
    mc[l3c..l3c + 2].fill(0);
    let c = pliant_net::checksum::checksum(&mc[l3..l3 + 20]);
    mc[l3c..l3c + 2].copy_from_slice(&c.to_be_bytes());
    port.inject(&mc);
    // TTL 1: answered with time exceeded from our inside address, quoting the packet.
    let ttl1 = client_udp_with("10.0.2.2", 8, 1, true);
    port.inject(&ttl1);
    // A good one still passes.
    port.inject(&client_udp("10.0.2.2"));
    e.poll_once(t0);
    assert_eq!(e.nf().n, 1, "only the good frame reaches the NF");
    let d = e.ctx.drops();
    assert_eq!(d.get("bad_ipv4_checksum"), 1);
    assert_eq!(d.get("l2_foreign_dst"), 1);
    assert_eq!(d.get("bad_src_addr"), 1);
    assert_eq!(d.get("ttl_exceeded"), 1);
    let back: Vec<Vec<u8>> = tx_frames(&mut e, Side::Inside);
    assert_eq!(back.len(), 1);
    let p = parsed(&back[0]);
    assert_eq!((p.proto, p.icmp_type, p.icmp_code), (proto::ICMP, 11, 0));
    assert_eq!((p.src, p.dst), (ip("10.0.1.1"), ip("10.0.1.2")));
    assert_eq!((p.src_mac, p.dst_mac), (IN_MAC, CLIENT_MAC));
    assert!(pliant_net::ipv4_header_ok(&back[0], &p));
    assert!(pliant_net::l4_checksum_ok(&back[0], &p));
    let q = pliant_net::icmp_error::inner(&back[0], &p).unwrap();
    assert_eq!(q.key, parsed(&ttl1).key);
    assert_eq!(e.stats().inside.icmp_errors_sent, 1);
    let m = metric_value(&e, t0, "pliant_icmp_errors_sent_total", "port=\"inside\"");
    assert_eq!(m, Some(1));
}

#[test]
fn time_exceeded_is_rate_limited() {
    let opts = EngineOptions {
        icmp_errors_per_s: 10,
        icmp_errors_burst: 3,
        ..EngineOptions::default()
    };
    let (mut e, t0) = engine_of(Seen::default(), opts);
    let ttl1 = client_udp_with("10.0.2.2", 8, 1, true);
    for _ in 0..8 {
        e.port_mut(Side::Inside).inject(&ttl1);
    }
    e.poll_once(t0);
    assert_eq!(e.nf().n, 0);
    assert_eq!(e.ctx.drops().get("ttl_exceeded"), 8);
    assert_eq!(e.port_mut(Side::Inside).take_tx().len(), 3);
    assert_eq!(e.stats().inside.icmp_errors_sent, 3);
    assert_eq!(e.stats().inside.icmp_errors_rate_limited, 5);
    // 10/s: one more after 100 ms.
    e.port_mut(Side::Inside).inject(&ttl1);
    e.port_mut(Side::Inside).inject(&ttl1);
    e.poll_once(t0 + Duration::from_millis(100));
    assert_eq!(e.port_mut(Side::Inside).take_tx().len(), 1);
}

/// A client UDP datagram with `len` payload bytes, DF set or not.
fn big_udp(len: usize, df: bool) -> Vec<u8> {
    let payload = vec![0x5au8; len];
    let mut f = build::udp(
        CLIENT_MAC,
        IN_MAC,
        ip("10.0.1.2"),
        1000,
        ip("10.0.2.2"),
        53,
        &payload,
    );
    if !df {
        clear_df(&mut f);
    }
    f
}

/// Clears DF in the frame's IPv4 header (checksum fixed).
fn clear_df(f: &mut [u8]) {
    let l3 = usize::from(parsed(f).l3_off);
    f[l3 + 6] &= !0x40;
    pliant_net::checksum::set_ipv4_header_checksum(&mut f[l3..l3 + 20]);
}

#[test]
fn oversized_packets_get_frag_needed_with_df_and_are_fragmented_without() {
    let (mut e, t0) = mtu_engine(1280, [false, false]);
    e.port_mut(Side::Inside).inject(&big_udp(1400, true));
    e.port_mut(Side::Inside).inject(&big_udp(2900, false));
    e.port_mut(Side::Inside).inject(&big_udp(1200, true));
    e.poll_once(t0);
    assert_eq!(e.nf().n, 2, "the DF packet never reached the NF");
    assert_eq!(e.ctx.drops().get("frag_needed"), 1);
    // Fragmentation needed, next-hop MTU 1280, from our inside address.
    let back = e.port_mut(Side::Inside).take_tx();
    assert_eq!(back.len(), 1);
    let p = parsed(&back[0].frame);
    assert_eq!((p.icmp_type, p.icmp_code, p.src), (3, 4, ip("10.0.1.1")));
    let l4 = usize::from(p.l4_off);
    assert_eq!(&back[0].frame[l4 + 6..l4 + 8], &1280u16.to_be_bytes());
    // The one without DF left as three fragments that fit, the small one whole.
    let out: Vec<Vec<u8>> = tx_frames(&mut e, Side::Outside);
    assert_eq!(out.len(), 4);
    for f in &out {
        let q = parsed(f);
        assert!(pliant_net::frag::ip_len(&q) <= 1280);
        assert!(pliant_net::ipv4_header_ok(f, &q));
        assert_eq!((q.dst_mac, q.src_mac), (SERVER_MAC, OUT_MAC));
    }
    assert_eq!(e.stats().outside.fragmented, 1);
    assert_eq!(e.stats().outside.fragments_sent, 3);
}

/// The fragments (MTU 1280) of a client datagram with `len` payload bytes, no DF.
fn client_fragments(len: usize) -> Vec<Vec<u8>> {
    let f = big_udp(len, false);
    pliant_net::frag::fragment_v4(&f, &parsed(&f), 1280).expect("fragments")
}

#[test]
fn fragments_reach_the_nf_as_one_datagram_and_leave_fragmented_again() {
    let (mut e, t0) = engine_of(Seen::default(), EngineOptions::default());
    e.port_mut(Side::Outside).inject(&server_arp_reply());
    e.poll_once(t0);
    let frags = client_fragments(2900);
    assert_eq!(frags.len(), 3);
    // Out of order: the NF sees nothing until the last piece arrives.
    for i in [2, 0] {
        e.port_mut(Side::Inside).inject(&frags[i]);
        e.poll_once(t0);
        assert_eq!(e.nf().n, 0);
    }
    e.port_mut(Side::Inside).inject(&frags[1]);
    e.poll_once(t0);
    assert_eq!(e.nf().n, 1, "one whole datagram");
    let out: Vec<Vec<u8>> = tx_frames(&mut e, Side::Outside);
    assert!(
        out.len() >= 2,
        "a 2928-byte packet leaves a 1500-byte port in pieces"
    );
    let mut r = pliant_net::reasm::Reassembler::new(Default::default());
    let whole = out
        .iter()
        .find_map(|f| match r.push(f, usize::from(parsed(f).l3_off), t0) {
            pliant_net::reasm::Outcome::Complete(w) => Some(w),
            _ => None,
        })
        .expect("the output fragments reassemble");
    let p = parsed(&whole);
    assert_eq!((p.sport, p.dport, p.payload_len), (1000, 53, 2900));
    assert!(pliant_net::ipv4_header_ok(&whole, &p) && pliant_net::l4_checksum_ok(&whole, &p));
    assert_eq!(e.stats_json(t0)["reassembly"]["reassembled"], 1);
}

#[test]
fn an_incomplete_datagram_is_dropped_after_the_timeout() {
    let (mut e, t0) = engine_of(Seen::default(), EngineOptions::default());
    let frags = client_fragments(2900);
    e.port_mut(Side::Inside).inject(&frags[0]);
    e.poll_once(t0);
    assert_eq!(e.stats_json(t0)["reassembly"]["pending_datagrams"], 1);
    e.poll_once(t0 + Duration::from_secs(31));
    assert_eq!(e.ctx.drops().get("frag_timeout"), 1);
    assert_eq!(e.nf().n, 0);
    assert_eq!(e.stats_json(t0)["reassembly"]["pending_bytes"], 0);
}

/// The frames a port sent since the last look.
fn tx_frames<N: NetworkFunction>(e: &mut Engine<N, MemPort>, side: Side) -> Vec<Vec<u8>> {
    e.port_mut(side)
        .take_tx()
        .into_iter()
        .map(|r| r.frame)
        .collect()
}

/// A TCP segment from the client (10.0.1.2:4000) to the server (10.0.2.2:80), ack 1.
fn client_tcp(flags: u8, seq: u32, payload: &[u8]) -> Vec<u8> {
    build::tcp(
        CLIENT_MAC,
        IN_MAC,
        ip("10.0.1.2"),
        4000,
        ip("10.0.2.2"),
        80,
        flags,
        seq,
        1,
        payload,
    )
}

/// Makes the TCP frame `f` what a kernel hands over for a TSO super-frame (the
/// pseudo-header sum in the checksum field) and returns its metadata.
fn as_tso(f: &mut [u8], gso: pliant_io::Gso) -> pliant_io::FrameMeta {
    let p = parsed(f);
    let l4_len = (p.l4_end() - usize::from(p.l4_off)) as u32;
    let ps = pliant_net::checksum::fold(pliant_net::checksum::pseudo_header_sum(
        p.src, p.dst, 6, l4_len,
    ));
    let off = usize::from(p.l4_off) + 16;
    f[off..off + 2].copy_from_slice(&ps.to_be_bytes());
    pliant_io::FrameMeta {
        wire_len: f.len() as u32,
        offload: Offload {
            csum_partial: Some(CsumPartial {
                start: p.l4_off,
                offset: 16,
            }),
            csum_valid: false,
            gso: Some(gso),
        },
        ..Default::default()
    }
}

/// A client TCP super-frame (TSO, segment size 1448) with `len` payload bytes,
/// FIN|PSH|ACK|CWR, DF set or not, and its metadata.
fn tso_frame(len: usize, df: bool) -> (Vec<u8>, pliant_io::FrameMeta) {
    let payload: Vec<u8> = (0..len).map(|i| (i * 13) as u8).collect();
    let mut f = client_tcp(0x99, 1000, &payload);
    if !df {
        clear_df(&mut f);
    }
    let gso = pliant_io::Gso {
        kind: pliant_io::GsoKind::TcpV4,
        segment_size: 1448,
        header_len: 54,
        ecn: true,
    };
    let meta = as_tso(&mut f, gso);
    (f, meta)
}

/// An engine whose outside port has MTU `mtu`, the ports' offloads as given (inside,
/// outside), the server's MAC known.
fn mtu_engine(mtu: usize, offloads: [bool; 2]) -> (Engine<Seen, MemPort>, Instant) {
    let mut ports = [
        MemPort::new(IN_MAC),
        MemPort::with_limits(
            OUT_MAC,
            pliant_io::MemPortLimits {
                max_frame_bytes: mtu + 18,
                ..Default::default()
            },
        ),
    ];
    ports[0].set_offloads(offloads[0]);
    ports[1].set_offloads(offloads[1]);
    let (e0, t0) = engine_of(Seen::default(), EngineOptions::default());
    let mut e = Engine::new(
        "t",
        Seen::default(),
        ports,
        e0.nets.clone(),
        EngineOptions::default(),
        t0,
    );
    e.port_mut(Side::Outside).inject(&server_arp_reply());
    e.poll_once(t0);
    (e, t0)
}

/// TCP segments out of `frames` (fragments reassembled), each checked: IPv4 header and TCP
/// checksums complete, fits `mtu`. Returns (seq, flags, payload) in order.
fn tcp_segments_out(frames: &[Vec<u8>], mtu: usize) -> Vec<(u32, u8, Vec<u8>)> {
    let mut r = pliant_net::reasm::Reassembler::new(Default::default());
    let mut segs = Vec::new();
    for f in frames {
        let q = parsed(f);
        assert!(pliant_net::frag::ip_len(&q) <= mtu);
        assert!(pliant_net::ipv4_header_ok(f, &q));
        let whole = match r.push(f, usize::from(q.l3_off), Instant::now()) {
            pliant_net::reasm::Outcome::NotFragment => f.clone(),
            pliant_net::reasm::Outcome::Complete(w) => w,
            pliant_net::reasm::Outcome::Held => continue,
            other => panic!("{other:?}"),
        };
        let q = parsed(&whole);
        assert!(
            pliant_net::l4_checksum_ok(&whole, &q),
            "complete TCP checksum"
        );
        let data = whole[usize::from(q.payload_off)..q.l4_end()].to_vec();
        segs.push((q.tcp_seq, q.tcp_flags, data));
    }
    segs.sort_by_key(|s| s.0);
    segs
}

/// A TSO super-frame without DF whose segments exceed the out-port's MTU leaves as segments
/// (fragmented where a segment alone is still too big) instead of being dropped; with DF it
/// is answered with "fragmentation needed" and never reaches the NF.
#[test]
fn a_gso_frame_too_big_for_the_port_is_segmented_then_fragmented() {
    let (mut e, t0) = mtu_engine(1280, [true, true]);
    let (f, meta) = tso_frame(3000, false);
    e.port_mut(Side::Inside).inject_meta(&f, meta);
    let (f_df, meta_df) = tso_frame(3000, true);
    e.port_mut(Side::Inside).inject_meta(&f_df, meta_df);
    e.poll_once(t0);
    assert_eq!(e.nf().n, 1, "the DF super-frame never reached the NF");
    assert_eq!(e.ctx.drops().get("frag_needed"), 1);
    assert_eq!(e.ctx.drops().get("gso_too_big"), 0);
    let out = e.port_mut(Side::Outside).take_tx();
    assert!(
        out.iter().all(|o| o.offload.is_none()),
        "no offload metadata"
    );
    let frames: Vec<Vec<u8>> = out.into_iter().map(|o| o.frame).collect();
    // 1448 + 1448 + 104 bytes; the two full segments (1488-byte packets) in two fragments.
    assert_eq!(frames.len(), 5);
    let segs = tcp_segments_out(&frames, 1280);
    let sizes: Vec<usize> = segs.iter().map(|s| s.2.len()).collect();
    assert_eq!(sizes, [1448, 1448, 104]);
    assert_eq!(segs[0].0, 1000);
    assert_eq!(segs[2].0, 1000 + 2896);
    // CWR on the first only, FIN and PSH on the last only, ACK on all.
    assert_eq!(
        segs.iter().map(|s| s.1).collect::<Vec<_>>(),
        [0x90, 0x10, 0x19]
    );
    let joined: Vec<u8> = segs.into_iter().flat_map(|s| s.2).collect();
    assert_eq!(joined, f[54..]);
    let st = e.stats().outside;
    assert_eq!((st.gso_segmented, st.gso_segments_sent), (1, 3));
    assert_eq!((st.fragmented, st.fragments_sent), (2, 4));
    let stats = e.stats_json(t0);
    assert_eq!(stats["engine"]["outside"]["gso_segmented"], 1);
    assert_eq!(
        metric_value(&e, t0, "pliant_gso_segmented_total", "port=\"outside\""),
        Some(1)
    );
}

/// A super-frame that fits the MTU but goes to a port without offloads is segmented too
/// (it used to be dropped as `gso_unsupported`); the segments need no fragmentation.
#[test]
fn a_gso_frame_for_a_port_without_offloads_is_segmented() {
    let (mut e, t0) = mtu_engine(1500, [true, false]);
    let (f, meta) = tso_frame(3000, true);
    e.port_mut(Side::Inside).inject_meta(&f, meta);
    e.poll_once(t0);
    let frames = tx_frames(&mut e, Side::Outside);
    assert_eq!(frames.len(), 3, "drops: {:?}", e.ctx.drops().snapshot());
    assert_eq!(tcp_segments_out(&frames, 1500).len(), 3);
    assert_eq!(e.stats().outside.fragmented, 0);
    assert_eq!(e.stats().outside.gso_segmented, 1);
}
