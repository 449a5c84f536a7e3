//! Seeded random instances, for the tests and the solve-time example: one seed gives one instance.

use crate::model::{Costs, HostSpec, Partition, Placement, Problem};

/// SplitMix64: small, deterministic, good enough to draw test instances.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        assert!(n > 0);
        (self.next_u64() % n as u64) as usize
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Each of `parts` partitions on `copies` distinct hosts drawn from `0..hosts`.
pub fn random_placement(rng: &mut Rng, parts: usize, hosts: usize, copies: usize) -> Placement {
    let copies = (0..parts)
        .map(|_| {
            let mut all: Vec<usize> = (0..hosts).collect();
            for n in 0..copies {
                let pick = n + rng.below(hosts - n);
                all.swap(n, pick);
            }
            all.truncate(copies);
            all
        })
        .collect();
    Placement::new(copies)
}

/// Shape of a random instance.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub partitions: usize,
    pub max_hosts: usize,
    pub k: usize,
    pub horizon: usize,
    /// Total load (all copies) as a multiple of one host's capacity, on average.
    pub fill_hosts: f64,
}

/// A random problem: loads uniform around the average the shape asks for, sizes between 1 and 8
/// units (small integers keep the objectives exact), memory for about twice the fill. With
/// `with_current`, a current placement that is first-fit on the first step's loads and feasible.
pub fn random_problem(seed: u64, shape: Shape, with_current: bool) -> Problem {
    let mut rng = Rng::new(seed);
    let copies = (shape.k + 1) as f64;
    let cpu_capacity = 100.0;
    let mean_load = shape.fill_hosts * cpu_capacity / (shape.partitions.max(1) as f64 * copies);
    let partitions: Vec<Partition> = (0..shape.partitions)
        .map(|_| Partition {
            bytes: 1 + rng.below(8) as u64,
            load: (0..shape.horizon)
                .map(|_| {
                    (mean_load * (0.2 + 1.6 * rng.unit()))
                        .min(cpu_capacity)
                        .round()
                })
                .collect(),
        })
        .collect();
    let total_bytes: u64 = partitions.iter().map(|p| p.bytes).sum::<u64>() * (shape.k as u64 + 1);
    let max_bytes = partitions.iter().map(|p| p.bytes).max().unwrap_or(1);
    let memory_bytes =
        (2 * total_bytes / shape.fill_hosts.ceil().max(1.0) as u64).max(2 * max_bytes);
    let mut problem = Problem {
        partitions,
        host: HostSpec {
            cpu_capacity,
            memory_bytes,
        },
        max_hosts: shape.max_hosts,
        k: shape.k,
        current: None,
        costs: Costs {
            host_step: 10.0,
            per_byte_moved: 1.0,
            epsilon: 1e-3,
        },
    };
    if with_current {
        problem.current = first_fit(&problem, 0);
    }
    problem
}

/// The solve-time instance at scale: k = 1, a pool of `partitions / 8` hosts, the copies placed
/// first-fit on one load, then a new load snapshot (each partition's load redrawn) to plan for, the
/// total load averaging `fill` of the pool's CPU; `horizon` predicted steps after the first-fit one
/// (1 for the online planner). Seed 42: every caller solves the same instance.
pub fn at_scale(partitions: usize, fill: f64, horizon: usize) -> Problem {
    let max_hosts = partitions / 8;
    let shape = Shape {
        partitions,
        max_hosts,
        k: 1,
        horizon: 1 + horizon,
        fill_hosts: max_hosts as f64 * fill,
    };
    let mut problem = random_problem(42, shape, true);
    assert!(problem.current.is_some(), "the first-fit start did not fit");
    for p in &mut problem.partitions {
        p.load.remove(0);
    }
    problem
}

/// Copies placed first-fit (hosts in index order) on the loads of `step`; `None` if they do not fit.
pub fn first_fit(problem: &Problem, step: usize) -> Option<Placement> {
    let mut totals = vec![(0.0f64, 0u64); problem.max_hosts];
    let mut copies = vec![Vec::new(); problem.partitions.len()];
    for (i, p) in problem.partitions.iter().enumerate() {
        for _ in 0..problem.copies() {
            let h = (0..problem.max_hosts).find(|&h| {
                !copies[i].contains(&h)
                    && totals[h].0 + p.load[step] <= problem.host.cpu_capacity
                    && totals[h].1 + p.bytes <= problem.host.memory_bytes
            })?;
            totals[h].0 += p.load[step];
            totals[h].1 += p.bytes;
            copies[i].push(h);
        }
    }
    Some(Placement::new(copies))
}

/// A one-step problem with hosts of CPU 100 and memory 1,000 bytes, every partition `bytes` big with
/// the given loads, nothing placed yet, default costs.
pub fn uniform(loads: &[f64], bytes: u64, max_hosts: usize, k: usize) -> Problem {
    Problem {
        partitions: loads
            .iter()
            .map(|&l| Partition {
                bytes,
                load: vec![l],
            })
            .collect(),
        host: HostSpec {
            cpu_capacity: 100.0,
            memory_bytes: 1000,
        },
        max_hosts,
        k,
        current: None,
        costs: Costs::default(),
    }
}
