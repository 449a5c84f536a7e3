//! Names and addresses of the lab topology. Interface names are fixed per role because every
//! lab has its own namespaces (a name only has to be unique inside its namespace); they are
//! <= 15 characters and none parses as an `ip` keyword.
//!
//! ```text
//! client ns (client0 10.77.1.2/24, gw .1) ── fabclient ┐
//!                                                       fabric ns ── fabr1in  ── r1in  ┐ replica r1 ns
//! server ns (server0 10.77.2.2/24, gw .1) ── fabserver ┘          └─ fabr1out ── r1out ┘
//! ```

use crate::error::LabError;
use std::fmt;

pub const CLIENT_IP: &str = "10.77.1.2";
pub const SERVER_IP: &str = "10.77.2.2";
/// Gateway of the client subnet: the replica's inside address (router role).
pub const INSIDE_GW_IP: &str = "10.77.1.1";
/// Gateway of the server subnet: the replica's outside address, also the NAT address.
pub const OUTSIDE_GW_IP: &str = "10.77.2.1";
pub const INSIDE_NET: &str = "10.77.1.0/24";
pub const PREFIX_LEN: u8 = 24;

/// Every replica's in-port and out-port carry the same MAC so that replicas are
/// interchangeable behind the fabric (steering can move a flow without ARP changes).
pub const IN_PORT_MAC: &str = "02:70:6c:00:01:01";
pub const OUT_PORT_MAC: &str = "02:70:6c:00:02:01";
pub const CLIENT_MAC: &str = "02:70:6c:00:01:02";
pub const SERVER_MAC: &str = "02:70:6c:00:02:02";

pub const CLIENT_IF: &str = "client0";
pub const SERVER_IF: &str = "server0";
pub const FAB_CLIENT_IF: &str = "fabclient";
pub const FAB_SERVER_IF: &str = "fabserver";

/// Replica `n`'s inside port (in its own namespace).
pub fn replica_in_if(n: u8) -> String {
    format!("r{n}in")
}
/// Replica `n`'s outside port.
pub fn replica_out_if(n: u8) -> String {
    format!("r{n}out")
}
/// Fabric end of replica `n`'s inside link.
pub fn fabric_in_if(n: u8) -> String {
    format!("fabr{n}in")
}
/// Fabric end of replica `n`'s outside link.
pub fn fabric_out_if(n: u8) -> String {
    format!("fabr{n}out")
}

/// A host of the lab. Replica numbers start at 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Client,
    Fabric,
    Server,
    Replica(u8),
}

impl Role {
    /// Suffix of the namespace name (`<lab>-<suffix>`).
    pub fn suffix(&self) -> String {
        match self {
            Role::Client => "client".into(),
            Role::Fabric => "fabric".into(),
            Role::Server => "server".into(),
            Role::Replica(n) => format!("r{n}"),
        }
    }

    pub fn parse(s: &str) -> Result<Role, LabError> {
        match s {
            "client" => Ok(Role::Client),
            "fabric" => Ok(Role::Fabric),
            "server" => Ok(Role::Server),
            _ => s
                .strip_prefix('r')
                .and_then(|n| n.parse::<u8>().ok())
                .filter(|n| *n >= 1)
                .map(Role::Replica)
                .ok_or_else(|| LabError::BadRole(s.to_string())),
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.suffix())
    }
}

/// Longest interface name the kernel accepts (IFNAMSIZ - 1).
pub const IFNAME_MAX: usize = 15;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interface_names_fit_ifnamsiz_for_all_replica_numbers() {
        for n in [1u8, 9, 99, 255] {
            for name in [
                replica_in_if(n),
                replica_out_if(n),
                fabric_in_if(n),
                fabric_out_if(n),
            ] {
                assert!(name.len() <= IFNAME_MAX, "{name}");
            }
        }
        for name in [CLIENT_IF, SERVER_IF, FAB_CLIENT_IF, FAB_SERVER_IF] {
            assert!(name.len() <= IFNAME_MAX && name.len() > 2, "{name}");
        }
    }

    #[test]
    fn roles_parse_and_print() {
        for r in [Role::Client, Role::Fabric, Role::Server, Role::Replica(3)] {
            assert_eq!(Role::parse(&r.to_string()).expect("parse"), r);
        }
        assert!(Role::parse("r0").is_err());
        assert!(Role::parse("router").is_err());
        assert!(Role::parse("").is_err());
    }
}
