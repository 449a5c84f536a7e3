//! ICMP/ICMPv6 error messages (destination unreachable, time exceeded, parameter problem, ...)
//! carry the start of the packet that caused them. A NAT or firewall relates the error to a flow
//! through that embedded packet, and a NAT must translate it as well (RFC 5508 §4.2), or the
//! client sees an error about an address it never used. Not on the hot path: errors are rare.
//!
//! [`inner`] parses the embedded packet leniently (it is cut short by design);
//! [`set_inner_ip`] and [`set_inner_port`] rewrite it in place, keeping the embedded IPv4 header
//! checksum, the embedded L4 checksum (when it is inside the frame) and the outer ICMP checksum
//! correct incrementally.

use crate::checksum::{udp_field, update16, update_addr};
use crate::rewrite::{RewriteError, Side};
use crate::{be16, proto, Dir, FlowKey, Parsed};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// The packet embedded in an ICMP error. Addresses and ports are those of the *original*
/// packet (which travelled the opposite way to the error), so `key` is that flow's key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IcmpInner {
    /// Offsets (from the frame start) of the embedded IP and L4 headers.
    pub l3_off: u16,
    pub l4_off: u16,
    pub src: IpAddr,
    pub dst: IpAddr,
    pub proto: u8,
    /// Ports (or echo identifier in both) of the embedded packet; 0 if not present.
    pub sport: u16,
    pub dport: u16,
    /// The embedded L4 header's ports/identifier are inside the frame.
    pub ports_present: bool,
    /// Key of the flow the embedded packet belongs to, and that packet's direction.
    pub key: FlowKey,
    pub dir: Dir,
}

/// True for the ICMP error types that embed the offending packet.
pub fn is_error(p: &Parsed) -> bool {
    if p.fragment {
        return false;
    }
    match (p.proto, p.src.is_ipv4()) {
        // Destination unreachable, source quench, redirect, time exceeded, parameter problem.
        (proto::ICMP, true) => matches!(p.icmp_type, 3 | 4 | 5 | 11 | 12),
        // Destination unreachable, packet too big, time exceeded, parameter problem.
        (proto::ICMPV6, false) => matches!(p.icmp_type, 1..=4),
        _ => false,
    }
}

/// Parses the packet embedded in an ICMP error; `None` if `p` is not an ICMP error or the
/// embedded IP header is not all there. The embedded IP must be of the outer IP's version.
pub fn inner(frame: &[u8], p: &Parsed) -> Option<IcmpInner> {
    if !is_error(p) {
        return None;
    }
    let start = usize::from(p.payload_off);
    let b = frame.get(start..p.l4_end())?;
    let (src, dst, mut nh, mut off, mut frag) = if p.src.is_ipv4() {
        let h: [u8; 20] = crate::array(b, 0)?;
        let ihl = usize::from(h[0] & 0x0f) * 4;
        if h[0] >> 4 != 4 || ihl < 20 || ihl > b.len() {
            return None;
        }
        let src = IpAddr::V4(Ipv4Addr::new(h[12], h[13], h[14], h[15]));
        let dst = IpAddr::V4(Ipv4Addr::new(h[16], h[17], h[18], h[19]));
        let frag = u16::from_be_bytes([h[6], h[7]]) & 0x1fff != 0;
        (src, dst, h[9], ihl, frag)
    } else {
        let h: [u8; 40] = crate::array(b, 0)?;
        if h[0] >> 4 != 6 {
            return None;
        }
        let s: [u8; 16] = crate::array(&h, 8)?;
        let d: [u8; 16] = crate::array(&h, 24)?;
        (
            IpAddr::V6(Ipv6Addr::from(s)),
            IpAddr::V6(Ipv6Addr::from(d)),
            h[6],
            40,
            false,
        )
    };
    if !p.src.is_ipv4() {
        // Same extension headers and bound as the main parser; a cut-off chain means no ports.
        for _ in 0..crate::ipv6::MAX_EXT_HEADERS {
            match nh {
                0 | 43 | 60 => {
                    let (Some(&next), Some(&len8)) = (b.get(off), b.get(off + 1)) else {
                        break;
                    };
                    nh = next;
                    off += (usize::from(len8) + 1) * 8;
                }
                44 => {
                    let (Some(&next), Some(fo)) = (b.get(off), be16(b, off + 2)) else {
                        break;
                    };
                    nh = next;
                    off += 8;
                    if fo >> 3 != 0 {
                        frag = true;
                        break;
                    }
                }
                _ => break,
            }
        }
    }
    let l4 = b.get(off..).unwrap_or(&[]);
    let (sport, dport, present) = match nh {
        _ if frag => (0, 0, false),
        proto::TCP | proto::UDP => match (be16(l4, 0), be16(l4, 2)) {
            (Some(s), Some(d)) => (s, d, true),
            _ => (0, 0, false),
        },
        proto::ICMP | proto::ICMPV6 => {
            let echo = l4
                .first()
                .is_some_and(|&t| crate::l4::is_echo(nh, t, p.src.is_ipv4()));
            match be16(l4, 4) {
                Some(id) if echo => (id, id, true),
                _ => (0, 0, false),
            }
        }
        _ => (0, 0, false),
    };
    let (key, dir) = FlowKey::new(nh, src, sport, dst, dport);
    Some(IcmpInner {
        l3_off: u16::try_from(start).ok()?,
        l4_off: u16::try_from(start + off).ok()?,
        src,
        dst,
        proto: nh,
        sport,
        dport,
        ports_present: present,
        key,
        dir,
    })
}

