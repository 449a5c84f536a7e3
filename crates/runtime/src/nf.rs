//! The contract between the runtime and a network function.

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
}

impl Packet {
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

/// What an NF sees of the runtime while it processes one packet or timer.
pub struct Ctx<S> {
    /// Partitioned per-flow state (the Split/Merge API).
    pub flows: FlowTable<S>,
    /// Coherent shared state.
    pub shared: SharedStore,
    pub(crate) now: Instant,
}

impl<S: FlowState> Ctx<S> {
    pub fn now(&self) -> Instant {
        self.now
    }
    /// Output that depends on the state of flow `key` (Pico replication holds it until that
    /// flow's group checkpoint is acknowledged; without HA it leaves at the end of the batch).
    pub fn pkt_write(&mut self, key: &FlowKey, pkt: Packet) {
        let _ = (key, pkt);
        todo!()
    }
    /// Output that bypasses output buffering by design.
    pub fn pkt_write_direct(&mut self, pkt: Packet) {
        let _ = pkt;
        todo!()
    }
    /// Drops a packet, counted under `reason` (a stable snake_case label).
    pub fn pkt_drop(&mut self, pkt: Packet, reason: &'static str) {
        let _ = (pkt, reason);
        todo!()
    }
    /// Adds to an NF-specific counter exported as `pliant_nf_<name>_total`.
    pub fn count(&mut self, name: &'static str, n: u64) {
        let _ = (name, n);
        todo!()
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

    /// NF-specific state for `pliant query` (e.g. IDS counts and alerts), as JSON.
    fn query(&self, ctx: &Ctx<Self::Flow>) -> serde_json::Value {
        let _ = ctx;
        serde_json::Value::Null
    }
}
