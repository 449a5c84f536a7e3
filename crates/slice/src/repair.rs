//! Capture and restore of an established TCP socket with TCP_REPAIR (Linux, CAP_NET_ADMIN).
//!
//! In repair mode the kernel lets a privileged process read and write what is otherwise
//! hidden behind the protocol: the sequence numbers, the queues, the negotiated options and
//! the windows; and a socket in repair mode sends nothing on its own: `connect` does not send
//! a SYN, data written to it is queued as if already sent, and `close` neither sends a FIN nor
//! a RST (the kernel disconnects it silently). The sequence here is the kernel's documented
//! one, in the order CRIU uses it:
//!
//! Capture (socket already in repair mode, see [`enter_repair`]):
//! 1. TCP_INFO: the state must be ESTABLISHED; the negotiated options (SACK, timestamps,
//!    window scale and both shift counts); TCP_MAXSEG for the MSS.
//! 2. TCP_REPAIR_QUEUE = send queue; TCP_QUEUE_SEQ gives `write_seq`; SIOCOUTQ / SIOCOUTQNSD
//!    give the unacknowledged and the never-sent byte counts; `recv(MSG_PEEK)` reads the
//!    queue itself (in repair mode a peek on the send queue copies it out).
//! 3. TCP_REPAIR_QUEUE = receive queue; TCP_QUEUE_SEQ gives `rcv_nxt`; SIOCINQ and a peek
//!    give the bytes received but not yet read.
//! 4. TCP_TIMESTAMP: the socket's timestamp clock; TCP_REPAIR_WINDOW: the windows.
//!
//! Restore ([`restore`]): a new socket; SO_REUSEADDR; TCP_REPAIR on (it marks the socket
//! force-reuse, so it may bind the port a listener holds, and keeps `connect` from sending a
//! SYN; in this order, because SO_REUSEADDR set afterwards would overwrite that mark); the
//! first sequence number of each queue (TCP_QUEUE_SEQ, only allowed before `connect`); bind
//! the local address; connect to the peer (the socket becomes ESTABLISHED at once);
//! TCP_REPAIR_OPTIONS (only allowed between `connect` and the first byte sent); TCP_TIMESTAMP;
//! refill the queues by writing with TCP_REPAIR_QUEUE selecting each (the receive queue's
//! bytes land as received, the send queue's as sent and unacknowledged, advancing the
//! sequence numbers to the captured ones); TCP_REPAIR_WINDOW last (the kernel checks it
//! against `rcv_nxt`, which the receive queue just advanced). The socket is handed back still
//! in repair mode; [`leave_repair`] ends it.

use crate::capsule::{TcpCapsule, TcpOptions, TcpWindow};
use std::io;
use std::mem::size_of;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

const TCP_REPAIR_ON: libc::c_int = 1;
const TCP_REPAIR_OFF: libc::c_int = 0;
const TCP_NO_QUEUE: libc::c_int = 0;
const TCP_RECV_QUEUE: libc::c_int = 1;
const TCP_SEND_QUEUE: libc::c_int = 2;
const TCPOPT_MSS: u32 = 2;
const TCPOPT_WINDOW: u32 = 3;
const TCPOPT_SACK_PERM: u32 = 4;
const TCPOPT_TIMESTAMP: u32 = 8;
const TCPI_OPT_TIMESTAMPS: u8 = 1;
const TCPI_OPT_SACK: u8 = 2;
const TCPI_OPT_WSCALE: u8 = 4;
const TCP_ESTABLISHED: u8 = 1;
const SIOCINQ: libc::c_ulong = 0x541B;
const SIOCOUTQ: libc::c_ulong = 0x5411;
const SIOCOUTQNSD: libc::c_ulong = 0x894B;
/// The largest MSS TCP_MAXSEG accepts.
pub const MAX_USER_MSS: u32 = 32767;
/// Queue refills are written in chunks of this (one skb each on the receive side).
const REFILL_CHUNK: usize = 64 << 10;

#[repr(C)]
struct RepairOpt {
    opt_code: u32,
    opt_val: u32,
}

