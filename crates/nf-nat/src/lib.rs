//! pliant-nf-nat: port-translating source NAT (NAPT) for TCP, UDP and ICMP echo, IPv4.
//!
//! Packets arriving on the inside port are translated to `external_ip` and an external port
//! (the echo identifier for ICMP) taken from a per-protocol pool; replies arriving on the outside
//! port find the same flow through an alias keyed by the translated tuple and are translated back.
//!
//! State lives in the Split/Merge flow table (one flow per mapping, keyed by the inside tuple,
//! plus one alias for the external tuple) so that a mapping can later be moved or replicated.
//! Because replies are looked up by the whole external tuple, one external port can back
//! several mappings whose remote endpoints differ (as Linux masquerade does); the pool counts
//! references per port. An inside endpoint keeps its external port for all its destinations
//! while its mappings live (endpoint-independent mapping), and its source port when free.
//! The port pool is per-replica: with `port_blocks` (config or the `set_port_blocks` control
//! request) each replica allocates only from its own blocks, and the fabric steers return
//! traffic by destination port to the block's owner. A migrated mapping keeps its external port
//! (the tuple the remote side knows); the owner keeps that port reserved ("lent") while the
//! mapping lives elsewhere, so it is never handed to a second flow, and the controller steers
//! the mapping's external tuple (its alias key) to the new owner with an exception.
//!
//! Expiry: one flow timer per mapping, re-armed lazily. The hot path only stamps `last_seen_ms`
//! in the flow; when the timer fires the mapping is removed if it has been idle for its timeout,
//! else the timer is re-armed for the remainder. So a busy flow touches the timer heap about once
//! per timeout, not once per packet.
//!
//! ICMP errors (unreachable, time exceeded, parameter problem) about mapped flows are
//! translated, quoted packet included (`icmp_err.rs`).
//!
//! Not handled (dropped and counted): IPv6 (`nat_ipv6_unsupported`), protocols other than
//! TCP/UDP/ICMP (`nat_unsupported_proto`), other ICMP types (`nat_icmp_unsupported`),
//! non-first fragments (`nat_fragment`; the runtime reassembles IPv4 fragments before the NF,
//! so these only come from embedders that feed fragments directly).

pub mod ftmb;
mod guard;
mod icmp_err;
mod pool;
mod xlate;

pub use pool::PortPool;

use pliant_net::{proto, FlowKey};
use pliant_runtime::{Ctx, NetworkFunction, Packet, Side};
use pliant_state::{StateError, TimerId};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

/// `[nat]` section of the replica config.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Source address of translated packets (usually the replica's outside address).
    pub external_ip: Ipv4Addr,
    /// First external port (and ICMP identifier) handed out, inclusive.
    #[serde(default = "d_port_min")]
    pub port_min: u16,
    /// Last external port handed out, inclusive.
    #[serde(default = "d_port_max")]
    pub port_max: u16,
    /// External port blocks `[[lo, hi], ...]` (inclusive) this replica allocates from; when
    /// set they replace `port_min..=port_max`. Blocks of different replicas must not overlap.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub port_blocks: Vec<(u16, u16)>,
    /// Idle timeout of an established TCP mapping.
    #[serde(default = "d_tcp_est")]
    pub tcp_established_timeout_s: u64,
    /// Idle timeout of a TCP mapping that is still opening (SYN seen, not yet established).
    #[serde(default = "d_tcp_trans")]
    pub tcp_transitory_timeout_s: u64,
    /// Idle timeout of a TCP mapping after FIN or RST.
    #[serde(default = "d_tcp_closing")]
    pub tcp_closing_timeout_s: u64,
    #[serde(default = "d_udp")]
    pub udp_timeout_s: u64,
    #[serde(default = "d_icmp")]
    pub icmp_timeout_s: u64,
    /// Idle timeout of a TCP mapping whose SYN has not been answered yet (embryonic): a SYN
    /// flood's mappings end this soon even without pool pressure.
    #[serde(default = "d_embryonic")]
    pub tcp_embryonic_timeout_s: u64,
    /// Live mappings one inside address may hold at most (all protocols); 0 = no limit.
    /// Beyond it new flows of that host are refused (`nat_host_quota`).
    #[serde(default)]
    pub max_mappings_per_host: u32,
}

fn d_port_min() -> u16 {
    20000
}
fn d_port_max() -> u16 {
    59999
}
fn d_tcp_est() -> u64 {
    7440
}
fn d_tcp_trans() -> u64 {
    60
}
fn d_tcp_closing() -> u64 {
    10
}
fn d_udp() -> u64 {
    30
}
fn d_icmp() -> u64 {
    30
}
fn d_embryonic() -> u64 {
    20
}

impl Config {
    /// A config with the defaults and the given external address.
    pub fn with_external_ip(external_ip: Ipv4Addr) -> Config {
        Config {
            external_ip,
            port_min: d_port_min(),
            port_max: d_port_max(),
            port_blocks: Vec::new(),
            tcp_established_timeout_s: d_tcp_est(),
            tcp_transitory_timeout_s: d_tcp_trans(),
            tcp_closing_timeout_s: d_tcp_closing(),
            udp_timeout_s: d_udp(),
            icmp_timeout_s: d_icmp(),
            tcp_embryonic_timeout_s: d_embryonic(),
            max_mappings_per_host: 0,
        }
    }

