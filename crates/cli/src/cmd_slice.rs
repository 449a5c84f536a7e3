//! `pliant slice`: live TCP sessions moved between server instances (pliant-slice, see
//! crates/slice/README.md).
//!
//! - `serve`: runs the example server (`LineApp`, the demo's line-hash protocol) until
//!   SIGINT/SIGTERM, with a control channel when `--control` is given.
//! - `list`, `stats`, `migrate`: an operator's commands, over a running instance's control
//!   channel (pliant-wire, authenticated: the identity must hold the admin or controller role;
//!   `pliant keys issue --ca DIR --name op --role admin --out DIR/op` makes one).
//!
//! Session ids are hexadecimal, as `list` prints them.

use crate::signals::TermSignals;
use clap::{Args, Subcommand};
use pliant_slice::control::{Client, Outcome, SessionInfo, StatsReport, Which};
use pliant_slice::demo::{self, ServeArgs};
use pliant_wire::{Endpoint, Security};
use serde_json::{json, Value};
use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(Args)]
pub struct SliceArgs {
    #[command(subcommand)]
    cmd: SliceCmd,
}

#[derive(Subcommand)]
enum SliceCmd {
    /// Run the example session server until SIGINT/SIGTERM.
    ///
    /// Line protocol: each line a client sends is answered with "<lines> <hash of everything
    /// received>". Prints `ready clients=... peer=... control=...` once listening. The
    /// identity is a replica identity (`pliant keys issue --role replica`) whose name is
    /// --name. Needs root (TCP_REPAIR, tc-BPF).
    Serve(ServeArgs),
    /// List a running instance's sessions: hex id and client address, one per line.
    ///
    /// The identity must hold the admin or controller role (`pliant keys issue --ca DIR --name
    /// op --role admin --out DIR/op`) and be of the instance's CA.
    List {
        #[command(flatten)]
        at: InstanceArgs,
        /// One JSON object on stdout.
        #[arg(long)]
        json: bool,
    },
    /// A running instance's counters (sessions, accepted, moved in and out, refusals, hold).
    Stats {
        #[command(flatten)]
        at: InstanceArgs,
        /// One JSON object on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Move live sessions of a running instance to another one, one at a time.
    ///
    /// Prints one line per session (`moved ID pause_us=N capsule=BYTES`, or `failed ID WHY`: a
    /// session that fails stays where it was) and a summary (`done: moved N, failed N, pause
    /// p50 .. us, p99 .. us`); a progress line on stderr every second. Exits non-zero if any
    /// session failed. A session id the instance does not serve moves nothing.
    Migrate {
        #[command(flatten)]
        at: InstanceArgs,
        /// The destination's slice channel (its `serve --peer`).
        #[arg(long)]
        to: Endpoint,
        /// The destination's name (its certificate must carry it).
        #[arg(long)]
        to_name: String,
        /// Sessions to move (hex ids as `list` prints them; repeat or list several).
        #[arg(long = "session", num_args = 1.., value_parser = parse_id, required_unless_present = "all", conflicts_with = "all")]
        sessions: Vec<u64>,
        /// Move every session the instance serves.
        #[arg(long)]
        all: bool,
        /// One JSON object on stdout.
        #[arg(long)]
        json: bool,
    },
}

/// Which instance, and who asks.
#[derive(Args)]
struct InstanceArgs {
    /// The instance's control channel (its `serve --control`).
    #[arg(long)]
    instance: Endpoint,
    /// This operator's identity directory (admin or controller role, same CA as the instance).
    #[arg(long)]
    identity: PathBuf,
    /// The instance must prove this name (default: any replica identity of the CA).
    #[arg(long)]
    instance_name: Option<String>,
    /// Connect and handshake timeout, seconds.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=300))]
    timeout_s: u64,
}

impl InstanceArgs {
    fn connect(&self) -> Result<Client, String> {
        let sec = Security::load(&self.identity, Default::default())
            .map_err(|e| format!("identity {}: {e}", self.identity.display()))?;
        Client::connect(
            &self.instance,
            &sec,
            self.instance_name.as_deref(),
            Duration::from_secs(self.timeout_s),
        )
        .map_err(|e| e.to_string())
    }
}

fn parse_id(s: &str) -> Result<u64, String> {
    let h = s.strip_prefix("0x").unwrap_or(s);
    u64::from_str_radix(h, 16).map_err(|e| format!("session id {s:?} is not hexadecimal: {e}"))
}

pub fn run(a: SliceArgs) -> Result<(), String> {
    match a.cmd {
        SliceCmd::Serve(a) => serve(&a),
        SliceCmd::List { at, json } => list(&at, json),
        SliceCmd::Stats { at, json } => stats(&at, json),
        SliceCmd::Migrate {
            at,
            to,
            to_name,
            sessions,
            all,
            json,
        } => {
            let which = if all {
                Which::All
            } else {
                Which::Ids(sessions)
            };
            migrate(&at, &to, &to_name, which, json)
        }
    }
}

fn serve(a: &ServeArgs) -> Result<(), String> {
    // Blocked before any thread starts: every thread inherits the mask.
    let signals = TermSignals::block()?;
    let inst = demo::start(a)?;
    println!("{}", demo::ready_line(&inst));
    let _ = std::io::stdout().flush();
    let sig = loop {
        if let Some(sig) = signals.wait(Duration::from_secs(1)) {
            break sig;
        }
    };
    eprintln!(
        "pliant slice: signal {sig}; stopping ({} sessions closed)",
        inst.session_ids().len()
    );
    drop(inst);
    Ok(())
}

fn session_json(s: &SessionInfo) -> Value {
    json!({"id": format!("{:x}", s.id), "client": s.client.map(|c| c.to_string())})
}

fn list(at: &InstanceArgs, json: bool) -> Result<(), String> {
    let sessions = at.connect()?.list().map_err(|e| e.to_string())?;
    if json {
        let v: Vec<Value> = sessions.iter().map(session_json).collect();
        println!(
            "{}",
            json!({"instance": at.instance.to_string(), "sessions": v})
        );
        return Ok(());
    }
    // Written, not println!'d: a reader that stops early (`| head`) ends the listing quietly.
    let mut out = std::io::stdout().lock();
    for s in &sessions {
        let client = s.client.map_or_else(|| "-".into(), |c| c.to_string());
        match writeln!(out, "{:x} {client}", s.id) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => return Ok(()),
            Err(e) => return Err(format!("stdout: {e}")),
        }
    }
    Ok(())
}

