//! `pliant bench kv`: the seed's sine load, compressed, on a lab cluster scaled by each planner
//! (offline over the known forecast, the online MILP loop, the greedy loop) and by the peer
//! (`redis-cli --cluster rebalance`, hosts added and removed by the same loop rule), against a
//! cluster fully scaled out from the start under the same load.
//!
//! Per system: `up` on `min_hosts` (the baseline on `max_hosts`), open-loop writers
//! ([`crate::loadgen`]) offering the sine for `duration`, the scaler, the hosts in use sampled
//! every 200 ms; then every acknowledged id is checked present exactly once. The rates come from
//! a calibration on the baseline cluster (CPU per op at a fixed rate) unless given: the peak
//! needs `max_hosts − ½` hosts at the loop's target utilisation, the trough leaves `min_hosts`
//! below its scale-in threshold.

use crate::autoscale::{self, AutoOpts, Scaled};
use crate::cluster::{DownOnDrop, Kv, UpOpts};
use crate::loadgen::{self, Load, LoadOpts, Sine, Spread};
use crate::monitor;
use crate::node;
use crate::peer;
use crate::planning::Planner;
use crate::scale;
use crate::state::KvState;
use pliant_placement::milp::{self, MilpOptions};
use pliant_placement::{Costs, HostSpec, Partition, Placement, Problem};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub const SYSTEMS: [&str; 4] = ["offline", "online", "greedy", "redis_rebalance"];

#[derive(Clone, Debug)]
pub struct BenchOpts {
    /// Seconds of sine load per system.
    pub duration_s: f64,
    /// Sine periods in `duration_s`.
    pub periods: f64,
    pub partitions: usize,
    pub k: usize,
    pub min_hosts: usize,
    pub max_hosts: usize,
    pub cpu_quota_pct: u32,
    /// Trough and peak (ops/s); calibrated when not given.
    pub low_ops: Option<f64>,
    pub high_ops: Option<f64>,
    pub writers: usize,
    pub value_bytes: usize,
    /// Steps of the offline planner's horizon.
    pub offline_steps: usize,
    /// One MILP solver run, seconds.
    pub time_limit_s: f64,
    /// Calibration: fixed rate and measurement window.
    pub calibrate_ops: f64,
    pub calibrate_s: f64,
    /// Time the online MILP on the 256-partition instance.
    pub p256: bool,
    /// Systems to run (all when empty); the baseline always runs.
    pub only: Vec<String>,
    /// Cluster state directories go under this.
    pub dir: PathBuf,
    /// Loop rounds.
    pub interval: Duration,
    /// Spread the load over the partitions as the seed's temporally skewed normal (a hot spot
    /// sliding once over every partition during the run, σ = partitions / 4) instead of evenly.
    pub skewed: bool,
}

impl BenchOpts {
    /// How the runs spread their writes over the partitions.
    pub fn spread(&self) -> Spread {
        if self.skewed {
            Spread::SlidingNormal {
                sigma: (self.partitions as f64 / 4.0).max(0.5),
                sweep_s: self.duration_s,
            }
        } else {
            Spread::Even
        }
    }
}

impl Default for BenchOpts {
    fn default() -> Self {
        BenchOpts {
            duration_s: 120.0,
            periods: 1.0,
            partitions: 8,
            k: 1,
            min_hosts: 2,
            max_hosts: 4,
            cpu_quota_pct: 20,
            low_ops: None,
            high_ops: None,
            writers: 8,
            value_bytes: 32,
            offline_steps: 8,
            time_limit_s: 15.0,
            calibrate_ops: 5000.0,
            calibrate_s: 5.0,
            p256: true,
            only: Vec::new(),
            dir: std::env::temp_dir(),
            interval: Duration::from_secs(2),
            skewed: true,
        }
    }
}

/// Payload of one key the writers store (`b:` + 10 digits, and the value).
pub fn bytes_per_key(value_bytes: usize) -> u64 {
    (loadgen::key(0).len() + value_bytes) as u64
}

/// What one system did.
#[derive(Clone, Debug, Default, Serialize)]
pub struct SystemResult {
    /// Payload bytes (key + value) arriving on hosts that did not hold them: a partition copy
    /// moved carries its master's keys at the end of the scale; a slot moved by the peer carries
    /// its keys to the new master and its `k` replicas.
    pub data_moved_bytes: u64,
    /// Acknowledged writes per second over the run, against the fully scaled-out baseline's.
    pub throughput_vs_full_pct: Option<f64>,
    /// Hosts in use, integrated over the run (sampled every 200 ms).
    pub host_seconds: f64,
    /// Partition copies moved (pliant); slot-range migrations `redis-cli` reported (the peer).
    pub moves: u64,
    pub acked_lost: u64,
    pub acked: u64,
    /// Ids found on more than one master.
    pub duplicated: u64,
    pub keys_moved: u64,
    pub slots_moved: u64,
    pub offered_ops: u64,
    pub achieved_ops_per_s: f64,
    /// Offered but never sent: a writer over a second behind drops the excess (open loop).
    pub dropped_ops: u64,
    /// Keys sent again (redirects, errors, short WAIT).
    pub retries: u64,
    pub scales: u64,
    pub failed_scales: u64,
    pub hosts_max: usize,
    pub hosts_end: usize,
    /// (seconds, hosts) at every change.
    pub hosts_timeline: Vec<(f64, usize)>,
    /// One sample a second while the load runs, and a last one when the scaler's last
    /// operation ended (offered and achieved 0 there): what the charts draw.
    pub timeline: Vec<Sample>,
    /// /proc/loadavg at the start and the end of the run.
    pub loadavg: (String, String),
    pub wall_s: f64,
    pub errors: Vec<String>,
}

