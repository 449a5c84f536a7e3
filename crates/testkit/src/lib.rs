//! Preconditions of tests that need root or an installed tool (see README.md).
//!
//! A test whose precondition fails must not pass: libtest captures what a passing test prints,
//! so an "eprintln + return" skip looked exactly like a run. A missing precondition therefore
//! panics, unless the caller opted in with `PLIANT_ALLOW_SKIP=1`; then the skip is appended to
//! [`SKIP_LOG`] so the Makefile can count and list it.

use std::io::Write;
use std::path::{Path, PathBuf};

/// The variable that turns a failed precondition into a recorded skip; only the value `1` counts.
pub const ALLOW_SKIP_ENV: &str = "PLIANT_ALLOW_SKIP";

/// Where skips are recorded: `target/test-skips.log` at the workspace root. Fixed at compile time
/// (this crate sits at `crates/testkit`), not taken from `CARGO_TARGET_DIR`, so the Makefile that
/// truncates and reads it needs no agreement with cargo about the target directory.
pub const SKIP_LOG: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../target/test-skips.log");

/// True when the effective uid is 0.
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Root (network namespaces, AF_PACKET sockets, tc, BPF). `true`: go on; `false`: the test was
/// skipped under `PLIANT_ALLOW_SKIP=1` and must return. Panics otherwise, at the caller's line
/// (`#[track_caller]` down to the panic, so the report points at the test, not at this crate).
#[track_caller]
pub fn require_root() -> bool {
    require(
        is_root(),
        "needs root (network namespaces, AF_PACKET, tc)",
        "run as root",
    )
}

/// An installed program: `tool` is looked up in `PATH`, or checked as a file when it contains a
/// `/`. `package` is the Debian package that provides it (`scripts/install-deps.sh` installs it).
/// Returns and panics like [`require_root`].
#[track_caller]
pub fn require_tool(tool: &str, package: &str) -> bool {
    let path = std::env::var_os("PATH").unwrap_or_default();
    require(
        find_tool(tool, &path).is_some(),
        &if tool.contains('/') {
            format!("needs `{tool}` (no such executable)")
        } else {
            format!("needs `{tool}` (not found in PATH)")
        },
        &format!("install package {package} (scripts/install-deps.sh installs it)"),
    )
}

#[track_caller]
fn require(ok: bool, reason: &str, fix: &str) -> bool {
    if ok {
        return true;
    }
    let allow = std::env::var(ALLOW_SKIP_ENV).is_ok_and(|v| v == "1");
    decide(&test_name(), reason, fix, allow, Path::new(SKIP_LOG))
}

/// The failed-precondition path, with the environment and the log passed in (unit-testable).
#[track_caller]
fn decide(test: &str, reason: &str, fix: &str, allow: bool, log: &Path) -> bool {
    if !allow {
        panic!("{test}: {reason}: {fix}, or set {ALLOW_SKIP_ENV}=1 to skip it");
    }
    let line = format!("{test}: {reason}\n");
    if let Some(dir) = log.parent() {
        std::fs::create_dir_all(dir)
            .unwrap_or_else(|e| panic!("{test}: cannot create {}: {e}", dir.display()));
    }
    // One write of one short line to an O_APPEND file: lines of test binaries running at the
    // same time do not interleave.
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .unwrap_or_else(|e| panic!("{test}: cannot open the skip log {}: {e}", log.display()));
    f.write_all(line.as_bytes())
        .unwrap_or_else(|e| panic!("{test}: cannot write the skip log {}: {e}", log.display()));
    eprintln!("SKIPPED ({ALLOW_SKIP_ENV}=1) {}", line.trim_end());
    false
}

/// `binary::test`: libtest names each test's thread after the test; the binary's file name
/// (cargo's `-<hash>` suffix removed) tells apart tests of the same name in different files.
fn test_name() -> String {
    let exe = std::env::args_os()
        .next()
        .and_then(|a| {
            Path::new(&a)
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
        })
        .unwrap_or_default();
    let binary = match exe.rsplit_once('-') {
        Some((stem, hash)) if hash.chars().all(|c| c.is_ascii_hexdigit()) => stem.to_string(),
        _ => exe,
    };
    let thread = std::thread::current();
    match thread.name() {
        Some(name) if name != "main" => format!("{binary}::{name}"),
        _ => binary,
    }
}

