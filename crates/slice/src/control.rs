//! The control channel of an instance: an operator lists its sessions, reads its counters and
//! moves sessions to a peer instance (`pliant slice list | stats | migrate`).
//!
//! The channel is a pliant-wire session on its own endpoint (`Config::control`, unix path or
//! `host:port`): mutual authentication with CA-signed identities, sealed frames of kind
//! [`kinds::CONTROL`], the messages below postcard-encoded. Only a client proving the ADMIN or
//! CONTROLLER role gets past the handshake; any other is refused there, and told why
//! (`peer "x" holds roles 0x1, none of 0x6 this channel requires`). The client requires the
//! instance to prove the REPLICA role (and, when given, its name).
//!
//! ```text
//!   client                                  instance
//!   List                                ->  Sessions([id, client address])
//!   Stats                               ->  Stats(counters)
//!   Migrate(to, to_name, Ids | All)     ->  Error(unknown ids: nothing moved)
//!                                         | Moving(total), Outcome(moved | failed)..., Done
//! ```
//! Each connection is served on its own thread (at most [`MAX_CONNECTIONS`]), so a long
//! migration on one does not hold up a `List` on another. The sessions of a `Migrate` move one
//! at a time over one slice channel ([`crate::instance::Instance::migrate_each`]), each
//! answered as it ends; a client that goes away stops the migration after the session being
//! moved.

use crate::instance::{Inner, SessionApp};
use crate::migrate::{MigrateError, Moved};
use pliant_wire::endpoint::Stream;
use pliant_wire::server::{self, ConnThreads, ServerSocket, SpawnRefused, StartError};
use pliant_wire::{kinds, role, Conn, ConnError, Endpoint, Expect, FrameError, Security};
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::net::SocketAddr;
use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Connections served at once; more are closed at once (and counted).
pub const MAX_CONNECTIONS: usize = 8;
/// A client silent this long between two requests is cut off.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// Session ids one `Migrate` may name.
pub const MAX_IDS: usize = 100_000;
/// Bound on a request frame (a `Migrate` of [`MAX_IDS`] ids is at most ~1 MiB).
pub const MAX_REQUEST: usize = 2 << 20;
/// Bound on an answer frame (a `Sessions` list).
pub const MAX_ANSWER: usize = 64 << 20;
/// How long a client waits for one answer frame: one session's move (connect, handshake,
/// restore retries) ends well within it.
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(30);
/// The roles a control client must hold one of.
pub const CLIENT_ROLES: u32 = role::ADMIN | role::CONTROLLER;

/// What a client asks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Request {
    List,
    Stats,
    /// Moves sessions to the instance `to_name` whose slice channel (its `--peer`) is `to`.
    Migrate {
        to: Endpoint,
        to_name: String,
        sessions: Which,
    },
}

impl Request {
    /// What a log line says of the request (not every id of a long `Migrate`).
    pub fn summary(&self) -> String {
        match self {
            Request::List => "list".into(),
            Request::Stats => "stats".into(),
            Request::Migrate {
                to,
                to_name,
                sessions,
            } => match sessions {
                Which::All => format!("migrate all to {to_name} at {to}"),
                Which::Ids(ids) => format!("migrate {} sessions to {to_name} at {to}", ids.len()),
            },
        }
    }
}

/// The sessions of a `Migrate`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Which {
    /// These; if any is not on the instance, nothing moves.
    Ids(Vec<u64>),
    /// Every session on the instance when the request arrives.
    All,
}

/// One session of a `List`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionInfo {
    pub id: u64,
    /// The client's address (the connection's remote end), if the socket still knew it.
    pub client: Option<SocketAddr>,
}

/// An instance's counters (`Stats`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatsReport {
    pub name: String,
    /// Sessions served now.
    pub sessions: u64,
    pub accepted: u64,
    pub moved_out: u64,
    pub moved_in: u64,
    pub refused_peers: u64,
    pub aborted_handshakes: u64,
    pub refused_capsules: u64,
    pub session_errors: u64,
    /// Control clients refused at the handshake (no ADMIN or CONTROLLER role, another CA...).
    pub refused_controls: u64,
    /// `queue` or `drop` (see [`crate::hold`]).
    pub hold: String,
}

