//! The queued frames: which held connection a frame belongs to, and its TCP checksum.
//!
//! A frame is what the packet socket reads: loopback's Ethernet header (zero addresses) and
//! the IP packet. Loopback's own segments carry a partial checksum (the stack leaves the rest
//! to a "device" that never computes it and marks the packet as checked); written back through
//! a raw socket the packet is an ordinary one, checked by TCP, so the checksum is completed
//! here before it goes.

use std::net::{IpAddr, SocketAddr};

pub(super) const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const IPPROTO_TCP: u8 = 6;

/// A held connection as the BPF program keys it: client -> instance, addresses in 16 bytes
/// (IPv4 in the first 4), ports in network order. Layout = `struct hold_key` of
/// bpf/slice_hold.bpf.c.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub(super) struct Key {
    pub saddr: [u8; 16],
    pub daddr: [u8; 16],
    pub sport: u16,
    pub dport: u16,
    pub family: u8,
    pub pad: [u8; 3],
}

// SAFETY: plain old data, no padding (16+16+2+2+1+3 = 40, alignment 2).
unsafe impl aya::Pod for Key {}

fn addr16(ip: IpAddr) -> ([u8; 16], u8) {
    let mut a = [0u8; 16];
    match ip {
        IpAddr::V4(v) => {
            a[..4].copy_from_slice(&v.octets());
            (a, 4)
        }
        IpAddr::V6(v) => (v.octets(), 6),
    }
}

impl Key {
    /// The client's segments of the connection `local` (the instance) <-> `remote` (client).
    pub fn of(local: &SocketAddr, remote: &SocketAddr) -> Key {
        let (saddr, family) = addr16(remote.ip());
        let (daddr, _) = addr16(local.ip());
        Key {
            saddr,
            daddr,
            sport: remote.port().to_be(),
            dport: local.port().to_be(),
            family,
            pad: [0; 3],
        }
    }

    /// The key of a frame's TCP segment, and where its TCP header starts.
    pub fn of_frame(f: &[u8]) -> Option<(Key, usize)> {
        let proto = u16::from_be_bytes([*f.get(12)?, *f.get(13)?]);
        let ip = f.get(ETH_HLEN..)?;
        let mut k = Key::default();
        let l4 = match proto {
            ETH_P_IP if ip.len() >= 20 && ip[0] >> 4 == 4 && ip[9] == IPPROTO_TCP => {
                k.saddr[..4].copy_from_slice(&ip[12..16]);
                k.daddr[..4].copy_from_slice(&ip[16..20]);
                k.family = 4;
                usize::from(ip[0] & 0x0f) * 4
            }
            ETH_P_IPV6 if ip.len() >= 40 && ip[6] == IPPROTO_TCP => {
                k.saddr.copy_from_slice(&ip[8..24]);
                k.daddr.copy_from_slice(&ip[24..40]);
                k.family = 6;
                40
            }
            _ => return None,
        };
        let ports = ip.get(l4..l4 + 4)?;
        k.sport = u16::from_ne_bytes([ports[0], ports[1]]);
        k.dport = u16::from_ne_bytes([ports[2], ports[3]]);
        Some((k, ETH_HLEN + l4))
    }

    /// The instance's segments of the connection `local` (the instance) <-> `remote`
    /// (client): the other direction, which output commit holds back.
    pub fn output_of(local: &SocketAddr, remote: &SocketAddr) -> Key {
        Key::of(remote, local)
    }

    /// The other direction of the same connection.
    pub fn reversed(&self) -> Key {
        Key {
            saddr: self.daddr,
            daddr: self.saddr,
            sport: self.dport,
            dport: self.sport,
            ..*self
        }
    }

    pub fn describe(&self) -> String {
        let ip = |a: &[u8; 16]| -> IpAddr {
            if self.family == 4 {
                IpAddr::from([a[0], a[1], a[2], a[3]])
            } else {
                IpAddr::from(*a)
            }
        };
        format!(
            "{} -> {}",
            SocketAddr::new(ip(&self.saddr), u16::from_be(self.sport)),
            SocketAddr::new(ip(&self.daddr), u16::from_be(self.dport))
        )
    }
}

