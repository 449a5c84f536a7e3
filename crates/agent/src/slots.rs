//! The replicas of one host: start, stop, watch.
//!
//! A replica the agent started is its child, so its death is exact and immediate: the watch
//! thread reaps it (`waitpid`, every `probe_ms`) and records how it ended. Its PID (with the
//! process's start time, so a recycled PID is never mistaken for it) goes to a 0600 file in
//! the state directory, and an agent restarted on the host adopts the replicas still running
//! instead of starting second copies; an adopted replica's death is seen when its PID is gone
//! (its exit status went to the agent that started it). An agent that ends leaves its replicas
//! running: traffic does not depend on the agent, and a new agent takes them over.

use crate::config::{AgentSection, SlotConfig};
use pliant_proto::agent::{SlotState, SlotStatus};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

pub fn now_unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// How the agent holds a running replica.
enum Proc {
    None,
    /// Started by this agent: reaped here.
    Child(Child),
    /// Started by an earlier agent: (pid, start time in clock ticks since boot).
    Adopted(u32, u64),
}

struct Slot {
    cfg: SlotConfig,
    state: SlotState,
    proc_: Proc,
    serving: bool,
    since_unix_ms: u64,
    exit: Option<String>,
    deaths: u64,
}

impl Slot {
    fn pid(&self) -> Option<u32> {
        match &self.proc_ {
            Proc::None => None,
            Proc::Child(c) => Some(c.id()),
            Proc::Adopted(p, _) => Some(*p),
        }
    }

    fn status(&self) -> SlotStatus {
        SlotStatus {
            replica: self.cfg.name.clone(),
            state: self.state,
            control: self.cfg.control.display().to_string(),
            serving: self.serving,
            pid: self.pid(),
            since_unix_ms: self.since_unix_ms,
            exit: self.exit.clone(),
            deaths: self.deaths,
        }
    }

    fn set(&mut self, state: SlotState, exit: Option<String>) {
        self.state = state;
        self.exit = exit;
        self.since_unix_ms = now_unix_ms();
        if state != SlotState::Running {
            self.serving = false;
        }
    }
}

