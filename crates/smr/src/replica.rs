//! One replica: its durable log, Raft thread, transport, applier, front and server address,
//! started together and stopped together.

use crate::apply::{Applier, Digest, Digests, ServerLimits};
use crate::front::{Front, FrontLimits, FrontStats, Sinks};
use crate::log::{Log, LogError};
use crate::node::{Input, Node, Status};
use crate::transport::{PeerSpec, Transport, TransportLimits, TransportStats};
use pliant_wire::endpoint::Endpoint;
use pliant_wire::server::StartError;
use pliant_wire::Security;
use raft::prelude::ConfState;
use raft::storage::MemStorage;
use raft::RawNode;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// Every bound and period of a replica. The defaults suit a LAN or one host.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Raft clock.
    pub tick: Duration,
    /// Ticks without a leader before a follower campaigns (randomised up to twice this).
    pub election_ticks: usize,
    pub heartbeat_ticks: usize,
    /// Largest append message Raft builds, in bytes.
    pub max_size_per_msg: u64,
    pub max_inflight_msgs: usize,
    /// Inputs taken by the Raft thread per round (one fsync per round at most).
    pub batch: usize,
    /// Depth of the Raft thread's inbox (fronts and peers block when it is full).
    pub inbox: usize,
    /// Committed batches queued for the applier.
    pub apply_queue: usize,
    pub transport: TransportLimits,
    pub front: FrontLimits,
    pub server: ServerLimits,
}

impl Default for Limits {
    fn default() -> Limits {
        let chunk = 16 << 10;
        let max_size_per_msg = 1 << 20;
        Limits {
            tick: Duration::from_millis(50),
            election_ticks: 10,
            heartbeat_ticks: 2,
            max_size_per_msg,
            max_inflight_msgs: 256,
            batch: 1024,
            inbox: 4096,
            apply_queue: 1024,
            transport: TransportLimits {
                // One append of max_size_per_msg plus an entry over it and the envelope.
                max_msg: 2 * max_size_per_msg as usize + (chunk << 1),
                queue: 4096,
                idle: Duration::from_secs(5),
                redial: Duration::from_millis(200),
                connect_timeout: Duration::from_secs(1),
            },
            front: FrontLimits {
                max_clients: 1024,
                chunk,
                idle: Duration::from_secs(300),
                write_timeout: Duration::from_secs(10),
            },
            server: ServerLimits {
                connect_timeout: Duration::from_secs(2),
                write_timeout: Duration::from_secs(10),
                max_digests: 1 << 16,
                reap_every: Duration::from_millis(500),
                order_wait: Duration::from_millis(5),
            },
        }
    }
}

#[derive(Clone)]
pub struct Config {
    /// This replica's Raft id (one of `members`).
    pub id: u64,
    /// Every member, this one included.
    pub members: Vec<PeerSpec>,
    /// Client address (TCP; port 0 picks one).
    pub front: Endpoint,
    /// Where this replica's own server listens (loopback).
    pub server: SocketAddr,
    /// Directory of the durable log.
    pub dir: PathBuf,
    pub security: Security,
    pub limits: Limits,
}

