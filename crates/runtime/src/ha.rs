//! Pico replication on the primary side (and its Remus-mode baseline), driven by the packet
//! thread between batches. See crates/runtime/README.md, "High availability: output commit",
//! for what each packet waits for.
//!
//! Per round, when a policy is set:
//! 1. start of round: poll every backup link ([`ReplLink`]); acks release held output through
//!    the [`OutputGate`]; a dead link turns its groups unprotected (held output released,
//!    `needs_backup`); a (re)connect whose `Welcome` does not show our last checkpoint forces
//!    a full resync of the link's groups;
//! 2. the NF runs; keys of received packets, fired timers and `pkt_write` output are noted
//!    ("touched");
//! 3. route: touched keys are resolved to their flow (primary key), given a replication record
//!    ([`FlowRep`]: group, last shipped version + seq, last shipped bytes) and queued as dirty
//!    in their group when their version moved; each output packet gets its [`Verdict`] from
//!    [`output_rule`] and is sent or held;
//! 4. end of round: every group whose epoch is due ships a checkpoint of its dirty flows
//!    (snapshot, XOR+RLE delta against the last shipped bytes, `Deleted` for flows gone);
//!    a busy flow (refcount > 0) stays dirty and its held output moves to the next epoch.
//!    Remus mode ships every flow in full plus the shared store each epoch; the packet thread
//!    is single-threaded, so the NF processes nothing while the copy is taken.
//!
//! A sweep over the whole table every [`SWEEP_EVERY`] catches what touching cannot see (a
//! flow changed or deleted while another flow's packet was processed).

use crate::nf::{OutputKind, Packet};
use pliant_ha::audit::{Exit, ExitAudit};
use pliant_ha::delta;
use pliant_ha::gate::{
    direct_rule, output_rule, Dep, FlowFacts, GroupFacts, HoldRefused, OutputGate, SyncState,
    Verdict,
};
use pliant_ha::policy::{Assigner, BackupTarget, GroupSpec, Policy};
use pliant_ha::{Ack, Checkpoint, FlowUpdate, GroupId, UpdateBody};
use pliant_state::{FlowKey, FlowState, FlowTable, SharedStore, StateError};
use serde_json::{json, Value};
// foldhash, as the flow table: these maps are consulted per packet, SipHash showed up first
// in the profile.
use foldhash::HashMap;
use std::os::fd::RawFd;
use std::time::{Duration, Instant};

/// Held packets per group at most (beyond: dropped, `dropped_hold_full`).
pub const MAX_HELD_PER_GROUP: usize = 1 << 16;
/// Touched keys remembered per round at most; beyond, the round ends with a full sweep.
pub const MAX_TOUCHED: usize = 1 << 16;
/// Period of the backstop sweep over the whole flow table.
pub const SWEEP_EVERY: Duration = Duration::from_secs(1);
/// A Pico checkpoint stops taking flows at about this many bytes (the rest ship next epoch;
/// the wire's frame bound is 8 MiB).
pub const MAX_CHECKPOINT_BYTES: usize = 4 << 20;
/// Retry delay after the link's queue was full.
const FULL_RETRY: Duration = Duration::from_millis(1);
/// Bytes counted per flow update besides its body (key, version, tags), for `bytes_shipped`.
const UPDATE_OVERHEAD: u64 = 48;

/// Why a checkpoint could not be queued on a link.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LinkError {
    /// The link's bounded queue is full: try again later (nothing was sent).
    Full,
    /// The link is dead.
    Dead,
}

/// What a link reports when polled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LinkStatus {
    Connecting,
    /// Connected; `session` changes on every (re)connection, `welcome` is what the backup
    /// said it holds of us when that session started (group, highest applied seq).
    Up {
        session: u64,
        welcome: Vec<(GroupId, u64)>,
    },
    Dead {
        reason: String,
    },
}

/// The primary's end of a replication channel to one backup. Implemented over
/// `pliant_ha::transport::ReplSender` in the replica; tests use an in-memory fake.
pub trait ReplLink: Send {
    /// Queues a checkpoint (non-blocking).
    fn send(&mut self, cp: Checkpoint) -> Result<(), LinkError>;
    /// Acks received since the last call (cumulative per group) and the link state.
    fn poll(&mut self, acks: &mut Vec<Ack>) -> LinkStatus;
    /// Readable when acks or a state change are waiting (for poll(2)).
    fn wake_fd(&self) -> Option<RawFd> {
        None
    }
    fn drain_wake(&self) {}
    /// Bytes written to the channel so far (frames included), if the link knows.
    fn bytes_sent(&self) -> Option<u64> {
        None
    }
}

/// Opens links to backups (one per backup socket).
pub trait LinkFactory: Send {
    fn connect(&mut self, backup: &BackupTarget, primary: &str, token: u64) -> Box<dyn ReplLink>;
}

/// A packet held until its checkpoint is acknowledged.
pub(crate) struct Held {
    pub pkt: Packet,
    /// What the output-commit audit needs when it leaves; `exit.key` is the flow's primary key
    /// (`None`: direct output held in Remus mode).
    pub exit: Exit,
}

/// Replication record of one protected flow (by primary key).
struct FlowRep {
    group: GroupId,
    /// (version, seq) last shipped to the group's backup.
    shipped: Option<(u64, u64)>,
    /// The record bytes last shipped (delta base).
    base: Vec<u8>,
    /// Queued in its group's dirty list.
    queued: bool,
    aliases: Vec<FlowKey>,
    /// Syncing into its group after its old backup died (see [`SyncState`]).
    sync: SyncState,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum GroupState {
    Connecting,
    Up,
    /// Its backup died: the group runs unprotected until a new `protect`.
    Unprotected,
    /// The backup refused us as fenced: our flows were activated elsewhere under a newer
    /// token (design invariant 7). We no longer own them: their output is dropped.
    Fenced,
}

impl GroupState {
    fn name(self) -> &'static str {
        match self {
            GroupState::Connecting => "connecting",
            GroupState::Up => "up",
            GroupState::Unprotected => "unprotected",
            GroupState::Fenced => "fenced",
        }
    }
}

struct Group {
    /// Wire id (unique over this process's lifetime, so a retiring group never shares an id
    /// with its successor on the same backup).
    id: GroupId,
    spec: GroupSpec,
    link: usize,
    period: Duration,
    next_due: Instant,
    state: GroupState,
    /// Replaced by a newer policy: takes no new flows, leaves once its held output is out.
    retiring: bool,
    /// The next checkpoint is `full` (first one, or the backup lost what we sent).
    needs_full: bool,
    dirty: Vec<FlowKey>,
    /// Flows that moved from this group to another one and were shipped here: this backup's
    /// copy must go (else a failover activates the flow on two survivors, invariant 1), but
    /// only once the successor group acknowledged the checkpoint carrying it (else, for a
    /// moment, no backup would hold it). `(key, successor group, successor seq)`.
    evict: Vec<(FlowKey, GroupId, u64)>,
    /// Evictions whose successor acknowledged: shipped as `Deleted` in the next checkpoint.
    deletes: Vec<FlowKey>,
    /// Last seq shipped (0: none yet).
    last_seq: u64,
    checkpoints: u64,
    bytes_shipped: u64,
    bytes_full_equiv: u64,
    needs_backup: bool,
    busy_retries: u64,
    send_full: u64,
    dead_reason: Option<String>,
}

