//! Deterministic live-migration tests: two engines on in-memory ports, a hand-driven "fabric"
//! (the test chooses which engine receives each frame) and a hand-driven peer channel (every
//! message goes through the wire codec). Fake time; no threads.

use super::*;
use crate::config::Cidr;
use crate::migrate::{decode_body, encode_body, PeerEvent, PeerMsg, MAX_HELD_PACKETS};
use crate::peer::{PeerEnd, PeerLink};
use pliant_io::MemPort;
use pliant_net::build;
use pliant_state::{FlowKey, StateError};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::sync::mpsc::{self, Receiver};

const IN_MAC: [u8; 6] = [0x02, 0, 0, 0, 1, 1];
const OUT_MAC: [u8; 6] = [0x02, 0, 0, 0, 2, 1];
const CLIENT_MAC: [u8; 6] = [0x02, 0, 0, 0, 1, 2];
const SERVER_MAC: [u8; 6] = [0x02, 0, 0, 0, 2, 2];
const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 0, 1, 2);
const SERVER: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 2);

/// Per-flow packet counter whose state must survive every move exactly.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
struct Seen {
    packets: u64,
    /// Sum of the sequence numbers seen, so a lost and a duplicated packet do not cancel out.
    seq_sum: u64,
}

#[derive(Default)]
struct SeqNf;

fn seq_of(payload: &[u8]) -> u64 {
    payload.get(..8).map_or(u64::MAX, |b| {
        u64::from_be_bytes(b.try_into().unwrap_or([0xff; 8]))
    })
}

impl NetworkFunction for SeqNf {
    type Flow = Seen;
    const NAME: &'static str = "seq";

    fn process(&mut self, ctx: &mut Ctx<Seen>, pkt: Packet) {
        let key = pkt.key();
        let seq = seq_of(pkt.payload());
        let r = match ctx.flows.get_flow(&key) {
            Ok(r) => r,
            Err(StateError::NotFound(_)) => {
                if ctx.flows.create_flow(key, Seen::default()).is_err() {
                    return ctx.pkt_drop(pkt, "create_failed");
                }
                match ctx.flows.get_flow(&key) {
                    Ok(r) => r,
                    Err(_) => return ctx.pkt_drop(pkt, "get_failed"),
                }
            }
            Err(StateError::Migrated { .. }) => return ctx.pkt_drop(pkt, "migrated"),
            Err(_) => return ctx.pkt_drop(pkt, "get_failed"),
        };
        let s = ctx.flows.state_mut(&r);
        s.packets += 1;
        s.seq_sum += seq;
        ctx.flows.put_flow(r, true);
        ctx.pkt_write(&key, pkt);
    }
}

type Eng = Engine<SeqNf, MemPort>;

fn engine(name: &str, t0: Instant, max_held: usize) -> (Eng, PeerEnd) {
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
    let opts = EngineOptions {
        max_held_packets: max_held,
        ..EngineOptions::default()
    };
    let mut e = Engine::new(
        name,
        SeqNf,
        [MemPort::new(IN_MAC), MemPort::new(OUT_MAC)],
        nets,
        opts,
        t0,
    );
    let (link, end) = PeerLink::channels();
    e.set_peer(link);
    // The server announces itself, so output needs no ARP round trip.
    let announce = pliant_net::arp::request(SERVER_MAC, SERVER, Ipv4Addr::new(10, 0, 2, 1), None);
    e.port_mut(Side::Outside).inject(&announce);
    e.poll_once(t0);
    let _ = e.port_mut(Side::Outside).take_tx();
    (e, end)
}

fn frame(sport: u16, seq: u64) -> Vec<u8> {
    build::udp(
        CLIENT_MAC,
        IN_MAC,
        IpAddr::V4(CLIENT),
        sport,
        IpAddr::V4(SERVER),
        9000,
        &seq.to_be_bytes(),
    )
}

fn key(sport: u16) -> FlowKey {
    FlowKey::v4(pliant_net::proto::UDP, CLIENT, sport, SERVER, 9000).0
}

/// Two replicas, the fabric and the peer channel, driven round by round.
struct Pair {
    e: [Eng; 2],
    ends: [PeerEnd; 2],
    now: Instant,
    /// Acks on their way back: (waiting on the destination's answer, source index).
    acks: Vec<(Receiver<PeerMsg>, usize)>,
    /// Output per flow (source port) in emission order: (replica index, seq).
    out: HashMap<u16, Vec<(usize, u64)>>,
    /// When set, the next batch sent is reported as undeliverable.
    fail_next_batch: bool,
}

const PATHS: [&str; 2] = ["/peer/a", "/peer/b"];

impl Pair {
    fn new(max_held: usize) -> Pair {
        let t0 = Instant::now();
        let (a, pa) = engine("a", t0, max_held);
        let (b, pb) = engine("b", t0, max_held);
        Pair {
            e: [a, b],
            ends: [pa, pb],
            now: t0,
            acks: Vec::new(),
            out: HashMap::new(),
            fail_next_batch: false,
        }
    }

