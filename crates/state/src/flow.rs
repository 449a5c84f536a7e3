//! Partitioned per-flow state with refcount transactions and per-flow timers.
//!
//! Layout: a slab of slots (`Vec<Slot>`, reused through a free list) plus one hash index that maps
//! both primary keys and aliases to a slot. A slot carries a generation, bumped whenever its entry
//! is freed, so a [`FlowRef`] (slot, generation) can never silently name a different flow.
//!
//! Timers live in each entry (at most `max_timers_per_flow`) and are mirrored in one min-heap per
//! table. Re-arming or cancelling does not search the heap: each arming gets a fresh sequence
//! number and a heap item is valid only while its entry still holds a timer with that sequence
//! number (lazy invalidation). The table keeps the heap's top valid after every call, so
//! [`FlowTable::next_deadline`] is a peek, and rebuilds the heap when stale items outnumber live
//! ones, so the heap stays bounded.
//!
//! Time is passed in (`now`) everywhere, never read from the clock, so tests are deterministic.

use crate::error::StateError;
use crate::key::FlowKey;
use foldhash::HashMap as FastMap;
use serde::{de::DeserializeOwned, Deserialize, Serialize};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Anything an NF keeps per flow. Serialised with postcard only on export (never on the hot path).
pub trait FlowState: Serialize + DeserializeOwned + Send + 'static {}
impl<T: Serialize + DeserializeOwned + Send + 'static> FlowState for T {}

/// Identifies one of an NF's timer kinds (a flow has at most one pending timer per id; re-arming
/// replaces it). Callbacks are not stored: function pointers mean nothing on another instance,
/// so the runtime dispatches expired `(key, TimerId)` pairs to the NF's `on_timer`.
pub type TimerId = u32;

/// Bound on aliases per flow (NAT needs one: the translated tuple). A constant rather than a
/// [`TableConfig`] field so existing struct literals of `TableConfig` keep compiling.
pub const MAX_ALIASES_PER_FLOW: usize = 8;

/// Longest timer accepted; longer requests are clamped to it. Keeps `now + after` far from
/// `Instant` overflow, here and on the importer.
pub const MAX_TIMER_AFTER: Duration = Duration::from_secs(365 * 24 * 3600);

/// First bytes of every exported flow record.
pub const EXPORT_MAGIC: [u8; 4] = *b"PLFX";

/// Version of the export record layout (see the crate README). Bump on any layout change;
/// `import_flow` refuses other versions with `StateError::Decode`.
pub const EXPORT_FORMAT_VERSION: u16 = 1;

/// Size of the fixed header: magic + little-endian format version.
const HEADER_LEN: usize = EXPORT_MAGIC.len() + 2;

/// Stale heap items tolerated beyond the live timers before the heap is rebuilt.
const HEAP_SLACK: usize = 1024;

/// Distinguishes tables so a `FlowRef` from one table is detected on another.
static NEXT_TABLE_ID: AtomicU32 = AtomicU32::new(1);

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
        TableConfig {
            max_flows: 1 << 20,
            max_tombstones: 1 << 16,
            max_timers_per_flow: 4,
        }
    }
}

/// An open transaction on one flow (refcount held). Not `Clone`: give it back with `put_flow`.
/// Dropping it without `put_flow` leaves the flow pinned, as in the seed.
///
/// `key` is the flow's primary key, even when the flow was looked up by an alias.
#[must_use = "a FlowRef pins its flow until put_flow"]
#[derive(Debug)]
pub struct FlowRef {
    pub(crate) slot: u32,
    pub(crate) gen: u32,
    pub(crate) table: u32,
    pub key: FlowKey,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct TableStats {
    pub flows: usize,
    pub timers: usize,
    /// Approximate: `size_of::<S>()` per live flow (inline size; heap memory owned by `S` is
    /// not counted, measuring it would need a serialisation per flow).
    pub state_bytes: usize,
    pub tombstones: usize,
    pub created: u64,
    pub deleted: u64,
    pub exported: u64,
    pub imported: u64,
    pub refused_full: u64,
    pub timers_fired: u64,
    /// Timers refused because the flow already had `max_timers_per_flow` pending.
    pub refused_timers: u64,
    /// Export/delete refused because a transaction was open (refcount > 0).
    pub refused_busy: u64,
    /// Tombstones dropped to respect `max_tombstones`.
    pub tombstones_evicted: u64,
    /// `put_flow` calls with a reference this table did not issue (ignored).
    pub stale_puts: u64,
    /// Exported records refused by `import_flow` as undecodable or invalid.
    pub import_rejected: u64,
}

struct Timer {
    id: TimerId,
    deadline: Instant,
    seq: u64,
}

struct Entry<S> {
    key: FlowKey,
    state: S,
    refcount: u32,
    version: u64,
    timers: Vec<Timer>,
    aliases: Vec<FlowKey>,
    /// The table's epoch when a transaction last began on this flow (see
    /// [`FlowTable::set_epoch`]); local, never exported.
    touched: u64,
}

struct Slot<S> {
    gen: u32,
    entry: Option<Entry<S>>,
}

/// Heap item; ordered by deadline, then by arming order (`seq`) so ties fire deterministically.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct HeapItem {
    deadline: Instant,
    seq: u64,
    slot: u32,
    id: TimerId,
}

/// The export record body (after the fixed header), encoder side: borrows the entry.
#[derive(Serialize)]
struct BodyRef<'a, S> {
    key: &'a FlowKey,
    aliases: &'a [FlowKey],
    version: u64,
    state: &'a S,
    /// `(timer id, remaining nanoseconds at export)`.
    timers: Vec<(TimerId, u64)>,
}

/// The export record body, decoder side. Field order must match [`BodyRef`].
#[derive(Deserialize)]
struct Body<S> {
    key: FlowKey,
    aliases: Vec<FlowKey>,
    version: u64,
    state: S,
    timers: Vec<(TimerId, u64)>,
}

pub struct FlowTable<S> {
    cfg: TableConfig,
    id: u32,
    slots: Vec<Slot<S>>,
    free: Vec<u32>,
    /// Primary keys and aliases -> slot.
    index: FastMap<FlowKey, u32>,
    live: usize,
    heap: BinaryHeap<Reverse<HeapItem>>,
    /// Pending timers over all flows (the heap may hold more items: stale ones).
    armed: usize,
    next_seq: u64,
    /// key -> (version at export, stamp). The stamp tells a FIFO entry from a newer tombstone
    /// of the same key.
    tombs: FastMap<FlowKey, (u64, u64)>,
    tomb_fifo: VecDeque<(FlowKey, u64)>,
    next_stamp: u64,
    stats: TableStats,
    /// Set by the owner (the engine: its round number) and stamped on every flow a
    /// transaction begins on; see [`FlowTable::touched`].
    epoch: u64,
}

impl<S: FlowState> FlowTable<S> {
    pub fn new(cfg: TableConfig) -> Self {
        let mut cfg = cfg;
        // Slots are addressed by u32.
        cfg.max_flows = cfg.max_flows.min(u32::MAX as usize);
        FlowTable {
            cfg,
            id: NEXT_TABLE_ID.fetch_add(1, Ordering::Relaxed),
            slots: Vec::new(),
            free: Vec::new(),
            index: FastMap::default(),
            live: 0,
            heap: BinaryHeap::new(),
            armed: 0,
            next_seq: 0,
            tombs: FastMap::default(),
            tomb_fifo: VecDeque::new(),
            next_stamp: 0,
            stats: TableStats::default(),
            epoch: 0,
        }
    }

    pub fn config(&self) -> &TableConfig {
        &self.cfg
    }

