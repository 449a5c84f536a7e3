//! The controller's view of flow steering: the [`Steering`] trait and its in-memory and tc-BPF
//! implementations live in `pliant_steer::control` (a fabric host's agent drives the same
//! fabric code for a controller elsewhere); here are the two a controller adds: fencing by
//! link in a lab without BPF ([`LabLinkSteering`]) and the fabric driven through its host's
//! agent ([`RemoteSteering`]).

use pliant_state::FlowKey;
pub use pliant_steer::control::{
    nat_side, FabricSteering, MemSteering, Result, Steering, SteeringError,
};
use std::net::IpAddr;
use std::ops::RangeInclusive;

fn serr(e: impl std::fmt::Display) -> SteeringError {
    SteeringError(e.to_string())
}

/// No BPF steering (a 1-replica lab's tc mirred patch panel): placement is only recorded
/// ([`MemSteering`]), but fencing is real, by the lab-only fallback of taking the replica's
/// fabric-side veths down (`pliant_lab::ha::fence_by_name`).
pub struct LabLinkSteering {
    pub mem: MemSteering,
    pub lab: String,
    pub run_root: std::path::PathBuf,
}

impl Steering for LabLinkSteering {
    fn add_replica(&mut self, index: u32) -> Result<()> {
        self.mem.add_replica(index)
    }
    fn set_live(&mut self, index: u32, live: bool) -> Result<()> {
        self.mem.set_live(index, live)
    }
    fn set_ring(&mut self, live: &[u32]) -> Result<()> {
        self.mem.set_ring(live)
    }
    fn set_exceptions(&mut self, entries: &[(FlowKey, u32)]) -> Result<()> {
        self.mem.set_exceptions(entries)
    }
    fn remove_exceptions(&mut self, keys: &[FlowKey]) -> Result<usize> {
        self.mem.remove_exceptions(keys)
    }
    fn exceptions(&self) -> Result<Vec<(FlowKey, u32)>> {
        self.mem.exceptions()
    }
    fn demote_exceptions(&mut self, entries: &[(FlowKey, u32)]) -> Result<usize> {
        self.mem.demote_exceptions(entries)
    }
    fn set_port_owner(&mut self, range: RangeInclusive<u16>, owner: Option<u32>) -> Result<()> {
        self.mem.set_port_owner(range, owner)
    }
    fn flush_pins(&mut self, index: u32) -> Result<usize> {
        self.mem.flush_pins(index)
    }
    fn nat_addrs(&self) -> Vec<IpAddr> {
        self.mem.nat_addrs()
    }
    fn set_fenced(&mut self, index: u32, fenced: bool) -> Result<()> {
        let n = u8::try_from(index).map_err(|_| SteeringError(format!("no replica r{index}")))?;
        pliant_lab::ha::fence_by_name(&self.run_root, &self.lab, n, fenced).map_err(serr)?;
        self.mem.set_fenced(index, fenced)
    }
    fn stats(&self) -> serde_json::Value {
        let mut v = self.mem.stats();
        v["backend"] = "lab-links".into();
        v
    }
}

/// Entries per steering request (a migration's exceptions are sent in pieces of this many;
/// each piece is one frame well under the agent's bound).
const STEER_CHUNK: usize = 4096;

/// The fabric's steering on another host, driven through that host's agent
/// (`[lab] steering = "agent"`): every operation is one request on a kept, authenticated link,
/// under this controller's term, so the agent refuses a deposed leader's changes. The agent
/// holds the tc-BPF maps (`pliant_steer::control::FabricSteering`); a new leader's `attach`
/// adopts what its predecessor left.
pub struct RemoteSteering {
    endpoint: pliant_wire::Endpoint,
    name: String,
    security: Option<pliant_wire::Security>,
    term: std::sync::Arc<std::sync::atomic::AtomicU64>,
    timeout: std::time::Duration,
    kept: pliant_proto::KeptLinks,
    nat_addrs: Vec<IpAddr>,
    /// What this controller attached and set, to attach again if the agent lost it (an agent
    /// restarted: the maps stay pinned, its hold on them does not).
    known: std::sync::Mutex<Known>,
}

