//! Moving a session between two running instances on one host (a planned move).
//!
//! The channel is a pliant-wire session (mutual authentication with CA-signed identities,
//! sealed and sequence-numbered frames, kind [`kinds::SLICE`]); the source dials the
//! destination by name and only then freezes the session, so a destination that cannot prove
//! its identity (or a source that cannot, at the destination) costs the session nothing.
//!
//! ```text
//!   source                                         destination
//!   connect + handshake (refused: session untouched)
//!   Prepare(id, a new session's application    ->  load the application capsule, check the
//!           capsule, netns of the socket)          network namespace
//!                                              <-  Ready | Refused(why)
//!   (Refused: nothing was touched)
//!   freeze the session thread
//!   hold the 4-tuple; TCP_REPAIR on; capture;
//!   recheck rcv_nxt; close in repair mode
//!   (no FIN, no RST; the 4-tuple is free now)
//!   Slice(capsule)                             ->  decode, restore the socket (repair mode)
//!                                              <-  Restored | Failed(why)
//!   (Failed: restore locally from the capsule)
//!   release the hold
//!   Released                                   ->  TCP_REPAIR off (window probe), run the
//!                                                  session with unsent + pending output
//!                                              <-  Serving
//! ```
//! With a queueing hold at the source (`Prepare.queued`), the destination ends repair mode
//! and runs the session right after the restore and answers the slice with `Serving`; the
//! source then releases the hold (the segments queued meanwhile, the answer to the window
//! probe among them, are written back) and the move is over: no `Released` round trip.
//! The close must come before the restore: the kernel refuses a second socket with a live
//! 4-tuple, even in repair mode. The hold covers the client's segments from before the
//! capture (a segment acknowledged by the source after its capture would be lost with it)
//! until the restored socket exists (a segment finding no socket, or the listener, would be
//! answered with a RST). Everything the destination can check without the session's state
//! (that it reads this application's capsules, the namespace) is checked before the freeze,
//! so neither the pause nor the hold includes that round trip; the session's own application
//! capsule is loaded with the restore, and if that fails the source restores the session. Until
//! the source has closed, every failure leaves the session where it was; after, the source
//! still holds the whole capsule and restores it itself if the destination cannot.

use crate::capsule::{Slice, TcpOptions};
use crate::format::{self, FormatError, MAX_BODY};
use crate::hold::HoldError;
use crate::instance::{peer_is_tcp, Frozen, Inner, Instance, SessionApp};
use crate::repair::{self, RepairError};
use pliant_wire::endpoint::{Endpoint, Stream};
use pliant_wire::frame::FrameError;
use pliant_wire::{kinds, role, Conn, ConnError, Expect};
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum ToDest {
    Prepare {
        session_id: u64,
        app: Vec<u8>,
        netns: u64,
        /// The source's hold queues: the destination may end repair mode and run the session
        /// as soon as it is restored, and answer `Serving` at once (see `take_slice`).
        queued: bool,
    },
    Slice(Vec<u8>),
    Released,
    /// A batch ([`crate::batch`]): the Prepare of each session.
    PrepareBatch(Vec<crate::batch::Prepared>),
    /// Capsules of the batch; `more`: another `Slices` follows (a frame holds at most
    /// `MAX_FRAME` bytes).
    Slices {
        capsules: Vec<Vec<u8>>,
        more: bool,
    },
    /// Replication updates from a primary ([`crate::replicate`]); answered with `Applied`.
    Replicate(Vec<crate::replicate::Update>),
    /// The primary stops replicating on purpose: nothing to take over.
    Goodbye,
}

#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum ToSource {
    Ready,
    Refused(String),
    Restored,
    Failed(String),
    Serving,
    /// Per capsule of a batch, in order: `None` restored, `Some(why)` not.
    RestoredBatch(Vec<Option<String>>),
    /// Replication updates applied (output commit moved on).
    Applied,
}

/// Frame bound of the channel: a capsule and its envelope.
pub(crate) const MAX_FRAME: usize = MAX_BODY + 1024;
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// What a move did.
#[derive(Debug, Clone)]
pub struct Moved {
    /// Freeze request at the source to the end of the move: the destination serving the
    /// session and the hold released (with a dropping hold the release comes first).
    pub pause: Duration,
    pub capsule_bytes: usize,
    /// The TCP options the moved connection had negotiated.
    pub options: TcpOptions,
    /// When each step ended, counted from the freeze request.
    pub phases: Phases,
}

