//! `pliant replica|stats|query`: run one replica, and talk to a running one over its control
//! socket.
//!
//! The NF is chosen here from `nf.kind` with a `match` over the NF crates, so the engine is
//! monomorphised per NF (no dynamic dispatch per packet).

use clap::Args;
use pliant_proto::Request;
use pliant_runtime::config::{nf_section, ReplicaConfig};
use pliant_runtime::{forward, replica, NetworkFunction};
use serde::de::DeserializeOwned;

#[derive(Args)]
#[command(
    after_help = "Runs one replica until SIGTERM/SIGINT or a `shutdown` control request.\n\n\
        The config is validated first (a bad file is refused with its line and the reason, \
        nothing started). On start-up the replica disables IPv6 on its two interfaces, refuses \
        to start if they carry IP addresses, and installs a tc ingress drop filter so the \
        namespace's kernel never reacts to frames the runtime owns; clean shutdown removes the \
        filter and the control socket.\n\n\
        Logs go to stderr: PLIANT_LOG sets the level/filter (default info), \
        PLIANT_LOG_FORMAT=json selects JSON lines. PLIANT_VNET_HDR=0 opens the ports without \
        virtio_net_hdr offloads (then neighbours must not send GSO super-frames)."
)]
pub struct ReplicaArgs {
    /// Replica configuration file (TOML).
    #[arg(long)]
    pub config: String,
    /// Validate the configuration and exit without starting anything.
    #[arg(long)]
    pub check: bool,
}

#[derive(Args)]
#[command(
    about = "Print a running replica's counters (frames, drops by reason, flows, neighbours)"
)]
pub struct StatsArgs {
    /// The replica's control endpoint: its unix socket, or the TCP `host:port` of its
    /// `control_listen`.
    #[arg(long)]
    pub socket: String,
    /// Identity directory to authenticate with (ADMIN or CONTROLLER role; see `pliant keys`).
    /// Default: none, or the lab's admin identity for a socket in a lab's run directory or
    /// in one of its hosts' directories.
    #[arg(long)]
    pub identity: Option<std::path::PathBuf>,
    /// Print the raw JSON answer instead of a summary.
    #[arg(long)]
    pub json: bool,
    /// Print the Prometheus text exposition instead.
    #[arg(long, conflicts_with = "json")]
    pub metrics: bool,
    /// Print the high-availability status instead (JSON: mode, groups with their seqs and
    /// held output, output-commit counters, standby copies, replication links).
    #[arg(long, conflicts_with_all = ["json", "metrics"])]
    pub ha: bool,
}

#[derive(Args)]
#[command(
    about = "Print NF-specific state of a running replica (e.g. NAT mappings, IDS alerts) as JSON"
)]
pub struct QueryArgs {
    /// The replica's control endpoint (unix socket or TCP `host:port`).
    #[arg(long)]
    pub socket: String,
    /// Identity directory to authenticate with (as for `pliant stats`).
    #[arg(long)]
    pub identity: Option<std::path::PathBuf>,
}

fn section<T: DeserializeOwned>(text: &str, file: &str, kind: &str) -> Result<T, String> {
    nf_section(text, file, kind).map_err(|e| e.to_string())
}

/// Builds the NF named by `nf.kind` (so its section is validated) and, unless `check_only`,
/// runs the replica with it.
fn dispatch(cfg: &ReplicaConfig, text: &str, file: &str, check_only: bool) -> Result<(), String> {
    fn go<N: NetworkFunction>(cfg: &ReplicaConfig, nf: N, check_only: bool) -> Result<(), String> {
        if check_only {
            println!(
                "config ok: nf {} for replica {:?}",
                N::NAME,
                cfg.replica.name
            );
            return Ok(());
        }
        replica::run(cfg, nf)
    }
    let kind = cfg.nf.kind.as_str();
    let bad = |e: String| format!("{file}: [{kind}]: {e}");
    if cfg.ftmb().is_some() {
        // `[ha] mode = "ftmb"`: the NF runs on FTMB worker threads (config validation
        // already refused every kind but nat).
        let nf = pliant_nf_nat::ftmb::FtmbNat::new(section(text, file, kind)?).map_err(bad)?;
        if check_only {
            println!(
                "config ok: nf {} in ftmb mode for replica {:?}",
                kind, cfg.replica.name
            );
            return Ok(());
        }
        return replica::run_ftmb(cfg, nf);
    }
    match kind {
        "nat" => go(
            cfg,
            pliant_nf_nat::Nat::new(section(text, file, kind)?).map_err(bad)?,
            check_only,
        ),
        "forward" => go(
            cfg,
            forward::Forward::new(section(text, file, kind)?).map_err(bad)?,
            check_only,
        ),
        "firewall" => go(
            cfg,
            pliant_nf_firewall::Firewall::new(section(text, file, kind)?).map_err(bad)?,
            check_only,
        ),
        "ids" => go(
            cfg,
            pliant_nf_ids::Ids::new(section(text, file, kind)?).map_err(bad)?,
            check_only,
        ),
        "mbserv" => go(
            cfg,
            pliant_nf_mbserv::MbServ::new(section(text, file, kind)?).map_err(bad)?,
            check_only,
        ),
        other => Err(format!(
            "{file}: nf.kind {other:?} is not built into this binary"
        )),
    }
}

