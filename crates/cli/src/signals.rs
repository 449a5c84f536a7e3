//! SIGINT and SIGTERM for the commands that run until stopped (`pliant smr up`, `pliant slice
//! serve`).

use std::time::Duration;

/// SIGINT and SIGTERM blocked in every thread and taken with `sigtimedwait`.
pub struct TermSignals {
    set: libc::sigset_t,
}

impl TermSignals {
    pub fn block() -> Result<TermSignals, String> {
        // SAFETY: the set is initialised by sigemptyset before use; pthread_sigmask only reads
        // it and changes this thread's mask.
        unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGINT);
            libc::sigaddset(&mut set, libc::SIGTERM);
            let rc = libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
            if rc != 0 {
                return Err(format!("blocking SIGINT/SIGTERM: error {rc}"));
            }
            Ok(TermSignals { set })
        }
    }

    /// A pending SIGINT/SIGTERM, waiting up to `t`.
    pub fn wait(&self, t: Duration) -> Option<i32> {
        let ts = libc::timespec {
            tv_sec: t.as_secs() as libc::time_t,
            tv_nsec: t.subsec_nanos() as libc::c_long,
        };
        // SAFETY: `self.set` is an initialised set; a null siginfo is allowed.
        let sig = unsafe { libc::sigtimedwait(&self.set, std::ptr::null_mut(), &ts) };
        (sig > 0).then_some(sig)
    }
}
