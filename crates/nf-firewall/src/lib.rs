//! pliant-nf-firewall: a stateful firewall on the Split/Merge API.
//!
//! Packet path (`Firewall::process`):
//! 1. look the flow up (`get_flow`): a known flow is allowed whatever the rules say — replies of
//!    flows the rules admitted are the point of a stateful firewall — and its TCP phase advances;
//! 2. an unknown flow is judged by the ordered rules (first match wins), else by the default
//!    policy of its direction (inbound deny, outbound allow unless configured otherwise);
//! 3. an admitted flow gets state (`create_flow`, remembering which side opened it) and an idle
//!    timer (`flow_timer`) whose length follows the TCP phase (FIN/RST shorten it);
//! 4. a refused packet is dropped under the reason `fw_denied`.
//!
//! Per-flow state ([`FwFlow`]) is a few bytes and written only when the TCP phase changes, so
//! Pico replication sees this NF as "write mostly once". Rule hit counts are NF-local statistics.

pub mod config;
pub mod rules;

pub use config::{Action, Config, Direction, PortSpec, RuleConfig};

use pliant_net::{proto, FlowKey};
use pliant_runtime::{Ctx, NetworkFunction, Packet, Side};
use pliant_state::{StateError, TimerId};
use rules::{Probe, Rule};
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// The one timer kind of this NF: idle expiry of a flow.
pub const TIMER_IDLE: TimerId = 0;

/// Retry delay when an expiring flow is pinned by an open transaction.
const BUSY_RETRY: Duration = Duration::from_secs(1);

const TCP_FIN: u8 = 0x01;
const TCP_SYN: u8 = 0x02;
const TCP_RST: u8 = 0x04;
const TCP_ACK: u8 = 0x10;

/// Drop reasons (stable labels).
pub const DROP_DENIED: &str = "fw_denied";
pub const DROP_TABLE_FULL: &str = "fw_table_full";
pub const DROP_MIGRATED: &str = "flow_migrated";
pub const DROP_STATE_ERROR: &str = "fw_state_error";

/// Coarse TCP phase: just enough to choose an expiry timeout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum TcpPhase {
    /// The opening SYN passed; no answer yet.
    SynSent,
    Established,
    /// One side sent FIN.
    Closing,
    /// RST seen, or FINs from both sides.
    Closed,
}

/// Per-flow state (exported on migration; keep it small).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FwFlow {
    /// The side whose packet opened the flow.
    pub initiator: Side,
    /// `None` for protocols other than TCP.
    pub tcp: Option<TcpPhase>,
    /// Bit 0: FIN seen from the initiator; bit 1: from the responder.
    pub fins: u8,
    /// The rule (0-based) that admitted the flow; `None` = the default policy.
    pub rule: Option<u16>,
}

impl FwFlow {
    /// Advances the TCP phase for a packet with `flags`; returns whether the state changed.
    fn observe_tcp(&mut self, from_initiator: bool, flags: u8) -> bool {
        let Some(phase) = self.tcp else { return false };
        let before = (phase, self.fins);
        let next = if flags & TCP_RST != 0 {
            TcpPhase::Closed
        } else if flags & TCP_FIN != 0 {
            self.fins |= if from_initiator { 1 } else { 2 };
            if self.fins == 3 {
                TcpPhase::Closed
            } else {
                TcpPhase::Closing
            }
        } else {
            match phase {
                // Any answer from the responder (SYN-ACK, or anything in a loose pickup)
                // establishes the flow.
                TcpPhase::SynSent if !from_initiator => TcpPhase::Established,
                p => p,
            }
        };
        // Never move backwards out of a closing phase on a stray packet.
        self.tcp = Some(match (phase, next) {
            (TcpPhase::Closed, _) => TcpPhase::Closed,
            (TcpPhase::Closing, TcpPhase::Established | TcpPhase::SynSent) => TcpPhase::Closing,
            (_, n) => n,
        });
        before != (self.tcp.unwrap_or(phase), self.fins)
    }
}

/// Compiled timeouts.
#[derive(Clone, Copy, Debug)]
struct Timeouts {
    syn: Duration,
    established: Duration,
    closing: Duration,
    closed: Duration,
    udp: Duration,
    icmp: Duration,
    other: Duration,
}

