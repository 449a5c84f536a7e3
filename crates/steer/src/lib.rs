//! pliant-steer: the fabric's flow-steering data plane.
//!
//! [`Steer::attach`] loads `bpf/steer.bpf.c` (compiled by build.rs and embedded in the binary)
//! into a fabric network namespace, attaches it to tc clsact ingress (classic netlink filters,
//! so `tc filter show dev X ingress` lists it) of every fabric port, and keeps the map file
//! descriptors in this process: the controller that calls `attach` owns the maps. Optionally the
//! maps are pinned under bpffs so another process can reopen them with
//! [`SteerMaps::open_pinned`].
//!
//! Decision order for an IP packet entering an outer port (see `layout` for the maps):
//! exceptions -> conn (pins learned on a flow's first packet) -> port_owner (NAT return traffic
//! to a NAT address) -> ring (Maglev table, slot = hash(key) % size). The replica's `live` flag
//! is checked last; a dead or absent replica drops the packet (counted), never redirects.

pub mod control;
pub mod lab;
pub mod layout;
pub mod maglev;
mod netns;
mod sys;

use aya::maps::{Array, HashMap, IterableMap, Map, MapData, MapError, PerCpuArray};
use aya::programs::tc::{self, NlOptions, SchedClassifier, TcAttachOptions, TcAttachType};
use aya::{Ebpf, EbpfLoader};
use layout::*;
use pliant_state::FlowKey;
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::ops::RangeInclusive;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::time::Instant;

pub use sys::TestRun;

/// The compiled BPF object, embedded so the product reads no file at run time.
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/steer.bpf.o"));

const PROGRAM: &str = "pliant_steer";
/// tc filter priority used for our filters (so they are easy to spot in `tc filter show`).
pub const TC_PRIORITY: u16 = 10;

/// tc return codes the program uses.
pub const TC_ACT_OK: u32 = 0;
pub const TC_ACT_SHOT: u32 = 2;
pub const TC_ACT_REDIRECT: u32 = 7;

/// What went wrong, and with what.
#[derive(Debug, thiserror::Error)]
pub enum SteerError {
    #[error("network namespace {ns}: {source}")]
    Netns { ns: String, source: std::io::Error },
    #[error("interface {name} not found in namespace {ns}")]
    NoInterface { ns: String, name: String },
    #[error("BPF object has layout version {found}, this loader speaks {expected}")]
    LayoutVersion { found: u32, expected: u32 },
    #[error("BPF object unreadable: {0}")]
    Object(String),
    #[error("loading the BPF object: {0}")]
    Load(#[from] Box<aya::EbpfError>),
    #[error("BPF program {what}: {source}")]
    Program {
        what: String,
        source: Box<aya::programs::ProgramError>,
    },
    #[error("map {map}: {source}")]
    Map {
        map: &'static str,
        source: Box<MapError>,
    },
    #[error("map {0} missing from the BPF object")]
    MissingMap(&'static str),
    #[error("replica index {0} out of range 0..{MAX_REPLICAS}")]
    BadReplica(u32),
    #[error("ring of {0} slots: must be 1..={RING_MAX}")]
    BadRing(usize),
    #[error("bpf({op}): {source}")]
    Sys {
        op: &'static str,
        source: std::io::Error,
    },
    #[error("bpffs at {path}: {source}")]
    Bpffs {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("steering is detached")]
    Detached,
}

pub type Result<T> = std::result::Result<T, SteerError>;

fn map_err(map: &'static str) -> impl Fn(MapError) -> SteerError {
    move |e| SteerError::Map {
        map,
        source: Box::new(e),
    }
}

fn prog_err(what: impl Into<String>) -> impl FnOnce(aya::programs::ProgramError) -> SteerError {
    let what = what.into();
    move |e| SteerError::Program {
        what,
        source: Box::new(e),
    }
}

/// One replica's pair of fabric ports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplicaPorts {
    /// Replica index, `0..MAX_REPLICAS` (the lab uses its replica number).
    pub index: u32,
    /// Fabric end of the replica's inside link (`fin_i`).
    pub in_port: String,
    /// Fabric end of the replica's outside link (`fout_i`).
    pub out_port: String,
}

/// The fabric's ports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FabricPorts {
    /// Outer port towards the clients.
    pub client: String,
    /// Outer port towards the servers.
    pub server: String,
    pub replicas: Vec<ReplicaPorts>,
}

/// Load-time options.
#[derive(Clone, Debug)]
pub struct SteerOptions {
    /// Capacity of the exceptions map (flows the controller placed explicitly).
    pub exceptions_max: u32,
    /// Capacity of the LRU connection table (concurrent pinned flows).
    pub conn_max: u32,
    /// Pin every map as `<dir>/<map name>` (bpffs is mounted at /sys/fs/bpf if needed).
    pub pin_dir: Option<PathBuf>,
}