    fn send(&mut self, to: usize, sport: u16, seq: u64) {
        assert!(self.e[to].port_mut(Side::Inside).inject(&frame(sport, seq)));
    }

    /// One round on both replicas (10 us apart), moving peer messages and collecting output.
    fn round(&mut self) {
        self.now += Duration::from_micros(10);
        for i in 0..2 {
            self.e[i].poll_once(self.now);
            for rec in self.e[i].port_mut(Side::Outside).take_tx() {
                let p = match pliant_net::parse(&rec.frame) {
                    Ok(Frame::Ip(p)) => p,
                    other => panic!("unexpected output {other:?}"),
                };
                let payload = &rec.frame[p.payload_off as usize..][..p.payload_len as usize];
                self.out
                    .entry(p.sport)
                    .or_default()
                    .push((i, seq_of(payload)));
            }
            self.pump(i);
        }
    }

    /// Delivers what replica `i` sent, through the wire codec, and returns finished Acks.
    fn pump(&mut self, i: usize) {
        let mut still = Vec::new();
        for (rx, src) in self.acks.drain(..) {
            match rx.try_recv() {
                Ok(ack) => self.ends[src]
                    .events
                    .send(PeerEvent::Ack(ack))
                    .expect("ack delivered"),
                Err(_) => still.push((rx, src)),
            }
        }
        self.acks = still;
        while let Ok(o) = self.ends[i].outbound.try_recv() {
            let bytes = encode_body(&o.msg).expect("encodes");
            let msg = decode_body(&bytes).expect("decodes");
            assert_eq!(msg, o.msg);
            let dst = PATHS.iter().position(|p| *p == o.to).expect("known peer");
            if self.fail_next_batch && matches!(msg, PeerMsg::Batch { .. }) {
                self.fail_next_batch = false;
                let PeerMsg::Batch { id, .. } = msg else {
                    unreachable!()
                };
                self.ends[i]
                    .events
                    .send(PeerEvent::SendFailed {
                        id,
                        what: "batch",
                        to: o.to,
                        error: "injected".into(),
                    })
                    .unwrap();
                continue;
            }
            let reply = if matches!(msg, PeerMsg::Done { .. }) {
                let (tx, rx) = mpsc::sync_channel(1);
                self.acks.push((rx, i));
                Some(tx)
            } else {
                None
            };
            self.ends[dst]
                .events
                .send(PeerEvent::Msg {
                    msg,
                    reply: reply.map(crate::peer::Reply::Channel),
                })
                .expect("delivered");
        }
    }

    fn migrate_in(&mut self, dst: usize, keys: &[FlowKey]) {
        let v = self.e[dst].answer(
            Cmd::MigrateIn {
                from: "x".into(),
                keys: keys.to_vec(),
            },
            self.now,
        );
        assert_eq!(v["ok"], true, "{v}");
    }

    fn migrate_out(&mut self, src: usize, dst: usize, keys: &[FlowKey]) -> Receiver<Value> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.e[src].submit(
            Cmd::MigrateOut {
                to: PATHS[dst].into(),
                keys: keys.to_vec(),
            },
            tx,
            self.now,
        );
        rx
    }

    fn run_until(&mut self, rx: &Receiver<Value>, max_rounds: usize) -> Value {
        for _ in 0..max_rounds {
            self.round();
            if let Ok(v) = rx.try_recv() {
                return v;
            }
        }
        panic!("migration did not finish in {max_rounds} rounds");
    }

    fn state(&self, i: usize, sport: u16) -> Option<Seen> {
        self.e[i].ctx.flows.peek(&key(sport)).cloned()
    }

    /// Every flow's output is exactly 0..n in order.
    fn assert_in_order(&self, flows: impl Iterator<Item = u16>, n: u64) {
        for f in flows {
            let seqs: Vec<u64> = self
                .out
                .get(&f)
                .map_or(vec![], |v| v.iter().map(|x| x.1).collect());
            assert_eq!(seqs, (0..n).collect::<Vec<_>>(), "flow {f}");
        }
    }
}

fn expected(n: u64) -> Seen {
    Seen {
        packets: n,
        seq_sum: n * (n - 1) / 2,
    }
}

