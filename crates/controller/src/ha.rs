//! High availability (Pico replication), the controller's pure parts: the `[ha]`
//! config, the protection policy each replica gets (as the `protect` JSON of the HA contract),
//! parsing of `ha_status` / `activate` answers, and the liveness probe. The orchestration
//! (failure detection, fencing, activation, re-steering, re-protection) is in
//! `controller/failover.rs`.
//!
//! Liveness probe: a *non-blocking* `connect(2)` to the replica's control socket, closed at once.
//! A SIGKILLed replica's listening socket is gone with its process, so the connect fails with
//! `ECONNREFUSED` (or `ENOENT` once the file is removed): immediate evidence of death, no
//! timeout involved, which is what makes detection take one watch interval (10 ms) instead of
//! several missed heartbeats. A hung-but-alive replica still accepts connections (the kernel
//! queues them), so it is caught by the heartbeats instead (`dead_after_missed` * `heartbeat_ms`).
//! Non-blocking, because a blocking connect to a hung replica whose backlog is full would block
//! the watcher (for unix sockets that is `EAGAIN`, which is *not* evidence of death).
//!
//! Over TCP (`[controller] control_endpoint`: the replica on another host) the probe is a
//! connect to its control endpoint bounded by `probe_timeout_ms`: a reset (`ECONNREFUSED`:
//! the host is up, nothing listens) is death as above; a connect that does not complete in
//! time is *no evidence* (a lost SYN, a full accept queue, a slow path) — it can only make a
//! replica suspected after `suspect_after_ms` of silence, never dead. [`connect_verdict`] is
//! that decision.

use pliant_proto::{reply, Request};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HaMode {
    /// No replication: replicas are not protected, a dead replica's flows are lost.
    Off,
    /// Pico replication: per-group checkpoints, output commit per group.
    Pico,
    /// The Remus-mode baseline: whole-replica epochs, all output held.
    Remus,
    /// FTMB rollback recovery: every replica is a primary logging to an FTMB
    /// logger hosted by its successor in the ring of live replicas; a dead primary is
    /// recovered by replay on that host.
    Ftmb,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PolicyKind {
    /// Elastic Pico chords: consistent-hash ring with virtual nodes over the other replicas.
    Chords,
    /// One backup per primary: the next live replica by index (cyclic).
    Single,
    /// Differentiated streams: flows of `streams_ports` to one backup at `hz`, the rest to
    /// another at `streams_default_hz`.
    Streams,
}

impl PolicyKind {
    pub fn parse(s: &str) -> Option<PolicyKind> {
        match s {
            "chords" => Some(PolicyKind::Chords),
            "single" => Some(PolicyKind::Single),
            "streams" => Some(PolicyKind::Streams),
            _ => None,
        }
    }
}

/// Linux's minimum TCP retransmission timeout (`TCP_RTO_MIN`, 200 ms): a segment lost once
/// arrives this late at best, so no failure-detection bound over TCP may be shorter.
pub const TCP_MIN_RTO_MS: u64 = 200;

/// Most checkpoints per second a group may be asked for (the goal is >= 10 kHz).
pub const MAX_HZ: u32 = 100_000;
/// Bound on virtual nodes per backup in the chords ring.
pub const MAX_VNODES: u32 = 4096;

/// `[ha]` in `ctl.toml`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct HaConfig {
    #[serde(default = "d_mode")]
    pub mode: HaMode,
    #[serde(default = "d_policy")]
    pub policy: PolicyKind,
    /// Checkpoint frequency of every protected group (Pico).
    #[serde(default = "d_hz")]
    pub hz: u32,
    /// Virtual nodes per backup (chords).
    #[serde(default = "d_vnodes")]
    pub vnodes: u32,
    /// Epoch rate in Remus mode.
    #[serde(default = "d_remus_hz")]
    pub remus_hz: u32,
    /// Port ranges of the high-priority class (streams).
    #[serde(default = "d_streams_ports")]
    pub streams_ports: Vec<[u16; 2]>,
    /// Frequency of the default (low-priority) class (streams).
    #[serde(default = "d_streams_default_hz")]
    pub streams_default_hz: u32,
    /// Liveness probe interval (failure detection takes about one interval).
    #[serde(default = "d_watch_ms")]
    pub watch_ms: u64,
    /// Bound on one TCP liveness probe's connect (replicas reached over TCP, `[controller]
    /// control_endpoint`). A connect still pending then is *no evidence* (`Unknown`: a lost
    /// SYN is retransmitted only after 1 s), never death. Unix probes never wait.
    #[serde(default = "d_probe_timeout_ms")]
    pub probe_timeout_ms: u64,
    /// A replica whose TCP probes have given no answer at all (neither accepted nor refused)
    /// for this long is *suspected*: named as nobody's backup and protections wait, until a
    /// probe sees it listening again. Not death: that takes a refused connection or
    /// `dead_after_missed` missed heartbeats.
    #[serde(default = "d_suspect_after_ms")]
    pub suspect_after_ms: u64,
    /// Bound on each `activate` / `protect` request during a failover.
    #[serde(default = "d_ha_rpc_ms")]
    pub rpc_timeout_ms: u64,
    /// Least time between two re-protections of one replica answering `needs_backup`.
    #[serde(default = "d_reprotect_ms")]
    pub reprotect_min_ms: u64,
    /// Where each replica's replication listener is, as told to primaries: a template in
    /// which `{name}` is the replica's control socket stem (`r2`) and `{index}` its number
    /// (`"10.254.0.{index}:7400"`; see [`endpoint_of`]). Absent: the unix socket beside the
    /// control socket (`r2.repl.sock`), the runtime's default.
    #[serde(default)]
    pub repl_endpoint: Option<String>,
    /// The same for each replica's hosted FTMB logger (absent: `r2.ftmb.sock`).
    #[serde(default)]
    pub ftmb_endpoint: Option<String>,
}