/// The steps of a move, each as the time from the freeze request to its end.
#[derive(Debug, Clone, Copy, Default)]
pub struct Phases {
    /// The session thread stopped and handed its state back.
    pub frozen: Duration,
    /// Zero: the destination checks the application and the namespace before the freeze.
    pub ready: Duration,
    /// The client's segments are held.
    pub held: Duration,
    /// Repair mode entered, kernel state captured, slice encoded, source socket closed.
    pub captured: Duration,
    /// The destination restored the socket (with a queueing hold: and serves the session).
    pub restored: Duration,
    /// The hold is released.
    pub released: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    #[error("no session {0:#x} on this instance")]
    NoSession(u64),
    #[error("slice channel to the destination (session untouched): {0}")]
    Connect(#[from] ConnError),
    #[error("packet hold (session resumed here): {0}")]
    Hold(HoldError),
    #[error("capture (session resumed here): {0}")]
    Capture(RepairError),
    #[error("destination refused the slice (session resumed here): {0}")]
    Refused(String),
    #[error("slice channel broke before the hand-over (session resumed here): {0}")]
    Channel(FrameError),
    #[error(
        "segments reached the source socket after its capture (rcv_nxt {captured:#x} -> \
         {now:#x}); move abandoned, session resumed here"
    )]
    CaptureRaced { captured: u32, now: u32 },
    #[error("destination could not restore the socket (session restored here): {0}")]
    DestRestore(String),
    #[error("destination could not restore ({dest}) and neither could the source ({local}): session lost")]
    Lost { dest: String, local: RepairError },
    #[error("destination holds the session but did not confirm serving it: {0}")]
    Unconfirmed(FrameError),
}

pub(crate) fn send(conn: &mut Conn, m: &impl Serialize) -> Result<(), FrameError> {
    conn.send(kinds::SLICE, m)
}

pub(crate) fn recv<T: for<'de> Deserialize<'de>>(conn: &mut Conn) -> Result<T, FrameError> {
    let (kind, m) = conn.recv()?;
    if kind != kinds::SLICE {
        return Err(FrameError::Io(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("frame of kind {kind:#x} on the slice channel"),
        )));
    }
    Ok(m)
}

impl<A: SessionApp> Instance<A> {
    /// Moves session `id` to the instance `peer_name` listening on `peer`.
    pub fn migrate(
        &self,
        id: u64,
        peer: &Endpoint,
        peer_name: &str,
    ) -> Result<Moved, MigrateError> {
        let mut conn = connect(&self.inner, peer, peer_name)?;
        move_one(&self.inner, &mut conn, id)
    }

    /// Moves the sessions `ids` to `peer_name` one at a time, each as [`Instance::migrate`]
    /// (its own freeze, hold and pause), over one slice channel (opened again after a move
    /// that failed: only a completed move leaves the channel in a known state). `each` gets
    /// every session's result as it ends; `false` from it stops before the next session.
    pub fn migrate_each(
        &self,
        ids: &[u64],
        peer: &Endpoint,
        peer_name: &str,
        each: impl FnMut(u64, Result<Moved, MigrateError>) -> bool,
    ) {
        migrate_each(&self.inner, ids, peer, peer_name, each)
    }
}

/// [`Instance::migrate_each`].
pub(crate) fn migrate_each<A: SessionApp>(
    inner: &Arc<Inner<A>>,
    ids: &[u64],
    peer: &Endpoint,
    peer_name: &str,
    mut each: impl FnMut(u64, Result<Moved, MigrateError>) -> bool,
) {
    let mut conn: Option<Conn> = None;
    for &id in ids {
        let c = match conn.take() {
            Some(c) => Ok(c),
            None => connect(inner, peer, peer_name),
        };
        let r = c.map_err(MigrateError::from).and_then(|mut c| {
            let r = move_one(inner, &mut c, id);
            if r.is_ok() {
                conn = Some(c);
            }
            r
        });
        if !each(id, r) {
            return;
        }
    }
}

/// One move on an open slice channel.
fn move_one<A: SessionApp>(
    inner: &Arc<Inner<A>>,
    conn: &mut Conn,
    id: u64,
) -> Result<Moved, MigrateError> {
    prepare(inner, conn, id)?;
    let t0 = Instant::now();
    let f = inner.freeze(id).ok_or(MigrateError::NoSession(id))?;
    let moved = move_frozen(inner, conn, f, t0)?;
    inner.stats.moved_out.fetch_add(1, Ordering::Relaxed);
    Ok(Moved {
        pause: t0.elapsed(),
        ..moved
    })
}