/// How one session's move ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    Moved {
        id: u64,
        /// Freeze request to the destination serving it (see [`crate::migrate::Moved`]).
        pause_us: u64,
        capsule_bytes: u64,
    },
    /// The session is not on the destination; `reason` says where it is (resumed or restored
    /// at the source, or lost).
    Failed { id: u64, reason: String },
}

impl Outcome {
    /// The outcome of [`crate::instance::Instance::migrate`] for session `id`.
    pub fn of(id: u64, r: Result<Moved, MigrateError>) -> Outcome {
        match r {
            Ok(m) => Outcome::Moved {
                id,
                pause_us: m.pause.as_micros() as u64,
                capsule_bytes: m.capsule_bytes as u64,
            },
            Err(e) => Outcome::Failed {
                id,
                reason: e.to_string(),
            },
        }
    }

    pub fn id(&self) -> u64 {
        match self {
            Outcome::Moved { id, .. } | Outcome::Failed { id, .. } => *id,
        }
    }
}

/// `moved ID pause_us=N capsule=BYTES` or `failed ID REASON` (ids in hex).
impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Outcome::Moved {
                id,
                pause_us,
                capsule_bytes,
            } => write!(
                f,
                "moved {id:x} pause_us={pause_us} capsule={capsule_bytes}"
            ),
            Outcome::Failed { id, reason } => write!(f, "failed {id:x} {reason}"),
        }
    }
}

/// What the instance answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Reply {
    Sessions(Vec<SessionInfo>),
    Stats(StatsReport),
    /// A `Migrate` starts: this many sessions, each answered by an `Outcome`, then `Done`.
    Moving {
        total: u64,
    },
    Outcome(Outcome),
    Done,
    /// The request was refused (nothing was done).
    Error(String),
}

/// What the channel asks of the instance; [`Inner`] is the real one, the tests have others.
pub(crate) trait Service: Send + Sync + 'static {
    fn sessions(&self) -> Vec<SessionInfo>;
    fn stats(&self) -> StatsReport;
    /// Moves `ids` one at a time (see [`crate::instance::Instance::migrate_each`]).
    fn migrate_each(self: &Arc<Self>, ids: &[u64], to: &Endpoint, name: &str, each: Each);
}

/// Gets each session's outcome as its move ends; `false` stops the migration there.
pub(crate) type Each<'a> = &'a mut dyn FnMut(Outcome) -> bool;

impl<A: SessionApp> Service for Inner<A> {
    fn sessions(&self) -> Vec<SessionInfo> {
        self.sessions_with_clients()
            .into_iter()
            .map(|(id, client)| SessionInfo { id, client })
            .collect()
    }

    fn stats(&self) -> StatsReport {
        let s = &self.stats;
        let n = |c: &AtomicU64| c.load(Ordering::Relaxed);
        StatsReport {
            name: self.name.clone(),
            sessions: self.sessions_with_clients().len() as u64,
            accepted: n(&s.accepted),
            moved_out: n(&s.moved_out),
            moved_in: n(&s.moved_in),
            refused_peers: n(&s.refused_peers),
            aborted_handshakes: n(&s.aborted_handshakes),
            refused_capsules: n(&s.refused_capsules),
            session_errors: n(&s.session_errors),
            refused_controls: n(&self.control.refused),
            hold: self.hold.mode().as_str().into(),
        }
    }

    fn migrate_each(self: &Arc<Self>, ids: &[u64], to: &Endpoint, name: &str, each: Each) {
        crate::migrate::migrate_each(self, ids, to, name, |id, r| each(Outcome::of(id, r)))
    }
}

/// The running control listener; dropping it stops accepting, shuts the open connections down
/// and joins their threads.
pub(crate) struct ControlServer {
    socket: ServerSocket,
    conns: Arc<ConnThreads>,
    stopping: Arc<AtomicBool>,
}

