//! The control channel (and optional HTTP metrics listener), served from their own threads.
//!
//! The packet thread owns all state, so these threads never touch it: they turn each request
//! into a [`Request`] on a bounded channel, poke the packet thread awake through a socket pair
//! it polls, and wait (bounded) for the answer. No locks on the hot path.
//!
//! Each control connection is served on its own thread (at most [`MAX_CONNECTIONS`] at once;
//! beyond that a local connection gets one error answer and a sealed one is closed, both
//! counted in `control_conns_refused`): a `migrate_out` or `ftmb_activate` may take seconds
//! to answer, and the controller's `stats` heartbeat on another connection must not wait
//! behind it. The packet thread never waits for those either: it answers them later on the
//! request's reply channel.
//!
//! Protocol: pliant-proto's typed requests and answers, one per pliant-wire frame, on the
//! replica's unix socket and, if configured, a TCP endpoint. A replica with a `[security]`
//! identity runs the wire handshake on both and serves only clients certified with the
//! CONTROLLER or ADMIN role; without one, only the unix socket is served, to peers of the
//! replica's own uid (SO_PEERCRED), with plain frames (see `pliant_proto::link`). Bodies are
//! bounded ([`MAX_REQUEST`]); anything malformed gets an error and is counted, never a crash.

use pliant_proto::link::{Link, MAX_REQUEST};
use pliant_wire::server::ServerSocket;
use pliant_wire::{role, Endpoint, Expect, Security, Stream};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::TcpListener;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::Duration;

/// The control protocol's requests (one definition, in pliant-proto, for both ends).
pub use pliant_proto::Request as Cmd;

/// Requests queued for the packet thread at most (beyond: refused at once and counted in
/// `control_errors`; requests whose client gave up waiting stay queued until served).
pub(crate) const CHANNEL_BOUND: usize = 16;
/// Control connections served at once. Each holds a thread while it waits for its answer or its
/// next request (a silent client at most [`IO_TIMEOUT`]); the controller needs a handful
/// (heartbeat, one operation, HA polls), so this leaves room for CLI use without unbounded
/// threads.
pub const MAX_CONNECTIONS: usize = 16;
/// Scrapes served at once on the HTTP metrics listener (more get 503 at once and are counted
/// in `control_errors`).
pub const MAX_METRICS_CONNECTIONS: usize = 4;
/// How long a client may take to send a request, and we wait for the packet thread.
const IO_TIMEOUT: Duration = Duration::from_secs(3);
/// How long `ftmb_protect`/`ftmb_activate` may take (connects, barriers, replay: each bounded
/// on its own, this is their sum with margin).
pub const FTMB_WAIT: Duration = Duration::from_secs(20);

/// Where and how the control channel is served.
#[derive(Clone, Debug, Default)]
pub struct ControlOptions {
    /// The unix socket (always served).
    pub socket: String,
    /// A TCP `host:port` as well (needs `security`).
    pub listen: Option<String>,
    /// The HTTP metrics listener.
    pub metrics_listen: Option<String>,
    /// The replica's identity: with it, every control connection runs the handshake.
    pub security: Option<Security>,
}

/// A request for the packet thread; it answers on `reply`.
pub struct Request {
    pub cmd: Cmd,
    pub reply: SyncSender<Value>,
}

/// The packet thread's end.
pub struct ControlHandle {
    pub requests: Receiver<Request>,
    /// Readable when a request was queued; the packet thread polls it and drains it.
    wake_rx: UnixStream,
    /// Malformed/refused requests counted by the serving threads.
    pub errors: Arc<AtomicU64>,
    /// Connections refused because [`MAX_CONNECTIONS`] were being served (also in `errors`).
    pub conns_refused: Arc<AtomicU64>,
    /// Sealed connections that went away, stalled or spoke garbage before their handshake
    /// finished (a liveness probe connects and closes at once): not refusals, not errors.
    pub handshakes_aborted: Arc<AtomicU64>,
    /// The controller leadership fence (highest term seen, refusals).
    pub fence: Arc<TermFence>,
}

pub use pliant_proto::fence::TermFence;

impl ControlHandle {
    pub fn wake_fd(&self) -> RawFd {
        self.wake_rx.as_raw_fd()
    }

    /// Empties the wake-up socket (non-blocking).
    pub fn drain_wake(&self) {
        let mut buf = [0u8; 64];
        while matches!((&self.wake_rx).read(&mut buf), Ok(n) if n > 0) {}
    }
}

