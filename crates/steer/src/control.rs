//! The controller's view of flow steering, behind a trait so the orchestration logic can be
//! tested without BPF ([`MemSteering`]) and the fabric implementation can change.
//! [`FabricSteering`] drives [`crate::Steer`] (the tc-BPF program in the fabric namespace); it
//! lives here, beside the program, because two processes drive it: a controller on the fabric's
//! host, or the fabric host's agent on behalf of a controller on another host.

use pliant_state::FlowKey;
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::ops::RangeInclusive;

#[derive(Debug, thiserror::Error)]
#[error("steering: {0}")]
pub struct SteeringError(pub String);

pub type Result<T> = std::result::Result<T, SteeringError>;

pub trait Steering: Send {
    /// Makes replica `index`'s fabric ports steerable and marks it live (not yet in the ring).
    fn add_replica(&mut self, index: u32) -> Result<()>;
    fn set_live(&mut self, index: u32, live: bool) -> Result<()>;
    /// New flows are spread over `live` (consistent hashing); pinned flows keep their replica.
    fn set_ring(&mut self, live: &[u32]) -> Result<()>;
    fn set_exceptions(&mut self, entries: &[(FlowKey, u32)]) -> Result<()>;
    fn remove_exceptions(&mut self, keys: &[FlowKey]) -> Result<usize>;
    fn exceptions(&self) -> Result<Vec<(FlowKey, u32)>>;
    /// Replaces each exception `key -> owner` by a conn pin to the same owner (pin first,
    /// then remove): packets of the key keep going where they went. For exceptions of flows
    /// that looked ended: a new flow reusing the 5-tuple may have started through the
    /// exception since (its first packet did not pin it), and must not be re-homed by the
    /// ring mid-connection. Pins are bounded by the fabric's LRU, exceptions are not. The
    /// caller leaves out keys of a NAT's outside side ([`nat_side`]).
    fn demote_exceptions(&mut self, entries: &[(FlowKey, u32)]) -> Result<usize>;
    /// The shared external addresses whose return traffic goes by port owner.
    fn nat_addrs(&self) -> Vec<IpAddr>;
    fn set_port_owner(&mut self, range: RangeInclusive<u16>, owner: Option<u32>) -> Result<()>;
    /// Drops the fabric's learned pins to `index` (after it is drained).
    fn flush_pins(&mut self, index: u32) -> Result<usize>;
    /// Fences replica `index` (design invariant 7): nothing it emits leaves the fabric and
    /// nothing is delivered to it, until unfenced or a new replica takes the slot.
    fn set_fenced(&mut self, index: u32, fenced: bool) -> Result<()>;
    /// Counters, for `status`.
    fn stats(&self) -> serde_json::Value;
}

/// In-memory steering: records the state it was told (tests, and running without a fabric).
#[derive(Default, Debug, Clone)]
pub struct MemSteering {
    pub live: BTreeMap<u32, bool>,
    pub ring: Vec<u32>,
    pub exceptions: BTreeMap<FlowKey, u32>,
    /// Conn pins the controller set (the fabric also learns its own; not modelled).
    pub pins: BTreeMap<FlowKey, u32>,
    pub port_owner: BTreeMap<u16, u32>,
    pub fenced: BTreeMap<u32, bool>,
    pub nat_addrs: Vec<IpAddr>,
}

/// Whether `key` is the outside side of a translated flow (one end is a NAT address): its
/// packets go by port owner, and the only replica that can give a later connection the same
/// NAT port is the port's owner. So an exception for such a key of a flow that ended must go,
/// not become a pin: a pin to another replica (the one the flow had moved or failed over to)
/// would outlive the flow and capture the return traffic of the owner's next connection with
/// that port and peer, which then never completes.
pub fn nat_side(key: &FlowKey, nat: &[IpAddr]) -> bool {
    nat.contains(&key.lo().0) || nat.contains(&key.hi().0)
}

