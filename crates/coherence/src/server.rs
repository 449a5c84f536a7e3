//! The hub: one process (or thread) every replica's [`crate::HubClient`] talks to.
//!
//! It keeps, in memory, per combiner key the last published contribution of each replica, per
//! strong key the newest `(version, bytes)` and its lease lock. That bookkeeping is exactly
//! [`LocalCoherence`] (the in-process hub of `pliant-state`); this server wraps one and adds
//! the socket, authentication, framing, bounds and counters, so both transports share one
//! implementation of the semantics.
//!
//! Any pliant-wire endpoint: a unix socket (mode 0600, and the peer's uid must be the hub's,
//! SO_PEERCRED) or TCP between hosts. Per connection: the mutual handshake of
//! [`pliant_wire::session`] (the hub proves its own identity; the client must prove a
//! CA-signed identity with the replica role), `Hello` (protocol version, replica id and name,
//! both of which must be the certified replica's: a replica publishes, locks and fences only
//! as itself), then one [`Response`] per [`Request`], every frame sealed with kind
//! [`pliant_wire::kinds::HUB`]. One thread per connection, at most
//! [`HubConfig::max_connections`].
//!
//! Versions and fences on the wire are offset by the hub's start time in nanoseconds
//! (`base`). A restarted hub therefore hands out versions and fences larger than any the
//! previous instance did: a store keeps accepting the new hub's copies (it takes a copy only
//! if its version is newer), and a token from before the restart can never match a grant of
//! the new hub (fencing survives a hub restart).

use crate::wire::{self, Blob, Request, Response, WireError, MAX_NAME_BYTES, PROTOCOL_VERSION};
use crate::{replica_id_for_name, CoherenceError};
use pliant_state::{Coherence, LocalCoherence, LockService, LockToken, ReplicaId};
use pliant_wire::endpoint::{euid, Endpoint, Listener, Stream};
use pliant_wire::server::{self as wire_server, ConnThreads, ServerSocket, SpawnRefused};
use pliant_wire::session::{self, Expect, Opener, Sealer, SessionError};
use pliant_wire::{kinds, role, FrameError, Security};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::io::BufReader;
use std::ops::Range;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

#[derive(Clone, Debug)]
pub struct HubConfig {
    /// Bounds of the state the hub keeps (keys, replicas per key, value bytes).
    pub limits: pliant_state::HubConfig,
    /// Bound on open connections (each has a thread); more are closed at once and counted.
    pub max_connections: usize,
    /// Bound on distinct replica ids registered by `Hello`.
    pub max_replicas: usize,
    /// Bound on a frame body, both directions (a `FetchOthers` answer over it is refused with
    /// a `hub response bytes` limit error).
    pub max_frame_bytes: usize,
    /// Longest lease granted; longer requests are capped (a client cannot pin a lock forever).
    pub max_lease: Duration,
    /// Time a new connection gets for the handshake, and then again for `Hello`.
    pub handshake_timeout: Duration,
    /// A connection that sends nothing for this long is closed (frees its thread).
    pub idle_timeout: Duration,
}

impl Default for HubConfig {
    fn default() -> Self {
        HubConfig {
            limits: pliant_state::HubConfig {
                max_keys: 4096,
                max_replicas_per_key: 256,
                // The default SharedConfig bound: a store never publishes more than this.
                max_value_bytes: 64 * 1024,
            },
            max_connections: 64,
            max_replicas: 1024,
            max_frame_bytes: 1 << 20,
            max_lease: Duration::from_secs(60),
            handshake_timeout: Duration::from_secs(2),
            idle_timeout: Duration::from_secs(300),
        }
    }
}

