//! The engine's side of live flow migration (see [`crate::migrate`] for the protocol): holding
//! packets of incoming flows, forwarding late packets of outgoing ones, exporting at a quiet
//! round, importing batches and releasing holds in order.

use super::{Engine, Rx};
use crate::migrate::{
    self, Hold, OutMig, Outbound, PeerEvent, PeerMsg, Phase, WirePacket, MAX_HOLD_KEYS,
    MAX_OUT_MIGRATIONS,
};
use crate::nf::{NetworkFunction, Packet};
use crate::peer::{OutState, PeerLink, Reply};
use pliant_io::{FramePort, Offload};
use pliant_state::FlowKey;
use serde_json::{json, Value};
use std::collections::HashSet;
use std::fmt::Write as _;
use std::sync::mpsc::SyncSender;
use std::sync::Arc;
use std::time::Instant;

const NO_PEER_CHANNEL: &str = "no peer channel: this replica's config has no [security] \
     identity (the peer channel is authenticated)";

/// Peer events handled per round at most (the rest wait for the next round).
const PEER_EVENTS_PER_ROUND: usize = 4096;

impl<N: NetworkFunction, P: FramePort> Engine<N, P> {
    /// Decides the fate of a packet while migrations are under way: held (its flow is moving
    /// here), forwarded (its flow moved away), or returned for the NF.
    pub(super) fn divert(&mut self, pkt: Packet, forwarded: bool, now: Instant) -> Option<Packet> {
        let key = pkt.meta.key;
        if self.mig.holds.contains_key(&key) {
            // A forwarded late packet was sent before anything held here arrived: once the
            // state is here it goes first.
            if forwarded && self.ctx.flows.contains(&key) {
                self.mig.stats.late_reinjected += 1;
                return Some(pkt);
            }
            if self.mig.held.len() >= self.opts.max_held_packets {
                self.mig.stats.hold_overflow += 1;
                self.ctx.pkt_drop(pkt, "migrate_hold_overflow");
                return None;
            }
            self.mig.stats.held_packets += 1;
            if let Some(h) = self.mig.holds.get_mut(&key) {
                h.first_held.get_or_insert(now);
            }
            self.mig.held.push_back((self.mig.stats.held_packets, pkt));
            return None;
        }
        if let Some(to) = self.mig.forwards.get(&key) {
            if forwarded {
                // Forwarded twice would risk a loop between two replicas.
                self.mig.stats.forward_loops += 1;
                self.ctx.pkt_drop(pkt, "migrate_forward_loop");
                return None;
            }
            let to = to.to_string();
            let Packet {
                buf,
                ingress,
                offload,
                ..
            } = pkt;
            let msg = PeerMsg::Fwd {
                key,
                pkt: WirePacket::new(ingress, &offload, buf),
            };
            let sent = self
                .peer
                .as_mut()
                .is_some_and(|p| p.send(Outbound { to, msg }));
            if sent {
                self.mig.stats.forwarded_late += 1;
            } else {
                self.mig.stats.forward_failed += 1;
                self.ctx.count_drop("migrate_forward_failed", 1);
            }
            return None;
        }
        if forwarded && self.mig.released.contains(&key) {
            self.mig.stats.late_after_release += 1;
        }
        Some(pkt)
    }

    /// `migrate_in`: hold packets of `keys` from now on.
    pub(super) fn migrate_in(&mut self, from: &str, keys: &[FlowKey], now: Instant) -> Value {
        if self.mig.holds.len() + keys.len() > MAX_HOLD_KEYS {
            return json!({"ok": false, "error": format!(
                "{} keys held already; {} more exceed the bound of {MAX_HOLD_KEYS}",
                self.mig.holds.len(), keys.len())});
        }
        if let Some(k) = keys.iter().find(|k| self.ctx.flows.contains(k)) {
            return json!({"ok": false, "error": format!("flow {k} is live here already")});
        }
        for k in keys {
            self.mig.holds.entry(*k).or_insert(Hold {
                since: now,
                first_held: None,
            });
            // The flow comes back: its late packets are ours again.
            self.mig.forwards.remove(k);
            self.mig.released.remove(k);
        }
        json!({"ok": true, "from": from, "holding": keys.len(), "held_keys": self.mig.holds.len()})
    }

