//! `pliant hub`: the coherence hub that keeps shared state (combiner contributions, strong
//! copies, lease locks) coherent across replica processes. See crates/coherence/README.md.
//!
//! The hub listens on a pliant-wire endpoint (a unix socket path, or `host:port` for replicas
//! on other hosts) and authenticates with its own identity (`--identity DIR`, issued by
//! `pliant keys issue --role service`). It accepts only replicas holding a certificate of the
//! same CA with the replica role, and each only as the replica its certificate names; replicas
//! in turn accept only a hub with the service role. Replicas point at it with
//! `[shared] hub = "<endpoint>"` and their own `[security] identity`.

use clap::Args;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Args, Debug)]
pub struct HubArgs {
    /// Endpoint to listen on: a unix socket path (absolute, or ./relative; created mode 0600;
    /// a stale socket of a dead hub is replaced) or host:port for TCP.
    #[arg(long)]
    pub listen: String,
    /// The hub's identity directory (node.key mode 0600, node.cert, ca.pub), with the service
    /// role: `pliant keys issue --ca CA --name hub --role service --out DIR`.
    #[arg(long)]
    pub identity: PathBuf,
    /// When frames are encrypted (always authenticated): auto (over TCP), always, never.
    #[arg(long, default_value = "auto")]
    pub encrypt: pliant_wire::Encrypt,
    /// Bound on open client connections (one thread each).
    #[arg(long, default_value_t = 64)]
    pub max_connections: usize,
    /// Longest lock lease granted, in milliseconds (longer requests are capped).
    #[arg(long, default_value_t = 60_000)]
    pub max_lease_ms: u64,
}

/// Runs the hub until SIGTERM/SIGINT; prints its final counters as one JSON line.
pub fn run(a: HubArgs) -> Result<(), String> {
    if a.max_connections == 0 {
        return Err("--max-connections must be at least 1".into());
    }
    let ep: pliant_wire::Endpoint = a.listen.parse().map_err(|e| format!("--listen: {e}"))?;
    let sec = pliant_wire::Security::load(&a.identity, a.encrypt)
        .map_err(|e| format!("--identity {}: {e}", a.identity.display()))?;
    let cfg = pliant_coherence::HubConfig {
        max_connections: a.max_connections,
        max_lease: Duration::from_millis(a.max_lease_ms),
        ..Default::default()
    };
    eprintln!(
        "pliant hub: starting on {ep} as {:?}; serving until SIGTERM/SIGINT",
        sec.name()
    );
    let stats = pliant_coherence::run_hub_until_signal(&ep, sec, cfg).map_err(|e| e.to_string())?;
    println!(
        "{}",
        serde_json::to_string(&stats).map_err(|e| e.to_string())?
    );
    Ok(())
}
