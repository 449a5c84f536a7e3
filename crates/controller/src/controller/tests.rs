//! Orchestration tests against fake replicas (real unix control sockets, in-memory flows), an
//! in-memory agent and in-memory steering: deterministic, no namespaces needed.

use super::*;
use crate::agent::{AgentError, Started};
use crate::migrator::{Outcome, SteerUpdate};
use crate::steering::MemSteering;
use crate::store::FileStore;
use pliant_proto::link::{Link, MAX_REQUEST};
use pliant_proto::{reply, Request};
use std::collections::HashMap;
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

#[derive(Default)]
struct FakeState {
    flows: Vec<FlowEntry>,
    port_blocks: Option<Value>,
    merged: Vec<Value>,
    down: bool,
    // HA (the runtime's side of the contract, faked).
    token: u64,
    standby: BTreeMap<String, Vec<FlowEntry>>,
    protects: Vec<Value>,
    activations: Vec<(String, u64)>,
    needs_backup: bool,
    /// The backup whose link died when `needs_backup` (reported in `ha_status`).
    lost_backup: Option<String>,
    // FTMB (the runtime's side of ftmb-contract.md, faked): where the workers log, the
    // `ftmb_protect` requests seen, the flows this replica can recover per primary it hosts.
    ftmb_logger: Option<String>,
    ftmb_protects: Vec<String>,
    ftmb_hosted: BTreeMap<String, Vec<FlowEntry>>,
    ftmb_activations: Vec<String>,
    /// Requests (by name) taken and never answered: the connection stays open (a hung
    /// replica, or a lost answer) until the client gives up.
    hang: Vec<&'static str>,
    /// The connections of those requests, as the fake holds them.
    held: Vec<std::os::unix::net::UnixStream>,
    /// Requests answered, by name, in order.
    served: Vec<&'static str>,
}