/// The hub's counters (also served to clients by `Request::Stats`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HubStats {
    pub connections: u64,
    /// Connections open now.
    pub active: u64,
    /// Handshakes refused: a certificate not signed by this deployment's CA (or expired), a
    /// signature that does not verify, or a peer without the replica role.
    pub auth_failures: u64,
    /// Peers that closed, stalled or sent garbage during the handshake.
    pub handshake_aborted: u64,
    /// `Hello`s naming another replica (name or id) than the client's certificate.
    pub identity_mismatch: u64,
    /// Frames that failed authentication (tampered, injected from another connection,
    /// replayed, reordered) or were of another channel's kind: the connection is closed.
    pub bad_frames: u64,
    /// Peers refused by the SO_PEERCRED uid check.
    pub peer_refused: u64,
    /// Connections closed at once because `max_connections` were open.
    pub over_bound: u64,
    /// Requests received (well-formed or not).
    pub frames: u64,
    pub bytes_in: u64,
    pub bytes_out: u64,
    /// Frames whose body did not decode (the connection is closed after the answer).
    pub decode_errors: u64,
    /// Frames whose length was over `max_frame_bytes` (the connection is closed).
    pub oversize_frames: u64,
    /// Well-formed requests that broke the protocol (no Hello, wrong replica id...).
    pub protocol_errors: u64,
    /// Requests answered with an error of the store (bounds, not found...), including the two
    /// below.
    pub refused: u64,
    pub lock_grants: u64,
    /// Lock requests refused because another grant's lease runs.
    pub lock_refused: u64,
    /// Publishes or unlocks refused because the token's grant was replaced (fencing).
    pub lease_lost: u64,
    /// Replica ids registered.
    pub replicas: u64,
    /// `Hello`s refused because another name holds the id (or the registry is full).
    pub id_refused: u64,
}

#[derive(Default)]
struct Counters {
    connections: AtomicU64,
    active: AtomicU64,
    auth_failures: AtomicU64,
    handshake_aborted: AtomicU64,
    identity_mismatch: AtomicU64,
    bad_frames: AtomicU64,
    peer_refused: AtomicU64,
    over_bound: AtomicU64,
    frames: AtomicU64,
    bytes_in: AtomicU64,
    bytes_out: AtomicU64,
    decode_errors: AtomicU64,
    oversize_frames: AtomicU64,
    protocol_errors: AtomicU64,
    refused: AtomicU64,
    lock_grants: AtomicU64,
    lock_refused: AtomicU64,
    lease_lost: AtomicU64,
    id_refused: AtomicU64,
}

fn bump(a: &AtomicU64) {
    a.fetch_add(1, Ordering::Relaxed);
}

struct Shared {
    sec: Security,
    cfg: HubConfig,
    store: LocalCoherence,
    /// Offset of every version and fence on the wire (see the module doc).
    base: u64,
    /// Replica id -> name registered by `Hello` (detects two names hashing to one id).
    replicas: Mutex<HashMap<ReplicaId, String>>,
    stop: AtomicBool,
    c: Counters,
    conns: ConnThreads,
    /// Microseconds the lease clock runs ahead of the monotonic clock ([`HubServer::advance_clock`]).
    clock_ahead_us: AtomicU64,
}

impl Shared {
    /// The clock leases run on.
    fn now(&self) -> Instant {
        let ahead = Duration::from_micros(self.clock_ahead_us.load(Ordering::Relaxed));
        let now = Instant::now();
        now.checked_add(ahead).unwrap_or(now)
    }

    fn stats(&self) -> HubStats {
        let c = &self.c;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        HubStats {
            connections: l(&c.connections),
            active: l(&c.active),
            auth_failures: l(&c.auth_failures),
            handshake_aborted: l(&c.handshake_aborted),
            identity_mismatch: l(&c.identity_mismatch),
            bad_frames: l(&c.bad_frames),
            peer_refused: l(&c.peer_refused),
            over_bound: l(&c.over_bound),
            frames: l(&c.frames),
            bytes_in: l(&c.bytes_in),
            bytes_out: l(&c.bytes_out),
            decode_errors: l(&c.decode_errors),
            oversize_frames: l(&c.oversize_frames),
            protocol_errors: l(&c.protocol_errors),
            refused: l(&c.refused),
            lock_grants: l(&c.lock_grants),
            lock_refused: l(&c.lock_refused),
            lease_lost: l(&c.lease_lost),
            replicas: lock(&self.replicas).len() as u64,
            id_refused: l(&c.id_refused),
        }
    }
}

/// A running hub. Drop stops accepting, closes every connection, joins the threads and
/// unlinks a unix socket (if it is still the one this hub bound).
pub struct HubServer {
    socket: ServerSocket,
    shared: Arc<Shared>,
}