    /// `migrate_abort`: ends the holds of `keys` for a migration that never switched over
    /// (rolled back by the controller that took over from the one that started it). Packets
    /// held for them — none, if the fabric never sent any here — go to the NF in arrival order,
    /// as a release would send them; keys not held are ignored (the abort is idempotent).
    pub(super) fn migrate_abort(&mut self, keys: &[FlowKey]) -> Value {
        let set: HashSet<FlowKey> = keys.iter().copied().collect();
        let mut ended = 0u64;
        for k in keys {
            if self.mig.holds.remove(k).is_some() {
                ended += 1;
            }
        }
        let mut to_nf = Vec::new();
        let held = std::mem::take(&mut self.mig.held);
        for (arrival, p) in held {
            if set.contains(&p.meta.key) {
                to_nf.push(p);
            } else {
                self.mig.held.push_back((arrival, p));
            }
        }
        let released = to_nf.len() as u64;
        self.mig.stats.aborted_holds += ended;
        self.mig.stats.released_packets += released;
        for p in to_nf {
            self.nf.process(&mut self.ctx, p);
        }
        json!({"ok": true, "aborted": ended, "released_packets": released,
            "held_keys": self.mig.holds.len()})
    }

    /// `migrate_out`: registers the migration; it advances in `step_out_migrations`.
    pub(super) fn start_migrate_out(
        &mut self,
        to: String,
        keys: Vec<FlowKey>,
        reply: SyncSender<Value>,
        now: Instant,
    ) {
        let refuse = |msg: String| {
            let _ = reply.try_send(json!({"ok": false, "error": msg}));
        };
        if self.peer.is_none() {
            return refuse(NO_PEER_CHANNEL.into());
        }
        if self.mig.out.len() >= MAX_OUT_MIGRATIONS {
            return refuse(format!(
                "{MAX_OUT_MIGRATIONS} migrations in progress already"
            ));
        }
        self.mig.next_id += 1;
        self.mig.out.push(OutMig {
            id: self.mig.next_id,
            to,
            keys,
            reply: Some(reply),
            started: now,
            start_round: self.stats.rounds,
            request_ns: super::realtime_ns(),
            shipped_ns: 0,
            phase: Phase::Draining,
            records: Vec::new(),
            moved_keys: Vec::new(),
            moved: 0,
            failed: Vec::new(),
            kept: Vec::new(),
            exported_at: None,
            done_at: None,
            busy_seen: false,
            deadline: now + migrate::BUSY_WAIT,
            settle_since: None,
            settle_us: 0,
            settle_mark: None,
        });
    }

    /// `peer_connect`: opens the peer connection to `to` ahead of a move, answered once it
    /// is up (at once if it already was), or failed, or after [`migrate::CONNECT_WAIT`].
    pub(super) fn start_peer_connect(
        &mut self,
        to: String,
        reply: SyncSender<Value>,
        now: Instant,
    ) {
        let Some(peer) = self.peer.as_mut() else {
            let _ = reply.try_send(json!({"ok": false, "error": NO_PEER_CHANNEL}));
            return;
        };
        if self.mig.connecting.len() >= MAX_OUT_MIGRATIONS {
            let _ = reply.try_send(json!({
                "ok": false,
                "error": format!("{MAX_OUT_MIGRATIONS} peer connections being set up already"),
            }));
            return;
        }
        match peer.connect(&to) {
            OutState::Up => {
                let _ = reply.try_send(json!({"ok": true, "reused": true, "wait_us": 0}));
            }
            OutState::Failed(e) => {
                let _ = reply.try_send(json!({"ok": false, "error": e}));
            }
            OutState::Connecting => self.mig.connecting.push(migrate::ConnectWait {
                to,
                reply,
                started: now,
            }),
        }
    }

