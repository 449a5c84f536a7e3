//! The control socket (and optional HTTP metrics listener), served from their own threads.
//!
//! The packet thread owns all state, so these threads never touch it: they turn each request
//! into a [`Request`] on a bounded channel, poke the packet thread awake through a socket pair
//! it polls, and wait (bounded) for the answer. No locks on the hot path.
//!
//! Each control connection is served on its own thread (at most [`MAX_CONNECTIONS`] at once;
//! beyond that a connection gets one error line and is closed, counted in
//! `control_conns_refused`): a `migrate_out` or `ftmb_activate` may take seconds to answer,
//! and the controller's `stats` heartbeat on another connection must not wait behind it. The
//! packet thread never waits for those either: it answers them later on the request's reply
//! channel.
//!
//! Protocol: a unix stream socket, mode 0600, and the peer's uid (SO_PEERCRED) must be ours.
//! One JSON object per line, `{"cmd":"stats"|"metrics"|"query"|"flows"|"shutdown"|...}` (the
//! migration commands are listed in the crate README), answered
//! by one JSON line: `{"ok":true,...}` or `{"ok":false,"error":"..."}`. Lines are bounded
//! ([`MAX_REQUEST_BYTES`]); anything malformed gets an error and is counted, never a crash.

use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::Duration;

/// Longest request line accepted (a `migrate_in` of 20,000 keys is ~1 MiB).
pub const MAX_REQUEST_BYTES: usize = 2 << 20;
/// Requests queued for the packet thread at most (beyond: refused at once and counted in
/// `control_errors`; requests whose client gave up waiting stay queued until served).
pub(crate) const CHANNEL_BOUND: usize = 16;
/// Control connections served at once. Each holds a thread while it waits for its answer or its
/// next line (a silent client at most [`IO_TIMEOUT`]); the controller needs a handful (heartbeat,
/// one operation, HA polls), so this leaves room for CLI use without unbounded threads.
pub const MAX_CONNECTIONS: usize = 16;
/// Scrapes served at once on the HTTP metrics listener (more get 503 at once and are counted
/// in `control_errors`).
pub const MAX_METRICS_CONNECTIONS: usize = 4;
/// How long a client may take to send a line, and we wait for the packet thread.
const IO_TIMEOUT: Duration = Duration::from_secs(3);
/// How long `ftmb_protect`/`ftmb_activate` may take (connects, barriers, replay: each bounded
/// on its own, this is their sum with margin).
pub const FTMB_WAIT: Duration = Duration::from_secs(20);

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Cmd {
    Stats,
    Metrics,
    Query,
    Flows,
    /// Whether this replica's flow table holds `key` (as a primary key or an alias), and if so
    /// its primary key, aliases and version: one index lookup, so the controller can find a
    /// flow's owner however many flows the replicas hold (`flows` lists at most
    /// `max_listed_flows`).
    Flow {
        key: pliant_state::FlowKey,
    },
    Shutdown,
    /// Destination side: hold packets of `keys` until their state arrives.
    MigrateIn {
        from: String,
        keys: Vec<pliant_state::FlowKey>,
    },
    /// Source side: export `keys` and ship them to the peer socket `to` (answered later).
    MigrateOut {
        to: String,
        keys: Vec<pliant_state::FlowKey>,
    },
    /// NAT: the external port blocks this replica allocates from.
    SetPortBlocks {
        blocks: Vec<(u16, u16)>,
    },
    /// Export this replica's combiner contributions (retires them).
    SharedExport,
    /// Merge a dying replica's exported contributions (hex).
    SharedMerge {
        bytes: Vec<u8>,
    },
    /// HA: replace the replication policy under fencing token `token`.
    Protect {
        token: u64,
        policy: Box<pliant_ha::policy::Policy>,
    },
    /// HA: groups, held output, standby state held for others.
    HaStatus,
    /// HA (backup): make `primary`'s standby state live here.
    Activate {
        primary: String,
        token: u64,
    },
    /// HA (backup): forget `primary`'s standby state.
    DropStandby {
        primary: String,
    },
    /// FTMB: log to the logger at `logger` (another replica's `.ftmb.sock`, or its TCP
    /// `host:port`). With `host` (the replica hosting it), the logger must prove that name in
    /// the handshake.
    FtmbProtect {
        logger: String,
        host: Option<String>,
    },
    /// FTMB: workers, logger, snapshots, hosted logs, recoveries.
    FtmbStatus,
    /// FTMB (logger host): recover `primary` by replay and import its flows.
    FtmbActivate {
        primary: String,
    },
    /// FTMB (logger host): hold arriving packets now, for `primary`'s activation to come.
    FtmbHold {
        primary: String,
    },
}

