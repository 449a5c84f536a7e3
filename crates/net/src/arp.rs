//! ARP for Ethernet/IPv4 (RFC 826): parsing and building requests and replies.
//!
//! Builders write into a caller's buffer ([`write()`]) so a runtime can answer ARP from a
//! preallocated frame; [`request`] and [`reply`] are allocating conveniences.

use crate::{array, be16, err, ArpInfo, Mac, ParseError, ETHERTYPE_ARP, ETHERTYPE_IPV4};
use crate::{ETHERTYPE_VLAN, ETH_HLEN};
use std::net::Ipv4Addr;

pub const OP_REQUEST: u16 = 1;
pub const OP_REPLY: u16 = 2;
/// Length of an Ethernet/IPv4 ARP body.
pub const ARP_LEN: usize = 28;
/// Frames are padded to the Ethernet minimum (without FCS) so any receiver accepts them.
pub const MIN_FRAME: usize = 60;
/// Largest frame [`write()`] produces (VLAN tag, no padding needed beyond the minimum).
pub const MAX_ARP_FRAME: usize = MIN_FRAME + 4;

pub(crate) fn parse(frame: &[u8], off: usize, vlan: Option<u16>) -> Result<ArpInfo, ParseError> {
    let b = frame.get(off..).ok_or(err::TRUNC_ARP)?;
    let Some(a) = array::<ARP_LEN>(b, 0) else {
        return Err(err::TRUNC_ARP);
    };
    let htype = u16::from_be_bytes([a[0], a[1]]);
    let ptype = u16::from_be_bytes([a[2], a[3]]);
    if htype != 1 || ptype != ETHERTYPE_IPV4 || a[4] != 6 || a[5] != 4 {
        return Err(err::BAD_ARP);
    }
    let op = be16(&a, 6).unwrap_or(0);
    if op != OP_REQUEST && op != OP_REPLY {
        return Err(err::BAD_ARP_OP);
    }
    let mac = |o: usize| array::<6>(&a, o).unwrap_or_default();
    let ip = |o: usize| Ipv4Addr::new(a[o], a[o + 1], a[o + 2], a[o + 3]);
    Ok(ArpInfo {
        op,
        sender_mac: mac(8),
        sender_ip: ip(14),
        target_mac: mac(18),
        target_ip: ip(24),
        vlan,
    })
}

/// Writes an ARP frame for `info` into `buf` and returns its length (60, or 64 with a VLAN
/// tag), or `None` if `buf` is shorter than that. The Ethernet destination is broadcast for a
/// request and `info.target_mac` for a reply; the source is `info.sender_mac`.
pub fn write(buf: &mut [u8], info: &ArpInfo) -> Option<usize> {
    let tag = if info.vlan.is_some() { 4 } else { 0 };
    let len = MIN_FRAME + tag;
    let out = buf.get_mut(..len)?;
    out.fill(0);
    let eth_dst = if info.op == OP_REQUEST {
        [0xff; 6]
    } else {
        info.target_mac
    };
    out[0..6].copy_from_slice(&eth_dst);
    out[6..12].copy_from_slice(&info.sender_mac);
    let mut off = 12;
    if let Some(vid) = info.vlan {
        out[12..14].copy_from_slice(&ETHERTYPE_VLAN.to_be_bytes());
        out[14..16].copy_from_slice(&(vid & 0x0fff).to_be_bytes());
        off += 4;
    }
    out[off..off + 2].copy_from_slice(&ETHERTYPE_ARP.to_be_bytes());
    let a = &mut out[off + 2..off + 2 + ARP_LEN];
    a[0..2].copy_from_slice(&1u16.to_be_bytes());
    a[2..4].copy_from_slice(&ETHERTYPE_IPV4.to_be_bytes());
    a[4] = 6;
    a[5] = 4;
    a[6..8].copy_from_slice(&info.op.to_be_bytes());
    a[8..14].copy_from_slice(&info.sender_mac);
    a[14..18].copy_from_slice(&info.sender_ip.octets());
    a[18..24].copy_from_slice(&info.target_mac);
    a[24..28].copy_from_slice(&info.target_ip.octets());
    debug_assert!(off + 2 + ARP_LEN <= len && ETH_HLEN + ARP_LEN <= MIN_FRAME);
    Some(len)
}

fn to_vec(info: &ArpInfo) -> Vec<u8> {
    let mut buf = [0u8; MAX_ARP_FRAME];
    // `buf` is MAX_ARP_FRAME long, which `write` always fits in.
    let n = write(&mut buf, info).unwrap_or(0);
    buf[..n].to_vec()
}

