//! `bench ha`: high-availability systems side by side on the same workloads, one after another
//! in one run, plus failover experiments.
//!
//! Systems: `no_ha` (pliant NAT, 3 replicas, controller, no protection), `pico_1k` / `pico_10k`
//! (the controller protects every replica with elastic Pico chords at 1 / 10 kHz), `remus_40`
//! (Remus mode, whole-replica epochs at 40 Hz, all output held), `ftmb` (every
//! replica runs its NAT on 2 FTMB worker threads with ordered logging to a logger in its ring
//! successor, snapshots every 50 ms; the controller recovers a dead primary by replay on that
//! host), `kernel_conntrackd` (the kernel peer, see [`crate::ha_kernel`]).
//!
//! Per system, in this order:
//! 1. txload ([`crate::txload`]): `connections` persistent TCP connections, 1400-byte
//!    request / 1400-byte response transactions, closed loop, for `duration_s` after 0.5 s of
//!    warm-up: `transactions_per_s`, `latency_us_p50/p95/p99` (nearest rank over every
//!    transaction in the window). Meanwhile: `cpu_pct` and `repl_bytes_per_s` (see below).
//! 2. iperf3, one TCP stream for `duration_s`: `gbps` (receiver side).
//! 3. Failover (the pliant system named by `failover_system`, and the kernel peer): a fresh
//!    txload run with `probe_flows` UDP probe flows; 1.5 s in, the primary fails (pliant:
//!    SIGKILL of replica r1; kernel: the master's links are cut and its keepalived and
//!    conntrackd SIGKILLed). `recovery_ms`: worst probe flow's time from the failure to the
//!    echo of its first probe sent after the failure (the first packet of the flow forwarded
//!    both ways by the new owner; probes every 2 ms). The `ftmb` system always runs its own
//!    failover (in `ftmb.failover`, summarised as `failover.ftmb_recovery_ms` etc.), whatever
//!    `failover_system` is. `tcp_stall_ms`: the longest gap between
//!    received bytes on any TCP connection. `flows_survived`: connections with no reset/error
//!    that completed a transaction started after the failure; `flows_total`: connections.
//!    A pliant failover also runs sequence-numbered UDP flows on every replica through it
//!    ([`FailoverUdp`]: reordered and lost datagrams, the other replicas' stall beside their
//!    own pre-kill gap).
//!
//! `cpu_pct` (100 = one core): pliant — the replica processes' utime+stime over the txload run
//! (all replicas, from /proc/<pid>/stat); kernel peer — the HA daemons' (conntrackd and
//! keepalived on both routers) utime+stime: the kernel's own forwarding and NAT run in softirq
//! context that no process or namespace is charged for, so it cannot be separated; the
//! whole-machine busy CPU over the same run is given for every system as `host_cpu_pct`
//! (it includes the load generator, identical for all systems).
//! `repl_bytes_per_s`: pliant — growth of the sum of `bytes_shipped` over every group of every
//! replica's `ha_status`, over the txload run; kernel peer — bytes sent on both routers' sync
//! veths (conntrackd FTFW) over the same run; ftmb — growth of the bytes the replicas' FTMB
//! loggers received (`ftmb_status`: `hosting.server.bytes_in`, summed over the replicas).

use crate::ha_kernel::{self, KernelPeer};
use crate::parse::parse_iperf3_gbps;
use crate::txload::{self, Marker, TxClientOpts, TxReport, TxServer, PROBE_PORT, TX_PORT};
use crate::BenchError;
use pliant_lab::{cmd, Lab, LabSpec, PliantNf, ReplicaMode};
use pliant_proto::Request;
use serde::Serialize;
use serde_json::Value;
use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub const SYSTEMS: [&str; 6] = [
    "no_ha",
    "pico_1k",
    "pico_10k",
    "remus_40",
    "ftmb",
    "kernel_conntrackd",
];
/// Systems a failover experiment can run on (pliant ones need protection).
pub const FAILOVER_SYSTEMS: [&str; 4] = ["pico_1k", "pico_10k", "remus_40", "ftmb"];
/// Time from the start of the failover window to the failure.
const KILL_AFTER: Duration = Duration::from_millis(1500);
/// Failover window after the failure (long enough for a TCP retransmission or two).
const AFTER_KILL: Duration = Duration::from_secs(3);
const PROTECT_TIMEOUT: Duration = Duration::from_secs(20);
const REACH_TIMEOUT: Duration = Duration::from_secs(10);
const REPLICAS: u8 = 3;
/// UDP flows per replica in a pliant failover trial, their rate (one every 2 ms, the probes'
/// pace) and their server port.
pub const FAILOVER_UDP_PER_REPLICA: usize = 2;
pub const FAILOVER_UDP_PPS: f64 = 500.0;
const FAILOVER_UDP_PORT: u16 = 7300;
/// Run directories of the kernel peer (configs, pid files, logs; removed on teardown).
pub const KERNEL_RUN_ROOT: &str = "/run/pliant-ha-peer";

#[derive(Clone, Debug)]
pub struct HaOpts {
    /// Seconds per txload window and per iperf3 run.
    pub duration_s: u32,
    pub connections: u32,
    pub request_bytes: u32,
    pub response_bytes: u32,
    /// 0: fixed sizes; > 0: lognormal sizes with these medians and this sigma (the seed's
    /// HTTP-like flowgrind model), clamped to 64 B..=64 KiB.
    pub size_sigma: f64,
    pub pliant_bin: Option<PathBuf>,
    /// Systems to run; empty = all.
    pub only: Vec<String>,
    /// Run the failover experiments.
    pub failover: bool,
    /// The pliant system whose failover fills the top-level `failover` section.
    pub failover_system: String,
    pub probe_flows: u16,
    /// Pliant failover trials (each in a fresh lab); the first fills `failover`, all of them
    /// `failover_trials`.
    pub trials: u32,
    /// Turn off checksum/segmentation offloads in the pliant labs (the user-space path wants
    /// MTU-sized frames with real checksums, as the e2e tests run it).
    pub disable_offloads: bool,
    pub run_root: PathBuf,
    /// How the pliant replicas reach each other (replication, FTMB logging, migration).
    pub transport: pliant_lab::mgmt::Transport,
    /// Also run `ftmb` over unix sockets and report `ftmb_tcp_vs_unix` (with TCP).
    pub ftmb_on_unix_too: bool,
    /// Every pliant replica on a host of its own with an agent (TCP); the failover kills a
    /// whole host (links cut, replica and agent SIGKILLed), as the kernel peer's failover
    /// kills its master router.
    pub hosts: bool,
    /// Measurement rounds (>= 1): every selected system is measured once per round, the
    /// order reversed every other round, and each system reports its median round (by
    /// transactions/s; the failovers run in the first round only). Two labs on two cores
    /// differ by several percent from one run to the next; the median of alternating rounds
    /// is what the ratios against `no_ha` should be read from.
    pub rounds: u32,
    /// With `hosts`: the hosts' replica ports are VXLAN tunnels over their management links.
    pub tunnels: bool,
    /// First source port of the measured transaction connections, the same for every system
    /// of a round (`run_ha` draws one per round); `None`: ephemeral ports.
    pub tx_sport_base: Option<u16>,
}

impl Default for HaOpts {
    fn default() -> Self {
        HaOpts {
            duration_s: 5,
            connections: 32,
            request_bytes: 1400,
            response_bytes: 1400,
            size_sigma: 0.0,
            pliant_bin: None,
            only: Vec::new(),
            failover: true,
            failover_system: "pico_1k".into(),
            probe_flows: 8,
            trials: 10,
            disable_offloads: true,
            run_root: PathBuf::from("/run/pliant"),
            transport: pliant_lab::mgmt::Transport::Unix,
            ftmb_on_unix_too: false,
            hosts: false,
            rounds: 1,
            tunnels: false,
            tx_sport_base: None,
        }
    }
}

#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct FailoverReport {
    /// What failed (system and victim); empty when not run.
    pub system: String,
    pub victim: String,
    /// "process" (a replica's process SIGKILLed) or "host" (a whole host lost: links cut,
    /// every process on it SIGKILLed).
    pub victim_kind: String,
    pub error: Option<String>,
    pub recovery_ms: Option<f64>,
    pub tcp_stall_ms: Option<f64>,
    pub flows_survived: Option<u32>,
    pub flows_total: Option<u32>,
    pub resets: Option<u64>,
    /// Earliest / latest first completion of a transaction started after the failure, over
    /// the connections (ms after the failure).
    pub first_txn_after_failure_ms: Option<f64>,
    pub all_flows_txn_after_failure_ms: Option<f64>,
    pub probe_flows: Option<usize>,
    pub probe_flows_recovered: Option<usize>,
    /// First errors of failed connections (at most 5).
    pub conn_errors: Vec<String>,
    /// Pliant: the controller's record of this failover (detect/activate/steer times; ftmb:
    /// the logger host's replay time and replayed packets).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub controller_record: Option<Value>,
    /// Pliant: sequence-numbered UDP flows through the failover, on every replica.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub udp: Option<FailoverUdp>,
}

/// Sequence-numbered UDP flows (flowgen) through one pliant failover: [`FAILOVER_UDP_PER_REPLICA`]
/// on every replica (placed by the controller's ring before their first datagram, located by
/// the replicas' `flows` listings before the kill), [`FAILOVER_UDP_PPS`] datagrams/s each. Gaps
/// are the receiver's largest inter-arrival gap per flow: `pre_kill_gap_ms` from the flows'
/// start (after the listing) to the kill, the stalls from the kill to the end of the window.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct FailoverUdp {
    pub flows: usize,
    pub on_failed_replica: usize,
    pub on_other_replicas: usize,
    /// Flows no replica listed (counted in neither group).
    pub not_located: usize,
    pub sent: u64,
    pub received: u64,
    /// Arrivals of a seq below the highest already seen, all flows.
    pub reordered: u64,
    pub duplicated: u64,
    pub lost_failed_replica: u64,
    pub lost_other_replicas: u64,
    /// Largest gap of the other replicas' flows before the kill.
    pub pre_kill_gap_ms: Option<f64>,
    /// Largest gap of the other replicas' flows that overlaps the failover (goal: <=
    /// `pre_kill_gap_ms`, the largest they saw before it in a window of `window_ms`). Gaps
    /// under 2.5 ms (a flow sends every 2 ms) count as 0.
    pub other_replica_stall_ms: Option<f64>,
    /// The failover as the flows saw it: from the kill until the failed replica's flows and
    /// the probes flowed again.
    pub failover_interval_ms: Option<f64>,
    /// Largest gap of the other replicas' flows in the `window_ms` after the kill, failover
    /// or not (on a busy machine a window's largest gap is its scheduling noise: this one is
    /// as likely as not to exceed the pre-kill one without any failover).
    pub other_replica_max_gap_ms: Option<f64>,
    /// Length of the pre-kill window and of the post-kill window.
    pub window_ms: Option<f64>,
    /// Largest gap of the failed replica's flows after the kill (their failover stall).
    pub failed_replica_stall_ms: Option<f64>,
    pub error: Option<String>,
}

