//! `pliant controller|status|flows|migrate|scale|policy|ha`: the controller daemon and the
//! commands that talk to it over its authenticated HTTP/JSON API.

use clap::{Args, Subcommand};
use pliant_controller::http;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::Duration;

const DEFAULT_API: &str = "/run/pliant/controller/api.sock";
const DEFAULT_TOKEN: &str = "/run/pliant/controller/token";

#[derive(Args)]
#[command(
    about = "Run the elasticity controller daemon (heartbeats, migrations, scaling, policies)",
    after_help = "Serves an HTTP/JSON API on a unix socket (mode 0600; optionally TCP). Every \
        request needs `Authorization: Bearer <token>`; the token is read from the token file \
        (created with mode 0600 on first start). Runs until SIGINT/SIGTERM.\n\n\
        Example ctl.toml:\n\
        [controller]\n\
        api_socket = \"/run/pliant/controller/api.sock\"\n\
        token_file = \"/run/pliant/controller/token\"\n\
        store = \"/run/pliant/controller/store.json\"\n\
        heartbeat_ms = 100\n\
        [lab]\n\
        name = \"demo\"          # replicas are namespaces of this running lab\n\
        nat_addr = \"10.77.2.1\"\n\
        [ports]                # NAT port blocks per replica\n\
        per_replica = 1\n\
        [policy]\n\
        high_water_flows = 60\n\
        low_water_flows = 40\n\
        # min_replicas: never scale in below it; with [ha] on at least 2 (the default then)\n\
        [ha]                   # high availability (Pico replication); absent = off\n\
        mode = \"pico\"          # pico | remus | ftmb | off\n\
        policy = \"chords\"      # chords | single | streams\n\
        hz = 1000"
)]
pub struct ControllerArgs {
    /// Controller configuration file (TOML).
    #[arg(long)]
    pub config: PathBuf,
    /// Validate the configuration (with an etcd store: that etcd answers, TLS included) and
    /// exit.
    #[arg(long)]
    pub check: bool,
}

/// How to reach the daemon (shared by every client command).
#[derive(Args, Clone)]
pub struct Conn {
    /// Controller API: a unix socket path or tcp://host:port.
    #[arg(long, env = "PLIANT_API", default_value = DEFAULT_API, global = true)]
    pub api: String,
    /// File holding the API bearer token.
    #[arg(long, env = "PLIANT_TOKEN_FILE", default_value = DEFAULT_TOKEN, global = true)]
    pub token_file: PathBuf,
    /// Print the raw JSON answer.
    #[arg(long, global = true)]
    pub json: bool,
}

#[derive(Args)]
#[command(
    about = "Show replicas (alive, flows, packets/s, port blocks), counters and recent events"
)]
pub struct StatusArgs {
    #[command(flatten)]
    pub conn: Conn,
}

#[derive(Args)]
#[command(about = "List the flows each replica holds (keys and aliases)")]
pub struct FlowsArgs {
    #[command(flatten)]
    pub conn: Conn,
    /// Only this replica (e.g. r2).
    #[arg(long)]
    pub replica: Option<String>,
}

#[derive(Args)]
#[command(
    about = "Move flows between replicas (loss-free; steering follows)",
    after_help = "Either one flow by key (any of its keys or aliases, in the form printed by \
        `pliant flows`):\n  pliant migrate --flow \"tcp 10.77.1.2:40000 <-> 10.77.2.2:80\" --to r2\n\
        or a number of flows:\n  pliant migrate --count 10 --from r1 --to r2"
)]
pub struct MigrateArgs {
    #[command(flatten)]
    pub conn: Conn,
    /// Flow key to move.
    #[arg(long, conflicts_with_all = ["count", "from"])]
    pub flow: Option<String>,
    /// Number of flows to move (with --from).
    #[arg(long, requires = "from")]
    pub count: Option<u64>,
    /// Source replica (with --count).
    #[arg(long)]
    pub from: Option<String>,
    /// Destination replica (e.g. r2).
    #[arg(long)]
    pub to: String,
}