fn d_mode() -> HaMode {
    HaMode::Pico
}
fn d_policy() -> PolicyKind {
    PolicyKind::Chords
}
fn d_hz() -> u32 {
    1000
}
fn d_vnodes() -> u32 {
    64
}
fn d_remus_hz() -> u32 {
    40
}
fn d_streams_ports() -> Vec<[u16; 2]> {
    vec![[1, 1023], [5201, 5201]]
}
fn d_streams_default_hz() -> u32 {
    100
}
fn d_watch_ms() -> u64 {
    10
}
fn d_probe_timeout_ms() -> u64 {
    100
}
fn d_suspect_after_ms() -> u64 {
    1000
}
fn d_ha_rpc_ms() -> u64 {
    2000
}
fn d_reprotect_ms() -> u64 {
    500
}

impl Default for HaConfig {
    fn default() -> Self {
        HaConfig {
            mode: d_mode(),
            policy: d_policy(),
            hz: d_hz(),
            vnodes: d_vnodes(),
            remus_hz: d_remus_hz(),
            streams_ports: d_streams_ports(),
            streams_default_hz: d_streams_default_hz(),
            watch_ms: d_watch_ms(),
            probe_timeout_ms: d_probe_timeout_ms(),
            suspect_after_ms: d_suspect_after_ms(),
            rpc_timeout_ms: d_ha_rpc_ms(),
            reprotect_min_ms: d_reprotect_ms(),
            repl_endpoint: None,
            ftmb_endpoint: None,
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{0}")]
pub struct HaConfigError(pub String);

impl HaConfig {
    /// An HA config with everything off (the controller's default without `[ha]`).
    pub fn off() -> HaConfig {
        HaConfig {
            mode: HaMode::Off,
            ..HaConfig::default()
        }
    }

    pub fn check(&self) -> Result<(), HaConfigError> {
        let bad = |s: String| Err(HaConfigError(s));
        for (name, hz) in [
            ("hz", self.hz),
            ("remus_hz", self.remus_hz),
            ("streams_default_hz", self.streams_default_hz),
        ] {
            if hz == 0 || hz > MAX_HZ {
                return bad(format!("{name} = {hz}: must be 1..={MAX_HZ}"));
            }
        }
        if self.vnodes == 0 || self.vnodes > MAX_VNODES {
            return bad(format!(
                "vnodes = {}: must be 1..={MAX_VNODES}",
                self.vnodes
            ));
        }
        if self.watch_ms == 0 || self.watch_ms > 10_000 {
            return bad(format!("watch_ms = {}: must be 1..=10000", self.watch_ms));
        }
        if self.rpc_timeout_ms == 0 {
            return bad("rpc_timeout_ms must be >= 1".into());
        }
        if self.probe_timeout_ms == 0 || self.probe_timeout_ms > 10_000 {
            return bad(format!(
                "probe_timeout_ms = {}: must be 1..=10000",
                self.probe_timeout_ms
            ));
        }
        // Suspicion must need more than one lost segment: at least one minimum TCP
        // retransmission timeout, and several probes' worth of silence.
        let least = TCP_MIN_RTO_MS.max(2 * self.probe_timeout_ms);
        if self.suspect_after_ms < least || self.suspect_after_ms > 600_000 {
            return bad(format!(
                "suspect_after_ms = {}: must be {least}..=600000 (at least the {TCP_MIN_RTO_MS} \
                 ms minimum TCP retransmission timeout and twice probe_timeout_ms = {}, so one \
                 lost segment or one slow probe never suspects a replica)",
                self.suspect_after_ms, self.probe_timeout_ms
            ));
        }
        if self.streams_ports.is_empty() || self.streams_ports.len() > 64 {
            return bad("streams_ports: 1..=64 ranges".into());
        }
        if let Some(r) = self.streams_ports.iter().find(|r| r[0] > r[1]) {
            return bad(format!("streams_ports: range {}-{} is empty", r[0], r[1]));
        }
        Ok(())
    }

    /// Applies `key=value` assignments (`pliant ha protect --policy .. --hz ..`), all or none.
    pub fn with(&self, policy: Option<&str>, hz: Option<u32>) -> Result<HaConfig, HaConfigError> {
        let mut c = self.clone();
        if let Some(p) = policy {
            c.policy = PolicyKind::parse(p).ok_or_else(|| {
                HaConfigError(format!("policy {p:?}: expected chords, single or streams"))
            })?;
        }
        if let Some(h) = hz {
            c.hz = h;
        }
        c.check()?;
        Ok(c)
    }
}

/// The fewest replicas HA protection needs: 1 with HA off; otherwise 2, because every mode
/// protects a primary only with *another* replica ([`build_policy`] answers `{"kind":"off"}`
/// for a primary with no other live replica, in every Pico/Remus policy kind, streams
/// included, which falls back to one backup for both classes; [`ftmb_successor`] finds no
/// logger host for a replica alone). No mode needs more than one other replica, so 2 is
/// enough for each. The elasticity policy never scales in below this (`Policy::floor`).
pub fn ha_min_replicas(cfg: &HaConfig) -> u32 {
    match cfg.mode {
        HaMode::Off => 1,
        HaMode::Pico | HaMode::Remus | HaMode::Ftmb => 2,
    }
}

/// Replica `control_socket`'s channel endpoint: `template` with `{name}` replaced by the
/// control socket's stem (`r2` for `/run/pliant/lab/r2.sock`) and `{index}` by the number
/// that stem ends with (`2`): the replica's channels may be on TCP at another host
/// (`"10.254.0.{index}:7400"`, `"{name}.example:7400"`). Without a template, the unix socket
/// beside the control socket, `<stem>.<suffix>.sock` (the runtime's default).
pub fn endpoint_of(template: Option<&str>, control_socket: &Path, suffix: &str) -> String {
    let stem = control_socket
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "replica".into());
    match template {
        Some(t) => {
            let digits = stem.len() - stem.trim_end_matches(|c: char| c.is_ascii_digit()).len();
            t.replace("{name}", &stem)
                .replace("{index}", &stem[stem.len() - digits..])
        }
        None => control_socket
            .with_file_name(format!("{stem}.{suffix}.sock"))
            .display()
            .to_string(),
    }
}

/// Replica `socket`'s replication socket: beside the control socket, `<stem>.repl.sock`
/// (`/run/pliant/lab/r1.sock` -> `/run/pliant/lab/r1.repl.sock`), the runtime's default.
pub fn repl_socket_of(control_socket: &Path) -> PathBuf {
    let stem = control_socket
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "replica".into());
    control_socket.with_file_name(format!("{stem}.repl.sock"))
}

/// Replica `socket`'s FTMB logger socket: beside the control socket, `<stem>.ftmb.sock`
/// (`/run/pliant/lab/r1.sock` -> `/run/pliant/lab/r1.ftmb.sock`), the runtime's default for
/// `[ha] ftmb_socket` (contract: ftmb-contract.md, "Replica config").
pub fn ftmb_socket_of(control_socket: &Path) -> PathBuf {
    let stem = control_socket
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "replica".into());
    control_socket.with_file_name(format!("{stem}.ftmb.sock"))
}