#[test]
fn flows_move_mid_stream_without_loss_or_reordering() {
    let mut p = Pair::new(MAX_HELD_PACKETS);
    let flows: Vec<u16> = (40000..40050).collect();
    let keys: Vec<FlowKey> = flows.iter().map(|f| key(*f)).collect();
    // Before the move: seq 0..20 of every flow at A.
    for seq in 0..20 {
        for f in &flows {
            p.send(0, *f, seq);
        }
        p.round();
    }
    p.migrate_in(1, &keys);
    // In flight at the switch: seq 20..22 are still in A's ring when migrate_out arrives.
    for f in &flows {
        p.send(0, *f, 20);
        p.send(0, *f, 21);
    }
    let reply = p.migrate_out(0, 1, &keys);
    // From the switch on the fabric sends to B (held there): seq 24, 25, ...
    let mut next_b = 24;
    let mut late_sent = false;
    let v = loop {
        for f in &flows {
            p.send(1, *f, next_b);
        }
        next_b += 1;
        p.round();
        // The stragglers 22, 23 reach A only after its export: forwarded to B.
        if !late_sent && p.e[0].migrate_stats().flows_exported > 0 {
            for f in &flows {
                p.send(0, *f, 22);
                p.send(0, *f, 23);
            }
            late_sent = true;
        }
        if let Ok(v) = reply.try_recv() {
            break v;
        }
        assert!(next_b < 200, "migration did not finish");
    };
    assert!(late_sent);
    assert_eq!(v["ok"], true, "{v}");
    assert_eq!(v["moved"], 50, "{v}");
    assert_eq!(v["imported"], 50, "{v}");
    assert_eq!(v["pause"]["flows"], 50, "{v}");
    // After the move: more traffic at B only.
    for s in next_b..next_b + 10 {
        for f in &flows {
            p.send(1, *f, s);
        }
        p.round();
    }
    let n = next_b + 10;
    // No loss, no reordering, and the flows' state carries on exactly.
    p.assert_in_order(flows.iter().copied(), n);
    for f in &flows {
        assert_eq!(p.state(1, *f), Some(expected(n)), "flow {f}");
        assert_eq!(p.state(0, *f), None);
        // A's output stops where B's starts.
        let o = &p.out[f];
        let first_b = o.iter().position(|x| x.0 == 1).unwrap();
        assert!(o[first_b..].iter().all(|x| x.0 == 1), "flow {f}: {o:?}");
        assert_eq!(
            first_b, 22,
            "A emitted everything it received before the export"
        );
    }
    let (sa, sb) = (p.e[0].migrate_stats(), p.e[1].migrate_stats());
    assert_eq!(sa.forwarded_late, 100);
    assert_eq!(sb.late_reinjected, 100);
    assert_eq!(sb.hold_overflow, 0);
    assert!(sb.released_packets >= 50);
    assert_eq!(p.e[0].ctx.drops().total() + p.e[1].ctx.drops().total(), 0);
    assert_eq!(p.e[1].held_packets(), 0);
}

#[test]
fn a_thousand_flows_move_in_one_batch() {
    let mut p = Pair::new(MAX_HELD_PACKETS);
    let flows: Vec<u16> = (20000..21000).collect();
    let keys: Vec<FlowKey> = flows.iter().map(|f| key(*f)).collect();
    for f in &flows {
        p.send(0, *f, 0);
        if p.e[0].port_mut(Side::Inside).rx_pending() >= 512 {
            p.round();
        }
    }
    for _ in 0..20 {
        p.round();
    }
    assert_eq!(p.e[0].ctx.flows.len(), 1000, "{}", p.e[0].stats_json(p.now));
    p.migrate_in(1, &keys);
    for f in &flows {
        p.send(1, *f, 1);
    }
    while p.e[1].port_mut(Side::Inside).rx_pending() > 0 {
        p.round();
    }
    assert_eq!(p.e[1].held_packets(), 1000);
    let rx = p.migrate_out(0, 1, &keys);
    let v = p.run_until(&rx, 50);
    assert_eq!(
        (v["ok"].clone(), v["moved"].clone()),
        (json!(true), json!(1000)),
        "{v}"
    );
    for _ in 0..20 {
        p.round();
    }
    assert_eq!(p.e[1].ctx.flows.len(), 1000);
    assert_eq!(p.e[0].ctx.flows.len(), 0);
    p.assert_in_order(flows.iter().copied(), 2);
    assert_eq!(p.e[1].migrate_stats().released_packets, 1000);
}

#[test]
fn busy_flows_are_retried_then_moved() {
    let mut p = Pair::new(MAX_HELD_PACKETS);
    p.send(0, 5000, 0);
    p.round();
    let k = key(5000);
    // An open transaction (refcount 1) pins the flow.
    let r = p.e[0].ctx.flows.get_flow(&k).expect("flow exists");
    p.migrate_in(1, &[k]);
    let rx = p.migrate_out(0, 1, &[k]);
    p.send(1, 5000, 1);
    for _ in 0..5 {
        p.round();
    }
    assert!(rx.try_recv().is_err(), "must not export a busy flow");
    assert!(p.e[0].migrate_stats().busy_retries >= 4);
    assert_eq!(p.e[0].migrate_stats().flows_exported, 0);
    p.e[0].ctx.flows.put_flow(r, false);
    let v = p.run_until(&rx, 10);
    assert_eq!(v["moved"], 1, "{v}");
    p.assert_in_order([5000].into_iter(), 2);
    assert_eq!(p.state(1, 5000), Some(expected(2)));
}