    /// Answers the `peer_connect` requests whose connection came up, failed or timed out.
    pub(super) fn step_peer_connects(&mut self, now: Instant) {
        let Some(peer) = self.peer.as_ref() else {
            return;
        };
        self.mig.connecting.retain(|w| {
            let waited = now.saturating_duration_since(w.started);
            let answer = match peer.connection(&w.to) {
                OutState::Up => json!({
                    "ok": true,
                    "reused": false,
                    "wait_us": u64::try_from(waited.as_micros()).unwrap_or(u64::MAX),
                }),
                OutState::Failed(e) => json!({"ok": false, "error": e}),
                OutState::Connecting if waited < migrate::CONNECT_WAIT => return true,
                OutState::Connecting => json!({
                    "ok": false,
                    "error": format!(
                        "{}: not connected within {:?}",
                        w.to,
                        migrate::CONNECT_WAIT
                    ),
                }),
            };
            let _ = w.reply.try_send(answer);
            false
        });
    }

    /// Advances outgoing migrations; called once per round after the received frames were
    /// processed (their output is written in the same round).
    pub(super) fn step_out_migrations(&mut self, now: Instant) {
        let drained = self.rings_drained;
        let mut outs = std::mem::take(&mut self.mig.out);
        let mut finished = Vec::new();
        for (i, m) in outs.iter_mut().enumerate() {
            let phase = m.phase;
            match phase {
                Phase::Draining
                    if (drained && self.stats.rounds > m.start_round)
                        || self.rings_read_past(m.request_ns) =>
                {
                    if !self.output_settled(m, now) {
                        continue;
                    }
                    // Exported but not shippable: re-imported and answered already.
                    let failed_to_ship = self.try_export(m, now) && !self.ship(m);
                    if failed_to_ship {
                        finished.push(i);
                    }
                }
                Phase::Shipped if drained || self.rings_read_past(m.shipped_ns) => {
                    let release = self.release_list(m);
                    let msg = PeerMsg::Done {
                        id: m.id,
                        from: self.name.clone(),
                        release,
                        kept: m.kept.clone(),
                    };
                    let ok = self.peer.as_mut().is_some_and(|p| {
                        p.send(Outbound {
                            to: m.to.clone(),
                            msg,
                        })
                    });
                    if ok {
                        m.done_at = Some(now);
                        m.phase = Phase::AwaitAck;
                        m.deadline = now + migrate::ACK_WAIT;
                    } // else: channel full, retry next quiet round
                }
                Phase::AwaitAck if now >= m.deadline => {
                    self.finish_out(m, Err("no Ack from the destination in time".into()), now);
                    finished.push(i);
                }
                _ => {}
            }
        }
        for i in finished.into_iter().rev() {
            outs.remove(i);
        }
        outs.append(&mut self.mig.out);
        self.mig.out = outs;
    }

