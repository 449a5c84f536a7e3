//! pliant-agent: one per host. Runs the replicas its host is provisioned for when a controller
//! asks, watches them, and answers the controller's polls.
//!
//! - [`config`]: `agent.toml` (name, listener, identity, the replica slots).
//! - [`slots`]: start/stop/watch of the replica processes (exact exit status of its children,
//!   PID files to adopt replicas across an agent restart).
//! - [`server`]: the control link (sealed with an AGENT identity), the term fence.
//! - [`fabric`]: on the fabric's host, the steering maps held for the leading controller.
//! - [`testing`]: an agent in-process with stand-in replicas, for tests here and elsewhere.
//!
//! Why an agent: a controller on another machine cannot fork a process on this one, and it
//! cannot tell from afar whether a replica's process died (the host answers: restart it or fail
//! over at once), the host died, or the host only became unreachable (the agent's silence,
//! weighed against the replicas' own). The agent is the host's witness.

pub mod config;
pub mod fabric;
pub mod server;
pub mod slots;
pub mod testing;

use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Runs the agent until `stop` is set.
pub fn run(
    cfg: &config::AgentConfig,
    stop: &std::sync::atomic::AtomicBool,
    on_ready: impl FnOnce(&pliant_wire::Endpoint),
) -> Result<(), String> {
    let fabric = cfg
        .fabric
        .as_ref()
        .map(|f| Arc::new(fabric::Fabric::netns(&f.netns)));
    run_with(cfg, stop, on_ready, fabric)
}

/// [`run`] with the fabric steering given (a test's in-memory one).
pub fn run_with(
    cfg: &config::AgentConfig,
    stop: &std::sync::atomic::AtomicBool,
    on_ready: impl FnOnce(&pliant_wire::Endpoint),
    fabric: Option<Arc<fabric::Fabric>>,
) -> Result<(), String> {
    let security = match &cfg.agent.identity {
        Some(dir) => {
            let s = pliant_wire::Security::load(dir, cfg.agent.encrypt.unwrap_or_default())
                .map_err(|e| format!("agent.identity {}: {e}", dir.display()))?;
            if s.identity.cert.roles & pliant_wire::role::AGENT == 0 {
                return Err(format!(
                    "agent.identity {}: the certificate of {:?} lacks the AGENT role",
                    dir.display(),
                    s.name()
                ));
            }
            if s.name() != cfg.agent.name {
                return Err(format!(
                    "agent.identity {} is {:?}, agent.name is {:?}",
                    dir.display(),
                    s.name(),
                    cfg.agent.name
                ));
            }
            Some(s)
        }
        None => None,
    };
    let slots = Arc::new(slots::Slots::new(&cfg.agent, &cfg.replica)?);
    let shared = Arc::new(server::Shared {
        name: cfg.agent.name.clone(),
        slots: slots.clone(),
        fence: Default::default(),
        counters: Default::default(),
        security,
        probe_ms: cfg.agent.probe_ms,
        stop: Default::default(),
        fabric,
    });
    let ep: pliant_wire::Endpoint = cfg
        .agent
        .listen
        .parse()
        .map_err(|e| format!("agent.listen: {e}"))?;
    let server = server::Server::start(&ep, shared.clone())?;
    let local = match &cfg.agent.socket {
        Some(p) => Some(server::Server::start(
            &pliant_wire::Endpoint::Unix(p.clone()),
            shared.clone(),
        )?),
        None => None,
    };
    tracing::info!(agent = %cfg.agent.name, listen = %server.endpoint(), slots = cfg.replica.len(), "agent up");
    on_ready(server.endpoint());
    let watch_stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (ws, sl) = (watch_stop.clone(), slots.clone());
    let watcher = std::thread::Builder::new()
        .name("pliant-agent-watch".into())
        .spawn(move || sl.watch(&ws))
        .map_err(|e| format!("spawn watch thread: {e}"))?;
    while !stop.load(Ordering::SeqCst) {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    drop(server);
    drop(local);
    watch_stop.store(true, Ordering::SeqCst);
    let _ = watcher.join();
    tracing::info!(agent = %cfg.agent.name, "agent stopped (its replicas keep running)");
    Ok(())
}

static STOP: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn on_signal(_sig: libc::c_int) {
    // Only an atomic store: async-signal-safe.
    STOP.store(true, Ordering::SeqCst);
}

/// [`run`] until SIGTERM or SIGINT (the `pliant agent` command).
pub fn run_until_signal(
    cfg: &config::AgentConfig,
    on_ready: impl FnOnce(&pliant_wire::Endpoint),
) -> Result<(), String> {
    // SAFETY: installing handlers that only perform an atomic store.
    unsafe {
        let h = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
        libc::signal(libc::SIGINT, h);
        libc::signal(libc::SIGTERM, h);
    }
    run(cfg, &STOP, on_ready)
}
