//! Direction-normalised flow keys.
//!
//! Both directions of a connection map to the same [`FlowKey`]: the endpoint that sorts lower
//! (by address, then port) is stored as `lo`. The [`Dir`] returned alongside says which way a
//! given packet travels, so an NF can still tell initiator from responder if it records it.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// IP protocol numbers used across pliant.
pub mod proto {
    pub const ICMP: u8 = 1;
    pub const TCP: u8 = 6;
    pub const UDP: u8 = 17;
    pub const ICMPV6: u8 = 58;
}

/// A direction-normalised 5-tuple. `#[repr(C)]` because the C ABI passes it by pointer.
///
/// IPv4 addresses are stored as IPv4-mapped IPv6 (`::ffff:a.b.c.d`) so one layout serves both
/// families. For ICMP echo, both "ports" hold the echo identifier.
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, Default)]
pub struct FlowKey {
    /// 4 or 6.
    pub family: u8,
    /// IP protocol number (see [`proto`]).
    pub proto: u8,
    pub port_lo: u16,
    pub port_hi: u16,
    pub addr_lo: [u8; 16],
    pub addr_hi: [u8; 16],
}

/// Which way a packet travels relative to its normalised key.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub enum Dir {
    /// From the `lo` endpoint to the `hi` endpoint.
    LoToHi,
    /// From the `hi` endpoint to the `lo` endpoint.
    HiToLo,
}

impl Dir {
    pub fn reverse(self) -> Dir {
        match self {
            Dir::LoToHi => Dir::HiToLo,
            Dir::HiToLo => Dir::LoToHi,
        }
    }
}

fn addr_bytes(a: IpAddr) -> [u8; 16] {
    match a {
        IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        IpAddr::V6(v6) => v6.octets(),
    }
}

impl FlowKey {
    /// Builds the normalised key of a packet from `src` to `dst` and the packet's direction.
    pub fn new(proto: u8, src: IpAddr, sport: u16, dst: IpAddr, dport: u16) -> (FlowKey, Dir) {
        let family = if src.is_ipv4() { 4 } else { 6 };
        let a = (addr_bytes(src), sport);
        let b = (addr_bytes(dst), dport);
        let (lo, hi, dir) = if a <= b {
            (a, b, Dir::LoToHi)
        } else {
            (b, a, Dir::HiToLo)
        };
        (
            FlowKey {
                family,
                proto,
                port_lo: lo.1,
                port_hi: hi.1,
                addr_lo: lo.0,
                addr_hi: hi.0,
            },
            dir,
        )
    }

    /// Convenience for IPv4 tuples.
    pub fn v4(proto: u8, src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16) -> (FlowKey, Dir) {
        FlowKey::new(proto, IpAddr::V4(src), sport, IpAddr::V4(dst), dport)
    }

    fn ip(&self, raw: [u8; 16]) -> IpAddr {
        let v6 = Ipv6Addr::from(raw);
        if self.family == 4 {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return IpAddr::V4(v4);
            }
        }
        IpAddr::V6(v6)
    }

    pub fn lo(&self) -> (IpAddr, u16) {
        (self.ip(self.addr_lo), self.port_lo)
    }

    pub fn hi(&self) -> (IpAddr, u16) {
        (self.ip(self.addr_hi), self.port_hi)
    }

    /// `(src, sport, dst, dport)` of a packet travelling in `dir`.
    pub fn endpoints(&self, dir: Dir) -> ((IpAddr, u16), (IpAddr, u16)) {
        match dir {
            Dir::LoToHi => (self.lo(), self.hi()),
            Dir::HiToLo => (self.hi(), self.lo()),
        }
    }
}

impl fmt::Display for FlowKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let p = match self.proto {
            proto::TCP => "tcp".to_string(),
            proto::UDP => "udp".to_string(),
            proto::ICMP => "icmp".to_string(),
            proto::ICMPV6 => "icmp6".to_string(),
            n => format!("proto{n}"),
        };
        let (la, lp) = self.lo();
        let (ha, hp) = self.hi();
        match (la, ha) {
            (IpAddr::V6(_), _) => write!(f, "{p} [{la}]:{lp} <-> [{ha}]:{hp}"),
            _ => write!(f, "{p} {la}:{lp} <-> {ha}:{hp}"),
        }
    }
}

/// Why a string is not a [`FlowKey`] in its textual ([`fmt::Display`]) form.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("bad flow key {text:?}: {reason} (expected e.g. \"tcp 10.0.0.1:4000 <-> 10.0.0.2:80\")")]
pub struct ParseFlowKeyError {
    /// The offending text (shortened to 80 characters).
    pub text: String,
    pub reason: &'static str,
}

impl std::str::FromStr for FlowKey {
    type Err = ParseFlowKeyError;

