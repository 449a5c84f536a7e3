//! The peer people use to grow and shrink a Redis Cluster: hosts added and removed, slots moved by
//! `redis-cli --cluster rebalance` (`MIGRATE`, key by key). For benchmarks only: it drives the
//! same lab cluster (hosts in namespaces with CPU quotas, state.json) as pliant does.
//!
//! - **Out**, per new host: a host, an empty master on it and its replica on the host created just
//!   before it (distinct hosts, `k = 1`), both met by every node; then `rebalance
//!   --cluster-use-empty-masters` moves slots onto the new masters, each weighted as a whole
//!   host's masters ([`weights`]).
//! - **In**: the newest hosts go first (the hosts `up` made are never removed); `rebalance
//!   --cluster-weight <master>=0` empties their masters; then the masters and their replicas are
//!   forgotten by every node and stopped, and the emptied hosts removed.
//!
//! Data moved is counted as pliant's is: bytes arriving on a host that did not hold them. A key
//! whose slot changes owner arrives on the new master and, by replication, on its `k` replicas;
//! the keys are counted with `CLUSTER COUNTKEYSINSLOT` on every slot's owner when the scale
//! begins (the rebalance also moves keys written to a slot while it waits its turn: not counted).

use crate::autoscale::Scaled;
use crate::cluster::Kv;
use crate::host;
use crate::loadgen;
use crate::moves;
use crate::node::{self, wait_for};
use crate::state::NodeRec;
use std::process::Command;
use std::time::Duration;

const REBALANCE_TIMEOUT: Duration = Duration::from_secs(600);
const AGREE_TIMEOUT: Duration = Duration::from_secs(60);

/// What a peer scale did, beyond [`Scaled`]; `error` when the rebalance failed after its retry
/// (the slots it moved before are counted all the same).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeerScaled {
    pub scaled: Scaled,
    pub keys_moved: u64,
    pub slots_moved: u64,
    pub error: Option<String>,
}

/// `Moving N slots from A to B` lines of `redis-cli --cluster rebalance`: (migrations, slots).
pub fn parse_rebalance(out: &str) -> (u64, u64) {
    out.lines()
        .filter_map(|l| {
            let rest = l.trim().strip_prefix("Moving ")?;
            let n: u64 = rest.split_whitespace().next()?.parse().ok()?;
            rest.contains(" slots from ").then_some(n)
        })
        .fold((0, 0), |(m, s), n| (m + 1, s + n))
}

fn addr(kv: &Kv, n: &NodeRec) -> String {
    format!("{}:{}", kv.state.host_ip(n.host), n.port)
}

/// Runs `redis-cli --cluster <sub>` (rebalance, fix) against a node of the cluster (password
/// from the environment, never the command line); returns its output. The calling thread is in
/// the fabric namespace, and so is the child.
fn cluster_cmd(kv: &Kv, sub: &str, extra: &[String]) -> Result<String, String> {
    let first = kv.state.nodes.first().ok_or("no nodes")?;
    let mut cmd = Command::new("redis-cli");
    cmd.env("REDISCLI_AUTH", kv.password())
        .args(["--cluster", sub, &addr(kv, first)])
        .args(extra)
        .args(["--cluster-yes", "--cluster-pipeline", "100"]);
    let out = pliant_lab::cmd::run_command(cmd, REBALANCE_TIMEOUT).map_err(|e| e.to_string())?;
    let (text, err) = (out.stdout, out.stderr);
    let bad = text.contains("[ERR]") || err.contains("[ERR]");
    if out.code != Some(0) || bad {
        let status = out.code.map_or("a signal".into(), |c| format!("exit {c}"));
        let all = text + &err;
        let tail: String = all
            .lines()
            .filter(|l| l.contains("[ERR]") || l.contains("[WARNING]") || l.contains("***"))
            .take(6)
            .collect::<Vec<_>>()
            .join(" | ");
        return Err(format!("redis-cli {sub} failed ({status}): {tail}"));
    }
    Ok(text)
}

