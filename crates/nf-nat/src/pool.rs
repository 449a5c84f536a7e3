//! Per-protocol pool of external ports (or ICMP echo identifiers).
//!
//! FIFO free list: allocation and release are O(1), and a released port goes to the back of the
//! queue so it is reused as late as possible (a remote host may still hold TIME_WAIT state for
//! the old mapping). A bitmap guards against double release.

use std::collections::VecDeque;

#[derive(Debug)]
pub struct PortPool {
    /// The blocks this replica allocates from (inclusive ranges), sorted.
    blocks: Vec<(u16, u16)>,
    free: VecDeque<u16>,
    /// Indexed by port: allocated (or reserved) right now. 64 KiB; three pools per NAT.
    in_use: Vec<bool>,
    used: usize,
    /// Allocations refused because the pool was empty.
    pub exhausted: u64,
    /// Releases of ports that were not allocated (a bug elsewhere; counted, ignored).
    pub bad_release: u64,
    /// Releases of ports outside our blocks: a migrated flow whose port belongs to another
    /// replica ended here (that replica keeps the port reserved; see the crate README).
    pub foreign_release: u64,
}

impl PortPool {
    /// A pool of `min..=max` (inclusive). Callers validate `min <= max`.
    pub fn new(min: u16, max: u16) -> Self {
        Self::from_blocks(&[(min, max)])
    }

    /// A pool of the union of `blocks` (inclusive ranges; callers validate `lo <= hi`).
    pub fn from_blocks(blocks: &[(u16, u16)]) -> Self {
        let mut blocks = blocks.to_vec();
        blocks.sort_unstable();
        let mut pool = PortPool {
            blocks: Vec::new(),
            free: VecDeque::new(),
            in_use: vec![false; 1 << 16],
            used: 0,
            exhausted: 0,
            bad_release: 0,
            foreign_release: 0,
        };
        let mut owned = vec![false; 1 << 16];
        for &(lo, hi) in &blocks {
            for p in lo..=hi {
                if !owned[usize::from(p)] {
                    owned[usize::from(p)] = true;
                    pool.free.push_back(p);
                }
            }
        }
        pool.blocks = blocks;
        pool
    }

    /// Whether `port` lies in one of our blocks.
    pub fn owns(&self, port: u16) -> bool {
        self.blocks
            .iter()
            .any(|&(lo, hi)| (lo..=hi).contains(&port))
    }

    pub fn blocks(&self) -> &[(u16, u16)] {
        &self.blocks
    }

    pub fn alloc(&mut self) -> Option<u16> {
        while let Some(p) = self.free.pop_front() {
            let used = &mut self.in_use[usize::from(p)];
            // A port reserved while it sat in the free list is skipped (lazy removal).
            if !*used {
                *used = true;
                self.used += 1;
                return Some(p);
            }
        }
        self.exhausted += 1;
        None
    }

    /// Marks an owned `port` as in use without allocating it (a port already taken by a
    /// mapping when the blocks changed). False if it is not ours or already in use.
    pub fn reserve(&mut self, port: u16) -> bool {
        if !self.owns(port) || self.in_use[usize::from(port)] {
            return false;
        }
        self.in_use[usize::from(port)] = true;
        self.used += 1;
        true
    }

    /// Returns `port` to the pool; false (and counted) if it was not allocated here.
    pub fn release(&mut self, port: u16) -> bool {
        if !self.owns(port) {
            self.foreign_release += 1;
            return false;
        }
        let used = &mut self.in_use[usize::from(port)];
        if !*used {
            self.bad_release += 1;
            return false;
        }
        *used = false;
        self.used -= 1;
        self.free.push_back(port);
        true
    }

    /// Ports in use (allocated or reserved) that `self` would hand out again if forgotten:
    /// carried over to a pool with new blocks.
    pub fn in_use_ports(&self) -> impl Iterator<Item = u16> + '_ {
        self.in_use
            .iter()
            .enumerate()
            .filter(|(_, u)| **u)
            .map(|(p, _)| p as u16)
    }

    pub fn capacity(&self) -> usize {
        self.blocks
            .iter()
            .map(|&(lo, hi)| usize::from(hi - lo) + 1)
            .sum()
    }

    pub fn in_use(&self) -> usize {
        self.used
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
        assert_eq!((p.bad_release, p.foreign_release), (1, 1));
        // The released port goes to the back: the other two come first.
        assert_ne!(p.alloc(), Some(a));
        assert_ne!(p.alloc(), Some(a));
        assert_eq!(p.alloc(), Some(a));
    }

    #[test]
    fn blocks_bound_allocation_and_reservations_survive() {
        let mut p = PortPool::from_blocks(&[(2000, 2001), (1000, 1000)]);
        assert_eq!(p.capacity(), 3);
        assert!(p.owns(1000) && p.owns(2001) && !p.owns(1500));
        assert!(p.reserve(2000));
        assert!(!p.reserve(2000), "already in use");
        assert!(!p.reserve(5), "not ours");
        let mut got: Vec<u16> = std::iter::from_fn(|| p.alloc()).collect();
        got.sort_unstable();
        assert_eq!(got, vec![1000, 2001], "the reserved port is skipped");
        assert_eq!(p.in_use(), 3);
        assert!(!p.release(7));
        assert_eq!((p.foreign_release, p.bad_release), (1, 0));
        assert!(p.release(2000));
        assert_eq!(p.alloc(), Some(2000));
        assert_eq!(p.in_use_ports().count(), 3);
    }
}
