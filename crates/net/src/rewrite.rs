//! In-place header rewrites that keep every checksum correct incrementally (RFC 1624).
//!
//! Each function takes the frame and the [`Parsed`] that `parse` returned for it, changes one
//! field, updates the IPv4 header checksum and the L4 checksum by the difference only (a few
//! additions instead of a pass over the payload), and updates the `Parsed` too (including `key`
//! and `dir`), so an NF can chain rewrites and keep using it.
//!
//! Checksum rules applied:
//! - IPv4 header checksum: covers TTL and addresses.
//! - TCP/UDP (both families) and ICMPv6: the pseudo header covers the addresses, so an address
//!   change updates the L4 checksum as well; ports and the ICMP echo identifier are inside the
//!   L4 header itself.
//! - ICMP over IPv4 has no pseudo header: address changes do not touch it.
//! - UDP checksum 0 means "no checksum" (IPv4; for IPv6 it is invalid but left alone too) and
//!   stays 0; an updated UDP checksum that comes out 0 is written as 0xffff (RFC 768).
//! - Non-first fragments carry no L4 header: only the IP header is touched.
//!
//! **Checksum offload (CHECKSUM_PARTIAL).** A frame handed over with a partial checksum carries
//! in its TCP/UDP checksum field the *non-complemented* sum of the pseudo header only; the NIC
//! (or the kernel's software fallback) adds the L4 bytes later. For such frames pass
//! [`L4Csum::Partial`] to [`set_ip`] / [`set_port`]: an address change then updates the field
//! as `P' = P - old + new` (the same one's-complement arithmetic as RFC 1624, but without the
//! complement around it — plain eqn. 3 would move a partial sum the wrong way), and a port
//! change leaves the field alone (ports are not in the pseudo header; the device sums them).
//! Frames from AF_PACKET in pliant's set-up are fully checksummed, which is [`L4Csum::Full`],
//! the default of the short-hand functions.

use crate::checksum::{udp_field, update16, update_addr, update_addr_partial};
use crate::frame_csum::l4_csum_off;
use crate::{be16, proto, Mac, Parsed};
use std::net::IpAddr;

/// Why a rewrite was refused. The frame is unchanged when one of these is returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RewriteError {
    #[error("packet is IPv{packet} but the new address is IPv{new}")]
    FamilyMismatch { packet: u8, new: u8 },
    #[error("frame is shorter than its parsed offsets say (frame and Parsed do not match)")]
    FrameTooShort,
    #[error("protocol {0} has no ports or echo identifier to rewrite")]
    NoPorts(u8),
    #[error("non-first fragment has no L4 header to rewrite")]
    Fragment,
}

/// How the L4 checksum field of the frame is to be read (see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum L4Csum {
    /// A complete checksum (frames received from the wire / AF_PACKET).
    #[default]
    Full,
    /// A non-complemented pseudo-header sum awaiting completion by offload (CHECKSUM_PARTIAL).
    Partial,
}

/// Which end of the packet a rewrite applies to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Src,
    Dst,
}

/// Reads the checksum at `off`, applies `f`, writes it back (bounds already checked).
fn patch(frame: &mut [u8], off: usize, f: impl FnOnce(u16) -> u16) {
    if let Some(old) = be16(frame, off) {
        frame[off..off + 2].copy_from_slice(&f(old).to_be_bytes());
    }
}

/// Checks that every byte a rewrite may touch exists, so nothing is half-rewritten.
fn check_len(frame: &[u8], p: &Parsed, need_l3: usize) -> Result<(), RewriteError> {
    let l3_need = usize::from(p.l3_off) + need_l3;
    let l4_need = l4_csum_off(p).map_or(0, |o| o + 2);
    if frame.len() < l3_need.max(l4_need) {
        return Err(RewriteError::FrameTooShort);
    }
    Ok(())
}

