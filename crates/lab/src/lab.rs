//! `Lab`: bring the topology up, run commands in it, tear it down (also from `Drop`).

use crate::cmd::{self, ExecOutput, SETUP_TIMEOUT};
use crate::error::{io_err, LabError, Result};
use crate::fabric;
use crate::state::{self, LabState, Owner, ProcRecord};
use crate::topology::*;
use pliant_runtime::config::{NfSection, PortConfig, ReplicaConfig, ReplicaSection};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Where labs keep their run directories unless told otherwise.
pub const DEFAULT_RUN_ROOT: &str = "/run/pliant";
/// Default bound for commands run through [`Lab::exec`].
pub const EXEC_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a pliant replica may take to answer on its control socket.
pub const REPLICA_READY_TIMEOUT: Duration = Duration::from_secs(15);
/// How long nginx/iperf3 may take to write their pid files and listen.
const SERVER_READY_TIMEOUT: Duration = Duration::from_secs(10);
/// Replicas per lab: one uses the tc mirred patch panel, more use pliant-steer's BPF steering
/// (see `fabric::install`).
pub const MAX_REPLICAS: u8 = 8;

/// The NF a pliant replica runs: `[nf] kind` plus its own TOML sections (e.g. `[nat]`).
#[derive(Clone, Debug, PartialEq)]
pub struct PliantNf {
    pub kind: String,
    pub sections: toml::Table,
}

impl PliantNf {
    pub fn new(kind: &str, sections: toml::Table) -> Self {
        PliantNf {
            kind: kind.to_string(),
            sections,
        }
    }

    /// Source NAT to the replica's outside address (what the kernel-nat peer does too).
    pub fn nat() -> Self {
        let mut nat = toml::Table::new();
        nat.insert("external_ip".into(), OUTSIDE_GW_IP.into());
        let mut sections = toml::Table::new();
        sections.insert("nat".into(), toml::Value::Table(nat));
        PliantNf::new("nat", sections)
    }

    /// Plain routing through the runtime (no NF state), the analogue of kernel forwarding.
    pub fn forward() -> Self {
        PliantNf::new("forward", toml::Table::new())
    }

    /// NF kinds a lab can run by name (`pliant-<kind>` modes): each with its own section's
    /// defaults (NAT: to the lab's outside address), refined by [`PliantNf::merge_sections`].
    pub const KINDS: [&'static str; 5] = ["nat", "forward", "firewall", "ids", "mbserv"];

    /// The NF `kind` with its defaults; `None` for a kind labs do not know.
    pub fn of_kind(kind: &str) -> Option<Self> {
        match kind {
            "nat" => Some(PliantNf::nat()),
            k if PliantNf::KINDS.contains(&k) => Some(PliantNf::new(k, toml::Table::new())),
            _ => None,
        }
    }

    /// Adds the tables of `text` (TOML: the NF's own sections, e.g. `[firewall]` with its
    /// `[[firewall.rules]]`) over the defaults, key by key within a section. Sections the
    /// lab writes itself (replica, ports, HA, security) are refused: they are not the NF's.
    pub fn merge_sections(&mut self, text: &str) -> std::result::Result<(), String> {
        let t: toml::Table = toml::from_str(text).map_err(|e| e.to_string())?;
        for (name, v) in t {
            if [
                "replica",
                "inside",
                "outside",
                "nf",
                "ha",
                "security",
                "migration",
            ]
            .contains(&name.as_str())
            {
                return Err(format!(
                    "[{name}] is written by the lab, not an NF section of a lab's replicas"
                ));
            }
            let toml::Value::Table(v) = v else {
                return Err(format!("{name} is not a section"));
            };
            match self.sections.get_mut(&name) {
                Some(toml::Value::Table(cur)) => cur.extend(v),
                _ => {
                    self.sections.insert(name, toml::Value::Table(v));
                }
            }
        }
        Ok(())
    }
}

/// What runs in a replica namespace.
#[derive(Clone, Debug, PartialEq)]
pub enum ReplicaMode {
    /// Linux router: in-port 10.77.1.1/24, out-port 10.77.2.1/24, ip_forward=1.
    KernelForward,
    /// KernelForward plus nftables masquerade of the client subnet on the out-port.
    KernelNat,
    /// `pliant replica --config <file>`; the ports carry no kernel addresses.
    Pliant { config: PliantNf },
}

impl ReplicaMode {
    /// Stable label used in state files, CLI flags and benchmark JSON.
    pub fn label(&self) -> String {
        match self {
            ReplicaMode::KernelForward => "kernel-forward".into(),
            ReplicaMode::KernelNat => "kernel-nat".into(),
            ReplicaMode::Pliant { config } => format!("pliant-{}", config.kind),
        }
    }

    /// Parse a CLI mode (`kernel-nat`, `kernel-forward`, `pliant-nat`, `pliant-forward`).
    pub fn parse(s: &str) -> Option<ReplicaMode> {
        match s {
            "kernel-forward" => Some(ReplicaMode::KernelForward),
            "kernel-nat" => Some(ReplicaMode::KernelNat),
            _ => PliantNf::of_kind(s.strip_prefix("pliant-")?)
                .map(|config| ReplicaMode::Pliant { config }),
        }
    }
}

/// A file the server's nginx serves, generated with deterministic pseudo-random content.
#[derive(Clone, Debug, PartialEq)]
pub struct FileSpec {
    pub name: String,
    pub size_bytes: u64,
}

/// A generated file as served: where to fetch it and what it must hash to.
#[derive(Clone, Debug, PartialEq)]
pub struct ServedFile {
    pub name: String,
    pub size_bytes: u64,
    /// Lower-case hex sha256 of the content.
    pub sha256: String,
    /// `http://10.77.2.2/<name>`
    pub url: String,
}

#[derive(Clone, Debug)]
pub struct LabSpec {
    /// Lab name (`[a-z0-9-]`, 1..=16 chars); default `pl<6 random hex>`.
    pub name: Option<String>,
    pub mode: ReplicaMode,
    /// Number of replicas, 1..=[`MAX_REPLICAS`].
    pub replicas: u8,
    /// The `pliant` binary; required for `ReplicaMode::Pliant` unless `replica_command` is set.
    pub pliant_bin: Option<PathBuf>,
    /// `ReplicaMode::Pliant` only: run this program (argv, the replica config path appended)
    /// instead of `<pliant_bin> replica --config <path>` — e.g. a network function written in
    /// C against libpliant (`nf.kind = "c"`), which opens the replica itself.
    pub replica_command: Option<Vec<String>>,
    pub files: Vec<FileSpec>,
    /// Turn off checksum/segmentation offloads on every lab interface (some user-space packet
    /// paths want real checksums and MTU-sized frames).
    pub disable_offloads: bool,
    /// The lab outlives this process (`pliant lab up`): not stale when the creator exits and
    /// [`Lab::detach`] is expected.
    pub detached: bool,
    pub run_root: PathBuf,
    /// Print progress lines to stderr.
    pub progress: bool,
    /// High availability (pliant modes only): every replica config gets an `[ha]` section
    /// (its replication socket beside the control socket; replicas authenticate with their
    /// `[security]` identity), so any replica can be a primary or a backup. Replicas added later by `scale::add_replica` inherit it.
    pub ha: bool,
    /// The HA mode the replicas run (with `ha`): Pico (default) or FTMB (`[ha]`
    /// gets `mode = "ftmb"`, `ftmb_workers`, `ftmb_snapshot_ms`). FTMB without `ha` is refused.
    pub ha_mode: crate::ha::LabHaMode,
    /// pliant modes: `[replica] realtime_priority` of every replica (SCHED_FIFO; `None`: the
    /// normal scheduler). Replicas added later copy it with the rest of the config.
    pub realtime_priority: Option<u8>,
    /// How replicas reach each other: unix sockets under the lab's run directory (default),
    /// or TCP over a management network between the replica namespaces, as between hosts
    /// (see [`crate::mgmt`]).
    pub transport: crate::mgmt::Transport,
    /// Each replica namespace is a host with its own `pliant agent`, which starts the host's
    /// replica (pliant modes over TCP only; see [`crate::agents`]).
    pub agents: bool,
    /// With `agents`: the hosts' replica ports reach the fabric through VXLAN tunnels over
    /// the management network instead of veths ([`crate::mgmt::tunnel_ports`]).
    pub tunnels: bool,
    /// With `agents`: this many controllers (0: none, the caller runs its own), each on a
    /// host of its own, electing a leader in an etcd on another host ([`crate::control`]).
    pub controllers: u8,
    /// With `agents`: this many more hosts (`r<replicas+1>`…), each with its agent, links and
    /// replica config but no replica running: somewhere a controller can scale out to, after
    /// a host's loss for instance (a stopped slot on a host running none).
    pub spare_hosts: u8,
}

impl LabSpec {
    /// Hosts (replica namespaces) in all: the running replicas' and the spare ones.
    pub fn hosts(&self) -> u8 {
        self.replicas.saturating_add(self.spare_hosts)
    }

