//! The session-preserving proxy: owns client connections, authenticates clients
//! (SCRAM-SHA-256 or md5), forwards the protocol to the current primary, forwards
//! CancelRequests to the backend that currently serves the session, and moves sessions at
//! failover.
//!
//! A thread per login (startup, TLS, authentication, the server connection: blocking steps
//! with timeouts); established sessions are relayed by a few event loops ([`relay`]); a
//! session whose server is lost moves on a thread of its own and returns to a loop. One
//! controller thread probes the primary and runs the failover. Sessions learn of a failover through `epoch`
//! (bumped once the old primary is fenced) and wait for `ready_epoch` (the new primary is
//! promoted and its xid horizon recorded) before they reconnect.
//!
//! The controller also watches the standby while protected: if it is unreachable, or a
//! commit has waited for it, for `async_fallback_ms`, the primary is switched to run
//! unprotected (`synchronous_standby_names = ''`, counted in `async_fallbacks`) so commits
//! never block forever; the standby is then restored in the background and protection
//! resumes once it streams synchronously again.

use crate::client::{Authenticator, Client};
use crate::health;
use crate::proto::{self, Frame};
use crate::scram::{self, Binding, Secret, ServerExchange};
use crate::secrets;
use crate::session::{CommitTxid, SessionState};
use crate::startup::{self, Opening, Policy, Refusal};
use crate::tls::{self, HandshakeError, Stream, TlsClient, TlsServer};
use serde::Serialize;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod relay;

/// Hooks into whatever runs the servers (the lab cluster, or a test double).
pub trait ClusterOps: Send + Sync {
    /// Makes sure node `i` never accepts a write again (kill it, cut its link).
    fn fence(&self, i: usize);
    /// Brings fenced node `old` back as a synchronous standby of `primary`.
    fn reprotect(&self, old: usize, primary: usize) -> Result<(), String>;
    /// Brings a lost standby back (restart, or a full copy if it cannot catch up) and makes
    /// it the synchronous standby of `primary` again.
    fn restore_standby(&self, standby: usize, primary: usize) -> Result<(), String> {
        self.reprotect(standby, primary)
    }
}

/// How the proxy authenticates its clients.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AuthMethod {
    /// SCRAM-SHA-256, what libpq picks when the server asks (PostgreSQL's default).
    ScramSha256,
    /// The older md5 challenge.
    Md5,
}

impl std::str::FromStr for AuthMethod {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "scram-sha-256" | "scram" => Ok(AuthMethod::ScramSha256),
            "md5" => Ok(AuthMethod::Md5),
            _ => Err(format!(
                "unknown authentication method {s:?} (scram-sha-256 or md5)"
            )),
        }
    }
}

#[derive(Clone, Debug)]
pub struct ProxyConfig {
    pub listen: SocketAddr,
    pub user: String,
    pub password: String,
    pub nodes: [SocketAddr; 2],
    pub primary: usize,
    pub probe_interval_ms: u64,
    /// How long a probe of a healthy primary waits for `SELECT 1` (ms); a late answer makes
    /// the primary only suspect (see [`crate::health`]).
    pub probe_timeout_ms: u64,
    /// A primary that answers probes late, but whose TCP connections are neither refused nor
    /// reset, is declared dead only after answering none for this long (ms); default
    /// [`DEFAULT_PROBE_DEAD_AFTER_MS`]. A crashed or cut-off primary is declared dead after
    /// two failed probes, without waiting for this.
    pub probe_dead_after_ms: u64,
    pub max_sessions: usize,
    /// Re-protect automatically after a failover.
    pub auto_reprotect: bool,
    pub auth: AuthMethod,
    /// Run unprotected after the standby has been unreachable, or a commit has waited for
    /// it, this long (ms); `None` = block commits until the standby returns (strict 2-safe).
    pub async_fallback_ms: Option<u64>,
    /// How long a new connection may take to send its startup packet and each
    /// authentication message (ms) before it is closed; also the limit for a whole TLS
    /// handshake.
    pub startup_timeout_ms: u64,
    /// TLS towards the clients; None = SSLRequest answered `N`.
    pub tls: Option<ListenTls>,
    /// TLS towards the PostgreSQL servers (sessions, probes, failover); None = plaintext.
    pub server_tls: Option<UpstreamTls>,
    /// Event-loop threads relaying established sessions (0 = [`default_relay_threads`]).
    pub relay_threads: usize,
}

/// TLS towards the proxy's clients.
#[derive(Clone, Debug)]
pub struct ListenTls {
    /// PEM certificate chain, the proxy's certificate first.
    pub cert: PathBuf,
    /// PEM private key (refused if group- or world-readable).
    pub key: PathBuf,
    /// Also serve clients that do not ask for TLS. Default false: with TLS configured a
    /// plaintext startup packet is refused (28000), so no session runs unencrypted whatever
    /// the client's sslmode.
    pub allow_plaintext: bool,
}

/// TLS towards the PostgreSQL servers.
#[derive(Clone, Debug)]
pub struct UpstreamTls {
    /// PEM CA certificate(s) the servers' certificates must chain to.
    pub ca: PathBuf,
    /// Name checked in the server certificate instead of the server's IP address.
    pub server_name: Option<String>,
    /// Answer a server's cleartext password request (over TLS only; default false).
    pub allow_cleartext_password: bool,
}

/// Default of `probe_dead_after_ms`: a `SELECT 1` was seen taking over 2 s on this 2-CPU
/// machine under pgbench; this leaves more than twice that, and stays below the ~7 s Patroni
/// (ttl 5) needs to notice a hung leader.
pub const DEFAULT_PROBE_DEAD_AFTER_MS: u64 = 5_000;

/// Default of `startup_timeout_ms`.
pub const DEFAULT_STARTUP_TIMEOUT_MS: u64 = 30_000;

/// Counters (all monotonic except the gauges marked so).
#[derive(Default, Debug, Serialize)]
pub struct Stats {
    pub sessions_total: AtomicU64,
    /// Gauge.
    pub sessions_active: AtomicU64,
    /// Sessions moved to a new primary and still open (their open transaction may have been aborted).
    pub sessions_kept: AtomicU64,
    pub sessions_dropped_unreplayable: AtomicU64,
    pub sessions_dropped_other: AtomicU64,
    pub txns_aborted_by_failover: AtomicU64,
    pub commits_resolved_committed: AtomicU64,
    pub commits_resolved_aborted: AtomicU64,
    pub statements_retried: AtomicU64,
    pub outcomes_unknown: AtomicU64,
    pub failovers: AtomicU64,
    pub last_failover_ms: AtomicU64,
    pub last_detect_ms: AtomicU64,
    pub protocol_errors: AtomicU64,
    pub auth_failures: AtomicU64,
    pub session_limit_hits: AtomicU64,
    /// Logins the primary refused with an error of its own (passed on to the client).
    pub logins_refused_by_server: AtomicU64,
    /// Connections closed because the startup packet or a password did not arrive in time.
    pub startup_timeouts: AtomicU64,
    pub reprotections: AtomicU64,
    pub reprotect_failures: AtomicU64,
    /// Times the primary was switched to run unprotected because the standby was lost.
    pub async_fallbacks: AtomicU64,
    /// Lost standbys brought back (protection resumed after an async fallback).
    pub standby_restores: AtomicU64,
    pub standby_restore_failures: AtomicU64,
    /// Milliseconds spent unprotected after async fallbacks (finished periods).
    pub unprotected_ms_total: AtomicU64,
    pub cancels_forwarded: AtomicU64,
    /// CancelRequests naming no session of this proxy, or with a wrong key (dropped).
    pub cancels_unmatched: AtomicU64,
    pub cancels_failed: AtomicU64,
    /// TLS handshakes with clients that failed (not TLS after SSLRequest, bad records, ...).
    pub tls_handshake_failures: AtomicU64,
    /// Plaintext startup packets refused because TLS is required.
    pub plaintext_refused: AtomicU64,
}

