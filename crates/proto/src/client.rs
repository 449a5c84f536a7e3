//! The client side of the control channel: one connection per [`Client`] call, or links
//! kept between the requests of a polling loop ([`KeptLinks`]); either way a connection never
//! outlives a request that timed out, so a late answer can never be taken for the next
//! request's.

use crate::link::{Link, MAX_ANSWER};
use crate::reply::{self, FlowEntry};
use crate::request::Request;
use crate::Command;
use pliant_state::FlowKey;
use pliant_wire::frame::FrameError;
use pliant_wire::{role, Endpoint, Expect, Security};
use serde::de::DeserializeOwned;
use serde_json::Value;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a slow request (`migrate_out`, `ftmb_protect`, `ftmb_activate`) may take to be
/// answered: the replica bounds each of them on its own side (20 s at most).
pub const SLOW_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum ControlError {
    #[error("replica control {ep}: {reason}")]
    Io { ep: String, reason: String },
    #[error("replica {ep} refused {cmd}: {error}")]
    Refused {
        ep: String,
        cmd: String,
        error: String,
    },
    #[error("replica {ep} answered {cmd} with a malformed answer: {reason}")]
    Malformed {
        ep: String,
        cmd: String,
        reason: String,
    },
}

/// Authenticated links kept between the rounds of a polling loop (the controller's heartbeats
/// and status polls of replicas, its polls of host agents), per peer. A new connection per
/// request costs both ends a handshake (two signatures, two verifications and an X25519
/// agreement), on a loaded host more CPU than the request itself, and a thread start at the
/// peer. A link is taken out while in use and put back only after a good answer, so a link
/// that timed out (its late answer still on the way) is never used again.
#[derive(Clone, Default)]
pub struct KeptLinks(Arc<Mutex<HashMap<String, Vec<Link>>>>);

/// Links kept per peer: two requests of different loops (a heartbeat and an HA poll) may ask
/// at the same moment.
const KEPT_PER_PEER: usize = 2;

impl std::fmt::Debug for KeptLinks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.0.lock().map(|m| m.len()).unwrap_or(0);
        write!(f, "KeptLinks({n})")
    }
}

impl KeptLinks {
    fn take(&self, peer: &str) -> Option<Link> {
        self.0.lock().ok()?.get_mut(peer)?.pop()
    }

    fn put(&self, peer: &str, link: Link) {
        if let Ok(mut m) = self.0.lock() {
            let v = m.entry(peer.to_owned()).or_default();
            if v.len() < KEPT_PER_PEER {
                v.push(link);
            }
        }
    }

    /// [`Client::call`] on a link kept for `peer` from an earlier request, or a new one
    /// (kept afterwards). A kept link that fails at once was closed under us (the peer
    /// restarted, or dropped it idle): one fresh try tells whether the peer answers. One that
    /// failed by waiting out the client's timeout is the peer's silence: reported as such, not
    /// waited out twice.
    pub fn call<R: Command>(&self, peer: &str, c: &Client, req: &R) -> Result<Value, ControlError> {
        if let Some(mut link) = self.take(peer) {
            let started = Instant::now();
            match c.call_kept(&mut link, req, started) {
                Ok(v) => {
                    self.put(peer, link);
                    return Ok(v);
                }
                Err(e) if started.elapsed() >= c.timeout / 2 => return Err(e),
                Err(_) => {}
            }
        }
        let started = Instant::now();
        let mut link = c.connect()?;
        let v = c.call_kept(&mut link, req, started)?;
        self.put(peer, link);
        Ok(v)
    }

    /// [`KeptLinks::call`] and the strict decoding of the answer's typed part.
    pub fn ask<T: DeserializeOwned, R: Command>(
        &self,
        peer: &str,
        c: &Client,
        req: &R,
    ) -> Result<T, ControlError> {
        let v = self.call(peer, c, req)?;
        c.decode(&v, req)
    }
}

/// Where a replica's control channel is and how to authenticate to it.
#[derive(Clone, Debug)]
pub struct Client {
    ep: Endpoint,
    security: Option<Security>,
    /// The peer's certified name, if the caller knows which replica (or agent) it dials.
    expect_name: Option<String>,
    /// The roles the peer must prove: REPLICA, or AGENT for a host agent.
    expect_roles: u32,
    timeout: Duration,
    /// The sending controller's leadership term, sent with every request (see
    /// [`crate::request::term_of`]); `None` for clients that are not a leading controller.
    term: Option<u64>,
}

