//! A session server: accepts clients, runs each session on its own thread around a
//! [`SessionApp`], and hands sessions to a peer instance or takes them from one
//! ([`crate::migrate`]).
//!
//! A session thread owns its socket, its application state and its not-yet-written output.
//! Freezing it (a byte on its wake socket) makes it stop at a consistent point, between two
//! reads, and hand all three back: nothing of the session is then left anywhere else but in
//! the kernel's socket, which the capsule captures.

use crate::control::ControlServer;
use crate::hold::{HoldError, PacketHold};
use crate::replicate::{Counts, RepStats, Replicator, Update};
use pliant_wire::endpoint::{Endpoint, Listener, Stream, TcpTuning};
use pliant_wire::server::{self, ConnThreads, ServerSocket, StartError};
use pliant_wire::Security;
use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::ops::ControlFlow;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

/// The application layer of a session: its state, how it answers input, and its capsule.
pub trait SessionApp: Send + Sized + 'static {
    fn new_session() -> Self;
    /// Consumes bytes received from the client; appends what to send back to `out`.
    fn on_input(&mut self, input: &[u8], out: &mut Vec<u8>);
    /// The application capsule.
    fn save(&self) -> Vec<u8>;
    /// Rebuilds the state from a capsule; an error refuses the move (the source keeps it).
    fn load(capsule: &[u8]) -> Result<Self, String>;
}

/// A session stopped between two reads: everything of it outside the kernel.
pub struct Frozen<A> {
    pub id: u64,
    pub sock: TcpStream,
    pub app: A,
    /// Output produced and not yet written to the socket.
    pub out: Vec<u8>,
}

enum Exit<A> {
    Frozen(Frozen<A>),
    Ended,
}

struct Handle<A> {
    /// The client's address (the connection's remote end).
    peer: Option<SocketAddr>,
    /// The network namespace of the session's socket (its nsfs inode).
    netns: Option<u64>,
    wake: UnixStream,
    /// Set before the wake byte is sent: a session busy reading sees it between two reads
    /// without going back to poll.
    freeze: Arc<AtomicBool>,
    thread: JoinHandle<Exit<A>>,
}

/// Above this much unwritten output a session stops reading until the client reads.
const MAX_OUT: usize = 1 << 20;

#[derive(Debug, Default)]
pub struct Stats {
    pub accepted: AtomicU64,
    pub moved_out: AtomicU64,
    pub moved_in: AtomicU64,
    /// Peers that failed the handshake of the slice channel.
    pub refused_peers: AtomicU64,
    pub aborted_handshakes: AtomicU64,
    /// Capsules refused (format, application state, restore).
    pub refused_capsules: AtomicU64,
    /// Sessions that ended with a socket error (a reset among them).
    pub session_errors: AtomicU64,
}

pub struct Config {
    pub name: String,
    /// Where clients connect (TCP).
    pub clients: SocketAddr,
    /// Where peer instances send slices.
    pub peer: Endpoint,
    pub security: Security,
    /// Where operators list, count and move sessions ([`crate::control`]); none: no control
    /// channel.
    pub control: Option<Endpoint>,
    /// The backup instance this one replicates its sessions to ([`crate::replicate`]): its
    /// peer endpoint and its name. None: sessions are not replicated.
    pub backup: Option<(Endpoint, String)>,
}