    /// The port blocks this config allocates from: `port_blocks`, else `port_min..=port_max`.
    pub fn blocks(&self) -> Vec<(u16, u16)> {
        if self.port_blocks.is_empty() {
            vec![(self.port_min, self.port_max)]
        } else {
            self.port_blocks.clone()
        }
    }

    /// Idle timeout, in seconds, of a mapping of protocol `p` in TCP phase `phase`.
    pub fn idle_timeout_s(&self, p: u8, phase: TcpPhase) -> u64 {
        match (p, phase) {
            (proto::TCP, TcpPhase::Established) => self.tcp_established_timeout_s,
            (proto::TCP, TcpPhase::Closing) => self.tcp_closing_timeout_s,
            (proto::TCP, _) => self.tcp_transitory_timeout_s,
            (proto::UDP, _) => self.udp_timeout_s,
            _ => self.icmp_timeout_s,
        }
    }

    /// Idle timeout, in seconds, of mapping `m`: [`Config::idle_timeout_s`], except that a
    /// TCP mapping still opening and never answered gets the embryonic timeout (if shorter).
    pub fn mapping_timeout_s(&self, m: &Mapping) -> u64 {
        let t = self.idle_timeout_s(m.proto, m.phase);
        if m.proto == proto::TCP && m.phase == TcpPhase::Opening && !m.replied {
            t.min(self.tcp_embryonic_timeout_s)
        } else {
            t
        }
    }

    /// Whether an inside host that holds `held` mappings in one of `parts` separately counted
    /// sets (the FTMB NAT's workers, each its own mappings; 1 for the normal NAT) may open
    /// another under `max_mappings_per_host`: each set gets `ceil(max / parts)`.
    pub fn host_quota_allows(&self, held: u32, parts: u32) -> bool {
        let max = self.max_mappings_per_host;
        max == 0 || held < max.div_ceil(parts.max(1))
    }

    pub fn validate(&self) -> Result<(), String> {
        if self.port_min == 0 || self.port_min > self.port_max {
            return Err(format!(
                "nat: port range {}-{} is empty or starts at 0",
                self.port_min, self.port_max
            ));
        }
        validate_blocks(&self.port_blocks)?;
        let timeouts = [
            ("tcp_established_timeout_s", self.tcp_established_timeout_s),
            ("tcp_transitory_timeout_s", self.tcp_transitory_timeout_s),
            ("tcp_closing_timeout_s", self.tcp_closing_timeout_s),
            ("udp_timeout_s", self.udp_timeout_s),
            ("icmp_timeout_s", self.icmp_timeout_s),
            ("tcp_embryonic_timeout_s", self.tcp_embryonic_timeout_s),
        ];
        for (name, v) in timeouts {
            // Zero would re-arm a timer at the same instant forever; a day-long bound keeps
            // Instant arithmetic far from overflow.
            if v == 0 || v > 30 * 24 * 3600 {
                return Err(format!("nat: {name} = {v} must be between 1 and 2592000"));
            }
        }
        if self.external_ip.is_unspecified() || self.external_ip.is_broadcast() {
            return Err(format!(
                "nat: external_ip {} is not a unicast address",
                self.external_ip
            ));
        }
        Ok(())
    }
}

/// Refuses blocks with a zero port, `lo > hi`, or more than 4096 blocks.
pub fn validate_blocks(blocks: &[(u16, u16)]) -> Result<(), String> {
    if blocks.len() > 4096 {
        return Err(format!("nat: {} port blocks (at most 4096)", blocks.len()));
    }
    for &(lo, hi) in blocks {
        if lo == 0 || lo > hi {
            return Err(format!(
                "nat: port block [{lo}, {hi}] is empty or starts at 0"
            ));
        }
    }
    Ok(())
}

/// Wall-clock milliseconds since the Unix epoch (0 if the clock is before it).
fn wall_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// TCP phase of a mapping, which selects its idle timeout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum TcpPhase {
    /// Not TCP.
    None,
    /// First packets seen; no reply with ACK yet.
    Opening,
    Established,
    /// FIN or RST seen.
    Closing,
}

/// Per-mapping flow state.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Mapping {
    pub proto: u8,
    pub inside_addr: Ipv4Addr,
    pub inside_port: u16,
    pub remote_addr: Ipv4Addr,
    pub remote_port: u16,
    /// External port (ICMP: echo identifier) on `external_ip`.
    pub external_port: u16,
    pub phase: TcpPhase,
    /// Whether a packet from the outside has been seen.
    pub replied: bool,
    /// Last packet, in wall-clock ms since the Unix epoch (CLOCK_REALTIME), so the value means
    /// the same on the replica a mapping migrates to (an `Instant` offset would not). Soft
    /// state: stamping it is not a modification (put_flow(.., false)), so checkpoints do not
    /// ship flows just because they are busy.
    pub last_seen_ms: u64,
}

impl Mapping {
    /// The mapping a new inside flow opens with `pkt` (see [`opens_mapping`]) on external
    /// port `ext`.
    pub(crate) fn opened_by(
        pkt: &Packet,
        src: Ipv4Addr,
        dst: Ipv4Addr,
        ext: u16,
        now_ms: u64,
    ) -> Mapping {
        let phase = if pkt.meta.proto == proto::TCP {
            next_phase(TcpPhase::Opening, pkt.meta.tcp_flags, false, Side::Inside)
        } else {
            TcpPhase::None
        };
        Mapping {
            proto: pkt.meta.proto,
            inside_addr: src,
            inside_port: pkt.meta.sport,
            remote_addr: dst,
            remote_port: pkt.meta.dport,
            external_port: ext,
            phase,
            replied: false,
            last_seen_ms: now_ms,
        }
    }

