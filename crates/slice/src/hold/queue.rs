//! The queueing hold: the client's segments of a held connection are kept, not dropped, and
//! written back in their order on release, so the client never has to retransmit them.
//!
//! This kernel has neither nft_queue nor iptables (no NFQUEUE), so the queue is built from what
//! it has (tc-BPF as TCX links, or clsact filters on a kernel without TCX; veth, packet
//! sockets):
//! ```text
//!   lo ingress (and every other interface present at creation): pliant_slice_hold
//!   (bpf/slice_hold.bpf.c)
//!     held 4-tuple -> bpf_redirect to the egress of veth <name>a
//!                       packet socket on <name>a reads it (taps see a frame before the
//!                       device sends it) and keeps it in its receive buffer;
//!                       <name>b's ingress (pliant_slice_hold_sink) drops what arrives
//!     otherwise    -> next filter / the stack
//!   release: the kept packets of the connection, checksum completed, are sent through a raw
//!   IP socket marked REINJECT_MARK (the route to a local address is loopback), which the
//!   program lets through, then the key goes.
//! ```
//! Why a raw IP socket and not the packet socket on lo: a frame written on lo arrives without
//! a route, and the input route lookup refuses 127/8 on any device (martian, drop reason
//! IP_LOCALNET) unless the receiving socket already caches an input route. A restored socket
//! has none until its first segment arrives, so every written-back frame was dropped and the
//! client had to retransmit it all the same (found with the kfree_skb tracepoint). A packet
//! sent through the output path carries its route to the stack on the other side of lo.
//! The program and the maps belong to this process (aya, like crates/steer); the filters and the
//! veth pair go with the hold. A frame is charged to its connection in the BPF map before it is
//! redirected, and the key is removed with BPF_MAP_LOOKUP_AND_DELETE_ELEM, so the release knows
//! how many frames to wait for (the last ones may still be on their way to the socket).
//!
//! Bounds ([`QueueBounds`]): per connection 8,192 frames and 32 MiB (beyond: dropped in the
//! program and counted, the client retransmits those); all connections together the packet
//! socket's receive buffer (`RCVBUF`; beyond: the kernel drops, counted as `socket_drops`).

use super::frames::{complete_tcp_checksum, covered, segment, seq_ge, Key, ETH_HLEN};
use super::HoldError;
use aya::maps::{Array, HashMap, IterableMap, MapData};
use aya::programs::tc::{self, NlOptions, SchedClassifier, TcAttachOptions, TcAttachType};
use aya::programs::LinkOrder;
use aya::{Ebpf, EbpfLoader};
use std::collections::{HashMap as Map, VecDeque};
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/slice_hold.bpf.o"));
const PROGRAM: &str = "pliant_slice_hold";
const SINK: &str = "pliant_slice_hold_sink";
const LAYOUT_VERSION: u32 = 2;
/// tc filter priority of the hold's filters (steering uses 10).
const TC_PRIORITY: u16 = 20;
/// skb mark of the frames written back; the program lets them through.
pub(super) const REINJECT_MARK: u32 = 0x534c_4943; // "SLIC"
/// How much the queue keeps per held connection; beyond, segments are dropped and counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueBounds {
    pub packets: u32,
    pub bytes: u32,
}

impl Default for QueueBounds {
    fn default() -> Self {
        // More than a client can have in flight into any window this crate's sockets
        // advertise on loopback in practice (4 MiB in flight in the bench's bulk flow).
        QueueBounds {
            packets: 8192,
            bytes: 32 << 20,
        }
    }
}

const RCVBUF: libc::c_int = 64 << 20;
/// Longest frame on loopback (MTU 65536) and its Ethernet header.
const FRAME_MAX: usize = 65536 + 14;
/// How long a release waits for frames charged to its connection that have not reached the
/// packet socket yet (they are microseconds behind; this bounds a frame lost in between).
const STRAGGLER_WAIT: Duration = Duration::from_millis(20);

/// Layout = `struct hold_val`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct Val {
    packets: u32,
    bytes: u32,
    over: u32,
    pad: u32,
}
// SAFETY: four u32, no padding.
unsafe impl aya::Pod for Val {}

/// Layout = `struct hold_config`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct Config {
    queue_ifindex: u32,
    max_packets: u32,
    max_bytes: u32,
    reinject_mark: u32,
}
// SAFETY: four u32, no padding.
unsafe impl aya::Pod for Config {}

/// Layout = `struct commit_val` (written here only).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct CommitVal {
    covered_seq: u32,
    covered_ack: u32,
    released: u32,
    /// `GUARDED`: nothing is covered yet.
    flags: u32,
}

const GUARDED: u32 = 1;
// SAFETY: four u32, no padding.
unsafe impl aya::Pod for CommitVal {}

/// Layout = `struct commit_cnt` (written by the program only).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct CommitCnt {
    queued: u32,
    passed: u32,
    resets: u32,
    over: u32,
    left_end: u32,
    left_ack: u32,
    left_flags: u32,
    orphans: u32,
    mirrored: u32,
    pad: [u32; 3],
}
// SAFETY: twelve u32, no padding.
unsafe impl aya::Pod for CommitCnt {}

/// What output commit did since the hold was created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CommitStats {
    /// Connections whose output is committed now.
    pub protected: u64,
    /// Segments let through at once (covered when sent, nothing queued before them).
    pub passed: u64,
    /// Segments queued, then written back once covered.
    pub released: u64,
    /// Queued segments dropped when their connection's protection ended without a flush
    /// (a failover: the restored socket sends that output again).
    pub dropped: u64,
    /// RSTs of protected connections that never left.
    pub resets: u64,
    /// Segments dropped beyond a connection's bound (the sender's kernel retransmits them).
    pub over_limit: u64,
    /// Client segments queued while no socket owned their protected connection (the
    /// primary had died), written back once the backup restored it.
    pub orphans: u64,
    /// Client segments carrying input copied to the queue (kept until a checkpoint covers
    /// them, written to the restored socket at a takeover).
    pub mirrored: u64,
}

