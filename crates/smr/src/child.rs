//! The unmodified server of a replica as a child process: started with its command line,
//! awaited until it accepts on its port, and killed by its own PID (never by name) when the
//! handle is dropped, so a failing test or a stopped replica leaves no server behind.

use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[derive(Debug, thiserror::Error)]
pub enum ChildError {
    #[error("starting {program}: {source}")]
    Spawn {
        program: String,
        source: std::io::Error,
    },
    #[error("{program} exited before accepting on {addr}: {status}")]
    Exited {
        program: String,
        addr: SocketAddr,
        status: std::process::ExitStatus,
    },
    #[error("{program} did not accept on {addr} within {waited:?}")]
    NotReady {
        program: String,
        addr: SocketAddr,
        waited: Duration,
    },
}

pub struct ServerChild {
    child: Option<Child>,
    pub addr: SocketAddr,
}

impl ServerChild {
    /// Runs `argv` (its output discarded) and waits up to `ready` for `addr` to accept.
    pub fn spawn(argv: &[String], addr: SocketAddr, ready: Duration) -> Result<Self, ChildError> {
        let program = argv.first().cloned().unwrap_or_default();
        let child = Command::new(&program)
            .args(&argv[1..])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|source| ChildError::Spawn {
                program: program.clone(),
                source,
            })?;
        let mut me = ServerChild {
            child: Some(child),
            addr,
        };
        let t0 = Instant::now();
        loop {
            if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
                return Ok(me);
            }
            if let Some(Ok(Some(status))) = me.child.as_mut().map(|c| c.try_wait()) {
                me.child = None;
                return Err(ChildError::Exited {
                    program,
                    addr,
                    status,
                });
            }
            if t0.elapsed() > ready {
                return Err(ChildError::NotReady {
                    program,
                    addr,
                    waited: ready,
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// SIGKILL and reap (idempotent).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for ServerChild {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The command line of a `redis-server` with no persistence of its own (the log is the
/// durable state) listening on loopback only.
pub fn redis_argv(program: &str, port: u16) -> Vec<String> {
    [
        program,
        "--port",
        &port.to_string(),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--enable-debug-command",
        "local",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}