    /// Whether the mapping may be evicted under pool pressure: it carries no confirmed
    /// two-way traffic (conntrack's "not assured"). TCP: not established (a SYN never
    /// answered, or answered and never acknowledged, or closing); UDP/ICMP: never answered.
    pub fn evictable(&self) -> bool {
        if self.proto == proto::TCP {
            self.phase != TcpPhase::Established
        } else {
            !self.replied
        }
    }

    /// The inside endpoint (protocol, address, port or echo identifier).
    pub(crate) fn endpoint(&self) -> Endpoint {
        (self.proto, self.inside_addr, self.inside_port)
    }

    /// The inside key (what the mapping's inside packets are keyed by).
    pub(crate) fn inside_key(&self) -> FlowKey {
        FlowKey::v4(
            self.proto,
            self.inside_addr,
            self.inside_port,
            self.remote_addr,
            self.remote_port,
        )
        .0
    }

    /// The outside key on external address `ext` (what replies are keyed by, the alias):
    /// ICMP echo keys carry the identifier as both "ports", so the reply's key has the
    /// translated identifier on the remote side too.
    pub(crate) fn outside_key(&self, ext: Ipv4Addr) -> FlowKey {
        outside_key(
            self.proto,
            ext,
            self.external_port,
            self.remote_addr,
            self.remote_port,
        )
    }

    /// An inside packet (source `src`:`sport`, TCP flags `flags`) of this mapping at `now_ms`:
    /// stamps it and advances the TCP phase. Err (the drop reason, nothing changed) if the
    /// packet is not from the inside endpoint: the key is direction-normalised, so this
    /// refuses, say, an inside host spoofing the remote side.
    pub(crate) fn outbound_packet(
        &mut self,
        src: Ipv4Addr,
        sport: u16,
        flags: u8,
        now_ms: u64,
    ) -> Result<(), &'static str> {
        if self.inside_addr != src || self.inside_port != sport {
            return Err("nat_direction_mismatch");
        }
        self.last_seen_ms = now_ms;
        if self.proto == proto::TCP {
            self.phase = next_phase(self.phase, flags, self.replied, Side::Inside);
        }
        Ok(())
    }

    /// A reply `pkt` found this mapping by its outside key at `now_ms`: stamps it, marks it
    /// replied and advances the TCP phase. Err (the drop reason, nothing changed) if the
    /// reply is not addressed to the mapping's external port and protocol.
    pub(crate) fn inbound_packet(&mut self, pkt: &Packet, now_ms: u64) -> Result<(), &'static str> {
        if self.external_port != pkt.meta.dport || self.proto != pkt.meta.proto {
            return Err("nat_no_mapping");
        }
        self.last_seen_ms = now_ms;
        self.replied = true;
        if self.proto == proto::TCP {
            self.phase = next_phase(self.phase, pkt.meta.tcp_flags, true, Side::Outside);
        }
        Ok(())
    }
}

/// The outside key of a mapping of protocol `p` on external endpoint `ext`:`port` towards
/// remote `remote`:`remote_port`; see [`Mapping::outside_key`]. Two mappings may share an
/// external port exactly when these keys differ.
fn outside_key(p: u8, ext: Ipv4Addr, port: u16, remote: Ipv4Addr, remote_port: u16) -> FlowKey {
    let remote_port = if p == proto::ICMP { port } else { remote_port };
    FlowKey::v4(p, ext, port, remote, remote_port).0
}

/// Whether an inside packet without a mapping may open one; Err is the drop reason.
pub(crate) fn opens_mapping(pkt: &Packet) -> Result<(), &'static str> {
    if pkt.meta.proto == proto::ICMP && pkt.meta.icmp_type != ICMP_ECHO_REQUEST {
        // An echo reply from inside opens nothing.
        return Err("nat_no_mapping");
    }
    Ok(())
}

/// The flow timer id of the idle-expiry timer.
pub const TIMER_IDLE: TimerId = 1;

const TCP_FIN: u8 = 0x01;
const TCP_SYN: u8 = 0x02;
const TCP_RST: u8 = 0x04;
const TCP_ACK: u8 = 0x10;
const ICMP_ECHO_REPLY: u8 = 0;
const ICMP_ECHO_REQUEST: u8 = 8;

/// In-use ports the sharing scan looks at for one new mapping before falling back to
/// eviction: bounds the work a flood towards one remote endpoint (which holds a tuple on
/// every port) can cause per packet, like conntrack's bounded tuple search.
const SHARE_SCAN: usize = 128;

/// An endpoint (an inside one, or a remote one in `ScanBackoff`): protocol, address, port
/// (ICMP: echo identifier).
type Endpoint = (u8, Ipv4Addr, u16);

pub struct Nat {
    cfg: Config,
    epoch: Instant,
    /// Wall-clock ms at `epoch`: `now_ms` = this + (now - epoch), so the fake clocks of tests
    /// still drive expiry while the stamps stay comparable across replicas.
    epoch_wall_ms: u64,
    tcp: PortPool,
    udp: PortPool,
    icmp: PortPool,
    /// Abuse defences: evictable mappings in creation order, per-host mapping counts.
    guard: guard::Guard,
    /// Endpoint-independent mapping: an inside endpoint's external port and how many of its
    /// live mappings use it. Its next destinations get that port too while the tuple is free.
    eim: HashMap<Endpoint, (u16, u32)>,
    /// Mappings counted in the pools and `eim` (created + imported - ended). It differs from
    /// the flow table's size after mappings left it unseen (exported by a migration); the
    /// next new mapping then resyncs both from the table first.
    tracked: usize,
    /// The last remote endpoint whose sharing scan found nothing (see [`ScanBackoff`]).
    share_backoff: ScanBackoff,
}

