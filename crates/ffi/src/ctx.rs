//! The context behind a `PliantCtx*`: one engine, the packets the C program holds, its open
//! flow and shared transactions, and the timer callback. All methods here are safe Rust; the
//! `extern "C"` layer ([`crate::api`]) converts pointers and catches panics.

use crate::adapter::{self, CAdapter, Queues, SharedQueues};
use crate::port::AnyPort;
use crate::*;
use pliant_io::{FramePort, MemPort, PacketPort, PortOptions};
use pliant_runtime::config::{Cidr, ReplicaConfig};
use pliant_runtime::control::ControlServer;
use pliant_runtime::engine::{Engine, EngineOptions};
use pliant_runtime::kernel::KernelGuard;
use pliant_runtime::route::SideNet;
use pliant_runtime::{Packet, Side};
use pliant_state::{
    FlowKey, FlowRef, GetFlags, HubConfig, LocalCoherence, PutFlags, SharedConfig, SharedRef,
    StateError, TimerId,
};
use std::collections::{HashMap, VecDeque};
use std::ffi::CString;
use std::os::fd::RawFd;
use std::os::raw::{c_int, c_void};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A failed call: the code returned to C and the text for `pliant_last_error`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Error {
    pub code: c_int,
    pub msg: String,
}

impl Error {
    pub fn new(code: c_int, msg: impl Into<String>) -> Self {
        Error {
            code,
            msg: msg.into(),
        }
    }
    pub fn inval(msg: impl Into<String>) -> Self {
        Error::new(PLIANT_EINVAL, msg)
    }
}

impl From<StateError> for Error {
    fn from(e: StateError) -> Self {
        let code = match &e {
            StateError::NotFound(_) | StateError::SharedNotFound(_) => PLIANT_ENOTFOUND,
            StateError::Migrated { .. } => PLIANT_EMIGRATED,
            StateError::Exists(_) | StateError::SharedExists(_) => PLIANT_EEXIST,
            StateError::Busy { .. } | StateError::SharedBusy { .. } => PLIANT_EBUSY,
            StateError::Full { .. }
            | StateError::TooManyTimers { .. }
            | StateError::TooManyAliases { .. }
            | StateError::SharedLimit { .. } => PLIANT_EFULL,
            StateError::StaleRef(_) => PLIANT_EINVAL,
            StateError::Decode(_) | StateError::Encode { .. } => PLIANT_EDECODE,
            StateError::SharedMode { .. } => PLIANT_EMODE,
            StateError::Locked(_) | StateError::LeaseLost(_) => PLIANT_ELOCKED,
            StateError::Coherence { .. } => PLIANT_EIO,
        };
        Error::new(code, e.to_string())
    }
}

pub(crate) type Res<T> = Result<T, Error>;

/// Bounds of one context (every queue and table the FFI layer adds has one).
#[derive(Clone, Debug)]
pub(crate) struct Limits {
    /// Packets the C program may hold at once (read, not yet written or dropped).
    pub max_held_packets: usize,
    /// Open `get_flow` transactions at once.
    pub max_open_flows: usize,
    /// Open `get_shared` transactions at once.
    pub max_open_shared: usize,
    /// Largest per-flow state blob.
    pub max_flow_state_bytes: usize,
    /// Packets queued between the engine and `pkt_read`.
    pub max_inbox: usize,
    /// Expired timers queued for the callback.
    pub max_timers: usize,
    /// Mem mode: transmitted frames kept for `pliant_mem_take`.
    pub max_mem_out: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_held_packets: 256,
            max_open_flows: 4096,
            max_open_shared: 64,
            max_flow_state_bytes: 64 * 1024,
            max_inbox: 1024,
            max_timers: 65_536,
            max_mem_out: 65_536,
        }
    }
}

/// Set by the SIGTERM/SIGINT handler of a live context.
static SIGNALLED: AtomicBool = AtomicBool::new(false);
static NEXT_CTX_ID: AtomicU64 = AtomicU64::new(1);
const CTX_MAGIC: u64 = 0x706c_6961_6e74_6378; // "pliantcx"
const PKT_MAGIC: u64 = 0x706c_6961_6e74_706b; // "pliantpk"

extern "C" fn on_signal(_sig: c_int) {
    // Only an atomic store: async-signal-safe.
    SIGNALLED.store(true, Ordering::SeqCst);
}

