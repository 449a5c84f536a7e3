//! `virtio_net_hdr`: the 10-byte offload descriptor AF_PACKET puts before each frame (and expects
//! before each transmitted frame) when `PACKET_VNET_HDR` is on.
//!
//! It says whether the L4 checksum is still to be completed (`NEEDS_CSUM` with the offsets of the
//! checksummed region and of the checksum field) and whether the frame is a GSO super-frame that
//! the kernel (or the peer) segments into `gso_size` pieces. Fields are little-endian on every
//! architecture we run on (virtio legacy on a little-endian host).

/// Size of `struct virtio_net_hdr` on the wire.
pub const VNET_HDR_LEN: usize = 10;

const F_NEEDS_CSUM: u8 = 1;
const F_DATA_VALID: u8 = 2;
const GSO_NONE: u8 = 0;
const GSO_TCPV4: u8 = 1;
const GSO_UDP: u8 = 3;
const GSO_TCPV6: u8 = 4;
const GSO_UDP_L4: u8 = 5;
const GSO_ECN: u8 = 0x80;

/// "Checksum still to be completed": the checksum covers bytes from `start` to the end of the
/// frame and is stored at `start + offset`; the field currently holds the pseudo-header sum.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CsumPartial {
    /// Offset from the start of the Ethernet frame where checksumming starts (the L4 header).
    pub start: u16,
    /// Offset of the checksum field from `start` (16 for TCP, 6 for UDP).
    pub offset: u16,
}

/// Kind of segmentation a GSO super-frame needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GsoKind {
    /// TCP over IPv4.
    TcpV4,
    /// TCP over IPv6.
    TcpV6,
    /// UDP fragmentation offload (legacy UFO).
    Udp,
    /// UDP segmentation (one datagram per segment).
    UdpL4,
}

/// A GSO super-frame: one frame that stands for several wire frames of `segment_size` payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gso {
    /// Segmentation kind.
    pub kind: GsoKind,
    /// Payload bytes per segment (the MSS for TCP).
    pub segment_size: u16,
    /// Length of the headers (Ethernet + IP + L4) replicated in each segment; a hint.
    pub header_len: u16,
    /// The TCP flow uses ECN (CWR must only be set on the first segment).
    pub ecn: bool,
}

/// Offload metadata of one frame (the content of its `virtio_net_hdr`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Offload {
    /// L4 checksum not finished (CHECKSUM_PARTIAL).
    pub csum_partial: Option<CsumPartial>,
    /// Checksum already verified by the kernel (VIRTIO_NET_HDR_F_DATA_VALID).
    pub csum_valid: bool,
    /// Segmentation still to be done.
    pub gso: Option<Gso>,
}

/// Why a `virtio_net_hdr` could not be decoded or encoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum VnetError {
    /// Fewer than 10 bytes available.
    #[error("virtio_net_hdr truncated")]
    Truncated,
    /// gso_type is not one we know.
    #[error("unknown virtio_net_hdr gso_type {0:#x}")]
    UnknownGso(u8),
    /// GSO with a zero segment size.
    #[error("GSO with zero segment size")]
    ZeroSegment,
    /// The checksum field would lie outside the frame.
    #[error("checksum offsets {start}+{offset} outside frame of {frame_len} bytes")]
    CsumOutside {
        /// csum_start
        start: u16,
        /// csum_offset
        offset: u16,
        /// frame length
        frame_len: usize,
    },
}

impl Offload {
    /// No offload: the frame is complete and at most MTU-sized.
    pub const NONE: Offload = Offload {
        csum_partial: None,
        csum_valid: false,
        gso: None,
    };

    /// True when nothing is offloaded.
    pub fn is_none(&self) -> bool {
        self.csum_partial.is_none() && self.gso.is_none()
    }

    /// Decodes a `virtio_net_hdr` (first 10 bytes of `bytes`).
    pub fn decode(bytes: &[u8]) -> Result<Offload, VnetError> {
        let h = bytes.get(..VNET_HDR_LEN).ok_or(VnetError::Truncated)?;
        let flags = h[0];
        let gso_type = h[1];
        let hdr_len = u16::from_le_bytes([h[2], h[3]]);
        let gso_size = u16::from_le_bytes([h[4], h[5]]);
        let csum_start = u16::from_le_bytes([h[6], h[7]]);
        let csum_offset = u16::from_le_bytes([h[8], h[9]]);
        let kind = match gso_type & !GSO_ECN {
            GSO_NONE => None,
            GSO_TCPV4 => Some(GsoKind::TcpV4),
            GSO_TCPV6 => Some(GsoKind::TcpV6),
            GSO_UDP => Some(GsoKind::Udp),
            GSO_UDP_L4 => Some(GsoKind::UdpL4),
            other => return Err(VnetError::UnknownGso(other)),
        };
        let gso = match kind {
            None => None,
            Some(kind) => {
                if gso_size == 0 {
                    return Err(VnetError::ZeroSegment);
                }
                Some(Gso {
                    kind,
                    segment_size: gso_size,
                    header_len: hdr_len,
                    ecn: gso_type & GSO_ECN != 0,
                })
            }
        };
        Ok(Offload {
            csum_partial: (flags & F_NEEDS_CSUM != 0).then_some(CsumPartial {
                start: csum_start,
                offset: csum_offset,
            }),
            csum_valid: flags & F_DATA_VALID != 0,
            gso,
        })
    }

