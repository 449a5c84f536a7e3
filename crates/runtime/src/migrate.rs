//! Live flow migration, replica side (OpenNF-style loss-free, order-preserving move).
//!
//! Protocol between the source S and the destination D of a batch of flows (the controller,
//! or [`crate::migrate_client::migrate`], drives it):
//!
//! 1. `migrate_in` at D: from now on, packets of the listed keys (primary keys and aliases)
//!    that reach D are *held* in one bounded FIFO (arrival order across all held flows, so
//!    both directions of a flow keep their relative order).
//! 2. The fabric is switched (steering update): new packets of the flows go to D.
//! 3. `migrate_out` at S: S keeps running rounds until each RX ring was read past the
//!    request's arrival — a receive that started after it found the ring empty, or S read a
//!    frame the kernel put in the ring after it (rings are read in order, and a busy ring
//!    rarely runs empty) — so every frame the fabric steered to S before the switch was
//!    processed and its output emitted (the NF writes output in the same round it processes a
//!    frame), every flow's refcount is 0 (export
//!    refuses `Busy`; S retries each round up to [`BUSY_WAIT`]) and every frame S has emitted
//!    so far has left the kernel's queues (see "Output order" below). Then it exports all flows
//!    in one [`PeerMsg::Batch`] and ships it over the peer channel.
//! 4. Late packets at S (still in flight in the fabric at the switch) hit the forwarding map
//!    (filled at export with each key and alias) and go to D as [`PeerMsg::Fwd`], on the same
//!    ordered connection, after the batch.
//! 5. Once each ring was read past the shipping (the same test) S sends [`PeerMsg::Done`].
//!    D then releases the held packets in
//!    arrival order (forwarded late packets were processed on arrival, before them, since the
//!    state was already imported) and answers [`PeerMsg::Ack`] with the pause statistics; S
//!    answers the control request.
//!
//! Flows that could not be exported (still busy after [`BUSY_WAIT`], encode errors) stay at S:
//! D returns their held packets inside the Ack and S processes them, so nothing is lost; the
//! controller must point the steering for those keys back at S (the reply lists them).
//!
//! A forwarded packet that arrives at D after D released the flow is processed too, but may
//! have been overtaken by a released one: counted as `late_after_release`.
//!
//! ## Output order
//!
//! S's last outputs of a moving flow and D's first ones travel different links to the same
//! receiver. "Flushed before the export" does not order them: a flushed frame can still wait
//! in a kernel queue on its way (a veth hands it to a per-CPU backlog of the sending CPU, and
//! when that CPU's softirq work is deferred, a frame D sends later from another CPU passes it;
//! a qdisc downstream holds it the same way). So S exports only in a round where, after the
//! flush, every frame it ever queued has been released by the kernel
//! ([`pliant_io::FramePort::tx_settled`]: the sender's claim on a frame ends where it leaves
//! the last queue — the receiving host's IP layer, an AF_PACKET receiver, or a drop) and no
//! frame waits for a neighbour answer. D emits nothing of the flows before the batch arrives,
//! which is after the export. The wait is bounded by [`TX_SETTLE_WAIT`]; past it S exports
//! anyway and counts `tx_settle_timeouts` (order then not guaranteed for that move).

use crate::nf::Side;
use pliant_io::Offload;
use pliant_state::FlowKey;
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::mpsc::SyncSender;
use std::time::{Duration, Instant};

/// Bound on a peer frame (a batch of 10,000 flows of a few hundred bytes fits easily).
pub const MAX_FRAME_BYTES: usize = 64 << 20;
/// Bound on flows per `migrate_out`/`migrate_in` request (checked as the request decodes).
pub use pliant_proto::request::MAX_KEYS_PER_REQUEST;
/// Bound on keys held at once on a destination.
pub const MAX_HOLD_KEYS: usize = 100_000;
/// Bound on packets held at once on a destination (beyond: dropped, `hold_overflow`).
pub const MAX_HELD_PACKETS: usize = 65_536;
/// Bound on remembered destinations of migrated keys (oldest forgotten first, counted).
pub const MAX_FORWARDS: usize = 131_072;
/// Bound on concurrent outgoing migrations.
pub const MAX_OUT_MIGRATIONS: usize = 8;
/// How long a source waits for busy flows (refcount > 0) before giving up on them.
pub const BUSY_WAIT: Duration = Duration::from_millis(1000);
/// How long a source waits for the destination's Ack.
pub const ACK_WAIT: Duration = Duration::from_millis(2500);
/// How long a source waits for its emitted frames to leave the kernel's queues before it
/// exports anyway (counted as `tx_settle_timeouts`). Frames queued behind deferred softirq
/// work are normally released within a few milliseconds.
pub const TX_SETTLE_WAIT: Duration = Duration::from_millis(20);
/// Pause samples kept for the p50/p99 statistics.
const MAX_PAUSE_SAMPLES: usize = 4096;

