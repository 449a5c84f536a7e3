//! The fabric namespace is a patch panel: frames entering one port are redirected, by tc on
//! that port's ingress, out of another port, never touching the fabric's own IP stack (it has no
//! addresses and IPv6 is disabled). This module is the one place that decides *where* frames go,
//! so replacing the fixed single-replica patch with tc-BPF steering over N replicas (the
//! elasticity issue) only replaces `install`.
//!
//! The rule is `u32 match u32 0 0` (match everything) because this kernel has no `matchall`
//! or `flower` classifier modules; u32 is built in.

use crate::cmd::{self, SETUP_TIMEOUT};
use crate::error::Result;
use crate::topology::{fabric_in_if, fabric_out_if, FAB_CLIENT_IF, FAB_SERVER_IF, OUTSIDE_GW_IP};

/// One redirect rule: frames arriving on `from` leave through `to`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Patch {
    pub from: String,
    pub to: String,
}

/// The patch list for one replica (r1): client <-> r1 in-port, server <-> r1 out-port.
pub fn single_replica_patches(n: u8) -> Vec<Patch> {
    let p = |from: String, to: String| Patch { from, to };
    vec![
        p(FAB_CLIENT_IF.into(), fabric_in_if(n)),
        p(fabric_in_if(n), FAB_CLIENT_IF.into()),
        p(FAB_SERVER_IF.into(), fabric_out_if(n)),
        p(fabric_out_if(n), FAB_SERVER_IF.into()),
    ]
}

/// The tc commands (argv, to run inside the fabric namespace) for a patch list.
pub fn tc_commands(patches: &[Patch]) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for p in patches {
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        out.push(s(&["tc", "qdisc", "add", "dev", &p.from, "clsact"]));
        out.push(s(&[
            "tc", "filter", "add", "dev", &p.from, "ingress", "protocol", "all", "u32", "match",
            "u32", "0", "0", "action", "mirred", "egress", "redirect", "dev", &p.to,
        ]));
    }
    out
}

/// Install the steering for `replicas` replicas in the fabric namespace `ns`. One replica keeps
/// the tc mirred patch panel (no flow state needed); two or more get pliant-steer's BPF
/// steering (Maglev ring over all replicas, conn pins, `OUTSIDE_GW_IP` registered as the NAT
/// address, maps pinned under `/sys/fs/bpf/pliant/<ns>`), returned so the caller keeps it alive.
/// NAT port blocks (`port_owner`) are set per replica by `Lab::up` (`ha::pin_nat_ports`) and
/// re-assigned by a controller.
pub fn install(ns: &str, replicas: u8) -> Result<Option<pliant_steer::Steer>> {
    if replicas > 1 {
        let opts = pliant_steer::SteerOptions {
            pin_dir: Some(pliant_steer::lab::pin_dir(ns)),
            ..Default::default()
        };
        let nat = OUTSIDE_GW_IP.parse().ok();
        return Ok(Some(pliant_steer::lab::install(ns, replicas, nat, &opts)?));
    }
    for argv in tc_commands(&single_replica_patches(1)) {
        let refs: Vec<&str> = argv.iter().map(String::as_str).collect();
        cmd::run_ok(&cmd::in_ns(ns, &refs), SETUP_TIMEOUT)?;
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_port_is_patched_exactly_once_and_symmetrically() {
        let p = single_replica_patches(1);
        let mut froms: Vec<&str> = p.iter().map(|x| x.from.as_str()).collect();
        froms.sort();
        froms.dedup();
        assert_eq!(
            froms.len(),
            4,
            "each fabric port has exactly one ingress rule"
        );
        for x in &p {
            assert!(
                p.iter().any(|y| y.from == x.to && y.to == x.from),
                "no return path for {x:?}"
            );
        }
    }

    #[test]
    fn tc_commands_redirect_to_the_patch_target() {
        let cmds = tc_commands(&single_replica_patches(1));
        assert_eq!(cmds.len(), 8);
        let first_filter = &cmds[1];
        assert_eq!(first_filter.last().map(String::as_str), Some("fabr1in"));
        assert!(first_filter.contains(&"fabclient".to_string()));
    }
}