#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct HaSystemReport {
    pub mode: String,
    /// Set when the system could not be brought up; then nothing else was measured.
    pub error: Option<String>,
    pub transactions_per_s: Option<f64>,
    pub latency_us_p50: Option<f64>,
    pub latency_us_p95: Option<f64>,
    pub latency_us_p99: Option<f64>,
    pub transactions: Option<u64>,
    /// Resets + errors on the txload connections (0 expected without a failure).
    pub tx_resets: Option<u64>,
    pub tx_errors: Option<u64>,
    pub tx_stall_ms: Option<f64>,
    pub gbps: Option<f64>,
    pub tcp_retransmits: Option<u64>,
    pub cpu_pct: Option<f64>,
    pub host_cpu_pct: Option<f64>,
    pub repl_bytes_per_s: Option<f64>,
    /// The system's own failover (kernel peer, ftmb; the pliant one is the top-level section).
    pub failover: Option<FailoverReport>,
    /// ftmb only: the replicas' FTMB numbers after the txload run (snapshot pause
    /// percentiles, snapshots, output-commit audit over the hosted loggers).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ftmb_detail: Option<Value>,
    /// pico/remus only: the replicas' output-commit audit after the txload run, summed
    /// (`audit_checked`, `audit_violations`, `audit_exempt`; every packet of a protected
    /// group checked as it left against the acks the backup sent).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output_audit: Option<Value>,
    /// Per-measurement failures (name -> reason); the others still ran.
    pub errors: BTreeMap<String, String>,
}

/// A system compared with `no_ha` (only from measured numbers).
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct VsNoHa {
    /// From each system's median round (`transactions_per_s`).
    pub transactions_per_s_ratio: Option<f64>,
    /// The same ratio within each round that measured both (round order): the spread, and
    /// pairs that share the machine's state of the moment (drift between rounds cancels).
    pub transactions_per_s_ratio_rounds: Vec<f64>,
    pub gbps_ratio: Option<f64>,
    pub latency_us_p50_added: Option<f64>,
    pub latency_us_p95_added: Option<f64>,
    pub latency_us_p99_added: Option<f64>,
}

/// The top-level failover section: the `failover_system`'s failover plus the ftmb system's
/// (`failover.ftmb_recovery_ms` beside Pico's numbers).
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct TopFailover {
    #[serde(flatten)]
    pub primary: FailoverReport,
    pub ftmb_recovery_ms: Option<f64>,
    pub ftmb_tcp_stall_ms: Option<f64>,
    pub ftmb_flows_survived: Option<u32>,
    pub ftmb_flows_total: Option<u32>,
    pub ftmb_resets: Option<u64>,
    /// Why the ftmb numbers are missing (not selected, failed, ...).
    pub ftmb_error: Option<String>,
}

impl TopFailover {
    fn new(primary: FailoverReport, ftmb: &HaSystemReport) -> Self {
        let mut t = TopFailover {
            primary,
            ..Default::default()
        };
        match &ftmb.failover {
            Some(f) => {
                t.ftmb_recovery_ms = f.recovery_ms;
                t.ftmb_tcp_stall_ms = f.tcp_stall_ms;
                t.ftmb_flows_survived = f.flows_survived;
                t.ftmb_flows_total = f.flows_total;
                t.ftmb_resets = f.resets;
                t.ftmb_error = f.error.clone();
            }
            None => {
                t.ftmb_error = Some(
                    ftmb.error
                        .clone()
                        .unwrap_or_else(|| "ftmb failover not run".into()),
                )
            }
        }
        t
    }
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct HaReport {
    pub bench: &'static str,
    /// The replicas' channels: "unix" (one host) or "tcp" (a management network between the
    /// replica namespaces, as between hosts).
    pub transport: &'static str,
    /// Pliant replicas each on a host of its own with an agent (`--hosts`): the number of
    /// hosts; `null` without.
    pub hosts: Option<u8>,
    /// Measurement rounds (`--rounds`): each system's figures are its median round's.
    pub rounds: u32,
    /// Every round's transactions/s per system, in round order (the spread behind the
    /// medians).
    pub transactions_per_s_rounds: BTreeMap<String, Vec<f64>>,
    pub duration_s: u32,
    pub connections: u32,
    pub request_bytes: u32,
    pub response_bytes: u32,
    pub size_sigma: f64,
    pub workload: &'static str,
    pub cpu_method: &'static str,
    pub failover_method: &'static str,
    pub no_ha: HaSystemReport,
    pub pico_1k: HaSystemReport,
    pub pico_10k: HaSystemReport,
    pub remus_40: HaSystemReport,
    pub ftmb: HaSystemReport,
    pub kernel_conntrackd: HaSystemReport,
    /// Pliant failover (primary killed under txload), with the ftmb system's numbers.
    pub failover: TopFailover,
    /// Every pliant failover trial summed up (`--trials`).
    pub failover_trials: TrialsSummary,
    pub vs_no_ha: BTreeMap<String, VsNoHa>,
    /// `--transport both`: ftmb run again over unix sockets in the same run...
    pub ftmb_unix: Option<HaSystemReport>,
    /// ...and ftmb's transactions/s over TCP divided by that over unix.
    pub ftmb_tcp_vs_unix: Option<f64>,
    pub total_s: f64,
}

fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

fn diff(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    Some(a? - b?)
}

impl HaReport {
    pub fn new(
        opts: &HaOpts,
        systems: [HaSystemReport; 6],
        trials: &[FailoverReport],
        total_s: f64,
    ) -> Self {
        let failover = trials.first().cloned().unwrap_or_else(|| FailoverReport {
            system: opts.failover_system.clone(),
            error: Some(if opts.failover {
                format!("not run: {} was not measured", opts.failover_system)
            } else {
                "not run (--no-failover)".into()
            }),
            ..Default::default()
        });
        let [no_ha, pico_1k, pico_10k, remus_40, ftmb, kernel_conntrackd] = systems;
        let failover = TopFailover::new(failover, &ftmb);
        let mut vs = BTreeMap::new();
        for (name, s) in [
            ("pico_1k", &pico_1k),
            ("pico_10k", &pico_10k),
            ("remus_40", &remus_40),
            ("ftmb", &ftmb),
            ("kernel_conntrackd", &kernel_conntrackd),
        ] {
            vs.insert(
                name.to_string(),
                VsNoHa {
                    transactions_per_s_ratio: ratio(s.transactions_per_s, no_ha.transactions_per_s),
                    transactions_per_s_ratio_rounds: Vec::new(),
                    gbps_ratio: ratio(s.gbps, no_ha.gbps),
                    latency_us_p50_added: diff(s.latency_us_p50, no_ha.latency_us_p50),
                    latency_us_p95_added: diff(s.latency_us_p95, no_ha.latency_us_p95),
                    latency_us_p99_added: diff(s.latency_us_p99, no_ha.latency_us_p99),
                },
            );
        }
        HaReport {
            bench: "ha",
            transport: opts.transport.label(),
            hosts: opts.hosts.then_some(REPLICAS),
            rounds: 1,
            transactions_per_s_rounds: BTreeMap::new(),
            duration_s: opts.duration_s,
            connections: opts.connections,
            request_bytes: opts.request_bytes,
            response_bytes: opts.response_bytes,
            size_sigma: opts.size_sigma,
            workload: "txload: persistent TCP connections, one request/response transaction \
                       outstanding per connection (closed loop), nearest-rank latency \
                       percentiles over every transaction in the window; iperf3 -P1 for gbps",
            cpu_method: "cpu_pct (100 = one core): pliant = replica processes' utime+stime; \
                         kernel_conntrackd = conntrackd+keepalived on both routers (kernel \
                         forwarding/NAT is softirq, charged to no process); host_cpu_pct = \
                         whole machine busy incl. the load generator",
            failover_method: "failure 1.5 s into a txload run with UDP probe flows every 2 ms; \
                              recovery_ms = worst probe flow's failure-to-first-echo of a probe \
                              sent after the failure; tcp_stall_ms = longest gap between \
                              received bytes on any connection; survived = no reset/error and a \
                              transaction started after the failure completed",
            no_ha,
            pico_1k,
            pico_10k,
            remus_40,
            ftmb,
            kernel_conntrackd,
            failover,
            failover_trials: TrialsSummary::of(trials),
            vs_no_ha: vs,
            ftmb_unix: None,
            ftmb_tcp_vs_unix: None,
            total_s,
        }
    }