fn sum16(data: &[u8], mut acc: u64) -> u64 {
    let mut chunks = data.chunks_exact(2);
    for c in &mut chunks {
        acc += u64::from(u16::from_be_bytes([c[0], c[1]]));
    }
    if let [last] = chunks.remainder() {
        acc += u64::from(*last) << 8;
    }
    acc
}

fn fold(mut acc: u64) -> u16 {
    while acc >> 16 != 0 {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    !(acc as u16)
}

/// What output commit looks at in a TCP segment (sequence numbers in host order).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Segment {
    pub seq: u32,
    /// `seq` + payload length: the first byte after this segment's data.
    pub end: u32,
    /// Only meaningful with `ack_flag`.
    pub ack: u32,
    pub ack_flag: bool,
    pub rst: bool,
    pub fin: bool,
}

impl Segment {
    /// The first sequence number after this segment (a FIN takes one).
    pub fn end_with_fin(&self) -> u32 {
        self.end.wrapping_add(u32::from(self.fin))
    }
}

/// The TCP segment of a frame (TCP header at `l4`, as [`Key::of_frame`] gave it).
pub(crate) fn segment(frame: &[u8], l4: usize) -> Option<Segment> {
    let ip = frame.get(ETH_HLEN..)?;
    let th = frame.get(l4..l4 + 20)?;
    let iplen = if ip[0] >> 4 == 4 {
        match usize::from(u16::from_be_bytes([ip[2], ip[3]])) {
            0 => ip.len(), // a GSO packet too large for the field (BIG TCP)
            n => n,
        }
    } else {
        40 + usize::from(u16::from_be_bytes([ip[4], ip[5]]))
    };
    let hdrs = (l4 - ETH_HLEN) + usize::from(th[12] >> 4) * 4;
    let payload = iplen.saturating_sub(hdrs) as u32;
    let seq = u32::from_be_bytes([th[4], th[5], th[6], th[7]]);
    Some(Segment {
        seq,
        end: seq.wrapping_add(payload),
        ack: u32::from_be_bytes([th[8], th[9], th[10], th[11]]),
        ack_flag: th[13] & 0x10 != 0,
        rst: th[13] & 0x04 != 0,
        fin: th[13] & 0x01 != 0,
    })
}

/// `a` is at or after `b` in sequence space (RFC 793 arithmetic, modulo 2^32).
pub(crate) fn seq_ge(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) >= 0
}

/// Output commit's rule, the same as the BPF program's `commit_output`: a segment may leave
/// once the backup holds every byte it carries (`covered_seq`) and every byte it
/// acknowledges (`covered_ack`). A RST never may.
pub(crate) fn covered(s: &Segment, covered_seq: u32, covered_ack: u32) -> bool {
    !s.rst && seq_ge(covered_seq, s.end) && (!s.ack_flag || seq_ge(covered_ack, s.ack))
}