/// The serving side: the listeners (a unix socket file is removed with its listener) and the
/// stop flag of the serving threads.
pub struct ControlServer {
    stop: Arc<AtomicBool>,
    sockets: Vec<ServerSocket>,
    /// Bound address of the HTTP metrics listener (resolves a `:0` port).
    pub metrics_addr: Option<std::net::SocketAddr>,
}

impl ControlServer {
    /// The TCP control endpoint actually bound (a `:0` port resolved), if one is served.
    pub fn tcp_endpoint(&self) -> Option<&Endpoint> {
        self.sockets
            .iter()
            .map(ServerSocket::endpoint)
            .find(|e| e.is_tcp())
    }
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for s in &mut self.sockets {
            s.stop_accepting();
        }
    }
}

/// The serving threads' end of the request queue.
#[derive(Clone)]
pub(crate) struct Shared {
    tx: SyncSender<Request>,
    wake_tx: Arc<UnixStream>,
    errors: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    /// Connections being served now.
    active: Arc<AtomicUsize>,
    conns_refused: Arc<AtomicU64>,
    handshakes_aborted: Arc<AtomicU64>,
    fence: Arc<TermFence>,
    /// The replica's identity (sealed mode), if it has one.
    security: Option<Arc<Security>>,
}

/// One of the [`MAX_CONNECTIONS`] serving slots, given back when the connection's thread ends
/// (however it ends).
struct Slot(Arc<AtomicUsize>);

impl Slot {
    fn claim(active: &Arc<AtomicUsize>) -> Option<Slot> {
        Slot::claim_of(active, MAX_CONNECTIONS)
    }

    fn claim_of(active: &Arc<AtomicUsize>, max: usize) -> Option<Slot> {
        active
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()
            .map(|_| Slot(Arc::clone(active)))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Shared {
    /// Queues `cmd` for the packet thread and wakes it; the answer arrives on the returned
    /// receiver. A full queue or a stopped packet thread is an error answer (counted).
    pub(crate) fn enqueue(&self, cmd: Cmd) -> Result<Receiver<Value>, Value> {
        let (rtx, rrx) = mpsc::sync_channel(1);
        match self.tx.try_send(Request { cmd, reply: rtx }) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                return Err(self.error("replica busy: too many pending requests"))
            }
            Err(TrySendError::Disconnected(_)) => {
                return Err(self.error("replica is shutting down"))
            }
        }
        let _ = (&*self.wake_tx).write(&[1]);
        Ok(rrx)
    }

    /// Hands `cmd` to the packet thread and waits (bounded) for its answer.
    pub(crate) fn ask(&self, cmd: Cmd) -> Value {
        let migrating = matches!(cmd, Cmd::MigrateOut { .. } | Cmd::PeerConnect { .. });
        // FTMB protect (connect + full snapshot) and activate (replay) answer when done.
        let ftmb_slow = matches!(cmd, Cmd::FtmbProtect { .. } | Cmd::FtmbActivate { .. });
        let rrx = match self.enqueue(cmd) {
            Ok(rrx) => rrx,
            Err(refused) => return refused,
        };
        // A migration answers only after the destination's Ack (bounded by BUSY_WAIT +
        // ACK_WAIT on the packet thread).
        let wait = if migrating {
            crate::migrate::BUSY_WAIT + crate::migrate::ACK_WAIT + Duration::from_secs(2)
        } else if ftmb_slow {
            FTMB_WAIT
        } else {
            IO_TIMEOUT
        };
        rrx.recv_timeout(wait)
            .unwrap_or_else(|_| self.error("the packet thread did not answer in time"))
    }

    fn error(&self, msg: &str) -> Value {
        self.errors.fetch_add(1, Ordering::Relaxed);
        json!({"ok": false, "error": msg})
    }
}

