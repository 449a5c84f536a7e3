//! Steering at scale (part of `bench migrate`): the forwarding rate through the tc-BPF fabric
//! with ~100,000 concurrent flows, without and with 10,000 per-flow exceptions (moved flows).
//!
//! Lab: 2 pliant replicas running the stateless `forward` NF (no NF state, so nothing but the
//! fabric differs between the two windows). A sender thread in the client (AF_PACKET send(2),
//! see [`raw_sender`] for why not trafgen) sends 64-byte UDP frames as fast as it can, cycling
//! over `flows` 5-tuples (source port x destination port 9/10); the rate is the
//! nftables netdev ingress counter at the server over a window, as in `bench forward`. Then
//! 10,000 of the flows get exceptions (alternating replicas, so about half of them really move
//! away from their ring owner) and the window is measured again. The fabric's own exception-hit
//! counter proves the exceptions were consulted.

use crate::forward::PPS_SPORT_BASE;
use crate::parse::parse_nft_counter_packets;
use crate::BenchError;
use pliant_lab::topology::{CLIENT_IF, CLIENT_MAC, IN_PORT_MAC, SERVER_IF};
use pliant_lab::{Lab, LabSpec, PliantNf, ReplicaMode, Role, CLIENT_IP, SERVER_IP};
use pliant_state::FlowKey;
use serde::Serialize;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Destination ports: two, so source ports x 2 gives the flow count.
const DPORTS: (u16, u16) = (9, 10);

#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct SteeringScale {
    pub measured: bool,
    pub flows: u32,
    pub exceptions: u32,
    pub window_s: u32,
    /// Frames/s received at the server, no exceptions (mean of two windows interleaved with the
    /// other variant's).
    pub pps_no_exceptions: Option<f64>,
    /// Frames/s received at the server with `exceptions` installed.
    pub pps_with_exceptions: Option<f64>,
    /// Received frames/s of each window, in order (the means above are over these).
    pub windows_no_exceptions: Vec<f64>,
    pub windows_with_exceptions: Vec<f64>,
    /// with / without (goal: >= 0.9).
    pub ratio: Option<f64>,
    /// Offered load (client tx) in each window.
    pub pps_sent_no_exceptions: Option<f64>,
    pub pps_sent_with_exceptions: Option<f64>,
    /// Microseconds per exception when installing them (batched map updates).
    pub install_us_per_exception: Option<f64>,
    /// Fabric packets that matched an exception during the second window (0 would mean the
    /// exceptions were never consulted).
    pub exception_hits: u64,
    /// Every fabric counter over the second window (where the frames went).
    pub fabric_stats: std::collections::BTreeMap<String, u64>,
    /// Entries in the fabric's connection (pin) table after the run.
    pub conn_entries: Option<usize>,
    pub method: &'static str,
    pub error: Option<String>,
}

/// trafgen packet (equivalent traffic, for reproducing by hand; see [`raw_sender`] for why the
/// bench does not use trafgen): source port cycling over an odd count (`sports`) and destination port
/// over 2, so the pair cycles over `2 * sports` distinct flows.
pub fn trafgen_config(sports: u16) -> String {
    let last = PPS_SPORT_BASE.saturating_add(sports.max(1) - 1);
    format!(
        "{{ eth(da={IN_PORT_MAC}, sa={CLIENT_MAC}), \
         ipv4(sa={CLIENT_IP}, da={SERVER_IP}, ttl=64), \
         udp(sp=dinc({PPS_SPORT_BASE}, {last}), dp=dinc({}, {})), fill(0x00, 18) }}\n",
        DPORTS.0, DPORTS.1
    )
}

fn counter_rules() -> String {
    format!(
        "table netdev pliantsteerscale {{\n\
         \tcounter rx64 {{\n\
         \t}}\n\
         \tchain ingress {{\n\
         \t\ttype filter hook ingress device \"{SERVER_IF}\" priority -500; policy accept;\n\
         \t\tudp dport {{ {}, {} }} counter name \"rx64\" drop\n\
         \t}}\n\
         }}\n",
        DPORTS.0, DPORTS.1
    )
}