    /// Sets the epoch stamped on flows from now on (the engine uses its round number). With
    /// [`FlowTable::touched`] the owner can tell whether a flow was worked on after some point,
    /// e.g. whether its last output is older than a transmit-queue mark taken then.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
    }

    /// The epoch of the last transaction on the flow of `key` (primary or alias), or of its
    /// creation/import; `None` if it is not here.
    pub fn touched(&self, key: &FlowKey) -> Option<u64> {
        let slot = *self.index.get(key)?;
        self.slots[slot as usize].entry.as_ref().map(|e| e.touched)
    }

    /// Allocates a flow. Errors: `Exists` (also when `key` is another flow's alias), `Full`,
    /// `Migrated` (the key was exported from here and its tombstone is still remembered; see
    /// [`FlowTable::clear_tombstone`]).
    pub fn create_flow(&mut self, key: FlowKey, init: S) -> Result<(), StateError> {
        if self.index.contains_key(&key) {
            return Err(StateError::Exists(key));
        }
        if let Some(&(version, _)) = self.tombs.get(&key) {
            return Err(StateError::Migrated { key, version });
        }
        let slot = self.alloc_slot()?;
        self.install(
            slot,
            Entry {
                key,
                state: init,
                refcount: 0,
                touched: self.epoch,
                version: 0,
                timers: Vec::new(),
                aliases: Vec::new(),
            },
        );
        self.stats.created += 1;
        Ok(())
    }

    /// Frees a flow (found by key or alias), its timers and its aliases, and returns its state.
    /// Errors: `NotFound`, `Migrated`, `Busy` when refcount > 0: the NF deletes a flow after
    /// `put_flow`, never inside its own transaction.
    pub fn delete_flow(&mut self, key: &FlowKey) -> Result<S, StateError> {
        let slot = self.resolve(key)?;
        self.check_idle(slot)?;
        let entry = self.remove_entry(slot)?;
        self.stats.deleted += 1;
        Ok(entry.state)
    }

    /// Begins a transaction (refcount + 1). Looks up aliases too. Errors: `NotFound`, `Migrated`,
    /// and `Busy` only if the refcount would overflow u32 (4 billion unreturned refs).
    pub fn get_flow(&mut self, key: &FlowKey) -> Result<FlowRef, StateError> {
        let slot = self.resolve(key)?;
        let table = self.id;
        let s = &mut self.slots[slot as usize];
        let gen = s.gen;
        let e = s.entry.as_mut().ok_or(StateError::NotFound(*key))?;
        let Some(n) = e.refcount.checked_add(1) else {
            return Err(StateError::Busy {
                key: e.key,
                refcount: e.refcount,
            });
        };
        e.refcount = n;
        e.touched = self.epoch;
        Ok(FlowRef {
            slot,
            gen,
            table,
            key: e.key,
        })
    }

    /// The state of an open transaction.
    ///
    /// # Panics
    /// If `r` was issued by another table. Through this API that is the only way a `FlowRef` can
    /// be stale: a ref holds the refcount, and delete/export refuse while refcount > 0. Use
    /// [`FlowTable::try_state`] where that cannot be ruled out (e.g. behind the C ABI).
    pub fn state(&self, r: &FlowRef) -> &S {
        match self.try_state(r) {
            Ok(s) => s,
            Err(_) => panic!(
                "FlowRef for {} used on a table that did not issue it",
                r.key
            ),
        }
    }

    /// Mutable state of an open transaction. Panics like [`FlowTable::state`].
    pub fn state_mut(&mut self, r: &FlowRef) -> &mut S {
        match self.try_state_mut(r) {
            Ok(s) => s,
            Err(_) => panic!(
                "FlowRef for {} used on a table that did not issue it",
                r.key
            ),
        }
    }

    /// Like [`FlowTable::state`], but a foreign or stale ref is `StaleRef` instead of a panic.
    pub fn try_state(&self, r: &FlowRef) -> Result<&S, StateError> {
        self.ref_entry(r)
            .map(|e| &e.state)
            .ok_or(StateError::StaleRef(r.key))
    }

    /// Like [`FlowTable::state_mut`], but a foreign or stale ref is `StaleRef`.
    pub fn try_state_mut(&mut self, r: &FlowRef) -> Result<&mut S, StateError> {
        self.ref_entry_mut(r)
            .map(|e| &mut e.state)
            .ok_or(StateError::StaleRef(r.key))
    }

    /// Ends a transaction (refcount - 1). `modified` bumps the flow's version (Pico uses it to
    /// skip unmodified flows at checkpoints). A ref this table did not issue is ignored and
    /// counted in `stale_puts` (it cannot be matched to any refcount here).
    pub fn put_flow(&mut self, r: FlowRef, modified: bool) {
        match self.ref_entry_mut(&r) {
            Some(e) => {
                debug_assert!(e.refcount > 0, "a live FlowRef implies refcount > 0");
                e.refcount = e.refcount.saturating_sub(1);
                if modified {
                    e.version += 1;
                }
            }
            None => self.stats.stale_puts += 1,
        }
    }

    /// get + closure + put in one call; the closure returns `(result, modified)`.
    pub fn with_flow<R>(
        &mut self,
        key: &FlowKey,
        f: impl FnOnce(&mut S) -> (R, bool),
    ) -> Result<R, StateError> {
        let r = self.get_flow(key)?;
        let (out, modified) = f(self.state_mut(&r));
        self.put_flow(r, modified);
        Ok(out)
    }

    /// Arms (or re-arms: replaces) timer `id` of a flow to expire `after` from `now`. `after` is
    /// clamped to [`MAX_TIMER_AFTER`]. Errors: `NotFound`, `Migrated`, `TooManyTimers` (counted).
    pub fn flow_timer(
        &mut self,
        key: &FlowKey,
        after: Duration,
        id: TimerId,
        now: Instant,
    ) -> Result<(), StateError> {
        let slot = self.resolve(key)?;
        let deadline = deadline_after(now, after);
        let seq = self.next_seq;
        let max = self.cfg.max_timers_per_flow;
        let e = self.entry_mut(slot, key)?;
        if let Some(t) = e.timers.iter_mut().find(|t| t.id == id) {
            t.deadline = deadline;
            t.seq = seq;
        } else if e.timers.len() >= max {
            let key = e.key;
            self.stats.refused_timers += 1;
            return Err(StateError::TooManyTimers { key, max });
        } else {
            e.timers.push(Timer { id, deadline, seq });
            self.armed += 1;
        }
        self.next_seq += 1;
        self.heap.push(Reverse(HeapItem {
            deadline,
            seq,
            slot,
            id,
        }));
        self.after_timer_change();
        Ok(())
    }

    /// Cancels timer `id` of a flow; cancelling a timer that is not armed is not an error.
    /// Errors: `NotFound`, `Migrated`.
    pub fn cancel_timer(&mut self, key: &FlowKey, id: TimerId) -> Result<(), StateError> {
        let slot = self.resolve(key)?;
        let e = self.entry_mut(slot, key)?;
        let before = e.timers.len();
        e.timers.retain(|t| t.id != id);
        let removed = before - e.timers.len();
        self.armed -= removed;
        self.after_timer_change();
        Ok(())
    }

    /// Earliest pending deadline, for the runtime's poll timeout.
    pub fn next_deadline(&self) -> Option<Instant> {
        // The top is kept valid by every mutating call (see `clean_heap_top`).
        self.heap.peek().map(|Reverse(top)| {
            debug_assert!(self.item_valid(top));
            top.deadline
        })
    }

    /// Removes and returns the timers due at `now` (each fires once), appended to `out` as
    /// `(primary key, timer id)` in deadline order.
    pub fn expired_timers(&mut self, now: Instant, out: &mut Vec<(FlowKey, TimerId)>) {
        while let Some(&Reverse(top)) = self.heap.peek() {
            if !self.item_valid(&top) {
                self.heap.pop();
                continue;
            }
            if top.deadline > now {
                break;
            }
            self.heap.pop();
            if let Some(e) = self.slots[top.slot as usize].entry.as_mut() {
                e.timers.retain(|t| t.seq != top.seq);
                self.armed -= 1;
                self.stats.timers_fired += 1;
                out.push((e.key, top.id));
            }
        }
    }

    /// Makes `alias` resolve to the flow of `key` (e.g. NAT's translated tuple). Aliases travel
    /// with the flow on export. Adding an alias the flow already has is a no-op. Errors:
    /// `NotFound`/`Migrated` for `key`, `Exists` if `alias` names another flow, `Migrated` if
    /// `alias` has a tombstone here, `TooManyAliases`.
    pub fn add_alias(&mut self, key: &FlowKey, alias: FlowKey) -> Result<(), StateError> {
        let slot = self.resolve(key)?;
        if let Some(&s) = self.index.get(&alias) {
            return if s == slot {
                Ok(())
            } else {
                Err(StateError::Exists(alias))
            };
        }
        if let Some(&(version, _)) = self.tombs.get(&alias) {
            return Err(StateError::Migrated {
                key: alias,
                version,
            });
        }
        let e = self.entry_mut(slot, key)?;
        if e.aliases.len() >= MAX_ALIASES_PER_FLOW {
            return Err(StateError::TooManyAliases {
                key: e.key,
                max: MAX_ALIASES_PER_FLOW,
            });
        }
        e.aliases.push(alias);
        self.index.insert(alias, slot);
        Ok(())
    }

    /// Removes an alias (not a primary key). Errors: `NotFound` if `alias` is not an alias.
    pub fn remove_alias(&mut self, alias: &FlowKey) -> Result<(), StateError> {
        let slot = *self.index.get(alias).ok_or(StateError::NotFound(*alias))?;
        let e = self.entry_mut(slot, alias)?;
        let before = e.aliases.len();
        e.aliases.retain(|a| a != alias);
        if e.aliases.len() == before {
            return Err(StateError::NotFound(*alias));
        }
        self.index.remove(alias);
        Ok(())
    }

    /// The primary key and aliases (in the order added) of the flow `key` resolves to.
    pub fn keys_of(&self, key: &FlowKey) -> Option<Vec<FlowKey>> {
        let slot = *self.index.get(key)?;
        let e = self.slots.get(slot as usize)?.entry.as_ref()?;
        let mut v = Vec::with_capacity(1 + e.aliases.len());
        v.push(e.key);
        v.extend_from_slice(&e.aliases);
        Some(v)
    }

    /// Serialises entry + pending timers (as remaining time) + version + aliases, removes the flow
    /// and leaves a MIGRATED tombstone for its key and each alias. Errors: `NotFound`, `Migrated`,
    /// `Busy` (refcount > 0: design invariant 2, no copy mid-transaction), `Encode` (the flow
    /// stays).
    pub fn export_flow(&mut self, key: &FlowKey, now: Instant) -> Result<Vec<u8>, StateError> {
        let slot = self.resolve(key)?;
        self.check_idle(slot)?;
        let bytes = self.encode_slot(slot, key, now)?;
        let e = self.remove_entry(slot)?;
        self.add_tombstone(e.key, e.version);
        for a in &e.aliases {
            self.add_tombstone(*a, e.version);
        }
        // Invariant 1 (one owner): after export nothing here resolves to the flow any more;
        // the importer holds the only active copy.
        debug_assert!(
            std::iter::once(&e.key)
                .chain(&e.aliases)
                .all(|k| !self.index.contains_key(k)),
            "an exported flow still resolves here"
        );
        self.stats.exported += 1;
        Ok(bytes)
    }

    /// Serialises a flow exactly like [`FlowTable::export_flow`] but keeps it (for checkpoints
    /// and replicas). Errors: `NotFound`, `Migrated`, `Busy`, `Encode`.
    pub fn snapshot_flow(&mut self, key: &FlowKey, now: Instant) -> Result<Vec<u8>, StateError> {
        let slot = self.resolve(key)?;
        self.check_idle(slot)?;
        self.encode_slot(slot, key, now)
    }

    /// Installs an exported flow with its version and aliases, re-arming its timers relative to
    /// `now`; clears tombstones of its key and aliases (a flow may migrate back and forth).
    /// Errors: `Decode` (bad magic, other format version, truncated or trailing bytes, invalid
    /// content; counted), `TooManyTimers`, `TooManyAliases`, `Exists`, `Full`.
    pub fn import_flow(&mut self, bytes: &[u8], now: Instant) -> Result<FlowKey, StateError> {
        let body = match decode_record::<S>(bytes) {
            Ok(b) => b,
            Err(e) => {
                self.stats.import_rejected += 1;
                return Err(e);
            }
        };
        if let Err(e) = self.validate_import(&body, now) {
            self.stats.import_rejected += 1;
            return Err(e);
        }
        let slot = self.alloc_slot()?;
        let Body {
            key,
            aliases,
            version,
            state,
            timers,
        } = body;
        let mut entry = Entry {
            key,
            state,
            refcount: 0,
            version,
            timers: Vec::with_capacity(timers.len()),
            aliases,
            touched: self.epoch,
        };
        for (id, remaining_ns) in timers {
            // Validated above: cannot fail.
            let deadline = deadline_after(now, Duration::from_nanos(remaining_ns));
            let seq = self.next_seq;
            self.next_seq += 1;
            entry.timers.push(Timer { id, deadline, seq });
            self.heap.push(Reverse(HeapItem {
                deadline,
                seq,
                slot,
                id,
            }));
            self.armed += 1;
        }
        self.tombs.remove(&key);
        for a in &entry.aliases {
            self.tombs.remove(a);
        }
        self.install(slot, entry);
        self.after_timer_change();
        self.stats.imported += 1;
        Ok(key)
    }

    /// Forgets the MIGRATED tombstone of `key` (e.g. once steering no longer sends its packets
    /// here), so a new flow with that key may be created. Returns whether one existed.
    pub fn clear_tombstone(&mut self, key: &FlowKey) -> bool {
        self.tombs.remove(key).is_some()
    }

    /// The version recorded when `key` migrated away, if its tombstone is remembered.
    pub fn migrated_version(&self, key: &FlowKey) -> Option<u64> {
        self.tombs.get(key).map(|&(v, _)| v)
    }

    pub fn contains(&self, key: &FlowKey) -> bool {
        self.index.contains_key(key)
    }

    pub fn version(&self, key: &FlowKey) -> Option<u64> {
        self.peek_entry(key).map(|e| e.version)
    }

    /// The primary key and version of the flow `key` (a primary key or an alias) names, in one
    /// index lookup, without a transaction: replication bookkeeping on the packet path.
    pub fn primary_and_version(&self, key: &FlowKey) -> Option<(FlowKey, u64)> {
        self.peek_entry(key).map(|e| (e.key, e.version))
    }

    pub fn refcount(&self, key: &FlowKey) -> Option<u32> {
        self.peek_entry(key).map(|e| e.refcount)
    }

    /// Read-only view of a flow's state without a transaction (for queries and tests; does not
    /// touch the refcount).
    pub fn peek(&self, key: &FlowKey) -> Option<&S> {
        self.peek_entry(key).map(|e| &e.state)
    }

    /// Pending timers of a flow as `(id, deadline)`.
    pub fn timers_of(&self, key: &FlowKey) -> Option<Vec<(TimerId, Instant)>> {
        self.peek_entry(key)
            .map(|e| e.timers.iter().map(|t| (t.id, t.deadline)).collect())
    }

    pub fn len(&self) -> usize {
        self.live
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Primary keys of all live flows (slot order).
    pub fn keys(&self) -> Vec<FlowKey> {
        self.slots
            .iter()
            .filter_map(|s| s.entry.as_ref().map(|e| e.key))
            .collect()
    }

    pub fn stats(&self) -> TableStats {
        let mut s = self.stats.clone();
        s.flows = self.live;
        s.timers = self.armed;
        s.state_bytes = self.live * std::mem::size_of::<S>();
        s.tombstones = self.tombs.len();
        s
    }

    // ---- internals ----

    fn resolve(&self, key: &FlowKey) -> Result<u32, StateError> {
        if let Some(&slot) = self.index.get(key) {
            return Ok(slot);
        }
        match self.tombs.get(key) {
            Some(&(version, _)) => Err(StateError::Migrated { key: *key, version }),
            None => Err(StateError::NotFound(*key)),
        }
    }

    /// The entry of a resolved slot. The index only ever points at occupied slots; the error
    /// path exists so a broken invariant is an error rather than a panic.
    fn entry_mut(&mut self, slot: u32, key: &FlowKey) -> Result<&mut Entry<S>, StateError> {
        self.slots
            .get_mut(slot as usize)
            .and_then(|s| s.entry.as_mut())
            .ok_or(StateError::NotFound(*key))
    }

    fn peek_entry(&self, key: &FlowKey) -> Option<&Entry<S>> {
        let slot = *self.index.get(key)?;
        self.slots.get(slot as usize)?.entry.as_ref()
    }

    fn ref_entry(&self, r: &FlowRef) -> Option<&Entry<S>> {
        if r.table != self.id {
            return None;
        }
        let s = self.slots.get(r.slot as usize)?;
        if s.gen != r.gen {
            return None;
        }
        s.entry.as_ref()
    }

    fn ref_entry_mut(&mut self, r: &FlowRef) -> Option<&mut Entry<S>> {
        if r.table != self.id {
            return None;
        }
        let s = self.slots.get_mut(r.slot as usize)?;
        if s.gen != r.gen {
            return None;
        }
        s.entry.as_mut()
    }

    fn check_idle(&mut self, slot: u32) -> Result<(), StateError> {
        let e = self.slots[slot as usize].entry.as_ref();
        match e {
            Some(e) if e.refcount > 0 => {
                let err = StateError::Busy {
                    key: e.key,
                    refcount: e.refcount,
                };
                self.stats.refused_busy += 1;
                Err(err)
            }
            _ => Ok(()),
        }
    }

    fn alloc_slot(&mut self) -> Result<u32, StateError> {
        if self.live >= self.cfg.max_flows {
            self.stats.refused_full += 1;
            return Err(StateError::Full {
                max: self.cfg.max_flows,
            });
        }
        if let Some(slot) = self.free.pop() {
            return Ok(slot);
        }
        // live < max_flows <= u32::MAX and every slot is live or free, so this fits.
        let slot = self.slots.len() as u32;
        self.slots.push(Slot {
            gen: 0,
            entry: None,
        });
        Ok(slot)
    }

    fn install(&mut self, slot: u32, entry: Entry<S>) {
        // Invariant 1 (one owner): a key names at most one thing here — one live flow, or the
        // tombstone of one that moved away. Create/import/alias refuse (`Exists`, `Migrated`) or
        // clear the tombstone (import) before they get here.
        debug_assert!(
            std::iter::once(&entry.key)
                .chain(&entry.aliases)
                .all(|k| !self.index.contains_key(k) && !self.tombs.contains_key(k)),
            "installing {} over a live flow or a tombstone",
            entry.key
        );
        self.index.insert(entry.key, slot);
        for a in &entry.aliases {
            self.index.insert(*a, slot);
        }
        let s = &mut self.slots[slot as usize];
        debug_assert!(s.entry.is_none());
        s.entry = Some(entry);
        self.live += 1;
    }

    fn remove_entry(&mut self, slot: u32) -> Result<Entry<S>, StateError> {
        let s = &mut self.slots[slot as usize];
        let e = s
            .entry
            .take()
            .ok_or(StateError::StaleRef(FlowKey::default()))?;
        // A new generation makes every outstanding (slot, gen) token for this slot stale.
        s.gen = s.gen.wrapping_add(1);
        self.free.push(slot);
        self.index.remove(&e.key);
        for a in &e.aliases {
            self.index.remove(a);
        }
        self.live -= 1;
        self.armed -= e.timers.len();
        self.after_timer_change();
        Ok(e)
    }

    fn encode_slot(&self, slot: u32, key: &FlowKey, now: Instant) -> Result<Vec<u8>, StateError> {
        let e = self.slots[slot as usize]
            .entry
            .as_ref()
            .ok_or(StateError::NotFound(*key))?;
        // Invariant 2 (no copy mid-transaction): export and snapshot call `check_idle` first;
        // a copy taken with a transaction open could miss the NF's next write.
        debug_assert_eq!(e.refcount, 0, "copying {} mid-transaction", e.key);
        let timers = e
            .timers
            .iter()
            .map(|t| {
                let rem = t.deadline.saturating_duration_since(now).as_nanos();
                (t.id, u64::try_from(rem).unwrap_or(u64::MAX))
            })
            .collect();
        let body = BodyRef {
            key: &e.key,
            aliases: &e.aliases,
            version: e.version,
            state: &e.state,
            timers,
        };
        let mut out = Vec::with_capacity(HEADER_LEN + 64);
        out.extend_from_slice(&EXPORT_MAGIC);
        out.extend_from_slice(&EXPORT_FORMAT_VERSION.to_le_bytes());
        let out = postcard::to_extend(&body, out).map_err(|err| StateError::Encode {
            key: e.key,
            reason: err.to_string(),
        })?;
        Ok(out)
    }

    fn validate_import(&self, b: &Body<S>, now: Instant) -> Result<(), StateError> {
        if b.aliases.len() > MAX_ALIASES_PER_FLOW {
            return Err(StateError::TooManyAliases {
                key: b.key,
                max: MAX_ALIASES_PER_FLOW,
            });
        }
        if b.timers.len() > self.cfg.max_timers_per_flow {
            return Err(StateError::TooManyTimers {
                key: b.key,
                max: self.cfg.max_timers_per_flow,
            });
        }
        for (i, a) in b.aliases.iter().enumerate() {
            if *a == b.key || b.aliases[..i].contains(a) {
                return Err(StateError::Decode(format!(
                    "flow {}: duplicate key {a}",
                    b.key
                )));
            }
        }
        for (i, (id, rem)) in b.timers.iter().enumerate() {
            if b.timers[..i].iter().any(|(other, _)| other == id) {
                return Err(StateError::Decode(format!(
                    "flow {}: duplicate timer {id}",
                    b.key
                )));
            }
            if now
                .checked_add(Duration::from_nanos(*rem).min(MAX_TIMER_AFTER))
                .is_none()
            {
                return Err(StateError::Decode(format!(
                    "flow {}: timer {id} out of range",
                    b.key
                )));
            }
        }
        for k in std::iter::once(&b.key).chain(b.aliases.iter()) {
            if self.index.contains_key(k) {
                return Err(StateError::Exists(*k));
            }
        }
        Ok(())
    }

    fn add_tombstone(&mut self, key: FlowKey, version: u64) {
        let max = self.cfg.max_tombstones;
        if max == 0 {
            return;
        }
        let stamp = self.next_stamp;
        self.next_stamp += 1;
        self.tombs.insert(key, (version, stamp));
        self.tomb_fifo.push_back((key, stamp));
        while self.tombs.len() > max {
            let Some((k, st)) = self.tomb_fifo.pop_front() else {
                break;
            };
            // Only the FIFO item carrying the live stamp owns the tombstone; older items of the
            // same key (cleared, then tombstoned again) are skipped.
            if self.tombs.get(&k).map(|&(_, s)| s) == Some(st) {
                self.tombs.remove(&k);
                self.stats.tombstones_evicted += 1;
            }
        }
        // Cleared tombstones leave FIFO items behind; keep the FIFO bounded too.
        if self.tomb_fifo.len() > 2 * max + 16 {
            let tombs = &self.tombs;
            self.tomb_fifo
                .retain(|(k, st)| tombs.get(k).map(|&(_, s)| s) == Some(*st));
        }
    }

    fn item_valid(&self, it: &HeapItem) -> bool {
        item_valid_in(&self.slots, it)
    }

    /// Restores the heap invariants after timers were armed, replaced or dropped: the top is
    /// valid, and stale items do not outnumber live ones by more than a constant. Filtering the
    /// heap itself (not rescanning the slots) keeps the cost proportional to the stale items
    /// that triggered it, even in a table of many flows with few timers.
    fn after_timer_change(&mut self) {
        if self.heap.len() > 2 * self.armed + HEAP_SLACK {
            let slots = &self.slots;
            self.heap.retain(|Reverse(it)| item_valid_in(slots, it));
        }
        while let Some(Reverse(top)) = self.heap.peek() {
            if self.item_valid(top) {
                break;
            }
            self.heap.pop();
        }
    }
}

