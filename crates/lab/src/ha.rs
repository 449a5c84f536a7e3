//! High availability in the lab: the deployment's CA and each replica's identity (the
//! `[security]` section every pliant replica config carries: every channel between replicas
//! is mutually authenticated with it), the `[ha]` section, replica PIDs (the e2e tests
//! SIGKILL a primary by the PID the lab started) and the fencing fallback for labs whose
//! fabric is the tc mirred patch panel.

use crate::cmd::{self, SETUP_TIMEOUT};
use crate::error::{LabError, Result};
use crate::state::{self, LabState};
use crate::topology::{fabric_in_if, fabric_out_if, Role};
use std::path::{Path, PathBuf};

/// Worker threads of a replica in FTMB mode (the runtime's default; >= 2 so that workers
/// contend on the NAT's shared port pool).
pub const FTMB_WORKERS: u32 = 2;
/// Snapshot interval of a replica in FTMB mode (the recovery goal is stated at 50 ms).
pub const FTMB_SNAPSHOT_MS: u32 = 50;

/// First NAT port of the pinned blocks of the lab's NAT replicas (the NAT's default pool
/// start).
pub const NAT_PORT_LO: u16 = 20000;
/// Ports per pinned block: replica n owns `NAT_PORT_LO + (n-1)*NAT_PORT_BLOCK ..` for one
/// block. The controller pins the same blocks for FTMB replicas when its `[ports]` say
/// `lo = 20000`, `block = 1000`, `per_replica = 1` (as the HA benches and e2e tests configure
/// it).
pub const NAT_PORT_BLOCK: u16 = 1000;

/// Replica `n`'s pinned NAT port block. An FTMB replica's pool is fixed by its config (the
/// controller cannot move blocks at run time: the pool is a shared variable in every
/// snapshot), so the lab and the controller derive it from the index alike; replicas of a
/// multi-replica lab get theirs the same way (see [`pin_nat_ports`]). `None` past the 16-bit
/// port space.
pub fn nat_port_block(n: u8) -> Option<(u16, u16)> {
    let lo = u32::from(NAT_PORT_LO) + u32::from(n.checked_sub(1)?) * u32::from(NAT_PORT_BLOCK);
    let hi = lo + u32::from(NAT_PORT_BLOCK) - 1;
    Some((u16::try_from(lo).ok()?, u16::try_from(hi).ok()?))
}

/// In a replica config (`table`, the whole file) whose NF has a `[nat]` section, pins
/// `[nat] port_blocks` to replica `n`'s block when it runs FTMB (its pool is fixed at start)
/// or when `shared` (the replicas share the NAT address, so each must allocate from ports
/// the fabric steers back to it: see `Lab::up`). Returns the block pinned, or None (no
/// `[nat]`, or neither reason: nothing to do).
pub fn pin_nat_ports(table: &mut toml::Table, n: u8, shared: bool) -> Result<Option<(u16, u16)>> {
    let ftmb = table
        .get("ha")
        .and_then(|h| h.get("mode"))
        .and_then(toml::Value::as_str)
        == Some("ftmb");
    let Some(toml::Value::Table(nat)) = table.get_mut("nat") else {
        return Ok(None);
    };
    if !ftmb && !shared {
        return Ok(None);
    }
    let (lo, hi) = nat_port_block(n)
        .ok_or_else(|| LabError::Config(format!("r{n}: no NAT port block left")))?;
    let block = toml::Value::Array(vec![i64::from(lo).into(), i64::from(hi).into()]);
    nat.insert("port_blocks".into(), toml::Value::Array(vec![block]));
    Ok(Some((lo, hi)))
}

/// Which HA mode the replicas of an HA lab run (`[ha] mode` of their configs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LabHaMode {
    /// Pico replication (the runtime's default: no `mode` key written).
    #[default]
    Pico,
    /// FTMB rollback recovery: `mode = "ftmb"`, [`FTMB_WORKERS`] workers, a
    /// snapshot every [`FTMB_SNAPSHOT_MS`]; the logger listens on `r<n>.ftmb.sock` (the
    /// runtime's default beside the control socket, so added replicas need no retargeting).
    Ftmb,
}

