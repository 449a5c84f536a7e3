//! High availability in the lab (issue 4): the shared replication secret, the `[ha]` section
//! every replica config carries, replica PIDs (the e2e tests SIGKILL a primary by the PID the
//! lab started) and the fencing fallback for labs whose fabric is the tc mirred patch panel.
//!
//! The secret file follows `pliant_ha::auth`'s format: 32 random bytes as 64 lower-case hex
//! characters and a newline, mode 0600 (a group/other-readable file is refused by the replicas).

use crate::cmd::{self, SETUP_TIMEOUT};
use crate::error::{LabError, Result};
use crate::state::{self, LabState};
use crate::topology::{fabric_in_if, fabric_out_if, Role};
use std::path::{Path, PathBuf};

/// Name of the replication secret inside the lab's run directory.
pub const SECRET_FILE: &str = "repl.secret";
/// Random bytes in a secret (`pliant_ha::auth`'s size).
pub const SECRET_BYTES: usize = 32;

/// `<run_dir>/repl.secret`.
pub fn secret_path(run_dir: &Path) -> PathBuf {
    run_dir.join(SECRET_FILE)
}

/// Replica `n`'s replication socket: beside its control socket, `r<n>.repl.sock` (the
/// runtime's default for a control socket `r<n>.sock`).
pub fn repl_socket(run_dir: &Path, n: u8) -> PathBuf {
    run_dir.join(format!("r{n}.repl.sock"))
}

/// Writes a fresh secret to `path` with `pliant_ha::auth::Secret::generate` (the replicas'
/// own format: created exclusively, mode 0600 from the start). Fails if the file exists.
pub fn write_secret(path: &Path) -> Result<()> {
    pliant_ha::auth::Secret::generate(path)
        .map(|_| ())
        .map_err(|e| LabError::Config(format!("replication secret: {e}")))
}

/// The `[ha]` table of replica `n`'s config.
pub fn ha_section(run_dir: &Path, n: u8) -> toml::Table {
    let mut t = toml::Table::new();
    t.insert(
        "repl_socket".into(),
        repl_socket(run_dir, n).display().to_string().into(),
    );
    t.insert(
        "repl_secret".into(),
        secret_path(run_dir).display().to_string().into(),
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
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn secret_is_64_hex_chars_mode_0600_and_never_overwritten() {
        let dir = std::env::temp_dir().join(format!("pliant-lab-secret-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("mkdir");
        let p = secret_path(&dir);
        write_secret(&p).expect("write");
        let text = std::fs::read_to_string(&p).expect("read");
        let hex = text.strip_suffix('\n').expect("trailing newline");
        assert_eq!(hex.len(), 2 * SECRET_BYTES);
        assert!(hex.bytes().all(|b| b.is_ascii_hexdigit()));
        let mode = std::fs::metadata(&p).expect("stat").permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        assert!(write_secret(&p).is_err(), "an existing secret is kept");
        let q = dir.join("other.secret");
        write_secret(&q).expect("second");
        assert_ne!(
            std::fs::read_to_string(&q).expect("read"),
            text,
            "fresh randomness"
        );
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn ha_tables_point_at_each_replicas_own_socket() {
        let dir = Path::new("/run/pliant/lab1");
        let t = ha_section(dir, 2);
        assert_eq!(
            t["repl_socket"].as_str(),
            Some("/run/pliant/lab1/r2.repl.sock")
        );
        assert_eq!(
            t["repl_secret"].as_str(),
            Some("/run/pliant/lab1/repl.secret")
        );
        let mut whole = toml::Table::new();
        assert!(!retarget_ha(&mut whole, dir, 3), "no [ha]: nothing to do");
        whole.insert("ha".into(), toml::Value::Table(t));
        assert!(retarget_ha(&mut whole, dir, 3));
        assert_eq!(
            whole["ha"]["repl_socket"].as_str(),
            Some("/run/pliant/lab1/r3.repl.sock")
        );
        assert_eq!(
            whole["ha"]["repl_secret"].as_str(),
            Some("/run/pliant/lab1/repl.secret")
        );
    }
}