fn install_signal_handlers() -> Res<()> {
    for sig in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: a zeroed sigaction with a plain handler and an empty mask is valid; the
        // handler only touches an atomic.
        let rc = unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as *const () as usize;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut())
        };
        if rc != 0 {
            return Err(Error::new(
                PLIANT_EIO,
                format!("sigaction({sig}): {}", std::io::Error::last_os_error()),
            ));
        }
    }
    Ok(())
}

/// A packet handed to C. Slots live in one allocation owned by the context and are recycled
/// first-in first-out, so a pointer used after `pkt_write`/`pkt_drop` finds an empty slot (an
/// error, not a use-after-free) until many later packets have reused it.
pub struct PliantPkt {
    magic: u64,
    ctx_id: u64,
    pub(crate) pkt: Option<Packet>,
}

impl PliantPkt {
    /// The packet held in this slot, if the pointer looks like one of ours and is held.
    ///
    /// # Safety
    /// `p` must be null or point into a live context's packet slots.
    pub(crate) unsafe fn get<'a>(p: *const PliantPkt) -> Option<&'a Packet> {
        let s = p.as_ref()?;
        if s.magic != PKT_MAGIC {
            return None;
        }
        s.pkt.as_ref()
    }

    /// # Safety
    /// As [`PliantPkt::get`], and no other reference to the slot is alive.
    pub(crate) unsafe fn get_mut<'a>(p: *mut PliantPkt) -> Option<&'a mut Packet> {
        let s = p.as_mut()?;
        if s.magic != PKT_MAGIC {
            return None;
        }
        s.pkt.as_mut()
    }
}

struct PktSlots {
    /// One boxed slice, kept as a raw pointer so C's pointers into it never alias a Rust
    /// reference to the context.
    base: NonNull<[PliantPkt]>,
    free: VecDeque<usize>,
}

impl PktSlots {
    fn new(n: usize, ctx_id: u64) -> Self {
        let slots: Box<[PliantPkt]> = (0..n)
            .map(|_| PliantPkt {
                magic: PKT_MAGIC,
                ctx_id,
                pkt: None,
            })
            .collect();
        PktSlots {
            // SAFETY: Box::into_raw never returns null.
            base: unsafe { NonNull::new_unchecked(Box::into_raw(slots)) },
            free: (0..n).collect(),
        }
    }

    fn index_of(&self, p: *const PliantPkt) -> Option<usize> {
        let base = self.base.as_ptr() as *const PliantPkt as usize;
        let size = std::mem::size_of::<PliantPkt>();
        let off = (p as usize).checked_sub(base)?;
        let i = off / size;
        (off % size == 0 && i < self.base.len()).then_some(i)
    }

    fn slot(&mut self, i: usize) -> &mut PliantPkt {
        // SAFETY: i < len (callers), the allocation lives as long as self, and C's pointers are
        // only dereferenced inside single-threaded API calls, never while this borrow is live.
        unsafe { &mut (*self.base.as_ptr())[i] }
    }

    /// Puts `pkt` into free slot `i` (taken from `free` by the caller).
    fn hold(&mut self, i: usize, pkt: Packet) -> *mut PliantPkt {
        let s = self.slot(i);
        s.pkt = Some(pkt);
        s as *mut PliantPkt
    }

    /// Takes back a held packet; `Err` says why the pointer is not a held packet of ours.
    fn release(&mut self, p: *mut PliantPkt, ctx_id: u64) -> Res<Packet> {
        let i = self
            .index_of(p)
            .ok_or_else(|| Error::inval("packet pointer does not belong to this context"))?;
        let s = self.slot(i);
        debug_assert_eq!(s.ctx_id, ctx_id);
        let pkt = s.pkt.take().ok_or_else(|| {
            Error::new(
                PLIANT_ENOTOPEN,
                "packet already written or dropped (not held)",
            )
        })?;
        self.free.push_back(i);
        Ok(pkt)
    }

    fn held(&self) -> usize {
        self.base.len() - self.free.len()
    }
}

impl Drop for PktSlots {
    fn drop(&mut self) {
        // SAFETY: base came from Box::into_raw in `new` and is freed only here.
        drop(unsafe { Box::from_raw(self.base.as_ptr()) });
    }
}

enum Mode {
    /// In-memory ports and a clock that moves only with `pliant_mem_advance`.
    Mem {
        clock: Instant,
        out: VecDeque<(Side, Vec<u8>)>,
        out_dropped: u64,
    },
    /// AF_PACKET ports; waits in poll(2) on these fds.
    Live { wait_fds: Vec<RawFd> },
}

