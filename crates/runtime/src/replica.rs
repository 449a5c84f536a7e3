//! Start-up and shutdown of one replica process around an [`Engine`].
//!
//! Order matters: everything that can be refused (config, interfaces, addresses) is checked
//! before anything is changed; the kernel guard is installed before the ports open so the
//! kernel never reacts to a frame the runtime owns; teardown runs in reverse by `Drop`.

use crate::config::ReplicaConfig;
use crate::control;
use crate::engine::{Engine, EngineOptions};
use crate::kernel::KernelGuard;
use crate::nf::NetworkFunction;
use crate::route::SideNet;
use pliant_io::{PacketPort, PortOptions};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

static STOP: AtomicBool = AtomicBool::new(false);

/// Standby flow records a backup holds for all primaries together (beyond: checkpoints are
/// refused, counted; the primary's group then runs unprotected and asks for a new backup).
const STANDBY_MAX_FLOWS: usize = 1 << 20;

extern "C" fn on_signal(_sig: libc::c_int) {
    // Only an atomic store: async-signal-safe.
    STOP.store(true, Ordering::SeqCst);
}

/// SIGTERM and SIGINT request a clean shutdown (tc filter and socket removed).
fn install_signal_handlers() -> Result<(), String> {
    for sig in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: a zeroed sigaction with a plain handler and an empty mask is valid; the
        // handler only touches an atomic.
        let rc = unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as *const () as usize;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut())
        };
        if rc != 0 {
            return Err(format!(
                "sigaction({sig}): {}",
                std::io::Error::last_os_error()
            ));
        }
    }
    Ok(())
}

/// Measurement knobs on the port layout (for benchmarking alternatives in one binary; the
/// defaults are what `PortOptions` chooses): `PLIANT_RX_SLOTS` = V2 RX slots per port,
/// `PLIANT_TX_SLOT_BYTES` = bytes per TX-ring slot (65_664 lets GSO super-frames use the ring
/// instead of a copying `sendmsg`; lower `PLIANT_TX_SLOTS` with it, the ring is slots x bytes),
/// `PLIANT_TX_MODE=sendmmsg` = `TxMode::Sendmmsg` instead of the TX ring. Values
/// `PacketPort::open` refuses make the replica fail to start with the reason, like a bad config.
/// Measured, none beat the defaults (crates/runtime/README.md, "Packet loop performance").
fn tune_ports(mut o: PortOptions) -> PortOptions {
    let num = |k: &str| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.trim().parse::<u32>().ok())
    };
    if let (Some(n), pliant_io::RxRing::V2 { frame_bytes, .. }) = (num("PLIANT_RX_SLOTS"), o.rx) {
        o.rx = pliant_io::RxRing::V2 {
            frame_bytes,
            frame_count: n,
        };
    }
    if let Some(b) = num("PLIANT_TX_SLOT_BYTES") {
        o.tx_frame_bytes = b;
    }
    if let Some(n) = num("PLIANT_TX_SLOTS") {
        o.tx_frame_count = n;
    }
    if std::env::var("PLIANT_TX_MODE").as_deref() == Ok("sendmmsg") {
        o.tx_mode = pliant_io::TxMode::Sendmmsg;
    }
    o
}

/// `EngineOptions` with the measurement knob `PLIANT_BATCH` (frames per port per round,
/// 1..=max_output/2; default 64): bigger batches mean fewer TX kicks per frame under load.
fn engine_options() -> EngineOptions {
    let mut o = EngineOptions::default();
    if let Some(b) = std::env::var("PLIANT_BATCH")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
    {
        // Two ports x batch must stay under `max_output` (4096) or outputs are dropped.
        o.batch = b.clamp(1, o.max_output / 2);
    }
    o
}

/// How long the packet loop keeps polling after the last frame before sleeping in poll(2)
/// (`engine::io_loop`): `PLIANT_SPIN_US` (0 = sleep after every empty round), default
/// [`crate::engine::io_loop::DEFAULT_SPIN`]. An unparsable value falls back to the default.
fn spin_budget() -> std::time::Duration {
    std::env::var("PLIANT_SPIN_US")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map_or(crate::engine::io_loop::DEFAULT_SPIN, |us| {
            // Bounded: a typo must not turn into a replica that never sleeps.
            std::time::Duration::from_micros(us.min(100_000))
        })
}