impl Steering for MemSteering {
    fn add_replica(&mut self, index: u32) -> Result<()> {
        self.live.insert(index, true);
        Ok(())
    }
    fn set_live(&mut self, index: u32, live: bool) -> Result<()> {
        self.live.insert(index, live);
        Ok(())
    }
    fn set_ring(&mut self, live: &[u32]) -> Result<()> {
        self.ring = live.to_vec();
        Ok(())
    }
    fn set_exceptions(&mut self, entries: &[(FlowKey, u32)]) -> Result<()> {
        for (k, r) in entries {
            self.exceptions.insert(*k, *r);
        }
        Ok(())
    }
    fn remove_exceptions(&mut self, keys: &[FlowKey]) -> Result<usize> {
        Ok(keys
            .iter()
            .filter(|k| self.exceptions.remove(k).is_some())
            .count())
    }
    fn exceptions(&self) -> Result<Vec<(FlowKey, u32)>> {
        Ok(self.exceptions.iter().map(|(k, r)| (*k, *r)).collect())
    }
    fn demote_exceptions(&mut self, entries: &[(FlowKey, u32)]) -> Result<usize> {
        for (k, r) in entries {
            self.pins.insert(*k, *r);
        }
        let keys: Vec<FlowKey> = entries.iter().map(|(k, _)| *k).collect();
        self.remove_exceptions(&keys)
    }
    fn set_port_owner(&mut self, range: RangeInclusive<u16>, owner: Option<u32>) -> Result<()> {
        for p in range {
            match owner {
                Some(r) => self.port_owner.insert(p, r),
                None => self.port_owner.remove(&p),
            };
        }
        Ok(())
    }
    fn flush_pins(&mut self, index: u32) -> Result<usize> {
        let before = self.pins.len();
        self.pins.retain(|_, r| *r != index);
        Ok(before - self.pins.len())
    }
    fn set_fenced(&mut self, index: u32, fenced: bool) -> Result<()> {
        self.fenced.insert(index, fenced);
        Ok(())
    }
    fn nat_addrs(&self) -> Vec<IpAddr> {
        self.nat_addrs.clone()
    }
    fn stats(&self) -> serde_json::Value {
        let fenced: Vec<u32> = self
            .fenced
            .iter()
            .filter(|(_, f)| **f)
            .map(|(i, _)| *i)
            .collect();
        serde_json::json!({"backend": "memory", "exceptions": self.exceptions.len(),
            "ring": self.ring, "fenced": fenced})
    }
}

fn serr(e: impl std::fmt::Display) -> SteeringError {
    SteeringError(e.to_string())
}

/// The tc-BPF fabric (pliant-steer), with the lab's port naming (`fabr<n>in`/`fabr<n>out`).
pub struct FabricSteering {
    pub steer: crate::Steer,
    pub ring_size: u32,
    /// The NAT addresses this controller put in the fabric.
    pub nat_addrs: Vec<IpAddr>,
}