/// `tool` as an executable file: itself when it has a `/`, else the first hit in `path`.
fn find_tool(tool: &str, path: &std::ffi::OsStr) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let executable = |p: &Path| {
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if tool.contains('/') {
        let p = PathBuf::from(tool);
        return executable(&p).then_some(p);
    }
    std::env::split_paths(path)
        .map(|d| d.join(tool))
        .find(|p| executable(p))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A private directory under the system temp dir, removed on drop.
    struct Dir(PathBuf);

    impl Dir {
        fn new(tag: &str) -> Dir {
            let p =
                std::env::temp_dir().join(format!("pliant-testkit-{tag}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&p);
            std::fs::create_dir_all(&p).unwrap();
            Dir(p)
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn without_permission_a_missing_precondition_panics_with_reason_and_fix() {
        let d = Dir::new("panic");
        let log = d.0.join("skips.log");
        let err =
            std::panic::catch_unwind(|| decide("bin::t", "needs root", "run as root", false, &log))
                .expect_err("must panic");
        let msg = err.downcast_ref::<String>().expect("formatted message");
        assert_eq!(
            msg,
            "bin::t: needs root: run as root, or set PLIANT_ALLOW_SKIP=1 to skip it"
        );
        assert!(!log.exists(), "nothing recorded when the test fails");
    }

    #[test]
    fn with_permission_each_skip_appends_one_line_and_returns_false() {
        let d = Dir::new("log");
        // The directory is created on demand (a clean tree has no target/ yet).
        let log = d.0.join("target").join("skips.log");
        assert!(!decide("a::one", "needs root", "run as root", true, &log));
        assert!(!decide(
            "b::two",
            "needs `x` (not found in PATH)",
            "install x",
            true,
            &log
        ));
        assert_eq!(
            std::fs::read_to_string(&log).unwrap(),
            "a::one: needs root\nb::two: needs `x` (not found in PATH)\n"
        );
    }

    #[test]
    fn tools_are_found_in_path_or_by_absolute_path_and_must_be_executable() {
        let d = Dir::new("tools");
        let (bin, other) = (d.0.join("bin"), d.0.join("other"));
        std::fs::create_dir_all(&bin).unwrap();
        std::fs::create_dir_all(&other).unwrap();
        let write = |p: &Path, mode: u32| {
            use std::os::unix::fs::PermissionsExt;
            std::fs::write(p, "#!/bin/sh\n").unwrap();
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
        };
        write(&bin.join("tool"), 0o755);
        write(&other.join("plain"), 0o644);
        let path = std::env::join_paths([&other, &bin]).unwrap();

        assert_eq!(find_tool("tool", &path), Some(bin.join("tool")));
        assert_eq!(find_tool("plain", &path), None, "not executable");
        assert_eq!(find_tool("absent", &path), None);
        let abs = bin.join("tool");
        assert_eq!(
            find_tool(abs.to_str().unwrap(), std::ffi::OsStr::new("")),
            Some(abs)
        );
        assert_eq!(
            find_tool(other.join("plain").to_str().unwrap(), &path),
            None
        );
        // A directory is not a tool.
        assert_eq!(find_tool(bin.to_str().unwrap(), &path), None);
    }

    #[test]
    fn the_name_recorded_is_this_binary_and_this_test() {
        assert_eq!(
            test_name(),
            "pliant_testkit::tests::the_name_recorded_is_this_binary_and_this_test"
        );
    }

    #[test]
    fn the_skip_log_is_target_test_skips_log_at_the_workspace_root() {
        let log = Path::new(SKIP_LOG);
        let root = log.parent().and_then(Path::parent).expect("two levels");
        assert_eq!(log.file_name().unwrap(), "test-skips.log");
        assert_eq!(log.parent().unwrap().file_name().unwrap(), "target");
        let manifest =
            std::fs::read_to_string(root.join("Cargo.toml")).expect("workspace manifest");
        assert!(manifest.contains("[workspace]") && manifest.contains("\"crates/testkit\""));
    }
}

/// A directory of a test, removed with what it holds when dropped (also when the test fails).
pub struct TempDir(pub PathBuf);

impl TempDir {
    /// A new empty directory in the system's temporary directory, named
    /// `<prefix>-<pid>-<nanoseconds>` so that no two tests or runs share one.
    pub fn new(prefix: &str) -> TempDir {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default();
        let p = std::env::temp_dir().join(format!("{prefix}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        TempDir(p)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A deterministic xorshift64 generator for seeded tests (one seed reproduces one interleaving);
/// the seed must be non-zero.
#[derive(Clone, Debug)]
pub struct XorShift(pub u64);

impl XorShift {
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A value in `0..n` (`n` > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// TCP endpoints that behave like failed peers, for liveness tests.
pub mod sockets {
    use std::net::{SocketAddr, TcpListener, TcpStream};
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

    /// A TCP endpoint that never answers a connect: a listener whose accept queue (backlog 0)
    /// holds one connection already and is never accepted from, so Linux drops every further
    /// SYN without a reset (`ListenOverflows`), as a lost SYN or a hung host would look.
    /// Keep both values alive for as long as the endpoint must stay silent.
    pub fn silent_tcp_endpoint(addr: SocketAddr) -> (TcpListener, TcpStream) {
        let l = TcpListener::bind(addr).unwrap();
        // SAFETY: listen(2) again on a listening socket we own only changes its backlog.
        assert_eq!(unsafe { libc::listen(l.as_raw_fd(), 0) }, 0);
        let filler = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        (l, filler)
    }

    /// A TCP socket bound to a free port of 127.0.0.1 that never listens, and its port: a SYN
    /// to it is answered with a reset (the host's kernel answers, nothing runs there), and
    /// while it lives no other socket binds or auto-picks the port (a freed port could be
    /// taken by another test, or by a connect's own ephemeral source port).
    pub fn bound_not_listening() -> (OwnedFd, u16) {
        // SAFETY: plain socket(2)/bind(2)/getsockname(2) on a zeroed sockaddr_in we fill; the
        // fd is owned.
        unsafe {
            let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
            assert!(fd >= 0);
            let owned = OwnedFd::from_raw_fd(fd);
            let mut sa: libc::sockaddr_in = std::mem::zeroed();
            sa.sin_family = libc::AF_INET as libc::sa_family_t;
            sa.sin_addr.s_addr = u32::from(std::net::Ipv4Addr::LOCALHOST).to_be();
            let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
            let p = &mut sa as *mut libc::sockaddr_in as *mut libc::sockaddr;
            assert_eq!(
                libc::bind(fd, p, len),
                0,
                "{}",
                std::io::Error::last_os_error()
            );
            assert_eq!(libc::getsockname(fd, p, &mut len), 0);
            (owned, u16::from_be(sa.sin_port))
        }
    }
}
