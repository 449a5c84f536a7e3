//! `pliant controller --config ctl.toml`: builds the controller from its config and runs the
//! API server plus three loops (heartbeats, policy, exception GC) until SIGINT/SIGTERM.

use crate::agent::{Agent, LabAgent};
use crate::config::ControllerConfig;
use crate::controller::{Controller, Settings};
use crate::http::{Listen, Server};
use crate::migrator::Migrator;
use crate::ports::PortBlocks;
use crate::steering::{FabricSteering, LabLinkSteering, MemSteering, RemoteSteering, Steering};
use crate::store::{EtcdStore, FileStore, Store};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_sig: libc::c_int) {
    // Only an atomic store: async-signal-safe.
    STOP.store(true, Ordering::SeqCst);
}

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error(transparent)]
    Auth(#[from] crate::auth::AuthError),
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
    #[error(transparent)]
    Steering(#[from] crate::steering::SteeringError),
    #[error(transparent)]
    Controller(#[from] crate::controller::ControllerError),
    #[error(transparent)]
    Serve(#[from] crate::http::ServeError),
    #[error("{0}")]
    Setup(String),
}

/// How the controller reaches replicas: `[controller] identity`, or the controller identity
/// of its lab (`[lab]`: the lab issued one beside its replicas').
pub fn dialer(cfg: &ControllerConfig) -> Result<crate::replica_client::Dialer, String> {
    let mut d = cfg.controller.dialer()?;
    if d.security.is_none() {
        if let Some(l) = &cfg.lab {
            d.security =
                pliant_lab::ha::lab_security(&l.run_root.join(&l.name), pliant_lab::ha::CONTROLLER);
        }
    }
    Ok(d)
}

/// Opens the store `[store]` names (the file at `[controller] store` by default). An etcd that
/// does not answer is an error here: a controller must read its state before it acts.
pub fn open_store(cfg: &ControllerConfig) -> Result<Box<dyn Store>, DaemonError> {
    match &cfg.store {
        Some(s) if s.backend == crate::config::StoreBackend::Etcd => {
            let store = EtcdStore::connect(&s.etcd_options())?;
            store.health()?;
            Ok(Box::new(store))
        }
        _ => {
            let path = &cfg.controller.store;
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir)
                    .map_err(|e| DaemonError::Setup(format!("{}: {e}", dir.display())))?;
            }
            Ok(Box::new(FileStore::open(path)?))
        }
    }
}

/// Builds a controller from a parsed config (steering attached, store opened, replicas found).
pub fn build(
    cfg: &ControllerConfig,
    migrator: Box<dyn Migrator>,
) -> Result<Controller, DaemonError> {
    let control = dialer(cfg).map_err(DaemonError::Setup)?;
    build_on(cfg, open_store(cfg)?, control, migrator)
}

/// [`build`] on a store already opened (a leader's, fenced by its term) and a dialer already
/// made (its term shared with the migrator's copy).
pub fn build_on(
    cfg: &ControllerConfig,
    store: Box<dyn Store>,
    control: crate::replica_client::Dialer,
    migrator: Box<dyn Migrator>,
) -> Result<Controller, DaemonError> {
    let c = &cfg.controller;
    let port_blocks = match &cfg.ports {
        Some(p) => Some((
            PortBlocks::new(p.lo, p.hi, p.block).map_err(|e| DaemonError::Setup(e.to_string()))?,
            p.per_replica,
        )),
        None => None,
    };
    // With [hosts], replicas are started and stopped by the hosts' agents (the lab, if any,
    // still provides the fabric's steering).
    let hosts = cfg.hosts.as_ref().map(|h| {
        Arc::new(crate::hosts::HostWatch::new(
            h.clone(),
            control.security.clone(),
            control.term.clone(),
        ))
    });
    let settings = Settings {
        heartbeat: Duration::from_millis(c.heartbeat_ms),
        dead_after_missed: c.dead_after_missed,
        rpc_timeout: Duration::from_millis(c.rpc_timeout_ms),
        heartbeat_timeout: Duration::from_millis(c.heartbeat_timeout_ms),
        port_blocks,
        ha: cfg.ha.clone().unwrap_or_else(crate::ha::HaConfig::off),
        control,
    };
    let statics: Vec<(u32, std::path::PathBuf)> = cfg
        .replica
        .iter()
        .map(|r| (r.index, r.socket.clone()))
        .collect();
    let (agent, steering): (Option<Box<dyn Agent>>, Box<dyn Steering>) = match &cfg.lab {
        Some(l) => {
            let opts = pliant_lab::scale::ScaleOptions {
                run_root: l.run_root.clone(),
                pliant_bin: l.pliant_bin.clone(),
                ..Default::default()
            };
            let agent: Box<dyn Agent> = match &hosts {
                Some(w) => Box::new(crate::hosts::RemoteAgents { watch: w.clone() }),
                None => Box::new(LabAgent::new(&l.name, opts)),
            };
            let mut known: Vec<u32> = agent
                .existing()
                .map_err(|e| DaemonError::Setup(e.to_string()))?
                .into_iter()
                .map(|(i, _)| i)
                .collect();
            known.extend(statics.iter().map(|(i, _)| *i));
            known.sort_unstable();
            known.dedup();
            let steering: Box<dyn Steering> = if l.steering == "attach" {
                let ns = format!("{}-fabric", l.name);
                Box::new(FabricSteering::attach_lab(&ns, &known, l.nat_addr)?)
            } else if let ("agent", Some(ep)) = (l.steering.as_str(), &l.fabric_agent) {
                Box::new(RemoteSteering::attach(
                    ep,
                    &l.fabric_agent_name,
                    settings.control.security.clone(),
                    settings.control.term.clone(),
                    settings.rpc_timeout,
                    &known,
                    l.nat_addr,
                )?)
            } else if cfg.ha.is_some() {
                // No BPF steering but HA on: fencing falls back to taking the replica's
                // fabric links down (lab only).
                Box::new(LabLinkSteering {
                    mem: MemSteering::default(),
                    lab: l.name.clone(),
                    run_root: l.run_root.clone(),
                })
            } else {
                Box::new(MemSteering::default())
            };
            (Some(agent), steering)
        }
        None => match &hosts {
            Some(w) => (
                Some(Box::new(crate::hosts::RemoteAgents { watch: w.clone() }) as Box<dyn Agent>),
                Box::new(MemSteering::default()) as Box<dyn Steering>,
            ),
            None => (None, Box::new(MemSteering::default())),
        },
    };
    let ctl = Controller::new(
        settings,
        store,
        steering,
        agent,
        migrator,
        statics,
        cfg.policy.clone(),
    )?;
    if let Some(w) = hosts {
        ctl.set_hosts(w);
    }
    Ok(ctl)
}

/// Spawns the heartbeat, policy and GC loops, and with HA on the liveness watch (after
/// protecting every replica once); they end when `stop` is set.
pub fn spawn_loops(
    ctl: &Arc<Controller>,
    cfg: &ControllerConfig,
    stop: &Arc<AtomicBool>,
) -> Vec<std::thread::JoinHandle<()>> {
    let mut v = Vec::new();
    if ctl.ha_enabled() {
        let (c, s) = (Arc::clone(ctl), Arc::clone(stop));
        v.push(std::thread::spawn(move || {
            let r = c.protect_all();
            tracing::info!(answers = %r, "initial protect");
            let every = c.ha_watch_interval();
            while !s.load(Ordering::SeqCst) {
                let t = Instant::now();
                c.ha_watch_once();
                std::thread::sleep(every.saturating_sub(t.elapsed()));
            }
        }));
    }
    if let Some(h) = ctl.hosts() {
        let (c, s) = (Arc::clone(ctl), Arc::clone(stop));
        let every = Duration::from_millis(h.cfg.poll_ms);
        v.push(std::thread::spawn(move || {
            while !s.load(Ordering::SeqCst) {
                let t = Instant::now();
                c.hosts_watch_once();
                std::thread::sleep(every.saturating_sub(t.elapsed()));
            }
        }));
    }
    let (c, s) = (Arc::clone(ctl), Arc::clone(stop));
    let hb = ctl.heartbeat_interval();
    v.push(std::thread::spawn(move || {
        while !s.load(Ordering::SeqCst) {
            let t = Instant::now();
            c.heartbeat_once();
            std::thread::sleep(hb.saturating_sub(t.elapsed()));
        }
    }));
    let (c, s) = (Arc::clone(ctl), Arc::clone(stop));
    let pi = Duration::from_millis(cfg.controller.policy_interval_ms.max(10));
    v.push(std::thread::spawn(move || {
        // A move the previous leader left half done, first (it may wait on a replica: here,
        // not before this controller serves).
        c.retry_intents();
        while !s.load(Ordering::SeqCst) {
            std::thread::sleep(pi);
            c.retry_intents();
            if let Err(e) = c.policy_tick(false) {
                tracing::warn!(error = %e, "policy action failed");
            }
        }
    }));
    let (c, s) = (Arc::clone(ctl), Arc::clone(stop));
    let gi = Duration::from_millis(cfg.controller.gc_interval_ms.max(100));
    v.push(std::thread::spawn(move || {
        let mut last = Instant::now();
        while !s.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(50));
            if last.elapsed() >= gi {
                last = Instant::now();
                if let Err(e) = c.gc_exceptions() {
                    tracing::debug!(error = %e, "exception GC skipped");
                }
            }
        }
    }));
    v
}

