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
    },
    /// Stop the proxy and servers and remove the namespaces.
    Down,
    /// Roles, replication lag, sessions and failovers (JSON).
    Status,
}

pub fn run(a: PgArgs) -> Result<(), String> {
    let out = match a.cmd {
        PgCmd::Up { foreground } => pliant_pg::cmd::up(foreground)?,
        PgCmd::Down => pliant_pg::cmd::down()?,
        PgCmd::Status => pliant_pg::cmd::status()?,
    };
    println!("{out}");
    Ok(())
}
