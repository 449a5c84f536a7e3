//! The engine's side of the FTMB mode ([`FtmbMode`]): dispatch to the worker queues, holding
//! packets while a recovery runs, draining released output, control commands; and [`start`],
//! which builds the workers, the in-process logger, the hosted logger server and the
//! coordinator.

use super::coord::{Coord, CoordStatus, Op};
use super::local_logger::{LocalAudit, LocalLogger};
use super::nf::FtmbNf;
use super::release::{ReleaseQueue, Wake, RELEASE_BOUND};
use super::worker::{Job, WorkerPub, WorkerThread};
use super::{FtmbCmd, FtmbMode};
use crate::nf::{Output, OutputKind, Packet};
use pliant_ftmb::{
    LoggerConfig, LoggerServer, Master, MasterConfig, NetOptions, OutputLogger, QueueId,
    ServerOptions,
};
use pliant_wire::{Endpoint, Security};
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Released payloads taken per round at most (the rest next round, which starts at once).
const RELEASE_PER_ROUND: usize = 4096;
/// Control operations queued for the coordinator at most.
const OPS_BOUND: usize = 4;

#[derive(Clone)]
pub struct FtmbOptions {
    /// The replica's name: the master name at the logger.
    pub name: String,
    pub workers: usize,
    pub snapshot_every: Duration,
    /// The replica's identity (`[security]`): proves our name (the master name, `name`) to a
    /// logger, and other masters' names to the logger we host.
    pub security: Option<Security>,
    /// Where the logger this replica hosts for another primary listens, a unix path or TCP
    /// `host:port` (needs `security`).
    pub host_socket: Option<Endpoint>,
    /// Packets queued per worker at most (beyond: dropped, `ftmb_queue_full`).
    pub queue_bound: usize,
    /// Packets held while a recovery runs at most (beyond: dropped, `ftmb_hold_full`).
    pub max_held: usize,
    /// `MasterConfig::batch_packets`: packets per log batch under load (a worker also flushes
    /// whenever its queue runs dry, so this does not delay a lone packet).
    pub batch_packets: u32,
    pub net: NetOptions,
    /// A replaying worker waits this long for its logged turn on a variable at most.
    pub replay_limit: Duration,
    /// An `ftmb_hold` not followed by the `ftmb_activate` of the same primary ends after this
    /// (a controller that died in between must not freeze the replica).
    pub hold_limit: Duration,
    /// Bounds of the logger this replica hosts (`release_to_master` is always set: see
    /// [`start`]).
    pub host_options: ServerOptions,
}

impl FtmbOptions {
    pub fn new(name: &str, workers: usize) -> FtmbOptions {
        FtmbOptions {
            name: name.to_string(),
            workers,
            snapshot_every: Duration::from_millis(crate::config::FTMB_DEFAULT_SNAPSHOT_MS),
            security: None,
            host_socket: None,
            queue_bound: 4096,
            max_held: 16_384,
            batch_packets: 32,
            net: NetOptions::default(),
            replay_limit: Duration::from_secs(2),
            hold_limit: Duration::from_secs(2),
            host_options: ServerOptions::default(),
        }
    }
}

/// Drop counters of the engine side (also reported to the engine's drop counters).
#[derive(Default)]
struct FrontStats {
    dispatched: u64,
    queue_full: u64,
    worker_gone: u64,
    held: u64,
    hold_full: u64,
    held_dispatched: u64,
    released: u64,
    undecodable: u64,
    /// `ftmb_hold` requests, and those that ended unused after `hold_limit`.
    holds: u64,
    holds_expired: u64,
}