#[derive(Args)]
#[command(about = "Add a replica (out) or merge one away (in)")]
pub struct ScaleArgs {
    #[command(flatten)]
    pub conn: Conn,
    #[command(subcommand)]
    pub dir: ScaleDir,
}

#[derive(Subcommand)]
pub enum ScaleDir {
    /// Start a replica and add it to the fabric's ring.
    Out,
    /// Migrate a replica's flows into the others, merge its shared state, destroy it.
    In {
        /// The replica to remove (default: the one with the fewest flows).
        #[arg(long)]
        replica: Option<String>,
    },
}

#[derive(Args)]
#[command(about = "Show or change the elasticity policy")]
pub struct PolicyArgs {
    #[command(flatten)]
    pub conn: Conn,
    #[command(subcommand)]
    pub op: PolicyOp,
}

#[derive(Subcommand)]
pub enum PolicyOp {
    /// Print the policy.
    Show,
    /// Change thresholds: `pliant policy set high_water_flows=100 low_water_flows=20`.
    #[command(
        after_help = "Keys: auto, high_water_flows, low_water_flows, high_water_pps, \
        min_replicas, max_replicas, rebalance, imbalance_flows, cooldown_ms, max_batch. \
        All assignments apply together or not at all. With HA on, min_replicas below what \
        protection needs (2) is refused."
    )]
    Set {
        /// key=value pairs.
        #[arg(required = true)]
        pairs: Vec<String>,
    },
    /// Evaluate the policy once now (acts even when auto is off).
    Evaluate,
}

pub fn run(a: ControllerArgs) -> Result<(), String> {
    let cfg =
        pliant_controller::config::ControllerConfig::load(&a.config).map_err(|e| e.to_string())?;
    if a.check {
        // A store on etcd is asked too: a config whose etcd or TLS files do not work would
        // only fail later, as a controller that never leads.
        if let Some(st) = cfg
            .store
            .as_ref()
            .filter(|s| s.backend == pliant_controller::config::StoreBackend::Etcd)
        {
            use pliant_controller::store::Store;
            let store = pliant_controller::store::EtcdStore::connect(&st.etcd_options())
                .map_err(|e| format!("{}: store: {e}", a.config.display()))?;
            let rev = store
                .health()
                .map_err(|e| format!("{}: store: {e}", a.config.display()))?;
            println!(
                "store: etcd at {} answers (revision {rev}{})",
                st.endpoints.join(", "),
                if st.ca_file.is_some() {
                    ", mutual TLS"
                } else {
                    ""
                }
            );
        }
        println!("{}: ok", a.config.display());
        return Ok(());
    }
    drop(cfg);
    pliant_runtime::logging::init();
    pliant_controller::daemon::run(&a.config).map_err(|e| e.to_string())
}

fn call(c: &Conn, method: &str, path: &str, body: Option<Value>) -> Result<Value, String> {
    let token = std::fs::read_to_string(&c.token_file)
        .map_err(|e| {
            format!(
                "cannot read the API token {}: {e} (is the controller running? are you root?)",
                c.token_file.display()
            )
        })?
        .trim()
        .to_string();
    let b = body.map(|v| v.to_string());
    // Scale-in drains a replica (many migrations): allow it time.
    let (status, text) = http::request(
        &c.api,
        &token,
        method,
        path,
        b.as_deref(),
        Duration::from_secs(120),
    )
    .map_err(|e| e.to_string())?;
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|_| json!({"raw": text}));
    if status == 200 {
        return Ok(v);
    }
    let msg = v["error"]
        .as_str()
        .map(str::to_string)
        .unwrap_or_else(|| text.clone());
    Err(match status {
        401 => format!(
            "controller refused the token from {}: {msg}",
            c.token_file.display()
        ),
        _ => format!("controller answered {status}: {msg}"),
    })
}

fn print_json(v: &Value) -> Result<(), String> {
    println!(
        "{}",
        serde_json::to_string_pretty(v).map_err(|e| e.to_string())?
    );
    Ok(())
}

