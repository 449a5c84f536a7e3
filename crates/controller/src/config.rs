//! `ctl.toml`: the controller's configuration. Unknown keys are refused (a typo must not
//! silently fall back to a default).

use crate::policy::Policy;
use serde::Deserialize;
use std::path::{Path, PathBuf};

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ControllerConfig {
    pub controller: ControllerSection,
    #[serde(default)]
    pub lab: Option<LabSection>,
    #[serde(default)]
    pub replica: Vec<StaticReplica>,
    #[serde(default)]
    pub ports: Option<PortsSection>,
    #[serde(default)]
    pub policy: Option<Policy>,
    /// High availability (Pico replication); absent = off.
    #[serde(default)]
    pub ha: Option<crate::ha::HaConfig>,
    /// Where the controller keeps its state; absent = the embedded file store.
    #[serde(default)]
    pub store: Option<StoreSection>,
    /// The hosts' agents (replicas on several hosts); absent = the lab's namespaces.
    #[serde(default)]
    pub hosts: Option<crate::hosts::HostsSection>,
}

/// Which store backend holds the controller's state.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum StoreBackend {
    /// One JSON file (`[controller] store`): one controller on one host.
    #[default]
    File,
    /// An etcd cluster: controllers on several hosts share it.
    Etcd,
}

/// `[store]`: the controller's state backend.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct StoreSection {
    #[serde(default)]
    pub backend: StoreBackend,
    /// etcd client URLs (`http://10.0.0.5:2379`); etcd only.
    #[serde(default)]
    pub endpoints: Vec<String>,
    /// Prefix of every key in etcd, ending in `/`: one etcd can hold several pliant clusters.
    #[serde(default = "d_store_prefix")]
    pub prefix: String,
    /// Bound on each etcd request. A store that does not answer in time is unavailable: the
    /// controller then changes no placement and `pliant status` says so.
    #[serde(default = "d_store_request_timeout_ms")]
    pub request_timeout_ms: u64,
    /// Bound on connecting to one etcd endpoint.
    #[serde(default = "d_store_connect_timeout_ms")]
    pub connect_timeout_ms: u64,
    /// Mutual TLS towards etcd (`https://` endpoints): the CA of etcd's certificate, and this
    /// controller's client certificate and key (mode 0600, owned by the controller's user).
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    #[serde(default)]
    pub cert_file: Option<PathBuf>,
    #[serde(default)]
    pub key_file: Option<PathBuf>,
    /// Allows `http://` endpoints that are not loopback (unauthenticated, unencrypted etcd
    /// traffic between hosts). Off: such a config is refused.
    #[serde(default)]
    pub insecure_plaintext: bool,
}

/// Whether an etcd client URL names this host's loopback (`http://127.0.0.1:2379`,
/// `http://[::1]:2379`, `http://localhost:2379`).
fn is_loopback_url(url: &str) -> bool {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let hostport = rest.split('/').next().unwrap_or(rest);
    let host = match hostport.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(""),
        None => hostport.rsplit_once(':').map_or(hostport, |(h, _)| h),
    };
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

fn d_store_prefix() -> String {
    "/pliant/default/".into()
}
fn d_store_request_timeout_ms() -> u64 {
    2000
}
fn d_store_connect_timeout_ms() -> u64 {
    2000
}

