//! Coherent shared state (seed 000 ch. 3): state every replica may read and write regardless of
//! how flows are partitioned — configuration, statistics, counters.
//!
//! Two kinds of keys, fixed at `create_shared`:
//!
//! * **With a combiner — eventual consistency.** Each replica owns its *contribution* (its
//!   local copy). Nothing is ever combined into the contribution except a dying replica's
//!   (`merge_from`), so a counter is never counted twice:
//!   - `GetFlags::Local` reads/writes the contribution;
//!   - `GetFlags::Pull` fetches the other replicas' last *published* contributions through the
//!     [`Coherence`] transport and hands out a **view** `combine(own, others...)`: `value()`
//!     returns the view, while `value_mut()` still edits this replica's contribution (the view is
//!     a snapshot taken at `get_shared`; writes during the transaction do not change it);
//!   - `PutFlags::Push` publishes the contribution after the transaction;
//!   - `merge_from(dying replica's export)` runs the combiner to fold the dying replica's
//!     contribution into this one, publishes the result and withdraws the dying replica's copy
//!     from the transport, so PULL views stay exact.
//! * **Without a combiner — strong consistency.** Only `Synch` is allowed. `get_shared(Synch)`
//!   takes a lease-based lock from the [`LockService`] and fetches the newest published copy;
//!   `put_shared(Synch)` publishes (fenced by the lock token) and releases the lock.
//!
//! Transactions: `get_shared` increments a per-key refcount and `put_shared` decrements it. A
//! combiner never runs while a transaction is open on that key in this store: PULL and SYNCH
//! refuse with `SharedBusy` while another transaction on the key is open here, merges into a
//! busy key are queued (bounded) and applied when the last transaction ends, and a PUSH is
//! deferred to that moment too.
//!
//! Time: the store keeps a `now` the runtime sets once per batch ([`SharedStore::set_now`]);
//! leases are measured against it, so tests control time.

use crate::error::StateError;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// Merges `other` into `acc` (like a MapReduce combiner). Must be associative and commutative,
/// and must not panic on any input (values come from other replicas).
pub type Combiner = fn(acc: &mut Vec<u8>, other: &[u8]);

/// Identifies a replica (one `SharedStore`) towards the transport and the lock service.
pub type ReplicaId = u32;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GetFlags {
    Local,
    Pull,
    Synch,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PutFlags {
    Local,
    Push,
    Synch,
}

/// An open transaction on a shared key. Not `Clone`: give it back with `put_shared`.
#[must_use = "a SharedRef holds a transaction on shared state until put_shared"]
#[derive(Debug)]
pub struct SharedRef {
    pub key: String,
    pub(crate) store: u64,
    pub(crate) mode: GetFlags,
    /// PULL only: `combine(own, others)` as of `get_shared`.
    pub(crate) view: Option<Vec<u8>>,
    /// SYNCH only: the lock held for the transaction.
    pub(crate) token: Option<LockToken>,
}

impl SharedRef {
    /// How the transaction was opened.
    pub fn mode(&self) -> GetFlags {
        self.mode
    }
}

/// A granted lock. `fence` grows with every grant of any key, so a write carrying an older
/// fence than the key's current holder can be refused (fencing token).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LockToken {
    pub holder: ReplicaId,
    pub fence: u64,
    pub expires: Instant,
}

/// Moves coherent state between replicas. In-process: [`LocalCoherence`]; the cross-process
/// transport implements the same trait.
pub trait Coherence: Send + Sync {
    /// Stores `value` as `replica`'s contribution to combiner key `key` (replacing the last one).
    fn publish(&self, key: &str, replica: ReplicaId, value: &[u8]) -> Result<(), StateError>;
    /// Appends the last published contributions of every replica except `replica` to `out`.
    fn fetch_others(
        &self,
        key: &str,
        replica: ReplicaId,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), StateError>;
    /// Forgets `replica`'s contribution (merged into a survivor, or the key deleted there).
    fn withdraw(&self, key: &str, replica: ReplicaId) -> Result<(), StateError>;
    /// The newest published copy of strong key `key`: `(version, bytes)`.
    fn fetch_latest(&self, key: &str) -> Result<Option<(u64, Vec<u8>)>, StateError>;
    /// Publishes a new copy of strong key `key` written under `token`; returns its version.
    /// Refused with `LeaseLost` when the lock was granted to someone else since `token`.
    fn publish_latest(&self, key: &str, token: &LockToken, value: &[u8])
        -> Result<u64, StateError>;
}

/// Lease-based locks for strongly consistent keys.
pub trait LockService: Send + Sync {
    /// Grants the lock of `key` to `holder` until `now + lease`, or fails with `Locked` while
    /// another grant's lease runs (a lock is not re-entrant).
    fn lock(
        &self,
        key: &str,
        holder: ReplicaId,
        lease: Duration,
        now: Instant,
    ) -> Result<LockToken, StateError>;
    /// Releases a grant. `LeaseLost` if the lock was granted to someone else since.
    fn unlock(&self, key: &str, token: &LockToken) -> Result<(), StateError>;
}

#[derive(Clone, Debug)]
pub struct SharedConfig {
    /// Bound on keys in one store.
    pub max_keys: usize,
    /// Bound on a key's name in bytes.
    pub max_key_len: usize,
    /// Bound on a value in bytes (checked at create, publish and merge).
    pub max_value_bytes: usize,
    /// Bound on merges queued on one busy key.
    pub max_pending_merges: usize,
    /// Lease of a SYNCH lock; a holder that neither puts nor renews within it loses the lock.
    pub lock_lease: Duration,
}

impl Default for SharedConfig {
    fn default() -> Self {
        SharedConfig {
            max_keys: 1024,
            max_key_len: 128,
            max_value_bytes: 64 * 1024,
            max_pending_merges: 16,
            lock_lease: Duration::from_secs(1),
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SharedStats {
    pub keys: usize,
    pub pulls: u64,
    pub pushes: u64,
    pub synch_gets: u64,
    pub synch_puts: u64,
    /// Dying replicas' contributions folded in by `merge_from`.
    pub merges_applied: u64,
    /// Merges queued because a transaction was open on the key.
    pub merges_deferred: u64,
    /// SYNCH gets refused because another replica held the lock.
    pub lock_refused: u64,
    /// SYNCH writes refused because the lease was lost (fenced).
    pub fenced: u64,
    /// Calls refused because the flags did not match the key's consistency mode.
    pub mode_errors: u64,
    /// Calls refused by a bound (keys, key length, value size, pending merges).
    pub limit_refusals: u64,
    /// Transport or lock service failures (including ignored ones on delete/unlock).
    pub transport_errors: u64,
}

/// A replica's combiner-key contributions, as handed to a survivor's `merge_from` when the
/// replica is destroyed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SharedExport {
    pub replica: ReplicaId,
    pub entries: Vec<(String, Vec<u8>)>,
}

/// First bytes of an encoded [`SharedExport`].
pub const SHARED_EXPORT_MAGIC: [u8; 4] = *b"PLSX";
/// Layout version of an encoded [`SharedExport`].
pub const SHARED_EXPORT_FORMAT_VERSION: u16 = 1;

impl SharedExport {
    /// `magic, format version (u16 LE), postcard(SharedExport)`.
    pub fn to_bytes(&self) -> Result<Vec<u8>, StateError> {
        let mut out = Vec::from(SHARED_EXPORT_MAGIC);
        out.extend_from_slice(&SHARED_EXPORT_FORMAT_VERSION.to_le_bytes());
        postcard::to_extend(self, out).map_err(|e| StateError::Coherence {
            key: String::new(),
            reason: format!("encode shared export: {e}"),
        })
    }

    /// Decodes [`SharedExport::to_bytes`]; bad input is `Decode`, never a panic.
    pub fn from_bytes(bytes: &[u8]) -> Result<SharedExport, StateError> {
        if bytes.len() < 6 || bytes[..4] != SHARED_EXPORT_MAGIC {
            return Err(StateError::Decode("not a shared-state export".into()));
        }
        let v = u16::from_le_bytes([bytes[4], bytes[5]]);
        if v != SHARED_EXPORT_FORMAT_VERSION {
            return Err(StateError::Decode(format!(
                "shared export format version {v}, this build reads {SHARED_EXPORT_FORMAT_VERSION}"
            )));
        }
        let (x, rest) = postcard::take_from_bytes::<SharedExport>(&bytes[6..])
            .map_err(|e| StateError::Decode(e.to_string()))?;
        if !rest.is_empty() {
            return Err(StateError::Decode(format!("{} trailing bytes", rest.len())));
        }
        Ok(x)
    }
}

/// What `merge_from` did with each key of a dying replica's export.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MergeReport {
    /// Combined into this replica's contribution now.
    pub merged: Vec<String>,
    /// Queued behind an open transaction; combined when it ends.
    pub deferred: Vec<String>,
    /// Not merged: the key is unknown here or has no combiner.
    pub skipped: Vec<String>,
    /// A bound or the transport refused: either the contribution was not merged (a value or
    /// queue bound) or it was merged locally but publishing it / withdrawing the dying copy
    /// failed (a transport error; the next successful PUSH publishes it).
    pub refused: Vec<(String, StateError)>,
}

struct SharedEntry {
    value: Vec<u8>,
    combiner: Option<Combiner>,
    refcount: u32,
    /// Strong keys: version of the copy held (0: never fetched or published).
    version: u64,
    /// A PUSH was requested while other transactions were still open.
    push_pending: bool,
    /// Dying replicas' contributions waiting for the key to become idle.
    pending: Vec<(ReplicaId, Vec<u8>)>,
}

/// Distinguishes stores so a `SharedRef` from one store is detected on another.
static NEXT_STORE_ID: AtomicU64 = AtomicU64::new(1);

pub struct SharedStore {
    id: u64,
    replica: ReplicaId,
    cfg: SharedConfig,
    now: Instant,
    entries: HashMap<String, SharedEntry>,
    coherence: Arc<dyn Coherence>,
    locks: Arc<dyn LockService>,
    stats: SharedStats,
    /// Set by `retire`: this replica's contributions were handed to a survivor, so publishing
    /// them again would count them twice.
    retired: bool,
}

impl Default for SharedStore {
    fn default() -> Self {
        SharedStore::standalone(SharedConfig::default())
    }
}

impl std::fmt::Debug for SharedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedStore")
            .field("replica", &self.replica)
            .field("keys", &self.entries.len())
            .finish()
    }
}