struct Link {
    socket: String,
    link: Box<dyn ReplLink>,
    session: Option<u64>,
    dead: bool,
}

/// Output counters (`ha_status` → `output`).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct OutStats {
    /// Held packets released after their checkpoint was acknowledged.
    pub released: u64,
    /// Held packets released because their group became unprotected.
    pub released_unprotected: u64,
    /// Output dropped because its group was fenced (held packets included).
    pub dropped_fenced: u64,
    /// `pkt_write` output that left at once: acked state it did not modify.
    pub bypassed_clean: u64,
    /// `pkt_write_direct` output that left at once.
    pub direct: u64,
    /// Output of flows in group 0 / unprotected groups.
    pub unprotected: u64,
    /// Output that left at once while its flow synced into a new group after its old backup
    /// died (see [`SyncState`]).
    pub syncing: u64,
    pub held: u64,
    pub dropped_hold_full: u64,
    /// Packets of protected groups checked by the output-commit audit when they left.
    pub audit_checked: u64,
    /// Checked packets that left before their state was acknowledged (must stay 0).
    pub audit_violations: u64,
    /// Packets that left exempt by design (direct output, unprotected groups).
    pub audit_exempt: u64,
}

impl OutStats {
    pub fn add(&mut self, o: &OutStats) {
        self.released += o.released;
        self.released_unprotected += o.released_unprotected;
        self.dropped_fenced += o.dropped_fenced;
        self.bypassed_clean += o.bypassed_clean;
        self.direct += o.direct;
        self.unprotected += o.unprotected;
        self.syncing += o.syncing;
        self.held += o.held;
        self.dropped_hold_full += o.dropped_hold_full;
        self.audit_checked += o.audit_checked;
        self.audit_violations += o.audit_violations;
        self.audit_exempt += o.audit_exempt;
    }
}

/// Counters of the checkpoint side.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ReplStats {
    pub sweeps: u64,
    pub touched_overflow: u64,
    pub snapshot_errors: u64,
    /// Remus epochs postponed because a flow was busy.
    pub remus_postponed: u64,
    pub resyncs: u64,
    /// Retired groups whose old backup copy was cleared (flows moved to other groups).
    pub standby_cleared: u64,
    /// Flows deleted from a backup after moving to another group (and being acked there).
    pub standby_evicted: u64,
    /// Held packets a policy change moved from a retiring group to their flow's new group.
    pub held_moved: u64,
}

/// What happens to one output packet.
pub(crate) enum Decision {
    /// Leaves now (the verdict says why: counted per kind).
    Now(Verdict),
    Hold(Dep),
    /// Its group is fenced: this replica no longer owns the flow.
    DropFenced,
}

impl From<Verdict> for Decision {
    fn from(v: Verdict) -> Decision {
        match v {
            Verdict::Wait(d) => Decision::Hold(d),
            other => Decision::Now(other),
        }
    }
}

/// Where an output packet goes.
pub(crate) enum Route {
    Now,
    Dropped,
}

fn primary_of<S: FlowState>(t: &FlowTable<S>, k: &FlowKey) -> Option<(FlowKey, u64)> {
    t.primary_and_version(k)
}

/// The primary side of HA: groups, links, replication records, held output.
pub struct HaPrimary {
    pub(crate) policy: Policy,
    assigner: Assigner,
    remus: bool,
    name: String,
    token: u64,
    groups: Vec<Group>,
    links: Vec<Link>,
    /// Policy group id (1-based index) -> wire id.
    wire_of_policy: Vec<GroupId>,
    reps: HashMap<FlowKey, FlowRep>,
    aliases: HashMap<FlowKey, FlowKey>,
    touched: Vec<FlowKey>,
    touched_overflow: bool,
    pub(crate) gate: OutputGate<Held>,
    /// Checks every packet that leaves against the checkpoints sent and the acks received,
    /// independently of `gate` (see `pliant_ha::audit`).
    audit: ExitAudit,
    /// Test-only fault: output that should wait leaves at once, so tests can show the audit
    /// counts early releases. Never set outside tests.
    fault_release_early: bool,
    /// Held output a policy change moved out of a retiring group that may leave now (its flow
    /// is unprotected) or must be dropped (the new group's queue is full).
    moved_out: Vec<(Held, Route)>,
    pub(crate) out: OutStats,
    pub(crate) repl: ReplStats,
    /// Round counter (the audit's clock: a packet is written and a checkpoint taken in a round).
    tick: u64,
    next_sweep: Instant,
    acks: Vec<Ack>,
}

