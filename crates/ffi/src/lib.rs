//! pliant's C ABI: the Split/Merge state API (flows, timers, coherent shared state,
//! export/import) plus `pkt_read` / `pkt_write` / `pkt_write_direct`, for network functions
//! written in C against `include/pliant.h` (generated from this crate by cbindgen).
//!
//! Shape: the C program owns its main loop. `pliant_open(config)` builds a replica (ports,
//! router role, control socket) whose NF is an adapter ([`adapter::CAdapter`]) that only queues
//! packets and expired timers; `pliant_pkt_read` runs engine rounds until a packet is queued
//! and dispatches expired timers to the C callback between rounds, outside any engine call.
//! `pliant_open_mem` does the same with in-memory ports and a fake clock, for tests.
//!
//! Safety rules kept at every entry point ([`api`]): no panic unwinds into C (each call runs
//! under `catch_unwind`; a panic poisons the context, later calls return `PLIANT_EPANIC`);
//! every pointer is null-checked; misuse that can be detected (double put, writing a packet
//! twice, a packet of another context, re-entering `pkt_read` from a timer callback) is an
//! error code with a message in `pliant_last_error`, never undefined behaviour.

pub mod adapter;
pub mod api;
pub mod combiner;
mod ctx;
pub mod labels;
pub mod port;
pub mod slice;

pub use api::*;
pub use combiner::PliantCombinerFn;
pub use ctx::{PliantCtx, PliantPkt};
pub use slice::PliantSliceHold;

use std::os::raw::c_int;

/// Success.
pub const PLIANT_OK: c_int = 0;
/// No such flow, shared key, counter, config entry or queued frame.
pub const PLIANT_ENOTFOUND: c_int = -1;
/// The flow was exported from this instance (it lives elsewhere now).
pub const PLIANT_EMIGRATED: c_int = -2;
/// The flow or shared key already exists.
pub const PLIANT_EEXIST: c_int = -3;
/// A transaction is open (refcount > 0), or the call is not allowed right now.
pub const PLIANT_EBUSY: c_int = -4;
/// A bound was hit (flow table, timers per flow, open references, packets held, queues).
pub const PLIANT_EFULL: c_int = -5;
/// Bad argument: null pointer, invalid string, unknown flag, a packet not held by the caller.
pub const PLIANT_EINVAL: c_int = -6;
/// The caller's buffer is too small; the needed length was stored.
pub const PLIANT_ENOSPC: c_int = -7;
/// `pliant_pkt_read`: no packet arrived within the timeout.
pub const PLIANT_ETIMEDOUT: c_int = -8;
/// `pliant_pkt_read`: the replica was asked to stop (SIGTERM/SIGINT, `pliant_stop`, or a
/// `shutdown` control request).
pub const PLIANT_ESTOPPED: c_int = -9;
/// An exported record was refused (corrupt, truncated, other format version).
pub const PLIANT_EDECODE: c_int = -10;
/// Shared state used in a mode its consistency does not allow (e.g. PULL on a SYNCH key).
pub const PLIANT_EMODE: c_int = -11;
/// Shared key locked by another replica, or its lease was lost.
pub const PLIANT_ELOCKED: c_int = -12;
/// Set-up or I/O failure (config file, interfaces, sockets, coherence transport).
pub const PLIANT_EIO: c_int = -13;
/// `pliant_put_flow` / `pliant_put_shared` without an open `get` for that key.
pub const PLIANT_ENOTOPEN: c_int = -14;
/// An internal error (a bug in pliant); the context refuses further calls except close.
pub const PLIANT_EPANIC: c_int = -15;

/// Port towards the clients.
pub const PLIANT_SIDE_INSIDE: c_int = 0;
/// Port towards the servers.
pub const PLIANT_SIDE_OUTSIDE: c_int = 1;

/// Packet travels from the key's `lo` endpoint to its `hi` endpoint.
pub const PLIANT_DIR_LO_TO_HI: c_int = 0;
/// Packet travels from the key's `hi` endpoint to its `lo` endpoint.
pub const PLIANT_DIR_HI_TO_LO: c_int = 1;

/// `pliant_get_shared`: this replica's contribution / copy only.
pub const PLIANT_GET_LOCAL: c_int = 0;
/// `pliant_get_shared`: combine the other replicas' published contributions into the view.
pub const PLIANT_GET_PULL: c_int = 1;
/// `pliant_get_shared`: strong consistency (lock, newest copy); keys without a combiner.
pub const PLIANT_GET_SYNCH: c_int = 2;
/// `pliant_put_shared`: keep the change local.
pub const PLIANT_PUT_LOCAL: c_int = 0;
/// `pliant_put_shared`: publish this replica's contribution.
pub const PLIANT_PUT_PUSH: c_int = 1;
/// `pliant_put_shared`: publish the strong copy and release the lock.
pub const PLIANT_PUT_SYNCH: c_int = 2;

/// A direction-normalised 5-tuple, the key of all per-flow state (same layout as
/// `pliant_state::FlowKey`). IPv4 addresses are stored IPv4-mapped (`::ffff:a.b.c.d`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PliantFlowKey {
    /// 4 or 6.
    pub family: u8,
    /// IP protocol number.
    pub proto: u8,
    /// Port (or ICMP echo identifier) of the lower endpoint, host byte order.
    pub port_lo: u16,
    /// Port (or ICMP echo identifier) of the higher endpoint, host byte order.
    pub port_hi: u16,
    pub addr_lo: [u8; 16],
    pub addr_hi: [u8; 16],
}

impl From<pliant_state::FlowKey> for PliantFlowKey {
    fn from(k: pliant_state::FlowKey) -> Self {
        PliantFlowKey {
            family: k.family,
            proto: k.proto,
            port_lo: k.port_lo,
            port_hi: k.port_hi,
            addr_lo: k.addr_lo,
            addr_hi: k.addr_hi,
        }
    }
}

impl From<PliantFlowKey> for pliant_state::FlowKey {
    fn from(k: PliantFlowKey) -> Self {
        pliant_state::FlowKey {
            family: k.family,
            proto: k.proto,
            port_lo: k.port_lo,
            port_hi: k.port_hi,
            addr_lo: k.addr_lo,
            addr_hi: k.addr_hi,
        }
    }
}

/// An open transaction on a shared key, filled by `pliant_get_shared`. Both pointers stay valid
/// until the matching `pliant_put_shared`.
#[repr(C)]
#[derive(Debug)]
pub struct PliantShared {
    /// What to read: for PULL the combined view of all replicas, otherwise this replica's copy.
    pub view: *const u8,
    pub view_len: usize,
    /// This replica's contribution (combiner keys) or copy (SYNCH keys), writable in place.
    pub value: *mut u8,
    pub value_len: usize,
}

/// Called for each expired flow timer, from inside `pliant_pkt_read` / `pliant_mem_advance`
/// but outside any engine call: it may call every API function except `pliant_pkt_read`,
/// `pliant_mem_advance`, `pliant_flush` and `pliant_close`.
pub type PliantTimerFn = Option<
    unsafe extern "C" fn(
        ctx: *mut PliantCtx,
        key: *const PliantFlowKey,
        timer_id: u32,
        user: *mut std::os::raw::c_void,
    ),
>;

#[cfg(test)]
mod tests;
