//! Greedy first-fit, the baseline the MILPs are measured against: keep every copy where it is,
//! and only move copies off hosts that are over capacity, heaviest first (so as few as possible),
//! each onto the first host in index order that has room, hosts in use before empty ones (scale
//! out). It never scales in.

use std::time::Instant;

use crate::model::{HostId, Placement, Problem, LOAD_TOLERANCE};
use crate::plan::{chain, Objective, Plan, PlanError, SolveStatus};

/// Greedy over the horizon, one step after the other.
pub fn plan_offline(problem: &Problem) -> Result<Plan, PlanError> {
    problem.validate()?;
    let started = Instant::now();
    let mut placements: Vec<Placement> = Vec::with_capacity(problem.horizon());
    for t in 0..problem.horizon() {
        let prev = placements.last().or(problem.current.as_ref());
        placements.push(greedy_step(problem, prev, t)?);
    }
    let steps = chain(problem, placements);
    Plan::assemble(
        problem,
        steps,
        Objective::Offline,
        SolveStatus::Heuristic,
        started,
        Vec::new(),
    )
}

/// Greedy for one load snapshot.
pub fn plan_online(problem: &Problem) -> Result<Plan, PlanError> {
    problem.validate_snapshot()?;
    let started = Instant::now();
    let steps = chain(
        problem,
        [greedy_step(problem, problem.current.as_ref(), 0)?],
    );
    Plan::assemble(
        problem,
        steps,
        Objective::Online,
        SolveStatus::Heuristic,
        started,
        Vec::new(),
    )
}

struct Hosts<'a> {
    problem: &'a Problem,
    step: usize,
    load: Vec<f64>,
    bytes: Vec<u64>,
    count: Vec<usize>,
}

impl Hosts<'_> {
    fn fits(&self, h: HostId, i: usize) -> bool {
        let p = &self.problem.partitions[i];
        self.load[h] + p.load[self.step] <= self.problem.host.cpu_capacity + LOAD_TOLERANCE
            && self.bytes[h] + p.bytes <= self.problem.host.memory_bytes
    }

    fn cpu_over(&self, h: HostId) -> bool {
        self.load[h] > self.problem.host.cpu_capacity + LOAD_TOLERANCE
    }

    fn mem_over(&self, h: HostId) -> bool {
        self.bytes[h] > self.problem.host.memory_bytes
    }

    fn add(&mut self, h: HostId, i: usize, sign: i8) {
        let p = &self.problem.partitions[i];
        if sign > 0 {
            self.load[h] += p.load[self.step];
            self.bytes[h] += p.bytes;
            self.count[h] += 1;
        } else {
            self.load[h] -= p.load[self.step];
            self.bytes[h] -= p.bytes;
            self.count[h] -= 1;
        }
    }

    /// First host with room for a copy of `i` that has none: hosts in use first, then empty ones.
    fn first_fit(&self, i: usize, copies: &[HostId]) -> Option<HostId> {
        let hosts = 0..self.problem.max_hosts;
        let free = |h: &HostId| !copies.contains(h) && self.fits(*h, i);
        hosts
            .clone()
            .filter(|&h| self.count[h] > 0)
            .find(free)
            .or_else(|| hosts.filter(|&h| self.count[h] == 0).find(free))
    }
}

fn greedy_step(
    problem: &Problem,
    prev: Option<&Placement>,
    t: usize,
) -> Result<Placement, PlanError> {
    let h = problem.max_hosts;
    let mut copies: Vec<Vec<HostId>> = match prev {
        Some(p) => p.copies.clone(),
        None => vec![Vec::new(); problem.partitions.len()],
    };
    let mut hosts = Hosts {
        problem,
        step: t,
        load: vec![0.0; h],
        bytes: vec![0; h],
        count: vec![0; h],
    };
    for (i, c) in copies.iter().enumerate() {
        for &j in c {
            hosts.add(j, i, 1);
        }
    }
    let no_room = || PlanError::NoFeasiblePlacement {
        from_hosts: problem.hosts_lower_bound(t),
        max_hosts: h,
    };
    // Copies not placed yet (nothing placed before): heaviest partitions first.
    let mut order: Vec<usize> = (0..copies.len()).collect();
    order.sort_by(|&x, &y| problem.partitions[y].load[t].total_cmp(&problem.partitions[x].load[t]));
    for &i in &order {
        while copies[i].len() < problem.copies() {
            let j = hosts.first_fit(i, &copies[i]).ok_or_else(no_room)?;
            hosts.add(j, i, 1);
            copies[i].push(j);
        }
    }
    // Overloaded hosts shed their heaviest copies (by the resource that is over) first.
    for j in 0..h {
        while hosts.cpu_over(j) || hosts.mem_over(j) {
            let by_cpu = hosts.cpu_over(j);
            let heaviest = (0..copies.len())
                .filter(|&i| copies[i].contains(&j))
                .max_by(|&x, &y| {
                    let (px, py) = (&problem.partitions[x], &problem.partitions[y]);
                    if by_cpu {
                        px.load[t].total_cmp(&py.load[t])
                    } else {
                        px.bytes.cmp(&py.bytes)
                    }
                });
            let i = heaviest.expect("an overloaded host holds a copy");
            let to = hosts.first_fit(i, &copies[i]).ok_or_else(no_room)?;
            hosts.add(j, i, -1);
            hosts.add(to, i, 1);
            copies[i].retain(|&x| x != j);
            copies[i].push(to);
        }
    }
    debug_assert!((0..h).all(|j| !hosts.cpu_over(j) && !hosts.mem_over(j)));
    debug_assert!(copies.iter().all(|c| c.len() == problem.copies()));
    Ok(Placement::new(copies))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problem(loads: &[f64], max_hosts: usize, current: Vec<Vec<HostId>>) -> Problem {
        let mut p = crate::instances::uniform(loads, 10, max_hosts, 0);
        p.current = Some(Placement::new(current));
        p
    }

    #[test]
    fn sheds_the_heaviest_copy_onto_the_first_host_with_room_and_scales_out_last() {
        // Host 0 carries 130: the 70 leaves; host 1 (in use, 50) has no room, host 2 is empty.
        let p = problem(&[70.0, 60.0, 50.0], 4, vec![vec![0], vec![0], vec![1]]);
        let plan = plan_online(&p).unwrap();
        assert_eq!(
            plan.steps[0].placement.copies,
            vec![vec![2], vec![0], vec![1]]
        );
        assert_eq!(plan.steps[0].moves.len(), 1);
        // With room on host 1 for the heaviest, nothing scales out.
        let p = problem(&[40.0, 70.0, 50.0], 4, vec![vec![0], vec![0], vec![1]]);
        let plan = plan_online(&p).unwrap();
        assert_eq!(
            plan.steps[0].placement.copies,
            vec![vec![0], vec![2], vec![1]]
        );
        let p = problem(&[70.0, 40.0, 20.0], 4, vec![vec![0], vec![0], vec![1]]);
        let plan = plan_online(&p).unwrap();
        assert_eq!(
            plan.steps[0].placement.copies,
            vec![vec![1], vec![0], vec![1]]
        );
    }

    #[test]
    fn refuses_when_no_host_has_room() {
        let p = problem(&[70.0, 60.0, 50.0], 2, vec![vec![0], vec![0], vec![1]]);
        assert!(matches!(
            plan_online(&p),
            Err(PlanError::NoFeasiblePlacement { max_hosts: 2, .. })
        ));
    }
}
