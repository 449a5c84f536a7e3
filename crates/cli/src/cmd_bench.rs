//! `pliant bench forward` (owned by the bench work; placeholder).
use clap::Args;

#[derive(Args)]
pub struct BenchArgs {}

pub fn run(_a: BenchArgs) -> Result<(), String> {
    Err("not yet implemented".into())
}
