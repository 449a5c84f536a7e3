//! Parser, rewrite and robustness tests over frames from [`crate::build`].

use crate::build::{self, tcp_flags, MAC_A, MAC_B};
use crate::checksum::{self, fold, pseudo_header_sum};
use crate::rewrite::{self, L4Csum, RewriteError, Side};
use crate::testutil::Rng;
use crate::*;
use std::net::{Ipv4Addr, Ipv6Addr};

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn parsed(f: &[u8]) -> Parsed {
    match parse(f) {
        Ok(Frame::Ip(p)) => p,
        other => panic!("expected an IP frame, got {other:?}"),
    }
}

fn reason(f: &[u8]) -> &'static str {
    match parse(f) {
        Err(e) => e.reason(),
        Ok(x) => panic!("expected an error, parsed {x:?}"),
    }
}

fn tcp4() -> Vec<u8> {
    build::tcp(
        MAC_A,
        MAC_B,
        ip("10.0.1.2"),
        40000,
        ip("10.0.2.2"),
        80,
        tcp_flags::SYN | tcp_flags::ACK,
        1000,
        2000,
        b"GET / HTTP/1.1\r\n",
    )
}

fn tcp6() -> Vec<u8> {
    build::tcp(
        MAC_A,
        MAC_B,
        ip("fd00::1"),
        40000,
        ip("fd00::2"),
        443,
        tcp_flags::ACK,
        7,
        9,
        b"x",
    )
}

fn udp4() -> Vec<u8> {
    build::udp(
        MAC_A,
        MAC_B,
        ip("192.168.1.10"),
        5353,
        ip("192.168.1.1"),
        53,
        b"query",
    )
}

fn udp6() -> Vec<u8> {
    build::udp(
        MAC_A,
        MAC_B,
        ip("2001:db8::10"),
        5353,
        ip("2001:db8::1"),
        53,
        b"query6",
    )
}

fn echo4() -> Vec<u8> {
    build::icmp_echo(
        MAC_A,
        MAC_B,
        ip("10.0.0.1"),
        ip("10.0.0.2"),
        0x1234,
        1,
        true,
        b"ping",
    )
}

fn echo6() -> Vec<u8> {
    build::icmp_echo(
        MAC_A,
        MAC_B,
        ip("fd00::1"),
        ip("fd00::2"),
        0x4321,
        1,
        false,
        b"pong",
    )
}

fn samples() -> Vec<Vec<u8>> {
    vec![
        tcp4(),
        tcp6(),
        udp4(),
        udp6(),
        echo4(),
        echo6(),
        build::with_vlan(&tcp4(), 7, false),
        build::with_vlan(&build::with_vlan(&udp6(), 8, false), 9, true),
        build::icmp(
            MAC_A,
            MAC_B,
            ip("10.0.0.1"),
            ip("10.0.0.2"),
            proto::ICMP,
            3,
            3,
            [0, 0],
            &[],
        ),
        ipv6_with_ext(&udp6(), &[(0, 8), (60, 16), (44, 8), (43, 8)], 0, false),
        build::icmp(
            MAC_B,
            MAC_A,
            ip("10.9.9.9"),
            ip("192.168.1.10"),
            proto::ICMP,
            11,
            0,
            [0, 0],
            &udp4()[14..],
        ),
        build::icmp(
            MAC_B,
            MAC_A,
            ip("fd00::9"),
            ip("fd00::1"),
            proto::ICMPV6,
            3,
            0,
            [0, 0],
            &tcp6()[14..],
        ),
    ]
}

// ---------------------------------------------------------------------------------------------
// Valid frames

#[test]
fn tcp_v4_fields() {
    let f = tcp4();
    let p = parsed(&f);
    assert_eq!((p.dst_mac, p.src_mac, p.vlan), (MAC_B, MAC_A, None));
    assert_eq!(
        (p.l3_off, p.l4_off, p.payload_off, p.payload_len),
        (14, 34, 54, 16)
    );
    assert_eq!(
        (p.src, p.dst, p.proto, p.ttl),
        (ip("10.0.1.2"), ip("10.0.2.2"), proto::TCP, 64)
    );
    assert_eq!((p.sport, p.dport), (40000, 80));
    assert_eq!((p.tcp_flags, p.tcp_seq, p.tcp_ack), (0x12, 1000, 2000));
    assert!(!p.fragment);
    let (k, d) = FlowKey::new(proto::TCP, p.src, 40000, p.dst, 80);
    assert_eq!((p.key, p.dir), (k, d));
    assert_eq!(
        &f[p.payload_off as usize..p.l4_end()],
        b"GET / HTTP/1.1\r\n"
    );
    assert!(ipv4_header_ok(&f, &p));
    assert!(l4_checksum_ok(&f, &p));
}

