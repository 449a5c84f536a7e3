//! Moving one copy of a partition without losing data (VoltDB's rejoin, on Redis replication):
//! a new copy joins as a replica of the partition's master and catches up; if the copy leaving
//! is the master, a coordinated failover hands mastership to the new copy (writes pause, no
//! acknowledged write is lost); then the old copy is forgotten by every node and stopped. The
//! k+1 rule is checked on live replication state right before the drop.

use crate::cluster::Kv;
use crate::host;
use crate::invariant;
use crate::node::{self, wait_for};
use crate::planning::Step;
use crate::state::NodeRec;
use std::time::{Duration, Instant};

/// How long a new copy may take to join and catch up.
const CATCH_UP_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a coordinated failover may take (it is retried within this).
const FAILOVER_TIMEOUT: Duration = Duration::from_secs(60);
/// One coordinated failover attempt: Redis gives up after twice the node timeout.
const FAILOVER_ATTEMPT: Duration = Duration::from_secs(10);
const GOSSIP_TIMEOUT: Duration = Duration::from_secs(30);

/// What one executed move did.
#[derive(Clone, Debug)]
pub struct MoveReport {
    pub step: Step,
    /// Host ids.
    pub from: Option<u32>,
    pub to: u32,
    pub was_master: bool,
    pub took: Duration,
}

fn role(kv: &Kv, n: &NodeRec) -> Result<std::collections::BTreeMap<String, String>, String> {
    let mut c = kv.connect(n)?;
    node::info(&mut c, "replication")
}

/// Live copies of a partition as its master sees them: itself plus the replicas whose
/// replication link it reports `online` (connected and past the initial sync).
pub fn live_copies(kv: &Kv, master: &NodeRec) -> Result<usize, String> {
    let i = role(kv, master)?;
    if i.get("role").map(String::as_str) != Some("master") {
        return Err(format!(
            "partition {}: {}:{} is not master",
            master.partition, master.host, master.port
        ));
    }
    Ok(1 + crate::parse::online_replicas(&i))
}

/// Waits until `replica` has everything `master` had when the wait began a round: link up and
/// its offset at least the master's offset read just before it.
fn wait_caught_up(kv: &Kv, master: &NodeRec, replica: &NodeRec) -> Result<(), String> {
    wait_for(
        &format!(
            "partition {} copy on host {} to catch up",
            replica.partition, replica.host
        ),
        CATCH_UP_TIMEOUT,
        || {
            let m = role(kv, master)?;
            let target = crate::parse::info_u64(&m, "master_repl_offset").unwrap_or(u64::MAX);
            let r = role(kv, replica)?;
            let up = r.get("master_link_status").map(String::as_str) == Some("up");
            let at = crate::parse::info_u64(&r, "slave_repl_offset").unwrap_or(0);
            Ok((up && at >= target).then_some(()))
        },
    )
}

/// Executes one step: copy to `to`, then (if it moves a copy off a host) drop the copy on
/// `from`. `to` and `from` are host ids.
pub fn execute(kv: &mut Kv, step: Step, from: Option<u32>, to: u32) -> Result<MoveReport, String> {
    let t0 = Instant::now();
    let p = step.partition;
    let st = &kv.state;
    if st.copies(p).any(|n| n.host == to) {
        return Err(format!("partition {p} already has a copy on host {to}"));
    }
    let host = st
        .host(to)
        .ok_or_else(|| format!("host {to} does not exist"))?
        .clone();
    let master = kv.master_of(p)?;

    // 1. The new copy: started, introduced to the cluster, made a replica of the master.
    let new = node::start(&kv.state, &host, p, &kv.password)?;
    kv.state.nodes.push(new.clone());
    kv.state.save()?;
    // Every node meets the new one directly rather than waiting for gossip to spread it.
    let [ip, port, bus] = node::meet_args(&kv.state, &new);
    for n in kv.state.nodes.iter().filter(|n| n.id != new.id) {
        node::query_str(&mut kv.connect(n)?, &["CLUSTER", "MEET", &ip, &port, &bus])?;
    }
    wait_for(
        &format!("partition {p}: new copy on host {to} to know its master"),
        GOSSIP_TIMEOUT,
        || {
            let known = node::cluster_nodes(&mut kv.connect(&new)?)?;
            Ok(known.iter().any(|n| n.id == master.id).then_some(()))
        },
    )?;
    wait_for(
        &format!("partition {p}: new copy on host {to} to replicate"),
        GOSSIP_TIMEOUT,
        || {
            Ok(node::query_str(
                &mut kv.connect(&new)?,
                &["CLUSTER", "REPLICATE", &master.id],
            )
            .ok())
        },
    )?;
    wait_caught_up(kv, &master, &new)?;
    // Every node must know the new copy as the master's replica before a failover to it: the
    // masters' votes elect it, and a master that has not heard of it yet does not vote.
    for n in kv.state.nodes.iter().filter(|n| n.id != new.id) {
        wait_for(
            &format!(
                "node {}:{} to learn of the new copy of partition {p}",
                n.host, n.port
            ),
            GOSSIP_TIMEOUT,
            || {
                let known = node::cluster_nodes(&mut kv.connect(n)?)?;
                Ok(known
                    .iter()
                    .any(|l| l.id == new.id && l.master.as_deref() == Some(master.id.as_str()))
                    .then_some(()))
            },
        )?;
    }

    let Some(from) = from else {
        return Ok(MoveReport {
            step,
            from: None,
            to,
            was_master: false,
            took: t0.elapsed(),
        });
    };
    let old = kv
        .state
        .copies(p)
        .find(|n| n.host == from)
        .cloned()
        .ok_or_else(|| format!("partition {p} has no copy on host {from}"))?;

    // 2. Mastership, if it is leaving: a coordinated failover to the new, caught-up copy.
    let was_master = old.id == master.id;
    let master = if was_master {
        failover(kv, &new)?;
        new.clone()
    } else {
        master
    };

    // 3. The k+1 rule on live state, then the drop. A master marks a replica `online` only at its
    // first acknowledgement after the sync (sent once a second), which can trail the replica's
    // own `link up`: wait a bounded time for the count, then check it.
    let k = kv.state.k;
    let live = wait_for(
        &format!("partition {p}: {} live copies before the drop", k + 2),
        CATCH_UP_TIMEOUT,
        || {
            let live = live_copies(kv, &master)?;
            Ok((live > k + 1).then_some(live))
        },
    )
    .or_else(|_| live_copies(kv, &master))?;
    invariant::may_drop(p, live, k)?;
    forget_everywhere(kv, &old)?;
    node::stop(&kv.state, &old);
    kv.state.nodes.retain(|n| n.id != old.id);
    kv.state.save()?;
    let _ = std::fs::remove_dir_all(kv.state.node_dir(old.host, p));
    Ok(MoveReport {
        step,
        from: Some(from),
        to,
        was_master,
        took: t0.elapsed(),
    })
}

