//! The typed placement problem and its validation.
//!
//! Units: a partition's `load` is in the same unit as [`HostSpec::cpu_capacity`] (the seed uses
//! cores × the highest per-core utilisation wanted, `L * C`); sizes are bytes. Every copy of a
//! partition carries the partition's full load and size (an active-active replica executes every
//! transaction, as in the seed's system), so copies are symmetric for placement: which copy is the
//! master is left to the layer that executes the plan.

use serde::{Deserialize, Serialize};

/// Index of a host in the pool, `0..max_hosts`.
pub type HostId = usize;

/// One partition: its size and its load at each time step of the horizon (one entry for the
/// online planner: the current snapshot).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Partition {
    pub bytes: u64,
    pub load: Vec<f64>,
}

/// Every host of the pool is alike (the seed's assumption; it is also what makes host indices
/// interchangeable, so that symmetry breaking is valid).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct HostSpec {
    pub cpu_capacity: f64,
    pub memory_bytes: u64,
}

/// Cost weights of the objectives.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Costs {
    /// S: cost of one host in use during one time step (offline).
    pub host_step: f64,
    /// I: cost of one byte copied to a new host (offline).
    pub per_byte_moved: f64,
    /// ε: weight of the mean absolute load deviation next to the bytes moved (online). Small, so
    /// that balance only breaks ties between plans that move about as much data.
    pub epsilon: f64,
}

impl Default for Costs {
    fn default() -> Self {
        Costs {
            host_step: 1.0,
            per_byte_moved: 1e-9,
            epsilon: 1e-3,
        }
    }
}

/// Where the copies of every partition are: `copies[i]` lists the hosts of partition `i`,
/// ascending, distinct.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Placement {
    pub copies: Vec<Vec<HostId>>,
}

impl Placement {
    /// Builds a placement, sorting each partition's host list.
    pub fn new(mut copies: Vec<Vec<HostId>>) -> Self {
        for c in &mut copies {
            c.sort_unstable();
        }
        Placement { copies }
    }

    /// Number of hosts holding at least one copy.
    pub fn hosts_used(&self) -> usize {
        let mut used: Vec<HostId> = self.copies.iter().flatten().copied().collect();
        used.sort_unstable();
        used.dedup();
        used.len()
    }

    /// Whether partition `i` has a copy on `host`.
    pub fn has(&self, i: usize, host: HostId) -> bool {
        self.copies[i].contains(&host)
    }

    /// Per-host totals (load at `step`, bytes) over `max_hosts` hosts.
    pub fn host_totals(&self, problem: &Problem, step: usize) -> Vec<(f64, u64)> {
        let mut totals = vec![(0.0, 0u64); problem.max_hosts];
        for (i, hosts) in self.copies.iter().enumerate() {
            let p = &problem.partitions[i];
            for &h in hosts {
                totals[h].0 += p.load[step];
                totals[h].1 += p.bytes;
            }
        }
        totals
    }
}

/// The whole problem: partitions, the host pool, the replication factor, where the copies are now,
/// and the cost weights.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Problem {
    pub partitions: Vec<Partition>,
    pub host: HostSpec,
    /// Size of the pool: the planner may use hosts `0..max_hosts`.
    pub max_hosts: usize,
    /// Replication factor: every partition has `k + 1` copies on distinct hosts.
    pub k: usize,
    /// The placement now. `None`: nothing is placed yet, every copy of the first step is new and
    /// counts as moved (a constant, so it does not change the optimum).
    pub current: Option<Placement>,
    pub costs: Costs,
}