impl Default for SteerOptions {
    fn default() -> Self {
        SteerOptions {
            exceptions_max: 65_536,
            conn_max: 262_144,
            pin_dir: None,
        }
    }
}

/// Reads the `steer_layout_version` symbol out of the object's .rodata.
fn object_layout_version(obj: &[u8]) -> Result<u32> {
    use object::{Object, ObjectSection, ObjectSymbol};
    let f = object::File::parse(obj).map_err(|e| SteerError::Object(e.to_string()))?;
    let sym = f
        .symbols()
        .find(|s| s.name() == Ok("steer_layout_version"))
        .ok_or_else(|| SteerError::Object("no steer_layout_version symbol".into()))?;
    let idx = sym
        .section_index()
        .ok_or_else(|| SteerError::Object("steer_layout_version has no section".into()))?;
    let sec = f
        .section_by_index(idx)
        .map_err(|e| SteerError::Object(e.to_string()))?;
    let data = sec.data().map_err(|e| SteerError::Object(e.to_string()))?;
    let off = usize::try_from(sym.address()).map_err(|e| SteerError::Object(e.to_string()))?;
    let bytes: [u8; 4] = data
        .get(off..off + 4)
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| SteerError::Object("steer_layout_version out of bounds".into()))?;
    Ok(u32::from_le_bytes(bytes))
}

/// The layout version of the embedded object (equals [`LAYOUT_VERSION`] or `attach` refuses).
pub fn embedded_layout_version() -> Result<u32> {
    object_layout_version(OBJECT)
}

/// A snapshot of the per-CPU counters, summed over CPUs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    pub values: [u64; STAT_COUNT as usize],
}

impl Stats {
    pub fn get(&self, s: Stat) -> u64 {
        self.values[s as usize]
    }
    /// `(name, value)` pairs in index order.
    pub fn named(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        Stat::ALL.iter().map(|s| (s.name(), self.get(*s)))
    }
    /// Counter-wise difference `self - earlier` (saturating).
    pub fn since(&self, earlier: &Stats) -> Stats {
        let mut d = Stats::default();
        for i in 0..STAT_COUNT as usize {
            d.values[i] = self.values[i].saturating_sub(earlier.values[i]);
        }
        d
    }
}

/// Typed handles on every map; the controller-facing API. Usable without the programs (e.g.
/// reopened from bpffs pins by another process).
pub struct SteerMaps {
    config: Array<MapData, Config>,
    ports: HashMap<MapData, u32, PortInfo>,
    exceptions: HashMap<MapData, KeyPod, u32>,
    conn: HashMap<MapData, KeyPod, u32>,
    port_owner: Array<MapData, u32>,
    nat_addrs: HashMap<MapData, [u8; 16], u32>,
    ring: Array<MapData, u32>,
    ring_size: Array<MapData, u32>,
    replicas: Array<MapData, ReplicaSlot>,
    stats: PerCpuArray<MapData, u64>,
    debug_key: Array<MapData, KeyPod>,
}

const MAP_NAMES: [&str; 11] = [
    "config",
    "ports",
    "exceptions",
    "conn",
    "port_owner",
    "nat_addrs",
    "ring",
    "ring_size",
    "replicas",
    "stats",
    "debug_key",
];

fn addr16(a: IpAddr) -> [u8; 16] {
    match a {
        IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        IpAddr::V6(v6) => v6.octets(),
    }
}

/// aya reports a missing key as `KeyNotFound` on lookups but as a raw ENOENT on deletes.
fn not_found(e: &MapError) -> bool {
    match e {
        MapError::KeyNotFound => true,
        MapError::SyscallError(s) => s.io_error.raw_os_error() == Some(libc::ENOENT),
        _ => false,
    }
}

fn check_replica(r: u32) -> Result<()> {
    if r >= MAX_REPLICAS {
        Err(SteerError::BadReplica(r))
    } else {
        Ok(())
    }
}

