//! Typed errors of the state API. Every variant says what failed and why.

use crate::key::FlowKey;
use thiserror::Error;

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum StateError {
    #[error("flow {0} not found")]
    NotFound(FlowKey),
    /// The flow was exported from this instance (it lives elsewhere now). Distinct from
    /// `NotFound` so the runtime can forward late packets instead of treating them as new flows.
    #[error("flow {key} migrated away (version {version})")]
    Migrated { key: FlowKey, version: u64 },
    #[error("flow {0} already exists")]
    Exists(FlowKey),
    /// A transaction is open on the flow (refcount > 0): it cannot be exported or deleted now.
    #[error("flow {key} is busy (refcount {refcount})")]
    Busy { key: FlowKey, refcount: u32 },
    #[error("flow table full ({max} flows)")]
    Full { max: usize },
    #[error("timer table full for flow {key} ({max} timers per flow)")]
    TooManyTimers { key: FlowKey, max: usize },
    #[error("stale flow reference for {0}")]
    StaleRef(FlowKey),
    #[error("cannot decode exported flow: {0}")]
    Decode(String),
    #[error("shared state {0:?} not found")]
    SharedNotFound(String),
    #[error("shared state {0:?} already exists")]
    SharedExists(String),
    #[error("shared state {key:?}: {reason}")]
    SharedMode { key: String, reason: &'static str },
    #[error("shared state {0:?} is locked by another replica")]
    Locked(String),
    /// Added: a flow already carries the maximum number of aliases.
    #[error("too many aliases for flow {key} ({max} per flow)")]
    TooManyAliases { key: FlowKey, max: usize },
    /// Added: the NF's state could not be serialised (the flow stays where it was).
    #[error("cannot encode flow {key}: {reason}")]
    Encode { key: FlowKey, reason: String },
    /// Added: a transaction is open on the shared key in this store, so the requested operation
    /// (PULL, SYNCH, delete, export) would read or remove a copy that is mid-update.
    #[error("shared state {key:?} is busy (refcount {refcount})")]
    SharedBusy { key: String, refcount: u32 },
    /// Added: a bound of the shared store or of the coherence hub was hit (counted).
    #[error("shared state {key:?}: {what} over the limit of {max}")]
    SharedLimit {
        key: String,
        what: &'static str,
        max: usize,
    },
    /// Added: the SYNCH lease ran out and another holder took the lock since; the write was
    /// fenced off and not published.
    #[error("shared state {0:?}: lock lease lost, write fenced off")]
    LeaseLost(String),
    /// Added: the coherence transport or lock service failed.
    #[error("coherence transport failed for {key:?}: {reason}")]
    Coherence { key: String, reason: String },
}