fn progress(msg: &str) {
    eprintln!("[bench migrate] {msg}");
}

fn lab_err(e: impl std::fmt::Display) -> BenchError {
    BenchError::Lab(e.to_string())
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
                "pliantsteerscale",
                "rx64",
            ],
        )
        .map_err(lab_err)?;
    parse_nft_counter_packets(&out.stdout)
}

fn read_tx(lab: &Lab) -> Result<u64, BenchError> {
    let s = lab.link_stats(Role::Client, CLIENT_IF).map_err(lab_err)?;
    Ok(s.tx_packets + s.tx_dropped)
}

/// (received pps, sent pps) over `window`.
fn window(lab: &Lab, window: Duration) -> Result<(f64, f64), BenchError> {
    let (rx0, tx0, t0) = (read_rx(lab)?, read_tx(lab)?, Instant::now());
    std::thread::sleep(window);
    let (rx1, tx1, s) = (read_rx(lab)?, read_tx(lab)?, t0.elapsed().as_secs_f64());
    Ok((
        rx1.saturating_sub(rx0) as f64 / s,
        tx1.saturating_sub(tx0) as f64 / s,
    ))
}

/// Runs the measurement in its own lab; never fails as a whole (the error is in the result).
pub fn run(pliant_bin: PathBuf, flows: u32, exceptions: u32, window_s: u32) -> SteeringScale {
    let mut r = SteeringScale {
        flows,
        exceptions,
        window_s,
        method: "2 pliant-forward replicas behind the tc-BPF fabric; one AF_PACKET send(2) \
                 thread, 64B UDP over \
                 `flows` 5-tuples; server nft netdev ingress counter; window without, then with \
                 `exceptions` steering exceptions",
        ..Default::default()
    };
    // An odd source-port count keeps the (sport, dport) pairs from repeating early.
    let sports = (flows / 2) | 1;
    if sports as usize + usize::from(PPS_SPORT_BASE) > 65_535 || exceptions > sports * 2 {
        r.error = Some(format!(
            "{flows} flows / {exceptions} exceptions do not fit the port range"
        ));
        return r;
    }
    r.flows = sports * 2;
    let mut spec = LabSpec::new(ReplicaMode::Pliant {
        config: PliantNf::forward(),
    });
    spec.replicas = 2;
    spec.pliant_bin = Some(pliant_bin);
    spec.files.clear();
    progress(&format!(
        "steering scale: {} flows, {exceptions} exceptions, {window_s} s windows",
        r.flows
    ));
    let lab = match Lab::up(spec) {
        Ok(l) => l,
        Err(e) => {
            r.error = Some(format!("lab up: {e}"));
            return r;
        }
    };
    if let Err(e) = measure(&lab, sports as u16, exceptions, window_s, &mut r) {
        r.error = Some(e.to_string());
    }
    if let Err(e) = lab.down() {
        r.error.get_or_insert(format!("teardown: {e}"));
    }
    r
}

