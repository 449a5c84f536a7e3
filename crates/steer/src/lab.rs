//! Glue for pliant-lab: steering over N replicas with the lab's port names, replacing the
//! single-replica tc mirred patch panel.

use crate::{FabricPorts, ReplicaPorts, Result, Steer, SteerOptions};
use std::net::IpAddr;

/// The lab's fabric port names (see pliant_lab::topology): `fabclient`, `fabserver`,
/// `fabr<n>in`, `fabr<n>out` for replicas `1..=replicas`.
pub fn lab_ports(replicas: u8) -> FabricPorts {
    FabricPorts {
        client: "fabclient".into(),
        server: "fabserver".into(),
        replicas: (1..=replicas)
            .map(|n| ReplicaPorts {
                index: u32::from(n),
                in_port: format!("fabr{n}in"),
                out_port: format!("fabr{n}out"),
            })
            .collect(),
    }
}

/// Attaches steering in the lab's fabric namespace `ns` for replicas `1..=replicas`, installs a
/// Maglev ring over all of them and registers `nat_addr` (the lab's outside gateway / NAT
/// address) for port-based return steering. The caller keeps the returned [`Steer`] alive
/// (dropping it detaches), or calls [`Steer::persist`] with a pin directory.
pub fn install(
    ns: &str,
    replicas: u8,
    nat_addr: Option<IpAddr>,
    opts: &SteerOptions,
) -> Result<Steer> {
    let ports = lab_ports(replicas);
    let mut s = Steer::attach(ns, &ports, opts)?;
    let live: Vec<u32> = ports.replicas.iter().map(|r| r.index).collect();
    s.set_ring_maglev(&live, crate::maglev::DEFAULT_RING_SIZE)?;
    if let Some(a) = nat_addr {
        s.add_nat_addr(a)?;
    }
    Ok(s)
}

/// Per-lab pin directory under bpffs.
pub fn pin_dir(lab_name: &str) -> std::path::PathBuf {
    std::path::Path::new("/sys/fs/bpf/pliant").join(lab_name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lab_ports_follow_the_lab_naming() {
        let p = lab_ports(3);
        assert_eq!(p.client, "fabclient");
        assert_eq!(p.replicas.len(), 3);
        assert_eq!(p.replicas[2].in_port, "fabr3in");
        assert_eq!(p.replicas[2].out_port, "fabr3out");
        assert_eq!(p.replicas[0].index, 1);
    }
}
