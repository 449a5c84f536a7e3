//! `scale out|in` and `plan`: measure, plan with pliant-placement, create the hosts a plan adds,
//! execute its moves in the planner's copy-before-drop order (one partition's in order, several
//! partitions' at once), remove the hosts it empties.

use crate::cluster::Kv;
use crate::host;
use crate::invariant;
use crate::monitor;
use crate::moves::{self, MoveReport};
use crate::planning::{self, Input, Planner, Step};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Mutex};
use std::time::Duration;

#[derive(Clone, Debug)]
pub struct ScaleOpts {
    pub target: usize,
    pub planner: Planner,
    /// How long the loads are measured before planning.
    pub window: Duration,
    /// Moves at once (of different partitions; `moves::PARALLEL` by default).
    pub parallel: usize,
}

/// A plan in host ids.
#[derive(Clone, Debug)]
pub struct ScalePlan {
    /// Pool index → host id (ids not created yet for a scale-out's new hosts).
    pub pool: Vec<u32>,
    pub new_hosts: Vec<u32>,
    pub steps: Vec<Step>,
    pub bytes_moved: u64,
    pub status: String,
    pub solve_time: Duration,
    /// Target placement, host ids per partition.
    pub target: Vec<Vec<u32>>,
    /// Moves of different partitions run at once, at most this many.
    pub parallel: usize,
}

impl ScalePlan {
    pub fn host_of(&self, pool_index: usize) -> u32 {
        self.pool[pool_index]
    }

    /// One line: moves, bytes, how the planner ended, new hosts.
    pub fn summary(&self) -> String {
        format!(
            "{} moves, {} bytes, {} in {:.2} s; new hosts {:?}",
            self.steps.len(),
            self.bytes_moved,
            self.status,
            self.solve_time.as_secs_f64(),
            self.new_hosts
        )
    }

    pub fn describe(&self, s: &Step) -> String {
        match s.from {
            Some(f) => format!(
                "partition {}: host {} -> host {}",
                s.partition,
                self.host_of(f),
                self.host_of(s.to)
            ),
            None => format!(
                "partition {}: new copy on host {}",
                s.partition,
                self.host_of(s.to)
            ),
        }
    }
}

pub fn plan(kv: &Kv, o: &ScaleOpts) -> Result<ScalePlan, String> {
    let st = &kv.state;
    let mut pool: Vec<u32> = st.hosts.iter().map(|h| h.id).collect();
    pool.sort_unstable();
    let new_hosts: Vec<u32> = (0..o.target.saturating_sub(pool.len()) as u32)
        .map(|i| st.next_host + i)
        .collect();
    pool.extend(&new_hosts);
    let index = |id: u32| pool.iter().position(|&h| h == id).expect("host in pool");
    let snap = monitor::measure(st, &kv.password, o.window);
    let input = Input {
        loads: snap.partitions.iter().map(|p| p.master_cpu).collect(),
        bytes: snap.partitions.iter().map(|p| p.used_memory).collect(),
        current: Some(
            st.placement()
                .iter()
                .map(|c| c.iter().map(|&h| index(h)).collect())
                .collect(),
        ),
        pool: pool.len(),
        target: o.target,
        k: st.k,
        slack: planning::default_slack(o.target),
        memory_bytes: crate::cluster::machine_memory(),
    };
    let (input, plan) = planning::plan_widening(&input, o.planner)?;
    let problem = planning::problem(&input)?;
    let target = &plan.steps[0].placement;
    let ops = pliant_placement::moves(&problem, problem.current.as_ref(), target);
    Ok(ScalePlan {
        steps: planning::steps(&ops)?,
        target: target
            .copies
            .iter()
            .map(|c| c.iter().map(|&j| pool[j]).collect())
            .collect(),
        new_hosts,
        pool,
        bytes_moved: plan.bytes_moved,
        status: format!("{:?}", plan.status),
        solve_time: plan.solve_time,
        parallel: o.parallel,
    })
}

