//! End-to-end elasticity: the `pliant controller` daemon over a pliant NAT lab, with tc-BPF
//! steering it attaches itself, the lab agent, real replica migrations and real UDP flows.
//!
//! Hotspot scenario (after the seed): flows are added one by one through the NAT (each a
//! separate UDP "session" sending a datagram every 50 ms to an echo server and counting the
//! echoes); when the average passes the high-water mark the controller creates a replica; flows
//! keep being added until the new replica holds one (steered there by the new ring); then
//! rebalancing is switched on (`pliant policy set rebalance=true`) and the controller moves
//! flows from the hot replica until the split is even. Every flow must still get its echoes
//! afterwards (a flow broken by a migration — state lost, steering or NAT return path wrong —
//! stops counting), and the status/CLI must show two live replicas.
//!
//! Needs root (`pliant_testkit::require_root`). Run in release (the unoptimised runtime is slow):
//! `cargo test --release -p pliant-cli --test e2e_scale -- --test-threads=1 --nocapture`.

mod common;

use pliant_lab::{cmd, Lab, LabSpec, PliantNf, ReplicaMode, Role, CLIENT_IP, SERVER_IP};
use pliant_state::FlowKey;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn pliant() -> &'static str {
    env!("CARGO_BIN_EXE_pliant")
}

const ECHO_PORT: u16 = 9000;
/// The burst test's sequence-numbered UDP stream, and its downloads' first client port.
const UDP_SPORT: u16 = 40000;
const UDP_DPORT: u16 = 9100;
const DOWNLOAD_SPORT: u16 = 45000;

const ECHO_SERVER: &str = r#"
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], int(sys.argv[2])))
while True:
    d, a = s.recvfrom(2048)
    s.sendto(d, a)
"#;

/// One UDP flow: sends every 50 ms from a fixed source port, writes the echo count to a file.
const FLOW_CLIENT: &str = r#"
import socket, sys, time, os
src, sport, dst, dport, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((src, sport))
s.settimeout(0.05)
got = 0
seq = 0
last = 0
while True:
    seq += 1
    s.sendto(str(seq).encode(), (dst, dport))
    end = time.time() + 0.05
    while time.time() < end:
        try:
            s.recvfrom(2048)
            got += 1
        except socket.timeout:
            break
    if time.time() - last > 0.2:
        last = time.time()
        tmp = out + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(got))
        os.replace(tmp, out)
"#;

/// An HTTP GET that reads the body at `rate` bytes/s from a fixed client port, into a file.
/// The small receive buffer keeps the kernel from taking the body ahead of the reader, so the
/// connection carries data for the whole download. Exits non-zero on any error, including a
/// body shorter than its Content-Length (http.client raises IncompleteRead).
const SLOW_GET: &str = r#"
import http.client, socket, sys, time
host, path, out, sport, rate = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
s.bind(("", sport))
s.settimeout(30)
s.connect((host, 80))
c = http.client.HTTPConnection(host, 80)
c.sock = s
c.request("GET", path)
r = c.getresponse()
if r.status != 200:
    sys.exit("status %d" % r.status)
t0, n = time.time(), 0
with open(out, "wb") as f:
    while True:
        b = r.read(16384)
        if not b:
            break
        f.write(b)
        n += len(b)
        ahead = n / rate - (time.time() - t0)
        if ahead > 0:
            time.sleep(ahead)
"#;

/// Everything this test started, stopped in the right order on drop (also on panic):
/// flows, controller (it detaches its BPF filters), replicas the controller added, the lab.
struct Run {
    dir: PathBuf,
    controller: Option<Child>,
    flows: Vec<Child>,
    echo: Option<Child>,
    lab: Option<Lab>,
    initial: Vec<u8>,
}

