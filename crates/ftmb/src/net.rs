//! Client side of the network logger (used by the primary's worker threads): one
//! [`NetTransport`] per worker queue and one [`SnapshotLink`] per master session, each an
//! authenticated stream to a [`crate::server::LoggerServer`] hosted by another replica.
//!
//! Connection set-up, as Pico's replication channel does it (`pliant_ha::transport`): any
//! pliant-wire endpoint (a unix socket on this host, peer uid also checked with SO_PEERCRED;
//! or TCP `host:port` across hosts), the mutual handshake of `pliant_wire::session` (both ends
//! prove a CA-signed identity with the replica role; when the caller names the replica that
//! hosts the logger, the server must prove it is that one), then [`NetMsg`] frames sealed with
//! the session (kind `pliant_wire::kinds::FTMB`, see [`crate::wire::seal_frame`]):
//! `Hello { master, epoch, stream }` -> `Welcome` or `Refused`. The logger refuses a hello
//! whose `master` is not the certified name: a replica logs only as itself. Connect the
//! [`SnapshotLink`] first: its hello opens the master's session at the server (worker count,
//! generation), queue hellos join it.
//!
//! Why this and not the former shared secret (HMAC challenge/response, then plain
//! length-prefixed frames): the handshake authenticated the connection but none of the frames
//! after it, which only held on a unix socket of one host; over TCP anyone on the path could
//! inject or replay log records into an established stream. And one secret shared by every
//! replica let any holder log as any master. Now every frame carries a tag under a
//! per-session key with an implicit sequence number (a frame injected, replayed or reordered
//! fails and the stream is closed), and each replica proves its own certified name.
//!
//! Blocking: after the hello the socket is non-blocking. A send writes what the socket
//! buffer takes and, when it is full, waits for room with poll(2) at most
//! [`NetOptions::write_stall`] *without progress* (counted as a blocked write); past that the
//! link is given up with [`TransportError::TimedOut`] (a frame may be cut, so the stream is
//! unusable: every later call fails the same way). Feedback and acks are read with
//! non-blocking reads only. Nothing here spawns a thread: the worker's own thread does its I/O.

use crate::transport::{LogTransport, TransportError};
use crate::wire::{
    open_front, read_msg, seal_frame, Feedback, LogBatch, LogMsg, NetMsg, OutputId, QueueId,
    SnapshotFrame, SnapshotMsg, StreamKind, FRAME_OVERHEAD, MAX_FRAME,
};
use pliant_wire::endpoint::{self as wire_ep, euid, Endpoint, Stream};
use pliant_wire::session::{self, Expect, Opener, Sealer, SessionError};
use pliant_wire::{role, FrameError, Security};
use std::collections::VecDeque;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Bound on a session-stream frame (a full snapshot of many flows is one frame).
pub const MAX_SNAPSHOT_FRAME: usize = 64 << 20;
/// Longest master name accepted in a hello.
pub const MAX_MASTER_NAME: usize = 255;
/// Bytes read per non-blocking read.
const READ_CHUNK: usize = 64 << 10;
/// A queue stream reads its feedback at most this often. A worker polls feedback on every
/// flush, which under light load is every packet: one recv(2) per packet for confirmations
/// that come every `LoggerConfig::confirm_every` PALs. Resend requests wait this much longer
/// at most (an idle worker still flushes every few ms, so they are always served).
const FEEDBACK_READ_EVERY: Duration = Duration::from_micros(500);
/// Encode buffer capacity a queue stream keeps between batches at most.
const WBUF_KEEP: usize = 256 << 10;
/// Outputs a releasing queue stream holds at most; over it the link is given up (the logger
/// releases nothing: the runtime falls back and releases what is held).
pub const MAX_HELD_OUTPUTS: usize = 1 << 16;
/// A reader thread checks its stop flag at least this often.
const READER_TICK_MS: i32 = 100;