impl SteerMaps {
    fn from_maps(mut take: impl FnMut(&'static str) -> Result<Map>) -> Result<SteerMaps> {
        macro_rules! typed {
            ($name:literal) => {
                take($name)?.try_into().map_err(map_err($name))?
            };
        }
        Ok(SteerMaps {
            config: typed!("config"),
            ports: typed!("ports"),
            exceptions: typed!("exceptions"),
            conn: typed!("conn"),
            port_owner: typed!("port_owner"),
            nat_addrs: typed!("nat_addrs"),
            ring: typed!("ring"),
            ring_size: typed!("ring_size"),
            replicas: typed!("replicas"),
            stats: typed!("stats"),
            debug_key: typed!("debug_key"),
        })
    }

    /// Reopens maps pinned by [`Steer::attach`] with [`SteerOptions::pin_dir`], checking the
    /// layout version stored in the config map.
    pub fn open_pinned(dir: &Path) -> Result<SteerMaps> {
        let maps = SteerMaps::from_maps(|name| {
            let md = MapData::from_pin(dir.join(name)).map_err(map_err(name))?;
            Map::from_map_data(md).map_err(map_err(name))
        })?;
        let cfg = maps.config()?;
        if cfg.layout_version != LAYOUT_VERSION {
            return Err(SteerError::LayoutVersion {
                found: cfg.layout_version,
                expected: LAYOUT_VERSION,
            });
        }
        Ok(maps)
    }

    /// Pins every map as `<dir>/<name>`, replacing older pins of the same name.
    fn pin_all(&self, dir: &Path) -> Result<()> {
        let pin = |name: &'static str, md: &MapData| -> Result<()> {
            let p = dir.join(name);
            let _ = std::fs::remove_file(&p);
            md.pin(&p).map_err(|e| SteerError::Bpffs {
                path: p.clone(),
                source: std::io::Error::other(e.to_string()),
            })
        };
        pin("config", self.config.map())?;
        pin("ports", self.ports.map())?;
        pin("exceptions", self.exceptions.map())?;
        pin("conn", self.conn.map())?;
        pin("port_owner", self.port_owner.map())?;
        pin("nat_addrs", self.nat_addrs.map())?;
        pin("ring", self.ring.map())?;
        pin("ring_size", self.ring_size.map())?;
        pin("replicas", self.replicas.map())?;
        pin("stats", self.stats.map())?;
        pin("debug_key", self.debug_key.map())
    }

    /// Copies flow placement from `old` (another instance's maps): replica slots, ring,
    /// exceptions, conn pins, NAT port owners and addresses. Counters start from zero; port
    /// roles and config are the caller's to write.
    fn adopt(&mut self, old: &SteerMaps) -> Result<()> {
        for i in 0..MAX_REPLICAS {
            let r = old.replica(i)?;
            if r != ReplicaSlot::default() {
                self.replicas.set(i, r, 0).map_err(map_err("replicas"))?;
            }
        }
        let ring = old.ring()?;
        if !ring.is_empty() {
            self.set_ring_half(0, &ring)?;
        }
        self.set_exceptions(&old.exceptions()?)?;
        for (k, r) in old.conn_entries()? {
            self.pin_conn(&k, r)?;
        }
        for p in 0..=u16::MAX {
            if let Some(r) = old.port_owner(p)? {
                self.set_port_owner(p..=p, Some(r))?;
            }
        }
        for a in old.nat_addrs.keys() {
            let a = a.map_err(map_err("nat_addrs"))?;
            self.nat_addrs
                .insert(a, 1, 0)
                .map_err(map_err("nat_addrs"))?;
        }
        Ok(())
    }

    pub fn config(&self) -> Result<Config> {
        self.config.get(&0, 0).map_err(map_err("config"))
    }

    fn set_config(&mut self, c: Config) -> Result<()> {
        self.config.set(0, c, 0).map_err(map_err("config"))
    }

    /// Records `ifindex`'s role (one of `ROLE_*`).
    pub fn set_port_role(&mut self, ifindex: u32, role: u32, replica: u32) -> Result<()> {
        self.ports
            .insert(ifindex, PortInfo { role, replica }, 0)
            .map_err(map_err("ports"))
    }

    /// Sets replica `i`'s fabric ports (ifindexes in the fabric namespace) and liveness.
    pub fn set_replica(
        &mut self,
        i: u32,
        in_ifindex: u32,
        out_ifindex: u32,
        live: bool,
    ) -> Result<()> {
        check_replica(i)?;
        let v = ReplicaSlot {
            in_ifindex,
            out_ifindex,
            flags: if live { REPLICA_LIVE } else { 0 },
            pad: 0,
        };
        self.replicas.set(i, v, 0).map_err(map_err("replicas"))
    }

    /// Flips replica `i`'s live flag, keeping its ports and its fence. A dead replica's packets
    /// are dropped (counted as `drop_dead`) until the controller re-homes its flows with
    /// exceptions.
    pub fn set_replica_live(&mut self, i: u32, live: bool) -> Result<()> {
        let mut r = self.replica(i)?;
        r.flags = if live {
            r.flags | REPLICA_LIVE
        } else {
            r.flags & !REPLICA_LIVE
        };
        self.replicas.set(i, r, 0).map_err(map_err("replicas"))
    }

    /// Fences (or unfences) replica slot `i` (design invariant 7): while fenced, every frame
    /// entering the fabric from its ports is dropped (counted `drop_fenced`) and no packet is
    /// steered to it, whatever its live flag says. [`set_replica`](Self::set_replica) (a new
    /// replica in the slot) clears the fence; [`set_replica_live`](Self::set_replica_live)
    /// keeps it, so a revived old owner stays silenced.
    pub fn set_replica_fenced(&mut self, i: u32, fenced: bool) -> Result<()> {
        let mut r = self.replica(i)?;
        r.flags = if fenced {
            r.flags | REPLICA_FENCED
        } else {
            r.flags & !REPLICA_FENCED
        };
        self.replicas.set(i, r, 0).map_err(map_err("replicas"))
    }