/// Resources of a live replica, released after the engine (declaration order in `PliantCtx`).
struct LiveResources {
    _server: ControlServer,
    _guards: [KernelGuard; 2],
}

/// Replicas of a mem group share one coherence hub (PULL/PUSH between them).
#[derive(Clone)]
struct MemGroup {
    hub: LocalCoherence,
    next_replica: Arc<AtomicU32>,
}

/// One C network function's view of a replica. Not thread-safe: use it from one thread.
pub struct PliantCtx {
    magic: u64,
    id: u64,
    pub(crate) engine: Engine<CAdapter, AnyPort>,
    queues: SharedQueues,
    slots: PktSlots,
    flow_refs: HashMap<FlowKey, Vec<FlowRef>>,
    open_flow_refs: usize,
    shared_refs: HashMap<String, Vec<SharedRef>>,
    open_shared_refs: usize,
    pub(crate) timer_cb: PliantTimerFn,
    pub(crate) timer_user: *mut c_void,
    /// True while a timer callback runs (refuses re-entrant rounds).
    pub(crate) in_callback: bool,
    pub(crate) timer_scratch: Vec<(FlowKey, TimerId)>,
    pub(crate) last_error: CString,
    pub(crate) poisoned: bool,
    stop: bool,
    mode: Mode,
    group: Option<MemGroup>,
    nf_config: toml::Table,
    limits: Limits,
    /// First IPv4 address of each side (the target of `pliant_mem_learn`'s ARP request).
    own_v4: [Option<std::net::Ipv4Addr>; 2],
    pub(crate) stats: FfiStats,
    _live: Option<LiveResources>,
}

/// Counters of the FFI layer itself (also exported as NF counters with a `c_` prefix).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct FfiStats {
    pub timers_dispatched: u64,
    pub timers_without_handler: u64,
    pub refused_held_full: u64,
}

/// What differs between a live and an in-memory context.
struct Parts {
    name: String,
    ports: [AnyPort; 2],
    nets: [SideNet; 2],
    mode: Mode,
    group: Option<MemGroup>,
    nf_config: toml::Table,
    live: Option<LiveResources>,
}

/// Default mem topology: inside 10.0.1.1/24, outside 10.0.2.1/24.
const MEM_INSIDE: &str = "10.0.1.1/24";
const MEM_OUTSIDE: &str = "10.0.2.1/24";
pub(crate) const MEM_MAC_INSIDE: [u8; 6] = [0x02, 0x50, 0, 0, 0, 0x01];
pub(crate) const MEM_MAC_OUTSIDE: [u8; 6] = [0x02, 0x50, 0, 0, 0, 0x02];

fn side_net(ifname: &str, cidr: &str) -> Res<SideNet> {
    Ok(SideNet {
        ifname: ifname.to_string(),
        addrs: vec![Cidr::parse(cidr).map_err(Error::inval)?],
        gateway: None,
    })
}

fn load_config(path: &str) -> Res<(ReplicaConfig, toml::Table)> {
    let cfg = ReplicaConfig::load(path).map_err(|e| Error::new(PLIANT_EIO, e.to_string()))?;
    if cfg.nf.kind != "c" {
        return Err(Error::new(
            PLIANT_EIO,
            format!(
                "{path}: nf.kind is {:?}; a C network function needs kind = \"c\"",
                cfg.nf.kind
            ),
        ));
    }
    let nf = match cfg.nf_sections.get("c") {
        Some(toml::Value::Table(t)) => t.clone(),
        Some(_) => {
            return Err(Error::new(
                PLIANT_EIO,
                format!("{path}: [c] is not a table"),
            ))
        }
        None => toml::Table::new(),
    };
    Ok((cfg, nf))
}

pub(crate) fn side_of(side: c_int) -> Res<Side> {
    match side {
        PLIANT_SIDE_INSIDE => Ok(Side::Inside),
        PLIANT_SIDE_OUTSIDE => Ok(Side::Outside),
        s => Err(Error::inval(format!(
            "side {s} is neither inside (0) nor outside (1)"
        ))),
    }
}

pub(crate) fn side_idx(side: Side) -> usize {
    match side {
        Side::Inside => 0,
        Side::Outside => 1,
    }
}

pub(crate) fn side_code(side: Side) -> c_int {
    match side {
        Side::Inside => PLIANT_SIDE_INSIDE,
        Side::Outside => PLIANT_SIDE_OUTSIDE,
    }
}

