//! The controller core: membership (heartbeats), load, and the orchestration of migrations,
//! scale-out/in and rebalancing. Thread-safe: the API, heartbeat and policy threads share one
//! [`Controller`].
//!
//! Locking: `state` (membership, load, policy) is held only for short, I/O-free sections, so
//! heartbeats and `status` never wait behind a migration; `ops` serialises the operations that
//! change placement (migrate, scale, rebalance), which do their replica I/O without `state`.
//! Lock order when both are needed: ops -> steering -> store -> state.

use crate::agent::Agent;
use crate::ha::{self, HaConfig};
use crate::migrator::{MigrateError, Migrator};
use crate::policy::{self, Decision, Move, Policy, ReplicaLoad};
use crate::ports::PortBlocks;
use crate::replica_client::{self as rc, FlowEntry};
use crate::steering::{self, Steering};
use crate::store::{self, Store};
use pliant_proto::reply::SharedExport;
use pliant_proto::Request;
use pliant_state::FlowKey;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Events kept for `status` (newest last).
pub const MAX_EVENTS: usize = 256;
/// Rounds a scale-in drains the victim before giving up (new flows may keep arriving from
/// conn pins that have not expired yet).
pub const MAX_DRAIN_ROUNDS: usize = 20;

#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    #[error("no replica r{0}")]
    NoReplica(u32),
    #[error("replica r{0} is not alive")]
    Dead(u32),
    #[error("{0}")]
    BadRequest(String),
    #[error("flow {0} is on no live replica")]
    NoSuchFlow(String),
    #[error("no agent configured: the controller cannot start or stop replicas")]
    NoAgent,
    #[error("{0}")]
    Refused(String),
    #[error(transparent)]
    Agent(#[from] crate::agent::AgentError),
    #[error(transparent)]
    Steering(#[from] crate::steering::SteeringError),
    #[error(transparent)]
    Store(#[from] store::StoreError),
    #[error(transparent)]
    Replica(#[from] rc::ReplicaError),
    #[error(transparent)]
    Migrate(#[from] MigrateError),
    #[error(transparent)]
    Policy(#[from] policy::PolicyError),
    #[error(transparent)]
    Ports(#[from] crate::ports::PortError),
}

impl ControllerError {
    /// HTTP status for the API.
    pub fn status(&self) -> u16 {
        match self {
            ControllerError::NoReplica(_) | ControllerError::NoSuchFlow(_) => 404,
            ControllerError::BadRequest(_) | ControllerError::Policy(_) => 400,
            ControllerError::Dead(_)
            | ControllerError::NoAgent
            | ControllerError::Refused(_)
            | ControllerError::Ports(_) => 409,
            _ => 500,
        }
    }
}

pub type Result<T> = std::result::Result<T, ControllerError>;

/// Static knobs (from the config file).
#[derive(Clone, Debug)]
pub struct Settings {
    pub heartbeat: Duration,
    /// Consecutive missed heartbeats after which a replica is dead.
    pub dead_after_missed: u32,
    /// Bound on one control request to a replica.
    pub rpc_timeout: Duration,
    /// Bound on one heartbeat or HA status poll (capped at `rpc_timeout`).
    pub heartbeat_timeout: Duration,
    /// NAT port blocks: (pool, blocks per replica); None when the NF needs none.
    pub port_blocks: Option<(PortBlocks, usize)>,
    /// High availability (`[ha]`); `HaConfig::off()` without one.
    pub ha: HaConfig,
    /// How replicas' control channels are reached (endpoint, identity).
    pub control: rc::Dialer,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            heartbeat: Duration::from_millis(100),
            dead_after_missed: 5,
            rpc_timeout: Duration::from_secs(2),
            heartbeat_timeout: Duration::from_millis(500),
            port_blocks: None,
            ha: HaConfig::off(),
            control: rc::Dialer::default(),
        }
    }
}

/// A replica as the store records it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaRecord {
    pub index: u32,
    pub socket: PathBuf,
    /// Started by our agent (and so ours to stop).
    pub managed: bool,
    pub added_unix_ms: u64,
}

/// What heartbeats learned.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Health {
    pub alive: bool,
    pub missed: u32,
    pub beats: u64,
    pub flows: u64,
    pub pps: u64,
    pub last_error: Option<String>,
    /// Leaving (scale-in in progress): out of the ring, not a migration target.
    pub draining: bool,
    /// Declared dead with HA on: fenced, its flows activated elsewhere. Never revived (a
    /// revived old owner must not act on ownership it lost; design invariant 7).
    pub failed_over: bool,
    #[serde(skip)]
    last_rx: Option<(Instant, u64)>,
}

#[derive(Default, Debug)]
pub struct Counters {
    pub heartbeats: AtomicU64,
    pub heartbeat_failures: AtomicU64,
    pub flows_migrated: AtomicU64,
    pub migrations_failed: AtomicU64,
    pub scale_outs: AtomicU64,
    pub scale_ins: AtomicU64,
    pub rebalances: AtomicU64,
    pub replicas_died: AtomicU64,
    pub unparsable_keys: AtomicU64,
    /// Replica answers missing a field the controller reads (a replica of another release,
    /// or a bug): never read as zero.
    pub malformed_answers: AtomicU64,
    pub events_dropped: AtomicU64,
    /// Exception GC: keys removed, rounds that collected nothing because a replica's listing
    /// was truncated or failed (absence not provable).
    pub exceptions_collected: AtomicU64,
    pub gc_skipped: AtomicU64,
    /// Placement changes refused because the store did not answer.
    pub store_refusals: AtomicU64,
    pub ha: HaCounters,
}

struct State {
    replicas: BTreeMap<u32, (ReplicaRecord, Health)>,
    policy: Policy,
    epoch: u64,
    ports: Option<PortBlocks>,
    last_action: Option<Instant>,
    events: VecDeque<Value>,
    last_scale_out_ms: Option<u64>,
    ha: HaState,
}

pub struct Controller {
    settings: Settings,
    state: Mutex<State>,
    ops: Mutex<()>,
    steering: Mutex<Box<dyn Steering>>,
    store: Mutex<Box<dyn Store>>,
    agent: Mutex<Option<Box<dyn Agent>>>,
    migrator: Box<dyn Migrator>,
    pub counters: Counters,
    /// Serialises failovers. A failover never takes `ops` (it must not wait behind a long
    /// migration); the exception GC, under `ops`, takes it only for its short decision step
    /// (no RPC under it), so neither deadlocks nor waits long for the other.
    ha_lock: Mutex<()>,
    /// This controller's role among several (leader and term), shown by `status`.
    role: Mutex<Value>,
    /// The hosts' agents, when replicas run on hosts with agents (`[hosts]`).
    hosts: std::sync::OnceLock<Arc<crate::hosts::HostWatch>>,
}

/// What the exception GC lists: the saved exceptions (key -> owner) and every key and alias
/// the live replicas hold.
type GcListing = (BTreeMap<String, u32>, BTreeSet<String>);

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Most threads one probe round runs at once (replica slots are 1..=63, so every replica of
/// a round gets its own).
pub const MAX_ROUND_THREADS: usize = 64;

/// `f` over every item, all at once (a scoped thread each, at most [`MAX_ROUND_THREADS`] at a
/// time), so a round of requests takes about its slowest answer, not their sum; on the calling
/// thread for a single item or where a thread cannot be started. Results in the items' order.
fn fan_out<I: Sync, R: Send>(items: &[I], f: impl Fn(&I) -> R + Sync) -> Vec<R> {
    if items.len() < 2 {
        return items.iter().map(&f).collect();
    }
    let f = &f;
    let mut out = Vec::with_capacity(items.len());
    for chunk in items.chunks(MAX_ROUND_THREADS) {
        std::thread::scope(|sc| {
            let started: Vec<std::result::Result<std::thread::ScopedJoinHandle<'_, R>, &I>> = chunk
                .iter()
                .map(|it| {
                    std::thread::Builder::new()
                        .name("ctl-probe".into())
                        .spawn_scoped(sc, move || f(it))
                        .map_err(|_| it)
                })
                .collect();
            for s in started {
                out.push(match s {
                    Ok(h) => h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)),
                    Err(it) => f(it),
                });
            }
        });
    }
    out
}

/// Locks, recovering from a poisoned mutex: a panicked API thread must not wedge the daemon
/// (every critical section leaves the state consistent between statements).
fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

const K_POLICY: &str = "policy";
const K_EPOCH: &str = "epoch";
/// The migration under way (see [`MigrationIntent`]); absent when none is.
const K_MIGRATION_INTENT: &str = "intent/migration";

/// What a controller writes before it moves flows, and removes once the move is settled
/// (steering and exceptions recorded), so that a controller taking over after its death
/// finishes or rolls back the move ([`Controller::resolve_intents`]). One store write before
/// the migration, none inside its pause: whether the move got past its steering switch is read
/// back from the fabric, whose exceptions outlive the controller.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct MigrationIntent {
    from: u32,
    to: u32,
    flows: Vec<FlowEntry>,
    started_unix_ms: u64,
}
const K_PORTS: &str = "ports";
const K_EXCEPTIONS: &str = "exceptions";
const K_RING: &str = "ring";
const P_REPLICAS: &str = "replicas/";

