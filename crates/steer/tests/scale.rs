//! Steering scale check (ignored by default; the bench runs it):
//! `cargo test -p pliant-steer --release --test scale -- --ignored --nocapture`
//! 100,000 concurrent flows pinned in the conn table and 10,000 exceptions: prints one JSON line
//! with per-update costs and the program's per-packet cost (BPF_PROG_TEST_RUN, kernel-timed)
//! with and without the exceptions installed. No timing assertions here (noisy machine); the
//! bench applies the 10% criterion.

mod common;

use common::Fixture;
use pliant_net::build;
use pliant_state::key::proto;
use pliant_state::FlowKey;
use pliant_steer::lab::lab_ports;
use pliant_steer::layout::Stat;
use pliant_steer::{per_item_us, Steer, SteerOptions, TC_ACT_REDIRECT};
use std::net::{IpAddr, Ipv4Addr};

const FLOWS: u32 = 100_000;
const EXCEPTIONS: u32 = 10_000;

fn tuple(i: u32) -> (Ipv4Addr, u16, Ipv4Addr, u16) {
    (
        Ipv4Addr::new(10, 77, (i >> 16) as u8, (i >> 8) as u8),
        10_000 + (i & 0xff) as u16,
        Ipv4Addr::new(10, 77, 2, 2),
        80,
    )
}

fn frames() -> Vec<Vec<u8>> {
    (0..FLOWS)
        .map(|i| {
            let (s, sp, d, dp) = tuple(i);
            build::udp(
                [2; 6],
                [4; 6],
                IpAddr::V4(s),
                sp,
                IpAddr::V4(d),
                dp,
                &[0u8; 18],
            )
        })
        .collect()
}

/// Mean kernel-measured ns per packet over all frames, each run `repeat` times (repeat > 1
/// amortises the kernel's per-call timing overhead; repeat 1 touches every flow once).
fn pass(steer: &Steer, ifi: u32, frames: &[Vec<u8>], repeat: u32) -> f64 {
    let mut total = 0u64;
    for f in frames {
        let r = steer.test_run(f, ifi, repeat).expect("test run");
        assert_eq!(r.retval, TC_ACT_REDIRECT);
        total += u64::from(r.duration_ns);
    }
    total as f64 / frames.len() as f64
}

#[test]
#[ignore = "scale measurement; run explicitly (root)"]
fn hundred_thousand_flows_ten_thousand_exceptions() {
    if !pliant_testkit::require_root() {
        return;
    }
    let fx = Fixture::new(4);
    let mut steer =
        Steer::attach(&fx.fabric(), &lab_ports(4), &SteerOptions::default()).expect("attach");
    let ring_us = per_item_us(1, || steer.set_ring_maglev(&[1, 2, 3, 4], 65_537)).expect("ring");
    let ifi = steer.ifindex("fabclient").expect("ifindex");
    let frames = frames();
    let learn_ns = pass(&steer, ifi, &frames, 1);
    let pinned = steer.stats().expect("stats").get(Stat::Ring);
    assert_eq!(pinned, u64::from(FLOWS), "every flow learned a conn pin");
    let base_ns = pass(&steer, ifi, &frames, 1);
    let sample: Vec<Vec<u8>> = frames.iter().step_by(100).cloned().collect();
    let base_rep_ns = pass(&steer, ifi, &sample, 200);

    let keys: Vec<FlowKey> = (0..FLOWS)
        .map(|i| {
            let (s, sp, d, dp) = tuple(i);
            FlowKey::v4(proto::UDP, s, sp, d, dp).0
        })
        .collect();
    // Single updates (1000) vs one batch of the 10,000 (every 10th flow moved).
    let single_us = per_item_us(1000, || {
        for k in &keys[..1000] {
            steer.set_exception(k, 1)?;
        }
        Ok(())
    })
    .expect("single");
    let moved: Vec<(FlowKey, u32)> = keys
        .iter()
        .step_by((FLOWS / EXCEPTIONS) as usize)
        .map(|k| (*k, 2))
        .collect();
    steer.remove_exceptions(&keys[..1000]).expect("clear");
    let batch_us = per_item_us(moved.len(), || steer.set_exceptions(&moved)).expect("batch");
    assert_eq!(steer.exceptions().expect("list").len(), EXCEPTIONS as usize);
    let exc_ns = pass(&steer, ifi, &frames, 1);
    let st = steer.stats().expect("stats");
    assert_eq!(st.get(Stat::Exception), u64::from(EXCEPTIONS));
    // The sample (every 100th flow) is all moved flows (every 10th): the worst case.
    let exc_rep_ns = pass(&steer, ifi, &sample, 200);
    let conn_entries = steer.conn_entries().expect("conn").len();
    println!(
        "{{\"flows\":{FLOWS},\"exceptions\":{EXCEPTIONS},\"conn_entries\":{conn_entries},\
\"ring_install_us\":{ring_us:.0},\"exception_update_us_single\":{single_us:.2},\
\"exception_update_us_batch\":{batch_us:.2},\"bpf_ns_per_pkt_learn\":{learn_ns:.1},\
\"bpf_ns_per_pkt\":{base_ns:.1},\"bpf_ns_per_pkt_with_exceptions\":{exc_ns:.1},\
\"bpf_ns_per_pkt_hot\":{base_rep_ns:.1},\"bpf_ns_per_pkt_hot_with_exceptions\":{exc_rep_ns:.1},\
\"rate_ratio_with_exceptions\":{:.3},\"conn_insert_fail\":{}}}",
        base_ns / exc_ns,
        st.get(Stat::ConnInsertFail)
    );
}