impl PliantCtx {
    fn build(parts: Parts, now: Instant) -> Box<PliantCtx> {
        let Parts {
            name,
            ports,
            nets,
            mode,
            group,
            nf_config,
            live,
        } = parts;
        let v4 = |n: &SideNet| {
            n.addrs.iter().find_map(|c| match c.addr {
                std::net::IpAddr::V4(a) => Some(a),
                std::net::IpAddr::V6(_) => None,
            })
        };
        let own_v4 = [v4(&nets[0]), v4(&nets[1])];
        let limits = Limits::default();
        let queues: SharedQueues = Arc::new(Mutex::new(Queues {
            max_inbox: limits.max_inbox,
            max_timers: limits.max_timers,
            ..Queues::default()
        }));
        let mut engine = Engine::new(
            &name,
            CAdapter {
                queues: queues.clone(),
            },
            ports,
            nets,
            EngineOptions::default(),
            now,
        );
        if let Some(g) = &group {
            let id = g.next_replica.fetch_add(1, Ordering::Relaxed);
            engine.ctx.shared = g.hub.store(id, SharedConfig::default());
        }
        let id = NEXT_CTX_ID.fetch_add(1, Ordering::Relaxed);
        Box::new(PliantCtx {
            magic: CTX_MAGIC,
            id,
            engine,
            queues,
            slots: PktSlots::new(limits.max_held_packets, id),
            flow_refs: HashMap::new(),
            open_flow_refs: 0,
            shared_refs: HashMap::new(),
            open_shared_refs: 0,
            timer_cb: None,
            timer_user: std::ptr::null_mut(),
            in_callback: false,
            timer_scratch: Vec::new(),
            last_error: CString::default(),
            poisoned: false,
            stop: false,
            mode,
            group,
            nf_config,
            limits,
            own_v4,
            stats: FfiStats::default(),
            _live: live,
        })
    }

    /// A replica on real interfaces, configured by a replica TOML with `nf.kind = "c"`.
    pub(crate) fn open_live(path: &str) -> Res<Box<PliantCtx>> {
        let (cfg, nf) = load_config(path)?;
        let io = |e: String| Error::new(PLIANT_EIO, e);
        cfg.check_interfaces().map_err(io)?;
        let nets = [
            SideNet::from_config(&cfg.inside).map_err(io)?,
            SideNet::from_config(&cfg.outside).map_err(io)?,
        ];
        install_signal_handlers()?;
        // The guard keeps the namespace's kernel off the interfaces before the ports open.
        let guards = [
            KernelGuard::install(&cfg.inside.ifname).map_err(io)?,
            KernelGuard::install(&cfg.outside.ifname).map_err(io)?,
        ];
        let opts = PortOptions::default();
        let inside = PacketPort::open(&cfg.inside.ifname, &opts).map_err(|e| io(e.to_string()))?;
        let outside =
            PacketPort::open(&cfg.outside.ifname, &opts).map_err(|e| io(e.to_string()))?;
        let security = cfg.security().map(|s| s.load()).transpose().map_err(io)?;
        let (server, handle) =
            pliant_runtime::control::start(&pliant_runtime::control::ControlOptions {
                socket: cfg.replica.control_socket.clone(),
                listen: cfg.replica.control_listen.clone(),
                metrics_listen: cfg.replica.metrics_listen.clone(),
                security,
            })
            .map_err(io)?;
        let mut wait_fds: Vec<RawFd> = [inside.poll_fd(), outside.poll_fd()]
            .into_iter()
            .flatten()
            .collect();
        wait_fds.push(handle.wake_fd());
        let mut ctx = Self::build(
            Parts {
                name: cfg.replica.name.clone(),
                ports: [
                    AnyPort::Packet(Box::new(inside)),
                    AnyPort::Packet(Box::new(outside)),
                ],
                nets,
                mode: Mode::Live { wait_fds },
                group: None,
                nf_config: nf,
                live: Some(LiveResources {
                    _server: server,
                    _guards: guards,
                }),
            },
            Instant::now(),
        );
        ctx.engine.set_control(handle);
        Ok(ctx)
    }

