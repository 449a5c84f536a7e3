//! `pliant bench ha`: HA systems side by side on the same workloads, plus failover. Progress goes
//! to stderr; the last line of stdout is one JSON object.

use clap::Args;

#[derive(Args)]
pub struct HaArgs {
    /// Print only the JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

pub fn run(_a: HaArgs) -> Result<(), String> {
    Err("bench ha: not implemented yet".into())
}
