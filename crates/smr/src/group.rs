//! A group of replicas in one process, each with its own server child on a loopback port:
//! what the tests, the benchmark example and (later) `pliant smr up` start. The group makes its
//! own CA and identities; peers talk over unix sockets in the group's directory or TCP
//! loopback. Dropping the group stops every replica and kills every server by its PID.

use crate::child::{ChildError, ServerChild};
use crate::{Config, Limits, PeerSpec, Replica, ReplicaError};
use pliant_wire::endpoint::Endpoint;
use pliant_wire::{role, Ca, IdentityError, Security};
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The server's command line for a loopback port.
pub type ServerArgv = Box<dyn Fn(u16) -> Vec<String> + Send>;

#[derive(Debug, thiserror::Error)]
pub enum GroupError {
    #[error("group directory {dir}: {source}")]
    Dir {
        dir: PathBuf,
        source: std::io::Error,
    },
    #[error("identity: {0}")]
    Identity(#[from] IdentityError),
    #[error("server: {0}")]
    Server(#[from] ChildError),
    #[error("replica: {0}")]
    Replica(#[from] ReplicaError),
    #[error("no free loopback port: {0}")]
    Port(std::io::Error),
    #[error("no single leader within {0:?}")]
    NoLeader(Duration),
}

pub struct LocalGroup {
    pub dir: PathBuf,
    ca: Ca,
    members: Vec<PeerSpec>,
    argv: ServerArgv,
    replicas: Vec<Option<Replica>>,
    servers: Vec<Option<ServerChild>>,
    pub limits: Limits,
    /// How long a server may take to accept on its port.
    pub server_ready: Duration,
    /// Leave the directory (logs) behind when the group is dropped, for a post-mortem.
    pub keep_dir: bool,
}

/// A loopback port nobody listens on now (bound and released; another process could take it
/// before the server does, which the server's start then reports).
pub fn free_port() -> Result<u16, GroupError> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(GroupError::Port)
}

impl LocalGroup {
    /// Starts `n` replicas (ids 1..=n) under `dir` (created; its old content removed).
    pub fn start(
        dir: PathBuf,
        n: u64,
        tcp_peers: bool,
        limits: Limits,
        argv: ServerArgv,
    ) -> Result<LocalGroup, GroupError> {
        let mut g = LocalGroup::new(dir, n, tcp_peers, limits, argv)?;
        for id in 1..=n {
            g.start_replica(id)?;
        }
        Ok(g)
    }

    /// The group of [`LocalGroup::start`] with no replica started yet (to change
    /// `server_ready` first; then [`LocalGroup::start_replica`] each id).
    pub fn new(
        dir: PathBuf,
        n: u64,
        tcp_peers: bool,
        limits: Limits,
        argv: ServerArgv,
    ) -> Result<LocalGroup, GroupError> {
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|source| GroupError::Dir {
            dir: dir.clone(),
            source,
        })?;
        let mut members = Vec::new();
        for id in 1..=n {
            let endpoint = if tcp_peers {
                Endpoint::Tcp(format!("127.0.0.1:{}", free_port()?))
            } else {
                Endpoint::Unix(dir.join(format!("peer-{id}.sock")))
            };
            members.push(PeerSpec {
                id,
                name: format!("smr-{id}"),
                endpoint,
            });
        }
        Ok(LocalGroup {
            dir,
            ca: Ca::generate(None)?,
            members,
            argv,
            replicas: (0..n).map(|_| None).collect(),
            servers: (0..n).map(|_| None).collect(),
            limits,
            server_ready: Duration::from_secs(10),
            keep_dir: false,
        })
    }

    /// Starts (or restarts, on its log) replica `id` with a fresh, empty server.
    pub fn start_replica(&mut self, id: u64) -> Result<(), GroupError> {
        let i = id as usize - 1;
        let port = free_port()?;
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let server = ServerChild::spawn(&(self.argv)(port), addr, self.server_ready)?;
        let identity = self.ca.issue(&format!("smr-{id}"), role::REPLICA, 86_400)?;
        let r = Replica::start(Config {
            id,
            members: self.members.clone(),
            front: Endpoint::Tcp("127.0.0.1:0".into()),
            server: addr,
            dir: self.dir.join(format!("r{id}")),
            security: Security::new(identity),
            limits: self.limits.clone(),
        })?;
        self.servers[i] = Some(server);
        self.replicas[i] = Some(r);
        Ok(())
    }

    /// SIGKILLs replica `id`'s server and stops its Raft node, transport and front.
    pub fn kill(&mut self, id: u64) {
        if let Some(mut s) = self.servers[id as usize - 1].take() {
            s.kill();
        }
        if let Some(r) = self.replicas[id as usize - 1].take() {
            r.stop();
        }
    }

    pub fn replica(&self, id: u64) -> Option<&Replica> {
        self.replicas.get(id as usize - 1)?.as_ref()
    }

    pub fn live(&self) -> impl Iterator<Item = &Replica> {
        self.replicas.iter().flatten()
    }

    /// Where replica `id`'s server listens, while it runs.
    pub fn server_addr(&self, id: u64) -> Option<SocketAddr> {
        Some(self.servers.get(id as usize - 1)?.as_ref()?.addr)
    }

    /// The one live leader, once there is exactly one.
    pub fn wait_leader(&self, within: Duration) -> Result<u64, GroupError> {
        let t0 = Instant::now();
        loop {
            let leaders: Vec<u64> = self
                .live()
                .filter(|r| r.is_leader())
                .map(|r| r.id)
                .collect();
            if leaders.len() == 1 {
                return Ok(leaders[0]);
            }
            if t0.elapsed() > within {
                return Err(GroupError::NoLeader(within));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Replica `id`'s client address (`host:port`).
    pub fn front_addr(&self, id: u64) -> Option<String> {
        match self.replica(id)?.front()? {
            Endpoint::Tcp(a) => Some(a),
            Endpoint::Unix(_) => None,
        }
    }

    /// Whether every live replica has applied everything committed and none failed.
    pub fn converged(&self) -> bool {
        let commit = self.live().map(|r| r.commit()).max().unwrap_or(0);
        self.live()
            .all(|r| !r.is_failed() && r.applied() >= commit && r.commit() == commit)
    }
}

impl Drop for LocalGroup {
    fn drop(&mut self) {
        for r in self.replicas.iter_mut() {
            if let Some(r) = r.take() {
                r.stop();
            }
        }
        for s in self.servers.iter_mut() {
            if let Some(mut s) = s.take() {
                s.kill();
            }
        }
        if !self.keep_dir {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}
