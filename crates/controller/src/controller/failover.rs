//! High availability in the controller (Pico replication): failure detection,
//! failover and re-protection.
//!
//! Failover of a dead primary A (`Controller::failover`), in this order:
//! 1. **fence** A in the fabric (frames from its ports dropped, nothing steered to it; design
//!    invariant 7) and take it out of liveness, so a partitioned or revived A cannot emit;
//! 2. bump the **ownership token**: tokens are leased from the store in blocks
//!    ([`TOKEN_LEASE`], compare-and-swap of the lease ceiling), so every token is durable
//!    before use (after a restart the controller starts above the old ceiling, never reusing
//!    one) without an fsync on the failover's critical path;
//! 3. **activate** A's standby state on every live survivor, in parallel, with the new token
//!    (a survivor holding no standby of A answers with no flows; the backups fence A's
//!    checkpoint stream at that token);
//! 4. **steer** every returned key and alias to the survivor that activated it (exceptions take
//!    precedence over conn pins, port owners and the ring: NAT return traffic follows too),
//!    drop A's conn pins (`steer_ms`), then take A out of the ring (`ring_ms`);
//! 5. **re-protect** every survivor with a fresh policy over the survivors (their policies
//!    still name A: output of groups backed by A would wait for A's link to time out);
//! 6. persist exceptions + the record of A's handed-over keys (for a controller restart; off
//!    the critical path), record timings (`detect_ms`, `activate_ms`, `steer_ms`, ...).
//!
//! FTMB mode (`[ha] mode = "ftmb"`) differs in steps 3-5: every live replica is a
//! primary whose FTMB logger runs in its ring successor (the next live replica by index;
//! `protect` sends `ftmb_protect` with that replica's logger socket and remembers the host).
//! On A's death, right after the fence, H (the host that ran A's logger) is told to hold
//! (`ftmb_hold`) and A's port blocks are re-homed to it (return traffic of A's flows then
//! reaches H, which holds it while it recovers instead of the fence dropping it); `ftmb_activate {primary: A}` goes to H alone (H replays
//! A's logged input from its last snapshot and imports the flows) and its answer is steered
//! exactly like a Pico activation; exceptions still naming A afterwards belong to flows that
//! ended on A and are removed at once (the exception GC would find them too, a round later);
//! re-protection then re-points only the replicas whose successor changed (A's predecessor
//! now logs to H).
//!
//! A's NAT port blocks stay assigned to A (quarantined: its return traffic is dropped by the
//! fence unless an exception re-homes it; FTMB: owned by H in the fabric) until no exception
//! for a flow A handed over remains; then the exception GC retires A (blocks back to the pool
//! and unowned, the agent removes it). Reusing the block earlier could hand a port to a new
//! flow while a failed-over flow still uses it. The GC learns that handed-over flows ended
//! from `flows` (FTMB replicas list their workers' flows, with the same key and aliases as
//! their `ftmb_activate` answer) and decides under the HA lock, so it never retires a
//! replica whose failover is still running.

use super::*;
use crate::ha::{self, FtmbBrief, HaBrief, Probe};
use crate::protection::{self, Caller, Decision, Liveness};
use pliant_proto::{reply, Request};

/// Failover records kept for `ha status` (newest last).
pub const MAX_FAILOVER_RECORDS: usize = 64;
/// Pause between rejoin attempts of one replica (a refused or unanswered one).
const REJOIN_RETRY: Duration = Duration::from_secs(1);
/// Tokens leased per store write (see the module doc).
pub const TOKEN_LEASE: u64 = 1024;
/// Store key of the lease ceiling: no token above it was ever handed out.
const K_HA_TOKEN: &str = "ha/token";
const K_HA_CONFIG: &str = "ha/config";
const K_HA_FAILED: &str = "ha/failed";

#[derive(Default, Debug)]
pub struct HaCounters {
    pub probes: AtomicU64,
    pub probes_dead: AtomicU64,
    /// TCP probes that gave no evidence (no connection, no reset within `probe_timeout_ms`).
    pub probes_unknown: AtomicU64,
    /// Replicas suspected because their TCP probes stayed silent for `suspect_after_ms`.
    pub silent_suspected: AtomicU64,
    pub failovers: AtomicU64,
    pub flows_activated: AtomicU64,
    pub flows_failed_activation: AtomicU64,
    pub activate_errors: AtomicU64,
    pub fence_errors: AtomicU64,
    pub protects: AtomicU64,
    pub protect_errors: AtomicU64,
    /// Re-protections asked for by a replica (`needs_backup`) or for a never-protected one.
    pub reprotects: AtomicU64,
    pub retired: AtomicU64,
    /// Failed-over replicas that were alive all along (cut off) and rejoined as members.
    pub rejoins: AtomicU64,
    pub rejoin_errors: AtomicU64,
    /// Flows two survivors both activated (see `failover`).
    pub duplicate_activations: AtomicU64,
    pub records_dropped: AtomicU64,
    /// FTMB: failovers of a primary with no live logger host (its flows are lost).
    pub ftmb_no_logger: AtomicU64,
    /// FTMB: `ftmb_protect` not sent because the replica already logs to its successor.
    pub ftmb_protect_unchanged: AtomicU64,
    /// Protections not started now (`protection::decide` deferred them; see its reasons).
    pub protects_deferred: AtomicU64,
    /// Protections whose policy, as sent, named a replica that was not live by then
    /// (suspected, failing over, gone). Must stay 0; checked at send time, apart from the
    /// decision.
    pub protects_naming_unlive: AtomicU64,
    /// Backups a replica reported its replication link to as dead (each probed at once).
    pub backups_suspected: AtomicU64,
}

/// HA part of the controller state (under the `state` lock).
#[derive(Debug, Default)]
pub(super) struct HaState {
    pub cfg: HaConfig,
    pub token: u64,
    /// Highest token the store allows us to hand out (exclusive of a new lease).
    pub token_ceiling: u64,
    /// Backups each primary was last protected to (from its `protect` answer).
    pub protected: BTreeMap<u32, Vec<String>>,
    pub brief: BTreeMap<u32, HaBrief>,
    pub last_seen: BTreeMap<u32, Instant>,
    /// TCP members whose probes have found nothing since then (cleared when one listens).
    pub silent_since: BTreeMap<u32, Instant>,
    pub last_protect: BTreeMap<u32, Instant>,
    /// Last re-protection a replica asked for (rate limit: a replica stuck in `needs_backup`
    /// must not make the controller send `protect` at the heartbeat rate).
    pub last_reprotect: BTreeMap<u32, Instant>,
    /// Failed-over replicas -> the keys (and aliases) they handed to survivors.
    pub failed: BTreeMap<u32, BTreeSet<String>>,
    /// FTMB: primary -> the replica hosting its logger, as of its last successful
    /// `ftmb_protect` (the one to recover it if it dies).
    pub ftmb_logger: BTreeMap<u32, u32>,
    /// Replicas a peer reported its replication link to as dead, until a probe answers (or
    /// they are failed over): never named as a backup meanwhile.
    pub suspects: BTreeSet<u32>,
    /// Replicas whose `protect` is in flight.
    pub protecting: BTreeSet<u32>,
    /// Replicas whose failover has started and not finished.
    pub failing_over: BTreeSet<u32>,
    /// Last rejoin attempt per failed-over replica (a refused or unanswered one is retried,
    /// paced).
    pub last_rejoin: BTreeMap<u32, Instant>,
    pub failovers: VecDeque<Value>,
    /// The unprotected members as last logged (an event when the set changes, not every
    /// heartbeat).
    pub unprotected_logged: Vec<u32>,
}