#[derive(Default)]
struct Known {
    replicas: std::collections::BTreeSet<u32>,
    ring: Vec<u32>,
}

impl RemoteSteering {
    /// Connects to the fabric host's agent `name` at `endpoint` and attaches (adopts) its
    /// steering over `replicas`.
    #[allow(clippy::too_many_arguments)]
    pub fn attach(
        endpoint: &str,
        name: &str,
        security: Option<pliant_wire::Security>,
        term: std::sync::Arc<std::sync::atomic::AtomicU64>,
        timeout: std::time::Duration,
        replicas: &[u32],
        nat_addr: Option<IpAddr>,
    ) -> Result<RemoteSteering> {
        let endpoint: pliant_wire::Endpoint = endpoint
            .parse()
            .map_err(|e| SteeringError(format!("fabric agent endpoint {endpoint:?}: {e}")))?;
        let s = RemoteSteering {
            endpoint,
            name: name.into(),
            security,
            term,
            timeout,
            kept: Default::default(),
            nat_addrs: nat_addr.into_iter().collect(),
            known: std::sync::Mutex::new(Known {
                replicas: replicas.iter().copied().collect(),
                ring: replicas.to_vec(),
            }),
        };
        s.ask(pliant_proto::agent::SteerOp::Attach {
            replicas: replicas.to_vec(),
            nat_addr,
        })?;
        Ok(s)
    }

    fn client(&self) -> pliant_proto::Client {
        let mut c = pliant_proto::Client::new(self.endpoint.clone(), self.security.clone())
            .expecting_role(pliant_wire::role::AGENT)
            .with_timeout(self.timeout);
        if self.security.is_some() {
            c = c.expecting(self.name.clone());
        }
        match self.term.load(std::sync::atomic::Ordering::Acquire) {
            0 => c,
            t => c.with_term(t),
        }
    }

    fn known(&self) -> std::sync::MutexGuard<'_, Known> {
        self.known.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Attaches again (the agent adopts the pinned maps) with every replica this controller
    /// knows and its last ring.
    fn reattach(&self) -> Result<()> {
        let (replicas, ring) = {
            let k = self.known();
            (
                k.replicas.iter().copied().collect::<Vec<_>>(),
                k.ring.clone(),
            )
        };
        tracing::warn!(agent = %self.name, "the fabric agent holds no steering (restarted?): attaching again");
        self.ask_once(pliant_proto::agent::SteerOp::Attach {
            replicas,
            nat_addr: self.nat_addrs.first().copied(),
        })?;
        if !ring.is_empty() {
            self.ask_once(pliant_proto::agent::SteerOp::SetRing { live: ring })?;
        }
        Ok(())
    }

    /// One operation; if the agent has no steering attached (it restarted), attach again and
    /// retry once.
    fn ask(&self, op: pliant_proto::agent::SteerOp) -> Result<pliant_proto::agent::SteerAnswer> {
        let attach = matches!(op, pliant_proto::agent::SteerOp::Attach { .. });
        match self.ask_once(op.clone()) {
            Err(e) if !attach && e.0.contains(pliant_proto::agent::NOT_ATTACHED) => {
                self.reattach()?;
                self.ask_once(op)
            }
            r => r,
        }
    }

    fn ask_once(
        &self,
        op: pliant_proto::agent::SteerOp,
    ) -> Result<pliant_proto::agent::SteerAnswer> {
        let req = pliant_proto::AgentRequest::Steer { op };
        let v = self
            .kept
            .call(&self.name, &self.client(), &req)
            .map_err(|e| SteeringError(format!("fabric agent {}: {e}", self.name)))?;
        serde_json::from_value(v)
            .map_err(|e| SteeringError(format!("fabric agent {}: bad answer: {e}", self.name)))
    }

    fn count(&self, op: pliant_proto::agent::SteerOp) -> Result<usize> {
        let what = op.name();
        self.ask(op)?
            .count
            .map(|n| n as usize)
            .ok_or_else(|| SteeringError(format!("fabric agent {}: {what}: no count", self.name)))
    }