#[test]
fn reply_direction_shares_the_key() {
    let a = parsed(&tcp4());
    let b = parsed(&build::tcp(
        MAC_B,
        MAC_A,
        ip("10.0.2.2"),
        80,
        ip("10.0.1.2"),
        40000,
        tcp_flags::ACK,
        0,
        0,
        &[],
    ));
    assert_eq!(a.key, b.key);
    assert_ne!(a.dir, b.dir);
}

#[test]
fn tcp_v6_fields() {
    let f = tcp6();
    let p = parsed(&f);
    assert_eq!(
        (p.l3_off, p.l4_off, p.payload_off, p.payload_len),
        (14, 54, 74, 1)
    );
    assert_eq!(
        (p.src, p.dst, p.proto),
        (ip("fd00::1"), ip("fd00::2"), proto::TCP)
    );
    assert_eq!((p.sport, p.dport, p.tcp_seq, p.tcp_ack), (40000, 443, 7, 9));
    assert_eq!(p.key.family, 6);
    assert!(l4_checksum_ok(&f, &p));
}

#[test]
fn udp_and_icmp_fields() {
    let p = parsed(&udp4());
    assert_eq!(
        (p.proto, p.sport, p.dport, p.payload_len),
        (proto::UDP, 5353, 53, 5)
    );
    assert_eq!((p.tcp_flags, p.icmp_type), (0, 0));
    let p = parsed(&udp6());
    assert_eq!(
        (p.proto, p.sport, p.dport, p.payload_len),
        (proto::UDP, 5353, 53, 6)
    );

    let f = echo4();
    let p = parsed(&f);
    assert_eq!((p.proto, p.icmp_type, p.icmp_code), (proto::ICMP, 8, 0));
    assert_eq!((p.sport, p.dport, p.payload_len), (0x1234, 0x1234, 4));
    assert!(p.is_icmp_echo());
    assert!(l4_checksum_ok(&f, &p));
    let f = echo6();
    let p = parsed(&f);
    assert_eq!((p.proto, p.icmp_type), (proto::ICMPV6, 129));
    assert_eq!((p.sport, p.dport), (0x4321, 0x4321));
    assert!(l4_checksum_ok(&f, &p));
}

#[test]
fn non_echo_icmp_has_no_ports() {
    // Destination unreachable with a non-zero "rest" word: it must not be taken as an id.
    let f = build::icmp(
        MAC_A,
        MAC_B,
        ip("10.0.0.1"),
        ip("10.0.0.2"),
        proto::ICMP,
        3,
        1,
        [7, 9],
        b"",
    );
    let p = parsed(&f);
    assert_eq!((p.icmp_type, p.icmp_code, p.sport, p.dport), (3, 1, 0, 0));
    assert!(!p.is_icmp_echo());
    // ICMPv6 echo type numbers carried over IPv4 ICMP are not echo.
    let f = build::icmp(
        MAC_A,
        MAC_B,
        ip("10.0.0.1"),
        ip("10.0.0.2"),
        proto::ICMP,
        128,
        0,
        [7, 9],
        b"",
    );
    assert_eq!(parsed(&f).sport, 0);
}

#[test]
fn other_protocols_and_ethertypes() {
    let f = build::raw_ip(
        MAC_A,
        MAC_B,
        ip("10.0.0.1"),
        ip("10.0.0.2"),
        47,
        &[1, 2, 3, 4, 5],
    );
    let p = parsed(&f);
    assert_eq!(
        (p.proto, p.sport, p.dport, p.payload_off, p.payload_len),
        (47, 0, 0, 34, 5)
    );
    let mut lldp = tcp4();
    lldp[12..14].copy_from_slice(&0x88ccu16.to_be_bytes());
    assert_eq!(parse(&lldp), Ok(Frame::Other { ethertype: 0x88cc }));
}

