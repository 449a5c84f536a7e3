//! Ethernet II header and up to two VLAN tags (802.1Q 0x8100, 802.1ad 0x88a8).

use crate::{array, be16, err, Mac, ParseError, ETHERTYPE_QINQ, ETHERTYPE_VLAN, ETH_HLEN};

/// Most VLAN tags accepted: single-tagged and QinQ. A deeper stack is refused rather than
/// walked, so the work per frame stays bounded.
pub const MAX_VLAN_TAGS: usize = 2;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Eth {
    pub dst: Mac,
    pub src: Mac,
    /// Outer VLAN id (12 bits), if tagged.
    pub vlan: Option<u16>,
    /// Ethertype after the VLAN tags.
    pub ethertype: u16,
    /// Offset of the L3 header.
    pub l3_off: usize,
}

pub(crate) fn parse(frame: &[u8]) -> Result<Eth, ParseError> {
    let (Some(dst), Some(src), Some(mut ethertype)) =
        (array::<6>(frame, 0), array::<6>(frame, 6), be16(frame, 12))
    else {
        return Err(err::TRUNC_ETH);
    };
    let mut off = ETH_HLEN;
    let mut vlan = None;
    let mut tags = 0;
    while ethertype == ETHERTYPE_VLAN || ethertype == ETHERTYPE_QINQ {
        if tags == MAX_VLAN_TAGS {
            return Err(err::BAD_VLAN_DEPTH);
        }
        // The tag is TCI (PCP/DEI/VID) then the next ethertype; `off` points at the TCI.
        let (Some(tci), Some(next)) = (be16(frame, off), be16(frame, off + 2)) else {
            return Err(err::TRUNC_VLAN);
        };
        if tags == 0 {
            vlan = Some(tci & 0x0fff);
        }
        ethertype = next;
        off += 4;
        tags += 1;
    }
    Ok(Eth {
        dst,
        src,
        vlan,
        ethertype,
        l3_off: off,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hdr(types: &[u16]) -> Vec<u8> {
        let mut f = vec![1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12];
        for (i, t) in types.iter().enumerate() {
            f.extend_from_slice(&t.to_be_bytes());
            if i + 1 < types.len() {
                // TCI: PCP 5 plus VID 100+i, to check PCP bits are masked off.
                f.extend_from_slice(&((5u16 << 13) | (100 + i as u16)).to_be_bytes());
            }
        }
        f
    }

    #[test]
    fn untagged() {
        let e = parse(&hdr(&[0x0800])).unwrap();
        assert_eq!(e.dst, [1, 2, 3, 4, 5, 6]);
        assert_eq!(e.src, [7, 8, 9, 10, 11, 12]);
        assert_eq!((e.vlan, e.ethertype, e.l3_off), (None, 0x0800, 14));
    }

    #[test]
    fn one_and_two_tags() {
        let e = parse(&hdr(&[0x8100, 0x86dd])).unwrap();
        assert_eq!((e.vlan, e.ethertype, e.l3_off), (Some(100), 0x86dd, 18));
        let e = parse(&hdr(&[0x88a8, 0x8100, 0x0800])).unwrap();
        assert_eq!((e.vlan, e.ethertype, e.l3_off), (Some(100), 0x0800, 22));
    }

    #[test]
    fn three_tags_refused() {
        let e = parse(&hdr(&[0x88a8, 0x8100, 0x8100, 0x0800])).unwrap_err();
        assert_eq!(e.reason(), "bad_vlan_depth");
    }

    #[test]
    fn truncation() {
        assert_eq!(parse(&[0u8; 13]).unwrap_err().reason(), "truncated_eth");
        let f = hdr(&[0x8100, 0x0800]);
        assert_eq!(parse(&f[..16]).unwrap_err().reason(), "truncated_vlan");
    }
}
