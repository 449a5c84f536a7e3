//! Replica configuration (TOML). CONTRACT: the lab builds these structs and writes them with
//! `to_toml()`; the replica loads them with `ReplicaConfig::load`, which refuses a bad file with
//! the line and the reason before anything starts.
//!
//! ```toml
//! [replica]
//! name = "r1"
//! control_socket = "/run/pliant/lab-x/r1.sock"   # unix socket, mode 0600
//! # control_listen = "10.0.0.1:7403"            # control on TCP too (needs [security])
//! # metrics_listen = "127.0.0.1:9100"            # optional TCP listener; none by default
//! # realtime_priority = 20                       # SCHED_FIFO 1..=99 for all threads; off by default
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
//! kind = "nat"                 # nat | firewall | ids | mbserv | forward | c
//!
//! [nat]                        # the section named by nf.kind, parsed by that NF crate
//! external_ip = "10.77.2.1"
//!
//! # [migration]                # optional; default: control_socket with .sock -> .peer.sock
//! #                            # (every socket field takes "/abs/path" or "host:port")
//! # peer_socket = "/run/pliant/lab-x/r1.peer.sock"
//!
//! # [ha]                       # optional: Pico replication (backup listener + protect)
//! # repl_socket = "/run/pliant/lab-x/r1.repl.sock"  # or "host:port"; default .sock -> .repl.sock
//! # mode = "ftmb"            # FTMB worker mode (needs [security] and nf.kind = "nat")
//! # ftmb_workers = 2         # 1..=16 worker threads
//! # ftmb_snapshot_ms = 50    # 5..=10000
//! # ftmb_socket = "/run/pliant/lab-x/r1.ftmb.sock"  # hosted logger, or "host:port" (TCP);
//! #                                                  # default: control_socket .sock -> .ftmb.sock
//!
//! # [security]                 # this replica's identity on every channel (required by [ha]
//! #                            # and [shared]); issue with `pliant keys issue --role replica`
//! # identity = "/run/pliant/lab-x/id/r1"   # node.key (0600), node.cert, ca.pub
//! # encrypt = "auto"           # auto (TCP encrypted, unix authenticated only) | always | never
//!
//! # [shared]                   # optional: shared state coherent across replicas (`pliant hub`)
//! # hub = "/run/pliant/lab-x/hub.sock"     # endpoint: absolute unix path or host:port
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
    /// The control channel on TCP as well (`host:port`), for a controller on another host;
    /// needs `[security]` (clients must then prove the CONTROLLER or ADMIN role).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_listen: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics_listen: Option<String>,
    /// Run every replica thread under SCHED_FIFO at this priority (1..=99; absent: the normal
    /// scheduler). For a replica with cores of its own or a latency goal (migration pauses):
    /// a woken packet thread then preempts ordinary tasks at once instead of waiting for a
    /// scheduler slice. A replica that saturates its core starves ordinary tasks on it down to
    /// the kernel's RT throttling share, so it is off unless asked for (crate::sched).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub realtime_priority: Option<u8>,
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

use serde::de::{DeserializeOwned, DeserializeSeed, IgnoredAny, MapAccess, Visitor};
use std::fmt;
use std::net::IpAddr;

/// The optional `[ha]` section (kept in `nf_sections` like `[migration]`, so configs built as
/// struct literals stay valid; see [`ReplicaConfig::ha`] / [`ReplicaConfig::set_ha`]).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct HaSection {
    /// The replication listener's socket (default: beside the control socket,
    /// `<name>.repl.sock`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repl_socket: Option<String>,
    /// `"ftmb"`: IP packets run on FTMB worker threads with ordered logging to a logger hosted
    /// by another replica (crates/runtime/README.md, "FTMB mode"). Absent, `"pico"` or
    /// `"remus"`: the single-threaded engine, protected by `protect` policies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    /// FTMB worker threads (= log queues), 1..=16; default 2.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ftmb_workers: Option<usize>,
    /// Interval between FTMB snapshots to the logger, 5..=10000 ms; default 50.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ftmb_snapshot_ms: Option<u64>,
    /// The FTMB logger endpoint this replica hosts for another primary: an absolute unix
    /// path or TCP `host:port` (default: beside the control socket, `<name>.ftmb.sock`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ftmb_socket: Option<String>,
}

/// Bounds of the `[ha]` FTMB knobs (checked by `ReplicaConfig::parse`).
pub const FTMB_WORKERS: std::ops::RangeInclusive<usize> = 1..=16;
pub const FTMB_SNAPSHOT_MS: std::ops::RangeInclusive<u64> = 5..=10_000;
pub const FTMB_DEFAULT_WORKERS: usize = 2;
pub const FTMB_DEFAULT_SNAPSHOT_MS: u64 = 50;

