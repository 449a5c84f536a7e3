//! The master side: shared variables whose every access leaves a PAL, per-worker log queues
//! with contiguous sequence numbers, VORs on output, and the same code path in replay mode
//! (PAL-gated lock acquisition, logged clock/RNG values).
//!
//! Ordering argument (paper §4.3), which the code keeps in this shape on purpose:
//! - a PAL gets its seq and is pushed on the worker's queue, and the queue's MAX is published
//!   (`Release`), all *while the variable's lock is held*;
//! - the next accessor of that variable takes the lock after, so whatever it later reads from
//!   MAX (`Acquire`) covers the PAL it depends on; transitively, when a packet reads its VOR,
//!   every PAL it depends on is queued and covered by the VOR;
//! - the packet itself is queued after its own PALs on the same queue.
//!
//! So the output logger can release a packet as soon as every queue's contiguous logged seq
//! reaches the packet's VOR, without tracking individual dependencies.

use crate::logger::Recovery;
use crate::transport::{LogTransport, TransportError};
use crate::wire::{
    Feedback, LogBatch, LogMsg, OutputId, PacketId, Pal, PalKind, QueueId, Snapshot, VarId,
    MAX_QUEUES,
};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

#[derive(Clone, Debug)]
pub struct MasterConfig {
    /// Worker threads = queues.
    pub workers: usize,
    /// Bound on PALs a worker keeps for retransmission until the logger confirms them; over it
    /// the oldest is forgotten (counted; a later resend request for it cannot be served).
    pub max_retained_pals: usize,
    /// How long a replaying worker waits for its turn on a variable before reporting
    /// [`FtmbError::ReplayStalled`] (a safety net against a broken log, not a tuning knob).
    pub replay_wait_limit: Duration,
    /// `end()` hands the queue to the transport every this many packets (1: every packet, the
    /// lowest latency; more amortises the hop, paper §4.4). Call [`Worker::flush`] when idle.
    pub batch_packets: u32,
}