/// A packet travelling between replicas: the ingress side, the offload metadata (as a
/// virtio_net_hdr) and the whole Ethernet frame.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WirePacket {
    pub side: Side,
    pub vnet: [u8; pliant_io::vnet::VNET_HDR_LEN],
    pub frame: Vec<u8>,
}

impl WirePacket {
    pub fn new(side: Side, offload: &Offload, frame: Vec<u8>) -> Self {
        WirePacket {
            side,
            vnet: offload.encode(),
            frame,
        }
    }
}

/// Pause statistics of one batch as seen by the destination.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PauseInfo {
    /// Keys whose hold ended with this batch.
    pub flows: u64,
    pub pause_us_p50: u64,
    pub pause_us_p99: u64,
    pub pause_us_max: u64,
    /// Held packets released to the NF.
    pub released_packets: u64,
    /// The longest any released packet waited in the hold (release minus the arrival of its
    /// flow's first held packet): the pause as the traffic saw it. `pause_us_*` start earlier,
    /// at `migrate_in`, before the fabric even switched.
    pub held_us_max: u64,
}

/// A message on the replica-to-replica peer channel.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PeerMsg {
    /// Exported flows (the state library's export records), shipped by the source.
    Batch {
        id: u64,
        from: String,
        records: Vec<Vec<u8>>,
    },
    /// A late packet of a migrated flow, forwarded by its old owner.
    Fwd { key: FlowKey, pkt: WirePacket },
    /// End of migration `id`: release the holds of `release`; `kept` stayed at the source.
    Done {
        id: u64,
        from: String,
        release: Vec<FlowKey>,
        kept: Vec<FlowKey>,
    },
    /// The destination's answer to `Done`.
    Ack {
        id: u64,
        imported: u64,
        /// `(what, why)` of records that could not be imported.
        import_failed: Vec<(String, String)>,
        /// The records that could not be imported, handed back to the source.
        rejected: Vec<Vec<u8>>,
        pause: PauseInfo,
        /// Held packets of `kept` flows, handed back to the owner.
        returned: Vec<WirePacket>,
    },
}

/// Why a peer message body could not be decoded.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("undecodable peer message: {0}")]
    Decode(String),
}

/// Postcard encoding of a message body (the peer channel seals it into a pliant-wire frame).
pub fn encode_body(msg: &PeerMsg) -> Result<Vec<u8>, FrameError> {
    postcard::to_allocvec(msg).map_err(|e| FrameError::Decode(e.to_string()))
}

/// Decodes one message body.
pub fn decode_body(body: &[u8]) -> Result<PeerMsg, FrameError> {
    postcard::from_bytes(body).map_err(|e| FrameError::Decode(e.to_string()))
}

/// What the engine hands to the peer transport.
#[derive(Debug)]
pub struct Outbound {
    /// The destination replica's peer socket path.
    pub to: String,
    pub msg: PeerMsg,
}

/// What the peer transport hands to the engine.
#[derive(Debug)]
pub enum PeerEvent {
    /// A message from another replica; `reply` is set for `Done` (the Ack goes there).
    Msg {
        msg: PeerMsg,
        reply: Option<crate::peer::Reply>,
    },
    /// The destination's Ack to our `Done` of migration `id`.
    Ack(PeerMsg),
    /// Migration `id`'s batch or Done could not be delivered to `to`.
    SendFailed {
        id: u64,
        /// "batch", "done" or "fwd".
        what: &'static str,
        to: String,
        error: String,
    },
}

