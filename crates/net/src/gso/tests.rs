//! Segments are checked against the original with a checksum written independently here
//! (plain 16-bit word sum over the pseudo-header and the segment), not with `crate::checksum`.

use super::*;
use crate::build::{self, MAC_A, MAC_B};
use crate::testutil::{parsed, Rng};
use std::net::IpAddr;

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

/// One's-complement sum of the concatenated parts, folded (0xffff when a checksum verifies).
fn word_sum(parts: &[&[u8]]) -> u16 {
    let bytes: Vec<u8> = parts.concat();
    let mut acc: u64 = 0;
    for w in bytes.chunks(2) {
        acc += u64::from(w[0]) << 8 | u64::from(*w.get(1).unwrap_or(&0));
    }
    while acc > 0xffff {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    acc as u16
}

fn pseudo(src: IpAddr, dst: IpAddr, proto: u8, len: usize) -> Vec<u8> {
    let mut v = Vec::new();
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            v.extend_from_slice(&s.octets());
            v.extend_from_slice(&d.octets());
            v.extend_from_slice(&[0, proto]);
            v.extend_from_slice(&(len as u16).to_be_bytes());
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            v.extend_from_slice(&s.octets());
            v.extend_from_slice(&d.octets());
            v.extend_from_slice(&(len as u32).to_be_bytes());
            v.extend_from_slice(&[0, 0, 0, proto]);
        }
        _ => panic!("mixed families"),
    }
    v
}

/// A TCP super-frame with `opts` bytes of TCP options (NOPs, a multiple of 4).
fn tcp_frame(v6: bool, flags: u8, seq: u32, payload: &[u8], opts: usize) -> Vec<u8> {
    let (s, d) = if v6 {
        (ip("2001:db8::1"), ip("2001:db8::2"))
    } else {
        (ip("10.0.0.1"), ip("10.0.0.2"))
    };
    let mut f = build::tcp(MAC_A, MAC_B, s, 4000, d, 80, flags, seq, 7, payload);
    if opts > 0 {
        let p = parsed(&f);
        let (l3, l4) = (usize::from(p.l3_off), usize::from(p.l4_off));
        f.splice(l4 + 20..l4 + 20, std::iter::repeat_n(1u8, opts));
        f[l4 + 12] = ((20 + opts) as u8 / 4) << 4;
        if v6 {
            let plen = u16::from_be_bytes([f[l3 + 4], f[l3 + 5]]) + opts as u16;
            f[l3 + 4..l3 + 6].copy_from_slice(&plen.to_be_bytes());
        } else {
            let tot = u16::from_be_bytes([f[l3 + 2], f[l3 + 3]]) + opts as u16;
            f[l3 + 2..l3 + 4].copy_from_slice(&tot.to_be_bytes());
        }
        let p = parsed(&f);
        assert!(crate::recompute_checksums(&mut f, &p));
    }
    f
}

fn udp_frame(v6: bool, payload: &[u8]) -> Vec<u8> {
    let (s, d) = if v6 {
        (ip("2001:db8::1"), ip("2001:db8::2"))
    } else {
        (ip("10.0.0.1"), ip("10.0.0.2"))
    };
    build::udp(MAC_A, MAC_B, s, 5000, d, 443, payload)
}

/// Segments `f` and checks every segment against the original independently; returns the
/// segments.
fn check(f: &[u8], kind: Kind, seg_size: usize) -> Vec<Vec<u8>> {
    let p = parsed(f);
    let segs = segment(f, &p, kind, seg_size).expect("segments");
    let (l3, l4, pay) = (
        usize::from(p.l3_off),
        usize::from(p.l4_off),
        usize::from(p.payload_off),
    );
    let data = &f[pay..p.l4_end()];
    assert_eq!(segs.len(), data.len().div_ceil(seg_size).max(1));
    let mut joined = Vec::new();
    for (i, s) in segs.iter().enumerate() {
        let q = parsed(s);
        let last = i + 1 == segs.len();
        // Same headers up to the fields that differ per segment.
        assert_eq!(
            (q.l3_off, q.l4_off, q.payload_off),
            (p.l3_off, p.l4_off, p.payload_off)
        );
        assert_eq!(&s[..l3], &f[..l3], "link layer");
        assert_eq!(
            (q.src, q.dst, q.sport, q.dport),
            (p.src, p.dst, p.sport, p.dport)
        );
        let chunk = &s[pay..q.l4_end()];
        assert!(!chunk.is_empty() || data.is_empty());
        assert!(chunk.len() <= seg_size);
        assert_eq!(s.len(), pay + chunk.len(), "no trailing bytes");
        if p.src.is_ipv4() {
            let tot = u16::from_be_bytes([s[l3 + 2], s[l3 + 3]]);
            assert_eq!(usize::from(tot), pay - l3 + chunk.len());
            let id = u16::from_be_bytes([s[l3 + 4], s[l3 + 5]]);
            let id0 = u16::from_be_bytes([f[l3 + 4], f[l3 + 5]]);
            assert_eq!(id, id0.wrapping_add(i as u16));
            assert_eq!(word_sum(&[&s[l3..l4]]), 0xffff, "IPv4 header checksum");
            assert_eq!(
                &s[l3 + 6..l3 + 10],
                &f[l3 + 6..l3 + 10],
                "flags, TTL, proto"
            );
        } else {
            let plen = u16::from_be_bytes([s[l3 + 4], s[l3 + 5]]);
            assert_eq!(usize::from(plen), pay - l3 - 40 + chunk.len());
        }
        let seg = &s[l4..];
        let ph = pseudo(p.src, p.dst, p.proto, seg.len());
        assert_eq!(word_sum(&[&ph, seg]), 0xffff, "L4 checksum of segment {i}");
        match kind {
            Kind::Tcp => {
                assert_eq!(q.tcp_seq, p.tcp_seq.wrapping_add(joined.len() as u32));
                assert_eq!(q.tcp_ack, p.tcp_ack);
                let mut want = p.tcp_flags;
                if !last {
                    want &= !0x09;
                }
                if i > 0 {
                    want &= !0x80;
                }
                assert_eq!(s[l4 + 13], want, "flags of segment {i}");
                // Options and the rest of the header travel unchanged.
                assert_eq!(&s[l4 + 14..l4 + 16], &f[l4 + 14..l4 + 16]);
                assert_eq!(&s[l4 + 18..pay], &f[l4 + 18..pay]);
            }
            Kind::Udp => {
                let len = u16::from_be_bytes([s[l4 + 4], s[l4 + 5]]);
                assert_eq!(usize::from(len), 8 + chunk.len());
                assert_ne!(&s[l4 + 6..l4 + 8], &[0, 0], "UDP checksum present");
            }
        }
        joined.extend_from_slice(chunk);
    }
    assert_eq!(joined, data, "payloads concatenate to the original");
    segs
}