impl MasterConfig {
    pub fn new(workers: usize) -> MasterConfig {
        MasterConfig {
            workers,
            max_retained_pals: 1 << 16,
            replay_wait_limit: Duration::from_secs(10),
            batch_packets: 1,
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FtmbError {
    #[error("{0} workers: between 1 and {max} are supported", max = MAX_QUEUES)]
    BadWorkerCount(usize),
    #[error("queue {0} does not exist")]
    NoQueue(QueueId),
    #[error("the worker of queue {0} was already created")]
    WorkerTaken(QueueId),
    #[error("shared variable {0} is declared twice")]
    DuplicateVar(VarId),
    #[error("worker {worker}: shared access or output outside begin()..end()")]
    NoPacket { worker: QueueId },
    #[error("worker {worker}: begin({got:?}) while packet {open:?} is still open")]
    PacketOpen {
        worker: QueueId,
        open: PacketId,
        got: PacketId,
    },
    #[error("worker {worker} got packet {got:?}: not its queue, or not after {last:?}")]
    OutOfOrder {
        worker: QueueId,
        last: Option<PacketId>,
        got: PacketId,
    },
    #[error("replay of queue {queue} diverged at packet {packet:?} access {n}: the log says {expected:?} ({what})")]
    ReplayDiverged {
        queue: QueueId,
        packet: PacketId,
        n: u32,
        expected: Pal,
        what: &'static str,
    },
    #[error("replay: waited {waited_ms} ms for a turn on variable {var} (access {access}); the log is inconsistent")]
    ReplayStalled {
        var: VarId,
        access: u64,
        waited_ms: u64,
    },
    #[error("shared variable {0}: a previous access panicked while holding its lock")]
    Poisoned(VarId),
    #[error("recovery data has {got} queues, the master {want}")]
    RecoveryShape { got: usize, want: usize },
    #[error(transparent)]
    Transport(#[from] TransportError),
}

/// Reported by an [`UnlockProbe`] while the variable's lock is still held, just before it is
/// released: lets a test check that the access's PAL is already queued (ordered logging).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UnlockEvent {
    pub var: VarId,
    /// This access's number (1-based).
    pub access: u64,
    pub queue: QueueId,
    /// The PAL seq of this access on `queue`.
    pub pal_seq: u64,
    /// True for a replayed access (its PAL was logged by the previous master).
    pub replayed: bool,
}

pub type UnlockProbe = Arc<dyn Fn(&UnlockEvent) + Send + Sync>;

struct VarState<T> {
    value: T,
    accesses: u64,
    /// During recovery: the last access number the replay schedules contain. An access that is
    /// not in a schedule waits until the variable got this far.
    replay_until: u64,
}

/// A variable shared between workers (paper §4.2): its own lock and access counter; every
/// access goes through [`Worker::access`] and leaves a PAL.
pub struct SharedVar<T> {
    id: VarId,
    state: Mutex<VarState<T>>,
    turn: Condvar,
    probe: Option<UnlockProbe>,
}

impl<T> SharedVar<T> {
    pub fn id(&self) -> VarId {
        self.id
    }

    fn lock(&self) -> Result<MutexGuard<'_, VarState<T>>, FtmbError> {
        self.state.lock().map_err(|_| FtmbError::Poisoned(self.id))
    }

    /// Accesses made so far.
    pub fn accesses(&self) -> Result<u64, FtmbError> {
        Ok(self.lock()?.accesses)
    }

    /// Reads the value without leaving a PAL. Only for a quiescent point (taking a snapshot,
    /// checking a test), never on the packet path: an unlogged read there would make replay
    /// diverge.
    pub fn read_quiesced<R>(&self, f: impl FnOnce(&T) -> R) -> Result<R, FtmbError> {
        Ok(f(&self.lock()?.value))
    }
}

trait VarControl: Send + Sync {
    fn id(&self) -> VarId;
    fn accesses(&self) -> Result<u64, FtmbError>;
}

impl<T: Send> VarControl for SharedVar<T> {
    fn id(&self) -> VarId {
        self.id
    }
    fn accesses(&self) -> Result<u64, FtmbError> {
        SharedVar::accesses(self)
    }
}

/// A queue's logged PALs still to replay: (PAL seq, PAL), in seq order.
type Schedule = VecDeque<(u64, Pal)>;

/// Per queue, read by every worker when it computes a VOR. Aligned so workers publishing their
/// MAX do not false-share a cache line.
#[repr(align(64))]
struct QueueShared {
    max: AtomicU64,
}

/// The NF instance: its queues, its shared variables, and (after a failure) its replay plan.
pub struct Master {
    cfg: MasterConfig,
    queues: Box<[QueueShared]>,
    vars: Mutex<Vec<Arc<dyn VarControl>>>,
    /// Per variable: (accesses at the snapshot, replay_until). Empty for a fresh master.
    restored: HashMap<VarId, (u64, u64)>,
    /// Master generation, stamped on every batch (fencing).
    epoch: u64,
    /// Per queue: the replay schedule, taken by [`Master::worker`] (`None` once taken).
    schedules: Mutex<Vec<Option<Schedule>>>,
}

impl Master {
    pub fn new(cfg: MasterConfig) -> Result<Arc<Master>, FtmbError> {
        let n = cfg.workers;
        Master::build(cfg, 0, vec![0; n], HashMap::new(), vec![Vec::new(); n])
    }

    /// A standby taking over: state will come from `snap` (the NF rebuilds its variables from
    /// `snap.nf_state` with [`Master::shared_var`], which restores their counters), and the
    /// workers replay `rec`'s schedules before going live.
    pub fn recovering(
        cfg: MasterConfig,
        snap: &Snapshot,
        rec: Recovery,
    ) -> Result<Arc<Master>, FtmbError> {
        let n = cfg.workers;
        for got in [snap.pal_seq.len(), rec.schedules.len(), rec.cut.len()] {
            if got != n {
                return Err(FtmbError::RecoveryShape { got, want: n });
            }
        }
        let mut restored: HashMap<VarId, (u64, u64)> = snap
            .var_accesses
            .iter()
            .map(|&(v, a)| (v, (a, a)))
            .collect();
        for &(v, until) in &rec.var_replay_until {
            let e = restored.entry(v).or_insert((0, 0));
            e.1 = e.1.max(until);
        }
        Master::build(
            cfg,
            rec.epoch,
            snap.pal_seq.clone(),
            restored,
            rec.schedules,
        )
    }

    fn build(
        cfg: MasterConfig,
        epoch: u64,
        pal_seq: Vec<u64>,
        restored: HashMap<VarId, (u64, u64)>,
        schedules: Vec<Vec<(u64, Pal)>>,
    ) -> Result<Arc<Master>, FtmbError> {
        if cfg.workers == 0 || cfg.workers > MAX_QUEUES {
            return Err(FtmbError::BadWorkerCount(cfg.workers));
        }
        Ok(Arc::new(Master {
            queues: pal_seq
                .into_iter()
                .map(|s| QueueShared {
                    max: AtomicU64::new(s),
                })
                .collect(),
            vars: Mutex::new(Vec::new()),
            epoch,
            restored,
            schedules: Mutex::new(schedules.into_iter().map(|s| Some(s.into())).collect()),
            cfg,
        }))
    }

    pub fn workers(&self) -> usize {
        self.queues.len()
    }

    /// The generation stamped on this master's batches (0 fresh, `Recovery::epoch` recovered).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Declares shared variable `id` with value `init` (for a recovering master: the value from
    /// the snapshot; its access counter and replay position are restored here).
    pub fn shared_var<T: Send + 'static>(
        &self,
        id: VarId,
        init: T,
    ) -> Result<Arc<SharedVar<T>>, FtmbError> {
        self.declare(id, init, None)
    }

    /// [`Master::shared_var`] with an instrumented unlock (tests of ordered logging).
    pub fn shared_var_probed<T: Send + 'static>(
        &self,
        id: VarId,
        init: T,
        probe: UnlockProbe,
    ) -> Result<Arc<SharedVar<T>>, FtmbError> {
        self.declare(id, init, Some(probe))
    }

