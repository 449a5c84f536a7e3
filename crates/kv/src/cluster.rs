//! A cluster's life: `up` (hosts, servers, the Redis Cluster with fixed slot ranges), opening
//! an existing one from its state file, the live view of its copies, and `down`.

use crate::host;
use crate::node::{self, wait_for};
use crate::planning::{self, Input, Planner};
use crate::slots;
use crate::state::{KvState, NodeRec, PASSWORD_FILE};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// How long the cluster may take to agree on its members, slots and replicas.
const FORM_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Clone, Debug)]
pub struct UpOpts {
    pub hosts: usize,
    pub partitions: usize,
    pub k: usize,
    pub cpu_quota_pct: u32,
    pub dir: PathBuf,
    pub planner: Planner,
}

/// A running cluster: its state and password. Methods that talk to Redis need the calling
/// thread in the fabric namespace: `up` and `open` move it there.
pub struct Kv {
    pub state: KvState,
    pub(crate) password: String,
}

/// Checks `up`'s options; errors name the numbers that conflict.
pub fn validate(o: &UpOpts) -> Result<(), String> {
    if o.hosts == 0 || o.hosts > 200 {
        return Err(format!("--hosts {}: need 1..=200", o.hosts));
    }
    if o.partitions == 0 || o.partitions > 1000 {
        return Err(format!("--partitions {}: need 1..=1000", o.partitions));
    }
    crate::invariant::k_fits(o.k, o.hosts, "--hosts")?;
    if !(1..=10_000).contains(&o.cpu_quota_pct) {
        return Err(format!(
            "--cpu-quota-pct {}: need 1..=10000",
            o.cpu_quota_pct
        ));
    }
    Ok(())
}

fn random_tag() -> Result<String, String> {
    let b: [u8; 3] = pliant_pg::secrets::random_bytes().map_err(|e| e.to_string())?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// Memory of the machine, the planner's per-host memory (hosts share it).
pub(crate) fn machine_memory() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(1 << 30, |kb| kb * 1024)
}

impl Kv {
    /// Creates everything; on failure removes what it created.
    pub fn up(o: &UpOpts) -> Result<Kv, String> {
        validate(o)?;
        if o.dir.join(crate::state::STATE_FILE).exists() {
            return Err(format!(
                "{} already holds a cluster (pliant kv down --dir {})",
                o.dir.display(),
                o.dir.display()
            ));
        }
        // The initial placement first: a bad request fails before anything is created.
        let (_, plan) = planning::plan_widening(
            &Input {
                loads: vec![0.0; o.partitions],
                bytes: vec![1; o.partitions],
                current: None,
                pool: o.hosts,
                target: o.hosts,
                k: o.k,
                slack: planning::default_slack(o.hosts),
                memory_bytes: machine_memory(),
            },
            o.planner,
        )?;
        let placement = plan.steps[0].placement.copies.clone();
        std::fs::create_dir_all(&o.dir).map_err(|e| format!("{}: {e}", o.dir.display()))?;
        let dir = o.dir.canonicalize().map_err(|e| e.to_string())?;
        let tag = random_tag()?;
        let subnet = u8::from_str_radix(&tag[..2], 16).unwrap_or(1).clamp(1, 254);
        let password = random_tag()? + &random_tag()? + &random_tag()? + &random_tag()?;
        pliant_pg::secrets::write_private(&dir.join(PASSWORD_FILE), password.as_bytes())?;
        let state = KvState {
            fabric_ns: format!("kv{tag}-f"),
            bridge: format!("kv{tag}br"),
            tag,
            dir,
            subnet,
            partitions: o.partitions,
            k: o.k,
            cpu_quota_pct: o.cpu_quota_pct,
            hosts: Vec::new(),
            nodes: Vec::new(),
            next_host: o.hosts as u32,
        };
        let mut kv = Kv { state, password };
        kv.state.save()?;
        match kv.build(o.hosts, &placement) {
            Ok(()) => Ok(kv),
            Err(e) => {
                let left = kv.teardown();
                Err(if left.is_empty() {
                    e
                } else {
                    format!("{e}; cleanup left: {}", left.join("; "))
                })
            }
        }
    }

