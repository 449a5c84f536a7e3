//! `pliant pg ...` (owned by the RemusDB work; placeholder).
use clap::Args;

#[derive(Args)]
pub struct PgArgs {}

pub fn run(_a: PgArgs) -> Result<(), String> {
    Err("not yet implemented".into())
}