pub struct Firewall {
    rules: Vec<Rule>,
    default_inbound: Action,
    default_outbound: Action,
    timeouts: Timeouts,
    /// Hits per rule, same order as `rules` (NF-local statistics).
    rule_hits: Vec<u64>,
    default_inbound_hits: u64,
    default_outbound_hits: u64,
}

impl Firewall {
    /// Validates `cfg`; a bad rule is refused with its position, name and the reason.
    pub fn new(cfg: Config) -> Result<Self, String> {
        cfg.validate_timeouts()?;
        let rules = rules::compile(&cfg.rules)?;
        let s = Duration::from_secs;
        Ok(Firewall {
            rule_hits: vec![0; rules.len()],
            rules,
            default_inbound: cfg.default_inbound,
            default_outbound: cfg.default_outbound,
            timeouts: Timeouts {
                syn: s(cfg.tcp_syn_timeout_s),
                established: s(cfg.tcp_established_timeout_s),
                closing: s(cfg.tcp_closing_timeout_s),
                closed: s(cfg.tcp_closed_timeout_s),
                udp: s(cfg.udp_timeout_s),
                icmp: s(cfg.icmp_timeout_s),
                other: s(cfg.other_timeout_s),
            },
            default_inbound_hits: 0,
            default_outbound_hits: 0,
        })
    }

    /// First matching rule, else the default policy of the packet's direction. Counts the hit.
    fn decide(&mut self, p: &Probe) -> (Action, Option<u16>) {
        if let Some(i) = self.rules.iter().position(|r| r.matches(p)) {
            self.rule_hits[i] += 1;
            // `rules::MAX_RULES` keeps the index within u16.
            return (self.rules[i].action, u16::try_from(i).ok());
        }
        match p.ingress {
            Side::Outside => {
                self.default_inbound_hits += 1;
                (self.default_inbound, None)
            }
            Side::Inside => {
                self.default_outbound_hits += 1;
                (self.default_outbound, None)
            }
        }
    }

    fn timeout_for(&self, f: &FwFlow, ip_proto: u8) -> Duration {
        match f.tcp {
            Some(TcpPhase::SynSent) => self.timeouts.syn,
            Some(TcpPhase::Established) => self.timeouts.established,
            Some(TcpPhase::Closing) => self.timeouts.closing,
            Some(TcpPhase::Closed) => self.timeouts.closed,
            None if ip_proto == proto::UDP => self.timeouts.udp,
            None if ip_proto == proto::ICMP || ip_proto == proto::ICMPV6 => self.timeouts.icmp,
            None => self.timeouts.other,
        }
    }

    fn arm(ctx: &mut Ctx<FwFlow>, key: &FlowKey, after: Duration) {
        let now = ctx.now();
        if ctx.flows.flow_timer(key, after, TIMER_IDLE, now).is_err() {
            // Without a timer the flow would never expire: make it visible.
            ctx.count("fw_timer_errors", 1);
        }
    }

    /// A packet of a flow with no state here.
    fn new_flow(&mut self, ctx: &mut Ctx<FwFlow>, pkt: Packet) {
        let m = pkt.meta;
        let probe = Probe {
            ingress: pkt.ingress,
            proto: m.proto,
            src: m.src,
            dst: m.dst,
            sport: m.sport,
            dport: m.dport,
        };
        let (action, rule) = self.decide(&probe);
        if action == Action::Deny {
            ctx.pkt_drop(pkt, DROP_DENIED);
            return;
        }
        let is_tcp = m.proto == proto::TCP;
        // Non-first fragments carry no ports, so they cannot be tied to a flow; an RST must not
        // open one. Both pass on the rules' verdict alone and leave no state behind.
        if m.fragment || (is_tcp && m.tcp_flags & TCP_RST != 0) {
            ctx.pkt_write_direct(pkt);
            return;
        }
        let tcp = match (is_tcp, m.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN) {
            (false, _) => None,
            (true, true) => Some(TcpPhase::SynSent),
            // Mid-stream pickup (e.g. state lost in a restart): allowed by the rules, so track
            // it as established rather than break the connection.
            (true, false) => Some(TcpPhase::Established),
        };
        let mut flow = FwFlow {
            initiator: pkt.ingress,
            tcp,
            fins: 0,
            rule,
        };
        if is_tcp {
            flow.observe_tcp(true, m.tcp_flags & TCP_FIN);
        }
        let timeout = self.timeout_for(&flow, m.proto);
        let key = pkt.key();
        match ctx.flows.create_flow(key, flow) {
            Ok(()) => {
                ctx.count("fw_flows_created", 1);
                Self::arm(ctx, &key, timeout);
                ctx.pkt_write(&key, pkt);
            }
            Err(StateError::Full { .. }) => ctx.pkt_drop(pkt, DROP_TABLE_FULL),
            Err(StateError::Migrated { .. }) => ctx.pkt_drop(pkt, DROP_MIGRATED),
            Err(_) => ctx.pkt_drop(pkt, DROP_STATE_ERROR),
        }
    }
}

