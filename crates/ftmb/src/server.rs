//! Backup side of the network logger: [`LoggerServer`] hosts, inside another replica, the
//! input logger, output logger and snapshot store of one or more FTMB primaries ("masters").
//!
//! Listens on any pliant-wire endpoint (a unix socket, mode 0600, or TCP `host:port`).
//! Threads: an accept thread (peer uid by SO_PEERCRED on a unix socket, the `pliant_wire`
//! session handshake, which requires a CA-signed identity with the replica role, and the
//! `Hello`, each bounded by [`ServerOptions::handshake_timeout`]) hands authenticated streams
//! and their sessions to one I/O thread, which owns every log and serves every connection
//! with poll(2). Every frame either way is sealed with the connection's session (kind
//! `pliant_wire::kinds::FTMB`): a frame that fails its tag (injected, replayed, reordered)
//! closes the connection. A hello must name the certified identity as its master (counted
//! as `identity_mismatch` and refused otherwise): the logs are filed under that name, and a
//! replica may only write, replace or fence its own. Control calls
//! ([`LoggerServer::status`], [`LoggerServer::take_for_recovery`]) run as closures on that
//! thread, ordered with the streams (so a recovery first drains what the dead master's sockets
//! still hold).
//!
//! Per master (see `MasterLog`):
//! - the session (`StreamKind::Session`, hello epoch = the session generation) opens the logs:
//!   an [`OutputLogger`] with one queue per declared worker, a per-queue input log
//!   (seq -> frame, bounded in bytes), the snapshot image. A session with an equal or higher
//!   epoch replaces the previous one (its connections are closed, its logs dropped); a lower
//!   one is refused. After [`LoggerServer::take_for_recovery`] every hello of that master up to
//!   the recovered generation is refused (fencing, design invariant 7).
//! - queue streams join a session of the same epoch. `Input` records go to the input log, the
//!   rest of each batch to the output logger; released outputs go to the release callback,
//!   feedback back on the queue's stream.
//! - The first snapshot of a session must be `full`: it fixes where the logs start (PAL and
//!   input positions; the master may have been running before this logger existed). Queue
//!   streams are not read before it arrived, so nothing is logged against the wrong base.
//! - A snapshot is applied once every queue's contiguous logged PAL seq reached its
//!   `pal_seq[q]` and the input log its `input_next[q]`; then both logs are truncated and
//!   `SnapshotAck { id }` goes back on the session stream.
//!
//! Bounds and back-pressure: a queue whose input log is at its byte bound, or a session with
//! [`ServerOptions::max_pending_snapshots`] waiting, is not read until a snapshot is applied
//! (counted as stalls; the worker's bounded send then fails if it lasts). Outbound bytes per
//! connection are bounded (feedback over it is dropped, counted: it is cumulative or asked
//! again). Connections and masters are bounded.

use crate::logger::{LoggerConfig, LoggerStats, OutputLogger, Recovery, Released};
use crate::net::{recv_into, NetError, MAX_MASTER_NAME, MAX_SNAPSHOT_FRAME};
use crate::wire::{
    open_front, read_msg, seal_frame, Feedback, LogBatch, LogMsg, NetMsg, OutputId, QueueId,
    Snapshot, SnapshotMsg, StreamKind, FRAME_OVERHEAD, MAX_FRAME, MAX_QUEUES,
};
use pliant_wire::endpoint::{Endpoint, Listener, Stream};
use pliant_wire::server::{self as wire_server, ServerSocket};
use pliant_wire::session::{self, Expect, Opener, Sealer};
use pliant_wire::{role, FrameError, Security};
use serde_json::json;
use std::collections::{BTreeMap, HashMap};
use std::io::{self, Read, Write};
use std::ops::ControlFlow;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Called on the server's I/O thread for every released output, in release order. It must not
/// call back into the [`LoggerServer`] (that would wait for the thread it runs on).
pub type ReleaseFn = Box<dyn FnMut(Released) + Send>;

/// Bytes read from one connection per wake-up (fairness between connections).
const READ_CHUNK: usize = 256 << 10;
/// Bound on a hello frame.
const MAX_HELLO: usize = 4096;
/// Bound on what a recovery reads from one connection of the dead master (more than any
/// socket buffer holds; a master that is somehow still sending cannot keep it busy forever).
const MAX_DRAIN: u64 = 256 << 20;

#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// Template for each master's output logger (`queues` is the session's worker count).
    pub logger: LoggerConfig,
    pub max_masters: usize,
    /// Authenticated connections open at once (over it a new one is closed, counted).
    pub max_connections: usize,
    /// Bound on one queue's input log between snapshots, in frame bytes.
    pub max_input_bytes_per_queue: usize,
    /// Snapshots received and waiting for the logs to catch up.
    pub max_pending_snapshots: usize,
    /// Bound on bytes waiting to be written to one connection.
    pub max_out_bytes: usize,
    /// Bound on handshake + hello of a new connection.
    pub handshake_timeout: Duration,
    /// The masters transmit their own output: a released output is not handed to the release
    /// callback but confirmed to its master (`Feedback::Released`, cumulative per queue),
    /// which holds it until then (`net::HeldOutputs`). Why: output handed to this process
    /// dies with it, while output the master still holds can be released by the master once
    /// this logger is gone (see the crate README, "Output when the logger dies").
    pub release_to_master: bool,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            logger: LoggerConfig::new(1),
            max_masters: 16,
            max_connections: 256,
            max_input_bytes_per_queue: 64 << 20,
            max_pending_snapshots: 8,
            max_out_bytes: 1 << 20,
            handshake_timeout: Duration::from_secs(2),
            release_to_master: false,
        }
    }
}