/// Writes `new` (even length) at `at` and updates the 16-bit one's-complement checksum at
/// `outer` for it, word by word. `at - start of the checksummed area` must be even, which holds
/// for every header field an ICMP error embeds (all offsets are multiples of 2 from the ICMP
/// header).
fn put(frame: &mut [u8], outer: usize, at: usize, new: &[u8]) -> Option<()> {
    let mut c = be16(frame, outer)?;
    frame.get(at..at + new.len())?;
    for (i, w) in new.chunks_exact(2).enumerate() {
        let o = at + 2 * i;
        let old = be16(frame, o)?;
        let nw = u16::from_be_bytes([w[0], w[1]]);
        frame[o..o + 2].copy_from_slice(&w[..2]);
        c = update16(c, old, nw);
    }
    frame[outer..outer + 2].copy_from_slice(&c.to_be_bytes());
    Some(())
}

/// Offset of the embedded L4 checksum if the whole field is inside the ICMP message.
fn inner_l4_csum(p: &Parsed, i: &IcmpInner) -> Option<usize> {
    let l4 = usize::from(i.l4_off);
    let at = match i.proto {
        proto::TCP => l4 + 16,
        proto::UDP => l4 + 6,
        proto::ICMPV6 if !i.src.is_ipv4() => l4 + 2,
        proto::ICMP if i.src.is_ipv4() => l4 + 2,
        _ => return None,
    };
    (at + 2 <= p.l4_end()).then_some(at)
}

