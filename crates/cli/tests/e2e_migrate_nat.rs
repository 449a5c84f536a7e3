//! End-to-end: an iperf3 TCP transfer through the NAT on two pliant replicas behind the
//! tc-BPF fabric, with every flow of the owning replica (the iperf3 control and data
//! connections) migrated to the other replica and back while data flows.
//!
//! Each replica allocates external ports from its own block (`set_port_blocks`) and the fabric
//! steers return traffic by destination port to the block's owner (`port_owner`); a migrated
//! mapping keeps its port, and `migrate` passes its alias (the external tuple) to the steering
//! update, so its return traffic goes to the new owner. A sequence-numbered UDP stream through
//! the NAT is moved with the iperf3 connections each time (TCP retransmits what a move drops;
//! a numbered datagram stream shows it). Proves: the transfer completes (no reset: iperf3 exits
//! 0 with its JSON report), both moves report every flow moved and the UDP flow listed on the
//! destination afterwards, datagrams were sent while the moves ran, the receiver saw 0 lost,
//! 0 reordered and 0 duplicated datagrams, no drop reason that could be a moved flow's packet
//! is non-zero on either replica (the whole drops map), and the fabric dropped nothing for a
//! dead replica. Needs root (`pliant_testkit::require_root`).

mod common;
use common::migration::{ask, control_of};

use pliant_lab::{Lab, LabSpec, PliantNf, ReplicaMode, Role, SERVER_IP};
use pliant_proto::Request;
use pliant_runtime::migrate_client::migrate;
use pliant_state::FlowKey;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The sequence-numbered UDP stream's ports.
const UDP_SPORT: u16 = 40000;
const UDP_DPORT: u16 = 9000;

/// The default peer socket beside a control socket (`ReplicaConfig::peer_socket`).
fn peer_of(sock: &str) -> String {
    match sock.strip_suffix(".sock") {
        Some(stem) => format!("{stem}.peer.sock"),
        None => format!("{sock}.peer"),
    }
}