    /// Indexes of the fenced replica slots.
    pub fn fenced_replicas(&self) -> Result<Vec<u32>> {
        let mut out = Vec::new();
        for i in 0..MAX_REPLICAS {
            if self.replica(i)?.flags & REPLICA_FENCED != 0 {
                out.push(i);
            }
        }
        Ok(out)
    }

    pub fn replica(&self, i: u32) -> Result<ReplicaSlot> {
        check_replica(i)?;
        self.replicas.get(&i, 0).map_err(map_err("replicas"))
    }

    /// Indexes of the replicas marked live.
    pub fn live_replicas(&self) -> Result<Vec<u32>> {
        let mut out = Vec::new();
        for i in 0..MAX_REPLICAS {
            if self.replica(i)?.flags & REPLICA_LIVE != 0 {
                out.push(i);
            }
        }
        Ok(out)
    }

    /// Installs a new ring (slot -> replica index, [`NO_REPLICA`] for none): written into the idle
    /// half, then switched in with one config update, so packets never see a half-written ring.
    /// Live flows keep their conn pins; only new flows follow the new ring.
    pub fn set_ring(&mut self, owners: &[u32]) -> Result<()> {
        if owners.is_empty() || owners.len() > RING_MAX as usize {
            return Err(SteerError::BadRing(owners.len()));
        }
        if let Some(&r) = owners
            .iter()
            .find(|&&r| r != NO_REPLICA && r >= MAX_REPLICAS)
        {
            return Err(SteerError::BadReplica(r));
        }
        let mut cfg = self.config()?;
        let idle = (cfg.ring_active & 1) ^ 1;
        self.set_ring_half(idle, owners)?;
        cfg.ring_active = idle;
        self.set_config(cfg)
    }

    /// Writes `owners` (validated by the caller) into ring half `half` and its size.
    fn set_ring_half(&mut self, half: u32, owners: &[u32]) -> Result<()> {
        let base = half * RING_MAX;
        for (slot, &r) in owners.iter().enumerate() {
            // slot < RING_MAX: callers check owners.len() <= RING_MAX
            self.ring
                .set(base + slot as u32, r, 0)
                .map_err(map_err("ring"))?;
        }
        self.ring_size
            .set(half, owners.len() as u32, 0)
            .map_err(map_err("ring_size"))
    }

    /// Builds a Maglev table of `slots` (prime) over `replicas` and installs it.
    pub fn set_ring_maglev(&mut self, replicas: &[u32], slots: u32) -> Result<()> {
        let t = maglev::maglev_table(replicas, slots).map_err(|e| match e {
            maglev::MaglevError::BadReplica(r) => SteerError::BadReplica(r),
            maglev::MaglevError::BadSize(s) => SteerError::BadRing(s as usize),
        })?;
        self.set_ring(&t)
    }

    /// The ring in use.
    pub fn ring(&self) -> Result<Vec<u32>> {
        let half = self.config()?.ring_active & 1;
        let n = self.ring_size.get(&half, 0).map_err(map_err("ring_size"))?;
        (0..n.min(RING_MAX))
            .map(|s| {
                self.ring
                    .get(&(half * RING_MAX + s), 0)
                    .map_err(map_err("ring"))
            })
            .collect()
    }

    /// The replica the ring (not exceptions or conn pins) assigns to `key`.
    pub fn ring_owner(&self, key: &FlowKey) -> Result<Option<u32>> {
        let half = self.config()?.ring_active & 1;
        let n = self.ring_size.get(&half, 0).map_err(map_err("ring_size"))?;
        if n == 0 || n > RING_MAX {
            return Ok(None);
        }
        let r = self
            .ring
            .get(&(half * RING_MAX + ring_slot(key, n)), 0)
            .map_err(map_err("ring"))?;
        Ok((r != NO_REPLICA).then_some(r))
    }

    pub fn set_exception(&mut self, key: &FlowKey, replica: u32) -> Result<()> {
        check_replica(replica)?;
        self.exceptions
            .insert(KeyPod(*key), replica, 0)
            .map_err(map_err("exceptions"))
    }

    /// Removes an exception; `Ok(false)` if there was none.
    pub fn remove_exception(&mut self, key: &FlowKey) -> Result<bool> {
        match self.exceptions.remove(&KeyPod(*key)) {
            Ok(()) => Ok(true),
            Err(e) if not_found(&e) => Ok(false),
            Err(e) => Err(map_err("exceptions")(e)),
        }
    }