impl Drop for Run {
    fn drop(&mut self) {
        for c in self.flows.iter_mut().chain(self.echo.iter_mut()) {
            cmd::stop_group(c, libc::SIGKILL, Duration::from_secs(1));
        }
        if let Some(mut c) = self.controller.take() {
            // SAFETY: SIGTERM to the controller process this test spawned (by PID).
            unsafe {
                libc::kill(c.id() as i32, libc::SIGTERM);
            }
            if cmd::wait_bounded(&mut c, Duration::from_secs(5)).is_none() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
        if let Some(lab) = self.lab.take() {
            let opts = pliant_lab::scale::ScaleOptions::default();
            // Replicas the controller added are in the lab's state file, not in this handle.
            if let Ok(rs) = pliant_lab::scale::replicas(lab.name(), &opts) {
                for r in rs.iter().filter(|r| !self.initial.contains(&r.index)) {
                    let _ = pliant_lab::scale::remove_replica(lab.name(), r.index, &opts);
                }
            }
            drop(lab);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Run {
    fn lab(&self) -> &Lab {
        self.lab.as_ref().expect("lab")
    }

    fn conn(&self) -> Vec<String> {
        vec![
            "--api".into(),
            self.dir.join("api.sock").display().to_string(),
            "--token-file".into(),
            self.dir.join("token").display().to_string(),
        ]
    }

    fn cli(&self, args: &[&str]) -> Value {
        let out = Command::new(pliant())
            .args(args)
            .args(self.conn())
            .arg("--json")
            .output()
            .expect("run pliant");
        assert!(
            out.status.success(),
            "pliant {args:?}: {}\ncontroller log: {}",
            String::from_utf8_lossy(&out.stderr),
            pliant_lab::log_tail(&self.dir.join("controller.log"), 30)
        );
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("pliant {args:?}: {e}"))
    }

    /// Live replicas' flow counts by index (from the controller's heartbeats).
    fn loads(&self) -> Vec<(u64, u64)> {
        let v = self.cli(&["status"]);
        v["replicas"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or(&[])
            .iter()
            .filter(|r| r["alive"] == true)
            .map(|r| {
                (
                    r["index"].as_u64().unwrap_or(0),
                    r["flows"].as_u64().unwrap_or(0),
                )
            })
            .collect()
    }

    fn wait_for(&self, what: &str, limit: Duration, mut f: impl FnMut(&Run) -> bool) {
        let t = Instant::now();
        while t.elapsed() < limit {
            if f(self) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!(
            "timed out after {limit:?} waiting for {what}; status: {}\ncontroller log: {}",
            self.cli(&["status"]),
            pliant_lab::log_tail(&self.dir.join("controller.log"), 30)
        );
    }

    fn add_flow(&mut self, sport: u16) {
        let out = self.dir.join(format!("flow-{sport}.count"));
        let script = self.dir.join("flow.py").display().to_string();
        let (sp, dp, o) = (
            sport.to_string(),
            ECHO_PORT.to_string(),
            out.display().to_string(),
        );
        let log = self.dir.join(format!("flow-{sport}.log"));
        let c = self
            .lab()
            .spawn(
                Role::Client,
                &["python3", &script, CLIENT_IP, &sp, SERVER_IP, &dp, &o],
                &log,
            )
            .expect("spawn flow");
        self.flows.push(c);
    }

    fn echoes(&self, sport: u16) -> u64 {
        std::fs::read_to_string(self.dir.join(format!("flow-{sport}.count")))
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    }
}

fn start(tag: &str, policy: &str) -> Option<Run> {
    start_with_file(tag, policy, &[])
}

fn start_with_file(tag: &str, policy: &str, file: &[(&str, u64)]) -> Option<Run> {
    start_on(tag, policy, file, pliant_lab::mgmt::Transport::Unix)
}

/// A lab and its controller; with `Transport::Tcp` the replicas (those added by scale-out
/// too) run on private hosts and every channel — control, migration — is TCP on the
/// management network, where the controller runs.
fn start_on(
    tag: &str,
    policy: &str,
    file: &[(&str, u64)],
    transport: pliant_lab::mgmt::Transport,
) -> Option<Run> {
    if !pliant_testkit::require_root() {
        return None;
    }
    let dir = std::env::temp_dir().join(format!("pliant-e2e-scale-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("mkdir");
    let mut nat = PliantNf::nat();
    // Finished connections leave the flow count within seconds (the default keeps a closed
    // TCP mapping for minutes), so the low-water mark can trigger scale-in after a burst.
    if let Some(toml::Value::Table(t)) = nat.sections.get_mut("nat") {
        t.insert("tcp_closing_timeout_s".into(), 2.into());
    }
    let mut spec = LabSpec::new(ReplicaMode::Pliant { config: nat });
    spec.pliant_bin = Some(PathBuf::from(pliant()));
    spec.transport = transport;
    for (name, size) in file {
        spec = spec.with_file(name, *size);
    }
    let lab = Lab::up(spec).unwrap_or_else(|e| panic!("lab up: {e}"));
    let mut run = Run {
        dir: dir.clone(),
        controller: None,
        flows: Vec::new(),
        echo: None,
        initial: vec![1],
        lab: Some(lab),
    };
    std::fs::write(dir.join("echo.py"), ECHO_SERVER).expect("write");
    std::fs::write(dir.join("flow.py"), FLOW_CLIENT).expect("write");
    let echo = run
        .lab()
        .spawn(
            Role::Server,
            &[
                "python3",
                &dir.join("echo.py").display().to_string(),
                SERVER_IP,
                &ECHO_PORT.to_string(),
            ],
            &dir.join("echo.log"),
        )
        .expect("echo server");
    run.echo = Some(echo);
    let tcp_ctl = match transport {
        pliant_lab::mgmt::Transport::Tcp => pliant_lab::mgmt::controller_keys().0,
        pliant_lab::mgmt::Transport::Unix => String::new(),
    };
    let ctl = format!(
        "[controller]\napi_socket = \"{d}/api.sock\"\ntoken_file = \"{d}/token\"\n\
         store = \"{d}/store.json\"\nheartbeat_ms = 100\npolicy_interval_ms = 200\n{tcp_ctl}\
         [lab]\nname = \"{name}\"\nnat_addr = \"10.77.2.1\"\n[ports]\nper_replica = 1\n\
         [policy]\n{policy}\n",
        d = dir.display(),
        name = run.lab().name(),
    );
    let cfg = dir.join("ctl.toml");
    std::fs::write(&cfg, ctl).expect("write ctl.toml");
    let log = std::fs::File::create(dir.join("controller.log")).expect("log");
    let child = pliant_lab::mgmt::controller_process(run.lab().state(), Path::new(pliant()), &cfg)
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("log"))
        .stderr(log)
        .spawn()
        .expect("start controller");
    run.controller = Some(child);
    let sock = dir.join("api.sock");
    let t = Instant::now();
    while !sock.exists() || !dir.join("token").exists() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "controller did not start: {}",
            pliant_lab::log_tail(&dir.join("controller.log"), 30)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    Some(run)
}

/// The live replica whose flow listing holds `key` (as the controller's `flows` shows it).
fn owner_of(run: &Run, key: &str) -> Option<u64> {
    let v = run.cli(&["flows"]);
    v["replicas"]
        .as_array()?
        .iter()
        .filter(|r| r["alive"] == true)
        .find(|r| {
            r["flows"]
                .as_array()
                .is_some_and(|fs| fs.iter().any(|f| f["key"] == key))
        })
        .and_then(|r| r["replica"].as_u64())
}

fn assert_all_flows_alive(run: &Run, ports: &[u16]) {
    let before: Vec<u64> = ports.iter().map(|p| run.echoes(*p)).collect();
    std::thread::sleep(Duration::from_millis(1500));
    for (p, b) in ports.iter().zip(before) {
        let now = run.echoes(*p);
        assert!(
            now > b,
            "flow from port {p} stopped getting echoes ({b} -> {now}); status: {}",
            run.cli(&["status"])
        );
    }
}

#[test]
fn hotspot_scale_out_then_even_split() {
    hotspot(pliant_lab::mgmt::Transport::Unix);
}

/// The same with the replicas on private hosts and the controller reaching them (and them
/// each other) over TCP only: scale-out, then migrations between the hosts.
#[test]
fn hotspot_scale_out_then_even_split_over_tcp() {
    hotspot(pliant_lab::mgmt::Transport::Tcp);
}

fn hotspot(transport: pliant_lab::mgmt::Transport) {
    let policy = "auto = true\nhigh_water_flows = 4\nlow_water_flows = 1\nmax_replicas = 2\n\
                  rebalance = false\ncooldown_ms = 300\nimbalance_flows = 1";
    let tag = match transport {
        pliant_lab::mgmt::Transport::Tcp => "hotspot-tcp",
        pliant_lab::mgmt::Transport::Unix => "hotspot",
    };
    let Some(mut run) = start_on(tag, policy, &[], transport) else {
        return;
    };
    run.wait_for("r1 alive", Duration::from_secs(5), |r| r.loads().len() == 1);
    // Flows one by one: four stay on r1 (at the high-water mark, not above), the fifth makes
    // the controller create a replica.
    let mut ports: Vec<u16> = Vec::new();
    let mut sport = 41000u16;
    for n in 1..=5u64 {
        run.add_flow(sport);
        ports.push(sport);
        sport += 1;
        run.wait_for("the new flow to be counted", Duration::from_secs(10), |r| {
            r.loads().iter().map(|l| l.1).sum::<u64>() >= n
        });
        if n <= 4 {
            // Give the policy (every 200 ms) a chance to act wrongly.
            std::thread::sleep(Duration::from_millis(600));
            assert_eq!(run.loads().len(), 1, "scale-out at only {n} flows");
        } else {
            run.wait_for("scale-out", Duration::from_secs(15), |r| {
                r.loads().len() >= 2
            });
        }
    }
    let st = run.cli(&["status"]);
    let ready = st["last_scale_out_ready_ms"].as_u64().unwrap_or(u64::MAX);
    eprintln!("scale-out: new replica serving in {ready} ms");
    // More flows until the new replica holds one (the ring now spreads new flows over both).
    while !run.loads().iter().any(|(i, f)| *i != 1 && *f >= 1) {
        assert!(
            ports.len() < 40,
            "new replica never got a flow: {}",
            run.cli(&["status"])
        );
        run.add_flow(sport);
        ports.push(sport);
        sport += 1;
        std::thread::sleep(Duration::from_millis(400));
    }
    assert_all_flows_alive(&run, &ports);
    // Now let the policy remove the hotspot.
    run.cli(&["policy", "set", "rebalance=true"]);
    run.wait_for("an even split", Duration::from_secs(20), |r| {
        let l = r.loads();
        l.len() == 2 && l[0].1.abs_diff(l[1].1) <= 1 && l[0].1 + l[1].1 == ports.len() as u64
    });
    let st = run.cli(&["status"]);
    assert!(
        st["counters"]["flows_migrated"].as_u64().unwrap_or(0) >= 1,
        "{st}"
    );
    assert_eq!(st["counters"]["migrations_failed"], 0, "{st}");
    // Every flow, moved or not, still gets its echoes through the NAT.
    assert_all_flows_alive(&run, &ports);
    let flows = run.cli(&["flows"]);
    assert_eq!(
        flows["replicas"].as_array().map(Vec::len),
        Some(2),
        "{flows}"
    );
    eprintln!("loads after rebalance: {:?}", run.loads());
    if transport == pliant_lab::mgmt::Transport::Tcp {
        let members: Vec<u32> = run.loads().iter().map(|(i, _)| *i as u32).collect();
        common::ha::assert_private_hosts(run.lab(), &members);
    }
}

#[test]
fn cli_refuses_a_wrong_token() {
    let Some(run) = start("token", "auto = false") else {
        return;
    };
    let bad = run.dir.join("bad-token");
    std::fs::write(&bad, "not-the-token-0123456789").expect("write");
    let out = Command::new(pliant())
        .args(["status", "--api"])
        .arg(run.dir.join("api.sock"))
        .arg("--token-file")
        .arg(&bad)
        .output()
        .expect("run");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("refused the token"), "{err}");
    let st = run.cli(&["status"]);
    assert_eq!(st["replicas"].as_array().map(Vec::len), Some(1), "{st}");
}

/// Burst scenario (issue acceptance): 4 long downloads as base load, then a burst of 46 shorter
/// ones pushes flows per replica over the high-water mark, so the policy scales out to 2+
/// replicas and rebalances live connections onto them. When the burst's downloads end (their NAT
/// mappings expire 2 s after FIN), flows per replica fall below the low-water mark and the policy
/// scales back in to one replica on its own, merging the still-running base downloads into the
/// survivor. Every one of the 50 downloads must complete with the served file's size and sha256:
/// a TCP connection broken or corrupted by a migration fails it. The base downloads must still
/// be running when the scale-in is done, must have been spread over 2+ replicas before it (the
/// test moves one if the policy left them together, so at least one is merged), and must all be
/// on the surviving replica afterwards.
///
/// A sequence-numbered UDP stream through the NAT runs from the start to the end (TCP would
/// retransmit what a move drops): the test moves it to another replica once the deployment has
/// scaled out, so it is moved at least once (and again if its replica is merged away); it must
/// end on the survivor with 0 lost, 0 reordered and 0 duplicated datagrams.
#[test]
fn burst_scale_out_then_in_downloads_complete() {
    const BASE: usize = 4;
    const TOTAL: usize = 50;
    let policy = "auto = true\nhigh_water_flows = 6\nlow_water_flows = 3\nmax_replicas = 3\n\
                  rebalance = true\ncooldown_ms = 500\nimbalance_flows = 2";
    let Some(run) = start_with_file("burst", policy, &[("8M.bin", 8 << 20), ("2M.bin", 2 << 20)])
    else {
        return;
    };
    run.wait_for("r1 alive", Duration::from_secs(5), |r| r.loads().len() == 1);
    let long = run
        .lab()
        .served_file("8M.bin")
        .expect("served file")
        .clone();
    let short = run
        .lab()
        .served_file("2M.bin")
        .expect("served file")
        .clone();
    // Fixed client ports: the base downloads' flow keys are known, to find them on replicas.
    let sport = |i: usize| DOWNLOAD_SPORT + i as u16;
    let start_download = |run: &Run, i: usize, f: &pliant_lab::ServedFile, rate: &str| {
        let out = run.dir.join(format!("dl-{i}.bin"));
        let o = out.display().to_string();
        let lp = sport(i).to_string();
        let c = run
            .lab()
            .spawn(
                Role::Client,
                &[
                    "curl",
                    "-sS",
                    "--fail",
                    "--max-time",
                    "150",
                    "--local-port",
                    &lp,
                    "--limit-rate",
                    rate,
                    "-o",
                    &o,
                    &f.url,
                ],
                &run.dir.join(format!("dl-{i}.log")),
            )
            .expect("spawn curl");
        (c, out, f.sha256.clone(), f.size_bytes)
    };
    let (cip, sip) = (
        CLIENT_IP.parse().expect("ip"),
        SERVER_IP.parse().expect("ip"),
    );
    let base_keys: Vec<String> = (0..BASE)
        .map(|i| FlowKey::v4(6, cip, sport(i), sip, 80).0.to_string())
        .collect();
    // The base downloads read at a paced rate themselves: curl's --limit-rate (7.88) lets the
    // whole body arrive at once and then sleeps, so its connection carried nothing after the
    // first seconds (8 MB arrived in under 2 s here) and some finished before the scale-in.
    let slow_download = |run: &Run, i: usize, f: &pliant_lab::ServedFile| {
        let out = run.dir.join(format!("dl-{i}.bin"));
        let script = run.dir.join("slow_get.py").display().to_string();
        let path = f
            .url
            .split_once(SERVER_IP)
            .map_or("/", |(_, p)| p)
            .to_string();
        let (o, lp) = (out.display().to_string(), sport(i).to_string());
        let c = run
            .lab()
            .spawn(
                Role::Client,
                &["python3", &script, SERVER_IP, &path, &o, &lp, "250000"],
                &run.dir.join(format!("dl-{i}.log")),
            )
            .expect("spawn a slow download");
        (c, out, f.sha256.clone(), f.size_bytes)
    };
    std::fs::write(run.dir.join("slow_get.py"), SLOW_GET).expect("write");
    let mut downloads = Vec::new();
    // Base load: under the high-water mark, long enough to outlive the burst and the scale-in.
    for i in 0..BASE {
        downloads.push(slow_download(&run, i, &long));
    }
    // One more flow of the base load (4 + 1 stays under the high-water mark).
    let udp = common::migration::SeqStream::start(run.lab(), UDP_SPORT, UDP_DPORT, 1000.0);
    udp.wait_arriving(Duration::from_secs(5));
    let udp_key = udp.key.to_string();
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(run.loads().len(), 1, "no scale-out for the base load");
    // Burst.
    for i in BASE..TOTAL {
        downloads.push(start_download(&run, i, &short, "700k"));
        std::thread::sleep(Duration::from_millis(20));
    }
    run.wait_for("scale-out to 2+ replicas", Duration::from_secs(15), |r| {
        r.loads().len() >= 2
    });
    // The burst's connections were pinned to r1 before the new replica existed: the policy
    // rebalances them (live TCP migrations) until 2+ replicas carry downloads.
    run.wait_for("downloads on 2+ replicas", Duration::from_secs(15), |r| {
        r.loads().iter().filter(|l| l.1 > 0).count() >= 2
    });
    let peak = run.loads().len();
    // Move the UDP stream to another replica (so it is moved at least once), and spread the
    // base downloads over 2+ replicas if the policy left them on one (so that scaling in to one
    // replica has to merge at least one of them).
    let live: Vec<u64> = run.loads().iter().map(|l| l.0).collect();
    let udp_from = owner_of(&run, &udp_key).expect("the UDP flow on a replica");
    let udp_to = *live.iter().find(|r| **r != udp_from).expect("2+ replicas");
    let sent_before = udp.sent();
    let mv = run.cli(&["migrate", "--flow", &udp_key, "--to", &format!("r{udp_to}")]);
    let udp_sent_during_move = udp.sent() - sent_before;
    assert_eq!(mv["moved"], 1, "{mv}");
    assert_eq!(owner_of(&run, &udp_key), Some(udp_to), "UDP flow not moved");
    let base_owners =
        |run: &Run| -> Vec<Option<u64>> { base_keys.iter().map(|k| owner_of(run, k)).collect() };
    let owners = base_owners(&run);
    assert!(
        owners.iter().all(Option::is_some),
        "base downloads not on replicas: {owners:?}"
    );
    if owners.iter().all(|o| *o == owners[0]) {
        let to = *live
            .iter()
            .find(|r| Some(**r) != owners[0])
            .expect("2+ replicas");
        let mv = run.cli(&[
            "migrate",
            "--flow",
            &base_keys[0],
            "--to",
            &format!("r{to}"),
        ]);
        assert_eq!(mv["moved"], 1, "{mv}");
    }
    let owners_before_in = base_owners(&run);
    let spread_over: std::collections::BTreeSet<u64> =
        owners_before_in.iter().flatten().copied().collect();
    assert!(
        spread_over.len() >= 2,
        "base downloads on one replica: {owners_before_in:?}"
    );
    let spread = run.cli(&["status"])["counters"]["flows_migrated"]
        .as_u64()
        .unwrap_or(0);
    // No request from here on: the low-water mark brings the deployment back to one replica
    // while the base downloads still run.
    run.wait_for("policy scale-in back to 1", Duration::from_secs(60), |r| {
        r.loads().len() == 1
    });
    let st = run.cli(&["status"]);
    assert_eq!(st["counters"]["migrations_failed"], 0, "{st}");
    let merged = st["counters"]["flows_migrated"].as_u64().unwrap_or(0) - spread;
    assert!(merged >= 1, "scale-in moved no flow: {st}");
    // The scale-in happened while the base downloads ran, and their flows (and the UDP stream)
    // are on the one replica left.
    let base_ended: Vec<(usize, std::process::ExitStatus)> = downloads[..BASE]
        .iter_mut()
        .enumerate()
        .filter_map(|(i, d)| Some((i, d.0.try_wait().ok().flatten()?)))
        .collect();
    assert!(
        base_ended.is_empty(),
        "base downloads ended before the scale-in was done: {base_ended:?}: {}",
        base_ended
            .iter()
            .map(|(i, _)| pliant_lab::log_tail(&run.dir.join(format!("dl-{i}.log")), 3))
            .collect::<Vec<_>>()
            .join(" | ")
    );
    let survivor = run.loads()[0].0;
    assert_eq!(
        base_owners(&run),
        vec![Some(survivor); BASE],
        "base downloads not (only) on the surviving r{survivor} (before: {owners_before_in:?})"
    );
    assert_eq!(
        owner_of(&run, &udp_key),
        Some(survivor),
        "UDP flow not on the survivor"
    );
    let udp_totals = udp.finish_loss_free("UDP through scale-out, a move and the scale-in");
    for (i, (mut c, out, sha, size)) in downloads.into_iter().enumerate() {
        let code = cmd::wait_bounded(&mut c, Duration::from_secs(180));
        assert_eq!(
            code,
            Some(Some(0)),
            "download {i} failed: {}; status: {}",
            pliant_lab::log_tail(&run.dir.join(format!("dl-{i}.log")), 5),
            run.cli(&["status"])
        );
        let sum = cmd::run_ok(
            &["sha256sum".to_string(), out.display().to_string()],
            Duration::from_secs(30),
        )
        .expect("sha256sum");
        let got = sum
            .stdout
            .split_whitespace()
            .next()
            .unwrap_or("")
            .to_string();
        assert_eq!(got, sha, "download {i} corrupted");
        let len = std::fs::metadata(&out).map(|m| m.len()).unwrap_or(0);
        assert_eq!(len, size, "download {i}: {len} of {size} bytes");
    }
    eprintln!(
        "burst: {TOTAL} downloads, peak {peak} replicas, {spread} flows rebalanced, {merged} \
         merged on policy scale-in ({BASE} base downloads still running then; base on \
         {owners_before_in:?} before, r{survivor} after); UDP stream {udp_totals:?}, moved \
         r{udp_from} -> r{udp_to} with {udp_sent_during_move} datagrams sent during the move"
    );
}