/// One second of a run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Sample {
    /// Seconds since the load started (the end of the second sampled).
    pub t_s: f64,
    /// The sine's rate at `t_s`.
    pub offered_ops_per_s: f64,
    /// Writes acknowledged during the second.
    pub achieved_ops_per_s: f64,
    pub hosts: usize,
    /// Data moved by the scales finished so far.
    pub data_moved_bytes: u64,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Planners {
    pub offline: Option<SystemResult>,
    pub online: Option<SystemResult>,
    pub greedy: Option<SystemResult>,
    pub redis_rebalance: Option<SystemResult>,
}

impl Planners {
    fn slot(&mut self, name: &str) -> &mut Option<SystemResult> {
        match name {
            "offline" => &mut self.offline,
            "online" => &mut self.online,
            "greedy" => &mut self.greedy,
            _ => &mut self.redis_rebalance,
        }
    }

    fn all_mut(&mut self) -> [&mut Option<SystemResult>; 4] {
        [
            &mut self.offline,
            &mut self.online,
            &mut self.greedy,
            &mut self.redis_rebalance,
        ]
    }
}

/// The goals, evaluated on pliant's three planners (`None`: a planner did not run).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Goals {
    /// offline < online < greedy in data moved.
    pub data_moved_offline_lt_online_lt_greedy: Option<bool>,
    /// The optimisers' (offline and online) throughput at least 88 % of the baseline's: the
    /// seed's claim (2-12 % below a fully scaled-out cluster) is about them; its greedy
    /// first-fit baseline came out 15-22 % below the offline optimiser, and ours is reported
    /// (`throughput_vs_full_pct`) but not held to it.
    pub throughput_within_12pct: Option<bool>,
    pub zero_acked_lost: Option<bool>,
}

pub fn goals(p: &Planners) -> Goals {
    let ours = [&p.offline, &p.online, &p.greedy];
    let all: Option<Vec<&SystemResult>> = ours.iter().map(|r| r.as_ref()).collect();
    let Some(all) = all else {
        return Goals::default();
    };
    Goals {
        data_moved_offline_lt_online_lt_greedy: Some(
            all[0].data_moved_bytes < all[1].data_moved_bytes
                && all[1].data_moved_bytes < all[2].data_moved_bytes,
        ),
        throughput_within_12pct: all[..2]
            .iter()
            .map(|r| r.throughput_vs_full_pct.map(|t| t >= 88.0))
            .collect::<Option<Vec<bool>>>()
            .map(|v| v.iter().all(|&b| b)),
        zero_acked_lost: Some(all.iter().all(|r| r.acked_lost == 0)),
    }
}

/// Achieved against the baseline, percent.
pub fn vs_full(achieved: f64, full: f64) -> Option<f64> {
    (full > 0.0).then(|| 100.0 * achieved / full)
}

/// The whole report: the last line of `pliant bench kv`'s stdout.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub bench: &'static str,
    pub duration_s: f64,
    pub sine: Option<Sine>,
    /// How the writes were spread over the partitions.
    pub spread: Spread,
    /// The hosts' redis CPU against the rate, measured on the baseline.
    pub cpu_model: Option<CpuModel>,
    pub partitions: usize,
    pub k: usize,
    pub min_hosts: usize,
    pub max_hosts: usize,
    pub cpu_quota_pct: u32,
    pub bytes_per_key: u64,
    pub full: Option<SystemResult>,
    pub planners: Planners,
    pub online_solve_s_p256: Option<f64>,
    pub online_p256: serde_json::Value,
    pub goals: Goals,
    pub errors: Vec<String>,
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// Offline forecast: per step, per partition, the load of one copy in units of a host's capacity
/// at `host_cores` (the offline plan: `quota × OFFLINE_MAX_LOAD`), from the step's peak rate.
pub fn forecast_loads(
    load: &Forecast,
    cpu: &CpuModel,
    partitions: usize,
    copies: usize,
    host_cores: f64,
) -> Vec<Vec<f64>> {
    let steps = load.steps.max(1);
    let dt = load.duration_s / steps as f64;
    // Each partition's load in a step is its highest over the step, sampled (the rate and the
    // shares both move within it), at the sine's peak inside the step too.
    const SAMPLES: usize = 32;
    let per_step: Vec<Vec<f64>> = (0..steps)
        .map(|s| {
            let (a, b) = (s as f64 * dt, (s + 1) as f64 * dt);
            let r = load.sine.peak(a, b);
            let grid = (0..=SAMPLES).map(|k| a + (b - a) * k as f64 / SAMPLES as f64);
            let peak_t = grid
                .clone()
                .min_by(|x, y| {
                    (load.sine.rate(*x) - r)
                        .abs()
                        .total_cmp(&(load.sine.rate(*y) - r).abs())
                })
                .unwrap_or(a);
            let mut col = vec![0.0f64; partitions];
            for t in grid.chain([peak_t]) {
                let cores = cpu.cores(load.sine.rate(t));
                for (c, share) in col.iter_mut().zip(load.spread.shares(partitions, t)) {
                    // The model's cores are every process's (masters and replicas): each copy
                    // carries its even part of its partition's share.
                    *c = c.max(cores * share / copies as f64 / host_cores);
                }
            }
            col
        })
        .collect();
    (0..partitions)
        .map(|i| per_step.iter().map(|col| col[i]).collect())
        .collect()
}

/// What the offline planner is told about the load to come.
pub struct Forecast<'a> {
    pub sine: &'a Sine,
    pub spread: &'a Spread,
    pub duration_s: f64,
    /// Steps of the horizon over `duration_s`.
    pub steps: usize,
}

