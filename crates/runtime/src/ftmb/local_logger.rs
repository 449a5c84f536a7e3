//! An output logger on a thread of this process, releasing straight into the engine's
//! [`ReleaseQueue`]. Used (1) before `ftmb_protect`, so traffic flows before any logger is
//! assigned, and (2) during a recovery, around the `OutputLogger` taken from the dead
//! primary's logs (it suppresses output that was already released).
//!
//! Not `pliant_ftmb::spawn_logger`: that one releases into an unbounded channel with no way to
//! wake the engine's poll(2); this one pushes into the bounded queue whose wake fd the engine
//! polls. Nothing can be recovered from an in-process logger of our own master, so it drops
//! every PAL as soon as it is logged (`truncate`), which keeps its log bounded without
//! snapshots.
//!
//! Output released here goes to this engine's ports, so it is audited like the network
//! logger's: `OutputLogger::drain_released` checks each output against the PALs stored when it
//! is handed to the [`ReleaseQueue`], and the counts go to a [`LocalAudit`] shared by every
//! in-process logger of the replica (`ftmb_status` `local_audit`). The PALs a local logger of
//! our own master drops after logging them were stored when the release was checked; nothing
//! is recovered from them, which is why dropping them does not weaken the audit.

use super::release::ReleaseQueue;
use pliant_ftmb::{Feedback, LogBatch, LogTransport, OutputLogger, QueueId, TransportError};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// Batches queued for the logger thread at most (a full channel blocks the worker: counted).
const BATCH_BOUND: usize = 1024;
/// Feedback queued per worker at most (cumulative or re-requested: dropping is safe).
const FEEDBACK_BOUND: usize = 256;

type FeedbackTable = Arc<Mutex<Vec<Option<SyncSender<Feedback>>>>>;

/// What the logger thread takes, in order.
pub(crate) enum Msg {
    Batch(LogBatch),
    /// Answered once every batch queued before it is handled (see [`LocalLogger::sync`]).
    Sync(SyncSender<()>),
}

/// How long [`LocalLogger::sync`] waits for the logger thread at most.
const SYNC_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Output-commit audit of the in-process loggers, summed over all of them (before
/// `ftmb_protect`, after a fallback, and the recovery loggers): they come and go, the replica's
/// status keeps their counts.
#[derive(Default)]
pub(crate) struct LocalAudit {
    pub checked: AtomicU64,
    pub violations: AtomicU64,
}

pub(crate) struct LocalLogger {
    tx: Option<SyncSender<Msg>>,
    feedback: FeedbackTable,
    queues: usize,
    join: Option<JoinHandle<OutputLogger>>,
    pub blocked_sends: Arc<AtomicU64>,
}

pub(crate) struct LocalTransport {
    tx: SyncSender<Msg>,
    fb: Receiver<Feedback>,
    blocked: Arc<AtomicU64>,
}

impl LogTransport for LocalTransport {
    fn send(&mut self, batch: LogBatch) -> Result<(), TransportError> {
        match self.tx.try_send(Msg::Batch(batch)) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(b)) => {
                // Back-pressure from the logger thread: wait (counted), never drop a batch.
                self.blocked.fetch_add(1, Ordering::Relaxed);
                self.tx.send(b).map_err(|_| TransportError::Closed)
            }
            Err(TrySendError::Disconnected(_)) => Err(TransportError::Closed),
        }
    }

    fn poll_feedback(&mut self) -> Option<Feedback> {
        self.fb.try_recv().ok()
    }
}

impl LocalLogger {
    pub fn spawn(
        logger: OutputLogger,
        release: Arc<ReleaseQueue>,
        audit: Arc<LocalAudit>,
    ) -> std::io::Result<LocalLogger> {
        let (tx, rx) = mpsc::sync_channel::<Msg>(BATCH_BOUND);
        let queues = logger.queues();
        let feedback: FeedbackTable = Arc::new(Mutex::new(vec![None; queues]));
        let fb = Arc::clone(&feedback);
        let join = std::thread::Builder::new()
            .name("ftmb-local-log".into())
            .spawn(move || run(logger, rx, fb, release, audit))?;
        Ok(LocalLogger {
            tx: Some(tx),
            feedback,
            queues,
            join: Some(join),
            blocked_sends: Arc::new(AtomicU64::new(0)),
        })
    }

    /// The transport of worker queue `q` (replaces the queue's feedback channel).
    pub fn transport(&self, q: usize) -> Result<LocalTransport, TransportError> {
        let Some(tx) = self.tx.clone() else {
            return Err(TransportError::Closed);
        };
        if q >= self.queues {
            return Err(TransportError::NoQueue(q as QueueId));
        }
        let (ftx, frx) = mpsc::sync_channel(FEEDBACK_BOUND);
        self.feedback.lock().unwrap_or_else(|e| e.into_inner())[q] = Some(ftx);
        Ok(LocalTransport {
            tx,
            fb: frx,
            blocked: Arc::clone(&self.blocked_sends),
        })
    }

    /// Waits (bounded) until every batch queued so far is handled: all releasable output is
    /// in the release queue. With the workers parked, output released after this is theirs
    /// from a later logger, so nothing is reordered across a logger switch.
    pub fn sync(&self) {
        let Some(tx) = &self.tx else {
            return;
        };
        let (dtx, drx) = mpsc::sync_channel(1);
        if tx.send(Msg::Sync(dtx)).is_ok() {
            let _ = drx.recv_timeout(SYNC_WAIT);
        }
    }

    /// Waits until every transport is dropped and every batch is handled (all releasable
    /// output is in the release queue), and returns the logger.
    pub fn finish(mut self) -> Option<OutputLogger> {
        self.tx = None;
        self.join.take().and_then(|j| j.join().ok())
    }
}

fn run(
    mut logger: OutputLogger,
    rx: Receiver<Msg>,
    fb: FeedbackTable,
    release: Arc<ReleaseQueue>,
    audit: Arc<LocalAudit>,
) -> OutputLogger {
    // A recovery's logger arrives with the network logger's counts: only ours are added.
    let (mut checked, mut violations) = (logger.stats.audit_checked, logger.stats.audit_violations);
    while let Ok(m) = rx.recv() {
        let b = match m {
            Msg::Batch(b) => b,
            Msg::Sync(done) => {
                let _ = done.try_send(());
                continue;
            }
        };
        // Errors are counted in the logger's stats (bad/stale batches); the stream goes on.
        let _ = logger.ingest(b);
        let released = logger.drain_released();
        // Counted before the output is queued: whoever saw the output sees its audit.
        let st = &logger.stats;
        audit
            .checked
            .fetch_add(st.audit_checked - checked, Ordering::Relaxed);
        audit
            .violations
            .fetch_add(st.audit_violations - violations, Ordering::Relaxed);
        (checked, violations) = (st.audit_checked, st.audit_violations);
        for r in released {
            release.push(r.payload);
        }
        let logged: Vec<u64> = (0..logger.queues())
            .map(|q| logger.logged(q as QueueId).unwrap_or(0))
            .collect();
        logger.truncate(&logged);
        let feedback = logger.drain_feedback();
        if !feedback.is_empty() {
            let table = fb.lock().unwrap_or_else(|e| e.into_inner());
            for (q, f) in feedback {
                if let Some(Some(tx)) = table.get(q as usize) {
                    let _ = tx.try_send(f);
                }
            }
        }
    }
    logger
}
