//! The rewrites the NAT makes, on top of `pliant_net::rewrite` (incremental checksums;
//! the parse result in `pkt.meta` is kept in sync with the bytes). For ICMP echo,
//! `set_*_port` sets the echo identifier. Shared by [`crate::Nat`] and
//! [`crate::ftmb::FtmbNat`], which differ only in where mappings live and how drops are counted.

use crate::icmp_err::{self, Inner};
use crate::Mapping;
use pliant_net::rewrite::{self, RewriteError};
use pliant_runtime::{Packet, Side};
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

/// Translates an ICMP error `pkt` (quoting `inner`) about mapping `m` on external address
/// `ext`: the quoted packet and the outer address. Err is the drop reason: the quote does not
/// match the mapping (`nat_no_mapping`, nothing changed) or the outer rewrite was refused
/// (`nat_rewrite_failed`).
pub fn icmp_error(
    pkt: &mut Packet,
    inner: &Inner,
    m: &Mapping,
    ext: Ipv4Addr,
) -> Result<(), &'static str> {
    let ok = match pkt.ingress {
        // Quotes a packet we translated out: external endpoint -> remote.
        Side::Outside => {
            pkt.meta.dst == IpAddr::V4(ext)
                && inner.src == ext
                && inner.sport == m.external_port
                && inner.dst == m.remote_addr
        }
        // Quotes a reply we delivered in: remote -> inside endpoint.
        Side::Inside => {
            inner.src == m.remote_addr && inner.dst == m.inside_addr && inner.dport == m.inside_port
        }
    };
    if !ok || m.proto != inner.proto {
        return Err("nat_no_mapping");
    }
    let l4 = usize::from(pkt.meta.l4_off);
    let res = match pkt.ingress {
        Side::Outside => {
            icmp_err::rewrite_inner(
                &mut pkt.buf,
                l4,
                inner,
                icmp_err::End::Src,
                m.inside_addr,
                m.inside_port,
            );
            rewrite::set_dst_ip(&mut pkt.buf, &mut pkt.meta, IpAddr::V4(m.inside_addr))
        }
        Side::Inside => {
            icmp_err::rewrite_inner(
                &mut pkt.buf,
                l4,
                inner,
                icmp_err::End::Dst,
                ext,
                m.external_port,
            );
            rewrite::set_src_ip(&mut pkt.buf, &mut pkt.meta, IpAddr::V4(ext))
        }
    };
    res.map_err(|_| "nat_rewrite_failed")
}