    fn build(&mut self, hosts: usize, placement: &[Vec<usize>]) -> Result<(), String> {
        host::create_fabric(&self.state)?;
        host::enter(&self.state.fabric_ns)?;
        for id in 0..hosts as u32 {
            let r = host::add_host(&self.state, id);
            let (rec, err) = match r {
                Ok(rec) => (rec, None),
                Err((rec, e)) => (rec, Some(e)),
            };
            self.state.hosts.push(rec);
            self.state.save()?;
            if let Some(e) = err {
                return Err(e);
            }
        }
        let masters = planning::spread_masters(placement, hosts);
        for (p, copies) in placement.iter().enumerate() {
            // The master first, so its record is the partition's first.
            let mut order = vec![masters[p]];
            order.extend(copies.iter().copied().filter(|&h| h != masters[p]));
            for h in order {
                let host = self.state.hosts[h].clone();
                let n = node::start(&self.state, &host, p, &self.password)?;
                self.state.nodes.push(n);
                self.state.save()?;
            }
        }
        self.form(&masters)
    }

    /// MEET, slots to masters, REPLICATE, then waits until every replica is linked and the
    /// cluster reports ok everywhere.
    fn form(&self, masters: &[usize]) -> Result<(), String> {
        let st = &self.state;
        let first = &st.nodes[0];
        let [ip, port, bus] = node::meet_args(st, first);
        for n in &st.nodes[1..] {
            let mut c = node::connect(st, n, &self.password)?;
            node::query_str(&mut c, &["CLUSTER", "MEET", &ip, &port, &bus])?;
        }
        let total = st.nodes.len();
        for n in &st.nodes {
            wait_for(
                &format!("node {}:{} to see {total} nodes", n.host, n.port),
                FORM_TIMEOUT,
                || {
                    let mut c = node::connect(st, n, &self.password)?;
                    Ok((node::cluster_nodes(&mut c)?.len() == total).then_some(()))
                },
            )?;
        }
        for (p, &m) in masters.iter().enumerate() {
            let master = self.master_rec(p, m as u32)?;
            let (a, b) = slots::range(p, st.partitions);
            let mut c = node::connect(st, master, &self.password)?;
            node::query_str(
                &mut c,
                &["CLUSTER", "ADDSLOTSRANGE", &a.to_string(), &b.to_string()],
            )?;
        }
        for (p, &m) in masters.iter().enumerate() {
            let master = self.master_rec(p, m as u32)?.clone();
            for r in st.copies(p).filter(|n| n.id != master.id) {
                let mut c = node::connect(st, r, &self.password)?;
                node::query_str(&mut c, &["CLUSTER", "REPLICATE", &master.id])?;
            }
        }
        for n in &st.nodes {
            wait_for(
                &format!("node {}:{} linked and cluster ok", n.host, n.port),
                FORM_TIMEOUT,
                || {
                    let mut c = node::connect(st, n, &self.password)?;
                    let state = node::query_str(&mut c, &["CLUSTER", "INFO"])?;
                    let ok = state.contains("cluster_state:ok");
                    let i = node::info(&mut c, "replication")?;
                    let linked = i.get("role").map(String::as_str) == Some("master")
                        || i.get("master_link_status").map(String::as_str) == Some("up");
                    Ok((ok && linked).then_some(()))
                },
            )?;
        }
        Ok(())
    }

    fn master_rec(&self, p: usize, host: u32) -> Result<&NodeRec, String> {
        self.state
            .copies(p)
            .find(|n| n.host == host)
            .ok_or_else(|| format!("partition {p}: no copy on host {host}"))
    }

