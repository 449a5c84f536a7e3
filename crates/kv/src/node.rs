//! One redis-server (one copy of one partition) on a host: its configuration (password in a
//! 0600 file, never on a command line), its process (in the host's namespace and cgroup), and the
//! admin connection to it.

use crate::host::reap;
use crate::parse;
use crate::state::{HostRec, KvState, NodeRec, BASE_PORT};
use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// How long a node may take to accept connections after it is started.
const START_TIMEOUT: Duration = Duration::from_secs(15);
const IO_TIMEOUT: Duration = Duration::from_secs(5);
/// Cluster bus port offset Redis uses by default.
const BUS_OFFSET: u16 = 10_000;

/// The configuration of partition `p`'s copy on host `h`.
pub fn config(st: &KvState, h: &HostRec, p: usize, password: &str) -> String {
    let dir = st.node_dir(h.id, p);
    format!(
        "# pliant kv: partition {p} on host {host}\n\
         bind {ip}\n\
         port {port}\n\
         protected-mode yes\n\
         requirepass {password}\n\
         masterauth {password}\n\
         daemonize no\n\
         dir {dir}\n\
         logfile {dir}/redis.log\n\
         cluster-enabled yes\n\
         cluster-config-file {dir}/nodes.conf\n\
         cluster-node-timeout 5000\n\
         # pliant decides where replicas live; Redis must not move them between masters.\n\
         cluster-allow-replica-migration no\n\
         # In-memory database: copies on other hosts are the durability, not the disk.\n\
         appendonly no\n\
         # A new copy starts its full sync at once (the default waits 5 s for more replicas).\n\
         repl-diskless-sync-delay 0\n\
         save \"\"\n",
        host = h.id,
        ip = h.ip,
        port = BASE_PORT + p as u16,
        dir = dir.display(),
    )
}

