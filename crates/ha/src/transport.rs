//! The replication channel: [`ReplServer`] on the backup, one [`ReplSender`] per backup
//! destination on the primary.
//!
//! Any endpoint of pliant-wire: a unix socket (mode 0600, peer uid also checked with
//! SO_PEERCRED on both ends) or TCP between hosts. Every connection starts with the mutual
//! handshake of `pliant_wire::session` (both ends prove a CA-signed replica identity; the
//! sender also checks that it reached the backup it was told about), then carries
//! [`crate::wire::ReplMsg`]s in sealed frames of kind `pliant_wire::kinds::REPL`: each frame
//! authenticated (encrypted over TCP by default) with an implicit sequence number, so a frame
//! injected, replayed or reordered on the link closes it. `Hello` must name the certified
//! identity: a replica checkpoints only as itself. The packet thread never blocks on a socket:
//! [`ReplSender::send`] writes a checkpoint itself only with a non-blocking send(2) (what the
//! socket does not take at once, the ship thread writes), else hands it to the ship thread
//! through a bounded channel; acks come through a non-blocking [`ReplSender::poll`] and a
//! wake-up fd ([`ReplSender::wake_fd`], an eventfd) it can add to poll(2).
//!
//! Protocol on one connection (primary -> backup on the left):
//! ```text
//!   handshake (auth)                    <-> handshake
//!   Hello { primary, token }             -> Welcome { held }   (or Refused: fenced token)
//!   Checkpoint(g, seq)                   -> Ack { g, seq }     after StandbyStore::apply
//!                                                              (or Refused, then close)
//!   Heartbeat (when idle for `heartbeat`) -> Ack of the latest (g, seq) applied on this
//!                                           connection, Ack { 0, 0 } before any
//! ```
//! Every `Checkpoint` and `Heartbeat` gets exactly one answer, so the sender knows how many
//! answers are outstanding. Acks are cumulative per group; group 0 (the unprotected group,
//! never checkpointed) only proves liveness.
//!
//! Dead detection (sender): a frame is outstanding and nothing came back from the backup for
//! `dead_after` (heartbeats keep something outstanding on an idle link), or EOF/reset, or a
//! `Refused`, or no live connection within `dead_after` of the start => [`LinkState::Dead`].
//! A sender never leaves `Dead`: the runtime runs the groups unprotected and asks the
//! controller for a new backup, which means a new `ReplSender`.
//!
//! Latency: each frame is one `send(2)` (length prefix and body in one buffer) with
//! `MSG_NOSIGNAL`; the backup reads through a buffer, so a small checkpoint costs one read,
//! one apply and one write there. Unix stream sockets have no Nagle delay to disable; the
//! remaining cost is thread wake-ups (packet thread -> sender thread -> backup thread ->
//! sender's reader thread -> packet thread), measured by `examples/repl_rtt.rs`.

use crate::standby::StandbyStore;
use crate::wire::{Ack, Checkpoint, GroupId, ReplMsg, MAX_FRAME};
use pliant_wire::endpoint::{euid, Endpoint, Listener, Stream};
use pliant_wire::server::{self as wire_server, ConnThreads, ServerSocket, SpawnRefused};
use pliant_wire::session::{self, Expect, Opener, Sealer};
use pliant_wire::{kinds, role, FrameError, Security};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use std::io::{self, BufReader, Read};
use std::ops::ControlFlow;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use thiserror::Error;

/// Bound on concurrent connections (each has a thread) a server accepts; more are closed at
/// once and counted in `over_bound`.
pub const MAX_CONNECTIONS: usize = 64;
/// Time a new connection gets for `Hello` after the handshake on the server.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(2);
/// A server closes a connection that sent nothing for this long (a live sender heartbeats
/// every few ms; this only reclaims threads of peers that vanished without EOF).
pub const SERVER_IDLE_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest primary name accepted in `Hello`.
pub const MAX_PRIMARY_NAME: usize = 255;
/// Read buffer per connection: a typical checkpoint frame arrives in one read.
const READ_BUF: usize = 64 << 10;

