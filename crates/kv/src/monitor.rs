//! Measurements: per partition ops/s (data commands in `INFO commandstats`), CPU of its
//! redis-servers (`/proc/PID/stat`), memory; per host CPU against its quota. `Monitor` samples on
//! a thread every interval (the autoscaler and benchmarks read `latest()`); `measure` takes one
//! reading over a window for one-shot commands. Both read `state.json` at every sample, so they
//! follow hosts and copies as a scale changes them.

use crate::host;
use crate::node;
use crate::parse;
use crate::slots;
use crate::state::{KvState, PASSWORD_FILE};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

#[derive(Clone, Debug, Serialize)]
pub struct PartitionStat {
    pub partition: usize,
    pub slots: (u16, u16),
    /// Host of the copy reporting `role:master`; `None` if none answered.
    pub master_host: Option<u32>,
    pub replica_hosts: Vec<u32>,
    /// Data commands per second executed by the master.
    pub ops_per_s: f64,
    /// CPU of the master's redis-server, cores.
    pub master_cpu: f64,
    /// CPU of all its redis-servers together, cores.
    pub cpu: f64,
    pub used_memory: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct HostStat {
    pub host: u32,
    /// CPU of the host's redis-servers, cores.
    pub cpu: f64,
    pub quota_cores: f64,
    /// `cpu / quota_cores`.
    pub utilisation: f64,
    pub partitions: Vec<usize>,
    pub masters: Vec<usize>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Snapshot {
    pub interval_s: f64,
    pub partitions: Vec<PartitionStat>,
    pub hosts: Vec<HostStat>,
}

/// One node read at one instant.
#[derive(Clone, Debug)]
struct NodeRead {
    partition: usize,
    host: u32,
    master: bool,
    calls: u64,
    used_memory: u64,
    cpu_ticks: u64,
}

#[derive(Clone, Debug)]
struct Reading {
    at: Instant,
    /// By node id.
    nodes: BTreeMap<String, NodeRead>,
}

/// utime + stime of a process, clock ticks.
fn cpu_ticks(pid: i32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &s[s.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After ')': state is field 3, utime field 14, stime field 15.
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

fn read(st: &KvState, password: &str) -> Reading {
    let at = Instant::now();
    let mut nodes = BTreeMap::new();
    for n in &st.nodes {
        let Ok(mut c) = node::connect(st, n, password) else {
            continue;
        };
        let Ok(text) = node::query_str(&mut c, &["INFO", "everything"]) else {
            continue;
        };
        let i = parse::info(&text);
        nodes.insert(
            n.id.clone(),
            NodeRead {
                partition: n.partition,
                host: n.host,
                master: i.get("role").map(String::as_str) == Some("master"),
                calls: parse::data_calls(&i),
                used_memory: parse::info_u64(&i, "used_memory").unwrap_or(0),
                cpu_ticks: cpu_ticks(n.pid).unwrap_or(0),
            },
        );
    }
    Reading { at, nodes }
}

fn clock_ticks() -> f64 {
    // SAFETY: sysconf reads a constant.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

/// The rates between two readings; nodes present in both count.
fn snapshot(st: &KvState, prev: &Reading, cur: &Reading) -> Snapshot {
    let dt = cur.at.duration_since(prev.at).as_secs_f64().max(1e-3);
    let tck = clock_ticks();
    let rate = |id: &str, f: fn(&NodeRead) -> u64| -> f64 {
        match (prev.nodes.get(id), cur.nodes.get(id)) {
            (Some(a), Some(b)) => f(b).saturating_sub(f(a)) as f64 / dt,
            _ => 0.0,
        }
    };
    let partitions: Vec<PartitionStat> = (0..st.partitions)
        .map(|p| {
            let mut s = PartitionStat {
                partition: p,
                slots: slots::range(p, st.partitions),
                master_host: None,
                replica_hosts: Vec::new(),
                ops_per_s: 0.0,
                master_cpu: 0.0,
                cpu: 0.0,
                used_memory: 0,
            };
            for (id, r) in cur.nodes.iter().filter(|(_, r)| r.partition == p) {
                let cpu = rate(id, |r| r.cpu_ticks) / tck;
                s.cpu += cpu;
                if r.master {
                    s.master_host = Some(r.host);
                    s.ops_per_s = rate(id, |r| r.calls);
                    s.master_cpu = cpu;
                    s.used_memory = r.used_memory;
                } else {
                    s.replica_hosts.push(r.host);
                }
            }
            s.replica_hosts.sort_unstable();
            s
        })
        .collect();
    let quota = host::cores(st);
    let hosts = st
        .hosts
        .iter()
        .map(|h| {
            let on: Vec<(&String, &NodeRead)> =
                cur.nodes.iter().filter(|(_, r)| r.host == h.id).collect();
            let cpu: f64 = on
                .iter()
                .map(|(id, _)| rate(id, |r| r.cpu_ticks) / tck)
                .sum();
            HostStat {
                host: h.id,
                cpu,
                quota_cores: quota,
                utilisation: cpu / quota,
                partitions: on.iter().map(|(_, r)| r.partition).collect(),
                masters: on
                    .iter()
                    .filter(|(_, r)| r.master)
                    .map(|(_, r)| r.partition)
                    .collect(),
            }
        })
        .collect();
    Snapshot {
        interval_s: dt,
        partitions,
        hosts,
    }
}

/// One reading over `window` (the calling thread must be in the fabric namespace).
pub fn measure(st: &KvState, password: &str, window: Duration) -> Snapshot {
    let a = read(st, password);
    std::thread::sleep(window);
    let b = read(st, password);
    snapshot(st, &a, &b)
}

/// A sampling thread.
pub struct Monitor {
    stop: Arc<AtomicBool>,
    latest: Arc<Mutex<Option<Snapshot>>>,
    samples: Arc<Mutex<u64>>,
    handle: Option<JoinHandle<()>>,
}

impl Monitor {
    /// Samples the cluster in `dir` every `interval` on a thread of its own (which enters the
    /// cluster's fabric namespace itself).
    pub fn start(dir: &Path, interval: Duration) -> Result<Monitor, String> {
        let dir: PathBuf = dir.to_path_buf();
        let st = KvState::load(&dir)?;
        let password = std::fs::read_to_string(dir.join(PASSWORD_FILE))
            .map_err(|e| format!("{}: {e}", dir.join(PASSWORD_FILE).display()))?
            .trim()
            .to_string();
        let stop = Arc::new(AtomicBool::new(false));
        let latest = Arc::new(Mutex::new(None));
        let samples = Arc::new(Mutex::new(0));
        let (s2, l2, n2) = (stop.clone(), latest.clone(), samples.clone());
        let (tx, rx) = std::sync::mpsc::channel();
        let handle = std::thread::Builder::new()
            .name("kv-monitor".into())
            .spawn(move || {
                let entered = host::enter(&st.fabric_ns);
                let failed = entered.is_err();
                let _ = tx.send(entered);
                if failed {
                    return;
                }
                let mut prev = read(&st, &password);
                while !s2.load(Ordering::Relaxed) {
                    let next = prev.at + interval;
                    while Instant::now() < next && !s2.load(Ordering::Relaxed) {
                        std::thread::sleep(Duration::from_millis(20).min(interval));
                    }
                    // The state file changes under a scale; a read failing half-way keeps the
                    // last good record.
                    let st = KvState::load(&dir).unwrap_or_else(|_| st.clone());
                    let cur = read(&st, &password);
                    if let Ok(mut l) = l2.lock() {
                        *l = Some(snapshot(&st, &prev, &cur));
                    }
                    if let Ok(mut n) = n2.lock() {
                        *n += 1;
                    }
                    prev = cur;
                }
            })
            .map_err(|e| e.to_string())?;
        rx.recv().map_err(|e| e.to_string())??;
        Ok(Monitor {
            stop,
            latest,
            samples,
            handle: Some(handle),
        })
    }

    pub fn latest(&self) -> Option<Snapshot> {
        self.latest.lock().ok()?.clone()
    }

    /// Samples taken so far.
    pub fn samples(&self) -> u64 {
        self.samples.lock().map(|n| *n).unwrap_or(0)
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_ticks_of_this_process() {
        assert!(cpu_ticks(std::process::id() as i32).is_some());
        assert!(cpu_ticks(-5).is_none());
    }
}
