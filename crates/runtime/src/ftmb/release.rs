//! Released output on its way to the engine: a bounded queue filled by logger threads (the
//! in-process logger, the network logger's confirmations via `pliant_ftmb::HeldOutputs`) and
//! drained by the engine's I/O thread once per round, plus a wake-up fd so an engine asleep in
//! poll(2) sends released output at once instead of after its sleep bound.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::Arc;

/// Released payloads waiting for the engine at most (beyond: dropped, counted as
/// `release_dropped`; the engine drains every round, so this only fills when it is stalled).
pub const RELEASE_BOUND: usize = 65_536;

/// One wake-up socket pair. `armed` keeps it to one write per engine round however many
/// payloads arrive: a writer writes only when it flips `armed` from false to true, and the
/// engine clears it before it drains the queue (so a payload pushed after the drain writes).
pub(crate) struct Wake {
    rx: UnixStream,
    tx: UnixStream,
    armed: AtomicBool,
}

impl Wake {
    pub fn new() -> std::io::Result<Wake> {
        let (tx, rx) = UnixStream::pair()?;
        tx.set_nonblocking(true)?;
        rx.set_nonblocking(true)?;
        Ok(Wake {
            rx,
            tx,
            armed: AtomicBool::new(false),
        })
    }

    pub fn notify(&self) {
        if !self.armed.swap(true, Ordering::AcqRel) {
            // A full socket buffer means a wake-up is pending anyway.
            let _ = (&self.tx).write(&[1]);
        }
    }

    /// Called by the engine before it drains the queue.
    pub fn disarm(&self) {
        self.armed.store(false, Ordering::Release);
    }

    pub fn fd(&self) -> RawFd {
        self.rx.as_raw_fd()
    }

    pub fn drain(&self) {
        let mut buf = [0u8; 64];
        while matches!((&self.rx).read(&mut buf), Ok(n) if n > 0) {}
    }
}

/// The producers' end, the engine's end and the wake-up they share.
pub(crate) type ReleaseEnds = (Arc<ReleaseQueue>, Receiver<Vec<u8>>, Arc<Wake>);

/// The producers' end (cloned into every logger that releases to this engine).
pub(crate) struct ReleaseQueue {
    tx: SyncSender<Vec<u8>>,
    wake: Arc<Wake>,
    pub dropped: AtomicU64,
    pub pushed: AtomicU64,
}

impl ReleaseQueue {
    pub fn new(bound: usize) -> std::io::Result<ReleaseEnds> {
        let (tx, rx) = mpsc::sync_channel(bound.max(1));
        let wake = Arc::new(Wake::new()?);
        Ok((
            Arc::new(ReleaseQueue {
                tx,
                wake: Arc::clone(&wake),
                dropped: AtomicU64::new(0),
                pushed: AtomicU64::new(0),
            }),
            rx,
            wake,
        ))
    }

    /// Wakes the engine without a payload (e.g. packets held for a recovery can go now).
    pub fn wake(&self) {
        self.wake.notify();
    }

    /// Queues one released payload for the engine; never blocks a logger thread.
    pub fn push(&self, payload: Vec<u8>) {
        match self.tx.try_send(payload) {
            Ok(()) => {
                self.pushed.fetch_add(1, Ordering::Relaxed);
            }
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.wake.notify();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_counted_and_wakes_once_per_drain() {
        let (q, rx, wake) = ReleaseQueue::new(2).unwrap();
        q.push(vec![1]);
        q.push(vec![2]);
        q.push(vec![3]);
        assert_eq!(q.dropped.load(Ordering::Relaxed), 1);
        assert_eq!(q.pushed.load(Ordering::Relaxed), 2);
        // One byte for three pushes.
        let mut buf = [0u8; 8];
        assert_eq!((&wake.rx).read(&mut buf).unwrap(), 1);
        wake.disarm();
        assert_eq!(rx.try_iter().count(), 2);
        q.push(vec![4]);
        assert_eq!(
            (&wake.rx).read(&mut buf).unwrap(),
            1,
            "re-armed after the drain"
        );
    }
}