impl HubServer {
    /// Listens at `ep` (a unix socket is mode 0600; a stale socket file left by a dead process
    /// is replaced; a live hub's socket or port is `Bind(InUse)`) and serves authenticated
    /// replicas until dropped. `sec` is the hub's own identity, which must hold the service
    /// role: replicas refuse to talk to anything else (a replica identity listening where the
    /// hub should be is not the hub).
    pub fn start(
        ep: &Endpoint,
        sec: Security,
        cfg: HubConfig,
    ) -> Result<HubServer, CoherenceError> {
        if sec.identity.cert.roles & role::SERVICE == 0 {
            return Err(CoherenceError::NotAService {
                name: sec.name().to_string(),
            });
        }
        let base = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX / 2));
        let shared = Arc::new(Shared {
            sec,
            store: LocalCoherence::new(cfg.limits.clone()),
            cfg,
            base,
            replicas: Mutex::new(HashMap::new()),
            stop: AtomicBool::new(false),
            c: Counters::default(),
            conns: ConnThreads::default(),
            clock_ahead_us: AtomicU64::new(0),
        });
        let sh = shared.clone();
        let tcp = shared.sec.tcp;
        let socket = ServerSocket::start(ep, &tcp, "coherence-accept", move |l, stop| {
            accept_loop(l, stop, sh)
        })
        .map_err(|e| match e {
            wire_server::StartError::Bind(b) => CoherenceError::Bind(b),
            wire_server::StartError::Io(source) => CoherenceError::Io {
                ep: ep.clone(),
                source,
            },
            wire_server::StartError::Spawn(e) => CoherenceError::Spawn(e),
        })?;
        tracing::info!(endpoint = %socket.endpoint(), "coherence hub listening");
        Ok(HubServer { socket, shared })
    }

    /// Where the hub listens (a TCP port 0 resolved).
    pub fn endpoint(&self) -> &Endpoint {
        self.socket.endpoint()
    }

    pub fn stats(&self) -> HubStats {
        self.shared.stats()
    }

    /// The hub's state, for queries and tests (contributions, newest strong copies).
    pub fn store(&self) -> &LocalCoherence {
        &self.shared.store
    }

    /// Moves the hub's lease clock forward by `by`: every lease granted so far runs out that
    /// much sooner. Tests of lease expiry use it instead of sleeping past a short lease, which
    /// a stalled test thread could also outlast before it looked.
    pub fn advance_clock(&self, by: Duration) {
        let us = u64::try_from(by.as_micros()).unwrap_or(u64::MAX);
        let _ =
            self.shared
                .clock_ahead_us
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                    Some(v.saturating_add(us))
                });
    }

    /// Wire version of a strong copy whose in-hub version is `v` (tests and tools).
    pub fn wire_version(&self, v: u64) -> u64 {
        self.shared.base.saturating_add(v)
    }
}

impl Drop for HubServer {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.socket.stop_accepting();
        self.shared.conns.shutdown_and_join();
    }
}

fn accept_loop(listener: Listener, stop_r: UnixStream, sh: Arc<Shared>) {
    wire_server::accept_until_stopped(&listener, &stop_r, &sh.stop, "coherence hub", |stream| {
        bump(&sh.c.connections);
        let s2 = sh.clone();
        let max = sh.cfg.max_connections;
        let spawned = sh
            .conns
            .spawn(stream, max, "coherence-conn", move |stream| {
                s2.c.active.fetch_add(1, Ordering::Relaxed);
                serve_conn(stream, &s2);
                s2.c.active.fetch_sub(1, Ordering::Relaxed);
            });
        match spawned {
            Ok(()) => {}
            Err(SpawnRefused::OverBound(_closed_after_counting)) => {
                bump(&sh.c.over_bound);
                tracing::warn!(max, "coherence hub connection refused: too many open");
            }
            Err(e) => tracing::warn!(error = ?e, "coherence hub connection dropped"),
        }
        std::ops::ControlFlow::Continue(())
    });
}

/// The reading half of a connection: the session's opener and a reused frame buffer.
struct ConnReader {
    rd: BufReader<Stream>,
    rx: Opener,
    buf: Vec<u8>,
}

