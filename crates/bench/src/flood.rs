//! SYN flood through a NAT: one inside host floods SYNs, another keeps fetching over HTTP.
//!
//! The lab's client namespace plays both inside hosts: the flooder is the client address
//! ([`CLIENT_IP`], `trafgen` TCP SYNs with the source port incremented per packet, towards a
//! server port whose SYNs the server drops at ingress, so every SYN stays unanswered — pure
//! NAT-state pressure, not the server's SYN queue), the other host is a second address on the
//! same interface ([`OTHER_HOST_IP`], `curl --interface`), fetching from the lab's nginx.
//!
//! Measured: the share of the other host's fetches that succeed while the flood runs (a fetch
//! succeeds when an HTTP status arrives within [`FETCH_TIMEOUT_S`]), the time from stopping the
//! flood to the first successful fetch completing, and (pliant only) the replica's peak RSS
//! (`VmHWM`). Used by `bench forward` and by the `e2e_nat_flood` test (one implementation).

use crate::forward::lab_err;
use crate::migrate::ask;
use crate::BenchError;
use pliant_lab::topology::{CLIENT_IF, CLIENT_MAC, IN_PORT_MAC, PREFIX_LEN, SERVER_IF};
use pliant_lab::{Lab, ReplicaMode, Role, CLIENT_IP, SERVER_IP};
use serde::Serialize;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// The second inside host: an extra address on the client interface.
pub const OTHER_HOST_IP: &str = "10.77.1.3";
/// Server port the SYNs go to; the server drops them at ingress (never answered).
pub const FLOOD_DPORT: u16 = 81;
/// Per-fetch budget (curl `-m`): a SYN lost to a full NAT needs a 1 s retransmit and fails.
pub const FETCH_TIMEOUT_S: u32 = 1;
/// Pause between two fetches of the other host during the flood.
const FETCH_GAP: Duration = Duration::from_millis(50);
/// Longest wait for the first successful fetch after the flood stops.
const RECOVERY_LIMIT: Duration = Duration::from_secs(5);

#[derive(Clone, Debug)]
pub struct FloodOpts {
    /// How long the flood runs.
    pub flood_s: f64,
    /// SYNs per second (trafgen `--rate`).
    pub rate_pps: u32,
}

impl Default for FloodOpts {
    fn default() -> Self {
        // 25k SYN/s for 4 s: 100k mappings asked for, more than pliant's 40000-port pool, so
        // its pool runs dry after ~1.6 s and the rest of the flood runs against a full table.
        FloodOpts {
            flood_s: 4.0,
            rate_pps: 25_000,
        }
    }
}

/// Results of one flood run. `null` fields were not measured.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct FloodReport {
    pub error: Option<String>,
    /// Successful fetches of the other host started during the flood, in percent.
    pub other_host_fetch_ok_pct: Option<f64>,
    pub fetches_during_flood: Option<u32>,
    /// Flood stop -> first successful fetch completed, milliseconds.
    pub recovery_ms: Option<f64>,
    /// Peak resident set of the pliant replica (VmHWM), MiB; `null` for kernel systems.
    pub rss_mb_max: Option<f64>,
    /// SYNs the generator got onto the flooder's interface.
    pub syns_sent: Option<u64>,
    pub flood_s: f64,
    pub rate_pps: u32,
    /// pliant only: resident set before the flood (VmRSS), MiB.
    pub rss_mb_before: Option<f64>,
    /// pliant only, after the flood: the replica's drop counters, the inside port's kernel
    /// ring drops (`inside_rx_kernel_drops` since the replica started,
    /// `inside_rx_kernel_drops_during_flood` those of the flood run) and the NAT's `abuse`
    /// query section.
    pub replica_counters: Option<Value>,
}

/// trafgen packet description: TCP SYNs from the flooder, source port incremented per frame.
pub fn syn_trafgen_config() -> String {
    format!(
        "{{ eth(da={IN_PORT_MAC}, sa={CLIENT_MAC}), \
         ipv4(sa={CLIENT_IP}, da={SERVER_IP}, ttl=64), \
         tcp(sp=dinc(1024, 65535), dp={FLOOD_DPORT}, seq=drnd(), syn, win=64240) }}\n"
    )
}

