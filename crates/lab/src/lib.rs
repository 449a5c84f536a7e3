//! pliant-lab: the network-namespace lab that tests, benchmarks and the demo run on.
//!
//! ```text
//! client ns ──veth── fabric ns ──veth── server ns (nginx, iperf3 -s)
//!                      └──veth pair── replica r1 ns (kernel router / kernel NAT / pliant replica)
//! ```
//! [`Lab::up`] builds it from a [`LabSpec`], [`Lab::exec`] runs commands in a host, and dropping
//! the [`Lab`] (or [`down_by_name`] from another process, after a crash) removes everything it
//! made: recorded processes (by PID, cmdline verified), namespaces and the run directory.

pub mod agents;
pub mod cmd;
pub mod control;
pub mod error;
pub mod etcd;
pub mod fabric;
pub mod ha;
pub mod host;
mod lab;
pub mod mgmt;
pub mod scale;
pub mod state;
pub mod topology;

pub use cmd::ExecOutput;
pub use error::{LabError, Result};
pub use ha::LabHaMode;
pub use lab::*;
pub use state::LabState;
pub use topology::{Role, CLIENT_IP, INSIDE_GW_IP, OUTSIDE_GW_IP, SERVER_IP};

use std::path::Path;

/// Liveness of one lab, for `pliant lab status`.
#[derive(Clone, Debug)]
pub struct LabStatus {
    pub state: LabState,
    pub stale: bool,
    /// (namespace, exists)
    pub namespaces: Vec<(String, bool)>,
    /// (process, alive and still ours)
    pub procs: Vec<(state::ProcRecord, bool)>,
}

/// Every lab under `run_root`; unreadable state files are reported as errors.
pub fn status(run_root: &Path) -> Vec<Result<LabStatus>> {
    state::list(run_root)
        .into_iter()
        .map(|r| {
            r.map(|st| LabStatus {
                stale: st.is_stale(),
                namespaces: st
                    .namespaces
                    .iter()
                    .map(|n| (n.clone(), state::netns_exists(n)))
                    .collect(),
                procs: st
                    .procs
                    .iter()
                    .map(|p| (p.clone(), state::proc_matches(p)))
                    .collect(),
                state: st,
            })
        })
        .collect()
}

/// Remove a lab by name from its state file (works after its creator crashed).
/// Returns the problems that could not be fixed (empty when everything is gone).
pub fn down_by_name(run_root: &Path, name: &str) -> Result<Vec<String>> {
    lab::validate_name(name)?;
    let path = run_root.join(name).join(state::STATE_FILE);
    if !path.exists() {
        return Err(LabError::NotFound(name.to_string()));
    }
    let st = LabState::load(&path)?;
    Ok(state::teardown(&st))
}

/// Remove every lab whose owning process is gone. Returns (name, problems) per lab removed.
pub fn down_stale(run_root: &Path) -> Vec<(String, Vec<String>)> {
    down_where(run_root, |st| st.is_stale())
}

/// Remove every lab under `run_root`, live or not.
pub fn down_all(run_root: &Path) -> Vec<(String, Vec<String>)> {
    down_where(run_root, |_| true)
}

fn down_where(run_root: &Path, pred: impl Fn(&LabState) -> bool) -> Vec<(String, Vec<String>)> {
    state::list(run_root)
        .into_iter()
        .filter_map(|r| r.ok())
        .filter(|st| pred(st))
        .map(|st| (st.name.clone(), state::teardown(&st)))
        .collect()
}
