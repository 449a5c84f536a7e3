//! Hosts and their agents: the controller polls every host's agent (`[hosts]` in ctl.toml),
//! starts and stops replicas through them ([`RemoteAgents`]), and tells three failures apart:
//!
//! - **process died**: the agent answers and reports the replica's process ended (with its
//!   exit status: it reaped its child) — the replica fails over at once, on the agent's word;
//! - **agent down, host up**: connecting to the agent is refused (the host's kernel answers,
//!   the agent process is gone) — nothing fails over; its replicas are judged on their own;
//! - **host dead (or cut off)**: the agent is silent (no answer, no refusal) and so are all the
//!   replicas it runs, for `dead_after_ms` — every replica of the host fails over. Silence of
//!   the agent while a replica of its host still answers is **unreachable**, not dead.
//!
//! From one vantage point a dead host and a host cut off from the controller look the same;
//! both are treated as dead, and fencing (steering moves the flows away, every command carries
//! the leader's term) keeps a cut-off replica from acting for flows that failed over.

use crate::agent::{Agent, AgentError, Started};
use pliant_proto::agent::{AgentRequest, AgentStatus, SlotState};
use pliant_proto::{Client, ControlError, KeptLinks};
use pliant_wire::{role, Endpoint, Security};
use serde::Deserialize;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// `[hosts]`: the agents of the hosts replicas run on.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct HostsSection {
    /// How often each agent is polled.
    #[serde(default = "d_poll_ms")]
    pub poll_ms: u64,
    /// A host whose agent and replicas are all silent this long is dead.
    #[serde(default = "d_dead_after_ms")]
    pub dead_after_ms: u64,
    /// Bound on one poll (connect + handshake + answer).
    #[serde(default = "d_poll_timeout_ms")]
    pub poll_timeout_ms: u64,
    #[serde(default)]
    pub agent: Vec<AgentEntry>,
}

fn d_poll_ms() -> u64 {
    50
}
fn d_dead_after_ms() -> u64 {
    1000
}
fn d_poll_timeout_ms() -> u64 {
    250
}

#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct AgentEntry {
    /// The host's name (its agent's certificate name).
    pub name: String,
    /// Where its agent listens (`host:port`, or a unix path on this host).
    pub endpoint: String,
}

impl HostsSection {
    pub fn check(&self, has_identity: bool) -> Result<(), String> {
        if self.agent.is_empty() {
            return Err("[hosts] lists no [[hosts.agent]]".into());
        }
        if !(5..=10_000).contains(&self.poll_ms) {
            return Err(format!("hosts.poll_ms = {}: need 5..=10000", self.poll_ms));
        }
        if self.dead_after_ms < 2 * self.poll_ms || self.dead_after_ms > 600_000 {
            return Err(format!(
                "hosts.dead_after_ms = {}: need 2 x poll_ms ({}) ..= 600000",
                self.dead_after_ms,
                2 * self.poll_ms
            ));
        }
        if !(10..=10_000).contains(&self.poll_timeout_ms) {
            return Err(format!(
                "hosts.poll_timeout_ms = {}: need 10..=10000",
                self.poll_timeout_ms
            ));
        }
        let mut seen = std::collections::BTreeSet::new();
        for a in &self.agent {
            pliant_proto::agent::check_slot_name(&a.name)
                .map_err(|e| format!("hosts.agent name: {e}"))?;
            if !seen.insert(&a.name) {
                return Err(format!("hosts.agent {:?} is listed twice", a.name));
            }
            let ep: Endpoint = a
                .endpoint
                .parse()
                .map_err(|e| format!("hosts.agent {:?} endpoint: {e}", a.name))?;
            if ep.is_tcp() && !has_identity {
                return Err(format!(
                    "hosts.agent {:?} is on TCP: the controller needs controller.identity",
                    a.name
                ));
            }
        }
        Ok(())
    }
}

/// One poll's outcome.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Poll {
    Answered,
    /// The connection was refused: the host's kernel answers, its agent does not run.
    Refused(String),
    /// No answer within the bound.
    Silent(String),
}

/// What the controller believes of a host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostState {
    Up,
    AgentDown,
    /// The agent is silent; not yet (or not) dead: a replica of the host still answers, or
    /// the silence is shorter than `dead_after_ms`.
    Unreachable,
    Dead,
}

impl HostState {
    pub fn name(self) -> &'static str {
        match self {
            HostState::Up => "up",
            HostState::AgentDown => "agent_down",
            HostState::Unreachable => "unreachable",
            HostState::Dead => "dead",
        }
    }
}

