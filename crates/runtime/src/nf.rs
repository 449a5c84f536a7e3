//! The contract between the runtime and a network function.

use pliant_io::Offload;
use pliant_net::{FlowKey, Parsed};
use pliant_state::{FlowState, FlowTable, SharedStore, TimerId};
use std::time::Instant;

/// The replica's two ports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Side {
    /// Towards the clients (the protected/private network).
    Inside,
    /// Towards the servers (the public network).
    Outside,
}

impl Side {
    pub fn opposite(self) -> Side {
        match self {
            Side::Inside => Side::Outside,
            Side::Outside => Side::Inside,
        }
    }
}

/// One IP frame handed to the NF. The NF owns it and must pass it to exactly one of
/// `Ctx::pkt_write`, `Ctx::pkt_write_direct` or `Ctx::pkt_drop`.
pub struct Packet {
    /// The whole Ethernet frame (owned; recycled by the runtime).
    pub buf: Vec<u8>,
    /// Port the frame arrived on.
    pub ingress: Side,
    /// Port the frame leaves by; defaults to the opposite of `ingress`.
    pub egress: Side,
    /// Parse result; rewrite helpers keep it in sync with `buf`.
    pub meta: Parsed,
    /// Checksum/segmentation offload state of the frame (ports with `vnet_hdr`). NFs leave it
    /// alone: when `offload.csum_partial` is set, the L4 checksum field is not meaningful (the
    /// runtime rewrites it from the final headers on output and the peer completes it), and
    /// `offload.gso` marks a TCP/UDP super-frame larger than the MTU, segmented after output.
    pub offload: Offload,
}

impl Packet {
    /// A packet that arrived on `ingress`, leaving by the opposite side, without offloads.
    pub fn new(buf: Vec<u8>, ingress: Side, meta: Parsed) -> Packet {
        Packet {
            buf,
            ingress,
            egress: ingress.opposite(),
            meta,
            offload: Offload::NONE,
        }
    }

    pub fn key(&self) -> FlowKey {
        self.meta.key
    }
    /// L4 payload (without Ethernet padding).
    pub fn payload(&self) -> &[u8] {
        let off = self.meta.payload_off as usize;
        let end = (off + self.meta.payload_len as usize).min(self.buf.len());
        &self.buf[off.min(end)..end]
    }
}

/// How a packet left the NF: the seam where Pico replication will hold `pkt_write` output per
/// replication group until that group's checkpoint is acknowledged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputKind {
    /// `pkt_write(key, ..)`: output that depends on the state of flow `key`.
    Stateful(FlowKey),
    /// `pkt_write_direct(..)`: exempt from output buffering by design.
    Direct,
}

/// One packet written by the NF, waiting for the runtime to route it to its egress port.
pub struct Output {
    pub pkt: Packet,
    pub kind: OutputKind,
}

/// A bounded set of named counters keyed by `&'static str` labels. NFs use a handful of stable
/// labels, so a linear scan over a short vector beats hashing on the hot path; the bound keeps
/// a buggy NF that invents labels from growing memory (excess labels land in `overflow`,
/// reported under [`Counters::OVERFLOW_LABEL`] so every increment shows up somewhere).
#[derive(Clone, Debug, Default)]
pub struct Counters {
    entries: Vec<(&'static str, u64)>,
    /// Increments whose label did not fit under [`Counters::MAX_LABELS`].
    pub overflow: u64,
}

impl Counters {
    /// Bound on distinct labels per counter set.
    pub const MAX_LABELS: usize = 128;
    /// The label [`Counters::snapshot`] reports `overflow` under.
    pub const OVERFLOW_LABEL: &'static str = "other";

    pub fn add(&mut self, name: &'static str, n: u64) {
        // Pointer equality first: labels are almost always the same literal.
        if let Some(e) = self
            .entries
            .iter_mut()
            .find(|(k, _)| std::ptr::eq(*k, name) || *k == name)
        {
            e.1 = e.1.saturating_add(n);
            return;
        }
        if self.entries.len() >= Self::MAX_LABELS {
            self.overflow = self.overflow.saturating_add(n);
            return;
        }
        self.entries.push((name, n));
    }