#[test]
fn vlan_tags_shift_offsets() {
    let base = parsed(&tcp4());
    let one = parsed(&build::with_vlan(&tcp4(), 100, false));
    assert_eq!(one.vlan, Some(100));
    assert_eq!((one.l3_off, one.l4_off, one.payload_off), (18, 38, 58));
    assert_eq!((one.key, one.payload_len), (base.key, base.payload_len));
    let two = parsed(&build::with_vlan(
        &build::with_vlan(&tcp4(), 200, false),
        300,
        true,
    ));
    assert_eq!(two.vlan, Some(300), "outer tag is reported");
    assert_eq!((two.l3_off, two.payload_off), (22, 62));
    let three = build::with_vlan(
        &build::with_vlan(&build::with_vlan(&tcp4(), 1, false), 2, false),
        3,
        true,
    );
    assert_eq!(reason(&three), "bad_vlan_depth");
}

#[test]
fn padding_is_not_payload() {
    let f = build::udp(MAC_A, MAC_B, ip("10.0.0.1"), 1, ip("10.0.0.2"), 2, b"z");
    assert_eq!(f.len(), 43);
    let padded = build::pad(&f, 60, 0xee);
    let p = parsed(&padded);
    assert_eq!(p.payload_len, 1);
    assert_eq!(p.l4_end(), 43);
    assert!(l4_checksum_ok(&padded, &p));
    let t = build::pad(
        &build::tcp(
            MAC_A,
            MAC_B,
            ip("10.0.0.1"),
            1,
            ip("10.0.0.2"),
            2,
            0x10,
            0,
            0,
            b"",
        ),
        60,
        0xee,
    );
    let p = parsed(&t);
    assert_eq!((p.payload_len, p.l4_end()), (0, 54));
    assert!(l4_checksum_ok(&t, &p));
    let e = build::pad(&echo4(), 80, 0xee);
    assert_eq!(parsed(&e).payload_len, 4);
}

#[test]
fn ipv4_options_are_skipped() {
    let f = tcp4();
    let mut g = f[..34].to_vec();
    g.extend_from_slice(&[1, 1, 1, 0]); // NOP NOP NOP EOL: 4 bytes of options, IHL 6
    g.extend_from_slice(&f[34..]);
    g[14] = 0x46;
    let total = u16::from_be_bytes([g[16], g[17]]) + 4;
    g[16..18].copy_from_slice(&total.to_be_bytes());
    let mut p = parsed(&g);
    assert_eq!((p.l4_off, p.payload_off, p.sport), (38, 58, 40000));
    assert!(recompute_checksums(&mut g, &p));
    assert!(ipv4_header_ok(&g, &p));
    p = parsed(&g);
    assert!(l4_checksum_ok(&g, &p));
}

#[test]
fn ipv4_errors() {
    let f = tcp4();
    let mut g = f.clone();
    g[14] = 0x65;
    assert_eq!(reason(&g), "bad_ipv4_version");
    g[14] = 0x44;
    assert_eq!(reason(&g), "bad_ipv4_ihl");
    let mut g = f.clone();
    g[16..18].copy_from_slice(&19u16.to_be_bytes());
    assert_eq!(reason(&g), "bad_ipv4_len");
    let mut g = f.clone();
    g[16..18].copy_from_slice(&(f.len() as u16 - 13).to_be_bytes());
    assert_eq!(reason(&g), "truncated_ipv4");
    g[14] = 0x4f; // IHL 60 > total
    g[16..18].copy_from_slice(&40u16.to_be_bytes());
    assert_eq!(reason(&g), "bad_ipv4_len");
    // The header checksum is not checked by parse, only by ipv4_header_ok.
    let mut g = f.clone();
    g[24] ^= 0xff;
    let p = parsed(&g);
    assert!(!ipv4_header_ok(&g, &p));
}

