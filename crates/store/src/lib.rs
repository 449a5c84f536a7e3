//! The controller's store: a small key/value space with revisions, behind the [`Store`] trait.
//!
//! The trait follows etcd's data model on purpose (string keys, opaque values, one global
//! revision that every write increments, per-key `mod_revision`, compare-and-swap on it, a watch
//! as "changes since revision R under prefix P"), so both backends answer the same way:
//!
//! - [`FileStore`] ([`file`]): the embedded single-host backend, the default. The whole map in
//!   memory, persisted as one JSON file written to a temp file, fsynced and renamed over the old
//!   one, so a crash leaves either the old or the new state, never half of one.
//! - [`EtcdStore`] ([`etcd`]): a real etcd cluster, for controllers on several hosts. Keys live
//!   under a per-cluster prefix; writes are etcd transactions; watches are etcd watch streams.
//!
//! Both are checked by one conformance suite (`tests/conformance.rs`) against the same
//! expectations, the etcd one against a real etcd server.

pub mod etcd;
pub mod file;
pub mod leader;

pub use etcd::{EtcdOptions, EtcdStore};
pub use file::FileStore;
pub use leader::{Candidate, Leader, Leadership, Seen, Verdict};

use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

/// Longest key accepted (before the etcd backend's prefix).
pub const MAX_KEY_BYTES: usize = 256;
/// Largest value the file backend accepts (the replica set, ring summary, exceptions are far
/// smaller). The etcd backend's bound is lower: [`etcd::MAX_VALUE_BYTES`].
pub const MAX_VALUE_BYTES: usize = 4 << 20;
/// Keys the store holds at most.
pub const MAX_KEYS: usize = 100_000;
/// Change events the file backend keeps for watchers; older ones are compacted away.
pub const MAX_EVENTS: usize = 4096;

/// What went wrong, and with which key, file or server.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum StoreError {
    #[error("key {0:?}: empty or longer than {MAX_KEY_BYTES} bytes")]
    BadKey(String),
    #[error("value of {key:?} is {len} bytes, more than the store's limit of {max}")]
    TooLarge { key: String, len: usize, max: usize },
    #[error("store full: {MAX_KEYS} keys")]
    Full,
    #[error("store file {path}: {reason}")]
    File { path: PathBuf, reason: String },
    #[error("value of {key:?}: {reason}")]
    Decode { key: String, reason: String },
    #[error("watch from revision {asked}: compacted, oldest kept is {oldest}")]
    Compacted { asked: u64, oldest: u64 },
    /// The backend could not be reached or did not answer in time. Nothing was changed by the
    /// failed call, as far as the caller can know: an etcd write that timed out may still have
    /// been applied, which is why every placement write is a compare-and-swap.
    #[error("store unavailable ({backend}): {reason}")]
    Unavailable {
        backend: &'static str,
        reason: String,
    },
    /// A write of a leader whose leadership (term) has ended: another controller leads now
    /// (`current` is its term, 0 if nobody leads). Nothing was written.
    #[error("deposed: this controller led in term {term}, the leader key now has term {current}")]
    Deposed { term: u64, current: u64 },
    /// The backend answered with something the trait cannot express (a non-UTF-8 value, a
    /// refused request).
    #[error("store backend ({backend}): {reason}")]
    Backend {
        backend: &'static str,
        reason: String,
    },
}

pub type Result<T> = std::result::Result<T, StoreError>;

/// A value with the revision of its last write.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Versioned {
    pub value: String,
    pub mod_revision: u64,
}

/// One change, for watchers. `value: None` is a delete.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    pub key: String,
    pub value: Option<String>,
    pub revision: u64,
}

/// A live watch: changes arrive in revision order as they happen. A `Compacted` error ends it
/// (the watcher must re-list and watch again from the listing's revision); while the backend is
/// unreachable the watch waits and resumes where it stopped, so no change is skipped. Dropping
/// it ends the watch.
pub struct Watch {
    rx: mpsc::Receiver<Result<Event>>,
    closed: Arc<AtomicBool>,
}