/// When the offline executor starts the move to step `s`: at the step's start, a step earlier
/// when the step needs more hosts than the one before (moves take seconds each).
pub fn offline_start(s: usize, hosts: &[usize], step_s: f64) -> f64 {
    let lead = if s > 0 && hosts[s] > hosts[s - 1] {
        step_s
    } else {
        0.0
    };
    (s as f64 * step_s - lead).max(0.0)
}

/// Moves, key copies moved and scales of one system's run.
#[derive(Clone, Debug, Default)]
struct Tally {
    moves: u64,
    keys: u64,
    slots: u64,
    scales: u64,
    failed: u64,
    errors: Vec<String>,
}

/// Every partition's placement and keys (`DBSIZE` of its master) when a scale begins.
fn pliant_before(kv: &Kv) -> (Vec<Vec<u32>>, Vec<u64>) {
    let keys = (0..kv.state.partitions)
        .map(|p| {
            kv.master_of(p)
                .and_then(|m| kv.connect(&m))
                .and_then(|mut c| {
                    redis::cmd("DBSIZE")
                        .query::<u64>(&mut c)
                        .map_err(|e| e.to_string())
                })
                .unwrap_or(0)
        })
        .collect();
    (kv.state.placement(), keys)
}

/// Copies moved and the keys they carried, from the placements before and after a scale: every
/// copy on a host that did not hold the partition before carries the keys the partition held when
/// the scale began.
pub fn copies_moved(before: &[Vec<u32>], after: &[Vec<u32>], keys: &[u64]) -> (u64, u64) {
    let (mut copies, mut moved) = (0, 0);
    for ((a, b), &n) in after.iter().zip(before).zip(keys) {
        let new = a.iter().filter(|h| !b.contains(h)).count() as u64;
        copies += new;
        moved += new * n;
    }
    (copies, moved)
}

fn say(line: &str) {
    eprintln!("[bench kv] {line}");
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum System {
    Full,
    Offline,
    Online,
    Greedy,
    Rebalance,
}

impl System {
    fn name(self) -> &'static str {
        match self {
            System::Full => "full",
            System::Offline => "offline",
            System::Online => "online",
            System::Greedy => "greedy",
            System::Rebalance => "redis_rebalance",
        }
    }

    fn parse(s: &str) -> Option<System> {
        [
            System::Offline,
            System::Online,
            System::Greedy,
            System::Rebalance,
        ]
        .into_iter()
        .find(|x| x.name() == s)
    }
}

fn auto_opts(o: &BenchOpts) -> AutoOpts {
    AutoOpts {
        min_hosts: o.min_hosts,
        max_hosts: o.max_hosts,
        interval: o.interval,
        ..AutoOpts::default()
    }
}

/// Rates and CPU per op, shared by every system after the baseline.
#[derive(Clone, Copy, Debug)]
struct Load0 {
    sine: Sine,
    cpu: CpuModel,
}

/// The hosts' redis CPU as a function of the offered rate, `idle + per_op × rate` (a line through
/// two measured points: per op cost falls with the rate, as batches grow).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct CpuModel {
    pub idle_cores: f64,
    pub cores_per_op: f64,
}

impl CpuModel {
    /// The line through two (ops/s, cores) points; through the origin and the higher point when
    /// the slope is not positive.
    pub fn fit(a: (f64, f64), b: (f64, f64)) -> CpuModel {
        let (lo, hi) = if a.0 <= b.0 { (a, b) } else { (b, a) };
        let slope = (hi.1 - lo.1) / (hi.0 - lo.0);
        if slope.is_finite() && slope > 0.0 && lo.1 - slope * lo.0 >= 0.0 {
            CpuModel {
                idle_cores: lo.1 - slope * lo.0,
                cores_per_op: slope,
            }
        } else {
            CpuModel {
                idle_cores: 0.0,
                cores_per_op: hi.1 / hi.0.max(1.0),
            }
        }
    }

    pub fn cores(&self, rate: f64) -> f64 {
        self.idle_cores + self.cores_per_op * rate
    }

    /// The rate that costs `cores` (at least 100 ops/s).
    pub fn rate_for(&self, cores: f64) -> f64 {
        ((cores - self.idle_cores) / self.cores_per_op).max(100.0)
    }
}

/// Ops/s and cores measured on the cluster at a fixed rate.
fn measure_at(kv: &Kv, dir: &Path, o: &BenchOpts, rate: f64, i: u64) -> Result<(f64, f64), String> {
    let lo = LoadOpts {
        sine: Sine::flat(rate),
        writers: o.writers,
        value_bytes: o.value_bytes,
        k: o.k,
        id_base: (1 << 40) + (i << 36),
        spread: Spread::Even,
    };
    let load = Load::start(dir, &lo, Instant::now())?;
    std::thread::sleep(Duration::from_secs(2));
    let snap = monitor::measure(
        &kv.state,
        kv.password(),
        Duration::from_secs_f64(o.calibrate_s),
    );
    load.finish();
    let cpu: f64 = snap.hosts.iter().map(|h| h.cpu).sum();
    let ops: f64 = snap.partitions.iter().map(|p| p.ops_per_s).sum();
    if ops < 1.0 || cpu <= 0.0 {
        return Err(format!(
            "calibration measured {ops:.0} ops/s on {cpu:.3} cores"
        ));
    }
    say(&format!(
        "calibration at {rate:.0} ops/s: {ops:.0} ops/s on {cpu:.3} cores ({:.1} µs of CPU per op)",
        cpu / ops * 1e6
    ));
    Ok((ops, cpu))
}