impl HaState {
    pub(super) fn load(s: &dyn Store, configured: &HaConfig) -> Result<HaState> {
        Ok(HaState {
            // The config file decides the mode; the policy/hz the API last set survive a
            // restart.
            // Only those: timeouts and intervals always come from the file.
            cfg: match store::get_json::<HaConfig>(s, K_HA_CONFIG)? {
                Some(c) if c.mode == configured.mode => HaConfig {
                    policy: c.policy,
                    hz: c.hz,
                    ..configured.clone()
                },
                _ => configured.clone(),
            },
            // Start at the old ceiling: above every token issued before a restart.
            token: store::get_json::<u64>(s, K_HA_TOKEN)?.unwrap_or(0),
            failed: store::get_json(s, K_HA_FAILED)?.unwrap_or_default(),
            ..HaState::default()
        })
    }
}

/// One replica's answer to an activation request.
type Answer = (u32, std::result::Result<Value, rc::ReplicaError>);

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e3 * 100.0).round() / 100.0
}

impl Controller {
    pub fn ha_enabled(&self) -> bool {
        lock(&self.state).ha.cfg.mode != ha::HaMode::Off
    }

    pub fn ha_config(&self) -> HaConfig {
        lock(&self.state).ha.cfg.clone()
    }

    /// The watch interval (the daemon's HA loop period).
    pub fn ha_watch_interval(&self) -> Duration {
        Duration::from_millis(lock(&self.state).ha.cfg.watch_ms.max(1))
    }

    fn ha_rpc_timeout(&self) -> Duration {
        Duration::from_millis(lock(&self.state).ha.cfg.rpc_timeout_ms.max(1))
    }

    fn ftmb_mode(&self) -> bool {
        lock(&self.state).ha.cfg.mode == ha::HaMode::Ftmb
    }

    /// The fewest replicas HA protection needs (1 with HA off): the policy's floor.
    pub fn ha_floor(&self) -> u32 {
        ha::ha_min_replicas(&lock(&self.state).ha.cfg)
    }

    /// The serving members that run unprotected with HA on ([`protection::unprotected`] over
    /// what the controller learnt from `protect` answers and status polls). Empty with HA off:
    /// nothing is protected then, by configuration, and that is no news.
    pub(super) fn unprotected_of(st: &State) -> Vec<u32> {
        if st.ha.cfg.mode == ha::HaMode::Off {
            return Vec::new();
        }
        let f = Self::protection_facts(st);
        let ftmb = st.ha.cfg.mode == ha::HaMode::Ftmb;
        let index = |name: &String| name.strip_prefix('r').and_then(|n| n.parse::<u32>().ok());
        let cover: BTreeMap<u32, protection::Cover> = f
            .members
            .keys()
            .map(|i| {
                let backups: Vec<u32> = if ftmb {
                    st.ha.ftmb_logger.get(i).copied().into_iter().collect()
                } else {
                    st.ha
                        .protected
                        .get(i)
                        .map(|b| b.iter().filter_map(index).collect())
                        .unwrap_or_default()
                };
                let lost_backup = !ftmb && st.ha.brief.get(i).is_some_and(|b| b.needs_backup);
                (
                    *i,
                    protection::Cover {
                        backups,
                        lost_backup,
                    },
                )
            })
            .collect();
        protection::unprotected(&f.members, &cover)
    }

    /// An event (and a log line) when the set of unprotected members changes.
    pub(super) fn note_unprotected(&self) {
        let changed = {
            let mut st = lock(&self.state);
            let now = Self::unprotected_of(&st);
            (now != st.ha.unprotected_logged).then(|| {
                st.ha.unprotected_logged = now.clone();
                now
            })
        };
        if let Some(now) = changed {
            if !now.is_empty() {
                tracing::warn!(replicas = ?now, "HA on, replicas running unprotected");
            }
            self.event("unprotected", json!({"replicas": now}));
        }
    }

    pub(super) fn ha_summary(&self, st: &State) -> Value {
        let c = &self.counters.ha;
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let loggers: BTreeMap<String, String> = st
            .ha
            .ftmb_logger
            .iter()
            .map(|(p, h)| (format!("r{p}"), format!("r{h}")))
            .collect();
        let unprotected = Self::unprotected_of(st);
        json!({
            "mode": st.ha.cfg.mode, "policy": st.ha.cfg.policy, "hz": st.ha.cfg.hz,
            "token": st.ha.token,
            "min_replicas": ha::ha_min_replicas(&st.ha.cfg),
            // A gauge: serving replicas that would lose their flows if they died now.
            "unprotected_replicas": unprotected.len(),
            "unprotected": unprotected,
            "ftmb_loggers": loggers,
            "failed_over": st.ha.failed.keys().collect::<Vec<_>>(),
            "last_failover": st.ha.failovers.back(),
            "counters": {
                "probes": g(&c.probes), "probes_dead": g(&c.probes_dead),
                "probes_unknown": g(&c.probes_unknown),
                "silent_suspected": g(&c.silent_suspected),
                "failovers": g(&c.failovers), "flows_activated": g(&c.flows_activated),
                "flows_failed_activation": g(&c.flows_failed_activation),
                "activate_errors": g(&c.activate_errors), "fence_errors": g(&c.fence_errors),
                "protects": g(&c.protects), "protect_errors": g(&c.protect_errors),
                "reprotects": g(&c.reprotects), "retired": g(&c.retired),
                "rejoins": g(&c.rejoins), "rejoin_errors": g(&c.rejoin_errors),
                "duplicate_activations": g(&c.duplicate_activations),
                "records_dropped": g(&c.records_dropped),
                "ftmb_no_logger": g(&c.ftmb_no_logger),
                "ftmb_protect_unchanged": g(&c.ftmb_protect_unchanged),
                "protects_deferred": g(&c.protects_deferred),
                "protects_naming_unlive": g(&c.protects_naming_unlive),
                "backups_suspected": g(&c.backups_suspected),
            },
        })
    }

    /// Live replicas that take part in HA (not failed over, not leaving).
    fn ha_members(&self) -> Vec<(u32, PathBuf)> {
        lock(&self.state)
            .replicas
            .iter()
            .filter(|(_, (_, h))| h.alive && !h.failed_over && !h.draining)
            .map(|(i, (r, _))| (*i, r.socket.clone()))
            .collect()
    }

    /// One liveness round: a non-blocking connect to every live replica's control socket
    /// (`ha::probe`); a refused connection fails the replica over at once.
    ///
    /// Over TCP every member is probed at once (each probe may wait up to
    /// `probe_timeout_ms`; a silent host must not delay the detection of another's death):
    /// non-blocking connects polled together on this thread (`ha::probe_tcp_many`), each
    /// verdict acted on as it comes, a failover on a thread of its own. Unix probes never
    /// wait: in turn, on this thread.
    pub fn ha_watch_once(&self) {
        if !self.ha_enabled() {
            return;
        }
        let (tcp_timeout, suspect_after) = {
            let st = lock(&self.state);
            (
                Duration::from_millis(st.ha.cfg.probe_timeout_ms.max(1)),
                Duration::from_millis(st.ha.cfg.suspect_after_ms),
            )
        };
        let members = self.ha_members();
        let fail = |i: u32, why: &str| {
            self.counters.ha.probes_dead.fetch_add(1, Ordering::Relaxed);
            if let Err(e) = self.failover(i, why) {
                self.event(
                    "failover_error",
                    json!({"replica": i, "error": e.to_string()}),
                );
            }
        };
        // Unix probes never wait: in turn, here. TCP probes: all at once.
        let mut eps: Vec<(u32, String)> = Vec::new();
        for (i, sock) in &members {
            self.counters.ha.probes.fetch_add(1, Ordering::Relaxed);
            match self.settings.control.endpoint(sock) {
                pliant_wire::Endpoint::Tcp(a) => eps.push((*i, a)),
                pliant_wire::Endpoint::Unix(p) => {
                    let verdict = crate::ha::probe(&p);
                    self.note_probe(*i, &verdict, false, suspect_after);
                    if let Probe::Dead(why) = verdict {
                        fail(*i, &why);
                    }
                }
            }
        }
        if eps.is_empty() {
            return;
        }
        // A dead replica's failover starts as its verdict comes, on a thread of its own: the
        // verdicts of the others (a silent host's only at the timeout) are not held up.
        std::thread::scope(|sc| {
            crate::ha::probe_tcp_many(&eps, tcp_timeout, |i, verdict| {
                self.note_probe(i, &verdict, true, suspect_after);
                if let Probe::Dead(why) = verdict {
                    let (fail, w) = (&fail, why.clone());
                    let started = std::thread::Builder::new()
                        .name("ctl-failover".into())
                        .spawn_scoped(sc, move || fail(i, &w));
                    if let Err(e) = started {
                        tracing::warn!(error = %e, "failover thread; failing over in turn");
                        fail(i, &why);
                    }
                }
            });
        });
    }