impl ConnReader {
    /// Reads and opens one request; the range of its body in `buf`. `None` when the
    /// connection should end (EOF, error, bound, a frame that fails authentication).
    fn read(&mut self, sh: &Shared) -> Option<Range<usize>> {
        match wire::read_frame(&mut self.rx, &mut self.rd, &mut self.buf) {
            Ok(body) => {
                bump(&sh.c.frames);
                sh.c.bytes_in
                    .fetch_add(self.buf.len() as u64, Ordering::Relaxed);
                Some(body)
            }
            Err(FrameError::TooLarge { len, max }) => {
                bump(&sh.c.oversize_frames);
                tracing::warn!(len, max, "coherence hub: oversize frame, closing");
                None
            }
            Err(e @ (FrameError::Closed | FrameError::Io(_))) => {
                tracing::debug!(error = %e, "coherence hub connection ended");
                None
            }
            Err(e) => {
                // Not from this session's peer (or not meant for this channel): nothing after
                // it on this stream can be trusted either.
                bump(&sh.c.bad_frames);
                tracing::warn!(error = %e, "coherence hub: frame refused, closing");
                None
            }
        }
    }
}

/// The writing half: the session's sealer and reused encoding buffers.
struct ConnWriter<'s> {
    stream: &'s Stream,
    tx: Sealer,
    body: Vec<u8>,
    out: Vec<u8>,
}

impl ConnWriter<'_> {
    /// Seals and sends one answer; `false` when the connection should end.
    fn send(&mut self, sh: &Shared, key: &str, r: &Response) -> bool {
        let max = sh.cfg.max_frame_bytes;
        if let Err(e) = wire::encode_body(r, &mut self.body, max) {
            // The only answers that can grow large are FetchOthers / FetchLatest copies.
            bump(&sh.c.refused);
            let error = match e {
                FrameError::TooLarge { .. } => WireError::Limit {
                    what: "hub response bytes".into(),
                    max: max as u64,
                },
                other => WireError::Refused(other.to_string()),
            };
            let err = Response::Error {
                key: key.to_string(),
                error,
            };
            if wire::encode_body(&err, &mut self.body, max).is_err() {
                return false;
            }
        }
        self.out.clear();
        if self
            .tx
            .seal_bytes(kinds::HUB, &self.body, &mut self.out)
            .is_err()
        {
            return false;
        }
        sh.c.bytes_out
            .fetch_add(self.out.len() as u64, Ordering::Relaxed);
        self.stream.send_all(&self.out).is_ok()
    }
}

/// Counts a failed handshake where it belongs: a peer that could not prove a replica identity
/// of this deployment (auth) or one that went away, stalled or sent garbage (aborted).
fn count_handshake_failure(c: &Counters, e: &SessionError) {
    if e.is_refusal() {
        bump(&c.auth_failures);
        tracing::warn!(error = %e, "coherence hub handshake refused");
    } else {
        bump(&c.handshake_aborted);
        tracing::debug!(error = %e, "coherence hub handshake aborted");
    }
}