mod failover;
pub use failover::HaCounters;
use failover::HaState;

impl Controller {
    /// Builds the controller: loads policy/epoch/ports from the store, registers the replicas
    /// the store, the agent and `static_replicas` know, installs ring and port blocks.
    pub fn new(
        settings: Settings,
        mut store: Box<dyn Store>,
        steering: Box<dyn Steering>,
        agent: Option<Box<dyn Agent>>,
        migrator: Box<dyn Migrator>,
        static_replicas: Vec<(u32, PathBuf)>,
        initial_policy: Option<Policy>,
    ) -> Result<Controller> {
        // With HA on, a `min_replicas` under the HA floor here is taken as "not set" and
        // raised to it: a stored policy from before HA was on, the default, or a caller's
        // policy that never named it. An explicit lower value in ctl.toml is refused earlier
        // (`ControllerConfig::parse`), one through the API by `set_policy`.
        let ha_floor = ha::ha_min_replicas(&settings.ha);
        let policy = match store::get_json::<Policy>(store.as_ref(), K_POLICY)? {
            Some(mut p) => {
                if p.min_replicas < ha_floor {
                    p.min_replicas = ha_floor;
                    p.check(ha_floor)?;
                    store::put_json(store.as_mut(), K_POLICY, &p)?;
                }
                p
            }
            None => {
                let mut p = initial_policy.unwrap_or_default();
                p.min_replicas = p.floor(ha_floor);
                p.check(ha_floor)?;
                store::put_json(store.as_mut(), K_POLICY, &p)?;
                p
            }
        };
        let epoch = store::get_json::<u64>(store.as_ref(), K_EPOCH)?.unwrap_or(0);
        let ha = HaState::load(store.as_ref(), &settings.ha)?;
        let ports = match store::get_json::<PortBlocks>(store.as_ref(), K_PORTS)? {
            Some(p) => Some(p),
            None => settings.port_blocks.as_ref().map(|(p, _)| p.clone()),
        };
        let mut replicas: BTreeMap<u32, (ReplicaRecord, Health)> = BTreeMap::new();
        for (_, v) in store.list(P_REPLICAS)? {
            if let Ok(r) = serde_json::from_str::<ReplicaRecord>(&v.value) {
                replicas.insert(r.index, (r, Health::default()));
            }
        }
        let mut found = static_replicas;
        if let Some(a) = &agent {
            found.extend(a.existing()?);
        }
        for (index, socket) in found {
            replicas.entry(index).or_insert_with(|| {
                (
                    ReplicaRecord {
                        index,
                        socket,
                        managed: false,
                        added_unix_ms: now_ms(),
                    },
                    Health::default(),
                )
            });
        }
        // Everything known starts alive (the first heartbeats decide otherwise), except
        // replicas that failed over before a restart: they stay fenced and dead.
        for (i, (_, h)) in replicas.iter_mut() {
            h.failed_over = ha.failed.contains_key(i);
            h.alive = !h.failed_over;
        }
        let c = Controller {
            settings,
            state: Mutex::new(State {
                replicas,
                policy,
                epoch,
                ports,
                last_action: None,
                events: VecDeque::new(),
                last_scale_out_ms: None,
                ha,
            }),
            ops: Mutex::new(()),
            steering: Mutex::new(steering),
            store: Mutex::new(store),
            agent: Mutex::new(agent),
            migrator,
            counters: Counters::default(),
            ha_lock: Mutex::new(()),
            role: Mutex::new(json!({"role": "only"})),
            hosts: std::sync::OnceLock::new(),
        };
        c.install_initial()?;
        if c.ha_enabled() {
            // Lease ownership tokens now, so no failover waits for a store write.
            c.lease_tokens()?;
        }
        // A move the previous controller left half done (it died) is finished or undone by
        // `retry_intents`, which the daemon runs first thing after it serves and then every
        // policy round: never here, where a hung replica of the move would delay the takeover.
        // No move of this controller can start before (one intent at a time).
        Ok(c)
    }

    fn install_initial(&self) -> Result<()> {
        let _ops = lock(&self.ops);
        let recs: Vec<ReplicaRecord> = lock(&self.state)
            .replicas
            .values()
            .map(|(r, _)| r.clone())
            .collect();
        {
            let mut st = lock(&self.store);
            for r in &recs {
                store::put_json(st.as_mut(), &format!("{P_REPLICAS}{}", r.index), r)?;
            }
        }
        // Blocks the store already holds were told to their replicas by a previous leader:
        // re-told in the background (a controller taking over must not wait on a replica that
        // hangs). New ones (a first start) are told now, in index order (assignment is
        // deterministic), each within a heartbeat's bound.
        let mut retell = Vec::new();
        for r in &recs {
            retell.extend(self.ensure_port_blocks(r, self.settings.heartbeat_timeout)?);
        }
        if !retell.is_empty() {
            let (dialer, timeout) = (self.settings.control.clone(), self.settings.rpc_timeout);
            let spawned = std::thread::Builder::new()
                .name("ctl-port-blocks".into())
                .spawn(move || {
                    for (socket, req) in retell {
                        if let Err(e) = dialer.call(&socket, &req, timeout) {
                            tracing::warn!(socket = %socket.display(), error = %e,
                                "re-telling port blocks");
                        }
                    }
                });
            if let Err(e) = spawned {
                tracing::warn!(error = %e, "port blocks not re-told");
            }
        }
        // Re-install exceptions the store remembers (e.g. after a controller restart).
        let saved: BTreeMap<String, u32> =
            store::get_json(lock(&self.store).as_ref(), K_EXCEPTIONS)?.unwrap_or_default();
        let entries: Vec<(FlowKey, u32)> = saved
            .iter()
            .filter_map(|(k, r)| k.parse::<FlowKey>().ok().map(|k| (k, *r)))
            .collect();
        if !entries.is_empty() {
            lock(&self.steering).set_exceptions(&entries)?;
        }
        self.install_ring()
    }

