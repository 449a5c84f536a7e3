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

/// Largest number of residue classes (FTMB workers) a [`ResiduePool`] splits into.
pub const MAX_CLASSES: u16 = 256;

/// A port pool shared by several workers, each allocating only ports of its own residue class
/// (`port % classes == class`), so a reply addressed to the external port can be steered to the
/// worker that owns the mapping by `port % classes` alone (the FTMB NAT).
///
/// Unlike [`PortPool`] the state is a bitmap with no free list: allocation scans the class
/// from a caller-given start (a logged random value), so the result is a pure function of the
/// bitmap and that value. That is what deterministic replay needs: the pool is rebuilt from
/// its image (the set of ports in use) and must hand out exactly the ports it handed out
/// originally, whatever order ports were released in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResiduePool {
    /// Disjoint, sorted inclusive ranges.
    blocks: Vec<(u16, u16)>,
    classes: u16,
    /// One bit per port: allocated or reserved.
    in_use: Vec<u64>,
    used: usize,
    /// Per class: ports in use, and ports the blocks hold.
    class_used: Vec<u32>,
    class_cap: Vec<u32>,
    /// Allocations refused because the class had no free port.
    pub exhausted: u64,
    /// Releases of owned ports that were not in use (counted, ignored).
    pub bad_release: u64,
    /// Releases of ports outside the blocks (a mapping imported from another replica).
    pub foreign_release: u64,
}

/// Serialisable form of a [`ResiduePool`]: what a snapshot stores (size grows with the ports
/// in use, not with the pool).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PoolImage {
    pub blocks: Vec<(u16, u16)>,
    pub classes: u16,
    /// Ports in use, ascending.
    pub in_use: Vec<u16>,
    pub exhausted: u64,
    pub bad_release: u64,
    pub foreign_release: u64,
}

/// Sorts `blocks` and merges overlapping or adjacent ranges.
fn merge_blocks(blocks: &[(u16, u16)]) -> Vec<(u16, u16)> {
    let mut b: Vec<(u16, u16)> = blocks.iter().copied().filter(|(lo, hi)| lo <= hi).collect();
    b.sort_unstable();
    let mut out: Vec<(u16, u16)> = Vec::with_capacity(b.len());
    for (lo, hi) in b {
        match out.last_mut() {
            Some(last) if u32::from(lo) <= u32::from(last.1) + 1 => last.1 = last.1.max(hi),
            _ => out.push((lo, hi)),
        }
    }
    out
}

/// First port of class `class` in `lo..=hi` and how many of that class the range holds.
fn class_span(lo: u16, hi: u16, classes: u16, class: u16) -> (u32, u32) {
    let (lo, hi, n, c) = (
        u32::from(lo),
        u32::from(hi),
        u32::from(classes),
        u32::from(class),
    );
    let first = lo + (c + n - lo % n) % n;
    if first > hi {
        (first, 0)
    } else {
        (first, (hi - first) / n + 1)
    }
}

impl ResiduePool {
    /// A pool over `blocks` (inclusive ranges; empty or reversed ones are ignored) split into
    /// `classes` residue classes (1..=256).
    pub fn new(blocks: &[(u16, u16)], classes: u16) -> Result<ResiduePool, String> {
        if classes == 0 || classes > MAX_CLASSES {
            return Err(format!(
                "nat: {classes} port classes (workers): between 1 and {MAX_CLASSES}"
            ));
        }
        let blocks = merge_blocks(blocks);
        let mut class_cap = vec![0u32; usize::from(classes)];
        for &(lo, hi) in &blocks {
            for (c, cap) in class_cap.iter_mut().enumerate() {
                *cap += class_span(lo, hi, classes, c as u16).1;
            }
        }
        Ok(ResiduePool {
            blocks,
            classes,
            in_use: vec![0; 1 << 10],
            used: 0,
            class_used: vec![0; usize::from(classes)],
            class_cap,
            exhausted: 0,
            bad_release: 0,
            foreign_release: 0,
        })
    }

    pub fn classes(&self) -> u16 {
        self.classes
    }

    pub fn blocks(&self) -> &[(u16, u16)] {
        &self.blocks
    }

    /// Whether `port` lies in one of the blocks.
    pub fn owns(&self, port: u16) -> bool {
        // Blocks are disjoint and sorted: the candidate is the last block starting at or
        // below `port`.
        let i = self.blocks.partition_point(|&(lo, _)| lo <= port);
        i > 0 && self.blocks[i - 1].1 >= port
    }

    pub fn is_used(&self, port: u16) -> bool {
        let p = usize::from(port);
        self.in_use[p / 64] & (1 << (p % 64)) != 0
    }

    fn set_used(&mut self, port: u16, used: bool) {
        let p = usize::from(port);
        let c = usize::from(port % self.classes);
        if used {
            self.in_use[p / 64] |= 1 << (p % 64);
            self.used += 1;
            self.class_used[c] += 1;
        } else {
            self.in_use[p / 64] &= !(1 << (p % 64));
            self.used -= 1;
            self.class_used[c] -= 1;
        }
    }