/// Counters of the migration machinery (exported in `stats.migration` and as metrics).
#[derive(Clone, Debug, Default, Serialize)]
pub struct MigrateStats {
    pub migrations_out: u64,
    pub migrations_out_failed: u64,
    pub flows_exported: u64,
    pub flows_export_failed: u64,
    pub busy_retries: u64,
    pub batches_in: u64,
    pub flows_imported: u64,
    pub flows_import_failed: u64,
    pub held_packets: u64,
    pub released_packets: u64,
    pub returned_packets: u64,
    /// Holds ended by `migrate_abort` (a migration rolled back before its switch).
    pub aborted_holds: u64,
    /// Packets refused because [`MAX_HELD_PACKETS`] were held (dropped, counted).
    pub hold_overflow: u64,
    pub forwarded_late: u64,
    /// Late packets that could not be forwarded (peer channel full or absent): dropped.
    pub forward_failed: u64,
    pub forwards_evicted: u64,
    /// Forwarded packets processed at the destination before the flow was released.
    pub late_reinjected: u64,
    /// Forwarded packets that arrived after the release (possibly reordered).
    pub late_after_release: u64,
    /// Forwarded packets for a key we forward ourselves (not forwarded twice: dropped).
    pub forward_loops: u64,
    pub peer_errors: u64,
    /// Exports that found frames this replica had emitted still in kernel queues (or waiting
    /// for a neighbour) and waited for them first: each is a move whose destination could
    /// otherwise have overtaken the source's last output.
    pub tx_settle_waits: u64,
    /// Longest such wait, microseconds.
    pub tx_settle_wait_us_max: u64,
    /// Exports that went ahead after [`TX_SETTLE_WAIT`] with output still queued: the order of
    /// that move's output is not guaranteed.
    pub tx_settle_timeouts: u64,
}

/// One held key at a destination.
pub(crate) struct Hold {
    pub since: Instant,
    /// Arrival of the first packet held for this key (None: none arrived yet).
    pub first_held: Option<Instant>,
}

/// One outgoing migration in progress at a source.
pub(crate) struct OutMig {
    pub id: u64,
    pub to: String,
    pub keys: Vec<FlowKey>,
    pub reply: Option<SyncSender<serde_json::Value>>,
    pub started: Instant,
    /// The engine's round counter when the request arrived: only a receive in a later round
    /// proves the rings were drained after it.
    pub start_round: u64,
    /// `CLOCK_REALTIME` (ns) when the request arrived: once both rings were read past it,
    /// every frame steered here before the switch was processed, drained round or not.
    pub request_ns: u64,
    /// `CLOCK_REALTIME` (ns) when the batch was shipped: `Done` waits until both rings were
    /// read past it (late packets queued before then are forwarded ahead of it).
    pub shipped_ns: u64,
    pub phase: Phase,
    /// Export records kept until the Ack (re-imported here if delivery fails).
    pub records: Vec<Vec<u8>>,
    /// Keys and aliases of exported flows.
    pub moved_keys: Vec<FlowKey>,
    pub moved: u64,
    /// `(key, why)` of flows that stayed here.
    pub failed: Vec<(FlowKey, String)>,
    /// Keys (and aliases) of flows that stayed here (busy/encode error).
    pub kept: Vec<FlowKey>,
    /// Time the export happened (the source-side part of the pause).
    pub exported_at: Option<Instant>,
    /// Time `Done` was queued for the destination (the Ack ends the migration).
    pub done_at: Option<Instant>,
    /// A flow was busy (refcount > 0) at an export attempt: retries are paced, not spun.
    pub busy_seen: bool,
    pub deadline: Instant,
    /// First round that found emitted output still queued in the kernel (see "Output order").
    pub settle_since: Option<Instant>,
    /// How long the export waited for that output, microseconds.
    pub settle_us: u64,
    /// `(round, per-port TX marks)` taken at the end of `round`: the moving flows' output up
    /// to then must leave the kernel before the export. Retaken only when one of the moving
    /// flows was worked on after `round` (so other flows' traffic cannot keep it moving).
    pub settle_mark: Option<(u64, [u64; 2])>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Waiting for a quiet round and refcounts 0.
    Draining,
    /// Batch sent; waiting for one more quiet round to send Done.
    Shipped,
    /// Done sent; waiting for the Ack.
    AwaitAck,
}

