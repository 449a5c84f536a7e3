//! The NAT as an FTMB network function ([`FtmbNat`]): the same packet behaviour as
//! [`crate::Nat`] (source NAT to `external_ip`, reverse translation of replies, TCP phases and
//! the idle timeouts of [`Config`], ICMP echo by identifier, ICMP errors with their quote, drops
//! counted by reason), run on N FTMB worker threads.
//!
//! State split (see `pliant_runtime::ftmb::nf` for the contract):
//! - **Shared** ([`Shared`]): the three port pools in one [`SharedVar`] ([`VAR_POOLS`]) and the
//!   global mapping counters in another ([`VAR_COUNTERS`]). Every access is a PAL and a lock, so
//!   they are touched only when a mapping is created (allocate + count) or expired (release +
//!   count, batched per sweep), never on a packet of an established flow.
//! - **Local** ([`Local`]): each worker's mappings, keyed by the inside key with a reverse
//!   index by the outside tuple (the alias the normal NAT registers), the change tracking for
//!   snapshot deltas, drop counters, and the worker's clock state.
//!
//! Flow pinning: `queue_of` sends an inside packet to `hash(inside key) % workers` and a
//! packet addressed to `external_ip` to `external port % workers` (ICMP echo: the identifier).
//! A worker allocates only ports of its own residue class (`port % workers == queue`,
//! [`ResiduePool::alloc_in_class`] from a logged random start), so a reply reaches the worker
//! that owns the mapping without any shared lookup. All replicas must run the same number of
//! workers for imported mappings to keep that property.
//!
//! Determinism under replay: the only time source is `Worker::now()` (logged), read on every
//! [`CLOCK_EVERY`]-th packet of the worker, on a new mapping, and on the first packet of a fresh
//! worker; the last value read stamps `last_seen_ms`, and mappings that saw a packet since are
//! re-stamped at the next read (a stamp is never earlier than the activity: expiry is never
//! early, at worst late by one read interval). Idle expiry sweeps run inside packet
//! processing at most once per [`SWEEP_INTERVAL_MS`] of that logged time (a worker that gets
//! no packets expires nothing until its next one). Everything a later decision depends on
//! (packet count, last clock value, last sweep slot, mappings to re-stamp) is part of the
//! worker's snapshot records: besides one record per mapping, each worker ships one *worker
//! record* under the empty key (see [`WorkerMeta`]), so a replay from any snapshot makes the
//! same clock reads and sweeps as the original run. Snapshot records must be exact for the
//! same reason: a `last_seen_ms` stamp is a change (unlike in the Pico NAT, where it is soft).
//!
//! Flood defences, with the normal NAT's config and rules: the embryonic TCP timeout
//! ([`Config::mapping_timeout_s`]), eviction of the worker's oldest evictable mapping when its
//! residue class is full (the port changes hands inside the pool access; victims in
//! (`last_seen_ms`, key) order, a function of the mappings alone, so replay from records picks
//! the same), and `max_mappings_per_host` split among the workers
//! ([`Config::host_quota_allows`], counted per worker over its own mappings, checked before any
//! logged access). All derived from the mappings, so the records need nothing new.
//!
//! Records: key = postcard([`FlowKey`]) of the inside key, record = postcard([`Mapping`]) —
//! the same encoding as the flow table's, so an imported record means the same thing. The
//! worker record (empty key) has no steering keys (`steering_keys` returns `None`), its
//! `record_queue` is its own queue, and `import` skips it (counted).

use crate::guard::{qi, HostCounts};
pub use crate::pool::{PoolImage, ResiduePool, MAX_CLASSES};
use crate::{icmp_err, opens_mapping, xlate, Config, Mapping, Nat};
use pliant_ftmb::{Determinants, FtmbError, Master, QueueId, SharedVar, VarId, Worker};
use pliant_net::{proto, FlowKey};
use pliant_runtime::ftmb::{FlowDelta, FlowRecord, FtmbNf};
use pliant_runtime::{Packet, Side};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;

/// Shared variable: the TCP, UDP and ICMP port pools ([`Pools`]).
pub const VAR_POOLS: VarId = 0x4E41_5401;
/// Shared variable: the global mapping counters ([`GlobalCounters`]).
pub const VAR_COUNTERS: VarId = 0x4E41_5402;
/// A worker reads the (logged) clock on every this many packets.
pub const CLOCK_EVERY: u64 = 64;
/// Idle expiry sweeps a worker's mappings at most once per this much logged time.
pub const SWEEP_INTERVAL_MS: u64 = 1000;
/// Bound on one worker's mappings (creation over it is dropped as `nat_flow_table_full`).
pub const MAX_MAPPINGS_PER_WORKER: usize = 1 << 18;
/// Key of the worker record in snapshot records.
pub const WORKER_RECORD_KEY: &[u8] = b"";
const IMAGE_VERSION: u8 = 1;

/// The three per-protocol pools, one shared variable.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pools {
    pub tcp: ResiduePool,
    pub udp: ResiduePool,
    pub icmp: ResiduePool,
}

impl Pools {
    fn get(&mut self, p: u8) -> &mut ResiduePool {
        match p {
            proto::TCP => &mut self.tcp,
            proto::UDP => &mut self.udp,
            _ => &mut self.icmp,
        }
    }
}

/// Global counters (shared variable [`VAR_COUNTERS`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GlobalCounters {
    pub mappings_created: u64,
    pub mappings_expired: u64,
}

/// What `save_shared` produces and `declare` reads back.
#[derive(Serialize, Deserialize)]
struct SharedImage {
    version: u8,
    tcp: PoolImage,
    udp: PoolImage,
    icmp: PoolImage,
    counters: GlobalCounters,
}

/// Handles to the shared variables.
pub struct Shared {
    pub pools: Arc<SharedVar<Pools>>,
    pub counters: Arc<SharedVar<GlobalCounters>>,
    /// Worker count of the master (the residue classes): each worker enforces its share of
    /// `max_mappings_per_host`.
    pub workers: u16,
}

/// A worker's own decision state, shipped as the worker record of its snapshot records: with
/// it a replay from the snapshot reads the clock and sweeps exactly where the original did.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerMeta {
    pub queue: QueueId,
    /// Packets this worker processed.
    pub packets: u64,
    /// The last clock value read (ms since the Unix epoch), never decreasing.
    pub now_ms: u64,
    /// Whether `now_ms` holds a read value yet.
    pub clock_read: bool,
    /// `now_ms / SWEEP_INTERVAL_MS` at the last expiry sweep.
    pub sweep_slot: u64,
    /// Imported mappings whose external port lies in this NAT's own blocks: the pool never
    /// allocated it to them, so their expiry must not release it (it may be in use by one of
    /// our own mappings). Bounded by the worker's mappings.
    pub keep_port: BTreeSet<FlowKey>,
    /// Mappings that saw a packet since the last clock read: stamped with the (older) last
    /// read value, they are re-stamped with the next one, so a stamp is never earlier than the
    /// activity and a slow flow on a quiet worker (64 packets may take minutes) is not expired
    /// early; expiry can only be late, by up to one read interval. At most `CLOCK_EVERY`
    /// entries (emptied on every read).
    pub refresh: Vec<FlowKey>,
}

/// Per-worker counters for `local_stats` (behaviour never depends on them, so they need not
/// survive a snapshot).
#[derive(Default, Debug)]
struct LocalStats {
    translated_out: u64,
    translated_in: u64,
    icmp_errors_translated: u64,
    created: u64,
    expired: u64,
    /// Embryonic mappings removed to make room for a new one (pool pressure).
    evicted: u64,
    foreign_port_ended: u64,
    imported: u64,
    clock_reads: u64,
    sweeps: u64,
    /// Drops and other events by reason (a fixed set of static labels: bounded).
    events: BTreeMap<&'static str, u64>,
    /// The first few recovered mappings refused at import because this worker already held
    /// their inside key or outside tuple, each beside the mapping it collided with (an import
    /// conflict means two replicas held one flow: the detail is what tells how).
    import_conflicts: Vec<serde_json::Value>,
    /// The first few replies that found no mapping (outside tuple, TCP flags): after a
    /// recovery they tell a flow the recovery missed from the late packets of ended flows.
    no_mapping: Vec<String>,
}

/// Import conflicts kept in detail per worker (the counter counts them all).
const CONFLICTS_KEPT: usize = 8;

/// One worker's partitioned state.
pub struct Local {
    meta: WorkerMeta,
    /// Mappings by inside key (the key of the inside packets, direction-normalised).
    flows: HashMap<FlowKey, Mapping>,
    /// Outside tuple (what replies arrive with) -> inside key.
    by_outside: HashMap<FlowKey, FlowKey>,
    /// Inside keys created, changed or deleted since the last `take_delta`, each with whether
    /// the mapping existed at that delta (the logger has it). A mapping created and deleted
    /// between two deltas is forgotten, so the set stays bounded by the live state (at most
    /// the mappings at the last delta plus the live ones: 2 x `MAX_MAPPINGS_PER_WORKER`)
    /// however long no snapshot is taken (an unprotected replica).
    dirty: HashMap<FlowKey, bool>,
    /// The packet being processed read the clock (its stamps are exact). Per packet only.
    read_now: bool,
    /// The keys of `meta.refresh`, for an O(1) membership test on the packet path.
    refresh_set: HashSet<FlowKey>,
    /// Evictable mappings ([`Mapping::evictable`]) per protocol (TCP, UDP, ICMP) by
    /// (`last_seen_ms`, inside key): the eviction victim is the first one whose port this
    /// worker can reuse. Unlike the normal NAT's creation-order queue this order is a
    /// function of the mappings alone, so a worker rebuilt from snapshot records (which do not
    /// say in which order mappings were created) evicts exactly what the original did. Kept
    /// exact by `insert`, `remove` and `update`, the only ways mappings change.
    evictable: [BTreeSet<(u64, FlowKey)>; 3],
    /// Live mappings per inside host, for this worker's share of `max_mappings_per_host`.
    hosts: HostCounts,
    stats: LocalStats,
}

/// Where mapping `m` sits in the eviction index (its stamp), if evictable.
fn evict_slot(m: &Mapping) -> Option<u64> {
    m.evictable().then_some(m.last_seen_ms)
}

/// Evictable entries a new mapping looks at for one whose port this worker can reuse (only
/// imported mappings can be unusable: another replica's or class's port, or `keep_port`).
const EVICT_SCAN: usize = 64;

impl Local {
    fn new(queue: QueueId) -> Local {
        Local {
            meta: WorkerMeta {
                queue,
                ..WorkerMeta::default()
            },
            flows: HashMap::new(),
            by_outside: HashMap::new(),
            dirty: HashMap::new(),
            read_now: false,
            refresh_set: HashSet::new(),
            evictable: Default::default(),
            hosts: HostCounts::default(),
            stats: LocalStats::default(),
        }
    }

    pub fn queue(&self) -> QueueId {
        self.meta.queue
    }

    pub fn meta(&self) -> &WorkerMeta {
        &self.meta
    }

    /// Live mappings of this worker.
    pub fn len(&self) -> usize {
        self.flows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.flows.is_empty()
    }

    /// The mapping whose inside key is `key`.
    pub fn mapping(&self, key: &FlowKey) -> Option<&Mapping> {
        self.flows.get(key)
    }

    pub fn mappings(&self) -> impl Iterator<Item = &Mapping> {
        self.flows.values()
    }

    /// How often `reason` (a drop reason or event label) was counted.
    pub fn count_of(&self, reason: &str) -> u64 {
        self.stats.events.get(reason).copied().unwrap_or(0)
    }

