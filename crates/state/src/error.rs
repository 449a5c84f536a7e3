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
}