/// After a sharing scan towards a remote endpoint found no port (every port it looked at
/// already has a tuple towards that remote: a flood towards one server fills them all), the
/// next new mappings towards the same remote try eviction before scanning again, for a number
/// of mappings that doubles with each scan that fails again (up to
/// [`ScanBackoff::MAX_SKIP`]). In a SYN flood the scan was most of the NAT's work per packet
/// (`SHARE_SCAN` table lookups for each SYN, ~60 % of the replica's samples), enough to fill
/// its receive ring with CPU to spare. Outcomes stay those of the full procedure: when eviction
/// finds nothing the scan still runs, so no flow is refused that a scan could have placed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct ScanBackoff {
    remote: Option<Endpoint>,
    /// New mappings towards `remote` that go to eviction first.
    skip: u32,
    /// `skip` after the next failed scan.
    next: u32,
}

impl ScanBackoff {
    const MAX_SKIP: u32 = 1024;

    /// Whether this mapping towards `remote` should try eviction before the scan.
    fn evict_first(&mut self, remote: Endpoint) -> bool {
        if self.remote != Some(remote) || self.skip == 0 {
            return false;
        }
        self.skip -= 1;
        true
    }

    /// A scan towards `remote` found no port.
    fn failed(&mut self, remote: Endpoint) {
        if self.remote != Some(remote) {
            *self = ScanBackoff {
                remote: Some(remote),
                skip: 0,
                next: 1,
            };
        }
        self.skip = self.next;
        self.next = (self.next * 2).min(Self::MAX_SKIP);
    }

    /// A scan towards `remote` found a port: scan first again.
    fn found(&mut self, remote: Endpoint) {
        if self.remote == Some(remote) {
            *self = ScanBackoff::default();
        }
    }
}

impl Nat {
    pub fn new(cfg: Config) -> Result<Self, String> {
        Self::with_clock(cfg, Instant::now(), wall_ms())
    }

    /// A NAT whose clock reads `wall_ms` at `epoch` (tests pin both).
    pub fn with_clock(cfg: Config, epoch: Instant, wall_ms: u64) -> Result<Self, String> {
        cfg.validate()?;
        let blocks = cfg.blocks();
        Ok(Nat {
            tcp: PortPool::from_blocks(&blocks),
            udp: PortPool::from_blocks(&blocks),
            icmp: PortPool::from_blocks(&blocks),
            guard: guard::Guard::default(),
            eim: HashMap::new(),
            tracked: 0,
            share_backoff: ScanBackoff::default(),
            cfg,
            epoch,
            epoch_wall_ms: wall_ms,
        })
    }

    /// Replaces the port blocks. Ports in use (live mappings, and ports lent to mappings that
    /// migrated away) stay reserved when the new blocks contain them, so no port is handed
    /// to a second flow.
    fn replace_blocks(&mut self, ctx: &mut Ctx<Mapping>, blocks: &[(u16, u16)]) {
        // First make the old pools' lent counts exact (mappings exported since).
        let live = self.resync(ctx);
        for (i, p) in [proto::TCP, proto::UDP, proto::ICMP]
            .into_iter()
            .enumerate()
        {
            let mut fresh = PortPool::from_blocks(blocks);
            fresh.resync(&live[i]);
            let old = self.pool(p);
            let lent: Vec<(u16, u32)> = old
                .in_use_ports()
                .map(|port| (port, old.lent(port)))
                .filter(|&(_, n)| n > 0)
                .collect();
            for (port, n) in lent {
                fresh.lend(port, n);
            }
            fresh.exhausted = old.exhausted;
            fresh.bad_release = old.bad_release;
            fresh.foreign_release = old.foreign_release;
            *self.pool(p) = fresh;
        }
        self.cfg.port_blocks = blocks.to_vec();
    }

    /// Rebuilds the pools' reference counts and the endpoint index from the flow table (after
    /// mappings left it unseen: references beyond the live mappings become lent, see
    /// [`PortPool::resync`]). O(mappings); returns the live mappings per port, TCP/UDP/ICMP.
    fn resync(&mut self, ctx: &mut Ctx<Mapping>) -> [Vec<u32>; 3] {
        let mut live = [
            vec![0u32; 1 << 16],
            vec![0u32; 1 << 16],
            vec![0u32; 1 << 16],
        ];
        self.eim.clear();
        self.tracked = 0;
        for k in ctx.flows.keys() {
            if let Some(m) = ctx.flows.peek(&k) {
                live[guard::qi(m.proto)][usize::from(m.external_port)] += 1;
                let (ep, port) = (m.endpoint(), m.external_port);
                self.eim_add(ep, port);
                self.tracked += 1;
            }
        }
        self.tcp.resync(&live[0]);
        self.udp.resync(&live[1]);
        self.icmp.resync(&live[2]);
        ctx.count("nat_pool_resyncs", 1);
        live
    }