pub(crate) struct Inner<A> {
    pub(crate) name: String,
    sessions: Mutex<HashMap<u64, Handle<A>>>,
    pub(crate) hold: PacketHold,
    pub(crate) security: Security,
    pub stats: Stats,
    /// The control channel's counters.
    pub(crate) control: Arc<crate::control::Counters>,
    stopping: AtomicBool,
    /// Replication, both roles (primary: sessions protected, checkpoints; backup: takeovers).
    pub(crate) rep_stats: Arc<RepStats>,
    /// The channel to the backup, when this instance has one.
    replicator: Mutex<Option<Arc<Replicator>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[derive(Debug, thiserror::Error)]
pub enum InstanceError {
    #[error("packet hold: {0}")]
    Hold(#[from] HoldError),
    #[error("listening for clients on {0}: {1}")]
    Clients(SocketAddr, StartError),
    #[error("listening for peers on {0}: {1}")]
    Peers(Endpoint, StartError),
    #[error("listening for control clients on {0}: {1}")]
    Control(Endpoint, StartError),
    #[error("{0}")]
    Backup(String),
}

/// A running instance.
pub struct Instance<A: SessionApp> {
    pub(crate) inner: Arc<Inner<A>>,
    clients: ServerSocket,
    peers: ServerSocket,
    peer_conns: Arc<ConnThreads>,
    control: Option<ControlServer>,
}

fn random_id() -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: getrandom writes at most 8 bytes into `b`.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), 8, 0) };
    assert_eq!(n, 8, "getrandom: {}", io::Error::last_os_error());
    u64::from_le_bytes(b)
}

impl<A: SessionApp> Instance<A> {
    pub fn start(cfg: Config) -> Result<Instance<A>, InstanceError> {
        let inner = Arc::new(Inner {
            hold: PacketHold::create(&cfg.name)?,
            name: cfg.name,
            sessions: Mutex::new(HashMap::new()),
            security: cfg.security,
            stats: Stats::default(),
            control: Arc::default(),
            stopping: AtomicBool::new(false),
            rep_stats: Arc::default(),
            replicator: Mutex::new(None),
        });
        // The backup first: no session may start before it can be protected.
        if let Some((ep, name)) = &cfg.backup {
            let r = Replicator::start(&inner, ep, name, inner.rep_stats.clone())
                .map_err(InstanceError::Backup)?;
            *lock(&inner.replicator) = Some(Arc::new(r));
        }
        let i = inner.clone();
        let clients = ServerSocket::start(
            &Endpoint::from(cfg.clients),
            &TcpTuning::default(),
            "slice-clients",
            move |l, stop| accept_clients(&i, &l, &stop),
        )
        .map_err(|e| InstanceError::Clients(cfg.clients, e))?;
        let peer_conns = Arc::new(ConnThreads::default());
        let (i, pc) = (inner.clone(), peer_conns.clone());
        let peers = ServerSocket::start(
            &cfg.peer,
            &TcpTuning::default(),
            "slice-peers",
            move |l, stop| {
                server::accept_until_stopped(&l, &stop, &i.stopping, "slice peers", |s| {
                    let i2 = i.clone();
                    let serve = move |s| crate::migrate::serve_peer(&i2, s);
                    if let Err(e) = pc.spawn(s, MAX_PEER_CONNS, "slice-peer", serve) {
                        tracing::warn!(?e, "slice peer connection refused");
                    }
                    ControlFlow::Continue(())
                })
            },
        )
        .map_err(|e| InstanceError::Peers(cfg.peer.clone(), e))?;
        let control = match &cfg.control {
            Some(ep) => Some(
                ControlServer::start(
                    ep,
                    inner.security.clone(),
                    inner.clone(),
                    inner.control.clone(),
                )
                .map_err(|e| InstanceError::Control(ep.clone(), e))?,
            ),
            None => None,
        };
        Ok(Instance {
            inner,
            clients,
            peers,
            peer_conns,
            control,
        })
    }

    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Where clients connect.
    pub fn client_endpoint(&self) -> &Endpoint {
        self.clients.endpoint()
    }

    /// Where peers send slices.
    pub fn peer_endpoint(&self) -> &Endpoint {
        self.peers.endpoint()
    }

    /// Where control clients connect, if the instance has a control channel.
    pub fn control_endpoint(&self) -> Option<&Endpoint> {
        self.control.as_ref().map(ControlServer::endpoint)
    }

    pub fn stats(&self) -> &Stats {
        &self.inner.stats
    }