impl HaPrimary {
    /// Starts protecting under `policy` (validated by the caller). `prev` is the replaced
    /// instance: groups with the same backup socket and name continue (same wire id, seq and
    /// replication records); the others retire (their held output still waits for their
    /// acks, or their link's death) and new ones start with a full checkpoint.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new<S: FlowState>(
        policy: Policy,
        name: &str,
        token: u64,
        factory: &mut dyn LinkFactory,
        table: &mut FlowTable<S>,
        now: Instant,
        next_wire_id: &mut GroupId,
        prev: Option<Box<HaPrimary>>,
    ) -> Box<HaPrimary> {
        let specs = policy.groups();
        let mut ha = Box::new(HaPrimary {
            assigner: Assigner::new(&policy),
            remus: policy.is_remus(),
            policy,
            name: name.to_string(),
            token,
            groups: Vec::new(),
            links: Vec::new(),
            wire_of_policy: Vec::new(),
            reps: HashMap::default(),
            aliases: HashMap::default(),
            touched: Vec::new(),
            touched_overflow: false,
            gate: OutputGate::new(MAX_HELD_PER_GROUP),
            audit: ExitAudit::new(),
            fault_release_early: false,
            moved_out: Vec::new(),
            out: OutStats::default(),
            repl: ReplStats::default(),
            tick: 0,
            next_sweep: now,
            acks: Vec::new(),
        });
        let mut old_groups = Vec::new();
        if let Some(mut p) = prev {
            // The gate, links and records carry over; counters too.
            std::mem::swap(&mut ha.gate, &mut p.gate);
            // What the backups acknowledged does not change with the policy.
            std::mem::swap(&mut ha.audit, &mut p.audit);
            ha.fault_release_early = p.fault_release_early;
            ha.links = std::mem::take(&mut p.links);
            ha.reps = std::mem::take(&mut p.reps);
            ha.aliases = std::mem::take(&mut p.aliases);
            ha.out = p.out.clone();
            ha.repl = p.repl.clone();
            ha.tick = p.tick;
            old_groups = std::mem::take(&mut p.groups);
            // A new token means a new Hello: links are re-opened below (old ones stay for
            // retiring groups).
        }
        for spec in specs {
            let reuse = old_groups.iter().position(|g| {
                !g.retiring
                    && !matches!(g.state, GroupState::Unprotected | GroupState::Fenced)
                    && g.spec.backup == spec.backup
                    && g.spec.name == spec.name
                    && !ha.links[g.link].dead
            });
            let period = Duration::from_secs_f64(1.0 / f64::from(spec.hz.max(1)));
            let g = match reuse {
                Some(i) => {
                    let mut g = old_groups.remove(i);
                    g.period = period;
                    g.spec = GroupSpec { id: g.id, ..spec };
                    g
                }
                None => {
                    let id = *next_wire_id;
                    *next_wire_id += 1;
                    let link = ha.link_for(&spec.backup, factory);
                    ha.gate.add_group(id, 1);
                    Group {
                        id,
                        spec: GroupSpec { id, ..spec },
                        link,
                        period,
                        next_due: now,
                        state: GroupState::Connecting,
                        retiring: false,
                        needs_full: true,
                        dirty: Vec::new(),
                        evict: Vec::new(),
                        deletes: Vec::new(),
                        last_seq: 0,
                        checkpoints: 0,
                        bytes_shipped: 0,
                        bytes_full_equiv: 0,
                        needs_backup: false,
                        busy_retries: 0,
                        send_full: 0,
                        dead_reason: None,
                    }
                }
            };
            ha.wire_of_policy.push(g.id);
            ha.groups.push(g);
        }
        for mut g in old_groups {
            g.retiring = true;
            g.dirty.clear();
            ha.groups.push(g);
        }
        // A link already up for a new group: the group starts once polled (session known).
        for g in ha.groups.iter_mut().filter(|g| !g.retiring) {
            if g.state == GroupState::Connecting {
                if let Some(_s) = ha.links[g.link].session {
                    g.state = GroupState::Up;
                }
            }
        }
        // Re-assign every tracked flow; a flow whose group changed ships in full to its new
        // group. Then pick up every flow of the table.
        let assigner = ha.assigner.clone();
        let wire = ha.wire_of_policy.clone();
        let wire_of = |p: GroupId| -> GroupId {
            if p == 0 {
                0
            } else {
                wire.get((p - 1) as usize).copied().unwrap_or(0)
            }
        };
        // Groups whose backup died: their flows run unprotected and sync into their new group.
        let dead: Vec<GroupId> = ha
            .groups
            .iter()
            .filter(|g| g.state == GroupState::Unprotected)
            .map(|g| g.id)
            .collect();
        let mut gone = Vec::new();
        // (key, old group, new group) of flows the old group's backup holds.
        let mut moved = Vec::new();
        // (key, new group) of every flow whose group changed.
        let mut arrived = Vec::new();
        for (k, rep) in ha.reps.iter_mut() {
            let g = wire_of(assigner.assign(k));
            if g != rep.group {
                if rep.shipped.is_some() {
                    moved.push((*k, rep.group, g));
                }
                arrived.push((*k, g));
                rep.sync = if dead.contains(&rep.group) && !ha.remus {
                    SyncState::UntilShipped
                } else {
                    SyncState::Synced
                };
                rep.group = g;
                rep.shipped = None;
                rep.base.clear();
                rep.queued = false;
            }
            if g == 0 {
                gone.push(*k);
            }
        }
        for k in gone {
            ha.forget(&k);
        }
        // A flow back in a (reused) group that was to evict it: that eviction is void, the
        // group ships the flow in full instead (a `Deleted` beside it would carry the flow
        // twice in one checkpoint, which the backup refuses as a whole).
        for (k, new) in arrived {
            if let Some(ng) = ha.groups.iter_mut().find(|g| g.id == new) {
                ng.evict.retain(|e| e.0 != k);
                ng.deletes.retain(|d| *d != k);
            }
        }
        for (k, old, new) in moved {
            // The successor's next checkpoint carries the flow (its copy was reset above).
            let wait = if new == 0 {
                None
            } else {
                ha.gate.open_seq(new)
            };
            if let Some(og) = ha.groups.iter_mut().find(|g| g.id == old) {
                match wait {
                    Some(seq) => og.evict.push((k, new, seq)),
                    // Unprotected from now on: no successor to wait for.
                    None => og.deletes.push(k),
                }
            }
        }
        for g in ha.groups.iter_mut() {
            g.dirty.clear();
        }
        for rep in ha.reps.values_mut() {
            rep.queued = false;
        }
        if !ha.remus {
            ha.sweep(table, now);
        }
        ha.move_retiring_output();
        ha.drop_idle_links();
        ha
    }

    /// Output held by retiring groups moves to the group its flow belongs to now, behind
    /// nothing of its own flow (the new group's first checkpoint carries the flow in full, so
    /// it is the right thing to wait for). Left in place, it would wait for its old backup —
    /// possibly dead, then for a connect timeout — while the same flow's later packets, held
    /// by the new group, leave first (a flow reordered by pliant itself, design invariant 5).
    /// Output whose flow is now unprotected leaves at once ([`Self::take_moved_out`]).
    fn move_retiring_output(&mut self) {
        let retiring: Vec<GroupId> = self
            .groups
            .iter()
            .filter(|g| g.retiring)
            .map(|g| g.id)
            .collect();
        let epoch_group = self.groups.iter().find(|g| !g.retiring).map(|g| g.id);
        for old in retiring {
            let mut held = Vec::new();
            self.gate.take_held(old, &mut held);
            for mut h in held {
                let new = if self.remus {
                    epoch_group.unwrap_or(0)
                } else {
                    match h.exit.key {
                        Some(k) => self
                            .reps
                            .get(&k)
                            .map_or_else(|| self.wire_of(self.assigner.assign(&k)), |r| r.group),
                        None => 0,
                    }
                };
                self.repl.held_moved += 1;
                h.exit.group = new;
                let Some(seq) = self.gate.open_seq(new).filter(|_| new != 0) else {
                    self.out.released_unprotected += 1;
                    self.moved_out.push((h, Route::Now));
                    continue;
                };
                match self.gate.hold(Dep { group: new, seq }, h) {
                    Ok(()) => {}
                    Err(HoldRefused::Full(h)) => {
                        self.out.dropped_hold_full += 1;
                        self.moved_out.push((h, Route::Dropped));
                    }
                    Err(e) => self.moved_out.push((e.into_inner(), Route::Now)),
                }
            }
        }
    }

    /// Output that a policy change let go (see [`Self::move_retiring_output`]): to be routed
    /// (or dropped) by the engine right after `protect`.
    pub(crate) fn take_moved_out(&mut self) -> Vec<(Held, Route)> {
        std::mem::take(&mut self.moved_out)
    }

    fn link_for(&mut self, b: &BackupTarget, factory: &mut dyn LinkFactory) -> usize {
        if let Some(i) = self
            .links
            .iter()
            .position(|l| l.socket == b.socket && !l.dead)
        {
            return i;
        }
        self.links.push(Link {
            socket: b.socket.clone(),
            link: factory.connect(b, &self.name, self.token),
            session: None,
            dead: false,
        });
        self.links.len() - 1
    }

    /// Removes links no group uses (re-indexing the groups).
    fn drop_idle_links(&mut self) {
        let mut i = 0;
        while i < self.links.len() {
            if self.groups.iter().any(|g| g.link == i) {
                i += 1;
                continue;
            }
            self.links.remove(i);
            for g in self.groups.iter_mut() {
                if g.link > i {
                    g.link -= 1;
                }
            }
        }
    }

    pub fn is_remus(&self) -> bool {
        self.remus
    }

    /// The policy in force.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    pub fn token(&self) -> u64 {
        self.token
    }

    fn wire_of(&self, p: GroupId) -> GroupId {
        if p == 0 {
            return 0;
        }
        self.wire_of_policy
            .get((p - 1) as usize)
            .copied()
            .unwrap_or(0)
    }

    fn group(&self, id: GroupId) -> Option<&Group> {
        self.groups.iter().find(|g| g.id == id)
    }

    /// Notes a key whose flow may have changed in this round (hot path: one push).
    #[inline]
    pub(crate) fn touch(&mut self, k: FlowKey) {
        if self.remus {
            return; // Remus ships every flow every epoch.
        }
        // Consecutive packets of one flow are common in a batch: note it once.
        if self.touched.last() == Some(&k) {
            return;
        }
        if self.touched.len() < MAX_TOUCHED {
            self.touched.push(k);
        } else {
            self.touched_overflow = true;
        }
    }

    /// Creates or refreshes the record of the flow `k` resolves to; queues it as dirty when its
    /// version moved since it was shipped (or it is gone after being shipped).
    fn note<S: FlowState>(&mut self, t: &mut FlowTable<S>, k: FlowKey) {
        match primary_of(t, &k) {
            Some((p, v)) => {
                // Common case first: a known flow, one map lookup.
                if let Some(rep) = self.reps.get_mut(&p) {
                    let dirty = rep.shipped.is_none_or(|(sv, _)| sv != v);
                    if dirty && !rep.queued {
                        rep.queued = true;
                        let g = rep.group;
                        if let Some(grp) = self.groups.iter_mut().find(|x| x.id == g) {
                            grp.dirty.push(p);
                        }
                    }
                    return;
                }
                {
                    let g = self.wire_of(self.assigner.assign(&p));
                    if g == 0 {
                        return;
                    }
                    let aliases: Vec<FlowKey> = t
                        .keys_of(&p)
                        .unwrap_or_default()
                        .into_iter()
                        .filter(|a| *a != p)
                        .collect();
                    for a in &aliases {
                        self.aliases.insert(*a, p);
                    }
                    self.reps.insert(
                        p,
                        FlowRep {
                            group: g,
                            shipped: None,
                            base: Vec::new(),
                            queued: false,
                            aliases,
                            sync: SyncState::Synced,
                        },
                    );
                }
                self.queue_if_dirty(p, Some(v));
            }
            None => {
                let p = if self.reps.contains_key(&k) {
                    k
                } else if let Some(p) = self.aliases.get(&k) {
                    *p
                } else {
                    return;
                };
                self.queue_if_dirty(p, None);
            }
        }
    }

    fn queue_if_dirty(&mut self, p: FlowKey, v: Option<u64>) {
        let Some(rep) = self.reps.get_mut(&p) else {
            return;
        };
        let dirty = match (v, rep.shipped) {
            (None, None) => {
                // Gone and never shipped: nothing to tell the backup.
                let aliases = std::mem::take(&mut rep.aliases);
                if !rep.queued {
                    self.reps.remove(&p);
                    for a in aliases {
                        self.aliases.remove(&a);
                    }
                } else {
                    rep.aliases = aliases;
                }
                return;
            }
            (Some(v), Some((sv, _))) => v != sv,
            _ => true,
        };
        if dirty && !rep.queued {
            rep.queued = true;
            let g = rep.group;
            if let Some(grp) = self.groups.iter_mut().find(|x| x.id == g) {
                grp.dirty.push(p);
            }
        }
    }

    fn forget(&mut self, p: &FlowKey) {
        if let Some(rep) = self.reps.remove(p) {
            for a in rep.aliases {
                self.aliases.remove(&a);
            }
        }
    }

    /// Resolves this round's touched keys (before the output of the round is decided).
    pub(crate) fn settle<S: FlowState>(&mut self, t: &mut FlowTable<S>, now: Instant) {
        let mut touched = std::mem::take(&mut self.touched);
        for k in touched.drain(..) {
            self.note(t, k);
        }
        self.touched = touched;
        if self.touched_overflow {
            self.touched_overflow = false;
            self.repl.touched_overflow += 1;
            self.sweep(t, now);
        }
    }

    /// Backstop: notes every flow of the table and every record whose flow is gone.
    fn sweep<S: FlowState>(&mut self, t: &mut FlowTable<S>, now: Instant) {
        self.repl.sweeps += 1;
        self.next_sweep = now + SWEEP_EVERY;
        for k in t.keys() {
            self.note(t, k);
        }
        let gone: Vec<FlowKey> = self
            .reps
            .iter()
            .filter(|(k, r)| !r.queued && !t.contains(k))
            .map(|(k, _)| *k)
            .collect();
        for k in gone {
            self.queue_if_dirty(k, None);
        }
    }

    fn facts(&self, g: &Group) -> GroupFacts {
        GroupFacts {
            group: g.id,
            protected: !g.retiring && matches!(g.state, GroupState::Connecting | GroupState::Up),
            open_seq: self.gate.open_seq(g.id).unwrap_or(0),
            acked_seq: self.gate.acked_seq(g.id).unwrap_or(0),
        }
    }

    /// The verdict for one output packet (after `settle`), and what the audit must know when
    /// it leaves (`key`: the primary key to hold it by).
    pub(crate) fn decide<S: FlowState>(
        &mut self,
        t: &mut FlowTable<S>,
        kind: OutputKind,
    ) -> (Decision, Exit) {
        let mut exit = Exit {
            key: None,
            version: None,
            group: 0,
            written: self.tick,
            remus: self.remus,
        };
        if self.remus {
            exit.key = match kind {
                OutputKind::Stateful(k) => Some(k),
                OutputKind::Direct => None,
            };
            let Some(g) = self.groups.first() else {
                return (Decision::Now(Verdict::Unprotected), exit);
            };
            exit.group = g.id;
            if g.state == GroupState::Fenced {
                return (Decision::DropFenced, exit);
            }
            return (direct_rule(Some(&self.facts(g))).into(), exit);
        }
        let OutputKind::Stateful(k) = kind else {
            return (Decision::Now(Verdict::Direct), exit);
        };
        let (p, version) = match primary_of(t, &k) {
            Some((p, v)) => (p, Some(v)),
            None => (self.aliases.get(&k).copied().unwrap_or(k), None),
        };
        // Output keys are not in the touched list: the verdict below must see the flow queued
        // for the next checkpoint whenever it waits for it.
        let mut known = match self.reps.get(&p) {
            Some(r) if r.queued || r.shipped.is_some_and(|(sv, _)| Some(sv) == version) => {
                Some((r.group, r.shipped, r.sync))
            }
            _ => None,
        };
        if known.is_none() {
            self.note(t, p);
            known = self.reps.get(&p).map(|r| (r.group, r.shipped, r.sync));
        }
        exit.key = Some(p);
        exit.version = version;
        let Some((rep_group, shipped, sync)) = known else {
            let g = self.wire_of(self.assigner.assign(&p));
            exit.group = g;
            let v = if g == 0 {
                Verdict::Unprotected
            } else {
                // No flow and nothing shipped: no replicated state to depend on.
                Verdict::Clean
            };
            return (Decision::Now(v), exit);
        };
        exit.group = rep_group;
        let Some(g) = self.group(rep_group) else {
            return (Decision::Now(Verdict::Unprotected), exit);
        };
        if g.state == GroupState::Fenced {
            return (Decision::DropFenced, exit);
        }
        let v = output_rule(
            &self.facts(g),
            &FlowFacts {
                version,
                shipped,
                sync,
            },
        );
        if v == Verdict::Syncing {
            // It relies on no group's protection yet: exempt from the audit, like unprotected
            // output.
            exit.group = 0;
        }
        (v.into(), exit)
    }

    /// Audits a packet that is leaving now (design invariant 3), on every output path: checked
    /// against the acks unless it is exempt by design (direct output outside Remus mode, or its
    /// group is unprotected now: group 0, gone, or its backup died).
    pub(crate) fn audit_exit(&mut self, e: &Exit) {
        let protected = (e.remus || e.key.is_some())
            && self
                .group(e.group)
                .is_some_and(|g| matches!(g.state, GroupState::Connecting | GroupState::Up));
        if !protected {
            self.audit.exempt();
            self.out.audit_exempt += 1;
            return;
        }
        self.out.audit_checked += 1;
        if !self.audit.left(e, self.tick) {
            self.out.audit_violations += 1;
            tracing::error!(group = e.group, version = ?e.version, written = e.written,
                "output commit violated: a packet left before the backup acknowledged its state");
        }
    }

    /// Test-only fault switch: output that should wait leaves at once.
    pub(crate) fn set_fault_release_early(&mut self, on: bool) {
        self.fault_release_early = on;
    }

    pub(crate) fn fault_release_early(&self) -> bool {
        self.fault_release_early
    }

    /// Holds `h` for `dep`. `None`: held. `Some((h, Now))`: it may leave now (its dep is
    /// acked already); `Some((h, Dropped))`: the group's queue is full (counted), drop it.
    pub(crate) fn hold(&mut self, dep: Dep, h: Held) -> Option<(Held, Route)> {
        match self.gate.hold(dep, h) {
            Ok(()) => {
                self.out.held += 1;
                None
            }
            Err(HoldRefused::Full(h)) => {
                self.out.dropped_hold_full += 1;
                Some((h, Route::Dropped))
            }
            Err(e) => Some((e.into_inner(), Route::Now)),
        }
    }

    /// Start of a round: acks and link state. Released packets are appended to `released`.
    pub(crate) fn poll_links(&mut self, released: &mut Vec<Held>, dropped: &mut Vec<Held>) {
        self.tick += 1;
        let mut acks = std::mem::take(&mut self.acks);
        for li in 0..self.links.len() {
            acks.clear();
            let status = self.links[li].link.poll(&mut acks);
            match status {
                LinkStatus::Connecting => {
                    for g in self.groups.iter_mut().filter(|g| g.link == li) {
                        if g.state == GroupState::Up {
                            g.state = GroupState::Connecting;
                        }
                    }
                }
                LinkStatus::Up { session, welcome } => {
                    if self.links[li].session != Some(session) {
                        self.links[li].session = Some(session);
                        self.on_connect(li, &welcome, released);
                    }
                }
                LinkStatus::Dead { reason } => {
                    if !self.links[li].dead {
                        self.links[li].dead = true;
                        self.on_dead(li, &reason, released, dropped);
                    }
                }
            }
            for a in &acks {
                let before = released.len();
                if self.group(a.group).is_some_and(|g| g.link == li) {
                    self.audit.acked(a.group, a.seq);
                    self.gate.ack(a.group, a.seq, released);
                } else {
                    self.gate.stats.bogus_acks += 1;
                }
                self.out.released += (released.len() - before) as u64;
            }
        }
        self.acks = acks;
        // Evictions whose successor acknowledged the checkpoint carrying the flow (or whose
        // successor is gone) become `Deleted` updates for the old backup.
        for gi in 0..self.groups.len() {
            if self.groups[gi].evict.is_empty() {
                continue;
            }
            let evict = std::mem::take(&mut self.groups[gi].evict);
            let mut keep = Vec::with_capacity(evict.len());
            for (k, succ, seq) in evict {
                let alive = self.gate.has_group(succ);
                if !alive || self.gate.acked_seq(succ).is_some_and(|a| a >= seq) {
                    self.groups[gi].deletes.push(k);
                } else {
                    keep.push((k, succ, seq));
                }
            }
            self.groups[gi].evict = keep;
        }
        // Retiring groups leave once nothing waits for them and every flow they held is safe
        // in its successor group; leaving clears the old backup's copy with an empty full
        // checkpoint (same reason as `evict`).
        let mut i = 0;
        while i < self.groups.len() {
            let g = &self.groups[i];
            if !(g.retiring && g.evict.is_empty() && self.gate.held_len(g.id) == 0) {
                i += 1;
                continue;
            }
            let id = g.id;
            // A backup that holds something of ours but is reconnecting cannot be cleared yet:
            // leaving now would leave its copy behind, and a failover of this replica would then
            // activate those flows there too (two live copies, invariant 1). Wait until the
            // link is up again (then clear) or dead (a dead backup activates nothing).
            if g.state == GroupState::Connecting && g.last_seq > 0 && !self.links[g.link].dead {
                i += 1;
                continue;
            }
            if g.state == GroupState::Up && !self.links[g.link].dead {
                let seq = self.gate.open_seq(id).unwrap_or(g.last_seq + 1);
                let clear = Checkpoint {
                    group: id,
                    seq,
                    full: true,
                    flows: Vec::new(),
                    shared: None,
                };
                match self.links[g.link].link.send(clear) {
                    Ok(()) => self.repl.standby_cleared += 1,
                    // Queue full: try again next round.
                    Err(LinkError::Full) => {
                        i += 1;
                        continue;
                    }
                    // A dead backup holds nothing anyone will activate through us.
                    Err(LinkError::Dead) => {}
                }
            }
            self.gate.remove_group(id, released);
            self.audit.forget_group(id);
            self.groups.remove(i);
        }
        self.drop_idle_links();
    }

    fn on_connect(&mut self, li: usize, welcome: &[(GroupId, u64)], released: &mut Vec<Held>) {
        // The audit hears what the backup says it holds of every group on this link (0:
        // nothing) before the gate acts on it.
        for g in self.groups.iter().filter(|g| g.link == li) {
            let held = welcome
                .iter()
                .find(|(gid, _)| *gid == g.id)
                .map_or(0, |w| w.1);
            self.audit.welcome(g.id, held);
        }
        // What the backup says it applied is acknowledged, even if the acks themselves were
        // lost with the old connection.
        for &(gid, s) in welcome {
            if self
                .groups
                .iter()
                .any(|g| g.id == gid && g.link == li && s > 0 && s <= g.last_seq)
            {
                let before = released.len();
                self.gate.ack(gid, s, released);
                self.out.released += (released.len() - before) as u64;
            }
        }
        let mut resync = Vec::new();
        for g in self.groups.iter_mut().filter(|g| g.link == li) {
            if matches!(g.state, GroupState::Unprotected | GroupState::Fenced) {
                continue;
            }
            g.state = GroupState::Up;
            // Deltas still apply only if the backup holds exactly what we shipped last.
            let holds_ours = g.last_seq > 0 && welcome.contains(&(g.id, g.last_seq));
            if !holds_ours && !g.needs_full {
                g.needs_full = true;
                resync.push(g.id);
            }
        }
        for id in resync {
            self.repl.resyncs += 1;
            // Everything must ship again: until then, the output rule treats the group's
            // flows as never shipped (their output waits for the full checkpoint).
            for rep in self.reps.values_mut().filter(|r| r.group == id) {
                rep.shipped = None;
                rep.base.clear();
            }
        }
    }

    fn on_dead(
        &mut self,
        li: usize,
        reason: &str,
        released: &mut Vec<Held>,
        dropped: &mut Vec<Held>,
    ) {
        // A backup that activated our flows under a newer token refuses us as fenced: we are a
        // stale owner (revived or partitioned). Nothing held may leave, nor anything later.
        let fenced = reason.contains("fenced");
        for g in self.groups.iter_mut().filter(|g| g.link == li) {
            self.audit.forget_group(g.id);
            g.dead_reason = Some(reason.to_string());
            g.dirty.clear();
            if fenced {
                g.state = GroupState::Fenced;
                g.needs_backup = false;
                let before = dropped.len();
                self.gate.release_all(g.id, dropped);
                self.out.dropped_fenced += (dropped.len() - before) as u64;
            } else {
                g.state = GroupState::Unprotected;
                g.needs_backup = !g.retiring;
                let before = released.len();
                self.gate.release_all(g.id, released);
                self.out.released_unprotected += (released.len() - before) as u64;
            }
        }
        if fenced {
            tracing::error!(backup = %self.links[li].socket, reason, "fenced by the backup: this replica no longer owns its flows; their output is dropped");
        } else {
            tracing::warn!(backup = %self.links[li].socket, reason, "replication link dead: groups run unprotected");
        }
    }

    /// Whether a backup fenced this replica (its flows were activated elsewhere).
    pub fn fenced(&self) -> bool {
        self.groups.iter().any(|g| g.state == GroupState::Fenced)
    }

    /// Earliest instant a group wants a checkpoint taken (for the poll timeout).
    pub(crate) fn next_deadline(&self, now: Instant) -> Option<Instant> {
        let mut best: Option<Instant> = None;
        for g in &self.groups {
            if g.retiring || g.state != GroupState::Up {
                continue;
            }
            let wants =
                self.remus || g.needs_full || !g.dirty.is_empty() || self.gate.waits_for_open(g.id);
            if wants {
                best = Some(best.map_or(g.next_due, |b| b.min(g.next_due)));
            }
        }
        if !self.remus && !self.reps.is_empty() {
            best = Some(best.map_or(self.next_sweep, |b| b.min(self.next_sweep)));
        }
        best.map(|b| b.max(now))
    }

    pub(crate) fn wake_fds(&self, out: &mut Vec<RawFd>) {
        out.extend(self.links.iter().filter_map(|l| l.link.wake_fd()));
    }

    pub(crate) fn drain_wakes(&self) {
        for l in &self.links {
            l.link.drain_wake();
        }
    }

    /// End of a round: takes and ships the checkpoints that are due.
    pub(crate) fn step<S: FlowState>(
        &mut self,
        t: &mut FlowTable<S>,
        shared: &SharedStore,
        now: Instant,
    ) {
        if !self.remus && now >= self.next_sweep {
            self.sweep(t, now);
        }
        for i in 0..self.groups.len() {
            let g = &self.groups[i];
            if g.retiring || g.state != GroupState::Up || now < g.next_due {
                continue;
            }
            let period = g.period;
            let sent = if self.remus {
                self.checkpoint_remus(i, t, shared, now)
            } else {
                self.checkpoint_pico(i, t, now)
            };
            let g = &mut self.groups[i];
            g.next_due = match sent {
                Shipped::Full => {
                    g.send_full += 1;
                    now + FULL_RETRY.min(period)
                }
                // Keep the epoch grid, but never schedule into the past (no bursts after a
                // long round).
                _ => {
                    let n = g.next_due + period;
                    if n <= now {
                        now + period
                    } else {
                        n
                    }
                }
            };
        }
    }

    fn checkpoint_remus<S: FlowState>(
        &mut self,
        i: usize,
        t: &mut FlowTable<S>,
        shared: &SharedStore,
        now: Instant,
    ) -> Shipped {
        let id = self.groups[i].id;
        let Some(seq) = self.gate.open_seq(id) else {
            return Shipped::Nothing;
        };
        let keys = t.keys();
        if keys.iter().any(|k| t.refcount(k).is_some_and(|r| r > 0)) {
            // A copy mid-transaction would be torn (invariant 2): the epoch waits a round.
            self.repl.remus_postponed += 1;
            self.groups[i].busy_retries += 1;
            return Shipped::Nothing;
        }
        let mut flows = Vec::with_capacity(keys.len());
        let mut bytes = 0u64;
        for k in keys {
            let version = t.version(&k).unwrap_or(0);
            match t.snapshot_flow(&k, now) {
                Ok(rec) => {
                    bytes += rec.len() as u64 + UPDATE_OVERHEAD;
                    flows.push(FlowUpdate {
                        key: k,
                        version,
                        body: UpdateBody::Full(rec),
                    });
                }
                Err(_) => self.repl.snapshot_errors += 1,
            }
        }
        let shared_blob = match shared.export_shared().and_then(|x| x.to_bytes()) {
            Ok(b) => Some(b),
            Err(_) => {
                self.repl.snapshot_errors += 1;
                None
            }
        };
        bytes += shared_blob.as_ref().map_or(0, |b| b.len() as u64);
        let cp = Checkpoint {
            group: id,
            seq,
            full: true,
            flows,
            shared: shared_blob,
        };
        self.audit.sent(&cp, self.tick, true);
        let sent = self.links[self.groups[i].link].link.send(cp);
        if sent.is_err() {
            self.audit.withdraw(id, seq);
        }
        match sent {
            Ok(()) => {
                self.gate.close_epoch(id);
                let g = &mut self.groups[i];
                g.last_seq = seq;
                g.needs_full = false;
                g.checkpoints += 1;
                g.bytes_shipped += bytes;
                g.bytes_full_equiv += bytes;
                Shipped::Sent
            }
            Err(LinkError::Full) => Shipped::Full,
            Err(LinkError::Dead) => Shipped::Nothing, // the next poll reports it
        }
    }

    fn checkpoint_pico<S: FlowState>(
        &mut self,
        i: usize,
        t: &mut FlowTable<S>,
        now: Instant,
    ) -> Shipped {
        let id = self.groups[i].id;
        let Some(seq) = self.gate.open_seq(id) else {
            return Shipped::Nothing;
        };
        let full = self.groups[i].needs_full;
        // A full checkpoint covers the dirty list too.
        let dirty = std::mem::take(&mut self.groups[i].dirty);
        let candidates: Vec<FlowKey> = if full {
            self.reps
                .iter()
                .filter(|(_, r)| r.group == id)
                .map(|(k, _)| *k)
                .collect()
        } else {
            dirty
        };
        // A full checkpoint replaces the group on the backup, which drops moved flows anyway.
        let deletes = std::mem::take(&mut self.groups[i].deletes);
        if candidates.is_empty() && deletes.is_empty() && !full && !self.gate.waits_for_open(id) {
            return Shipped::Nothing;
        }
        let mut flows = Vec::with_capacity(candidates.len() + deletes.len());
        if !full {
            for k in &deletes {
                flows.push(FlowUpdate {
                    key: *k,
                    version: 0,
                    body: UpdateBody::Deleted,
                });
            }
        }
        // (key, version, bytes) to commit; keys to forget; keys that stay dirty.
        let mut commit: Vec<(FlowKey, u64, Vec<u8>)> = Vec::new();
        let mut forget: Vec<FlowKey> = Vec::new();
        let mut later: Vec<FlowKey> = Vec::new();
        let (mut bytes, mut full_equiv) = (0u64, 0u64);
        let mut seen = std::collections::HashSet::with_capacity(candidates.len());
        for p in candidates {
            let Some(rep) = self.reps.get(&p) else {
                continue;
            };
            if rep.group != id || !seen.insert(p) {
                continue;
            }
            if bytes as usize >= MAX_CHECKPOINT_BYTES {
                later.push(p);
                continue;
            }
            match t.version(&p) {
                None => {
                    if rep.shipped.is_some() && !full {
                        flows.push(FlowUpdate {
                            key: p,
                            version: rep.shipped.map_or(0, |s| s.0),
                            body: UpdateBody::Deleted,
                        });
                        bytes += UPDATE_OVERHEAD;
                    }
                    forget.push(p);
                }
                Some(v) => {
                    if !full && rep.shipped.is_some_and(|(sv, _)| sv == v) {
                        // Clean again (nothing to ship).
                        if let Some(r) = self.reps.get_mut(&p) {
                            r.queued = false;
                        }
                        continue;
                    }
                    match t.snapshot_flow(&p, now) {
                        Ok(rec) => {
                            full_equiv += rec.len() as u64 + UPDATE_OVERHEAD;
                            let body = match rep.shipped {
                                Some((sv, _)) if !full && sv < v => UpdateBody::Delta {
                                    base_version: sv,
                                    bytes: delta::encode(&rep.base, &rec),
                                },
                                _ => UpdateBody::Full(rec.clone()),
                            };
                            bytes += UPDATE_OVERHEAD
                                + match &body {
                                    UpdateBody::Full(b) => b.len(),
                                    UpdateBody::Delta { bytes, .. } => bytes.len(),
                                    UpdateBody::Deleted => 0,
                                } as u64;
                            flows.push(FlowUpdate {
                                key: p,
                                version: v,
                                body,
                            });
                            commit.push((p, v, rec));
                        }
                        Err(StateError::Busy { .. }) => {
                            self.groups[i].busy_retries += 1;
                            later.push(p);
                        }
                        Err(_) => {
                            // Gone meanwhile (e.g. migrated away): the backup forgets it.
                            self.repl.snapshot_errors += 1;
                            if rep.shipped.is_some() && !full {
                                flows.push(FlowUpdate {
                                    key: p,
                                    version: v,
                                    body: UpdateBody::Deleted,
                                });
                            }
                            forget.push(p);
                        }
                    }
                }
            }
        }
        if flows.is_empty() && !full && !self.gate.waits_for_open(id) {
            // Nothing changed after all, and no output waits for this epoch: no checkpoint
            // (the seq stays open, so seqs on the wire stay contiguous).
            for p in forget {
                self.forget(&p);
            }
            for p in &later {
                let p = *p;
                self.gate
                    .retarget(id, seq, seq + 1, |h: &Held| h.exit.key == Some(p));
            }
            self.groups[i].dirty.extend(later);
            return Shipped::Nothing;
        }
        let cp = Checkpoint {
            group: id,
            seq,
            full,
            flows,
            shared: None,
        };
        // A flow twice would make the backup refuse the whole checkpoint.
        debug_assert!(
            cp.duplicate_key().is_none(),
            "flow {:?} twice in checkpoint {} of group {id}",
            cp.duplicate_key(),
            cp.seq
        );
        self.audit.sent(&cp, self.tick, false);
        match self.links[self.groups[i].link].link.send(cp) {
            Ok(()) => {}
            Err(e) => {
                self.audit.withdraw(id, seq);
                // Nothing committed: everything stays dirty for the next try.
                let g = &mut self.groups[i];
                if !full {
                    g.deletes.extend(deletes);
                    g.dirty.extend(commit.iter().map(|c| c.0));
                    g.dirty.extend(forget.iter().copied());
                    g.dirty.extend(later);
                }
                return if e == LinkError::Full {
                    Shipped::Full
                } else {
                    Shipped::Nothing
                };
            }
        }
        self.gate.close_epoch(id);
        for (p, v, rec) in commit {
            if let Some(rep) = self.reps.get_mut(&p) {
                rep.shipped = Some((v, seq));
                rep.sync = rep.sync.shipped(seq);
                rep.base = rec;
                rep.queued = false;
            }
        }
        for p in forget {
            self.forget(&p);
        }
        // Flows not copied into `seq`: their held output waits for the next epoch.
        for p in &later {
            let p = *p;
            self.gate
                .retarget(id, seq, seq + 1, |h: &Held| h.exit.key == Some(p));
        }
        self.repl.standby_evicted += if full { 0 } else { deletes.len() as u64 };
        let g = &mut self.groups[i];
        g.dirty.extend(later);
        g.last_seq = seq;
        g.needs_full = false;
        g.checkpoints += 1;
        g.bytes_shipped += bytes;
        g.bytes_full_equiv += full_equiv;
        Shipped::Sent
    }

    /// Releases all held output (policy off / replaced by `off`).
    pub(crate) fn release_everything(&mut self, released: &mut Vec<Held>) {
        let ids: Vec<GroupId> = self.gate.groups().collect();
        for id in ids {
            let before = released.len();
            self.gate.release_all(id, released);
            let n = (released.len() - before) as u64;
            self.out.released_unprotected += n;
            // Protection was switched off: these leave exempt.
            self.out.audit_exempt += n;
            self.audit.stats.exempt += n;
        }
    }

    /// Takes every held packet out, none released (a rejoining replica's output of flows
    /// that failed over must never leave), and returns how many groups there were.
    pub(crate) fn discard_everything(&mut self, out: &mut Vec<Held>) -> usize {
        let ids: Vec<GroupId> = self.gate.groups().collect();
        for id in &ids {
            self.gate.take_held(*id, out);
        }
        out.extend(self.moved_out.drain(..).map(|(h, _)| h));
        self.groups.len()
    }

    pub(crate) fn held_now(&self) -> usize {
        self.gate.held_total()
    }

    /// The `groups` array of `ha_status`.
    pub(crate) fn groups_json(&self, table_flows: usize) -> Vec<Value> {
        self.groups
            .iter()
            .map(|g| {
                let flows = if self.remus {
                    table_flows
                } else {
                    self.reps.values().filter(|r| r.group == g.id).count()
                };
                let state =
                    if g.retiring && matches!(g.state, GroupState::Connecting | GroupState::Up) {
                        "retiring"
                    } else {
                        g.state.name()
                    };
                json!({
                    "id": g.id,
                    "name": g.spec.name,
                    "backup": g.spec.backup.name,
                    "socket": g.spec.backup.socket,
                    "hz": g.spec.hz,
                    "state": state,
                    "open_seq": self.gate.open_seq(g.id).unwrap_or(0),
                    "acked_seq": self.gate.acked_seq(g.id).unwrap_or(0),
                    "held_packets": self.gate.held_len(g.id),
                    "flows": flows,
                    "checkpoints": g.checkpoints,
                    "bytes_shipped": g.bytes_shipped,
                    "bytes_full_equiv": g.bytes_full_equiv,
                    "needs_backup": g.needs_backup,
                    "busy_retries": g.busy_retries,
                    "send_queue_full": g.send_full,
                    "dead_reason": g.dead_reason,
                })
            })
            .collect()
    }

    /// `{"id","name","backup","hz"}` of the active groups (the `protect` answer).
    pub(crate) fn groups_brief(&self) -> Vec<Value> {
        self.groups
            .iter()
            .filter(|g| !g.retiring)
            .map(|g| json!({"id": g.id, "name": g.spec.name, "backup": g.spec.backup.name, "hz": g.spec.hz}))
            .collect()
    }

    /// The most recent output-commit violations as JSON (oldest first).
    pub(crate) fn audit_json(&self, max: usize) -> Vec<Value> {
        let n = self.audit.violations().count();
        self.audit
            .violations()
            .skip(n.saturating_sub(max))
            .map(|v| serde_json::to_value(v).unwrap_or(Value::Null))
            .collect()
    }

    /// (bytes shipped, full-record equivalent, checkpoints) over the current groups.
    pub(crate) fn shipped_totals(&self) -> (u64, u64, u64) {
        self.groups.iter().fold((0, 0, 0), |(s, f, c), g| {
            (
                s + g.bytes_shipped,
                f + g.bytes_full_equiv,
                c + g.checkpoints,
            )
        })
    }

    /// Whether any group is unprotected because its backup died.
    pub fn needs_backup(&self) -> bool {
        self.groups.iter().any(|g| g.needs_backup)
    }
}