    /// A poll's failed answer: an unreachable replica is the probes' business; a malformed
    /// answer is counted and reported (the poll learns nothing from it).
    fn note_bad_answer(&self, i: u32, e: &rc::ReplicaError) {
        if matches!(e, rc::ReplicaError::Malformed { .. }) {
            self.counters
                .malformed_answers
                .fetch_add(1, Ordering::Relaxed);
            self.event(
                "malformed_answer",
                json!({"replica": i, "error": e.to_string()}),
            );
        }
    }

    fn event(&self, kind: &str, detail: Value) {
        tracing::info!(event = kind, %detail);
        let mut st = lock(&self.state);
        if st.events.len() >= MAX_EVENTS {
            st.events.pop_front();
            self.counters.events_dropped.fetch_add(1, Ordering::Relaxed);
        }
        st.events
            .push_back(json!({"unix_ms": now_ms(), "event": kind, "detail": detail}));
    }

    /// Bumps the placement epoch with compare-and-swap (a second controller writing the same
    /// store would lose the race and see an error, never silently interleave).
    fn bump_epoch(&self) -> Result<u64> {
        let mut st = lock(&self.store);
        let cur = st.get(K_EPOCH)?;
        let (rev, val) = match &cur {
            Some(v) => (v.mod_revision, v.value.parse::<u64>().unwrap_or(0)),
            None => (0, 0),
        };
        let next = val + 1;
        match st.compare_and_swap(K_EPOCH, rev, &next.to_string())? {
            Ok(_) => {
                lock(&self.state).epoch = next;
                Ok(next)
            }
            Err(now) => Err(ControllerError::Refused(format!(
                "epoch changed under us (store revision {now}): another controller?"
            ))),
        }
    }

    fn live_indexes(&self) -> Vec<u32> {
        lock(&self.state)
            .replicas
            .iter()
            .filter(|(_, (_, h))| h.alive && !h.draining)
            .map(|(i, _)| *i)
            .collect()
    }

    fn install_ring(&self) -> Result<()> {
        let live = self.live_indexes();
        if live.is_empty() {
            return Ok(());
        }
        lock(&self.steering).set_ring(&live)?;
        store::put_json(lock(&self.store).as_mut(), K_RING, &live)?;
        Ok(())
    }

    fn record(&self, index: u32) -> Result<ReplicaRecord> {
        lock(&self.state)
            .replicas
            .get(&index)
            .map(|(r, _)| r.clone())
            .ok_or(ControllerError::NoReplica(index))
    }

    /// Gives `r` its NAT port blocks if it has none: tells the replica, then the fabric.
    /// FTMB replicas' blocks are pinned by index, not told (see `ports`). Blocks `r` had
    /// already are not told again here: returned (socket and request) for the caller to.
    fn ensure_port_blocks(
        &self,
        r: &ReplicaRecord,
        timeout: Duration,
    ) -> Result<Option<(PathBuf, Request)>> {
        let Some((_, per)) = &self.settings.port_blocks else {
            return Ok(None);
        };
        let ftmb = self.settings.ha.mode == crate::ha::HaMode::Ftmb;
        let (ranges, known) = {
            let mut st = lock(&self.state);
            let Some(pb) = st.ports.as_mut() else {
                return Ok(None);
            };
            let have = pb.of(r.index);
            if !have.is_empty() {
                (have, true)
            } else if ftmb {
                let a = pb.assign_at(r.index, PortBlocks::pinned_first(r.index, *per), *per)?;
                (a, false)
            } else {
                (pb.assign(r.index, *per)?, false)
            }
        };
        let tell = Request::SetPortBlocks {
            blocks: ranges.iter().map(|x| (*x.start(), *x.end())).collect(),
        };
        let mut retell = None;
        if ftmb {
            // Its pool is fixed by its config (see `ports`): nothing to tell the replica.
        } else if known {
            retell = Some((r.socket.clone(), tell));
        } else if let Err(e) = self.settings.control.call(&r.socket, &tell, timeout) {
            // Not fatal (an NF without NAT has nothing to do with ports), but worth seeing.
            self.event(
                "port_blocks_refused",
                json!({"replica": r.index, "error": e.to_string()}),
            );
        }
        {
            let mut s = lock(&self.steering);
            for x in &ranges {
                s.set_port_owner(x.clone(), Some(r.index))?;
            }
        }
        let pb = lock(&self.state).ports.clone();
        if let Some(pb) = pb {
            store::put_json(lock(&self.store).as_mut(), K_PORTS, &pb)?;
        }
        Ok(retell)
    }

    // ---------------------------------------------------------------- heartbeats

    /// One heartbeat round over every replica, all at once (I/O without the state lock):
    /// the round takes about one heartbeat bound when a replica does not answer, whatever
    /// the number of replicas.
    pub fn heartbeat_once(&self) {
        let targets: Vec<(u32, PathBuf)> = lock(&self.state)
            .replicas
            .iter()
            .filter(|(_, (_, h))| !h.failed_over)
            .map(|(i, (r, _))| (*i, r.socket.clone()))
            .collect();
        let timeout = self.poll_timeout();
        let ha_on = self.ha_enabled();
        // Every replica at once, each answer recorded as it comes (a short state lock, no
        // I/O under it): a replica that does not answer delays no other's heartbeat.
        let outcomes = fan_out(&targets, |(i, sock)| {
            let res = self.settings.control.heartbeat(sock, timeout);
            self.record_beat(*i, res)
        });
        let died: Vec<u32> = outcomes
            .iter()
            .filter_map(|o| match o {
                Some((i, false)) => Some(*i),
                _ => None,
            })
            .collect();
        let revived: Vec<u32> = outcomes
            .iter()
            .filter_map(|o| match o {
                Some((i, true)) => Some(*i),
                _ => None,
            })
            .collect();
        for i in died {
            if ha_on {
                // Unanswered heartbeats are evidence too (a hung replica still accepts
                // connections, so the connect probe cannot see it): fail it over.
                if let Err(e) = self.failover(i, "missed heartbeats") {
                    self.event(
                        "failover_error",
                        json!({"replica": i, "error": e.to_string()}),
                    );
                }
                continue;
            }
            self.counters.replicas_died.fetch_add(1, Ordering::Relaxed);
            self.event("replica_dead", json!({"replica": i}));
            // New flows must not be hashed onto a dead replica; its pinned flows are lost
            // (failover is the HA work, not elasticity) and counted by the fabric.
            let r = lock(&self.steering).set_live(i, false);
            if let Err(e) = r
                .map_err(ControllerError::from)
                .and_then(|_| self.install_ring())
            {
                self.event(
                    "steering_error",
                    json!({"replica": i, "error": e.to_string()}),
                );
            }
        }
        if ha_on {
            self.ha_poll();
            self.note_unprotected();
        }
        for i in revived {
            self.event("replica_alive", json!({"replica": i}));
            let r = lock(&self.steering).set_live(i, true);
            if let Err(e) = r
                .map_err(ControllerError::from)
                .and_then(|_| self.install_ring())
            {
                self.event(
                    "steering_error",
                    json!({"replica": i, "error": e.to_string()}),
                );
            }
        }
    }

    /// The bound on each heartbeat and status poll.
    fn poll_timeout(&self) -> Duration {
        self.settings
            .heartbeat_timeout
            .min(self.settings.rpc_timeout)
            .max(Duration::from_millis(1))
    }