    fn declare<T: Send + 'static>(
        &self,
        id: VarId,
        init: T,
        probe: Option<UnlockProbe>,
    ) -> Result<Arc<SharedVar<T>>, FtmbError> {
        let mut vars = self.vars.lock().unwrap_or_else(|e| e.into_inner());
        if vars.iter().any(|v| v.id() == id) {
            return Err(FtmbError::DuplicateVar(id));
        }
        let (accesses, replay_until) = self.restored.get(&id).copied().unwrap_or((0, 0));
        let v = Arc::new(SharedVar {
            id,
            state: Mutex::new(VarState {
                value: init,
                accesses,
                replay_until,
            }),
            turn: Condvar::new(),
            probe,
        });
        vars.push(Arc::clone(&v) as Arc<dyn VarControl>);
        Ok(v)
    }

    /// The highest PAL seq queue `q` has enqueued.
    pub fn queue_max(&self, q: QueueId) -> Option<u64> {
        self.queues
            .get(q as usize)
            .map(|s| s.max.load(Ordering::Acquire))
    }

    /// The worker of queue `q` (once per queue), sending its stream through `transport`.
    pub fn worker(
        self: &Arc<Self>,
        q: QueueId,
        transport: Box<dyn LogTransport>,
    ) -> Result<Worker, FtmbError> {
        let seq = self.queue_max(q).ok_or(FtmbError::NoQueue(q))?;
        let schedule = {
            let mut s = self.schedules.lock().unwrap_or_else(|e| e.into_inner());
            s.get_mut(q as usize)
                .ok_or(FtmbError::NoQueue(q))?
                .take()
                .ok_or(FtmbError::WorkerTaken(q))?
        };
        let now = wall_ns();
        Ok(Worker {
            master: Arc::clone(self),
            q,
            seq,
            pending: Vec::new(),
            retained: VecDeque::new(),
            cur: None,
            last: None,
            n: 0,
            out_index: 0,
            schedule,
            transport,
            rng: now ^ (u64::from(q) + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15),
            unflushed: 0,
            stats: WorkerStats::default(),
        })
    }

    /// Captures the snapshot metadata around the NF's own serialised state. The caller must
    /// hold every worker between packets (quiescent point) and pass, per queue, the first input
    /// seq not yet processed.
    pub fn snapshot(&self, nf_state: Vec<u8>, input_next: Vec<u64>) -> Result<Snapshot, FtmbError> {
        let vars = self.vars.lock().unwrap_or_else(|e| e.into_inner());
        let mut var_accesses = Vec::with_capacity(vars.len());
        for v in vars.iter() {
            var_accesses.push((v.id(), v.accesses()?));
        }
        var_accesses.sort_unstable();
        Ok(Snapshot {
            nf_state,
            input_next,
            var_accesses,
            pal_seq: self
                .queues
                .iter()
                .map(|q| q.max.load(Ordering::Acquire))
                .collect(),
        })
    }
}

fn wall_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct WorkerStats {
    pub packets: u64,
    pub pals: u64,
    pub value_pals: u64,
    pub outputs: u64,
    pub batches: u64,
    /// Accesses and value reads served from the replay schedule.
    pub replayed: u64,
    pub resent_pals: u64,
    /// Resend requests for PALs no longer retained (over `max_retained_pals`).
    pub resend_unavailable: u64,
    pub retained_dropped: u64,
    pub feedback: u64,
}

/// Clock and RNG reads that are logged (live) or served from the log (replay).
pub trait Determinants {
    /// Wall clock, ns since the Unix epoch.
    fn now(&mut self) -> Result<u64, FtmbError>;
    fn random(&mut self) -> Result<u64, FtmbError>;
}

enum Want {
    Var(VarId),
    Clock,
    Random,
}

