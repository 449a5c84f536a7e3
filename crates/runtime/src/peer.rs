//! The replica-to-replica peer channel: a unix stream socket per replica (mode 0600, peer uid
//! checked with SO_PEERCRED), carrying length-prefixed [`PeerMsg`] frames.
//!
//! Threads, not the packet thread, do all socket I/O: an accept thread spawns one reader per
//! incoming connection (bounded), and one sender thread owns the outgoing connections (one per
//! destination path, so the frames of one migration — batch, forwarded packets, Done — stay in
//! order). They talk to the packet thread only through bounded channels it polls each round
//! ([`PeerLink`]) and a wake-up socket it polls in poll(2). A full inbound channel blocks the
//! reader, which back-pressures the sending replica; a full outbound channel makes the packet
//! thread count the message as failed (never blocks it).

use crate::migrate::{encode_frame, read_frame, Outbound, PeerEvent, PeerMsg};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender};
use std::sync::Arc;
use std::time::Duration;

/// Messages queued towards the packet thread at most.
const INBOUND_BOUND: usize = 8192;
/// Messages queued from the packet thread towards the sender thread at most.
const OUTBOUND_BOUND: usize = 8192;
/// Concurrent incoming connections at most.
const MAX_CONNECTIONS: usize = 32;
/// Outgoing connections kept open at most.
const MAX_OUT_CONNECTIONS: usize = 32;
/// How long a Done waits for the packet thread's Ack, and the sender for the peer's Ack.
const ACK_TIMEOUT: Duration = Duration::from_secs(3);
const IO_TIMEOUT: Duration = Duration::from_secs(5);

/// The packet thread's end of the peer channel.
pub struct PeerLink {
    pub tx: SyncSender<Outbound>,
    pub rx: Receiver<PeerEvent>,
    wake_rx: Option<UnixStream>,
}

/// The other end of an in-memory [`PeerLink`] (tests, or a custom transport).
pub struct PeerEnd {
    /// What the engine sends.
    pub outbound: Receiver<Outbound>,
    /// Where to deliver events to the engine.
    pub events: SyncSender<PeerEvent>,
}

impl PeerLink {
    /// A link with no transport behind it: the caller moves messages (deterministic tests).
    pub fn channels() -> (PeerLink, PeerEnd) {
        let (otx, orx) = mpsc::sync_channel(OUTBOUND_BOUND);
        let (etx, erx) = mpsc::sync_channel(INBOUND_BOUND);
        (
            PeerLink {
                tx: otx,
                rx: erx,
                wake_rx: None,
            },
            PeerEnd {
                outbound: orx,
                events: etx,
            },
        )
    }

    pub fn wake_fd(&self) -> Option<RawFd> {
        self.wake_rx.as_ref().map(|s| s.as_raw_fd())
    }

    pub fn drain_wake(&self) {
        if let Some(s) = &self.wake_rx {
            let mut buf = [0u8; 256];
            while matches!((&*s).read(&mut buf), Ok(n) if n > 0) {}
        }
    }
}

/// Removes the socket file and stops accepting on drop.
pub struct PeerServer {
    path: String,
    stop: Arc<AtomicBool>,
}

impl Drop for PeerServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = std::fs::remove_file(&self.path);
    }
}

#[derive(Clone)]
struct Wake(Arc<UnixStream>);

impl Wake {
    fn poke(&self) {
        // Non-blocking: a full socket already means "wake up".
        let _ = (&*self.0).write(&[1]);
    }
}

/// Starts the peer socket at `path` and the sender thread.
pub fn start(path: &str) -> Result<(PeerServer, PeerLink), String> {
    if let Ok(md) = std::fs::symlink_metadata(path) {
        if md.file_type().is_socket() {
            let _ = std::fs::remove_file(path);
        } else {
            return Err(format!("peer socket {path}: exists and is not a socket"));
        }
    }
    if let Some(dir) = std::path::Path::new(path).parent() {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("peer socket dir {}: {e}", dir.display()))?;
    }
    let listener =
        UnixListener::bind(path).map_err(|e| format!("peer socket {path}: bind: {e}"))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| format!("peer socket {path}: chmod 0600: {e}"))?;
    let (otx, orx) = mpsc::sync_channel::<Outbound>(OUTBOUND_BOUND);
    let (etx, erx) = mpsc::sync_channel::<PeerEvent>(INBOUND_BOUND);
    let (wake_tx, wake_rx) = UnixStream::pair().map_err(|e| format!("socketpair: {e}"))?;
    for s in [&wake_tx, &wake_rx] {
        s.set_nonblocking(true)
            .map_err(|e| format!("socketpair: {e}"))?;
    }
    let wake = Wake(Arc::new(wake_tx));
    let stop = Arc::new(AtomicBool::new(false));
    {
        let (etx, wake, stop) = (etx.clone(), wake.clone(), stop.clone());
        std::thread::Builder::new()
            .name("pliant-peer-accept".into())
            .spawn(move || accept_loop(listener, etx, wake, stop))
            .map_err(|e| format!("spawn peer thread: {e}"))?;
    }
    std::thread::Builder::new()
        .name("pliant-peer-send".into())
        .spawn(move || send_loop(orx, etx, wake))
        .map_err(|e| format!("spawn peer thread: {e}"))?;
    Ok((
        PeerServer {
            path: path.to_string(),
            stop,
        },
        PeerLink {
            tx: otx,
            rx: erx,
            wake_rx: Some(wake_rx),
        },
    ))
}