/// The host's state after a poll: `silent_for` is how long the agent has been silent (this
/// poll included), `replica_answered` whether one of its replicas answered within
/// `dead_after`. Pure, so the rules are tested on their own.
pub fn classify(
    poll: &Poll,
    silent_for: Duration,
    replica_answered: bool,
    dead_after: Duration,
) -> HostState {
    match poll {
        Poll::Answered => HostState::Up,
        Poll::Refused(_) => HostState::AgentDown,
        Poll::Silent(_) if replica_answered || silent_for < dead_after => HostState::Unreachable,
        Poll::Silent(_) => HostState::Dead,
    }
}

/// What a poll round tells the controller to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HostEvent {
    /// The agent reaped replica `replica`'s process (first report of this death).
    ProcessDied {
        host: String,
        replica: u32,
        exit: String,
    },
    /// The host became dead: its replicas (as last reported) fail over.
    HostDead {
        host: String,
        replicas: Vec<u32>,
        silent_ms: u64,
    },
}

struct View {
    entry: AgentEntry,
    state: HostState,
    since: Instant,
    silent_since: Option<Instant>,
    /// When the agent last answered: a silence is counted from there (the host was last known
    /// alive then), not from the end of the first poll that timed out.
    last_ok: Option<Instant>,
    last: Option<AgentStatus>,
    last_error: Option<String>,
    /// Deaths already reported, per replica (the agent's death counter).
    deaths_seen: std::collections::HashMap<String, u64>,
}

/// Replica index of a slot named `r<N>` (the controller's replica numbering).
pub fn index_of(slot: &str) -> Option<u32> {
    slot.strip_prefix('r')?.parse().ok().filter(|n| *n > 0)
}

