//! Validated firewall rules: CIDR prefixes, port ranges, protocols, and first-match evaluation.
//!
//! Rules are compiled once by [`compile`] from the configuration; a bad rule is refused with its
//! position, its name and the reason, so an operator can fix the file without guessing.

use crate::config::{Action, Direction, PortSpec, RuleConfig};
use pliant_net::proto;
use pliant_runtime::Side;
use std::fmt;
use std::net::IpAddr;

/// An address prefix. IPv4 prefixes match only IPv4 packets and IPv6 prefixes only IPv6 ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cidr {
    V4 { net: u32, prefix: u8 },
    V6 { net: u128, prefix: u8 },
}

impl Cidr {
    /// Parses `a.b.c.d/n`, `x::y/n` or a bare address (a host prefix). Host bits must be zero:
    /// `10.0.0.1/8` is far more often a typo than an intent, so it is refused.
    pub fn parse(s: &str) -> Result<Cidr, String> {
        let (addr_s, prefix_s) = match s.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s, None),
        };
        let addr: IpAddr = addr_s
            .trim()
            .parse()
            .map_err(|_| format!("{s:?} is not an IP address or CIDR prefix"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix_s {
            None => max,
            Some(p) => p
                .trim()
                .parse::<u8>()
                .map_err(|_| format!("{s:?}: prefix length {p:?} is not a number"))?,
        };
        if prefix > max {
            return Err(format!("{s:?}: prefix length {prefix} exceeds {max}"));
        }
        let cidr = match addr {
            IpAddr::V4(a) => Cidr::V4 {
                net: u32::from(a),
                prefix,
            },
            IpAddr::V6(a) => Cidr::V6 {
                net: u128::from(a),
                prefix,
            },
        };
        let host_bits_set = match cidr {
            Cidr::V4 { net, prefix } => net & !mask_v4(prefix) != 0,
            Cidr::V6 { net, prefix } => net & !mask_v6(prefix) != 0,
        };
        if host_bits_set {
            return Err(format!(
                "{s:?}: address has bits set beyond the /{prefix} prefix"
            ));
        }
        Ok(cidr)
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        match (*self, ip) {
            (Cidr::V4 { net, prefix }, IpAddr::V4(a)) => u32::from(a) & mask_v4(prefix) == net,
            (Cidr::V6 { net, prefix }, IpAddr::V6(a)) => u128::from(a) & mask_v6(prefix) == net,
            _ => false,
        }
    }
}

fn mask_v4(prefix: u8) -> u32 {
    // `checked_shl` because a shift by the full width (prefix 0) overflows.
    u32::MAX
        .checked_shl(32 - u32::from(prefix.min(32)))
        .unwrap_or(0)
}

fn mask_v6(prefix: u8) -> u128 {
    u128::MAX
        .checked_shl(128 - u32::from(prefix.min(128)))
        .unwrap_or(0)
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Cidr::V4 { net, prefix } => write!(f, "{}/{prefix}", std::net::Ipv4Addr::from(net)),
            Cidr::V6 { net, prefix } => write!(f, "{}/{prefix}", std::net::Ipv6Addr::from(net)),
        }
    }
}

/// Which protocols a rule covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProtoMatch {
    Any,
    /// ICMP for IPv4 and ICMPv6 alike (one name for "ping and its errors").
    Icmp,
    Number(u8),
}

impl ProtoMatch {
    fn parse(s: &str) -> Result<ProtoMatch, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "any" | "all" => Ok(ProtoMatch::Any),
            "tcp" => Ok(ProtoMatch::Number(proto::TCP)),
            "udp" => Ok(ProtoMatch::Number(proto::UDP)),
            "icmp" | "icmpv6" | "icmp6" => Ok(ProtoMatch::Icmp),
            other => other.parse::<u8>().map(ProtoMatch::Number).map_err(|_| {
                format!("proto {s:?} is not one of any, tcp, udp, icmp or a number 0-255")
            }),
        }
    }

    fn matches(self, p: u8) -> bool {
        match self {
            ProtoMatch::Any => true,
            ProtoMatch::Icmp => p == proto::ICMP || p == proto::ICMPV6,
            ProtoMatch::Number(n) => n == p,
        }
    }

    fn has_ports(self) -> bool {
        matches!(
            self,
            ProtoMatch::Number(proto::TCP) | ProtoMatch::Number(proto::UDP)
        )
    }
}

/// An inclusive port range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortRange {
    pub lo: u16,
    pub hi: u16,
}