    /// What a probe's verdict changes in the state (no I/O under the lock). Listening: seen
    /// now, no longer suspected, silence forgotten. Unknown over TCP: the replica has been
    /// silent since its first unanswered probe; after `suspect_after` of that it is
    /// suspected (never dead: death needs a refused connect or missed heartbeats).
    pub(super) fn note_probe(&self, i: u32, verdict: &Probe, tcp: bool, suspect_after: Duration) {
        let now = Instant::now();
        let silent_for = {
            let mut st = lock(&self.state);
            match verdict {
                Probe::Listening => {
                    st.ha.last_seen.insert(i, now);
                    st.ha.silent_since.remove(&i);
                    st.ha.suspects.remove(&i);
                    return;
                }
                Probe::Dead(_) => return,
                Probe::Unknown(_) if !tcp => return,
                Probe::Unknown(_) => {
                    self.counters
                        .ha
                        .probes_unknown
                        .fetch_add(1, Ordering::Relaxed);
                    let since = *st.ha.silent_since.entry(i).or_insert(now);
                    let silent_for = now.saturating_duration_since(since);
                    if silent_for < suspect_after || !st.ha.suspects.insert(i) {
                        return;
                    }
                    silent_for
                }
            }
        };
        self.counters
            .ha
            .silent_suspected
            .fetch_add(1, Ordering::Relaxed);
        let why = match verdict {
            Probe::Unknown(w) => w.as_str(),
            _ => "",
        };
        self.event(
            "replica_silent",
            json!({"replica": i, "silent_ms": ms(silent_for), "last_probe": why}),
        );
    }

    /// `ha_status` of every member (with the heartbeat): caches what it learns and re-protects
    /// replicas that lost a backup (`needs_backup`) or were never protected.
    ///
    /// The statuses are fetched from every member at once (a member that does not answer
    /// delays no other's), then acted on in index order. Members that missed their last
    /// heartbeat are not asked: they would most likely hold the round for a whole timeout.
    pub(super) fn ha_poll(&self) {
        let members = self.ha_members();
        let timeout = self.poll_timeout();
        let min_gap = Duration::from_millis(lock(&self.state).ha.cfg.reprotect_min_ms);
        if self.ftmb_mode() {
            self.ftmb_poll(&members, timeout, min_gap);
            return;
        }
        let answers = fan_out(&self.answering(&members), |(i, sock)| {
            let fetched = Instant::now();
            let r = self.settings.control.ha_status(sock, timeout);
            (*i, fetched, r)
        });
        for (i, fetched, r) in &answers {
            let b = match r {
                Ok(v) => HaBrief::from(v),
                Err(e) => {
                    self.note_bad_answer(*i, e);
                    continue;
                }
            };
            if self.failed_over_now(*i) {
                continue; // failed over since its status was read (by an earlier member's)
            }
            // A backup the replica lost its link to may be dead: suspect it (never named as a
            // backup meanwhile) and probe it now rather than wait for the watch loop.
            if self.suspect_backups(*i, &b.dead_backups) {
                continue; // a failover ran: it re-protected the survivors
            }
            let due = {
                let mut st = lock(&self.state);
                let unprotected = !st.ha.protected.contains_key(i);
                let recent = st
                    .ha
                    .last_reprotect
                    .get(i)
                    .is_some_and(|t| t.elapsed() < min_gap);
                let due = (b.needs_backup || unprotected) && members.len() > 1 && !recent;
                st.ha.brief.insert(*i, b);
                if due {
                    st.ha.last_reprotect.insert(*i, Instant::now());
                }
                due
            };
            if due {
                self.counters.ha.reprotects.fetch_add(1, Ordering::Relaxed);
                let r = self.protect_from_poll(*i, *fetched);
                self.event("reprotect", json!({"replica": i, "answer": r}));
            }
        }
    }

    /// Whether `i` is gone or failed over by now.
    fn failed_over_now(&self, i: u32) -> bool {
        lock(&self.state)
            .replicas
            .get(&i)
            .is_none_or(|(_, h)| h.failed_over)
    }

    /// The members that answered their last heartbeat (the ones worth polling now).
    fn answering(&self, members: &[(u32, PathBuf)]) -> Vec<(u32, PathBuf)> {
        let st = lock(&self.state);
        members
            .iter()
            .filter(|(i, _)| st.replicas.get(i).is_some_and(|(_, h)| h.missed == 0))
            .cloned()
            .collect()
    }

    /// Suspects every replica `reporter` says its replication link to died, and probes each
    /// at once: refused -> failed over now (true: a failover ran); listening -> cleared.
    fn suspect_backups(&self, reporter: u32, names: &[String]) -> bool {
        let mut failed_over = false;
        let tcp_timeout = Duration::from_millis(lock(&self.state).ha.cfg.probe_timeout_ms.max(1));
        for name in names {
            let Some(x) = name.strip_prefix('r').and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            let sock = {
                let mut st = lock(&self.state);
                let Some((r, h)) = st.replicas.get(&x) else {
                    continue;
                };
                if h.failed_over {
                    continue;
                }
                let sock = r.socket.clone();
                if st.ha.suspects.insert(x) {
                    self.counters
                        .ha
                        .backups_suspected
                        .fetch_add(1, Ordering::Relaxed);
                }
                sock
            };
            match self.settings.control.probe(&sock, tcp_timeout) {
                Probe::Dead(why) => {
                    let evidence = format!("r{reporter}'s replication link to it died; {why}");
                    if let Err(e) = self.failover(x, &evidence) {
                        self.event(
                            "failover_error",
                            json!({"replica": x, "error": e.to_string()}),
                        );
                    }
                    failed_over = true;
                }
                Probe::Listening => {
                    lock(&self.state).ha.suspects.remove(&x);
                }
                // Not known yet: stays suspected until a probe or heartbeat tells.
                Probe::Unknown(_) => {}
            }
        }
        failed_over
    }

    /// What [`protection::decide`] looks at, from the controller's state.
    fn protection_facts(st: &State) -> protection::Facts {
        let mut f = protection::Facts::default();
        for (i, (_, h)) in &st.replicas {
            if h.draining {
                continue;
            }
            let l = if h.failed_over {
                if st.ha.failing_over.contains(i) {
                    Liveness::FailingOver
                } else {
                    Liveness::Gone
                }
            } else if !h.alive || h.missed > 0 || st.ha.suspects.contains(i) {
                Liveness::Suspected
            } else {
                Liveness::Live
            };
            f.members.insert(*i, l);
        }
        f.protecting = st.ha.protecting.clone();
        f.failing_over = st.ha.failing_over.clone();
        f
    }

