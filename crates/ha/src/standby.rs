//! Standby state on a backup.
//!
//! [`StandbyStore`] holds, per primary replica name and group, the latest applied checkpoint:
//! `key -> (version, full export record bytes)` plus the primary's optional `shared` blob. It is
//! fed by the replication server thread ([`crate::transport::ReplServer`]) and is never handed
//! to the NF until activation (Pico's SMM standby state).
//!
//! Rules of [`StandbyStore::apply`]:
//! - **Atomic**: the whole checkpoint is validated and decoded into a staging area first;
//!   only then is anything changed. A delta whose base version is not held (or that does not
//!   decode) fails the whole checkpoint and nothing of it is applied: the backup never holds a
//!   group half-way between two epochs (design invariant 6: no torn state).
//! - **Deltas** ([`UpdateBody::Delta`]) are decoded against the record the group holds for that
//!   key, which must have exactly `base_version`. [`UpdateBody::Deleted`] forgets the key.
//! - **`full = true`** replaces everything the group holds with the checkpoint's flows (a delta
//!   in a full checkpoint is still decoded against the record held before it).
//! - **Sequence**: a `full` checkpoint is accepted at any seq (a reconnecting or restarted
//!   primary starts over); a non-full one must carry `held seq + 1` for a group already held
//!   (a gap would mean changes the backup never saw), any seq for a group not yet held.
//! - **Bounds**: `max_flows` records and `max_bytes` record bytes over all primaries, at most
//!   [`MAX_GROUPS_PER_PRIMARY`] groups per primary and [`MAX_PRIMARIES`] primaries; a checkpoint
//!   that would exceed one is refused whole and counted.
//! - **Fencing** (design invariant 7): [`StandbyStore::activate`] under token `T` makes every
//!   later checkpoint from that primary with a token `< T` fail with [`StandbyError::Fenced`].
//!   The fence outlives [`StandbyStore::drop_primary`], so a revived old primary cannot
//!   re-populate a backup it was failed over to.
//!
//! A flow moved between groups of one primary may briefly be held by two groups; activation
//! keeps the record with the highest version for each key, so the live table gets one copy.

use crate::delta::{self, DeltaError};
use crate::wire::{Checkpoint, GroupId, UpdateBody};
use foldhash::{HashMap as FastMap, HashMapExt};
use pliant_state::FlowKey;
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use thiserror::Error;

/// Bound on distinct primaries (fence tombstones included).
pub const MAX_PRIMARIES: usize = 1024;
/// Bound on groups held per primary.
pub const MAX_GROUPS_PER_PRIMARY: usize = 4096;
/// Default bound on record bytes held over all primaries (see [`StandbyStore::with_max_bytes`]).
pub const DEFAULT_MAX_BYTES: usize = 1 << 30;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum StandbyError {
    #[error(
        "primary {primary} token {token} is fenced: its flows were activated under token {fence}"
    )]
    Fenced {
        primary: String,
        token: u64,
        fence: u64,
    },
    #[error("group {group} seq {seq}: flow {key} delta needs base version {base_version}, backup holds {held:?}")]
    MissingBase {
        group: GroupId,
        seq: u64,
        key: FlowKey,
        base_version: u64,
        held: Option<u64>,
    },
    #[error("group {group} seq {seq}: flow {key} delta does not decode: {error}")]
    BadDelta {
        group: GroupId,
        seq: u64,
        key: FlowKey,
        error: DeltaError,
    },
    #[error("group {group}: non-full checkpoint seq {got} but backup holds seq {held} (expected {expected})", expected = held.saturating_add(1))]
    SeqGap { group: GroupId, held: u64, got: u64 },
    #[error("group {group} seq {seq}: flow {key} appears twice in one checkpoint")]
    DuplicateKey {
        group: GroupId,
        seq: u64,
        key: FlowKey,
    },
    #[error("checkpoint would hold {flows} flows / {bytes} bytes, over the bound of {max_flows} flows / {max_bytes} bytes")]
    OverBound {
        flows: usize,
        bytes: usize,
        max_flows: usize,
        max_bytes: usize,
    },
    #[error("primary {primary}: over the bound of {max} groups", max = MAX_GROUPS_PER_PRIMARY)]
    TooManyGroups { primary: String },
    #[error("over the bound of {max} primaries", max = MAX_PRIMARIES)]
    TooManyPrimaries,
}