impl PortRange {
    fn parse(spec: &PortSpec) -> Result<PortRange, String> {
        let one = |n: i64| -> Result<u16, String> {
            u16::try_from(n).map_err(|_| format!("port {n} is outside 0-65535"))
        };
        match spec {
            PortSpec::Number(n) => {
                let p = one(*n)?;
                Ok(PortRange { lo: p, hi: p })
            }
            PortSpec::Text(s) => {
                let num = |t: &str| -> Result<u16, String> {
                    let n = t
                        .trim()
                        .parse::<i64>()
                        .map_err(|_| format!("port range {s:?}: {t:?} is not a number"))?;
                    one(n)
                };
                let (lo, hi) = match s.split_once('-') {
                    Some((a, b)) => (num(a)?, num(b)?),
                    None => {
                        let p = num(s)?;
                        (p, p)
                    }
                };
                if lo > hi {
                    return Err(format!("port range {s:?} is empty (start above end)"));
                }
                Ok(PortRange { lo, hi })
            }
        }
    }

    fn contains(&self, p: u16) -> bool {
        self.lo <= p && p <= self.hi
    }
}

/// One compiled rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    pub name: Option<String>,
    pub action: Action,
    pub direction: Direction,
    pub proto: ProtoMatch,
    pub src: Option<Cidr>,
    pub dst: Option<Cidr>,
    /// Empty means any port.
    pub src_ports: Vec<PortRange>,
    pub dst_ports: Vec<PortRange>,
}

/// The fields of a packet that rules look at.
#[derive(Clone, Copy, Debug)]
pub struct Probe {
    /// The side the packet arrived on (`Inside` = outbound traffic).
    pub ingress: Side,
    pub proto: u8,
    pub src: IpAddr,
    pub dst: IpAddr,
    pub sport: u16,
    pub dport: u16,
}

impl Rule {
    pub fn matches(&self, p: &Probe) -> bool {
        let dir_ok = match self.direction {
            Direction::Any => true,
            Direction::Outbound => p.ingress == Side::Inside,
            Direction::Inbound => p.ingress == Side::Outside,
        };
        let ports_ok = |ranges: &[PortRange], port: u16| {
            ranges.is_empty() || ranges.iter().any(|r| r.contains(port))
        };
        dir_ok
            && self.proto.matches(p.proto)
            && cidr_ok(self.src, p.src)
            && cidr_ok(self.dst, p.dst)
            && ports_ok(&self.src_ports, p.sport)
            && ports_ok(&self.dst_ports, p.dport)
    }
}

/// An absent prefix matches any address.
fn cidr_ok(c: Option<Cidr>, ip: IpAddr) -> bool {
    match c {
        None => true,
        Some(c) => c.contains(ip),
    }
}

/// Bound on the number of rules: evaluation is a linear scan per new flow.
pub const MAX_RULES: usize = 4096;

/// Compiles and validates the configured rules. The error names the rule (1-based position and
/// name) and the reason.
pub fn compile(cfgs: &[RuleConfig]) -> Result<Vec<Rule>, String> {
    if cfgs.len() > MAX_RULES {
        return Err(format!(
            "{} rules configured; at most {MAX_RULES} are allowed",
            cfgs.len()
        ));
    }
    cfgs.iter()
        .enumerate()
        .map(|(i, rc)| {
            compile_one(rc).map_err(|why| match &rc.name {
                Some(n) => format!("rule #{} ({n:?}): {why}", i + 1),
                None => format!("rule #{}: {why}", i + 1),
            })
        })
        .collect()
}

