//! Writes the fuzz seed corpus: one valid frame per file, covering every layer `parse`
//! understands (so the fuzzer starts from deep inside the parser instead of rediscovering
//! Ethernet). Usage: `cargo run -p pliant-net --example fuzz_seeds -- fuzz/seeds`.

use pliant_net::build::{self, tcp_flags, MAC_A, MAC_B};
use pliant_net::{arp, proto};
use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;

fn main() -> std::io::Result<()> {
    let dir = PathBuf::from(
        std::env::args()
            .nth(1)
            .unwrap_or_else(|| "fuzz/seeds".into()),
    );
    std::fs::create_dir_all(&dir)?;
    let v4 = |s: &str| -> IpAddr { s.parse().unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST)) };
    let (a4, b4, a6, b6) = (v4("10.0.1.2"), v4("10.0.2.2"), v4("fd00::1"), v4("fd00::2"));
    let mut seeds: Vec<(&str, Vec<u8>)> = vec![
        (
            "tcp4_syn",
            build::tcp(MAC_A, MAC_B, a4, 40000, b4, 80, tcp_flags::SYN, 1, 0, b""),
        ),
        (
            "tcp4_data",
            build::tcp(
                MAC_A,
                MAC_B,
                a4,
                40000,
                b4,
                80,
                0x18,
                1,
                2,
                b"GET / HTTP/1.1\r\n\r\n",
            ),
        ),
        (
            "tcp6",
            build::tcp(
                MAC_A,
                MAC_B,
                a6,
                40000,
                b6,
                443,
                tcp_flags::ACK,
                5,
                6,
                b"hi",
            ),
        ),
        ("udp4", build::udp(MAC_A, MAC_B, a4, 5353, b4, 53, b"query")),
        ("udp6", build::udp(MAC_A, MAC_B, a6, 5353, b6, 53, b"query")),
        (
            "echo4",
            build::icmp_echo(MAC_A, MAC_B, a4, b4, 7, 1, true, b"ping"),
        ),
        (
            "echo6",
            build::icmp_echo(MAC_A, MAC_B, a6, b6, 7, 1, false, b"pong"),
        ),
        (
            "unreach4",
            build::icmp(MAC_A, MAC_B, a4, b4, proto::ICMP, 3, 3, [0, 0], &[0x45; 28]),
        ),
        ("gre4", build::raw_ip(MAC_A, MAC_B, a4, b4, 47, &[0; 8])),
        (
            "udp4_padded",
            build::pad(&build::udp(MAC_A, MAC_B, a4, 1, b4, 2, b"z"), 60, 0),
        ),
        (
            "vlan_tcp4",
            build::with_vlan(
                &build::tcp(MAC_A, MAC_B, a4, 1, b4, 2, 0x10, 0, 0, b""),
                5,
                false,
            ),
        ),
        (
            "qinq_udp6",
            build::with_vlan(
                &build::with_vlan(&build::udp(MAC_A, MAC_B, a6, 1, b6, 2, b""), 5, false),
                6,
                true,
            ),
        ),
        (
            "arp_req",
            arp::request(
                MAC_A,
                Ipv4Addr::new(10, 0, 0, 1),
                Ipv4Addr::new(10, 0, 0, 2),
                None,
            ),
        ),
        (
            "arp_reply_vlan",
            arp::reply(
                MAC_A,
                Ipv4Addr::new(10, 0, 0, 1),
                MAC_B,
                Ipv4Addr::new(10, 0, 0, 2),
                Some(9),
            ),
        ),
    ];
    // ICMP errors quoting the packet that caused them (exercises `icmp_error`).
    let quoted4 = build::udp(MAC_A, MAC_B, a4, 4000, b4, 53, b"q");
    seeds.push((
        "timex4",
        build::icmp(
            MAC_B,
            MAC_A,
            b4,
            a4,
            proto::ICMP,
            11,
            0,
            [0, 0],
            &quoted4[14..],
        ),
    ));
    let quoted6 = build::tcp(MAC_A, MAC_B, a6, 4000, b6, 80, tcp_flags::SYN, 1, 0, b"");
    seeds.push((
        "unreach6",
        build::icmp(
            MAC_B,
            MAC_A,
            b6,
            a6,
            proto::ICMPV6,
            1,
            4,
            [0, 0],
            &quoted6[14..],
        ),
    ));
    // IPv6 with a hop-by-hop header and a (first) fragment header in front of UDP.
    let u6 = build::udp(MAC_A, MAC_B, a6, 1000, b6, 2000, b"ext");
    let mut ext = u6[..54].to_vec();
    ext[20] = 0; // next header: hop-by-hop
    ext.extend_from_slice(&[44, 0, 1, 4, 0, 0, 0, 0]); // HBH -> fragment, PadN
    ext.extend_from_slice(&[proto::UDP, 0, 0, 1, 0, 0, 0, 1]); // fragment: offset 0, M=1
    ext.extend_from_slice(&u6[54..]);
    let plen = (ext.len() - 54) as u16;
    ext[18..20].copy_from_slice(&plen.to_be_bytes());
    seeds.push(("udp6_ext_frag", ext));
    for (name, frame) in &seeds {
        std::fs::write(dir.join(name), frame)?;
    }
    println!("wrote {} seeds to {}", seeds.len(), dir.display());
    Ok(())
}
