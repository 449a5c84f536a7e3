//! The lab's management network, for labs whose replicas talk over TCP as on separate hosts:
//! a bridge `mgmt0` in the fabric namespace and a veth `mg0` into each replica namespace
//! with address `10.254.0.<n>/24`. Only pliant's own channels use it (replication, the
//! migration peer channel, FTMB loggers); data traffic stays on the fabric's veths (in labs of
//! hosts: on VXLAN tunnels over this network, [`tunnel_ports`]), so the steering programs
//! never see the management traffic itself. The bridge itself has [`CONTROLLER_ADDR`]: the lab's
//! controller runs in the fabric namespace's network stack and reaches every replica's control
//! channel over TCP too. Each replica also runs on a private host view of the run directory
//! ([`crate::host`]): nothing between replicas goes through shared files.

use crate::cmd::{self, SETUP_TIMEOUT};
use crate::error::Result;
use crate::topology::Role;

/// How the replicas of a lab reach each other.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Transport {
    /// Unix sockets under the lab's run directory (one host).
    #[default]
    Unix,
    /// TCP over the management network (as between hosts).
    Tcp,
}

impl Transport {
    pub fn parse(s: &str) -> Option<Transport> {
        match s {
            "unix" => Some(Transport::Unix),
            "tcp" => Some(Transport::Tcp),
            _ => None,
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Transport::Unix => "unix",
            Transport::Tcp => "tcp",
        }
    }
}

/// The management bridge in the fabric namespace.
pub const BRIDGE: &str = "mgmt0";
/// Replica `n`'s management interface (in its namespace).
pub const REPLICA_IF: &str = "mg0";
/// Ports of each replica's channels on its management address.
pub const REPL_PORT: u16 = 7400;
pub const PEER_PORT: u16 = 7401;
pub const FTMB_PORT: u16 = 7402;
pub const CONTROL_PORT: u16 = 7403;
/// The controller's address on the management network (the bridge's own, in the fabric
/// namespace, where a TCP lab's controller runs: see [`controller_command`]).
pub const CONTROLLER_ADDR: &str = "10.254.0.254";

/// Replica `n`'s management address.
pub fn addr(n: u8) -> String {
    format!("10.254.0.{n}")
}

/// The controller's endpoint templates for this addressing plan (`{index}` is the replica
/// number; see the controller's `endpoint_of`).
pub const REPL_TEMPLATE: &str = "10.254.0.{index}:7400";
pub const PEER_TEMPLATE: &str = "10.254.0.{index}:7401";
pub const FTMB_TEMPLATE: &str = "10.254.0.{index}:7402";
pub const CONTROL_TEMPLATE: &str = "10.254.0.{index}:7403";

/// Replica `n`'s TCP control endpoint (`[replica] control_listen`).
pub fn control_listen(n: u8) -> String {
    format!("{}:{CONTROL_PORT}", addr(n))
}

/// The command prefix that runs a TCP lab's controller on the management network: in the
/// fabric namespace's network stack only (`nsenter --net`), so it keeps the host's mounts —
/// the pinned steering maps under /sys/fs/bpf and the replicas' host directories — as an
/// agent on the controller's host would.
pub fn controller_command(lab: &str) -> Vec<String> {
    vec![
        "nsenter".into(),
        format!("--net=/run/netns/{lab}-{}", Role::Fabric.suffix()),
        "--".into(),
    ]
}

/// The command that runs `bin controller --config cfg` as lab `state` runs its controller
/// ([`controller_argv`]); the caller sets its output and starts it.
pub fn controller_process(
    state: &crate::LabState,
    bin: &std::path::Path,
    cfg: &std::path::Path,
) -> std::process::Command {
    let argv = controller_argv(
        state,
        vec![
            bin.display().to_string(),
            "controller".into(),
            "--config".into(),
            cfg.display().to_string(),
        ],
    );
    let mut c = std::process::Command::new(&argv[0]);
    c.args(&argv[1..]);
    c
}

/// `program` (a controller command line) as lab `state` runs it: on the management network
/// in a TCP lab (its replicas are on private hosts), as it is otherwise.
pub fn controller_argv(state: &crate::LabState, program: Vec<String>) -> Vec<String> {
    match state.private_hosts {
        true => controller_command(&state.name)
            .into_iter()
            .chain(program)
            .collect(),
        false => program,
    }
}

fn run(args: &[&str]) -> Result<()> {
    let v: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    cmd::run_ok(&v, SETUP_TIMEOUT).map(|_| ())
}