pub fn run(a: ReplicaArgs) -> Result<(), String> {
    pliant_runtime::logging::init();
    let text = std::fs::read_to_string(&a.config)
        .map_err(|e| format!("{}: cannot read: {e}", a.config))?;
    let cfg = ReplicaConfig::parse(&text, &a.config).map_err(|e| e.to_string())?;
    dispatch(&cfg, &text, &a.config, a.check)
}

/// A client of the replica's control channel: with `--identity`, that identity; for a
/// socket in a lab's run directory, the lab's admin identity; else the local mode.
fn client(
    socket: &str,
    identity: Option<&std::path::Path>,
) -> Result<pliant_proto::Client, String> {
    let ep: pliant_wire::Endpoint = socket
        .parse()
        .map_err(|e| format!("--socket {socket:?}: {e}"))?;
    let sec = match identity {
        Some(d) => Some(
            pliant_wire::Security::load(d, pliant_wire::Encrypt::Auto)
                .map_err(|e| format!("--identity {}: {e}", d.display()))?,
        ),
        None => match &ep {
            pliant_wire::Endpoint::Unix(p) => pliant_lab::ha::lab_run_dir_of(p)
                .and_then(|run| pliant_lab::ha::lab_security(&run, pliant_lab::ha::ADMIN)),
            pliant_wire::Endpoint::Tcp(_) => None,
        },
    };
    Ok(pliant_proto::Client::new(ep, sec))
}

fn ask(
    socket: &str,
    identity: Option<&std::path::Path>,
    req: pliant_proto::Request,
) -> Result<serde_json::Value, String> {
    client(socket, identity)?
        .call(&req)
        .map_err(|e| e.to_string())
}

pub fn stats(a: StatsArgs) -> Result<(), String> {
    if a.metrics {
        let v = ask(&a.socket, a.identity.as_deref(), Request::Metrics)?;
        print!("{}", v["metrics"].as_str().unwrap_or_default());
        return Ok(());
    }
    if a.ha {
        println!(
            "{}",
            ask(&a.socket, a.identity.as_deref(), Request::HaStatus)?
        );
        return Ok(());
    }
    let v = ask(&a.socket, a.identity.as_deref(), Request::Stats)?;
    if a.json {
        println!("{v}");
        return Ok(());
    }
    println!(
        "replica {} (nf {}), up {:.1} s",
        v["replica"],
        v["nf"],
        v["uptime_s"].as_f64().unwrap_or(0.0)
    );
    for side in ["inside", "outside"] {
        let e = &v["engine"][side];
        let n = &v["neighbours"][side];
        println!(
            "  {side:<8} in {} frames / {} B, out {} frames / {} B, arp in {}, neighbours {}",
            e["frames_in"],
            e["bytes_in"],
            e["frames_out"],
            e["bytes_out"],
            e["arp_in"],
            n["entries"]
        );
    }
    let t = &v["table"];
    println!(
        "  flows {} (created {}, deleted {}), timers {}, state {} B",
        t["flows"], t["created"], t["deleted"], t["timers"], t["state_bytes"]
    );
    if let Some(d) = v["drops"].as_object().filter(|d| !d.is_empty()) {
        println!("  drops:");
        for (reason, n) in d {
            println!("    {reason:<28} {n}");
        }
    }
    if let Some(c) = v["nf_counters"].as_object().filter(|c| !c.is_empty()) {
        println!("  nf counters:");
        for (name, n) in c {
            println!("    {name:<28} {n}");
        }
    }
    Ok(())
}

pub fn query(a: QueryArgs) -> Result<(), String> {
    let v = ask(&a.socket, a.identity.as_deref(), Request::Query)?;
    println!(
        "{}",
        serde_json::to_string_pretty(&v["query"]).map_err(|e| e.to_string())?
    );
    Ok(())
}