fn stats(at: &InstanceArgs, json: bool) -> Result<(), String> {
    let s: StatsReport = at.connect()?.stats().map_err(|e| e.to_string())?;
    let v = json!({
        "name": s.name,
        "sessions": s.sessions,
        "accepted": s.accepted,
        "moved_out": s.moved_out,
        "moved_in": s.moved_in,
        "refused_peers": s.refused_peers,
        "aborted_handshakes": s.aborted_handshakes,
        "refused_capsules": s.refused_capsules,
        "session_errors": s.session_errors,
        "refused_controls": s.refused_controls,
        "hold": s.hold,
    });
    if json {
        println!("{v}");
        return Ok(());
    }
    if let Value::Object(m) = v {
        for (k, v) in m {
            println!(
                "{k} {}",
                v.as_str().map_or_else(|| v.to_string(), str::to_string)
            );
        }
    }
    Ok(())
}

/// How often the progress line is printed during a long migration.
const PROGRESS_EVERY: Duration = Duration::from_secs(1);

fn migrate(
    at: &InstanceArgs,
    to: &Endpoint,
    to_name: &str,
    which: Which,
    json: bool,
) -> Result<(), String> {
    let mut c = at.connect()?;
    let started = Instant::now();
    let mut last = started;
    let (mut moved, mut failed) = (0u64, 0u64);
    let outcomes = c
        .migrate(to, to_name, which, |o, total| {
            match o {
                Outcome::Moved { .. } => moved += 1,
                Outcome::Failed { .. } => failed += 1,
            }
            if !json {
                println!("{o}");
            }
            if last.elapsed() >= PROGRESS_EVERY {
                last = Instant::now();
                eprintln!(
                    "pliant slice: {}/{total} done ({moved} moved, {failed} failed) in {:.1} s",
                    moved + failed,
                    started.elapsed().as_secs_f64()
                );
            }
        })
        .map_err(|e| e.to_string())?;
    let pauses: Vec<u64> = outcomes
        .iter()
        .filter_map(|o| match o {
            Outcome::Moved { pause_us, .. } => Some(*pause_us),
            Outcome::Failed { .. } => None,
        })
        .collect();
    let (p50, p99, _) = pliant_runtime::migrate::percentiles(pauses);
    let secs = started.elapsed().as_secs_f64();
    if json {
        let each: Vec<Value> = outcomes.iter().map(outcome_json).collect();
        println!(
            "{}",
            json!({
                "moved": moved, "failed": failed,
                "pause_us_p50": (moved > 0).then_some(p50),
                "pause_us_p99": (moved > 0).then_some(p99),
                "seconds": secs, "sessions": each,
            })
        );
    } else {
        println!(
            "done: moved {moved}, failed {failed}, pause p50 {p50} us, p99 {p99} us ({secs:.2} s)"
        );
    }
    if failed > 0 {
        return Err(format!(
            "{failed} of {} sessions did not move",
            outcomes.len()
        ));
    }
    Ok(())
}

fn outcome_json(o: &Outcome) -> Value {
    match o {
        Outcome::Moved {
            id,
            pause_us,
            capsule_bytes,
        } => json!({"id": format!("{id:x}"), "moved": true, "pause_us": pause_us,
                    "capsule_bytes": capsule_bytes}),
        Outcome::Failed { id, reason } => {
            json!({"id": format!("{id:x}"), "moved": false, "error": reason})
        }
    }
}

#[cfg(test)]
mod tests {
    use super::parse_id;

    #[test]
    fn session_ids_are_hex_as_list_prints_them() {
        assert_eq!(parse_id("ff"), Ok(255));
        assert_eq!(parse_id("0xFF"), Ok(255));
        assert_eq!(parse_id(&format!("{:x}", u64::MAX)), Ok(u64::MAX));
        assert!(parse_id("zz").unwrap_err().contains("\"zz\""));
        assert!(parse_id("").is_err());
        assert!(parse_id("1ffffffffffffffff").is_err());
    }
}
