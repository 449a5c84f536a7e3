//! `pliant bench migrate` and `pliant bench scale-in` (elasticity benchmarks). Progress goes to
//! stderr; the last line of stdout is one JSON object.

use clap::Args;

#[derive(Args)]
pub struct MigrateArgs {
    /// Print only the JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct ScaleInArgs {
    /// Print only the JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

pub fn migrate(_a: MigrateArgs) -> Result<(), String> {
    Err("bench migrate: not implemented yet".into())
}

pub fn scale_in(_a: ScaleInArgs) -> Result<(), String> {
    Err("bench scale-in: not implemented yet".into())
}