fn serve_conn(stream: Stream, sh: &Shared) {
    let c = &sh.c;
    // On a unix socket the kernel also vouches for the peer's uid: kept as a second fence.
    match stream.peer_uid() {
        None => {}
        Some(Ok(uid)) if uid == euid() => {}
        Some(r) => {
            bump(&c.peer_refused);
            tracing::warn!(uid = ?r.ok(), "coherence hub peer refused: other uid");
            return;
        }
    }
    let expect = Expect {
        name: None,
        roles: role::REPLICA,
    };
    let mut o = sh
        .sec
        .options_for(!stream.is_unix(), expect, sh.cfg.max_frame_bytes);
    o.handshake_timeout = sh.cfg.handshake_timeout;
    let sess = match session::server(&stream, &sh.sec.identity, &o) {
        Ok(s) => s,
        Err(e) => return count_handshake_failure(c, &e),
    };
    // Hello must come within the handshake timeout; a peer that stops reading its answers
    // cannot hold the thread for longer than that per answer either.
    let t = Some(sh.cfg.handshake_timeout);
    if stream.set_read_timeout(t).is_err() || stream.set_write_timeout(t).is_err() {
        return;
    }
    let Ok(clone) = stream.try_clone() else {
        return;
    };
    let mut rd = ConnReader {
        // Small requests arrive whole in one read(2).
        rd: BufReader::with_capacity(16 << 10, clone),
        rx: sess.rx,
        buf: Vec::new(),
    };
    let mut wr = ConnWriter {
        stream: &stream,
        tx: sess.tx,
        body: Vec::new(),
        out: Vec::new(),
    };
    let Some(me) = hello(&mut rd, &mut wr, sh, &sess.peer.name) else {
        return;
    };
    if stream.set_read_timeout(Some(sh.cfg.idle_timeout)).is_err() {
        return;
    }
    while let Some(body) = rd.read(sh) {
        let (key, answer) = match wire::decode::<Request<'_>>(&rd.buf[body]) {
            Ok(req) => (req.key().to_string(), handle(sh, me, req)),
            Err(reason) => {
                bump(&c.decode_errors);
                let r = Response::Error {
                    key: String::new(),
                    error: WireError::Protocol(format!("malformed request: {reason}")),
                };
                // Answer so the client learns why, then close: a peer that sends garbage
                // once is not trusted to frame the next request correctly.
                let _ = wr.send(sh, "", &r);
                return;
            }
        };
        if !wr.send(sh, &key, &answer) {
            return;
        }
    }
}

/// Reads and answers the connection's `Hello`; the registered replica id on success.
/// `certified` is the name the client's certificate carries.
fn hello(
    rd: &mut ConnReader,
    conn: &mut ConnWriter<'_>,
    sh: &Shared,
    certified: &str,
) -> Option<ReplicaId> {
    let body = rd.read(sh)?;
    let refuse = |conn: &mut ConnWriter<'_>, reason: String| {
        bump(&sh.c.protocol_errors);
        tracing::warn!(%reason, "coherence hub refused a client");
        let _ = conn.send(
            sh,
            "",
            &Response::Error {
                key: String::new(),
                error: WireError::Protocol(reason),
            },
        );
        None
    };
    let (replica, name) = match wire::decode::<Request<'_>>(&rd.buf[body]) {
        Ok(Request::Hello {
            version,
            replica,
            name,
        }) => {
            if version != PROTOCOL_VERSION {
                return refuse(
                    conn,
                    format!("protocol version {version}, this hub speaks {PROTOCOL_VERSION}"),
                );
            }
            if name.len() > MAX_NAME_BYTES {
                return refuse(
                    conn,
                    format!(
                        "replica name of {} bytes (max {MAX_NAME_BYTES})",
                        name.len()
                    ),
                );
            }
            // Contributions, locks and fences are filed under the Hello's id: a replica acts
            // only as itself, whatever else its certificate lets it do.
            if name != certified || replica != replica_id_for_name(certified) {
                bump(&sh.c.identity_mismatch);
                return refuse(
                    conn,
                    format!(
                        "hello names replica {name:?} (id {replica}) but the certificate is \
                         {certified:?} (id {})",
                        replica_id_for_name(certified)
                    ),
                );
            }
            (replica, name.to_string())
        }
        Ok(_) => return refuse(conn, "the first request must be Hello".into()),
        Err(reason) => {
            bump(&sh.c.decode_errors);
            return refuse(conn, format!("malformed Hello: {reason}"));
        }
    };
    {
        let mut reg = lock(&sh.replicas);
        match reg.get(&replica) {
            Some(n) if *n == name => {}
            Some(n) => {
                let reason = format!(
                    "replica id {replica} is registered to {n:?}; {name:?} maps to the same id \
                     (rename one of them)"
                );
                drop(reg);
                bump(&sh.c.id_refused);
                return refuse(conn, reason);
            }
            None if reg.len() >= sh.cfg.max_replicas => {
                drop(reg);
                bump(&sh.c.id_refused);
                bump(&sh.c.refused);
                let _ = conn.send(
                    sh,
                    "",
                    &Response::Error {
                        key: String::new(),
                        error: WireError::Limit {
                            what: "hub replicas".into(),
                            max: sh.cfg.max_replicas as u64,
                        },
                    },
                );
                return None;
            }
            None => {
                reg.insert(replica, name);
            }
        }
    }
    if !conn.send(
        sh,
        "",
        &Response::Welcome {
            version: PROTOCOL_VERSION,
        },
    ) {
        return None;
    }
    Some(replica)
}

