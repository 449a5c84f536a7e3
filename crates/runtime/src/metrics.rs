//! Counters of the packet thread and their Prometheus text rendering.

use crate::nf::Counters;
use pliant_io::PortStats;
use pliant_state::TableStats;
use serde::Serialize;
use std::fmt::Write;

/// Per-port counters kept by the engine (the port keeps its own ring counters too).
#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq, Eq)]
pub struct SideStats {
    pub frames_in: u64,
    pub bytes_in: u64,
    pub frames_out: u64,
    pub bytes_out: u64,
    pub arp_in: u64,
    pub arp_replies_sent: u64,
    pub arp_requests_sent: u64,
    /// Echo replies the router role sent for pings of its own inside addresses.
    pub echo_replies_sent: u64,
    /// Frames whose partial (offload) checksum the engine completed before the NF saw them.
    pub csum_completed: u64,
    /// ICMP errors the router role sent out of this port (time exceeded, fragmentation
    /// needed), and those the rate limit suppressed.
    pub icmp_errors_sent: u64,
    pub icmp_errors_rate_limited: u64,
    /// IPv4 packets larger than this port's MTU sent as fragments, and the fragments.
    pub fragmented: u64,
    pub fragments_sent: u64,
    /// GSO super-frames this port could not take as one (segments above its MTU, or no
    /// offloads) that the engine segmented in software, and the segments that made.
    pub gso_segmented: u64,
    pub gso_segments_sent: u64,
}

#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct EngineStats {
    pub inside: SideStats,
    pub outside: SideStats,
    pub rounds: u64,
    /// Empty rounds after which the loop kept polling (traffic seen within the spin budget).
    pub idle_spins: u64,
    /// Times the loop blocked in poll(2).
    pub sleeps: u64,
    pub timers_fired: u64,
    pub control_requests: u64,
    pub control_errors: u64,
    /// Control connections refused because the bound of those served at once was reached
    /// (counted by the control socket's threads; filled in when reported).
    pub control_conns_refused: u64,
    /// Sealed control connections closed before their handshake finished (liveness probes).
    pub control_handshakes_aborted: u64,
    /// Highest controller leadership term seen on the control channel (0: none).
    pub control_term: u64,
    /// Control requests refused because their term was lower (a deposed controller's).
    pub control_deposed_refused: u64,
}