#[repr(C)]
#[derive(Default)]
struct RepairWindow {
    snd_wl1: u32,
    snd_wnd: u32,
    max_window: u32,
    rcv_wnd: u32,
    rcv_wup: u32,
}

#[derive(Debug, thiserror::Error)]
pub enum RepairError {
    #[error("{op}: {source}")]
    Sys {
        op: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("socket is not established (TCP state {0})")]
    NotEstablished(u8),
    #[error("{queue} queue: expected {expected} bytes, peeked {got}")]
    ShortPeek {
        queue: &'static str,
        expected: usize,
        got: usize,
    },
    #[error(
        "cannot restore {local} <-> {remote}: that 4-tuple is in use by another socket on this \
         host (the source's socket still open, or another connection)"
    )]
    TupleInUse {
        local: SocketAddr,
        remote: SocketAddr,
    },
    #[error("capsule's local and remote addresses are of different families")]
    MixedFamilies,
    #[error(
        "the connection lives in network namespace {capsule}, this is {here}: a socket restored \
         here would never see its packets"
    )]
    OtherNamespace { capsule: u64, here: u64 },
}

fn sys(op: &'static str) -> impl FnOnce(io::Error) -> RepairError {
    move |source| RepairError::Sys { op, source }
}

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn setsockopt_raw<T>(fd: RawFd, level: libc::c_int, opt: libc::c_int, v: &T) -> io::Result<()> {
    // SAFETY: `v` points to a live `T` of the size passed; the kernel only reads it.
    cvt(unsafe {
        libc::setsockopt(
            fd,
            level,
            opt,
            (v as *const T).cast(),
            size_of::<T>() as libc::socklen_t,
        )
    })
    .map(drop)
}

fn set_int(fd: RawFd, level: libc::c_int, opt: libc::c_int, v: libc::c_int) -> io::Result<()> {
    setsockopt_raw(fd, level, opt, &v)
}

fn set_tcp(fd: RawFd, opt: libc::c_int, v: libc::c_int) -> io::Result<()> {
    set_int(fd, libc::IPPROTO_TCP, opt, v)
}

/// getsockopt into a `T`; returns the length the kernel wrote.
fn getsockopt_raw<T>(
    fd: RawFd,
    level: libc::c_int,
    opt: libc::c_int,
    v: &mut T,
) -> io::Result<usize> {
    let mut len = size_of::<T>() as libc::socklen_t;
    // SAFETY: `v` is a live, writable `T` of `len` bytes; the kernel writes at most `len`.
    cvt(unsafe { libc::getsockopt(fd, level, opt, (v as *mut T).cast(), &mut len) })?;
    Ok(len as usize)
}

fn get_tcp_int(fd: RawFd, opt: libc::c_int) -> io::Result<libc::c_int> {
    let mut v: libc::c_int = 0;
    getsockopt_raw(fd, libc::IPPROTO_TCP, opt, &mut v)?;
    Ok(v)
}

fn ioctl_int(fd: RawFd, req: libc::c_ulong) -> io::Result<usize> {
    let mut v: libc::c_int = 0;
    // SAFETY: these socket ioctls write one int to the pointer given.
    cvt(unsafe { libc::ioctl(fd, req as _, &mut v as *mut libc::c_int) })?;
    Ok(v.max(0) as usize)
}

/// The first bytes of `struct tcp_info` (stable ABI: fields are only ever appended).
#[repr(C)]
#[derive(Default)]
struct TcpInfoHead {
    state: u8,
    ca_state: u8,
    retransmits: u8,
    probes: u8,
    backoff: u8,
    options: u8,
    /// snd_wscale in the low nibble, rcv_wscale in the high nibble.
    wscale: u8,
    flags: u8,
    rto: u32,
    ato: u32,
    snd_mss: u32,
    rcv_mss: u32,
    unacked: u32,
}

fn tcp_info(fd: RawFd) -> io::Result<TcpInfoHead> {
    let mut i = TcpInfoHead::default();
    getsockopt_raw(fd, libc::IPPROTO_TCP, libc::TCP_INFO, &mut i)?;
    Ok(i)
}