#[test]
fn tcp_and_udp_errors() {
    let mut g = tcp4();
    g[34 + 12] = 4 << 4;
    assert_eq!(reason(&g), "bad_tcp_offset");
    g[34 + 12] = 15 << 4; // 60-byte header, only 36 bytes of segment
    assert_eq!(reason(&g), "truncated_tcp");
    let mut g = tcp4();
    g[34 + 12] = 8 << 4; // 12 bytes of options eat into the payload
    let p = parsed(&g);
    assert_eq!((p.payload_off, p.payload_len), (66, 4));
    let mut g = udp4();
    g[34 + 4..34 + 6].copy_from_slice(&7u16.to_be_bytes());
    assert_eq!(reason(&g), "bad_udp_len");
    g[34 + 4..34 + 6].copy_from_slice(&14u16.to_be_bytes());
    assert_eq!(reason(&g), "bad_udp_len");
    // A UDP length shorter than the IP payload: trailing bytes are not payload.
    g[34 + 4..34 + 6].copy_from_slice(&10u16.to_be_bytes());
    assert_eq!(parsed(&g).payload_len, 2);
}

// ---------------------------------------------------------------------------------------------
// Fragments and IPv6 extension headers

/// Sets the IPv4 fragment field of `f` (offset in 8-byte units, MF bit) and fixes the header
/// checksum.
fn fragment4(f: &[u8], offset: u16, more: bool) -> Vec<u8> {
    let mut g = f.to_vec();
    let v = offset | if more { 0x2000 } else { 0 };
    g[20..22].copy_from_slice(&v.to_be_bytes());
    g[24] = 0;
    g[25] = 0;
    let c = checksum::checksum(&g[14..34]);
    g[24..26].copy_from_slice(&c.to_be_bytes());
    g
}

#[test]
fn ipv4_fragments() {
    let f = fragment4(&udp4(), 100, false);
    let p = parsed(&f);
    assert!(p.fragment);
    assert_eq!(
        (p.proto, p.sport, p.dport, p.l4_off, p.payload_off),
        (proto::UDP, 0, 0, 34, 34)
    );
    assert_eq!(p.payload_len, 13);
    assert!(ipv4_header_ok(&f, &p));
    // First fragment whose UDP length covers bytes in later fragments: accepted, ports read.
    let mut g = fragment4(&udp4(), 0, true);
    g[34 + 4..34 + 6].copy_from_slice(&3000u16.to_be_bytes());
    let p = parsed(&g);
    assert!(!p.fragment);
    assert_eq!((p.sport, p.dport, p.payload_len), (5353, 53, 5));
    // A truncated non-first fragment cannot be "truncated_udp": there is no UDP header.
    let tiny = fragment4(&udp4()[..38], 1, false);
    let mut tiny = tiny;
    tiny[16..18].copy_from_slice(&24u16.to_be_bytes());
    assert!(parsed(&tiny).fragment);
}

/// Inserts IPv6 extension headers `(type, length in bytes)` after the fixed header of the IPv6
/// frame `f` (untagged). A fragment header (44) gets fragment offset `frag_off` and MF `more`.
fn ipv6_with_ext(f: &[u8], ext: &[(u8, usize)], frag_off: u16, more: bool) -> Vec<u8> {
    let upper = f[14 + 6];
    let mut g = f[..54].to_vec();
    for (i, &(t, len)) in ext.iter().enumerate() {
        let next = ext.get(i + 1).map_or(upper, |e| e.0);
        let mut h = vec![0u8; len];
        h[0] = next;
        if t == 44 {
            h[2..4].copy_from_slice(&((frag_off << 3) | u16::from(more)).to_be_bytes());
        } else {
            h[1] = (len / 8 - 1) as u8;
        }
        g.extend_from_slice(&h);
    }
    g[14 + 6] = ext.first().map_or(upper, |e| e.0);
    g.extend_from_slice(&f[54..]);
    let plen = (g.len() - 54) as u16;
    g[18..20].copy_from_slice(&plen.to_be_bytes());
    g
}

#[test]
fn ipv6_extension_headers_are_skipped() {
    let f = ipv6_with_ext(&udp6(), &[(0, 8), (43, 24), (60, 16)], 0, false);
    let p = parsed(&f);
    assert_eq!(
        (p.proto, p.sport, p.dport, p.l4_off),
        (proto::UDP, 5353, 53, 54 + 48)
    );
    assert_eq!(p.payload_len, 6);
    assert!(l4_checksum_ok(&f, &p));
}