/// The sending half a backend keeps for one [`Watch`].
pub(crate) struct WatchSender {
    tx: mpsc::Sender<Result<Event>>,
    closed: Arc<AtomicBool>,
}

pub(crate) fn watch_channel() -> (WatchSender, Watch) {
    let (tx, rx) = mpsc::channel();
    let closed = Arc::new(AtomicBool::new(false));
    (
        WatchSender {
            tx,
            closed: closed.clone(),
        },
        Watch { rx, closed },
    )
}

impl WatchSender {
    /// False once the watcher is gone.
    pub(crate) fn send(&self, item: Result<Event>) -> bool {
        !self.is_closed() && self.tx.send(item).is_ok()
    }
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Relaxed)
    }
}

impl Watch {
    /// The next change, waiting at most `timeout`; `None` if nothing came.
    pub fn next_timeout(&self, timeout: Duration) -> Option<Result<Event>> {
        self.rx.recv_timeout(timeout).ok()
    }
    /// Every change already delivered, without waiting.
    pub fn drain(&self) -> Vec<Result<Event>> {
        self.rx.try_iter().collect()
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.closed.store(true, Ordering::Relaxed);
    }
}

/// The controller's view of a store (etcd-shaped; see the module doc).
pub trait Store: Send {
    /// "file" or "etcd", for status output and errors.
    fn backend(&self) -> &'static str;
    fn get(&self, key: &str) -> Result<Option<Versioned>>;
    /// Unconditional write; returns the new revision.
    fn put(&mut self, key: &str, value: &str) -> Result<u64>;
    /// Deletes `key`; `Ok(None)` if it was absent, else the new revision.
    fn delete(&mut self, key: &str) -> Result<Option<u64>>;
    /// Keys under `prefix`, in key order.
    fn list(&self, prefix: &str) -> Result<Vec<(String, Versioned)>>;
    /// Writes only if `key`'s `mod_revision` equals `expected` (0 = key must be absent).
    /// `Ok(Err(current))` when the comparison failed, with the current revision (0 if absent).
    fn compare_and_swap(
        &mut self,
        key: &str,
        expected: u64,
        value: &str,
    ) -> Result<std::result::Result<u64, u64>>;
    /// Changes under `prefix` with revision > `since`, delivered in revision order as they
    /// happen (those already made first). A start before the kept history is `Compacted`
    /// (from this call or as the watch's first item).
    fn watch(&self, prefix: &str, since: u64) -> Result<Watch>;
    /// The latest revision this store has seen (for etcd: of its last answer).
    fn revision(&self) -> u64;
    /// Asks the backend whether it serves now; `Ok(revision)` if so. The file backend always
    /// does; etcd answers within the request timeout or is reported unavailable.
    fn health(&self) -> Result<u64>;
}

pub(crate) fn check_key(key: &str) -> Result<()> {
    if key.is_empty() || key.len() > MAX_KEY_BYTES {
        Err(StoreError::BadKey(key.chars().take(64).collect()))
    } else {
        Ok(())
    }
}

/// Typed helpers over any [`Store`]: values are JSON.
pub fn get_json<T: serde::de::DeserializeOwned>(s: &dyn Store, key: &str) -> Result<Option<T>> {
    match s.get(key)? {
        None => Ok(None),
        Some(v) => serde_json::from_str(&v.value)
            .map(Some)
            .map_err(|e| StoreError::Decode {
                key: key.to_string(),
                reason: format!("undecodable value: {e}"),
            }),
    }
}

pub fn put_json<T: Serialize>(s: &mut dyn Store, key: &str, v: &T) -> Result<u64> {
    let text = serde_json::to_string(v).map_err(|e| StoreError::Decode {
        key: key.to_string(),
        reason: format!("unencodable value: {e}"),
    })?;
    s.put(key, &text)
}