/// Slot owners as one node sees them.
fn owners(kv: &Kv) -> Result<Vec<Option<String>>, String> {
    let first = kv.state.nodes.first().ok_or("no nodes")?;
    let view = node::cluster_nodes(&mut kv.connect(first)?)?;
    Ok(loadgen::slot_owners(&view))
}

/// Keys per slot, counted on each slot's owner (one pipeline per owner).
fn slot_keys(kv: &Kv, owners: &[Option<String>]) -> Result<Vec<u64>, String> {
    let mut keys = vec![0u64; owners.len()];
    for n in &kv.state.nodes {
        let mine: Vec<usize> = (0..owners.len())
            .filter(|&s| owners[s].as_deref() == Some(n.id.as_str()))
            .collect();
        if mine.is_empty() {
            continue;
        }
        let mut pipe = redis::pipe();
        for &s in &mine {
            pipe.cmd("CLUSTER").arg("COUNTKEYSINSLOT").arg(s);
        }
        let counts: Vec<u64> = pipe
            .query(&mut kv.connect(n)?)
            .map_err(|e| format!("COUNTKEYSINSLOT on {}: {e}", addr(kv, n)))?;
        for (&s, c) in mine.iter().zip(counts) {
            keys[s] = c;
        }
    }
    Ok(keys)
}

/// Slots whose owner changed, and the keys they held before (`keys[slot]`).
pub fn moved_slots(
    before: &[Option<String>],
    after: &[Option<String>],
    keys: &[u64],
) -> (u64, u64) {
    before
        .iter()
        .zip(after)
        .zip(keys)
        .filter(|((a, b), _)| b.is_some() && a != b)
        .fold((0, 0), |(s, k), (_, &n)| (s + 1, k + n))
}

/// Waits until every node lists every node of the record, every replica of `pairs` under its
/// master, and the same owner for every slot (redis-cli refuses to rebalance a cluster whose
/// nodes disagree).
fn wait_agreed(kv: &Kv, pairs: &[(NodeRec, NodeRec)]) -> Result<(), String> {
    let total = kv.state.nodes.len();
    wait_for(
        "every node to agree on nodes and slots",
        AGREE_TIMEOUT,
        || {
            let mut first: Option<Vec<Option<String>>> = None;
            for n in &kv.state.nodes {
                let view = node::cluster_nodes(&mut kv.connect(n)?)?;
                let linked = view.len() == total
                    && pairs.iter().all(|(m, r)| {
                        view.iter()
                            .any(|l| l.id == r.id && l.master.as_deref() == Some(m.id.as_str()))
                    });
                let owners = loadgen::slot_owners(&view);
                if !linked || first.as_ref().is_some_and(|f| *f != owners) {
                    return Ok(None);
                }
                first.get_or_insert(owners);
            }
            Ok(Some(()))
        },
    )
}