    fn eim_add(&mut self, ep: Endpoint, port: u16) {
        let e = self.eim.entry(ep).or_insert((port, 0));
        // A mapping that could not get the endpoint's port (its tuple was taken) is not
        // counted: the entry ends with the mappings on the endpoint's port.
        if e.0 == port {
            e.1 += 1;
        }
    }

    fn eim_remove(&mut self, ep: Endpoint, port: u16) {
        if let Some(e) = self.eim.get_mut(&ep) {
            if e.0 == port {
                e.1 -= 1;
                if e.1 == 0 {
                    self.eim.remove(&ep);
                }
            }
        }
    }

    /// Whether external `port` may take a mapping towards `dst`:`dport`: no live mapping
    /// has that outside tuple, nor one that migrated away from here (its tombstone).
    fn tuple_free(&self, ctx: &Ctx<Mapping>, p: u8, port: u16, dst: Ipv4Addr, dport: u16) -> bool {
        let k = outside_key(p, self.cfg.external_ip, port, dst, dport);
        !ctx.flows.contains(&k) && ctx.flows.migrated_version(&k).is_none()
    }

    /// Whether a new mapping towards `dst`:`dport` may take one more reference on `port`.
    fn usable(&mut self, ctx: &Ctx<Mapping>, p: u8, port: u16, dst: Ipv4Addr, dport: u16) -> bool {
        self.pool(p).shareable(port) && self.tuple_free(ctx, p, port, dst, dport)
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// The pool of protocol `p` (for tests and queries).
    pub fn port_pool(&self, p: u8) -> &PortPool {
        match p {
            proto::TCP => &self.tcp,
            proto::UDP => &self.udp,
            _ => &self.icmp,
        }
    }

    fn pool(&mut self, p: u8) -> &mut PortPool {
        match p {
            proto::TCP => &mut self.tcp,
            proto::UDP => &mut self.udp,
            _ => &mut self.icmp,
        }
    }

    fn now_ms(&self, now: Instant) -> u64 {
        let since = u64::try_from(now.saturating_duration_since(self.epoch).as_millis())
            .unwrap_or(u64::MAX);
        self.epoch_wall_ms.saturating_add(since)
    }

    fn timeout(&self, m: &Mapping) -> Duration {
        Duration::from_secs(self.cfg.mapping_timeout_s(m))
    }

    /// Checks what the NF can translate; returns the drop reason otherwise.
    fn classify(pkt: &Packet) -> Result<(), &'static str> {
        let m = &pkt.meta;
        if !m.src.is_ipv4() {
            return Err("nat_ipv6_unsupported");
        }
        if m.fragment {
            return Err("nat_fragment");
        }
        match m.proto {
            proto::TCP | proto::UDP => Ok(()),
            proto::ICMP if m.icmp_type == ICMP_ECHO_REQUEST || m.icmp_type == ICMP_ECHO_REPLY => {
                Ok(())
            }
            proto::ICMP if icmp_err::is_error(m.icmp_type) => Ok(()),
            proto::ICMP => Err("nat_icmp_unsupported"),
            _ => Err("nat_unsupported_proto"),
        }
    }

    fn outbound(&mut self, ctx: &mut Ctx<Mapping>, mut pkt: Packet) {
        let (IpAddr::V4(src), IpAddr::V4(dst)) = (pkt.meta.src, pkt.meta.dst) else {
            return ctx.pkt_drop(pkt, "nat_ipv6_unsupported");
        };
        let key = pkt.key();
        let now_ms = self.now_ms(ctx.now());
        let flags = pkt.meta.tcp_flags;
        let ext_port = match ctx.flows.get_flow(&key) {
            Ok(r) => {
                let m = ctx.flows.state_mut(&r);
                let before = m.phase;
                if let Err(reason) = m.outbound_packet(src, pkt.meta.sport, flags, now_ms) {
                    ctx.flows.put_flow(r, false);
                    return ctx.pkt_drop(pkt, reason);
                }
                let (after, port) = (m.phase, m.external_port);
                let shorter = after != before
                    && self.timeout_of(proto::TCP, after) < self.timeout_of(proto::TCP, before);
                ctx.flows.put_flow(r, after != before);
                if shorter {
                    self.rearm(ctx, &key, after);
                }
                port
            }
            Err(StateError::NotFound(_)) => match self.create(ctx, &pkt, key, src, dst, now_ms) {
                Ok(p) => p,
                Err(reason) => return ctx.pkt_drop(pkt, reason),
            },
            Err(StateError::Migrated { .. }) => return ctx.pkt_drop(pkt, "nat_flow_migrated"),
            Err(_) => return ctx.pkt_drop(pkt, "nat_flow_busy"),
        };
        if xlate::set_src(&mut pkt, self.cfg.external_ip, ext_port).is_err() {
            // Classify admitted only translatable packets; a refusal means a frame/parse
            // mismatch. The mapping stays (it expires normally).
            return ctx.pkt_drop(pkt, "nat_rewrite_failed");
        }
        ctx.count("nat_translated_out", 1);
        ctx.pkt_write(&key, pkt);
    }

    fn timeout_of(&self, p: u8, phase: TcpPhase) -> Duration {
        Duration::from_secs(self.cfg.idle_timeout_s(p, phase))
    }

    /// Re-arms the idle timer at the (shorter) timeout of a new phase, so a closing flow does
    /// not hold its port until the established timeout's lazy re-check.
    fn rearm(&self, ctx: &mut Ctx<Mapping>, key: &FlowKey, phase: TcpPhase) {
        let after = self.timeout_of(proto::TCP, phase);
        let now = ctx.now();
        if ctx.flows.flow_timer(key, after, TIMER_IDLE, now).is_err() {
            ctx.count("nat_timer_arm_failed", 1);
        }
    }

