//! The client-facing listener. Only the leader serves: a follower's front closes what it
//! accepts at once (the client finds the leader; a redirect is a later step). Each accepted
//! client gets a connection id, and everything it does becomes an event proposed to Raft:
//! connect, each read of bytes, close (FIN) or reset. The client's replies come from the
//! leader's own server, through [`Sinks`], once the events are committed and applied.
//!
//! Bounds: at most `max_clients` connections (more are closed on accept), one event carries at
//! most `chunk` bytes, a client silent for `idle` is cut (reset event), a client that does not
//! read its replies for `write_timeout` is cut by the output side.

use crate::event::{self, Kind};
use crate::lock;
use crate::node::{Input, Status};
use pliant_wire::endpoint::{Endpoint, Stream, TcpTuning};
use pliant_wire::server::{self, ConnThreads, ServerSocket};
use std::collections::HashMap;
use std::io::{self, Read};
use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc::SyncSender;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Client bounds.
#[derive(Debug, Clone)]
pub struct FrontLimits {
    pub max_clients: usize,
    pub chunk: usize,
    pub idle: Duration,
    pub write_timeout: Duration,
}

/// The leader's client streams by connection id: where a connection's server output goes.
#[derive(Default)]
pub struct Sinks {
    map: Mutex<HashMap<u64, Stream>>,
}

impl Sinks {
    pub fn insert(&self, conn: u64, s: Stream) {
        lock(&self.map).insert(conn, s);
    }

    /// A clone of the client stream of `conn`, if this replica serves that client.
    pub fn get(&self, conn: u64) -> Option<Stream> {
        lock(&self.map).get(&conn).and_then(|s| s.try_clone().ok())
    }

    pub fn contains(&self, conn: u64) -> bool {
        lock(&self.map).contains_key(&conn)
    }

    /// Ends the client connection of `conn` (its reader thread sees it and stops).
    pub fn shutdown(&self, conn: u64) {
        if let Some(s) = lock(&self.map).remove(&conn) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    pub fn shutdown_all(&self) {
        for (_, s) in lock(&self.map).drain() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

/// Counters of the front.
#[derive(Debug, Default)]
pub struct FrontStats {
    pub accepted: AtomicU64,
    /// Closed on accept: not the leader.
    pub not_leader: AtomicU64,
    /// Closed on accept: `max_clients` open.
    pub over_bound: AtomicU64,
    pub events: AtomicU64,
}

pub struct Front {
    server: Mutex<Option<ServerSocket>>,
    conns: Arc<ConnThreads>,
    stopped: Arc<AtomicBool>,
    pub stats: Arc<FrontStats>,
}

impl Front {
    pub fn start(
        ep: &Endpoint,
        tcp: &TcpTuning,
        limits: FrontLimits,
        status: Arc<Status>,
        sinks: Arc<Sinks>,
        inbox: SyncSender<Input>,
    ) -> Result<Front, server::StartError> {
        let stats = Arc::new(FrontStats::default());
        let stopped = Arc::new(AtomicBool::new(false));
        let conns = Arc::new(ConnThreads::default());
        let counter = Arc::new(AtomicU32::new(0));
        let server = {
            let (stats, stopped, conns) = (stats.clone(), stopped.clone(), conns.clone());
            ServerSocket::start(ep, tcp, "smr-front", move |l, stop| {
                server::accept_until_stopped(&l, &stop, &stopped, "smr front", |stream| {
                    stats.accepted.fetch_add(1, Ordering::Relaxed);
                    let term = status.leader_term.load(Ordering::SeqCst);
                    if term == 0 {
                        stats.not_leader.fetch_add(1, Ordering::Relaxed);
                        return std::ops::ControlFlow::Continue(());
                    }
                    let id = event::conn_id(term, counter.fetch_add(1, Ordering::Relaxed));
                    let (lim, sinks, inbox, st) =
                        (limits.clone(), sinks.clone(), inbox.clone(), stats.clone());
                    let serve = move |s| serve_client(s, id, &lim, &sinks, &inbox, &st);
                    crate::spawn_bounded(
                        &conns,
                        stream,
                        limits.max_clients,
                        "smr-client",
                        &stats.over_bound,
                        serve,
                    )
                });
            })?
        };
        Ok(Front {
            server: Mutex::new(Some(server)),
            conns,
            stopped,
            stats,
        })
    }

    /// Where clients connect (a port 0 resolved).
    pub fn endpoint(&self) -> Option<Endpoint> {
        lock(&self.server).as_ref().map(|s| s.endpoint().clone())
    }

    /// Stops accepting, cuts every client and joins their threads.
    pub fn stop(&self) {
        self.stopped.store(true, Ordering::SeqCst);
        if let Some(mut s) = lock(&self.server).take() {
            s.stop_accepting();
        }
        self.conns.shutdown_and_join();
    }
}

fn serve_client(
    s: Stream,
    id: u64,
    limits: &FrontLimits,
    sinks: &Sinks,
    inbox: &SyncSender<Input>,
    stats: &FrontStats,
) {
    let propose = |kind, bytes: &[u8]| {
        stats.events.fetch_add(1, Ordering::Relaxed);
        inbox
            .send(Input::Propose {
                conn: id,
                data: event::encode(id, kind, bytes),
            })
            .is_ok()
    };
    let (Ok(sink), Ok(())) = (s.try_clone(), s.set_read_timeout(Some(limits.idle))) else {
        return;
    };
    if sink.set_write_timeout(Some(limits.write_timeout)).is_err() {
        return;
    }
    // The sink is in place before the connect is proposed, so no reply can precede it.
    sinks.insert(id, sink);
    if !propose(Kind::Connect, b"") {
        sinks.shutdown(id);
        return;
    }
    let mut r = s;
    let mut buf = vec![0u8; limits.chunk];
    let end = loop {
        match r.read(&mut buf) {
            Ok(0) => break Kind::Close,
            Ok(n) => {
                if !propose(Kind::Data, &buf[..n]) {
                    break Kind::Reset;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                let idle = matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                );
                tracing::debug!(conn = id, idle, error = %e, "smr client cut");
                break Kind::Reset;
            }
        }
    };
    // The close travels the log like the bytes; the sink stays until the server's side ends
    // (the applier's output reader removes it), so the replies to the last bytes still go out.
    let _ = propose(end, b"");
    if end == Kind::Reset {
        sinks.shutdown(id);
    }
}