/// Everything a standby needs to recover a master (see [`LoggerServer::take_for_recovery`]).
pub struct RecoveryBundle {
    /// The last applied snapshot; `nf_state` = the shared variables' image.
    pub snapshot: Snapshot,
    /// Its id.
    pub snapshot_id: u64,
    /// Per queue: the flow records at the snapshot.
    pub locals: Vec<Vec<(Vec<u8>, Vec<u8>)>>,
    pub recovery: Recovery,
    /// Per queue: the logged input from `snapshot.input_next[q]` on, (seq, frame), in order.
    pub inputs: Vec<Vec<(u64, Vec<u8>)>>,
    /// The master's output logger after `recover`: feed it the replay's batches so output
    /// released before the failure is suppressed (its epoch is `recovery.epoch`).
    pub logger: OutputLogger,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct ServerStats {
    pub connections: u64,
    pub active: u64,
    /// Handshakes refused: certificate not the CA's, expired, no replica role, bad signature.
    pub auth_failures: u64,
    /// Hellos naming another master than the certified identity (refused).
    pub identity_mismatch: u64,
    /// Peers that closed or stalled during the handshake or before their hello.
    pub handshake_aborted: u64,
    pub peer_refused: u64,
    pub over_bound: u64,
    /// Hellos refused because the master was recovered (fenced) at that generation or later.
    pub refused_fenced: u64,
    /// Hellos of an older generation than the master's current session.
    pub refused_stale: u64,
    /// Other refused hellos (no session, bad queue, too many masters).
    pub refused_other: u64,
    pub sessions_replaced: u64,
    pub protocol_errors: u64,
    pub decode_errors: u64,
    pub frames_in: u64,
    pub bytes_in: u64,
    pub bytes_out: u64,
    /// Outbound frames dropped because a connection's outbound buffer was full.
    pub out_dropped: u64,
    pub recoveries: u64,
}

#[derive(Default)]
struct AcceptCounters {
    connections: AtomicU64,
    active: AtomicU64,
    auth_failures: AtomicU64,
    identity_mismatch: AtomicU64,
    handshake_aborted: AtomicU64,
    peer_refused: AtomicU64,
    over_bound: AtomicU64,
    protocol_errors: AtomicU64,
}

struct Incoming {
    stream: Stream,
    tx: Sealer,
    rx: Opener,
    master: String,
    epoch: u64,
    kind: StreamKind,
}

type Ctl = Box<dyn FnOnce(&mut Inner) + Send>;

/// The I/O thread's wake-up: a byte on a socket pair it polls.
struct Waker(UnixStream);
impl Waker {
    fn wake(&self) {
        // Full (a wake-up is already pending) or closed (thread gone): nothing to do.
        let _ = (&self.0).write(&[1]);
    }
}

struct Shared {
    stop: AtomicBool,
    c: AcceptCounters,
    waker: Waker,
}

/// The network logger. Drop stops both threads, closes every connection and unlinks a unix
/// socket if it is still the one this server bound.
pub struct LoggerServer {
    socket: ServerSocket,
    shared: Arc<Shared>,
    ctl: Sender<Ctl>,
    io: Option<JoinHandle<()>>,
}

impl LoggerServer {
    /// Listens at `ep` (a unix socket is mode 0600; a stale socket left by a dead process is
    /// replaced, a live server's socket or port is refused) and starts the accept and I/O
    /// threads. `sec` is this replica's identity: peers must prove one from the same CA with
    /// the replica role.
    pub fn start(
        ep: &Endpoint,
        sec: Security,
        opts: ServerOptions,
        release: ReleaseFn,
    ) -> Result<LoggerServer, NetError> {
        let io_err = |source| NetError::Io {
            ep: ep.clone(),
            source,
        };
        let (wake_r, wake_w) = UnixStream::pair().map_err(io_err)?;
        wake_r.set_nonblocking(true).map_err(io_err)?;
        wake_w.set_nonblocking(true).map_err(io_err)?;
        let shared = Arc::new(Shared {
            stop: AtomicBool::new(false),
            c: AcceptCounters::default(),
            waker: Waker(wake_w),
        });
        let (inc_tx, inc_rx) = mpsc::channel::<Incoming>();
        let (ctl_tx, ctl_rx) = mpsc::channel::<Ctl>();
        let inner = Inner {
            opts: opts.clone(),
            release,
            conns: HashMap::new(),
            next_id: 0,
            masters: BTreeMap::new(),
            fenced: BTreeMap::new(),
            stats: ServerStats::default(),
            shared: shared.clone(),
            body: Vec::new(),
        };
        let sh = shared.clone();
        let io = std::thread::Builder::new()
            .name("ftmb-logger-io".into())
            .spawn(move || io_loop(inner, wake_r, inc_rx, ctl_rx))
            .map_err(NetError::Spawn)?;
        let tcp = sec.tcp;
        let socket = ServerSocket::start(ep, &tcp, "ftmb-logger-accept", move |l, stop| {
            accept_loop(l, stop, sh, sec, opts, inc_tx)
        });
        let socket = match socket {
            Ok(s) => s,
            Err(e) => {
                shared.stop.store(true, Ordering::SeqCst);
                shared.waker.wake();
                let _ = io.join();
                return Err(match e {
                    wire_server::StartError::Bind(b) => NetError::Bind(b),
                    wire_server::StartError::Io(source) => NetError::Io {
                        ep: ep.clone(),
                        source,
                    },
                    wire_server::StartError::Spawn(e) => NetError::Spawn(e),
                });
            }
        };
        tracing::info!(endpoint = %socket.endpoint(), "ftmb logger listening");
        Ok(LoggerServer {
            socket,
            shared,
            ctl: ctl_tx,
            io: Some(io),
        })
    }

