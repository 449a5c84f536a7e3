//! The Raft thread: one thread owns the `RawNode`, so the library's synchronous API needs no
//! lock. It ticks the clock, steps peer messages, turns the front's client events into
//! proposals, and handles each `Ready`: entries and hard state to the log with one fsync,
//! messages to the transport, committed entries to the applier. A `Ready` that changes only
//! the commit index is not synced (see `on_ready`).
//!
//! Proposals are taken in bulk (everything queued, up to a bound) before each `Ready`, so one
//! fsync and one append round covers many client events under load: the batching.

use crate::front::Sinks;
use crate::log::{Log, LogError};
use crate::transport::Transport;
use raft::prelude::{Entry, Message};
use raft::storage::MemStorage;
use raft::{RawNode, StateRole};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What the Raft thread is handed.
pub enum Input {
    /// A client event from this replica's front (only a leader's front proposes).
    Propose { conn: u64, data: Vec<u8> },
    /// A message from a peer.
    Peer(Message),
    /// Stop the thread.
    Stop,
}

/// What the replica shows of itself (read by the front, the applier, tests and operators).
#[derive(Debug, Default)]
pub struct Status {
    /// The term in which this replica leads, 0 when it does not.
    pub leader_term: AtomicU64,
    /// The leader it knows of (0: none).
    pub leader_id: AtomicU64,
    pub term: AtomicU64,
    pub commit: AtomicU64,
    /// Last entry delivered to the server (set by the applier).
    pub applied: AtomicU64,
    /// Bytes in the durable log.
    pub log_bytes: AtomicU64,
    /// Proposals refused because this replica was not the leader.
    pub dropped_proposals: AtomicU64,
    /// The server could not be reached or fed, or delivery met a gap: this replica's server
    /// no longer follows the log.
    pub server_failed: AtomicBool,
    /// The Raft thread stopped on an error (the log could not be written).
    pub failed: AtomicBool,
}

pub struct Node {
    pub raw: RawNode<MemStorage>,
    pub log: Log,
    pub inbox: Receiver<Input>,
    pub transport: Arc<Transport>,
    pub apply: SyncSender<Vec<Entry>>,
    pub status: Arc<Status>,
    pub sinks: Arc<Sinks>,
    pub tick: Duration,
    /// Inputs taken per round before a `Ready` is handled.
    pub batch: usize,
}

impl Node {
    /// Runs until [`Input::Stop`], the inbox closes, or the log fails.
    pub fn run(mut self) {
        let mut next_tick = Instant::now() + self.tick;
        loop {
            let wait = next_tick.saturating_duration_since(Instant::now());
            match self.inbox.recv_timeout(wait) {
                Ok(Input::Stop) | Err(RecvTimeoutError::Disconnected) => return,
                Ok(i) => {
                    if !self.take(i) {
                        return;
                    }
                    for _ in 1..self.batch {
                        match self.inbox.try_recv() {
                            Ok(i) => {
                                if !self.take(i) {
                                    return;
                                }
                            }
                            Err(_) => break,
                        }
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
            }
            if Instant::now() >= next_tick {
                self.raw.tick();
                next_tick = Instant::now() + self.tick;
            }
            if let Err(e) = self.on_ready() {
                tracing::error!(error = %e, "smr: log write failed; this replica stops");
                self.status.failed.store(true, Ordering::SeqCst);
                self.sinks.shutdown_all();
                return;
            }
            self.publish();
        }
    }

    /// Handles one input; false to stop.
    fn take(&mut self, i: Input) -> bool {
        match i {
            Input::Stop => return false,
            Input::Peer(m) => {
                if let Err(e) = self.raw.step(m) {
                    tracing::debug!(error = %e, "smr: message not stepped");
                }
            }
            Input::Propose { conn, data } => {
                let leads = self.raw.raft.state == StateRole::Leader;
                if !leads || self.raw.propose(Vec::new(), data).is_err() {
                    // Not (or no longer) the leader: the client is cut, it reconnects to the
                    // leader; its events must not reach the log from here.
                    self.status
                        .dropped_proposals
                        .fetch_add(1, Ordering::Relaxed);
                    self.sinks.shutdown(conn);
                }
            }
        }
        true
    }

    fn on_ready(&mut self) -> Result<(), LogError> {
        if !self.raw.has_ready() {
            return Ok(());
        }
        let mut rd = self.raw.ready();
        // A leader's appends may go out before its own fsync (Raft counts its own vote only
        // after the persist below); a follower's acks are in persisted_messages.
        self.transport.send(rd.take_messages());
        if !rd.snapshot().is_empty() {
            // No compaction in this slice, so no member ever sends a snapshot.
            tracing::error!("smr: snapshot received; snapshots are not supported yet");
        }
        self.deliver(rd.take_committed_entries());
        if !rd.entries().is_empty() {
            self.log.append_entries(rd.entries())?;
            if let Err(e) = self.raw.mut_store().wl().append(rd.entries()) {
                tracing::error!(error = %e, "smr: storage append");
            }
        }
        if let Some(hs) = rd.hs() {
            self.log.append_hard_state(hs)?;
            self.raw.mut_store().wl().set_hardstate(hs.clone());
        }
        // Entries, a term or a vote must be on disk before the messages that depend on them
        // go out. A hard state whose only change is the commit index need not be (a commit
        // index lost in a crash is learnt again from the leader; raft says so with
        // `must_sync`): it stays buffered and reaches the disk with the next sync, so
        // committing costs no fsync of its own on the path of every request.
        if rd.must_sync() {
            self.log.sync()?;
        }
        self.status
            .log_bytes
            .store(self.log.len(), Ordering::Relaxed);
        self.transport.send(rd.take_persisted_messages());
        let mut light = self.raw.advance(rd);
        if let Some(c) = light.commit_index() {
            self.raw.mut_store().wl().mut_hard_state().set_commit(c);
        }
        self.transport.send(light.take_messages());
        self.deliver(light.take_committed_entries());
        self.raw.advance_apply();
        Ok(())
    }

    fn deliver(&mut self, entries: Vec<Entry>) {
        if entries.is_empty() {
            return;
        }
        if self.apply.send(entries).is_err() {
            tracing::error!("smr: the applier is gone");
            self.status.server_failed.store(true, Ordering::SeqCst);
        }
    }

    /// Publishes role, term and commit; cuts every client when leadership is lost.
    fn publish(&mut self) {
        let r = &self.raw.raft;
        let leads = r.state == StateRole::Leader;
        let was = self.status.leader_term.load(Ordering::Relaxed);
        let now = if leads { r.term } else { 0 };
        if was != now {
            if was != 0 {
                tracing::info!(term = r.term, "smr: leadership lost; clients cut");
                self.sinks.shutdown_all();
            }
            if now != 0 {
                tracing::info!(term = r.term, id = r.id, "smr: leading");
            }
            self.status.leader_term.store(now, Ordering::SeqCst);
        }
        self.status.leader_id.store(r.leader_id, Ordering::Relaxed);
        self.status.term.store(r.term, Ordering::Relaxed);
        self.status
            .commit
            .store(r.raft_log.committed, Ordering::Relaxed);
    }
}
