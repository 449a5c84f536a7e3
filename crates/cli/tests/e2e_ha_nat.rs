//! End-to-end Pico HA with the NAT: three replicas r1, r2, r3 in an HA lab,
//! the controller protecting every replica (chords over the others, 1 kHz), long iperf3 TCP
//! and large curl downloads through r1, r1 SIGKILLed mid-transfer. Every connection completes
//! without reset and with the served sha256; the server sees every connection from the same
//! NAT mapping (address and port) before and after the failover; the dead owner is fenced;
//! survivors' output audit shows no packet released before its checkpoint was acknowledged.
//!
//! Needs root (`pliant_testkit::require_root`). Run in release:
//! `cargo test --release -p pliant-cli --test e2e_ha_nat -- --test-threads=1 --nocapture`.

mod common;
use common::ha::*;
use pliant_lab::PliantNf;

#[test]
fn nat_primary_killed_mid_transfer_loses_no_connection_and_no_mapping() {
    let Some(mut run) = ha_up("nat", PliantNf::nat(), &[("32M.bin", 32 << 20)]) else {
        return;
    };
    let m = kill_primary_mid_transfer(&mut run, "32M.bin");
    eprintln!(
        "nat failover: kill->detect {:.1} ms, activate {:.2} ms, steer {:.2} ms, \
         kill->steered (as the test saw it) {:.0} ms, {} flows activated",
        m.detect_ms, m.activate_ms, m.steer_ms, m.kill_to_steered_ms, m.activated
    );
}

/// The same with every channel between the replicas on TCP over the lab's management network
/// (as between hosts): replication, the migration peer channel. Nothing of theirs may be a
/// unix socket in the shared run directory, and the primaries' backups are TCP endpoints.
#[test]
fn nat_primary_killed_mid_transfer_over_tcp_channels() {
    let Some(mut run) = ha_up_on(
        "nattcp",
        PliantNf::nat(),
        &[("32M.bin", 32 << 20)],
        pliant_lab::mgmt::Transport::Tcp,
    ) else {
        return;
    };
    let dir = run.lab().run_dir().to_path_buf();
    let unix_channels: Vec<String> = std::fs::read_dir(&dir)
        .expect("run dir")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".repl.sock") || n.ends_with(".peer.sock"))
        .collect();
    assert!(
        unix_channels.is_empty(),
        "unix channel sockets: {unix_channels:?}"
    );
    assert_private_hosts(run.lab(), &run.members());
    let sock = run
        .lab()
        .replica_socket(1)
        .expect("r1")
        .display()
        .to_string();
    let st = common::ha::control(
        std::path::Path::new(&sock),
        &pliant_proto::Request::HaStatus,
    )
    .expect("ha_status");
    let text = st["policy"].to_string();
    assert!(
        text.contains("10.254.0."),
        "backups are not TCP endpoints: {st}"
    );
    let m = kill_primary_mid_transfer(&mut run, "32M.bin");
    eprintln!(
        "nat failover over TCP: kill->detect {:.1} ms, activate {:.2} ms, steer {:.2} ms, \
         kill->steered {:.0} ms, {} flows activated",
        m.detect_ms, m.activate_ms, m.steer_ms, m.kill_to_steered_ms, m.activated
    );
}
