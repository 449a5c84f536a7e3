//! Session replication with output commit (Pico's, applied to a kernel socket): the sessions
//! of a primary instance survive its death (SIGKILL included) on a backup instance, with no
//! reset and nothing the client was told lost.
//!
//! ```text
//!   primary                                          backup (same host, same namespace)
//!   accept; SO_LINGER {on, 0}; observe the socket    owns the output-commit maps (hold)
//!   (repair on, capture, repair off: nothing sent)
//!   Protect(slice: the kernel capsule + app)    ->   covered = (write_seq, rcv_nxt): from now
//!                                               <-   Applied    on its output is held back
//!   the session runs; after every read:
//!   Checkpoint(id, app, bytes read, new output, ->   keeps the output the client has not
//!              bytes the client acknowledged)        acknowledged, the app, the counts;
//!                                                    covered marks forward: the output they
//!                                                    cover is written back, in order
//!   Ended(id) (the session ended or moved away) ->   queued output flushed, session forgotten
//!   Goodbye (stopping on purpose)               ->   nothing to take over
//!
//!   the channel ends without Goodbye: the primary is dead
//!                                                    hold the client's segments of every
//!                                                    session; end output commit (its queued
//!                                                    output dropped: sent again below);
//!                                                    restore each socket from the newest
//!                                                    checkpoint, repair off, run the session
//!                                                    with the unacknowledged output as its
//!                                                    first output; audit; release the hold
//! ```
//! **Output commit.** Every segment the primary's kernel sends on a protected session passes
//! the backup's tc program (bpf/slice_hold.bpf.c, `commit_output`), which lets it out only if
//! every byte it carries is in the backup's copy (`seq + len <= covered_seq`) and everything it
//! acknowledges is in the backup's state (`ack <= covered_ack`); otherwise it is queued and
//! written back once a checkpoint covers it. A checkpoint is taken after the application
//! consumed input and before its output is written, so the output is covered by the time
//! the kernel sends it, or a round trip to the backup later. No timing assumption: a segment
//! leaves because the backup holds what it depends on. A RST never leaves: the one the dying
//! primary's kernel sends (SO_LINGER 0 frees the 4-tuple at once, so the backup can restore
//! the connection) is dropped.
//!
//! **Input.** The program also copies every client segment that carries input to the queue;
//! the backup keeps the copies its checkpoints do not cover yet and writes them to the
//! restored socket at a takeover, so the client need not retransmit what the dead primary
//! acknowledged to no one. A client segment that finds no socket at all (the primary died, the
//! backup has not restored yet) is queued rather than answered with a RST.
//!
//! **Why the backup can take over.** The client has received only covered output, so
//! everything it lacks is in the backup's copy (from the last acknowledged byte the primary
//! reported, which is at or before the client's); the backup sends all of that again as new
//! data and the client drops what it already has. The client's input was acknowledged only up
//! to what the backup's application state has consumed (or holds unread), so anything beyond
//! is retransmitted by the client. The timestamp clock is the primary's, advanced by the time
//! since it was read (one host, one monotonic clock).
//!
//! **Audit.** While it holds the client's segments at the takeover, the backup reads the
//! acknowledgment they carry (the client's own word for how much output it received, the
//! answer to the restored socket's window probe among them) and counts any beyond the output
//! it held: `commit_violations`, 0 unless output leaked.
//!
//! Steady state costs no repair mode: the primary learns the sequence numbers once, when the
//! session starts (`repair::observe`), and counts bytes from there; SIOCOUTQ tells what the
//! client acknowledged.