/// What the listener counts besides what it serves.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) refused: AtomicU64,
    pub(crate) aborted: AtomicU64,
}

impl ControlServer {
    /// Listens on `ep`, serving `service`; counts in `counters`.
    pub(crate) fn start<S: Service>(
        ep: &Endpoint,
        security: Security,
        service: Arc<S>,
        counters: Arc<Counters>,
    ) -> Result<ControlServer, StartError> {
        let conns = Arc::new(ConnThreads::default());
        let stopping = Arc::new(AtomicBool::new(false));
        let (cs, st) = (conns.clone(), stopping.clone());
        let tcp = security.tcp;
        let security = Arc::new(security);
        let socket = ServerSocket::start(ep, &tcp, "slice-control", move |l, stop| {
            server::accept_until_stopped(&l, &stop, &st, "slice control", |s| {
                let (sv, sec, cn) = (service.clone(), security.clone(), counters.clone());
                let serve = move |s| serve_conn(&sv, &sec, s, &cn);
                match cs.spawn(s, MAX_CONNECTIONS, "slice-control-conn", serve) {
                    Ok(()) => {}
                    Err(SpawnRefused::OverBound(s)) => {
                        tracing::warn!(
                            "slice control: {MAX_CONNECTIONS} connections open, one refused"
                        );
                        drop(s);
                    }
                    Err(SpawnRefused::Clone(e) | SpawnRefused::Thread(e)) => {
                        tracing::warn!(error = %e, "slice control connection refused");
                    }
                }
                ControlFlow::Continue(())
            })
        })?;
        Ok(ControlServer {
            socket,
            conns,
            stopping,
        })
    }

    pub(crate) fn endpoint(&self) -> &Endpoint {
        self.socket.endpoint()
    }
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        self.stopping.store(true, Ordering::SeqCst);
        self.socket.stop_accepting();
        self.conns.shutdown_and_join();
    }
}

fn serve_conn<S: Service>(service: &Arc<S>, sec: &Security, s: Stream, counters: &Counters) {
    let expect = Expect {
        name: None,
        roles: CLIENT_ROLES,
    };
    let opts = sec.options_for(!s.is_unix(), expect, MAX_REQUEST);
    let mut conn = match Conn::server(s, &sec.identity, &opts) {
        Ok(c) => c,
        Err(e) => {
            server::count_handshake_failure(
                &e,
                &counters.refused,
                &counters.aborted,
                "slice control",
            );
            return;
        }
    };
    let st = conn.reader.stream();
    let _ = st.set_read_timeout(Some(IDLE_TIMEOUT));
    let _ = st.set_write_timeout(Some(IDLE_TIMEOUT));
    let client = conn.peer.name.clone();
    loop {
        let req = match conn.recv::<Request>() {
            Ok((kinds::CONTROL, r)) => r,
            Ok((kind, _)) => {
                let _ = reply(&mut conn, &Reply::Error(format!("frame of kind {kind:#x}")));
                return;
            }
            Err(FrameError::Decode(e)) => {
                // Another build's request (or garbage): say so, then hang up.
                let _ = reply(
                    &mut conn,
                    &Reply::Error(format!("undecodable request: {e}")),
                );
                return;
            }
            Err(_) => return,
        };
        tracing::info!(%client, request = %req.summary(), "slice control request");
        if answer(service, &mut conn, req).is_err() {
            return;
        }
    }
}

fn reply(conn: &mut Conn, r: &Reply) -> Result<(), FrameError> {
    conn.send(kinds::CONTROL, r)
}

/// Answers one request; `Err`: the connection broke.
fn answer<S: Service>(service: &Arc<S>, conn: &mut Conn, req: Request) -> Result<(), FrameError> {
    match req {
        Request::List => reply(conn, &Reply::Sessions(service.sessions())),
        Request::Stats => reply(conn, &Reply::Stats(service.stats())),
        Request::Migrate {
            to,
            to_name,
            sessions,
        } => {
            let ids = match targets(&**service, sessions) {
                Ok(ids) => ids,
                Err(e) => return reply(conn, &Reply::Error(e)),
            };
            reply(
                conn,
                &Reply::Moving {
                    total: ids.len() as u64,
                },
            )?;
            let mut sent = Ok(());
            service.migrate_each(&ids, &to, &to_name, &mut |o| {
                sent = reply(conn, &Reply::Outcome(o));
                sent.is_ok()
            });
            sent?;
            reply(conn, &Reply::Done)
        }
    }
}