/// Runs a replica with NF `nf` until SIGTERM/SIGINT or a `shutdown` control request.
pub fn run<N: NetworkFunction>(cfg: &ReplicaConfig, nf: N) -> Result<(), String> {
    if cfg.ftmb().is_some() {
        return Err(format!(
            "[ha] mode = \"ftmb\": the {} NF must be run with replica::run_ftmb",
            N::NAME
        ));
    }
    run_with(cfg, nf, |_| Ok(()))
}

/// Runs a replica in FTMB mode (`[ha] mode = "ftmb"`): the engine's I/O thread hands IP
/// packets to `ftmb_workers` worker threads running `nf`, and this replica hosts an FTMB
/// logger for another primary on `ftmb_socket` (a unix path or TCP `host:port`). Both the
/// streams to a logger and the hosted logger authenticate with the `[security]` identity.
pub fn run_ftmb<F: crate::ftmb::FtmbNf>(cfg: &ReplicaConfig, nf: F) -> Result<(), String> {
    let Some(s) = cfg.ftmb() else {
        return Err("run_ftmb needs [ha] mode = \"ftmb\" in the config".into());
    };
    let Some(security) = cfg.security() else {
        return Err("[ha] mode = \"ftmb\" needs a [security] section".into());
    };
    let host_socket: pliant_wire::Endpoint = s
        .socket
        .parse()
        .map_err(|e| format!("[ha] ftmb_socket: {e}"))?;
    let mut opts = crate::ftmb::FtmbOptions::new(&cfg.replica.name, s.workers);
    opts.snapshot_every = std::time::Duration::from_millis(s.snapshot_ms);
    opts.security = Some(security.load()?);
    opts.host_socket = Some(host_socket);
    run_with(cfg, crate::ftmb::FtmbShell::<F>::default(), move |engine| {
        let mode = crate::ftmb::start(nf, opts)?;
        engine.set_ftmb(mode);
        tracing::info!(
            workers = s.workers,
            snapshot_ms = s.snapshot_ms,
            ftmb_socket = %s.socket,
            "ftmb mode: workers started, hosting a logger"
        );
        Ok(())
    })
}

