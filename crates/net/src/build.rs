//! Builders for well-formed test frames with correct checksums (IPv4 or IPv6, TCP, UDP, ICMP
//! echo, optional VLAN tags, Ethernet padding). For unit tests of NFs and the fuzz seed corpus;
//! they allocate and are not meant for the data path.
//!
//! Conventions: IPv4 frames have TTL 64, DF set, id 0, no options; IPv6 frames have hop limit
//! 64, no extension headers. The IP version follows the addresses: if either `src` or `dst` is
//! IPv6, both are used as IPv6 (an IPv4 one as `::ffff:a.b.c.d`). Payloads longer than fit in
//! one IP packet are cut to fit.
//!
//! ```
//! use pliant_net::{build, parse, Frame};
//! let f = build::udp(build::MAC_A, build::MAC_B, "10.0.0.1".parse().unwrap(), 5000,
//!                    "10.0.0.2".parse().unwrap(), 53, b"hello");
//! let Ok(Frame::Ip(p)) = parse(&f) else { panic!() };
//! assert_eq!((p.sport, p.dport, p.payload_len), (5000, 53, 5));
//! ```

use crate::checksum::{checksum, l4_checksum, udp_field};
use crate::l4::{ICMPV6_ECHO_REPLY, ICMPV6_ECHO_REQUEST, ICMP_ECHO_REPLY, ICMP_ECHO_REQUEST};
use crate::{proto, Mac, ETHERTYPE_IPV4, ETHERTYPE_IPV6, ETHERTYPE_QINQ, ETHERTYPE_VLAN};
use std::net::{IpAddr, Ipv6Addr};

/// Handy locally administered MACs for tests.
pub const MAC_A: Mac = [0x02, 0, 0, 0, 0, 0x0a];
pub const MAC_B: Mac = [0x02, 0, 0, 0, 0, 0x0b];

/// TCP flag bits for [`tcp`].
pub mod tcp_flags {
    pub const FIN: u8 = 0x01;
    pub const SYN: u8 = 0x02;
    pub const RST: u8 = 0x04;
    pub const PSH: u8 = 0x08;
    pub const ACK: u8 = 0x10;
}

fn v6(a: IpAddr) -> Ipv6Addr {
    match a {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    }
}

/// Resolves the IP version (see the module docs).
fn family(src: IpAddr, dst: IpAddr) -> (IpAddr, IpAddr) {
    if src.is_ipv4() && dst.is_ipv4() {
        (src, dst)
    } else {
        (IpAddr::V6(v6(src)), IpAddr::V6(v6(dst)))
    }
}

/// Wraps an L4 segment into Ethernet + IP. `csum_at` is the offset of the L4 checksum field in
/// `l4` (zeroed by the caller), filled here: with the pseudo header for TCP, UDP and ICMPv6,
/// without it for ICMP over IPv4.
fn ip_frame(
    src_mac: Mac,
    dst_mac: Mac,
    src: IpAddr,
    dst: IpAddr,
    proto: u8,
    mut l4: Vec<u8>,
    csum_at: Option<usize>,
) -> Vec<u8> {
    let v4 = src.is_ipv4();
    let hlen = if v4 { 20 } else { 40 };
    // IPv4 total length and IPv6 payload length are 16-bit fields.
    let max_l4 = if v4 { 65535 - hlen } else { 65535 };
    l4.truncate(max_l4);
    if let Some(at) = csum_at.filter(|&at| at + 2 <= l4.len()) {
        let c = match (proto, v4) {
            (proto::ICMP, true) => checksum(&l4),
            (proto::UDP, _) => udp_field(l4_checksum(src, dst, proto, &l4)),
            _ => l4_checksum(src, dst, proto, &l4),
        };
        l4[at..at + 2].copy_from_slice(&c.to_be_bytes());
    }
    let mut f = Vec::with_capacity(14 + hlen + l4.len());
    f.extend_from_slice(&dst_mac);
    f.extend_from_slice(&src_mac);
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            f.extend_from_slice(&ETHERTYPE_IPV4.to_be_bytes());
            let total = (hlen + l4.len()) as u16; // <= 65535 by the truncate above
            let mut h = [0u8; 20];
            h[0] = 0x45;
            h[2..4].copy_from_slice(&total.to_be_bytes());
            h[6] = 0x40; // DF
            h[8] = 64;
            h[9] = proto;
            h[12..16].copy_from_slice(&s.octets());
            h[16..20].copy_from_slice(&d.octets());
            let c = checksum(&h);
            h[10..12].copy_from_slice(&c.to_be_bytes());
            f.extend_from_slice(&h);
        }
        _ => {
            f.extend_from_slice(&ETHERTYPE_IPV6.to_be_bytes());
            let mut h = [0u8; 40];
            h[0] = 0x60;
            h[4..6].copy_from_slice(&(l4.len() as u16).to_be_bytes());
            h[6] = proto;
            h[7] = 64;
            h[8..24].copy_from_slice(&v6(src).octets());
            h[24..40].copy_from_slice(&v6(dst).octets());
            f.extend_from_slice(&h);
        }
    }
    f.extend_from_slice(&l4);
    f
}

