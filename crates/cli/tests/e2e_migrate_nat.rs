//! End-to-end: an iperf3 TCP transfer through the NAT on two pliant replicas behind the
//! tc-BPF fabric, with every flow of the owning replica (the iperf3 control and data
//! connections) migrated to the other replica and back while data flows.
//!
//! Each replica allocates external ports from its own block (`set_port_blocks`) and the fabric
//! steers return traffic by destination port to the block's owner (`port_owner`); a migrated
//! mapping keeps its port, and `migrate` passes its alias (the external tuple) to the steering
//! update, so its return traffic goes to the new owner. Proves: the transfer completes (no
//! reset: iperf3 exits 0 with its JSON report), both moves report the flows moved, no packet
//! was dropped by pliant for NAT or migration reasons on either replica, and the fabric dropped
//! nothing for a dead replica. Needs root (skips otherwise).

use pliant_lab::{Lab, LabSpec, PliantNf, ReplicaMode, Role, SERVER_IP};
use pliant_runtime::control::client_request_json;
use pliant_runtime::migrate_client::migrate;
use pliant_state::FlowKey;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::{Duration, Instant};

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .map(|s| {
            s.lines()
                .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false)
}

fn ask(sock: &str, req: Value) -> Value {
    client_request_json(sock, &req).unwrap_or_else(|e| panic!("{sock}: {e}"))
}

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

fn flows_on(sock: &str) -> Vec<FlowKey> {
    ask(sock, json!({"cmd": "flows"}))["flows"]
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
    if !is_root() {
        eprintln!("skipping: needs root for network namespaces");
        return;
    }
    let mut spec = LabSpec::new(ReplicaMode::Pliant {
        config: PliantNf::nat(),
    });
    spec.replicas = 2;
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
    let mut maps =
        pliant_steer::SteerMaps::open_pinned(&pliant_steer::lab::pin_dir(&lab.netns(Role::Fabric)))
            .expect("open the fabric's pinned steering maps");
    let blocks = [(20000u16, 29999u16), (30000, 39999)];
    for (i, (lo, hi)) in blocks.iter().enumerate() {
        let v = ask(
            &socks[i],
            json!({"cmd": "set_port_blocks", "blocks": [[lo, hi]]}),
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
            &["iperf3", "-c", SERVER_IP, "-t", "6", "-J"],
            &client_log,
        )
        .expect("iperf3 client");
    let mut client = ChildGuard(client);

    let mut moved_total = 0;
    for round in 0..2 {
        std::thread::sleep(Duration::from_millis(1500));
        let (src, keys) = wait_for("iperf3 flows", Duration::from_secs(10), || {
            (0..2)
                .map(|i| (i, flows_on(&socks[i])))
                .find(|(_, k)| !k.is_empty())
        });
        let dst = 1 - src;
        let v = migrate(
            &socks[src],
            &socks[dst],
            &peer_of(&socks[dst]),
            &keys,
            |all| {
                let entries: Vec<(FlowKey, u32)> =
                    all.iter().map(|k| (*k, dst as u32 + 1)).collect();
                maps.set_exceptions(&entries).expect("steering update");
            },
        )
        .unwrap_or_else(|e| panic!("move {round}: {e}"));
        assert_eq!(v["moved"], keys.len(), "move {round}: {v}");
        assert_eq!(v["failed"], json!([]), "move {round}: {v}");
        moved_total += keys.len();
        eprintln!("move {round}: {v}");
    }
    assert!(moved_total >= 2);
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
        let st = ask(s, json!({"cmd": "stats"}));
        let drops = st["drops"].as_object().cloned().unwrap_or_default();
        let bad: Vec<_> = drops
            .iter()
            .filter(|(k, _)| {
                k.starts_with("nat_")
                    || k.starts_with("migrate_")
                    || *k == "output_queue_full"
                    || *k == "tx_full"
                    || *k == "flow_migrated"
            })
            .collect();
        assert!(bad.is_empty(), "pliant dropped packets on {s}: {bad:?}");
        let m = &st["migration"];
        for c in [
            "hold_overflow",
            "forward_failed",
            "peer_errors",
            "flows_import_failed",
        ] {
            assert_eq!(m[c], 0, "{c}: {st:#}");
        }
    }
    let fab = maps.stats().expect("fabric stats");
    assert_eq!(fab.get(pliant_steer::layout::Stat::DropDead), 0);
    drop(maps);
    lab.down().expect("lab down");
}