/// "Who has `target_ip`? Tell `sender_ip`" (broadcast, target MAC zero).
pub fn request(
    sender_mac: Mac,
    sender_ip: Ipv4Addr,
    target_ip: Ipv4Addr,
    vlan: Option<u16>,
) -> Vec<u8> {
    to_vec(&ArpInfo {
        op: OP_REQUEST,
        sender_mac,
        sender_ip,
        target_mac: [0; 6],
        target_ip,
        vlan,
    })
}

/// "`sender_ip` is at `sender_mac`", sent to `target_mac`/`target_ip` (the requester).
pub fn reply(
    sender_mac: Mac,
    sender_ip: Ipv4Addr,
    target_mac: Mac,
    target_ip: Ipv4Addr,
    vlan: Option<u16>,
) -> Vec<u8> {
    to_vec(&ArpInfo {
        op: OP_REPLY,
        sender_mac,
        sender_ip,
        target_mac,
        target_ip,
        vlan,
    })
}

/// The reply to a parsed request `req` asking for an address we own at `our_mac`; `None` if
/// `req` is not a request. The reply keeps the request's VLAN.
pub fn reply_to(req: &ArpInfo, our_mac: Mac) -> Option<Vec<u8>> {
    (req.op == OP_REQUEST).then(|| {
        reply(
            our_mac,
            req.target_ip,
            req.sender_mac,
            req.sender_ip,
            req.vlan,
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{parse as parse_frame, Frame};

    const ME: Mac = [2, 0, 0, 0, 0, 1];
    const PEER: Mac = [2, 0, 0, 0, 0, 2];

    fn arp_of(f: &[u8]) -> ArpInfo {
        match parse_frame(f) {
            Ok(Frame::Arp(a)) => a,
            other => panic!("not ARP: {other:?}"),
        }
    }

    #[test]
    fn request_round_trip() {
        let f = request(
            PEER,
            Ipv4Addr::new(10, 0, 0, 2),
            Ipv4Addr::new(10, 0, 0, 1),
            None,
        );
        assert_eq!(f.len(), 60);
        assert_eq!(&f[0..6], &[0xff; 6]);
        let a = arp_of(&f);
        assert_eq!(a.op, OP_REQUEST);
        assert_eq!(a.sender_mac, PEER);
        assert_eq!(a.sender_ip, Ipv4Addr::new(10, 0, 0, 2));
        assert_eq!(a.target_ip, Ipv4Addr::new(10, 0, 0, 1));
        assert_eq!(a.vlan, None);
    }

    #[test]
    fn reply_to_request_with_vlan() {
        let f = request(
            PEER,
            Ipv4Addr::new(10, 0, 0, 2),
            Ipv4Addr::new(10, 0, 0, 1),
            Some(42),
        );
        assert_eq!(f.len(), 64);
        let req = arp_of(&f);
        assert_eq!(req.vlan, Some(42));
        let r = reply_to(&req, ME).unwrap();
        assert_eq!(&r[0..6], &PEER);
        let a = arp_of(&r);
        assert_eq!(a.op, OP_REPLY);
        assert_eq!(
            (a.sender_mac, a.sender_ip),
            (ME, Ipv4Addr::new(10, 0, 0, 1))
        );
        assert_eq!(
            (a.target_mac, a.target_ip),
            (PEER, Ipv4Addr::new(10, 0, 0, 2))
        );
        assert_eq!(a.vlan, Some(42));
        assert!(reply_to(&a, ME).is_none());
    }

    #[test]
    fn bad_arp() {
        let mut f = request(
            PEER,
            Ipv4Addr::new(10, 0, 0, 2),
            Ipv4Addr::new(10, 0, 0, 1),
            None,
        );
        assert_eq!(
            parse_frame(&f[..14 + 27]).unwrap_err().reason(),
            "truncated_arp"
        );
        f[14 + 7] = 3;
        assert_eq!(parse_frame(&f).unwrap_err().reason(), "bad_arp_op");
        f[14 + 2] = 0x86;
        assert_eq!(parse_frame(&f).unwrap_err().reason(), "bad_arp");
    }

    #[test]
    fn write_needs_room() {
        let info = arp_of(&request(
            PEER,
            Ipv4Addr::LOCALHOST,
            Ipv4Addr::LOCALHOST,
            None,
        ));
        assert_eq!(write(&mut [0u8; 59], &info), None);
        assert_eq!(write(&mut [0u8; 100], &info), Some(60));
    }
}