/// One line per host of `[hosts]` (empty without): its agent's state and its replicas.
fn host_lines(hosts: &Value) -> Vec<String> {
    let Some(hs) = hosts.as_array() else {
        return Vec::new();
    };
    hs.iter()
        .map(|h| {
            let slots: Vec<String> = h["replicas"]
                .as_array()
                .map(Vec::as_slice)
                .unwrap_or(&[])
                .iter()
                .map(|s| {
                    let mut t = format!(
                        "{} {}",
                        s["replica"].as_str().unwrap_or("?"),
                        s["state"].as_str().unwrap_or("?")
                    );
                    if let Some(e) = s["exit"].as_str() {
                        t.push_str(&format!(" ({e})"));
                    }
                    t
                })
                .collect();
            let state = h["state"].as_str().unwrap_or("?");
            let mut line = format!(
                "host {} {} for {} ms: {}",
                h["name"].as_str().unwrap_or("?"),
                state,
                h["for_ms"],
                if slots.is_empty() {
                    "no replica reported".to_string()
                } else {
                    slots.join(", ")
                }
            );
            if state != "up" {
                line = format!(
                    "WARNING: {line} ({})",
                    h["last_error"].as_str().unwrap_or("")
                );
            }
            line
        })
        .collect()
}

pub fn status(a: StatusArgs) -> Result<(), String> {
    let v = call(&a.conn, "GET", "/v1/status", None)?;
    if a.conn.json {
        return print_json(&v);
    }
    println!("epoch {}", v["epoch"]);
    let ctl = &v["controller"];
    if ctl["role"] == "leader" {
        println!(
            "controller {} leads (term {})",
            ctl["name"].as_str().unwrap_or("?"),
            ctl["term"]
        );
    }
    let st = &v["store"];
    if st["ok"] == true {
        println!(
            "store {} ok (revision {})",
            st["backend"].as_str().unwrap_or("?"),
            st["revision"]
        );
    } else {
        println!(
            "WARNING: store {} unavailable: {} ({})",
            st["backend"].as_str().unwrap_or("?"),
            st["error"].as_str().unwrap_or("?"),
            st["note"].as_str().unwrap_or("")
        );
    }
    println!(
        "{:<6} {:<6} {:>8} {:>10} {:<14} note",
        "name", "alive", "flows", "pps", "ports"
    );
    for r in v["replicas"].as_array().map(Vec::as_slice).unwrap_or(&[]) {
        let ports = r["port_blocks"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_str)
                    .collect::<Vec<_>>()
                    .join(",")
            })
            .unwrap_or_default();
        let note = if r["draining"] == true {
            "draining".to_string()
        } else {
            r["last_error"].as_str().unwrap_or("").to_string()
        };
        println!(
            "{:<6} {:<6} {:>8} {:>10} {:<14} {note}",
            r["name"].as_str().unwrap_or("?"),
            r["alive"],
            r["flows"],
            r["pps"],
            ports
        );
    }
    if let Some(w) = unprotected_warning(&v["unprotected"], &v["ha"]["min_replicas"]) {
        println!("{w}");
    }
    for line in host_lines(&v["hosts"]) {
        println!("{line}");
    }
    let c = &v["counters"];
    println!(
        "migrated {} flows ({} failed batches), scale-outs {}, scale-ins {}, rebalances {}",
        c["flows_migrated"],
        c["migrations_failed"],
        c["scale_outs"],
        c["scale_ins"],
        c["rebalances"]
    );
    if let Some(ev) = v["events"].as_array().filter(|e| !e.is_empty()) {
        println!("recent events:");
        for e in ev.iter().take(8) {
            println!("  {} {}", e["event"].as_str().unwrap_or("?"), e["detail"]);
        }
    }
    Ok(())
}

/// The line `status` and `ha status` print when HA is on and some serving replica has no
/// backup (or FTMB logger) on another live replica: it loses its flows if it dies now.
fn unprotected_warning(unprotected: &Value, ha_min_replicas: &Value) -> Option<String> {
    let names: Vec<String> = unprotected
        .as_array()?
        .iter()
        .filter_map(Value::as_u64)
        .map(|i| format!("r{i}"))
        .collect();
    if names.is_empty() {
        return None;
    }
    Some(format!(
        "WARNING: HA is on but {} {} unprotected (no live backup or logger on another \
         replica): {} if {} now; HA needs at least {} live replicas",
        names.join(", "),
        if names.len() == 1 { "runs" } else { "run" },
        if names.len() == 1 {
            "its flows are lost"
        } else {
            "their flows are lost"
        },
        if names.len() == 1 {
            "it dies"
        } else {
            "they die"
        },
        ha_min_replicas.as_u64().unwrap_or(2)
    ))
}