/// The effective FTMB settings of a replica with `[ha] mode = "ftmb"` (defaults filled in).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FtmbSettings {
    pub workers: usize,
    pub snapshot_ms: u64,
    /// Where this replica's hosted logger listens (an endpoint: unix path or `host:port`).
    pub socket: String,
}

/// The optional `[shared]` section: the coherence hub's endpoint (`pliant hub --listen ..`),
/// a unix socket path or `host:port`. The replica authenticates to the hub with its
/// `[security]` identity (required with `[shared]`): the hub accepts it only as the replica
/// its certificate names. Without the section the replica's shared state is local to the
/// replica (and merged only through `shared_export`/`shared_merge`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct SharedSection {
    pub hub: String,
}

/// `[security]`: the replica's identity directory (see `pliant_wire::identity`) and when its
/// channels encrypt. Every frame is authenticated either way.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct SecuritySection {
    pub identity: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub encrypt: Option<pliant_wire::Encrypt>,
}

impl SecuritySection {
    /// Loads the identity (key mode and owner checked, certificate verified).
    pub fn load(&self) -> Result<pliant_wire::Security, String> {
        pliant_wire::Security::load(
            std::path::Path::new(&self.identity),
            self.encrypt.unwrap_or_default(),
        )
        .map_err(|e| format!("[security] identity {}: {e}", self.identity))
    }
}

/// NF kinds the CLI knows how to build (`nf.kind`).
/// `c` is a network function written in C against `pliant.h`: the C program opens the replica
/// itself (`pliant_open`), so the `pliant replica` command does not run it.
pub const NF_KINDS: &[&str] = &["nat", "firewall", "ids", "mbserv", "forward", "c"];

/// A socket field that takes an endpoint: a TCP `host:port` or an absolute unix path.
fn check_endpoint(what: &str, s: &str) -> Result<(), String> {
    match s.parse::<pliant_wire::Endpoint>() {
        Ok(pliant_wire::Endpoint::Unix(p)) if !p.is_absolute() => Err(format!(
            "{what} = {s:?}: a unix socket path must be absolute"
        )),
        Ok(_) => Ok(()),
        Err(e) => Err(format!("{what}: {e}")),
    }
}

/// A refused configuration: which file, where in it, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ConfigError {
    pub file: String,
    /// 1-based line, when known.
    pub line: Option<usize>,
    pub reason: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(l) => write!(f, "{}:{}: {}", self.file, l, self.reason),
            None => write!(f, "{}: {}", self.file, self.reason),
        }
    }
}

/// 1-based line of byte offset `off` in `text`.
fn line_of(text: &str, off: usize) -> usize {
    text.as_bytes()
        .iter()
        .take(off)
        .filter(|&&b| b == b'\n')
        .count()
        + 1
}

/// Line of the first line that mentions `needle` (used to place semantic errors).
fn line_mentioning(text: &str, needle: &str) -> Option<usize> {
    text.lines().position(|l| l.contains(needle)).map(|i| i + 1)
}

fn toml_error(file: &str, text: &str, e: &toml::de::Error) -> ConfigError {
    ConfigError {
        file: file.to_string(),
        line: e.span().map(|s| line_of(text, s.start)),
        // The message alone: toml's Display repeats the source snippet over several lines.
        reason: e.message().trim().replace('\n', "; "),
    }
}

/// An address on a port with its prefix length, e.g. `10.77.1.1/24`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cidr {
    pub addr: IpAddr,
    pub prefix: u8,
}

impl Cidr {
    pub fn parse(s: &str) -> Result<Cidr, String> {
        let (a, p) = s
            .split_once('/')
            .ok_or_else(|| format!("{s:?}: expected ADDRESS/PREFIX"))?;
        let addr: IpAddr = a
            .trim()
            .parse()
            .map_err(|_| format!("{s:?}: bad address {a:?}"))?;
        let prefix: u8 = p
            .trim()
            .parse()
            .map_err(|_| format!("{s:?}: bad prefix {p:?}"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        if prefix > max {
            return Err(format!("{s:?}: prefix {prefix} longer than {max}"));
        }
        Ok(Cidr { addr, prefix })
    }

    /// True when `ip` is in this subnet.
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, ip) {
            (IpAddr::V4(n), IpAddr::V4(a)) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                u32::from(n) & mask == u32::from(a) & mask
            }
            (IpAddr::V6(n), IpAddr::V6(a)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                u128::from(n) & mask == u128::from(a) & mask
            }
            _ => false,
        }
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

impl PortConfig {
    /// Parsed `addresses` (validated by `ReplicaConfig::parse`).
    pub fn cidrs(&self) -> Result<Vec<Cidr>, String> {
        self.addresses.iter().map(|s| Cidr::parse(s)).collect()
    }