/// Starts the control channel (and the HTTP metrics listener if asked).
pub fn start(o: &ControlOptions) -> Result<(ControlServer, ControlHandle), String> {
    if o.listen.is_some() && o.security.is_none() {
        return Err(format!(
            "control listen {}: a TCP control endpoint needs a [security] identity",
            o.listen.as_deref().unwrap_or_default()
        ));
    }
    if let Some(dir) = std::path::Path::new(&o.socket).parent() {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("control socket dir {}: {e}", dir.display()))?;
    }
    let (mut shared, handle) = channel()?;
    shared.security = o.security.clone().map(Arc::new);
    let stop = shared.stop.clone();

    let mut metrics_addr = None;
    if let Some(addr) = &o.metrics_listen {
        let l = TcpListener::bind(addr).map_err(|e| format!("metrics_listen {addr}: bind: {e}"))?;
        metrics_addr = l.local_addr().ok();
        let sh = shared.clone();
        std::thread::Builder::new()
            .name("pliant-metrics".into())
            .spawn(move || serve_http(l, sh))
            .map_err(|e| format!("spawn metrics thread: {e}"))?;
    }
    let mut eps = vec![Endpoint::Unix(o.socket.clone().into())];
    if let Some(l) = &o.listen {
        eps.push(
            l.parse::<Endpoint>()
                .map_err(|e| format!("control listen {l:?}: {e}"))?,
        );
    }
    let tcp = o.security.as_ref().map(|s| s.tcp).unwrap_or_default();
    let mut sockets = Vec::new();
    for ep in eps {
        let sh = shared.clone();
        let s = ServerSocket::start(&ep, &tcp, "pliant-control", move |l, stop| {
            // The controller's TCP probes (reset before sending a byte) then never wake
            // this thread; every client sends its request or handshake first.
            if let Err(e) = l.defer_accept_until_data(IO_TIMEOUT) {
                tracing::warn!(error = %e, "control listener: TCP_DEFER_ACCEPT");
            }
            pliant_wire::server::accept_until_stopped(
                &l,
                &stop,
                &sh.stop.clone(),
                "control",
                |stream| {
                    accept_one(stream, &sh);
                    std::ops::ControlFlow::Continue(())
                },
            )
        })
        .map_err(|e| format!("control {ep}: {e}"))?;
        sockets.push(s);
    }
    Ok((
        ControlServer {
            stop,
            sockets,
            metrics_addr,
        },
        handle,
    ))
}

/// The bounded request queue and wake-up pair between the serving threads and the packet
/// thread (tests drive the serving end directly).
pub(crate) fn channel() -> Result<(Shared, ControlHandle), String> {
    let (tx, rx) = mpsc::sync_channel(CHANNEL_BOUND);
    let (wake_tx, wake_rx) = UnixStream::pair().map_err(|e| format!("socketpair: {e}"))?;
    wake_rx
        .set_nonblocking(true)
        .map_err(|e| format!("socketpair: {e}"))?;
    wake_tx
        .set_nonblocking(true)
        .map_err(|e| format!("socketpair: {e}"))?;
    let errors = Arc::new(AtomicU64::new(0));
    let conns_refused = Arc::new(AtomicU64::new(0));
    let handshakes_aborted = Arc::new(AtomicU64::new(0));
    let fence = Arc::new(TermFence::default());
    let shared = Shared {
        tx,
        wake_tx: Arc::new(wake_tx),
        errors: errors.clone(),
        stop: Arc::new(AtomicBool::new(false)),
        active: Arc::new(AtomicUsize::new(0)),
        conns_refused: conns_refused.clone(),
        handshakes_aborted: handshakes_aborted.clone(),
        fence: fence.clone(),
        security: None,
    };
    let handle = ControlHandle {
        requests: rx,
        wake_rx,
        errors,
        conns_refused,
        handshakes_aborted,
        fence,
    };
    Ok((shared, handle))
}

/// One accepted connection: the uid fence of a unix peer, a serving slot, a thread.
fn accept_one(stream: Stream, sh: &Shared) {
    // A liveness probe (the controller's connect-and-close, up to a hundred a second per
    // replica) is told from a client before a thread is started for it: the probe gave
    // its answer when the connection was accepted, and a thread each cost the packet loop
    // CPU on a loaded host.
    if stream.closed_before_sending() {
        sh.handshakes_aborted.fetch_add(1, Ordering::Relaxed);
        return;
    }
    // Counted in `control_errors` below, with the other refusals.
    let other_uid = AtomicU64::new(0);
    if !pliant_wire::server::same_uid_peer(&stream, &other_uid, "control") {
        let e = sh.error("permission denied: peer uid differs from the replica's");
        if sh.security.is_none() {
            let _ = Link::local(stream, MAX_REQUEST).send(e.to_string().as_bytes());
        }
        return;
    }
    // A client silent for IO_TIMEOUT is cut off, so a stuck one holds its slot that long.
    let _ = stream.set_read_timeout(Some(IO_TIMEOUT));
    let _ = stream.set_write_timeout(Some(IO_TIMEOUT));
    let Some(slot) = Slot::claim(&sh.active) else {
        sh.conns_refused.fetch_add(1, Ordering::Relaxed);
        let e = sh.error(&format!(
            "replica busy: {MAX_CONNECTIONS} control connections are being served; retry"
        ));
        // A local client is told why; a sealed one cannot be before its handshake.
        if sh.security.is_none() {
            let _ = Link::local(stream, MAX_REQUEST).send(e.to_string().as_bytes());
        }
        return;
    };
    let conn_sh = sh.clone();
    let spawned = std::thread::Builder::new()
        .name("pliant-ctl-conn".into())
        .spawn(move || {
            let _slot = slot;
            if let Some(link) = open_link(stream, &conn_sh) {
                serve_conn(link, &conn_sh);
            }
        });
    if let Err(e) = spawned {
        // The connection (moved into the closure) is closed and its slot given back.
        let _ = sh.error(&format!("spawn control connection thread: {e}"));
    }
}

