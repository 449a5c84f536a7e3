//! Rough per-frame cost of `parse` and of a NAT-style rewrite (source address + port), on a
//! 64-byte TCP/IPv4 frame. Not a benchmark suite, just a sanity check that the data path stays
//! cheap: `cargo run --release -p pliant-net --example parse_speed`.

use pliant_net::build::{self, MAC_A, MAC_B};
use pliant_net::{parse, rewrite, Frame};
use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr};
use std::time::Instant;

fn main() {
    let src = IpAddr::V4(Ipv4Addr::new(10, 0, 1, 2));
    let dst = IpAddr::V4(Ipv4Addr::new(10, 0, 2, 2));
    let frame = build::pad(
        &build::tcp(MAC_A, MAC_B, src, 40000, dst, 80, 0x10, 1, 2, b""),
        64,
        0,
    );
    let n: u32 = 10_000_000;

    let t = Instant::now();
    let mut ok = 0u32;
    for _ in 0..n {
        if let Ok(Frame::Ip(p)) = parse(black_box(&frame)) {
            ok += u32::from(p.sport == 40000);
        }
    }
    let parse_ns = t.elapsed().as_nanos() as f64 / f64::from(n);

    let mut f = frame.clone();
    let nat = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1));
    let t = Instant::now();
    for i in 0..n {
        if let Ok(Frame::Ip(mut p)) = parse(black_box(&f)) {
            let _ = rewrite::set_src_ip(&mut f, &mut p, if i % 2 == 0 { nat } else { src });
            let _ = rewrite::set_src_port(&mut f, &mut p, i as u16);
        }
    }
    let both_ns = t.elapsed().as_nanos() as f64 / f64::from(n);
    println!("parse: {parse_ns:.1} ns/frame; parse + set_src_ip + set_src_port: {both_ns:.1} ns/frame ({ok} ok)");
}
