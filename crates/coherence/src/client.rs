//! [`HubClient`]: [`Coherence`] and [`LockService`] over one authenticated connection to a
//! [`crate::HubServer`].
//!
//! The client authenticates with the replica's own identity (its certificate's name is the
//! replica it speaks for: the id it uses is [`crate::replica_id_for_name`] of that name) and
//! requires the hub to prove an identity of the same CA holding the service role, so neither a
//! stranger nor another replica listening at the hub's endpoint is taken for the hub.
//!
//! `SharedStore` calls these from the packet thread, so a call is one round trip on an
//! established connection: the request is encoded into a reused buffer, sealed into another
//! and written with one `send(2)`, the answer is read through a reused buffer (usually one
//! `read(2)`); nothing else allocates except the values handed back to the store. Every call is bounded by
//! [`ClientOptions::request_timeout`] per socket operation.
//!
//! Failures: the connection is dropped on any i/o error, timeout or malformed answer (after a
//! timeout a late answer could otherwise be taken for the next request's). The next call
//! reconnects, unless a connection attempt failed less than [`ClientOptions::retry_backoff`]
//! ago: then the call fails at once (a dead hub must not cost the packet thread a connect per
//! packet). A request whose write failed was not delivered and is resent once on a fresh
//! connection; one that was written but got no answer is resent only if it is idempotent
//! ([`Request::idempotent`]). A resent request is sealed again on the new connection (a sealed
//! frame belongs to one session). Everything surfaces as `StateError::Coherence` with the hub
//! endpoint and the cause, except the hub's typed refusals (`Locked`, `LeaseLost`, `SharedLimit`...).

use crate::server::lock;
use crate::wire::{self, Bytes, Request, Response, PROTOCOL_VERSION};
use crate::{replica_id_for_name, HubStats};
use pliant_state::{Coherence, LockService, LockToken, ReplicaId, StateError};
use pliant_wire::endpoint::{euid, Endpoint, Stream};
use pliant_wire::session::{self, Expect, Opener, Sealer, SessionError};
use pliant_wire::{kinds, role, FrameError, Security};
use std::io::{self, BufReader};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

#[derive(Clone, Debug)]
pub struct ClientOptions {
    /// Bound on each socket read or write of a request (the packet thread waits at most about
    /// twice this per call).
    pub request_timeout: Duration,
    /// Bound on each step of connecting: the connect itself, the handshake, `Hello`.
    pub connect_timeout: Duration,
    /// After a failed connection attempt, calls fail at once for this long.
    pub retry_backoff: Duration,
    /// Bound on a frame body in either direction (match the hub's `max_frame_bytes`).
    pub max_frame_bytes: usize,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            request_timeout: Duration::from_millis(50),
            connect_timeout: Duration::from_millis(500),
            retry_backoff: Duration::from_millis(100),
            max_frame_bytes: 1 << 20,
        }
    }
}

/// Client-side counters.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ClientStats {
    pub requests: u64,
    /// Connections established (the first and every reconnect).
    pub connects: u64,
    pub connect_failures: u64,
    /// Calls refused at once because the last connection attempt failed recently.
    pub fast_failures: u64,
    /// Requests sent a second time on a fresh connection.
    pub resends: u64,
    pub timeouts: u64,
    /// I/O errors, closed connections and malformed answers (the connection was dropped).
    pub transport_errors: u64,
    /// Typed refusals from the hub (Locked, LeaseLost, bounds...).
    pub hub_errors: u64,
    /// `fetch_latest` calls answered from the copy that came with the lock grant.
    pub prefetch_hits: u64,
}

#[derive(Default)]
struct Counters {
    requests: AtomicU64,
    connects: AtomicU64,
    connect_failures: AtomicU64,
    fast_failures: AtomicU64,
    resends: AtomicU64,
    timeouts: AtomicU64,
    transport_errors: AtomicU64,
    hub_errors: AtomicU64,
    prefetch_hits: AtomicU64,
}

fn bump(a: &AtomicU64) {
    a.fetch_add(1, Ordering::Relaxed);
}

/// An authenticated connection: the stream and the session's two directions.
struct Conn {
    stream: Stream,
    rd: BufReader<Stream>,
    tx: Sealer,
    rx: Opener,
}

