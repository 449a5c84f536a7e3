//! Rough cost of software segmentation (`gso::segment`, copy + full checksum per segment): a
//! 64 KiB TSO super-frame (TCP/IPv4, 1448-byte segments, 46 of them) and a 1 KiB one. Not a
//! benchmark suite, a sanity check of what a super-frame costs when the egress port cannot
//! take it: `cargo run --release -p pliant-net --example gso_speed`.

use pliant_net::build::{self, MAC_A, MAC_B};
use pliant_net::{gso, parse, Frame};
use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr};
use std::time::Instant;

fn main() {
    let src = IpAddr::V4(Ipv4Addr::new(10, 0, 1, 2));
    let dst = IpAddr::V4(Ipv4Addr::new(10, 0, 2, 2));
    for len in [65535 - 40, 1024] {
        let payload: Vec<u8> = (0..len).map(|i| i as u8).collect();
        let frame = build::tcp(MAC_A, MAC_B, src, 40000, dst, 80, 0x18, 1, 2, &payload);
        let Ok(Frame::Ip(p)) = parse(&frame) else {
            panic!("not IP");
        };
        let n: u32 = if len > 2000 { 20_000 } else { 1_000_000 };
        let mut segs = 0usize;
        let t = Instant::now();
        for _ in 0..n {
            let out = gso::segment(black_box(&frame), &p, gso::Kind::Tcp, 1448).expect("segments");
            segs = out.len();
        }
        let ns = t.elapsed().as_nanos() as f64 / f64::from(n);
        let gbps = (len as f64 * 8.0) / ns;
        println!(
            "{len}-byte payload: {segs} segments, {:.2} us/super-frame ({:.0} ns/segment, {gbps:.1} Gbit/s of payload on one core)",
            ns / 1000.0,
            ns / segs as f64
        );
    }
}