/// Grows or shrinks the peer cluster to `to` hosts (never below the hosts `up` made: `initial`);
/// `bytes_per_key` turns the keys moved into bytes.
pub fn scale(
    kv: &mut Kv,
    to: usize,
    initial: usize,
    bytes_per_key: u64,
    progress: &mut dyn FnMut(&str),
) -> Result<PeerScaled, String> {
    let now = kv.state.hosts.len();
    let before = owners(kv)?;
    // Keys are counted when the scale begins (pliant's moves too): what the rebalance has to move
    // then, not what the load adds while it runs.
    let keys_before = slot_keys(kv, &before)?;
    let mut extra: Vec<String> = Vec::new();
    if to > now {
        let mut pairs = Vec::new();
        for _ in now..to {
            let id = kv.state.next_host;
            let prev = kv
                .state
                .hosts
                .iter()
                .map(|h| h.id)
                .max()
                .ok_or("no hosts")?;
            let (rec, err) = match host::add_host(&kv.state, id) {
                Ok(r) => (r, None),
                Err((r, e)) => (r, Some(e)),
            };
            kv.state.hosts.push(rec.clone());
            kv.state.next_host = id + 1;
            kv.state.save()?;
            if let Some(e) = err {
                return Err(e);
            }
            // A new slot owner: the next partition index (its port) after every one in use.
            let q = kv
                .state
                .nodes
                .iter()
                .map(|n| n.partition)
                .max()
                .unwrap_or(0)
                + 1;
            let m = node::start(&kv.state, &rec, q, kv.password())?;
            kv.state.nodes.push(m.clone());
            kv.state.save()?;
            let replica_host = kv.state.host(prev).cloned().ok_or("previous host")?;
            let r = node::start(&kv.state, &replica_host, q, kv.password())?;
            kv.state.nodes.push(r.clone());
            kv.state.save()?;
            for new in [&m, &r] {
                let [ip, port, bus] = node::meet_args(&kv.state, new);
                for n in kv.state.nodes.iter().filter(|n| n.id != new.id) {
                    node::query_str(&mut kv.connect(n)?, &["CLUSTER", "MEET", &ip, &port, &bus])?;
                }
            }
            wait_for(
                &format!("replica of {} to replicate", m.id),
                AGREE_TIMEOUT,
                || Ok(node::query_str(&mut kv.connect(&r)?, &["CLUSTER", "REPLICATE", &m.id]).ok()),
            )?;
            progress(&format!(
                "host {id}: empty master {}, its replica on host {prev}",
                addr(kv, &m)
            ));
            pairs.push((m, r));
        }
        wait_agreed(kv, &pairs)?;
        extra.push("--cluster-use-empty-masters".into());
        extra.extend(weights(kv, initial, &[])?);
    } else if to < now {
        let (gone, qs) = leaving(kv, to, initial);
        if gone.is_empty() {
            return Err(format!(
                "the peer keeps the {initial} hosts it started with"
            ));
        }
        wait_agreed(kv, &[])?;
        extra.extend(weights(kv, initial, &qs)?);
    } else {
        return Ok(PeerScaled::default());
    }
    // What an operator does when a rebalance stops half-way (a slot left migrating, as when a
    // node answered CLUSTERDOWN under overload): `--cluster fix`, then the rebalance again, once.
    let mut run = || -> Result<String, String> {
        match cluster_cmd(kv, "rebalance", &extra) {
            Ok(out) => Ok(out),
            Err(e) => {
                progress(&format!(
                    "{e}; redis-cli --cluster fix, then the rebalance once more"
                ));
                cluster_cmd(kv, "fix", &[])?;
                wait_agreed(kv, &[])?;
                cluster_cmd(kv, "rebalance", &extra)
            }
        }
    };
    // A rebalance that fails still moved the slots it got to: they are counted.
    let (out, error) = match run() {
        Ok(out) => (out, None),
        Err(e) => (String::new(), Some(e)),
    };
    let (migrations, _) = parse_rebalance(&out);
    let after = owners(kv)?;
    let (slots, keys) = moved_slots(&before, &after, &keys_before);
    progress(&format!(
        "rebalance: {migrations} migrations, {slots} slots, {keys} keys"
    ));
    if error.is_none() && to < now {
        drop_emptied(kv, to, initial, &after, progress)?;
    }
    Ok(PeerScaled {
        scaled: Scaled {
            moves: migrations as usize,
            bytes_moved: keys * bytes_per_key * (kv.state.k as u64 + 1),
        },
        keys_moved: keys,
        slots_moved: slots,
        error,
    })
}