    /// True when every frame this replica has queued so far (this round's flush included) has
    /// left the kernel's queues and none waits for a neighbour answer, or when the wait for
    /// that ran past [`migrate::TX_SETTLE_WAIT`] (counted). Called after the round's flush, so
    /// the export that follows a `true` comes after the last output of the moving flows was
    /// delivered: nothing the destination emits later can overtake it (crate::migrate,
    /// "Output order").
    fn output_settled(&mut self, m: &mut OutMig, now: Instant) -> bool {
        // Frames waiting for a neighbour answer go out whenever it comes (a bounded table,
        // read only while a migration waits here).
        let mut settled = self
            .neigh
            .iter()
            .all(|n| n.snapshot().iter().all(|e| e.2 == 0));
        // The output that matters is the moving flows': everything the ports had queued at
        // the end of the last round that worked on one of them. A mark retaken every round
        // would chase the other flows' traffic and never settle on a busy port.
        let last_touched = m
            .keys
            .iter()
            .filter_map(|k| self.ctx.flows.touched(k))
            .max()
            .unwrap_or(0);
        let round = self.stats.rounds;
        let marks = match m.settle_mark {
            Some((r, marks)) if last_touched <= r => marks,
            // Untouched this round: the marks from the round's start cover its output and
            // not this round's frames of other flows.
            _ if last_touched < round => {
                m.settle_mark = Some((round - 1, self.round_start_marks));
                self.round_start_marks
            }
            _ => {
                let marks = [0, 1].map(|i| self.ports[i].tx_mark());
                m.settle_mark = Some((round, marks));
                marks
            }
        };
        for (port, mark) in self.ports.iter_mut().zip(marks) {
            settled = settled && port.tx_settled(mark);
        }
        let since = match (settled, m.settle_since) {
            (true, None) => return true,
            (true, Some(t)) => t,
            (false, t) => *m.settle_since.get_or_insert(t.unwrap_or(now)),
        };
        let waited = now.saturating_duration_since(since);
        let timed_out = !settled && waited >= migrate::TX_SETTLE_WAIT;
        if settled || timed_out {
            let us = waited.as_micros() as u64;
            m.settle_us = us;
            m.settle_since = None;
            let st = &mut self.mig.stats;
            st.tx_settle_waits += 1;
            st.tx_settle_wait_us_max = st.tx_settle_wait_us_max.max(us);
            if timed_out {
                st.tx_settle_timeouts += 1;
                tracing::warn!(
                    waited_us = us,
                    "exporting with emitted frames still queued in the kernel: the order of \
                     this move's output is not guaranteed"
                );
            }
            return true;
        }
        // The kernel releases the frames on its own (softirq work, maybe ksoftirqd on this
        // very CPU): give the CPU away instead of spinning through empty rounds.
        std::thread::yield_now();
        false
    }

    /// Exports the migration's flows once none is busy (or the busy wait ran out). False while
    /// still waiting.
    fn try_export(&mut self, m: &mut OutMig, now: Instant) -> bool {
        let busy = m
            .keys
            .iter()
            .any(|k| self.ctx.flows.refcount(k).is_some_and(|r| r > 0));
        if busy && now < m.deadline {
            m.busy_seen = true;
            self.mig.stats.busy_retries += 1;
            return false;
        }
        let mut seen = HashSet::new();
        for k in m.keys.clone() {
            if seen.contains(&k) {
                continue;
            }
            let Some(all) = self.ctx.flows.keys_of(&k) else {
                // Not here (ended, or never was): nothing to move; the destination simply
                // releases its held packets.
                seen.insert(k);
                continue;
            };
            seen.extend(all.iter().copied());
            match self.ctx.flows.export_flow(&k, now) {
                Ok(rec) => {
                    m.records.push(rec);
                    m.moved_keys.extend(all);
                    m.moved += 1;
                }
                Err(e) => {
                    m.failed.push((k, e.to_string()));
                    m.kept.extend(all);
                }
            }
        }
        m.exported_at = Some(now);
        self.mig.stats.flows_exported += m.moved;
        self.mig.stats.flows_export_failed += m.failed.len() as u64;
        true
    }

    /// Sends the batch and starts forwarding late packets. False if it could not be queued
    /// (the flows are re-imported here and the request answered with an error).
    fn ship(&mut self, m: &mut OutMig) -> bool {
        let to: Arc<str> = m.to.as_str().into();
        let msg = PeerMsg::Batch {
            id: m.id,
            from: self.name.clone(),
            records: m.records.clone(),
        };
        let ok = self.peer.as_mut().is_some_and(|p| {
            p.send(Outbound {
                to: m.to.clone(),
                msg,
            })
        });
        let now = self.ctx.now();
        if !ok {
            self.reimport(&m.records.clone(), now);
            m.records.clear();
            self.finish_out(m, Err("peer channel full: batch not sent".into()), now);
            return false;
        }
        for k in &m.moved_keys {
            self.mig.remember_forward(*k, to.clone());
        }
        m.phase = Phase::Shipped;
        m.shipped_ns = super::realtime_ns();
        true
    }

    /// Keys whose holds the destination may release: everything requested or moved, except
    /// what stayed here.
    fn release_list(&self, m: &OutMig) -> Vec<FlowKey> {
        let kept: HashSet<&FlowKey> = m.kept.iter().collect();
        let mut seen = HashSet::new();
        m.keys
            .iter()
            .chain(m.moved_keys.iter())
            .filter(|k| !kept.contains(k) && seen.insert(**k))
            .copied()
            .collect()
    }

