//! pliant-net: everything that looks inside a frame (SKELETON: contract; bodies being written).
//!
//! - [`parse`]: Ethernet (+ one or two VLAN tags), ARP, IPv4, IPv6 (skipping extension headers),
//!   TCP, UDP, ICMP/ICMPv6 into [`Parsed`] offsets + fields + a direction-normalised flow key.
//!   Never panics: malformed or truncated input is a [`ParseError`] with a short reason label.
//! - `checksum`: RFC 1071 sums and RFC 1624 incremental updates.
//! - `rewrite`: in-place header rewrites (addresses, ports, ICMP id, TTL, MACs) that keep the
//!   IPv4 header and L4 checksums correct incrementally.
//! - `arp`: ARP request/reply frames.
//! - `build`: well-formed test frames (TCP/UDP/ICMP/ARP) for unit tests of NFs.

pub use pliant_state::key::{proto, Dir, FlowKey};
use std::net::IpAddr;

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
    Other { ethertype: u16 },
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

/// Why a frame was refused. `reason()` is the stable label used in drop counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    #[error("truncated {0} header")]
    Truncated(&'static str),
    #[error("malformed {0} header")]
    Malformed(&'static str),
}

impl ParseError {
    pub fn reason(&self) -> &'static str {
        todo!()
    }
}

/// Parses one Ethernet frame. Never panics, never reads out of bounds.
pub fn parse(frame: &[u8]) -> Result<Frame, ParseError> {
    let _ = frame;
    todo!()
}
