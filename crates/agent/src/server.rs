//! The agent's listener: the control link (pliant-proto) on a unix path or TCP, sealed when the
//! agent has an identity (clients must prove CONTROLLER or ADMIN), requests checked against the
//! term fence, at most [`MAX_CONNECTIONS`] served at once, each idle at most [`IO_TIMEOUT`].

use crate::fabric::Fabric;
use crate::slots::{now_unix_ms, Slots};
use pliant_proto::agent::{AgentRequest, AgentStatus};
use pliant_proto::{Link, TermFence};
use pliant_wire::server::{ConnThreads, ServerSocket, SpawnRefused};
use pliant_wire::{role, Endpoint, Expect, Security, Stream};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

pub const MAX_CONNECTIONS: usize = 16;
/// A client silent this long is cut off (the controller polls far more often).
pub const IO_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest request body (requests are a few dozen bytes), without a fabric to steer.
pub const MAX_REQUEST: usize = 4096;
/// With a fabric: a steering request may carry a migration's exceptions.
pub const MAX_STEER_REQUEST: usize = pliant_proto::link::MAX_REQUEST;

/// What the listener counts.
#[derive(Default)]
pub struct Counters {
    pub requests: AtomicU64,
    pub errors: AtomicU64,
    pub conns_refused: AtomicU64,
    pub auth_failures: AtomicU64,
    pub handshakes_aborted: AtomicU64,
}

pub struct Shared {
    pub name: String,
    pub slots: Arc<Slots>,
    pub fence: TermFence,
    pub counters: Counters,
    pub security: Option<Security>,
    pub probe_ms: u64,
    pub stop: AtomicBool,
    /// The fabric's steering, on the fabric's host (`[fabric]`).
    pub fabric: Option<Arc<Fabric>>,
}

impl Shared {
    pub fn status(&self) -> AgentStatus {
        AgentStatus {
            agent: self.name.clone(),
            term: self.fence.term.load(Ordering::Relaxed),
            deposed_refused: self.fence.refused.load(Ordering::Relaxed),
            now_unix_ms: now_unix_ms(),
            probe_ms: self.probe_ms,
            slots: self.slots.status(),
            fabric: self.fabric.as_ref().map(|f| f.status()),
        }
    }

    fn max_request(&self) -> usize {
        match self.fabric {
            Some(_) => MAX_STEER_REQUEST,
            None => MAX_REQUEST,
        }
    }

    fn error(&self, msg: &str) -> Value {
        self.counters.errors.fetch_add(1, Ordering::Relaxed);
        json!({"ok": false, "error": msg})
    }

    /// One request body's answer.
    pub fn answer(&self, body: &[u8]) -> Value {
        self.counters.requests.fetch_add(1, Ordering::Relaxed);
        let parsed =
            AgentRequest::parse(body).and_then(|r| Ok((r, pliant_proto::request::term_of(body)?)));
        let (req, term) = match parsed {
            Ok(x) => x,
            Err(e) => return self.error(&e),
        };
        if let Err(e) = self.fence.admit(term) {
            tracing::warn!(error = %e, "request refused");
            return self.error(&e);
        }
        if let AgentRequest::Steer { op } = &req {
            let Some(f) = &self.fabric else {
                return self.error(&format!(
                    "agent {} steers no fabric (its config has no [fabric])",
                    self.name
                ));
            };
            return match f.apply(op, &self.fence, term) {
                Ok(a) => {
                    let mut v = serde_json::to_value(a).unwrap_or_default();
                    v["ok"] = json!(true);
                    v
                }
                Err(e) => {
                    tracing::warn!(error = %e, "steering refused");
                    self.error(&e)
                }
            };
        }
        let done = match &req {
            AgentRequest::AgentStatus => Ok(()),
            AgentRequest::Steer { .. } => unreachable!("answered above"),
            AgentRequest::Start { replica } => self.slots.start(replica).map(|_| ()),
            AgentRequest::Stop { replica } => self.slots.stop(replica).map(|_| ()),
        };
        match done {
            Ok(()) => {
                let mut v = serde_json::to_value(self.status()).unwrap_or_default();
                v["ok"] = json!(true);
                v
            }
            Err(e) => self.error(&e.to_string()),
        }
    }
}

