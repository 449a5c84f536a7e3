//! Frames and checks shared by the unit tests of [`crate::Nat`] (`tests.rs`) and
//! [`crate::ftmb::FtmbNat`] (`ftmb.rs`): the same client, server and external address, so
//! both NATs are tested against the same traffic.

use pliant_net::build::{self, MAC_A, MAC_B};
use pliant_net::{parse, proto, Frame, Parsed};
use pliant_runtime::{Packet, Side};
use std::net::{IpAddr, Ipv4Addr};

pub const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 77, 1, 2);
pub const SERVER: Ipv4Addr = Ipv4Addr::new(10, 77, 2, 2);
pub const EXT: Ipv4Addr = Ipv4Addr::new(10, 77, 2, 1);

pub fn v4(a: Ipv4Addr) -> IpAddr {
    IpAddr::V4(a)
}

pub fn parsed(frame: &[u8]) -> Parsed {
    match parse(frame) {
        Ok(Frame::Ip(p)) => p,
        other => panic!("not an IP frame: {other:?}"),
    }
}

/// `frame` as a packet arriving on `side`.
pub fn packet(side: Side, frame: &[u8]) -> Packet {
    Packet::new(frame.to_vec(), side, parsed(frame))
}

/// Parses an output frame and checks both checksums by full recomputation.
pub fn check(frame: &[u8]) -> Parsed {
    let p = parsed(frame);
    assert!(
        pliant_net::ipv4_header_ok(frame, &p),
        "IPv4 header checksum"
    );
    assert!(pliant_net::l4_checksum_ok(frame, &p), "L4 checksum");
    p
}

/// TCP from the client's `sport` to the server's port 80.
pub fn tcp_out(sport: u16, flags: u8, payload: &[u8]) -> Vec<u8> {
    build::tcp(
        MAC_A,
        MAC_B,
        v4(CLIENT),
        sport,
        v4(SERVER),
        80,
        flags,
        1,
        0,
        payload,
    )
}

/// TCP from the server's port 80 to the external address's `dport`.
pub fn tcp_in(dport: u16, flags: u8, payload: &[u8]) -> Vec<u8> {
    build::tcp(
        MAC_B,
        MAC_A,
        v4(SERVER),
        80,
        v4(EXT),
        dport,
        flags,
        7,
        2,
        payload,
    )
}

/// UDP from the client's `sport` to the server's port 53.
pub fn udp_out(sport: u16) -> Vec<u8> {
    build::udp(MAC_A, MAC_B, v4(CLIENT), sport, v4(SERVER), 53, b"query")
}

/// UDP from the server's port 53 to the external address's `dport`.
pub fn udp_in(dport: u16) -> Vec<u8> {
    build::udp(MAC_B, MAC_A, v4(SERVER), 53, v4(EXT), dport, b"answer")
}

/// ICMP "port unreachable" from `src` to `dst` arriving on `side`, quoting `quote` (an IP
/// packet: what the host or router reports about).
pub fn port_unreachable(side: Side, src: Ipv4Addr, dst: Ipv4Addr, quote: &[u8]) -> Vec<u8> {
    let (smac, dmac) = match side {
        Side::Inside => (MAC_A, MAC_B),
        Side::Outside => (MAC_B, MAC_A),
    };
    build::icmp(
        smac,
        dmac,
        v4(src),
        v4(dst),
        proto::ICMP,
        3,
        3,
        [0, 0],
        quote,
    )
}
