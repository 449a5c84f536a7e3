//! One FTMB worker thread: owns a `pliant_ftmb::Worker` (its log queue) and the NF's
//! partitioned state for the flows pinned to it, and processes its input queue in order.
//!
//! Per packet: assign the next input seq; `begin_input` (the input record goes on the stream
//! ahead of the packet's PALs) or `begin` (no logger to recover from: input is not logged);
//! `FtmbNf::process`; `output` per written packet (VOR read then); `end`. The stream is flushed
//! every `batch_packets` packets and whenever the input queue is empty, so a lone packet never
//! waits for a batch to fill; an idle worker still flushes every `IDLE_FLUSH` to serve the
//! logger's feedback (resend requests).
//!
//! Barriers (snapshots, logger switch, imports): the coordinator sends `Ctl::Park` and pokes
//! the input queue; the worker checks its control channel before every packet, so it parks
//! at the next packet boundary without draining its queue first (a short pause), does the
//! per-worker part (flush, take the flow delta on its own thread), reports, and waits for its
//! `Post` before going on.

use super::nf::{FlowDelta, FlowRecord, FtmbNf};
use crate::nf::Packet;
use pliant_ftmb::{LogTransport, PacketId, QueueId, Worker, WorkerStats};
use serde_json::{json, Value};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// An idle worker flushes (serving logger feedback) this often.
const IDLE_FLUSH: Duration = Duration::from_millis(5);
/// Counters are published for `ftmb_status` every this many packets (and when idle).
const PUBLISH_EVERY: u64 = 1024;
/// The NF's own stats (`local_stats`, costlier) are refreshed at most this often.
const LOCAL_STATS_EVERY: Duration = Duration::from_millis(100);

pub(crate) enum Job {
    Packet(Packet),
    /// Wakes an idle worker so it sees a control message.
    Poke,
}

pub(crate) enum Ctl {
    Park {
        /// `Some(full)`: take the flow delta (`full`: every record) while parked.
        delta: Option<bool>,
        arrived: SyncSender<Parked>,
    },
}

/// A worker stopped at a packet boundary.
pub(crate) struct Parked {
    pub queue: usize,
    /// The first input seq not processed yet (the snapshot's `input_next`).
    pub input_next: u64,
    pub delta: Option<Vec<FlowDelta>>,
    /// When it stopped (the pause is measured from the first worker to stop).
    pub at: Instant,
    pub resume: SyncSender<Post>,
}

/// What a parked worker does before it goes on.
pub(crate) enum Post {
    Continue,
    /// Log to a new logger from now on; `log_input`: send input records (network loggers).
    SetTransport {
        transport: Box<dyn LogTransport>,
        log_input: bool,
    },
    /// Add records recovered from another primary to this worker's flows.
    Import {
        records: Vec<FlowRecord>,
        done: SyncSender<Result<usize, String>>,
    },
}

/// Counters a worker publishes for `ftmb_status`.
#[derive(Clone, Debug, Default)]
pub(crate) struct WorkerPub {
    pub stats: WorkerStats,
    pub input_next: u64,
    pub nf_errors: u64,
    pub log_errors: u64,
    pub last_error: Option<String>,
    pub local: Value,
}

impl WorkerPub {
    pub fn json(&self, queue: usize) -> Value {
        json!({
            "queue": queue,
            "packets": self.stats.packets,
            "pals": self.stats.pals,
            "value_pals": self.stats.value_pals,
            "outputs": self.stats.outputs,
            "batches": self.stats.batches,
            "replayed": self.stats.replayed,
            "resent_pals": self.stats.resent_pals,
            "resend_unavailable": self.stats.resend_unavailable,
            "input_next": self.input_next,
            "nf_errors": self.nf_errors,
            "log_errors": self.log_errors,
            "last_error": self.last_error,
            "nf": self.local,
        })
    }
}