/// The CPU model of the cluster in `dir`: two rates, then the trough and peak they give, measured
/// again; the keys are flushed afterwards.
fn calibrate(kv: &Kv, dir: &Path, o: &BenchOpts) -> Result<(Sine, CpuModel), String> {
    let a = measure_at(kv, dir, o, o.calibrate_ops, 0)?;
    let b = measure_at(kv, dir, o, o.calibrate_ops * 3.0, 1)?;
    let first = rates(o, &CpuModel::fit(a, b));
    let lo = measure_at(kv, dir, o, first.low, 2)?;
    let hi = measure_at(kv, dir, o, first.high, 3)?;
    let model = CpuModel::fit(lo, hi);
    for n in &kv.state.nodes {
        let mut c = kv.connect(n)?;
        if node::info(&mut c, "replication")?
            .get("role")
            .map(String::as_str)
            == Some("master")
        {
            node::query_str(&mut c, &["FLUSHALL"])?;
        }
    }
    Ok((rates(o, &model), model))
}

/// Trough and peak: the peak needs `max_hosts − ½` hosts at the loop's target utilisation, the
/// trough is 0.6 × the scale-in threshold on `min_hosts` (unless given).
pub fn rates(o: &BenchOpts, m: &CpuModel) -> Sine {
    let a = AutoOpts::default();
    let q = f64::from(o.cpu_quota_pct) / 100.0;
    let high = o
        .high_ops
        .unwrap_or_else(|| m.rate_for((o.max_hosts as f64 - 0.5) * q * a.target));
    let low = o
        .low_ops
        .unwrap_or_else(|| m.rate_for(o.min_hosts as f64 * q * a.low * 0.6));
    Sine {
        low: low.min(high),
        high,
        period_s: o.duration_s / o.periods,
    }
}

/// The offline planner's costs, the seed's (Table 5.1: S = 1000 per host and step, I = 100 per
/// partition migrated).
pub const OFFLINE_HOST_STEP_COST: f64 = 1000.0;
pub const OFFLINE_MOVE_COST: f64 = 100.0;
/// The most of a host's CPU quota the offline plan fills at a step's peak: the seed's maximum
/// load per core (Table 5.1: L = 95 %). The loop keeps headroom (it scales out at `high`, 80 %,
/// and plans to `target`, 65 %) because it reacts to load it has already seen; the offline
/// planner knows the load to come (each copy at its highest within the step), so it needs none.
pub const OFFLINE_MAX_LOAD: f64 = 0.95;

/// The offline planner's plan over the forecast, solved before the load starts (it is the
/// planner that knows the future), with the problem its moves are derived from and the pool
/// (index → host id) it starts from.
struct OfflinePlan {
    problem: Problem,
    plan: pliant_placement::Plan,
    pool: Vec<Option<u32>>,
}

fn offline_plan(kv: &Kv, o: &BenchOpts, l0: Load0) -> Result<OfflinePlan, String> {
    let steps = o.offline_steps.max(1);
    let q = f64::from(o.cpu_quota_pct) / 100.0;
    let mut loads = forecast_loads(
        &Forecast {
            sine: &l0.sine,
            spread: &o.spread(),
            duration_s: o.duration_s,
            steps,
        },
        &l0.cpu,
        o.partitions,
        o.k + 1,
        q * OFFLINE_MAX_LOAD,
    );
    // A forecast beyond the pool is planned as a full pool (the loop's bound too).
    for t in 0..steps {
        let total: f64 = loads.iter().map(|l| l[t]).sum::<f64>() * (o.k + 1) as f64;
        let most = 0.97 * o.max_hosts as f64;
        if total > most {
            loads.iter_mut().for_each(|l| l[t] *= most / total);
        }
    }
    let mut ids: Vec<u32> = kv.state.hosts.iter().map(|h| h.id).collect();
    ids.sort_unstable();
    let pool: Vec<Option<u32>> = (0..o.max_hosts.max(ids.len()))
        .map(|j| ids.get(j).copied())
        .collect();
    let current = Placement::new(
        kv.state
            .placement()
            .iter()
            .map(|c| {
                c.iter()
                    .map(|h| ids.iter().position(|x| x == h).unwrap_or(0))
                    .collect()
            })
            .collect(),
    );
    let problem = Problem {
        partitions: loads
            .into_iter()
            .map(|load| Partition { bytes: 1, load })
            .collect(),
        host: HostSpec {
            cpu_capacity: 1.0,
            memory_bytes: 1 << 40,
        },
        max_hosts: pool.len(),
        k: o.k,
        current: Some(current),
        // The seed's weights (its Table 5.1): a host for one step costs S = 1000, moving a
        // partition I = 100 (every partition counts as one unit: the forecast has no sizes).
        // So a host-step is worth ten copies moved: the plan keeps a host a step longer rather
        // than move more than ten copies to empty it, and buys no host-step with a reshuffle.
        costs: Costs {
            host_step: OFFLINE_HOST_STEP_COST,
            per_byte_moved: OFFLINE_MOVE_COST,
            ..Costs::default()
        },
    };
    let plan = milp::plan_offline(
        &problem,
        &MilpOptions {
            time_limit_s: o.time_limit_s,
            exact_balance: false,
        },
    )
    .map_err(|e| format!("offline planner: {e}"))?;
    let hosts: Vec<usize> = plan.steps.iter().map(|s| s.hosts_used).collect();
    say(&format!(
        "offline: hosts per step {hosts:?}, {} copies moved over the horizon, {:?} in {:.2} s",
        plan.bytes_moved,
        plan.status,
        plan.solve_time.as_secs_f64()
    ));
    Ok(OfflinePlan {
        problem,
        plan,
        pool,
    })
}

