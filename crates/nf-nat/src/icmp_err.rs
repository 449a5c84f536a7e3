//! ICMP error messages (destination unreachable, time exceeded, parameter problem) about
//! translated flows. The error quotes the IP header and the first L4 bytes of the packet that
//! caused it; a NAT must translate that quote too, or the host never learns (e.g. "port
//! unreachable", "fragmentation needed" for path MTU discovery).
//!
//! Inner rewrites keep the quoted IP header checksum and (when fully quoted) the quoted L4
//! checksum right incrementally; the outer ICMP checksum is then recomputed over the message
//! (errors are small, at most 576 bytes by RFC 1812, and rare).

use pliant_net::checksum::{checksum, udp_field, update16, update_addr};
use pliant_net::{proto, FlowKey};
use std::net::{IpAddr, Ipv4Addr};

pub const ICMP_DEST_UNREACH: u8 = 3;
pub const ICMP_TIME_EXCEEDED: u8 = 11;
pub const ICMP_PARAM_PROBLEM: u8 = 12;

pub fn is_error(icmp_type: u8) -> bool {
    matches!(
        icmp_type,
        ICMP_DEST_UNREACH | ICMP_TIME_EXCEEDED | ICMP_PARAM_PROBLEM
    )
}

/// The packet quoted in an ICMP error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Inner {
    /// Offsets of the quoted IP and L4 headers in the frame.
    pub l3: usize,
    pub l4: usize,
    /// End of the ICMP message in the frame.
    pub end: usize,
    pub proto: u8,
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    /// Ports; the echo identifier (both) for a quoted ICMP echo.
    pub sport: u16,
    pub dport: u16,
}

impl Inner {
    /// Normalised key of the quoted packet (the same key its flow has in the table).
    pub fn key(&self) -> FlowKey {
        FlowKey::v4(self.proto, self.src, self.sport, self.dst, self.dport).0
    }
}

fn be16(b: &[u8], off: usize) -> Option<u16> {
    Some(u16::from_be_bytes([*b.get(off)?, *b.get(off + 1)?]))
}

fn put16(b: &mut [u8], off: usize, v: u16) {
    b[off..off + 2].copy_from_slice(&v.to_be_bytes());
}

/// Finds the quoted packet of an ICMP error whose ICMP header starts at `l4_off` and whose
/// message ends at `end`. `None` if it is not a quoted IPv4 TCP/UDP/echo first fragment with
/// at least 8 L4 bytes.
pub fn parse_inner(frame: &[u8], l4_off: usize, end: usize) -> Option<Inner> {
    let end = end.min(frame.len());
    let l3 = l4_off.checked_add(8)?;
    let b = frame.get(l3..end)?;
    if b.len() < 20 || b[0] >> 4 != 4 {
        return None;
    }
    let ihl = usize::from(b[0] & 0x0f) * 4;
    if ihl < 20 || b.len() < ihl + 8 || be16(b, 6)? & 0x1fff != 0 {
        return None;
    }
    let (p, src, dst) = (b[9], addr(&b[12..16]), addr(&b[16..20]));
    let l4 = l3 + ihl;
    let (sport, dport) = match p {
        proto::TCP | proto::UDP => (be16(frame, l4)?, be16(frame, l4 + 2)?),
        proto::ICMP if matches!(frame[l4], 0 | 8) => {
            let id = be16(frame, l4 + 4)?;
            (id, id)
        }
        _ => return None,
    };
    Some(Inner {
        l3,
        l4,
        end,
        proto: p,
        src,
        dst,
        sport,
        dport,
    })
}

fn addr(b: &[u8]) -> Ipv4Addr {
    Ipv4Addr::new(b[0], b[1], b[2], b[3])
}

/// Which end of the quoted packet to rewrite.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum End {
    Src,
    Dst,
}

/// Rewrites one end (address and port/identifier) of the quoted packet, then recomputes the
/// ICMP checksum at `l4_off + 2` over the message.
pub fn rewrite_inner(
    frame: &mut [u8],
    l4_off: usize,
    inner: &Inner,
    end: End,
    a: Ipv4Addr,
    port: u16,
) {
    let (addr_off, old_addr) = match end {
        End::Src => (inner.l3 + 12, inner.src),
        End::Dst => (inner.l3 + 16, inner.dst),
    };
    let (old, new) = (IpAddr::V4(old_addr), IpAddr::V4(a));
    frame[addr_off..addr_off + 4].copy_from_slice(&a.octets());
    // Quoted IP header checksum (covers the address).
    if let Some(c) = be16(frame, inner.l3 + 10) {
        put16(frame, inner.l3 + 10, update_addr(c, old, new));
    }
    let (port_off, csum_off) = match (inner.proto, end) {
        (proto::ICMP, _) => (inner.l4 + 4, Some(inner.l4 + 2)),
        (proto::TCP, End::Src) => (inner.l4, Some(inner.l4 + 16)),
        (proto::TCP, End::Dst) => (inner.l4 + 2, Some(inner.l4 + 16)),
        (_, End::Src) => (inner.l4, Some(inner.l4 + 6)),
        (_, End::Dst) => (inner.l4 + 2, Some(inner.l4 + 6)),
    };
    let old_port = be16(frame, port_off).unwrap_or(0);
    put16(frame, port_off, port);
    // The quoted L4 checksum, only when the quote includes it (TCP's often is cut off).
    if let Some(c_off) = csum_off.filter(|o| o + 2 <= inner.end) {
        if let Some(c) = be16(frame, c_off) {
            let mut v = update16(c, old_port, port);
            if inner.proto != proto::ICMP {
                v = update_addr(v, old, new); // pseudo header
            }
            let v = match inner.proto {
                proto::UDP if c == 0 => 0,
                proto::UDP => udp_field(v),
                _ => v,
            };
            put16(frame, c_off, v);
        }
    }
    put16(frame, l4_off + 2, 0);
    let sum = checksum(&frame[l4_off..inner.end]);
    put16(frame, l4_off + 2, sum);
}