    /// Protects `i` if [`protection::decide`] lets `caller` do it now, over the backups it
    /// names. `status_read`: when the poll read the status that asked for it (a protection
    /// started since makes that status stale).
    fn protect_checked(&self, i: u32, caller: Caller, status_read: Option<Instant>) -> Value {
        let (decision, members) = {
            let mut st = lock(&self.state);
            let mut f = Self::protection_facts(&st);
            f.stale_status =
                status_read.is_some_and(|t| st.ha.last_protect.get(&i).is_some_and(|p| *p >= t));
            let d = protection::decide(&f, i, caller);
            let members: Vec<(u32, PathBuf)> = match &d {
                Decision::Protect { backups } => st
                    .replicas
                    .iter()
                    .filter(|(x, _)| **x == i || backups.contains(x))
                    .map(|(x, (r, _))| (*x, r.socket.clone()))
                    .collect(),
                Decision::Defer(_) => Vec::new(),
            };
            if matches!(d, Decision::Protect { .. }) {
                st.ha.protecting.insert(i);
            }
            (d, members)
        };
        if let Decision::Defer(why) = decision {
            self.counters
                .ha
                .protects_deferred
                .fetch_add(1, Ordering::Relaxed);
            return json!({"ok": false, "deferred": why});
        }
        let ans = self.protect_one(i, &members);
        lock(&self.state).ha.protecting.remove(&i);
        ans
    }

    /// The poll's re-protection: under the HA lock, so it never interleaves with a failover
    /// (which re-protects the survivors itself) or another protection.
    pub(super) fn protect_from_poll(&self, i: u32, status_read: Instant) -> Value {
        let _g = lock(&self.ha_lock);
        self.protect_checked(i, Caller::Poll, Some(status_read))
    }

    /// FTMB flavour of [`Controller::ha_poll`]: `ftmb_status` of every member; a member the
    /// controller never protected, or whose workers log somewhere else than its successor's
    /// logger (say its logger connection was given up), is sent `ftmb_protect` again, at
    /// most once per `min_gap`. A replica still connecting (`protected: false` with the right
    /// logger) is left alone: re-sending would restart its full snapshot.
    fn ftmb_poll(&self, members: &[(u32, PathBuf)], timeout: Duration, min_gap: Duration) {
        let cfg = self.ha_config();
        // Fetched from every answering member at once, acted on in order (as `ha_poll`).
        let answers = fan_out(&self.answering(members), |(i, sock)| {
            let fetched = Instant::now();
            let r = self.settings.control.ftmb_status(sock, timeout);
            (*i, fetched, r)
        });
        for (i, fetched, r) in &answers {
            let (i, fetched) = (i, *fetched);
            let b = match r {
                Ok(v) => FtmbBrief::from(v),
                Err(e) => {
                    self.note_bad_answer(*i, e);
                    continue;
                }
            };
            let want = ha::ftmb_successor(*i, members).map(|(_, s)| ha::ftmb_endpoint(&cfg, &s));
            if self.failed_over_now(*i) {
                continue; // failed over since its status was read
            }
            let due = {
                let mut st = lock(&self.state);
                let unprotected = !st.ha.ftmb_logger.contains_key(i);
                let elsewhere = want
                    .as_ref()
                    .is_some_and(|w| b.logger.as_deref() != Some(w.as_str()));
                let recent = st
                    .ha
                    .last_reprotect
                    .get(i)
                    .is_some_and(|t| t.elapsed() < min_gap);
                let due = (unprotected || elsewhere) && want.is_some() && !recent;
                if due {
                    st.ha.last_reprotect.insert(*i, Instant::now());
                }
                due
            };
            if due {
                self.counters.ha.reprotects.fetch_add(1, Ordering::Relaxed);
                let r = self.protect_from_poll(*i, fetched);
                self.event("reprotect", json!({"replica": i, "answer": r}));
            }
        }
    }

    /// Leases the next [`TOKEN_LEASE`] tokens: compare-and-swap of the ceiling in the store
    /// (a second controller on the same store loses the race and sees an error).
    pub(super) fn lease_tokens(&self) -> Result<u64> {
        let mut st = lock(&self.store);
        let cur = st.get(K_HA_TOKEN)?;
        let (rev, val) = match &cur {
            Some(v) => (v.mod_revision, v.value.parse::<u64>().unwrap_or(0)),
            None => (0, 0),
        };
        let floor = val.max(lock(&self.state).ha.token);
        let ceiling = floor + TOKEN_LEASE;
        match st.compare_and_swap(K_HA_TOKEN, rev, &ceiling.to_string())? {
            Ok(_) => {
                let mut s = lock(&self.state);
                s.ha.token = floor;
                s.ha.token_ceiling = ceiling;
                Ok(ceiling)
            }
            Err(now) => Err(ControllerError::Refused(format!(
                "HA token lease changed under us (store revision {now}): another controller?"
            ))),
        }
    }

    /// The next ownership token (durable: within a lease persisted before it is used).
    pub(super) fn bump_ha_token(&self) -> Result<u64> {
        let need_lease = {
            let s = lock(&self.state);
            s.ha.token >= s.ha.token_ceiling
        };
        if need_lease {
            self.lease_tokens()?;
        }
        let mut s = lock(&self.state);
        s.ha.token += 1;
        Ok(s.ha.token)
    }

    fn save_failed(&self) -> Result<()> {
        let failed = lock(&self.state).ha.failed.clone();
        store::put_json(lock(&self.store).as_mut(), K_HA_FAILED, &failed)?;
        Ok(())
    }

    /// Fails replica `a` over (see the module doc). Idempotent: a replica already failed over
    /// is left alone.
    pub fn failover(&self, a: u32, evidence: &str) -> Result<Value> {
        let _g = lock(&self.ha_lock);
        let r = self.failover_locked(a, evidence);
        // Started or not, it is over: `a` is gone (or was never failed over by this call).
        let mut st = lock(&self.state);
        st.ha.failing_over.remove(&a);
        st.ha.suspects.remove(&a);
        st.ha.silent_since.remove(&a);
        r
    }

