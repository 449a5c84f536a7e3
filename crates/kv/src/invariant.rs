//! The safety rule of every move: no partition ever has fewer than `k + 1` live copies.

/// Checks a count of live copies per partition (index = partition). Returns the partitions below
/// `k + 1` as `(partition, copies)`.
pub fn below_k_plus_one(copies: &[usize], k: usize) -> Vec<(usize, usize)> {
    copies
        .iter()
        .enumerate()
        .filter(|&(_, &c)| c < k + 1)
        .map(|(p, &c)| (p, c))
        .collect()
}

/// Whether one copy of `partition`, which has `live` caught-up copies now, may be dropped: only
/// when `k + 1` remain after the drop. The move executor calls this immediately before it removes
/// a copy and refuses the drop otherwise.
pub fn may_drop(partition: usize, live: usize, k: usize) -> Result<(), String> {
    if live > k + 1 {
        Ok(())
    } else {
        Err(format!(
            "refusing to drop a copy of partition {partition}: it has {live} live copies and \
             k = {k} needs {} after the drop",
            k + 1
        ))
    }
}

/// `k + 1` copies on distinct hosts need `k + 1` hosts; the error names both numbers.
/// `what` names where the host count came from (`--hosts`, `--to`).
pub fn k_fits(k: usize, hosts: usize, what: &str) -> Result<(), String> {
    if k + 1 > hosts {
        return Err(format!(
            "k = {k} needs {} hosts (k + 1 copies on distinct hosts), but {what} is {hosts}",
            k + 1
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_below_k_plus_one_are_reported() {
        assert!(below_k_plus_one(&[2, 3, 2], 1).is_empty());
        assert_eq!(below_k_plus_one(&[2, 1, 0, 3], 1), vec![(1, 1), (2, 0)]);
        assert_eq!(below_k_plus_one(&[1], 0), vec![]);
        assert_eq!(below_k_plus_one(&[2, 2], 2), vec![(0, 2), (1, 2)]);
    }

    #[test]
    fn a_drop_needs_k_plus_two_live_copies() {
        assert!(may_drop(3, 3, 1).is_ok());
        let e = may_drop(3, 2, 1).unwrap_err();
        assert!(e.contains("partition 3") && e.contains("2 live"), "{e}");
        assert!(may_drop(0, 1, 0).is_err());
        assert!(may_drop(0, 2, 0).is_ok());
    }
}