/// Completes the TCP checksum of `frame` (as [`Key::of_frame`] parsed it, TCP header at
/// `l4`). `false` when the IP lengths do not fit the frame.
pub(super) fn complete_tcp_checksum(frame: &mut [u8], l4: usize) -> bool {
    let ip = &frame[ETH_HLEN..];
    let (pseudo_len, end, v4) = if ip[0] >> 4 == 4 {
        let total = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
        (total.saturating_sub(l4 - ETH_HLEN), ETH_HLEN + total, true)
    } else {
        let payload = usize::from(u16::from_be_bytes([ip[4], ip[5]]));
        (payload, ETH_HLEN + 40 + payload, false)
    };
    if end > frame.len() || end < l4 + 20 {
        return false;
    }
    let mut acc = 0u64;
    if v4 {
        acc = sum16(&frame[ETH_HLEN + 12..ETH_HLEN + 20], acc);
    } else {
        acc = sum16(&frame[ETH_HLEN + 8..ETH_HLEN + 40], acc);
    }
    acc += u64::from(IPPROTO_TCP) + pseudo_len as u64;
    frame[l4 + 16] = 0;
    frame[l4 + 17] = 0;
    acc = sum16(&frame[l4..end], acc);
    let c = fold(acc);
    frame[l4 + 16..l4 + 18].copy_from_slice(&c.to_be_bytes());
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A loopback frame of one IPv4 TCP segment from 127.0.0.2:40000 to 127.0.0.1:80.
    fn frame_v4(payload: &[u8]) -> Vec<u8> {
        let mut f = vec![0u8; 12];
        f.extend_from_slice(&ETH_P_IP.to_be_bytes());
        let total = (20 + 20 + payload.len()) as u16;
        f.extend_from_slice(&[0x45, 0, 0, 0, 0, 0, 0x40, 0, 64, IPPROTO_TCP, 0, 0]);
        f[16..18].copy_from_slice(&total.to_be_bytes());
        f.extend_from_slice(&[127, 0, 0, 2, 127, 0, 0, 1]);
        let mut tcp = [0u8; 20];
        tcp[..2].copy_from_slice(&40000u16.to_be_bytes());
        tcp[2..4].copy_from_slice(&80u16.to_be_bytes());
        tcp[12] = 5 << 4;
        f.extend_from_slice(&tcp);
        f.extend_from_slice(payload);
        f
    }

    #[test]
    fn a_frame_keys_like_its_connection_and_its_checksum_verifies() {
        let mut f = frame_v4(b"hello, odd");
        let (k, l4) = Key::of_frame(&f).unwrap();
        let local: SocketAddr = "127.0.0.1:80".parse().unwrap();
        let remote: SocketAddr = "127.0.0.2:40000".parse().unwrap();
        assert_eq!(k, Key::of(&local, &remote));
        assert_eq!(k.describe(), "127.0.0.2:40000 -> 127.0.0.1:80");
        assert!(complete_tcp_checksum(&mut f, l4));
        // Summing a segment with its checksum in place gives 0 (folded: !0xffff).
        let mut acc = sum16(&f[14 + 12..14 + 20], 0) + 6 + (f.len() - l4) as u64;
        acc = sum16(&f[l4..], acc);
        assert_eq!(fold(acc), 0);
        // A frame that claims more than it has is refused.
        let short = f.len() - 3;
        assert!(!complete_tcp_checksum(&mut f[..short], l4));
    }

    #[test]
    fn output_commit_releases_a_segment_only_when_both_directions_are_covered() {
        let mut f = frame_v4(b"0123456789");
        let l4 = Key::of_frame(&f).unwrap().1;
        let seq = u32::MAX - 4; // the data wraps around 2^32
        f[l4 + 4..l4 + 8].copy_from_slice(&seq.to_be_bytes());
        f[l4 + 8..l4 + 12].copy_from_slice(&1000u32.to_be_bytes());
        f[l4 + 13] = 0x18; // PSH ACK
        let s = segment(&f, l4).unwrap();
        assert_eq!((s.seq, s.end, s.ack), (seq, 5, 1000));
        assert!(covered(&s, 5, 1000));
        assert!(covered(&s, 6, 2000));
        assert!(!covered(&s, 4, 1000), "a byte beyond the backup's copy");
        assert!(
            !covered(&s, u32::MAX, 1000),
            "before the wrap is before the end"
        );
        assert!(!covered(&s, 5, 999), "input the backup does not hold");
        // Without the ACK flag the acknowledgment field means nothing.
        f[l4 + 13] = 0x02;
        assert!(covered(&segment(&f, l4).unwrap(), 5, 0));
        // A RST never leaves, however covered.
        f[l4 + 13] = 0x14;
        assert!(!covered(&segment(&f, l4).unwrap(), 5, 1000));
        // The other direction's key is the output key.
        let (local, remote) = (
            "127.0.0.2:40000".parse().unwrap(),
            "127.0.0.1:80".parse().unwrap(),
        );
        assert_eq!(
            Key::of_frame(&f).unwrap().0,
            Key::output_of(&local, &remote)
        );
        assert!(segment(&f[..l4 + 10], l4).is_none());
    }

    #[test]
    fn the_key_layout_is_the_bpf_programs() {
        assert_eq!(std::mem::size_of::<Key>(), 40);
        let k6 = Key::of(&"[::1]:80".parse().unwrap(), &"[::2]:1".parse().unwrap());
        assert_eq!(k6.family, 6);
        assert_eq!(k6.sport.to_ne_bytes(), [0, 1]);
    }
}