    /// Where the server listens (a TCP port 0 resolved).
    pub fn endpoint(&self) -> &Endpoint {
        self.socket.endpoint()
    }

    /// Runs `f` on the I/O thread, after everything it is doing now.
    fn with<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Inner) -> R + Send + 'static,
    ) -> Result<R, NetError> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.ctl
            .send(Box::new(move |inner| {
                let _ = tx.send(f(inner));
            }))
            .map_err(|_| NetError::ServerGone)?;
        self.shared.waker.wake();
        rx.recv().map_err(|_| NetError::ServerGone)
    }

    /// Names of the masters whose logs are held.
    pub fn masters(&self) -> Vec<String> {
        self.with(|i| i.masters.keys().cloned().collect())
            .unwrap_or_default()
    }

    pub fn stats(&self) -> ServerStats {
        self.with(|i| i.server_stats()).unwrap_or_default()
    }

    /// Per master: generation, queues (logged PAL seq, input positions, held input, connected),
    /// held outputs, snapshot id/age/pending, bytes; and the server's counters.
    pub fn status(&self) -> serde_json::Value {
        self.with(|i| i.status())
            .unwrap_or_else(|e| json!({ "error": e.to_string() }))
    }

    /// Fences `master` (its connections are closed and every later hello of its current
    /// generation or older is refused), after reading what its sockets still hold, and returns
    /// everything needed to recover it. Err if no snapshot was ever applied (the master is
    /// fenced and its logs dropped either way: the caller declared it dead).
    pub fn take_for_recovery(&self, master: &str) -> Result<RecoveryBundle, NetError> {
        let m = master.to_string();
        self.with(move |i| i.take_for_recovery(&m))?
    }
}