#[test]
fn tcp_v4_with_options_is_cut_at_the_segment_size() {
    let mut rng = Rng::new(1);
    let mut payload = vec![0u8; 4000];
    rng.fill(&mut payload);
    // FIN|PSH|ACK|CWR, and a sequence number that wraps inside the frame.
    let f = tcp_frame(false, 0x99, u32::MAX - 1000, &payload, 12);
    let segs = check(&f, Kind::Tcp, 1448);
    assert_eq!(segs.len(), 3);
    assert_eq!(
        parsed(&segs[2]).tcp_seq,
        (u32::MAX - 1000).wrapping_add(2896)
    );
}

#[test]
fn tcp_v6_and_udp_l4_on_both_families() {
    let mut rng = Rng::new(2);
    let mut payload = vec![0u8; 3001];
    rng.fill(&mut payload);
    check(&tcp_frame(true, 0x18, 5, &payload, 0), Kind::Tcp, 1000);
    assert_eq!(check(&udp_frame(false, &payload), Kind::Udp, 1200).len(), 3);
    assert_eq!(check(&udp_frame(true, &payload), Kind::Udp, 1200).len(), 3);
}

#[test]
fn a_payload_that_fits_is_one_frame_with_complete_checksums() {
    let f = tcp_frame(false, 0x18, 1, b"hello", 0);
    let p = parsed(&f);
    let mut broken = f.clone();
    // A partial (pseudo-header only) checksum as the kernel hands it over.
    broken[usize::from(p.l4_off) + 16..usize::from(p.l4_off) + 18].copy_from_slice(&[0x12, 0x34]);
    let segs = check(&broken, Kind::Tcp, 1448);
    assert_eq!(segs, vec![f]);
}

#[test]
fn refuses_mismatched_and_excessive_frames() {
    let f = udp_frame(false, &[0u8; 2048]);
    let p = parsed(&f);
    assert_eq!(segment(&f, &p, Kind::Tcp, 100), Err(ERR_MALFORMED));
    assert_eq!(segment(&f, &p, Kind::Udp, 0), Err(ERR_MALFORMED));
    assert_eq!(segment(&f[..100], &p, Kind::Udp, 100), Err(ERR_MALFORMED));
    assert_eq!(segment(&f, &p, Kind::Udp, 1), Err(ERR_TOO_MANY));
    assert_eq!(segment(&f, &p, Kind::Udp, 2).map(|s| s.len()), Ok(1024));
}

/// Property check over random sizes, families, kinds, flags and option lengths (the crate
/// has no proptest; its seeded `Rng` makes a failure reproducible from the printed seed).
#[test]
fn random_super_frames_segment_consistently() {
    for seed in 0..300u64 {
        let mut rng = Rng::new(seed);
        let v6 = rng.below(2) == 1;
        let mut payload = vec![0u8; rng.below(6000)];
        rng.fill(&mut payload);
        let seg_size = 64 + rng.below(1500);
        let (f, kind) = if rng.below(2) == 0 {
            let flags = rng.next() as u8 & 0xdb | 0x10; // never SYN/RST, always ACK
            let opts = 4 * rng.below(11);
            (tcp_frame(v6, flags, rng.next(), &payload, opts), Kind::Tcp)
        } else {
            (udp_frame(v6, &payload), Kind::Udp)
        };
        eprintln!("seed {seed}");
        check(&f, kind, seg_size);
    }
}
