//! Replica configuration (TOML). CONTRACT: the lab builds these structs and writes them with
//! `to_toml()`; the replica loads them with `ReplicaConfig::load`, which refuses a bad file with
//! the line and the reason before anything starts.
//!
//! ```toml
//! [replica]
//! name = "r1"
//! control_socket = "/run/pliant/lab-x/r1.sock"   # unix socket, mode 0600
//! # metrics_listen = "127.0.0.1:9100"            # optional TCP listener; none by default
//!
//! [inside]                     # port towards the clients
//! ifname = "r1in"
//! addresses = ["10.77.1.1/24"] # router-role addresses answered for (ARP) on this side
//! # gateway = "10.77.1.254"    # next hop for destinations outside the connected subnets
//!
//! [outside]
//! ifname = "r1out"
//! addresses = ["10.77.2.1/24"]
//!
//! [nf]
//! kind = "nat"                 # nat | firewall | ids | mbserv | forward
//!
//! [nat]                        # the section named by nf.kind, parsed by that NF crate
//! external_ip = "10.77.2.1"
//! ```

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ReplicaConfig {
    pub replica: ReplicaSection,
    pub inside: PortConfig,
    pub outside: PortConfig,
    pub nf: NfSection,
    /// NF-specific sections (`[nat]`, `[firewall]`, ...), kept as TOML for the NF crate to parse.
    #[serde(flatten)]
    pub nf_sections: toml::Table,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ReplicaSection {
    pub name: String,
    pub control_socket: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics_listen: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PortConfig {
    pub ifname: String,
    /// CIDR strings, e.g. "10.77.1.1/24".
    pub addresses: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct NfSection {
    pub kind: String,
}