struct Inner {
    conn: Option<Conn>,
    /// No connection attempt before this instant (set after a failed attempt).
    retry_at: Option<Instant>,
    last_error: String,
    /// The encoded body of the request in flight (sealed anew for each attempt).
    wbuf: Vec<u8>,
    /// The sealed frame being sent.
    obuf: Vec<u8>,
    rbuf: Vec<u8>,
    /// The strong copy that came with the last lock grant, for the `fetch_latest` that
    /// follows it (see `Response::Granted`). One-shot, and only while the grant is sure to
    /// hold: after that another replica may have published.
    prefetched: Option<Prefetched>,
}

struct Prefetched {
    key: String,
    valid: bool,
    valid_until: Instant,
    latest: Option<(u64, Vec<u8>)>,
}

/// One replica's connection to the hub. `Send + Sync`; calls are serialised on one
/// connection (a replica has one packet thread).
pub struct HubClient {
    ep: Endpoint,
    hub: String,
    sec: Security,
    replica: ReplicaId,
    name: String,
    opts: ClientOptions,
    inner: Mutex<Inner>,
    c: Counters,
}

/// How one attempt at a request failed.
enum Failure {
    /// Not delivered (connect or write failed): always safe to resend.
    NotSent(StateError),
    /// Written, but no answer arrived: the hub may or may not have applied it.
    NoAnswer(StateError),
}

impl HubClient {
    /// A client of the hub at `hub` for the replica `sec` certifies: its id is
    /// [`replica_id_for_name`] of the certificate's name, and the hub uses the name to detect
    /// two replicas sharing an id. Does not connect: the first call does (see
    /// [`HubClient::connect_now`]).
    pub fn new(hub: &Endpoint, sec: Security, opts: ClientOptions) -> HubClient {
        let name = sec.name().to_string();
        HubClient {
            ep: hub.clone(),
            hub: hub.to_string(),
            replica: replica_id_for_name(&name),
            name,
            sec,
            opts,
            inner: Mutex::new(Inner {
                conn: None,
                retry_at: None,
                last_error: String::new(),
                wbuf: Vec::with_capacity(256),
                obuf: Vec::with_capacity(256),
                rbuf: Vec::with_capacity(256),
                prefetched: None,
            }),
            c: Counters::default(),
        }
    }

    /// The replica id this client speaks for.
    pub fn replica(&self) -> ReplicaId {
        self.replica
    }

    /// The certified replica name this client speaks for.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Connects now (ignoring the retry backoff) so configuration errors (identity refused, no
    /// hub) show at start-up rather than at the first shared-state call.
    pub fn connect_now(&self) -> Result<(), StateError> {
        let mut g = lock(&self.inner);
        g.retry_at = None;
        if g.conn.is_none() {
            self.connect(&mut g, "")?;
        }
        Ok(())
    }

    /// Whether a connection is open now.
    pub fn connected(&self) -> bool {
        lock(&self.inner).conn.is_some()
    }

    pub fn stats(&self) -> ClientStats {
        let c = &self.c;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ClientStats {
            requests: l(&c.requests),
            connects: l(&c.connects),
            connect_failures: l(&c.connect_failures),
            fast_failures: l(&c.fast_failures),
            resends: l(&c.resends),
            timeouts: l(&c.timeouts),
            transport_errors: l(&c.transport_errors),
            hub_errors: l(&c.hub_errors),
            prefetch_hits: l(&c.prefetch_hits),
        }
    }

    /// The hub's counters.
    pub fn hub_stats(&self) -> Result<HubStats, StateError> {
        match self.call(&Request::Stats)? {
            Response::Stats(s) => Ok(s),
            other => Err(self.unexpected("", &other)),
        }
    }

    fn forget_prefetched(&self) {
        if let Some(p) = lock(&self.inner).prefetched.as_mut() {
            p.valid = false;
            p.latest = None;
        }
    }

    fn err(&self, key: &str, reason: String) -> StateError {
        StateError::Coherence {
            key: key.to_string(),
            reason: format!("hub {}: {reason}", self.hub),
        }
    }

    fn unexpected(&self, key: &str, r: &Response) -> StateError {
        bump(&self.c.transport_errors);
        self.err(key, format!("unexpected answer {r:?}"))
    }