/// A TCP segment (20-byte header, no options, window 65535).
#[allow(clippy::too_many_arguments)]
pub fn tcp(
    src_mac: Mac,
    dst_mac: Mac,
    src: IpAddr,
    sport: u16,
    dst: IpAddr,
    dport: u16,
    flags: u8,
    seq: u32,
    ack: u32,
    payload: &[u8],
) -> Vec<u8> {
    let (src, dst) = family(src, dst);
    let mut l4 = Vec::with_capacity(20 + payload.len());
    l4.extend_from_slice(&sport.to_be_bytes());
    l4.extend_from_slice(&dport.to_be_bytes());
    l4.extend_from_slice(&seq.to_be_bytes());
    l4.extend_from_slice(&ack.to_be_bytes());
    l4.push(5 << 4);
    l4.push(flags);
    l4.extend_from_slice(&0xffffu16.to_be_bytes()); // window
    l4.extend_from_slice(&[0, 0, 0, 0]); // checksum, urgent pointer
    l4.extend_from_slice(payload);
    ip_frame(src_mac, dst_mac, src, dst, proto::TCP, l4, Some(16))
}

/// A UDP datagram.
pub fn udp(
    src_mac: Mac,
    dst_mac: Mac,
    src: IpAddr,
    sport: u16,
    dst: IpAddr,
    dport: u16,
    payload: &[u8],
) -> Vec<u8> {
    let (src, dst) = family(src, dst);
    // Cut the payload so the UDP length field cannot wrap.
    let payload = &payload[..payload
        .len()
        .min(65535 - 8 - if src.is_ipv4() { 20 } else { 0 })];
    let mut l4 = Vec::with_capacity(8 + payload.len());
    l4.extend_from_slice(&sport.to_be_bytes());
    l4.extend_from_slice(&dport.to_be_bytes());
    l4.extend_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
    l4.extend_from_slice(&[0, 0]);
    l4.extend_from_slice(payload);
    ip_frame(src_mac, dst_mac, src, dst, proto::UDP, l4, Some(6))
}

/// An ICMP (IPv4) or ICMPv6 (IPv6) echo request (`request`) or reply with identifier `id`.
#[allow(clippy::too_many_arguments)]
pub fn icmp_echo(
    src_mac: Mac,
    dst_mac: Mac,
    src: IpAddr,
    dst: IpAddr,
    id: u16,
    seq: u16,
    request: bool,
    payload: &[u8],
) -> Vec<u8> {
    let (src, dst) = family(src, dst);
    let (pr, t) = match (src.is_ipv4(), request) {
        (true, true) => (proto::ICMP, ICMP_ECHO_REQUEST),
        (true, false) => (proto::ICMP, ICMP_ECHO_REPLY),
        (false, true) => (proto::ICMPV6, ICMPV6_ECHO_REQUEST),
        (false, false) => (proto::ICMPV6, ICMPV6_ECHO_REPLY),
    };
    icmp(src_mac, dst_mac, src, dst, pr, t, 0, [id, seq], payload)
}

/// Any ICMP/ICMPv6 message: `proto` is `proto::ICMP` or `proto::ICMPV6`, `rest` the 4
/// type-specific header bytes as two 16-bit words (for echo: identifier, sequence).
#[allow(clippy::too_many_arguments)]
pub fn icmp(
    src_mac: Mac,
    dst_mac: Mac,
    src: IpAddr,
    dst: IpAddr,
    proto: u8,
    icmp_type: u8,
    code: u8,
    rest: [u16; 2],
    payload: &[u8],
) -> Vec<u8> {
    let (src, dst) = family(src, dst);
    let mut l4 = Vec::with_capacity(8 + payload.len());
    l4.extend_from_slice(&[icmp_type, code, 0, 0]);
    l4.extend_from_slice(&rest[0].to_be_bytes());
    l4.extend_from_slice(&rest[1].to_be_bytes());
    l4.extend_from_slice(payload);
    ip_frame(src_mac, dst_mac, src, dst, proto, l4, Some(2))
}

/// An IP packet of any protocol with `l4` as its payload, unchanged (no L4 checksum computed).
pub fn raw_ip(
    src_mac: Mac,
    dst_mac: Mac,
    src: IpAddr,
    dst: IpAddr,
    proto: u8,
    l4: &[u8],
) -> Vec<u8> {
    let (src, dst) = family(src, dst);
    ip_frame(src_mac, dst_mac, src, dst, proto, l4.to_vec(), None)
}

/// Inserts a VLAN tag (TPID 0x8100, or 0x88a8 for `outer_qinq`) with VLAN id `vid` right after
/// the MAC addresses, in front of any existing tag. Frames shorter than 12 bytes are returned
/// unchanged.
pub fn with_vlan(frame: &[u8], vid: u16, outer_qinq: bool) -> Vec<u8> {
    if frame.len() < 12 {
        return frame.to_vec();
    }
    let tpid = if outer_qinq {
        ETHERTYPE_QINQ
    } else {
        ETHERTYPE_VLAN
    };
    let mut f = Vec::with_capacity(frame.len() + 4);
    f.extend_from_slice(&frame[..12]);
    f.extend_from_slice(&tpid.to_be_bytes());
    f.extend_from_slice(&(vid & 0x0fff).to_be_bytes());
    f.extend_from_slice(&frame[12..]);
    f
}

/// Pads `frame` with `fill` bytes up to `len` (Ethernet minimum is 60 without FCS); longer
/// frames are returned unchanged. A non-zero `fill` makes padding-vs-payload bugs visible.
pub fn pad(frame: &[u8], len: usize, fill: u8) -> Vec<u8> {
    let mut f = frame.to_vec();
    if f.len() < len {
        f.resize(len, fill);
    }
    f
}