/// Sets the source or destination address, updating the IPv4 header checksum and the L4
/// checksum (pseudo header) per `mode`.
pub fn set_ip(
    frame: &mut [u8],
    p: &mut Parsed,
    side: Side,
    addr: IpAddr,
    mode: L4Csum,
) -> Result<(), RewriteError> {
    let v4 = p.src.is_ipv4();
    if addr.is_ipv4() != v4 {
        let (packet, new) = if v4 { (4, 6) } else { (6, 4) };
        return Err(RewriteError::FamilyMismatch { packet, new });
    }
    let l3 = usize::from(p.l3_off);
    check_len(frame, p, if v4 { 20 } else { 40 })?;
    // The frame, not `p`, is the source of truth for the old bytes: if they ever disagreed,
    // updating by the bytes actually replaced keeps the checksums consistent with the frame.
    let old = match addr {
        IpAddr::V4(new) => {
            let off = l3 + if side == Side::Src { 12 } else { 16 };
            let mut o = [0u8; 4];
            o.copy_from_slice(&frame[off..off + 4]);
            frame[off..off + 4].copy_from_slice(&new.octets());
            let old = IpAddr::from(o);
            patch(frame, l3 + 10, |c| update_addr(c, old, addr));
            old
        }
        IpAddr::V6(new) => {
            let off = l3 + if side == Side::Src { 8 } else { 24 };
            let mut o = [0u8; 16];
            o.copy_from_slice(&frame[off..off + 16]);
            frame[off..off + 16].copy_from_slice(&new.octets());
            IpAddr::from(o)
        }
    };
    // ICMP over IPv4 has no pseudo header, so its checksum does not cover addresses.
    let pseudo = !(p.proto == proto::ICMP && v4);
    if let (Some(c), true) = (l4_csum_off(p), pseudo) {
        match (p.proto, mode) {
            (proto::TCP | proto::UDP, L4Csum::Partial) => {
                patch(frame, c, |f| update_addr_partial(f, old, addr))
            }
            (proto::UDP, L4Csum::Full) => patch(frame, c, |f| match f {
                0 => 0,
                f => udp_field(update_addr(f, old, addr)),
            }),
            _ => patch(frame, c, |f| update_addr(f, old, addr)),
        }
    }
    match side {
        Side::Src => p.src = addr,
        Side::Dst => p.dst = addr,
    }
    p.refresh_key();
    Ok(())
}

/// [`set_ip`] on the source address of a fully checksummed frame.
pub fn set_src_ip(frame: &mut [u8], p: &mut Parsed, addr: IpAddr) -> Result<(), RewriteError> {
    set_ip(frame, p, Side::Src, addr, L4Csum::Full)
}

/// [`set_ip`] on the destination address of a fully checksummed frame.
pub fn set_dst_ip(frame: &mut [u8], p: &mut Parsed, addr: IpAddr) -> Result<(), RewriteError> {
    set_ip(frame, p, Side::Dst, addr, L4Csum::Full)
}

/// Writes a 16-bit L4 header field at `field_off` and updates the L4 checksum for it.
fn set_l4_word(
    frame: &mut [u8],
    p: &Parsed,
    field_off: usize,
    new: u16,
    mode: L4Csum,
) -> Result<(), RewriteError> {
    let Some(csum_off) = l4_csum_off(p) else {
        return Err(if p.fragment {
            RewriteError::Fragment
        } else {
            RewriteError::NoPorts(p.proto)
        });
    };
    check_len(frame, p, 0)?;
    let Some(old) = be16(frame, field_off) else {
        return Err(RewriteError::FrameTooShort);
    };
    frame[field_off..field_off + 2].copy_from_slice(&new.to_be_bytes());
    let partial = mode == L4Csum::Partial && matches!(p.proto, proto::TCP | proto::UDP);
    if !partial {
        patch(frame, csum_off, |f| match p.proto {
            proto::UDP if f == 0 => 0,
            proto::UDP => udp_field(update16(f, old, new)),
            _ => update16(f, old, new),
        });
        // ICMPv4 has no pseudo header: an all-zero message sums to +0, whose checksum is
        // 0xffff, but the incremental update yields the other zero, 0x0000, which does not
        // verify. Only then (rare) is the message scanned.
        if p.proto == proto::ICMP && be16(frame, csum_off) == Some(0) {
            let seg = frame.get(usize::from(p.l4_off)..p.l4_end()).unwrap_or(&[]);
            if seg.iter().all(|b| *b == 0) {
                frame[csum_off..csum_off + 2].copy_from_slice(&0xffffu16.to_be_bytes());
            }
        }
    }
    Ok(())
}

