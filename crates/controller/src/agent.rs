//! The agent: starts and stops replica processes on the controller's request. Behind a trait
//! so orchestration is testable without namespaces; [`LabAgent`] drives `pliant_lab::scale`
//! (namespaces in a running lab).

use std::path::PathBuf;
use std::process::Child;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
#[error("agent: {0}")]
pub struct AgentError(pub String);

/// A replica the agent started.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Started {
    pub index: u32,
    pub socket: PathBuf,
    /// Time from the request to the replica answering on its control socket.
    pub ready_ms: u64,
}

pub trait Agent: Send {
    fn add_replica(&mut self) -> Result<Started, AgentError>;
    fn remove_replica(&mut self, index: u32) -> Result<(), AgentError>;
    /// Replicas that already exist when the controller starts: (index, control socket).
    fn existing(&self) -> Result<Vec<(u32, PathBuf)>, AgentError>;
}

/// Replicas as namespaces of a running lab.
pub struct LabAgent {
    pub lab: String,
    pub opts: pliant_lab::scale::ScaleOptions,
    /// Processes we started, reaped when removed (so none lingers as a zombie).
    children: Vec<(u32, Child)>,
}

impl LabAgent {
    pub fn new(lab: &str, opts: pliant_lab::scale::ScaleOptions) -> LabAgent {
        LabAgent {
            lab: lab.to_string(),
            opts,
            children: Vec::new(),
        }
    }
}

impl Agent for LabAgent {
    fn add_replica(&mut self) -> Result<Started, AgentError> {
        let a = pliant_lab::scale::add_replica(&self.lab, &self.opts)
            .map_err(|e| AgentError(format!("add replica to lab {}: {e}", self.lab)))?;
        let index = u32::from(a.replica.index);
        self.children.push((index, a.child));
        Ok(Started {
            index,
            socket: a.replica.socket,
            ready_ms: a.ready_ms,
        })
    }

    fn remove_replica(&mut self, index: u32) -> Result<(), AgentError> {
        let n = u8::try_from(index).map_err(|_| AgentError(format!("no replica r{index}")))?;
        pliant_lab::scale::remove_replica(&self.lab, n, &self.opts)
            .map_err(|e| AgentError(format!("remove r{index} from lab {}: {e}", self.lab)))?;
        if let Some(pos) = self.children.iter().position(|(i, _)| *i == index) {
            let (_, mut c) = self.children.swap_remove(pos);
            let _ = pliant_lab::cmd::wait_bounded(&mut c, Duration::from_secs(2));
        }
        Ok(())
    }

    fn existing(&self) -> Result<Vec<(u32, PathBuf)>, AgentError> {
        pliant_lab::scale::replicas(&self.lab, &self.opts)
            .map(|v| {
                v.into_iter()
                    .map(|r| (u32::from(r.index), r.socket))
                    .collect()
            })
            .map_err(|e| AgentError(format!("list replicas of lab {}: {e}", self.lab)))
    }
}
