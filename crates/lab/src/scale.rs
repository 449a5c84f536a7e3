//! Adding and removing pliant replicas in a *running* lab (the agent role of the elasticity
//! work): a new namespace `<lab>-r<n>`, its two veth links to the fabric (same shared MACs as
//! every replica, so steering can move flows without ARP changes), and a `pliant replica`
//! process whose config is derived from an existing replica's (same NF and NF sections).
//!
//! Works by lab name from any process (the controller daemon is not the process that built the
//! lab): resources are recorded in the lab's `state.json` *before* they are created, under an
//! advisory lock (`state.lock`), so `pliant lab down` removes them even if the caller crashes.
//! Steering is not touched here: the caller (the controller, which owns the fabric's maps)
//! attaches the new fabric ports (`fabr<n>in`, `fabr<n>out`) and puts the replica in the ring.

use crate::cmd::{self, SETUP_TIMEOUT};
use crate::error::{io_err, LabError, Result};
use crate::state::{self, LabState, ProcRecord, STATE_FILE};
use crate::topology::*;
use pliant_runtime::config::ReplicaConfig;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Replica numbers this module hands out (interface names stay within IFNAMSIZ up to 255; the
/// steering has 64 replica slots, index 0 unused by the lab).
pub const MAX_REPLICA_INDEX: u8 = 63;

/// How to add replicas to a lab.
#[derive(Clone, Debug)]
pub struct ScaleOptions {
    /// Where labs live (`/run/pliant` by default).
    pub run_root: PathBuf,
    /// The `pliant` binary; `None`: reuse the command line of a running replica of the lab.
    pub pliant_bin: Option<PathBuf>,
    /// Replica whose config (NF kind and sections) new replicas copy; `None`: the lowest.
    pub template: Option<u8>,
    /// How long a new replica may take to answer on its control socket.
    pub ready_timeout: Duration,
}

impl Default for ScaleOptions {
    fn default() -> Self {
        ScaleOptions {
            run_root: PathBuf::from(crate::DEFAULT_RUN_ROOT),
            pliant_bin: None,
            template: None,
            ready_timeout: Duration::from_secs(10),
        }
    }
}

/// A replica that exists in a lab.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LabReplica {
    pub index: u8,
    pub netns: String,
    /// Control socket.
    pub socket: PathBuf,
    pub config: PathBuf,
    /// Fabric-side port names (what steering attaches to).
    pub fabric_in: String,
    pub fabric_out: String,
}

/// A freshly added replica and how long it took to serve.
#[derive(Debug)]
pub struct AddedReplica {
    pub replica: LabReplica,
    pub pid: i32,
    /// The process (the caller reaps it; [`remove_replica`] stops it by PID either way).
    pub child: Child,
    /// From the call to the control socket answering a connection.
    pub ready_ms: u64,
}

fn argv(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

fn run_dir(opts: &ScaleOptions, lab: &str) -> Result<PathBuf> {
    crate::lab::validate_name(lab)?;
    let d = opts.run_root.join(lab);
    if !d.join(STATE_FILE).exists() {
        return Err(LabError::NotFound(lab.to_string()));
    }
    Ok(d)
}

/// Exclusive advisory lock on `<run_dir>/state.lock` for a load-modify-save of `state.json`.
struct StateLock {
    // Held for its descriptor: closing it releases the lock.
    _file: std::fs::File,
}

impl StateLock {
    fn take(dir: &Path) -> Result<StateLock> {
        let p = dir.join("state.lock");
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&p)
            .map_err(io_err(&p))?;
        // SAFETY: flock(2) on a descriptor we own; released when the file is closed.
        let r = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) };
        if r != 0 {
            return Err(io_err(&p)(std::io::Error::last_os_error()));
        }
        Ok(StateLock { _file: f })
    }
}