fn accept_loop(l: UnixListener, etx: SyncSender<PeerEvent>, wake: Wake, stop: Arc<AtomicBool>) {
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    let live = Arc::new(AtomicUsize::new(0));
    for conn in l.incoming() {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(s) = conn else { continue };
        // Only our own uid may move flows into this replica: a flow record is trusted state.
        if pliant_ha::unix::peer_uid(&s).ok() != Some(me) {
            tracing::warn!("peer connection refused: uid differs from the replica's");
            continue;
        }
        if live.load(Ordering::SeqCst) >= MAX_CONNECTIONS {
            tracing::warn!("peer connection refused: {MAX_CONNECTIONS} connections open");
            continue;
        }
        live.fetch_add(1, Ordering::SeqCst);
        let (etx, wake, live) = (etx.clone(), wake.clone(), live.clone());
        let spawned = std::thread::Builder::new()
            .name("pliant-peer-read".into())
            .spawn(move || {
                read_loop(s, &etx, &wake);
                live.fetch_sub(1, Ordering::SeqCst);
            });
        if spawned.is_err() {
            tracing::warn!("peer connection dropped: cannot spawn a reader");
        }
    }
}

fn read_loop(s: UnixStream, etx: &SyncSender<PeerEvent>, wake: &Wake) {
    let Ok(mut w) = s.try_clone() else { return };
    let _ = w.set_write_timeout(Some(IO_TIMEOUT));
    let mut r = std::io::BufReader::new(s);
    loop {
        let msg = match read_frame(&mut r) {
            Ok(m) => m,
            Err(e) => {
                if !matches!(&e, crate::migrate::FrameError::Io(io) if io.kind() == std::io::ErrorKind::UnexpectedEof)
                {
                    tracing::warn!(error = %e, "peer connection closed on a bad frame");
                }
                return;
            }
        };
        let is_done = matches!(msg, PeerMsg::Done { .. });
        let (rtx, rrx) = mpsc::sync_channel(1);
        let reply = is_done.then_some(rtx);
        // Blocking send: a slow packet thread back-pressures the sender, nothing is dropped.
        if etx.send(PeerEvent::Msg { msg, reply }).is_err() {
            return;
        }
        wake.poke();
        if is_done {
            let Ok(ack) = rrx.recv_timeout(ACK_TIMEOUT) else {
                tracing::warn!("packet thread did not answer a migration Done in time");
                return;
            };
            let Ok(bytes) = encode_frame(&ack) else {
                return;
            };
            if w.write_all(&bytes).is_err() {
                return;
            }
        }
    }
}

fn migration_id(m: &PeerMsg) -> u64 {
    match m {
        PeerMsg::Batch { id, .. } | PeerMsg::Done { id, .. } | PeerMsg::Ack { id, .. } => *id,
        PeerMsg::Fwd { .. } => 0,
    }
}

fn send_loop(orx: Receiver<Outbound>, etx: SyncSender<PeerEvent>, wake: Wake) {
    let mut conns: HashMap<String, UnixStream> = HashMap::new();
    // Migrations whose batch was not delivered: their Done must not reach the destination on a
    // fresh connection (it would release holds without the state). Bounded.
    let mut failed_batches: std::collections::VecDeque<u64> = Default::default();
    let report = |ev: PeerEvent| {
        let _ = etx.send(ev);
        wake.poke();
    };
    while let Ok(Outbound { to, msg }) = orx.recv() {
        let id = migration_id(&msg);
        let is_done = matches!(msg, PeerMsg::Done { .. });
        let is_batch = matches!(msg, PeerMsg::Batch { .. });
        if is_done && failed_batches.contains(&id) {
            continue;
        }
        let res = (|| -> Result<Option<PeerMsg>, String> {
            let bytes = encode_frame(&msg).map_err(|e| e.to_string())?;
            if !conns.contains_key(&to) {
                if conns.len() >= MAX_OUT_CONNECTIONS {
                    conns.clear();
                }
                let s = UnixStream::connect(&to).map_err(|e| format!("connect {to}: {e}"))?;
                s.set_write_timeout(Some(IO_TIMEOUT))
                    .map_err(|e| e.to_string())?;
                s.set_read_timeout(Some(ACK_TIMEOUT + Duration::from_secs(1)))
                    .map_err(|e| e.to_string())?;
                conns.insert(to.clone(), s);
            }
            let s = conns.get_mut(&to).ok_or("connection vanished")?;
            s.write_all(&bytes)
                .map_err(|e| format!("write {to}: {e}"))?;
            if is_done {
                let ack = read_frame(s).map_err(|e| format!("Ack from {to}: {e}"))?;
                return Ok(Some(ack));
            }
            Ok(None)
        })();
        match res {
            Ok(Some(ack)) => report(PeerEvent::Ack(ack)),
            Ok(None) => {}
            Err(error) => {
                conns.remove(&to);
                if is_batch {
                    if failed_batches.len() >= 64 {
                        failed_batches.pop_front();
                    }
                    failed_batches.push_back(id);
                }
                let what = if is_batch {
                    "batch"
                } else if is_done {
                    "done"
                } else {
                    "fwd"
                };
                report(PeerEvent::SendFailed {
                    id,
                    what,
                    to,
                    error,
                });
            }
        }
    }
}