#[test]
fn a_flow_busy_too_long_stays_and_its_held_packets_come_back() {
    let mut p = Pair::new(MAX_HELD_PACKETS);
    p.send(0, 5001, 0);
    p.round();
    let k = key(5001);
    let r = p.e[0].ctx.flows.get_flow(&k).expect("flow exists");
    p.migrate_in(1, &[k]);
    let rx = p.migrate_out(0, 1, &[k]);
    p.send(1, 5001, 1);
    p.send(1, 5001, 2);
    p.round();
    p.now += crate::migrate::BUSY_WAIT; // the busy wait runs out
    let v = p.run_until(&rx, 10);
    assert_eq!(v["moved"], 0, "{v}");
    assert_eq!(v["failed"][0]["key"], k.to_string(), "{v}");
    p.e[0].ctx.flows.put_flow(r, false);
    p.round();
    // The held packets were handed back and processed by the owner, in order.
    p.assert_in_order([5001].into_iter(), 3);
    assert_eq!(p.state(0, 5001), Some(expected(3)));
    assert_eq!(p.state(1, 5001), None);
    assert_eq!(p.e[1].migrate_stats().returned_packets, 2);
}

/// A migration rolled back before its switch: the destination stops holding the keys, and
/// what it held (here: packets that reached it anyway) goes to its NF in order instead of
/// waiting for state that will never come.
#[test]
fn an_aborted_migration_ends_its_holds_and_releases_what_was_held() {
    let mut p = Pair::new(64);
    let (k1, k2) = (key(6100), key(6101));
    p.migrate_in(1, &[k1, k2]);
    for seq in 0..3 {
        p.send(1, 6100, seq);
    }
    p.round();
    assert_eq!(p.e[1].held_packets(), 3);
    let v = p.e[1].answer(Cmd::MigrateAbort { keys: vec![k1, k2] }, p.now);
    assert_eq!(v["ok"], true, "{v}");
    assert_eq!(
        (v["aborted"].as_u64(), v["released_packets"].as_u64()),
        (Some(2), Some(3))
    );
    assert_eq!(v["held_keys"], 0);
    assert_eq!(p.e[1].held_packets(), 0);
    assert_eq!(
        p.state(1, 6100).map(|s| s.packets),
        Some(3),
        "processed here, in order"
    );
    // Later packets are not held any more; aborting again changes nothing.
    p.send(1, 6100, 3);
    p.round();
    assert_eq!(p.state(1, 6100).map(|s| s.packets), Some(4));
    let v = p.e[1].answer(Cmd::MigrateAbort { keys: vec![k1] }, p.now);
    assert_eq!(v["aborted"], 0);
    assert_eq!(p.e[1].migrate_stats().aborted_holds, 2);
}

#[test]
fn hold_overflow_is_counted_and_nothing_else_is_lost() {
    let mut p = Pair::new(8);
    p.send(0, 6000, 0);
    p.round();
    let k = key(6000);
    p.migrate_in(1, &[k]);
    for seq in 1..=12 {
        p.send(1, 6000, seq);
    }
    p.round();
    assert_eq!(p.e[1].held_packets(), 8);
    assert_eq!(p.e[1].migrate_stats().hold_overflow, 4);
    assert_eq!(p.e[1].ctx.drops().get("migrate_hold_overflow"), 4);
    let rx = p.migrate_out(0, 1, &[k]);
    let v = p.run_until(&rx, 10);
    assert_eq!(v["pause"]["released_packets"], 8, "{v}");
    assert_eq!(p.state(1, 6000).map(|s| s.packets), Some(9));
    let stats = p.e[1].stats_json(p.now);
    assert_eq!(stats["migration"]["hold_overflow"], 4);
}

#[test]
fn a_flow_bounces_back_and_forth_with_exact_state() {
    let mut p = Pair::new(MAX_HELD_PACKETS);
    let k = key(7000);
    let mut seq = 0;
    let mut owner = 0;
    for _ in 0..3 {
        p.send(owner, 7000, seq);
        seq += 1;
        p.round();
    }
    for _ in 0..24 {
        let dst = 1 - owner;
        p.migrate_in(dst, &[k]);
        let rx = p.migrate_out(owner, dst, &[k]);
        p.send(dst, 7000, seq);
        seq += 1;
        let v = p.run_until(&rx, 10);
        assert_eq!(v["moved"], 1, "{v}");
        owner = dst;
        for _ in 0..2 {
            p.send(owner, 7000, seq);
            seq += 1;
            p.round();
        }
    }
    p.assert_in_order([7000].into_iter(), seq);
    assert_eq!(p.state(owner, 7000), Some(expected(seq)));
    assert_eq!(p.state(1 - owner, 7000), None);
    let (p50, _, _) = p.e[owner].mig.pause_percentiles();
    assert!(p50 > 0, "pauses are recorded");
}