#[test]
fn ipv6_fragments() {
    // First fragment (offset 0): L4 parsed.
    let f = ipv6_with_ext(&tcp6(), &[(44, 8)], 0, true);
    let p = parsed(&f);
    assert!(!p.fragment);
    assert_eq!((p.proto, p.sport, p.l4_off), (proto::TCP, 40000, 62));
    // Non-first: no L4, ports 0, proto is the fragment header's next header.
    let f = ipv6_with_ext(&tcp6(), &[(0, 8), (44, 8)], 3, true);
    let p = parsed(&f);
    assert!(p.fragment);
    assert_eq!(
        (p.proto, p.sport, p.dport, p.l4_off, p.payload_off),
        (proto::TCP, 0, 0, 70, 70)
    );
    assert_eq!(p.key, FlowKey::new(proto::TCP, p.src, 0, p.dst, 0).0);
}

#[test]
fn ipv6_errors() {
    let long: Vec<(u8, usize)> = vec![(60, 8); ipv6::MAX_EXT_HEADERS + 1];
    assert_eq!(
        reason(&ipv6_with_ext(&udp6(), &long, 0, false)),
        "bad_ipv6_ext"
    );
    let ok: Vec<(u8, usize)> = vec![(60, 8); ipv6::MAX_EXT_HEADERS];
    assert_eq!(parsed(&ipv6_with_ext(&udp6(), &ok, 0, false)).sport, 5353);
    let mut g = udp6();
    g[14] = 0x40;
    assert_eq!(reason(&g), "bad_ipv6_version");
    let mut g = udp6();
    g[18..20].copy_from_slice(&100u16.to_be_bytes());
    assert_eq!(reason(&g), "truncated_ipv6");
    // Extension header claiming more bytes than the payload holds.
    let mut g = ipv6_with_ext(&udp6(), &[(60, 8)], 0, false);
    g[55] = 200;
    assert_eq!(reason(&g), "truncated_ipv6_ext");
}

// ---------------------------------------------------------------------------------------------
// Truncation, error labels and robustness

#[test]
fn every_strict_prefix_is_an_error() {
    for f in samples() {
        for n in 0..f.len() {
            match parse(&f[..n]) {
                Err(e) => assert!(!e.reason().ends_with("other"), "{e:?}"),
                Ok(x) => panic!("prefix {n} of a {}-byte frame parsed: {x:?}", f.len()),
            }
        }
        assert!(parse(&f).is_ok());
    }
}

#[test]
fn truncation_labels_name_the_layer() {
    let f = tcp4();
    assert_eq!(reason(&f[..10]), "truncated_eth");
    assert_eq!(reason(&f[..30]), "truncated_ipv4");
    let f = udp6();
    assert_eq!(reason(&f[..40]), "truncated_ipv6");
    // Shorten the IP length fields so the L4 header itself is cut.
    let mut t = tcp4();
    t[16..18].copy_from_slice(&30u16.to_be_bytes());
    assert_eq!(reason(&t), "truncated_tcp");
    let mut u = udp4();
    u[16..18].copy_from_slice(&26u16.to_be_bytes());
    assert_eq!(reason(&u), "truncated_udp");
    let mut i = echo4();
    i[16..18].copy_from_slice(&27u16.to_be_bytes());
    assert_eq!(reason(&i), "truncated_icmp");
    let mut i6 = echo6();
    i6[18..20].copy_from_slice(&7u16.to_be_bytes());
    assert_eq!(reason(&i6), "truncated_icmpv6");
}

#[test]
fn reason_labels_are_unique_and_label_safe() {
    let all: Vec<&str> = ParseError::all_reasons().collect();
    let mut dedup = all.clone();
    dedup.sort();
    dedup.dedup();
    assert_eq!(dedup.len(), all.len());
    for l in all {
        assert!(
            l.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
            "{l}"
        );
    }
    assert_eq!(ParseError::Truncated("x").reason(), "truncated_other");
    assert_eq!(err::BAD_IPV4_IHL.reason(), "bad_ipv4_ihl");
    assert_eq!(err::TRUNC_ETH.to_string(), "truncated Ethernet header");
}

