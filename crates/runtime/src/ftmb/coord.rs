//! The coordinator thread: everything that needs all workers stopped at a packet boundary
//! (a barrier), off the engine's I/O thread so packets keep being received meanwhile.
//!
//! - Snapshots, every `snapshot_every` once protected: park all workers (each flushes and
//!   takes its flow delta on its own thread), read the shared variables and the master's
//!   counters, resume, then ship the `SnapshotMsg` (the send is outside the pause). A failed
//!   send or an abandoned barrier makes the next snapshot full: a lost delta cannot be patched.
//! - `ftmb_protect`: connect the session and one stream per queue to the new logger, park,
//!   ship a FULL snapshot, and resume every worker on its new transport (input records on);
//!   the previous logger (in-process or network) is dropped.
//! - `ftmb_activate`: recover a primary whose logs this replica hosts (see [`Coord::activate`]).
//! - `flows`: the steering keys of our live flows, from a [`FlowIndex`] the coordinator keeps
//!   from the flow deltas the snapshots take anyway (see [`Coord::flows`]).
//!
//! The pause (first worker parked -> all resumed) is kept per snapshot for `ftmb_status`.

use super::local_logger::{LocalAudit, LocalLogger};
use super::nf::{FlowDelta, FlowRecord, FtmbNf};
use super::release::ReleaseQueue;
use super::worker::{self, Ctl, Job, Parked, Post, WorkerPub};
use pliant_ftmb::{
    HeldOutputs, LoggerAddr, LoggerConfig, LoggerServer, Master, MasterConfig, NetOptions,
    NetTransport, OutputLogger, QueueId, SnapshotLink, SnapshotMsg,
};
use pliant_net::FlowKey;
use pliant_wire::{Endpoint, Security};
use serde_json::{json, Value};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a barrier waits for every worker to park (a worker stuck longer is a bug or a
/// stalled logger; the barrier is abandoned and reported, the workers go on).
const BARRIER_WAIT: Duration = Duration::from_secs(5);
/// Pause samples kept for the percentiles.
const PAUSE_SAMPLES: usize = 4096;
/// Recoveries listed in `ftmb_status`.
const RECOVERIES_KEPT: usize = 16;
/// While protected, the coordinator checks the logger's streams this often (between
/// snapshots): a lost logger's held output is released within this plus one barrier, not
/// after a snapshot interval (up to 10 s) or any connect timeout.
const LOGGER_CHECK: Duration = Duration::from_millis(5);

pub(crate) enum Op {
    Protect {
        logger: String,
        host: Option<String>,
        reply: SyncSender<Value>,
    },
    Activate {
        primary: String,
        reply: SyncSender<Value>,
        /// When the engine took the request (the reply reports the wait before it started).
        asked: Instant,
    },
    /// `flows`: list at most `max` flows (the engine's `max_listed_flows`).
    Flows {
        max: usize,
        reply: SyncSender<Value>,
    },
}

/// A flow's key and its aliases other than the key.
type Steering = (FlowKey, Vec<FlowKey>);

/// The steering keys of every live flow of our workers, for `flows` (the controller's
/// exception GC and the retirement of failed-over replicas depend on it).
///
/// Why a mirror fed by deltas rather than asking each worker for its key list: the NF can
/// list its flows only through `take_delta`, which also resets its change tracking, so a
/// listing must go through the same deltas the snapshots ship (a full listing per request
/// would force the next snapshot to be full). Kept up by the periodic snapshots at no extra
/// barrier (only the coordinator's own time after the workers resumed: steering keys of the
/// changed records); a `flows` request adds one delta barrier, as short as a snapshot's, so
/// the answer is current (see [`Coord::flows`]). Bounded by the workers' own tables (one
/// entry per live record).
#[derive(Default)]
pub(crate) struct FlowIndex {
    /// Per queue: the NF's record key -> (flow key, its aliases other than the key).
    queues: Vec<HashMap<Vec<u8>, Steering>>,
    /// False until a full delta was applied, and again once a taken delta was lost (an
    /// abandoned barrier, a failed capture): only a full delta can make it right.
    valid: bool,
    /// Barriers' deltas applied so far (tells `flows` whether its barrier got through).
    applied: u64,
}

impl FlowIndex {
    /// Applies worker `queue`'s delta (`full`: it lists every live record).
    fn apply<F: FtmbNf>(&mut self, nf: &F, queue: usize, delta: Vec<FlowDelta>, full: bool) {
        if self.queues.len() <= queue {
            self.queues.resize_with(queue + 1, HashMap::new);
        }
        let q = &mut self.queues[queue];
        if full {
            q.clear();
        }
        for (k, rec) in delta {
            let Some(r) = rec else {
                q.remove(&k);
                continue;
            };
            let record = (k, r);
            // Records that are no flow (the NAT's per-worker record) have no steering keys.
            match nf.steering_keys(&record) {
                Some((key, aliases)) => {
                    let aliases = aliases.into_iter().filter(|a| *a != key).collect();
                    q.insert(record.0, (key, aliases));
                }
                None => {
                    q.remove(&record.0);
                }
            }
        }
    }

    /// Applies the deltas of one barrier (per queue, in queue order).
    fn apply_all<F: FtmbNf>(&mut self, nf: &F, deltas: Vec<Vec<FlowDelta>>, full: bool) {
        if !full && !self.valid {
            // An increment on top of a lost one would still be wrong: wait for a full one.
            return;
        }
        for (q, d) in deltas.into_iter().enumerate() {
            self.apply(nf, q, d, full);
        }
        self.valid = true;
        self.applied += 1;
    }

    /// The `flows` answer, in the engine's shape (`version` is null: FTMB records carry no
    /// migration version).
    fn listing(&self, max: usize) -> Value {
        let total: usize = self.queues.iter().map(HashMap::len).sum();
        let flows: Vec<Value> = self
            .queues
            .iter()
            .enumerate()
            .flat_map(|(q, m)| m.values().map(move |f| (q, f)))
            .take(max)
            .map(|(q, (key, aliases))| {
                let aliases: Vec<String> = aliases.iter().map(ToString::to_string).collect();
                json!({"key": key.to_string(), "aliases": aliases, "version": Value::Null,
                       "queue": q})
            })
            .collect();
        json!({"ok": true, "total": total, "listed": flows.len(), "flows": flows})
    }
}

/// What `ftmb_status` shows of the coordinator (updated by it, read by the engine thread).
#[derive(Default)]
pub(crate) struct CoordStatus {
    pub logger: Option<String>,
    pub protected: bool,
    pub session_epoch: u64,
    pub snapshots: u64,
    pub full_snapshots: u64,
    pub snapshot_failures: u64,
    pub barrier_failures: u64,
    /// Times the network logger was lost and the workers fell back to the in-process logger.
    pub fallbacks: u64,
    pub last_snapshot_id: Option<u64>,
    pub last_snapshot_acked: Option<u64>,
    /// The session stream's counters (bytes shipped, blocked writes).
    pub link_stats: Value,
    /// Sends to the in-process logger that waited for room (back-pressure), if it is in use.
    pub local_blocked_sends: Option<u64>,
    /// `LoggerServer::status()` of the logger we host, refreshed by the coordinator every
    /// tick: the call waits for the server's I/O thread, which the engine's packet thread
    /// must never do.
    pub hosting: Value,
    pub pauses_us: VecDeque<u64>,
    /// Outputs the lost loggers had not confirmed, released by this replica at a fallback.
    pub held_released_at_fallback: u64,
    pub last_error: Option<String>,
    pub recoveries: VecDeque<Value>,
}

impl CoordStatus {
    fn pause(&mut self, us: u64) {
        if self.pauses_us.len() >= PAUSE_SAMPLES {
            self.pauses_us.pop_front();
        }
        self.pauses_us.push_back(us);
    }

    /// (p50, p99) of the kept pause samples, microseconds.
    pub fn pause_percentiles(&self) -> (Option<u64>, Option<u64>) {
        let mut v: Vec<u64> = self.pauses_us.iter().copied().collect();
        if v.is_empty() {
            return (None, None);
        }
        v.sort_unstable();
        let at = |p: f64| v[((v.len() - 1) as f64 * p).round() as usize];
        (Some(at(0.50)), Some(at(0.99)))
    }
}

pub(crate) struct Coord<F: FtmbNf> {
    pub nf: Arc<F>,
    pub master: Arc<Master>,
    pub shared: Arc<F::Shared>,
    pub ctl: Vec<Sender<Ctl>>,
    pub pokes: Vec<SyncSender<Job>>,
    pub name: String,
    /// The replica's identity: the logger checks that our master name is its certified name.
    pub security: Option<Security>,
    pub snapshot_every: Duration,
    pub net: NetOptions,
    pub replay_limit: Duration,
    pub link: Option<SnapshotLink>,
    pub next_snap_id: u64,
    pub need_full: bool,
    pub local: Option<LocalLogger>,
    /// Per queue, the output the current network logger has not confirmed released yet
    /// (this replica transmits its own output, see [`Coord::try_protect`]); empty while the
    /// in-process logger releases.
    pub held: Vec<Arc<HeldOutputs>>,
    pub status: Arc<Mutex<CoordStatus>>,
    pub hosting: Option<Arc<LoggerServer>>,
    pub release: Arc<ReleaseQueue>,
    /// Output-commit audit counts of every in-process logger spawned here.
    pub local_audit: Arc<LocalAudit>,
    /// Recoveries asked for and not finished (the engine holds packets while > 0).
    pub recovering: Arc<AtomicUsize>,
    /// The workers' published counters (their log errors tell a broken stream).
    pub pubs: Vec<Arc<Mutex<WorkerPub>>>,
    /// Sum of the workers' log errors when last checked.
    pub log_errors_seen: u64,
    /// What `flows` lists (see [`FlowIndex`]).
    pub index: FlowIndex,
}

fn lock(s: &Mutex<CoordStatus>) -> std::sync::MutexGuard<'_, CoordStatus> {
    s.lock().unwrap_or_else(|e| e.into_inner())
}