    /// Records one heartbeat's outcome. `Some((i, true))`: `i` answered again after being
    /// dead; `Some((i, false))`: this miss made `i` dead.
    fn record_beat(
        &self,
        i: u32,
        res: std::result::Result<rc::Beat, rc::ReplicaError>,
    ) -> Option<(u32, bool)> {
        self.counters.heartbeats.fetch_add(1, Ordering::Relaxed);
        let now = Instant::now();
        let mut st = lock(&self.state);
        let (_, h) = st.replicas.get_mut(&i)?;
        match res {
            Ok(b) => {
                let revived = !h.alive;
                h.alive = true;
                h.missed = 0;
                h.beats += 1;
                h.flows = b.flows;
                h.last_error = None;
                if let Some((t0, rx0)) = h.last_rx {
                    let dt = now.saturating_duration_since(t0).as_secs_f64();
                    if dt > 0.0 {
                        h.pps = (b.rx_frames.saturating_sub(rx0) as f64 / dt) as u64;
                    }
                }
                h.last_rx = Some((now, b.rx_frames));
                revived.then_some((i, true))
            }
            Err(e) => {
                self.counters
                    .heartbeat_failures
                    .fetch_add(1, Ordering::Relaxed);
                h.missed = h.missed.saturating_add(1);
                h.last_error = Some(e.to_string());
                if h.alive && h.missed >= self.settings.dead_after_missed {
                    h.alive = false;
                    h.pps = 0;
                    Some((i, false))
                } else {
                    None
                }
            }
        }
    }

    /// The load snapshot the policy sees (live, non-draining replicas).
    pub fn loads(&self) -> Vec<ReplicaLoad> {
        lock(&self.state)
            .replicas
            .iter()
            .filter(|(_, (_, h))| h.alive && !h.draining)
            .map(|(i, (_, h))| ReplicaLoad {
                index: *i,
                flows: h.flows,
                pps: h.pps,
            })
            .collect()
    }

    // ---------------------------------------------------------------- queries

    /// Placement changes (scale, migration, rebalance, exception GC) start only while the store
    /// answers: one begun without it could not record what it did, and a controller that
    /// cannot reach the store cannot know it is still the one in charge. Replicas keep
    /// forwarding and replicating meanwhile; nothing here touches them.
    fn store_gate(&self, what: &str) -> Result<()> {
        let r = lock(&self.store).health();
        if let Err(e) = r {
            self.counters.store_refusals.fetch_add(1, Ordering::Relaxed);
            self.event(
                "store_unavailable",
                json!({"refused": what, "error": e.to_string()}),
            );
            return Err(e.into());
        }
        Ok(())
    }

    /// Whether the store serves now (etcd is asked; bounded by its request timeout).
    pub fn store_status(&self) -> Value {
        let s = lock(&self.store);
        match s.health() {
            Ok(rev) => json!({"backend": s.backend(), "ok": true, "revision": rev}),
            Err(e) => json!({"backend": s.backend(), "ok": false, "error": e.to_string(),
                "revision": s.revision(),
                "note": "no placement change (scale, migration, failover) until the store answers; \
                         replicas keep forwarding and replicating"}),
        }
    }

    /// Records this controller's role (the daemon, once it leads).
    pub fn set_role(&self, v: Value) {
        *lock(&self.role) = v;
    }

    pub fn status(&self) -> Value {
        let store = self.store_status();
        let role = lock(&self.role).clone();
        let steer = lock(&self.steering).stats();
        let st = lock(&self.state);
        let replicas: Vec<Value> = st
            .replicas
            .values()
            .map(|(r, h)| {
                json!({
                    "index": r.index, "name": format!("r{}", r.index),
                    "socket": r.socket, "managed": r.managed,
                    "alive": h.alive, "draining": h.draining, "missed": h.missed,
                    "failed_over": h.failed_over,
                    "beats": h.beats, "flows": h.flows, "pps": h.pps,
                    "last_error": h.last_error,
                    "port_blocks": st.ports.as_ref().map(|p| p.of(r.index).iter()
                        .map(|x| format!("{}-{}", x.start(), x.end())).collect::<Vec<_>>()),
                })
            })
            .collect();
        let c = &self.counters;
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        json!({
            "ok": true,
            "epoch": st.epoch,
            "replicas": replicas,
            "policy": st.policy,
            "last_scale_out_ready_ms": st.last_scale_out_ms,
            "counters": {
                "heartbeats": g(&c.heartbeats), "heartbeat_failures": g(&c.heartbeat_failures),
                "flows_migrated": g(&c.flows_migrated), "migrations_failed": g(&c.migrations_failed),
                "scale_outs": g(&c.scale_outs), "scale_ins": g(&c.scale_ins),
                "rebalances": g(&c.rebalances), "replicas_died": g(&c.replicas_died),
                "unparsable_keys": g(&c.unparsable_keys), "events_dropped": g(&c.events_dropped),
                "malformed_answers": g(&c.malformed_answers),
                "exceptions_collected": g(&c.exceptions_collected),
                "gc_skipped": g(&c.gc_skipped),
                "store_refusals": g(&c.store_refusals),
            },
            "steering": steer,
            "store": store,
            "controller": role,
            "hosts": self.hosts.get().map(|h| h.status()),
            "ha": self.ha_summary(&st),
            // Serving replicas with HA on that would lose their flows if they died now.
            "unprotected": Self::unprotected_of(&st),
            "events": st.events.iter().rev().take(20).collect::<Vec<_>>(),
        })
    }

    /// Flows per replica (as each lists them; listings are bounded by the replica).
    pub fn flows(&self, only: Option<u32>) -> Result<Value> {
        let targets: Vec<(u32, PathBuf, bool)> = {
            let st = lock(&self.state);
            if let Some(i) = only {
                if !st.replicas.contains_key(&i) {
                    return Err(ControllerError::NoReplica(i));
                }
            }
            st.replicas
                .iter()
                .filter(|(i, _)| only.is_none() || only == Some(**i))
                .map(|(i, (r, h))| (*i, r.socket.clone(), h.alive))
                .collect()
        };
        let mut out = Vec::new();
        for (i, sock, alive) in targets {
            if !alive {
                out.push(json!({"replica": i, "alive": false}));
                continue;
            }
            match self
                .settings
                .control
                .flows(&sock, self.settings.rpc_timeout)
            {
                Ok((total, f)) => {
                    out.push(json!({"replica": i, "alive": true, "total": total, "flows": f}))
                }
                Err(e) => out.push(json!({"replica": i, "alive": true, "error": e.to_string()})),
            }
        }
        Ok(json!({"ok": true, "replicas": out}))
    }

    pub fn policy(&self) -> Policy {
        lock(&self.state).policy.clone()
    }

    /// Applies `k=v` assignments atomically (all or none) and stores the result.
    pub fn set_policy(&self, assignments: &[(String, String)]) -> Result<Policy> {
        let mut p = self.policy();
        for (k, v) in assignments {
            p.set(k, v)?;
        }
        // An explicit `min_replicas` below what HA needs is refused here, naming both.
        p.check(self.ha_floor())?;
        store::put_json(lock(&self.store).as_mut(), K_POLICY, &p)?;
        lock(&self.state).policy = p.clone();
        self.event("policy_set", json!(assignments));
        Ok(p)
    }

    // ---------------------------------------------------------------- migration

    fn alive_target(&self, i: u32) -> Result<ReplicaRecord> {
        let st = lock(&self.state);
        let (r, h) = st.replicas.get(&i).ok_or(ControllerError::NoReplica(i))?;
        if !h.alive {
            return Err(ControllerError::Dead(i));
        }
        Ok(r.clone())
    }