/// Rewrites the embedded packet's source or destination address. For a NAT translating an
/// error that comes back towards the client, that is the embedded *source* (the client's
/// translated address).
pub fn set_inner_ip(
    frame: &mut [u8],
    p: &Parsed,
    i: &mut IcmpInner,
    side: Side,
    addr: IpAddr,
) -> Result<(), RewriteError> {
    let v4 = i.src.is_ipv4();
    if addr.is_ipv4() != v4 {
        let (packet, new) = if v4 { (4, 6) } else { (6, 4) };
        return Err(RewriteError::FamilyMismatch { packet, new });
    }
    let outer = usize::from(p.l4_off) + 2;
    let l3 = usize::from(i.l3_off);
    let (at, len) = match (v4, side) {
        (true, Side::Src) => (l3 + 12, 4),
        (true, Side::Dst) => (l3 + 16, 4),
        (false, Side::Src) => (l3 + 8, 16),
        (false, Side::Dst) => (l3 + 24, 16),
    };
    let old = match side {
        Side::Src => i.src,
        Side::Dst => i.dst,
    };
    if at + len > p.l4_end() || frame.len() < p.l4_end() || be16(frame, outer).is_none() {
        return Err(RewriteError::FrameTooShort);
    }
    let new_bytes: [u8; 16] = match addr {
        IpAddr::V4(a) => {
            let mut b = [0u8; 16];
            b[..4].copy_from_slice(&a.octets());
            b
        }
        IpAddr::V6(a) => a.octets(),
    };
    // Everything was bounds-checked above, so none of these `put`s can stop half way.
    let _ = put(frame, outer, at, &new_bytes[..len]);
    if v4 {
        if let Some(c) = be16(frame, l3 + 10) {
            let _ = put(
                frame,
                outer,
                l3 + 10,
                &update_addr(c, old, addr).to_be_bytes(),
            );
        }
    }
    if let Some(at) = inner_l4_csum(p, i) {
        let c = be16(frame, at).unwrap_or(0);
        let n = match i.proto {
            proto::ICMP => c, // no pseudo header over IPv4
            proto::UDP if c == 0 => 0,
            proto::UDP => udp_field(update_addr(c, old, addr)),
            _ => update_addr(c, old, addr),
        };
        let _ = put(frame, outer, at, &n.to_be_bytes());
    }
    match side {
        Side::Src => i.src = addr,
        Side::Dst => i.dst = addr,
    }
    (i.key, i.dir) = FlowKey::new(i.proto, i.src, i.sport, i.dst, i.dport);
    Ok(())
}

/// Rewrites the embedded packet's source or destination port (for an embedded ICMP echo, the
/// identifier, whichever side is given).
pub fn set_inner_port(
    frame: &mut [u8],
    p: &Parsed,
    i: &mut IcmpInner,
    side: Side,
    port: u16,
) -> Result<(), RewriteError> {
    if !i.ports_present {
        return Err(RewriteError::NoPorts(i.proto));
    }
    let outer = usize::from(p.l4_off) + 2;
    let l4 = usize::from(i.l4_off);
    let echo = matches!(i.proto, proto::ICMP | proto::ICMPV6);
    let at = match (echo, side) {
        (true, _) => l4 + 4,
        (false, Side::Src) => l4,
        (false, Side::Dst) => l4 + 2,
    };
    if at + 2 > p.l4_end() || frame.len() < p.l4_end() || be16(frame, outer).is_none() {
        return Err(RewriteError::FrameTooShort);
    }
    let old = be16(frame, at).unwrap_or(0);
    let _ = put(frame, outer, at, &port.to_be_bytes());
    if let Some(c_at) = inner_l4_csum(p, i) {
        let c = be16(frame, c_at).unwrap_or(0);
        let n = match i.proto {
            proto::UDP if c == 0 => 0,
            proto::UDP => udp_field(update16(c, old, port)),
            _ => update16(c, old, port),
        };
        let _ = put(frame, outer, c_at, &n.to_be_bytes());
    }
    match (echo, side) {
        (true, _) => (i.sport, i.dport) = (port, port),
        (false, Side::Src) => i.sport = port,
        (false, Side::Dst) => i.dport = port,
    }
    (i.key, i.dir) = FlowKey::new(i.proto, i.src, i.sport, i.dst, i.dport);
    Ok(())
}

/// Bytes of the offending IP packet an ICMP error quotes at most: RFC 1812 §4.3.2.3 (the
/// error, IP header included, stays within 576 bytes).
pub const MAX_QUOTE: usize = 576 - 20 - 8;

