//! HA engine tests: in-memory ports and an in-memory replication link whose acks the test
//! delivers by hand, so every interleaving is deterministic (no timing thresholds).
//!
//! The test NF keeps a counter per flow; a packet whose payload starts with `m` modifies it
//! (`put_flow(.., true)`), `r` only reads it (`put_flow(.., false)`), `d` is written with
//! `pkt_write_direct`. Stateful output carries the flow's version after the packet in payload
//! bytes 1..9, so the test can check, independently of the gate, which state each packet
//! that left depended on.

use super::*;
use crate::config::Cidr;
use crate::ha::{LinkError, LinkFactory, LinkStatus, ReplLink};
use pliant_ha::policy::{BackupTarget, Policy};
use pliant_ha::standby::StandbyStore;
use pliant_ha::{Ack, Checkpoint, GroupId, UpdateBody};
use pliant_io::MemPort;
use pliant_net::build;
use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex};

const IN_MAC: [u8; 6] = [0x02, 0, 0, 0, 1, 1];
const OUT_MAC: [u8; 6] = [0x02, 0, 0, 0, 2, 1];
const CLIENT_MAC: [u8; 6] = [0x02, 0, 0, 0, 1, 2];
const SERVER_MAC: [u8; 6] = [0x02, 0, 0, 0, 2, 2];
const MS: Duration = Duration::from_millis(1);

#[derive(Default, Clone, serde::Serialize, serde::Deserialize)]
struct Count {
    n: u64,
}

/// `x`: deletes the flow, then writes the packet; `h`: pins the flow (a transaction left open
/// across rounds, as a buggy or slow NF would); `u`: unpins it (modified).
#[derive(Default)]
struct CounterNf {
    pinned: Option<pliant_state::FlowRef>,
}

impl NetworkFunction for CounterNf {
    type Flow = Count;
    const NAME: &'static str = "counter";

    fn process(&mut self, ctx: &mut crate::nf::Ctx<Count>, mut pkt: Packet) {
        let kind = pkt.payload().first().copied().unwrap_or(b'?');
        if kind == b'd' {
            return ctx.pkt_write_direct(pkt);
        }
        let key = pkt.key();
        match kind {
            b'x' => {
                let _ = ctx.flows.delete_flow(&key);
                return ctx.pkt_write(&key, pkt);
            }
            b'h' => {
                self.pinned = ctx.flows.get_flow(&key).ok();
                return ctx.pkt_drop(pkt, "pinned");
            }
            b'u' => {
                if let Some(r) = self.pinned.take() {
                    ctx.flows.state_mut(&r).n += 1;
                    ctx.flows.put_flow(r, true);
                }
                return ctx.pkt_drop(pkt, "unpinned");
            }
            _ => {}
        }
        if !ctx.flows.contains(&key) && ctx.flows.create_flow(key, Count::default()).is_err() {
            return ctx.pkt_drop(pkt, "create_failed");
        }
        let Ok(r) = ctx.flows.get_flow(&key) else {
            return ctx.pkt_drop(pkt, "busy");
        };
        let modify = kind == b'm';
        if modify {
            ctx.flows.state_mut(&r).n += 1;
        }
        ctx.flows.put_flow(r, modify);
        let v = ctx.flows.version(&key).unwrap_or(0);
        let off = usize::from(pkt.meta.payload_off);
        pkt.buf[off + 1..off + 9].copy_from_slice(&v.to_le_bytes());
        ctx.pkt_write(&key, pkt);
    }
}

/// The backup end of the in-memory link: what was sent, what was applied, the link state.
struct FakeBackup {
    primary: String,
    token: u64,
    unapplied: Vec<Checkpoint>,
    applied: Vec<Checkpoint>,
    pending_acks: Vec<Ack>,
    status: LinkStatus,
    queue_full: bool,
    store: Arc<Mutex<StandbyStore>>,
}

type Shared = Arc<Mutex<FakeBackup>>;

struct FakeLink(Shared);

impl ReplLink for FakeLink {
    fn send(&mut self, cp: Checkpoint) -> Result<(), LinkError> {
        let mut b = self.0.lock().unwrap();
        match b.status {
            LinkStatus::Dead { .. } => return Err(LinkError::Dead),
            _ if b.queue_full => return Err(LinkError::Full),
            _ => {}
        }
        b.unapplied.push(cp);
        Ok(())
    }

    fn poll(&mut self, acks: &mut Vec<Ack>) -> LinkStatus {
        let mut b = self.0.lock().unwrap();
        acks.append(&mut b.pending_acks);
        b.status.clone()
    }
}

#[derive(Default)]
struct FakeFactory {
    backups: Arc<Mutex<HashMap<String, Shared>>>,
    stores: HashMap<String, Arc<Mutex<StandbyStore>>>,
}

impl LinkFactory for FakeFactory {
    fn connect(&mut self, b: &BackupTarget, primary: &str, token: u64) -> Box<dyn ReplLink> {
        let store = self
            .stores
            .get(&b.socket)
            .cloned()
            .unwrap_or_else(|| Arc::new(Mutex::new(StandbyStore::new(1 << 16))));
        let shared = Arc::new(Mutex::new(FakeBackup {
            primary: primary.to_string(),
            token,
            unapplied: Vec::new(),
            applied: Vec::new(),
            pending_acks: Vec::new(),
            status: LinkStatus::Connecting,
            queue_full: false,
            store,
        }));
        self.backups
            .lock()
            .unwrap()
            .insert(b.socket.clone(), shared.clone());
        Box::new(FakeLink(shared))
    }
}

/// Test handle on the fake backups.
#[derive(Clone)]
struct Backups(Arc<Mutex<HashMap<String, Shared>>>);

impl Backups {
    fn get(&self, socket: &str) -> Shared {
        self.0.lock().unwrap()[socket].clone()
    }

    fn up(&self, socket: &str, session: u64, welcome: Vec<(GroupId, u64)>) {
        self.get(socket).lock().unwrap().status = LinkStatus::Up { session, welcome };
    }

    fn kill(&self, socket: &str) {
        self.get(socket).lock().unwrap().status = LinkStatus::Dead {
            reason: "test kill".into(),
        };
    }

    /// Applies every checkpoint sent so far to the backup's standby store and queues their
    /// acks; returns them.
    fn deliver(&self, socket: &str) -> Vec<Checkpoint> {
        let b = self.get(socket);
        let mut b = b.lock().unwrap();
        let cps = std::mem::take(&mut b.unapplied);
        for cp in &cps {
            let seq = b
                .store
                .lock()
                .unwrap()
                .apply(&b.primary, b.token, cp)
                .expect("the standby store accepts every checkpoint the engine sends");
            assert_eq!(seq, cp.seq);
            b.pending_acks.push(Ack {
                group: cp.group,
                seq: cp.seq,
            });
        }
        b.applied.extend(cps.iter().cloned());
        cps
    }