/// The sessions a `Migrate` moves, in order, each once; an error naming every id that is not
/// on the instance (then nothing moves).
fn targets<S: Service>(service: &S, which: Which) -> Result<Vec<u64>, String> {
    let here: Vec<u64> = service.sessions().iter().map(|s| s.id).collect();
    let Which::Ids(ids) = which else {
        return Ok(here);
    };
    if ids.len() > MAX_IDS {
        return Err(format!(
            "{} session ids in one request, at most {MAX_IDS}",
            ids.len()
        ));
    }
    let here: HashSet<u64> = here.into_iter().collect();
    let unknown: Vec<String> = ids
        .iter()
        .filter(|id| !here.contains(id))
        .map(|id| format!("{id:x}"))
        .collect();
    if !unknown.is_empty() {
        return Err(format!(
            "no session {} on this instance; nothing was moved",
            unknown.join(", ")
        ));
    }
    let mut seen = HashSet::new();
    Ok(ids.into_iter().filter(|id| seen.insert(*id)).collect())
}

/// Why a client call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error(
        "instance {ep} refused this identity: {why} (the control channel takes identities with \
         the admin or controller role: `pliant keys issue --role admin`)"
    )]
    Forbidden { ep: Endpoint, why: String },
    #[error("cannot reach the instance's control channel: {0}")]
    Connect(ConnError),
    #[error(
        "the instance's control channel failed the handshake (is it an instance of this \
         identity's CA, and the one named?): {0}"
    )]
    Handshake(ConnError),
    #[error("control channel to {ep}: {source}")]
    Channel { ep: Endpoint, source: FrameError },
    #[error("instance {ep}: {msg}")]
    Refused { ep: Endpoint, msg: String },
    #[error("instance {ep} answered {got}, expected {want}")]
    Unexpected {
        ep: Endpoint,
        got: String,
        want: &'static str,
    },
}

/// A connection to an instance's control channel.
pub struct Client {
    ep: Endpoint,
    conn: Conn,
}

impl Client {
    /// Connects to `ep` and authenticates both ways: this side with `sec` (ADMIN or
    /// CONTROLLER role), the instance with the REPLICA role and, if given, the name `name`.
    pub fn connect(
        ep: &Endpoint,
        sec: &Security,
        name: Option<&str>,
        timeout: Duration,
    ) -> Result<Client, ClientError> {
        let expect = Expect {
            name: name.map(str::to_string),
            roles: role::REPLICA,
        };
        let mut o = sec.options(ep, expect, MAX_ANSWER);
        o.handshake_timeout = o.handshake_timeout.min(timeout);
        let conn =
            Conn::connect(ep, &sec.identity, &o, timeout, &sec.tcp).map_err(|e| match e {
                ConnError::Handshake {
                    ep,
                    source: pliant_wire::SessionError::Refused(why),
                } => ClientError::Forbidden { ep, why },
                e @ ConnError::Handshake { .. } => ClientError::Handshake(e),
                e => ClientError::Connect(e),
            })?;
        let st = conn.reader.stream();
        st.set_read_timeout(Some(ANSWER_TIMEOUT))
            .and_then(|_| st.set_write_timeout(Some(ANSWER_TIMEOUT)))
            .map_err(|e| ClientError::Channel {
                ep: ep.clone(),
                source: FrameError::Io(e),
            })?;
        Ok(Client {
            ep: ep.clone(),
            conn,
        })
    }

    fn send(&mut self, r: &Request) -> Result<(), ClientError> {
        self.conn
            .send(kinds::CONTROL, r)
            .map_err(|source| ClientError::Channel {
                ep: self.ep.clone(),
                source,
            })
    }