    pub fn systems(&self) -> [(&'static str, &HaSystemReport); 6] {
        [
            ("no_ha", &self.no_ha),
            ("pico_1k", &self.pico_1k),
            ("pico_10k", &self.pico_10k),
            ("remus_40", &self.remus_40),
            ("ftmb", &self.ftmb),
            ("kernel_conntrackd", &self.kernel_conntrackd),
        ]
    }
}

fn progress(msg: &str) {
    eprintln!("[bench ha] {msg}");
}

/// Run the whole benchmark. Never fails as a whole: a system that cannot be measured carries
/// its error in the report.
pub fn run_ha(opts: &HaOpts) -> HaReport {
    let start = Instant::now();
    let rounds = opts.rounds.max(1);
    let mut per_round: Vec<[HaSystemReport; 6]> = Vec::new();
    let mut per_round_unix: Vec<HaSystemReport> = Vec::new();
    let mut trials: Vec<FailoverReport> = Vec::new();
    for r in 0..rounds {
        if rounds > 1 {
            progress(&format!("round {}/{rounds}", r + 1));
        }
        // Failovers in the first round only: later rounds measure the steady state again.
        // One draw of source ports per round, for every system of it (see `TX_SPORT_SPAN`).
        let ropts = HaOpts {
            failover: opts.failover && r == 0,
            tx_sport_base: opts.tx_sport_base.or_else(|| Some(random_sport_base(opts))),
            ..opts.clone()
        };
        let reverse = r % 2 == 1;
        let (out, t, unix) = run_round(&ropts, start, reverse);
        if r == 0 {
            trials = t;
        }
        per_round.push(out);
        per_round_unix.extend(unix);
    }
    let out = median_rounds(&per_round);
    if opts.failover && !FAILOVER_SYSTEMS.contains(&opts.failover_system.as_str()) {
        trials = vec![FailoverReport {
            system: opts.failover_system.clone(),
            error: Some(format!(
                "failover_system {} is not one of {FAILOVER_SYSTEMS:?}",
                opts.failover_system
            )),
            ..Default::default()
        }];
    }
    let ftmb_unix = (!per_round_unix.is_empty()).then(|| median_of(&per_round_unix));
    let mut report = HaReport::new(opts, out, &trials, start.elapsed().as_secs_f64());
    report.rounds = rounds;
    for (i, sys) in SYSTEMS.iter().enumerate() {
        let tps: Vec<f64> = per_round
            .iter()
            .filter_map(|o| o[i].transactions_per_s)
            .collect();
        if !tps.is_empty() {
            report
                .transactions_per_s_rounds
                .insert(sys.to_string(), tps);
        }
    }
    for (i, sys) in SYSTEMS.iter().enumerate().skip(1) {
        if let Some(vs) = report.vs_no_ha.get_mut(*sys) {
            vs.transactions_per_s_ratio_rounds = round_ratios(&per_round, i);
        }
    }
    if let Some(u) = ftmb_unix {
        report.ftmb_tcp_vs_unix = ratio(report.ftmb.transactions_per_s, u.transactions_per_s);
        report.ftmb_unix = Some(u);
    }
    report
}

/// System `i`'s transactions/s over `no_ha`'s within each round that measured both.
fn round_ratios(rounds: &[[HaSystemReport; 6]], i: usize) -> Vec<f64> {
    rounds
        .iter()
        .filter_map(|o| ratio(o[i].transactions_per_s, o[0].transactions_per_s))
        .collect()
}

/// Per system, the report of its median round by transactions/s (rounds that measured none
/// sort last); the first round's own failover (kernel peer, ftmb) is kept with it.
fn median_rounds(rounds: &[[HaSystemReport; 6]]) -> [HaSystemReport; 6] {
    let mut out: [HaSystemReport; 6] = Default::default();
    for (i, o) in out.iter_mut().enumerate() {
        let of: Vec<HaSystemReport> = rounds.iter().map(|r| r[i].clone()).collect();
        *o = median_of(&of);
        if let Some(first) = rounds.first() {
            o.failover = first[i].failover.clone();
        }
    }
    out
}

/// The median report by transactions/s (the lower middle of an even count).
fn median_of(reports: &[HaSystemReport]) -> HaSystemReport {
    let mut v: Vec<&HaSystemReport> = reports.iter().collect();
    v.sort_by(|a, b| match (a.transactions_per_s, b.transactions_per_s) {
        (Some(x), Some(y)) => x.total_cmp(&y),
        (Some(_), None) => std::cmp::Ordering::Less,
        (None, Some(_)) => std::cmp::Ordering::Greater,
        (None, None) => std::cmp::Ordering::Equal,
    });
    let measured = v.iter().filter(|r| r.transactions_per_s.is_some()).count();
    match measured {
        0 => v.first().map(|r| (*r).clone()).unwrap_or_default(),
        n => v[(n - 1) / 2].clone(),
    }
}

/// One round over the selected systems (in reverse order when `reverse`): their reports, the
/// pliant failover trials (when this round runs them) and ftmb over unix (when asked).
fn run_round(
    opts: &HaOpts,
    start: Instant,
    reverse: bool,
) -> (
    [HaSystemReport; 6],
    Vec<FailoverReport>,
    Option<HaSystemReport>,
) {
    let mut out: [HaSystemReport; 6] = Default::default();
    let mut trials: Vec<FailoverReport> = Vec::new();
    let mut order: Vec<(usize, &str)> = SYSTEMS.iter().copied().enumerate().collect();
    if reverse {
        order.reverse();
    }
    for (i, sys) in order {
        let sys = &sys;
        out[i].mode = mode_label(sys).into();
        if !opts.only.is_empty() && !opts.only.iter().any(|o| o == sys) {
            out[i].error = Some("not selected (--only)".into());
            continue;
        }
        if cmd::interrupted() {
            out[i].error = Some("interrupted before this system ran".into());
            continue;
        }
        progress(&format!("{sys}: start ({})", mode_label(sys)));
        let do_failover = opts.failover && *sys == opts.failover_system;
        if *sys == "kernel_conntrackd" {
            out[i] = measure_kernel(opts);
        } else {
            let (r, f) = measure_pliant(opts, sys, do_failover);
            out[i] = r;
            // Only the failover system's trials: a later system's empty list must not
            // overwrite them.
            if do_failover {
                trials = f;
            }
        }
        progress(&format!(
            "{sys}: done ({:.0} s elapsed)",
            start.elapsed().as_secs_f64()
        ));
    }
    let ftmb_unix = (opts.ftmb_on_unix_too
        && opts.transport == pliant_lab::mgmt::Transport::Tcp
        && !cmd::interrupted()
        && (opts.only.is_empty() || opts.only.iter().any(|o| o == "ftmb")))
    .then(|| {
        progress("ftmb over unix sockets (for ftmb_tcp_vs_unix): start");
        let unix = HaOpts {
            transport: pliant_lab::mgmt::Transport::Unix,
            ..opts.clone()
        };
        measure_pliant(&unix, "ftmb", false).0
    });
    (out, trials, ftmb_unix)
}

fn mode_label(sys: &str) -> &'static str {
    match sys {
        "no_ha" => "pliant-nat x3, no protection",
        "pico_1k" => "pliant-nat x3, pico chords 1000 Hz",
        "pico_10k" => "pliant-nat x3, pico chords 10000 Hz",
        "remus_40" => "pliant-nat x3, remus 40 Hz",
        "ftmb" => "pliant-nat x3, ftmb 2 workers, snapshots every 50 ms",
        _ => "nftables NAT pair, conntrackd FTFW + keepalived VRRPv3 100 ms",
    }
}

// ---------------------------------------------------------------------------------------------
// CPU accounting

/// utime+stime of a process in clock ticks.
pub fn proc_cpu_ticks(pid: i32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_stat_ticks(&s)
}

/// Fields 14 and 15 of /proc/<pid>/stat (counted after the `)` that ends the command name,
/// which may itself contain spaces and parentheses).
pub fn parse_stat_ticks(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // rest starts at field 3 (state): utime is field 14 -> index 11.
    let u: u64 = f.get(11)?.parse().ok()?;
    let s: u64 = f.get(12)?.parse().ok()?;
    Some(u + s)
}

/// (busy, total) jiffies over all CPUs from /proc/stat's first line.
pub fn parse_proc_stat(text: &str) -> Option<(u64, u64)> {
    let line = text.lines().next()?;
    let mut it = line.split_whitespace();
    if it.next()? != "cpu" {
        return None;
    }
    let v: Vec<u64> = it.filter_map(|x| x.parse().ok()).collect();
    if v.len() < 4 {
        return None;
    }
    // Guest time is already included in user/nice; count the first 8 fields only.
    let total: u64 = v.iter().take(8).sum();
    let idle = v[3] + v.get(4).copied().unwrap_or(0);
    Some((total.saturating_sub(idle), total))
}

struct CpuSnap {
    t: Instant,
    ticks: u64,
    host: Option<(u64, u64)>,
}

fn cpu_snap(pids: &[i32]) -> CpuSnap {
    CpuSnap {
        t: Instant::now(),
        ticks: pids.iter().filter_map(|p| proc_cpu_ticks(*p)).sum(),
        host: std::fs::read_to_string("/proc/stat")
            .ok()
            .and_then(|s| parse_proc_stat(&s)),
    }
}

fn clk_tck() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

fn ncpu() -> f64 {
    std::thread::available_parallelism()
        .map(|n| n.get() as f64)
        .unwrap_or(1.0)
}

/// (process cpu %, host cpu %) between two snapshots; 100 = one core.
fn cpu_pcts(a: &CpuSnap, b: &CpuSnap) -> (Option<f64>, Option<f64>) {
    let secs = b.t.duration_since(a.t).as_secs_f64();
    let proc =
        (secs > 0.0).then(|| b.ticks.saturating_sub(a.ticks) as f64 / clk_tck() / secs * 100.0);
    let host = match (a.host, b.host) {
        (Some((b0, t0)), Some((b1, t1))) if t1 > t0 => {
            Some((b1.saturating_sub(b0)) as f64 / (t1 - t0) as f64 * ncpu() * 100.0)
        }
        _ => None,
    };
    (proc, host)
}

// ---------------------------------------------------------------------------------------------
// Common measurement

/// What a system under test offers the common measurement code.
trait Sut {
    fn client_ns(&self) -> String;
    fn server_ip(&self) -> Ipv4Addr;
    /// Processes whose CPU is the system's `cpu_pct`.
    fn cpu_pids(&self) -> Vec<i32>;
    /// Replication bytes so far (monotonic while nothing fails).
    fn repl_bytes(&self) -> Result<u64, BenchError>;
    /// The members of the ring that places flows on replicas (pliant), so the failover's
    /// probe flows can be spread over every replica, the victim included; `None`: one router
    /// carries every flow (the kernel peer's VRRP master).
    fn ring_members(&self) -> Option<Vec<u32>> {
        None
    }
}

fn tx_opts(opts: &HaOpts, server: Ipv4Addr, dur: Duration) -> TxClientOpts {
    let mut o = TxClientOpts::new(SocketAddrV4::new(server, TX_PORT), opts.connections, dur);
    let dist = |median: u32| {
        if opts.size_sigma > 0.0 {
            txload::SizeDist::Lognormal {
                median: median.max(1),
                sigma: opts.size_sigma,
                min: 64,
                max: 64 << 10,
            }
        } else {
            txload::SizeDist::Fixed(median)
        }
    };
    o.request = dist(opts.request_bytes);
    o.response = dist(opts.response_bytes);
    o.probe_port = PROBE_PORT;
    o
}

/// Where the measured transaction connections' source ports are drawn, once per round
/// (`TxClientOpts::sport_base`): the fabric places flows by a hash of addresses and ports, so
/// one draw for all systems of a round compares them on the same placement of flows on
/// replicas, and a new draw each round samples other placements (one fixed set of ports
/// measures one placement, even or not, every time).
const TX_SPORT_SPAN: std::ops::Range<u16> = 20_000..60_000;

/// A random first port in [`TX_SPORT_SPAN`] with room for every connection.
fn random_sport_base(opts: &HaOpts) -> u16 {
    let mut b = [0u8; 2];
    // SAFETY: `b` is valid for writes of its length for the duration of the call.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    let r = if n == 2 {
        u16::from_le_bytes(b)
    } else {
        // No random source: the clock's nanoseconds are random enough for ports.
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos() as u16)
    };
    let room = TX_SPORT_SPAN.end - TX_SPORT_SPAN.start;
    let conns = opts.connections.min(u32::from(room) / 2) as u16;
    TX_SPORT_SPAN.start + r % (room - conns)
}

fn tx_err(e: txload::TxError) -> BenchError {
    BenchError::Tool {
        tool: "txload",
        reason: e.to_string(),
    }
}

/// txload + CPU + replication bytes into `r`.
fn measure_txload(opts: &HaOpts, sut: &dyn Sut, r: &mut HaSystemReport) -> Result<(), BenchError> {
    let mut o = tx_opts(
        opts,
        sut.server_ip(),
        Duration::from_secs(u64::from(opts.duration_s)),
    );
    // The same flows on the same replicas for every system of the round (each is measured
    // in a lab of its own, once: no earlier connection of these ports is in TIME_WAIT there;
    // a failover run in the same lab afterwards uses ephemeral ports).
    o.sport_base = opts.tx_sport_base;
    let sizes = if opts.size_sigma > 0.0 {
        format!("lognormal (sigma {})", opts.size_sigma)
    } else {
        "fixed".into()
    };
    progress(&format!(
        "  txload: {} connections, {}B/{}B {sizes} transactions, {} s",
        opts.connections, opts.request_bytes, opts.response_bytes, opts.duration_s
    ));
    let pids = sut.cpu_pids();
    let repl0 = sut.repl_bytes();
    let c0 = cpu_snap(&pids);
    let m = Marker::default();
    let rep = txload::run_client(Some(&sut.client_ns()), &o, &m).map_err(tx_err)?;
    let c1 = cpu_snap(&pids);
    let repl1 = sut.repl_bytes();
    let (p, h) = cpu_pcts(&c0, &c1);
    r.cpu_pct = p.filter(|_| !pids.is_empty());
    r.host_cpu_pct = h;
    match (repl0, repl1) {
        (Ok(a), Ok(b)) => {
            let secs = c1.t.duration_since(c0.t).as_secs_f64();
            r.repl_bytes_per_s = (secs > 0.0).then(|| b.saturating_sub(a) as f64 / secs);
        }
        (Err(e), _) | (_, Err(e)) => {
            r.errors.insert("repl_bytes".into(), e.to_string());
        }
    }
    fill_tx(r, &rep);
    progress(&format!(
        "  txload: {:.0} txn/s, p50 {} us, p99 {} us, resets {}",
        rep.transactions_per_s,
        rep.latency_us_p50.unwrap_or(f64::NAN),
        rep.latency_us_p99.unwrap_or(f64::NAN),
        rep.resets
    ));
    Ok(())
}

