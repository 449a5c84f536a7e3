//! Internet checksums: RFC 1071 one's-complement sums and RFC 1624 incremental updates.
//!
//! Conventions used throughout:
//! - A *sum* is an unfolded `u32` accumulator of big-endian 16-bit words ([`sum`], [`addr_sum`], [`pseudo_header_sum`]).
//!   [`fold`] reduces it to 16 bits with end-around carry.
//! - A *checksum field* (what sits in an IPv4/TCP/UDP/ICMP header of a finished packet) is the
//!   complement of the folded sum, so a receiver summing the covered bytes *including* the field
//!   gets `0xffff` ([`l4_verifies`] checks exactly that).
//! - The `update*` helpers apply RFC 1624 eqn. 3, `HC' = ~(~HC + ~m + m')`, which is exact: when
//!   `HC` came from a full computation the result is bit-identical to recomputing from scratch
//!   (both never produce `0xffff`, because a one's-complement sum of non-zero data is never `+0`).
//! - The `update*_partial` helpers are for a field that holds a *non-complemented* pseudo-header
//!   sum, which is what a CHECKSUM_PARTIAL (checksum offload) frame carries until the NIC finishes
//!   it: there the update is `P' = P + ~m + m'` with no complement around it. Applying eqn. 3 to such
//!   a field would move it in the wrong direction, which is why the two are kept apart.

use std::net::IpAddr;

/// Adds the bytes of `data` as big-endian 16-bit words to `acc` (an odd last byte is padded with
/// a zero byte, as RFC 1071 says). Never overflows for inputs up to 64 KiB per call when `acc`
/// starts folded-ish; callers summing more use [`fold`] in between.
pub fn sum(data: &[u8], mut acc: u32) -> u32 {
    let mut chunks = data.chunks_exact(2);
    for c in &mut chunks {
        acc = acc.wrapping_add(u32::from(u16::from_be_bytes([c[0], c[1]])));
        // Keep headroom: fold the carry back in once the top bit is set, so very long inputs
        // cannot overflow the u32 accumulator.
        if acc & 0x8000_0000 != 0 {
            acc = (acc & 0xffff) + (acc >> 16);
        }
    }
    if let [last] = chunks.remainder() {
        acc = acc.wrapping_add(u32::from(*last) << 8);
    }
    acc
}

/// Folds a 32-bit accumulator to 16 bits with end-around carry (not complemented).
#[inline]
pub fn fold(mut acc: u32) -> u16 {
    acc = (acc & 0xffff) + (acc >> 16);
    acc = (acc & 0xffff) + (acc >> 16);
    acc as u16
}

/// The checksum field value for data whose accumulated sum is `acc`.
#[inline]
pub fn finish(acc: u32) -> u16 {
    !fold(acc)
}

/// RFC 1071 checksum of `data` (the value to store in a zeroed checksum field).
pub fn checksum(data: &[u8]) -> u16 {
    finish(sum(data, 0))
}

/// Sum of an IP address's bytes as 16-bit words.
#[inline]
/// Writes the header checksum of the IPv4 header `h` (exactly its IHL bytes) into `h[10..12]`.
pub fn set_ipv4_header_checksum(h: &mut [u8]) {
    h[10..12].fill(0);
    let c = checksum(h);
    h[10..12].copy_from_slice(&c.to_be_bytes());
}

pub fn addr_sum(a: IpAddr) -> u32 {
    match a {
        IpAddr::V4(v4) => sum(&v4.octets(), 0),
        IpAddr::V6(v6) => sum(&v6.octets(), 0),
    }
}

/// Sum of the TCP/UDP/ICMPv6 pseudo header (RFC 793 / RFC 768 for IPv4, RFC 8200 §8.1 for IPv6).
/// `l4_len` is the length of the L4 header plus payload.
pub fn pseudo_header_sum(src: IpAddr, dst: IpAddr, proto: u8, l4_len: u32) -> u32 {
    // IPv4 uses a 16-bit length and IPv6 a 32-bit one; as 16-bit words both come to the same
    // thing for lengths below 64 KiB, and summing both halves is correct for larger ones.
    addr_sum(src) + addr_sum(dst) + u32::from(proto) + (l4_len >> 16) + (l4_len & 0xffff)
}

