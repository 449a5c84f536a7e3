//! `FramePort::tx_settled` on a real port: a flushed frame that still waits in a kernel queue on
//! its L2 path (here a token-bucket qdisc on a bridge port, standing in for a busy CPU's veth
//! backlog) keeps its TX-ring slot busy, so the port reports it unsettled until it leaves the
//! queue. This is what lets a migrating replica tell that its last output is really out before
//! the destination may emit (pliant-runtime, "Output order"). Needs root.
//!
//! a (PacketPort) --veth-- b: bridge [pb0, pb1 + tbf 100 kbit] --veth-- c

use std::time::{Duration, Instant};

use pliant_io::testlab::Lab;
use pliant_io::{FramePort, PacketPort, PortOptions, TxMode};

/// A 300-byte frame of an experimental ethertype (nobody in `c` consumes it; it is freed there).
fn frame(src: [u8; 6], dst: [u8; 6], i: u8) -> Vec<u8> {
    let mut f = Vec::with_capacity(300);
    f.extend_from_slice(&dst);
    f.extend_from_slice(&src);
    f.extend_from_slice(&[0x88, 0xb5]);
    f.resize(300, i);
    f
}

fn settles_within(port: &mut PacketPort, mark: u64, limit: Duration) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if port.tx_settled(mark) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    false
}

#[test]
fn frames_queued_downstream_are_not_settled_until_they_leave() {
    if !pliant_testkit::require_root() {
        return;
    }
    for mode in [TxMode::Ring, TxMode::Sendmmsg] {
        run(mode);
    }
}

fn run(mode: TxMode) {
    let mut lab = Lab::new();
    let t = lab.tag().to_string();
    let (ns_a, ns_b, ns_c) = (
        lab.add_ns("sa").unwrap(),
        lab.add_ns("sb").unwrap(),
        lab.add_ns("sc").unwrap(),
    );
    let (a0, b0, b1, c0) = (
        format!("psa{t}"),
        format!("psb{t}"),
        format!("psB{t}"),
        format!("psc{t}"),
    );
    lab.add_veth(&ns_a, &a0, &ns_b, &b0).unwrap();
    lab.add_veth(&ns_b, &b1, &ns_c, &c0).unwrap();
    for args in [
        vec!["ip", "link", "add", "br0", "type", "bridge"],
        vec!["ip", "link", "set", &b0, "master", "br0"],
        vec!["ip", "link", "set", &b1, "master", "br0"],
        vec!["ip", "link", "set", "br0", "up"],
    ] {
        lab.exec(&ns_b, &args).unwrap();
    }
    let c_mac = lab
        .in_ns(&ns_c, || {
            PacketPort::open(&c0, &PortOptions::default()).map(|p| p.mac())
        })
        .unwrap()
        .unwrap();
    let opts = PortOptions {
        tx_frame_count: 64,
        tx_mode: mode,
        ..PortOptions::default()
    };
    let mut tx = lab
        .in_ns(&ns_a, || PacketPort::open(&a0, &opts))
        .unwrap()
        .unwrap();
    // Nothing queued downstream: the frames are released once they reach `c`.
    for i in 0..8 {
        tx.send(&frame(tx.mac(), c_mac, i)).unwrap();
    }
    tx.flush().unwrap();
    let before = tx.tx_mark();
    assert!(
        settles_within(&mut tx, before, Duration::from_secs(5)),
        "frames with no queue on their path never settled"
    );
    // 100 kbit/s: 20 frames of 300 bytes need about half a second to pass.
    lab.exec(
        &ns_b,
        &[
            "tc", "qdisc", "add", "dev", &b1, "root", "tbf", "rate", "100kbit", "burst", "1600",
            "limit", "100000",
        ],
    )
    .unwrap();
    for i in 0..20 {
        tx.send(&frame(tx.mac(), c_mac, i)).unwrap();
    }
    tx.flush().unwrap();
    let mark = tx.tx_mark();
    assert!(
        !tx.tx_settled(mark),
        "{mode:?}: flushed frames waiting in a qdisc downstream were reported settled"
    );
    if mode == TxMode::Ring {
        // Per-slot tracking: frames before the mark are judged alone. (sendmmsg can only tell
        // "nothing in flight".)
        assert!(tx.tx_settled(before), "older frames became unsettled");
    }
    assert!(
        settles_within(&mut tx, mark, Duration::from_secs(10)),
        "{mode:?}: frames never settled after the qdisc let them through"
    );
}
