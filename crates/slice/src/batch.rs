//! Moving many sessions at once (a drain): one channel, one Prepare, one hold update, one
//! round trip for the capsules and one for the release per batch, instead of per session.
//!
//! ```text
//!   source                                         destination
//!   freeze every session of the batch (all told first, then joined)
//!   PrepareBatch([id, application capsule, netns]) ->  load each, check the namespace
//!                                              <-  Ready | Refused(why): the whole batch stays
//!   hold every 4-tuple (one hold update)
//!   per session: TCP_REPAIR on; capture; recheck rcv_nxt; close in repair mode
//!     (a session that fails here is resumed here and left out)
//!   Slices(capsules, more)...                  ->  decode and restore each (repair mode)
//!                                              <-  RestoredBatch([ok | why])
//!   restore here each one the destination could not; release every hold
//!   Released                                   ->  repair off and run each restored session
//!                                              <-  Serving
//! ```
//! The guarantees are the single move's ([`crate::migrate`]), session by session: until its
//! socket is closed a session that fails is resumed where it was, after it the source restores
//! it from its capsule.

use crate::capsule::Slice;
use crate::format;
use crate::instance::{Frozen, Inner, Instance, SessionApp};
use crate::migrate::{
    connect, recv, refuse, restore_here, restore_when_free, resume, send, MigrateError, ToDest,
    ToSource, MAX_FRAME,
};
use crate::repair::{self, RepairError};
use pliant_wire::endpoint::Endpoint;
use pliant_wire::frame::FrameError;
use pliant_wire::Conn;
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One session of a batch, as the destination checks it before the hold.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Prepared {
    session_id: u64,
    app: Vec<u8>,
    netns: u64,
}

/// What a batch move did.
#[derive(Debug, Clone, Default)]
pub struct BatchMoved {
    /// Sessions now served by the destination.
    pub moved: Vec<u64>,
    /// Sessions that stayed (resumed or restored here), with why.
    pub stayed: Vec<(u64, String)>,
    /// Freeze request to the destination serving the batch (summed over the batches).
    pub pause: Duration,
    pub capsule_bytes: usize,
    /// The steps of the last batch.
    pub phases: BatchPhases,
}

/// When each step of a batch ended, counted from the freeze request.
#[derive(Debug, Clone, Copy, Default)]
pub struct BatchPhases {
    pub frozen: Duration,
    pub ready: Duration,
    pub held: Duration,
    pub captured: Duration,
    pub restored: Duration,
    pub released: Duration,
}

/// A session captured and closed at the source, its capsule on its way.
struct Captured<A> {
    slice: Slice,
    bytes: Vec<u8>,
    tuple: (SocketAddr, SocketAddr),
    app: A,
    out: Vec<u8>,
}

impl<A: SessionApp> Instance<A> {
    /// Moves the sessions `ids` to the instance `peer_name` listening on `peer`, `batch` at a
    /// time (each batch one Prepare, one hold update and one exchange of capsules). A session
    /// that cannot move stays here (`BatchMoved::stayed`); a batch the destination refuses
    /// stays whole.
    pub fn migrate_batch(
        &self,
        ids: &[u64],
        peer: &Endpoint,
        peer_name: &str,
        batch: usize,
    ) -> Result<BatchMoved, MigrateError> {
        let inner = &self.inner;
        let mut conn = connect(inner, peer, peer_name)?;
        let mut all = BatchMoved::default();
        for chunk in ids.chunks(batch.max(1)) {
            let m = move_batch(inner, &mut conn, chunk)?;
            all.moved.extend(m.moved);
            all.stayed.extend(m.stayed);
            all.pause += m.pause;
            all.capsule_bytes += m.capsule_bytes;
            all.phases = m.phases;
        }
        Ok(all)
    }

    /// Moves every session of this instance to `peer_name` (see [`Instance::migrate_batch`]).
    pub fn drain_to(
        &self,
        peer: &Endpoint,
        peer_name: &str,
        batch: usize,
    ) -> Result<BatchMoved, MigrateError> {
        let ids = self.session_ids();
        self.migrate_batch(&ids, peer, peer_name, batch)
    }
}