/// One worker thread's context: processes its queue's packets in input order, one at a time
/// (`begin`, accesses/outputs, `end`).
pub struct Worker {
    master: Arc<Master>,
    q: QueueId,
    /// Highest PAL seq of this queue (assigned or replayed).
    seq: u64,
    /// This worker's output queue: PALs and outputs not yet handed to the transport.
    pending: Vec<LogMsg>,
    /// Sent PALs not yet confirmed by the logger (for retransmission).
    retained: VecDeque<(u64, Pal)>,
    cur: Option<PacketId>,
    last: Option<PacketId>,
    n: u32,
    out_index: u32,
    schedule: Schedule,
    transport: Box<dyn LogTransport>,
    rng: u64,
    /// Packets ended since the last flush.
    unflushed: u32,
    pub stats: WorkerStats,
}

impl Worker {
    pub fn queue(&self) -> QueueId {
        self.q
    }

    /// True while logged PALs of this queue remain to be replayed.
    pub fn replaying(&self) -> bool {
        !self.schedule.is_empty()
    }

    /// Starts processing input packet `id` (the next of this queue, in input-logger order).
    pub fn begin(&mut self, id: PacketId) -> Result<(), FtmbError> {
        if let Some(open) = self.cur {
            return Err(FtmbError::PacketOpen {
                worker: self.q,
                open,
                got: id,
            });
        }
        if id.queue != self.q || self.last.is_some_and(|l| l.seq >= id.seq) {
            return Err(FtmbError::OutOfOrder {
                worker: self.q,
                last: self.last,
                got: id,
            });
        }
        if let Some(&(_, p)) = self.schedule.front() {
            if p.packet < id {
                return Err(self.diverged(
                    id,
                    0,
                    p,
                    "logged accesses of an earlier packet were not replayed",
                ));
            }
        }
        self.cur = Some(id);
        self.n = 0;
        self.out_index = 0;
        self.stats.packets += 1;
        Ok(())
    }

    /// [`Worker::begin`], and the packet's input-log record ([`LogMsg::Input`]) queued first
    /// on this worker's stream, ahead of the packet's PALs: a logger that has the PALs then
    /// also has the input to replay them from (network loggers, `net`/`server`).
    pub fn begin_input(&mut self, id: PacketId, frame: Vec<u8>) -> Result<(), FtmbError> {
        self.begin(id)?;
        self.pending.push(LogMsg::Input { id, frame });
        Ok(())
    }

    /// Replaces this worker's transport (a new logger). What is queued and not yet flushed
    /// goes to the new one; PALs kept for retransmission are forgotten (the new logger starts
    /// from the next snapshot, which the caller ships before resuming the worker).
    pub fn set_transport(&mut self, transport: Box<dyn LogTransport>) -> Box<dyn LogTransport> {
        self.retained.clear();
        std::mem::replace(&mut self.transport, transport)
    }

    /// The transport's link counters, if it has any (see [`LogTransport::net_stats`]).
    pub fn transport_stats(&self) -> Option<crate::net::NetStats> {
        self.transport.net_stats()
    }

    /// Highest PAL seq of this queue (assigned or replayed).
    pub fn pal_seq(&self) -> u64 {
        self.seq
    }

    /// Ends the current packet and hands the queue to the transport.
    pub fn end(&mut self) -> Result<(), FtmbError> {
        let Some(id) = self.cur.take() else {
            return Err(FtmbError::NoPacket { worker: self.q });
        };
        self.last = Some(id);
        if let Some(&(_, p)) = self.schedule.front() {
            if p.packet == id {
                return Err(self.diverged(
                    id,
                    self.n + 1,
                    p,
                    "the packet made fewer accesses than logged",
                ));
            }
        }
        self.unflushed += 1;
        if self.unflushed >= self.master.cfg.batch_packets {
            self.flush()
        } else {
            Ok(())
        }
    }

    fn diverged(&self, packet: PacketId, n: u32, expected: Pal, what: &'static str) -> FtmbError {
        FtmbError::ReplayDiverged {
            queue: self.q,
            packet,
            n,
            expected,
            what,
        }
    }

