//! `bench scale-in`: the seed's consolidation experiment (FreeFlow, ch. 3): 4 replicas with
//! `per_replica` UDP flows each, flows ending round-robin across the replicas at a steady rate
//! (one every `interval`), so every replica empties slowly. Measured twice, each in its own
//! lab and controller, with the same schedule:
//!
//! - **pliant**: the controller's policy (auto) merges a replica as soon as the survivors can
//!   absorb its flows (`high_water_flows = per_replica`, `low_water_flows = per_replica - 1`,
//!   i.e. total <= 3 x per_replica from 5 flows per replica on): its flows migrate, its shared
//!   state is merged, it is destroyed;
//! - **kill-based**: no merging; a replica is released (destroyed) once its last flow has
//!   ended and its state expired, i.e. when the controller sees it holding 0 flows.
//!
//! Time to release the first replica is from the first flow ending to the replica count
//! dropping to 3. The flows' datagrams carry sequence numbers, so loss and reordering across
//! the merge are counted at the server.
//!
//! A flow "ends" when its client stops sending; the NAT keeps its mapping for `udp_timeout_s`
//! after that (both variants pay it equally).

use crate::flowgen::{UdpFlows, UdpSpec, UdpTotals};
use crate::BenchError;
use pliant_lab::{cmd, Lab, LabSpec, PliantNf, ReplicaMode, Role, CLIENT_IP, SERVER_IP};
use pliant_state::FlowKey;
use serde::Serialize;
use serde_json::Value;
use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const REPLICAS: usize = 4;
const SPORT_BASE: u16 = 43000;
const DPORT: u16 = 9002;

#[derive(Clone, Debug)]
pub struct ScaleInOpts {
    pub pliant_bin: PathBuf,
    /// Flows per replica at the start (at least 2: the policy needs low < high water).
    pub per_replica: usize,
    /// One flow ends every `interval` (round-robin over the replicas).
    pub interval: Duration,
    /// The NAT's UDP mapping timeout (how long an ended flow's state stays).
    pub udp_timeout_s: u64,
    /// Datagrams per second per flow.
    pub pps_per_flow: f64,
    /// Skip the kill-based run (then no speedup is reported).
    pub skip_kill_based: bool,
}

impl ScaleInOpts {
    pub fn new(pliant_bin: PathBuf) -> Self {
        ScaleInOpts {
            pliant_bin,
            per_replica: 20,
            interval: Duration::from_millis(250),
            udp_timeout_s: 2,
            pps_per_flow: 20.0,
            skip_kill_based: false,
        }
    }
}

#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct RunReport {
    /// Seconds from the first flow ending to the first replica released (None: not reached).
    pub first_release_s: Option<f64>,
    pub released_replica: Option<u64>,
    /// Flows ended before the release.
    pub flows_ended: usize,
    /// Flows per replica at the start (after trimming to `per_replica`).
    pub start_flows: BTreeMap<String, u64>,
    /// The controller's answer/event for the release.
    pub release: Value,
    pub flows_migrated: u64,
    pub udp: UdpTotals,
    pub errors: Vec<String>,
}

#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct ScaleInReport {
    pub bench: &'static str,
    pub pliant_first_release_s: Option<f64>,
    pub kill_based_first_release_s: Option<f64>,
    pub speedup_vs_kill_based: Option<f64>,
    pub packets_lost: Option<u64>,
    pub packets_reordered: Option<u64>,
    pub packets_duplicated: Option<u64>,
    pub replicas: usize,
    pub per_replica: usize,
    pub interval_ms: u64,
    pub udp_timeout_s: u64,
    pub pliant: RunReport,
    pub kill_based: Option<RunReport>,
    pub build: &'static str,
    /// /proc/loadavg before and after (the machine is shared).
    pub loadavg_start: String,
    pub loadavg_end: String,
    pub total_s: f64,
}

fn progress(msg: &str) {
    eprintln!("[bench scale-in] {msg}");
}