    fn count(&mut self, reason: &'static str) {
        *self.stats.events.entry(reason).or_insert(0) += 1;
    }

    /// A packet of mapping `key` was handled with the cached clock value: re-stamp it at the
    /// next read.
    fn note_activity(&mut self, key: FlowKey) {
        if !self.read_now && self.refresh_set.insert(key) {
            self.meta.refresh.push(key);
        }
    }

    /// A live mapping changed. Not yet dirty means it existed at the last delta (a creation
    /// since would have made it dirty).
    fn touch(&mut self, key: FlowKey) {
        self.dirty.entry(key).or_insert(true);
    }

    fn insert(&mut self, key: FlowKey, alias: FlowKey, m: Mapping) {
        self.by_outside.insert(alias, key);
        if let Some(s) = evict_slot(&m) {
            self.evictable[qi(m.proto)].insert((s, key));
        }
        self.hosts.add(m.inside_addr);
        self.flows.insert(key, m);
        // Not dirty: new since the last delta. Dirty: deleted and re-created meanwhile; the
        // logger may still hold the old record, keep reporting it.
        self.dirty.entry(key).or_insert(false);
    }

    fn remove(&mut self, key: &FlowKey, alias: &FlowKey) -> Option<Mapping> {
        let m = self.flows.remove(key)?;
        if self.by_outside.get(alias) == Some(key) {
            self.by_outside.remove(alias);
        }
        if let Some(s) = evict_slot(&m) {
            self.evictable[qi(m.proto)].remove(&(s, *key));
        }
        self.hosts.remove(m.inside_addr);
        if self.dirty.get(key) == Some(&false) {
            // Created after the last delta: the logger never saw it, nothing to delete.
            self.dirty.remove(key);
        } else {
            self.dirty.insert(*key, true);
        }
        Some(m)
    }

    /// Changes mapping `key` through `f` (None if there is none), keeping the eviction index
    /// in step with its stamp and evictability.
    fn update<R>(&mut self, key: &FlowKey, f: impl FnOnce(&mut Mapping) -> R) -> Option<R> {
        let m = self.flows.get_mut(key)?;
        let before = evict_slot(m);
        let r = f(m);
        let after = evict_slot(m);
        if before != after {
            let i = qi(m.proto);
            if let Some(s) = before {
                self.evictable[i].remove(&(s, *key));
            }
            if let Some(s) = after {
                self.evictable[i].insert((s, *key));
            }
        }
        Some(r)
    }

    /// The oldest evictable mapping of protocol `p` whose external port `reusable` accepts
    /// (and not kept out of the pool, see [`WorkerMeta::keep_port`]): key and port.
    fn eviction_victim(&self, p: u8, reusable: impl Fn(u16) -> bool) -> Option<(FlowKey, u16)> {
        self.evictable[qi(p)]
            .iter()
            .take(EVICT_SCAN)
            .filter(|(_, k)| !self.meta.keep_port.contains(k))
            .find_map(|&(_, k)| {
                let m = self.flows.get(&k)?;
                (m.proto == p && reusable(m.external_port)).then_some((k, m.external_port))
            })
    }

    /// Live mappings of inside `host` on this worker.
    pub fn host_mappings(&self, host: Ipv4Addr) -> u32 {
        self.hosts.get(host)
    }

    /// Evictable mappings on this worker (all protocols).
    pub fn evictable(&self) -> usize {
        self.evictable.iter().map(BTreeSet::len).sum()
    }
}

