//! Input logger (paper §5.1): per input queue, assign sequence numbers, keep each packet until a
//! snapshot covers it, and hand the same per-queue order to the master and, after a failure, to
//! the replaying standby. Reliable delivery to the master is the caller's channel; this is the
//! log itself, bounded per queue (a full queue refuses input, counted, instead of growing).

use crate::wire::{PacketId, QueueId};
use std::collections::VecDeque;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum InputError {
    #[error("input queue {0} does not exist")]
    NoQueue(QueueId),
    #[error("input queue {queue} holds {held} packets, its bound: packet refused")]
    Full { queue: QueueId, held: usize },
    #[error("input queue {queue}: seq {seq} was truncated (first held is {first})")]
    Truncated {
        queue: QueueId,
        seq: u64,
        first: u64,
    },
}

#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct InputStats {
    pub logged: u64,
    pub refused_full: u64,
    pub truncated: u64,
}

struct InQueue {
    /// Seq of `held[0]`.
    base: u64,
    held: VecDeque<Vec<u8>>,
}

pub struct InputLogger {
    queues: Vec<InQueue>,
    max_held: usize,
    pub stats: InputStats,
}

impl InputLogger {
    /// `queues` input queues, each holding at most `max_held` packets between snapshots.
    pub fn new(queues: usize, max_held: usize) -> InputLogger {
        InputLogger {
            queues: (0..queues)
                .map(|_| InQueue {
                    base: 0,
                    held: VecDeque::new(),
                })
                .collect(),
            max_held,
            stats: InputStats::default(),
        }
    }

    fn q(&self, queue: QueueId) -> Result<&InQueue, InputError> {
        self.queues
            .get(queue as usize)
            .ok_or(InputError::NoQueue(queue))
    }

    /// Logs one input packet; its id is what the worker must process it as.
    pub fn append(&mut self, queue: QueueId, payload: Vec<u8>) -> Result<PacketId, InputError> {
        let max = self.max_held;
        let q = self
            .queues
            .get_mut(queue as usize)
            .ok_or(InputError::NoQueue(queue))?;
        if q.held.len() >= max {
            self.stats.refused_full += 1;
            return Err(InputError::Full {
                queue,
                held: q.held.len(),
            });
        }
        let seq = q.base + q.held.len() as u64;
        q.held.push_back(payload);
        self.stats.logged += 1;
        Ok(PacketId { queue, seq })
    }

    /// The seq the next packet of `queue` will get.
    pub fn next_seq(&self, queue: QueueId) -> Result<u64, InputError> {
        let q = self.q(queue)?;
        Ok(q.base + q.held.len() as u64)
    }

    /// Logged packets of `queue` from seq `from` on, in order (replay; or delivery).
    pub fn read_from(
        &self,
        queue: QueueId,
        from: u64,
    ) -> Result<impl Iterator<Item = (PacketId, &[u8])>, InputError> {
        let q = self.q(queue)?;
        if from < q.base {
            return Err(InputError::Truncated {
                queue,
                seq: from,
                first: q.base,
            });
        }
        let skip = usize::try_from(from - q.base).unwrap_or(usize::MAX);
        Ok(q.held.iter().enumerate().skip(skip).map(move |(i, p)| {
            (
                PacketId {
                    queue,
                    seq: q.base + i as u64,
                },
                p.as_slice(),
            )
        }))
    }

    /// A snapshot covers input below `input_next[q]` on each queue: drop it.
    pub fn truncate(&mut self, input_next: &[u64]) {
        for (q, &next) in self.queues.iter_mut().zip(input_next) {
            while q.base < next && q.held.pop_front().is_some() {
                q.base += 1;
                self.stats.truncated += 1;
            }
        }
    }

    pub fn held(&self) -> usize {
        self.queues.iter().map(|q| q.held.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequences_bounds_and_truncation() {
        let mut il = InputLogger::new(2, 3);
        for i in 0..3u8 {
            assert_eq!(
                il.append(1, vec![i]).unwrap(),
                PacketId {
                    queue: 1,
                    seq: i as u64
                }
            );
        }
        assert!(matches!(
            il.append(1, vec![9]),
            Err(InputError::Full { queue: 1, .. })
        ));
        assert_eq!(il.stats.refused_full, 1);
        assert_eq!(il.append(5, vec![]), Err(InputError::NoQueue(5)));
        let got: Vec<u64> = il.read_from(1, 1).unwrap().map(|(id, _)| id.seq).collect();
        assert_eq!(got, vec![1, 2]);
        il.truncate(&[0, 2]);
        assert_eq!(il.held(), 1);
        assert!(matches!(
            il.read_from(1, 1),
            Err(InputError::Truncated { first: 2, .. })
        ));
        // Seqs continue after truncation; room is freed.
        assert_eq!(il.append(1, vec![3]).unwrap().seq, 3);
        let got: Vec<(u64, u8)> = il
            .read_from(1, 2)
            .unwrap()
            .map(|(id, p)| (id.seq, p[0]))
            .collect();
        assert_eq!(got, vec![(2, 2), (3, 3)]);
    }
}