impl SharedStore {
    /// A store of replica `replica` talking to other replicas through `coherence` and `locks`.
    pub fn new(
        replica: ReplicaId,
        cfg: SharedConfig,
        coherence: Arc<dyn Coherence>,
        locks: Arc<dyn LockService>,
    ) -> SharedStore {
        SharedStore {
            id: NEXT_STORE_ID.fetch_add(1, Ordering::Relaxed),
            replica,
            cfg,
            now: Instant::now(),
            entries: HashMap::new(),
            coherence,
            locks,
            stats: SharedStats::default(),
            retired: false,
        }
    }

    /// A single-replica store (its own private [`LocalCoherence`] hub), replica id 0.
    pub fn standalone(cfg: SharedConfig) -> SharedStore {
        LocalCoherence::new(HubConfig::default()).store(0, cfg)
    }

    pub fn replica(&self) -> ReplicaId {
        self.replica
    }

    /// Sets the time used for lock leases (the runtime calls it once per batch).
    pub fn set_now(&mut self, now: Instant) {
        self.now = now;
    }

    pub fn now(&self) -> Instant {
        self.now
    }

    /// Allocates shared state `key` with initial value `init`. With a combiner the key is
    /// eventually consistent, without one strongly consistent (SYNCH only). Errors:
    /// `SharedExists`, `SharedLimit` (key length, value size, number of keys).
    pub fn create_shared(
        &mut self,
        key: &str,
        init: Vec<u8>,
        combiner: Option<Combiner>,
    ) -> Result<(), StateError> {
        if key.len() > self.cfg.max_key_len {
            return Err(self.limit(key, "key length", self.cfg.max_key_len));
        }
        if init.len() > self.cfg.max_value_bytes {
            return Err(self.limit(key, "value bytes", self.cfg.max_value_bytes));
        }
        if self.entries.contains_key(key) {
            return Err(StateError::SharedExists(key.to_string()));
        }
        if self.entries.len() >= self.cfg.max_keys {
            return Err(self.limit(key, "keys", self.cfg.max_keys));
        }
        self.entries.insert(
            key.to_string(),
            SharedEntry {
                value: init,
                combiner,
                refcount: 0,
                version: 0,
                push_pending: false,
                pending: Vec::new(),
            },
        );
        Ok(())
    }

    /// Frees this replica's copy of `key`. For a combiner key its published contribution is
    /// withdrawn too (other replicas' PULL views no longer include it); a strong key's published
    /// copy stays with the transport (it belongs to all replicas). Errors: `SharedNotFound`,
    /// `SharedBusy`. A transport failure while withdrawing is counted, not returned: the local
    /// copy is gone either way.
    pub fn delete_shared(&mut self, key: &str) -> Result<(), StateError> {
        let e = self
            .entries
            .get(key)
            .ok_or_else(|| StateError::SharedNotFound(key.into()))?;
        if e.refcount > 0 {
            return Err(StateError::SharedBusy {
                key: key.into(),
                refcount: e.refcount,
            });
        }
        let had_combiner = e.combiner.is_some();
        self.entries.remove(key);
        if had_combiner && self.coherence.withdraw(key, self.replica).is_err() {
            self.stats.transport_errors += 1;
        }
        Ok(())
    }

    /// Begins a transaction on `key` (see the module docs for the flags). Errors:
    /// `SharedNotFound`; `SharedMode` (SYNCH on a combiner key, LOCAL/PULL on a strong key);
    /// `SharedBusy` (PULL or SYNCH while another transaction on the key is open here);
    /// `Locked` (SYNCH while another replica holds the lock); transport errors.
    pub fn get_shared(&mut self, key: &str, flags: GetFlags) -> Result<SharedRef, StateError> {
        let e = self
            .entries
            .get(key)
            .ok_or_else(|| StateError::SharedNotFound(key.into()))?;
        let has_combiner = e.combiner.is_some();
        let refcount = e.refcount;
        match (flags, has_combiner) {
            (GetFlags::Synch, true) => {
                return Err(self.mode_error(key, "SYNCH needs a key without combiner"))
            }
            (GetFlags::Local | GetFlags::Pull, false) => {
                return Err(self.mode_error(key, "a key without combiner allows only SYNCH"))
            }
            _ => {}
        }
        if refcount == u32::MAX
            || (refcount > 0 && matches!(flags, GetFlags::Pull | GetFlags::Synch))
        {
            return Err(StateError::SharedBusy {
                key: key.into(),
                refcount,
            });
        }
        let mut r = SharedRef {
            key: key.to_string(),
            store: self.id,
            mode: flags,
            view: None,
            token: None,
        };
        match flags {
            GetFlags::Local => {}
            GetFlags::Pull => {
                let mut others = Vec::new();
                if let Err(err) = self.coherence.fetch_others(key, self.replica, &mut others) {
                    self.stats.transport_errors += 1;
                    return Err(err);
                }
                let e = self
                    .entries
                    .get(key)
                    .ok_or_else(|| StateError::SharedNotFound(key.into()))?;
                let mut view = e.value.clone();
                if let Some(c) = e.combiner {
                    for o in &others {
                        c(&mut view, o);
                    }
                }
                r.view = Some(view);
                self.stats.pulls += 1;
            }
            GetFlags::Synch => {
                let token = match self
                    .locks
                    .lock(key, self.replica, self.cfg.lock_lease, self.now)
                {
                    Ok(t) => t,
                    Err(err) => {
                        if matches!(err, StateError::Locked(_)) {
                            self.stats.lock_refused += 1;
                        } else {
                            self.stats.transport_errors += 1;
                        }
                        return Err(err);
                    }
                };
                let latest = match self.coherence.fetch_latest(key) {
                    Ok(l) => l,
                    Err(err) => {
                        self.stats.transport_errors += 1;
                        let _ = self.locks.unlock(key, &token);
                        return Err(err);
                    }
                };
                let e = self
                    .entries
                    .get_mut(key)
                    .ok_or_else(|| StateError::SharedNotFound(key.into()))?;
                if let Some((version, bytes)) = latest {
                    if version > e.version {
                        e.value = bytes;
                        e.version = version;
                    }
                }
                r.token = Some(token);
                self.stats.synch_gets += 1;
            }
        }
        if let Some(e) = self.entries.get_mut(key) {
            e.refcount += 1;
        }
        Ok(r)
    }