    /// Sends `req` and returns the hub's answer; hub refusals become their `StateError`.
    fn call(&self, req: &Request<'_>) -> Result<Response, StateError> {
        bump(&self.c.requests);
        let key = req.key();
        let mut g = lock(&self.inner);
        let inner = &mut *g;
        if let Err(e) = wire::encode_body(req, &mut inner.wbuf, self.opts.max_frame_bytes) {
            return Err(match e {
                FrameError::TooLarge { len, max } => StateError::SharedLimit {
                    key: key.to_string(),
                    what: "hub request bytes",
                    max: max.min(len),
                },
                other => self.err(key, other.to_string()),
            });
        }
        let first = self.attempt(inner, key);
        let resend = match &first {
            Ok(_) => false,
            Err(Failure::NotSent(_)) => true,
            Err(Failure::NoAnswer(_)) => req.idempotent(),
        };
        let result = if resend && inner.retry_at.is_none() {
            bump(&self.c.resends);
            self.attempt(inner, key)
        } else {
            first
        };
        let resp = result.map_err(|f| match f {
            Failure::NotSent(e) | Failure::NoAnswer(e) => e,
        })?;
        match resp {
            Response::Error { key: k, error } => {
                bump(&self.c.hub_errors);
                let k = if k.is_empty() { key.to_string() } else { k };
                Err(error.into_state(k, &self.hub))
            }
            r => Ok(r),
        }
    }

    /// One try: connect if needed, seal and write the encoded request, read one answer.
    fn attempt(&self, inner: &mut Inner, key: &str) -> Result<Response, Failure> {
        if inner.conn.is_none() {
            if let Some(at) = inner.retry_at {
                if Instant::now() < at {
                    bump(&self.c.fast_failures);
                    let reason = format!(
                        "unreachable (last error: {}); next attempt in {} ms",
                        inner.last_error,
                        at.saturating_duration_since(Instant::now()).as_millis()
                    );
                    return Err(Failure::NotSent(self.err(key, reason)));
                }
            }
            self.connect(inner, key).map_err(Failure::NotSent)?;
        }
        let Some(conn) = inner.conn.as_mut() else {
            return Err(Failure::NotSent(self.err(key, "not connected".into())));
        };
        inner.obuf.clear();
        if let Err(e) = conn.tx.seal_bytes(kinds::HUB, &inner.wbuf, &mut inner.obuf) {
            inner.conn = None;
            bump(&self.c.transport_errors);
            return Err(Failure::NotSent(self.err(key, format!("seal: {e}"))));
        }
        if let Err(e) = conn.stream.send_all(&inner.obuf) {
            inner.conn = None;
            let e = self.io_failure(key, "send", e);
            return Err(Failure::NotSent(e));
        }
        match wire::read_frame(&mut conn.rx, &mut conn.rd, &mut inner.rbuf) {
            Ok(body) => match wire::decode::<Response>(&inner.rbuf[body]) {
                Ok(r) => Ok(r),
                Err(reason) => {
                    inner.conn = None;
                    bump(&self.c.transport_errors);
                    Err(Failure::NoAnswer(
                        self.err(key, format!("malformed answer: {reason}")),
                    ))
                }
            },
            Err(FrameError::Closed) => {
                inner.conn = None;
                bump(&self.c.transport_errors);
                Err(Failure::NoAnswer(self.err(
                    key,
                    "connection closed by the hub before it answered".into(),
                )))
            }
            Err(FrameError::Io(e)) => {
                inner.conn = None;
                Err(Failure::NoAnswer(self.io_failure(key, "receive", e)))
            }
            Err(e) => {
                inner.conn = None;
                bump(&self.c.transport_errors);
                Err(Failure::NoAnswer(self.err(key, format!("answer: {e}"))))
            }
        }
    }

    fn io_failure(&self, key: &str, what: &str, e: io::Error) -> StateError {
        if matches!(
            e.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
        ) {
            bump(&self.c.timeouts);
            self.err(
                key,
                format!(
                    "{what} timed out after {} ms",
                    self.opts.request_timeout.as_millis()
                ),
            )
        } else {
            bump(&self.c.transport_errors);
            self.err(key, format!("{what}: {e}"))
        }
    }