/// Start-up shared by both modes; `setup` runs on the built engine before the loop starts.
fn run_with<N: NetworkFunction>(
    cfg: &ReplicaConfig,
    nf: N,
    setup: impl FnOnce(&mut Engine<N, PacketPort>) -> Result<(), String>,
) -> Result<(), String> {
    cfg.check_interfaces()?;
    // Before any thread exists, so that all of them inherit the policy (crate::sched).
    if let Some(prio) = cfg.replica.realtime_priority {
        crate::sched::set_realtime(prio)
            .map_err(|e| format!("[replica] realtime_priority: {e}"))?;
        tracing::info!(priority = prio, "replica threads run under SCHED_FIFO");
    }
    let nets = [
        SideNet::from_config(&cfg.inside)?,
        SideNet::from_config(&cfg.outside)?,
    ];
    install_signal_handlers()?;
    let guards = [
        KernelGuard::install(&cfg.inside.ifname)?,
        KernelGuard::install(&cfg.outside.ifname)?,
    ];
    // vnet_hdr: GSO super-frames and partial checksums pass through as one unit (the engine
    // restores them on output); PLIANT_VNET_HDR=0 turns it off (software checksums, MTU-sized
    // frames only).
    let vnet_hdr = std::env::var("PLIANT_VNET_HDR").map_or(true, |v| v != "0");
    // Ring layout: TPACKET_V2 by default. A V3 ring hands frames over only when a block fills or
    // its timeout fires (kernel timer granularity is 4 ms at HZ=250), which added ~0.7 ms to every
    // ping at low load; V2 makes each frame visible at once. PLIANT_RX_RING=v3 selects the
    // block ring (fewer wake-ups under sustained load).
    let base = match std::env::var("PLIANT_RX_RING").as_deref() {
        Ok("v3") => PortOptions::throughput(),
        _ => PortOptions::low_latency(),
    };
    let opts = tune_ports(PortOptions { vnet_hdr, ..base });
    let inside = PacketPort::open(&cfg.inside.ifname, &opts).map_err(|e| e.to_string())?;
    let outside = PacketPort::open(&cfg.outside.ifname, &opts).map_err(|e| e.to_string())?;
    // The replica's identity: every channel to another pliant process authenticates with it.
    // Without [security] the replica runs alone: control only on its unix socket to its own
    // uid, no peer channel (migrations are refused) and no replication listener.
    let security = cfg.security().map(|s| s.load()).transpose()?;
    let (server, handle) = control::start(&control::ControlOptions {
        socket: cfg.replica.control_socket.clone(),
        listen: cfg.replica.control_listen.clone(),
        metrics_listen: cfg.replica.metrics_listen.clone(),
        security: security.clone(),
    })?;
    let mut engine = Engine::new(
        &cfg.replica.name,
        nf,
        [inside, outside],
        nets,
        engine_options(),
        Instant::now(),
    );
    engine.set_control(handle);
    let peer_path = cfg.peer_socket();
    let mut peer_server = None;
    if let Some(sec) = &security {
        let (server, link) = crate::peer::start(&peer_path, sec.clone())?;
        engine.set_peer(link);
        peer_server = Some(server);
    } else {
        tracing::warn!("no [security] identity: the peer channel (migration) is off");
    }
    // Coherent shared state across replicas: with [shared], the store's transport and lock
    // service is the hub (`pliant hub`), reached as this replica's certified identity (parse
    // refuses [shared] without [security]); without it the store stays local to this replica.
    if let Some(sh) = cfg.shared() {
        let sec = security
            .clone()
            .ok_or("[shared] needs a [security] identity to authenticate to the hub")?;
        let hub: pliant_wire::Endpoint =
            sh.hub.parse().map_err(|e| format!("[shared] hub: {e}"))?;
        engine.ctx.shared = pliant_coherence::store_for(
            &cfg.replica.name,
            &hub,
            sec,
            pliant_state::SharedConfig::default(),
        )
        .map_err(|e| format!("[shared] hub {}: {e}", sh.hub))?;
    } else {
        // Local store, but with this replica's own id: a survivor merging a retiring
        // replica's combiner contributions (scale-in) refuses an export carrying its own id,
        // and every replica had id 0 before.
        let id = pliant_coherence::replica_id_for_name(&cfg.replica.name);
        engine.ctx.shared = pliant_state::LocalCoherence::new(pliant_state::HubConfig::default())
            .store(id, pliant_state::SharedConfig::default());
    }
    // HA: a replica with [ha] (and the [security] identity it requires) listens for
    // checkpoints (backup role) and may be asked to protect its own flows (primary role).
    // In ftmb mode the FTMB logger streams are its HA channel instead (`setup`).
    let repl_ep = cfg.repl_socket();
    let mut repl_server = None;
    let pico = cfg.ha().is_some() && cfg.ftmb().is_none();
    if let (true, Some(sec)) = (pico, security.clone()) {
        let ep: pliant_wire::Endpoint = repl_ep
            .parse()
            .map_err(|e| format!("[ha] repl_socket: {e}"))?;
        let store = std::sync::Arc::new(std::sync::Mutex::new(
            pliant_ha::standby::StandbyStore::new(STANDBY_MAX_FLOWS),
        ));
        let server = std::sync::Arc::new(
            pliant_ha::transport::ReplServer::start(&ep, sec.clone(), store.clone())
                .map_err(|e| e.to_string())?,
        );
        let stats_of = server.clone();
        engine.set_ha_backend(crate::engine::HaBackend {
            factory: Box::new(crate::ha::SenderFactory { sec, opts: None }),
            store: Some(store),
            server_stats: Some(Box::new(move || {
                serde_json::to_value(stats_of.stats()).unwrap_or(serde_json::Value::Null)
            })),
        });
        repl_server = Some(server);
    }
    setup(&mut engine)?;
    tracing::info!(
        replica = %cfg.replica.name,
        nf = N::NAME,
        inside = %cfg.inside.ifname,
        outside = %cfg.outside.ifname,
        socket = %cfg.replica.control_socket,
        peer_socket = %peer_server.as_ref().map_or("none", |_| peer_path.as_str()),
        repl_socket = %repl_server.as_ref().map_or("none", |_| repl_ep.as_str()),
        "replica running"
    );
    let spin = spin_budget();
    let res = engine
        .run_paced(&STOP, spin)
        .map_err(|e| format!("packet loop: {e}"));
    tracing::info!(replica = %cfg.replica.name, "replica stopping");
    drop(engine);
    drop(repl_server);
    drop(peer_server);
    drop(server);
    drop(guards);
    res
}
