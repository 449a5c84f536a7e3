//! The HA e2e harness: a 3-replica HA lab (`LabSpec::ha`: replication secret and
//! `[ha]` in every replica config), the real `pliant controller` with `[ha]` (Pico, chords at
//! 1 kHz) taking over the lab's tc-BPF steering, and helpers to place flows on a chosen replica
//! (client source ports whose flow key the Maglev ring maps there), SIGKILL a replica by the PID
//! the lab started, and read failover records and `ha_status` through the controller.
//!
//! Everything started here is stopped by `Drop` (also on panic): traffic, stopped replicas,
//! the controller (which detaches its BPF filters), replicas the controller added, the lab.

use super::pliant;
pub use pliant_bench::flowgen::Ring;
use pliant_lab::topology::{CLIENT_MAC, IN_PORT_MAC, OUT_PORT_MAC, SERVER_MAC};
use pliant_lab::{cmd, Lab, LabSpec, PliantNf, ReplicaMode, Role, CLIENT_IP, SERVER_IP};
use pliant_proto::Request;
use serde_json::Value;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Wall clock in milliseconds (comparable with the controller's `detected_unix_ms`).
pub fn unix_ms() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64() * 1e3)
        .unwrap_or(0.0)
}

/// A SIGKILL this test sent.
pub struct Killed {
    pub replica: u32,
    pub at: Instant,
    pub unix_ms: f64,
}

pub struct HaRun {
    pub dir: PathBuf,
    pub controller: Option<Child>,
    pub lab: Option<Lab>,
    /// Traffic processes (own process groups).
    pub procs: Vec<Child>,
    /// Replica PIDs this test SIGSTOPped: SIGKILLed at the end.
    pub stopped: Vec<i32>,
    pub nat: bool,
}

