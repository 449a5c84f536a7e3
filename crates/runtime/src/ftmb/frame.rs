//! How a packet travels through the FTMB logs: the input record (`LogMsg::Input`, replayed by a
//! standby) and the output payload (released by the logger, transmitted by whichever engine
//! hosts the logger) both carry the frame together with what the engine needs to send or
//! re-process it: the sides and the offload state. Opaque to pliant-ftmb.
//!
//! Layout (little-endian), [`HEADER_LEN`] bytes then the Ethernet frame:
//! `version u8 | ingress u8 | egress u8 | flags u8 | csum_start u16 | csum_offset u16 |
//!  gso_kind u8 | gso_segment u16 | gso_header_len u16 | reserved u8 | frame...`
//! flags: bit 0 partial checksum present, bit 1 GSO present, bit 2 checksum valid, bit 3 GSO
//! with ECN. The receiving side re-parses the frame (the NF keeps `meta` in sync with `buf`, so
//! parsing the bytes gives the same `Parsed`).

use crate::nf::{Packet, Side};
use pliant_io::{CsumPartial, Gso, GsoKind, Offload};
use pliant_net::Frame;

const VERSION: u8 = 1;
pub const HEADER_LEN: usize = 14;
const F_CSUM: u8 = 1;
const F_GSO: u8 = 2;
const F_VALID: u8 = 4;
const F_ECN: u8 = 8;

/// Why a logged payload could not be turned back into a packet.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("payload of {0} bytes is shorter than the {HEADER_LEN}-byte header")]
    Short(usize),
    #[error("payload version {0}, expected {VERSION}")]
    Version(u8),
    #[error("bad side byte {0}")]
    Side(u8),
    #[error("bad GSO kind {0}")]
    Gso(u8),
    #[error("the frame does not parse as IP: {0}")]
    NotIp(String),
}

impl FrameError {
    /// Stable drop-counter label.
    pub fn reason(&self) -> &'static str {
        match self {
            FrameError::NotIp(_) => "ftmb_frame_not_ip",
            _ => "ftmb_frame_malformed",
        }
    }
}

fn side_byte(s: Side) -> u8 {
    match s {
        Side::Inside => 0,
        Side::Outside => 1,
    }
}

fn side_of(b: u8) -> Result<Side, FrameError> {
    match b {
        0 => Ok(Side::Inside),
        1 => Ok(Side::Outside),
        _ => Err(FrameError::Side(b)),
    }
}

fn gso_byte(k: GsoKind) -> u8 {
    match k {
        GsoKind::TcpV4 => 0,
        GsoKind::TcpV6 => 1,
        GsoKind::Udp => 2,
        GsoKind::UdpL4 => 3,
    }
}

fn gso_of(b: u8) -> Result<GsoKind, FrameError> {
    Ok(match b {
        0 => GsoKind::TcpV4,
        1 => GsoKind::TcpV6,
        2 => GsoKind::Udp,
        3 => GsoKind::UdpL4,
        _ => return Err(FrameError::Gso(b)),
    })
}

/// Encodes `pkt` (its sides, offload state and frame bytes) for a log record.
pub fn encode(pkt: &Packet) -> Vec<u8> {
    let o = &pkt.offload;
    let mut flags = 0;
    let (cs, co) = o.csum_partial.map_or((0, 0), |c| {
        flags |= F_CSUM;
        (c.start, c.offset)
    });
    let (gk, gs, gh) = o.gso.map_or((0, 0, 0), |g| {
        flags |= F_GSO;
        if g.ecn {
            flags |= F_ECN;
        }
        (gso_byte(g.kind), g.segment_size, g.header_len)
    });
    if o.csum_valid {
        flags |= F_VALID;
    }
    let mut v = Vec::with_capacity(HEADER_LEN + pkt.buf.len());
    v.extend_from_slice(&[
        VERSION,
        side_byte(pkt.ingress),
        side_byte(pkt.egress),
        flags,
    ]);
    v.extend_from_slice(&cs.to_le_bytes());
    v.extend_from_slice(&co.to_le_bytes());
    v.push(gk);
    v.extend_from_slice(&gs.to_le_bytes());
    v.extend_from_slice(&gh.to_le_bytes());
    v.push(0);
    debug_assert_eq!(v.len(), HEADER_LEN);
    v.extend_from_slice(&pkt.buf);
    v
}

/// Output payload of a packet the NF wrote (same layout as input records).
pub fn encode_output(pkt: &Packet) -> Vec<u8> {
    encode(pkt)
}

/// Decodes a payload made by [`encode`] back into a packet (the frame is re-parsed).
pub fn decode(payload: &[u8]) -> Result<Packet, FrameError> {
    decode_owned(payload.to_vec())
}