struct Front<F: FtmbNf> {
    nf: Arc<F>,
    jobs: Vec<SyncSender<Job>>,
    ops: SyncSender<Op>,
    release_rx: Receiver<Vec<u8>>,
    release: Arc<ReleaseQueue>,
    wake: Arc<Wake>,
    recovering: Arc<AtomicUsize>,
    held: VecDeque<Packet>,
    max_held: usize,
    /// Holds taken by `ftmb_hold` for a primary whose `ftmb_activate` has not come yet (each
    /// counts once in `recovering`; the activation takes it over).
    holds: Vec<(String, Instant)>,
    hold_limit: Duration,
    stats: FrontStats,
    /// Drops not yet reported to the engine (packets that never came back to it).
    unreported: Vec<(&'static str, u64)>,
    status: Arc<Mutex<CoordStatus>>,
    local_audit: Arc<LocalAudit>,
    workers: Vec<Arc<Mutex<WorkerPub>>>,
    snapshot_ms: u64,
}

/// Starts the FTMB mode for `nf`: `opts.workers` worker threads on an in-process logger
/// (traffic flows at once; `ftmb_protect` moves them to a network logger), the hosted logger
/// server when `opts.host_socket` is set, and the coordinator thread.
pub fn start<F: FtmbNf>(nf: F, opts: FtmbOptions) -> Result<Box<dyn FtmbMode>, String> {
    let n = opts.workers;
    if !crate::config::FTMB_WORKERS.contains(&n) {
        return Err(format!("ftmb: {n} workers, must be within 1..=16"));
    }
    let nf = Arc::new(nf);
    let (release, release_rx, wake) =
        ReleaseQueue::new(RELEASE_BOUND).map_err(|e| format!("ftmb: wake socket: {e}"))?;
    let mut cfg = MasterConfig::new(n);
    cfg.batch_packets = opts.batch_packets.max(1);
    cfg.replay_wait_limit = opts.replay_limit;
    let master = Master::new(cfg).map_err(|e| format!("ftmb: {e}"))?;
    let shared = Arc::new(
        nf.declare(&master, None)
            .map_err(|e| format!("ftmb: shared variables: {e}"))?,
    );
    let logger = OutputLogger::new(LoggerConfig::new(n)).map_err(|e| format!("ftmb: {e}"))?;
    let local_audit = Arc::new(LocalAudit::default());
    let local = LocalLogger::spawn(logger, Arc::clone(&release), Arc::clone(&local_audit))
        .map_err(|e| format!("ftmb: logger thread: {e}"))?;
    let hosting = match (&opts.host_socket, &opts.security) {
        (Some(ep), Some(sec)) => {
            let rq = Arc::clone(&release);
            let server = LoggerServer::start(
                ep,
                sec.clone(),
                // Each master transmits its own output once we confirm it released (see
                // `Coord::try_protect`): output we held would die with us. The callback
                // stays for any master that does not (none in this runtime).
                ServerOptions {
                    release_to_master: true,
                    ..opts.host_options.clone()
                },
                Box::new(move |r| rq.push(r.payload)),
            )
            .map_err(|e| format!("ftmb: logger server {ep}: {e}"))?;
            Some(Arc::new(server))
        }
        (Some(ep), None) => {
            return Err(format!(
                "ftmb: hosting a logger at {ep} needs this replica's identity ([security])"
            ))
        }
        _ => None,
    };
    let mut jobs = Vec::with_capacity(n);
    let mut ctl = Vec::with_capacity(n);
    let mut pubs = Vec::with_capacity(n);
    for q in 0..n {
        let (jtx, jrx) = mpsc::sync_channel(opts.queue_bound.max(1));
        let (ctx, crx) = mpsc::channel();
        let t = local.transport(q).map_err(|e| format!("ftmb: {e}"))?;
        let w = master
            .worker(q as QueueId, Box::new(t))
            .map_err(|e| format!("ftmb: {e}"))?;
        let l = nf
            .new_local(q as QueueId, &[])
            .map_err(|e| format!("ftmb: worker {q} state: {e}"))?;
        let publ = Arc::new(Mutex::new(WorkerPub::default()));
        let wt = WorkerThread::new(
            Arc::clone(&nf),
            Arc::clone(&shared),
            w,
            l,
            jrx,
            crx,
            Arc::clone(&publ),
        );
        std::thread::Builder::new()
            .name(format!("ftmb-w{q}"))
            .spawn(move || {
                wt.run();
            })
            .map_err(|e| format!("ftmb: spawn worker {q}: {e}"))?;
        jobs.push(jtx);
        ctl.push(ctx);
        pubs.push(publ);
    }
    // Session generations start at the process's start time in microseconds, not at 1: a
    // replica restarted under the same name (a scaled-out replica reusing a freed index) must
    // not present a generation that a logger fenced when the earlier process failed over.
    let incarnation = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX / 2));
    let status = Arc::new(Mutex::new(CoordStatus {
        session_epoch: incarnation,
        ..CoordStatus::default()
    }));
    let recovering = Arc::new(AtomicUsize::new(0));
    let coord = Coord {
        nf: Arc::clone(&nf),
        master,
        shared,
        ctl,
        pokes: jobs.clone(),
        name: opts.name.clone(),
        security: opts.security.clone(),
        snapshot_every: opts.snapshot_every,
        net: opts.net.clone(),
        replay_limit: opts.replay_limit,
        link: None,
        next_snap_id: 1,
        need_full: true,
        local: Some(local),
        held: Vec::new(),
        status: Arc::clone(&status),
        hosting,
        release: Arc::clone(&release),
        local_audit: Arc::clone(&local_audit),
        recovering: Arc::clone(&recovering),
        pubs: pubs.clone(),
        log_errors_seen: 0,
        index: Default::default(),
    };
    let (otx, orx) = mpsc::sync_channel(OPS_BOUND);
    std::thread::Builder::new()
        .name("ftmb-coord".into())
        .spawn(move || coord.run(orx))
        .map_err(|e| format!("ftmb: spawn coordinator: {e}"))?;
    Ok(Box::new(Front {
        nf,
        jobs,
        ops: otx,
        release_rx,
        release,
        wake,
        recovering,
        held: VecDeque::new(),
        max_held: opts.max_held,
        holds: Vec::new(),
        hold_limit: opts.hold_limit,
        stats: FrontStats::default(),
        unreported: Vec::new(),
        status,
        local_audit,
        workers: pubs,
        snapshot_ms: opts.snapshot_every.as_millis() as u64,
    }))
}

