//! The property the fuzz target checks, kept here so unit tests run exactly the same code:
//! whatever the input, `parse` does not panic, and for a frame it accepts, every rewrite keeps
//! the checksums equal to a from-scratch recomputation and the frame re-parses to the updated
//! `Parsed`. Returns a description of the first violation instead of panicking, so the caller
//! (fuzz target or test) decides how to fail.

use crate::icmp_error;
use crate::rewrite::{self, Side};
use crate::{ipv4_header_ok, l4_checksum_ok, parse, recompute_checksums, Frame, Parsed};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// FNV-1a: derives "random" rewrite values from the input itself, so a failing input alone
/// reproduces the failure.
fn fnv(data: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in data {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

fn check(frame: &[u8], p: &Parsed, step: &str) -> Result<(), String> {
    if !ipv4_header_ok(frame, p) {
        return Err(format!("{step}: IPv4 header checksum does not verify"));
    }
    if !l4_checksum_ok(frame, p) {
        return Err(format!("{step}: L4 checksum does not verify"));
    }
    let mut fresh = frame.to_vec();
    if !recompute_checksums(&mut fresh, p) {
        return Err(format!("{step}: frame shorter than Parsed says"));
    }
    if fresh != frame {
        return Err(format!(
            "{step}: incremental checksum differs from recomputation"
        ));
    }
    match parse(frame) {
        Ok(Frame::Ip(q)) if q == *p => Ok(()),
        other => Err(format!("{step}: re-parse gave {other:?}, expected {p:?}")),
    }
}

/// Runs the parse + rewrite round trip on `data`. `Ok` for inputs that do not parse.
pub fn parse_and_rewrite(data: &[u8]) -> Result<(), String> {
    let Ok(Frame::Ip(mut p)) = parse(data) else {
        return Ok(());
    };
    let mut f = data.to_vec();
    if !recompute_checksums(&mut f, &p) {
        return Err("recompute_checksums refused a frame parse accepted".into());
    }
    check(&f, &p, "after recompute")?;
    let h = fnv(data);
    let (a, b) = (h as u32, (h >> 32) as u32);
    let (new_src, new_dst) = if p.src.is_ipv4() {
        (IpAddr::V4(Ipv4Addr::from(a)), IpAddr::V4(Ipv4Addr::from(b)))
    } else {
        let x = u128::from(h) << 64 | u128::from(!h);
        (
            IpAddr::V6(Ipv6Addr::from(x)),
            IpAddr::V6(Ipv6Addr::from(x.rotate_left(17))),
        )
    };
    if let Some(mut i) = icmp_error::inner(&f, &p) {
        icmp_error::set_inner_ip(&mut f, &p, &mut i, Side::Src, new_dst)
            .map_err(|e| format!("set_inner_ip: {e}"))?;
        check(&f, &p, "set_inner_ip")?;
        if i.ports_present {
            icmp_error::set_inner_port(&mut f, &p, &mut i, Side::Dst, b as u16)
                .map_err(|e| format!("set_inner_port: {e}"))?;
            check(&f, &p, "set_inner_port")?;
        }
        if icmp_error::inner(&f, &p) != Some(i) {
            return Err("embedded packet re-parses differently after its rewrite".into());
        }
    }
    rewrite::set_src_ip(&mut f, &mut p, new_src).map_err(|e| format!("set_src_ip: {e}"))?;
    check(&f, &p, "set_src_ip")?;
    rewrite::set_dst_ip(&mut f, &mut p, new_dst).map_err(|e| format!("set_dst_ip: {e}"))?;
    check(&f, &p, "set_dst_ip")?;
    let has_ports = !p.fragment && matches!(p.proto, crate::proto::TCP | crate::proto::UDP);
    if has_ports {
        rewrite::set_port(&mut f, &mut p, Side::Src, a as u16, Default::default())
            .map_err(|e| format!("set_src_port: {e}"))?;
        check(&f, &p, "set_src_port")?;
        rewrite::set_dst_port(&mut f, &mut p, b as u16)
            .map_err(|e| format!("set_dst_port: {e}"))?;
        check(&f, &p, "set_dst_port")?;
    } else if p.is_icmp_echo() {
        rewrite::set_icmp_id(&mut f, &mut p, (a >> 16) as u16)
            .map_err(|e| format!("set_icmp_id: {e}"))?;
        check(&f, &p, "set_icmp_id")?;
    } else if rewrite::set_src_port(&mut f, &mut p, 1).is_ok() {
        return Err("set_src_port accepted a packet without ports".into());
    }
    let ttl = p.ttl;
    let ok = rewrite::dec_ttl(&mut f, &mut p);
    if ok != (ttl > 1) || p.ttl != if ok { ttl - 1 } else { ttl } {
        return Err(format!(
            "dec_ttl from {ttl} returned {ok}, ttl now {}",
            p.ttl
        ));
    }
    check(&f, &p, "dec_ttl")?;
    rewrite::set_src_mac(&mut f, &mut p, [2, 0, 0, 0, 0, 1]).map_err(|e| e.to_string())?;
    rewrite::set_dst_mac(&mut f, &mut p, [2, 0, 0, 0, 0, 2]).map_err(|e| e.to_string())?;
    check(&f, &p, "set_macs")
}