/// All migration state of one engine. Empty maps when nothing moves, so the packet path pays
/// one `is_empty()` check per frame.
#[derive(Default)]
pub(crate) struct Migration {
    pub holds: HashMap<FlowKey, Hold>,
    /// Held packets in arrival order, each with its arrival number (`held_packets` counted
    /// when it was held).
    pub held: VecDeque<(u64, crate::nf::Packet)>,
    /// Where migrated keys went (for late packets), with FIFO eviction order.
    pub forwards: HashMap<FlowKey, std::sync::Arc<str>>,
    pub forward_order: VecDeque<FlowKey>,
    /// Keys released at this destination (for `late_after_release`), bounded like `forwards`.
    pub released: HashSet<FlowKey>,
    pub released_order: VecDeque<FlowKey>,
    pub out: Vec<OutMig>,
    /// `peer_connect` requests waiting for their connection to come up.
    pub connecting: Vec<ConnectWait>,
    pub next_id: u64,
    /// Import results of batches waiting for their Done, by (source, migration id).
    #[allow(clippy::type_complexity)]
    pub pending_in: HashMap<(String, u64), (u64, Vec<(String, String)>, Vec<Vec<u8>>)>,
    pub stats: MigrateStats,
    pub pauses_us: VecDeque<u64>,
}

/// A `peer_connect` request whose connection is still being set up.
pub(crate) struct ConnectWait {
    pub to: String,
    pub reply: SyncSender<serde_json::Value>,
    pub started: Instant,
}

/// How long a `peer_connect` waits for its connection (a TCP connect, then a handshake).
pub const CONNECT_WAIT: Duration = Duration::from_secs(4);

/// Longest poll(2) sleep while an outgoing migration waits for its next round.
pub(crate) const PACED_ROUND_WAIT: Duration = Duration::from_millis(1);

impl Migration {
    /// How long the packet loop may sleep before the next round, as far as outgoing migrations
    /// are concerned (`None`: they impose no bound). A migration whose next step needs only one
    /// more receive (the first drain check, or `Done` after shipping) must not wait for the 1 ms
    /// poll timeout: on an idle source those two sleeps were most of the pause. One that waits
    /// for a busy flow or for the destination's Ack is paced instead of spinning.
    pub fn round_wait(&self) -> Option<Duration> {
        // A connection coming up wakes the loop itself (the handshake's eventfd); the pace
        // only bounds how late a `peer_connect` that never comes up is answered.
        let connecting = (!self.connecting.is_empty()).then_some(PACED_ROUND_WAIT);
        self.out
            .iter()
            .map(|m| match m.phase {
                Phase::Draining if !m.busy_seen => Duration::ZERO,
                Phase::Shipped => Duration::ZERO,
                _ => PACED_ROUND_WAIT,
            })
            .chain(connecting)
            .min()
    }

    /// True when a frame may need diverting (held or forwarded).
    #[inline]
    pub fn active(&self) -> bool {
        !self.holds.is_empty() || !self.forwards.is_empty()
    }

    pub fn remember_forward(&mut self, key: FlowKey, to: std::sync::Arc<str>) {
        if self.forwards.insert(key, to).is_none() {
            self.forward_order.push_back(key);
        }
        while self.forwards.len() > MAX_FORWARDS {
            let Some(old) = self.forward_order.pop_front() else {
                break;
            };
            if self.forwards.remove(&old).is_some() {
                self.stats.forwards_evicted += 1;
            }
        }
        // The order queue may hold keys already removed; keep it from growing without bound.
        if self.forward_order.len() > 2 * MAX_FORWARDS {
            let live = &self.forwards;
            self.forward_order.retain(|k| live.contains_key(k));
        }
    }

    pub fn remember_released(&mut self, key: FlowKey) {
        if self.released.insert(key) {
            self.released_order.push_back(key);
        }
        while self.released.len() > MAX_FORWARDS {
            let Some(old) = self.released_order.pop_front() else {
                break;
            };
            self.released.remove(&old);
        }
    }

