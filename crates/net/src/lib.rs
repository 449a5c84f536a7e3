//! pliant-net: everything that looks inside a frame.
//!
//! - [`parse`]: Ethernet (+ one or two VLAN tags), ARP, IPv4, IPv6 (skipping extension headers),
//!   TCP, UDP, ICMP/ICMPv6 into [`Parsed`] offsets + fields + a direction-normalised flow key.
//!   Never panics: malformed or truncated input is a [`ParseError`] with a short reason label.
//!   No allocation: it runs once per packet on the data path.
//! - [`checksum`]: RFC 1071 sums and RFC 1624 incremental updates; [`ipv4_header_ok`],
//!   [`l4_checksum_ok`] and [`recompute_checksums`] work on a parsed frame.
//! - [`rewrite`]: in-place header rewrites (addresses, ports, ICMP id, TTL, MACs) that keep the
//!   IPv4 header and L4 checksums correct incrementally.
//! - [`icmp_error`]: the packet embedded in an ICMP error (flow lookup and NAT translation).
//! - [`arp`]: ARP request/reply frames.
//! - [`build`]: well-formed test frames (TCP/UDP/ICMP, IPv4/IPv6, VLAN) for unit tests of NFs.

pub use pliant_state::key::{proto, Dir, FlowKey};
use std::net::IpAddr;

pub mod arp;
pub mod build;
pub mod checksum;
mod eth;
pub mod frag;
mod frame_csum;
pub mod gso;
pub mod icmp_error;
mod ipv4;
mod ipv6;
mod l4;
pub mod reasm;
pub mod rewrite;
#[doc(hidden)]
pub mod selfcheck;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod testutil;

pub use frame_csum::{ipv4_header_ok, l4_checksum_ok, recompute_checksums};

pub const ETH_HLEN: usize = 14;
pub const ETHERTYPE_IPV4: u16 = 0x0800;
pub const ETHERTYPE_ARP: u16 = 0x0806;
pub const ETHERTYPE_IPV6: u16 = 0x86dd;
pub const ETHERTYPE_VLAN: u16 = 0x8100;
pub const ETHERTYPE_QINQ: u16 = 0x88a8;

pub type Mac = [u8; 6];

/// What a frame is, at the top level.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame {
    Arp(ArpInfo),
    Ip(Parsed),
    /// A well-formed frame of an ethertype pliant does not handle (counted, dropped).
    Other {
        ethertype: u16,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArpInfo {
    /// 1 = request, 2 = reply.
    pub op: u16,
    pub sender_mac: Mac,
    pub sender_ip: std::net::Ipv4Addr,
    pub target_mac: Mac,
    pub target_ip: std::net::Ipv4Addr,
    pub vlan: Option<u16>,
}

/// Offsets and fields of an IP frame. Offsets are from the start of the Ethernet frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Parsed {
    pub dst_mac: Mac,
    pub src_mac: Mac,
    /// Outer VLAN id, if tagged.
    pub vlan: Option<u16>,
    /// Offset of the IP header.
    pub l3_off: u16,
    /// Offset of the L4 header (after IPv6 extension headers).
    pub l4_off: u16,
    /// Offset of the L4 payload.
    pub payload_off: u16,
    /// L4 payload length per the IP header (not counting Ethernet padding).
    pub payload_len: u16,
    pub src: IpAddr,
    pub dst: IpAddr,
    /// IP protocol (`proto::*`); for IPv6 the final next-header.
    pub proto: u8,
    pub ttl: u8,
    /// TCP/UDP ports; for ICMP echo both hold the identifier; 0 otherwise.
    pub sport: u16,
    pub dport: u16,
    /// TCP flags byte (FIN=0x01 SYN=0x02 RST=0x04 PSH=0x08 ACK=0x10), 0 if not TCP.
    pub tcp_flags: u8,
    pub tcp_seq: u32,
    pub tcp_ack: u32,
    /// ICMP type and code (0 if not ICMP).
    pub icmp_type: u8,
    pub icmp_code: u8,
    /// Non-first IPv4/IPv6 fragment: no L4 header present (ports are 0).
    pub fragment: bool,
    pub key: FlowKey,
    pub dir: Dir,
}