fn move_batch<A: SessionApp>(
    inner: &Arc<Inner<A>>,
    conn: &mut Conn,
    ids: &[u64],
) -> Result<BatchMoved, MigrateError> {
    let t0 = Instant::now();
    let mut done = BatchMoved::default();
    let mut frozen = Vec::with_capacity(ids.len());
    for (id, f) in ids.iter().zip(inner.freeze_many(ids)) {
        let Some(f) = f else {
            done.stayed.push((*id, "no such session (ended?)".into()));
            continue;
        };
        let tuple = match (f.sock.local_addr(), f.sock.peer_addr()) {
            (Ok(l), Ok(r)) => (l, r),
            (Err(e), _) | (_, Err(e)) => {
                done.stayed.push((*id, format!("socket addresses: {e}")));
                resume(inner, f, None);
                continue;
            }
        };
        match repair::socket_netns(&f.sock) {
            Ok(netns) => frozen.push((f, tuple, netns)),
            Err(e) => {
                done.stayed.push((*id, format!("SIOCGSKNS: {e}")));
                resume(inner, f, None);
            }
        }
    }
    done.phases.frozen = t0.elapsed();
    let resume_all = |frozen: Vec<(Frozen<A>, (SocketAddr, SocketAddr), u64)>, held: bool| {
        for (f, tuple, _) in frozen {
            resume(inner, f, held.then_some(tuple));
        }
    };
    if frozen.is_empty() {
        return Ok(done);
    }
    let prepare = ToDest::PrepareBatch(
        frozen
            .iter()
            .map(|(f, _, netns)| Prepared {
                session_id: f.id,
                app: f.app.save(),
                netns: *netns,
            })
            .collect(),
    );
    match send(conn, &prepare).and_then(|_| recv::<ToSource>(conn)) {
        Ok(ToSource::Ready) => {}
        Ok(ToSource::Refused(why)) => {
            resume_all(frozen, false);
            return Err(MigrateError::Refused(why));
        }
        Ok(other) => {
            resume_all(frozen, false);
            return Err(MigrateError::Refused(format!(
                "unexpected answer {other:?}"
            )));
        }
        Err(e) => {
            resume_all(frozen, false);
            return Err(MigrateError::Channel(e));
        }
    }
    done.phases.ready = t0.elapsed();
    let tuples: Vec<_> = frozen.iter().map(|(_, t, _)| *t).collect();
    if let Err(e) = inner.hold.hold_many(&tuples) {
        resume_all(frozen, false);
        return Err(MigrateError::Hold(e));
    }
    done.phases.held = t0.elapsed();

    let mut captured: Vec<Captured<A>> = Vec::with_capacity(frozen.len());
    for (f, tuple, _) in frozen {
        let tcp = match repair::enter_repair(&f.sock).and_then(|_| repair::capture(&f.sock)) {
            Ok(t) => t,
            Err(e) => {
                done.stayed.push((f.id, format!("capture: {e}")));
                resume(inner, f, Some(tuple));
                continue;
            }
        };
        let slice = Slice {
            session_id: f.id,
            tcp,
            pending_out: f.out.clone(),
            app: f.app.save(),
        };
        // As in a single move: a segment that passed just before the hold makes the capture
        // stale; that session stays.
        match repair::recv_seq(&f.sock) {
            Ok(now) if now == slice.tcp.recv_seq => {}
            Ok(now) => {
                let e = MigrateError::CaptureRaced {
                    captured: slice.tcp.recv_seq,
                    now,
                };
                done.stayed.push((f.id, e.to_string()));
                resume(inner, f, Some(tuple));
                continue;
            }
            Err(e) => {
                done.stayed.push((f.id, format!("capture: {e}")));
                resume(inner, f, Some(tuple));
                continue;
            }
        }
        let bytes = format::encode(&slice);
        let Frozen { sock, app, out, .. } = f;
        if let Err(e) = repair::close_in_repair(sock) {
            tracing::error!(error = %e, "closing a source socket in repair mode");
        }
        captured.push(Captured {
            slice,
            bytes,
            tuple,
            app,
            out,
        });
    }
    // Replicated sessions leave the pair: the backup lets go of their output first.
    let ids: Vec<u64> = captured.iter().map(|c| c.slice.session_id).collect();
    inner.leaving_many(&ids);
    done.phases.captured = t0.elapsed();
    done.capsule_bytes = captured.iter().map(|c| c.bytes.len()).sum();

    let answer = send_slices(conn, &captured).and_then(|_| recv::<ToSource>(conn));
    let results: Vec<Option<String>> = match answer {
        Ok(ToSource::RestoredBatch(r)) if r.len() == captured.len() => r,
        Ok(other) => vec![Some(format!("unexpected answer {other:?}")); captured.len()],
        Err(e) => vec![Some(e.to_string()); captured.len()],
    };
    done.phases.restored = t0.elapsed();
    let held: Vec<_> = captured.iter().map(|c| c.tuple).collect();
    let mut any_moved = false;
    for (c, r) in captured.into_iter().zip(results) {
        let id = c.slice.session_id;
        match r {
            None => {
                any_moved = true;
                done.moved.push(id);
            }
            // Restored here before the release, as in a single move.
            Some(dest) => match restore_here(inner, &c.slice, c.app, c.out, id) {
                Ok(()) => done.stayed.push((id, format!("destination: {dest}"))),
                Err(local) => {
                    let e = MigrateError::Lost { dest, local };
                    tracing::error!(session = id, error = %e, "session lost");
                    done.stayed.push((id, e.to_string()));
                }
            },
        }
    }
    if let Err(e) = inner.hold.release_many(&held) {
        tracing::error!(error = %e, "releasing the packet hold");
    }
    done.phases.released = t0.elapsed();
    if any_moved {
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
    inner
        .stats
        .moved_out
        .fetch_add(done.moved.len() as u64, Ordering::Relaxed);
    done.pause = t0.elapsed();
    Ok(done)
}

/// The capsules in as many frames as they need (`more` on all but the last).
fn send_slices<A>(conn: &mut Conn, captured: &[Captured<A>]) -> Result<(), FrameError> {
    // Room for the envelope and the encoding's per-capsule lengths.
    let budget = MAX_FRAME / 2;
    let mut part: Vec<Vec<u8>> = Vec::new();
    let mut size = 0;
    for c in captured {
        if !part.is_empty() && size + c.bytes.len() > budget {
            let capsules = std::mem::take(&mut part);
            send(
                conn,
                &ToDest::Slices {
                    capsules,
                    more: true,
                },
            )?;
            size = 0;
        }
        size += c.bytes.len();
        part.push(c.bytes.clone());
    }
    send(
        conn,
        &ToDest::Slices {
            capsules: part,
            more: false,
        },
    )
}

/// The destination's side of one batch: `Err` ends the connection.
pub(crate) fn take_batch<A: SessionApp>(
    inner: &Arc<Inner<A>>,
    conn: &mut Conn,
    items: Vec<Prepared>,
) -> Result<(), FrameError> {
    let here = match repair::thread_netns() {
        Ok(n) => n,
        Err(e) => return refuse(inner, conn, format!("network namespace: {e}")),
    };
    for p in &items {
        if p.netns != here {
            let e = RepairError::OtherNamespace {
                capsule: p.netns,
                here,
            };
            return refuse(inner, conn, e.to_string());
        }
        if let Err(e) = A::load(&p.app) {
            return refuse(
                inner,
                conn,
                format!("application capsule of {:#x}: {e}", p.session_id),
            );
        }
    }
    send(conn, &ToSource::Ready)?;
    let mut capsules = Vec::new();
    loop {
        match recv::<ToDest>(conn)? {
            ToDest::Slices { capsules: c, more } => {
                capsules.extend(c);
                if !more {
                    break;
                }
            }
            // Anything else: the source kept the batch.
            _ => return Ok(()),
        }
    }
    let prepared: std::collections::HashSet<u64> = items.iter().map(|p| p.session_id).collect();
    let mut results = Vec::with_capacity(capsules.len());
    let mut restored = Vec::new();
    for bytes in &capsules {
        let r = format::decode(bytes)
            .map_err(|e| format!("capsule: {e}"))
            .and_then(|slice| {
                if !prepared.contains(&slice.session_id) {
                    return Err(format!(
                        "slice of session {:#x}, not prepared",
                        slice.session_id
                    ));
                }
                let app = A::load(&slice.app).map_err(|e| format!("application capsule: {e}"))?;
                let sock = restore_when_free(&slice.tcp).map_err(|e| e.to_string())?;
                Ok((slice, app, sock))
            });
        match r {
            Ok(x) => {
                restored.push(x);
                results.push(None);
            }
            Err(why) => {
                inner.stats.refused_capsules.fetch_add(1, Ordering::Relaxed);
                results.push(Some(why));
            }
        }
    }
    send(conn, &ToSource::RestoredBatch(results))?;
    if restored.is_empty() {
        return Ok(());
    }
    let released = recv::<ToDest>(conn);
    for (slice, app, sock) in restored {
        crate::migrate::start_restored(inner, &slice, app, sock)?;
    }
    released?;
    send(conn, &ToSource::Serving)
}