fn u64_field(v: &Value, name: &str) -> Result<u64, String> {
    v.get(name)
        .and_then(Value::as_u64)
        .ok_or_else(|| format!("missing unsigned integer field {name:?}"))
}

fn str_field(v: &Value, name: &str) -> Result<String, String> {
    v.get(name)
        .and_then(Value::as_str)
        .map(str::to_string)
        .ok_or_else(|| format!("missing string field {name:?}"))
}

/// Decodes lowercase/uppercase hex; `None` on odd length or a non-hex digit.
pub fn from_hex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| s.get(i..i + 2).and_then(|b| u8::from_str_radix(b, 16).ok()))
        .collect()
}

pub fn to_hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl Cmd {
    fn parse(line: &str) -> Result<Cmd, String> {
        let v: Value = serde_json::from_str(line).map_err(|e| format!("malformed JSON: {e}"))?;
        let cmd = v
            .get("cmd")
            .and_then(Value::as_str)
            .ok_or("missing string field \"cmd\"")?;
        Ok(match cmd {
            "stats" => Cmd::Stats,
            "metrics" => Cmd::Metrics,
            "query" => Cmd::Query,
            "flows" => Cmd::Flows,
            "flow" => Cmd::Flow {
                key: str_field(&v, "key")?
                    .parse()
                    .map_err(|e: pliant_state::ParseFlowKeyError| e.to_string())?,
            },
            "shutdown" => Cmd::Shutdown,
            "migrate_in" => Cmd::MigrateIn {
                from: str_field(&v, "from")?,
                keys: crate::migrate::parse_keys(v.get("keys"))?,
            },
            "migrate_out" => Cmd::MigrateOut {
                to: str_field(&v, "to")?,
                keys: crate::migrate::parse_keys(v.get("keys"))?,
            },
            "set_port_blocks" => {
                let arr = v
                    .get("blocks")
                    .and_then(Value::as_array)
                    .ok_or("missing array field \"blocks\"")?;
                if arr.len() > 4096 {
                    return Err("more than 4096 port blocks".into());
                }
                let mut blocks = Vec::with_capacity(arr.len());
                for b in arr {
                    let pair = b
                        .as_array()
                        .filter(|p| p.len() == 2)
                        .and_then(|p| Some((p[0].as_u64()?, p[1].as_u64()?)))
                        .ok_or("each block is [lo, hi]")?;
                    let (Ok(lo), Ok(hi)) = (u16::try_from(pair.0), u16::try_from(pair.1)) else {
                        return Err("port out of range 0..=65535".into());
                    };
                    if lo == 0 || lo > hi {
                        return Err(format!("bad port block [{lo}, {hi}]: need 1 <= lo <= hi"));
                    }
                    blocks.push((lo, hi));
                }
                Cmd::SetPortBlocks { blocks }
            }
            "shared_export" => Cmd::SharedExport,
            "protect" => {
                let p = v.get("policy").ok_or("missing object field \"policy\"")?;
                let policy: pliant_ha::policy::Policy =
                    serde_json::from_value(p.clone()).map_err(|e| format!("bad policy: {e}"))?;
                Cmd::Protect {
                    token: u64_field(&v, "token")?,
                    policy: Box::new(policy),
                }
            }
            "ha_status" => Cmd::HaStatus,
            "activate" => Cmd::Activate {
                primary: str_field(&v, "primary")?,
                token: u64_field(&v, "token")?,
            },
            "drop_standby" => Cmd::DropStandby {
                primary: str_field(&v, "primary")?,
            },
            "ftmb_protect" => Cmd::FtmbProtect {
                logger: str_field(&v, "logger")?,
                host: match v.get("host") {
                    None | Some(Value::Null) => None,
                    Some(Value::String(h)) => Some(h.clone()),
                    Some(_) => return Err("field \"host\" must be a string".into()),
                },
            },
            "ftmb_status" => Cmd::FtmbStatus,
            "ftmb_activate" => Cmd::FtmbActivate {
                primary: str_field(&v, "primary")?,
            },
            "ftmb_hold" => Cmd::FtmbHold {
                primary: str_field(&v, "primary")?,
            },
            "shared_merge" => Cmd::SharedMerge {
                bytes: from_hex(&str_field(&v, "bytes")?).ok_or("\"bytes\" is not hex")?,
            },
            other => {
                let mut shown: String = other.chars().take(40).collect();
                if shown.len() < other.len() {
                    shown.push('…');
                }
                return Err(format!(
                    "unknown cmd {shown:?} (known: stats, metrics, query, flows, flow, shutdown, migrate_in, \
                     migrate_out, set_port_blocks, shared_export, shared_merge, protect, ha_status, \
                     activate, drop_standby, ftmb_protect, ftmb_status, ftmb_activate, ftmb_hold)"
                ));
            }
        })
    }
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
}

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