    /// Checks the metadata against the frame it describes (what the kernel would refuse).
    pub fn validate(&self, frame_len: usize) -> Result<(), VnetError> {
        if let Some(c) = self.csum_partial {
            // The 2-byte checksum field must lie inside the frame.
            if usize::from(c.start) + usize::from(c.offset) + 2 > frame_len {
                return Err(VnetError::CsumOutside {
                    start: c.start,
                    offset: c.offset,
                    frame_len,
                });
            }
        }
        if let Some(g) = self.gso {
            if g.segment_size == 0 {
                return Err(VnetError::ZeroSegment);
            }
        }
        Ok(())
    }

    /// Encodes as a `virtio_net_hdr`.
    pub fn encode(&self) -> [u8; VNET_HDR_LEN] {
        let mut h = [0u8; VNET_HDR_LEN];
        let mut flags = 0;
        if let Some(c) = self.csum_partial {
            flags |= F_NEEDS_CSUM;
            h[6..8].copy_from_slice(&c.start.to_le_bytes());
            h[8..10].copy_from_slice(&c.offset.to_le_bytes());
        }
        if self.csum_valid {
            flags |= F_DATA_VALID;
        }
        h[0] = flags;
        if let Some(g) = self.gso {
            let t = match g.kind {
                GsoKind::TcpV4 => GSO_TCPV4,
                GsoKind::TcpV6 => GSO_TCPV6,
                GsoKind::Udp => GSO_UDP,
                GsoKind::UdpL4 => GSO_UDP_L4,
            };
            h[1] = t | if g.ecn { GSO_ECN } else { 0 };
            h[2..4].copy_from_slice(&g.header_len.to_le_bytes());
            h[4..6].copy_from_slice(&g.segment_size.to_le_bytes());
        }
        h
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_tcp4_gso_with_partial_csum() {
        let o = Offload {
            csum_partial: Some(CsumPartial {
                start: 34,
                offset: 16,
            }),
            csum_valid: false,
            gso: Some(Gso {
                kind: GsoKind::TcpV4,
                segment_size: 1448,
                header_len: 66,
                ecn: true,
            }),
        };
        let b = o.encode();
        assert_eq!(b[0], F_NEEDS_CSUM);
        assert_eq!(b[1], GSO_TCPV4 | GSO_ECN);
        assert_eq!(u16::from_le_bytes([b[4], b[5]]), 1448);
        assert_eq!(Offload::decode(&b), Ok(o));
    }

    #[test]
    fn none_encodes_to_zeroes_and_back() {
        assert_eq!(Offload::NONE.encode(), [0u8; VNET_HDR_LEN]);
        assert_eq!(Offload::decode(&[0u8; VNET_HDR_LEN]), Ok(Offload::NONE));
        assert!(Offload::NONE.is_none());
    }

    #[test]
    fn decode_rejects_bad_headers() {
        assert_eq!(Offload::decode(&[0u8; 9]), Err(VnetError::Truncated));
        let mut b = [0u8; VNET_HDR_LEN];
        b[1] = 9;
        assert_eq!(Offload::decode(&b), Err(VnetError::UnknownGso(9)));
        b[1] = GSO_TCPV6; // gso_size stays 0
        assert_eq!(Offload::decode(&b), Err(VnetError::ZeroSegment));
    }

    #[test]
    fn validate_checks_csum_field_inside_frame() {
        let o = Offload {
            csum_partial: Some(CsumPartial {
                start: 34,
                offset: 16,
            }),
            ..Offload::NONE
        };
        // The field occupies bytes 50..52.
        assert_eq!(
            o.validate(51),
            Err(VnetError::CsumOutside {
                start: 34,
                offset: 16,
                frame_len: 51
            })
        );
        assert!(o.validate(52).is_ok());
        assert!(o.validate(1514).is_ok());
    }
}