/// The source's last output of a flow is flushed but still in a kernel queue (veth backlog,
/// qdisc) when the migration starts. Output reaches the receiver (`Pair::out`) only when it
/// leaves that queue, so if the source exported before, the destination's released output
/// would arrive first: the receiver would see the flow out of order.
#[test]
fn the_export_waits_until_the_source_output_left_the_kernel() {
    let mut p = Pair::new(MAX_HELD_PACKETS);
    let k = key(6100);
    for seq in 0..3 {
        p.send(0, 6100, seq);
        p.round();
    }
    // From here the source's frames stay queued after the flush.
    p.e[0].port_mut(Side::Outside).set_hold_tx(true);
    for seq in 3..6 {
        p.send(0, 6100, seq);
        p.round();
    }
    assert_eq!(p.e[0].port_mut(Side::Outside).tx_in_flight(), 3);
    p.migrate_in(1, &[k]);
    let rx = p.migrate_out(0, 1, &[k]);
    let mut seq = 6;
    for _ in 0..20 {
        p.send(1, 6100, seq);
        seq += 1;
        p.round();
        assert!(
            rx.try_recv().is_err(),
            "the move finished with output in flight"
        );
    }
    // Nothing was exported, and the destination emitted nothing of the flow meanwhile.
    assert_eq!(p.e[0].migrate_stats().flows_exported, 0);
    assert!(p.out[&6100].iter().all(|x| x.0 == 0), "{:?}", p.out[&6100]);
    // The queue drains: the move completes and the receiver sees 0..seq in order.
    assert_eq!(p.e[0].port_mut(Side::Outside).complete_tx(usize::MAX), 3);
    p.e[0].port_mut(Side::Outside).set_hold_tx(false);
    let v = p.run_until(&rx, 10);
    assert_eq!(v["moved"], 1, "{v}");
    assert!(v["settle_us"].as_u64().unwrap_or(0) > 0, "{v}");
    for _ in 0..2 {
        p.send(1, 6100, seq);
        seq += 1;
        p.round();
    }
    p.assert_in_order([6100].into_iter(), seq);
    let st = p.e[0].migrate_stats();
    assert_eq!((st.tx_settle_waits, st.tx_settle_timeouts), (1, 0));
}

/// Other flows keep the source's port busy (their frames are always in flight): the move
/// waits only for the moving flow's own output, not for a queue that never empties.
#[test]
fn a_busy_port_does_not_hold_up_a_quiet_flow() {
    let mut p = Pair::new(MAX_HELD_PACKETS);
    let k = key(6300);
    p.send(0, 6300, 0);
    p.round();
    p.e[0].port_mut(Side::Outside).set_hold_tx(true);
    p.send(0, 6300, 1);
    p.round();
    p.migrate_in(1, &[k]);
    let rx = p.migrate_out(0, 1, &[k]);
    let mut reply = None;
    for i in 0..10 {
        // Another flow's output joins the queue every round and stays there.
        p.send(0, 6301, i);
        p.round();
        if i == 2 {
            // Only the moving flow's frame (the oldest) leaves the kernel.
            assert_eq!(p.e[0].port_mut(Side::Outside).complete_tx(1), 1);
        }
        if let Ok(v) = rx.try_recv() {
            reply = Some(v);
            break;
        }
    }
    let v = reply.expect("the move finished while the port stayed busy");
    assert_eq!(v["moved"], 1, "{v}");
    assert!(p.e[0].port_mut(Side::Outside).tx_in_flight() > 0);
    let st = p.e[0].migrate_stats();
    assert_eq!((st.tx_settle_waits, st.tx_settle_timeouts), (1, 0));
    p.e[0].port_mut(Side::Outside).set_hold_tx(false);
    for seq in 2..4 {
        p.send(1, 6300, seq);
        p.round();
    }
    p.assert_in_order([6300].into_iter(), 4);
}

/// Keeps `backlog` frames of an unmoved bulk flow queued in replica `i`'s inside ring, each
/// stamped as a kernel ring stamps it (`stamped`) or not (a port without ring stamps).
fn keep_ring_busy(p: &mut Pair, i: usize, backlog: usize, seq: &mut u64, stamped: bool) {
    while p.e[i].port_mut(Side::Inside).rx_pending() < backlog {
        let f = frame(7000, *seq);
        let meta = pliant_io::FrameMeta {
            wire_len: f.len() as u32,
            rx_ns: if stamped { realtime_ns() } else { 0 },
            ..Default::default()
        };
        assert!(p.e[i].port_mut(Side::Inside).inject_meta(&f, meta));
        *seq += 1;
    }
}

/// A source whose ring never runs empty (another flow's bulk traffic keeps more than a batch
/// queued) moves a flow once it has read the frames queued before the request and before the
/// shipping: the ring stamps prove it, where a quiet round never comes.
#[test]
fn a_ring_that_never_runs_empty_does_not_hold_up_a_move() {
    for stamped in [true, false] {
        let mut p = Pair::new(MAX_HELD_PACKETS);
        let batch = p.e[0].opts.batch;
        let k = key(6400);
        let mut bulk = 0;
        p.send(0, 6400, 0);
        p.round();
        p.migrate_in(1, &[k]);
        // Three batches queued before the request: the first rounds after it read only those.
        keep_ring_busy(&mut p, 0, 3 * batch, &mut bulk, stamped);
        std::thread::sleep(Duration::from_micros(50));
        let rx = p.migrate_out(0, 1, &[k]);
        let mut reply = None;
        for round in 0..40 {
            if round == 1 {
                assert_eq!(
                    p.e[0].migrate_stats().flows_exported,
                    0,
                    "exported too early"
                );
            }
            keep_ring_busy(&mut p, 0, 3 * batch, &mut bulk, stamped);
            // Sleep past the stamp clock's resolution between rounds.
            std::thread::sleep(Duration::from_micros(50));
            p.round();
            if let Ok(v) = rx.try_recv() {
                reply = Some(v);
                break;
            }
        }
        if !stamped {
            // Without stamps only a drained round proves the ring was read: none came.
            assert!(reply.is_none(), "moved without proof the ring was read");
            assert_eq!(p.e[0].migrate_stats().flows_exported, 0);
            continue;
        }
        let v = reply.expect("the move finished while the ring stayed busy");
        assert_eq!(
            (v["ok"].clone(), v["moved"].clone()),
            (json!(true), json!(1)),
            "{v}"
        );
        assert!(p.e[0].port_mut(Side::Inside).rx_pending() >= 2 * batch);
        p.send(1, 6400, 1);
        p.round();
        p.assert_in_order([6400].into_iter(), 2);
    }
}