    pub fn gateway_ip(&self) -> Result<Option<IpAddr>, String> {
        self.gateway
            .as_deref()
            .map(|g| {
                g.parse()
                    .map_err(|_| format!("gateway {g:?} is not an IP address"))
            })
            .transpose()
    }
}

/// Linux interface name rules (IFNAMSIZ and the characters `ip link` refuses).
fn valid_ifname(n: &str) -> bool {
    !n.is_empty()
        && n.len() < 16
        && n != "."
        && n != ".."
        && n.bytes()
            .all(|b| b.is_ascii_graphic() && b != b'/' && b != b':')
}

impl ReplicaConfig {
    /// Reads and validates a config file. Nothing is started; a bad file is refused with the
    /// file, line and reason.
    pub fn load(path: &str) -> Result<ReplicaConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            file: path.to_string(),
            line: None,
            reason: format!("cannot read: {e}"),
        })?;
        Self::parse(&text, path)
    }

    /// Parses and validates config text; `file` names it in errors.
    pub fn parse(text: &str, file: &str) -> Result<ReplicaConfig, ConfigError> {
        let cfg: ReplicaConfig = toml::from_str(text).map_err(|e| toml_error(file, text, &e))?;
        cfg.validate().map_err(|(needle, reason)| ConfigError {
            file: file.to_string(),
            line: needle.and_then(|n| line_mentioning(text, &n)),
            reason,
        })?;
        Ok(cfg)
    }

    pub fn to_toml(&self) -> Result<String, String> {
        toml::to_string(self).map_err(|e| format!("cannot serialise replica config: {e}"))
    }

    /// Semantic checks; on error returns a string to locate the line by and the reason.
    fn validate(&self) -> Result<(), (Option<String>, String)> {
        let r = &self.replica;
        if let Some(p) = r.realtime_priority {
            if !crate::sched::PRIORITIES.contains(&p) {
                return Err((
                    Some("realtime_priority".into()),
                    format!(
                        "replica.realtime_priority {p}: use {}..={} (or leave it out)",
                        crate::sched::PRIORITIES.start(),
                        crate::sched::PRIORITIES.end()
                    ),
                ));
            }
        }
        if r.name.is_empty()
            || !r
                .name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err((
                Some("name".into()),
                format!("replica.name {:?}: use [A-Za-z0-9_-]+", r.name),
            ));
        }
        if !r.control_socket.starts_with('/') {
            return Err((
                Some("control_socket".into()),
                format!(
                    "replica.control_socket {:?} must be an absolute path",
                    r.control_socket
                ),
            ));
        }
        if let Some(m) = &r.metrics_listen {
            m.parse::<std::net::SocketAddr>().map_err(|_| {
                (
                    Some("metrics_listen".into()),
                    format!("replica.metrics_listen {m:?} is not IP:PORT"),
                )
            })?;
        }
        for (side, p) in [("inside", &self.inside), ("outside", &self.outside)] {
            if !valid_ifname(&p.ifname) {
                return Err((
                    Some(p.ifname.clone()),
                    format!("{side}.ifname {:?} is not a valid interface name", p.ifname),
                ));
            }
            let mut cidrs = Vec::with_capacity(p.addresses.len());
            for a in &p.addresses {
                cidrs.push(
                    Cidr::parse(a)
                        .map_err(|e| (Some(a.clone()), format!("{side}.addresses: {e}")))?,
                );
            }
            if let Some(gw) = p
                .gateway_ip()
                .map_err(|e| (Some("gateway".into()), format!("{side}.{e}")))?
            {
                if !cidrs.iter().any(|c| c.contains(gw)) {
                    return Err((
                        Some(gw.to_string()),
                        format!("{side}.gateway {gw} is in none of the {side} subnets"),
                    ));
                }
            }
        }
        if self.inside.ifname == self.outside.ifname {
            return Err((
                Some("ifname".into()),
                "inside and outside use the same interface".into(),
            ));
        }
        if !NF_KINDS.contains(&self.nf.kind.as_str()) {
            return Err((
                Some("kind".into()),
                format!(
                    "nf.kind {:?} unknown; known kinds: {}",
                    self.nf.kind,
                    NF_KINDS.join(", ")
                ),
            ));
        }
        if let Some(m) = self.nf_sections.get("migration") {
            let ok = m.as_table().is_some_and(|t| {
                t.iter().all(|(k, v)| {
                    k == "peer_socket"
                        && v.as_str()
                            .is_some_and(|p| check_endpoint("[migration] peer_socket", p).is_ok())
                })
            });
            if !ok {
                return Err((
                    Some("[migration".into()),
                    "[migration] takes only peer_socket = \"/absolute/path\" or \"host:port\""
                        .into(),
                ));
            }
        }
        if let Some(h) = self.nf_sections.get("ha") {
            // As for [shared] secret: said plainly, with what replaces it.
            if h.as_table().is_some_and(|t| t.contains_key("repl_secret")) {
                return Err((
                    Some("repl_secret".into()),
                    "[ha] repl_secret is no longer used: replication and FTMB logging \
                     authenticate with the replica's [security] identity (remove the line)"
                        .into(),
                ));
            }
            let parsed: HaSection = h.clone().try_into().map_err(|e: toml::de::Error| {
                (Some("[ha".into()), format!("[ha]: {}", e.message().trim()))
            })?;
            for (k, v) in [
                ("repl_socket", &parsed.repl_socket),
                ("ftmb_socket", &parsed.ftmb_socket),
            ] {
                if let Some(ep) = v {
                    check_endpoint(&format!("[ha] {k}"), ep).map_err(|e| (Some(k.into()), e))?;
                }
            }
            self.validate_ftmb(&parsed)?;
        }
        if let Some(s) = self.nf_sections.get("shared") {
            // Said plainly rather than as an unknown field: configs from before the port to
            // identities carry it, and their operators need to know what replaces it.
            if s.as_table().is_some_and(|t| t.contains_key("secret")) {
                return Err((
                    Some("secret".into()),
                    "[shared] secret is no longer used: the replica authenticates to the hub \
                     with its [security] identity (remove the line)"
                        .into(),
                ));
            }
            let parsed: SharedSection = s.clone().try_into().map_err(|e: toml::de::Error| {
                (
                    Some("[shared".into()),
                    format!("[shared]: {}", e.message().trim()),
                )
            })?;
            check_endpoint("[shared] hub", &parsed.hub).map_err(|e| (Some("hub".into()), e))?;
            if !self.nf_sections.contains_key("security") {
                return Err((
                    Some("[shared".into()),
                    "[shared] needs a [security] identity: the hub accepts only replicas with a \
                     certificate of the deployment's CA (pliant keys issue --role replica)"
                        .into(),
                ));
            }
        }
        if let Some(l) = &self.replica.control_listen {
            check_endpoint("replica.control_listen", l)
                .map_err(|e| (Some("control_listen".into()), e))?;
            if !self.nf_sections.contains_key("security") {
                return Err((
                    Some("control_listen".into()),
                    "replica.control_listen needs a [security] identity: control over TCP is \
                     served only to authenticated clients"
                        .into(),
                ));
            }
        }
        if let Some(s) = self.nf_sections.get("security") {
            let parsed: SecuritySection = s.clone().try_into().map_err(|e: toml::de::Error| {
                (
                    Some("[security".into()),
                    format!("[security]: {}", e.message().trim()),
                )
            })?;
            if !parsed.identity.starts_with('/') {
                return Err((
                    Some("identity".into()),
                    "[security] identity must be an absolute path (a directory)".into(),
                ));
            }
        }
        for name in self.nf_sections.keys() {
            if !NF_KINDS.contains(&name.as_str())
                && name != "migration"
                && name != "ha"
                && name != "shared"
                && name != "security"
            {
                return Err((
                    Some(format!("[{name}")),
                    format!("unknown section [{name}]"),
                ));
            }
        }
        Ok(())
    }

    /// `[ha]` FTMB checks: known mode, knobs in range and only with `mode = "ftmb"`, which
    /// needs `[security]` (the logger streams authenticate with the replica's identity, and the
    /// logger it hosts checks other masters' identities) and the NAT (the only NF with an FTMB
    /// implementation).
    fn validate_ftmb(&self, h: &HaSection) -> Result<(), (Option<String>, String)> {
        let ftmb = match h.mode.as_deref() {
            None | Some("pico") | Some("remus") => false,
            Some("ftmb") => true,
            Some(other) => {
                return Err((
                    Some("mode".into()),
                    format!("[ha] mode {other:?} unknown; known modes: pico, remus, ftmb"),
                ))
            }
        };
        if !ftmb {
            for (k, set) in [
                ("ftmb_workers", h.ftmb_workers.is_some()),
                ("ftmb_snapshot_ms", h.ftmb_snapshot_ms.is_some()),
                ("ftmb_socket", h.ftmb_socket.is_some()),
            ] {
                if set {
                    return Err((
                        Some(k.into()),
                        format!("[ha] {k} is only meaningful with mode = \"ftmb\""),
                    ));
                }
            }
            return Ok(());
        }
        if let Some(w) = h.ftmb_workers.filter(|w| !FTMB_WORKERS.contains(w)) {
            return Err((
                Some("ftmb_workers".into()),
                format!(
                    "[ha] ftmb_workers = {w}: must be within {}..={}",
                    FTMB_WORKERS.start(),
                    FTMB_WORKERS.end()
                ),
            ));
        }
        if let Some(ms) = h.ftmb_snapshot_ms.filter(|m| !FTMB_SNAPSHOT_MS.contains(m)) {
            return Err((
                Some("ftmb_snapshot_ms".into()),
                format!(
                    "[ha] ftmb_snapshot_ms = {ms}: must be within {}..={}",
                    FTMB_SNAPSHOT_MS.start(),
                    FTMB_SNAPSHOT_MS.end()
                ),
            ));
        }
        if !self.nf_sections.contains_key("security") {
            return Err((
                Some("mode".into()),
                "[ha] mode = \"ftmb\" needs a [security] section (the logger streams \
                 authenticate with the replica's identity)"
                    .into(),
            ));
        }
        if self.nf.kind != "nat" {
            return Err((
                Some("kind".into()),
                format!(
                    "[ha] mode = \"ftmb\" is implemented for nf.kind = \"nat\" only, not {:?}",
                    self.nf.kind
                ),
            ));
        }
        Ok(())
    }

    /// The FTMB settings when `[ha] mode = "ftmb"` (validated by `parse`), defaults filled in.
    pub fn ftmb(&self) -> Option<FtmbSettings> {
        let h = self.ha()?;
        if h.mode.as_deref() != Some("ftmb") {
            return None;
        }
        let socket = h.ftmb_socket.clone().unwrap_or_else(|| {
            let c = &self.replica.control_socket;
            match c.strip_suffix(".sock") {
                Some(stem) => format!("{stem}.ftmb.sock"),
                None => format!("{c}.ftmb"),
            }
        });
        Some(FtmbSettings {
            workers: h.ftmb_workers.unwrap_or(FTMB_DEFAULT_WORKERS),
            snapshot_ms: h.ftmb_snapshot_ms.unwrap_or(FTMB_DEFAULT_SNAPSHOT_MS),
            socket,
        })
    }

    /// The replica-to-replica peer socket (migration): `[migration] peer_socket`, or by default
    /// the control socket's path with `.sock` replaced by `.peer.sock` (`+ .peer` otherwise).
    pub fn peer_socket(&self) -> String {
        if let Some(p) = self
            .nf_sections
            .get("migration")
            .and_then(|m| m.get("peer_socket"))
            .and_then(|v| v.as_str())
        {
            return p.to_string();
        }
        let c = &self.replica.control_socket;
        match c.strip_suffix(".sock") {
            Some(stem) => format!("{stem}.peer.sock"),
            None => format!("{c}.peer"),
        }
    }

    /// The `[ha]` section, if any (validated by `parse`; `None` if absent or malformed).
    pub fn ha(&self) -> Option<HaSection> {
        self.nf_sections
            .get("ha")
            .and_then(|h| h.clone().try_into().ok())
    }

    /// The `[security]` section, if any (validated by `parse`).
    pub fn security(&self) -> Option<SecuritySection> {
        self.nf_sections
            .get("security")
            .and_then(|s| s.clone().try_into().ok())
    }

    /// The `[shared]` section (coherence hub), if any.
    pub fn shared(&self) -> Option<SharedSection> {
        self.nf_sections
            .get("shared")
            .and_then(|s| s.clone().try_into().ok())
    }

    /// Sets (or with `None` removes) the `[shared]` section.
    pub fn set_shared(&mut self, s: Option<&SharedSection>) {
        match s.and_then(|s| toml::Value::try_from(s).ok()) {
            Some(v) => {
                self.nf_sections.insert("shared".into(), v);
            }
            None => {
                self.nf_sections.remove("shared");
            }
        }
    }

    /// Sets (or with `None` removes) the `[ha]` section.
    pub fn set_ha(&mut self, h: Option<&HaSection>) {
        match h.and_then(|h| toml::Value::try_from(h).ok()) {
            Some(v) => {
                self.nf_sections.insert("ha".into(), v);
            }
            None => {
                self.nf_sections.remove("ha");
            }
        }
    }

    /// The replication socket: `[ha] repl_socket`, or the control socket's path with `.sock`
    /// replaced by `.repl.sock` (`+ .repl` otherwise).
    pub fn repl_socket(&self) -> String {
        if let Some(p) = self.ha().and_then(|h| h.repl_socket) {
            return p;
        }
        let c = &self.replica.control_socket;
        match c.strip_suffix(".sock") {
            Some(stem) => format!("{stem}.repl.sock"),
            None => format!("{c}.repl"),
        }
    }

    /// Checks that both interfaces exist in this network namespace (run where the replica runs).
    pub fn check_interfaces(&self) -> Result<(), String> {
        for (side, p) in [("inside", &self.inside), ("outside", &self.outside)] {
            if !std::path::Path::new("/sys/class/net")
                .join(&p.ifname)
                .exists()
            {
                return Err(format!(
                    "{side}.ifname {:?}: no such interface in this namespace",
                    p.ifname
                ));
            }
        }
        Ok(())
    }
}