pub fn run_scale_in(opts: &ScaleInOpts) -> ScaleInReport {
    let t = Instant::now();
    let mut rep = ScaleInReport {
        bench: "scale-in",
        replicas: REPLICAS,
        per_replica: opts.per_replica,
        interval_ms: opts.interval.as_millis() as u64,
        udp_timeout_s: opts.udp_timeout_s,
        build: if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
        loadavg_start: crate::migrate::loadavg(),
        ..Default::default()
    };
    progress("pliant run (merge through the controller's policy)");
    rep.pliant = one_run(opts, true);
    rep.pliant_first_release_s = rep.pliant.first_release_s;
    rep.packets_lost = Some(rep.pliant.udp.lost);
    rep.packets_reordered = Some(rep.pliant.udp.reordered);
    rep.packets_duplicated = Some(rep.pliant.udp.duplicated);
    if !opts.skip_kill_based && !cmd::interrupted() {
        progress("kill-based run (release a replica once it is empty)");
        let k = one_run(opts, false);
        rep.kill_based_first_release_s = k.first_release_s;
        rep.packets_lost = rep.packets_lost.map(|l| l + k.udp.lost);
        rep.packets_reordered = rep.packets_reordered.map(|l| l + k.udp.reordered);
        rep.packets_duplicated = rep.packets_duplicated.map(|l| l + k.udp.duplicated);
        rep.kill_based = Some(k);
    }
    rep.speedup_vs_kill_based = match (rep.pliant_first_release_s, rep.kill_based_first_release_s) {
        (Some(p), Some(k)) if p > 0.0 => Some(k / p),
        _ => None,
    };
    rep.total_s = t.elapsed().as_secs_f64();
    rep.loadavg_end = crate::migrate::loadavg();
    rep
}

/// Everything one run started, stopped in order on drop (also on error): flows, controller
/// (it detaches its BPF filters), replicas the controller added, the lab.
struct Setup {
    dir: PathBuf,
    controller: Option<Child>,
    lab: Option<Lab>,
    pliant: PathBuf,
}

