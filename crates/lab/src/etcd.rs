//! A real etcd server for labs and tests (Debian's `etcd-server`), one member, started like the
//! lab's other servers: optionally inside a namespace, its data directory and log under the
//! caller's directory, stopped (by PID) when dropped.
//!
//! It can be killed and restarted on the same data directory, which is how tests take etcd away
//! under load and bring it back with its history.

use crate::cmd;
use crate::error::{io_err, LabError, Result};
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The binary Debian's `etcd-server` installs.
pub const ETCD_BIN: &str = "/usr/bin/etcd";
/// How long a start may take before it is an error (first start creates the WAL: ~1 s here).
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// Where and how to run one etcd member.
#[derive(Clone, Debug)]
pub struct EtcdSpec {
    /// Directory for the data dir (`<dir>/data`) and the log (`<dir>/etcd.log`).
    pub dir: PathBuf,
    /// Network namespace to run in (`None`: the caller's).
    pub netns: Option<String>,
    /// Address the client and peer listeners bind.
    pub addr: IpAddr,
    pub client_port: u16,
    pub peer_port: u16,
}

impl EtcdSpec {
    /// On loopback in the caller's namespace, on two ports free right now (tests).
    pub fn loopback(dir: &Path) -> Result<EtcdSpec> {
        Ok(EtcdSpec {
            dir: dir.to_path_buf(),
            netns: None,
            addr: IpAddr::from([127, 0, 0, 1]),
            client_port: free_port()?,
            peer_port: free_port()?,
        })
    }

    pub fn client_url(&self) -> String {
        format!("http://{}", SocketAddr::new(self.addr, self.client_port))
    }

    fn peer_url(&self) -> String {
        format!("http://{}", SocketAddr::new(self.addr, self.peer_port))
    }
}

fn free_port() -> Result<u16> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(io_err("127.0.0.1:0"))?;
    Ok(l.local_addr().map_err(io_err("127.0.0.1:0"))?.port())
}

/// A running etcd member (killed when dropped).
pub struct EtcdServer {
    pub spec: EtcdSpec,
    child: Option<Child>,
    /// Remove `spec.dir` when dropped (a scratch server of a test).
    scratch: bool,
}

impl EtcdServer {
    /// Starts etcd and waits until it answers a health check.
    pub fn start(spec: EtcdSpec) -> Result<EtcdServer> {
        std::fs::create_dir_all(spec.dir.join("data")).map_err(io_err(&spec.dir))?;
        let mut s = EtcdServer {
            spec,
            child: None,
            scratch: false,
        };
        s.restart()?;
        Ok(s)
    }

    /// A throwaway member on loopback for a test: its directory under the temp dir, named by
    /// `tag` and the PID, removed with the server.
    pub fn scratch(tag: &str) -> Result<EtcdServer> {
        let dir = std::env::temp_dir().join(format!("pliant-etcd-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut s = EtcdServer::start(EtcdSpec::loopback(&dir)?)?;
        s.scratch = true;
        Ok(s)
    }

    /// PID of the running member, if any.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// SIGKILLs the member (what a crash or a lost host does to it); the data stays.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts the member again on its data directory (a no-op if it runs) and waits until it is
    /// healthy.
    pub fn restart(&mut self) -> Result<()> {
        if self.child.is_some() {
            return Ok(());
        }
        let s = &self.spec;
        let data = s.dir.join("data");
        let log_path = s.dir.join("etcd.log");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(io_err(&log_path))?;
        let log2 = log.try_clone().map_err(io_err(&log_path))?;
        let (client, peer) = (s.client_url(), s.peer_url());
        let data_s = data.to_string_lossy().to_string();
        let initial = format!("p1={peer}");
        let args: Vec<&str> = vec![
            ETCD_BIN,
            "--name",
            "p1",
            "--data-dir",
            &data_s,
            "--listen-client-urls",
            &client,
            "--advertise-client-urls",
            &client,
            "--listen-peer-urls",
            &peer,
            "--initial-advertise-peer-urls",
            &peer,
            "--initial-cluster",
            &initial,
            "--initial-cluster-state",
            "new",
            "--log-level",
            "warn",
            "--logger",
            "zap",
        ];
        let argv = match &s.netns {
            Some(ns) => cmd::in_ns(ns, &args),
            None => args.iter().map(|a| a.to_string()).collect(),
        };
        let child = Command::new(&argv[0])
            .args(&argv[1..])
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2)
            .spawn()
            .map_err(|source| LabError::Spawn {
                cmd: cmd::render(&argv),
                source,
            })?;
        self.child = Some(child);
        self.wait_healthy(START_TIMEOUT)
    }

    /// Waits until `etcdctl endpoint health` succeeds (a quorum read, not just an open port).
    pub fn wait_healthy(&mut self, timeout: Duration) -> Result<()> {
        let t0 = Instant::now();
        let url = self.spec.client_url();
        let mut last;
        loop {
            if let Some(c) = self.child.as_mut() {
                if let Ok(Some(st)) = c.try_wait() {
                    self.child = None;
                    return Err(LabError::NotReady {
                        what: "etcd".into(),
                        waited_ms: t0.elapsed().as_millis() as u64,
                        detail: format!("exited ({st}); see {}", self.log().display()),
                    });
                }
            }
            let args = [
                "etcdctl",
                "--endpoints",
                url.as_str(),
                "--dial-timeout",
                "1s",
                "--command-timeout",
                "1s",
                "endpoint",
                "health",
            ];
            let argv = match &self.spec.netns {
                Some(ns) => cmd::in_ns(ns, &args),
                None => args.iter().map(|a| a.to_string()).collect(),
            };
            match cmd::run(&argv, Duration::from_secs(5)) {
                Ok(o) if o.success() => return Ok(()),
                Ok(o) => last = o.stderr.trim().chars().take(200).collect(),
                Err(e) => last = e.to_string(),
            }
            if t0.elapsed() > timeout {
                return Err(LabError::NotReady {
                    what: "etcd".into(),
                    waited_ms: t0.elapsed().as_millis() as u64,
                    detail: last,
                });
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn log(&self) -> PathBuf {
        self.spec.dir.join("etcd.log")
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.kill();
        if self.scratch {
            let _ = std::fs::remove_dir_all(&self.spec.dir);
        }
    }
}