#[derive(Debug, Error)]
pub enum TransportError {
    #[error("replication listener: {0}")]
    Bind(#[from] pliant_wire::BindError),
    #[error("replication listener: {0}")]
    Start(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum SendError {
    #[error("replication queue full")]
    Full,
    #[error("replication link is dead")]
    Dead,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum LinkState {
    Connecting,
    /// Authenticated and greeted; `welcome` is what the backup already held of this primary
    /// per group (highest applied seq) when the connection started.
    Up {
        welcome: Vec<(GroupId, u64)>,
    },
    Dead {
        reason: String,
    },
}

#[derive(Debug, Clone)]
pub struct SenderOptions {
    /// Pause between connection attempts.
    pub retry: Duration,
    /// No answer from the backup for this long while something is outstanding (or no live
    /// connection this long after start) => Dead.
    pub dead_after: Duration,
    /// A Heartbeat is sent after this long without any frame sent. Keep it well below
    /// `dead_after` (several answers per window) and below [`SERVER_IDLE_TIMEOUT`].
    pub heartbeat: Duration,
    /// Bound on checkpoints queued for the sender thread (at least 1).
    pub max_queued: usize,
}

impl Default for SenderOptions {
    fn default() -> Self {
        SenderOptions {
            retry: Duration::from_millis(5),
            dead_after: Duration::from_millis(60),
            heartbeat: Duration::from_millis(10),
            max_queued: 1024,
        }
    }
}

impl SenderOptions {
    /// Defaults for a link over `ep`. A unix socket is on this host: a dead backup process is
    /// an EOF at once and a live one answers in microseconds, so 60 ms of silence is death.
    /// Over TCP one lost segment costs a retransmission timeout (200 ms minimum on Linux)
    /// before the answer arrives: the link must survive that, so silence means death only
    /// after 600 ms (a killed backup process still shows as a reset at once).
    pub fn for_endpoint(ep: &Endpoint) -> SenderOptions {
        let mut o = SenderOptions::default();
        if ep.is_tcp() {
            o.dead_after = Duration::from_millis(600);
            o.heartbeat = Duration::from_millis(50);
        }
        o
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct SenderStats {
    pub bytes_sent: u64,
    pub frames_sent: u64,
    pub checkpoints: u64,
    /// Checkpoints the caller of `send` wrote itself (nothing queued before them), of
    /// `checkpoints`; the rest went through the ship thread's queue.
    pub checkpoints_direct: u64,
    /// Direct writes the socket did not take whole (the ship thread wrote the rest).
    pub direct_backlogged: u64,
    pub heartbeats: u64,
    /// Frames received from the backup (acks of either kind).
    pub acks: u64,
    pub connect_attempts: u64,
    /// Connection attempts after the first.
    pub reconnects: u64,
    /// `send` calls refused because the queue was full.
    pub queue_full: u64,
    /// Ship-to-ack time of the most recent checkpoint whose ack arrived, in microseconds.
    pub rtt_us_last: u64,
    pub rtt_us_max: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ServerStats {
    pub connections: u64,
    /// Connections open now.
    pub active: u64,
    /// Handshakes refused: certificate not the CA's, expired, no replica role, bad signature.
    pub auth_failures: u64,
    /// `Hello` naming another replica than the certified identity (refused).
    pub identity_mismatch: u64,
    /// Peers that closed or stalled during the handshake.
    pub handshake_aborted: u64,
    /// Peers refused by the SO_PEERCRED uid check.
    pub peer_refused: u64,
    /// Connections closed at once because `MAX_CONNECTIONS` were open.
    pub over_bound: u64,
    pub frames: u64,
    pub bytes_in: u64,
    pub decode_errors: u64,
    /// Well-formed frames that break the protocol (no Hello first, backup-side messages...).
    pub protocol_errors: u64,
    /// `Refused` answers (fenced token, checkpoint refused by the store).
    pub refused: u64,
    pub checkpoints: u64,
    pub acks_sent: u64,
}

// ---------------------------------------------------------------------------------------------
// Server (backup side)

#[derive(Default)]
struct ServerCounters {
    connections: AtomicU64,
    active: AtomicU64,
    auth_failures: AtomicU64,
    identity_mismatch: AtomicU64,
    handshake_aborted: AtomicU64,
    peer_refused: AtomicU64,
    over_bound: AtomicU64,
    frames: AtomicU64,
    bytes_in: AtomicU64,
    decode_errors: AtomicU64,
    protocol_errors: AtomicU64,
    refused: AtomicU64,
    checkpoints: AtomicU64,
    acks_sent: AtomicU64,
}

struct ServerShared {
    sec: Security,
    store: Arc<Mutex<StandbyStore>>,
    stop: AtomicBool,
    c: ServerCounters,
    conns: ConnThreads,
}

/// The backup's replication listener. Drop stops the accept thread, closes every connection,
/// joins the threads and unlinks a unix socket (if it is still the one this server bound).
pub struct ReplServer {
    socket: ServerSocket,
    shared: Arc<ServerShared>,
}

impl ReplServer {
    /// Listens at `ep` (a unix socket is mode 0600; a stale socket file left by a dead
    /// process is replaced; a live server's socket or port is `Bind(InUse)`). Every
    /// authenticated connection gets a reader thread (at most [`MAX_CONNECTIONS`]) that
    /// applies checkpoints to `store` and answers `Ack` only after `apply` returned Ok (the
    /// checkpoint is in the backup's memory, as in Remus). Refusals answer `Refused` and close
    /// the connection.
    pub fn start(
        ep: &Endpoint,
        sec: Security,
        store: Arc<Mutex<StandbyStore>>,
    ) -> Result<ReplServer, TransportError> {
        let shared = Arc::new(ServerShared {
            sec,
            store,
            stop: AtomicBool::new(false),
            c: ServerCounters::default(),
            conns: ConnThreads::default(),
        });
        let sh = shared.clone();
        let tcp = shared.sec.tcp;
        let socket = ServerSocket::start(ep, &tcp, "ha-repl-accept", move |l, stop| {
            accept_loop(l, stop, sh)
        })
        .map_err(|e| match e {
            wire_server::StartError::Bind(b) => TransportError::Bind(b),
            e => TransportError::Start(e.to_string()),
        })?;
        tracing::info!(endpoint = %socket.endpoint(), "replication server listening");
        Ok(ReplServer { socket, shared })
    }

    /// Where the server listens (a TCP port 0 resolved).
    pub fn endpoint(&self) -> &Endpoint {
        self.socket.endpoint()
    }

    pub fn stats(&self) -> ServerStats {
        let c = &self.shared.c;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ServerStats {
            connections: l(&c.connections),
            active: l(&c.active),
            auth_failures: l(&c.auth_failures),
            identity_mismatch: l(&c.identity_mismatch),
            handshake_aborted: l(&c.handshake_aborted),
            peer_refused: l(&c.peer_refused),
            over_bound: l(&c.over_bound),
            frames: l(&c.frames),
            bytes_in: l(&c.bytes_in),
            decode_errors: l(&c.decode_errors),
            protocol_errors: l(&c.protocol_errors),
            refused: l(&c.refused),
            checkpoints: l(&c.checkpoints),
            acks_sent: l(&c.acks_sent),
        }
    }
}

impl Drop for ReplServer {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.socket.stop_accepting();
        self.shared.conns.shutdown_and_join();
    }
}

fn accept_loop(listener: Listener, stop_r: UnixStream, sh: Arc<ServerShared>) {
    wire_server::accept_until_stopped(&listener, &stop_r, &sh.stop, "replication", |stream| {
        sh.c.connections.fetch_add(1, Ordering::Relaxed);
        let s2 = sh.clone();
        let spawned = sh
            .conns
            .spawn(stream, MAX_CONNECTIONS, "ha-repl-conn", move |stream| {
                s2.c.active.fetch_add(1, Ordering::Relaxed);
                serve_conn(stream, &s2);
                s2.c.active.fetch_sub(1, Ordering::Relaxed);
            });
        match spawned {
            Ok(()) => {}
            Err(SpawnRefused::OverBound(_closed_after_counting)) => {
                sh.c.over_bound.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    max = MAX_CONNECTIONS,
                    "replication connection refused: too many open"
                );
            }
            Err(e) => tracing::warn!(error = ?e, "replication connection dropped"),
        }
        ControlFlow::Continue(())
    });
}

/// Counts bytes read through it (for `bytes_in`).
struct Counting<R> {
    inner: R,
    n: u64,
}

impl<R: Read> Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.n += n as u64;
        Ok(n)
    }
}

enum ConnEnd {
    Closed,
    Error,
}

fn serve_conn(stream: Stream, sh: &ServerShared) {
    let c = &sh.c;
    if !wire_server::same_uid_peer(&stream, &c.peer_refused, "replication") {
        return;
    }
    let expect = Expect {
        name: None,
        roles: role::REPLICA,
    };
    let o = sh.sec.options_for(!stream.is_unix(), expect, MAX_FRAME);
    let sess = match session::server(&stream, &sh.sec.identity, &o) {
        Ok(s) => s,
        Err(e) => {
            return wire_server::count_handshake_failure(
                &e,
                &c.auth_failures,
                &c.handshake_aborted,
                "replication",
            )
        }
    };
    if stream.set_read_timeout(Some(HELLO_TIMEOUT)).is_err() {
        return;
    }
    let Ok(clone) = stream.try_clone() else {
        return;
    };
    let mut rd = Counting {
        inner: BufReader::with_capacity(READ_BUF, clone),
        n: 0,
    };
    let mut link = ServerLink {
        stream: &stream,
        tx: sess.tx,
        rx: sess.rx,
        out: Vec::new(),
        buf: Vec::new(),
    };
    let end = serve_frames(&mut link, &mut rd, &sess.peer.name, sh);
    if let ConnEnd::Error = end {
        tracing::debug!("replication connection closed after an error");
    }
}

/// The server's end of one authenticated connection.
struct ServerLink<'a> {
    stream: &'a Stream,
    tx: Sealer,
    rx: Opener,
    out: Vec<u8>,
    buf: Vec<u8>,
}

impl ServerLink<'_> {
    fn send(&mut self, m: &ReplMsg) -> bool {
        self.out.clear();
        self.tx.seal_msg(kinds::REPL, m, &mut self.out).is_ok()
            && self.stream.send_all(&self.out).is_ok()
    }

    fn read<R: Read>(&mut self, rd: &mut Counting<R>) -> Result<ReplMsg, FrameError> {
        let (kind, body) = self.rx.read(rd, &mut self.buf)?;
        if kind != kinds::REPL {
            return Err(FrameError::UnexpectedKind(kind));
        }
        pliant_wire::frame::decode_body(&self.buf[body])
    }
}

fn serve_frames<R: Read>(
    link: &mut ServerLink<'_>,
    rd: &mut Counting<R>,
    certified: &str,
    sh: &ServerShared,
) -> ConnEnd {
    let c = &sh.c;
    let read = |link: &mut ServerLink<'_>, rd: &mut Counting<R>| -> Result<ReplMsg, ConnEnd> {
        let before = rd.n;
        let r = link.read(rd);
        c.bytes_in.fetch_add(rd.n - before, Ordering::Relaxed);
        match r {
            Ok(m) => {
                c.frames.fetch_add(1, Ordering::Relaxed);
                Ok(m)
            }
            Err(FrameError::Closed) | Err(FrameError::Io(_)) => Err(ConnEnd::Closed),
            Err(e) => {
                c.decode_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(error = %e, "replication frame refused");
                Err(ConnEnd::Error)
            }
        }
    };
    let (primary, token) = match read(link, rd) {
        Ok(ReplMsg::Hello { primary, token }) if primary.len() <= MAX_PRIMARY_NAME => {
            if primary != certified {
                // Checkpoints are filed under the Hello's name: only the replica itself may
                // write its backup state, whatever else its certificate allows.
                c.identity_mismatch.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    primary,
                    certified,
                    "replication hello names another replica"
                );
                link.send(&ReplMsg::Refused {
                    reason: format!("hello names {primary:?} but the certificate is {certified:?}"),
                });
                return ConnEnd::Error;
            }
            (primary, token)
        }
        Ok(_) => {
            c.protocol_errors.fetch_add(1, Ordering::Relaxed);
            return ConnEnd::Error;
        }
        Err(e) => {
            // EOF right after a good handshake is a peer going away, not a bad frame.
            if let ConnEnd::Closed = e {
                c.handshake_aborted.fetch_add(1, Ordering::Relaxed);
            }
            return e;
        }
    };
    let welcome = {
        let store = lock(&sh.store);
        store
            .check_token(&primary, token)
            .map(|()| store.held(&primary))
    };
    let held = match welcome {
        Ok(h) => h,
        Err(e) => {
            c.refused.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(primary, token, error = %e, "replication refused at hello");
            link.send(&ReplMsg::Refused {
                reason: e.to_string(),
            });
            return ConnEnd::Error;
        }
    };
    if !link.send(&ReplMsg::Welcome { held }) {
        return ConnEnd::Closed;
    }
    tracing::info!(primary, token, "replication connection up");
    if link
        .stream
        .set_read_timeout(Some(SERVER_IDLE_TIMEOUT))
        .is_err()
    {
        return ConnEnd::Error;
    }
    let mut last = Ack { group: 0, seq: 0 };
    loop {
        let reply = match read(link, rd) {
            Ok(ReplMsg::Checkpoint(cp)) => {
                let r = lock(&sh.store).apply(&primary, token, &cp);
                match r {
                    Ok(seq) => {
                        c.checkpoints.fetch_add(1, Ordering::Relaxed);
                        last = Ack {
                            group: cp.group,
                            seq,
                        };
                        ReplMsg::Ack(last)
                    }
                    Err(e) => {
                        c.refused.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(primary, group = cp.group, seq = cp.seq, error = %e,
                            "checkpoint refused");
                        link.send(&ReplMsg::Refused {
                            reason: e.to_string(),
                        });
                        return ConnEnd::Error;
                    }
                }
            }
            Ok(ReplMsg::Heartbeat { .. }) => ReplMsg::Ack(last),
            Ok(_) => {
                c.protocol_errors.fetch_add(1, Ordering::Relaxed);
                return ConnEnd::Error;
            }
            Err(e) => return e,
        };
        if !link.send(&reply) {
            return ConnEnd::Closed;
        }
        c.acks_sent.fetch_add(1, Ordering::Relaxed);
    }
}