fn wait_for<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let end = Instant::now() + timeout;
    while Instant::now() < end {
        if let Some(v) = f() {
            return v;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("timed out waiting for {what}");
}

/// Kills the client (a process this test started) even if the test panics.
struct ChildGuard(std::process::Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Whether replica `sock` lists flow `key`.
fn holds(sock: &str, key: &FlowKey) -> bool {
    let k = key.to_string();
    ask(sock, Request::Flows)["flows"]
        .as_array()
        .is_some_and(|fs| fs.iter().any(|f| f["key"] == k.as_str()))
}

fn flows_on(sock: &str) -> Vec<FlowKey> {
    ask(sock, Request::Flows)["flows"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[])
        .iter()
        .filter_map(|f| f["key"].as_str()?.parse().ok())
        .filter(|k: &FlowKey| k.proto == 6)
        .collect()
}

#[test]
fn iperf3_through_nat_survives_two_migrations() {
    two_migrations(pliant_lab::mgmt::Transport::Unix);
}

/// The same between replicas on private hosts that reach each other over TCP (the peer
/// channel on the management network, as between machines).
#[test]
fn iperf3_through_nat_survives_two_migrations_over_tcp() {
    two_migrations(pliant_lab::mgmt::Transport::Tcp);
}

fn two_migrations(transport: pliant_lab::mgmt::Transport) {
    if !pliant_testkit::require_root() {
        return;
    }
    let mut spec = LabSpec::new(ReplicaMode::Pliant {
        config: PliantNf::nat(),
    });
    spec.replicas = 2;
    spec.transport = transport;
    let tcp = transport == pliant_lab::mgmt::Transport::Tcp;
    // Where each replica's peer channel listens.
    let peer = |i: usize, sock: &str| match tcp {
        true => format!(
            "{}:{}",
            pliant_lab::mgmt::addr(i as u8 + 1),
            pliant_lab::mgmt::PEER_PORT
        ),
        false => peer_of(sock),
    };
    spec.pliant_bin = Some(PathBuf::from(env!("CARGO_BIN_EXE_pliant")));
    spec.disable_offloads = true;
    let lab = Lab::up(spec).unwrap_or_else(|e| panic!("lab up: {e}"));
    let socks: Vec<String> = (1..=2)
        .map(|n| {
            lab.replica_socket(n)
                .expect("replica socket")
                .display()
                .to_string()
        })
        .collect();
    if tcp {
        common::ha::assert_private_hosts(&lab, &[1, 2]);
    }
    let mut maps =
        pliant_steer::SteerMaps::open_pinned(&pliant_steer::lab::pin_dir(&lab.netns(Role::Fabric)))
            .expect("open the fabric's pinned steering maps");
    let blocks = [(20000u16, 29999u16), (30000, 39999)];
    for (i, (lo, hi)) in blocks.iter().enumerate() {
        let v = ask(
            &socks[i],
            Request::SetPortBlocks {
                blocks: vec![(*lo, *hi)],
            },
        );
        assert_eq!(v["ok"], true, "{v}");
        maps.set_port_owner(*lo..=*hi, Some(i as u32 + 1))
            .expect("port owner");
    }

    let dir = lab.run_dir().to_path_buf();
    let server = lab
        .spawn(
            Role::Server,
            &["iperf3", "-s", "-1"],
            &dir.join("iperf3-server.log"),
        )
        .expect("iperf3 server");
    let _server = ChildGuard(server);
    std::thread::sleep(Duration::from_millis(500));
    let client_log = dir.join("iperf3-client.log");
    let client = lab
        .spawn(
            Role::Client,
            // Paced: unpaced, iperf3 saturates the replica's RX ring and the kernel drops
            // frames of every flow on it (measured: ~3% of the inside port's frames, 220 of
            // 3000 datagrams before any move), which would bury what a move loses.
            &["iperf3", "-c", SERVER_IP, "-t", "6", "-b", "100M", "-J"],
            &client_log,
        )
        .expect("iperf3 client");
    let mut client = ChildGuard(client);

    // The UDP stream starts on the replica most iperf3 connections landed on (steered there
    // before its first datagram), so every move carries it and the data connection. iperf3
    // opens its control connection first and the data connection after it: wait for both,
    // they may land on different replicas.
    let first = wait_for("iperf3 flows", Duration::from_secs(10), || {
        let per: Vec<usize> = (0..2).map(|i| flows_on(&socks[i]).len()).collect();
        (per.iter().sum::<usize>() >= 2).then(|| usize::from(per[1] > per[0]))
    });
    let udp_key = common::migration::udp_key(UDP_SPORT, UDP_DPORT);
    maps.set_exceptions(&[(udp_key, first as u32 + 1)])
        .expect("steer the UDP stream");
    let udp = common::migration::SeqStream::start(&lab, UDP_SPORT, UDP_DPORT, 5000.0);
    udp.wait_arriving(Duration::from_secs(5));
    wait_for(
        "the UDP flow on its replica",
        Duration::from_secs(5),
        || holds(&socks[first], &udp_key).then_some(()),
    );

    let mut moved_total = 0;
    let mut sent_during_moves = Vec::new();
    let mut held_released = Vec::new();
    for round in 0..2 {
        std::thread::sleep(Duration::from_millis(1500));
        // The replica holding the UDP stream moves it with the TCP flows it holds.
        let src = wait_for("the UDP flow", Duration::from_secs(10), || {
            (0..2).find(|i| holds(&socks[*i], &udp_key))
        });
        let mut keys = flows_on(&socks[src]);
        assert!(
            !keys.is_empty(),
            "move {round}: no iperf3 connection on r{} with the UDP flow",
            src + 1
        );
        let dst = 1 - src;
        keys.push(udp_key);
        let sent_before = udp.sent();
        let v = migrate(
            &control_of(&socks[src]),
            &control_of(&socks[dst]),
            &peer(dst, &socks[dst]),
            &keys,
            |all| {
                let entries: Vec<(FlowKey, u32)> =
                    all.iter().map(|k| (*k, dst as u32 + 1)).collect();
                maps.set_exceptions(&entries).expect("steering update");
            },
        )
        .unwrap_or_else(|e| panic!("move {round}: {e}"));
        sent_during_moves.push(udp.sent() - sent_before);
        held_released.push(v["pause"]["released_packets"].as_u64().unwrap_or(0));
        assert_eq!(v["moved"], keys.len(), "move {round}: {v}");
        assert_eq!(v["failed"], json!([]), "move {round}: {v}");
        assert!(
            holds(&socks[dst], &udp_key) && !holds(&socks[src], &udp_key),
            "move {round}: the UDP flow is not (only) on the destination r{}",
            dst + 1
        );
        moved_total += keys.len();
        eprintln!("move {round}: {v}");
    }
    assert!(moved_total >= 4);
    // Datagrams were sent while the moves ran (not only before and after them), so the
    // receiver's counts below cover the moves themselves. Summed over the moves: a sender
    // thread descheduled for one whole move (a few ms) is possible on a busy machine.
    assert!(
        sent_during_moves.iter().sum::<u64>() > 0,
        "no datagram sent during the moves: {sent_during_moves:?}"
    );
    // Frames the kernel dropped on a full replica RX ring (a descheduled or saturated
    // replica) lose datagrams without any move: shown with a failure to tell the two apart.
    let ring_drops: Vec<u64> = socks
        .iter()
        .map(|s| {
            let st = ask(s, Request::Stats);
            ["inside", "outside"]
                .iter()
                .map(|p| st["ports"][p]["rx_kernel_drops"].as_u64().unwrap_or(0))
                .sum()
        })
        .collect();
    let totals = udp.finish_loss_free(&format!(
        "UDP through two NAT migrations (RX ring drops per replica: {ring_drops:?})"
    ));
    eprintln!(
        "UDP stream: {totals:?}; sent during each move {sent_during_moves:?}, held at the \
         destination and released {held_released:?}"
    );
    let status = wait_for("iperf3 client exit", Duration::from_secs(30), || {
        client.0.try_wait().ok().flatten()
    });
    let out = std::fs::read_to_string(&client_log).unwrap_or_default();
    assert!(status.success(), "iperf3 failed: {out}");
    let report: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert!(report.get("error").is_none(), "{report:#}");
    let received = report["end"]["sum_received"]["bytes"].as_u64().unwrap_or(0);
    assert!(received > 0, "{report:#}");

    for s in &socks {
        common::migration::assert_no_drops_of_moved_flows(s, &ask(s, Request::Stats));
    }
    let fab = maps.stats().expect("fabric stats");
    assert_eq!(fab.get(pliant_steer::layout::Stat::DropDead), 0);
    drop(maps);
    lab.down().expect("lab down");
}
