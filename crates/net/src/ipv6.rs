//! IPv6 header (RFC 8200) and the extension headers pliant skips to reach L4: hop-by-hop (0),
//! routing (43), fragment (44) and destination options (60).

use crate::{array, be16, err, ParseError, L3};
use std::net::{IpAddr, Ipv6Addr};

pub const IPV6_HLEN: usize = 40;

/// Most extension headers walked before giving up: a legitimate packet has at most a handful
/// (RFC 8200 §4.1 lists each at most once or twice), and the bound keeps per-packet work fixed.
pub const MAX_EXT_HEADERS: usize = 8;

const NH_HOP_BY_HOP: u8 = 0;
const NH_ROUTING: u8 = 43;
const NH_FRAGMENT: u8 = 44;
const NH_DEST_OPTS: u8 = 60;

pub(crate) fn parse(frame: &[u8], l3: usize) -> Result<L3, ParseError> {
    let h = frame.get(l3..).ok_or(err::TRUNC_IPV6)?;
    let Some(fixed) = array::<IPV6_HLEN>(h, 0) else {
        return Err(err::TRUNC_IPV6);
    };
    if fixed[0] >> 4 != 6 {
        return Err(err::BAD_IPV6_VERSION);
    }
    let payload_len = usize::from(u16::from_be_bytes([fixed[4], fixed[5]]));
    // Jumbograms (payload length 0 + a hop-by-hop jumbo option) are not supported: such a
    // packet parses as having an empty payload, and its L4 header then reads as truncated.
    let end = IPV6_HLEN + payload_len;
    if end > h.len() {
        return Err(err::TRUNC_IPV6);
    }
    let h = &h[..end];
    let mut src = [0u8; 16];
    let mut dst = [0u8; 16];
    src.copy_from_slice(&fixed[8..24]);
    dst.copy_from_slice(&fixed[24..40]);

    let mut nh = fixed[6];
    let mut off = IPV6_HLEN;
    let mut fragment = false;
    let mut more_fragments = false;
    let mut walked = 0;
    loop {
        match nh {
            NH_HOP_BY_HOP | NH_ROUTING | NH_DEST_OPTS => {
                let (Some(&next), Some(&len8)) = (h.get(off), h.get(off + 1)) else {
                    return Err(err::TRUNC_IPV6_EXT);
                };
                let len = (usize::from(len8) + 1) * 8;
                if off + len > h.len() {
                    return Err(err::TRUNC_IPV6_EXT);
                }
                nh = next;
                off += len;
            }
            NH_FRAGMENT => {
                let (Some(&next), Some(fo)) = (h.get(off), be16(h, off + 2)) else {
                    return Err(err::TRUNC_IPV6_EXT);
                };
                if off + 8 > h.len() {
                    return Err(err::TRUNC_IPV6_EXT);
                }
                nh = next;
                off += 8;
                if fo >> 3 != 0 {
                    // Non-first fragment: what follows is the middle of some upper-layer
                    // data, not a header; stop here and report the protocol it belongs to.
                    fragment = true;
                    break;
                }
                more_fragments = fo & 1 != 0;
            }
            _ => break,
        }
        walked += 1;
        if walked > MAX_EXT_HEADERS {
            return Err(err::BAD_IPV6_EXT);
        }
    }
    Ok(L3 {
        src: IpAddr::V6(Ipv6Addr::from(src)),
        dst: IpAddr::V6(Ipv6Addr::from(dst)),
        proto: nh,
        ttl: fixed[7],
        l4_off: l3 + off,
        ip_end: l3 + end,
        fragment,
        more_fragments,
    })
}