/// Executes the offline plan: each step's placement at its time ([`offline_start`]), none
/// started after the run.
fn offline(
    kv: &mut Kv,
    o: &BenchOpts,
    op: OfflinePlan,
    t0: Instant,
    stop: &AtomicBool,
    tally: &Mutex<Tally>,
) -> Result<(), String> {
    let OfflinePlan {
        problem,
        plan,
        mut pool,
    } = op;
    let steps = plan.steps.len();
    let hosts: Vec<usize> = plan.steps.iter().map(|s| s.hosts_used).collect();
    let step_s = o.duration_s / steps as f64;
    for (s, sp) in plan.steps.iter().enumerate() {
        let at = offline_start(s, &hosts, step_s);
        if at >= o.duration_s || t0.elapsed().as_secs_f64() >= o.duration_s {
            break;
        }
        while t0.elapsed().as_secs_f64() < at {
            if stop.load(Ordering::Relaxed) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let p = scale::plan_to(kv, &problem, &pool, &sp.placement)?;
        if p.steps.is_empty() && p.new_hosts.is_empty() {
            continue;
        }
        say(&format!(
            "offline step {s} at {:.1} s: {} hosts, {} moves",
            t0.elapsed().as_secs_f64(),
            sp.hosts_used,
            p.steps.len()
        ));
        let (before, held) = pliant_before(kv);
        let r = scale::execute(kv, &p, &mut |l| say(&format!("offline: {l}")));
        let (copies, keys) = copies_moved(&before, &kv.state.placement(), &held);
        for (j, id) in p.pool.iter().enumerate() {
            pool[j] = kv.state.host(*id).map(|h| h.id);
        }
        let mut t = tally.lock().map_err(|e| e.to_string())?;
        t.scales += 1;
        t.moves += copies;
        t.keys += keys;
        if let Err(e) = r {
            t.failed += 1;
            t.errors.push(format!("offline step {s}: {e}"));
        }
    }
    Ok(())
}

/// The scaler of one system, on its own thread, until `stop` (or the duration).
fn scaler(
    sys: System,
    dir: &Path,
    o: &BenchOpts,
    op: Option<OfflinePlan>,
    t0: Instant,
    stop: &AtomicBool,
    tally: &Mutex<Tally>,
) -> Result<(), String> {
    let mut kv = Kv::open(dir)?;
    let bpk = bytes_per_key(o.value_bytes);
    let left = Duration::from_secs_f64(o.duration_s).saturating_sub(t0.elapsed());
    let stop_fn = || stop.load(Ordering::Relaxed) || pliant_lab::cmd::interrupted();
    let mut on_round = |r: &autoscale::Round| say(&format!("{}: round {r}", sys.name()));
    let mut progress = |l: &str| say(&format!("{}: {l}", sys.name()));
    let record = |r: &Result<Scaled, String>, copies: u64, keys: u64, slots: u64| {
        if let Ok(mut t) = tally.lock() {
            t.scales += 1;
            t.moves += copies;
            t.keys += keys;
            t.slots += slots;
            if let Err(e) = r {
                t.failed += 1;
                t.errors.push(e.clone());
            }
        }
    };
    // The peer's tool balances slot counts, blind to load: it is only asked to scale.
    let ao = AutoOpts {
        rebalance: sys != System::Rebalance,
        ..auto_opts(o)
    };
    let mut sc: Box<autoscale::Scaler<'_>> = match sys {
        System::Full => return Ok(()),
        System::Offline => {
            return match op {
                Some(op) => offline(&mut kv, o, op, t0, stop, tally),
                None => Err("offline: no plan".into()),
            }
        }
        System::Online | System::Greedy => {
            let planner = if sys == System::Greedy {
                Planner::Greedy
            } else {
                Planner::Online {
                    time_limit_s: o.time_limit_s,
                }
            };
            Box::new(move |kv: &mut Kv, to: usize, pr: &mut dyn FnMut(&str)| {
                let (before, held) = pliant_before(kv);
                let r = autoscale::plan_and_execute(kv, to, planner, pr);
                let (copies, keys) = copies_moved(&before, &kv.state.placement(), &held);
                let r = r.map(|_| Scaled {
                    moves: copies as usize,
                    bytes_moved: keys * bpk,
                });
                record(&r, copies, keys, 0);
                r
            })
        }
        System::Rebalance => {
            let (initial, copies) = (o.min_hosts, o.k as u64 + 1);
            Box::new(move |kv: &mut Kv, to: usize, pr: &mut dyn FnMut(&str)| {
                let r = peer::scale(kv, to, initial, bpk, pr);
                let (m, k, s) = r
                    .as_ref()
                    .map(|p| (p.scaled.moves as u64, p.keys_moved, p.slots_moved))
                    .unwrap_or_default();
                let r = r.and_then(|p| p.error.map_or(Ok(p.scaled), Err));
                record(&r, m, k * copies, s);
                r
            })
        }
    };
    autoscale::run_with(
        &mut kv,
        &ao,
        left,
        &stop_fn,
        &mut on_round,
        &mut progress,
        &mut *sc,
    )
    .map(|_| ())
}

/// One system from `up` to `down`. The baseline (`l0` = None) calibrates first.
fn run_system(sys: System, o: &BenchOpts, l0: Option<Load0>) -> (SystemResult, Option<Load0>) {
    let mut res = SystemResult {
        loadavg: (loadavg(), String::new()),
        ..SystemResult::default()
    };
    let started = Instant::now();
    let mut l0_out = l0;
    if let Err(e) = run_inner(sys, o, &mut l0_out, &mut res) {
        say(&format!("{}: {e}", sys.name()));
        res.errors.push(e);
    }
    res.loadavg.1 = loadavg();
    res.wall_s = started.elapsed().as_secs_f64();
    (res, l0_out)
}