/// Lets a load or size sit exactly on a capacity despite float rounding.
pub const LOAD_TOLERANCE: f64 = 1e-9;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ModelError {
    #[error("the host pool is empty (max_hosts = 0)")]
    NoHosts,
    #[error("host cpu capacity {0} must be finite and > 0")]
    BadCpuCapacity(f64),
    #[error("host memory capacity must be > 0 bytes")]
    NoMemory,
    #[error("{copies} copies per partition (k = {k}) need {copies} distinct hosts, the pool has {max_hosts}")]
    NotEnoughHosts {
        k: usize,
        copies: usize,
        max_hosts: usize,
    },
    #[error("the horizon is empty: partitions have no load entries")]
    EmptyHorizon,
    #[error("partition {partition} has {len} load entries, partition 0 has {expected}")]
    HorizonMismatch {
        partition: usize,
        len: usize,
        expected: usize,
    },
    #[error("partition {partition} load {load} at step {step} is negative or not finite")]
    BadLoad {
        partition: usize,
        step: usize,
        load: f64,
    },
    #[error("partition {partition} ({bytes} bytes) is bigger than a host's memory ({memory_bytes} bytes)")]
    PartitionTooBig {
        partition: usize,
        bytes: u64,
        memory_bytes: u64,
    },
    #[error("partition {partition} load {load} at step {step} exceeds a host's cpu capacity {cpu_capacity}")]
    PartitionTooHot {
        partition: usize,
        step: usize,
        load: f64,
        cpu_capacity: f64,
    },
    #[error("cost weight {name} = {value} must be finite and >= 0")]
    BadCost { name: &'static str, value: f64 },
    #[error("the current placement lists {len} partitions, the problem has {expected}")]
    CurrentLength { len: usize, expected: usize },
    #[error("the current placement gives partition {partition} {len} copies, k + 1 = {copies}")]
    CurrentCopies {
        partition: usize,
        len: usize,
        copies: usize,
    },
    #[error("the current placement puts partition {partition} on host {host}, outside the pool of {max_hosts}")]
    CurrentHostOutOfRange {
        partition: usize,
        host: HostId,
        max_hosts: usize,
    },
    #[error("the current placement puts two copies of partition {partition} on host {host}")]
    CurrentDuplicate { partition: usize, host: HostId },
    #[error("the online planner takes one load snapshot, the partitions have {0} steps")]
    NotASnapshot(usize),
}

impl Problem {
    /// Copies per partition, `k + 1`.
    pub fn copies(&self) -> usize {
        self.k + 1
    }

    /// Number of time steps in the horizon (validated to be the same for every partition).
    pub fn horizon(&self) -> usize {
        self.partitions.first().map_or(1, |p| p.load.len())
    }

    /// Hosts holding no copy now, ascending: these are interchangeable, the others are not.
    pub fn empty_hosts(&self) -> Vec<HostId> {
        let mut empty = vec![true; self.max_hosts];
        if let Some(cur) = &self.current {
            for &h in cur.copies.iter().flatten() {
                empty[h] = false;
            }
        }
        (0..self.max_hosts).filter(|&h| empty[h]).collect()
    }

    /// The fewest hosts that could carry step `step`: copies, total load and total bytes each give
    /// a bound; the largest wins. (Not always enough: bin packing may need more.)
    pub fn hosts_lower_bound(&self, step: usize) -> usize {
        if self.partitions.is_empty() {
            return 0;
        }
        let c = self.copies() as f64;
        let load: f64 = self.partitions.iter().map(|p| p.load[step]).sum::<f64>() * c;
        let bytes: f64 = self.partitions.iter().map(|p| p.bytes as f64).sum::<f64>() * c;
        let by_cpu = (load / self.host.cpu_capacity - LOAD_TOLERANCE)
            .ceil()
            .max(0.0) as usize;
        let by_mem = (bytes / self.host.memory_bytes as f64 - LOAD_TOLERANCE)
            .ceil()
            .max(0.0) as usize;
        self.copies().max(by_cpu).max(by_mem)
    }

    /// [`Problem::validate`], and one load step: what the online planners take.
    pub fn validate_snapshot(&self) -> Result<(), ModelError> {
        self.validate()?;
        match self.horizon() {
            1 => Ok(()),
            steps => Err(ModelError::NotASnapshot(steps)),
        }
    }

    /// Checks every field; the planners call it first.
    pub fn validate(&self) -> Result<(), ModelError> {
        if self.max_hosts == 0 {
            return Err(ModelError::NoHosts);
        }
        let cpu = self.host.cpu_capacity;
        if !(cpu.is_finite() && cpu > 0.0) {
            return Err(ModelError::BadCpuCapacity(cpu));
        }
        if self.host.memory_bytes == 0 {
            return Err(ModelError::NoMemory);
        }
        if self.copies() > self.max_hosts {
            return Err(ModelError::NotEnoughHosts {
                k: self.k,
                copies: self.copies(),
                max_hosts: self.max_hosts,
            });
        }
        for (name, value) in [
            ("S (host_step)", self.costs.host_step),
            ("I (per_byte_moved)", self.costs.per_byte_moved),
            ("epsilon", self.costs.epsilon),
        ] {
            if !(value.is_finite() && value >= 0.0) {
                return Err(ModelError::BadCost { name, value });
            }
        }
        let expected = self.horizon();
        if !self.partitions.is_empty() && expected == 0 {
            return Err(ModelError::EmptyHorizon);
        }
        for (i, p) in self.partitions.iter().enumerate() {
            if p.load.len() != expected {
                return Err(ModelError::HorizonMismatch {
                    partition: i,
                    len: p.load.len(),
                    expected,
                });
            }
            if p.bytes > self.host.memory_bytes {
                return Err(ModelError::PartitionTooBig {
                    partition: i,
                    bytes: p.bytes,
                    memory_bytes: self.host.memory_bytes,
                });
            }
            for (step, &load) in p.load.iter().enumerate() {
                if !(load.is_finite() && load >= 0.0) {
                    return Err(ModelError::BadLoad {
                        partition: i,
                        step,
                        load,
                    });
                }
                if load > cpu + LOAD_TOLERANCE {
                    return Err(ModelError::PartitionTooHot {
                        partition: i,
                        step,
                        load,
                        cpu_capacity: cpu,
                    });
                }
            }
        }
        if let Some(cur) = &self.current {
            if cur.copies.len() != self.partitions.len() {
                return Err(ModelError::CurrentLength {
                    len: cur.copies.len(),
                    expected: self.partitions.len(),
                });
            }
            for (i, hosts) in cur.copies.iter().enumerate() {
                if hosts.len() != self.copies() {
                    return Err(ModelError::CurrentCopies {
                        partition: i,
                        len: hosts.len(),
                        copies: self.copies(),
                    });
                }
                let mut seen = hosts.clone();
                seen.sort_unstable();
                for w in seen.windows(2) {
                    if w[0] == w[1] {
                        return Err(ModelError::CurrentDuplicate {
                            partition: i,
                            host: w[0],
                        });
                    }
                }
                if let Some(&host) = hosts.iter().find(|&&h| h >= self.max_hosts) {
                    return Err(ModelError::CurrentHostOutOfRange {
                        partition: i,
                        host,
                        max_hosts: self.max_hosts,
                    });
                }
            }
        }
        Ok(())
    }
}