    /// Creates the mapping of a new inside flow; returns its external port or a drop reason.
    fn create(
        &mut self,
        ctx: &mut Ctx<Mapping>,
        pkt: &Packet,
        key: FlowKey,
        src: Ipv4Addr,
        dst: Ipv4Addr,
        now_ms: u64,
    ) -> Result<u16, &'static str> {
        let p = pkt.meta.proto;
        opens_mapping(pkt)?;
        if self.cfg.max_mappings_per_host > 0
            && !self
                .cfg
                .host_quota_allows(self.guard.host_count(ctx, src), 1)
        {
            return Err("nat_host_quota");
        }
        if self.tracked != ctx.flows.len() {
            self.resync(ctx);
        }
        let ext = self.pick_port(ctx, p, src, pkt.meta.sport, dst, pkt.meta.dport)?;
        let m = Mapping::opened_by(pkt, src, dst, ext, now_ms);
        let ep = m.endpoint();
        let timeout = self.timeout(&m);
        let alias = m.outside_key(self.cfg.external_ip);
        if let Err(e) = ctx.flows.create_flow(key, m) {
            self.pool(p).release(ext);
            return Err(match e {
                StateError::Full { .. } => "nat_flow_table_full",
                StateError::Migrated { .. } => "nat_flow_migrated",
                _ => "nat_flow_create_failed",
            });
        }
        let now = ctx.now();
        let armed = ctx
            .flows
            .add_alias(&key, alias)
            .and_then(|()| ctx.flows.flow_timer(&key, timeout, TIMER_IDLE, now));
        if armed.is_err() {
            // Without an alias replies cannot find the flow, without a timer it would never
            // expire: undo rather than keep a half-made mapping.
            let _ = ctx.flows.delete_flow(&key);
            self.pool(p).release(ext);
            return Err("nat_alias_conflict");
        }
        ctx.count("nat_mappings_created", 1);
        self.tracked += 1;
        self.eim_add(ep, ext);
        self.guard.created(ctx, key, p, src);
        Ok(ext)
    }

    /// The external port of a new mapping from inside endpoint `src`:`sport` to remote
    /// `dst`:`dport` (protocol `p`), with one reference taken, or the drop reason. A port may
    /// back several mappings whose remote endpoints differ (the outside tuples differ, and
    /// replies are looked up by the whole tuple), but it is shared between inside endpoints
    /// only when no port is free: a shared port breaks endpoint-independence as soon as both
    /// endpoints talk to the same remote, so sharing is kept for when the only alternative is
    /// refusing the flow. In order:
    /// 1. the endpoint's own port, if it has live mappings (endpoint-independent mapping);
    /// 2. the inside source port, if ours and free (port preservation);
    /// 3. a free port from the FIFO;
    /// 4. no port free: the source port, then up to [`SHARE_SCAN`] in-use ports, whose tuple
    ///    towards this remote is free (sharing);
    /// 5. evicting embryonic mappings ([`Nat::evict_for`]).
    ///
    /// While scans towards this remote keep failing, 5 comes before the scan ([`ScanBackoff`]).
    fn pick_port(
        &mut self,
        ctx: &mut Ctx<Mapping>,
        p: u8,
        src: Ipv4Addr,
        sport: u16,
        dst: Ipv4Addr,
        dport: u16,
    ) -> Result<u16, &'static str> {
        if let Some(&(port, _)) = self.eim.get(&(p, src, sport)) {
            if self.usable(ctx, p, port, dst, dport) {
                self.pool(p).acquire(port);
                return Ok(port);
            }
            if self.pool(p).owns(port) {
                // Another endpoint shares the port and already talks to this remote.
                ctx.count("nat_eim_conflict", 1);
            }
        }
        if self.pool(p).is_free(sport) {
            self.pool(p).acquire(sport);
            ctx.count("nat_port_preserved", 1);
            return Ok(sport);
        }
        if let Some(port) = self.pool(p).alloc() {
            return Ok(port);
        }
        if self.usable(ctx, p, sport, dst, dport) {
            self.pool(p).acquire(sport);
            ctx.count("nat_port_preserved", 1);
            ctx.count("nat_port_shared", 1);
            return Ok(sport);
        }
        let remote = (p, dst, dport);
        let evicted_first = self.share_backoff.evict_first(remote);
        if evicted_first {
            ctx.count("nat_share_scan_skipped", 1);
            if let Some(port) = self.evict_for(ctx, p, dst, dport) {
                return Ok(port);
            }
        }
        for _ in 0..SHARE_SCAN {
            let Some(port) = self.pool(p).scan_next() else {
                continue;
            };
            if self.tuple_free(ctx, p, port, dst, dport) {
                self.pool(p).acquire(port);
                ctx.count("nat_port_shared", 1);
                self.share_backoff.found(remote);
                return Ok(port);
            }
        }
        self.share_backoff.failed(remote);
        if !evicted_first {
            if let Some(port) = self.evict_for(ctx, p, dst, dport) {
                return Ok(port);
            }
        }
        self.pool(p).exhausted += 1;
        Err("nat_port_exhausted")
    }

    /// No port can take a mapping towards `dst`:`dport`: evicts the oldest evictable mappings
    /// of `p` (see [`Mapping::evictable`]) until one frees a port, or a tuple on a shared
    /// port, this mapping can use; returns it with a reference taken. None if none is left.
    fn evict_for(
        &mut self,
        ctx: &mut Ctx<Mapping>,
        p: u8,
        dst: Ipv4Addr,
        dport: u16,
    ) -> Option<u16> {
        while let Some(key) = self.guard.pop_evictable(ctx, p) {
            let Ok(m) = ctx.flows.delete_flow(&key) else {
                continue;
            };
            self.ended(ctx, &m);
            ctx.count("nat_evicted_embryonic", 1);
            if let Some(port) = self.pool(p).alloc() {
                return Some(port);
            }
            // The evicted mapping's port is still shared by others.
            if self.usable(ctx, p, m.external_port, dst, dport) {
                self.pool(p).acquire(m.external_port);
                ctx.count("nat_port_shared", 1);
                return Some(m.external_port);
            }
        }
        None
    }

    /// Bookkeeping of mapping `m` that the NAT removed (expired or evicted): quota, endpoint
    /// index, and its port reference.
    fn ended(&mut self, ctx: &mut Ctx<Mapping>, m: &Mapping) {
        self.guard.ended(m.inside_addr);
        self.eim_remove(m.endpoint(), m.external_port);
        self.tracked = self.tracked.saturating_sub(1);
        if !self.pool(m.proto).release(m.external_port) && !self.pool(m.proto).owns(m.external_port)
        {
            // A migrated mapping whose port belongs to another replica's block.
            ctx.count("nat_foreign_port_ended", 1);
        }
    }

    fn inbound(&mut self, ctx: &mut Ctx<Mapping>, mut pkt: Packet) {
        let IpAddr::V4(dst) = pkt.meta.dst else {
            return ctx.pkt_drop(pkt, "nat_ipv6_unsupported");
        };
        if dst != self.cfg.external_ip {
            return ctx.pkt_drop(pkt, "nat_not_external_ip");
        }
        let now_ms = self.now_ms(ctx.now());
        let r = match ctx.flows.get_flow(&pkt.key()) {
            Ok(r) => r,
            Err(StateError::Migrated { .. }) => return ctx.pkt_drop(pkt, "nat_flow_migrated"),
            Err(_) => return ctx.pkt_drop(pkt, "nat_no_mapping"),
        };
        let primary = r.key;
        let m = ctx.flows.state_mut(&r);
        let before = (m.phase, m.replied);
        if let Err(reason) = m.inbound_packet(&pkt, now_ms) {
            ctx.flows.put_flow(r, false);
            return ctx.pkt_drop(pkt, reason);
        }
        let (inside_addr, inside_port, phase) = (m.inside_addr, m.inside_port, m.phase);
        let changed = (phase, true) != before;
        let shorter = phase != before.0
            && self.timeout_of(proto::TCP, phase) < self.timeout_of(proto::TCP, before.0);
        ctx.flows.put_flow(r, changed);
        if shorter {
            self.rearm(ctx, &primary, phase);
        }
        if xlate::set_dst(&mut pkt, inside_addr, inside_port).is_err() {
            return ctx.pkt_drop(pkt, "nat_rewrite_failed");
        }
        ctx.count("nat_translated_in", 1);
        ctx.pkt_write(&primary, pkt);
    }

    /// Translates an ICMP error about a mapped flow: the quoted packet and the outer address.
    /// Errors never create or refresh a mapping (they are not traffic of the flow).
    fn icmp_error(&mut self, ctx: &mut Ctx<Mapping>, mut pkt: Packet) {
        let l4 = usize::from(pkt.meta.l4_off);
        let Some(inner) = icmp_err::parse_inner(&pkt.buf, l4, pkt.meta.l4_end()) else {
            return ctx.pkt_drop(pkt, "nat_icmp_error_unparsable");
        };
        let m = match ctx.flows.get_flow(&inner.key()) {
            Ok(r) => {
                let m = ctx.flows.state(&r).clone();
                let primary = r.key;
                ctx.flows.put_flow(r, false);
                (primary, m)
            }
            Err(_) => return ctx.pkt_drop(pkt, "nat_no_mapping"),
        };
        let (primary, m) = m;
        if let Err(reason) = xlate::icmp_error(&mut pkt, &inner, &m, self.cfg.external_ip) {
            return ctx.pkt_drop(pkt, reason);
        }
        ctx.count("nat_icmp_errors_translated", 1);
        ctx.pkt_write(&primary, pkt);
    }

    fn expire(&mut self, ctx: &mut Ctx<Mapping>, key: FlowKey) {
        let now = ctx.now();
        let now_ms = self.now_ms(now);
        let state = match ctx.flows.get_flow(&key) {
            Ok(r) => {
                let m = ctx.flows.state(&r).clone();
                ctx.flows.put_flow(r, false);
                m
            }
            // Deleted or moved meanwhile: nothing to do.
            Err(_) => return,
        };
        let timeout = self.timeout(&state);
        let idle = Duration::from_millis(now_ms.saturating_sub(state.last_seen_ms));
        if idle < timeout {
            if ctx
                .flows
                .flow_timer(&key, timeout - idle, TIMER_IDLE, now)
                .is_err()
            {
                ctx.count("nat_timer_arm_failed", 1);
            }
            return;
        }
        match ctx.flows.delete_flow(&key) {
            Ok(m) => {
                self.ended(ctx, &m);
                ctx.count("nat_mappings_expired", 1);
            }
            Err(_) => ctx.count("nat_expire_failed", 1),
        }
    }
}