/// The handshake of a sealed connection (CONTROLLER or ADMIN role required), within the
/// whole-handshake deadline; a local connection as it is.
fn open_link(stream: Stream, sh: &Shared) -> Option<Link> {
    let Some(sec) = &sh.security else {
        return Some(Link::local(stream, MAX_REQUEST));
    };
    let expect = Expect {
        name: None,
        roles: role::CONTROLLER | role::ADMIN,
    };
    let o = sec.options_for(!stream.is_unix(), expect, MAX_REQUEST);
    match pliant_wire::Conn::server(stream, &sec.identity, &o) {
        Ok(c) => {
            let s = c.reader.stream();
            let _ = s.set_read_timeout(Some(IO_TIMEOUT));
            let _ = s.set_write_timeout(Some(IO_TIMEOUT));
            Some(Link::Sealed(Box::new(c)))
        }
        // A client that could not prove an acceptable identity is a refusal (an error, and
        // worth a warning); one that went away first is what every liveness probe does.
        Err(e) if e.is_refusal() => {
            let _ = sh.error(&format!("control client refused: {e}"));
            tracing::warn!(error = %e, "control client refused");
            None
        }
        Err(e) => {
            sh.handshakes_aborted.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(error = %e, "control handshake aborted");
            None
        }
    }
}

fn serve_conn(mut link: Link, sh: &Shared) {
    loop {
        let answer = match link.recv() {
            Ok(body) => match Cmd::parse(body).and_then(|cmd| {
                let term = pliant_proto::request::term_of(body)?;
                Ok((cmd, term))
            }) {
                Ok((cmd, term)) => match sh.fence.admit(term) {
                    Ok(()) => sh.ask(cmd),
                    Err(msg) => sh.error(&msg),
                },
                Err(msg) => sh.error(&msg),
            },
            Err(pliant_wire::FrameError::Closed) => return,
            Err(e @ pliant_wire::FrameError::TooLarge { .. }) => {
                // The rest of the frame is unread: answer, then close the connection.
                let e = sh.error(&format!("request too long: {e}"));
                let _ = link.send(e.to_string().as_bytes());
                return;
            }
            Err(e) => {
                if !matches!(&e, pliant_wire::FrameError::Io(io) if matches!(io.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut))
                {
                    let _ = sh.error(&format!("control connection: {e}"));
                }
                return;
            }
        };
        if link.send(answer.to_string().as_bytes()).is_err() {
            return;
        }
    }
}