fn run_inner(
    sys: System,
    o: &BenchOpts,
    l0: &mut Option<Load0>,
    res: &mut SystemResult,
) -> Result<(), String> {
    let dir = o.dir.join(format!(
        "pliant-kv-bench-{}-{}",
        std::process::id(),
        sys.name()
    ));
    let _guard = DownOnDrop(dir.clone());
    let hosts = if sys == System::Full {
        o.max_hosts
    } else {
        o.min_hosts
    };
    say(&format!("{}: up, {hosts} hosts", sys.name()));
    let kv = Kv::up(&UpOpts {
        hosts,
        partitions: o.partitions,
        k: o.k,
        cpu_quota_pct: o.cpu_quota_pct,
        dir: dir.clone(),
        planner: Planner::Online {
            time_limit_s: o.time_limit_s,
        },
    })?;
    let load0 = match *l0 {
        Some(l) => l,
        None => {
            let (sine, cpu) = calibrate(&kv, &dir, o)?;
            let l = Load0 { sine, cpu };
            say(&format!(
                "sine: {:.0} to {:.0} ops/s, period {:.0} s",
                l.sine.low, l.sine.high, l.sine.period_s
            ));
            *l0 = Some(l);
            l
        }
    };
    let op = match sys {
        System::Offline => Some(offline_plan(&kv, o, load0)?),
        _ => None,
    };
    let t0 = Instant::now();
    let load = Load::start(
        &dir,
        &LoadOpts {
            sine: load0.sine,
            writers: o.writers,
            value_bytes: o.value_bytes,
            k: o.k,
            id_base: 0,
            spread: o.spread(),
        },
        t0,
    )?;
    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Mutex::new(Tally::default()));
    let handle = {
        let (dir, o, stop, tally) = (dir.clone(), o.clone(), stop.clone(), tally.clone());
        std::thread::spawn(move || scaler(sys, &dir, &o, op, t0, &stop, &tally))
    };
    // Hosts in use over the run.
    let mut h = hosts;
    let mut last = t0;
    res.hosts_timeline.push((0.0, h));
    res.hosts_max = h;
    let end = Duration::from_secs_f64(o.duration_s);
    let bpk = bytes_per_key(o.value_bytes);
    let mut second = (t0, 0u64);
    while t0.elapsed() < end && !pliant_lab::cmd::interrupted() {
        std::thread::sleep(Duration::from_millis(200).min(end.saturating_sub(t0.elapsed())));
        let now = Instant::now();
        res.host_seconds += h as f64 * now.duration_since(last).as_secs_f64();
        last = now;
        let n = KvState::load(&dir).map(|s| s.hosts.len()).unwrap_or(h);
        if n != h {
            h = n;
            res.hosts_timeline.push((t0.elapsed().as_secs_f64(), h));
            res.hosts_max = res.hosts_max.max(h);
        }
        let dt = now.duration_since(second.0).as_secs_f64();
        if dt >= 1.0 {
            let acked = load.counters.acked.load(Ordering::Relaxed);
            let t = now.duration_since(t0).as_secs_f64();
            let moved = tally.lock().map(|t| t.keys * bpk).unwrap_or(0);
            res.timeline.push(Sample {
                t_s: t,
                offered_ops_per_s: load0.sine.rate(t),
                achieved_ops_per_s: (acked - second.1) as f64 / dt,
                hosts: h,
                data_moved_bytes: moved,
            });
            second = (now, acked);
        }
    }
    let t_end = t0.elapsed().as_secs_f64();
    let acked_by_end = load.counters.acked.load(Ordering::Relaxed);
    res.dropped_ops = load.counters.dropped.load(Ordering::Relaxed);
    res.offered_ops = load0.sine.offered(t_end) as u64;
    res.achieved_ops_per_s = acked_by_end as f64 / t_end.max(1e-3);
    say(&format!(
        "{}: load done ({:.0} acked ops/s); waiting for the scaler to finish its operation",
        sys.name(),
        res.achieved_ops_per_s
    ));
    stop.store(true, Ordering::Relaxed);
    let scaled = handle
        .join()
        .map_err(|_| "the scaler thread panicked".to_string())?;
    res.retries = load.counters.retries.load(Ordering::Relaxed);
    let acked = load.finish();
    if let Err(e) = scaled {
        res.errors.push(e);
    }
    // The timeline's last sample: the scaler's last operation has ended (after the load, it
    // may still have been moving); no load is offered any more.
    res.timeline.push(Sample {
        t_s: t0.elapsed().as_secs_f64(),
        offered_ops_per_s: 0.0,
        achieved_ops_per_s: 0.0,
        hosts: KvState::load(&dir).map(|s| s.hosts.len()).unwrap_or(h),
        data_moved_bytes: tally.lock().map(|t| t.keys * bpk).unwrap_or(0),
    });
    if let Ok(t) = tally.lock() {
        res.moves = t.moves;
        res.keys_moved = t.keys;
        res.slots_moved = t.slots;
        res.scales = t.scales;
        res.failed_scales = t.failed;
        res.data_moved_bytes = t.keys * bytes_per_key(o.value_bytes);
        res.errors.extend(t.errors.iter().cloned());
    }
    let st = KvState::load(&dir)?;
    res.hosts_end = st.hosts.len();
    let found = loadgen::scan_masters(&st, kv.password())?;
    let c = loadgen::check_acks(&acked, &found);
    res.acked = c.acked;
    res.acked_lost = c.lost;
    res.duplicated = c.duplicated;
    say(&format!(
        "{}: {} acked, {} lost, {} on two masters, {} moves, {} bytes moved, {:.0} host-seconds",
        sys.name(),
        c.acked,
        c.lost,
        c.duplicated,
        res.moves,
        res.data_moved_bytes,
        res.host_seconds
    ));
    Ok(())
}