/// The replica that hosts `primary`'s FTMB logger: the next live replica after it by index
/// (cyclic), so every replica hosts exactly one logger when all are live and a death moves
/// only the dead one's predecessor. `None` when `primary` is alone.
pub fn ftmb_successor(primary: u32, live: &[(u32, PathBuf)]) -> Option<(u32, PathBuf)> {
    let mut others: Vec<&(u32, PathBuf)> = live.iter().filter(|(i, _)| *i != primary).collect();
    others.sort_by_key(|(i, _)| *i);
    others
        .iter()
        .find(|(i, _)| *i > primary)
        .or_else(|| others.first())
        .map(|(i, s)| (*i, s.clone()))
}

/// The `ftmb_protect` request that points `primary`'s workers at the logger of `host`
/// (whose control socket is `host_socket`).
pub fn ftmb_protect_request(cfg: &HaConfig, host: u32, host_socket: &Path) -> Request {
    // `host` names the replica the master must find at the logger's endpoint (its
    // certificate is checked): an address reused by another replica is refused.
    Request::FtmbProtect {
        logger: ftmb_endpoint(cfg, host_socket),
        host: Some(format!("r{host}")),
    }
}

/// Where the FTMB logger hosted by the replica at `host_socket` listens.
pub fn ftmb_endpoint(cfg: &HaConfig, host_socket: &Path) -> String {
    endpoint_of(cfg.ftmb_endpoint.as_deref(), host_socket, "ftmb")
}

/// What the controller keeps of an `ftmb_status` answer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FtmbBrief {
    /// The logger endpoint the replica's workers log to, if any.
    pub logger: Option<String>,
    /// Connected to its logger with a full snapshot acknowledged (the runtime's view).
    pub protected: bool,
    pub snapshots: u64,
    pub last_snapshot_acked: u64,
    /// Primaries whose logger this replica hosts.
    pub hosting: Vec<String>,
    /// Output-commit audit of the output this replica transmits (hosted loggers and its
    /// in-process loggers): outputs checked as they were handed out / of those, released
    /// before a PAL of their VOR was stored. A recovered primary's hosted logger leaves the
    /// status with it, so sample before recoveries.
    pub audit_checked: u64,
    pub audit_violations: u64,
}

impl From<&reply::FtmbStatus> for FtmbBrief {
    fn from(v: &reply::FtmbStatus) -> FtmbBrief {
        let audit = v.audit();
        FtmbBrief {
            logger: v.logger.clone(),
            protected: v.protected,
            snapshots: v.snapshots,
            last_snapshot_acked: v.last_snapshot_acked.unwrap_or(0),
            hosting: v.hosted(),
            audit_checked: audit.audit_checked,
            audit_violations: audit.audit_violations,
        }
    }
}

/// The FTMB-specific numbers of an `ftmb_activate` answer, for the failover record.
pub fn ftmb_activate_detail(v: &reply::FtmbActivate) -> Value {
    json!({"replay_ms": v.replay_ms, "total_ms": v.total_ms,
        "replayed_packets": v.replayed_packets, "suppressed": v.suppressed})
}

fn target(cfg: &HaConfig, index: u32, control_socket: &Path) -> Value {
    let socket = endpoint_of(cfg.repl_endpoint.as_deref(), control_socket, "repl");
    json!({"name": format!("r{index}"), "socket": socket})
}