/// A plan to `target` (pool indices), decided elsewhere (the offline planner's step). `pool[j]` is
/// the host id of pool index `j`, `None` when no host is that index now: a host is created for
/// each such index the target uses. The moves are `problem`'s copy-before-drop order from the
/// cluster's current placement.
pub fn plan_to(
    kv: &Kv,
    problem: &pliant_placement::Problem,
    pool: &[Option<u32>],
    target: &pliant_placement::Placement,
) -> Result<ScalePlan, String> {
    let st = &kv.state;
    let mut ids: Vec<u32> = Vec::with_capacity(pool.len());
    let mut new_hosts = Vec::new();
    for (j, h) in pool.iter().enumerate() {
        match h {
            Some(id) => ids.push(*id),
            None if target.copies.iter().any(|c| c.contains(&j)) => {
                let id = st.next_host + new_hosts.len() as u32;
                new_hosts.push(id);
                ids.push(id);
            }
            // Never named by a step: neither the current placement nor the target uses it.
            None => ids.push(u32::MAX),
        }
    }
    let index = |id: u32| {
        pool.iter()
            .position(|&h| h == Some(id))
            .ok_or_else(|| format!("host {id} holds copies but is not in the plan's pool"))
    };
    let current = st
        .placement()
        .iter()
        .map(|c| c.iter().map(|&h| index(h)).collect::<Result<Vec<_>, _>>())
        .collect::<Result<Vec<_>, _>>()?;
    let current = pliant_placement::Placement::new(current);
    let ops = pliant_placement::moves(problem, Some(&current), target);
    let bytes_moved = ops
        .iter()
        .map(|o| match o {
            pliant_placement::Op::Copy { bytes, .. } => *bytes,
            pliant_placement::Op::Drop { .. } => 0,
        })
        .sum();
    Ok(ScalePlan {
        steps: planning::steps(&ops)?,
        target: target
            .copies
            .iter()
            .map(|c| c.iter().map(|&j| ids[j]).collect())
            .collect(),
        new_hosts,
        pool: ids,
        bytes_moved,
        status: "Offline".into(),
        solve_time: Duration::ZERO,
        parallel: moves::PARALLEL,
    })
}

/// Plans and executes; `progress` gets one line per move.
pub fn scale(
    kv: &mut Kv,
    o: &ScaleOpts,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<MoveReport>, String> {
    let p = plan(kv, o)?;
    progress(&format!("plan: {}", p.summary()));
    execute(kv, &p, progress)
}

pub fn execute(
    kv: &mut Kv,
    p: &ScalePlan,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<MoveReport>, String> {
    for &id in &p.new_hosts {
        let (rec, err) = match host::add_host(&kv.state, id) {
            Ok(r) => (r, None),
            Err((r, e)) => (r, Some(e)),
        };
        kv.state.hosts.push(rec);
        kv.state.next_host = kv.state.next_host.max(id + 1);
        kv.state.save()?;
        if let Some(e) = err {
            return Err(e);
        }
    }
    // One partition's steps in plan order, on one worker; partitions on up to `parallel` at once.
    let mut groups: Vec<Vec<(usize, Step)>> = Vec::new();
    for (i, s) in p.steps.iter().enumerate() {
        match groups.iter_mut().find(|g| g[0].1.partition == s.partition) {
            Some(g) => g.push((i, *s)),
            None => groups.push(vec![(i, *s)]),
        }
    }
    let workers = p.parallel.clamp(1, groups.len().max(1));
    let queue = Mutex::new(groups.into_iter().collect::<VecDeque<_>>());
    let failed = AtomicBool::new(false);
    let total = p.steps.len();
    let k = kv.state.k;
    let sh = moves::Shared::new(kv);
    let (mut done, mut errors) = (Vec::new(), Vec::new());
    std::thread::scope(|scope| {
        let (tx, rx) = mpsc::channel::<Result<MoveReport, String>>();
        for _ in 0..workers {
            let (tx, sh, queue, failed) = (tx.clone(), &sh, &queue, &failed);
            scope.spawn(move || {
                // After a failure no new partition starts; moves under way finish.
                while !failed.load(Ordering::Relaxed) {
                    let Some(group) = queue.lock().unwrap_or_else(|e| e.into_inner()).pop_front()
                    else {
                        break;
                    };
                    for (i, s) in group {
                        let r =
                            moves::execute(sh, s, s.from.map(|f| p.host_of(f)), p.host_of(s.to))
                                .map_err(|e| {
                                    format!("move {}/{total} ({}): {e}", i + 1, p.describe(&s))
                                });
                        let bad = r.is_err();
                        failed.fetch_or(bad, Ordering::Relaxed);
                        let _ = tx.send(r);
                        if bad {
                            // The partition's later steps need this one.
                            break;
                        }
                    }
                }
            });
        }
        drop(tx);
        for r in rx {
            match r {
                Ok(r) => {
                    // The record must show every partition with k+1 copies after every move.
                    let counts: Vec<usize> =
                        sh.with(|kv| kv.state.placement().iter().map(Vec::len).collect());
                    let low = invariant::below_k_plus_one(&counts, k);
                    assert!(
                        low.is_empty(),
                        "after move {}: partitions below k+1 copies: {low:?}",
                        done.len() + 1
                    );
                    progress(&format!(
                        "move {}/{total}: {}{} in {:.2} s ({})",
                        done.len() + 1,
                        p.describe(&r.step),
                        if r.was_master {
                            " (master: coordinated failover)"
                        } else {
                            ""
                        },
                        r.took.as_secs_f64(),
                        r.phases_line()
                    ));
                    for n in &r.notes {
                        progress(&format!("  {n}"));
                    }
                    done.push(r);
                }
                Err(e) => {
                    progress(&format!("failed: {e}"));
                    errors.push(e);
                }
            }
        }
    });
    drop(sh);
    if !errors.is_empty() {
        return Err(errors.join("; "));
    }
    let removed = moves::remove_empty_hosts(kv)?;
    if !removed.is_empty() {
        progress(&format!("removed empty hosts {removed:?}"));
    }
    Ok(done)
}