fn modify_state(dir: &Path, f: impl FnOnce(&mut LabState)) -> Result<LabState> {
    let _g = StateLock::take(dir)?;
    let mut st = LabState::load(&dir.join(STATE_FILE))?;
    f(&mut st);
    st.save()?;
    Ok(st)
}

fn replica_of(st: &LabState, n: u8) -> LabReplica {
    LabReplica {
        index: n,
        netns: format!("{}-r{n}", st.name),
        socket: crate::host::socket(&st.run_dir, n, st.private_hosts),
        config: crate::host::config(&st.run_dir, n, st.private_hosts),
        fabric_in: fabric_in_if(n),
        fabric_out: fabric_out_if(n),
    }
}

/// Replica numbers of a state record (from its `<lab>-r<n>` namespaces), ascending.
pub fn replica_indexes(st: &LabState) -> Vec<u8> {
    let prefix = format!("{}-r", st.name);
    let mut v: Vec<u8> = st
        .namespaces
        .iter()
        .filter_map(|ns| ns.strip_prefix(&prefix)?.parse::<u8>().ok())
        .filter(|n| *n >= 1)
        .collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// The lab's replicas as its state file records them.
pub fn replicas(lab: &str, opts: &ScaleOptions) -> Result<Vec<LabReplica>> {
    let dir = run_dir(opts, lab)?;
    let st = LabState::load(&dir.join(STATE_FILE))?;
    Ok(replica_indexes(&st)
        .into_iter()
        .map(|n| replica_of(&st, n))
        .collect())
}

/// Lowest free replica number, 1..=[`MAX_REPLICA_INDEX`].
pub fn next_index(used: &[u8]) -> Option<u8> {
    (1..=MAX_REPLICA_INDEX).find(|n| !used.contains(n))
}

/// The config of replica `n`, derived from the template's: same NF and sections, own name,
/// socket and interfaces.
pub fn derive_config(template: &ReplicaConfig, n: u8, sock: &Path) -> ReplicaConfig {
    let mut c = template.clone();
    c.replica.name = format!("r{n}");
    c.replica.control_socket = sock.display().to_string();
    // The template's metrics listener names a fixed address/port; a copy would only confuse
    // scrapers (every replica answering as if it were the template): keep it off.
    c.replica.metrics_listen = None;
    c.inside.ifname = replica_in_if(n);
    c.outside.ifname = replica_out_if(n);
    // An explicit peer socket names the template's path: drop it so the runtime derives this
    // replica's own from its control socket (`r<n>.peer.sock`).
    c.nf_sections.remove("migration");
    c
}

fn pliant_command(st: &LabState, opts: &ScaleOptions) -> Result<String> {
    if let Some(b) = &opts.pliant_bin {
        return Ok(b.display().to_string());
    }
    // Reuse the binary of a running replica (its cmdline: ip netns exec NS BIN replica --config F).
    for p in &st.procs {
        if p.role.starts_with("pliant-r") && state::proc_matches(p) {
            if let Some(cl) = state::proc_cmdline(p.pid) {
                let words: Vec<&str> = cl.split(' ').collect();
                if let Some(i) = words.iter().position(|w| *w == "replica") {
                    if i >= 1 {
                        return Ok(words[i - 1].to_string());
                    }
                }
            }
        }
    }
    Err(LabError::NoPliantBinary)
}

fn spawn_logged(args: &[String], log: &Path) -> Result<Child> {
    let f = std::fs::File::create(log).map_err(io_err(log))?;
    let f2 = f.try_clone().map_err(io_err(log))?;
    let (prog, rest) = args.split_first().ok_or(LabError::NoPliantBinary)?;
    use std::os::unix::process::CommandExt;
    Command::new(prog)
        .args(rest)
        .stdin(Stdio::null())
        .stdout(f)
        .stderr(f2)
        .process_group(0)
        .spawn()
        .map_err(|source| LabError::Spawn {
            cmd: cmd::render(args),
            source,
        })
}

/// Adds one pliant replica to the running lab `lab` and waits until it serves. On failure,
/// what was created is removed again.
pub fn add_replica(lab: &str, opts: &ScaleOptions) -> Result<AddedReplica> {
    let start = Instant::now();
    let dir = run_dir(opts, lab)?;
    let st0 = LabState::load(&dir.join(STATE_FILE))?;
    let used = replica_indexes(&st0);
    let template_n = opts
        .template
        .or_else(|| used.first().copied())
        .ok_or_else(|| LabError::Config("no replica to copy the config from".into()))?;
    let tpath = crate::host::config(&dir, template_n, st0.private_hosts);
    let template = ReplicaConfig::load(&tpath.display().to_string())
        .map_err(|e| LabError::Config(e.to_string()))?;
    let bin = pliant_command(&st0, opts)?;
    // Claim the index and record the namespace before creating it (crash safety).
    let mut n = 0u8;
    let st = modify_state(&dir, |st| {
        if let Some(k) = next_index(&replica_indexes(st)) {
            n = k;
            st.namespaces.push(format!("{}-r{k}", st.name));
        }
    })?;
    if n == 0 {
        return Err(LabError::Replicas {
            asked: MAX_REPLICA_INDEX.saturating_add(1),
            max: MAX_REPLICA_INDEX,
        });
    }
    let r = replica_of(&st, n);
    match build(&st, &r, &template, &bin, opts, start) {
        Ok(added) => Ok(added),
        Err(e) => {
            let _ = remove_replica(lab, n, opts);
            Err(e)
        }
    }
}

fn build(
    st: &LabState,
    r: &LabReplica,
    template: &ReplicaConfig,
    bin: &str,
    opts: &ScaleOptions,
    start: Instant,
) -> Result<AddedReplica> {
    let n = r.index;
    let ns = &r.netns;
    let fab = format!("{}-{}", st.name, Role::Fabric.suffix());
    crate::lab::make_netns(ns)?;
    for (rif, fif, mac) in [
        (replica_in_if(n), r.fabric_in.clone(), IN_PORT_MAC),
        (replica_out_if(n), r.fabric_out.clone(), OUT_PORT_MAC),
    ] {
        cmd::run_ok(
            &argv(&[
                "ip", "-n", ns, "link", "add", &rif, "address", mac, "type", "veth", "peer",
                "name", &fif, "netns", &fab,
            ]),
            SETUP_TIMEOUT,
        )?;
        cmd::run_ok(
            &argv(&["ip", "-n", ns, "link", "set", &rif, "up"]),
            SETUP_TIMEOUT,
        )?;
        cmd::run_ok(
            &argv(&["ip", "-n", &fab, "link", "set", &fif, "up"]),
            SETUP_TIMEOUT,
        )?;
    }
    // The replica's own control socket path (inside its host view if private).
    let cfg = derive_config(template, n, &st.run_dir.join(format!("r{n}.sock")));
    // Serialise through a table so that an `[ha]` section (HA labs) can be pointed at this
    // replica's own replication socket whichever way the config type carries it.
    let mut table = toml::Table::try_from(&cfg).map_err(|e| LabError::Config(e.to_string()))?;
    crate::ha::retarget_ha(&mut table, &st.run_dir, n);
    crate::ha::retarget_security(&mut table, &st.run_dir, n, st.private_hosts)?;
    // A TCP lab (the template's peer channel is on the management network; `derive_config`
    // dropped that section from the copy): the new replica joins that network and listens on
    // its own address.
    let tcp_lab = template
        .nf_sections
        .get("migration")
        .and_then(|m| m.get("peer_socket"))
        .and_then(|p| p.as_str())
        .is_some_and(|p| !p.starts_with('/'));
    if tcp_lab {
        crate::mgmt::connect(&fab, &st.name, n)?;
        crate::mgmt::tcp_endpoints(&mut table, n);
        if let Some(toml::Value::Table(rep)) = table.get_mut("replica") {
            rep.insert(
                "control_listen".into(),
                crate::mgmt::control_listen(n).into(),
            );
        }
    }
    // NAT replicas the lab pinned (FTMB, or several sharing the address) own a pinned port
    // block: the template's is another replica's.
    let pinned = table
        .get("nat")
        .and_then(|t| t.get("port_blocks"))
        .is_some();
    crate::ha::pin_nat_ports(&mut table, n, pinned)?;
    let text = toml::to_string(&table).map_err(|e| LabError::Config(e.to_string()))?;
    std::fs::write(&r.config, text).map_err(io_err(&r.config))?;
    let log = st.run_dir.join(format!("r{n}.log"));
    // The path the replica opens (inside its host view if private).
    let cfg_s = st.run_dir.join(format!("r{n}.toml")).display().to_string();
    let program = [bin, "replica", "--config", &cfg_s];
    let argv = match st.private_hosts {
        true => crate::host::command(ns, &st.run_dir, n, &program),
        false => cmd::in_ns(ns, &program),
    };
    let child = spawn_logged(&argv, &log)?;
    let pid = child.id() as i32;
    let mut child = child;
    let dir = st.run_dir.clone();
    let rec = modify_state(&dir, |s| {
        s.procs.push(ProcRecord {
            pid,
            role: format!("pliant-r{n}"),
            marker: format!("{}/", dir.display()),
        })
    });
    if let Err(e) = rec {
        let _ = child.kill();
        let _ = child.wait();
        return Err(e);
    }
    loop {
        if std::os::unix::net::UnixStream::connect(&r.socket).is_ok() {
            break;
        }
        if let Ok(Some(status)) = child.try_wait() {
            return Err(LabError::NotReady {
                what: format!("pliant replica r{n}"),
                waited_ms: start.elapsed().as_millis() as u64,
                detail: format!(
                    "exited with {status}; log tail: {}",
                    crate::lab::log_tail(&log, 12)
                ),
            });
        }
        if start.elapsed() > opts.ready_timeout {
            let _ = child.kill();
            let _ = child.wait();
            return Err(LabError::NotReady {
                what: format!("pliant replica r{n} control socket {}", r.socket.display()),
                waited_ms: start.elapsed().as_millis() as u64,
                detail: format!("log tail: {}", crate::lab::log_tail(&log, 12)),
            });
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(AddedReplica {
        replica: r.clone(),
        pid,
        child,
        ready_ms: start.elapsed().as_millis() as u64,
    })
}

/// Stops replica `n`'s process (by recorded PID, cmdline verified), deletes its namespace
/// (which removes both veth pairs, fabric ends included) and drops it from the state file.
/// Idempotent.
pub fn remove_replica(lab: &str, n: u8, opts: &ScaleOptions) -> Result<()> {
    let dir = run_dir(opts, lab)?;
    let st = LabState::load(&dir.join(STATE_FILE))?;
    let ns = format!("{}-r{n}", st.name);
    let role = format!("pliant-r{n}");
    for p in st.procs.iter().filter(|p| p.role == role) {
        state::stop_proc(p, Duration::from_secs(2));
    }
    // Anything else left inside (only this lab's processes can be in its namespace).
    for pid in state::netns_pids(&ns) {
        if pid > 1 && pid != std::process::id() as i32 {
            // SAFETY: kill(2) on a PID inside this lab's own replica namespace.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
            }
        }
    }
    if state::netns_exists(&ns) {
        cmd::run_ok(&argv(&["ip", "netns", "del", &ns]), SETUP_TIMEOUT)?;
    }
    let _ = std::fs::remove_file(crate::host::socket(&dir, n, st.private_hosts));
    let _ = std::fs::remove_file(crate::ha::repl_socket(&dir, n));
    modify_state(&dir, |s| {
        s.namespaces.retain(|x| *x != ns);
        s.procs.retain(|p| p.role != role);
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn st(ns: &[&str]) -> LabState {
        LabState {
            name: "lab1".into(),
            run_dir: PathBuf::from("/run/pliant/lab1"),
            mode: "pliant-nat".into(),
            created_unix_s: 0,
            owner: None,
            namespaces: ns.iter().map(|s| s.to_string()).collect(),
            procs: vec![],
            private_hosts: false,
            agents: false,
        }
    }

    #[test]
    fn replica_indexes_come_from_own_namespaces_only() {
        let s = st(&[
            "lab1-client",
            "lab1-r2",
            "lab1-fabric",
            "lab1-r1",
            "lab10-r3",
            "lab1-rx",
        ]);
        assert_eq!(replica_indexes(&s), vec![1, 2]);
        assert_eq!(next_index(&[1, 2]), Some(3));
        assert_eq!(next_index(&[2]), Some(1));
        let all: Vec<u8> = (1..=MAX_REPLICA_INDEX).collect();
        assert_eq!(next_index(&all), None);
        let r = replica_of(&s, 3);
        assert_eq!(r.netns, "lab1-r3");
        assert_eq!(r.fabric_in, "fabr3in");
        assert_eq!(r.socket, PathBuf::from("/run/pliant/lab1/r3.sock"));
    }

    #[test]
    fn derived_config_keeps_the_nf_and_renames_the_rest() {
        let mut t = crate::lab::replica_config(
            1,
            Path::new("/run/pliant/lab1/r1.sock"),
            &crate::PliantNf::nat(),
        );
        t.replica.metrics_listen = Some("127.0.0.1:9100".into());
        t.replica.realtime_priority = Some(20);
        let mut mig = toml::Table::new();
        mig.insert("peer_socket".into(), "/run/pliant/lab1/r1.peer.sock".into());
        t.nf_sections
            .insert("migration".into(), toml::Value::Table(mig));
        let c = derive_config(&t, 4, Path::new("/run/pliant/lab1/r4.sock"));
        assert_eq!(c.replica.name, "r4");
        assert_eq!(c.replica.control_socket, "/run/pliant/lab1/r4.sock");
        // A replica added by scale-out is scheduled like the ones it joins.
        assert_eq!(c.replica.realtime_priority, Some(20));
        assert_eq!(c.inside.ifname, "r4in");
        assert_eq!(c.outside.ifname, "r4out");
        assert_eq!(c.replica.metrics_listen, None);
        assert_eq!(c.nf.kind, "nat");
        assert!(c.nf_sections.contains_key("nat"));
        assert!(
            !c.nf_sections.contains_key("migration"),
            "own peer socket, not r1's"
        );
        assert_eq!(c.inside.addresses, t.inside.addresses);
    }

    #[test]
    fn added_replicas_of_an_ha_lab_get_their_own_repl_socket() {
        let dir = Path::new("/run/pliant/lab1");
        let mut t = crate::lab::replica_config(1, &dir.join("r1.sock"), &crate::PliantNf::nat());
        t.nf_sections.insert(
            "ha".into(),
            toml::Value::Table(crate::ha::ha_section(dir, 1)),
        );
        let c = derive_config(&t, 5, &dir.join("r5.sock"));
        let mut table = toml::Table::try_from(&c).expect("table");
        assert!(crate::ha::retarget_ha(&mut table, dir, 5));
        let text = toml::to_string(&table).expect("toml");
        // (Not ReplicaConfig::parse: it refuses sections the runtime does not know yet.)
        let back: toml::Table = toml::from_str(&text).expect("reparse");
        let ha = back["ha"].clone();
        assert_eq!(back["replica"]["name"].as_str(), Some("r5"));
        assert_eq!(
            ha["repl_socket"].as_str(),
            Some("/run/pliant/lab1/r5.repl.sock")
        );
    }
}