    /// Sends what is queued and handles the logger's feedback. Called by `end`; call it when
    /// idle too, so retransmission requests are served without new input.
    pub fn flush(&mut self) -> Result<(), FtmbError> {
        self.unflushed = 0;
        if !self.pending.is_empty() {
            // The next batch starts at this one's size: one allocation instead of regrowing
            // by doubling from empty for every batch.
            let cap = self.pending.len();
            let msgs = std::mem::replace(&mut self.pending, Vec::with_capacity(cap));
            for m in &msgs {
                if let LogMsg::Pal { seq, pal } = m {
                    if self.retained.len() >= self.master.cfg.max_retained_pals {
                        self.retained.pop_front();
                        self.stats.retained_dropped += 1;
                    }
                    self.retained.push_back((*seq, *pal));
                }
            }
            self.stats.batches += 1;
            self.transport.send(LogBatch {
                queue: self.q,
                epoch: self.master.epoch,
                msgs,
            })?;
        }
        while let Some(f) = self.transport.poll_feedback() {
            self.stats.feedback += 1;
            match f {
                Feedback::Logged { upto } => {
                    while self.retained.front().is_some_and(|&(s, _)| s <= upto) {
                        self.retained.pop_front();
                    }
                }
                // Handled by the transport that holds the output (`net::HeldOutputs`).
                Feedback::Released { .. } => {}
                Feedback::Resend { from, to } => {
                    let msgs: Vec<LogMsg> = self
                        .retained
                        .iter()
                        .filter(|&&(s, _)| s >= from && s <= to)
                        .map(|&(seq, pal)| LogMsg::Pal { seq, pal })
                        .collect();
                    let want = to.saturating_sub(from).saturating_add(1);
                    self.stats.resend_unavailable += want.saturating_sub(msgs.len() as u64);
                    if !msgs.is_empty() {
                        self.stats.resent_pals += msgs.len() as u64;
                        self.transport.send(LogBatch {
                            queue: self.q,
                            epoch: self.master.epoch,
                            msgs,
                        })?;
                    }
                }
            }
        }
        Ok(())
    }

    /// The schedule entry for the current packet's next determinant, if replaying; an entry
    /// that does not match is a divergence (the schedule is a per-queue prefix, so while it is
    /// not empty every determinant of this worker must come from it, in order).
    fn scheduled(&mut self, want: Want) -> Result<Option<(u64, PalKind)>, FtmbError> {
        let pkt = self.cur.ok_or(FtmbError::NoPacket { worker: self.q })?;
        let n = self.n + 1;
        let Some(&(seq, p)) = self.schedule.front() else {
            return Ok(None);
        };
        let kind_ok = matches!(
            (&want, p.kind),
            (Want::Var(v), PalKind::Var { var, .. }) if *v == var
        ) || matches!((&want, p.kind), (Want::Clock, PalKind::Clock { .. }))
            || matches!((&want, p.kind), (Want::Random, PalKind::Random { .. }));
        if p.packet != pkt || p.n != n || !kind_ok {
            return Err(self.diverged(pkt, n, p, "a different determinant was logged here"));
        }
        self.schedule.pop_front();
        self.stats.replayed += 1;
        Ok(Some((seq, p.kind)))
    }

    fn publish(&mut self, seq: u64) {
        self.seq = seq;
        self.master.queues[self.q as usize]
            .max
            .store(seq, Ordering::Release);
    }

    /// Enqueues a live PAL on this worker's queue and publishes its seq.
    fn enqueue_pal(&mut self, kind: PalKind) -> u64 {
        let seq = self.seq + 1;
        let pal = Pal {
            packet: self.cur.unwrap_or(PacketId {
                queue: self.q,
                seq: 0,
            }),
            n: self.n + 1,
            kind,
        };
        self.pending.push(LogMsg::Pal { seq, pal });
        self.publish(seq);
        seq
    }