/// nftables netdev table for the server: drop the flood's SYNs at ingress, unanswered.
pub fn server_drop_rules() -> String {
    format!(
        "table netdev pliantflood {{\n\
         \tchain ingress {{\n\
         \t\ttype filter hook ingress device \"{SERVER_IF}\" priority -500; policy accept;\n\
         \t\ttcp dport {FLOOD_DPORT} drop\n\
         \t}}\n\
         }}\n"
    )
}

/// One fetch by the other host; true when an HTTP status came back in time.
fn fetch(lab: &Lab) -> bool {
    let url = format!("http://{SERVER_IP}/");
    let t = FETCH_TIMEOUT_S.to_string();
    lab.exec_timeout(
        Role::Client,
        &[
            "curl",
            "--interface",
            OTHER_HOST_IP,
            "-s",
            "-o",
            "/dev/null",
            "-m",
            &t,
            "-w",
            "%{http_code}",
            &url,
        ],
        Duration::from_secs(u64::from(FETCH_TIMEOUT_S) + 5),
    )
    .map(|o| o.stdout.trim().parse::<u16>().unwrap_or(0) > 0)
    .unwrap_or(false)
}

/// Peak RSS (VmHWM) of a process, MiB.
pub fn peak_rss_mb(pid: i32) -> Option<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    parse_vm_hwm_kb(&s).map(|kb| kb as f64 / 1024.0)
}

/// Current RSS (VmRSS) of a process, MiB.
pub fn rss_mb(pid: i32) -> Option<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status_kb(&s, "VmRSS:").map(|kb| kb as f64 / 1024.0)
}

fn parse_vm_hwm_kb(status: &str) -> Option<u64> {
    status_kb(status, "VmHWM:")
}

fn status_kb(status: &str, field: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|n| n.parse().ok())
}

/// Percentage of `ok` in `n`, `None` when nothing ran.
pub fn pct(ok: u32, n: u32) -> Option<f64> {
    (n > 0).then(|| f64::from(ok) * 100.0 / f64::from(n))
}

/// Run the flood on a lab whose replica is a NAT (kernel or pliant). Adds the other host's
/// address and the server's drop rule (both stay until the lab goes down).
pub fn measure_flood(lab: &Lab, opts: &FloodOpts) -> FloodReport {
    let mut r = FloodReport {
        flood_s: opts.flood_s,
        rate_pps: opts.rate_pps,
        ..Default::default()
    };
    if let Err(e) = run(lab, opts, &mut r) {
        r.error = Some(e.to_string());
    }
    r
}