impl<F: FtmbNf> Coord<F> {
    pub fn run(mut self, ops: Receiver<Op>) {
        self.refresh_link_status();
        let mut next = Instant::now() + self.snapshot_every;
        loop {
            let mut wait = next.saturating_duration_since(Instant::now());
            let checking = !self.held.is_empty() && wait > LOGGER_CHECK;
            if checking {
                wait = LOGGER_CHECK;
            }
            match ops.recv_timeout(wait) {
                Ok(Op::Protect {
                    logger,
                    host,
                    reply,
                }) => {
                    let v = self.protect(&logger, host.as_deref());
                    let _ = reply.try_send(v);
                    next = Instant::now() + self.snapshot_every;
                }
                Ok(Op::Activate {
                    primary,
                    reply,
                    asked,
                }) => {
                    let queued_ms = asked.elapsed().as_secs_f64() * 1000.0;
                    let mut v = self.activate(&primary);
                    v["queued_ms"] = json!(queued_ms);
                    // Whatever happened, the engine stops holding for this recovery (and is
                    // woken to dispatch what it held, should it be asleep).
                    self.recovering.fetch_sub(1, Ordering::AcqRel);
                    self.release.wake();
                    let _ = reply.try_send(v);
                }
                Ok(Op::Flows { max, reply }) => {
                    let v = self.flows(max);
                    let _ = reply.try_send(v);
                }
                Err(RecvTimeoutError::Timeout) if checking => {
                    // Only the cheap check between snapshots (no status refresh).
                    self.check_logger();
                    continue;
                }
                Err(RecvTimeoutError::Timeout) => {
                    if self.link.as_ref().is_some_and(|l| l.broken().is_none()) {
                        if let Err(e) = self.snapshot(false) {
                            lock(&self.status).last_error = Some(e);
                        }
                    }
                    next = Instant::now() + self.snapshot_every;
                }
                Err(RecvTimeoutError::Disconnected) => break,
            }
            self.refresh_link_status();
            self.check_logger();
        }
    }

