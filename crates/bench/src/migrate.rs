//! `bench migrate`: live flow migration between two pliant NAT replicas behind the tc-BPF
//! fabric, with real traffic whose loss and reordering are counted at the receiver.
//!
//! Set-up (as the migration e2e tests): a lab with 2 replicas, each with its own NAT port block
//! and the fabric steering return traffic by port block; flows are steered to r1 by an
//! exception installed before their first packet, so the bench knows where every flow is.
//!
//! 1. *Single flow*, `rounds` times back and forth: one paced UDP flow with sequence numbers
//!    (loss, reordering and the largest inter-arrival gap counted at the server) and one TCP
//!    stream (a byte pattern verified by the server, resets counted), each moved alone. The
//!    pause per move is the destination's: from `migrate_in` (it starts holding the flow) to
//!    the release of the hold (the flow resumes there), the `pause` the source's answer carries.
//!    The receiver's largest gap is the pause as the wire saw it.
//! 2. *Batch*: `batch_flows` UDP flows moved in one request, r1 -> r2 and back; `batch_1000_ms`
//!    is the slower of the two, from the first request to the source's answer (every hold
//!    released).
//!
//! The orchestration is [`pliant_runtime::migrate_client`]'s order (migrate_in, steering,
//! migrate_out) with the flows' NAT aliases taken from the receiver (the source port it sees is
//! the external port), so it does not depend on the replicas' bounded `flows` listing.

use crate::flowgen::{parse_nstat_resets, TcpStream, TcpSummary, UdpFlows, UdpSpec, UdpTotals};
use crate::parse::percentile;
use crate::BenchError;
use pliant_lab::{
    Lab, LabSpec, PliantNf, ReplicaMode, Role, CLIENT_IP, INSIDE_GW_IP, OUTSIDE_GW_IP, SERVER_IP,
};
use pliant_proto::Request;
use pliant_state::FlowKey;
use serde::Serialize;
use serde_json::Value;
use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::PathBuf;
use std::time::{Duration, Instant};

const UDP_SINGLE_SPORT: u16 = 40000;
const UDP_SINGLE_DPORT: u16 = 9000;
const TCP_SPORT: u16 = 40100;
const TCP_DPORT: u16 = 5301;
const BATCH_SPORT_BASE: u16 = 41000;
const BATCH_DPORT: u16 = 9001;
/// NAT port blocks of r1 and r2 (the fabric steers return traffic by block).
const PORT_BLOCKS: [(u16, u16); 2] = [(20000, 29999), (30000, 39999)];

/// The replicas' SCHED_FIFO priority unless told otherwise: a migration pause is a chain of
/// wake-ups across processes, and under the normal scheduler a wake-up on a busy core can wait
/// milliseconds (crates/runtime/src/sched.rs). Low, so it stays below kernel threads that use
/// FIFO themselves.
pub const DEFAULT_REALTIME_PRIORITY: u8 = 20;

#[derive(Clone, Debug)]
pub struct MigrateOpts {
    pub pliant_bin: PathBuf,
    /// Back-and-forth moves of each single flow.
    pub rounds: u32,
    /// Flows moved in one request in the batch phase (0: skip it).
    pub batch_flows: usize,
    /// Datagrams per second of the single UDP flow.
    pub single_pps: f64,
    /// Datagrams per second of each batch flow.
    pub batch_pps_per_flow: f64,
    /// Pause between moves (traffic flows at the new owner meanwhile).
    pub gap: Duration,
    /// Steering at scale: concurrent flows (0: not measured) and exceptions, window seconds.
    pub steering_flows: u32,
    pub steering_exceptions: u32,
    pub steering_window_s: u32,
    /// SCHED_FIFO priority of the replicas (`[replica] realtime_priority`) and of the bench's
    /// orchestrating thread while it moves flows (it plays the controller); `None`: the normal
    /// scheduler everywhere.
    pub realtime_priority: Option<u8>,
    /// How the two replicas reach each other (the peer channel): unix sockets, or TCP over the
    /// lab's management network between private hosts.
    pub transport: pliant_lab::mgmt::Transport,
}

impl MigrateOpts {
    pub fn new(pliant_bin: PathBuf) -> Self {
        MigrateOpts {
            pliant_bin,
            rounds: 20,
            batch_flows: 1000,
            single_pps: 5000.0,
            batch_pps_per_flow: 10.0,
            gap: Duration::from_millis(150),
            steering_flows: 100_000,
            steering_exceptions: 10_000,
            steering_window_s: 3,
            realtime_priority: Some(DEFAULT_REALTIME_PRIORITY),
            transport: pliant_lab::mgmt::Transport::Unix,
        }
    }
}