/// The policy `primary` gets, over the other live replicas `live` (index, control socket; the
/// primary itself may be in it and is skipped). No other replica => `{"kind":"off"}` (nothing
/// to protect to; the primary runs unprotected and is protected again when one appears).
pub fn build_policy(cfg: &HaConfig, primary: u32, live: &[(u32, PathBuf)]) -> Value {
    let mut others: Vec<&(u32, PathBuf)> = live.iter().filter(|(i, _)| *i != primary).collect();
    others.sort_by_key(|(i, _)| *i);
    others.dedup_by_key(|(i, _)| *i);
    // FTMB replicas are not protected by a Pico policy (see `ftmb_protect_request`).
    if matches!(cfg.mode, HaMode::Off | HaMode::Ftmb) || others.is_empty() {
        return json!({"kind": "off"});
    }
    // "Next after the primary" (cyclic by index): spreads single backups evenly over a ring
    // of replicas instead of piling every primary onto the lowest index.
    let start = others.iter().position(|(i, _)| *i > primary).unwrap_or(0);
    let ring: Vec<&(u32, PathBuf)> = others[start..]
        .iter()
        .chain(others[..start].iter())
        .copied()
        .collect();
    let first = target(cfg, ring[0].0, &ring[0].1);
    if cfg.mode == HaMode::Remus {
        return json!({"kind": "remus", "backup": first, "hz": cfg.remus_hz});
    }
    match cfg.policy {
        PolicyKind::Single => json!({"kind": "single", "backup": first, "hz": cfg.hz}),
        PolicyKind::Chords => json!({
            "kind": "chords",
            "backups": ring.iter().map(|(i, s)| target(cfg, *i, s)).collect::<Vec<_>>(),
            "vnodes": cfg.vnodes,
            "hz": cfg.hz,
        }),
        PolicyKind::Streams => {
            let low = ring.get(1).copied().unwrap_or(ring[0]);
            json!({
                "kind": "streams",
                "classes": [{
                    "ports": cfg.streams_ports,
                    "backup": first,
                    "hz": cfg.hz,
                }],
                "default": {"backup": target(cfg, low.0, &low.1), "hz": cfg.streams_default_hz},
            })
        }
    }
}

/// What the controller keeps of an `ha_status` answer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HaBrief {
    pub token: u64,
    /// Some group lost its backup and runs unprotected: the controller must send `protect`.
    pub needs_backup: bool,
    /// Names of the backups those groups lost their link to (suspects until probed).
    pub dead_backups: Vec<String>,
    /// Groups in each state (`up`, `connecting`, `dead`, `unprotected`).
    pub groups_up: u64,
    pub groups_total: u64,
    /// Primaries whose standby state this replica holds, with flow counts.
    pub standby: Vec<(String, u64)>,
    pub audit_checked: u64,
    pub audit_violations: u64,
}

impl From<&reply::HaStatus> for HaBrief {
    fn from(v: &reply::HaStatus) -> HaBrief {
        HaBrief {
            token: v.token,
            needs_backup: v.groups.iter().any(|g| g.needs_backup),
            dead_backups: v.dead_backups(),
            groups_up: v.groups.iter().filter(|g| g.state == "up").count() as u64,
            groups_total: v.groups.len() as u64,
            standby: v
                .standby
                .iter()
                .map(|s| (s.primary.clone(), s.flows))
                .collect(),
            audit_checked: v.output.audit_checked,
            audit_violations: v.output.audit_violations,
        }
    }
}

/// Result of one liveness probe.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Probe {
    /// Something accepts connections on the socket.
    Listening,
    /// No listener (`ECONNREFUSED`) or no socket file (`ENOENT`): the process is gone.
    Dead(String),
    /// Anything else (a full backlog, a transient error, a TCP connect still pending at its
    /// bound): no evidence either way.
    Unknown(String),
}

/// How a probe reached the replica.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    /// Its control socket on this host.
    Unix,
    /// Its TCP control endpoint (maybe on another host).
    Tcp,
}

/// What one connect's outcome says about the replica (pure: the whole failure-detection
/// decision of a probe).
/// - Accepted: `Listening`.
/// - Unix: `ECONNREFUSED` (the file is there, nothing listens: what SIGKILL leaves) or
///   `ENOENT` (no file) is `Dead`. A unix connect completes or fails at once; `EAGAIN` means
///   a full backlog (alive but busy): `Unknown`.
/// - TCP: `ECONNREFUSED` is `Dead`: the replica's host answered the SYN with a reset, so
///   its kernel is up and nothing listens on the port (the process died). Everything else
///   is `Unknown`: a connect that did not complete within its bound (`TimedOut`; a lost SYN
///   is retransmitted only after 1 s, and a full accept queue drops SYNs silently), an
///   unreachable host or network (an ARP or routing failure, maybe transient), a local
///   error. Silence is never death.
pub fn connect_verdict(transport: Transport, outcome: &std::io::Result<()>) -> Probe {
    let err = match outcome {
        Ok(()) => return Probe::Listening,
        Err(e) => e,
    };
    let dead = matches!(
        (transport, err.raw_os_error()),
        (_, Some(libc::ECONNREFUSED)) | (Transport::Unix, Some(libc::ENOENT))
    );
    let what = match (transport, err.kind()) {
        (Transport::Tcp, std::io::ErrorKind::TimedOut) => "connect did not complete in time",
        _ => "connect",
    };
    if dead {
        Probe::Dead(format!("{what}: {err}"))
    } else {
        Probe::Unknown(format!("{what}: {err}"))
    }
}

/// The verdict over every address an endpoint resolved to (pure): listening at any is
/// `Listening`; `Dead` only when every address was (none is not); else `Unknown`.
pub fn verdict_over_addresses(verdicts: Vec<Probe>) -> Probe {
    let (mut dead, mut unknown) = (None, None);
    for v in verdicts {
        match v {
            Probe::Listening => return Probe::Listening,
            Probe::Dead(_) => {
                dead.get_or_insert(v);
            }
            Probe::Unknown(_) => {
                unknown.get_or_insert(v);
            }
        }
    }
    unknown
        .or(dead)
        .unwrap_or_else(|| Probe::Unknown("no address".into()))
}

/// Non-blocking connect to `path`, closed at once (see the module doc).
pub fn probe(path: &Path) -> Probe {
    use std::os::unix::ffi::OsStrExt;
    let Ok(p) = std::str::from_utf8(path.as_os_str().as_bytes()) else {
        return Probe::Unknown(format!("socket path not UTF-8: {}", path.display()));
    };
    let outcome = pliant_runtime::peer::connect_nonblocking(p).map(|_closed_at_once| ());
    connect_verdict(Transport::Unix, &outcome)
}

