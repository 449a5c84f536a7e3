//! End-to-end Pico HA with MBServ. MBServ drops every packet that does not
//! fit a known flow's TCP state machine, so a failover without the replicated state would break
//! every connection; with Pico replication the survivors continue them. Same scenario as
//! `e2e_ha_nat` (see `common::ha::kill_primary_mid_transfer`): r1 SIGKILLed mid-transfer, every
//! connection completes, server-side peers unchanged (no NAT: the client's own ports), fencing,
//! output audit clean.
//!
//! Needs root (`pliant_testkit::require_root`). Run in release:
//! `cargo test --release -p pliant-cli --test e2e_ha_mbserv -- --test-threads=1 --nocapture`.

mod common;
use common::ha::*;
use common::nf;

#[test]
fn mbserv_primary_killed_mid_transfer_loses_no_connection() {
    let Some(mut run) = ha_up(
        "mbserv",
        nf(
            "mbserv",
            "[mbserv]\npatterns = [\"malicious\", \"attack\"]\n",
        ),
        &[("32M.bin", 32 << 20)],
    ) else {
        return;
    };
    let m = kill_primary_mid_transfer(&mut run, "32M.bin");
    eprintln!(
        "mbserv failover: kill->detect {:.1} ms, activate {:.2} ms, steer {:.2} ms, \
         kill->steered (as the test saw it) {:.0} ms, {} flows activated",
        m.detect_ms, m.activate_ms, m.steer_ms, m.kill_to_steered_ms, m.activated
    );
}