impl Drop for LoggerServer {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.waker.wake();
        self.socket.stop_accepting();
        if let Some(t) = self.io.take() {
            let _ = t.join();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Accept thread

fn accept_loop(
    listener: Listener,
    stop_r: UnixStream,
    sh: Arc<Shared>,
    sec: Security,
    opts: ServerOptions,
    inc: Sender<Incoming>,
) {
    wire_server::accept_until_stopped(&listener, &stop_r, &sh.stop, "ftmb logger", |stream| {
        sh.c.connections.fetch_add(1, Ordering::Relaxed);
        if sh.c.active.load(Ordering::Relaxed) >= opts.max_connections as u64 {
            sh.c.over_bound.fetch_add(1, Ordering::Relaxed);
            return ControlFlow::Continue(());
        }
        // One handshake at a time: a peer that stalls delays the others by at most
        // `handshake_timeout` (they wait in the listen backlog).
        if let Some(i) = admit(stream, &sh, &sec, opts.handshake_timeout) {
            sh.c.active.fetch_add(1, Ordering::Relaxed);
            if inc.send(i).is_err() {
                return ControlFlow::Break(());
            }
            sh.waker.wake();
        }
        ControlFlow::Continue(())
    });
}

/// Seals `m` and writes it on a blocking stream, best effort (the peer may be gone).
fn send_now(stream: &Stream, tx: &mut Sealer, m: &NetMsg) {
    let (mut body, mut f) = (Vec::new(), Vec::new());
    if seal_frame(tx, m, MAX_FRAME, &mut body, &mut f).is_ok() {
        let _ = stream.send_all(&f);
    }
}

/// Peer uid, handshake, hello (whose master must be the certified name). `None` (counted) if
/// the peer is refused.
fn admit(stream: Stream, sh: &Shared, sec: &Security, timeout: Duration) -> Option<Incoming> {
    let c = &sh.c;
    // The listener is non-blocking; the accepted socket must not inherit that for the
    // handshake (Linux does not, but say it).
    stream.set_nonblocking(false).ok()?;
    if !wire_server::same_uid_peer(&stream, &c.peer_refused, "ftmb logger") {
        return None;
    }
    let expect = Expect {
        name: None,
        roles: role::REPLICA,
    };
    // The hello is small; the stream's own bound is set once its kind is known.
    let mut o = sec.options_for(!stream.is_unix(), expect, MAX_HELLO);
    o.handshake_timeout = o.handshake_timeout.min(timeout);
    let sess = match session::server(&stream, &sec.identity, &o) {
        Ok(s) => s,
        Err(e) => {
            // Counted as every channel's server counts it (auth vs aborted).
            wire_server::count_handshake_failure(
                &e,
                &c.auth_failures,
                &c.handshake_aborted,
                "ftmb logger",
            );
            return None;
        }
    };
    let (mut tx, mut rx) = (sess.tx, sess.rx);
    stream.set_read_timeout(Some(timeout)).ok()?;
    let mut buf = Vec::new();
    let (master, epoch, kind) = match read_msg(&mut rx, &mut &stream, &mut buf) {
        Ok(NetMsg::Hello {
            master,
            epoch,
            stream: kind,
        }) if master.len() <= MAX_MASTER_NAME => (master, epoch, kind),
        Err(FrameError::Closed | FrameError::Io(_)) => {
            c.handshake_aborted.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        _ => {
            c.protocol_errors.fetch_add(1, Ordering::Relaxed);
            return None;
        }
    };
    let certified = &sess.peer.name;
    if master != *certified {
        // The logs are filed under the hello's name: only the replica itself may open,
        // replace or feed them, whatever else its certificate allows.
        c.identity_mismatch.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(master, certified, "ftmb logger hello names another master");
        let reason = format!("hello names {master:?} but the certificate is {certified:?}");
        send_now(&stream, &mut tx, &NetMsg::Refused { reason });
        return None;
    }
    rx.set_max_body(match kind {
        StreamKind::Queue(_) => MAX_FRAME,
        StreamKind::Session { .. } => MAX_SNAPSHOT_FRAME,
    });
    stream.set_nonblocking(true).ok()?;
    stream.set_read_timeout(None).ok()?;
    stream.set_write_timeout(None).ok()?;
    Some(Incoming {
        stream,
        tx,
        rx,
        master,
        epoch,
        kind,
    })
}

// ---------------------------------------------------------------------------------------------
// I/O thread

struct Conn {
    stream: Stream,
    /// The session's two directions: every frame out is sealed with `tx`, every frame in
    /// opened with `rx` (whose bound is the stream kind's: `MAX_FRAME` or
    /// `MAX_SNAPSHOT_FRAME`).
    tx: Sealer,
    rx: Opener,
    master: String,
    epoch: u64,
    kind: StreamKind,
    rbuf: Vec<u8>,
    /// Bytes of `rbuf` already decoded. Frames are consumed by advancing this and the buffer
    /// is compacted once per read: draining each frame off the front moved the rest of a
    /// 256 KiB read per frame (quadratic; the logger's top entry in the profile).
    rpos: usize,
    wbuf: Vec<u8>,
    eof: bool,
}

/// One queue's input log: seq -> frame, from the snapshot's `input_next` on.
#[derive(Default)]
struct InputLog {
    held: BTreeMap<u64, Vec<u8>>,
    /// First seq not yet logged (everything below it is logged or covered by the snapshot).
    next: u64,
    bytes: usize,
}

#[derive(Default, serde::Serialize)]
struct MasterStats {
    batches: u64,
    bytes_in: u64,
    inputs_logged: u64,
    /// Input records at or below what is logged (a repeated or covered record), ignored.
    inputs_duplicate: u64,
    /// Input records past a gap in the sequence (logged, but the queue cannot replay past it).
    inputs_gap: u64,
    /// Input records naming another queue than the stream's (refused).
    inputs_bad: u64,
    /// Times a queue stream was not read because its input log was at its byte bound.
    input_full_stalls: u64,
    /// Times the session stream was not read because snapshots were waiting.
    snapshot_stalls: u64,
    snapshots_received: u64,
    snapshots_applied: u64,
    snapshots_refused: u64,
    /// Feedback frames written back.
    feedback_sent: u64,
    released: u64,
    /// Batch errors the output logger reported (details in its stats).
    logger_errors: u64,
}

struct Image {
    id: u64,
    meta: Snapshot,
    locals: Vec<BTreeMap<Vec<u8>, Vec<u8>>>,
    applied_at: Instant,
}

struct MasterLog {
    epoch: u64,
    workers: usize,
    logger: OutputLogger,
    /// The session's first (full) snapshot arrived and fixed where the logs start.
    based: bool,
    inputs: Vec<InputLog>,
    image: Option<Image>,
    pending: std::collections::VecDeque<SnapshotMsg>,
    last_id: Option<u64>,
    session: Option<u64>,
    queues: Vec<Option<u64>>,
    stats: MasterStats,
}

struct Inner {
    opts: ServerOptions,
    release: ReleaseFn,
    conns: HashMap<u64, Conn>,
    next_id: u64,
    masters: BTreeMap<String, MasterLog>,
    /// Master -> the highest generation recovered from here: hellos up to it are refused.
    fenced: BTreeMap<String, u64>,
    stats: ServerStats,
    shared: Arc<Shared>,
    /// Scratch for an outbound frame's body (see `seal_frame`).
    body: Vec<u8>,
}

fn io_loop(mut inner: Inner, wake_r: UnixStream, inc: Receiver<Incoming>, ctl: Receiver<Ctl>) {
    let mut fds: Vec<libc::pollfd> = Vec::new();
    let mut ids: Vec<u64> = Vec::new();
    loop {
        while let Ok(f) = ctl.try_recv() {
            f(&mut inner);
        }
        while let Ok(i) = inc.try_recv() {
            inner.on_hello(i);
        }
        if inner.shared.stop.load(Ordering::SeqCst) {
            break;
        }
        inner.pump();
        fds.clear();
        ids.clear();
        fds.push(libc::pollfd {
            fd: wake_r.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        });
        for (&id, c) in &inner.conns {
            let mut events = 0;
            if inner.may_read(c) {
                events |= libc::POLLIN;
            }
            if !c.wbuf.is_empty() {
                events |= libc::POLLOUT;
            }
            // A stream that may not be read now is left out (poll would report its hang-up
            // again and again); it is looked at again once the stall ends.
            if events == 0 {
                continue;
            }
            fds.push(libc::pollfd {
                fd: c.stream.as_raw_fd(),
                events,
                revents: 0,
            });
            ids.push(id);
        }
        // SAFETY: `fds` is a valid array of pollfd for the duration of the call.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            tracing::error!(error = %e, "ftmb logger: poll failed, the logger stops");
            break;
        }
        if fds[0].revents != 0 {
            let mut b = [0u8; 64];
            while matches!((&wake_r).read(&mut b), Ok(n) if n > 0) {}
        }
        for (p, &id) in fds[1..].iter().zip(&ids) {
            if p.revents & libc::POLLOUT != 0 {
                inner.flush(id);
            }
            if p.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0 {
                inner.on_readable(id, false);
            }
        }
    }
    let ids: Vec<u64> = inner.conns.keys().copied().collect();
    for id in ids {
        inner.close(id);
    }
}

impl Inner {
    fn server_stats(&self) -> ServerStats {
        let c = &self.shared.c;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ServerStats {
            connections: l(&c.connections),
            active: self.conns.len() as u64,
            auth_failures: l(&c.auth_failures),
            identity_mismatch: l(&c.identity_mismatch),
            handshake_aborted: l(&c.handshake_aborted),
            peer_refused: l(&c.peer_refused),
            over_bound: l(&c.over_bound),
            protocol_errors: l(&c.protocol_errors) + self.stats.protocol_errors,
            ..self.stats.clone()
        }
    }

    fn may_read(&self, c: &Conn) -> bool {
        let Some(m) = self.masters.get(&c.master).filter(|m| m.epoch == c.epoch) else {
            return true; // reads to EOF / refusal; the frames are ignored
        };
        match c.kind {
            StreamKind::Queue(q) => {
                m.based
                    && m.inputs
                        .get(q as usize)
                        .is_some_and(|i| i.bytes < self.opts.max_input_bytes_per_queue)
            }
            StreamKind::Session { .. } => m.pending.len() < self.opts.max_pending_snapshots,
        }
    }

    fn refuse(&mut self, mut i: Incoming, reason: String) {
        tracing::warn!(reason, "ftmb logger: hello refused");
        // Best effort on a fresh socket (its buffer is empty; it is non-blocking now, so a
        // peer that does not read cannot hold the I/O thread); then close.
        send_now(&i.stream, &mut i.tx, &NetMsg::Refused { reason });
        self.shared.c.active.fetch_sub(1, Ordering::Relaxed);
    }

    fn on_hello(&mut self, i: Incoming) {
        if let Some(&f) = self.fenced.get(&i.master) {
            if i.epoch <= f {
                self.stats.refused_fenced += 1;
                let r = format!(
                    "master {:?} was recovered at generation {f}: generation {} is fenced",
                    i.master, i.epoch
                );
                return self.refuse(i, r);
            }
        }
        let cur = self.masters.get(&i.master).map(|m| m.epoch);
        match i.kind {
            StreamKind::Session { workers } => {
                if let Some(e) = cur.filter(|&e| e > i.epoch) {
                    self.stats.refused_stale += 1;
                    let r = format!(
                        "master {:?}: generation {} is older than the current session's {e}",
                        i.master, i.epoch
                    );
                    return self.refuse(i, r);
                }
                let workers = workers as usize;
                if workers == 0 || workers > MAX_QUEUES {
                    self.stats.refused_other += 1;
                    return self.refuse(i, format!("{workers} workers: 1..={MAX_QUEUES}"));
                }
                if cur.is_none() && self.masters.len() >= self.opts.max_masters {
                    self.stats.refused_other += 1;
                    let r = format!("already {} masters logged here", self.masters.len());
                    return self.refuse(i, r);
                }
                let mut cfg = self.opts.logger.clone();
                cfg.queues = workers;
                let logger = match OutputLogger::new(cfg) {
                    Ok(l) => l,
                    Err(e) => {
                        self.stats.refused_other += 1;
                        return self.refuse(i, e.to_string());
                    }
                };
                if let Some(old) = self.masters.remove(&i.master) {
                    self.stats.sessions_replaced += 1;
                    for id in old
                        .session
                        .into_iter()
                        .chain(old.queues.into_iter().flatten())
                    {
                        self.close(id);
                    }
                }
                let (master, epoch) = (i.master.clone(), i.epoch);
                let id = self.add_conn(i);
                self.masters.insert(
                    master.clone(),
                    MasterLog {
                        epoch,
                        workers,
                        logger,
                        based: false,
                        inputs: (0..workers).map(|_| InputLog::default()).collect(),
                        image: None,
                        pending: Default::default(),
                        last_id: None,
                        session: Some(id),
                        queues: vec![None; workers],
                        stats: MasterStats::default(),
                    },
                );
                self.send(id, &NetMsg::Welcome);
                tracing::info!(master, epoch, workers, "ftmb session up");
            }
            StreamKind::Queue(q) => {
                let Some(m) = self.masters.get(&i.master) else {
                    self.stats.refused_other += 1;
                    let r = format!(
                        "master {:?} has no session here: connect it first",
                        i.master
                    );
                    return self.refuse(i, r);
                };
                if m.epoch != i.epoch {
                    let r = format!(
                        "master {:?}: queue of generation {}, the session is generation {}",
                        i.master, i.epoch, m.epoch
                    );
                    if i.epoch < m.epoch {
                        self.stats.refused_stale += 1;
                    } else {
                        self.stats.refused_other += 1;
                    }
                    return self.refuse(i, r);
                }
                if q as usize >= m.workers {
                    self.stats.refused_other += 1;
                    let r = format!("queue {q}: the session declared {} workers", m.workers);
                    return self.refuse(i, r);
                }
                let old = m.queues[q as usize];
                if let Some(old) = old {
                    self.close(old);
                }
                let master = i.master.clone();
                let id = self.add_conn(i);
                if let Some(m) = self.masters.get_mut(&master) {
                    m.queues[q as usize] = Some(id);
                }
                self.send(id, &NetMsg::Welcome);
            }
        }
    }

    fn add_conn(&mut self, i: Incoming) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        self.conns.insert(
            id,
            Conn {
                stream: i.stream,
                tx: i.tx,
                rx: i.rx,
                master: i.master,
                epoch: i.epoch,
                kind: i.kind,
                rbuf: Vec::new(),
                rpos: 0,
                wbuf: Vec::new(),
                eof: false,
            },
        );
        id
    }

    fn close(&mut self, id: u64) {
        let Some(c) = self.conns.remove(&id) else {
            return;
        };
        let _ = c.stream.shutdown(std::net::Shutdown::Both);
        self.shared.c.active.fetch_sub(1, Ordering::Relaxed);
        if let Some(m) = self.masters.get_mut(&c.master) {
            if m.session == Some(id) {
                m.session = None;
            }
            for s in m.queues.iter_mut() {
                if *s == Some(id) {
                    *s = None;
                }
            }
        }
    }

    /// Queues `m` on connection `id` and writes what the socket takes now.
    fn send(&mut self, id: u64, m: &NetMsg) -> bool {
        let max_out = self.opts.max_out_bytes;
        let Some(c) = self.conns.get_mut(&id) else {
            return false;
        };
        // The outbound bound applies to the body before it is sealed: a frame sealed and then
        // dropped would leave a hole in the sequence and the peer would close the stream.
        let max = if c.wbuf.is_empty() {
            MAX_FRAME
        } else {
            max_out
                .saturating_sub(c.wbuf.len() + FRAME_OVERHEAD)
                .min(MAX_FRAME)
        };
        match seal_frame(&mut c.tx, m, max, &mut self.body, &mut c.wbuf) {
            Ok(()) => {}
            Err(FrameError::TooLarge { .. }) if !c.wbuf.is_empty() => {
                self.stats.out_dropped += 1;
                return false;
            }
            Err(_) => return false,
        }
        self.flush(id);
        true
    }

    fn flush(&mut self, id: u64) {
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        let mut done = 0;
        let mut failed = false;
        while done < c.wbuf.len() {
            let rest = &c.wbuf[done..];
            // SAFETY: pointer and length describe `rest`, a valid readable slice.
            let n = unsafe {
                libc::send(
                    c.stream.as_raw_fd(),
                    rest.as_ptr().cast(),
                    rest.len(),
                    libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
                )
            };
            if n > 0 {
                done += n as usize;
                continue;
            }
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::Interrupted => continue,
                io::ErrorKind::WouldBlock => break,
                _ => {
                    failed = true;
                    break;
                }
            }
        }
        c.wbuf.drain(..done);
        self.stats.bytes_out += done as u64;
        if failed {
            // The peer is gone; its unread input (if any) is still read until EOF.
            c.wbuf.clear();
        }
    }

