//! The `[ids]` section of the replica TOML.
//!
//! ```toml
//! [ids]
//! alert_threshold = 5          # alert when a flow's injection count reaches this (once per flow)
//! patterns = ["' or 1=1", "union select"]   # optional; default: scan::default_patterns()
//! max_head_bytes = 16384       # request line + headers, per flow
//! max_body_scan_bytes = 65536  # body prefix scanned per request
//! max_ooo_segments = 64        # out-of-order buffer per flow
//! max_ooo_bytes = 65536
//! max_alerts = 1024            # alert log kept in the replica (oldest evicted, counted)
//! max_finished_flows = 1024    # summaries of expired flows kept for `pliant query`
//! idle_timeout_s = 300
//! closed_timeout_s = 10        # after RST or FINs from both sides
//! ```

use crate::scan;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default = "d_threshold")]
    pub alert_threshold: u64,
    #[serde(default = "scan::default_patterns")]
    pub patterns: Vec<String>,
    #[serde(default = "d_head")]
    pub max_head_bytes: usize,
    #[serde(default = "d_body")]
    pub max_body_scan_bytes: usize,
    #[serde(default = "d_ooo_segments")]
    pub max_ooo_segments: usize,
    #[serde(default = "d_body")]
    pub max_ooo_bytes: usize,
    #[serde(default = "d_log")]
    pub max_alerts: usize,
    #[serde(default = "d_log")]
    pub max_finished_flows: usize,
    #[serde(default = "d_idle")]
    pub idle_timeout_s: u64,
    #[serde(default = "d_closed")]
    pub closed_timeout_s: u64,
}

fn d_threshold() -> u64 {
    5
}
fn d_head() -> usize {
    16 * 1024
}
fn d_body() -> usize {
    64 * 1024
}
fn d_ooo_segments() -> usize {
    64
}
fn d_log() -> usize {
    1024
}
fn d_idle() -> u64 {
    300
}
fn d_closed() -> u64 {
    10
}

impl Default for Config {
    fn default() -> Self {
        Config {
            alert_threshold: d_threshold(),
            patterns: scan::default_patterns(),
            max_head_bytes: d_head(),
            max_body_scan_bytes: d_body(),
            max_ooo_segments: d_ooo_segments(),
            max_ooo_bytes: d_body(),
            max_alerts: d_log(),
            max_finished_flows: d_log(),
            idle_timeout_s: d_idle(),
            closed_timeout_s: d_closed(),
        }
    }
}

/// Upper bounds: flow state is exported on migration and replicated by Pico, so per-flow
/// buffers stay modest; a week is the longest sensible timeout.
const MAX_BUFFER_BYTES: usize = 16 << 20;
const MAX_TIMEOUT_S: u64 = 7 * 24 * 3600;

impl Config {
    pub(crate) fn validate(&self) -> Result<(), String> {
        let range = |name: &str, v: usize, lo: usize, hi: usize| -> Result<(), String> {
            if v < lo || v > hi {
                return Err(format!("{name} = {v}: must be between {lo} and {hi}"));
            }
            Ok(())
        };
        if self.alert_threshold == 0 {
            return Err("alert_threshold = 0: must be at least 1".into());
        }
        range("max_head_bytes", self.max_head_bytes, 256, MAX_BUFFER_BYTES)?;
        range(
            "max_body_scan_bytes",
            self.max_body_scan_bytes,
            0,
            MAX_BUFFER_BYTES,
        )?;
        range("max_ooo_segments", self.max_ooo_segments, 0, 4096)?;
        range("max_ooo_bytes", self.max_ooo_bytes, 0, MAX_BUFFER_BYTES)?;
        range("max_alerts", self.max_alerts, 1, 1 << 20)?;
        range("max_finished_flows", self.max_finished_flows, 0, 1 << 20)?;
        for (name, v) in [
            ("idle_timeout_s", self.idle_timeout_s),
            ("closed_timeout_s", self.closed_timeout_s),
        ] {
            if v == 0 || v > MAX_TIMEOUT_S {
                return Err(format!(
                    "{name} = {v}: must be between 1 and {MAX_TIMEOUT_S} seconds"
                ));
            }
        }
        Ok(())
    }
}
