//! NAT port blocks: replicas share one external address, so each allocates new mappings only
//! from its own disjoint blocks, and the fabric steers return traffic by destination port
//! (`port_owner`) to the block's owner. Flows that moved keep their port; their aliases get
//! steering exceptions, which take precedence over `port_owner`.
//!
//! Blocks are assigned lowest-free-first and never move while their owner lives, so a live
//! mapping's port always stays with the replica that allocated it.
//!
//! FTMB replicas cannot take blocks at run time: their pool is a shared variable
//! captured in every snapshot and replayed by index, so it is fixed by the replica's config
//! (`[nat] port_blocks`). For them blocks are *pinned* by replica index
//! ([`PortBlocks::pinned_first`]): replica n owns blocks `(n-1)*per .. n*per`, the rule the lab
//! writes into each FTMB replica's config.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::ops::RangeInclusive;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PortError {
    #[error("port range {lo}-{hi} with blocks of {block} ports is empty")]
    Empty { lo: u16, hi: u16, block: u16 },
    #[error("no free NAT port block for replica r{0} (all {1} blocks assigned)")]
    Exhausted(u32, usize),
    #[error("NAT port block {block} pinned to replica r{replica} is {why}")]
    Pinned {
        replica: u32,
        block: u32,
        why: String,
    },
}

/// The pool and who owns which block (persisted in the store).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PortBlocks {
    pub lo: u16,
    pub hi: u16,
    pub block: u16,
    /// Block number -> replica index.
    pub owner: BTreeMap<u32, u32>,
}

impl PortBlocks {
    pub fn new(lo: u16, hi: u16, block: u16) -> Result<PortBlocks, PortError> {
        let pb = PortBlocks {
            lo,
            hi,
            block,
            owner: BTreeMap::new(),
        };
        if block == 0 || lo > hi || pb.count() == 0 {
            return Err(PortError::Empty { lo, hi, block });
        }
        Ok(pb)
    }

    /// Whole blocks in the range (a partial tail block is left unused).
    pub fn count(&self) -> usize {
        if self.block == 0 || self.lo > self.hi {
            return 0;
        }
        ((u32::from(self.hi) - u32::from(self.lo) + 1) / u32::from(self.block)) as usize
    }

    pub fn range(&self, b: u32) -> RangeInclusive<u16> {
        let start = u32::from(self.lo) + b * u32::from(self.block);
        let end = start + u32::from(self.block) - 1;
        // b < count() keeps both inside lo..=hi, hence inside u16.
        (start as u16)..=(end as u16)
    }

    /// Assigns `n` free blocks to `replica`, returning their ranges.
    pub fn assign(
        &mut self,
        replica: u32,
        n: usize,
    ) -> Result<Vec<RangeInclusive<u16>>, PortError> {
        let free: Vec<u32> = (0..self.count() as u32)
            .filter(|b| !self.owner.contains_key(b))
            .take(n)
            .collect();
        if free.len() < n {
            return Err(PortError::Exhausted(replica, self.count()));
        }
        for &b in &free {
            self.owner.insert(b, replica);
        }
        Ok(free.into_iter().map(|b| self.range(b)).collect())
    }

    /// The first block pinned to replica `index` when every replica owns `per` blocks.
    pub fn pinned_first(index: u32, per: usize) -> u32 {
        index.saturating_sub(1).saturating_mul(per as u32)
    }

    /// Assigns `replica` exactly the blocks `first..first + n` (see the module doc): all or
    /// none; a block past the pool or owned by another replica is an error.
    pub fn assign_at(
        &mut self,
        replica: u32,
        first: u32,
        n: usize,
    ) -> Result<Vec<RangeInclusive<u16>>, PortError> {
        let want: Vec<u32> = (0..n as u32).map(|k| first.saturating_add(k)).collect();
        for &b in &want {
            if b as usize >= self.count() {
                return Err(PortError::Pinned {
                    replica,
                    block: b,
                    why: format!("past the pool ({} blocks)", self.count()),
                });
            }
            if let Some(&o) = self.owner.get(&b).filter(|&&o| o != replica) {
                return Err(PortError::Pinned {
                    replica,
                    block: b,
                    why: format!("owned by r{o}"),
                });
            }
        }
        for &b in &want {
            self.owner.insert(b, replica);
        }
        Ok(want.into_iter().map(|b| self.range(b)).collect())
    }

    /// Releases `replica`'s blocks, returning their ranges.
    pub fn release(&mut self, replica: u32) -> Vec<RangeInclusive<u16>> {
        let mine: Vec<u32> = self
            .owner
            .iter()
            .filter(|(_, &r)| r == replica)
            .map(|(&b, _)| b)
            .collect();
        for b in &mine {
            self.owner.remove(b);
        }
        mine.into_iter().map(|b| self.range(b)).collect()
    }

    pub fn of(&self, replica: u32) -> Vec<RangeInclusive<u16>> {
        self.owner
            .iter()
            .filter(|(_, &r)| r == replica)
            .map(|(&b, _)| self.range(b))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_disjoint_and_reused_after_release() {
        let mut pb = PortBlocks::new(20000, 59999, 4000).unwrap();
        assert_eq!(pb.count(), 10);
        assert_eq!(pb.assign(1, 1).unwrap(), vec![20000..=23999]);
        assert_eq!(pb.assign(2, 2).unwrap(), vec![24000..=27999, 28000..=31999]);
        assert_eq!(pb.of(2).len(), 2);
        assert_eq!(pb.release(1), vec![20000..=23999]);
        // Lowest free first: r3 gets r1's old block.
        assert_eq!(pb.assign(3, 1).unwrap(), vec![20000..=23999]);
        assert_eq!(pb.range(9), 56000..=59999);
    }

    #[test]
    fn pinned_blocks_follow_the_index_and_refuse_conflicts() {
        let mut pb = PortBlocks::new(20000, 59999, 1000).unwrap();
        assert_eq!(PortBlocks::pinned_first(3, 1), 2);
        assert_eq!(PortBlocks::pinned_first(2, 2), 2);
        assert_eq!(pb.assign_at(3, 2, 1).unwrap(), vec![22000..=22999]);
        // Idempotent for the owner; refused for anyone else.
        assert_eq!(pb.assign_at(3, 2, 1).unwrap(), vec![22000..=22999]);
        assert!(matches!(
            pb.assign_at(4, 2, 1),
            Err(PortError::Pinned { block: 2, .. })
        ));
        assert!(matches!(
            pb.assign_at(41, 40, 1),
            Err(PortError::Pinned { block: 40, .. })
        ));
        // All or none: block 3 free, block 2 taken -> nothing assigned.
        assert!(pb.assign_at(5, 1, 2).is_err());
        assert!(pb.of(5).is_empty());
        // Lowest-free assignment skips pinned blocks.
        assert_eq!(pb.assign(9, 1).unwrap(), vec![20000..=20999]);
    }

    #[test]
    fn exhaustion_and_bad_ranges_are_errors() {
        let mut pb = PortBlocks::new(100, 199, 50).unwrap();
        pb.assign(1, 2).unwrap();
        assert_eq!(pb.assign(2, 1), Err(PortError::Exhausted(2, 2)));
        assert!(PortBlocks::new(100, 120, 50).is_err());
        assert!(PortBlocks::new(200, 100, 1).is_err());
        assert!(PortBlocks::new(1, 100, 0).is_err());
        // Range tail at u16::MAX does not overflow.
        let pb = PortBlocks::new(65000, 65535, 268).unwrap();
        assert_eq!(pb.range(1), 65268..=65535);
    }
}
