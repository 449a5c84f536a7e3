//! The router role's view of one side: its addresses, connected subnets and gateway.

use crate::config::{Cidr, PortConfig};
use std::net::{IpAddr, Ipv4Addr};

#[derive(Clone, Debug)]
pub struct SideNet {
    pub ifname: String,
    /// Addresses the replica answers ARP for on this side, with their subnets.
    pub addrs: Vec<Cidr>,
    pub gateway: Option<IpAddr>,
}

impl SideNet {
    pub fn from_config(p: &PortConfig) -> Result<SideNet, String> {
        Ok(SideNet {
            ifname: p.ifname.clone(),
            addrs: p.cidrs()?,
            gateway: p.gateway_ip()?,
        })
    }

    /// True when `ip` is one of the replica's own addresses on this side.
    pub fn is_own(&self, ip: IpAddr) -> bool {
        self.addrs.iter().any(|c| c.addr == ip)
    }

    pub fn is_connected(&self, ip: IpAddr) -> bool {
        self.addrs.iter().any(|c| c.contains(ip))
    }

    /// Next hop for `dst`: itself if it is in a connected subnet, else the gateway.
    pub fn next_hop(&self, dst: IpAddr) -> Option<IpAddr> {
        if self.is_connected(dst) {
            Some(dst)
        } else {
            self.gateway.filter(|g| g.is_ipv4() == dst.is_ipv4())
        }
    }

    /// Our IPv4 address in the subnet of `ip` (the sender address of ARP requests for it).
    pub fn source_for(&self, ip: Ipv4Addr) -> Option<Ipv4Addr> {
        self.addrs
            .iter()
            .find(|c| c.contains(IpAddr::V4(ip)))
            .and_then(|c| match c.addr {
                IpAddr::V4(a) => Some(a),
                IpAddr::V6(_) => None,
            })
    }
}

impl SideNet {
    /// Our IPv4 address in the subnet of `ip`, else our first IPv4 address on this side (the
    /// source of ARP requests and of the router's ICMP errors).
    pub fn source_or_any(&self, ip: Ipv4Addr) -> Option<Ipv4Addr> {
        self.source_for(ip).or_else(|| {
            self.addrs.iter().find_map(|c| match c.addr {
                IpAddr::V4(a) => Some(a),
                IpAddr::V6(_) => None,
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn next_hop_prefers_connected_then_gateway() {
        let s = SideNet {
            ifname: "x".into(),
            addrs: vec![Cidr::parse("10.0.2.1/24").unwrap()],
            gateway: Some("10.0.2.254".parse().unwrap()),
        };
        assert_eq!(
            s.next_hop("10.0.2.7".parse().unwrap()),
            Some("10.0.2.7".parse().unwrap())
        );
        assert_eq!(
            s.next_hop("8.8.8.8".parse().unwrap()),
            Some("10.0.2.254".parse().unwrap())
        );
        assert_eq!(s.next_hop("fd00::1".parse().unwrap()), None);
        assert!(s.is_own("10.0.2.1".parse().unwrap()));
        assert_eq!(
            s.source_for("10.0.2.9".parse().unwrap()),
            Some("10.0.2.1".parse().unwrap())
        );
        let no_gw = SideNet { gateway: None, ..s };
        assert_eq!(no_gw.next_hop("8.8.8.8".parse().unwrap()), None);
    }
}