/// How far a protected connection's output that left went: the highest end of its data and
/// the highest acknowledgment it carried (`None`: nothing of the kind left).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Left {
    pub end: Option<u32>,
    pub ack: Option<u32>,
    /// The highest acknowledgment the client's own segments carried (the client's word for
    /// how much output it has received, a lower bound of it).
    pub peer_ack: Option<u32>,
}

fn later(cur: Option<u32>, v: u32) -> Option<u32> {
    Some(cur.map_or(v, |c| if seq_ge(c, v) { c } else { v }))
}

impl Left {
    fn note(&mut self, end: u32, ack: Option<u32>) {
        self.end = later(self.end, end);
        if let Some(a) = ack {
            self.ack = later(self.ack, a);
        }
    }

    fn merge(&mut self, o: Left) {
        if let Some(e) = o.end {
            self.end = later(self.end, e);
        }
        if let Some(a) = o.ack {
            self.ack = later(self.ack, a);
        }
        if let Some(p) = o.peer_ack {
            self.peer_ack = later(self.peer_ack, p);
        }
    }

    /// Whether everything that left is within `covered_seq` / `covered_ack`.
    pub fn within(&self, covered_seq: u32, covered_ack: u32) -> bool {
        self.end.is_none_or(|e| seq_ge(covered_seq, e))
            && self.ack.is_none_or(|a| seq_ge(covered_ack, a))
    }
}

/// The output-commit maps: the covered marks (written here) and the program's counters.
type CommitMaps = (
    HashMap<MapData, Key, CommitVal>,
    HashMap<MapData, Key, CommitCnt>,
);

/// A protected connection's queued output and how far the backup covers it.
#[derive(Default)]
struct Committed {
    /// Nothing is covered yet (see [`QueueHold::protect_with`]).
    guarded: bool,
    /// What this queue wrote back (the program keeps what it let through).
    left: Left,
    covered_seq: u32,
    covered_ack: u32,
    /// Frames taken off the queue so far (written back or dropped): the program lets a
    /// segment through at once only when this equals its count of queued ones.
    released: u32,
    frames: VecDeque<Vec<u8>>,
}

/// What the queue did since it was created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QueueStats {
    /// Frames kept and written back.
    pub reinjected: u64,
    /// Frames dropped by the program beyond a connection's bound.
    pub over_limit: u64,
    /// Frames charged to a released connection that never reached the socket in time.
    pub missing: u64,
    /// Frames the kernel dropped because the packet socket's buffer was full.
    pub socket_drops: u64,
}

#[derive(Default)]
struct Counters {
    reinjected: AtomicU64,
    over_limit: AtomicU64,
    missing: AtomicU64,
    socket_drops: AtomicU64,
    commit_released: AtomicU64,
    commit_dropped: AtomicU64,
    /// Program counters of connections no longer protected.
    commit_retired: Mutex<CommitCnt>,
}

/// Frames read from the socket, per connection, until that connection's release.
struct Queue {
    rx: OwnedFd,
    /// Raw IP sockets (header included) of each family, for writing packets back.
    tx4: OwnedFd,
    tx6: OwnedFd,
    frames: Map<Key, Vec<Vec<u8>>>,
    /// Output of protected connections (server -> client keys).
    committed: Map<Key, Committed>,
    /// Input of protected connections (client -> server keys) not yet covered.
    inputs: Map<Key, VecDeque<Vec<u8>>>,
    /// Frames written back per connection being released.
    sent: Map<Key, u32>,
    buf: Vec<u8>,
}

pub(super) struct QueueHold {
    name: String,
    netns: OwnedFd,
    ebpf: Option<Ebpf>,
    /// The interfaces whose ingress the hold's program filters (the hold's own veth aside).
    devs: Vec<String>,
    held: Mutex<HashMap<MapData, Key, Val>>,
    commit: Mutex<CommitMaps>,
    queue: Mutex<Queue>,
    /// The packet socket (owned by `queue`), to wait on without its lock.
    rx_fd: RawFd,
    counters: Counters,
}

impl std::fmt::Debug for QueueHold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueueHold")
            .field("name", &self.name)
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn bpf_err(what: &str) -> impl FnOnce(String) -> HoldError + '_ {
    move |e| HoldError::Bpf(format!("{what}: {e}"))
}

fn sys(op: &'static str) -> impl FnOnce(io::Error) -> HoldError {
    move |source| HoldError::Sys { op, source }
}

fn ip(args: &[&str]) -> Result<(), HoldError> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|source| HoldError::Spawn { cmd: "ip", source })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(HoldError::Command {
            what: format!("ip {}", args.join(" ")),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        })
    }
}

fn ifindex(name: &str) -> Result<i32, HoldError> {
    let c = std::ffi::CString::new(name).expect("interface names have no NUL");
    // SAFETY: `c` is a valid NUL-terminated string.
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if i == 0 {
        Err(sys("if_nametoindex")(io::Error::last_os_error()))
    } else {
        Ok(i as i32)
    }
}