impl Drop for Setup {
    fn drop(&mut self) {
        if let Some(mut c) = self.controller.take() {
            // SAFETY: SIGTERM to the controller process this run spawned (by PID).
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
            if let Ok(rs) = pliant_lab::scale::replicas(lab.name(), &opts) {
                for r in rs.iter().filter(|r| r.index != 1) {
                    let _ = pliant_lab::scale::remove_replica(lab.name(), r.index, &opts);
                }
            }
            drop(lab);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Setup {
    fn lab(&self) -> Result<&Lab, BenchError> {
        self.lab
            .as_ref()
            .ok_or_else(|| BenchError::Lab("lab gone".into()))
    }

    /// `pliant <args> --api ... --token-file ... --json`.
    fn cli(&self, args: &[&str]) -> Result<Value, BenchError> {
        let out = Command::new(&self.pliant)
            .args(args)
            .arg("--api")
            .arg(self.dir.join("api.sock"))
            .arg("--token-file")
            .arg(self.dir.join("token"))
            .arg("--json")
            .stdin(Stdio::null())
            .output()
            .map_err(|e| BenchError::Io(self.pliant.clone(), e))?;
        if !out.status.success() {
            return Err(BenchError::Tool {
                tool: "pliant cli",
                reason: format!("{args:?}: {}", String::from_utf8_lossy(&out.stderr).trim()),
            });
        }
        serde_json::from_slice(&out.stdout).map_err(|e| BenchError::Parse {
            what: "pliant cli JSON",
            reason: e.to_string(),
        })
    }

    /// Live replicas' (index, flows), from the controller's heartbeats.
    fn loads(&self) -> Result<Vec<(u64, u64)>, BenchError> {
        let v = self.cli(&["status"])?;
        Ok(v["replicas"]
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
            .collect())
    }
}

fn nat_config(udp_timeout_s: u64) -> PliantNf {
    let mut nat = toml::Table::new();
    nat.insert("external_ip".into(), pliant_lab::OUTSIDE_GW_IP.into());
    nat.insert(
        "udp_timeout_s".into(),
        toml::Value::Integer(udp_timeout_s.min(i64::MAX as u64) as i64),
    );
    let mut sections = toml::Table::new();
    sections.insert("nat".into(), toml::Value::Table(nat));
    PliantNf::new("nat", sections)
}

fn start(opts: &ScaleInOpts, tag: &str) -> Result<Setup, BenchError> {
    if opts.per_replica < 2 {
        return Err(BenchError::Tool {
            tool: "scale-in",
            reason: "per_replica must be at least 2 (the policy needs low < high water)".into(),
        });
    }
    let dir =
        std::env::temp_dir().join(format!("pliant-bench-scalein-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| BenchError::Io(dir.clone(), e))?;
    let mut spec = LabSpec::new(ReplicaMode::Pliant {
        config: nat_config(opts.udp_timeout_s),
    });
    spec.pliant_bin = Some(opts.pliant_bin.clone());
    spec.files.clear();
    let lab = Lab::up(spec).map_err(|e| BenchError::Lab(e.to_string()))?;
    let mut s = Setup {
        dir: dir.clone(),
        controller: None,
        lab: Some(lab),
        pliant: opts.pliant_bin.clone(),
    };
    // Policy off while flows are set up. `high_water_flows = per_replica` makes the survivors'
    // capacity the merge condition (total <= 3 x per_replica on 4 replicas); the low-water
    // mark must be below it (total < 4 x (per_replica - 1), implied by the former from 5 flows
    // per replica on).
    let ctl = format!(
        "[controller]\napi_socket = \"{d}/api.sock\"\ntoken_file = \"{d}/token\"\n\
         store = \"{d}/store.json\"\nheartbeat_ms = 100\npolicy_interval_ms = 100\n\
         [lab]\nname = \"{name}\"\nnat_addr = \"{nat}\"\n[ports]\nper_replica = 1\n\
         [policy]\nauto = false\nhigh_water_flows = {hw}\nlow_water_flows = {lw}\n\
         min_replicas = 1\nmax_replicas = {REPLICAS}\nrebalance = false\ncooldown_ms = 100\n\
         max_batch = 1000\n",
        d = dir.display(),
        name = s.lab()?.name(),
        nat = pliant_lab::OUTSIDE_GW_IP,
        hw = opts.per_replica,
        lw = opts.per_replica.saturating_sub(1),
    );
    let cfg = dir.join("ctl.toml");
    std::fs::write(&cfg, ctl).map_err(|e| BenchError::Io(cfg.clone(), e))?;
    let logp = dir.join("controller.log");
    let log = std::fs::File::create(&logp).map_err(|e| BenchError::Io(logp.clone(), e))?;
    let log2 = log
        .try_clone()
        .map_err(|e| BenchError::Io(logp.clone(), e))?;
    let child = Command::new(&opts.pliant_bin)
        .args(["controller", "--config"])
        .arg(&cfg)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log2)
        .spawn()
        .map_err(|e| BenchError::Io(opts.pliant_bin.clone(), e))?;
    s.controller = Some(child);
    let t = Instant::now();
    while !dir.join("api.sock").exists() || !dir.join("token").exists() {
        if t.elapsed() > Duration::from_secs(10) {
            return Err(BenchError::Tool {
                tool: "controller",
                reason: format!(
                    "did not start: {}",
                    pliant_lab::log_tail(&dir.join("controller.log"), 10)
                ),
            });
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    wait(&s, "r1 alive", Duration::from_secs(10), |l| l.len() == 1)?;
    for _ in 1..REPLICAS {
        s.cli(&["scale", "out"])?;
    }
    wait(&s, "4 live replicas", Duration::from_secs(10), |l| {
        l.len() == REPLICAS
    })?;
    Ok(s)
}

fn wait(
    s: &Setup,
    what: &str,
    limit: Duration,
    mut f: impl FnMut(&[(u64, u64)]) -> bool,
) -> Result<Vec<(u64, u64)>, BenchError> {
    let t = Instant::now();
    loop {
        let l = s.loads()?;
        if f(&l) {
            return Ok(l);
        }
        if t.elapsed() > limit || cmd::interrupted() {
            return Err(BenchError::Tool {
                tool: "controller",
                reason: format!("timed out waiting for {what}; loads {l:?}"),
            });
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Source port of the client side of a listed flow key.
fn client_sport(key: &str) -> Option<u16> {
    let k: FlowKey = key.parse().ok()?;
    let client: IpAddr = CLIENT_IP.parse().ok()?;
    let (a, pa) = k.lo();
    let (b, pb) = k.hi();
    if a == client {
        Some(pa)
    } else if b == client {
        Some(pb)
    } else {
        None
    }
}

/// Replica -> generator flow indexes, from the controller's flow listing.
fn placement(s: &Setup, n: usize) -> Result<BTreeMap<u64, Vec<usize>>, BenchError> {
    let v = s.cli(&["flows"])?;
    let mut out: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
    for r in v["replicas"].as_array().map(Vec::as_slice).unwrap_or(&[]) {
        let idx = r["replica"].as_u64().unwrap_or(0);
        let e = out.entry(idx).or_default();
        for f in r["flows"].as_array().map(Vec::as_slice).unwrap_or(&[]) {
            let key = f["key"].as_str().or_else(|| f.as_str()).unwrap_or("");
            if let Some(p) = client_sport(key) {
                let i = usize::from(p.wrapping_sub(SPORT_BASE));
                if p >= SPORT_BASE && i < n {
                    e.push(i);
                }
            }
        }
        e.sort_unstable();
    }
    Ok(out)
}

fn one_run(opts: &ScaleInOpts, merge: bool) -> RunReport {
    let mut rr = RunReport::default();
    let tag = if merge { "pliant" } else { "kill" };
    let setup = match start(opts, tag) {
        Ok(s) => s,
        Err(e) => {
            rr.errors.push(format!("setup: {e}"));
            return rr;
        }
    };
    // Candidates: the ring places flows by hash, so start more than needed and keep exactly
    // `per_replica` on each replica.
    let want = opts.per_replica * REPLICAS;
    // 3x: with 4 replicas a replica gets fewer than a third of its share only very rarely.
    let candidates = (want * 3).max(want + 32);
    let lab = match setup.lab() {
        Ok(l) => l,
        Err(e) => {
            rr.errors.push(e.to_string());
            return rr;
        }
    };
    // The client's gateway must be resolved before sequence-numbered datagrams start: while
    // it is not, the client kernel queues them on ARP and a later send overtakes the queue
    // (a reorder that has nothing to do with pliant; crates/bench/src/migrate.rs).
    if let Err(e) = crate::migrate::resolve_gateways(lab) {
        rr.errors.push(e.to_string());
        return rr;
    }
    let cip: Ipv4Addr = CLIENT_IP.parse().unwrap_or(Ipv4Addr::UNSPECIFIED);
    let sip: Ipv4Addr = SERVER_IP.parse().unwrap_or(Ipv4Addr::UNSPECIFIED);
    let flows = match UdpFlows::start(&UdpSpec {
        client_ns: lab.netns(Role::Client),
        server_ns: lab.netns(Role::Server),
        client_ip: cip,
        server_ip: sip,
        sport_base: SPORT_BASE,
        dport: DPORT,
        flows: candidates,
        pps_per_flow: opts.pps_per_flow,
        payload: 64,
    }) {
        Ok(f) => f,
        Err(e) => {
            rr.errors.push(format!("flows: {e}"));
            return rr;
        }
    };
    let res = drive(&setup, opts, merge, &flows, candidates, &mut rr);
    if let Err(e) = res {
        rr.errors.push(e.to_string());
    }
    let (tot, errs) = flows.stop(Duration::from_millis(500));
    rr.udp = tot;
    rr.errors.extend(errs);
    if let Ok(st) = setup.cli(&["status"]) {
        rr.flows_migrated = st["counters"]["flows_migrated"].as_u64().unwrap_or(0);
    }
    drop(setup);
    rr
}

fn drive(
    s: &Setup,
    opts: &ScaleInOpts,
    merge: bool,
    flows: &UdpFlows,
    candidates: usize,
    rr: &mut RunReport,
) -> Result<(), BenchError> {
    // Every candidate must have created its mapping before the placement is read.
    let t = Instant::now();
    while (0..candidates).any(|i| flows.seen_sport(i).is_none()) {
        if t.elapsed() > Duration::from_secs(10) {
            return Err(BenchError::Tool {
                tool: "traffic",
                reason: "not every flow reached the server".into(),
            });
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let place = placement(s, candidates)?;
    let mut kept: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
    for (r, idx) in &place {
        if idx.len() < opts.per_replica {
            return Err(BenchError::Tool {
                tool: "placement",
                reason: format!(
                    "r{r} got only {} of {candidates} flows (< {}); placement {place:?}",
                    idx.len(),
                    opts.per_replica
                ),
            });
        }
        kept.insert(*r, idx[..opts.per_replica].to_vec());
        for i in &idx[opts.per_replica..] {
            flows.end_flow(*i);
        }
    }
    // The surplus flows' mappings expire before the clock starts.
    let want = opts.per_replica as u64;
    let l = wait(
        s,
        "exactly per_replica flows on every replica",
        Duration::from_secs(opts.udp_timeout_s + 15),
        |l| l.len() == REPLICAS && l.iter().all(|(_, f)| *f == want),
    )?;
    rr.start_flows = l.iter().map(|(i, f)| (format!("r{i}"), *f)).collect();
    if merge {
        s.cli(&["policy", "set", "auto=true"])?;
    }
    progress(&format!(
        "  {} flows on {REPLICAS} replicas; one ends every {} ms, round-robin",
        want * REPLICAS as u64,
        opts.interval.as_millis()
    ));
    // Round-robin over replicas, one flow per interval.
    let order: Vec<u64> = kept.keys().copied().collect();
    let mut next_end = Instant::now();
    let t0 = next_end;
    let mut turn = 0usize;
    let limit = opts.interval * (want as u32 * REPLICAS as u32 + 4)
        + Duration::from_secs(opts.udp_timeout_s + 20);
    let mut killed: Option<u64> = None;
    loop {
        let now = Instant::now();
        if now >= next_end {
            // The next replica (in turn) that still has a flow to end.
            for _ in 0..order.len() {
                let r = order[turn % order.len()];
                turn += 1;
                if let Some(i) = kept.get_mut(&r).and_then(Vec::pop) {
                    flows.end_flow(i);
                    rr.flows_ended += 1;
                    break;
                }
            }
            next_end += opts.interval;
        }
        let loads = s.loads()?;
        if loads.len() < REPLICAS {
            rr.first_release_s = Some(t0.elapsed().as_secs_f64());
            let alive: Vec<u64> = loads.iter().map(|l| l.0).collect();
            rr.released_replica = order.iter().copied().find(|i| !alive.contains(i));
            break;
        }
        if !merge && killed.is_none() {
            if let Some((idx, _)) = loads.iter().find(|(_, f)| *f == 0) {
                // Empty: release it (no flow to move; the controller destroys it).
                let name = format!("r{idx}");
                rr.release = s.cli(&["scale", "in", "--replica", &name])?;
                killed = Some(*idx);
                continue;
            }
        }
        if t0.elapsed() > limit || cmd::interrupted() {
            return Err(BenchError::Tool {
                tool: "controller",
                reason: format!("no replica released within {limit:?}; loads {loads:?}"),
            });
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    if merge {
        if let Ok(st) = s.cli(&["status"]) {
            rr.release = st["events"].clone();
        }
    }
    progress(&format!(
        "  first replica released after {:.2} s ({} flows ended)",
        rr.first_release_s.unwrap_or(f64::NAN),
        rr.flows_ended
    ));
    // Traffic keeps flowing a moment on the survivors (losses across the merge show up).
    std::thread::sleep(Duration::from_millis(500));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_port_is_found_on_either_side_of_a_key() {
        assert_eq!(
            client_sport("udp 10.77.1.2:43005 <-> 10.77.2.2:9002"),
            Some(43005)
        );
        assert_eq!(client_sport("udp 10.77.0.9:1 <-> 10.77.2.2:9002"), None);
        assert_eq!(client_sport("garbage"), None);
    }

    #[test]
    fn json_contract_fields_are_present() {
        let v = serde_json::to_value(ScaleInReport::default()).expect("json");
        for k in [
            "pliant_first_release_s",
            "kill_based_first_release_s",
            "speedup_vs_kill_based",
        ] {
            assert!(v.get(k).is_some(), "missing {k}");
        }
    }
}