/// The running listener; dropping it stops accepting and joins the connection threads.
pub struct Server {
    socket: ServerSocket,
    conns: Arc<ConnThreads>,
    shared: Arc<Shared>,
}

impl Server {
    pub fn start(ep: &Endpoint, shared: Arc<Shared>) -> Result<Server, String> {
        if ep.is_tcp() && shared.security.is_none() {
            return Err(format!("agent listen {ep}: TCP needs an identity"));
        }
        let tcp = shared.security.as_ref().map(|s| s.tcp).unwrap_or_default();
        let conns = Arc::new(ConnThreads::default());
        let (sh, cs) = (shared.clone(), conns.clone());
        let socket = ServerSocket::start(ep, &tcp, "pliant-agent", move |l, stop| {
            pliant_wire::server::accept_until_stopped(&l, &stop, &sh.stop, "agent", |s| {
                accept_one(s, &sh, &cs);
                std::ops::ControlFlow::Continue(())
            })
        })
        .map_err(|e| format!("agent listen {ep}: {e}"))?;
        Ok(Server {
            socket,
            conns,
            shared,
        })
    }

    /// Where it listens (a TCP port 0 resolved).
    pub fn endpoint(&self) -> &Endpoint {
        self.socket.endpoint()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.socket.stop_accepting();
        self.conns.shutdown_and_join();
    }
}

fn accept_one(stream: Stream, sh: &Arc<Shared>, conns: &ConnThreads) {
    if !pliant_wire::server::same_uid_peer(&stream, &sh.counters.conns_refused, "agent") {
        return;
    }
    let _ = stream.set_read_timeout(Some(IO_TIMEOUT));
    let _ = stream.set_write_timeout(Some(IO_TIMEOUT));
    let conn_sh = sh.clone();
    match conns.spawn(stream, MAX_CONNECTIONS, "pliant-agent-conn", move |s| {
        if let Some(link) = open_link(s, &conn_sh) {
            serve(link, &conn_sh);
        }
    }) {
        Ok(()) => {}
        Err(SpawnRefused::OverBound(s)) => {
            sh.counters.conns_refused.fetch_add(1, Ordering::Relaxed);
            tracing::warn!("agent busy: {MAX_CONNECTIONS} connections served, one refused");
            drop(s);
        }
        Err(SpawnRefused::Clone(e) | SpawnRefused::Thread(e)) => {
            let _ = sh.error(&format!("agent connection thread: {e}"));
        }
    }
}

fn open_link(stream: Stream, sh: &Shared) -> Option<Link> {
    let Some(sec) = &sh.security else {
        return Some(Link::local(stream, sh.max_request()));
    };
    let expect = Expect {
        name: None,
        roles: role::CONTROLLER | role::ADMIN,
    };
    let o = sec.options_for(!stream.is_unix(), expect, sh.max_request());
    match pliant_wire::Conn::server(stream, &sec.identity, &o) {
        Ok(c) => Some(Link::Sealed(Box::new(c))),
        Err(e) => {
            pliant_wire::server::count_handshake_failure(
                &e,
                &sh.counters.auth_failures,
                &sh.counters.handshakes_aborted,
                "agent",
            );
            None
        }
    }
}

fn serve(mut link: Link, sh: &Shared) {
    loop {
        let answer = match link.recv() {
            Ok(body) => sh.answer(body),
            Err(pliant_wire::FrameError::Closed) => return,
            Err(e @ pliant_wire::FrameError::TooLarge { .. }) => {
                let e = sh.error(&format!("request too long: {e}"));
                let _ = link.send(e.to_string().as_bytes());
                return;
            }
            Err(_) => return,
        };
        if link.send(answer.to_string().as_bytes()).is_err() {
            return;
        }
    }
}