/// Times the online MILP on the 256-partition solve-time instance.
fn solve_p256(time_limit_s: f64) -> (Option<f64>, serde_json::Value) {
    let problem = pliant_placement::instances::at_scale(256, 0.6, 1);
    let t = Instant::now();
    let r = milp::plan_online(
        &problem,
        &MilpOptions {
            time_limit_s,
            exact_balance: false,
        },
    );
    let s = t.elapsed().as_secs_f64();
    match r {
        Ok(p) => (
            Some(s),
            serde_json::json!({
                "status": format!("{:?}", p.status),
                "hosts": p.steps[0].hosts_used,
                "moves": p.steps[0].moves.len(),
                "attempts": p.attempts.len(),
                "loadavg": loadavg(),
            }),
        ),
        Err(e) => (
            None,
            serde_json::json!({ "error": e.to_string(), "solve_s": s }),
        ),
    }
}

/// Runs the benchmark: the baseline, then each system, then the solve-time measurement.
pub fn run(o: &BenchOpts) -> Result<Report, String> {
    if o.min_hosts < o.k + 1 || o.max_hosts <= o.min_hosts {
        return Err(format!(
            "hosts: need k + 1 ({}) <= min_hosts ({}) < max_hosts ({})",
            o.k + 1,
            o.min_hosts,
            o.max_hosts
        ));
    }
    let systems: Vec<System> = if o.only.is_empty() {
        SYSTEMS.iter().filter_map(|s| System::parse(s)).collect()
    } else {
        o.only
            .iter()
            .map(|s| System::parse(s).ok_or_else(|| format!("unknown system {s:?}")))
            .collect::<Result<_, _>>()?
    };
    let in_thread = |sys: System, l0: Option<Load0>| {
        let o = o.clone();
        // Each system on a thread of its own: `up` moves its thread into the cluster's namespace.
        std::thread::spawn(move || run_system(sys, &o, l0))
            .join()
            .map_err(|_| format!("{}: the run panicked", sys.name()))
    };
    let mut report = Report {
        bench: "kv",
        duration_s: o.duration_s,
        sine: None,
        spread: o.spread(),
        cpu_model: None,
        partitions: o.partitions,
        k: o.k,
        min_hosts: o.min_hosts,
        max_hosts: o.max_hosts,
        cpu_quota_pct: o.cpu_quota_pct,
        bytes_per_key: bytes_per_key(o.value_bytes),
        full: None,
        planners: Planners::default(),
        online_solve_s_p256: None,
        online_p256: serde_json::Value::Null,
        goals: Goals::default(),
        errors: Vec::new(),
    };
    let (full, l0) = in_thread(System::Full, None)?;
    report.sine = l0.map(|l| l.sine);
    report.cpu_model = l0.map(|l| l.cpu);
    let full_ops = full.achieved_ops_per_s;
    report.full = Some(full);
    match l0 {
        None => report
            .errors
            .push("the baseline failed before its calibration: no load for the others".into()),
        Some(l0) => {
            for sys in systems {
                if pliant_lab::cmd::interrupted() {
                    break;
                }
                let (r, _) = in_thread(sys, Some(l0))?;
                *report.planners.slot(sys.name()) = Some(r);
            }
        }
    }
    for r in report.planners.all_mut().into_iter().flatten() {
        r.throughput_vs_full_pct = vs_full(r.achieved_ops_per_s, full_ops);
    }
    if let Some(f) = report.full.as_mut() {
        f.throughput_vs_full_pct = vs_full(f.achieved_ops_per_s, full_ops);
    }
    if o.p256 && !pliant_lab::cmd::interrupted() {
        say("online MILP on 256 partitions ...");
        let (s, v) = solve_p256(o.time_limit_s);
        report.online_solve_s_p256 = s;
        report.online_p256 = v;
    }
    report.goals = goals(&report.planners);
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(moved: u64, pct: f64, lost: u64) -> Option<SystemResult> {
        Some(SystemResult {
            data_moved_bytes: moved,
            throughput_vs_full_pct: Some(pct),
            acked_lost: lost,
            ..SystemResult::default()
        })
    }

    #[test]
    fn goals_are_evaluated_on_the_three_planners() {
        let mut p = Planners {
            offline: r(10, 95.0, 0),
            online: r(20, 90.0, 0),
            greedy: r(30, 88.5, 0),
            redis_rebalance: r(5, 50.0, 3),
        };
        assert_eq!(
            goals(&p),
            Goals {
                data_moved_offline_lt_online_lt_greedy: Some(true),
                throughput_within_12pct: Some(true),
                zero_acked_lost: Some(true),
            }
        );
        // A failed scale is not a lost write.
        p.greedy
            .as_mut()
            .unwrap()
            .errors
            .push("planner: no placement".into());
        assert_eq!(goals(&p).zero_acked_lost, Some(true));
        // The greedy baseline's throughput is reported, not held to the optimisers' goal.
        p.greedy = r(30, 81.0, 0);
        assert_eq!(goals(&p).throughput_within_12pct, Some(true));
        p.online = r(40, 80.0, 1);
        let g = goals(&p);
        assert_eq!(g.data_moved_offline_lt_online_lt_greedy, Some(false));
        assert_eq!(g.throughput_within_12pct, Some(false));
        assert_eq!(g.zero_acked_lost, Some(false));
        p.greedy = None;
        assert_eq!(goals(&p), Goals::default());
    }

    #[test]
    fn report_has_the_contract_keys() {
        let p = Planners {
            offline: r(1, 100.0, 0),
            online: r(2, 99.0, 0),
            greedy: r(3, 98.0, 0),
            redis_rebalance: r(4, 97.0, 0),
        };
        let v = serde_json::to_value(&p).unwrap();
        for sys in SYSTEMS {
            for k in [
                "data_moved_bytes",
                "throughput_vs_full_pct",
                "host_seconds",
                "moves",
                "acked_lost",
                "timeline",
            ] {
                assert!(v[sys].get(k).is_some(), "{sys}.{k}");
            }
        }
        // What the charts read from each sample.
        let s = serde_json::to_value(Sample::default()).unwrap();
        for k in [
            "t_s",
            "offered_ops_per_s",
            "achieved_ops_per_s",
            "hosts",
            "data_moved_bytes",
        ] {
            assert!(s.get(k).is_some(), "sample.{k}");
        }
        assert_eq!(vs_full(45.0, 50.0), Some(90.0));
        assert_eq!(vs_full(45.0, 0.0), None);
        assert_eq!(bytes_per_key(32), 44);
    }

    #[test]
    fn copies_moved_carry_what_their_partition_held() {
        let before = vec![vec![0, 1], vec![0, 1], vec![1, 0]];
        let after = vec![vec![0, 2], vec![3, 2], vec![0, 1]];
        assert_eq!(copies_moved(&before, &after, &[10, 20, 30]), (3, 50));
    }

    #[test]
    fn the_cpu_model_is_a_line_through_two_points_and_sets_the_rates() {
        let m = CpuModel::fit((12_000.0, 0.30), (4_000.0, 0.14));
        assert!((m.cores_per_op - 0.16 / 8000.0).abs() < 1e-12);
        assert!((m.idle_cores - 0.06).abs() < 1e-9);
        assert!((m.cores(4000.0) - 0.14).abs() < 1e-9);
        assert!((m.rate_for(0.30) - 12_000.0).abs() < 1e-6);
        // A falling or negative-intercept line: through the origin and the higher point.
        let m = CpuModel::fit((1000.0, 0.5), (2000.0, 0.4));
        assert_eq!(m.idle_cores, 0.0);
        assert!((m.cores_per_op - 0.4 / 2000.0).abs() < 1e-12);
        let o = BenchOpts::default();
        let m = CpuModel {
            idle_cores: 0.02,
            cores_per_op: 20e-6,
        };
        let s = rates(&o, &m);
        // Peak: 3.5 hosts × 0.2 cores × 0.65; trough: 2 × 0.2 × 0.45 × 0.6.
        assert!((m.cores(s.high) - 3.5 * 0.2 * 0.65).abs() < 1e-9);
        assert!((m.cores(s.low) - 2.0 * 0.2 * 0.45 * 0.6).abs() < 1e-9);
        assert!((s.period_s - o.duration_s).abs() < 1e-9);
        let given = rates(
            &BenchOpts {
                low_ops: Some(10.0),
                high_ops: Some(20.0),
                ..o
            },
            &m,
        );
        assert_eq!((given.low, given.high), (10.0, 20.0));
    }

    #[test]
    fn the_forecast_needs_the_hosts_the_loop_would_want_and_scale_out_starts_early() {
        // Peak 10k ops/s at 40 µs per op = 0.4 cores; 8 partitions × 2 copies; hosts of
        // 0.2 × 0.65 cores: the peak step needs ceil(0.4 / 0.13) = 4 hosts.
        let s = Sine {
            low: 1000.0,
            high: 10_000.0,
            period_s: 80.0,
        };
        let cpu = CpuModel {
            idle_cores: 0.0,
            cores_per_op: 40e-6,
        };
        let f = |spread| Forecast {
            sine: &s,
            spread,
            duration_s: 80.0,
            steps: 8,
        };
        let l = forecast_loads(&f(&Spread::Even), &cpu, 8, 2, 0.2 * 0.65);
        assert_eq!(l.len(), 8);
        assert_eq!(l[0].len(), 8);
        let total = |t: usize| l.iter().map(|p| p[t]).sum::<f64>() * 2.0;
        assert_eq!(total(3).ceil() as usize, 4);
        assert!(total(0) < total(3) && total(7) < total(4));
        // Steps 3 and 4 hold the peak.
        assert!((total(3) - total(4)).abs() < 1e-9);
        // Skewed: the same total at each sample, the hot spot's partition loaded most.
        let sk = Spread::SlidingNormal {
            sigma: 2.0,
            sweep_s: 80.0,
        };
        let k = forecast_loads(&f(&sk), &cpu, 8, 2, 0.2 * 0.65);
        for (step, hot) in [(0, 0), (3, 3), (6, 6)] {
            let col: Vec<f64> = k.iter().map(|p| p[step]).collect();
            let max = col.iter().copied().fold(0.0, f64::max);
            assert!(
                (col[hot] - max).abs() < 1e-12 || col[hot] > 0.8 * max,
                "{col:?}"
            );
            // The step's per-partition peaks are at least the even split and no more than
            // the whole step's peak load.
            let sum: f64 = col.iter().sum::<f64>() * 2.0;
            assert!(sum >= total(step) - 1e-9, "{sum} {}", total(step));
            assert!(col.iter().all(|&x| x * 2.0 <= total(3) + 1e-9));
        }
        let hosts = [2, 3, 4, 4, 4, 3, 2, 2];
        assert_eq!(offline_start(0, &hosts, 10.0), 0.0);
        assert_eq!(offline_start(1, &hosts, 10.0), 0.0);
        assert_eq!(offline_start(2, &hosts, 10.0), 10.0);
        assert_eq!(offline_start(3, &hosts, 10.0), 30.0);
        assert_eq!(offline_start(5, &hosts, 10.0), 50.0);
    }
}