/// Starts partition `p`'s redis-server on host `h` and waits until it answers; returns its
/// record. The child joins the host's cgroup before it execs, so it never runs outside its quota.
pub fn start(st: &KvState, h: &HostRec, p: usize, password: &str) -> Result<NodeRec, String> {
    let dir = st.node_dir(h.id, p);
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    // A fresh identity: a directory left by an earlier copy of this partition on this host
    // would make the new server reuse that node id, which the cluster has forgotten.
    let _ = std::fs::remove_file(dir.join("nodes.conf"));
    let conf = dir.join("redis.conf");
    pliant_pg::secrets::write_private(&conf, config(st, h, p, password).as_bytes())?;
    let procs = std::fs::OpenOptions::new()
        .write(true)
        .open(h.cgroup.join("cgroup.procs"))
        .map_err(|e| format!("{}: {e}", h.cgroup.display()))?;
    let mut c = Command::new("ip");
    c.args(["netns", "exec", &h.ns, "redis-server"])
        .arg(&conf)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        // Its own process group: a Ctrl-C at `pliant kv up` does not reach the servers.
        .process_group(0);
    // SAFETY: the closure only calls write(2) on an fd opened before fork (async-signal-safe).
    unsafe {
        c.pre_exec(move || {
            let mut f: &std::fs::File = &procs;
            f.write_all(b"0")
        });
    }
    let child = c
        .spawn()
        .map_err(|e| format!("redis-server for partition {p} on host {}: {e}", h.id))?;
    let mut rec = NodeRec {
        partition: p,
        host: h.id,
        port: BASE_PORT + p as u16,
        pid: child.id() as i32,
        id: String::new(),
    };
    // Not waited on here: `up` returns while the servers run; `stop` reaps them when it can.
    std::mem::forget(child);
    let t0 = Instant::now();
    loop {
        match connect(st, &rec, password).and_then(|mut c| query_str(&mut c, &["CLUSTER", "MYID"]))
        {
            Ok(id) => {
                rec.id = id.trim().to_string();
                return Ok(rec);
            }
            Err(e) if t0.elapsed() > START_TIMEOUT => {
                stop(st, &rec);
                return Err(format!(
                    "partition {p} on host {}: not answering after {:?}: {e} (log: {}/redis.log)",
                    h.id,
                    START_TIMEOUT,
                    dir.display()
                ));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// SIGTERM, then SIGKILL after a grace period, by PID, only if the PID is still this node.
pub fn stop(st: &KvState, n: &NodeRec) {
    let rec = pliant_lab::state::ProcRecord {
        pid: n.pid,
        role: format!("redis p{} h{}", n.partition, n.host),
        marker: st.marker(n),
    };
    pliant_lab::state::stop_proc(&rec, Duration::from_secs(3));
    reap(n.pid);
}

/// An admin connection to node `n` (the calling thread must be in the fabric namespace).
pub fn connect(st: &KvState, n: &NodeRec, password: &str) -> Result<redis::Connection, String> {
    connect_addr(&format!("{}:{}", st.host_ip(n.host), n.port), password)
}

/// An admin connection to `ip:port` (a node named by a `MOVED` reply or `CLUSTER NODES`).
pub fn connect_addr(addr: &str, password: &str) -> Result<redis::Connection, String> {
    let url = format!("redis://:{password}@{addr}/");
    let c = redis::Client::open(url.as_str()).map_err(|e| e.to_string())?;
    let con = c
        .get_connection_with_timeout(IO_TIMEOUT)
        .map_err(|e| format!("{addr}: {e}"))?;
    con.set_read_timeout(Some(IO_TIMEOUT))
        .map_err(|e| e.to_string())?;
    con.set_write_timeout(Some(IO_TIMEOUT))
        .map_err(|e| e.to_string())?;
    Ok(con)
}

/// Runs one command, its reply as a string (status and bulk replies).
pub fn query_str(c: &mut redis::Connection, args: &[&str]) -> Result<String, String> {
    let mut cmd = redis::cmd(args[0]);
    for a in &args[1..] {
        cmd.arg(*a);
    }
    let v: redis::Value = cmd
        .query(c)
        .map_err(|e| format!("{}: {e}", args.join(" ")))?;
    match v {
        redis::Value::BulkString(b) => Ok(String::from_utf8_lossy(&b).into_owned()),
        redis::Value::SimpleString(s) => Ok(s),
        redis::Value::Okay => Ok("OK".into()),
        redis::Value::VerbatimString { text, .. } => Ok(text),
        redis::Value::Int(i) => Ok(i.to_string()),
        other => Err(format!("{}: unexpected reply {other:?}", args.join(" "))),
    }
}

pub fn info(c: &mut redis::Connection, section: &str) -> Result<BTreeMap<String, String>, String> {
    query_str(c, &["INFO", section]).map(|t| parse::info(&t))
}

pub fn cluster_nodes(c: &mut redis::Connection) -> Result<Vec<parse::NodeLine>, String> {
    query_str(c, &["CLUSTER", "NODES"]).and_then(|t| parse::cluster_nodes(&t))
}

/// `CLUSTER MEET` arguments for node `n`.
pub fn meet_args(st: &KvState, n: &NodeRec) -> [String; 3] {
    [
        st.host_ip(n.host).to_string(),
        n.port.to_string(),
        (n.port + BUS_OFFSET).to_string(),
    ]
}

/// Polls `f` until it returns `Ok(Some(_))`, at most `limit`; the last error or "timed out"
/// names `what`. Every wait of this crate is one of these: bounded, never a fixed sleep.
pub fn wait_for<T>(
    what: &str,
    limit: Duration,
    mut f: impl FnMut() -> Result<Option<T>, String>,
) -> Result<T, String> {
    let t0 = Instant::now();
    let mut last = String::new();
    loop {
        match f() {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(e) => last = e,
        }
        if t0.elapsed() > limit {
            return Err(format!(
                "{what}: not done after {limit:?}{}",
                if last.is_empty() {
                    String::new()
                } else {
                    format!(" (last error: {last})")
                }
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