/// Answers one request of the connection registered as replica `me`.
fn handle(sh: &Shared, me: ReplicaId, req: Request<'_>) -> Response {
    let key = req.key().to_string();
    let own = |r: ReplicaId| -> Result<(), WireError> {
        if r == me {
            Ok(())
        } else {
            Err(WireError::Protocol(format!(
                "this connection speaks for replica {me}, not {r}"
            )))
        }
    };
    let st = &sh.store;
    let result: Result<Response, WireError> = (|| match req {
        Request::Hello { .. } => Err(WireError::Protocol("Hello sent twice".into())),
        Request::Stats => Ok(Response::Stats(sh.stats())),
        Request::Publish {
            key,
            replica,
            value,
        } => {
            own(replica)?;
            st.publish(key, replica, value.0).map_err(state)?;
            Ok(Response::Done)
        }
        Request::FetchOthers { key, replica } => {
            own(replica)?;
            let mut others = Vec::new();
            st.fetch_others(key, replica, &mut others).map_err(state)?;
            Ok(Response::Others(others.into_iter().map(Blob).collect()))
        }
        Request::Withdraw { key, replica } => {
            st.withdraw(key, replica).map_err(state)?;
            Ok(Response::Done)
        }
        Request::FetchLatest { key } => {
            let l = st.fetch_latest(key).map_err(state)?;
            Ok(Response::Latest(
                l.map(|(v, b)| (sh.base.saturating_add(v), Blob(b))),
            ))
        }
        Request::PublishLatest {
            key,
            holder,
            fence,
            value,
        } => {
            own(holder)?;
            let token = local_token(sh, holder, fence).ok_or(WireError::LeaseLost)?;
            let v = st.publish_latest(key, &token, value.0).map_err(state)?;
            Ok(Response::Version(sh.base.saturating_add(v)))
        }
        Request::Lock {
            key,
            holder,
            lease_us,
        } => {
            own(holder)?;
            let lease = Duration::from_micros(lease_us).min(sh.cfg.max_lease);
            // The hub's clock decides: the lease starts now, here.
            let t = st.lock(key, holder, lease, sh.now()).map_err(state)?;
            bump(&sh.c.lock_grants);
            // Read after the grant: from here on only this grant can publish the key.
            let latest = st.fetch_latest(key).map_err(state)?;
            Ok(Response::Granted {
                fence: sh.base.saturating_add(t.fence),
                lease_us: u64::try_from(lease.as_micros()).unwrap_or(u64::MAX),
                latest: latest.map(|(v, b)| (sh.base.saturating_add(v), Blob(b))),
            })
        }
        Request::Unlock { key, holder, fence } => {
            own(holder)?;
            let token = local_token(sh, holder, fence).ok_or(WireError::LeaseLost)?;
            st.unlock(key, &token).map_err(state)?;
            Ok(Response::Done)
        }
    })();
    match result {
        Ok(r) => r,
        Err(error) => {
            match &error {
                WireError::Protocol(_) => bump(&sh.c.protocol_errors),
                WireError::Locked => {
                    bump(&sh.c.refused);
                    bump(&sh.c.lock_refused)
                }
                WireError::LeaseLost => {
                    bump(&sh.c.refused);
                    bump(&sh.c.lease_lost)
                }
                _ => bump(&sh.c.refused),
            }
            Response::Error { key, error }
        }
    }
}

fn state(e: pliant_state::StateError) -> WireError {
    WireError::from_state(&e)
}

/// The in-hub token for a wire fence; `None` for a fence this hub instance never issued.
fn local_token(sh: &Shared, holder: ReplicaId, fence: u64) -> Option<LockToken> {
    let local = fence.checked_sub(sh.base).filter(|f| *f > 0)?;
    Some(LockToken {
        holder,
        fence: local,
        // Unused by publish/unlock, which compare fences only.
        expires: Instant::now(),
    })
}

// ---------------------------------------------------------------------------------------------
// Helpers (shared with the client)

/// Locks a mutex, also after another thread panicked while holding it (the data are maps and
/// handles that stay consistent between statements).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
