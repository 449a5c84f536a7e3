//! `pliant replica|stats|query` (owned by the runtime work; placeholder until it lands).
use clap::Args;

#[derive(Args)]
pub struct ReplicaArgs {
    /// Replica configuration file (TOML).
    #[arg(long)]
    pub config: String,
}
#[derive(Args)]
pub struct StatsArgs {
    /// Control socket of the replica.
    #[arg(long)]
    pub socket: String,
}
#[derive(Args)]
pub struct QueryArgs {
    /// Control socket of the replica.
    #[arg(long)]
    pub socket: String,
}

pub fn run(_a: ReplicaArgs) -> Result<(), String> {
    Err("not yet implemented".into())
}
pub fn stats(_a: StatsArgs) -> Result<(), String> {
    Err("not yet implemented".into())
}
pub fn query(_a: QueryArgs) -> Result<(), String> {
    Err("not yet implemented".into())
}