    pub fn get(&self, name: &str) -> u64 {
        self.entries
            .iter()
            .find(|(k, _)| *k == name)
            .map_or(0, |e| e.1)
    }

    /// All `(label, value)` pairs, sorted by label (stable output for metrics and tests), with
    /// the increments past the label bound under [`Counters::OVERFLOW_LABEL`] (added to it if
    /// that label is in use), so the values sum to [`Counters::total`].
    pub fn snapshot(&self) -> Vec<(&'static str, u64)> {
        let mut v = self.entries.clone();
        if self.overflow > 0 {
            match v.iter_mut().find(|(k, _)| *k == Self::OVERFLOW_LABEL) {
                Some(e) => e.1 = e.1.saturating_add(self.overflow),
                None => v.push((Self::OVERFLOW_LABEL, self.overflow)),
            }
        }
        v.sort_unstable_by_key(|e| e.0);
        v
    }

    pub fn total(&self) -> u64 {
        self.entries
            .iter()
            .map(|e| e.1)
            .sum::<u64>()
            .saturating_add(self.overflow)
    }
}

/// What an NF sees of the runtime while it processes one packet or timer.
pub struct Ctx<S> {
    /// Partitioned per-flow state (the Split/Merge API).
    pub flows: FlowTable<S>,
    /// Coherent shared state.
    pub shared: SharedStore,
    pub(crate) now: Instant,
    /// Packets written since the runtime last drained (bounded by `max_output`).
    pub(crate) out: Vec<Output>,
    pub(crate) max_output: usize,
    /// Drops by reason: NF drops (`pkt_drop`) and the runtime's own (parse errors, routing...).
    pub(crate) drops: Counters,
    /// NF-specific counters (`count`).
    pub(crate) nf_counters: Counters,
    /// Frame buffers handed back by drops, reused for received frames (bounded).
    pub(crate) spare_bufs: Vec<Vec<u8>>,
}

/// Drop reason used when the NF writes more packets in one round than the output queue holds.
pub const DROP_OUTPUT_FULL: &str = "output_queue_full";

impl<S: FlowState> Ctx<S> {
    /// Default bound on packets written between two drains of the output queue.
    pub const DEFAULT_MAX_OUTPUT: usize = 4096;
    /// Bound on recycled frame buffers kept for reuse.
    const MAX_SPARE_BUFS: usize = 256;

    pub fn new(flows: FlowTable<S>, shared: SharedStore, now: Instant) -> Self {
        Ctx {
            flows,
            shared,
            now,
            out: Vec::with_capacity(256),
            max_output: Self::DEFAULT_MAX_OUTPUT,
            drops: Counters::default(),
            nf_counters: Counters::default(),
            spare_bufs: Vec::new(),
        }
    }

    pub fn now(&self) -> Instant {
        self.now
    }

    /// Sets the runtime's notion of the current time (the engine does it once per round; the
    /// test harness on `advance`).
    pub fn set_now(&mut self, now: Instant) {
        self.now = now;
        // The shared store times SYNCH lock leases with it.
        self.shared.set_now(now);
    }

    /// Output that depends on the state of flow `key` (Pico replication holds it until that
    /// flow's group checkpoint is acknowledged; without HA it leaves at the end of the batch).
    pub fn pkt_write(&mut self, key: &FlowKey, pkt: Packet) {
        self.push_output(Output {
            pkt,
            kind: OutputKind::Stateful(*key),
        });
    }

    /// Output that bypasses output buffering by design.
    pub fn pkt_write_direct(&mut self, pkt: Packet) {
        self.push_output(Output {
            pkt,
            kind: OutputKind::Direct,
        });
    }

    fn push_output(&mut self, o: Output) {
        if self.out.len() >= self.max_output {
            self.pkt_drop(o.pkt, DROP_OUTPUT_FULL);
            return;
        }
        self.out.push(o);
    }