/// Segments sent but not yet acknowledged by the peer (TCP_INFO `tcpi_unacked`).
pub fn unacked_segments(s: &TcpStream) -> io::Result<u32> {
    Ok(tcp_info(s.as_raw_fd())?.unacked)
}

/// The size of the segments the socket sends now (TCP_INFO `tcpi_snd_mss`).
pub fn send_mss(s: &TcpStream) -> io::Result<u32> {
    Ok(tcp_info(s.as_raw_fd())?.snd_mss)
}

/// The live socket's windows and acknowledged bytes, without repair mode (TCP_INFO, Linux 6.2+
/// for the windows; `None` on an older kernel).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LiveWindows {
    /// The peer's window as this socket last saw it (`tcpi_snd_wnd`).
    pub snd_wnd: u32,
    /// The window this socket offers (`tcpi_rcv_wnd`).
    pub rcv_wnd: u32,
}

pub fn live_windows(s: &TcpStream) -> io::Result<Option<LiveWindows>> {
    // struct tcp_info (linux/tcp.h): tcpi_snd_wnd at 228, tcpi_rcv_wnd at 232.
    let mut b = [0u8; 256];
    let mut len = b.len() as libc::socklen_t;
    // SAFETY: `b` is writable for `len` bytes.
    cvt(unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            b.as_mut_ptr().cast(),
            &mut len,
        )
    })?;
    if (len as usize) < 236 {
        return Ok(None);
    }
    let u = |o: usize| u32::from_ne_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
    Ok(Some(LiveWindows {
        snd_wnd: u(228),
        rcv_wnd: u(232),
    }))
}

/// Puts the socket in repair mode: from here it sends nothing by itself, and its state can be
/// read out. The application must have stopped using it.
pub fn enter_repair(s: &TcpStream) -> Result<(), RepairError> {
    set_tcp(s.as_raw_fd(), libc::TCP_REPAIR, TCP_REPAIR_ON).map_err(sys("TCP_REPAIR on"))
}

/// Ends repair mode with TCP_REPAIR_OFF, which sends one window probe (an ACK carrying an old
/// sequence number). That is wanted here: the peer answers it at once with its current ACK and
/// window, so a restored socket learns what the peer already has (acknowledging the sent part
/// of the restored send queue) and its current window without waiting for a retransmission
/// timeout, which on a fresh socket starts at one second. TCP_REPAIR_OFF_NO_WP (no probe) is
/// for a peer not reachable yet; here the answer always gets through: callers end repair
/// after the packet hold for the connection is released, or, with the queueing hold, before
/// (the answer is queued and written back at the release).
pub fn leave_repair(s: &TcpStream) -> Result<(), RepairError> {
    set_tcp(s.as_raw_fd(), libc::TCP_REPAIR, TCP_REPAIR_OFF).map_err(sys("TCP_REPAIR off"))
}

/// The kernel state of a live socket read out without stopping it: repair mode on, a capture,
/// repair mode off without a window probe (`TCP_REPAIR_OFF_NO_WP`: nothing leaves). The
/// socket must have nothing unsent (a session that has written nothing yet): with the send
/// queue selected in repair mode, the kernel would mark data it pushes meanwhile as sent
/// without sending it. Used to learn a replicated session's sequence numbers, options and
/// timestamp clock when it starts; from then on its owner counts the bytes itself.
pub fn observe(s: &TcpStream) -> Result<TcpCapsule, RepairError> {
    const TCP_REPAIR_OFF_NO_WP: libc::c_int = -1;
    enter_repair(s)?;
    let c = capture(s);
    let off = set_tcp(s.as_raw_fd(), libc::TCP_REPAIR, TCP_REPAIR_OFF_NO_WP)
        .map_err(sys("TCP_REPAIR off (no probe)"));
    let c = c?;
    off?;
    Ok(c)
}

/// `SO_LINGER` with a zero timeout (`reset`) or the default. With it, closing the socket, as the
/// kernel does when its process dies, sends a RST and frees the 4-tuple at once instead of
/// leaving a FIN_WAIT socket that holds it: a replicated session's backup can then restore the
/// connection (and its output commit keeps that RST from the client).
pub fn set_linger_reset(s: &TcpStream, reset: bool) -> io::Result<()> {
    let l = libc::linger {
        l_onoff: libc::c_int::from(reset),
        l_linger: 0,
    };
    // SAFETY: `l` is a live linger of the size given.
    cvt(unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&l as *const libc::linger).cast(),
            size_of::<libc::linger>() as libc::socklen_t,
        )
    })
    .map(|_| ())
}