impl StoreSection {
    /// The etcd client options this section describes.
    pub fn etcd_options(&self) -> crate::store::EtcdOptions {
        let mut o = crate::store::EtcdOptions::new(self.endpoints.clone(), &self.prefix);
        o.request_timeout = std::time::Duration::from_millis(self.request_timeout_ms);
        o.connect_timeout = std::time::Duration::from_millis(self.connect_timeout_ms);
        if let (Some(ca), Some(cert), Some(key)) = (&self.ca_file, &self.cert_file, &self.key_file)
        {
            o.tls = Some(crate::store::etcd::EtcdTls {
                ca: ca.clone(),
                cert: cert.clone(),
                key: key.clone(),
            });
        }
        o
    }
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ControllerSection {
    /// API unix socket (mode 0600).
    #[serde(default = "d_api_socket")]
    pub api_socket: PathBuf,
    /// Optional TCP listener, e.g. "127.0.0.1:7400" (same token).
    #[serde(default)]
    pub api_tcp: Option<String>,
    #[serde(default = "d_token_file")]
    pub token_file: PathBuf,
    #[serde(default = "d_store")]
    pub store: PathBuf,
    #[serde(default = "d_heartbeat_ms")]
    pub heartbeat_ms: u64,
    #[serde(default = "d_dead_after")]
    pub dead_after_missed: u32,
    #[serde(default = "d_rpc_timeout_ms")]
    pub rpc_timeout_ms: u64,
    /// Bound on one heartbeat (`stats`) and one HA status poll of a replica, connect and
    /// handshake included (capped at `rpc_timeout_ms`). A replica that does not answer in
    /// time misses that heartbeat; `dead_after_missed` misses in a row make it dead.
    #[serde(default = "d_heartbeat_timeout_ms")]
    pub heartbeat_timeout_ms: u64,
    /// How often the policy is evaluated (when `policy.auto`).
    #[serde(default = "d_policy_interval_ms")]
    pub policy_interval_ms: u64,
    /// How often exceptions of ended flows are collected.
    #[serde(default = "d_gc_interval_ms")]
    pub gc_interval_ms: u64,
    /// Run the controller's threads under SCHED_FIFO at this priority (1..=99; absent: the
    /// normal scheduler). The controller is the orchestrator of every migration (migrate_in,
    /// steering, migrate_out): its wake-ups are part of each flow's pause, as the replicas'
    /// are (`[replica] realtime_priority`), and of failure detection.
    #[serde(default)]
    pub realtime_priority: Option<u8>,
    /// Where each replica's migration peer channel is, told to sources: a template in which
    /// `{name}` is the replica's control socket stem and `{index}` its number
    /// (`"10.254.0.{index}:7401"`); absent, the unix socket beside the control socket.
    #[serde(default)]
    pub peer_endpoint: Option<String>,
    /// The controller's identity directory (CONTROLLER role, see `pliant keys issue`):
    /// replicas with a `[security]` identity answer only authenticated controllers.
    #[serde(default)]
    pub identity: Option<PathBuf>,
    /// Where each replica serves control on TCP (`[replica] control_listen`), a template like
    /// `peer_endpoint` (`"10.254.0.{index}:7403"`); absent, the replica's control socket.
    /// Needs `identity`.
    #[serde(default)]
    pub control_endpoint: Option<String>,
    /// This controller's name among the controllers sharing one etcd (shown as the leader);
    /// default `<hostname>-<pid>`.
    #[serde(default)]
    pub name: Option<String>,
    /// With `[store] backend = "etcd"`: the leadership lease's TTL (whole seconds; etcd's
    /// minimum with default flags is 2 s). A leader cut off from etcd stops acting within it;
    /// a standby takes over after it unless it sees the leader's process gone first (its
    /// `api_tcp` refusing connections), which takes `leader_poll_ms`.
    #[serde(default = "d_leader_ttl_ms")]
    pub leader_ttl_ms: u64,
    /// How often a standby looks at the leader (etcd read + a probe of its `api_tcp`).
    #[serde(default = "d_leader_poll_ms")]
    pub leader_poll_ms: u64,
}

fn d_leader_ttl_ms() -> u64 {
    2000
}
fn d_leader_poll_ms() -> u64 {
    25
}

/// Least heartbeat bound over TCP: one minimum retransmission timeout (200 ms) plus room for
/// the round trips of connect, handshake and answer.
pub const MIN_TCP_HEARTBEAT_TIMEOUT_MS: u64 = 300;

impl ControllerSection {
    /// The bound each heartbeat actually gets: `heartbeat_timeout_ms`, at most
    /// `rpc_timeout_ms`.
    pub fn heartbeat_ms_bound(&self) -> u64 {
        self.heartbeat_timeout_ms.min(self.rpc_timeout_ms)
    }