    /// Drops a packet, counted under `reason` (a stable snake_case label).
    pub fn pkt_drop(&mut self, pkt: Packet, reason: &'static str) {
        self.drops.add(reason, 1);
        self.recycle(pkt.buf);
    }

    /// Counts a drop of something that never became a [`Packet`] (runtime use).
    pub fn count_drop(&mut self, reason: &'static str, n: u64) {
        self.drops.add(reason, n);
    }

    /// Adds to an NF-specific counter exported as `pliant_nf_<name>_total`.
    pub fn count(&mut self, name: &'static str, n: u64) {
        self.nf_counters.add(name, n);
    }

    /// Drops by reason so far.
    pub fn drops(&self) -> &Counters {
        &self.drops
    }

    /// NF counters so far.
    pub fn nf_counters(&self) -> &Counters {
        &self.nf_counters
    }

    /// Moves the written packets out (in write order) into `dst`.
    pub fn drain_output(&mut self, dst: &mut Vec<Output>) {
        dst.append(&mut self.out);
    }

    /// Hands a frame buffer back for reuse.
    pub fn recycle(&mut self, mut buf: Vec<u8>) {
        if self.spare_bufs.len() < Self::MAX_SPARE_BUFS {
            buf.clear();
            self.spare_bufs.push(buf);
        }
    }

    /// A cleared buffer (recycled if one is available).
    pub fn take_buf(&mut self) -> Vec<u8> {
        self.spare_bufs
            .pop()
            .unwrap_or_else(|| Vec::with_capacity(2048))
    }
}

/// A network function written on the Split/Merge API.
pub trait NetworkFunction: Send + 'static {
    /// Per-flow state kept in the state library.
    type Flow: FlowState;
    /// Short name used in config (`nf = "nat"`), logs and metrics.
    const NAME: &'static str;

    /// Processes one IP packet (ARP and malformed frames never reach the NF).
    fn process(&mut self, ctx: &mut Ctx<Self::Flow>, pkt: Packet);

    /// A flow timer armed with `ctx.flows.flow_timer` expired.
    fn on_timer(&mut self, ctx: &mut Ctx<Self::Flow>, key: FlowKey, timer: TimerId) {
        let _ = (ctx, key, timer);
    }

    /// Assigns the external port blocks this replica may allocate from (`set_port_blocks`
    /// control request, `[nat] port_blocks`). Only NFs that allocate ports implement it.
    fn set_port_blocks(
        &mut self,
        ctx: &mut Ctx<Self::Flow>,
        blocks: &[(u16, u16)],
    ) -> Result<serde_json::Value, String> {
        let _ = (ctx, blocks);
        Err(format!("the {} NF allocates no ports", Self::NAME))
    }

    /// A flow was installed from another replica's export record (live migration, or
    /// activation of standby state after a failover); `key` is its primary key. NFs that own
    /// per-replica resources named in flow state (NAT: the external port) mark them in use
    /// here, so the imported flow never shares one with a new local flow.
    fn on_import(&mut self, ctx: &mut Ctx<Self::Flow>, key: FlowKey) {
        let _ = (ctx, key);
    }

    /// Every flow was just deleted from the table at once, unseen by the NF (a replica
    /// rejoining after a partition: its flows failed over and live on elsewhere). NFs that
    /// account per-replica resources named in flow state rebuild that accounting from the
    /// table; resources the deleted flows still use elsewhere must stay reserved here (NAT:
    /// their external ports, in this replica's blocks, are now lent).
    fn on_flows_dropped(&mut self, ctx: &mut Ctx<Self::Flow>) {
        let _ = ctx;
    }

    /// NF-specific state for `pliant query` (e.g. IDS counts and alerts), as JSON.
    fn query(&self, ctx: &Ctx<Self::Flow>) -> serde_json::Value {
        let _ = ctx;
        serde_json::Value::Null
    }
}