/// TCP connect to `endpoint` (`host:port`), bounded by `timeout` in all, reset at once
/// (unseen by the replica's process). See [`connect_verdict`].
pub fn probe_tcp(endpoint: &str, timeout: std::time::Duration) -> Probe {
    use std::net::ToSocketAddrs;
    let deadline = std::time::Instant::now() + timeout;
    let addrs: Vec<std::net::SocketAddr> = match endpoint.to_socket_addrs() {
        Ok(a) => a.collect(),
        Err(e) => return Probe::Unknown(format!("resolve {endpoint}: {e}")),
    };
    let mut verdicts = Vec::with_capacity(addrs.len());
    for a in addrs {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            verdicts.push(Probe::Unknown(format!("{a}: no time left")));
            break;
        }
        // Reset, not closed: the replica's listener defers accepting until data arrives, so
        // the kernel discards the probe's connection and the replica never wakes for it.
        let outcome = std::net::TcpStream::connect_timeout(&a, left)
            .map(pliant_wire::endpoint::close_with_reset);
        let v = connect_verdict(Transport::Tcp, &outcome);
        if v == Probe::Listening {
            return v;
        }
        verdicts.push(at(a, v));
    }
    verdict_over_addresses(verdicts)
}

/// TCP probes of many replicas at once from one thread: a non-blocking connect each, all
/// polled together, each verdict handed to `on_verdict` as soon as it is known (a refused
/// connect within microseconds, a silent host at `timeout`), each connection reset as soon
/// as it is up. A thread per probe and round cost the controller more CPU than the probes
/// (a hundred rounds a second). An endpoint that does not resolve to exactly one address
/// is probed with [`probe_tcp`] after the others.
pub fn probe_tcp_many<K: Copy>(
    endpoints: &[(K, String)],
    timeout: std::time::Duration,
    mut on_verdict: impl FnMut(K, Probe),
) {
    use socket2::{Domain, Socket, Type};
    use std::net::ToSocketAddrs;
    let deadline = std::time::Instant::now() + timeout;
    let mut pending: Vec<(K, std::net::SocketAddr, Socket)> = Vec::new();
    let mut in_turn = Vec::new();
    for (k, ep) in endpoints {
        let addrs: Vec<std::net::SocketAddr> = match ep.to_socket_addrs() {
            Ok(a) => a.collect(),
            Err(e) => {
                on_verdict(*k, Probe::Unknown(format!("resolve {ep}: {e}")));
                continue;
            }
        };
        let &[a] = addrs.as_slice() else {
            in_turn.push((*k, ep));
            continue;
        };
        let started = Socket::new(Domain::for_address(a), Type::STREAM.nonblocking(), None)
            .and_then(|s| match s.connect(&a.into()) {
                Ok(()) => Ok((s, true)),
                Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => Ok((s, false)),
                Err(e) => Err(e),
            });
        match started {
            Ok((s, true)) => {
                pliant_wire::endpoint::close_with_reset(s.into());
                on_verdict(*k, Probe::Listening);
            }
            Ok((s, false)) => pending.push((*k, a, s)),
            Err(e) => on_verdict(*k, at(a, connect_verdict(Transport::Tcp, &Err(e)))),
        }
    }
    finish_connects(pending, deadline, &mut on_verdict);
    for (k, ep) in in_turn {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        on_verdict(
            k,
            probe_tcp(ep, left.max(std::time::Duration::from_millis(1))),
        );
    }
}

/// Waits until `deadline` for the pending non-blocking connects and gives each its verdict.
fn finish_connects<K: Copy>(
    mut pending: Vec<(K, std::net::SocketAddr, socket2::Socket)>,
    deadline: std::time::Instant,
    on_verdict: &mut impl FnMut(K, Probe),
) {
    use std::os::fd::AsRawFd;
    // The last round polls without waiting once the bound has passed: a connect that completed
    // while this thread was held up (resolving a name, descheduled on a busy host) is seen as
    // what it is, not reported as one that timed out.
    let mut last = false;
    while !pending.is_empty() && !last {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        last = left.is_zero();
        let mut fds: Vec<libc::pollfd> = pending
            .iter()
            .map(|(_, _, s)| libc::pollfd {
                fd: s.as_raw_fd(),
                events: libc::POLLOUT,
                revents: 0,
            })
            .collect();
        let ms = if last {
            0
        } else {
            left.as_millis().clamp(1, i32::MAX as u128) as i32
        };
        // SAFETY: `fds` is a valid array of `fds.len()` pollfd for the duration of the call.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted && !last {
                continue;
            }
            for (k, a, _) in pending.drain(..) {
                on_verdict(k, Probe::Unknown(format!("{a}: poll: {e}")));
            }
            return;
        }
        // Walk back so that removing an entry leaves the indices still to visit in place.
        for j in (0..fds.len()).rev() {
            if fds[j].revents == 0 {
                continue;
            }
            let (k, a, s) = pending.swap_remove(j);
            let outcome = match s.take_error() {
                Ok(None) => Ok(()),
                Ok(Some(e)) | Err(e) => Err(e),
            };
            if outcome.is_ok() {
                // Reset, not closed, as in `probe_tcp`.
                pliant_wire::endpoint::close_with_reset(s.into());
            }
            on_verdict(k, at(a, connect_verdict(Transport::Tcp, &outcome)));
        }
    }
    for (k, a, _) in pending {
        let timed_out = Err(std::io::ErrorKind::TimedOut.into());
        on_verdict(k, at(a, connect_verdict(Transport::Tcp, &timed_out)));
    }
}

/// A verdict's reason prefixed with the address it is about.
fn at(a: std::net::SocketAddr, v: Probe) -> Probe {
    match v {
        Probe::Dead(w) => Probe::Dead(format!("{a}: {w}")),
        Probe::Unknown(w) => Probe::Unknown(format!("{a}: {w}")),
        Probe::Listening => Probe::Listening,
    }
}