    fn unapplied(&self, socket: &str) -> usize {
        self.get(socket).lock().unwrap().unapplied.len()
    }
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn target(n: &str) -> BackupTarget {
    BackupTarget {
        name: n.into(),
        socket: format!("/fake/{n}"),
    }
}

type E = Engine<CounterNf, MemPort>;

fn engine_with(
    name: &str,
    stores: HashMap<String, Arc<Mutex<StandbyStore>>>,
    own_store: Option<Arc<Mutex<StandbyStore>>>,
) -> (E, Backups, Instant) {
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
    let mut e = Engine::new(
        name,
        CounterNf::default(),
        [MemPort::new(IN_MAC), MemPort::new(OUT_MAC)],
        nets,
        EngineOptions::default(),
        t0,
    );
    let factory = FakeFactory {
        stores,
        ..FakeFactory::default()
    };
    let backups = Backups(factory.backups.clone());
    e.set_ha_backend(HaBackend {
        factory: Box::new(factory),
        store: own_store,
        server_stats: None,
    });
    // Learn the server's MAC so output is not queued behind ARP.
    let req = arp::request(
        SERVER_MAC,
        Ipv4Addr::new(10, 0, 2, 2),
        Ipv4Addr::new(10, 0, 2, 1),
        None,
    );
    e.port_mut(Side::Outside).inject(&req);
    e.poll_once(t0);
    e.port_mut(Side::Outside).take_tx();
    (e, backups, t0)
}

fn engine() -> (E, Backups, Instant) {
    engine_with("p", HashMap::new(), None)
}

/// A client packet of flow `flow` (source port 1000 + flow) with `kind` m/r/d.
fn pkt(flow: u16, kind: u8) -> Vec<u8> {
    let mut payload = [0u8; 9];
    payload[0] = kind;
    build::udp(
        CLIENT_MAC,
        IN_MAC,
        ip("10.0.1.2"),
        1000 + flow,
        ip("10.0.2.2"),
        53,
        &payload,
    )
}

fn key_of(flow: u16) -> FlowKey {
    FlowKey::v4(
        17,
        Ipv4Addr::new(10, 0, 1, 2),
        1000 + flow,
        Ipv4Addr::new(10, 0, 2, 2),
        53,
    )
    .0
}

/// What left on the outside port: (flow, kind, version).
fn sent(e: &mut E) -> Vec<(u16, u8, u64)> {
    e.port_mut(Side::Outside)
        .take_tx()
        .into_iter()
        .map(|r| {
            let p = match pliant_net::parse(&r.frame) {
                Ok(Frame::Ip(p)) => p,
                other => panic!("not IP: {other:?}"),
            };
            let pl = &r.frame[usize::from(p.payload_off)..];
            let v = u64::from_le_bytes(pl[1..9].try_into().unwrap());
            (p.sport - 1000, pl[0], v)
        })
        .collect()
}

fn protect(e: &mut E, token: u64, policy: Policy, now: Instant) -> Value {
    e.answer(
        Cmd::Protect {
            token,
            policy: Box::new(policy),
        },
        now,
    )
}

fn single(hz: u32) -> Policy {
    Policy::Single {
        backup: target("b"),
        hz,
    }
}

fn status(e: &mut E, now: Instant) -> Value {
    e.answer(Cmd::HaStatus, now)
}

/// Deterministic so a failure reproduces.
use pliant_testkit::XorShift as Rng;

/// Output-commit audit (invariant 3), checked twice and independently: the test's own model
/// finds, per stateful packet that left, the first acked checkpoint carrying its flow at the
/// packet's version or later (from what the fake backup applied); the product's audit must
/// agree packet for packet. Without the fault no packet leaves early and both see 0; with the
/// test-only early-release fault on, packets leave before their checkpoint is acked and the
/// audit must count exactly the ones the model finds (an audit that restates the gate's
/// decision would see 0 here).
#[test]
fn output_commit_audit_no_packet_leaves_before_its_checkpoint_is_acked() {
    for (seed, fault) in [
        (7u64, false),
        (99, false),
        (12345, false),
        (7, true),
        (99, true),
    ] {
        let (mut e, backups, t0) = engine();
        let mut r = Rng(seed);
        let ans = protect(&mut e, 1, single(1000), t0);
        assert_eq!(ans["ok"], true, "{ans}");
        e.ha_fault_release_early(fault);
        backups.up("/fake/b", 1, vec![]);
        // (group, seq) -> round acked; (flow key, version) carried -> first (group, seq).
        let mut acked_round: HashMap<(GroupId, u64), u64> = HashMap::new();
        let mut carried: Vec<((GroupId, u64), FlowKey, u64)> = Vec::new();
        let (mut written, mut left_stateful, mut deltas) = (0u64, 0u64, 0u64);
        let mut early = 0u64;
        for round in 1..=400u64 {
            let now = t0 + MS * round as u32;
            if r.below(3) == 0 {
                for cp in backups.deliver("/fake/b") {
                    acked_round.insert((cp.group, cp.seq), round);
                    for f in &cp.flows {
                        if matches!(f.body, UpdateBody::Delta { .. }) {
                            deltas += 1;
                        }
                        carried.push(((cp.group, cp.seq), f.key, f.version));
                    }
                }
            }
            for _ in 0..r.below(4) {
                let flow = r.below(6) as u16;
                let kind = [b'm', b'r', b'r', b'd'][r.below(4) as usize];
                if kind != b'd' {
                    written += 1;
                }
                e.port_mut(Side::Inside).inject(&pkt(flow, kind));
            }
            e.poll_once(now);
            let out = sent(&mut e);
            // A packet depends on its flow's state after the whole batch that wrote it (the
            // output rule is decided then): the highest version of its flow leaving in this
            // round (with the fault on, everything leaves in the round that wrote it).
            let mut batch_v: HashMap<u16, u64> = HashMap::new();
            for &(flow, _, v) in &out {
                let m = batch_v.entry(flow).or_insert(v);
                *m = (*m).max(v);
            }
            for (flow, kind, _) in out {
                if kind == b'd' {
                    continue;
                }
                left_stateful += 1;
                let k = key_of(flow);
                let v = batch_v[&flow];
                // The checkpoint this packet depended on: the earliest acked one that carried
                // the flow at this version or later.
                let dep = carried
                    .iter()
                    .filter(|(_, ck, cv)| *ck == k && *cv >= v)
                    .filter_map(|(gs, _, _)| acked_round.get(gs).copied())
                    .min();
                if dep.is_none_or(|ack_round| ack_round > round) {
                    assert!(
                        fault,
                        "seed {seed}: flow {flow} v{v} left in round {round}; acked in {dep:?}"
                    );
                    early += 1;
                }
            }
        }
        // Drain: everything written eventually leaves.
        for round in 401..=410u64 {
            backups.deliver("/fake/b");
            e.poll_once(t0 + MS * round as u32);
            left_stateful += sent(&mut e).iter().filter(|s| s.1 != b'd').count() as u64;
        }
        assert_eq!(
            left_stateful, written,
            "seed {seed}: every stateful packet left"
        );
        let st = status(&mut e, t0 + MS * 411);
        let out = &st["output"];
        assert_eq!(
            out["audit_checked"].as_u64(),
            Some(left_stateful),
            "seed {seed}: every stateful packet was audited on its way out: {st}"
        );
        assert_eq!(
            out["audit_violations"].as_u64(),
            Some(early),
            "seed {seed} fault {fault}: the audit agrees with the model: {st}"
        );
        assert_eq!(
            e.ha_audit_violations(usize::MAX).len() as u64,
            early.min(pliant_ha::audit::MAX_VIOLATION_RECORDS as u64)
        );
        if fault {
            assert!(early > 10, "seed {seed}: the fault released early: {early}");
        } else {
            assert!(out["bypassed_clean"].as_u64().unwrap() > 0, "{st}");
            assert!(
                deltas > 0,
                "deltas were shipped after the first full checkpoint"
            );
            let g = &st["groups"][0];
            assert!(
                g["bytes_shipped"].as_u64() < g["bytes_full_equiv"].as_u64(),
                "{g}"
            );
        }
        assert!(
            out["audit_exempt"].as_u64().unwrap() > 0,
            "direct output: {st}"
        );
    }
}

/// Remus mode: every packet, direct output included, waits for an epoch taken after it was
/// written; with the early-release fault the audit counts each packet that left before.
#[test]
fn remus_audit_counts_output_released_before_its_epoch() {
    let (mut e, backups, t0) = engine();
    let remus = Policy::Remus {
        backup: target("b"),
        hz: 100,
    };
    assert_eq!(protect(&mut e, 1, remus, t0)["ok"], true);
    backups.up("/fake/b", 1, vec![]);
    e.ha_fault_release_early(true);
    e.port_mut(Side::Inside).inject(&pkt(1, b'm'));
    e.port_mut(Side::Inside).inject(&pkt(2, b'd'));
    e.poll_once(t0 + MS);
    assert_eq!(sent(&mut e).len(), 2, "the fault let both out at once");
    let st = status(&mut e, t0 + MS * 2);
    assert_eq!(st["output"]["audit_violations"], 2, "{st}");
    // Fault off: output waits for the epoch again, and the audit sees no new violation.
    e.ha_fault_release_early(false);
    e.port_mut(Side::Inside).inject(&pkt(1, b'r'));
    e.poll_once(t0 + MS * 3);
    assert!(sent(&mut e).is_empty());
    for round in 4..=30u32 {
        backups.deliver("/fake/b");
        e.poll_once(t0 + MS * round);
        if !sent(&mut e).is_empty() {
            break;
        }
    }
    let st = status(&mut e, t0 + MS * 31);
    assert_eq!(st["output"]["audit_checked"], 3, "{st}");
    assert_eq!(st["output"]["audit_violations"], 2, "{st}");
}

#[test]
fn blocked_acks_stall_dependent_output_but_not_direct_output() {
    let (mut e, backups, t0) = engine();
    protect(&mut e, 1, single(1000), t0);
    backups.up("/fake/b", 1, vec![]);
    e.port_mut(Side::Inside).inject(&pkt(1, b'm'));
    e.port_mut(Side::Inside).inject(&pkt(2, b'd'));
    for round in 1..=50u32 {
        e.poll_once(t0 + MS * round);
        let out = sent(&mut e);
        match round {
            1 => assert_eq!(out, [(2, b'd', 0)], "direct output leaves at once"),
            // Direct output keeps flowing while acks are blocked.
            11 => assert_eq!(out, [(3, b'd', 0)]),
            _ => assert!(out.is_empty(), "round {round}: {out:?}"),
        }
        if round == 10 {
            e.port_mut(Side::Inside).inject(&pkt(3, b'd'));
        }
    }
    let st = status(&mut e, t0 + MS * 51);
    assert_eq!(st["groups"][0]["held_packets"], 1, "{st}");
    assert_eq!(st["output"]["direct"], 2, "{st}");
    assert!(
        backups.unapplied("/fake/b") >= 1,
        "the checkpoint was shipped"
    );
    backups.deliver("/fake/b");
    e.poll_once(t0 + MS * 52);
    assert_eq!(sent(&mut e), [(1, b'm', 1)], "released by the ack");
    let st = status(&mut e, t0 + MS * 53);
    assert_eq!(st["output"]["released"], 1, "{st}");
    let m = e.metrics(t0 + MS * 53);
    assert!(
        m.contains("pliant_ha_released_total{replica=\"p\"} 1"),
        "{m}"
    );
    assert!(m.contains("pliant_ha_direct_total{replica=\"p\"} 2"), "{m}");
    assert_eq!(st["output"]["held_now"], 0, "{st}");
}

#[test]
fn clean_flows_bypass_once_acked_and_wait_for_an_unacked_ship() {
    let (mut e, backups, t0) = engine();
    protect(&mut e, 1, single(1000), t0);
    backups.up("/fake/b", 1, vec![]);
    // Set-up: modifies the flow (NAT creating its mapping).
    e.port_mut(Side::Inside).inject(&pkt(1, b'm'));
    e.poll_once(t0 + MS);
    assert!(sent(&mut e).is_empty());
    // Shipped in round 1 but not acked: a read-only packet waits for that checkpoint.
    e.port_mut(Side::Inside).inject(&pkt(1, b'r'));
    e.poll_once(t0 + MS * 2);
    assert!(sent(&mut e).is_empty(), "clean but unacked state: waits");
    backups.deliver("/fake/b");
    e.poll_once(t0 + MS * 3);
    assert_eq!(sent(&mut e), [(1, b'm', 1), (1, b'r', 1)], "in write order");
    // Acked and not modified: leaves in the round it was processed, no checkpoint needed.
    for round in 4..=8u32 {
        e.port_mut(Side::Inside).inject(&pkt(1, b'r'));
        e.poll_once(t0 + MS * round);
        assert_eq!(sent(&mut e), [(1, b'r', 1)], "round {round}");
    }
    let st = status(&mut e, t0 + MS * 9);
    assert_eq!(st["output"]["bypassed_clean"], 5, "{st}");
    assert_eq!(
        st["groups"][0]["checkpoints"], 1,
        "unmodified flows are not shipped again: {st}"
    );
    // A modification waits again.
    e.port_mut(Side::Inside).inject(&pkt(1, b'm'));
    e.poll_once(t0 + MS * 10);
    assert!(sent(&mut e).is_empty());
}

#[test]
fn remus_mode_holds_all_output_until_the_epoch_is_acked() {
    let (mut e, backups, t0) = engine();
    let ans = protect(
        &mut e,
        1,
        Policy::Remus {
            backup: target("b"),
            hz: 100,
        },
        t0,
    );
    assert_eq!(ans["ok"], true, "{ans}");
    backups.up("/fake/b", 1, vec![]);
    e.port_mut(Side::Inside).inject(&pkt(1, b'm'));
    e.port_mut(Side::Inside).inject(&pkt(2, b'd'));
    e.port_mut(Side::Inside).inject(&pkt(3, b'r'));
    for round in 1..=30u32 {
        e.poll_once(t0 + MS * round);
        assert!(
            sent(&mut e).is_empty(),
            "round {round}: Remus holds direct output too"
        );
    }
    let cps = backups.deliver("/fake/b");
    assert!(cps.len() >= 2, "one epoch per 10 ms: {}", cps.len());
    for cp in &cps {
        assert!(cp.full, "Remus epochs are full copies");
        assert!(cp.shared.is_some(), "with the shared store");
        assert_eq!(cp.flows.len(), 2, "every flow, modified or not");
    }
    e.poll_once(t0 + MS * 31);
    let mut out = sent(&mut e);
    out.sort();
    assert_eq!(out, [(1, b'm', 1), (2, b'd', 0), (3, b'r', 0)]);
    let st = status(&mut e, t0 + MS * 32);
    assert_eq!(st["mode"], "remus");
    assert_eq!(st["output"]["released"], 3, "{st}");
    assert_eq!(st["output"]["audit_violations"], 0, "{st}");
}

#[test]
fn link_death_releases_held_output_and_asks_for_a_backup() {
    let (mut e, backups, t0) = engine();
    protect(&mut e, 1, single(1000), t0);
    backups.up("/fake/b", 1, vec![]);
    e.port_mut(Side::Inside).inject(&pkt(1, b'm'));
    e.port_mut(Side::Inside).inject(&pkt(2, b'm'));
    e.poll_once(t0 + MS);
    e.poll_once(t0 + MS * 2);
    assert!(sent(&mut e).is_empty());
    backups.kill("/fake/b");
    e.poll_once(t0 + MS * 3);
    assert_eq!(
        sent(&mut e).len(),
        2,
        "held output released when the backup died"
    );
    let st = status(&mut e, t0 + MS * 4);
    let g = &st["groups"][0];
    assert_eq!(g["state"], "unprotected", "{st}");
    assert_eq!(g["needs_backup"], true, "{st}");
    assert_eq!(st["needs_backup"], true, "{st}");
    assert_eq!(
        st["output"]["audit_violations"], 0,
        "exempt by design: {st}"
    );
    // Unprotected from now on: output leaves at once.
    e.port_mut(Side::Inside).inject(&pkt(1, b'm'));
    e.poll_once(t0 + MS * 5);
    assert_eq!(sent(&mut e), [(1, b'm', 2)]);
    // Re-protection to a new backup: a full checkpoint of every flow. The flows ran
    // unprotected a moment ago; they keep leaving at once while they sync into the new group
    // (holding them for the first copy would stall them for a failure elsewhere) ...
    let ans = protect(
        &mut e,
        2,
        Policy::Single {
            backup: target("c"),
            hz: 1000,
        },
        t0 + MS * 6,
    );
    assert_eq!(ans["ok"], true, "{ans}");
    backups.up("/fake/c", 1, vec![]);
    e.port_mut(Side::Inside).inject(&pkt(2, b'r'));
    e.poll_once(t0 + MS * 7);
    assert_eq!(sent(&mut e), [(2, b'r', 1)], "syncing: leaves at once");
    e.port_mut(Side::Inside).inject(&pkt(1, b'm'));
    e.poll_once(t0 + MS * 8);
    assert_eq!(
        sent(&mut e),
        [(1, b'm', 3)],
        "shipped, not acked yet: still syncing"
    );
    let cps = backups.deliver("/fake/c");
    assert!(cps[0].full && cps[0].flows.len() == 2, "{cps:?}");
    // ... and output commit applies again from the new backup's ack on.
    e.poll_once(t0 + MS * 9);
    e.port_mut(Side::Inside).inject(&pkt(1, b'm'));
    e.poll_once(t0 + MS * 10);
    assert!(
        sent(&mut e).is_empty(),
        "synced: a change waits for its checkpoint"
    );
    backups.deliver("/fake/c");
    e.poll_once(t0 + MS * 11);
    e.poll_once(t0 + MS * 12);
    assert_eq!(sent(&mut e), [(1, b'm', 4)]);
    let st = status(&mut e, t0 + MS * 13);
    assert_eq!(st["needs_backup"], false, "{st}");
    assert_eq!(st["output"]["syncing"], 2, "{st}");
    assert_eq!(st["output"]["audit_violations"], 0, "{st}");
    assert!(st["output"]["audit_checked"].as_u64() >= Some(1), "{st}");
}

/// A flow that moves to a new group while its old backup is alive stays protected: it does
/// not sync unprotected (only flows of a dead backup's group do).
#[test]
fn a_flow_moved_from_a_live_backup_does_not_sync_unprotected() {
    let (mut e, backups, t0) = engine();
    protect(&mut e, 1, single(1000), t0);
    backups.up("/fake/b", 1, vec![]);
    e.port_mut(Side::Inside).inject(&pkt(1, b'm'));
    e.poll_once(t0 + MS);
    backups.deliver("/fake/b");
    e.poll_once(t0 + MS * 2);
    e.poll_once(t0 + MS * 3);
    assert_eq!(sent(&mut e), [(1, b'm', 1)]);
    protect(
        &mut e,
        2,
        Policy::Single {
            backup: target("c"),
            hz: 1000,
        },
        t0 + MS * 4,
    );
    backups.up("/fake/c", 1, vec![]);
    e.port_mut(Side::Inside).inject(&pkt(1, b'r'));
    e.poll_once(t0 + MS * 5);
    assert!(sent(&mut e).is_empty(), "waits for the new group's copy");
    backups.deliver("/fake/c");
    e.poll_once(t0 + MS * 6);
    assert_eq!(sent(&mut e), [(1, b'r', 1)]);
    let st = status(&mut e, t0 + MS * 7);
    assert_eq!(st["output"]["syncing"], 0, "{st}");
}

#[test]
fn reconnect_whose_welcome_holds_our_last_checkpoint_acks_it_and_keeps_deltas() {
    let (mut e, backups, t0) = engine();
    protect(&mut e, 1, single(1000), t0);
    backups.up("/fake/b", 1, vec![]);
    e.port_mut(Side::Inside).inject(&pkt(1, b'm'));
    e.poll_once(t0 + MS);
    backups.deliver("/fake/b");
    // The ack is lost with the connection; the new session's Welcome shows seq 1 applied.
    backups.get("/fake/b").lock().unwrap().pending_acks.clear();
    backups.up("/fake/b", 2, vec![(1, 1)]);
    e.poll_once(t0 + MS * 2);
    assert_eq!(sent(&mut e), [(1, b'm', 1)], "released by the Welcome");
    e.port_mut(Side::Inside).inject(&pkt(1, b'm'));
    e.poll_once(t0 + MS * 3);
    let cps = backups.deliver("/fake/b");
    assert!(
        !cps[0].full,
        "the backup holds our last checkpoint: no resync"
    );
    assert!(matches!(cps[0].flows[0].body, UpdateBody::Delta { .. }));
}

#[test]
fn reconnect_without_our_last_checkpoint_resyncs_in_full() {
    let (mut e, backups, t0) = engine();
    protect(&mut e, 1, single(1000), t0);
    backups.up("/fake/b", 1, vec![]);
    e.port_mut(Side::Inside).inject(&pkt(1, b'm'));
    e.poll_once(t0 + MS);
    backups.deliver("/fake/b");
    e.poll_once(t0 + MS * 2);
    assert_eq!(sent(&mut e).len(), 1);
    e.port_mut(Side::Inside).inject(&pkt(1, b'm'));
    e.poll_once(t0 + MS * 3); // seq 2 shipped as a delta, never delivered: lost
    backups.get("/fake/b").lock().unwrap().unapplied.clear();
    backups.up("/fake/b", 2, vec![(1, 1)]); // new session; the backup holds seq 1 only
    e.poll_once(t0 + MS * 4);
    let cps = backups.deliver("/fake/b");
    assert_eq!(cps.len(), 1);
    assert!(
        cps[0].full,
        "resync in full after the backup lost a checkpoint"
    );
    assert!(matches!(cps[0].flows[0].body, UpdateBody::Full(_)));
    e.poll_once(t0 + MS * 5);
    assert_eq!(sent(&mut e), [(1, b'm', 2)], "released by the resync's ack");
}

#[test]
fn activation_makes_get_flow_return_the_standby_state_and_fences() {
    let store = Arc::new(Mutex::new(StandbyStore::new(1 << 16)));
    let mut stores = HashMap::new();
    stores.insert("/fake/b".to_string(), store.clone());
    let (mut p, backups, t0) = engine_with("p", stores, None);
    let (mut b, _, _) = engine_with("b", HashMap::new(), Some(store.clone()));
    protect(&mut p, 3, single(1000), t0);
    backups.up("/fake/b", 1, vec![]);
    for (flow, n) in [(1u16, 3u64), (2, 1)] {
        for _ in 0..n {
            p.port_mut(Side::Inside).inject(&pkt(flow, b'm'));
        }
    }
    p.poll_once(t0 + MS);
    p.port_mut(Side::Inside).inject(&pkt(1, b'm')); // 4th change of flow 1, shipped as a delta
    p.poll_once(t0 + MS * 2);
    backups.deliver("/fake/b");
    // Never handed to the NF before activation.
    assert!(!b.ctx.flows.contains(&key_of(1)));
    let st = status(&mut b, t0);
    assert_eq!(st["standby"][0]["primary"], "p", "{st}");
    assert_eq!(st["standby"][0]["flows"], 2, "{st}");
    let ans = b.answer(
        Cmd::Activate {
            primary: "p".into(),
            token: 4,
        },
        t0 + MS * 3,
    );
    assert_eq!(ans["ok"], true, "{ans}");
    assert_eq!(ans["activated"], 2, "{ans}");
    assert_eq!(ans["failed"], 0, "{ans}");
    let keys: Vec<&str> = ans["flows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["key"].as_str().unwrap())
        .collect();
    assert!(keys.contains(&key_of(1).to_string().as_str()), "{ans}");
    let r = b
        .ctx
        .flows
        .get_flow(&key_of(1))
        .expect("live after activation");
    assert_eq!(b.ctx.flows.state(&r).n, 4);
    b.ctx.flows.put_flow(r, false);
    assert_eq!(b.ctx.flows.version(&key_of(2)), Some(1));
    assert_eq!(b.ha_token(), 4);
    // Fencing: the old primary's checkpoints under its older token are refused now.
    p.port_mut(Side::Inside).inject(&pkt(2, b'm'));
    p.poll_once(t0 + MS * 3);
    let cp = backups
        .get("/fake/b")
        .lock()
        .unwrap()
        .unapplied
        .pop()
        .unwrap();
    assert!(store.lock().unwrap().apply("p", 3, &cp).is_err(), "fenced");
    // Stale tokens are refused by protect; the token stays.
    let ans = protect(&mut b, 3, single(1000), t0);
    assert_eq!(ans["ok"], false, "{ans}");
    assert!(
        ans["error"].as_str().unwrap().contains("stale token"),
        "{ans}"
    );
    assert_eq!(b.ha_token(), 4);
    let ans = protect(&mut b, 4, Policy::Off, t0);
    assert_eq!(ans["ok"], true, "{ans}");
    // drop_standby forgets what is held for a primary.
    let ans = b.answer(
        Cmd::DropStandby {
            primary: "p".into(),
        },
        t0,
    );
    assert_eq!(ans["ok"], true, "{ans}");
}

#[test]
fn no_backend_or_bad_policy_is_refused_and_off_releases() {
    let (mut e, backups, t0) = engine();
    let bad = Policy::Single {
        backup: target("b"),
        hz: 0,
    };
    assert_eq!(protect(&mut e, 1, bad, t0)["ok"], false);
    protect(&mut e, 1, single(1000), t0);
    backups.up("/fake/b", 1, vec![]);
    e.port_mut(Side::Inside).inject(&pkt(1, b'm'));
    e.poll_once(t0 + MS);
    assert!(sent(&mut e).is_empty());
    assert_eq!(protect(&mut e, 1, Policy::Off, t0 + MS * 2)["ok"], true);
    e.poll_once(t0 + MS * 3);
    assert_eq!(sent(&mut e).len(), 1, "policy off: held output released");
    let st = status(&mut e, t0 + MS * 4);
    assert_eq!(st["mode"], "off");
    assert_eq!(st["output"]["released_unprotected"], 1, "{st}");
    // A replica without [ha] refuses protect.
    let (mut plain, _) = {
        let (e2, _, t) = engine();
        (e2, t)
    };
    plain.ha_side.backend = None;
    let ans = protect(&mut plain, 1, single(1000), t0);
    assert!(ans["error"].as_str().unwrap().contains("[ha]"), "{ans}");
}

#[test]
fn send_queue_full_keeps_state_dirty_and_retries() {
    let (mut e, backups, t0) = engine();
    protect(&mut e, 1, single(1000), t0);
    backups.up("/fake/b", 1, vec![]);
    backups.get("/fake/b").lock().unwrap().queue_full = true;
    e.port_mut(Side::Inside).inject(&pkt(1, b'm'));
    for round in 1..=5u32 {
        e.poll_once(t0 + MS * round);
    }
    assert_eq!(backups.unapplied("/fake/b"), 0);
    backups.get("/fake/b").lock().unwrap().queue_full = false;
    e.poll_once(t0 + MS * 6);
    let cps = backups.deliver("/fake/b");
    assert_eq!(cps.len(), 1);
    assert_eq!(cps[0].seq, 1, "no seq consumed by the refused sends");
    e.poll_once(t0 + MS * 7);
    assert_eq!(sent(&mut e), [(1, b'm', 1)]);
}

/// Removes the test's directory on drop (also when the test fails).
struct TempDir(std::path::PathBuf);
impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Polls `e` in real time until `done` holds (a liveness bound, not a timing assertion).
fn run_until(e: &mut E, mut done: impl FnMut(&mut E) -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        e.poll_once(Instant::now());
        if done(e) {
            return true;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    false
}

/// The engine over the real authenticated transport (unix socket in a private temp dir):
/// output is released by the backup's ack, and the backup's death turns the group unprotected.
#[test]
fn real_transport_releases_on_ack_and_survives_backup_death() {
    use std::os::unix::fs::PermissionsExt;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let dir = TempDir(
        std::env::temp_dir().join(format!("pliant-ha-engine-{}-{nanos}", std::process::id())),
    );
    std::fs::create_dir_all(&dir.0).unwrap();
    std::fs::set_permissions(&dir.0, std::fs::Permissions::from_mode(0o700)).unwrap();
    let ca = pliant_wire::Ca::generate(None).unwrap();
    let id = |n: &str| {
        pliant_wire::Security::new(ca.issue(n, pliant_wire::role::REPLICA, 3600).unwrap())
    };
    let sock = dir.0.join("b.repl.sock");
    let store = Arc::new(Mutex::new(StandbyStore::new(1 << 16)));
    let server = pliant_ha::transport::ReplServer::start(
        &pliant_wire::Endpoint::Unix(sock.clone()),
        id("b"),
        store.clone(),
    )
    .unwrap();
    let (mut e, _, t0) = engine();
    e.ha_side.backend = Some(HaBackend {
        factory: Box::new(crate::ha::SenderFactory {
            // The engine of these tests is replica "p": its checkpoints go out as "p".
            sec: id("p"),
            opts: Some(pliant_ha::transport::SenderOptions::default()),
        }),
        store: None,
        server_stats: None,
    });
    let backup = BackupTarget {
        name: "b".into(),
        socket: sock.to_str().unwrap().into(),
    };
    let ans = protect(&mut e, 1, Policy::Single { backup, hz: 1000 }, t0);
    assert_eq!(ans["ok"], true, "{ans}");
    e.port_mut(Side::Inside).inject(&pkt(1, b'm'));
    let mut out = Vec::new();
    assert!(
        run_until(&mut e, |e| {
            out.extend(sent(e));
            !out.is_empty()
        }),
        "the held packet was released by the backup's ack"
    );
    assert_eq!(out, [(1, b'm', 1)]);
    assert_eq!(store.lock().unwrap().stats().flows, 1);
    let st = status(&mut e, Instant::now());
    assert!(st["groups"][0]["acked_seq"].as_u64().unwrap() >= 1, "{st}");
    assert_eq!(st["output"]["audit_violations"], 0, "{st}");
    // The backup dies: the link goes dead, the group runs unprotected and asks for a backup.
    drop(server);
    assert!(
        run_until(&mut e, |e| status(e, Instant::now())["needs_backup"]
            == true),
        "backup death detected"
    );
    e.port_mut(Side::Inside).inject(&pkt(1, b'm'));
    e.poll_once(Instant::now());
    assert_eq!(sent(&mut e), [(1, b'm', 2)], "unprotected: leaves at once");
}

/// Per-packet cost of Pico at 1 kHz relative to no HA, on the same engine and traffic
/// (1000 flows, mostly read-only packets as a NAT after set-up, 1 in 16 modifying). Prints a
/// ratio; run with `cargo test --release -p pliant-runtime -- --ignored ha_cost --nocapture`.
#[test]
#[ignore]
fn ha_cost_ratio_at_1khz() {
    let frames: Vec<Vec<u8>> = (0..4096u32)
        .map(|i| pkt((i % 1000) as u16, if i % 16 == 0 { b'm' } else { b'r' }))
        .collect();
    let run = |ha: bool| -> (Duration, u64) {
        let (mut e, backups, t0) = engine();
        if ha {
            protect(&mut e, 1, single(1000), t0);
            backups.up("/fake/b", 1, vec![]);
        }
        let mut now = t0;
        let mut out = 0u64;
        let mut backup_time = Duration::ZERO;
        let start = Instant::now();
        for round in 0..3000u32 {
            // 64 packets per round, 1000 rounds per simulated second: 64 kpps.
            for j in 0..64usize {
                let f = &frames[(round as usize * 64 + j) % frames.len()];
                e.port_mut(Side::Inside).inject(f);
            }
            now += MS;
            if ha {
                // The backup's work (applying checkpoints) is not the primary's cost.
                let b = Instant::now();
                backups.deliver("/fake/b");
                backup_time += b.elapsed();
            }
            e.poll_once(now);
            out += e.port_mut(Side::Outside).take_tx().len() as u64;
        }
        (start.elapsed() - backup_time, out)
    };
    let _ = run(false); // warm-up
                        // Alternating runs, the best of each: the machine is shared, the minimum is the least
                        // disturbed measurement.
    let (mut base, mut pico) = (Duration::MAX, Duration::MAX);
    let (mut n0, mut n1) = (0, 0);
    for _ in 0..5 {
        let (b, n) = run(false);
        base = base.min(b);
        n0 = n;
        let (p, n) = run(true);
        pico = pico.min(p);
        n1 = n;
    }
    assert!(n0 > 0 && n1 > 0);
    let per = |d: Duration, n: u64| d.as_nanos() as f64 / n as f64;
    println!(
        "ha_cost: no-HA {:.0} ns/frame, Pico@1kHz {:.0} ns/frame, ratio {:.3}",
        per(base, n0),
        per(pico, n1),
        pico.as_secs_f64() / base.as_secs_f64()
    );
}

/// Invariant 7 on the replica: a backup that activated our flows under a newer token refuses
/// us as fenced; the stale owner then emits nothing for those flows, held output included.
#[test]
fn a_fenced_primary_drops_held_and_later_output_instead_of_releasing_it() {
    let (mut e, backups, t0) = engine();
    protect(&mut e, 1, single(1000), t0);
    backups.up("/fake/b", 1, vec![]);
    e.port_mut(Side::Inside).inject(&pkt(1, b'm'));
    e.poll_once(t0 + MS);
    assert!(sent(&mut e).is_empty());
    backups.get("/fake/b").lock().unwrap().status = LinkStatus::Dead {
        reason:
            "backup refused: primary p token 1 is fenced: its flows were activated under token 2"
                .into(),
    };
    e.poll_once(t0 + MS * 2);
    assert!(
        sent(&mut e).is_empty(),
        "held output of a fenced owner never leaves"
    );
    e.port_mut(Side::Inside).inject(&pkt(1, b'r'));
    e.port_mut(Side::Inside).inject(&pkt(2, b'm'));
    e.poll_once(t0 + MS * 3);
    assert!(
        sent(&mut e).is_empty(),
        "nor does later output of its flows"
    );
    let st = status(&mut e, t0 + MS * 4);
    assert_eq!(st["fenced"], true, "{st}");
    assert_eq!(st["needs_backup"], false, "{st}");
    assert_eq!(st["groups"][0]["state"], "fenced", "{st}");
    assert_eq!(st["output"]["dropped_fenced"], 3, "{st}");
    assert_eq!(e.ctx.drops().get("ha_fenced"), 3);
}

#[test]
fn deleted_flows_ship_deleted_and_their_last_output_waits_for_it() {
    let (mut e, backups, t0) = engine();
    protect(&mut e, 1, single(1000), t0);
    backups.up("/fake/b", 1, vec![]);
    e.port_mut(Side::Inside).inject(&pkt(1, b'm'));
    e.poll_once(t0 + MS);
    backups.deliver("/fake/b");
    e.poll_once(t0 + MS * 2);
    assert_eq!(sent(&mut e).len(), 1);
    e.port_mut(Side::Inside).inject(&pkt(1, b'x'));
    e.poll_once(t0 + MS * 3);
    assert!(
        sent(&mut e).is_empty(),
        "output after the deletion waits for it to be shipped"
    );
    let cps = backups.deliver("/fake/b");
    assert_eq!(cps.len(), 1);
    assert_eq!(cps[0].flows.len(), 1);
    assert_eq!(cps[0].flows[0].body, UpdateBody::Deleted);
    e.poll_once(t0 + MS * 4);
    assert_eq!(sent(&mut e).len(), 1);
    let st = status(&mut e, t0 + MS * 5);
    assert_eq!(st["groups"][0]["flows"], 0, "membership forgotten: {st}");
}

/// Invariant 2: a flow pinned by an open transaction is not copied; its output keeps waiting
/// past the ack of the checkpoint it missed, and leaves once a later one carries it.
#[test]
fn a_busy_flow_is_not_copied_and_its_output_waits_for_the_next_checkpoint() {
    let (mut e, backups, t0) = engine();
    protect(&mut e, 1, single(1000), t0);
    backups.up("/fake/b", 1, vec![]);
    e.port_mut(Side::Inside).inject(&pkt(2, b'm')); // another flow, so the epoch ships
    e.port_mut(Side::Inside).inject(&pkt(1, b'm'));
    e.port_mut(Side::Inside).inject(&pkt(1, b'h'));
    e.poll_once(t0 + MS);
    let cps = backups.deliver("/fake/b");
    assert_eq!(cps.len(), 1);
    let keys: Vec<FlowKey> = cps[0].flows.iter().map(|f| f.key).collect();
    assert_eq!(keys, [key_of(2)], "the pinned flow was not copied");
    e.poll_once(t0 + MS * 2);
    assert_eq!(
        sent(&mut e),
        [(2, b'm', 1)],
        "flow 1's output waits past that ack"
    );
    let st = status(&mut e, t0 + MS * 3);
    assert!(
        st["groups"][0]["busy_retries"].as_u64().unwrap() >= 1,
        "{st}"
    );
    e.port_mut(Side::Inside).inject(&pkt(1, b'u'));
    e.poll_once(t0 + MS * 4);
    let cps = backups.deliver("/fake/b");
    let f1: Vec<_> = cps
        .iter()
        .flat_map(|c| c.flows.iter())
        .filter(|f| f.key == key_of(1))
        .collect();
    assert!(!f1.is_empty() && f1.last().unwrap().version == 2, "{cps:?}");
    e.poll_once(t0 + MS * 5);
    assert_eq!(sent(&mut e), [(1, b'm', 1)]);
}

/// Flows a backup's standby store holds (all primaries).
fn standby_flows(backups: &Backups, socket: &str) -> usize {
    let b = backups.get(socket);
    let b = b.lock().unwrap();
    let st = b.store.lock().unwrap().stats();
    st.flows
}

#[test]
fn a_flow_moved_to_another_group_leaves_its_old_backup_only_after_the_new_one_acked() {
    let (mut e, backups, t0) = engine();
    protect(&mut e, 1, single(1000), t0);
    backups.up("/fake/b", 1, vec![]);
    e.port_mut(Side::Inside).inject(&pkt(1, b'm'));
    e.port_mut(Side::Inside).inject(&pkt(2, b'm'));
    e.poll_once(t0 + MS);
    backups.deliver("/fake/b");
    e.poll_once(t0 + MS * 2);
    assert_eq!(sent(&mut e).len(), 2);
    assert_eq!(standby_flows(&backups, "/fake/b"), 2);
    // Re-protect to c: the flows change group (and backup).
    let ans = protect(
        &mut e,
        2,
        Policy::Single {
            backup: target("c"),
            hz: 1000,
        },
        t0 + MS * 3,
    );
    assert_eq!(ans["ok"], true, "{ans}");
    backups.up("/fake/c", 1, vec![]);
    e.poll_once(t0 + MS * 4);
    // Shipped to c but not acknowledged: b must keep its copy (else no backup holds them).
    assert_eq!(backups.unapplied("/fake/b"), 0, "nothing sent to b yet");
    let cps = backups.deliver("/fake/c");
    assert!(cps[0].full && cps[0].flows.len() == 2, "{cps:?}");
    e.poll_once(t0 + MS * 5);
    e.poll_once(t0 + MS * 6);
    // c acknowledged: the old group leaves b, so a failover cannot activate the flows twice.
    let cleared = backups.deliver("/fake/b");
    assert_eq!(cleared.len(), 1, "{cleared:?}");
    assert!(
        cleared[0].full && cleared[0].flows.is_empty(),
        "{cleared:?}"
    );
    assert_eq!(standby_flows(&backups, "/fake/b"), 0);
    assert_eq!(standby_flows(&backups, "/fake/c"), 2);
    let st = status(&mut e, t0 + MS * 7);
    assert_eq!(st["replication"]["standby_cleared"], 1, "{st}");
}

#[test]
fn chord_growth_moves_flows_to_the_new_backup_and_evicts_them_from_the_old_after_its_ack() {
    let (mut e, backups, t0) = engine();
    let chords = |names: &[&str]| Policy::Chords {
        backups: names.iter().map(|n| target(n)).collect(),
        vnodes: 64,
        hz: 1000,
    };
    const FLOWS: u16 = 24;
    assert_eq!(protect(&mut e, 1, chords(&["b", "c"]), t0)["ok"], true);
    backups.up("/fake/b", 1, vec![]);
    backups.up("/fake/c", 1, vec![]);
    for f in 0..FLOWS {
        e.port_mut(Side::Inside).inject(&pkt(f, b'm'));
    }
    e.poll_once(t0 + MS);
    backups.deliver("/fake/b");
    backups.deliver("/fake/c");
    e.poll_once(t0 + MS * 2);
    assert_eq!(sent(&mut e).len(), FLOWS as usize);
    let held = |s: &str| standby_flows(&backups, s);
    assert_eq!(held("/fake/b") + held("/fake/c"), FLOWS as usize);
    // A third backup joins the ring: some flows now belong to d's group.
    assert_eq!(
        protect(&mut e, 2, chords(&["b", "c", "d"]), t0 + MS * 3)["ok"],
        true
    );
    backups.up("/fake/d", 1, vec![]);
    e.poll_once(t0 + MS * 4);
    backups.deliver("/fake/b");
    backups.deliver("/fake/c");
    // Shipped to d, not acknowledged: the old copies stay (no instant without a backup).
    assert_eq!(held("/fake/b") + held("/fake/c"), FLOWS as usize);
    let to_d = backups.deliver("/fake/d");
    let moved: usize = to_d.iter().map(|c| c.flows.len()).sum();
    assert!(moved > 0, "the ring gave d no flow: {to_d:?}");
    e.poll_once(t0 + MS * 5);
    e.poll_once(t0 + MS * 6);
    backups.deliver("/fake/b");
    backups.deliver("/fake/c");
    // Exactly one standby copy per flow again (invariant 1 at the next failover).
    assert_eq!(held("/fake/d"), moved);
    assert_eq!(
        held("/fake/b") + held("/fake/c") + held("/fake/d"),
        FLOWS as usize
    );
    let st = status(&mut e, t0 + MS * 7);
    assert_eq!(st["replication"]["standby_evicted"], moved as u64, "{st}");
}

/// A re-protection while output waits: the held packet follows its flow to the new group and
/// leaves before the flow's later packets (design invariant 5), even though the old backup
/// never answers. Left in the old group it would wait for that backup while the new group's
/// ack let the flow's next packet overtake it.
#[test]
fn held_output_follows_its_flow_to_the_new_group_in_order() {
    let (mut e, backups, t0) = engine();
    assert_eq!(protect(&mut e, 1, single(1000), t0)["ok"], true);
    backups.up("/fake/b", 1, vec![]);
    e.port_mut(Side::Inside).inject(&pkt(1, b'm'));
    e.poll_once(t0 + MS);
    assert!(sent(&mut e).is_empty(), "waits for b");
    let to_c = Policy::Single {
        backup: target("c"),
        hz: 1000,
    };
    assert_eq!(protect(&mut e, 2, to_c, t0 + MS * 2)["ok"], true);
    backups.up("/fake/c", 1, vec![]);
    e.port_mut(Side::Inside).inject(&pkt(1, b'm'));
    e.poll_once(t0 + MS * 3);
    assert!(sent(&mut e).is_empty(), "waits for c");
    // b never acknowledges; c does.
    backups.deliver("/fake/c");
    e.poll_once(t0 + MS * 4);
    assert_eq!(
        sent(&mut e),
        [(1, b'm', 1), (1, b'm', 2)],
        "both packets, in write order, on c's ack"
    );
    backups.kill("/fake/b");
    e.poll_once(t0 + MS * 5);
    assert!(sent(&mut e).is_empty(), "nothing was left behind on b");
    let st = status(&mut e, t0 + MS * 6);
    assert_eq!(st["replication"]["held_moved"], 1, "{st}");
    assert_eq!(st["output"]["audit_violations"], 0, "{st}");
    assert_eq!(st["output"]["audit_checked"], 2, "{st}");
}

/// Chords grow to a backup that dies before acknowledging, then shrink back: the flows that
/// went to the dead backup's group return to groups that were to evict them. Those evictions
/// are void; each flow is shipped exactly once per checkpoint (a `Deleted` beside a full record
/// would make the backup refuse the whole checkpoint) and ends with one standby copy.
#[test]
fn a_flow_back_in_a_group_that_was_evicting_it_ships_once() {
    let (mut e, backups, t0) = engine();
    let chords = |names: &[&str]| Policy::Chords {
        backups: names.iter().map(|n| target(n)).collect(),
        vnodes: 64,
        hz: 1000,
    };
    const FLOWS: u16 = 24;
    assert_eq!(protect(&mut e, 1, chords(&["b", "c"]), t0)["ok"], true);
    backups.up("/fake/b", 1, vec![]);
    backups.up("/fake/c", 1, vec![]);
    for f in 0..FLOWS {
        e.port_mut(Side::Inside).inject(&pkt(f, b'm'));
    }
    e.poll_once(t0 + MS);
    backups.deliver("/fake/b");
    backups.deliver("/fake/c");
    e.poll_once(t0 + MS * 2);
    assert_eq!(sent(&mut e).len(), FLOWS as usize);
    assert_eq!(
        protect(&mut e, 2, chords(&["b", "c", "d"]), t0 + MS * 3)["ok"],
        true
    );
    backups.up("/fake/d", 1, vec![]);
    e.poll_once(t0 + MS * 4);
    assert!(
        backups.unapplied("/fake/d") > 0,
        "d's group shipped its flows"
    );
    // d dies unacknowledged; the ring shrinks back to b and c.
    backups.kill("/fake/d");
    e.poll_once(t0 + MS * 5);
    assert_eq!(
        protect(&mut e, 3, chords(&["b", "c"]), t0 + MS * 6)["ok"],
        true
    );
    let mut round = 7u32;
    for _ in 0..6 {
        e.poll_once(t0 + MS * round);
        round += 1;
        for s in ["/fake/b", "/fake/c"] {
            for cp in backups.deliver(s) {
                assert_eq!(cp.duplicate_key(), None, "{cp:?}");
            }
        }
    }
    let held = |s: &str| standby_flows(&backups, s);
    assert_eq!(held("/fake/b") + held("/fake/c"), FLOWS as usize);
    let st = status(&mut e, t0 + MS * round);
    assert_eq!(st["output"]["audit_violations"], 0, "{st}");
}

/// A re-protection retires the group of a backup that is reconnecting at that moment. The
/// group must not leave before it cleared that backup's copy: the backup keeps what it held
/// across a reconnection, and a failover of this replica would activate those flows there as
/// well as on their new backup (two live copies, invariant 1).
#[test]
fn a_retiring_group_clears_a_reconnecting_backup_before_it_leaves() {
    let (mut e, backups, t0) = engine();
    assert_eq!(protect(&mut e, 1, single(1000), t0)["ok"], true);
    backups.up("/fake/b", 1, vec![]);
    for f in 0..4 {
        e.port_mut(Side::Inside).inject(&pkt(f, b'm'));
    }
    e.poll_once(t0 + MS);
    backups.deliver("/fake/b");
    e.poll_once(t0 + MS * 2);
    assert_eq!(sent(&mut e).len(), 4);
    assert_eq!(standby_flows(&backups, "/fake/b"), 4);
    // b's connection drops (its process lives on); meanwhile the replica is re-protected to c.
    backups.get("/fake/b").lock().unwrap().status = LinkStatus::Connecting;
    e.poll_once(t0 + MS * 3);
    let to_c = Policy::Single {
        backup: target("c"),
        hz: 1000,
    };
    assert_eq!(protect(&mut e, 2, to_c, t0 + MS * 4)["ok"], true);
    backups.up("/fake/c", 1, vec![]);
    let mut round = 5u32;
    for _ in 0..4 {
        e.poll_once(t0 + MS * round);
        backups.deliver("/fake/c");
        round += 1;
    }
    assert_eq!(standby_flows(&backups, "/fake/c"), 4);
    assert_eq!(
        standby_flows(&backups, "/fake/b"),
        4,
        "b was not reachable: nothing cleared yet"
    );
    // b is back (it still holds seq 1 of the old group): the old group clears it, then leaves.
    backups.up("/fake/b", 2, vec![(1, 1)]);
    for _ in 0..3 {
        e.poll_once(t0 + MS * round);
        backups.deliver("/fake/b");
        round += 1;
    }
    assert_eq!(
        standby_flows(&backups, "/fake/b"),
        0,
        "one standby copy per flow"
    );
    let st = status(&mut e, t0 + MS * round);
    assert_eq!(st["replication"]["standby_cleared"], 1, "{st}");
    assert_eq!(st["groups"].as_array().map(Vec::len), Some(1), "{st}");
}

/// A replica that failed over while cut off (a partition) rejoins: it drops its flows, the
/// output it held for its backup's acknowledgement (none of it is ever sent, not even when the
/// old acknowledgement arrives late), the frames waiting for a neighbour and the standby
/// copies it held for another primary; a token that is not newer is refused; afterwards it is
/// protected again under the new token and serves new flows.
#[test]
fn rejoin_drops_everything_held_and_sends_none_of_it() {
    let own = Arc::new(Mutex::new(StandbyStore::new(1 << 16)));
    let mut stores = HashMap::new();
    stores.insert("/fake/p".to_string(), own.clone());
    let (mut p, backups, t0) = engine_with("p", HashMap::new(), Some(own.clone()));
    // p is the backup of q: one standby flow.
    let (mut q, q_backups, _) = engine_with("q", stores, None);
    let to_p = Policy::Single {
        backup: target("p"),
        hz: 1000,
    };
    protect(&mut q, 1, to_p, t0);
    q_backups.up("/fake/p", 1, vec![]);
    q.port_mut(Side::Inside).inject(&pkt(9, b'm'));
    q.poll_once(t0 + MS);
    assert_eq!(q_backups.deliver("/fake/p").len(), 1);
    // p protects three flows to b; their output waits for b's acknowledgement.
    protect(&mut p, 1, single(1000), t0);
    backups.up("/fake/b", 1, vec![]);
    for f in 1..=3 {
        p.port_mut(Side::Inside).inject(&pkt(f, b'm'));
    }
    p.poll_once(t0 + MS);
    assert!(sent(&mut p).is_empty(), "held for the backup");
    // And one frame waits for a neighbour that never answers (an address not yet resolved).
    let unresolved = build::udp(
        CLIENT_MAC,
        IN_MAC,
        ip("10.0.1.2"),
        1004,
        ip("10.0.2.77"),
        53,
        &[b'd'; 9],
    );
    p.port_mut(Side::Inside).inject(&unresolved);
    p.poll_once(t0 + MS * 2);
    let _ = p.port_mut(Side::Outside).take_tx(); // its ARP request
    assert_eq!(p.ctx.flows.len(), 3);
    assert_eq!(status(&mut p, t0)["standby"][0]["flows"], 1);

    let ans = p.answer(Cmd::Rejoin { token: 1 }, t0 + MS * 3);
    assert_eq!(ans["ok"], false, "{ans}");
    assert!(
        ans["error"].as_str().unwrap().contains("stale token"),
        "{ans}"
    );
    assert_eq!(p.ctx.flows.len(), 3, "a refused rejoin changes nothing");

    let ans = p.answer(Cmd::Rejoin { token: 5 }, t0 + MS * 3);
    let r: pliant_proto::reply::Rejoin = serde_json::from_value(ans.clone()).expect("typed");
    assert_eq!(ans["ok"], true, "{ans}");
    assert_eq!(
        (
            r.flows_dropped,
            r.packets_dropped,
            r.groups_closed,
            r.standby_dropped,
            r.token
        ),
        (3, 4, 1, 1, 5),
        "{ans}"
    );
    assert_eq!(p.ha_token(), 5);
    assert_eq!(p.ctx.flows.len(), 0);
    // The old backup's acknowledgements arrive late: nothing was kept for them to release.
    backups.deliver("/fake/b");
    for i in 4..8 {
        p.poll_once(t0 + MS * i);
    }
    assert!(
        sent(&mut p).is_empty(),
        "output of flows that failed over left"
    );
    let st = status(&mut p, t0 + MS * 8);
    assert_eq!(st["groups"].as_array().map(Vec::len), Some(0), "{st}");
    assert_eq!(st["standby"].as_array().map(Vec::len), Some(0), "{st}");
    assert_eq!(
        p.answer(Cmd::Stats, t0 + MS * 8)["drops"]["rejoin_discarded"],
        4
    );

    // A member again: protected under the new token, new flows are served and checkpointed.
    assert_eq!(protect(&mut p, 5, single(1000), t0 + MS * 9)["ok"], true);
    backups.up("/fake/b", 2, vec![]);
    p.port_mut(Side::Inside).inject(&pkt(7, b'm'));
    p.poll_once(t0 + MS * 10);
    assert_eq!(backups.deliver("/fake/b").len(), 1);
    p.poll_once(t0 + MS * 11);
    assert_eq!(sent(&mut p), [(7, b'm', 1)]);
}