enum Shipped {
    Nothing,
    Sent,
    /// The link's queue was full.
    Full,
}

/// [`ReplLink`] over the authenticated unix-socket sender of `pliant_ha::transport`.
pub struct SenderLink {
    s: pliant_ha::transport::ReplSender,
}

impl ReplLink for SenderLink {
    fn send(&mut self, cp: Checkpoint) -> Result<(), LinkError> {
        self.s.send(cp).map_err(|e| match e {
            pliant_ha::transport::SendError::Full => LinkError::Full,
            pliant_ha::transport::SendError::Dead => LinkError::Dead,
        })
    }

    fn poll(&mut self, acks: &mut Vec<Ack>) -> LinkStatus {
        match self.s.poll(acks) {
            pliant_ha::transport::LinkState::Connecting => LinkStatus::Connecting,
            // Every connection attempt counts; the state is Up only after the last one
            // succeeded, so a changed count while Up means a new session.
            pliant_ha::transport::LinkState::Up { welcome } => LinkStatus::Up {
                session: self.s.stats().connect_attempts,
                welcome,
            },
            pliant_ha::transport::LinkState::Dead { reason } => LinkStatus::Dead { reason },
        }
    }

    fn wake_fd(&self) -> Option<RawFd> {
        Some(self.s.wake_fd())
    }