    /// The value seen by the transaction: the PULL view for a PULL transaction, else this
    /// replica's copy.
    ///
    /// # Panics
    /// If `r` was issued by another store. Through this API that is the only way a ref can be
    /// stale (delete refuses while refcount > 0); use [`SharedStore::try_value`] where that
    /// cannot be ruled out.
    pub fn value<'a>(&'a self, r: &'a SharedRef) -> &'a [u8] {
        match self.try_value(r) {
            Ok(v) => v,
            Err(_) => panic!(
                "SharedRef for {:?} used on a store that did not issue it",
                r.key
            ),
        }
    }

    /// This replica's copy, for writing (also in a PULL transaction: writes go to this
    /// replica's contribution, never into the view). Panics like [`SharedStore::value`].
    pub fn value_mut(&mut self, r: &SharedRef) -> &mut Vec<u8> {
        match self.try_value_mut(r) {
            Ok(v) => v,
            Err(_) => panic!(
                "SharedRef for {:?} used on a store that did not issue it",
                r.key
            ),
        }
    }

    /// Like [`SharedStore::value`]; a foreign ref is `SharedNotFound` instead of a panic.
    pub fn try_value<'a>(&'a self, r: &'a SharedRef) -> Result<&'a [u8], StateError> {
        if r.store != self.id {
            return Err(StateError::SharedNotFound(r.key.clone()));
        }
        if let Some(v) = &r.view {
            return Ok(v);
        }
        self.entries
            .get(&r.key)
            .map(|e| e.value.as_slice())
            .ok_or_else(|| StateError::SharedNotFound(r.key.clone()))
    }

    /// Like [`SharedStore::value_mut`]; a foreign ref is `SharedNotFound` instead of a panic.
    pub fn try_value_mut(&mut self, r: &SharedRef) -> Result<&mut Vec<u8>, StateError> {
        if r.store != self.id {
            return Err(StateError::SharedNotFound(r.key.clone()));
        }
        self.entries
            .get_mut(&r.key)
            .map(|e| &mut e.value)
            .ok_or_else(|| StateError::SharedNotFound(r.key.clone()))
    }

    /// Ends a transaction. It always ends (refcount - 1, SYNCH lock released) even when an error
    /// is returned; the error says what could not be done:
    /// - `SharedMode`: flags do not match the key (PUSH/LOCAL on a strong key: nothing is
    ///   published, i.e. the SYNCH transaction is aborted; SYNCH on a combiner key: treated as
    ///   LOCAL);
    /// - `SharedLimit`: the value grew over `max_value_bytes`, not published;
    /// - `LeaseLost`: the SYNCH lease ran out and another replica took the lock, not published;
    /// - transport errors from publishing.
    ///
    /// When the last transaction on a key ends, queued merges are applied and a deferred PUSH
    /// is published.
    pub fn put_shared(&mut self, r: SharedRef, flags: PutFlags) -> Result<(), StateError> {
        if r.store != self.id {
            return Err(StateError::SharedNotFound(r.key));
        }
        let key = r.key.as_str();
        let Some(e) = self.entries.get_mut(key) else {
            return Err(StateError::SharedNotFound(r.key.clone()));
        };
        debug_assert!(e.refcount > 0, "a live SharedRef implies refcount > 0");
        e.refcount = e.refcount.saturating_sub(1);
        let strong = e.combiner.is_none();
        if strong {
            return self.put_strong(&r, flags);
        }
        let mut result = Ok(());
        match flags {
            PutFlags::Local => {}
            PutFlags::Push => e.push_pending = true,
            PutFlags::Synch => {
                result = Err(self.mode_error(key, "SYNCH put on a combiner key (treated as LOCAL)"))
            }
        }
        let idle_result = self.on_idle(key);
        result.and(idle_result)
    }

    /// Exports this replica's combiner-key contributions for a survivor's `merge_from` (when
    /// this replica is about to be destroyed). Errors: `SharedBusy` if a transaction is open on
    /// any combiner key (never copy mid-transaction).
    pub fn export_shared(&self) -> Result<SharedExport, StateError> {
        let mut entries = Vec::new();
        for (k, e) in &self.entries {
            if e.combiner.is_none() {
                continue;
            }
            if e.refcount > 0 {
                return Err(StateError::SharedBusy {
                    key: k.clone(),
                    refcount: e.refcount,
                });
            }
            entries.push((k.clone(), e.value.clone()));
        }
        entries.sort();
        Ok(SharedExport {
            replica: self.replica,
            entries,
        })
    }

    /// [`SharedStore::export_shared`] for a replica about to be destroyed, after which this
    /// store refuses to publish combiner keys (`SharedMode`): the survivor that merges the export
    /// withdraws this replica's published copies, and a later PUSH would bring them back and
    /// double count them.
    pub fn retire(&mut self) -> Result<SharedExport, StateError> {
        let export = self.export_shared()?;
        self.retired = true;
        Ok(export)
    }

    pub fn is_retired(&self) -> bool {
        self.retired
    }

    /// Folds a dying replica's contributions into this replica's with each key's combiner,
    /// publishes the results and withdraws the dying replica's published copies (so PULL views
    /// do not count them twice). Keys busy here are queued and merged when their transaction
    /// ends. Errors: `SharedMode` when `dying` is this replica's own export.
    pub fn merge_from(&mut self, dying: &SharedExport) -> Result<MergeReport, StateError> {
        if dying.replica == self.replica {
            return Err(self.mode_error("", "cannot merge a replica's export into itself"));
        }
        let mut report = MergeReport::default();
        let mut seen = std::collections::HashSet::new();
        for (key, value) in &dying.entries {
            // A well-formed export names each key once; a repeated key would be counted twice.
            if !seen.insert(key.as_str()) {
                report.skipped.push(key.clone());
                continue;
            }
            let max_value = self.cfg.max_value_bytes;
            let max_pending = self.cfg.max_pending_merges;
            let Some(e) = self.entries.get_mut(key.as_str()) else {
                report.skipped.push(key.clone());
                continue;
            };
            if e.combiner.is_none() {
                report.skipped.push(key.clone());
                continue;
            }
            if value.len() > max_value {
                let err = self.limit(key, "value bytes", max_value);
                report.refused.push((key.clone(), err));
                continue;
            }
            if e.refcount > 0 {
                if e.pending.len() >= max_pending {
                    let err = self.limit(key, "pending merges", max_pending);
                    report.refused.push((key.clone(), err));
                    continue;
                }
                e.pending.push((dying.replica, value.clone()));
                self.stats.merges_deferred += 1;
                report.deferred.push(key.clone());
                continue;
            }
            e.pending.push((dying.replica, value.clone()));
            match self.on_idle(key) {
                Ok(()) => report.merged.push(key.clone()),
                Err(err) => report.refused.push((key.clone(), err)),
            }
        }
        Ok(report)
    }

    // ---- typed helpers: u64 counters (little-endian, combined by summing) ----

    /// Creates an eventually consistent u64 counter (initial 0, combiner [`combiner_sum_u64`]).
    pub fn create_counter(&mut self, key: &str) -> Result<(), StateError> {
        self.create_shared(key, 0u64.to_le_bytes().to_vec(), Some(combiner_sum_u64))
    }

    /// The transaction's value read as a little-endian u64 (see [`decode_u64`]).
    pub fn get_u64(&self, r: &SharedRef) -> u64 {
        decode_u64(self.value(r))
    }

    /// Adds `delta` (wrapping) to this replica's copy, as a little-endian u64.
    pub fn add_u64(&mut self, r: &SharedRef, delta: u64) {
        let v = self.value_mut(r);
        let n = decode_u64(v).wrapping_add(delta);
        v.clear();
        v.extend_from_slice(&n.to_le_bytes());
    }

