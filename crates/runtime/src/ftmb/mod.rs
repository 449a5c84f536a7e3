//! FTMB runtime mode: the replica's IP packets are processed by N worker threads
//! running an [`nf::FtmbNf`], with ordered logging to a logger hosted by another replica.
//!
//! Threads and where a packet goes (crates/runtime/README.md, "FTMB mode"):
//! - the engine's I/O thread does everything it does in the other modes up to the NF call
//!   (parse, ARP, neighbours, offload fix-ups), then [`FtmbMode::dispatch`]es the packet to
//!   worker `queue_of(pkt)` through a bounded queue (full: dropped, counted);
//! - each worker thread (`worker`) logs the packet's input record, runs the NF between
//!   `Worker::begin`/`end` (shared variables leave PALs), and logs each output with its VOR;
//! - the logger releases output once its PALs are logged: before `ftmb_protect` an in-process
//!   logger (`local_logger`), after it the network logger of another replica, which confirms
//!   each release to us while we hold the payload (`pliant_ftmb::HeldOutputs`: output held by
//!   the logger host would die with it); released payloads come back to this engine through
//!   a bounded queue with a wake fd (`release`) and leave by the normal output path (a
//!   recovery's replayed output is released on the logger host, to its own engine);
//! - a coordinator thread (`coord`) takes snapshots at a barrier of all workers, switches
//!   loggers (`ftmb_protect`) and runs recoveries of another primary (`ftmb_activate`).
//!
//! The engine holds a `Box<dyn FtmbMode>` so `Engine<N, P>` keeps its two generics.

mod coord;
pub mod frame;
mod front;
mod local_logger;
pub mod nf;
mod release;
pub mod shell;
mod worker;

/// A tiny NAT on the FTMB contract for the runtime's own tests (`engine/tests_ftmb.rs`).
#[cfg(test)]
pub(crate) mod testnf;

pub use front::{start, FtmbOptions};
pub use nf::{FlowDelta, FlowRecord, FtmbNf};
pub use shell::FtmbShell;

use crate::nf::{Output, Packet};
use serde_json::Value;
use std::os::fd::RawFd;
use std::sync::mpsc::SyncSender;

/// The output-commit audit in an `ftmb_status` answer: (outputs checked, violations), summed
/// over every logger that released output to this replica's ports: the hosted network
/// logger's per-primary counts (`hosting.masters.<primary>.logger`) and the in-process
/// loggers' (`local_audit`). Each output is checked as its logger hands it out for
/// transmission (`pliant_ftmb::OutputLogger::drain_released`). A recovered primary's hosted
/// logger leaves `hosting` with it (its later output is counted in `local_audit`), so sample
/// before a recovery to keep what it had checked. Not audited, because they depend on no PAL:
/// what the engine sends without the NF (ARP, answers to pings of the gateway address).
pub fn audit_totals(status: &Value) -> (u64, u64) {
    let count = |v: &Value, k: &str| v[k].as_u64().unwrap_or(0);
    let mut checked = count(&status["local_audit"], "audit_checked");
    let mut violations = count(&status["local_audit"], "audit_violations");
    if let Some(masters) = status["hosting"]["masters"].as_object() {
        for m in masters.values() {
            checked = checked.saturating_add(count(&m["logger"], "audit_checked"));
            violations = violations.saturating_add(count(&m["logger"], "audit_violations"));
        }
    }
    (checked, violations)
}

/// A control request for the FTMB mode (see the contract's "Control commands").
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FtmbCmd {
    /// Log to the logger listening at `logger` (another replica's `.ftmb.sock`, or TCP
    /// `host:port`), hosted by replica `host` if given (checked in the handshake).
    Protect {
        logger: String,
        host: Option<String>,
    },
    Status,
    /// Start holding packets for the recovery of `primary` (its `Activate` follows; see
    /// `FtmbOptions::hold_limit`).
    Hold {
        primary: String,
    },
    /// Recover the primary `primary` whose logger this replica hosts, and import its flows.
    Activate {
        primary: String,
    },
    /// `flows`: the live flows' steering keys (key + aliases), at most `max` listed.
    Flows {
        max: usize,
    },
}

/// The engine's view of the FTMB mode. Object safe: the engine stores `Box<dyn FtmbMode>`.
pub trait FtmbMode: Send {
    /// Hands one IP packet to its worker (or holds it while a recovery runs). A packet that
    /// cannot be taken comes back with the drop reason, for the engine to count and recycle.
    fn dispatch(&mut self, pkt: Packet) -> Option<(Packet, &'static str)>;

    /// Once per round: released output (decoded) into `out`, packets held during a recovery
    /// to their workers once it finished, and drops counted since the last call to `drop`.
    fn poll(&mut self, out: &mut Vec<Output>, drop: &mut dyn FnMut(&'static str, u64));

    /// Readable when released output is waiting (the engine polls it while asleep).
    fn wake_fd(&self) -> RawFd;

    /// Empties the wake fd after poll(2) reported it readable.
    fn drain_wake(&self);

    /// The `ftmb_status` answer (never waits for the coordinator).
    fn status(&self) -> Value;

    /// Serves `cmd`; the answer goes to `reply`, possibly later (protect, activate).
    fn command(&mut self, cmd: FtmbCmd, reply: SyncSender<Value>);
}
