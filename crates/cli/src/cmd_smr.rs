//! `pliant smr up`: an unmodified TCP server replicated by ordering its input (pliant-smr).
//! Starts N replicas in this process, each with its own copy of the server on a loopback port,
//! prints where clients connect (the leader's front), follows leadership changes, and stops
//! everything (servers killed by PID) on SIGINT/SIGTERM. See crates/smr/README.md.

use crate::signals::TermSignals;
use clap::{Args, Subcommand};
use pliant_smr::group::LocalGroup;
use pliant_smr::Limits;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Args)]
pub struct SmrArgs {
    #[command(subcommand)]
    cmd: SmrCmd,
}

#[derive(Subcommand)]
enum SmrCmd {
    /// Run N replicas of COMMAND until SIGINT/SIGTERM. COMMAND must contain `{port}`, replaced
    /// by the loopback port each copy listens on, e.g.
    /// `pliant smr up --replicas 3 -- redis-server --port {port} --bind 127.0.0.1 --save ''`.
    Up {
        #[arg(long, default_value_t = 3)]
        replicas: u64,
        /// Directory of the replicas' logs and peer sockets (emptied first).
        #[arg(long, default_value = "/run/pliant/smr")]
        dir: PathBuf,
        /// Peers over TCP loopback instead of unix sockets in --dir.
        #[arg(long)]
        tcp_peers: bool,
        /// How long a server copy may take to accept on its port, seconds.
        #[arg(long, default_value_t = 10)]
        ready_s: u64,
        #[arg(required = true, last = true)]
        command: Vec<String>,
    },
}

pub fn run(a: SmrArgs) -> Result<(), String> {
    match a.cmd {
        SmrCmd::Up {
            replicas,
            dir,
            tcp_peers,
            ready_s,
            command,
        } => up(replicas, dir, tcp_peers, ready_s, command),
    }
}

fn up(n: u64, dir: PathBuf, tcp: bool, ready_s: u64, command: Vec<String>) -> Result<(), String> {
    if n == 0 {
        return Err("--replicas must be at least 1".into());
    }
    if !command.iter().any(|a| a.contains("{port}")) {
        return Err("COMMAND must contain {port} (each copy's loopback port)".into());
    }
    // Blocked before any thread starts, so every thread inherits the mask and the signals
    // wait for sigwait below (std's spawn gives children an empty mask again).
    let signals = TermSignals::block()?;
    let argv = Box::new(move |port: u16| {
        command
            .iter()
            .map(|a| a.replace("{port}", &port.to_string()))
            .collect()
    });
    let mut g = LocalGroup::new(dir, n, tcp, Limits::default(), argv).map_err(|e| e.to_string())?;
    g.server_ready = Duration::from_secs(ready_s);
    for id in 1..=n {
        g.start_replica(id).map_err(|e| e.to_string())?;
    }
    for r in g.live() {
        eprintln!(
            "pliant smr: replica {} front {} server {}",
            r.id,
            g.front_addr(r.id).unwrap_or_default(),
            g.server_addr(r.id)
                .map(|a| a.to_string())
                .unwrap_or_default()
        );
    }
    let mut shown = 0;
    loop {
        if let Some(sig) = signals.wait(Duration::from_millis(200)) {
            eprintln!("pliant smr: signal {sig}; stopping replicas and servers");
            break;
        }
        if let Some(r) = g.live().find(|r| r.is_leader()) {
            if r.id != shown {
                shown = r.id;
                println!(
                    "leader {} clients -> {}",
                    r.id,
                    g.front_addr(r.id).unwrap_or_default()
                );
            }
        }
    }
    drop(g);
    Ok(())
}