#[derive(Debug, thiserror::Error)]
pub enum ReplicaError {
    #[error("replica {0} is not among the members")]
    NotMember(u64),
    #[error("data directory {dir}: {source}")]
    Dir {
        dir: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Log(#[from] LogError),
    #[error("raft: {0}")]
    Raft(#[from] raft::Error),
    #[error(transparent)]
    Start(#[from] StartError),
    #[error("thread: {0}")]
    Thread(std::io::Error),
}

pub struct Replica {
    pub id: u64,
    status: Arc<Status>,
    digests: Arc<Digests>,
    inbox: mpsc::SyncSender<Input>,
    transport: Arc<Transport>,
    front: Front,
    node: Option<JoinHandle<()>>,
    applier: Option<JoinHandle<()>>,
    sinks: Arc<Sinks>,
    /// Entries found in the log at start (replayed into the server).
    pub recovered: usize,
    /// Bytes of torn tail cut off the log at start.
    pub torn: u64,
}

impl Replica {
    /// Recovers the log, starts every thread. The server at `cfg.server` must be running and
    /// empty: the whole committed log is delivered to it again.
    pub fn start(cfg: Config) -> Result<Replica, ReplicaError> {
        let me = cfg
            .members
            .iter()
            .find(|p| p.id == cfg.id)
            .cloned()
            .ok_or(ReplicaError::NotMember(cfg.id))?;
        std::fs::create_dir_all(&cfg.dir).map_err(|source| ReplicaError::Dir {
            dir: cfg.dir.clone(),
            source,
        })?;
        let l = &cfg.limits;
        let max_record = l.transport.max_msg;
        let (log, rec) = Log::open(&cfg.dir.join("raft.log"), max_record)?;
        let voters: Vec<u64> = cfg.members.iter().map(|p| p.id).collect();
        let store = MemStorage::new_with_conf_state(ConfState::from((voters, vec![])));
        let (recovered, torn) = (rec.entries.len(), rec.truncated);
        if !rec.entries.is_empty() {
            store.wl().append(&rec.entries)?;
        }
        if let Some(hs) = rec.hard_state {
            store.wl().set_hardstate(hs);
        }
        let rcfg = raft::Config {
            id: cfg.id,
            election_tick: l.election_ticks,
            heartbeat_tick: l.heartbeat_ticks,
            // The server restarts empty: every committed entry is delivered again.
            applied: 0,
            max_size_per_msg: l.max_size_per_msg,
            max_inflight_msgs: l.max_inflight_msgs,
            check_quorum: true,
            pre_vote: true,
            ..Default::default()
        };
        rcfg.validate()?;
        let logger = crate::rlog::logger().new(slog::o!("replica" => cfg.id));
        let raw = RawNode::new(&rcfg, store, &logger)?;

        let status = Arc::new(Status::default());
        status.log_bytes.store(log.len(), Ordering::Relaxed);
        let sinks = Arc::new(Sinks::default());
        let digests = Arc::new(Digests::default());
        let (inbox_tx, inbox_rx) = mpsc::sync_channel(l.inbox);
        let (apply_tx, apply_rx) = mpsc::sync_channel(l.apply_queue);
        let transport = Arc::new(Transport::start(
            &me,
            &cfg.members,
            &cfg.security,
            &l.transport,
            inbox_tx.clone(),
        )?);
        let applier = Applier {
            server: cfg.server,
            limits: l.server.clone(),
            entries: apply_rx,
            inbox: inbox_tx.clone(),
            status: status.clone(),
            sinks: sinks.clone(),
            digests: digests.clone(),
        };
        let applier = std::thread::Builder::new()
            .name(format!("smr-apply-{}", cfg.id))
            .spawn(move || applier.run())
            .map_err(ReplicaError::Thread)?;
        let node = Node {
            raw,
            log,
            inbox: inbox_rx,
            transport: transport.clone(),
            apply: apply_tx,
            status: status.clone(),
            sinks: sinks.clone(),
            tick: l.tick,
            batch: l.batch,
        };
        let (st, sk) = (status.clone(), sinks.clone());
        let node = std::thread::Builder::new()
            .name(format!("smr-raft-{}", cfg.id))
            .spawn(move || {
                // raft panics on what it takes for a broken invariant (a replica that lost
                // entries it acknowledged): this replica stops serving, the others go on.
                let run = std::panic::AssertUnwindSafe(|| node.run());
                if std::panic::catch_unwind(run).is_err() {
                    st.failed.store(true, Ordering::SeqCst);
                    st.leader_term.store(0, Ordering::SeqCst);
                    sk.shutdown_all();
                }
            })
            .map_err(ReplicaError::Thread)?;
        let front = Front::start(
            &cfg.front,
            &cfg.security.tcp,
            l.front.clone(),
            status.clone(),
            sinks.clone(),
            inbox_tx.clone(),
        )?;
        Ok(Replica {
            id: cfg.id,
            status,
            digests,
            inbox: inbox_tx,
            transport,
            front,
            node: Some(node),
            applier: Some(applier),
            sinks,
            recovered,
            torn,
        })
    }

    pub fn status(&self) -> &Status {
        &self.status
    }

    pub fn is_leader(&self) -> bool {
        self.status.leader_term.load(Ordering::SeqCst) != 0
    }

    /// The Raft thread stopped on an error, or the server no longer follows the log.
    pub fn is_failed(&self) -> bool {
        self.status.failed.load(Ordering::SeqCst)
            || self.status.server_failed.load(Ordering::SeqCst)
    }

    pub fn applied(&self) -> u64 {
        self.status.applied.load(Ordering::Acquire)
    }

    pub fn commit(&self) -> u64 {
        self.status.commit.load(Ordering::Relaxed)
    }

    /// Where clients connect.
    pub fn front(&self) -> Option<Endpoint> {
        self.front.endpoint()
    }

    pub fn front_stats(&self) -> &FrontStats {
        &self.front.stats
    }

    pub fn transport_stats(&self) -> &TransportStats {
        &self.transport.stats
    }

    /// Output digests of the server's connections, by connection id.
    pub fn digests(&self) -> BTreeMap<u64, Digest> {
        self.digests.snapshot()
    }

    /// Stops everything this replica runs (not its server: the caller owns that).
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.front.stop();
        self.sinks.shutdown_all();
        let _ = self.inbox.try_send(Input::Stop);
        if let Some(t) = self.node.take() {
            // The inbox may be full: the Raft thread also ends when every sender is gone,
            // but the applier holds one; a blocking send is the sure way.
            if !t.is_finished() {
                let _ = self.inbox.send(Input::Stop);
            }
            let _ = t.join();
        }
        self.transport.stop();
        if let Some(t) = self.applier.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        self.shutdown();
    }
}