/// What [`StandbyStore::activate`] hands to the runtime: every record of the primary, each a
/// whole export record ready for `FlowTable::import_flow`, one per key (highest version).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Activated {
    pub records: Vec<Vec<u8>>,
    pub shared: Option<Vec<u8>>,
    pub last_seq: Vec<(GroupId, u64)>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct PrimaryStats {
    pub primary: String,
    pub flows: usize,
    /// `(group, highest applied seq)`.
    pub groups: Vec<(GroupId, u64)>,
    /// Record bytes held (plus the shared blob).
    pub bytes: usize,
    pub checkpoints: u64,
    pub refused: u64,
    /// Tokens below this are refused (0: never activated here).
    pub fence: u64,
    /// Newest token seen in an applied checkpoint.
    pub token: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct StandbyStats {
    pub flows: usize,
    pub bytes: usize,
    pub max_flows: usize,
    pub max_bytes: usize,
    pub checkpoints: u64,
    /// Checkpoints refused for any reason (each also counted under its primary when known).
    pub refused: u64,
    /// Of `refused`: over a bound.
    pub refused_bound: u64,
    pub activations: u64,
    pub primaries: Vec<PrimaryStats>,
}

#[derive(Default)]
struct Group {
    seq: u64,
    /// foldhash, not SipHash: hashing was a third of the apply time of a 100-flow checkpoint.
    flows: FastMap<FlowKey, (u64, Vec<u8>)>,
    bytes: usize,
}

#[derive(Default)]
struct Primary {
    groups: BTreeMap<GroupId, Group>,
    shared: Option<Vec<u8>>,
    fence: u64,
    token: u64,
    checkpoints: u64,
    refused: u64,
}

impl Primary {
    fn flows(&self) -> usize {
        self.groups.values().map(|g| g.flows.len()).sum()
    }
    fn bytes(&self) -> usize {
        self.groups.values().map(|g| g.bytes).sum::<usize>()
            + self.shared.as_ref().map_or(0, Vec::len)
    }
}

pub struct StandbyStore {
    max_flows: usize,
    max_bytes: usize,
    primaries: HashMap<String, Primary>,
    /// Totals over all primaries, kept in step with every change (checked against bounds).
    flows: usize,
    bytes: usize,
    checkpoints: u64,
    refused: u64,
    refused_bound: u64,
    activations: u64,
}

/// One staged change: the key, the length of the record the group holds for it now (if any),
/// and the new record (`None` deletes the key).
type Staged = (FlowKey, Option<usize>, Option<(u64, Vec<u8>)>);

impl StandbyStore {
    /// A store of at most `max_flows` records and [`DEFAULT_MAX_BYTES`] record bytes.
    pub fn new(max_flows: usize) -> StandbyStore {
        StandbyStore::with_max_bytes(max_flows, DEFAULT_MAX_BYTES)
    }

    pub fn with_max_bytes(max_flows: usize, max_bytes: usize) -> StandbyStore {
        StandbyStore {
            max_flows,
            max_bytes,
            primaries: HashMap::new(),
            flows: 0,
            bytes: 0,
            checkpoints: 0,
            refused: 0,
            refused_bound: 0,
            activations: 0,
        }
    }

    /// `Err(Fenced)` if checkpoints from `primary` under `token` would be refused (the
    /// replication server checks this at `Hello`, before any checkpoint).
    pub fn check_token(&self, primary: &str, token: u64) -> Result<(), StandbyError> {
        match self.primaries.get(primary) {
            Some(p) if token < p.fence => Err(StandbyError::Fenced {
                primary: primary.to_string(),
                token,
                fence: p.fence,
            }),
            _ => Ok(()),
        }
    }

    /// Applies one checkpoint atomically (all of it or none; see the module docs). Returns the
    /// checkpoint's seq, which the backup then acknowledges.
    pub fn apply(
        &mut self,
        primary: &str,
        token: u64,
        cp: &Checkpoint,
    ) -> Result<u64, StandbyError> {
        let r = self.try_apply(primary, token, cp);
        if let Err(e) = &r {
            self.refused += 1;
            if matches!(
                e,
                StandbyError::OverBound { .. }
                    | StandbyError::TooManyGroups { .. }
                    | StandbyError::TooManyPrimaries
            ) {
                self.refused_bound += 1;
            }
            if let Some(p) = self.primaries.get_mut(primary) {
                p.refused += 1;
            }
            tracing::debug!(primary, group = cp.group, seq = cp.seq, error = %e, "standby checkpoint refused");
        }
        r
    }

    fn try_apply(
        &mut self,
        primary: &str,
        token: u64,
        cp: &Checkpoint,
    ) -> Result<u64, StandbyError> {
        self.check_token(primary, token)?;
        if !self.primaries.contains_key(primary) && self.primaries.len() >= MAX_PRIMARIES {
            return Err(StandbyError::TooManyPrimaries);
        }
        let empty = Group::default();
        let (held_group, group_count) = match self.primaries.get(primary) {
            Some(p) => (p.groups.get(&cp.group), p.groups.len()),
            None => (None, 0),
        };
        if held_group.is_none() && group_count >= MAX_GROUPS_PER_PRIMARY {
            return Err(StandbyError::TooManyGroups {
                primary: primary.to_string(),
            });
        }
        if let (Some(g), false) = (held_group, cp.full) {
            if cp.seq != g.seq.saturating_add(1) {
                return Err(StandbyError::SeqGap {
                    group: cp.group,
                    held: g.seq,
                    got: cp.seq,
                });
            }
        }
        let base = held_group.unwrap_or(&empty);

        if let Some(key) = cp.duplicate_key() {
            return Err(StandbyError::DuplicateKey {
                group: cp.group,
                seq: cp.seq,
                key,
            });
        }
        // Stage: decode every update against what the group holds now.
        let mut staged: Vec<Staged> = Vec::with_capacity(cp.flows.len());
        for u in &cp.flows {
            let held = base.flows.get(&u.key);
            let rec = match &u.body {
                UpdateBody::Full(bytes) => Some((u.version, bytes.clone())),
                UpdateBody::Delta {
                    base_version,
                    bytes,
                } => {
                    let held_rec = match held {
                        Some((v, rec)) if v == base_version => rec,
                        _ => {
                            return Err(StandbyError::MissingBase {
                                group: cp.group,
                                seq: cp.seq,
                                key: u.key,
                                base_version: *base_version,
                                held: held.map(|(v, _)| *v),
                            })
                        }
                    };
                    let rec =
                        delta::decode(held_rec, bytes).map_err(|error| StandbyError::BadDelta {
                            group: cp.group,
                            seq: cp.seq,
                            key: u.key,
                            error,
                        })?;
                    Some((u.version, rec))
                }
                UpdateBody::Deleted => None,
            };
            staged.push((u.key, held.map(|(_, r)| r.len()), rec));
        }

        // Bounds, on the totals the store would hold afterwards.
        let (new_flows, new_bytes) = if cp.full {
            let (f, b) = staged
                .iter()
                .filter_map(|(_, _, r)| r.as_ref())
                .fold((0usize, 0usize), |(f, b), (_, rec)| (f + 1, b + rec.len()));
            (
                self.flows - base.flows.len() + f,
                self.bytes - base.bytes + b,
            )
        } else {
            let (mut f, mut b) = (self.flows, self.bytes);
            for (_, old, r) in &staged {
                if let Some(old) = old {
                    f -= 1;
                    b -= old;
                }
                if let Some((_, rec)) = r {
                    f += 1;
                    b += rec.len();
                }
            }
            (f, b)
        };
        let shared_delta = match (&cp.shared, self.primaries.get(primary)) {
            (Some(new), Some(p)) => {
                new.len() as isize - p.shared.as_ref().map_or(0, Vec::len) as isize
            }
            (Some(new), None) => new.len() as isize,
            (None, _) => 0,
        };
        let new_bytes = new_bytes.saturating_add_signed(shared_delta);
        if new_flows > self.max_flows || new_bytes > self.max_bytes {
            return Err(StandbyError::OverBound {
                flows: new_flows,
                bytes: new_bytes,
                max_flows: self.max_flows,
                max_bytes: self.max_bytes,
            });
        }

        // Commit: nothing below can fail.
        let p = self.primaries.entry(primary.to_string()).or_default();
        // Invariant 7 (fencing): state from a token below the fence is never taken.
        assert!(token >= p.fence, "applying a fenced checkpoint");
        let g = p.groups.entry(cp.group).or_default();
        if cp.full {
            g.flows.clear();
            g.bytes = 0;
        }
        for (k, _, r) in staged {
            let old = match r {
                Some((v, rec)) => {
                    g.bytes += rec.len();
                    g.flows.insert(k, (v, rec))
                }
                None => g.flows.remove(&k),
            };
            if let Some((_, old)) = old {
                g.bytes -= old.len();
            }
        }
        g.seq = cp.seq;
        if let Some(s) = &cp.shared {
            p.shared = Some(s.clone());
        }
        p.token = p.token.max(token);
        p.checkpoints += 1;
        self.flows = new_flows;
        self.bytes = new_bytes;
        self.checkpoints += 1;
        debug_assert_eq!(
            self.flows,
            self.primaries.values().map(Primary::flows).sum::<usize>()
        );
        debug_assert_eq!(
            self.bytes,
            self.primaries.values().map(Primary::bytes).sum::<usize>()
        );
        Ok(cp.seq)
    }

    /// Highest applied seq per group for `primary` (for `Welcome`), by group id.
    pub fn held(&self, primary: &str) -> Vec<(GroupId, u64)> {
        self.primaries
            .get(primary)
            .map(|p| p.groups.iter().map(|(g, s)| (*g, s.seq)).collect())
            .unwrap_or_default()
    }

    /// Fencing + takeover: refuses `token` below an earlier activation's (`Fenced`), raises the
    /// fence to `token`, and takes every flow record of `primary` (all groups, one per key:
    /// the highest version) for import into the live table, forgetting them here; also returns
    /// the newest `shared` blob and the last applied seq per group. An unknown primary yields
    /// an empty `Activated` but is still fenced.
    pub fn activate(&mut self, primary: &str, token: u64) -> Result<Activated, StandbyError> {
        self.check_token(primary, token)?;
        if !self.primaries.contains_key(primary) && self.primaries.len() >= MAX_PRIMARIES {
            // The fence must be recorded; evict nothing silently.
            return Err(StandbyError::TooManyPrimaries);
        }
        let p = self.primaries.entry(primary.to_string()).or_default();
        // Invariant 7 (fencing): the fence only rises; an older token never activates.
        assert!(token >= p.fence, "activating under a fenced token");
        p.fence = token;
        let last_seq: Vec<(GroupId, u64)> = p.groups.iter().map(|(g, s)| (*g, s.seq)).collect();
        let mut best: FastMap<FlowKey, (u64, Vec<u8>)> = FastMap::new();
        for (_, g) in std::mem::take(&mut p.groups) {
            self.flows -= g.flows.len();
            self.bytes -= g.bytes;
            for (k, (v, rec)) in g.flows {
                match best.get(&k) {
                    Some((held_v, _)) if *held_v >= v => {}
                    _ => {
                        best.insert(k, (v, rec));
                    }
                }
            }
        }
        let shared = p.shared.take();
        self.bytes -= shared.as_ref().map_or(0, Vec::len);
        let mut keyed: Vec<(FlowKey, Vec<u8>)> =
            best.into_iter().map(|(k, (_, r))| (k, r)).collect();
        // Deterministic order (tests, logs).
        keyed.sort_by_key(|a| a.0);
        self.activations += 1;
        Ok(Activated {
            records: keyed.into_iter().map(|(_, r)| r).collect(),
            shared,
            last_seq,
        })
    }

    /// Forgets a primary's standby state (it was re-protected elsewhere / scaled in). Returns
    /// how many flow records were dropped. Its fence, if any, is kept.
    /// Forgets every primary's standby state, fences included (a replica rejoining after a
    /// partition: whatever it held is stale, its primaries are protected elsewhere now).
    /// Returns the flows dropped.
    pub fn drop_all(&mut self) -> usize {
        let n = self.flows;
        self.primaries.clear();
        self.flows = 0;
        self.bytes = 0;
        n
    }

    pub fn drop_primary(&mut self, primary: &str) -> usize {
        let Some(p) = self.primaries.get_mut(primary) else {
            return 0;
        };
        let n = p.flows();
        self.flows -= n;
        self.bytes -= p.bytes();
        p.groups.clear();
        p.shared = None;
        if p.fence == 0 {
            self.primaries.remove(primary);
        }
        n
    }

    pub fn stats(&self) -> StandbyStats {
        let mut primaries: Vec<PrimaryStats> = self
            .primaries
            .iter()
            .map(|(name, p)| PrimaryStats {
                primary: name.clone(),
                flows: p.flows(),
                groups: p.groups.iter().map(|(g, s)| (*g, s.seq)).collect(),
                bytes: p.bytes(),
                checkpoints: p.checkpoints,
                refused: p.refused,
                fence: p.fence,
                token: p.token,
            })
            .collect();
        primaries.sort_by(|a, b| a.primary.cmp(&b.primary));
        StandbyStats {
            flows: self.flows,
            bytes: self.bytes,
            max_flows: self.max_flows,
            max_bytes: self.max_bytes,
            checkpoints: self.checkpoints,
            refused: self.refused,
            refused_bound: self.refused_bound,
            activations: self.activations,
            primaries,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::FlowUpdate;
    use pliant_state::{FlowTable, TableConfig};
    use serde::Deserialize;
    use std::time::{Duration, Instant};

    /// A small NF-like per-flow state: counters and a sequence number change per packet.
    #[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
    struct St {
        packets: u64,
        bytes: u64,
        last_seq: u32,
        ext_port: u16,
        note: String,
    }

    fn key(i: u16) -> FlowKey {
        FlowKey::v4(6, [10, 0, 0, 1].into(), 1000 + i, [10, 0, 0, 2].into(), 80).0
    }

    struct Primary {
        t: FlowTable<St>,
        now: Instant,
    }

    impl Primary {
        fn new() -> Primary {
            Primary {
                t: FlowTable::new(TableConfig::default()),
                now: Instant::now(),
            }
        }
        fn add(&mut self, i: u16) {
            let st = St {
                packets: 0,
                bytes: 0,
                last_seq: 7,
                ext_port: 40000 + i,
                note: "flow".into(),
            };
            self.t.create_flow(key(i), st).unwrap();
            self.t
                .flow_timer(&key(i), Duration::from_secs(30), 1, self.now)
                .unwrap();
        }
        /// One packet through flow `i` (a modifying transaction).
        fn touch(&mut self, i: u16, len: u64) {
            let r = self.t.get_flow(&key(i)).unwrap();
            let s = self.t.state_mut(&r);
            s.packets += 1;
            s.bytes += len;
            s.last_seq = s.last_seq.wrapping_add(len as u32);
            self.t.put_flow(r, true);
        }
        fn snap(&mut self, i: u16) -> (u64, Vec<u8>) {
            let v = self.t.version(&key(i)).unwrap();
            (v, self.t.snapshot_flow(&key(i), self.now).unwrap())
        }
    }

    fn full_update(i: u16, (v, rec): (u64, Vec<u8>)) -> FlowUpdate {
        FlowUpdate {
            key: key(i),
            version: v,
            body: UpdateBody::Full(rec),
        }
    }

    fn cp(group: GroupId, seq: u64, full: bool, flows: Vec<FlowUpdate>) -> Checkpoint {
        Checkpoint {
            group,
            seq,
            full,
            flows,
            shared: None,
        }
    }

    #[test]
    fn delta_chain_over_100_versions_reproduces_the_exact_record() {
        let mut p = Primary::new();
        p.add(1);
        let mut s = StandbyStore::new(100);
        let (mut v, mut rec) = p.snap(1);
        s.apply(
            "r1",
            1,
            &cp(1, 1, true, vec![full_update(1, (v, rec.clone()))]),
        )
        .unwrap();
        let mut delta_bytes = 0;
        for i in 0..100u64 {
            p.touch(1, 100 + i);
            let (nv, nrec) = p.snap(1);
            assert!(nv > v);
            let d = delta::encode(&rec, &nrec);
            delta_bytes += d.len();
            let u = FlowUpdate {
                key: key(1),
                version: nv,
                body: UpdateBody::Delta {
                    base_version: v,
                    bytes: d,
                },
            };
            assert_eq!(
                s.apply("r1", 1, &cp(1, i + 2, false, vec![u])).unwrap(),
                i + 2
            );
            (v, rec) = (nv, nrec);
        }
        assert!(
            delta_bytes < 100 * rec.len(),
            "deltas should be smaller than records"
        );
        assert_eq!(s.held("r1"), vec![(1, 101)]);
        let a = s.activate("r1", 2).unwrap();
        assert_eq!(
            a.records,
            vec![rec.clone()],
            "the exact bytes of the last snapshot"
        );
        assert_eq!(a.last_seq, vec![(1, 101)]);
        // And it imports into a live table with the primary's state and version.
        let mut live: FlowTable<St> = FlowTable::new(TableConfig::default());
        let k = live.import_flow(&a.records[0], p.now).unwrap();
        assert_eq!(k, key(1));
        assert_eq!(live.peek(&k), p.t.peek(&k));
        assert_eq!(live.version(&k), Some(v));
        assert_eq!(live.timers_of(&k).map(|t| t.len()), Some(1));
        assert_eq!(s.stats().flows, 0);
        assert_eq!(s.stats().bytes, 0);
    }

    #[test]
    fn a_missing_base_refuses_the_whole_checkpoint() {
        let mut p = Primary::new();
        for i in 1..=3 {
            p.add(i);
        }
        let mut s = StandbyStore::new(100);
        let (v1, r1) = p.snap(1);
        s.apply(
            "r1",
            1,
            &cp(1, 1, true, vec![full_update(1, (v1, r1.clone()))]),
        )
        .unwrap();
        let before = s.stats();
        p.touch(1, 10);
        let (v1b, r1b) = p.snap(1);
        let good_delta = FlowUpdate {
            key: key(1),
            version: v1b,
            body: UpdateBody::Delta {
                base_version: v1,
                bytes: delta::encode(&r1, &r1b),
            },
        };
        let (v2, r2) = p.snap(2);
        let bad = FlowUpdate {
            key: key(3),
            version: 5,
            body: UpdateBody::Delta {
                base_version: 4,
                bytes: vec![0, 0, 0],
            },
        };
        let e = s
            .apply(
                "r1",
                1,
                &cp(
                    1,
                    2,
                    false,
                    vec![good_delta.clone(), full_update(2, (v2, r2)), bad],
                ),
            )
            .unwrap_err();
        assert!(
            matches!(
                e,
                StandbyError::MissingBase {
                    base_version: 4,
                    held: None,
                    ..
                }
            ),
            "{e}"
        );
        let after = s.stats();
        assert_eq!(after.refused, 1);
        assert_eq!(after.flows, before.flows);
        assert_eq!(after.bytes, before.bytes);
        assert_eq!(s.held("r1"), vec![(1, 1)], "seq did not advance");
        // A delta against the wrong version of a held flow is refused the same way.
        let mut wrong = good_delta.clone();
        wrong.body = UpdateBody::Delta {
            base_version: v1 + 7,
            bytes: delta::encode(&r1, &r1b),
        };
        assert!(matches!(
            s.apply("r1", 1, &cp(1, 2, false, vec![wrong])),
            Err(StandbyError::MissingBase { held: Some(_), .. })
        ));
        // A hostile delta is an error, not a panic.
        let mut hostile = good_delta.clone();
        hostile.body = UpdateBody::Delta {
            base_version: v1,
            bytes: vec![0xff; 12],
        };
        assert!(matches!(
            s.apply("r1", 1, &cp(1, 2, false, vec![hostile])),
            Err(StandbyError::BadDelta { .. })
        ));
        // Nothing of the refused checkpoints leaked: the group still holds the seq-1 record.
        s.apply("r1", 1, &cp(1, 2, false, vec![good_delta]))
            .unwrap();
        let a = s.activate("r1", 2).unwrap();
        assert_eq!(a.records, vec![r1b]);
    }

    #[test]
    fn deleted_and_full_replace_what_the_group_holds() {
        let mut p = Primary::new();
        for i in 1..=4 {
            p.add(i);
        }
        let mut s = StandbyStore::new(100);
        let a = full_update(1, p.snap(1));
        let b = full_update(2, p.snap(2));
        s.apply("r1", 1, &cp(1, 1, true, vec![a, b])).unwrap();
        // Another group of the same primary is independent.
        s.apply("r1", 1, &cp(2, 1, true, vec![full_update(4, p.snap(4))]))
            .unwrap();
        assert_eq!(s.stats().flows, 3);
        let del = FlowUpdate {
            key: key(1),
            version: 99,
            body: UpdateBody::Deleted,
        };
        s.apply("r1", 1, &cp(1, 2, false, vec![del])).unwrap();
        assert_eq!(s.stats().flows, 2);
        // full=true replaces group 1 (flow 2 goes, flow 3 comes); group 2 untouched.
        let c = p.snap(3);
        s.apply("r1", 1, &cp(1, 3, true, vec![full_update(3, c.clone())]))
            .unwrap();
        assert_eq!(s.held("r1"), vec![(1, 3), (2, 1)]);
        let st = s.stats();
        assert_eq!(st.flows, 2);
        assert_eq!(st.primaries[0].flows, 2);
        let act = s.activate("r1", 2).unwrap();
        let d = p.snap(4).1;
        let mut want = vec![c.1, d];
        want.sort();
        let mut got = act.records.clone();
        got.sort();
        assert_eq!(got, want);
    }

    #[test]
    fn sequence_gaps_are_refused_and_full_restarts() {
        let mut p = Primary::new();
        p.add(1);
        let mut s = StandbyStore::new(10);
        let f = full_update(1, p.snap(1));
        s.apply("r1", 1, &cp(1, 5, true, vec![f.clone()])).unwrap();
        assert!(matches!(
            s.apply("r1", 1, &cp(1, 7, false, vec![])),
            Err(StandbyError::SeqGap {
                held: 5,
                got: 7,
                ..
            })
        ));
        assert!(matches!(
            s.apply("r1", 1, &cp(1, 5, false, vec![])),
            Err(StandbyError::SeqGap { .. })
        ));
        s.apply("r1", 1, &cp(1, 6, false, vec![])).unwrap();
        s.apply("r1", 1, &cp(1, 1, true, vec![f.clone()])).unwrap();
        assert_eq!(s.held("r1"), vec![(1, 1)]);
        assert!(matches!(
            s.apply("r1", 1, &cp(1, 2, false, vec![f.clone(), f])),
            Err(StandbyError::DuplicateKey { .. })
        ));
    }

    #[test]
    fn stale_token_is_refused_after_activate() {
        let mut p = Primary::new();
        p.add(1);
        let mut s = StandbyStore::new(10);
        let f = full_update(1, p.snap(1));
        s.apply("r1", 5, &cp(1, 1, true, vec![f.clone()])).unwrap();
        assert_eq!(s.check_token("r1", 5), Ok(()));
        let a = s.activate("r1", 6).unwrap();
        assert_eq!(a.records.len(), 1);
        let e = s
            .apply("r1", 5, &cp(1, 1, true, vec![f.clone()]))
            .unwrap_err();
        assert!(
            matches!(
                e,
                StandbyError::Fenced {
                    token: 5,
                    fence: 6,
                    ..
                }
            ),
            "{e}"
        );
        assert!(s.check_token("r1", 5).is_err());
        assert!(matches!(
            s.activate("r1", 5),
            Err(StandbyError::Fenced { .. })
        ));
        assert_eq!(s.stats().flows, 0, "the fenced checkpoint applied nothing");
        // The fence survives drop_primary; a newer token is accepted.
        assert_eq!(s.drop_primary("r1"), 0);
        assert!(s.apply("r1", 5, &cp(1, 1, true, vec![f.clone()])).is_err());
        s.apply("r1", 6, &cp(1, 1, true, vec![f])).unwrap();
        assert_eq!(s.drop_primary("r1"), 1);
        assert_eq!(s.stats().flows, 0);
        // Activating an unknown primary fences it too.
        assert_eq!(s.activate("r9", 3).unwrap(), Activated::default());
        assert!(s.check_token("r9", 2).is_err());
    }

    #[test]
    fn bounds_refuse_whole_checkpoints_and_are_counted() {
        let mut p = Primary::new();
        for i in 1..=5 {
            p.add(i);
        }
        let mut s = StandbyStore::new(3);
        let all: Vec<FlowUpdate> = (1..=4).map(|i| full_update(i, p.snap(i))).collect();
        let e = s.apply("r1", 1, &cp(1, 1, true, all.clone())).unwrap_err();
        assert!(
            matches!(
                e,
                StandbyError::OverBound {
                    flows: 4,
                    max_flows: 3,
                    ..
                }
            ),
            "{e}"
        );
        assert_eq!(s.stats().flows, 0);
        s.apply("r1", 1, &cp(1, 1, true, all[..3].to_vec()))
            .unwrap();
        // Adding one more, even in another group or for another primary, is over the bound.
        assert!(s
            .apply("r1", 1, &cp(1, 2, false, vec![all[3].clone()]))
            .is_err());
        assert!(s
            .apply("r2", 1, &cp(1, 1, true, vec![all[3].clone()]))
            .is_err());
        // Replacing a held flow or deleting one to make room is fine.
        let del = FlowUpdate {
            key: key(1),
            version: 9,
            body: UpdateBody::Deleted,
        };
        s.apply("r1", 1, &cp(1, 2, false, vec![del, all[3].clone()]))
            .unwrap();
        s.apply("r1", 1, &cp(1, 3, false, vec![all[1].clone()]))
            .unwrap();
        let st = s.stats();
        assert_eq!(st.flows, 3);
        assert_eq!(st.refused, 3);
        assert_eq!(st.refused_bound, 3);
        // A byte bound holds the same way.
        let rec_len = match &all[0].body {
            UpdateBody::Full(r) => r.len(),
            _ => unreachable!(),
        };
        let mut b = StandbyStore::with_max_bytes(100, rec_len * 2);
        assert!(b
            .apply("r1", 1, &cp(1, 1, true, all[..3].to_vec()))
            .is_err());
        b.apply("r1", 1, &cp(1, 1, true, all[..2].to_vec()))
            .unwrap();
        let mut shared = cp(1, 2, false, vec![]);
        shared.shared = Some(vec![0; 1]);
        assert!(matches!(
            b.apply("r1", 1, &shared),
            Err(StandbyError::OverBound { .. })
        ));
        assert_eq!(b.stats().bytes, rec_len * 2);
    }

    #[test]
    fn activation_keeps_one_record_per_key_and_the_shared_blob() {
        let mut p = Primary::new();
        p.add(1);
        let old = p.snap(1);
        p.touch(1, 5);
        let new = p.snap(1);
        let mut s = StandbyStore::new(10);
        // The flow moved from group 1 to group 2 and both copies are held.
        s.apply("r1", 1, &cp(2, 1, true, vec![full_update(1, new.clone())]))
            .unwrap();
        let mut c = cp(1, 1, true, vec![full_update(1, old)]);
        c.shared = Some(b"shared-v1".to_vec());
        s.apply("r1", 1, &c).unwrap();
        let mut c = cp(1, 2, false, vec![]);
        c.shared = Some(b"shared-v2".to_vec());
        s.apply("r1", 1, &c).unwrap();
        assert_eq!(s.stats().bytes, 2 * new.1.len() + 9);
        let a = s.activate("r1", 2).unwrap();
        assert_eq!(a.records, vec![new.1]);
        assert_eq!(a.shared.as_deref(), Some(&b"shared-v2"[..]));
        assert_eq!(a.last_seq, vec![(1, 2), (2, 1)]);
        assert!(s.held("r1").is_empty());
        assert_eq!(s.stats().bytes, 0);
        assert_eq!(s.stats().activations, 1);
    }
}