    /// Puts export records back into this table (a batch that never reached its destination,
    /// or records it refused).
    fn reimport(&mut self, records: &[Vec<u8>], now: Instant) {
        for rec in records {
            match self.import_record(rec, now) {
                Ok(_) => {}
                Err(e) => {
                    self.mig.stats.peer_errors += 1;
                    tracing::error!(error = %e, "cannot re-import a flow whose migration failed");
                }
            }
        }
    }

    /// Answers the `migrate_out` request.
    fn finish_out(&mut self, m: &mut OutMig, res: Result<Value, String>, now: Instant) {
        let reply = match res {
            Ok(mut v) => {
                self.mig.stats.migrations_out += 1;
                v["ok"] = json!(true);
                v
            }
            Err(e) => {
                self.mig.stats.migrations_out_failed += 1;
                json!({"ok": false, "error": e})
            }
        };
        let mut reply = reply;
        reply["moved"] = json!(m.moved);
        reply["failed"] = m
            .failed
            .iter()
            .map(|(k, e)| json!({"key": k.to_string(), "error": e}))
            .collect();
        let drain_us = m.exported_at.map_or(0, |t| {
            t.saturating_duration_since(m.started).as_micros() as u64
        });
        reply["drain_us"] = json!(drain_us);
        // Part of drain_us spent waiting for this replica's emitted frames to leave the kernel.
        reply["settle_us"] = json!(m.settle_us);
        // Where the source's time went: request -> Done queued, Done -> Ack handled (the
        // destination's release and the peer channel's round trip).
        let since = |t: Option<Instant>, from: Instant| {
            t.map_or(0, |t| t.saturating_duration_since(from).as_micros() as u64)
        };
        reply["done_us"] = json!(since(m.done_at, m.started));
        reply["ack_us"] = json!(m
            .done_at
            .map_or(0, |d| now.saturating_duration_since(d).as_micros() as u64));
        reply["total_us"] = json!(now.saturating_duration_since(m.started).as_micros() as u64);
        if let Some(r) = m.reply.take() {
            let _ = r.try_send(reply);
        }
    }

    /// Handles what the peer transport delivered since the last round.
    pub(super) fn poll_peer(&mut self, now: Instant) {
        let force = std::mem::take(&mut self.peer_pump_due);
        let every = if self.mig.active() || !self.mig.out.is_empty() {
            crate::peer::PUMP_EVERY
        } else {
            crate::peer::PUMP_IDLE_EVERY
        };
        if let Some(p) = self.peer.as_mut() {
            p.pump(now, force, every);
        }
        for _ in 0..PEER_EVENTS_PER_ROUND {
            let Some(ev) = self.peer.as_mut().and_then(PeerLink::next_event) else {
                return;
            };
            match ev {
                PeerEvent::Msg { msg, reply } => self.peer_msg(msg, reply, now),
                PeerEvent::Ack(msg) => self.peer_ack(msg, now),
                PeerEvent::SendFailed {
                    id,
                    what,
                    to,
                    error,
                } => {
                    self.mig.stats.peer_errors += 1;
                    if what == "fwd" {
                        self.ctx.count_drop("migrate_forward_failed", 1);
                        continue;
                    }
                    let Some(pos) = self.mig.out.iter().position(|m| m.id == id) else {
                        continue;
                    };
                    let mut m = self.mig.out.remove(pos);
                    let err = if what == "batch" {
                        // The batch did not reach the destination: the flows are ours again.
                        let recs = std::mem::take(&mut m.records);
                        self.reimport(&recs, now);
                        m.moved = 0;
                        format!("sending to {to}: {error}; flows re-imported here")
                    } else {
                        format!("Done/Ack with {to}: {error}; the flows may be at the destination")
                    };
                    self.finish_out(&mut m, Err(err), now);
                }
            }
        }
    }