fn measure(
    lab: &Lab,
    sports: u16,
    exceptions: u32,
    window_s: u32,
    r: &mut SteeringScale,
) -> Result<(), BenchError> {
    let dir = lab.run_dir();
    let rules = dir.join("steer-scale.nft");
    std::fs::write(&rules, counter_rules()).map_err(|e| BenchError::Io(rules.clone(), e))?;
    let rules_s = rules.display().to_string();
    lab.exec_ok(Role::Server, &["nft", "-f", &rules_s])
        .map_err(lab_err)?;
    let mut maps =
        pliant_steer::SteerMaps::open_pinned(&pliant_steer::lab::pin_dir(&lab.netns(Role::Fabric)))
            .map_err(lab_err)?;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let gen = {
        let stop = stop.clone();
        crate::flowgen::spawn_in_netns(&lab.netns(Role::Client), "raw-gen", move || {
            raw_sender(sports, &stop)
        })?
    };
    let w = Duration::from_secs(u64::from(window_s.max(1)));
    let res = (|| -> Result<(), BenchError> {
        // Warm-up: every flow seen once (connection pins made) before the first window.
        std::thread::sleep(Duration::from_secs(2));
        if gen.is_finished() {
            return Err(BenchError::Tool {
                tool: "raw sender",
                reason: "exited early".into(),
            });
        }
        let cip: Ipv4Addr = CLIENT_IP.parse().unwrap_or(Ipv4Addr::UNSPECIFIED);
        let sip: Ipv4Addr = SERVER_IP.parse().unwrap_or(Ipv4Addr::UNSPECIFIED);
        let entries: Vec<(FlowKey, u32)> = (0..exceptions)
            .map(|i| {
                let sport = PPS_SPORT_BASE + (i / 2) as u16;
                let dport = if i.is_multiple_of(2) {
                    DPORTS.0
                } else {
                    DPORTS.1
                };
                (FlowKey::v4(17, cip, sport, sip, dport).0, i % 2 + 1)
            })
            .collect();
        let keys: Vec<FlowKey> = entries.iter().map(|(k, _)| *k).collect();
        // Alternating windows (without, with, without, with): the machine's load drifts by
        // more than the effect being measured, so each variant gets two windows interleaved.
        let (mut without, mut with) = (Vec::new(), Vec::new());
        for _ in 0..2 {
            without.push(window(lab, w)?);
            let us = pliant_steer::per_item_us(entries.len(), || maps.set_exceptions(&entries))
                .map_err(lab_err)?;
            r.install_us_per_exception = Some(us);
            std::thread::sleep(Duration::from_millis(300));
            let s0 = maps.stats().map_err(lab_err)?;
            with.push(window(lab, w)?);
            let s1 = maps.stats().map_err(lab_err)?;
            let d = s1.since(&s0);
            r.exception_hits += d.get(pliant_steer::layout::Stat::Exception);
            r.fabric_stats = d.named().map(|(k, v)| (k.to_string(), v)).collect();
            r.conn_entries = maps.conn_entries().ok().map(|v| v.len());
            maps.remove_exceptions(&keys).map_err(lab_err)?;
            std::thread::sleep(Duration::from_millis(300));
        }
        let mean = |v: &[(f64, f64)], f: fn(&(f64, f64)) -> f64| {
            (!v.is_empty()).then(|| v.iter().map(f).sum::<f64>() / v.len() as f64)
        };
        r.pps_no_exceptions = mean(&without, |x| x.0);
        r.pps_sent_no_exceptions = mean(&without, |x| x.1);
        r.pps_with_exceptions = mean(&with, |x| x.0);
        r.pps_sent_with_exceptions = mean(&with, |x| x.1);
        r.windows_no_exceptions = without.iter().map(|x| x.0).collect();
        r.windows_with_exceptions = with.iter().map(|x| x.0).collect();
        r.ratio = match (r.pps_with_exceptions, r.pps_no_exceptions) {
            (Some(a), Some(b)) if b > 0.0 => Some(a / b),
            _ => None,
        };
        r.measured = true;
        Ok(())
    })();
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    match gen.join() {
        Ok(Ok(Ok(()))) => res,
        Ok(Ok(Err(e))) => res.and(Err(BenchError::Tool {
            tool: "raw sender",
            reason: e,
        })),
        Ok(Err(e)) => res.and(Err(e)),
        Err(_) => res.and(Err(BenchError::Tool {
            tool: "raw sender",
            reason: "panicked".into(),
        })),
    }
}

fn mac(s: &str) -> [u8; 6] {
    let mut m = [0u8; 6];
    for (i, p) in s.split(':').take(6).enumerate() {
        m[i] = u8::from_str_radix(p, 16).unwrap_or(0);
    }
    m
}