impl FakeState {
    /// Whether the client of held request `n` still waits for its answer (its side of the
    /// connection open), rather than having given up and closed it.
    fn held_open(&self, n: usize) -> bool {
        use std::os::fd::AsRawFd;
        let mut b = [0u8; 1];
        // SAFETY: recv(2) into a 1-byte buffer on a socket this state owns.
        let n = unsafe {
            libc::recv(
                self.held[n].as_raw_fd(),
                b.as_mut_ptr().cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        n != 0 // 0: end of stream (the client closed); -1 EAGAIN: open, nothing sent
    }
}

type Shared = Arc<Mutex<FakeState>>;

/// The runtime's default `max_listed_flows`.
const FAKE_MAX_LISTED: usize = 1000;

struct FakeReplica {
    path: PathBuf,
    state: Shared,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FakeReplica {
    fn start(dir: &Path, index: u32) -> FakeReplica {
        let path = dir.join(format!("r{index}.sock"));
        let _ = std::fs::remove_file(&path);
        let l = UnixListener::bind(&path).unwrap();
        l.set_nonblocking(true).unwrap();
        let state: Shared = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let (st, sp) = (Arc::clone(&state), Arc::clone(&stop));
        let thread = std::thread::spawn(move || loop {
            if sp.load(Ordering::SeqCst) {
                return;
            }
            let Ok((s, _)) = l.accept() else {
                std::thread::sleep(Duration::from_millis(2));
                continue;
            };
            s.set_nonblocking(false).unwrap();
            let peer = s.try_clone().unwrap();
            // The runtime's local mode of the control protocol: one typed request per frame.
            let mut link = Link::local(pliant_wire::Stream::Unix(s), MAX_REQUEST);
            let req = match link.recv().map(Request::parse) {
                Ok(Ok(r)) => r,
                Ok(Err(e)) => {
                    let _ = link.send(reply::error(e).to_string().as_bytes());
                    continue;
                }
                Err(_) => continue,
            };
            let mut g = st.lock().unwrap();
            if g.down {
                continue; // drop the connection: a missed heartbeat
            }
            if g.hang.contains(&req.name()) {
                g.held.push(peer); // never answered, kept open
                continue;
            }
            g.served.push(req.name());
            let ans = match req {
                Request::Stats => reply::ok(&reply::Stats {
                    replica: format!("r{index}"),
                    table: reply::TableBrief {
                        flows: g.flows.len() as u64,
                    },
                    ports: reply::Ports {
                        inside: reply::PortBrief { rx_frames: 0 },
                        outside: reply::PortBrief { rx_frames: 0 },
                    },
                }),
                // Bounded as the runtime's listing is (`max_listed_flows`), so a test can put
                // a flow out of the listing's reach.
                Request::Flows => {
                    let listed = &g.flows[..g.flows.len().min(FAKE_MAX_LISTED)];
                    reply::ok(&reply::FlowList {
                        total: g.flows.len() as u64,
                        listed: listed.len() as u64,
                        flows: listed.to_vec(),
                    })
                }
                Request::Flow { key } => {
                    let hit = g.flows.iter().find(|f| {
                        std::iter::once(&f.key)
                            .chain(f.aliases.iter())
                            .any(|s| s.parse::<FlowKey>().ok() == Some(key))
                    });
                    reply::ok(&reply::FlowLookup {
                        found: hit.is_some(),
                        flow: hit.cloned(),
                    })
                }
                Request::SetPortBlocks { blocks } => {
                    g.port_blocks = Some(serde_json::to_value(&blocks).unwrap());
                    json!({"ok": true})
                }
                Request::SharedExport => reply::ok(&reply::SharedExport {
                    bytes: vec![index as u8],
                }),
                Request::SharedMerge { bytes } => {
                    g.merged.push(json!(pliant_proto::request::to_hex(&bytes)));
                    json!({"ok": true})
                }
                Request::Protect { token: t, policy } => {
                    if t < g.token {
                        reply::error(format!("stale token {t} < {}", g.token))
                    } else {
                        g.token = t;
                        let policy = serde_json::to_value(&policy).unwrap();
                        g.protects.push(policy.clone());
                        g.needs_backup = false;
                        let group = |b: &Value| reply::GroupBrief {
                            id: 1,
                            name: "g".into(),
                            backup: b["name"].as_str().unwrap().into(),
                            hz: 100,
                        };
                        let groups: Vec<reply::GroupBrief> = match policy["kind"].as_str() {
                            Some("chords") => policy["backups"]
                                .as_array()
                                .unwrap()
                                .iter()
                                .map(group)
                                .collect(),
                            Some("single") => vec![group(&policy["backup"])],
                            _ => vec![],
                        };
                        reply::ok(&reply::Protect { groups })
                    }
                }
                Request::HaStatus => reply::ok(&reply::HaStatus {
                    token: g.token,
                    groups: vec![reply::GroupStatus {
                        backup: g.lost_backup.clone().unwrap_or_default(),
                        state: if g.needs_backup { "unprotected" } else { "up" }.into(),
                        needs_backup: g.needs_backup,
                    }],
                    standby: g
                        .standby
                        .iter()
                        .map(|(p, f)| reply::StandbyBrief {
                            primary: p.clone(),
                            flows: f.len() as u64,
                        })
                        .collect(),
                    output: reply::Audit {
                        audit_checked: 1,
                        audit_violations: 0,
                    },
                }),
                Request::Activate {
                    primary: p,
                    token: t,
                } => {
                    g.token = g.token.max(t);
                    g.activations.push((p.clone(), t));
                    let got = g.standby.remove(&p).unwrap_or_default();
                    g.flows.extend(got.iter().cloned());
                    reply::ok(&reply::Activate {
                        activated: got.len() as u64,
                        failed: 0,
                        errors: vec![],
                        flows: got,
                    })
                }
                Request::FtmbProtect { logger: l, .. } => {
                    g.ftmb_protects.push(l.clone());
                    g.ftmb_logger = Some(l);
                    json!({"ok": true})
                }
                Request::FtmbStatus => reply::ok(&reply::FtmbStatus {
                    logger: g.ftmb_logger.clone(),
                    protected: g.ftmb_logger.is_some(),
                    snapshots: 3,
                    last_snapshot_acked: Some(3),
                    last_error: None,
                    local_audit: reply::Audit::default(),
                    hosting: json!({"masters": g.ftmb_hosted.keys()
                        .map(|p| (p.clone(), json!({"logger": {"outputs_released": 2,
                            "audit_checked": 2, "audit_violations": 0}})))
                        .collect::<serde_json::Map<String, Value>>()}),
                }),
                Request::FtmbActivate { primary: p } => {
                    g.ftmb_activations.push(p.clone());
                    match g.ftmb_hosted.remove(&p) {
                        Some(got) => {
                            g.flows.extend(got.iter().cloned());
                            let mut v = reply::ok(&reply::Activate {
                                activated: got.len() as u64,
                                failed: 0,
                                errors: vec![],
                                flows: got,
                            });
                            let figures = serde_json::to_value(reply::FtmbActivate {
                                replay_ms: 1.5,
                                total_ms: 2.0,
                                replayed_packets: 7,
                                suppressed: 0,
                            })
                            .unwrap();
                            v.as_object_mut()
                                .unwrap()
                                .extend(figures.as_object().unwrap().clone());
                            v
                        }
                        None => reply::error(format!("no logger for {p}")),
                    }
                }
                Request::DropStandby { primary: p } => {
                    g.standby.remove(&p);
                    json!({"ok": true})
                }
                Request::Rejoin { token: t } if t <= g.token => {
                    reply::error(format!("stale token {t}: this replica's is {}", g.token))
                }
                Request::Rejoin { token: t } => {
                    g.token = t;
                    let r = reply::Rejoin {
                        flows_dropped: g.flows.len() as u64,
                        standby_dropped: g.standby.values().map(|v| v.len() as u64).sum(),
                        token: t,
                        ..Default::default()
                    };
                    g.flows.clear();
                    g.standby.clear();
                    reply::ok(&r)
                }
                Request::MigrateAbort { keys } => json!({"ok": true, "aborted": keys.len()}),
                other => reply::error(format!("the fake does not serve {}", other.name())),
            };
            drop(g);
            let _ = link.send(ans.to_string().as_bytes());
        });
        FakeReplica {
            path,
            state,
            stop,
            thread: Some(thread),
        }
    }

    /// What SIGKILL leaves: the socket file stays, nothing listens (ECONNREFUSED).
    fn kill(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
    }
}

impl Drop for FakeReplica {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Removes the test's directory when the last [`World`] clone goes (also on panic).
#[derive(Default)]
struct DirGuard(PathBuf);

impl Drop for DirGuard {
    fn drop(&mut self) {
        if !self.0.as_os_str().is_empty() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// Every fake replica by socket path, shared by the agent and the migrator.
#[derive(Clone, Default)]
struct World {
    dir: PathBuf,
    _guard: Arc<DirGuard>,
    replicas: Arc<Mutex<HashMap<PathBuf, FakeReplica>>>,
    by_index: Arc<Mutex<BTreeMap<u32, PathBuf>>>,
}

impl World {
    fn new(tag: &str) -> World {
        let dir = std::env::temp_dir().join(format!("pliant-ctl-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        World {
            _guard: Arc::new(DirGuard(dir.clone())),
            dir,
            ..Default::default()
        }
    }
    fn add(&self, index: u32) -> PathBuf {
        let r = FakeReplica::start(&self.dir, index);
        let p = r.path.clone();
        self.replicas.lock().unwrap().insert(p.clone(), r);
        self.by_index.lock().unwrap().insert(index, p.clone());
        p
    }
    fn state(&self, index: u32) -> Shared {
        let p = self.by_index.lock().unwrap()[&index].clone();
        Arc::clone(&self.replicas.lock().unwrap()[&p].state)
    }
    fn flows(&self, index: u32) -> usize {
        self.state(index).lock().unwrap().flows.len()
    }
    fn fill(&self, index: u32, range: std::ops::Range<u16>) {
        let s = self.state(index);
        let mut g = s.lock().unwrap();
        for p in range {
            g.flows.push(flow(p));
        }
    }
}

fn flow(p: u16) -> FlowEntry {
    FlowEntry {
        key: format!("udp 10.77.1.2:{p} <-> 10.77.2.2:9000"),
        aliases: vec![format!("udp 10.77.2.1:{} <-> 10.77.2.2:9000", 20000 + p)],
    }
}

struct FakeAgent(World, u32);

impl Agent for FakeAgent {
    fn add_replica(&mut self) -> std::result::Result<Started, AgentError> {
        self.1 += 1;
        let socket = self.0.add(self.1);
        Ok(Started {
            index: self.1,
            socket,
            ready_ms: 1,
        })
    }
    fn remove_replica(&mut self, index: u32) -> std::result::Result<(), AgentError> {
        let p = self.0.by_index.lock().unwrap().remove(&index);
        if let Some(p) = p {
            self.0.replicas.lock().unwrap().remove(&p);
        }
        Ok(())
    }
    fn existing(&self) -> std::result::Result<Vec<(u32, PathBuf)>, AgentError> {
        Ok(Vec::new())
    }
}

/// Moves flow entries between fake replicas, switching steering first as the real one does.
struct FakeMigrator(World);

impl Migrator for FakeMigrator {
    fn migrate(
        &self,
        src: &Path,
        dst: &Path,
        flows: &[FlowEntry],
        steer: &mut SteerUpdate<'_>,
    ) -> std::result::Result<Outcome, MigrateError> {
        steer(&[]).map_err(MigrateError)?;
        let reps = self.0.replicas.lock().unwrap();
        let (s, d) = (&reps[src].state, &reps[dst].state);
        let mut moved = 0;
        let mut failed = Vec::new();
        for f in flows {
            // A flow on port 666 is "busy" at the source and stays there (refcount never 0).
            if f.key.contains(":666 ") {
                failed.push(f.key.clone());
                continue;
            }
            let mut sg = s.lock().unwrap();
            if let Some(pos) = sg.flows.iter().position(|x| x == f) {
                let e = sg.flows.remove(pos);
                drop(sg);
                d.lock().unwrap().flows.push(e);
                moved += 1;
            }
        }
        Ok(Outcome {
            moved,
            failed,
            detail: Value::Null,
        })
    }
}

/// Steering the test can inspect while the controller owns it.
#[derive(Clone, Default)]
struct SharedSteer(Arc<Mutex<MemSteering>>);

impl Steering for SharedSteer {
    fn add_replica(&mut self, i: u32) -> crate::steering::Result<()> {
        self.0.lock().unwrap().add_replica(i)
    }
    fn set_live(&mut self, i: u32, l: bool) -> crate::steering::Result<()> {
        self.0.lock().unwrap().set_live(i, l)
    }
    fn set_ring(&mut self, live: &[u32]) -> crate::steering::Result<()> {
        self.0.lock().unwrap().set_ring(live)
    }
    fn set_exceptions(&mut self, e: &[(FlowKey, u32)]) -> crate::steering::Result<()> {
        self.0.lock().unwrap().set_exceptions(e)
    }
    fn remove_exceptions(&mut self, k: &[FlowKey]) -> crate::steering::Result<usize> {
        self.0.lock().unwrap().remove_exceptions(k)
    }
    fn exceptions(&self) -> crate::steering::Result<Vec<(FlowKey, u32)>> {
        self.0.lock().unwrap().exceptions()
    }
    fn demote_exceptions(&mut self, e: &[(FlowKey, u32)]) -> crate::steering::Result<usize> {
        self.0.lock().unwrap().demote_exceptions(e)
    }
    fn set_port_owner(
        &mut self,
        r: std::ops::RangeInclusive<u16>,
        o: Option<u32>,
    ) -> crate::steering::Result<()> {
        self.0.lock().unwrap().set_port_owner(r, o)
    }
    fn flush_pins(&mut self, i: u32) -> crate::steering::Result<usize> {
        self.0.lock().unwrap().flush_pins(i)
    }
    fn nat_addrs(&self) -> Vec<std::net::IpAddr> {
        self.0.lock().unwrap().nat_addrs()
    }
    fn set_fenced(&mut self, i: u32, f: bool) -> crate::steering::Result<()> {
        self.0.lock().unwrap().set_fenced(i, f)
    }
    fn stats(&self) -> Value {
        self.0.lock().unwrap().stats()
    }
}

fn setup(tag: &str, n: u32, policy: Policy) -> (World, SharedSteer, Controller) {
    setup_with(tag, n, policy, HaConfig::off())
}

fn setup_with(tag: &str, n: u32, policy: Policy, ha: HaConfig) -> (World, SharedSteer, Controller) {
    setup_tuned(tag, n, policy, ha, |_| {})
}

fn setup_tuned(
    tag: &str,
    n: u32,
    policy: Policy,
    ha: HaConfig,
    tune: impl FnOnce(&mut Settings),
) -> (World, SharedSteer, Controller) {
    setup_on(tag, n, policy, ha, tune, Box::new(FileStore::in_memory()))
}

fn setup_on(
    tag: &str,
    n: u32,
    policy: Policy,
    ha: HaConfig,
    tune: impl FnOnce(&mut Settings),
    store: Box<dyn crate::store::Store>,
) -> (World, SharedSteer, Controller) {
    let w = World::new(tag);
    let statics: Vec<(u32, PathBuf)> = (1..=n).map(|i| (i, w.add(i))).collect();
    let steer = SharedSteer::default();
    let mut settings = test_settings(ha);
    tune(&mut settings);
    let c = Controller::new(
        settings,
        store,
        Box::new(steer.clone()),
        Some(Box::new(FakeAgent(w.clone(), n))),
        Box::new(FakeMigrator(w.clone())),
        statics,
        Some(policy),
    )
    .unwrap();
    (w, steer, c)
}

fn test_settings(ha: HaConfig) -> Settings {
    Settings {
        heartbeat: Duration::from_millis(10),
        dead_after_missed: 3,
        rpc_timeout: Duration::from_secs(2),
        heartbeat_timeout: Duration::from_millis(500),
        port_blocks: Some((PortBlocks::new(20000, 59999, 4000).unwrap(), 1)),
        ha,
        control: rc::Dialer::default(),
    }
}

/// A controller on the store file at `path` (one "restart" of it), HA per `ha`.
fn restarted(w: &World, statics: &[(u32, PathBuf)], path: &Path, ha: HaConfig) -> Controller {
    Controller::new(
        Settings {
            ha,
            ..Settings::default()
        },
        Box::new(FileStore::open(path).unwrap()),
        Box::new(MemSteering::default()),
        None,
        Box::new(FakeMigrator(w.clone())),
        statics.to_vec(),
        Some(manual()),
    )
    .unwrap()
}

fn manual() -> Policy {
    Policy {
        auto: false,
        cooldown_ms: 0,
        high_water_flows: 100,
        low_water_flows: 40,
        ..Policy::default()
    }
}

#[test]
fn start_up_installs_ring_and_disjoint_port_blocks() {
    let (w, steer, c) = setup("startup", 2, manual());
    let s = steer.0.lock().unwrap();
    assert_eq!(s.ring, vec![1, 2]);
    assert_eq!(s.port_owner.get(&20000), Some(&1));
    assert_eq!(s.port_owner.get(&24000), Some(&2));
    assert_eq!(s.port_owner.get(&28000), None);
    drop(s);
    // The replicas were told their blocks.
    assert_eq!(
        w.state(1).lock().unwrap().port_blocks,
        Some(json!([[20000, 23999]]))
    );
    assert_eq!(
        w.state(2).lock().unwrap().port_blocks,
        Some(json!([[24000, 27999]]))
    );
    assert_eq!(c.status()["replicas"].as_array().unwrap().len(), 2);
}

#[test]
fn missed_heartbeats_kill_a_replica_and_take_it_out_of_the_ring() {
    let (w, steer, c) = setup("heartbeat", 2, manual());
    w.fill(1, 0..5);
    c.heartbeat_once();
    assert_eq!(c.loads()[0].flows, 5);
    w.state(2).lock().unwrap().down = true;
    for _ in 0..2 {
        c.heartbeat_once();
    }
    assert_eq!(
        c.loads().len(),
        2,
        "two misses are not yet death (dead_after_missed = 3)"
    );
    c.heartbeat_once();
    assert_eq!(c.loads().len(), 1);
    assert_eq!(steer.0.lock().unwrap().ring, vec![1]);
    assert_eq!(steer.0.lock().unwrap().live.get(&2), Some(&false));
    // It comes back: live again and in the ring.
    w.state(2).lock().unwrap().down = false;
    c.heartbeat_once();
    assert_eq!(steer.0.lock().unwrap().ring, vec![1, 2]);
    assert_eq!(c.counters.replicas_died.load(Ordering::Relaxed), 1);
}

/// Waits (bounded: a huge margin, never reached when things work) until `ready`, or until
/// `round` ended; returns whether `ready` held.
fn wait_during(round: &std::thread::ScopedJoinHandle<'_, ()>, ready: impl Fn() -> bool) -> bool {
    let limit = Instant::now() + Duration::from_secs(60);
    while Instant::now() < limit {
        if ready() {
            return true;
        }
        if round.is_finished() {
            return ready();
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    false
}

fn beats(c: &Controller, i: u32) -> (u64, u32) {
    let st = lock(&c.state);
    let h = &st.replicas[&i].1;
    (h.beats, h.missed)
}

/// One heartbeat round asks every replica at once. r1 and r3 take the request and never
/// answer; r2's and r4's heartbeats are recorded while both silent requests still wait for
/// their answers (their connections open: no timeout has expired), so the round lasts about
/// one heartbeat bound however many replicas are silent. Asked in turn, r2 would be asked only
/// after r1's request timed out and its connection was closed, r4 after r3's.
#[test]
fn a_heartbeat_round_asks_every_replica_at_once_so_silent_ones_delay_no_other() {
    let (w, _s, c) = setup_tuned("hb-parallel", 4, manual(), HaConfig::off(), |s| {
        s.heartbeat_timeout = Duration::from_secs(2);
    });
    for i in [1, 3] {
        w.state(i).lock().unwrap().hang = vec!["stats"];
    }
    let held = |i: u32| w.state(i).lock().unwrap().held.len();
    std::thread::scope(|sc| {
        let round = sc.spawn(|| c.heartbeat_once());
        let ready = wait_during(&round, || {
            beats(&c, 2).0 == 1 && beats(&c, 4).0 == 1 && held(1) == 1 && held(3) == 1
        });
        assert!(
            ready,
            "r2 and r4 recorded, r1 and r3 asked, before the round ended"
        );
        for i in [1, 3] {
            assert!(
                w.state(i).lock().unwrap().held_open(0),
                "r{i}'s request still waits for its answer while r2 and r4 are recorded"
            );
        }
        round.join().unwrap();
    });
    assert_eq!((beats(&c, 2), beats(&c, 4)), ((1, 0), (1, 0)));
    assert_eq!((beats(&c, 1), beats(&c, 3)), ((0, 1), (0, 1)));
    for i in [1, 3] {
        assert!(
            !w.state(i).lock().unwrap().held_open(0),
            "r{i}: the round ended when its heartbeat gave up"
        );
    }
}

/// The HA status poll (with the heartbeats) asks every member at once too: r1 takes its
/// `ha_status` and never answers, r2 and r3 have answered theirs while r1's still waits.
#[test]
fn the_ha_status_poll_asks_every_member_at_once() {
    let ha = HaConfig {
        reprotect_min_ms: 600_000,
        ..HaConfig::default()
    };
    let (w, _s, c) = setup_tuned("poll-parallel", 3, manual(), ha, |s| {
        s.heartbeat_timeout = Duration::from_secs(2);
    });
    w.state(1).lock().unwrap().hang = vec!["ha_status"];
    let polled = |i: u32| w.state(i).lock().unwrap().served.contains(&"ha_status");
    std::thread::scope(|sc| {
        let round = sc.spawn(|| c.heartbeat_once());
        let ready = wait_during(&round, || {
            polled(2) && polled(3) && w.state(1).lock().unwrap().held.len() == 1
        });
        assert!(ready, "r2 and r3 polled, r1 asked, before the round ended");
        assert!(
            w.state(1).lock().unwrap().held_open(0),
            "r1's poll still waits for its answer while r2 and r3 have answered"
        );
        round.join().unwrap();
    });
    // The heartbeats themselves were answered: nobody missed one.
    assert_eq!((beats(&c, 1).1, beats(&c, 2).1, beats(&c, 3).1), (0, 0, 0));
}

/// A member that missed its last heartbeat is not polled (it would hold the round for a
/// whole bound); it is again once it answers.
#[test]
fn a_member_that_missed_its_heartbeat_is_not_polled() {
    let (w, _s, c) = setup_with("poll-skip", 2, manual(), HaConfig::default());
    w.state(2).lock().unwrap().hang = vec!["stats"];
    c.heartbeat_once();
    assert_eq!(beats(&c, 2), (0, 1));
    let g = w.state(2);
    assert!(!g.lock().unwrap().served.contains(&"ha_status"));
    assert!(w.state(1).lock().unwrap().served.contains(&"ha_status"));
    g.lock().unwrap().hang.clear();
    c.heartbeat_once();
    assert!(g.lock().unwrap().served.contains(&"ha_status"));
}

#[test]
fn migrate_moves_flows_and_steers_every_key_and_alias() {
    let (w, steer, c) = setup("migrate", 2, manual());
    w.fill(1, 0..10);
    let r = c.migrate_count(1, 2, 4).unwrap();
    assert_eq!(r["moved"], 4);
    assert_eq!(r["keys_steered"], 8, "4 keys + 4 aliases");
    assert_eq!((w.flows(1), w.flows(2)), (6, 4));
    let ex = steer.0.lock().unwrap().exceptions.clone();
    assert_eq!(ex.len(), 8);
    assert!(ex.values().all(|&r| r == 2));
    // By key: the alias form finds the flow too.
    let k = flow(0).aliases[0].clone();
    let r = c.migrate_key(&k, 2).unwrap();
    assert_eq!(r["moved"], 1);
    assert_eq!(w.flows(2), 5);
    assert!(matches!(
        c.migrate_key("udp 1.2.3.4:1 <-> 5.6.7.8:2", 2),
        Err(ControllerError::NoSuchFlow(_))
    ));
    assert!(matches!(
        c.migrate_key("garbage", 2),
        Err(ControllerError::BadRequest(_))
    ));
    assert!(matches!(
        c.migrate_count(1, 9, 1),
        Err(ControllerError::NoReplica(9))
    ));
    assert!(matches!(
        c.migrate_count(1, 1, 1),
        Err(ControllerError::BadRequest(_))
    ));
    assert_eq!(c.status()["epoch"], 2);
}

#[test]
fn a_flow_beyond_the_listing_bound_is_found_and_moved_by_key() {
    let (w, steer, c) = setup("migrate-deep", 2, manual());
    w.fill(1, 0..1500);
    let (total, listed) = c.list_flows(1).unwrap();
    assert_eq!((total, listed.len()), (1500, FAKE_MAX_LISTED));
    // Flow 1200 is not in r1's listing: only asking r1 for the key finds it.
    let deep = flow(1200);
    assert!(!listed.contains(&deep));
    let r = c.migrate_key(&deep.key, 2).unwrap();
    assert_eq!(r["moved"], 1, "{r}");
    assert_eq!((w.flows(1), w.flows(2)), (1499, 1));
    assert!(w.state(2).lock().unwrap().flows.contains(&deep));
    let ex = steer.0.lock().unwrap().exceptions.clone();
    for k in std::iter::once(&deep.key).chain(deep.aliases.iter()) {
        assert_eq!(ex.get(&k.parse::<FlowKey>().unwrap()), Some(&2), "{k}");
    }
    // An alias past the bound finds its flow too; asking again where it is now is a no-op.
    let alias = flow(1400).aliases[0].clone();
    assert_eq!(c.migrate_key(&alias, 2).unwrap()["moved"], 1);
    assert_eq!(c.migrate_key(&alias, 2).unwrap()["moved"], 0);
    assert!(matches!(
        c.migrate_key("udp 1.2.3.4:1 <-> 5.6.7.8:2", 2),
        Err(ControllerError::NoSuchFlow(_))
    ));
    // A replica that does not answer may hold the flow: that is said, not "no such flow".
    w.state(2).lock().unwrap().down = true;
    match c.migrate_key("udp 1.2.3.4:1 <-> 5.6.7.8:2", 1) {
        Err(ControllerError::Refused(m)) => assert!(m.contains("no answer from r2"), "{m}"),
        other => panic!("expected a refusal naming r2, got {other:?}"),
    }
}

#[test]
fn exceptions_of_ended_flows_are_collected() {
    let (w, steer, c) = setup("gc", 2, manual());
    w.fill(1, 0..3);
    c.migrate_count(1, 2, 3).unwrap();
    assert_eq!(steer.0.lock().unwrap().exceptions.len(), 6);
    assert_eq!(c.gc_exceptions().unwrap(), 0, "all flows still exist");
    w.state(2).lock().unwrap().flows.remove(0);
    let before: BTreeMap<FlowKey, u32> = steer.0.lock().unwrap().exceptions.clone();
    assert_eq!(c.gc_exceptions().unwrap(), 2);
    let st = steer.0.lock().unwrap();
    assert_eq!(st.exceptions.len(), 4);
    // The collected ones became pins to the same (live) replica, nothing else moved: a
    // connection that reused the tuple since the listing stays where it started.
    let gone: BTreeMap<FlowKey, u32> = before
        .into_iter()
        .filter(|(k, _)| !st.exceptions.contains_key(k))
        .collect();
    assert_eq!(gone.len(), 2);
    assert_eq!(st.pins, gone);
    assert!(gone.values().all(|o| *o == 2), "{gone:?}");
}

#[test]
fn scale_out_then_in_round_trip() {
    let (w, steer, c) = setup("scale", 1, manual());
    w.fill(1, 0..9);
    let r = c.scale_out().unwrap();
    assert_eq!(r["replica"], 2);
    assert_eq!(steer.0.lock().unwrap().ring, vec![1, 2]);
    assert_eq!(steer.0.lock().unwrap().port_owner.get(&24000), Some(&2));
    c.heartbeat_once();
    c.migrate_count(1, 2, 3).unwrap();
    c.heartbeat_once();
    // Scale in r2 (the emptier one): its flows come back to r1, combiners run, ports freed.
    let r = c.scale_in(None).unwrap();
    assert_eq!(r["replica"], 2);
    assert_eq!(r["moved"], 3);
    assert_eq!(w.flows(1), 9);
    assert_eq!(r["shared"]["merged_into"], 1);
    assert_eq!(w.state(1).lock().unwrap().merged, vec![json!("02")]);
    let s = steer.0.lock().unwrap();
    assert_eq!(s.ring, vec![1]);
    assert_eq!(s.live.get(&2), Some(&false));
    assert_eq!(s.port_owner.get(&24000), None);
    assert!(s.exceptions.values().all(|&r| r == 1));
    drop(s);
    assert!(
        !w.by_index.lock().unwrap().contains_key(&2),
        "agent removed r2"
    );
    assert!(matches!(c.scale_in(None), Err(ControllerError::Refused(_))));
}

#[test]
fn scale_out_respects_max_replicas() {
    let mut p = manual();
    p.max_replicas = 1;
    let (_w, _s, c) = setup("max", 1, p);
    assert!(matches!(c.scale_out(), Err(ControllerError::Refused(_))));
}

#[test]
fn hotspot_policy_scales_out_then_rebalances_evenly() {
    let mut p = manual();
    p.auto = true;
    let (w, _s, c) = setup("hotspot", 1, p);
    w.fill(1, 0..101);
    c.heartbeat_once();
    let d = c.policy_tick(false).unwrap();
    assert_eq!(d["decision"]["action"], "scale_out", "{d}");
    // The new replica receives one new flow (the ring now covers it).
    w.state(2).lock().unwrap().flows.push(flow(500));
    c.heartbeat_once();
    let d = c.policy_tick(false).unwrap();
    assert_eq!(d["decision"]["action"], "rebalance", "{d}");
    c.heartbeat_once();
    assert_eq!((w.flows(1), w.flows(2)), (51, 51));
    assert_eq!(
        c.policy_tick(false).unwrap()["decision"]["action"],
        "nothing"
    );
}

#[test]
fn policy_changes_are_validated_and_stored() {
    let (_w, _s, c) = setup("policy", 1, manual());
    let p = c
        .set_policy(&[
            ("high_water_flows".into(), "10".into()),
            ("low_water_flows".into(), "2".into()),
        ])
        .unwrap();
    assert_eq!(p.high_water_flows, 10);
    // All or nothing: a bad pair leaves the policy unchanged.
    assert!(c
        .set_policy(&[
            ("high_water_flows".into(), "20".into()),
            ("nope".into(), "1".into())
        ])
        .is_err());
    assert_eq!(c.policy().high_water_flows, 10);
    assert!(c
        .set_policy(&[("low_water_flows".into(), "50".into())])
        .is_err());
}

#[test]
fn api_requires_token_and_refuses_bad_requests() {
    let (w, _s, c) = setup("api", 2, manual());
    w.fill(1, 0..4);
    let c = Arc::new(c);
    let sock = w.dir.join("api.sock");
    let token = "tok-0123456789abcdef".to_string();
    let hc = Arc::clone(&c);
    let srv = crate::http::Server::start(
        &crate::http::Listen {
            unix: Some(sock.clone()),
            tcp: None,
        },
        token.clone(),
        Box::new(move |r| crate::api::handle(&hc, r)),
    )
    .unwrap();
    let ep = sock.display().to_string();
    let t = Duration::from_secs(5);
    let req = |tok: &str, m: &str, p: &str, b: Option<&str>| {
        crate::http::request(&ep, tok, m, p, b, t).unwrap()
    };
    assert_eq!(req("bad-token-000000000", "GET", "/v1/status", None).0, 401);
    assert_eq!(req(&token, "GET", "/v1/status", None).0, 200);
    // Metrics: the same token, Prometheus text rendered from the status.
    assert_eq!(req("bad-token-000000000", "GET", "/metrics", None).0, 401);
    let (st, text) = req(&token, "GET", "/metrics", None);
    assert_eq!(st, 200);
    assert!(
        text.contains("pliant_controller_replicas_alive 2\n"),
        "{text}"
    );
    assert!(text.contains("pliant_controller_store_ok 1\n"), "{text}");
    assert_eq!(req(&token, "GET", "/v1/nope", None).0, 404);
    assert_eq!(req(&token, "DELETE", "/v1/status", None).0, 405);
    assert_eq!(req(&token, "POST", "/v1/migrate", Some("{not json")).0, 400);
    assert_eq!(
        req(&token, "POST", "/v1/migrate", Some("{\"to\":\"rX\"}")).0,
        400
    );
    assert_eq!(
        req(
            &token,
            "POST",
            "/v1/migrate",
            Some("{\"to\":\"r9\",\"from\":1,\"count\":1}")
        )
        .0,
        404
    );
    let (st, body) = req(
        &token,
        "POST",
        "/v1/migrate",
        Some("{\"from\":\"r1\",\"to\":\"r2\",\"count\":2}"),
    );
    assert_eq!(st, 200, "{body}");
    assert_eq!(w.flows(2), 2);
    let (st, body) = req(&token, "GET", "/v1/flows?replica=r2", None);
    assert_eq!(st, 200);
    assert!(body.contains("10.77.1.2"), "{body}");
    let (st, body) = req(
        &token,
        "POST",
        "/v1/policy",
        Some("{\"set\":{\"high_water_flows\":7,\"low_water_flows\":\"1\"}}"),
    );
    assert_eq!(st, 200, "{body}");
    assert_eq!(c.policy().high_water_flows, 7);
    assert_eq!(
        req(
            &token,
            "POST",
            "/v1/policy",
            Some("{\"set\":{\"bogus\":1}}")
        )
        .0,
        400
    );
    assert_eq!(srv.stats.unauthorized.load(Ordering::Relaxed), 2);
}

#[test]
fn flows_that_fail_to_move_are_steered_back_to_the_source() {
    let (w, steer, c) = setup("failed", 2, manual());
    w.fill(1, 665..668);
    let r = c.migrate_count(1, 2, 3).unwrap();
    assert_eq!(r["moved"], 2);
    assert_eq!(r["failed"][0], flow(666).key);
    let ex = steer.0.lock().unwrap().exceptions.clone();
    let k666: FlowKey = flow(666).key.parse().unwrap();
    let a666: FlowKey = flow(666).aliases[0].parse().unwrap();
    let k665: FlowKey = flow(665).key.parse().unwrap();
    assert_eq!(ex.get(&k666), Some(&1), "key back at the source");
    assert_eq!(ex.get(&a666), Some(&1), "alias back at the source");
    assert_eq!(ex.get(&k665), Some(&2));
    assert_eq!((w.flows(1), w.flows(2)), (1, 2));
}

// ---------------------------------------------------------------- high availability

impl World {
    fn kill(&self, index: u32) {
        let p = self.by_index.lock().unwrap()[&index].clone();
        self.replicas.lock().unwrap().get_mut(&p).unwrap().kill();
    }
    /// A new process on the old socket (a revived old owner).
    fn revive(&self, index: u32) {
        let r = FakeReplica::start(&self.dir, index);
        self.replicas.lock().unwrap().insert(r.path.clone(), r);
    }
}

fn ha3(tag: &str) -> (World, SharedSteer, Controller) {
    // A re-protection gap no test run reaches: the rate limit is deterministic.
    let ha = HaConfig {
        reprotect_min_ms: 600_000,
        ..HaConfig::default()
    };
    let (w, steer, c) = setup_with(tag, 3, manual(), ha);
    // r1 holds 6 flows; r2 backs up 0..3, r3 backs up 3..6 (chords over two backups).
    w.fill(1, 0..6);
    w.state(2)
        .lock()
        .unwrap()
        .standby
        .insert("r1".into(), (0..3).map(flow).collect());
    w.state(3)
        .lock()
        .unwrap()
        .standby
        .insert("r1".into(), (3..6).map(flow).collect());
    let p = c.protect_all();
    assert_eq!(p["r1"]["backups"], json!(["r2", "r3"]), "{p}");
    (w, steer, c)
}

/// A replica failed over while it still ran (cut off, not dead) and is reachable again: it
/// rejoins under a newer token — only once it dropped everything is it unfenced, live, back
/// in the ring, protected and named as a backup again; it is no longer retired. A replica
/// that refuses stays failed over and fenced (counted, retried later).
#[test]
fn a_failed_over_replica_that_answers_again_rejoins_unfenced_and_protected() {
    let (w, steer, c) = ha3("rejoin");
    let rec = c.failover(1, "cut off (test)").unwrap();
    let token = rec["token"].as_u64().unwrap();
    assert_eq!(steer.0.lock().unwrap().fenced.get(&1), Some(&true));
    assert!(!steer.0.lock().unwrap().ring.contains(&1));
    // r1 still holds its six flows: it never died.
    assert_eq!(w.state(1).lock().unwrap().flows.len(), 6);
    c.rejoin_returned(&[1]);
    assert_eq!(c.counters.ha.rejoins.load(Ordering::Relaxed), 1);
    let g = w.state(1);
    let g = g.lock().unwrap();
    assert!(g.token > token, "rejoin under a newer token");
    assert!(g.flows.is_empty(), "dropped what failed over");
    assert!(g.protects.len() >= 2, "protected again: {:?}", g.protects);
    drop(g);
    {
        let s = steer.0.lock().unwrap();
        assert_eq!(s.fenced.get(&1), Some(&false));
        assert_eq!(s.live.get(&1), Some(&true));
        assert!(s.ring.contains(&1), "{:?}", s.ring);
    }
    assert_eq!(c.status()["ha"]["failed_over"], json!([]));
    let named = w
        .state(2)
        .lock()
        .unwrap()
        .protects
        .last()
        .unwrap()
        .to_string();
    assert!(
        named.contains("\"r1\""),
        "r2 names r1 as a backup again: {named}"
    );
    // Not failed over any more: nothing to do, and never retired.
    c.rejoin_returned(&[1]);
    assert_eq!(c.counters.ha.rejoins.load(Ordering::Relaxed), 1);
    assert_eq!(c.gc_exceptions().unwrap(), 0);
    assert_eq!(c.counters.ha.retired.load(Ordering::Relaxed), 0);

    // A replica that refuses (its token is newer than any we hand out) stays fenced.
    c.failover(2, "cut off (test)").unwrap();
    w.state(2).lock().unwrap().token = u64::MAX;
    c.rejoin_returned(&[2]);
    assert_eq!(c.counters.ha.rejoin_errors.load(Ordering::Relaxed), 1);
    assert_eq!(steer.0.lock().unwrap().fenced.get(&2), Some(&true));
    assert_eq!(c.status()["ha"]["failed_over"], json!([2]));
    // Paced: not asked again at once.
    c.rejoin_returned(&[2]);
    assert_eq!(c.counters.ha.rejoin_errors.load(Ordering::Relaxed), 1);
}

#[test]
fn protect_sends_each_replica_a_chords_policy_over_the_others() {
    let (w, _s, c) = ha3("protect");
    for (i, want) in [(1, ["r2", "r3"]), (2, ["r3", "r1"]), (3, ["r1", "r2"])] {
        let g = w.state(i);
        let g = g.lock().unwrap();
        let pol = g.protects.last().unwrap();
        assert_eq!(pol["kind"], "chords");
        assert_eq!(pol["hz"], 1000);
        let names: Vec<&str> = pol["backups"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, want, "r{i}");
        assert!(pol["backups"][0]["socket"]
            .as_str()
            .unwrap()
            .ends_with(".repl.sock"));
    }
    assert_eq!(c.counters.ha.protects.load(Ordering::Relaxed), 3);
}

#[test]
fn a_dead_primary_is_fenced_activated_on_its_backups_steered_and_survivors_reprotected() {
    let (w, steer, c) = ha3("failover");
    c.ha_watch_once();
    assert_eq!(
        c.counters.ha.failovers.load(Ordering::Relaxed),
        0,
        "all alive"
    );
    w.kill(1);
    c.ha_watch_once();
    assert_eq!(c.counters.ha.failovers.load(Ordering::Relaxed), 1);
    let s = steer.0.lock().unwrap().clone();
    assert_eq!(s.fenced.get(&1), Some(&true), "fenced");
    assert_eq!(s.live.get(&1), Some(&false));
    assert_eq!(s.ring, vec![2, 3], "out of the ring");
    // Every key and alias at the replica that activated it.
    for p in 0..6u16 {
        let want = if p < 3 { 2 } else { 3 };
        let f = flow(p);
        for k in std::iter::once(&f.key).chain(f.aliases.iter()) {
            assert_eq!(
                s.exceptions.get(&k.parse::<FlowKey>().unwrap()),
                Some(&want),
                "{k}"
            );
        }
    }
    // Both backups activated with the bumped token, and were re-protected with it over the
    // survivors only.
    for i in [2, 3] {
        let g = w.state(i);
        let g = g.lock().unwrap();
        assert_eq!(g.activations, vec![("r1".to_string(), 1)], "r{i}");
        assert_eq!(g.token, 1);
        let pol = g.protects.last().unwrap();
        let names: Vec<&str> = pol["backups"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, vec![if i == 2 { "r3" } else { "r2" }]);
        assert_eq!(g.flows.len(), 3);
    }
    let st = c.status();
    assert_eq!(st["ha"]["token"], 1);
    let rec = &st["ha"]["last_failover"];
    assert_eq!(rec["activated"], 6, "{rec}");
    assert_eq!(rec["keys_steered"], 12, "6 keys + 6 aliases");
    assert_eq!(rec["duplicates"], json!([]));
    for k in ["detect_ms", "activate_ms", "steer_ms", "failover_ms"] {
        assert!(rec[k].is_number(), "{k}: {rec}");
    }
    // Each re-protection answer says whom its policy named and when it was sent (the e2e kill
    // trials check from these that nothing sent after a detection names the dead replica).
    let detected = rec["detected_unix_ms"].as_u64().expect("detected_unix_ms");
    for (i, other) in [("r2", "r3"), ("r3", "r2")] {
        let p = &rec["reprotected"][i];
        assert_eq!(p["named"], json!([other]), "{rec}");
        let sent = p["sent_unix_ms"].as_u64().expect("sent_unix_ms");
        assert!(sent >= detected, "{rec}");
    }
    // Idempotent: a second detection or a heartbeat death does nothing more.
    c.ha_watch_once();
    assert!(c.failover(1, "again").unwrap()["note"].is_string());
    assert_eq!(c.counters.ha.failovers.load(Ordering::Relaxed), 1);
    // A revived old owner is never taken back: it stays fenced, dead and out of the ring.
    w.revive(1);
    for _ in 0..3 {
        c.heartbeat_once();
        c.ha_watch_once();
    }
    let s = steer.0.lock().unwrap().clone();
    assert_eq!(s.fenced.get(&1), Some(&true));
    assert_eq!(s.ring, vec![2, 3]);
    assert!(c.status()["replicas"][0]["failed_over"] == true);
    assert!(matches!(
        c.migrate_count(2, 1, 1),
        Err(ControllerError::Dead(1))
    ));
}

#[test]
fn a_flow_activated_by_two_survivors_is_reported_as_a_duplicate() {
    let (w, _s, c) = ha3("dup");
    // r3 kept a stale standby copy of flow 0 (it moved to r2's group since).
    w.state(3)
        .lock()
        .unwrap()
        .standby
        .get_mut("r1")
        .unwrap()
        .push(flow(0));
    w.kill(1);
    c.ha_watch_once();
    let rec = c.status()["ha"]["last_failover"].clone();
    assert_eq!(rec["duplicates"], json!([flow(0).key]), "{rec}");
    assert_eq!(
        c.counters.ha.duplicate_activations.load(Ordering::Relaxed),
        1
    );
}

#[test]
fn a_backup_that_lost_its_backup_is_reprotected_at_a_bounded_rate() {
    let (w, _s, c) = ha3("needs-backup");
    let before = w.state(1).lock().unwrap().protects.len();
    w.state(1).lock().unwrap().needs_backup = true;
    c.heartbeat_once();
    assert_eq!(w.state(1).lock().unwrap().protects.len(), before + 1);
    assert_eq!(c.counters.ha.reprotects.load(Ordering::Relaxed), 1);
    // Still reporting it right away (say the new protect raced): not again within the gap.
    w.state(1).lock().unwrap().needs_backup = true;
    c.heartbeat_once();
    assert_eq!(w.state(1).lock().unwrap().protects.len(), before + 1);
}

/// r3 dies; before the watch loop sees it, r1 reports that its link to r3 died. The poll
/// suspects r3, probes it, fails it over, and the failover re-protects the survivors over the
/// live ones: no protection sent after the kill names r3 (before, the poll re-protected r1
/// over a member list that still held r3).
#[test]
fn a_backup_reported_dead_is_failed_over_and_never_named_again() {
    let (w, _s, c) = ha3("suspect");
    let sent_before: Vec<usize> = (1..=2)
        .map(|i| w.state(i).lock().unwrap().protects.len())
        .collect();
    w.kill(3);
    {
        let s = w.state(1);
        let mut g = s.lock().unwrap();
        g.needs_backup = true;
        g.lost_backup = Some("r3".into());
    }
    c.heartbeat_once();
    let ha = &c.counters.ha;
    assert_eq!(ha.backups_suspected.load(Ordering::Relaxed), 1);
    assert_eq!(ha.failovers.load(Ordering::Relaxed), 1, "r3 failed over");
    assert_eq!(ha.protects_naming_unlive.load(Ordering::Relaxed), 0);
    for (i, before) in (1..=2).zip(sent_before) {
        let s = w.state(i);
        let g = s.lock().unwrap();
        let after = &g.protects[before..];
        assert!(!after.is_empty(), "r{i} re-protected");
        for p in after {
            assert!(
                !p.to_string().contains("\"r3\""),
                "r{i} protected with r3: {p}"
            );
        }
    }
    // The poll again: r1 is protected (by the failover), nothing is suspected, nothing sent.
    w.state(1).lock().unwrap().needs_backup = false;
    let n = w.state(1).lock().unwrap().protects.len();
    c.heartbeat_once();
    assert_eq!(w.state(1).lock().unwrap().protects.len(), n);
}

/// A protection decided from a status read before the replica's last protection started is
/// stale and deferred (the failover re-protected it meanwhile); a poll that interleaved with a
/// failover used to protect the replica a second time.
#[test]
fn a_poll_acting_on_a_status_older_than_the_last_protection_defers() {
    let (w, _s, c) = ha3("stale");
    let read = Instant::now();
    let n = w.state(1).lock().unwrap().protects.len();
    c.protect_all(); // a protection after the status was read
    let ans = c.protect_from_poll(1, read);
    assert_eq!(ans["deferred"], "stale_status", "{ans}");
    assert_eq!(w.state(1).lock().unwrap().protects.len(), n + 1);
    assert_eq!(c.counters.ha.protects_deferred.load(Ordering::Relaxed), 1);
}

#[test]
fn a_failed_replica_is_retired_once_none_of_its_flows_is_steered() {
    let (w, steer, c) = ha3("retire");
    w.kill(1);
    c.ha_watch_once();
    c.heartbeat_once();
    assert_eq!(
        steer.0.lock().unwrap().port_owner.get(&20000),
        Some(&1),
        "quarantined"
    );
    assert_eq!(
        c.gc_exceptions().unwrap(),
        0,
        "handed-over flows still live"
    );
    assert!(c.status()["ha"]["failed_over"] == json!([1]));
    // The flows end at their new owners.
    w.state(2).lock().unwrap().flows.clear();
    w.state(3).lock().unwrap().flows.clear();
    assert_eq!(c.gc_exceptions().unwrap(), 12);
    assert_eq!(c.counters.ha.retired.load(Ordering::Relaxed), 1);
    assert_eq!(
        steer.0.lock().unwrap().port_owner.get(&20000),
        None,
        "block released"
    );
    assert!(
        !w.by_index.lock().unwrap().contains_key(&1),
        "agent removed r1"
    );
    assert_eq!(c.status()["replicas"].as_array().unwrap().len(), 2);
    // A new replica may now take the block.
    c.scale_out().unwrap();
    assert_eq!(steer.0.lock().unwrap().port_owner.get(&20000), Some(&4));
}

#[test]
fn ha_api_shows_status_and_protects_with_validation() {
    let (w, _s, c) = ha3("ha-api");
    let c = Arc::new(c);
    let sock = w.dir.join("api.sock");
    let token = "tok-0123456789abcdef".to_string();
    let hc = Arc::clone(&c);
    let _srv = crate::http::Server::start(
        &crate::http::Listen {
            unix: Some(sock.clone()),
            tcp: None,
        },
        token.clone(),
        Box::new(move |r| crate::api::handle(&hc, r)),
    )
    .unwrap();
    let ep = sock.display().to_string();
    let req = |m: &str, p: &str, b: Option<&str>| {
        crate::http::request(&ep, &token, m, p, b, Duration::from_secs(5)).unwrap()
    };
    let (st, body) = req("GET", "/v1/ha", None);
    assert_eq!(st, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["replicas"][0]["ha_status"]["output"]["audit_checked"], 1);
    assert_eq!(v["replicas"][0]["protected_to"], json!(["r2", "r3"]));
    assert_eq!(
        req("POST", "/v1/ha/protect", Some(r#"{"policy":"raid"}"#)).0,
        400
    );
    assert_eq!(req("POST", "/v1/ha/protect", Some(r#"{"hz":0}"#)).0, 400);
    assert_eq!(
        req("POST", "/v1/ha/protect", Some(r#"{"replica":"r9"}"#)).0,
        409
    );
    let (st, body) = req(
        "POST",
        "/v1/ha/protect",
        Some(r#"{"policy":"single","hz":10000}"#),
    );
    assert_eq!(st, 200, "{body}");
    let pol = w.state(1).lock().unwrap().protects.last().unwrap().clone();
    assert_eq!(pol["kind"], "single");
    assert_eq!(pol["hz"], 10000);
    assert_eq!(c.ha_config().hz, 10000);
    assert_eq!(req("DELETE", "/v1/ha", None).0, 405);
}

#[test]
fn tokens_are_leased_so_a_restart_never_reuses_one() {
    let w = World::new("lease");
    let statics: Vec<(u32, PathBuf)> = (1..=2).map(|i| (i, w.add(i))).collect();
    let path = w.dir.join("store.json");
    let mk = || {
        Controller::new(
            Settings {
                ha: HaConfig::default(),
                ..Settings::default()
            },
            Box::new(FileStore::open(&path).unwrap()),
            Box::new(MemSteering::default()),
            None,
            Box::new(FakeMigrator(w.clone())),
            statics.clone(),
            Some(manual()),
        )
        .unwrap()
    };
    let c = mk();
    assert_eq!(c.bump_ha_token().unwrap(), 1);
    assert_eq!(c.bump_ha_token().unwrap(), 2);
    drop(c);
    // A new controller on the same store starts above every token the old one could issue.
    let c = mk();
    let t = c.bump_ha_token().unwrap();
    assert!(t > crate::controller::failover::TOKEN_LEASE, "{t}");
    // Exhausting a lease takes a new one transparently.
    for _ in 0..crate::controller::failover::TOKEN_LEASE + 5 {
        c.bump_ha_token().unwrap();
    }
    assert!(
        c.status()["ha"]["token"].as_u64().unwrap() > 2 * crate::controller::failover::TOKEN_LEASE
    );
}

/// The policy and hz the API set survive a restart; the failure-detection knobs come from
/// the config file (a stored copy used to override them all, so a new `watch_ms` or probe
/// bound in ctl.toml was ignored after the first `ha protect --policy`).
#[test]
fn a_restart_keeps_the_api_policy_and_takes_detection_knobs_from_the_file() {
    let w = World::new("ha-knobs");
    let statics: Vec<(u32, PathBuf)> = (1..=2).map(|i| (i, w.add(i))).collect();
    let path = w.dir.join("store.json");
    let mk = |ha: HaConfig| restarted(&w, &statics, &path, ha);
    let c = mk(HaConfig::default());
    c.ha_protect(Some("single"), Some(2000), None).unwrap();
    drop(c);
    let c = mk(HaConfig {
        watch_ms: 25,
        probe_timeout_ms: 300,
        suspect_after_ms: 3000,
        ..HaConfig::default()
    });
    let cfg = c.ha_config();
    assert_eq!((cfg.policy, cfg.hz), (crate::ha::PolicyKind::Single, 2000));
    assert_eq!(
        (cfg.watch_ms, cfg.probe_timeout_ms, cfg.suspect_after_ms),
        (25, 300, 3000)
    );
}

/// What probe verdicts do to a member: a TCP probe that finds nothing is no evidence, and
/// only `suspect_after_ms` of such silence makes it suspected (never failed over); a
/// listening probe clears that; unix probes keep their old meaning (Unknown changes nothing).
#[test]
fn silent_tcp_probes_suspect_a_member_after_the_bound_and_never_kill_it() {
    let (_w, _s, c) = setup_with("silent", 3, manual(), HaConfig::default());
    use crate::ha::Probe;
    let unknown = Probe::Unknown("connect did not complete in time".into());
    let suspected = |i: u32| lock(&c.state).ha.suspects.contains(&i);
    // Silent for less than the bound: nothing yet, however many probes.
    for _ in 0..50 {
        c.note_probe(2, &unknown, true, Duration::from_secs(3600));
    }
    assert!(!suspected(2));
    assert!(lock(&c.state).ha.silent_since.contains_key(&2));
    // Past the bound: suspected (once: one event, one count).
    c.note_probe(2, &unknown, true, Duration::ZERO);
    c.note_probe(2, &unknown, true, Duration::ZERO);
    assert!(suspected(2));
    assert_eq!(c.counters.ha.silent_suspected.load(Ordering::Relaxed), 1);
    assert_eq!(c.counters.ha.probes_unknown.load(Ordering::Relaxed), 52);
    assert_eq!(c.counters.ha.failovers.load(Ordering::Relaxed), 0);
    assert!(lock(&c.state).replicas[&2].1.alive);
    // It listens again: cleared, silence forgotten.
    c.note_probe(2, &Probe::Listening, true, Duration::ZERO);
    assert!(!suspected(2));
    assert!(!lock(&c.state).ha.silent_since.contains_key(&2));
    // Unix: an Unknown (a full backlog) is no evidence and starts no suspicion.
    c.note_probe(3, &unknown, false, Duration::ZERO);
    assert!(!suspected(3));
    assert!(!lock(&c.state).ha.silent_since.contains_key(&3));
}

/// Over TCP the watch probes every member at once and acts on each verdict as it comes: r3
/// (nothing listens: reset) is failed over before r2's probe (a connect whose SYNs are
/// dropped) can have reached its bound, which a round in turn cannot do (r2 is probed
/// before r3 and its connect cannot return earlier). r2's silence is no evidence: it is
/// not failed over. r1 listens.
#[test]
fn a_tcp_watch_round_fails_over_a_dead_member_without_waiting_for_a_silent_one() {
    let bound = Duration::from_secs(3);
    let r1 = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = r1.local_addr().unwrap().port();
    let _r2 = crate::ha::testing::silent_tcp_endpoint(format!("127.0.0.2:{port}").parse().unwrap());
    let statics: Vec<(u32, PathBuf)> = (1..=3)
        .map(|i| (i, PathBuf::from(format!("/nonexistent/pliant/r{i}.sock"))))
        .collect();
    let c = Controller::new(
        Settings {
            ha: HaConfig {
                probe_timeout_ms: bound.as_millis() as u64,
                suspect_after_ms: 600_000,
                ..HaConfig::default()
            },
            control: rc::Dialer {
                security: None,
                template: Some(format!("127.0.0.{{index}}:{port}")),
                ..Default::default()
            },
            ..Settings::default()
        },
        Box::new(FileStore::in_memory()),
        Box::new(MemSteering::default()),
        None,
        Box::new(FakeMigrator(World::default())),
        statics,
        Some(manual()),
    )
    .unwrap();
    let failed_over = |i: u32| lock(&c.state).replicas[&i].1.failed_over;
    std::thread::scope(|sc| {
        let t0 = Instant::now();
        let round = sc.spawn(|| c.ha_watch_once());
        let seen = wait_during(&round, || failed_over(3));
        let at = t0.elapsed();
        assert!(seen, "r3 failed over");
        assert!(
            at < bound,
            "r3 failed over {at:?} after the round started: it waited for r2's probe ({bound:?})"
        );
        round.join().unwrap();
    });
    assert!(!failed_over(1) && !failed_over(2));
    assert_eq!(c.counters.ha.probes_dead.load(Ordering::Relaxed), 1);
    assert_eq!(c.counters.ha.probes_unknown.load(Ordering::Relaxed), 1);
    assert!(lock(&c.state).ha.silent_since.contains_key(&2));
    assert!(lock(&c.state).ha.last_seen.contains_key(&1));
}

#[test]
fn ha_off_protects_nothing_and_death_is_not_a_failover() {
    let (w, steer, c) = setup("ha-off", 2, manual());
    assert!(c.protect_all().is_null());
    w.kill(2);
    c.ha_watch_once();
    for _ in 0..3 {
        c.heartbeat_once();
    }
    assert_eq!(c.counters.ha.failovers.load(Ordering::Relaxed), 0);
    assert_eq!(steer.0.lock().unwrap().fenced.get(&2), None);
    assert!(w.state(1).lock().unwrap().protects.is_empty());
    assert!(matches!(
        c.ha_protect(None, None, None),
        Err(ControllerError::Refused(_))
    ));
}

fn ftmb3(tag: &str) -> (World, SharedSteer, Controller) {
    let ha = HaConfig {
        mode: crate::ha::HaMode::Ftmb,
        reprotect_min_ms: 600_000,
        ..HaConfig::default()
    };
    let (w, steer, c) = setup_with(tag, 3, manual(), ha);
    // r1 holds 6 flows; r2 hosts r1's logger and can recover all of them.
    w.fill(1, 0..6);
    w.state(2)
        .lock()
        .unwrap()
        .ftmb_hosted
        .insert("r1".into(), (0..6).map(flow).collect());
    let p = c.protect_all();
    assert_eq!(p["r1"]["backups"], json!(["r2"]), "{p}");
    (w, steer, c)
}

fn ftmb_protects(w: &World, i: u32) -> Vec<String> {
    w.state(i).lock().unwrap().ftmb_protects.clone()
}

#[test]
fn ftmb_protect_points_each_replica_at_its_successors_logger_once() {
    let (w, _s, c) = ftmb3("ftmb-protect");
    for (i, host) in [(1, 2), (2, 3), (3, 1)] {
        let p = ftmb_protects(&w, i);
        assert_eq!(p.len(), 1, "r{i}: {p:?}");
        assert!(
            p[0].ends_with(&format!("/r{host}.ftmb.sock")),
            "r{i}: {p:?}"
        );
        // No Pico policy in FTMB mode, and no run-time port blocks (pinned by index).
        assert!(w.state(i).lock().unwrap().protects.is_empty());
        assert!(w.state(i).lock().unwrap().port_blocks.is_none());
    }
    // Nothing changed: no replica is re-pointed (that would restart its full snapshot).
    let again = c.protect_all();
    assert_eq!(again["r2"]["unchanged"], true, "{again}");
    for i in 1..=3 {
        assert_eq!(ftmb_protects(&w, i).len(), 1, "r{i}");
    }
    assert_eq!(
        c.counters.ha.ftmb_protect_unchanged.load(Ordering::Relaxed),
        3
    );
    let st = c.status();
    assert_eq!(
        st["ha"]["ftmb_loggers"],
        json!({"r1": "r2", "r2": "r3", "r3": "r1"})
    );
    assert_eq!(st["ha"]["mode"], "ftmb");
    // The API view carries each member's ftmb_status and logger host.
    let v = c.ha_view();
    assert_eq!(v["replicas"][0]["ftmb_logger_host"], "r2");
    assert_eq!(
        v["replicas"][1]["ftmb_status"]["hosting"]["masters"]["r1"]["logger"]["outputs_released"],
        2
    );
    // A replica whose workers lost their logger (its runtime reports none) is re-pointed at
    // the next poll.
    w.state(3).lock().unwrap().ftmb_logger = None;
    c.heartbeat_once();
    let p = ftmb_protects(&w, 3);
    assert_eq!(p.len(), 2, "{p:?}");
    assert!(p[1].ends_with("/r1.ftmb.sock"));
    assert_eq!(c.counters.ha.reprotects.load(Ordering::Relaxed), 1);
}

#[test]
fn ftmb_failover_recovers_on_the_logger_host_steers_it_and_repoints_the_predecessor() {
    let (w, steer, c) = ftmb3("ftmb-failover");
    // Exceptions left from earlier moves: one of a flow that ended on r1 (r1's logger does not
    // recover it), one of a flow on r3.
    let ended: FlowKey = flow(100).key.parse().unwrap();
    let on3: FlowKey = flow(101).key.parse().unwrap();
    steer
        .0
        .lock()
        .unwrap()
        .set_exceptions(&[(ended, 1), (on3, 3)])
        .unwrap();
    c.ha_watch_once();
    assert_eq!(c.counters.ha.failovers.load(Ordering::Relaxed), 0);
    w.kill(1);
    c.ha_watch_once();
    assert_eq!(c.counters.ha.failovers.load(Ordering::Relaxed), 1);
    let s = steer.0.lock().unwrap().clone();
    assert_eq!(s.fenced.get(&1), Some(&true), "fenced");
    assert_eq!(s.ring, vec![2, 3], "out of the ring");
    // Every key and alias at the logger host.
    for p in 0..6u16 {
        let f = flow(p);
        for k in std::iter::once(&f.key).chain(f.aliases.iter()) {
            assert_eq!(
                s.exceptions.get(&k.parse::<FlowKey>().unwrap()),
                Some(&2),
                "{k}"
            );
        }
    }
    // The ended flow's exception is gone (a new connection on its 5-tuple must not hit the
    // fence), r3's stays.
    assert_eq!(s.exceptions.get(&ended), None);
    assert_eq!(s.exceptions.get(&on3), Some(&3));
    // r1's port block (20000-23999) now reaches r2, which recovered its flows.
    assert_eq!(s.port_owner.get(&20000), Some(&2));
    assert_eq!(s.port_owner.get(&23999), Some(&2));
    assert_eq!(s.port_owner.get(&24000), Some(&2), "r2's own block");
    assert_eq!(s.port_owner.get(&28000), Some(&3));
    // Only the host was asked, only with ftmb_activate.
    assert_eq!(w.state(2).lock().unwrap().ftmb_activations, vec!["r1"]);
    assert!(w.state(3).lock().unwrap().ftmb_activations.is_empty());
    for i in [2, 3] {
        assert!(w.state(i).lock().unwrap().activations.is_empty(), "r{i}");
    }
    assert_eq!(w.flows(2), 6);
    // r3 logged to r1: re-pointed at r2. r2 still logs to r3: left alone.
    let p3 = ftmb_protects(&w, 3);
    assert_eq!(p3.len(), 2, "{p3:?}");
    assert!(p3[1].ends_with("/r2.ftmb.sock"), "{p3:?}");
    assert_eq!(ftmb_protects(&w, 2).len(), 1);
    let st = c.status();
    assert_eq!(st["ha"]["ftmb_loggers"], json!({"r2": "r3", "r3": "r2"}));
    let rec = &st["ha"]["last_failover"];
    assert_eq!(rec["mode"], "ftmb", "{rec}");
    assert_eq!(rec["activated"], 6, "{rec}");
    assert_eq!(rec["keys_steered"], 12, "{rec}");
    assert_eq!(rec["ftmb"]["logger_host"], 2, "{rec}");
    assert_eq!(rec["ftmb"]["replay_ms"], 1.5, "{rec}");
    assert_eq!(rec["ftmb"]["replayed_packets"], 7, "{rec}");
    assert_eq!(rec["ftmb"]["port_blocks_rehomed"], 1, "{rec}");
    assert_eq!(rec["stale_exceptions_removed"], 1, "{rec}");
    for k in ["detect_ms", "activate_ms", "steer_ms", "failover_ms"] {
        assert!(rec[k].is_number(), "{k}: {rec}");
    }
    // The re-pointing answer says whom it named and when it was sent (after the detection);
    // r2's, not sent, carries neither.
    let p3 = &rec["reprotected"]["r3"];
    assert_eq!(p3["named"], json!(["r2"]), "{rec}");
    let sent = p3["sent_unix_ms"].as_u64().expect("sent_unix_ms");
    assert!(
        sent >= rec["detected_unix_ms"].as_u64().expect("detected"),
        "{rec}"
    );
    assert_eq!(rec["reprotected"]["r2"]["unchanged"], true, "{rec}");
    assert!(rec["reprotected"]["r2"]["sent_unix_ms"].is_null(), "{rec}");
    // The flows end at r2: r1 is retired and its block goes back to the pool, unowned.
    w.state(2).lock().unwrap().flows.clear();
    assert_eq!(c.gc_exceptions().unwrap(), 12);
    assert_eq!(c.counters.ha.retired.load(Ordering::Relaxed), 1);
    assert_eq!(steer.0.lock().unwrap().port_owner.get(&20000), None);
}

#[test]
fn ftmb_failover_without_a_live_logger_host_loses_the_flows_visibly() {
    let (w, steer, c) = ftmb3("ftmb-nohost");
    // r1's logger host r2 dies first: r2's flows are recovered by r3 (none hosted there,
    // so the activation is refused), r1 is re-pointed at r3.
    w.kill(2);
    c.ha_watch_once();
    let rec = c.status()["ha"]["last_failover"].clone();
    assert_eq!(rec["activated"], 0, "{rec}");
    assert!(rec["by_replica"]["3"]["error"].is_string(), "{rec}");
    let p1 = ftmb_protects(&w, 1);
    assert!(p1.last().unwrap().ends_with("/r3.ftmb.sock"), "{p1:?}");
    // r1's log now lives on r3, which never got r1's log in this fake: killing r1 asks r3.
    w.kill(1);
    c.ha_watch_once();
    assert_eq!(
        w.state(3).lock().unwrap().ftmb_activations,
        vec!["r2", "r1"]
    );
    assert_eq!(c.counters.ha.failovers.load(Ordering::Relaxed), 2);
    // Alone now: nothing to log to, nothing sent.
    assert_eq!(c.status()["ha"]["ftmb_loggers"], json!({}));
    assert_eq!(steer.0.lock().unwrap().ring, vec![3]);
    // A primary that was never protected has no host: counted, nothing asked.
    let (w, _s, c) = setup_with(
        "ftmb-never",
        2,
        manual(),
        HaConfig {
            mode: crate::ha::HaMode::Ftmb,
            ..HaConfig::default()
        },
    );
    w.kill(1);
    c.ha_watch_once();
    assert_eq!(c.counters.ha.ftmb_no_logger.load(Ordering::Relaxed), 1);
    assert!(w.state(2).lock().unwrap().ftmb_activations.is_empty());
    let rec = c.status()["ha"]["last_failover"].clone();
    assert!(rec["ftmb"]["error"]
        .as_str()
        .is_some_and(|e| e.contains("never protected")));
}

#[test]
fn ftmb_port_blocks_are_pinned_by_index_at_start_and_on_scale_out() {
    // Replicas r1, r2, r5 (a gap): lowest-free assignment would give r5 block 2 and the next
    // replica (r6) block 3; pinned, they get blocks 4 and 5 (their configs say so).
    let w = World::new("ftmb-pinned");
    let statics: Vec<(u32, PathBuf)> = [1, 2, 5].iter().map(|i| (*i, w.add(*i))).collect();
    let steer = SharedSteer::default();
    let c = Controller::new(
        Settings {
            port_blocks: Some((PortBlocks::new(20000, 59999, 4000).unwrap(), 1)),
            ha: HaConfig {
                mode: crate::ha::HaMode::Ftmb,
                ..HaConfig::default()
            },
            ..Settings::default()
        },
        Box::new(FileStore::in_memory()),
        Box::new(steer.clone()),
        Some(Box::new(FakeAgent(w.clone(), 5))),
        Box::new(FakeMigrator(w.clone())),
        statics,
        Some(manual()),
    )
    .unwrap();
    c.protect_all();
    let owner = |p: u16| steer.0.lock().unwrap().port_owner.get(&p).copied();
    assert_eq!(
        (owner(20000), owner(24000), owner(28000), owner(36000)),
        (Some(1), Some(2), None, Some(5))
    );
    assert!(w.state(5).lock().unwrap().port_blocks.is_none(), "not told");
    let out = c.scale_out().unwrap();
    assert_eq!(out["replica"], 6, "{out}");
    assert_eq!(owner(40000), Some(6), "r6 owns block 5");
    assert_eq!(owner(28000), None);
    // The ring r1 -> r2 -> r5 -> r6 -> r1: r5 re-pointed at r6, r6 logs to r1, r1 and r2
    // left alone.
    let p5 = ftmb_protects(&w, 5);
    assert!(p5.last().unwrap().ends_with("/r6.ftmb.sock"), "{p5:?}");
    let p6 = ftmb_protects(&w, 6);
    assert_eq!(p6.len(), 1);
    assert!(p6[0].ends_with("/r1.ftmb.sock"), "{p6:?}");
    assert_eq!(ftmb_protects(&w, 1).len(), 1);
    assert_eq!(ftmb_protects(&w, 2).len(), 1);
    assert_eq!(
        c.status()["ha"]["ftmb_loggers"],
        json!({"r1": "r2", "r2": "r5", "r5": "r6", "r6": "r1"})
    );
}

#[test]
fn ftmb_exception_gc_follows_what_the_replicas_list_and_retires_the_dead_primary_last() {
    let (w, steer, c) = ftmb3("ftmb-gc");
    // Exceptions from an earlier recovery at r3: flow 50 still lives there, flow 60 ended.
    w.fill(3, 50..51);
    let keys_of = |f: &FlowEntry| -> Vec<FlowKey> {
        std::iter::once(&f.key)
            .chain(f.aliases.iter())
            .map(|k| k.parse().unwrap())
            .collect()
    };
    let earlier: Vec<FlowKey> = [flow(50), flow(60)].iter().flat_map(keys_of).collect();
    let with_owner: Vec<(FlowKey, u32)> = earlier.iter().map(|k| (*k, 3)).collect();
    steer.0.lock().unwrap().set_exceptions(&with_owner).unwrap();
    c.save_exceptions(&earlier, Some(3)).unwrap();
    w.kill(1);
    c.ha_watch_once();
    assert_eq!(c.counters.ha.failovers.load(Ordering::Relaxed), 1);
    assert_eq!(w.flows(2), 6, "r2 recovered and lists r1's flows");
    // The ended flow's key and alias go; r1's recovered flows and flow 50 stay steered.
    assert_eq!(c.gc_exceptions().unwrap(), 2);
    let ex = steer.0.lock().unwrap().exceptions.clone();
    for k in keys_of(&flow(60)) {
        assert_eq!(ex.get(&k), None, "{k}");
    }
    for k in keys_of(&flow(50)) {
        assert_eq!(ex.get(&k), Some(&3), "{k}");
    }
    assert_eq!(c.counters.ha.retired.load(Ordering::Relaxed), 0);
    // Half of r1's flows end at r2: their exceptions go, r1 stays (its block still routes
    // the other half's return traffic to r2).
    w.state(2)
        .lock()
        .unwrap()
        .flows
        .retain(|f| !(0..3).any(|p| *f == flow(p)));
    assert_eq!(c.gc_exceptions().unwrap(), 6);
    assert_eq!(c.counters.ha.retired.load(Ordering::Relaxed), 0);
    assert_eq!(steer.0.lock().unwrap().port_owner.get(&20000), Some(&2));
    assert_eq!(c.status()["ha"]["failed_over"], json!([1]));
    for p in 3..6 {
        for k in keys_of(&flow(p)) {
            assert_eq!(steer.0.lock().unwrap().exceptions.get(&k), Some(&2), "{k}");
        }
    }
    // The rest end: r1 is retired, its block unowned; flow 50's exception is untouched.
    w.state(2).lock().unwrap().flows.clear();
    assert_eq!(c.gc_exceptions().unwrap(), 6);
    assert_eq!(c.counters.ha.retired.load(Ordering::Relaxed), 1);
    assert_eq!(c.status()["ha"]["failed_over"], json!([]));
    let s = steer.0.lock().unwrap().clone();
    assert_eq!(s.port_owner.get(&20000), None);
    assert_eq!(s.exceptions.len(), 2, "{:?}", s.exceptions);
    assert_eq!(c.status()["counters"]["exceptions_collected"], 14);
    assert_eq!(c.status()["counters"]["gc_skipped"], 0);
}

#[test]
fn exception_gc_keeps_a_key_a_failover_re_pointed_after_the_listing() {
    let (w, steer, c) = ftmb3("ftmb-gc-race");
    // r3 was steered flow 0 once; nothing lists it when the GC lists (r1, which holds it,
    // is already out of the listing: its failover has begun).
    let k0: Vec<FlowKey> = std::iter::once(&flow(0).key)
        .chain(flow(0).aliases.iter())
        .map(|k| k.parse().unwrap())
        .collect();
    c.save_exceptions(&k0, Some(3)).unwrap();
    let (saved, _) = c.gc_listing().unwrap().expect("exceptions to collect");
    let present = BTreeSet::new();
    // The failover completes before the GC decides: r2 recovered flow 0, its keys now name
    // r2.
    w.kill(1);
    c.ha_watch_once();
    assert_eq!(
        steer.0.lock().unwrap().exceptions.get(&k0[0]),
        Some(&2),
        "re-pointed"
    );
    assert_eq!(c.gc_apply(&saved, &present).unwrap(), 0);
    assert_eq!(steer.0.lock().unwrap().exceptions.get(&k0[0]), Some(&2));
    // An owner that did not change is collected as before.
    let (saved, _) = c.gc_listing().unwrap().expect("exceptions to collect");
    assert_eq!(c.gc_apply(&saved, &present).unwrap(), 12);
}

fn test_etcd(tag: &str) -> Option<pliant_lab::etcd::EtcdServer> {
    if !pliant_testkit::require_tool("etcd", "etcd-server")
        || !pliant_testkit::require_tool("etcdctl", "etcd-client")
    {
        return None;
    }
    Some(pliant_lab::etcd::EtcdServer::scratch(&format!("ctl-{tag}")).unwrap())
}

fn etcd_client(e: &pliant_lab::etcd::EtcdServer) -> crate::store::EtcdStore {
    let mut o = crate::store::EtcdOptions::new(vec![e.spec.client_url()], "/pliant/t/");
    o.request_timeout = Duration::from_millis(500);
    o.connect_timeout = Duration::from_millis(300);
    crate::store::EtcdStore::connect(&o).unwrap()
}

#[test]
fn without_its_etcd_the_controller_changes_no_placement_and_resumes_when_it_returns() {
    let Some(mut etcd) = test_etcd("outage") else {
        return;
    };
    let (w, steer, c) = setup_on(
        "etcd-outage",
        2,
        manual(),
        HaConfig::off(),
        |_| {},
        Box::new(etcd_client(&etcd)),
    );
    w.fill(1, 0..9);
    c.heartbeat_once();
    c.migrate_count(1, 2, 2).unwrap();
    assert_eq!((w.flows(1), w.flows(2)), (7, 2));
    assert_eq!(c.status()["store"]["ok"], true);
    assert_eq!(c.status()["store"]["backend"], "etcd");

    etcd.kill();
    assert!(c.scale_out().is_err(), "no scale-out without the store");
    assert!(
        c.migrate_count(1, 2, 2).is_err(),
        "no migration without the store"
    );
    assert!(
        c.scale_in(Some(2)).is_err(),
        "no scale-in without the store"
    );
    assert_eq!(steer.0.lock().unwrap().ring, vec![1, 2], "ring unchanged");
    assert!(
        !w.by_index.lock().unwrap().contains_key(&3),
        "no replica started"
    );
    assert_eq!((w.flows(1), w.flows(2)), (7, 2), "no flow moved");
    // Heartbeats need no store: replicas stay alive and are still watched.
    c.heartbeat_once();
    let st = c.status();
    assert!(st["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .all(|r| r["alive"] == true));
    assert_eq!(
        st["store"]["ok"], false,
        "status says the store is gone: {}",
        st["store"]
    );
    assert!(st["counters"]["store_refusals"].as_u64().unwrap() >= 3);

    etcd.restart().unwrap();
    let t0 = Instant::now();
    while c.status()["store"]["ok"] != true {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "store back, status still down"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    c.migrate_count(1, 2, 2).unwrap();
    assert_eq!((w.flows(1), w.flows(2)), (5, 4));
    c.scale_out().unwrap();
    assert_eq!(steer.0.lock().unwrap().ring, vec![1, 2, 3]);
    // What the controller did is in etcd, for another controller to read.
    let other = etcd_client(&etcd);
    use crate::store::Store as _;
    let recorded: Vec<String> = other
        .list("replicas/")
        .unwrap()
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    assert!(recorded.contains(&"replicas/3".to_string()), "{recorded:?}");
}

#[test]
fn an_idle_ha_controller_keeps_the_ha_floor_and_warns_about_an_unprotected_replica() {
    // The default policy (auto, min_replicas 1) with HA on and no traffic: the seed's report
    // was a scale-in to one replica, with no backup and no warning.
    let policy = Policy {
        cooldown_ms: 0,
        ..Policy::default()
    };
    let (w, _s, c) = setup_with("ha-floor", 3, policy, HaConfig::default());
    assert_eq!(c.ha_floor(), 2);
    assert_eq!(
        c.policy().min_replicas,
        2,
        "an unset min_replicas is the HA floor"
    );
    c.protect_all();
    c.heartbeat_once();
    for _ in 0..5 {
        c.policy_tick(false).unwrap();
    }
    let live = c.loads();
    assert_eq!(live.len(), 2, "{live:?}");
    assert_eq!(c.counters.scale_ins.load(Ordering::Relaxed), 1);
    c.heartbeat_once();
    let st = c.status();
    assert_eq!(st["unprotected"], json!([]), "{st}");
    assert_eq!(st["ha"]["unprotected_replicas"], 0);
    assert_eq!(st["ha"]["min_replicas"], 2);
    // The other survivor dies: the one left has no backup.
    let (a, b) = (live[0].index, live[1].index);
    w.kill(b);
    c.ha_watch_once();
    c.heartbeat_once();
    assert_eq!(c.counters.ha.failovers.load(Ordering::Relaxed), 1);
    let st = c.status();
    assert_eq!(st["unprotected"], json!([a]), "{st}");
    assert_eq!(st["ha"]["unprotected_replicas"], 1);
    assert_eq!(st["ha"]["unprotected"], json!([a]));
    assert_eq!(c.ha_view()["unprotected"], json!([a]));
    let ev: Vec<&Value> = st["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["event"] == "unprotected")
        .collect();
    assert_eq!(ev[0]["detail"]["replicas"], json!([a]), "{st}");
    // Alone: nothing to merge into, and the policy does not try.
    assert_eq!(
        c.policy_tick(false).unwrap()["decision"]["action"],
        "nothing"
    );
}

#[test]
fn a_replica_that_reports_a_lost_backup_is_unprotected_until_reprotected() {
    let (w, _s, c) = ha3("ha-lost");
    c.heartbeat_once();
    assert_eq!(c.status()["unprotected"], json!([]));
    // r1's group lost its backup (the rate limit keeps the poll from re-protecting it).
    w.state(1).lock().unwrap().needs_backup = true;
    c.heartbeat_once();
    assert_eq!(c.status()["unprotected"], json!([1]));
    c.ha_protect(None, None, Some(1)).unwrap();
    c.heartbeat_once();
    assert_eq!(c.status()["unprotected"], json!([]));
}

#[test]
fn ftmb_a_replica_alone_has_no_logger_and_is_unprotected() {
    let (w, _s, c) = ftmb3("ftmb-alone");
    c.heartbeat_once();
    assert_eq!(c.status()["unprotected"], json!([]));
    w.kill(2);
    c.ha_watch_once();
    w.kill(3);
    c.ha_watch_once();
    c.heartbeat_once();
    assert_eq!(c.status()["unprotected"], json!([1]));
}

#[test]
fn with_ha_on_policy_set_refuses_min_replicas_below_the_floor_naming_both() {
    let (_w, _s, c) = setup_with("ha-policy", 2, manual(), HaConfig::default());
    assert_eq!(c.policy().min_replicas, 2);
    let e = c
        .set_policy(&[("min_replicas".into(), "1".into())])
        .unwrap_err();
    assert_eq!(e.status(), 400);
    assert!(e.to_string().contains("min_replicas = 1 is below 2"), "{e}");
    assert_eq!(c.policy().min_replicas, 2, "a refused set changes nothing");
    // Other keys are set as before (the floor was applied at start, not demanded of them).
    c.set_policy(&[("high_water_flows".into(), "500".into())])
        .unwrap();
    c.set_policy(&[("min_replicas".into(), "3".into())])
        .unwrap();
    assert_eq!(c.policy().min_replicas, 3);
    // HA off: 1 is fine.
    let (_w, _s, c) = setup("noha-policy", 2, manual());
    c.set_policy(&[("min_replicas".into(), "1".into())])
        .unwrap();
}

#[test]
fn a_policy_stored_without_ha_is_raised_to_the_floor_when_ha_is_turned_on() {
    let w = World::new("ha-stored");
    let statics: Vec<(u32, PathBuf)> = (1..=2).map(|i| (i, w.add(i))).collect();
    let path = w.dir.join("store.json");
    let mk = |ha: HaConfig| restarted(&w, &statics, &path, ha);
    let c = mk(HaConfig::off());
    c.set_policy(&[("min_replicas".into(), "1".into())])
        .unwrap();
    drop(c);
    let c = mk(HaConfig::default());
    assert_eq!(c.policy().min_replicas, 2);
    drop(c);
    // Stored raised: the next start reads 2 back even with HA off again.
    let c = mk(HaConfig::off());
    assert_eq!(c.policy().min_replicas, 2);
}

/// A migrator whose controller dies in the middle of a move: before the steering switch, or
/// right after it (before the source was told to export).
struct DyingMigrator {
    after_switch: bool,
}

impl Migrator for DyingMigrator {
    fn migrate(
        &self,
        _src: &Path,
        _dst: &Path,
        _flows: &[FlowEntry],
        steer: &mut SteerUpdate<'_>,
    ) -> std::result::Result<Outcome, MigrateError> {
        if self.after_switch {
            steer(&[]).map_err(MigrateError)?;
        }
        panic!("the controller dies here");
    }
}

/// Two controllers on one store file, fake replicas and steering: the first dies in a move
/// (`after_switch` or before it), the second starts and must settle it.
/// A first controller that died (panicked) in the middle of moving 3 of r1's 6 flows to r2,
/// before or after the steering switch; the store and steering it left.
struct CutShort {
    w: World,
    steer: SharedSteer,
    path: PathBuf,
    dir: PathBuf,
    statics: Vec<(u32, PathBuf)>,
    moved: Vec<FlowEntry>,
}

fn cut_short(tag: &str, after_switch: bool) -> CutShort {
    let dir = std::env::temp_dir().join(format!("pliant-ctl-intent-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("store.json");
    let w = World::new(tag);
    let statics: Vec<(u32, PathBuf)> = (1..=2).map(|i| (i, w.add(i))).collect();
    let steer = SharedSteer::default();
    let first = Controller::new(
        test_settings(HaConfig::off()),
        Box::new(FileStore::open(&path).unwrap()),
        Box::new(steer.clone()),
        None,
        Box::new(DyingMigrator { after_switch }),
        statics.clone(),
        Some(manual()),
    )
    .unwrap();
    w.fill(1, 0..6);
    first.heartbeat_once();
    let died = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = first.migrate_count(1, 2, 3);
    }));
    assert!(died.is_err(), "the first controller died mid-move");
    std::mem::forget(first); // dead: nothing of it runs any more (no drop, no cleanup)
    let moved: Vec<FlowEntry> = w.state(1).lock().unwrap().flows[3..].to_vec();
    let to_dst = steer
        .0
        .lock()
        .unwrap()
        .exceptions
        .values()
        .filter(|o| **o == 2)
        .count();
    assert_eq!(
        to_dst > 0,
        after_switch,
        "the fabric shows how far the move got"
    );
    CutShort {
        w,
        steer,
        path,
        dir,
        statics,
        moved,
    }
}

/// The next controller, on what the dead one left.
fn take_over(c: &CutShort) -> Controller {
    Controller::new(
        test_settings(HaConfig::off()),
        Box::new(FileStore::open(&c.path).unwrap()),
        Box::new(c.steer.clone()),
        None,
        Box::new(FakeMigrator(c.w.clone())),
        c.statics.clone(),
        Some(manual()),
    )
    .unwrap()
}

fn die_mid_migration(tag: &str, after_switch: bool) -> (World, SharedSteer, Controller, Value) {
    let cs = cut_short(tag, after_switch);
    let second = take_over(&cs);
    second.retry_intents();
    let CutShort {
        w,
        steer,
        path,
        dir,
        moved,
        ..
    } = cs;
    let events = second.status()["events"].clone();
    let resolved = events
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["event"] == "intent_resolved")
        .cloned()
        .unwrap_or_else(|| panic!("no intent_resolved event: {events}"));
    let saved: Option<Value> =
        crate::store::get_json(&FileStore::open(&path).unwrap(), K_MIGRATION_INTENT).unwrap();
    assert_eq!(saved, None, "the intent is settled");
    let _ = std::fs::remove_dir_all(&dir);
    // Every flow of the move is on exactly one replica, and steering agrees.
    let (s1, s2) = (w.state(1), w.state(2));
    for f in &moved {
        let on = (
            s1.lock().unwrap().flows.contains(f),
            s2.lock().unwrap().flows.contains(f),
        );
        let owner = if after_switch { 2 } else { 1 };
        assert_eq!(on, (owner == 1, owner == 2), "{} after the takeover", f.key);
        for k in std::iter::once(&f.key).chain(f.aliases.iter()) {
            let ex = steer
                .0
                .lock()
                .unwrap()
                .exceptions
                .get(&k.parse::<FlowKey>().unwrap())
                .copied();
            assert!(
                ex.is_none() || ex == Some(owner),
                "{k} steered to {ex:?}, lives on r{owner}"
            );
        }
    }
    (w, steer, second, resolved)
}

#[test]
fn a_move_cut_short_after_its_switch_is_finished_by_the_next_controller() {
    let (w, _steer, _c, resolved) = die_mid_migration("after", true);
    assert_eq!(resolved["detail"]["resolved"], "completed", "{resolved}");
    assert_eq!(resolved["detail"]["moved_again"], 3, "{resolved}");
    assert_eq!((w.flows(1), w.flows(2)), (3, 3));
    assert!(!w.state(2).lock().unwrap().served.contains(&"migrate_abort"));
}

#[test]
fn a_move_cut_short_before_its_switch_is_rolled_back_by_the_next_controller() {
    let (w, steer, _c, resolved) = die_mid_migration("before", false);
    assert_eq!(resolved["detail"]["resolved"], "rolled_back", "{resolved}");
    assert_eq!((w.flows(1), w.flows(2)), (6, 0));
    assert!(
        w.state(2).lock().unwrap().served.contains(&"migrate_abort"),
        "the destination's holds are ended"
    );
    assert!(steer.0.lock().unwrap().exceptions.values().all(|o| *o != 2));
}

/// The destination of a move cut short hangs when the next controller takes over: the roll-back
/// cannot be delivered. The successor starts anyway (it does not wait on the replica), keeps
/// the intent, refuses new moves meanwhile (one would overwrite it and the destination's holds
/// would never end), and rolls back once the destination answers (every policy round).
#[test]
fn a_move_cut_short_whose_destination_hangs_is_rolled_back_once_it_answers() {
    let cs = cut_short("hang", false);
    cs.w.state(2).lock().unwrap().hang = vec!["migrate_abort"];
    let second = take_over(&cs);
    second.retry_intents();
    let events = second.status()["events"].to_string();
    assert!(events.contains("intent_pending"), "{events}");
    assert!(!events.contains("intent_resolved"), "{events}");
    let saved: Option<Value> =
        crate::store::get_json(&FileStore::open(&cs.path).unwrap(), K_MIGRATION_INTENT).unwrap();
    assert!(
        saved.is_some(),
        "the intent stays until the roll-back is delivered"
    );
    let e = second.migrate_count(1, 2, 1).unwrap_err().to_string();
    assert!(e.contains("cut short by the previous leader"), "{e}");
    assert_eq!(
        (cs.w.flows(1), cs.w.flows(2)),
        (6, 0),
        "nothing moved meanwhile"
    );

    cs.w.state(2).lock().unwrap().hang.clear();
    second.retry_intents();
    let events = second.status()["events"].to_string();
    assert!(events.contains("rolled_back"), "{events}");
    assert!(
        cs.w.state(2)
            .lock()
            .unwrap()
            .served
            .contains(&"migrate_abort"),
        "the destination's holds are ended"
    );
    let saved: Option<Value> =
        crate::store::get_json(&FileStore::open(&cs.path).unwrap(), K_MIGRATION_INTENT).unwrap();
    assert_eq!(saved, None);
    // Moves go through again.
    second.migrate_count(1, 2, 1).unwrap();
    assert_eq!((cs.w.flows(1), cs.w.flows(2)), (5, 1));
    assert!(cs.moved.len() == 3);
    let _ = std::fs::remove_dir_all(&cs.dir);
}

#[test]
fn exception_gc_pins_an_ended_flows_inside_key_but_never_its_nat_side() {
    let (_w, steer, c) = setup_with("gc-nat-side", 2, manual(), HaConfig::off());
    steer.0.lock().unwrap().nat_addrs = vec!["10.77.2.1".parse().unwrap()];
    // Flow 0 had moved to r2 and ended there: its inside key and its NAT-side alias are
    // steered to r2 by exceptions that nothing lists any more.
    let keys: Vec<FlowKey> = std::iter::once(&flow(0).key)
        .chain(flow(0).aliases.iter())
        .map(|k| k.parse().unwrap())
        .collect();
    let entries: Vec<(FlowKey, u32)> = keys.iter().map(|k| (*k, 2)).collect();
    steer.0.lock().unwrap().set_exceptions(&entries).unwrap();
    c.save_exceptions(&keys, Some(2)).unwrap();
    let (saved, _) = c.gc_listing().unwrap().expect("exceptions to collect");
    assert_eq!(c.gc_apply(&saved, &BTreeSet::new()).unwrap(), 2);
    let s = steer.0.lock().unwrap();
    assert!(s.exceptions.is_empty(), "{:?}", s.exceptions);
    // A connection reusing the inside 5-tuple through the exception stays at r2; the NAT
    // side goes back to the port's owner: a pin there would take the owner's next
    // connection with that port and peer to r2, which has no mapping for it.
    assert_eq!(s.pins.get(&keys[0]), Some(&2));
    assert_eq!(s.pins.get(&keys[1]), None, "NAT side pinned: {:?}", s.pins);
}