/// TCP phase transitions (deliberately coarse, like a NAT's conntrack: the phase only selects
/// a timeout). RST or FIN from either side -> Closing; an ACK without SYN after the outside
/// has answered -> Established.
fn next_phase(cur: TcpPhase, flags: u8, replied: bool, from: Side) -> TcpPhase {
    if flags & (TCP_RST | TCP_FIN) != 0 {
        return TcpPhase::Closing;
    }
    match cur {
        TcpPhase::Opening | TcpPhase::None
            if replied && flags & TCP_ACK != 0 && flags & TCP_SYN == 0 && from == Side::Inside =>
        {
            TcpPhase::Established
        }
        TcpPhase::None => TcpPhase::Opening,
        other => other,
    }
}

impl NetworkFunction for Nat {
    type Flow = Mapping;
    const NAME: &'static str = "nat";

    fn process(&mut self, ctx: &mut Ctx<Mapping>, pkt: Packet) {
        if let Err(reason) = Self::classify(&pkt) {
            return ctx.pkt_drop(pkt, reason);
        }
        if pkt.meta.proto == proto::ICMP && icmp_err::is_error(pkt.meta.icmp_type) {
            return self.icmp_error(ctx, pkt);
        }
        match pkt.ingress {
            Side::Inside => self.outbound(ctx, pkt),
            Side::Outside => self.inbound(ctx, pkt),
        }
    }