    /// The sessions this instance serves now.
    pub fn session_ids(&self) -> Vec<u64> {
        let mut v: Vec<u64> = lock(&self.inner.sessions).keys().copied().collect();
        v.sort_unstable();
        v
    }

    /// The sessions this instance serves now, with their clients' addresses.
    pub fn sessions(&self) -> Vec<(u64, Option<SocketAddr>)> {
        self.inner.sessions_with_clients()
    }

    /// The name of this instance's packet-hold table.
    pub fn hold_table(&self) -> &str {
        self.inner.hold.table()
    }

    /// This instance's packet hold (its mode, its queue's counters).
    pub fn hold(&self) -> &PacketHold {
        &self.inner.hold
    }

    /// Replication counters (both roles).
    pub fn replication(&self) -> &RepStats {
        &self.inner.rep_stats
    }
}

impl<A: SessionApp> Drop for Instance<A> {
    fn drop(&mut self) {
        self.inner.stopping.store(true, Ordering::SeqCst);
        // First: a control connection may be moving sessions.
        drop(self.control.take());
        self.clients.stop_accepting();
        self.peers.stop_accepting();
        self.peer_conns.shutdown_and_join();
        let ids: Vec<u64> = lock(&self.inner.sessions).keys().copied().collect();
        let rep = lock(&self.inner.replicator).take();
        for id in ids {
            // Frozen and dropped: the socket closes normally (FIN) with the instance; a
            // replicated one's too (not the RST its death would send), once its backup lets go.
            if let Some(f) = self.inner.freeze(id) {
                if let Some(r) = &rep {
                    let _ = crate::repair::set_linger_reset(&f.sock, false);
                    r.ended(&[id], false);
                }
            }
        }
        // The last reference: the sender says Goodbye after every update before it.
        drop(rep);
    }
}

/// Bound on concurrent peer connections (each moves one session at a time).
const MAX_PEER_CONNS: usize = 16;