/// The names of the calling thread's network namespace's interfaces.
/// Deletes the clsact qdisc of `dev` once no filter is left on it, in either direction. A
/// hold adds the qdisc where there is none (and several holds share one on lo); the last one
/// out removes it, so a host does not keep a qdisc on its interfaces for every server that
/// ever held a session. A qdisc with someone else's filters stays; so does one whose filters
/// cannot be listed. An empty clsact does nothing, so one a user made on purpose and left
/// empty is no loss either.
fn remove_empty_clsact(dev: &str) {
    let filters = |dir: &str| {
        Command::new("tc")
            .args(["filter", "show", "dev", dev, dir])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| o.stdout.iter().all(u8::is_ascii_whitespace))
    };
    if filters("ingress") == Some(true) && filters("egress") == Some(true) {
        let _ = Command::new("tc")
            .args(["qdisc", "del", "dev", dev, "clsact"])
            .output();
    }
}

fn interfaces() -> Vec<String> {
    // SAFETY: if_nameindex returns an array ending with a zero entry, freed below.
    let list = unsafe { libc::if_nameindex() };
    if list.is_null() {
        return Vec::new();
    }
    let mut names = Vec::new();
    let mut i = 0;
    loop {
        // SAFETY: within the array, up to and including its zero terminator.
        let e = unsafe { &*list.add(i) };
        if e.if_index == 0 || e.if_name.is_null() {
            break;
        }
        // SAFETY: a NUL-terminated name owned by the array.
        let n = unsafe { std::ffi::CStr::from_ptr(e.if_name) };
        names.push(n.to_string_lossy().into_owned());
        i += 1;
    }
    // SAFETY: the array if_nameindex returned, freed once.
    unsafe { libc::if_freenameindex(list) };
    names
}

fn open_ns() -> Result<OwnedFd, HoldError> {
    let f = std::fs::File::open("/proc/thread-self/ns/net").map_err(sys("open netns"))?;
    Ok(OwnedFd::from(f))
}

fn setsockopt_int(fd: &OwnedFd, level: i32, opt: i32, v: libc::c_int) -> io::Result<()> {
    // SAFETY: `v` is an int that lives for the call.
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            opt,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// A raw socket of `family` that sends whole IP packets (IPPROTO_RAW: header included),
/// marked so the hold's program lets them through.
fn raw_socket(family: libc::c_int) -> io::Result<OwnedFd> {
    // SAFETY: plain socket creation.
    let fd = unsafe {
        libc::socket(
            family,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::IPPROTO_RAW,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor we own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    setsockopt_int(&fd, libc::SOL_SOCKET, libc::SO_MARK, REINJECT_MARK as i32)?;
    Ok(fd)
}

fn packet_socket(ifindex: i32, protocol: u16, flags: i32) -> io::Result<OwnedFd> {
    let proto_be = protocol.to_be();
    // SAFETY: plain socket creation.
    let fd = unsafe {
        libc::socket(
            libc::AF_PACKET,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC | flags,
            libc::c_int::from(proto_be),
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor we own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: zeroed sockaddr_ll is valid; the fields that matter are set below.
    let mut sa: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    sa.sll_family = libc::AF_PACKET as u16;
    sa.sll_protocol = proto_be;
    sa.sll_ifindex = ifindex;
    // SAFETY: `sa` is a sockaddr_ll of the size given.
    let r = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&sa as *const libc::sockaddr_ll).cast(),
            std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// BPF_MAP_LOOKUP_AND_DELETE_ELEM (aya 0.14 has no call for it on hash maps): the entry's last
/// value and its removal in one step, so no frame is charged between the two.
fn lookup_and_delete(map: &MapData, key: &Key) -> io::Result<Val> {
    lookup_and_delete_in(map, key)
}

fn lookup_and_delete_in<V: aya::Pod + Default>(map: &MapData, key: &Key) -> io::Result<V> {
    const BPF_MAP_LOOKUP_AND_DELETE_ELEM: libc::c_long = 21;
    let mut val = V::default();
    // union bpf_attr for map element commands: map_fd u32, pad, key u64, value u64, flags u64.
    let mut attr = [0u8; 32];
    let fd = map.fd().as_fd().as_raw_fd() as u32;
    attr[0..4].copy_from_slice(&fd.to_ne_bytes());
    attr[8..16].copy_from_slice(&(key as *const Key as u64).to_ne_bytes());
    attr[16..24].copy_from_slice(&(&mut val as *mut V as u64).to_ne_bytes());
    // SAFETY: attr is a bpf_attr prefix whose pointers (key, val) outlive the call.
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_MAP_LOOKUP_AND_DELETE_ELEM,
            attr.as_ptr(),
            attr.len() as libc::c_uint,
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(val)
    }
}

/// Runs `f` on a thread in the network namespace `ns`: the filters are detached and the veth
/// deleted by interface index or name in the *current* namespace, which may not be the one the
/// hold was created in (a test's instance created on a thread of another namespace). When the
/// thread cannot enter it, `f` does not run and is handed back: run elsewhere it would detach
/// by index in the wrong namespace (loopback is index 1 in every one).
fn in_netns<T: Send, F: FnOnce() -> T + Send>(ns: &OwnedFd, f: F) -> Result<T, (io::Error, F)> {
    std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: setns on this helper thread only.
            if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err((io::Error::last_os_error(), f));
            }
            Ok(f())
        })
        .join()
        .unwrap_or_else(|_| panic!("dropping a packet hold panicked"))
    })
}