/// The slice channel to the instance `peer_name` at `peer`, authenticated both ways.
pub(crate) fn connect<A: SessionApp>(
    inner: &Inner<A>,
    peer: &Endpoint,
    peer_name: &str,
) -> Result<Conn, ConnError> {
    let sec = &inner.security;
    let expect = Expect {
        name: Some(peer_name.to_string()),
        roles: role::REPLICA,
    };
    let opts = sec.options(peer, expect, MAX_FRAME);
    Conn::connect(peer, &sec.identity, &opts, CONNECT_TIMEOUT, &sec.tcp)
}

/// Puts a frozen session back to work where it is (nothing was handed over).
pub(crate) fn resume<A: SessionApp>(
    inner: &Arc<Inner<A>>,
    f: Frozen<A>,
    tuple: Option<(SocketAddr, SocketAddr)>,
) {
    // Held means in repair mode too (or failing to enter it, where leaving is harmless).
    if let Some((l, r)) = tuple {
        if let Err(e) = inner.hold.release(&l, &r) {
            tracing::error!(error = %e, "releasing the packet hold");
        }
        if let Err(e) = repair::leave_repair(&f.sock) {
            tracing::error!(error = %e, "leaving repair mode");
        }
    }
    if let Err(e) = inner.run(f) {
        tracing::error!(error = %e, "resuming a session");
    }
}

/// Asks the destination, before the session is frozen, whether it can take it: the network
/// namespace of the session's socket (recorded when its thread started) and an application
/// capsule of this application (a new session's: the session's own state is only known once
/// it is frozen, and is checked again, with the restore, after the close; a failure there
/// makes the source restore the session itself). The session runs on meanwhile, so this
/// round trip is not part of the pause.
fn prepare<A: SessionApp>(inner: &Inner<A>, conn: &mut Conn, id: u64) -> Result<(), MigrateError> {
    let netns = inner
        .session_netns(id)
        .ok_or(MigrateError::NoSession(id))?
        .ok_or_else(|| {
            MigrateError::Capture(RepairError::Sys {
                op: "SIOCGSKNS",
                source: std::io::Error::other("the session's network namespace is unknown"),
            })
        })?;
    let m = ToDest::Prepare {
        session_id: id,
        app: A::new_session().save(),
        netns,
        queued: inner.hold.mode() == crate::hold::HoldMode::Queue,
    };
    match send(conn, &m).and_then(|_| recv::<ToSource>(conn)) {
        Ok(ToSource::Ready) => Ok(()),
        Ok(ToSource::Refused(why)) => Err(MigrateError::Refused(why)),
        Ok(other) => Err(MigrateError::Refused(format!(
            "unexpected answer {other:?}"
        ))),
        Err(e) => Err(MigrateError::Channel(e)),
    }
}

