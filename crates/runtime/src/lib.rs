//! pliant-runtime: the replica process (SKELETON: the NF contract; the engine is being written).
//!
//! Packet path: port (pliant-io ring) -> parse (pliant-net) -> ARP/neighbour handling (never seen
//! by the NF) -> `NetworkFunction::process` with a [`Ctx`] -> `pkt_write` / `pkt_write_direct` ->
//! routing to the egress side (MAC rewrite, TTL) -> port.

pub mod config;
pub mod nf;

pub use nf::{Ctx, NetworkFunction, Packet, Side};
pub use pliant_net as net;
pub use pliant_state as state;
