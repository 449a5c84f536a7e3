//! Per-protocol pool of external ports (or ICMP echo identifiers).
//!
//! A port may back several mappings at once, as long as their remote endpoints differ (the
//! NAT checks that: the reverse lookup is keyed by the whole outside tuple), so the pool
//! keeps a reference count per port and a port returns to the free list only when its last
//! mapping ends.
//!
//! FIFO free list: allocation and release are O(1), and a port whose last mapping ended goes
//! to the back of the queue so it is reused as late as possible (a remote host may still hold
//! TIME_WAIT state for the old mapping). A port taken out of turn (preserved, imported) stays
//! queued where it was and is skipped while in use; `queued` keeps it in the list at most once.

use std::collections::VecDeque;

#[derive(Debug)]
pub struct PortPool {
    /// The blocks this replica allocates from (inclusive ranges), sorted.
    blocks: Vec<(u16, u16)>,
    /// Every owned port once, in block order: what the sharing scan walks.
    ports: Vec<u16>,
    /// Position of the sharing scan in `ports` (rotates, so repeated scans spread).
    cursor: usize,
    free: VecDeque<u16>,
    /// Indexed by port: sits in `free`.
    queued: Vec<bool>,
    /// Indexed by port: live mappings of this replica on it.
    refs: Vec<u32>,
    /// Indexed by port: mappings on it that live on another replica (migrated away, noticed by
    /// [`PortPool::resync`]). Their remote endpoints are unknown here, so a lent port takes no
    /// new mapping at all (it might collide with a lent tuple) and stays in use while any is
    /// out.
    lent: Vec<u32>,
    /// Ports with `refs + lent > 0`.
    used: usize,
    /// Sum of `refs`: local mappings holding a port of this pool.
    mappings: usize,
    /// New mappings refused for want of a port (counted by the caller: an empty free list is
    /// not exhaustion while a port can still be shared).
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
            ports: Vec::new(),
            cursor: 0,
            free: VecDeque::new(),
            queued: vec![false; 1 << 16],
            refs: vec![0; 1 << 16],
            lent: vec![0; 1 << 16],
            used: 0,
            mappings: 0,
            exhausted: 0,
            bad_release: 0,
            foreign_release: 0,
        };
        for &(lo, hi) in &blocks {
            for p in lo..=hi {
                if !pool.queued[usize::from(p)] {
                    pool.queued[usize::from(p)] = true;
                    pool.free.push_back(p);
                    pool.ports.push(p);
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

    /// A port no mapping holds (taken with one reference), or None if every port is in use.
    pub fn alloc(&mut self) -> Option<u16> {
        while let Some(p) = self.free.pop_front() {
            let i = usize::from(p);
            self.queued[i] = false;
            // A port taken out of turn while it sat in the free list is skipped.
            if self.refs[i] == 0 && self.lent[i] == 0 {
                self.take(p);
                return Some(p);
            }
        }
        None
    }

    /// Whether `port` is ours and held by nothing.
    pub fn is_free(&self, port: u16) -> bool {
        self.owns(port) && self.refs[usize::from(port)] == 0 && self.lent[usize::from(port)] == 0
    }

    /// Whether `port` is ours and may take one more mapping (free, or held only by local
    /// mappings whose remote endpoints the caller has checked).
    pub fn shareable(&self, port: u16) -> bool {
        self.owns(port) && self.lent[usize::from(port)] == 0
    }

    /// Adds a mapping to a [`PortPool::shareable`] `port`; false (nothing changed) otherwise.
    pub fn acquire(&mut self, port: u16) -> bool {
        if !self.shareable(port) {
            return false;
        }
        self.take(port);
        true
    }

    fn take(&mut self, port: u16) {
        let i = usize::from(port);
        if self.refs[i] == 0 && self.lent[i] == 0 {
            self.used += 1;
        }
        self.refs[i] += 1;
        self.mappings += 1;
    }

    /// An imported mapping holds owned `port` (lent ports included: a mapping coming back
    /// takes the place of one that was lent). False if the port is not ours or was in use
    /// already.
    pub fn reserve(&mut self, port: u16) -> bool {
        if !self.owns(port) {
            return false;
        }
        let i = usize::from(port);
        let was_free = self.refs[i] == 0 && self.lent[i] == 0;
        if self.lent[i] > 0 {
            self.lent[i] -= 1;
            self.refs[i] += 1;
            self.mappings += 1;
        } else {
            self.take(port);
        }
        was_free
    }

    /// A mapping on `port` ended here; the port returns to the pool with its last mapping.
    /// False (and counted) if it was not held here.
    pub fn release(&mut self, port: u16) -> bool {
        if !self.owns(port) {
            self.foreign_release += 1;
            return false;
        }
        let i = usize::from(port);
        if self.refs[i] == 0 {
            self.bad_release += 1;
            return false;
        }
        self.refs[i] -= 1;
        self.mappings -= 1;
        if self.refs[i] == 0 && self.lent[i] == 0 {
            self.used -= 1;
            self.enqueue(port);
        }
        true
    }

    fn enqueue(&mut self, port: u16) {
        let i = usize::from(port);
        if !self.queued[i] {
            self.queued[i] = true;
            self.free.push_back(port);
        }
    }

    /// Sets the local reference counts to `live` (indexed by port: mappings in the flow table
    /// now), after mappings left or arrived without the NAT seeing it (migration export):
    /// references beyond `live` belong to mappings now living elsewhere and become lent;
    /// mappings beyond the references (imported unseen) take lent ones back first.
    pub fn resync(&mut self, live: &[u32]) {
        self.used = 0;
        self.mappings = 0;
        for k in 0..self.ports.len() {
            let port = self.ports[k];
            let i = usize::from(port);
            let (refs, now) = (self.refs[i], live[i]);
            if refs > now {
                self.lent[i] += refs - now;
            } else {
                self.lent[i] -= (now - refs).min(self.lent[i]);
            }
            self.refs[i] = now;
            self.mappings += now as usize;
            if now > 0 || self.lent[i] > 0 {
                self.used += 1;
            } else {
                self.enqueue(port);
            }
        }
    }

    /// Adds `n` lent mappings to owned `port` (carried over to new blocks); ignored if not ours.
    pub fn lend(&mut self, port: u16, n: u32) {
        let i = usize::from(port);
        if n == 0 || !self.owns(port) {
            return;
        }
        if self.refs[i] == 0 && self.lent[i] == 0 {
            self.used += 1;
        }
        self.lent[i] += n;
    }

    /// The next port of the sharing scan if it is held by local mappings only (a candidate to
    /// share, once the caller has checked the tuple), else None; one step per call.
    pub fn scan_next(&mut self) -> Option<u16> {
        if self.ports.is_empty() {
            return None;
        }
        self.cursor = (self.cursor + 1) % self.ports.len();
        let port = self.ports[self.cursor];
        let i = usize::from(port);
        (self.refs[i] > 0 && self.lent[i] == 0).then_some(port)
    }

    /// Local mappings on `port`.
    pub fn refs(&self, port: u16) -> u32 {
        self.refs[usize::from(port)]
    }

    /// Mappings on `port` living on another replica.
    pub fn lent(&self, port: u16) -> u32 {
        self.lent[usize::from(port)]
    }

    /// Owned ports in use (by local or lent mappings), ascending.
    pub fn in_use_ports(&self) -> impl Iterator<Item = u16> + '_ {
        (0..=u16::MAX).filter(|&p| self.refs[usize::from(p)] > 0 || self.lent[usize::from(p)] > 0)
    }

    pub fn capacity(&self) -> usize {
        self.ports.len()
    }

    /// Ports in use (by one mapping or several, or lent).
    pub fn in_use(&self) -> usize {
        self.used
    }

    /// Local mappings holding ports of this pool (>= ports in use when ports are shared).
    pub fn mappings(&self) -> usize {
        self.mappings
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
    /// Whether class `class` has no free port (true for a class that does not exist), without
    /// counting an exhaustion as a failed `alloc_in_class` does.
    pub fn class_full(&self, class: u16) -> bool {
        let ci = usize::from(class);
        match (self.class_cap.get(ci), self.class_used.get(ci)) {
            (Some(&cap), Some(&used)) => used >= cap,
            _ => true,
        }
    }

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
        assert_eq!((p.in_use(), p.mappings()), (3, 4));
        assert!(!p.release(7));
        assert_eq!((p.foreign_release, p.bad_release), (1, 0));
        assert!(p.release(2000));
        assert_eq!(p.alloc(), None, "2000 still holds the second reservation");
        assert!(p.release(2000));
        assert_eq!(p.alloc(), Some(2000));
        assert_eq!(p.in_use_ports().count(), 3);
    }

    #[test]
    fn a_shared_port_returns_with_its_last_mapping_only() {
        let mut p = PortPool::new(10, 11);
        let a = p.alloc().unwrap();
        assert!(p.acquire(a) && p.acquire(a));
        assert_eq!((p.refs(a), p.in_use(), p.mappings()), (3, 1, 3));
        assert!(p.release(a) && p.release(a));
        assert_eq!(p.alloc(), Some(11), "a still has a mapping");
        assert_eq!(p.alloc(), None);
        assert!(p.release(a));
        assert_eq!(p.alloc(), Some(a));
        assert!(!p.acquire(500), "not ours");
        // A preserved port (taken out of turn) and released is queued once, not twice.
        let mut q = PortPool::new(20, 21);
        assert!(q.acquire(21) && q.release(21) && q.acquire(21) && q.release(21));
        let got: Vec<u16> = std::iter::from_fn(|| q.alloc()).collect();
        assert_eq!(got, vec![20, 21]);
    }

    #[test]
    fn resync_lends_references_that_left_and_lent_ports_take_nothing_new() {
        let mut p = PortPool::new(10, 12);
        let (a, b) = (p.alloc().unwrap(), p.alloc().unwrap());
        assert!(p.acquire(a));
        // One mapping on `a` and the one on `b` migrated away unseen.
        let mut live = vec![0u32; 1 << 16];
        live[usize::from(a)] = 1;
        p.resync(&live);
        assert_eq!((p.refs(a), p.lent(a), p.refs(b), p.lent(b)), (1, 1, 0, 1));
        assert!(!p.shareable(a) && !p.acquire(b), "lent ports are exclusive");
        assert_eq!(p.in_use(), 2);
        assert!(p.release(a));
        assert_eq!(p.alloc(), Some(12));
        assert_eq!(p.alloc(), None, "a and b stay lent");
        // The mapping on b comes back and ends here: b is free again.
        assert!(!p.reserve(b), "b was in use (lent)");
        assert_eq!((p.refs(b), p.lent(b)), (1, 0));
        assert!(p.release(b));
        assert_eq!(p.alloc(), Some(b));
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