impl NetworkFunction for Firewall {
    type Flow = FwFlow;
    const NAME: &'static str = "firewall";

    fn process(&mut self, ctx: &mut Ctx<FwFlow>, pkt: Packet) {
        let key = pkt.key();
        let m = pkt.meta;
        let r = match ctx.flows.get_flow(&key) {
            Ok(r) => r,
            Err(StateError::NotFound(_)) => return self.new_flow(ctx, pkt),
            Err(StateError::Migrated { .. }) => return ctx.pkt_drop(pkt, DROP_MIGRATED),
            Err(_) => return ctx.pkt_drop(pkt, DROP_STATE_ERROR),
        };
        let st = ctx.flows.state_mut(&r);
        let from_initiator = pkt.ingress == st.initiator;
        let pure_syn = m.tcp_flags & (TCP_SYN | TCP_ACK | TCP_RST) == TCP_SYN;
        if m.proto == proto::TCP && st.tcp == Some(TcpPhase::Closed) && pure_syn {
            // The 5-tuple is being reused for a new connection: judge it afresh by the rules
            // instead of inheriting the old connection's admission.
            ctx.flows.put_flow(r, false);
            if ctx.flows.delete_flow(&key).is_err() {
                return ctx.pkt_drop(pkt, DROP_STATE_ERROR);
            }
            return self.new_flow(ctx, pkt);
        }
        let changed = m.proto == proto::TCP && st.observe_tcp(from_initiator, m.tcp_flags);
        let timeout = self.timeout_for(st, m.proto);
        ctx.flows.put_flow(r, changed);
        Self::arm(ctx, &key, timeout);
        ctx.pkt_write(&key, pkt);
    }

    fn on_timer(&mut self, ctx: &mut Ctx<FwFlow>, key: FlowKey, timer: TimerId) {
        if timer != TIMER_IDLE {
            return;
        }
        match ctx.flows.delete_flow(&key) {
            Ok(_) => ctx.count("fw_expired", 1),
            Err(StateError::Busy { .. }) => {
                ctx.count("fw_expire_busy", 1);
                Self::arm(ctx, &key, BUSY_RETRY);
            }
            // Already gone (deleted or migrated away): nothing to expire.
            Err(_) => {}
        }
    }