    fn recv(&mut self) -> Result<Reply, ClientError> {
        let ep = &self.ep;
        match self.conn.recv::<Reply>() {
            Ok((kinds::CONTROL, Reply::Error(msg))) => Err(ClientError::Refused {
                ep: ep.clone(),
                msg,
            }),
            Ok((kinds::CONTROL, r)) => Ok(r),
            Ok((kind, _)) => Err(ClientError::Channel {
                ep: ep.clone(),
                source: FrameError::UnexpectedKind(kind),
            }),
            Err(source) => Err(ClientError::Channel {
                ep: ep.clone(),
                source,
            }),
        }
    }

    fn unexpected(&self, got: &Reply, want: &'static str) -> ClientError {
        ClientError::Unexpected {
            ep: self.ep.clone(),
            got: format!("{got:?}").chars().take(200).collect(),
            want,
        }
    }

    /// The instance's sessions, by id.
    pub fn list(&mut self) -> Result<Vec<SessionInfo>, ClientError> {
        self.send(&Request::List)?;
        match self.recv()? {
            Reply::Sessions(v) => Ok(v),
            r => Err(self.unexpected(&r, "Sessions")),
        }
    }

    pub fn stats(&mut self) -> Result<StatsReport, ClientError> {
        self.send(&Request::Stats)?;
        match self.recv()? {
            Reply::Stats(s) => Ok(s),
            r => Err(self.unexpected(&r, "Stats")),
        }
    }

