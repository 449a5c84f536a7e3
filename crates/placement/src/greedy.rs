//! Two greedy planners:
//!
//! - **Greedy first-fit** ([`plan_online`], [`plan_offline`]), the seed's baseline ("GRD"): every
//!   plan is made from scratch, ignoring where the copies are: hosts in index order, each filled
//!   with partition copies in index order until it is full. Hosts in use are whatever the
//!   packing needs, so it scales in as readily as out, and it moves whatever the new packing puts
//!   elsewhere. This is what the MILPs are measured against.
//! - **Repair** ([`repair_online`], [`repair_offline`]): keep every copy where it is and only
//!   move copies off hosts that are over capacity, heaviest first (so as few as possible), each
//!   onto the first host in index order that has room, hosts in use before empty ones (scale
//!   out). It never scales in. Not the seed's; the MILPs use it as a feasible plan to start
//!   from or fall back to.

use std::time::Instant;

use crate::model::{HostId, Placement, Problem, LOAD_TOLERANCE};
use crate::plan::{chain, Objective, Plan, PlanError, SolveStatus};

/// Greedy first-fit over the horizon, every step packed from scratch.
pub fn plan_offline(problem: &Problem) -> Result<Plan, PlanError> {
    problem.validate()?;
    let started = Instant::now();
    let placements = (0..problem.horizon())
        .map(|t| first_fit_step(problem, t))
        .collect::<Result<Vec<_>, _>>()?;
    assemble(problem, placements, Objective::Offline, started)
}

/// Greedy first-fit for one load snapshot, packed from scratch.
pub fn plan_online(problem: &Problem) -> Result<Plan, PlanError> {
    problem.validate_snapshot()?;
    let started = Instant::now();
    let placement = first_fit_step(problem, 0)?;
    assemble(problem, [placement], Objective::Online, started)
}

/// Repair over the horizon, one step after the other.
pub fn repair_offline(problem: &Problem) -> Result<Plan, PlanError> {
    problem.validate()?;
    let started = Instant::now();
    let mut placements: Vec<Placement> = Vec::with_capacity(problem.horizon());
    for t in 0..problem.horizon() {
        let prev = placements.last().or(problem.current.as_ref());
        placements.push(repair_step(problem, prev, t)?);
    }
    assemble(problem, placements, Objective::Offline, started)
}

/// Repair for one load snapshot.
pub fn repair_online(problem: &Problem) -> Result<Plan, PlanError> {
    problem.validate_snapshot()?;
    let started = Instant::now();
    let placement = repair_step(problem, problem.current.as_ref(), 0)?;
    assemble(problem, [placement], Objective::Online, started)
}