/// The hosts' agents as the controller sees them.
pub struct HostWatch {
    pub cfg: HostsSection,
    security: Option<Security>,
    term: Arc<AtomicU64>,
    views: Mutex<Vec<View>>,
    /// Poll links kept between rounds (a poll every `poll_ms` per agent would otherwise cost
    /// a handshake each).
    kept: KeptLinks,
    pub polls: AtomicU64,
    pub poll_failures: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl HostWatch {
    pub fn new(cfg: HostsSection, security: Option<Security>, term: Arc<AtomicU64>) -> HostWatch {
        let now = Instant::now();
        let views = cfg
            .agent
            .iter()
            .map(|e| View {
                entry: e.clone(),
                state: HostState::Unreachable,
                since: now,
                silent_since: None,
                last_ok: None,
                last: None,
                last_error: None,
                deaths_seen: Default::default(),
            })
            .collect();
        HostWatch {
            cfg,
            security,
            term,
            views: Mutex::new(views),
            kept: KeptLinks::default(),
            polls: AtomicU64::new(0),
            poll_failures: AtomicU64::new(0),
        }
    }

    /// A client of agent `e` (it must prove the AGENT role and its name), under our term.
    pub fn client(&self, e: &AgentEntry, timeout: Duration) -> Result<Client, String> {
        let ep: Endpoint = e.endpoint.parse().map_err(|x| format!("{x}"))?;
        let mut c = Client::new(ep, self.security.clone())
            .expecting_role(role::AGENT)
            .with_timeout(timeout);
        if self.security.is_some() {
            c = c.expecting(e.name.clone());
        }
        let t = self.term.load(Ordering::Acquire);
        Ok(if t > 0 { c.with_term(t) } else { c })
    }

    fn entries(&self) -> Vec<AgentEntry> {
        lock(&self.views).iter().map(|v| v.entry.clone()).collect()
    }

    /// Polls every agent (in parallel) and returns what the controller must act on.
    /// `replica_answered(i)`: whether replica `i` answered the controller within
    /// `dead_after_ms`.
    pub fn poll_once(&self, replica_answered: &(dyn Fn(u32) -> bool + Sync)) -> Vec<HostEvent> {
        let timeout = Duration::from_millis(self.cfg.poll_timeout_ms);
        let started = Instant::now();
        let entries = self.entries();
        let answers = self.poll_all(&entries, timeout);
        let dead_after = Duration::from_millis(self.cfg.dead_after_ms);
        let now = Instant::now();
        let mut events = Vec::new();
        let mut views = lock(&self.views);
        for (v, (poll, status)) in views.iter_mut().zip(answers) {
            self.polls.fetch_add(1, Ordering::Relaxed);
            let silent_for = match &poll {
                Poll::Silent(w) => {
                    self.poll_failures.fetch_add(1, Ordering::Relaxed);
                    v.last_error = Some(w.clone());
                    let from = v.last_ok.unwrap_or(started);
                    now - *v.silent_since.get_or_insert(from)
                }
                Poll::Refused(w) => {
                    self.poll_failures.fetch_add(1, Ordering::Relaxed);
                    v.last_error = Some(w.clone());
                    v.silent_since = None;
                    Duration::ZERO
                }
                Poll::Answered => {
                    v.last_ok = Some(now);
                    v.silent_since = None;
                    v.last_error = None;
                    Duration::ZERO
                }
            };
            let ours: Vec<u32> = v
                .last
                .as_ref()
                .map(|s| {
                    s.slots
                        .iter()
                        .filter(|x| x.state == SlotState::Running)
                        .filter_map(|x| index_of(&x.replica))
                        .collect()
                })
                .unwrap_or_default();
            let answered = ours.iter().any(|i| replica_answered(*i));
            let state = classify(&poll, silent_for, answered, dead_after);
            if let Some(st) = status {
                for slot in &st.slots {
                    let seen = v.deaths_seen.entry(slot.replica.clone()).or_insert(0);
                    // The first report of an agent counts what it already knew as seen: a
                    // death from before the controller watched is not news.
                    let first = v.last.is_none();
                    if slot.deaths > *seen && !first && slot.state == SlotState::Died {
                        if let Some(i) = index_of(&slot.replica) {
                            events.push(HostEvent::ProcessDied {
                                host: v.entry.name.clone(),
                                replica: i,
                                exit: slot.exit.clone().unwrap_or_default(),
                            });
                        }
                    }
                    *seen = slot.deaths;
                }
                v.last = Some(st);
            }
            if state != v.state {
                tracing::warn!(host = %v.entry.name, from = v.state.name(), to = state.name(), "host state");
                if state == HostState::Dead {
                    events.push(HostEvent::HostDead {
                        host: v.entry.name.clone(),
                        replicas: ours.clone(),
                        silent_ms: silent_for.as_millis() as u64,
                    });
                }
                v.state = state;
                v.since = now;
            }
        }
        events
    }

    /// Every agent in `entries` polled at once (a silent host costs the bound once).
    fn poll_all(
        &self,
        entries: &[AgentEntry],
        timeout: Duration,
    ) -> Vec<(Poll, Option<AgentStatus>)> {
        std::thread::scope(|s| {
            let hs: Vec<_> = entries
                .iter()
                .map(|e| s.spawn(move || self.poll_agent(e, timeout)))
                .collect();
            hs.into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or((Poll::Silent("poll thread panicked".into()), None))
                })
                .collect()
        })
    }

    fn poll_agent(&self, e: &AgentEntry, timeout: Duration) -> (Poll, Option<AgentStatus>) {
        let c = match self.client(e, timeout) {
            Ok(c) => c,
            Err(w) => return (Poll::Silent(w), None),
        };
        let peer = format!("{}@{}", e.name, e.endpoint);
        match self
            .kept
            .ask::<AgentStatus, _>(&peer, &c, &AgentRequest::AgentStatus)
        {
            Ok(s) => (Poll::Answered, Some(s)),
            Err(ControlError::Io { reason, .. }) if reason.contains("refused") => {
                (Poll::Refused(reason), None)
            }
            Err(e) => (Poll::Silent(e.to_string()), None),
        }
    }

    /// The `hosts` section of the controller's status.
    pub fn status(&self) -> Value {
        let now = Instant::now();
        let views = lock(&self.views);
        Value::Array(
            views
                .iter()
                .map(|v| {
                    json!({
                        "name": v.entry.name,
                        "endpoint": v.entry.endpoint,
                        "state": v.state.name(),
                        "for_ms": now.duration_since(v.since).as_millis() as u64,
                        "last_error": v.last_error,
                        "agent_term": v.last.as_ref().map(|s| s.term),
                        "replicas": v.last.as_ref().map(|s| s.slots.clone()).unwrap_or_default(),
                    })
                })
                .collect(),
        )
    }

    /// The host whose agent runs (or last ran) replica `i`.
    pub fn host_of(&self, i: u32) -> Option<String> {
        lock(&self.views).iter().find_map(|v| {
            let has = v
                .last
                .as_ref()?
                .slots
                .iter()
                .any(|s| index_of(&s.replica) == Some(i));
            has.then(|| v.entry.name.clone())
        })
    }

    /// Replicas whose process runs and serves (as its agent reported at the last poll) on a
    /// host that is up: the candidates for a rejoin when they failed over.
    pub fn serving_on_up_hosts(&self) -> Vec<u32> {
        lock(&self.views)
            .iter()
            .filter(|v| v.state == HostState::Up)
            .filter_map(|v| v.last.as_ref())
            .flat_map(|s| s.slots.iter())
            .filter(|s| s.state == SlotState::Running && s.serving)
            .filter_map(|s| index_of(&s.replica))
            .collect()
    }

    /// The current state of host `name`.
    pub fn state_of(&self, name: &str) -> Option<HostState> {
        lock(&self.views)
            .iter()
            .find(|v| v.entry.name == name)
            .map(|v| v.state)
    }
}