    /// Moves `flows` from `from` to `to`: runs the migration, switching the fabric's
    /// exceptions for every key and alias to `to` at the migration's switch-over point.
    pub fn move_flows(&self, from: u32, to: u32, flows: &[FlowEntry]) -> Result<Value> {
        if from == to {
            return Err(ControllerError::BadRequest(format!(
                "r{from} -> r{to}: same replica"
            )));
        }
        let src = self.alive_target(from)?;
        let dst = self.alive_target(to)?;
        if lock(&self.state)
            .replicas
            .get(&to)
            .is_some_and(|(_, h)| h.draining)
        {
            return Err(ControllerError::Refused(format!("r{to} is draining")));
        }
        if flows.is_empty() {
            return Ok(json!({"ok": true, "moved": 0}));
        }
        let mut keys: Vec<FlowKey> = Vec::new();
        for f in flows {
            for s in std::iter::once(&f.key).chain(f.aliases.iter()) {
                match s.parse::<FlowKey>() {
                    Ok(k) => keys.push(k),
                    Err(_) => {
                        self.counters
                            .unparsable_keys
                            .fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }
        // One intent at a time: a move cut short by a previous leader whose roll-back could not
        // be delivered yet (its destination does not answer) must not be overwritten by this
        // one, or its destination's holds would never be ended.
        if let Some(p) =
            store::get_json::<MigrationIntent>(lock(&self.store).as_ref(), K_MIGRATION_INTENT)?
        {
            return Err(ControllerError::BadRequest(format!(
                "a move r{} -> r{} of {} flow(s) cut short by the previous leader is not resolved \
                 yet (r{} has not answered its roll-back); retried every policy round",
                p.from,
                p.to,
                p.flows.len(),
                p.to
            )));
        }
        let intent = MigrationIntent {
            from,
            to,
            flows: flows.to_vec(),
            started_unix_ms: now_ms(),
        };
        store::put_json(lock(&self.store).as_mut(), K_MIGRATION_INTENT, &intent)?;
        let r = self.move_flows_recorded(from, to, flows, &src, &dst, keys);
        // Settled either way (moved and recorded, or steered back): nothing left to resolve. A
        // failure to delete is harmless: the successor finds every flow where steering says.
        if let Err(e) = lock(&self.store).delete(K_MIGRATION_INTENT) {
            self.event("intent_not_cleared", json!({"error": e.to_string()}));
        }
        r
    }

    fn move_flows_recorded(
        &self,
        from: u32,
        to: u32,
        flows: &[FlowEntry],
        src: &ReplicaRecord,
        dst: &ReplicaRecord,
        keys: Vec<FlowKey>,
    ) -> Result<Value> {
        let mut switched = false;
        let mut steered: BTreeSet<FlowKey> = keys.iter().copied().collect();
        let started = Instant::now();
        let res = {
            let mut steer = |extra: &[FlowKey]| -> std::result::Result<(), String> {
                steered.extend(extra.iter().copied());
                let entries: Vec<(FlowKey, u32)> = steered.iter().map(|k| (*k, to)).collect();
                lock(&self.steering)
                    .set_exceptions(&entries)
                    .map_err(|e| e.to_string())?;
                switched = true;
                Ok(())
            };
            self.migrator
                .migrate(&src.socket, &dst.socket, flows, &mut steer)
        };
        let steered: Vec<FlowKey> = steered.into_iter().collect();
        match res {
            Ok(out) => {
                // Flows the source could not export stay there: steer them (and their aliases)
                // back.
                let mut back: Vec<FlowKey> = Vec::new();
                for fk in &out.failed {
                    if let Some(f) = flows.iter().find(|f| &f.key == fk) {
                        back.extend(
                            std::iter::once(&f.key)
                                .chain(f.aliases.iter())
                                .filter_map(|s| s.parse::<FlowKey>().ok()),
                        );
                    }
                }
                if !back.is_empty() {
                    let entries: Vec<(FlowKey, u32)> = back.iter().map(|k| (*k, from)).collect();
                    lock(&self.steering).set_exceptions(&entries)?;
                }
                let back_set: BTreeSet<FlowKey> = back.iter().copied().collect();
                let moved_keys: Vec<FlowKey> = steered
                    .iter()
                    .filter(|k| !back_set.contains(k))
                    .copied()
                    .collect();
                self.save_exceptions(&moved_keys, Some(to))?;
                self.save_exceptions(&back, Some(from))?;
                let epoch = self.bump_epoch()?;
                self.counters
                    .flows_migrated
                    .fetch_add(out.moved, Ordering::Relaxed);
                {
                    // Until the next heartbeat, account the move so the policy does not act
                    // twice on the same imbalance.
                    let mut st = lock(&self.state);
                    let n = out.moved;
                    if let Some((_, h)) = st.replicas.get_mut(&from) {
                        h.flows = h.flows.saturating_sub(n);
                    }
                    if let Some((_, h)) = st.replicas.get_mut(&to) {
                        h.flows += n;
                    }
                    st.last_action = Some(Instant::now());
                }
                let ms = started.elapsed().as_secs_f64() * 1e3;
                self.event(
                    "migrated",
                    json!({"from": from, "to": to, "flows": flows.len(), "moved": out.moved,
                        "failed": out.failed.len(), "ms": ms, "epoch": epoch}),
                );
                Ok(
                    json!({"ok": true, "from": from, "to": to, "moved": out.moved,
                    "failed": out.failed, "keys_steered": moved_keys.len(), "epoch": epoch,
                    "ms": ms, "detail": out.detail}),
                )
            }
            Err(e) => {
                self.counters
                    .migrations_failed
                    .fetch_add(1, Ordering::Relaxed);
                if switched {
                    // The migration did not complete, so the flows are still at the source:
                    // point steering back at it.
                    let back: Vec<(FlowKey, u32)> = steered.iter().map(|k| (*k, from)).collect();
                    if let Err(se) = lock(&self.steering).set_exceptions(&back) {
                        self.event("steering_error", json!({"error": se.to_string()}));
                    }
                }
                self.event(
                    "migration_failed",
                    json!({"from": from, "to": to, "error": e.to_string()}),
                );
                Err(e.into())
            }
        }
    }

    /// Finishes or rolls back a migration a previous controller left under way (it died
    /// between writing its intent and settling the move). Called once at start-up, before any
    /// loop runs:
    /// - if the fabric steers any of its keys to the destination, the move got past its switch:
    ///   flows still live at the source are moved again (the destination's holds are still
    ///   there, the source exports them as usual); flows live at the destination get their
    ///   exceptions recorded; steering of the rest follows where each flow lives;
    /// - otherwise nothing ever went to the destination: its holds are ended (`migrate_abort`)
    ///   and the flows stay where they are.
    pub fn resolve_intents(&self) -> Result<Option<Value>> {
        let Some(i) =
            store::get_json::<MigrationIntent>(lock(&self.store).as_ref(), K_MIGRATION_INTENT)?
        else {
            return Ok(None);
        };
        let keys_of = |f: &FlowEntry| -> Vec<FlowKey> {
            std::iter::once(&f.key)
                .chain(f.aliases.iter())
                .filter_map(|s| s.parse::<FlowKey>().ok())
                .collect()
        };
        let all: Vec<FlowKey> = i.flows.iter().flat_map(keys_of).collect();
        let steered_to_dst = {
            let ex = lock(&self.steering).exceptions()?;
            let set: BTreeSet<FlowKey> = all.iter().copied().collect();
            ex.iter().any(|(k, o)| *o == i.to && set.contains(k))
        };
        let (src, dst) = (self.alive_target(i.from), self.alive_target(i.to));
        // A heartbeat's bound, not a slow request's: a leader taking over must not wait long
        // on a replica that hangs (the intent stays and is retried every policy round).
        let timeout = self.settings.heartbeat_timeout;
        // Whether the intent was already replaced (by the move of the flows still at the source).
        let mut replaced = false;
        let outcome = match (steered_to_dst, &src, &dst) {
            (false, _, Ok(d)) => {
                // Rolled back only once the destination's holds are ended: a hold left behind
                // would keep the flow's packets there if it ever came (a later failover).
                self.settings
                    .control
                    .call(
                        &d.socket,
                        &Request::MigrateAbort { keys: all.clone() },
                        timeout,
                    )
                    .inspect_err(|e| {
                        self.event(
                            "intent_pending",
                            json!({"from": i.from, "to": i.to, "error": e.to_string()}),
                        )
                    })?;
                json!({"resolved": "rolled_back", "from": i.from, "to": i.to,
                    "flows": i.flows.len()})
            }
            (true, Ok(s), Ok(d)) => {
                let (mut at_src, mut at_dst, mut gone) = (Vec::new(), Vec::new(), 0u64);
                for f in &i.flows {
                    let Ok(k) = f.key.parse::<FlowKey>() else {
                        continue;
                    };
                    if self
                        .settings
                        .control
                        .flow(&s.socket, &k, timeout)?
                        .is_some()
                    {
                        at_src.push(f.clone());
                    } else if self
                        .settings
                        .control
                        .flow(&d.socket, &k, timeout)?
                        .is_some()
                    {
                        at_dst.push(f.clone());
                    } else {
                        gone += 1;
                    }
                }
                let dst_keys: Vec<FlowKey> = at_dst.iter().flat_map(keys_of).collect();
                if !dst_keys.is_empty() {
                    let entries: Vec<(FlowKey, u32)> =
                        dst_keys.iter().map(|k| (*k, i.to)).collect();
                    lock(&self.steering).set_exceptions(&entries)?;
                    self.save_exceptions(&dst_keys, Some(i.to))?;
                }
                let moved_again = if at_src.is_empty() {
                    Value::Null
                } else {
                    // The rest moves as a move of its own (its own intent).
                    lock(&self.store).delete(K_MIGRATION_INTENT)?;
                    replaced = true;
                    self.move_flows(i.from, i.to, &at_src)?
                };
                json!({"resolved": "completed", "from": i.from, "to": i.to,
                    "at_destination": at_dst.len(), "moved_again": at_src.len(),
                    "ended": gone, "move": moved_again})
            }
            // A replica of the move is gone: its flows are the failover's business (or lost
            // with it); the intent has nothing left to do.
            _ => json!({"resolved": "abandoned", "from": i.from, "to": i.to,
                "source_alive": src.is_ok(), "destination_alive": dst.is_ok()}),
        };
        if !replaced {
            lock(&self.store).delete(K_MIGRATION_INTENT)?;
        }
        self.event("intent_resolved", outcome.clone());
        Ok(Some(outcome))
    }

    /// Retries a move cut short by a previous leader that could not be resolved when this
    /// controller took over (called every policy round; nothing to do in the common case: one
    /// store read). Under `ops`: no move of this controller runs meanwhile.
    pub fn retry_intents(&self) {
        let _ops = lock(&self.ops);
        if let Err(e) = self.resolve_intents() {
            tracing::debug!(error = %e, "move cut short still unresolved");
        }
    }

    fn save_exceptions(&self, keys: &[FlowKey], owner: Option<u32>) -> Result<()> {
        let mut st = lock(&self.store);
        let mut saved: BTreeMap<String, u32> =
            store::get_json(st.as_ref(), K_EXCEPTIONS)?.unwrap_or_default();
        for k in keys {
            match owner {
                Some(o) => saved.insert(k.to_string(), o),
                None => saved.remove(&k.to_string()),
            };
        }
        store::put_json(st.as_mut(), K_EXCEPTIONS, &saved)?;
        Ok(())
    }

    fn list_flows(&self, i: u32) -> Result<(u64, Vec<FlowEntry>)> {
        let r = self.alive_target(i)?;
        Ok(self
            .settings
            .control
            .flows(&r.socket, self.settings.rpc_timeout)?)
    }

    /// `pliant migrate --count N --from rA --to rB`.
    pub fn migrate_count(&self, from: u32, to: u32, count: u64) -> Result<Value> {
        let _ops = lock(&self.ops);
        self.migrate_count_locked(from, to, count)
    }

    fn migrate_count_locked(&self, from: u32, to: u32, count: u64) -> Result<Value> {
        self.store_gate("migrate")?;
        let (_, mut list) = self.list_flows(from)?;
        // Move the most recently listed first: the listing order is the replica's, and taking
        // from the end keeps the choice deterministic for a given listing.
        let take = (count as usize).min(list.len());
        let batch: Vec<FlowEntry> = list.split_off(list.len() - take);
        self.move_flows(from, to, &batch)
    }

    /// `pliant migrate --flow KEY --to rN`: finds the flow's owner and moves it.
    pub fn migrate_key(&self, key: &str, to: u32) -> Result<Value> {
        let want: FlowKey = key.parse().map_err(|e: pliant_state::ParseFlowKeyError| {
            ControllerError::BadRequest(e.to_string())
        })?;
        let _ops = lock(&self.ops);
        self.store_gate("migrate")?;
        let candidates: Vec<u32> = lock(&self.state)
            .replicas
            .iter()
            .filter(|(_, (_, h))| h.alive)
            .map(|(i, _)| *i)
            .collect();
        // Each replica is asked for the key itself (one index lookup there), not for its
        // listing: a listing stops at `max_listed_flows`, so a flow past it was never found.
        let mut unanswered: Vec<String> = Vec::new();
        for i in candidates {
            // Died since the candidates were taken: nothing can be moved off it anyway.
            let Ok(r) = self.alive_target(i) else {
                continue;
            };
            let sock = r.socket;
            match self
                .settings
                .control
                .flow(&sock, &want, self.settings.rpc_timeout)
            {
                Ok(Some(f)) => {
                    if i == to {
                        return Ok(
                            json!({"ok": true, "moved": 0, "note": format!("already on r{to}")}),
                        );
                    }
                    return self.move_flows(i, to, &[f]);
                }
                Ok(None) => {}
                Err(e) => unanswered.push(format!("r{i}: {e}")),
            }
        }
        let shown: String = key.chars().take(120).collect();
        if unanswered.is_empty() {
            return Err(ControllerError::NoSuchFlow(shown));
        }
        // "Not found" would be a guess: the flow may live on a replica that did not answer.
        Err(ControllerError::Refused(format!(
            "flow {shown} is on none of the replicas that answered; no answer from {}",
            unanswered.join("; ")
        )))
    }

    fn execute_moves(&self, moves: &[Move]) -> Result<Vec<Value>> {
        let mut out = Vec::new();
        for m in moves {
            out.push(self.migrate_count_locked(m.from, m.to, m.count)?);
        }
        Ok(out)
    }

    // ---------------------------------------------------------------- scaling

    /// Starts a replica through the agent and makes it serve: fabric ports, port blocks, ring.
    pub fn scale_out(&self) -> Result<Value> {
        let _ops = lock(&self.ops);
        self.scale_out_locked()
    }

    fn scale_out_locked(&self) -> Result<Value> {
        let t0 = Instant::now();
        self.store_gate("scale_out")?;
        let max = self.policy().max_replicas as usize;
        if lock(&self.state).replicas.len() >= max {
            return Err(ControllerError::Refused(format!(
                "already at max_replicas {max} (pliant policy set max_replicas=N)"
            )));
        }
        let started = {
            let mut a = lock(&self.agent);
            a.as_mut().ok_or(ControllerError::NoAgent)?.add_replica()?
        };
        let rec = ReplicaRecord {
            index: started.index,
            socket: started.socket.clone(),
            managed: true,
            added_unix_ms: now_ms(),
        };
        let attach = lock(&self.steering).add_replica(rec.index);
        if let Err(e) = attach {
            // Without fabric ports the replica can never serve: undo.
            if let Some(a) = lock(&self.agent).as_mut() {
                let _ = a.remove_replica(rec.index);
            }
            return Err(e.into());
        }
        let recorded = store::put_json(
            lock(&self.store).as_mut(),
            &format!("{P_REPLICAS}{}", rec.index),
            &rec,
        );
        if let Err(e) = recorded {
            // The store went away after the gate: a replica nobody recorded would be an orphan
            // after a restart or a change of controller. Undo; the ring never saw it.
            let _ = lock(&self.steering).set_live(rec.index, false);
            if let Some(a) = lock(&self.agent).as_mut() {
                let _ = a.remove_replica(rec.index);
            }
            return Err(e.into());
        }
        lock(&self.state).replicas.insert(
            rec.index,
            (
                rec.clone(),
                Health {
                    alive: true,
                    ..Health::default()
                },
            ),
        );
        if let Some((socket, tell)) = self.ensure_port_blocks(&rec, self.settings.rpc_timeout)? {
            // A new replica whose index had blocks (a reused index): told now, as new ones.
            self.settings
                .control
                .call(&socket, &tell, self.settings.rpc_timeout)?;
        }
        self.install_ring()?;
        let epoch = self.bump_epoch()?;
        let serving_ms = t0.elapsed().as_millis() as u64;
        // The new replica can back others up and needs protecting itself: every live replica
        // gets a policy over the grown set (chords spread over the new member too).
        let protect = self.protect_all();
        {
            let mut st = lock(&self.state);
            st.last_action = Some(Instant::now());
            st.last_scale_out_ms = Some(serving_ms);
        }
        self.counters.scale_outs.fetch_add(1, Ordering::Relaxed);
        self.event(
            "scale_out",
            json!({"replica": rec.index, "process_ready_ms": started.ready_ms, "serving_ms": serving_ms}),
        );
        Ok(
            json!({"ok": true, "replica": rec.index, "process_ready_ms": started.ready_ms,
            "serving_ms": serving_ms, "epoch": epoch, "protect": protect}),
        )
    }

    /// Merges `victim` (default: the policy's choice) into the survivors and destroys it.
    pub fn scale_in(&self, victim: Option<u32>) -> Result<Value> {
        let _ops = lock(&self.ops);
        self.scale_in_locked(victim)
    }

    fn scale_in_locked(&self, victim: Option<u32>) -> Result<Value> {
        let t0 = Instant::now();
        self.store_gate("scale_in")?;
        let loads = self.loads();
        if loads.len() <= 1 {
            return Err(ControllerError::Refused(
                "only one live replica: nothing to merge into".into(),
            ));
        }
        let v = match victim {
            Some(v) => {
                if !loads.iter().any(|l| l.index == v) {
                    return Err(ControllerError::NoReplica(v));
                }
                v
            }
            None => loads
                .iter()
                .min_by(|a, b| a.flows.cmp(&b.flows).then(b.index.cmp(&a.index)))
                .map(|l| l.index)
                .ok_or_else(|| ControllerError::Refused("no live replica".into()))?,
        };
        let vrec = self.record(v)?;
        // 1. Out of the ring: new flows go to the survivors; live flows stay pinned to v.
        if let Some((_, h)) = lock(&self.state).replicas.get_mut(&v) {
            h.draining = true;
        }
        if let Err(e) = self.install_ring() {
            if let Some((_, h)) = lock(&self.state).replicas.get_mut(&v) {
                h.draining = false;
            }
            return Err(e);
        }
        // 2. Drain: move every flow to the survivors, evenly, until v lists none.
        let max_batch = self.policy().max_batch;
        let mut moved = 0u64;
        let mut rounds = 0;
        loop {
            let (total, list) = match self
                .settings
                .control
                .flows(&vrec.socket, self.settings.rpc_timeout)
            {
                Ok(x) => x,
                Err(e) => {
                    self.abort_drain(v);
                    return Err(e.into());
                }
            };
            if total == 0 || list.is_empty() {
                break;
            }
            rounds += 1;
            if rounds > MAX_DRAIN_ROUNDS {
                self.abort_drain(v);
                return Err(ControllerError::Refused(format!(
                    "r{v} still holds {total} flows after {MAX_DRAIN_ROUNDS} rounds; left in service"
                )));
            }
            let survivors: Vec<ReplicaLoad> =
                self.loads().into_iter().filter(|l| l.index != v).collect();
            let victim_load = ReplicaLoad {
                index: v,
                flows: list.len() as u64,
                pps: 0,
            };
            let plan = policy::plan_merge(&victim_load, &survivors, max_batch);
            let mut rest = list;
            for m in plan {
                let take = (m.count as usize).min(rest.len());
                let batch: Vec<FlowEntry> = rest.split_off(rest.len() - take);
                match self.move_flows(v, m.to, &batch) {
                    Ok(r) => moved += r.get("moved").and_then(Value::as_u64).unwrap_or(0),
                    Err(e) => {
                        self.abort_drain(v);
                        return Err(e);
                    }
                }
            }
        }
        // 3. Coherent state: run the combiners (v's shared state merged into a survivor).
        let merged = self.merge_shared(&vrec);
        // 4. Destroy: fabric first (no packet may be sent to a vanishing port), then ports,
        //    then the process and namespace.
        {
            let mut s = lock(&self.steering);
            s.set_live(v, false)?;
            let _ = s.flush_pins(v);
        }
        let released = lock(&self.state)
            .ports
            .as_mut()
            .map(|p| p.release(v))
            .unwrap_or_default();
        {
            let mut s = lock(&self.steering);
            for r in &released {
                s.set_port_owner(r.clone(), None)?;
            }
        }
        let pb = lock(&self.state).ports.clone();
        if let Some(pb) = pb {
            store::put_json(lock(&self.store).as_mut(), K_PORTS, &pb)?;
        }
        {
            let mut a = lock(&self.agent);
            match a.as_mut() {
                // The agent can remove replicas it did not start too (the lab's initial ones).
                Some(a) => a.remove_replica(v)?,
                None => {
                    // No agent: ask the process to stop; its host is not ours to remove.
                    let _ = self.settings.control.call(
                        &vrec.socket,
                        &Request::Shutdown,
                        self.settings.rpc_timeout,
                    );
                }
            }
        }
        lock(&self.store).delete(&format!("{P_REPLICAS}{v}"))?;
        lock(&self.state).replicas.remove(&v);
        let epoch = self.bump_epoch()?;
        // Survivors that backed v up are protected elsewhere now; those it backed up too.
        self.forget_replica_ha(v);
        self.protect_all();
        lock(&self.state).last_action = Some(Instant::now());
        self.counters.scale_ins.fetch_add(1, Ordering::Relaxed);
        let ms = t0.elapsed().as_millis() as u64;
        self.event(
            "scale_in",
            json!({"replica": v, "moved": moved, "ms": ms, "shared": merged}),
        );
        Ok(
            json!({"ok": true, "replica": v, "moved": moved, "ms": ms, "shared": merged, "epoch": epoch}),
        )
    }

    fn abort_drain(&self, v: u32) {
        if let Some((_, h)) = lock(&self.state).replicas.get_mut(&v) {
            h.draining = false;
        }
        if let Err(e) = self.install_ring() {
            self.event("steering_error", json!({"error": e.to_string()}));
        }
    }

    /// Exports `v`'s coherent state and merges it into the first survivor (combiners run there;
    /// PULL/PUSH spread it further). Best effort: reported, never blocks the scale-in.
    fn merge_shared(&self, v: &ReplicaRecord) -> Value {
        let exported = match self
            .settings
            .control
            .call(&v.socket, &Request::SharedExport, self.settings.rpc_timeout)
            .and_then(|a| rc::decode::<SharedExport>(&v.socket, "shared_export", &a))
        {
            Ok(x) => x,
            Err(e) => return json!({"exported": false, "error": e.to_string()}),
        };
        let Some(target) = self.live_indexes().into_iter().find(|i| *i != v.index) else {
            return json!({"exported": true, "merged": false, "error": "no survivor"});
        };
        let Ok(t) = self.record(target) else {
            return json!({"exported": true, "merged": false});
        };
        let req = Request::SharedMerge {
            bytes: exported.bytes,
        };
        match self
            .settings
            .control
            .call(&t.socket, &req, self.settings.rpc_timeout)
        {
            Ok(r) => json!({"exported": true, "merged_into": target, "answer": r}),
            Err(e) => json!({"exported": true, "merged": false, "error": e.to_string()}),
        }
    }

    /// One policy evaluation; acts when the policy says so (and `auto` is on, unless `force`).
    pub fn policy_tick(&self, force: bool) -> Result<Value> {
        let (p, since) = {
            let st = lock(&self.state);
            (
                st.policy.clone(),
                st.last_action.map(|t| t.elapsed().as_millis() as u64),
            )
        };
        if !p.auto && !force {
            return Ok(json!({"ok": true, "decision": Decision::Nothing, "auto": false}));
        }
        let loads = self.loads();
        let d = policy::decide(&p, self.ha_floor(), &loads, since);
        let _ops = lock(&self.ops);
        let result = match &d {
            Decision::Nothing => Value::Null,
            Decision::ScaleOut { .. } => self.scale_out_locked()?,
            Decision::ScaleIn { victim, .. } => self.scale_in_locked(Some(*victim))?,
            Decision::Rebalance { moves } => {
                self.counters.rebalances.fetch_add(1, Ordering::Relaxed);
                json!(self.execute_moves(moves)?)
            }
        };
        if d != Decision::Nothing {
            self.event("policy", json!({"decision": d}));
        }
        Ok(json!({"ok": true, "decision": d, "result": result}))
    }

    /// Removes exceptions for flows no replica holds any more (the flow ended after moving or
    /// after a failover; FTMB replicas list their workers' flows too). Also retires
    /// failed-over replicas none of whose handed-over flows is steered any more (their NAT
    /// port blocks return to the pool, the agent removes them).
    ///
    /// The listing (one RPC per replica) runs without the HA lock, so a failover may run
    /// meanwhile: it takes the dead replica out of the listing before its flows reach their
    /// new owner, and records the handed-over keys only at its end. So the decisions are
    /// taken under the HA lock (never in the middle of a failover), and only for exceptions
    /// whose owner is still the one seen before the listing.
    pub fn gc_exceptions(&self) -> Result<usize> {
        let _ops = lock(&self.ops);
        self.store_gate("gc")?;
        let n = match self.gc_listing()? {
            Some((saved, present)) => {
                let _ha = lock(&self.ha_lock);
                self.gc_apply(&saved, &present)?
            }
            None => 0,
        };
        let _ha = lock(&self.ha_lock);
        self.retire_failed()?;
        Ok(n)
    }

    /// The saved exceptions (key -> owner) and every key and alias the live replicas list;
    /// `None` when there is nothing to collect or a listing was truncated (absence cannot be
    /// proven).
    fn gc_listing(&self) -> Result<Option<GcListing>> {
        let saved: BTreeMap<String, u32> =
            store::get_json(lock(&self.store).as_ref(), K_EXCEPTIONS)?.unwrap_or_default();
        if saved.is_empty() {
            return Ok(None);
        }
        let mut present: BTreeSet<String> = BTreeSet::new();
        let alive: Vec<u32> = self.live_indexes();
        for i in alive {
            let (total, list) = self.list_flows(i).inspect_err(|_| {
                self.counters.gc_skipped.fetch_add(1, Ordering::Relaxed);
            })?;
            if total as usize > list.len() {
                // Truncated listing: we cannot prove absence, so collect nothing this round.
                self.counters.gc_skipped.fetch_add(1, Ordering::Relaxed);
                return Ok(None);
            }
            for f in list {
                present.insert(f.key);
                present.extend(f.aliases);
            }
        }
        Ok(Some((saved, present)))
    }

    /// Removes the exceptions of `saved` that no replica listed in `present`, unless their
    /// owner changed since `saved` was read (a failover re-pointed the key at a replica that
    /// was listed before it imported the flow). Call with the HA lock held.
    fn gc_apply(&self, saved: &BTreeMap<String, u32>, present: &BTreeSet<String>) -> Result<usize> {
        let now: BTreeMap<String, u32> =
            store::get_json(lock(&self.store).as_ref(), K_EXCEPTIONS)?.unwrap_or_default();
        let stale: Vec<(FlowKey, u32)> = saved
            .iter()
            .filter(|(k, o)| !present.contains(*k) && now.get(*k) == Some(*o))
            .filter_map(|(k, o)| k.parse().ok().map(|k| (k, *o)))
            .collect();
        if stale.is_empty() {
            return Ok(0);
        }
        // A live owner's exception becomes a conn pin to it: a connection reusing the 5-tuple
        // may have started through the exception after the listing (it was not pinned), and
        // the ring could send its next packets elsewhere (a second mapping of one tuple, a
        // reset). Dead owners' exceptions just go (their pins are flushed at failover).
        // The outside side of a translated flow is never pinned (see `steering::nat_side`): its
        // exception just goes, and return traffic falls back to the port's owner.
        let live: BTreeSet<u32> = self.live_indexes().into_iter().collect();
        let mut s = lock(&self.steering);
        let nat = s.nat_addrs();
        let (to_pin, to_drop): (Vec<_>, Vec<_>) = stale
            .iter()
            .partition(|(k, o)| live.contains(o) && !steering::nat_side(k, &nat));
        let drop_keys: Vec<FlowKey> = to_drop.iter().map(|(k, _)| *k).collect();
        s.demote_exceptions(&to_pin)?;
        s.remove_exceptions(&drop_keys)?;
        drop(s);
        let stale: Vec<FlowKey> = stale.into_iter().map(|(k, _)| k).collect();
        self.save_exceptions(&stale, None)?;
        self.counters
            .exceptions_collected
            .fetch_add(stale.len() as u64, Ordering::Relaxed);
        Ok(stale.len())
    }

    pub fn heartbeat_interval(&self) -> Duration {
        self.settings.heartbeat
    }
}

#[cfg(test)]
mod tests;
