//! Checksum verification and recomputation on a parsed frame (off the hot path: tests,
//! frame builders, the fuzz target, and a runtime that wants to check suspicious input).

use crate::checksum::{checksum, l4_checksum, udp_field};
use crate::{proto, Parsed};

/// Offset (from the frame start) of the L4 checksum field, if the packet has one pliant
/// maintains: TCP, UDP, ICMP over IPv4, ICMPv6 over IPv6, not in a non-first fragment.
pub(crate) fn l4_csum_off(p: &Parsed) -> Option<usize> {
    if p.fragment {
        return None;
    }
    let l4 = usize::from(p.l4_off);
    match (p.proto, p.src.is_ipv4()) {
        (proto::TCP, _) => Some(l4 + 16),
        (proto::UDP, _) => Some(l4 + 6),
        (proto::ICMP, true) | (proto::ICMPV6, false) => Some(l4 + 2),
        _ => None,
    }
}

/// True if `p` is IPv6 (no header checksum) or its IPv4 header checksum verifies.
/// `parse` skips this check on purpose (the kernel verified it already); call it when the
/// input is untrusted. False also if `frame` is shorter than `p` says.
pub fn ipv4_header_ok(frame: &[u8], p: &Parsed) -> bool {
    if !p.src.is_ipv4() {
        return true;
    }
    // For IPv4 the L4 header starts right after the IP header, so l3..l4 is the header.
    match frame.get(usize::from(p.l3_off)..usize::from(p.l4_off)) {
        Some(h) => checksum(h) == 0,
        None => false,
    }
}

/// True if the L4 checksum verifies, or there is none to verify (non-first fragment, a
/// protocol without a pliant-maintained checksum, UDP over IPv4 sent without checksum).
/// A first fragment of a larger datagram does not verify on its own (the checksum covers the
/// whole datagram). False also if `frame` is shorter than `p` says.
pub fn l4_checksum_ok(frame: &[u8], p: &Parsed) -> bool {
    let Some(field_off) = l4_csum_off(p) else {
        return true;
    };
    let Some(seg) = frame.get(usize::from(p.l4_off)..p.l4_end()) else {
        return false;
    };
    let Some(field) = crate::be16(frame, field_off) else {
        return false;
    };
    if p.proto == proto::UDP && field == 0 && p.src.is_ipv4() {
        return true;
    }
    if p.proto == proto::ICMP {
        checksum(seg) == 0
    } else {
        l4_checksum(p.src, p.dst, p.proto, seg) == 0
    }
}

/// Recomputes the IPv4 header checksum and the L4 checksum (as [`l4_checksum_ok`] defines
/// it) from scratch. Used by the frame builders and tests; too slow for the data path, where
/// [`crate::rewrite`] updates incrementally. Returns false (frame unchanged) if `frame` is
/// shorter than `p` says.
pub fn recompute_checksums(frame: &mut [u8], p: &Parsed) -> bool {
    let (l3, l4, end) = (usize::from(p.l3_off), usize::from(p.l4_off), p.l4_end());
    let csum_off = l4_csum_off(p);
    // Check every index used below up front, so a `Parsed` that does not match `frame` leaves
    // the frame untouched instead of half-rewritten.
    let ip_ok = !p.src.is_ipv4() || (l3 + 20 <= l4 && l4 <= frame.len());
    let l4_ok = match csum_off {
        Some(o) => l4 <= o && o + 2 <= end && end <= frame.len(),
        None => true,
    };
    if !(ip_ok && l4_ok) {
        return false;
    }
    if p.src.is_ipv4() {
        let Some(h) = frame.get_mut(l3..l4) else {
            return false;
        };
        h[10] = 0;
        h[11] = 0;
        let c = checksum(h);
        h[10..12].copy_from_slice(&c.to_be_bytes());
    }
    if let Some(o) = csum_off {
        let Some(seg) = frame.get_mut(l4..end) else {
            return false;
        };
        let rel = o - l4;
        seg[rel] = 0;
        seg[rel + 1] = 0;
        let c = match p.proto {
            proto::ICMP => checksum(seg),
            proto::UDP => udp_field(l4_checksum(p.src, p.dst, p.proto, seg)),
            _ => l4_checksum(p.src, p.dst, p.proto, seg),
        };
        seg[rel..rel + 2].copy_from_slice(&c.to_be_bytes());
    }
    true
}
