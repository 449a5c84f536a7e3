//! Running code inside a named network namespace, and bpffs for pinning.
//!
//! `setns(CLONE_NEWNET)` changes only the calling thread, so each call spawns a scoped thread,
//! moves it into the namespace and runs the closure there; the caller's thread never changes
//! namespace. BPF map and program FDs are namespace-independent, so they stay usable from any
//! thread afterwards; only ifindex lookups and tc netlink calls need the fabric namespace.

use crate::{Result, SteerError};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;

/// Runs `f` on a thread inside network namespace `ns` (a name under /run/netns).
pub(crate) fn in_netns<T: Send>(ns: &str, f: impl FnOnce() -> T + Send) -> Result<T> {
    let err = |source| SteerError::Netns {
        ns: ns.to_string(),
        source,
    };
    if ns.is_empty() || ns.contains('/') {
        return Err(err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "namespace name must be a plain name",
        )));
    }
    let file = File::open(Path::new("/run/netns").join(ns)).map_err(err)?;
    std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: file is an open netns fd; setns affects only this thread.
            let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
            if rc != 0 {
                return Err(err(std::io::Error::last_os_error()));
            }
            Ok(f())
        })
        .join()
        .unwrap_or_else(|_| {
            Err(err(std::io::Error::other(
                "thread running in the namespace panicked",
            )))
        })
    })
}

const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

fn is_bpffs(p: &Path) -> bool {
    let Ok(c) = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()) else {
        return false;
    };
    // SAFETY: statfs writes into a zeroed struct we own; c is NUL-terminated.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::statfs(c.as_ptr(), &mut st) };
    rc == 0 && st.f_type as i64 == BPF_FS_MAGIC
}

/// Makes sure `dir` lies on a bpffs, mounting one at /sys/fs/bpf if none is (root only), and
/// creates `dir`.
pub(crate) fn ensure_bpffs(dir: &Path) -> Result<()> {
    let root = Path::new("/sys/fs/bpf");
    if !dir.starts_with(root) {
        return Err(SteerError::Bpffs {
            path: dir.to_path_buf(),
            source: std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "pin directory must be under /sys/fs/bpf",
            ),
        });
    }
    if !is_bpffs(root) {
        let st = std::process::Command::new("mount")
            .args(["-t", "bpf", "bpf", "/sys/fs/bpf"])
            .status()
            .map_err(|e| SteerError::Bpffs {
                path: root.to_path_buf(),
                source: e,
            })?;
        if !st.success() || !is_bpffs(root) {
            return Err(SteerError::Bpffs {
                path: root.to_path_buf(),
                source: std::io::Error::other(format!("mount -t bpf failed ({st})")),
            });
        }
    }
    std::fs::create_dir_all(dir).map_err(|e| SteerError::Bpffs {
        path: dir.to_path_buf(),
        source: e,
    })
}