/// Test helpers shared with the controller's tests (one copy, in pliant-testkit).
#[cfg(test)]
pub(crate) mod testing {
    pub(crate) use pliant_testkit::sockets::{bound_not_listening, silent_tcp_endpoint};
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    fn live(n: &[u32]) -> Vec<(u32, PathBuf)> {
        n.iter()
            .map(|i| (*i, PathBuf::from(format!("/run/pliant/lab/r{i}.sock"))))
            .collect()
    }

    /// `ha_min_replicas` is what the placement code needs, not a guess: with that many live
    /// replicas every primary gets a backup (or logger host) on another replica in every mode
    /// and policy kind, and with one fewer it gets none.
    #[test]
    fn ha_min_replicas_is_the_fewest_with_which_every_primary_is_protected() {
        let protected = |cfg: &HaConfig, members: &[(u32, PathBuf)]| {
            members.iter().all(|(i, _)| match cfg.mode {
                HaMode::Off => true,
                HaMode::Ftmb => ftmb_successor(*i, members).is_some_and(|(h, _)| h != *i),
                HaMode::Pico | HaMode::Remus => build_policy(cfg, *i, members)["kind"] != "off",
            })
        };
        assert_eq!(ha_min_replicas(&HaConfig::off()), 1);
        for mode in [HaMode::Pico, HaMode::Remus, HaMode::Ftmb] {
            for policy in [PolicyKind::Chords, PolicyKind::Single, PolicyKind::Streams] {
                let cfg = HaConfig {
                    mode,
                    policy,
                    ..HaConfig::default()
                };
                let n = ha_min_replicas(&cfg);
                let members = live(&(1..=n).collect::<Vec<_>>());
                assert!(protected(&cfg, &members), "{mode:?}/{policy:?} with {n}");
                let fewer = live(&(1..n).collect::<Vec<_>>());
                assert!(
                    !protected(&cfg, &fewer),
                    "{mode:?}/{policy:?}: {} replicas suffice, the floor says {n}",
                    n - 1
                );
            }
        }
    }

    #[test]
    fn endpoint_templates_name_each_replica_or_default_beside_its_socket() {
        let c = Path::new("/run/pliant/lab/r12.sock");
        assert_eq!(
            endpoint_of(None, c, "repl"),
            "/run/pliant/lab/r12.repl.sock"
        );
        assert_eq!(
            endpoint_of(Some("10.254.0.{index}:7400"), c, "repl"),
            "10.254.0.12:7400"
        );
        assert_eq!(
            endpoint_of(Some("{name}.lab:7401"), c, "peer"),
            "r12.lab:7401"
        );
        let cfg = HaConfig {
            ftmb_endpoint: Some("10.254.0.{index}:7402".into()),
            repl_endpoint: Some("10.254.0.{index}:7400".into()),
            ..HaConfig::default()
        };
        assert_eq!(ftmb_endpoint(&cfg, c), "10.254.0.12:7402");
        let live = vec![
            (1, PathBuf::from("/r/r1.sock")),
            (2, PathBuf::from("/r/r2.sock")),
        ];
        let p = build_policy(&cfg, 1, &live);
        assert_eq!(p["backups"][0]["socket"], "10.254.0.2:7400", "{p}");
    }

    #[test]
    fn repl_socket_sits_beside_the_control_socket() {
        assert_eq!(
            repl_socket_of(Path::new("/run/pliant/lab/r3.sock")),
            PathBuf::from("/run/pliant/lab/r3.repl.sock")
        );
    }

    #[test]
    fn ftmb_logger_is_the_next_live_replica_and_sits_beside_its_control_socket() {
        assert_eq!(
            ftmb_socket_of(Path::new("/run/pliant/lab/r3.sock")),
            PathBuf::from("/run/pliant/lab/r3.ftmb.sock")
        );
        let l = live(&[1, 2, 3]);
        let succ = |p| ftmb_successor(p, &l).map(|(i, _)| i);
        assert_eq!((succ(1), succ(2), succ(3)), (Some(2), Some(3), Some(1)));
        // r2 died: r1's logger moves to r3, r3 keeps r1.
        let l = live(&[1, 3]);
        assert_eq!(ftmb_successor(1, &l).map(|(i, _)| i), Some(3));
        assert_eq!(ftmb_successor(3, &l).map(|(i, _)| i), Some(1));
        assert_eq!(ftmb_successor(1, &live(&[1])), None, "alone");
        // A primary not in the list (just died) still gets its would-be successor.
        assert_eq!(
            ftmb_successor(4, &live(&[1, 2, 5])).map(|(i, _)| i),
            Some(5)
        );
        assert_eq!(
            ftmb_protect_request(
                &HaConfig::default(),
                2,
                Path::new("/run/pliant/lab/r2.sock")
            ),
            Request::FtmbProtect {
                logger: "/run/pliant/lab/r2.ftmb.sock".into(),
                host: Some("r2".into())
            }
        );
        // FTMB replicas get no Pico policy.
        let c = HaConfig {
            mode: HaMode::Ftmb,
            ..HaConfig::default()
        };
        assert_eq!(build_policy(&c, 1, &live(&[1, 2]))["kind"], "off");
    }

