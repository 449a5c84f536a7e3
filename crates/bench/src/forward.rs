//! `bench forward`: kernel forwarding, kernel nftables NAT and pliant NAT on the same lab
//! topology, one after another in one run, each measured the same way.
//!
//! What is measured (see the crate README for the reasoning):
//! - TCP throughput: `iperf3 -c` from the client, 1 and 4 streams, receiver-side bits/s.
//! - 64-byte UDP packets/s: `trafgen` (one CPU) on the client sends 60-byte frames (64 on the
//!   wire with FCS) over `flows` source ports; the count is an nftables netdev *ingress* counter
//!   on the server's interface (frames that reached the server's stack, then dropped there so
//!   the server sends nothing back), read before and after a window that starts after warm-up.
//! - RTT: `ping -i 0.002 -c N` (ICMP echo through the replica), per-reply times.

use crate::flood::{measure_flood, FloodOpts, FloodReport};
use crate::parse::{parse_iperf3_gbps, parse_nft_counter_packets, parse_ping_rtts_us, percentile};
use crate::BenchError;
use pliant_lab::topology::{CLIENT_IF, CLIENT_MAC, IN_PORT_MAC, SERVER_IF};
use pliant_lab::{Lab, LabSpec, PliantNf, ReplicaMode, Role, CLIENT_IP, SERVER_IP};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// UDP port the 64-byte frames are sent to (discard); the server drops them at ingress.
pub const PPS_DPORT: u16 = 9;
/// First source port of the 64-byte flows.
pub const PPS_SPORT_BASE: u16 = 10000;
pub const RTT_SAMPLES: u32 = 500;
/// Warm-up before a pps window opens (ARP, conntrack/NAT mappings for every flow).
const PPS_WARMUP: Duration = Duration::from_secs(1);

#[derive(Clone, Debug)]
pub struct ForwardOpts {
    /// Seconds per iperf3 run and per packet-rate window.
    pub duration_s: u32,
    /// Distinct UDP source ports (flows) in the 64-byte test, 1..=50000.
    pub flows: u16,
    /// The `pliant` binary for the pliant system; `None` reports an error for it.
    pub pliant_bin: Option<PathBuf>,
    /// Systems to run (`kernel_forward`, `kernel_nat`, `pliant_nat`); empty = all.
    pub only: Vec<String>,
    /// Turn off checksum/segmentation offloads in the labs (same for every system).
    pub disable_offloads: bool,
}

impl Default for ForwardOpts {
    fn default() -> Self {
        ForwardOpts {
            duration_s: 5,
            flows: 1024,
            pliant_bin: None,
            only: Vec::new(),
            disable_offloads: false,
        }
    }
}

/// Results for one system. `null` fields were not measured (see `error` / `errors`).
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct SystemReport {
    pub mode: String,
    /// Set when the system could not be brought up at all; then nothing else was measured.
    pub error: Option<String>,
    pub gbps_1stream: Option<f64>,
    pub gbps_4streams: Option<f64>,
    pub tcp_retransmits_1stream: Option<u64>,
    /// 64-byte UDP frames per second received at the server (nft ingress counter).
    pub pps_64b: Option<f64>,
    /// Frames per second the generator got onto the client's interface (tx counter).
    pub pps_64b_sent: Option<f64>,
    /// 1 - received/sent over the window.
    pub loss_ratio_64b: Option<f64>,
    pub rtt_us_p50: Option<f64>,
    pub rtt_us_p99: Option<f64>,
    pub rtt_samples: Option<usize>,
    /// Per-measurement failures (measurement name -> reason); the others still ran.
    pub errors: BTreeMap<String, String>,
    /// NAT systems: the SYN flood run (reported under the top-level `flood`).
    #[serde(skip)]
    pub flood: Option<FloodReport>,
}

/// The SYN flood (`crate::flood`) against both NATs, each in its own lab of this run.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct FloodPair {
    pub pliant_nat: Option<FloodReport>,
    pub kernel_nat: Option<FloodReport>,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct ForwardReport {
    pub bench: &'static str,
    pub duration_s: u32,
    pub flows_64b: u16,
    pub pps_method: &'static str,
    pub rtt_method: &'static str,
    pub kernel_forward: SystemReport,
    pub kernel_nat: SystemReport,
    pub pliant_nat: SystemReport,
    pub ratio_pps_vs_kernel_nat: Option<f64>,
    /// 1-stream TCP throughput ratio pliant / kernel NAT.
    pub ratio_gbps_vs_kernel_nat: Option<f64>,
    pub ratio_gbps_4streams_vs_kernel_nat: Option<f64>,
    /// pliant NAT minus kernel NAT, microseconds.
    pub added_rtt_us_p50: Option<f64>,
    pub added_rtt_us_p99: Option<f64>,
    pub flood: FloodPair,
    pub total_s: f64,
}