impl<F: FtmbNf> Front<F> {
    fn send(&mut self, pkt: Packet) -> Option<(Packet, &'static str)> {
        let n = self.jobs.len();
        // A bad `queue_of` must not index out of range.
        let q = self.nf.queue_of(&pkt, n) % n;
        match self.jobs[q].try_send(Job::Packet(pkt)) {
            Ok(()) => {
                self.stats.dispatched += 1;
                None
            }
            Err(TrySendError::Full(Job::Packet(p))) => {
                self.stats.queue_full += 1;
                Some((p, "ftmb_queue_full"))
            }
            Err(TrySendError::Disconnected(Job::Packet(p))) => {
                self.stats.worker_gone += 1;
                Some((p, "ftmb_worker_gone"))
            }
            Err(_) => None,
        }
    }

    /// Ends the holds whose activation never came within `hold_limit`.
    fn expire_holds(&mut self) {
        let limit = self.hold_limit;
        let before = self.holds.len();
        self.holds.retain(|(_, at)| at.elapsed() < limit);
        let gone = before - self.holds.len();
        if gone > 0 {
            self.stats.holds_expired += gone as u64;
            self.recovering.fetch_sub(gone, Ordering::AcqRel);
            // The held packets go out with the next round.
            self.wake.notify();
        }
    }

    /// Dispatches the packets held during a recovery, in arrival order.
    fn release_held(&mut self) {
        while let Some(p) = self.held.pop_front() {
            self.stats.held_dispatched += 1;
            if let Some((_, why)) = self.send(p) {
                self.unreported.push((why, 1));
            }
        }
    }

    fn status_json(&self) -> Value {
        let st = self.status.lock().unwrap_or_else(|e| e.into_inner());
        let (p50, p99) = st.pause_percentiles();
        let workers: Vec<Value> = self
            .workers
            .iter()
            .enumerate()
            .map(|(q, w)| w.lock().unwrap_or_else(|e| e.into_inner()).json(q))
            .collect();
        json!({
            "ok": true,
            "mode": "ftmb",
            "nf": F::NAME,
            "workers": self.jobs.len(),
            "logger": st.logger,
            "protected": st.protected,
            "session_epoch": st.session_epoch,
            "snapshot_ms": self.snapshot_ms,
            "snapshots": st.snapshots,
            "full_snapshots": st.full_snapshots,
            "snapshot_failures": st.snapshot_failures,
            "barrier_failures": st.barrier_failures,
            "fallbacks": st.fallbacks,
            "held_released_at_fallback": st.held_released_at_fallback,
            "snapshot_pause_us_p50": p50,
            "snapshot_pause_us_p99": p99,
            "last_snapshot_id": st.last_snapshot_id,
            "last_snapshot_acked": st.last_snapshot_acked,
            "snapshot_link": st.link_stats,
            "local_logger_blocked_sends": st.local_blocked_sends,
            "last_error": st.last_error,
            "worker_stats": workers,
            "dispatch": {
                "dispatched": self.stats.dispatched,
                "queue_full": self.stats.queue_full,
                "worker_gone": self.stats.worker_gone,
                "held": self.stats.held,
                "held_now": self.held.len(),
                "hold_full": self.stats.hold_full,
                "held_dispatched": self.stats.held_dispatched,
                "recovering": self.recovering.load(Ordering::Acquire),
                "holds": self.stats.holds,
                "holds_expired": self.stats.holds_expired,
            },
            "release": {
                "released": self.stats.released,
                "undecodable": self.stats.undecodable,
                "queued_total": self.release.pushed.load(Ordering::Relaxed),
                "dropped_full": self.release.dropped.load(Ordering::Relaxed),
            },
            "hosting": st.hosting,
            // Output released by this replica's in-process loggers (the hosted logger's own
            // counts are in `hosting`).
            "local_audit": {
                "audit_checked": self.local_audit.checked.load(Ordering::Relaxed),
                "audit_violations": self.local_audit.violations.load(Ordering::Relaxed),
            },
            "recoveries": st.recoveries.iter().cloned().collect::<Vec<_>>(),
        })
    }

