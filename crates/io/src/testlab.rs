//! Throw-away network namespaces joined by veth pairs, for tests and the pps example.
//!
//! Needs root (tests check it with `pliant_testkit::require_root`) and iproute2 (`ip`). Names
//! carry the process id and a random suffix so concurrent runs never collide; [`Lab`]'s `Drop`
//! deletes every namespace it created (which also deletes their veth interfaces), also when a
//! test fails or panics.

use std::io;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

static COUNTER: AtomicU32 = AtomicU32::new(0);

fn unique_tag() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    // 6 hex digits: short enough for 15-byte interface names.
    format!(
        "{:06x}",
        (std::process::id() ^ nanos.rotate_left(7) ^ n.wrapping_mul(0x9e37_79b9)) & 0xff_ffff
    )
}

/// Runs a command, turning a non-zero exit into an error that carries its stderr.
pub fn run(cmd: &str, args: &[&str]) -> io::Result<String> {
    let out = Command::new(cmd).args(args).output()?;
    if !out.status.success() {
        return Err(io::Error::other(format!(
            "`{} {}` failed: {}",
            cmd,
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A set of namespaces removed on drop.
#[derive(Debug)]
pub struct Lab {
    tag: String,
    namespaces: Vec<String>,
}

impl Lab {
    /// An empty lab with a unique tag.
    pub fn new() -> Lab {
        Lab {
            tag: unique_tag(),
            namespaces: Vec::new(),
        }
    }

    /// Unique tag of this lab (6 hex digits), usable in interface names.
    pub fn tag(&self) -> &str {
        &self.tag
    }

    /// Creates namespace `pio-<role>-<pid>-<tag>` with IPv6 disabled (so the kernel sends no
    /// router solicitations or MLD reports that would disturb frame counts) and loopback up.
    pub fn add_ns(&mut self, role: &str) -> io::Result<String> {
        let name = format!("pio-{}-{}-{}", role, std::process::id(), self.tag);
        run("ip", &["netns", "add", &name])?;
        self.namespaces.push(name.clone());
        for key in [
            "net.ipv6.conf.all.disable_ipv6=1",
            "net.ipv6.conf.default.disable_ipv6=1",
        ] {
            self.exec(&name, &["sysctl", "-qw", key])?;
        }
        self.exec(&name, &["ip", "link", "set", "lo", "up"])?;
        Ok(name)
    }

    /// Creates a veth pair `if_a` (in `ns_a`) <-> `if_b` (in `ns_b`), both up.
    pub fn add_veth(&self, ns_a: &str, if_a: &str, ns_b: &str, if_b: &str) -> io::Result<()> {
        run(
            "ip",
            &[
                "-n", ns_a, "link", "add", if_a, "type", "veth", "peer", "name", if_b, "netns",
                ns_b,
            ],
        )?;
        self.exec(ns_a, &["ip", "link", "set", if_a, "up"])?;
        self.exec(ns_b, &["ip", "link", "set", if_b, "up"])?;
        Ok(())
    }

    /// Runs `args` inside namespace `ns` (`ip netns exec`).
    pub fn exec(&self, ns: &str, args: &[&str]) -> io::Result<String> {
        let mut all = vec!["netns", "exec", ns];
        all.extend_from_slice(args);
        run("ip", &all)
    }

    /// Runs `f` on a fresh thread that has joined namespace `ns`. Sockets opened by `f` stay in
    /// `ns` and can be used from any thread afterwards.
    pub fn in_ns<T: Send>(&self, ns: &str, f: impl FnOnce() -> T + Send) -> io::Result<T> {
        let path = format!("/run/netns/{ns}");
        std::thread::scope(|s| {
            s.spawn(move || -> io::Result<T> {
                let file = std::fs::File::open(&path)?;
                use std::os::fd::AsRawFd;
                // SAFETY: setns on a namespace fd affects only this thread.
                if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(f())
            })
            .join()
            .map_err(|_| io::Error::other("namespace thread panicked"))?
        })
    }
}

impl Default for Lab {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        for ns in self.namespaces.drain(..).rev() {
            // Best effort: report but never panic in drop.
            if let Err(e) = run("ip", &["netns", "del", &ns]) {
                eprintln!("pliant-io testlab: cleanup of {ns} failed: {e}");
            }
        }
    }
}