impl FabricSteering {
    /// Attaches steering in the fabric namespace `ns` over `replicas`, with `nat_addr` (the
    /// shared external address) steered by port block. If the lab already runs BPF steering
    /// with pinned maps (a 2+-replica lab, or a previous controller), this takes it over: the
    /// old maps' placement (replica slots, ring, exceptions, conn pins, port owners) is
    /// adopted, the filters are replaced by ours, and the pins are ours from then on. The
    /// steering outlives this controller: dropped (a leadership lost, a stop), it leaves the
    /// filters attached and the maps pinned, so the fabric goes on steering every flow where it
    /// was and the next leader adopts all of it. (Before, a controller that stood down removed
    /// the pins and detached the filters: its successor attached fresh maps, and live flows
    /// whose pins were lost were re-homed by the next ring change — a download broken by a
    /// leader's death in the middle of a scale-out.)
    pub fn attach_lab(
        ns: &str,
        replicas: &[u32],
        nat_addr: Option<std::net::IpAddr>,
    ) -> Result<FabricSteering> {
        let pins = crate::lab::pin_dir(ns);
        let opts = crate::SteerOptions {
            pin_dir: Some(pins),
            ..Default::default()
        };
        let mut ports = crate::lab::lab_ports(0);
        for &n in replicas {
            ports.replicas.push(crate::ReplicaPorts {
                index: n,
                in_port: format!("fabr{n}in"),
                out_port: format!("fabr{n}out"),
            });
        }
        let mut steer = crate::Steer::attach(ns, &ports, &opts).map_err(serr)?;
        steer.keep_on_drop();
        if let Some(a) = nat_addr {
            steer.add_nat_addr(a).map_err(serr)?;
        }
        let mut f = FabricSteering {
            steer,
            ring_size: crate::maglev::DEFAULT_RING_SIZE,
            nat_addrs: nat_addr.into_iter().collect(),
        };
        f.set_ring(replicas)?;
        Ok(f)
    }
}

impl Steering for FabricSteering {
    fn add_replica(&mut self, index: u32) -> Result<()> {
        self.steer
            .add_replica(&crate::ReplicaPorts {
                index,
                in_port: format!("fabr{index}in"),
                out_port: format!("fabr{index}out"),
            })
            .map_err(serr)
    }
    fn set_live(&mut self, index: u32, live: bool) -> Result<()> {
        self.steer.set_replica_live(index, live).map_err(serr)
    }
    fn set_ring(&mut self, live: &[u32]) -> Result<()> {
        if live.is_empty() {
            // An empty ring would drop every new flow; keep the old one until a replica exists.
            return Err(SteeringError("refusing an empty ring".into()));
        }
        self.steer
            .set_ring_maglev(live, self.ring_size)
            .map_err(serr)
    }
    fn set_exceptions(&mut self, entries: &[(FlowKey, u32)]) -> Result<()> {
        self.steer.set_exceptions(entries).map_err(serr)
    }
    fn remove_exceptions(&mut self, keys: &[FlowKey]) -> Result<usize> {
        self.steer.remove_exceptions(keys).map_err(serr)
    }
    fn exceptions(&self) -> Result<Vec<(FlowKey, u32)>> {
        self.steer.exceptions().map_err(serr)
    }
    fn demote_exceptions(&mut self, entries: &[(FlowKey, u32)]) -> Result<usize> {
        for (k, r) in entries {
            self.steer.pin_conn(k, *r).map_err(serr)?;
        }
        let keys: Vec<FlowKey> = entries.iter().map(|(k, _)| *k).collect();
        self.steer.remove_exceptions(&keys).map_err(serr)
    }
    fn set_port_owner(&mut self, range: RangeInclusive<u16>, owner: Option<u32>) -> Result<()> {
        self.steer.set_port_owner(range, owner).map_err(serr)
    }
    fn flush_pins(&mut self, index: u32) -> Result<usize> {
        self.steer.flush_conn_for(index).map_err(serr)
    }
    fn set_fenced(&mut self, index: u32, fenced: bool) -> Result<()> {
        self.steer.set_replica_fenced(index, fenced).map_err(serr)
    }
    fn nat_addrs(&self) -> Vec<IpAddr> {
        self.nat_addrs.clone()
    }
    fn stats(&self) -> serde_json::Value {
        match self.steer.stats() {
            Ok(s) => {
                let m: serde_json::Map<String, serde_json::Value> =
                    s.named().map(|(k, v)| (k.to_string(), v.into())).collect();
                let fenced = self.steer.fenced_replicas().unwrap_or_default();
                serde_json::json!({"backend": "tc-bpf", "netns": self.steer.netns(),
                    "counters": m, "fenced": fenced})
            }
            Err(e) => serde_json::json!({"backend": "tc-bpf", "error": e.to_string()}),
        }
    }
}