    /// In-memory ports; addresses from `path` if given, else the default mem topology.
    pub(crate) fn open_mem(path: Option<&str>, peer: Option<&PliantCtx>) -> Res<Box<PliantCtx>> {
        let (name, nets, nf) = match path {
            Some(p) => {
                let (cfg, nf) = load_config(p)?;
                let io = |e: String| Error::new(PLIANT_EIO, e);
                (
                    cfg.replica.name.clone(),
                    [
                        SideNet::from_config(&cfg.inside).map_err(io)?,
                        SideNet::from_config(&cfg.outside).map_err(io)?,
                    ],
                    nf,
                )
            }
            None => match peer {
                // A peer sees the same network and config as the replica it joins.
                Some(p) => (
                    "c-mem-peer".to_string(),
                    [
                        side_net("mem-in", MEM_INSIDE)?,
                        side_net("mem-out", MEM_OUTSIDE)?,
                    ],
                    p.nf_config.clone(),
                ),
                None => (
                    "c-mem".to_string(),
                    [
                        side_net("mem-in", MEM_INSIDE)?,
                        side_net("mem-out", MEM_OUTSIDE)?,
                    ],
                    toml::Table::new(),
                ),
            },
        };
        let group = match peer.and_then(|p| p.group.clone()) {
            Some(g) => g,
            None if peer.is_some() => {
                return Err(Error::inval("peer is not an in-memory context"));
            }
            None => MemGroup {
                hub: LocalCoherence::new(HubConfig::default()),
                next_replica: Arc::new(AtomicU32::new(0)),
            },
        };
        let now = Instant::now();
        Ok(Self::build(
            Parts {
                name,
                ports: [
                    AnyPort::Mem(Box::new(MemPort::new(MEM_MAC_INSIDE))),
                    AnyPort::Mem(Box::new(MemPort::new(MEM_MAC_OUTSIDE))),
                ],
                nets,
                mode: Mode::Mem {
                    clock: now,
                    out: VecDeque::new(),
                    out_dropped: 0,
                },
                group: Some(group),
                nf_config: nf,
                live: None,
            },
            now,
        ))
    }

    /// Validates a context pointer from C.
    ///
    /// # Safety
    /// `p` must be null or a pointer returned by an open function and not yet closed.
    pub(crate) unsafe fn from_ptr<'a>(p: *mut PliantCtx) -> Option<&'a mut PliantCtx> {
        let c = p.as_mut()?;
        (c.magic == CTX_MAGIC).then_some(c)
    }

    pub(crate) fn invalidate(&mut self) {
        self.magic = 0;
    }

    pub(crate) fn set_error(&mut self, e: &Error) {
        self.last_error = CString::new(e.msg.replace('\0', " ")).unwrap_or_default();
    }

    pub(crate) fn now(&self) -> Instant {
        match &self.mode {
            Mode::Mem { clock, .. } => *clock,
            Mode::Live { .. } => Instant::now(),
        }
    }

    pub(crate) fn is_mem(&self) -> bool {
        matches!(self.mode, Mode::Mem { .. })
    }

    pub(crate) fn stopped(&self) -> bool {
        self.stop
            || self.engine.stop_requested()
            || (!self.is_mem() && SIGNALLED.load(Ordering::SeqCst))
    }

    pub(crate) fn request_stop(&mut self) {
        self.stop = true;
    }

    // ---- engine rounds -------------------------------------------------------------------

    /// One engine round at the context's time; mem mode collects what the ports sent.
    pub(crate) fn round(&mut self) {
        let now = self.now();
        self.engine.poll_once(now);
        let max_out = self.limits.max_mem_out;
        if let Mode::Mem {
            out, out_dropped, ..
        } = &mut self.mode
        {
            for side in [Side::Inside, Side::Outside] {
                if let AnyPort::Mem(p) = self.engine.port_mut(side) {
                    for rec in p.take_tx() {
                        if out.len() >= max_out {
                            *out_dropped += 1;
                        } else {
                            out.push_back((side, rec.frame));
                        }
                    }
                }
            }
        }
    }

    /// Moves expired timers from the adapter's queue into `timer_scratch` (for dispatch).
    pub(crate) fn take_timers(&mut self) -> Vec<(FlowKey, TimerId)> {
        let mut v = std::mem::take(&mut self.timer_scratch);
        v.clear();
        v.extend(adapter::lock(&self.queues).timers.drain(..));
        v
    }