    pub fn exception(&self, key: &FlowKey) -> Result<Option<u32>> {
        match self.exceptions.get(&KeyPod(*key), 0) {
            Ok(v) => Ok(Some(v)),
            Err(e) if not_found(&e) => Ok(None),
            Err(e) => Err(map_err("exceptions")(e)),
        }
    }

    /// All exceptions (bounded by the map's capacity).
    pub fn exceptions(&self) -> Result<Vec<(FlowKey, u32)>> {
        self.exceptions
            .iter()
            .map(|r| r.map(|(k, v)| (k.0, v)).map_err(map_err("exceptions")))
            .collect()
    }

    /// Installs many exceptions with `BPF_MAP_UPDATE_BATCH` (one syscall per 4096), falling back
    /// to one update each if the kernel refuses batch ops for this map.
    pub fn set_exceptions(&mut self, entries: &[(FlowKey, u32)]) -> Result<()> {
        if let Some((_, r)) = entries.iter().find(|(_, r)| *r >= MAX_REPLICAS) {
            return Err(SteerError::BadReplica(*r));
        }
        for chunk in entries.chunks(4096) {
            let mut keys = Vec::with_capacity(chunk.len() * KEY_SIZE);
            let mut vals = Vec::with_capacity(chunk.len() * 4);
            for (k, v) in chunk {
                keys.extend_from_slice(&key_bytes(k));
                vals.extend_from_slice(&v.to_ne_bytes());
            }
            let fd = self.exceptions.map().fd().as_fd();
            let (done, r) = sys::update_batch(fd, &keys, &vals, chunk.len() as u32);
            match r {
                Ok(()) => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOTSUP | 524)) => {
                    for (k, v) in &chunk[done as usize..] {
                        self.set_exception(k, *v)?;
                    }
                }
                Err(e) => {
                    return Err(SteerError::Sys {
                        op: "map_update_batch(exceptions)",
                        source: e,
                    })
                }
            }
        }
        Ok(())
    }

    /// Removes many exceptions (absent keys are skipped). Returns how many were removed.
    pub fn remove_exceptions(&mut self, keys: &[FlowKey]) -> Result<usize> {
        let mut removed = 0;
        for chunk in keys.chunks(4096) {
            let mut raw = Vec::with_capacity(chunk.len() * KEY_SIZE);
            for k in chunk {
                raw.extend_from_slice(&key_bytes(k));
            }
            let fd = self.exceptions.map().fd().as_fd();
            let (done, r) = sys::delete_batch(fd, &raw, chunk.len() as u32);
            removed += done as usize;
            if r.is_err() {
                // ENOENT on an absent key (or no batch support): finish one by one.
                for k in &chunk[done as usize..] {
                    if self.remove_exception(k)? {
                        removed += 1;
                    }
                }
            }
        }
        Ok(removed)
    }

    /// Assigns NAT ports `range` to `replica` (`None` clears). Return traffic to a NAT address
    /// with one of these destination ports goes to that replica.
    pub fn set_port_owner(
        &mut self,
        range: RangeInclusive<u16>,
        replica: Option<u32>,
    ) -> Result<()> {
        let v = match replica {
            Some(r) => {
                check_replica(r)?;
                r + 1
            }
            None => 0,
        };
        for p in range {
            self.port_owner
                .set(u32::from(p), v, 0)
                .map_err(map_err("port_owner"))?;
        }
        Ok(())
    }

    pub fn port_owner(&self, port: u16) -> Result<Option<u32>> {
        let v = self
            .port_owner
            .get(&u32::from(port), 0)
            .map_err(map_err("port_owner"))?;
        Ok(v.checked_sub(1))
    }

    /// Declares `addr` a NAT address (its return traffic is steered by port).
    pub fn add_nat_addr(&mut self, addr: IpAddr) -> Result<()> {
        self.nat_addrs
            .insert(addr16(addr), 1, 0)
            .map_err(map_err("nat_addrs"))
    }

    pub fn remove_nat_addr(&mut self, addr: IpAddr) -> Result<bool> {
        match self.nat_addrs.remove(&addr16(addr)) {
            Ok(()) => Ok(true),
            Err(e) if not_found(&e) => Ok(false),
            Err(e) => Err(map_err("nat_addrs")(e)),
        }
    }

    /// Every pinned connection (bounded by the conn table's capacity).
    pub fn conn_entries(&self) -> Result<Vec<(FlowKey, u32)>> {
        // Iteration over a map that the data path mutates can skip or repeat a key; fine for
        // inspection, and flushes below re-check each key.
        let mut out = Vec::new();
        for r in self.conn.iter() {
            match r {
                Ok((k, v)) => out.push((k.0, v)),
                Err(e) if not_found(&e) => continue,
                Err(e) => return Err(map_err("conn")(e)),
            }
        }
        Ok(out)
    }

    pub fn conn_owner(&self, key: &FlowKey) -> Result<Option<u32>> {
        match self.conn.get(&KeyPod(*key), 0) {
            Ok(v) => Ok(Some(v)),
            Err(e) if not_found(&e) => Ok(None),
            Err(e) => Err(map_err("conn")(e)),
        }
    }

    /// Pins `key` to `replica` in the conn table (e.g. to pre-pin flows before a ring change).
    pub fn pin_conn(&mut self, key: &FlowKey, replica: u32) -> Result<()> {
        check_replica(replica)?;
        self.conn
            .insert(KeyPod(*key), replica, 0)
            .map_err(map_err("conn"))
    }

    /// Removes every conn pin pointing at `replica`; returns how many.
    pub fn flush_conn_for(&mut self, replica: u32) -> Result<usize> {
        let keys: Vec<FlowKey> = self
            .conn_entries()?
            .into_iter()
            .filter(|(_, r)| *r == replica)
            .map(|(k, _)| k)
            .collect();
        let mut n = 0;
        for k in keys {
            match self.conn.remove(&KeyPod(k)) {
                Ok(()) => n += 1,
                Err(e) if not_found(&e) => {}
                Err(e) => return Err(map_err("conn")(e)),
            }
        }
        Ok(n)
    }

    /// Removes every conn pin; returns how many.
    pub fn flush_conn(&mut self) -> Result<usize> {
        let keys: Vec<FlowKey> = self.conn_entries()?.into_iter().map(|(k, _)| k).collect();
        let mut n = 0;
        for k in keys {
            if self.conn.remove(&KeyPod(k)).is_ok() {
                n += 1;
            }
        }
        Ok(n)
    }

    pub fn stats(&self) -> Result<Stats> {
        let mut s = Stats::default();
        for st in Stat::ALL {
            let v = self.stats.get(&(st as u32), 0).map_err(map_err("stats"))?;
            s.values[st as usize] = v.iter().copied().fold(0u64, u64::saturating_add);
        }
        Ok(s)
    }

    /// Makes the program record every computed key into `debug_key` (tests only: it costs a
    /// map write per packet).
    pub fn set_debug_key(&mut self, on: bool) -> Result<()> {
        let mut c = self.config()?;
        c.flags = if on {
            c.flags | CFG_DEBUG_KEY
        } else {
            c.flags & !CFG_DEBUG_KEY
        };
        self.set_config(c)
    }

    /// The last key recorded with [`set_debug_key`](Self::set_debug_key) on.
    pub fn debug_key(&self) -> Result<FlowKey> {
        self.debug_key
            .get(&0, 0)
            .map(|k| k.0)
            .map_err(map_err("debug_key"))
    }
}