fn fill_tx(r: &mut HaSystemReport, rep: &TxReport) {
    r.transactions_per_s = Some(rep.transactions_per_s);
    r.latency_us_p50 = rep.latency_us_p50;
    r.latency_us_p95 = rep.latency_us_p95;
    r.latency_us_p99 = rep.latency_us_p99;
    r.transactions = Some(rep.transactions);
    r.tx_resets = Some(rep.resets);
    r.tx_errors = Some(rep.errors);
    r.tx_stall_ms = Some(rep.tcp_stall_ms);
}

fn measure_iperf(client_ns: &str, server: Ipv4Addr, secs: u32) -> Result<(f64, u64), BenchError> {
    progress(&format!("  iperf3: 1 TCP stream for {secs} s"));
    let (t, s) = (secs.to_string(), server.to_string());
    let mut attempt = 0;
    loop {
        attempt += 1;
        let out = cmd::run(
            &cmd::in_ns(
                client_ns,
                &[
                    "iperf3",
                    "-c",
                    &s,
                    "-t",
                    &t,
                    "-J",
                    "--connect-timeout",
                    "3000",
                ],
            ),
            Duration::from_secs(u64::from(secs) + 30),
        )
        .map_err(|e| BenchError::Tool {
            tool: "iperf3",
            reason: e.to_string(),
        })?;
        // The server says "busy" for a moment after a previous test; not a measurement.
        if attempt < 3 && out.stdout.contains("the server is busy") {
            std::thread::sleep(Duration::from_secs(1));
            continue;
        }
        let r = parse_iperf3_gbps(&out.stdout)?;
        return Ok((r.gbps, r.retransmits));
    }
}

/// A txload run with probe flows during which `fail` injects the failure (it must set the
/// marker at the failure instant) and returns a description of the victim.
fn run_failover(
    opts: &HaOpts,
    sut: &dyn Sut,
    system: &str,
    fail: &mut dyn FnMut(&Marker) -> Result<String, BenchError>,
) -> FailoverReport {
    let mut f = FailoverReport {
        system: system.into(),
        ..Default::default()
    };
    let mut o = tx_opts(opts, sut.server_ip(), KILL_AFTER + AFTER_KILL);
    o.probe_flows = opts.probe_flows;
    if let Some(m) = sut.ring_members() {
        // Spread over every replica: with ephemeral (often consecutive) source ports the
        // probes could all land on survivors and time nothing.
        let per = usize::from(opts.probe_flows).div_ceil(m.len());
        o.probe_sport_base = crate::flowgen::Ring::of(&m).ok().and_then(|r| {
            r.spread_block(
                &m,
                pliant_state::key::proto::UDP,
                o.probe_port,
                per,
                30_000,
                40_000,
            )
        });
        if o.probe_sport_base.is_none() {
            progress("  failover: no probe port block spreads over the ring; ephemeral ports");
        }
    }
    o.warmup = Duration::ZERO;
    progress(&format!(
        "  failover: txload with {} probe flows, failure after {:?}",
        opts.probe_flows, KILL_AFTER
    ));
    let m = Arc::new(Marker::default());
    let h = match txload::spawn_client(Some(sut.client_ns()), o, m.clone()) {
        Ok(h) => h,
        Err(e) => {
            f.error = Some(e.to_string());
            return f;
        }
    };
    std::thread::sleep(KILL_AFTER);
    let failed = fail(&m);
    let rep = txload::join_client(h);
    match (failed, rep) {
        (Err(e), _) => f.error = Some(format!("failure injection: {e}")),
        (_, Err(e)) => f.error = Some(format!("txload: {e}")),
        (Ok(victim), Ok(rep)) => {
            f.victim = victim;
            fill_failover(&mut f, &rep);
            progress(&format!(
                "  failover: recovery {:?} ms, tcp stall {:.0} ms, survived {}/{}",
                f.recovery_ms,
                rep.tcp_stall_ms,
                rep.conns_survived(true),
                rep.connections
            ));
        }
    }
    f
}

fn fill_failover(f: &mut FailoverReport, rep: &TxReport) {
    f.recovery_ms = rep.probe_recovery_ms();
    f.tcp_stall_ms = Some(rep.tcp_stall_ms);
    f.flows_survived = Some(rep.conns_survived(true));
    f.flows_total = Some(rep.connections);
    f.resets = Some(rep.resets);
    let firsts: Vec<f64> = rep
        .per_conn
        .iter()
        .filter_map(|c| c.first_done_after_mark_ms)
        .collect();
    f.first_txn_after_failure_ms = firsts.iter().copied().reduce(f64::min);
    f.all_flows_txn_after_failure_ms =
        (firsts.len() == rep.per_conn.len()).then(|| firsts.iter().copied().fold(0.0, f64::max));
    f.probe_flows = Some(rep.probes.len());
    f.probe_flows_recovered = Some(
        rep.probes
            .iter()
            .filter(|p| p.recovery_ms.is_some())
            .count(),
    );
    f.conn_errors = rep
        .per_conn
        .iter()
        .filter_map(|c| c.error.clone())
        .take(5)
        .collect();
}

// ---------------------------------------------------------------------------------------------
// Kernel peer

struct KernelSut<'a>(&'a KernelPeer);

impl Sut for KernelSut<'_> {
    fn client_ns(&self) -> String {
        self.0.client_ns()
    }
    fn server_ip(&self) -> Ipv4Addr {
        ha_kernel::SERVER_IP
    }
    fn cpu_pids(&self) -> Vec<i32> {
        self.0.ha_pids()
    }
    fn repl_bytes(&self) -> Result<u64, BenchError> {
        self.0.sync_tx_bytes()
    }
}

fn measure_kernel(opts: &HaOpts) -> HaSystemReport {
    let mut r = HaSystemReport {
        mode: mode_label("kernel_conntrackd").into(),
        ..Default::default()
    };
    // Not under the labs' run root: lab listings would take the peer's directory for a lab.
    let mut peer = match KernelPeer::up(Path::new(KERNEL_RUN_ROOT)) {
        Ok(p) => p,
        Err(e) => {
            r.error = Some(format!("kernel peer up: {e}"));
            return r;
        }
    };
    let bind = SocketAddrV4::new(ha_kernel::SERVER_IP, TX_PORT);
    let srv = match TxServer::start(Some(&peer.server_ns()), bind, PROBE_PORT) {
        Ok(s) => s,
        Err(e) => {
            r.error = Some(format!("txload server: {e}"));
            return r;
        }
    };
    if let Err(e) = measure_txload(opts, &KernelSut(&peer), &mut r) {
        r.errors.insert("txload".into(), e.to_string());
    }
    if !cmd::interrupted() {
        let res = peer
            .start_iperf_server()
            .and_then(|()| measure_iperf(&peer.client_ns(), ha_kernel::SERVER_IP, opts.duration_s));
        match res {
            Ok((g, rt)) => {
                r.gbps = Some(g);
                r.tcp_retransmits = Some(rt);
            }
            Err(e) => {
                r.errors.insert("iperf3".into(), e.to_string());
            }
        }
    }
    if opts.failover && !cmd::interrupted() {
        // The failure needs `&mut peer` while the Sut borrows it: take what the run needs first.
        let cl = peer.client_ns();
        struct Ns(String);
        impl Sut for Ns {
            fn client_ns(&self) -> String {
                self.0.clone()
            }
            fn server_ip(&self) -> Ipv4Addr {
                ha_kernel::SERVER_IP
            }
            fn cpu_pids(&self) -> Vec<i32> {
                Vec::new()
            }
            fn repl_bytes(&self) -> Result<u64, BenchError> {
                Ok(0)
            }
        }
        let mut fail = |m: &Marker| {
            peer.kill_master(m).map(|router| {
                format!("router {router:?} (links cut, keepalived+conntrackd SIGKILLed)")
            })
        };
        let mut f = run_failover(opts, &Ns(cl), "kernel_conntrackd", &mut fail);
        f.victim_kind = "host".into();
        r.failover = Some(f);
    }
    drop(srv);
    drop(peer);
    r
}

// ---------------------------------------------------------------------------------------------
// Pliant labs

/// `[ha]` of the controller config for a system.
pub fn controller_ha_section(sys: &str) -> Option<&'static str> {
    match sys {
        "no_ha" => Some("[ha]\nmode = \"off\"\n"),
        "pico_1k" => Some("[ha]\nmode = \"pico\"\npolicy = \"chords\"\nhz = 1000\n"),
        "pico_10k" => Some("[ha]\nmode = \"pico\"\npolicy = \"chords\"\nhz = 10000\n"),
        "remus_40" => Some("[ha]\nmode = \"remus\"\nremus_hz = 40\n"),
        "ftmb" => Some("[ha]\nmode = \"ftmb\"\n"),
        _ => None,
    }
}

/// Expected `ha_status` mode of every replica once the controller protected it.
fn expected_mode(sys: &str) -> &'static str {
    match sys {
        "no_ha" => "off",
        "remus_40" => "remus",
        "ftmb" => "ftmb",
        _ => "pico",
    }
}

/// A pliant lab with 3 HA-capable replicas and a controller. Drop stops the controller (it
/// detaches its steering) and then the lab removes everything it made.
struct PliantSys {
    dir: PathBuf,
    controller: Option<Child>,
    lab: Option<Lab>,
    srv: Option<TxServer>,
}

