//! The fence against deposed controllers, kept by every process a controller commands
//! (replicas, host agents).

use std::sync::atomic::{AtomicU64, Ordering};

/// Controllers take turns leading (one at a time, by an etcd lease); each leader's requests
/// carry its term, which only grows. The commanded process keeps the highest term it has seen and refuses
/// any request of a lower one: a controller that was deposed (partitioned, paused) and still
/// believes it leads cannot migrate, protect or activate anything once its successor has
/// spoken. Requests without a term (the CLI, a single controller without elections) pass.
#[derive(Debug, Default)]
pub struct TermFence {
    pub term: AtomicU64,
    /// Requests refused for a lower term (counted, and each answered with both terms).
    pub refused: AtomicU64,
}

impl TermFence {
    /// Admits a request of `term` (and raises the fence to it), or says why not.
    pub fn admit(&self, term: Option<u64>) -> Result<(), String> {
        let Some(t) = term else { return Ok(()) };
        let seen = self.term.fetch_max(t, Ordering::AcqRel);
        if seen > t {
            self.refused.fetch_add(1, Ordering::Relaxed);
            return Err(format!(
                "deposed controller: request of term {t}, this process follows term {seen}"
            ));
        }
        Ok(())
    }
}
