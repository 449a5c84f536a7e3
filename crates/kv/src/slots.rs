//! Redis Cluster's 16384 hash slots, split into fixed contiguous ranges, one per partition, and
//! the key → slot hash (so that a client or a test can aim a key at a partition).

/// Number of hash slots of a Redis Cluster.
pub const SLOTS: u16 = 16384;

/// Inclusive slot range `(first, last)` of partition `p` of `partitions`: ranges are contiguous,
/// cover every slot once, and differ in size by at most one slot (the first `16384 % P`
/// partitions hold one more), so that partitions stay fixed while their hosts change.
pub fn range(p: usize, partitions: usize) -> (u16, u16) {
    assert!(
        partitions > 0 && partitions <= SLOTS as usize && p < partitions,
        "partition {p} of {partitions}"
    );
    let base = SLOTS as usize / partitions;
    let extra = SLOTS as usize % partitions;
    let first = p * base + p.min(extra);
    let len = base + usize::from(p < extra);
    (first as u16, (first + len - 1) as u16)
}

/// The partition owning `slot`.
pub fn partition_of(slot: u16, partitions: usize) -> usize {
    (0..partitions)
        .find(|&p| {
            let (a, b) = range(p, partitions);
            (a..=b).contains(&slot)
        })
        .expect("every slot has a partition")
}

/// CRC16-XMODEM, the hash Redis Cluster maps keys with.
fn crc16(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in data {
        crc ^= (b as u16) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// The slot of `key`, honouring a `{hash tag}` as Redis does (the first `{...}` with a non-empty
/// body is hashed instead of the whole key).
pub fn key_slot(key: &[u8]) -> u16 {
    let hashed = key
        .iter()
        .position(|&c| c == b'{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            let close = rest.iter().position(|&c| c == b'}')?;
            (close > 0).then(|| &rest[..close])
        })
        .unwrap_or(key);
    crc16(hashed) % SLOTS
}

/// A hash tag (`t<n>`, the smallest such `n`) whose keys land in partition `p`: a writer spreads
/// keys over every partition by cycling through these tags.
pub fn tag_for(p: usize, partitions: usize) -> String {
    (0u32..)
        .map(|n| format!("t{n}"))
        .find(|t| partition_of(key_slot(t.as_bytes()), partitions) == p)
        .expect("some tag hashes into every partition")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_cover_every_slot_once_and_contiguously() {
        for parts in [1, 3, 8, 12, 16, 7, 16384] {
            let mut next = 0u32;
            for p in 0..parts {
                let (a, b) = range(p, parts);
                assert_eq!(
                    a as u32, next,
                    "{parts} partitions: partition {p} starts at {a}"
                );
                assert!(b >= a);
                let len = (b - a) as usize + 1;
                assert!(len == 16384 / parts || len == 16384 / parts + 1);
                next = b as u32 + 1;
            }
            assert_eq!(next, 16384);
        }
        assert_eq!(range(0, 3), (0, 5461));
        assert_eq!(range(2, 3), (10923, 16383));
    }

    #[test]
    fn key_slots_match_redis() {
        // Values from CLUSTER KEYSLOT on redis-server 7.
        assert_eq!(key_slot(b"foo"), 12182);
        assert_eq!(key_slot(b"bar"), 5061);
        assert_eq!(key_slot(b"{user1000}.following"), key_slot(b"user1000"));
        assert_eq!(key_slot(b"foo{}{bar}"), key_slot(b"foo{}{bar}"));
        assert_ne!(key_slot(b"foo{}{bar}"), key_slot(b"bar"));
        // The CRC16-XMODEM check value of "123456789" is 0x31C3 (below 16384, so it is the slot).
        assert_eq!(key_slot(b"123456789"), 0x31C3);
    }

    #[test]
    fn tags_land_in_their_partition() {
        for p in 0..12 {
            let t = tag_for(p, 12);
            assert_eq!(
                partition_of(key_slot(format!("id:{{{t}}}:9").as_bytes()), 12),
                p
            );
        }
    }
}