pub(crate) struct WorkerThread<F: FtmbNf> {
    pub nf: Arc<F>,
    pub shared: Arc<F::Shared>,
    pub worker: Worker,
    pub local: F::Local,
    pub jobs: Receiver<Job>,
    pub ctl: Receiver<Ctl>,
    pub publ: Arc<Mutex<WorkerPub>>,
    pub log_input: bool,
    /// The next input seq (per queue, gapless: the input log's order).
    pub next_seq: u64,
    pub nf_errors: u64,
    pub log_errors: u64,
    pub last_error: Option<String>,
    pub since_publish: u64,
    pub local_published: Option<Instant>,
    pub out: Vec<Packet>,
}

impl<F: FtmbNf> WorkerThread<F> {
    pub fn new(
        nf: Arc<F>,
        shared: Arc<F::Shared>,
        worker: Worker,
        local: F::Local,
        jobs: Receiver<Job>,
        ctl: Receiver<Ctl>,
        publ: Arc<Mutex<WorkerPub>>,
    ) -> Self {
        WorkerThread {
            nf,
            shared,
            worker,
            local,
            jobs,
            ctl,
            publ,
            log_input: false,
            next_seq: 0,
            nf_errors: 0,
            log_errors: 0,
            last_error: None,
            since_publish: 0,
            local_published: None,
            out: Vec::new(),
        }
    }

    fn queue(&self) -> usize {
        usize::from(self.worker.queue())
    }

    fn note_error(&mut self, log: bool, e: String) {
        if log {
            self.log_errors += 1;
        } else {
            self.nf_errors += 1;
        }
        self.last_error = Some(e);
    }

    /// Processes one packet as input `seq` of this queue.
    pub fn process(&mut self, pkt: Packet, seq: u64) {
        let id = PacketId {
            queue: self.worker.queue(),
            seq,
        };
        let begun = if self.log_input {
            self.worker.begin_input(id, super::frame::encode(&pkt))
        } else {
            self.worker.begin(id)
        };
        if let Err(e) = begun {
            return self.note_error(true, format!("begin {id:?}: {e}"));
        }
        let mut out = std::mem::take(&mut self.out);
        if let Err(e) = self.nf.process(
            &self.shared,
            &mut self.local,
            &mut self.worker,
            pkt,
            &mut out,
        ) {
            self.note_error(false, format!("packet {id:?}: {e}"));
        }
        for o in out.drain(..) {
            if let Err(e) = self.worker.output(super::frame::encode_output(&o)) {
                self.note_error(true, format!("output of {id:?}: {e}"));
            }
        }
        self.out = out;
        // Always end what was begun, also after an NF error: the next begin needs it closed.
        if let Err(e) = self.worker.end() {
            self.note_error(true, format!("end {id:?}: {e}"));
        }
        self.since_publish += 1;
        if self.since_publish >= PUBLISH_EVERY {
            self.publish(false);
        }
    }

    fn flush(&mut self) {
        if let Err(e) = self.worker.flush() {
            self.note_error(true, format!("flush: {e}"));
        }
    }

    /// Publishes counters; `with_local`: the NF's own stats as well (costlier: when idle, at
    /// most every `LOCAL_STATS_EVERY`).
    fn publish(&mut self, with_local: bool) {
        self.since_publish = 0;
        let due = self
            .local_published
            .is_none_or(|t| t.elapsed() >= LOCAL_STATS_EVERY);
        let local = (with_local && due).then(|| {
            self.local_published = Some(Instant::now());
            self.nf.local_stats(&self.local)
        });
        let mut p = self.publ.lock().unwrap_or_else(|e| e.into_inner());
        p.stats = self.worker.stats.clone();
        p.input_next = self.next_seq;
        p.nf_errors = self.nf_errors;
        p.log_errors = self.log_errors;
        p.last_error.clone_from(&self.last_error);
        if let Some(l) = local {
            p.local = l;
        }
    }

    /// Serves control messages; returns false once the coordinator is gone.
    fn serve_ctl(&mut self) -> bool {
        loop {
            match self.ctl.try_recv() {
                Ok(Ctl::Park { delta, arrived }) => self.park(delta, arrived),
                Err(TryRecvError::Empty) => return true,
                Err(TryRecvError::Disconnected) => return false,
            }
        }
    }