    /// Moves `which` to the instance `to_name` at `to`; `each(outcome, total)` sees every
    /// session's outcome as it arrives. Returns them all, in order.
    pub fn migrate(
        &mut self,
        to: &Endpoint,
        to_name: &str,
        which: Which,
        mut each: impl FnMut(&Outcome, u64),
    ) -> Result<Vec<Outcome>, ClientError> {
        self.send(&Request::Migrate {
            to: to.clone(),
            to_name: to_name.into(),
            sessions: which,
        })?;
        let total = match self.recv()? {
            Reply::Moving { total } => total,
            r => return Err(self.unexpected(&r, "Moving")),
        };
        let mut all = Vec::with_capacity(total.min(MAX_IDS as u64) as usize);
        loop {
            match self.recv()? {
                Reply::Outcome(o) => {
                    each(&o, total);
                    all.push(o);
                }
                Reply::Done => return Ok(all),
                r => return Err(self.unexpected(&r, "Outcome or Done")),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pliant_wire::frame::{decode_body, encode_body};
    use pliant_wire::Ca;
    use std::sync::{Condvar, Mutex};

    fn round_trip<T>(m: &T) -> T
    where
        T: Serialize + for<'de> Deserialize<'de>,
    {
        decode_body(&encode_body(m, Vec::new()).unwrap()).unwrap()
    }

    #[test]
    fn messages_round_trip_and_garbage_is_an_error() {
        let reqs = [
            Request::List,
            Request::Stats,
            Request::Migrate {
                to: Endpoint::Tcp("127.0.0.1:7100".into()),
                to_name: "demo-b".into(),
                sessions: Which::Ids(vec![1, u64::MAX]),
            },
            Request::Migrate {
                to: Endpoint::Unix("/run/b.sock".into()),
                to_name: "b".into(),
                sessions: Which::All,
            },
        ];
        for r in &reqs {
            assert_eq!(&round_trip(r), r);
        }
        let replies = [
            Reply::Sessions(vec![
                SessionInfo {
                    id: 7,
                    client: Some("127.0.0.1:5000".parse().unwrap()),
                },
                SessionInfo {
                    id: 8,
                    client: Some("[::1]:5001".parse().unwrap()),
                },
                SessionInfo {
                    id: 9,
                    client: None,
                },
            ]),
            Reply::Stats(StatsReport {
                name: "a".into(),
                sessions: 3,
                hold: "queue".into(),
                ..StatsReport::default()
            }),
            Reply::Moving { total: 2 },
            Reply::Outcome(Outcome::Moved {
                id: 7,
                pause_us: 1500,
                capsule_bytes: 300,
            }),
            Reply::Outcome(Outcome::Failed {
                id: 8,
                reason: "why".into(),
            }),
            Reply::Done,
            Reply::Error("no".into()),
        ];
        for r in &replies {
            assert_eq!(&round_trip(r), r);
        }
        // An unknown variant or a truncated body is refused, not misread.
        assert!(decode_body::<Request>(&[9]).is_err());
        let m = encode_body(&reqs[2], Vec::new()).unwrap();
        assert!(decode_body::<Request>(&m[..m.len() - 1]).is_err());
    }

    /// Sessions 1..=3; a move is recorded. A gated fake's moves wait for the gate to open.
    struct Fake {
        gate: Option<(Mutex<bool>, Condvar)>,
        /// A migration has started.
        moving: AtomicBool,
        moved: Mutex<Vec<u64>>,
        counters: Arc<Counters>,
    }

    impl Fake {
        fn open(&self) {
            if let Some((m, cv)) = &self.gate {
                *m.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = true;
                cv.notify_all();
            }
        }
    }

    /// Opens the gate when dropped: a failing test must not leave a move waiting at it (the
    /// server's drop joins its connection threads).
    struct OpenOnDrop(Arc<Fake>);

    impl Drop for OpenOnDrop {
        fn drop(&mut self) {
            self.0.open();
        }
    }

    impl Service for Fake {
        fn sessions(&self) -> Vec<SessionInfo> {
            let moved = self.moved.lock().unwrap().clone();
            (1..=3)
                .filter(|id| !moved.contains(id))
                .map(|id| SessionInfo {
                    id,
                    client: Some(SocketAddr::from(([127, 0, 0, 1], 4000 + id as u16))),
                })
                .collect()
        }
        fn stats(&self) -> StatsReport {
            StatsReport {
                name: "fake".into(),
                sessions: self.sessions().len() as u64,
                refused_controls: self.counters.refused.load(Ordering::Relaxed),
                ..StatsReport::default()
            }
        }
        fn migrate_each(self: &Arc<Self>, ids: &[u64], _: &Endpoint, name: &str, each: Each) {
            self.moving.store(true, Ordering::SeqCst);
            if let Some((m, cv)) = &self.gate {
                let _open = cv.wait_while(m.lock().unwrap(), |open| !*open).unwrap();
            }
            for &id in ids {
                let o = if name != "b" {
                    Outcome::Failed {
                        id,
                        reason: format!("no instance {name}"),
                    }
                } else {
                    self.moved.lock().unwrap().push(id);
                    Outcome::Moved {
                        id,
                        pause_us: 10,
                        capsule_bytes: 100,
                    }
                };
                if !each(o) {
                    return;
                }
            }
        }
    }

    fn serve(gated: bool) -> (Ca, Arc<Fake>, ControlServer) {
        let ca = Ca::generate(None).unwrap();
        let sec = Security::new(ca.issue("inst-a", role::REPLICA, 600).unwrap());
        let fake = Arc::new(Fake {
            gate: gated.then(|| (Mutex::new(false), Condvar::new())),
            moving: AtomicBool::new(false),
            moved: Mutex::new(Vec::new()),
            counters: Arc::default(),
        });
        let srv = ControlServer::start(
            &Endpoint::Tcp("127.0.0.1:0".into()),
            sec,
            fake.clone(),
            fake.counters.clone(),
        )
        .unwrap();
        (ca, fake, srv)
    }

    fn client(ca: &Ca, name: &str, roles: u32, srv: &ControlServer) -> Result<Client, ClientError> {
        let sec = Security::new(ca.issue(name, roles, 600).unwrap());
        Client::connect(srv.endpoint(), &sec, None, Duration::from_secs(5))
    }

    #[test]
    fn only_admin_or_controller_identities_of_the_ca_get_in() {
        let (ca, fake, srv) = serve(false);
        for r in [role::ADMIN, role::CONTROLLER, role::ADMIN | role::REPLICA] {
            let mut c = client(&ca, "op", r, &srv).unwrap();
            assert_eq!(c.list().unwrap().len(), 3);
        }
        for r in [role::REPLICA, role::AGENT, role::SERVICE] {
            let e = client(&ca, "intruder", r, &srv).err().expect("refused");
            let msg = e.to_string();
            assert!(matches!(e, ClientError::Forbidden { .. }), "{msg}");
            assert!(msg.contains("intruder") && msg.contains("role"), "{msg}");
        }
        let other = Ca::generate(None).unwrap();
        let e = client(&other, "op", role::ADMIN, &srv)
            .err()
            .expect("refused");
        assert!(matches!(e, ClientError::Handshake(_)), "{e}");
        // The three role refusals are counted (the server counts after telling the client, so
        // wait for it); the other CA's client gives up on the instance's certificate first.
        let t = std::time::Instant::now();
        while fake.counters.refused.load(Ordering::Relaxed) < 3 {
            assert!(t.elapsed() < Duration::from_secs(5), "refusals not counted");
            std::thread::sleep(Duration::from_millis(5));
        }
        // The client insists on the instance's name when given one.
        let sec = Security::new(ca.issue("op", role::ADMIN, 600).unwrap());
        let e = Client::connect(srv.endpoint(), &sec, Some("inst-z"), Duration::from_secs(5));
        let e = e.err().expect("another instance");
        assert!(
            matches!(e, ClientError::Handshake(_)) && e.to_string().contains("inst-z"),
            "{e}"
        );
        assert!(
            Client::connect(srv.endpoint(), &sec, Some("inst-a"), Duration::from_secs(5)).is_ok()
        );
    }

    #[test]
    fn an_unknown_id_moves_nothing_and_a_long_move_does_not_block_a_list() {
        let (ca, fake, srv) = serve(true);
        let _open = OpenOnDrop(fake.clone());
        let mut c = client(&ca, "op", role::ADMIN, &srv).unwrap();
        let to = Endpoint::Tcp("127.0.0.1:1".into());
        let e = c
            .migrate(&to, "b", Which::Ids(vec![2, 0xdead, 3, 0xbeef]), |_, _| {})
            .expect_err("refused");
        let msg = e.to_string();
        assert!(
            msg.contains("dead, beef") && msg.contains("nothing"),
            "{msg}"
        );
        assert!(fake.moved.lock().unwrap().is_empty());
        // The connection is still usable after a refused request.
        assert_eq!(c.list().unwrap().len(), 3);

        let mover = {
            let (ep, to) = (srv.endpoint().clone(), to.clone());
            let sec = Security::new(ca.issue("op2", role::CONTROLLER, 600).unwrap());
            std::thread::spawn(move || {
                let mut c = Client::connect(&ep, &sec, None, Duration::from_secs(5)).unwrap();
                let mut seen = Vec::new();
                let all = c
                    .migrate(&to, "b", Which::All, |o, total| seen.push((o.id(), total)))
                    .unwrap();
                (all, seen)
            })
        };
        let t = std::time::Instant::now();
        while !fake.moving.load(Ordering::SeqCst) {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "the migration started"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
        // The migration is held at its gate: a list and stats on another connection are
        // answered meanwhile (a blocked one would fail after ANSWER_TIMEOUT).
        assert_eq!(c.list().unwrap().len(), 3);
        assert_eq!(c.stats().unwrap().name, "fake");
        fake.open();
        let (all, seen) = mover.join().unwrap();
        assert_eq!(seen, vec![(1, 3), (2, 3), (3, 3)]);
        assert!(all.iter().all(|o| matches!(o, Outcome::Moved { .. })));
        assert!(c.list().unwrap().is_empty());
        // A failed move is an outcome, not an error of the request.
        let (ca2, fake2, srv2) = serve(false);
        let mut c2 = client(&ca2, "op", role::ADMIN, &srv2).unwrap();
        let out = c2
            .migrate(&to, "x", Which::Ids(vec![1, 1]), |_, _| {})
            .unwrap();
        assert_eq!(
            out,
            vec![Outcome::Failed {
                id: 1,
                reason: "no instance x".into()
            }]
        );
        assert!(fake2.moved.lock().unwrap().is_empty());
    }
}