impl LabHaMode {
    pub fn parse(s: &str) -> Option<LabHaMode> {
        match s {
            "pico" => Some(LabHaMode::Pico),
            "ftmb" => Some(LabHaMode::Ftmb),
            _ => None,
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            LabHaMode::Pico => "pico",
            LabHaMode::Ftmb => "ftmb",
        }
    }
}

/// The lab's certificate authority: `<run_dir>/ca` (`ca.key` 0600, `ca.pub`). Only the lab
/// reads the CA key; replicas get their own identity directory.
pub fn ca_dir(run_dir: &Path) -> PathBuf {
    run_dir.join("ca")
}

/// Node `name`'s identity directory: `<run_dir>/id/<name>` (`node.key` 0600, `node.cert`,
/// `ca.pub`).
pub fn identity_dir(run_dir: &Path, name: &str) -> PathBuf {
    run_dir.join("id").join(name)
}

/// Creates the lab's CA (fails if one exists: a deployment's CA is never silently replaced)
/// and the identities of the lab's operators: `admin` (ADMIN role: the CLI, tests, benches)
/// and `controller` (CONTROLLER role), which the replicas' control channels require.
pub fn provision_ca(run_dir: &Path) -> Result<()> {
    let d = ca_dir(run_dir);
    private_dir(&d)?;
    private_dir(&run_dir.join("id"))?;
    pliant_wire::Ca::generate(Some(&d))
        .map_err(|e| LabError::Config(format!("lab CA in {}: {e}", d.display())))?;
    issue_identity(run_dir, ADMIN, pliant_wire::role::ADMIN)?;
    issue_identity(run_dir, CONTROLLER, pliant_wire::role::CONTROLLER)?;
    Ok(())
}

/// The lab's operator identities (under `<run_dir>/id/`).
pub const ADMIN: &str = "admin";
pub const CONTROLLER: &str = "controller";

/// The security of identity `name` of the lab whose run directory is `run_dir`, if it has one.
pub fn lab_security(run_dir: &Path, name: &str) -> Option<pliant_wire::Security> {
    let d = identity_dir(run_dir, name);
    // An unreadable identity falls back to none: the replica's refusal then says which
    // identity it needs.
    pliant_wire::Security::load(&d, pliant_wire::Encrypt::Auto).ok()
}

/// A client of the replica control socket `sock` of a lab (the socket sits in the lab's run
/// directory, or in a replica's host directory `<run>/hosts/r<n>/`): authenticated as the
/// lab's admin when the lab has identities, local otherwise.
pub fn control_client(sock: &Path) -> pliant_proto::Client {
    let sec = lab_run_dir_of(sock).and_then(|run| lab_security(&run, ADMIN));
    pliant_proto::Client::new(pliant_wire::Endpoint::Unix(sock.to_path_buf()), sec)
}

fn private_dir(d: &Path) -> Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    match std::fs::DirBuilder::new().mode(0o700).create(d) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(LabError::Config(format!("{}: {e}", d.display()))),
    }
}

/// How long lab certificates are valid: far beyond any lab's life.
const LAB_CERT_SECS: u64 = 30 * 24 * 3600;

/// Issues node `name` an identity with `roles` under the lab's CA (kept if it exists and
/// loads), and returns its directory.
pub fn issue_identity(run_dir: &Path, name: &str, roles: u32) -> Result<PathBuf> {
    issue_identity_in(run_dir, &identity_dir(run_dir, name), name, roles)
}

/// [`issue_identity`] into directory `dir` (a replica's private host directory).
pub fn issue_identity_in(run_dir: &Path, dir: &Path, name: &str, roles: u32) -> Result<PathBuf> {
    let dir = dir.to_path_buf();
    if dir.join("node.key").exists() {
        pliant_wire::Identity::load(&dir)
            .map_err(|e| LabError::Config(format!("identity {}: {e}", dir.display())))?;
        return Ok(dir);
    }
    let ca = pliant_wire::Ca::load(&ca_dir(run_dir))
        .map_err(|e| LabError::Config(format!("lab CA: {e}")))?;
    ca.issue_to(&dir, name, roles, LAB_CERT_SECS)
        .map_err(|e| LabError::Config(format!("identity {}: {e}", dir.display())))?;
    Ok(dir)
}

