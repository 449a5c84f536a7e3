//! The host agent's protocol: what a controller (or an admin) may ask the agent of one host,
//! and what the agent answers. Same framing, link and sealing as the replica control channel
//! ([`crate::link`]); the agent proves the AGENT role in the handshake and serves CONTROLLER
//! and ADMIN clients, so a replica can never be taken for an agent or the reverse.
//!
//! An agent runs the replicas its host is provisioned for: each is a *slot* of the agent's
//! config (a name, the command that runs it, its control socket on the host). The controller
//! chooses which slots run; the agent starts and stops them, watches them (the exit status of
//! a process it started is exact, its control socket is probed every few milliseconds), and
//! reports in [`AgentStatus`].
//!
//! The agent of the fabric's host (the load-balancer tier) also holds the fabric's steering
//! maps for whichever controller leads ([`AgentRequest::Steer`], [`SteerOp`]): the maps live
//! in that host's kernel, and a controller on another host drives them through this link,
//! under its term like every other command.

use pliant_state::FlowKey;
use serde::{Deserialize, Serialize};
use std::net::IpAddr;

/// Longest replica (slot) name a request may carry.
pub const MAX_SLOT_NAME: usize = 64;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "snake_case")]
pub enum AgentRequest {
    /// The agent and every slot's state.
    AgentStatus,
    /// Run slot `replica` (already running: answered with its state, nothing started).
    Start { replica: String },
    /// Stop slot `replica` (SIGTERM, SIGKILL after a grace period); stopped already: ok.
    Stop { replica: String },
    /// One operation on the fabric's steering (only an agent with a `[fabric]` serves it).
    Steer { op: SteerOp },
}

/// How a fabric agent with no steering attached (it restarted, say) refuses an operation: the
/// leader attaches again and retries.
pub const NOT_ATTACHED: &str = "no steering attached";

/// Replica slots one `attach` or `set_ring` may name.
pub const MAX_STEER_REPLICAS: usize = 4096;

/// One operation on the fabric's steering maps, as `pliant_steer::control::Steering` names
/// them. The agent answers `{"ok": true}` plus `count` (operations that count what they
/// changed), `entries` (`exceptions`) or `stats` (`stats`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum SteerOp {
    /// Attaches (or adopts, from the maps a previous holder pinned) the steering over
    /// `replicas`, with `nat_addr` steered by port owner: what a new leader does first.
    Attach {
        replicas: Vec<u32>,
        nat_addr: Option<IpAddr>,
    },
    AddReplica {
        index: u32,
    },
    SetLive {
        index: u32,
        live: bool,
    },
    SetRing {
        live: Vec<u32>,
    },
    SetExceptions {
        entries: Vec<SteerEntry>,
    },
    RemoveExceptions {
        #[serde(with = "crate::request::key_strs")]
        keys: Vec<FlowKey>,
    },
    Exceptions,
    DemoteExceptions {
        entries: Vec<SteerEntry>,
    },
    SetPortOwner {
        lo: u16,
        hi: u16,
        owner: Option<u32>,
    },
    FlushPins {
        index: u32,
    },
    SetFenced {
        index: u32,
        fenced: bool,
    },
    Stats,
}

/// A flow key and the replica it is steered to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SteerEntry {
    #[serde(with = "crate::request::key_str")]
    pub key: FlowKey,
    pub replica: u32,
}

impl SteerOp {
    /// The bounds serde does not express.
    pub fn check(&self) -> Result<(), String> {
        let max = crate::request::MAX_KEYS_PER_REQUEST;
        match self {
            SteerOp::Attach { replicas: r, .. } | SteerOp::SetRing { live: r }
                if r.len() > MAX_STEER_REPLICAS =>
            {
                Err(format!("more than {MAX_STEER_REPLICAS} replicas"))
            }
            SteerOp::SetExceptions { entries } | SteerOp::DemoteExceptions { entries }
                if entries.len() > max =>
            {
                Err(format!(
                    "{} entries exceed the bound of {max} per request",
                    entries.len()
                ))
            }
            SteerOp::SetPortOwner { lo, hi, .. } if *lo == 0 || lo > hi => {
                Err(format!("bad port range [{lo}, {hi}]: need 1 <= lo <= hi"))
            }
            _ => Ok(()),
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            SteerOp::Attach { .. } => "attach",
            SteerOp::AddReplica { .. } => "add_replica",
            SteerOp::SetLive { .. } => "set_live",
            SteerOp::SetRing { .. } => "set_ring",
            SteerOp::SetExceptions { .. } => "set_exceptions",
            SteerOp::RemoveExceptions { .. } => "remove_exceptions",
            SteerOp::Exceptions => "exceptions",
            SteerOp::DemoteExceptions { .. } => "demote_exceptions",
            SteerOp::SetPortOwner { .. } => "set_port_owner",
            SteerOp::FlushPins { .. } => "flush_pins",
            SteerOp::SetFenced { .. } => "set_fenced",
            SteerOp::Stats => "stats",
        }
    }
}

/// The answer to a [`SteerOp`] (besides `ok`): what the operation returns, if anything.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SteerAnswer {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub count: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entries: Option<Vec<SteerEntry>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stats: Option<serde_json::Value>,
}

impl AgentRequest {
    /// Decodes and checks one request body.
    pub fn parse(body: &[u8]) -> Result<AgentRequest, String> {
        let r: AgentRequest = serde_json::from_slice(body).map_err(|e| {
            let mut m = e.to_string();
            m.truncate(m.floor_char_boundary(300));
            format!("bad request: {m}")
        })?;
        match &r {
            AgentRequest::Start { replica } | AgentRequest::Stop { replica } => {
                check_slot_name(replica)?
            }
            AgentRequest::AgentStatus => {}
            AgentRequest::Steer { op } => op.check()?,
        }
        Ok(r)
    }
}