    fn drain_wake(&self) {
        self.s.drain_wake();
    }

    fn bytes_sent(&self) -> Option<u64> {
        Some(self.s.stats().bytes_sent)
    }
}

/// Opens [`SenderLink`]s as this replica's identity.
pub struct SenderFactory {
    pub sec: pliant_wire::Security,
    /// `None`: the defaults for the backup's endpoint (`SenderOptions::for_endpoint`).
    pub opts: Option<pliant_ha::transport::SenderOptions>,
}

impl LinkFactory for SenderFactory {
    fn connect(&mut self, backup: &BackupTarget, primary: &str, token: u64) -> Box<dyn ReplLink> {
        // A socket string that is no endpoint is tried as a path: the link then dies with the
        // connect error, which names it.
        let ep = backup
            .socket
            .parse::<pliant_wire::Endpoint>()
            .unwrap_or_else(|_| pliant_wire::Endpoint::Unix(backup.socket.clone().into()));
        let opts = self
            .opts
            .clone()
            .unwrap_or_else(|| pliant_ha::transport::SenderOptions::for_endpoint(&ep));
        Box::new(SenderLink {
            s: pliant_ha::transport::ReplSender::start(
                &ep,
                self.sec.clone(),
                &backup.name,
                primary,
                token,
                opts,
            ),
        })
    }
}