    pub fn record_pause(&mut self, us: u64) {
        if self.pauses_us.len() >= MAX_PAUSE_SAMPLES {
            self.pauses_us.pop_front();
        }
        self.pauses_us.push_back(us);
    }

    /// `(p50, p99, max)` of the recent pause samples, microseconds.
    pub fn pause_percentiles(&self) -> (u64, u64, u64) {
        percentiles(self.pauses_us.iter().copied().collect())
    }
}

/// `(p50, p99, max)` of `v` (nearest rank); zeros when empty.
pub fn percentiles(mut v: Vec<u64>) -> (u64, u64, u64) {
    if v.is_empty() {
        return (0, 0, 0);
    }
    v.sort_unstable();
    let rank = |p: f64| {
        let i = ((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
        v[i]
    };
    (rank(0.50), rank(0.99), v[v.len() - 1])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_round_trip_and_bad_bodies_are_refused() {
        let (k, _) = FlowKey::v4(6, [10, 0, 0, 1].into(), 1, [10, 0, 0, 2].into(), 2);
        let msgs = [
            PeerMsg::Batch {
                id: 7,
                from: "r1".into(),
                records: vec![vec![1, 2, 3], vec![]],
            },
            PeerMsg::Fwd {
                key: k,
                pkt: WirePacket::new(Side::Outside, &Offload::NONE, vec![9; 60]),
            },
            PeerMsg::Done {
                id: 7,
                from: "r1".into(),
                release: vec![k],
                kept: vec![],
            },
        ];
        for m in &msgs {
            assert_eq!(&decode_body(&encode_body(m).unwrap()).unwrap(), m);
        }
        // Garbage is a decode error, never a panic.
        for junk in [&[][..], &[0xff, 0xff, 0xff], &[3, 0, 0, 0, 9]] {
            assert!(matches!(decode_body(junk), Err(FrameError::Decode(_))));
        }
    }

    #[test]
    fn percentiles_use_nearest_rank() {
        assert_eq!(percentiles(vec![]), (0, 0, 0));
        assert_eq!(percentiles((1..=100).collect()), (50, 99, 100));
        assert_eq!(percentiles(vec![5]), (5, 5, 5));
    }

    #[test]
    fn forward_memory_is_bounded() {
        let mut m = Migration::default();
        let to: std::sync::Arc<str> = "x".into();
        for i in 0..(MAX_FORWARDS as u32 + 10) {
            let (k, _) = FlowKey::v4(17, std::net::Ipv4Addr::from(i), 1, [10, 0, 0, 2].into(), 2);
            m.remember_forward(k, to.clone());
        }
        assert_eq!(m.forwards.len(), MAX_FORWARDS);
        assert_eq!(m.stats.forwards_evicted, 10);
    }

    fn out_mig(phase: Phase, busy_seen: bool) -> OutMig {
        let now = Instant::now();
        OutMig {
            id: 1,
            to: "d".into(),
            keys: Vec::new(),
            reply: None,
            started: now,
            start_round: 0,
            request_ns: 0,
            shipped_ns: 0,
            phase,
            records: Vec::new(),
            moved_keys: Vec::new(),
            moved: 0,
            failed: Vec::new(),
            kept: Vec::new(),
            exported_at: None,
            done_at: None,
            busy_seen,
            deadline: now,
            settle_since: None,
            settle_us: 0,
            settle_mark: None,
        }
    }

    #[test]
    fn round_wait_spins_only_for_steps_one_receive_away() {
        let mut m = Migration::default();
        assert_eq!(m.round_wait(), None, "no migration: no bound");
        m.out.push(out_mig(Phase::AwaitAck, false));
        assert_eq!(m.round_wait(), Some(PACED_ROUND_WAIT));
        m.out.push(out_mig(Phase::Draining, true));
        assert_eq!(
            m.round_wait(),
            Some(PACED_ROUND_WAIT),
            "busy flows are paced"
        );
        m.out.push(out_mig(Phase::Shipped, false));
        assert_eq!(m.round_wait(), Some(Duration::ZERO));
        m.out.clear();
        m.out.push(out_mig(Phase::Draining, false));
        assert_eq!(m.round_wait(), Some(Duration::ZERO));
    }
}