impl QueueHold {
    pub(super) fn create(tag: &str, bounds: QueueBounds) -> Result<QueueHold, HoldError> {
        static N: AtomicU64 = AtomicU64::new(0);
        let _ = tag; // interface names are 15 bytes: no room for the tag
        let name = format!(
            "psh{:x}{:x}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        );
        let (a, b) = (format!("{name}a"), format!("{name}b"));
        let netns = open_ns()?;
        ip(&["link", "add", &a, "type", "veth", "peer", "name", &b])?;
        // From here on a failure deletes the pair (with it the filter on b).
        let made = (|| {
            ip(&["link", "set", &a, "up"])?;
            ip(&["link", "set", &b, "up"])?;
            QueueHold::load(&name, &a, &b, netns, bounds)
        })();
        if made.is_err() {
            let _ = ip(&["link", "del", &a]);
        }
        made
    }

    fn load(
        name: &str,
        a: &str,
        b: &str,
        netns: OwnedFd,
        bounds: QueueBounds,
    ) -> Result<QueueHold, HoldError> {
        let ia = ifindex(a)?;
        let rx = packet_socket(ia, libc::ETH_P_ALL as u16, libc::SOCK_NONBLOCK)
            .map_err(sys("packet socket on the hold veth"))?;
        setsockopt_int(&rx, libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, RCVBUF)
            .map_err(sys("SO_RCVBUFFORCE"))?;
        let tx4 = raw_socket(libc::AF_INET).map_err(sys("raw IPv4 socket"))?;
        let tx6 = raw_socket(libc::AF_INET6).map_err(sys("raw IPv6 socket"))?;

        let mut ebpf = EbpfLoader::new()
            .load(OBJECT)
            .map_err(|e| HoldError::Bpf(format!("loading: {e}")))?;
        let mut cfg: Array<MapData, Config> = Array::try_from(
            ebpf.take_map("config")
                .ok_or_else(|| HoldError::Bpf("no map config".into()))?,
        )
        .map_err(|e| bpf_err("map config")(e.to_string()))?;
        cfg.set(
            0,
            Config {
                queue_ifindex: ia as u32,
                max_packets: bounds.packets,
                max_bytes: bounds.bytes,
                reinject_mark: REINJECT_MARK,
            },
            0,
        )
        .map_err(|e| bpf_err("config")(e.to_string()))?;
        let held: HashMap<MapData, Key, Val> = HashMap::try_from(
            ebpf.take_map("held")
                .ok_or_else(|| HoldError::Bpf("no map held".into()))?,
        )
        .map_err(|e| bpf_err("map held")(e.to_string()))?;
        let commit: HashMap<MapData, Key, CommitVal> = HashMap::try_from(
            ebpf.take_map("commit")
                .ok_or_else(|| HoldError::Bpf("no map commit".into()))?,
        )
        .map_err(|e| bpf_err("map commit")(e.to_string()))?;
        let commit_cnt: HashMap<MapData, Key, CommitCnt> = HashMap::try_from(
            ebpf.take_map("commit_cnt")
                .ok_or_else(|| HoldError::Bpf("no map commit_cnt".into()))?,
        )
        .map_err(|e| bpf_err("map commit_cnt")(e.to_string()))?;
        let version = u32_symbol(OBJECT, "hold_layout_version");
        if version != Some(LAYOUT_VERSION) {
            return Err(HoldError::Bpf(format!(
                "object layout {version:?}, loader {LAYOUT_VERSION}"
            )));
        }
        // Every interface the client's segments may arrive on: loopback first, then the
        // others present now (not the holds' own veths). An interface added later is not
        // covered.
        let mut devs = vec![(SINK, b.to_string()), (PROGRAM, "lo".to_string())];
        devs.extend(
            interfaces()
                .into_iter()
                .filter(|n| n != "lo" && !n.starts_with("psh"))
                .map(|n| (PROGRAM, n)),
        );
        for prog in [SINK, PROGRAM] {
            let p: &mut SchedClassifier = ebpf
                .program_mut(prog)
                .ok_or_else(|| HoldError::Bpf(format!("no program {prog}")))?
                .try_into()
                .map_err(|e: aya::programs::ProgramError| bpf_err(prog)(e.to_string()))?;
            p.load().map_err(|e| bpf_err(prog)(format!("load: {e}")))?;
        }
        // TCX links (Linux 6.6+) where the kernel has them: a link lives as long as this
        // process holds its descriptor, so a process killed without running its destructors
        // (a SIGKILLed backup instance, say) takes its program off the interfaces with it.
        // A tc filter attached through netlink stays after its process, and kept diverting
        // the connections it held to a queue nobody read. Netlink (classic clsact filters)
        // only where TCX is refused.
        let mut tcx = true;
        for (i, (prog, dev)) in devs.iter().enumerate() {
            let p: &mut SchedClassifier = ebpf
                .program_mut(prog)
                .ok_or_else(|| HoldError::Bpf(format!("no program {prog}")))?
                .try_into()
                .map_err(|e: aya::programs::ProgramError| bpf_err(prog)(e.to_string()))?;
            if tcx {
                let r = p.attach_with_options(
                    dev,
                    TcAttachType::Ingress,
                    TcAttachOptions::TcxOrder(LinkOrder::default()),
                );
                match r {
                    Ok(_) => continue,
                    // Only the first attach decides: all links are of one kind.
                    Err(e) if i == 0 => {
                        tracing::info!(error = %e, "TCX refused: classic tc filters instead");
                        tcx = false;
                    }
                    Err(e) => return Err(bpf_err(prog)(format!("attach to {dev}: {e}"))),
                }
            }
            // An existing clsact qdisc (another instance's hold on lo) is fine.
            let _ = tc::qdisc_add_clsact(dev);
            p.attach_with_options(
                dev,
                TcAttachType::Ingress,
                TcAttachOptions::Netlink(NlOptions {
                    priority: TC_PRIORITY,
                    ..Default::default()
                }),
            )
            .map_err(|e| bpf_err(prog)(format!("attach to {dev}: {e}")))?;
        }
        Ok(QueueHold {
            name: name.to_string(),
            netns,
            ebpf: Some(ebpf),
            // Interfaces whose clsact qdisc the hold may have added (none with TCX).
            devs: devs
                .into_iter()
                .filter(|(prog, _)| *prog == PROGRAM && !tcx)
                .map(|(_, d)| d)
                .collect(),
            held: Mutex::new(held),
            commit: Mutex::new((commit, commit_cnt)),
            rx_fd: rx.as_raw_fd(),
            queue: Mutex::new(Queue {
                rx,
                tx4,
                tx6,
                frames: Map::new(),
                committed: Map::new(),
                inputs: Map::new(),
                sent: Map::new(),
                buf: vec![0u8; FRAME_MAX + 1],
            }),
            counters: Counters::default(),
        })
    }

    pub(super) fn name(&self) -> &str {
        &self.name
    }

    pub(super) fn hold(&self, conns: &[(SocketAddr, SocketAddr)]) -> Result<(), HoldError> {
        const BPF_NOEXIST: u64 = 1;
        let mut held = lock(&self.held);
        for (i, (l, r)) in conns.iter().enumerate() {
            let k = Key::of(l, r);
            if let Err(e) = held.insert(k, Val::default(), BPF_NOEXIST) {
                // All or none: the ones added before are taken back (nothing was queued for
                // them that matters: their owner has not been captured yet).
                for (l, r) in &conns[..i] {
                    let _ = held.remove(&Key::of(l, r));
                }
                return Err(match e {
                    aya::maps::MapError::SyscallError(s)
                        if s.io_error.raw_os_error() == Some(libc::EEXIST) =>
                    {
                        HoldError::AlreadyHeld(k.describe())
                    }
                    e => HoldError::Bpf(format!("hold {}: {e}", k.describe())),
                });
            }
        }
        Ok(())
    }

    /// Writes back what was kept for each connection, in order, then lets its segments pass.
    /// Releasing a connection not held is an error (after the others were released).
    pub(super) fn release(&self, conns: &[(SocketAddr, SocketAddr)]) -> Result<(), HoldError> {
        let keys: Vec<Key> = conns.iter().map(|(l, r)| Key::of(l, r)).collect();
        let mut q = lock(&self.queue);
        // What arrived so far goes back while the keys still hold: a segment the client sends
        // meanwhile is queued behind them, not overtaking them.
        q.drain(&self.counters)?;
        for k in &keys {
            q.reinject(k, &self.counters);
        }
        let mut owed: Map<Key, u32> = Map::new();
        let mut missing = None;
        {
            let held = lock(&self.held);
            for k in &keys {
                match lookup_and_delete(IterableMap::map(&*held), k) {
                    Ok(v) => {
                        self.counters
                            .over_limit
                            .fetch_add(u64::from(v.over), Ordering::Relaxed);
                        owed.insert(*k, v.packets);
                    }
                    Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                        missing.get_or_insert_with(|| k.describe());
                    }
                    Err(e) => return Err(sys("BPF_MAP_LOOKUP_AND_DELETE_ELEM")(e)),
                }
            }
        }
        // Frames charged to a key before its removal may still be on their way.
        let deadline = Instant::now() + STRAGGLER_WAIT;
        loop {
            owed.retain(|k, n| {
                let got = q.sent.get(k).copied().unwrap_or(0);
                got < *n
            });
            if owed.is_empty() {
                break;
            }
            if Instant::now() >= deadline {
                let short: u64 = owed
                    .iter()
                    .map(|(k, n)| u64::from(n - q.sent.get(k).copied().unwrap_or(0)))
                    .sum();
                self.counters.missing.fetch_add(short, Ordering::Relaxed);
                break;
            }
            q.wait_readable(Duration::from_millis(1));
            q.drain(&self.counters)?;
            for k in owed.keys() {
                q.reinject(k, &self.counters);
            }
        }
        for k in &keys {
            q.sent.remove(k);
            q.frames.remove(k);
        }
        // Frames of connections no longer held arrived after their release gave up waiting:
        // their socket exists, so they go now rather than stay here (counted as missing
        // then; the client may have retransmitted them meanwhile, a duplicate is harmless).
        let late: Vec<Key> = {
            let held = lock(&self.held);
            q.frames
                .keys()
                .filter(|k| held.get(k, 0).is_err())
                .copied()
                .collect()
        };
        for k in &late {
            q.reinject(k, &self.counters);
            q.sent.remove(k);
        }
        match missing {
            Some(m) => Err(HoldError::NotHeld(m)),
            None => Ok(()),
        }
    }

