//! The fabric's steering, held by the agent of the fabric's host for whichever controller
//! leads (`[fabric]` in agent.toml). The tc-BPF program and its maps live in that host's
//! kernel; a controller on another host cannot open them, so it sends each change here
//! ([`pliant_proto::agent::SteerOp`]), under its term like every command: a deposed leader's
//! changes are refused by the agent's fence before they reach the maps.
//!
//! What a controller would do on the fabric's host, the agent does: a new leader's `attach`
//! adopts the maps its predecessor pinned (placement, exceptions, conn pins, port owners), and
//! dropping the steering (the agent stops, or a new `attach` replaces it) leaves the program
//! attached and the maps pinned, so the fabric goes on steering every flow where it was.

use pliant_proto::agent::{SteerAnswer, SteerEntry, SteerOp};
use pliant_state::FlowKey;
use pliant_steer::control::{FabricSteering, MemSteering, Steering, SteeringError};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

type Attach =
    dyn Fn(&[u32], Option<IpAddr>) -> Result<Box<dyn Steering>, SteeringError> + Send + Sync;

pub struct Fabric {
    /// What the steering runs on (for status and messages).
    pub what: String,
    attach: Box<Attach>,
    steering: Mutex<Option<Box<dyn Steering>>>,
    /// Steering operations applied, and refused (no attach yet, or the maps said no).
    pub ops: AtomicU64,
    pub op_errors: AtomicU64,
}

impl Fabric {
    /// The tc-BPF fabric in network namespace `netns` (the lab's port naming, pinned maps).
    pub fn netns(netns: &str) -> Fabric {
        let ns = netns.to_string();
        Fabric::new(
            format!("tc-bpf in netns {netns}"),
            Box::new(move |replicas: &[u32], nat: Option<IpAddr>| {
                FabricSteering::attach_lab(&ns, replicas, nat)
                    .map(|s| Box::new(s) as Box<dyn Steering>)
            }),
        )
    }

    /// Steering that only records what it is told (tests; an agent without a data plane).
    pub fn memory() -> Fabric {
        Fabric::new(
            "memory".into(),
            Box::new(|replicas: &[u32], nat: Option<IpAddr>| {
                let mut m = MemSteering {
                    nat_addrs: nat.into_iter().collect(),
                    ..Default::default()
                };
                for r in replicas {
                    m.add_replica(*r)?;
                }
                m.set_ring(replicas)?;
                Ok(Box::new(m) as Box<dyn Steering>)
            }),
        )
    }

    fn new(what: String, attach: Box<Attach>) -> Fabric {
        Fabric {
            what,
            attach,
            steering: Mutex::new(None),
            ops: AtomicU64::new(0),
            op_errors: AtomicU64::new(0),
        }
    }

    /// Applies one operation of `term`, admitted by `fence` once the steering is held: a
    /// request admitted before a new leader's (slow) attach, and waiting for it, is checked
    /// again after it, so a deposed leader's change never lands on the new leader's maps.
    pub fn apply(
        &self,
        op: &SteerOp,
        fence: &pliant_proto::TermFence,
        term: Option<u64>,
    ) -> Result<SteerAnswer, String> {
        let r = self.apply_inner(op, fence, term);
        match &r {
            Ok(_) => self.ops.fetch_add(1, Ordering::Relaxed),
            Err(_) => self.op_errors.fetch_add(1, Ordering::Relaxed),
        };
        r.map_err(|e| format!("steer {}: {e}", op.name()))
    }

    fn apply_inner(
        &self,
        op: &SteerOp,
        fence: &pliant_proto::TermFence,
        term: Option<u64>,
    ) -> Result<SteerAnswer, String> {
        let mut g = self.steering.lock().unwrap_or_else(|p| p.into_inner());
        fence.admit(term)?;
        if let SteerOp::Attach { replicas, nat_addr } = op {
            // The old holder first: dropped, it leaves the program and the pinned maps for
            // the new one to adopt (and if the attach fails, the fabric still steers).
            *g = None;
            *g = Some((self.attach)(replicas, *nat_addr).map_err(|e| e.to_string())?);
            return Ok(SteerAnswer::default());
        }
        let Some(s) = g.as_mut() else {
            return Err(format!(
                "{} on this fabric ({}): a leading controller attaches first",
                pliant_proto::agent::NOT_ATTACHED,
                self.what
            ));
        };
        let pairs = |es: &[SteerEntry]| -> Vec<(FlowKey, u32)> {
            es.iter().map(|e| (e.key, e.replica)).collect()
        };
        let count = |n: usize| SteerAnswer {
            count: Some(n as u64),
            ..Default::default()
        };
        let e = |x: SteeringError| x.0;
        Ok(match op {
            SteerOp::Attach { .. } => unreachable!("handled above"),
            SteerOp::AddReplica { index } => s.add_replica(*index).map(|_| count(0)).map_err(e)?,
            SteerOp::SetLive { index, live } => {
                s.set_live(*index, *live).map(|_| count(0)).map_err(e)?
            }
            SteerOp::SetRing { live } => s.set_ring(live).map(|_| count(0)).map_err(e)?,
            SteerOp::SetExceptions { entries } => s
                .set_exceptions(&pairs(entries))
                .map(|_| count(entries.len()))
                .map_err(e)?,
            SteerOp::RemoveExceptions { keys } => {
                s.remove_exceptions(keys).map(count).map_err(e)?
            }
            SteerOp::Exceptions => SteerAnswer {
                entries: Some(
                    s.exceptions()
                        .map_err(e)?
                        .into_iter()
                        .map(|(key, replica)| SteerEntry { key, replica })
                        .collect(),
                ),
                ..Default::default()
            },
            SteerOp::DemoteExceptions { entries } => {
                s.demote_exceptions(&pairs(entries)).map(count).map_err(e)?
            }
            SteerOp::SetPortOwner { lo, hi, owner } => s
                .set_port_owner(*lo..=*hi, *owner)
                .map(|_| count(0))
                .map_err(e)?,
            SteerOp::FlushPins { index } => s.flush_pins(*index).map(count).map_err(e)?,
            SteerOp::SetFenced { index, fenced } => {
                s.set_fenced(*index, *fenced).map(|_| count(0)).map_err(e)?
            }
            SteerOp::Stats => SteerAnswer {
                stats: Some(s.stats()),
                ..Default::default()
            },
        })
    }

    /// For the agent's status: what it steers and whether a controller attached.
    pub fn status(&self) -> serde_json::Value {
        let attached = self
            .steering
            .lock()
            .map(|g| g.is_some())
            .unwrap_or_default();
        serde_json::json!({"what": self.what, "attached": attached,
            "ops": self.ops.load(Ordering::Relaxed),
            "op_errors": self.op_errors.load(Ordering::Relaxed)})
    }
}