fn assemble(
    problem: &Problem,
    placements: impl IntoIterator<Item = Placement>,
    objective: Objective,
    started: Instant,
) -> Result<Plan, PlanError> {
    let steps = chain(problem, placements);
    Plan::assemble(
        problem,
        steps,
        objective,
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

impl<'a> Hosts<'a> {
    fn empty(problem: &'a Problem, step: usize) -> Self {
        let h = problem.max_hosts;
        Hosts {
            problem,
            step,
            load: vec![0.0; h],
            bytes: vec![0; h],
            count: vec![0; h],
        }
    }
}

fn no_room(problem: &Problem, t: usize) -> PlanError {
    PlanError::NoFeasiblePlacement {
        from_hosts: problem.hosts_lower_bound(t),
        max_hosts: problem.max_hosts,
    }
}

/// The seed's greedy first-fit: "starts with a node, allocates partitions to it until its
/// maximum capacity is reached, moves on to the next node, and so on, until there are no more
/// partitions to be allocated". The copies to allocate are one sequence (every partition's
/// first copy in index order, then every second copy, ...); each host in index order takes, in
/// sequence order, every copy that fits and whose partition it does not hold yet. Taking the
/// sequence where the previous host stopped (rather than restarting at partition 0 for every
/// host) is what lets the copies of k + 1 partitions fill an odd number of hosts.
fn first_fit_step(problem: &Problem, t: usize) -> Result<Placement, PlanError> {
    let mut hosts = Hosts::empty(problem, t);
    let parts = problem.partitions.len();
    let mut copies: Vec<Vec<HostId>> = vec![Vec::new(); parts];
    let mut queue: Vec<usize> = (0..problem.copies()).flat_map(|_| 0..parts).collect();
    for j in 0..problem.max_hosts {
        queue.retain(|&i| {
            if copies[i].contains(&j) || !hosts.fits(j, i) {
                return true;
            }
            hosts.add(j, i, 1);
            copies[i].push(j);
            false
        });
        if queue.is_empty() {
            return Ok(Placement::new(copies));
        }
    }
    Err(no_room(problem, t))
}

fn repair_step(
    problem: &Problem,
    prev: Option<&Placement>,
    t: usize,
) -> Result<Placement, PlanError> {
    let h = problem.max_hosts;
    let mut copies: Vec<Vec<HostId>> = match prev {
        Some(p) => p.copies.clone(),
        None => vec![Vec::new(); problem.partitions.len()],
    };
    let mut hosts = Hosts::empty(problem, t);
    for (i, c) in copies.iter().enumerate() {
        for &j in c {
            hosts.add(j, i, 1);
        }
    }
    let no_room = || no_room(problem, t);
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
    fn repair_sheds_the_heaviest_copy_onto_the_first_host_with_room_and_scales_out_last() {
        // Host 0 carries 130: the 70 leaves; host 1 (in use, 50) has no room, host 2 is empty.
        let p = problem(&[70.0, 60.0, 50.0], 4, vec![vec![0], vec![0], vec![1]]);
        let plan = repair_online(&p).unwrap();
        assert_eq!(
            plan.steps[0].placement.copies,
            vec![vec![2], vec![0], vec![1]]
        );
        assert_eq!(plan.steps[0].moves.len(), 1);
        // With room on host 1 for the heaviest, nothing scales out.
        let p = problem(&[40.0, 70.0, 50.0], 4, vec![vec![0], vec![0], vec![1]]);
        let plan = repair_online(&p).unwrap();
        assert_eq!(
            plan.steps[0].placement.copies,
            vec![vec![0], vec![2], vec![1]]
        );
        let p = problem(&[70.0, 40.0, 20.0], 4, vec![vec![0], vec![0], vec![1]]);
        let plan = repair_online(&p).unwrap();
        assert_eq!(
            plan.steps[0].placement.copies,
            vec![vec![1], vec![0], vec![1]]
        );
    }

    #[test]
    fn refuses_when_no_host_has_room() {
        let p = problem(&[70.0, 60.0, 50.0], 2, vec![vec![0], vec![0], vec![1]]);
        for plan in [repair_online(&p), plan_online(&p)] {
            assert!(matches!(
                plan,
                Err(PlanError::NoFeasiblePlacement { max_hosts: 2, .. })
            ));
        }
    }

    #[test]
    fn first_fit_packs_from_scratch_in_index_order_whatever_the_current_placement() {
        // Capacity 100: 40 + 50 fill host 0, 30 and 60 do not fit there, host 1 takes them;
        // the current placement (all apart on hosts 0..3) is ignored.
        let p = problem(
            &[40.0, 50.0, 30.0, 60.0],
            4,
            vec![vec![1], vec![2], vec![3], vec![0]],
        );
        let plan = plan_online(&p).unwrap();
        assert_eq!(
            plan.steps[0].placement.copies,
            vec![vec![0], vec![0], vec![1], vec![1]]
        );
        assert_eq!(plan.steps[0].hosts_used, 2, "it scales in");
        assert_eq!(
            plan.steps[0].moves.len(),
            4,
            "every copy that lands elsewhere moves"
        );
        // Copies of one partition go to distinct hosts.
        let mut p = crate::instances::uniform(&[60.0, 30.0], 10, 4, 1);
        p.current = None;
        let plan = plan_online(&p).unwrap();
        assert_eq!(plan.steps[0].placement.copies, vec![vec![0, 1], vec![0, 1]]);
    }

    #[test]
    fn first_fit_fills_an_odd_number_of_hosts_with_two_copies_of_each_partition() {
        // 8 partitions x 2 copies of 15 on hosts of 100 (6 copies each): 6 / 6 / 4, no host
        // holding both copies of one partition.
        let p = crate::instances::uniform(&[15.0; 8], 10, 4, 1);
        let plan = plan_online(&p).unwrap();
        let placement = &plan.steps[0].placement;
        assert_eq!(plan.steps[0].hosts_used, 3);
        let mut per_host = [0; 4];
        for c in &placement.copies {
            assert_eq!(c.len(), 2);
            assert_ne!(c[0], c[1]);
            c.iter().for_each(|&h| per_host[h] += 1);
        }
        assert_eq!(per_host, [6, 6, 4, 0]);
    }

    #[test]
    fn first_fit_offline_repacks_every_step_from_scratch() {
        let mut p = problem(
            &[40.0, 50.0, 30.0, 60.0],
            4,
            vec![vec![0], vec![0], vec![1], vec![1]],
        );
        // Step 2: partition 0 heats up to 70: 70 + 50 no longer fit on host 0.
        for (part, l) in p.partitions.iter_mut().zip([70.0, 50.0, 30.0, 60.0]) {
            let first = part.load[0];
            part.load = vec![first, l];
        }
        let plan = plan_offline(&p).unwrap();
        assert_eq!(plan.steps[0].moves.len(), 0);
        assert_eq!(
            plan.steps[1].placement.copies,
            vec![vec![0], vec![1], vec![0], vec![2]]
        );
    }
}
