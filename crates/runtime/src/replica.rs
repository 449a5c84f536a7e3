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

/// Runs a replica with NF `nf` until SIGTERM/SIGINT or a `shutdown` control request.
pub fn run<N: NetworkFunction>(cfg: &ReplicaConfig, nf: N) -> Result<(), String> {
    cfg.check_interfaces()?;
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
    let opts = PortOptions { vnet_hdr, ..base };
    let inside = PacketPort::open(&cfg.inside.ifname, &opts).map_err(|e| e.to_string())?;
    let outside = PacketPort::open(&cfg.outside.ifname, &opts).map_err(|e| e.to_string())?;
    let (server, handle) = control::start(
        &cfg.replica.control_socket,
        cfg.replica.metrics_listen.as_deref(),
    )?;
    let mut engine = Engine::new(
        &cfg.replica.name,
        nf,
        [inside, outside],
        nets,
        EngineOptions::default(),
        Instant::now(),
    );
    engine.set_control(handle);
    tracing::info!(
        replica = %cfg.replica.name,
        nf = N::NAME,
        inside = %cfg.inside.ifname,
        outside = %cfg.outside.ifname,
        socket = %cfg.replica.control_socket,
        "replica running"
    );
    let res = engine.run(&STOP).map_err(|e| format!("packet loop: {e}"));
    tracing::info!(replica = %cfg.replica.name, "replica stopping");
    drop(engine);
    drop(server);
    drop(guards);
    res
}
