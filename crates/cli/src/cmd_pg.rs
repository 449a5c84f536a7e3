//! `pliant pg up|down|status`: a commit-protected PostgreSQL pair behind the session-preserving
//! proxy (see crates/pg/README.md).
use clap::{Args, Subcommand};

#[derive(Args)]
pub struct PgArgs {
    #[command(subcommand)]
    cmd: PgCmd,
}

#[derive(Subcommand)]
enum PgCmd {
    /// Create primary + synchronous standby in namespaces and start the proxy (in the background).
    Up {
        /// Stay in the foreground (the background process runs this).
        #[arg(long)]
        foreground: bool,
        /// How the proxy authenticates clients: scram-sha-256 (libpq's default) or md5.
        #[arg(long, default_value = "scram-sha-256")]
        auth: pliant_pg::proxy::AuthMethod,
        /// If the standby is lost (unreachable, or a commit waits for it) this long, the
        /// primary runs unprotected until the standby is back (ms; 0 = block commits instead).
        #[arg(long, default_value_t = pliant_pg::bench::DEFAULT_ASYNC_FALLBACK_MS)]
        async_fallback_ms: u64,
        /// TLS everywhere: a private CA and server certificate are made in the run directory
        /// (keys 0600); the proxy requires TLS of its clients (SCRAM-SHA-256-PLUS offered) and
        /// uses TLS, verified against that CA, towards the servers (ssl = on, hostssl only).
        /// `up` prints the CA's path (`sslrootcert`).
        #[arg(long)]
        tls: bool,
        /// A primary that stops answering the proxy's health probe while its server still
        /// accepts connections (busy, not dead) is failed over only after this many ms
        /// (a refused connection fails it over at once). Raise it on a loaded machine.
        #[arg(long, default_value_t = pliant_pg::proxy::DEFAULT_PROBE_DEAD_AFTER_MS,
              value_parser = clap::value_parser!(u64).range(250..=600_000))]
        probe_dead_after_ms: u64,
        /// Event-loop threads that relay the established sessions (0 = one per four CPUs, at least one).
        #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=64))]
        relay_threads: u64,
    },
    /// Stop the proxy and servers and remove the namespaces.
    Down,
    /// Roles, replication lag, sessions and failovers (JSON).
    Status,
}

pub fn run(a: PgArgs) -> Result<(), String> {
    let out = match a.cmd {
        PgCmd::Up {
            foreground,
            auth,
            async_fallback_ms,
            tls,
            probe_dead_after_ms,
            relay_threads,
        } => pliant_pg::cmd::up(
            foreground,
            &pliant_pg::cmd::UpOpts {
                auth,
                async_fallback_ms,
                tls,
                probe_dead_after_ms,
                relay_threads: relay_threads as usize,
            },
        )?,
        PgCmd::Down => pliant_pg::cmd::down()?,
        PgCmd::Status => pliant_pg::cmd::status()?,
    };
    println!("{out}");
    Ok(())
}