impl Parsed {
    /// True for an ICMP or ICMPv6 echo request/reply (the identifier is in `sport`/`dport`).
    pub fn is_icmp_echo(&self) -> bool {
        !self.fragment && l4::is_echo(self.proto, self.icmp_type, self.src.is_ipv4())
    }

    /// End of the bytes the L4 checksum covers: `payload_off + payload_len`.
    pub fn l4_end(&self) -> usize {
        usize::from(self.payload_off) + usize::from(self.payload_len)
    }

    /// Recomputes `key` and `dir` from the address/port fields (after a rewrite).
    pub fn refresh_key(&mut self) {
        (self.key, self.dir) = FlowKey::new(self.proto, self.src, self.sport, self.dst, self.dport);
    }
}

/// Why a frame was refused. `reason()` is the stable label used in drop counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    #[error("truncated {0} header")]
    Truncated(&'static str),
    #[error("malformed {0} header")]
    Malformed(&'static str),
}

/// Every error the parser produces, with its stable label. The parser only ever returns one of
/// these constants, so `reason()` is a table lookup and a test checks the table is complete.
pub(crate) mod err {
    use super::ParseError::{self, Malformed, Truncated};

    pub const TRUNC_ETH: ParseError = Truncated("Ethernet");
    pub const TRUNC_VLAN: ParseError = Truncated("VLAN");
    pub const TRUNC_ARP: ParseError = Truncated("ARP");
    pub const TRUNC_IPV4: ParseError = Truncated("IPv4");
    pub const TRUNC_IPV6: ParseError = Truncated("IPv6");
    pub const TRUNC_IPV6_EXT: ParseError = Truncated("IPv6 extension");
    pub const TRUNC_TCP: ParseError = Truncated("TCP");
    pub const TRUNC_UDP: ParseError = Truncated("UDP");
    pub const TRUNC_ICMP: ParseError = Truncated("ICMP");
    pub const TRUNC_ICMPV6: ParseError = Truncated("ICMPv6");
    pub const BAD_VLAN_DEPTH: ParseError = Malformed("VLAN stack (more than two tags)");
    pub const BAD_ARP: ParseError = Malformed("ARP (not Ethernet/IPv4)");
    pub const BAD_ARP_OP: ParseError = Malformed("ARP opcode");
    pub const BAD_IPV4_VERSION: ParseError = Malformed("IPv4 version");
    pub const BAD_IPV4_IHL: ParseError = Malformed("IPv4 IHL");
    pub const BAD_IPV4_LEN: ParseError = Malformed("IPv4 total length");
    pub const BAD_IPV6_VERSION: ParseError = Malformed("IPv6 version");
    pub const BAD_IPV6_EXT: ParseError = Malformed("IPv6 extension chain (too long)");
    pub const BAD_TCP_OFFSET: ParseError = Malformed("TCP data offset");
    pub const BAD_UDP_LEN: ParseError = Malformed("UDP length");
    pub const BAD_FRAME_LEN: ParseError = Malformed("frame (offsets beyond 64 KiB)");

    /// (error, label) for every error above.
    pub const ALL: &[(ParseError, &str)] = &[
        (TRUNC_ETH, "truncated_eth"),
        (TRUNC_VLAN, "truncated_vlan"),
        (TRUNC_ARP, "truncated_arp"),
        (TRUNC_IPV4, "truncated_ipv4"),
        (TRUNC_IPV6, "truncated_ipv6"),
        (TRUNC_IPV6_EXT, "truncated_ipv6_ext"),
        (TRUNC_TCP, "truncated_tcp"),
        (TRUNC_UDP, "truncated_udp"),
        (TRUNC_ICMP, "truncated_icmp"),
        (TRUNC_ICMPV6, "truncated_icmpv6"),
        (BAD_VLAN_DEPTH, "bad_vlan_depth"),
        (BAD_ARP, "bad_arp"),
        (BAD_ARP_OP, "bad_arp_op"),
        (BAD_IPV4_VERSION, "bad_ipv4_version"),
        (BAD_IPV4_IHL, "bad_ipv4_ihl"),
        (BAD_IPV4_LEN, "bad_ipv4_len"),
        (BAD_IPV6_VERSION, "bad_ipv6_version"),
        (BAD_IPV6_EXT, "bad_ipv6_ext"),
        (BAD_TCP_OFFSET, "bad_tcp_offset"),
        (BAD_UDP_LEN, "bad_udp_len"),
        (BAD_FRAME_LEN, "bad_frame_len"),
    ];
}

impl ParseError {
    /// Stable, Prometheus-label-safe name of this error (`truncated_tcp`, `bad_ipv4_ihl`, ...).
    /// Errors built outside this crate map to `truncated_other` / `malformed_other`.
    pub fn reason(&self) -> &'static str {
        for (e, label) in err::ALL {
            if e == self {
                return label;
            }
        }
        match self {
            ParseError::Truncated(_) => "truncated_other",
            ParseError::Malformed(_) => "malformed_other",
        }
    }

    /// Every label [`reason`](Self::reason) can return for errors of [`parse`], so a metrics
    /// exporter can pre-register them (a drop counter that never fired still shows as 0).
    pub fn all_reasons() -> impl Iterator<Item = &'static str> {
        err::ALL.iter().map(|(_, l)| *l)
    }
}