/// The attached steering program plus its maps. Derefs to [`SteerMaps`].
pub struct Steer {
    ns: String,
    maps: SteerMaps,
    guard: AttachGuard,
    ifindexes: BTreeMap<String, u32>,
    attached: Vec<String>,
}

impl std::ops::Deref for Steer {
    type Target = SteerMaps;
    fn deref(&self) -> &SteerMaps {
        &self.maps
    }
}

impl std::ops::DerefMut for Steer {
    fn deref_mut(&mut self) -> &mut SteerMaps {
        &mut self.maps
    }
}

fn ifindex(ns: &str, name: &str) -> Result<u32> {
    let c = std::ffi::CString::new(name).map_err(|_| SteerError::NoInterface {
        ns: ns.into(),
        name: name.into(),
    })?;
    // SAFETY: c is a valid NUL-terminated string.
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if i == 0 {
        Err(SteerError::NoInterface {
            ns: ns.into(),
            name: name.into(),
        })
    } else {
        Ok(i)
    }
}

fn attach_port(ebpf: &mut Ebpf, port: &str) -> Result<()> {
    // An existing clsact qdisc is fine (EEXIST); anything else surfaces at attach.
    let _ = tc::qdisc_add_clsact(port);
    let prog: &mut SchedClassifier = ebpf
        .program_mut(PROGRAM)
        .ok_or_else(|| SteerError::Object(format!("no program {PROGRAM}")))?
        .try_into()
        .map_err(prog_err(PROGRAM))?;
    prog.attach_with_options(
        port,
        TcAttachType::Ingress,
        TcAttachOptions::Netlink(NlOptions {
            priority: TC_PRIORITY,
            ..Default::default()
        }),
    )
    .map_err(prog_err(format!("attach to {port} ingress")))?;
    Ok(())
}

