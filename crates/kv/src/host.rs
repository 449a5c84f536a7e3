//! Lab hosts: a fabric namespace with a bridge, and per host a namespace with a veth to that
//! bridge and a cgroup v1 cpu directory whose CFS quota is the host's CPU capacity. Commands run
//! through pliant-lab's `cmd` helpers; processes are stopped by PID only.

use crate::state::{HostRec, KvState};
use pliant_lab::cmd;
use std::path::{Path, PathBuf};
use std::time::Duration;

const IP_TIMEOUT: Duration = Duration::from_secs(10);
const CGROUP_CPU: &str = "/sys/fs/cgroup/cpu";
/// CFS period; the quota is a percentage of it (100 % = one core).
const CFS_PERIOD_US: u64 = 100_000;

fn ip(args: &[&str]) -> Result<(), String> {
    let mut argv = vec!["ip".to_string()];
    argv.extend(args.iter().map(|s| s.to_string()));
    cmd::run_ok(&argv, IP_TIMEOUT)
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// Moves the calling thread (and threads it spawns afterwards) into namespace `ns`: every
/// connection to the cluster is made from the fabric namespace, so nothing listens outside it.
pub fn enter(ns: &str) -> Result<(), String> {
    pliant_lab::cmd::enter_netns(ns).map_err(|e| format!("namespace {ns}: {e}"))
}

/// The fabric namespace and its bridge (10.214.subnet.1/24).
pub fn create_fabric(st: &KvState) -> Result<(), String> {
    ip(&["netns", "add", &st.fabric_ns])?;
    let ns = st.fabric_ns.as_str();
    ip(&["-n", ns, "link", "set", "lo", "up"])?;
    ip(&["-n", ns, "link", "add", &st.bridge, "type", "bridge"])?;
    let addr = format!("10.214.{}.1/24", st.subnet);
    ip(&["-n", ns, "addr", "add", &addr, "dev", &st.bridge])?;
    ip(&["-n", ns, "link", "set", &st.bridge, "up"])
}

pub fn cgroup_dir(st: &KvState, id: u32) -> PathBuf {
    Path::new(CGROUP_CPU).join(format!("pliant-kv-{}-h{id}", st.tag))
}

/// Creates host `id`: namespace, veth to the bridge, cgroup with the quota. The record is
/// returned even when a step fails part-way (`Err` carries it), so the caller can remove it.
pub fn add_host(st: &KvState, id: u32) -> Result<HostRec, (HostRec, String)> {
    let rec = HostRec {
        id,
        ns: format!("kv{}-h{id}", st.tag),
        veth: format!("kv{}h{id}", st.tag),
        ip: st.host_ip(id),
        cgroup: cgroup_dir(st, id),
    };
    build_host(st, &rec)
        .map(|()| rec.clone())
        .map_err(|e| (rec, e))
}

fn build_host(st: &KvState, h: &HostRec) -> Result<(), String> {
    ip(&["netns", "add", &h.ns])?;
    let inner = format!("{}i", h.veth);
    let fab = st.fabric_ns.as_str();
    ip(&[
        "-n", fab, "link", "add", &h.veth, "type", "veth", "peer", "name", &inner, "netns", &h.ns,
    ])?;
    ip(&[
        "-n", fab, "link", "set", &h.veth, "master", &st.bridge, "up",
    ])?;
    ip(&[
        "-n",
        &h.ns,
        "addr",
        "add",
        &format!("{}/24", h.ip),
        "dev",
        &inner,
    ])?;
    ip(&["-n", &h.ns, "link", "set", &inner, "up"])?;
    ip(&["-n", &h.ns, "link", "set", "lo", "up"])?;
    std::fs::create_dir(&h.cgroup).map_err(|e| format!("{}: {e}", h.cgroup.display()))?;
    let write = |f: &str, v: String| {
        let p = h.cgroup.join(f);
        std::fs::write(&p, v).map_err(|e| format!("{}: {e}", p.display()))
    };
    write("cpu.cfs_period_us", CFS_PERIOD_US.to_string())?;
    write(
        "cpu.cfs_quota_us",
        (CFS_PERIOD_US * st.cpu_quota_pct as u64 / 100).to_string(),
    )
}

/// CPU capacity of a host in cores, from its quota.
pub fn cores(st: &KvState) -> f64 {
    st.cpu_quota_pct as f64 / 100.0
}

/// Removes host `h`: kills whatever still runs in its namespace (it exists only for this
/// cluster, so every process in it was started here; by PID), then its veth, namespace and
/// cgroup. Idempotent; returns what it could not remove.
pub fn remove_host(st: &KvState, h: &HostRec) -> Vec<String> {
    let mut problems = Vec::new();
    for _ in 0..50 {
        let pids = pliant_lab::state::netns_pids(&h.ns);
        if pids.is_empty() {
            break;
        }
        for pid in pids {
            // SAFETY: kill(2) on a PID inside this cluster's own namespace.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            reap(pid);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    if pliant_lab::state::netns_exists(&st.fabric_ns) {
        let _ = ip(&["-n", &st.fabric_ns, "link", "del", &h.veth]);
    }
    if pliant_lab::state::netns_exists(&h.ns) {
        if let Err(e) = ip(&["netns", "del", &h.ns]) {
            problems.push(e);
        }
    }
    if h.cgroup.exists() {
        // A cgroup is removable once its last task has exited, which trails the kill slightly.
        let ok = (0..100).any(|_| {
            std::fs::remove_dir(&h.cgroup).is_ok() || {
                std::thread::sleep(Duration::from_millis(20));
                false
            }
        });
        if !ok {
            problems.push(format!("cgroup {} not removed", h.cgroup.display()));
        }
    }
    problems
}

pub fn remove_fabric(st: &KvState) -> Vec<String> {
    let mut problems = Vec::new();
    if pliant_lab::state::netns_exists(&st.fabric_ns) {
        if let Err(e) = ip(&["netns", "del", &st.fabric_ns]) {
            problems.push(e);
        }
    }
    problems
}

/// Collects an exited child so it does not linger as a zombie (no effect on other processes).
pub fn reap(pid: i32) {
    // SAFETY: waitpid with WNOHANG on a PID; fails harmlessly when it is not our child.
    unsafe { libc::waitpid(pid, std::ptr::null_mut(), libc::WNOHANG) };
}