#[test]
fn random_mutations_never_panic_and_round_trip() {
    let mut rng = Rng::new(42);
    let samples = samples();
    let mut parsed_ok = 0;
    for i in 0..60_000 {
        let mut f = samples[i % samples.len()].clone();
        for _ in 0..1 + rng.below(4) {
            match rng.below(4) {
                0 | 1 => {
                    let at = rng.below(f.len());
                    f[at] = rng.next() as u8;
                }
                2 => f.truncate(rng.below(f.len() + 1)),
                _ => f.extend((0..rng.below(20)).map(|_| rng.next() as u8)),
            }
            if f.is_empty() {
                break;
            }
        }
        if parse(&f).is_ok() {
            parsed_ok += 1;
        }
        if let Err(e) = selfcheck::parse_and_rewrite(&f) {
            panic!("round trip failed on {f:02x?}: {e}");
        }
    }
    // The mutations must leave a good share parseable, or the round trip checks nothing.
    assert!(parsed_ok > 10_000, "only {parsed_ok} mutated frames parsed");
}

#[test]
fn samples_round_trip() {
    for f in samples() {
        selfcheck::parse_and_rewrite(&f).unwrap();
        selfcheck::parse_and_rewrite(&build::pad(&f, 128, 0xa5)).unwrap();
    }
}

/// Found by the fuzzer: an ICMP echo whose message is all zeros once its identifier is
/// rewritten to 0 must carry checksum 0xffff (the incremental update gave 0x0000, which does
/// not verify: ICMPv4 has no pseudo header to make the sum non-zero).
#[test]
fn an_icmp_echo_rewritten_to_all_zeros_keeps_a_valid_checksum() {
    let mut f = vec![0u8; 14 + 20 + 8];
    f[12] = 0x08; // IPv4
    f[14] = 0x45;
    f[17] = 28; // total length: header + 8-byte echo
    f[22] = 64; // TTL
    f[23] = 1; // ICMP
    f[26..30].copy_from_slice(&[10, 0, 0, 1]);
    f[30..34].copy_from_slice(&[10, 0, 0, 2]);
    f[38..40].copy_from_slice(&0x1234u16.to_be_bytes()); // echo reply, id 0x1234, seq 0
    let Ok(Frame::Ip(mut p)) = parse(&f) else {
        panic!("parses");
    };
    assert!(recompute_checksums(&mut f, &p));
    rewrite::set_icmp_id(&mut f, &mut p, 0).unwrap();
    assert_eq!(&f[36..38], &[0xff, 0xff]);
    assert!(l4_checksum_ok(&f, &p));
    // The fuzzer's input passes the round trip.
    let crash: &[u8] = &[
        0x02, 0x00, 0x00, 0x00, 0x00, 0x0a, 0x02, 0x00, 0x00, 0x00, 0xc7, 0x0b, 0x08, 0x00, 0x45,
        0x00, 0x00, 0x33, 0x00, 0x00, 0x40, 0x00, 0x3f, 0x01, 0x23, 0xff, 0x00, 0x00, 0xfb, 0x85,
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xc3, 0x00, 0x00, 0x00, 0xc1, 0x0a, 0x02, 0x00,
        0x01, 0x02, 0x0b, 0x00, 0x0c, 0x1e, 0x28, 0x00, 0x00, 0x00, 0x45, 0x00, 0x00, 0x1d, 0x00,
        0x00, 0x40, 0x00, 0x44, 0x01, 0xa3, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xc7, 0x0b,
        0x08, 0x38, 0x00,
    ];
    selfcheck::parse_and_rewrite(crash).unwrap();
}

// ---------------------------------------------------------------------------------------------
// Rewrites against full recomputation

fn rand_addr(rng: &mut Rng, v4: bool) -> IpAddr {
    if v4 {
        IpAddr::V4(Ipv4Addr::from(rng.next()))
    } else {
        let mut b = [0u8; 16];
        rng.fill(&mut b);
        IpAddr::V6(Ipv6Addr::from(b))
    }
}

/// Builds the frame of the given kind from scratch with the given fields.
#[allow(clippy::too_many_arguments)]
fn build_kind(
    kind: usize,
    src: IpAddr,
    sport: u16,
    dst: IpAddr,
    dport: u16,
    ttl: u8,
    payload: &[u8],
) -> Vec<u8> {
    let mut f = match kind {
        0 => build::tcp(
            MAC_A,
            MAC_B,
            src,
            sport,
            dst,
            dport,
            tcp_flags::PSH,
            11,
            22,
            payload,
        ),
        1 => build::udp(MAC_A, MAC_B, src, sport, dst, dport, payload),
        _ => build::icmp_echo(MAC_A, MAC_B, src, dst, sport, 5, true, payload),
    };
    // Set the TTL and redo the checksums from scratch.
    let p = parsed(&f);
    let at = usize::from(p.l3_off) + if src.is_ipv4() { 8 } else { 7 };
    f[at] = ttl;
    assert!(recompute_checksums(&mut f, &p));
    f
}