fn accept_clients<A: SessionApp>(inner: &Arc<Inner<A>>, l: &Listener, stop: &UnixStream) {
    let Listener::Tcp(tcp, _) = l else {
        return;
    };
    loop {
        match server::wait_accept_or_stop(l, stop) {
            server::Wake::Accept => {}
            server::Wake::Stop => return,
            server::Wake::Failed(e) => {
                tracing::error!(error = %e, "slice clients: poll failed");
                return;
            }
        }
        // Accepted here rather than through the wire listener, which would tune the socket
        // (keepalive, user timeout) with options a capsule does not carry.
        loop {
            match tcp.accept() {
                Ok((s, _)) => {
                    inner.stats.accepted.fetch_add(1, Ordering::Relaxed);
                    let f = Frozen {
                        id: random_id(),
                        sock: s,
                        app: A::new_session(),
                        out: Vec::new(),
                    };
                    // Protected before its first byte of output (one round trip to the
                    // backup per new session).
                    if let Some(r) = inner.replicator() {
                        let st = &inner.rep_stats;
                        match r.protect(f.id, &f.sock, f.app.save()) {
                            Some(_) => st.protected.fetch_add(1, Ordering::Relaxed),
                            None => st.unprotected.fetch_add(1, Ordering::Relaxed),
                        };
                    }
                    if let Err(e) = inner.run(f) {
                        tracing::warn!(error = %e, "cannot start a session");
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::warn!(error = %e, "slice clients: accept failed");
                    break;
                }
            }
        }
    }
}

impl<A: SessionApp> Inner<A> {
    pub(crate) fn is_stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }

    fn replicator(&self) -> Option<Arc<Replicator>> {
        lock(&self.replicator).clone()
    }

    /// Replicated sessions leave this pair (moved away): the backup lets go of their output
    /// before this returns.
    pub(crate) fn leaving_many(&self, ids: &[u64]) {
        if let Some(r) = self.replicator() {
            r.ended(ids, true);
        }
    }

    pub(crate) fn leaving(&self, id: u64) {
        self.leaving_many(&[id]);
    }

    /// The sessions served now with their clients' addresses, by id.
    pub(crate) fn sessions_with_clients(&self) -> Vec<(u64, Option<SocketAddr>)> {
        let mut v: Vec<_> = lock(&self.sessions)
            .iter()
            .map(|(id, h)| (*id, h.peer))
            .collect();
        v.sort_unstable();
        v
    }

    /// Runs a session (new, restored or resumed) on its own thread.
    pub(crate) fn run(self: &Arc<Self>, f: Frozen<A>) -> io::Result<()> {
        f.sock.set_nonblocking(true)?;
        let (wake_r, wake_w) = UnixStream::pair()?;
        let freeze = Arc::new(AtomicBool::new(false));
        let freeze_seen = freeze.clone();
        let id = f.id;
        let peer = f.sock.peer_addr().ok();
        let netns = crate::repair::socket_netns(&f.sock).ok();
        let me = self.clone();
        let rep = self
            .replicator()
            .and_then(|r| r.counts(id).map(|c| Rep { r, c }));
        let mut sessions = lock(&self.sessions);
        let thread = std::thread::Builder::new()
            .name("slice-session".into())
            .spawn(move || {
                let exit = serve(f, &wake_r, &freeze_seen, &me.stats, rep.as_ref());
                if let Exit::Ended = exit {
                    lock(&me.sessions).remove(&id);
                    if let Some(r) = rep {
                        r.r.ended(&[id], false);
                    }
                }
                exit
            })?;
        sessions.insert(
            id,
            Handle {
                peer,
                netns,
                wake: wake_w,
                freeze,
                thread,
            },
        );
        Ok(())
    }

    /// The network namespace of session `id`'s socket (`None` inside: it could not be read);
    /// `None` when the session is not here.
    pub(crate) fn session_netns(&self, id: u64) -> Option<Option<u64>> {
        lock(&self.sessions).get(&id).map(|h| h.netns)
    }

    /// [`Inner::freeze`] for many sessions: every thread is told first, then each is joined, so
    /// they stop in parallel. In the order of `ids`; `None` for a session that is not here or
    /// ended meanwhile.
    pub(crate) fn freeze_many(&self, ids: &[u64]) -> Vec<Option<Frozen<A>>> {
        let handles: Vec<Option<Handle<A>>> = {
            let mut sessions = lock(&self.sessions);
            ids.iter().map(|id| sessions.remove(id)).collect()
        };
        for h in handles.iter().flatten() {
            h.freeze.store(true, Ordering::SeqCst);
            let _ = (&h.wake).write_all(&[1]);
        }
        handles
            .into_iter()
            .map(|h| match h?.thread.join() {
                Ok(Exit::Frozen(f)) => Some(f),
                _ => None,
            })
            .collect()
    }

    /// Stops session `id` between two reads and takes it over; `None` when there is no such
    /// session or it ended meanwhile.
    pub(crate) fn freeze(&self, id: u64) -> Option<Frozen<A>> {
        let h = lock(&self.sessions).remove(&id)?;
        h.freeze.store(true, Ordering::SeqCst);
        let _ = (&h.wake).write_all(&[1]);
        match h.thread.join() {
            Ok(Exit::Frozen(f)) => Some(f),
            _ => None,
        }
    }
}

fn poll2(fds: &mut [libc::pollfd; 2]) -> io::Result<()> {
    loop {
        // SAFETY: `fds` is a valid array of two pollfd for the duration of the call.
        if unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) } >= 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// A replicated session's link to its backup.
struct Rep {
    r: Arc<Replicator>,
    c: Arc<Counts>,
}

