//! Raft messages between replicas over pliant-wire: the project's one framing, authenticated
//! sessions, unix or TCP endpoints.
//!
//! Each replica dials every other one (a sender thread per peer, fed by a bounded queue) and
//! accepts their dials (a reader thread per connection), so each ordered pair has its own
//! one-way connection: no request/answer pairing to keep, and a slow peer only fills its own
//! queue. A message that finds its queue full or its peer unreachable is dropped: Raft
//! retransmits (heartbeats, append probes), which is how it treats a lossy network anyway.
//!
//! Bounds a hostile or broken peer meets: the handshake deadline of pliant-wire, a frame size
//! bound (`max_msg`), an idle bound (a live peer sends heartbeats every tick), at most two
//! connections per member, and the certified name must be a member's whose id the message
//! carries as its sender.

use crate::lock;
use crate::node::Input;
use pliant_wire::endpoint::{Endpoint, Stream};
use pliant_wire::server::{self, ConnThreads, ServerSocket};
use pliant_wire::{kinds, role, Conn, Expect, Security};
use protobuf::Message as _;
use raft::prelude::Message;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A member of the group.
#[derive(Debug, Clone)]
pub struct PeerSpec {
    /// Raft id (non-zero).
    pub id: u64,
    /// Certified name of its identity.
    pub name: String,
    /// Where its transport listens.
    pub endpoint: Endpoint,
}

/// Transport bounds.
#[derive(Debug, Clone)]
pub struct TransportLimits {
    /// Largest frame (an encoded Raft message).
    pub max_msg: usize,
    /// Messages queued per peer before new ones are dropped.
    pub queue: usize,
    /// A peer connection silent this long is closed.
    pub idle: Duration,
    /// Wait before redialling a peer that could not be reached.
    pub redial: Duration,
    pub connect_timeout: Duration,
}

/// Counters of the transport.
#[derive(Debug, Default)]
pub struct TransportStats {
    pub sent: AtomicU64,
    pub dropped: AtomicU64,
    pub received: AtomicU64,
    pub refused: AtomicU64,
    pub auth_failures: AtomicU64,
    pub aborted: AtomicU64,
}

/// How the Raft thread reaches one peer: its queue, the messages in it, the connection the
/// sender thread keeps (shared, so the Raft thread can write on it directly).
struct PeerOut {
    queue: SyncSender<Message>,
    queued: Arc<AtomicUsize>,
    conn: Arc<Mutex<Option<pliant_wire::ConnWriter>>>,
}

/// The bound on a write to a peer (a peer that takes no bytes for this long is cut off).
const WRITE_TIMEOUT: Duration = Duration::from_secs(1);
/// The largest message the Raft thread writes itself (acks, heartbeats and appends of a few
/// entries; a catch-up append goes through the sender thread).
const DIRECT_MAX: u32 = 64 << 10;

pub struct Transport {
    /// Emptied by [`Transport::stop`]: the senders see their queue close at once.
    queues: Mutex<HashMap<u64, PeerOut>>,
    senders: Mutex<Vec<JoinHandle<()>>>,
    server: Mutex<Option<ServerSocket>>,
    conns: Arc<ConnThreads>,
    stopped: Arc<AtomicBool>,
    pub stats: Arc<TransportStats>,
}