/// Bytes written to the socket and not yet acknowledged by the peer (SIOCOUTQ; no repair
/// mode needed).
pub fn unacked_bytes(s: &TcpStream) -> io::Result<usize> {
    ioctl_int(s.as_raw_fd(), SIOCOUTQ)
}

/// Closes a socket that is in repair mode: the kernel disconnects it without sending a FIN or
/// a RST (the connection lives on in its restored copy).
pub fn close_in_repair(s: TcpStream) -> Result<(), RepairError> {
    // Set again: closing a socket that had left repair mode would send a FIN or a RST.
    enter_repair(&s)?;
    drop(s);
    Ok(())
}

fn select_queue(fd: RawFd, q: libc::c_int) -> Result<(), RepairError> {
    set_tcp(fd, libc::TCP_REPAIR_QUEUE, q).map_err(sys("TCP_REPAIR_QUEUE"))
}

fn peek(fd: RawFd, queue: &'static str, len: usize) -> Result<Vec<u8>, RepairError> {
    let mut buf = vec![0u8; len];
    if len == 0 {
        return Ok(buf);
    }
    // SAFETY: `buf` is writable for `len` bytes.
    let n = unsafe {
        libc::recv(
            fd,
            buf.as_mut_ptr().cast(),
            len,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        return Err(RepairError::Sys {
            op: "peek queue",
            source: io::Error::last_os_error(),
        });
    }
    if n as usize != len {
        return Err(RepairError::ShortPeek {
            queue,
            expected: len,
            got: n as usize,
        });
    }
    Ok(buf)
}

/// Reads the connection's `rcv_nxt` (socket in repair mode): a capture is consistent as long as
/// it has not moved.
pub fn recv_seq(s: &TcpStream) -> Result<u32, RepairError> {
    let fd = s.as_raw_fd();
    select_queue(fd, TCP_RECV_QUEUE)?;
    let v = get_tcp_int(fd, libc::TCP_QUEUE_SEQ).map_err(sys("TCP_QUEUE_SEQ recv"))?;
    select_queue(fd, TCP_NO_QUEUE)?;
    Ok(v as u32)
}

/// Captures the kernel state of `s`, which must be established and in repair mode.
pub fn capture(s: &TcpStream) -> Result<TcpCapsule, RepairError> {
    let fd = s.as_raw_fd();
    let info = tcp_info(fd).map_err(sys("TCP_INFO"))?;
    if info.state != TCP_ESTABLISHED {
        return Err(RepairError::NotEstablished(info.state));
    }
    let wscale =
        (info.options & TCPI_OPT_WSCALE != 0).then_some((info.wscale & 0xf, info.wscale >> 4));
    let mss = get_tcp_int(fd, libc::TCP_MAXSEG).map_err(sys("TCP_MAXSEG"))? as u32;
    let nodelay = get_tcp_int(fd, libc::TCP_NODELAY).map_err(sys("TCP_NODELAY"))? != 0;
    let local = s.local_addr().map_err(sys("getsockname"))?;
    let remote = s.peer_addr().map_err(sys("getpeername"))?;

    select_queue(fd, TCP_SEND_QUEUE)?;
    let send_seq = get_tcp_int(fd, libc::TCP_QUEUE_SEQ).map_err(sys("TCP_QUEUE_SEQ send"))? as u32;
    let outq = ioctl_int(fd, SIOCOUTQ).map_err(sys("SIOCOUTQ"))?;
    let unsent = ioctl_int(fd, SIOCOUTQNSD).map_err(sys("SIOCOUTQNSD"))?;
    let send_queue = peek(fd, "send", outq)?;

    select_queue(fd, TCP_RECV_QUEUE)?;
    let recv_seq = get_tcp_int(fd, libc::TCP_QUEUE_SEQ).map_err(sys("TCP_QUEUE_SEQ recv"))? as u32;
    let inq = ioctl_int(fd, SIOCINQ).map_err(sys("SIOCINQ"))?;
    let recv_queue = peek(fd, "receive", inq)?;
    select_queue(fd, TCP_NO_QUEUE)?;

    let timestamp = get_tcp_int(fd, libc::TCP_TIMESTAMP).map_err(sys("TCP_TIMESTAMP"))? as u32;
    let captured_at_ms = monotonic_ms();
    let netns = socket_netns(s).map_err(sys("SIOCGSKNS"))?;
    let mut w = RepairWindow::default();
    getsockopt_raw(fd, libc::IPPROTO_TCP, libc::TCP_REPAIR_WINDOW, &mut w)
        .map_err(sys("TCP_REPAIR_WINDOW get"))?;
    Ok(TcpCapsule {
        local,
        remote,
        send_seq,
        recv_seq,
        send_queue,
        unsent: unsent.min(outq) as u32,
        recv_queue,
        options: TcpOptions {
            mss,
            wscale,
            sack: info.options & TCPI_OPT_SACK != 0,
            timestamps: info.options & TCPI_OPT_TIMESTAMPS != 0,
        },
        window: TcpWindow {
            snd_wl1: w.snd_wl1,
            snd_wnd: w.snd_wnd,
            max_window: w.max_window,
            rcv_wnd: w.rcv_wnd,
            rcv_wup: w.rcv_wup,
        },
        timestamp,
        captured_at_ms,
        netns,
        nodelay,
    })
}

const SIOCGSKNS: libc::c_ulong = 0x894C;

fn ns_inode(fd: RawFd) -> io::Result<u64> {
    // SAFETY: zeroed stat is valid; fstat writes it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a live, writable stat.
    cvt(unsafe { libc::fstat(fd, &mut st) })?;
    Ok(st.st_ino)
}

/// The network namespace a socket belongs to (SIOCGSKNS opens it; its nsfs inode names it).
pub fn socket_netns(s: &impl AsRawFd) -> io::Result<u64> {
    // SAFETY: SIOCGSKNS takes no argument and returns a new descriptor, owned at once.
    let fd = cvt(unsafe { libc::ioctl(s.as_raw_fd(), SIOCGSKNS as _) })?;
    // SAFETY: `fd` is a fresh descriptor nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    ns_inode(fd.as_raw_fd())
}

/// The network namespace of the calling thread (where it creates sockets).
pub fn thread_netns() -> io::Result<u64> {
    let f = std::fs::File::open("/proc/thread-self/ns/net")?;
    ns_inode(f.as_raw_fd())
}

/// Refuses a capsule of another network namespace than the calling thread's.
pub fn check_netns(c: &TcpCapsule) -> Result<(), RepairError> {
    let here = thread_netns().map_err(sys("network namespace"))?;
    if c.netns != here {
        return Err(RepairError::OtherNamespace {
            capsule: c.netns,
            here,
        });
    }
    Ok(())
}

/// CLOCK_MONOTONIC in ms: the clock the kernel's TCP timestamps count (tcp_clock_ns).
pub fn monotonic_ms() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1000 + ts.tv_nsec as u64 / 1_000_000
}