/// A stable (process- and host-independent) hash of a direction-normalised key: the I/O
/// thread, the workers and another replica importing a record must all agree on it. Hashing
/// the normalised key (not the directed tuple) sends a packet claiming to be the remote end of
/// an inside flow to the same worker, which then refuses it as the normal NAT does
/// (`nat_direction_mismatch`) instead of opening a second mapping elsewhere.
fn key_hash(k: &FlowKey) -> u64 {
    let mut h: u64 = 0xCBF2_9CE4_8422_2325;
    let mut eat = |v: u64| h = (h ^ v).wrapping_mul(0x0100_0000_01B3);
    eat(u64::from(k.proto));
    eat(u64::from(k.port_lo) << 16 | u64::from(k.port_hi));
    for a in [&k.addr_lo, &k.addr_hi] {
        for half in a.chunks_exact(8) {
            let mut b = [0u8; 8];
            b.copy_from_slice(half);
            eat(u64::from_le_bytes(b));
        }
    }
    // splitmix64 finaliser: the low bits (used modulo a small worker count) depend on all.
    h = (h ^ (h >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    h = (h ^ (h >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    h ^ (h >> 31)
}

fn key_queue(k: &FlowKey, n: usize) -> usize {
    (key_hash(k) % n as u64) as usize
}

fn encode<T: Serialize>(v: &T) -> Option<Vec<u8>> {
    postcard::to_allocvec(v).ok()
}

/// The NAT on FTMB workers.
pub struct FtmbNat {
    cfg: Config,
    /// The port blocks of the config (`port_blocks`, else `port_min..=port_max`).
    blocks: Vec<(u16, u16)>,
}

impl FtmbNat {
    pub fn new(cfg: Config) -> Result<Self, String> {
        cfg.validate()?;
        let blocks = cfg.blocks();
        Ok(FtmbNat { cfg, blocks })
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    fn owns_port(&self, port: u16) -> bool {
        self.blocks
            .iter()
            .any(|&(lo, hi)| (lo..=hi).contains(&port))
    }

    /// The normal NAT's timeout rule, embryonic TCP timeout included: it depends only on
    /// the mapping (in the records), so replay expires the same mappings.
    fn timeout_ms(&self, m: &Mapping) -> u64 {
        self.cfg.mapping_timeout_s(m).saturating_mul(1000)
    }

    /// The global counters and pool usage (for status; reads without a PAL, which is fine
    /// off the packet path: it changes nothing a replay depends on).
    pub fn shared_stats(&self, sh: &Shared) -> serde_json::Value {
        let pools = sh.pools.read_quiesced(|p| {
            let one = |x: &ResiduePool| {
                serde_json::json!({
                    "in_use": x.in_use(), "capacity": x.capacity(), "exhausted": x.exhausted,
                    "bad_release": x.bad_release, "foreign_release": x.foreign_release,
                })
            };
            serde_json::json!({"tcp": one(&p.tcp), "udp": one(&p.udp), "icmp": one(&p.icmp)})
        });
        let counters = sh.counters.read_quiesced(|c| *c);
        match (pools, counters) {
            (Ok(p), Ok(c)) => serde_json::json!({
                "pools": p,
                "mappings_created": c.mappings_created,
                "mappings_expired": c.mappings_expired,
            }),
            (Err(e), _) | (_, Err(e)) => serde_json::json!({ "error": e.to_string() }),
        }
    }

    /// Reads the logged clock; sweeps idle mappings when a new sweep slot began.
    fn tick(&self, sh: &Shared, local: &mut Local, w: &mut Worker) -> Result<(), FtmbError> {
        let now_ms = w.now()? / 1_000_000;
        // Never backwards (a wall-clock step would otherwise un-age mappings); the values are
        // logged, so replay computes the same maximum.
        local.meta.now_ms = local.meta.now_ms.max(now_ms);
        local.meta.clock_read = true;
        local.read_now = true;
        local.stats.clock_reads += 1;
        let now = local.meta.now_ms;
        local.refresh_set.clear();
        for k in std::mem::take(&mut local.meta.refresh) {
            let stamped = local.update(&k, |m| std::mem::replace(&mut m.last_seen_ms, now) != now);
            if stamped == Some(true) {
                local.touch(k);
            }
        }
        let slot = local.meta.now_ms / SWEEP_INTERVAL_MS;
        if slot != local.meta.sweep_slot {
            local.meta.sweep_slot = slot;
            self.sweep(sh, local, w)?;
        }
        Ok(())
    }

    /// Expires every mapping idle for its timeout: one pool access releases all their ports,
    /// one counter access counts them.
    fn sweep(&self, sh: &Shared, local: &mut Local, w: &mut Worker) -> Result<(), FtmbError> {
        local.stats.sweeps += 1;
        let now = local.meta.now_ms;
        let mut idle: Vec<FlowKey> = local
            .flows
            .iter()
            .filter(|(_, m)| now.saturating_sub(m.last_seen_ms) >= self.timeout_ms(m))
            .map(|(k, _)| *k)
            .collect();
        if idle.is_empty() {
            return Ok(());
        }
        // Canonical order (HashMap order differs between runs); the pool is a bitmap, so the
        // result would not depend on it anyway.
        idle.sort_unstable();
        let ext = self.cfg.external_ip;
        let mut ports = Vec::with_capacity(idle.len());
        for k in &idle {
            let alias = match local.flows.get(k) {
                Some(m) => m.outside_key(ext),
                None => continue,
            };
            if let Some(m) = local.remove(k, &alias) {
                if local.meta.keep_port.remove(k) {
                    local.count("nat_import_own_port_ended");
                } else {
                    ports.push((m.proto, m.external_port));
                }
            }
        }
        let n = idle.len() as u64;
        let foreign = if ports.is_empty() {
            0
        } else {
            w.access(&sh.pools, |pools| {
                let mut foreign = 0u64;
                for &(p, port) in &ports {
                    let pool = pools.get(p);
                    if !pool.release(port) && !pool.owns(port) {
                        foreign += 1;
                    }
                }
                foreign
            })?
        };
        w.access(&sh.counters, |c| c.mappings_expired += n)?;
        local.stats.expired += n;
        local.stats.foreign_port_ended += foreign;
        Ok(())
    }

    fn outbound(
        &self,
        sh: &Shared,
        local: &mut Local,
        w: &mut Worker,
        mut pkt: Packet,
        out: &mut Vec<Packet>,
    ) -> Result<(), FtmbError> {
        let (IpAddr::V4(src), IpAddr::V4(dst)) = (pkt.meta.src, pkt.meta.dst) else {
            local.count("nat_ipv6_unsupported");
            return Ok(());
        };
        let key = pkt.key();
        let flags = pkt.meta.tcp_flags;
        let now = local.meta.now_ms;
        let sport = pkt.meta.sport;
        let seen = local.update(&key, |m| {
            let before = (m.phase, m.last_seen_ms);
            m.outbound_packet(src, sport, flags, now)
                .map(|()| ((m.phase, m.last_seen_ms) != before, m.external_port))
        });
        let ext_port = match seen {
            Some(Err(reason)) => {
                local.count(reason);
                return Ok(());
            }
            Some(Ok((changed, port))) => {
                if changed {
                    local.touch(key);
                }
                local.note_activity(key);
                port
            }
            None => match self.create(sh, local, w, &pkt, key, src, dst)? {
                Ok(p) => p,
                Err(reason) => {
                    local.count(reason);
                    return Ok(());
                }
            },
        };
        if xlate::set_src(&mut pkt, self.cfg.external_ip, ext_port).is_err() {
            // Classify admitted only translatable packets: a frame/parse mismatch. The mapping
            // stays (it expires normally).
            local.count("nat_rewrite_failed");
            return Ok(());
        }
        local.stats.translated_out += 1;
        out.push(pkt);
        Ok(())
    }

    /// Creates the mapping of a new inside flow: the outer `Result` is the FTMB machinery's,
    /// the inner one the external port or a drop reason.
    #[allow(clippy::too_many_arguments)]
    fn create(
        &self,
        sh: &Shared,
        local: &mut Local,
        w: &mut Worker,
        pkt: &Packet,
        key: FlowKey,
        src: Ipv4Addr,
        dst: Ipv4Addr,
    ) -> Result<Result<u16, &'static str>, FtmbError> {
        let p = pkt.meta.proto;
        if let Err(reason) = opens_mapping(pkt) {
            return Ok(Err(reason));
        }
        if local.flows.len() >= MAX_MAPPINGS_PER_WORKER {
            return Ok(Err("nat_flow_table_full"));
        }
        // Before the clock read and any shared access: a host over its quota costs no lock
        // (local state only, so replay refuses the same packets).
        if !self
            .cfg
            .host_quota_allows(local.hosts.get(src), u32::from(sh.workers))
        {
            return Ok(Err("nat_host_quota"));
        }
        // A fresh time for the new mapping (and a chance to free ports first).
        self.tick(sh, local, w)?;
        let start = w.random()?;
        let class = w.queue();
        let held: &Local = local;
        // Under the pool's lock (so its PAL orders the decision): a free port of our class,
        // else the port of our oldest embryonic mapping, which changes hands without going
        // back to the pool (the victim is chosen from local state: replay picks the same).
        let got = w.access(&sh.pools, |pools| {
            let pool = pools.get(p);
            if !pool.class_full(class) {
                return pool.alloc_in_class(class, start).map(|port| (port, None));
            }
            let classes = pool.classes();
            let reusable = |port| pool.owns(port) && port % classes == class;
            let victim = held.eviction_victim(p, reusable);
            if victim.is_none() {
                pool.exhausted += 1;
            }
            victim.map(|(k, port)| (port, Some(k)))
        })?;
        let Some((ext, victim)) = got else {
            return Ok(Err("nat_port_exhausted"));
        };
        if let Some(k) = victim {
            let alias = local
                .flows
                .get(&k)
                .map(|m| m.outside_key(self.cfg.external_ip));
            if let Some(alias) = alias {
                local.remove(&k, &alias);
            }
            local.count("nat_evicted_embryonic");
            local.stats.evicted += 1;
        }
        let m = Mapping::opened_by(pkt, src, dst, ext, local.meta.now_ms);
        let alias = m.outside_key(self.cfg.external_ip);
        if local.by_outside.contains_key(&alias) {
            // Only an imported mapping holding a port of our own pool can be in the way
            // (import refuses those; kept as a guard): give the port back.
            w.access(&sh.pools, |pools| pools.get(p).release(ext))?;
            return Ok(Err("nat_alias_conflict"));
        }
        w.access(&sh.counters, |c| c.mappings_created += 1)?;
        local.insert(key, alias, m);
        local.stats.created += 1;
        Ok(Ok(ext))
    }

    fn inbound(&self, local: &mut Local, mut pkt: Packet, out: &mut Vec<Packet>) {
        let IpAddr::V4(dst) = pkt.meta.dst else {
            return local.count("nat_ipv6_unsupported");
        };
        if dst != self.cfg.external_ip {
            return local.count("nat_not_external_ip");
        }
        let now = local.meta.now_ms;
        let Some(key) = local.by_outside.get(&pkt.key()).copied() else {
            if local.stats.no_mapping.len() < CONFLICTS_KEPT {
                let flags = pkt.meta.tcp_flags;
                local
                    .stats
                    .no_mapping
                    .push(format!("{} flags {flags:#04x}", pkt.key()));
            }
            return local.count("nat_no_mapping");
        };
        let seen = local.update(&key, |m| {
            let before = (m.phase, m.replied, m.last_seen_ms);
            m.inbound_packet(&pkt, now).map(|()| {
                let changed = (m.phase, m.replied, m.last_seen_ms) != before;
                (changed, m.inside_addr, m.inside_port)
            })
        });
        let (changed, inside_addr, inside_port) = match seen {
            None => return local.count("nat_no_mapping"),
            Some(Err(reason)) => return local.count(reason),
            Some(Ok(v)) => v,
        };
        if changed {
            local.touch(key);
        }
        local.note_activity(key);
        if xlate::set_dst(&mut pkt, inside_addr, inside_port).is_err() {
            return local.count("nat_rewrite_failed");
        }
        local.stats.translated_in += 1;
        out.push(pkt);
    }

    /// Translates an ICMP error about a mapped flow (the quoted packet and the outer address),
    /// as the normal NAT does. Errors never create or refresh a mapping.
    fn icmp_error(&self, local: &mut Local, mut pkt: Packet, out: &mut Vec<Packet>) {
        let l4 = usize::from(pkt.meta.l4_off);
        let Some(inner) = icmp_err::parse_inner(&pkt.buf, l4, pkt.meta.l4_end()) else {
            return local.count("nat_icmp_error_unparsable");
        };
        let ik = inner.key();
        let key = if local.flows.contains_key(&ik) {
            ik
        } else if let Some(k) = local.by_outside.get(&ik) {
            *k
        } else {
            return local.count("nat_no_mapping");
        };
        let Some(m) = local.flows.get(&key).cloned() else {
            return local.count("nat_no_mapping");
        };
        if let Err(reason) = xlate::icmp_error(&mut pkt, &inner, &m, self.cfg.external_ip) {
            return local.count(reason);
        }
        local.stats.icmp_errors_translated += 1;
        out.push(pkt);
    }

    fn fresh_pools(&self, workers: u16) -> Result<Pools, String> {
        Ok(Pools {
            tcp: ResiduePool::new(&self.blocks, workers)?,
            udp: ResiduePool::new(&self.blocks, workers)?,
            icmp: ResiduePool::new(&self.blocks, workers)?,
        })
    }

    /// Decodes one mapping record and checks that its key is the mapping's inside key.
    fn decode_record(key: &[u8], record: &[u8]) -> Result<(FlowKey, Mapping), String> {
        let m: Mapping =
            postcard::from_bytes(record).map_err(|e| format!("nat: undecodable mapping: {e}"))?;
        let k: FlowKey =
            postcard::from_bytes(key).map_err(|e| format!("nat: undecodable flow key: {e}"))?;
        if !matches!(m.proto, proto::TCP | proto::UDP | proto::ICMP) {
            return Err(format!("nat: mapping of protocol {}", m.proto));
        }
        let ik = m.inside_key();
        if ik != k {
            return Err(format!("nat: record key {k} is not its mapping's ({ik})"));
        }
        Ok((ik, m))
    }
}

impl FtmbNf for FtmbNat {
    const NAME: &'static str = "nat";
    type Shared = Shared;
    type Local = Local;

    fn declare(&self, master: &Master, image: Option<&[u8]>) -> Result<Shared, String> {
        let workers = u16::try_from(master.workers())
            .map_err(|_| format!("nat: {} workers", master.workers()))?;
        let (pools, counters) = match image {
            None => (self.fresh_pools(workers)?, GlobalCounters::default()),
            Some(bytes) => {
                let img: SharedImage = postcard::from_bytes(bytes)
                    .map_err(|e| format!("nat: undecodable shared image: {e}"))?;
                if img.version != IMAGE_VERSION {
                    return Err(format!(
                        "nat: shared image version {} (this build reads {IMAGE_VERSION})",
                        img.version
                    ));
                }
                for p in [&img.tcp, &img.udp, &img.icmp] {
                    // The residue classes are the worker queues: a different count would
                    // send replies to workers that do not own the mappings.
                    if p.classes != workers {
                        return Err(format!(
                            "nat: shared image is for {} workers, the master has {workers}",
                            p.classes
                        ));
                    }
                }
                let pools = Pools {
                    tcp: ResiduePool::from_image(&img.tcp)?,
                    udp: ResiduePool::from_image(&img.udp)?,
                    icmp: ResiduePool::from_image(&img.icmp)?,
                };
                (pools, img.counters)
            }
        };
        Ok(Shared {
            pools: master
                .shared_var(VAR_POOLS, pools)
                .map_err(|e| e.to_string())?,
            counters: master
                .shared_var(VAR_COUNTERS, counters)
                .map_err(|e| e.to_string())?,
            workers,
        })
    }

    fn new_local(&self, queue: QueueId, records: &[FlowRecord]) -> Result<Local, String> {
        let mut local = Local::new(queue);
        let ext = self.cfg.external_ip;
        for (k, r) in records {
            if k.as_slice() == WORKER_RECORD_KEY {
                let meta: WorkerMeta = postcard::from_bytes(r)
                    .map_err(|e| format!("nat: undecodable worker record: {e}"))?;
                if meta.queue != queue {
                    return Err(format!(
                        "nat: worker record of queue {} given to queue {queue}",
                        meta.queue
                    ));
                }
                local.refresh_set = meta.refresh.iter().copied().collect();
                local.meta = meta;
                continue;
            }
            let (key, m) = Self::decode_record(k, r)?;
            let alias = m.outside_key(ext);
            local.insert(key, alias, m);
        }
        // Records from a snapshot are what the logger already has: nothing is dirty.
        local.dirty.clear();
        Ok(local)
    }

    fn queue_of(&self, pkt: &Packet, workers: usize) -> usize {
        let n = workers.max(1);
        let m = &pkt.meta;
        let IpAddr::V4(dst) = m.dst else {
            // Dropped by every worker anyway.
            return key_queue(&m.key, n);
        };
        let ext = self.cfg.external_ip;
        if m.proto == proto::ICMP && icmp_err::is_error(m.icmp_type) && !m.fragment {
            // An error goes where the packet it quotes went.
            let l4 = usize::from(m.l4_off);
            if let Some(inner) = icmp_err::parse_inner(&pkt.buf, l4, m.l4_end()) {
                match pkt.ingress {
                    Side::Outside if dst == ext && inner.src == ext => {
                        return usize::from(inner.sport) % n;
                    }
                    Side::Inside => return key_queue(&inner.key(), n),
                    Side::Outside => {}
                }
            }
        }
        match pkt.ingress {
            // TCP/UDP: the destination port; ICMP echo: the identifier (in both ports).
            Side::Outside if dst == ext => usize::from(m.dport) % n,
            _ => key_queue(&m.key, n),
        }
    }

    fn process(
        &self,
        sh: &Shared,
        local: &mut Local,
        w: &mut Worker,
        pkt: Packet,
        out: &mut Vec<Packet>,
    ) -> Result<(), FtmbError> {
        local.meta.packets += 1;
        local.read_now = false;
        if !local.meta.clock_read || local.meta.packets.is_multiple_of(CLOCK_EVERY) {
            self.tick(sh, local, w)?;
        }
        if let Err(reason) = Nat::classify(&pkt) {
            local.count(reason);
            return Ok(());
        }
        if pkt.meta.proto == proto::ICMP && icmp_err::is_error(pkt.meta.icmp_type) {
            self.icmp_error(local, pkt, out);
            return Ok(());
        }
        match pkt.ingress {
            Side::Inside => self.outbound(sh, local, w, pkt, out),
            Side::Outside => {
                self.inbound(local, pkt, out);
                Ok(())
            }
        }
    }

    fn save_shared(&self, sh: &Shared) -> Result<Vec<u8>, String> {
        let (tcp, udp, icmp) = sh
            .pools
            .read_quiesced(|p| (p.tcp.to_image(), p.udp.to_image(), p.icmp.to_image()))
            .map_err(|e| e.to_string())?;
        let counters = sh
            .counters
            .read_quiesced(|c| *c)
            .map_err(|e| e.to_string())?;
        let img = SharedImage {
            version: IMAGE_VERSION,
            tcp,
            udp,
            icmp,
            counters,
        };
        postcard::to_allocvec(&img).map_err(|e| format!("nat: encoding the shared image: {e}"))
    }

    fn take_delta(&self, local: &mut Local, full: bool) -> Vec<FlowDelta> {
        let mut out: Vec<FlowDelta> = Vec::new();
        let keys: Vec<FlowKey> = if full {
            local.dirty.clear();
            local.flows.keys().copied().collect()
        } else {
            local.dirty.drain().map(|(k, _)| k).collect()
        };
        let mut unencodable = 0u64;
        for k in keys {
            let Some(kb) = encode(&k) else {
                unencodable += 1;
                continue;
            };
            match local.flows.get(&k) {
                Some(m) => match encode(m) {
                    Some(rb) => out.push((kb, Some(rb))),
                    None => unencodable += 1,
                },
                None => out.push((kb, None)),
            }
        }
        // The worker record changes with every packet: always part of the delta.
        match encode(&local.meta) {
            Some(rb) => out.push((WORKER_RECORD_KEY.to_vec(), Some(rb))),
            None => unencodable += 1,
        }
        for _ in 0..unencodable {
            local.count("nat_record_encode_failed");
        }
        out.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        out
    }

    fn steering_keys(&self, record: &FlowRecord) -> Option<(FlowKey, Vec<FlowKey>)> {
        if record.0.as_slice() == WORKER_RECORD_KEY {
            return None;
        }
        let m: Mapping = postcard::from_bytes(&record.1).ok()?;
        Some((m.inside_key(), vec![m.outside_key(self.cfg.external_ip)]))
    }

    fn record_queue(&self, record: &FlowRecord, workers: usize) -> Option<usize> {
        if workers == 0 {
            return None;
        }
        if record.0.as_slice() == WORKER_RECORD_KEY {
            // Its own queue (where `import` skips it), so the runtime does not count it as a
            // record without a worker.
            let meta: WorkerMeta = postcard::from_bytes(&record.1).ok()?;
            return Some(usize::from(meta.queue) % workers);
        }
        let m: Mapping = postcard::from_bytes(&record.1).ok()?;
        Some(key_queue(&m.inside_key(), workers))
    }

    fn import(&self, local: &mut Local, records: Vec<FlowRecord>) -> Result<usize, String> {
        let ext = self.cfg.external_ip;
        let mut n = 0;
        for (k, r) in records {
            if k.as_slice() == WORKER_RECORD_KEY {
                // The dead primary's worker state: this worker keeps its own.
                local.count("nat_import_worker_record_skipped");
                continue;
            }
            let Ok((key, m)) = Self::decode_record(&k, &r) else {
                local.count("nat_import_bad_record");
                continue;
            };
            let alias = m.outside_key(ext);
            let held_key = local
                .flows
                .get(&key)
                .map(|_| key)
                .or_else(|| local.by_outside.get(&alias).copied());
            if let Some(held_key) = held_key {
                local.count("nat_import_conflict");
                if local.stats.import_conflicts.len() < CONFLICTS_KEPT {
                    let held = local.flows.get(&held_key);
                    local.stats.import_conflicts.push(serde_json::json!({
                        "same": if held_key == key { "inside_key" } else { "outside_tuple" },
                        "imported": format!("{m:?}"),
                        "held": format!("{held:?}"),
                    }));
                }
                continue;
            }
            if local.flows.len() >= MAX_MAPPINGS_PER_WORKER {
                local.count("nat_flow_table_full");
                continue;
            }
            if self.owns_port(m.external_port) {
                // The controller quarantines the dead primary's block so this does not
                // happen (disjoint `port_blocks`). If it does (e.g. replicas sharing one
                // range), the mapping still works, but the port was never allocated from our
                // pool: its expiry must not release it there. A new mapping of ours to the
                // same remote on that port is refused as `nat_alias_conflict`.
                local.count("nat_import_port_in_own_pool");
                local.meta.keep_port.insert(key);
            }
            local.insert(key, alias, m);
            local.stats.imported += 1;
            n += 1;
        }
        Ok(n)
    }

    fn local_stats(&self, local: &Local) -> serde_json::Value {
        let s = &local.stats;
        let mut by_proto = [0u64; 3];
        for m in local.flows.values() {
            by_proto[match m.proto {
                proto::TCP => 0,
                proto::UDP => 1,
                _ => 2,
            }] += 1;
        }
        serde_json::json!({
            "queue": local.meta.queue,
            "packets": local.meta.packets,
            "mappings": local.flows.len(),
            "mappings_tcp": by_proto[0],
            "mappings_udp": by_proto[1],
            "mappings_icmp": by_proto[2],
            "translated_out": s.translated_out,
            "translated_in": s.translated_in,
            "icmp_errors_translated": s.icmp_errors_translated,
            "mappings_created": s.created,
            "mappings_expired": s.expired,
            "mappings_evicted": s.evicted,
            "evictable": local.evictable(),
            "hosts": local.hosts.hosts(),
            "top_hosts": local.hosts.top(5),
            "foreign_port_ended": s.foreign_port_ended,
            "mappings_imported": s.imported,
            "clock_reads": s.clock_reads,
            "sweeps": s.sweeps,
            "dirty": local.dirty.len(),
            "events": s.events,
            "import_conflicts": s.import_conflicts,
            "no_mapping": s.no_mapping,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::*;
    use crate::TcpPhase;
    use pliant_ftmb::{
        spawn_logger, AuditEvent, Feedback, InputLogger, LogBatch, LogTransport, LoggerConfig,
        LoggerHandle, MasterConfig, OutputLogger, PacketId, Released, Snapshot, TransportError,
    };
    use pliant_net::build::{self, tcp_flags, MAC_A, MAC_B};
    use pliant_net::Parsed;
    use std::collections::BTreeSet;
    use std::sync::mpsc;

    mod abuse;

    const W: usize = 2;

    /// Discards the log stream (tests of packet behaviour only).
    struct Null;
    impl LogTransport for Null {
        fn send(&mut self, _: LogBatch) -> Result<(), TransportError> {
            Ok(())
        }
        fn poll_feedback(&mut self) -> Option<Feedback> {
            None
        }
    }

    fn cfg_blocks(lo: u16, hi: u16) -> Config {
        let mut c = Config::with_external_ip(EXT);
        c.port_blocks = vec![(lo, hi)];
        c
    }

    /// Input-log payload: one byte of ingress side, then the frame (what the runtime logs).
    fn input(side: Side, frame: &[u8]) -> Vec<u8> {
        let mut v = vec![u8::from(side == Side::Outside)];
        v.extend_from_slice(frame);
        v
    }

    /// One packet through worker `w` the way the runtime drives it; returns the output frames.
    fn run_one(
        nat: &FtmbNat,
        sh: &Shared,
        w: &mut Worker,
        local: &mut Local,
        id: PacketId,
        inp: &[u8],
    ) -> Vec<Vec<u8>> {
        let side = if inp[0] == 0 {
            Side::Inside
        } else {
            Side::Outside
        };
        let pkt = packet(side, &inp[1..]);
        w.begin(id).unwrap();
        let mut out = Vec::new();
        nat.process(sh, local, w, pkt, &mut out).unwrap();
        let bufs: Vec<Vec<u8>> = out.into_iter().map(|p| p.buf).collect();
        for b in &bufs {
            w.output(b.clone()).unwrap();
        }
        w.end().unwrap();
        bufs
    }

    /// A NAT on a 2-worker master, driven packet by packet from the test thread.
    struct Rig {
        nat: FtmbNat,
        _m: Arc<Master>,
        sh: Shared,
        ws: Vec<Worker>,
        locals: Vec<Local>,
        seq: Vec<u64>,
    }

    impl Rig {
        fn new(cfg: Config) -> Rig {
            let nat = FtmbNat::new(cfg).unwrap();
            let m = Master::new(MasterConfig::new(W)).unwrap();
            let sh = nat.declare(&m, None).unwrap();
            let ws = (0..W)
                .map(|q| m.worker(q as QueueId, Box::new(Null)).unwrap())
                .collect();
            let locals = fresh_locals(&nat);
            Rig {
                nat,
                _m: m,
                sh,
                ws,
                locals,
                seq: vec![0; W],
            }
        }

        fn queue(&self, side: Side, frame: &[u8]) -> usize {
            self.nat.queue_of(&packet(side, frame), W)
        }

        /// Runs `frame` on the worker `queue_of` picks; returns that queue and the output.
        fn inject(&mut self, side: Side, frame: &[u8]) -> (usize, Vec<Vec<u8>>) {
            let q = self.queue(side, frame);
            let id = PacketId {
                queue: q as QueueId,
                seq: self.seq[q],
            };
            self.seq[q] += 1;
            let out = run_one(
                &self.nat,
                &self.sh,
                &mut self.ws[q],
                &mut self.locals[q],
                id,
                &input(side, frame),
            );
            (q, out)
        }

        fn one(&mut self, side: Side, frame: &[u8]) -> (usize, Parsed, Vec<u8>) {
            let (q, mut out) = self.inject(side, frame);
            assert_eq!(out.len(), 1, "expected exactly one output frame");
            let f = out.remove(0);
            (q, check(&f), f)
        }

        fn none(&mut self, side: Side, frame: &[u8]) {
            let (_, out) = self.inject(side, frame);
            assert!(out.is_empty(), "expected a drop");
        }

        fn count(&self, reason: &str) -> u64 {
            self.locals.iter().map(|l| l.count_of(reason)).sum()
        }

        fn in_use(&self, p: u8) -> usize {
            self.sh
                .pools
                .read_quiesced(|x| match p {
                    proto::TCP => x.tcp.in_use(),
                    proto::UDP => x.udp.in_use(),
                    _ => x.icmp.in_use(),
                })
                .unwrap()
        }

        fn counters(&self) -> GlobalCounters {
            self.sh.counters.read_quiesced(|c| *c).unwrap()
        }
    }

    fn tcp_key(sport: u16) -> FlowKey {
        FlowKey::v4(proto::TCP, CLIENT, sport, SERVER, 80).0
    }

    /// Ages every mapping of `local` by `ms` (as if their last packets were that long ago)
    /// and makes its next packet read the clock and sweep.
    fn age(local: &mut Local, ms: u64) {
        let keys: Vec<FlowKey> = local.flows.keys().copied().collect();
        for k in keys {
            local.update(&k, |m| m.last_seen_ms -= ms);
        }
        local.meta.refresh.clear();
        local.refresh_set.clear();
        local.meta.sweep_slot = 0;
        local.meta.clock_read = false;
    }

    /// A UDP source port whose flow `queue_of` pins to `q`, from `from` on.
    fn udp_port_on(r: &Rig, q: usize, from: u16) -> u16 {
        (from..)
            .find(|&p| r.queue(Side::Inside, &udp_out(p)) == q)
            .unwrap()
    }

    #[test]
    fn tcp_translated_both_ways_on_the_owning_queue_with_phases() {
        let mut r = Rig::new(cfg_blocks(30000, 30999));
        let mut queues = BTreeSet::new();
        for sport in 40000..40016u16 {
            let (q, p, _) = r.one(Side::Inside, &tcp_out(sport, tcp_flags::SYN, b""));
            queues.insert(q);
            assert_eq!((p.src, p.dst, p.dport), (v4(EXT), v4(SERVER), 80));
            let ext = p.sport;
            assert!((30000..=30999).contains(&ext));
            assert_eq!(usize::from(ext) % W, q, "the port is in the worker's class");
            let m = r.locals[q].mapping(&tcp_key(sport)).unwrap().clone();
            assert_eq!(
                (m.phase, m.replied, m.external_port),
                (TcpPhase::Opening, false, ext)
            );

            let (q2, p, f) = r.one(
                Side::Outside,
                &tcp_in(ext, tcp_flags::SYN | tcp_flags::ACK, b"hello"),
            );
            assert_eq!(q2, q, "the reply lands on the worker owning the mapping");
            assert_eq!(
                (p.src, p.sport, p.dst, p.dport),
                (v4(SERVER), 80, v4(CLIENT), sport)
            );
            assert_eq!(&f[usize::from(p.payload_off)..], b"hello");

            let (q3, p, _) = r.one(Side::Inside, &tcp_out(sport, tcp_flags::ACK, b"data"));
            assert_eq!((q3, p.sport), (q, ext), "later packets reuse the mapping");
            let m = r.locals[q].mapping(&tcp_key(sport)).unwrap();
            assert_eq!((m.phase, m.replied), (TcpPhase::Established, true));
            r.one(
                Side::Inside,
                &tcp_out(sport, tcp_flags::FIN | tcp_flags::ACK, b""),
            );
            let m = r.locals[q].mapping(&tcp_key(sport)).unwrap();
            assert_eq!(m.phase, TcpPhase::Closing);
        }
        assert_eq!(queues.len(), W, "16 flows spread over both workers");
        assert_eq!(r.counters().mappings_created, 16);
        assert_eq!(r.in_use(proto::TCP), 16);
        assert_eq!(r.locals.iter().map(Local::len).sum::<usize>(), 16);
    }

    #[test]
    fn udp_and_icmp_echo_translated_both_ways() {
        let mut r = Rig::new(cfg_blocks(30000, 30999));
        let (q, p, _) = r.one(Side::Inside, &udp_out(5353));
        assert_eq!((p.src, p.dst, p.dport), (v4(EXT), v4(SERVER), 53));
        let ext = p.sport;
        assert_eq!(usize::from(ext) % W, q);
        let (q2, p, _) = r.one(Side::Outside, &udp_in(ext));
        assert_eq!(q2, q);
        assert_eq!(
            (p.src, p.sport, p.dst, p.dport),
            (v4(SERVER), 53, v4(CLIENT), 5353)
        );

        let req = build::icmp_echo(MAC_A, MAC_B, v4(CLIENT), v4(SERVER), 777, 1, true, b"ping");
        let (q, p, _) = r.one(Side::Inside, &req);
        assert_eq!((p.src, p.dst, p.icmp_type), (v4(EXT), v4(SERVER), 8));
        let id = p.sport;
        assert_ne!(id, 777);
        assert_eq!(usize::from(id) % W, q);
        let reply = build::icmp_echo(MAC_B, MAC_A, v4(SERVER), v4(EXT), id, 1, false, b"ping");
        let (q2, p, _) = r.one(Side::Outside, &reply);
        assert_eq!(q2, q);
        assert_eq!((p.dst, p.sport, p.icmp_type), (v4(CLIENT), 777, 0));
        assert_eq!(r.counters().mappings_created, 2);
        assert_eq!((r.in_use(proto::UDP), r.in_use(proto::ICMP)), (1, 1));
    }

    #[test]
    fn drops_are_counted_by_reason() {
        let mut r = Rig::new(cfg_blocks(30000, 30999));
        r.none(Side::Outside, &udp_in(30001));
        assert_eq!(r.count("nat_no_mapping"), 1);
        let other = build::udp(MAC_B, MAC_A, v4(SERVER), 53, v4(CLIENT), 9, b"x");
        r.none(Side::Outside, &other);
        assert_eq!(r.count("nat_not_external_ip"), 1);
        // An echo reply from inside opens nothing.
        let reply = build::icmp_echo(MAC_A, MAC_B, v4(CLIENT), v4(SERVER), 5, 1, false, b"");
        r.none(Side::Inside, &reply);
        assert_eq!(r.count("nat_no_mapping"), 2);
        let v6 = build::udp(
            MAC_A,
            MAC_B,
            "fd00::1".parse().unwrap(),
            1,
            "fd00::2".parse().unwrap(),
            2,
            b"",
        );
        r.none(Side::Inside, &v6);
        assert_eq!(r.count("nat_ipv6_unsupported"), 1);
        let gre = build::raw_ip(MAC_A, MAC_B, v4(CLIENT), v4(SERVER), 47, &[0; 8]);
        r.none(Side::Inside, &gre);
        assert_eq!(r.count("nat_unsupported_proto"), 1);
        // The inside host spoofing the remote end of an existing mapping.
        r.one(Side::Inside, &tcp_out(40000, tcp_flags::SYN, b""));
        let spoof = build::tcp(
            MAC_A,
            MAC_B,
            v4(SERVER),
            80,
            v4(CLIENT),
            40000,
            tcp_flags::ACK,
            1,
            0,
            b"",
        );
        r.none(Side::Inside, &spoof);
        assert_eq!(r.count("nat_direction_mismatch"), 1);
        assert_eq!(
            r.counters().mappings_created,
            1,
            "no drop created a mapping"
        );
    }

    #[test]
    fn icmp_error_quote_is_translated_on_the_owning_queue() {
        let mut r = Rig::new(cfg_blocks(30000, 30999));
        let f = udp_out(5353);
        let (q, p, sent) = r.one(Side::Inside, &f);
        let ext = p.sport;
        let router = Ipv4Addr::new(10, 77, 2, 254);
        let err = port_unreachable(Side::Outside, router, EXT, &sent[14..]);
        assert_eq!(r.queue(Side::Outside, &err), q);
        let (_, p, out) = r.one(Side::Outside, &err);
        assert_eq!((p.src, p.dst, p.icmp_type), (v4(router), v4(CLIENT), 3));
        // The quote now shows the client's own datagram, byte for byte.
        assert_eq!(&out[usize::from(p.l4_off) + 8..], &f[14..]);
        assert_eq!(r.locals[q].stats.icmp_errors_translated, 1);
        // An error about a port we never handed out is dropped.
        let mut stray = sent[14..].to_vec();
        stray[20..22].copy_from_slice(&(ext ^ 2).to_be_bytes());
        let err = port_unreachable(Side::Outside, router, EXT, &stray);
        r.none(Side::Outside, &err);
        assert_eq!(r.count("nat_no_mapping"), 1);

        // The inside host reports an error about a reply it got: the quote and the outer
        // source must show the external endpoint, not the inside address.
        let reply = r.one(Side::Outside, &udp_in(ext)).2;
        let err = port_unreachable(Side::Inside, CLIENT, SERVER, &reply[14..]);
        assert_eq!(r.queue(Side::Inside, &err), q);
        let (_, p, out) = r.one(Side::Inside, &err);
        assert_eq!((p.src, p.dst), (v4(EXT), v4(SERVER)));
        let quoted = &out[usize::from(p.l4_off) + 8..];
        assert_eq!(&quoted[16..20], &EXT.octets(), "quoted destination address");
        assert_eq!(
            &quoted[22..24],
            &ext.to_be_bytes(),
            "quoted destination port"
        );
        assert_eq!(r.locals[q].stats.icmp_errors_translated, 2);
    }

    #[test]
    fn two_workers_contending_on_the_pool_never_share_a_port() {
        // 1000 ports: 500 per class; each worker opens 500 flows at the same time, then one
        // more, which finds its class exhausted and takes the port of its oldest unanswered
        // mapping (evicted).
        let r = Rig::new(cfg_blocks(30000, 30999));
        let per = 500usize;
        let flows: Vec<Vec<Vec<u8>>> = (0..W)
            .map(|q| {
                let mut v = Vec::new();
                let mut p = 1024u16;
                while v.len() < per + 1 {
                    p = udp_port_on(&r, q, p + 1);
                    v.push(input(Side::Inside, &udp_out(p)));
                }
                v
            })
            .collect();
        let Rig {
            nat,
            sh,
            mut ws,
            mut locals,
            ..
        } = r;
        let ports: Vec<Vec<u16>> = std::thread::scope(|s| {
            let hs: Vec<_> = ws
                .iter_mut()
                .zip(locals.iter_mut())
                .zip(flows.iter())
                .map(|((w, l), inputs)| {
                    let (nat, sh) = (&nat, &sh);
                    s.spawn(move || {
                        let q = w.queue();
                        let mut got = Vec::new();
                        for (i, inp) in inputs.iter().enumerate() {
                            let id = PacketId {
                                queue: q,
                                seq: i as u64,
                            };
                            for f in run_one(nat, sh, w, l, id, inp) {
                                got.push(check(&f).sport);
                            }
                        }
                        got
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let mut all = HashSet::new();
        for (q, got) in ports.iter().enumerate() {
            assert_eq!(got.len(), per + 1, "queue {q}: every flow got a port");
            for &p in &got[..per] {
                assert_eq!(usize::from(p) % W, q);
                assert!(all.insert(p), "port {p} handed out twice");
            }
            assert!(got[..per].contains(&got[per]), "an evicted mapping's port");
            assert_eq!(locals[q].count_of("nat_port_exhausted"), 0);
            assert_eq!(locals[q].count_of("nat_evicted_embryonic"), 1);
            assert_eq!(locals[q].len(), per);
        }
        let (used, exhausted) = sh
            .pools
            .read_quiesced(|p| (p.udp.in_use(), p.udp.exhausted))
            .unwrap();
        assert_eq!((used, exhausted), (2 * per, 0));
        assert_eq!(
            sh.counters.read_quiesced(|c| c.mappings_created).unwrap(),
            2 * per as u64 + 2
        );
        // One pool access and one counter access per mapping.
        assert_eq!(sh.pools.accesses().unwrap(), 2 * per as u64 + 2);
        assert_pools_match_mappings(&nat, &sh, &locals);
    }

    fn decode_delta(d: &[FlowDelta]) -> Vec<(Option<FlowKey>, Option<Mapping>)> {
        d.iter()
            .map(|(k, r)| {
                if k.is_empty() {
                    (None, None)
                } else {
                    (
                        Some(postcard::from_bytes(k).unwrap()),
                        r.as_ref().map(|r| postcard::from_bytes(r).unwrap()),
                    )
                }
            })
            .collect()
    }

    #[test]
    fn deltas_report_created_changed_and_deleted_records() {
        let mut r = Rig::new(cfg_blocks(30000, 30999));
        let a = udp_port_on(&r, 0, 2000);
        let b = udp_port_on(&r, 0, a + 1);
        let ext_a = r.one(Side::Inside, &udp_out(a)).1.sport;
        let ext_b = r.one(Side::Inside, &udp_out(b)).1.sport;
        let ka = FlowKey::v4(proto::UDP, CLIENT, a, SERVER, 53).0;
        let kb = FlowKey::v4(proto::UDP, CLIENT, b, SERVER, 53).0;
        let d = r.nat.take_delta(&mut r.locals[0], false);
        assert_eq!(d[0].0, WORKER_RECORD_KEY, "the worker record sorts first");
        let meta: WorkerMeta = postcard::from_bytes(d[0].1.as_ref().unwrap()).unwrap();
        assert_eq!(meta, r.locals[0].meta);
        let mut got = decode_delta(&d[1..]);
        got.sort_by_key(|x| x.0);
        let mut want = vec![
            (Some(ka), r.locals[0].mapping(&ka).cloned()),
            (Some(kb), r.locals[0].mapping(&kb).cloned()),
        ];
        want.sort_by_key(|x| x.0);
        assert_eq!(got, want);
        assert!(want.iter().all(|w| w.1.is_some()));
        // Nothing changed since: only the worker record.
        assert_eq!(r.nat.take_delta(&mut r.locals[0], false).len(), 1);
        // A reply changes A (replied); B's next packet stamps the same clock value: no change.
        r.one(Side::Outside, &udp_in(ext_a));
        r.one(Side::Inside, &udp_out(b));
        let d = r.nat.take_delta(&mut r.locals[0], false);
        assert_eq!(
            decode_delta(&d[1..]),
            vec![(Some(ka), r.locals[0].mapping(&ka).cloned())]
        );
        assert!(r.locals[0].mapping(&ka).unwrap().replied);
        // A idles out: deleted.
        r.locals[0].flows.get_mut(&ka).unwrap().last_seen_ms -= 31_000;
        r.locals[0].meta.refresh.retain(|k| *k != ka);
        r.locals[0].refresh_set.remove(&ka);
        r.locals[0].meta.sweep_slot = 0;
        r.locals[0].meta.clock_read = false;
        r.one(Side::Inside, &udp_out(b));
        let d = r.nat.take_delta(&mut r.locals[0], false);
        let got = decode_delta(&d[1..]);
        assert!(got.contains(&(Some(ka), None)), "{got:?}");
        // Full: every live record and the worker record; the tracking starts afresh.
        r.none(Side::Outside, &udp_in(ext_a));
        r.one(Side::Outside, &udp_in(ext_b));
        let d = r.nat.take_delta(&mut r.locals[0], true);
        assert_eq!(
            decode_delta(&d[1..]),
            vec![(Some(kb), r.locals[0].mapping(&kb).cloned())]
        );
        assert_eq!(r.nat.take_delta(&mut r.locals[0], false).len(), 1);
        // C is created and expires between two deltas: the logger never hears of it.
        let c = udp_port_on(&r, 0, b + 1);
        r.one(Side::Inside, &udp_out(c));
        let kc = FlowKey::v4(proto::UDP, CLIENT, c, SERVER, 53).0;
        r.locals[0].flows.get_mut(&kc).unwrap().last_seen_ms -= 31_000;
        r.locals[0].meta.refresh.retain(|k| *k != kc);
        r.locals[0].refresh_set.remove(&kc);
        r.locals[0].meta.sweep_slot = 0;
        r.locals[0].meta.clock_read = false;
        r.one(Side::Inside, &udp_out(b));
        assert!(r.locals[0].mapping(&kc).is_none(), "C expired");
        let d = r.nat.take_delta(&mut r.locals[0], false);
        assert!(
            decode_delta(&d[1..]).iter().all(|(k, _)| *k != Some(kc)),
            "a record the logger never had is not deleted"
        );
        let d = r.nat.take_delta(&mut r.locals[0], true);
        // A snapshot's records rebuild an identical worker.
        let recs: Vec<FlowRecord> = d.into_iter().map(|(k, v)| (k, v.unwrap())).collect();
        let l2 = r.nat.new_local(0, &recs).unwrap();
        assert_eq!(l2.flows, r.locals[0].flows);
        assert_eq!(l2.by_outside, r.locals[0].by_outside);
        assert_eq!(l2.meta, r.locals[0].meta);
        assert!(
            r.nat.new_local(1, &recs).is_err(),
            "worker record of queue 0"
        );
    }

    #[test]
    fn idle_expiry_releases_the_port_and_honours_tcp_phases() {
        let mut r = Rig::new(cfg_blocks(30000, 30999));
        let a = udp_port_on(&r, 1, 3000);
        let ext_a = r.one(Side::Inside, &udp_out(a)).1.sport;
        assert_eq!(r.in_use(proto::UDP), 1);
        age(&mut r.locals[1], 29_000);
        let b = udp_port_on(&r, 1, a + 1);
        r.one(Side::Inside, &udp_out(b));
        assert_eq!(
            r.locals[1].len(),
            2,
            "29 s idle is within the 30 s UDP timeout"
        );
        age(&mut r.locals[1], 2_000);
        let c = udp_port_on(&r, 1, b + 1);
        r.one(Side::Inside, &udp_out(c));
        // A idled 31 s, B 2 s; C is new.
        assert_eq!(r.locals[1].len(), 2);
        let ka = FlowKey::v4(proto::UDP, CLIENT, a, SERVER, 53).0;
        let kc = FlowKey::v4(proto::UDP, CLIENT, c, SERVER, 53).0;
        assert!(r.locals[1].mapping(&ka).is_none(), "A expired");
        assert_eq!(
            r.in_use(proto::UDP),
            2,
            "the expired port went back to the pool"
        );
        assert_eq!(r.counters().mappings_expired, 1);
        // C's port is drawn from a random start in the worker's class (a logged random value,
        // seeded from the clock), so about once in the class's size it is A's old port: then
        // the port is C's alone. Otherwise an answer to A's old port finds no mapping.
        if r.locals[1].mapping(&kc).map(|m| m.external_port) == Some(ext_a) {
            assert_eq!(
                r.locals[1]
                    .flows
                    .values()
                    .filter(|m| m.external_port == ext_a)
                    .count(),
                1
            );
        } else {
            assert!(r.locals[1].flows.values().all(|m| m.external_port != ext_a));
            r.none(Side::Outside, &udp_in(ext_a));
            assert_eq!(r.count("nat_no_mapping"), 1);
        }

        // A slow flow on a quiet worker: its packet is handled with a clock value read long
        // ago (simulated: the cached value and every stamp 40 s back). The next read
        // re-stamps it before sweeping, so it survives while B and C, silent since, expire.
        let d = udp_port_on(&r, 1, c + 1);
        r.one(Side::Inside, &udp_out(d));
        let kd = FlowKey::v4(proto::UDP, CLIENT, d, SERVER, 53).0;
        for m in r.locals[1].flows.values_mut() {
            m.last_seen_ms -= 40_000;
        }
        r.locals[1].meta.now_ms -= 40_000;
        r.one(Side::Inside, &udp_out(d));
        assert_eq!(
            r.locals[1].mapping(&kd).unwrap().last_seen_ms,
            r.locals[1].meta.now_ms,
            "stamped with the cached value"
        );
        assert_eq!(r.locals[1].meta.refresh, vec![kd]);
        r.locals[1].meta.sweep_slot = 0;
        let e = udp_port_on(&r, 1, d + 1);
        r.one(Side::Inside, &udp_out(e)); // a new mapping reads the clock
        assert!(r.locals[1].meta.refresh.is_empty());
        assert!(
            r.locals[1].mapping(&kd).is_some(),
            "the active flow was kept"
        );
        assert_eq!(r.locals[1].len(), 2, "B and C expired, D and E live");
        assert_eq!(r.counters().mappings_expired, 3);

        // TCP: the closing timeout (10 s) is shorter than the established one.
        let mut est = None;
        let mut closing = None;
        for sport in 41000.. {
            if r.queue(Side::Inside, &tcp_out(sport, tcp_flags::SYN, b"")) != 0 {
                continue;
            }
            if est.is_none() {
                est = Some(sport);
            } else {
                closing = Some(sport);
                break;
            }
        }
        let (est, closing) = (est.unwrap(), closing.unwrap());
        for (sport, last) in [
            (est, tcp_flags::ACK),
            (closing, tcp_flags::FIN | tcp_flags::ACK),
        ] {
            let ext = r
                .one(Side::Inside, &tcp_out(sport, tcp_flags::SYN, b""))
                .1
                .sport;
            r.one(
                Side::Outside,
                &tcp_in(ext, tcp_flags::SYN | tcp_flags::ACK, b""),
            );
            r.one(Side::Inside, &tcp_out(sport, last, b""));
        }
        assert_eq!(r.in_use(proto::TCP), 2);
        age(&mut r.locals[0], 11_000);
        r.one(Side::Inside, &tcp_out(est, tcp_flags::ACK, b"x"));
        assert!(r.locals[0].mapping(&tcp_key(est)).is_some());
        assert!(r.locals[0].mapping(&tcp_key(closing)).is_none());
        assert_eq!(r.in_use(proto::TCP), 1);
        assert_eq!(r.counters().mappings_expired, 4);
    }

    /// The live records (not the worker record) of every worker of `r`.
    fn live_records(r: &mut Rig) -> Vec<FlowRecord> {
        let mut v = Vec::new();
        for l in r.locals.iter_mut() {
            for (k, rec) in r.nat.take_delta(l, true) {
                if !k.is_empty() {
                    v.push((k, rec.unwrap()));
                }
            }
        }
        v
    }

    #[test]
    fn imported_records_translate_both_ways_and_steer() {
        let mut a = Rig::new(cfg_blocks(30000, 30999));
        let ext_t = a
            .one(Side::Inside, &tcp_out(40000, tcp_flags::SYN, b""))
            .1
            .sport;
        a.one(
            Side::Outside,
            &tcp_in(ext_t, tcp_flags::SYN | tcp_flags::ACK, b""),
        );
        a.one(Side::Inside, &tcp_out(40000, tcp_flags::ACK, b""));
        let ext_u = a.one(Side::Inside, &udp_out(5353)).1.sport;
        let req = build::icmp_echo(MAC_A, MAC_B, v4(CLIENT), v4(SERVER), 99, 1, true, b"");
        let ext_i = a.one(Side::Inside, &req).1.sport;
        let recs = live_records(&mut a);
        assert_eq!(recs.len(), 3);

        let mut b = Rig::new(cfg_blocks(40000, 40999));
        for rec in &recs {
            let q = b.nat.record_queue(rec, W).unwrap();
            let (inside, aliases) = b.nat.steering_keys(rec).unwrap();
            let m: Mapping = postcard::from_bytes(&rec.1).unwrap();
            assert_eq!(inside, m.inside_key());
            assert_eq!(aliases, vec![m.outside_key(EXT)]);
            assert_eq!(
                usize::from(m.external_port) % W,
                q,
                "same pinning as the primary"
            );
            assert_eq!(b.nat.import(&mut b.locals[q], vec![rec.clone()]), Ok(1));
        }
        // Importing again conflicts; the worker record and garbage are skipped.
        let q = b.nat.record_queue(&recs[0], W).unwrap();
        assert_eq!(b.nat.import(&mut b.locals[q], vec![recs[0].clone()]), Ok(0));
        assert_eq!(b.count("nat_import_conflict"), 1);
        let wr = WorkerMeta {
            queue: 1,
            ..WorkerMeta::default()
        };
        let meta = (
            WORKER_RECORD_KEY.to_vec(),
            postcard::to_allocvec(&wr).unwrap(),
        );
        assert_eq!(b.nat.steering_keys(&meta), None);
        assert_eq!(b.nat.record_queue(&meta, W), Some(1));
        let garbage = (vec![1u8, 2, 3], vec![9u8; 3]);
        assert_eq!(b.nat.import(&mut b.locals[0], vec![meta, garbage]), Ok(0));
        assert_eq!(b.count("nat_import_worker_record_skipped"), 1);
        assert_eq!(b.count("nat_import_bad_record"), 1);

        // Both directions of every imported flow, on the queue the record named.
        let (q, p, _) = b.one(Side::Outside, &tcp_in(ext_t, tcp_flags::ACK, b"more"));
        assert_eq!(
            q,
            b.nat.record_queue(&recs_for(&recs, proto::TCP), W).unwrap()
        );
        assert_eq!((p.dst, p.dport), (v4(CLIENT), 40000));
        let (q2, p, _) = b.one(Side::Inside, &tcp_out(40000, tcp_flags::ACK, b"ok"));
        assert_eq!((q2, p.src, p.sport), (q, v4(EXT), ext_t));
        let p = b.one(Side::Outside, &udp_in(ext_u)).1;
        assert_eq!((p.dst, p.dport), (v4(CLIENT), 5353));
        let reply = build::icmp_echo(MAC_B, MAC_A, v4(SERVER), v4(EXT), ext_i, 1, false, b"");
        assert_eq!(b.one(Side::Outside, &reply).1.sport, 99);
        assert_eq!(b.counters().mappings_created, 0, "imports allocate nothing");

        // Imported expiry releases nothing into b's pool (the port is foreign).
        let on_q = b.locals[q].len() as u64;
        age(&mut b.locals[q], 8_000_000);
        b.one(Side::Inside, &udp_out(udp_port_on(&b, q, 6000)));
        assert_eq!(b.locals[q].stats.foreign_port_ended, on_q);
        assert_eq!(b.locals[q].len(), 1, "only the new flow is left");
        let foreign =
            b.sh.pools
                .read_quiesced(|p| {
                    p.tcp.foreign_release + p.udp.foreign_release + p.icmp.foreign_release
                })
                .unwrap();
        assert_eq!(foreign, on_q);
        assert_eq!(b.counters().mappings_expired, on_q);

        // A NAT whose own pool holds the records' ports (replicas sharing one range) takes
        // them, but their expiry does not release ports its pool never allocated to them.
        let mut c = Rig::new(cfg_blocks(30000, 30999));
        c.one(Side::Inside, &udp_out(7777));
        for rec in &recs {
            let q = c.nat.record_queue(rec, W).unwrap();
            assert_eq!(c.nat.import(&mut c.locals[q], vec![rec.clone()]), Ok(1));
        }
        assert_eq!(c.count("nat_import_port_in_own_pool"), 3);
        for q in 0..W {
            age(&mut c.locals[q], 8_000_000);
        }
        for q in 0..W {
            c.one(Side::Inside, &udp_out(udp_port_on(&c, q, 8000)));
        }
        assert_eq!(c.count("nat_import_own_port_ended"), 3);
        assert_eq!(
            c.counters().mappings_expired,
            4,
            "3 imported + our own aged one"
        );
        let (used, bad) =
            c.sh.pools
                .read_quiesced(|p| {
                    (
                        p.tcp.in_use() + p.udp.in_use() + p.icmp.in_use(),
                        p.tcp.bad_release + p.udp.bad_release + p.icmp.bad_release,
                    )
                })
                .unwrap();
        assert_eq!((used, bad), (2, 0), "only the two new flows hold ports");
    }

    fn recs_for(recs: &[FlowRecord], p: u8) -> FlowRecord {
        recs.iter()
            .find(|r| postcard::from_bytes::<Mapping>(&r.1).unwrap().proto == p)
            .unwrap()
            .clone()
    }

    type QueueOutputs = Vec<(PacketId, Vec<Vec<u8>>)>;

    /// Runs each queue's logged input from `from[q]` on its own thread.
    fn run_threads(
        nat: &FtmbNat,
        sh: &Shared,
        ws: &mut [Worker],
        locals: &mut [Local],
        il: &InputLogger,
        from: &[u64],
    ) -> Vec<QueueOutputs> {
        let inputs: Vec<Vec<(PacketId, Vec<u8>)>> = (0..W)
            .map(|q| {
                il.read_from(q as QueueId, from[q])
                    .unwrap()
                    .map(|(id, p)| (id, p.to_vec()))
                    .collect()
            })
            .collect();
        std::thread::scope(|s| {
            let hs: Vec<_> = ws
                .iter_mut()
                .zip(locals.iter_mut())
                .zip(inputs.iter())
                .map(|((w, l), inp)| {
                    s.spawn(move || {
                        let out: QueueOutputs = inp
                            .iter()
                            .map(|(id, p)| (*id, run_one(nat, sh, w, l, *id, p)))
                            .collect();
                        assert!(!w.replaying(), "input ran out before the replay schedule");
                        w.flush().unwrap();
                        out
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// Every worker's state without mappings.
    fn fresh_locals(nat: &FtmbNat) -> Vec<Local> {
        (0..W)
            .map(|q| nat.new_local(q as QueueId, &[]).unwrap())
            .collect()
    }

    /// An output logger thread that keeps an audit trail, and what it releases.
    fn audited_logger() -> (LoggerHandle, mpsc::Receiver<Released>) {
        let (sink, released_rx) = mpsc::channel::<Released>();
        let mut lcfg = LoggerConfig::new(W);
        lcfg.audit_capacity = 1 << 16;
        let logger = spawn_logger(OutputLogger::new(lcfg).unwrap(), 64, sink).unwrap();
        (logger, released_rx)
    }

    /// The workers of `m`, each logging to `logger`.
    fn logged_workers(m: &Arc<Master>, logger: &LoggerHandle) -> Vec<Worker> {
        (0..W)
            .map(|q| {
                let t = logger.transport(q as QueueId).unwrap();
                m.worker(q as QueueId, Box::new(t)).unwrap()
            })
            .collect()
    }

    /// Every worker's full record set (what a snapshot holds).
    fn full_records(nat: &FtmbNat, locals: &mut [Local]) -> Vec<Vec<FlowRecord>> {
        locals
            .iter_mut()
            .map(|l| {
                nat.take_delta(l, true)
                    .into_iter()
                    .map(|(k, v)| (k, v.unwrap()))
                    .collect()
            })
            .collect()
    }

    /// The standby once the primary died: the master recovered from `snap` and the logger's
    /// logs, the NAT declared from the snapshot's image, the workers' state from `recs`.
    struct Standby {
        _m: Arc<Master>,
        nat: FtmbNat,
        sh: Shared,
        ws: Vec<Worker>,
        locals: Vec<Local>,
    }

    fn recover(
        logger: &LoggerHandle,
        snap: &Snapshot,
        cfg: Config,
        recs: &[Vec<FlowRecord>],
    ) -> Standby {
        let (ps, va) = (snap.pal_seq.clone(), snap.var_accesses.clone());
        let rec = logger.with(move |l| l.recover(&ps, &va)).unwrap().unwrap();
        let m = Master::recovering(MasterConfig::new(W), snap, rec).unwrap();
        let nat = FtmbNat::new(cfg).unwrap();
        let sh = nat.declare(&m, Some(&snap.nf_state)).unwrap();
        let ws = logged_workers(&m, logger);
        let locals = (0..W)
            .map(|q| nat.new_local(q as QueueId, &recs[q]).unwrap())
            .collect();
        Standby {
            _m: m,
            nat,
            sh,
            ws,
            locals,
        }
    }

    /// What the logger released so far, by output.
    fn released_so_far(rx: &mpsc::Receiver<Released>) -> HashMap<pliant_ftmb::OutputId, Vec<u8>> {
        rx.try_iter().map(|r| (r.id, r.payload)).collect()
    }

    /// A deterministic xorshift64 sequence (reproducible test inputs without a dependency).
    fn xorshift(seed: u64) -> impl FnMut() -> u64 {
        let mut x = seed;
        move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        }
    }

    fn append(il: &mut InputLogger, nat: &FtmbNat, side: Side, frame: &[u8]) {
        let q = nat.queue_of(&packet(side, frame), W);
        il.append(q as QueueId, input(side, frame)).unwrap();
    }

    #[test]
    fn replay_from_a_snapshot_reproduces_outputs_and_mappings() {
        let cfg = cfg_blocks(30000, 30099); // 50 ports per worker: reuse after expiry
        let (logger, released_rx) = audited_logger();
        let nat = FtmbNat::new(cfg.clone()).unwrap();
        let (m, sh, mut ws, mut locals, mut il) = logged_primary(&nat, &logger);

        // Phase A, before the snapshot: 30 flows of each protocol, replies to the TCP ones.
        for i in 0..30u16 {
            append(
                &mut il,
                &nat,
                Side::Inside,
                &tcp_out(42000 + i, tcp_flags::SYN, b""),
            );
            append(&mut il, &nat, Side::Inside, &udp_out(43000 + i));
            let req = build::icmp_echo(MAC_A, MAC_B, v4(CLIENT), v4(SERVER), 100 + i, 1, true, b"");
            append(&mut il, &nat, Side::Inside, &req);
        }
        let a = run_threads(&nat, &sh, &mut ws, &mut locals, &il, &[0, 0]);
        assert_eq!(a.iter().flatten().filter(|(_, o)| o.len() == 1).count(), 90);
        // Which inside port each TCP external port belongs to (from the mappings).
        let mut tcp_ext: Vec<(u16, u16)> = locals
            .iter()
            .flat_map(|l| l.mappings())
            .filter(|m| m.proto == proto::TCP)
            .map(|m| (m.inside_port, m.external_port))
            .collect();
        tcp_ext.sort_unstable();
        assert_eq!(tcp_ext.len(), 30);
        // The UDP and ICMP mappings idle out right after the snapshot (TCP is still opening:
        // 60 s), so phase B frees and reuses ports.
        for l in locals.iter_mut() {
            for mm in l.flows.values_mut() {
                if mm.proto != proto::TCP {
                    mm.last_seen_ms -= 45_000;
                }
            }
            l.meta.sweep_slot = 0;
            l.meta.clock_read = false;
        }

        // Snapshot at this quiescent point.
        let (snap, recs) = snapshot_now(&nat, &sh, &m, &mut locals, &logger, &mut il);

        // Phase B, after it: both directions of the TCP flows, 60 new UDP flows (they need the
        // expired ports: 50 per worker), replies to some of them by guessed port.
        for (i, &(sport, ext)) in tcp_ext.iter().enumerate() {
            append(
                &mut il,
                &nat,
                Side::Outside,
                &tcp_in(ext, tcp_flags::SYN | tcp_flags::ACK, b"s"),
            );
            append(
                &mut il,
                &nat,
                Side::Inside,
                &tcp_out(sport, tcp_flags::ACK, b"a"),
            );
            if i % 3 == 0 {
                append(
                    &mut il,
                    &nat,
                    Side::Inside,
                    &tcp_out(sport, tcp_flags::FIN, b""),
                );
            }
        }
        for i in 0..60u16 {
            append(&mut il, &nat, Side::Inside, &udp_out(44000 + i));
            append(&mut il, &nat, Side::Outside, &udp_in(30000 + i));
        }
        let b = run_threads(&nat, &sh, &mut ws, &mut locals, &il, &snap.input_next);
        logger.with(|_| ()).unwrap();
        let released = released_so_far(&released_rx);
        let b_outputs: usize = b.iter().flatten().map(|(_, o)| o.len()).sum();
        assert!(b_outputs > 120, "phase B produced {b_outputs} outputs");
        let expired = sh.counters.read_quiesced(|c| c.mappings_expired).unwrap();
        assert_eq!(expired, 60, "the UDP and ICMP mappings of phase A expired");
        let translated_in: u64 = locals.iter().map(|l| l.stats.translated_in).sum();
        assert!(translated_in > 30, "some guessed replies hit new mappings");
        drop(ws);

        // The primary dies; the standby recovers from the snapshot and the logs.
        let primary = (b, &nat, &sh, locals.as_mut_slice());
        let sb = replay_and_compare(&logger, &snap, cfg, &recs, &il, primary);
        // The output logger recognised every replayed packet as released: none goes twice.
        drop(sb.ws);
        let mut l = logger.join().unwrap();
        assert!(
            released_rx.try_iter().next().is_none(),
            "a replayed output was released"
        );
        assert_eq!(l.stats.outputs_suppressed as usize, b_outputs);
        for e in l.drain_audit() {
            if let AuditEvent::Suppressed { id, payload } = e {
                assert_eq!(released.get(&id), Some(&payload), "{id:?} differs");
            }
        }
        assert_eq!(l.stats.audit_violations, 0);
    }

    /// A fresh primary of `nat` logging to `logger`: master, shared state, workers, their
    /// state, and an input logger.
    fn logged_primary(
        nat: &FtmbNat,
        logger: &LoggerHandle,
    ) -> (Arc<Master>, Shared, Vec<Worker>, Vec<Local>, InputLogger) {
        let m = Master::new(MasterConfig::new(W)).unwrap();
        let sh = nat.declare(&m, None).unwrap();
        let ws = logged_workers(&m, logger);
        let locals = fresh_locals(nat);
        (m, sh, ws, locals, InputLogger::new(W, 1 << 16))
    }

    /// A snapshot of a quiescent primary (the logs truncated to it) and its workers' full
    /// records.
    fn snapshot_now(
        nat: &FtmbNat,
        sh: &Shared,
        m: &Master,
        locals: &mut [Local],
        logger: &LoggerHandle,
        il: &mut InputLogger,
    ) -> (Snapshot, Vec<Vec<FlowRecord>>) {
        let recs = full_records(nat, locals);
        let input_next: Vec<u64> = (0..W).map(|q| il.next_seq(q as QueueId).unwrap()).collect();
        let snap = m
            .snapshot(nat.save_shared(sh).unwrap(), input_next)
            .unwrap();
        let ps = snap.pal_seq.clone();
        logger.with(move |l| l.truncate(&ps)).unwrap();
        il.truncate(&snap.input_next);
        (snap, recs)
    }

    /// A primary's run after a snapshot: its outputs, NF, shared state and workers' state.
    type Primary<'a> = (Vec<QueueOutputs>, &'a FtmbNat, &'a Shared, &'a mut [Local]);

    /// The standby recovered from `snap` (see [`recover`]) re-runs the input logged after it;
    /// its outputs, shared image and full records must equal the primary's, and its pools
    /// its mappings. Returns the standby.
    fn replay_and_compare(
        logger: &LoggerHandle,
        snap: &Snapshot,
        cfg: Config,
        recs: &[Vec<FlowRecord>],
        il: &InputLogger,
        primary: Primary<'_>,
    ) -> Standby {
        let (b, nat, sh, locals) = primary;
        let image = nat.save_shared(sh).unwrap();
        let final_recs: Vec<Vec<FlowDelta>> =
            locals.iter_mut().map(|l| nat.take_delta(l, true)).collect();
        let mut sb = recover(logger, snap, cfg, recs);
        let from = &snap.input_next;
        let b2 = run_threads(&sb.nat, &sb.sh, &mut sb.ws, &mut sb.locals, il, from);
        assert_eq!(b2, b, "replayed output differs");
        let image2 = sb.nat.save_shared(&sb.sh).unwrap();
        assert_eq!(image2, image, "shared state differs");
        let final2: Vec<Vec<FlowDelta>> = sb
            .locals
            .iter_mut()
            .map(|l| sb.nat.take_delta(l, true))
            .collect();
        assert_eq!(final2, final_recs, "mappings differ");
        assert_pools_match_mappings(&sb.nat, &sb.sh, &sb.locals);
        sb
    }

    /// The pools hold exactly the ports of the live mappings allocated from them: no port
    /// leaked, none used by two mappings.
    fn assert_pools_match_mappings(nat: &FtmbNat, sh: &Shared, locals: &[Local]) {
        let mut want: [BTreeSet<u16>; 3] = Default::default();
        for l in locals {
            for (k, m) in &l.flows {
                if l.meta.keep_port.contains(k) || !nat.owns_port(m.external_port) {
                    continue;
                }
                let i = match m.proto {
                    proto::TCP => 0,
                    proto::UDP => 1,
                    _ => 2,
                };
                assert!(
                    want[i].insert(m.external_port),
                    "port {} of protocol {} held by two mappings",
                    m.external_port,
                    m.proto
                );
            }
        }
        let have: [BTreeSet<u16>; 3] = sh
            .pools
            .read_quiesced(|p| {
                [
                    p.tcp.in_use_ports().collect(),
                    p.udp.in_use_ports().collect(),
                    p.icmp.in_use_ports().collect(),
                ]
            })
            .unwrap();
        assert_eq!(have, want, "pools and mappings disagree");
    }

    /// Forwards at most `budget` more messages: the rest of the queue's stream is lost with
    /// the dying primary.
    struct CutTransport {
        inner: pliant_ftmb::ChannelTransport,
        budget: Arc<std::sync::atomic::AtomicU64>,
    }

    impl LogTransport for CutTransport {
        fn send(&mut self, mut batch: LogBatch) -> Result<(), TransportError> {
            use std::sync::atomic::Ordering::Relaxed;
            let left = self.budget.load(Relaxed);
            let n = (batch.msgs.len() as u64).min(left);
            self.budget.store(left - n, Relaxed);
            batch.msgs.truncate(n as usize);
            if batch.msgs.is_empty() {
                return Ok(());
            }
            self.inner.send(batch)
        }
        fn poll_feedback(&mut self) -> Option<Feedback> {
            self.inner.poll_feedback()
        }
    }

    /// The primary dies with each queue's log stream cut at a random point: the standby
    /// replays the logged prefix, then goes live on the rest of the input. Every output
    /// released before the failure is regenerated byte for byte (and suppressed), nothing is
    /// released twice or lost, and the pools stay consistent with the mappings.
    #[test]
    fn recovery_from_a_cut_log_keeps_released_output() {
        let mut next = xorshift(0x2545_F491_4F6C_DD1D);
        let mut suppressed_total = 0;
        for _seed in 0..6 {
            let cfg = cfg_blocks(30000, 30199);
            let (logger, released_rx) = audited_logger();
            let nat = FtmbNat::new(cfg.clone()).unwrap();
            let m = Master::new(MasterConfig::new(W)).unwrap();
            let sh = nat.declare(&m, None).unwrap();
            let budgets: Vec<Arc<std::sync::atomic::AtomicU64>> = (0..W)
                .map(|_| Arc::new(std::sync::atomic::AtomicU64::new(u64::MAX)))
                .collect();
            let mut ws: Vec<Worker> = (0..W)
                .map(|q| {
                    let t = CutTransport {
                        inner: logger.transport(q as QueueId).unwrap(),
                        budget: Arc::clone(&budgets[q]),
                    };
                    m.worker(q as QueueId, Box::new(t)).unwrap()
                })
                .collect();
            let mut locals = fresh_locals(&nat);
            let snap = m
                .snapshot(nat.save_shared(&sh).unwrap(), vec![0; W])
                .unwrap();
            let recs = full_records(&nat, &mut locals);
            let mut il = InputLogger::new(W, 1 << 16);
            let base = 20000 + (next() % 20000) as u16;
            for i in 0..40u16 {
                append(
                    &mut il,
                    &nat,
                    Side::Inside,
                    &tcp_out(base + i, tcp_flags::SYN, b""),
                );
                append(&mut il, &nat, Side::Inside, &udp_out(base + i));
                append(
                    &mut il,
                    &nat,
                    Side::Outside,
                    &udp_in(30000 + (next() % 200) as u16),
                );
                append(
                    &mut il,
                    &nat,
                    Side::Outside,
                    &tcp_in(30000 + (next() % 200) as u16, tcp_flags::ACK, b""),
                );
                append(
                    &mut il,
                    &nat,
                    Side::Inside,
                    &udp_out(base + (next() % 40) as u16),
                );
            }
            for b in &budgets {
                b.store(next() % 300, std::sync::atomic::Ordering::Relaxed);
            }
            let first = run_threads(&nat, &sh, &mut ws, &mut locals, &il, &[0, 0]);
            logger.with(|_| ()).unwrap();
            drop(ws);
            let released1 = released_so_far(&released_rx);
            assert!(first.iter().flatten().any(|(_, o)| !o.is_empty()));

            let mut sb = recover(&logger, &snap, cfg, &recs);
            let second = run_threads(&sb.nat, &sb.sh, &mut sb.ws, &mut sb.locals, &il, &[0, 0]);
            drop(sb.ws);
            let l = logger.join().unwrap();
            let released2 = released_so_far(&released_rx);
            let mut all = HashMap::new();
            for (packet, outs) in second.iter().flatten() {
                for (i, f) in outs.iter().enumerate() {
                    let id = pliant_ftmb::OutputId {
                        packet: *packet,
                        index: i as u32,
                    };
                    all.insert(id, f.clone());
                }
            }
            for (id, payload) in &released1 {
                assert_eq!(all.get(id), Some(payload), "{id:?}: replay differs");
                assert!(!released2.contains_key(id), "{id:?} released twice");
            }
            for (id, payload) in &released2 {
                assert_eq!(all.get(id), Some(payload));
            }
            assert_eq!(
                released1.len() + released2.len(),
                all.len(),
                "an output was lost"
            );
            assert_eq!(l.stats.audit_violations, 0);
            suppressed_total += l.stats.outputs_suppressed;
            assert_pools_match_mappings(&sb.nat, &sb.sh, &sb.locals);
        }
        assert!(suppressed_total > 0, "no replayed output was suppressed");
    }

    /// What the logger does with deltas: a full image, then every delta applied on top, must
    /// always equal the worker's full record set (creations, changes, expiries, flows created
    /// and expired between two deltas, keys re-created after deletion).
    #[test]
    fn deltas_applied_on_a_full_image_track_the_live_records() {
        let mut r = Rig::new(cfg_blocks(30000, 30999));
        let mut image: Vec<BTreeMap<Vec<u8>, Vec<u8>>> = vec![BTreeMap::new(); W];
        for (q, img) in image.iter_mut().enumerate() {
            for (k, v) in r.nat.take_delta(&mut r.locals[q], true) {
                img.insert(k, v.unwrap());
            }
        }
        let mut rng = xorshift(0x9E37_79B9_7F4A_7C15);
        let mut next = move |n: u64| rng() % n;
        let mut exts: Vec<u16> = Vec::new();
        for round in 0..30 {
            for _ in 0..20 {
                match next(4) {
                    0 | 1 => {
                        // A new flow or more of an old one (sport from a small range, so keys
                        // come back after they expired).
                        let sport = 5000 + next(60) as u16;
                        let (_, outs) = r.inject(Side::Inside, &udp_out(sport));
                        exts.extend(outs.iter().map(|f| check(f).sport));
                    }
                    2 if !exts.is_empty() => {
                        let e = exts[next(exts.len() as u64) as usize];
                        r.inject(Side::Outside, &udp_in(e));
                    }
                    _ => {
                        // Age a random worker's mappings so the next clock read expires some.
                        let q = next(W as u64) as usize;
                        let ms = 10_000 + next(25_000);
                        age(&mut r.locals[q], ms);
                    }
                }
            }
            // Deltas are not taken every round: several changes to one key in between.
            if round % 3 == 2 {
                for (q, img) in image.iter_mut().enumerate() {
                    for (k, v) in r.nat.take_delta(&mut r.locals[q], false) {
                        match v {
                            Some(v) => img.insert(k, v),
                            None => {
                                assert!(img.remove(&k).is_some(), "deleted a record never sent");
                                None
                            }
                        };
                    }
                }
            }
        }
        assert!(r.counters().mappings_expired > 10, "expiry was exercised");
        for (q, img) in image.iter_mut().enumerate() {
            for (k, v) in r.nat.take_delta(&mut r.locals[q], false) {
                match v {
                    Some(v) => img.insert(k, v),
                    None => img.remove(&k),
                };
            }
            let full: BTreeMap<Vec<u8>, Vec<u8>> = r
                .nat
                .take_delta(&mut r.locals[q], true)
                .into_iter()
                .map(|(k, v)| (k, v.unwrap()))
                .collect();
            assert_eq!(
                *img, full,
                "queue {q}: deltas drifted from the live records"
            );
        }
    }
}