/// Deserialises section `name` of config text as the NF's own config type, so errors inside
/// the section carry their line (the flattened `nf_sections` table has lost its spans). A
/// missing section deserialises from an empty table (all defaults, or a "missing field" error).
pub fn nf_section<T: DeserializeOwned>(
    text: &str,
    file: &str,
    name: &str,
) -> Result<T, ConfigError> {
    struct Seed<'a, T>(&'a str, std::marker::PhantomData<T>);
    impl<'de, T: DeserializeOwned> DeserializeSeed<'de> for Seed<'_, T> {
        type Value = Option<T>;
        fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Option<T>, D::Error> {
            d.deserialize_map(self)
        }
    }
    impl<'de, T: DeserializeOwned> Visitor<'de> for Seed<'_, T> {
        type Value = Option<T>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a TOML document")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Option<T>, A::Error> {
            let mut found = None;
            while let Some(k) = m.next_key::<String>()? {
                if k == self.0 {
                    found = Some(m.next_value::<T>()?);
                } else {
                    m.next_value::<IgnoredAny>()?;
                }
            }
            Ok(found)
        }
    }
    let de = toml::Deserializer::new(text);
    match Seed::<T>(name, std::marker::PhantomData).deserialize(de) {
        Ok(Some(v)) => Ok(v),
        Ok(None) => T::deserialize(toml::Table::new()).map_err(|e| ConfigError {
            file: file.to_string(),
            line: None,
            reason: format!("section [{name}]: {}", e.message()),
        }),
        Err(e) => Err(toml_error(file, text, &e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
[replica]
name = "r1"
control_socket = "/tmp/r1.sock"

[inside]
ifname = "r1in"
addresses = ["10.77.1.1/24"]

[outside]
ifname = "r1out"
addresses = ["10.77.2.1/24"]
gateway = "10.77.2.254"

[nf]
kind = "nat"

[nat]
external_ip = "10.77.2.1"
port_min = 1000
"#;

    #[derive(Deserialize, Debug)]
    #[serde(deny_unknown_fields)]
    struct NatLike {
        external_ip: std::net::Ipv4Addr,
        #[serde(default)]
        port_min: u16,
    }

    #[test]
    fn good_config_loads_and_round_trips() {
        let c = ReplicaConfig::parse(GOOD, "t.toml").expect("valid");
        assert_eq!(c.nf.kind, "nat");
        assert_eq!(
            c.outside.gateway_ip().unwrap(),
            Some("10.77.2.254".parse().unwrap())
        );
        let again = ReplicaConfig::parse(&c.to_toml().unwrap(), "t2.toml").expect("round trip");
        assert_eq!(again, c);
        let n: NatLike = nf_section(GOOD, "t.toml", "nat").expect("nat section");
        assert_eq!(n.port_min, 1000);
        assert_eq!(n.external_ip, std::net::Ipv4Addr::new(10, 77, 2, 1));
    }

    #[test]
    fn realtime_priority_is_optional_bounded_and_round_trips() {
        let c = ReplicaConfig::parse(GOOD, "t.toml").expect("valid");
        assert_eq!(c.replica.realtime_priority, None);
        let with = GOOD.replacen(
            "control_socket = \"/tmp/r1.sock\"\n",
            "control_socket = \"/tmp/r1.sock\"\nrealtime_priority = 20\n",
            1,
        );
        let c = ReplicaConfig::parse(&with, "t.toml").expect("valid");
        assert_eq!(c.replica.realtime_priority, Some(20));
        let again = ReplicaConfig::parse(&c.to_toml().unwrap(), "t2.toml").expect("round trip");
        assert_eq!(again.replica.realtime_priority, Some(20));
        let zero = with.replace("realtime_priority = 20", "realtime_priority = 0");
        let e = ReplicaConfig::parse(&zero, "t.toml").unwrap_err();
        assert_eq!(e.line, Some(5), "{e}");
        assert!(e.reason.contains("1..=99"), "{e}");
        let big = with.replace("realtime_priority = 20", "realtime_priority = 300");
        assert!(ReplicaConfig::parse(&big, "t.toml").is_err());
    }

    #[test]
    fn peer_socket_defaults_beside_the_control_socket_or_is_configured() {
        let c = ReplicaConfig::parse(GOOD, "t.toml").expect("valid");
        assert_eq!(c.peer_socket(), "/tmp/r1.peer.sock");
        let with = format!("{GOOD}\n[migration]\npeer_socket = \"/run/x/p.sock\"\n");
        let c = ReplicaConfig::parse(&with, "t.toml").expect("valid");
        assert_eq!(c.peer_socket(), "/run/x/p.sock");
        let bad = format!("{GOOD}\n[migration]\npeer_socket = \"rel.sock\"\n");
        assert!(ReplicaConfig::parse(&bad, "t.toml").is_err());
        let bad = format!("{GOOD}\n[migration]\nother = 1\n");
        assert!(ReplicaConfig::parse(&bad, "t.toml").is_err());
    }

    #[test]
    fn ha_section_parses_defaults_and_is_checked() {
        let c = ReplicaConfig::parse(GOOD, "t.toml").expect("valid");
        assert_eq!(c.ha(), None);
        assert_eq!(c.repl_socket(), "/tmp/r1.repl.sock");
        let with = format!("{GOOD}\n[ha]\nmode = \"pico\"\n");
        let mut c = ReplicaConfig::parse(&with, "t.toml").expect("valid");
        assert_eq!(c.ha().unwrap().mode.as_deref(), Some("pico"));
        assert_eq!(c.repl_socket(), "/tmp/r1.repl.sock");
        let h = HaSection {
            repl_socket: Some("/run/x/r1.repl.sock".into()),
            ..HaSection::default()
        };
        c.set_ha(Some(&h));
        let again = ReplicaConfig::parse(&c.to_toml().unwrap(), "t2.toml").expect("round trip");
        assert_eq!(again.ha(), Some(h));
        assert_eq!(again.repl_socket(), "/run/x/r1.repl.sock");
        // The old shared secret is refused with what replaces it.
        let old = format!("{GOOD}\n[ha]\nrepl_secret = \"/run/x/repl.secret\"\n");
        let e = ReplicaConfig::parse(&old, "t.toml").unwrap_err();
        assert!(e.reason.contains("no longer used"), "{e}");
        let bad = format!("{GOOD}\n[ha]\nrepl_socket = \"rel\"\n");
        assert!(ReplicaConfig::parse(&bad, "t.toml").is_err());
        let bad = format!("{GOOD}\n[ha]\nbogus = 1\n");
        assert!(ReplicaConfig::parse(&bad, "t.toml").is_err());
    }

    #[test]
    fn ftmb_mode_defaults_bounds_and_requirements() {
        // `[security]` after the `[ha]` keys; the comment keeps the lines the refusals below
        // are located at.
        let ha = |body: &str| {
            format!("{GOOD}\n[ha]\n# (identity below)\n{body}\n[security]\nidentity = \"/id/r1\"\n")
        };
        let c = ReplicaConfig::parse(&ha("mode = \"ftmb\"\n"), "t.toml").expect("valid");
        assert_eq!(
            c.ftmb(),
            Some(FtmbSettings {
                workers: 2,
                snapshot_ms: 50,
                socket: "/tmp/r1.ftmb.sock".into(),
            })
        );
        // The hosted logger may listen on TCP (a logger on another host than its primary).
        let c = ReplicaConfig::parse(
            &ha("mode = \"ftmb\"\nftmb_socket = \"10.0.0.2:7400\"\n"),
            "t.toml",
        )
        .expect("valid");
        assert_eq!(c.ftmb().unwrap().socket, "10.0.0.2:7400");
        let c = ReplicaConfig::parse(
            &ha("mode = \"ftmb\"\nftmb_workers = 4\nftmb_snapshot_ms = 20\nftmb_socket = \"/x/l.sock\"\n"),
            "t.toml",
        )
        .expect("valid");
        let f = c.ftmb().unwrap();
        assert_eq!(
            (f.workers, f.snapshot_ms, f.socket.as_str()),
            (4, 20, "/x/l.sock")
        );
        let again = ReplicaConfig::parse(&c.to_toml().unwrap(), "t2.toml").expect("round trip");
        assert_eq!(again.ftmb(), c.ftmb());
        // Pico mode (explicit or absent) has no FTMB settings.
        let c = ReplicaConfig::parse(&ha("mode = \"pico\"\n"), "t.toml").expect("valid");
        assert_eq!(c.ftmb(), None);
        let refused = |text: &str, want: &str, line: usize| {
            let e = ReplicaConfig::parse(text, "t.toml").unwrap_err();
            assert!(e.reason.contains(want), "{e}");
            assert_eq!(e.line, Some(line), "{e}");
        };
        refused(
            &ha("mode = \"ftmb\"\nftmb_workers = 0\n"),
            "ftmb_workers = 0",
            25,
        );
        refused(&ha("mode = \"ftmb\"\nftmb_workers = 17\n"), "1..=16", 25);
        refused(
            &ha("mode = \"ftmb\"\nftmb_snapshot_ms = 4\n"),
            "5..=10000",
            25,
        );
        refused(
            &ha("mode = \"ftmb\"\nftmb_socket = \"./rel.sock\"\n"),
            "absolute",
            25,
        );
        refused(
            &ha("mode = \"ftmb\"\nftmb_socket = \"rel\"\n"),
            "neither a unix socket path",
            25,
        );
        refused(&ha("mode = \"raft\"\n"), "mode \"raft\" unknown", 24);
        refused(&ha("ftmb_workers = 2\n"), "only meaningful", 24);
        refused(
            &format!("{GOOD}\n[ha]\nmode = \"ftmb\"\n"),
            "needs a [security] section",
            23,
        );
        let fw = ha("mode = \"ftmb\"\n").replace("kind = \"nat\"", "kind = \"firewall\"");
        let fw = fw.replace("[nat]\nexternal_ip = \"10.77.2.1\"\nport_min = 1000\n", "");
        refused(&fw, "nat\" only", 16);
    }

    #[test]
    fn shared_section_parses_round_trips_and_is_checked() {
        let c = ReplicaConfig::parse(GOOD, "t.toml").expect("valid");
        assert_eq!(c.shared(), None);
        let sec = "\n[security]\nidentity = \"/run/x/id/r1\"\n";
        let with = format!("{GOOD}{sec}\n[shared]\nhub = \"/run/x/hub.sock\"\n");
        let mut c = ReplicaConfig::parse(&with, "t.toml").expect("valid");
        assert_eq!(
            c.shared(),
            Some(SharedSection {
                hub: "/run/x/hub.sock".into(),
            })
        );
        // An endpoint: TCP between hosts too.
        let s = SharedSection {
            hub: "10.0.0.5:7400".into(),
        };
        c.set_shared(Some(&s));
        let again = ReplicaConfig::parse(&c.to_toml().unwrap(), "t2.toml").expect("round trip");
        assert_eq!(again.shared(), Some(s));
        let refused = |shared: &str, sec: &str, why: &str| {
            let bad = format!("{GOOD}{sec}\n[shared]\n{shared}");
            let e = ReplicaConfig::parse(&bad, "t.toml").unwrap_err();
            assert!(e.reason.contains(why), "{e}");
        };
        refused(
            "hub = \"./rel.sock\"\n",
            sec,
            "a unix socket path must be absolute",
        );
        refused("hub = \"nohost\"\n", sec, "neither a unix socket path");
        refused("hub = \"/h\"\nbogus = 1\n", sec, "bogus");
        // The shared secret is gone, and says so.
        refused(
            "hub = \"/h\"\nsecret = \"/s\"\n",
            sec,
            "[shared] secret is no longer used",
        );
        // Without an identity the hub would refuse the replica: refused here, at parse time.
        refused("hub = \"/h\"\n", "", "[shared] needs a [security] identity");
    }

    #[test]
    fn syntax_errors_carry_file_and_line() {
        let bad = GOOD.replace("kind = \"nat\"", "kind = nat");
        let e = ReplicaConfig::parse(&bad, "t.toml").unwrap_err();
        assert_eq!(e.file, "t.toml");
        assert_eq!(e.line, Some(16), "{e}");
    }

    #[test]
    fn semantic_errors_are_located() {
        let bad = GOOD.replace("10.77.1.1/24", "10.77.1.1/33");
        let e = ReplicaConfig::parse(&bad, "t.toml").unwrap_err();
        assert!(e.reason.contains("prefix 33"), "{e}");
        assert_eq!(e.line, Some(8), "{e}");

        let bad = GOOD.replace("10.77.2.254", "10.9.9.9");
        let e = ReplicaConfig::parse(&bad, "t.toml").unwrap_err();
        assert!(e.reason.contains("gateway"), "{e}");
        assert_eq!(e.line, Some(13), "{e}");

        let bad = GOOD.replace("kind = \"nat\"", "kind = \"nope\"");
        let e = ReplicaConfig::parse(&bad, "t.toml").unwrap_err();
        assert!(e.reason.contains("unknown"), "{e}");
        assert_eq!(e.line, Some(16), "{e}");

        let bad = GOOD.replace("[nat]", "[nta]");
        assert!(ReplicaConfig::parse(&bad, "t.toml")
            .unwrap_err()
            .reason
            .contains("[nta]"));
    }

    #[test]
    fn nf_section_errors_carry_lines() {
        let bad = GOOD.replace("port_min = 1000", "port_min = 1000\nbogus = 1");
        let e = nf_section::<NatLike>(&bad, "t.toml", "nat").unwrap_err();
        assert!(e.reason.contains("bogus"), "{e}");
        assert_eq!(e.line, Some(21), "{e}");
    }

    #[test]
    fn cidr_contains() {
        let c = Cidr::parse("10.0.0.1/8").unwrap();
        assert!(c.contains("10.200.1.1".parse().unwrap()));
        assert!(!c.contains("11.0.0.1".parse().unwrap()));
        assert!(Cidr::parse("0.0.0.0/0")
            .unwrap()
            .contains("1.2.3.4".parse().unwrap()));
        assert!(Cidr::parse("fd00::1/64")
            .unwrap()
            .contains("fd00::99".parse().unwrap()));
        assert!(Cidr::parse("10.0.0.1").is_err());
    }
}