/// The timestamp a restored socket starts from: the captured one, advanced by the time since
/// the capture when that is known (same host; a monotonic clock of another host, or one that
/// went backwards, gives no usable difference, and the captured value is used as is).
fn restored_timestamp(c: &TcpCapsule) -> u32 {
    let now = monotonic_ms();
    let since = now.saturating_sub(c.captured_at_ms);
    if now >= c.captured_at_ms && since < 60_000 {
        // Bit 0 is the kernel's flag for microsecond timestamps (then the unit is a us).
        let flag = c.timestamp & 1;
        let delta = if flag == 1 { since * 1000 } else { since };
        (c.timestamp.wrapping_add(delta as u32) & !1) | flag
    } else {
        c.timestamp
    }
}

fn sockaddr(a: &SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain data; all-zero is a valid value.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match a {
        SocketAddr::V4(v4) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: v4.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(v4.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is large and aligned enough for any sockaddr.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin) };
            size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(v6) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: v6.port().to_be(),
                sin6_flowinfo: v6.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: v6.ip().octets(),
                },
                sin6_scope_id: v6.scope_id(),
            };
            // SAFETY: as above.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin6) };
            size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as libc::socklen_t)
}

/// Writes `data` into the queue selected on `fd` (repair mode), in chunks.
fn refill(fd: RawFd, op: &'static str, data: &[u8]) -> Result<(), RepairError> {
    for chunk in data.chunks(REFILL_CHUNK) {
        let mut off = 0;
        while off < chunk.len() {
            // SAFETY: the pointer and length describe the live slice `chunk[off..]`.
            let n = unsafe {
                libc::send(
                    fd,
                    chunk[off..].as_ptr().cast(),
                    chunk.len() - off,
                    libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
                )
            };
            if n < 0 {
                return Err(RepairError::Sys {
                    op,
                    source: io::Error::last_os_error(),
                });
            }
            off += n as usize;
        }
    }
    Ok(())
}

