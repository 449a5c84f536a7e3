//! Partitioned per-flow state with refcount transactions and per-flow timers.
//!
//! SKELETON: signatures are the contract other crates code against; bodies are being written.

use crate::error::StateError;
use crate::key::FlowKey;
use serde::{de::DeserializeOwned, Serialize};
use std::time::{Duration, Instant};

/// Anything an NF keeps per flow. Serialised with postcard only on export (never on the hot path).
pub trait FlowState: Serialize + DeserializeOwned + Send + 'static {}
impl<T: Serialize + DeserializeOwned + Send + 'static> FlowState for T {}

/// Identifies one of an NF's timer kinds (a flow has at most one pending timer per id; re-arming
/// replaces it). Callbacks are not stored: function pointers mean nothing on another instance,
/// so the runtime dispatches expired `(key, TimerId)` pairs to the NF's `on_timer`.
pub type TimerId = u32;

#[derive(Clone, Debug)]
pub struct TableConfig {
    /// Upper bound on live flows; `create_flow` beyond it fails with `Full` (counted).
    pub max_flows: usize,
    /// Bound on remembered MIGRATED tombstones (oldest evicted first).
    pub max_tombstones: usize,
    /// Bound on pending timers per flow.
    pub max_timers_per_flow: usize,
}

impl Default for TableConfig {
    fn default() -> Self {
        TableConfig { max_flows: 1 << 20, max_tombstones: 1 << 16, max_timers_per_flow: 4 }
    }
}

/// An open transaction on one flow (refcount held). Not `Clone`: give it back with `put_flow`.
/// Dropping it without `put_flow` leaves the flow pinned, as in the seed.
#[must_use = "a FlowRef pins its flow until put_flow"]
#[derive(Debug)]
pub struct FlowRef {
    pub(crate) slot: u32,
    pub(crate) gen: u32,
    pub key: FlowKey,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct TableStats {
    pub flows: usize,
    pub timers: usize,
    pub state_bytes: usize,
    pub tombstones: usize,
    pub created: u64,
    pub deleted: u64,
    pub exported: u64,
    pub imported: u64,
    pub refused_full: u64,
    pub timers_fired: u64,
}

pub struct FlowTable<S> {
    _p: std::marker::PhantomData<S>,
}

impl<S: FlowState> FlowTable<S> {
    pub fn new(cfg: TableConfig) -> Self {
        let _ = cfg;
        todo!()
    }
    /// Allocates a flow. Errors: `Exists`, `Full`, `Migrated` (the key was exported from here).
    pub fn create_flow(&mut self, key: FlowKey, init: S) -> Result<(), StateError> {
        let _ = (key, init);
        todo!()
    }
    /// Frees a flow and its timers. Errors: `NotFound`, `Busy` if a transaction other than... refcount > 0.
    pub fn delete_flow(&mut self, key: &FlowKey) -> Result<S, StateError> {
        let _ = key;
        todo!()
    }
    /// Begins a transaction (refcount + 1). Looks up aliases too. Errors: `NotFound`, `Migrated`.
    pub fn get_flow(&mut self, key: &FlowKey) -> Result<FlowRef, StateError> {
        let _ = key;
        todo!()
    }
    pub fn state(&self, r: &FlowRef) -> &S {
        let _ = r;
        todo!()
    }
    pub fn state_mut(&mut self, r: &FlowRef) -> &mut S {
        let _ = r;
        todo!()
    }
    /// Ends a transaction (refcount - 1). `modified` bumps the flow's version (Pico uses it to
    /// skip unmodified flows at checkpoints).
    pub fn put_flow(&mut self, r: FlowRef, modified: bool) {
        let _ = (r, modified);
        todo!()
    }
    /// get + closure + put in one call; the closure returns `(result, modified)`.
    pub fn with_flow<R>(
        &mut self,
        key: &FlowKey,
        f: impl FnOnce(&mut S) -> (R, bool),
    ) -> Result<R, StateError> {
        let _ = (key, f);
        todo!()
    }
    /// Arms (or re-arms) timer `id` of a flow to expire `after` from `now`.
    pub fn flow_timer(
        &mut self,
        key: &FlowKey,
        after: Duration,
        id: TimerId,
        now: Instant,
    ) -> Result<(), StateError> {
        let _ = (key, after, id, now);
        todo!()
    }
    pub fn cancel_timer(&mut self, key: &FlowKey, id: TimerId) -> Result<(), StateError> {
        let _ = (key, id);
        todo!()
    }
    /// Earliest pending deadline, for the runtime's poll timeout.
    pub fn next_deadline(&self) -> Option<Instant> {
        todo!()
    }
    /// Removes and returns the timers due at `now` (each fires once), appended to `out`.
    pub fn expired_timers(&mut self, now: Instant, out: &mut Vec<(FlowKey, TimerId)>) {
        let _ = (now, out);
        todo!()
    }
    /// Makes `alias` resolve to the flow of `key` (e.g. NAT's translated tuple). Aliases travel
    /// with the flow on export.
    pub fn add_alias(&mut self, key: &FlowKey, alias: FlowKey) -> Result<(), StateError> {
        let _ = (key, alias);
        todo!()
    }
    /// The primary key and aliases of the flow `key` resolves to.
    pub fn keys_of(&self, key: &FlowKey) -> Option<Vec<FlowKey>> {
        let _ = key;
        todo!()
    }
    /// Serialises entry + pending timers (as remaining time) + version + aliases, removes the flow
    /// and leaves a MIGRATED tombstone. Errors: `NotFound`, `Busy` (refcount > 0).
    pub fn export_flow(&mut self, key: &FlowKey, now: Instant) -> Result<Vec<u8>, StateError> {
        let _ = (key, now);
        todo!()
    }
    /// Installs an exported flow, re-arming its timers relative to `now`; clears a tombstone.
    pub fn import_flow(&mut self, bytes: &[u8], now: Instant) -> Result<FlowKey, StateError> {
        let _ = (bytes, now);
        todo!()
    }
    pub fn version(&self, key: &FlowKey) -> Option<u64> {
        let _ = key;
        todo!()
    }
    pub fn refcount(&self, key: &FlowKey) -> Option<u32> {
        let _ = key;
        todo!()
    }
    pub fn len(&self) -> usize {
        todo!()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Primary keys of all live flows.
    pub fn keys(&self) -> Vec<FlowKey> {
        todo!()
    }
    pub fn stats(&self) -> TableStats {
        todo!()
    }
}
