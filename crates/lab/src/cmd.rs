//! Running commands (optionally inside a namespace) with captured output and a time bound.
//!
//! Every command the lab runs has a timeout: a wedged `ip`/`nft`/`curl` must not hang a test
//! forever. On timeout the child — a process this lab started, identified by its PID — is killed.

use crate::error::{LabError, Result};
use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_interrupt(_sig: libc::c_int) {
    // Only an atomic store: async-signal-safe.
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// Make Ctrl-C / SIGTERM *request* a stop instead of killing this process, so a long-running
/// command (demo, benchmark) can tear its lab down instead of leaving it behind. Children are
/// unaffected (exec resets caught signals), so the tool running in the foreground still dies
/// from Ctrl-C and the caller sees its failure; poll [`interrupted`] between steps.
pub fn defer_interrupts() {
    let handler = on_interrupt as extern "C" fn(libc::c_int) as libc::sighandler_t;
    // SAFETY: installing a handler that only performs an atomic store.
    unsafe {
        libc::signal(libc::SIGINT, handler);
        libc::signal(libc::SIGTERM, handler);
    }
}

/// True once SIGINT/SIGTERM arrived after [`defer_interrupts`].
pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

/// Default bound for set-up commands (ip, tc, nft, sysctl).
pub const SETUP_TIMEOUT: Duration = Duration::from_secs(20);

/// Captured result of one command.
#[derive(Clone, Debug)]
pub struct ExecOutput {
    /// Exit code; `None` when the process was ended by a signal.
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl ExecOutput {
    pub fn success(&self) -> bool {
        self.code == Some(0)
    }
}

/// Human-readable rendering of an argv for error messages.
pub fn render(args: &[String]) -> String {
    args.join(" ")
}

/// The argv that runs `args` inside namespace `ns` (`ip netns exec` setns()s and then execs, so
/// the PID of the spawned process is the PID of the command itself).
pub fn in_ns(ns: &str, args: &[&str]) -> Vec<String> {
    let mut v = vec!["ip".to_string(), "netns".into(), "exec".into(), ns.into()];
    v.extend(args.iter().map(|s| s.to_string()));
    v
}

/// Run `args` to completion (bounded by `timeout`), capturing stdout and stderr.
pub fn run(args: &[String], timeout: Duration) -> Result<ExecOutput> {
    let (prog, rest) = args.split_first().ok_or_else(|| LabError::Command {
        cmd: String::new(),
        code: None,
        stderr: "empty command".into(),
    })?;
    let mut cmd = Command::new(prog);
    cmd.args(rest);
    run_command(cmd, timeout)
}

/// [`run`] for a prepared command (its environment set, for a secret that must stay off the
/// command line): stdin empty, both pipes drained, killed after `timeout`.
pub fn run_command(mut cmd: Command, timeout: Duration) -> Result<ExecOutput> {
    let rendered = std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| a.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| LabError::Spawn {
            cmd: rendered.clone(),
            source,
        })?;
    // Drain both pipes on threads so a chatty child cannot block on a full pipe while we wait.
    let out_t = drain(child.stdout.take());
    let err_t = drain(child.stderr.take());
    let status = wait_bounded(&mut child, timeout);
    let stdout = out_t.join().unwrap_or_default();
    let stderr = err_t.join().unwrap_or_default();
    match status {
        Some(code) => Ok(ExecOutput {
            code,
            stdout,
            stderr,
        }),
        None => Err(LabError::Timeout {
            cmd: rendered,
            timeout_ms: timeout.as_millis() as u64,
        }),
    }
}

/// Run and require exit code 0.
pub fn run_ok(args: &[String], timeout: Duration) -> Result<ExecOutput> {
    let out = run(args, timeout)?;
    if out.success() {
        Ok(out)
    } else {
        Err(LabError::Command {
            cmd: render(args),
            code: out.code,
            stderr: out.stderr.trim().to_string(),
        })
    }
}

fn drain<R: Read + Send + 'static>(r: Option<R>) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        if let Some(mut r) = r {
            let _ = r.read_to_end(&mut buf);
        }
        String::from_utf8_lossy(&buf).into_owned()
    })
}