impl Transport {
    /// Listens on `me`'s endpoint and starts a sender per other member; received messages go
    /// to `inbox`.
    pub fn start(
        me: &PeerSpec,
        members: &[PeerSpec],
        sec: &Security,
        limits: &TransportLimits,
        inbox: SyncSender<Input>,
    ) -> Result<Transport, server::StartError> {
        let stats = Arc::new(TransportStats::default());
        let stopped = Arc::new(AtomicBool::new(false));
        let conns = Arc::new(ConnThreads::default());
        let by_name: Arc<HashMap<String, u64>> = Arc::new(
            members
                .iter()
                .filter(|p| p.id != me.id)
                .map(|p| (p.name.clone(), p.id))
                .collect(),
        );
        let max_conns = 2 * by_name.len();
        let server = {
            let (stats, stopped, conns) = (stats.clone(), stopped.clone(), conns.clone());
            let (sec, limits, my_id) = (sec.clone(), limits.clone(), me.id);
            let tcp = sec.tcp;
            ServerSocket::start(&me.endpoint, &tcp, "smr-peers", move |l, stop| {
                server::accept_until_stopped(&l, &stop, &stopped, "smr peers", |stream| {
                    if !server::same_uid_peer(&stream, &stats.refused, "smr peers") {
                        return std::ops::ControlFlow::Continue(());
                    }
                    let (sec, limits, st) = (sec.clone(), limits.clone(), stats.clone());
                    let (inbox, by_name) = (inbox.clone(), by_name.clone());
                    let serve = move |s| serve_peer(s, my_id, &sec, &limits, &by_name, &st, &inbox);
                    crate::spawn_bounded(
                        &conns,
                        stream,
                        max_conns,
                        "smr-peer-in",
                        &stats.refused,
                        serve,
                    )
                });
            })?
        };
        let mut queues = HashMap::new();
        let mut senders = Vec::new();
        for p in members.iter().filter(|p| p.id != me.id) {
            let (tx, rx) = mpsc::sync_channel(limits.queue);
            let out = PeerOut {
                queue: tx,
                queued: Arc::default(),
                conn: Arc::default(),
            };
            let (queued, conn) = (out.queued.clone(), out.conn.clone());
            queues.insert(p.id, out);
            let (p, sec, limits) = (p.clone(), sec.clone(), limits.clone());
            let (stats, stopped) = (stats.clone(), stopped.clone());
            let t = std::thread::Builder::new()
                .name(format!("smr-send-{}", p.id))
                .spawn(move || {
                    let out = SendSide {
                        rx: &rx,
                        queued: &queued,
                        conn: &conn,
                    };
                    send_loop(&p, &sec, &limits, &out, &stats, &stopped)
                })
                .map_err(server::StartError::Spawn)?;
            senders.push(t);
        }
        Ok(Transport {
            queues: Mutex::new(queues),
            senders: Mutex::new(senders),
            server: Mutex::new(Some(server)),
            conns,
            stopped,
            stats,
        })
    }