    /// Starts output commit for connections `(key, covered_seq, covered_ack)` (server ->
    /// client keys): from now on their segments leave only as the rule of
    /// [`super::frames::covered`] allows. All or none.
    pub(super) fn protect(&self, conns: &[(Key, u32, u32)]) -> Result<(), HoldError> {
        self.protect_with(conns, false)
    }

    /// [`QueueHold::protect`]; `guarded`: nothing covered until the first `cover`.
    pub(super) fn protect_with(
        &self,
        conns: &[(Key, u32, u32)],
        guarded: bool,
    ) -> Result<(), HoldError> {
        const BPF_NOEXIST: u64 = 1;
        let mut q = lock(&self.queue);
        let mut m = lock(&self.commit);
        for (i, (k, seq, ack)) in conns.iter().enumerate() {
            let val = CommitVal {
                covered_seq: *seq,
                covered_ack: *ack,
                flags: if guarded { GUARDED } else { 0 },
                ..CommitVal::default()
            };
            // The counters first: the program drops a segment whose value has no counters.
            let r =
                m.1.insert(*k, CommitCnt::default(), BPF_NOEXIST)
                    .and_then(|_| m.0.insert(*k, val, BPF_NOEXIST));
            if let Err(e) = r {
                let _ = m.1.remove(k);
                for (k, _, _) in &conns[..i] {
                    let _ = m.0.remove(k);
                    let _ = m.1.remove(k);
                    q.committed.remove(k);
                    q.inputs.remove(&k.reversed());
                }
                return Err(match e {
                    aya::maps::MapError::SyscallError(s)
                        if s.io_error.raw_os_error() == Some(libc::EEXIST) =>
                    {
                        HoldError::AlreadyHeld(k.describe())
                    }
                    e => HoldError::Bpf(format!("protect {}: {e}", k.describe())),
                });
            }
            q.inputs.insert(k.reversed(), VecDeque::new());
            q.committed.insert(
                *k,
                Committed {
                    covered_seq: *seq,
                    covered_ack: *ack,
                    guarded,
                    ..Committed::default()
                },
            );
        }
        Ok(())
    }