/// Creates the bridge in `fabric` and connects replicas `1..=replicas` of lab `lab`.
pub fn install(fabric: &str, lab: &str, replicas: u8) -> Result<()> {
    run(&["ip", "-n", fabric, "link", "add", BRIDGE, "type", "bridge"])?;
    // Where br_netfilter is loaded (container hosts load it), a new namespace starts with
    // bridged frames sent through the IP firewall hooks: per frame of the replication,
    // logging and control channels, for nothing (the fabric has no rules for them). Off in
    // the fabric; without the module these keys do not exist and nothing needs turning off.
    let keys = [
        "net.bridge.bridge-nf-call-iptables",
        "net.bridge.bridge-nf-call-ip6tables",
        "net.bridge.bridge-nf-call-arptables",
    ];
    if std::path::Path::new("/proc/sys/net/bridge").exists() {
        let settings: Vec<String> = keys.iter().map(|k| format!("{k}=0")).collect();
        let mut args = vec!["sysctl", "-qw"];
        args.extend(settings.iter().map(String::as_str));
        cmd::run_ok(&cmd::in_ns(fabric, &args), SETUP_TIMEOUT)?;
    }
    let ctl = format!("{CONTROLLER_ADDR}/24");
    run(&["ip", "-n", fabric, "addr", "add", &ctl, "dev", BRIDGE])?;
    run(&["ip", "-n", fabric, "link", "set", BRIDGE, "up"])?;
    for n in 1..=replicas {
        connect(fabric, lab, n)?;
    }
    Ok(())
}

/// Connects replica `n` (also used by scale-out for a new replica).
pub fn connect(fabric: &str, lab: &str, n: u8) -> Result<()> {
    let ns = format!("{lab}-{}", Role::Replica(n).suffix());
    connect_ns(fabric, &ns, &format!("mg{n}"), &addr(n))
}

/// Connects namespace `ns` to the bridge (its side [`REPLICA_IF`], the bridge's `fab_if`)
/// with management address `addr`.
pub fn connect_ns(fabric: &str, ns: &str, fab_if: &str, addr: &str) -> Result<()> {
    run(&[
        "ip", "-n", ns, "link", "add", REPLICA_IF, "type", "veth", "peer", "name", fab_if, "netns",
        fabric,
    ])?;
    run(&["ip", "-n", fabric, "link", "set", fab_if, "master", BRIDGE])?;
    run(&["ip", "-n", fabric, "link", "set", fab_if, "up"])?;
    let cidr = format!("{addr}/24");
    run(&["ip", "-n", ns, "addr", "add", &cidr, "dev", REPLICA_IF])?;
    run(&["ip", "-n", ns, "link", "set", REPLICA_IF, "up"])
}

/// VXLAN's UDP port (IANA), for the data tunnels of host labs.
pub const VXLAN_PORT: u16 = 4789;
/// MTU of the management network when it carries the data tunnels: a full 1500-byte frame
/// plus VXLAN's 50 bytes of outer headers.
pub const TUNNEL_UNDERLAY_MTU: u32 = 1600;

/// The VXLAN network identifier of replica `n`'s inside (`outside = false`) or outside port.
pub fn vni(n: u8, outside: bool) -> u32 {
    1000 + 2 * u32::from(n) + u32::from(outside)
}

