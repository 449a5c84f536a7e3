//! A replica as on a host of its own: in a lab whose replicas talk over TCP, each replica
//! process sees only its own files. Its namespace's mount view has `hosts/r<n>` (its "host
//! directory") mounted over the lab's run directory, so the paths in its config
//! (`<run>/r<n>.toml`, `<run>/id/r<n>`, its control socket `<run>/r<n>.sock`) resolve inside
//! its own directory, and no other replica's sockets, keys or configs exist for it: whatever
//! works in such a lab does not depend on a shared `/run`.
//!
//! The lab and the controller (one per "deployment", in the host's mount namespace) still see
//! every host directory, the way an agent sees its own host: they find replica `n`'s control
//! socket at `hosts/r<n>/r<n>.sock`.

use crate::cmd;
use crate::error::{io_err, Result};
use std::path::{Path, PathBuf};

/// Replica `n`'s host directory.
pub fn dir(run_dir: &Path, n: u8) -> PathBuf {
    run_dir.join("hosts").join(format!("r{n}"))
}

/// Replica `n`'s control socket as the lab sees it.
pub fn socket(run_dir: &Path, n: u8, private: bool) -> PathBuf {
    match private {
        true => dir(run_dir, n).join(format!("r{n}.sock")),
        false => run_dir.join(format!("r{n}.sock")),
    }
}

/// Replica `n`'s config file as the lab writes it (`<run>/r<n>.toml` for the replica).
pub fn config(run_dir: &Path, n: u8, private: bool) -> PathBuf {
    match private {
        true => dir(run_dir, n).join(format!("r{n}.toml")),
        false => run_dir.join(format!("r{n}.toml")),
    }
}

/// Creates replica `n`'s host directory (mode 0700) and issues its identity into it (at
/// `id/r<n>`, what `<run>/id/r<n>` is inside its view).
pub fn prepare(run_dir: &Path, n: u8) -> Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    let d = dir(run_dir, n);
    std::fs::DirBuilder::new()
        .mode(0o700)
        .recursive(true)
        .create(&d)
        .map_err(io_err(&d))?;
    crate::ha::issue_identity_in(
        run_dir,
        &d.join("id").join(format!("r{n}")),
        &format!("r{n}"),
        pliant_wire::role::REPLICA,
    )
    .map(|_| ())
}

/// The command that runs `program` in namespace `ns` with replica `n`'s host directory over
/// the run directory (`ip netns exec` gives the process a mount namespace that does not
/// propagate back; the shell binds, then becomes the program, so the recorded PID is it).
pub fn command(ns: &str, run_dir: &Path, n: u8, program: &[&str]) -> Vec<String> {
    command_in(ns, &dir(run_dir, n), run_dir, program)
}

/// [`command`] with host directory `host` (a control-plane host's, [`crate::control`]).
pub fn command_in(ns: &str, host: &Path, run_dir: &Path, program: &[&str]) -> Vec<String> {
    let host = host.display().to_string();
    let run = run_dir.display().to_string();
    let mut argv: Vec<&str> = vec![
        "sh",
        "-c",
        "mount --bind \"$1\" \"$2\" && shift 2 && exec \"$@\"",
        "sh",
        &host,
        &run,
    ];
    argv.extend_from_slice(program);
    cmd::in_ns(ns, &argv)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_private_replica_is_found_in_its_host_directory() {
        let run = Path::new("/run/pliant/lab1");
        assert_eq!(
            socket(run, 3, true),
            PathBuf::from("/run/pliant/lab1/hosts/r3/r3.sock")
        );
        assert_eq!(
            socket(run, 3, false),
            PathBuf::from("/run/pliant/lab1/r3.sock")
        );
        let c = command("lab1-r3", run, 3, &["/bin/pliant", "replica"]);
        let tail: Vec<&str> = c.iter().rev().take(4).rev().map(String::as_str).collect();
        assert_eq!(
            tail,
            [
                "/run/pliant/lab1/hosts/r3",
                "/run/pliant/lab1",
                "/bin/pliant",
                "replica"
            ]
        );
    }
}