    /// How the controller reaches replicas' control channels (loads the identity).
    pub fn dialer(&self) -> Result<crate::replica_client::Dialer, String> {
        let security = self
            .identity
            .as_deref()
            .map(|d| {
                pliant_wire::Security::load(d, pliant_wire::Encrypt::Auto)
                    .map_err(|e| format!("controller.identity {}: {e}", d.display()))
            })
            .transpose()?;
        Ok(crate::replica_client::Dialer {
            security,
            template: self.control_endpoint.clone(),
            term: Default::default(),
            kept: Default::default(),
        })
    }
}

/// Replicas as namespaces of a running lab (agent + steering in its fabric).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct LabSection {
    pub name: String,
    #[serde(default = "d_run_root")]
    pub run_root: PathBuf,
    /// The `pliant` binary for new replicas (default: the one running the lab's replicas).
    #[serde(default)]
    pub pliant_bin: Option<PathBuf>,
    /// "attach": the controller attaches tc-BPF steering in `<lab>-fabric` and owns its maps;
    /// "agent": the fabric host's agent (`fabric_agent`) holds the maps and applies this
    /// controller's changes (a controller on another host than the fabric);
    /// "none": no steering (placement only, e.g. for tests without a fabric).
    #[serde(default = "d_steering")]
    pub steering: String,
    /// With `steering = "agent"`: the fabric host's agent (`host:port` or a unix path).
    #[serde(default)]
    pub fabric_agent: Option<String>,
    /// Its certified name.
    #[serde(default = "d_fabric_agent_name")]
    pub fabric_agent_name: String,
    /// The shared NAT address, steered by port block.
    #[serde(default)]
    pub nat_addr: Option<std::net::IpAddr>,
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct StaticReplica {
    pub index: u32,
    pub socket: PathBuf,
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PortsSection {
    #[serde(default = "d_port_lo")]
    pub lo: u16,
    #[serde(default = "d_port_hi")]
    pub hi: u16,
    #[serde(default = "d_port_block")]
    pub block: u16,
    #[serde(default = "d_per_replica")]
    pub per_replica: usize,
}

fn d_api_socket() -> PathBuf {
    PathBuf::from("/run/pliant/controller/api.sock")
}
fn d_token_file() -> PathBuf {
    PathBuf::from("/run/pliant/controller/token")
}
fn d_store() -> PathBuf {
    PathBuf::from("/run/pliant/controller/store.json")
}
fn d_heartbeat_ms() -> u64 {
    100
}
fn d_dead_after() -> u32 {
    5
}
fn d_rpc_timeout_ms() -> u64 {
    2000
}
fn d_heartbeat_timeout_ms() -> u64 {
    500
}
fn d_policy_interval_ms() -> u64 {
    500
}
fn d_gc_interval_ms() -> u64 {
    5000
}
fn d_run_root() -> PathBuf {
    PathBuf::from("/run/pliant")
}
fn d_steering() -> String {
    "attach".into()
}
fn d_fabric_agent_name() -> String {
    "fabric".into()
}
// The NAT NF's default pool (nf-nat: 20000-59999), in 10 blocks.
fn d_port_lo() -> u16 {
    20000
}
fn d_port_hi() -> u16 {
    59999
}
fn d_port_block() -> u16 {
    4000
}
fn d_per_replica() -> usize {
    1
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: {reason}")]
    Read { path: PathBuf, reason: String },
    #[error("{path}: {reason}")]
    Parse { path: PathBuf, reason: String },
    #[error("{path}: {reason}")]
    Invalid { path: PathBuf, reason: String },
}

impl ControllerConfig {
    pub fn parse(text: &str, path: &Path) -> Result<ControllerConfig, ConfigError> {
        let mut c: ControllerConfig = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        let bad = |reason: String| ConfigError::Invalid {
            path: path.to_path_buf(),
            reason,
        };
        if let Some(h) = &c.hosts {
            h.check(c.controller.identity.is_some() || c.lab.is_some())
                .map_err(bad)?;
        }
        if c.controller.heartbeat_ms == 0 || c.controller.heartbeat_ms > 60_000 {
            return Err(bad("controller.heartbeat_ms must be 1..=60000".into()));
        }
        if let Some(p) = c.controller.realtime_priority {
            if !pliant_runtime::sched::PRIORITIES.contains(&p) {
                return Err(bad(format!(
                    "controller.realtime_priority = {p}: use 1..=99 (or leave it out)"
                )));
            }
        }
        if c.controller.control_endpoint.is_some()
            && c.controller.identity.is_none()
            && c.lab.is_none()
        {
            return Err(bad(
                "controller.control_endpoint needs controller.identity (or a [lab], whose \
                 controller identity is used): replicas serve control on TCP only to \
                 authenticated controllers"
                    .into(),
            ));
        }
        if c.controller.dead_after_missed == 0 {
            return Err(bad("controller.dead_after_missed must be >= 1".into()));
        }
        if c.controller.rpc_timeout_ms == 0 || c.controller.rpc_timeout_ms > 600_000 {
            return Err(bad("controller.rpc_timeout_ms must be 1..=600000".into()));
        }
        if c.controller.heartbeat_timeout_ms == 0 || c.controller.heartbeat_timeout_ms > 60_000 {
            return Err(bad(
                "controller.heartbeat_timeout_ms must be 1..=60000".into()
            ));
        }
        if c.controller.control_endpoint.is_some() {
            // Over TCP, one lost segment must never kill a replica: a heartbeat must outlast
            // one retransmission of its request or answer (>= the 200 ms minimum RTO plus the
            // round trip), and a lost SYN (retransmitted after 1 s, longer than any heartbeat
            // bound) costs one whole heartbeat, so death needs more than one miss.
            let hb = c.controller.heartbeat_ms_bound();
            if hb < MIN_TCP_HEARTBEAT_TIMEOUT_MS {
                return Err(bad(format!(
                    "controller.heartbeat_timeout_ms = {} (capped at rpc_timeout_ms = {}): \
                     with control_endpoint (TCP) it must be >= {MIN_TCP_HEARTBEAT_TIMEOUT_MS} \
                     ms, so a heartbeat outlasts one TCP retransmission (minimum RTO {} ms)",
                    c.controller.heartbeat_timeout_ms,
                    c.controller.rpc_timeout_ms,
                    crate::ha::TCP_MIN_RTO_MS
                )));
            }
            if c.controller.dead_after_missed < 2 {
                return Err(bad(format!(
                    "controller.dead_after_missed = {}: with control_endpoint (TCP) it must be \
                     >= 2 (a lost SYN is retransmitted after 1 s and costs one heartbeat by \
                     itself)",
                    c.controller.dead_after_missed
                )));
            }
        }
        if !(1000..=60_000).contains(&c.controller.leader_ttl_ms) {
            return Err(bad(format!(
                "controller.leader_ttl_ms = {}: must be 1000..=60000",
                c.controller.leader_ttl_ms
            )));
        }
        if !(5..=5_000).contains(&c.controller.leader_poll_ms) {
            return Err(bad(format!(
                "controller.leader_poll_ms = {}: must be 5..=5000",
                c.controller.leader_poll_ms
            )));
        }
        if let Some(s) = &c.store {
            match s.backend {
                StoreBackend::File if !s.endpoints.is_empty() => {
                    return Err(bad(
                        "store.endpoints is set but store.backend is \"file\": set backend = \
                         \"etcd\" to use them"
                            .into(),
                    ))
                }
                StoreBackend::Etcd if s.endpoints.is_empty() => {
                    return Err(bad(
                        "store.backend = \"etcd\" needs store.endpoints (client URLs like \
                         \"http://10.0.0.5:2379\")"
                            .into(),
                    ))
                }
                _ => {}
            }
            let tls_files = [&s.ca_file, &s.cert_file, &s.key_file]
                .iter()
                .filter(|f| f.is_some())
                .count();
            if tls_files != 0 && tls_files != 3 {
                return Err(bad(
                    "store.ca_file, store.cert_file and store.key_file go together (mutual TLS \
                     towards etcd)"
                        .into(),
                ));
            }
            for e in &s.endpoints {
                let https = e.starts_with("https://");
                if !https && !e.starts_with("http://") {
                    return Err(bad(format!(
                        "store.endpoints: {e:?} is not an http:// or https:// URL"
                    )));
                }
                if https && tls_files == 0 {
                    return Err(bad(format!(
                        "store.endpoints: {e:?} is https but store.ca_file/cert_file/key_file \
                         are not set"
                    )));
                }
                if !https && tls_files == 3 {
                    return Err(bad(format!(
                        "store.endpoints: {e:?} is plain http but TLS files are set: use https://"
                    )));
                }
                if !https && !s.insecure_plaintext && !is_loopback_url(e) {
                    return Err(bad(format!(
                        "store.endpoints: {e:?} would carry the controller's state unauthenticated \
                         and unencrypted between hosts: use https:// with store.ca_file, \
                         cert_file and key_file (etcd with --client-cert-auth), or set \
                         store.insecure_plaintext = true"
                    )));
                }
            }
            if s.prefix.is_empty() || !s.prefix.ends_with('/') {
                return Err(bad(format!(
                    "store.prefix = {:?}: must be non-empty and end with '/'",
                    s.prefix
                )));
            }
            for (name, v) in [
                ("request_timeout_ms", s.request_timeout_ms),
                ("connect_timeout_ms", s.connect_timeout_ms),
            ] {
                // A LAN round trip plus an etcd commit (fsync) must fit; minutes would hang
                // every operation behind a dead etcd.
                if !(100..=60_000).contains(&v) {
                    return Err(bad(format!("store.{name} = {v}: must be 100..=60000")));
                }
            }
        }
        // With HA on the policy may not scale in below what protection needs. A
        // `min_replicas` the file does not set is raised to that floor (the default, 1, was
        // never a choice); one it sets lower is refused: the operator asked for something HA
        // cannot give.
        let ha_floor = c.ha.as_ref().map_or(1, crate::ha::ha_min_replicas);
        if let Some(p) = &mut c.policy {
            let explicit = toml::from_str::<toml::Table>(text).is_ok_and(|t| {
                t.get("policy")
                    .and_then(|p| p.as_table())
                    .is_some_and(|p| p.contains_key("min_replicas"))
            });
            if !explicit {
                p.min_replicas = p.floor(ha_floor);
            }
            p.check(ha_floor).map_err(|e| match &c.ha {
                Some(h) if p.min_replicas.min(p.max_replicas) < ha_floor => bad(format!(
                    "policy: {e} ([ha] mode = {})",
                    serde_json::to_string(&h.mode).unwrap_or_default()
                )),
                _ => bad(e.to_string()),
            })?;
        }
        if let Some(h) = &c.ha {
            h.check().map_err(|e| bad(format!("ha: {e}")))?;
        }
        if let Some(l) = &c.lab {
            if !["attach", "agent", "none"].contains(&l.steering.as_str()) {
                return Err(bad(format!(
                    "lab.steering = {:?}: expected \"attach\", \"agent\" or \"none\"",
                    l.steering
                )));
            }
            match (l.steering.as_str(), &l.fabric_agent) {
                ("agent", None) => {
                    return Err(bad(
                        "lab.steering = \"agent\" needs lab.fabric_agent (the fabric host's \
                         agent endpoint)"
                            .into(),
                    ))
                }
                ("agent", Some(ep)) => {
                    // The identity: controller.identity, or the lab's controller identity.
                    ep.parse::<pliant_wire::Endpoint>()
                        .map_err(|e| bad(format!("lab.fabric_agent {ep:?}: {e}")))?;
                    pliant_proto::agent::check_slot_name(&l.fabric_agent_name)
                        .map_err(|e| bad(format!("lab.fabric_agent_name: {e}")))?;
                }
                (_, Some(_)) => {
                    return Err(bad(format!(
                        "lab.fabric_agent is only for lab.steering = \"agent\" (it is {:?})",
                        l.steering
                    )))
                }
                _ => {}
            }
        }
        if let Some(p) = &c.ports {
            crate::ports::PortBlocks::new(p.lo, p.hi, p.block).map_err(|e| bad(e.to_string()))?;
            if p.per_replica == 0 {
                return Err(bad("ports.per_replica must be >= 1".into()));
            }
        }
        let mut seen = std::collections::BTreeSet::new();
        for r in &c.replica {
            if r.index == 0 || r.index >= 64 || !seen.insert(r.index) {
                return Err(bad(format!(
                    "replica index {} is out of 1..=63 or repeated",
                    r.index
                )));
            }
        }
        Ok(c)
    }

    pub fn load(path: &Path) -> Result<ControllerConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Read {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        ControllerConfig::parse(&text, path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> Result<ControllerConfig, ConfigError> {
        ControllerConfig::parse(s, Path::new("ctl.toml"))
    }

    #[test]
    fn minimal_config_gets_defaults() {
        let c = p("[controller]\n").unwrap();
        assert_eq!(c.controller.heartbeat_ms, 100);
        assert!(c.lab.is_none());
        assert!(c.replica.is_empty());
    }

    #[test]
    fn realtime_priority_is_optional_and_bounded() {
        assert_eq!(
            p("[controller]\n").unwrap().controller.realtime_priority,
            None
        );
        let c = p("[controller]\nrealtime_priority = 20\n").unwrap();
        assert_eq!(c.controller.realtime_priority, Some(20));
        let e = p("[controller]\nrealtime_priority = 0\n").unwrap_err();
        assert!(e.to_string().contains("1..=99"), "{e}");
        assert!(p("[controller]\nrealtime_priority = 100\n").is_err());
    }

    #[test]
    fn full_config_parses() {
        let c = p(r#"
[controller]
api_socket = "/tmp/x.sock"
api_tcp = "127.0.0.1:7400"
heartbeat_ms = 50
[lab]
name = "demo"
steering = "none"
[[replica]]
index = 1
socket = "/run/pliant/demo/r1.sock"
[ports]
per_replica = 2
[policy]
high_water_flows = 100
low_water_flows = 10
"#)
        .unwrap();
        assert_eq!(c.controller.api_tcp.as_deref(), Some("127.0.0.1:7400"));
        assert_eq!(c.policy.unwrap().high_water_flows, 100);
        assert_eq!(c.ports.unwrap().block, 4000);
    }

    #[test]
    fn ha_section_parses_with_defaults_and_is_validated() {
        let c = p("[controller]\n[ha]\n").unwrap();
        let h = c.ha.unwrap();
        assert_eq!(h.mode, crate::ha::HaMode::Pico);
        assert_eq!(h.policy, crate::ha::PolicyKind::Chords);
        assert_eq!(h.hz, 1000);
        assert_eq!(h.watch_ms, 10);
        let c = p("[controller]\n[ha]\nmode = \"remus\"\nremus_hz = 40\npolicy = \"single\"\n")
            .unwrap();
        assert_eq!(c.ha.unwrap().mode, crate::ha::HaMode::Remus);
        let c = p("[controller]\n[ha]\nmode = \"ftmb\"\nwatch_ms = 10\n").unwrap();
        assert_eq!(c.ha.unwrap().mode, crate::ha::HaMode::Ftmb);
        for (text, needle) in [
            ("[controller]\n[ha]\nmode = \"raid\"\n", "mode"),
            ("[controller]\n[ha]\nhz = 0\n", "hz"),
            ("[controller]\n[ha]\nhz = 200000\n", "hz"),
            ("[controller]\n[ha]\nwatch_ms = 0\n", "watch_ms"),
            ("[controller]\n[ha]\nvnodes = 0\n", "vnodes"),
            ("[controller]\n[ha]\nbogus = 1\n", "unknown field"),
        ] {
            let e = p(text).expect_err(text).to_string();
            assert!(e.contains(needle), "{text:?}: {e}");
        }
    }

    #[test]
    fn heartbeat_bounds_are_validated_and_tcp_control_needs_lan_safe_ones() {
        let c = p("[controller]\n").unwrap().controller;
        assert_eq!((c.heartbeat_timeout_ms, c.heartbeat_ms_bound()), (500, 500));
        // Capped at the RPC bound, as before the knob existed.
        let c = p("[controller]\nrpc_timeout_ms = 200\n")
            .unwrap()
            .controller;
        assert_eq!(c.heartbeat_ms_bound(), 200);
        // Unix sockets: any bound, even one miss = dead (unchanged).
        p("[controller]\nheartbeat_timeout_ms = 20\ndead_after_missed = 1\n").unwrap();
        let tcp = "[controller]\nidentity = \"/etc/pliant/ctl\"\n\
                   control_endpoint = \"10.254.0.{index}:7403\"\n";
        let c = p(tcp).unwrap().controller;
        assert_eq!((c.heartbeat_ms_bound(), c.dead_after_missed), (500, 5));
        p(&format!(
            "{tcp}heartbeat_timeout_ms = 300\ndead_after_missed = 2\n"
        ))
        .unwrap();
        for (extra, needle) in [
            (
                "heartbeat_timeout_ms = 0\n",
                "heartbeat_timeout_ms must be 1..=60000",
            ),
            (
                "heartbeat_timeout_ms = 60001\n",
                "heartbeat_timeout_ms must be 1..=60000",
            ),
            ("rpc_timeout_ms = 0\n", "rpc_timeout_ms must be"),
            (
                "heartbeat_timeout_ms = 250\n",
                "heartbeat_timeout_ms = 250 (capped at rpc_timeout_ms = 2000): with \
                 control_endpoint (TCP) it must be >= 300",
            ),
            (
                "rpc_timeout_ms = 250\n",
                "capped at rpc_timeout_ms = 250): with control_endpoint (TCP)",
            ),
            (
                "dead_after_missed = 1\n",
                "dead_after_missed = 1: with control_endpoint",
            ),
        ] {
            let text = format!("{tcp}{extra}");
            let e = p(&text).expect_err(&text).to_string();
            assert!(e.contains(needle), "{text:?}: {e}");
        }
        for text in [
            "[controller]\nheartbeat_timeout_ms = 0\n",
            "[controller]\n[ha]\nprobe_timeout_ms = 0\n",
            "[controller]\n[ha]\nsuspect_after_ms = 100\n",
        ] {
            let e = p(text).expect_err(text).to_string();
            assert!(e.contains("ctl.toml"), "{e}");
        }
        let h = p("[controller]\n[ha]\nprobe_timeout_ms = 250\nsuspect_after_ms = 2000\n")
            .unwrap()
            .ha
            .unwrap();
        assert_eq!((h.probe_timeout_ms, h.suspect_after_ms), (250, 2000));
    }

    #[test]
    fn the_store_section_chooses_the_backend() {
        assert_eq!(
            p("[controller]\n").unwrap().store,
            None,
            "file store by default"
        );
        let c = p(
            "[controller]\n[store]\nbackend = \"etcd\"\nendpoints = [\"http://10.0.0.5:2379\"]\ninsecure_plaintext = true\n",
        )
        .unwrap();
        let o = c.store.unwrap().etcd_options();
        assert_eq!(o.endpoints, vec!["http://10.0.0.5:2379".to_string()]);
        assert_eq!(o.prefix, "/pliant/default/");
        assert_eq!(o.request_timeout, std::time::Duration::from_millis(2000));
        assert_eq!(o.tls, None);
        let c = p(
            "[controller]\n[store]\nbackend = \"etcd\"\nendpoints = [\"https://10.0.0.5:2379\"]\n\
                   ca_file = \"/k/ca.crt\"\ncert_file = \"/k/c.crt\"\nkey_file = \"/k/c.key\"\n",
        )
        .unwrap();
        let t = c.store.unwrap().etcd_options().tls.expect("tls");
        assert_eq!(t.key, PathBuf::from("/k/c.key"));
        for (url, lo) in [
            ("http://127.0.0.1:2379", true),
            ("http://[::1]:2379", true),
            ("http://localhost:2379", true),
            ("http://10.0.0.5:2379", false),
            ("http://[fd00::1]:2379", false),
        ] {
            assert_eq!(is_loopback_url(url), lo, "{url}");
        }
    }

    #[test]
    fn min_replicas_not_set_is_raised_to_the_ha_floor_and_a_set_one_is_kept() {
        let min = |text: &str| p(text).unwrap().policy.unwrap().min_replicas;
        // The example's shape: [policy] without min_replicas, HA on.
        assert_eq!(
            min("[controller]\n[policy]\nhigh_water_flows = 60\n[ha]\nmode = \"pico\"\n"),
            2
        );
        assert_eq!(min("[controller]\n[policy]\nauto = true\n[ha]\n"), 2);
        assert_eq!(min("[controller]\n[policy]\nauto = true\n"), 1);
        assert_eq!(
            min("[controller]\n[policy]\nauto = true\n[ha]\nmode = \"off\"\n"),
            1
        );
        assert_eq!(
            min("[controller]\n[policy]\nmin_replicas = 3\n[ha]\nmode = \"pico\"\n"),
            3
        );
        // An explicit 1 with HA off is fine.
        assert_eq!(min("[controller]\n[policy]\nmin_replicas = 1\n"), 1);
    }

    #[test]
    fn bad_configs_are_refused_with_the_reason() {
        for (text, needle) in [
            ("[controller]\nheartbeat_msx = 1\n", "unknown field"),
            ("[controller]\nheartbeat_ms = 0\n", "heartbeat_ms"),
            (
                "[controller]\n[policy]\nlow_water_flows = 100\nhigh_water_flows = 10\n",
                "low_water",
            ),
            (
                "[controller]\n[lab]\nname = \"x\"\nsteering = \"magic\"\n",
                "steering",
            ),
            (
                "[controller]\n[[replica]]\nindex = 0\nsocket = \"/x\"\n",
                "index",
            ),
            ("[controller]\n[ports]\nlo = 100\nhi = 50\n", "port range"),
            ("[controller]\n[store]\nbackend = \"etcd\"\n", "needs store.endpoints"),
            (
                "[controller]\n[store]\nendpoints = [\"http://127.0.0.1:2379\"]\n",
                "backend = \"etcd\"",
            ),
            (
                "[controller]\n[store]\nbackend = \"etcd\"\nendpoints = [\"http://127.0.0.1:2379\"]\nprefix = \"/p\"\n",
                "end with '/'",
            ),
            (
                "[controller]\n[store]\nbackend = \"etcd\"\nendpoints = [\"http://127.0.0.1:2379\"]\nrequest_timeout_ms = 0\n",
                "request_timeout_ms",
            ),
            ("[controller]\n[store]\nbackend = \"zookeeper\"\n", "unknown variant"),
            (
                "[controller]\n[store]\nbackend = \"etcd\"\nendpoints = [\"http://10.0.0.5:2379\"]\n",
                "unauthenticated",
            ),
            (
                "[controller]\n[store]\nbackend = \"etcd\"\nendpoints = [\"https://10.0.0.5:2379\"]\n",
                "are not set",
            ),
            (
                "[controller]\n[store]\nbackend = \"etcd\"\nendpoints = [\"https://e:2379\"]\nca_file = \"/ca\"\n",
                "go together",
            ),
            (
                "[controller]\n[policy]\nmin_replicas = 1\n[ha]\nmode = \"pico\"\n",
                "min_replicas = 1 is below 2",
            ),
            (
                "[controller]\n[policy]\nmin_replicas = 1\n[ha]\nmode = \"ftmb\"\n",
                "[ha] mode = \"ftmb\"",
            ),
            (
                "[controller]\n[policy]\nmin_replicas = 1\n[ha]\nmode = \"ftmb\"\n",
                "min_replicas = 1 is below 2",
            ),
            (
                "[controller]\n[policy]\nmax_replicas = 1\n[ha]\nmode = \"remus\"\n",
                "max_replicas = 1 is below 2",
            ),
        ] {
            let e = p(text).expect_err(text).to_string();
            assert!(e.contains(needle), "{text:?}: {e}");
        }
    }
}