/// One move as the bench saw it.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct MoveSample {
    pub from: u8,
    pub to: u8,
    pub flows: usize,
    pub moved: u64,
    /// Request to answer, as the orchestrator saw it (migrate_in + steering + migrate_out).
    pub total_ms: f64,
    pub migrate_in_ms: f64,
    pub steer_ms: f64,
    pub migrate_out_ms: f64,
    /// The destination's pause (migrate_in to release) over the moved flows.
    pub pause_us_p50: u64,
    pub pause_us_p99: u64,
    pub pause_us_max: u64,
    /// The longest a held packet waited at the destination (first held packet to release).
    pub held_us_max: u64,
    /// Source: request to export (waiting for its RX rings to drain and refcounts 0).
    pub source_drain_us: u64,
    /// Part of `source_drain_us` spent waiting for the source's emitted frames to leave the
    /// kernel's queues (0 when they had already: the common case).
    pub source_settle_us: u64,
    /// Source: request to `Done` queued (export, ship, one more quiet round).
    pub source_done_us: u64,
    /// Source: `Done` queued to the destination's Ack handled (release + peer round trip).
    pub source_ack_us: u64,
    /// Packets the destination held and released.
    pub released_packets: u64,
    /// Largest inter-arrival gap of the moved UDP flow at the receiver (single UDP moves).
    pub receiver_gap_us: Option<u64>,
    /// The same, over an equally long window just before the move (no migration): the noise
    /// floor of the generator/receiver on this machine.
    pub baseline_gap_us: Option<u64>,
    /// Single moves: whether a probe thread woke >= 0.5 ms late while the move ran (the
    /// virtual CPU or the scheduler stalled; see `sched_probe`).
    pub during_stall: Option<bool>,
    /// Request to answer, for matching against the probe's stalls.
    #[serde(skip)]
    pub window: Option<(Instant, Instant)>,
}

#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct Phase {
    pub moves: Vec<MoveSample>,
    pub udp: UdpTotals,
}

#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct MigrateReport {
    pub bench: &'static str,
    /// The peer channel's transport: `unix` or `tcp`.
    pub transport: &'static str,
    /// Seqs sent and never received at the server, over every generated flow.
    pub packets_lost: Option<u64>,
    /// Arrivals of a new seq below the highest one seen.
    pub packets_reordered: Option<u64>,
    /// Arrivals of a seq already received.
    pub packets_duplicated: Option<u64>,
    /// RSTs: max of the endpoints' own view and their namespaces' TcpOutRsts/TcpEstabResets.
    pub tcp_resets: Option<u64>,
    /// Datagrams the client/server sockets themselves dropped (`UdpRcvbufErrors` deltas): a
    /// receiver too slow for its buffer, not the network. Included in `packets_lost`.
    pub receiver_socket_drops: Option<u64>,
    /// Single-flow moves (UDP and TCP), destination pause, microseconds.
    pub pause_us_p50: Option<f64>,
    pub pause_us_p99: Option<f64>,
    pub pause_us_max: Option<f64>,
    /// Single-flow moves: the longest a packet waited in the destination's hold (first held
    /// packet to release), microseconds — the pause as the traffic saw it.
    pub held_us_p50: Option<f64>,
    pub held_us_p99: Option<f64>,
    /// The slower of the two batch moves (request to every flow resumed).
    pub batch_1000_ms: Option<f64>,
    pub batch_flows: usize,
    pub batch_pause_us_p99: Option<u64>,
    pub flows_migrated: u64,
    pub migrations: u64,
    pub migrations_failed: u64,
    /// The receiver's largest gap around single UDP moves (the pause as the wire saw it).
    pub receiver_gap_us_p50: Option<f64>,
    pub receiver_gap_us_p99: Option<f64>,
    /// The receiver's largest gap in equally long windows without a move (noise floor).
    pub baseline_gap_us_p50: Option<f64>,
    pub baseline_gap_us_p99: Option<f64>,
    /// Drops pliant counted that a migration could cause (NAT, migration, output, TX), per
    /// replica, plus the fabric's drop counters; all should be 0.
    pub pliant_drops: BTreeMap<String, u64>,
    pub fabric_drops: BTreeMap<String, u64>,
    /// Exports (both replicas) that found the source's own earlier output still queued in the
    /// kernel and waited for it (without that wait the destination could overtake it: the
    /// reordering this guards against), and the longest wait in microseconds. Timeouts of that
    /// wait are in `pliant_drops` (`tx_settle_timeouts`, must be 0).
    pub source_output_waits: Option<u64>,
    pub source_output_wait_us_max: Option<u64>,
    /// Frames the kernel dropped because a replica's RX ring was full (the replica thread was
    /// descheduled longer than the ring lasts), per replica and port: on a loaded machine this,
    /// not the migration, is where `packets_lost` comes from.
    pub replica_rx_ring_drops: BTreeMap<String, u64>,
    pub tcp: Option<TcpSummary>,
    pub nstat: BTreeMap<String, u64>,
    pub single: Phase,
    pub batch: Phase,
    /// The forwarding rate with `steering_flows` concurrent flows with and without
    /// `steering_exceptions` exceptions (`null` when skipped).
    pub steering_scale: Option<crate::steering_scale::SteeringScale>,
    pub rounds: u32,
    pub single_pps: f64,
    pub batch_pps_per_flow: f64,
    /// The replicas' and the orchestrating thread's SCHED_FIFO priority (`null`: normal).
    pub realtime_priority: Option<u8>,
    /// The machine's scheduling latency during the single-flow phase, at the same priority:
    /// the floor under every pause above.
    pub sched_probe: Option<crate::sched_probe::SchedProbeReport>,
    /// Single moves whose pause exceeded 1 ms, and how many of them overlapped a stall the
    /// probe saw: the share of the tail the machine, not the migration, accounts for.
    pub moves_over_1ms: u64,
    pub moves_over_1ms_during_stall: u64,
    /// The policy each replica's packet thread reported running under (`fifo:20`, `other:0`).
    pub replica_sched: BTreeMap<String, String>,
    pub build: &'static str,
    /// /proc/loadavg before and after: the machine is shared, and scheduling delays show up
    /// directly in pauses and receiver gaps.
    pub loadavg_start: String,
    pub loadavg_end: String,
    pub errors: Vec<String>,
    pub total_s: f64,
}

