//! IPv4 fragmentation by a router (RFC 791 §3.2, RFC 1812 §5.2.6) and the "don't fragment"
//! facts the path-MTU logic needs (RFC 1191).

use crate::checksum::set_ipv4_header_checksum;
use crate::Parsed;

/// IPv4 DF flag of the frame's IP header (false for IPv6 or a short frame).
pub fn dont_fragment(frame: &[u8], p: &Parsed) -> bool {
    p.src.is_ipv4()
        && frame
            .get(usize::from(p.l3_off) + 6)
            .is_some_and(|b| b & 0x40 != 0)
}

/// Length of the IP packet (header included) `p` describes.
pub fn ip_len(p: &Parsed) -> usize {
    p.l4_end().saturating_sub(usize::from(p.l3_off))
}

/// Why a packet could not be fragmented (the drop reason label).
pub const ERR_DF: &str = "frag_needed";
pub const ERR_OPTIONS: &str = "frag_options_unsupported";
pub const ERR_NOT_V4: &str = "packet_too_big";

/// Splits the IPv4 packet in `frame` into frames whose IP packets fit `mtu`, each with the
/// same link-layer header (Ethernet, VLAN tags), offsets and MF set so that a fragment of a
/// fragment stays a valid piece of the original, and a correct header checksum. The L4
/// checksum must be complete (not an offload partial) beforehand. Err with the drop reason:
/// DF set, IPv6 (routers never fragment it), IP options (not copied selectively here), or an
/// MTU too small for 8 bytes of payload.
pub fn fragment_v4(frame: &[u8], p: &Parsed, mtu: usize) -> Result<Vec<Vec<u8>>, &'static str> {
    if !p.src.is_ipv4() {
        return Err(ERR_NOT_V4);
    }
    if dont_fragment(frame, p) {
        return Err(ERR_DF);
    }
    let l3 = usize::from(p.l3_off);
    let hl = usize::from(p.l4_off) - l3;
    if hl != 20 {
        return Err(ERR_OPTIONS);
    }
    let end = p.l4_end();
    let (Some(link), Some(hdr), Some(data)) = (
        frame.get(..l3),
        frame.get(l3..l3 + hl),
        frame.get(l3 + hl..end),
    ) else {
        return Err(ERR_NOT_V4);
    };
    let chunk = (mtu.saturating_sub(hl)) & !7;
    if chunk == 0 {
        return Err(ERR_DF);
    }
    let fo = u16::from_be_bytes([hdr[6], hdr[7]]);
    let (base, more) = (usize::from(fo & 0x1fff) * 8, fo & 0x2000 != 0);
    let mut out = Vec::with_capacity(data.len().div_ceil(chunk));
    let mut off = 0;
    while off < data.len() {
        let n = chunk.min(data.len() - off);
        let last = off + n == data.len();
        let mut f = Vec::with_capacity(l3 + hl + n);
        f.extend_from_slice(link);
        f.extend_from_slice(hdr);
        f.extend_from_slice(&data[off..off + n]);
        let h = &mut f[l3..l3 + hl];
        h[2..4].copy_from_slice(&((hl + n) as u16).to_be_bytes());
        let flags = if !last || more { 0x2000 } else { 0 };
        let word = flags | (((base + off) / 8) as u16 & 0x1fff);
        h[6..8].copy_from_slice(&word.to_be_bytes());
        set_ipv4_header_checksum(h);
        out.push(f);
        off += n;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::build::{self, MAC_A, MAC_B};
    use crate::testutil::parsed;

    fn clear_df(f: &mut [u8]) {
        let p = parsed(f);
        let l3 = usize::from(p.l3_off);
        f[l3 + 6] &= !0x40;
        set_ipv4_header_checksum(&mut f[l3..l3 + 20]);
    }

    #[test]
    fn fragments_fit_and_reassemble_to_the_original() {
        let payload: Vec<u8> = (0..2972u32).map(|i| (i * 7) as u8).collect();
        let mut f = build::udp(
            MAC_A,
            MAC_B,
            "10.0.0.1".parse().unwrap(),
            5,
            "10.0.0.2".parse().unwrap(),
            6,
            &payload,
        );
        let p = parsed(&f);
        assert!(dont_fragment(&f, &p));
        assert_eq!(fragment_v4(&f, &p, 1280), Err(ERR_DF));
        clear_df(&mut f);
        let p = parsed(&f);
        assert_eq!(ip_len(&p), 3000);
        let frags = fragment_v4(&f, &p, 1280).unwrap();
        assert_eq!(frags.len(), 3);
        let mut data = Vec::new();
        for (i, fr) in frags.iter().enumerate() {
            let q = parsed(fr);
            assert!(ip_len(&q) <= 1280);
            assert!(crate::ipv4_header_ok(fr, &q));
            let l3 = usize::from(q.l3_off);
            let fo = u16::from_be_bytes([fr[l3 + 6], fr[l3 + 7]]);
            assert_eq!(usize::from(fo & 0x1fff) * 8, data.len());
            assert_eq!(fo & 0x2000 != 0, i + 1 < frags.len());
            assert_eq!(i > 0, q.fragment);
            data.extend_from_slice(&fr[l3 + 20..l3 + ip_len(&q)]);
        }
        assert_eq!(data, f[34..34 + 2980]);
        // A fragment of a fragment keeps MF and its place in the original.
        let mid = &frags[1];
        let q = parsed(mid);
        let sub = fragment_v4(mid, &q, 600).unwrap();
        let l3 = usize::from(q.l3_off);
        for s in &sub {
            let fo = u16::from_be_bytes([s[l3 + 6], s[l3 + 7]]);
            assert!(fo & 0x2000 != 0);
            assert!(usize::from(fo & 0x1fff) * 8 >= 1256);
        }
    }
}