    /// Opens the cluster in `dir` and moves the calling thread into its fabric namespace.
    pub fn open(dir: &Path) -> Result<Kv, String> {
        let state = KvState::load(dir)?;
        let pw = state.dir.join(PASSWORD_FILE);
        let password = std::fs::read_to_string(&pw)
            .map_err(|e| format!("{}: {e}", pw.display()))?
            .trim()
            .to_string();
        host::enter(&state.fabric_ns)?;
        Ok(Kv { state, password })
    }

    pub fn connect(&self, n: &NodeRec) -> Result<redis::Connection, String> {
        node::connect(&self.state, n, &self.password)
    }

    /// Addresses (`redis://` URLs without credentials) of every node, for a cluster client.
    pub fn seed_urls(&self) -> Vec<String> {
        self.state.seed_urls()
    }

    pub fn password(&self) -> &str {
        &self.password
    }

    /// The live master of partition `p` (the copy whose INFO says `role:master`).
    pub fn master_of(&self, p: usize) -> Result<NodeRec, String> {
        for n in self.state.copies(p) {
            if let Ok(mut c) = self.connect(n) {
                if node::info(&mut c, "replication")?
                    .get("role")
                    .map(String::as_str)
                    == Some("master")
                {
                    return Ok(n.clone());
                }
            }
        }
        Err(format!("partition {p}: no copy reports role:master"))
    }

    /// Stops every process it started (by PID), removes hosts, cgroups, the fabric and the
    /// state directory's files. Returns what could not be removed.
    pub fn teardown(&self) -> Vec<String> {
        teardown(&self.state)
    }
}

/// `down` from a state record alone (no connection needed).
/// Removes the cluster in a directory (processes by PID, namespaces, cgroups, files) when
/// dropped: tests and benchmarks hold one so a failure leaves nothing behind.
pub struct DownOnDrop(pub std::path::PathBuf);

impl Drop for DownOnDrop {
    fn drop(&mut self) {
        if let Ok(st) = KvState::load(&self.0) {
            let left = teardown(&st);
            if !left.is_empty() {
                eprintln!("cleanup left: {left:?}");
            }
        }
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn teardown(st: &KvState) -> Vec<String> {
    for n in &st.nodes {
        node::stop(st, n);
    }
    let mut problems = Vec::new();
    for h in &st.hosts {
        problems.extend(host::remove_host(st, h));
    }
    problems.extend(host::remove_fabric(st));
    for h in &st.hosts {
        let _ = std::fs::remove_dir_all(st.dir.join(format!("h{}", h.id)));
    }
    // Hosts created by a scale that failed before it was recorded are still named by the tag.
    for id in 0..st.next_host + 1 {
        let cg = host::cgroup_dir(st, id);
        if cg.exists() && std::fs::remove_dir(&cg).is_err() {
            problems.push(format!("cgroup {} not removed", cg.display()));
        }
    }
    if problems.is_empty() {
        for f in [crate::state::STATE_FILE, PASSWORD_FILE] {
            let _ = std::fs::remove_file(st.dir.join(f));
        }
        let _ = std::fs::remove_dir(&st.dir);
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn up_options_are_checked_with_both_numbers_named() {
        let o = UpOpts {
            hosts: 3,
            partitions: 8,
            k: 3,
            cpu_quota_pct: 50,
            dir: PathBuf::from("/nonexistent"),
            planner: Planner::Greedy,
        };
        let e = validate(&o).unwrap_err();
        assert!(e.contains("k = 3") && e.contains("--hosts is 3"), "{e}");
        assert!(validate(&UpOpts { k: 1, ..o.clone() }).is_ok());
        assert!(validate(&UpOpts {
            k: 1,
            partitions: 0,
            ..o.clone()
        })
        .is_err());
        assert!(validate(&UpOpts {
            k: 1,
            cpu_quota_pct: 0,
            ..o
        })
        .is_err());
    }
}