    fn peer_msg(&mut self, msg: PeerMsg, reply: Option<Reply>, now: Instant) {
        match msg {
            PeerMsg::Batch { id, from, records } => {
                self.mig.stats.batches_in += 1;
                let mut imported = 0u64;
                let mut failed = Vec::new();
                let mut rejected = Vec::new();
                for (i, rec) in records.into_iter().enumerate() {
                    match self.import_record(&rec, now) {
                        Ok(_) => imported += 1,
                        Err(e) => {
                            failed.push((format!("record {i}"), e.to_string()));
                            rejected.push(rec);
                        }
                    }
                }
                self.mig.stats.flows_imported += imported;
                self.mig.stats.flows_import_failed += failed.len() as u64;
                // Bounded: one entry per source and batch id, replaced by the next batch.
                if self.mig.pending_in.len() >= migrate::MAX_OUT_MIGRATIONS * 16 {
                    self.mig.pending_in.clear();
                }
                self.mig
                    .pending_in
                    .insert((from, id), (imported, failed, rejected));
            }
            PeerMsg::Fwd { key: _, pkt } => match Offload::decode(&pkt.vnet) {
                Ok(offload) => {
                    let f = Rx {
                        side: pkt.side,
                        buf: pkt.frame,
                        csum_not_ready: false,
                        truncated: false,
                        offload,
                        forwarded: true,
                    };
                    self.handle_frame(f, now);
                }
                Err(_) => {
                    self.mig.stats.peer_errors += 1;
                    self.ctx.count_drop("migrate_bad_forward", 1);
                }
            },
            PeerMsg::Done {
                id,
                from,
                release,
                kept,
            } => {
                let ack = self.release(id, &from, &release, &kept, now);
                let sent =
                    reply.is_some_and(|r| self.peer.as_mut().is_some_and(|p| p.reply(r, ack)));
                if !sent {
                    self.mig.stats.peer_errors += 1;
                }
            }
            PeerMsg::Ack { .. } => self.mig.stats.peer_errors += 1,
        }
    }

    /// Ends the holds of `release` (held packets go to the NF in arrival order) and of `kept`
    /// (their held packets go back to the source in the Ack).
    fn release(
        &mut self,
        id: u64,
        from: &str,
        release: &[FlowKey],
        kept: &[FlowKey],
        now: Instant,
    ) -> PeerMsg {
        let rel: HashSet<FlowKey> = release.iter().copied().collect();
        let keep: HashSet<FlowKey> = kept.iter().copied().collect();
        let mut returned = Vec::new();
        let mut to_nf = Vec::new();
        let held = std::mem::take(&mut self.mig.held);
        for (arrival, p) in held {
            let k = p.meta.key;
            if keep.contains(&k) {
                returned.push(WirePacket::new(p.ingress, &p.offload, p.buf));
            } else if rel.contains(&k) {
                to_nf.push((arrival, p));
            } else {
                self.mig.held.push_back((arrival, p));
            }
        }
        // Invariant 5 (order): the released packets reach the NF in the order they arrived
        // (across flows, hence per flow and across both directions of one).
        debug_assert!(
            to_nf.windows(2).all(|w| w[0].0 < w[1].0),
            "held packets released out of arrival order"
        );
        let mut pauses = Vec::new();
        let mut held_us_max = 0u64;
        for k in release {
            if let Some(h) = self.mig.holds.remove(k) {
                if let Some(t) = h.first_held {
                    held_us_max =
                        held_us_max.max(now.saturating_duration_since(t).as_micros() as u64);
                }
                let primary = self
                    .ctx
                    .flows
                    .keys_of(k)
                    .is_none_or(|v| v.first() == Some(k));
                if primary {
                    let us = now.saturating_duration_since(h.since).as_micros() as u64;
                    pauses.push(us);
                    self.mig.record_pause(us);
                }
            }
            self.mig.remember_released(*k);
        }
        for k in kept {
            self.mig.holds.remove(k);
        }
        let released_packets = to_nf.len() as u64;
        self.mig.stats.released_packets += released_packets;
        self.mig.stats.returned_packets += returned.len() as u64;
        for (_, p) in to_nf {
            self.nf.process(&mut self.ctx, p);
        }
        let (imported, import_failed, rejected) = self
            .mig
            .pending_in
            .remove(&(from.to_string(), id))
            .unwrap_or_default();
        let flows = pauses.len() as u64;
        let (p50, p99, max) = migrate::percentiles(pauses);
        PeerMsg::Ack {
            id,
            imported,
            import_failed,
            rejected,
            pause: migrate::PauseInfo {
                flows,
                pause_us_p50: p50,
                pause_us_p99: p99,
                pause_us_max: max,
                released_packets,
                held_us_max,
            },
            returned,
        }
    }

