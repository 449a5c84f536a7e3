//! The two rewrites the NAT makes, on top of `pliant_net::rewrite` (incremental checksums;
//! the parse result in `pkt.meta` is kept in sync with the bytes). For ICMP echo,
//! `set_*_port` sets the echo identifier.

use pliant_net::rewrite::{self, RewriteError};
use pliant_runtime::Packet;
use std::net::{IpAddr, Ipv4Addr};

/// Outbound: source address and source port (ICMP echo: the identifier).
pub fn set_src(pkt: &mut Packet, addr: Ipv4Addr, port: u16) -> Result<(), RewriteError> {
    // Port first: if it is refused (no ports), the frame is still untouched.
    rewrite::set_src_port(&mut pkt.buf, &mut pkt.meta, port)?;
    rewrite::set_src_ip(&mut pkt.buf, &mut pkt.meta, IpAddr::V4(addr))
}

/// Inbound: destination address and port (ICMP echo: the identifier).
pub fn set_dst(pkt: &mut Packet, addr: Ipv4Addr, port: u16) -> Result<(), RewriteError> {
    rewrite::set_dst_port(&mut pkt.buf, &mut pkt.meta, port)?;
    rewrite::set_dst_ip(&mut pkt.buf, &mut pkt.meta, IpAddr::V4(addr))
}
