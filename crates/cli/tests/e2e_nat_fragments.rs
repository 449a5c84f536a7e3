//! End-to-end: 3000-byte UDP datagrams (fragmented by the sending host's kernel: the lab's
//! links have an MTU of 1500) round-trip through the NAT in both directions — client to a UDP
//! echo server, the echo back — against the kernel NAT and the pliant NAT in the same run, from
//! six client sockets. pliant runs three replicas, so the flows spread over them and every
//! fragment must reach the replica its datagram's first fragment went to (the fabric tracks
//! fragments by IP id; the later ones carry no ports); the replicas' `reassembly` stats show
//! both directions of every flow reassembled. Needs root.

mod common;
use pliant_lab::{Lab, LabSpec, PliantNf, ReplicaMode};
use serde_json::Value;
use std::time::Duration;

fn stats(sock: &std::path::Path) -> Value {
    pliant_lab::ha::control_client(sock)
        .call(&pliant_proto::Request::Stats)
        .expect("stats")
}

/// Round trips through `lab`'s NAT (six UDP sockets, 3000 bytes each way); the pliant replicas' reassembly stats, summed over its
/// first `replicas` replicas (Null for the kernel).
fn round_trip(lab: &Lab, replicas: u8) -> (String, Value) {
    // Six flows, 3000 bytes each way.
    let checks = common::lab_scripts::udp_round_trips("flow", 6, 3000, 10);
    let verdict = common::lab_scripts::run_client(lab, &checks, Duration::from_secs(45));
    let mut st = Value::Null;
    for n in 1..=replicas {
        let Some(sock) = lab.replica_socket(n) else {
            continue;
        };
        let all = stats(sock);
        let r = &all["reassembly"];
        eprintln!(
            "replica r{n} reassembly {r} drops {} nf {}",
            all["drops"], all["nf_counters"]
        );
        let sum = |k: &str| st[k].as_u64().unwrap_or(0) + r[k].as_u64().unwrap_or(0);
        st = serde_json::json!({
            "reassembled": sum("reassembled"),
            "pending_datagrams": sum("pending_datagrams"),
            "replicas_reassembling": st["replicas_reassembling"].as_u64().unwrap_or(0)
                + u64::from(r["reassembled"].as_u64().unwrap_or(0) > 0),
        });
    }
    (verdict, st)
}

#[test]
fn a_3000_byte_udp_datagram_round_trips_through_the_nat() {
    if !pliant_testkit::require_root() || !pliant_testkit::require_tool("python3", "python3") {
        return;
    }
    let mut spec = LabSpec::new(ReplicaMode::KernelNat);
    spec.progress = false;
    spec.files.clear();
    let lab = Lab::up(spec).unwrap_or_else(|e| panic!("lab up: {e}"));
    let (kernel, _) = round_trip(&lab, 0);
    lab.down().ok();
    // Three replicas with the controller (it owns the NAT port blocks that steer the return
    // traffic, and protects each replica).
    let Some(run) = common::ha::ha_up("frag", PliantNf::nat(), &[]) else {
        return;
    };
    let (pliant, reasm) = round_trip(run.lab(), 3);
    drop(run);
    eprintln!("kernel_nat: {kernel}; pliant_nat: {pliant}, reassembly {reasm}");
    assert_eq!(kernel, "ok", "kernel NAT (the peer)");
    assert_eq!(pliant, "ok", "pliant NAT");
    // Both directions of every flow went through reassembly (the request, then the echo).
    assert!(reasm["reassembled"].as_u64().unwrap_or(0) >= 12, "{reasm}");
    assert_eq!(reasm["pending_datagrams"], 0, "{reasm}");
    assert!(
        reasm["replicas_reassembling"].as_u64().unwrap_or(0) >= 2,
        "six flows on one replica: the fragments' steering was not exercised: {reasm}"
    );
}