    /// Accesses shared variable `var` for the current packet: takes its lock (in replay, only
    /// when the log says it is this packet's turn), runs `f`, enqueues the PAL, and only then
    /// releases the lock.
    pub fn access<T, R>(
        &mut self,
        var: &SharedVar<T>,
        f: impl FnOnce(&mut T) -> R,
    ) -> Result<R, FtmbError> {
        let scheduled = self.scheduled(Want::Var(var.id))?;
        let g = var.lock()?;
        let limit = self.master.cfg.replay_wait_limit;
        let (mut g, target) = match scheduled {
            Some((_, PalKind::Var { access, .. })) => {
                // Wait for the accesses that came before this one in the original run.
                let (g, _) = var
                    .turn
                    .wait_timeout_while(g, limit, |st| st.accesses + 1 < access)
                    .map_err(|_| FtmbError::Poisoned(var.id))?;
                if g.accesses + 1 != access {
                    return Err(if g.accesses + 1 < access {
                        FtmbError::ReplayStalled {
                            var: var.id,
                            access,
                            waited_ms: limit.as_millis() as u64,
                        }
                    } else {
                        self.diverged(
                            self.cur.unwrap_or(PacketId {
                                queue: self.q,
                                seq: 0,
                            }),
                            self.n + 1,
                            Pal {
                                packet: self.cur.unwrap_or(PacketId {
                                    queue: self.q,
                                    seq: 0,
                                }),
                                n: self.n + 1,
                                kind: PalKind::Var {
                                    var: var.id,
                                    access,
                                },
                            },
                            "the variable was accessed past its logged turn",
                        )
                    });
                }
                (g, Some(access))
            }
            _ => {
                // Live: accesses still in some replay schedule came first originally. Checked
                // before waiting so the common case (no replay) does not even read the clock.
                let g = if g.accesses < g.replay_until {
                    var.turn
                        .wait_timeout_while(g, limit, |st| st.accesses < st.replay_until)
                        .map_err(|_| FtmbError::Poisoned(var.id))?
                        .0
                } else {
                    g
                };
                if g.accesses < g.replay_until {
                    return Err(FtmbError::ReplayStalled {
                        var: var.id,
                        access: g.accesses + 1,
                        waited_ms: limit.as_millis() as u64,
                    });
                }
                (g, None)
            }
        };
        g.accesses += 1;
        let access = g.accesses;
        let r = f(&mut g.value);
        let (pal_seq, replayed) = match (scheduled, target) {
            (Some((seq, _)), Some(_)) => {
                self.publish(seq);
                (seq, true)
            }
            _ => {
                self.stats.pals += 1;
                (
                    self.enqueue_pal(PalKind::Var {
                        var: var.id,
                        access,
                    }),
                    false,
                )
            }
        };
        self.n += 1;
        if let Some(p) = &var.probe {
            p(&UnlockEvent {
                var: var.id,
                access,
                queue: self.q,
                pal_seq,
                replayed,
            });
        }
        let wake = g.replay_until > 0 && g.accesses <= g.replay_until;
        drop(g);
        if wake {
            var.turn.notify_all();
        }
        Ok(r)
    }

    fn value_read(
        &mut self,
        want: Want,
        live: impl FnOnce(&mut Self) -> u64,
    ) -> Result<u64, FtmbError> {
        if let Some((seq, kind)) = self.scheduled(want)? {
            self.publish(seq);
            self.n += 1;
            return Ok(match kind {
                PalKind::Clock { value } | PalKind::Random { value } => value,
                PalKind::Var { .. } => 0, // excluded by `scheduled`
            });
        }
        let value = live(self);
        Ok(value)
    }

    /// Writes output packet `payload` for the current packet: queued behind this worker's PALs
    /// with the VOR read now.
    pub fn output(&mut self, payload: Vec<u8>) -> Result<OutputId, FtmbError> {
        let packet = self.cur.ok_or(FtmbError::NoPacket { worker: self.q })?;
        let id = OutputId {
            packet,
            index: self.out_index,
        };
        self.out_index += 1;
        let vor: Vec<u64> = self
            .master
            .queues
            .iter()
            .map(|q| q.max.load(Ordering::Acquire))
            .collect();
        debug_assert_eq!(vor[self.q as usize], self.seq);
        self.pending.push(LogMsg::Output { id, vor, payload });
        self.stats.outputs += 1;
        Ok(id)
    }
}

impl Determinants for Worker {
    fn now(&mut self) -> Result<u64, FtmbError> {
        self.value_read(Want::Clock, |w| {
            let value = wall_ns();
            w.enqueue_pal(PalKind::Clock { value });
            w.n += 1;
            w.stats.value_pals += 1;
            value
        })
    }