// ---------------------------------------------------------------------------------------------
// Sender (primary side)

/// An eventfd that is readable while something is waiting for the packet thread. `pending`
/// saves a write(2) per ack when the packet thread has not drained yet. `fd` is `None` only
/// when the process had no descriptor left (the link is then Dead from the start).
struct Wake {
    fd: Option<OwnedFd>,
    pending: AtomicBool,
}

impl Wake {
    fn new() -> io::Result<Wake> {
        // SAFETY: plain syscall; the result is checked before use.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Wake {
            // SAFETY: `fd` is a fresh descriptor we own.
            fd: Some(unsafe { OwnedFd::from_raw_fd(fd) }),
            pending: AtomicBool::new(false),
        })
    }

    fn raw(&self) -> RawFd {
        // poll(2) ignores negative descriptors.
        self.fd.as_ref().map_or(-1, |f| f.as_raw_fd())
    }

    fn signal(&self) {
        if !self.pending.swap(true, Ordering::SeqCst) {
            let one: u64 = 1;
            // SAFETY: writes 8 bytes from a valid u64. It cannot fail with EAGAIN: at most one
            // increment is outstanding, far from the counter's limit.
            let _ = unsafe {
                libc::write(
                    self.raw(),
                    (&one as *const u64).cast(),
                    std::mem::size_of::<u64>(),
                )
            };
        }
    }

    fn drain(&self) {
        // Clear first: a signal racing with the read then writes again (a spurious wake-up at
        // worst), never gets lost.
        self.pending.store(false, Ordering::SeqCst);
        let mut v: u64 = 0;
        // SAFETY: reads 8 bytes into a valid u64; EAGAIN (nothing pending) is fine.
        let _ = unsafe {
            libc::read(
                self.raw(),
                (&mut v as *mut u64).cast(),
                std::mem::size_of::<u64>(),
            )
        };
    }
}

#[derive(Default)]
struct SenderCounters {
    bytes_sent: AtomicU64,
    frames_sent: AtomicU64,
    checkpoints: AtomicU64,
    checkpoints_direct: AtomicU64,
    direct_backlogged: AtomicU64,
    heartbeats: AtomicU64,
    acks: AtomicU64,
    connect_attempts: AtomicU64,
    queue_full: AtomicU64,
    rtt_us_last: AtomicU64,
    rtt_us_max: AtomicU64,
}

struct Link {
    state: LinkState,
    /// Highest ack per group seen from the backup.
    acked: HashMap<GroupId, u64>,
    /// Acks not yet handed out by `poll` (newest per group).
    unreported: BTreeMap<GroupId, u64>,
    /// Highest seq shipped per group: an ack above it would release output for state the
    /// backup cannot hold, so it is a protocol violation (the link goes Dead).
    shipped: HashMap<GroupId, u64>,
    /// Frames sent that expect one answer each (checkpoints, heartbeats) and answers received.
    expecting: u64,
    answered: u64,
    /// Since when the backup owes an answer without having sent any frame.
    waiting_since: Option<Instant>,
    last_cp: Option<(GroupId, u64, Instant)>,
}

struct SenderShared {
    stop: AtomicBool,
    dead: AtomicBool,
    link: Mutex<Link>,
    wake: Wake,
    c: SenderCounters,
    /// The live connection, so Drop can shut it down and unblock both threads.
    conn: Mutex<Option<Stream>>,
    /// The sending half once greeted. Whichever thread sends a frame takes it: the caller of
    /// [`ReplSender::send`] ships a checkpoint itself when nothing queued is waiting before it
    /// (no hand-off to the ship thread on the output-commit path: one thread wake-up fewer per
    /// round trip), the ship thread ships queued checkpoints and heartbeats. Sealing and
    /// writing under one lock keeps the frames' order, which the session's sequence numbers
    /// require.
    txh: Mutex<Option<TxHalf>>,
    /// Checkpoints in the queue and not yet written (decremented under `txh` once written): a
    /// direct send happens only when it is 0, so nothing overtakes a queued checkpoint.
    queued: std::sync::atomic::AtomicUsize,
}

struct TxHalf {
    stream: Stream,
    tx: Sealer,
    frame: Vec<u8>,
    /// The tail of a frame the caller's non-blocking write left unsent (counted in `queued`
    /// until the ship thread has written it, so nothing goes out before it).
    backlog: Vec<u8>,
    last_tx: Instant,
}

/// What the ship thread is asked to do.
enum Job {
    Checkpoint(Checkpoint),
    /// Write the backlog a non-blocking direct write left.
    Flush,
}

/// How a frame is written.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Write {
    /// Blocking (the ship thread), bounded by the socket's write timeout.
    Blocking,
    /// The caller's: what the socket does not take at once goes to the backlog.
    NoWait,
}

impl SenderShared {
    /// Seals and writes one frame (the caller holds `txh`); bookkeeping of what the backup
    /// owes an answer for. An error is the link's death reason.
    fn ship(
        &self,
        h: &mut TxHalf,
        msg: &ReplMsg,
        cp_id: Option<(GroupId, u64)>,
        how: Write,
    ) -> Result<(), String> {
        debug_assert!(
            h.backlog.is_empty(),
            "a frame sealed before the backlog was written"
        );
        h.frame.clear();
        match h.tx.seal_msg(kinds::REPL, msg, &mut h.frame) {
            Ok(()) if h.frame.len() <= MAX_FRAME => {}
            // A checkpoint over MAX_FRAME cannot be shipped; the groups must go unprotected
            // rather than wait forever for its ack.
            Ok(()) => {
                return Err(format!(
                    "cannot ship {cp_id:?}: frame of {} bytes is over the {MAX_FRAME}-byte bound",
                    h.frame.len()
                ))
            }
            Err(e) => return Err(format!("cannot ship {cp_id:?}: {e}")),
        }
        {
            // Recorded before the write: the ack may arrive before send(2) returns.
            let now = Instant::now();
            let mut l = lock(&self.link);
            l.expecting += 1;
            l.waiting_since.get_or_insert(now);
            if let Some((g, seq)) = cp_id {
                let s = l.shipped.entry(g).or_insert(seq);
                *s = (*s).max(seq);
                l.last_cp = Some((g, seq, now));
            }
        }
        let err = |e: std::io::Error| format!("writing to the backup: {e}");
        match how {
            Write::Blocking => h.stream.send_all(&h.frame).map_err(err)?,
            Write::NoWait => {
                let mut done = 0;
                while done < h.frame.len() {
                    match h.stream.send_nowait(&h.frame[done..]) {
                        Ok(0) => return Err(err(std::io::ErrorKind::WriteZero.into())),
                        Ok(n) => done += n,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                        Err(e) => return Err(err(e)),
                    }
                }
                if done < h.frame.len() {
                    h.backlog.extend_from_slice(&h.frame[done..]);
                    self.queued.fetch_add(1, Ordering::AcqRel);
                }
            }
        }
        h.last_tx = Instant::now();
        self.c.frames_sent.fetch_add(1, Ordering::Relaxed);
        self.c
            .bytes_sent
            .fetch_add(h.frame.len() as u64, Ordering::Relaxed);
        match cp_id {
            Some(_) => self.c.checkpoints.fetch_add(1, Ordering::Relaxed),
            None => self.c.heartbeats.fetch_add(1, Ordering::Relaxed),
        };
        Ok(())
    }
}

impl SenderShared {
    fn set_state(&self, s: LinkState) {
        let mut l = lock(&self.link);
        if matches!(l.state, LinkState::Dead { .. }) {
            return;
        }
        if let LinkState::Dead { reason } = &s {
            if !self.stop.load(Ordering::SeqCst) {
                tracing::warn!(reason, "replication link dead");
            }
            self.dead.store(true, Ordering::SeqCst);
        }
        l.state = s;
        drop(l);
        self.wake.signal();
    }

    fn set_dead(&self, reason: String) {
        self.set_state(LinkState::Dead { reason });
        if let Some(s) = lock(&self.conn).as_ref() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }

    fn on_answer(&self, a: Ack) {
        self.c.acks.fetch_add(1, Ordering::Relaxed);
        let now = Instant::now();
        let mut l = lock(&self.link);
        l.answered += 1;
        l.waiting_since = (l.answered < l.expecting).then_some(now);
        if a.group == 0 {
            return; // heartbeat answer before any checkpoint: liveness only
        }
        let shipped = l.shipped.get(&a.group).copied();
        if shipped.is_none_or(|s| a.seq > s) {
            drop(l);
            self.set_dead(format!(
                "backup acknowledged group {} seq {} but only {shipped:?} was shipped",
                a.group, a.seq
            ));
            return;
        }
        let advanced = l.acked.get(&a.group).is_none_or(|&s| a.seq > s);
        if !advanced {
            return;
        }
        l.acked.insert(a.group, a.seq);
        l.unreported.insert(a.group, a.seq);
        if let Some((g, s, at)) = l.last_cp {
            if g == a.group && a.seq >= s {
                let us = now.duration_since(at).as_micros() as u64;
                self.c.rtt_us_last.store(us, Ordering::Relaxed);
                self.c.rtt_us_max.fetch_max(us, Ordering::Relaxed);
                l.last_cp = None;
            }
        }
        drop(l);
        self.wake.signal();
    }
}