    #[test]
    fn ftmb_status_keeps_hosted_masters_and_sums_the_audit_of_every_logger() {
        let v = json!({"ok": true, "mode": "ftmb", "workers": 2,
            "logger": "/run/pliant/lab/r2.ftmb.sock", "protected": true, "snapshots": 40,
            "last_snapshot_acked": 39, "last_error": null,
            "local_audit": {"audit_checked": 4, "audit_violations": 1},
            "hosting": {"masters": {
                "r3": {"queues": [{"logged_pal_seq": 4}],
                       "logger": {"outputs_released": 99, "audit_checked": 15,
                                  "audit_violations": 2}},
                "r9": {"logger": {"audit_checked": 1, "audit_violations": 0}}},
                "fenced": {}, "server": {"accepted": 3}}});
        let b = FtmbBrief::from(&reply::decode::<reply::FtmbStatus>(&v).unwrap());
        assert_eq!(b.logger.as_deref(), Some("/run/pliant/lab/r2.ftmb.sock"));
        assert!(b.protected);
        assert_eq!((b.snapshots, b.last_snapshot_acked), (40, 39));
        assert_eq!(b.hosting, vec!["r3".to_string(), "r9".to_string()]);
        assert_eq!((b.audit_checked, b.audit_violations), (20, 3));
        // A status without the audit is malformed, not "0 violations".
        let mut gap = v.clone();
        gap["local_audit"]
            .as_object_mut()
            .unwrap()
            .remove("audit_violations");
        assert!(reply::decode::<reply::FtmbStatus>(&gap).is_err());
    }

    #[test]
    fn ha_status_answers_decode_strictly() {
        let v = json!({"ok": true, "mode": "pico", "token": 4,
            "groups": [{"id": 1, "backup": "r2", "state": "up", "needs_backup": false},
                       {"id": 2, "backup": "r3", "state": "unprotected", "needs_backup": true}],
            "standby": [{"primary": "r1", "flows": 7, "groups": [[1, 9]]}],
            "output": {"audit_checked": 100, "audit_violations": 0}});
        let b = HaBrief::from(&reply::decode::<reply::HaStatus>(&v).unwrap());
        assert_eq!(b.token, 4);
        assert!(b.needs_backup);
        assert_eq!(b.dead_backups, vec!["r3".to_string()]);
        assert_eq!((b.groups_up, b.groups_total), (1, 2));
        assert_eq!(b.standby, vec![("r1".to_string(), 7)]);
        assert_eq!((b.audit_checked, b.audit_violations), (100, 0));
        assert!(reply::decode::<reply::HaStatus>(&json!({"ok": true})).is_err());
    }

    #[test]
    fn protect_options_apply_all_or_nothing() {
        let c = HaConfig::default();
        let d = c.with(Some("single"), Some(10_000)).unwrap();
        assert_eq!((d.policy, d.hz), (PolicyKind::Single, 10_000));
        assert!(c.with(Some("raid"), None).is_err());
        assert!(c.with(Some("single"), Some(0)).is_err());
    }

    #[test]
    fn a_connect_outcome_is_death_only_when_refused_and_silence_never_is() {
        use std::io::{Error, ErrorKind};
        let os = Error::from_raw_os_error;
        let v = |t, o: std::io::Result<()>| connect_verdict(t, &o);
        for t in [Transport::Unix, Transport::Tcp] {
            assert_eq!(v(t, Ok(())), Probe::Listening);
            // Nothing listens (unix: the file SIGKILL leaves; TCP: a reset from the host).
            assert!(matches!(v(t, Err(os(libc::ECONNREFUSED))), Probe::Dead(_)));
        }
        assert!(matches!(
            v(Transport::Unix, Err(os(libc::ENOENT))),
            Probe::Dead(_)
        ));
        // A full unix backlog: alive but busy.
        assert!(matches!(
            v(Transport::Unix, Err(os(libc::EAGAIN))),
            Probe::Unknown(_)
        ));
        // TCP: no answer within the bound (std's connect_timeout, or the kernel's own), an
        // unreachable host or network, a local shortage: no evidence, never death.
        for e in [
            Error::new(ErrorKind::TimedOut, "connection timed out"),
            os(libc::ETIMEDOUT),
            os(libc::EHOSTUNREACH),
            os(libc::ENETUNREACH),
            os(libc::EADDRNOTAVAIL),
            os(libc::EMFILE),
            os(libc::ENOENT),
        ] {
            let s = e.to_string();
            assert!(
                matches!(v(Transport::Tcp, Err(e)), Probe::Unknown(_)),
                "{s}"
            );
        }
        let Probe::Unknown(why) = v(
            Transport::Tcp,
            Err(Error::new(ErrorKind::TimedOut, "connection timed out")),
        ) else {
            unreachable!()
        };
        assert!(why.contains("did not complete in time"), "{why}");
    }

    #[test]
    fn an_endpoint_is_dead_only_when_every_address_refused() {
        let dead = || Probe::Dead("refused".into());
        let unknown = || Probe::Unknown("timed out".into());
        assert_eq!(
            verdict_over_addresses(vec![dead(), Probe::Listening]),
            Probe::Listening
        );
        assert_eq!(verdict_over_addresses(vec![dead(), dead()]), dead());
        assert_eq!(verdict_over_addresses(vec![dead(), unknown()]), unknown());
        assert_eq!(verdict_over_addresses(vec![unknown(), dead()]), unknown());
        assert!(matches!(verdict_over_addresses(vec![]), Probe::Unknown(_)));
    }

    #[test]
    fn with_a_control_endpoint_the_probe_connects_over_tcp() {
        use crate::replica_client::Dialer;
        use std::time::Duration;
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let d = Dialer {
            security: None,
            template: Some(format!("127.0.0.1:{port}")),
            ..Default::default()
        };
        // The unix socket does not exist: only the TCP endpoint can answer.
        let sock = Path::new("/nonexistent/pliant/r1.sock");
        assert_eq!(d.probe(sock, Duration::from_secs(5)), Probe::Listening);
        assert!(matches!(
            Dialer::default().probe(sock, Duration::from_secs(5)),
            Probe::Dead(_)
        ));
        // Nothing listens on this port: the kernel answers the SYN with a reset. The port is
        // held bound (not listening) rather than freed by closing a listener, so neither another
        // test's listener nor the probe's own ephemeral source port (a TCP self-connect) can
        // take it meanwhile.
        let (_held, closed_port) = testing::bound_not_listening();
        let d = Dialer {
            security: None,
            template: Some(format!("127.0.0.1:{closed_port}")),
            ..Default::default()
        };
        let v = d.probe(sock, Duration::from_secs(5));
        assert!(
            matches!(&v, Probe::Dead(w) if w.contains("refused")),
            "{v:?}"
        );
    }