/// The host's slots, shared by the watch thread and the request handlers.
pub struct Slots {
    slots: Mutex<Vec<Slot>>,
    /// One start or stop at a time (a start waits for the control socket outside the lock).
    ops: Mutex<()>,
    opts: AgentSection,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[derive(Debug, thiserror::Error)]
pub enum SlotError {
    #[error("no replica {0:?} on this host")]
    Unknown(String),
    #[error("replica {name}: {reason}")]
    Failed { name: String, reason: String },
}

/// A process's start time (field 22 of /proc/PID/stat), if it exists.
fn start_time(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: fields after the last ')'.
    let rest = &s[s.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// A zombie counts as gone (it is dead; only its parent has not reaped it yet).
fn alive(pid: u32, started: u64) -> bool {
    let Ok(s) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let zombie = s
        .rfind(')')
        .and_then(|i| s[i + 1..].split_whitespace().next().map(|st| st == "Z"));
    zombie == Some(false) && start_time(pid) == Some(started)
}

fn describe(st: std::process::ExitStatus) -> String {
    match (st.code(), st.signal()) {
        (Some(c), _) => format!("exit status {c}"),
        (_, Some(s)) => format!("killed by signal {s}"),
        _ => st.to_string(),
    }
}

fn serving(control: &std::path::Path) -> bool {
    std::os::unix::net::UnixStream::connect(control).is_ok()
}

impl Slots {
    /// The configured slots, adopting replicas an earlier agent left running.
    pub fn new(opts: &AgentSection, cfgs: &[SlotConfig]) -> Result<Slots, String> {
        std::fs::create_dir_all(&opts.state_dir)
            .map_err(|e| format!("agent.state_dir {}: {e}", opts.state_dir.display()))?;
        let mut slots = Vec::new();
        for cfg in cfgs {
            let mut s = Slot {
                cfg: cfg.clone(),
                state: SlotState::Stopped,
                proc_: Proc::None,
                serving: false,
                since_unix_ms: now_unix_ms(),
                exit: None,
                deaths: 0,
            };
            let pf = pid_file(opts, &cfg.name);
            if let Some((pid, started)) = read_pid_file(&pf) {
                if alive(pid, started) {
                    tracing::info!(replica = %cfg.name, pid, "adopted a running replica");
                    s.proc_ = Proc::Adopted(pid, started);
                    s.state = SlotState::Running;
                    s.serving = serving(&cfg.control);
                } else {
                    let _ = std::fs::remove_file(&pf);
                }
            }
            slots.push(s);
        }
        Ok(Slots {
            slots: Mutex::new(slots),
            ops: Mutex::new(()),
            opts: opts.clone(),
        })
    }

    pub fn status(&self) -> Vec<SlotStatus> {
        lock(&self.slots).iter().map(Slot::status).collect()
    }

    fn index(&self, name: &str) -> Result<usize, SlotError> {
        lock(&self.slots)
            .iter()
            .position(|s| s.cfg.name == name)
            .ok_or_else(|| SlotError::Unknown(name.into()))
    }

    /// Starts `name` (running already: nothing to do) and waits until it serves its control
    /// socket, dies, or `start_timeout_ms` passes.
    pub fn start(&self, name: &str) -> Result<SlotStatus, SlotError> {
        let _op = lock(&self.ops);
        let i = self.index(name)?;
        let fail = |reason: String| SlotError::Failed {
            name: name.into(),
            reason,
        };
        let cfg = {
            let mut g = lock(&self.slots);
            if g[i].state == SlotState::Running {
                return Ok(g[i].status());
            }
            let cfg = g[i].cfg.clone();
            let child = spawn(&cfg).map_err(&fail)?;
            let pid = child.id();
            match start_time(pid) {
                Some(t) => write_pid_file(&pid_file(&self.opts, name), pid, t)
                    .map_err(|e| fail(format!("pid file: {e}")))?,
                None => tracing::warn!(replica = name, pid, "exited before its pid was recorded"),
            }
            g[i].proc_ = Proc::Child(child);
            g[i].set(SlotState::Running, None);
            tracing::info!(replica = name, pid, "started");
            cfg
        };
        let limit = Duration::from_millis(self.opts.start_timeout_ms);
        let t0 = Instant::now();
        loop {
            let up = serving(&cfg.control);
            {
                let mut g = lock(&self.slots);
                if up && g[i].state == SlotState::Running {
                    g[i].serving = true;
                    return Ok(g[i].status());
                }
                if g[i].state != SlotState::Running {
                    let why = g[i].exit.clone().unwrap_or_default();
                    return Err(fail(format!(
                        "ended before serving its control socket: {why}"
                    )));
                }
            }
            if t0.elapsed() >= limit {
                drop(_op);
                let _ = self.stop(name);
                return Err(fail(format!(
                    "did not serve {} within {} ms (stopped again)",
                    cfg.control.display(),
                    limit.as_millis()
                )));
            }
            std::thread::sleep(Duration::from_millis(self.opts.probe_ms.min(20)));
        }
    }

    /// Stops `name`: SIGTERM to its PID, SIGKILL after the grace period.
    pub fn stop(&self, name: &str) -> Result<SlotStatus, SlotError> {
        let _op = lock(&self.ops);
        let i = self.index(name)?;
        let (pid, started) = {
            let mut g = lock(&self.slots);
            let pid = g[i].pid();
            let started = match &g[i].proc_ {
                Proc::Adopted(_, t) => Some(*t),
                _ => pid.and_then(start_time),
            };
            if g[i].state != SlotState::Running {
                g[i].proc_ = Proc::None;
                g[i].set(SlotState::Stopped, None);
                return Ok(g[i].status());
            }
            // Marked first, so the watch thread records the end as asked for, not a death.
            g[i].state = SlotState::Stopped;
            (pid, started)
        };
        if let (Some(pid), Some(t)) = (pid, started) {
            if alive(pid, t) {
                // SAFETY: kill(2) on a PID this agent runs, checked against its start time.
                unsafe { libc::kill(pid as i32, libc::SIGTERM) };
            }
            let deadline = Instant::now() + Duration::from_millis(self.opts.stop_grace_ms);
            while self.reap_or_alive(i, pid, t) {
                if Instant::now() >= deadline {
                    // SAFETY: as above.
                    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        let _ = std::fs::remove_file(pid_file(&self.opts, name));
        let mut g = lock(&self.slots);
        g[i].proc_ = Proc::None;
        g[i].set(SlotState::Stopped, None);
        tracing::info!(replica = name, "stopped");
        Ok(g[i].status())
    }

    /// Whether slot `i`'s process still runs (reaping it if it is our child and ended).
    fn reap_or_alive(&self, i: usize, pid: u32, started: u64) -> bool {
        let mut g = lock(&self.slots);
        match &mut g[i].proc_ {
            Proc::Child(c) => matches!(c.try_wait(), Ok(None)),
            _ => alive(pid, started),
        }
    }

    /// One watch round: reap children, check adopted PIDs, and every `serve_probe_every`
    /// rounds probe the control sockets. Returns the names of replicas that died this round.
    pub fn watch_once(&self, probe_sockets: bool) -> Vec<String> {
        let mut died = Vec::new();
        let mut g = lock(&self.slots);
        for s in g.iter_mut() {
            let ended = match &mut s.proc_ {
                Proc::None => None,
                Proc::Child(c) => match c.try_wait() {
                    Ok(Some(st)) => Some(describe(st)),
                    Ok(None) => None,
                    Err(e) => Some(format!("wait failed: {e}")),
                },
                Proc::Adopted(pid, t) => (!alive(*pid, *t)).then(|| {
                    "process gone (adopted: its exit status went to an earlier agent)".into()
                }),
            };
            match ended {
                Some(why) if s.state == SlotState::Running => {
                    tracing::warn!(replica = %s.cfg.name, exit = %why, "replica died");
                    s.proc_ = Proc::None;
                    s.deaths += 1;
                    s.set(SlotState::Died, Some(why));
                    let _ = std::fs::remove_file(pid_file(&self.opts, &s.cfg.name));
                    died.push(s.cfg.name.clone());
                }
                Some(_) => {} // a stop in progress reaps it
                None => {
                    if probe_sockets && s.state == SlotState::Running {
                        s.serving = serving(&s.cfg.control);
                    }
                }
            }
        }
        died
    }

    /// Runs [`Slots::watch_once`] every `probe_ms` until `stop`.
    pub fn watch(&self, stop: &AtomicBool) {
        let every = Duration::from_millis(self.opts.probe_ms);
        let mut round = 0u32;
        while !stop.load(Ordering::SeqCst) {
            round = round.wrapping_add(1);
            self.watch_once(round.is_multiple_of(self.opts.serve_probe_every));
            std::thread::sleep(every);
        }
    }
}

/// The replica's process: its own process group (a signal to the agent's terminal does not
/// reach it), output appended to its log, stdin closed.
fn spawn(cfg: &SlotConfig) -> Result<Child, String> {
    let mut c = Command::new(&cfg.command[0]);
    c.args(&cfg.command[1..])
        .stdin(Stdio::null())
        .process_group(0);
    match &cfg.log {
        Some(p) => {
            let f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .mode(0o640)
                .open(p)
                .map_err(|e| format!("log {}: {e}", p.display()))?;
            let f2 = f.try_clone().map_err(|e| format!("log: {e}"))?;
            c.stdout(f).stderr(f2);
        }
        None => {
            c.stdout(Stdio::null()).stderr(Stdio::null());
        }
    }
    c.spawn()
        .map_err(|e| format!("start {}: {e}", cfg.command[0]))
}

fn pid_file(o: &AgentSection, name: &str) -> PathBuf {
    o.state_dir.join(format!("{name}.pid"))
}

fn write_pid_file(p: &std::path::Path, pid: u32, started: u64) -> std::io::Result<()> {
    let tmp = p.with_extension("pid.tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .create_new(true)
        .write(true)
        .mode(0o600)
        .open(&tmp)?;
    std::io::Write::write_all(&mut f, format!("{pid} {started}\n").as_bytes())?;
    std::fs::rename(&tmp, p)
}

fn read_pid_file(p: &std::path::Path) -> Option<(u32, u64)> {
    let s = std::fs::read_to_string(p).ok()?;
    let mut it = s.split_whitespace();
    Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?))
}