    fn query(&self, ctx: &Ctx<FwFlow>) -> serde_json::Value {
        let rules: Vec<_> = self
            .rules
            .iter()
            .zip(&self.rule_hits)
            .enumerate()
            .map(|(i, (r, hits))| {
                serde_json::json!({
                    "index": i + 1,
                    "name": r.name,
                    "action": r.action,
                    "direction": r.direction,
                    "hits": hits,
                })
            })
            .collect();
        serde_json::json!({
            "flows": ctx.flows.len(),
            "rules": rules,
            "default_inbound": { "action": self.default_inbound, "hits": self.default_inbound_hits },
            "default_outbound": { "action": self.default_outbound, "hits": self.default_outbound_hits },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pliant_net::build::{self, tcp_flags::*};
    use pliant_runtime::testing::Harness;
    use std::net::IpAddr;

    const CLIENT: &str = "10.0.1.2";
    const SERVER: &str = "10.0.2.2";

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    /// A TCP segment from `src:sport` to `dst:dport`.
    fn tcp(src: &str, sport: u16, dst: &str, dport: u16, flags: u8, payload: &[u8]) -> Vec<u8> {
        build::tcp(
            build::MAC_A,
            build::MAC_B,
            ip(src),
            sport,
            ip(dst),
            dport,
            flags,
            1,
            1,
            payload,
        )
    }

    fn udp(src: &str, sport: u16, dst: &str, dport: u16) -> Vec<u8> {
        build::udp(
            build::MAC_A,
            build::MAC_B,
            ip(src),
            sport,
            ip(dst),
            dport,
            b"x",
        )
    }

    fn harness(cfg: Config) -> Harness<Firewall> {
        Harness::new(Firewall::new(cfg).expect("valid config"))
    }

    /// Injects and returns the egress sides of what came out.
    fn send(h: &mut Harness<Firewall>, side: Side, frame: &[u8]) -> Vec<Side> {
        h.inject(side, frame).expect("frame parses");
        h.take_output().into_iter().map(|(s, _)| s).collect()
    }

    fn from_toml(s: &str) -> Result<Config, String> {
        #[derive(Deserialize)]
        struct File {
            firewall: Config,
        }
        toml::from_str::<File>(s)
            .map(|f| f.firewall)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn outbound_allowed_and_replies_allowed() {
        let mut h = harness(Config::default());
        assert_eq!(
            send(
                &mut h,
                Side::Inside,
                &tcp(CLIENT, 40000, SERVER, 80, SYN, b"")
            ),
            [Side::Outside]
        );
        assert_eq!(
            send(
                &mut h,
                Side::Outside,
                &tcp(SERVER, 80, CLIENT, 40000, SYN | ACK, b"")
            ),
            [Side::Inside],
            "the reply of an established flow passes although inbound is denied by default"
        );
        assert_eq!(
            send(
                &mut h,
                Side::Inside,
                &tcp(CLIENT, 40000, SERVER, 80, ACK, b"GET /")
            ),
            [Side::Outside]
        );
        assert_eq!(
            send(
                &mut h,
                Side::Outside,
                &tcp(SERVER, 80, CLIENT, 40000, ACK, b"200")
            ),
            [Side::Inside]
        );
        // UDP and ICMP echo replies as well.
        assert_eq!(
            send(&mut h, Side::Inside, &udp(CLIENT, 5353, SERVER, 53)),
            [Side::Outside]
        );
        assert_eq!(
            send(&mut h, Side::Outside, &udp(SERVER, 53, CLIENT, 5353)),
            [Side::Inside]
        );
        let ping = build::icmp_echo(
            build::MAC_A,
            build::MAC_B,
            ip(CLIENT),
            ip(SERVER),
            7,
            1,
            true,
            b"",
        );
        let pong = build::icmp_echo(
            build::MAC_A,
            build::MAC_B,
            ip(SERVER),
            ip(CLIENT),
            7,
            1,
            false,
            b"",
        );
        assert_eq!(send(&mut h, Side::Inside, &ping), [Side::Outside]);
        assert_eq!(send(&mut h, Side::Outside, &pong), [Side::Inside]);
        assert_eq!(h.drop_count(DROP_DENIED), 0);
        assert_eq!(h.ctx.flows.len(), 3);
        let f = h
            .ctx
            .flows
            .peek(
                &pliant_net::FlowKey::v4(
                    proto::TCP,
                    CLIENT.parse().unwrap(),
                    40000,
                    SERVER.parse().unwrap(),
                    80,
                )
                .0,
            )
            .unwrap();
        assert_eq!(
            (f.initiator, f.tcp),
            (Side::Inside, Some(TcpPhase::Established))
        );
    }

    #[test]
    fn unsolicited_inbound_is_dropped_and_counted() {
        let mut h = harness(Config::default());
        assert!(send(
            &mut h,
            Side::Outside,
            &tcp(SERVER, 5555, CLIENT, 22, SYN, b"")
        )
        .is_empty());
        assert!(send(
            &mut h,
            Side::Outside,
            &tcp(SERVER, 80, CLIENT, 40000, ACK, b"data")
        )
        .is_empty());
        assert!(send(&mut h, Side::Outside, &udp(SERVER, 53, CLIENT, 5353)).is_empty());
        assert_eq!(h.drop_count(DROP_DENIED), 3);
        assert!(h.ctx.flows.is_empty(), "a denied packet leaves no state");
        let q = h.query();
        assert_eq!(q["default_inbound"]["hits"], 3);
        assert_eq!(q["default_outbound"]["hits"], 0);
        // A client-opened flow does not open the door for another port.
        send(
            &mut h,
            Side::Inside,
            &tcp(CLIENT, 40000, SERVER, 80, SYN, b""),
        );
        assert!(send(
            &mut h,
            Side::Outside,
            &tcp(SERVER, 81, CLIENT, 40000, SYN | ACK, b"")
        )
        .is_empty());
        assert_eq!(h.drop_count(DROP_DENIED), 4);
    }

    #[test]
    fn rules_apply_in_order_and_hits_are_counted() {
        let cfg = from_toml(
            r#"
            [firewall]
            [[firewall.rules]]
            name = "ssh-from-admin"
            action = "allow"
            direction = "inbound"
            proto = "tcp"
            src = "10.0.2.0/24"
            dst_ports = [22]
            [[firewall.rules]]
            name = "no-inbound-tcp"
            action = "deny"
            direction = "inbound"
            proto = "tcp"
            [[firewall.rules]]
            name = "web-in"
            action = "allow"
            direction = "inbound"
            proto = "tcp"
            dst_ports = [80]
            [[firewall.rules]]
            name = "no-dns-out"
            action = "deny"
            direction = "outside->inside"
            proto = "udp"
            [[firewall.rules]]
            name = "no-dns-out-really"
            action = "deny"
            direction = "outbound"
            proto = "udp"
            dst_ports = ["53-53"]
            "#,
        )
        .unwrap();
        let mut h = harness(cfg);
        // Rule 1 admits ssh from the admin subnet before rule 2 denies all inbound TCP.
        assert_eq!(
            send(
                &mut h,
                Side::Outside,
                &tcp(SERVER, 5555, CLIENT, 22, SYN, b"")
            ),
            [Side::Inside]
        );
        // From elsewhere rule 2 matches first.
        assert!(send(
            &mut h,
            Side::Outside,
            &tcp("192.0.2.1", 5555, CLIENT, 22, SYN, b"")
        )
        .is_empty());
        // Rule 3 would allow port 80 but rule 2 comes first.
        assert!(send(
            &mut h,
            Side::Outside,
            &tcp("192.0.2.1", 5555, CLIENT, 80, SYN, b"")
        )
        .is_empty());
        // Outbound DNS denied by rule 5, other outbound UDP by the default (allow).
        assert!(send(&mut h, Side::Inside, &udp(CLIENT, 5353, SERVER, 53)).is_empty());
        assert_eq!(
            send(&mut h, Side::Inside, &udp(CLIENT, 5353, SERVER, 123)),
            [Side::Outside]
        );
        // The reply of the admitted ssh flow passes although rule 2 denies inbound TCP.
        assert_eq!(
            send(
                &mut h,
                Side::Inside,
                &tcp(CLIENT, 22, SERVER, 5555, SYN | ACK, b"")
            ),
            [Side::Outside]
        );
        let q = h.query();
        let hits: Vec<u64> = q["rules"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["hits"].as_u64().unwrap())
            .collect();
        assert_eq!(hits, [1, 2, 0, 0, 1]);
        assert_eq!(q["default_outbound"]["hits"], 1);
        assert_eq!(q["flows"], 2);
        assert_eq!(h.drop_count(DROP_DENIED), 3);
    }

    #[test]
    fn idle_flows_expire_and_traffic_keeps_them_alive() {
        let cfg = Config {
            tcp_established_timeout_s: 100,
            udp_timeout_s: 20,
            ..Config::default()
        };
        let mut h = harness(cfg);
        send(
            &mut h,
            Side::Inside,
            &tcp(CLIENT, 40000, SERVER, 80, SYN, b""),
        );
        send(
            &mut h,
            Side::Outside,
            &tcp(SERVER, 80, CLIENT, 40000, SYN | ACK, b""),
        );
        send(&mut h, Side::Inside, &udp(CLIENT, 5353, SERVER, 53));
        for _ in 0..5 {
            h.advance(Duration::from_secs(60));
            // Keeps the TCP flow alive; the UDP flow (20 s) expires after the first round.
            assert_eq!(
                send(
                    &mut h,
                    Side::Outside,
                    &tcp(SERVER, 80, CLIENT, 40000, ACK, b"x")
                ),
                [Side::Inside]
            );
        }
        assert_eq!(h.ctx.flows.len(), 1);
        assert!(
            send(&mut h, Side::Outside, &udp(SERVER, 53, CLIENT, 5353)).is_empty(),
            "expired"
        );
        h.advance(Duration::from_secs(101));
        assert!(h.ctx.flows.is_empty());
        assert_eq!(h.counter("fw_expired"), 2);
        assert!(send(
            &mut h,
            Side::Outside,
            &tcp(SERVER, 80, CLIENT, 40000, ACK, b"x")
        )
        .is_empty());
    }

    #[test]
    fn fin_and_rst_shorten_the_timeout() {
        let mut h = harness(Config::default());
        let (est, closing, closed) = (3600, 30, 5);
        send(
            &mut h,
            Side::Inside,
            &tcp(CLIENT, 40000, SERVER, 80, SYN, b""),
        );
        send(
            &mut h,
            Side::Outside,
            &tcp(SERVER, 80, CLIENT, 40000, SYN | ACK, b""),
        );
        send(
            &mut h,
            Side::Inside,
            &tcp(CLIENT, 40000, SERVER, 80, FIN | ACK, b""),
        );
        h.advance(Duration::from_secs(closing - 1));
        assert_eq!(h.ctx.flows.len(), 1);
        h.advance(Duration::from_secs(2));
        assert!(
            h.ctx.flows.is_empty(),
            "half-closed flow expires after {closing}s, not {est}s"
        );

        send(
            &mut h,
            Side::Inside,
            &tcp(CLIENT, 40001, SERVER, 80, SYN, b""),
        );
        send(
            &mut h,
            Side::Outside,
            &tcp(SERVER, 80, CLIENT, 40001, SYN | ACK, b""),
        );
        send(
            &mut h,
            Side::Outside,
            &tcp(SERVER, 80, CLIENT, 40001, RST | ACK, b""),
        );
        h.advance(Duration::from_secs(closed - 1));
        assert_eq!(h.ctx.flows.len(), 1);
        h.advance(Duration::from_secs(2));
        assert!(h.ctx.flows.is_empty(), "reset flow expires after {closed}s");
    }

    #[test]
    fn reused_tuple_after_close_is_judged_again() {
        let cfg = from_toml(
            r#"
            [firewall]
            default_outbound = "deny"
            [[firewall.rules]]
            action = "allow"
            direction = "outbound"
            proto = "tcp"
            dst_ports = [80]
            "#,
        )
        .unwrap();
        let mut h = harness(cfg);
        send(
            &mut h,
            Side::Inside,
            &tcp(CLIENT, 40000, SERVER, 80, SYN, b""),
        );
        send(
            &mut h,
            Side::Outside,
            &tcp(SERVER, 80, CLIENT, 40000, RST | ACK, b""),
        );
        // The server now opens a connection on the same 5-tuple: inbound, no rule allows it.
        assert!(send(
            &mut h,
            Side::Outside,
            &tcp(SERVER, 80, CLIENT, 40000, SYN, b"")
        )
        .is_empty());
        assert_eq!(h.drop_count(DROP_DENIED), 1);
        assert!(h.ctx.flows.is_empty());
        // The client reopening it is allowed again.
        assert_eq!(
            send(
                &mut h,
                Side::Inside,
                &tcp(CLIENT, 40000, SERVER, 80, SYN, b"")
            ),
            [Side::Outside]
        );
        let q = h.query();
        assert_eq!(q["rules"][0]["hits"], 2);
    }

    #[test]
    fn exported_flow_is_small() {
        let mut h = harness(Config::default());
        send(
            &mut h,
            Side::Inside,
            &tcp(CLIENT, 40000, SERVER, 80, SYN, b""),
        );
        let key = pliant_net::FlowKey::v4(
            proto::TCP,
            CLIENT.parse().unwrap(),
            40000,
            SERVER.parse().unwrap(),
            80,
        )
        .0;
        let now = h.now();
        let bytes = h.ctx.flows.export_flow(&key, now).unwrap();
        // Key, timer, version and a few bytes of state: cheap to migrate and replicate.
        assert!(bytes.len() <= 96, "{} bytes", bytes.len());
    }

    #[test]
    fn ipv6_flows_are_tracked_like_ipv4() {
        let mut h = harness(Config::default());
        let (c, s) = ("fd00:1::2", "fd00:2::2");
        assert_eq!(
            send(&mut h, Side::Inside, &tcp(c, 40000, s, 443, SYN, b"")),
            [Side::Outside]
        );
        assert_eq!(
            send(
                &mut h,
                Side::Outside,
                &tcp(s, 443, c, 40000, SYN | ACK, b"")
            ),
            [Side::Inside]
        );
        assert!(send(&mut h, Side::Outside, &tcp(s, 443, c, 40001, SYN, b"")).is_empty());
    }

    #[test]
    fn random_traffic_is_forwarded_or_dropped_exactly_once() {
        let mut h = harness(Config::default());
        let mut x: u64 = 0x9e3779b97f4a7c15;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut out = 0;
        for _ in 0..3000 {
            let r = rnd();
            let port = 40000 + (r % 16) as u16;
            let flags = (rnd() as u8) & (FIN | SYN | RST | ACK);
            let (side, f) = match r % 4 {
                0 => (Side::Inside, tcp(CLIENT, port, SERVER, 80, flags, b"x")),
                1 => (Side::Outside, tcp(SERVER, 80, CLIENT, port, flags, b"y")),
                2 => (Side::Inside, udp(CLIENT, port, SERVER, 53)),
                _ => (Side::Outside, udp(SERVER, 53, CLIENT, port)),
            };
            out += send(&mut h, side, &f).len();
            if r % 97 == 0 {
                h.advance(Duration::from_secs(rnd() % 100));
            }
        }
        let dropped: u64 = h.drops().iter().map(|d| d.1).sum();
        assert_eq!(out as u64 + dropped, 3000);
        assert_eq!(
            dropped,
            h.drop_count(DROP_DENIED),
            "only policy drops: {:?}",
            h.drops()
        );
        // Every outbound packet passed (default allow).
        assert!(out >= 1500 - 200, "{out}");
    }

    #[test]
    fn bad_configs_are_refused_with_the_rule_and_the_reason() {
        let err = |toml_text: &str| match from_toml(toml_text) {
            Ok(cfg) => Firewall::new(cfg).err().expect("must be refused"),
            Err(e) => e,
        };
        let e = err(r#"
            [firewall]
            [[firewall.rules]]
            action = "allow"
            direction = "inbound"
            [[firewall.rules]]
            name = "typo"
            action = "allow"
            direction = "inbound"
            dst = "10.0.0.0/33"
            "#);
        assert!(
            e.contains("rule #2 (\"typo\"): dst") && e.contains("exceeds 32"),
            "{e}"
        );
        let e = err(r#"
            [firewall]
            [[firewall.rules]]
            action = "allow"
            direction = "inbound"
            proto = "udp"
            dst_ports = ["100-90"]
            "#);
        assert!(
            e.contains("rule #1: dst_ports") && e.contains("empty"),
            "{e}"
        );
        // Unknown keys and values are refused by the parser (with the TOML line).
        let e = err("[firewall]\n[[firewall.rules]]\naction = \"allow\"\ndirection = \"in\"\n");
        assert!(e.contains("unknown variant"), "{e}");
        let e = err("[firewall]\ndefualt_inbound = \"allow\"\n");
        assert!(e.contains("unknown field"), "{e}");
        let e = err("[firewall]\nudp_timeout_s = 0\n");
        assert!(e.contains("udp_timeout_s"), "{e}");
    }
}