    fn peer_ack(&mut self, msg: PeerMsg, now: Instant) {
        let PeerMsg::Ack {
            id,
            imported,
            import_failed,
            rejected,
            pause,
            returned,
        } = msg
        else {
            self.mig.stats.peer_errors += 1;
            return;
        };
        let Some(pos) = self.mig.out.iter().position(|m| m.id == id) else {
            self.mig.stats.peer_errors += 1;
            return;
        };
        let mut m = self.mig.out.remove(pos);
        // Records the destination refused come home (their flows are ours again).
        self.reimport(&rejected, now);
        for w in returned {
            match Offload::decode(&w.vnet) {
                Ok(offload) => self.handle_frame(
                    Rx {
                        side: w.side,
                        buf: w.frame,
                        csum_not_ready: false,
                        truncated: false,
                        offload,
                        forwarded: true,
                    },
                    now,
                ),
                Err(_) => self.ctx.count_drop("migrate_bad_forward", 1),
            }
        }
        let v = json!({
            "imported": imported,
            "import_failed": import_failed
                .iter()
                .map(|(w, e)| json!({"what": w, "error": e}))
                .collect::<Vec<_>>(),
            "pause": pause,
        });
        self.finish_out(&mut m, Ok(v), now);
    }

    pub(super) fn migration_json(&self) -> Value {
        let (p50, p99, max) = self.mig.pause_percentiles();
        let mut v = serde_json::to_value(&self.mig.stats).unwrap_or(Value::Null);
        v["holding_keys"] = json!(self.mig.holds.len());
        v["held_now"] = json!(self.mig.held.len());
        v["forward_keys"] = json!(self.mig.forwards.len());
        v["out_in_progress"] = json!(self.mig.out.len());
        v["pause_us_p50"] = json!(p50);
        v["pause_us_p99"] = json!(p99);
        v["pause_us_max"] = json!(max);
        v["pause_samples"] = json!(self.mig.pauses_us.len());
        v
    }

    pub(super) fn migration_metrics(&self, out: &mut String) {
        let s = &self.mig.stats;
        let r = &self.name;
        let counters = [
            ("migrations_out", s.migrations_out),
            ("migrations_out_failed", s.migrations_out_failed),
            ("flows_exported", s.flows_exported),
            ("flows_imported", s.flows_imported),
            ("flows_import_failed", s.flows_import_failed),
            ("held_packets", s.held_packets),
            ("released_packets", s.released_packets),
            ("hold_overflow", s.hold_overflow),
            ("forwarded_late", s.forwarded_late),
            ("forward_failed", s.forward_failed),
            ("late_after_release", s.late_after_release),
            ("peer_errors", s.peer_errors),
            ("tx_settle_waits", s.tx_settle_waits),
            ("tx_settle_timeouts", s.tx_settle_timeouts),
        ];
        for (name, v) in counters {
            let _ = writeln!(out, "# TYPE pliant_migrate_{name}_total counter");
            let _ = writeln!(out, "pliant_migrate_{name}_total{{replica=\"{r}\"}} {v}");
        }
        let (p50, p99, _) = self.mig.pause_percentiles();
        let _ = writeln!(out, "# TYPE pliant_migrate_pause_us gauge");
        let _ = writeln!(
            out,
            "pliant_migrate_pause_us{{replica=\"{r}\",quantile=\"0.5\"}} {p50}"
        );
        let _ = writeln!(
            out,
            "pliant_migrate_pause_us{{replica=\"{r}\",quantile=\"0.99\"}} {p99}"
        );
    }
}