/// Makes sure a buffer can hold a queue of `len` bytes being refilled (a source socket's
/// buffers may have grown by autotuning beyond a fresh socket's defaults). Only raised when
/// needed: setting a buffer size turns the kernel's autotuning off for that socket.
fn fit_buffer(
    fd: RawFd,
    opt: libc::c_int,
    op: &'static str,
    len: usize,
) -> Result<(), RepairError> {
    if len <= REFILL_CHUNK {
        return Ok(());
    }
    let want = len.saturating_mul(2).min(i32::MAX as usize) as libc::c_int;
    set_int(fd, libc::SOL_SOCKET, opt, want).map_err(sys(op))
}

/// Rebuilds the connection of `c` in a new socket, left in repair mode (see the module doc).
/// The 4-tuple must be free on this host: while another socket holds it (the source's socket
/// not yet closed) the kernel refuses the `connect` and this returns
/// [`RepairError::TupleInUse`].
pub fn restore(c: &TcpCapsule) -> Result<TcpStream, RepairError> {
    if c.local.is_ipv4() != c.remote.is_ipv4() {
        return Err(RepairError::MixedFamilies);
    }
    check_netns(c)?;
    let family = if c.local.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    // SAFETY: plain socket(2); the fd is owned at once.
    let raw = cvt(unsafe { libc::socket(family, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) })
        .map_err(sys("socket"))?;
    // SAFETY: `raw` is a fresh descriptor nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // SO_REUSEADDR first: TCP_REPAIR on marks the socket force-reuse (it may bind the port a
    // listener or the source connection holds), and a later SO_REUSEADDR would overwrite that
    // mark with plain reuse, and bind would fail with EADDRINUSE.
    set_int(raw, libc::SOL_SOCKET, libc::SO_REUSEADDR, 1).map_err(sys("SO_REUSEADDR"))?;
    set_tcp(raw, libc::TCP_REPAIR, TCP_REPAIR_ON).map_err(sys("TCP_REPAIR on"))?;

    select_queue(raw, TCP_SEND_QUEUE)?;
    set_tcp(raw, libc::TCP_QUEUE_SEQ, c.send_una() as libc::c_int)
        .map_err(sys("TCP_QUEUE_SEQ send"))?;
    select_queue(raw, TCP_RECV_QUEUE)?;
    set_tcp(raw, libc::TCP_QUEUE_SEQ, c.recv_copied() as libc::c_int)
        .map_err(sys("TCP_QUEUE_SEQ recv"))?;
    select_queue(raw, TCP_NO_QUEUE)?;

    // The MSS before connect: connect sizes the socket's segments (mss_cache) from the clamp it
    // knows then, and TCP_REPAIR_OPTIONS, allowed only after connect, sets the clamp without
    // resizing them; without this the restored socket sends 524-byte segments (the default).
    // TCP_MAXSEG takes at most 32767 (MAX_TCP_WINDOW): exact for any real link's MSS; on
    // loopback (MSS 65495) the restored socket's segments are half as large as before.
    let user_mss = c.options.mss.min(MAX_USER_MSS) as libc::c_int;
    set_tcp(raw, libc::TCP_MAXSEG, user_mss).map_err(sys("TCP_MAXSEG"))?;
    let (sa, len) = sockaddr(&c.local);
    // SAFETY: `sa` holds a sockaddr of `len` bytes.
    cvt(unsafe { libc::bind(raw, (&sa as *const libc::sockaddr_storage).cast(), len) })
        .map_err(sys("bind local address"))?;
    let (sa, len) = sockaddr(&c.remote);
    // SAFETY: as above.
    let r = unsafe { libc::connect(raw, (&sa as *const libc::sockaddr_storage).cast(), len) };
    if r < 0 {
        let e = io::Error::last_os_error();
        return Err(match e.raw_os_error() {
            // The established-table check of connect: the 4-tuple belongs to a live socket.
            Some(libc::EADDRNOTAVAIL) | Some(libc::EADDRINUSE) => RepairError::TupleInUse {
                local: c.local,
                remote: c.remote,
            },
            _ => RepairError::Sys {
                op: "connect (repair)",
                source: e,
            },
        });
    }

    let mut opts = vec![RepairOpt {
        opt_code: TCPOPT_MSS,
        opt_val: c.options.mss,
    }];
    if let Some((snd, rcv)) = c.options.wscale {
        opts.push(RepairOpt {
            opt_code: TCPOPT_WINDOW,
            opt_val: snd as u32 | (rcv as u32) << 16,
        });
    }
    if c.options.sack {
        opts.push(RepairOpt {
            opt_code: TCPOPT_SACK_PERM,
            opt_val: 0,
        });
    }
    if c.options.timestamps {
        opts.push(RepairOpt {
            opt_code: TCPOPT_TIMESTAMP,
            opt_val: 0,
        });
    }
    // SAFETY: `opts` is a live array of `opts.len()` RepairOpt (the kernel's layout).
    cvt(unsafe {
        libc::setsockopt(
            raw,
            libc::IPPROTO_TCP,
            libc::TCP_REPAIR_OPTIONS,
            opts.as_ptr().cast(),
            (opts.len() * size_of::<RepairOpt>()) as libc::socklen_t,
        )
    })
    .map_err(sys("TCP_REPAIR_OPTIONS"))?;
    if c.options.timestamps {
        set_tcp(
            raw,
            libc::TCP_TIMESTAMP,
            restored_timestamp(c) as libc::c_int,
        )
        .map_err(sys("TCP_TIMESTAMP"))?;
    }

    fit_buffer(
        raw,
        libc::SO_SNDBUFFORCE,
        "SO_SNDBUFFORCE",
        c.sent_part().len(),
    )?;
    // Room for the unread bytes and for everything the client may send into the window the
    // source advertised: a restored socket starts from the default buffer, and data beyond
    // it is dropped (the client retransmits it, after a retransmission timeout if it was its
    // last). Seen with a bulk flow moved mid-transfer: 1-3 client RTOs in 5 moves.
    fit_buffer(
        raw,
        libc::SO_RCVBUFFORCE,
        "SO_RCVBUFFORCE",
        c.recv_queue.len() + c.window.rcv_wnd as usize,
    )?;
    select_queue(raw, TCP_SEND_QUEUE)?;
    refill(raw, "refill send queue", c.sent_part())?;
    select_queue(raw, TCP_RECV_QUEUE)?;
    refill(raw, "refill receive queue", &c.recv_queue)?;
    select_queue(raw, TCP_NO_QUEUE)?;

    let w = RepairWindow {
        snd_wl1: c.window.snd_wl1,
        snd_wnd: c.window.snd_wnd,
        max_window: c.window.max_window,
        rcv_wnd: c.window.rcv_wnd,
        rcv_wup: c.window.rcv_wup,
    };
    setsockopt_raw(raw, libc::IPPROTO_TCP, libc::TCP_REPAIR_WINDOW, &w)
        .map_err(sys("TCP_REPAIR_WINDOW set"))?;
    if c.nodelay {
        set_tcp(raw, libc::TCP_NODELAY, 1).map_err(sys("TCP_NODELAY"))?;
    }
    Ok(TcpStream::from(fd))
}