/// Bounds-checked big-endian reads; `None` past the end of `b`. The parser uses these
/// everywhere so no input can make it index out of bounds.
#[inline]
pub(crate) fn be16(b: &[u8], off: usize) -> Option<u16> {
    match b.get(off..off.checked_add(2)?) {
        Some(&[x, y]) => Some(u16::from_be_bytes([x, y])),
        _ => None,
    }
}

#[inline]
pub(crate) fn be32(b: &[u8], off: usize) -> Option<u32> {
    let s = b.get(off..off.checked_add(4)?)?;
    Some(u32::from_be_bytes([s[0], s[1], s[2], s[3]]))
}

#[inline]
pub(crate) fn array<const N: usize>(b: &[u8], off: usize) -> Option<[u8; N]> {
    let s = b.get(off..off.checked_add(N)?)?;
    let mut out = [0u8; N];
    out.copy_from_slice(s);
    Some(out)
}

#[inline]
fn off16(v: usize) -> Result<u16, ParseError> {
    u16::try_from(v).map_err(|_| err::BAD_FRAME_LEN)
}

/// Parses one Ethernet frame. Never panics, never reads out of bounds, never allocates.
pub fn parse(frame: &[u8]) -> Result<Frame, ParseError> {
    let e = eth::parse(frame)?;
    let l3 = match e.ethertype {
        ETHERTYPE_ARP => return arp::parse(frame, e.l3_off, e.vlan).map(Frame::Arp),
        ETHERTYPE_IPV4 => ipv4::parse(frame, e.l3_off)?,
        ETHERTYPE_IPV6 => ipv6::parse(frame, e.l3_off)?,
        other => return Ok(Frame::Other { ethertype: other }),
    };
    let l4 = l4::parse(frame, &l3)?;
    let (key, dir) = FlowKey::new(l3.proto, l3.src, l4.sport, l3.dst, l4.dport);
    Ok(Frame::Ip(Parsed {
        dst_mac: e.dst,
        src_mac: e.src,
        vlan: e.vlan,
        l3_off: off16(e.l3_off)?,
        l4_off: off16(l3.l4_off)?,
        payload_off: off16(l4.payload_off)?,
        payload_len: off16(l4.payload_len)?,
        src: l3.src,
        dst: l3.dst,
        proto: l3.proto,
        ttl: l3.ttl,
        sport: l4.sport,
        dport: l4.dport,
        tcp_flags: l4.tcp_flags,
        tcp_seq: l4.tcp_seq,
        tcp_ack: l4.tcp_ack,
        icmp_type: l4.icmp_type,
        icmp_code: l4.icmp_code,
        fragment: l3.fragment,
        key,
        dir,
    }))
}

/// What the L3 parsers hand to the L4 parser.
#[derive(Clone, Copy, Debug)]
pub(crate) struct L3 {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub proto: u8,
    pub ttl: u8,
    /// Offset of the L4 header and end of the IP datagram (excludes Ethernet padding).
    pub l4_off: usize,
    pub ip_end: usize,
    /// Non-first fragment: no L4 header.
    pub fragment: bool,
    /// First fragment of a datagram with more to come: L4 length fields describe bytes that
    /// are not in this frame.
    pub more_fragments: bool,
}