pub const SYSTEMS: [&str; 3] = ["kernel_forward", "kernel_nat", "pliant_nat"];

fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

fn diff(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    Some(a? - b?)
}

impl ForwardReport {
    /// Assemble the report and derive the ratios (only from numbers that were measured).
    pub fn new(opts: &ForwardOpts, systems: [SystemReport; 3], total_s: f64) -> Self {
        let [kernel_forward, kernel_nat, pliant_nat] = systems;
        ForwardReport {
            bench: "forward",
            duration_s: opts.duration_s,
            flows_64b: opts.flows,
            pps_method: "trafgen -P1 on client, 60B UDP frames (64B with FCS) over flows_64b \
                         source ports; received = nft netdev ingress counter on the server port",
            rtt_method:
                "ping -i 0.002 -c 500 (ICMP echo), per-reply time, nearest-rank percentiles",
            ratio_pps_vs_kernel_nat: ratio(pliant_nat.pps_64b, kernel_nat.pps_64b),
            ratio_gbps_vs_kernel_nat: ratio(pliant_nat.gbps_1stream, kernel_nat.gbps_1stream),
            ratio_gbps_4streams_vs_kernel_nat: ratio(
                pliant_nat.gbps_4streams,
                kernel_nat.gbps_4streams,
            ),
            added_rtt_us_p50: diff(pliant_nat.rtt_us_p50, kernel_nat.rtt_us_p50),
            added_rtt_us_p99: diff(pliant_nat.rtt_us_p99, kernel_nat.rtt_us_p99),
            flood: FloodPair {
                pliant_nat: pliant_nat.flood.clone(),
                kernel_nat: kernel_nat.flood.clone(),
            },
            kernel_forward,
            kernel_nat,
            pliant_nat,
            total_s,
        }
    }