#[derive(Clone, Debug)]
pub struct NetOptions {
    /// Bound on connect + handshake + hello/welcome.
    pub connect_timeout: Duration,
    /// Longest a send waits for socket-buffer room without any byte taken before the link is
    /// given up (the logger is stalled or gone).
    pub write_stall: Duration,
    /// Bound on feedback frames read but not yet polled (over it the oldest is dropped,
    /// counted: feedback is cumulative or re-requested).
    pub max_feedback: usize,
}

impl Default for NetOptions {
    fn default() -> Self {
        NetOptions {
            connect_timeout: Duration::from_secs(2),
            write_stall: Duration::from_secs(1),
            max_feedback: 1024,
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct NetStats {
    pub bytes_sent: u64,
    /// Batches (queue stream) or snapshots (session stream) sent.
    pub frames_sent: u64,
    pub bytes_received: u64,
    pub frames_received: u64,
    /// Writes that found the socket buffer full and waited for room.
    pub blocked_writes: u64,
    /// Total time spent in those waits, in microseconds.
    pub blocked_us: u64,
    pub feedback_dropped: u64,
    /// Connections made after the first (always 0 here: a broken link is replaced by the
    /// runtime with a new transport; kept so the stats shape stays when that changes).
    pub reconnects: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("logger endpoint {ep}: {source}")]
    Io { ep: Endpoint, source: io::Error },
    #[error("logger listener: {0}")]
    Bind(#[from] pliant_wire::BindError),
    #[error("cannot start the logger thread: {0}")]
    Spawn(io::Error),
    #[error("logger peer runs as uid {uid}, this process as {me}: refused")]
    PeerUid { uid: u32, me: u32 },
    #[error("logger handshake with {ep}: {source}")]
    Handshake { ep: Endpoint, source: SessionError },
    #[error("the logger refused the connection: {reason}")]
    Refused { reason: String },
    #[error("logger protocol: {0}")]
    Protocol(String),
    #[error("logger frame: {0}")]
    Frame(#[from] FrameError),
    #[error("the logger took nothing for {waited_ms} ms (socket buffer full): link given up")]
    TimedOut { waited_ms: u64 },
    #[error("logger link broken: {0}")]
    Broken(String),
    #[error("master name of {0} bytes is over the {max} byte bound", max = MAX_MASTER_NAME)]
    BadName(usize),
    #[error("{0} workers: between 1 and {max} are supported", max = crate::wire::MAX_QUEUES)]
    BadWorkers(usize),
    #[error("no logs of master {master:?} here")]
    UnknownMaster { master: String },
    #[error("master {master:?}: no snapshot was applied yet, it cannot be recovered from here")]
    NoSnapshot { master: String },
    #[error("master {master:?}: its logs do not recover: {reason}")]
    Unrecoverable { master: String, reason: String },
    #[error("the logger server thread is gone")]
    ServerGone,
}

/// One authenticated, non-blocking stream, its session's two directions and its read buffer.
struct Conn {
    stream: Stream,
    tx: Sealer,
    /// `None` once a reader thread owns the read direction ([`NetTransport::releasing`]).
    rx: Option<Opener>,
    rbuf: Vec<u8>,
    /// Scratch for a frame's encoded body (see [`seal_frame`]).
    body: Vec<u8>,
    max_in: usize,
    write_stall: Duration,
    /// Why the link is unusable, once it is.
    broken: Option<String>,
    stats: NetStats,
}

/// Where a client dials and whom it expects there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoggerAddr {
    pub endpoint: Endpoint,
    /// The replica hosting the logger, when the caller knows it: the server must prove this
    /// name in the handshake (otherwise any replica of the deployment is accepted).
    pub host: Option<String>,
}

impl LoggerAddr {
    pub fn new(endpoint: Endpoint, host: Option<&str>) -> LoggerAddr {
        LoggerAddr {
            endpoint,
            host: host.map(str::to_string),
        }
    }
}

impl From<Endpoint> for LoggerAddr {
    fn from(endpoint: Endpoint) -> Self {
        LoggerAddr {
            endpoint,
            host: None,
        }
    }
}

/// One non-blocking recv(2) of up to `max` bytes appended to `buf` (no zeroed scratch buffer:
/// this runs on every worker flush). `Ok(0)` is EOF.
pub(crate) fn recv_into(s: &Stream, buf: &mut Vec<u8>, max: usize) -> io::Result<usize> {
    buf.reserve(max);
    let len = buf.len();
    let room = buf.capacity() - len;
    loop {
        // SAFETY: the pointer is `room` writable bytes of `buf`'s spare capacity.
        let n = unsafe {
            libc::recv(
                s.as_raw_fd(),
                buf.as_mut_ptr().add(len).cast(),
                room,
                libc::MSG_DONTWAIT,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        // SAFETY: recv initialised the first `n` bytes of the spare capacity.
        unsafe { buf.set_len(len + n as usize) };
        return Ok(n as usize);
    }
}

/// Waits until `fd` is writable or `timeout` passed; true if writable (or in error, which
/// the next send reports).
fn wait_writable(fd: i32, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLOUT,
            revents: 0,
        };
        let ms = i32::try_from(left.as_millis().max(1)).unwrap_or(i32::MAX);
        // SAFETY: `p` is one valid pollfd for the duration of the call.
        let n = unsafe { libc::poll(&mut p, 1, ms) };
        if n > 0 {
            return true;
        }
        if n < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
            continue;
        }
        if Instant::now() >= deadline {
            return false;
        }
    }
}

impl Conn {
    fn open(
        to: &LoggerAddr,
        sec: &Security,
        hello: NetMsg,
        max_in: usize,
        opts: &NetOptions,
    ) -> Result<Conn, NetError> {
        let ep = &to.endpoint;
        let io_err = |source| NetError::Io {
            ep: ep.clone(),
            source,
        };
        let deadline = Instant::now() + opts.connect_timeout.max(Duration::from_millis(1));
        let left = || {
            deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1))
        };
        let stream = wire_ep::connect(ep, left(), &sec.tcp).map_err(io_err)?;
        // On a unix socket the kernel also vouches for the peer's uid: a second fence.
        if let Some(uid) = stream.peer_uid() {
            let uid = uid.map_err(io_err)?;
            if uid != euid() {
                return Err(NetError::PeerUid { uid, me: euid() });
            }
        }
        let expect = Expect {
            name: to.host.clone(),
            roles: role::REPLICA,
        };
        let mut o = sec.options(ep, expect, max_in);
        o.handshake_timeout = o.handshake_timeout.min(left());
        let sess =
            session::client(&stream, &sec.identity, &o).map_err(|source| NetError::Handshake {
                ep: ep.clone(),
                source,
            })?;
        let (mut tx, mut rx) = (sess.tx, sess.rx);
        stream
            .set_read_timeout(Some(left()))
            .and_then(|()| stream.set_write_timeout(Some(left())))
            .map_err(io_err)?;
        let (mut body, mut f) = (Vec::new(), Vec::new());
        seal_frame(&mut tx, &hello, MAX_FRAME, &mut body, &mut f)?;
        stream
            .send_all(&f)
            .map_err(|e| NetError::Broken(format!("hello: {e}")))?;
        let mut buf = Vec::new();
        let answer = read_msg(&mut rx, &mut &stream, &mut buf).map_err(|e| match e {
            FrameError::Closed => {
                NetError::Broken("the logger closed the connection during the hello".into())
            }
            e => NetError::Broken(format!("hello: {e}")),
        })?;
        match answer {
            NetMsg::Welcome => {}
            NetMsg::Refused { reason } => return Err(NetError::Refused { reason }),
            other => {
                return Err(NetError::Protocol(format!(
                    "expected Welcome or Refused, got {other:?}"
                )))
            }
        }
        stream.set_read_timeout(None).map_err(io_err)?;
        stream.set_write_timeout(None).map_err(io_err)?;
        stream.set_nonblocking(true).map_err(io_err)?;
        Ok(Conn {
            stream,
            tx,
            rx: Some(rx),
            rbuf: Vec::new(),
            body,
            max_in,
            write_stall: opts.write_stall,
            broken: None,
            stats: NetStats {
                bytes_sent: f.len() as u64,
                ..NetStats::default()
            },
        })
    }