/// Sets the source or destination port of a TCP/UDP packet. For an ICMP/ICMPv6 echo, where
/// both "ports" are the identifier, either side sets the identifier (see [`set_icmp_id`]), so a
/// NAT can treat echo like a port-based protocol. Other packets: [`RewriteError::NoPorts`].
pub fn set_port(
    frame: &mut [u8],
    p: &mut Parsed,
    side: Side,
    port: u16,
    mode: L4Csum,
) -> Result<(), RewriteError> {
    if p.fragment {
        return Err(RewriteError::Fragment);
    }
    match p.proto {
        proto::TCP | proto::UDP => {
            let off = usize::from(p.l4_off) + if side == Side::Src { 0 } else { 2 };
            set_l4_word(frame, p, off, port, mode)?;
            match side {
                Side::Src => p.sport = port,
                Side::Dst => p.dport = port,
            }
            p.refresh_key();
            Ok(())
        }
        _ if p.is_icmp_echo() => set_icmp_id(frame, p, port),
        other => Err(RewriteError::NoPorts(other)),
    }
}

/// [`set_port`] on the source port of a fully checksummed frame.
pub fn set_src_port(frame: &mut [u8], p: &mut Parsed, port: u16) -> Result<(), RewriteError> {
    set_port(frame, p, Side::Src, port, L4Csum::Full)
}

/// [`set_port`] on the destination port of a fully checksummed frame.
pub fn set_dst_port(frame: &mut [u8], p: &mut Parsed, port: u16) -> Result<(), RewriteError> {
    set_port(frame, p, Side::Dst, port, L4Csum::Full)
}

/// Sets the identifier of an ICMP/ICMPv6 echo request or reply (and `p.sport`/`p.dport`).
pub fn set_icmp_id(frame: &mut [u8], p: &mut Parsed, id: u16) -> Result<(), RewriteError> {
    if !p.is_icmp_echo() {
        return Err(if p.fragment {
            RewriteError::Fragment
        } else {
            RewriteError::NoPorts(p.proto)
        });
    }
    set_l4_word(frame, p, usize::from(p.l4_off) + 4, id, L4Csum::Full)?;
    p.sport = id;
    p.dport = id;
    p.refresh_key();
    Ok(())
}

/// Decrements the IPv4 TTL / IPv6 hop limit (fixing the IPv4 header checksum). Returns false,
/// leaving the frame unchanged, when the packet must not be forwarded: the TTL would reach 0
/// (the caller drops it, or answers with ICMP time exceeded), or `frame` is shorter than `p`.
pub fn dec_ttl(frame: &mut [u8], p: &mut Parsed) -> bool {
    let l3 = usize::from(p.l3_off);
    let v4 = p.src.is_ipv4();
    let ttl_off = l3 + if v4 { 8 } else { 7 };
    let Some(&ttl) = frame.get(ttl_off) else {
        return false;
    };
    if ttl <= 1 || (v4 && frame.len() < l3 + 20) {
        return false;
    }
    frame[ttl_off] = ttl - 1;
    if v4 {
        // TTL shares a 16-bit word with the protocol byte.
        let pr = u16::from(frame[l3 + 9]);
        let old = (u16::from(ttl) << 8) | pr;
        let new = (u16::from(ttl - 1) << 8) | pr;
        patch(frame, l3 + 10, |c| update16(c, old, new));
    }
    p.ttl = ttl - 1;
    true
}

/// Sets the Ethernet source MAC (no checksum covers it).
pub fn set_src_mac(frame: &mut [u8], p: &mut Parsed, mac: Mac) -> Result<(), RewriteError> {
    frame
        .get_mut(6..12)
        .ok_or(RewriteError::FrameTooShort)?
        .copy_from_slice(&mac);
    p.src_mac = mac;
    Ok(())
}

/// Sets the Ethernet destination MAC (no checksum covers it).
pub fn set_dst_mac(frame: &mut [u8], p: &mut Parsed, mac: Mac) -> Result<(), RewriteError> {
    frame
        .get_mut(0..6)
        .ok_or(RewriteError::FrameTooShort)?
        .copy_from_slice(&mac);
    p.dst_mac = mac;
    Ok(())
}