    /// A lost logger (session stream broken, or a worker's stream failing) leaves the
    /// workers' output unreleasable: fall back to an in-process logger, unprotected, until the
    /// controller names a new logger (`ftmb_protect`). Pico does the same with a dead backup
    /// (its groups run unprotected): availability first, and the status says so.
    fn check_logger(&mut self) {
        let Some(link) = self.link.as_ref() else {
            return;
        };
        let log_errors: u64 = self
            .pubs
            .iter()
            .map(|p| p.lock().unwrap_or_else(|e| e.into_inner()).log_errors)
            .sum();
        let why = if let Some(b) = link.broken() {
            format!("snapshot link: {b}")
        } else if let Some(b) = self.held.iter().find_map(|h| h.lost()) {
            // A queue stream's reader saw the logger close or fail (even with no batch sent).
            format!("worker stream: {b}")
        } else if log_errors > self.log_errors_seen {
            let last = self
                .pubs
                .iter()
                .filter_map(|p| {
                    p.lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .last_error
                        .clone()
                })
                .next_back()
                .unwrap_or_default();
            format!("worker stream: {last}")
        } else {
            return;
        };
        self.log_errors_seen = log_errors;
        match self.fall_back(&why) {
            Ok(()) => tracing::warn!(reason = %why, "ftmb: logger lost, running unprotected"),
            Err(e) => lock(&self.status).last_error = Some(format!("logger lost ({why}); {e}")),
        }
    }