/// `--cluster-weight` for the masters the peer added: one such master per host, so each weighs as
/// much as the masters of one of the `initial` hosts (`partitions / initial`) and a new host takes
/// its share of the slots (weight 1, the default, would give it one master's); 0 for those of
/// `leaving` (their slots go to the others). redis-cli keeps no weights between runs.
fn weights(kv: &Kv, initial: usize, leaving: &[usize]) -> Result<Vec<String>, String> {
    let w = kv.state.partitions as f64 / initial.max(1) as f64;
    let mut out = vec!["--cluster-weight".to_string()];
    for n in kv
        .state
        .nodes
        .iter()
        .filter(|n| n.partition >= kv.state.partitions)
    {
        let role = node::info(&mut kv.connect(n)?, "replication")?;
        if role.get("role").map(String::as_str) != Some("master") {
            continue;
        }
        let w = if leaving.contains(&n.partition) {
            0.0
        } else {
            w
        };
        out.push(format!("{}={w}", n.id));
    }
    Ok(out)
}

/// The hosts a scale in to `to` removes (the newest, never the first `initial`), and the slot
/// owners (partition indices) with a copy on them.
fn leaving(kv: &Kv, to: usize, initial: usize) -> (Vec<u32>, Vec<usize>) {
    let mut ids: Vec<u32> = kv.state.hosts.iter().map(|h| h.id).collect();
    ids.sort_unstable();
    let gone: Vec<u32> = ids[to.max(initial).min(ids.len())..].to_vec();
    let qs = kv
        .state
        .nodes
        .iter()
        .filter(|n| gone.contains(&n.host))
        .map(|n| n.partition)
        .collect();
    (gone, qs)
}

/// After the rebalance: forgets and stops the masters (and their replicas) of the hosts beyond the
/// newest `to` (they must own no slot), then removes the emptied hosts.
fn drop_emptied(
    kv: &mut Kv,
    to: usize,
    initial: usize,
    owners_now: &[Option<String>],
    progress: &mut dyn FnMut(&str),
) -> Result<(), String> {
    let (_, qs) = leaving(kv, to, initial);
    let doomed: Vec<NodeRec> = kv
        .state
        .nodes
        .iter()
        .filter(|n| qs.contains(&n.partition))
        .cloned()
        .collect();
    for n in &doomed {
        if owners_now
            .iter()
            .any(|o| o.as_deref() == Some(n.id.as_str()))
        {
            return Err(format!(
                "{} still owns slots after the rebalance",
                addr(kv, n)
            ));
        }
    }
    // Replicas first: a replica refuses to forget its own master.
    let mut order = doomed.clone();
    order.sort_by_key(|n| {
        let role = kv
            .connect(n)
            .and_then(|mut c| node::info(&mut c, "replication"))
            .ok()
            .and_then(|i| i.get("role").cloned());
        role.as_deref() == Some("master")
    });
    for n in &order {
        moves::forget_and_stop(kv, &kv.state.nodes, n)?;
        kv.state.nodes.retain(|x| x.id != n.id);
        kv.state.save()?;
    }
    let removed = moves::remove_empty_hosts(kv)?;
    progress(&format!("removed hosts {removed:?}"));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rebalance_output_counts_migrations_and_slots() {
        let out = ">>> Performing Cluster Check (using node 10.0.0.1:7000)\n\
                   [OK] All 16384 slots covered.\n\
                   >>> Rebalancing across 3 nodes. Total weight = 3.00\n\
                   Moving 1366 slots from 10.0.0.1:7000 to 10.0.0.3:7008\n\
                   ####################\n\
                   Moving 1365 slots from 10.0.0.2:7001 to 10.0.0.3:7008\n\
                   ####\n";
        assert_eq!(parse_rebalance(out), (2, 2731));
        assert_eq!(parse_rebalance("*** No rebalancing needed!"), (0, 0));
    }

    #[test]
    fn moved_slots_count_the_keys_they_held() {
        let a = |s: &str| Some(s.to_string());
        let before = [a("x"), a("x"), a("y"), None];
        let after = [a("x"), a("z"), a("z"), a("z")];
        assert_eq!(moved_slots(&before, &after, &[5, 7, 11, 13]), (3, 31));
        assert_eq!(moved_slots(&before, &before, &[5, 7, 11, 13]), (0, 0));
    }
}