/// Whether a router may answer the IPv4 packet `p` with an ICMP error (RFC 1122 §3.2.2,
/// RFC 1812 §4.3.2.7): not about an ICMP error, a non-first fragment, a packet whose source
/// is not a unicast host address, or one sent to a link-layer broadcast/multicast address.
pub fn may_answer(p: &Parsed) -> bool {
    let IpAddr::V4(src) = p.src else {
        return false;
    };
    if p.fragment || is_error(p) || p.dst_mac[0] & 1 != 0 {
        return false;
    }
    if let IpAddr::V4(d) = p.dst {
        if d.is_broadcast() || d.is_multicast() {
            return false;
        }
    }
    !(src.is_unspecified()
        || src.is_broadcast()
        || src.is_multicast()
        || src.is_loopback()
        || src.octets()[0] == 0)
}

/// The ICMPv4 error (`icmp_type`/`code`, the 4 type-specific bytes as `rest`) a router at
/// `router` sends back to the source of the IPv4 packet in `frame` (parsed as `p`), quoting its
/// IP header and up to [`MAX_QUOTE`] bytes of it; addressed from `our_mac` to the frame's
/// sender. `None` when [`may_answer`] says no error may be sent. Allocates (not the data path).
pub fn build_v4(
    frame: &[u8],
    p: &Parsed,
    our_mac: crate::Mac,
    router: Ipv4Addr,
    icmp_type: u8,
    code: u8,
    rest: [u16; 2],
) -> Option<Vec<u8>> {
    if !may_answer(p) {
        return None;
    }
    let l3 = usize::from(p.l3_off);
    let end = p.l4_end().min(frame.len()).min(l3 + MAX_QUOTE);
    let quote = frame.get(l3..end)?;
    Some(crate::build::icmp(
        our_mac,
        p.src_mac,
        IpAddr::V4(router),
        p.src,
        proto::ICMP,
        icmp_type,
        code,
        rest,
        quote,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::build::{self, MAC_A, MAC_B};
    use crate::l4_checksum_ok;
    use crate::testutil::{parsed, Rng};

    /// The ICMP error a router at `router` sends to `orig_src` about the packet `orig` (a
    /// built frame), quoting `quote` bytes of its IP packet.
    fn error_about(orig: &[u8], router: IpAddr, quote: usize) -> Vec<u8> {
        let o = parsed(orig);
        let ip = &orig[usize::from(o.l3_off)..];
        let ip = &ip[..quote.min(ip.len())];
        let (pr, t) = if o.src.is_ipv4() {
            (proto::ICMP, 3)
        } else {
            (proto::ICMPV6, 1)
        };
        build::icmp(MAC_B, MAC_A, router, o.src, pr, t, 3, [0, 0], ip)
    }

    fn addr(rng: &mut Rng, v4: bool) -> IpAddr {
        if v4 {
            IpAddr::V4(Ipv4Addr::from(rng.next()))
        } else {
            let mut b = [0u8; 16];
            rng.fill(&mut b);
            IpAddr::V6(Ipv6Addr::from(b))
        }
    }

    #[test]
    fn inner_tuple_of_an_error() {
        let c: IpAddr = "10.0.0.1".parse().unwrap();
        let s: IpAddr = "10.0.9.9".parse().unwrap();
        let orig = build::udp(MAC_A, MAC_B, c, 4000, s, 53, b"abc");
        let e = error_about(&orig, "10.0.5.5".parse().unwrap(), 28);
        let p = parsed(&e);
        assert!(is_error(&p));
        assert_eq!((p.sport, p.dport), (0, 0));
        let i = inner(&e, &p).unwrap();
        assert_eq!(
            (i.src, i.dst, i.proto, i.sport, i.dport),
            (c, s, proto::UDP, 4000, 53)
        );
        assert_eq!(i.key, parsed(&orig).key);
        assert!(i.ports_present);
        // Too short to hold the embedded IP header.
        let e = error_about(&orig, "10.0.5.5".parse().unwrap(), 19);
        assert_eq!(inner(&e, &parsed(&e)), None);
        // Not an error.
        assert_eq!(inner(&orig, &parsed(&orig)), None);
    }

    /// Translating the embedded packet must give exactly the error built around the translated
    /// original packet (checksums included), for full and cut-short quotes.
    #[test]
    fn inner_rewrites_equal_rebuild() {
        let mut rng = Rng::new(5508);
        let mut compared = 0;
        for n in 0..3_000 {
            let v4 = n % 2 == 0;
            let (a, b, r, a2) = (
                addr(&mut rng, v4),
                addr(&mut rng, v4),
                addr(&mut rng, v4),
                addr(&mut rng, v4),
            );
            let (pa, pb, pa2) = (rng.next() as u16, rng.next() as u16, rng.next() as u16);
            let mut payload = vec![0u8; rng.below(30)];
            rng.fill(&mut payload);
            let kind = rng.below(3);
            let mk = |src: IpAddr, sp: u16| match kind {
                0 => build::tcp(MAC_A, MAC_B, src, sp, b, pb, 0x10, 1, 2, &payload),
                1 => build::udp(MAC_A, MAC_B, src, sp, b, pb, &payload),
                _ => build::icmp_echo(MAC_A, MAC_B, src, b, sp, 9, true, &payload),
            };
            let quote = [28, 48, 68, 2000][rng.below(4)];
            let mut e = error_about(&mk(a, pa), r, quote);
            let mut p = parsed(&e);
            let Some(mut i) = inner(&e, &p) else {
                continue;
            };
            // A NAT sends the error on to the real client: outer destination too.
            crate::rewrite::set_dst_ip(&mut e, &mut p, a2).unwrap();
            set_inner_ip(&mut e, &p, &mut i, Side::Src, a2).unwrap();
            if i.ports_present {
                set_inner_port(&mut e, &p, &mut i, Side::Src, pa2).unwrap();
                assert_eq!(
                    e,
                    error_about(&mk(a2, pa2), r, quote),
                    "kind {kind} quote {quote}"
                );
                assert_eq!(i.key, parsed(&mk(a2, pa2)).key);
                compared += 1;
            }
            assert!(l4_checksum_ok(&e, &p));
            assert!(crate::ipv4_header_ok(&e, &p));
            assert_eq!(inner(&e, &p), Some(i));
        }
        assert!(compared > 2_000, "only {compared} cases compared");
    }

    #[test]
    fn router_errors_quote_the_packet_and_refuse_what_rfc_1812_forbids() {
        let c: IpAddr = "10.0.0.1".parse().unwrap();
        let s: IpAddr = "10.0.9.9".parse().unwrap();
        let r = Ipv4Addr::new(10, 0, 0, 254);
        let big = vec![7u8; 1400];
        let orig = build::udp(MAC_A, MAC_B, c, 4000, s, 53, &big);
        let p = parsed(&orig);
        let e = build_v4(&orig, &p, MAC_B, r, 11, 0, [0, 0]).unwrap();
        let ep = parsed(&e);
        assert_eq!((ep.src, ep.dst, ep.icmp_type), (IpAddr::V4(r), c, 11));
        assert_eq!((ep.dst_mac, ep.src_mac), (MAC_A, MAC_B));
        assert_eq!(usize::from(ep.payload_len), MAX_QUOTE);
        assert!(l4_checksum_ok(&e, &ep) && crate::ipv4_header_ok(&e, &ep));
        let i = inner(&e, &ep).unwrap();
        assert_eq!(i.key, p.key);
        // Never about an ICMP error (here: the error just built).
        assert!(build_v4(&e, &ep, MAC_B, r, 11, 0, [0, 0]).is_none());
        // Never to a non-unicast source, nor for a frame sent to a multicast MAC.
        let bc = build::udp(
            MAC_A,
            MAC_B,
            "255.255.255.255".parse().unwrap(),
            1,
            s,
            2,
            b"",
        );
        assert!(!may_answer(&parsed(&bc)));
        let mut mc = orig.clone();
        mc[0] = 0x01;
        assert!(!may_answer(&parsed(&mc)));
        let (a6, b6) = ("fd00::1".parse().unwrap(), "fd00::2".parse().unwrap());
        assert!(!may_answer(&parsed(&build::udp(
            MAC_A, MAC_B, a6, 1, b6, 2, b""
        ))));
    }
}