/// Where a client's CancelRequest must go: the server backend currently serving it.
#[derive(Clone, Copy, Debug)]
struct CancelTarget {
    /// The secret the proxy gave the client in its BackendKeyData.
    client_key: u32,
    addr: SocketAddr,
    pid: u32,
    key: u32,
}

pub struct Shared {
    pub cfg: ProxyConfig,
    pub epoch: AtomicU64,
    pub ready_epoch: AtomicU64,
    pub primary: AtomicUsize,
    /// The standby is streaming synchronously: a failover loses no acknowledged commit.
    pub protected: AtomicBool,
    /// Next transaction id of the new primary at promotion (xids at or above it belong to
    /// the old primary's lost history: aborted).
    pub xid_horizon: AtomicU64,
    /// When a session last received bytes from the primary ([`mono_ms`]; 0 = never):
    /// evidence for the failure detector that a primary whose probe is late is alive.
    pub primary_heard_ms: AtomicU64,
    /// When a session's connection to the primary was last closed by the server side without
    /// a FATAL message (EOF or reset: a backend that died; [`mono_ms`], 0 = never): evidence
    /// for the failure detector that a primary whose probe is late is dead.
    pub primary_closed_ms: AtomicU64,
    /// When the last probe that the primary answered started ([`mono_ms`], 0 = never): a
    /// session that lost its server connection before that is not part of a failover.
    pub primary_answered_ms: AtomicU64,
    /// Monotonic origin of `primary_heard_ms`.
    pub clock: Instant,
    pub stats: Stats,
    pub shutdown: AtomicBool,
    ops: Option<Arc<dyn ClusterOps>>,
    next_session: AtomicU64,
    pub last_error: Mutex<String>,
    /// The primary runs unprotected because the standby was lost (async fallback).
    pub degraded: AtomicBool,
    /// When the current async fallback began (ms since the UNIX epoch; 0 = not degraded).
    degraded_since_ms: AtomicU64,
    /// Operator hold: do not bring a lost standby back yet (maintenance; tests).
    pub reprotect_hold: AtomicBool,
    /// Session id -> cancel target. One entry per live session, so bounded by
    /// `max_sessions` like the sessions themselves.
    cancel: Mutex<HashMap<u32, CancelTarget>>,
    scram: Secret,
    tls_in: Option<TlsServer>,
    tls_out: Option<TlsClient>,
    relay: relay::Relay,
}

pub struct Proxy {
    pub shared: Arc<Shared>,
    threads: Vec<std::thread::JoinHandle<()>>,
    pub addr: SocketAddr,
}

impl Proxy {
    /// Binds the listener and starts the acceptor and controller threads.
    pub fn start(
        cfg: ProxyConfig,
        protected: bool,
        ops: Option<Arc<dyn ClusterOps>>,
    ) -> Result<Proxy, String> {
        let l =
            TcpListener::bind(cfg.listen).map_err(|e| format!("proxy bind {}: {e}", cfg.listen))?;
        let addr = l.local_addr().map_err(|e| e.to_string())?;
        l.set_nonblocking(true).map_err(|e| e.to_string())?;
        // The proxy knows the password, so it derives the SCRAM verifier itself, once.
        let salt = secrets::random_bytes::<16>().map_err(|e| format!("SCRAM salt: {e}"))?;
        let secret = Secret::new(&cfg.password, &salt, scram::ITERATIONS);
        let tls_in = cfg
            .tls
            .as_ref()
            .map(|t| TlsServer::load(&t.cert, &t.key))
            .transpose()?;
        let tls_out = cfg
            .server_tls
            .as_ref()
            .map(|t| TlsClient::load(&t.ca, t.server_name.as_deref()))
            .transpose()?;
        let loops = match cfg.relay_threads {
            0 => default_relay_threads(),
            n => n,
        };
        let relay = relay::Relay::new(loops)?;
        let shared = Arc::new(Shared {
            primary: AtomicUsize::new(cfg.primary),
            cfg,
            epoch: AtomicU64::new(0),
            ready_epoch: AtomicU64::new(0),
            protected: AtomicBool::new(protected),
            xid_horizon: AtomicU64::new(0),
            primary_heard_ms: AtomicU64::new(0),
            primary_closed_ms: AtomicU64::new(0),
            primary_answered_ms: AtomicU64::new(0),
            clock: Instant::now(),
            stats: Stats::default(),
            shutdown: AtomicBool::new(false),
            ops,
            next_session: AtomicU64::new(1),
            last_error: Mutex::new(String::new()),
            degraded: AtomicBool::new(false),
            degraded_since_ms: AtomicU64::new(0),
            reprotect_hold: AtomicBool::new(false),
            cancel: Mutex::new(HashMap::new()),
            scram: secret,
            tls_in,
            tls_out,
            relay,
        });
        // Named threads: `top -H`, perf and /proc tell the relay loops from the rest.
        // A thread that cannot start stops the ones already started (they watch `shutdown`).
        let named = |name: String, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name)
                .spawn(f)
                .map_err(|e| {
                    shared.shutdown.store(true, SeqCst);
                    format!("proxy thread: {e}")
                })
        };
        let s1 = shared.clone();
        let acc = named("pg-accept".into(), Box::new(move || accept_loop(l, s1)))?;
        let s2 = shared.clone();
        let ctl = named("pg-controller".into(), Box::new(move || controller(s2)))?;
        let mut threads = vec![acc, ctl];
        for i in 0..shared.relay.threads() {
            let s = shared.clone();
            threads.push(named(
                format!("pg-relay-{i}"),
                Box::new(move || relay::run(s, i)),
            )?);
        }
        Ok(Proxy {
            shared,
            threads,
            addr,
        })
    }

    pub fn stats_json(&self) -> serde_json::Value {
        status_json(&self.shared)
    }

    pub fn stop(mut self) {
        self.shared.shutdown.store(true, SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, SeqCst);
    }
}

pub fn status_json(s: &Shared) -> serde_json::Value {
    let p = s.primary.load(SeqCst);
    let mut v = serde_json::to_value(&s.stats).unwrap_or_default();
    v["primary"] = s.cfg.nodes[p].to_string().into();
    v["standby"] = s.cfg.nodes[1 - p].to_string().into();
    v["protected"] = s.protected.load(SeqCst).into();
    let degraded = s.degraded.load(SeqCst);
    v["degraded"] = degraded.into();
    v["mode"] = if s.protected.load(SeqCst) {
        "protected (synchronous standby)"
    } else if degraded {
        "unprotected: standby lost, async fallback"
    } else {
        "unprotected: failing over / re-protecting"
    }
    .into();
    let since = s.degraded_since_ms.load(SeqCst);
    v["unprotected_for_ms"] = if degraded && since > 0 {
        now_ms().saturating_sub(since)
    } else {
        0
    }
    .into();
    v["async_fallback_ms"] = s.cfg.async_fallback_ms.into();
    v["auth"] = format!("{:?}", s.cfg.auth).into();
    v["tls"] = match &s.cfg.tls {
        None => "off",
        Some(t) if t.allow_plaintext => "on (plaintext clients allowed)",
        Some(_) => "required",
    }
    .into();
    v["server_tls"] = s.cfg.server_tls.is_some().into();
    v["epoch"] = s.epoch.load(SeqCst).into();
    v["last_error"] = s
        .last_error
        .lock()
        .map(|e| e.clone())
        .unwrap_or_default()
        .into();
    v
}

/// How coarsely sessions record that the primary spoke (ms): a store per frame from every
/// relay loop would contend on one cache line; the detector's windows are far coarser.
const HEARD_GRANULARITY_MS: u64 = 10;

/// Milliseconds since `sh.clock`, from 1 (0 stands for "never").
fn mono_ms(sh: &Shared) -> u64 {
    sh.clock.elapsed().as_millis() as u64 + 1
}