/// Starting and stopping replicas through the hosts' agents.
pub struct RemoteAgents {
    pub watch: Arc<HostWatch>,
}

impl RemoteAgents {
    fn statuses(&self) -> Vec<(AgentEntry, Result<AgentStatus, String>)> {
        let t = Duration::from_millis(self.watch.cfg.poll_timeout_ms * 4);
        let entries = self.watch.entries();
        let answers = self.watch.poll_all(&entries, t);
        entries
            .into_iter()
            .zip(answers)
            .map(|(e, (poll, st))| {
                let s = match (poll, st) {
                    (_, Some(st)) => Ok(st),
                    (Poll::Refused(w) | Poll::Silent(w), None) => Err(w),
                    (Poll::Answered, None) => Err("no status".into()),
                };
                (e, s)
            })
            .collect()
    }

    fn slow_client(&self, e: &AgentEntry) -> Result<Client, AgentError> {
        self.watch
            .client(e, pliant_proto::client::SLOW_TIMEOUT)
            .map_err(|w| AgentError(format!("agent {}: {w}", e.name)))
    }
}

/// Which host a new replica goes to: among reachable agents with a slot not running, the one
/// running the fewest replicas (spreading replicas, and so primaries and backups, over hosts);
/// ties to the first listed. Returns (agent position, slot name).
pub fn choose_slot(statuses: &[Option<&AgentStatus>]) -> Option<(usize, String)> {
    statuses
        .iter()
        .enumerate()
        .filter_map(|(k, s)| {
            let s = (*s)?;
            let running = s
                .slots
                .iter()
                .filter(|x| x.state == SlotState::Running)
                .count();
            let free = s
                .slots
                .iter()
                .find(|x| x.state != SlotState::Running && index_of(&x.replica).is_some())?;
            Some((running, k, free.replica.clone()))
        })
        .min_by_key(|(running, k, _)| (*running, *k))
        .map(|(_, k, name)| (k, name))
}

impl Agent for RemoteAgents {
    fn add_replica(&mut self) -> Result<Started, AgentError> {
        let t0 = Instant::now();
        let sts = self.statuses();
        let view: Vec<Option<&AgentStatus>> = sts.iter().map(|(_, s)| s.as_ref().ok()).collect();
        let Some((k, slot)) = choose_slot(&view) else {
            let why: Vec<String> = sts
                .iter()
                .map(|(e, s)| match s {
                    Ok(_) => format!("{}: every slot runs", e.name),
                    Err(w) => format!("{}: {w}", e.name),
                })
                .collect();
            return Err(AgentError(format!(
                "no host can start a replica ({})",
                why.join("; ")
            )));
        };
        let e = &sts[k].0;
        let st: AgentStatus = self
            .slow_client(e)?
            .ask(&AgentRequest::Start {
                replica: slot.clone(),
            })
            .map_err(|x| AgentError(format!("agent {}: start {slot}: {x}", e.name)))?;
        let s = st
            .slot(&slot)
            .ok_or_else(|| AgentError(format!("agent {} lost slot {slot}", e.name)))?;
        Ok(Started {
            index: index_of(&slot).unwrap_or(0),
            socket: PathBuf::from(&s.control),
            ready_ms: t0.elapsed().as_millis() as u64,
        })
    }

    /// Stops replica `index` through the agent that runs it. Done also when every agent
    /// answered and none has it (nothing runs it any more); an error while an agent that may
    /// run it is silent (a host cut off keeps its processes).
    fn remove_replica(&mut self, index: u32) -> Result<(), AgentError> {
        let name = format!("r{index}");
        let mut silent = Vec::new();
        for (e, s) in self.statuses() {
            match s {
                Ok(s) if s.slot(&name).is_some() => {
                    self.slow_client(&e)?
                        .call(&AgentRequest::Stop {
                            replica: name.clone(),
                        })
                        .map_err(|x| AgentError(format!("agent {}: stop {name}: {x}", e.name)))?;
                    return Ok(());
                }
                Ok(_) => {}
                Err(w) => silent.push(format!("{}: {w}", e.name)),
            }
        }
        if silent.is_empty() {
            return Ok(());
        }
        Err(AgentError(format!(
            "{name}: no reachable agent runs it, and these may: {}",
            silent.join("; ")
        )))
    }