impl Client {
    /// A client of the control channel at `ep`; with `security`, the sealed mode (the replica
    /// must prove a REPLICA certificate of the same CA), without, the local mode (unix only).
    pub fn new(ep: Endpoint, security: Option<Security>) -> Client {
        Client {
            ep,
            security,
            expect_name: None,
            expect_roles: role::REPLICA,
            timeout: Duration::from_secs(10),
            term: None,
        }
    }

    /// Sends `term` with every request: the replica refuses requests of a term lower than the
    /// highest it has seen (a deposed controller's).
    pub fn with_term(mut self, term: u64) -> Client {
        self.term = Some(term);
        self
    }

    /// The replica must prove this name in the handshake (sealed mode).
    pub fn expecting(mut self, name: impl Into<String>) -> Client {
        self.expect_name = Some(name.into());
        self
    }

    /// The peer must prove `roles` instead of REPLICA (a host agent: AGENT).
    pub fn expecting_role(mut self, roles: u32) -> Client {
        self.expect_roles = roles;
        self
    }

    /// How long an ordinary request may take (connect + handshake + answer).
    pub fn with_timeout(mut self, t: Duration) -> Client {
        self.timeout = t;
        self
    }

    pub fn endpoint(&self) -> &Endpoint {
        &self.ep
    }

    fn io(&self, reason: impl Into<String>) -> ControlError {
        ControlError::Io {
            ep: self.ep.to_string(),
            reason: reason.into(),
        }
    }

    /// Opens a connection (and runs the handshake in the sealed mode).
    pub fn connect(&self) -> Result<Link, ControlError> {
        let Some(sec) = &self.security else {
            if self.ep.is_tcp() {
                return Err(self.io(
                    "a TCP control endpoint needs an identity (give one with CONTROLLER or \
                     ADMIN role)",
                ));
            }
            let s = pliant_wire::endpoint::connect(&self.ep, self.timeout, &Default::default())
                .map_err(|e| self.io(format!("connect: {e}")))?;
            return Ok(Link::local(s, MAX_ANSWER));
        };
        let expect = Expect {
            name: self.expect_name.clone(),
            roles: self.expect_roles,
        };
        let mut o = sec.options(&self.ep, expect, MAX_ANSWER);
        // The handshake is part of the request's time: a hung replica (its kernel still
        // accepts) must cost a heartbeat its own timeout, not the handshake's default.
        o.handshake_timeout = o.handshake_timeout.min(self.timeout);
        let c = pliant_wire::Conn::connect(&self.ep, &sec.identity, &o, self.timeout, &sec.tcp)
            .map_err(|e| {
                self.io(format!(
                    "{e} (a replica without a [security] identity serves only local clients \
                     without one)"
                ))
            })?;
        Ok(Link::Sealed(Box::new(c)))
    }

    /// Sends `req` and returns the answer if it says `ok` (an answer that does not is
    /// [`ControlError::Refused`]).
    pub fn call<R: Command>(&self, req: &R) -> Result<Value, ControlError> {
        let started = Instant::now();
        let link = self.connect()?;
        self.call_on(link, req, started)
    }

    /// [`Client::call`] on a link [`Client::connect`] opened earlier (at `started`): a caller
    /// whose request is on a critical path — `migrate_out` after the steering switch, while
    /// the destination holds the flow's packets — connects and authenticates before it.
    pub fn call_on<R: Command>(
        &self,
        mut link: Link,
        req: &R,
        started: Instant,
    ) -> Result<Value, ControlError> {
        self.call_kept(&mut link, req, started)
    }

