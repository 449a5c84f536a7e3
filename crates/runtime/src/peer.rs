//! The replica-to-replica peer channel: one listener per replica on a pliant-wire endpoint
//! (a unix socket, mode 0600 and peer uid checked with SO_PEERCRED, or TCP between hosts),
//! carrying [`PeerMsg`]s in sealed frames of kind `pliant_wire::kinds::PEER`. Every connection
//! is mutually authenticated first (both ends prove a CA-signed replica identity): the channel
//! imports flow state and injects packets, so it takes them only from replicas, and a `Batch`
//! or `Done` must name the certified sender (a replica migrates flows only as itself). Frames
//! carry implicit sequence numbers: one injected, replayed or reordered closes the connection.
//!
//! The handshake is blocking and takes round trips, so it runs on a short-lived thread per new
//! connection ([`MAX_HANDSHAKES`] at once at most), which hands the authenticated stream and its
//! session keys to the packet thread through a channel and an eventfd in the epoll set.
//! Messages sent to a destination whose connection is still being set up wait, in order,
//! within the same byte bound as unsent data.
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

use crate::migrate::{decode_body, Outbound, PeerEvent, PeerMsg, MAX_FRAME_BYTES};
use pliant_wire::endpoint::{euid, Endpoint, Listener, Stream};
use pliant_wire::session::{self, Expect, Opener, Sealer, SessionError};
use pliant_wire::{kinds, role, FrameError, Security};
use std::collections::VecDeque;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, SyncSender};
use std::sync::Arc;
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
/// Handshakes in progress at most (incoming and outgoing together); more incoming
/// connections are closed at once.
pub const MAX_HANDSHAKES: usize = 16;
/// How long an outgoing TCP connect may take (a unix connect is immediate).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Bound on a body: a frame adds its header and tag.
const MAX_WIRE_FRAME: usize =
    MAX_FRAME_BYTES + pliant_wire::frame::HEADER_LEN + pliant_wire::frame::TAG_LEN;

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

    /// Opens the connection to `to` if there is none (the handshake runs on its thread) and
    /// says where it stands; see [`PeerLink::connection`]. In-memory links are always up.
    pub fn connect(&mut self, to: &str) -> OutState {
        match &mut self.inner {
            Inner::Channels { .. } => OutState::Up,
            Inner::Sockets(s) => match s.out_slot(to) {
                Ok(_) => s.out_state(to),
                Err(e) => OutState::Failed(e),
            },
        }
    }

    /// Where the outgoing connection to `to` stands, without opening one: up, still
    /// connecting, or closed (with why, if it failed since it was opened).
    pub fn connection(&self, to: &str) -> OutState {
        match &self.inner {
            Inner::Channels { .. } => OutState::Up,
            Inner::Sockets(s) => s.out_state(to),
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

/// Where an outgoing peer connection stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OutState {
    /// Authenticated: a message sent now is written at once.
    Up,
    /// The connect or the handshake is still running.
    Connecting,
    /// No connection (closed, or it failed: why, when known).
    Failed(String),
}

/// The peer listener's handle: where it listens (a TCP port 0 resolved). The listener itself
/// lives in the link (its unix socket file goes with it).
pub struct PeerServer {
    endpoint: Endpoint,
}

impl PeerServer {
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }
}