/// Output that never leaves the kernel does not stall a move for ever: past the bound the
/// source exports anyway and counts it.
#[test]
fn output_stuck_in_the_kernel_times_out_counted() {
    let mut p = Pair::new(MAX_HELD_PACKETS);
    let k = key(6200);
    p.send(0, 6200, 0);
    p.round();
    p.e[0].port_mut(Side::Outside).set_hold_tx(true);
    p.send(0, 6200, 1);
    p.round();
    p.migrate_in(1, &[k]);
    let rx = p.migrate_out(0, 1, &[k]);
    for _ in 0..3 {
        p.round();
    }
    assert_eq!(p.e[0].migrate_stats().flows_exported, 0);
    p.now += crate::migrate::TX_SETTLE_WAIT;
    let v = p.run_until(&rx, 10);
    assert_eq!(v["moved"], 1, "{v}");
    let st = p.e[0].migrate_stats();
    assert_eq!((st.tx_settle_waits, st.tx_settle_timeouts), (1, 1));
    // The held frame is still delivered (late): nothing is lost, the order is not promised.
    p.e[0].port_mut(Side::Outside).set_hold_tx(false);
    p.round();
    assert_eq!(p.out[&6200].len(), 2);
}

#[test]
fn an_undeliverable_batch_is_reimported_at_the_source() {
    let mut p = Pair::new(MAX_HELD_PACKETS);
    p.send(0, 8000, 0);
    p.round();
    let k = key(8000);
    p.fail_next_batch = true;
    let rx = p.migrate_out(0, 1, &[k]);
    let v = p.run_until(&rx, 10);
    assert_eq!(v["ok"], false, "{v}");
    assert!(v["error"].as_str().unwrap().contains("re-imported"), "{v}");
    assert_eq!(p.state(0, 8000), Some(expected(1)));
    // The flow is fully ours again: its packets are processed, not forwarded.
    p.send(0, 8000, 1);
    p.round();
    assert_eq!(p.state(0, 8000), Some(expected(2)));
    assert_eq!(p.e[0].migrate_stats().forwarded_late, 0);
}

#[test]
fn flows_listing_and_refusals() {
    let mut p = Pair::new(MAX_HELD_PACKETS);
    p.send(0, 9000, 0);
    p.round();
    let v = p.e[0].answer(Cmd::Flows, p.now);
    assert_eq!(v["flows"][0]["key"], key(9000).to_string(), "{v}");
    assert_eq!(v["flows"][0]["version"], 1, "{v}");
    assert_eq!(v["flows"][0]["aliases"], json!([]), "{v}");
    // A flow live here cannot be moved in.
    let v = p.e[0].answer(
        Cmd::MigrateIn {
            from: "b".into(),
            keys: vec![key(9000)],
        },
        p.now,
    );
    assert_eq!(v["ok"], false, "{v}");
    // Without a peer channel migrate_out is refused at once.
    let (mut lone, _) = engine("lone", p.now, 8);
    lone.peer = None;
    let (tx, rx) = mpsc::sync_channel(1);
    lone.submit(
        Cmd::MigrateOut {
            to: "/x".into(),
            keys: vec![],
        },
        tx,
        p.now,
    );
    assert_eq!(rx.try_recv().unwrap()["ok"], false);
    // The forward NF has no port blocks.
    let v = p.e[0].answer(
        Cmd::SetPortBlocks {
            blocks: vec![(1, 2)],
        },
        p.now,
    );
    assert_eq!(v["ok"], false);
}