    pub fn systems(&self) -> [(&'static str, &SystemReport); 3] {
        [
            ("kernel_forward", &self.kernel_forward),
            ("kernel_nat", &self.kernel_nat),
            ("pliant_nat", &self.pliant_nat),
        ]
    }
}

fn progress(msg: &str) {
    eprintln!("[bench] {msg}");
}

/// Run the whole benchmark. Never fails as a whole: a system that cannot be measured carries
/// its error in the report.
pub fn run_forward(opts: &ForwardOpts) -> ForwardReport {
    let start = Instant::now();
    let mut out: [SystemReport; 3] = Default::default();
    for (i, sys) in SYSTEMS.iter().enumerate() {
        let mode = match *sys {
            "kernel_forward" => ReplicaMode::KernelForward,
            "kernel_nat" => ReplicaMode::KernelNat,
            _ => ReplicaMode::Pliant {
                config: PliantNf::nat(),
            },
        };
        out[i].mode = mode.label();
        if !opts.only.is_empty() && !opts.only.iter().any(|o| o == sys) {
            out[i].error = Some("not selected (--only)".into());
            continue;
        }
        if pliant_lab::cmd::interrupted() {
            out[i].error = Some("interrupted before this system ran".into());
            continue;
        }
        progress(&format!("{sys}: bringing up a {} lab", mode.label()));
        out[i] = measure_system(opts, mode);
        progress(&format!(
            "{sys}: done ({:.0} s elapsed)",
            start.elapsed().as_secs_f64()
        ));
    }
    ForwardReport::new(opts, out, start.elapsed().as_secs_f64())
}

fn measure_system(opts: &ForwardOpts, mode: ReplicaMode) -> SystemReport {
    let nat = !matches!(mode, ReplicaMode::KernelForward);
    let mut r = SystemReport {
        mode: mode.label(),
        ..Default::default()
    };
    let mut spec = LabSpec::new(mode);
    spec.pliant_bin = opts.pliant_bin.clone();
    spec.disable_offloads = opts.disable_offloads;
    spec.files.clear();
    let lab = match Lab::up(spec) {
        Ok(l) => l,
        Err(e) => {
            r.error = Some(format!("lab up: {e}"));
            return r;
        }
    };
    let mut note = |name: &str, e: BenchError| {
        progress(&format!("  {name} failed: {e}"));
        r.errors.insert(name.to_string(), e.to_string());
    };
    let stop = || pliant_lab::cmd::interrupted();
    // RTT first, on an idle path (the pps flood leaves NAT state behind).
    match measure_rtt(&lab) {
        Ok(s) => {
            r.rtt_us_p50 = percentile(&s, 50.0);
            r.rtt_us_p99 = percentile(&s, 99.0);
            r.rtt_samples = Some(s.len());
        }
        Err(e) => note("rtt", e),
    }
    for streams in [1u32, 4] {
        if stop() {
            break;
        }
        match measure_iperf(&lab, opts.duration_s, streams) {
            Ok(x) if streams == 1 => {
                r.gbps_1stream = Some(x.gbps);
                r.tcp_retransmits_1stream = Some(x.retransmits);
            }
            Ok(x) => r.gbps_4streams = Some(x.gbps),
            Err(e) => note(&format!("iperf3_{streams}stream"), e),
        }
    }
    match if stop() {
        Err(BenchError::Interrupted)
    } else {
        measure_pps(&lab, opts)
    } {
        Ok((rx, tx)) => {
            r.pps_64b = Some(rx);
            r.pps_64b_sent = Some(tx);
            r.loss_ratio_64b = (tx > 0.0).then(|| (1.0 - rx / tx).max(0.0));
        }
        Err(e) => note("pps_64b", e),
    }
    if nat && !stop() {
        progress("  SYN flood from one inside host, HTTP fetches from another");
        let f = measure_flood(&lab, &FloodOpts::default());
        if let Some(e) = &f.error {
            progress(&format!("  flood failed: {e}"));
        }
        r.flood = Some(f);
    }
    if stop() {
        r.errors
            .insert("interrupted".into(), "stopped by a signal".into());
    }
    if let Err(e) = lab.down() {
        r.errors.insert("teardown".into(), e.to_string());
    }
    r
}

pub(crate) fn lab_err(e: pliant_lab::LabError) -> BenchError {
    BenchError::Lab(e.to_string())
}

fn measure_rtt(lab: &Lab) -> Result<Vec<f64>, BenchError> {
    progress(&format!(
        "  ping: {RTT_SAMPLES} echo requests at 2 ms intervals"
    ));
    // Warm-up: resolve ARP on every hop and create the NAT mapping before sampling.
    lab.exec(
        Role::Client,
        &["ping", "-c", "3", "-i", "0.05", "-W", "1", SERVER_IP],
    )
    .map_err(lab_err)?;
    let n = RTT_SAMPLES.to_string();
    let out = lab
        .exec_timeout(
            Role::Client,
            &[
                "ping", "-i", "0.002", "-c", &n, "-W", "1", "-w", "20", SERVER_IP,
            ],
            Duration::from_secs(30),
        )
        .map_err(lab_err)?;
    let s = parse_ping_rtts_us(&out.stdout);
    if s.is_empty() {
        return Err(BenchError::Tool {
            tool: "ping",
            reason: format!(
                "no replies ({})",
                out.stdout.lines().last().unwrap_or("").trim()
            ),
        });
    }
    Ok(s)
}

fn measure_iperf(
    lab: &Lab,
    duration_s: u32,
    streams: u32,
) -> Result<crate::parse::IperfResult, BenchError> {
    progress(&format!(
        "  iperf3: {streams} TCP stream(s) for {duration_s} s"
    ));
    let (t, p) = (duration_s.to_string(), streams.to_string());
    let mut attempt = 0;
    loop {
        attempt += 1;
        let out = lab
            .exec_timeout(
                Role::Client,
                &[
                    "iperf3",
                    "-c",
                    SERVER_IP,
                    "-t",
                    &t,
                    "-P",
                    &p,
                    "-J",
                    "--connect-timeout",
                    "3000",
                ],
                Duration::from_secs(u64::from(duration_s) + 30),
            )
            .map_err(lab_err)?;
        // The iperf3 server answers "busy" for a moment after the previous test while it
        // finishes that test's bookkeeping; that is not a measurement, so wait and retry.
        if attempt < 3 && out.stdout.contains("the server is busy") {
            progress("  iperf3: server still busy with the previous test, retrying in 1 s");
            std::thread::sleep(Duration::from_secs(1));
            continue;
        }
        return parse_iperf3_gbps(&out.stdout);
    }
}

/// trafgen packet description: one 60-byte frame, source port cycling over `flows` values.
pub fn trafgen_config(flows: u16) -> String {
    let last = PPS_SPORT_BASE.saturating_add(flows.max(1) - 1);
    format!(
        "{{ eth(da={IN_PORT_MAC}, sa={CLIENT_MAC}), \
         ipv4(sa={CLIENT_IP}, da={SERVER_IP}, ttl=64), \
         udp(sp=dinc({PPS_SPORT_BASE}, {last}), dp={PPS_DPORT}), fill(0x00, 18) }}\n"
    )
}

/// nftables netdev table for the server: count and drop the generator's frames at ingress.
pub fn server_counter_rules() -> String {
    format!(
        "table netdev pliantbench {{\n\
         \tcounter rx64 {{\n\
         \t}}\n\
         \tchain ingress {{\n\
         \t\ttype filter hook ingress device \"{SERVER_IF}\" priority -500; policy accept;\n\
         \t\tudp dport {PPS_DPORT} counter name \"rx64\" drop\n\
         \t}}\n\
         }}\n"
    )
}

fn read_rx(lab: &Lab) -> Result<u64, BenchError> {
    let out = lab
        .exec_ok(
            Role::Server,
            &[
                "nft",
                "-j",
                "list",
                "counter",
                "netdev",
                "pliantbench",
                "rx64",
            ],
        )
        .map_err(lab_err)?;
    parse_nft_counter_packets(&out.stdout)
}

/// Frames the generator offered to the client's veth: transmitted plus dropped by veth (the
/// peer's backlog was full). trafgen's own "packets outgoing" is not used: it counts ring slots.
fn read_tx(lab: &Lab) -> Result<u64, BenchError> {
    let s = lab.link_stats(Role::Client, CLIENT_IF).map_err(lab_err)?;
    Ok(s.tx_packets + s.tx_dropped)
}

/// Returns (received pps, sent pps).
fn measure_pps(lab: &Lab, opts: &ForwardOpts) -> Result<(f64, f64), BenchError> {
    if !(1..=50_000).contains(&opts.flows) {
        return Err(BenchError::Tool {
            tool: "trafgen",
            reason: format!("flows must be 1..=50000, got {}", opts.flows),
        });
    }
    progress(&format!(
        "  trafgen: 64-byte UDP over {} flows, {} s window after {} s warm-up",
        opts.flows,
        opts.duration_s,
        PPS_WARMUP.as_secs()
    ));
    let dir = lab.run_dir();
    let rules = dir.join("bench-counter.nft");
    std::fs::write(&rules, server_counter_rules()).map_err(|e| BenchError::Io(rules.clone(), e))?;
    let rules_s = rules.display().to_string();
    lab.exec_ok(Role::Server, &["nft", "-f", &rules_s])
        .map_err(lab_err)?;
    let cfg = dir.join("trafgen.cfg");
    std::fs::write(&cfg, trafgen_config(opts.flows)).map_err(|e| BenchError::Io(cfg.clone(), e))?;
    let cfg_s = cfg.display().to_string();
    // -P 1: one generator CPU, leaving the other for a user-space replica. --no-sock-mem and
    // --notouch-irq: trafgen must not retune host-wide sysctls or IRQ affinities.
    let mut child = lab
        .spawn(
            Role::Client,
            &[
                "trafgen",
                "-o",
                CLIENT_IF,
                "-i",
                &cfg_s,
                "-P",
                "1",
                "--no-sock-mem",
                "--notouch-irq",
            ],
            &dir.join("trafgen.log"),
        )
        .map_err(lab_err)?;
    let result = (|| {
        std::thread::sleep(PPS_WARMUP);
        if let Ok(Some(st)) = child.try_wait() {
            let log = pliant_lab::log_tail(&dir.join("trafgen.log"), 5);
            return Err(BenchError::Tool {
                tool: "trafgen",
                reason: format!("exited early ({st}): {log}"),
            });
        }
        let (rx0, tx0, t0) = (read_rx(lab)?, read_tx(lab)?, Instant::now());
        std::thread::sleep(Duration::from_secs(u64::from(opts.duration_s)));
        let (rx1, tx1, secs) = (read_rx(lab)?, read_tx(lab)?, t0.elapsed().as_secs_f64());
        Ok((
            rx1.saturating_sub(rx0) as f64 / secs,
            tx1.saturating_sub(tx0) as f64 / secs,
        ))
    })();
    // SIGINT to trafgen's process group (it forks a worker per CPU) lets it exit cleanly.
    if !pliant_lab::cmd::stop_group(&mut child, libc::SIGINT, Duration::from_secs(3)) {
        progress("  trafgen did not stop on SIGINT; killed");
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratios_only_from_measured_numbers() {
        let opts = ForwardOpts::default();
        let kn = SystemReport {
            pps_64b: Some(100.0),
            gbps_1stream: Some(10.0),
            rtt_us_p50: Some(20.0),
            ..Default::default()
        };
        let pl_failed = SystemReport {
            error: Some("lab up: replica did not start".into()),
            ..Default::default()
        };
        let r = ForwardReport::new(&opts, [SystemReport::default(), kn.clone(), pl_failed], 1.0);
        assert_eq!(r.ratio_pps_vs_kernel_nat, None);
        assert_eq!(r.added_rtt_us_p50, None);
        let pl = SystemReport {
            pps_64b: Some(80.0),
            gbps_1stream: Some(5.0),
            rtt_us_p50: Some(35.0),
            ..Default::default()
        };
        let r = ForwardReport::new(&opts, [SystemReport::default(), kn, pl], 1.0);
        assert_eq!(r.ratio_pps_vs_kernel_nat, Some(0.8));
        assert_eq!(r.ratio_gbps_vs_kernel_nat, Some(0.5));
        assert_eq!(r.added_rtt_us_p50, Some(15.0));
        assert_eq!(r.ratio_gbps_4streams_vs_kernel_nat, None);
    }

    #[test]
    fn json_has_stable_field_names_and_nulls_for_unmeasured() {
        let r = ForwardReport::new(&ForwardOpts::default(), Default::default(), 0.0);
        let v = serde_json::to_value(&r).expect("json");
        for k in [
            "kernel_forward",
            "kernel_nat",
            "pliant_nat",
            "ratio_pps_vs_kernel_nat",
            "ratio_gbps_vs_kernel_nat",
            "added_rtt_us_p50",
            "flood",
        ] {
            assert!(v.get(k).is_some(), "missing {k}");
        }
        let kn = &v["kernel_nat"];
        for k in [
            "gbps_1stream",
            "gbps_4streams",
            "pps_64b",
            "rtt_us_p50",
            "rtt_us_p99",
        ] {
            assert!(
                kn.get(k).is_some_and(|x| x.is_null()),
                "{k} must be present and null"
            );
        }
    }

    #[test]
    fn flood_is_reported_per_nat_system_at_top_level() {
        let f = |pct| FloodReport {
            other_host_fetch_ok_pct: Some(pct),
            recovery_ms: Some(20.0),
            ..Default::default()
        };
        let kn = SystemReport {
            flood: Some(f(100.0)),
            ..Default::default()
        };
        let pl = SystemReport {
            flood: Some(f(97.5)),
            ..Default::default()
        };
        let r = ForwardReport::new(
            &ForwardOpts::default(),
            [SystemReport::default(), kn, pl],
            1.0,
        );
        let v = serde_json::to_value(&r).expect("json");
        assert_eq!(v["flood"]["pliant_nat"]["other_host_fetch_ok_pct"], 97.5);
        assert_eq!(v["flood"]["kernel_nat"]["other_host_fetch_ok_pct"], 100.0);
        assert!(v["flood"]["kernel_nat"]["rss_mb_max"].is_null());
        assert!(
            v["pliant_nat"].get("flood").is_none(),
            "reported once, at the top"
        );
    }

    #[test]
    fn trafgen_config_covers_exactly_the_flow_range() {
        let c = trafgen_config(1024);
        assert!(c.contains("sp=dinc(10000, 11023)"), "{c}");
        assert!(c.contains("dp=9"), "{c}");
        assert!(c.contains(IN_PORT_MAC) && c.contains(CLIENT_MAC));
        // 14 eth + 20 ip + 8 udp + 18 fill = 60 bytes (64 with FCS).
        assert!(c.contains("fill(0x00, 18)"));
        assert!(trafgen_config(1).contains("dinc(10000, 10000)"));
    }

    #[test]
    fn counter_rules_are_one_statement_per_line() {
        let r = server_counter_rules();
        assert!(r.contains("hook ingress device \"server0\""), "{r}");
        assert!(r.contains("udp dport 9 counter name \"rx64\" drop"), "{r}");
    }
}
