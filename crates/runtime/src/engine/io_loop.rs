//! Pacing of the packet loop: after an empty round, keep polling the rings or sleep in poll(2)?
//!
//! Sleeping after every empty round means the next frame has to wake the thread: the sending
//! core raises an IPI, the scheduler switches us in, and only then is the ring read — several
//! microseconds per wake-up, paid per frame at moderate rates (ping, TCP ACK clocking) and
//! added to the RTT. [`Engine::run_paced`] therefore keeps polling for a bounded `spin` after
//! the last frame (yielding the CPU on each empty round, so other runnable tasks on a shared
//! core still get it) and only then sleeps; an idle replica sleeps after `spin` and so does not
//! burn a core. `spin == 0` is the plain loop of [`Engine::run`].

use super::Engine;
use crate::nf::NetworkFunction;
use pliant_io::FramePort;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// What the loop does after a round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Next {
    /// Frames arrived: run the next round at once.
    Poll,
    /// Nothing arrived, but traffic was flowing less than `spin` ago: yield, then poll again.
    Spin,
    /// Idle for at least `spin`: block in poll(2).
    Sleep,
}

/// The decision after a round at `now` that received `received` frames, given the time of the
/// last round that received any (`last_busy`). Pure, so it is unit-tested without ports.
pub(crate) fn next_step(
    received: usize,
    now: Instant,
    last_busy: Option<Instant>,
    spin: Duration,
) -> Next {
    if received > 0 {
        return Next::Poll;
    }
    match last_busy {
        Some(t) if now.saturating_duration_since(t) < spin => Next::Spin,
        _ => Next::Sleep,
    }
}

/// Spin budget used when the caller does not choose one (`PLIANT_SPIN_US` in the replica).
/// Zero: on the shared 2-core benchmark machine spinning 50-200 µs (with a yield per round)
/// showed no measurable gain in packets/s, Gbit/s or ping RTT (pings 2 ms apart outlast any
/// sane budget; under load the loop rarely sleeps anyway), while the yields cost ~13% of the
/// replica's CPU (crates/runtime/README.md, "Packet loop performance"). The knob stays for
/// machines with a dedicated core.
pub const DEFAULT_SPIN: Duration = Duration::ZERO;

impl<N: NetworkFunction, P: FramePort> Engine<N, P> {
    /// Like [`Engine::run`], but keeps polling (with a yield per empty round) for `spin` after
    /// the last received frame before sleeping in poll(2).
    pub fn run_paced(&mut self, stop: &AtomicBool, spin: Duration) -> std::io::Result<()> {
        let mut last_busy: Option<Instant> = None;
        while !stop.load(Ordering::SeqCst) && !self.stop_requested {
            let now = Instant::now();
            let received = self.poll_once(now);
            match next_step(received, now, last_busy, spin) {
                Next::Poll => last_busy = Some(now),
                Next::Spin => {
                    self.stats.idle_spins += 1;
                    std::thread::yield_now();
                }
                Next::Sleep => {
                    last_busy = None;
                    self.stats.sleeps += 1;
                    self.sleep(now)?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_mean_poll_again_at_once() {
        let t = Instant::now();
        assert_eq!(
            next_step(3, t, None, Duration::from_micros(100)),
            Next::Poll
        );
        assert_eq!(next_step(1, t, Some(t), Duration::ZERO), Next::Poll);
    }

    #[test]
    fn empty_round_spins_only_within_budget_after_traffic() {
        let t0 = Instant::now();
        let spin = Duration::from_micros(100);
        assert_eq!(
            next_step(0, t0 + Duration::from_micros(40), Some(t0), spin),
            Next::Spin
        );
        assert_eq!(
            next_step(0, t0 + Duration::from_micros(100), Some(t0), spin),
            Next::Sleep
        );
        // Never any traffic: sleep at once (an idle replica does not spin).
        assert_eq!(next_step(0, t0, None, spin), Next::Sleep);
        // Spin disabled: the plain loop.
        assert_eq!(next_step(0, t0, Some(t0), Duration::ZERO), Next::Sleep);
    }
}