impl Steer {
    /// Loads and attaches steering in the fabric namespace `ns` (a name under /run/netns) on
    /// the outer ports and each replica's port pair. Replicas start live; the ring starts empty
    /// (IP packets from outer ports are dropped and counted until [`SteerMaps::set_ring`]).
    pub fn attach(ns: &str, ports: &FabricPorts, opts: &SteerOptions) -> Result<Steer> {
        let found = embedded_layout_version()?;
        if found != LAYOUT_VERSION {
            return Err(SteerError::LayoutVersion {
                found,
                expected: LAYOUT_VERSION,
            });
        }
        for r in &ports.replicas {
            check_replica(r.index)?;
        }
        if let Some(dir) = &opts.pin_dir {
            netns::ensure_bpffs(dir)?;
        }
        let nsname = ns.to_string();
        let (ebpf, maps, ifindexes) = netns::in_netns(ns, move || -> Result<_> {
            let mut ifi = BTreeMap::new();
            let mut names = vec![ports.client.clone(), ports.server.clone()];
            for r in &ports.replicas {
                names.push(r.in_port.clone());
                names.push(r.out_port.clone());
            }
            for n in &names {
                ifi.insert(n.clone(), ifindex(&nsname, n)?);
            }
            let mut ebpf = EbpfLoader::new()
                .map_max_entries("exceptions", opts.exceptions_max)
                .map_max_entries("conn", opts.conn_max)
                .load(OBJECT)
                .map_err(|e| SteerError::Load(Box::new(e)))?;
            let prog: &mut SchedClassifier = ebpf
                .program_mut(PROGRAM)
                .ok_or_else(|| SteerError::Object(format!("no program {PROGRAM}")))?
                .try_into()
                .map_err(prog_err(PROGRAM))?;
            prog.load().map_err(prog_err("load"))?;
            let mut taken: BTreeMap<&'static str, Map> = BTreeMap::new();
            for name in MAP_NAMES {
                let m = ebpf.take_map(name).ok_or(SteerError::MissingMap(name))?;
                taken.insert(name, m);
            }
            let mut maps = SteerMaps::from_maps(|name| {
                taken.remove(name).ok_or(SteerError::MissingMap(name))
            })?;
            if let Some(dir) = &opts.pin_dir {
                // A previous owner's pinned maps (e.g. the lab that built this fabric, when the
                // controller takes over): carry their flow placement over so that no live flow
                // is re-homed by the takeover.
                if dir.join("config").exists() {
                    let old = SteerMaps::open_pinned(dir)?;
                    maps.adopt(&old)?;
                }
                maps.pin_all(dir)?;
            }
            // Config, roles and replicas before any filter exists, so the first packet already
            // sees a complete configuration.
            maps.set_config(Config {
                layout_version: LAYOUT_VERSION,
                flags: 0,
                client_ifindex: ifi[&ports.client],
                server_ifindex: ifi[&ports.server],
                ring_active: 0,
                pad: 0,
            })?;
            maps.set_port_role(ifi[&ports.client], ROLE_CLIENT, 0)?;
            maps.set_port_role(ifi[&ports.server], ROLE_SERVER, 0)?;
            for r in &ports.replicas {
                let (i, o) = (ifi[&r.in_port], ifi[&r.out_port]);
                maps.set_port_role(i, ROLE_REPLICA_IN, r.index)?;
                maps.set_port_role(o, ROLE_REPLICA_OUT, r.index)?;
                maps.set_replica(r.index, i, o, true)?;
            }
            for n in &names {
                // Replace a previous owner's filter (same program name) on this port; packets
                // arriving in the microseconds between the two netlink calls see no filter.
                let _ = tc::qdisc_detach_program(n, TcAttachType::Ingress, PROGRAM);
                attach_port(&mut ebpf, n)?;
            }
            Ok((ebpf, maps, ifi))
        })??;
        let attached = ifindexes.keys().cloned().collect();
        Ok(Steer {
            ns: ns.to_string(),
            maps,
            guard: AttachGuard {
                ns: ns.to_string(),
                ebpf: Some(ebpf),
                pin_dir: opts.pin_dir.clone(),
                keep: false,
            },
            ifindexes,
            attached,
        })
    }

    /// Adds a replica's port pair after attach (scale-out): attaches the program to both ports,
    /// records their roles and marks the replica live. Add it to the ring separately.
    pub fn add_replica(&mut self, r: &ReplicaPorts) -> Result<()> {
        check_replica(r.index)?;
        let ebpf = self.guard.ebpf.as_mut().ok_or(SteerError::Detached)?;
        let ns = self.ns.clone();
        let (i, o) = netns::in_netns(&self.ns, move || -> Result<(u32, u32)> {
            let i = ifindex(&ns, &r.in_port)?;
            let o = ifindex(&ns, &r.out_port)?;
            attach_port(ebpf, &r.in_port)?;
            attach_port(ebpf, &r.out_port)?;
            Ok((i, o))
        })??;
        self.maps.set_port_role(i, ROLE_REPLICA_IN, r.index)?;
        self.maps.set_port_role(o, ROLE_REPLICA_OUT, r.index)?;
        self.maps.set_replica(r.index, i, o, true)?;
        self.ifindexes.insert(r.in_port.clone(), i);
        self.ifindexes.insert(r.out_port.clone(), o);
        self.attached.push(r.in_port.clone());
        self.attached.push(r.out_port.clone());
        Ok(())
    }