    pub fn new(mode: ReplicaMode) -> Self {
        LabSpec {
            name: None,
            mode,
            replicas: 1,
            pliant_bin: None,
            replica_command: None,
            files: vec![FileSpec {
                name: "1M.bin".into(),
                size_bytes: 1 << 20,
            }],
            disable_offloads: false,
            detached: false,
            run_root: PathBuf::from(DEFAULT_RUN_ROOT),
            progress: true,
            ha: false,
            ha_mode: crate::ha::LabHaMode::Pico,
            realtime_priority: None,
            transport: crate::mgmt::Transport::Unix,
            agents: false,
            controllers: 0,
            spare_hosts: 0,
            tunnels: false,
        }
    }

    pub fn with_file(mut self, name: &str, size_bytes: u64) -> Self {
        self.files.push(FileSpec {
            name: name.into(),
            size_bytes,
        });
        self
    }
}

/// Per-interface counters (`ip -s -j link`), for benchmarks and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LinkStats {
    pub rx_packets: u64,
    pub rx_dropped: u64,
    pub tx_packets: u64,
    pub tx_dropped: u64,
}

/// A running lab. Dropping it tears everything down (unless [`Lab::detach`]ed).
pub struct Lab {
    state: LabState,
    files: Vec<ServedFile>,
    /// Long-running processes this handle spawned directly (replicas), reaped at teardown.
    children: Vec<Child>,
    replica_sockets: Vec<PathBuf>,
    mode: ReplicaMode,
    progress: bool,
    finished: bool,
    /// BPF steering over 2+ replicas; dropped (filters detached) before the namespaces go.
    steer: Option<pliant_steer::Steer>,
}

/// Validate a user-given lab name: it becomes part of namespace names and a directory name.
pub fn validate_name(name: &str) -> Result<()> {
    let bad = |reason| {
        Err(LabError::BadName {
            name: name.to_string(),
            reason,
        })
    };
    if name.is_empty() || name.len() > 16 {
        return bad("must be 1 to 16 characters");
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    {
        return bad("only a-z, 0-9 and '-' are allowed");
    }
    if name.starts_with('-') {
        return bad("must not start with '-'");
    }
    Ok(())
}

fn random_name() -> String {
    let mut b = [0u8; 3];
    let got = std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))
        .is_ok();
    if !got {
        // Fall back to time and PID: still unique enough across concurrent runs on one host.
        let t = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0)
            ^ std::process::id().rotate_left(13);
        b = [(t >> 16) as u8, (t >> 8) as u8, t as u8];
    }
    format!("pl{:02x}{:02x}{:02x}", b[0], b[1], b[2])
}