#[test]
fn a_flow_past_the_listing_bound_is_found_by_key_and_moved() {
    let mut p = Pair::new(MAX_HELD_PACKETS);
    // A bound of 8 stands in for the default 1000: the lookup must not depend on it.
    p.e[0].opts.max_listed_flows = 8;
    let flows: Vec<u16> = (30000..30020).collect();
    for f in &flows {
        p.send(0, *f, 0);
    }
    p.round();
    let listing = p.e[0].answer(Cmd::Flows, p.now);
    assert_eq!(
        (listing["total"].clone(), listing["listed"].clone()),
        (json!(20), json!(8))
    );
    let listed: Vec<&str> = listing["flows"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|f| f["key"].as_str())
        .collect();
    let deep = *flows
        .iter()
        .find(|f| !listed.contains(&key(**f).to_string().as_str()))
        .expect("a flow the listing leaves out");
    // Found by its key, and by an alias (answering with the primary key).
    let alias = FlowKey::v4(pliant_net::proto::UDP, CLIENT, 1, SERVER, 2).0;
    p.e[0].ctx.flows.add_alias(&key(deep), alias).unwrap();
    for asked in [key(deep), alias] {
        let v = p.e[0].answer(Cmd::Flow { key: asked }, p.now);
        assert_eq!(v["found"], true, "{v}");
        assert_eq!(v["key"], key(deep).to_string(), "{v}");
        assert_eq!(v["aliases"], json!([alias.to_string()]), "{v}");
        assert_eq!(v["version"], 1, "{v}");
    }
    let v = p.e[1].answer(Cmd::Flow { key: key(deep) }, p.now);
    assert_eq!(v, json!({"ok": true, "found": false}));
    // What the answer names is what a migration needs: move it by that key.
    let keys = [key(deep), alias];
    p.migrate_in(1, &keys);
    let rx = p.migrate_out(0, 1, &keys);
    let v = p.run_until(&rx, 50);
    assert_eq!(
        (v["ok"].clone(), v["moved"].clone()),
        (json!(true), json!(1)),
        "{v}"
    );
    assert_eq!(p.state(1, deep), Some(expected(1)));
    assert_eq!(
        p.e[0].answer(Cmd::Flow { key: alias }, p.now)["found"],
        false
    );
    let v = p.e[1].answer(Cmd::Flow { key: alias }, p.now);
    assert_eq!(v["key"], key(deep).to_string(), "{v}");
}