    /// One-call LOCAL transaction: adds `delta` to this replica's contribution and ends with
    /// `put` (e.g. `PutFlags::Push` to publish). Returns the contribution after the add.
    pub fn counter_add(&mut self, key: &str, delta: u64, put: PutFlags) -> Result<u64, StateError> {
        let r = self.get_shared(key, GetFlags::Local)?;
        self.add_u64(&r, delta);
        let n = decode_u64(self.value(&r));
        self.put_shared(r, put)?;
        Ok(n)
    }

    /// One-call read: `GetFlags::Local` gives this replica's contribution, `GetFlags::Pull` the
    /// combined value over all replicas' published contributions.
    pub fn counter_read(&mut self, key: &str, get: GetFlags) -> Result<u64, StateError> {
        let r = self.get_shared(key, get)?;
        let n = self.get_u64(&r);
        self.put_shared(r, PutFlags::Local)?;
        Ok(n)
    }

    pub fn contains(&self, key: &str) -> bool {
        self.entries.contains_key(key)
    }

    pub fn refcount(&self, key: &str) -> Option<u32> {
        self.entries.get(key).map(|e| e.refcount)
    }

    /// This replica's copy of `key` without a transaction (queries and tests).
    pub fn peek(&self, key: &str) -> Option<&[u8]> {
        self.entries.get(key).map(|e| e.value.as_slice())
    }

    /// Names of all keys, sorted.
    pub fn keys(&self) -> Vec<String> {
        let mut k: Vec<String> = self.entries.keys().cloned().collect();
        k.sort();
        k
    }

    pub fn stats(&self) -> SharedStats {
        let mut s = self.stats.clone();
        s.keys = self.entries.len();
        s
    }

    // ---- internals ----

    fn limit(&mut self, key: &str, what: &'static str, max: usize) -> StateError {
        self.stats.limit_refusals += 1;
        StateError::SharedLimit {
            key: key.to_string(),
            what,
            max,
        }
    }

    fn mode_error(&mut self, key: &str, reason: &'static str) -> StateError {
        self.stats.mode_errors += 1;
        StateError::SharedMode {
            key: key.to_string(),
            reason,
        }
    }

    /// Put of a strong key (refcount already decremented).
    fn put_strong(&mut self, r: &SharedRef, flags: PutFlags) -> Result<(), StateError> {
        let key = r.key.as_str();
        let Some(token) = r.token else {
            // Unreachable through this API: strong keys open only SYNCH transactions.
            return Err(self.mode_error(key, "strong key transaction without a lock"));
        };
        let publish_result = if flags != PutFlags::Synch {
            Err(self.mode_error(key, "a key without combiner needs a SYNCH put (aborted)"))
        } else {
            self.publish_strong(key, &token)
        };
        let unlock_result = self.locks.unlock(key, &token);
        if unlock_result.is_err() {
            self.stats.transport_errors += 1;
        }
        // The publish outcome matters more than the unlock: report it first.
        publish_result.and(unlock_result)
    }

    fn publish_strong(&mut self, key: &str, token: &LockToken) -> Result<(), StateError> {
        let max = self.cfg.max_value_bytes;
        let len = self.entries.get(key).map_or(0, |e| e.value.len());
        if len > max {
            return Err(self.limit(key, "value bytes", max));
        }
        let value = match self.entries.get(key) {
            Some(e) => &e.value,
            None => return Err(StateError::SharedNotFound(key.into())),
        };
        match self.coherence.publish_latest(key, token, value) {
            Ok(version) => {
                if let Some(e) = self.entries.get_mut(key) {
                    e.version = version;
                }
                self.stats.synch_puts += 1;
                Ok(())
            }
            Err(err) => {
                if matches!(err, StateError::LeaseLost(_)) {
                    self.stats.fenced += 1;
                } else {
                    self.stats.transport_errors += 1;
                }
                Err(err)
            }
        }
    }

    /// Runs when a combiner key may have become idle: applies queued merges, then publishes if
    /// a merge happened or a PUSH is pending. Nothing happens while a transaction is open.
    fn on_idle(&mut self, key: &str) -> Result<(), StateError> {
        let max = self.cfg.max_value_bytes;
        let Some(e) = self.entries.get_mut(key) else {
            return Ok(());
        };
        if e.refcount > 0 {
            return Ok(());
        }
        let Some(combine) = e.combiner else {
            return Ok(());
        };
        let merged: Vec<(ReplicaId, Vec<u8>)> = std::mem::take(&mut e.pending);
        for (_, v) in &merged {
            combine(&mut e.value, v);
        }
        if merged.is_empty() && !e.push_pending {
            return Ok(());
        }
        e.push_pending = false;
        self.stats.merges_applied += merged.len() as u64;
        let len = e.value.len();
        if len > max {
            return Err(self.limit(key, "value bytes", max));
        }
        if self.retired {
            return Err(self.mode_error(key, "replica retired: its contributions were merged away"));
        }
        let Some(e) = self.entries.get(key) else {
            return Ok(());
        };
        if let Err(err) = self.coherence.publish(key, self.replica, &e.value) {
            self.stats.transport_errors += 1;
            return Err(err);
        }
        self.stats.pushes += 1;
        // Only after our contribution includes theirs and is published: withdrawing earlier
        // would make other replicas' PULL views briefly miss the dying replica's share.
        for (dying, _) in &merged {
            if let Err(err) = self.coherence.withdraw(key, *dying) {
                self.stats.transport_errors += 1;
                return Err(err);
            }
        }
        Ok(())
    }
}

/// Reads the first 8 bytes as a little-endian u64; shorter values are zero-extended (so a
/// corrupt or empty value reads as a number, never a panic).
pub fn decode_u64(bytes: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    let n = bytes.len().min(8);
    b[..n].copy_from_slice(&bytes[..n]);
    u64::from_le_bytes(b)
}

/// Combiner for little-endian u64 counters: `acc = acc + other` (wrapping).
pub fn combiner_sum_u64(acc: &mut Vec<u8>, other: &[u8]) {
    let n = decode_u64(acc).wrapping_add(decode_u64(other));
    acc.clear();
    acc.extend_from_slice(&n.to_le_bytes());
}

/// Combiner for little-endian u64 high-water marks: `acc = max(acc, other)`.
pub fn combiner_max_u64(acc: &mut Vec<u8>, other: &[u8]) {
    let n = decode_u64(acc).max(decode_u64(other));
    acc.clear();
    acc.extend_from_slice(&n.to_le_bytes());
}

// ---------------------------------------------------------------------------------------------
// In-process transport and lock service
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Debug)]
pub struct HubConfig {
    /// Bound on keys the hub tracks (contributions, latest copies and locks together).
    pub max_keys: usize,
    /// Bound on replicas contributing to one combiner key.
    pub max_replicas_per_key: usize,
    /// Bound on one stored value in bytes.
    pub max_value_bytes: usize,
}

impl Default for HubConfig {
    fn default() -> Self {
        HubConfig {
            max_keys: 4096,
            max_replicas_per_key: 256,
            max_value_bytes: 1 << 20,
        }
    }
}

#[derive(Default)]
struct HubKey {
    /// Combiner keys: each replica's last published contribution.
    contributions: BTreeMap<ReplicaId, Vec<u8>>,
    /// Strong keys: newest published copy.
    latest: Option<(u64, Vec<u8>)>,
    /// Strong keys: last grant; it stays until unlocked or replaced after its lease ran out.
    lock: Option<LockToken>,
}

struct Hub {
    cfg: HubConfig,
    keys: HashMap<String, HubKey>,
    next_fence: u64,
}

impl Hub {
    fn key_mut(&mut self, key: &str) -> Result<&mut HubKey, StateError> {
        if !self.keys.contains_key(key) {
            if self.keys.len() >= self.cfg.max_keys {
                return Err(StateError::SharedLimit {
                    key: key.into(),
                    what: "hub keys",
                    max: self.cfg.max_keys,
                });
            }
            self.keys.insert(key.to_string(), HubKey::default());
        }
        self.keys
            .get_mut(key)
            .ok_or_else(|| StateError::SharedNotFound(key.into()))
    }