/// A heap item is live while its slot's entry still holds a timer with the item's sequence
/// number (sequence numbers are unique per table, so a reused slot cannot match).
fn item_valid_in<S>(slots: &[Slot<S>], it: &HeapItem) -> bool {
    slots
        .get(it.slot as usize)
        .and_then(|s| s.entry.as_ref())
        .is_some_and(|e| e.timers.iter().any(|t| t.seq == it.seq))
}

fn deadline_after(now: Instant, after: Duration) -> Instant {
    let after = after.min(MAX_TIMER_AFTER);
    // Only fails within a year of the end of `Instant`'s range; firing at `now` is then the
    // least surprising choice.
    now.checked_add(after).unwrap_or(now)
}

fn decode_record<S: FlowState>(bytes: &[u8]) -> Result<Body<S>, StateError> {
    if bytes.len() < HEADER_LEN {
        return Err(StateError::Decode(format!(
            "record of {} bytes is shorter than its header",
            bytes.len()
        )));
    }
    if bytes[..4] != EXPORT_MAGIC {
        return Err(StateError::Decode(
            "bad magic (not an exported flow)".into(),
        ));
    }
    let version = u16::from_le_bytes([bytes[4], bytes[5]]);
    if version != EXPORT_FORMAT_VERSION {
        return Err(StateError::Decode(format!(
            "format version {version}, this build reads {EXPORT_FORMAT_VERSION}"
        )));
    }
    let (body, rest) = postcard::take_from_bytes::<Body<S>>(&bytes[HEADER_LEN..])
        .map_err(|e| StateError::Decode(e.to_string()))?;
    if !rest.is_empty() {
        return Err(StateError::Decode(format!("{} trailing bytes", rest.len())));
    }
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::proto;
    use std::net::Ipv4Addr;

    #[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
    struct St {
        count: u64,
        note: String,
    }

    fn key(n: u16) -> FlowKey {
        FlowKey::v4(
            proto::TCP,
            Ipv4Addr::new(10, 0, 1, 2),
            n,
            Ipv4Addr::new(10, 0, 2, 2),
            80,
        )
        .0
    }

    fn alias_of(n: u16) -> FlowKey {
        FlowKey::v4(
            proto::TCP,
            Ipv4Addr::new(192, 0, 2, 1),
            n,
            Ipv4Addr::new(10, 0, 2, 2),
            80,
        )
        .0
    }

    fn table() -> FlowTable<St> {
        FlowTable::new(TableConfig::default())
    }

    fn st(count: u64) -> St {
        St {
            count,
            note: format!("n{count}"),
        }
    }

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn touched_records_the_epoch_of_the_last_transaction() {
        let mut t = table();
        t.set_epoch(3);
        t.create_flow(key(1), st(0)).unwrap();
        t.add_alias(&key(1), alias_of(1)).unwrap();
        assert_eq!(t.touched(&key(1)), Some(3));
        t.set_epoch(9);
        // Reading (peek, refcount) is not a transaction.
        assert_eq!(t.peek(&key(1)).map(|s| s.count), Some(0));
        assert_eq!(t.touched(&key(1)), Some(3));
        let r = t.get_flow(&alias_of(1)).unwrap();
        t.set_epoch(10);
        t.put_flow(r, false);
        assert_eq!(t.touched(&key(1)), Some(9));
        assert_eq!(t.touched(&alias_of(1)), Some(9));
        assert_eq!(t.touched(&key(2)), None);
        // An imported flow is stamped with the importer's epoch, not the exporter's.
        let bytes = t.export_flow(&key(1), Instant::now()).unwrap();
        assert_eq!(t.touched(&key(1)), None);
        let mut u = table();
        u.set_epoch(42);
        u.import_flow(&bytes, Instant::now()).unwrap();
        assert_eq!(u.touched(&key(1)), Some(42));
    }

    #[test]
    fn get_put_counts_refs_and_bumps_version_only_when_modified() {
        let mut t = table();
        t.create_flow(key(1), st(0)).unwrap();
        assert_eq!(t.version(&key(1)), Some(0));
        let r = t.get_flow(&key(1)).unwrap();
        let r2 = t.get_flow(&key(1)).unwrap();
        assert_eq!(t.refcount(&key(1)), Some(2));
        t.state_mut(&r).count += 5;
        assert_eq!(t.state(&r2).count, 5);
        t.put_flow(r, true);
        assert_eq!(t.version(&key(1)), Some(1));
        t.put_flow(r2, false);
        assert_eq!(t.version(&key(1)), Some(1));
        assert_eq!(t.refcount(&key(1)), Some(0));
        let n = t.with_flow(&key(1), |s| (s.count, true)).unwrap();
        assert_eq!(n, 5);
        assert_eq!(t.version(&key(1)), Some(2));
        assert_eq!(t.refcount(&key(1)), Some(0));
        assert_eq!(
            t.get_flow(&key(2)).unwrap_err(),
            StateError::NotFound(key(2))
        );
        assert_eq!(
            t.with_flow(&key(2), |_| ((), true)).unwrap_err(),
            StateError::NotFound(key(2))
        );
    }

    #[test]
    fn create_refuses_duplicates_and_respects_max_flows() {
        let mut t: FlowTable<St> = FlowTable::new(TableConfig {
            max_flows: 2,
            ..TableConfig::default()
        });
        t.create_flow(key(1), st(1)).unwrap();
        assert_eq!(
            t.create_flow(key(1), st(9)).unwrap_err(),
            StateError::Exists(key(1))
        );
        t.create_flow(key(2), st(2)).unwrap();
        assert_eq!(
            t.create_flow(key(3), st(3)).unwrap_err(),
            StateError::Full { max: 2 }
        );
        assert_eq!(t.stats().refused_full, 1);
        assert_eq!(t.len(), 2);
        // Deleting frees a slot that the next flow reuses.
        assert_eq!(t.delete_flow(&key(1)).unwrap(), st(1));
        t.create_flow(key(3), st(3)).unwrap();
        assert_eq!(t.peek(&key(3)), Some(&st(3)));
        let mut keys = t.keys();
        keys.sort();
        let mut want = vec![key(2), key(3)];
        want.sort();
        assert_eq!(keys, want);
        let s = t.stats();
        assert_eq!((s.created, s.deleted, s.flows), (3, 1, 2));
    }

    #[test]
    fn delete_refuses_busy_flows_and_returns_state_after_put() {
        let mut t = table();
        t.create_flow(key(1), st(7)).unwrap();
        let r = t.get_flow(&key(1)).unwrap();
        assert_eq!(
            t.delete_flow(&key(1)).unwrap_err(),
            StateError::Busy {
                key: key(1),
                refcount: 1
            }
        );
        assert_eq!(t.stats().refused_busy, 1);
        t.put_flow(r, false);
        assert_eq!(t.delete_flow(&key(1)).unwrap(), st(7));
        assert_eq!(
            t.delete_flow(&key(1)).unwrap_err(),
            StateError::NotFound(key(1))
        );
        assert!(t.is_empty());
    }

    #[test]
    fn migrated_is_distinct_from_not_found_after_export() {
        let mut t = table();
        let now = Instant::now();
        t.create_flow(key(1), st(1)).unwrap();
        t.with_flow(&key(1), |s| {
            s.count += 1;
            ((), true)
        })
        .unwrap();
        let _bytes = t.export_flow(&key(1), now).unwrap();
        let migrated = StateError::Migrated {
            key: key(1),
            version: 1,
        };
        assert_eq!(t.get_flow(&key(1)).unwrap_err(), migrated);
        assert_eq!(
            t.get_flow(&key(2)).unwrap_err(),
            StateError::NotFound(key(2))
        );
        assert_eq!(t.create_flow(key(1), st(0)).unwrap_err(), migrated);
        assert_eq!(t.delete_flow(&key(1)).unwrap_err(), migrated);
        assert_eq!(
            t.flow_timer(&key(1), secs(1), 0, now).unwrap_err(),
            migrated
        );
        assert_eq!(t.export_flow(&key(1), now).unwrap_err(), migrated);
        assert_eq!(t.migrated_version(&key(1)), Some(1));
        assert_eq!(t.stats().tombstones, 1);
        // Once steering no longer sends the flow here, the key may be reused.
        assert!(t.clear_tombstone(&key(1)));
        t.create_flow(key(1), st(0)).unwrap();
    }

    #[test]
    fn import_on_second_table_gives_same_state_and_version() {
        let mut a = table();
        let mut b = table();
        let now = Instant::now();
        a.create_flow(key(1), st(0)).unwrap();
        for _ in 0..3 {
            a.with_flow(&key(1), |s| {
                s.count += 10;
                ((), true)
            })
            .unwrap();
        }
        let bytes = a.export_flow(&key(1), now).unwrap();
        assert_eq!(&bytes[..4], &EXPORT_MAGIC);
        assert_eq!(b.import_flow(&bytes, now).unwrap(), key(1));
        let r = b.get_flow(&key(1)).unwrap();
        assert_eq!(
            b.state(&r),
            &St {
                count: 30,
                note: "n0".into()
            }
        );
        b.put_flow(r, false);
        assert_eq!(b.version(&key(1)), Some(3));
        assert_eq!(b.refcount(&key(1)), Some(0));
        assert!(!a.contains(&key(1)));
        assert_eq!((a.stats().exported, b.stats().imported), (1, 1));
        // Importing the same record again is refused: one owner per flow.
        assert_eq!(
            b.import_flow(&bytes, now).unwrap_err(),
            StateError::Exists(key(1))
        );
        assert_eq!(b.stats().import_rejected, 1);
    }

    #[test]
    fn timers_survive_export_import_relative_to_new_now() {
        let mut a = table();
        let mut b = table();
        let t0 = Instant::now();
        a.create_flow(key(1), st(0)).unwrap();
        a.flow_timer(&key(1), secs(10), 1, t0).unwrap();
        a.flow_timer(&key(1), secs(20), 2, t0).unwrap();
        let bytes = a.export_flow(&key(1), t0 + secs(3)).unwrap();
        // The exporter forgets the timers entirely.
        assert_eq!(a.next_deadline(), None);
        assert_eq!(a.stats().timers, 0);
        let mut out = Vec::new();
        a.expired_timers(t0 + secs(1000), &mut out);
        assert!(out.is_empty());
        // The importer's clock is unrelated; remaining time (7 s, 17 s) is preserved.
        let t1 = t0 + secs(500);
        b.import_flow(&bytes, t1).unwrap();
        assert_eq!(b.next_deadline(), Some(t1 + secs(7)));
        assert_eq!(
            b.timers_of(&key(1)).unwrap(),
            vec![(1, t1 + secs(7)), (2, t1 + secs(17))]
        );
        b.expired_timers(t1 + secs(7) - Duration::from_nanos(1), &mut out);
        assert!(out.is_empty());
        b.expired_timers(t1 + secs(7), &mut out);
        assert_eq!(out, vec![(key(1), 1)]);
        b.expired_timers(t1 + secs(100), &mut out);
        assert_eq!(out, vec![(key(1), 1), (key(1), 2)]);
        assert_eq!(b.stats().timers_fired, 2);
        assert_eq!(a.stats().timers_fired, 0);
    }

    #[test]
    fn an_overdue_timer_travels_as_zero_remaining_and_fires_on_import() {
        let mut a = table();
        let mut b = table();
        let t0 = Instant::now();
        a.create_flow(key(1), st(0)).unwrap();
        a.flow_timer(&key(1), secs(1), 9, t0).unwrap();
        let bytes = a.export_flow(&key(1), t0 + secs(5)).unwrap();
        let t1 = t0 + secs(60);
        b.import_flow(&bytes, t1).unwrap();
        let mut out = Vec::new();
        b.expired_timers(t1, &mut out);
        assert_eq!(out, vec![(key(1), 9)]);
    }

    #[test]
    fn refcount_pins_a_flow_against_export() {
        let mut t = table();
        let now = Instant::now();
        t.create_flow(key(1), st(0)).unwrap();
        let r = t.get_flow(&key(1)).unwrap();
        let busy = StateError::Busy {
            key: key(1),
            refcount: 1,
        };
        assert_eq!(t.export_flow(&key(1), now).unwrap_err(), busy);
        assert_eq!(t.snapshot_flow(&key(1), now).unwrap_err(), busy);
        // Still here and still usable: the refusal changed nothing.
        assert_eq!(t.state(&r), &st(0));
        assert_eq!(t.stats().refused_busy, 2);
        t.put_flow(r, false);
        assert!(t.export_flow(&key(1), now).is_ok());
    }

    #[test]
    fn snapshot_keeps_the_flow_and_imports_elsewhere() {
        let mut a = table();
        let mut b = table();
        let now = Instant::now();
        a.create_flow(key(1), st(4)).unwrap();
        let bytes = a.snapshot_flow(&key(1), now).unwrap();
        assert!(a.contains(&key(1)));
        assert_eq!(a.stats().tombstones, 0);
        b.import_flow(&bytes, now).unwrap();
        assert_eq!(b.peek(&key(1)), Some(&st(4)));
    }

    #[test]
    fn primary_and_version_resolve_aliases_without_a_transaction() {
        let mut t = table();
        t.create_flow(key(1), st(1)).unwrap();
        t.add_alias(&key(1), alias_of(1)).unwrap();
        t.with_flow(&key(1), |s| ((), s.count > 0)).unwrap();
        assert_eq!(t.primary_and_version(&alias_of(1)), Some((key(1), 1)));
        assert_eq!(t.primary_and_version(&key(1)), Some((key(1), 1)));
        assert_eq!(t.refcount(&key(1)), Some(0));
        assert_eq!(t.primary_and_version(&key(2)), None);
    }

    #[test]
    fn aliases_resolve_travel_and_are_removed_with_the_flow() {
        let mut a = table();
        let mut b = table();
        let now = Instant::now();
        a.create_flow(key(1), st(1)).unwrap();
        a.add_alias(&key(1), alias_of(1)).unwrap();
        a.add_alias(&key(1), alias_of(1)).unwrap(); // idempotent
        a.create_flow(key(2), st(2)).unwrap();
        assert_eq!(
            a.add_alias(&key(2), alias_of(1)).unwrap_err(),
            StateError::Exists(alias_of(1))
        );
        assert_eq!(
            a.create_flow(alias_of(1), st(0)).unwrap_err(),
            StateError::Exists(alias_of(1))
        );
        let r = a.get_flow(&alias_of(1)).unwrap();
        assert_eq!(r.key, key(1));
        assert_eq!(a.state(&r), &st(1));
        a.put_flow(r, true);
        assert_eq!(a.keys_of(&alias_of(1)), Some(vec![key(1), alias_of(1)]));
        a.flow_timer(&alias_of(1), secs(5), 3, now).unwrap();
        // Export by alias: the whole flow moves, both keys become MIGRATED here.
        let bytes = a.export_flow(&alias_of(1), now).unwrap();
        let m = |k| StateError::Migrated { key: k, version: 1 };
        assert_eq!(a.get_flow(&key(1)).unwrap_err(), m(key(1)));
        assert_eq!(a.get_flow(&alias_of(1)).unwrap_err(), m(alias_of(1)));
        assert_eq!(
            a.add_alias(&key(2), alias_of(1)).unwrap_err(),
            m(alias_of(1))
        );
        b.import_flow(&bytes, now).unwrap();
        assert_eq!(b.keys_of(&key(1)), Some(vec![key(1), alias_of(1)]));
        assert_eq!(b.with_flow(&alias_of(1), |s| (s.count, false)).unwrap(), 1);
        let mut out = Vec::new();
        b.expired_timers(now + secs(5), &mut out);
        assert_eq!(out, vec![(key(1), 3)]);
        // Deleting removes the alias too.
        b.delete_flow(&key(1)).unwrap();
        assert_eq!(
            b.get_flow(&alias_of(1)).unwrap_err(),
            StateError::NotFound(alias_of(1))
        );
        assert_eq!(b.keys_of(&alias_of(1)), None);
    }

    #[test]
    fn alias_bounds_and_removal() {
        let mut t = table();
        t.create_flow(key(1), st(1)).unwrap();
        for i in 0..MAX_ALIASES_PER_FLOW as u16 {
            t.add_alias(&key(1), alias_of(100 + i)).unwrap();
        }
        assert_eq!(
            t.add_alias(&key(1), alias_of(99)).unwrap_err(),
            StateError::TooManyAliases {
                key: key(1),
                max: MAX_ALIASES_PER_FLOW
            }
        );
        t.remove_alias(&alias_of(100)).unwrap();
        assert!(!t.contains(&alias_of(100)));
        assert_eq!(
            t.remove_alias(&key(1)).unwrap_err(),
            StateError::NotFound(key(1))
        );
        assert_eq!(
            t.remove_alias(&alias_of(100)).unwrap_err(),
            StateError::NotFound(alias_of(100))
        );
        t.add_alias(&key(1), alias_of(99)).unwrap();
        assert_eq!(
            t.keys_of(&key(1)).map(|k| k.len()),
            Some(1 + MAX_ALIASES_PER_FLOW)
        );
    }

    #[test]
    fn rearm_replaces_and_cancel_removes() {
        let mut t = table();
        let t0 = Instant::now();
        t.create_flow(key(1), st(0)).unwrap();
        t.flow_timer(&key(1), secs(10), 1, t0).unwrap();
        t.flow_timer(&key(1), secs(20), 1, t0).unwrap();
        assert_eq!(t.stats().timers, 1);
        assert_eq!(t.next_deadline(), Some(t0 + secs(20)));
        let mut out = Vec::new();
        t.expired_timers(t0 + secs(15), &mut out);
        assert!(out.is_empty(), "the replaced 10 s deadline must not fire");
        t.expired_timers(t0 + secs(20), &mut out);
        assert_eq!(out, vec![(key(1), 1)]);
        // Cancel the earliest of two: the next deadline moves to the other.
        t.flow_timer(&key(1), secs(5), 1, t0).unwrap();
        t.flow_timer(&key(1), secs(8), 2, t0).unwrap();
        t.cancel_timer(&key(1), 1).unwrap();
        t.cancel_timer(&key(1), 7).unwrap(); // not armed: fine
        assert_eq!(t.next_deadline(), Some(t0 + secs(8)));
        assert_eq!(
            t.cancel_timer(&key(2), 1).unwrap_err(),
            StateError::NotFound(key(2))
        );
        // Deleting a flow cancels its timers.
        t.delete_flow(&key(1)).unwrap();
        assert_eq!(t.next_deadline(), None);
        assert_eq!(t.stats().timers, 0);
        out.clear();
        t.expired_timers(t0 + secs(100), &mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn expired_timers_fire_once_in_deadline_order() {
        let mut t = table();
        let t0 = Instant::now();
        for n in 1..=3u16 {
            t.create_flow(key(n), st(0)).unwrap();
        }
        t.flow_timer(&key(3), secs(1), 0, t0).unwrap();
        t.flow_timer(&key(1), secs(3), 0, t0).unwrap();
        t.flow_timer(&key(2), secs(2), 0, t0).unwrap();
        t.flow_timer(&key(2), secs(2), 1, t0).unwrap();
        let mut out = Vec::new();
        t.expired_timers(t0 + secs(2), &mut out);
        assert_eq!(out, vec![(key(3), 0), (key(2), 0), (key(2), 1)]);
        out.clear();
        t.expired_timers(t0 + secs(2), &mut out);
        assert!(out.is_empty(), "fired timers must not fire again");
        t.expired_timers(t0 + secs(9), &mut out);
        assert_eq!(out, vec![(key(1), 0)]);
        assert_eq!(t.stats().timers_fired, 4);
        assert_eq!(t.next_deadline(), None);
        // A fired timer can be armed again.
        t.flow_timer(&key(1), secs(1), 0, t0 + secs(9)).unwrap();
        assert_eq!(t.next_deadline(), Some(t0 + secs(10)));
    }

    #[test]
    fn timers_per_flow_are_bounded_but_rearm_is_allowed() {
        let mut t: FlowTable<St> = FlowTable::new(TableConfig {
            max_timers_per_flow: 2,
            ..TableConfig::default()
        });
        let t0 = Instant::now();
        t.create_flow(key(1), st(0)).unwrap();
        t.flow_timer(&key(1), secs(1), 1, t0).unwrap();
        t.flow_timer(&key(1), secs(1), 2, t0).unwrap();
        assert_eq!(
            t.flow_timer(&key(1), secs(1), 3, t0).unwrap_err(),
            StateError::TooManyTimers {
                key: key(1),
                max: 2
            }
        );
        t.flow_timer(&key(1), secs(9), 2, t0).unwrap();
        assert_eq!(t.stats().refused_timers, 1);
        // An importer with a smaller bound refuses a flow carrying more timers.
        let bytes = t.export_flow(&key(1), t0).unwrap();
        let mut small: FlowTable<St> = FlowTable::new(TableConfig {
            max_timers_per_flow: 1,
            ..TableConfig::default()
        });
        assert_eq!(
            small.import_flow(&bytes, t0).unwrap_err(),
            StateError::TooManyTimers {
                key: key(1),
                max: 1
            }
        );
        assert!(small.is_empty());
    }

    #[test]
    fn huge_timeouts_are_clamped() {
        let mut t = table();
        let t0 = Instant::now();
        t.create_flow(key(1), st(0)).unwrap();
        t.flow_timer(&key(1), Duration::MAX, 1, t0).unwrap();
        assert_eq!(t.next_deadline(), Some(t0 + MAX_TIMER_AFTER));
    }

    #[test]
    fn heap_stays_bounded_under_rearm_churn() {
        let mut t = table();
        let t0 = Instant::now();
        t.create_flow(key(1), st(0)).unwrap();
        for i in 0..20_000u64 {
            t.flow_timer(&key(1), Duration::from_millis(1000 + i), 1, t0)
                .unwrap();
            assert!(t.heap.len() <= 2 * t.armed + HEAP_SLACK + 1);
        }
        let mut out = Vec::new();
        t.expired_timers(t0 + secs(100), &mut out);
        assert_eq!(out, vec![(key(1), 1)]);
    }

    #[test]
    fn tombstones_are_bounded_fifo() {
        let mut t: FlowTable<St> = FlowTable::new(TableConfig {
            max_tombstones: 2,
            ..TableConfig::default()
        });
        let now = Instant::now();
        for n in 1..=3u16 {
            t.create_flow(key(n), st(0)).unwrap();
            t.export_flow(&key(n), now).unwrap();
        }
        assert_eq!(
            t.get_flow(&key(1)).unwrap_err(),
            StateError::NotFound(key(1))
        );
        assert!(matches!(
            t.get_flow(&key(2)),
            Err(StateError::Migrated { .. })
        ));
        assert!(matches!(
            t.get_flow(&key(3)),
            Err(StateError::Migrated { .. })
        ));
        let s = t.stats();
        assert_eq!((s.tombstones, s.tombstones_evicted), (2, 1));
        // No tombstones at all when the bound is 0.
        let mut z: FlowTable<St> = FlowTable::new(TableConfig {
            max_tombstones: 0,
            ..TableConfig::default()
        });
        z.create_flow(key(1), st(0)).unwrap();
        z.export_flow(&key(1), now).unwrap();
        assert_eq!(
            z.get_flow(&key(1)).unwrap_err(),
            StateError::NotFound(key(1))
        );
    }

    #[test]
    fn a_renewed_tombstone_is_not_evicted_by_its_older_fifo_item() {
        let mut t: FlowTable<St> = FlowTable::new(TableConfig {
            max_tombstones: 2,
            ..TableConfig::default()
        });
        let now = Instant::now();
        t.create_flow(key(1), st(0)).unwrap();
        let b1 = t.export_flow(&key(1), now).unwrap(); // FIFO: [k1]
        t.import_flow(&b1, now).unwrap(); // tombstone cleared, FIFO item stale
        t.export_flow(&key(1), now).unwrap(); // FIFO: [k1(stale), k1]
        t.create_flow(key(2), st(0)).unwrap();
        t.export_flow(&key(2), now).unwrap(); // FIFO: [k1(stale), k1, k2]
        assert!(matches!(
            t.get_flow(&key(1)),
            Err(StateError::Migrated { .. })
        ));
        t.create_flow(key(3), st(0)).unwrap();
        t.export_flow(&key(3), now).unwrap(); // evicts the live k1, not k2
        assert_eq!(
            t.get_flow(&key(1)).unwrap_err(),
            StateError::NotFound(key(1))
        );
        assert!(matches!(
            t.get_flow(&key(2)),
            Err(StateError::Migrated { .. })
        ));
        assert_eq!(t.stats().tombstones_evicted, 1);
    }

    #[test]
    fn tombstone_fifo_stays_bounded_when_flows_bounce() {
        let mut a: FlowTable<St> = FlowTable::new(TableConfig {
            max_tombstones: 4,
            ..TableConfig::default()
        });
        let now = Instant::now();
        a.create_flow(key(1), st(0)).unwrap();
        for _ in 0..1000 {
            let b = a.export_flow(&key(1), now).unwrap();
            a.import_flow(&b, now).unwrap();
        }
        assert!(a.tomb_fifo.len() <= 2 * 4 + 16 + 1);
    }

    #[test]
    fn truncated_and_corrupt_records_are_decode_errors() {
        let mut a = table();
        let now = Instant::now();
        a.create_flow(
            key(1),
            St {
                count: 3,
                note: "hello".into(),
            },
        )
        .unwrap();
        a.add_alias(&key(1), alias_of(1)).unwrap();
        a.flow_timer(&key(1), secs(3), 1, now).unwrap();
        let good = a.export_flow(&key(1), now).unwrap();
        let mut b = table();
        for len in 0..good.len() {
            let err = b.import_flow(&good[..len], now).unwrap_err();
            assert!(matches!(err, StateError::Decode(_)), "len {len}: {err:?}");
        }
        let mut trailing = good.clone();
        trailing.push(0);
        assert!(matches!(
            b.import_flow(&trailing, now),
            Err(StateError::Decode(_))
        ));
        let mut magic = good.clone();
        magic[0] ^= 0xff;
        assert!(matches!(
            b.import_flow(&magic, now),
            Err(StateError::Decode(_))
        ));
        let mut ver = good.clone();
        ver[4] = ver[4].wrapping_add(1);
        assert!(matches!(
            b.import_flow(&ver, now),
            Err(StateError::Decode(_))
        ));
        assert!(b.is_empty());
        assert_eq!(b.stats().import_rejected as usize, good.len() + 3);
        // Every single-byte corruption either decodes to something valid or is an error.
        for i in 0..good.len() {
            for x in [0x01u8, 0x80, 0xff] {
                let mut m = good.clone();
                m[i] ^= x;
                let mut c = table();
                let _ = c.import_flow(&m, now);
            }
        }
        b.import_flow(&good, now).unwrap();
    }

    #[test]
    fn random_bytes_never_panic_and_never_import() {
        // Deterministic xorshift; no dependency needed for this.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let now = Instant::now();
        let mut t = table();
        let mut imported = 0;
        for round in 0..20_000 {
            let len = (next() % 160) as usize;
            let mut buf: Vec<u8> = (0..len).map(|_| next() as u8).collect();
            // Half the inputs get a valid header so the body decoder is exercised too.
            if round % 2 == 0 && len >= HEADER_LEN {
                buf[..4].copy_from_slice(&EXPORT_MAGIC);
                buf[4..6].copy_from_slice(&EXPORT_FORMAT_VERSION.to_le_bytes());
            }
            match t.import_flow(&buf, now) {
                Ok(k) => {
                    imported += 1;
                    t.delete_flow(&k).unwrap();
                }
                Err(e) => assert!(
                    matches!(
                        e,
                        StateError::Decode(_)
                            | StateError::TooManyTimers { .. }
                            | StateError::TooManyAliases { .. }
                            | StateError::Exists(_)
                    ),
                    "{e:?}"
                ),
            }
        }
        // Random bytes essentially never form a valid record (string must be UTF-8, lengths
        // must match exactly); a few may, which is fine, but most must be refused.
        assert!(imported < 200, "{imported} random records imported");
        assert_eq!(t.stats().import_rejected, 20_000 - imported);
    }

    #[test]
    fn a_ref_from_another_table_is_detected() {
        let mut a = table();
        let mut b = table();
        a.create_flow(key(1), st(1)).unwrap();
        b.create_flow(key(1), st(2)).unwrap();
        let ra = a.get_flow(&key(1)).unwrap();
        // Same slot and generation in `b`, but another table: must not touch b's flow.
        assert_eq!(b.try_state(&ra).unwrap_err(), StateError::StaleRef(key(1)));
        assert!(b.try_state_mut(&ra).is_err());
        let rb = b.get_flow(&key(1)).unwrap();
        b.put_flow(ra, true);
        assert_eq!(b.stats().stale_puts, 1);
        assert_eq!(b.refcount(&key(1)), Some(1));
        assert_eq!(b.version(&key(1)), Some(0));
        b.put_flow(rb, false);
        assert_eq!(
            a.refcount(&key(1)),
            Some(1),
            "a's flow stays pinned by the lost ref"
        );
    }

    #[test]
    #[should_panic(expected = "did not issue it")]
    fn state_panics_on_a_foreign_ref() {
        let mut a = table();
        let b = table();
        a.create_flow(key(1), st(1)).unwrap();
        let r = a.get_flow(&key(1)).unwrap();
        let _ = b.state(&r);
    }

    #[test]
    fn migrate_back_and_forth_100_times_keeps_state_version_and_timers() {
        let mut tables = [table(), table()];
        let t0 = Instant::now();
        tables[0].create_flow(key(1), st(0)).unwrap();
        tables[0].add_alias(&key(1), alias_of(1)).unwrap();
        tables[0].flow_timer(&key(1), secs(3600), 7, t0).unwrap();
        let mut now = t0;
        for i in 0..100usize {
            let (from, to) = (i % 2, (i + 1) % 2);
            tables[from]
                .with_flow(&key(1), |s| {
                    s.count += 1;
                    ((), true)
                })
                .unwrap();
            let bytes = tables[from].export_flow(&key(1), now).unwrap();
            assert!(matches!(
                tables[from].get_flow(&key(1)),
                Err(StateError::Migrated { .. })
            ));
            now += secs(1);
            tables[to].import_flow(&bytes, now).unwrap();
        }
        let owner = &mut tables[0]; // 100 moves: back where it started
        assert_eq!(owner.peek(&key(1)).map(|s| s.count), Some(100));
        assert_eq!(owner.version(&key(1)), Some(100));
        assert_eq!(owner.keys_of(&key(1)), Some(vec![key(1), alias_of(1)]));
        // One second passed per move; remaining time kept (3600 - 0 s at each export).
        assert_eq!(owner.next_deadline(), Some(now + secs(3600)));
        assert!(matches!(
            tables[1].get_flow(&key(1)),
            Err(StateError::Migrated { version: 100, .. })
        ));
        assert_eq!(tables[1].stats().tombstones, 2); // key + alias
        assert_eq!(
            (tables[0].stats().exported, tables[1].stats().imported),
            (50, 50)
        );
    }

    /// A state whose serialisation always fails.
    #[derive(Deserialize, Debug, PartialEq)]
    struct Unserialisable(u8);
    impl Serialize for Unserialisable {
        fn serialize<Z: serde::Serializer>(&self, _: Z) -> Result<Z::Ok, Z::Error> {
            Err(serde::ser::Error::custom("refuses to serialise"))
        }
    }

    #[test]
    fn an_encode_failure_leaves_the_flow_in_place() {
        let mut t: FlowTable<Unserialisable> = FlowTable::new(TableConfig::default());
        let now = Instant::now();
        t.create_flow(key(1), Unserialisable(1)).unwrap();
        assert!(matches!(
            t.export_flow(&key(1), now),
            Err(StateError::Encode { .. })
        ));
        assert_eq!(t.peek(&key(1)), Some(&Unserialisable(1)));
        assert_eq!(t.stats().tombstones, 0);
        assert_eq!(t.stats().exported, 0);
    }

    #[test]
    fn delete_by_alias_removes_the_whole_flow() {
        let mut t = table();
        t.create_flow(key(1), st(1)).unwrap();
        t.add_alias(&key(1), alias_of(1)).unwrap();
        assert_eq!(t.delete_flow(&alias_of(1)).unwrap(), st(1));
        assert!(!t.contains(&key(1)));
        assert!(!t.contains(&alias_of(1)));
        assert_eq!(t.keys_of(&key(1)), None);
        // Both keys are free for new flows.
        t.create_flow(alias_of(1), st(2)).unwrap();
        t.create_flow(key(1), st(3)).unwrap();
    }

    /// Random operations on two tables checked against a plain model of what each call must
    /// do (one seed, one deterministic sequence). Keys migrate between the tables; refs are held
    /// across other operations; time advances and timers fire.
    #[test]
    fn random_operations_match_a_model() {
        struct MFlow {
            owner: usize,
            count: u64,
            version: u64,
            refs: usize,
            timers: Vec<(TimerId, Instant)>,
        }
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        let mut rnd = move |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        let cfg = TableConfig {
            max_flows: 12,
            max_tombstones: 1 << 10,
            max_timers_per_flow: 2,
        };
        let mut t: [FlowTable<St>; 2] = [FlowTable::new(cfg.clone()), FlowTable::new(cfg)];
        let mut model: std::collections::BTreeMap<u16, MFlow> = Default::default();
        let mut tombs: [std::collections::BTreeMap<u16, u64>; 2] = Default::default();
        let mut held: Vec<(u16, usize, FlowRef)> = Vec::new();
        let mut now = Instant::now();
        let mut fired_total = 0u64;
        for step in 0..20_000 {
            let k = rnd(16) as u16;
            let fk = key(k);
            let side = rnd(2) as usize;
            match rnd(8) {
                0 => {
                    // create on `side` (only for keys live nowhere: ownership is the caller's job)
                    if model.contains_key(&k) {
                        continue;
                    }
                    let res = t[side].create_flow(fk, st(0));
                    let live = model.values().filter(|f| f.owner == side).count();
                    if let Some(&v) = tombs[side].get(&k) {
                        assert_eq!(
                            res,
                            Err(StateError::Migrated {
                                key: fk,
                                version: v
                            })
                        );
                    } else if live >= 12 {
                        assert_eq!(res, Err(StateError::Full { max: 12 }));
                    } else {
                        assert_eq!(res, Ok(()), "step {step}");
                        let f = MFlow {
                            owner: side,
                            count: 0,
                            version: 0,
                            refs: 0,
                            timers: vec![],
                        };
                        model.insert(k, f);
                    }
                }
                1 | 2 => {
                    // get + modify, keeping the ref open
                    let res = t[side].get_flow(&fk);
                    match model.get_mut(&k) {
                        Some(f) if f.owner == side => {
                            let r = res.unwrap();
                            t[side].state_mut(&r).count += 1;
                            f.count += 1;
                            f.refs += 1;
                            held.push((k, side, r));
                        }
                        _ => match tombs[side].get(&k) {
                            Some(&v) => {
                                assert_eq!(
                                    res.unwrap_err(),
                                    StateError::Migrated {
                                        key: fk,
                                        version: v
                                    }
                                )
                            }
                            None => assert_eq!(res.unwrap_err(), StateError::NotFound(fk)),
                        },
                    }
                }
                3 => {
                    // put one held ref
                    if held.is_empty() {
                        continue;
                    }
                    let (hk, hs, r) = held.swap_remove(rnd(held.len() as u64) as usize);
                    let modified = rnd(2) == 0;
                    t[hs].put_flow(r, modified);
                    let f = model.get_mut(&hk).unwrap();
                    f.refs -= 1;
                    f.version += u64::from(modified);
                }
                4 => {
                    // arm or re-arm a timer
                    let id = rnd(3) as TimerId;
                    let after = Duration::from_nanos(1 + rnd(5_000_000_000));
                    let res = t[side].flow_timer(&fk, after, id, now);
                    match model.get_mut(&k) {
                        Some(f) if f.owner == side => {
                            if let Some(tm) = f.timers.iter_mut().find(|tm| tm.0 == id) {
                                tm.1 = now + after;
                                res.unwrap();
                            } else if f.timers.len() >= 2 {
                                assert_eq!(res, Err(StateError::TooManyTimers { key: fk, max: 2 }));
                            } else {
                                res.unwrap();
                                f.timers.push((id, now + after));
                            }
                        }
                        _ => assert!(res.is_err()),
                    }
                }
                5 => {
                    // export to the other table, imported there at the same instant
                    let res = t[side].export_flow(&fk, now);
                    match model.get_mut(&k) {
                        Some(f) if f.owner == side => {
                            if f.refs > 0 {
                                let refcount = f.refs as u32;
                                assert_eq!(res, Err(StateError::Busy { key: fk, refcount }));
                            } else {
                                let bytes = res.unwrap();
                                let other = 1 - side;
                                let live = model.values().filter(|g| g.owner == other).count();
                                let imp = t[other].import_flow(&bytes, now);
                                let f = model.get_mut(&k).unwrap();
                                tombs[side].insert(k, f.version);
                                if live >= 12 {
                                    assert_eq!(imp, Err(StateError::Full { max: 12 }));
                                    model.remove(&k); // lost in transit: the caller's choice
                                } else {
                                    assert_eq!(imp, Ok(fk));
                                    tombs[other].remove(&k);
                                    f.owner = other;
                                }
                            }
                        }
                        _ => assert!(res.is_err()),
                    }
                }
                6 => {
                    // delete
                    let res = t[side].delete_flow(&fk);
                    match model.get(&k) {
                        Some(f) if f.owner == side => {
                            if f.refs > 0 {
                                assert!(matches!(res, Err(StateError::Busy { .. })));
                            } else {
                                assert_eq!(res.unwrap().count, f.count);
                                model.remove(&k);
                            }
                        }
                        _ => assert!(res.is_err()),
                    }
                }
                _ => {
                    // time passes; timers fire on their owner only, once
                    now += Duration::from_nanos(rnd(2_000_000_000));
                    for (s, table) in t.iter_mut().enumerate() {
                        let mut out = Vec::new();
                        table.expired_timers(now, &mut out);
                        let mut want = Vec::new();
                        for (mk, f) in model.iter_mut().filter(|(_, f)| f.owner == s) {
                            f.timers.retain(|&(id, d)| {
                                let due = d <= now;
                                if due {
                                    want.push((key(*mk), id));
                                }
                                !due
                            });
                        }
                        fired_total += want.len() as u64;
                        out.sort();
                        want.sort();
                        assert_eq!(out, want, "step {step}");
                    }
                }
            }
            for (s, table) in t.iter().enumerate() {
                let mine = || model.iter().filter(move |(_, f)| f.owner == s);
                assert_eq!(table.len(), mine().count());
                assert_eq!(
                    table.stats().timers,
                    mine().map(|(_, f)| f.timers.len()).sum::<usize>()
                );
                let earliest = mine()
                    .flat_map(|(_, f)| f.timers.iter().map(|tm| tm.1))
                    .min();
                assert_eq!(table.next_deadline(), earliest, "step {step}");
            }
        }
        for (k, f) in &model {
            let tb = &t[f.owner];
            assert_eq!(tb.peek(&key(*k)).map(|s| s.count), Some(f.count));
            assert_eq!(tb.version(&key(*k)), Some(f.version));
            assert_eq!(tb.refcount(&key(*k)), Some(f.refs as u32));
        }
        let fired = t[0].stats().timers_fired + t[1].stats().timers_fired;
        assert_eq!(fired, fired_total);
        assert!(
            fired_total > 100,
            "the sequence should exercise timers ({fired_total})"
        );
    }

    #[test]
    fn stats_report_flows_timers_and_bytes() {
        let mut t = table();
        let now = Instant::now();
        t.create_flow(key(1), st(0)).unwrap();
        t.create_flow(key(2), st(0)).unwrap();
        t.flow_timer(&key(2), secs(1), 0, now).unwrap();
        let s = t.stats();
        assert_eq!((s.flows, s.timers), (2, 1));
        assert_eq!(s.state_bytes, 2 * std::mem::size_of::<St>());
    }
}