    /// Moves every worker to a fresh in-process logger starting at the current PAL positions.
    fn fall_back(&mut self, why: &str) -> Result<(), String> {
        let n = self.ctl.len();
        let parked = self.barrier(None)?;
        // Parked and flushed: no PAL of any queue is pending, so the positions are final.
        let pal: Vec<u64> = (0..n)
            .map(|q| self.master.queue_max(q as QueueId).unwrap_or(0))
            .collect();
        let made = OutputLogger::new(LoggerConfig::new(n))
            .map_err(|e| e.to_string())
            .and_then(|mut l| {
                l.start_at(&pal);
                LocalLogger::spawn(l, Arc::clone(&self.release), Arc::clone(&self.local_audit))
                    .map_err(|e| e.to_string())
            })
            .and_then(|local| {
                let ts = (0..n)
                    .map(|q| local.transport(q).map_err(|e| e.to_string()))
                    .collect::<Result<Vec<_>, String>>()?;
                Ok((local, ts))
            });
        let (local, ts) = match made {
            Ok(x) => x,
            Err(e) => {
                self.resume(parked, Vec::new());
                return Err(format!("fallback logger: {e}"));
            }
        };
        // The lost logger's unconfirmed output goes now, before any output of the fallback
        // logger (the workers are parked and flushed: nothing more can join it). This gives
        // output commit up for it — its PALs are on no logger that will survive — which is
        // what falling back means for every later output too (crates/ftmb/README.md, "Output
        // when the logger dies"): the alternative is losing it on flows that did not fail.
        let released = self.release_held();
        let posts = ts
            .into_iter()
            .map(|t| Post::SetTransport {
                transport: Box::new(t),
                log_input: false,
            })
            .collect();
        {
            // Before the workers go on: their first local release must find the status told.
            let mut st = lock(&self.status);
            st.fallbacks += 1;
            st.protected = false;
            st.logger = None;
            st.last_error = Some(format!(
                "logger lost ({why}): unprotected until ftmb_protect"
            ));
            st.held_released_at_fallback += released as u64;
        }
        self.resume(parked, posts);
        self.local = Some(local);
        self.link = None;
        self.need_full = true;
        // Errors of the dead streams are counted already; only new ones mean a new failure.
        self.log_errors_seen = self
            .pubs
            .iter()
            .map(|p| p.lock().unwrap_or_else(|e| e.into_inner()).log_errors)
            .sum();
        Ok(())
    }

    /// Releases (transmits) what the current network logger holds unconfirmed, in order per
    /// queue, and forgets it; only with every worker parked. Returns how many outputs went.
    fn release_held(&mut self) -> usize {
        std::mem::take(&mut self.held)
            .iter()
            .map(|h| h.release_all())
            .sum()
    }

    fn refresh_link_status(&mut self) {
        let (acked, broken, stats) = match self.link.as_mut() {
            Some(l) => (
                l.acked(),
                l.broken().map(str::to_string),
                serde_json::to_value(l.stats()).unwrap_or(Value::Null),
            ),
            None => (None, None, Value::Null),
        };
        let local_blocked = self
            .local
            .as_ref()
            .map(|l| l.blocked_sends.load(Ordering::Relaxed));
        let hosting = self.hosting.as_ref().map_or(Value::Null, |h| h.status());
        let mut st = lock(&self.status);
        st.hosting = hosting;
        st.link_stats = stats;
        st.local_blocked_sends = local_blocked;
        st.last_snapshot_acked = acked.or(st.last_snapshot_acked);
        st.protected = self.link.is_some() && broken.is_none();
        if let Some(b) = broken {
            st.last_error = Some(format!("snapshot link: {b}"));
        }
    }

