//! The replica-to-replica peer channel: a unix stream socket per replica (mode 0600, peer uid
//! checked with SO_PEERCRED), carrying length-prefixed [`PeerMsg`] frames.
//!
//! The packet thread does the socket I/O itself, non-blocking, from [`PeerLink::pump`] (once
//! per round, at most every [`PUMP_EVERY`] while traffic keeps it busy and a migration is
//! under way, every [`PUMP_IDLE_EVERY`] when none is, at once after a
//! sleep) and [`PeerLink::send`] (which writes at once). Why not helper threads: a migration's
//! pause is a chain of wake-ups, and a thread between the packet thread and the socket adds
//! one per message on each side — source engine -> sender thread -> socket -> reader thread ->
//! destination engine was three wake-ups for the batch and three for `Done`, where the direct
//! path needs one. An epoll set of every peer socket is the single fd the packet thread sleeps
//! on ([`PeerLink::poll_fd`]).
//!
//! Bounds: 32 incoming and 32 outgoing connections; an incoming connection is read only while
//! fewer than [`INBOUND_BOUND`] events wait for the engine (the kernel's socket buffer then
//! fills and the sender's writes wait: back-pressure, nothing dropped); an outgoing
//! connection buffers at most [`OUT_BUF_MAX`] unsent bytes, beyond which `send` refuses (the
//! engine counts the message as failed, never blocks). A connection that breaks reports every
//! message it had not fully written (and every `Done` still waiting for its Ack) as
//! [`PeerEvent::SendFailed`]; the `Done` of a batch that failed is not sent on a fresh
//! connection (it would release holds without the state).

use crate::migrate::{decode_body, encode_frame, Outbound, PeerEvent, PeerMsg, MAX_FRAME_BYTES};
use std::collections::VecDeque;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::mpsc::{self, Receiver, SyncSender};
use std::time::{Duration, Instant};

/// Events waiting for the engine at most (incoming connections are not read beyond it).
pub const INBOUND_BOUND: usize = 8192;
/// Messages queued from the packet thread in channel mode at most.
const OUTBOUND_BOUND: usize = 8192;
/// Concurrent incoming connections at most.
const MAX_CONNECTIONS: usize = 32;
/// Outgoing connections kept open at most.
const MAX_OUT_CONNECTIONS: usize = 32;
/// Unsent bytes buffered per outgoing connection at most (a few full batches).
pub const OUT_BUF_MAX: usize = 4 * MAX_FRAME_BYTES;
/// While the packet thread is busy, the sockets are looked at this often at most (one
/// epoll_wait per look); right after a sleep, at once.
pub const PUMP_EVERY: Duration = Duration::from_micros(20);
/// The same while no migration holds, forwards or waits (one epoll_wait per look costs
/// ~1 us; at 20 us that would be a few per cent of a busy packet thread for nothing).
pub const PUMP_IDLE_EVERY: Duration = Duration::from_micros(200);
/// Bytes read per read(2) at most.
const READ_CHUNK: usize = 256 << 10;

/// Where the Ack to a `Done` goes.
#[derive(Debug)]
pub enum Reply {
    /// An in-memory link (tests, custom transports).
    Channel(SyncSender<PeerMsg>),
    /// The incoming connection the `Done` came on (`slot`, and its generation so that an Ack
    /// never reaches a later connection that reused the slot).
    Conn { slot: usize, gen: u64 },
}

/// The packet thread's end of the peer channel.
pub struct PeerLink {
    inner: Inner,
}

enum Inner {
    Channels {
        tx: SyncSender<Outbound>,
        rx: Receiver<PeerEvent>,
    },
    Sockets(Box<Sockets>),
}

/// The other end of an in-memory [`PeerLink`] (tests, or a custom transport).
pub struct PeerEnd {
    /// What the engine sends.
    pub outbound: Receiver<Outbound>,
    /// Where to deliver events to the engine.
    pub events: SyncSender<PeerEvent>,
}

impl PeerLink {
    /// A link with no transport behind it: the caller moves messages (deterministic tests).
    pub fn channels() -> (PeerLink, PeerEnd) {
        let (otx, orx) = mpsc::sync_channel(OUTBOUND_BOUND);
        let (etx, erx) = mpsc::sync_channel(INBOUND_BOUND);
        (
            PeerLink {
                inner: Inner::Channels { tx: otx, rx: erx },
            },
            PeerEnd {
                outbound: orx,
                events: etx,
            },
        )
    }