use crate::capsule::{Slice, TcpCapsule, TcpWindow};
use crate::format;
use crate::instance::{Frozen, Inner, SessionApp};
use crate::migrate::{recv, restore_when_free, send, ToDest, ToSource};
use crate::repair;
use pliant_wire::frame::FrameError;
use pliant_wire::{Conn, Endpoint};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, VecDeque};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One replication update, primary -> backup.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum Update {
    /// A new session's connection, before anything of it is read from the kernel: from here
    /// its output is held back entirely (nothing is covered yet), so not even an
    /// acknowledgment of input leaves before the backup holds that input.
    Guard {
        id: u64,
        local: SocketAddr,
        remote: SocketAddr,
    },
    /// The guarded session's kernel capsule as it started (nothing written yet) and its
    /// application's initial state, encoded as a [`Slice`] (versioned, checked).
    Protect(Vec<u8>),
    /// The session's state after it consumed `read` bytes in all: its application capsule,
    /// the output produced since the last checkpoint, and how many output bytes the client has
    /// acknowledged (all counted from the session's start).
    Checkpoint {
        id: u64,
        app: Vec<u8>,
        read: u64,
        produced: Vec<u8>,
        acked: u64,
        /// The socket's windows now (`None`: unknown, the start's are used).
        windows: Option<(u32, u32)>,
    },
    /// The session ended, or left this pair (moved to another instance).
    Ended(u64),
}

/// Bound of one replication frame's updates (a frame carries several).
const BATCH_BYTES: usize = 1 << 20;
/// How long a new session waits for the backup to protect it.
const PROTECT_TIMEOUT: Duration = Duration::from_secs(3);

/// Counters of replication, both roles.
#[derive(Debug, Default)]
pub struct RepStats {
    /// Primary: sessions the backup protects / sessions that run unprotected (the backup
    /// refused or was gone).
    pub protected: AtomicU64,
    pub unprotected: AtomicU64,
    /// Primary: checkpoints sent, frames (batches) acknowledged.
    pub checkpoints: AtomicU64,
    pub batches: AtomicU64,
    /// Primary: the backup channel broke.
    pub backup_lost: AtomicU64,
    /// Backup: updates applied, failovers done, sessions taken over / lost in one.
    pub applied: AtomicU64,
    pub failovers: AtomicU64,
    pub taken_over: AtomicU64,
    pub takeover_failed: AtomicU64,
    /// Backup: client acknowledgments beyond the output the backup held (output that leaked
    /// past output commit); must stay 0.
    pub commit_violations: AtomicU64,
    /// Backup: the last failover, primary's death seen -> every session served (µs).
    pub last_failover_us: AtomicU64,
}

impl RepStats {
    /// `key=value` pairs of every counter, with output commit's (`commit_*`) when given.
    pub fn line(&self, commit: Option<crate::hold::CommitStats>) -> String {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut l = format!(
            "protected={} unprotected={} checkpoints={} batches={} backup_lost={} applied={} \
             failovers={} taken_over={} takeover_failed={} commit_violations={} \
             last_failover_us={}",
            g(&self.protected),
            g(&self.unprotected),
            g(&self.checkpoints),
            g(&self.batches),
            g(&self.backup_lost),
            g(&self.applied),
            g(&self.failovers),
            g(&self.taken_over),
            g(&self.takeover_failed),
            g(&self.commit_violations),
            g(&self.last_failover_us),
        );
        if let Some(c) = commit {
            l.push_str(&format!(
                " commit_protected={} commit_passed={} commit_released={} commit_dropped={} \
                 commit_resets={} commit_over={} commit_orphans={} commit_mirrored={}",
                c.protected,
                c.passed,
                c.released,
                c.dropped,
                c.resets,
                c.over_limit,
                c.orphans,
                c.mirrored
            ));
        }
        l
    }
}

/// The value of `key` in a `key=value` line such as [`RepStats::line`]'s.
pub fn field(line: &str, key: &str) -> Option<u64> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('=')?.parse().ok())
}

enum Msg {
    Update(Update),
    /// An update whose application the caller waits for (`true`: applied).
    Sync(Update, mpsc::SyncSender<bool>),
}

