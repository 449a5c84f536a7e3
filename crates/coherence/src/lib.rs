//! pliant-coherence: coherent shared state across replica *processes* (seed 000 ch. 3).
//!
//! `pliant_state::SharedStore` implements the shared-state API (combiners, PULL/PUSH, SYNCH)
//! against two traits, [`Coherence`](pliant_state::Coherence) and
//! [`LockService`](pliant_state::LockService). `pliant_state::LocalCoherence` implements them
//! for stores in one process; this crate implements them across processes:
//!
//! - [`HubServer`]: a hub on a pliant-wire endpoint (a unix socket, 0600 and same uid, or TCP)
//!   holding every replica's published combiner contributions, the newest copy of each strong
//!   key and the lease locks. It wraps a `LocalCoherence`, so the semantics are the in-process
//!   ones; the hub's own monotonic clock runs the leases.
//! - [`HubClient`]: one replica's connection to it, used by that replica's `SharedStore`.
//! - [`store_for`]: builds a replica's `SharedStore` on a hub from its endpoint and the
//!   replica's identity.
//! - [`run_hub_until_signal`]: the body of `pliant hub`.
//!
//! Every connection is a pliant-wire session: both ends prove a certificate of the
//! deployment's CA (the hub the service role, a client the replica role), and every frame is
//! sealed (kind `pliant_wire::kinds::HUB`). Why not the shared secret it used before: with one
//! secret every holder can claim to be any replica, and the hub cannot tell who publishes; a
//! certificate names the one replica a connection may speak for.
//!
//! Wire protocol: [`wire`]. Design notes and measurements: the crate's README.md.

pub mod client;
pub mod server;
pub mod wire;

pub use client::{ClientOptions, ClientStats, HubClient};
pub use server::{HubConfig, HubServer, HubStats};

use pliant_state::{ReplicaId, SharedConfig, SharedStore};
use pliant_wire::{Endpoint, Security};
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum CoherenceError {
    #[error("hub listener: {0}")]
    Bind(#[from] pliant_wire::BindError),
    #[error("hub listener {ep}: {source}")]
    Io {
        ep: Endpoint,
        source: std::io::Error,
    },
    #[error("cannot start a hub thread: {0}")]
    Spawn(std::io::Error),
    #[error(
        "hub identity {name:?} lacks the service role, so replicas would refuse it (issue one \
         with `pliant keys issue --role service`)"
    )]
    NotAService { name: String },
    #[error(
        "replica {replica:?} holds the identity of {certified:?}, and the hub accepts a replica \
         only as the one its certificate names (issue it an identity named {replica:?})"
    )]
    NotCertified { replica: String, certified: String },
    #[error("signal handling: {0}")]
    Signal(std::io::Error),
    #[error("replica name {0:?}: must be 1..=255 bytes")]
    BadName(String),
}

/// The replica id a replica named `name` uses on a hub: the number itself for an all-digit
/// name that fits in a u32, else the 32-bit FNV-1a hash of the name. Stable across restarts
/// (a restarted replica keeps its id, so its published contributions stay its own). Two names
/// that map to one id are detected by the hub, which refuses the second (`id_refused`).
pub fn replica_id_for_name(name: &str) -> ReplicaId {
    if !name.is_empty() && name.bytes().all(|b| b.is_ascii_digit()) {
        if let Ok(n) = name.parse::<u32>() {
            return n;
        }
    }
    let mut h: u32 = 0x811c_9dc5;
    for b in name.bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h
}

/// A `SharedStore` for replica `replica` (a name or a decimal id, see
/// [`replica_id_for_name`]) whose coherence transport and lock service is the hub at `hub`,
/// authenticated with the replica's identity `sec`, which must be certified for `replica`
/// (the hub files contributions and locks under the certified name only).
///
/// Connects once at once so a refused identity or a missing hub shows in the log at start-up;
/// the store still works if the hub comes up later (the client reconnects on use).
pub fn store_for(
    replica: &str,
    hub: &Endpoint,
    sec: Security,
    cfg: SharedConfig,
) -> Result<SharedStore, CoherenceError> {
    store_with_options(replica, hub, sec, cfg, ClientOptions::default()).map(|(s, _)| s)
}

/// [`store_for`] with client options; also returns the client (for its stats).
pub fn store_with_options(
    replica: &str,
    hub: &Endpoint,
    sec: Security,
    cfg: SharedConfig,
    opts: ClientOptions,
) -> Result<(SharedStore, Arc<HubClient>), CoherenceError> {
    if replica.is_empty() || replica.len() > wire::MAX_NAME_BYTES {
        return Err(CoherenceError::BadName(replica.to_string()));
    }
    if sec.name() != replica {
        return Err(CoherenceError::NotCertified {
            replica: replica.to_string(),
            certified: sec.name().to_string(),
        });
    }
    let client = Arc::new(HubClient::new(hub, sec, opts));
    let id = client.replica();
    if let Err(e) = client.connect_now() {
        tracing::warn!(error = %e, "coherence hub not reachable yet; will retry on use");
    }
    let store = SharedStore::new(id, cfg, client.clone(), client.clone());
    Ok((store, client))
}