    fn failover_locked(&self, a: u32, evidence: &str) -> Result<Value> {
        let t0 = Instant::now();
        let detected_unix_ms = now_ms();
        let last_seen = {
            let mut st = lock(&self.state);
            let last_seen = st.ha.last_seen.get(&a).copied();
            let Some((_, h)) = st.replicas.get_mut(&a) else {
                return Err(ControllerError::NoReplica(a));
            };
            if h.failed_over {
                return Ok(json!({"ok": true, "replica": a, "note": "already failed over"}));
            }
            h.failed_over = true;
            h.alive = false;
            h.pps = 0;
            st.ha.failed.entry(a).or_default();
            st.ha.failing_over.insert(a);
            last_seen
        };
        self.counters.replicas_died.fetch_add(1, Ordering::Relaxed);
        // 1. Fence before anyone else may act for A's flows.
        let fenced = {
            let mut s = lock(&self.steering);
            s.set_fenced(a, true).and_then(|_| s.set_live(a, false))
        };
        if let Err(e) = &fenced {
            // Fail-stop is the model: a SIGKILLed replica emits nothing anyway. Carry on (its
            // flows would be lost otherwise) but make the gap visible.
            self.counters
                .ha
                .fence_errors
                .fetch_add(1, Ordering::Relaxed);
            self.event("fence_error", json!({"replica": a, "error": e.to_string()}));
        }
        let fence_ms = ms(t0.elapsed());
        // 2. Token.
        let token = self.bump_ha_token()?;
        // 3. Activate on every survivor in parallel (FTMB: on A's logger host only).
        let t_act = Instant::now();
        let survivors = self.ha_members();
        let timeout = self.ha_rpc_timeout();
        let ftmb = self.ftmb_mode();
        let mut ftmb_detail = Value::Null;
        let answers: Vec<Answer> = if ftmb {
            let (answers, detail) = self.ftmb_activate(a, &survivors, timeout);
            ftmb_detail = detail;
            answers
        } else {
            let req = Request::Activate {
                primary: format!("r{a}"),
                token,
            };
            std::thread::scope(|sc| {
                let hs: Vec<_> = survivors
                    .iter()
                    .map(|(i, sock)| {
                        let req = &req;
                        let dial = &self.settings.control;
                        (*i, sc.spawn(move || dial.call(sock, req, timeout)))
                    })
                    .collect();
                hs.into_iter()
                    .map(|(i, h)| {
                        (
                            i,
                            h.join().unwrap_or_else(|_| {
                                Err(rc::ReplicaError::Io {
                                    ep: format!("r{i}"),
                                    reason: "activate thread panicked".into(),
                                })
                            }),
                        )
                    })
                    .collect()
            })
        };
        let activate_ms = ms(t_act.elapsed());
        // 4. Steer every key and alias to its new owner.
        let t_steer = Instant::now();
        let mut entries: Vec<(FlowKey, u32)> = Vec::new();
        let mut per: BTreeMap<u32, Value> = BTreeMap::new();
        let mut handed: BTreeSet<String> = BTreeSet::new();
        let (mut activated, mut failed) = (0u64, 0u64);
        // A flow activated by two survivors would have two live copies (design invariant 1):
        // only possible if a backup kept a stale standby copy after the flow moved to another
        // group. Counted and reported; steering points at one of them (the last answer).
        let mut first_owner: BTreeMap<String, u32> = BTreeMap::new();
        let mut duplicates: Vec<String> = Vec::new();
        for (i, ans) in &answers {
            match ans {
                Ok(v) => {
                    let act = match reply::decode::<reply::Activate>(v) {
                        Ok(a) => a,
                        Err(e) => {
                            self.counters
                                .ha
                                .activate_errors
                                .fetch_add(1, Ordering::Relaxed);
                            per.insert(*i, json!({"error": e}));
                            continue;
                        }
                    };
                    let (n, f, flows) = (act.activated, act.failed, &act.flows);
                    activated += n;
                    failed += f;
                    for fl in flows {
                        if first_owner.insert(fl.key.clone(), *i).is_some() {
                            self.counters
                                .ha
                                .duplicate_activations
                                .fetch_add(1, Ordering::Relaxed);
                            if duplicates.len() < 16 {
                                duplicates.push(fl.key.clone());
                            }
                        }
                        for k in std::iter::once(&fl.key).chain(fl.aliases.iter()) {
                            match k.parse::<FlowKey>() {
                                Ok(key) => {
                                    entries.push((key, *i));
                                    handed.insert(k.clone());
                                }
                                Err(_) => {
                                    self.counters
                                        .unparsable_keys
                                        .fetch_add(1, Ordering::Relaxed);
                                }
                            }
                        }
                    }
                    per.insert(
                        *i,
                        json!({"activated": n, "failed": f, "errors": act.errors}),
                    );
                }
                Err(e) => {
                    self.counters
                        .ha
                        .activate_errors
                        .fetch_add(1, Ordering::Relaxed);
                    per.insert(*i, json!({"error": e.to_string()}));
                }
            }
        }
        let steer_res = {
            let mut s = lock(&self.steering);
            let r = if entries.is_empty() {
                Ok(())
            } else {
                s.set_exceptions(&entries)
            };
            // Pins to A are useless now (A is fenced): new packets of unknown flows go by ring.
            let _ = s.flush_pins(a);
            r
        };
        let steer_ms = ms(t_steer.elapsed());
        // New flows must not hash onto A (they would be dropped at the fence). Not part of
        // `steer_ms`: existing flows are already re-homed by their exceptions.
        let t_ring = Instant::now();
        let ring_res = self.install_ring();
        let ring_ms = ms(t_ring.elapsed());
        // FTMB: exceptions still naming A are flows A no longer had (the recovered ones were
        // just re-pointed at H): they ended. Without them a new connection reusing such a
        // 5-tuple goes by ring/port owner instead of into the fence. Removed now rather than
        // by the exception GC's next round (Pico leaves them to the GC): A's recovery is
        // complete, every flow A still had was in H's answer.
        let stale = if ftmb {
            self.drop_exceptions_of(a)
        } else {
            Ok(0)
        };
        let total_ms = ms(t0.elapsed());
        self.counters.ha.failovers.fetch_add(1, Ordering::Relaxed);
        self.counters
            .ha
            .flows_activated
            .fetch_add(activated, Ordering::Relaxed);
        self.counters
            .ha
            .flows_failed_activation
            .fetch_add(failed, Ordering::Relaxed);
        // 5. Re-protect the survivors (their backup A is gone; activated flows need backups).
        let t_prot = Instant::now();
        let protect = self.protect_all_as(Caller::Failover);
        let protect_ms = ms(t_prot.elapsed());
        // 6. Persist (for a controller restart; the store's fsyncs are off the critical path).
        let mut by_owner: BTreeMap<u32, Vec<FlowKey>> = BTreeMap::new();
        for (k, o) in &entries {
            by_owner.entry(*o).or_default().push(*k);
        }
        for (o, keys) in &by_owner {
            self.save_exceptions(keys, Some(*o))?;
        }
        lock(&self.state)
            .ha
            .failed
            .entry(a)
            .or_default()
            .extend(handed);
        self.save_failed()?;
        let epoch = self.bump_epoch()?;
        {
            let mut st = lock(&self.state);
            // Until the next heartbeat, account the activated flows at their new owners.
            for (i, v) in &per {
                let n = v["activated"].as_u64().unwrap_or(0);
                if let Some((_, h)) = st.replicas.get_mut(i) {
                    h.flows += n;
                }
            }
            if let Some((_, h)) = st.replicas.get_mut(&a) {
                h.flows = 0;
            }
            st.ha.protected.remove(&a);
            st.ha.brief.remove(&a);
            st.ha.ftmb_logger.remove(&a);
        }
        let record = json!({
            "replica": a, "evidence": evidence, "token": token, "epoch": epoch,
            "mode": if ftmb { "ftmb" } else { "pico" },
            "ftmb": ftmb_detail,
            "detected_unix_ms": detected_unix_ms,
            "detect_ms": last_seen.map(|t| ms(t0.saturating_duration_since(t))),
            "fence_ms": fence_ms, "activate_ms": activate_ms, "steer_ms": steer_ms,
            "ring_ms": ring_ms,
            "failover_ms": total_ms, "protect_ms": protect_ms,
            "activated": activated, "failed": failed, "keys_steered": entries.len(),
            "stale_exceptions_removed": stale.as_ref().ok(),
            "duplicates": duplicates,
            "by_replica": per,
            "fenced": fenced.is_ok(),
            "reprotected": protect,
            "steering_error": steer_res.err().map(|e| e.to_string())
                .or_else(|| ring_res.err().map(|e| e.to_string()))
                .or_else(|| stale.err().map(|e| e.to_string())),
        });
        {
            let mut st = lock(&self.state);
            if st.ha.failovers.len() >= MAX_FAILOVER_RECORDS {
                st.ha.failovers.pop_front();
                self.counters
                    .ha
                    .records_dropped
                    .fetch_add(1, Ordering::Relaxed);
            }
            st.ha.failovers.push_back(record.clone());
        }
        self.event("failover", record.clone());
        Ok(record)
    }