    fn check(&self) -> Result<(), NetError> {
        match &self.broken {
            Some(r) => Err(NetError::Broken(r.clone())),
            None => Ok(()),
        }
    }

    fn fail(&mut self, why: String) -> NetError {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        self.broken.get_or_insert(why.clone());
        NetError::Broken(why)
    }

    /// Writes one whole frame (see the module doc for the bound on waiting).
    fn write_frame(&mut self, mut buf: &[u8]) -> Result<(), NetError> {
        self.check()?;
        let fd = self.stream.as_raw_fd();
        while !buf.is_empty() {
            // SAFETY: pointer and length describe `buf`, a valid readable slice.
            let n = unsafe {
                libc::send(
                    fd,
                    buf.as_ptr().cast(),
                    buf.len(),
                    libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
                )
            };
            if n > 0 {
                self.stats.bytes_sent += n as u64;
                buf = &buf[n as usize..];
                continue;
            }
            let e = if n == 0 {
                io::ErrorKind::WriteZero.into()
            } else {
                io::Error::last_os_error()
            };
            match e.kind() {
                io::ErrorKind::Interrupted => continue,
                io::ErrorKind::WouldBlock => {
                    self.stats.blocked_writes += 1;
                    let t0 = Instant::now();
                    let ok = wait_writable(fd, self.write_stall);
                    self.stats.blocked_us += t0.elapsed().as_micros() as u64;
                    if !ok {
                        let waited_ms = self.write_stall.as_millis() as u64;
                        self.fail(format!(
                            "the logger took nothing for {waited_ms} ms (socket buffer full)"
                        ));
                        return Err(NetError::TimedOut { waited_ms });
                    }
                }
                _ => return Err(self.fail(format!("send: {e}"))),
            }
        }
        self.stats.frames_sent += 1;
        Ok(())
    }