pub fn flows(a: FlowsArgs) -> Result<(), String> {
    let path = match &a.replica {
        Some(r) => format!("/v1/flows?replica={}", r.trim()),
        None => "/v1/flows".to_string(),
    };
    let v = call(&a.conn, "GET", &path, None)?;
    if a.conn.json {
        return print_json(&v);
    }
    for r in v["replicas"].as_array().map(Vec::as_slice).unwrap_or(&[]) {
        let name = format!("r{}", r["replica"]);
        if r["alive"] != true {
            println!("{name}: dead");
            continue;
        }
        if let Some(e) = r["error"].as_str() {
            println!("{name}: error: {e}");
            continue;
        }
        let list = r["flows"].as_array().map(Vec::as_slice).unwrap_or(&[]);
        println!("{name}: {} flows ({} listed)", r["total"], list.len());
        for f in list {
            let aliases: Vec<&str> = f["aliases"]
                .as_array()
                .map(|a| a.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            if aliases.is_empty() {
                println!("  {}", f["key"].as_str().unwrap_or("?"));
            } else {
                println!(
                    "  {}  (aliases: {})",
                    f["key"].as_str().unwrap_or("?"),
                    aliases.join("; ")
                );
            }
        }
    }
    Ok(())
}

pub fn migrate(a: MigrateArgs) -> Result<(), String> {
    let body = match (&a.flow, a.count, &a.from) {
        (Some(f), _, _) => json!({"flow": f, "to": a.to}),
        (None, Some(n), Some(from)) => json!({"from": from, "to": a.to, "count": n}),
        _ => return Err("give --flow KEY, or --count N --from rA (see --help)".into()),
    };
    let v = call(&a.conn, "POST", "/v1/migrate", Some(body))?;
    if a.conn.json {
        return print_json(&v);
    }
    println!(
        "moved {} flow(s) r{} -> r{} in {:.1} ms ({} keys steered, epoch {})",
        v["moved"],
        v["from"],
        v["to"],
        v["ms"].as_f64().unwrap_or(0.0),
        v["keys_steered"],
        v["epoch"]
    );
    if let Some(f) = v["failed"].as_array().filter(|f| !f.is_empty()) {
        println!("{} flow(s) stayed at the source (busy): {:?}", f.len(), f);
    }
    Ok(())
}

pub fn scale(a: ScaleArgs) -> Result<(), String> {
    let v = match &a.dir {
        ScaleDir::Out => call(&a.conn, "POST", "/v1/scale/out", None)?,
        ScaleDir::In { replica } => {
            let body = match replica {
                Some(r) => json!({"replica": r}),
                None => json!({}),
            };
            call(&a.conn, "POST", "/v1/scale/in", Some(body))?
        }
    };
    if a.conn.json {
        return print_json(&v);
    }
    match &a.dir {
        ScaleDir::Out => println!(
            "added r{}: process ready in {} ms, serving in {} ms",
            v["replica"], v["process_ready_ms"], v["serving_ms"]
        ),
        ScaleDir::In { .. } => println!(
            "removed r{}: {} flow(s) merged into the others in {} ms",
            v["replica"], v["moved"], v["ms"]
        ),
    }
    Ok(())
}

pub fn policy(a: PolicyArgs) -> Result<(), String> {
    let v = match &a.op {
        PolicyOp::Show => call(&a.conn, "GET", "/v1/policy", None)?,
        PolicyOp::Set { pairs } => {
            let mut set = serde_json::Map::new();
            for p in pairs {
                let (k, val) = p
                    .split_once('=')
                    .ok_or_else(|| format!("{p:?}: expected key=value"))?;
                set.insert(k.trim().to_string(), json!(val.trim()));
            }
            call(&a.conn, "POST", "/v1/policy", Some(json!({"set": set})))?
        }
        PolicyOp::Evaluate => call(&a.conn, "POST", "/v1/policy/evaluate", None)?,
    };
    if a.conn.json || matches!(a.op, PolicyOp::Evaluate) {
        return print_json(&v);
    }
    if let Some(p) = v["policy"].as_object() {
        for (k, val) in p {
            println!("{k} = {val}");
        }
    }
    Ok(())
}

#[derive(Args)]
#[command(about = "High availability: replication status and (re-)protection")]
pub struct HaArgs {
    #[command(flatten)]
    pub conn: Conn,
    #[command(subcommand)]
    pub op: HaOp,
}

#[derive(Subcommand)]
pub enum HaOp {
    /// Per replica: groups (backup, state, acked seq, held output), standby state, output
    /// audit; plus the ownership token and recent failovers with their timings.
    Status,
    /// Send every replica (or one) a protection policy now; optionally change the policy
    /// kind and checkpoint frequency first (kept by the controller).
    Protect {
        /// chords (consistent-hash ring over the others), single (next replica) or streams
        /// (well-known ports and iperf3 at --hz, the rest at a lower rate elsewhere).
        #[arg(long)]
        policy: Option<String>,
        /// Checkpoints per second of each protected group.
        #[arg(long)]
        hz: Option<u32>,
        /// Only this replica (e.g. r1).
        #[arg(long)]
        replica: Option<String>,
    },
}

pub fn ha(a: HaArgs) -> Result<(), String> {
    match &a.op {
        HaOp::Status => {
            let v = call(&a.conn, "GET", "/v1/ha", None)?;
            if a.conn.json {
                return print_json(&v);
            }
            let s = &v["summary"];
            if s["mode"] == "ftmb" {
                // No Pico policy: each replica logs to its ring successor.
                println!(
                    "mode ftmb (each replica logs to its successor), token {}, failovers {}",
                    s["token"], s["counters"]["failovers"]
                );
            } else {
                println!(
                    "mode {} policy {} at {} Hz, token {}, failovers {}",
                    s["mode"].as_str().unwrap_or("?"),
                    s["policy"].as_str().unwrap_or("?"),
                    s["hz"],
                    s["token"],
                    s["counters"]["failovers"]
                );
            }
            if let Some(w) = unprotected_warning(&v["unprotected"], &s["min_replicas"]) {
                println!("{w}");
            }
            for r in v["replicas"].as_array().map(Vec::as_slice).unwrap_or(&[]) {
                let name = r["name"].as_str().unwrap_or("?");
                if r["failed_over"] == true {
                    println!("{name}: failed over (fenced)");
                    continue;
                }
                let fs = &r["ftmb_status"];
                if fs["ok"] == true {
                    // FTMB member: where it logs, its snapshots, the loggers it hosts.
                    let hosting: Vec<&String> = fs["hosting"]["masters"]
                        .as_object()
                        .map(|m| m.keys().collect())
                        .unwrap_or_default();
                    println!(
                        "{name}: ftmb, {} workers, logs to {} ({}), {} snapshots (pause p50 {} \
                         us, p99 {} us), hosts the logger of {:?}",
                        fs["workers"],
                        r["ftmb_logger_host"].as_str().unwrap_or("-"),
                        if fs["protected"] == true {
                            "protected"
                        } else {
                            "not protected"
                        },
                        fs["snapshots"],
                        fs["snapshot_pause_us_p50"],
                        fs["snapshot_pause_us_p99"],
                        hosting
                    );
                    continue;
                }
                let h = &r["ha_status"];
                if h["ok"] != true {
                    println!("{name}: {}", h["error"].as_str().unwrap_or("no answer"));
                    continue;
                }
                println!(
                    "{name}: token {} | audit {} checked, {} violations | held now {}",
                    h["token"],
                    h["output"]["audit_checked"],
                    h["output"]["audit_violations"],
                    h["output"]["held_now"]
                );
                for g in h["groups"].as_array().map(Vec::as_slice).unwrap_or(&[]) {
                    println!(
                        "  group {} -> {} at {} Hz: {} (acked {}/{}, {} flows{})",
                        g["id"],
                        g["backup"].as_str().unwrap_or("-"),
                        g["hz"],
                        g["state"].as_str().unwrap_or("?"),
                        g["acked_seq"],
                        g["open_seq"],
                        g["flows"],
                        if g["needs_backup"] == true {
                            ", needs a backup"
                        } else {
                            ""
                        }
                    );
                }
                for sb in h["standby"].as_array().map(Vec::as_slice).unwrap_or(&[]) {
                    println!(
                        "  standby for {}: {} flows",
                        sb["primary"].as_str().unwrap_or("?"),
                        sb["flows"]
                    );
                }
            }
            for f in v["failovers"].as_array().map(Vec::as_slice).unwrap_or(&[]) {
                if f["mode"] == "ftmb" {
                    println!(
                        "failover of r{} (ftmb, recovered on r{}): detect {} ms, activate {} ms \
                         (replay {} ms, {} packets), steer {} ms; {} flows recovered",
                        f["replica"],
                        f["ftmb"]["logger_host"],
                        f["detect_ms"],
                        f["activate_ms"],
                        f["ftmb"]["replay_ms"],
                        f["ftmb"]["replayed_packets"],
                        f["steer_ms"],
                        f["activated"]
                    );
                    continue;
                }
                println!(
                    "failover of r{}: detect {} ms, activate {} ms, steer {} ms; {} flows activated ({})",
                    f["replica"],
                    f["detect_ms"],
                    f["activate_ms"],
                    f["steer_ms"],
                    f["activated"],
                    f["evidence"].as_str().unwrap_or("")
                );
            }
            Ok(())
        }
        HaOp::Protect {
            policy,
            hz,
            replica,
        } => {
            let mut body = serde_json::Map::new();
            if let Some(p) = policy {
                body.insert("policy".into(), json!(p));
            }
            if let Some(h) = hz {
                body.insert("hz".into(), json!(h));
            }
            if let Some(r) = replica {
                body.insert("replica".into(), json!(r));
            }
            let v = call(&a.conn, "POST", "/v1/ha/protect", Some(Value::Object(body)))?;
            if a.conn.json {
                return print_json(&v);
            }
            println!(
                "policy {} at {} Hz (token {})",
                v["policy"].as_str().unwrap_or("?"),
                v["hz"],
                v["token"]
            );
            if let Some(m) = v["replicas"].as_object() {
                for (name, ans) in m {
                    if ans["ok"] == true {
                        println!("  {name}: protected to {}", ans["backups"]);
                    } else {
                        println!("  {name}: failed: {}", ans["error"].as_str().unwrap_or("?"));
                    }
                }
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn hosts_are_one_line_each_and_a_host_not_up_is_a_warning() {
        let v = serde_json::json!([
            {"name": "h1", "state": "up", "for_ms": 5, "replicas": [
                {"replica": "r1", "state": "running"}]},
            {"name": "h2", "state": "dead", "for_ms": 7, "last_error": "timed out",
             "replicas": [{"replica": "r2", "state": "died", "exit": "killed by signal 9"}]},
        ]);
        let l = super::host_lines(&v);
        assert_eq!(l[0], "host h1 up for 5 ms: r1 running");
        assert_eq!(
            l[1],
            "WARNING: host h2 dead for 7 ms: r2 died (killed by signal 9) (timed out)"
        );
        assert!(super::host_lines(&serde_json::Value::Null).is_empty());
    }

    use super::*;

    #[test]
    fn the_unprotected_warning_names_each_replica_and_the_floor() {
        assert_eq!(unprotected_warning(&json!([]), &json!(2)), None);
        assert_eq!(unprotected_warning(&Value::Null, &json!(2)), None);
        let w = unprotected_warning(&json!([3]), &json!(2)).unwrap();
        assert!(
            w.starts_with("WARNING: ") && w.contains("r3 runs unprotected"),
            "{w}"
        );
        assert!(w.contains("at least 2 live replicas"), "{w}");
        let w = unprotected_warning(&json!([1, 4]), &json!(2)).unwrap();
        assert!(w.contains("r1, r4 run unprotected"), "{w}");
    }
}