    /// Next packet for C, if one is queued and a slot is free.
    pub(crate) fn next_packet(&mut self) -> Res<Option<*mut PliantPkt>> {
        if self.slots.free.is_empty() {
            self.stats.refused_held_full += 1;
            return Err(Error::new(
                PLIANT_EFULL,
                format!(
                    "the program holds {} packets (the bound): write or drop some first",
                    self.slots.held()
                ),
            ));
        }
        let Some(pkt) = adapter::lock(&self.queues).inbox.pop_front() else {
            return Ok(None);
        };
        match self.slots.free.pop_front() {
            Some(i) => Ok(Some(self.slots.hold(i, pkt))),
            None => {
                // Unreachable: a free slot was checked above.
                self.engine.ctx.pkt_drop(pkt, "c_held_full");
                Ok(None)
            }
        }
    }

    /// Live mode: waits in poll(2) for a port or the control socket, at most `max`.
    pub(crate) fn wait(&mut self, max: Duration) {
        let Mode::Live { wait_fds } = &self.mode else {
            return;
        };
        let mut max = max.min(Duration::from_millis(100));
        if let Some(dl) = self.engine.ctx.flows.next_deadline() {
            max = max.min(dl.saturating_duration_since(Instant::now()));
        }
        let mut fds: Vec<libc::pollfd> = wait_fds
            .iter()
            .map(|&fd| libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        let ms = c_int::try_from(max.as_millis()).unwrap_or(100);
        // SAFETY: fds is a valid array of pollfd of the given length. EINTR is fine (signals
        // set the stop flag, checked by the caller).
        unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
    }

    /// Mem mode: the next deadline at or before `target`, moving the clock to it.
    pub(crate) fn mem_step(&mut self, target: Instant) -> bool {
        let dl = self.engine.ctx.flows.next_deadline();
        let Mode::Mem { clock, .. } = &mut self.mode else {
            return false;
        };
        match dl {
            Some(dl) if dl <= target => {
                if dl > *clock {
                    *clock = dl;
                }
                true
            }
            _ => {
                *clock = target;
                false
            }
        }
    }

    // ---- packets ---------------------------------------------------------------------------

    pub(crate) fn pkt_write(&mut self, key: Option<FlowKey>, p: *mut PliantPkt) -> Res<()> {
        let pkt = self.slots.release(p, self.id)?;
        match key {
            Some(k) => self.engine.ctx.pkt_write(&k, pkt),
            None => self.engine.ctx.pkt_write_direct(pkt),
        }
        Ok(())
    }

    pub(crate) fn pkt_drop(&mut self, p: *mut PliantPkt, reason: &'static str) -> Res<()> {
        let pkt = self.slots.release(p, self.id)?;
        self.engine.ctx.pkt_drop(pkt, reason);
        Ok(())
    }

    // ---- flows -----------------------------------------------------------------------------

    pub(crate) fn create_flow(&mut self, key: FlowKey, size: usize) -> Res<()> {
        if size > self.limits.max_flow_state_bytes {
            return Err(Error::inval(format!(
                "flow state of {size} bytes exceeds the bound of {} bytes",
                self.limits.max_flow_state_bytes
            )));
        }
        Ok(self.engine.ctx.flows.create_flow(key, vec![0u8; size])?)
    }

    pub(crate) fn delete_flow(&mut self, key: &FlowKey) -> Res<()> {
        self.engine.ctx.flows.delete_flow(key)?;
        Ok(())
    }

    /// Opens a transaction; returns a pointer to the state blob (stable until the put: the
    /// blob's heap buffer never moves while the refcount pins the flow) and its length.
    pub(crate) fn get_flow(&mut self, key: FlowKey) -> Res<(*mut u8, usize)> {
        if self.open_flow_refs >= self.limits.max_open_flows {
            return Err(Error::new(
                PLIANT_EFULL,
                format!(
                    "{} flow transactions open (the bound): put some first",
                    self.open_flow_refs
                ),
            ));
        }
        let r = self.engine.ctx.flows.get_flow(&key)?;
        let st = self.engine.ctx.flows.try_state_mut(&r)?;
        let out = (st.as_mut_ptr(), st.len());
        self.flow_refs.entry(key).or_default().push(r);
        self.open_flow_refs += 1;
        Ok(out)
    }

    pub(crate) fn put_flow(&mut self, key: &FlowKey, modified: bool) -> Res<()> {
        let refs = self.flow_refs.get_mut(key);
        let Some(r) = refs.and_then(|v| v.pop()) else {
            return Err(Error::new(
                PLIANT_ENOTOPEN,
                format!("put_flow({key}) without an open get_flow for that key"),
            ));
        };
        if self.flow_refs.get(key).is_some_and(|v| v.is_empty()) {
            self.flow_refs.remove(key);
        }
        self.open_flow_refs -= 1;
        self.engine.ctx.flows.put_flow(r, modified);
        Ok(())
    }

    pub(crate) fn flow_timer(&mut self, key: &FlowKey, after_ms: u64, id: TimerId) -> Res<()> {
        let now = self.now();
        Ok(self
            .engine
            .ctx
            .flows
            .flow_timer(key, Duration::from_millis(after_ms), id, now)?)
    }

    pub(crate) fn cancel_timer(&mut self, key: &FlowKey, id: TimerId) -> Res<()> {
        Ok(self.engine.ctx.flows.cancel_timer(key, id)?)
    }

    pub(crate) fn add_alias(&mut self, key: &FlowKey, alias: FlowKey) -> Res<()> {
        Ok(self.engine.ctx.flows.add_alias(key, alias)?)
    }

    pub(crate) fn remove_alias(&mut self, alias: &FlowKey) -> Res<()> {
        Ok(self.engine.ctx.flows.remove_alias(alias)?)
    }

    /// Exports into `buf`. Callers size `buf` with [`PliantCtx::export_len`] first, so a short
    /// buffer never loses the flow; should the record still not fit, it is imported back.
    pub(crate) fn export_flow(&mut self, key: &FlowKey, buf: &mut [u8]) -> Res<usize> {
        let now = self.now();
        let bytes = self.engine.ctx.flows.export_flow(key, now)?;
        if bytes.len() > buf.len() {
            self.engine.ctx.flows.import_flow(&bytes, now)?;
            return Err(Error::new(
                PLIANT_ENOSPC,
                format!(
                    "export of {key} needs {} bytes, buffer has {}",
                    bytes.len(),
                    buf.len()
                ),
            ));
        }
        buf[..bytes.len()].copy_from_slice(&bytes);
        Ok(bytes.len())
    }

    pub(crate) fn export_len(&mut self, key: &FlowKey) -> Res<usize> {
        let now = self.now();
        Ok(self.engine.ctx.flows.snapshot_flow(key, now)?.len())
    }

    pub(crate) fn import_flow(&mut self, bytes: &[u8]) -> Res<FlowKey> {
        let now = self.now();
        Ok(self.engine.ctx.flows.import_flow(bytes, now)?)
    }

    // ---- shared ----------------------------------------------------------------------------

    pub(crate) fn create_shared(
        &mut self,
        key: &str,
        init: Vec<u8>,
        comb: PliantCombinerFn,
    ) -> Res<()> {
        let combiner = match comb {
            None => None,
            Some(f) => Some(crate::combiner::register(f).ok_or_else(|| {
                Error::new(
                    PLIANT_EFULL,
                    format!(
                        "more than {} distinct C combiner functions",
                        crate::combiner::MAX_C_COMBINERS
                    ),
                )
            })?),
        };
        Ok(self.engine.ctx.shared.create_shared(key, init, combiner)?)
    }

    pub(crate) fn delete_shared(&mut self, key: &str) -> Res<()> {
        Ok(self.engine.ctx.shared.delete_shared(key)?)
    }

    pub(crate) fn get_shared(&mut self, key: &str, flags: c_int) -> Res<PliantShared> {
        let flags = match flags {
            PLIANT_GET_LOCAL => GetFlags::Local,
            PLIANT_GET_PULL => GetFlags::Pull,
            PLIANT_GET_SYNCH => GetFlags::Synch,
            f => return Err(Error::inval(format!("unknown get_shared flags {f}"))),
        };
        if self.open_shared_refs >= self.limits.max_open_shared {
            return Err(Error::new(
                PLIANT_EFULL,
                "too many open shared transactions: put some first",
            ));
        }
        let now = self.now();
        let shared = &mut self.engine.ctx.shared;
        shared.set_now(now);
        let r = shared.get_shared(key, flags)?;
        // The view is either inside `r` (PULL: a heap Vec that moves with `r` without
        // reallocating) or the entry's value; neither buffer moves until the put.
        let (view, view_len) = {
            let v = shared.try_value(&r)?;
            (v.as_ptr(), v.len())
        };
        let (value, value_len) = {
            let v = shared.try_value_mut(&r)?;
            (v.as_mut_ptr(), v.len())
        };
        self.shared_refs.entry(key.to_string()).or_default().push(r);
        self.open_shared_refs += 1;
        Ok(PliantShared {
            view,
            view_len,
            value,
            value_len,
        })
    }

    pub(crate) fn put_shared(&mut self, key: &str, flags: c_int) -> Res<()> {
        let flags = match flags {
            PLIANT_PUT_LOCAL => PutFlags::Local,
            PLIANT_PUT_PUSH => PutFlags::Push,
            PLIANT_PUT_SYNCH => PutFlags::Synch,
            f => return Err(Error::inval(format!("unknown put_shared flags {f}"))),
        };
        let Some(r) = self.shared_refs.get_mut(key).and_then(|v| v.pop()) else {
            return Err(Error::new(
                PLIANT_ENOTOPEN,
                format!("put_shared({key:?}) without an open get_shared for that key"),
            ));
        };
        if self.shared_refs.get(key).is_some_and(|v| v.is_empty()) {
            self.shared_refs.remove(key);
        }
        self.open_shared_refs -= 1;
        let now = self.now();
        self.engine.ctx.shared.set_now(now);
        Ok(self.engine.ctx.shared.put_shared(r, flags)?)
    }

    // ---- counters, config, mem ---------------------------------------------------------------

    pub(crate) fn config_int(&self, name: &str) -> Res<i64> {
        match self.nf_config.get(name) {
            Some(toml::Value::Integer(i)) => Ok(*i),
            Some(v) => Err(Error::inval(format!(
                "[c].{name} is a {}, not an integer",
                v.type_str()
            ))),
            None => Err(Error::new(PLIANT_ENOTFOUND, format!("[c].{name} not set"))),
        }
    }

    pub(crate) fn mem_inject(&mut self, side: Side, frame: &[u8]) -> Res<()> {
        if !self.is_mem() {
            return Err(Error::inval("not an in-memory context"));
        }
        match self.engine.port_mut(side) {
            AnyPort::Mem(p) => {
                if p.inject(frame) {
                    Ok(())
                } else {
                    Err(Error::new(PLIANT_EFULL, "in-memory RX queue full"))
                }
            }
            AnyPort::Packet(_) => Err(Error::inval("not an in-memory context")),
        }
    }

    /// Pops the oldest transmitted frame if it fits in `cap` bytes.
    pub(crate) fn mem_take(&mut self, cap: usize) -> Res<(Side, Vec<u8>)> {
        let Mode::Mem { out, .. } = &mut self.mode else {
            return Err(Error::inval("not an in-memory context"));
        };
        let Some((_, f)) = out.front() else {
            return Err(Error::new(PLIANT_ENOTFOUND, "no transmitted frame queued"));
        };
        if f.len() > cap {
            return Err(Error::new(
                PLIANT_ENOSPC,
                format!("frame of {} bytes, buffer of {cap}", f.len()),
            ));
        }
        out.pop_front()
            .ok_or_else(|| Error::new(PLIANT_ENOTFOUND, "no transmitted frame queued"))
    }

    pub(crate) fn mem_front_len(&self) -> Option<usize> {
        match &self.mode {
            Mode::Mem { out, .. } => out.front().map(|f| f.1.len()),
            Mode::Live { .. } => None,
        }
    }

    /// Teaches the router role that `ip` is at `mac` on `side` (an ARP request from that
    /// host, as a real neighbour would send), and discards the router's ARP reply.
    pub(crate) fn mem_learn(
        &mut self,
        side: Side,
        ip: std::net::Ipv4Addr,
        mac: [u8; 6],
    ) -> Res<()> {
        let target = self.own_v4[side_idx(side)].ok_or_else(|| {
            Error::inval("this side has no IPv4 address to address an ARP request to")
        })?;
        let req = pliant_net::arp::request(mac, ip, target, None);
        self.mem_inject(side, &req)?;
        self.round();
        if let Mode::Mem { out, .. } = &mut self.mode {
            out.retain(|(s, f)| {
                !(*s == side
                    && f.len() >= 14
                    && f[12..14] == pliant_net::ETHERTYPE_ARP.to_be_bytes())
            });
        }
        if self.engine.neighbours(side).lookup(ip.into()) != Some(mac) {
            return Err(Error::inval(format!(
                "{ip} was not learned (not in a connected subnet of this side?)"
            )));
        }
        Ok(())
    }

    pub(crate) fn count(&mut self, name: &'static str, n: u64) {
        self.engine.ctx.count(name, n);
    }

    #[cfg(test)]
    pub(crate) fn open_refs(&self) -> (usize, usize, usize) {
        (
            self.open_flow_refs,
            self.open_shared_refs,
            self.slots.held(),
        )
    }
}