    fn on_timer(&mut self, ctx: &mut Ctx<Mapping>, key: FlowKey, timer: TimerId) {
        if timer == TIMER_IDLE {
            self.expire(ctx, key);
        }
    }

    /// An imported mapping (migration or HA activation) keeps its external port: if the port
    /// is in this replica's own pool it must not be handed to a new flow while the mapping
    /// lives (ports of another replica's block are not ours to reserve; `set_port_blocks`
    /// reserves them if that block is handed over later).
    fn on_import(&mut self, ctx: &mut Ctx<Mapping>, key: FlowKey) {
        let Some(m) = ctx.flows.peek(&key) else {
            return;
        };
        let (p, port, host, ep) = (m.proto, m.external_port, m.inside_addr, m.endpoint());
        if self.tracked + 1 != ctx.flows.len() {
            // Mappings left unseen since the last count (say this one, exported earlier and
            // back now: its old reference is still counted). The resync counts the imported
            // mapping from the table, so that reference is not counted twice (which would
            // keep the port lent after the mapping ends).
            self.resync(ctx);
        } else {
            // One more reference: the port may already back local mappings to other remotes
            // (the importer's table refused the import if the outside tuple were taken).
            if self.pool(p).reserve(port) {
                ctx.count("nat_imported_ports_reserved", 1);
            }
            self.tracked += 1;
            self.eim_add(ep, port);
        }
        // Evictable imported mappings queue behind local ones of the same age class.
        self.guard.created(ctx, key, p, host);
    }

    /// The table was emptied unseen (a rejoin after a partition): the resync makes every
    /// reference of the dropped mappings lent, so their external ports stay out of the pool
    /// while the mappings live on at the replicas they failed over to.
    fn on_flows_dropped(&mut self, ctx: &mut Ctx<Mapping>) {
        self.resync(ctx);
    }

    fn set_port_blocks(
        &mut self,
        ctx: &mut Ctx<Mapping>,
        blocks: &[(u16, u16)],
    ) -> Result<serde_json::Value, String> {
        validate_blocks(blocks)?;
        if blocks.is_empty() {
            return Err("nat: at least one port block is needed".into());
        }
        self.replace_blocks(ctx, blocks);
        Ok(serde_json::json!({
            "blocks": blocks,
            "tcp_in_use": self.tcp.in_use(),
            "udp_in_use": self.udp.in_use(),
            "capacity": self.tcp.capacity(),
        }))
    }

    fn query(&self, ctx: &Ctx<Mapping>) -> serde_json::Value {
        const SAMPLE: usize = 16;
        let pool = |p: &PortPool| {
            serde_json::json!({
                "in_use": p.in_use(), "mappings": p.mappings(), "capacity": p.capacity(),
                "exhausted": p.exhausted,
                "foreign_release": p.foreign_release, "blocks": p.blocks(),
            })
        };
        // `keys()` copies every key: fine for an operator query, not for the packet path.
        let sample: Vec<serde_json::Value> = ctx
            .flows
            .keys()
            .into_iter()
            .filter_map(|k| ctx.flows.peek(&k))
            .take(SAMPLE)
            .map(|m| {
                let p = match m.proto {
                    proto::TCP => "tcp",
                    proto::UDP => "udp",
                    _ => "icmp",
                };
                serde_json::json!({
                    "proto": p,
                    "inside": format!("{}:{}", m.inside_addr, m.inside_port),
                    "external": format!("{}:{}", self.cfg.external_ip, m.external_port),
                    "remote": format!("{}:{}", m.remote_addr, m.remote_port),
                    "tcp_phase": format!("{:?}", m.phase),
                })
            })
            .collect();
        serde_json::json!({
            "nf": "nat",
            "external_ip": self.cfg.external_ip.to_string(),
            "mappings": ctx.flows.len(),
            "pools": { "tcp": pool(&self.tcp), "udp": pool(&self.udp), "icmp": pool(&self.icmp) },
            "abuse": self.guard.query(ctx, &self.cfg),
            "sample": sample,
        })
    }
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod testutil;