    /// FTMB step 3 of a failover: re-homes A's port blocks to the replica that hosted A's
    /// logger, then asks that replica to recover A (`ftmb_activate`). Returns the answer (none
    /// when A had no live logger host: its flows are lost, which the record says) and the
    /// record's `ftmb` detail.
    fn ftmb_activate(
        &self,
        a: u32,
        survivors: &[(u32, PathBuf)],
        timeout: Duration,
    ) -> (Vec<Answer>, Value) {
        let host = lock(&self.state).ha.ftmb_logger.get(&a).copied();
        let Some((h, sock)) = host.and_then(|h| survivors.iter().find(|(i, _)| *i == h).cloned())
        else {
            self.counters
                .ha
                .ftmb_no_logger
                .fetch_add(1, Ordering::Relaxed);
            let why = match host {
                Some(h) => format!("r{a}'s logger host r{h} is not live"),
                None => format!("r{a} was never protected (no logger host)"),
            };
            self.event("ftmb_unrecoverable", json!({"replica": a, "error": why}));
            return (Vec::new(), json!({"logger_host": host, "error": why}));
        };
        // Return traffic to A's NAT ports goes to H from now on: H holds what arrives for the
        // flows it is recovering (bounded, counted by the runtime) instead of the fence
        // dropping it, so the flows need no retransmission timeout. The blocks stay A's in
        // the port pool (quarantined) until A is retired.
        // H holds first (one short round trip), so what the re-homing sends there waits for
        // the activation instead of finding no flow (`nat_no_mapping` at H, lost for UDP,
        // retransmitted for TCP). Not fatal: without it H starts holding at the activation.
        let hold = self.settings.control.call(
            &sock,
            &Request::FtmbHold {
                primary: format!("r{a}"),
            },
            timeout,
        );
        let t_rehome = Instant::now();
        let blocks = lock(&self.state)
            .ports
            .as_ref()
            .map(|p| p.of(a))
            .unwrap_or_default();
        let rehome = {
            let mut s = lock(&self.steering);
            blocks
                .iter()
                .try_for_each(|r| s.set_port_owner(r.clone(), Some(h)))
        };
        if let Err(e) = &rehome {
            self.event(
                "steering_error",
                json!({"replica": a, "rehome_to": h, "error": e.to_string()}),
            );
        }
        let rehome_ms = ms(t_rehome.elapsed());
        let req = Request::FtmbActivate {
            primary: format!("r{a}"),
        };
        let ans = self.settings.control.call(&sock, &req, timeout);
        let mut detail = match ans
            .as_ref()
            .map(|v| rc::decode::<reply::FtmbActivate>(&sock, "ftmb_activate", v))
        {
            Ok(Ok(v)) => ha::ftmb_activate_detail(&v),
            Ok(Err(e)) => json!({"error": e.to_string()}),
            Err(e) => json!({"error": e.to_string()}),
        };
        detail["logger_host"] = json!(h);
        detail["held_before_rehome"] = json!(hold.is_ok());
        detail["port_blocks_rehomed"] = json!(blocks.len());
        detail["rehome_ms"] = json!(rehome_ms);
        (vec![(h, ans)], detail)
    }

    /// Removes (fabric and store) every steering exception that names replica `a`.
    fn drop_exceptions_of(&self, a: u32) -> Result<usize> {
        let keys: Vec<FlowKey> = {
            let mut s = lock(&self.steering);
            let keys: Vec<FlowKey> = s
                .exceptions()?
                .into_iter()
                .filter(|(_, o)| *o == a)
                .map(|(k, _)| k)
                .collect();
            if !keys.is_empty() {
                s.remove_exceptions(&keys)?;
            }
            keys
        };
        if !keys.is_empty() {
            self.save_exceptions(&keys, None)?;
        }
        Ok(keys.len())
    }

    /// Sends `protect` with a fresh policy to every member (in parallel). Answers per replica.
    /// FTMB: `ftmb_protect` only to members whose logger host is not their successor yet.
    pub fn protect_all(&self) -> Value {
        self.protect_all_as(Caller::Api)
    }

    /// [`Controller::protect_all`] on behalf of `caller` (each member through
    /// [`protection::decide`]).
    fn protect_all_as(&self, caller: Caller) -> Value {
        if !self.ha_enabled() {
            return Value::Null;
        }
        let members = self.ha_members();
        let ftmb = self.ftmb_mode();
        let mut skipped: Vec<(u32, Value)> = Vec::new();
        let todo: Vec<u32> = members
            .iter()
            .map(|(i, _)| *i)
            .filter(|i| {
                if !ftmb {
                    return true;
                }
                let want = ha::ftmb_successor(*i, &members).map(|(h, _)| h);
                let have = lock(&self.state).ha.ftmb_logger.get(i).copied();
                if want.is_some() && want == have {
                    self.counters
                        .ha
                        .ftmb_protect_unchanged
                        .fetch_add(1, Ordering::Relaxed);
                    skipped.push((
                        *i,
                        json!({"ok": true, "unchanged": true,
                        "backups": [format!("r{}", want.unwrap_or(0))]}),
                    ));
                    return false;
                }
                true
            })
            .collect();
        let mut out: Vec<(u32, Value)> = std::thread::scope(|sc| {
            let hs: Vec<_> = todo
                .iter()
                .map(|i| (*i, sc.spawn(move || self.protect_checked(*i, caller, None))))
                .collect();
            hs.into_iter()
                .map(|(i, h)| (i, h.join().unwrap_or(json!({"error": "panicked"}))))
                .collect()
        });
        out.extend(skipped);
        Value::Object(out.into_iter().map(|(i, v)| (format!("r{i}"), v)).collect())
    }

    /// Sends `protect` to replica `i` with the policy over `members`; records its backups.
    fn protect_one(&self, i: u32, members: &[(u32, PathBuf)]) -> Value {
        if self.ftmb_mode() {
            return self.protect_one_ftmb(i, members);
        }
        let (cfg, token) = {
            let st = lock(&self.state);
            (st.ha.cfg.clone(), st.ha.token)
        };
        let Some((_, sock)) = members.iter().find(|(x, _)| *x == i) else {
            return json!({"error": format!("r{i} is not a live member")});
        };
        let policy = ha::build_policy(&cfg, i, members);
        self.counters.ha.protects.fetch_add(1, Ordering::Relaxed);
        let (named, sent_unix_ms) = self.note_protect_sent(i, members);
        // The policy is built as JSON (the config's shape) and must be the runtime's type.
        let answer = serde_json::from_value::<pliant_ha::policy::Policy>(policy.clone())
            .map_err(|e| rc::ReplicaError::Malformed {
                ep: sock.display().to_string(),
                cmd: "protect".into(),
                reason: format!("the controller built a policy the runtime cannot take: {e}"),
            })
            .and_then(|p| {
                let req = Request::Protect {
                    token,
                    policy: Box::new(p),
                };
                let v = self
                    .settings
                    .control
                    .call(sock, &req, self.ha_rpc_timeout())?;
                rc::decode::<reply::Protect>(sock, "protect", &v)
            });
        match answer {
            Ok(v) => {
                let backups = v.backups();
                lock(&self.state).ha.protected.insert(i, backups.clone());
                json!({"ok": true, "policy": policy["kind"], "backups": backups,
                    "groups": v.groups, "named": named, "sent_unix_ms": sent_unix_ms})
            }
            Err(e) => {
                self.counters
                    .ha
                    .protect_errors
                    .fetch_add(1, Ordering::Relaxed);
                lock(&self.state).ha.protected.remove(&i);
                json!({"ok": false, "error": e.to_string(), "named": named,
                    "sent_unix_ms": sent_unix_ms})
            }
        }
    }