    /// Sends messages to their peers: directly when the peer's queue is empty and its
    /// connection up and free, else through the queue; drops what does not fit.
    pub fn send(&self, msgs: Vec<Message>) {
        if msgs.is_empty() {
            return;
        }
        let queues = lock(&self.queues);
        for m in msgs {
            let Some(out) = queues.get(&m.to) else {
                tracing::warn!(to = m.to, "smr: message to a non-member dropped");
                continue;
            };
            if out.queued.load(Ordering::SeqCst) == 0 && m.compute_size() <= DIRECT_MAX {
                if let Ok(mut g) = out.conn.try_lock() {
                    if let Some(w) = g.as_mut() {
                        match write(w, &m) {
                            Ok(()) => self.stats.sent.fetch_add(1, Ordering::Relaxed),
                            Err(e) => {
                                tracing::debug!(peer = m.to, error = %e, "smr: peer connection lost");
                                *g = None;
                                self.stats.dropped.fetch_add(1, Ordering::Relaxed)
                            }
                        };
                        continue;
                    }
                }
            }
            out.queued.fetch_add(1, Ordering::SeqCst);
            match out.queue.try_send(m) {
                Ok(()) => {}
                Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                    out.queued.fetch_sub(1, Ordering::SeqCst);
                    self.stats.dropped.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }

    /// Stops listening, closes every connection and joins the threads.
    pub fn stop(&self) {
        self.stopped.store(true, Ordering::SeqCst);
        if let Some(mut s) = lock(&self.server).take() {
            s.stop_accepting();
        }
        self.conns.shutdown_and_join();
        lock(&self.queues).clear();
        for t in std::mem::take(&mut *lock(&self.senders)) {
            let _ = t.join();
        }
    }
}

/// The sender thread's side of a peer.
struct SendSide<'a> {
    rx: &'a Receiver<Message>,
    queued: &'a AtomicUsize,
    conn: &'a Mutex<Option<pliant_wire::ConnWriter>>,
}

fn write(w: &mut pliant_wire::ConnWriter, m: &Message) -> Result<(), String> {
    m.write_to_bytes()
        .map_err(|e| e.to_string())
        .and_then(|b| w.send_bytes(kinds::SMR, &b).map_err(|e| e.to_string()))
}

fn send_loop(
    peer: &PeerSpec,
    sec: &Security,
    limits: &TransportLimits,
    out: &SendSide,
    stats: &TransportStats,
    stopped: &AtomicBool,
) {
    let expect = Expect {
        name: Some(peer.name.clone()),
        roles: role::REPLICA,
    };
    let opts = sec.options(&peer.endpoint, expect, limits.max_msg);
    let mut retry_at = Instant::now();
    loop {
        let m = match out.rx.recv_timeout(limits.idle / 4) {
            Ok(m) => m,
            Err(RecvTimeoutError::Timeout) if !stopped.load(Ordering::SeqCst) => continue,
            Err(_) => return,
        };
        if stopped.load(Ordering::SeqCst) {
            return;
        }
        let mut conn = lock(out.conn);
        // Counted as queued until here, so the Raft thread does not write past it.
        out.queued.fetch_sub(1, Ordering::SeqCst);
        if conn.is_none() && Instant::now() >= retry_at {
            match Conn::connect(
                &peer.endpoint,
                &sec.identity,
                &opts,
                limits.connect_timeout,
                &sec.tcp,
            ) {
                Ok(c) => {
                    let w = c.split().2;
                    if let Err(e) = w.stream().set_write_timeout(Some(WRITE_TIMEOUT)) {
                        tracing::debug!(peer = peer.id, error = %e, "smr: no write bound");
                    } else {
                        *conn = Some(w);
                    }
                }
                Err(e) => {
                    tracing::debug!(peer = peer.id, error = %e, "smr: peer unreachable");
                    retry_at = Instant::now() + limits.redial;
                }
            }
        }
        let Some(w) = conn.as_mut() else {
            stats.dropped.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        match write(w, &m) {
            Ok(()) => {
                stats.sent.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                tracing::debug!(peer = peer.id, error = %e, "smr: peer connection lost");
                stats.dropped.fetch_add(1, Ordering::Relaxed);
                *conn = None;
                retry_at = Instant::now();
            }
        }
    }
}

fn serve_peer(
    s: Stream,
    me: u64,
    sec: &Security,
    limits: &TransportLimits,
    by_name: &HashMap<String, u64>,
    stats: &TransportStats,
    inbox: &SyncSender<Input>,
) {
    let expect = Expect {
        name: None,
        roles: role::REPLICA,
    };
    let opts = sec.options_for(!s.is_unix(), expect, limits.max_msg);
    let conn = match Conn::server(s, &sec.identity, &opts) {
        Ok(c) => c,
        Err(e) => {
            server::count_handshake_failure(&e, &stats.auth_failures, &stats.aborted, "smr");
            return;
        }
    };
    let (peer, mut reader, _writer) = conn.split();
    let Some(&from) = by_name.get(&peer.name) else {
        stats.auth_failures.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(name = %peer.name, "smr: a replica that is not a member dialled in");
        return;
    };
    if let Err(e) = reader.stream().set_read_timeout(Some(limits.idle)) {
        tracing::warn!(error = %e, "smr: cannot bound the peer connection's idle time");
        return;
    }
    loop {
        let m = match reader.recv_bytes() {
            Ok((kinds::SMR, b)) => Message::parse_from_bytes(b),
            Ok((kind, _)) => {
                tracing::warn!(kind, "smr: frame of another channel");
                return;
            }
            Err(e) => {
                tracing::debug!(from, error = %e, "smr: peer connection closed");
                return;
            }
        };
        let m = match m {
            Ok(m) if m.from == from && m.to == me => m,
            Ok(m) => {
                tracing::warn!(
                    from,
                    claimed = m.from,
                    to = m.to,
                    "smr: misaddressed message"
                );
                return;
            }
            Err(e) => {
                tracing::warn!(from, error = %e, "smr: undecodable message");
                return;
            }
        };
        stats.received.fetch_add(1, Ordering::Relaxed);
        if inbox.send(Input::Peer(m)).is_err() {
            return;
        }
    }
}