/// The `[security]` table of replica `n` (its identity, issued if needed). A replica on a
/// private host ([`crate::host`]) finds `<run>/id/r<n>` in its host directory, where
/// [`crate::host::prepare`] issued it; the shared `<run>/id/` holds only the operators'.
pub fn security_section(run_dir: &Path, n: u8, private: bool) -> Result<toml::Table> {
    let dir = identity_dir(run_dir, &format!("r{n}"));
    if private {
        crate::host::prepare(run_dir, n)?;
    } else {
        issue_identity(run_dir, &format!("r{n}"), pliant_wire::role::REPLICA)?;
    }
    let mut t = toml::Table::new();
    t.insert("identity".into(), dir.display().to_string().into());
    Ok(t)
}

/// The run directory of the lab whose replica control socket is `sock`.
pub fn lab_run_dir_of(sock: &Path) -> Option<PathBuf> {
    let parent = sock.parent()?;
    match parent.parent() {
        Some(hosts) if hosts.file_name().is_some_and(|n| n == "hosts") => {
            hosts.parent().map(Path::to_path_buf)
        }
        _ => Some(parent.to_path_buf()),
    }
}

/// Replica `n`'s FTMB logger socket: beside its control socket, `r<n>.ftmb.sock` (the
/// runtime's default for `[ha] ftmb_socket`; the controller derives the same path).
pub fn ftmb_socket(run_dir: &Path, n: u8) -> PathBuf {
    run_dir.join(format!("r{n}.ftmb.sock"))
}

/// Replica `n`'s replication socket: beside its control socket, `r<n>.repl.sock` (the
/// runtime's default for a control socket `r<n>.sock`).
pub fn repl_socket(run_dir: &Path, n: u8) -> PathBuf {
    run_dir.join(format!("r{n}.repl.sock"))
}

/// The `[ha]` table of replica `n`'s config in `mode`.
pub fn ha_section_for(run_dir: &Path, n: u8, mode: LabHaMode) -> toml::Table {
    let mut t = ha_section(run_dir, n);
    if mode == LabHaMode::Ftmb {
        t.insert("mode".into(), "ftmb".into());
        t.insert("ftmb_workers".into(), i64::from(FTMB_WORKERS).into());
        t.insert(
            "ftmb_snapshot_ms".into(),
            i64::from(FTMB_SNAPSHOT_MS).into(),
        );
    }
    t
}

/// The `[ha]` table of replica `n`'s config (Pico: the runtime's default mode).
pub fn ha_section(run_dir: &Path, n: u8) -> toml::Table {
    let mut t = toml::Table::new();
    t.insert(
        "repl_socket".into(),
        repl_socket(run_dir, n).display().to_string().into(),
    );
    t
}

/// Points an `[ha]` table already in a serialised replica config (`table`, the whole file) at
/// replica `n`'s own replication socket. Works on the TOML table so it does not matter whether
/// the runtime's config type keeps `[ha]` as a typed field or among the NF sections. Returns
/// whether the config has an `[ha]` section.
pub fn retarget_ha(table: &mut toml::Table, run_dir: &Path, n: u8) -> bool {
    match table.get_mut("ha") {
        Some(toml::Value::Table(ha)) => {
            ha.insert(
                "repl_socket".into(),
                repl_socket(run_dir, n).display().to_string().into(),
            );
            true
        }
        _ => false,
    }
}

/// Points a `[security]` section already in a serialised replica config at replica `n`'s own
/// identity (issued now if needed): a new replica never runs under another's name. Returns
/// whether the config has a `[security]` section.
pub fn retarget_security(
    table: &mut toml::Table,
    run_dir: &Path,
    n: u8,
    private: bool,
) -> Result<bool> {
    if !table.contains_key("security") {
        return Ok(false);
    }
    table.insert(
        "security".into(),
        toml::Value::Table(security_section(run_dir, n, private)?),
    );
    Ok(true)
}