    /// Allocates a free port with `port % classes == class`, scanning the class in port order
    /// from its `start % capacity`-th port (wrapping). `None` (counted) if the class is full.
    pub fn alloc_in_class(&mut self, class: u16, start: u64) -> Option<u16> {
        let ci = usize::from(class);
        let (Some(&cap), Some(&used)) = (self.class_cap.get(ci), self.class_used.get(ci)) else {
            self.exhausted += 1;
            return None;
        };
        if used >= cap {
            self.exhausted += 1;
            return None;
        }
        // Find the block holding the start index, then walk the class forward from there.
        let mut idx = (start % u64::from(cap)) as u32;
        let spans: Vec<(u32, u32)> = self
            .blocks
            .iter()
            .map(|&(lo, hi)| class_span(lo, hi, self.classes, class))
            .collect();
        let mut b = 0;
        while idx >= spans[b].1 {
            idx -= spans[b].1;
            b += 1;
        }
        // `used < cap` guarantees a free port within `cap` steps.
        for _ in 0..cap {
            let first = spans[b].0;
            let port = (first + idx * u32::from(self.classes)) as u16;
            if !self.is_used(port) {
                self.set_used(port, true);
                return Some(port);
            }
            idx += 1;
            while idx >= spans[b].1 {
                idx = 0;
                b = (b + 1) % spans.len();
            }
        }
        self.exhausted += 1;
        None
    }

    /// Marks an owned, free `port` as in use. False if it is not ours or already in use.
    pub fn reserve(&mut self, port: u16) -> bool {
        if !self.owns(port) || self.is_used(port) {
            return false;
        }
        self.set_used(port, true);
        true
    }

    /// Returns `port` to the pool; false (and counted) if it was not in use or not ours.
    pub fn release(&mut self, port: u16) -> bool {
        if !self.owns(port) {
            self.foreign_release += 1;
            return false;
        }
        if !self.is_used(port) {
            self.bad_release += 1;
            return false;
        }
        self.set_used(port, false);
        true
    }

    pub fn capacity(&self) -> usize {
        self.class_cap.iter().map(|&c| c as usize).sum()
    }

    pub fn in_use(&self) -> usize {
        self.used
    }

    /// Ports in use in class `class`.
    pub fn class_in_use(&self, class: u16) -> usize {
        self.class_used
            .get(usize::from(class))
            .map_or(0, |&c| c as usize)
    }

    /// Ports in use, ascending.
    pub fn in_use_ports(&self) -> impl Iterator<Item = u16> + '_ {
        self.in_use.iter().enumerate().flat_map(|(w, &bits)| {
            (0..64u32)
                .filter(move |b| bits & (1u64 << b) != 0)
                .map(move |b| (w as u32 * 64 + b) as u16)
        })
    }

    pub fn to_image(&self) -> PoolImage {
        PoolImage {
            blocks: self.blocks.clone(),
            classes: self.classes,
            in_use: self.in_use_ports().collect(),
            exhausted: self.exhausted,
            bad_release: self.bad_release,
            foreign_release: self.foreign_release,
        }
    }

    /// Rebuilds a pool from its image; refuses ports in use outside the blocks.
    pub fn from_image(img: &PoolImage) -> Result<ResiduePool, String> {
        let mut p = ResiduePool::new(&img.blocks, img.classes)?;
        for &port in &img.in_use {
            if !p.reserve(port) {
                return Err(format!(
                    "nat: pool image lists port {port} in use twice or outside its blocks"
                ));
            }
        }
        p.exhausted = img.exhausted;
        p.bad_release = img.bad_release;
        p.foreign_release = img.foreign_release;
        Ok(p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

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

    #[test]
    fn residue_pool_allocates_only_its_class_and_every_port_once() {
        // Overlapping and adjacent blocks are merged; 3 classes over 99 ports.
        let mut p = ResiduePool::new(&[(150, 198), (100, 149), (120, 130)], 3).unwrap();
        assert_eq!(p.blocks(), &[(100, 198)]);
        assert_eq!(p.capacity(), 99);
        let mut seen = HashSet::new();
        let mut start = 12345u64;
        for class in 0..3u16 {
            for _ in 0..33 {
                start = start.wrapping_mul(6364136223846793005).wrapping_add(1);
                let port = p.alloc_in_class(class, start).expect("a free port");
                assert_eq!(port % 3, class);
                assert!((100..=198).contains(&port));
                assert!(seen.insert(port), "port {port} handed out twice");
            }
            assert_eq!(p.alloc_in_class(class, start), None);
            assert_eq!(p.class_in_use(class), 33);
        }
        assert_eq!(p.exhausted, 3);
        assert_eq!(p.alloc_in_class(7, 0), None, "no such class");
        assert!(p.release(150));
        assert!(!p.release(150));
        assert!(!p.release(99));
        assert_eq!((p.bad_release, p.foreign_release), (1, 1));
        assert_eq!(
            p.alloc_in_class(0, 999),
            Some(150),
            "the only free port of class 0"
        );
    }

    #[test]
    fn residue_pool_start_picks_the_port_and_image_round_trips() {
        let mut p = ResiduePool::new(&[(10, 13), (20, 23)], 2).unwrap();
        // Class 0 holds 10, 12, 20, 22: start 2 is the third of them.
        assert_eq!(p.alloc_in_class(0, 2), Some(20));
        // Same start again: 20 is taken, so the scan moves on to 22.
        assert_eq!(p.alloc_in_class(0, 2), Some(22));
        // Start 3 (22, taken) wraps around to 10.
        assert_eq!(p.alloc_in_class(0, 3), Some(10));
        assert!(p.reserve(11));
        let img = p.to_image();
        assert_eq!(img.in_use, vec![10, 11, 20, 22]);
        let mut q = ResiduePool::from_image(&img).unwrap();
        assert_eq!(q, p);
        // Identical state: identical choices.
        assert_eq!(q.alloc_in_class(1, 5), p.alloc_in_class(1, 5));
        let mut bad = img.clone();
        bad.in_use.push(99);
        assert!(ResiduePool::from_image(&bad).is_err());
        assert!(ResiduePool::new(&[(1, 2)], 0).is_err());
    }
}