/// This controller's name among candidates: `[controller] name`, or `<hostname>-<pid>`.
fn candidate_name(cfg: &ControllerConfig) -> String {
    cfg.controller.name.clone().unwrap_or_else(|| {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "controller".into());
        format!("{host}-{}", std::process::id())
    })
}

/// A standby's look at the leader: only a TCP API can be probed from another host, and only a
/// refused connection is proof that nothing listens there any more (the leader binds its API
/// before it campaigns and keeps it until it exits). Anything else — silence, a timeout, a
/// unix path — is no evidence: wait for the lease.
fn probe_leader(l: &crate::store::Leader, refusals: &mut u32) -> crate::store::Verdict {
    use crate::store::Verdict;
    let Ok(addr) = l.candidate.api.parse::<std::net::SocketAddr>() else {
        return Verdict::Wait;
    };
    match std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)) {
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => *refusals += 1,
        _ => *refusals = 0,
    }
    // Two refusals in a row: one stray RST is not a death.
    if *refusals >= 2 {
        *refusals = 0;
        Verdict::Depose
    } else {
        Verdict::Wait
    }
}

/// Runs the daemon until SIGINT/SIGTERM. With `[store] backend = "etcd"` it campaigns for
/// leadership (serving the API as a standby meanwhile), leads, and when its leadership ends
/// under it stops acting at once and becomes a standby again.
pub fn run(config: &Path) -> Result<(), DaemonError> {
    let cfg = ControllerConfig::load(config)?;
    // Before any thread is spawned (API server, loops), so that all of them inherit it.
    if let Some(p) = cfg.controller.realtime_priority {
        pliant_runtime::sched::set_realtime(p)
            .map_err(|e| DaemonError::Setup(format!("controller.realtime_priority: {e}")))?;
    }
    let token = crate::auth::load_or_create_token(&cfg.controller.token_file)?;
    // The API is bound before anything else (and before a campaign): a standby that finds it
    // refusing connections may depose this controller.
    let serving: Arc<std::sync::RwLock<Option<Arc<Controller>>>> = Arc::default();
    let leader_seen: Arc<std::sync::Mutex<serde_json::Value>> = Arc::default();
    let (h_serving, h_seen) = (serving.clone(), leader_seen.clone());
    let etcd = cfg
        .store
        .as_ref()
        .filter(|s| s.backend == crate::config::StoreBackend::Etcd);
    // Without elections there is nothing to wait for: the controller is built before its API
    // answers, so a client never meets a controller that is not ready (as before elections).
    let mut prebuilt: Option<Arc<Controller>> = None;
    if etcd.is_none() {
        let control = dialer(&cfg).map_err(DaemonError::Setup)?;
        let migrator = crate::migrator::RuntimeMigrator {
            peer_endpoint: cfg.controller.peer_endpoint.clone(),
            control: control.clone(),
            timeout: Duration::from_millis(cfg.controller.rpc_timeout_ms),
        };
        let ctl = Arc::new(build_on(
            &cfg,
            open_store(&cfg)?,
            control,
            Box::new(migrator),
        )?);
        *serving.write().unwrap_or_else(|p| p.into_inner()) = Some(Arc::clone(&ctl));
        prebuilt = Some(ctl);
    }
    if let Some(dir) = cfg.controller.api_socket.parent() {
        std::fs::create_dir_all(dir)
            .map_err(|e| DaemonError::Setup(format!("{}: {e}", dir.display())))?;
    }
    let mut server = Server::start(
        &Listen {
            unix: Some(cfg.controller.api_socket.clone()),
            tcp: cfg.controller.api_tcp.clone(),
        },
        token,
        Box::new(move |r| {
            let current = h_serving.read().unwrap_or_else(|p| p.into_inner()).clone();
            match current {
                Some(c) => crate::api::handle(&c, r),
                None => standby_answer(&h_seen.lock().unwrap_or_else(|p| p.into_inner())),
            }
        }),
    )?;
    // SAFETY: installing handlers that only perform an atomic store.
    unsafe {
        let h = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
        libc::signal(libc::SIGINT, h);
        libc::signal(libc::SIGTERM, h);
    }
    let name = candidate_name(&cfg);
    let r = loop {
        let (ctl, leadership) = match prebuilt.take() {
            Some(c) => (c, None),
            None => {
                // One dialer per term: the migrator's clone shares it.
                let control = dialer(&cfg).map_err(DaemonError::Setup)?;
                let (store, leadership): (Box<dyn Store>, Option<crate::store::Leadership>) =
                    match etcd {
                        None => (open_store(&cfg)?, None),
                        Some(s) => match campaign(&cfg, s, &name, &leader_seen, &control)? {
                            Some((store, l)) => (Box::new(store), Some(l)),
                            None => break Ok(()),
                        },
                    };
                let migrator = crate::migrator::RuntimeMigrator {
                    peer_endpoint: cfg.controller.peer_endpoint.clone(),
                    control: control.clone(),
                    timeout: Duration::from_millis(cfg.controller.rpc_timeout_ms),
                };
                let ctl = match build_on(&cfg, store, control, Box::new(migrator)) {
                    Ok(c) => Arc::new(c),
                    // A leader that cannot build (etcd gone between the election and the reads)
                    // tries again as a candidate; without elections it is fatal as before.
                    Err(e) if leadership.is_some() => {
                        eprintln!("pliant controller {name}: cannot take over: {e}; standing by");
                        // Hand the leadership back at once (another candidate may do better) rather
                        // than hold it idle until the lease expires.
                        resign(etcd, leadership);
                        std::thread::sleep(Duration::from_millis(cfg.controller.leader_poll_ms));
                        continue;
                    }
                    Err(e) => break Err(e),
                };
                (ctl, leadership)
            }
        };
        if let Some(l) = &leadership {
            ctl.set_role(serde_json::json!({"role": "leader", "name": name, "term": l.term}));
        }
        *serving.write().unwrap_or_else(|p| p.into_inner()) = Some(Arc::clone(&ctl));
        let stop = Arc::new(AtomicBool::new(false));
        let loops = spawn_loops(&ctl, &cfg, &stop);
        tracing::info!(api = %cfg.controller.api_socket.display(), "controller serving");
        eprintln!(
            "pliant controller: serving on {} (token in {})",
            cfg.controller.api_socket.display(),
            cfg.controller.token_file.display()
        );
        let mut lost = false;
        while !STOP.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(10));
            if leadership.as_ref().is_some_and(|l| !l.valid()) {
                lost = true;
                break;
            }
        }
        // Stop acting: the API answers as a standby from now on, the loops end after the
        // step they are in (anything they still send carries the old term, which etcd and
        // the replicas refuse once the successor has spoken).
        *serving.write().unwrap_or_else(|p| p.into_inner()) = None;
        stop.store(true, Ordering::SeqCst);
        if lost {
            let term = leadership.as_ref().map_or(0, |l| l.term);
            eprintln!(
                "pliant controller {name}: leadership of term {term} ended (lease lost or \
                 revoked): standing by"
            );
            tracing::warn!(term, "leadership lost, standing by");
        }
        for l in loops {
            let _ = l.join();
        }
        drop(ctl);
        if !lost {
            // A clean stop hands over at once instead of after the TTL.
            resign(etcd, leadership);
            break Ok(());
        }
    };
    server.stop();
    r
}