/// PID of replica `n`'s process as the lab recorded it (the `pliant replica` process itself:
/// `ip netns exec` execs it), if it is still ours.
pub fn replica_pid(st: &LabState, n: u8) -> Option<i32> {
    let role = format!("pliant-r{n}");
    st.procs
        .iter()
        .rev()
        .find(|p| p.role == role && state::proc_matches(p))
        .map(|p| p.pid)
}

/// Lab-only fencing fallback when no BPF steering runs in the fabric (a 1-replica lab's
/// mirred patch panel): takes replica `n`'s two fabric-side veths down (or up again), so the
/// fabric neither delivers to it nor accepts anything it emits.
pub fn fence_links(st: &LabState, n: u8, fenced: bool) -> Result<()> {
    let fab = format!("{}-{}", st.name, Role::Fabric.suffix());
    let updown = if fenced { "down" } else { "up" };
    for dev in [fabric_in_if(n), fabric_out_if(n)] {
        cmd::run_ok(
            &[
                "ip".to_string(),
                "-n".into(),
                fab.clone(),
                "link".into(),
                "set".into(),
                dev,
                updown.into(),
            ],
            SETUP_TIMEOUT,
        )?;
    }
    Ok(())
}

/// [`fence_links`] by lab name (for the controller, which is not the process that built the
/// lab).
pub fn fence_by_name(run_root: &Path, lab: &str, n: u8, fenced: bool) -> Result<()> {
    crate::lab::validate_name(lab)?;
    let p = run_root.join(lab).join(state::STATE_FILE);
    if !p.exists() {
        return Err(LabError::NotFound(lab.to_string()));
    }
    fence_links(&LabState::load(&p)?, n, fenced)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lab_ca_issues_each_replica_its_own_identity() {
        let d = std::env::temp_dir().join(format!("pliant-lab-id-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        provision_ca(&d).expect("ca");
        assert!(
            provision_ca(&d).is_err(),
            "an existing CA is never replaced"
        );
        let t = security_section(&d, 2, false).expect("issue");
        let dir = identity_dir(&d, "r2");
        assert_eq!(t["identity"].as_str(), Some(dir.to_str().unwrap()));
        let id = pliant_wire::Identity::load(&dir).expect("loads");
        assert_eq!(id.name(), "r2");
        // Issued once: asking again keeps the same key.
        security_section(&d, 2, false).expect("again");
        assert_eq!(
            pliant_wire::Identity::load(&dir).unwrap().cert.key,
            id.cert.key
        );
        // A scaled-out replica's config copied from r2 is pointed at its own identity.
        let mut whole = toml::Table::new();
        whole.insert("security".into(), toml::Value::Table(t));
        assert!(retarget_security(&mut whole, &d, 5, false).unwrap());
        assert_eq!(
            whole["security"]["identity"].as_str(),
            Some(identity_dir(&d, "r5").to_str().unwrap())
        );
        assert_eq!(
            pliant_wire::Identity::load(&identity_dir(&d, "r5"))
                .unwrap()
                .name(),
            "r5"
        );
        let mut none = toml::Table::new();
        assert!(!retarget_security(&mut none, &d, 5, false).unwrap());
        let _ = std::fs::remove_dir_all(&d);
    }
    #[test]
    fn ftmb_mode_writes_its_keys_and_pico_writes_none() {
        let dir = Path::new("/run/pliant/lab1");
        let f = ha_section_for(dir, 2, LabHaMode::Ftmb);
        assert_eq!(f["mode"].as_str(), Some("ftmb"));
        assert_eq!(f["ftmb_workers"].as_integer(), Some(2));
        assert_eq!(f["ftmb_snapshot_ms"].as_integer(), Some(50));
        assert!(
            f.get("repl_secret").is_none(),
            "identities, not a shared secret"
        );
        let p = ha_section_for(dir, 2, LabHaMode::Pico);
        assert_eq!(p, ha_section(dir, 2));
        assert!(p.get("mode").is_none());
        assert_eq!(LabHaMode::parse("ftmb"), Some(LabHaMode::Ftmb));
        assert_eq!(LabHaMode::parse("pico").map(LabHaMode::label), Some("pico"));
        assert_eq!(LabHaMode::parse("remus"), None);
        assert_eq!(
            ftmb_socket(dir, 3),
            PathBuf::from("/run/pliant/lab1/r3.ftmb.sock")
        );
        // An added replica copies the template's [ha] (mode and all) and gets its own
        // replication socket; its logger socket is the runtime's default.
        let mut whole = toml::Table::new();
        whole.insert("ha".into(), toml::Value::Table(f));
        assert!(retarget_ha(&mut whole, dir, 4));
        assert_eq!(whole["ha"]["mode"].as_str(), Some("ftmb"));
        assert!(whole["ha"].get("ftmb_socket").is_none());
    }

    #[test]
    fn nat_replicas_get_their_pinned_port_block() {
        assert_eq!(nat_port_block(1), Some((20000, 20999)));
        assert_eq!(nat_port_block(3), Some((22000, 22999)));
        assert_eq!(nat_port_block(0), None);
        assert_eq!(nat_port_block(46), None, "past 65535");
        let dir = Path::new("/run/pliant/lab1");
        let mut t = toml::Table::new();
        let mut nat = toml::Table::new();
        nat.insert("external_ip".into(), "10.77.2.1".into());
        t.insert("nat".into(), toml::Value::Table(nat));
        assert_eq!(
            pin_nat_ports(&mut t, 2, false).unwrap(),
            None,
            "one pico replica: its whole range"
        );
        assert!(!toml::to_string(&t).unwrap().contains("port_blocks"));
        // Replicas sharing the NAT address: each its own block.
        let mut shared = t.clone();
        assert_eq!(
            pin_nat_ports(&mut shared, 2, true).unwrap(),
            Some((21000, 21999))
        );
        let text = toml::to_string(&shared).unwrap();
        assert!(text.contains("port_blocks = [[21000, 21999]]"), "{text}");
        t.insert(
            "ha".into(),
            toml::Value::Table(ha_section_for(dir, 2, LabHaMode::Ftmb)),
        );
        assert_eq!(
            pin_nat_ports(&mut t, 2, false).unwrap(),
            Some((21000, 21999))
        );
        let text = toml::to_string(&t).unwrap();
        assert!(text.contains("port_blocks = [[21000, 21999]]"), "{text}");
        // A replica added later (the template's table copied) is re-pinned to its own block.
        assert!(pin_nat_ports(&mut t, 5, false).unwrap().is_some());
        assert!(toml::to_string(&t)
            .unwrap()
            .contains("port_blocks = [[24000, 24999]]"));
        assert!(pin_nat_ports(&mut t, 60, false).is_err());
        let mut no_nat = toml::Table::new();
        no_nat.insert(
            "ha".into(),
            toml::Value::Table(ha_section_for(dir, 2, LabHaMode::Ftmb)),
        );
        assert_eq!(pin_nat_ports(&mut no_nat, 2, true).unwrap(), None);
    }

    #[test]
    fn ha_tables_point_at_each_replicas_own_socket() {
        let dir = Path::new("/run/pliant/lab1");
        let t = ha_section(dir, 2);
        assert_eq!(
            t["repl_socket"].as_str(),
            Some("/run/pliant/lab1/r2.repl.sock")
        );
        let mut whole = toml::Table::new();
        assert!(!retarget_ha(&mut whole, dir, 3), "no [ha]: nothing to do");
        whole.insert("ha".into(), toml::Value::Table(t));
        assert!(retarget_ha(&mut whole, dir, 3));
        assert_eq!(
            whole["ha"]["repl_socket"].as_str(),
            Some("/run/pliant/lab1/r3.repl.sock")
        );
    }
}
