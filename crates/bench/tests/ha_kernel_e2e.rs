//! The kernel HA peer for real: conntrackd + keepalived NAT pair in namespaces, txload through
//! it, then the master is killed mid-load and the connections must survive on the backup.
//! Needs root, conntrackd, keepalived, nftables (`pliant_testkit` checks them).

use pliant_bench::ha_kernel::{KernelPeer, Router, SERVER_IP};
use pliant_bench::txload::{self, Marker, TxClientOpts, TxServer, PROBE_PORT, TX_PORT};
use std::net::SocketAddrV4;
use std::sync::Arc;
use std::time::Duration;

#[test]
fn kernel_peer_carries_transactions_and_survives_a_master_kill() {
    if !pliant_testkit::require_root()
        || !pliant_testkit::require_tool("conntrackd", "conntrackd")
        || !pliant_testkit::require_tool("keepalived", "keepalived")
        || !pliant_testkit::require_tool("nft", "nftables")
    {
        return;
    }
    let mut peer =
        KernelPeer::up(std::path::Path::new(pliant_bench::ha::KERNEL_RUN_ROOT)).expect("peer up");
    assert_eq!(peer.master(), Some(Router::A));
    let srv = TxServer::start(
        Some(&peer.server_ns()),
        SocketAddrV4::new(SERVER_IP, TX_PORT),
        PROBE_PORT,
    )
    .expect("server");
    let mut o = TxClientOpts::new(
        SocketAddrV4::new(SERVER_IP, TX_PORT),
        16,
        Duration::from_secs(1),
    );
    o.warmup = Duration::from_millis(200);
    let m = Arc::new(Marker::default());
    let r = txload::run_client(Some(&peer.client_ns()), &o, &m).expect("client");
    eprintln!(
        "steady: {:.0} txn/s p50 {:?} us p99 {:?} us",
        r.transactions_per_s, r.latency_us_p50, r.latency_us_p99
    );
    assert!(r.transactions > 100, "{r:?}");
    assert_eq!(r.resets + r.errors, 0, "{r:?}");
    // The backup learnt the flows over the sync link.
    assert!(peer.sync_tx_bytes().expect("sync bytes") > 0);

    // Failover under load.
    let mut o = o.clone();
    o.duration = Duration::from_secs(4);
    o.probe_flows = 4;
    let m = Arc::new(Marker::default());
    let h = txload::spawn_client(Some(peer.client_ns()), o, m.clone()).expect("spawn");
    std::thread::sleep(Duration::from_millis(1500));
    let killed = peer.kill_master(&m).expect("kill");
    assert_eq!(killed, Router::A);
    let r = txload::join_client(h).expect("client");
    eprintln!(
        "failover: probe recovery {:?} ms, tcp stall {:.0} ms, survived {}/{}; B has {:?} entries",
        r.probe_recovery_ms(),
        r.tcp_stall_ms,
        r.conns_survived(true),
        r.connections,
        peer.conntrack_count(Router::B)
    );
    assert!(
        peer.holds_vips(Router::B),
        "{}",
        peer.log_tail("rb-keepalived.out", 10)
    );
    // Every probe flow is forwarded again by the new master (each has a recovery time).
    assert_eq!(r.probes.len(), 4, "{:?}", r.probes);
    assert!(
        r.probes
            .iter()
            .all(|p| p.recovery_ms.is_some_and(|ms| ms > 0.0) && p.echoed > 0),
        "{:?}",
        r.probes
    );
    eprintln!("rb notify: {}", peer.log_tail("rb-notify.log", 10));
    eprintln!("rb keepalived: {}", peer.log_tail("rb-keepalived.out", 30));
    for c in r
        .per_conn
        .iter()
        .filter(|c| c.error.is_some() || c.first_done_after_mark_ms.is_none())
    {
        eprintln!("failed conn: {c:?}");
    }
    assert_eq!(r.conns_survived(true), 16, "{:?}", r.per_conn);
    drop(srv);
}