/// Full L4 checksum (TCP, UDP, ICMPv6) over `l4` (header with a zeroed or in-place checksum
/// field, plus payload) with the pseudo header. The caller zeroes the checksum field first when
/// computing, or leaves it in place and compares with 0 when verifying (see [`l4_verifies`]).
/// For UDP the caller maps a result of 0 to 0xffff (RFC 768); [`udp_field`] does that.
pub fn l4_checksum(src: IpAddr, dst: IpAddr, proto: u8, l4: &[u8]) -> u16 {
    let len = u32::try_from(l4.len()).unwrap_or(u32::MAX);
    let acc = pseudo_header_sum(src, dst, proto, len);
    finish(sum(l4, fold(acc).into()))
}

/// True when the L4 segment (checksum field in place) verifies against the pseudo header.
pub fn l4_verifies(src: IpAddr, dst: IpAddr, proto: u8, l4: &[u8]) -> bool {
    l4_checksum(src, dst, proto, l4) == 0
}

/// A computed UDP checksum as it goes on the wire: 0 means "no checksum", so a computed 0 is
/// sent as 0xffff (the same value in one's-complement arithmetic).
#[inline]
pub fn udp_field(computed: u16) -> u16 {
    if computed == 0 {
        0xffff
    } else {
        computed
    }
}

/// RFC 1624 eqn. 3 for one 16-bit word changing from `old` to `new`.
#[inline]
pub fn update16(field: u16, old: u16, new: u16) -> u16 {
    let acc = u32::from(!field) + u32::from(!old) + u32::from(new);
    !fold(acc)
}

/// RFC 1624 eqn. 3 for a 32-bit value (e.g. an IPv4 address) changing.
#[inline]
pub fn update32(field: u16, old: u32, new: u32) -> u16 {
    let acc = u32::from(!field)
        + u32::from(!(old >> 16) as u16)
        + u32::from(!(old as u16))
        + (new >> 16)
        + (new & 0xffff);
    !fold(acc)
}

/// RFC 1624 eqn. 3 for a 128-bit value (an IPv6 address) changing.
#[inline]
pub fn update128(field: u16, old: &[u8; 16], new: &[u8; 16]) -> u16 {
    let mut acc = u32::from(!field);
    for i in 0..8 {
        let o = u16::from_be_bytes([old[2 * i], old[2 * i + 1]]);
        let n = u16::from_be_bytes([new[2 * i], new[2 * i + 1]]);
        acc += u32::from(!o) + u32::from(n);
    }
    !fold(acc)
}

/// Incremental update for an address change of either family (same family required; a
/// mismatch leaves the field unchanged and is the caller's bug to refuse earlier).
#[inline]
pub fn update_addr(field: u16, old: IpAddr, new: IpAddr) -> u16 {
    match (old, new) {
        (IpAddr::V4(o), IpAddr::V4(n)) => update32(field, u32::from(o), u32::from(n)),
        (IpAddr::V6(o), IpAddr::V6(n)) => update128(field, &o.octets(), &n.octets()),
        _ => field,
    }
}

/// Update of a *non-complemented* partial (pseudo-header-only) checksum field, as carried by a
/// CHECKSUM_PARTIAL frame, for a 16-bit word change: `P' = P - old + new`.
#[inline]
pub fn update16_partial(field: u16, old: u16, new: u16) -> u16 {
    fold(u32::from(field) + u32::from(!old) + u32::from(new))
}