fn move_frozen<A: SessionApp>(
    inner: &Arc<Inner<A>>,
    conn: &mut Conn,
    f: Frozen<A>,
    t0: Instant,
) -> Result<Moved, MigrateError> {
    let mut ph = Phases {
        frozen: t0.elapsed(),
        ..Phases::default()
    };
    let tuple = match (f.sock.local_addr(), f.sock.peer_addr()) {
        (Ok(l), Ok(r)) => (l, r),
        (Err(e), _) | (_, Err(e)) => {
            resume(inner, f, None);
            return Err(MigrateError::Capture(RepairError::Sys {
                op: "socket addresses",
                source: e,
            }));
        }
    };
    if let Err(e) = inner.hold.hold(&tuple.0, &tuple.1) {
        resume(inner, f, None);
        return Err(MigrateError::Hold(e));
    }
    ph.held = t0.elapsed();
    let captured = repair::enter_repair(&f.sock).and_then(|_| repair::capture(&f.sock));
    let tcp = match captured {
        Ok(t) => t,
        Err(e) => {
            resume(inner, f, Some(tuple));
            return Err(MigrateError::Capture(e));
        }
    };
    let slice = Slice {
        session_id: f.id,
        tcp,
        pending_out: f.out.clone(),
        app: f.app.save(),
    };
    let bytes = format::encode(&slice);
    // The hold was in place before the capture; a segment that had passed the filter just
    // before it could still have reached the socket after. Then the capture is stale: give up
    // the move rather than lose bytes the source acknowledged.
    match repair::recv_seq(&f.sock) {
        Ok(now) if now == slice.tcp.recv_seq => {}
        Ok(now) => {
            resume(inner, f, Some(tuple));
            return Err(MigrateError::CaptureRaced {
                captured: slice.tcp.recv_seq,
                now,
            });
        }
        Err(e) => {
            resume(inner, f, Some(tuple));
            return Err(MigrateError::Capture(e));
        }
    }
    let Frozen { sock, app, out, id } = f;
    if let Err(e) = repair::close_in_repair(sock) {
        // The socket is gone either way (dropped); restore from the capsule below.
        tracing::error!(error = %e, "closing the source socket in repair mode");
    }
    // A replicated session leaves the pair: its backup lets go of the 4-tuple's output
    // before the destination sends on it.
    inner.leaving(id);
    ph.captured = t0.elapsed();
    let answer = send(conn, &ToDest::Slice(bytes.clone())).and_then(|_| recv::<ToSource>(conn));
    // `Serving`: the destination runs the session already (queueing hold, see take_slice).
    let mut serving = false;
    let failure = match answer {
        Ok(ToSource::Restored) => None,
        Ok(ToSource::Serving) => {
            serving = true;
            None
        }
        Ok(ToSource::Failed(why)) => Some(why),
        Ok(other) => Some(format!("unexpected answer {other:?}")),
        Err(e) => Some(e.to_string()),
    };
    if let Some(dest) = failure {
        // Restored before the release: the queueing hold writes the held segments back at
        // once, and they must find the socket (not the listener, which would reset).
        let here = restore_here(inner, &slice, app, out, id);
        inner.hold.release(&tuple.0, &tuple.1).ok();
        return match here {
            Ok(()) => Err(MigrateError::DestRestore(dest)),
            Err(local) => Err(MigrateError::Lost { dest, local }),
        };
    }
    ph.restored = t0.elapsed();
    if let Err(e) = inner.hold.release(&tuple.0, &tuple.1) {
        tracing::error!(error = %e, "releasing the packet hold");
    }
    ph.released = t0.elapsed();
    if !serving {
        send(conn, &ToDest::Released)
            .and_then(|_| recv::<ToSource>(conn))
            .map_err(MigrateError::Unconfirmed)
            .and_then(|a| match a {
                ToSource::Serving => Ok(()),
                other => Err(MigrateError::Unconfirmed(FrameError::Io(
                    std::io::Error::other(format!("unexpected answer {other:?}")),
                ))),
            })?;
    }
    Ok(Moved {
        pause: Duration::ZERO,
        capsule_bytes: bytes.len(),
        options: slice.tcp.options,
        phases: ph,
    })
}

/// How long a restore waits for the source's closed socket to let go of the 4-tuple.
const TUPLE_FREE_WAIT: Duration = Duration::from_secs(2);

/// [`repair::restore`], retried while the 4-tuple is still in use. The source has closed its
/// socket before saying Go, but a close only releases the connection with the last reference
/// to the socket: a process that forks (any `Command::spawn` in it, on any thread) lends every
/// descriptor to the child until the child's `exec`, and a close in that window is finished
/// only then. Measured here: a move failing with the tuple in use while another thread of the
/// same process started `nft`.
pub(crate) fn restore_when_free(
    c: &crate::capsule::TcpCapsule,
) -> Result<std::net::TcpStream, RepairError> {
    let end = Instant::now() + TUPLE_FREE_WAIT;
    let mut step = Duration::from_micros(100);
    loop {
        match repair::restore(c) {
            Err(RepairError::TupleInUse { .. }) if Instant::now() < end => {
                std::thread::sleep(step);
                step = (step * 2).min(Duration::from_millis(20));
            }
            r => return r,
        }
    }
}

/// The source's way back when the destination could not restore after the source closed.
pub(crate) fn restore_here<A: SessionApp>(
    inner: &Arc<Inner<A>>,
    slice: &Slice,
    app: A,
    out: Vec<u8>,
    id: u64,
) -> Result<(), RepairError> {
    let sock = restore_when_free(&slice.tcp)?;
    repair::leave_repair(&sock)?;
    let mut all = slice.tcp.unsent_part().to_vec();
    all.extend_from_slice(&out);
    inner
        .run(Frozen {
            id,
            sock,
            app,
            out: all,
        })
        .map_err(|source| RepairError::Sys {
            op: "run restored session",
            source,
        })
}