/// The primary's end of one replication link (one backup destination).
pub struct ReplSender {
    tx: Option<SyncSender<Job>>,
    shared: Arc<SenderShared>,
    thread: Option<JoinHandle<()>>,
}

impl ReplSender {
    /// Starts a sender thread that connects to `ep` (retrying every `retry` until
    /// `dead_after` has passed without a live connection), runs the handshake (the peer must
    /// prove it is the replica `backup`), sends Hello{primary, token}, then
    /// ships queued checkpoints in order and sends a Heartbeat every `heartbeat` when idle.
    /// Never fails: a link that cannot be set up (even a thread that cannot start) is `Dead`
    /// with the reason.
    pub fn start(
        ep: &Endpoint,
        sec: Security,
        backup: &str,
        primary: &str,
        token: u64,
        opts: SenderOptions,
    ) -> ReplSender {
        let (wake, wake_err) = match Wake::new() {
            Ok(w) => (w, None),
            Err(e) => (
                Wake {
                    fd: None,
                    pending: AtomicBool::new(false),
                },
                Some(e),
            ),
        };
        let shared = Arc::new(SenderShared {
            stop: AtomicBool::new(false),
            dead: AtomicBool::new(false),
            link: Mutex::new(Link {
                state: LinkState::Connecting,
                acked: HashMap::new(),
                unreported: BTreeMap::new(),
                shipped: HashMap::new(),
                expecting: 0,
                answered: 0,
                waiting_since: None,
                last_cp: None,
            }),
            wake,
            c: SenderCounters::default(),
            conn: Mutex::new(None),
            txh: Mutex::new(None),
            queued: Default::default(),
        });
        let (tx, rx) = mpsc::sync_channel(opts.max_queued.max(1));
        if let Some(e) = wake_err {
            shared.set_dead(format!("no eventfd for the wake-up fd: {e}"));
            return ReplSender {
                tx: None,
                shared,
                thread: None,
            };
        }
        let sh = shared.clone();
        let target = Target {
            ep: ep.clone(),
            sec,
            backup: backup.to_string(),
            primary: primary.to_string(),
            token,
        };
        let thread = std::thread::Builder::new()
            .name("ha-repl-send".into())
            .spawn(move || run_link(&target, &opts, rx, &sh));
        let thread = match thread {
            Ok(t) => Some(t),
            Err(e) => {
                shared.set_dead(format!("cannot start the sender thread: {e}"));
                None
            }
        };
        ReplSender {
            tx: Some(tx),
            shared,
            thread,
        }
    }

    /// Never blocks: the checkpoint is written at once (non-blocking send(2)) when nothing queued
    /// waits before it and no other write holds the link, else queued for the ship thread.
    /// `Err(Full)` when the bounded queue is full (counted), `Err(Dead)` once the link is dead.
    pub fn send(&self, cp: Checkpoint) -> Result<(), SendError> {
        // Built by this process: a flow twice would be refused by the backup as a whole.
        debug_assert!(
            cp.duplicate_key().is_none(),
            "flow {:?} twice in checkpoint {} of group {}",
            cp.duplicate_key(),
            cp.seq,
            cp.group
        );
        if self.shared.dead.load(Ordering::SeqCst) {
            return Err(SendError::Dead);
        }
        let Some(tx) = &self.tx else {
            return Err(SendError::Dead);
        };
        let sh = &self.shared;
        // Shipped here when the link is up, nothing queued waits before it and no other send
        // is under way; else queued for the ship thread.
        if let Ok(mut g) = sh.txh.try_lock() {
            if let (Some(h), 0) = (g.as_mut(), sh.queued.load(Ordering::Acquire)) {
                let id = (cp.group, cp.seq);
                return match sh.ship(h, &ReplMsg::Checkpoint(cp), Some(id), Write::NoWait) {
                    Ok(()) => {
                        sh.c.checkpoints_direct.fetch_add(1, Ordering::Relaxed);
                        if !h.backlog.is_empty() {
                            // The socket took only part of it: the ship thread writes the rest
                            // (if the queue is full, it does before its next queued job).
                            sh.c.direct_backlogged.fetch_add(1, Ordering::Relaxed);
                            let _ = tx.try_send(Job::Flush);
                        }
                        Ok(())
                    }
                    Err(e) => {
                        drop(g);
                        sh.set_dead(e);
                        Err(SendError::Dead)
                    }
                };
            }
        }
        sh.queued.fetch_add(1, Ordering::AcqRel);
        match tx.try_send(Job::Checkpoint(cp)) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(_)) => {
                sh.queued.fetch_sub(1, Ordering::AcqRel);
                sh.c.queue_full.fetch_add(1, Ordering::Relaxed);
                Err(SendError::Full)
            }
            Err(TrySendError::Disconnected(_)) => {
                sh.queued.fetch_sub(1, Ordering::AcqRel);
                Err(SendError::Dead)
            }
        }
    }

    /// Non-blocking: appends the acks received since the last call (the newest, cumulative, per
    /// group that advanced) and returns the link state.
    pub fn poll(&self, acks: &mut Vec<Ack>) -> LinkState {
        let mut l = lock(&self.shared.link);
        acks.extend(l.unreported.iter().map(|(&group, &seq)| Ack { group, seq }));
        l.unreported.clear();
        l.state.clone()
    }

    /// Readable when acks or a state change are waiting. Call [`ReplSender::drain_wake`], then
    /// [`ReplSender::poll`] (in that order, so nothing arriving in between is missed).
    pub fn wake_fd(&self) -> RawFd {
        self.shared.wake.raw()
    }

    pub fn drain_wake(&self) {
        self.shared.wake.drain();
    }

    pub fn stats(&self) -> SenderStats {
        let c = &self.shared.c;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let attempts = l(&c.connect_attempts);
        SenderStats {
            bytes_sent: l(&c.bytes_sent),
            frames_sent: l(&c.frames_sent),
            checkpoints: l(&c.checkpoints),
            checkpoints_direct: l(&c.checkpoints_direct),
            direct_backlogged: l(&c.direct_backlogged),
            heartbeats: l(&c.heartbeats),
            acks: l(&c.acks),
            connect_attempts: attempts,
            reconnects: attempts.saturating_sub(1),
            queue_full: l(&c.queue_full),
            rtt_us_last: l(&c.rtt_us_last),
            rtt_us_max: l(&c.rtt_us_max),
        }
    }
}

impl Drop for ReplSender {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        drop(self.tx.take()); // wakes the sender thread (Disconnected)
        if let Some(s) = lock(&self.shared.conn).as_ref() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

enum Setup {
    Retry(String),
    Fatal(String),
}

/// Where and as whom a sender connects.
struct Target {
    ep: Endpoint,
    sec: Security,
    backup: String,
    primary: String,
    token: u64,
}

/// A greeted connection: the stream, the backup's held seqs, and the session's two halves.
struct Greeted {
    stream: Stream,
    welcome: Vec<(GroupId, u64)>,
    tx: Sealer,
    rx: Opener,
}

/// Connects, checks the peer, authenticates, says Hello and reads Welcome, within `deadline`.
fn connect_and_greet(t: &Target, deadline: Instant, sh: &SenderShared) -> Result<Greeted, Setup> {
    let left = || {
        deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1))
    };
    let s = pliant_wire::endpoint::connect(&t.ep, left(), &t.sec.tcp)
        .map_err(|e| Setup::Retry(format!("connect {}: {e}", t.ep)))?;
    // Registered at once, so a Drop during the handshake can shut it down instead of waiting
    // for the handshake timeout.
    let registered = s
        .try_clone()
        .map_err(|e| Setup::Fatal(format!("socket clone: {e}")))?;
    *lock(&sh.conn) = Some(registered);
    if sh.stop.load(Ordering::SeqCst) {
        return Err(Setup::Fatal("stopped".into()));
    }
    match s.peer_uid() {
        None => {}
        Some(Ok(uid)) if uid == euid() => {}
        Some(Ok(uid)) => return Err(Setup::Fatal(format!("backup socket is owned by uid {uid}"))),
        Some(Err(e)) => return Err(Setup::Fatal(format!("no peer credentials: {e}"))),
    }
    let expect = Expect {
        name: Some(t.backup.clone()),
        roles: role::REPLICA,
    };
    let mut o = t.sec.options(&t.ep, expect, MAX_FRAME);
    o.handshake_timeout = o.handshake_timeout.min(left());
    let sess = session::client(&s, &t.sec.identity, &o).map_err(|e| {
        Setup::Fatal(format!(
            "handshake with backup {} at {}: {e} (or the backup is over its connection bound)",
            t.backup, t.ep
        ))
    })?;
    let (mut tx, mut rx) = (sess.tx, sess.rx);
    s.set_read_timeout(Some(left()))
        .and_then(|()| s.set_write_timeout(Some(left())))
        .map_err(|e| Setup::Fatal(format!("socket options: {e}")))?;
    let mut out = Vec::new();
    tx.seal_msg(
        kinds::REPL,
        &ReplMsg::Hello {
            primary: t.primary.clone(),
            token: t.token,
        },
        &mut out,
    )
    .map_err(|e| Setup::Fatal(e.to_string()))?;
    s.send_all(&out)
        .map_err(|e| Setup::Fatal(format!("sending hello: {e}")))?;
    let mut buf = Vec::new();
    match read_msg(&mut rx, &mut &s, &mut buf) {
        Ok(ReplMsg::Welcome { held }) => Ok(Greeted {
            stream: s,
            welcome: held,
            tx,
            rx,
        }),
        Ok(ReplMsg::Refused { reason }) => Err(Setup::Fatal(format!("backup refused: {reason}"))),
        Ok(m) => Err(Setup::Fatal(format!("backup answered hello with {m:?}"))),
        Err(e) => Err(Setup::Fatal(format!("waiting for welcome: {e}"))),
    }
}