    /// Interface index of a fabric port this steering knows.
    pub fn ifindex(&self, port: &str) -> Option<u32> {
        self.ifindexes.get(port).copied()
    }

    /// The fabric namespace.
    pub fn netns(&self) -> &str {
        &self.ns
    }

    /// Runs the program once over `frame` as if it arrived on `ingress_ifindex`, `repeat` times
    /// (BPF_PROG_TEST_RUN; nothing is sent for redirect verdicts). For tests and cost
    /// measurement.
    pub fn test_run(&self, frame: &[u8], ingress_ifindex: u32, repeat: u32) -> Result<TestRun> {
        let ebpf = self.guard.ebpf.as_ref().ok_or(SteerError::Detached)?;
        let prog: &SchedClassifier = ebpf
            .program(PROGRAM)
            .ok_or_else(|| SteerError::Object(format!("no program {PROGRAM}")))?
            .try_into()
            .map_err(prog_err(PROGRAM))?;
        let fd = prog.fd().map_err(prog_err("fd"))?;
        sys::test_run(fd.as_fd(), frame, ingress_ifindex, repeat).map_err(|e| SteerError::Sys {
            op: "prog_test_run",
            source: e,
        })
    }

    /// Removes the tc filters (inside the fabric namespace) and closes the program. The maps
    /// stay open (and pinned, if they were) for inspection.
    pub fn detach(&mut self) -> Result<()> {
        let Some(ebpf) = self.guard.ebpf.take() else {
            return Ok(());
        };
        netns::in_netns(&self.ns, move || drop(ebpf))
    }

    /// Leaves the filters attached after this process exits (the kernel keeps the program alive
    /// through them) and returns the maps. Pair with [`SteerOptions::pin_dir`] so that a later
    /// process can reopen the maps.
    pub fn persist(self) -> SteerMaps {
        let Steer {
            maps, mut guard, ..
        } = self;
        if let Some(ebpf) = guard.ebpf.take() {
            // Dropping would detach; forgetting leaks only this process's FDs.
            std::mem::forget(ebpf);
        }
        guard.pin_dir = None;
        maps
    }

    /// Like [`Steer::persist`] for when this instance is dropped, whenever that is: the
    /// filters stay attached and the pins stay, so the fabric keeps steering with everything
    /// it learned (conn pins, exceptions, ring, port owners) and the next owner's
    /// [`Steer::attach`] on the same `pin_dir` adopts it. For an owner that may stop at any
    /// time while the fabric must not (a controller that loses its leadership).
    pub fn keep_on_drop(&mut self) {
        self.guard.keep = true;
    }

    /// Names of the ports the program is attached to.
    pub fn attached_ports(&self) -> &[String] {
        &self.attached
    }
}

/// Programs and their tc links. Dropped only inside the fabric namespace, because aya removes
/// netlink tc filters by ifindex in the *current* namespace.
/// Pins (if any) are removed with it unless [`Steer::persist`] handed them on.
struct AttachGuard {
    ns: String,
    ebpf: Option<Ebpf>,
    pin_dir: Option<PathBuf>,
    /// [`Steer::keep_on_drop`]: filters and pins outlive this instance.
    keep: bool,
}

impl Drop for AttachGuard {
    fn drop(&mut self) {
        if self.keep {
            // Dropping would detach; forgetting leaks only this process's FDs.
            std::mem::forget(self.ebpf.take());
            return;
        }
        if let Some(ebpf) = self.ebpf.take() {
            let ns = self.ns.clone();
            // If the namespace is gone its interfaces (and our filters) went with it; dropping
            // here would issue netlink deletes against this thread's namespace, where the same
            // ifindexes may name unrelated interfaces, so forget the handles instead.
            let mut slot = Some(ebpf);
            let r = netns::in_netns(&ns, || drop(slot.take()));
            if r.is_err() {
                std::mem::forget(slot.take());
            }
        }
        if let Some(dir) = self.pin_dir.take() {
            remove_pins(&dir);
        }
    }
}

/// Removes the map pins `attach` created under `dir`, then `dir` if it is empty. Used when the
/// owning [`Steer`] goes away without [`Steer::persist`], and by lab teardown.
pub fn remove_pins(dir: &Path) {
    for name in MAP_NAMES {
        let _ = std::fs::remove_file(dir.join(name));
    }
    let _ = std::fs::remove_dir(dir);
}

/// Measures `f` over `n` items: mean microseconds per item (for the scale report).
pub fn per_item_us(n: usize, f: impl FnOnce() -> Result<()>) -> Result<f64> {
    let t = Instant::now();
    f()?;
    Ok(t.elapsed().as_secs_f64() * 1e6 / n.max(1) as f64)
}