    #[test]
    fn a_tcp_connect_that_never_completes_is_unknown_not_dead() {
        use std::time::{Duration, Instant};
        let (l, _filler) = testing::silent_tcp_endpoint("127.0.0.1:0".parse().unwrap());
        let ep = l.local_addr().unwrap().to_string();
        let t0 = Instant::now();
        let v = probe_tcp(&ep, Duration::from_millis(300));
        assert!(
            matches!(&v, Probe::Unknown(w) if w.contains("did not complete in time")),
            "{v:?}"
        );
        // It waited for its bound (the SYN was dropped, not answered): a causal lower bound.
        assert!(t0.elapsed() >= Duration::from_millis(300));
    }

    /// A connect that completed while the probing thread was held up past the bound (a slow
    /// name lookup of another endpoint, a busy host) is a live endpoint, not a timed-out one:
    /// past the deadline the pending connects are still polled once, without waiting.
    #[test]
    fn a_connect_completed_while_the_prober_was_held_up_is_listening_not_timed_out() {
        use std::time::{Duration, Instant};
        let listening = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = listening.local_addr().unwrap();
        let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        s.connect(&a.into()).unwrap();
        let passed = Instant::now() - Duration::from_millis(50);
        let mut got = Vec::new();
        finish_connects(vec![(1u32, a, s)], passed, &mut |k, v| got.push((k, v)));
        assert_eq!(got, vec![(1, Probe::Listening)]);
    }

    #[test]
    fn many_tcp_probes_from_one_thread_each_get_their_own_verdict_as_it_comes() {
        use std::time::{Duration, Instant};
        let listening = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let (_held, closed_port) = testing::bound_not_listening();
        let (silent, _filler) = testing::silent_tcp_endpoint("127.0.0.1:0".parse().unwrap());
        let eps = vec![
            (1u32, silent.local_addr().unwrap().to_string()),
            (2, listening.local_addr().unwrap().to_string()),
            (3, format!("127.0.0.1:{closed_port}")),
            (4, "no-such-host.invalid:1".to_string()),
        ];
        let t0 = Instant::now();
        let mut got = Vec::new();
        probe_tcp_many(&eps, Duration::from_millis(300), |k, v| {
            got.push((k, v, t0.elapsed()))
        });
        let verdict = |k: u32| got.iter().find(|g| g.0 == k).expect("a verdict each");
        assert_eq!(got.len(), 4, "{got:?}");
        assert_eq!(verdict(2).1, Probe::Listening);
        assert!(
            matches!(&verdict(3).1, Probe::Dead(w) if w.contains("refused")),
            "{got:?}"
        );
        assert!(
            matches!(&verdict(4).1, Probe::Unknown(w) if w.contains("resolve")),
            "{got:?}"
        );
        assert!(
            matches!(&verdict(1).1, Probe::Unknown(w) if w.contains("did not complete in time")),
            "{got:?}"
        );
        // The silent endpoint held up no other verdict: it came last, at its bound.
        assert_eq!(got.last().map(|g| g.0), Some(1), "{got:?}");
        assert!(verdict(1).2 >= Duration::from_millis(300));
        // The listener's connection was reset, never left for it to accept as a client.
        listening.set_nonblocking(true).unwrap();
        if let Ok((s, _)) = listening.accept() {
            let mut b = [0u8; 1];
            let r = std::io::Read::read(&mut &s, &mut b);
            assert!(
                matches!(&r, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset),
                "{r:?}"
            );
        }
    }

    #[test]
    fn probe_timeouts_and_suspicion_are_validated() {
        let d = HaConfig::default();
        assert_eq!((d.probe_timeout_ms, d.suspect_after_ms), (100, 1000));
        assert_eq!(d.check(), Ok(()));
        let with = |p: u64, s: u64| {
            HaConfig {
                probe_timeout_ms: p,
                suspect_after_ms: s,
                ..HaConfig::default()
            }
            .check()
        };
        assert_eq!(with(300, 600), Ok(()));
        for (p, s, needle) in [
            (0, 1000, "probe_timeout_ms = 0"),
            (10_001, 30_000, "probe_timeout_ms = 10001"),
            // One minimum RTO (200 ms) of silence must never suspect.
            (50, 150, "suspect_after_ms = 150: must be 200..=600000"),
            // Nor one slow probe.
            (600, 1000, "suspect_after_ms = 1000: must be 1200..=600000"),
            (100, 600_001, "suspect_after_ms = 600001"),
        ] {
            let e = with(p, s).unwrap_err().0;
            assert!(e.contains(needle), "{p}/{s}: {e}");
        }
    }

    #[test]
    fn probe_tells_a_listener_from_a_dead_socket() {
        let dir = std::env::temp_dir().join(format!("pliant-ha-probe-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("r1.sock");
        assert!(matches!(probe(&p), Probe::Dead(_)), "no file: ENOENT");
        let l = UnixListener::bind(&p).unwrap();
        assert_eq!(probe(&p), Probe::Listening);
        drop(l);
        // The file stays, the listener is gone (what SIGKILL leaves behind): ECONNREFUSED.
        assert!(p.exists());
        assert!(matches!(probe(&p), Probe::Dead(e) if e.contains("refused")));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