#[test]
fn rewrites_equal_full_recomputation() {
    let mut rng = Rng::new(1624);
    for i in 0..6_000 {
        let v4 = i % 2 == 0;
        let kind = rng.below(3);
        let mut payload = vec![0u8; rng.below(40)];
        rng.fill(&mut payload);
        let (s, d) = (rand_addr(&mut rng, v4), rand_addr(&mut rng, v4));
        let (sp, dp) = (rng.next() as u16, rng.next() as u16);
        let dp = if kind == 2 { sp } else { dp };
        let mut f = build_kind(kind, s, sp, d, dp, 64, &payload);
        let mut p = parsed(&f);

        let (s2, d2) = (rand_addr(&mut rng, v4), rand_addr(&mut rng, v4));
        let (sp2, dp2) = (rng.next() as u16, rng.next() as u16);
        rewrite::set_src_ip(&mut f, &mut p, s2).unwrap();
        rewrite::set_dst_ip(&mut f, &mut p, d2).unwrap();
        let dp2 = if kind == 2 {
            rewrite::set_icmp_id(&mut f, &mut p, sp2).unwrap();
            sp2
        } else {
            rewrite::set_src_port(&mut f, &mut p, sp2).unwrap();
            rewrite::set_dst_port(&mut f, &mut p, dp2).unwrap();
            dp2
        };
        assert!(rewrite::dec_ttl(&mut f, &mut p));
        let want = build_kind(kind, s2, sp2, d2, dp2, 63, &payload);
        assert_eq!(f, want, "kind {kind} v4 {v4}");
        assert_eq!(parsed(&f), p, "Parsed kept in step with the frame");
        assert_eq!((p.sport, p.dport, p.ttl), (sp2, dp2, 63));
    }
}

#[test]
fn icmp_echo_ports_rewrite_sets_the_identifier() {
    let mut f = echo4();
    let mut p = parsed(&f);
    rewrite::set_dst_port(&mut f, &mut p, 999).unwrap();
    assert_eq!((p.sport, p.dport), (999, 999));
    assert_eq!(parsed(&f), p);
    assert!(l4_checksum_ok(&f, &p));
}

#[test]
fn udp_zero_checksum_stays_zero_over_ipv4() {
    let mut f = udp4();
    f[34 + 6] = 0;
    f[34 + 7] = 0;
    let mut p = parsed(&f);
    rewrite::set_src_ip(&mut f, &mut p, ip("1.2.3.4")).unwrap();
    rewrite::set_src_port(&mut f, &mut p, 4444).unwrap();
    assert_eq!(&f[40..42], &[0, 0]);
    assert!(ipv4_header_ok(&f, &p));
    assert!(l4_checksum_ok(&f, &p));
}

#[test]
fn udp_checksum_that_comes_out_zero_is_sent_as_ffff() {
    // Search for a source port making the full UDP checksum 0 (must be sent as 0xffff), then
    // reach the same frame by incremental rewrite from a different port.
    let base = udp4();
    let p0 = parsed(&base);
    let seg = &base[34..];
    let mut target = None;
    for port in 0..=u16::MAX {
        let mut s = seg.to_vec();
        s[0..2].copy_from_slice(&port.to_be_bytes());
        s[6] = 0;
        s[7] = 0;
        if checksum::l4_checksum(p0.src, p0.dst, proto::UDP, &s) == 0 {
            target = Some(port);
            break;
        }
    }
    let port = target.expect("some port zeroes the checksum");
    let mut f = base.clone();
    let mut p = p0;
    rewrite::set_src_port(&mut f, &mut p, port).unwrap();
    assert_eq!(&f[40..42], &[0xff, 0xff]);
    assert!(l4_checksum_ok(&f, &p));
    // And moving away from 0xffff again is still exact.
    rewrite::set_src_port(&mut f, &mut p, 5353).unwrap();
    assert_eq!(f, base);
}