/// The serving side: removing the socket file on drop.
pub struct ControlServer {
    path: String,
    stop: Arc<AtomicBool>,
    /// Bound address of the HTTP metrics listener (resolves a `:0` port).
    pub metrics_addr: Option<std::net::SocketAddr>,
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = std::fs::remove_file(&self.path);
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
        let migrating = matches!(cmd, Cmd::MigrateOut { .. });
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

/// Starts the control socket at `path` (and the HTTP metrics listener if `metrics_listen`).
pub fn start(
    path: &str,
    metrics_listen: Option<&str>,
) -> Result<(ControlServer, ControlHandle), String> {
    // A socket file left by a crashed replica would make bind fail; remove only a socket.
    if let Ok(md) = std::fs::symlink_metadata(path) {
        if md.file_type().is_socket() {
            let _ = std::fs::remove_file(path);
        } else {
            return Err(format!("control socket {path}: exists and is not a socket"));
        }
    }
    if let Some(dir) = std::path::Path::new(path).parent() {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("control socket dir {}: {e}", dir.display()))?;
    }
    let listener =
        UnixListener::bind(path).map_err(|e| format!("control socket {path}: bind: {e}"))?;
    // Only root (our uid) may talk to it: that is its authentication. SO_PEERCRED is checked
    // as well, which also covers the instant between bind and chmod.
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| format!("control socket {path}: chmod 0600: {e}"))?;

    let (shared, handle) = channel()?;
    let stop = shared.stop.clone();

    let mut metrics_addr = None;
    if let Some(addr) = metrics_listen {
        let l = TcpListener::bind(addr).map_err(|e| format!("metrics_listen {addr}: bind: {e}"))?;
        metrics_addr = l.local_addr().ok();
        let sh = shared.clone();
        std::thread::Builder::new()
            .name("pliant-metrics".into())
            .spawn(move || serve_http(l, sh))
            .map_err(|e| format!("spawn metrics thread: {e}"))?;
    }
    let sh = shared;
    std::thread::Builder::new()
        .name("pliant-control".into())
        .spawn(move || serve_unix(listener, sh))
        .map_err(|e| format!("spawn control thread: {e}"))?;
    Ok((
        ControlServer {
            path: path.to_string(),
            stop,
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
    let shared = Shared {
        tx,
        wake_tx: Arc::new(wake_tx),
        errors: errors.clone(),
        stop: Arc::new(AtomicBool::new(false)),
        active: Arc::new(AtomicUsize::new(0)),
        conns_refused: conns_refused.clone(),
    };
    let handle = ControlHandle {
        requests: rx,
        wake_rx,
        errors,
        conns_refused,
    };
    Ok((shared, handle))
}

fn serve_unix(l: UnixListener, sh: Shared) {
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    for conn in l.incoming() {
        if sh.stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(mut s) = conn else { continue };
        if pliant_wire::endpoint::peer_uid(&s).ok() != Some(me) {
            let e = sh.error("permission denied: peer uid differs from the replica's");
            let _ = writeln!(s, "{e}");
            continue;
        }
        // A client silent for IO_TIMEOUT is cut off, so a stuck one holds its slot that long.
        let _ = s.set_read_timeout(Some(IO_TIMEOUT));
        let _ = s.set_write_timeout(Some(IO_TIMEOUT));
        let Some(slot) = Slot::claim(&sh.active) else {
            sh.conns_refused.fetch_add(1, Ordering::Relaxed);
            let e = sh.error(&format!(
                "replica busy: {MAX_CONNECTIONS} control connections are being served; retry"
            ));
            let _ = writeln!(s, "{e}");
            continue;
        };
        let conn_sh = sh.clone();
        let spawned = std::thread::Builder::new()
            .name("pliant-ctl-conn".into())
            .spawn(move || {
                let _slot = slot;
                serve_conn(s, &conn_sh);
            });
        if let Err(e) = spawned {
            // The connection (moved into the closure) is closed and its slot given back.
            let _ = sh.error(&format!("spawn control connection thread: {e}"));
        }
    }
}

fn serve_conn(s: UnixStream, sh: &Shared) {
    let Ok(w) = s.try_clone() else { return };
    let mut w = w;
    let mut r = BufReader::new(s);
    loop {
        let mut line = Vec::new();
        // Read one byte more than allowed to tell "exactly at the bound" from "over it".
        match (&mut r)
            .take(MAX_REQUEST_BYTES as u64 + 1)
            .read_until(b'\n', &mut line)
        {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        if line.len() > MAX_REQUEST_BYTES {
            let e = sh.error("request too long");
            let _ = writeln!(w, "{e}");
            return; // the rest of the line is garbage: close the connection
        }
        let text = String::from_utf8_lossy(&line);
        let text = text.trim();
        if text.is_empty() {
            continue;
        }
        let answer = match Cmd::parse(text) {
            Ok(cmd) => sh.ask(cmd),
            Err(msg) => sh.error(&msg),
        };
        if writeln!(w, "{answer}").is_err() {
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

/// Sends one request line to a replica's control socket and returns its answer (the CLI side).
pub fn client_request(path: &str, cmd: &str) -> Result<Value, String> {
    client_request_json(path, &json!({ "cmd": cmd }))
}

/// Sends one JSON request object and returns the answer.
pub fn client_request_json(path: &str, req: &Value) -> Result<Value, String> {
    let mut s = UnixStream::connect(path).map_err(|e| format!("connect {path}: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(|e| e.to_string())?;
    // One write: formatting straight into the socket issues a syscall per JSON token, which
    // made large key lists (migrations of thousands of flows) take tens of milliseconds.
    let line = format!("{req}\n");
    s.write_all(line.as_bytes())
        .map_err(|e| format!("write {path}: {e}"))?;
    let mut line = String::new();
    BufReader::new(s)
        .take(64 << 20)
        .read_line(&mut line)
        .map_err(|e| format!("read {path}: {e}"))?;
    serde_json::from_str(&line).map_err(|e| format!("bad answer from {path}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_known_commands_and_refuses_the_rest() {
        assert_eq!(Cmd::parse(r#"{"cmd":"stats"}"#), Ok(Cmd::Stats));
        assert_eq!(Cmd::parse(r#"{"cmd":"flows","x":1}"#), Ok(Cmd::Flows));
        assert!(Cmd::parse(r#"{"cmd":"reboot"}"#)
            .unwrap_err()
            .contains("unknown cmd"));
        assert!(Cmd::parse(r#"{"cmd":3}"#).is_err());
        let k = "tcp 10.0.0.1:1 <-> 10.0.0.2:2";
        assert_eq!(
            Cmd::parse(&format!(
                r#"{{"cmd":"migrate_out","to":"/p","keys":["{k}"]}}"#
            )),
            Ok(Cmd::MigrateOut {
                to: "/p".into(),
                keys: vec![k.parse().unwrap()]
            })
        );
        assert_eq!(
            Cmd::parse(&format!(r#"{{"cmd":"flow","key":"{k}"}}"#)),
            Ok(Cmd::Flow {
                key: k.parse().unwrap()
            })
        );
        assert!(Cmd::parse(r#"{"cmd":"flow"}"#).is_err());
        assert!(Cmd::parse(r#"{"cmd":"flow","key":"tcp nowhere"}"#).is_err());
        assert!(Cmd::parse(r#"{"cmd":"migrate_in","keys":[]}"#).is_err());
        assert!(Cmd::parse(r#"{"cmd":"migrate_in","from":"a","keys":["x"]}"#).is_err());
        assert_eq!(
            Cmd::parse(r#"{"cmd":"set_port_blocks","blocks":[[1024,2047]]}"#),
            Ok(Cmd::SetPortBlocks {
                blocks: vec![(1024, 2047)]
            })
        );
        assert!(Cmd::parse(r#"{"cmd":"set_port_blocks","blocks":[[5,1]]}"#).is_err());
        assert!(Cmd::parse(r#"{"cmd":"set_port_blocks","blocks":[[1,70000]]}"#).is_err());
        assert_eq!(
            Cmd::parse(r#"{"cmd":"shared_merge","bytes":"00ff"}"#),
            Ok(Cmd::SharedMerge {
                bytes: vec![0, 255]
            })
        );
        assert!(Cmd::parse(r#"{"cmd":"shared_merge","bytes":"0g"}"#).is_err());
        let p = Cmd::parse(
            r#"{"cmd":"protect","token":3,"policy":{"kind":"single","backup":{"name":"r2","socket":"/s"},"hz":1000}}"#,
        )
        .unwrap();
        assert!(matches!(p, Cmd::Protect { token: 3, .. }));
        assert!(Cmd::parse(r#"{"cmd":"protect","token":3,"policy":{"kind":"nope"}}"#).is_err());
        assert!(Cmd::parse(r#"{"cmd":"protect","policy":{"kind":"off"}}"#).is_err());
        assert_eq!(Cmd::parse(r#"{"cmd":"ha_status"}"#), Ok(Cmd::HaStatus));
        assert_eq!(
            Cmd::parse(r#"{"cmd":"activate","primary":"r1","token":4}"#),
            Ok(Cmd::Activate {
                primary: "r1".into(),
                token: 4
            })
        );
        assert!(Cmd::parse(r#"{"cmd":"activate","primary":"r1","token":-1}"#).is_err());
        assert_eq!(
            Cmd::parse(r#"{"cmd":"drop_standby","primary":"r1"}"#),
            Ok(Cmd::DropStandby {
                primary: "r1".into()
            })
        );
        assert_eq!(
            Cmd::parse(r#"{"cmd":"ftmb_protect","logger":"/run/x/r2.ftmb.sock"}"#),
            Ok(Cmd::FtmbProtect {
                logger: "/run/x/r2.ftmb.sock".into(),
                host: None,
            })
        );
        assert_eq!(
            Cmd::parse(r#"{"cmd":"ftmb_protect","logger":"10.0.0.2:7400","host":"r2"}"#),
            Ok(Cmd::FtmbProtect {
                logger: "10.0.0.2:7400".into(),
                host: Some("r2".into()),
            })
        );
        assert!(Cmd::parse(r#"{"cmd":"ftmb_protect","logger":"/x","host":2}"#).is_err());
        assert!(Cmd::parse(r#"{"cmd":"ftmb_protect"}"#).is_err());
        assert_eq!(Cmd::parse(r#"{"cmd":"ftmb_status"}"#), Ok(Cmd::FtmbStatus));
        assert_eq!(
            Cmd::parse(r#"{"cmd":"ftmb_activate","primary":"r1"}"#),
            Ok(Cmd::FtmbActivate {
                primary: "r1".into()
            })
        );
        assert!(Cmd::parse(r#"{"cmd":"ftmb_activate","primary":3}"#).is_err());
        assert!(Cmd::parse("not json").unwrap_err().contains("malformed"));
        assert!(
            Cmd::parse(&format!(r#"{{"cmd":"{}"}}"#, "x".repeat(1000)))
                .unwrap_err()
                .len()
                < 300,
            "the echoed command name is cut short"
        );
    }

    #[test]
    fn socket_round_trip_errors_and_bounds() {
        let dir = std::env::temp_dir().join(format!("pliant-ctl-{}", std::process::id()));
        let path = dir.join("c.sock");
        let path = path.to_str().unwrap().to_string();
        let (server, handle) = start(&path, Some("127.0.0.1:0")).expect("start");
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        // A fake packet thread answering three requests.
        let t = std::thread::spawn(move || {
            for _ in 0..3 {
                let r = handle.requests.recv().unwrap();
                let metrics = format!("m_{:?} 1\n", r.cmd);
                let v = json!({"ok": true, "cmd": format!("{:?}", r.cmd), "metrics": metrics});
                r.reply.send(v).unwrap();
            }
            handle
        });
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
            ok.starts_with("HTTP/1.0 200") && ok.ends_with("m_Metrics 1\n"),
            "{ok}"
        );
        assert!(get("GET /other HTTP/1.1\r\n\r\n").starts_with("HTTP/1.0 404"));
        assert_eq!(client_request(&path, "stats").unwrap()["cmd"], "Stats");
        assert_eq!(client_request(&path, "bogus").unwrap()["ok"], false);
        // Oversized line: error, connection closed, server still alive.
        let mut s = UnixStream::connect(&path).unwrap();
        let _ = s.write_all(&vec![b'x'; MAX_REQUEST_BYTES + 10]);
        let _ = s.write_all(b"\n");
        let mut line = String::new();
        BufReader::new(s).read_line(&mut line).unwrap();
        assert!(line.contains("too long"), "{line}");
        assert_eq!(client_request(&path, "query").unwrap()["cmd"], "Query");
        let handle = t.join().unwrap();
        assert_eq!(handle.errors.load(Ordering::Relaxed), 2);
        let _ = std::fs::remove_dir_all(dir);
    }

    /// A scrape is answered while other clients hold metrics connections open sending
    /// nothing (or trickling): they hold their own slots, not the listener.
    #[test]
    fn a_silent_metrics_client_does_not_block_a_scrape() {
        let (dir, path) = test_socket(line!());
        let (server, handle) = start(&path, Some("127.0.0.1:0")).expect("start");
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
        assert!(out.contains("\"cmd\":\"Metrics\""), "{out}");
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
                            let _ = r
                                .reply
                                .send(json!({"ok": true, "cmd": format!("{other:?}")}));
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
        let (server, handle) = start(&path, None).expect("start");
        let (taken_tx, taken_rx) = mpsc::channel();
        let (release_tx, release_rx) = mpsc::channel();
        let fake = holding_packet_thread(handle, taken_tx, release_rx, Duration::from_secs(5));
        let (done_tx, done_rx) = mpsc::channel();
        let slow_path = path.clone();
        let slow = std::thread::spawn(move || {
            let v = client_request_json(
                &slow_path,
                &json!({"cmd": "ftmb_activate", "primary": "r1"}),
            );
            let _ = done_tx.send(v);
        });
        taken_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the slow request reached the packet thread");
        let stats = client_request(&path, "stats").expect("stats answered");
        assert_eq!(stats["cmd"], "Stats", "{stats}");
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
        let (server, handle) = start(&path, None).expect("start");
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
                    client_request_json(
                        &p,
                        &json!({"cmd": "ftmb_activate", "primary": format!("r{i}")}),
                    )
                })
            })
            .collect();
        for i in 0..MAX_CONNECTIONS {
            taken_rx
                .recv_timeout(Duration::from_secs(10))
                .unwrap_or_else(|_| panic!("only {i} of {MAX_CONNECTIONS} requests in flight"));
        }
        let v = client_request(&path, "stats").expect("an answer, not a hang-up");
        assert_eq!(v["ok"], false, "{v}");
        assert!(
            v["error"].as_str().unwrap().contains("control connections"),
            "{v}"
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
            let v = client_request(&path, "stats").expect("answered");
            if v["ok"] == true {
                served = Some(v);
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(served.expect("served again")["cmd"], "Stats");
        drop(server);
        drop(fake);
        let _ = std::fs::remove_dir_all(dir);
    }
}
