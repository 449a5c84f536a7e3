//! Per-protocol pool of external ports (or ICMP echo identifiers).
//!
//! FIFO free list: allocation and release are O(1), and a released port goes to the back of the
//! queue so it is reused as late as possible (a remote host may still hold TIME_WAIT state for
//! the old mapping). A bitmap guards against double release.

use std::collections::VecDeque;

#[derive(Debug)]
pub struct PortPool {
    min: u16,
    free: VecDeque<u16>,
    in_use: Vec<bool>,
    /// Allocations refused because the pool was empty.
    pub exhausted: u64,
    /// Releases of ports that were not allocated (a bug elsewhere; counted, ignored).
    pub bad_release: u64,
}

impl PortPool {
    /// A pool of `min..=max` (inclusive). Callers validate `min <= max`.
    pub fn new(min: u16, max: u16) -> Self {
        let n = usize::from(max.saturating_sub(min)) + 1;
        PortPool {
            min,
            free: (min..=max).collect(),
            in_use: vec![false; n],
            exhausted: 0,
            bad_release: 0,
        }
    }

    pub fn alloc(&mut self) -> Option<u16> {
        match self.free.pop_front() {
            Some(p) => {
                let i = usize::from(p - self.min);
                debug_assert!(!self.in_use[i], "free list held an allocated port");
                self.in_use[i] = true;
                Some(p)
            }
            None => {
                self.exhausted += 1;
                None
            }
        }
    }

    /// Returns `port` to the pool; false (and counted) if it was not allocated.
    pub fn release(&mut self, port: u16) -> bool {
        let Some(i) = port.checked_sub(self.min).map(usize::from) else {
            self.bad_release += 1;
            return false;
        };
        match self.in_use.get_mut(i) {
            Some(used) if *used => {
                *used = false;
                self.free.push_back(port);
                true
            }
            _ => {
                self.bad_release += 1;
                false
            }
        }
    }

    pub fn capacity(&self) -> usize {
        self.in_use.len()
    }

    pub fn in_use(&self) -> usize {
        self.in_use.len() - self.free.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocates_every_port_once_then_refuses() {
        let mut p = PortPool::new(100, 103);
        let mut got: Vec<u16> = (0..4).filter_map(|_| p.alloc()).collect();
        got.sort_unstable();
        assert_eq!(got, vec![100, 101, 102, 103]);
        assert_eq!(p.alloc(), None);
        assert_eq!(p.exhausted, 1);
        assert_eq!(p.in_use(), 4);
    }

    #[test]
    fn release_is_fifo_and_rejects_double_release() {
        let mut p = PortPool::new(1, 3);
        let a = p.alloc().unwrap();
        assert!(p.release(a));
        assert!(!p.release(a));
        assert!(!p.release(999));
        assert_eq!(p.bad_release, 2);
        // The released port goes to the back: the other two come first.
        assert_ne!(p.alloc(), Some(a));
        assert_ne!(p.alloc(), Some(a));
        assert_eq!(p.alloc(), Some(a));
    }
}