impl Rep {
    /// Sends the backup what changed since the last checkpoint: taken after the application
    /// consumed input and before its output is written (output commit then finds it covered).
    fn checkpoint<A: SessionApp>(&self, f: &Frozen<A>) {
        let c = &self.c;
        let read = c.read.load(Ordering::Relaxed);
        let written = c.written.load(Ordering::Relaxed);
        let produced_total = written + f.out.len() as u64;
        let done = c.ckpt_produced.load(Ordering::Relaxed);
        if read == c.ckpt_read.load(Ordering::Relaxed) && produced_total == done {
            return;
        }
        let new = (produced_total - done) as usize;
        let produced = f.out[f.out.len() - new..].to_vec();
        // SIOCOUTQ: written and not yet acknowledged. An error keeps every byte at the backup.
        let unacked = crate::repair::unacked_bytes(&f.sock).map_or(written, |n| n as u64);
        self.r.checkpoint(Update::Checkpoint {
            id: f.id,
            app: f.app.save(),
            read,
            produced,
            acked: written.saturating_sub(unacked),
            windows: crate::repair::live_windows(&f.sock)
                .ok()
                .flatten()
                .map(|w| (w.snd_wnd, w.rcv_wnd)),
        });
        c.ckpt_read.store(read, Ordering::Relaxed);
        c.ckpt_produced.store(produced_total, Ordering::Relaxed);
    }
}

/// The session loop: read what the client sent, let the application answer, write it out;
/// until the client ends the session or the instance freezes it.
fn serve<A: SessionApp>(
    mut f: Frozen<A>,
    wake: &UnixStream,
    freeze: &AtomicBool,
    stats: &Stats,
    rep: Option<&Rep>,
) -> Exit<A> {
    let mut buf = vec![0u8; 64 << 10];
    let failed = |e: io::Error| {
        stats.session_errors.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(error = %e, "session failed");
        Exit::Ended
    };
    loop {
        let mut events = 0;
        if f.out.len() < MAX_OUT {
            events |= libc::POLLIN;
        }
        if !f.out.is_empty() {
            events |= libc::POLLOUT;
        }
        let mut fds = [
            libc::pollfd {
                fd: f.sock.as_raw_fd(),
                events,
                revents: 0,
            },
            libc::pollfd {
                fd: wake.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        if let Err(e) = poll2(&mut fds) {
            return failed(e);
        }
        if fds[1].revents != 0 {
            return Exit::Frozen(f);
        }
        let mut eof = false;
        while f.out.len() < MAX_OUT {
            match f.sock.read(&mut buf) {
                Ok(0) => {
                    eof = true;
                    break;
                }
                Ok(n) => {
                    f.app.on_input(&buf[..n], &mut f.out);
                    if let Some(r) = rep {
                        r.c.read.fetch_add(n as u64, Ordering::Relaxed);
                    }
                    // Between two reads is a consistent point: what was read is in the
                    // application's state and output, the rest still in the kernel.
                    if freeze.load(Ordering::SeqCst) {
                        if let Some(r) = rep {
                            r.checkpoint(&f);
                        }
                        return Exit::Frozen(f);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return failed(e),
            }
        }
        if let Some(r) = rep {
            r.checkpoint(&f);
        }
        while !f.out.is_empty() {
            match f.sock.write(&f.out) {
                Ok(n) => {
                    f.out.drain(..n);
                    if let Some(r) = rep {
                        r.c.written.fetch_add(n as u64, Ordering::Relaxed);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return failed(e),
            }
        }
        if eof {
            // The client is done sending; what is left to answer goes out before the close
            // (a FIN, also for a replicated session, whose death would send a RST).
            if rep.is_some() {
                let _ = crate::repair::set_linger_reset(&f.sock, false);
            }
            let r = f
                .sock
                .set_nonblocking(false)
                .and_then(|_| f.sock.write_all(&f.out));
            if let Err(e) = r {
                return failed(e);
            }
            return Exit::Ended;
        }
    }
}

/// Whether an accepted peer stream is TCP (the `auto` policy then encrypts its frames).
pub(crate) fn peer_is_tcp(s: &Stream) -> bool {
    matches!(s, Stream::Tcp(_))
}