/// The byte counts of one replicated session, kept by its session thread (they outlive a
/// freeze: a session resumed after a failed move goes on counting).
#[derive(Debug)]
pub(crate) struct Counts {
    pub read: AtomicU64,
    pub written: AtomicU64,
    /// What the last checkpoint covered: bytes read, bytes produced (written + pending).
    pub ckpt_read: AtomicU64,
    pub ckpt_produced: AtomicU64,
}

/// The primary's side: a sender thread owning the channel to the backup.
pub(crate) struct Replicator {
    tx: Mutex<Option<mpsc::Sender<Msg>>>,
    alive: Arc<AtomicBool>,
    sessions: Mutex<HashMap<u64, Arc<Counts>>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Replicator {
    /// Dials the backup (authenticated like a move's destination) and starts the sender.
    pub(crate) fn start<A: SessionApp>(
        inner: &Inner<A>,
        backup: &Endpoint,
        backup_name: &str,
        stats: Arc<RepStats>,
    ) -> Result<Replicator, String> {
        let conn = crate::migrate::connect(inner, backup, backup_name)
            .map_err(|e| format!("replication channel to {backup_name} at {backup}: {e}"))?;
        let (tx, rx) = mpsc::channel();
        let alive = Arc::new(AtomicBool::new(true));
        let a = alive.clone();
        let thread = std::thread::Builder::new()
            .name("slice-replicate".into())
            .spawn(move || sender(conn, rx, &a, &stats))
            .map_err(|e| format!("replication thread: {e}"))?;
        Ok(Replicator {
            tx: Mutex::new(Some(tx)),
            alive,
            sessions: Mutex::new(HashMap::new()),
            thread: Mutex::new(Some(thread)),
        })
    }

    fn post(&self, m: Msg) {
        if let Some(tx) = lock(&self.tx).as_ref() {
            let _ = tx.send(m);
        }
    }

    fn sync(&self, u: Update, timeout: Duration) -> bool {
        if !self.alive.load(Ordering::SeqCst) {
            return false;
        }
        let (tx, rx) = mpsc::sync_channel(1);
        self.post(Msg::Sync(u, tx));
        rx.recv_timeout(timeout).unwrap_or(false)
    }

    /// Protects a session that has not written anything yet: observes its socket and waits
    /// for the backup to hold its output back. `None`: it runs unprotected (why is logged).
    pub(crate) fn protect(&self, id: u64, sock: &TcpStream, app: Vec<u8>) -> Option<Arc<Counts>> {
        let unprotected = |why: &str| {
            tracing::warn!(session = id, %why, "a new session runs unprotected");
            let _ = repair::set_linger_reset(sock, false);
            None
        };
        let (local, remote) = match (sock.local_addr(), sock.peer_addr()) {
            (Ok(l), Ok(r)) => (l, r),
            _ => return unprotected("its addresses are unknown"),
        };
        if let Err(e) = repair::set_linger_reset(sock, true) {
            return unprotected(&e.to_string());
        }
        // The guard first (one round trip): what the kernel acknowledges from now on stays
        // here until the backup holds it.
        if !self.sync(Update::Guard { id, local, remote }, PROTECT_TIMEOUT) {
            return unprotected("the backup did not guard it");
        }
        let tcp = match repair::observe(sock) {
            Ok(t) => t,
            Err(e) => {
                self.post(Msg::Update(Update::Ended(id)));
                return unprotected(&format!("observing its socket: {e}"));
            }
        };
        let counts = Arc::new(Counts {
            read: AtomicU64::new(0),
            written: AtomicU64::new(0),
            ckpt_read: AtomicU64::new(0),
            ckpt_produced: AtomicU64::new(0),
        });
        let slice = format::encode(&Slice {
            session_id: id,
            tcp,
            pending_out: Vec::new(),
            app,
        });
        // In order ahead of the session's first checkpoint: no need to wait.
        self.post(Msg::Update(Update::Protect(slice)));
        lock(&self.sessions).insert(id, counts.clone());
        Some(counts)
    }

    /// The counts of a protected session (a resumed session finds its own).
    pub(crate) fn counts(&self, id: u64) -> Option<Arc<Counts>> {
        lock(&self.sessions).get(&id).cloned()
    }

    pub(crate) fn checkpoint(&self, u: Update) {
        self.post(Msg::Update(u));
    }

    /// The sessions end here (ended, or moved away); `wait`: until the backup has let go of
    /// their output (a move: the destination's socket sends on the same 4-tuples). Updates
    /// are applied in order, so waiting for the last one waits for all.
    pub(crate) fn ended(&self, ids: &[u64], wait: bool) {
        let mine: Vec<u64> = {
            let mut s = lock(&self.sessions);
            ids.iter()
                .filter(|id| s.remove(id).is_some())
                .copied()
                .collect()
        };
        let Some((last, rest)) = mine.split_last() else {
            return;
        };
        for id in rest {
            self.post(Msg::Update(Update::Ended(*id)));
        }
        if wait {
            self.sync(Update::Ended(*last), PROTECT_TIMEOUT);
        } else {
            self.post(Msg::Update(Update::Ended(*last)));
        }
    }
}

impl Drop for Replicator {
    fn drop(&mut self) {
        // The sender sends Goodbye once every update before it went.
        drop(lock(&self.tx).take());
        if let Some(t) = lock(&self.thread).take() {
            let _ = t.join();
        }
    }
}

fn size_of_update(u: &Update) -> usize {
    match u {
        Update::Guard { .. } => 64,
        Update::Protect(b) => b.len(),
        Update::Checkpoint { app, produced, .. } => app.len() + produced.len() + 32,
        Update::Ended(_) => 8,
    }
}

/// The sender: batches whatever updates are waiting into one frame, one frame in flight.
fn sender(mut conn: Conn, rx: mpsc::Receiver<Msg>, alive: &AtomicBool, stats: &RepStats) {
    let mut pending: Option<Msg> = None;
    loop {
        let first = match pending.take() {
            Some(m) => m,
            None => match rx.recv() {
                Ok(m) => m,
                Err(_) => {
                    if alive.load(Ordering::SeqCst) {
                        let _ = send(&mut conn, &ToDest::Goodbye);
                    }
                    return;
                }
            },
        };
        let mut batch = Vec::new();
        let mut waiters = Vec::new();
        let mut bytes = 0;
        let mut add = |m: Msg, batch: &mut Vec<Update>| match m {
            Msg::Update(u) => batch.push(u),
            Msg::Sync(u, w) => {
                batch.push(u);
                waiters.push(w);
            }
        };
        add(first, &mut batch);
        while bytes < BATCH_BYTES {
            match rx.try_recv() {
                Ok(m) => {
                    bytes += match &m {
                        Msg::Update(u) | Msg::Sync(u, _) => size_of_update(u),
                    };
                    add(m, &mut batch);
                }
                Err(_) => break,
            }
        }
        if bytes >= BATCH_BYTES {
            pending = rx.try_recv().ok();
        }
        if !alive.load(Ordering::SeqCst) {
            for w in waiters {
                let _ = w.send(false);
            }
            continue;
        }
        let n = batch
            .iter()
            .filter(|u| matches!(u, Update::Checkpoint { .. }))
            .count();
        let ok = match send(&mut conn, &ToDest::Replicate(batch))
            .and_then(|_| recv::<ToSource>(&mut conn))
        {
            Ok(ToSource::Applied) => true,
            Ok(other) => {
                tracing::error!(answer = ?other, "backup refused replication updates");
                false
            }
            Err(e) => {
                tracing::error!(error = %e, "replication channel to the backup broke: sessions run unprotected");
                false
            }
        };
        if ok {
            stats.checkpoints.fetch_add(n as u64, Ordering::Relaxed);
            stats.batches.fetch_add(1, Ordering::Relaxed);
        } else if alive.swap(false, Ordering::SeqCst) {
            stats.backup_lost.fetch_add(1, Ordering::Relaxed);
        }
        for w in waiters {
            let _ = w.send(ok);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The backup's side.

/// Restored timestamp clocks run this much ahead of the primary's: with the clock only
/// advanced by the time since it was read, clients rejected the restored sockets' first
/// segments as old (PAWS, `PAWSEstab` +1 or +2 per failover of 200 sessions; none with it).
const TS_MARGIN_MS: u64 = 2;

/// What the backup holds of one session.
struct Replica {
    /// The kernel capsule from the session's start (addresses, options, windows, timestamp
    /// clock, the unread input it had then).
    base: TcpCapsule,
    app: Vec<u8>,
    read: u64,
    acked: u64,
    /// Output bytes from `acked` to everything produced.
    out: VecDeque<u8>,
    /// When the last update for it came (the backup's count of updates).
    last_update: u64,
    /// The primary socket's (snd_wnd, rcv_wnd) at the last checkpoint.
    windows: Option<(u32, u32)>,
}

impl Replica {
    /// The restored socket's windows. The primary's, as its last checkpoint saw them, with the
    /// receive window doubled: it starts at `covered_ack`, maybe before the primary's
    /// `rcv_nxt`, and the client may send up to the primary's right edge; a segment beyond
    /// the restored socket's would be dropped (with the window of the session's start, input
    /// in flight of 110 KB met a 64 KB window). Offering more than was offered is allowed.
    fn window(&self, rcv: u32) -> TcpWindow {
        let b = &self.base.window;
        let (snd_wnd, rcv_wnd) = self.windows.unwrap_or((b.snd_wnd, b.rcv_wnd));
        let rcv_shift = self.base.options.wscale.map_or(0, |(_, r)| r);
        let rcv_max = 65535u32 << rcv_shift.min(14);
        TcpWindow {
            snd_wl1: rcv,
            snd_wnd,
            max_window: b.max_window.max(snd_wnd),
            rcv_wnd: rcv_wnd.max(b.rcv_wnd).saturating_mul(2).min(rcv_max),
            rcv_wup: rcv,
        }
    }

    fn produced(&self) -> u64 {
        self.acked + self.out.len() as u64
    }

    fn tuple(&self) -> (SocketAddr, SocketAddr) {
        (self.base.local, self.base.remote)
    }

    /// Output the backup holds ends here.
    fn covered_seq(&self) -> u32 {
        self.base.send_seq.wrapping_add(self.produced() as u32)
    }

    /// Input the backup holds (consumed by the application, or unread from the start's
    /// capsule) ends here.
    fn covered_ack(&self) -> u32 {
        let consumed = self.base.recv_copied().wrapping_add(self.read as u32);
        if crate::hold::seq_ge(consumed, self.base.recv_seq) {
            consumed
        } else {
            self.base.recv_seq
        }
    }

    /// The kernel capsule to restore from: nothing in flight, the receive queue what the start's
    /// capsule had that the application has not consumed.
    ///
    /// `client_has`: output the client is known to have received (the highest acknowledgment
    /// in its own segments that reached the backup). The bytes before it are restored as sent
    /// (the client's next ACK frees them), the rest goes out again as new data at once (the
    /// client drops what it has). Two ways this went wrong before:
    /// - everything as new data: the socket's `snd_nxt` started at the last acknowledged byte
    ///   the primary had reported, and while it was behind the client's own point the kernel
    ///   discarded every client segment as acknowledging unsent data, data included; when the
    ///   window or the congestion window kept it from catching up, the session stalled for
    ///   good (the client's retransmissions timed out 6 times);
    /// - as sent up to the end of what had left the hold: a byte the client never got then
    ///   waited for the restored socket's first retransmission timeout (1 s, no RTT sample
    ///   yet).
    fn capsule(&self, client_has: Option<u32>) -> TcpCapsule {
        let b = &self.base;
        let una = b.send_seq.wrapping_add(self.acked as u32);
        let sent = client_has.map_or(0, |e| {
            if crate::hold::seq_ge(e, una) {
                (e.wrapping_sub(una) as usize).min(self.out.len())
            } else {
                0
            }
        });
        let unread = b
            .recv_queue
            .get(self.read.min(b.recv_queue.len() as u64) as usize..)
            .unwrap_or_default()
            .to_vec();
        let copied = b.recv_copied().wrapping_add(self.read as u32);
        let rcv = copied.wrapping_add(unread.len() as u32);
        TcpCapsule {
            local: b.local,
            remote: b.remote,
            send_seq: b.send_seq.wrapping_add(self.produced() as u32),
            recv_seq: rcv,
            send_queue: self.out.iter().copied().collect(),
            unsent: (self.out.len() - sent) as u32,
            recv_queue: unread,
            options: b.options,
            window: self.window(rcv),
            timestamp: b.timestamp,
            captured_at_ms: b.captured_at_ms.saturating_sub(TS_MARGIN_MS),
            netns: b.netns,
            nodelay: b.nodelay,
        }
    }
}

/// Serves one primary's replication channel, `first` being its first updates. Returns when
/// the primary says Goodbye, or after taking its sessions over when the channel ends without
/// it (the primary died).
pub(crate) fn serve_primary<A: SessionApp>(
    inner: &Arc<Inner<A>>,
    conn: &mut Conn,
    first: Vec<Update>,
) {
    let mut sessions: HashMap<u64, Replica> = HashMap::new();
    let mut guarded: HashMap<u64, (SocketAddr, SocketAddr)> = HashMap::new();
    let stop = Arc::new(AtomicBool::new(false));
    let sweeper = {
        let (i, s) = (inner.clone(), stop.clone());
        std::thread::Builder::new()
            .name("slice-commit".into())
            .spawn(move || {
                while !s.load(Ordering::Relaxed) {
                    if let Err(e) = i.hold.sweep(Duration::from_millis(5)) {
                        tracing::error!(error = %e, "output commit sweep");
                        std::thread::sleep(Duration::from_millis(5));
                    }
                }
            })
    };
    let mut updates = first;
    let died = loop {
        let answer = match apply(inner, &mut sessions, &mut guarded, updates) {
            Ok(()) => ToSource::Applied,
            Err(why) => ToSource::Failed(why),
        };
        if send(conn, &answer).is_err() {
            break true;
        }
        match recv::<ToDest>(conn) {
            Ok(ToDest::Replicate(u)) => updates = u,
            Ok(ToDest::Goodbye) => break false,
            Ok(other) => {
                tracing::error!(message = ?other, "unexpected message on a replication channel");
                break true;
            }
            Err(FrameError::Closed) => break true,
            Err(e) => {
                tracing::warn!(error = %e, "replication channel from the primary broke");
                break true;
            }
        }
    };
    let t0 = Instant::now();
    // An instance that is stopping cuts its channels itself: that is no primary's death.
    let died = died && !inner.is_stopping();
    // Guarded sessions the primary never described cannot be restored: their output flows
    // again (the kernel's RST for their next segment tells the clients).
    if !guarded.is_empty() {
        let g: Vec<_> = guarded.values().copied().collect();
        if died {
            inner
                .rep_stats
                .takeover_failed
                .fetch_add(g.len() as u64, Ordering::Relaxed);
        }
        if let Err(e) = inner.hold.unprotect(&g, true) {
            tracing::error!(error = %e, "ending output commit");
        }
    }
    if died && !sessions.is_empty() {
        take_over(inner, sessions, t0);
    } else {
        let tuples: Vec<_> = sessions.values().map(Replica::tuple).collect();
        if let Err(e) = inner.hold.unprotect(&tuples, true) {
            tracing::error!(error = %e, "ending output commit");
        }
    }
    stop.store(true, Ordering::Relaxed);
    if let Ok(t) = sweeper {
        let _ = t.join();
    }
}

fn apply<A: SessionApp>(
    inner: &Inner<A>,
    sessions: &mut HashMap<u64, Replica>,
    guarded: &mut HashMap<u64, (SocketAddr, SocketAddr)>,
    updates: Vec<Update>,
) -> Result<(), String> {
    let mut covers = Vec::new();
    let mut ended = Vec::new();
    let mut failed = None;
    let rep = &inner.rep_stats;
    for u in updates {
        rep.applied.fetch_add(1, Ordering::Relaxed);
        match u {
            Update::Guard { id, local, remote } => match inner.hold.guard(&[(local, remote)]) {
                Ok(()) => {
                    guarded.insert(id, (local, remote));
                }
                Err(e) => {
                    failed.get_or_insert(format!("guard {local} <- {remote}: {e}"));
                }
            },
            Update::Protect(bytes) => {
                let r = format::decode(&bytes)
                    .map_err(|e| format!("capsule: {e}"))
                    .and_then(|s| {
                        A::load(&s.app).map_err(|e| format!("application capsule: {e}"))?;
                        repair::check_netns(&s.tcp).map_err(|e| e.to_string())?;
                        match guarded.remove(&s.session_id) {
                            Some(t) if t == (s.tcp.local, s.tcp.remote) => Ok(s),
                            Some(t) => {
                                guarded.insert(s.session_id, t);
                                Err(format!(
                                    "session {:#x}: capsule of another connection",
                                    s.session_id
                                ))
                            }
                            None => Err(format!("session {:#x} was not guarded", s.session_id)),
                        }
                    })
                    .and_then(|s| {
                        let r = Replica {
                            app: s.app,
                            read: 0,
                            acked: 0,
                            out: VecDeque::new(),
                            last_update: 0,
                            windows: None,
                            base: s.tcp,
                        };
                        let (l, rm) = r.tuple();
                        // Arms the guard: from here what the capsule covers may leave.
                        inner
                            .hold
                            .cover(&[(l, rm, r.covered_seq(), r.covered_ack())])
                            .map_err(|e| e.to_string())?;
                        sessions.insert(s.session_id, r);
                        Ok(())
                    });
                if let Err(e) = r {
                    inner.stats.refused_capsules.fetch_add(1, Ordering::Relaxed);
                    failed.get_or_insert(e);
                }
            }
            Update::Checkpoint {
                id,
                app,
                read,
                produced,
                acked,
                windows,
            } => {
                let Some(r) = sessions.get_mut(&id) else {
                    continue;
                };
                r.app = app;
                r.read = read;
                r.last_update = rep.applied.load(Ordering::Relaxed);
                if windows.is_some() {
                    r.windows = windows;
                }
                r.out.extend(produced);
                // Acknowledged output is never needed again (the count only grows).
                if acked > r.acked {
                    let drop = (acked - r.acked).min(r.out.len() as u64) as usize;
                    r.out.drain(..drop);
                    r.acked += drop as u64;
                }
                let (l, rm) = r.tuple();
                covers.push((l, rm, r.covered_seq(), r.covered_ack()));
            }
            Update::Ended(id) => {
                if let Some(r) = sessions.remove(&id) {
                    ended.push(r.tuple());
                } else if let Some(t) = guarded.remove(&id) {
                    ended.push(t);
                }
            }
        }
    }
    if !covers.is_empty() {
        inner.hold.cover(&covers).map_err(|e| e.to_string())?;
    }
    if !ended.is_empty() {
        inner
            .hold
            .unprotect(&ended, true)
            .map_err(|e| e.to_string())?;
    }
    match failed {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Sessions restored and released per step of a takeover: the clients of the first ones
/// (the most recently active) get their sessions back while later ones are restored.
const TAKEOVER_CHUNK: usize = 32;

/// The primary died: its sessions continue here (see the module doc).
fn take_over<A: SessionApp>(inner: &Arc<Inner<A>>, sessions: HashMap<u64, Replica>, t0: Instant) {
    let rep = &inner.rep_stats;
    rep.failovers.fetch_add(1, Ordering::Relaxed);
    let mut sessions: Vec<(u64, Replica)> = sessions.into_iter().collect();
    // The most recently active first: their clients are the ones waiting.
    sessions.sort_unstable_by_key(|(_, r)| std::cmp::Reverse(r.last_update));
    let tuples: Vec<_> = sessions.iter().map(|(_, r)| r.tuple()).collect();
    // The client's segments first: from here none meets a missing socket (and its RST).
    let held = match inner.hold.hold_many(&tuples) {
        Ok(()) => true,
        Err(e) => {
            tracing::error!(error = %e, "holding the clients' segments for a takeover");
            false
        }
    };
    // Ending output commit hands back what left of each session's output: the audit's first
    // half (the exit's own record against what this backup held).
    let left = match inner.hold.unprotect(&tuples, false) {
        Ok(left) => {
            let leaked = left
                .iter()
                .zip(&sessions)
                .filter(|(l, (_, r))| !l.within(r.covered_seq(), r.covered_ack()))
                .count();
            rep.commit_violations
                .fetch_add(leaked as u64, Ordering::Relaxed);
            left
        }
        Err(e) => {
            tracing::error!(error = %e, "ending output commit for a takeover");
            vec![crate::hold::Left::default(); sessions.len()]
        }
    };
    for ((chunk, tuples), left) in sessions
        .chunks(TAKEOVER_CHUNK)
        .zip(tuples.chunks(TAKEOVER_CHUNK))
        .zip(left.chunks(TAKEOVER_CHUNK))
    {
        for ((id, r), l) in chunk.iter().zip(left) {
            match restore_one(inner, *id, r, l.peer_ack) {
                Ok(()) => rep.taken_over.fetch_add(1, Ordering::Relaxed),
                Err(e) => {
                    tracing::error!(session = id, error = %e, "takeover");
                    rep.takeover_failed.fetch_add(1, Ordering::Relaxed)
                }
            };
        }
        if !held {
            continue;
        }
        // The second half of the audit: the clients' own acknowledgments, held meanwhile
        // (the answers to the restored sockets' window probes among them).
        match inner.hold.held_acks(tuples) {
            Ok(acks) => {
                let leaked = acks
                    .iter()
                    .zip(chunk)
                    .filter(|(a, (_, r))| {
                        a.is_some_and(|a| !crate::hold::seq_ge(r.covered_seq(), a))
                    })
                    .count();
                rep.commit_violations
                    .fetch_add(leaked as u64, Ordering::Relaxed);
            }
            Err(e) => tracing::error!(error = %e, "takeover audit"),
        }
        if let Err(e) = inner.hold.release_many(tuples) {
            tracing::error!(error = %e, "releasing the clients' segments after a takeover");
        }
    }
    rep.last_failover_us
        .store(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
}

/// Restores one session from the backup's copy and runs it here: its unacknowledged output
/// goes out first, as new data (the client drops what it already has).
fn restore_one<A: SessionApp>(
    inner: &Arc<Inner<A>>,
    id: u64,
    r: &Replica,
    client_has: Option<u32>,
) -> Result<(), String> {
    let app = A::load(&r.app).map_err(|e| format!("application capsule: {e}"))?;
    let c = r.capsule(client_has);
    let sock = restore_when_free(&c).map_err(|e| format!("restore: {e}"))?;
    repair::leave_repair(&sock).map_err(|e| e.to_string())?;
    // Nagle off for a restored session: with it, a short reply waited while anything was
    // unacknowledged, and right after a takeover the client's acknowledgments can be held up
    // (its out-of-window ACKs are rate limited to two a second, and one acknowledging more
    // than the restored socket has sent yet is discarded): in the bench one session in a
    // thousand then answered only after the restored socket's first retransmission timeout
    // (1 s, no RTT sample yet), 1.3-1.5 s after the kill.
    sock.set_nodelay(true)
        .map_err(|e| format!("TCP_NODELAY: {e}"))?;
    let out = c.unsent_part().to_vec();
    inner
        .run(Frozen { id, sock, app, out })
        .map_err(|e| format!("run: {e}"))
}
