//! The lab's on-disk record (`<run_root>/<name>/state.json`) and teardown from it.
//!
//! The record is written *before* each resource is created, so a crash at any point leaves a
//! file that names everything that might exist; teardown tolerates entries that never came to be.
//! This is what lets `pliant lab down` clean up after a process that died without running `Drop`.

use crate::cmd::{self, SETUP_TIMEOUT};
use crate::error::{io_err, LabError, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub const STATE_FILE: &str = "state.json";

/// A process the lab started. Before it is signalled its `/proc/<pid>/cmdline` must still
/// contain `marker` (the lab's run directory), so a recycled PID is never killed.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ProcRecord {
    pub pid: i32,
    pub role: String,
    pub marker: String,
}

/// The process that owns a lab (a test, the benchmark). When it is gone and the lab is not
/// `detached`, the lab is stale. `start_ticks` (from /proc/<pid>/stat) guards against PID reuse.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Owner {
    pub pid: i32,
    pub start_ticks: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct LabState {
    pub name: String,
    pub run_dir: PathBuf,
    pub mode: String,
    pub created_unix_s: u64,
    /// `None` for labs made by `pliant lab up`, which outlive the command on purpose.
    pub owner: Option<Owner>,
    pub namespaces: Vec<String>,
    pub procs: Vec<ProcRecord>,
    /// Each replica runs on a private host view of the run directory ([`crate::host`]).
    #[serde(default)]
    pub private_hosts: bool,
    /// Each replica namespace is a host whose agent starts its replica ([`crate::agents`]).
    #[serde(default)]
    pub agents: bool,
}

impl LabState {
    pub fn path(&self) -> PathBuf {
        self.run_dir.join(STATE_FILE)
    }

    /// Write atomically (temp file + rename) so a reader never sees half a record.
    pub fn save(&self) -> Result<()> {
        let path = self.path();
        let tmp = self.run_dir.join("state.json.tmp");
        let text = serde_json::to_string_pretty(self).map_err(|e| LabError::State {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        std::fs::write(&tmp, text).map_err(io_err(&tmp))?;
        std::fs::rename(&tmp, &path).map_err(io_err(&path))
    }

    pub fn load(path: &Path) -> Result<LabState> {
        let text = std::fs::read_to_string(path).map_err(io_err(path))?;
        serde_json::from_str(&text).map_err(|e| LabError::State {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })
    }

    /// True when the owning process is gone (or was replaced by another with the same PID).
    pub fn is_stale(&self) -> bool {
        match &self.owner {
            None => false,
            Some(o) => proc_start_ticks(o.pid) != Some(o.start_ticks),
        }
    }
}

/// Start time of a process in clock ticks since boot (field 22 of /proc/<pid>/stat).
pub fn proc_start_ticks(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may contain spaces and parentheses: parse after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    // After ')' come fields 3.. ; start time is field 22, i.e. index 19 here.
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// The process's command line with NULs turned into spaces, if it exists.
pub fn proc_cmdline(pid: i32) -> Option<String> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let s: String = String::from_utf8_lossy(&raw)
        .chars()
        .map(|c| if c == '\0' { ' ' } else { c })
        .collect();
    Some(s.trim_end().to_string())
}

/// Alive (not a zombie) and still the process we recorded.
pub fn proc_matches(rec: &ProcRecord) -> bool {
    if rec.pid <= 1 {
        return false;
    }
    if is_zombie(rec.pid) {
        return false;
    }
    proc_cmdline(rec.pid).is_some_and(|c| c.contains(&rec.marker))
}

fn is_zombie(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            let rest = s[s.rfind(')')? + 1..].trim_start().to_string();
            rest.chars().next()
        })
        .is_some_and(|c| c == 'Z' || c == 'X')
}

fn signal(pid: i32, sig: i32) {
    // SAFETY: kill(2) with a PID we verified belongs to this lab; no memory is involved.
    unsafe {
        libc::kill(pid, sig);
    }
}