    fn forward(&mut self, op: Op) -> Result<(), (Op, &'static str)> {
        match self.ops.try_send(op) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(op)) => {
                Err((op, "ftmb: too many protect/activate requests pending"))
            }
            Err(TrySendError::Disconnected(op)) => {
                Err((op, "ftmb: the coordinator thread is gone"))
            }
        }
    }
}

impl<F: FtmbNf> FtmbMode for Front<F> {
    fn dispatch(&mut self, pkt: Packet) -> Option<(Packet, &'static str)> {
        if self.recovering.load(Ordering::Acquire) > 0 {
            // A packet of a flow being recovered must not reach a worker before the flow is
            // imported (it would create a new mapping); we cannot tell which flows those are
            // until the replay ends, so everything waits, bounded.
            if self.held.len() >= self.max_held {
                self.stats.hold_full += 1;
                return Some((pkt, "ftmb_hold_full"));
            }
            self.stats.held += 1;
            self.held.push_back(pkt);
            return None;
        }
        if !self.held.is_empty() {
            self.release_held();
        }
        self.send(pkt)
    }

    fn poll(&mut self, out: &mut Vec<Output>, drop: &mut dyn FnMut(&'static str, u64)) {
        // Disarm before draining: a payload pushed after the drain writes a new wake-up.
        self.wake.disarm();
        self.expire_holds();
        if !self.held.is_empty() && self.recovering.load(Ordering::Acquire) == 0 {
            self.release_held();
        }
        let mut taken = 0;
        while taken < RELEASE_PER_ROUND {
            let Ok(payload) = self.release_rx.try_recv() else {
                break;
            };
            taken += 1;
            match super::frame::decode_owned(payload) {
                Ok(pkt) => {
                    self.stats.released += 1;
                    out.push(Output {
                        pkt,
                        kind: OutputKind::Direct,
                    });
                }
                Err(e) => {
                    self.stats.undecodable += 1;
                    drop(e.reason(), 1);
                }
            }
        }
        if taken == RELEASE_PER_ROUND {
            // More is waiting: make sure the engine does not sleep on it.
            self.wake.notify();
        }
        for (why, n) in self.unreported.drain(..) {
            drop(why, n);
        }
    }

    fn wake_fd(&self) -> RawFd {
        self.wake.fd()
    }

    fn drain_wake(&self) {
        self.wake.drain();
    }

    fn status(&self) -> Value {
        self.status_json()
    }

    fn command(&mut self, cmd: FtmbCmd, reply: SyncSender<Value>) {
        let op = match cmd {
            FtmbCmd::Status => {
                let _ = reply.try_send(self.status_json());
                return;
            }
            FtmbCmd::Protect { logger, host } => Op::Protect {
                logger,
                host,
                reply,
            },
            FtmbCmd::Flows { max } => Op::Flows { max, reply },
            FtmbCmd::Hold { primary } => {
                // Before the controller points the primary's traffic here (its port blocks),
                // so that traffic waits for the activation instead of finding no flow.
                if !self.holds.iter().any(|(p, _)| *p == primary) {
                    self.recovering.fetch_add(1, Ordering::AcqRel);
                    self.holds.push((primary, Instant::now()));
                    self.stats.holds += 1;
                }
                let _ = reply.try_send(json!({"ok": true, "holding": true}));
                return;
            }
            FtmbCmd::Activate { primary } => {
                // Hold from now on: the fabric may already deliver the primary's flows here.
                // An `ftmb_hold` for this primary already counts: the activation takes it.
                match self.holds.iter().position(|(p, _)| *p == primary) {
                    Some(i) => {
                        self.holds.swap_remove(i);
                    }
                    None => {
                        self.recovering.fetch_add(1, Ordering::AcqRel);
                    }
                }
                Op::Activate {
                    primary,
                    reply,
                    asked: Instant::now(),
                }
            }
        };
        if let Err((op, why)) = self.forward(op) {
            let reply = match op {
                Op::Protect { reply, .. } | Op::Flows { reply, .. } => reply,
                Op::Activate { reply, .. } => {
                    self.recovering.fetch_sub(1, Ordering::AcqRel);
                    reply
                }
            };
            let _ = reply.try_send(json!({"ok": false, "error": why}));
        }
    }
}