#[test]
fn ttl_expiry_and_fragments() {
    let mut f = build_kind(0, ip("10.0.0.1"), 1, ip("10.0.0.2"), 2, 1, b"");
    let before = f.clone();
    let mut p = parsed(&f);
    assert!(!rewrite::dec_ttl(&mut f, &mut p));
    assert_eq!((f.clone(), p.ttl), (before, 1));

    let mut f = fragment4(&udp4(), 10, false);
    let mut p = parsed(&f);
    let l4_before = f[34..].to_vec();
    rewrite::set_dst_ip(&mut f, &mut p, ip("9.9.9.9")).unwrap();
    assert_eq!(&f[34..], &l4_before[..], "no L4 header to touch");
    assert!(ipv4_header_ok(&f, &p));
    assert_eq!(
        rewrite::set_src_port(&mut f, &mut p, 1),
        Err(RewriteError::Fragment)
    );
}

#[test]
fn rewrite_refusals_leave_the_frame_alone() {
    let mut f = tcp4();
    let before = f.clone();
    let mut p = parsed(&f);
    assert!(matches!(
        rewrite::set_src_ip(&mut f, &mut p, ip("::1")),
        Err(RewriteError::FamilyMismatch { .. })
    ));
    let mut short = f[..40].to_vec();
    assert_eq!(
        rewrite::set_src_ip(&mut short, &mut p, ip("1.1.1.1")),
        Err(RewriteError::FrameTooShort)
    );
    assert_eq!(&short[..], &before[..40]);
    assert_eq!(f, before);
    let mut g = build::raw_ip(MAC_A, MAC_B, ip("10.0.0.1"), ip("10.0.0.2"), 47, &[0; 8]);
    let mut q = parsed(&g);
    assert_eq!(
        rewrite::set_src_port(&mut g, &mut q, 1),
        Err(RewriteError::NoPorts(47))
    );
    assert_eq!(
        rewrite::set_icmp_id(&mut g, &mut q, 1),
        Err(RewriteError::NoPorts(47))
    );
    // Addresses of a protocol without an L4 checksum still rewrite (IP header only).
    rewrite::set_src_ip(&mut g, &mut q, ip("10.9.9.9")).unwrap();
    assert_eq!(parsed(&g), q);
}

#[test]
fn mac_rewrite() {
    let mut f = tcp4();
    let mut p = parsed(&f);
    rewrite::set_src_mac(&mut f, &mut p, [9; 6]).unwrap();
    rewrite::set_dst_mac(&mut f, &mut p, [8; 6]).unwrap();
    assert_eq!((&f[0..6], &f[6..12]), (&[8u8; 6][..], &[9u8; 6][..]));
    assert_eq!(parsed(&f), p);
}

#[test]
fn partial_checksum_mode_tracks_the_pseudo_header() {
    let mut rng = Rng::new(99);
    for i in 0..2_000 {
        let v4 = i % 2 == 0;
        let udp = i % 4 < 2;
        let (s, d) = (rand_addr(&mut rng, v4), rand_addr(&mut rng, v4));
        let mut f = if udp {
            build::udp(MAC_A, MAC_B, s, 1, d, 2, b"partial")
        } else {
            build::tcp(MAC_A, MAC_B, s, 1, d, 2, 0x10, 0, 0, b"partial")
        };
        let mut p = parsed(&f);
        let pr = p.proto;
        let len = (p.l4_end() - usize::from(p.l4_off)) as u32;
        let field = p.l4_off as usize + if udp { 6 } else { 16 };
        // What the kernel leaves in the field for CHECKSUM_PARTIAL: the folded pseudo-header
        // sum, not complemented.
        let partial = |a: IpAddr, b: IpAddr| fold(pseudo_header_sum(a, b, pr, len));
        f[field..field + 2].copy_from_slice(&partial(s, d).to_be_bytes());
        let s2 = rand_addr(&mut rng, v4);
        rewrite::set_ip(&mut f, &mut p, Side::Src, s2, L4Csum::Partial).unwrap();
        rewrite::set_port(&mut f, &mut p, Side::Dst, 77, L4Csum::Partial).unwrap();
        let got = u16::from_be_bytes([f[field], f[field + 1]]);
        // 0x0000 and 0xffff are the same one's-complement value.
        assert_eq!(got % 0xffff, partial(s2, d) % 0xffff);
        assert!(ipv4_header_ok(&f, &p));
    }
}
