//! pliant-bench: benchmarks that measure pliant against Linux kernel peers on the same lab
//! topology in the same run, and report ratios (these machines are too noisy for absolutes).

pub mod chart;
pub mod flood;
pub mod flowgen;
pub mod forward;
pub mod ha;
pub mod ha_kernel;
pub mod migrate;
pub mod parse;
pub mod scale_in;
pub mod sched_probe;
pub mod steering_scale;
pub mod txload;

pub use forward::{run_forward, ForwardOpts, ForwardReport, SystemReport};
pub use parse::{parse_iperf3_gbps, IperfResult};

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("could not parse {what}: {reason}")]
    Parse { what: &'static str, reason: String },
    #[error("{tool}: {reason}")]
    Tool { tool: &'static str, reason: String },
    #[error("lab: {0}")]
    Lab(String),
    #[error("{0}: {1}")]
    Io(PathBuf, #[source] std::io::Error),
    #[error("interrupted")]
    Interrupted,
    #[error("chart: {0}")]
    Chart(String),
}