fn argv(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

impl Lab {
    /// Build the whole topology. On any error everything created so far is removed.
    pub fn up(spec: LabSpec) -> Result<Lab> {
        let name = match &spec.name {
            Some(n) => {
                validate_name(n)?;
                n.clone()
            }
            None => random_name(),
        };
        if spec.replicas == 0 || spec.replicas > MAX_REPLICAS {
            return Err(LabError::Replicas {
                asked: spec.replicas,
                max: MAX_REPLICAS,
            });
        }
        // Checked before anything exists: a half-built lab would be torn down anyway.
        if spec.ha_mode != crate::ha::LabHaMode::Pico && !spec.ha {
            return Err(LabError::Config(format!(
                "ha_mode = {} needs ha = true",
                spec.ha_mode.label()
            )));
        }
        if matches!(spec.mode, ReplicaMode::Pliant { .. })
            && spec.pliant_bin.is_none()
            && spec.replica_command.is_none()
        {
            return Err(LabError::NoPliantBinary);
        }
        if spec.agents
            && (spec.transport != crate::mgmt::Transport::Tcp
                || !matches!(spec.mode, ReplicaMode::Pliant { .. })
                || spec.pliant_bin.is_none()
                || spec.replica_command.is_some())
        {
            return Err(LabError::Config(
                "host agents need pliant replicas over TCP (transport tcp) run by the pliant \
                 binary (not a replica command)"
                    .into(),
            ));
        }
        if spec.controllers > crate::control::MAX_CONTROLLERS
            || (spec.controllers > 0 && !spec.agents)
        {
            return Err(LabError::Config(format!(
                "controllers = {}: 1..={} controllers on hosts of their own need a lab of \
                 hosts (agents)",
                spec.controllers,
                crate::control::MAX_CONTROLLERS
            )));
        }
        if spec.controllers > 0 {
            // Both must start (etcd serves, etcdctl tells when it is healthy).
            let missing: Vec<&str> = [(crate::etcd::ETCD_BIN, "--version"), ("etcdctl", "version")]
                .into_iter()
                .filter(|(b, v)| cmd::run(&argv(&[b, v]), SETUP_TIMEOUT).is_err())
                .map(|(b, _)| b)
                .collect();
            if !missing.is_empty() {
                return Err(LabError::Config(format!(
                    "controllers on hosts of their own elect a leader in etcd: {} missing \
                     (apt-get install etcd-server etcd-client), or run none (controllers = 0, \
                     `--controllers 0`)",
                    missing.join(" and ")
                )));
            }
        }
        if spec.spare_hosts > 0
            && (!spec.agents
                || spec.replicas < 2
                || spec.replicas.saturating_add(spec.spare_hosts) > MAX_REPLICAS)
        {
            return Err(LabError::Config(format!(
                "spare_hosts = {}: spare hosts need a lab of hosts (agents) with 2+ replicas \
                 and at most {MAX_REPLICAS} hosts in all",
                spec.spare_hosts
            )));
        }
        if spec.tunnels && !spec.agents {
            return Err(LabError::Config(
                "tunnels connect the replica ports of a lab's hosts: they need host agents".into(),
            ));
        }
        std::fs::create_dir_all(&spec.run_root).map_err(io_err(&spec.run_root))?;
        let run_dir = spec.run_root.join(&name);
        // create_dir (not _all) is the atomic claim on the name: two racing `up`s cannot both win.
        match std::fs::create_dir(&run_dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                return Err(LabError::Exists(name))
            }
            Err(e) => return Err(io_err(&run_dir)(e)),
        }
        let me = std::process::id() as i32;
        let owner = if spec.detached {
            None
        } else {
            state::proc_start_ticks(me).map(|start_ticks| Owner {
                pid: me,
                start_ticks,
            })
        };
        let st = LabState {
            name,
            run_dir,
            mode: spec.mode.label(),
            created_unix_s: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            owner,
            namespaces: Vec::new(),
            procs: Vec::new(),
            // Replicas that talk over TCP also see no files of each other (see `host`).
            private_hosts: spec.transport == crate::mgmt::Transport::Tcp
                && matches!(spec.mode, ReplicaMode::Pliant { .. }),
            agents: spec.agents,
        };
        st.save()?;
        let mut lab = Lab {
            state: st,
            files: Vec::new(),
            children: Vec::new(),
            replica_sockets: Vec::new(),
            mode: spec.mode.clone(),
            progress: spec.progress,
            finished: false,
            steer: None,
        };
        let start = Instant::now();
        // If build fails, `lab` is dropped here and Drop removes what was made.
        lab.build(&spec)?;
        lab.say(&format!(
            "up in {:.1} s ({})",
            start.elapsed().as_secs_f64(),
            lab.state.mode
        ));
        Ok(lab)
    }

    fn say(&self, msg: &str) {
        if self.progress {
            eprintln!("[lab {}] {msg}", self.state.name);
        }
    }

    pub fn name(&self) -> &str {
        &self.state.name
    }
    pub fn run_dir(&self) -> &Path {
        &self.state.run_dir
    }
    pub fn mode(&self) -> &ReplicaMode {
        &self.mode
    }
    pub fn state(&self) -> &LabState {
        &self.state
    }
    /// Namespace name of a role (`<lab>-client`, `<lab>-r1`, ...).
    pub fn netns(&self, role: Role) -> String {
        format!("{}-{}", self.state.name, role.suffix())
    }
    pub fn served_files(&self) -> &[ServedFile] {
        &self.files
    }
    pub fn served_file(&self, name: &str) -> Option<&ServedFile> {
        self.files.iter().find(|f| f.name == name)
    }
    /// Where the control socket of replica `n` is (or would be), whether the lab started it
    /// or a scale-out added it: in its host directory if replicas run on private hosts.
    pub fn control_socket_of(&self, n: u8) -> PathBuf {
        crate::host::socket(&self.state.run_dir, n, self.state.private_hosts)
    }

    /// Control socket of pliant replica `n` (1-based), if the mode runs pliant.
    pub fn replica_socket(&self, n: u8) -> Option<&Path> {
        self.replica_sockets
            .get(usize::from(n).checked_sub(1)?)
            .map(PathBuf::as_path)
    }
    pub fn nginx_access_log(&self) -> PathBuf {
        self.state.run_dir.join("nginx-access.log")
    }
    /// Replica `n`'s FTMB logger socket (FTMB labs; the runtime's default path).
    pub fn ftmb_socket(&self, n: u8) -> PathBuf {
        crate::ha::ftmb_socket(&self.state.run_dir, n)
    }
    /// Replica `n`'s replication socket (`[ha] repl_socket`).
    pub fn repl_socket(&self, n: u8) -> PathBuf {
        crate::ha::repl_socket(&self.state.run_dir, n)
    }
    /// PID of replica `n`'s `pliant replica` process (also for replicas added later by
    /// `scale::add_replica`: read from `state.json`), if it is still running.
    pub fn replica_pid(&self, n: u8) -> Option<i32> {
        let st = state::LabState::load(&self.state.path()).unwrap_or_else(|_| self.state.clone());
        crate::ha::replica_pid(&st, n)
    }
    /// The replica's log file (stdout and stderr of `pliant replica`).
    pub fn replica_log(&self, n: u8) -> PathBuf {
        if self.state.agents {
            return crate::agents::replica_log(&self.state.run_dir, n);
        }
        self.state.run_dir.join(format!("r{n}.log"))
    }

    /// Run a command inside a role's namespace, capturing output (bounded by [`EXEC_TIMEOUT`]).
    pub fn exec(&self, role: Role, args: &[&str]) -> Result<ExecOutput> {
        self.exec_timeout(role, args, EXEC_TIMEOUT)
    }

    pub fn exec_timeout(&self, role: Role, args: &[&str], timeout: Duration) -> Result<ExecOutput> {
        cmd::run(&cmd::in_ns(&self.netns(role), args), timeout)
    }

    /// Like [`Lab::exec`] but a non-zero exit is an error carrying stderr.
    pub fn exec_ok(&self, role: Role, args: &[&str]) -> Result<ExecOutput> {
        cmd::run_ok(&cmd::in_ns(&self.netns(role), args), EXEC_TIMEOUT)
    }

    /// Start a background command in a namespace with stdout+stderr going to `log`. The child
    /// leads its own process group so [`cmd::stop_group`] reaches helpers it forks (trafgen's
    /// workers). The caller owns the child; teardown kills it anyway if it is still running.
    pub fn spawn(&self, role: Role, args: &[&str], log: &Path) -> Result<Child> {
        let argv = cmd::in_ns(&self.netns(role), args);
        spawn_logged(&argv, log)
    }

    /// Counters of an interface inside a role's namespace.
    pub fn link_stats(&self, role: Role, ifname: &str) -> Result<LinkStats> {
        let ns = self.netns(role);
        let out = cmd::run_ok(
            &argv(&["ip", "-n", &ns, "-s", "-j", "link", "show", "dev", ifname]),
            SETUP_TIMEOUT,
        )?;
        parse_link_stats(&out.stdout).ok_or_else(|| LabError::Command {
            cmd: format!("ip -n {ns} -s -j link show dev {ifname}"),
            code: Some(0),
            stderr: "unexpected JSON (no stats64)".into(),
        })
    }

    /// Tear down now, reporting anything that could not be removed.
    pub fn down(mut self) -> Result<()> {
        let problems = self.teardown();
        if problems.is_empty() {
            Ok(())
        } else {
            Err(LabError::Command {
                cmd: format!("lab down {}", self.state.name),
                code: None,
                stderr: problems.join("; "),
            })
        }
    }

    /// Leave the lab running after this handle goes away (for `pliant lab up`).
    pub fn detach(mut self) -> LabState {
        self.finished = true;
        // Steering outlives this process: filters stay, maps are pinned for the controller.
        if let Some(s) = self.steer.take() {
            let _ = s.persist();
        }
        self.state.clone()
    }

    fn teardown(&mut self) -> Vec<String> {
        if self.finished {
            return Vec::new();
        }
        self.finished = true;
        // Detach steering inside the fabric namespace while it still exists.
        self.steer = None;
        // Replicas added while the lab ran (`scale::add_replica`, e.g. by a controller) are
        // recorded only in state.json, so tear down the union of what this handle and the file
        // know. Stale entries are harmless: missing namespaces are skipped and a recorded PID is
        // signalled only if its command line still carries this lab's run directory.
        let mut st = self.state.clone();
        if let Ok(disk) = state::LabState::load(&st.path()) {
            if disk.name == st.name {
                for ns in disk.namespaces {
                    if !st.namespaces.contains(&ns) {
                        st.namespaces.push(ns);
                    }
                }
                for p in disk.procs {
                    if !st.procs.iter().any(|q| q.pid == p.pid) {
                        st.procs.push(p);
                    }
                }
            }
        }
        let problems = state::teardown(&st);
        // Reap our direct children so none lingers as a zombie in a long-lived test process.
        for c in &mut self.children {
            let _ = cmd::wait_bounded(c, Duration::from_secs(2));
        }
        self.say("down");
        problems
    }

    fn record_ns(&mut self, role: Role) -> Result<String> {
        let ns = self.netns(role);
        self.state.namespaces.push(ns.clone());
        self.state.save()?;
        Ok(ns)
    }

    fn record_proc(&mut self, pid: i32, role: &str) -> Result<()> {
        self.state.procs.push(ProcRecord {
            pid,
            role: role.to_string(),
            // Trailing '/' so lab "demo" never matches a process of lab "demo2".
            marker: format!("{}/", self.state.run_dir.display()),
        });
        self.state.save()
    }

    fn build(&mut self, spec: &LabSpec) -> Result<()> {
        let mut roles = vec![Role::Client, Role::Fabric, Role::Server];
        roles.extend((1..=spec.hosts()).map(Role::Replica));
        for role in &roles {
            let ns = self.record_ns(*role)?;
            make_netns(&ns)?;
        }
        // The control plane's hosts (etcd, controllers): on the management network only.
        for name in crate::control::hosts(spec.controllers) {
            let ns = crate::control::netns(&self.state.name, &name);
            self.state.namespaces.push(ns.clone());
            self.state.save()?;
            make_netns(&ns)?;
        }
        self.build_links(spec)
    }

    fn build_links(&mut self, spec: &LabSpec) -> Result<()> {
        // Every host's ports and links exist from the start (spare ones too); the steering
        // covers the running replicas, a controller adds a spare's ports when it starts one.
        let replicas = spec.replicas;
        let hosts = spec.hosts();
        let (cl, fab, srv) = (
            self.netns(Role::Client),
            self.netns(Role::Fabric),
            self.netns(Role::Server),
        );
        // Links: each veth is created with both ends directly in their namespaces.
        let mut links: Vec<(String, String, String, String, &str)> = vec![
            (
                cl.clone(),
                CLIENT_IF.into(),
                fab.clone(),
                FAB_CLIENT_IF.into(),
                CLIENT_MAC,
            ),
            (
                srv.clone(),
                SERVER_IF.into(),
                fab.clone(),
                FAB_SERVER_IF.into(),
                SERVER_MAC,
            ),
        ];
        // Tunnelled host labs carry the replica ports over the management network (below).
        for n in (1..=hosts).filter(|_| !spec.tunnels) {
            let rn = self.netns(Role::Replica(n));
            links.push((
                rn.clone(),
                replica_in_if(n),
                fab.clone(),
                fabric_in_if(n),
                IN_PORT_MAC,
            ));
            links.push((
                rn,
                replica_out_if(n),
                fab.clone(),
                fabric_out_if(n),
                OUT_PORT_MAC,
            ));
        }
        for (ns_a, if_a, ns_b, if_b, mac_a) in &links {
            cmd::run_ok(
                &argv(&[
                    "ip", "-n", ns_a, "link", "add", if_a, "address", mac_a, "type", "veth",
                    "peer", "name", if_b, "netns", ns_b,
                ]),
                SETUP_TIMEOUT,
            )?;
            if spec.disable_offloads {
                for (ns, ifn) in [(ns_a, if_a), (ns_b, if_b)] {
                    // Not every feature is changeable on veth; ethtool then exits non-zero
                    // although the others were changed, so only a spawn failure is fatal.
                    cmd::run(
                        &cmd::in_ns(
                            ns,
                            &[
                                "ethtool", "-K", ifn, "tx", "off", "tso", "off", "gso", "off",
                                "gro", "off",
                            ],
                        ),
                        SETUP_TIMEOUT,
                    )?;
                }
            }
            for (ns, ifn) in [(ns_a, if_a), (ns_b, if_b)] {
                cmd::run_ok(
                    &argv(&["ip", "-n", ns, "link", "set", ifn, "up"]),
                    SETUP_TIMEOUT,
                )?;
            }
        }
        let plen = PREFIX_LEN.to_string();
        for (ns, ifn, ip, gw) in [
            (&cl, CLIENT_IF, CLIENT_IP, INSIDE_GW_IP),
            (&srv, SERVER_IF, SERVER_IP, OUTSIDE_GW_IP),
        ] {
            let cidr = format!("{ip}/{plen}");
            cmd::run_ok(
                &argv(&["ip", "-n", ns, "addr", "add", &cidr, "dev", ifn]),
                SETUP_TIMEOUT,
            )?;
            cmd::run_ok(
                &argv(&["ip", "-n", ns, "route", "add", "default", "via", gw]),
                SETUP_TIMEOUT,
            )?;
        }
        if spec.transport == crate::mgmt::Transport::Tcp {
            crate::mgmt::install(&fab, &self.state.name, hosts)?;
            for name in crate::control::hosts(spec.controllers) {
                crate::control::connect(&fab, &self.state.name, &name)?;
            }
        }
        if spec.tunnels {
            for n in 1..=hosts {
                crate::mgmt::tunnel_ports(&fab, &self.state.name, n, spec.disable_offloads)?;
            }
        }
        // After every replica port exists on the fabric side (tunnels included).
        self.steer = fabric::install(&fab, replicas)?;
        if spec.ha && !matches!(spec.mode, ReplicaMode::Pliant { .. }) {
            return Err(LabError::Config(
                "ha = true needs a pliant replica mode".into(),
            ));
        }
        if matches!(spec.mode, ReplicaMode::Pliant { .. }) {
            // Every pliant replica proves who it is on every channel (migration included).
            crate::ha::provision_ca(&self.state.run_dir)?;
        }
        self.start_servers(spec)?;
        for n in 1..=hosts {
            self.setup_replica(spec, n)?;
        }
        if spec.agents {
            self.start_fabric_agent(spec)?;
        }
        if spec.controllers > 0 {
            self.start_control_plane(spec)?;
        }
        Ok(())
    }

    /// etcd on a host of its own, then `spec.controllers` controllers, each on a host of its
    /// own (private view of the run directory, the management network only): they elect a
    /// leader by an etcd lease and steer through the fabric's agent, as across machines.
    fn start_control_plane(&mut self, spec: &LabSpec) -> Result<()> {
        let run = self.state.run_dir.clone();
        let name = self.state.name.clone();
        let bin = spec_bin(spec)?;
        self.say("starting etcd on its own host");
        let etcd = crate::control::start_etcd(&run, &name)?;
        let pid = etcd.id() as i32;
        self.children.push(etcd);
        self.record_proc(pid, "etcd")?;
        for k in 1..=spec.controllers {
            let cfg = crate::control::prepare_controller(&run, &name, k, spec)?;
            let host = crate::control::controller_host(k);
            let ns = crate::control::netns(&name, &host);
            let program = [bin.as_str(), "controller", "--config", cfg.as_str()];
            let argv =
                crate::host::command_in(&ns, &crate::control::dir(&run, &host), &run, &program);
            let log = crate::control::dir(&run, &host).join("controller.log");
            let child = spawn_logged(&argv, &log)?;
            let pid = child.id() as i32;
            self.children.push(child);
            self.record_proc(pid, &format!("pliant-controller-{host}"))?;
            self.say(&format!("controller {host} (pid {pid}) on its own host"));
        }
        let leader = crate::control::wait_leader(&run, spec.controllers)?;
        self.say(&format!("controller {leader} leads"));
        Ok(())
    }

    /// The fabric host's agent, in the fabric namespace's network stack (with the host's
    /// mounts: the pinned steering maps), on the management network: it holds the fabric's
    /// steering for whichever controller leads, wherever that controller runs.
    fn start_fabric_agent(&mut self, spec: &LabSpec) -> Result<()> {
        let run = self.state.run_dir.clone();
        let bin = spec_bin(spec)?;
        let cfg = crate::agents::prepare_fabric(&run, &self.state.name)?;
        let cfg = cfg.display().to_string();
        let argv: Vec<String> = crate::mgmt::controller_command(&self.state.name)
            .into_iter()
            .chain([bin, "agent".into(), "--config".into(), cfg])
            .collect();
        let log = run.join("fabric-agent.log");
        let mut child = spawn_logged(&argv, &log)?;
        let pid = child.id() as i32;
        self.record_proc(pid, "pliant-agent-fabric")?;
        self.say(&format!("waiting for the fabric agent (pid {pid})"));
        let ready = crate::agents::wait_fabric_agent(&run, &mut child);
        self.children.push(child);
        ready
    }

    fn setup_replica(&mut self, spec: &LabSpec, n: u8) -> Result<()> {
        let ns = self.netns(Role::Replica(n));
        let (rin, rout) = (replica_in_if(n), replica_out_if(n));
        let in_cidr = format!("{INSIDE_GW_IP}/{PREFIX_LEN}");
        let out_cidr = format!("{OUTSIDE_GW_IP}/{PREFIX_LEN}");
        match &spec.mode {
            ReplicaMode::KernelForward | ReplicaMode::KernelNat => {
                for (ifn, cidr) in [(&rin, &in_cidr), (&rout, &out_cidr)] {
                    cmd::run_ok(
                        &argv(&["ip", "-n", &ns, "addr", "add", cidr, "dev", ifn]),
                        SETUP_TIMEOUT,
                    )?;
                }
                cmd::run_ok(
                    &cmd::in_ns(&ns, &["sysctl", "-qw", "net.ipv4.ip_forward=1"]),
                    SETUP_TIMEOUT,
                )?;
                if spec.mode == ReplicaMode::KernelNat {
                    let path = self.state.run_dir.join(format!("r{n}-nat.nft"));
                    std::fs::write(&path, nft_masquerade_rules(&rout)).map_err(io_err(&path))?;
                    let p = path.display().to_string();
                    cmd::run_ok(&cmd::in_ns(&ns, &["nft", "-f", &p]), SETUP_TIMEOUT)?;
                }
                Ok(())
            }
            ReplicaMode::Pliant { config } => {
                let private = self.state.private_hosts;
                let run = self.state.run_dir.clone();
                // The replica's own path (inside its host view, if private) and the lab's.
                let own_sock = run.join(format!("r{n}.sock"));
                let sock = crate::host::socket(&run, n, private);
                let mut cfg = replica_config(n, &own_sock, config);
                cfg.replica.realtime_priority = spec.realtime_priority;
                cfg.nf_sections.insert(
                    "security".into(),
                    toml::Value::Table(crate::ha::security_section(&run, n, private)?),
                );
                if spec.ha {
                    cfg.nf_sections.insert(
                        "ha".into(),
                        toml::Value::Table(crate::ha::ha_section_for(
                            &self.state.run_dir,
                            n,
                            spec.ha_mode,
                        )),
                    );
                }
                // Replicas share the NAT address: without a block of its own each would
                // allocate from the whole range, and the fabric (which steers return traffic
                // to the NAT address by destination port, else by the ring) would send
                // replies to a replica without the mapping. So each gets the block of its
                // index (FTMB ones always: their pool is fixed by the config), and the
                // fabric's `port_owner` steers the block to it. A controller started later
                // re-tells Pico replicas its own blocks and re-points the fabric.
                // (`[ha]` and `[nat]` both sit in the flattened NF sections.)
                let shared = spec.replicas > 1;
                let pinned = crate::ha::pin_nat_ports(&mut cfg.nf_sections, n, shared)?;
                // A spare host's block stays unowned until a controller starts its replica
                // (and tells it, and the fabric, the blocks it allocates).
                let spare = n > spec.replicas;
                if let (Some((lo, hi)), Some(steer), false) = (pinned, self.steer.as_mut(), spare) {
                    steer.set_port_owner(lo..=hi, Some(u32::from(n)))?;
                }
                if spec.transport == crate::mgmt::Transport::Tcp {
                    crate::mgmt::tcp_endpoints(&mut cfg.nf_sections, n);
                    cfg.replica.control_listen = Some(crate::mgmt::control_listen(n));
                }
                let text = toml::to_string(&cfg).map_err(|e| LabError::Config(e.to_string()))?;
                let cfg_path = crate::host::config(&run, n, private);
                std::fs::write(&cfg_path, text).map_err(io_err(&cfg_path))?;
                if spec.agents {
                    return self.start_through_agent(spec, n, &ns, sock);
                }
                let log = self.replica_log(n);
                let cfg_s = run.join(format!("r{n}.toml")).display().to_string();
                let mut program: Vec<String> = match (&spec.replica_command, &spec.pliant_bin) {
                    (Some(c), _) if !c.is_empty() => c.clone(),
                    (_, Some(bin)) => vec![
                        bin.display().to_string(),
                        "replica".into(),
                        "--config".into(),
                    ],
                    _ => return Err(LabError::NoPliantBinary),
                };
                program.push(cfg_s);
                let program: Vec<&str> = program.iter().map(String::as_str).collect();
                let argv = match private {
                    true => crate::host::command(&ns, &run, n, &program),
                    false => cmd::in_ns(&ns, &program),
                };
                let child = spawn_logged(&argv, &log)?;
                let pid = child.id() as i32;
                self.children.push(child);
                self.record_proc(pid, &format!("pliant-r{n}"))?;
                self.replica_sockets.push(sock.clone());
                self.say(&format!(
                    "waiting for replica r{n} (pid {pid}) on {}",
                    sock.display()
                ));
                self.wait_replica(n, &sock, &log)
            }
        }
    }

    /// Host `n`'s agent (on its private host view), then its replica, started by the agent.
    fn start_through_agent(
        &mut self,
        spec: &LabSpec,
        n: u8,
        ns: &str,
        sock: PathBuf,
    ) -> Result<()> {
        let run = self.state.run_dir.clone();
        let bin = spec_bin(spec)?;
        let cfg = crate::agents::prepare(&run, n, &bin)?;
        let program = [bin.as_str(), "agent", "--config", cfg.as_str()];
        let argv = crate::host::command(ns, &run, n, &program);
        let log = run.join(format!("{}-agent.log", crate::agents::host_name(n)));
        let mut child = spawn_logged(&argv, &log)?;
        let pid = child.id() as i32;
        self.record_proc(
            pid,
            &format!("pliant-agent-{}", crate::agents::host_name(n)),
        )?;
        self.say(&format!(
            "waiting for agent {} (pid {pid})",
            crate::agents::host_name(n)
        ));
        let ready = crate::agents::wait_agent(&run, n, &mut child);
        self.children.push(child);
        ready?;
        if n > spec.replicas {
            self.say(&format!(
                "spare host {} ready (replica r{n} not started)",
                crate::agents::host_name(n)
            ));
            return Ok(());
        }
        let rpid = crate::agents::start_replica(&run, n)?;
        self.record_proc(rpid as i32, &format!("pliant-r{n}"))?;
        self.replica_sockets.push(sock);
        self.say(&format!("replica r{n} (pid {rpid}) started by its agent"));
        Ok(())
    }

    fn wait_replica(&mut self, n: u8, sock: &Path, log: &Path) -> Result<()> {
        let start = Instant::now();
        let idx = self.children.len() - 1;
        loop {
            if std::os::unix::net::UnixStream::connect(sock).is_ok() {
                return Ok(());
            }
            if let Ok(Some(st)) = self.children[idx].try_wait() {
                return Err(LabError::NotReady {
                    what: format!("pliant replica r{n}"),
                    waited_ms: start.elapsed().as_millis() as u64,
                    detail: format!("exited with {st}; log tail: {}", log_tail(log, 12)),
                });
            }
            if start.elapsed() > REPLICA_READY_TIMEOUT {
                return Err(LabError::NotReady {
                    what: format!("pliant replica r{n} control socket {}", sock.display()),
                    waited_ms: start.elapsed().as_millis() as u64,
                    detail: format!("log tail: {}", log_tail(log, 12)),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn start_servers(&mut self, spec: &LabSpec) -> Result<()> {
        let dir = self.state.run_dir.clone();
        let www = dir.join("www");
        std::fs::create_dir_all(&www).map_err(io_err(&www))?;
        // nginx creates the temp dirs themselves but not their parent.
        let tmp = dir.join("nginx-tmp");
        std::fs::create_dir_all(&tmp).map_err(io_err(&tmp))?;
        std::fs::write(
            www.join("index.html"),
            format!("<html><body>pliant lab {}</body></html>\n", self.state.name),
        )
        .map_err(io_err(www.join("index.html")))?;
        for f in &spec.files {
            let path = www.join(&f.name);
            if f.size_bytes >= 32 << 20 {
                self.say(&format!(
                    "generating {} ({} MB)",
                    f.name,
                    f.size_bytes >> 20
                ));
            }
            write_pseudo_random(&path, f.size_bytes, &f.name)?;
            let p = path.display().to_string();
            let out = cmd::run_ok(&argv(&["sha256sum", &p]), Duration::from_secs(120))?;
            let sha = out
                .stdout
                .split_whitespace()
                .next()
                .unwrap_or("")
                .to_string();
            self.files.push(ServedFile {
                name: f.name.clone(),
                size_bytes: f.size_bytes,
                sha256: sha,
                url: format!("http://{SERVER_IP}/{}", f.name),
            });
        }
        let conf = dir.join("nginx.conf");
        std::fs::write(&conf, nginx_conf(&dir)).map_err(io_err(&conf))?;
        let srv = self.netns(Role::Server);
        let (d, c) = (format!("{}/", dir.display()), conf.display().to_string());
        let elog = dir.join("nginx-error.log").display().to_string();
        cmd::run_ok(
            &cmd::in_ns(&srv, &["nginx", "-p", &d, "-c", &c, "-e", &elog]),
            SETUP_TIMEOUT,
        )?;
        let pid = wait_pidfile(&dir.join("nginx.pid"), "nginx")?;
        self.record_proc(pid, "nginx")?;

        let pidf = dir.join("iperf3.pid").display().to_string();
        let ilog = dir.join("iperf3.log").display().to_string();
        cmd::run_ok(
            &cmd::in_ns(
                &srv,
                &[
                    "iperf3",
                    "-s",
                    "-D",
                    "-B",
                    SERVER_IP,
                    "-I",
                    &pidf,
                    "--logfile",
                    &ilog,
                ],
            ),
            SETUP_TIMEOUT,
        )?;
        let pid = wait_pidfile(&dir.join("iperf3.pid"), "iperf3")?;
        self.record_proc(pid, "iperf3")?;
        self.wait_listening(&srv, 5201)?;
        self.wait_listening(&srv, 80)
    }

    fn wait_listening(&self, ns: &str, port: u16) -> Result<()> {
        let start = Instant::now();
        let filter = format!("sport = :{port}");
        loop {
            let out = cmd::run_ok(&cmd::in_ns(ns, &["ss", "-Hltn", &filter]), SETUP_TIMEOUT)?;
            if !out.stdout.trim().is_empty() {
                return Ok(());
            }
            if start.elapsed() > SERVER_READY_TIMEOUT {
                return Err(LabError::NotReady {
                    what: format!("TCP listener on port {port} in {ns}"),
                    waited_ms: start.elapsed().as_millis() as u64,
                    detail: "nothing listening".into(),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        let problems = self.teardown();
        if !problems.is_empty() {
            eprintln!(
                "[lab {}] teardown problems: {}",
                self.state.name,
                problems.join("; ")
            );
        }
    }
}

/// The replica config the lab writes for pliant mode (router-role addresses on both ports).
pub fn replica_config(n: u8, sock: &Path, nf: &PliantNf) -> ReplicaConfig {
    ReplicaConfig {
        replica: ReplicaSection {
            name: format!("r{n}"),
            control_socket: sock.display().to_string(),
            control_listen: None,
            metrics_listen: None,
            realtime_priority: None,
        },
        inside: PortConfig {
            ifname: replica_in_if(n),
            addresses: vec![format!("{INSIDE_GW_IP}/{PREFIX_LEN}")],
            gateway: None,
        },
        outside: PortConfig {
            ifname: replica_out_if(n),
            addresses: vec![format!("{OUTSIDE_GW_IP}/{PREFIX_LEN}")],
            gateway: None,
        },
        nf: NfSection {
            kind: nf.kind.clone(),
        },
        nf_sections: nf.sections.clone(),
    }
}

/// nftables masquerade for the kernel NAT peer. nft 1.0.6 rejects one-line table definitions,
/// so one statement per line; only the client subnet is translated.
pub fn nft_masquerade_rules(out_if: &str) -> String {
    format!(
        "table ip pliantlab {{\n\
         \tchain postrouting {{\n\
         \t\ttype nat hook postrouting priority srcnat; policy accept;\n\
         \t\toifname \"{out_if}\" ip saddr {INSIDE_NET} masquerade\n\
         \t}}\n\
         }}\n"
    )
}

/// nginx configuration with every path (pid, logs, temp dirs, document root) inside `dir`, so
/// labs never share files with each other or with a system nginx.
pub fn nginx_conf(dir: &Path) -> String {
    let d = dir.display();
    format!(
        "worker_processes 1;\n\
         user nobody nogroup;\n\
         pid {d}/nginx.pid;\n\
         error_log {d}/nginx-error.log;\n\
         events {{\n    worker_connections 512;\n}}\n\
         http {{\n\
         \x20   default_type application/octet-stream;\n\
         \x20   log_format pliant '$remote_addr $remote_port \"$request\" $status $body_bytes_sent';\n\
         \x20   access_log {d}/nginx-access.log pliant;\n\
         \x20   sendfile on;\n\
         \x20   client_body_temp_path {d}/nginx-tmp/body;\n\
         \x20   proxy_temp_path {d}/nginx-tmp/proxy;\n\
         \x20   fastcgi_temp_path {d}/nginx-tmp/fastcgi;\n\
         \x20   uwsgi_temp_path {d}/nginx-tmp/uwsgi;\n\
         \x20   scgi_temp_path {d}/nginx-tmp/scgi;\n\
         \x20   server {{\n\
         \x20       listen {SERVER_IP}:80;\n\
         \x20       root {d}/www;\n\
         \x20   }}\n\
         }}\n"
    )
}

/// One parsed line of the lab's nginx access log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AccessLogEntry {
    pub remote_addr: String,
    pub remote_port: u16,
    pub request: String,
    pub status: u16,
    pub body_bytes: u64,
}

/// Parse the `pliant` log_format; malformed lines are skipped.
pub fn parse_access_log(text: &str) -> Vec<AccessLogEntry> {
    text.lines()
        .filter_map(|line| {
            let (addr, rest) = line.split_once(' ')?;
            let (port, rest) = rest.split_once(' ')?;
            let rest = rest.strip_prefix('"')?;
            let (request, rest) = rest.split_once("\" ")?;
            let mut it = rest.split_whitespace();
            Some(AccessLogEntry {
                remote_addr: addr.to_string(),
                remote_port: port.parse().ok()?,
                request: request.to_string(),
                status: it.next()?.parse().ok()?,
                body_bytes: it.next()?.parse().ok()?,
            })
        })
        .collect()
}

impl Lab {
    /// The nginx access log, parsed.
    pub fn access_log(&self) -> Result<Vec<AccessLogEntry>> {
        let p = self.nginx_access_log();
        let text = std::fs::read_to_string(&p).map_err(io_err(&p))?;
        Ok(parse_access_log(&text))
    }
}

fn parse_link_stats(json: &str) -> Option<LinkStats> {
    let v: serde_json::Value = serde_json::from_str(json).ok()?;
    let s = v.get(0)?.get("stats64")?;
    let g = |dir: &str, k: &str| s.get(dir)?.get(k)?.as_u64();
    Some(LinkStats {
        rx_packets: g("rx", "packets")?,
        rx_dropped: g("rx", "dropped")?,
        tx_packets: g("tx", "packets")?,
        tx_dropped: g("tx", "dropped")?,
    })
}

/// Creates namespace `ns` (recorded by the caller), loopback up, IPv6 off.
pub(crate) fn make_netns(ns: &str) -> Result<()> {
    cmd::run_ok(&argv(&["ip", "netns", "add", ns]), SETUP_TIMEOUT)?;
    cmd::run_ok(
        &argv(&["ip", "-n", ns, "link", "set", "lo", "up"]),
        SETUP_TIMEOUT,
    )?;
    // No IPv6 anywhere: router solicitations and DAD would otherwise be the first
    // "traffic" through an NF, and the fabric's kernel must not act on frames at all.
    cmd::run_ok(
        &cmd::in_ns(
            ns,
            &[
                "sysctl",
                "-qw",
                "net.ipv6.conf.all.disable_ipv6=1",
                "net.ipv6.conf.default.disable_ipv6=1",
            ],
        ),
        SETUP_TIMEOUT,
    )?;
    Ok(())
}

/// The `pliant` binary a lab of pliant replicas runs.
fn spec_bin(spec: &LabSpec) -> Result<String> {
    Ok(spec
        .pliant_bin
        .as_ref()
        .ok_or(LabError::NoPliantBinary)?
        .display()
        .to_string())
}

fn spawn_logged(argv: &[String], log: &Path) -> Result<Child> {
    let f = std::fs::File::create(log).map_err(io_err(log))?;
    let f2 = f.try_clone().map_err(io_err(log))?;
    let (prog, rest) = argv.split_first().ok_or_else(|| LabError::Command {
        cmd: String::new(),
        code: None,
        stderr: "empty command".into(),
    })?;
    use std::os::unix::process::CommandExt;
    Command::new(prog)
        .args(rest)
        .stdin(Stdio::null())
        .stdout(f)
        .stderr(f2)
        .process_group(0)
        .spawn()
        .map_err(|source| LabError::Spawn {
            cmd: cmd::render(argv),
            source,
        })
}

fn wait_pidfile(path: &Path, what: &str) -> Result<i32> {
    let start = Instant::now();
    loop {
        if let Ok(s) = std::fs::read_to_string(path) {
            if let Ok(pid) = s.trim().parse::<i32>() {
                if pid > 1 {
                    return Ok(pid);
                }
            }
        }
        if start.elapsed() > SERVER_READY_TIMEOUT {
            return Err(LabError::NotReady {
                what: what.to_string(),
                waited_ms: start.elapsed().as_millis() as u64,
                detail: format!("no pid in {}", path.display()),
            });
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Last `n` lines of a log file, joined with " | " for one-line error messages.
pub fn log_tail(path: &Path, n: usize) -> String {
    match std::fs::read_to_string(path) {
        Ok(t) => {
            let lines: Vec<&str> = t.lines().collect();
            lines[lines.len().saturating_sub(n)..].join(" | ")
        }
        Err(e) => format!("(no log {}: {e})", path.display()),
    }
}

/// Deterministic pseudo-random content (xorshift64*, seeded from the file name) so a transfer
/// that corrupts or reorders bytes changes the checksum; not compressible by accident.
fn write_pseudo_random(path: &Path, size: u64, seed_name: &str) -> Result<()> {
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    for b in seed_name.bytes() {
        seed = (seed ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
    }
    let f = std::fs::File::create(path).map_err(io_err(path))?;
    let mut w = std::io::BufWriter::with_capacity(1 << 20, f);
    let mut x = seed | 1;
    let mut left = size;
    let mut buf = vec![0u8; 1 << 16];
    while left > 0 {
        for chunk in buf.chunks_mut(8) {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            let v = x.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
        let n = left.min(buf.len() as u64) as usize;
        w.write_all(&buf[..n]).map_err(io_err(path))?;
        left -= n as u64;
    }
    w.flush().map_err(io_err(path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_validated() {
        assert!(validate_name("demo-1").is_ok());
        assert!(validate_name("").is_err());
        assert!(validate_name("UPPER").is_err());
        assert!(validate_name("a/b").is_err());
        assert!(validate_name("-x").is_err());
        assert!(validate_name("abcdefghijklmnopq").is_err());
        let r = random_name();
        assert!(validate_name(&r).is_ok(), "{r}");
        assert_eq!(r.len(), 8);
    }

    #[test]
    fn modes_round_trip_through_labels() {
        for s in [
            "kernel-forward",
            "kernel-nat",
            "pliant-nat",
            "pliant-forward",
            "pliant-firewall",
            "pliant-ids",
            "pliant-mbserv",
        ] {
            assert_eq!(ReplicaMode::parse(s).expect("mode").label(), s);
        }
        assert!(ReplicaMode::parse("pliant").is_none());
        assert!(ReplicaMode::parse("pliant-c").is_none());
    }

    #[test]
    fn nf_sections_merge_over_the_defaults_and_lab_sections_are_refused() {
        let mut nf = PliantNf::nat();
        nf.merge_sections("[nat]\nport_min = 30000\n[shared]\nmode = \"synch\"\n")
            .expect("merge");
        let nat = nf.sections["nat"].as_table().expect("nat");
        assert_eq!(nat["port_min"].as_integer(), Some(30000));
        assert!(nat.contains_key("external_ip"), "defaults kept: {nat:?}");
        assert!(nf.sections.contains_key("shared"));
        let e = nf.merge_sections("[replica]\nname = \"x\"\n").unwrap_err();
        assert!(e.contains("[replica] is written by the lab"), "{e}");
        let e = nf.merge_sections("nat = 3\n").unwrap_err();
        assert!(e.contains("not a section"), "{e}");
        assert!(nf.merge_sections("[nat\n").is_err());
    }

    #[test]
    fn replica_config_serialises_and_reparses_with_nat_section() {
        let cfg = replica_config(1, Path::new("/run/pliant/x/r1.sock"), &PliantNf::nat());
        let text = toml::to_string(&cfg).expect("toml");
        let back: ReplicaConfig = toml::from_str(&text).expect("reparse");
        assert_eq!(back, cfg);
        assert!(text.contains("[nat]"), "{text}");
        assert!(text.contains("external_ip = \"10.77.2.1\""), "{text}");
        assert_eq!(back.inside.ifname, "r1in");
        assert_eq!(back.outside.addresses, vec!["10.77.2.1/24".to_string()]);
    }

    #[test]
    fn nft_rules_are_one_statement_per_line_and_restricted_to_clients() {
        let r = nft_masquerade_rules("r1out");
        assert!(r.lines().count() >= 5);
        assert!(
            r.contains("oifname \"r1out\" ip saddr 10.77.1.0/24 masquerade"),
            "{r}"
        );
    }

    #[test]
    fn access_log_lines_parse_and_garbage_is_skipped() {
        let text = "10.77.2.1 40000 \"GET /1M.bin HTTP/1.1\" 200 1048576\n\
                    garbage\n\
                    10.77.1.2 x \"GET / HTTP/1.1\" 200 5\n";
        let e = parse_access_log(text);
        assert_eq!(e.len(), 1);
        assert_eq!(e[0].remote_addr, "10.77.2.1");
        assert_eq!(e[0].remote_port, 40000);
        assert_eq!(e[0].request, "GET /1M.bin HTTP/1.1");
        assert_eq!(e[0].status, 200);
        assert_eq!(e[0].body_bytes, 1 << 20);
    }

    #[test]
    fn link_stats_parse_from_ip_json() {
        let j = r#"[{"ifname":"x","stats64":{"rx":{"bytes":1,"packets":10,"errors":0,"dropped":2},
                   "tx":{"bytes":1,"packets":7,"errors":0,"dropped":3}}}]"#;
        let s = parse_link_stats(j).expect("parse");
        assert_eq!(
            s,
            LinkStats {
                rx_packets: 10,
                rx_dropped: 2,
                tx_packets: 7,
                tx_dropped: 3
            }
        );
        assert!(parse_link_stats("[]").is_none());
    }

    #[test]
    fn pseudo_random_files_have_exact_size_and_depend_on_name() {
        let dir = std::env::temp_dir().join(format!("pliant-lab-gen-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        let (a, b) = (dir.join("a"), dir.join("b"));
        write_pseudo_random(&a, 100_003, "a").expect("a");
        write_pseudo_random(&b, 100_003, "b").expect("b");
        let (da, db) = (
            std::fs::read(&a).expect("ra"),
            std::fs::read(&b).expect("rb"),
        );
        assert_eq!(da.len(), 100_003);
        assert_ne!(da, db);
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}
