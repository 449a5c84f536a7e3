//! IPv4 header (RFC 791). The header checksum is deliberately not verified here: the kernel
//! already checked it on the way in, and verification costs a pass over the header per packet.
//! [`crate::ipv4_header_ok`] does it on demand.

use crate::{array, be16, err, ParseError, L3};
use std::net::{IpAddr, Ipv4Addr};

/// Minimum header length (IHL = 5).
pub const IPV4_HLEN: usize = 20;

pub(crate) fn parse(frame: &[u8], l3: usize) -> Result<L3, ParseError> {
    let h = frame.get(l3..).ok_or(err::TRUNC_IPV4)?;
    let Some(fixed) = array::<IPV4_HLEN>(h, 0) else {
        return Err(err::TRUNC_IPV4);
    };
    if fixed[0] >> 4 != 4 {
        return Err(err::BAD_IPV4_VERSION);
    }
    let ihl = usize::from(fixed[0] & 0x0f) * 4;
    if ihl < IPV4_HLEN {
        return Err(err::BAD_IPV4_IHL);
    }
    let total = usize::from(u16::from_be_bytes([fixed[2], fixed[3]]));
    if total < ihl {
        return Err(err::BAD_IPV4_LEN);
    }
    // Everything after `total` is Ethernet padding (or garbage) and is ignored.
    if total > h.len() {
        return Err(err::TRUNC_IPV4);
    }
    let frag = be16(h, 6).unwrap_or(0);
    let frag_off = frag & 0x1fff;
    let more = frag & 0x2000 != 0;
    Ok(L3 {
        src: IpAddr::V4(Ipv4Addr::new(fixed[12], fixed[13], fixed[14], fixed[15])),
        dst: IpAddr::V4(Ipv4Addr::new(fixed[16], fixed[17], fixed[18], fixed[19])),
        proto: fixed[9],
        ttl: fixed[8],
        l4_off: l3 + ihl,
        ip_end: l3 + total,
        fragment: frag_off != 0,
        more_fragments: frag_off == 0 && more,
    })
}