impl Drop for PliantSys {
    fn drop(&mut self) {
        self.srv = None;
        if let Some(mut c) = self.controller.take() {
            // SAFETY: SIGTERM to the controller process we spawned (not yet reaped).
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            if cmd::wait_bounded(&mut c, Duration::from_secs(5)).is_none() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
        if let Some(lab) = self.lab.take() {
            let opts = pliant_lab::scale::ScaleOptions::default();
            if let Ok(rs) = pliant_lab::scale::replicas(lab.name(), &opts) {
                for r in rs.iter().filter(|r| r.index > REPLICAS) {
                    let _ = pliant_lab::scale::remove_replica(lab.name(), r.index, &opts);
                }
            }
            drop(lab);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl PliantSys {
    fn lab(&self) -> &Lab {
        // Invariant: `lab` is Some from construction until Drop.
        self.lab.as_ref().expect("lab present until drop")
    }

    fn replica_pids(&self) -> Vec<i32> {
        let st = pliant_lab::state::LabState::load(&self.lab().state().path())
            .unwrap_or_else(|_| self.lab().state().clone());
        st.procs
            .iter()
            .filter(|p| p.role.starts_with("pliant-r"))
            .map(|p| p.pid)
            .filter(|p| Path::new(&format!("/proc/{p}")).exists())
            .collect()
    }

    fn sockets(&self) -> Vec<(u8, PathBuf)> {
        (1..=REPLICAS)
            .filter_map(|n| Some((n, self.lab().replica_socket(n)?.to_path_buf())))
            .collect()
    }
}

/// One request/answer on a lab replica's control socket (as the lab's admin), the answer if
/// it says `ok`.
pub fn replica_request(sock: &Path, req: &Request) -> Result<Value, BenchError> {
    pliant_lab::ha::control_client(sock)
        .with_timeout(Duration::from_secs(10))
        .call(req)
        .map_err(|e| BenchError::Tool {
            tool: "replica control",
            reason: e.to_string(),
        })
}

/// Sum of `bytes_shipped` over every group of an `ha_status` answer.
pub fn shipped_bytes(status: &Value) -> u64 {
    status["groups"]
        .as_array()
        .map(|g| g.iter().filter_map(|x| x["bytes_shipped"].as_u64()).sum())
        .unwrap_or(0)
}

/// True when a replica's `ftmb_status` shows it logging to a logger with its first (full)
/// snapshot acknowledged.
pub fn ftmb_protected(status: &Value) -> bool {
    status["mode"] == "ftmb" && status["protected"] == true && status["logger"].is_string()
}

/// Replication bytes as the logger a replica hosts received them (`ftmb_status`:
/// `hosting.server.bytes_in`: input log, PALs, output records and snapshots of the primary
/// logging to it). Summed over every replica, that is everything FTMB shipped; measured at
/// the receiving end because the primaries' per-queue streams publish no byte counters.
pub fn ftmb_logged_bytes(status: &Value) -> u64 {
    status["hosting"]["server"]["bytes_in"]
        .as_u64()
        .unwrap_or(0)
}

/// True when a replica's `ha_status` shows `mode` with every group up (or, for "off", no
/// protected group).
pub fn protected_as(status: &Value, mode: &str) -> bool {
    if status["mode"] != mode {
        return false;
    }
    if mode == "off" {
        return true;
    }
    status["groups"]
        .as_array()
        .is_some_and(|g| !g.is_empty() && g.iter().all(|x| x["state"] == "up"))
}

struct PliantSut<'a>(&'a PliantSys, bool);

impl Sut for PliantSut<'_> {
    fn client_ns(&self) -> String {
        self.0.lab().netns(pliant_lab::Role::Client)
    }
    fn ring_members(&self) -> Option<Vec<u32>> {
        Some((1..=u32::from(REPLICAS)).collect())
    }
    fn server_ip(&self) -> Ipv4Addr {
        pliant_lab::SERVER_IP
            .parse()
            .unwrap_or(Ipv4Addr::new(10, 77, 2, 2))
    }
    fn cpu_pids(&self) -> Vec<i32> {
        self.0.replica_pids()
    }
    fn repl_bytes(&self) -> Result<u64, BenchError> {
        let mut sum = 0;
        for (_, s) in self.0.sockets() {
            sum += if self.1 {
                ftmb_logged_bytes(&replica_request(&s, &Request::FtmbStatus)?)
            } else {
                shipped_bytes(&replica_request(&s, &Request::HaStatus)?)
            };
        }
        Ok(sum)
    }
}

fn pliant_up(opts: &HaOpts, sys: &str) -> Result<PliantSys, String> {
    let bin = opts
        .pliant_bin
        .clone()
        .ok_or("no pliant binary given (needed for the replicas and the controller)")?;
    let ha = controller_ha_section(sys).ok_or_else(|| format!("{sys} is not a pliant system"))?;
    let mut spec = LabSpec::new(ReplicaMode::Pliant {
        config: PliantNf::nat(),
    });
    spec.pliant_bin = Some(bin.clone());
    spec.replicas = REPLICAS;
    spec.disable_offloads = opts.disable_offloads;
    spec.files.clear();
    spec.ha = true;
    if sys == "ftmb" {
        spec.ha_mode = pliant_lab::LabHaMode::Ftmb;
    }
    spec.run_root = opts.run_root.clone();
    spec.transport = opts.transport;
    if opts.hosts {
        spec.transport = pliant_lab::mgmt::Transport::Tcp;
        spec.agents = true;
        spec.tunnels = opts.tunnels;
    }
    let lab = Lab::up(spec).map_err(|e| format!("lab up: {e}"))?;
    let dir = lab.run_dir().join("bench-ha");
    std::fs::create_dir_all(&dir).map_err(|e| format!("mkdir {}: {e}", dir.display()))?;
    let mut sys_ = PliantSys {
        dir: dir.clone(),
        controller: None,
        lab: Some(lab),
        srv: None,
    };
    // Over TCP the controller tells replicas each other's management addresses.
    let (tcp_ctl, mut tcp_ha) = match (opts.transport, opts.hosts) {
        (pliant_lab::mgmt::Transport::Tcp, _) | (_, true) => pliant_lab::mgmt::controller_keys(),
        _ => (String::new(), String::new()),
    };
    if opts.hosts {
        // The hosts' agents, with the kernel peer's detection budget: VRRP declares its master
        // dead after 3 missed adverts of 100 ms; a host here is dead after 300 ms of silence
        // (plus one poll bound, 75 ms).
        tcp_ha.push_str(&pliant_lab::agents::hosts_section(REPLICAS, 20, 300));
    }
    // As the e2e HA harness runs it: 10 ms liveness probes, NAT port blocks of 1000 (a
    // failed-over replica's block stays quarantined while its flows live on elsewhere).
    let ctl = format!(
        "[controller]\napi_socket = \"{d}/api.sock\"\ntoken_file = \"{d}/token\"\n\
         store = \"{d}/store.json\"\nheartbeat_ms = 100\ndead_after_missed = 5\n{tcp_ctl}\
         [lab]\nname = \"{name}\"\nrun_root = \"{root}\"\nnat_addr = \"{nat}\"\n{steering}\
         [ports]\nlo = 20000\nhi = 59999\nblock = 1000\nper_replica = 1\n\
         [policy]\nauto = false\nmax_replicas = 60\n{ha}watch_ms = 10\n{tcp_ha}",
        d = dir.display(),
        tcp_ha = tcp_ha,
        name = sys_.lab().name(),
        steering = match opts.hosts {
            true => pliant_lab::agents::steering_keys(),
            false => String::new(),
        },
        root = opts.run_root.display(),
        nat = pliant_lab::OUTSIDE_GW_IP,
    );
    let cfg = dir.join("ctl.toml");
    std::fs::write(&cfg, ctl).map_err(|e| format!("write {}: {e}", cfg.display()))?;
    let log = std::fs::File::create(dir.join("controller.log")).map_err(|e| e.to_string())?;
    let log2 = log.try_clone().map_err(|e| e.to_string())?;
    let child = pliant_lab::mgmt::controller_process(sys_.lab().state(), &bin, &cfg)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log2)
        .spawn()
        .map_err(|e| format!("start controller: {e}"))?;
    sys_.controller = Some(child);
    let ctl_log = || pliant_lab::log_tail(&dir.join("controller.log"), 10);
    // Every replica must report the mode this system asks for, every group up.
    let want = expected_mode(sys);
    let t = Instant::now();
    loop {
        if let Some(c) = sys_.controller.as_mut() {
            if let Ok(Some(st)) = c.try_wait() {
                return Err(format!("controller exited ({st}): {}", ctl_log()));
            }
        }
        let ok = controller_sees_all(&bin, &dir)
            && sys_.sockets().iter().all(|(_, s)| {
                if want == "ftmb" {
                    replica_request(s, &Request::FtmbStatus)
                        .map(|v| ftmb_protected(&v))
                        .unwrap_or(false)
                } else {
                    replica_request(s, &Request::HaStatus)
                        .map(|v| protected_as(&v, want))
                        .unwrap_or(false)
                }
            });
        if ok && sys_.sockets().len() == usize::from(REPLICAS) {
            break;
        }
        if t.elapsed() > PROTECT_TIMEOUT {
            let st: Vec<String> = sys_
                .sockets()
                .iter()
                .map(|(n, s)| {
                    let cmd = if want == "ftmb" {
                        Request::FtmbStatus
                    } else {
                        Request::HaStatus
                    };
                    format!(
                        "r{n}: {}",
                        replica_request(s, &cmd)
                            .map(|v| v.to_string())
                            .unwrap_or_else(|e| e.to_string())
                    )
                })
                .collect();
            return Err(format!(
                "replicas not in mode {want} with all groups up after {PROTECT_TIMEOUT:?}: {}; \
                 controller: {}",
                st.join("; "),
                ctl_log()
            ));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let server = PliantSut(&sys_, false).server_ip();
    let ns = sys_.lab().netns(pliant_lab::Role::Server);
    let srv = TxServer::start(Some(&ns), SocketAddrV4::new(server, TX_PORT), PROBE_PORT)
        .map_err(|e| format!("txload server: {e}"))?;
    sys_.srv = Some(srv);
    let cl = sys_.lab().netns(pliant_lab::Role::Client);
    wait_reachable(&cl, SocketAddrV4::new(server, TX_PORT))?;
    Ok(sys_)
}

/// The controller answers `status` and lists every lab replica alive.
fn controller_sees_all(bin: &Path, dir: &Path) -> bool {
    let out = Command::new(bin)
        .arg("status")
        .arg("--api")
        .arg(dir.join("api.sock"))
        .arg("--token-file")
        .arg(dir.join("token"))
        .arg("--json")
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output();
    let Ok(out) = out else { return false };
    let Ok(v) = serde_json::from_slice::<Value>(&out.stdout) else {
        return false;
    };
    let alive = v["replicas"]
        .as_array()
        .map(|a| a.iter().filter(|r| r["alive"] == true).count())
        .unwrap_or(0);
    out.status.success() && alive == usize::from(REPLICAS)
}

/// One TCP connection from the client namespace must get through before measuring (the first
/// packets after start-up can meet steering that is still being installed).
fn wait_reachable(client_ns: &str, server: SocketAddrV4) -> Result<(), String> {
    let ns = client_ns.to_string();
    let h = std::thread::spawn(move || -> Result<(), String> {
        txload::enter_netns(&ns).map_err(|e| e.to_string())?;
        let t = Instant::now();
        loop {
            let a = std::net::SocketAddr::V4(server);
            match std::net::TcpStream::connect_timeout(&a, Duration::from_millis(500)) {
                Ok(_) => return Ok(()),
                Err(e) if t.elapsed() > REACH_TIMEOUT => {
                    return Err(format!("{server} unreachable from the client: {e}"))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    });
    h.join()
        .map_err(|_| "reachability thread panicked".to_string())?
}

fn measure_pliant(
    opts: &HaOpts,
    sys: &str,
    do_failover: bool,
) -> (HaSystemReport, Vec<FailoverReport>) {
    let mut r = HaSystemReport {
        mode: mode_label(sys).into(),
        ..Default::default()
    };
    let mut trials = Vec::new();
    let ftmb = sys == "ftmb";
    let p = match pliant_up(opts, sys) {
        Ok(p) => p,
        Err(e) => {
            progress(&format!("  {sys}: {e}"));
            if ftmb && opts.failover {
                r.failover = Some(FailoverReport {
                    system: sys.into(),
                    error: Some("system did not come up".into()),
                    ..Default::default()
                });
            }
            r.error = Some(e);
            if do_failover {
                trials.push(FailoverReport {
                    system: sys.into(),
                    error: Some("system did not come up".into()),
                    ..Default::default()
                });
            }
            return (r, trials);
        }
    };
    if let Err(e) = measure_txload(opts, &PliantSut(&p, ftmb), &mut r) {
        progress(&format!("  txload failed: {e}"));
        r.errors.insert("txload".into(), e.to_string());
    }
    if ftmb {
        r.ftmb_detail = Some(ftmb_detail(&p));
    } else {
        r.output_audit = Some(output_audit(&p));
    }
    if !cmd::interrupted() {
        let sut = PliantSut(&p, ftmb);
        match measure_iperf(&sut.client_ns(), sut.server_ip(), opts.duration_s) {
            Ok((g, rt)) => {
                r.gbps = Some(g);
                r.tcp_retransmits = Some(rt);
            }
            Err(e) => {
                r.errors.insert("iperf3".into(), e.to_string());
            }
        }
    }
    if (do_failover || (ftmb && opts.failover)) && !cmd::interrupted() {
        let f = kill_r1(opts, &p, sys);
        if ftmb {
            r.failover = Some(f.clone());
        }
        if do_failover {
            trials.push(f);
        }
    }
    drop(p);
    // Further trials, each in a fresh lab (the first one's lab lost r1).
    for n in 2..=opts.trials {
        if !do_failover || cmd::interrupted() {
            break;
        }
        progress(&format!("  failover trial {n}/{}", opts.trials));
        match pliant_up(opts, sys) {
            Ok(p) => trials.push(kill_r1(opts, &p, sys)),
            Err(e) => trials.push(FailoverReport {
                system: sys.into(),
                error: Some(format!("trial {n}: {e}")),
                ..Default::default()
            }),
        }
    }
    (r, trials)
}

/// One failover experiment on a pliant system: replica r1 SIGKILLed under txload, with
/// sequence-numbered UDP flows on every replica ([`FailoverUdp`]).
fn kill_r1(opts: &HaOpts, p: &PliantSys, sys: &str) -> FailoverReport {
    let victim = p
        .replica_pids()
        .into_iter()
        .find(|pid| pliant_lab::state::proc_cmdline(*pid).is_some_and(|c| c.contains("r1.toml")));
    let udp = start_failover_udp(p);
    if let Err(e) = &udp {
        progress(&format!("  failover UDP flows: {e}"));
    }
    let located = Instant::now();
    let mut pre_gaps: Vec<u64> = Vec::new();
    // The kill instant and the pre-kill window's length, to the thread that takes the
    // post-kill gaps over a window as long (a longer one would see more of the machine's
    // scheduling noise and compare unfairly).
    let (kill_tx, kill_rx) = std::sync::mpsc::channel::<(Instant, Duration)>();
    // The closure owns the sender: dropping it (no kill happened) ends the window thread.
    let (udp_flows, pre) = (&udp, &mut pre_gaps);
    let mut fail = move |m: &Marker| match victim {
        Some(pid) => {
            if let Ok((flows, _)) = udp_flows {
                *pre = (0..flows.flows().len())
                    .map(|i| flows.take_max_gap_us(i))
                    .collect();
            }
            let _ = kill_tx.send((Instant::now(), located.elapsed()));
            if opts.hosts {
                // The whole host, as the kernel peer loses its master router: the mark when
                // its links are cut.
                return pliant_lab::agents::kill_host(p.lab(), 1, &mut || {
                    m.set();
                })
                .map_err(|e| BenchError::Tool {
                    tool: "kill",
                    reason: format!("host h1: {e}"),
                });
            }
            m.set();
            // SAFETY: SIGKILL to replica r1, a process of our lab (cmdline checked above).
            let rc = unsafe { libc::kill(pid, libc::SIGKILL) };
            if rc != 0 {
                return Err(BenchError::Tool {
                    tool: "kill",
                    reason: format!("r1 (pid {pid}): {}", std::io::Error::last_os_error()),
                });
            }
            Ok(format!("replica r1 (pid {pid}) SIGKILLed"))
        }
        None => Err(BenchError::Tool {
            tool: "kill",
            reason: "replica r1's process not found".into(),
        }),
    };
    let t_kill = unix_ms();
    let (mut f, window) = std::thread::scope(|s| {
        let udp = &udp;
        let window = s.spawn(move || {
            let (at, len) = kill_rx.recv().ok()?;
            std::thread::sleep((at + len).saturating_duration_since(Instant::now()));
            let flows = &udp.as_ref().ok()?.0;
            Some(PostKillWindow {
                at,
                ms: len.as_secs_f64() * 1e3,
                gaps: (0..flows.flows().len())
                    .map(|i| flows.take_max_gap_us(i))
                    .collect(),
            })
        });
        let f = run_failover(opts, &PliantSut(p, sys == "ftmb"), sys, &mut fail);
        // No kill (no victim found): the window thread must not wait for one.
        drop(fail);
        (f, window.join().ok().flatten())
    });
    f.victim_kind = if opts.hosts { "host" } else { "process" }.into();
    f.controller_record = controller_failover(opts, p, 1, t_kill);
    f.udp = Some(match udp {
        Ok((flows, on_r1)) => finish_failover_udp(flows, &on_r1, &pre_gaps, window, f.recovery_ms),
        Err(e) => FailoverUdp {
            error: Some(e),
            ..Default::default()
        },
    });
    if let Some(u) = &f.udp {
        let o = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.1}"));
        progress(&format!(
            "  failover UDP: other replicas' stall {} ms during the failover ({} ms), largest gap \
             {} ms in the {} ms after the kill vs {} ms before it; {} reordered, {} lost off the \
             victim",
            o(u.other_replica_stall_ms),
            o(u.failover_interval_ms),
            o(u.other_replica_max_gap_ms),
            o(u.window_ms),
            o(u.pre_kill_gap_ms),
            u.reordered,
            u.lost_other_replicas
        ));
    }
    f
}

/// Starts the failover trial's UDP flows (spread over r1..r3 by the controller's ring), waits
/// until each reaches the server, and locates each in the replicas' `flows` listings: `Some(true)`
/// on r1 (the victim), `Some(false)` elsewhere, `None` listed nowhere. The flows' gaps so far
/// (start-up) are discarded.
fn start_failover_udp(
    p: &PliantSys,
) -> Result<(crate::flowgen::UdpFlows, Vec<Option<bool>>), String> {
    use crate::flowgen::{Ring, UdpFlows, UdpSpec};
    let members: Vec<u32> = (1..=u32::from(REPLICAS)).collect();
    let ring = Ring::of(&members).map_err(|e| e.to_string())?;
    let udp = pliant_state::key::proto::UDP;
    let base = ring
        .spread_block(
            &members,
            udp,
            FAILOVER_UDP_PORT,
            FAILOVER_UDP_PER_REPLICA,
            20_000,
            30_000,
        )
        .ok_or("no source port block spreads evenly over the ring")?;
    let n = FAILOVER_UDP_PER_REPLICA * members.len();
    crate::migrate::resolve_gateways(p.lab()).map_err(|e| e.to_string())?;
    let (c, s): (Ipv4Addr, Ipv4Addr) = (
        pliant_lab::CLIENT_IP.parse().map_err(|e| format!("{e}"))?,
        pliant_lab::SERVER_IP.parse().map_err(|e| format!("{e}"))?,
    );
    let flows = UdpFlows::start(&UdpSpec {
        client_ns: p.lab().netns(pliant_lab::Role::Client),
        server_ns: p.lab().netns(pliant_lab::Role::Server),
        client_ip: c,
        server_ip: s,
        sport_base: base,
        dport: FAILOVER_UDP_PORT,
        flows: n,
        pps_per_flow: FAILOVER_UDP_PPS,
        payload: 64,
    })
    .map_err(|e| e.to_string())?;
    let t = Instant::now();
    while !(0..n).all(|i| flows.seen_sport(i).is_some()) {
        if t.elapsed() > REACH_TIMEOUT {
            return Err("the UDP flows never all reached the server".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let keys: Vec<String> = (0..n as u16)
        .map(|i| {
            pliant_state::FlowKey::v4(udp, c, base + i, s, FAILOVER_UDP_PORT)
                .0
                .to_string()
        })
        .collect();
    // FTMB replicas list their flows as of the last snapshot (50 ms): retry briefly.
    let mut on_r1 = vec![None; n];
    let t = Instant::now();
    while on_r1.iter().any(Option::is_none) && t.elapsed() < Duration::from_secs(2) {
        for (r, sock) in p.sockets() {
            let Ok(v) = replica_request(&sock, &Request::Flows) else {
                continue;
            };
            let listed: Vec<&str> = v["flows"]
                .as_array()
                .map(Vec::as_slice)
                .unwrap_or(&[])
                .iter()
                .filter_map(|f| f["key"].as_str())
                .collect();
            for (i, k) in keys.iter().enumerate() {
                if listed.contains(&k.as_str()) {
                    // On r1 if any listing there has it (a copy elsewhere does not clear it).
                    on_r1[i] = Some(on_r1[i].unwrap_or(false) || r == 1);
                }
            }
        }
        if on_r1.iter().any(Option::is_none) {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    for i in 0..n {
        flows.take_max_gap_us(i);
    }
    Ok((flows, on_r1))
}

/// The flows' largest gaps (µs) from the kill (`at`) over a window as long as the pre-kill
/// one (`ms`).
struct PostKillWindow {
    at: Instant,
    ms: f64,
    gaps: Vec<u64>,
}

/// Stops the trial's UDP flows and sums them up per group (see [`FailoverUdp`]).
fn finish_failover_udp(
    mut flows: crate::flowgen::UdpFlows,
    on_r1: &[Option<bool>],
    pre_gaps: &[u64],
    window: Option<PostKillWindow>,
    recovery_ms: Option<f64>,
) -> FailoverUdp {
    let n = on_r1.len();
    let rest: Vec<u64> = (0..n).map(|i| flows.take_max_gap_us(i)).collect();
    let in_window = |i: usize| window.as_ref().and_then(|w| w.gaps.get(i).copied());
    // The failed replica's flows: their stall over the whole rest of the run.
    let post = |i: usize| in_window(i).unwrap_or(0).max(rest[i]);
    // The failover, as the flows saw it: from the kill until the failed replica's flows (and
    // the probes) flowed again.
    let interval_us = on_r1
        .iter()
        .enumerate()
        .filter(|(_, l)| **l == Some(true))
        .map(|(i, _)| post(i))
        .chain(recovery_ms.map(|r| (r * 1e3) as u64))
        .max()
        .unwrap_or(0);
    // The other replicas' flows: their largest gap overlapping that interval (taken before
    // the flows stop).
    let during: Vec<Option<u64>> = (0..n)
        .map(|i| {
            let w = window.as_ref()?;
            let to = w.at + Duration::from_micros(interval_us);
            Some(flows.max_gap_overlapping_us(i, w.at, to))
        })
        .collect();
    let errors = flows.halt(Duration::from_millis(300));
    let ms = |us: u64| us as f64 / 1e3;
    let mut u = FailoverUdp {
        flows: n,
        error: (!errors.is_empty()).then(|| errors.join("; ")),
        ..Default::default()
    };
    u.window_ms = window.as_ref().map(|w| w.ms);
    u.failover_interval_ms = window.as_ref().map(|_| ms(interval_us));
    let max_of = |cur: Option<f64>, v: f64| Some(cur.map_or(v, |c: f64| c.max(v)));
    for (i, loc) in on_r1.iter().enumerate() {
        let t = flows.totals(i..i + 1);
        u.sent += t.sent;
        u.received += t.received;
        u.reordered += t.reordered;
        u.duplicated += t.duplicated;
        match loc {
            Some(true) => {
                u.on_failed_replica += 1;
                u.lost_failed_replica += t.lost;
                u.failed_replica_stall_ms = max_of(u.failed_replica_stall_ms, ms(post(i)));
            }
            Some(false) => {
                u.on_other_replicas += 1;
                u.lost_other_replicas += t.lost;
                let g = during[i].unwrap_or(post(i));
                u.other_replica_stall_ms = max_of(u.other_replica_stall_ms, ms(g));
                let w = in_window(i).unwrap_or(post(i));
                u.other_replica_max_gap_ms = max_of(u.other_replica_max_gap_ms, ms(w));
                if let Some(g) = pre_gaps.get(i) {
                    u.pre_kill_gap_ms = max_of(u.pre_kill_gap_ms, ms(*g));
                }
            }
            None => u.not_located += 1,
        }
    }
    u
}

fn unix_ms() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64() * 1e3)
        .unwrap_or(0.0)
}

/// The controller's failover record of replica `n` detected after `since_unix_ms`.
fn controller_failover(opts: &HaOpts, p: &PliantSys, n: u32, since_unix_ms: f64) -> Option<Value> {
    let bin = opts.pliant_bin.as_ref()?;
    let out = Command::new(bin)
        .args(["ha", "status", "--json", "--api"])
        .arg(p.dir.join("api.sock"))
        .arg("--token-file")
        .arg(p.dir.join("token"))
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()?;
    let v: Value = serde_json::from_slice(&out.stdout).ok()?;
    v["failovers"]
        .as_array()?
        .iter()
        .find(|f| {
            f["replica"] == n && f["detected_unix_ms"].as_f64().unwrap_or(0.0) >= since_unix_ms
        })
        .cloned()
}

/// The pico/remus replicas' output-commit audit, summed over the replicas.
fn output_audit(p: &PliantSys) -> Value {
    let names = ["audit_checked", "audit_violations", "audit_exempt"];
    let mut sums = [0u64; 3];
    let mut errors = serde_json::Map::new();
    for (n, s) in p.sockets() {
        match replica_request(&s, &Request::HaStatus) {
            Ok(v) => {
                for (sum, name) in sums.iter_mut().zip(names) {
                    // A missing counter is an error, never a 0.
                    match v["output"][name].as_u64() {
                        Some(x) => *sum += x,
                        None => {
                            errors.insert(format!("r{n}.{name}"), serde_json::json!("missing"));
                        }
                    }
                }
            }
            Err(e) => {
                errors.insert(format!("r{n}"), serde_json::json!(e.to_string()));
            }
        }
    }
    serde_json::json!({"audit_checked": sums[0], "audit_violations": sums[1],
        "audit_exempt": sums[2], "errors": errors})
}

/// The ftmb replicas' own numbers (snapshot pauses, audit of the loggers they host).
fn ftmb_detail(p: &PliantSys) -> Value {
    let mut per = serde_json::Map::new();
    let (mut checked, mut violations) = (0u64, 0u64);
    for (n, s) in p.sockets() {
        match replica_request(&s, &Request::FtmbStatus) {
            Ok(v) => {
                // Each output checked against the stored PALs as its logger handed it out.
                let (c, bad) = pliant_runtime::ftmb::audit_totals(&v);
                checked += c;
                violations += bad;
                per.insert(
                    format!("r{n}"),
                    serde_json::json!({
                        "snapshots": v["snapshots"],
                        "snapshot_pause_us_p50": v["snapshot_pause_us_p50"],
                        "snapshot_pause_us_p99": v["snapshot_pause_us_p99"],
                        "last_snapshot_acked": v["last_snapshot_acked"],
                        "snapshot_failures": v["snapshot_failures"],
                        "hosted_logger_bytes_in": ftmb_logged_bytes(&v),
                        "held": v["dispatch"]["held"],
                        "hold_full": v["dispatch"]["hold_full"],
                    }),
                );
            }
            Err(e) => {
                per.insert(format!("r{n}"), serde_json::json!({"error": e.to_string()}));
            }
        }
    }
    serde_json::json!({"replicas": per, "audit_checked": checked,
        "audit_violations": violations})
}

/// Sums every number under a key named `name` anywhere in `v` (the loggers' status nests
/// per-master, per-queue objects).
pub fn sum_named(v: &Value, name: &str) -> u64 {
    match v {
        Value::Object(m) => m
            .iter()
            .map(|(k, x)| {
                if k == name {
                    x.as_u64().unwrap_or(0)
                } else {
                    sum_named(x, name)
                }
            })
            .fold(0, u64::saturating_add),
        Value::Array(a) => a
            .iter()
            .map(|x| sum_named(x, name))
            .fold(0, u64::saturating_add),
        _ => 0,
    }
}

/// All failover trials of a run.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct TrialsSummary {
    pub trials: usize,
    /// Trials that ran to the end (failure injected, txload finished).
    pub trials_completed: usize,
    pub flows_survived: u32,
    pub flows_total: u32,
    pub resets: u64,
    pub recovery_ms_p50: Option<f64>,
    pub recovery_ms_max: Option<f64>,
    /// Completed trials in which some probe flow never came back.
    pub trials_unrecovered: usize,
    pub tcp_stall_ms_p50: Option<f64>,
    pub tcp_stall_ms_max: Option<f64>,
    /// Completed trials whose UDP flows ran ([`FailoverUdp`]).
    pub udp_trials: usize,
    /// UDP datagrams reordered, over every flow of every trial.
    pub reordered: u64,
    /// UDP datagrams lost on flows of the replicas that did not fail (0 expected) / of the
    /// failed replica.
    pub udp_lost_other_replicas: u64,
    pub udp_lost_failed_replica: u64,
    /// The longest gap on flows of replicas that did not fail during the failover, over the
    /// trials; beside it the same flows' longest gap before the kill (goal: the first <= the
    /// second), and their longest gap in a window after the kill as long as the pre-kill one,
    /// failover or not ([`FailoverUdp::other_replica_max_gap_ms`]).
    pub other_replica_stall_ms_max: Option<f64>,
    pub pre_kill_gap_ms_max: Option<f64>,
    pub other_replica_max_gap_ms_max: Option<f64>,
    /// Trials in which the other replicas' stall during the failover exceeded their own
    /// pre-kill gap.
    pub trials_other_stall_over_pre_kill_gap: usize,
    /// The longest gap on the failed replica's flows after the kill, over the trials.
    pub failed_replica_stall_ms_max: Option<f64>,
    /// First errors (at most 5).
    pub errors: Vec<String>,
}

impl TrialsSummary {
    pub fn of(trials: &[FailoverReport]) -> Self {
        let done: Vec<&FailoverReport> = trials.iter().filter(|t| t.error.is_none()).collect();
        let rec: Vec<f64> = done.iter().filter_map(|t| t.recovery_ms).collect();
        let stall: Vec<f64> = done.iter().filter_map(|t| t.tcp_stall_ms).collect();
        let max = |v: &[f64]| v.iter().copied().reduce(f64::max);
        let udp: Vec<&FailoverUdp> = done
            .iter()
            .filter_map(|t| t.udp.as_ref())
            .filter(|u| u.error.is_none())
            .collect();
        let of = |f: fn(&FailoverUdp) -> Option<f64>| -> Vec<f64> {
            udp.iter().filter_map(|u| f(u)).collect()
        };
        TrialsSummary {
            trials: trials.len(),
            trials_completed: done.len(),
            flows_survived: done.iter().filter_map(|t| t.flows_survived).sum(),
            flows_total: done.iter().filter_map(|t| t.flows_total).sum(),
            resets: done.iter().filter_map(|t| t.resets).sum(),
            recovery_ms_p50: crate::parse::percentile(&rec, 50.0),
            recovery_ms_max: max(&rec),
            trials_unrecovered: done.iter().filter(|t| t.recovery_ms.is_none()).count(),
            tcp_stall_ms_p50: crate::parse::percentile(&stall, 50.0),
            tcp_stall_ms_max: max(&stall),
            udp_trials: udp.len(),
            reordered: udp.iter().map(|u| u.reordered).sum(),
            udp_lost_other_replicas: udp.iter().map(|u| u.lost_other_replicas).sum(),
            udp_lost_failed_replica: udp.iter().map(|u| u.lost_failed_replica).sum(),
            other_replica_stall_ms_max: max(&of(|u| u.other_replica_stall_ms)),
            pre_kill_gap_ms_max: max(&of(|u| u.pre_kill_gap_ms)),
            other_replica_max_gap_ms_max: max(&of(|u| u.other_replica_max_gap_ms)),
            trials_other_stall_over_pre_kill_gap: udp
                .iter()
                .filter(|u| match (u.other_replica_stall_ms, u.pre_kill_gap_ms) {
                    (Some(s), Some(g)) => s > g,
                    _ => false,
                })
                .count(),
            failed_replica_stall_ms_max: max(&of(|u| u.failed_replica_stall_ms)),
            errors: trials
                .iter()
                .filter_map(|t| t.error.clone())
                .take(5)
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_ticks_skip_a_command_name_with_spaces() {
        let s = "1234 (my (odd) prog) S 1 2 3 4 5 6 7 8 9 10 110 25 0 0 20 0 1 0";
        assert_eq!(parse_stat_ticks(s), Some(135));
        assert_eq!(parse_stat_ticks("garbage"), None);
    }

    #[test]
    fn proc_stat_busy_excludes_idle_and_iowait() {
        let t = "cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 1 2 3\n";
        assert_eq!(parse_proc_stat(t), Some((150, 1000)));
        assert_eq!(parse_proc_stat("intr 1 2"), None);
    }

    #[test]
    fn shipped_bytes_sums_groups_and_protection_needs_every_group_up() {
        let v: Value = serde_json::json!({"ok":true,"mode":"pico","groups":[
            {"id":1,"state":"up","bytes_shipped":100},{"id":2,"state":"up","bytes_shipped":23}]});
        assert_eq!(shipped_bytes(&v), 123);
        assert!(protected_as(&v, "pico"));
        assert!(!protected_as(&v, "remus"));
        let v2: Value = serde_json::json!({"ok":true,"mode":"pico","groups":[
            {"id":1,"state":"connecting"}]});
        assert!(!protected_as(&v2, "pico"));
        let off: Value = serde_json::json!({"ok":true,"mode":"off","groups":[]});
        assert!(protected_as(&off, "off"));
        assert!(!protected_as(
            &serde_json::json!({"ok":true,"mode":"pico","groups":[]}),
            "pico"
        ));
        assert_eq!(shipped_bytes(&off), 0);
    }

    #[test]
    fn controller_ha_sections_match_the_systems() {
        assert!(controller_ha_section("pico_10k").is_some_and(|s| s.contains("hz = 10000")));
        assert!(controller_ha_section("remus_40").is_some_and(|s| s.contains("remus_hz = 40")));
        assert!(controller_ha_section("no_ha").is_some_and(|s| s.contains("\"off\"")));
        assert!(controller_ha_section("ftmb").is_some_and(|s| s.contains("mode = \"ftmb\"")));
        assert_eq!(expected_mode("ftmb"), "ftmb");
        assert_eq!(controller_ha_section("kernel_conntrackd"), None);
    }

    #[test]
    fn report_has_the_contract_fields_and_ratios_only_from_measured_numbers() {
        let base = HaSystemReport {
            transactions_per_s: Some(1000.0),
            latency_us_p50: Some(100.0),
            latency_us_p99: Some(400.0),
            gbps: Some(10.0),
            ..Default::default()
        };
        let pico = HaSystemReport {
            transactions_per_s: Some(900.0),
            latency_us_p50: Some(130.0),
            latency_us_p99: Some(1000.0),
            ..Default::default()
        };
        let r = HaReport::new(
            &HaOpts::default(),
            [
                base,
                pico,
                Default::default(),
                Default::default(),
                HaSystemReport {
                    transactions_per_s: Some(980.0),
                    latency_us_p50: Some(110.0),
                    failover: Some(FailoverReport {
                        recovery_ms: Some(42.0),
                        tcp_stall_ms: Some(90.0),
                        flows_survived: Some(8),
                        flows_total: Some(8),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
                Default::default(),
            ],
            &[],
            1.0,
        );
        let v = serde_json::to_value(&r).expect("json");
        for s in SYSTEMS {
            for k in [
                "transactions_per_s",
                "latency_us_p50",
                "latency_us_p95",
                "latency_us_p99",
                "gbps",
                "cpu_pct",
                "repl_bytes_per_s",
            ] {
                assert!(v[s].get(k).is_some(), "{s}.{k} missing");
            }
        }
        for k in [
            "recovery_ms",
            "tcp_stall_ms",
            "flows_survived",
            "flows_total",
        ] {
            assert!(v["failover"].get(k).is_some(), "failover.{k} missing");
        }
        // The ftmb section and its failover numbers beside the top-level ones.
        assert_eq!(v["failover"]["ftmb_recovery_ms"], 42.0);
        assert_eq!(v["failover"]["ftmb_tcp_stall_ms"], 90.0);
        assert_eq!(v["failover"]["ftmb_flows_survived"], 8);
        assert!(v["failover"]["ftmb_error"].is_null());
        assert_eq!(v["ftmb"]["failover"]["recovery_ms"], 42.0);
        assert!(v["ftmb"].get("ftmb_detail").is_none(), "only when measured");
        assert_eq!(r.vs_no_ha["ftmb"].transactions_per_s_ratio, Some(0.98));
        assert_eq!(r.vs_no_ha["ftmb"].latency_us_p50_added, Some(10.0));
        // Not run: the reason instead of numbers.
        let none = HaReport::new(&HaOpts::default(), Default::default(), &[], 1.0);
        let v = serde_json::to_value(&none).expect("json");
        assert!(v["failover"]["ftmb_recovery_ms"].is_null());
        assert!(v["failover"]["ftmb_error"].is_string());
        let p = &r.vs_no_ha["pico_1k"];
        assert_eq!(p.transactions_per_s_ratio, Some(0.9));
        assert_eq!(p.latency_us_p50_added, Some(30.0));
        assert_eq!(p.latency_us_p99_added, Some(600.0));
        assert_eq!(p.gbps_ratio, None, "pico gbps was not measured");
        assert_eq!(r.vs_no_ha["remus_40"].transactions_per_s_ratio, None);
    }

    #[test]
    fn ftmb_status_shows_protection_and_shipped_bytes() {
        let v: Value = serde_json::json!({"ok": true, "mode": "ftmb", "logger": "/x/r2.ftmb.sock",
            "protected": true,
            "hosting": {"masters": {"r3": {"logger": {"outputs_released": 4, "audit_violations": 1}}},
                        "server": {"bytes_in": 125, "bytes_out": 7}}});
        assert!(ftmb_protected(&v));
        assert_eq!(ftmb_logged_bytes(&v), 125);
        assert_eq!(ftmb_logged_bytes(&serde_json::json!({"hosting": null})), 0);
        assert_eq!(sum_named(&v["hosting"], "outputs_released"), 4);
        assert_eq!(sum_named(&v["hosting"], "audit_violations"), 1);
        let mut u = v.clone();
        u["protected"] = Value::Bool(false);
        assert!(!ftmb_protected(&u));
        u["protected"] = Value::Bool(true);
        u["logger"] = Value::Null;
        assert!(!ftmb_protected(&u), "no logger");
        assert!(!ftmb_protected(
            &serde_json::json!({"mode": "pico", "protected": true})
        ));
    }

    #[test]
    fn a_system_reports_its_median_round_and_keeps_the_first_rounds_failover() {
        let r = |tps: Option<f64>| HaSystemReport {
            transactions_per_s: tps,
            ..Default::default()
        };
        let tps = |v: &HaSystemReport| v.transactions_per_s;
        assert_eq!(
            tps(&median_of(&[
                r(Some(3.0)),
                r(None),
                r(Some(1.0)),
                r(Some(2.0))
            ])),
            Some(2.0)
        );
        assert_eq!(
            tps(&median_of(&[
                r(Some(4.0)),
                r(Some(1.0)),
                r(Some(3.0)),
                r(Some(2.0))
            ])),
            Some(2.0)
        );
        assert_eq!(tps(&median_of(&[r(None), r(None)])), None);
        assert_eq!(tps(&median_of(&[])), None);
        let mut first: [HaSystemReport; 6] = Default::default();
        first[1] = r(Some(9.0));
        first[1].failover = Some(FailoverReport {
            recovery_ms: Some(12.0),
            ..Default::default()
        });
        let mut second: [HaSystemReport; 6] = Default::default();
        second[1] = r(Some(5.0));
        let mut third: [HaSystemReport; 6] = Default::default();
        third[1] = r(Some(7.0));
        let m = median_rounds(&[first, second, third]);
        assert_eq!(m[1].transactions_per_s, Some(7.0));
        assert_eq!(
            m[1].failover.as_ref().and_then(|f| f.recovery_ms),
            Some(12.0)
        );
    }

    #[test]
    fn per_round_ratios_pair_systems_within_a_round_in_round_order() {
        let round = |no_ha: Option<f64>, pico: Option<f64>| {
            let mut o: [HaSystemReport; 6] = Default::default();
            o[0].transactions_per_s = no_ha;
            o[1].transactions_per_s = pico;
            o
        };
        let rounds = [
            round(Some(100.0), Some(90.0)),
            round(Some(50.0), Some(50.0)),
            round(None, Some(80.0)),
            round(Some(80.0), None),
            round(Some(200.0), Some(210.0)),
        ];
        // Not 90/50 or 210/100: each pair comes from one round; rounds missing either side
        // are left out.
        assert_eq!(round_ratios(&rounds, 1), vec![0.9, 1.0, 1.05]);
        assert!(round_ratios(&rounds, 2).is_empty());
    }

    #[test]
    fn trials_summary_sums_completed_trials_only() {
        let t = |rec: Option<f64>, surv: u32, err: Option<&str>| FailoverReport {
            recovery_ms: rec,
            tcp_stall_ms: rec.map(|r| r * 2.0),
            flows_survived: Some(surv),
            flows_total: Some(4),
            resets: Some(u64::from(4 - surv)),
            error: err.map(str::to_string),
            ..Default::default()
        };
        let s = TrialsSummary::of(&[
            t(Some(10.0), 4, None),
            t(Some(30.0), 3, None),
            t(None, 4, None),
            t(Some(1.0), 0, Some("lab up failed")),
        ]);
        assert_eq!((s.trials, s.trials_completed), (4, 3));
        assert_eq!((s.flows_survived, s.flows_total, s.resets), (11, 12, 1));
        assert_eq!(s.recovery_ms_p50, Some(10.0));
        assert_eq!(s.recovery_ms_max, Some(30.0));
        assert_eq!(s.tcp_stall_ms_max, Some(60.0));
        assert_eq!(s.trials_unrecovered, 1);
        assert_eq!(s.errors, vec!["lab up failed".to_string()]);
        let none = TrialsSummary::of(&[]);
        assert_eq!((none.trials, none.recovery_ms_p50), (0, None));
        assert_eq!(
            (none.udp_trials, none.other_replica_stall_ms_max),
            (0, None)
        );
    }

    #[test]
    fn trials_summary_sums_the_udp_flows_and_compares_stalls_with_pre_kill_gaps() {
        let t = |stall: f64, pre: f64, reordered: u64, err: Option<&str>| FailoverReport {
            udp: Some(FailoverUdp {
                reordered,
                lost_other_replicas: 1,
                lost_failed_replica: 7,
                other_replica_stall_ms: Some(stall),
                pre_kill_gap_ms: Some(pre),
                failed_replica_stall_ms: Some(stall * 10.0),
                error: err.map(str::to_string),
                ..Default::default()
            }),
            ..Default::default()
        };
        let mut no_udp = t(1.0, 1.0, 0, None);
        no_udp.udp = None;
        let s = TrialsSummary::of(&[
            t(3.0, 4.0, 0, None),
            t(9.0, 5.0, 2, None),
            t(99.0, 1.0, 50, Some("generator failed")),
            no_udp,
        ]);
        assert_eq!(s.udp_trials, 2);
        assert_eq!(s.reordered, 2);
        assert_eq!(
            (s.udp_lost_other_replicas, s.udp_lost_failed_replica),
            (2, 14)
        );
        assert_eq!(s.other_replica_stall_ms_max, Some(9.0));
        assert_eq!(s.pre_kill_gap_ms_max, Some(5.0));
        assert_eq!(s.trials_other_stall_over_pre_kill_gap, 1);
        assert_eq!(s.failed_replica_stall_ms_max, Some(90.0));
    }

    #[test]
    fn source_ports_are_drawn_within_their_span_with_room_for_every_connection() {
        let mut seen = std::collections::BTreeSet::new();
        for conns in [1u32, 32, 4096] {
            let o = HaOpts {
                connections: conns,
                ..HaOpts::default()
            };
            for _ in 0..200 {
                let b = random_sport_base(&o);
                assert!(TX_SPORT_SPAN.contains(&b), "{b}");
                assert!(
                    u32::from(b) + conns <= u32::from(TX_SPORT_SPAN.end),
                    "{b} + {conns}"
                );
                seen.insert(b);
            }
        }
        // Drawn, not fixed.
        assert!(seen.len() > 100, "{}", seen.len());
    }

    #[test]
    fn failover_fill_counts_survivors_and_recovery() {
        use crate::txload::{ConnStats, ProbeStats};
        let ok = ConnStats {
            transactions: 10,
            first_done_after_mark_ms: Some(40.0),
            max_stall_ms: 35.0,
            ..Default::default()
        };
        let reset = ConnStats {
            transactions: 3,
            resets: 1,
            error: Some("receive: reset".into()),
            ..Default::default()
        };
        let rep = TxReport {
            connections: 2,
            resets: 1,
            tcp_stall_ms: 35.0,
            per_conn: vec![ok, reset],
            probes: vec![ProbeStats {
                recovery_ms: Some(12.0),
                ..Default::default()
            }],
            ..Default::default()
        };
        let mut f = FailoverReport::default();
        fill_failover(&mut f, &rep);
        assert_eq!(f.flows_survived, Some(1));
        assert_eq!(f.flows_total, Some(2));
        assert_eq!(f.recovery_ms, Some(12.0));
        assert_eq!(f.first_txn_after_failure_ms, Some(40.0));
        assert_eq!(
            f.all_flows_txn_after_failure_ms, None,
            "one flow never came back"
        );
        assert_eq!(f.conn_errors, vec!["receive: reset".to_string()]);
    }
}