/// Partial-checksum update for an address change (see [`update16_partial`]).
pub fn update_addr_partial(field: u16, old: IpAddr, new: IpAddr) -> u16 {
    // Negating eqn. 3 on both sides turns it into the non-complemented form: update the
    // complement of the field and complement back.
    !update_addr(!field, old, new)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::Rng;
    use std::net::{Ipv4Addr, Ipv6Addr};

    #[test]
    fn rfc1071_example() {
        // RFC 1071 §3 example: words 0001 f203 f4f5 f6f7 sum to 0xddf2 (folded).
        let data = [0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7];
        assert_eq!(fold(sum(&data, 0)), 0xddf2);
        assert_eq!(checksum(&data), !0xddf2);
    }

    #[test]
    fn odd_length_pads_with_zero() {
        assert_eq!(fold(sum(&[0x12, 0x34, 0x56], 0)), 0x1234 + 0x5600);
    }

    #[test]
    fn known_ipv4_header_checksum() {
        // A classic example header (Wikipedia "IPv4 header checksum"): checksum 0xb861.
        let mut h = [
            0x45, 0x00, 0x00, 0x73, 0x00, 0x00, 0x40, 0x00, 0x40, 0x11, 0x00, 0x00, 0xc0, 0xa8,
            0x00, 0x01, 0xc0, 0xa8, 0x00, 0xc7,
        ];
        assert_eq!(checksum(&h), 0xb861);
        h[10..12].copy_from_slice(&0xb861u16.to_be_bytes());
        assert_eq!(checksum(&h), 0);
    }

    #[test]
    fn long_input_does_not_overflow() {
        let data = vec![0xffu8; 200_000];
        // 100_000 words of 0xffff: one's-complement sum is 0xffff.
        assert_eq!(fold(sum(&data, 0)), 0xffff);
    }

    /// Every incremental helper must equal a full recomputation over random data.
    #[test]
    fn incremental_updates_match_recomputation() {
        let mut rng = Rng::new(0x5eed);
        for _ in 0..20_000 {
            let mut data = [0u8; 40];
            rng.fill(&mut data);
            // Bias some words towards the edge values that break naive implementations.
            if rng.below(4) == 0 {
                data[0..4].copy_from_slice(&[0, 0, 0xff, 0xff]);
            }
            let field = checksum(&data);

            // 16-bit change at word 3.
            let mut d16 = data;
            let new16 = rng.next() as u16;
            let old16 = u16::from_be_bytes([d16[6], d16[7]]);
            d16[6..8].copy_from_slice(&new16.to_be_bytes());
            assert_eq!(update16(field, old16, new16), checksum(&d16));

            // 32-bit change at bytes 8..12.
            let mut d32 = data;
            let new32 = rng.next();
            let old32 = u32::from_be_bytes([d32[8], d32[9], d32[10], d32[11]]);
            d32[8..12].copy_from_slice(&new32.to_be_bytes());
            assert_eq!(update32(field, old32, new32), checksum(&d32));

            // 128-bit change at bytes 16..32.
            let mut d128 = data;
            let mut new128 = [0u8; 16];
            rng.fill(&mut new128);
            let mut old128 = [0u8; 16];
            old128.copy_from_slice(&d128[16..32]);
            d128[16..32].copy_from_slice(&new128);
            assert_eq!(update128(field, &old128, &new128), checksum(&d128));
        }
    }

    #[test]
    fn partial_update_tracks_pseudo_header_sum() {
        let mut rng = Rng::new(7);
        for _ in 0..5_000 {
            let src = Ipv4Addr::from(rng.next());
            let dst = Ipv4Addr::from(rng.next());
            let new = Ipv4Addr::from(rng.next());
            let p = fold(pseudo_header_sum(src.into(), dst.into(), 6, 100));
            let want = fold(pseudo_header_sum(new.into(), dst.into(), 6, 100));
            let got = update_addr_partial(p, src.into(), new.into());
            // Partial sums may legitimately differ in the representation of zero only.
            assert!(
                got == want || (got % 0xffff == want % 0xffff),
                "{got:#x} {want:#x}"
            );
            let mut a = [0u8; 16];
            let mut b = [0u8; 16];
            rng.fill(&mut a);
            rng.fill(&mut b);
            let (a, b) = (Ipv6Addr::from(a), Ipv6Addr::from(b));
            let p6 = fold(pseudo_header_sum(a.into(), dst.into(), 17, 8));
            let w6 = fold(pseudo_header_sum(b.into(), dst.into(), 17, 8));
            let g6 = update_addr_partial(p6, a.into(), b.into());
            assert!(g6 % 0xffff == w6 % 0xffff);
            let port_p = update16_partial(p, 1000, 2000);
            assert_eq!(port_p % 0xffff, fold(u32::from(p) + 1000) % 0xffff);
        }
    }

    #[test]
    fn udp_zero_is_sent_as_ffff() {
        assert_eq!(udp_field(0), 0xffff);
        assert_eq!(udp_field(0x1234), 0x1234);
    }
}
