//! Real-time scheduling for a replica (`[replica] realtime_priority`).
//!
//! A migration's pause is a chain of thread wake-ups across processes (control request, the
//! source's packet thread, the peer channel's threads, the destination's packet thread). Under
//! the normal scheduler each wake-up on a busy core may wait for the running task's slice to
//! end, which on the 2-core benchmark machine turned a ~0.5 ms move into 4-8 ms now and then.
//! A SCHED_FIFO thread preempts ordinary tasks as soon as it is woken. The policy is set on
//! the replica's main thread before it spawns any other, so every thread (control, peer,
//! FTMB workers) inherits it.
//!
//! What it cannot remove: stalls of the whole virtual CPU (hypervisor), which `cyclictest`
//! shows on the benchmark machine at 2-3 ms a few times per second even for priority 80.

use std::ops::RangeInclusive;

/// The SCHED_FIFO priorities Linux accepts.
pub const PRIORITIES: RangeInclusive<u8> = 1..=99;

/// Puts the calling thread (and the threads it spawns afterwards) under SCHED_FIFO at `prio`.
pub fn set_realtime(prio: u8) -> Result<(), String> {
    if !PRIORITIES.contains(&prio) {
        return Err(format!(
            "realtime priority {prio}: use {}..={}",
            PRIORITIES.start(),
            PRIORITIES.end()
        ));
    }
    let param = libc::sched_param {
        sched_priority: i32::from(prio),
    };
    // SAFETY: `param` is a valid sched_param; pid 0 names the calling thread.
    let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        return Err(format!(
            "SCHED_FIFO priority {prio}: {e} (needs root or CAP_SYS_NICE, and an RT budget in \
             the cgroup)"
        ));
    }
    Ok(())
}

/// Back to the normal scheduler (SCHED_OTHER) for the calling thread.
pub fn set_normal() -> Result<(), String> {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: as in `set_realtime`.
    let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_OTHER, &param) };
    if rc != 0 {
        return Err(format!("SCHED_OTHER: {}", std::io::Error::last_os_error()));
    }
    Ok(())
}

/// SCHED_FIFO for the calling thread while the guard lives (for an orchestrating thread that
/// must not spawn threads meanwhile: they would inherit the policy). `None`: does nothing.
pub struct RealtimeGuard {
    active: bool,
}

impl RealtimeGuard {
    pub fn new(prio: Option<u8>) -> Result<RealtimeGuard, String> {
        match prio {
            Some(p) => set_realtime(p).map(|()| RealtimeGuard { active: true }),
            None => Ok(RealtimeGuard { active: false }),
        }
    }
}

impl Drop for RealtimeGuard {
    fn drop(&mut self) {
        if self.active {
            if let Err(e) = set_normal() {
                tracing::warn!(error = %e, "could not leave SCHED_FIFO");
            }
        }
    }
}

/// The calling thread's policy and priority, as `("fifo" | "rr" | "other" | ..., priority)`.
pub fn current() -> (&'static str, i32) {
    // SAFETY: both calls only read the calling thread's scheduling attributes.
    let policy = unsafe { libc::sched_getscheduler(0) };
    let mut param = libc::sched_param { sched_priority: 0 };
    // SAFETY: `param` is a valid out-pointer.
    unsafe { libc::sched_getparam(0, &mut param) };
    let name = match policy {
        libc::SCHED_FIFO => "fifo",
        libc::SCHED_RR => "rr",
        libc::SCHED_OTHER => "other",
        libc::SCHED_BATCH => "batch",
        libc::SCHED_IDLE => "idle",
        _ => "unknown",
    };
    (name, param.sched_priority)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_range_priorities_are_refused_before_any_syscall() {
        assert!(set_realtime(0).unwrap_err().contains("1..=99"));
        assert!(set_realtime(100).unwrap_err().contains("1..=99"));
    }

    // The test suite runs as root (CI and `make test`), so the syscall must succeed; done on
    // a thread of its own so the test harness keeps its normal policy.
    #[test]
    fn fifo_is_set_and_inherited_by_threads_spawned_afterwards() {
        std::thread::spawn(|| {
            assert_eq!(current().0, "other");
            set_realtime(7).expect("SCHED_FIFO as root");
            assert_eq!(current(), ("fifo", 7));
            let child = std::thread::spawn(current).join().unwrap();
            assert_eq!(child, ("fifo", 7));
            set_normal().unwrap();
            assert_eq!(current(), ("other", 0));
            {
                let _g = RealtimeGuard::new(Some(9)).unwrap();
                assert_eq!(current(), ("fifo", 9));
            }
            assert_eq!(current(), ("other", 0));
            let _none = RealtimeGuard::new(None).unwrap();
            assert_eq!(current(), ("other", 0));
        })
        .join()
        .unwrap();
    }
}
