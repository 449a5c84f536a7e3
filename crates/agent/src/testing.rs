//! Test helpers for agents in-process (this crate's tests and the controller's): a stand-in
//! replica slot (a python3 process serving a unix socket, as a replica serves its control
//! socket) and a running agent that ends with its test.

use crate::config::{AgentConfig, SlotConfig};
use pliant_wire::Endpoint;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The stand-in replica: binds the unix socket named by its argument (replacing a dead one's
/// file, as a replica does) and accepts and closes connections until killed.
const FAKE_REPLICA: &str = "import os,socket,sys\n\
if os.path.exists(sys.argv[1]): os.unlink(sys.argv[1])\n\
s=socket.socket(socket.AF_UNIX)\n\
s.bind(sys.argv[1]); s.listen(16)\n\
while True:\n    c,_=s.accept(); c.close()\n";

/// Slot `name` running a stand-in replica whose control socket is `dir/<name>.sock`.
pub fn fake_slot(dir: &Path, name: &str, log: Option<PathBuf>) -> SlotConfig {
    let sock = dir.join(format!("{name}.sock"));
    SlotConfig {
        name: name.into(),
        command: vec![
            "/usr/bin/python3".into(),
            "-c".into(),
            FAKE_REPLICA.into(),
            sock.display().to_string(),
        ],
        control: sock,
        log,
    }
}

/// An agent running on a thread of the test. Dropped: the agent stops, and the replicas it
/// started (its PID files) are killed — a real agent leaves them running, a test must not,
/// also when it fails half-way — unless `leave_replicas` is set.
pub struct RunningAgent {
    pub leave_replicas: bool,
    pub ep: Endpoint,
    state_dir: PathBuf,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<Result<(), String>>>,
}

impl RunningAgent {
    /// Starts an agent on `cfg` and waits until it listens.
    pub fn start(cfg: AgentConfig) -> RunningAgent {
        RunningAgent::start_with(cfg, None)
    }

    /// [`RunningAgent::start`] holding `fabric` as the fabric's steering.
    pub fn start_with(
        cfg: AgentConfig,
        fabric: Option<Arc<crate::fabric::Fabric>>,
    ) -> RunningAgent {
        cfg.check().unwrap();
        let state_dir = cfg.agent.state_dir.clone();
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = std::sync::mpsc::channel();
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            crate::run_with(
                &cfg,
                &s,
                |ep| {
                    let _ = tx.send(ep.clone());
                },
                fabric,
            )
        });
        let ep = rx.recv_timeout(Duration::from_secs(10)).expect("agent up");
        RunningAgent {
            leave_replicas: false,
            ep,
            state_dir,
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for RunningAgent {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        if self.leave_replicas {
            return;
        }
        if let Ok(files) = std::fs::read_dir(&self.state_dir) {
            for f in files.flatten() {
                let text = std::fs::read_to_string(f.path()).unwrap_or_default();
                if let Some(pid) = text.split_whitespace().next().and_then(|p| p.parse().ok()) {
                    // SAFETY: SIGKILL to a process this test's agent started (its PID file).
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
            }
        }
    }
}
