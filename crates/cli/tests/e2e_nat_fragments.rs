//! End-to-end: a 3000-byte UDP datagram (fragmented by the sending host's kernel: the lab's
//! links have an MTU of 1500) round-trips through the NAT in both directions — client to a UDP
//! echo server, the echo back — against the kernel NAT and the pliant NAT in the same run. For
//! pliant, the replica's `reassembly` stats show both directions reassembled. Needs root.

use pliant_lab::{Lab, LabSpec, PliantNf, ReplicaMode, Role, SERVER_IP};
use serde_json::Value;
use std::path::PathBuf;
use std::time::Duration;

const ECHO: &str = "import socket\n\
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
s.bind(('0.0.0.0', 7777))\n\
while True:\n\
\x20   d, a = s.recvfrom(65535)\n\
\x20   s.sendto(d, a)\n";

/// Sends 3000 bytes, waits for them back (retrying while the echo server starts); prints
/// `ok` or what went wrong.
const CLIENT: &str = "import os, socket, sys\n\
d = os.urandom(3000)\n\
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
s.settimeout(0.5)\n\
for _ in range(10):\n\
\x20   s.sendto(d, (sys.argv[1], 7777))\n\
\x20   try:\n\
\x20       r, a = s.recvfrom(65535)\n\
\x20   except socket.timeout:\n\
\x20       continue\n\
\x20   print('ok' if r == d else 'mismatch %d bytes' % len(r))\n\
\x20   sys.exit(0)\n\
print('no reply')\n";

fn stats(sock: &std::path::Path) -> Value {
    pliant_lab::ha::control_client(sock)
        .call(&pliant_proto::Request::Stats)
        .expect("stats")
}

/// Round trip on a fresh lab; the pliant replica's reassembly stats (Null for the kernel).
fn round_trip(mode: ReplicaMode) -> (String, Value) {
    let mut spec = LabSpec::new(mode);
    spec.pliant_bin = Some(PathBuf::from(env!("CARGO_BIN_EXE_pliant")));
    spec.progress = false;
    spec.files.clear();
    let lab = Lab::up(spec).unwrap_or_else(|e| panic!("lab up: {e}"));
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
            Duration::from_secs(20),
        )
        .expect("client");
    let st = lab
        .replica_socket(1)
        .map(|s| stats(s)["reassembly"].clone())
        .unwrap_or(Value::Null);
    let verdict = format!("{}{}", out.stdout.trim(), out.stderr.trim());
    echo_server.kill().ok();
    echo_server.wait().ok();
    lab.down().ok();
    (verdict, st)
}

#[test]
fn a_3000_byte_udp_datagram_round_trips_through_the_nat() {
    if !pliant_testkit::require_root() || !pliant_testkit::require_tool("python3", "python3") {
        return;
    }
    let (kernel, _) = round_trip(ReplicaMode::KernelNat);
    let (pliant, reasm) = round_trip(ReplicaMode::Pliant {
        config: PliantNf::nat(),
    });
    eprintln!("kernel_nat: {kernel}; pliant_nat: {pliant}, reassembly {reasm}");
    assert_eq!(pliant, "ok", "pliant NAT");
    // Both directions went through reassembly (the request, then the echo).
    assert!(reasm["reassembled"].as_u64().unwrap_or(0) >= 2, "{reasm}");
    assert_eq!(reasm["pending_datagrams"], 0, "{reasm}");
}