    /// Queues `o` (sockets: written at once as far as the kernel takes it). False when the
    /// transport is full: the caller counts the message as failed. Delivery failures come
    /// back later as [`PeerEvent::SendFailed`].
    pub fn send(&mut self, o: Outbound) -> bool {
        match &mut self.inner {
            Inner::Channels { tx, .. } => tx.try_send(o).is_ok(),
            Inner::Sockets(s) => s.send(o),
        }
    }

    /// The next event for the engine, if any.
    pub fn next_event(&mut self) -> Option<PeerEvent> {
        match &mut self.inner {
            Inner::Channels { rx, .. } => rx.try_recv().ok(),
            Inner::Sockets(s) => s.events.pop_front(),
        }
    }

    /// Sends `ack` back for a `Done` that came with `to`. False when it cannot go anywhere
    /// (the connection is gone).
    pub fn reply(&mut self, to: Reply, ack: PeerMsg) -> bool {
        match (to, &mut self.inner) {
            (Reply::Channel(tx), _) => tx.try_send(ack).is_ok(),
            (Reply::Conn { slot, gen }, Inner::Sockets(s)) => s.reply(slot, gen, &ack),
            (Reply::Conn { .. }, Inner::Channels { .. }) => false,
        }
    }

    /// Socket I/O: accepts, reads what arrived, writes what waits. `now` paces it to one
    /// look per `every` while the engine is busy; `force` skips the pacing (the engine just
    /// woke up).
    pub fn pump(&mut self, now: Instant, force: bool, every: Duration) {
        if let Inner::Sockets(s) = &mut self.inner {
            if force
                || s.last_pump
                    .is_none_or(|t| now.saturating_duration_since(t) >= every)
            {
                s.last_pump = Some(now);
                s.pump();
            }
        }
    }

    /// The fd the packet thread includes in its poll(2) when it sleeps (readable when any
    /// peer socket needs attention).
    pub fn poll_fd(&self) -> Option<RawFd> {
        match &self.inner {
            Inner::Channels { .. } => None,
            Inner::Sockets(s) => Some(s.epoll.as_raw_fd()),
        }
    }

    /// True when events or unread frames wait: the packet thread must not sleep.
    pub fn has_pending(&self) -> bool {
        match &self.inner {
            Inner::Channels { .. } => false,
            Inner::Sockets(s) => {
                !s.events.is_empty() || s.inbound.iter().flatten().any(|c| c.has_frame())
            }
        }
    }
}

/// Removes the socket file on drop.
pub struct PeerServer {
    path: String,
}

impl Drop for PeerServer {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Binds the peer socket at `path`; the returned link does the I/O on the caller's thread.
pub fn start(path: &str) -> Result<(PeerServer, PeerLink), String> {
    if let Ok(md) = std::fs::symlink_metadata(path) {
        if md.file_type().is_socket() {
            let _ = std::fs::remove_file(path);
        } else {
            return Err(format!("peer socket {path}: exists and is not a socket"));
        }
    }
    if let Some(dir) = std::path::Path::new(path).parent() {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("peer socket dir {}: {e}", dir.display()))?;
    }
    let listener =
        UnixListener::bind(path).map_err(|e| format!("peer socket {path}: bind: {e}"))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| format!("peer socket {path}: chmod 0600: {e}"))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| format!("peer socket {path}: {e}"))?;
    // SAFETY: epoll_create1 has no preconditions; the fd is owned below.
    let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    if fd < 0 {
        return Err(format!(
            "epoll_create1: {}",
            std::io::Error::last_os_error()
        ));
    }
    // SAFETY: `fd` is a fresh descriptor nobody else owns.
    let epoll = unsafe { OwnedFd::from_raw_fd(fd) };
    let s = Sockets {
        epoll,
        listener,
        // SAFETY: geteuid has no preconditions.
        me: unsafe { libc::geteuid() },
        inbound: (0..MAX_CONNECTIONS).map(|_| None).collect(),
        outbound: (0..MAX_OUT_CONNECTIONS).map(|_| None).collect(),
        next_gen: 0,
        failed_batches: VecDeque::new(),
        events: VecDeque::new(),
        scratch: vec![0u8; READ_CHUNK],
        last_pump: None,
    };
    s.ctl(
        libc::EPOLL_CTL_ADD,
        s.listener.as_raw_fd(),
        TOKEN_LISTENER,
        false,
    )
    .map_err(|e| format!("epoll add listener: {e}"))?;
    Ok((
        PeerServer {
            path: path.to_string(),
        },
        PeerLink {
            inner: Inner::Sockets(Box::new(s)),
        },
    ))
}