/// The destination's side of one peer connection: authenticate, then take slices.
pub(crate) fn serve_peer<A: SessionApp>(inner: &Arc<Inner<A>>, s: Stream) {
    let sec = &inner.security;
    let expect = Expect {
        name: None,
        roles: role::REPLICA,
    };
    let opts = sec.options_for(peer_is_tcp(&s), expect, MAX_FRAME);
    let mut conn = match Conn::server(s, &sec.identity, &opts) {
        Ok(c) => c,
        Err(e) => {
            pliant_wire::server::count_handshake_failure(
                &e,
                &inner.stats.refused_peers,
                &inner.stats.aborted_handshakes,
                "slice peers",
            );
            return;
        }
    };
    loop {
        let done = match recv::<ToDest>(&mut conn) {
            Ok(ToDest::Prepare {
                session_id,
                app,
                netns,
                queued,
            }) => take_slice(inner, &mut conn, session_id, &app, netns, queued),
            Ok(ToDest::PrepareBatch(items)) => crate::batch::take_batch(inner, &mut conn, items),
            Ok(ToDest::Replicate(first)) => {
                crate::replicate::serve_primary(inner, &mut conn, first);
                return;
            }
            _ => return,
        };
        if done.is_err() {
            return;
        }
    }
}

pub(crate) fn refuse<A>(inner: &Inner<A>, conn: &mut Conn, why: String) -> Result<(), FrameError> {
    inner.stats.refused_capsules.fetch_add(1, Ordering::Relaxed);
    tracing::warn!(peer = %conn.peer.name, %why, "slice refused");
    send(conn, &ToSource::Refused(why))
}

/// One slice: `Err` ends the connection.
/// Ends repair mode on a restored socket and runs its session here: the never-sent part of
/// the send queue goes out first, then the output the session had pending.
pub(crate) fn start_restored<A: SessionApp>(
    inner: &Arc<Inner<A>>,
    slice: &Slice,
    app: A,
    sock: std::net::TcpStream,
) -> Result<(), FrameError> {
    if let Err(e) = repair::leave_repair(&sock) {
        tracing::error!(error = %e, "leaving repair mode on a restored socket");
    }
    let mut out = slice.tcp.unsent_part().to_vec();
    out.extend_from_slice(&slice.pending_out);
    inner
        .run(Frozen {
            id: slice.session_id,
            sock,
            app,
            out,
        })
        .map_err(FrameError::Io)?;
    inner.stats.moved_in.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

fn take_slice<A: SessionApp>(
    inner: &Arc<Inner<A>>,
    conn: &mut Conn,
    session_id: u64,
    app: &[u8],
    netns: u64,
    queued: bool,
) -> Result<(), FrameError> {
    // Checked before Ready: the source still holds the session and resumes it.
    match repair::thread_netns() {
        Ok(here) if here == netns => {}
        Ok(here) => {
            let e = RepairError::OtherNamespace {
                capsule: netns,
                here,
            };
            return refuse(inner, conn, e.to_string());
        }
        Err(e) => return refuse(inner, conn, format!("network namespace: {e}")),
    }
    if let Err(e) = A::load(app) {
        return refuse(inner, conn, format!("application capsule: {e}"));
    }
    send(conn, &ToSource::Ready)?;
    // Anything but the slice: the source kept the session.
    let ToDest::Slice(bytes) = recv::<ToDest>(conn)? else {
        return Ok(());
    };
    let restored = format::decode(&bytes)
        .map_err(|e| decode_reason(&e))
        .and_then(|slice| {
            if slice.session_id != session_id {
                return Err(format!(
                    "slice of session {:#x}, prepared for {session_id:#x}",
                    slice.session_id
                ));
            }
            let app = A::load(&slice.app).map_err(|e| format!("application capsule: {e}"))?;
            let sock = restore_when_free(&slice.tcp).map_err(|e| e.to_string())?;
            Ok((slice, app, sock))
        });
    let (slice, app, sock) = match restored {
        Ok(r) => r,
        Err(why) => {
            inner.stats.refused_capsules.fetch_add(1, Ordering::Relaxed);
            return send(conn, &ToSource::Failed(why));
        }
    };
    // With a queueing hold at the source, nothing the client sends is lost while it is held:
    // the answer to the window probe of TCP_REPAIR_OFF, and to whatever the session writes,
    // is queued and written back at the release. So the session runs now and the source
    // releases on `Serving`: one round trip less in the pause. A dropping hold would drop
    // that answer: then repair mode ends only after the release (`Released`).
    let released = if queued {
        None
    } else {
        send(conn, &ToSource::Restored)?;
        // The source releases the hold before saying so; if it went away meanwhile, the
        // session is ours all the same.
        Some(recv::<ToDest>(conn))
    };
    start_restored(inner, &slice, app, sock)?;
    if let Some(r) = released {
        r?;
    }
    send(conn, &ToSource::Serving)
}

fn decode_reason(e: &FormatError) -> String {
    format!("capsule: {e}")
}
