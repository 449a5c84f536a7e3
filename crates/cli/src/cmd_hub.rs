//! `pliant hub`: the coherence hub that keeps shared state (combiner contributions, strong
//! copies, lease locks) coherent across replica processes. See crates/coherence/README.md.

use clap::Args;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Args, Debug)]
pub struct HubArgs {
    /// Unix socket to listen on (created mode 0600; a stale socket of a dead hub is replaced).
    #[arg(long)]
    pub socket: PathBuf,
    /// Shared secret file (64+ hex digits, mode 0600). Every replica's `[shared] secret` names
    /// the same file.
    #[arg(long)]
    pub secret: PathBuf,
    /// Create the secret file (32 random bytes) if it does not exist yet.
    #[arg(long)]
    pub init_secret: bool,
    /// Bound on open client connections (one thread each).
    #[arg(long, default_value_t = 64)]
    pub max_connections: usize,
    /// Longest lock lease granted, in milliseconds (longer requests are capped).
    #[arg(long, default_value_t = 60_000)]
    pub max_lease_ms: u64,
}

/// Runs the hub until SIGTERM/SIGINT; prints its final counters as one JSON line.
pub fn run(a: HubArgs) -> Result<(), String> {
    if a.init_secret && !a.secret.exists() {
        pliant_coherence::Secret::generate(&a.secret).map_err(|e| e.to_string())?;
    }
    if a.max_connections == 0 {
        return Err("--max-connections must be at least 1".into());
    }
    let cfg = pliant_coherence::HubConfig {
        max_connections: a.max_connections,
        max_lease: Duration::from_millis(a.max_lease_ms),
        ..Default::default()
    };
    eprintln!(
        "pliant hub: serving {} until SIGTERM/SIGINT",
        a.socket.display()
    );
    let stats = pliant_coherence::run_hub_until_signal(&a.socket, &a.secret, cfg)
        .map_err(|e| e.to_string())?;
    println!(
        "{}",
        serde_json::to_string(&stats).map_err(|e| e.to_string())?
    );
    Ok(())
}