/// Wait for `child` at most `timeout`. Returns `Some(exit code)` or `None` after killing it.
pub fn wait_bounded(child: &mut Child, timeout: Duration) -> Option<Option<i32>> {
    let start = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(st)) => return Some(st.code()),
            Ok(None) => {}
            Err(_) => return Some(None),
        }
        if start.elapsed() >= timeout {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Stop a child spawned as a process-group leader (see `Lab::spawn`): `sig` to the whole group,
/// wait up to `grace`, then SIGKILL to the group. Returns false if it had to be killed.
pub fn stop_group(child: &mut Child, sig: i32, grace: Duration) -> bool {
    let pgid = child.id() as i32;
    if let Ok(Some(_)) = child.try_wait() {
        return true;
    }
    // SAFETY: kill(2) on the process group we created for our own, not yet reaped, child (its
    // PID is the group ID, so it cannot have been recycled).
    unsafe {
        libc::kill(-pgid, sig);
    }
    if wait_bounded_quiet(child, grace) {
        return true;
    }
    // SAFETY: as above.
    unsafe {
        libc::kill(-pgid, libc::SIGKILL);
    }
    let _ = child.wait();
    false
}

fn wait_bounded_quiet(child: &mut Child, timeout: Duration) -> bool {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if let Ok(Some(_)) = child.try_wait() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    false
}

/// Moves the calling thread (and the threads it spawns afterwards) into network namespace
/// `ns` (`/run/netns/<ns>`, as `ip netns` makes it): `setns(CLONE_NEWNET)` changes only the
/// calling thread.
pub fn enter_netns(ns: &str) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    if ns.is_empty() || ns.contains('/') {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{ns:?} is not a namespace name"),
        ));
    }
    let f = std::fs::File::open(std::path::Path::new("/run/netns").join(ns))?;
    // SAFETY: setns on a valid fd we own; CLONE_NEWNET affects only the calling thread.
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn captures_output_and_code() {
        let out = run(
            &argv(&["sh", "-c", "echo hi; echo err >&2; exit 3"]),
            SETUP_TIMEOUT,
        )
        .expect("sh runs");
        assert_eq!(out.code, Some(3));
        assert_eq!(out.stdout, "hi\n");
        assert_eq!(out.stderr, "err\n");
        assert!(!out.success());
    }

    #[test]
    fn run_ok_reports_failure_with_stderr() {
        let e = run_ok(&argv(&["sh", "-c", "echo boom >&2; exit 1"]), SETUP_TIMEOUT).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("boom"), "{msg}");
        assert!(msg.contains("exit Some(1)"), "{msg}");
    }

    #[test]
    fn timeout_kills_child() {
        let e = run(&argv(&["sleep", "30"]), Duration::from_millis(100)).unwrap_err();
        assert!(matches!(e, LabError::Timeout { .. }), "{e}");
    }

    #[test]
    fn missing_program_is_a_spawn_error() {
        let e = run(&argv(&["/nonexistent/prog"]), SETUP_TIMEOUT).unwrap_err();
        assert!(matches!(e, LabError::Spawn { .. }), "{e}");
    }

    #[test]
    fn stop_group_reaches_forked_grandchildren() {
        use std::os::unix::process::CommandExt;
        // A shell that forks a long sleep and waits: SIGTERM to the group must end both.
        let mut c = Command::new("sh")
            .args(["-c", "sleep 30 & echo $! ; wait"])
            .stdout(Stdio::piped())
            .process_group(0)
            .spawn()
            .expect("spawn sh");
        let mut line = String::new();
        let mut out = c.stdout.take().expect("stdout");
        let mut byte = [0u8; 1];
        while out.read(&mut byte).map(|n| n == 1).unwrap_or(false) && byte[0] != b'\n' {
            line.push(byte[0] as char);
        }
        let grandchild: i32 = line.trim().parse().expect("pid of sleep");
        assert!(stop_group(&mut c, libc::SIGTERM, Duration::from_secs(5)));
        // The grandchild was reparented; it must be gone (or a zombie about to be reaped).
        // The signal was sent to it, but on a loaded machine it may not have run to die yet
        // when the shell is reaped: wait for that, bounded (a hang guard, not a timing check).
        let alive = || {
            std::fs::read_to_string(format!("/proc/{grandchild}/stat"))
                .map(|s| !s.contains(") Z"))
                .unwrap_or(false)
        };
        let t = Instant::now();
        while alive() && t.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(!alive(), "sleep {grandchild} survived the group signal");
    }

    #[test]
    fn in_ns_prefixes_ip_netns_exec() {
        assert_eq!(
            in_ns("x", &["ls", "-l"]),
            argv(&["ip", "netns", "exec", "x", "ls", "-l"])
        );
    }
}