const TOKEN_LISTENER: u64 = u64::MAX;
const OUT_TOKEN_BASE: u64 = 1 << 32;

/// A byte stream with frames in it, read or written incrementally.
#[derive(Default)]
struct Buf {
    data: Vec<u8>,
    pos: usize,
}

impl Buf {
    fn pending(&self) -> usize {
        self.data.len() - self.pos
    }

    fn consume(&mut self, n: usize) {
        self.pos += n;
        if self.pos == self.data.len() {
            self.data.clear();
            self.pos = 0;
        } else if self.pos > (1 << 20) && self.pos * 2 > self.data.len() {
            self.data.drain(..self.pos);
            self.pos = 0;
        }
    }

    /// The next complete frame: `Ok(None)` when more bytes are needed.
    fn take_frame(&mut self) -> Result<Option<PeerMsg>, String> {
        let p = &self.data[self.pos..];
        if p.len() < 4 {
            return Ok(None);
        }
        let len = u32::from_le_bytes([p[0], p[1], p[2], p[3]]) as usize;
        if len > MAX_FRAME_BYTES {
            return Err(format!("frame of {len} bytes exceeds {MAX_FRAME_BYTES}"));
        }
        if p.len() < 4 + len {
            return Ok(None);
        }
        let msg = decode_body(&p[4..4 + len]).map_err(|e| e.to_string());
        self.consume(4 + len);
        msg.map(Some)
    }

    fn has_frame(&self) -> bool {
        let p = &self.data[self.pos..];
        p.len() >= 4 && {
            let len = u32::from_le_bytes([p[0], p[1], p[2], p[3]]) as usize;
            len > MAX_FRAME_BYTES || p.len() >= 4 + len
        }
    }