/// Campaigns (as a standby meanwhile) until this controller leads: its store is then fenced
/// by the term and `control` carries the term. `None`: stopped (SIGINT/SIGTERM) while waiting.
fn campaign(
    cfg: &ControllerConfig,
    s: &crate::config::StoreSection,
    name: &str,
    leader_seen: &std::sync::Mutex<serde_json::Value>,
    control: &crate::replica_client::Dialer,
) -> Result<Option<(EtcdStore, crate::store::Leadership)>, DaemonError> {
    let mut store = EtcdStore::connect(&s.etcd_options())?;
    let me = crate::store::Candidate {
        name: name.to_string(),
        api: cfg
            .controller
            .api_tcp
            .clone()
            .unwrap_or_else(|| cfg.controller.api_socket.display().to_string()),
    };
    eprintln!("pliant controller {name}: standby, campaigning for leadership");
    let mut refusals = 0;
    let t_wait = Instant::now();
    let won = store.campaign(
        &me,
        Duration::from_millis(cfg.controller.leader_ttl_ms),
        Duration::from_millis(cfg.controller.leader_poll_ms),
        &STOP,
        |seen| {
            let mut last = leader_seen.lock().unwrap_or_else(|p| p.into_inner());
            match seen {
                crate::store::Seen::Leader(l) => {
                    *last = serde_json::json!({"name": l.candidate.name,
                    "api": l.candidate.api, "term": l.term});
                    drop(last);
                    probe_leader(l, &mut refusals)
                }
                crate::store::Seen::Unavailable(e) => {
                    *last = serde_json::json!({"store_error": e.to_string()});
                    crate::store::Verdict::Wait
                }
            }
        },
    )?;
    let Some(l) = won else { return Ok(None) };
    store.fence_writes(l.term);
    control.set_term(l.term);
    eprintln!(
        "pliant controller {name}: leading in term {} (waited {} ms)",
        l.term,
        t_wait.elapsed().as_millis()
    );
    tracing::info!(term = l.term, name = %name, "leading");
    Ok(Some((store, l)))
}

/// Ends a leadership now (its lease revoked, the leader key gone), best effort: if etcd does
/// not answer, the lease expires by itself.
fn resign(etcd: Option<&crate::config::StoreSection>, l: Option<crate::store::Leadership>) {
    if let (Some(l), Some(s)) = (l, etcd) {
        if let Ok(store) = EtcdStore::connect(&s.etcd_options()) {
            let _ = store.resign(l);
        }
    }
}

/// What a standby's API answers: 503, naming the leader it last saw.
fn standby_answer(seen: &serde_json::Value) -> crate::http::Response {
    let error = match (seen["name"].as_str(), seen["store_error"].as_str()) {
        (Some(name), _) => format!(
            "standby controller: {name:?} leads in term {} (API {}); ask it",
            seen["term"], seen["api"]
        ),
        (None, Some(e)) => format!(
            "standby controller: the store does not answer ({e}): no controller can lead until \
             it does; replicas forward and replicate on, no placement changes"
        ),
        (None, None) => "standby controller: no leader seen yet".to_string(),
    };
    crate::http::Response::json(
        503,
        &serde_json::json!({"ok": false, "role": "standby", "error": error, "leader": seen}),
    )
}
