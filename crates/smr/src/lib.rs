//! pliant-smr: state machine replication of an unmodified TCP service by ordering its input.
//!
//! Every client event of the service (connect, bytes, close, reset) is proposed by the leader
//! to Raft (tikv's `raft` crate), made durable in each replica's log, and once committed
//! delivered in log order to each replica's own copy of the server over local TCP, one local
//! connection per client connection. The leader's server answers the clients; the followers'
//! output is hashed per connection so replicas can be compared.
//!
//! - [`event`]: the log entry's payload (connection id, kind, bytes).
//! - [`log`]: the durable log, framed and checksummed, batched fsync, torn tails cut.
//! - [`deliver`]: the pure decisions (exactly-once in-order admission, connection table).
//! - [`node`]: the Raft thread.
//! - [`transport`]: Raft messages over pliant-wire.
//! - [`apply`]: committed entries into the server; output hashing and forwarding.
//! - [`front`]: the client listener (leader only).
//! - [`child`]: the server as a child process.
//! - [`replica`]: all of the above for one replica.
//! - `rlog`: raft's slog records forwarded to `tracing`.
//! - [`group`]: replicas and their server children in one process (tests, benchmark).
//! - [`bench`]: `pliant bench smr`, against Redis alone and Redis's own replication.

pub mod apply;
pub mod bench;
pub mod child;
pub mod deliver;
pub mod event;
pub mod front;
pub mod group;
pub mod log;
pub mod node;
pub mod replica;
mod rlog;
pub mod transport;

pub use replica::{Config, Limits, Replica, ReplicaError};
pub use transport::PeerSpec;

use pliant_wire::endpoint::Stream;
use pliant_wire::server::{ConnThreads, SpawnRefused};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

/// A lock that a panicked thread does not poison for the others (a panicking connection
/// thread must not take the replica down with it).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Serves `stream` on a connection thread of `conns`, unless `max` are open: then the stream
/// is closed and counted in `over`. Both listeners (peers, clients) accept this way.
pub(crate) fn spawn_bounded(
    conns: &ConnThreads,
    stream: Stream,
    max: usize,
    name: &str,
    over: &AtomicU64,
    serve: impl FnOnce(Stream) + Send + 'static,
) -> std::ops::ControlFlow<()> {
    match conns.spawn(stream, max, name, serve) {
        Ok(()) => {}
        Err(SpawnRefused::OverBound(_)) => {
            over.fetch_add(1, Ordering::Relaxed);
        }
        Err(e) => tracing::warn!(?e, "{name}: connection not served"),
    }
    std::ops::ControlFlow::Continue(())
}