    fn existing(&self) -> Result<Vec<(u32, PathBuf)>, AgentError> {
        let mut v = Vec::new();
        for (e, s) in self.statuses() {
            let s = s.map_err(|w| AgentError(format!("agent {}: {w}", e.name)))?;
            v.extend(
                s.slots
                    .iter()
                    .filter(|x| x.state == SlotState::Running)
                    .filter_map(|x| Some((index_of(&x.replica)?, PathBuf::from(&x.control)))),
            );
        }
        v.sort();
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pliant_proto::agent::SlotStatus;

    #[test]
    fn process_death_agent_death_and_host_death_are_told_apart() {
        let d = Duration::from_millis(1000);
        let silent = Poll::Silent("timed out".into());
        let ms = Duration::from_millis;
        assert_eq!(classify(&Poll::Answered, ms(0), false, d), HostState::Up);
        // The kernel refused: the host lives, only its agent is gone.
        let refused = Poll::Refused("connection refused".into());
        assert_eq!(classify(&refused, ms(0), false, d), HostState::AgentDown);
        assert_eq!(classify(&refused, ms(5000), false, d), HostState::AgentDown);
        // Silent: unreachable until dead_after, and while any of its replicas answers.
        assert_eq!(classify(&silent, ms(999), false, d), HostState::Unreachable);
        assert_eq!(classify(&silent, ms(1000), false, d), HostState::Dead);
        assert_eq!(
            classify(&silent, ms(60_000), true, d),
            HostState::Unreachable
        );
    }

    #[test]
    fn the_hosts_section_is_checked() {
        let h = |poll: u64, dead: u64, ep: &str| HostsSection {
            poll_ms: poll,
            dead_after_ms: dead,
            poll_timeout_ms: 250,
            agent: vec![AgentEntry {
                name: "h1".into(),
                endpoint: ep.into(),
            }],
        };
        assert!(h(50, 1000, "10.0.0.1:7410").check(true).is_ok());
        let e = |x: HostsSection, id: bool| x.check(id).unwrap_err();
        assert!(e(h(50, 1000, "10.0.0.1:7410"), false).contains("controller.identity"));
        assert!(e(h(50, 60, "/run/a.sock"), false).contains("dead_after_ms"));
        assert!(e(h(1, 1000, "/run/a.sock"), false).contains("poll_ms"));
        assert!(e(h(50, 1000, "nowhere"), true).contains("endpoint"));
        let mut twice = h(50, 1000, "/run/a.sock");
        twice.agent.push(twice.agent[0].clone());
        assert!(e(twice, true).contains("twice"));
        let none = HostsSection {
            agent: vec![],
            ..h(50, 1000, "/run/a.sock")
        };
        assert!(e(none, true).contains("no [[hosts.agent]]"));
    }

    fn st(slots: &[(&str, SlotState)]) -> AgentStatus {
        AgentStatus {
            agent: "h".into(),
            term: 0,
            deposed_refused: 0,
            now_unix_ms: 0,
            probe_ms: 5,
            fabric: None,
            slots: slots
                .iter()
                .map(|(n, s)| SlotStatus {
                    replica: n.to_string(),
                    state: *s,
                    control: format!("/run/{n}.sock"),
                    serving: *s == SlotState::Running,
                    pid: None,
                    since_unix_ms: 0,
                    exit: None,
                    deaths: 0,
                })
                .collect(),
        }
    }

    #[test]
    fn a_new_replica_goes_to_the_reachable_host_running_fewest() {
        use SlotState::*;
        let h1 = st(&[("r1", Running), ("r4", Stopped)]);
        let h2 = st(&[("r2", Running), ("r5", Died)]);
        let h3 = st(&[("r3", Stopped), ("r6", Stopped)]);
        assert_eq!(
            choose_slot(&[Some(&h1), Some(&h2), Some(&h3)]),
            Some((2, "r3".into()))
        );
        // h3 unreachable: the first of the tied hosts; a died slot is free.
        assert_eq!(
            choose_slot(&[Some(&h1), Some(&h2), None]),
            Some((0, "r4".into()))
        );
        let full = st(&[("r1", Running)]);
        let odd = st(&[("db", Stopped)]);
        assert_eq!(choose_slot(&[Some(&full), Some(&odd), None]), None);
        assert_eq!(index_of("r12"), Some(12));
        assert_eq!(index_of("r0"), None);
        assert_eq!(index_of("x1"), None);
    }
}
