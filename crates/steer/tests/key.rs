//! The BPF program's flow key equals pliant_state::FlowKey (as computed by pliant_net::parse)
//! for random tuples: both families, TCP/UDP/ICMP echo/other protocols, VLAN tags. Runs the
//! real program with BPF_PROG_TEST_RUN and reads the key it recorded in `debug_key`.
//! Root only (loads BPF, creates namespaces).

mod common;

use common::{Fixture, Rng};
use pliant_net::build;
use pliant_state::key::proto;
use pliant_steer::lab::lab_ports;
use pliant_steer::{Steer, SteerOptions};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

fn rand_addr(rng: &mut Rng, v6: bool) -> IpAddr {
    // Few distinct high bytes so equal-address ties (port tie-break) happen too.
    let x = rng.next();
    if v6 {
        let mut o = [0u8; 16];
        o[0] = 0xfd;
        o[15] = (x % 3) as u8;
        o[8..14].copy_from_slice(&x.to_be_bytes()[2..8]);
        if x.checked_rem(5) == Some(0) {
            o[8..14].fill(0);
        }
        IpAddr::V6(Ipv6Addr::from(o))
    } else {
        let b = x.to_be_bytes();
        IpAddr::V4(Ipv4Addr::new(10, b[1] % 3, b[2] % 2, b[3] % 4))
    }
}

/// An ICMP error (sent by `router`-ish third address to `src`) embedding the first bytes of a
/// `src:sport -> dst:dport` TCP or UDP packet; sometimes cut short inside the embedded ports.
fn icmp_error(
    rng: &mut Rng,
    src: IpAddr,
    sport: u16,
    dst: IpAddr,
    dport: u16,
    tcp: bool,
) -> Vec<u8> {
    let (sm, dm) = ([2, 0, 0, 0, 0, 3], [2, 0, 0, 0, 0, 1]);
    let orig = if tcp {
        build::tcp(
            sm,
            dm,
            src,
            sport,
            dst,
            dport,
            0x10,
            7,
            9,
            b"original payload",
        )
    } else {
        build::udp(sm, dm, src, sport, dst, dport, b"original payload")
    };
    let ip_len = if src.is_ipv4() { 20 } else { 40 };
    let cut = match rng.next() % 4 {
        0 => ip_len + 2, // embedded ports cut off
        _ => ip_len + 8,
    };
    let inner = &orig[14..14 + cut];
    let router = rand_addr(rng, !src.is_ipv4());
    let (p, t) = if src.is_ipv4() {
        (proto::ICMP, [3u8, 11][(rng.next() % 2) as usize])
    } else {
        (proto::ICMPV6, [1u8, 2, 3][(rng.next() % 3) as usize])
    };
    build::icmp(sm, dm, router, src, p, t, 0, [0, 1400], inner)
}

#[test]
fn bpf_key_equals_rust_flow_key_for_random_tuples() {
    if !pliant_testkit::require_root() {
        return;
    }
    let fx = Fixture::new(1);
    let mut steer =
        Steer::attach(&fx.fabric(), &lab_ports(1), &SteerOptions::default()).expect("attach");
    steer.set_debug_key(true).expect("debug on");
    let ifi = steer.ifindex("fabclient").expect("client ifindex");
    let mut rng = Rng(0x5eed_1234_abcd);
    let (sm, dm) = ([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2]);
    let mut checked = 0;
    let mut inner_cases = 0;
    for i in 0..3000u32 {
        let v6 = rng.next() & 1 == 0;
        let (src, dst) = (rand_addr(&mut rng, v6), rand_addr(&mut rng, v6));
        let r = rng.next();
        let (sport, dport) = (
            (r % 7) as u16 * 10_000 + (r >> 8) as u16 % 3,
            (r >> 24) as u16,
        );
        let kind = rng.next() % 7;
        let dport = if kind == 4 { sport } else { dport };
        let frame = match kind {
            0 => build::tcp(sm, dm, src, sport, dst, dport, 0x02, 1, 0, b"x"),
            1 => build::udp(sm, dm, src, sport, dst, dport, b"y"),
            2 => build::icmp_echo(sm, dm, src, dst, sport, 1, r & 1 == 0, b"z"),
            3 => build::raw_ip(sm, dm, src, dst, 47, b"gre-ish payload"),
            5 | 6 => icmp_error(&mut rng, src, sport, dst, dport, kind == 6),
            _ => build::udp(sm, dm, src, sport, dst, dport, b"same ports"),
        };
        let frame = match rng.next() % 4 {
            0 => build::with_vlan(&frame, (i % 4000) as u16 + 1, false),
            1 => build::with_vlan(&build::with_vlan(&frame, 7, false), 9, true),
            _ => frame,
        };
        let want = match pliant_net::parse(&frame) {
            // ICMP errors steer by the embedded packet's flow.
            Ok(pliant_net::Frame::Ip(p)) => match pliant_net::icmp_error::inner(&frame, &p) {
                Some(i) => {
                    inner_cases += 1;
                    i.key
                }
                None => p.key,
            },
            other => panic!("test frame did not parse as IP: {other:?}"),
        };
        steer.test_run(&frame, ifi, 1).expect("test run");
        let got = steer.debug_key().expect("debug key");
        assert_eq!(got, want, "case {i}: frame {frame:02x?}");
        // And the Rust constructor agrees with both for the tuple we built.
        if matches!(want.proto, proto::TCP | proto::UDP) && kind != 5 && kind != 6 {
            let (k, _) = pliant_state::FlowKey::new(want.proto, src, sport, dst, dport);
            assert_eq!(k, want);
        }
        checked += 1;
    }
    assert_eq!(checked, 3000);
    assert!(
        inner_cases > 500,
        "only {inner_cases} ICMP errors with an embedded flow"
    );
    let st = steer.stats().expect("stats");
    assert_eq!(st.get(pliant_steer::layout::Stat::IcmpInner), inner_cases);
    steer.detach().expect("detach");
}