    fn random(&mut self) -> Result<u64, FtmbError> {
        self.value_read(Want::Random, |w| {
            // splitmix64: the values are logged, so quality only matters for the NF's use.
            w.rng = w.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = w.rng;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            let value = z ^ (z >> 31);
            w.enqueue_pal(PalKind::Random { value });
            w.n += 1;
            w.stats.value_pals += 1;
            value
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::logger::{LoggerConfig, OutputLogger};
    use std::sync::mpsc;

    /// Collects batches for the test to deliver by hand; feedback is pushed by the test.
    struct HandTransport {
        out: mpsc::Sender<LogBatch>,
        fb: mpsc::Receiver<Feedback>,
    }

    impl LogTransport for HandTransport {
        fn send(&mut self, batch: LogBatch) -> Result<(), TransportError> {
            self.out.send(batch).map_err(|_| TransportError::Closed)
        }
        fn poll_feedback(&mut self) -> Option<Feedback> {
            self.fb.try_recv().ok()
        }
    }

    type Hand = (mpsc::Receiver<LogBatch>, mpsc::Sender<Feedback>);

    fn workers(m: &Arc<Master>) -> (Vec<Worker>, Vec<Hand>) {
        let mut ws = Vec::new();
        let mut hs = Vec::new();
        for q in 0..m.workers() {
            let (otx, orx) = mpsc::channel();
            let (ftx, frx) = mpsc::channel();
            ws.push(
                m.worker(q as QueueId, Box::new(HandTransport { out: otx, fb: frx }))
                    .unwrap(),
            );
            hs.push((orx, ftx));
        }
        (ws, hs)
    }

    fn pid(queue: QueueId, seq: u64) -> PacketId {
        PacketId { queue, seq }
    }

    #[test]
    fn pals_counters_and_vor() {
        let m = Master::new(MasterConfig::new(2)).unwrap();
        let v = m.shared_var(1, 0u64).unwrap();
        assert_eq!(m.shared_var(1, 0u8).err(), Some(FtmbError::DuplicateVar(1)));
        let (mut ws, hs) = workers(&m);
        assert!(matches!(
            m.worker(
                0,
                Box::new(HandTransport {
                    out: mpsc::channel().0,
                    fb: mpsc::channel().1
                })
            ),
            Err(FtmbError::WorkerTaken(0))
        ));
        assert_eq!(
            ws[0].access(&v, |x| *x += 1),
            Err(FtmbError::NoPacket { worker: 0 })
        );
        ws[0].begin(pid(0, 0)).unwrap();
        ws[0].access(&v, |x| *x += 1).unwrap();
        let t = ws[0].now().unwrap();
        ws[0].output(vec![1]).unwrap();
        ws[0].end().unwrap();
        ws[1].begin(pid(1, 0)).unwrap();
        ws[1].access(&v, |x| *x += 1).unwrap();
        ws[1].output(vec![2]).unwrap();
        ws[1].end().unwrap();
        assert!(matches!(
            ws[1].begin(pid(1, 0)),
            Err(FtmbError::OutOfOrder { .. })
        ));
        assert!(matches!(
            ws[1].begin(pid(0, 1)),
            Err(FtmbError::OutOfOrder { .. })
        ));
        let b0 = hs[0].0.try_recv().unwrap();
        let b1 = hs[1].0.try_recv().unwrap();
        assert_eq!(
            b0.msgs[0],
            LogMsg::Pal {
                seq: 1,
                pal: Pal {
                    packet: pid(0, 0),
                    n: 1,
                    kind: PalKind::Var { var: 1, access: 1 }
                }
            }
        );
        assert_eq!(
            b0.msgs[1],
            LogMsg::Pal {
                seq: 2,
                pal: Pal {
                    packet: pid(0, 0),
                    n: 2,
                    kind: PalKind::Clock { value: t }
                }
            }
        );
        assert!(matches!(&b0.msgs[2], LogMsg::Output { vor, .. } if *vor == vec![2, 0]));
        // Worker 1's access came second on the variable and its VOR covers worker 0's PALs.
        assert!(
            matches!(&b1.msgs[0], LogMsg::Pal { seq: 1, pal } if pal.kind == PalKind::Var { var: 1, access: 2 })
        );
        assert!(matches!(&b1.msgs[1], LogMsg::Output { vor, .. } if *vor == vec![2, 1]));
        assert_eq!(v.accesses(), Ok(2));
    }

    #[test]
    fn resend_is_served_from_retained_pals() {
        let m = Master::new(MasterConfig::new(1)).unwrap();
        let v = m.shared_var(1, 0u64).unwrap();
        let (mut ws, hs) = workers(&m);
        let mut cfg = LoggerConfig::new(1);
        cfg.confirm_every = 1;
        let mut l = OutputLogger::new(cfg).unwrap();
        for s in 0..3 {
            ws[0].begin(pid(0, s)).unwrap();
            ws[0].access(&v, |x| *x += 1).unwrap();
            ws[0].output(vec![s as u8]).unwrap();
            ws[0].end().unwrap();
        }
        // Lose the first batch; deliver the others.
        let _lost = hs[0].0.try_recv().unwrap();
        for b in hs[0].0.try_iter() {
            l.ingest(b).unwrap();
        }
        assert!(l.drain_released().is_empty());
        for (_, f) in l.drain_feedback() {
            hs[0].1.send(f).unwrap();
        }
        ws[0].flush().unwrap();
        assert_eq!(ws[0].stats.resent_pals, 1);
        for b in hs[0].0.try_iter() {
            l.ingest(b).unwrap();
        }
        // PAL 1 is back: the two later outputs go; the first output was lost with its batch.
        assert_eq!(l.drain_released().len(), 2);
        for (_, f) in l.drain_feedback() {
            hs[0].1.send(f).unwrap();
        }
        ws[0].flush().unwrap();
        assert!(ws[0].retained.is_empty(), "confirmed PALs are forgotten");
    }

    #[test]
    fn replay_follows_the_log_and_detects_divergence() {
        // Live run: w1 then w0 append to a shared vector; w0 also reads clock and RNG.
        let m = Master::new(MasterConfig::new(2)).unwrap();
        let v = m.shared_var(7, Vec::<u8>::new()).unwrap();
        let snap = m.snapshot(Vec::new(), vec![0, 0]).unwrap();
        let (mut ws, hs) = workers(&m);
        ws[1].begin(pid(1, 0)).unwrap();
        ws[1].access(&v, |x| x.push(1)).unwrap();
        ws[1].end().unwrap();
        ws[0].begin(pid(0, 0)).unwrap();
        let t = ws[0].now().unwrap();
        let r = ws[0].random().unwrap();
        ws[0].access(&v, |x| x.push(0)).unwrap();
        ws[0].output(vec![]).unwrap();
        ws[0].end().unwrap();
        let mut l = OutputLogger::new(LoggerConfig::new(2)).unwrap();
        for h in &hs {
            for b in h.0.try_iter() {
                l.ingest(b).unwrap();
            }
        }
        let rec = l.recover(&snap.pal_seq, &snap.var_accesses).unwrap();
        assert_eq!(rec.cut, vec![3, 1]);

        // Replay with worker 0 started first: it must wait for worker 1's logged turn.
        let m2 = Master::recovering(MasterConfig::new(2), &snap, rec.clone()).unwrap();
        let v2 = m2.shared_var(7, Vec::<u8>::new()).unwrap();
        let (ws2, _hs2) = workers(&m2);
        let mut it = ws2.into_iter();
        let (mut w0, mut w1) = (it.next().unwrap(), it.next().unwrap());
        std::thread::scope(|s| {
            let v0 = &v2;
            let h = s.spawn(move || {
                w0.begin(pid(0, 0)).unwrap();
                assert_eq!(w0.now().unwrap(), t);
                assert_eq!(w0.random().unwrap(), r);
                w0.access(v0, |x| x.push(0)).unwrap();
                w0.end().unwrap();
                assert!(!w0.replaying());
                // Live again: a new PAL continues after the cut.
                w0.begin(pid(0, 1)).unwrap();
                w0.access(v0, |x| x.push(9)).unwrap();
                w0.end().unwrap();
                w0.stats.pals
            });
            w1.begin(pid(1, 0)).unwrap();
            w1.access(&v2, |x| x.push(1)).unwrap();
            w1.end().unwrap();
            assert_eq!(h.join().unwrap(), 1);
        });
        assert_eq!(v2.read_quiesced(|x| x.clone()).unwrap(), vec![1, 0, 9]);

        // A replay that reads the RNG where the log has a clock read is refused.
        let m3 = Master::recovering(MasterConfig::new(2), &snap, rec).unwrap();
        let (mut ws3, _hs3) = workers(&m3);
        ws3[0].begin(pid(0, 0)).unwrap();
        assert!(matches!(
            ws3[0].random(),
            Err(FtmbError::ReplayDiverged { queue: 0, n: 1, .. })
        ));
    }

    #[test]
    fn input_record_precedes_the_packets_pals_and_transports_can_be_replaced() {
        let m = Master::new(MasterConfig::new(1)).unwrap();
        let v = m.shared_var(1, 0u64).unwrap();
        let (mut ws, hs) = workers(&m);
        ws[0].begin_input(pid(0, 0), vec![42]).unwrap();
        ws[0].access(&v, |x| *x += 1).unwrap();
        ws[0].output(vec![1]).unwrap();
        ws[0].end().unwrap();
        let b = hs[0].0.try_recv().unwrap();
        assert_eq!(
            b.msgs[0],
            LogMsg::Input {
                id: pid(0, 0),
                frame: vec![42]
            }
        );
        assert!(matches!(b.msgs[1], LogMsg::Pal { seq: 1, .. }));
        assert!(matches!(b.msgs[2], LogMsg::Output { .. }));
        assert_eq!(ws[0].pal_seq(), 1);
        assert_eq!(m.epoch(), 0);
        assert!(ws[0].transport_stats().is_none());
        // A new logger: the stream continues there.
        let (otx, orx) = mpsc::channel();
        let (_ftx, frx) = mpsc::channel();
        let _old = ws[0].set_transport(Box::new(HandTransport { out: otx, fb: frx }));
        ws[0].begin_input(pid(0, 1), vec![43]).unwrap();
        ws[0].access(&v, |x| *x += 1).unwrap();
        ws[0].end().unwrap();
        assert!(hs[0].0.try_recv().is_err());
        let b = orx.try_recv().unwrap();
        assert!(matches!(b.msgs[1], LogMsg::Pal { seq: 2, .. }));
        assert!(
            ws[0].retained.len() == 1,
            "only the new stream's PAL is retained"
        );
    }
}