pub(crate) fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn progress(msg: &str) {
    eprintln!("[bench migrate] {msg}");
}

fn lab_err(e: impl std::fmt::Display) -> BenchError {
    BenchError::Lab(e.to_string())
}

pub(crate) fn ask(sock: &str, req: &Request) -> Result<Value, BenchError> {
    crate::ha::replica_request(std::path::Path::new(sock), req)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn v4(s: &str) -> Ipv4Addr {
    s.parse().unwrap_or(Ipv4Addr::UNSPECIFIED)
}

/// The two replicas and the fabric's maps.
struct Pair {
    socks: [String; 2],
    names: [String; 2],
    peers: [String; 2],
    maps: pliant_steer::SteerMaps,
    /// SCHED_FIFO for the orchestrating thread during a move (see [`MigrateOpts`]).
    realtime: Option<u8>,
}

impl Pair {
    /// Moves `primaries` (with `aliases`) from replica `src` (0/1) to the other one.
    fn move_flows(
        &mut self,
        src: usize,
        primaries: &[FlowKey],
        aliases: &[FlowKey],
    ) -> Result<MoveSample, BenchError> {
        let dst = 1 - src;
        // Only for the move: threads this thread spawns later must not inherit the policy.
        let _rt = pliant_runtime::sched::RealtimeGuard::new(self.realtime).map_err(lab_err)?;
        let all: Vec<FlowKey> = primaries.iter().chain(aliases).copied().collect();
        // The source's connection is opened (and authenticated) before the switch, as the
        // controller's migration client does: the handshake is not part of the pause.
        let source = pliant_lab::ha::control_client(std::path::Path::new(&self.socks[src]))
            .with_timeout(Duration::from_secs(10));
        let src_link = source.connect().map_err(|e| BenchError::Tool {
            tool: "replica control",
            reason: e.to_string(),
        })?;
        // So is its peer connection to the destination, as the migration client does.
        pliant_runtime::migrate_client::peer_connect(&source, &self.peers[dst]).map_err(|e| {
            BenchError::Tool {
                tool: "peer_connect",
                reason: e,
            }
        })?;
        let t0 = Instant::now();
        ask(
            &self.socks[dst],
            &Request::MigrateIn {
                from: self.names[src].clone(),
                keys: all,
            },
        )?;
        let t1 = Instant::now();
        let entries: Vec<(FlowKey, u32)> = primaries
            .iter()
            .chain(aliases)
            .map(|k| (*k, dst as u32 + 1))
            .collect();
        self.maps
            .set_exceptions(&entries)
            .map_err(|e| BenchError::Lab(format!("steering update: {e}")))?;
        let t2 = Instant::now();
        let r = source
            .call_on(
                src_link,
                &Request::MigrateOut {
                    to: self.peers[dst].clone(),
                    keys: primaries.to_vec(),
                },
                t2,
            )
            .map_err(|e| BenchError::Tool {
                tool: "replica control",
                reason: e.to_string(),
            })?;
        let t3 = Instant::now();
        let failed = r["failed"].as_array().map_or(0, Vec::len);
        if failed > 0 {
            // They stayed at the source: point the steering back there.
            let back: Vec<(FlowKey, u32)> =
                entries.iter().map(|(k, _)| (*k, src as u32 + 1)).collect();
            let _ = self.maps.set_exceptions(&back);
            return Err(BenchError::Tool {
                tool: "migrate_out",
                reason: format!("{failed} flow(s) not moved: {}", r["failed"]),
            });
        }
        let p = &r["pause"];
        let u = |v: &Value| v.as_u64().unwrap_or(0);
        Ok(MoveSample {
            from: src as u8 + 1,
            to: dst as u8 + 1,
            flows: primaries.len(),
            moved: u(&r["moved"]),
            total_ms: ms(t3 - t0),
            migrate_in_ms: ms(t1 - t0),
            steer_ms: ms(t2 - t1),
            migrate_out_ms: ms(t3 - t2),
            pause_us_p50: u(&p["pause_us_p50"]),
            pause_us_p99: u(&p["pause_us_p99"]),
            pause_us_max: u(&p["pause_us_max"]),
            window: Some((t0, t3)),
            during_stall: None,
            held_us_max: u(&p["held_us_max"]),
            source_drain_us: u(&r["drain_us"]),
            source_settle_us: u(&r["settle_us"]),
            source_done_us: u(&r["done_us"]),
            source_ack_us: u(&r["ack_us"]),
            released_packets: u(&p["released_packets"]),
            receiver_gap_us: None,
            baseline_gap_us: None,
        })
    }
}

/// Drop reasons of a replica's `drops` map that cannot be a packet of a migrated flow (IPv4
/// unicast TCP/UDP between the client and the server through the NAT), with why. Every other
/// reason, including ones added later, may have dropped such a packet and must stay 0 across
/// moves: an allow-list of "migration-related" names would miss a new way to lose one.
pub const DROPS_NOT_OF_MOVED_FLOWS: [(&str, &str); 5] = [
    (
        "not_ip",
        "neither IP nor ARP (e.g. LLDP): no flow's packet",
    ),
    (
        "l2_multicast",
        "broadcast/multicast destination MAC (IPv6 ND, mDNS the namespaces send): flows are unicast",
    ),
    (
        "to_router",
        "addressed to the router's own inside address, not forwarded: flows go to the server",
    ),
    ("nat_ipv6_unsupported", "IPv6: the moved flows are IPv4"),
    ("neigh_v6_unknown", "an IPv6 next hop: the moved flows are IPv4"),
];

/// Whether drop reason `name` may have dropped a packet of a migrated flow.
pub fn drop_may_hit_moved_flow(name: &str) -> bool {
    !DROPS_NOT_OF_MOVED_FLOWS.iter().any(|(n, _)| *n == name)
}

fn nstat(lab: &Lab, role: Role) -> BTreeMap<String, u64> {
    lab.exec(role, &["nstat", "-asz"])
        .map(|o| parse_nstat_resets(&o.stdout).into_iter().collect())
        .unwrap_or_default()
}

/// Runs the whole benchmark; a phase that fails carries its error in `errors`.
pub fn run_migrate(opts: &MigrateOpts) -> MigrateReport {
    let start = Instant::now();
    let mut r = MigrateReport {
        bench: "migrate",
        transport: opts.transport.label(),
        rounds: opts.rounds,
        single_pps: opts.single_pps,
        batch_pps_per_flow: opts.batch_pps_per_flow,
        batch_flows: opts.batch_flows,
        realtime_priority: opts.realtime_priority,
        build: if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
        loadavg_start: loadavg(),
        ..Default::default()
    };
    let mut spec = LabSpec::new(ReplicaMode::Pliant {
        config: PliantNf::nat(),
    });
    spec.replicas = 2;
    spec.pliant_bin = Some(opts.pliant_bin.clone());
    spec.realtime_priority = opts.realtime_priority;
    spec.transport = opts.transport;
    // MTU-sized frames with real checksums on the user-space path (as the migration tests).
    spec.disable_offloads = true;
    spec.files.clear();
    progress("bringing up a 2-replica pliant-nat lab");
    let lab = match Lab::up(spec) {
        Ok(l) => l,
        Err(e) => {
            r.errors.push(format!("lab up: {e}"));
            return r;
        }
    };
    if let Err(e) = measure(&lab, opts, &mut r) {
        progress(&format!("failed: {e}"));
        r.errors.push(e.to_string());
    }
    if let Err(e) = lab.down() {
        r.errors.push(format!("teardown: {e}"));
    }
    if opts.steering_flows > 0 && !pliant_lab::cmd::interrupted() {
        let s = crate::steering_scale::run(
            opts.pliant_bin.clone(),
            opts.steering_flows,
            opts.steering_exceptions,
            opts.steering_window_s,
        );
        if let Some(e) = &s.error {
            r.errors.push(format!("steering scale: {e}"));
        }
        r.steering_scale = Some(s);
    }
    r.total_s = start.elapsed().as_secs_f64();
    r.loadavg_end = loadavg();
    r
}

/// Neighbour states in which the kernel sends at once (anything else queues or drops).
fn neigh_usable(ip_neigh_show: &str) -> bool {
    ["REACHABLE", "STALE", "DELAY", "PROBE", "PERMANENT", "NOARP"]
        .iter()
        .any(|s| ip_neigh_show.contains(s))
}

/// Resolves the client's gateway before sequence-numbered traffic starts.
///
/// Why: a fresh namespace has no neighbour entry for its gateway, so the first datagrams of a
/// flow wait in the kernel's ARP queue; when the answer comes, a datagram the sender thread
/// sends meanwhile from another CPU can leave before the queue is flushed. The receiver then
/// counts the queued ones as reordered although no migration happened yet (seen here: seq 2
/// left the client before seq 0 and 1, on the client's own veth). Pinging the gateway makes the
/// kernel resolve it first (the replicas answer ARP and echo requests for the inside gateway
/// address). Only the client: the measured datagrams flow client -> server, and an echo
/// request from the server to the outside address would reach the NAT (`nat_no_mapping`).
pub fn resolve_gateways(lab: &Lab) -> Result<(), BenchError> {
    for (role, gw) in [(Role::Client, INSIDE_GW_IP)] {
        let mut state = String::new();
        for _ in 0..3 {
            // The echo reply does not matter; the ARP exchange it causes does.
            let _ = lab.exec_timeout(
                role,
                &["ping", "-c", "1", "-W", "1", gw],
                Duration::from_secs(3),
            );
            state = lab
                .exec(role, &["ip", "-4", "neigh", "show", gw])
                .map(|o| o.stdout)
                .unwrap_or_default();
            if neigh_usable(&state) {
                break;
            }
        }
        if !neigh_usable(&state) {
            return Err(BenchError::Tool {
                tool: "arp warm-up",
                reason: format!("{role:?} could not resolve its gateway {gw}: {state:?}"),
            });
        }
    }
    Ok(())
}

fn measure(lab: &Lab, opts: &MigrateOpts, r: &mut MigrateReport) -> Result<(), BenchError> {
    let socks: [String; 2] = [1u8, 2].map(|n| {
        lab.replica_socket(n)
            .map(|p| p.display().to_string())
            .unwrap_or_default()
    });
    if socks.iter().any(String::is_empty) {
        return Err(BenchError::Lab("replica control sockets missing".into()));
    }
    let names = [0, 1].map(|i| {
        ask(&socks[i], &Request::Stats)
            .ok()
            .and_then(|v| v["replica"].as_str().map(str::to_string))
            .unwrap_or_default()
    });
    let peers = [0, 1].map(|i| match (opts.transport, socks[i].strip_suffix(".sock")) {
        (pliant_lab::mgmt::Transport::Tcp, _) => format!(
            "{}:{}",
            pliant_lab::mgmt::addr(i as u8 + 1),
            pliant_lab::mgmt::PEER_PORT
        ),
        (_, Some(stem)) => format!("{stem}.peer.sock"),
        (_, None) => format!("{}.peer", socks[i]),
    });
    let maps =
        pliant_steer::SteerMaps::open_pinned(&pliant_steer::lab::pin_dir(&lab.netns(Role::Fabric)))
            .map_err(lab_err)?;
    let mut pair = Pair {
        socks,
        names,
        peers,
        maps,
        realtime: opts.realtime_priority,
    };
    for (i, (lo, hi)) in PORT_BLOCKS.iter().enumerate() {
        ask(
            &pair.socks[i],
            &Request::SetPortBlocks {
                blocks: vec![(*lo, *hi)],
            },
        )?;
        pair.maps
            .set_port_owner(*lo..=*hi, Some(i as u32 + 1))
            .map_err(lab_err)?;
    }
    let fabric0 = pair.maps.stats().map_err(lab_err)?;
    let ns_client = lab.netns(Role::Client);
    let ns_server = lab.netns(Role::Server);
    let nstat0: Vec<BTreeMap<String, u64>> = [Role::Client, Role::Server]
        .iter()
        .map(|x| nstat(lab, *x))
        .collect();
    let (cip, sip, gw) = (v4(CLIENT_IP), v4(SERVER_IP), v4(OUTSIDE_GW_IP));
    resolve_gateways(lab)?;

    // ---------------------------------------------------------------- single flows
    let udp_key = FlowKey::v4(17, cip, UDP_SINGLE_SPORT, sip, UDP_SINGLE_DPORT).0;
    let tcp_key = FlowKey::v4(6, cip, TCP_SPORT, sip, TCP_DPORT).0;
    pair.maps
        .set_exceptions(&[(udp_key, 1), (tcp_key, 1)])
        .map_err(lab_err)?;
    progress(&format!(
        "single flows: UDP at {} pps and a TCP stream, {} moves each",
        opts.single_pps,
        2 * opts.rounds
    ));
    let udp = UdpFlows::start(&UdpSpec {
        client_ns: ns_client.clone(),
        server_ns: ns_server.clone(),
        client_ip: cip,
        server_ip: sip,
        sport_base: UDP_SINGLE_SPORT,
        dport: UDP_SINGLE_DPORT,
        flows: 1,
        pps_per_flow: opts.single_pps,
        payload: 100,
    })?;
    let tcp = TcpStream::start(
        &ns_client,
        &ns_server,
        SocketAddrV4::new(cip, TCP_SPORT),
        SocketAddrV4::new(sip, TCP_DPORT),
        8192,
        Duration::from_millis(1),
    );
    let tcp = match tcp {
        Ok(t) => Some(t),
        Err(e) => {
            r.errors.push(format!("tcp stream: {e}"));
            None
        }
    };
    // 500 us: finer than the 1 ms pause goal, few enough wake-ups (two threads at the
    // replicas' priority) not to slow the moves it watches.
    let probe =
        crate::sched_probe::SchedProbe::start(Duration::from_micros(500), opts.realtime_priority);
    let single = (|| -> Result<(), BenchError> {
        let t = Instant::now();
        while udp.seen_sport(0).is_none()
            || tcp.as_ref().is_some_and(|t| {
                t.counters()
                    .seen_sport
                    .load(std::sync::atomic::Ordering::SeqCst)
                    == 0
            })
        {
            if t.elapsed() > Duration::from_secs(5) {
                return Err(BenchError::Tool {
                    tool: "traffic",
                    reason: "flows did not reach the server through the NAT in 5 s".into(),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        std::thread::sleep(Duration::from_millis(300));
        let udp_alias = FlowKey::v4(
            17,
            gw,
            udp.seen_sport(0).unwrap_or(0),
            sip,
            UDP_SINGLE_DPORT,
        )
        .0;
        let tcp_alias = tcp.as_ref().map(|t| {
            let p = t
                .counters()
                .seen_sport
                .load(std::sync::atomic::Ordering::SeqCst);
            FlowKey::v4(6, gw, p, sip, TCP_DPORT).0
        });
        let mut owner_udp = 0usize;
        let mut owner_tcp = 0usize;
        for round in 0..opts.rounds {
            if pliant_lab::cmd::interrupted() {
                return Err(BenchError::Interrupted);
            }
            udp.take_max_gap_us(0);
            std::thread::sleep(opts.gap);
            let baseline = udp.take_max_gap_us(0);
            let mut s = pair.move_flows(owner_udp, &[udp_key], &[udp_alias]);
            std::thread::sleep(opts.gap);
            if let Ok(s) = &mut s {
                s.receiver_gap_us = Some(udp.take_max_gap_us(0));
                s.baseline_gap_us = Some(baseline);
                owner_udp = 1 - owner_udp;
            }
            record(r, s, round, "udp");
            if let Some(alias) = tcp_alias {
                let s = pair.move_flows(owner_tcp, &[tcp_key], &[alias]);
                if s.is_ok() {
                    owner_tcp = 1 - owner_tcp;
                }
                record(r, s, round, "tcp");
                std::thread::sleep(opts.gap);
            }
        }
        Ok(())
    })();
    match probe.and_then(crate::sched_probe::SchedProbe::stop) {
        Ok(p) => {
            for m in &mut r.single.moves {
                m.during_stall = m.window.map(|(a, b)| p.stalled_during(a, b));
            }
            r.sched_probe = Some(p.report);
        }
        Err(e) => r.errors.push(format!("scheduling probe: {e}")),
    }
    if let Err(e) = single {
        r.errors.push(format!("single-flow phase: {e}"));
    }
    let (udp_tot, errs) = udp.stop(Duration::from_millis(300));
    r.errors
        .extend(errs.into_iter().map(|e| format!("udp: {e}")));
    r.single.udp = udp_tot;
    if let Some(t) = tcp {
        let sum = t.stop(Duration::from_secs(15));
        if !sum.complete {
            r.errors.push(format!("tcp stream incomplete: {sum:?}"));
        }
        r.tcp = Some(sum);
    }

    // ---------------------------------------------------------------- batch
    if opts.batch_flows > 0 {
        if let Err(e) = batch_phase(lab, opts, &mut pair, r) {
            r.errors.push(format!("batch phase: {e}"));
        }
    }

    // ---------------------------------------------------------------- totals
    let nstat1: Vec<BTreeMap<String, u64>> = [Role::Client, Role::Server]
        .iter()
        .map(|x| nstat(lab, *x))
        .collect();
    let mut out_rsts = 0u64;
    let mut estab_resets = 0u64;
    let mut rcvbuf_drops = 0u64;
    for (i, who) in ["client", "server"].iter().enumerate() {
        for (k, v1) in &nstat1[i] {
            let d = v1.saturating_sub(nstat0[i].get(k).copied().unwrap_or(0));
            if k == "TcpOutRsts" {
                out_rsts += d;
            }
            if k == "TcpEstabResets" {
                estab_resets += d;
            }
            if k == "UdpRcvbufErrors" {
                rcvbuf_drops += d;
            }
            r.nstat.insert(format!("{who}.{k}"), d);
        }
    }
    let app_resets = r.tcp.as_ref().map_or(0, |t| t.resets_seen);
    r.tcp_resets = Some(app_resets.max(out_rsts).max(estab_resets));
    r.receiver_socket_drops = Some(rcvbuf_drops);
    r.packets_lost = Some(r.single.udp.lost + r.batch.udp.lost);
    r.packets_reordered = Some(r.single.udp.reordered + r.batch.udp.reordered);
    r.packets_duplicated = Some(r.single.udp.duplicated + r.batch.udp.duplicated);
    for (i, s) in pair.socks.iter().enumerate() {
        match ask(s, &Request::Stats) {
            Ok(st) => {
                if let Some(d) = st["drops"].as_object() {
                    for (k, v) in d {
                        if drop_may_hit_moved_flow(k) {
                            r.pliant_drops
                                .insert(format!("r{}.{k}", i + 1), v.as_u64().unwrap_or(0));
                        }
                    }
                }
                for c in [
                    "hold_overflow",
                    "forward_failed",
                    "forward_loops",
                    "late_after_release",
                    "tx_settle_timeouts",
                ] {
                    let v = st["migration"][c].as_u64().unwrap_or(0);
                    r.pliant_drops
                        .insert(format!("r{}.migration.{c}", i + 1), v);
                }
                for side in ["inside", "outside"] {
                    let d = st["ports"][side]["rx_kernel_drops"].as_u64().unwrap_or(0);
                    r.replica_rx_ring_drops
                        .insert(format!("r{}.{side}", i + 1), d);
                }
                let sch = &st["engine"]["sched"];
                r.replica_sched.insert(
                    format!("r{}", i + 1),
                    format!(
                        "{}:{}",
                        sch["policy"].as_str().unwrap_or("?"),
                        sch["priority"]
                    ),
                );
                let m = &st["migration"];
                let waits = m["tx_settle_waits"].as_u64().unwrap_or(0);
                let wmax = m["tx_settle_wait_us_max"].as_u64().unwrap_or(0);
                r.source_output_waits = Some(r.source_output_waits.unwrap_or(0) + waits);
                r.source_output_wait_us_max =
                    Some(r.source_output_wait_us_max.unwrap_or(0).max(wmax));
            }
            Err(e) => r.errors.push(format!("stats r{}: {e}", i + 1)),
        }
    }
    match pair.maps.stats() {
        Ok(f1) => {
            let d = f1.since(&fabric0);
            for (k, v) in d.named() {
                if k.starts_with("drop") || k.contains("fail") {
                    r.fabric_drops.insert(k.to_string(), v);
                }
            }
        }
        Err(e) => r.errors.push(format!("fabric stats: {e}")),
    }
    summarize(r);
    Ok(())
}

fn record(r: &mut MigrateReport, s: Result<MoveSample, BenchError>, round: u32, what: &str) {
    r.migrations += 1;
    match s {
        Ok(s) => {
            r.flows_migrated += s.moved;
            r.single.moves.push(s);
        }
        Err(e) => {
            r.migrations_failed += 1;
            r.errors.push(format!("round {round} {what}: {e}"));
        }
    }
}

fn batch_phase(
    lab: &Lab,
    opts: &MigrateOpts,
    pair: &mut Pair,
    r: &mut MigrateReport,
) -> Result<(), BenchError> {
    let n = opts.batch_flows;
    let (cip, sip, gw) = (v4(CLIENT_IP), v4(SERVER_IP), v4(OUTSIDE_GW_IP));
    let primaries: Vec<FlowKey> = (0..n)
        .map(|i| FlowKey::v4(17, cip, BATCH_SPORT_BASE + i as u16, sip, BATCH_DPORT).0)
        .collect();
    let pre: Vec<(FlowKey, u32)> = primaries.iter().map(|k| (*k, 1)).collect();
    pair.maps.set_exceptions(&pre).map_err(lab_err)?;
    progress(&format!(
        "batch: {n} UDP flows at {} pps each, moved r1 -> r2 -> r1 in one request each",
        opts.batch_pps_per_flow
    ));
    let flows = UdpFlows::start(&UdpSpec {
        client_ns: lab.netns(Role::Client),
        server_ns: lab.netns(Role::Server),
        client_ip: cip,
        server_ip: sip,
        sport_base: BATCH_SPORT_BASE,
        dport: BATCH_DPORT,
        flows: n,
        pps_per_flow: opts.batch_pps_per_flow,
        payload: 64,
    })?;
    let res = (|| -> Result<(), BenchError> {
        let t = Instant::now();
        let wait = Duration::from_secs_f64(3.0 + 3.0 / opts.batch_pps_per_flow);
        while (0..n).any(|i| flows.seen_sport(i).is_none()) {
            if t.elapsed() > wait {
                let missing = (0..n).filter(|i| flows.seen_sport(*i).is_none()).count();
                return Err(BenchError::Tool {
                    tool: "traffic",
                    reason: format!("{missing} of {n} flows never reached the server"),
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let aliases: Vec<FlowKey> = (0..n)
            .map(|i| FlowKey::v4(17, gw, flows.seen_sport(i).unwrap_or(0), sip, BATCH_DPORT).0)
            .collect();
        std::thread::sleep(Duration::from_millis(300));
        for (k, src) in [0usize, 1].into_iter().enumerate() {
            let s = pair.move_flows(src, &primaries, &aliases);
            r.migrations += 1;
            match s {
                Ok(s) => {
                    progress(&format!(
                        "  batch move {}: {} flows in {:.1} ms (pause p99 {} us)",
                        k + 1,
                        s.moved,
                        s.total_ms,
                        s.pause_us_p99
                    ));
                    if s.moved != n as u64 {
                        r.errors.push(format!(
                            "batch move {}: moved {} of {n} flows",
                            k + 1,
                            s.moved
                        ));
                    }
                    r.flows_migrated += s.moved;
                    r.batch.moves.push(s);
                }
                Err(e) => {
                    r.migrations_failed += 1;
                    return Err(e);
                }
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        Ok(())
    })();
    let (tot, errs) = flows.stop(Duration::from_millis(500));
    r.errors
        .extend(errs.into_iter().map(|e| format!("batch udp: {e}")));
    r.batch.udp = tot;
    res
}

fn summarize(r: &mut MigrateReport) {
    let pauses: Vec<f64> = r
        .single
        .moves
        .iter()
        .map(|m| m.pause_us_max as f64)
        .collect();
    r.pause_us_p50 = percentile(&pauses, 50.0);
    r.pause_us_p99 = percentile(&pauses, 99.0);
    r.pause_us_max = percentile(&pauses, 100.0);
    let held: Vec<f64> = r
        .single
        .moves
        .iter()
        .map(|m| m.held_us_max as f64)
        .collect();
    let slow = r.single.moves.iter().filter(|m| m.pause_us_max > 1000);
    r.moves_over_1ms = slow.clone().count() as u64;
    r.moves_over_1ms_during_stall = slow.filter(|m| m.during_stall == Some(true)).count() as u64;
    r.held_us_p50 = percentile(&held, 50.0);
    r.held_us_p99 = percentile(&held, 99.0);
    let gaps: Vec<f64> = r
        .single
        .moves
        .iter()
        .filter_map(|m| m.receiver_gap_us.map(|g| g as f64))
        .collect();
    let base: Vec<f64> = r
        .single
        .moves
        .iter()
        .filter_map(|m| m.baseline_gap_us.map(|g| g as f64))
        .collect();
    r.baseline_gap_us_p50 = percentile(&base, 50.0);
    r.baseline_gap_us_p99 = percentile(&base, 99.0);
    r.receiver_gap_us_p50 = percentile(&gaps, 50.0);
    r.receiver_gap_us_p99 = percentile(&gaps, 99.0);
    let full: Vec<&MoveSample> = r
        .batch
        .moves
        .iter()
        .filter(|m| m.moved as usize == r.batch_flows)
        .collect();
    if !full.is_empty() && full.len() == r.batch.moves.len() {
        r.batch_1000_ms = full.iter().map(|m| m.total_ms).reduce(f64::max);
        r.batch_pause_us_p99 = full.iter().map(|m| m.pause_us_p99).max();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(pause: u64, gap: Option<u64>) -> MoveSample {
        MoveSample {
            moved: 1,
            pause_us_max: pause,
            receiver_gap_us: gap,
            ..Default::default()
        }
    }

    #[test]
    fn summary_takes_percentiles_and_refuses_partial_batches() {
        let mut r = MigrateReport {
            batch_flows: 1000,
            ..Default::default()
        };
        r.single.moves = (1..=100).map(|i| sample(i * 10, Some(i))).collect();
        r.batch.moves = vec![
            MoveSample {
                moved: 1000,
                total_ms: 40.0,
                pause_us_p99: 30_000,
                ..Default::default()
            },
            MoveSample {
                moved: 999,
                total_ms: 20.0,
                ..Default::default()
            },
        ];
        summarize(&mut r);
        assert_eq!(r.pause_us_p50, Some(500.0));
        assert_eq!(r.pause_us_p99, Some(990.0));
        assert_eq!(r.receiver_gap_us_p99, Some(99.0));
        assert_eq!((r.moves_over_1ms, r.moves_over_1ms_during_stall), (0, 0));
        r.single.moves[0].pause_us_max = 4000;
        r.single.moves[0].during_stall = Some(true);
        r.single.moves[1].pause_us_max = 2000;
        r.single.moves[1].during_stall = Some(false);
        summarize(&mut r);
        assert_eq!((r.moves_over_1ms, r.moves_over_1ms_during_stall), (2, 1));
        // A move that left a flow behind is not a 1000-flow move.
        assert_eq!(r.batch_1000_ms, None);
        r.batch.moves.pop();
        summarize(&mut r);
        assert_eq!(r.batch_1000_ms, Some(40.0));
        assert_eq!(r.batch_pause_us_p99, Some(30_000));
    }

    #[test]
    fn json_contract_fields_are_present() {
        let v = serde_json::to_value(MigrateReport::default()).expect("json");
        for k in [
            "packets_lost",
            "packets_reordered",
            "packets_duplicated",
            "tcp_resets",
            "pause_us_p50",
            "pause_us_p99",
            "batch_1000_ms",
            "flows_migrated",
            "steering_scale",
        ] {
            assert!(v.get(k).is_some(), "missing {k}");
        }
    }

    #[test]
    fn only_resolved_neighbours_count_as_usable() {
        assert!(neigh_usable(
            "10.77.1.1 dev client0 lladdr 02:70:6c:00:01:01 REACHABLE\n"
        ));
        assert!(neigh_usable(
            "10.77.1.1 dev client0 lladdr 02:70:6c:00:01:01 STALE\n"
        ));
        assert!(!neigh_usable("10.77.1.1 dev client0 INCOMPLETE\n"));
        assert!(!neigh_usable("10.77.1.1 dev client0 FAILED\n"));
        assert!(!neigh_usable(""));
    }

    #[test]
    fn every_drop_reason_counts_unless_it_cannot_be_a_moved_flows_packet() {
        for r in [
            "migrate_hold_overflow",
            "nat_no_mapping",
            "tx_full",
            "ttl_exceeded",
        ] {
            assert!(drop_may_hit_moved_flow(r), "{r}");
        }
        // A reason nobody listed yet counts: the check is an exemption list, not an allow-list.
        assert!(drop_may_hit_moved_flow("some_future_reason"));
        for (r, why) in DROPS_NOT_OF_MOVED_FLOWS {
            assert!(!drop_may_hit_moved_flow(r), "{r}");
            assert!(!why.is_empty());
        }
    }
}