    /// Reads what `id` has (one chunk; everything when `drain`) and processes the complete
    /// frames the bounds allow.
    fn on_readable(&mut self, id: u64, drain: bool) {
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        if c.rpos > 0 {
            c.rbuf.drain(..c.rpos);
            c.rpos = 0;
        }
        let mut got = 0u64;
        loop {
            match recv_into(&c.stream, &mut c.rbuf, READ_CHUNK) {
                Ok(0) => {
                    c.eof = true;
                    break;
                }
                Ok(n) => {
                    self.stats.bytes_in += n as u64;
                    got += n as u64;
                    if !drain || got >= MAX_DRAIN {
                        break;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(_) => {
                    c.eof = true;
                    break;
                }
            }
        }
        if got > 0 {
            let (master, epoch) = (c.master.clone(), c.epoch);
            if let Some(m) = self.masters.get_mut(&master).filter(|m| m.epoch == epoch) {
                m.stats.bytes_in += got;
            }
        }
        self.process_buffered(id, drain);
    }

    /// Processes the complete frames buffered for `id` while its bounds allow (all of them
    /// when `force`); closes it at EOF once nothing complete is left.
    fn process_buffered(&mut self, id: u64, force: bool) {
        loop {
            let Some(c) = self.conns.get(&id) else {
                return;
            };
            if !force && !self.may_read(c) {
                self.count_stall(id);
                return;
            }
            let eof = c.eof;
            let Some(c) = self.conns.get_mut(&id) else {
                return;
            };
            match open_front(&mut c.rx, &mut c.rbuf[c.rpos..]) {
                Ok(Some((m, n))) => {
                    c.rpos += n;
                    if c.rpos >= c.rbuf.len() {
                        c.rbuf.clear();
                        c.rpos = 0;
                    }
                    self.stats.frames_in += 1;
                    if let Err(why) = self.on_frame(id, m) {
                        self.stats.protocol_errors += 1;
                        tracing::warn!(why, "ftmb logger: connection closed");
                        self.close(id);
                        return;
                    }
                }
                Ok(None) => {
                    if eof {
                        self.close(id);
                    }
                    return;
                }
                Err(e) => {
                    // Bad tag (injected, replayed, reordered), other kind or version, over the
                    // bound, undecodable: the stream cannot be trusted past this point.
                    self.stats.decode_errors += 1;
                    tracing::warn!(error = %e, "ftmb logger: bad frame, connection closed");
                    self.close(id);
                    return;
                }
            }
        }
    }

    fn count_stall(&mut self, id: u64) {
        let Some(c) = self.conns.get(&id) else {
            return;
        };
        let kind = c.kind;
        if let Some(m) = self.masters.get_mut(&c.master) {
            match kind {
                StreamKind::Queue(_) if m.based => m.stats.input_full_stalls += 1,
                StreamKind::Queue(_) => {}
                StreamKind::Session { .. } => m.stats.snapshot_stalls += 1,
            }
        }
    }

    /// Frames buffered while their stream was stalled are processed once it may go on (poll
    /// would not report them: they are already read).
    fn pump(&mut self) {
        let ids: Vec<u64> = self
            .conns
            .iter()
            .filter(|(_, c)| c.rbuf.len() > c.rpos || c.eof)
            .map(|(&id, _)| id)
            .collect();
        for id in ids {
            if self.conns.get(&id).is_some_and(|c| self.may_read(c)) {
                self.process_buffered(id, false);
            }
        }
    }

    fn on_frame(&mut self, id: u64, m: NetMsg) -> Result<(), String> {
        let Some(c) = self.conns.get(&id) else {
            return Ok(());
        };
        let (master, epoch, kind) = (c.master.clone(), c.epoch, c.kind);
        let Some(ml) = self.masters.get_mut(&master).filter(|m| m.epoch == epoch) else {
            // A replaced session's straggler: its logs are gone, ignore.
            return Ok(());
        };
        match (kind, m) {
            (StreamKind::Queue(q), NetMsg::Batch(b)) => {
                if b.queue != q {
                    return Err(format!("batch of queue {} on queue {q}'s stream", b.queue));
                }
                ml.stats.batches += 1;
                self.on_batch(&master, q, b);
                Ok(())
            }
            (StreamKind::Session { .. }, NetMsg::Snapshot(s)) => self.on_snapshot(&master, s),
            (_, other) => Err(format!("unexpected frame {other:?} on a {kind:?} stream")),
        }
    }

    fn on_batch(&mut self, master: &str, q: QueueId, b: LogBatch) {
        let Some(m) = self.masters.get_mut(master) else {
            return;
        };
        let qi = q as usize;
        // Input records leave the batch in place (no second Vec per batch); the rest goes
        // to the output logger in order.
        let mut msgs = b.msgs;
        msgs.retain_mut(|msg| {
            let LogMsg::Input { id, frame } = msg else {
                return true;
            };
            if id.queue != q {
                m.stats.inputs_bad += 1;
                return false;
            }
            let il = &mut m.inputs[qi];
            if id.seq < il.next || il.held.contains_key(&id.seq) {
                m.stats.inputs_duplicate += 1;
                return false;
            }
            if id.seq > il.next {
                m.stats.inputs_gap += 1;
            }
            il.bytes += frame.len();
            il.held.insert(id.seq, std::mem::take(frame));
            while il.held.contains_key(&il.next) {
                il.next += 1;
            }
            m.stats.inputs_logged += 1;
            false
        });
        // Stale batches are fenced per connection (hello generation), so the output logger
        // takes every batch of the current session under its own generation.
        let epoch = m.logger.epoch();
        if m.logger
            .ingest(LogBatch {
                queue: q,
                epoch,
                msgs,
            })
            .is_err()
        {
            m.stats.logger_errors += 1;
        }
        self.after_ingest(master);
    }

    /// Hands out released output and feedback, applies snapshots that became complete.
    fn after_ingest(&mut self, master: &str) {
        let Some(m) = self.masters.get_mut(master) else {
            return;
        };
        let released = m.logger.drain_released();
        m.stats.released += released.len() as u64;
        let mut feedback = m.logger.drain_feedback();
        if self.opts.release_to_master {
            // Release is FIFO per queue: the last released id of a queue confirms all before.
            let mut upto: Vec<Option<OutputId>> = vec![None; m.queues.len()];
            for r in &released {
                if let Some(u) = upto.get_mut(r.id.packet.queue as usize) {
                    *u = Some(u.map_or(r.id, |p| p.max(r.id)));
                }
            }
            feedback.extend(
                upto.into_iter()
                    .enumerate()
                    .filter_map(|(q, u)| Some((q as QueueId, Feedback::Released { upto: u? }))),
            );
        }
        // Cloned only when there is feedback to route (every `confirm_every` PALs, and every
        // release when the masters transmit their own output).
        let queues = if feedback.is_empty() {
            Vec::new()
        } else {
            m.queues.clone()
        };
        if !self.opts.release_to_master {
            for r in released {
                (self.release)(r);
            }
        }
        for (q, f) in feedback {
            if let Some(Some(id)) = queues.get(q as usize) {
                if self.send(*id, &NetMsg::Feedback(f)) {
                    if let Some(m) = self.masters.get_mut(master) {
                        m.stats.feedback_sent += 1;
                    }
                }
            }
        }
        self.try_apply(master);
    }

    fn on_snapshot(&mut self, master: &str, s: SnapshotMsg) -> Result<(), String> {
        let Some(m) = self.masters.get_mut(master) else {
            return Ok(());
        };
        let n = m.workers;
        let bad =
            if s.locals.len() != n || s.meta.pal_seq.len() != n || s.meta.input_next.len() != n {
                Some(format!("snapshot {} is not shaped for {n} queues", s.id))
            } else if m.last_id.is_some_and(|l| s.id <= l) {
                Some(format!(
                    "snapshot {} after {:?}: ids must grow",
                    s.id, m.last_id
                ))
            } else if !m.based && !s.full {
                Some(format!(
                    "snapshot {}: the first of a session must be full",
                    s.id
                ))
            } else {
                None
            };
        if let Some(why) = bad {
            m.stats.snapshots_refused += 1;
            return Err(why);
        }
        m.stats.snapshots_received += 1;
        m.last_id = Some(s.id);
        if !m.based {
            // The master may have run before this logger: its logs start here.
            m.based = true;
            m.logger.start_at(&s.meta.pal_seq);
            for (il, &next) in m.inputs.iter_mut().zip(&s.meta.input_next) {
                il.next = next;
            }
        }
        m.pending.push_back(s);
        self.try_apply(master);
        Ok(())
    }

    fn try_apply(&mut self, master: &str) {
        let mut acks = Vec::new();
        let Some(m) = self.masters.get_mut(master) else {
            return;
        };
        while let Some(s) = m.pending.front() {
            let caught_up = (0..m.workers).all(|q| {
                m.logger.logged(q as QueueId).unwrap_or(0) >= s.meta.pal_seq[q]
                    && m.inputs[q].next >= s.meta.input_next[q]
            });
            if !caught_up {
                break;
            }
            let Some(s) = m.pending.pop_front() else {
                break;
            };
            let mut locals = match (s.full, m.image.take()) {
                (false, Some(img)) => img.locals,
                _ => vec![BTreeMap::new(); m.workers],
            };
            for (map, delta) in locals.iter_mut().zip(s.locals) {
                for (k, v) in delta {
                    match v {
                        Some(v) => map.insert(k, v),
                        None => map.remove(&k),
                    };
                }
            }
            for (il, &next) in m.inputs.iter_mut().zip(&s.meta.input_next) {
                let keep = il.held.split_off(&next);
                let dropped = std::mem::replace(&mut il.held, keep);
                il.bytes = il
                    .bytes
                    .saturating_sub(dropped.values().map(Vec::len).sum::<usize>());
            }
            m.logger.truncate(&s.meta.pal_seq);
            m.stats.snapshots_applied += 1;
            acks.push(s.id);
            m.image = Some(Image {
                id: s.id,
                meta: s.meta,
                locals,
                applied_at: Instant::now(),
            });
        }
        let session = m.session;
        if let (Some(id), Some(&last)) = (session, acks.last()) {
            // Acks are cumulative: the newest says it all.
            self.send(id, &NetMsg::SnapshotAck { id: last });
        }
    }

    fn status(&self) -> serde_json::Value {
        let mut masters = serde_json::Map::new();
        for (name, m) in &self.masters {
            let queues: Vec<serde_json::Value> = (0..m.workers)
                .map(|q| {
                    let il = &m.inputs[q];
                    json!({
                        "logged_pal_seq": m.logger.logged(q as QueueId),
                        "pals_held": m.logger.pals(q as QueueId).count(),
                        "input_next": il.next,
                        "input_held": il.held.len(),
                        "input_bytes": il.bytes,
                        "connected": m.queues[q].is_some(),
                    })
                })
                .collect();
            let logger: &LoggerStats = &m.logger.stats;
            masters.insert(
                name.clone(),
                json!({
                    "epoch": m.epoch,
                    "workers": m.workers,
                    "session_connected": m.session.is_some(),
                    "based": m.based,
                    "queues": queues,
                    "held_outputs": m.logger.held_outputs(),
                    "snapshot_id": m.image.as_ref().map(|i| i.id),
                    "snapshot_age_ms": m.image.as_ref().map(|i| i.applied_at.elapsed().as_millis() as u64),
                    "snapshot_flows": m.image.as_ref().map(|i| i.locals.iter().map(BTreeMap::len).sum::<usize>()),
                    "snapshots_pending": m.pending.len(),
                    "stats": m.stats,
                    "logger": logger,
                }),
            );
        }
        json!({
            "masters": masters,
            "fenced": self.fenced,
            "server": self.server_stats(),
        })
    }

    fn take_for_recovery(&mut self, master: &str) -> Result<RecoveryBundle, NetError> {
        let Some(m) = self.masters.get(master) else {
            return Err(NetError::UnknownMaster {
                master: master.to_string(),
            });
        };
        // What the dead master's sockets still hold was sent before it died: log it first.
        let conns: Vec<u64> = m
            .session
            .into_iter()
            .chain(m.queues.iter().flatten().copied())
            .collect();
        for &id in &conns {
            self.on_readable(id, true);
        }
        for id in conns {
            self.close(id);
        }
        let Some(mut m) = self.masters.remove(master) else {
            return Err(NetError::UnknownMaster {
                master: master.to_string(),
            });
        };
        let f = self.fenced.entry(master.to_string()).or_insert(m.epoch);
        *f = (*f).max(m.epoch);
        self.stats.recoveries += 1;
        let Some(img) = m.image.take() else {
            return Err(NetError::NoSnapshot {
                master: master.to_string(),
            });
        };
        let recovery = m
            .logger
            .recover(&img.meta.pal_seq, &img.meta.var_accesses)
            .map_err(|e| NetError::Unrecoverable {
                master: master.to_string(),
                reason: e.to_string(),
            })?;
        let inputs = m
            .inputs
            .iter_mut()
            .zip(&img.meta.input_next)
            .map(|(il, &next)| {
                std::mem::take(&mut il.held)
                    .into_iter()
                    .filter(|&(s, _)| s >= next)
                    .collect()
            })
            .collect();
        tracing::info!(
            master,
            snapshot = img.id,
            cut = ?recovery.cut,
            "ftmb logs taken for recovery"
        );
        Ok(RecoveryBundle {
            snapshot_id: img.id,
            snapshot: img.meta,
            locals: img
                .locals
                .into_iter()
                .map(|m| m.into_iter().collect())
                .collect(),
            recovery,
            inputs,
            logger: m.logger,
        })
    }
}
