//! `pliant pg up|down|status`: a protected cluster + proxy run by a background process.
//!
//! `up` starts `pliant pg up --foreground` detached and waits until it reports ready; the
//! foreground process owns the namespaces and servers, writes `status.json` twice a second,
//! and tears everything down on SIGTERM/SIGINT (`down` sends SIGTERM).

use crate::bench::proxy_config;
use crate::cluster::{Cluster, ClusterConfig};
use crate::proxy::{AuthMethod, ClusterOps, Proxy};
use crate::tls::DemoPki;
use serde_json::json;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, SeqCst);
}

/// Where `up` keeps `state.json`, `status.json` and `up.log` (`PLIANT_PG_RUN_DIR` overrides
/// it, so that tests do not touch a cluster an operator runs). Removed again by `down`.
pub fn state_dir() -> PathBuf {
    std::env::var_os("PLIANT_PG_RUN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/run/pliant/pg"))
}

/// Subdirectory of the run directory with the `--tls` demo CA and server certificate.
const TLS_DIR: &str = "tls";

/// libpq password file in the run directory (0600) that the printed `connect` line uses:
/// neither the output nor a command line carries the password.
const PASSFILE: &str = "pgpass";

/// Removes every file `up` created and the directory itself if nothing else is in it.
fn remove_state_files() {
    let d = state_dir();
    for f in ["state.json", "status.json", "up.log", PASSFILE] {
        let _ = std::fs::remove_file(d.join(f));
    }
    for f in ["ca.crt", "server.crt", "server.key"] {
        let _ = std::fs::remove_file(d.join(TLS_DIR).join(f));
    }
    let _ = std::fs::remove_dir(d.join(TLS_DIR));
    // remove_dir fails on a non-empty directory: files someone else put there stay.
    let _ = std::fs::remove_dir(&d);
}

fn read_state() -> Result<serde_json::Value, String> {
    let p = state_dir().join("state.json");
    let s =
        std::fs::read_to_string(&p).map_err(|_| "no cluster is up (pliant pg up)".to_string())?;
    serde_json::from_str(&s).map_err(|e| format!("{}: {e}", p.display()))
}

fn alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks for existence.
    pid > 0 && unsafe { libc::kill(pid, 0) } == 0
}

/// Options of `pliant pg up`.
#[derive(Clone, Debug)]
pub struct UpOpts {
    pub auth: AuthMethod,
    /// Run unprotected after the standby is lost for this long (ms); 0 = never (commits block
    /// until the standby returns).
    pub async_fallback_ms: u64,
    /// Demo TLS: private CA + server certificate in the run directory; clients must use TLS.
    pub tls: bool,
    /// How long a primary whose health probe is slow (but answering) may stay unanswered
    /// before it is failed over (ms; see the proxy's health detector).
    pub probe_dead_after_ms: u64,
    /// Event-loop threads relaying the sessions (0 = one per four CPUs, at least one).
    pub relay_threads: usize,
}

impl Default for UpOpts {
    fn default() -> Self {
        UpOpts {
            auth: AuthMethod::ScramSha256,
            async_fallback_ms: crate::bench::DEFAULT_ASYNC_FALLBACK_MS,
            tls: false,
            probe_dead_after_ms: crate::proxy::DEFAULT_PROBE_DEAD_AFTER_MS,
            relay_threads: 0,
        }
    }
}