/// Serves scrapes, each on its own thread (at most [`MAX_METRICS_CONNECTIONS`]): a client
/// that connects and sends nothing, or one byte at a time, holds only its own slot, and for
/// [`IO_TIMEOUT`] at most (one deadline over the whole request head), so it cannot block the
/// next scrape.
fn serve_http(l: TcpListener, sh: Shared) {
    let active = Arc::new(AtomicUsize::new(0));
    for conn in l.incoming() {
        if sh.stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(mut s) = conn else { continue };
        let Some(slot) = Slot::claim_of(&active, MAX_METRICS_CONNECTIONS) else {
            let _ = sh.error("metrics listener busy");
            let _ = s.set_write_timeout(Some(Duration::from_millis(100)));
            let _ = write!(
                s,
                "HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            );
            continue;
        };
        let conn_sh = sh.clone();
        let spawned = std::thread::Builder::new()
            .name("pliant-metrics-conn".into())
            .spawn(move || {
                let _slot = slot;
                serve_http_conn(s, &conn_sh);
            });
        if let Err(e) = spawned {
            let _ = sh.error(&format!("spawn metrics connection thread: {e}"));
        }
    }
}

fn serve_http_conn(mut s: std::net::TcpStream, sh: &Shared) {
    let deadline = std::time::Instant::now() + IO_TIMEOUT;
    let _ = s.set_write_timeout(Some(IO_TIMEOUT));
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while head.len() < 8192 && !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() || s.set_read_timeout(Some(left)).is_err() {
            return;
        }
        match s.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    let (status, ctype, body) = if head.starts_with(b"GET /metrics ") {
        let v = sh.ask(Cmd::Metrics);
        match v.get("metrics").and_then(Value::as_str) {
            Some(m) => ("200 OK", "text/plain; version=0.0.4", m.to_string()),
            None => ("503 Service Unavailable", "application/json", v.to_string()),
        }
    } else {
        (
            "404 Not Found",
            "text/plain",
            "only GET /metrics is served\n".to_string(),
        )
    };
    let _ = write!(
        s,
        "HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
}

/// A local-or-sealed client of the control channel at `ep` (see `pliant_proto::Client`).
pub fn client(ep: &str, security: Option<&Security>) -> Result<pliant_proto::Client, String> {
    let ep: Endpoint = ep
        .parse()
        .map_err(|e| format!("control endpoint {ep:?}: {e}"))?;
    Ok(pliant_proto::Client::new(ep, security.cloned()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use pliant_proto::{Client, ControlError, Request};
    use pliant_wire::Ca;
    use std::os::unix::fs::PermissionsExt;

    fn local(path: &str) -> Client {
        client(path, None).unwrap()
    }

    fn opts(path: &str) -> ControlOptions {
        ControlOptions {
            socket: path.into(),
            ..ControlOptions::default()
        }
    }

    /// A fake packet thread answering `n` requests with the command's name.
    fn answering(handle: ControlHandle, n: usize) -> std::thread::JoinHandle<ControlHandle> {
        std::thread::spawn(move || {
            for _ in 0..n {
                let r = handle.requests.recv().unwrap();
                let metrics = format!("m_{} 1\n", r.cmd.name());
                let v = json!({"ok": true, "cmd": r.cmd.name(), "metrics": metrics});
                r.reply.send(v).unwrap();
            }
            handle
        })
    }

    #[test]
    fn socket_round_trip_errors_and_bounds() {
        let (dir, path) = test_socket(line!());
        let (server, handle) = start(&ControlOptions {
            metrics_listen: Some("127.0.0.1:0".into()),
            ..opts(&path)
        })
        .expect("start");
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let t = answering(handle, 4);
        // HTTP: GET /metrics answered with the exposition text, anything else 404.
        let addr = server.metrics_addr.expect("metrics listener");
        let get = |req: &str| {
            let mut s = std::net::TcpStream::connect(addr).unwrap();
            s.write_all(req.as_bytes()).unwrap();
            let mut out = String::new();
            s.read_to_string(&mut out).unwrap();
            out
        };
        let ok = get("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(
            ok.starts_with("HTTP/1.0 200") && ok.ends_with("m_metrics 1\n"),
            "{ok}"
        );
        assert!(get("GET /other HTTP/1.1\r\n\r\n").starts_with("HTTP/1.0 404"));
        let c = local(&path);
        assert_eq!(c.call(&Request::Stats).unwrap()["cmd"], "stats");
        // A malformed request: an error answer (counted), the connection still served.
        let mut link = c.connect().unwrap();
        link.send(br#"{"cmd":"reboot"}"#).unwrap();
        let v: Value = serde_json::from_slice(link.recv().unwrap()).unwrap();
        assert!(
            v["error"].as_str().unwrap().contains("unknown variant"),
            "{v}"
        );
        link.send(br#"{"cmd":"query"}"#).unwrap();
        let v: Value = serde_json::from_slice(link.recv().unwrap()).unwrap();
        assert_eq!(v["cmd"], "query");
        // A frame declaring more than the bound: an error before the body is read, then close.
        let mut raw = UnixStream::connect(&path).unwrap();
        let mut f = Vec::new();
        pliant_wire::frame::push_plain(pliant_wire::kinds::CONTROL, b"", &mut f);
        f[0..4].copy_from_slice(&((MAX_REQUEST + 10) as u32).to_le_bytes());
        raw.write_all(&f).unwrap();
        let mut link = Link::local(Stream::Unix(raw), 1 << 20);
        let v: Value = serde_json::from_slice(link.recv().unwrap()).unwrap();
        assert!(v["error"].as_str().unwrap().contains("too long"), "{v}");
        assert_eq!(c.call(&Request::Flows).unwrap()["cmd"], "flows");
        let handle = t.join().unwrap();
        assert_eq!(handle.errors.load(Ordering::Relaxed), 2);
        // A second server cannot take over the socket of a live one.
        let e = start(&opts(&path)).err().expect("refused");
        assert!(e.contains("in use"), "{e}");
        drop(server);
        let _ = std::fs::remove_dir_all(dir);
    }

    /// A controller's term only grows: once a request of term 5 was served, requests of term 4
    /// (a deposed leader's) are refused, counted and never reach the packet thread; requests of
    /// term 5 and up, and those without a term (the CLI), are served.
    #[test]
    fn requests_of_a_deposed_controllers_term_are_refused() {
        let (dir, path) = test_socket(line!());
        let (server, handle) = start(&opts(&path)).expect("start");
        let fence = handle.fence.clone();
        let t = answering(handle, 4);
        let c = local(&path);
        assert_eq!(
            c.clone().with_term(4).call(&Request::Stats).unwrap()["cmd"],
            "stats"
        );
        assert_eq!(
            c.clone().with_term(5).call(&Request::Flows).unwrap()["cmd"],
            "flows"
        );
        let e = c.clone().with_term(4).call(&Request::Shutdown).unwrap_err();
        assert!(
            matches!(&e, ControlError::Refused { error, .. }
                if error.contains("deposed controller") && error.contains("term 4")
                    && error.contains("term 5")),
            "{e:?}"
        );
        assert_eq!(
            c.call(&Request::Query).unwrap()["cmd"],
            "query",
            "no term: served"
        );
        assert_eq!(
            c.clone().with_term(9).call(&Request::Stats).unwrap()["cmd"],
            "stats"
        );
        let e = c.clone().with_term(5).call(&Request::Stats);
        assert!(e.is_err(), "5 < 9 now");
        // Exactly the four admitted requests reached the packet thread.
        let handle = t.join().unwrap();
        assert_eq!(fence.term.load(Ordering::Relaxed), 9);
        assert_eq!(fence.refused.load(Ordering::Relaxed), 2);
        assert_eq!(handle.errors.load(Ordering::Relaxed), 2);
        drop(server);
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn the_term_fence_only_rises() {
        let f = TermFence::default();
        assert!(f.admit(None).is_ok());
        assert!(f.admit(Some(3)).is_ok());
        assert!(f.admit(Some(3)).is_ok(), "the same leader again");
        assert!(f.admit(Some(2)).is_err());
        assert!(f.admit(None).is_ok());
        assert_eq!(
            f.term.load(Ordering::Relaxed),
            3,
            "a refusal never lowers it"
        );
        assert_eq!(f.refused.load(Ordering::Relaxed), 1);
    }

    /// With an identity the control channel is sealed on the unix socket and on TCP alike, and
    /// served only to clients certified as controller or admin: a replica's certificate, one
    /// of another CA, or no identity at all get no answer.
    #[test]
    fn sealed_control_serves_only_controllers_and_admins_on_unix_and_tcp() {
        let (dir, path) = test_socket(line!());
        let ca = Ca::generate(None).unwrap();
        let me = Security::new(ca.issue("r1", role::REPLICA, 3600).unwrap());
        let (server, handle) = start(&ControlOptions {
            listen: Some("127.0.0.1:0".into()),
            security: Some(me),
            ..opts(&path)
        })
        .expect("start");
        let tcp = server.tcp_endpoint().expect("tcp").to_string();
        let t = answering(handle, 4);
        let with = |ep: &str, name: &str, roles: u32, ca: &Ca| {
            client(
                ep,
                Some(&Security::new(ca.issue(name, roles, 3600).unwrap())),
            )
            .unwrap()
            .expecting("r1")
            .with_timeout(Duration::from_secs(5))
        };
        for ep in [path.as_str(), tcp.as_str()] {
            let v = with(ep, "ctl", role::CONTROLLER, &ca).call(&Request::Stats);
            assert_eq!(v.expect("controller served")["cmd"], "stats");
            let v = with(ep, "op", role::ADMIN, &ca).call(&Request::Query);
            assert_eq!(v.expect("admin served")["cmd"], "query");
            let e = with(ep, "r2", role::REPLICA, &ca).call(&Request::Stats);
            assert!(matches!(e, Err(ControlError::Io { .. })), "{e:?}");
            let other = Ca::generate(None).unwrap();
            let e = with(ep, "ctl", role::CONTROLLER, &other).call(&Request::Stats);
            assert!(matches!(e, Err(ControlError::Io { .. })), "{e:?}");
        }
        // No identity: the unix socket gives no answer (the server expects a handshake), and a
        // TCP endpoint is not even dialled.
        let e = local(&path).call(&Request::Stats).unwrap_err().to_string();
        assert!(e.contains("CONTROLLER or ADMIN"), "{e}");
        let e = local(&tcp).call(&Request::Stats).unwrap_err().to_string();
        assert!(e.contains("needs an identity"), "{e}");
        // The client checks the replica's name too.
        let e = with(&tcp, "ctl", role::CONTROLLER, &ca)
            .expecting("r9")
            .call(&Request::Stats);
        assert!(matches!(e, Err(ControlError::Io { .. })), "{e:?}");
        let handle = t.join().unwrap();
        // The replica-role client is refused by the server (an error, per endpoint); the
        // clients that gave up first — on a certificate of another CA (per endpoint), on the
        // replica's name, and the one without a handshake — are aborted handshakes, not
        // errors. The serving threads count after the clients saw the outcome: wait (bounded).
        let counted = || {
            (
                handle.errors.load(Ordering::Relaxed),
                handle.handshakes_aborted.load(Ordering::Relaxed),
            )
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while counted() != (2, 4) && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(counted(), (2, 4), "(errors, aborted handshakes)");
        drop(server);
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn tcp_control_without_an_identity_is_refused_at_start() {
        let (dir, path) = test_socket(line!());
        let e = start(&ControlOptions {
            listen: Some("127.0.0.1:0".into()),
            ..opts(&path)
        })
        .err()
        .expect("refused");
        assert!(e.contains("[security]"), "{e}");
        let _ = std::fs::remove_dir_all(dir);
    }

    /// A scrape is answered while other clients hold metrics connections open sending
    /// nothing (or trickling): they hold their own slots, not the listener.
    #[test]
    fn a_silent_metrics_client_does_not_block_a_scrape() {
        let (dir, path) = test_socket(line!());
        let (server, handle) = start(&ControlOptions {
            metrics_listen: Some("127.0.0.1:0".into()),
            ..opts(&path)
        })
        .expect("start");
        let (taken_tx, _taken_rx) = mpsc::channel();
        let (_release_tx, release_rx) = mpsc::channel();
        let fake = holding_packet_thread(handle, taken_tx, release_rx, Duration::from_secs(5));
        let addr = server.metrics_addr.expect("metrics listener");
        let silent = std::net::TcpStream::connect(addr).unwrap();
        let mut trickle = std::net::TcpStream::connect(addr).unwrap();
        trickle.write_all(b"GET /me").unwrap();
        let started = std::time::Instant::now();
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\n\r\n").unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        // (The fake packet thread answers without exposition text: 503 with its answer.)
        assert!(out.contains("\"cmd\":\"metrics\""), "{out}");
        // Answered before the silent clients' own deadline cut them off: not behind them.
        assert!(started.elapsed() < IO_TIMEOUT, "{:?}", started.elapsed());
        drop((silent, trickle));
        drop(server);
        drop(fake);
        let _ = std::fs::remove_dir_all(dir);
    }

    fn test_socket(tag: u32) -> (std::path::PathBuf, String) {
        let dir = std::env::temp_dir().join(format!("pliant-ctl-{}-{tag}", std::process::id()));
        let path = dir.join("c.sock").to_str().unwrap().to_string();
        (dir, path)
    }

    /// A fake packet thread that holds every `ftmb_activate` reply (as the engine does while a
    /// replay runs elsewhere) and answers everything else at once. It reports each activation
    /// taken on `taken`, answers the held ones when told on `release` (or after `fallback`, so
    /// a server that serves connections one at a time fails the caller's assertions instead of
    /// hanging), and ends 10 s after that (the serving threads keep the queue open).
    fn holding_packet_thread(
        handle: ControlHandle,
        taken: mpsc::Sender<()>,
        release: Receiver<()>,
        fallback: Duration,
    ) -> std::thread::JoinHandle<()> {
        std::thread::spawn(move || {
            let start = std::time::Instant::now();
            let mut held: Vec<SyncSender<Value>> = Vec::new();
            loop {
                match handle.requests.recv_timeout(Duration::from_millis(5)) {
                    Ok(r) => match r.cmd {
                        Cmd::FtmbActivate { .. } => {
                            held.push(r.reply);
                            let _ = taken.send(());
                        }
                        other => {
                            let _ = r.reply.send(json!({"ok": true, "cmd": other.name()}));
                        }
                    },
                    Err(mpsc::RecvTimeoutError::Timeout) => {}
                    Err(mpsc::RecvTimeoutError::Disconnected) => return,
                }
                if start.elapsed() > fallback + Duration::from_secs(10) {
                    return;
                }
                if release.try_recv().is_ok() || start.elapsed() > fallback {
                    for h in held.drain(..) {
                        let _ = h.send(json!({"ok": true, "activated": 1}));
                    }
                }
            }
        })
    }

    #[test]
    fn stats_is_answered_while_a_slow_request_is_pending_on_another_connection() {
        let (dir, path) = test_socket(line!());
        let (server, handle) = start(&opts(&path)).expect("start");
        let (taken_tx, taken_rx) = mpsc::channel();
        let (release_tx, release_rx) = mpsc::channel();
        let fake = holding_packet_thread(handle, taken_tx, release_rx, Duration::from_secs(5));
        let (done_tx, done_rx) = mpsc::channel();
        let slow_path = path.clone();
        let slow = std::thread::spawn(move || {
            let v = local(&slow_path).call(&Request::FtmbActivate {
                primary: "r1".into(),
            });
            let _ = done_tx.send(v);
        });
        taken_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the slow request reached the packet thread");
        let stats = local(&path).call(&Request::Stats).expect("stats answered");
        assert_eq!(stats["cmd"], "stats", "{stats}");
        assert!(
            matches!(done_rx.try_recv(), Err(mpsc::TryRecvError::Empty)),
            "stats was answered only after the slow request finished: connections are served \
             one at a time"
        );
        release_tx.send(()).unwrap();
        let v = done_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the slow request answered once released")
            .expect("slow request");
        assert_eq!(v["activated"], 1, "{v}");
        slow.join().unwrap();
        drop(server);
        drop(fake);
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn connections_past_the_bound_are_refused_counted_and_served_again_later() {
        let (dir, path) = test_socket(line!());
        let (server, handle) = start(&opts(&path)).expect("start");
        let refused = handle.conns_refused.clone();
        let errors = handle.errors.clone();
        let (taken_tx, taken_rx) = mpsc::channel();
        let (release_tx, release_rx) = mpsc::channel();
        let fake = holding_packet_thread(handle, taken_tx, release_rx, Duration::from_secs(15));
        // Every slot taken by a request in flight.
        let clients: Vec<_> = (0..MAX_CONNECTIONS)
            .map(|i| {
                let p = path.clone();
                std::thread::spawn(move || {
                    local(&p).call(&Request::FtmbActivate {
                        primary: format!("r{i}"),
                    })
                })
            })
            .collect();
        for i in 0..MAX_CONNECTIONS {
            taken_rx
                .recv_timeout(Duration::from_secs(10))
                .unwrap_or_else(|_| panic!("only {i} of {MAX_CONNECTIONS} requests in flight"));
        }
        let e = local(&path).call(&Request::Stats).unwrap_err();
        assert!(
            matches!(&e, ControlError::Refused { error, .. } if error.contains("control connections")),
            "an answer, not a hang-up: {e:?}"
        );
        assert_eq!(refused.load(Ordering::Relaxed), 1);
        assert_eq!(errors.load(Ordering::Relaxed), 1);
        release_tx.send(()).unwrap();
        for c in clients {
            assert_eq!(c.join().unwrap().expect("answered")["activated"], 1);
        }
        // The slots come back as the serving threads see their clients go.
        let mut served = None;
        for _ in 0..500 {
            if let Ok(v) = local(&path).call(&Request::Stats) {
                served = Some(v);
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(served.expect("served again")["cmd"], "stats");
        drop(server);
        drop(fake);
        let _ = std::fs::remove_dir_all(dir);
    }
}