    /// [`Client::call_on`] on a link the caller keeps for later requests (a controller's
    /// heartbeats reuse one authenticated link per replica). After an error the link's
    /// state is unknown: drop it.
    pub fn call_kept<R: Command>(
        &self,
        link: &mut Link,
        req: &R,
        started: Instant,
    ) -> Result<Value, ControlError> {
        let wait = if req.is_slow() {
            SLOW_TIMEOUT
        } else {
            self.timeout
        };
        let left = wait
            .saturating_sub(started.elapsed())
            .max(Duration::from_millis(1));
        link.stream()
            .set_read_timeout(Some(left))
            .and_then(|_| link.stream().set_write_timeout(Some(left)))
            .map_err(|e| self.io(e.to_string()))?;
        let body = crate::request::encode(req, self.term).map_err(|e| self.io(e))?;
        // A server that refuses the connection (at its connection bound, say) answers and
        // closes before it reads the request: the send then fails (broken pipe, reset) while
        // the refusal waits in our receive buffer — read it rather than report the pipe.
        let send_err = match link.send(&body) {
            Ok(()) => None,
            Err(FrameError::Io(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
                ) =>
            {
                Some(e.to_string())
            }
            Err(e) => return Err(self.io(format!("send {}: {e}", req.name()))),
        };
        let local = matches!(link, Link::Local { .. });
        let answer = link.recv().map_err(|e| match &send_err {
            Some(se) => self.io(format!("send {}: i/o: {se}", req.name())),
            None => self.io(format!(
                "no answer to {}: {e}{}",
                req.name(),
                match local {
                    true =>
                        " (a replica with a [security] identity answers only authenticated \
                         clients: give an identity with CONTROLLER or ADMIN role)",
                    _ => "",
                }
            )),
        })?;
        let v: Value = serde_json::from_slice(answer).map_err(|e| ControlError::Malformed {
            ep: self.ep.to_string(),
            cmd: req.name().into(),
            reason: e.to_string(),
        })?;
        if reply::is_ok(&v) {
            Ok(v)
        } else {
            Err(ControlError::Refused {
                ep: self.ep.to_string(),
                cmd: req.name().into(),
                error: reply::error_text(&v),
            })
        }
    }

    /// [`Client::call`] and the strict decoding of the answer's typed part.
    pub fn ask<T: DeserializeOwned, R: Command>(&self, req: &R) -> Result<T, ControlError> {
        let v = self.call(req)?;
        self.decode(&v, req)
    }

    fn decode<T: DeserializeOwned, R: Command>(
        &self,
        v: &Value,
        req: &R,
    ) -> Result<T, ControlError> {
        reply::decode(v).map_err(|reason| ControlError::Malformed {
            ep: self.ep.to_string(),
            cmd: req.name().into(),
            reason,
        })
    }

    pub fn stats(&self) -> Result<reply::Stats, ControlError> {
        self.ask(&Request::Stats)
    }

    pub fn flows(&self) -> Result<reply::FlowList, ControlError> {
        self.ask(&Request::Flows)
    }

    /// The flow holding `key` here (as a primary key or an alias), if any.
    pub fn flow(&self, key: &FlowKey) -> Result<Option<FlowEntry>, ControlError> {
        let l: reply::FlowLookup = self.ask(&Request::Flow { key: *key })?;
        l.entry().map_err(|reason| ControlError::Malformed {
            ep: self.ep.to_string(),
            cmd: "flow".into(),
            reason,
        })
    }

    pub fn ha_status(&self) -> Result<reply::HaStatus, ControlError> {
        self.ask(&Request::HaStatus)
    }

    pub fn ftmb_status(&self) -> Result<reply::FtmbStatus, ControlError> {
        self.ask(&Request::FtmbStatus)
    }

    /// Waits until the replica answers `stats`, returning how long that took.
    pub fn wait_serving(&self, limit: Duration) -> Result<Duration, ControlError> {
        let start = Instant::now();
        let quick = self.clone().with_timeout(Duration::from_millis(500));
        loop {
            match quick.stats() {
                Ok(_) => return Ok(start.elapsed()),
                Err(e) if start.elapsed() >= limit => return Err(e),
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pliant_wire::{role, Ca};

    /// A hung replica's kernel still accepts the connection; the handshake then never answers.
    /// The request must end with the client's own timeout, not the handshake's longer default
    /// (a heartbeat would otherwise take seconds to see a hung replica).
    #[test]
    fn a_replica_that_accepts_but_never_answers_costs_the_clients_timeout() {
        let dir = std::env::temp_dir().join(format!("pliant-proto-hung-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("r1.sock");
        let _ = std::fs::remove_file(&path);
        let l = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let held = std::thread::spawn(move || l.accept().map(|(s, _)| s));
        let ca = Ca::generate(None).unwrap();
        let sec = Security::new(ca.issue("ctl", role::CONTROLLER, 3600).unwrap());
        assert!(sec.handshake_timeout >= Duration::from_secs(3));
        let c =
            Client::new(Endpoint::Unix(path), Some(sec)).with_timeout(Duration::from_millis(100));
        let t = Instant::now();
        let e = c.call(&Request::Stats).unwrap_err();
        assert!(matches!(e, ControlError::Io { .. }), "{e:?}");
        // Far below the handshake's own 3 s default: the client's bound applied.
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        drop(held.join());
        let _ = std::fs::remove_dir_all(dir);
    }

    /// Polls on kept links: one connection (one handshake) for many requests; a link the
    /// peer closed is replaced by one fresh connection within the same call, and the answer
    /// still comes.
    #[test]
    fn kept_links_reuse_one_connection_and_replace_one_the_peer_closed() {
        use std::io::Write;
        use std::sync::atomic::{AtomicU64, Ordering};
        let dir = std::env::temp_dir().join(format!("pliant-proto-kept-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("r1.sock");
        let _ = std::fs::remove_file(&path);
        let l = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let accepted = Arc::new(AtomicU64::new(0));
        let a = accepted.clone();
        // Serves `stats` on each connection; the first connection is closed after 3 answers.
        std::thread::spawn(move || {
            for s in l.incoming() {
                let Ok(mut s) = s else { return };
                let n = a.fetch_add(1, Ordering::SeqCst);
                std::thread::spawn(move || {
                    let mut buf = Vec::new();
                    let mut answered = 0;
                    while pliant_wire::frame::read_frame_into(&mut s, 1 << 16, &mut buf).is_ok() {
                        let mut out = Vec::new();
                        pliant_wire::frame::push_plain(
                            pliant_wire::kinds::CONTROL,
                            br#"{"ok":true}"#,
                            &mut out,
                        );
                        if s.write_all(&out).is_err() {
                            return;
                        }
                        answered += 1;
                        if n == 0 && answered == 3 {
                            return;
                        }
                    }
                });
            }
        });
        let c = Client::new(Endpoint::Unix(path), None).with_timeout(Duration::from_secs(5));
        let kept = KeptLinks::default();
        for _ in 0..3 {
            kept.call("r1", &c, &Request::Stats).unwrap();
        }
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            1,
            "three requests, one connection"
        );
        // The server closed that link: the next call notices at once and dials again.
        let t = Instant::now();
        kept.call("r1", &c, &Request::Stats).unwrap();
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        for _ in 0..5 {
            kept.call("r1", &c, &Request::Stats).unwrap();
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 2, "{kept:?}");
        // Another peer has links of its own.
        let other = KeptLinks::default();
        other.call("r1-again", &c, &Request::Stats).unwrap();
        assert_eq!(accepted.load(Ordering::SeqCst), 3);
        let _ = std::fs::remove_dir_all(dir);
    }

    /// A server at its connection bound answers with a refusal and closes before it reads
    /// the request; the client's send then fails (broken pipe). The client reports the
    /// server's refusal, not the pipe.
    #[test]
    fn a_refusal_sent_before_the_request_was_read_is_reported_as_the_refusal() {
        use std::io::Write;
        let dir = std::env::temp_dir().join(format!("pliant-proto-refused-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("r1.sock");
        let _ = std::fs::remove_file(&path);
        let l = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut out = Vec::new();
            pliant_wire::frame::push_plain(
                pliant_wire::kinds::CONTROL,
                br#"{"ok":false,"error":"too many control connections (64)"}"#,
                &mut out,
            );
            s.write_all(&out).unwrap();
            // Closed without reading anything.
        });
        let c = Client::new(Endpoint::Unix(path), None);
        let link = c.connect().expect("connect");
        server.join().unwrap();
        let e = c
            .call_on(link, &Request::Stats, Instant::now())
            .unwrap_err();
        assert!(
            matches!(&e, ControlError::Refused { error, .. } if error.contains("control connections")),
            "{e:?}"
        );
        let _ = std::fs::remove_dir_all(dir);
    }
}