    /// Writes as much as the socket takes; the number of bytes written.
    fn flush(&mut self, s: &mut UnixStream) -> std::io::Result<usize> {
        let mut wrote = 0;
        while self.pending() > 0 {
            match s.write(&self.data[self.pos..]) {
                Ok(0) => return Err(ErrorKind::WriteZero.into()),
                Ok(n) => {
                    self.consume(n);
                    wrote += n;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(wrote)
    }
}

struct InConn {
    s: UnixStream,
    gen: u64,
    rbuf: Buf,
    /// Acks not yet taken by the socket.
    wbuf: Buf,
    want_out: bool,
}

impl InConn {
    fn has_frame(&self) -> bool {
        self.rbuf.has_frame()
    }
}

/// A message on an outgoing connection that is not fully written yet.
struct Unsent {
    /// Stream offset just past the frame.
    end: u64,
    id: u64,
    what: &'static str,
}

struct OutConn {
    to: String,
    s: UnixStream,
    wbuf: Buf,
    /// Bytes written to the socket so far.
    written: u64,
    /// Bytes queued so far (written + pending).
    queued: u64,
    unsent: VecDeque<Unsent>,
    /// Migrations whose `Done` went out and whose Ack has not come back.
    awaiting_ack: VecDeque<u64>,
    rbuf: Buf,
    want_out: bool,
}

struct Sockets {
    epoll: OwnedFd,
    listener: UnixListener,
    me: libc::uid_t,
    inbound: Vec<Option<InConn>>,
    outbound: Vec<Option<OutConn>>,
    next_gen: u64,
    /// Migrations whose batch was not delivered: their `Done` is not sent. Bounded.
    failed_batches: VecDeque<u64>,
    events: VecDeque<PeerEvent>,
    scratch: Vec<u8>,
    last_pump: Option<Instant>,
}

fn migration_id(m: &PeerMsg) -> u64 {
    match m {
        PeerMsg::Batch { id, .. } | PeerMsg::Done { id, .. } | PeerMsg::Ack { id, .. } => *id,
        PeerMsg::Fwd { .. } => 0,
    }
}

fn kind(m: &PeerMsg) -> &'static str {
    match m {
        PeerMsg::Batch { .. } => "batch",
        PeerMsg::Done { .. } => "done",
        PeerMsg::Fwd { .. } => "fwd",
        PeerMsg::Ack { .. } => "ack",
    }
}

/// Reads what `s` has into `buf` (at most `READ_CHUNK` per call, until it would block or
/// `limit` bytes are pending). Ok(false) on end of stream.
fn read_into(
    s: &mut UnixStream,
    buf: &mut Buf,
    scratch: &mut [u8],
    limit: usize,
) -> std::io::Result<bool> {
    while buf.pending() < limit {
        match s.read(scratch) {
            Ok(0) => return Ok(false),
            Ok(n) => buf.data.extend_from_slice(&scratch[..n]),
            Err(e) if e.kind() == ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// A non-blocking connect: a destination whose backlog is full (a hung replica) fails at
/// once (EAGAIN) instead of blocking the caller. Also the controller's liveness probe.
pub fn connect_nonblocking(path: &str) -> std::io::Result<UnixStream> {
    let bytes = path.as_bytes();
    // SAFETY: sockaddr_un is plain data.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    if bytes.len() >= addr.sun_path.len() || bytes.contains(&0) {
        return Err(std::io::Error::new(
            ErrorKind::InvalidInput,
            "socket path too long or contains NUL",
        ));
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    // SAFETY: plain socket(2); the fd is owned by the UnixStream below.
    let fd = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh socket nobody else owns.
    let s = unsafe { UnixStream::from_raw_fd(fd) };
    let len = std::mem::size_of::<libc::sa_family_t>() + bytes.len();
    // SAFETY: `addr` is a valid sockaddr_un and `len` covers the family and the path.
    let rc = unsafe {
        libc::connect(
            fd,
            (&addr as *const libc::sockaddr_un).cast(),
            len as libc::socklen_t,
        )
    };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        // EAGAIN on a unix socket: the listener's backlog is full.
        return Err(e);
    }
    Ok(s)
}

impl Sockets {
    fn ctl(&self, op: libc::c_int, fd: RawFd, token: u64, out: bool) -> std::io::Result<()> {
        let mut ev = libc::epoll_event {
            events: (libc::EPOLLIN | if out { libc::EPOLLOUT } else { 0 }) as u32,
            u64: token,
        };
        // SAFETY: `ev` is a valid epoll_event; the fds are open.
        let rc = unsafe { libc::epoll_ctl(self.epoll.as_raw_fd(), op, fd, &mut ev) };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    fn unregister(&self, fd: RawFd) {
        // SAFETY: EPOLL_CTL_DEL ignores the event argument (non-null for old kernels).
        let mut ev = libc::epoll_event { events: 0, u64: 0 };
        unsafe { libc::epoll_ctl(self.epoll.as_raw_fd(), libc::EPOLL_CTL_DEL, fd, &mut ev) };
    }

    fn pump(&mut self) {
        let mut evs = [libc::epoll_event { events: 0, u64: 0 }; 64];
        // SAFETY: `evs` has room for 64 events.
        let n = unsafe { libc::epoll_wait(self.epoll.as_raw_fd(), evs.as_mut_ptr(), 64, 0) };
        for ev in evs.iter().take(n.max(0) as usize) {
            let token = ev.u64;
            if token == TOKEN_LISTENER {
                self.accept();
            } else if token >= OUT_TOKEN_BASE {
                self.service_out((token - OUT_TOKEN_BASE) as usize);
            } else {
                self.service_in(token as usize);
            }
        }
        // Connections whose frames wait because the engine was full before.
        if self.events.len() < INBOUND_BOUND {
            for slot in 0..self.inbound.len() {
                if self.inbound[slot].as_ref().is_some_and(InConn::has_frame) {
                    self.parse_in(slot);
                }
            }
        }
    }

    fn accept(&mut self) {
        loop {
            let s = match self.listener.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => return,
            };
            // Only our own uid may move flows into this replica: a flow record is trusted state.
            if pliant_ha::unix::peer_uid(&s).ok() != Some(self.me) {
                tracing::warn!("peer connection refused: uid differs from the replica's");
                continue;
            }
            let Some(slot) = self.inbound.iter().position(Option::is_none) else {
                tracing::warn!("peer connection refused: {MAX_CONNECTIONS} connections open");
                continue;
            };
            if s.set_nonblocking(true).is_err()
                || self
                    .ctl(libc::EPOLL_CTL_ADD, s.as_raw_fd(), slot as u64, false)
                    .is_err()
            {
                continue;
            }
            self.next_gen += 1;
            self.inbound[slot] = Some(InConn {
                s,
                gen: self.next_gen,
                rbuf: Buf::default(),
                wbuf: Buf::default(),
                want_out: false,
            });
        }
    }

    fn close_in(&mut self, slot: usize, why: Option<String>) {
        if let Some(c) = self.inbound.get_mut(slot).and_then(Option::take) {
            self.unregister(c.s.as_raw_fd());
            if let Some(why) = why {
                tracing::warn!(error = %why, "peer connection closed");
            }
        }
    }

    fn service_in(&mut self, slot: usize) {
        let Some(c) = self.inbound.get_mut(slot).and_then(Option::as_mut) else {
            return;
        };
        if c.wbuf.pending() > 0 {
            if let Err(e) = c.wbuf.flush(&mut c.s) {
                return self.close_in(slot, Some(format!("writing an Ack: {e}")));
            }
        }
        let limit = if self.events.len() < INBOUND_BOUND {
            MAX_FRAME_BYTES + 4
        } else {
            0 // back-pressure: leave it in the kernel
        };
        match read_into(&mut c.s, &mut c.rbuf, &mut self.scratch, limit) {
            Ok(true) => {}
            Ok(false) => {
                // End of stream: what arrived complete is still delivered.
                self.parse_in(slot);
                return self.close_in(slot, None);
            }
            Err(e) => return self.close_in(slot, Some(format!("reading: {e}"))),
        }
        self.parse_in(slot);
        self.update_in_interest(slot);
    }

    fn parse_in(&mut self, slot: usize) {
        while self.events.len() < INBOUND_BOUND {
            let Some(c) = self.inbound.get_mut(slot).and_then(Option::as_mut) else {
                return;
            };
            let gen = c.gen;
            match c.rbuf.take_frame() {
                Ok(Some(msg)) => {
                    let reply =
                        matches!(msg, PeerMsg::Done { .. }).then_some(Reply::Conn { slot, gen });
                    self.events.push_back(PeerEvent::Msg { msg, reply });
                }
                Ok(None) => return,
                Err(e) => return self.close_in(slot, Some(format!("bad frame: {e}"))),
            }
        }
    }

    fn update_in_interest(&mut self, slot: usize) {
        let Some(c) = self.inbound.get(slot).and_then(Option::as_ref) else {
            return;
        };
        let want = c.wbuf.pending() > 0;
        if want != c.want_out {
            let fd = c.s.as_raw_fd();
            if self.ctl(libc::EPOLL_CTL_MOD, fd, slot as u64, want).is_ok() {
                if let Some(c) = self.inbound[slot].as_mut() {
                    c.want_out = want;
                }
            }
        }
    }

    fn reply(&mut self, slot: usize, gen: u64, ack: &PeerMsg) -> bool {
        let Ok(bytes) = encode_frame(ack) else {
            return false;
        };
        let Some(c) = self.inbound.get_mut(slot).and_then(Option::as_mut) else {
            return false;
        };
        if c.gen != gen {
            return false;
        }
        c.wbuf.data.extend_from_slice(&bytes);
        if let Err(e) = c.wbuf.flush(&mut c.s) {
            self.close_in(slot, Some(format!("writing an Ack: {e}")));
            return false;
        }
        self.update_in_interest(slot);
        true
    }

    fn send(&mut self, o: Outbound) -> bool {
        let Outbound { to, msg } = o;
        let id = migration_id(&msg);
        let what = kind(&msg);
        if what == "done" && self.failed_batches.contains(&id) {
            return true; // its batch failed: reported already
        }
        let bytes = match encode_frame(&msg) {
            Ok(b) => b,
            Err(e) => {
                self.report_failed(id, what, &to, e.to_string());
                return true;
            }
        };
        let slot = match self.out_slot(&to) {
            Ok(s) => s,
            Err(e) => {
                self.report_failed(id, what, &to, e);
                return true;
            }
        };
        let Some(c) = self.outbound[slot].as_mut() else {
            return false;
        };
        if c.wbuf.pending() + bytes.len() > OUT_BUF_MAX {
            return false;
        }
        c.queued += bytes.len() as u64;
        c.wbuf.data.extend_from_slice(&bytes);
        c.unsent.push_back(Unsent {
            end: c.queued,
            id,
            what,
        });
        if what == "done" {
            c.awaiting_ack.push_back(id);
        }
        self.flush_out(slot);
        true
    }

    fn report_failed(&mut self, id: u64, what: &'static str, to: &str, error: String) {
        if what == "batch" {
            if self.failed_batches.len() >= 64 {
                self.failed_batches.pop_front();
            }
            self.failed_batches.push_back(id);
        }
        self.events.push_back(PeerEvent::SendFailed {
            id,
            what,
            to: to.to_string(),
            error,
        });
    }

    /// The slot of the connection to `to`, connecting if there is none.
    fn out_slot(&mut self, to: &str) -> Result<usize, String> {
        if let Some(i) = self
            .outbound
            .iter()
            .position(|c| c.as_ref().is_some_and(|c| c.to == to))
        {
            return Ok(i);
        }
        let slot = match self.outbound.iter().position(Option::is_none) {
            Some(i) => i,
            None => {
                // All in use: drop an idle one (nothing unsent, no Ack awaited).
                let idle = self
                    .outbound
                    .iter()
                    .position(|c| {
                        c.as_ref()
                            .is_some_and(|c| c.unsent.is_empty() && c.awaiting_ack.is_empty())
                    })
                    .ok_or_else(|| format!("{MAX_OUT_CONNECTIONS} peer connections busy"))?;
                self.close_out(idle, None);
                idle
            }
        };
        let s = connect_nonblocking(to).map_err(|e| format!("connect {to}: {e}"))?;
        self.ctl(
            libc::EPOLL_CTL_ADD,
            s.as_raw_fd(),
            OUT_TOKEN_BASE + slot as u64,
            false,
        )
        .map_err(|e| format!("epoll add: {e}"))?;
        self.outbound[slot] = Some(OutConn {
            to: to.to_string(),
            s,
            wbuf: Buf::default(),
            written: 0,
            queued: 0,
            unsent: VecDeque::new(),
            awaiting_ack: VecDeque::new(),
            rbuf: Buf::default(),
            want_out: false,
        });
        Ok(slot)
    }

    /// Closes an outgoing connection; with `error`, everything it had not delivered is
    /// reported failed.
    fn close_out(&mut self, slot: usize, error: Option<String>) {
        let Some(c) = self.outbound.get_mut(slot).and_then(Option::take) else {
            return;
        };
        self.unregister(c.s.as_raw_fd());
        let Some(error) = error else { return };
        let mut failed: Vec<(u64, &'static str)> =
            c.unsent.iter().map(|u| (u.id, u.what)).collect();
        for id in &c.awaiting_ack {
            if !failed.contains(&(*id, "done")) {
                failed.push((*id, "done"));
            }
        }
        for (id, what) in failed {
            self.report_failed(id, what, &c.to, error.clone());
        }
    }

    fn flush_out(&mut self, slot: usize) {
        let Some(c) = self.outbound.get_mut(slot).and_then(Option::as_mut) else {
            return;
        };
        match c.wbuf.flush(&mut c.s) {
            Ok(n) => {
                c.written += n as u64;
                while c.unsent.front().is_some_and(|u| u.end <= c.written) {
                    c.unsent.pop_front();
                }
            }
            Err(e) => {
                let to = c.to.clone();
                return self.close_out(slot, Some(format!("write {to}: {e}")));
            }
        }
        let want = c.wbuf.pending() > 0;
        if want != c.want_out {
            let fd = c.s.as_raw_fd();
            if self
                .ctl(libc::EPOLL_CTL_MOD, fd, OUT_TOKEN_BASE + slot as u64, want)
                .is_ok()
            {
                if let Some(c) = self.outbound[slot].as_mut() {
                    c.want_out = want;
                }
            }
        }
    }

    fn service_out(&mut self, slot: usize) {
        self.flush_out(slot);
        let Some(c) = self.outbound.get_mut(slot).and_then(Option::as_mut) else {
            return;
        };
        let open = match read_into(
            &mut c.s,
            &mut c.rbuf,
            &mut self.scratch,
            MAX_FRAME_BYTES + 4,
        ) {
            Ok(open) => open,
            Err(e) => {
                let to = c.to.clone();
                return self.close_out(slot, Some(format!("read from {to}: {e}")));
            }
        };
        loop {
            let Some(c) = self.outbound.get_mut(slot).and_then(Option::as_mut) else {
                return;
            };
            match c.rbuf.take_frame() {
                Ok(Some(ack @ PeerMsg::Ack { .. })) => {
                    let id = migration_id(&ack);
                    c.awaiting_ack.retain(|a| *a != id);
                    self.events.push_back(PeerEvent::Ack(ack));
                }
                Ok(Some(other)) => {
                    let to = c.to.clone();
                    let what = kind(&other);
                    return self
                        .close_out(slot, Some(format!("{to} sent a {what} instead of an Ack")));
                }
                Ok(None) => break,
                Err(e) => {
                    let to = c.to.clone();
                    return self.close_out(slot, Some(format!("Ack from {to}: {e}")));
                }
            }
        }
        if !open {
            let Some(c) = self.outbound.get(slot).and_then(Option::as_ref) else {
                return;
            };
            let error = (!c.unsent.is_empty() || !c.awaiting_ack.is_empty())
                .then(|| format!("{} closed the connection", c.to));
            self.close_out(slot, error);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::migrate::{PauseInfo, WirePacket};
    use pliant_state::FlowKey;

    fn dir(tag: &str) -> std::path::PathBuf {
        std::env::temp_dir().join(format!("pliant-peer-{}-{tag}", std::process::id()))
    }

    fn key(p: u16) -> FlowKey {
        FlowKey::v4(17, [10, 0, 0, 1].into(), p, [10, 0, 0, 2].into(), 9).0
    }

    fn fwd(p: u16) -> PeerMsg {
        PeerMsg::Fwd {
            key: key(p),
            pkt: WirePacket {
                side: crate::nf::Side::Inside,
                vnet: [0; pliant_io::vnet::VNET_HDR_LEN],
                frame: vec![p as u8; 64],
            },
        }
    }

    fn ack(id: u64) -> PeerMsg {
        PeerMsg::Ack {
            id,
            imported: 1,
            import_failed: vec![],
            rejected: vec![],
            pause: PauseInfo::default(),
            returned: vec![],
        }
    }

    fn out(to: &str, msg: PeerMsg) -> Outbound {
        Outbound { to: to.into(), msg }
    }

    /// Pumps both links until `cond` holds on the events `b` delivered (bounded).
    fn pump_until(
        a: &mut PeerLink,
        b: &mut PeerLink,
        got: &mut Vec<PeerEvent>,
        cond: impl Fn(&[PeerEvent]) -> bool,
    ) {
        for _ in 0..2000 {
            a.pump(Instant::now(), true, PUMP_EVERY);
            b.pump(Instant::now(), true, PUMP_EVERY);
            while let Some(e) = b.next_event() {
                got.push(e);
            }
            if cond(got) {
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        panic!("condition not reached; events: {got:?}");
    }

    #[test]
    fn frames_arrive_in_order_and_the_ack_returns_on_the_same_connection() {
        let d = dir("order");
        let (pa, pb) = (d.join("a.sock"), d.join("b.sock"));
        let (_sa, mut a) = start(pa.to_str().unwrap()).unwrap();
        let (_sb, mut b) = start(pb.to_str().unwrap()).unwrap();
        let to = pb.to_str().unwrap();
        let batch = PeerMsg::Batch {
            id: 7,
            from: "a".into(),
            records: vec![vec![1, 2, 3]; 3],
        };
        assert!(a.send(out(to, batch.clone())));
        for p in 0..100 {
            assert!(a.send(out(to, fwd(p))));
        }
        let done = PeerMsg::Done {
            id: 7,
            from: "a".into(),
            release: vec![key(1)],
            kept: vec![],
        };
        assert!(a.send(out(to, done.clone())));
        let mut got = Vec::new();
        pump_until(&mut a, &mut b, &mut got, |g| g.len() == 102);
        let msgs: Vec<&PeerMsg> = got
            .iter()
            .map(|e| match e {
                PeerEvent::Msg { msg, .. } => msg,
                other => panic!("unexpected {other:?}"),
            })
            .collect();
        assert_eq!(msgs[0], &batch);
        for (i, m) in msgs[1..101].iter().enumerate() {
            assert_eq!(*m, &fwd(i as u16));
        }
        assert_eq!(msgs[101], &done);
        let Some(PeerEvent::Msg {
            reply: Some(reply), ..
        }) = got.pop()
        else {
            panic!("Done without a reply handle");
        };
        assert!(b.reply(reply, ack(7)));
        let mut acks = Vec::new();
        pump_until(&mut b, &mut a, &mut acks, |g| !g.is_empty());
        assert!(
            matches!(&acks[0], PeerEvent::Ack(PeerMsg::Ack { id: 7, .. })),
            "{acks:?}"
        );
        // The sleeping engine's fd exists and nothing is left pending.
        assert!(a.poll_fd().is_some() && !a.has_pending() && !b.has_pending());
        let _ = std::fs::remove_dir_all(d);
    }

    #[test]
    fn an_unreachable_destination_fails_the_batch_and_swallows_its_done() {
        let d = dir("unreach");
        let (_sa, mut a) = start(d.join("a.sock").to_str().unwrap()).unwrap();
        let nowhere = d.join("nobody.sock");
        let nowhere = nowhere.to_str().unwrap();
        let batch = PeerMsg::Batch {
            id: 3,
            from: "a".into(),
            records: vec![],
        };
        assert!(a.send(out(nowhere, batch)));
        let done = PeerMsg::Done {
            id: 3,
            from: "a".into(),
            release: vec![],
            kept: vec![],
        };
        assert!(a.send(out(nowhere, done)));
        let ev: Vec<PeerEvent> = std::iter::from_fn(|| a.next_event()).collect();
        assert_eq!(ev.len(), 1, "{ev:?}");
        assert!(
            matches!(
                &ev[0],
                PeerEvent::SendFailed {
                    id: 3,
                    what: "batch",
                    ..
                }
            ),
            "{ev:?}"
        );
        let _ = std::fs::remove_dir_all(d);
    }

    #[test]
    fn a_destination_that_dies_before_acking_fails_the_done() {
        let d = dir("dies");
        let (pa, pb) = (d.join("a.sock"), d.join("b.sock"));
        let (_sa, mut a) = start(pa.to_str().unwrap()).unwrap();
        let (sb, mut b) = start(pb.to_str().unwrap()).unwrap();
        let to = pb.to_str().unwrap();
        let done = PeerMsg::Done {
            id: 9,
            from: "a".into(),
            release: vec![],
            kept: vec![],
        };
        assert!(a.send(out(to, done)));
        let mut got = Vec::new();
        pump_until(&mut a, &mut b, &mut got, |g| g.len() == 1);
        drop((b, sb)); // the destination goes away without answering
        let mut failed = None;
        for _ in 0..2000 {
            a.pump(Instant::now(), true, PUMP_EVERY);
            if let Some(e) = a.next_event() {
                failed = Some(e);
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(
            matches!(
                failed,
                Some(PeerEvent::SendFailed {
                    id: 9,
                    what: "done",
                    ..
                })
            ),
            "{failed:?}"
        );
        let _ = std::fs::remove_dir_all(d);
    }

    #[test]
    fn a_bad_frame_closes_only_its_connection() {
        let d = dir("bad");
        let (pa, pb) = (d.join("a.sock"), d.join("b.sock"));
        let (_sa, mut a) = start(pa.to_str().unwrap()).unwrap();
        let (_sb, mut b) = start(pb.to_str().unwrap()).unwrap();
        let mut raw = UnixStream::connect(&pb).unwrap();
        // A length over the bound, then garbage: refused before allocating.
        raw.write_all(&u32::MAX.to_le_bytes()).unwrap();
        raw.write_all(&[0xff; 32]).unwrap();
        let mut undecodable = UnixStream::connect(&pb).unwrap();
        undecodable.write_all(&4u32.to_le_bytes()).unwrap();
        undecodable.write_all(&[0xff; 4]).unwrap();
        assert!(a.send(out(pb.to_str().unwrap(), fwd(5))));
        let mut got = Vec::new();
        pump_until(&mut a, &mut b, &mut got, |g| !g.is_empty());
        for _ in 0..20 {
            b.pump(Instant::now(), true, PUMP_EVERY);
            got.extend(std::iter::from_fn(|| b.next_event()));
        }
        assert_eq!(got.len(), 1, "{got:?}");
        assert!(matches!(&got[0], PeerEvent::Msg { msg, .. } if *msg == fwd(5)));
        // Both bad connections were closed by the replica.
        let mut buf = [0u8; 1];
        raw.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        assert_eq!(raw.read(&mut buf).unwrap_or(0), 0);
        undecodable
            .set_read_timeout(Some(Duration::from_secs(2)))
            .unwrap();
        assert_eq!(undecodable.read(&mut buf).unwrap_or(0), 0);
        let _ = std::fs::remove_dir_all(d);
    }

    #[test]
    fn a_slow_engine_back_pressures_the_sender_without_losing_messages() {
        let d = dir("bp");
        let (pa, pb) = (d.join("a.sock"), d.join("b.sock"));
        let (_sa, mut a) = start(pa.to_str().unwrap()).unwrap();
        let (_sb, mut b) = start(pb.to_str().unwrap()).unwrap();
        let to = pb.to_str().unwrap();
        let n = INBOUND_BOUND + 3000;
        for p in 0..n {
            assert!(a.send(out(to, fwd(p as u16))));
        }
        // The destination reads only up to its bound while nobody takes events.
        for _ in 0..50 {
            a.pump(Instant::now(), true, PUMP_EVERY);
            b.pump(Instant::now(), true, PUMP_EVERY);
        }
        assert!(b.has_pending());
        let mut got = Vec::new();
        pump_until(&mut a, &mut b, &mut got, |g| g.len() == n);
        for (i, e) in got.iter().enumerate() {
            assert!(
                matches!(e, PeerEvent::Msg { msg, .. } if *msg == fwd(i as u16)),
                "{i}"
            );
        }
        let _ = std::fs::remove_dir_all(d);
    }
}