    fn entries(es: &[(FlowKey, u32)]) -> Vec<Vec<pliant_proto::agent::SteerEntry>> {
        es.chunks(STEER_CHUNK)
            .map(|c| {
                c.iter()
                    .map(|(key, replica)| pliant_proto::agent::SteerEntry {
                        key: *key,
                        replica: *replica,
                    })
                    .collect()
            })
            .collect()
    }
}

impl Steering for RemoteSteering {
    fn add_replica(&mut self, index: u32) -> Result<()> {
        self.ask(pliant_proto::agent::SteerOp::AddReplica { index })?;
        self.known().replicas.insert(index);
        Ok(())
    }
    fn set_live(&mut self, index: u32, live: bool) -> Result<()> {
        self.ask(pliant_proto::agent::SteerOp::SetLive { index, live })
            .map(|_| ())
    }
    fn set_ring(&mut self, live: &[u32]) -> Result<()> {
        self.ask(pliant_proto::agent::SteerOp::SetRing {
            live: live.to_vec(),
        })?;
        self.known().ring = live.to_vec();
        Ok(())
    }
    fn set_exceptions(&mut self, entries: &[(FlowKey, u32)]) -> Result<()> {
        for entries in Self::entries(entries) {
            self.ask(pliant_proto::agent::SteerOp::SetExceptions { entries })?;
        }
        Ok(())
    }
    fn remove_exceptions(&mut self, keys: &[FlowKey]) -> Result<usize> {
        let mut n = 0;
        for keys in keys.chunks(STEER_CHUNK) {
            n += self.count(pliant_proto::agent::SteerOp::RemoveExceptions {
                keys: keys.to_vec(),
            })?;
        }
        Ok(n)
    }
    fn exceptions(&self) -> Result<Vec<(FlowKey, u32)>> {
        let a = self.ask(pliant_proto::agent::SteerOp::Exceptions)?;
        let es = a.entries.ok_or_else(|| {
            SteeringError(format!(
                "fabric agent {}: exceptions: no entries",
                self.name
            ))
        })?;
        Ok(es.into_iter().map(|e| (e.key, e.replica)).collect())
    }
    fn demote_exceptions(&mut self, entries: &[(FlowKey, u32)]) -> Result<usize> {
        let mut n = 0;
        for entries in Self::entries(entries) {
            n += self.count(pliant_proto::agent::SteerOp::DemoteExceptions { entries })?;
        }
        Ok(n)
    }
    fn nat_addrs(&self) -> Vec<IpAddr> {
        self.nat_addrs.clone()
    }
    fn set_port_owner(&mut self, range: RangeInclusive<u16>, owner: Option<u32>) -> Result<()> {
        self.ask(pliant_proto::agent::SteerOp::SetPortOwner {
            lo: *range.start(),
            hi: *range.end(),
            owner,
        })
        .map(|_| ())
    }
    fn flush_pins(&mut self, index: u32) -> Result<usize> {
        self.count(pliant_proto::agent::SteerOp::FlushPins { index })
    }
    fn set_fenced(&mut self, index: u32, fenced: bool) -> Result<()> {
        self.ask(pliant_proto::agent::SteerOp::SetFenced { index, fenced })
            .map(|_| ())
    }
    fn stats(&self) -> serde_json::Value {
        // The fabric's own figures (the same fields as steering held here), and by whom.
        let mut v = match self.ask(pliant_proto::agent::SteerOp::Stats) {
            Ok(pliant_proto::agent::SteerAnswer {
                stats: Some(v @ serde_json::Value::Object(_)),
                ..
            }) => v,
            Ok(_) => serde_json::json!({"error": "the fabric agent sent no stats"}),
            Err(e) => serde_json::json!({"error": e.to_string()}),
        };
        v["agent"] = self.name.clone().into();
        v["agent_endpoint"] = self.endpoint.to_string().into();
        v
    }
}