/// Reads and opens one replication frame.
fn read_msg<R: Read + ?Sized>(
    rx: &mut Opener,
    r: &mut R,
    buf: &mut Vec<u8>,
) -> Result<ReplMsg, FrameError> {
    let (kind, body) = rx.read(r, buf)?;
    if kind != kinds::REPL {
        return Err(FrameError::UnexpectedKind(kind));
    }
    pliant_wire::frame::decode_body(&buf[body])
}

fn run_link(t: &Target, opts: &SenderOptions, rx: Receiver<Job>, sh: &Arc<SenderShared>) {
    let start = Instant::now();
    let deadline = start + opts.dead_after;
    let g = loop {
        if sh.stop.load(Ordering::SeqCst) {
            return;
        }
        sh.c.connect_attempts.fetch_add(1, Ordering::Relaxed);
        match connect_and_greet(t, deadline, sh) {
            Ok(ok) => break ok,
            Err(Setup::Retry(e)) if Instant::now() + opts.retry < deadline => {
                tracing::debug!(error = %e, "replication connect: retrying");
                std::thread::sleep(opts.retry);
            }
            Err(Setup::Retry(e)) => {
                sh.set_dead(format!("no connection within {:?}: {e}", opts.dead_after));
                return;
            }
            Err(Setup::Fatal(e)) => {
                sh.set_dead(e);
                return;
            }
        }
    };
    let stream = g.stream;
    // Writes may block only while the backup's receive buffer is full; past `dead_after` that
    // is a dead backup.
    let prepared = stream
        .set_write_timeout(Some(opts.dead_after))
        .and_then(|()| stream.set_read_timeout(None))
        .and_then(|()| stream.try_clone());
    let rd = match prepared {
        Ok(p) => p,
        Err(e) => {
            sh.set_dead(format!("socket setup: {e}"));
            return;
        }
    };
    let sh_rd = sh.clone();
    let opener = g.rx;
    let reader = std::thread::Builder::new()
        .name("ha-repl-acks".into())
        .spawn(move || read_answers(rd, opener, &sh_rd));
    let reader = match reader {
        Ok(r) => r,
        Err(e) => {
            sh.set_dead(format!("cannot start the ack reader: {e}"));
            return;
        }
    };
    sh.set_state(LinkState::Up { welcome: g.welcome });
    ship_loop(&stream, g.tx, opts, &rx, sh, start);
    let _ = stream.shutdown(std::net::Shutdown::Both);
    let _ = reader.join();
}

fn ship_loop(
    stream: &Stream,
    tx: Sealer,
    opts: &SenderOptions,
    rx: &Receiver<Job>,
    sh: &SenderShared,
    start: Instant,
) {
    let half = stream.try_clone().map(|stream| TxHalf {
        stream,
        tx,
        frame: Vec::new(),
        backlog: Vec::new(),
        last_tx: Instant::now(),
    });
    match half {
        Ok(h) => *lock(&sh.txh) = Some(h),
        Err(e) => {
            sh.set_dead(format!("socket clone: {e}"));
            return;
        }
    }
    loop {
        if sh.stop.load(Ordering::SeqCst) || sh.dead.load(Ordering::SeqCst) {
            break;
        }
        let now = Instant::now();
        let waiting_since = lock(&sh.link).waiting_since;
        let last_tx = lock(&sh.txh).as_ref().map_or(now, |h| h.last_tx);
        let mut wait = opts.heartbeat.saturating_sub(now.duration_since(last_tx));
        if let Some(t) = waiting_since {
            let silent = now.duration_since(t);
            if silent >= opts.dead_after {
                sh.set_dead(format!("no answer from the backup for {silent:?}"));
                break;
            }
            wait = wait.min(opts.dead_after - silent);
        }
        let (msg, cp_id) = match rx.recv_timeout(wait) {
            Ok(Job::Checkpoint(cp)) => {
                let id = (cp.group, cp.seq);
                (Some(ReplMsg::Checkpoint(cp)), Some(id))
            }
            Ok(Job::Flush) => (None, None),
            Err(RecvTimeoutError::Timeout) => {
                let idle = lock(&sh.txh)
                    .as_ref()
                    .is_none_or(|h| h.last_tx.elapsed() >= opts.heartbeat);
                if !idle {
                    continue;
                }
                let at_us = start.elapsed().as_micros() as u64;
                (Some(ReplMsg::Heartbeat { at_us }), None)
            }
            Err(RecvTimeoutError::Disconnected) => break,
        };
        let mut g = lock(&sh.txh);
        let Some(h) = g.as_mut() else { break };
        // First what a direct write left unsent: it went out before anything queued.
        let mut shipped = Ok(());
        if !h.backlog.is_empty() {
            shipped = h
                .stream
                .send_all(&h.backlog)
                .map_err(|e| format!("writing to the backup: {e}"));
            h.backlog.clear();
            sh.queued.fetch_sub(1, Ordering::AcqRel);
        }
        if let (Ok(()), Some(msg)) = (&shipped, &msg) {
            shipped = sh.ship(h, msg, cp_id, Write::Blocking);
        }
        if cp_id.is_some() {
            // Written (or the link is dead): a direct send may now follow it.
            sh.queued.fetch_sub(1, Ordering::AcqRel);
        }
        drop(g);
        if let Err(e) = shipped {
            sh.set_dead(e);
            break;
        }
    }
    // No sender writes on a dead or stopped link.
    *lock(&sh.txh) = None;
}

fn read_answers(rd: Stream, mut rx: Opener, sh: &SenderShared) {
    let mut rd = BufReader::with_capacity(4096, rd);
    let mut buf = Vec::new();
    loop {
        let reason = match read_msg(&mut rx, &mut rd, &mut buf) {
            Ok(ReplMsg::Ack(a)) => {
                sh.on_answer(a);
                if sh.dead.load(Ordering::SeqCst) {
                    return;
                }
                continue;
            }
            Ok(ReplMsg::Refused { reason }) => format!("backup refused: {reason}"),
            Ok(m) => format!("unexpected message from the backup: {m:?}"),
            Err(FrameError::Closed) => "backup closed the connection".to_string(),
            Err(e) => format!("reading from the backup: {e}"),
        };
        if !sh.stop.load(Ordering::SeqCst) {
            sh.set_dead(reason);
        }
        return;
    }
}