    /// Parks every worker at a packet boundary; `delta`: each takes its flow delta.
    fn barrier(&mut self, delta: Option<bool>) -> Result<Vec<Parked>, String> {
        let n = self.ctl.len();
        let (atx, arx) = mpsc::sync_channel(n);
        for q in 0..n {
            let park = Ctl::Park {
                delta,
                arrived: atx.clone(),
            };
            if self.ctl[q].send(park).is_err() {
                return Err(format!("worker {q} is gone"));
            }
            // An idle worker blocks on its input queue: wake it (a full queue is not idle).
            let _ = self.pokes[q].try_send(Job::Poke);
        }
        drop(atx);
        let deadline = Instant::now() + BARRIER_WAIT;
        let mut parked: Vec<Parked> = Vec::with_capacity(n);
        while parked.len() < n {
            match arx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(p) => parked.push(p),
                Err(_) => {
                    let got = parked.len();
                    for p in parked {
                        let _ = p.resume.send(Post::Continue);
                    }
                    // Deltas taken by the workers that did park are lost with the barrier.
                    self.need_full = true;
                    if delta.is_some() {
                        self.index.valid = false;
                    }
                    lock(&self.status).barrier_failures += 1;
                    return Err(format!(
                        "barrier: only {got} of {n} workers stopped within {} ms",
                        BARRIER_WAIT.as_millis()
                    ));
                }
            }
        }
        parked.sort_by_key(|p| p.queue);
        Ok(parked)
    }

    /// Resumes parked workers with their posts; returns the pause in microseconds.
    fn resume(&self, parked: Vec<Parked>, mut posts: Vec<Post>) -> u64 {
        let first = parked.iter().map(|p| p.at).min();
        for p in parked.into_iter().rev() {
            let post = posts.pop().unwrap_or(Post::Continue);
            let _ = p.resume.send(post);
        }
        let us = first.map_or(0, |t| t.elapsed().as_micros() as u64);
        lock(&self.status).pause(us);
        us
    }

    /// Builds the snapshot of the parked workers (their deltas are taken out of `parked`).
    fn capture(&mut self, parked: &mut [Parked], full: bool) -> Result<SnapshotMsg, String> {
        let meta = self
            .nf
            .save_shared(&self.shared)
            .map_err(|e| format!("save shared variables: {e}"))
            .and_then(|image| {
                let input_next = parked.iter().map(|p| p.input_next).collect();
                self.master
                    .snapshot(image, input_next)
                    .map_err(|e| format!("snapshot metadata: {e}"))
            })
            // The deltas the workers took are dropped with `parked`: the index lost them.
            .inspect_err(|_| self.index.valid = false)?;
        let locals = parked
            .iter_mut()
            .map(|p| p.delta.take().unwrap_or_default())
            .collect();
        let id = self.next_snap_id;
        self.next_snap_id += 1;
        Ok(SnapshotMsg {
            id,
            full,
            meta,
            locals,
        })
    }

    fn shipped(&mut self, snap: &SnapshotMsg) {
        let mut st = lock(&self.status);
        st.snapshots += 1;
        st.full_snapshots += u64::from(snap.full);
        st.last_snapshot_id = Some(snap.id);
    }

    /// The deltas of a captured snapshot into the flow index (shipped or not: the workers'
    /// change tracking was reset either way). After the send, so it never delays the ship.
    fn index_snapshot(&mut self, snap: SnapshotMsg) {
        self.index.apply_all(&*self.nf, snap.locals, snap.full);
    }

    /// `flows`: the steering keys of our live flows, in the engine's `flows` shape, as of a
    /// delta barrier taken now: protected, an early snapshot (the logger must get every
    /// delta); unprotected, a barrier for the index only. Current rather than as of the last
    /// snapshot, because the controller removes the steering exceptions of the keys missing
    /// here: a flow created since must not look ended. The cost is one short pause per
    /// request (the controller asks every `gc_interval_ms`, 5 s by default).
    pub fn flows(&mut self, max: usize) -> Value {
        let before = self.index.applied;
        let refreshed = if self.link.is_some() {
            self.snapshot(false).map(|_| ())
        } else {
            self.index_barrier()
        };
        match refreshed {
            // A failed send after the barrier still brought the index up to date.
            Err(e) if self.index.applied == before => {
                json!({"ok": false, "error": format!("flows: {e}")})
            }
            _ => self.index.listing(max),
        }
    }

    /// Unprotected: a barrier only to take the workers' deltas for the index (no logger to
    /// ship them to; the next `ftmb_protect` starts with a full snapshot anyway).
    fn index_barrier(&mut self) -> Result<(), String> {
        let full = !self.index.valid;
        let mut parked = self.barrier(Some(full))?;
        let deltas: Vec<Vec<FlowDelta>> = parked
            .iter_mut()
            .map(|p| p.delta.take().unwrap_or_default())
            .collect();
        self.resume(parked, Vec::new());
        self.index.apply_all(&*self.nf, deltas, full);
        Ok(())
    }

    /// One periodic (or forced full) snapshot to the current logger.
    pub fn snapshot(&mut self, full: bool) -> Result<u64, String> {
        if self.link.is_none() {
            return Err("not protected: no logger to snapshot to".into());
        }
        // A full one also when the flow index lost a delta (its only way back).
        let full = full || self.need_full || !self.index.valid;
        let mut parked = self.barrier(Some(full))?;
        let snap = self.capture(&mut parked, full);
        self.resume(parked, Vec::new());
        let snap = snap.inspect_err(|_| self.need_full = true)?;
        let Some(link) = self.link.as_mut() else {
            self.index_snapshot(snap);
            return Err("not protected".into());
        };
        let sent = link.send(&snap);
        let id = snap.id;
        let r = match sent {
            Ok(()) => {
                self.need_full = false;
                self.shipped(&snap);
                Ok(id)
            }
            Err(e) => {
                self.need_full = true;
                lock(&self.status).snapshot_failures += 1;
                Err(format!("snapshot {id}: {e}"))
            }
        };
        self.index_snapshot(snap);
        r
    }

    /// `ftmb_protect`: log to the logger at `path` (a unix path or TCP `host:port`) from now
    /// on; `host`, if given, is the replica that must answer there.
    pub fn protect(&mut self, path: &str, host: Option<&str>) -> Value {
        match self.try_protect(path, host) {
            Ok(v) => v,
            Err(e) => {
                lock(&self.status).last_error = Some(e.clone());
                json!({"ok": false, "error": e})
            }
        }
    }

    fn try_protect(&mut self, path: &str, host: Option<&str>) -> Result<Value, String> {
        let Some(sec) = self.security.clone() else {
            return Err("no [security] identity: cannot authenticate to a logger".into());
        };
        let ep: Endpoint = path.parse().map_err(|e| format!("logger {path:?}: {e}"))?;
        // Idempotent: already logging to this logger over a healthy session, a repeated
        // request (a controller retry, a poll that raced a failover's re-protection) must not
        // restart the session and its full snapshot, nor bump the epoch.
        let healthy = self.link.as_mut().is_some_and(|l| l.broken().is_none()) && !self.need_full;
        {
            let st = lock(&self.status);
            if healthy && st.protected && st.logger.as_deref() == Some(path) {
                return Ok(
                    json!({"ok": true, "logger": path, "epoch": st.session_epoch,
                                 "unchanged": true}),
                );
            }
        }
        let n = self.ctl.len();
        let epoch = lock(&self.status).session_epoch + 1;
        let to = LoggerAddr::new(ep, host);
        // Session first: its hello opens (or replaces) our logs at the logger.
        let mut link = SnapshotLink::connect(&to, &sec, &self.name, epoch, n, &self.net)
            .map_err(|e| format!("logger {path}: session: {e}"))?;
        // Our output stays here until the logger confirms it released it, and this replica
        // transmits it: held by the logger host, it would die with that host (the flows of a
        // replica that did not fail would lose it). See `pliant_ftmb::HeldOutputs`.
        let mut transports = Vec::with_capacity(n);
        let mut held = Vec::with_capacity(n);
        for q in 0..n {
            let rq = Arc::clone(&self.release);
            let (t, h) =
                NetTransport::connect(&to, &sec, &self.name, q as QueueId, epoch, &self.net)
                    .and_then(|t| t.releasing(Box::new(move |p| rq.push(p))))
                    .map_err(|e| format!("logger {path}: queue {q}: {e}"))?;
            transports.push(t);
            held.push(h);
        }
        let mut parked = self.barrier(Some(true))?;
        let snap = match self.capture(&mut parked, true) {
            Ok(s) => s,
            Err(e) => {
                self.resume(parked, Vec::new());
                self.need_full = true;
                return Err(e);
            }
        };
        // The full snapshot goes before any batch of the new streams: the logger's logs start
        // at its positions.
        if let Err(e) = link.send(&snap) {
            self.resume(parked, Vec::new());
            self.need_full = true;
            self.index_snapshot(snap);
            return Err(format!("logger {path}: full snapshot: {e}"));
        }
        // Output of the previous logger goes before any of the new one's: the in-process
        // logger's is handed out now, a previous network logger's unconfirmed output is
        // released (its PALs are covered by the full snapshot just shipped).
        if let Some(l) = &self.local {
            l.sync();
        }
        self.release_held();
        self.held = held;
        let posts = transports
            .into_iter()
            .map(|t| Post::SetTransport {
                transport: Box::new(t),
                log_input: true,
            })
            .collect();
        let pause_us = self.resume(parked, posts);
        // The workers dropped their previous transports when they resumed: the in-process
        // logger (if it was still in use) releases what it holds and ends.
        if let Some(l) = self.local.take() {
            l.finish();
        }
        self.link = Some(link);
        self.need_full = false;
        self.shipped(&snap);
        let snapshot_id = snap.id;
        self.index_snapshot(snap);
        self.log_errors_seen = self
            .pubs
            .iter()
            .map(|p| p.lock().unwrap_or_else(|e| e.into_inner()).log_errors)
            .sum();
        {
            let mut st = lock(&self.status);
            st.session_epoch = epoch;
            st.logger = Some(path.to_string());
            st.protected = true;
            st.last_error = None;
        }
        tracing::info!(logger = path, epoch, pause_us, "ftmb: protected");
        Ok(
            json!({"ok": true, "logger": path, "epoch": epoch, "snapshot_id": snapshot_id,
                  "pause_us": pause_us}),
        )
    }

    /// `ftmb_activate`: recovers `primary` from the logs this replica hosts and imports its
    /// flows here.
    ///
    /// 1. `take_for_recovery` fences the primary at our logger and hands its last snapshot,
    ///    the logged input after it, and the output logger (with the replay schedules cut);
    /// 2. a temporary recovery master re-declares the primary's shared variables from the
    ///    snapshot image, its workers rebuild their flows from the snapshot records and replay
    ///    the logged input in order (PAL-gated shared accesses, logged clock/RNG values);
    /// 3. their output goes through an in-process logger around the primary's output logger,
    ///    which suppresses what was released before the failure and releases the rest here;
    /// 4. the recovered flow records are imported into this replica's own workers at a
    ///    barrier (`record_queue` picks the worker), then a full snapshot goes to our own
    ///    logger if we are protected.
    pub fn activate(&mut self, primary: &str) -> Value {
        match self.try_activate(primary) {
            Ok(v) => v,
            Err(e) => {
                lock(&self.status).last_error = Some(e.clone());
                tracing::warn!(primary, error = %e, "ftmb: recovery failed");
                json!({"ok": false, "error": e})
            }
        }
    }

    fn try_activate(&mut self, primary: &str) -> Result<Value, String> {
        let Some(server) = self.hosting.clone() else {
            return Err("this replica hosts no FTMB logger (it needs [security])".into());
        };
        let t0 = Instant::now();
        let bundle = server
            .take_for_recovery(primary)
            .map_err(|e| format!("recover {primary}: {e}"))?;
        let n = bundle.snapshot.pal_seq.len();
        let mut cfg = MasterConfig::new(n);
        cfg.replay_wait_limit = self.replay_limit;
        let master = Master::recovering(cfg, &bundle.snapshot, bundle.recovery)
            .map_err(|e| format!("recover {primary}: {e}"))?;
        let shared = self
            .nf
            .declare(&master, Some(&bundle.snapshot.nf_state))
            .map_err(|e| format!("recover {primary}: shared variables: {e}"))?;
        let logger = LocalLogger::spawn(
            bundle.logger,
            Arc::clone(&self.release),
            Arc::clone(&self.local_audit),
        )
        .map_err(|e| format!("recover {primary}: logger thread: {e}"))?;
        let mut inputs = bundle.inputs;
        inputs.resize_with(n, Vec::new);
        let mut jobs = Vec::with_capacity(n);
        for (q, input) in inputs.into_iter().enumerate() {
            let records = bundle.locals.get(q).map_or(&[][..], |v| v.as_slice());
            let local = self
                .nf
                .new_local(q as QueueId, records)
                .map_err(|e| format!("recover {primary}: queue {q} flows: {e}"))?;
            let t = logger
                .transport(q)
                .map_err(|e| format!("recover {primary}: {e}"))?;
            let w = master
                .worker(q as QueueId, Box::new(t))
                .map_err(|e| format!("recover {primary}: {e}"))?;
            jobs.push((w, local, input));
        }
        // Replay on one thread per queue: the queues' accesses interleave as the log says.
        let nf = &*self.nf;
        let shared = &shared;
        let results: Vec<Result<(F::Local, u64), String>> = std::thread::scope(|s| {
            let handles: Vec<_> = jobs
                .into_iter()
                .map(|(mut w, mut local, input)| {
                    s.spawn(move || {
                        worker::replay_queue(nf, shared, &mut w, &mut local, input)
                            .map(|n| (local, n))
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err("a replay thread panicked".into()))
                })
                .collect()
        });
        // Every transport is gone with its worker: the logger releases the rest and ends.
        let logger = logger.finish();
        let suppressed = logger.as_ref().map_or(0, |l| l.stats.outputs_suppressed);
        let mut locals = Vec::with_capacity(n);
        let mut replayed = 0;
        for (q, r) in results.into_iter().enumerate() {
            let (local, k) = r.map_err(|e| format!("recover {primary}: queue {q}: {e}"))?;
            replayed += k;
            locals.push(local);
        }
        let replay_ms = t0.elapsed().as_secs_f64() * 1000.0;
        let mut records: Vec<FlowRecord> = Vec::new();
        for local in &mut locals {
            for (k, rec) in self.nf.take_delta(local, true) {
                if let Some(r) = rec {
                    records.push((k, r));
                }
            }
        }
        let (flows, failed, errors) = self.import(records)?;
        if self.link.is_some() {
            self.need_full = true;
            if let Err(e) = self.snapshot(true) {
                lock(&self.status).last_error = Some(format!("after recovery: {e}"));
            }
        }
        let total_ms = t0.elapsed().as_secs_f64() * 1000.0;
        let activated = flows.len();
        lock(&self.status).recoveries.push_back(json!({
            "primary": primary, "replay_ms": replay_ms, "total_ms": total_ms,
            "replayed_packets": replayed, "suppressed": suppressed, "flows": activated,
            "failed": failed,
        }));
        {
            let mut st = lock(&self.status);
            while st.recoveries.len() > RECOVERIES_KEPT {
                st.recoveries.pop_front();
            }
        }
        tracing::info!(
            primary,
            activated,
            failed,
            replayed,
            suppressed,
            replay_ms,
            "ftmb: primary recovered"
        );
        Ok(json!({
            "ok": true,
            "activated": activated,
            "failed": failed,
            "errors": errors,
            "flows": flows,
            "replay_ms": replay_ms,
            "total_ms": total_ms,
            "replayed_packets": replayed,
            "suppressed": suppressed,
        }))
    }

    /// Imports recovered records into this replica's workers at a barrier; returns the
    /// flows (key + aliases, for steering), the failures and some error texts.
    fn import(
        &mut self,
        records: Vec<FlowRecord>,
    ) -> Result<(Vec<Value>, usize, Vec<String>), String> {
        let n = self.ctl.len();
        let mut groups: Vec<Vec<FlowRecord>> = vec![Vec::new(); n];
        let mut flows = Vec::with_capacity(records.len());
        let mut failed = 0;
        let mut errors = Vec::new();
        for rec in records {
            let Some(q) = self.nf.record_queue(&rec, n).filter(|q| *q < n) else {
                failed += 1;
                if errors.len() < 16 {
                    errors.push("a recovered record names no worker queue".to_string());
                }
                continue;
            };
            if let Some((key, aliases)) = self.nf.steering_keys(&rec) {
                let aliases: Vec<String> = aliases
                    .iter()
                    .filter(|a| **a != key)
                    .map(|a| a.to_string())
                    .collect();
                flows.push(json!({"key": key.to_string(), "aliases": aliases}));
            }
            groups[q].push(rec);
        }
        let parked = self.barrier(None)?;
        let mut waits = Vec::with_capacity(n);
        let posts = groups
            .into_iter()
            .map(|records| {
                let (tx, rx) = mpsc::sync_channel(1);
                waits.push(rx);
                Post::Import { records, done: tx }
            })
            .collect();
        self.resume(parked, posts);
        for (q, rx) in waits.into_iter().enumerate() {
            match rx.recv_timeout(BARRIER_WAIT) {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => {
                    failed += 1;
                    if errors.len() < 16 {
                        errors.push(format!("queue {q}: {e}"));
                    }
                }
                Err(_) => return Err(format!("queue {q} did not finish the import")),
            }
        }
        Ok((flows, failed, errors))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pause_percentiles_over_a_bounded_window() {
        let mut st = CoordStatus::default();
        assert_eq!(st.pause_percentiles(), (None, None));
        for us in 1..=100 {
            st.pause(us);
        }
        assert_eq!(st.pause_percentiles(), (Some(51), Some(99)));
        for _ in 0..PAUSE_SAMPLES {
            st.pause(7);
        }
        assert_eq!(st.pauses_us.len(), PAUSE_SAMPLES, "oldest samples dropped");
        assert_eq!(st.pause_percentiles(), (Some(7), Some(7)));
    }
}
