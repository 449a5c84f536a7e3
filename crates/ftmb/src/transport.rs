//! How a worker's log stream reaches the output logger. [`LogTransport`] is the seam: here an
//! in-process bounded channel to a logger thread ([`spawn_logger`]); between processes the
//! same batches go over a pliant-wire session ([`crate::net::NetTransport`]).

use crate::logger::{LoggerError, OutputLogger, Released};
use crate::wire::{Feedback, LogBatch, QueueId};
use std::sync::mpsc::{self, Receiver, Sender, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TransportError {
    #[error("the output logger is gone (channel closed)")]
    Closed,
    #[error("queue {0} has no feedback channel installed")]
    NoQueue(QueueId),
    /// Network transport: the logger did not take any byte for `waited_ms` (socket buffer full;
    /// the logger is stalled or gone). The stream is unusable after it (a frame may be cut).
    #[error("the logger took nothing for {waited_ms} ms (socket buffer full): link given up")]
    TimedOut { waited_ms: u64 },
    /// Network transport: the link broke earlier or now (reset, refused, protocol error).
    #[error("logger link broken: {0}")]
    Broken(String),
    #[error("batch of {0} bytes is over the frame bound")]
    TooLarge(usize),
}

/// One worker queue's link to the output logger.
pub trait LogTransport: Send {
    /// Hands one batch over. Reliable, in-order delivery is *not* assumed: the logger detects
    /// PAL gaps and asks for them again through [`LogTransport::poll_feedback`].
    fn send(&mut self, batch: LogBatch) -> Result<(), TransportError>;
    /// The next feedback from the logger for this queue, if any (non-blocking).
    fn poll_feedback(&mut self) -> Option<Feedback>;
    /// Link counters, for transports that have them (network: bytes, frames, blocked writes).
    fn net_stats(&self) -> Option<crate::net::NetStats> {
        None
    }
}

/// What the logger thread takes: a batch, or a closure run on the logger between batches (so a
/// control step is ordered after every batch sent before it).
pub enum LoggerInput {
    Batch(LogBatch),
    Control(Box<dyn FnOnce(&mut OutputLogger) + Send>),
}

type FeedbackTable = Arc<Mutex<Vec<Option<SyncSender<Feedback>>>>>;

/// In-process transport: a bounded channel into the logger thread, a bounded channel back.
pub struct ChannelTransport {
    queue: QueueId,
    tx: SyncSender<LoggerInput>,
    fb: Receiver<Feedback>,
    /// Sends that found the channel full and waited (back-pressure; counted, not hidden).
    pub blocked_sends: u64,
}

impl LogTransport for ChannelTransport {
    fn send(&mut self, batch: LogBatch) -> Result<(), TransportError> {
        match self.tx.try_send(LoggerInput::Batch(batch)) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(b)) => {
                self.blocked_sends += 1;
                self.tx.send(b).map_err(|_| TransportError::Closed)
            }
            Err(TrySendError::Disconnected(_)) => Err(TransportError::Closed),
        }
    }

    fn poll_feedback(&mut self) -> Option<Feedback> {
        // Empty or disconnected (logger gone): nothing to act on either way.
        self.fb.try_recv().ok()
    }
}

impl ChannelTransport {
    pub fn queue(&self) -> QueueId {
        self.queue
    }
}

/// Handle on a logger thread.
pub struct LoggerHandle {
    tx: SyncSender<LoggerInput>,
    feedback: FeedbackTable,
    queues: usize,
    join: Option<JoinHandle<OutputLogger>>,
}

/// Bound on queued feedback per queue (feedback is cumulative or repeatable; an overflow is
/// dropped, counted by the logger thread as `feedback_dropped`).
pub const FEEDBACK_BOUND: usize = 1024;

/// Runs `logger` on a thread fed by a bounded channel of `bound` batches; released outputs go
/// to `sink` in release order.
pub fn spawn_logger(
    logger: OutputLogger,
    bound: usize,
    sink: Sender<Released>,
) -> std::io::Result<LoggerHandle> {
    let (tx, rx) = mpsc::sync_channel::<LoggerInput>(bound.max(1));
    let queues = logger.queues();
    let feedback: FeedbackTable = Arc::new(Mutex::new(vec![None; queues]));
    let fb = Arc::clone(&feedback);
    let join = std::thread::Builder::new()
        .name("ftmb-logger".into())
        .spawn(move || run_logger(logger, rx, fb, sink))?;
    Ok(LoggerHandle {
        tx,
        feedback,
        queues,
        join: Some(join),
    })
}

fn run_logger(
    mut logger: OutputLogger,
    rx: Receiver<LoggerInput>,
    fb: FeedbackTable,
    sink: Sender<Released>,
) -> OutputLogger {
    while let Ok(input) = rx.recv() {
        match input {
            // Errors are counted in the logger's stats (bad_batches); the stream goes on.
            LoggerInput::Batch(b) => {
                let _: Result<(), LoggerError> = logger.ingest(b);
            }
            LoggerInput::Control(f) => f(&mut logger),
        }
        for r in logger.drain_released() {
            // A closed sink means nobody consumes output any more; the logger keeps logging.
            let _ = sink.send(r);
        }
        let feedback = logger.drain_feedback();
        if !feedback.is_empty() {
            let table = fb.lock().unwrap_or_else(|e| e.into_inner());
            for (q, f) in feedback {
                if let Some(Some(tx)) = table.get(q as usize) {
                    // Full or closed: feedback is cumulative / re-requested, dropping is safe.
                    let _ = tx.try_send(f);
                }
            }
        }
    }
    logger
}

impl LoggerHandle {
    /// A transport for `queue`. Replaces the queue's feedback channel (a recovered master's
    /// worker takes over the queue of the dead one).
    pub fn transport(&self, queue: QueueId) -> Result<ChannelTransport, TransportError> {
        if queue as usize >= self.queues {
            return Err(TransportError::NoQueue(queue));
        }
        let (ftx, frx) = mpsc::sync_channel(FEEDBACK_BOUND);
        let mut table = self.feedback.lock().unwrap_or_else(|e| e.into_inner());
        table[queue as usize] = Some(ftx);
        Ok(ChannelTransport {
            queue,
            tx: self.tx.clone(),
            fb: frx,
            blocked_sends: 0,
        })
    }

    /// Runs `f` on the logger after every batch already sent, and returns its result.
    pub fn with<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut OutputLogger) -> R + Send + 'static,
    ) -> Result<R, TransportError> {
        let (rtx, rrx) = mpsc::sync_channel(1);
        self.tx
            .send(LoggerInput::Control(Box::new(move |l| {
                let _ = rtx.send(f(l));
            })))
            .map_err(|_| TransportError::Closed)?;
        rrx.recv().map_err(|_| TransportError::Closed)
    }

    /// Stops the thread once every transport is dropped and returns the logger.
    pub fn join(mut self) -> Option<OutputLogger> {
        let (tx, _) = mpsc::sync_channel(1);
        drop(std::mem::replace(&mut self.tx, tx));
        self.join.take().and_then(|j| j.join().ok())
    }
}