impl Drop for HaRun {
    fn drop(&mut self) {
        for c in self.procs.iter_mut() {
            cmd::stop_group(c, libc::SIGKILL, Duration::from_secs(1));
        }
        for pid in &self.stopped {
            // SAFETY: a replica process of this test's own lab (PID recorded by the lab).
            unsafe {
                libc::kill(*pid, libc::SIGKILL);
            }
        }
        if let Some(mut c) = self.controller.take() {
            // SAFETY: SIGTERM to the controller this test spawned (by PID).
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
                for r in rs.iter().filter(|r| r.index > 3) {
                    let _ = pliant_lab::scale::remove_replica(lab.name(), r.index, &opts);
                }
            }
            drop(lab);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Brings up the lab (3 replicas of `nf`, HA on) and the controller; waits until every
/// replica's groups are `up`. `None` when skipped
/// (`pliant_testkit::require_root`).
pub fn ha_up(tag: &str, nf: PliantNf, files: &[(&str, u64)]) -> Option<HaRun> {
    ha_up_on(tag, nf, files, pliant_lab::mgmt::Transport::Unix)
}

/// [`ha_up`] with the replicas' channels on `transport` (TCP: the lab's management network,
/// as between hosts; the controller is given the matching endpoint templates).
pub fn ha_up_on(
    tag: &str,
    nf: PliantNf,
    files: &[(&str, u64)],
    transport: pliant_lab::mgmt::Transport,
) -> Option<HaRun> {
    // The policy off: these tests place flows on chosen replicas and must not see them move.
    ha_up_with(
        tag,
        nf,
        files,
        transport,
        "auto = false\nmax_replicas = 60\n",
    )
}

/// [`ha_up_on`] with `policy` as the body of the controller's `[policy]` section.
pub fn ha_up_with(
    tag: &str,
    nf: PliantNf,
    files: &[(&str, u64)],
    transport: pliant_lab::mgmt::Transport,
    policy: &str,
) -> Option<HaRun> {
    ha_up_full(tag, nf, files, transport, policy, "", "")
}

/// [`ha_up_with`] with `ctl_extra` added to the controller's `[controller]` section and
/// `sections` (whole TOML sections, e.g. `[store]`) appended to its config.
pub fn ha_up_full(
    tag: &str,
    nf: PliantNf,
    files: &[(&str, u64)],
    transport: pliant_lab::mgmt::Transport,
    policy: &str,
    ctl_extra: &str,
    sections: &str,
) -> Option<HaRun> {
    ha_up_spec(tag, nf, files, transport, None, policy, ctl_extra, sections)
}

/// How the replica ports of a lab's hosts reach the fabric.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tunnels {
    Veth,
    Vxlan,
}

/// [`ha_up_full`], with `agents`: every replica namespace a host whose `pliant agent` starts
/// its replica (TCP only; the controller then needs a `[hosts]` section in `sections`).
#[allow(clippy::too_many_arguments)]
pub fn ha_up_spec(
    tag: &str,
    nf: PliantNf,
    files: &[(&str, u64)],
    transport: pliant_lab::mgmt::Transport,
    agents: Option<Tunnels>,
    policy: &str,
    ctl_extra: &str,
    sections: &str,
) -> Option<HaRun> {
    if !pliant_testkit::require_root() {
        return None;
    }
    let nat = nf.kind == "nat";
    let dir = std::env::temp_dir().join(format!("pliant-e2e-ha-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("mkdir");
    let mut spec = LabSpec::new(ReplicaMode::Pliant { config: nf });
    spec.pliant_bin = Some(PathBuf::from(pliant()));
    spec.disable_offloads = true;
    spec.replicas = 3;
    spec.ha = true;
    spec.transport = transport;
    spec.agents = agents.is_some();
    spec.tunnels = agents == Some(Tunnels::Vxlan);
    for (name, size) in files {
        spec = spec.with_file(name, *size);
    }
    let lab = Lab::up(spec).unwrap_or_else(|e| panic!("lab up: {e}"));
    let mut run = HaRun {
        dir: dir.clone(),
        controller: None,
        lab: Some(lab),
        procs: Vec::new(),
        stopped: Vec::new(),
        nat,
    };
    let nat_cfg = if nat {
        // Blocks of 1000 ports: failed-over replicas keep theirs quarantined while their flows
        // live on, so many kill trials need many blocks.
        "nat_addr = \"10.77.2.1\"\n[ports]\nlo = 20000\nhi = 59999\nblock = 1000\nper_replica = 1\n"
    } else {
        ""
    };
    let (tcp_ctl, tcp_ha) = match transport {
        pliant_lab::mgmt::Transport::Tcp => pliant_lab::mgmt::controller_keys(),
        pliant_lab::mgmt::Transport::Unix => (String::new(), String::new()),
    };
    // A lab of hosts: the controller steers through the fabric host's agent, as one on
    // another host than the fabric must.
    let steering = match agents {
        Some(_) => pliant_lab::agents::steering_keys(),
        None => String::new(),
    };
    let ctl = format!(
        "[controller]\napi_socket = \"{d}/api.sock\"\ntoken_file = \"{d}/token\"\n\
         store = \"{d}/store.json\"\nheartbeat_ms = 100\ndead_after_missed = 5\n{tcp_ctl}{ctl_extra}\
         [lab]\nname = \"{name}\"\n{steering}{nat_cfg}\
         [policy]\n{policy}\
         [ha]\nmode = \"pico\"\npolicy = \"chords\"\nhz = 1000\nwatch_ms = 10\n{tcp_ha}{sections}",
        d = dir.display(),
        name = run.lab().name(),
    );
    run.start_controller(&dir, &ctl);
    run.wait_protected(Duration::from_secs(20));
    Some(run)
}

impl HaRun {
    /// Writes `ctl` as the controller config in `dir`, starts `pliant controller` with it and
    /// waits until its API socket and token exist.
    pub fn start_controller(&mut self, dir: &Path, ctl: &str) {
        self.controller = Some(self.spawn_controller(dir, ctl));
        let t = Instant::now();
        while !dir.join("api.sock").exists() || !dir.join("token").exists() {
            assert!(
                t.elapsed() < Duration::from_secs(15),
                "controller did not start: {}",
                self.log_tail()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        // A controller on etcd serves its API before it leads (a standby answers 503): wait
        // until it answers as the one in charge.
        while !controller_cli(dir, &["status", "--json"]).status.success() {
            assert!(
                t.elapsed() < Duration::from_secs(15),
                "controller does not answer: {}",
                self.log_tail()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Writes `ctl` as `dir/ctl.toml` and starts `pliant controller` on it as the lab runs
    /// its controller, logging to `dir/controller.log`; does not wait.
    pub fn spawn_controller(&self, dir: &Path, ctl: &str) -> Child {
        let cfg = dir.join("ctl.toml");
        std::fs::write(&cfg, ctl).expect("write ctl.toml");
        let log = std::fs::File::create(dir.join("controller.log")).expect("log");
        pliant_lab::mgmt::controller_process(self.lab().state(), Path::new(pliant()), &cfg)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("start controller")
    }

    pub fn lab(&self) -> &Lab {
        self.lab.as_ref().expect("lab")
    }

    pub fn log_tail(&self) -> String {
        pliant_lab::log_tail(&self.dir.join("controller.log"), 30)
    }

    /// `pliant <args> --api .. --token-file .. --json`, parsed.
    pub fn cli(&self, args: &[&str]) -> Value {
        let mut with_json = args.to_vec();
        with_json.push("--json");
        let out = controller_cli(&self.dir, &with_json);
        assert!(
            out.status.success(),
            "pliant {args:?}: {}\ncontroller log: {}",
            String::from_utf8_lossy(&out.stderr),
            self.log_tail()
        );
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("pliant {args:?}: {e}"))
    }

    pub fn ha(&self) -> Value {
        self.cli(&["ha", "status"])
    }

    /// Live replicas taking part in HA, ascending (the controller's ring members).
    pub fn members(&self) -> Vec<u32> {
        let st = self.cli(&["status"]);
        let mut v: Vec<u32> = st["replicas"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or(&[])
            .iter()
            .filter(|r| r["alive"] == true && r["failed_over"] != true && r["draining"] != true)
            .filter_map(|r| r["index"].as_u64().map(|i| i as u32))
            .collect();
        v.sort_unstable();
        v
    }

    /// Waits until every member answers `ha_status` with all groups `up` and a backup set
    /// that contains no dead replica.
    pub fn wait_protected(&self, limit: Duration) -> Value {
        let t = Instant::now();
        loop {
            let v = self.ha();
            let members = self.members();
            let ok = members.len() >= 2
                && v["replicas"]
                    .as_array()
                    .map(Vec::as_slice)
                    .unwrap_or(&[])
                    .iter()
                    .filter(|r| members.contains(&(r["index"].as_u64().unwrap_or(0) as u32)))
                    .all(|r| {
                        let g = r["ha_status"]["groups"].as_array();
                        g.is_some_and(|g| {
                            !g.is_empty()
                                && g.iter().all(|g| {
                                    g["state"] == "up"
                                        && g["backup"].as_str().is_some_and(|b| {
                                            members.iter().any(|m| format!("r{m}") == b)
                                        })
                                })
                        })
                    });
            if ok {
                return v;
            }
            assert!(
                t.elapsed() < limit,
                "replicas not all protected after {limit:?}: {v:#}\ncontroller log: {}",
                self.log_tail()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// `n` client source ports, from `*next` upward, whose TCP flow to SERVER:`dport` the
    /// controller's Maglev ring over the current members sends to `replica`.
    pub fn sports_for(&self, replica: u32, dport: u16, n: usize, next: &mut u16) -> Vec<u16> {
        let ring = Ring::of(&self.members()).expect("maglev");
        let mut out = Vec::new();
        while out.len() < n {
            let p = *next;
            *next = next.checked_add(1).expect("ran out of source ports");
            if ring.owner(pliant_state::key::proto::TCP, p, dport) == replica {
                out.push(p);
            }
        }
        out
    }

    pub fn replica_pid(&self, n: u32) -> i32 {
        let n8 = u8::try_from(n).expect("replica index");
        self.lab()
            .replica_pid(n8)
            .unwrap_or_else(|| panic!("no running process recorded for r{n}"))
    }

    /// SIGKILL replica `n` by the PID the lab started.
    /// Loses host `n` of a lab with agents as a whole (`pliant_lab::agents::kill_host`).
    pub fn kill_host(&self, n: u32) -> Killed {
        let mut cut = (unix_ms(), Instant::now());
        let what = pliant_lab::agents::kill_host(self.lab(), n as u8, &mut || {
            cut = (unix_ms(), Instant::now())
        })
        .unwrap_or_else(|e| panic!("kill host {n}: {e}"));
        eprintln!("{what}");
        Killed {
            replica: n,
            at: cut.1,
            unix_ms: cut.0,
        }
    }

    pub fn kill(&self, n: u32) -> Killed {
        let pid = self.replica_pid(n);
        let unix_ms = unix_ms();
        // SAFETY: SIGKILL to a replica process of this test's own lab, by recorded PID.
        let r = unsafe { libc::kill(pid, libc::SIGKILL) };
        assert_eq!(r, 0, "kill r{n} (pid {pid})");
        Killed {
            replica: n,
            at: Instant::now(),
            unix_ms,
        }
    }

    /// The controller's failover record for replica `n` detected at or after `since_unix_ms`
    /// (an index can be reused once a failed replica is retired; older records are skipped).
    pub fn wait_failover(&self, n: u32, since_unix_ms: f64, limit: Duration) -> Value {
        let t = Instant::now();
        loop {
            let v = self.ha();
            if let Some(f) = v["failovers"].as_array().and_then(|a| {
                a.iter().find(|f| {
                    f["replica"] == n
                        && f["detected_unix_ms"].as_f64().unwrap_or(0.0) >= since_unix_ms
                })
            }) {
                return f.clone();
            }
            assert!(
                t.elapsed() < limit,
                "no failover of r{n} after {limit:?}: {v:#}\ncontroller log: {}",
                self.log_tail()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Peer ports of established TCP connections to SERVER:`port`, as the server sees them
    /// (for the NAT: the mappings' external ports).
    pub fn server_peer_ports(&self, port: u16) -> BTreeSet<u16> {
        let filter = format!("( sport = :{port} )");
        let out = self
            .lab()
            .exec_ok(
                Role::Server,
                &["ss", "-Htn", "state", "established", &filter],
            )
            .expect("ss");
        out.stdout
            .lines()
            .filter_map(|l| l.split_whitespace().last())
            .filter_map(|peer| peer.rsplit_once(':').and_then(|(_, p)| p.parse().ok()))
            .collect()
    }

    /// A rate-limited curl download from the client, bound to source port `sport`.
    pub fn curl(&mut self, url: &str, sport: u16, rate: &str, tag: &str) -> Download {
        let out = self.dir.join(format!("dl-{tag}.bin"));
        let log = self.dir.join(format!("dl-{tag}.log"));
        let (o, lp) = (out.display().to_string(), sport.to_string());
        let c = self
            .lab()
            .spawn(
                Role::Client,
                &[
                    "curl",
                    "-sS",
                    "--fail",
                    "--max-time",
                    "120",
                    "--local-port",
                    &lp,
                    "--limit-rate",
                    rate,
                    "-o",
                    &o,
                    url,
                ],
                &log,
            )
            .expect("spawn curl");
        Download {
            child: Some(c),
            out,
            log,
            sport,
        }
    }

    /// A TCP iperf3 test from the client (data stream bound to `sport`), JSON to a file.
    pub fn iperf3(&mut self, sport: u16, secs: u32, rate: &str) -> Iperf {
        let json = self.dir.join(format!("iperf3-{sport}.json"));
        let (cp, t) = (sport.to_string(), secs.to_string());
        let c = self
            .lab()
            .spawn(
                Role::Client,
                &[
                    "iperf3", "-c", SERVER_IP, "-t", &t, "-b", rate, "--cport", &cp, "-J",
                ],
                &json,
            )
            .expect("spawn iperf3");
        Iperf {
            child: Some(c),
            json,
        }
    }

    /// Every member's `ha_status` output audit: (checked, violations) summed, plus per replica.
    pub fn audit(&self) -> (u64, u64, Vec<(u32, u64, u64)>) {
        let v = self.ha();
        let members = self.members();
        let mut per = Vec::new();
        for r in v["replicas"].as_array().map(Vec::as_slice).unwrap_or(&[]) {
            let i = r["index"].as_u64().unwrap_or(0) as u32;
            if !members.contains(&i) {
                continue;
            }
            let o = &r["ha_status"]["output"];
            per.push((
                i,
                o["audit_checked"].as_u64().unwrap_or(0),
                o["audit_violations"].as_u64().unwrap_or(u64::MAX),
            ));
        }
        let checked = per.iter().map(|p| p.1).sum();
        let violations = per.iter().map(|p| p.2).fold(0u64, u64::saturating_add);
        (checked, violations, per)
    }

    /// The fabric's counters as the controller reports them.
    pub fn steer_counter(&self, name: &str) -> u64 {
        self.cli(&["status"])["steering"]["counters"][name]
            .as_u64()
            .unwrap_or(0)
    }
}

/// One request to a lab replica's control socket (as the lab's admin): the `ok` answer.
/// `pliant <args> --api DIR/api.sock --token-file DIR/token`: a client command against the
/// controller whose API and token are in `dir`.
pub fn controller_cli(dir: &Path, args: &[&str]) -> std::process::Output {
    Command::new(pliant())
        .args(args)
        .arg("--api")
        .arg(dir.join("api.sock"))
        .arg("--token-file")
        .arg(dir.join("token"))
        .output()
        .expect("run pliant")
}

pub fn control(sock: &Path, req: &Request) -> Result<Value, String> {
    pliant_lab::ha::control_client(sock)
        .with_timeout(Duration::from_secs(3))
        .call(req)
        .map_err(|e| e.to_string())
}

/// Asserts that each of `members` sees only its own files in the lab's run directory (a TCP
/// lab runs replicas on private host views): read through the replica process's own mount
/// namespace (`/proc/PID/root`), its run directory holds its config and its identity and
/// nothing of the other replicas, the lab's CA or the operators' keys.
pub fn assert_private_hosts(lab: &Lab, members: &[u32]) {
    let dir = lab.run_dir().to_path_buf();
    let list = |p: PathBuf| -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(&p)
            .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    for &n in members {
        let pid = lab.replica_pid(n as u8).expect("replica pid");
        let root = PathBuf::from(format!("/proc/{pid}/root"));
        let view = list(root.join(dir.strip_prefix("/").expect("absolute run dir")));
        assert!(
            view.contains(&format!("r{n}.toml")) && view.contains(&format!("r{n}.sock")),
            "r{n} does not see its own config and socket: {view:?}"
        );
        for m in members.iter().filter(|m| **m != n) {
            assert!(
                !view.iter().any(|f| f.starts_with(&format!("r{m}."))),
                "r{n} sees r{m}'s files: {view:?}"
            );
        }
        assert!(
            !view
                .iter()
                .any(|f| f == "ca" || f == "hosts" || f == "state.json"),
            "r{n} sees the lab's own files: {view:?}"
        );
        let ids = list(root.join(dir.strip_prefix("/").unwrap()).join("id"));
        assert_eq!(ids, vec![format!("r{n}")], "r{n} sees other identities");
    }
}

pub fn ha_status(sock: &Path) -> Result<Value, String> {
    control(sock, &Request::HaStatus)
}

pub struct Download {
    pub child: Option<Child>,
    pub out: PathBuf,
    pub log: PathBuf,
    pub sport: u16,
}

impl Download {
    /// Waits for curl and checks exit status 0 and the served sha256.
    pub fn finish(&mut self, sha256: &str, what: &str) {
        let mut c = self.child.take().expect("running");
        let code = cmd::wait_bounded(&mut c, Duration::from_secs(150));
        assert_eq!(
            code,
            Some(Some(0)),
            "{what}: download from port {} failed: {}",
            self.sport,
            pliant_lab::log_tail(&self.log, 5)
        );
        let sum = cmd::run_ok(
            &["sha256sum".to_string(), self.out.display().to_string()],
            Duration::from_secs(30),
        )
        .expect("sha256sum");
        let got = sum.stdout.split_whitespace().next().unwrap_or("");
        assert_eq!(
            got, sha256,
            "{what}: download from port {} corrupted",
            self.sport
        );
        let _ = std::fs::remove_file(&self.out);
    }
}

pub struct Iperf {
    pub child: Option<Child>,
    pub json: PathBuf,
}

impl Iperf {
    /// Waits for iperf3; checks a clean end (no error, e.g. no "connection reset") and data
    /// received by the server. Returns the bytes the server received.
    pub fn finish(&mut self, what: &str) -> u64 {
        let mut c = self.child.take().expect("running");
        let code = cmd::wait_bounded(&mut c, Duration::from_secs(120));
        let text = std::fs::read_to_string(&self.json).unwrap_or_default();
        assert_eq!(code, Some(Some(0)), "{what}: iperf3 failed: {text}");
        let j: Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("{what}: iperf3 JSON {e}: {text}"));
        assert!(
            j.get("error").is_none(),
            "{what}: iperf3 error {}",
            j["error"]
        );
        let got = j["end"]["sum_received"]["bytes"].as_u64().unwrap_or(0);
        assert!(got > 0, "{what}: iperf3 moved no data: {text}");
        got
    }
}

/// Sum of the standby flows `primary` has on the other members (from their `ha_status`).
pub fn standby_flows(run: &HaRun, primary: u32) -> u64 {
    let name = format!("r{primary}");
    run.members()
        .into_iter()
        .filter(|m| *m != primary)
        .filter_map(|m| ha_status(&run.lab().control_socket_of(m as u8)).ok())
        .map(|v| {
            v["standby"]
                .as_array()
                .map(Vec::as_slice)
                .unwrap_or(&[])
                .iter()
                .filter(|s| s["primary"] == name.as_str())
                .map(|s| s["flows"].as_u64().unwrap_or(0))
                .sum::<u64>()
        })
        .sum()
}

/// Sends `n` UDP frames out of replica `r`'s outside port from inside its namespace (what a
/// revived or partitioned old owner would emit), for the fencing check.
pub fn emit_from_replica(run: &HaRun, r: u32, n: u32) {
    emit_udp_frames(
        run,
        r,
        Side::Outside,
        ("10.77.2.1", 20999),
        (SERVER_IP, 9),
        b"FENCED-OLD-OWNER-OUTPUT",
        n,
    );
}

/// Which of a replica's ports a frame leaves by: inside (towards the client) or outside.
#[derive(Clone, Copy, Debug)]
pub enum Side {
    Inside,
    Outside,
}

/// Sends `n` UDP frames with `payload` from `src` to `dst` (IPv4, port) out of replica `r`'s
/// `side` port, written on the port itself (AF_PACKET) as the replica's own output is: Ethernet
/// from the port's MAC to the client's or server's MAC.
pub fn emit_udp_frames(
    run: &HaRun,
    r: u32,
    side: Side,
    src: (&str, u16),
    dst: (&str, u16),
    payload: &[u8],
    n: u32,
) {
    let py = r#"
import socket, struct, sys
ifname, n, src, sport, dst, dport, smac, dmac, payload = sys.argv[1:10]
n, sport, dport = int(n), int(sport), int(dport)
payload = bytes.fromhex(payload)
def csum(b):
    s = sum(struct.unpack("!%dH" % (len(b) // 2), b))
    s = (s >> 16) + (s & 0xffff)
    s += s >> 16
    return (~s) & 0xffff
udp = struct.pack("!HHHH", sport, dport, 8 + len(payload), 0) + payload
ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 1, 0, 64, 17, 0,
                 socket.inet_aton(src), socket.inet_aton(dst))
ip = ip[:10] + struct.pack("!H", csum(ip)) + ip[12:]
eth = bytes.fromhex(dmac) + bytes.fromhex(smac) + b"\x08\x00"
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
s.bind((ifname, 0))
for _ in range(n):
    s.send(eth + ip + udp)
"#;
    let (ifname, smac, dmac) = match side {
        Side::Inside => (format!("r{r}in"), IN_PORT_MAC, CLIENT_MAC),
        Side::Outside => (format!("r{r}out"), OUT_PORT_MAC, SERVER_MAC),
    };
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    let role = Role::Replica(u8::try_from(r).expect("index"));
    let (sp, dp, count) = (src.1.to_string(), dst.1.to_string(), n.to_string());
    let (smac, dmac) = (smac.replace(':', ""), dmac.replace(':', ""));
    let payload = hex(payload);
    run.lab()
        .exec_ok(
            role,
            &[
                "python3", "-c", py, &ifname, &count, src.0, &sp, dst.0, &dp, &smac, &dmac,
                &payload,
            ],
        )
        .expect("emit frames from a replica's port");
}

/// What a failover scenario measured.
#[derive(Debug)]
pub struct Measured {
    pub detect_ms: f64,
    pub activate_ms: f64,
    pub steer_ms: f64,
    pub kill_to_steered_ms: f64,
    pub activated: u64,
}

/// The acceptance scenario for one NF: long iperf3 TCP and large curl downloads (sha256)
/// through r1 (protected to r2 and r3, chords, 1 kHz); r1 SIGKILLed mid-transfer; every
/// connection must complete without reset; the server's view of each connection's peer port
/// (the NAT mapping, or the client port without NAT) is unchanged by the failover; fencing
/// drops what the old owner emits; survivors' output audit is clean.
pub fn kill_primary_mid_transfer(run: &mut HaRun, file: &str) -> Measured {
    let f = run.lab().served_file(file).expect("served file").clone();
    let a = 1u32;
    let mut next = 40_000u16;
    let web = run.sports_for(a, 80, 3, &mut next);
    let perf = run.sports_for(a, 5201, 1, &mut next)[0];
    // ~10 s downloads and a 10 s iperf3: the kill lands well inside every transfer.
    let rate = format!("{}", f.size_bytes / 10);
    let mut dls: Vec<Download> = web
        .iter()
        .enumerate()
        .map(|(i, p)| run.curl(&f.url, *p, &rate, &format!("k{i}")))
        .collect();
    let mut perf3 = run.iperf3(perf, 10, "50M");
    super::wait_for(
        "r1's connections checkpointed to its backups",
        Duration::from_secs(15),
        || standby_flows(run, a) >= 4,
    );
    std::thread::sleep(Duration::from_millis(1000));
    let web_before = run.server_peer_ports(80);
    let perf_before = run.server_peer_ports(5201);
    assert_eq!(
        web_before.len(),
        3,
        "three downloads in flight: {web_before:?}"
    );
    let fenced_before = run.steer_counter("drop_fenced");
    let killed = run.kill(a);
    let rec = run.wait_failover(a, killed.unix_ms, Duration::from_secs(5));
    let steered_wall = killed.at.elapsed();
    eprintln!("failover record: {rec}");
    // Server-side view right after the failover: the same peers (mappings) on the same
    // connections.
    std::thread::sleep(Duration::from_millis(500));
    let web_after = run.server_peer_ports(80);
    let perf_after = run.server_peer_ports(5201);
    assert_eq!(
        web_after, web_before,
        "HTTP connections/mappings changed by the failover"
    );
    assert!(
        perf_before.is_subset(&perf_after),
        "iperf3 connections changed: {perf_before:?} -> {perf_after:?}"
    );
    // Fencing (invariant 7): what the dead owner's ports emit never leaves the fabric.
    emit_from_replica(run, a, 5);
    std::thread::sleep(Duration::from_millis(200));
    let fenced = run.steer_counter("drop_fenced") - fenced_before;
    assert!(
        fenced >= 5,
        "old owner's frames not dropped by the fence ({fenced})"
    );
    // Every connection completes, intact.
    for d in dls.iter_mut() {
        d.finish(&f.sha256, "after failover");
    }
    perf3.finish("after failover");
    // End to end: nginx logged each download from the peer port it had before the kill.
    let log = run.lab().access_log().expect("access log");
    let req = format!("GET /{file} HTTP/1.1");
    let ports: BTreeSet<u16> = log
        .iter()
        .filter(|e| e.request == req && e.status == 200 && e.body_bytes == f.size_bytes)
        .map(|e| e.remote_port)
        .collect();
    assert_eq!(
        ports, web_before,
        "nginx saw other peers than before the failover: {log:?}"
    );
    let (checked, violations, per) = run.audit();
    assert_eq!(
        violations, 0,
        "output released before its checkpoint was acked: {per:?}"
    );
    assert!(checked > 0, "the output audit checked nothing: {per:?}");
    let num = |k: &str| rec[k].as_f64().unwrap_or(f64::NAN);
    let m = Measured {
        detect_ms: rec["detected_unix_ms"].as_f64().unwrap_or(f64::NAN) - killed.unix_ms,
        activate_ms: num("activate_ms"),
        steer_ms: num("steer_ms"),
        kill_to_steered_ms: steered_wall.as_secs_f64() * 1e3,
        activated: rec["activated"].as_u64().unwrap_or(0),
    };
    assert!(m.activated >= 4, "too few flows activated: {rec}");
    m
}

/// Waits until replica `r` holds TCP flows from every client port in `sports` and their state
/// is acknowledged by the backups, whatever older standby state those hold. Once the flows
/// exist (time T) each group's `open_seq` is noted; anything dirty at T ships in that
/// checkpoint, which is cut within one period (1 ms at 1 kHz). After 20 periods, a group is
/// done when its `acked_seq` reached that checkpoint, or when it is caught up (`acked_seq + 1 ==
/// open_seq`, nothing shipped unacknowledged: it had nothing dirty at T).
pub fn wait_checkpointed(run: &HaRun, r: u32, sports: &[u16], limit: Duration) {
    let sock = run.lab().control_socket_of(r as u8);
    let t = Instant::now();
    let has_all = |v: &Value| {
        let keys: Vec<&str> = v["flows"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or(&[])
            .iter()
            .filter_map(|f| f.as_str().or_else(|| f["key"].as_str()))
            .collect();
        sports.iter().all(|p| {
            let needle = format!("{CLIENT_IP}:{p} ");
            keys.iter()
                .any(|k| k.starts_with("tcp") && k.contains(&needle))
        })
    };
    loop {
        if control(&sock, &Request::Flows).is_ok_and(|v| has_all(&v)) {
            break;
        }
        assert!(
            t.elapsed() < limit,
            "r{r} never held flows from ports {sports:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let open: Vec<(Value, u64)> = ha_status(&sock).expect("ha_status")["groups"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[])
        .iter()
        .map(|g| (g["id"].clone(), g["open_seq"].as_u64().unwrap_or(0)))
        .collect();
    assert!(!open.is_empty(), "r{r} has no replication group");
    std::thread::sleep(Duration::from_millis(20));
    loop {
        let v = ha_status(&sock).expect("ha_status");
        let groups = v["groups"].as_array().cloned().unwrap_or_default();
        let done = open.iter().all(|(id, seq)| {
            groups.iter().find(|g| &g["id"] == id).is_some_and(|g| {
                let acked = g["acked_seq"].as_u64().unwrap_or(0);
                let now_open = g["open_seq"].as_u64().unwrap_or(u64::MAX);
                acked >= *seq || acked + 1 >= now_open
            })
        });
        if done {
            return;
        }
        assert!(
            t.elapsed() < limit,
            "r{r}'s checkpoints {open:?} not acknowledged: {v}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}