/// Everything `metrics` renders, gathered by the packet thread.
pub struct Snapshot<'a> {
    pub replica: &'a str,
    pub nf: &'a str,
    pub engine: &'a EngineStats,
    pub ports: [(&'a str, PortStats); 2],
    pub drops: &'a Counters,
    pub nf_counters: &'a Counters,
    pub table: &'a TableStats,
    pub neighbours: [(&'a str, usize); 2],
    pub uptime_s: f64,
}

/// Prometheus metric names allow `[a-zA-Z0-9_:]`; NF labels are snake_case already, this only
/// guards against a stray character breaking the exposition format.
fn sanitize(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Label values: escape backslash, quote and newline per the text format.
fn esc(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

struct Out {
    s: String,
    replica: String,
}

impl Out {
    fn header(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.s, "# HELP {name} {help}\n# TYPE {name} {kind}");
    }
    fn sample(&mut self, name: &str, labels: &[(&str, &str)], v: impl std::fmt::Display) {
        let _ = write!(self.s, "{name}{{replica=\"{}\"", self.replica);
        for (k, val) in labels {
            let _ = write!(self.s, ",{k}=\"{}\"", esc(val));
        }
        let _ = writeln!(self.s, "}} {v}");
    }
}

pub fn render(s: &Snapshot<'_>) -> String {
    let mut o = Out {
        s: String::with_capacity(4096),
        replica: esc(s.replica),
    };
    let sides = [("inside", &s.engine.inside), ("outside", &s.engine.outside)];
    type Field = fn(&SideStats) -> u64;
    let side_metrics: [(&str, &str, Field); 11] = [
        (
            "pliant_gso_segmented_total",
            "GSO super-frames the engine segmented in software per out-port (segments above \
             its MTU, or no offloads)",
            |x| x.gso_segmented,
        ),
        (
            "pliant_icmp_errors_sent_total",
            "ICMP errors (time exceeded, fragmentation needed) the router sent per port",
            |x| x.icmp_errors_sent,
        ),
        (
            "pliant_icmp_errors_rate_limited_total",
            "ICMP errors the router's rate limit suppressed per port",
            |x| x.icmp_errors_rate_limited,
        ),
        ("pliant_frames_in_total", "Frames received per port", |x| {
            x.frames_in
        }),
        ("pliant_bytes_in_total", "Bytes received per port", |x| {
            x.bytes_in
        }),
        ("pliant_frames_out_total", "Frames sent per port", |x| {
            x.frames_out
        }),
        ("pliant_bytes_out_total", "Bytes sent per port", |x| {
            x.bytes_out
        }),
        ("pliant_arp_in_total", "ARP frames received per port", |x| {
            x.arp_in
        }),
        (
            "pliant_arp_requests_sent_total",
            "ARP requests sent per port",
            |x| x.arp_requests_sent,
        ),
        (
            "pliant_arp_replies_sent_total",
            "ARP replies sent per port",
            |x| x.arp_replies_sent,
        ),
        (
            "pliant_echo_replies_sent_total",
            "Echo replies for pings of the router's inside addresses",
            |x| x.echo_replies_sent,
        ),
    ];
    for (name, help, f) in side_metrics {
        o.header(name, "counter", help);
        for (port, st) in sides {
            o.sample(name, &[("port", port)], f(st));
        }
    }
    type PField = fn(&PortStats) -> u64;
    let port_metrics: [(&str, &str, PField); 4] = [
        (
            "pliant_port_rx_kernel_drops_total",
            "Frames the kernel dropped (RX ring full)",
            |p| p.rx_kernel_drops,
        ),
        (
            "pliant_port_rx_truncated_total",
            "Frames truncated by the RX ring",
            |p| p.rx_truncated,
        ),
        (
            "pliant_port_tx_full_total",
            "Sends refused because the TX ring was full",
            |p| p.tx_dropped_full,
        ),
        (
            "pliant_port_tx_errors_total",
            "Frames the port failed to send",
            |p| p.tx_errors,
        ),
    ];
    for (name, help, f) in port_metrics {
        o.header(name, "counter", help);
        for (port, st) in &s.ports {
            o.sample(name, &[("port", port)], f(st));
        }
    }
    o.header(
        "pliant_drops_total",
        "Dropped frames by reason (runtime and NF)",
        "counter",
    );
    for (reason, n) in s.drops.snapshot() {
        o.sample("pliant_drops_total", &[("reason", reason)], n);
    }
    let gauges: [(&str, &str, u64); 4] = [
        (
            "pliant_flows",
            "Live flows in the flow table",
            s.table.flows as u64,
        ),
        (
            "pliant_timers",
            "Pending flow timers",
            s.table.timers as u64,
        ),
        (
            "pliant_state_bytes",
            "Bytes of per-flow state",
            s.table.state_bytes as u64,
        ),
        (
            "pliant_tombstones",
            "Remembered migrated flows",
            s.table.tombstones as u64,
        ),
    ];
    for (name, help, v) in gauges {
        o.header(name, "gauge", help);
        o.sample(name, &[("nf", s.nf)], v);
    }
    let counters: [(&str, &str, u64); 12] = [
        (
            "pliant_flows_created_total",
            "Flows created",
            s.table.created,
        ),
        (
            "pliant_flows_deleted_total",
            "Flows deleted",
            s.table.deleted,
        ),
        (
            "pliant_flows_refused_full_total",
            "Flow creations refused (table full)",
            s.table.refused_full,
        ),
        (
            "pliant_timers_fired_total",
            "Flow timers dispatched to the NF",
            s.engine.timers_fired,
        ),
        (
            "pliant_rounds_total",
            "Polling rounds of the packet thread",
            s.engine.rounds,
        ),
        (
            "pliant_idle_spins_total",
            "Empty rounds followed by another poll instead of a sleep (spin after traffic)",
            s.engine.idle_spins,
        ),
        (
            "pliant_sleeps_total",
            "Times the packet thread blocked in poll(2)",
            s.engine.sleeps,
        ),
        (
            "pliant_control_requests_total",
            "Control requests served",
            s.engine.control_requests,
        ),
        (
            "pliant_control_errors_total",
            "Control requests refused",
            s.engine.control_errors,
        ),
        (
            "pliant_control_connections_refused_total",
            "Control connections refused: too many served at once",
            s.engine.control_conns_refused,
        ),
        (
            "pliant_control_handshakes_aborted_total",
            "Sealed control connections closed before their handshake finished (probes)",
            s.engine.control_handshakes_aborted,
        ),
        (
            "pliant_control_deposed_refused_total",
            "Control requests refused for a controller term lower than one already seen",
            s.engine.control_deposed_refused,
        ),
    ];
    for (name, help, v) in counters {
        o.header(name, "counter", help);
        o.sample(name, &[("nf", s.nf)], v);
    }
    o.header(
        "pliant_control_term",
        "gauge",
        "Highest controller leadership term seen (0: none)",
    );
    o.sample(
        "pliant_control_term",
        &[("nf", s.nf)],
        s.engine.control_term,
    );
    o.header(
        "pliant_neighbours",
        "gauge",
        "Neighbour table entries per port",
    );
    for (port, n) in s.neighbours {
        o.sample("pliant_neighbours", &[("port", port)], n);
    }
    for (name, n) in s.nf_counters.snapshot() {
        let metric = format!("pliant_nf_{}_total", sanitize(name));
        o.header(&metric, "counter", "NF counter");
        o.sample(&metric, &[("nf", s.nf)], n);
    }
    o.header(
        "pliant_uptime_seconds",
        "gauge",
        "Seconds since the replica started",
    );
    o.sample("pliant_uptime_seconds", &[], format!("{:.3}", s.uptime_s));
    o.s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_labels_and_nf_counters() {
        let mut drops = Counters::default();
        drops.add("ttl_exceeded", 3);
        let mut nf = Counters::default();
        nf.add("nat_mappings_created", 7);
        let engine = EngineStats {
            inside: SideStats {
                frames_in: 5,
                ..Default::default()
            },
            ..Default::default()
        };
        let snap = Snapshot {
            replica: "r\"1",
            nf: "nat",
            engine: &engine,
            ports: [
                ("inside", PortStats::default()),
                ("outside", PortStats::default()),
            ],
            drops: &drops,
            nf_counters: &nf,
            table: &TableStats::default(),
            neighbours: [("inside", 1), ("outside", 2)],
            uptime_s: 1.0,
        };
        let text = render(&snap);
        assert!(
            text.contains("pliant_frames_in_total{replica=\"r\\\"1\",port=\"inside\"} 5\n"),
            "{text}"
        );
        assert!(text.contains("pliant_drops_total{replica=\"r\\\"1\",reason=\"ttl_exceeded\"} 3\n"));
        assert!(text
            .contains("pliant_nf_nat_mappings_created_total{replica=\"r\\\"1\",nf=\"nat\"} 7\n"));
        // Every sample line has a metric name, labels and a value.
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            assert_eq!(line.split(' ').count(), 2, "bad line {line:?}");
        }
    }
}