/// A 60-byte UDP frame client -> server; ports are patched per packet (UDP checksum 0, which
/// IPv4 allows; the IP checksum does not cover the ports).
pub fn frame_template() -> [u8; 60] {
    let mut f = [0u8; 60];
    f[0..6].copy_from_slice(&mac(IN_PORT_MAC));
    f[6..12].copy_from_slice(&mac(CLIENT_MAC));
    f[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
    let ip = &mut f[14..34];
    ip[0] = 0x45;
    ip[2..4].copy_from_slice(&46u16.to_be_bytes());
    ip[8] = 64;
    ip[9] = 17;
    let c: Ipv4Addr = CLIENT_IP.parse().unwrap_or(Ipv4Addr::UNSPECIFIED);
    let d: Ipv4Addr = SERVER_IP.parse().unwrap_or(Ipv4Addr::UNSPECIFIED);
    ip[12..16].copy_from_slice(&c.octets());
    ip[16..20].copy_from_slice(&d.octets());
    let mut sum = 0u32;
    for w in ip.chunks(2) {
        sum += u32::from(u16::from_be_bytes([w[0], w[1]]));
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    ip[10..12].copy_from_slice(&(!(sum as u16)).to_be_bytes());
    f[38..40].copy_from_slice(&26u16.to_be_bytes());
    f
}

/// Sends frames over `2 * sports` flows as fast as one thread can with send(2) on an
/// AF_PACKET socket. Not trafgen: its TX ring produces non-linear skbs, which the fabric's BPF
/// parser (direct packet access without `bpf_skb_pull_data`) drops; small frames from send(2)
/// are linear.
fn raw_sender(sports: u16, stop: &std::sync::atomic::AtomicBool) -> Result<(), String> {
    let name = std::ffi::CString::new(CLIENT_IF).map_err(|e| e.to_string())?;
    // SAFETY: plain syscalls on an fd we own; the sockaddr and the frame outlive the calls.
    unsafe {
        let ifindex = libc::if_nametoindex(name.as_ptr());
        if ifindex == 0 {
            return Err(format!("{CLIENT_IF}: no such interface"));
        }
        let fd = libc::socket(
            libc::AF_PACKET,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            i32::from((libc::ETH_P_ALL as u16).to_be()),
        );
        if fd < 0 {
            return Err(format!("socket: {}", std::io::Error::last_os_error()));
        }
        // Closes the socket on every return path.
        let _guard = <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd);
        let mut sll: libc::sockaddr_ll = std::mem::zeroed();
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = (libc::ETH_P_ALL as u16).to_be();
        sll.sll_ifindex = ifindex as i32;
        if libc::bind(
            fd,
            (&sll as *const libc::sockaddr_ll).cast(),
            std::mem::size_of::<libc::sockaddr_ll>() as u32,
        ) != 0
        {
            return Err(format!("bind: {}", std::io::Error::last_os_error()));
        }
        let mut f = frame_template();
        let mut i: u32 = 0;
        let n = u32::from(sports);
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            for _ in 0..256 {
                let sport = PPS_SPORT_BASE + (i % n) as u16;
                let dport = if i.is_multiple_of(2) {
                    DPORTS.0
                } else {
                    DPORTS.1
                };
                f[34..36].copy_from_slice(&sport.to_be_bytes());
                f[36..38].copy_from_slice(&dport.to_be_bytes());
                // ENOBUFS under overload is the offered load exceeding the link: keep going.
                libc::send(fd, f.as_ptr().cast(), f.len(), 0);
                i = i.wrapping_add(1);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_template_has_a_valid_ip_checksum() {
        let f = frame_template();
        let mut sum = 0u32;
        for w in f[14..34].chunks(2) {
            sum += u32::from(u16::from_be_bytes([w[0], w[1]]));
        }
        while sum > 0xffff {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        assert_eq!(sum, 0xffff);
        assert_eq!(&f[12..14], &[0x08, 0x00]);
    }

    #[test]
    fn trafgen_config_cycles_ports_and_rules_count_both() {
        let c = trafgen_config(50_001);
        assert!(c.contains("sp=dinc(10000, 60000)"), "{c}");
        assert!(c.contains("dp=dinc(9, 10)"), "{c}");
        assert!(counter_rules().contains("udp dport { 9, 10 } counter"));
    }

    #[test]
    fn flows_outside_the_port_range_are_refused_without_a_lab() {
        let r = run(PathBuf::from("/nonexistent"), 200_000, 10, 1);
        assert!(!r.measured);
        assert!(r.error.is_some());
    }
}
