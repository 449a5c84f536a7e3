//! `DIR/state.json`: every host, namespace, cgroup and redis-server process a cluster owns, so
//! that `status`, `scale` and `down` (other processes than `up`) find them, and `down` stops only
//! what `up` and `scale` started, by PID.

use serde::{Deserialize, Serialize};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

pub const STATE_FILE: &str = "state.json";
pub const PASSWORD_FILE: &str = "password";
/// Port of partition `p`'s redis-server on any host: a host holds at most one copy of a
/// partition, so ports never clash, and a port names its partition.
pub const BASE_PORT: u16 = 7000;

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct HostRec {
    pub id: u32,
    /// The host's network namespace.
    pub ns: String,
    /// Its veth end in the fabric namespace (the peer is `<veth>i` in `ns`).
    pub veth: String,
    pub ip: Ipv4Addr,
    /// Its cgroup v1 cpu directory.
    pub cgroup: PathBuf,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct NodeRec {
    pub partition: usize,
    pub host: u32,
    pub port: u16,
    pub pid: i32,
    /// Redis Cluster node id.
    pub id: String,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct KvState {
    /// Unique per cluster: part of every namespace, interface and cgroup name.
    pub tag: String,
    pub dir: PathBuf,
    pub fabric_ns: String,
    pub bridge: String,
    /// Hosts are 10.214.`subnet`.(10 + id)/24; the bridge is .1.
    pub subnet: u8,
    pub partitions: usize,
    pub k: usize,
    pub cpu_quota_pct: u32,
    pub hosts: Vec<HostRec>,
    pub nodes: Vec<NodeRec>,
    pub next_host: u32,
}

impl KvState {
    pub fn load(dir: &Path) -> Result<KvState, String> {
        let p = dir.join(STATE_FILE);
        let text = std::fs::read_to_string(&p).map_err(|e| {
            format!(
                "{}: {e} (no cluster here: pliant kv up --dir ...)",
                p.display()
            )
        })?;
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", p.display()))
    }

    /// Atomic replace, so a reader never sees half a file.
    pub fn save(&self) -> Result<(), String> {
        let p = self.dir.join(STATE_FILE);
        let tmp = self.dir.join(format!("{STATE_FILE}.tmp"));
        let text = serde_json::to_string_pretty(self).map_err(|e| e.to_string())?;
        std::fs::write(&tmp, text).map_err(|e| format!("{}: {e}", tmp.display()))?;
        std::fs::rename(&tmp, &p).map_err(|e| format!("{}: {e}", p.display()))
    }

    pub fn host(&self, id: u32) -> Option<&HostRec> {
        self.hosts.iter().find(|h| h.id == id)
    }

    pub fn host_ip(&self, id: u32) -> Ipv4Addr {
        Ipv4Addr::new(10, 214, self.subnet, 10 + id as u8)
    }

    pub fn node_dir(&self, host: u32, partition: usize) -> PathBuf {
        self.dir
            .join(format!("h{host}"))
            .join(format!("p{partition}"))
    }

    /// The copies of `partition`, in no particular order.
    pub fn copies(&self, partition: usize) -> impl Iterator<Item = &NodeRec> {
        self.nodes.iter().filter(move |n| n.partition == partition)
    }

    /// The hosts (ids) of every partition's copies.
    pub fn placement(&self) -> Vec<Vec<u32>> {
        (0..self.partitions)
            .map(|p| self.copies(p).map(|n| n.host).collect())
            .collect()
    }

    /// Addresses (`redis://` URLs without credentials) of every node, for a cluster client.
    pub fn seed_urls(&self) -> Vec<String> {
        self.nodes
            .iter()
            .map(|n| format!("redis://{}:{}/", self.host_ip(n.host), n.port))
            .collect()
    }

    /// Marker of a node's process in /proc/PID/cmdline (redis-server shows `ip:port` in its
    /// process title), so a recycled PID is never signalled.
    pub fn marker(&self, n: &NodeRec) -> String {
        format!("{}:{}", self.host_ip(n.host), n.port)
    }
}