    /// Moves the covered marks of protected connections forward (never back) and writes back
    /// their queued output that is covered now, in order.
    pub(super) fn cover(&self, updates: &[(Key, u32, u32)]) -> Result<(), HoldError> {
        let mut q = lock(&self.queue);
        q.drain(&self.counters)?;
        let m = lock(&self.commit);
        let mut commit = m;
        for (k, seq, ack) in updates {
            let Some(c) = q.committed.get_mut(k) else {
                continue;
            };
            if c.guarded {
                // The first marks: set, not moved (there is nothing to compare with).
                (c.covered_seq, c.covered_ack, c.guarded) = (*seq, *ack, false);
            }
            if seq_ge(*seq, c.covered_seq) {
                c.covered_seq = *seq;
            }
            if seq_ge(*ack, c.covered_ack) {
                c.covered_ack = *ack;
            }
            q.release_covered(k, &mut commit.0, &self.counters);
        }
        Ok(())
    }

    /// Writes back whatever queued output is covered now (segments that reached the queue
    /// after the checkpoint covering them was applied).
    pub(super) fn sweep(&self) -> Result<(), HoldError> {
        let mut q = lock(&self.queue);
        q.drain(&self.counters)?;
        let waiting: Vec<Key> = q
            .committed
            .iter()
            .filter(|(_, c)| !c.frames.is_empty())
            .map(|(k, _)| *k)
            .collect();
        if waiting.is_empty() {
            return Ok(());
        }
        let mut commit = lock(&self.commit);
        for k in &waiting {
            q.release_covered(k, &mut commit.0, &self.counters);
        }
        Ok(())
    }