/// Locks a mutex, also after another thread panicked while holding it (the data are counters
/// and maps that stay consistent between statements).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{FlowUpdate, UpdateBody};
    use pliant_state::FlowKey;
    use pliant_wire::{Ca, Conn};
    use std::io::Write;
    use std::path::PathBuf;
    use std::sync::OnceLock;

    /// Every wait in these tests is bounded by this, far above what any step needs, so a slow
    /// machine cannot fail them while a hang still fails instead of blocking the suite.
    const PATIENCE: Duration = Duration::from_secs(20);

    /// A private temporary directory, removed on drop.
    struct TempDir(PathBuf);
    impl TempDir {
        fn new() -> TempDir {
            static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.subsec_nanos());
            let p = std::env::temp_dir().join(format!(
                "pliant-ha-transport-{}-{}-{nanos}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed),
            ));
            std::fs::create_dir(&p).unwrap();
            TempDir(p)
        }
    }
    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// The deployment's CA of these tests, and a stranger's.
    fn ca() -> &'static Ca {
        static CA: OnceLock<Ca> = OnceLock::new();
        CA.get_or_init(|| Ca::generate(None).unwrap())
    }

    /// A replica identity `name` certified by the tests' CA.
    fn sec(name: &str) -> Security {
        Security::new(ca().issue(name, role::REPLICA, 3600).unwrap())
    }

    fn uds(p: PathBuf) -> Endpoint {
        Endpoint::Unix(p)
    }

    /// A sender of replica `r1` to the backup `b` of [`server`].
    fn sender(ep: &Endpoint, primary: &str, token: u64, o: SenderOptions) -> ReplSender {
        ReplSender::start(ep, sec(primary), "b", primary, token, o)
    }

    fn opts(dead_after_ms: u64) -> SenderOptions {
        SenderOptions {
            retry: Duration::from_millis(5),
            dead_after: Duration::from_millis(dead_after_ms),
            heartbeat: Duration::from_millis(10),
            max_queued: 1024,
        }
    }

    fn server(d: &TempDir) -> (ReplServer, Arc<Mutex<StandbyStore>>, Endpoint) {
        let store = Arc::new(Mutex::new(StandbyStore::new(10_000)));
        let s = ReplServer::start(&uds(d.0.join("b.repl.sock")), sec("b"), store.clone()).unwrap();
        let ep = s.endpoint().clone();
        (s, store, ep)
    }

    fn path_of(ep: &Endpoint) -> PathBuf {
        match ep {
            Endpoint::Unix(p) => p.clone(),
            Endpoint::Tcp(_) => panic!("not a unix endpoint"),
        }
    }

    fn key(i: u16) -> FlowKey {
        FlowKey::v4(6, [10, 0, 0, 1].into(), i, [10, 0, 0, 2].into(), 80).0
    }

    fn cp(group: GroupId, seq: u64, full: bool, n: u16) -> Checkpoint {
        Checkpoint {
            group,
            seq,
            full,
            flows: (0..n)
                .map(|i| FlowUpdate {
                    key: key(i),
                    version: seq,
                    body: UpdateBody::Full(vec![seq as u8; 40]),
                })
                .collect(),
            shared: None,
        }
    }

    /// Waits on the wake fd (as the packet thread would) until `done` holds for the state and
    /// the acks seen so far, or PATIENCE passes.
    fn wait_for(
        s: &ReplSender,
        acks: &mut Vec<Ack>,
        mut done: impl FnMut(&LinkState, &[Ack]) -> bool,
    ) -> LinkState {
        let end = Instant::now() + PATIENCE;
        loop {
            s.drain_wake();
            let st = s.poll(acks);
            if done(&st, acks) || Instant::now() > end {
                return st;
            }
            let mut p = libc::pollfd {
                fd: s.wake_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd.
            unsafe { libc::poll(&mut p, 1, 20) };
        }
    }

    fn wait_up(s: &ReplSender) -> Vec<(GroupId, u64)> {
        match wait_for(s, &mut Vec::new(), |st, _| {
            !matches!(st, LinkState::Connecting)
        }) {
            LinkState::Up { welcome } => welcome,
            st => panic!("link not up: {st:?}"),
        }
    }

    fn wait_dead(s: &ReplSender) -> String {
        match wait_for(s, &mut Vec::new(), |st, _| {
            matches!(st, LinkState::Dead { .. })
        }) {
            LinkState::Dead { reason } => reason,
            st => panic!("link not dead: {st:?}"),
        }
    }

    fn acked(acks: &[Ack], g: GroupId) -> u64 {
        acks.iter()
            .filter(|a| a.group == g)
            .map(|a| a.seq)
            .max()
            .unwrap_or(0)
    }

    fn until_server<F: Fn(&ServerStats) -> bool>(srv: &ReplServer, f: F) -> ServerStats {
        let end = Instant::now() + PATIENCE;
        loop {
            let st = srv.stats();
            if f(&st) || Instant::now() > end {
                return st;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// The runtime keeps senders in its engine and servers in its replica: both must move
    /// between threads.
    #[test]
    fn handles_are_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<ReplSender>();
        check::<ReplServer>();
        check::<Arc<Mutex<StandbyStore>>>();
    }

    #[test]
    fn checkpoints_are_applied_and_acked_in_order() {
        let d = TempDir::new();
        let (srv, store, path) = server(&d);
        let mode =
            std::os::unix::fs::MetadataExt::mode(&std::fs::metadata(path_of(&path)).unwrap())
                & 0o777;
        assert_eq!(mode, 0o600);
        checkpoints_flow(&srv, &store, &path);
    }

    /// The same over TCP, where the frames are also encrypted.
    #[test]
    fn checkpoints_are_applied_and_acked_in_order_over_tcp() {
        let store = Arc::new(Mutex::new(StandbyStore::new(10_000)));
        let srv =
            ReplServer::start(&"127.0.0.1:0".parse().unwrap(), sec("b"), store.clone()).unwrap();
        let ep = srv.endpoint().clone();
        assert!(ep.is_tcp());
        checkpoints_flow(&srv, &store, &ep);
    }

    fn checkpoints_flow(srv: &ReplServer, store: &Arc<Mutex<StandbyStore>>, path: &Endpoint) {
        let s = sender(path, "r1", 1, opts(5_000));
        assert_eq!(wait_up(&s), vec![]);
        s.send(cp(1, 1, true, 3)).unwrap();
        s.send(cp(2, 1, true, 1)).unwrap();
        for seq in 2..=50 {
            s.send(cp(1, seq, false, 2)).unwrap();
        }
        let mut acks = Vec::new();
        let st = wait_for(&s, &mut acks, |_, a| acked(a, 1) == 50 && acked(a, 2) == 1);
        assert!(matches!(st, LinkState::Up { .. }), "{st:?}");
        assert_eq!(acked(&acks, 1), 50);
        // Cumulative and in order: the acks of one group never go backwards.
        let g1: Vec<u64> = acks
            .iter()
            .filter(|a| a.group == 1)
            .map(|a| a.seq)
            .collect();
        assert!(g1.windows(2).all(|w| w[0] < w[1]), "{g1:?}");
        assert_eq!(lock(store).held("r1"), vec![(1, 50), (2, 1)]);
        assert_eq!(lock(store).stats().flows, 4);
        let ss = s.stats();
        assert_eq!(ss.checkpoints, 51);
        assert!(ss.bytes_sent > 51 * 40);
        let vs = srv.stats();
        assert_eq!(vs.checkpoints, 51);
        assert_eq!(vs.auth_failures + vs.decode_errors + vs.refused, 0);
        // Nothing more to report once drained.
        let mut more = Vec::new();
        s.poll(&mut more);
        assert!(more.is_empty(), "{more:?}");
    }

    /// Checkpoints sent while another send holds the link go through the ship thread's queue;
    /// once it is empty the caller writes them itself. Both kinds interleave in one order: the
    /// backup applies every seq once, in order (it refuses a gap), and nothing overtakes a
    /// queued checkpoint.
    #[test]
    fn queued_and_direct_checkpoints_keep_one_order() {
        let d = TempDir::new();
        let (srv, store, path) = server(&d);
        let s = sender(&path, "r1", 1, opts(5_000));
        wait_up(&s);
        s.send(cp(1, 1, true, 2)).unwrap();
        let mut seq = 1;
        for round in 0..20 {
            // The link busy (as while the ship thread writes a heartbeat): these queue.
            let held = lock(&s.shared.txh);
            for _ in 0..5 {
                seq += 1;
                s.send(cp(1, seq, false, 2)).unwrap();
            }
            assert!(s.shared.queued.load(Ordering::SeqCst) >= 1, "round {round}");
            drop(held);
            // Sent at once after the release: queued ones may still be waiting, then these
            // queue behind them; later ones go direct.
            for _ in 0..5 {
                seq += 1;
                s.send(cp(1, seq, false, 2)).unwrap();
            }
        }
        let mut acks = Vec::new();
        let st = wait_for(&s, &mut acks, |_, a| acked(a, 1) == seq);
        assert!(matches!(st, LinkState::Up { .. }), "{st:?}");
        assert_eq!(lock(&store).held("r1"), vec![(1, seq)]);
        let ss = s.stats();
        assert_eq!(ss.checkpoints, seq);
        assert!(
            ss.checkpoints_direct > 0 && ss.checkpoints_direct < seq,
            "both paths taken: {ss:?}"
        );
        let vs = srv.stats();
        assert_eq!(vs.checkpoints, seq);
        assert_eq!(
            vs.auth_failures + vs.decode_errors + vs.refused,
            0,
            "{vs:?}"
        );
        assert_eq!(s.shared.queued.load(Ordering::SeqCst), 0);
    }

    /// A backup that stops reading (its store held by the test, so its connection thread waits
    /// in `apply`) fills the socket: the caller's writes then go partly or not at all, the rest
    /// to the ship thread, and `send` never blocks — it returns `Full` once the queue is full.
    /// Once the backup reads again, everything sent is applied in order and acked.
    #[test]
    fn send_never_blocks_on_a_backup_that_stops_reading() {
        let d = TempDir::new();
        let (srv, store, path) = server(&d);
        let mut o = opts(60_000);
        o.max_queued = 64;
        let s = Arc::new(sender(&path, "r1", 1, o));
        wait_up(&s);
        s.send(cp(1, 1, true, 100)).unwrap();
        let mut acks = Vec::new();
        wait_for(&s, &mut acks, |_, a| acked(a, 1) == 1);
        let held = lock(&store);
        let (done_tx, done_rx) = mpsc::channel();
        let s2 = s.clone();
        let t = std::thread::spawn(move || {
            // Until the queue is full: every call returns (a blocking write would hang here
            // for the 60 s of dead_after and the watchdog below would fail the test).
            let mut seq = 1;
            loop {
                match s2.send(cp(1, seq + 1, false, 100)) {
                    Ok(()) => seq += 1,
                    Err(SendError::Full) => break,
                    Err(e) => panic!("{e:?}"),
                }
                assert!(seq < 100_000, "the socket never filled");
            }
            done_tx.send(seq).unwrap();
        });
        let last = done_rx
            .recv_timeout(PATIENCE)
            .expect("send blocked on a backup that stopped reading");
        t.join().unwrap();
        let st = s.stats();
        assert!(
            st.direct_backlogged >= 1 || st.checkpoints_direct < last,
            "{st:?}"
        );
        assert!(st.queue_full >= 1, "{st:?}");
        drop(held);
        let st = wait_for(&s, &mut acks, |_, a| acked(a, 1) == last);
        assert!(matches!(st, LinkState::Up { .. }), "{st:?}");
        assert_eq!(lock(&store).held("r1"), vec![(1, last)]);
        assert_eq!(s.shared.queued.load(Ordering::SeqCst), 0);
        let vs = srv.stats();
        assert_eq!(vs.decode_errors + vs.refused, 0, "{vs:?}");
    }

    #[test]
    fn a_stranger_is_refused_and_counted() {
        let d = TempDir::new();
        let (srv, store, path) = server(&d);
        // Certified by another CA, but trusting ours (so it gets to present its certificate).
        let mut stranger = Ca::generate(None)
            .unwrap()
            .issue("r1", role::REPLICA, 60)
            .unwrap();
        stranger.ca_pub = ca().public();
        let s = ReplSender::start(&path, Security::new(stranger), "b", "r1", 1, opts(5_000));
        let reason = wait_dead(&s);
        assert!(reason.contains("handshake"), "{reason}");
        assert_eq!(s.send(cp(1, 1, true, 1)), Err(SendError::Dead));
        let st = until_server(&srv, |st| st.auth_failures == 1);
        assert_eq!(st.auth_failures, 1);
        assert_eq!(st.checkpoints, 0);
        assert!(lock(&store).held("r1").is_empty());
    }

    #[test]
    fn a_dropped_backup_is_reported_dead() {
        let d = TempDir::new();
        let (srv, _store, path) = server(&d);
        // The answer timer outlasts PATIENCE: if the link dies within it, the closed
        // connection told the sender, not the silence.
        let s = sender(&path, "r1", 1, opts(3 * PATIENCE.as_millis() as u64));
        wait_up(&s);
        s.send(cp(1, 1, true, 1)).unwrap();
        let mut acks = Vec::new();
        wait_for(&s, &mut acks, |_, a| acked(a, 1) == 1);
        assert_eq!(acked(&acks, 1), 1);
        drop(srv);
        assert!(!path_of(&path).exists(), "the server unlinks its socket");
        let reason = wait_dead(&s);
        assert!(!reason.contains("no answer"), "{reason}");
        assert_eq!(s.send(cp(1, 2, false, 1)), Err(SendError::Dead));
    }

    /// A backup that authenticates and greets, then never answers (hung, not closed): the
    /// sender's answer timer, not EOF, finds it dead.
    #[test]
    fn a_silent_backup_is_reported_dead() {
        let d = TempDir::new();
        let ep = uds(d.0.join("silent.sock"));
        let l = Listener::bind(&ep, &Default::default()).unwrap();
        let t = std::thread::spawn(move || {
            let s = l.accept().unwrap();
            let mut c = Conn::server(s, &sec("b").identity, &Default::default()).unwrap();
            let (_, hello): (u16, ReplMsg) = c.recv().unwrap();
            assert!(matches!(hello, ReplMsg::Hello { .. }));
            c.send(kinds::REPL, &ReplMsg::Welcome { held: vec![] })
                .unwrap();
            // Hold the connection open, read nothing, until the sender gives up.
            let mut sink = Vec::new();
            let _ = c
                .reader
                .stream()
                .try_clone()
                .unwrap()
                .read_to_end(&mut sink);
        });
        // 500 ms: connect + handshake must fit in it on a loaded machine too.
        let s = sender(&ep, "r1", 1, opts(500));
        wait_up(&s);
        let reason = wait_dead(&s);
        assert!(reason.contains("no answer"), "{reason}");
        drop(s);
        t.join().unwrap();
    }

    #[test]
    fn no_backup_at_all_is_dead_after_retries() {
        let d = TempDir::new();
        let s = sender(&uds(d.0.join("nobody.sock")), "r1", 1, opts(50));
        let reason = wait_dead(&s);
        assert!(reason.contains("no connection"), "{reason}");
        assert!(s.stats().connect_attempts >= 2, "{:?}", s.stats());
    }

    /// The sender was told which replica its backup is: another one answering is refused.
    #[test]
    fn the_sender_refuses_a_backup_that_is_not_the_one_named() {
        let d = TempDir::new();
        let (_srv, _store, path) = server(&d);
        let s = ReplSender::start(&path, sec("r1"), "b2", "r1", 1, opts(5_000));
        let reason = wait_dead(&s);
        assert!(reason.contains("expected \"b2\""), "{reason}");
    }

    /// An authenticated client as replica `name` (for hand-written frames).
    fn raw_client(path: &Endpoint, name: &str) -> Conn {
        let s = pliant_wire::endpoint::connect(path, PATIENCE, &Default::default()).unwrap();
        s.set_read_timeout(Some(PATIENCE)).unwrap();
        Conn::client(s, &sec(name).identity, &Default::default()).unwrap()
    }

    /// True once the server closed `c` (EOF), false if it stayed open for PATIENCE.
    fn closed_by_server(c: &Conn) -> bool {
        let mut b = [0u8; 64];
        let mut s = c.reader.stream().try_clone().unwrap();
        loop {
            match s.read(&mut b) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(e) => return e.kind() == io::ErrorKind::ConnectionReset,
            }
        }
    }

    #[test]
    fn malformed_frames_are_counted_and_do_not_crash_the_server() {
        let d = TempDir::new();
        let (srv, store, path) = server(&d);
        // Garbage instead of a handshake.
        let mut g = UnixStream::connect(path_of(&path)).unwrap();
        g.set_read_timeout(Some(PATIENCE)).unwrap();
        g.write_all(&[0xa5; 64]).unwrap();
        let mut sink = Vec::new();
        let _ = g.read_to_end(&mut sink);
        // Authenticated, then an undecodable body.
        let mut c = raw_client(&path, "r1");
        c.writer
            .send_bytes(kinds::REPL, &[0xff, 0xff, 0xff])
            .unwrap();
        assert!(closed_by_server(&c));
        // A length over MAX_FRAME.
        let c = raw_client(&path, "r1");
        let huge = pliant_wire::frame::Header {
            len: u32::MAX,
            version: pliant_wire::PROTOCOL_VERSION,
            kind: kinds::REPL,
        };
        c.writer.stream().send_all(&huge.encode()).unwrap();
        assert!(closed_by_server(&c));
        // A frame of another channel's kind after a good Hello.
        let mut c = raw_client(&path, "r1");
        let hello = ReplMsg::Hello {
            primary: "r1".into(),
            token: 1,
        };
        c.send(kinds::REPL, &hello).unwrap();
        assert!(matches!(
            c.recv::<ReplMsg>().unwrap().1,
            ReplMsg::Welcome { .. }
        ));
        c.send(kinds::FTMB, &ReplMsg::Heartbeat { at_us: 1 })
            .unwrap();
        assert!(closed_by_server(&c));
        // A checkpoint before Hello; a backup-side message from a primary.
        let mut c = raw_client(&path, "r1");
        c.send(kinds::REPL, &ReplMsg::Checkpoint(cp(1, 1, true, 1)))
            .unwrap();
        assert!(closed_by_server(&c));
        let mut c = raw_client(&path, "r1");
        c.send(kinds::REPL, &hello).unwrap();
        assert!(matches!(
            c.recv::<ReplMsg>().unwrap().1,
            ReplMsg::Welcome { .. }
        ));
        c.send(kinds::REPL, &ReplMsg::Ack(Ack { group: 1, seq: 9 }))
            .unwrap();
        assert!(closed_by_server(&c));
        // Connect and leave.
        drop(UnixStream::connect(path_of(&path)).unwrap());

        let st = until_server(&srv, |st| st.handshake_aborted >= 2 && st.active == 0);
        assert_eq!(st.auth_failures, 0, "{st:?}");
        assert_eq!(st.decode_errors, 3, "{st:?}");
        assert_eq!(st.protocol_errors, 2, "{st:?}");
        assert_eq!(st.handshake_aborted, 2, "{st:?}");
        assert_eq!(st.checkpoints, 0);
        assert!(lock(&store).held("r1").is_empty());
        // The server still serves a real sender.
        let s = sender(&path, "r1", 1, opts(5_000));
        wait_up(&s);
        s.send(cp(1, 1, true, 1)).unwrap();
        let mut acks = Vec::new();
        wait_for(&s, &mut acks, |_, a| acked(a, 1) == 1);
        assert_eq!(acked(&acks, 1), 1);
    }

    fn hello_r1() -> ReplMsg {
        ReplMsg::Hello {
            primary: "r1".into(),
            token: 1,
        }
    }

    /// A replica can only checkpoint as itself: r2's certificate with a Hello for r1 is
    /// refused, and an Ack injected into r1's established link (bytes not sealed with its
    /// session key) closes it.
    #[test]
    fn hello_for_another_replica_and_injected_frames_are_refused() {
        let d = TempDir::new();
        let (srv, store, path) = server(&d);
        let mut c = raw_client(&path, "r2");
        c.send(kinds::REPL, &hello_r1()).unwrap();
        match c.recv::<ReplMsg>().unwrap().1 {
            ReplMsg::Refused { reason } => assert!(reason.contains("certificate"), "{reason}"),
            m => panic!("{m:?}"),
        }
        assert!(closed_by_server(&c));
        assert_eq!(
            until_server(&srv, |st| st.identity_mismatch == 1).identity_mismatch,
            1
        );
        // Injection: another session's sealed frame spliced into r1's stream.
        let mut c = raw_client(&path, "r1");
        c.send(kinds::REPL, &hello_r1()).unwrap();
        assert!(matches!(
            c.recv::<ReplMsg>().unwrap().1,
            ReplMsg::Welcome { .. }
        ));
        let mut forged = Vec::new();
        {
            let (c2, s2) = UnixStream::pair().unwrap();
            let srv2 = std::thread::spawn(move || {
                session::server(&Stream::Unix(s2), &sec("x").identity, &Default::default())
            });
            let mut sess =
                session::client(&Stream::Unix(c2), &sec("r1").identity, &Default::default())
                    .unwrap();
            drop(srv2.join().unwrap());
            sess.tx
                .seal_msg(
                    kinds::REPL,
                    &ReplMsg::Checkpoint(cp(1, 1, true, 1)),
                    &mut forged,
                )
                .unwrap();
        }
        c.writer.stream().send_all(&forged).unwrap();
        assert!(closed_by_server(&c));
        let st = until_server(&srv, |st| st.decode_errors >= 1);
        assert_eq!(st.decode_errors, 1, "{st:?}");
        assert_eq!(st.checkpoints, 0);
        assert!(lock(&store).held("r1").is_empty());
    }

    #[test]
    fn heartbeats_are_answered_with_the_latest_ack() {
        let d = TempDir::new();
        let (_srv, _store, path) = server(&d);
        let mut c = raw_client(&path, "r1");
        let mut say = |m: ReplMsg| c.call::<ReplMsg, ReplMsg>(kinds::REPL, &m).unwrap().1;
        let hello = ReplMsg::Hello {
            primary: "r1".into(),
            token: 1,
        };
        assert_eq!(say(hello), ReplMsg::Welcome { held: vec![] });
        let hb = ReplMsg::Heartbeat { at_us: 1 };
        assert_eq!(say(hb.clone()), ReplMsg::Ack(Ack { group: 0, seq: 0 }));
        let a = say(ReplMsg::Checkpoint(cp(3, 1, true, 1)));
        assert_eq!(a, ReplMsg::Ack(Ack { group: 3, seq: 1 }));
        let a = say(ReplMsg::Checkpoint(cp(3, 2, false, 1)));
        assert_eq!(a, ReplMsg::Ack(Ack { group: 3, seq: 2 }));
        assert_eq!(say(hb), ReplMsg::Ack(Ack { group: 3, seq: 2 }));
    }

    #[test]
    fn a_reconnecting_sender_gets_welcome_with_held_seqs() {
        let d = TempDir::new();
        let (_srv, _store, path) = server(&d);
        let s = sender(&path, "r1", 1, opts(5_000));
        wait_up(&s);
        for seq in 1..=3 {
            s.send(cp(1, seq, seq == 1, 2)).unwrap();
        }
        s.send(cp(7, 1, true, 1)).unwrap();
        let mut acks = Vec::new();
        wait_for(&s, &mut acks, |_, a| acked(a, 1) == 3 && acked(a, 7) == 1);
        drop(s);
        let s = sender(&path, "r1", 1, opts(5_000));
        assert_eq!(wait_up(&s), vec![(1, 3), (7, 1)]);
        // It continues with deltas-by-seq where the backup is.
        s.send(cp(1, 4, false, 1)).unwrap();
        let mut acks = Vec::new();
        wait_for(&s, &mut acks, |_, a| acked(a, 1) == 4);
        assert_eq!(acked(&acks, 1), 4);
        // Another primary name starts from nothing.
        let o = sender(&path, "r2", 1, opts(5_000));
        assert_eq!(wait_up(&o), vec![]);
    }

    #[test]
    fn fenced_and_refused_checkpoints_kill_the_link() {
        let d = TempDir::new();
        let (srv, store, path) = server(&d);
        let s = sender(&path, "r1", 1, opts(5_000));
        wait_up(&s);
        s.send(cp(1, 1, true, 1)).unwrap();
        let mut acks = Vec::new();
        wait_for(&s, &mut acks, |_, a| acked(a, 1) == 1);
        // A gap in the sequence is refused by the store: Refused, then Dead.
        s.send(cp(1, 5, false, 1)).unwrap();
        let reason = wait_dead(&s);
        assert!(reason.contains("refused"), "{reason}");
        // After activation under token 2, the old primary (token 1) is refused at Hello.
        let a = lock(&store).activate("r1", 2).unwrap();
        assert_eq!(a.records.len(), 1);
        let old = sender(&path, "r1", 1, opts(5_000));
        let reason = wait_dead(&old);
        assert!(reason.contains("fenced"), "{reason}");
        let st = until_server(&srv, |st| st.refused == 2);
        assert_eq!(st.refused, 2);
        let new = sender(&path, "r1", 2, opts(5_000));
        wait_up(&new);
    }

    #[test]
    fn a_full_queue_is_refused_and_counted() {
        let d = TempDir::new();
        // Nobody listens: the sender thread keeps retrying and drains nothing.
        let mut o = opts(60_000);
        o.max_queued = 2;
        let s = sender(&uds(d.0.join("later.sock")), "r1", 1, o);
        s.send(cp(1, 1, true, 1)).unwrap();
        s.send(cp(1, 2, false, 1)).unwrap();
        assert_eq!(s.send(cp(1, 3, false, 1)), Err(SendError::Full));
        assert_eq!(s.stats().queue_full, 1);
        assert!(matches!(s.poll(&mut Vec::new()), LinkState::Connecting));
        // When the backup appears, the queued checkpoints go out.
        let path = d.0.join("later.sock");
        let store = Arc::new(Mutex::new(StandbyStore::new(100)));
        let _srv = ReplServer::start(&uds(path), sec("b"), store.clone()).unwrap();
        let mut acks = Vec::new();
        wait_for(&s, &mut acks, |_, a| acked(a, 1) == 2);
        assert_eq!(acked(&acks, 1), 2);
    }

    #[test]
    fn an_idle_link_heartbeats_and_stays_up() {
        let d = TempDir::new();
        let (srv, _store, path) = server(&d);
        let s = sender(&path, "r1", 1, opts(10_000));
        wait_up(&s);
        let end = Instant::now() + PATIENCE;
        // Counters move after send(2) returns, possibly after the answer came back: wait for
        // both.
        while (s.stats().acks < 5 || s.stats().heartbeats < 5) && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(5));
        }
        let st = s.stats();
        assert!(st.heartbeats >= 5 && st.acks >= 5, "{st:?}");
        assert!(matches!(s.poll(&mut Vec::new()), LinkState::Up { .. }));
        // Heartbeat answers before any checkpoint are not reported as acks.
        let mut acks = Vec::new();
        s.poll(&mut acks);
        assert!(acks.is_empty(), "{acks:?}");
        assert!(srv.stats().frames >= 5);
    }

    #[test]
    fn a_live_socket_or_port_is_not_stolen_and_a_stale_one_is_replaced() {
        let d = TempDir::new();
        let (_srv, _store, path) = server(&d);
        let store = Arc::new(Mutex::new(StandbyStore::new(1)));
        assert!(matches!(
            ReplServer::start(&path, sec("b"), store.clone()),
            Err(TransportError::Bind(pliant_wire::BindError::InUse(_)))
        ));
        let tcp =
            ReplServer::start(&"127.0.0.1:0".parse().unwrap(), sec("b"), store.clone()).unwrap();
        assert!(matches!(
            ReplServer::start(tcp.endpoint(), sec("b"), store.clone()),
            Err(TransportError::Bind(pliant_wire::BindError::InUse(_)))
        ));
        let stale = d.0.join("stale.sock");
        drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
        assert!(stale.exists());
        let s = ReplServer::start(&uds(stale.clone()), sec("b"), store.clone()).unwrap();
        assert_eq!(s.endpoint(), &uds(stale));
        let file = d.0.join("file");
        std::fs::write(&file, b"x").unwrap();
        assert!(matches!(
            ReplServer::start(&uds(file), sec("b"), store),
            Err(TransportError::Bind(pliant_wire::BindError::NotASocket(_)))
        ));
    }
}
