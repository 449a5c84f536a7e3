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
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
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

pub struct Transport {
    /// Emptied by [`Transport::stop`]: the senders see their queue close at once.
    queues: Mutex<HashMap<u64, SyncSender<Message>>>,
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
            queues.insert(p.id, tx);
            let (p, sec, limits) = (p.clone(), sec.clone(), limits.clone());
            let (stats, stopped) = (stats.clone(), stopped.clone());
            let t = std::thread::Builder::new()
                .name(format!("smr-send-{}", p.id))
                .spawn(move || send_loop(&p, &sec, &limits, &rx, &stats, &stopped))
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

    /// Queues messages to their peers; drops what does not fit.
    pub fn send(&self, msgs: Vec<Message>) {
        if msgs.is_empty() {
            return;
        }
        let queues = lock(&self.queues);
        for m in msgs {
            let Some(q) = queues.get(&m.to) else {
                tracing::warn!(to = m.to, "smr: message to a non-member dropped");
                continue;
            };
            match q.try_send(m) {
                Ok(()) => {}
                Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
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

fn send_loop(
    peer: &PeerSpec,
    sec: &Security,
    limits: &TransportLimits,
    rx: &Receiver<Message>,
    stats: &TransportStats,
    stopped: &AtomicBool,
) {
    let expect = Expect {
        name: Some(peer.name.clone()),
        roles: role::REPLICA,
    };
    let opts = sec.options(&peer.endpoint, expect, limits.max_msg);
    let mut conn: Option<pliant_wire::ConnWriter> = None;
    let mut retry_at = Instant::now();
    loop {
        let m = match rx.recv_timeout(limits.idle / 4) {
            Ok(m) => m,
            Err(RecvTimeoutError::Timeout) if !stopped.load(Ordering::SeqCst) => continue,
            Err(_) => return,
        };
        if stopped.load(Ordering::SeqCst) {
            return;
        }
        if conn.is_none() && Instant::now() >= retry_at {
            match Conn::connect(
                &peer.endpoint,
                &sec.identity,
                &opts,
                limits.connect_timeout,
                &sec.tcp,
            ) {
                Ok(c) => conn = Some(c.split().2),
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
        let sent = m
            .write_to_bytes()
            .map_err(|e| e.to_string())
            .and_then(|b| w.send_bytes(kinds::SMR, &b).map_err(|e| e.to_string()));
        match sent {
            Ok(()) => {
                stats.sent.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                tracing::debug!(peer = peer.id, error = %e, "smr: peer connection lost");
                stats.dropped.fetch_add(1, Ordering::Relaxed);
                conn = None;
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