    /// Opens, authenticates and registers a connection; on failure arms the retry backoff.
    fn connect(&self, inner: &mut Inner, key: &str) -> Result<(), StateError> {
        match self.open() {
            Ok(conn) => {
                bump(&self.c.connects);
                inner.conn = Some(conn);
                inner.retry_at = None;
                Ok(())
            }
            Err(reason) => {
                bump(&self.c.connect_failures);
                tracing::warn!(hub = %self.hub, %reason, "coherence hub connection failed");
                inner.retry_at = Some(Instant::now() + self.opts.retry_backoff);
                inner.last_error = reason.clone();
                Err(self.err(key, reason))
            }
        }
    }

    fn open(&self) -> Result<Conn, String> {
        let t = self.opts.connect_timeout;
        let stream = pliant_wire::endpoint::connect(&self.ep, t, &self.sec.tcp)
            .map_err(|e| format!("cannot connect: {e}"))?;
        // On a unix socket the hub must also run as our uid (a second fence behind its
        // certificate).
        match stream.peer_uid() {
            None => {}
            Some(Ok(uid)) if uid == euid() => {}
            Some(Ok(uid)) => return Err(format!("hub runs as uid {uid}, not ours ({})", euid())),
            Some(Err(e)) => return Err(format!("cannot read the hub's credentials: {e}")),
        }
        let expect = Expect {
            name: None,
            roles: role::SERVICE,
        };
        let mut o = self
            .sec
            .options(&self.ep, expect, self.opts.max_frame_bytes);
        o.handshake_timeout = t;
        let sess = session::client(&stream, &self.sec.identity, &o).map_err(|e| {
            // A hub refusing our certificate says why (`Refused`); a bare close or reset is a
            // hub at its connection bound (it closes before reading our hello) or no hub.
            let closed = match &e {
                SessionError::Frame(FrameError::Closed) => true,
                SessionError::Frame(FrameError::Io(io)) => matches!(
                    io.kind(),
                    io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe
                ),
                _ => false,
            };
            if closed {
                format!(
                    "handshake: the hub closed the connection ({e}: it is at its connection \
                     bound, or not a pliant hub)"
                )
            } else {
                format!("handshake: {e}")
            }
        })?;
        stream
            .set_read_timeout(Some(t))
            .and_then(|()| stream.set_write_timeout(Some(t)))
            .map_err(|e| format!("socket options: {e}"))?;
        let rd = stream
            .try_clone()
            .map_err(|e| format!("socket clone: {e}"))?;
        let mut conn = Conn {
            stream,
            rd: BufReader::with_capacity(16 << 10, rd),
            tx: sess.tx,
            rx: sess.rx,
        };
        let hello = Request::Hello {
            version: PROTOCOL_VERSION,
            replica: self.replica,
            name: &self.name,
        };
        let mut body = Vec::new();
        wire::encode_body(&hello, &mut body, self.opts.max_frame_bytes)
            .map_err(|e| format!("Hello: {e}"))?;
        let mut buf = Vec::new();
        conn.tx
            .seal_bytes(kinds::HUB, &body, &mut buf)
            .map_err(|e| format!("Hello: {e}"))?;
        conn.stream
            .send_all(&buf)
            .map_err(|e| format!("send Hello: {e}"))?;
        let welcome = match wire::read_frame(&mut conn.rx, &mut conn.rd, &mut buf) {
            Ok(body) => body,
            Err(FrameError::Closed) => {
                return Err("the hub closed the connection after the handshake".into())
            }
            Err(e) => return Err(format!("Welcome: {e}")),
        };
        match wire::decode::<Response>(&buf[welcome]) {
            Ok(Response::Welcome { version }) if version == PROTOCOL_VERSION => {}
            Ok(Response::Welcome { version }) => {
                return Err(format!(
                    "hub speaks protocol {version}, this build {PROTOCOL_VERSION}"
                ))
            }
            Ok(Response::Error { error, .. }) => return Err(format!("hub refused: {error}")),
            Ok(other) => return Err(format!("unexpected answer to Hello: {other:?}")),
            Err(e) => return Err(format!("malformed Welcome: {e}")),
        }
        let t = Some(self.opts.request_timeout);
        conn.stream
            .set_read_timeout(t)
            .and_then(|()| conn.stream.set_write_timeout(t))
            .map_err(|e| format!("socket options: {e}"))?;
        Ok(conn)
    }
}