/// Runs a hub at `ep` with the identity `sec` (service role) until SIGTERM or SIGINT, then
/// stops it (connections closed, a unix socket unlinked) and returns its final counters.
///
/// The signal handler only writes a byte to a pipe the calling thread waits on (async-signal
/// safe, and it works whichever thread the kernel picks to take the signal). The previous
/// dispositions are restored before returning.
pub fn run_hub_until_signal(
    ep: &Endpoint,
    sec: Security,
    cfg: HubConfig,
) -> Result<HubStats, CoherenceError> {
    let guard = signals::TermSignals::install()?;
    let server = HubServer::start(ep, sec, cfg)?;
    let sig = guard.wait()?;
    tracing::info!(signal = sig, "coherence hub stopping");
    let stats = server.stats();
    drop(server);
    Ok(stats)
}

mod signals {
    use super::CoherenceError;
    use std::io;
    use std::sync::atomic::{AtomicI32, Ordering};

    /// Write end of the self-pipe the handler signals through (-1: no handler installed).
    static PIPE_W: AtomicI32 = AtomicI32::new(-1);

    extern "C" fn on_signal(sig: libc::c_int) {
        let fd = PIPE_W.load(Ordering::SeqCst);
        if fd >= 0 {
            // The signal number fits in a byte for SIGTERM/SIGINT.
            let b = sig as u8;
            // SAFETY: write(2) is async-signal-safe; `b` lives for the call. A full pipe
            // (signals faster than the waiter reads) just drops the byte: one is enough.
            unsafe { libc::write(fd, (&b as *const u8).cast(), 1) };
        }
    }

    /// SIGTERM/SIGINT handlers that wake [`TermSignals::wait`]; Drop restores the old ones.
    pub(super) struct TermSignals {
        r: libc::c_int,
        w: libc::c_int,
        old: [(libc::c_int, libc::sigaction); 2],
    }

    const SIGNALS: [libc::c_int; 2] = [libc::SIGTERM, libc::SIGINT];

    impl TermSignals {
        pub(super) fn install() -> Result<TermSignals, CoherenceError> {
            let err = |_: ()| CoherenceError::Signal(io::Error::last_os_error());
            let mut fds = [-1; 2];
            // SAFETY: `fds` has room for two descriptors.
            if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
                return Err(err(()));
            }
            // The handler must never block: make the write end non-blocking.
            // SAFETY: fds[1] is a descriptor we own.
            unsafe {
                let fl = libc::fcntl(fds[1], libc::F_GETFL);
                libc::fcntl(fds[1], libc::F_SETFL, fl | libc::O_NONBLOCK);
            }
            if PIPE_W
                .compare_exchange(-1, fds[1], Ordering::SeqCst, Ordering::SeqCst)
                .is_err()
            {
                // SAFETY: closing descriptors we own.
                unsafe {
                    libc::close(fds[0]);
                    libc::close(fds[1]);
                }
                return Err(CoherenceError::Signal(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    "a hub already waits for signals in this process",
                )));
            }
            // SAFETY: a zeroed sigaction is valid; it is filled in before use.
            let mut me = TermSignals {
                r: fds[0],
                w: fds[1],
                old: unsafe { std::mem::zeroed() },
            };
            for (i, sig) in SIGNALS.into_iter().enumerate() {
                // SAFETY: a zeroed sigaction with a plain handler and an empty mask is valid;
                // the handler only loads an atomic and calls write(2).
                let rc = unsafe {
                    let mut sa: libc::sigaction = std::mem::zeroed();
                    sa.sa_sigaction = on_signal as *const () as usize;
                    sa.sa_flags = libc::SA_RESTART;
                    libc::sigemptyset(&mut sa.sa_mask);
                    libc::sigaction(sig, &sa, &mut me.old[i].1)
                };
                if rc != 0 {
                    // Drop restores what was installed so far.
                    return Err(err(()));
                }
                me.old[i].0 = sig;
            }
            Ok(me)
        }

        /// Blocks until SIGTERM or SIGINT arrives; returns the signal number.
        pub(super) fn wait(&self) -> Result<libc::c_int, CoherenceError> {
            let mut b = 0u8;
            loop {
                // SAFETY: reading one byte into `b` from a descriptor we own.
                let n = unsafe { libc::read(self.r, (&mut b as *mut u8).cast(), 1) };
                if n == 1 {
                    return Ok(libc::c_int::from(b));
                }
                let e = io::Error::last_os_error();
                if n < 0 && e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(CoherenceError::Signal(e));
            }
        }
    }

    impl Drop for TermSignals {
        fn drop(&mut self) {
            for (sig, old) in &self.old {
                if *sig != 0 {
                    // SAFETY: restoring a disposition saved by sigaction above.
                    unsafe { libc::sigaction(*sig, old, std::ptr::null_mut()) };
                }
            }
            PIPE_W.store(-1, Ordering::SeqCst);
            // SAFETY: closing descriptors we own, once.
            unsafe {
                libc::close(self.r);
                libc::close(self.w);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replica_ids_are_stable_and_numeric_names_map_to_themselves() {
        assert_eq!(replica_id_for_name("7"), 7);
        assert_eq!(replica_id_for_name("4294967295"), u32::MAX);
        // Too large for a u32: hashed like any name.
        assert_ne!(replica_id_for_name("4294967296"), 0);
        assert_eq!(replica_id_for_name("r1"), replica_id_for_name("r1"));
        assert_ne!(replica_id_for_name("r1"), replica_id_for_name("r2"));
        // FNV-1a 32 of "a" (published test vector).
        assert_eq!(replica_id_for_name("a"), 0xe40c_292c);
    }
}