    /// Reads whatever is available without blocking and returns the complete frames.
    fn read_available(&mut self) -> Result<Vec<NetMsg>, NetError> {
        self.check()?;
        let Some(rx) = self.rx.as_mut() else {
            return Ok(Vec::new()); // a reader thread reads this stream
        };
        let mut eof = false;
        loop {
            match recv_into(&self.stream, &mut self.rbuf, READ_CHUNK) {
                Ok(0) => {
                    eof = true;
                    break;
                }
                Ok(n) => {
                    self.stats.bytes_received += n as u64;
                    if self.rbuf.len() > self.max_in + FRAME_OVERHEAD {
                        break; // decode (and refuse) before reading more
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(self.fail(format!("recv: {e}"))),
            }
        }
        let mut out = Vec::new();
        let mut used = 0;
        loop {
            match open_front(rx, &mut self.rbuf[used..]) {
                Ok(Some((m, n))) => {
                    used += n;
                    self.stats.frames_received += 1;
                    out.push(m);
                }
                Ok(None) => break,
                Err(e) => return Err(self.fail(format!("bad frame from the logger: {e}"))),
            }
        }
        self.rbuf.drain(..used);
        if eof {
            // Frames that arrived before the close still count; later calls report it.
            self.fail("the logger closed the connection".into());
        }
        Ok(out)
    }
}

fn check_name(master: &str) -> Result<(), NetError> {
    if master.len() > MAX_MASTER_NAME {
        return Err(NetError::BadName(master.len()));
    }
    Ok(())
}

/// One worker queue's stream to the network logger.
pub struct NetTransport {
    conn: Conn,
    queue: QueueId,
    feedback: VecDeque<Feedback>,
    max_feedback: usize,
    /// When the socket was last read for feedback (`FEEDBACK_READ_EVERY`).
    pulled: Option<Instant>,
    /// Encode buffer reused by every batch (its capacity stays at the largest batch).
    wbuf: Vec<u8>,
    /// Set by [`NetTransport::releasing`]: the master transmits its own output.
    releasing: Option<Releasing>,
}

/// Called with each output payload to transmit, in order (under the [`HeldOutputs`] lock:
/// it must not block).
pub type ReleaseSink = Box<dyn FnMut(Vec<u8>) + Send>;

/// Output a queue stream sent to the logger and the logger has not confirmed released yet,
/// kept by the master (payloads stay here; the logger gets the id and VOR only).
///
/// Why: output handed to the logger's process dies with it — a logger host SIGKILLed with
/// output in its hold, its release queue or its socket buffers lost that output for flows
/// whose replica did not fail. Held here, the master transmits each output exactly once:
/// when the logger confirms it released it (`Feedback::Released`, read by the stream's
/// reader thread), or, once the logger is lost, when the runtime gives protection up and
/// calls [`HeldOutputs::release_all`] (with every worker stopped, before they go on with a
/// new logger, so nothing is reordered). Both paths pop under one lock, in FIFO order.
pub struct HeldOutputs {
    st: Mutex<HeldState>,
}

struct HeldState {
    held: VecDeque<(OutputId, Vec<u8>)>,
    sink: ReleaseSink,
    lost: Option<String>,
    released: u64,
}

impl HeldOutputs {
    fn new(sink: ReleaseSink) -> HeldOutputs {
        HeldOutputs {
            st: Mutex::new(HeldState {
                held: VecDeque::new(),
                sink,
                lost: None,
                released: 0,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HeldState> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn hold(&self, id: OutputId, payload: Vec<u8>) {
        let mut st = self.lock();
        st.held.push_back((id, payload));
        if st.held.len() > MAX_HELD_OUTPUTS && st.lost.is_none() {
            st.lost = Some(format!(
                "over {MAX_HELD_OUTPUTS} outputs held: the logger releases nothing"
            ));
        }
    }

    /// The logger released every output up to `upto`: transmit them.
    fn confirm(&self, upto: OutputId) {
        let mut st = self.lock();
        while st.held.front().is_some_and(|(id, _)| *id <= upto) {
            let Some((_, p)) = st.held.pop_front() else {
                break;
            };
            st.released += 1;
            (st.sink)(p);
        }
    }

    /// Transmits everything held, in order, without the logger's confirmation: for the
    /// runtime once the logger is lost (or replaced), with the worker stopped. Returns how
    /// many outputs went.
    pub fn release_all(&self) -> usize {
        let mut st = self.lock();
        let n = st.held.len();
        while let Some((_, p)) = st.held.pop_front() {
            st.released += 1;
            (st.sink)(p);
        }
        n
    }

    /// Outputs held now.
    pub fn held(&self) -> usize {
        self.lock().held.len()
    }

    /// Outputs transmitted so far (confirmed or released by [`HeldOutputs::release_all`]).
    pub fn released(&self) -> u64 {
        self.lock().released
    }

    /// Why the stream is lost (the reader saw it close or fail), if it is.
    pub fn lost(&self) -> Option<String> {
        self.lock().lost.clone()
    }

    fn set_lost(&self, why: String) {
        self.lock().lost.get_or_insert(why);
    }
}

/// The reader thread of a releasing queue stream.
struct Releasing {
    held: Arc<HeldOutputs>,
    feedback: Arc<Mutex<VecDeque<Feedback>>>,
    stop: Arc<AtomicBool>,
    /// A clone of the stream, to wake the reader (shutdown) when the transport is dropped.
    stream: Stream,
    join: Option<JoinHandle<()>>,
}

impl Drop for Releasing {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        if let Some(j) = self.join.take() {
            let _ = j.join();
        }
    }
}

/// Reads a releasing queue stream until it closes or the transport is dropped: confirmed
/// releases go to the held outputs at once (a blocking poll, not the worker's flushes, so
/// output leaves as soon as the logger released it), other feedback to the worker.
#[allow(clippy::too_many_arguments)]
fn read_loop(
    stream: Stream,
    mut rx: Opener,
    max_in: usize,
    max_feedback: usize,
    held: Arc<HeldOutputs>,
    feedback: Arc<Mutex<VecDeque<Feedback>>>,
    stop: Arc<AtomicBool>,
) {
    let mut buf: Vec<u8> = Vec::new();
    let fd = stream.as_raw_fd();
    let why = 'read: loop {
        if stop.load(Ordering::Acquire) {
            return;
        }
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: `p` is one valid pollfd for the duration of the call.
        let n = unsafe { libc::poll(&mut p, 1, READER_TICK_MS) };
        if n <= 0 {
            continue;
        }
        match recv_into(&stream, &mut buf, READ_CHUNK) {
            Ok(0) => break "the logger closed the connection".to_string(),
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ) =>
            {
                continue
            }
            Err(e) => break format!("recv: {e}"),
        }
        let mut used = 0;
        loop {
            match open_front(&mut rx, &mut buf[used..]) {
                Ok(Some((m, n))) => {
                    used += n;
                    match m {
                        NetMsg::Feedback(Feedback::Released { upto }) => held.confirm(upto),
                        NetMsg::Feedback(f) => {
                            let mut q = feedback.lock().unwrap_or_else(|e| e.into_inner());
                            if q.len() >= max_feedback {
                                q.pop_front(); // cumulative or re-requested
                            }
                            q.push_back(f);
                        }
                        NetMsg::Refused { reason } => {
                            break 'read format!("the logger refused: {reason}")
                        }
                        other => {
                            break 'read format!("unexpected frame on a queue stream: {other:?}")
                        }
                    }
                }
                Ok(None) => break,
                Err(e) => break 'read format!("bad frame from the logger: {e}"),
            }
        }
        buf.drain(..used);
        if buf.len() > max_in + FRAME_OVERHEAD {
            break "oversized frame from the logger".to_string();
        }
    };
    if !stop.load(Ordering::Acquire) {
        held.set_lost(why);
    }
}

impl NetTransport {
    /// Connects queue `queue` of master `master` (generation `epoch`, the same as its
    /// [`SnapshotLink`]'s, which must be connected first) as the identity of `sec`, which the
    /// logger requires to be `master`'s.
    pub fn connect(
        to: &LoggerAddr,
        sec: &Security,
        master: &str,
        queue: QueueId,
        epoch: u64,
        opts: &NetOptions,
    ) -> Result<NetTransport, NetError> {
        check_name(master)?;
        let hello = NetMsg::Hello {
            master: master.to_string(),
            epoch,
            stream: StreamKind::Queue(queue),
        };
        Ok(NetTransport {
            conn: Conn::open(to, sec, hello, MAX_FRAME, opts)?,
            queue,
            feedback: VecDeque::new(),
            max_feedback: opts.max_feedback.max(1),
            pulled: None,
            wbuf: Vec::new(),
            releasing: None,
        })
    }

    /// From now on this master transmits its own output: each output's payload stays in the
    /// returned [`HeldOutputs`] (the logger gets its id and VOR, enough to decide) until the
    /// logger confirms it released it (the logger must run with
    /// `ServerOptions::release_to_master`), when `sink` gets it. A thread reads the stream
    /// from now on (blocking poll): confirmations act at once, other feedback goes to
    /// [`LogTransport::poll_feedback`]. Dropping the transport stops the thread; what is
    /// still held stays in the `HeldOutputs` (see [`HeldOutputs::release_all`]).
    pub fn releasing(
        mut self,
        sink: ReleaseSink,
    ) -> Result<(NetTransport, Arc<HeldOutputs>), NetError> {
        let held = Arc::new(HeldOutputs::new(sink));
        let Some(rx) = self.conn.rx.take() else {
            return Err(NetError::Protocol("the stream already has a reader".into()));
        };
        let spawn_err = |e: io::Error| NetError::Spawn(e);
        let reader_stream = self.conn.stream.try_clone().map_err(spawn_err)?;
        let wake = self.conn.stream.try_clone().map_err(spawn_err)?;
        let feedback = Arc::new(Mutex::new(VecDeque::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (h, f, st) = (Arc::clone(&held), Arc::clone(&feedback), Arc::clone(&stop));
        let (max_in, max_fb) = (self.conn.max_in, self.max_feedback);
        let join = std::thread::Builder::new()
            .name(format!("ftmb-rel-q{}", self.queue))
            .spawn(move || read_loop(reader_stream, rx, max_in, max_fb, h, f, st))
            .map_err(spawn_err)?;
        self.releasing = Some(Releasing {
            held: Arc::clone(&held),
            feedback,
            stop,
            stream: wake,
            join: Some(join),
        });
        Ok((self, held))
    }

    pub fn queue(&self) -> QueueId {
        self.queue
    }

    pub fn stats(&self) -> NetStats {
        self.conn.stats.clone()
    }

    /// Why the link is unusable, if it is.
    pub fn broken(&self) -> Option<&str> {
        self.conn.broken.as_deref()
    }

    fn pull(&mut self) {
        // An error marks the link broken; the next send reports it.
        let Ok(msgs) = self.conn.read_available() else {
            return;
        };
        for m in msgs {
            match m {
                NetMsg::Feedback(f) => {
                    if self.feedback.len() >= self.max_feedback {
                        self.feedback.pop_front();
                        self.conn.stats.feedback_dropped += 1;
                    }
                    self.feedback.push_back(f);
                }
                NetMsg::Refused { reason } => {
                    self.conn.fail(format!("the logger refused: {reason}"));
                }
                other => {
                    self.conn
                        .fail(format!("unexpected frame on a queue stream: {other:?}"));
                }
            }
        }
    }
}

fn to_transport(e: NetError) -> TransportError {
    match e {
        NetError::TimedOut { waited_ms } => TransportError::TimedOut { waited_ms },
        NetError::Frame(FrameError::TooLarge { len, .. }) => TransportError::TooLarge(len),
        other => TransportError::Broken(other.to_string()),
    }
}

impl LogTransport for NetTransport {
    fn send(&mut self, mut batch: LogBatch) -> Result<(), TransportError> {
        if let Some(r) = &self.releasing {
            // Held here before anything can fail: a batch that does not reach the logger
            // loses its PALs (the runtime starts its next logger past them) but never output.
            for m in &mut batch.msgs {
                if let LogMsg::Output { id, payload, .. } = m {
                    r.held.hold(*id, std::mem::take(payload));
                }
            }
            if let Some(why) = r.held.lost() {
                return Err(to_transport(self.conn.fail(why)));
            }
        }
        self.wbuf.clear();
        let c = &mut self.conn;
        seal_frame(
            &mut c.tx,
            &NetMsg::Batch(batch),
            MAX_FRAME,
            &mut c.body,
            &mut self.wbuf,
        )
        .map_err(|e| to_transport(e.into()))?;
        let r = self.conn.write_frame(&self.wbuf).map_err(to_transport);
        // A large batch (a burst) must not pin its buffer for the life of the link.
        if self.wbuf.capacity() > WBUF_KEEP {
            self.wbuf = Vec::new();
        }
        if self.conn.body.capacity() > WBUF_KEEP {
            self.conn.body = Vec::new();
        }
        r
    }

    fn poll_feedback(&mut self) -> Option<Feedback> {
        if let Some(r) = &self.releasing {
            return r
                .feedback
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .pop_front();
        }
        if self.feedback.is_empty() && self.conn.broken.is_none() {
            let now = Instant::now();
            if self
                .pulled
                .is_none_or(|t| now.duration_since(t) >= FEEDBACK_READ_EVERY)
            {
                self.pulled = Some(now);
                self.pull();
            }
        }
        self.feedback.pop_front()
    }

    fn net_stats(&self) -> Option<NetStats> {
        Some(self.stats())
    }
}

/// The session stream of a master: snapshots go out, acks come back.
pub struct SnapshotLink {
    conn: Conn,
    acked: Option<u64>,
    workers: usize,
}

impl SnapshotLink {
    /// Opens (or replaces, for a higher or equal `epoch`) the session of `master` with
    /// `workers` queues at the logger, as the identity of `sec` (which must be `master`'s).
    pub fn connect(
        to: &LoggerAddr,
        sec: &Security,
        master: &str,
        epoch: u64,
        workers: usize,
        opts: &NetOptions,
    ) -> Result<SnapshotLink, NetError> {
        check_name(master)?;
        if workers == 0 || workers > crate::wire::MAX_QUEUES {
            return Err(NetError::BadWorkers(workers));
        }
        let hello = NetMsg::Hello {
            master: master.to_string(),
            epoch,
            stream: StreamKind::Session {
                workers: workers as u16,
            },
        };
        Ok(SnapshotLink {
            conn: Conn::open(to, sec, hello, MAX_FRAME, opts)?,
            acked: None,
            workers,
        })
    }

    /// Ships one snapshot (the first on a session must be `full`). Waits for socket-buffer
    /// room like [`NetTransport`]'s send (bounded, see the module doc).
    pub fn send(&mut self, snap: &SnapshotMsg) -> Result<(), NetError> {
        let n = self.workers;
        if snap.locals.len() != n || snap.meta.pal_seq.len() != n || snap.meta.input_next.len() != n
        {
            return Err(NetError::Protocol(format!(
                "snapshot {} has {}/{}/{} queues (locals/pal_seq/input_next), the session {n}",
                snap.id,
                snap.locals.len(),
                snap.meta.pal_seq.len(),
                snap.meta.input_next.len()
            )));
        }
        self.conn.check()?;
        let c = &mut self.conn;
        let mut f = Vec::new();
        seal_frame(
            &mut c.tx,
            &SnapshotFrame(snap),
            MAX_SNAPSHOT_FRAME,
            &mut c.body,
            &mut f,
        )?;
        // A full snapshot may be megabytes: its scratch copy is not kept for the next one.
        c.body = Vec::new();
        self.conn.write_frame(&f)
    }

    /// The highest snapshot id the logger applied (non-blocking).
    pub fn acked(&mut self) -> Option<u64> {
        if self.conn.broken.is_none() {
            if let Ok(msgs) = self.conn.read_available() {
                for m in msgs {
                    match m {
                        NetMsg::SnapshotAck { id } => {
                            self.acked = Some(self.acked.map_or(id, |a| a.max(id)));
                        }
                        NetMsg::Refused { reason } => {
                            self.conn.fail(format!("the logger refused: {reason}"));
                        }
                        other => {
                            self.conn
                                .fail(format!("unexpected frame on the session: {other:?}"));
                        }
                    }
                }
            }
        }
        self.acked
    }

    pub fn stats(&self) -> NetStats {
        self.conn.stats.clone()
    }

    /// Why the link is unusable, if it is.
    pub fn broken(&self) -> Option<&str> {
        self.conn.broken.as_deref()
    }
}