fn compile_one(rc: &RuleConfig) -> Result<Rule, String> {
    let proto = ProtoMatch::parse(&rc.proto)?;
    let cidr = |field: &str, v: &Option<String>| -> Result<Option<Cidr>, String> {
        match v.as_deref().map(str::trim) {
            None | Some("any") => Ok(None),
            Some(s) => Cidr::parse(s)
                .map(Some)
                .map_err(|e| format!("{field}: {e}")),
        }
    };
    let src = cidr("src", &rc.src)?;
    let dst = cidr("dst", &rc.dst)?;
    if let (Some(a), Some(b)) = (src, dst) {
        if matches!(a, Cidr::V4 { .. }) != matches!(b, Cidr::V4 { .. }) {
            return Err(format!(
                "src {a} and dst {b} are of different IP families; the rule could never match"
            ));
        }
    }
    let ports = |field: &str, specs: &[PortSpec]| -> Result<Vec<PortRange>, String> {
        specs
            .iter()
            .map(|s| PortRange::parse(s).map_err(|e| format!("{field}: {e}")))
            .collect()
    };
    let src_ports = ports("src_ports", &rc.src_ports)?;
    let dst_ports = ports("dst_ports", &rc.dst_ports)?;
    if (!src_ports.is_empty() || !dst_ports.is_empty()) && !proto.has_ports() {
        return Err(format!(
            "ports are given but proto is {:?}; ports need proto \"tcp\" or \"udp\"",
            rc.proto
        ));
    }
    Ok(Rule {
        name: rc.name.clone(),
        action: rc.action,
        direction: rc.direction,
        proto,
        src,
        dst,
        src_ports,
        dst_ports,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, Ipv6Addr};

    fn v4(a: u8, b: u8, c: u8, d: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(a, b, c, d))
    }

    #[test]
    fn cidr_contains_and_families() {
        let c = Cidr::parse("10.1.0.0/16").unwrap();
        assert!(c.contains(v4(10, 1, 200, 3)));
        assert!(!c.contains(v4(10, 2, 0, 1)));
        assert!(!c.contains(IpAddr::V6(Ipv6Addr::LOCALHOST)));
        let all = Cidr::parse("0.0.0.0/0").unwrap();
        assert!(all.contains(v4(255, 255, 255, 255)));
        let host = Cidr::parse("192.168.1.7").unwrap();
        assert!(host.contains(v4(192, 168, 1, 7)));
        assert!(!host.contains(v4(192, 168, 1, 8)));
        let v6 = Cidr::parse("fd00::/8").unwrap();
        assert!(v6.contains("fd12::1".parse().unwrap()));
        assert!(!v6.contains("fe80::1".parse().unwrap()));
        assert!(Cidr::parse("::/0")
            .unwrap()
            .contains("2001:db8::1".parse().unwrap()));
    }

    #[test]
    fn cidr_refusals_say_why() {
        assert!(Cidr::parse("10.0.0.0/33")
            .unwrap_err()
            .contains("exceeds 32"));
        assert!(Cidr::parse("10.0.0.1/8")
            .unwrap_err()
            .contains("beyond the /8"));
        assert!(Cidr::parse("10.0.0/8")
            .unwrap_err()
            .contains("not an IP address"));
        assert!(Cidr::parse("10.0.0.0/x")
            .unwrap_err()
            .contains("not a number"));
    }

    #[test]
    fn port_ranges() {
        assert_eq!(
            PortRange::parse(&PortSpec::Number(80)),
            Ok(PortRange { lo: 80, hi: 80 })
        );
        assert_eq!(
            PortRange::parse(&PortSpec::Text("1000-2000".into())),
            Ok(PortRange { lo: 1000, hi: 2000 })
        );
        assert!(PortRange::parse(&PortSpec::Number(70000))
            .unwrap_err()
            .contains("outside"));
        assert!(PortRange::parse(&PortSpec::Text("9-3".into()))
            .unwrap_err()
            .contains("empty"));
        assert!(PortRange::parse(&PortSpec::Text("http".into()))
            .unwrap_err()
            .contains("not a number"));
    }

    #[test]
    fn rule_matching() {
        let rc = RuleConfig {
            name: Some("web".into()),
            action: Action::Allow,
            direction: Direction::Inbound,
            proto: "tcp".into(),
            src: None,
            dst: Some("10.0.1.0/24".into()),
            src_ports: vec![],
            dst_ports: vec![PortSpec::Number(80), PortSpec::Text("8000-8080".into())],
        };
        let r = &compile(&[rc]).unwrap()[0];
        let mut p = Probe {
            ingress: Side::Outside,
            proto: proto::TCP,
            src: v4(8, 8, 8, 8),
            dst: v4(10, 0, 1, 5),
            sport: 5555,
            dport: 8042,
        };
        assert!(r.matches(&p));
        p.dport = 22;
        assert!(!r.matches(&p));
        p.dport = 80;
        p.ingress = Side::Inside;
        assert!(!r.matches(&p), "direction must be honoured");
        p.ingress = Side::Outside;
        p.proto = proto::UDP;
        assert!(!r.matches(&p), "protocol must be honoured");
    }

    #[test]
    fn compile_names_the_bad_rule() {
        let good = RuleConfig {
            name: None,
            action: Action::Allow,
            direction: Direction::Outbound,
            proto: "any".into(),
            src: None,
            dst: None,
            src_ports: vec![],
            dst_ports: vec![],
        };
        let mut bad = good.clone();
        bad.name = Some("ping".into());
        bad.proto = "icmp".into();
        bad.dst_ports = vec![PortSpec::Number(7)];
        let e = compile(&[good.clone(), bad]).unwrap_err();
        assert!(e.starts_with("rule #2 (\"ping\"): ports are given"), "{e}");
        let mut bad = good.clone();
        bad.src = Some("10.0.0.0/8".into());
        bad.dst = Some("fd00::/8".into());
        assert!(compile(&[bad])
            .unwrap_err()
            .contains("different IP families"));
        let mut bad = good;
        bad.proto = "gre-ish".into();
        assert!(compile(&[bad]).unwrap_err().starts_with("rule #1: proto"));
    }
}