/// Binds the peer endpoint `ep` (a unix path or `host:port`) as the identity in `sec`; the
/// returned link does the I/O on the caller's thread. A live server's socket or port is never
/// taken over.
pub fn start(ep: &str, sec: Security) -> Result<(PeerServer, PeerLink), String> {
    let ep: Endpoint = ep.parse().map_err(|e| format!("peer socket: {e}"))?;
    if let Endpoint::Unix(path) = &ep {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)
                .map_err(|e| format!("peer socket dir {}: {e}", dir.display()))?;
        }
    }
    let listener = Listener::bind(&ep, &sec.tcp).map_err(|e| format!("peer socket: {e}"))?;
    let endpoint = listener
        .local_endpoint()
        .map_err(|e| format!("peer socket {ep}: {e}"))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| format!("peer socket {ep}: {e}"))?;
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
    // SAFETY: plain syscall; the result is checked before use.
    let efd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if efd < 0 {
        return Err(format!("eventfd: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: `efd` is a fresh descriptor nobody else owns.
    let wake = Arc::new(unsafe { OwnedFd::from_raw_fd(efd) });
    let (done_tx, done_rx) = mpsc::channel();
    let s = Sockets {
        epoll,
        listener,
        sec,
        hs: Handshakes {
            tx: done_tx,
            rx: done_rx,
            wake,
            running: Arc::new(AtomicUsize::new(0)),
        },
        inbound: (0..MAX_CONNECTIONS).map(|_| None).collect(),
        outbound: (0..MAX_OUT_CONNECTIONS).map(|_| None).collect(),
        next_gen: 0,
        failed_batches: VecDeque::new(),
        events: VecDeque::new(),
        scratch: vec![0u8; READ_CHUNK],
        last_pump: None,
        last_out_error: None,
        refused: 0,
    };
    s.ctl(
        libc::EPOLL_CTL_ADD,
        s.listener.as_raw_fd(),
        TOKEN_LISTENER,
        false,
    )
    .map_err(|e| format!("epoll add listener: {e}"))?;
    s.ctl(
        libc::EPOLL_CTL_ADD,
        s.hs.wake.as_raw_fd(),
        TOKEN_HANDSHAKE,
        false,
    )
    .map_err(|e| format!("epoll add eventfd: {e}"))?;
    Ok((
        PeerServer { endpoint },
        PeerLink {
            inner: Inner::Sockets(Box::new(s)),
        },
    ))
}

/// A finished handshake, handed from its thread to the packet thread.
enum Handshaken {
    In(Result<Ready, String>),
    Out {
        slot: usize,
        gen: u64,
        r: Result<Ready, String>,
    },
}

/// An authenticated connection: the (non-blocking) stream and its session.
struct Ready {
    s: Stream,
    tx: Sealer,
    rx: Opener,
    peer: String,
}

struct Handshakes {
    tx: Sender<Handshaken>,
    rx: Receiver<Handshaken>,
    /// An eventfd in the epoll set, written when a handshake finishes.
    wake: Arc<OwnedFd>,
    running: Arc<AtomicUsize>,
}

impl Handshakes {
    /// Runs `f` on a new thread unless [`MAX_HANDSHAKES`] are running; its result goes to
    /// the packet thread. False when refused.
    fn spawn(&self, f: impl FnOnce() -> Handshaken + Send + 'static) -> bool {
        if self.running.fetch_add(1, Ordering::SeqCst) >= MAX_HANDSHAKES {
            self.running.fetch_sub(1, Ordering::SeqCst);
            return false;
        }
        let (tx, wake, running) = (self.tx.clone(), self.wake.clone(), self.running.clone());
        let spawned = std::thread::Builder::new()
            .name("peer-handshake".into())
            .spawn(move || {
                let _ = tx.send(f());
                running.fetch_sub(1, Ordering::SeqCst);
                let one: u64 = 1;
                // SAFETY: writes 8 bytes from a valid u64 to our eventfd.
                let _ = unsafe { libc::write(wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
            });
        if spawned.is_err() {
            self.running.fetch_sub(1, Ordering::SeqCst);
            return false;
        }
        true
    }

    fn drain_wake(&self) {
        let mut v: u64 = 0;
        // SAFETY: reads 8 bytes into a valid u64; EAGAIN is fine.
        let _ = unsafe { libc::read(self.wake.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
    }
}

fn ready(s: Stream, sess: session::Session) -> Result<Ready, String> {
    s.set_nonblocking(true)
        .map_err(|e| format!("non-blocking: {e}"))?;
    Ok(Ready {
        s,
        tx: sess.tx,
        rx: sess.rx,
        peer: sess.peer.name,
    })
}

/// The session options of the peer channel: replicas only, bodies up to the frame bound.
fn options(sec: &Security, tcp: bool) -> session::SessionOptions {
    let expect = Expect {
        name: None,
        roles: role::REPLICA,
    };
    sec.options_for(tcp, expect, MAX_FRAME_BYTES)
}

/// Seals `msg` as one peer frame appended to `out`. The size is checked before sealing:
/// sealing takes the next sequence number, so a frame sealed and then dropped would make
/// every later frame on the connection fail its tag at the peer.
fn seal(tx: &mut Sealer, msg: &PeerMsg, out: &mut Vec<u8>) -> Result<(), String> {
    let n = postcard::experimental::serialized_size(msg).map_err(|e| e.to_string())?;
    if n > MAX_FRAME_BYTES {
        return Err(format!(
            "peer message of {n} bytes exceeds the bound of {MAX_FRAME_BYTES}"
        ));
    }
    tx.seal_msg(kinds::PEER, msg, out)
        .map_err(|e| e.to_string())
}

const TOKEN_LISTENER: u64 = u64::MAX;
const TOKEN_HANDSHAKE: u64 = u64::MAX - 1;
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

    /// The next complete frame, opened with `rx`: `Ok(None)` when more bytes are needed.
    fn take_frame(&mut self, rx: &mut Opener) -> Result<Option<PeerMsg>, String> {
        let p = &mut self.data[self.pos..];
        let (kind, body, used) = match rx.open_front(p) {
            Ok(Some(f)) => f,
            Ok(None) => return Ok(None),
            Err(e) => return Err(e.to_string()),
        };
        if kind != kinds::PEER {
            return Err(FrameError::UnexpectedKind(kind).to_string());
        }
        let msg = decode_body(&p[body]).map_err(|e| e.to_string());
        self.consume(used);
        msg.map(Some)
    }

    /// A whole frame (or a header already over the bound) is buffered.
    fn has_frame(&self) -> bool {
        let p = &self.data[self.pos..];
        !matches!(
            pliant_wire::frame::split_frame(p, MAX_FRAME_BYTES + pliant_wire::frame::TAG_LEN),
            Ok(None)
        )
    }

    /// Writes as much as the socket takes; the number of bytes written.
    fn flush(&mut self, s: &mut Stream) -> std::io::Result<usize> {
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
    s: Stream,
    /// Session keys: Acks out, frames in.
    tx: Sealer,
    rx: Opener,
    /// The certified replica at the other end.
    peer: String,
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
    gen: u64,
    /// `None` while the handshake runs; messages then wait in `waiting`.
    s: Option<Stream>,
    tx: Option<Sealer>,
    rx: Option<Opener>,
    /// Messages sent before the session existed, in order, with their encoded size.
    waiting: VecDeque<(PeerMsg, usize)>,
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
    listener: Listener,
    sec: Security,
    hs: Handshakes,
    /// Incoming connections refused (uid, bound, handshake, identity).
    refused: u64,
    inbound: Vec<Option<InConn>>,
    outbound: Vec<Option<OutConn>>,
    next_gen: u64,
    /// Migrations whose batch was not delivered: their `Done` is not sent. Bounded.
    failed_batches: VecDeque<u64>,
    events: VecDeque<PeerEvent>,
    scratch: Vec<u8>,
    last_pump: Option<Instant>,
    /// Why the last outgoing connection that failed did (destination, error): answers a
    /// `peer_connect` whose connection closed before it was up.
    last_out_error: Option<(String, String)>,
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
    s: &mut Stream,
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
            } else if token == TOKEN_HANDSHAKE {
                self.hs.drain_wake();
                while let Ok(h) = self.hs.rx.try_recv() {
                    self.handshaken(h);
                }
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
                Ok(s) => s,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => return,
            };
            // On a unix socket the kernel also vouches for the uid: a second fence.
            if let Some(uid) = s.peer_uid() {
                if uid.ok() != Some(euid()) {
                    self.refused += 1;
                    tracing::warn!("peer connection refused: uid differs from the replica's");
                    continue;
                }
            }
            if self.inbound.iter().all(Option::is_some) {
                self.refused += 1;
                tracing::warn!("peer connection refused: {MAX_CONNECTIONS} connections open");
                continue;
            }
            let o = options(&self.sec, !s.is_unix());
            let id = self.sec.identity.clone();
            let started = self.hs.spawn(move || {
                let r = session::server(&s, &id, &o)
                    .map_err(|e| e.to_string())
                    .and_then(|sess| ready(s, sess));
                Handshaken::In(r)
            });
            if !started {
                self.refused += 1;
                tracing::warn!("peer connection refused: {MAX_HANDSHAKES} handshakes running");
            }
        }
    }

    /// A handshake finished: an incoming connection gets a slot, an outgoing one its session
    /// (and what waited for it is sealed and written).
    fn handshaken(&mut self, h: Handshaken) {
        match h {
            Handshaken::In(Err(e)) => {
                self.refused += 1;
                tracing::warn!(error = %e, "peer connection refused at the handshake");
            }
            Handshaken::In(Ok(r)) => {
                let Some(slot) = self.inbound.iter().position(Option::is_none) else {
                    self.refused += 1;
                    return;
                };
                if self
                    .ctl(libc::EPOLL_CTL_ADD, r.s.as_raw_fd(), slot as u64, false)
                    .is_err()
                {
                    return;
                }
                self.next_gen += 1;
                self.inbound[slot] = Some(InConn {
                    s: r.s,
                    tx: r.tx,
                    rx: r.rx,
                    peer: r.peer,
                    gen: self.next_gen,
                    rbuf: Buf::default(),
                    wbuf: Buf::default(),
                    want_out: false,
                });
                // Frames may have arrived with the handshake's last bytes.
                self.service_in(slot);
            }
            Handshaken::Out { slot, gen, r } => {
                let Some(c) = self.outbound.get_mut(slot).and_then(Option::as_mut) else {
                    return;
                };
                if c.gen != gen {
                    return; // the slot was closed and reused meanwhile
                }
                let r = match r {
                    Ok(r) => r,
                    Err(e) => {
                        let to = c.to.clone();
                        return self.close_out(slot, Some(format!("{to}: {e}")));
                    }
                };
                if let Err(e) = self.ctl(
                    libc::EPOLL_CTL_ADD,
                    r.s.as_raw_fd(),
                    OUT_TOKEN_BASE + slot as u64,
                    false,
                ) {
                    return self.close_out(slot, Some(format!("epoll add: {e}")));
                }
                let Some(c) = self.outbound[slot].as_mut() else {
                    return;
                };
                c.s = Some(r.s);
                let mut tx = r.tx;
                c.rx = Some(r.rx);
                while let Some((msg, _)) = c.waiting.pop_front() {
                    let at = c.wbuf.data.len();
                    if let Err(e) = seal(&mut tx, &msg, &mut c.wbuf.data) {
                        let to = c.to.clone();
                        c.tx = Some(tx);
                        return self.close_out(slot, Some(format!("{to}: {e}")));
                    }
                    c.queued += (c.wbuf.data.len() - at) as u64;
                    c.unsent.push_back(Unsent {
                        end: c.queued,
                        id: migration_id(&msg),
                        what: kind(&msg),
                    });
                    if kind(&msg) == "done" {
                        c.awaiting_ack.push_back(migration_id(&msg));
                    }
                }
                c.tx = Some(tx);
                self.flush_out(slot);
            }
        }
    }

    fn close_in(&mut self, slot: usize, why: Option<String>) {
        if let Some(c) = self.inbound.get_mut(slot).and_then(Option::take) {
            self.unregister(c.s.as_raw_fd());
            if why.is_some() {
                self.refused += 1;
            }
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
            MAX_WIRE_FRAME
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
            match c.rbuf.take_frame(&mut c.rx) {
                Ok(Some(msg)) => {
                    // State and hold releases are filed under `from`: only that replica
                    // itself may send them.
                    let claimed = match &msg {
                        PeerMsg::Batch { from, .. } | PeerMsg::Done { from, .. } => Some(from),
                        _ => None,
                    };
                    if let Some(from) = claimed.filter(|f| **f != c.peer) {
                        let why = format!(
                            "{} names {from:?} but the certificate is {:?}",
                            kind(&msg),
                            c.peer
                        );
                        return self.close_in(slot, Some(why));
                    }
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
        let Some(c) = self.inbound.get_mut(slot).and_then(Option::as_mut) else {
            return false;
        };
        if c.gen != gen {
            return false;
        }
        if let Err(e) = seal(&mut c.tx, ack, &mut c.wbuf.data) {
            tracing::warn!(error = %e, "peer Ack not sent");
            return false;
        }
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
        let Some(tx) = c.tx.as_mut() else {
            // The handshake is running: the message waits, bounded like unsent bytes.
            let size = postcard::experimental::serialized_size(&msg).unwrap_or(usize::MAX);
            let waiting: usize = c.waiting.iter().map(|(_, n)| n).sum();
            if waiting.saturating_add(size) > OUT_BUF_MAX {
                return false;
            }
            c.waiting.push_back((msg, size));
            return true;
        };
        let at = c.wbuf.data.len();
        if let Err(e) = seal(tx, &msg, &mut c.wbuf.data) {
            self.report_failed(id, what, &to, e);
            return true;
        }
        let n = c.wbuf.data.len() - at;
        if c.wbuf.pending() > OUT_BUF_MAX {
            // Over the bound: take it back. The sealer's sequence already moved, so the
            // connection cannot continue in order; close it, reporting what it held.
            c.wbuf.data.truncate(at);
            self.close_out(
                slot,
                Some(format!("{to}: more than {OUT_BUF_MAX} bytes unsent")),
            );
            return false;
        }
        c.queued += n as u64;
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

    fn out_state(&self, to: &str) -> OutState {
        match self.outbound.iter().flatten().find(|c| c.to == to) {
            Some(c) if c.tx.is_some() => OutState::Up,
            Some(_) => OutState::Connecting,
            None => OutState::Failed(match &self.last_out_error {
                Some((t, e)) if t == to => e.clone(),
                _ => format!("{to}: no connection"),
            }),
        }
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
        let ep: Endpoint = to.parse().map_err(|e| format!("{to}: {e}"))?;
        // A unix connect is immediate and non-blocking (a destination that is gone or hung
        // fails here, at once); TCP connects on the handshake thread.
        let early = match &ep {
            Endpoint::Unix(p) => Some(Stream::Unix(
                connect_nonblocking(&p.to_string_lossy())
                    .map_err(|e| format!("connect {to}: {e}"))?,
            )),
            Endpoint::Tcp(_) => None,
        };
        self.next_gen += 1;
        let gen = self.next_gen;
        let (id, tcp, o) = (
            self.sec.identity.clone(),
            self.sec.tcp,
            options(&self.sec, ep.is_tcp()),
        );
        let started = self.hs.spawn(move || {
            let r = (|| {
                let s = match early {
                    Some(s) => {
                        s.set_nonblocking(false).map_err(|e| e.to_string())?;
                        s
                    }
                    None => pliant_wire::endpoint::connect(&ep, CONNECT_TIMEOUT, &tcp)
                        .map_err(|e| format!("connect: {e}"))?,
                };
                let sess = session::client(&s, &id, &o).map_err(|e: SessionError| e.to_string())?;
                ready(s, sess)
            })();
            Handshaken::Out { slot, gen, r }
        });
        if !started {
            return Err(format!("{MAX_HANDSHAKES} peer handshakes running"));
        }
        self.outbound[slot] = Some(OutConn {
            to: to.to_string(),
            gen,
            s: None,
            tx: None,
            rx: None,
            waiting: VecDeque::new(),
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
        if let Some(s) = &c.s {
            self.unregister(s.as_raw_fd());
        }
        let Some(error) = error else { return };
        self.last_out_error = Some((c.to.clone(), error.clone()));
        let mut failed: Vec<(u64, &'static str)> =
            c.unsent.iter().map(|u| (u.id, u.what)).collect();
        failed.extend(c.waiting.iter().map(|(m, _)| (migration_id(m), kind(m))));
        for id in &c.awaiting_ack {
            if !failed.contains(&(*id, "done")) {
                failed.push((*id, "done"));
            }
        }
        for (id, what) in failed {
            // A Done whose batch failed on this very connection is swallowed (as `send`
            // does): releasing holds without the state would be wrong.
            if what == "done" && self.failed_batches.contains(&id) {
                continue;
            }
            self.report_failed(id, what, &c.to, error.clone());
        }
    }

    fn flush_out(&mut self, slot: usize) {
        let Some(c) = self.outbound.get_mut(slot).and_then(Option::as_mut) else {
            return;
        };
        let Some(s) = c.s.as_mut() else {
            return; // still handshaking
        };
        match c.wbuf.flush(s) {
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
            let Some(fd) = c.s.as_ref().map(AsRawFd::as_raw_fd) else {
                return;
            };
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
        let Some(s) = c.s.as_mut() else {
            return;
        };
        let open = match read_into(s, &mut c.rbuf, &mut self.scratch, MAX_WIRE_FRAME) {
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
            let Some(rx) = c.rx.as_mut() else {
                return;
            };
            match c.rbuf.take_frame(rx) {
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

/// A replica identity `name` under one CA shared by the tests of this crate.
#[cfg(test)]
pub(crate) fn test_security(name: &str) -> Security {
    static CA: std::sync::OnceLock<pliant_wire::Ca> = std::sync::OnceLock::new();
    let ca = CA.get_or_init(|| pliant_wire::Ca::generate(None).expect("CA"));
    Security::new(ca.issue(name, role::REPLICA, 3600).expect("identity"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::migrate::{PauseInfo, WirePacket};
    use pliant_state::FlowKey;
    use pliant_wire::Conn;

    fn sec(name: &str) -> Security {
        test_security(name)
    }

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
        let (_sa, mut a) = start(pa.to_str().unwrap(), sec("a")).unwrap();
        let (_sb, mut b) = start(pb.to_str().unwrap(), sec("b")).unwrap();
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
        let (_sa, mut a) = start(d.join("a.sock").to_str().unwrap(), sec("a")).unwrap();
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
        let (_sa, mut a) = start(pa.to_str().unwrap(), sec("a")).unwrap();
        let (sb, mut b) = start(pb.to_str().unwrap(), sec("b")).unwrap();
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

    /// True once the replica closed `s` (EOF or reset) within a bounded wait.
    fn closed(s: &mut impl Read) -> bool {
        let mut buf = [0u8; 256];
        loop {
            match s.read(&mut buf) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(e) => return e.kind() == ErrorKind::ConnectionReset,
            }
        }
    }

    /// An authenticated connection to `to` as replica `name`, for hand-made frames.
    fn raw_peer(to: &std::path::Path, name: &str) -> Conn {
        let s = Stream::Unix(UnixStream::connect(to).unwrap());
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let b = std::thread::spawn({
            let name = name.to_string();
            move || Conn::client(s, &sec(&name).identity, &Default::default())
        });
        b.join().unwrap().unwrap()
    }

    /// Drives `b` (the destination) while `f` runs on another thread.
    fn pumping<T: Send + 'static>(b: &mut PeerLink, f: impl FnOnce() -> T + Send + 'static) -> T {
        let h = std::thread::spawn(f);
        while !h.is_finished() {
            b.pump(Instant::now(), true, PUMP_EVERY);
            std::thread::sleep(Duration::from_millis(1));
        }
        h.join().unwrap()
    }

    #[test]
    fn a_bad_frame_closes_only_its_connection() {
        let d = dir("bad");
        let (pa, pb) = (d.join("a.sock"), d.join("b.sock"));
        let (_sa, mut a) = start(pa.to_str().unwrap(), sec("a")).unwrap();
        let (_sb, mut b) = start(pb.to_str().unwrap(), sec("b")).unwrap();
        // Garbage instead of a handshake (a length over any bound): refused, closed.
        let mut raw = UnixStream::connect(&pb).unwrap();
        raw.write_all(&u32::MAX.to_le_bytes()).unwrap();
        raw.write_all(&[0xff; 32]).unwrap();
        raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        // Authenticated, then an undecodable body; then a declared huge frame.
        let pb2 = pb.clone();
        let (mut undecodable, mut huge) = pumping(&mut b, move || {
            let mut u = raw_peer(&pb2, "c");
            u.writer.send_bytes(kinds::PEER, &[0xff; 4]).unwrap();
            let h = raw_peer(&pb2, "c");
            let hdr = pliant_wire::frame::Header {
                len: u32::MAX,
                version: pliant_wire::PROTOCOL_VERSION,
                kind: kinds::PEER,
            };
            h.writer.stream().send_all(&hdr.encode()).unwrap();
            (
                u.reader.stream().try_clone().unwrap(),
                h.reader.stream().try_clone().unwrap(),
            )
        });
        assert!(a.send(out(pb.to_str().unwrap(), fwd(5))));
        let mut got = Vec::new();
        pump_until(&mut a, &mut b, &mut got, |g| !g.is_empty());
        for _ in 0..20 {
            b.pump(Instant::now(), true, PUMP_EVERY);
            got.extend(std::iter::from_fn(|| b.next_event()));
        }
        assert_eq!(got.len(), 1, "{got:?}");
        assert!(matches!(&got[0], PeerEvent::Msg { msg, .. } if *msg == fwd(5)));
        // The three bad connections were closed by the replica.
        assert!(pumping(&mut b, move || closed(&mut raw)));
        assert!(pumping(&mut b, move || closed(&mut undecodable)));
        assert!(pumping(&mut b, move || closed(&mut huge)));
        let _ = std::fs::remove_dir_all(d);
    }

    /// Flow state is filed under the Batch's `from`: a replica certified as "c" claiming to
    /// be "a" is cut off before the engine sees anything, and a stranger (another CA) never
    /// gets past the handshake.
    #[test]
    fn a_batch_naming_another_replica_and_strangers_are_refused() {
        let d = dir("impostor");
        let pb = d.join("b.sock");
        let (_sb, mut b) = start(pb.to_str().unwrap(), sec("b")).unwrap();
        let pb2 = pb.clone();
        let mut c = pumping(&mut b, move || raw_peer(&pb2, "c"));
        let forged = PeerMsg::Batch {
            id: 1,
            from: "a".into(),
            records: vec![vec![9; 8]],
        };
        c.send(kinds::PEER, &forged).unwrap();
        let mut s = c.reader.stream().try_clone().unwrap();
        assert!(pumping(&mut b, move || closed(&mut s)));
        assert!(
            b.next_event().is_none(),
            "the forged batch reached the engine"
        );
        let pb3 = pb.clone();
        let stranger = pumping(&mut b, move || {
            let mut id = pliant_wire::Ca::generate(None)
                .unwrap()
                .issue("a", role::REPLICA, 60)
                .unwrap();
            id.ca_pub = sec("x").identity.ca_pub;
            let s = Stream::Unix(UnixStream::connect(&pb3).unwrap());
            Conn::client(s, &id, &Default::default()).err()
        });
        assert!(
            stranger.is_some(),
            "a certificate of another CA was accepted"
        );
        // The server's side of that handshake reports on the next pumps.
        let refused = |b: &PeerLink| match &b.inner {
            Inner::Sockets(sk) => sk.refused,
            Inner::Channels { .. } => 0,
        };
        for _ in 0..5000 {
            if refused(&b) >= 2 {
                break;
            }
            b.pump(Instant::now(), true, PUMP_EVERY);
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(refused(&b), 2);
        let _ = std::fs::remove_dir_all(d);
    }

    /// The same channel between hosts: TCP endpoints, encrypted frames.
    #[test]
    fn frames_and_acks_cross_tcp() {
        let (sa, mut a) = start("127.0.0.1:0", sec("a")).unwrap();
        let (sb, mut b) = start("127.0.0.1:0", sec("b")).unwrap();
        assert!(sa.endpoint().is_tcp());
        let to = match sb.endpoint() {
            Endpoint::Tcp(a) => a.clone(),
            e => panic!("{e}"),
        };
        let done = PeerMsg::Done {
            id: 4,
            from: "a".into(),
            release: vec![key(1)],
            kept: vec![],
        };
        for p in 0..10 {
            assert!(a.send(out(&to, fwd(p))));
        }
        assert!(a.send(out(&to, done.clone())));
        let mut got = Vec::new();
        pump_until(&mut a, &mut b, &mut got, |g| g.len() == 11);
        let Some(PeerEvent::Msg {
            msg,
            reply: Some(reply),
        }) = got.pop()
        else {
            panic!("{got:?}");
        };
        assert_eq!(msg, done);
        assert!(b.reply(reply, ack(4)));
        let mut acks = Vec::new();
        pump_until(&mut b, &mut a, &mut acks, |g| !g.is_empty());
        assert!(
            matches!(&acks[0], PeerEvent::Ack(PeerMsg::Ack { id: 4, .. })),
            "{acks:?}"
        );
    }

    #[test]
    fn a_slow_engine_back_pressures_the_sender_without_losing_messages() {
        let d = dir("bp");
        let (pa, pb) = (d.join("a.sock"), d.join("b.sock"));
        let (_sa, mut a) = start(pa.to_str().unwrap(), sec("a")).unwrap();
        let (_sb, mut b) = start(pb.to_str().unwrap(), sec("b")).unwrap();
        let to = pb.to_str().unwrap();
        let n = INBOUND_BOUND + 3000;
        for p in 0..n {
            assert!(a.send(out(to, fwd(p as u16))));
        }
        // The destination reads only up to its bound while nobody takes events (the
        // connection first needs its handshake, on other threads).
        for _ in 0..5000 {
            a.pump(Instant::now(), true, PUMP_EVERY);
            b.pump(Instant::now(), true, PUMP_EVERY);
            if b.has_pending() {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
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