/// Starts the cluster in the background and returns its state once ready.
pub fn up(foreground: bool, opts: &UpOpts) -> Result<String, String> {
    if let Ok(st) = read_state() {
        if alive(st["pid"].as_i64().unwrap_or(0) as i32) {
            return Err(format!("a cluster is already up: {st}"));
        }
    }
    std::fs::create_dir_all(state_dir()).map_err(|e| e.to_string())?;
    if foreground {
        return serve(opts);
    }
    let _ = std::fs::remove_file(state_dir().join("state.json"));
    let log = std::fs::File::create(state_dir().join("up.log")).map_err(|e| e.to_string())?;
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut child = std::process::Command::new(exe)
        .args(["pg", "up", "--foreground", "--auth"])
        .arg(match opts.auth {
            AuthMethod::ScramSha256 => "scram-sha-256",
            AuthMethod::Md5 => "md5",
        })
        .arg("--async-fallback-ms")
        .arg(opts.async_fallback_ms.to_string())
        .args(opts.tls.then_some("--tls"))
        .arg("--probe-dead-after-ms")
        .arg(opts.probe_dead_after_ms.to_string())
        .arg("--relay-threads")
        .arg(opts.relay_threads.to_string())
        .stdin(std::process::Stdio::null())
        .stdout(log.try_clone().map_err(|e| e.to_string())?)
        .stderr(log)
        .spawn()
        .map_err(|e| format!("spawn: {e}"))?;
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(120) {
        if let Ok(st) = read_state() {
            if st["ready"].as_bool() == Some(true) {
                return Ok(serde_json::to_string_pretty(&st).unwrap_or_default());
            }
        }
        if let Ok(Some(s)) = child.try_wait() {
            let log = std::fs::read_to_string(state_dir().join("up.log")).unwrap_or_default();
            // The log is part of the error; nothing of the failed attempt stays behind.
            remove_state_files();
            return Err(format!("pliant pg up failed ({s}): {log}"));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    // Give up: stop the background process (it tears its cluster down on SIGTERM) and leave
    // nothing behind; the log goes into the error.
    // SAFETY: SIGTERM to the child this call spawned.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let t1 = Instant::now();
    while t1.elapsed() < Duration::from_secs(60) && matches!(child.try_wait(), Ok(None)) {
        std::thread::sleep(Duration::from_millis(100));
    }
    let log = std::fs::read_to_string(state_dir().join("up.log")).unwrap_or_default();
    remove_state_files();
    Err(format!("cluster not ready after 120 s: {log}"))
}

fn serve(opts: &UpOpts) -> Result<String, String> {
    // SAFETY: installs an async-signal-safe handler that only stores an atomic.
    unsafe {
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
    }
    let mut cl = Cluster::create(ClusterConfig {
        fsync: true,
        ..Default::default()
    })?;
    // The certificate must name the bridge and the servers, known once the namespaces exist.
    let pki = if opts.tls {
        Some(crate::bench::cluster_tls(
            &mut cl,
            &state_dir().join(TLS_DIR),
        )?)
    } else {
        None
    };
    let cl = Arc::new(cl);
    let r = serve_cluster(&cl, opts, pki.as_ref());
    cl.teardown();
    // up.log stays until `down` has seen this process exit (it still writes to it).
    let _ = std::fs::remove_file(state_dir().join("status.json"));
    let _ = std::fs::remove_file(state_dir().join("state.json"));
    r
}

fn serve_cluster(
    cl: &Arc<Cluster>,
    opts: &UpOpts,
    pki: Option<&DemoPki>,
) -> Result<String, String> {
    cl.init_primary()?;
    cl.add_standby(1, 0)?;
    cl.protect(0, 1)?;
    let ops: Arc<dyn ClusterOps> = cl.clone();
    let mut pc = proxy_config(cl, 0);
    pc.auth = opts.auth;
    pc.async_fallback_ms = Some(opts.async_fallback_ms).filter(|ms| *ms > 0);
    pc.probe_dead_after_ms = opts.probe_dead_after_ms;
    pc.relay_threads = opts.relay_threads;
    if let Some(p) = pki {
        crate::bench::require_tls(&mut pc, p);
    }
    let proxy = Proxy::start(pc, true, Some(ops))?;
    let passfile = state_dir().join(PASSFILE);
    crate::secrets::write_private(
        &passfile,
        crate::secrets::pgpass_line(&cl.cfg.user, &cl.cfg.password).as_bytes(),
    )?;
    let mut state = up_state(&cl.cfg, proxy.addr, &passfile, pki.map(|p| p.ca.as_path()));
    state["pid"] = std::process::id().into();
    state["dir"] = json!(cl.dir);
    state["bridge"] = json!(cl.bridge);
    state["nodes"] = cl
        .nodes
        .iter()
        .map(|n| json!({"name": n.name, "ns": n.ns, "addr": n.addr().to_string()}))
        .collect();
    // Private as well: it names the servers and the password file.
    crate::tls::write_private(
        &state_dir().join("state.json"),
        state.to_string().as_bytes(),
    )?;
    eprintln!("pliant pg: up, proxy at {}", proxy.addr);
    if let Some(p) = pki {
        eprintln!(
            "pliant pg: TLS required; CA for sslrootcert: {}",
            p.ca.display()
        );
    }
    while !STOP.load(SeqCst) {
        let p = proxy.shared.primary.load(SeqCst);
        let protected = proxy.shared.protected.load(SeqCst);
        let mut st = proxy.stats_json();
        st["roles"] = json!({
            cl.nodes[p].name.clone(): "primary",
            cl.nodes[1 - p].name.clone(): if protected {
                "sync standby"
            } else if proxy.shared.degraded.load(SeqCst) {
                "lost (primary runs unprotected; restoring)"
            } else {
                "fenced / rejoining"
            },
        });
        st["replication_lag_bytes"] = json!(cl.lag_bytes(p));
        let _ = std::fs::write(state_dir().join("status.json"), st.to_string());
        std::thread::sleep(Duration::from_millis(500));
    }
    proxy.stop();
    Ok("stopped".into())
}

/// What `up` records and prints about how to connect: user, password file (never the
/// password) and a `connect` line using it.
fn up_state(
    cfg: &ClusterConfig,
    proxy: std::net::SocketAddr,
    passfile: &std::path::Path,
    ca: Option<&std::path::Path>,
) -> serde_json::Value {
    let ssl = ca
        .map(|ca| format!(" sslmode=verify-full sslrootcert={}", ca.display()))
        .unwrap_or_default();
    json!({
        "ready": true,
        "proxy": proxy.to_string(),
        "user": cfg.user,
        "passfile": passfile,
        "connect": format!(
            "PGPASSFILE={} psql 'host={} port={} user={} dbname=postgres{ssl}'",
            passfile.display(),
            proxy.ip(),
            proxy.port(),
            cfg.user
        ),
        "sslrootcert": ca.map(|p| p.display().to_string()),
    })
}

pub fn status() -> Result<String, String> {
    let st = read_state()?;
    let pid = st["pid"].as_i64().unwrap_or(0) as i32;
    let mut s: serde_json::Value = std::fs::read_to_string(state_dir().join("status.json"))
        .ok()
        .and_then(|s| serde_json::from_str(&s).ok())
        .unwrap_or(json!({}));
    s["running"] = alive(pid).into();
    s["proxy_addr"] = st["proxy"].clone();
    s["connect"] = st["connect"].clone();
    Ok(serde_json::to_string_pretty(&s).unwrap_or_default())
}

pub fn down() -> Result<String, String> {
    let st = read_state()?;
    let pid = st["pid"].as_i64().unwrap_or(0) as i32;
    if !alive(pid) {
        remove_state_files();
        return Ok("not running (stale state removed)".into());
    }
    // SAFETY: SIGTERM to the cluster process recorded by `up`.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let t0 = Instant::now();
    while alive(pid) && t0.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(100));
    }
    if alive(pid) {
        return Err(format!("process {pid} did not stop within 60 s"));
    }
    remove_state_files();
    Ok("down".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn up_prints_a_passfile_never_the_password() {
        let cfg = ClusterConfig {
            password: "pw-not-to-be-printed".into(),
            ..Default::default()
        };
        let pf = std::path::Path::new("/run/pliant/pg/pgpass");
        for ca in [
            None,
            Some(std::path::Path::new("/run/pliant/pg/tls/ca.crt")),
        ] {
            let st = up_state(&cfg, "10.213.1.1:6432".parse().unwrap(), pf, ca);
            let text = st.to_string();
            assert!(!text.contains(&cfg.password), "{text}");
            assert_eq!(st["passfile"], "/run/pliant/pg/pgpass");
            let connect = st["connect"].as_str().unwrap();
            assert!(
                connect.starts_with("PGPASSFILE=/run/pliant/pg/pgpass psql 'host=10.213.1.1 port=6432 user=pliant dbname=postgres"),
                "{connect}"
            );
            assert_eq!(
                ca.is_some(),
                connect.contains("sslmode=verify-full"),
                "{connect}"
            );
        }
    }
}