    /// Parses exactly the [`fmt::Display`] form (`"tcp 10.77.1.2:40000 <-> 10.77.2.2:80"`,
    /// IPv6 in brackets, `proto<N>` for other protocols), so keys travel as strings in JSON.
    /// The endpoints are normalised again, so a key written with its endpoints swapped parses
    /// to the same key.
    fn from_str(s: &str) -> Result<FlowKey, ParseFlowKeyError> {
        let err = |reason| ParseFlowKeyError {
            text: s.chars().take(80).collect(),
            reason,
        };
        let (p, rest) = s
            .trim()
            .split_once(' ')
            .ok_or_else(|| err("missing protocol"))?;
        let proto = match p {
            "tcp" => proto::TCP,
            "udp" => proto::UDP,
            "icmp" => proto::ICMP,
            "icmp6" => proto::ICMPV6,
            other => other
                .strip_prefix("proto")
                .and_then(|n| n.parse::<u8>().ok())
                .ok_or_else(|| err("unknown protocol"))?,
        };
        let (a, b) = rest
            .split_once(" <-> ")
            .ok_or_else(|| err("missing \" <-> \" between the endpoints"))?;
        let a: std::net::SocketAddr = a.trim().parse().map_err(|_| err("bad first endpoint"))?;
        let b: std::net::SocketAddr = b.trim().parse().map_err(|_| err("bad second endpoint"))?;
        if a.is_ipv4() != b.is_ipv4() {
            return Err(err("endpoints of different address families"));
        }
        Ok(FlowKey::new(proto, a.ip(), a.port(), b.ip(), b.port()).0)
    }
}

impl fmt::Debug for FlowKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_directions_share_a_key() {
        let c = Ipv4Addr::new(10, 0, 1, 2);
        let s = Ipv4Addr::new(10, 0, 2, 2);
        let (k1, d1) = FlowKey::v4(proto::TCP, c, 40000, s, 80);
        let (k2, d2) = FlowKey::v4(proto::TCP, s, 80, c, 40000);
        assert_eq!(k1, k2);
        assert_ne!(d1, d2);
        assert_eq!(
            k1.endpoints(d1),
            ((IpAddr::V4(c), 40000), (IpAddr::V4(s), 80))
        );
        assert_eq!(
            k1.endpoints(d2),
            ((IpAddr::V4(s), 80), (IpAddr::V4(c), 40000))
        );
    }

    #[test]
    fn textual_form_round_trips() {
        let c = Ipv4Addr::new(10, 77, 1, 2);
        let s = Ipv4Addr::new(10, 77, 2, 2);
        let (k, _) = FlowKey::v4(proto::TCP, s, 80, c, 40000);
        let text = k.to_string();
        assert_eq!(text, "tcp 10.77.1.2:40000 <-> 10.77.2.2:80");
        assert_eq!(text.parse::<FlowKey>(), Ok(k));
        let v6a: IpAddr = "fd00::1".parse().unwrap();
        let v6b: IpAddr = "fd00::2".parse().unwrap();
        for p in [proto::UDP, proto::ICMP, proto::ICMPV6, 132] {
            let (k6, _) = FlowKey::new(p, v6b, 53, v6a, 5353);
            assert_eq!(k6.to_string().parse::<FlowKey>(), Ok(k6), "{k6}");
            let (k4, _) = FlowKey::v4(p, c, 1, s, 2);
            assert_eq!(k4.to_string().parse::<FlowKey>(), Ok(k4), "{k4}");
        }
        assert!(k6_text_has_brackets(v6a, v6b));
        // Swapped endpoints normalise to the same key.
        assert_eq!(
            "tcp 10.77.2.2:80 <-> 10.77.1.2:40000".parse::<FlowKey>(),
            Ok(k)
        );
        for bad in [
            "",
            "tcp",
            "tcp 10.0.0.1:1",
            "sctp 10.0.0.1:1 <-> 10.0.0.2:2",
            "tcp 10.0.0.1 <-> 10.0.0.2:2",
            "tcp 10.0.0.1:1 <-> [fd00::1]:2",
            "tcp 10.0.0.1:99999 <-> 10.0.0.2:2",
            "proto999 10.0.0.1:1 <-> 10.0.0.2:2",
        ] {
            assert!(bad.parse::<FlowKey>().is_err(), "{bad:?} parsed");
        }
    }

    fn k6_text_has_brackets(a: IpAddr, b: IpAddr) -> bool {
        FlowKey::new(proto::TCP, a, 1, b, 2).0.to_string() == "tcp [fd00::1]:1 <-> [fd00::2]:2"
    }

    #[test]
    fn ports_break_ties_between_equal_addresses() {
        let a = Ipv4Addr::new(10, 0, 0, 1);
        let (k1, _) = FlowKey::v4(proto::UDP, a, 9, a, 7);
        let (k2, _) = FlowKey::v4(proto::UDP, a, 7, a, 9);
        assert_eq!(k1, k2);
        assert_eq!(k1.port_lo, 7);
    }
}