    fn check_len(&self, key: &str, value: &[u8]) -> Result<(), StateError> {
        if value.len() > self.cfg.max_value_bytes {
            return Err(StateError::SharedLimit {
                key: key.into(),
                what: "hub value bytes",
                max: self.cfg.max_value_bytes,
            });
        }
        Ok(())
    }
}

/// [`Coherence`] and [`LockService`] for several `SharedStore`s in one process, sharing one
/// hub behind a mutex. Clone it to hand the same hub to each store.
#[derive(Clone)]
pub struct LocalCoherence {
    hub: Arc<Mutex<Hub>>,
}

impl LocalCoherence {
    pub fn new(cfg: HubConfig) -> LocalCoherence {
        LocalCoherence {
            hub: Arc::new(Mutex::new(Hub {
                cfg,
                keys: HashMap::new(),
                next_fence: 0,
            })),
        }
    }

    /// A store for `replica` using this hub as transport and lock service.
    pub fn store(&self, replica: ReplicaId, cfg: SharedConfig) -> SharedStore {
        SharedStore::new(replica, cfg, Arc::new(self.clone()), Arc::new(self.clone()))
    }

    /// `replica`'s published contribution to `key` (for tests and queries).
    pub fn contribution(&self, key: &str, replica: ReplicaId) -> Option<Vec<u8>> {
        self.hub()
            .keys
            .get(key)
            .and_then(|k| k.contributions.get(&replica).cloned())
    }

    /// The newest published copy of strong key `key`.
    pub fn latest(&self, key: &str) -> Option<(u64, Vec<u8>)> {
        self.hub().keys.get(key).and_then(|k| k.latest.clone())
    }

    fn hub(&self) -> MutexGuard<'_, Hub> {
        // Hub methods do not panic while holding the lock; if some caller's panic poisoned it,
        // the data is still consistent (every update is a single insert/remove).
        self.hub.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Coherence for LocalCoherence {
    fn publish(&self, key: &str, replica: ReplicaId, value: &[u8]) -> Result<(), StateError> {
        let mut hub = self.hub();
        hub.check_len(key, value)?;
        let max = hub.cfg.max_replicas_per_key;
        let k = hub.key_mut(key)?;
        if !k.contributions.contains_key(&replica) && k.contributions.len() >= max {
            return Err(StateError::SharedLimit {
                key: key.into(),
                what: "replicas per key",
                max,
            });
        }
        k.contributions.insert(replica, value.to_vec());
        Ok(())
    }

    fn fetch_others(
        &self,
        key: &str,
        replica: ReplicaId,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), StateError> {
        let hub = self.hub();
        if let Some(k) = hub.keys.get(key) {
            out.extend(
                k.contributions
                    .iter()
                    .filter(|(r, _)| **r != replica)
                    .map(|(_, v)| v.clone()),
            );
        }
        Ok(())
    }

    fn withdraw(&self, key: &str, replica: ReplicaId) -> Result<(), StateError> {
        let mut hub = self.hub();
        if let Some(k) = hub.keys.get_mut(key) {
            k.contributions.remove(&replica);
            if k.contributions.is_empty() && k.latest.is_none() && k.lock.is_none() {
                hub.keys.remove(key);
            }
        }
        Ok(())
    }

    fn fetch_latest(&self, key: &str) -> Result<Option<(u64, Vec<u8>)>, StateError> {
        Ok(self.hub().keys.get(key).and_then(|k| k.latest.clone()))
    }

    fn publish_latest(
        &self,
        key: &str,
        token: &LockToken,
        value: &[u8],
    ) -> Result<u64, StateError> {
        let mut hub = self.hub();
        hub.check_len(key, value)?;
        let k = hub.key_mut(key)?;
        // Fencing: only the current grant may publish. A holder whose lease ran out may still
        // publish if nobody took the lock since (no conflicting writer exists).
        if k.lock.map(|l| l.fence) != Some(token.fence) {
            return Err(StateError::LeaseLost(key.into()));
        }
        let version = k.latest.as_ref().map_or(0, |(v, _)| *v) + 1;
        k.latest = Some((version, value.to_vec()));
        Ok(version)
    }
}

impl LockService for LocalCoherence {
    fn lock(
        &self,
        key: &str,
        holder: ReplicaId,
        lease: Duration,
        now: Instant,
    ) -> Result<LockToken, StateError> {
        let mut hub = self.hub();
        let fence = hub.next_fence + 1;
        let k = hub.key_mut(key)?;
        if let Some(l) = k.lock {
            if now < l.expires {
                return Err(StateError::Locked(key.into()));
            }
        }
        let expires = now.checked_add(lease).unwrap_or(now);
        let token = LockToken {
            holder,
            fence,
            expires,
        };
        k.lock = Some(token);
        hub.next_fence = fence;
        Ok(token)
    }