/// [`decode`] of a payload the caller owns: the frame keeps the payload's allocation (the
/// header is cut off in place) instead of being copied into a new one, once per released
/// packet on the engine's thread.
pub fn decode_owned(mut payload: Vec<u8>) -> Result<Packet, FrameError> {
    let (ingress, egress, offload) = header(&payload)?;
    payload.drain(..HEADER_LEN);
    let buf = payload;
    let meta = match pliant_net::parse(&buf) {
        Ok(Frame::Ip(p)) => p,
        Ok(_) => return Err(FrameError::NotIp("not an IP frame".into())),
        Err(e) => return Err(FrameError::NotIp(e.to_string())),
    };
    Ok(Packet {
        buf,
        ingress,
        egress,
        meta,
        offload,
    })
}

/// The sides and offload state from a payload's header.
fn header(payload: &[u8]) -> Result<(Side, Side, Offload), FrameError> {
    let Some(h) = payload.get(..HEADER_LEN) else {
        return Err(FrameError::Short(payload.len()));
    };
    if h[0] != VERSION {
        return Err(FrameError::Version(h[0]));
    }
    let ingress = side_of(h[1])?;
    let egress = side_of(h[2])?;
    let flags = h[3];
    let u16_at = |i: usize| u16::from_le_bytes([h[i], h[i + 1]]);
    let mut offload = Offload::NONE;
    if flags & F_CSUM != 0 {
        offload.csum_partial = Some(CsumPartial {
            start: u16_at(4),
            offset: u16_at(6),
        });
    }
    if flags & F_GSO != 0 {
        offload.gso = Some(Gso {
            kind: gso_of(h[8])?,
            segment_size: u16_at(9),
            header_len: u16_at(11),
            ecn: flags & F_ECN != 0,
        });
    }
    offload.csum_valid = flags & F_VALID != 0;
    Ok((ingress, egress, offload))
}

#[cfg(test)]
mod tests {
    use super::*;
    use pliant_net::build;

    fn pkt() -> Packet {
        let f = build::udp(
            [2, 0, 0, 0, 0, 1],
            [2, 0, 0, 0, 0, 2],
            "10.0.1.2".parse().unwrap(),
            1000,
            "10.0.2.2".parse().unwrap(),
            53,
            b"hello",
        );
        let meta = match pliant_net::parse(&f) {
            Ok(Frame::Ip(p)) => p,
            other => panic!("{other:?}"),
        };
        Packet::new(f, Side::Inside, meta)
    }

    #[test]
    fn round_trips_sides_offload_and_frame() {
        let mut p = pkt();
        p.egress = Side::Inside; // a reflected packet (e.g. an ICMP error) keeps its egress
        p.offload = Offload {
            csum_partial: Some(CsumPartial {
                start: 34,
                offset: 6,
            }),
            csum_valid: true,
            gso: Some(Gso {
                kind: GsoKind::UdpL4,
                segment_size: 1400,
                header_len: 42,
                ecn: true,
            }),
        };
        let b = encode_output(&p);
        let back = decode(&b).unwrap();
        assert_eq!(back.buf, p.buf);
        assert_eq!(
            (back.ingress, back.egress, back.offload),
            (Side::Inside, Side::Inside, p.offload)
        );
        assert_eq!(back.meta, p.meta);
        let owned = decode_owned(b).unwrap();
        assert_eq!(
            (owned.buf, owned.meta, owned.offload),
            (back.buf, back.meta, back.offload)
        );
        let plain = decode(&encode(&pkt())).unwrap();
        assert_eq!(plain.offload, Offload::NONE);
        assert_eq!(plain.egress, Side::Outside);
    }

    #[test]
    fn malformed_payloads_are_refused_not_panicked_on() {
        let b = encode(&pkt());
        assert_eq!(decode(&b[..5]).err(), Some(FrameError::Short(5)));
        let mut v = b.clone();
        v[0] = 9;
        assert_eq!(decode(&v).err(), Some(FrameError::Version(9)));
        let mut v = b.clone();
        v[2] = 7;
        assert_eq!(decode(&v).err(), Some(FrameError::Side(7)));
        let mut v = b.clone();
        v[3] |= F_GSO;
        v[8] = 200;
        assert_eq!(decode(&v).err(), Some(FrameError::Gso(200)));
        let Err(e) = decode(&b[..HEADER_LEN + 10]) else {
            panic!("a cut frame decoded");
        };
        assert_eq!(e.reason(), "ftmb_frame_not_ip");
        assert_eq!(
            decode_owned(b[..3].to_vec()).err(),
            Some(FrameError::Short(3))
        );
    }
}
