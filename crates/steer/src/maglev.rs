//! Maglev consistent-hash table (Eisenbud et al., NSDI'16): every backend walks its own
//! permutation of the `m` slots and the backends take turns claiming their next free slot.
//! The result is near-perfect balance (slot counts differ by at most ~1 per backend for prime
//! `m`) and small disruption when the backend set changes — and the conn table pins the flows
//! whose slot did move, so a changed table never re-homes a live flow.

use crate::layout::{NO_REPLICA, RING_MAX};

/// Default ring size: prime, ~64 slots per replica even at the 64-replica maximum (balance
/// within ~2%), and small enough that a ring change (one map write per slot, ~2-3 us each)
/// takes ~10 ms. Use up to [`RING_MAX`] for finer balance at ~0.2 s per change.
pub const DEFAULT_RING_SIZE: u32 = 4099;

/// Errors of [`maglev_table`].
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MaglevError {
    #[error("ring size {0} must be a prime in 2..={RING_MAX}")]
    BadSize(u32),
    #[error("replica index {0} is reserved (NO_REPLICA)")]
    BadReplica(u32),
}

fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn is_prime(n: u32) -> bool {
    if n < 2 {
        return false;
    }
    let mut d = 2u32;
    while d.saturating_mul(d) <= n {
        if n.checked_rem(d) == Some(0) {
            return false;
        }
        d += 1;
    }
    true
}

/// Builds a table of `m` slots (a prime `<= RING_MAX`) owned by `replicas` (replica indexes).
/// With no replicas every slot is [`NO_REPLICA`]. The permutation of a replica depends only on
/// its index, so the same live set always yields the same table.
pub fn maglev_table(replicas: &[u32], m: u32) -> Result<Vec<u32>, MaglevError> {
    if !is_prime(m) || m > RING_MAX {
        return Err(MaglevError::BadSize(m));
    }
    if let Some(&r) = replicas.iter().find(|&&r| r == NO_REPLICA) {
        return Err(MaglevError::BadReplica(r));
    }
    let mut owners: Vec<u32> = replicas.to_vec();
    owners.sort_unstable();
    owners.dedup();
    let mut table = vec![NO_REPLICA; m as usize];
    if owners.is_empty() {
        return Ok(table);
    }
    let m64 = u64::from(m);
    let perms: Vec<(u64, u64)> = owners
        .iter()
        .map(|&r| {
            let offset = splitmix64(u64::from(r) ^ 0x5eed_0001) % m64;
            let skip = splitmix64(u64::from(r) ^ 0x5eed_0002) % (m64 - 1) + 1;
            (offset, skip)
        })
        .collect();
    let mut next = vec![0u64; owners.len()];
    let mut filled = 0u32;
    // Each round gives every replica one slot; at most m rounds, each probe bounded by m
    // because a permutation of a prime modulus visits every slot.
    'outer: loop {
        for (i, &r) in owners.iter().enumerate() {
            let (offset, skip) = perms[i];
            let mut c = (offset + next[i] * skip) % m64;
            while table[c as usize] != NO_REPLICA {
                next[i] += 1;
                c = (offset + next[i] * skip) % m64;
            }
            table[c as usize] = r;
            next[i] += 1;
            filled += 1;
            if filled == m {
                break 'outer;
            }
        }
    }
    Ok(table)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balanced_within_one_percent() {
        let t = maglev_table(&[1, 2, 3, 4, 5], 4099).expect("table");
        for r in 1..=5u32 {
            let n = t.iter().filter(|&&x| x == r).count() as i64;
            assert!((n - 4099 / 5).abs() <= 41, "replica {r} has {n}");
        }
        assert!(!t.contains(&NO_REPLICA));
    }

    #[test]
    fn removing_a_replica_moves_mostly_its_own_slots() {
        let a = maglev_table(&[1, 2, 3, 4], 4099).expect("a");
        let b = maglev_table(&[1, 2, 3], 4099).expect("b");
        let moved_other = a.iter().zip(&b).filter(|(x, y)| **x != 4 && x != y).count();
        // Maglev guarantees little, not zero, disruption for survivors.
        assert!(
            moved_other < 4099 / 10,
            "{moved_other} survivor slots moved"
        );
        assert!(!b.contains(&4));
    }

    #[test]
    fn rejects_bad_sizes_and_reserved_index() {
        assert_eq!(maglev_table(&[1], 4096), Err(MaglevError::BadSize(4096)));
        assert_eq!(maglev_table(&[1], 1), Err(MaglevError::BadSize(1)));
        assert_eq!(
            maglev_table(&[NO_REPLICA], 7),
            Err(MaglevError::BadReplica(NO_REPLICA))
        );
        assert_eq!(maglev_table(&[], 7).expect("empty"), vec![NO_REPLICA; 7]);
    }
}
