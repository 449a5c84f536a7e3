//! Generic segmentation in software (what the kernel's `skb_gso_segment` does for TCP and
//! UDP_L4 super-frames): a router must do it when a super-frame's segments do not fit the
//! outgoing port (the kernel's `ip_finish_output_gso`), or when that port cannot take
//! super-frames at all. Each segment is an ordinary frame with complete checksums, because
//! the offload metadata (partial checksum, segment size) describes the super-frame only.

use crate::checksum::{l4_checksum, set_ipv4_header_checksum, udp_field};
use crate::{proto, Parsed};

/// How the super-frame is cut (the GSO type, reduced to what changes per segment).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// TCP (TSO v4/v6): sequence numbers advance, FIN/PSH only on the last segment, CWR only
    /// on the first.
    Tcp,
    /// UDP segmentation (UDP_L4): every segment is a datagram of its own.
    Udp,
}

/// Bound on the segments one super-frame may become. A legitimate 64 KiB TSO frame at the
/// smallest MSS Linux sends by default (536) is 123 segments; the bound is far above that,
/// but keeps a hostile super-frame with a tiny segment size (1 byte: 65k frames of ~60 bytes
/// each) from turning into megabytes of output per input frame.
pub const MAX_SEGMENTS: usize = 1024;

/// The super-frame would need more than [`MAX_SEGMENTS`] segments (the drop label).
pub const ERR_TOO_MANY: &str = "gso_too_big";
/// The frame does not match its GSO type (protocol, fragment, zero segment size, short
/// frame): the drop label.
pub const ERR_MALFORMED: &str = "gso_malformed";

/// Cuts the super-frame in `frame` (described by `p`) into frames of at most `seg_size`
/// payload bytes each. Every segment carries the super-frame's link-layer, IP (with its
/// options or IPv6 extension headers) and L4 headers (TCP options included), with its own
/// IP length, IPv4 id (`id + i`, as Linux does without fixed-id) and header checksum, its own
/// UDP length, TCP sequence number and flags, and a fully computed L4 checksum. A payload
/// that already fits comes back as one frame with its checksums completed.
pub fn segment(
    frame: &[u8],
    p: &Parsed,
    kind: Kind,
    seg_size: usize,
) -> Result<Vec<Vec<u8>>, &'static str> {
    let want = match kind {
        Kind::Tcp => proto::TCP,
        Kind::Udp => proto::UDP,
    };
    if p.proto != want || p.fragment || seg_size == 0 {
        return Err(ERR_MALFORMED);
    }
    let (l3, l4, pay, end) = (
        usize::from(p.l3_off),
        usize::from(p.l4_off),
        usize::from(p.payload_off),
        p.l4_end(),
    );
    let min_hdr = if p.src.is_ipv4() { 20 } else { 40 };
    let (Some(hdr), Some(data)) = (frame.get(..pay), frame.get(pay..end)) else {
        return Err(ERR_MALFORMED);
    };
    if l3 + min_hdr > l4 || l4 > pay {
        return Err(ERR_MALFORMED);
    }
    let n = data.len().div_ceil(seg_size).max(1);
    if n > MAX_SEGMENTS {
        return Err(ERR_TOO_MANY);
    }
    let id = u16::from_be_bytes([hdr[l3 + 4], hdr[l3 + 5]]);
    let seq = p.tcp_seq;
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let chunk = data.get(i * seg_size..((i + 1) * seg_size).min(data.len()));
        let chunk = chunk.unwrap_or(&[]);
        let mut f = Vec::with_capacity(pay + chunk.len());
        f.extend_from_slice(hdr);
        f.extend_from_slice(chunk);
        let last = i + 1 == n;
        if p.src.is_ipv4() {
            let h = &mut f[l3..l4];
            h[2..4].copy_from_slice(&((pay - l3 + chunk.len()) as u16).to_be_bytes());
            h[4..6].copy_from_slice(&id.wrapping_add(i as u16).to_be_bytes());
            set_ipv4_header_checksum(h);
        } else {
            let plen = (pay - l3 - 40 + chunk.len()) as u16;
            f[l3 + 4..l3 + 6].copy_from_slice(&plen.to_be_bytes());
        }
        let seg = &mut f[l4..];
        let field = match kind {
            Kind::Tcp => {
                let s = seq.wrapping_add((i * seg_size) as u32);
                seg[4..8].copy_from_slice(&s.to_be_bytes());
                if !last {
                    seg[13] &= !(FIN | PSH);
                }
                if i > 0 {
                    seg[13] &= !CWR;
                }
                16
            }
            Kind::Udp => {
                let len = (pay - l4 + chunk.len()) as u16;
                seg[4..6].copy_from_slice(&len.to_be_bytes());
                6
            }
        };
        seg[field..field + 2].fill(0);
        let c = l4_checksum(p.src, p.dst, p.proto, seg);
        let c = if kind == Kind::Udp { udp_field(c) } else { c };
        seg[field..field + 2].copy_from_slice(&c.to_be_bytes());
        out.push(f);
    }
    Ok(out)
}

const FIN: u8 = 0x01;
const PSH: u8 = 0x08;
const CWR: u8 = 0x80;

#[cfg(test)]
mod tests;