    fn park(&mut self, delta: Option<bool>, arrived: SyncSender<Parked>) {
        let at = Instant::now();
        self.flush();
        let delta = delta.map(|full| self.nf.take_delta(&mut self.local, full));
        let (rtx, rrx) = std::sync::mpsc::sync_channel(1);
        let parked = Parked {
            queue: self.queue(),
            input_next: self.next_seq,
            delta,
            at,
            resume: rtx,
        };
        if arrived.send(parked).is_err() {
            return; // the coordinator gave up on this barrier: go on
        }
        // A dropped sender (coordinator gone or barrier abandoned) means go on as before.
        match rrx.recv().unwrap_or(Post::Continue) {
            Post::Continue => {}
            Post::SetTransport {
                transport,
                log_input,
            } => {
                drop(self.worker.set_transport(transport));
                self.log_input = log_input;
            }
            Post::Import { records, done } => {
                let r = self.nf.import(&mut self.local, records);
                let _ = done.send(r);
            }
        }
        self.publish(true);
    }

    /// The thread's loop: until the engine and the coordinator are gone.
    pub fn run(mut self) -> (F::Local, WorkerPub) {
        let mut dirty = false;
        loop {
            if !self.serve_ctl() {
                break;
            }
            let job = match self.jobs.try_recv() {
                Ok(j) => j,
                Err(TryRecvError::Empty) => {
                    if dirty {
                        // The queue ran dry: nothing to batch with, send what is queued now.
                        self.flush();
                        dirty = false;
                        self.publish(false);
                    }
                    match self.jobs.recv_timeout(IDLE_FLUSH) {
                        Ok(j) => j,
                        Err(RecvTimeoutError::Timeout) => {
                            self.flush();
                            self.publish(true);
                            continue;
                        }
                        Err(RecvTimeoutError::Disconnected) => break,
                    }
                }
                Err(TryRecvError::Disconnected) => break,
            };
            match job {
                Job::Packet(p) => {
                    let seq = self.next_seq;
                    self.next_seq += 1;
                    self.process(p, seq);
                    dirty = true;
                }
                Job::Poke => {}
            }
        }
        self.flush();
        self.publish(true);
        let p = self.publ.lock().unwrap_or_else(|e| e.into_inner()).clone();
        (self.local, p)
    }
}

/// Replays one queue of a dead primary's logged input on a recovery worker (same per-packet
/// path as live processing, input seqs from the log). Returns the worker state and the
/// number of packets replayed.
pub(crate) fn replay_queue<F: FtmbNf>(
    nf: &F,
    shared: &F::Shared,
    worker: &mut Worker,
    local: &mut F::Local,
    inputs: Vec<(u64, Vec<u8>)>,
) -> Result<u64, String> {
    let q: QueueId = worker.queue();
    let mut out = Vec::new();
    let mut n = 0;
    for (seq, frame) in inputs {
        let pkt = super::frame::decode_owned(frame)
            .map_err(|e| format!("queue {q} input {seq}: undecodable logged frame: {e}"))?;
        let id = PacketId { queue: q, seq };
        worker
            .begin(id)
            .map_err(|e| format!("replay begin {id:?}: {e}"))?;
        if let Err(e) = nf.process(shared, local, worker, pkt, &mut out) {
            // A divergence or a stalled turn means the log does not replay: stop, do not guess.
            let _ = worker.end();
            return Err(format!("replay of {id:?}: {e}"));
        }
        for o in out.drain(..) {
            worker
                .output(super::frame::encode_output(&o))
                .map_err(|e| format!("replay output of {id:?}: {e}"))?;
        }
        worker
            .end()
            .map_err(|e| format!("replay end {id:?}: {e}"))?;
        n += 1;
    }
    worker.flush().map_err(|e| format!("replay flush: {e}"))?;
    Ok(n)
}