/// A session got bytes from the primary: records it for the failure detector.
fn note_primary_heard(sh: &Shared) {
    let now = mono_ms(sh);
    if now >= sh.primary_heard_ms.load(Relaxed) + HEARD_GRANULARITY_MS {
        sh.primary_heard_ms.store(now, Relaxed);
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn accept_loop(l: TcpListener, sh: Arc<Shared>) {
    while !sh.shutdown.load(SeqCst) {
        match l.accept() {
            Ok((c, _)) => {
                if sh.stats.sessions_active.load(SeqCst) as usize >= sh.cfg.max_sessions {
                    sh.stats.session_limit_hits.fetch_add(1, SeqCst);
                    let mut c = c;
                    let _ = proto::write_frames(
                        &mut c,
                        &[proto::error_response(
                            "FATAL",
                            "53300",
                            "sorry, too many clients already (pliant proxy)",
                        )],
                    );
                    continue;
                }
                let s = sh.clone();
                let active = Active::new(&s);
                let _ = c.set_nonblocking(false);
                std::thread::spawn(move || {
                    let _ = serve_client(c, &s, active);
                });
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// Relay loops when the configuration says 0: one per four CPUs, at least one. A loop spends
/// almost all of its time in the kernel's TCP paths and serves tens of thousands of
/// statements a second; on the 2-core lab machine a second loop only competed with the
/// servers and clients for the CPUs (select-only through the proxy: 0.84-0.94x of direct with
/// two loops, 0.85-1.03x with one, in alternating runs under the same load).
pub fn default_relay_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| (n.get() / 4).max(1))
}

/// Counts a session in `sessions_active` for as long as it lives (login, relay, moves).
struct Active(Arc<Shared>);

impl Active {
    fn new(sh: &Arc<Shared>) -> Active {
        sh.stats.sessions_active.fetch_add(1, SeqCst);
        Active(sh.clone())
    }
}

impl Drop for Active {
    fn drop(&mut self) {
        self.0.stats.sessions_active.fetch_sub(1, SeqCst);
    }
}

fn fatal(c: &mut Stream, code: &str, msg: &str) {
    let _ = proto::write_frames(c, &[proto::error_response("FATAL", code, msg)]);
    c.shutdown();
}

/// Counts a refused connection in `counter` and closes it with a FATAL error.
fn refuse(c: &mut Stream, counter: &AtomicU64, code: &str, msg: &str) -> Result<(), String> {
    counter.fetch_add(1, SeqCst);
    fatal(c, code, msg);
    Ok(())
}

/// Authenticated server connection with the session's startup parameters.
struct Backend {
    s: Stream,
    epoch: u64,
    params: Vec<Frame>,
    addr: SocketAddr,
    /// The server's BackendKeyData (pid, secret), for forwarding CancelRequests.
    key: Option<(u32, u32)>,
}

/// Why a server connection could not be opened.
#[derive(Debug)]
enum ConnectError {
    /// The server answered the login with this error (too many clients, a missing
    /// database, ...): passed to the client as it is, at once.
    Refused(Frame),
    /// No answer, a transport error, or a server not accepting connections yet (57P0x):
    /// worth waiting for.
    Unreachable(String),
}

impl std::fmt::Display for ConnectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConnectError::Refused(e) => {
                write!(
                    f,
                    "{}",
                    proto::error_field(&e.body, b'M').unwrap_or_default()
                )
            }
            ConnectError::Unreachable(e) => write!(f, "{e}"),
        }
    }
}

impl From<String> for ConnectError {
    fn from(e: String) -> Self {
        ConnectError::Unreachable(e)
    }
}

impl From<&str> for ConnectError {
    fn from(e: &str) -> Self {
        ConnectError::Unreachable(e.to_string())
    }
}

/// An ErrorResponse at login that is the server's answer for this client rather than a
/// sign that it is (still) unavailable: 57P0x (shutting down, starting up, in recovery)
/// is worth waiting for, anything else (53300 too many clients, 28P01, 3D000) is final.
fn login_error(f: Frame) -> ConnectError {
    let code = proto::error_field(&f.body, b'C').unwrap_or_default();
    if code.starts_with("57P0") {
        ConnectError::Unreachable(proto::error_field(&f.body, b'M').unwrap_or_default())
    } else {
        ConnectError::Refused(f)
    }
}

fn connect_backend(sh: &Shared, startup: &[(String, String)]) -> Result<Backend, ConnectError> {
    let epoch = sh.ready_epoch.load(SeqCst);
    let addr = sh.cfg.nodes[sh.primary.load(SeqCst)];
    let t = Duration::from_millis(sh.cfg.probe_timeout_ms.max(200) * 5);
    let s = TcpStream::connect_timeout(&addr, t).map_err(|e| format!("connect {addr}: {e}"))?;
    let _ = s.set_nodelay(true);
    s.set_read_timeout(Some(t)).map_err(|e| e.to_string())?;
    let mut s = match &sh.tls_out {
        Some(tc) => match tls::connect(s, tc, addr.ip(), Instant::now() + t) {
            Ok(s) => s,
            // A certificate that does not verify will not verify on a retry either.
            Err(e @ HandshakeError::Tls(_)) => {
                return Err(refusal(&format!("pliant: TLS to the server {addr}: {e}")))
            }
            Err(e) => return Err(format!("TLS to {addr}: {e}").into()),
        },
        None => Stream::Plain(s),
    };
    s.write_all(&proto::startup_message(startup))
        .map_err(|e| e.to_string())?;
    let user = startup
        .iter()
        .find(|(k, _)| k == "user")
        .map(|(_, v)| v.as_str())
        .unwrap_or("");
    let allow_cleartext = sh
        .cfg
        .server_tls
        .as_ref()
        .is_some_and(|t| t.allow_cleartext_password);
    let mut auth = Authenticator::new(user, &sh.cfg.password).over(&s, allow_cleartext);
    let mut params = Vec::new();
    let mut key = None;
    loop {
        let f = proto::read_frame(&mut s)
            .map_err(|e| e.to_string())?
            .ok_or("server closed during startup")?;
        match f.tag {
            b'R' => match auth.answer(&f.body) {
                Ok(Some(reply)) => {
                    proto::write_frames(&mut s, &[reply]).map_err(|e| e.to_string())?;
                }
                Ok(None) => {}
                // A downgrade attempt or a policy refusal: final, the client is told why.
                Err(e @ crate::client::ClientError::Refused(_)) => {
                    return Err(refusal(&format!("pliant: login to the server {addr}: {e}")))
                }
                Err(e) => return Err(format!("authentication at {addr}: {e}").into()),
            },
            b'E' => return Err(login_error(f)),
            b'S' => params.push(f),
            b'K' if f.body.len() == 8 => {
                let w = |i: usize| {
                    u32::from_be_bytes([f.body[i], f.body[i + 1], f.body[i + 2], f.body[i + 3]])
                };
                key = Some((w(0), w(4)));
            }
            b'Z' => break,
            _ => {}
        }
    }
    s.set_read_timeout(None).map_err(|e| e.to_string())?;
    Ok(Backend {
        s,
        epoch,
        params,
        addr,
        key,
    })
}

/// A final login failure of the proxy's own making (28000), passed to the client at once.
fn refusal(msg: &str) -> ConnectError {
    ConnectError::Refused(proto::error_response("FATAL", "28000", msg))
}

/// Sends frames and consumes answers up to `zs` ReadyForQuery; returns the last status and
/// whether any error came back.
fn run_quiet(b: &mut Backend, frames: &[Frame], zs: usize) -> Result<(u8, bool), String> {
    proto::write_frames(&mut b.s, frames).map_err(|e| e.to_string())?;
    let mut err = false;
    let mut st = b'I';
    let mut seen = 0;
    while seen < zs {
        let f = proto::read_frame(&mut b.s)
            .map_err(|e| e.to_string())?
            .ok_or("server closed")?;
        match f.tag {
            b'E' => err = true,
            b'Z' => {
                seen += 1;
                st = f.body.first().copied().unwrap_or(b'I');
            }
            _ => {}
        }
    }
    Ok((st, err))
}

/// Logs a client in (blocking, bounded by the startup timeout) and hands the established
/// session to the relay.
fn serve_client(c: TcpStream, sh: &Arc<Shared>, active: Active) -> Result<(), String> {
    let _ = c.set_nodelay(true);
    let policy = Policy {
        tls: sh.tls_in.as_ref(),
        require_tls: sh.cfg.tls.as_ref().is_some_and(|t| !t.allow_plaintext),
        timeout: Duration::from_millis(sh.cfg.startup_timeout_ms.max(1)),
    };
    // Encryption negotiation and the startup packet; a CancelRequest goes to the backend
    // serving that session.
    let (mut c, params) = match startup::open(c, &policy) {
        Ok((c, Opening::Params(p))) => (c, p),
        Ok((_, Opening::Cancel { pid, key })) => {
            // Like PostgreSQL: no answer either way, the connection just closes.
            forward_cancel(sh, pid, key);
            return Ok(());
        }
        Ok((_, Opening::Closed)) => return Ok(()),
        Err(Refusal::Timeout(mut c)) => {
            return refuse(
                &mut c,
                &sh.stats.startup_timeouts,
                "08006",
                "timeout waiting for startup packet",
            )
        }
        Err(Refusal::Handshake(HandshakeError::Timeout)) => {
            sh.stats.startup_timeouts.fetch_add(1, SeqCst);
            return Ok(());
        }
        Err(Refusal::Handshake(_)) => {
            sh.stats.tls_handshake_failures.fetch_add(1, SeqCst);
            return Ok(());
        }
        Err(Refusal::Invalid(mut c, code, msg)) => {
            return refuse(&mut c, &sh.stats.protocol_errors, code, &msg)
        }
        Err(Refusal::PlaintextRefused(mut c)) => {
            return refuse(
                &mut c,
                &sh.stats.plaintext_refused,
                "28000",
                "pliant: TLS is required (connect with sslmode=require or verify-full)",
            )
        }
    };
    let user = params
        .iter()
        .find(|(k, _)| k == "user")
        .map(|(_, v)| v.clone())
        .unwrap_or_default();
    if params.iter().any(|(k, _)| k == "replication") {
        fatal(
            &mut c,
            "08P01",
            "replication connections are not served by the pliant proxy",
        );
        return Ok(());
    }
    match authenticate(&mut c, sh, &user) {
        Auth::Ok => {}
        Auth::Failed => {
            return refuse(
                &mut c,
                &sh.stats.auth_failures,
                "28P01",
                &format!("password authentication failed for user \"{user}\""),
            )
        }
        Auth::TimedOut => {
            return refuse(
                &mut c,
                &sh.stats.startup_timeouts,
                "08006",
                "timeout waiting for the authentication response",
            )
        }
        Auth::Protocol(what) => {
            sh.stats.protocol_errors.fetch_add(1, SeqCst);
            fatal(&mut c, "08P01", &what);
            return Ok(());
        }
        Auth::Gone => return Ok(()),
        Auth::Internal(what) => {
            fatal(&mut c, "XX000", &format!("pliant: {what}"));
            return Ok(());
        }
    }
    // The key a CancelRequest must quote: a guessable one would let anyone cancel queries.
    let client_key = match secrets::random_u32() {
        Ok(k) => k,
        Err(e) => {
            fatal(&mut c, "XX000", &format!("pliant: cancel key: {e}"));
            return Ok(());
        }
    };
    let st = SessionState::new(params);
    let be = match wait_backend(sh, &st.startup, 0) {
        Ok(b) => b,
        Err(ConnectError::Refused(f)) => {
            sh.stats.logins_refused_by_server.fetch_add(1, SeqCst);
            let _ = proto::write_frames(&mut c, &[f]);
            c.shutdown();
            return Ok(());
        }
        Err(e) => {
            fatal(
                &mut c,
                "08006",
                &format!("pliant: cannot reach the primary: {e}"),
            );
            return Ok(());
        }
    };
    let mut hello = vec![proto::auth(0, &[])];
    hello.extend(be.params.iter().cloned());
    let id = sh.next_session.fetch_add(1, SeqCst) as u32;
    let mut kd = id.to_be_bytes().to_vec();
    kd.extend(client_key.to_be_bytes());
    hello.push(Frame::new(b'K', kd));
    hello.push(proto::ready_for_query(b'I'));
    proto::write_frames(&mut c, &hello).map_err(|e| e.to_string())?;
    sh.stats.sessions_total.fetch_add(1, SeqCst);
    c.set_read_timeout(None).map_err(|e| e.to_string())?;
    let reg = CancelReg::new(sh, id, client_key, &be);
    c.set_nonblocking(true).map_err(|e| e.to_string())?;
    be.s.set_nonblocking(true).map_err(|e| e.to_string())?;
    sh.relay
        .submit(relay::Session::new(sh, c, be, st, id, reg, active));
    Ok(())
}

enum Auth {
    Ok,
    Failed,
    TimedOut,
    Protocol(String),
    Gone,
    /// The proxy could not run the exchange (no random salt or nonce).
    Internal(String),
}

/// Reads the client's next message, which must be a password/SASL response ('p');
/// `Err(None)`: it did not arrive in time.
fn read_password_message(c: &mut Stream) -> Result<Option<Vec<u8>>, Option<String>> {
    match proto::read_frame(c) {
        Ok(Some(f)) if f.tag == b'p' => Ok(Some(f.body)),
        Ok(Some(f)) => Err(Some(format!(
            "expected password response, got message type {}",
            f.tag
        ))),
        Ok(None) => Ok(None),
        Err(e) if startup::timed_out(&e) => Err(None),
        Err(e) => Err(Some(format!("invalid password response: {e}"))),
    }
}

/// Authenticates the client against the proxy's user (md5 or SCRAM-SHA-256). A wrong user
/// fails exactly like a wrong password (no user enumeration).
fn authenticate(c: &mut Stream, sh: &Shared, user: &str) -> Auth {
    let send = |c: &mut Stream, f: Frame| proto::write_frames(c, &[f]).is_ok();
    match sh.cfg.auth {
        AuthMethod::Md5 => {
            let salt = match secrets::random_bytes::<4>() {
                Ok(s) => s,
                Err(e) => return Auth::Internal(format!("md5 salt: {e}")),
            };
            if !send(c, proto::auth(5, &salt)) {
                return Auth::Gone;
            }
            let body = match read_password_message(c) {
                Ok(Some(b)) => b,
                Ok(None) => return Auth::Gone,
                Err(e) => return e.map_or(Auth::TimedOut, Auth::Protocol),
            };
            if md5_login_ok(&sh.cfg.user, &sh.cfg.password, user, &body, &salt) {
                Auth::Ok
            } else {
                Auth::Failed
            }
        }
        AuthMethod::ScramSha256 => {
            // Over TLS (with a certificate whose hash is defined) SCRAM-SHA-256-PLUS first,
            // as PostgreSQL lists them.
            let end_point = sh
                .tls_in
                .as_ref()
                .filter(|_| c.is_tls())
                .and_then(|t| t.end_point.clone());
            let mut mechs = Vec::new();
            if end_point.is_some() {
                proto::put_cstr(&mut mechs, scram::MECHANISM_PLUS);
            }
            proto::put_cstr(&mut mechs, scram::MECHANISM);
            mechs.push(0);
            if !send(c, proto::auth(10, &mechs)) {
                return Auth::Gone;
            }
            let body = match read_password_message(c) {
                Ok(Some(b)) => b,
                Ok(None) => return Auth::Gone,
                Err(e) => return e.map_or(Auth::TimedOut, Auth::Protocol),
            };
            let (mech, data) = match proto::parse_sasl_initial_response(&body) {
                Ok(x) => x,
                Err(e) => return Auth::Protocol(format!("invalid SASL response: {e}")),
            };
            let binding = match (mech, end_point) {
                (scram::MECHANISM_PLUS, Some(d)) => Binding::Plus(d),
                (scram::MECHANISM, Some(_)) => Binding::Declined,
                (scram::MECHANISM, None) => Binding::NotOffered,
                _ => {
                    return Auth::Protocol(format!(
                        "client selected an invalid SASL authentication mechanism {mech:?}"
                    ))
                }
            };
            let first = String::from_utf8_lossy(data);
            let nonce = match scram::new_nonce() {
                Ok(n) => n,
                Err(e) => return Auth::Internal(format!("SCRAM nonce: {e}")),
            };
            let (ex, server_first) =
                match ServerExchange::start_bound(&sh.scram, &first, &nonce, &binding) {
                    Ok(x) => x,
                    Err(e) => return Auth::Protocol(e.to_string()),
                };
            if !send(c, proto::auth(11, server_first.as_bytes())) {
                return Auth::Gone;
            }
            let body = match read_password_message(c) {
                Ok(Some(b)) => b,
                Ok(None) => return Auth::Gone,
                Err(e) => return e.map_or(Auth::TimedOut, Auth::Protocol),
            };
            match ex.finish(&String::from_utf8_lossy(&body)) {
                Ok(server_final) if secrets::ct_eq(user.as_bytes(), sh.cfg.user.as_bytes()) => {
                    if send(c, proto::auth(12, server_final.as_bytes())) {
                        Auth::Ok
                    } else {
                        Auth::Gone
                    }
                }
                Ok(_) | Err(scram::ScramError::Proof) => Auth::Failed,
                Err(e) => Auth::Protocol(e.to_string()),
            }
        }
    }
}

/// Whether an md5 password `response` (a C string) is right for `user`: user name and hash are
/// compared in constant time and both always, so neither how much of a guessed hash was right
/// nor whether the user exists shows in the time the answer takes.
fn md5_login_ok(
    cfg_user: &str,
    cfg_password: &str,
    user: &str,
    response: &[u8],
    salt: &[u8; 4],
) -> bool {
    let got = proto::cstr(response).map(|(s, _)| s).unwrap_or_default();
    let want = proto::md5_password(user, cfg_password, salt);
    let user_ok = secrets::ct_eq(user.as_bytes(), cfg_user.as_bytes());
    let hash_ok = secrets::ct_eq(got.as_bytes(), want.as_bytes());
    user_ok & hash_ok
}

/// Registers a session's cancel target for its lifetime.
struct CancelReg {
    sh: Arc<Shared>,
    id: u32,
}

impl CancelReg {
    fn new(sh: &Arc<Shared>, id: u32, client_key: u32, be: &Backend) -> Self {
        set_cancel_target(sh, id, Some(client_key), be);
        CancelReg { sh: sh.clone(), id }
    }
}

impl Drop for CancelReg {
    fn drop(&mut self) {
        if let Ok(mut m) = self.sh.cancel.lock() {
            m.remove(&self.id);
        }
    }
}

/// Points session `id`'s cancel target at backend `be` (at login and after each move).
fn set_cancel_target(sh: &Shared, id: u32, client_key: Option<u32>, be: &Backend) {
    let Ok(mut m) = sh.cancel.lock() else { return };
    let client_key = match client_key.or_else(|| m.get(&id).map(|t| t.client_key)) {
        Some(k) => k,
        None => return,
    };
    match be.key {
        Some((pid, key)) => {
            m.insert(
                id,
                CancelTarget {
                    client_key,
                    addr: be.addr,
                    pid,
                    key,
                },
            );
        }
        // A server that sends no BackendKeyData cannot be cancelled.
        None => {
            m.remove(&id);
        }
    }
}

/// Sends a CancelRequest for session `pid` to the server backend serving it, if `key`
/// matches what the proxy gave that session.
fn forward_cancel(sh: &Shared, pid: u32, key: u32) {
    let target = sh
        .cancel
        .lock()
        .ok()
        .and_then(|m| m.get(&pid).copied())
        // Constant time: the key is the only secret of a CancelRequest.
        .filter(|t| secrets::ct_eq(&t.client_key.to_be_bytes(), &key.to_be_bytes()));
    let Some(t) = target else {
        sh.stats.cancels_unmatched.fetch_add(1, SeqCst);
        return;
    };
    let mut pkt = 16u32.to_be_bytes().to_vec();
    pkt.extend(proto::CANCEL_REQUEST.to_be_bytes());
    pkt.extend(t.pid.to_be_bytes());
    pkt.extend(t.key.to_be_bytes());
    let sent = TcpStream::connect_timeout(&t.addr, Duration::from_secs(1)).and_then(|mut s| {
        s.write_all(&pkt)?;
        // The server closes without answering once it has read the request.
        let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
        let _ = s.read(&mut [0u8; 1]);
        Ok(())
    });
    match sent {
        Ok(()) => sh.stats.cancels_forwarded.fetch_add(1, SeqCst),
        Err(_) => sh.stats.cancels_failed.fetch_add(1, SeqCst),
    };
}

/// Connects to the primary, waiting out a failover in progress.
fn wait_backend(
    sh: &Shared,
    startup: &[(String, String)],
    _after: u64,
) -> Result<Backend, ConnectError> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if sh.epoch.load(SeqCst) == sh.ready_epoch.load(SeqCst) {
            match connect_backend(sh, startup) {
                Ok(b) => return Ok(b),
                Err(e @ ConnectError::Refused(_)) => return Err(e),
                Err(e) if Instant::now() > deadline => return Err(e),
                Err(_) => {}
            }
        }
        if Instant::now() > deadline || sh.shutdown.load(SeqCst) {
            return Err("no primary available".into());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

enum Lost {
    Moved(Backend),
    Closed,
}

fn is_fatal(body: &[u8]) -> bool {
    matches!(
        proto::error_field(body, b'V')
            .or_else(|| proto::error_field(body, b'S'))
            .as_deref(),
        Some("FATAL" | "PANIC")
    )
}

/// Waits for the controller's verdict on a lost server connection: true if a failover
/// started (epoch moved), false if the primary stayed up (an isolated backend death): a probe
/// that started after the loss was answered. The session follows the failure detector
/// rather than a clock of its own, so a verdict that takes the detector's whole slow window
/// still moves the session instead of closing it just before the failover.
fn wait_for_epoch_change(sh: &Shared, old_epoch: u64) -> bool {
    let lost_ms = mono_ms(sh);
    let t0 = Instant::now();
    // The detector's longest verdict (the slow window, then a few probes), as a backstop.
    let verdict_ms =
        sh.cfg.probe_dead_after_ms + (sh.cfg.probe_timeout_ms + sh.cfg.probe_interval_ms) * 3 + 500;
    while sh.epoch.load(SeqCst) == old_epoch {
        // Strictly later: a probe that started in the loss's millisecond may have been
        // answered just before it.
        if sh.primary_answered_ms.load(SeqCst) > lost_ms
            || t0.elapsed() > Duration::from_millis(verdict_ms)
            || sh.shutdown.load(SeqCst)
        {
            // An epoch change that raced with the answer still counts.
            return sh.epoch.load(SeqCst) != old_epoch;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    true
}

/// The server connection died or its server was fenced: move the session or close it.
fn backend_lost(c: &mut Stream, st: &mut SessionState, sh: &Shared, old_epoch: u64) -> Lost {
    if !wait_for_epoch_change(sh, old_epoch) {
        dbg("session dropped: no failover");
        sh.stats.sessions_dropped_other.fetch_add(1, SeqCst);
        fatal(
            c,
            "57P01",
            "pliant: the server connection was lost and the primary did not fail over",
        );
        return Lost::Closed;
    }
    if let Some(u) = st.unreplayable_reason() {
        sh.stats.sessions_dropped_unreplayable.fetch_add(1, SeqCst);
        if st.commit.is_some() {
            sh.stats.outcomes_unknown.fetch_add(1, SeqCst);
        }
        dbg("session dropped");
        fatal(
            c,
            "57P01",
            &format!(
                "pliant: the primary failed over and this session held {} which cannot be moved; reconnect",
                u.what()
            ),
        );
        return Lost::Closed;
    }
    let mut nb = match wait_backend(sh, &st.startup, old_epoch) {
        Ok(b) => b,
        Err(ConnectError::Refused(f)) => {
            // The new primary refuses this session (e.g. too many clients): say so.
            sh.stats.sessions_dropped_other.fetch_add(1, SeqCst);
            sh.stats.logins_refused_by_server.fetch_add(1, SeqCst);
            let _ = proto::write_frames(c, &[f]);
            c.shutdown();
            return Lost::Closed;
        }
        Err(e) => {
            sh.stats.sessions_dropped_other.fetch_add(1, SeqCst);
            dbg("session dropped");
            fatal(
                c,
                "08006",
                &format!("pliant: failover did not complete: {e}"),
            );
            return Lost::Closed;
        }
    };
    let (replay, zs) = st.replay_frames();
    match run_quiet(&mut nb, &replay, zs) {
        Ok((_, false)) => {}
        Ok((_, true)) | Err(_) => {
            sh.stats.sessions_dropped_other.fetch_add(1, SeqCst);
            dbg("session dropped");
            fatal(
                c,
                "57P01",
                "pliant: the primary failed over and replaying this session's state failed",
            );
            return Lost::Closed;
        }
    }
    // Txid answers still expected from the old server will never come.
    st.resent();
    let mut reply = Vec::new();
    let mut aborted = false;
    if st.idle() {
        // Between requests: an open block is gone (Lemma 2); the client learns it on its next
        // statement, or as an error of its COMMIT (`SessionState::block_aborted_by_failover`).
        aborted = st.moved_between_requests();
    } else if let Some(ct) = st.commit {
        let outcome = resolve_commit(sh, &mut nb, ct);
        let pending = st.awaiting.max(1);
        match outcome {
            Some(true) => {
                sh.stats.commits_resolved_committed.fetch_add(1, SeqCst);
                synth_commit_ok(st, &mut reply);
            }
            Some(false) => {
                sh.stats.commits_resolved_aborted.fetch_add(1, SeqCst);
                proto::error_response(
                    "ERROR",
                    "40001",
                    "pliant: the primary failed before the commit reached the standby; the transaction was rolled back",
                )
                .encode_into(&mut reply);
                proto::ready_for_query(b'I').encode_into(&mut reply);
            }
            None => {
                sh.stats.outcomes_unknown.fetch_add(1, SeqCst);
                proto::error_response(
                    "ERROR",
                    "08007",
                    "pliant: the primary failed during COMMIT and its outcome could not be determined",
                )
                .encode_into(&mut reply);
                proto::ready_for_query(b'I').encode_into(&mut reply);
            }
        }
        for _ in 1..pending {
            proto::ready_for_query(b'I').encode_into(&mut reply);
        }
        st.reset_cycle(b'I');
    } else if st.cycle_status == b'I' && st.inflight_retryable() {
        sh.stats.statements_retried.fetch_add(1, SeqCst);
        let frames = st.inflight.clone();
        let awaiting = st.awaiting;
        let ext = st.ext_open;
        if proto::write_frames(&mut nb.s, &frames).is_err() {
            dbg("session dropped");
            fatal(c, "08006", "pliant: lost the new primary while retrying");
            return Lost::Closed;
        }
        // The state keeps counting the same cycles; responses flow normally.
        st.awaiting = awaiting;
        st.ext_open = ext;
        st.resent();
        sh.stats.sessions_kept.fetch_add(1, SeqCst);
        return Lost::Moved(nb);
    } else if st.cycle_status == b'I' {
        sh.stats.outcomes_unknown.fetch_add(1, SeqCst);
        let pending = st.awaiting;
        proto::error_response(
            "ERROR",
            "08007",
            "pliant: the primary failed while this statement ran; whether it took effect is unknown",
        )
        .encode_into(&mut reply);
        for _ in 0..pending {
            proto::ready_for_query(b'I').encode_into(&mut reply);
        }
        let ext = st.ext_open;
        st.reset_cycle(b'I');
        st.ext_open = ext;
    } else {
        aborted = true;
        let lost_live_block = st.cycle_status == b'T';
        let pending = st.awaiting;
        proto::error_response("ERROR", "40001", crate::session::LOST_BLOCK_MESSAGE)
            .encode_into(&mut reply);
        for _ in 0..pending {
            proto::ready_for_query(b'E').encode_into(&mut reply);
        }
        let ext = st.ext_open;
        st.reset_cycle(b'E');
        st.ext_open = ext;
        if lost_live_block {
            st.block_aborted_by_failover(true);
        }
    }
    if aborted {
        sh.stats.txns_aborted_by_failover.fetch_add(1, SeqCst);
        // Put the new server session into a failed block so that later statements of the
        // client's transaction fail as they would have; a COMMIT of it is answered with an
        // error, not with the ROLLBACK tag (see `SessionState::on_server`).
        if run_quiet(&mut nb, &[proto::query("BEGIN; SELECT 1/0")], 1).is_err() {
            dbg("session dropped");
            fatal(
                c,
                "08006",
                "pliant: lost the new primary while moving the session",
            );
            return Lost::Closed;
        }
    }
    if !reply.is_empty() && c.write_all(&reply).is_err() {
        return Lost::Closed;
    }
    sh.stats.sessions_kept.fetch_add(1, SeqCst);
    Lost::Moved(nb)
}

/// Answers for a COMMIT cycle that committed: one response per message, as the server would.
fn synth_commit_ok(st: &SessionState, out: &mut Vec<u8>) {
    let mut zs = 0;
    for f in &st.inflight {
        match f.tag {
            b'Q' => {
                proto::command_complete("COMMIT").encode_into(out);
                proto::ready_for_query(b'I').encode_into(out);
                zs += 1;
            }
            b'P' => Frame::new(b'1', vec![]).encode_into(out),
            b'B' => Frame::new(b'2', vec![]).encode_into(out),
            b'D' => {
                if f.body.first() == Some(&b'S') {
                    Frame::new(b't', vec![0, 0]).encode_into(out);
                }
                Frame::new(b'n', vec![]).encode_into(out);
            }
            b'E' => proto::command_complete("COMMIT").encode_into(out),
            b'C' => Frame::new(b'3', vec![]).encode_into(out),
            b'S' => {
                proto::ready_for_query(b'I').encode_into(out);
                zs += 1;
            }
            _ => {}
        }
    }
    if zs == 0 {
        proto::command_complete("COMMIT").encode_into(out);
        proto::ready_for_query(b'I').encode_into(out);
    }
}

/// True outcome of an in-flight COMMIT on the new primary, or None if it cannot be known.
fn resolve_commit(sh: &Shared, nb: &mut Backend, ct: CommitTxid) -> Option<bool> {
    match ct {
        // Nothing written: committing or not changes nothing visible.
        CommitTxid::None => Some(true),
        CommitTxid::NotSent => Some(false),
        CommitTxid::Pending | CommitTxid::Untracked => None,
        CommitTxid::Some(x) => {
            if x >= sh.xid_horizon.load(SeqCst) {
                // The new primary never saw this xid: its commit record never replicated.
                return Some(false);
            }
            let q = proto::query(&format!("SELECT txid_status({x})"));
            proto::write_frames(&mut nb.s, &[q]).ok()?;
            let mut ans = None;
            loop {
                let f = proto::read_frame(&mut nb.s).ok()??;
                match f.tag {
                    b'D' => {
                        ans = proto::data_row_columns(&f.body)?
                            .into_iter()
                            .next()
                            .flatten()
                    }
                    b'Z' => break,
                    _ => {}
                }
            }
            match ans.as_deref() {
                Some("committed") => Some(true),
                Some("aborted") => Some(false),
                _ => None,
            }
        }
    }
}

/// The failure-detection policy of `cfg` (see [`crate::health`]).
pub fn probe_policy(cfg: &ProxyConfig) -> health::Policy {
    health::Policy {
        probe_timeout_ms: cfg.probe_timeout_ms,
        slow_dead_after_ms: cfg.probe_dead_after_ms,
    }
}

fn controller(sh: Arc<Shared>) {
    let iv = Duration::from_millis(sh.cfg.probe_interval_ms);
    let to = Duration::from_millis(sh.cfg.probe_timeout_ms);
    let mut detector = health::Detector::new(probe_policy(&sh.cfg));
    let clock = Instant::now();
    let mut wait = to;
    let mut probe: Option<Client> = None;
    let mut watch = StandbyWatch::default();
    // When the last answered probe started ([`mono_ms`]; sessions' evidence older than that
    // is about a primary that answered since).
    let mut last_answer_ms = mono_ms(&sh);
    while !sh.shutdown.load(SeqCst) {
        let p = sh.primary.load(SeqCst);
        let addr = sh.cfg.nodes[p];
        let t = Instant::now();
        let start_ms = mono_ms(&sh);
        // Late, but the primary sent the sessions data meanwhile: alive, only busy; late and
        // a session's backend vanished without a word since the last answer: dead.
        let outcome = health::refine(
            probe_once(&mut probe, addr, &sh, wait),
            sh.primary_heard_ms.load(Relaxed) >= start_ms,
            sh.primary_closed_ms.load(Relaxed) >= last_answer_ms,
        );
        let took = t.elapsed();
        match detector.observe(clock.elapsed().as_millis() as u64, outcome) {
            health::Verdict::Healthy => {
                last_answer_ms = start_ms;
                sh.primary_answered_ms.store(start_ms, SeqCst);
                wait = to;
                watch_standby(&sh, &mut watch, &mut probe, p);
            }
            health::Verdict::Suspect { wait_ms } => {
                dbg(&format!(
                    "primary suspect ({outcome:?} after {took:?}); next probe waits {wait_ms} ms"
                ));
                // Again at once on a fresh connection: its TCP handshake tells a cut link or
                // a dead server from a busy one. A late-class outcome that came back before
                // its wait was up (SQLSTATE class 53) waits an interval: no tight login loop.
                probe = None;
                if matches!(outcome, health::Probe::Slow | health::Probe::Busy) && took < wait {
                    std::thread::sleep(iv);
                }
                // A session's backend vanished without a word: no grace for a late answer
                // (the next late probe is taken as death, see `health::refine`).
                wait = if sh.primary_closed_ms.load(Relaxed) >= last_answer_ms {
                    to
                } else {
                    Duration::from_millis(wait_ms)
                };
                continue;
            }
            health::Verdict::Dead => {
                dbg(&format!("primary dead ({outcome:?} after {took:?})"));
                wait = to;
                detector.reset();
                let detect = Instant::now();
                if !sh.protected.load(SeqCst) {
                    set_err(&sh, "primary unreachable while unprotected: not failing over (acknowledged commits might be missing on the standby)");
                    std::thread::sleep(iv);
                    continue;
                }
                match failover(&sh, p, detect) {
                    Ok(()) => {
                        probe = None;
                        watch = StandbyWatch::default();
                        // Sessions' closes so far were the old primary's.
                        last_answer_ms = mono_ms(&sh);
                    }
                    Err(e) => set_err(&sh, &format!("failover failed: {e}")),
                }
            }
        }
        std::thread::sleep(iv);
    }
}

/// The controller's view of the standby (async fallback and its restoration).
#[derive(Default)]
struct StandbyWatch {
    probe: Option<Client>,
    unreachable_since: Option<Instant>,
    restore: Option<std::thread::JoinHandle<Result<(), String>>>,
    next_restore: Option<Instant>,
}

/// How long the oldest commit on the primary has waited for the synchronous standby (ms).
const SYNC_WAIT_QUERY: &str =
    "SELECT coalesce(max(extract(epoch FROM clock_timestamp() - state_change) * 1000), 0)::bigint \
     FROM pg_stat_activity WHERE wait_event = 'SyncRep'";

/// While protected: fall back to running unprotected once the standby has been unreachable,
/// or a commit has waited for it, for `async_fallback_ms`. While degraded: bring the standby
/// back in the background (retrying every 2 s) and resume protection once it is in sync.
fn watch_standby(sh: &Arc<Shared>, w: &mut StandbyWatch, probe: &mut Option<Client>, p: usize) {
    let Some(limit) = sh.cfg.async_fallback_ms.filter(|ms| *ms > 0) else {
        return;
    };
    let limit = Duration::from_millis(limit);
    let sb = 1 - p;
    if sh.protected.load(SeqCst) && !sh.degraded.load(SeqCst) {
        let to = Duration::from_millis(sh.cfg.probe_timeout_ms);
        let reachable =
            probe_once(&mut w.probe, sh.cfg.nodes[sb], sh, to) == health::Probe::Answered;
        if reachable {
            w.unreachable_since = None;
        } else {
            w.unreachable_since.get_or_insert_with(Instant::now);
        }
        let waited_ms = probe
            .as_mut()
            .and_then(|c| c.scalar(SYNC_WAIT_QUERY).ok().flatten())
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
        let lost_for = w.unreachable_since.map(|t| t.elapsed()).unwrap_or_default();
        if lost_for >= limit || Duration::from_millis(waited_ms) >= limit {
            let why = if lost_for >= limit {
                format!("standby unreachable for {} ms", lost_for.as_millis())
            } else {
                format!("a commit waited {waited_ms} ms for the standby")
            };
            match degrade(sh, p) {
                Ok(()) => {
                    dbg("async fallback");
                    set_err(sh, &format!("async fallback: {why}; running unprotected"));
                    w.unreachable_since = None;
                    w.probe = None;
                    w.next_restore = None;
                }
                Err(e) => set_err(sh, &format!("async fallback failed: {e}")),
            }
        }
        return;
    }
    if !sh.degraded.load(SeqCst) {
        // Unprotected after a failover: the failover's own re-protection runs.
        return;
    }
    if let Some(h) = w.restore.take() {
        if !h.is_finished() {
            w.restore = Some(h);
            return;
        }
        match h.join() {
            Ok(Ok(())) => {
                sh.stats.standby_restores.fetch_add(1, SeqCst);
                let since = sh.degraded_since_ms.swap(0, SeqCst);
                sh.stats
                    .unprotected_ms_total
                    .fetch_add(now_ms().saturating_sub(since), SeqCst);
                sh.protected.store(true, SeqCst);
                sh.degraded.store(false, SeqCst);
                set_err(sh, "");
                dbg("protection resumed");
                return;
            }
            Ok(Err(e)) => {
                sh.stats.standby_restore_failures.fetch_add(1, SeqCst);
                set_err(sh, &format!("standby restore failed (will retry): {e}"));
            }
            Err(_) => {
                sh.stats.standby_restore_failures.fetch_add(1, SeqCst);
                set_err(sh, "standby restore panicked (will retry)");
            }
        }
        w.next_restore = Some(Instant::now() + Duration::from_secs(2));
        return;
    }
    if sh.reprotect_hold.load(SeqCst) || w.next_restore.is_some_and(|t| Instant::now() < t) {
        return;
    }
    if let Some(ops) = sh.ops.clone() {
        w.restore = Some(std::thread::spawn(move || ops.restore_standby(sb, p)));
    }
}

/// Switches primary `p` to run without a synchronous standby: waiting commits are released
/// by the reload. Stale WAL senders of the lost standby are ended so that a returning
/// standby is not shadowed by a half-dead connection that still looks "streaming".
fn degrade(sh: &Shared, p: usize) -> Result<(), String> {
    let mut c = server_client(sh, p, CONNECT_TIMEOUT * 5, Duration::from_secs(10))
        .map_err(|e| format!("primary: {e}"))?;
    c.query("ALTER SYSTEM SET synchronous_standby_names = ''")
        .map_err(|e| e.to_string())?;
    c.query("SELECT pg_reload_conf()")
        .map_err(|e| e.to_string())?;
    // From here on commits no longer wait: the protection is off.
    sh.protected.store(false, SeqCst);
    sh.degraded.store(true, SeqCst);
    sh.degraded_since_ms.store(now_ms(), SeqCst);
    sh.stats.async_fallbacks.fetch_add(1, SeqCst);
    let _ = c.query("SELECT pg_terminate_backend(pid) FROM pg_stat_replication");
    Ok(())
}

/// TCP connect timeout of probes: the handshake is answered by the server's kernel, not by
/// PostgreSQL, so it does not stretch under database load; a cut link shows as a timeout.
const CONNECT_TIMEOUT: Duration = Duration::from_millis(100);

fn set_err(sh: &Shared, e: &str) {
    if let Ok(mut g) = sh.last_error.lock() {
        *g = e.to_string();
    }
}

/// The controller's own connection to node `i` (over TLS when configured).
fn server_client(
    sh: &Shared,
    i: usize,
    connect_timeout: Duration,
    timeout: Duration,
) -> Result<Client, crate::client::ClientError> {
    connect_server(sh, sh.cfg.nodes[i], connect_timeout, timeout)
}

fn connect_server(
    sh: &Shared,
    addr: SocketAddr,
    connect_timeout: Duration,
    timeout: Duration,
) -> Result<Client, crate::client::ClientError> {
    Client::dial(&crate::client::Dial {
        addr,
        user: &sh.cfg.user,
        password: &sh.cfg.password,
        database: "postgres",
        connect_timeout,
        timeout,
        tls: sh.tls_out.as_ref(),
    })
}

/// `SELECT 1` on `probe` (a fresh login when there is none), waiting up to `to` for each
/// answer; a failed probe's connection is dropped.
fn probe_once(
    probe: &mut Option<Client>,
    addr: SocketAddr,
    sh: &Shared,
    to: Duration,
) -> health::Probe {
    let t = Instant::now();
    let c = match probe {
        Some(c) => c,
        None => match connect_server(sh, addr, CONNECT_TIMEOUT, to) {
            Ok(c) => probe.insert(c),
            Err(e) => {
                dbg(&format!("probe login failed after {:?}: {e}", t.elapsed()));
                return health::classify(&e);
            }
        },
    };
    // A connection opened while the primary was suspect waits longer; back to `to`.
    c.set_timeout(to);
    match c.query("SELECT 1") {
        Ok(_) => health::Probe::Answered,
        Err(e) => {
            dbg(&format!("probe query failed after {:?}: {e}", t.elapsed()));
            *probe = None;
            health::classify(&e)
        }
    }
}

fn dbg(what: &str) {
    if std::env::var_os("PLIANT_PG_DEBUG").is_some() {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        eprintln!(
            "{}.{:03} pg-proxy: {what}",
            t.as_secs() % 1000,
            t.subsec_millis()
        );
    }
}

fn failover(sh: &Arc<Shared>, old: usize, t0: Instant) -> Result<(), String> {
    let new = 1 - old;
    dbg("primary declared dead");
    if let Some(ops) = &sh.ops {
        ops.fence(old);
    }
    dbg("fenced");
    sh.protected.store(false, SeqCst);
    // Sessions leave the old primary now.
    sh.epoch.fetch_add(1, SeqCst);
    let to = Duration::from_secs(10);
    let mut c = server_client(sh, new, to, to).map_err(|e| format!("standby: {e}"))?;
    // pg_promote(wait => true) polls only every 100 ms; poll faster ourselves.
    c.query("SELECT pg_promote(false)")
        .map_err(|e| format!("pg_promote: {e}"))?;
    let tp = Instant::now();
    while c
        .scalar("SELECT pg_is_in_recovery()")
        .map_err(|e| e.to_string())?
        .as_deref()
        != Some("f")
    {
        if tp.elapsed() > Duration::from_secs(10) {
            return Err("standby did not finish promotion within 10 s".into());
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    dbg("promotion finished");
    let horizon = c
        .scalar("SELECT pg_snapshot_xmax(pg_current_snapshot())")
        .map_err(|e| e.to_string())?
        .and_then(|s| s.parse::<u64>().ok())
        .ok_or("no xid horizon")?;
    sh.xid_horizon.store(horizon, SeqCst);
    dbg("promoted");
    sh.primary.store(new, SeqCst);
    sh.stats
        .last_detect_ms
        .store(t0.elapsed().as_millis() as u64, SeqCst);
    sh.ready_epoch.store(sh.epoch.load(SeqCst), SeqCst);
    sh.stats.failovers.fetch_add(1, SeqCst);
    sh.stats
        .last_failover_ms
        .store(t0.elapsed().as_millis() as u64, SeqCst);
    // Running alone until re-protection: commits must not wait for a standby that is gone.
    // A standby's configuration never names a synchronous standby (it is copied from a
    // primary before protection is switched on), so this is a safety net, run after the gate
    // opened (ALTER SYSTEM fsyncs, slow under load).
    c.query("ALTER SYSTEM SET synchronous_standby_names = ''")
        .map_err(|e| e.to_string())?;
    c.query("SELECT pg_reload_conf()")
        .map_err(|e| e.to_string())?;
    if sh.cfg.auto_reprotect {
        if let Some(ops) = sh.ops.clone() {
            let s = sh.clone();
            std::thread::spawn(move || match ops.reprotect(old, new) {
                Ok(()) => {
                    s.stats.reprotections.fetch_add(1, SeqCst);
                    s.protected.store(true, SeqCst);
                }
                Err(e) => {
                    s.stats.reprotect_failures.fetch_add(1, SeqCst);
                    set_err(&s, &format!("re-protection failed: {e}"));
                    if s.cfg.async_fallback_ms.is_some_and(|ms| ms > 0) {
                        // Hand it to the controller's standby restoration (retried).
                        s.degraded_since_ms.store(now_ms(), SeqCst);
                        s.degraded.store(true, SeqCst);
                    }
                }
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn md5_logins_need_the_right_user_and_hash() {
        let salt = [9, 8, 7, 6];
        let right = proto::md5_password("alice", "pw", &salt);
        let msg = |s: &str| {
            let mut b = s.as_bytes().to_vec();
            b.push(0);
            b
        };
        let ok = |user: &str, body: &[u8]| md5_login_ok("alice", "pw", user, body, &salt);
        assert!(ok("alice", &msg(&right)));
        // The hash a client would send for another user, sent as alice or as that user.
        assert!(!ok("alice", &msg(&proto::md5_password("bob", "pw", &salt))));
        assert!(!ok("bob", &msg(&proto::md5_password("bob", "pw", &salt))));
        assert!(!ok(
            "alice",
            &msg(&proto::md5_password("alice", "pw", &[0; 4]))
        ));
        assert!(!ok("alice", &msg(&right[..right.len() - 1])), "a prefix");
        assert!(!ok("alice", &msg(&format!("{right}0"))), "longer");
        assert!(!ok("alice", right.as_bytes()), "no terminator");
        assert!(!ok("alice", b"\0"), "empty");
    }

    fn config() -> ProxyConfig {
        let unused: SocketAddr = "127.0.0.1:9".parse().unwrap();
        ProxyConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            user: "u".into(),
            password: "pw".into(),
            nodes: [unused, unused],
            primary: 0,
            probe_interval_ms: 100,
            probe_timeout_ms: 250,
            probe_dead_after_ms: DEFAULT_PROBE_DEAD_AFTER_MS,
            max_sessions: 1,
            auto_reprotect: false,
            auth: AuthMethod::ScramSha256,
            async_fallback_ms: None,
            startup_timeout_ms: DEFAULT_STARTUP_TIMEOUT_MS,
            tls: None,
            server_tls: None,
            relay_threads: 1,
        }
    }

    #[test]
    fn the_proxy_does_not_start_without_a_random_salt() {
        let r = secrets::with_broken_random(|| Proxy::start(config(), false, None).map(|_| ()));
        let e = r.expect_err("started with a predictable SCRAM salt");
        assert!(e.contains("random source"), "{e}");
    }
}