/// SIGTERM a recorded process (after verifying its cmdline), wait up to `grace`, then SIGKILL.
pub fn stop_proc(rec: &ProcRecord, grace: Duration) {
    if !proc_matches(rec) {
        return;
    }
    signal(rec.pid, libc::SIGTERM);
    let start = Instant::now();
    while start.elapsed() < grace {
        if !proc_matches(rec) {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    if proc_matches(rec) {
        signal(rec.pid, libc::SIGKILL);
    }
}

pub fn netns_exists(ns: &str) -> bool {
    Path::new("/run/netns").join(ns).exists()
}

/// PIDs of processes inside a namespace (`ip netns pids`), e.g. nginx workers, curl, trafgen.
pub fn netns_pids(ns: &str) -> Vec<i32> {
    if !netns_exists(ns) {
        return Vec::new();
    }
    let argv: Vec<String> = ["ip", "netns", "pids", ns]
        .iter()
        .map(|s| s.to_string())
        .collect();
    match cmd::run(&argv, SETUP_TIMEOUT) {
        Ok(out) => out
            .stdout
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect(),
        Err(_) => Vec::new(),
    }
}

impl LabState {
    /// Namespaces this record may delete: only `<name>-...` ones, so a corrupted or hand-edited
    /// state file cannot make teardown delete someone else's namespace.
    pub fn owned_namespaces(&self) -> impl Iterator<Item = &String> {
        let prefix = format!("{}-", self.name);
        self.namespaces
            .iter()
            .filter(move |n| n.starts_with(&prefix) && !n.contains('/'))
    }

    /// The run directory, if it really is this lab's (`.../<name>`).
    fn owned_run_dir(&self) -> Option<&Path> {
        (self.run_dir.file_name().and_then(|f| f.to_str()) == Some(self.name.as_str())
            && self.run_dir.join(STATE_FILE).exists())
        .then_some(self.run_dir.as_path())
    }
}

/// Remove everything a state record names. Idempotent; collects the errors it could not fix.
pub fn teardown(state: &LabState) -> Vec<String> {
    let mut problems = Vec::new();
    // 1. Recorded processes, newest first (replicas before the servers they talk to).
    for rec in state.procs.iter().rev() {
        stop_proc(rec, Duration::from_secs(2));
    }
    // 2. Anything still running inside the lab's own namespaces (nginx workers, a client tool
    //    left by a crashed test) — these namespaces exist only for this lab, so every process
    //    in them was started by it. Killed by PID, never by name.
    for ns in state.owned_namespaces() {
        for pid in netns_pids(ns) {
            if pid > 1 && pid != std::process::id() as i32 {
                signal(pid, libc::SIGKILL);
            }
        }
    }
    // 3. Namespaces: deleting one destroys its end of each veth pair (and so the pair).
    for ns in state.owned_namespaces() {
        if !netns_exists(ns) {
            continue;
        }
        let argv: Vec<String> = ["ip", "netns", "del", ns]
            .iter()
            .map(|s| s.to_string())
            .collect();
        if let Err(e) = cmd::run_ok(&argv, SETUP_TIMEOUT) {
            problems.push(format!("delete netns {ns}: {e}"));
        }
    }
    // 3b. Steering map pins of a detached lab (the fabric's filters went with its namespace).
    for ns in state.owned_namespaces() {
        pliant_steer::remove_pins(&pliant_steer::lab::pin_dir(ns));
    }
    // 4. The run directory (configs, logs, served files, the state file itself).
    match state.owned_run_dir() {
        Some(dir) => {
            if let Err(e) = std::fs::remove_dir_all(dir) {
                problems.push(format!("remove {}: {e}", dir.display()));
            }
        }
        None if state.run_dir.exists() => problems.push(format!(
            "not removing {}: it is not lab {}'s run directory",
            state.run_dir.display(),
            state.name
        )),
        None => {}
    }
    problems
}

/// All labs with a readable state file under `run_root`, sorted by name.
pub fn list(run_root: &Path) -> Vec<std::result::Result<LabState, LabError>> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(run_root) else {
        return out;
    };
    let mut dirs: Vec<PathBuf> = rd.filter_map(|e| e.ok()).map(|e| e.path()).collect();
    dirs.sort();
    for d in dirs {
        let p = d.join(STATE_FILE);
        if p.exists() {
            out.push(LabState::load(&p));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_start_ticks_are_readable_and_stable() {
        let me = std::process::id() as i32;
        let a = proc_start_ticks(me).expect("own /proc/self/stat");
        assert_eq!(Some(a), proc_start_ticks(me));
    }

    #[test]
    fn stale_when_owner_start_time_differs() {
        let me = std::process::id() as i32;
        let ticks = proc_start_ticks(me).expect("ticks");
        let mut st = LabState {
            name: "x".into(),
            run_dir: PathBuf::from("/nonexistent"),
            mode: "kernel-nat".into(),
            created_unix_s: 0,
            owner: Some(Owner {
                pid: me,
                start_ticks: ticks,
            }),
            namespaces: vec![],
            procs: vec![],
            private_hosts: false,
            agents: false,
        };
        assert!(!st.is_stale());
        st.owner = Some(Owner {
            pid: me,
            start_ticks: ticks + 1,
        });
        assert!(st.is_stale());
        st.owner = None;
        assert!(!st.is_stale(), "detached labs are never stale");
    }

    #[test]
    fn cmdline_marker_must_match_before_kill() {
        let me = std::process::id() as i32;
        let rec = ProcRecord {
            pid: me,
            role: "self".into(),
            marker: "/definitely/not/in/my/cmdline".into(),
        };
        assert!(!proc_matches(&rec));
        // stop_proc must then be a no-op (if it signalled us, this test process would die).
        stop_proc(&rec, Duration::from_millis(10));
    }

    #[test]
    fn teardown_only_touches_namespaces_and_directories_of_its_own_name() {
        let st = LabState {
            name: "lab1".into(),
            run_dir: PathBuf::from("/nonexistent/other"),
            mode: "kernel-nat".into(),
            created_unix_s: 0,
            owner: None,
            namespaces: vec![
                "lab1-client".into(),
                "lab10-client".into(),
                "somebody-else".into(),
                "lab1-../x".into(),
            ],
            procs: vec![],
            private_hosts: false,
            agents: false,
        };
        let owned: Vec<&String> = st.owned_namespaces().collect();
        assert_eq!(owned, vec!["lab1-client"]);
        assert!(st.owned_run_dir().is_none());
    }

    #[test]
    fn save_and_load_round_trip() {
        let dir = std::env::temp_dir().join(format!("pliant-lab-state-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        let st = LabState {
            name: "rt".into(),
            run_dir: dir.clone(),
            mode: "kernel-forward".into(),
            created_unix_s: 1,
            owner: None,
            namespaces: vec!["a-client".into()],
            procs: vec![ProcRecord {
                pid: 42,
                role: "nginx".into(),
                marker: "m".into(),
            }],
            private_hosts: false,
            agents: false,
        };
        st.save().expect("save");
        let back = LabState::load(&st.path()).expect("load");
        assert_eq!(back, st);
        std::fs::write(st.path(), "{not json").expect("write");
        assert!(matches!(
            LabState::load(&st.path()),
            Err(LabError::State { .. })
        ));
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}