#[test]
fn flows_move_over_real_peer_sockets() {
    let dir = std::env::temp_dir().join(format!("pliant-peer-{}-{}", std::process::id(), line!()));
    let pa = dir.join("a.peer.sock").to_str().unwrap().to_string();
    let pb = dir.join("b.peer.sock").to_str().unwrap().to_string();
    let t0 = Instant::now();
    let (mut a, _) = engine("a", t0, MAX_HELD_PACKETS);
    let (mut b, _) = engine("b", t0, MAX_HELD_PACKETS);
    let (_sa, la) =
        crate::peer::start(&pa, crate::peer::test_security("a")).expect("peer socket a");
    let (_sb, lb) =
        crate::peer::start(&pb, crate::peer::test_security("b")).expect("peer socket b");
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&pb).unwrap().permissions().mode() & 0o777,
        0o600
    );
    a.set_peer(la);
    b.set_peer(lb);
    let keys: Vec<FlowKey> = (100..110).map(key).collect();
    for s in 100..110 {
        a.port_mut(Side::Inside).inject(&frame(s, 0));
    }
    let clock = std::cell::Cell::new(t0);
    let step = |a: &mut Eng, b: &mut Eng| {
        let now = clock.get() + Duration::from_micros(10);
        clock.set(now);
        a.poll_once(now);
        b.poll_once(now);
        now
    };
    let now = step(&mut a, &mut b);
    assert_eq!(a.ctx.flows.len(), 10);
    let v = b.answer(
        Cmd::MigrateIn {
            from: "a".into(),
            keys: keys.clone(),
        },
        now,
    );
    assert_eq!(v["ok"], true);
    for s in 100..110 {
        b.port_mut(Side::Inside).inject(&frame(s, 1));
    }
    let (tx, rx) = mpsc::sync_channel(1);
    a.submit(
        Cmd::MigrateOut {
            to: pb.clone(),
            keys,
        },
        tx,
        now,
    );
    let mut reply = None;
    for _ in 0..5000 {
        step(&mut a, &mut b);
        if let Ok(v) = rx.try_recv() {
            reply = Some(v);
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let v = reply.expect("migration answered");
    assert_eq!(v["ok"], true, "{v}");
    assert_eq!(v["moved"], 10, "{v}");
    assert_eq!(v["imported"], 10, "{v}");
    assert_eq!(b.ctx.flows.len(), 10);
    for s in 100..110 {
        assert_eq!(b.ctx.flows.peek(&key(s)), Some(&expected(2)));
    }
    // A late packet at A goes to B over the socket.
    a.port_mut(Side::Inside).inject(&frame(100, 2));
    step(&mut a, &mut b);
    for _ in 0..5000 {
        if b.ctx.flows.peek(&key(100)) == Some(&expected(3)) {
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
        step(&mut a, &mut b);
    }
    assert_eq!(b.ctx.flows.peek(&key(100)), Some(&expected(3)));
    assert_eq!(a.migrate_stats().forwarded_late, 1);
    let _ = std::fs::remove_dir_all(dir);
}

/// `migrate_client::migrate` gives the destination and the steering a flow's aliases even when
/// the source's listing does not reach the flow (here it lists nothing at all): it asks `flow`.
#[test]
fn the_migration_client_finds_aliases_past_the_listing_bound() {
    let dir = std::env::temp_dir().join(format!("pliant-peer-{}-{}", std::process::id(), line!()));
    let path = |n: &str| dir.join(n).to_str().unwrap().to_string();
    let (ca, cb, pb) = (path("a.sock"), path("b.sock"), path("b.peer.sock"));
    let t0 = Instant::now();
    let (mut a, _) = engine("a", t0, MAX_HELD_PACKETS);
    let (mut b, _) = engine("b", t0, MAX_HELD_PACKETS);
    a.opts.max_listed_flows = 0;
    for s in 100..105 {
        a.port_mut(Side::Inside).inject(&frame(s, 0));
    }
    a.poll_once(t0);
    assert_eq!(a.ctx.flows.len(), 5);
    let alias = FlowKey::v4(pliant_net::proto::UDP, CLIENT, 1, SERVER, 2).0;
    a.ctx.flows.add_alias(&key(103), alias).unwrap();
    let (_sa, ha) = crate::control::start(&crate::control::ControlOptions {
        socket: ca.clone(),
        ..Default::default()
    })
    .expect("control a");
    let (_sb, hb) = crate::control::start(&crate::control::ControlOptions {
        socket: cb.clone(),
        ..Default::default()
    })
    .expect("control b");
    let (_pa, la) =
        crate::peer::start(&path("a.peer.sock"), crate::peer::test_security("a")).expect("peer a");
    let (_pb, lb) = crate::peer::start(&pb, crate::peer::test_security("b")).expect("peer b");
    a.set_control(ha);
    b.set_control(hb);
    a.set_peer(la);
    b.set_peer(lb);
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let run = |mut e: Eng| {
        let stop = stop.clone();
        std::thread::spawn(move || {
            e.run_paced(&stop, Duration::ZERO).expect("engine runs");
            e
        })
    };
    let (ta, tb) = (run(a), run(b));
    let mut steered = Vec::new();
    let (cla, clb) = (
        crate::control::client(&ca, None).unwrap(),
        crate::control::client(&cb, None).unwrap(),
    );
    let res =
        crate::migrate_client::migrate(&cla, &clb, &pb, &[key(103)], |all| steered = all.to_vec());
    stop.store(true, Ordering::SeqCst);
    let (a, b) = (ta.join().unwrap(), tb.join().unwrap());
    let _ = std::fs::remove_dir_all(&dir);
    let v = res.expect("migration");
    assert_eq!(v["moved"], 1, "{v}");
    assert_eq!(steered, vec![key(103), alias]);
    assert_eq!(b.ctx.flows.keys_of(&alias), Some(vec![key(103), alias]));
    assert!(!a.ctx.flows.contains(&key(103)));
}

/// `peer_connect` answers once the source's authenticated connection to the destination is
/// up (so a move after it runs no handshake inside its pause), at once when it already is,
/// and with the connect's error for a destination nobody serves.
#[test]
fn peer_connect_answers_once_the_connection_is_up_and_names_an_unreachable_destination() {
    let dir = std::env::temp_dir().join(format!("pliant-peer-{}-{}", std::process::id(), line!()));
    let path = |n: &str| dir.join(n).to_str().unwrap().to_string();
    let pb = path("b.peer.sock");
    let t0 = Instant::now();
    let (mut a, _) = engine("a", t0, MAX_HELD_PACKETS);
    let (mut b, _) = engine("b", t0, MAX_HELD_PACKETS);
    let (_sa, la) =
        crate::peer::start(&path("a.peer.sock"), crate::peer::test_security("a")).expect("peer a");
    let (_sb, lb) = crate::peer::start(&pb, crate::peer::test_security("b")).expect("peer b");
    a.set_peer(la);
    b.set_peer(lb);
    let clock = std::cell::Cell::new(t0);
    let ask = |a: &mut Eng, b: &mut Eng, to: &str| -> (Value, usize) {
        let (tx, rx) = mpsc::sync_channel(1);
        let now = clock.get();
        a.submit(Cmd::PeerConnect { to: to.into() }, tx, now);
        for rounds in 0..5000 {
            if let Ok(v) = rx.try_recv() {
                return (v, rounds);
            }
            let now = clock.get() + Duration::from_micros(10);
            clock.set(now);
            a.poll_once(now);
            b.poll_once(now);
            std::thread::sleep(Duration::from_millis(1));
        }
        panic!("peer_connect to {to} not answered");
    };
    let (v, _) = ask(&mut a, &mut b, &pb);
    assert_eq!(
        (v["ok"].clone(), v["reused"].clone()),
        (json!(true), json!(false)),
        "{v}"
    );
    assert_eq!(
        a.peer.as_ref().unwrap().connection(&pb),
        crate::peer::OutState::Up,
        "answered before the connection was up"
    );
    let (v, rounds) = ask(&mut a, &mut b, &pb);
    assert_eq!((v["reused"].clone(), rounds), (json!(true), 0), "{v}");
    let nobody = path("nobody.peer.sock");
    let (v, _) = ask(&mut a, &mut b, &nobody);
    assert_eq!(v["ok"], false, "{v}");
    assert!(
        v["error"].as_str().unwrap().contains("nobody.peer.sock"),
        "{v}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
