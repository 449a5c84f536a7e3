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
