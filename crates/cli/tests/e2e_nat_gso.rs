//! End-to-end: TCP super-frames (the client's kernel TSO over veth, offloads on) whose
//! segments do not fit the replica's outside port and have DF clear (the client runs with
//! `net.ipv4.ip_no_pmtu_disc = 1`) are segmented by pliant in software and each segment
//! fragmented to the port's MTU, as the kernel's forwarding path does, instead of being
//! dropped (`gso_too_big`). The replica's outside port has MTU 1280 (set before the replica
//! opens it) while the server's link has 1500, so the server's MSS (1460) makes the client's
//! segments 1500-byte packets. Proves: a 4 MiB upload arrives whole at the server, the
//! replica counted segmented super-frames and fragments on its outside port, and dropped no
//! super-frame. Needs root.

mod common;
use pliant_lab::{Lab, LabSpec, PliantNf, ReplicaMode, Role};
use std::time::Duration;

/// Counts the bytes of one connection and answers with the count.
const SINK: &str = "import socket\n\
s = socket.socket()\n\
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
s.bind(('0.0.0.0', 9000))\n\
s.listen(1)\n\
c, a = s.accept()\n\
n = 0\n\
while True:\n\
\x20   d = c.recv(1 << 16)\n\
\x20   if not d:\n\
\x20       break\n\
\x20   n += len(d)\n\
c.sendall(str(n).encode())\n\
c.close()\n";

/// Sends 4 MiB in 64 KiB writes (TSO builds super-frames of them), prints the count the
/// server read.
const UPLOAD: &str = "import socket, sys, time\n\
for _ in range(50):\n\
\x20   try:\n\
\x20       s = socket.create_connection((sys.argv[1], 9000), timeout=20)\n\
\x20       break\n\
\x20   except OSError:\n\
\x20       time.sleep(0.1)\n\
b = bytes(range(256)) * 256\n\
for _ in range(64):\n\
\x20   s.sendall(b)\n\
s.shutdown(socket.SHUT_WR)\n\
print(s.recv(64).decode())\n";

#[test]
fn super_frames_too_big_for_the_port_are_segmented_and_fragmented() {
    if !pliant_testkit::require_root() || !pliant_testkit::require_tool("python3", "python3") {
        return;
    }
    let bin = env!("CARGO_BIN_EXE_pliant");
    let mut spec = LabSpec::new(ReplicaMode::Pliant {
        config: PliantNf::nat(),
    });
    spec.progress = false;
    spec.files.clear();
    // The outside port's MTU is read when the replica opens it: lower it first (the config
    // path is appended to the command: `$0` of the shell).
    spec.replica_command = Some(vec![
        "sh".into(),
        "-c".into(),
        format!("ip link set r1out mtu 1280 && exec {bin} replica --config \"$0\""),
    ]);
    let lab = Lab::up(spec).unwrap_or_else(|e| panic!("lab up: {e}"));
    lab.exec_timeout(
        Role::Client,
        &["sysctl", "-qw", "net.ipv4.ip_no_pmtu_disc=1"],
        Duration::from_secs(5),
    )
    .expect("no PMTU discovery on the client: DF clear");
    let uploaded = common::lab_scripts::run_scripts(&lab, SINK, UPLOAD, Duration::from_secs(60));
    let st = pliant_lab::ha::control_client(lab.replica_socket(1).unwrap())
        .call(&pliant_proto::Request::Stats)
        .expect("stats");
    let outside = &st["engine"]["outside"];
    eprintln!(
        "upload: {uploaded}; outside {outside}; rx_gso_frames {}; drops {}",
        st["ports"]["inside"]["rx_gso_frames"], st["drops"]
    );
    lab.down().ok();
    assert_eq!(uploaded, (4u32 << 20).to_string());
    let n = |k: &str| outside[k].as_u64().unwrap_or(0);
    assert!(
        n("gso_segmented") > 0,
        "no super-frame segmented: {outside}"
    );
    assert!(n("gso_segments_sent") > n("gso_segmented"));
    // Every segment above 1280 bytes was fragmented (only a super-frame's last segment may
    // be short enough), each 1500-byte packet into two.
    assert!(n("fragmented") >= n("gso_segments_sent") - n("gso_segmented"));
    assert_eq!(n("fragments_sent"), 2 * n("fragmented"));
    assert_eq!(st["drops"]["gso_too_big"].as_u64().unwrap_or(0), 0);
}
