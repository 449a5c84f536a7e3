//! TCP, UDP, ICMP and ICMPv6 headers: ports (or the echo identifier), TCP flags/seq/ack, ICMP
//! type/code, and where the payload starts and ends.

use crate::{be16, be32, err, proto, ParseError, L3};

pub const TCP_HLEN: usize = 20;
pub const UDP_HLEN: usize = 8;
/// ICMP and ICMPv6 share an 8-byte header (type, code, checksum, 4 type-specific bytes).
pub const ICMP_HLEN: usize = 8;

pub const ICMP_ECHO_REPLY: u8 = 0;
pub const ICMP_ECHO_REQUEST: u8 = 8;
pub const ICMPV6_ECHO_REQUEST: u8 = 128;
pub const ICMPV6_ECHO_REPLY: u8 = 129;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct L4 {
    pub sport: u16,
    pub dport: u16,
    pub tcp_flags: u8,
    pub tcp_seq: u32,
    pub tcp_ack: u32,
    pub icmp_type: u8,
    pub icmp_code: u8,
    pub payload_off: usize,
    pub payload_len: usize,
}

/// True for echo request/reply of the ICMP flavour that belongs to the IP version.
pub(crate) fn is_echo(proto: u8, icmp_type: u8, ipv4: bool) -> bool {
    match (proto, ipv4) {
        (proto::ICMP, true) => matches!(icmp_type, ICMP_ECHO_REQUEST | ICMP_ECHO_REPLY),
        (proto::ICMPV6, false) => matches!(icmp_type, ICMPV6_ECHO_REQUEST | ICMPV6_ECHO_REPLY),
        _ => false,
    }
}

pub(crate) fn parse(frame: &[u8], l3: &L3) -> Result<L4, ParseError> {
    // The IP layer already checked `ip_end <= frame.len()` and `l4_off <= ip_end`; `get` keeps
    // this safe even if that ever changes.
    let seg = frame.get(l3.l4_off..l3.ip_end).unwrap_or(&[]);
    let whole = L4 {
        payload_off: l3.l4_off,
        payload_len: seg.len(),
        ..L4::default()
    };
    if l3.fragment {
        return Ok(whole);
    }
    let ipv4 = l3.src.is_ipv4();
    match l3.proto {
        proto::TCP => {
            let (Some(sport), Some(dport), Some(seq), Some(ack), Some(&doff), Some(&flags)) = (
                be16(seg, 0),
                be16(seg, 2),
                be32(seg, 4),
                be32(seg, 8),
                seg.get(12),
                seg.get(13),
            ) else {
                return Err(err::TRUNC_TCP);
            };
            let hlen = usize::from(doff >> 4) * 4;
            if hlen < TCP_HLEN {
                return Err(err::BAD_TCP_OFFSET);
            }
            if hlen > seg.len() {
                return Err(err::TRUNC_TCP);
            }
            Ok(L4 {
                sport,
                dport,
                tcp_flags: flags,
                tcp_seq: seq,
                tcp_ack: ack,
                payload_off: l3.l4_off + hlen,
                payload_len: seg.len() - hlen,
                ..L4::default()
            })
        }
        proto::UDP => {
            let (Some(sport), Some(dport), Some(ulen), true) = (
                be16(seg, 0),
                be16(seg, 2),
                be16(seg, 4),
                seg.len() >= UDP_HLEN,
            ) else {
                return Err(err::TRUNC_UDP);
            };
            let ulen = usize::from(ulen);
            let payload_len = if l3.more_fragments {
                // The UDP length covers the whole datagram, most of it in later fragments.
                seg.len() - UDP_HLEN
            } else if ulen < UDP_HLEN || ulen > seg.len() {
                return Err(err::BAD_UDP_LEN);
            } else {
                ulen - UDP_HLEN
            };
            Ok(L4 {
                sport,
                dport,
                payload_off: l3.l4_off + UDP_HLEN,
                payload_len,
                ..L4::default()
            })
        }
        proto::ICMP | proto::ICMPV6 if (l3.proto == proto::ICMP) == ipv4 => {
            let (Some(&t), Some(&code), Some(id), true) = (
                seg.first(),
                seg.get(1),
                be16(seg, 4),
                seg.len() >= ICMP_HLEN,
            ) else {
                return Err(if ipv4 {
                    err::TRUNC_ICMP
                } else {
                    err::TRUNC_ICMPV6
                });
            };
            let id = if is_echo(l3.proto, t, ipv4) { id } else { 0 };
            Ok(L4 {
                sport: id,
                dport: id,
                icmp_type: t,
                icmp_code: code,
                payload_off: l3.l4_off + ICMP_HLEN,
                payload_len: seg.len() - ICMP_HLEN,
                ..L4::default()
            })
        }
        // Any other protocol (and ICMP carried by the "wrong" IP version): no ports, the whole
        // IP payload is payload.
        _ => Ok(whole),
    }
}