/// A slot name: 1..=64 of `[A-Za-z0-9_.-]` (it names files and appears in logs).
pub fn check_slot_name(n: &str) -> Result<(), String> {
    let ok = !n.is_empty()
        && n.len() <= MAX_SLOT_NAME
        && n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b));
    match ok {
        true => Ok(()),
        false => Err(format!(
            "bad replica name {:?}: 1..={MAX_SLOT_NAME} characters of A-Z a-z 0-9 _ . -",
            n.chars().take(80).collect::<String>()
        )),
    }
}

impl crate::Command for AgentRequest {
    fn name(&self) -> &'static str {
        match self {
            AgentRequest::AgentStatus => "agent_status",
            AgentRequest::Start { .. } => "start",
            AgentRequest::Stop { .. } => "stop",
            AgentRequest::Steer { .. } => "steer",
        }
    }
    /// A start waits for the replica to serve its control socket (bounded by the agent); an
    /// attach loads the steering program.
    fn is_slow(&self) -> bool {
        matches!(
            self,
            AgentRequest::Start { .. }
                | AgentRequest::Stop { .. }
                | AgentRequest::Steer {
                    op: SteerOp::Attach { .. }
                }
        )
    }
}

/// The state of one slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SlotState {
    /// Not running, and not asked to run.
    Stopped,
    /// Running: the process lives (its control socket may not answer yet: `serving`).
    Running,
    /// It was running and ended without being asked to (`exit` says how).
    Died,
}

/// One slot of an agent.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotStatus {
    /// The replica's name (its certificate's, when it has an identity).
    pub replica: String,
    pub state: SlotState,
    /// The replica's control socket on its host.
    pub control: String,
    /// Whether the control socket accepted a connection at the last probe.
    pub serving: bool,
    pub pid: Option<u32>,
    /// When the state last changed (unix ms, the agent's clock).
    pub since_unix_ms: u64,
    /// How a died replica ended ("killed by signal 9", "exit status 1", "control socket
    /// refused" for one the agent adopted and cannot wait for).
    pub exit: Option<String>,
    /// Times this slot's process died since the agent started.
    pub deaths: u64,
}

/// `agent_status` (and the answer of `start`/`stop`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentStatus {
    /// The agent's (host's) name.
    pub agent: String,
    /// The highest controller term seen (0: none).
    pub term: u64,
    /// Requests refused for a lower (deposed) term.
    pub deposed_refused: u64,
    /// The agent's clock (unix ms) when it answered.
    pub now_unix_ms: u64,
    /// How often the agent probes its replicas.
    pub probe_ms: u64,
    pub slots: Vec<SlotStatus>,
    /// On the fabric's host: what it steers, whether a controller attached, ops applied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fabric: Option<serde_json::Value>,
}

impl AgentStatus {
    pub fn slot(&self, replica: &str) -> Option<&SlotStatus> {
        self.slots.iter().find(|s| s.replica == replica)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip_and_bad_names_are_refused() {
        for r in [
            AgentRequest::AgentStatus,
            AgentRequest::Start {
                replica: "r4".into(),
            },
            AgentRequest::Stop {
                replica: "db-1.a_b".into(),
            },
        ] {
            let body = crate::request::encode(&r, Some(7)).unwrap();
            assert_eq!(AgentRequest::parse(&body).unwrap(), r);
            assert_eq!(crate::request::term_of(&body).unwrap(), Some(7));
        }
        for bad in ["", "../etc", "a b", &"x".repeat(65)] {
            let body = format!(r#"{{"cmd":"start","replica":{bad:?}}}"#);
            let e = AgentRequest::parse(body.as_bytes()).unwrap_err();
            assert!(e.contains("bad replica name"), "{e}");
        }
        let key: FlowKey = "tcp 10.0.0.1:1000 <-> 10.0.0.2:80".parse().unwrap();
        for op in [
            SteerOp::Attach {
                replicas: vec![1, 2],
                nat_addr: Some("10.77.2.1".parse().unwrap()),
            },
            SteerOp::SetExceptions {
                entries: vec![SteerEntry { key, replica: 2 }],
            },
            SteerOp::RemoveExceptions { keys: vec![key] },
            SteerOp::SetPortOwner {
                lo: 20000,
                hi: 20999,
                owner: None,
            },
            SteerOp::Stats,
        ] {
            let r = AgentRequest::Steer { op };
            let body = crate::request::encode(&r, Some(3)).unwrap();
            assert_eq!(AgentRequest::parse(&body).unwrap(), r);
        }
        let e = AgentRequest::parse(
            br#"{"cmd":"steer","op":{"op":"set_port_owner","lo":9,"hi":8,"owner":1}}"#,
        )
        .unwrap_err();
        assert!(e.contains("bad port range"), "{e}");
        let many = serde_json::json!({"cmd": "steer", "op": {"op": "set_ring",
            "live": vec![1u32; MAX_STEER_REPLICAS + 1]}});
        let e = AgentRequest::parse(many.to_string().as_bytes()).unwrap_err();
        assert!(e.contains("more than"), "{e}");
        let e = AgentRequest::parse(br#"{"cmd":"steer","op":{"op":"fly"}}"#).unwrap_err();
        assert!(e.starts_with("bad request"), "{e}");
        let e = AgentRequest::parse(br#"{"cmd":"stats"}"#).unwrap_err();
        assert!(e.starts_with("bad request"), "{e}");
        let e = AgentRequest::parse(br#"{"cmd":"start"}"#).unwrap_err();
        assert!(e.contains("replica"), "{e}");
    }
}
