//! pliant-slice-demo: the line-hash session server (see `pliant_slice::demo`) as a process that
//! hands its sessions to a peer instance and takes sessions from one.
//!
//! ```text
//! pliant-slice-demo keys DIR NAME...      a CA and one identity directory DIR/NAME per name
//! pliant-slice-demo serve --name N --identity DIR/N --clients 127.0.0.1:7000 --peer 127.0.0.1:7100
//! ```
//! `serve` prints `ready clients=ADDR peer=ENDPOINT` (and `control=ENDPOINT` with `--control`,
//! the channel `pliant slice` commands use) once listening, then reads commands on
//! its standard input, one per line, and answers each on its standard output:
//! - `list`: `sessions ID...` (hex ids);
//! - `move ID|all PEER-ENDPOINT PEER-NAME`: one `moved ID pause_us=N capsule=BYTES` or
//!   `failed ID REASON` line per session, then `done`;
//! - `stats`: counters; `replication`: replication and output-commit counters
//!   (`pliant_slice::replicate::RepStats::line`); `quit` (or end of input): stop, closing the
//!   sessions still here.
//!
//! `serve --backup ENDPOINT --backup-name NAME` replicates every session to that instance,
//! where they continue if this process dies.

use clap::{Parser, Subcommand};
use pliant_slice::control::Outcome;
use pliant_slice::demo::{self, ServeArgs};
use pliant_wire::Endpoint;
use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::sync::atomic::Ordering;

#[derive(Parser)]
#[command(about = "Example session server whose live TCP sessions move between instances")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Makes a CA in DIR and an identity directory DIR/NAME (replica role) for each name.
    Keys { dir: PathBuf, names: Vec<String> },
    /// Serves clients and takes commands on stdin.
    Serve(ServeArgs),
}

fn main() {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Keys { dir, names } => demo::keys(&dir, &names),
        Cmd::Serve(a) => serve(&a),
    };
    if let Err(e) = r {
        eprintln!("pliant-slice-demo: {e}");
        std::process::exit(1);
    }
}

fn serve(a: &ServeArgs) -> Result<(), String> {
    let inst = demo::start(a)?;
    let out = std::io::stdout();
    let say = |line: String| {
        let mut o = out.lock();
        let _ = writeln!(o, "{line}");
        let _ = o.flush();
    };
    say(demo::ready_line(&inst));
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["list"] => say(format!("sessions {}", ids(&inst.session_ids()))),
            ["move", which, ep, peer_name] => {
                let Ok(ep) = ep.parse::<Endpoint>() else {
                    say(format!("error bad endpoint {ep:?}"));
                    continue;
                };
                let targets = if *which == "all" {
                    inst.session_ids()
                } else {
                    match u64::from_str_radix(which, 16) {
                        Ok(id) => vec![id],
                        Err(_) => {
                            say(format!("error bad session id {which:?}"));
                            continue;
                        }
                    }
                };
                inst.migrate_each(&targets, &ep, peer_name, |id, r| {
                    say(Outcome::of(id, r).to_string());
                    true
                });
                say("done".into());
            }
            ["stats"] => {
                let s = inst.stats();
                say(format!(
                    "stats accepted={} moved_out={} moved_in={} refused_peers={} \
                     refused_capsules={} session_errors={}",
                    s.accepted.load(Ordering::Relaxed),
                    s.moved_out.load(Ordering::Relaxed),
                    s.moved_in.load(Ordering::Relaxed),
                    s.refused_peers.load(Ordering::Relaxed),
                    s.refused_capsules.load(Ordering::Relaxed),
                    s.session_errors.load(Ordering::Relaxed),
                ))
            }
            ["replication"] => say(format!(
                "replication {}",
                inst.replication().line(inst.hold().commit_stats())
            )),
            ["quit"] => break,
            [] => {}
            _ => say(format!("error unknown command {line:?}")),
        }
    }
    Ok(())
}

fn ids(v: &[u64]) -> String {
    v.iter()
        .map(|i| format!("{i:x}"))
        .collect::<Vec<_>>()
        .join(" ")
}
