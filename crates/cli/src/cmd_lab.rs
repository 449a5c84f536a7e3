//! `pliant lab up|down|status` and `pliant demo` (owned by the lab work; placeholder).
use clap::Args;

#[derive(Args)]
pub struct LabArgs {}
#[derive(Args)]
pub struct DemoArgs {}

pub fn run(_a: LabArgs) -> Result<(), String> {
    Err("not yet implemented".into())
}
pub fn demo(_a: DemoArgs) -> Result<(), String> {
    Err("not yet implemented".into())
}