    fn unlock(&self, key: &str, token: &LockToken) -> Result<(), StateError> {
        let mut hub = self.hub();
        let Some(k) = hub.keys.get_mut(key) else {
            return Err(StateError::LeaseLost(key.into()));
        };
        if k.lock.map(|l| l.fence) != Some(token.fence) {
            return Err(StateError::LeaseLost(key.into()));
        }
        k.lock = None;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hub() -> LocalCoherence {
        LocalCoherence::new(HubConfig::default())
    }

    fn stores(h: &LocalCoherence, n: u32) -> Vec<SharedStore> {
        (0..n)
            .map(|r| h.store(r, SharedConfig::default()))
            .collect()
    }

    fn counters(h: &LocalCoherence, n: u32, key: &str) -> Vec<SharedStore> {
        let mut v = stores(h, n);
        for s in &mut v {
            s.create_counter(key).unwrap();
        }
        v
    }

    #[test]
    fn create_delete_and_bounds() {
        let cfg = SharedConfig {
            max_keys: 2,
            max_key_len: 8,
            max_value_bytes: 16,
            ..Default::default()
        };
        let mut s = hub().store(0, cfg);
        s.create_shared("a", vec![1], Some(combiner_sum_u64))
            .unwrap();
        assert_eq!(
            s.create_shared("a", vec![], None).unwrap_err(),
            StateError::SharedExists("a".into())
        );
        assert!(matches!(
            s.create_shared("much-too-long", vec![], None),
            Err(StateError::SharedLimit {
                what: "key length",
                ..
            })
        ));
        assert!(matches!(
            s.create_shared("big", vec![0; 17], None),
            Err(StateError::SharedLimit {
                what: "value bytes",
                ..
            })
        ));
        s.create_shared("b", vec![], None).unwrap();
        assert!(matches!(
            s.create_shared("c", vec![], None),
            Err(StateError::SharedLimit {
                what: "keys",
                max: 2,
                ..
            })
        ));
        assert_eq!(s.stats().limit_refusals, 3);
        assert_eq!(s.keys(), vec!["a".to_string(), "b".to_string()]);
        let r = s.get_shared("a", GetFlags::Local).unwrap();
        assert_eq!(
            s.delete_shared("a").unwrap_err(),
            StateError::SharedBusy {
                key: "a".into(),
                refcount: 1
            }
        );
        s.put_shared(r, PutFlags::Local).unwrap();
        s.delete_shared("a").unwrap();
        assert_eq!(
            s.delete_shared("a").unwrap_err(),
            StateError::SharedNotFound("a".into())
        );
        assert_eq!(
            s.get_shared("a", GetFlags::Local).unwrap_err(),
            StateError::SharedNotFound("a".into())
        );
        s.create_shared("c", vec![], None).unwrap();
    }

    #[test]
    fn local_reads_and_writes_only_this_replicas_copy() {
        let h = hub();
        let mut s = counters(&h, 2, "pkts");
        let r = s[0].get_shared("pkts", GetFlags::Local).unwrap();
        s[0].add_u64(&r, 5);
        assert_eq!(s[0].get_u64(&r), 5);
        assert_eq!(s[0].refcount("pkts"), Some(1));
        s[0].put_shared(r, PutFlags::Local).unwrap();
        assert_eq!(s[0].refcount("pkts"), Some(0));
        assert_eq!(s[1].counter_read("pkts", GetFlags::Local).unwrap(), 0);
        // LOCAL put publishes nothing.
        assert_eq!(h.contribution("pkts", 0), None);
        assert_eq!(s[1].counter_read("pkts", GetFlags::Pull).unwrap(), 0);
    }

    #[test]
    fn push_publishes_this_replicas_contribution() {
        let h = hub();
        let mut s = counters(&h, 2, "pkts");
        assert_eq!(s[0].counter_add("pkts", 3, PutFlags::Push).unwrap(), 3);
        assert_eq!(h.contribution("pkts", 0), Some(3u64.to_le_bytes().to_vec()));
        assert_eq!(s[0].stats().pushes, 1);
        // Re-publishing replaces, it does not add.
        s[0].counter_add("pkts", 1, PutFlags::Push).unwrap();
        assert_eq!(h.contribution("pkts", 0), Some(4u64.to_le_bytes().to_vec()));
    }

    #[test]
    fn pull_combines_replicas_without_double_counting() {
        let h = hub();
        let mut s = counters(&h, 3, "alerts");
        for (i, st) in s.iter_mut().enumerate() {
            st.counter_add("alerts", i as u64 + 1, PutFlags::Push)
                .unwrap();
        }
        assert_eq!(s[0].counter_read("alerts", GetFlags::Pull).unwrap(), 6);
        // Pulling again gives the same total: nothing was folded into the contribution.
        assert_eq!(s[0].counter_read("alerts", GetFlags::Pull).unwrap(), 6);
        assert_eq!(s[0].counter_read("alerts", GetFlags::Local).unwrap(), 1);
        // Unpublished local increments count for the local replica's view only.
        s[0].counter_add("alerts", 10, PutFlags::Local).unwrap();
        assert_eq!(s[0].counter_read("alerts", GetFlags::Pull).unwrap(), 16);
        assert_eq!(s[1].counter_read("alerts", GetFlags::Pull).unwrap(), 6);
        s[0].counter_add("alerts", 0, PutFlags::Push).unwrap();
        assert_eq!(s[1].counter_read("alerts", GetFlags::Pull).unwrap(), 16);
        assert_eq!(s[1].stats().pulls, 2);
    }

    #[test]
    fn writes_in_a_pull_transaction_go_to_the_contribution_not_the_view() {
        let h = hub();
        let mut s = counters(&h, 2, "c");
        s[1].counter_add("c", 100, PutFlags::Push).unwrap();
        let r = s[0].get_shared("c", GetFlags::Pull).unwrap();
        assert_eq!(r.mode(), GetFlags::Pull);
        assert_eq!(s[0].get_u64(&r), 100);
        s[0].add_u64(&r, 1);
        assert_eq!(s[0].get_u64(&r), 100, "the view is a snapshot");
        s[0].put_shared(r, PutFlags::Push).unwrap();
        assert_eq!(s[0].counter_read("c", GetFlags::Local).unwrap(), 1);
        assert_eq!(s[0].counter_read("c", GetFlags::Pull).unwrap(), 101);
    }

    #[test]
    fn pull_refuses_while_a_local_transaction_is_open() {
        let h = hub();
        let mut s = counters(&h, 1, "c");
        let r = s[0].get_shared("c", GetFlags::Local).unwrap();
        assert_eq!(
            s[0].get_shared("c", GetFlags::Pull).unwrap_err(),
            StateError::SharedBusy {
                key: "c".into(),
                refcount: 1
            }
        );
        // LOCAL transactions may nest.
        let r2 = s[0].get_shared("c", GetFlags::Local).unwrap();
        s[0].put_shared(r2, PutFlags::Local).unwrap();
        s[0].put_shared(r, PutFlags::Local).unwrap();
        assert!(s[0]
            .get_shared("c", GetFlags::Pull)
            .is_ok_and(|r| s[0].put_shared(r, PutFlags::Local).is_ok()));
    }

    #[test]
    fn push_waits_for_the_last_open_transaction() {
        let h = hub();
        let mut s = counters(&h, 1, "c");
        let r1 = s[0].get_shared("c", GetFlags::Local).unwrap();
        let r2 = s[0].get_shared("c", GetFlags::Local).unwrap();
        s[0].add_u64(&r2, 2);
        s[0].put_shared(r2, PutFlags::Push).unwrap();
        assert_eq!(h.contribution("c", 0), None, "published mid-transaction");
        s[0].add_u64(&r1, 3);
        s[0].put_shared(r1, PutFlags::Local).unwrap();
        assert_eq!(h.contribution("c", 0), Some(5u64.to_le_bytes().to_vec()));
    }

    #[test]
    fn merge_on_destruction_folds_the_dying_replica_in_exactly_once() {
        let h = hub();
        let mut s = counters(&h, 3, "flows");
        s[0].counter_add("flows", 1, PutFlags::Push).unwrap();
        s[1].counter_add("flows", 2, PutFlags::Push).unwrap();
        s[2].counter_add("flows", 7, PutFlags::Push).unwrap();
        // Replica 2 adds more locally before dying: not pushed, but must not be lost.
        s[2].counter_add("flows", 3, PutFlags::Local).unwrap();
        let dying = s.pop().unwrap();
        let export = dying.export_shared().unwrap();
        let bytes = export.to_bytes().unwrap();
        drop(dying);
        let export = SharedExport::from_bytes(&bytes).unwrap();
        let report = s[1].merge_from(&export).unwrap();
        assert_eq!(report.merged, vec!["flows".to_string()]);
        assert_eq!(s[1].counter_read("flows", GetFlags::Local).unwrap(), 12);
        assert_eq!(h.contribution("flows", 2), None, "dying copy withdrawn");
        assert_eq!(
            h.contribution("flows", 1),
            Some(12u64.to_le_bytes().to_vec())
        );
        assert_eq!(s[0].counter_read("flows", GetFlags::Pull).unwrap(), 13);
        assert_eq!(s[1].counter_read("flows", GetFlags::Pull).unwrap(), 13);
        assert_eq!(s[1].stats().merges_applied, 1);
    }

    #[test]
    fn a_retired_replica_cannot_publish_again() {
        let h = hub();
        let mut s = counters(&h, 2, "c");
        s[1].counter_add("c", 4, PutFlags::Push).unwrap();
        let export = s[1].retire().unwrap();
        assert!(s[1].is_retired());
        s[0].merge_from(&export).unwrap();
        assert!(matches!(
            s[1].counter_add("c", 1, PutFlags::Push),
            Err(StateError::SharedMode { .. })
        ));
        assert_eq!(h.contribution("c", 1), None);
        assert_eq!(s[0].counter_read("c", GetFlags::Pull).unwrap(), 4);
    }

    /// Random adds, pushes, pulls and replica retirements (merged into a random survivor, at
    /// times behind an open transaction): PULL always equals own + others' published copies,
    /// and after a final push every survivor's PULL equals everything ever added.
    #[test]
    fn random_counter_traffic_never_loses_or_double_counts() {
        let mut x: u64 = 0xdead_beef_cafe_f00d;
        let mut rnd = move |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        let h = hub();
        let mut alive: Vec<SharedStore> = counters(&h, 6, "c");
        let mut own = [0u64; 6];
        let mut published = [0u64; 6];
        let mut total = 0u64;
        for step in 0..3000 {
            let i = rnd(alive.len() as u64) as usize;
            let r = alive[i].replica() as usize;
            match rnd(10) {
                0..=4 => {
                    let d = rnd(100);
                    let push = rnd(2) == 0;
                    let flags = if push {
                        PutFlags::Push
                    } else {
                        PutFlags::Local
                    };
                    alive[i].counter_add("c", d, flags).unwrap();
                    own[r] += d;
                    total += d;
                    if push {
                        published[r] = own[r];
                    }
                }
                5..=8 => {
                    let want = own[r]
                        + alive
                            .iter()
                            .map(|s| s.replica() as usize)
                            .filter(|&o| o != r)
                            .map(|o| published[o])
                            .sum::<u64>();
                    assert_eq!(
                        alive[i].counter_read("c", GetFlags::Pull).unwrap(),
                        want,
                        "step {step}"
                    );
                }
                _ if alive.len() > 1 => {
                    let dying = alive.swap_remove(i);
                    let d = dying.replica() as usize;
                    let export = dying.export_shared().unwrap();
                    let j = rnd(alive.len() as u64) as usize;
                    let sr = alive[j].replica() as usize;
                    let open = rnd(2) == 0;
                    let tx = if open {
                        Some(alive[j].get_shared("c", GetFlags::Local).unwrap())
                    } else {
                        None
                    };
                    alive[j].merge_from(&export).unwrap();
                    if let Some(tx) = tx {
                        alive[j].put_shared(tx, PutFlags::Local).unwrap();
                    }
                    own[sr] += own[d];
                    published[sr] = own[sr];
                    published[d] = 0;
                    own[d] = 0;
                    assert_eq!(h.contribution("c", d as ReplicaId), None);
                }
                _ => {}
            }
        }
        for s in &mut alive {
            s.counter_add("c", 0, PutFlags::Push).unwrap();
        }
        for s in &mut alive {
            assert_eq!(s.counter_read("c", GetFlags::Pull).unwrap(), total);
        }
        assert!(alive.len() < 6, "the sequence should retire replicas");
    }

    #[test]
    fn stores_and_tables_can_move_between_threads() {
        fn is_send<T: Send>() {}
        is_send::<SharedStore>();
        is_send::<crate::FlowTable<Vec<u8>>>();
    }

    #[test]
    fn merge_into_a_busy_key_waits_for_the_transaction() {
        let h = hub();
        let mut s = counters(&h, 2, "c");
        s[1].counter_add("c", 4, PutFlags::Push).unwrap();
        let export = s[1].export_shared().unwrap();
        let r = s[0].get_shared("c", GetFlags::Local).unwrap();
        s[0].add_u64(&r, 1);
        let report = s[0].merge_from(&export).unwrap();
        assert_eq!(report.deferred, vec!["c".to_string()]);
        assert_eq!(s[0].get_u64(&r), 1, "combiner ran mid-transaction");
        assert_eq!(h.contribution("c", 1), Some(4u64.to_le_bytes().to_vec()));
        s[0].put_shared(r, PutFlags::Local).unwrap();
        assert_eq!(s[0].counter_read("c", GetFlags::Local).unwrap(), 5);
        assert_eq!(h.contribution("c", 1), None);
        assert_eq!(h.contribution("c", 0), Some(5u64.to_le_bytes().to_vec()));
        let st = s[0].stats();
        assert_eq!((st.merges_deferred, st.merges_applied), (1, 1));
    }

    #[test]
    fn merge_skips_unknown_and_strong_keys_and_bounds_the_queue() {
        let h = hub();
        let cfg = SharedConfig {
            max_pending_merges: 1,
            ..Default::default()
        };
        let mut a = h.store(0, cfg);
        a.create_counter("c").unwrap();
        a.create_shared("cfg", b"x".to_vec(), None).unwrap();
        let export = SharedExport {
            replica: 9,
            entries: vec![
                ("c".into(), 1u64.to_le_bytes().to_vec()),
                ("cfg".into(), vec![]),
                ("zz".into(), vec![]),
            ],
        };
        let mut dup = export.clone();
        dup.entries.push(("c".into(), 1u64.to_le_bytes().to_vec()));
        let report = a.merge_from(&dup).unwrap();
        assert_eq!(report.merged, vec!["c".to_string()]);
        assert_eq!(
            report.skipped,
            vec!["cfg".to_string(), "zz".to_string(), "c".to_string()]
        );
        let r = a.get_shared("c", GetFlags::Local).unwrap();
        assert_eq!(
            a.merge_from(&export).unwrap().deferred,
            vec!["c".to_string()]
        );
        let report = a.merge_from(&export).unwrap();
        assert!(matches!(
            report.refused[0].1,
            StateError::SharedLimit {
                what: "pending merges",
                ..
            }
        ));
        a.put_shared(r, PutFlags::Local).unwrap();
        assert_eq!(a.counter_read("c", GetFlags::Local).unwrap(), 2);
        let own = a.export_shared().unwrap();
        assert!(matches!(
            a.merge_from(&own),
            Err(StateError::SharedMode { .. })
        ));
        // Strong keys are not exported: their truth lives with the transport.
        assert_eq!(own.entries.len(), 1);
        let r = a.get_shared("c", GetFlags::Local).unwrap();
        assert!(matches!(
            a.export_shared(),
            Err(StateError::SharedBusy { .. })
        ));
        a.put_shared(r, PutFlags::Local).unwrap();
    }

    #[test]
    fn synch_excludes_a_second_store_until_put() {
        let h = hub();
        let mut s = stores(&h, 2);
        for st in &mut s {
            st.create_shared("cfg", b"v1".to_vec(), None).unwrap();
        }
        let r = s[0].get_shared("cfg", GetFlags::Synch).unwrap();
        assert_eq!(
            s[1].get_shared("cfg", GetFlags::Synch).unwrap_err(),
            StateError::Locked("cfg".into())
        );
        assert_eq!(s[1].stats().lock_refused, 1);
        // Same store, second SYNCH: refused locally (a lock is not re-entrant).
        assert!(matches!(
            s[0].get_shared("cfg", GetFlags::Synch),
            Err(StateError::SharedBusy { .. })
        ));
        assert_eq!(s[0].value(&r), b"v1");
        *s[0].value_mut(&r) = b"v2".to_vec();
        s[0].put_shared(r, PutFlags::Synch).unwrap();
        assert_eq!(h.latest("cfg"), Some((1, b"v2".to_vec())));
        // Now the other store gets the lock and the newest copy.
        let r = s[1].get_shared("cfg", GetFlags::Synch).unwrap();
        assert_eq!(s[1].value(&r), b"v2");
        s[1].value_mut(&r).push(b'!');
        s[1].put_shared(r, PutFlags::Synch).unwrap();
        let r = s[0].get_shared("cfg", GetFlags::Synch).unwrap();
        assert_eq!(s[0].value(&r), b"v2!");
        s[0].put_shared(r, PutFlags::Synch).unwrap();
        assert_eq!(h.latest("cfg").map(|l| l.0), Some(3));
        assert_eq!((s[0].stats().synch_gets, s[0].stats().synch_puts), (2, 2));
    }

    #[test]
    fn lease_expiry_frees_the_lock_and_fences_the_old_holder() {
        let h = hub();
        let mut s = stores(&h, 2);
        let t0 = Instant::now();
        for st in &mut s {
            st.create_shared("cfg", b"v1".to_vec(), None).unwrap();
            st.set_now(t0);
        }
        let stale = s[0].get_shared("cfg", GetFlags::Synch).unwrap();
        s[1].set_now(t0 + Duration::from_millis(999));
        assert_eq!(
            s[1].get_shared("cfg", GetFlags::Synch).unwrap_err(),
            StateError::Locked("cfg".into())
        );
        s[1].set_now(t0 + SharedConfig::default().lock_lease);
        let r = s[1].get_shared("cfg", GetFlags::Synch).unwrap();
        *s[1].value_mut(&r) = b"from-1".to_vec();
        s[1].put_shared(r, PutFlags::Synch).unwrap();
        // The old holder's write is refused: another replica held the lock since.
        *s[0].value_mut(&stale) = b"from-0".to_vec();
        assert_eq!(
            s[0].put_shared(stale, PutFlags::Synch).unwrap_err(),
            StateError::LeaseLost("cfg".into())
        );
        assert_eq!(s[0].stats().fenced, 1);
        assert_eq!(h.latest("cfg"), Some((1, b"from-1".to_vec())));
        assert_eq!(s[0].refcount("cfg"), Some(0));
        // Its next SYNCH transaction sees the winner's copy.
        let r = s[0].get_shared("cfg", GetFlags::Synch).unwrap();
        assert_eq!(s[0].value(&r), b"from-1");
        s[0].put_shared(r, PutFlags::Synch).unwrap();
    }

    #[test]
    fn an_expired_lease_nobody_took_still_publishes() {
        let h = hub();
        let mut a = h.store(0, SharedConfig::default());
        let t0 = Instant::now();
        a.set_now(t0);
        a.create_shared("k", vec![1], None).unwrap();
        let r = a.get_shared("k", GetFlags::Synch).unwrap();
        a.set_now(t0 + Duration::from_secs(60));
        a.put_shared(r, PutFlags::Synch).unwrap();
        assert_eq!(h.latest("k"), Some((1, vec![1])));
    }

    #[test]
    fn flags_must_match_the_keys_consistency_mode() {
        let h = hub();
        let mut s = stores(&h, 2);
        for st in &mut s {
            st.create_counter("ctr").unwrap();
            st.create_shared("cfg", vec![0], None).unwrap();
        }
        let mode =
            |r: Result<SharedRef, StateError>| matches!(r, Err(StateError::SharedMode { .. }));
        assert!(mode(s[0].get_shared("ctr", GetFlags::Synch)));
        assert!(mode(s[0].get_shared("cfg", GetFlags::Local)));
        assert!(mode(s[0].get_shared("cfg", GetFlags::Pull)));
        assert_eq!(s[0].refcount("cfg"), Some(0));
        // A non-SYNCH put of a strong key aborts: nothing published, lock released.
        let r = s[0].get_shared("cfg", GetFlags::Synch).unwrap();
        *s[0].value_mut(&r) = vec![9];
        assert!(matches!(
            s[0].put_shared(r, PutFlags::Push),
            Err(StateError::SharedMode { .. })
        ));
        assert_eq!(h.latest("cfg"), None);
        let r = s[1].get_shared("cfg", GetFlags::Synch).unwrap();
        s[1].put_shared(r, PutFlags::Synch).unwrap();
        // A SYNCH put of a combiner key ends the transaction as LOCAL.
        let r = s[0].get_shared("ctr", GetFlags::Local).unwrap();
        assert!(matches!(
            s[0].put_shared(r, PutFlags::Synch),
            Err(StateError::SharedMode { .. })
        ));
        assert_eq!(s[0].refcount("ctr"), Some(0));
        assert_eq!(s[0].stats().mode_errors, 5);
    }

    #[test]
    fn oversized_values_are_not_published() {
        let h = hub();
        let cfg = SharedConfig {
            max_value_bytes: 8,
            ..Default::default()
        };
        let mut a = h.store(0, cfg);
        a.create_shared("k", vec![], None).unwrap();
        let r = a.get_shared("k", GetFlags::Synch).unwrap();
        *a.value_mut(&r) = vec![0; 9];
        assert!(matches!(
            a.put_shared(r, PutFlags::Synch),
            Err(StateError::SharedLimit { .. })
        ));
        assert_eq!(h.latest("k"), None);
        // The lock was released anyway.
        let r = a.get_shared("k", GetFlags::Synch).unwrap();
        a.value_mut(&r).truncate(8);
        a.put_shared(r, PutFlags::Synch).unwrap();
        assert_eq!(h.latest("k").map(|l| l.1.len()), Some(8));
    }

    #[test]
    fn a_ref_from_another_store_is_refused() {
        let h = hub();
        let mut s = counters(&h, 2, "c");
        let r = s[0].get_shared("c", GetFlags::Local).unwrap();
        assert_eq!(
            s[1].try_value(&r).unwrap_err(),
            StateError::SharedNotFound("c".into())
        );
        assert!(s[1].try_value_mut(&r).is_err());
        assert!(s[1].put_shared(r, PutFlags::Push).is_err());
        assert_eq!(s[1].refcount("c"), Some(0));
        assert_eq!(h.contribution("c", 1), None);
        assert_eq!(
            s[0].refcount("c"),
            Some(1),
            "the lost ref keeps the key pinned"
        );
    }

    #[test]
    fn delete_withdraws_a_combiner_contribution() {
        let h = hub();
        let mut s = counters(&h, 2, "c");
        s[1].counter_add("c", 4, PutFlags::Push).unwrap();
        assert_eq!(s[0].counter_read("c", GetFlags::Pull).unwrap(), 4);
        s[1].delete_shared("c").unwrap();
        assert_eq!(s[0].counter_read("c", GetFlags::Pull).unwrap(), 0);
    }

    #[test]
    fn hub_bounds_are_enforced() {
        let h = LocalCoherence::new(HubConfig {
            max_keys: 1,
            max_replicas_per_key: 1,
            max_value_bytes: 4,
        });
        let mut a = h.store(0, SharedConfig::default());
        let mut b = h.store(1, SharedConfig::default());
        a.create_counter("c").unwrap();
        b.create_counter("c").unwrap();
        a.create_counter("d").unwrap();
        // 8-byte counter over a 4-byte hub limit.
        assert!(matches!(
            a.counter_add("c", 1, PutFlags::Push),
            Err(StateError::SharedLimit { .. })
        ));
        let h = LocalCoherence::new(HubConfig {
            max_keys: 1,
            max_replicas_per_key: 1,
            max_value_bytes: 64,
        });
        let mut a = h.store(0, SharedConfig::default());
        let mut b = h.store(1, SharedConfig::default());
        for st in [&mut a, &mut b] {
            st.create_counter("c").unwrap();
            st.create_counter("d").unwrap();
        }
        a.counter_add("c", 1, PutFlags::Push).unwrap();
        assert!(matches!(
            b.counter_add("c", 1, PutFlags::Push),
            Err(StateError::SharedLimit {
                what: "replicas per key",
                ..
            })
        ));
        assert!(matches!(
            a.counter_add("d", 1, PutFlags::Push),
            Err(StateError::SharedLimit {
                what: "hub keys",
                ..
            })
        ));
        assert_eq!(a.stats().transport_errors, 1);
    }

    #[test]
    fn standalone_store_works_alone() {
        let mut s = SharedStore::default();
        s.create_counter("c").unwrap();
        s.counter_add("c", 2, PutFlags::Push).unwrap();
        assert_eq!(s.counter_read("c", GetFlags::Pull).unwrap(), 2);
        s.create_shared("cfg", vec![], None).unwrap();
        let r = s.get_shared("cfg", GetFlags::Synch).unwrap();
        s.put_shared(r, PutFlags::Synch).unwrap();
    }

    #[test]
    fn combiners_and_decoding_never_panic() {
        assert_eq!(decode_u64(&[]), 0);
        assert_eq!(decode_u64(&[1]), 1);
        assert_eq!(decode_u64(&[0, 1, 0, 0, 0, 0, 0, 0, 0xff]), 256);
        let mut acc = vec![5];
        combiner_sum_u64(&mut acc, &7u64.to_le_bytes());
        assert_eq!(acc, 12u64.to_le_bytes().to_vec());
        combiner_sum_u64(&mut acc, &u64::MAX.to_le_bytes());
        assert_eq!(decode_u64(&acc), 11);
        combiner_max_u64(&mut acc, &[3]);
        assert_eq!(decode_u64(&acc), 11);
        combiner_max_u64(&mut acc, &40u64.to_le_bytes());
        assert_eq!(decode_u64(&acc), 40);
    }

    #[test]
    fn shared_export_decoding_refuses_bad_bytes() {
        let good = SharedExport {
            replica: 3,
            entries: vec![("k".into(), vec![1, 2])],
        }
        .to_bytes()
        .unwrap();
        assert_eq!(SharedExport::from_bytes(&good).unwrap().replica, 3);
        for len in 0..good.len() {
            assert!(SharedExport::from_bytes(&good[..len]).is_err(), "len {len}");
        }
        let mut x: u64 = 0x1234_5678_9abc_def1;
        for _ in 0..5000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let len = (x % 64) as usize;
            let mut buf: Vec<u8> = (0..len)
                .map(|i| (x >> (i % 8 * 8)) as u8 ^ i as u8)
                .collect();
            if len >= 6 {
                buf[..4].copy_from_slice(&SHARED_EXPORT_MAGIC);
                buf[4..6].copy_from_slice(&SHARED_EXPORT_FORMAT_VERSION.to_le_bytes());
            }
            let _ = SharedExport::from_bytes(&buf);
        }
    }
}
