//! pliant-runtime: the replica process.
//!
//! Packet path: port (pliant-io ring) -> parse (pliant-net) -> ARP/neighbour handling (never seen
//! by the NF) -> `NetworkFunction::process` with a [`Ctx`] -> `pkt_write` / `pkt_write_direct` ->
//! routing to the egress side (MAC rewrite, TTL) -> port.
//!
//! Modules, in packet order: [`engine`] (the packet thread), [`neigh`] (ARP cache), [`route`]
//! (next hops), [`nf`] (the NF contract and `Ctx`), [`metrics`], [`control`] (control socket),
//! [`kernel`] (keeps the namespace's kernel off the runtime's interfaces), [`config`],
//! [`replica`] (start-up and shutdown of a whole replica), [`forward`] (the trivial NF),
//! [`testing`] (NF test harness).

pub mod config;
pub mod control;
pub mod engine;
pub mod forward;
pub mod ftmb;
pub mod ha;
pub mod kernel;
pub mod logging;
pub mod metrics;
pub mod migrate;
pub mod migrate_client;
pub mod neigh;
pub mod nf;
pub mod peer;
pub mod ratelimit;
pub mod replica;
pub mod route;
pub mod sched;
pub mod testing;

pub use nf::{Counters, Ctx, NetworkFunction, Output, OutputKind, Packet, Side};
pub use pliant_net as net;
pub use pliant_state as state;
