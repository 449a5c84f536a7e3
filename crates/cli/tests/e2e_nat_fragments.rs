//! End-to-end: 3000-byte UDP datagrams (fragmented by the sending host's kernel: the lab's
//! links have an MTU of 1500) round-trip through the NAT in both directions — client to a UDP
//! echo server, the echo back — against the kernel NAT and the pliant NAT in the same run, from
//! six client sockets. pliant runs three replicas, so the flows spread over them and every
//! fragment must reach the replica its datagram's first fragment went to (the fabric tracks
//! fragments by IP id; the later ones carry no ports); the replicas' `reassembly` stats show
//! both directions of every flow reassembled. Needs root.

mod common;
use pliant_lab::{Lab, LabSpec, PliantNf, ReplicaMode, Role, SERVER_IP};
use serde_json::Value;
use std::time::Duration;

const ECHO: &str = "import socket\n\
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
s.bind(('0.0.0.0', 7777))\n\
while True:\n\
\x20   d, a = s.recvfrom(65535)\n\
\x20   s.sendto(d, a)\n";

/// From each of six sockets (six flows), sends 3000 bytes and waits for them back (retrying
/// while the echo server starts); prints `ok` or what went wrong.
const CLIENT: &str = "import os, socket, sys\n\
bad = []\n\
for i in range(6):\n\
\x20   d = os.urandom(3000)\n\
\x20   s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
\x20   s.settimeout(0.5)\n\
\x20   got = 'no reply'\n\
\x20   for _ in range(10):\n\
\x20       s.sendto(d, (sys.argv[1], 7777))\n\
\x20       try:\n\
\x20           r, a = s.recvfrom(65535)\n\
\x20       except socket.timeout:\n\
\x20           continue\n\
\x20       got = 'ok' if r == d else 'mismatch %d bytes' % len(r)\n\
\x20       break\n\
\x20   if got != 'ok':\n\
\x20       bad.append('flow %d (port %d): %s' % (i, s.getsockname()[1], got))\n\
print('; '.join(bad) if bad else 'ok')\n";

fn stats(sock: &std::path::Path) -> Value {
    pliant_lab::ha::control_client(sock)
        .call(&pliant_proto::Request::Stats)
        .expect("stats")
}

/// Round trips through `lab`'s NAT; the pliant replicas' reassembly stats, summed over its
/// first `replicas` replicas (Null for the kernel).
fn round_trip(lab: &Lab, replicas: u8) -> (String, Value) {
    let dir = lab.run_dir().to_path_buf();
    let (echo, client) = (dir.join("echo.py"), dir.join("client.py"));
    std::fs::write(&echo, ECHO).expect("write echo");
    std::fs::write(&client, CLIENT).expect("write client");
    let mut echo_server = lab
        .spawn(
            Role::Server,
            &["python3", &echo.display().to_string()],
            &dir.join("echo.log"),
        )
        .expect("echo server");
    let out = lab
        .exec_timeout(
            Role::Client,
            &["python3", &client.display().to_string(), SERVER_IP],
            Duration::from_secs(45),
        )
        .expect("client");
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
    let verdict = format!("{}{}", out.stdout.trim(), out.stderr.trim());
    echo_server.kill().ok();
    echo_server.wait().ok();
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