    /// Records that a protection of `i` naming `named` is being sent, and checks, apart from
    /// the decision that chose them, that every named replica is still live now. Returns the
    /// names of the replicas it names (`i` itself excluded) and the wall-clock time it is sent
    /// at (both go into the answer, so a reader can check what was named after a failure
    /// without trusting this check).
    fn note_protect_sent(&self, i: u32, named: &[(u32, PathBuf)]) -> (Vec<String>, u64) {
        let mut st = lock(&self.state);
        st.ha.last_protect.insert(i, Instant::now());
        let sent_unix_ms = now_ms();
        let f = Self::protection_facts(&st);
        let unlive: Vec<u32> = named
            .iter()
            .map(|(x, _)| *x)
            .filter(|x| *x != i && f.members.get(x) != Some(&Liveness::Live))
            .collect();
        drop(st);
        let names: Vec<String> = named
            .iter()
            .filter(|(x, _)| *x != i)
            .map(|(x, _)| format!("r{x}"))
            .collect();
        if !unlive.is_empty() {
            self.counters
                .ha
                .protects_naming_unlive
                .fetch_add(1, Ordering::Relaxed);
            self.event(
                "protect_names_unlive",
                json!({"replica": i, "named": unlive}),
            );
        }
        (names, sent_unix_ms)
    }

    /// FTMB: points replica `i`'s workers at its successor's logger (`ftmb_protect`) and
    /// remembers the successor as the one to recover `i`.
    fn protect_one_ftmb(&self, i: u32, members: &[(u32, PathBuf)]) -> Value {
        let Some((_, sock)) = members.iter().find(|(x, _)| *x == i) else {
            return json!({"error": format!("r{i} is not a live member")});
        };
        let Some((h, hsock)) = ha::ftmb_successor(i, members) else {
            // Alone: nothing to log to. Protected again when a replica joins.
            lock(&self.state).ha.ftmb_logger.remove(&i);
            return json!({"ok": true, "policy": "off", "backups": []});
        };
        let req = ha::ftmb_protect_request(&self.ha_config(), h, &hsock);
        self.counters.ha.protects.fetch_add(1, Ordering::Relaxed);
        let (named, sent_unix_ms) = self.note_protect_sent(i, &[(h, hsock.clone())]);
        match self
            .settings
            .control
            .call(sock, &req, self.ha_rpc_timeout())
        {
            Ok(_) => {
                let mut st = lock(&self.state);
                st.ha.ftmb_logger.insert(i, h);
                st.ha.protected.insert(i, vec![format!("r{h}")]);
                let logger = match &req {
                    Request::FtmbProtect { logger, .. } => logger.clone(),
                    _ => String::new(),
                };
                json!({"ok": true, "policy": "ftmb", "backups": [format!("r{h}")],
                    "logger": logger, "named": named, "sent_unix_ms": sent_unix_ms})
            }
            Err(e) => {
                self.counters
                    .ha
                    .protect_errors
                    .fetch_add(1, Ordering::Relaxed);
                let mut st = lock(&self.state);
                // Its old logger may be gone; never recover `i` from a host it did not log to
                // last (a stale host would replay a stale log).
                st.ha.ftmb_logger.remove(&i);
                st.ha.protected.remove(&i);
                json!({"ok": false, "error": e.to_string(), "named": named,
                    "sent_unix_ms": sent_unix_ms})
            }
        }
    }

    /// Forgets HA bookkeeping of a replica that left by scale-in, and tells the survivors to
    /// drop any standby state they hold for it (best effort).
    pub(super) fn forget_replica_ha(&self, v: u32) {
        {
            let mut st = lock(&self.state);
            st.ha.protected.remove(&v);
            st.ha.brief.remove(&v);
            st.ha.last_seen.remove(&v);
            st.ha.silent_since.remove(&v);
            st.ha.last_protect.remove(&v);
            st.ha.last_reprotect.remove(&v);
            st.ha.ftmb_logger.remove(&v);
        }
        // FTMB loggers hold no standby flows to drop: a left replica's logger connection is
        // simply closed by its process.
        if !self.ha_enabled() || self.ftmb_mode() {
            return;
        }
        let req = Request::DropStandby {
            primary: format!("r{v}"),
        };
        for (_, sock) in self.ha_members() {
            let _ = self
                .settings
                .control
                .call(&sock, &req, self.ha_rpc_timeout());
        }
    }

    /// Retires failed-over replicas none of whose handed-over flows is steered any more: port
    /// blocks released (and unowned in the fabric), the agent removes the replica, records go.
    pub(super) fn retire_failed(&self) -> Result<usize> {
        let saved: BTreeMap<String, u32> =
            store::get_json(lock(&self.store).as_ref(), K_EXCEPTIONS)?.unwrap_or_default();
        let done: Vec<u32> = lock(&self.state)
            .ha
            .failed
            .iter()
            .filter(|(_, keys)| !keys.iter().any(|k| saved.contains_key(k)))
            .map(|(i, _)| *i)
            .collect();
        for &v in &done {
            // The agent stops the process first: one it cannot reach (its host cut off) may
            // still run, so the record stays (retried next round) rather than leave an
            // unknown replica behind; its blocks stay quarantined meanwhile.
            let managed_by_agent = lock(&self.agent).is_some();
            if managed_by_agent {
                if let Some(a) = lock(&self.agent).as_mut() {
                    if let Err(e) = a.remove_replica(v) {
                        self.event(
                            "retire_error",
                            json!({"replica": v, "error": e.to_string()}),
                        );
                        continue;
                    }
                }
            }
            let released = lock(&self.state)
                .ports
                .as_mut()
                .map(|p| p.release(v))
                .unwrap_or_default();
            {
                let mut s = lock(&self.steering);
                for r in &released {
                    s.set_port_owner(r.clone(), None)?;
                }
            }
            let pb = lock(&self.state).ports.clone();
            if let Some(pb) = pb {
                store::put_json(lock(&self.store).as_mut(), K_PORTS, &pb)?;
            }
            lock(&self.store).delete(&format!("{P_REPLICAS}{v}"))?;
            {
                let mut st = lock(&self.state);
                st.replicas.remove(&v);
                st.ha.failed.remove(&v);
                st.ha.last_seen.remove(&v);
            }
            self.save_failed()?;
            self.counters.ha.retired.fetch_add(1, Ordering::Relaxed);
            self.event(
                "retired",
                json!({"replica": v, "ports_released": released.len()}),
            );
        }
        Ok(done.len())
    }

    /// Failed-over replicas that were alive all along — cut off, not dead: their host's agent
    /// answers again and reports their process running and serving — rejoin as members
    /// instead of being retired (see [`Self::rejoin`]). Pico/Remus only: an FTMB replica's
    /// flows were recovered by replay elsewhere and it is retired as before.
    pub(super) fn rejoin_returned(&self, serving: &[u32]) {
        if !self.ha_enabled() || self.ftmb_mode() {
            return;
        }
        let now = Instant::now();
        let due: Vec<u32> = {
            let st = lock(&self.state);
            serving
                .iter()
                .copied()
                .filter(|i| st.replicas.get(i).is_some_and(|(_, h)| h.failed_over))
                .filter(|i| !st.ha.failing_over.contains(i))
                .filter(|i| {
                    st.ha
                        .last_rejoin
                        .get(i)
                        .is_none_or(|t| now.saturating_duration_since(*t) >= REJOIN_RETRY)
                })
                .collect()
        };
        for a in due {
            lock(&self.state).ha.last_rejoin.insert(a, now);
            if let Err(e) = self.rejoin(a) {
                self.counters
                    .ha
                    .rejoin_errors
                    .fetch_add(1, Ordering::Relaxed);
                self.event(
                    "rejoin_error",
                    json!({"replica": a, "error": e.to_string()}),
                );
            }
        }
    }

