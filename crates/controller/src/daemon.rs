//! `pliant controller --config ctl.toml`: builds the controller from its config and runs the
//! API server plus three loops (heartbeats, policy, exception GC) until SIGINT/SIGTERM.

use crate::agent::{Agent, LabAgent};
use crate::config::ControllerConfig;
use crate::controller::{Controller, Settings};
use crate::http::{Listen, Server};
use crate::migrator::Migrator;
use crate::ports::PortBlocks;
use crate::steering::{FabricSteering, LabLinkSteering, MemSteering, Steering};
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
    let c = &cfg.controller;
    let store = open_store(cfg)?;
    let port_blocks = match &cfg.ports {
        Some(p) => Some((
            PortBlocks::new(p.lo, p.hi, p.block).map_err(|e| DaemonError::Setup(e.to_string()))?,
            p.per_replica,
        )),
        None => None,
    };
    let settings = Settings {
        heartbeat: Duration::from_millis(c.heartbeat_ms),
        dead_after_missed: c.dead_after_missed,
        rpc_timeout: Duration::from_millis(c.rpc_timeout_ms),
        heartbeat_timeout: Duration::from_millis(c.heartbeat_timeout_ms),
        port_blocks,
        ha: cfg.ha.clone().unwrap_or_else(crate::ha::HaConfig::off),
        control: dialer(cfg).map_err(DaemonError::Setup)?,
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
            let agent = LabAgent::new(&l.name, opts);
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
            (Some(Box::new(agent)), steering)
        }
        None => (None, Box::new(MemSteering::default())),
    };
    Ok(Controller::new(
        settings,
        store,
        steering,
        agent,
        migrator,
        statics,
        cfg.policy.clone(),
    )?)
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
        while !s.load(Ordering::SeqCst) {
            std::thread::sleep(pi);
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

/// Runs the daemon until SIGINT/SIGTERM.
pub fn run(config: &Path, migrator: Box<dyn Migrator>) -> Result<(), DaemonError> {
    let cfg = ControllerConfig::load(config)?;
    // Before any thread is spawned (API server, loops), so that all of them inherit it.
    if let Some(p) = cfg.controller.realtime_priority {
        pliant_runtime::sched::set_realtime(p)
            .map_err(|e| DaemonError::Setup(format!("controller.realtime_priority: {e}")))?;
    }
    let token = crate::auth::load_or_create_token(&cfg.controller.token_file)?;
    let ctl = Arc::new(build(&cfg, migrator)?);
    let handler_ctl = Arc::clone(&ctl);
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
        Box::new(move |r| crate::api::handle(&handler_ctl, r)),
    )?;
    // SAFETY: installing handlers that only perform an atomic store.
    unsafe {
        let h = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
        libc::signal(libc::SIGINT, h);
        libc::signal(libc::SIGTERM, h);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let loops = spawn_loops(&ctl, &cfg, &stop);
    tracing::info!(api = %cfg.controller.api_socket.display(), "controller serving");
    eprintln!(
        "pliant controller: serving on {} (token in {})",
        cfg.controller.api_socket.display(),
        cfg.controller.token_file.display()
    );
    while !STOP.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(50));
    }
    stop.store(true, Ordering::SeqCst);
    server.stop();
    for l in loops {
        let _ = l.join();
    }
    Ok(())
}