    /// Waits (at most `t`) for a frame to reach the queue.
    pub(super) fn wait_frames(&self, t: Duration) {
        let mut p = libc::pollfd {
            fd: self.rx_fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd; the socket lives as long as `self`.
        unsafe { libc::poll(&mut p, 1, t.as_millis() as libc::c_int) };
    }

    /// Ends output commit for these connections. `flush`: their queued output goes out (the
    /// session ended or left: nothing will send it again); otherwise it is dropped (a
    /// failover: the restored socket sends it again). Unknown keys are skipped.
    /// Returns, per key, how far the output that left before went (the audit's record).
    pub(super) fn unprotect(&self, keys: &[Key], flush: bool) -> Result<Vec<Left>, HoldError> {
        let mut q = lock(&self.queue);
        q.drain(&self.counters)?;
        let mut owed: Map<Key, u32> = Map::new();
        let mut passed: Map<Key, Left> = Map::new();
        {
            let mut m = lock(&self.commit);
            let mut retired = lock(&self.counters.commit_retired);
            for k in keys {
                // The value first: without it the program lets the segments through.
                let _ = m.0.remove(k);
                if let Ok(n) = lookup_and_delete_in::<CommitCnt>(IterableMap::map(&m.1), k) {
                    retired.queued += n.queued;
                    retired.passed += n.passed;
                    retired.resets += n.resets;
                    retired.over += n.over;
                    retired.orphans += n.orphans;
                    retired.mirrored += n.mirrored;
                    owed.insert(*k, n.queued);
                    let mut l = Left::default();
                    if n.left_flags & 1 != 0 {
                        l.end = Some(n.left_end);
                    }
                    if n.left_flags & 2 != 0 {
                        l.ack = Some(n.left_ack);
                    }
                    passed.insert(*k, l);
                }
            }
        }
        if flush {
            // Segments charged before the removal may still be on their way.
            let deadline = Instant::now() + STRAGGLER_WAIT;
            loop {
                owed.retain(|k, n| {
                    q.committed
                        .get(k)
                        .is_some_and(|c| c.released + (c.frames.len() as u32) < *n)
                });
                if owed.is_empty() || Instant::now() >= deadline {
                    break;
                }
                q.wait_readable(Duration::from_millis(1));
                q.drain(&self.counters)?;
            }
        }
        let mut left = Vec::with_capacity(keys.len());
        for k in keys {
            // The input copies: written to the restored socket ahead of anything held since
            // (a failover), or no longer needed.
            if let Some(input) = q.inputs.remove(&k.reversed()) {
                if !flush {
                    let ck = k.reversed();
                    let held = q.frames.remove(&ck).unwrap_or_default();
                    let mut all: Vec<Vec<u8>> = input.into_iter().collect();
                    all.extend(held);
                    q.frames.insert(ck, all);
                }
            }
            let mut l = passed.get(k).copied().unwrap_or_default();
            let Some(c) = q.committed.remove(k) else {
                left.push(l);
                continue;
            };
            l.merge(c.left);
            left.push(l);
            if flush {
                q.frames.insert(*k, c.frames.into_iter().collect());
                q.reinject(k, &self.counters);
                q.sent.remove(k);
            } else {
                self.counters
                    .commit_dropped
                    .fetch_add(c.frames.len() as u64, Ordering::Relaxed);
            }
        }
        Ok(left)
    }

    /// The highest acknowledgment among the queued client segments of each held connection
    /// (client -> instance keys): how much of the instance's output the client's kernel has
    /// received, as the client itself says. `None` for one with nothing queued.
    pub(super) fn held_acks(&self, keys: &[Key]) -> Result<Vec<Option<u32>>, HoldError> {
        let mut q = lock(&self.queue);
        q.drain(&self.counters)?;
        Ok(keys
            .iter()
            .map(|k| {
                q.frames.get(k).and_then(|fs| {
                    fs.iter()
                        .filter_map(|f| {
                            let (_, l4) = Key::of_frame(f)?;
                            segment(f, l4).filter(|s| s.ack_flag).map(|s| s.ack)
                        })
                        .reduce(|a, b| if seq_ge(a, b) { a } else { b })
                })
            })
            .collect())
    }

    pub(super) fn commit_stats(&self) -> CommitStats {
        let m = lock(&self.commit);
        let mut t = *lock(&self.counters.commit_retired);
        let mut protected = 0u64;
        for (_, n) in m.1.iter().flatten() {
            protected += 1;
            t.passed += n.passed;
            t.resets += n.resets;
            t.over += n.over;
            t.orphans += n.orphans;
            t.mirrored += n.mirrored;
        }
        let c = &self.counters;
        CommitStats {
            protected,
            passed: u64::from(t.passed),
            released: c.commit_released.load(Ordering::Relaxed),
            dropped: c.commit_dropped.load(Ordering::Relaxed),
            resets: u64::from(t.resets),
            over_limit: u64::from(t.over),
            orphans: u64::from(t.orphans),
            mirrored: u64::from(t.mirrored),
        }
    }

    pub(super) fn stats(&self) -> QueueStats {
        let c = &self.counters;
        QueueStats {
            reinjected: c.reinjected.load(Ordering::Relaxed),
            over_limit: c.over_limit.load(Ordering::Relaxed),
            missing: c.missing.load(Ordering::Relaxed),
            socket_drops: c.socket_drops.load(Ordering::Relaxed),
        }
    }
}

/// A `u32` global of the object (`const volatile` in `.rodata`), read from the ELF symbols.
fn u32_symbol(obj: &[u8], name: &str) -> Option<u32> {
    use object::{Object, ObjectSection, ObjectSymbol};
    let f = object::File::parse(obj).ok()?;
    let sym = f.symbols().find(|s| s.name() == Ok(name))?;
    let sec = f.section_by_index(sym.section_index()?).ok()?;
    let data = sec.data().ok()?;
    let off = (sym.address() - sec.address()) as usize;
    let b = data.get(off..off + 4)?;
    Some(u32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
}

impl Queue {
    /// Reads every frame the socket has into `frames`.
    fn drain(&mut self, c: &Counters) -> Result<(), HoldError> {
        loop {
            // SAFETY: zeroed sockaddr_ll is valid for the kernel to fill.
            let mut sa: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
            let mut sl = std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t;
            // SAFETY: `buf` is writable for its length, `sa` for `sl`.
            let n = unsafe {
                libc::recvfrom(
                    self.rx.as_raw_fd(),
                    self.buf.as_mut_ptr().cast(),
                    self.buf.len(),
                    libc::MSG_TRUNC,
                    (&mut sa as *mut libc::sockaddr_ll).cast(),
                    &mut sl,
                )
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                match e.kind() {
                    io::ErrorKind::WouldBlock => break,
                    io::ErrorKind::Interrupted => continue,
                    _ => return Err(sys("recvfrom on the hold veth")(e)),
                }
            }
            let n = n as usize;
            // Only frames sent out of the veth are ours (what arrives on it is the stack's own
            // chatter from the far end); a frame longer than loopback's MTU cannot be one.
            if sa.sll_pkttype != libc::PACKET_OUTGOING || n > FRAME_MAX {
                continue;
            }
            let frame = self.buf[..n].to_vec();
            if let Some((k, _)) = Key::of_frame(&frame) {
                if let Some(c) = self.committed.get_mut(&k) {
                    c.frames.push_back(frame);
                } else if let Some(i) = self.inputs.get_mut(&k) {
                    let ack = Key::of_frame(&frame)
                        .and_then(|(_, l4)| segment(&frame, l4))
                        .filter(|s| s.ack_flag)
                        .map(|s| s.ack);
                    i.push_back(frame);
                    if let (Some(a), Some(c)) = (ack, self.committed.get_mut(&k.reversed())) {
                        c.left.peer_ack = later(c.left.peer_ack, a);
                    }
                } else {
                    self.frames.entry(k).or_default().push(frame);
                }
            }
        }
        if let Ok(d) = packet_drops(&self.rx) {
            c.socket_drops.fetch_add(u64::from(d), Ordering::Relaxed);
        }
        Ok(())
    }

    fn wait_readable(&self, t: Duration) {
        let mut p = libc::pollfd {
            fd: self.rx.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        unsafe { libc::poll(&mut p, 1, t.as_millis() as libc::c_int) };
    }

    /// Writes back the covered prefix of protected connection `k`'s queued output, then tells
    /// the program how far the queue got (and the covered marks).
    fn release_covered(
        &mut self,
        k: &Key,
        commit: &mut HashMap<MapData, Key, CommitVal>,
        c: &Counters,
    ) {
        let Some(cm) = self.committed.get_mut(k) else {
            return;
        };
        if cm.guarded {
            return;
        }
        // Input the backup's state holds now needs no copy.
        if let Some(input) = self.inputs.get_mut(&k.reversed()) {
            while let Some(f) = input.front() {
                let end = Key::of_frame(f).and_then(|(_, l4)| segment(f, l4));
                if end.is_some_and(|s| !seq_ge(cm.covered_ack, s.end_with_fin())) {
                    break;
                }
                input.pop_front();
            }
        }
        while let Some(f) = cm.frames.front() {
            let seg = Key::of_frame(f).and_then(|(_, l4)| Some((l4, segment(f, l4)?)));
            match seg {
                Some((_, s)) if !covered(&s, cm.covered_seq, cm.covered_ack) => break,
                Some((l4, s)) => {
                    let mut f = cm.frames.pop_front().expect("front exists");
                    cm.released = cm.released.wrapping_add(1);
                    cm.left.note(s.end, s.ack_flag.then_some(s.ack));
                    if complete_tcp_checksum(&mut f, l4) {
                        match send_ip(&self.tx4, &self.tx6, k, &f[ETH_HLEN..]) {
                            Ok(()) => {
                                c.commit_released.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(e) => {
                                tracing::warn!(error = %e, conn = %k.describe(), "writing committed output")
                            }
                        }
                    }
                }
                // Not a TCP segment we can read: it cannot be covered, nor stay first.
                None => {
                    cm.frames.pop_front();
                    cm.released = cm.released.wrapping_add(1);
                    c.commit_dropped.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        let v = CommitVal {
            covered_seq: cm.covered_seq,
            covered_ack: cm.covered_ack,
            released: cm.released,
            flags: 0,
        };
        if let Err(e) = commit.insert(*k, v, 0) {
            tracing::error!(error = %e, conn = %k.describe(), "updating output commit");
        }
    }

    /// Sends the packets kept for `k` back to the stack, in the order they came.
    fn reinject(&mut self, k: &Key, c: &Counters) {
        let Some(frames) = self.frames.remove(k) else {
            return;
        };
        for mut f in frames {
            *self.sent.entry(*k).or_default() += 1;
            let Some((_, l4)) = Key::of_frame(&f) else {
                continue;
            };
            if !complete_tcp_checksum(&mut f, l4) {
                continue;
            }
            let r = send_ip(&self.tx4, &self.tx6, k, &f[ETH_HLEN..]);
            match r {
                Ok(()) => {
                    c.reinjected.fetch_add(1, Ordering::Relaxed);
                }
                // Lost like a dropped segment: the client retransmits it.
                Err(e) => {
                    tracing::warn!(error = %e, conn = %k.describe(), "writing a held segment back")
                }
            }
        }
    }
}

/// Sends one IP packet of connection `k` (to its destination) through the raw socket of its
/// family.
fn send_ip(tx4: &OwnedFd, tx6: &OwnedFd, k: &Key, packet: &[u8]) -> io::Result<()> {
    // SAFETY: zeroed sockaddr_in / sockaddr_in6 are valid; family and address set below.
    let mut sa4: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let mut sa6: libc::sockaddr_in6 = unsafe { std::mem::zeroed() };
    let (fd, sa, len) = if k.family == 4 {
        sa4.sin_family = libc::AF_INET as libc::sa_family_t;
        sa4.sin_addr.s_addr = u32::from_ne_bytes([k.daddr[0], k.daddr[1], k.daddr[2], k.daddr[3]]);
        (
            tx4,
            (&sa4 as *const libc::sockaddr_in).cast::<libc::sockaddr>(),
            std::mem::size_of::<libc::sockaddr_in>(),
        )
    } else {
        sa6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
        sa6.sin6_addr.s6_addr = k.daddr;
        (
            tx6,
            (&sa6 as *const libc::sockaddr_in6).cast::<libc::sockaddr>(),
            std::mem::size_of::<libc::sockaddr_in6>(),
        )
    };
    loop {
        // SAFETY: `packet` and the address are live for the call, their sizes passed.
        let r = unsafe {
            libc::sendto(
                fd.as_raw_fd(),
                packet.as_ptr().cast(),
                packet.len(),
                0,
                sa,
                len as libc::socklen_t,
            )
        };
        if r >= 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// PACKET_STATISTICS: frames the kernel dropped since the last call (the call resets them).
fn packet_drops(fd: &OwnedFd) -> io::Result<u32> {
    let mut st = libc::tpacket_stats {
        tp_packets: 0,
        tp_drops: 0,
    };
    let mut len = std::mem::size_of::<libc::tpacket_stats>() as libc::socklen_t;
    // SAFETY: `st` is writable for `len`.
    let r = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_PACKET,
            libc::PACKET_STATISTICS,
            (&mut st as *mut libc::tpacket_stats).cast(),
            &mut len,
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(st.tp_drops)
    }
}

impl Drop for QueueHold {
    fn drop(&mut self) {
        let ebpf = self.ebpf.take();
        let a = format!("{}a", self.name);
        let devs = std::mem::take(&mut self.devs);
        let done = in_netns(&self.netns, move || {
            drop(ebpf);
            for d in &devs {
                remove_empty_clsact(d);
            }
            ip(&["link", "del", &a])
        });
        match done {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "hold veth left behind"),
            Err((e, f)) => {
                // Forgetting leaks this process's descriptors; the filters stay attached.
                std::mem::forget(f);
                tracing::warn!(error = %e, "hold filters and veth left behind");
            }
        }
    }
}