    /// Replica `a` failed over while alive (a partition, a long stall) and is reachable
    /// again. Under a new token it drops everything it held (`rejoin`: flows that live on
    /// elsewhere, output held for its old backups, standby copies); only then is it unfenced,
    /// back in the ring and protected — a primary of new flows and a backup of others. Its
    /// port blocks stay its own (the NAT keeps the ports of the mappings that failed over
    /// reserved); it is no longer a candidate for retirement.
    pub fn rejoin(&self, a: u32) -> Result<Value> {
        let _g = lock(&self.ha_lock);
        let sock = {
            let st = lock(&self.state);
            match st.replicas.get(&a) {
                Some((r, h)) if h.failed_over => r.socket.clone(),
                Some(_) => return Ok(json!({"ok": true, "replica": a, "note": "not failed over"})),
                None => return Err(ControllerError::NoReplica(a)),
            }
        };
        let t0 = Instant::now();
        let token = self.bump_ha_token()?;
        let v =
            self.settings
                .control
                .call(&sock, &Request::Rejoin { token }, self.ha_rpc_timeout())?;
        let dropped = reply::decode::<reply::Rejoin>(&v).map_err(ControllerError::Refused)?;
        // Nothing it held survived: it may forward again.
        {
            let mut s = lock(&self.steering);
            s.set_fenced(a, false)?;
            s.set_live(a, true)?;
        }
        {
            let mut st = lock(&self.state);
            if let Some((_, h)) = st.replicas.get_mut(&a) {
                // Its answer is the proof of life; heartbeats it missed while cut off are old.
                h.failed_over = false;
                h.alive = true;
                h.missed = 0;
            }
            st.ha.suspects.remove(&a);
            st.ha.silent_since.remove(&a);
            st.ha.failed.remove(&a);
            st.ha.last_seen.insert(a, Instant::now());
            st.ha.last_rejoin.remove(&a);
        }
        self.save_failed()?;
        self.install_ring()?;
        let protect = self.protect_all_as(Caller::Failover);
        self.counters.ha.rejoins.fetch_add(1, Ordering::Relaxed);
        let record = json!({
            "replica": a, "token": token, "dropped": dropped,
            "rejoin_ms": ms(t0.elapsed()), "reprotected": protect,
        });
        self.event("rejoined", record.clone());
        Ok(record)
    }

    /// `GET /v1/ha`: the controller's HA view plus each live replica's `ha_status`, fresh.
    pub fn ha_view(&self) -> Value {
        let members = self.ha_members();
        let timeout = self.settings.rpc_timeout;
        let ftmb = self.ftmb_mode();
        let live: Vec<(u32, (Value, Value))> = std::thread::scope(|sc| {
            let hs: Vec<_> = members
                .iter()
                .map(|(i, sock)| {
                    (
                        *i,
                        sc.spawn(move || {
                            let c = self.settings.control.client(sock, timeout);
                            let ha = c.call(&Request::HaStatus);
                            let ftmb = ftmb.then(|| c.call(&Request::FtmbStatus));
                            (ha, ftmb)
                        }),
                    )
                })
                .collect();
            let answer = |r: std::result::Result<Value, rc::ReplicaError>| match r {
                Ok(v) => v,
                Err(e) => json!({"ok": false, "error": e.to_string()}),
            };
            hs.into_iter()
                .map(|(i, h)| {
                    let v = match h.join() {
                        Ok((ha, ftmb)) => (answer(ha), ftmb.map(answer).unwrap_or(Value::Null)),
                        Err(_) => (json!({"ok": false, "error": "panicked"}), Value::Null),
                    };
                    (i, v)
                })
                .collect()
        });
        let st = lock(&self.state);
        let replicas: Vec<Value> = st
            .replicas
            .iter()
            .map(|(i, (_, h))| {
                let (status, ftmb_status) = live
                    .iter()
                    .find(|(x, _)| x == i)
                    .map(|(_, v)| v.clone())
                    .unwrap_or((Value::Null, Value::Null));
                json!({"index": i, "name": format!("r{i}"), "alive": h.alive,
                    "failed_over": h.failed_over, "draining": h.draining,
                    "protected_to": st.ha.protected.get(i),
                    "ftmb_logger_host": st.ha.ftmb_logger.get(i).map(|h| format!("r{h}")),
                    "ha_status": status, "ftmb_status": ftmb_status})
            })
            .collect();
        json!({
            "ok": true,
            "config": st.ha.cfg,
            "unprotected": Self::unprotected_of(&st),
            "summary": self.ha_summary(&st),
            "replicas": replicas,
            "failovers": st.ha.failovers.iter().rev().take(16).collect::<Vec<_>>(),
        })
    }

    /// `POST /v1/ha/protect`: optionally changes the policy kind / frequency (stored), then
    /// protects `only` (or every member) now.
    pub fn ha_protect(
        &self,
        policy: Option<&str>,
        hz: Option<u32>,
        only: Option<u32>,
    ) -> Result<Value> {
        let cfg = {
            let st = lock(&self.state);
            if st.ha.cfg.mode == ha::HaMode::Off {
                return Err(ControllerError::Refused(
                    "HA is off (add an [ha] section with mode = \"pico\" to ctl.toml)".into(),
                ));
            }
            st.ha
                .cfg
                .with(policy, hz)
                .map_err(|e| ControllerError::BadRequest(e.to_string()))?
        };
        store::put_json(lock(&self.store).as_mut(), K_HA_CONFIG, &cfg)?;
        lock(&self.state).ha.cfg = cfg.clone();
        let answers = match only {
            Some(i) => {
                let members = self.ha_members();
                if !members.iter().any(|(x, _)| *x == i) {
                    return Err(ControllerError::Dead(i));
                }
                json!({format!("r{i}"): self.protect_checked(i, Caller::Api, None)})
            }
            None => self.protect_all(),
        };
        self.event(
            "protect",
            json!({"policy": cfg.policy, "hz": cfg.hz, "only": only}),
        );
        Ok(json!({"ok": true, "policy": cfg.policy, "hz": cfg.hz,
            "token": lock(&self.state).ha.token, "replicas": answers}))
    }
}

impl Controller {
    /// Watches the hosts' agents from now on (`[hosts]`).
    pub fn set_hosts(&self, h: Arc<crate::hosts::HostWatch>) {
        let _ = self.hosts.set(h);
    }

    pub fn hosts(&self) -> Option<&Arc<crate::hosts::HostWatch>> {
        self.hosts.get()
    }

    /// One poll of every host's agent, acted on: a replica whose process its agent saw die
    /// fails over on that word (the exit status is exact; no probe or heartbeat needs to
    /// miss); every replica of a host found dead fails over.
    pub fn hosts_watch_once(&self) {
        use crate::hosts::HostEvent;
        let Some(h) = self.hosts.get() else { return };
        let dead_after = Duration::from_millis(h.cfg.dead_after_ms);
        let seen = lock(&self.state).ha.last_seen.clone();
        let now = Instant::now();
        let answered = |i: u32| {
            seen.get(&i)
                .is_some_and(|t| now.saturating_duration_since(*t) < dead_after)
        };
        for ev in h.poll_once(&answered) {
            let (kind, replicas, evidence) = match &ev {
                HostEvent::ProcessDied {
                    host,
                    replica,
                    exit,
                } => (
                    "process_died",
                    vec![*replica],
                    format!("process died on host {host}: {exit} (reported by its agent)"),
                ),
                HostEvent::HostDead {
                    host,
                    replicas,
                    silent_ms,
                } => (
                    "host_dead",
                    replicas.clone(),
                    format!(
                        "host {host} dead: its agent and its replicas silent for {silent_ms} ms"
                    ),
                ),
            };
            self.event(kind, json!({"replicas": replicas, "evidence": evidence}));
            if !self.ha_enabled() {
                continue;
            }
            for r in replicas {
                if let Err(e) = self.failover(r, &evidence) {
                    self.event(
                        "failover_error",
                        json!({"replica": r, "error": e.to_string()}),
                    );
                }
            }
        }
        self.rejoin_returned(&h.serving_on_up_hosts());
    }
}