fn run(lab: &Lab, opts: &FloodOpts, r: &mut FloodReport) -> Result<(), BenchError> {
    let dir = lab.run_dir();
    let addr = format!("{OTHER_HOST_IP}/{PREFIX_LEN}");
    lab.exec_ok(
        Role::Client,
        &["ip", "addr", "replace", &addr, "dev", CLIENT_IF],
    )
    .map_err(lab_err)?;
    let rules = dir.join("flood-drop.nft");
    std::fs::write(&rules, server_drop_rules()).map_err(|e| BenchError::Io(rules.clone(), e))?;
    lab.exec_ok(Role::Server, &["nft", "-f", &rules.display().to_string()])
        .map_err(lab_err)?;
    // The other host works before the flood (ARP resolved, path up).
    let t0 = Instant::now();
    while !fetch(lab) {
        if t0.elapsed() > RECOVERY_LIMIT {
            return Err(BenchError::Tool {
                tool: "curl",
                reason: "the other host cannot fetch even before the flood".into(),
            });
        }
    }
    let pliant = matches!(lab.mode(), ReplicaMode::Pliant { .. });
    // The replica's ring drops are a lifetime total: what the flood added is the difference
    // (`bench forward` floods a lab that already ran its pps and iperf3 phases).
    let mut ring_drops_before = None;
    if pliant {
        r.rss_mb_before = lab.replica_pid(1).and_then(rss_mb);
        ring_drops_before = replica_counters(lab)
            .ok()
            .and_then(|v| v["inside_rx_kernel_drops"].as_u64());
    }
    let cfg = dir.join("flood.cfg");
    std::fs::write(&cfg, syn_trafgen_config()).map_err(|e| BenchError::Io(cfg.clone(), e))?;
    let rate = format!("{}pps", opts.rate_pps);
    let tx0 = lab.link_stats(Role::Client, CLIENT_IF).map_err(lab_err)?;
    let mut child = lab
        .spawn(
            Role::Client,
            &[
                "trafgen",
                "-o",
                CLIENT_IF,
                "-i",
                &cfg.display().to_string(),
                "-P",
                "1",
                "-b",
                &rate,
                "--no-sock-mem",
                "--notouch-irq",
            ],
            &dir.join("flood-trafgen.log"),
        )
        .map_err(lab_err)?;
    let flood = Duration::from_secs_f64(opts.flood_s);
    let start = Instant::now();
    let (mut n, mut ok) = (0u32, 0u32);
    while start.elapsed() < flood {
        if let Ok(Some(st)) = child.try_wait() {
            let log = pliant_lab::log_tail(&dir.join("flood-trafgen.log"), 5);
            return Err(BenchError::Tool {
                tool: "trafgen",
                reason: format!("exited early ({st}): {log}"),
            });
        }
        n += 1;
        ok += u32::from(fetch(lab));
        std::thread::sleep(FETCH_GAP);
    }
    pliant_lab::cmd::stop_group(&mut child, libc::SIGINT, Duration::from_secs(3));
    let stopped = Instant::now();
    let tx1 = lab.link_stats(Role::Client, CLIENT_IF).map_err(lab_err)?;
    // Not exact (the other host's packets are in it too) but those are a few hundred.
    r.syns_sent =
        Some((tx1.tx_packets + tx1.tx_dropped).saturating_sub(tx0.tx_packets + tx0.tx_dropped));
    r.fetches_during_flood = Some(n);
    r.other_host_fetch_ok_pct = pct(ok, n);
    while stopped.elapsed() < RECOVERY_LIMIT {
        if fetch(lab) {
            r.recovery_ms = Some(stopped.elapsed().as_secs_f64() * 1000.0);
            break;
        }
    }
    if pliant {
        r.rss_mb_max = lab.replica_pid(1).and_then(peak_rss_mb);
        r.replica_counters = replica_counters(lab).ok();
        if let Some(c) = r.replica_counters.as_mut() {
            let during = c["inside_rx_kernel_drops"]
                .as_u64()
                .zip(ring_drops_before)
                .map(|(after, before)| after.saturating_sub(before));
            c["inside_rx_kernel_drops_during_flood"] = json!(during);
        }
    }
    Ok(())
}

fn replica_counters(lab: &Lab) -> Result<Value, BenchError> {
    let sock = lab
        .replica_socket(1)
        .ok_or_else(|| BenchError::Lab("no replica control socket".into()))?
        .display()
        .to_string();
    let stats = ask(&sock, &pliant_proto::Request::Stats)?;
    let query = ask(&sock, &pliant_proto::Request::Query)?;
    Ok(json!({
        "drops": stats["drops"],
        "inside_rx_kernel_drops": stats["ports"]["inside"]["rx_kernel_drops"],
        "abuse": query["query"]["abuse"],
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn syn_config_increments_the_source_port_towards_the_dropped_port() {
        let c = syn_trafgen_config();
        assert!(c.contains("sp=dinc(1024, 65535)"), "{c}");
        assert!(c.contains("dp=81") && c.contains("syn"), "{c}");
        assert!(c.contains(IN_PORT_MAC) && c.contains(CLIENT_MAC), "{c}");
        let d = server_drop_rules();
        assert!(d.contains("tcp dport 81 drop"), "{d}");
    }

    #[test]
    fn vm_hwm_is_read_in_kib() {
        let s = "Name:\tpliant\nVmPeak:\t  9000 kB\nVmHWM:\t   20480 kB\nVmRSS:\t 1 kB\n";
        assert_eq!(parse_vm_hwm_kb(s), Some(20480));
        assert_eq!(parse_vm_hwm_kb("Name: x\n"), None);
    }

    #[test]
    fn pct_only_when_something_ran() {
        assert_eq!(pct(0, 0), None);
        assert_eq!(pct(19, 20), Some(95.0));
    }

    #[test]
    fn report_json_field_names() {
        let v = serde_json::to_value(FloodReport::default()).expect("json");
        for k in ["other_host_fetch_ok_pct", "recovery_ms", "rss_mb_max"] {
            assert!(v.get(k).is_some_and(|x| x.is_null()), "{k}");
        }
    }
}
