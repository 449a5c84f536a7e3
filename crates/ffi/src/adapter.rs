//! The runtime side of a C network function: an NF whose `process` only queues the packet for
//! the C program's `pliant_pkt_read`, and whose `on_timer` only queues `(key, id)` for the C
//! timer callback. The C code then runs *outside* any engine call, so it may call every API
//! function (state, packets) without re-entering the engine.

use pliant_runtime::{Ctx, NetworkFunction, Packet};
use pliant_state::{FlowKey, TimerId};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};

/// Drop reason when the C program does not read packets as fast as the engine receives them.
pub const DROP_INBOX_FULL: &str = "c_inbox_full";
/// Drop reason when more timers expire in one round than the timer queue holds.
pub const DROP_TIMER_QUEUE_FULL: &str = "c_timer_queue_full";

/// What the engine hands to the C program, bounded both ways.
#[derive(Default)]
pub struct Queues {
    pub inbox: VecDeque<Packet>,
    pub timers: VecDeque<(FlowKey, TimerId)>,
    pub max_inbox: usize,
    pub max_timers: usize,
}

/// Shared between the adapter (inside the engine) and the FFI context. A mutex rather than a
/// `RefCell` because `NetworkFunction` must be `Send`; it is never contended (one thread).
pub type SharedQueues = Arc<Mutex<Queues>>;

pub fn lock(q: &SharedQueues) -> MutexGuard<'_, Queues> {
    // Nothing panics while holding the lock; recover the data rather than propagate a poison.
    q.lock().unwrap_or_else(|e| e.into_inner())
}

pub struct CAdapter {
    pub queues: SharedQueues,
}

impl NetworkFunction for CAdapter {
    /// A C flow's state is an opaque, zero-initialised byte blob of the size given to
    /// `pliant_create_flow`.
    type Flow = Vec<u8>;
    const NAME: &'static str = "c";

    fn process(&mut self, ctx: &mut Ctx<Vec<u8>>, pkt: Packet) {
        let mut q = lock(&self.queues);
        if q.inbox.len() >= q.max_inbox {
            drop(q);
            ctx.pkt_drop(pkt, DROP_INBOX_FULL);
            return;
        }
        q.inbox.push_back(pkt);
    }

    fn on_timer(&mut self, ctx: &mut Ctx<Vec<u8>>, key: FlowKey, timer: TimerId) {
        let mut q = lock(&self.queues);
        if q.timers.len() >= q.max_timers {
            drop(q);
            ctx.count_drop(DROP_TIMER_QUEUE_FULL, 1);
            return;
        }
        q.timers.push_back((key, timer));
    }
}