impl Coherence for HubClient {
    fn publish(&self, key: &str, replica: ReplicaId, value: &[u8]) -> Result<(), StateError> {
        match self.call(&Request::Publish {
            key,
            replica,
            value: Bytes(value),
        })? {
            Response::Done => Ok(()),
            other => Err(self.unexpected(key, &other)),
        }
    }

    fn fetch_others(
        &self,
        key: &str,
        replica: ReplicaId,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<(), StateError> {
        match self.call(&Request::FetchOthers { key, replica })? {
            Response::Others(v) => {
                out.extend(v.into_iter().map(|b| b.0));
                Ok(())
            }
            other => Err(self.unexpected(key, &other)),
        }
    }

    fn withdraw(&self, key: &str, replica: ReplicaId) -> Result<(), StateError> {
        match self.call(&Request::Withdraw { key, replica })? {
            Response::Done => Ok(()),
            other => Err(self.unexpected(key, &other)),
        }
    }

    fn fetch_latest(&self, key: &str) -> Result<Option<(u64, Vec<u8>)>, StateError> {
        if let Some(p) = lock(&self.inner).prefetched.as_mut() {
            let fresh = p.valid && p.key == key && Instant::now() < p.valid_until;
            p.valid = false;
            if fresh {
                bump(&self.c.prefetch_hits);
                return Ok(p.latest.take());
            }
        }
        match self.call(&Request::FetchLatest { key })? {
            Response::Latest(l) => Ok(l.map(|(v, b)| (v, b.0))),
            other => Err(self.unexpected(key, &other)),
        }
    }

    fn publish_latest(
        &self,
        key: &str,
        token: &LockToken,
        value: &[u8],
    ) -> Result<u64, StateError> {
        self.forget_prefetched();
        match self.call(&Request::PublishLatest {
            key,
            holder: token.holder,
            fence: token.fence,
            value: Bytes(value),
        })? {
            Response::Version(v) => Ok(v),
            other => Err(self.unexpected(key, &other)),
        }
    }
}

impl LockService for HubClient {
    /// The hub's clock runs the lease; `expires` in the returned token is this process's
    /// estimate, `now + granted lease`. `now` (the store's batch time) is at or before the
    /// moment the request left, so the estimate ends no later than the hub's lease: a holder
    /// that respects it never writes after the hub gave the lock away.
    fn lock(
        &self,
        key: &str,
        holder: ReplicaId,
        lease: Duration,
        now: Instant,
    ) -> Result<LockToken, StateError> {
        let lease_us = u64::try_from(lease.as_micros()).unwrap_or(u64::MAX);
        // Taken before the request leaves: the hub's lease starts later, so a deadline
        // counted from here ends no later than the hub's.
        let sent = Instant::now();
        match self.call(&Request::Lock {
            key,
            holder,
            lease_us,
        })? {
            Response::Granted {
                fence,
                lease_us,
                latest,
            } => {
                let granted = Duration::from_micros(lease_us);
                let mut g = lock(&self.inner);
                // Reuse the previous entry's key buffer: no allocation per SYNCH once warm.
                let mut k = g.prefetched.take().map(|p| p.key).unwrap_or_default();
                k.clear();
                k.push_str(key);
                g.prefetched = Some(Prefetched {
                    key: k,
                    valid: true,
                    valid_until: sent.checked_add(granted).unwrap_or(sent),
                    latest: latest.map(|(v, b)| (v, b.0)),
                });
                Ok(LockToken {
                    holder,
                    fence,
                    expires: now.checked_add(granted).unwrap_or(now),
                })
            }
            other => Err(self.unexpected(key, &other)),
        }
    }

    fn unlock(&self, key: &str, token: &LockToken) -> Result<(), StateError> {
        // Once released, others may publish: the copy from the grant is no longer the newest.
        self.forget_prefetched();
        match self.call(&Request::Unlock {
            key,
            holder: token.holder,
            fence: token.fence,
        })? {
            Response::Done => Ok(()),
            other => Err(self.unexpected(key, &other)),
        }
    }
}