/// Host labs: replica `n`'s inside and outside ports reach the fabric through VXLAN tunnels
/// over the management network, as ports on another machine would (a tunnel per port, its
/// own VNI; the fabric's steering redirects into the tunnel device as into a veth). Each
/// port keeps its name and MAC, so nothing above the link sees a difference; the host then
/// shares nothing with the fabric but the management link. The underlay MTU is raised so a
/// 1500-byte frame fits.
pub fn tunnel_ports(fabric: &str, lab: &str, n: u8, disable_offloads: bool) -> Result<()> {
    use crate::topology::{fabric_in_if, fabric_out_if, replica_in_if, replica_out_if};
    use crate::topology::{IN_PORT_MAC, OUT_PORT_MAC};
    let ns = format!("{lab}-{}", Role::Replica(n).suffix());
    let mtu = TUNNEL_UNDERLAY_MTU.to_string();
    run(&["ip", "-n", &ns, "link", "set", REPLICA_IF, "mtu", &mtu])?;
    run(&[
        "ip",
        "-n",
        fabric,
        "link",
        "set",
        &format!("mg{n}"),
        "mtu",
        &mtu,
    ])?;
    run(&["ip", "-n", fabric, "link", "set", BRIDGE, "mtu", &mtu])?;
    let (host, hub) = (addr(n), CONTROLLER_ADDR.to_string());
    let port = VXLAN_PORT.to_string();
    for (rif, fif, mac, outside) in [
        (replica_in_if(n), fabric_in_if(n), IN_PORT_MAC, false),
        (replica_out_if(n), fabric_out_if(n), OUT_PORT_MAC, true),
    ] {
        let id = vni(n, outside).to_string();
        run(&[
            "ip", "-n", &ns, "link", "add", &rif, "address", mac, "mtu", "1500", "type", "vxlan",
            "id", &id, "local", &host, "remote", &hub, "dstport", &port, "dev", REPLICA_IF,
        ])?;
        run(&[
            "ip", "-n", fabric, "link", "add", &fif, "mtu", "1500", "type", "vxlan", "id", &id,
            "local", &hub, "remote", &host, "dstport", &port, "dev", BRIDGE,
        ])?;
        if disable_offloads {
            // As on the veths of other labs (`LabSpec::disable_offloads`). Not every feature
            // is changeable on a tunnel device; ethtool then exits non-zero although the others
            // were changed, so only a spawn failure is fatal.
            for (n_s, ifn) in [(ns.as_str(), rif.as_str()), (fabric, fif.as_str())] {
                let argv: Vec<String> = [
                    "ip", "netns", "exec", n_s, "ethtool", "-K", ifn, "tx", "off", "tso", "off",
                    "gso", "off", "gro", "off",
                ]
                .iter()
                .map(|x| x.to_string())
                .collect();
                cmd::run(&argv, SETUP_TIMEOUT)?;
            }
        }
        run(&["ip", "-n", &ns, "link", "set", &rif, "up"])?;
        run(&["ip", "-n", fabric, "link", "set", &fif, "up"])?;
    }
    Ok(())
}

/// Points replica `n`'s channels at its management address: `[migration] peer_socket`, and
/// with `[ha]` the replication listener and the FTMB logger.
pub fn tcp_endpoints(sections: &mut toml::Table, n: u8) {
    let a = addr(n);
    let mut mig = toml::Table::new();
    mig.insert("peer_socket".into(), format!("{a}:{PEER_PORT}").into());
    sections.insert("migration".into(), toml::Value::Table(mig));
    if let Some(toml::Value::Table(ha)) = sections.get_mut("ha") {
        ha.insert("repl_socket".into(), format!("{a}:{REPL_PORT}").into());
        if ha.get("mode").and_then(|m| m.as_str()) == Some("ftmb") {
            ha.insert("ftmb_socket".into(), format!("{a}:{FTMB_PORT}").into());
        }
    }
}

/// The lines a controller config needs for a TCP lab (`[controller]` and `[ha]` keys).
pub fn controller_keys() -> (String, String) {
    (
        format!("peer_endpoint = \"{PEER_TEMPLATE}\"\ncontrol_endpoint = \"{CONTROL_TEMPLATE}\"\n"),
        format!("repl_endpoint = \"{REPL_TEMPLATE}\"\nftmb_endpoint = \"{FTMB_TEMPLATE}\"\n"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_tunnelled_port_has_its_own_vni() {
        let mut seen = std::collections::BTreeSet::new();
        for n in 1..=u8::MAX {
            for outside in [false, true] {
                let v = vni(n, outside);
                assert!(v < 1 << 24, "VNIs are 24 bits");
                assert!(seen.insert(v), "r{n} {outside}: VNI {v} reused");
            }
        }
    }

    #[test]
    fn tcp_endpoints_point_every_channel_at_the_management_address() {
        let mut t = toml::Table::new();
        let mut ha = toml::Table::new();
        ha.insert("mode".into(), "ftmb".into());
        t.insert("ha".into(), toml::Value::Table(ha));
        tcp_endpoints(&mut t, 3);
        assert_eq!(
            t["migration"]["peer_socket"].as_str(),
            Some("10.254.0.3:7401")
        );
        assert_eq!(t["ha"]["repl_socket"].as_str(), Some("10.254.0.3:7400"));
        assert_eq!(t["ha"]["ftmb_socket"].as_str(), Some("10.254.0.3:7402"));
        let mut plain = toml::Table::new();
        tcp_endpoints(&mut plain, 1);
        assert!(!plain.contains_key("ha"));
        assert_eq!(Transport::parse("tcp"), Some(Transport::Tcp));
        assert_eq!(Transport::parse("udp"), None);
    }
}