/// `CLUSTER FAILOVER` (coordinated: the master stops writes until the replica has its offset)
/// on `new`, until `new` is master and `old` and every other copy replicate from it.
fn failover(kv: &Kv, new: &NodeRec) -> Result<(), String> {
    let p = new.partition;
    wait_for(
        &format!("partition {p}: failover to host {}", new.host),
        FAILOVER_TIMEOUT,
        || {
            node::query_str(&mut kv.connect(new)?, &["CLUSTER", "FAILOVER"])?;
            let attempt = Instant::now();
            while attempt.elapsed() < FAILOVER_ATTEMPT {
                if role(kv, new)?.get("role").map(String::as_str) == Some("master") {
                    return Ok(Some(()));
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            Ok(None)
        },
    )?;
    // Every node must see the new master own the partition's slots before the old copy is
    // forgotten: a node that forgets the slots' owner in its view leaves them unassigned there,
    // and a client refreshing its slot map from that node would lose the partition (redis-rs's
    // sync client then kept retrying the removed address).
    let (first, _) = crate::slots::range(p, kv.state.partitions);
    for n in &kv.state.nodes {
        wait_for(
            &format!(
                "node {}:{} to see host {} own partition {p}",
                n.host, n.port, new.host
            ),
            GOSSIP_TIMEOUT,
            || {
                let view = node::cluster_nodes(&mut kv.connect(n)?)?;
                Ok(view
                    .iter()
                    .any(|l| {
                        l.id == new.id
                            && l.is_master()
                            && l.slots.iter().any(|&(a, b)| (a..=b).contains(&first))
                    })
                    .then_some(()))
            },
        )?;
    }
    let new_ip = kv.state.host_ip(new.host).to_string();
    for n in kv.state.copies(p).filter(|n| n.id != new.id) {
        wait_for(
            &format!(
                "partition {p}: copy on host {} to follow the new master",
                n.host
            ),
            GOSSIP_TIMEOUT,
            || {
                let i = role(kv, n)?;
                Ok((i.get("master_host") == Some(&new_ip)
                    && i.get("master_link_status").map(String::as_str) == Some("up"))
                .then_some(()))
            },
        )?;
    }
    Ok(())
}

/// `CLUSTER FORGET` of `old` on every other node (each keeps it banned for a minute, long enough
/// for the stop that follows); a replica refuses to forget its own master, so that is retried
/// until gossip has moved it to the new one.
pub(crate) fn forget_everywhere(kv: &Kv, old: &NodeRec) -> Result<(), String> {
    for n in kv.state.nodes.iter().filter(|n| n.id != old.id) {
        wait_for(
            &format!("node {}:{} to forget {}", n.host, n.port, old.id),
            GOSSIP_TIMEOUT,
            || match node::query_str(&mut kv.connect(n)?, &["CLUSTER", "FORGET", &old.id]) {
                Ok(_) => Ok(Some(())),
                Err(e) if e.contains("Unknown node") => Ok(Some(())),
                Err(e) => Err(e),
            },
        )?;
    }
    Ok(())
}

/// Removes hosts that hold no copy any more (after a scale-in).
pub fn remove_empty_hosts(kv: &mut Kv) -> Result<Vec<u32>, String> {
    let empty: Vec<_> = kv
        .state
        .hosts
        .iter()
        .filter(|h| !kv.state.nodes.iter().any(|n| n.host == h.id))
        .cloned()
        .collect();
    for h in &empty {
        let problems = host::remove_host(&kv.state, h);
        if !problems.is_empty() {
            return Err(problems.join("; "));
        }
        kv.state.hosts.retain(|x| x.id != h.id);
        kv.state.save()?;
        let _ = std::fs::remove_dir_all(kv.state.dir.join(format!("h{}", h.id)));
    }
    Ok(empty.iter().map(|h| h.id).collect())
}
