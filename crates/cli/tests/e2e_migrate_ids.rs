//! End-to-end: the seed's Bro verification with live migration. Two pliant replicas running
//! the IDS behind the tc-BPF fabric; one client TCP connection carries clean and SQL-injection
//! HTTP requests to nginx while the test moves its flow back and forth between the replicas 20
//! times (steering exception + `migrate_in`/`migrate_out`, through
//! `pliant_runtime::migrate_client::migrate`, the function the controller calls).
//!
//! Proves: every request got its response (the client checks each), the per-flow counts on the
//! final owner equal exactly what the client sent, the alert fired exactly once (on whichever
//! replica held the flow when it crossed the threshold), no drop reason that could be a moved
//! flow's packet is non-zero on either replica (the whole drops map: the IDS drops a packet
//! that reaches a replica its flow has left, and TCP would retransmit it unnoticed), no packet
//! was held beyond the bound or failed to forward, and both replicas stay healthy.
//!
//! No sequence-numbered UDP stream here (unlike `e2e_migrate_nat`): the IDS keeps state only
//! for TCP and forwards UDP statelessly, so a UDP flow has nothing to migrate. Needs root
//! (`pliant_testkit::require_root`).

mod common;
use common::migration::{ask, control_of};

use pliant_lab::{Lab, LabSpec, PliantNf, ReplicaMode, Role, CLIENT_IP, SERVER_IP};
use pliant_proto::Request;
use pliant_runtime::config::ReplicaConfig;
use pliant_runtime::migrate_client::migrate;
use pliant_state::FlowKey;
use serde_json::json;
use std::path::PathBuf;
use std::time::{Duration, Instant};

fn nf(kind: &str, section: &str) -> PliantNf {
    let text = format!(
        "[replica]\nname = \"e2e\"\ncontrol_socket = \"/e2e.sock\"\n\
         [inside]\nifname = \"in0\"\naddresses = []\n\
         [outside]\nifname = \"out0\"\naddresses = []\n\
         [nf]\nkind = \"{kind}\"\n{section}\n"
    );
    let cfg = ReplicaConfig::parse(&text, "e2e").unwrap_or_else(|e| panic!("{e}"));
    PliantNf::new(kind, cfg.nf_sections)
}

/// The default peer socket beside a control socket (`ReplicaConfig::peer_socket`).
fn peer_of(sock: &str) -> String {
    match sock.strip_suffix(".sock") {
        Some(stem) => format!("{stem}.peer.sock"),
        None => format!("{sock}.peer"),
    }
}

const REQUESTS: u64 = 150;
const THRESHOLD: u64 = 5;

/// One keep-alive connection; every third request is an injection; each response is read in
/// full before the next request. Prints the local port, then `done <requests> <injections>`,
/// then keeps the connection open so the flow is still live when the test reads the counts.
fn client_script() -> String {
    format!(
        r#"
import http.client, sys, time
c = http.client.HTTPConnection("{SERVER_IP}", 80, timeout=20)
c.connect()
print("port", c.sock.getsockname()[1], flush=True)
inj = 0
for i in range({REQUESTS}):
    if i % 3 == 0:
        path = "/item?id=1%27%20OR%201%3D1&n=" + str(i)
        inj += 1
    else:
        path = "/?page=" + str(i)
    c.request("GET", path)
    r = c.getresponse()
    r.read()
    if r.status not in (200, 404):
        print("bad status", r.status, flush=True)
        sys.exit(1)
    time.sleep(0.02)
print("done", {REQUESTS}, inj, flush=True)
time.sleep(60)
"#
    )
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

#[test]
fn an_ids_flow_migrated_twenty_times_keeps_exact_counts() {
    if !pliant_testkit::require_root() {
        return;
    }
    let mut spec = LabSpec::new(ReplicaMode::Pliant {
        config: nf("ids", &format!("[ids]\nalert_threshold = {THRESHOLD}\n")),
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

    let log = lab.run_dir().join("migrate-client.log");
    let script = client_script();
    let child = lab
        .spawn(Role::Client, &["/usr/bin/python3", "-c", &script], &log)
        .expect("spawn client");
    let _guard = ChildGuard(child);
    let read_log = || std::fs::read_to_string(&log).unwrap_or_default();
    let port: u16 = wait_for("client port", Duration::from_secs(10), || {
        read_log()
            .lines()
            .find_map(|l| l.strip_prefix("port ")?.trim().parse().ok())
    });
    let key = FlowKey::v4(
        6,
        CLIENT_IP.parse().unwrap(),
        port,
        SERVER_IP.parse().unwrap(),
        80,
    )
    .0;
    let text = key.to_string();
    let owner_now = || {
        (0..2).find(|&i| {
            ask(&socks[i], Request::Flows)["flows"]
                .as_array()
                .is_some_and(|fs| fs.iter().any(|f| f["key"] == text.as_str()))
        })
    };
    let mut owner = wait_for("flow on a replica", Duration::from_secs(10), owner_now);

    let mut moves = 0;
    let mut pauses = Vec::new();
    while moves < 20 {
        let dst = 1 - owner;
        let v = migrate(
            &control_of(&socks[owner]),
            &control_of(&socks[dst]),
            &peer_of(&socks[dst]),
            &[key],
            |keys| {
                let entries: Vec<(FlowKey, u32)> =
                    keys.iter().map(|k| (*k, dst as u32 + 1)).collect();
                maps.set_exceptions(&entries).expect("steering update");
            },
        )
        .unwrap_or_else(|e| panic!("move {moves}: {e}"));
        assert_eq!(v["moved"], 1, "move {moves}: {v}");
        assert_eq!(v["failed"], json!([]), "move {moves}: {v}");
        pauses.push(v["pause"]["pause_us_max"].as_u64().unwrap_or(0));
        owner = dst;
        moves += 1;
        assert!(
            !read_log().contains("done"),
            "the client finished before 20 moves: slow the client down"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let done = wait_for("client done", Duration::from_secs(60), || {
        let l = read_log();
        assert!(!l.contains("bad status") && !l.contains("Traceback"), "{l}");
        l.lines()
            .find(|l| l.starts_with("done "))
            .map(str::to_string)
    });
    let inj = REQUESTS.div_ceil(3);
    assert_eq!(done, format!("done {REQUESTS} {inj}"));

    // The final owner holds the flow with exact counts.
    let q = ask(&socks[owner], Request::Query);
    let flow = q["query"]["flows"]
        .as_array()
        .and_then(|fs| fs.iter().find(|f| f["flow"] == text.as_str()).cloned())
        .unwrap_or_else(|| panic!("flow not on the final owner: {q:#}"));
    assert_eq!(flow["requests"], REQUESTS, "{flow}");
    assert_eq!(flow["injections"], inj, "{flow}");
    assert_eq!(flow["alerted"], true, "{flow}");
    assert_eq!(flow["gaps"], 0, "{flow}");
    let mut alerts = 0;
    for s in &socks {
        let st = ask(s, Request::Stats);
        assert_eq!(st["ok"], true, "{st:#}");
        alerts += st["nf_counters"]["ids_alerts"].as_u64().unwrap_or(0);
        common::migration::assert_no_drops_of_moved_flows(s, &st);
    }
    assert_eq!(alerts, 1, "exactly one alert over both replicas");
    eprintln!("pause_us_max per move: {pauses:?}");
    drop(maps);
    lab.down().expect("lab down");
}
