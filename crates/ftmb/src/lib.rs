//! pliant-ftmb: rollback recovery for multi-threaded network functions after FTMB (SIGCOMM'15,
//! seed 002): instead of checkpointing state before output leaves (Pico), log the *determinants*
//! of execution (order of accesses to shared state, clock and RNG values) and the input, so
//! output waits only for small log records, and a standby rebuilds state by replaying.
//!
//! The pieces, in the order a packet meets them:
//! 1. [`input::InputLogger`] gives each input packet a per-queue sequence number and holds it
//!    until a snapshot covers it;
//! 2. a [`master::Worker`] (one per queue, flows pinned by hash) processes it; every access to
//!    a [`master::SharedVar`] takes the variable's lock and enqueues a PAL on the worker's queue
//!    *before the lock is released* (design invariant 4's precondition); clock and RNG reads
//!    made through [`master::Determinants`] enqueue value-PALs;
//! 3. output is queued behind the worker's PALs with a VOR (the max PAL seq of every queue);
//!    a [`transport::LogTransport`] carries each queue's stream to the [`logger::OutputLogger`],
//!    which releases a packet once every queue's contiguous logged PAL seq reaches its VOR
//!    (parallel release), requesting retransmission of gaps;
//! 4. after a failure, [`logger::OutputLogger::recover`] cuts the logs to a consistent prefix
//!    and hands back per-queue replay schedules; a [`master::Master`] built with
//!    [`master::Master::recovering`] replays input from the [`wire::Snapshot`]'s positions with
//!    PAL-gated lock acquisition and logged clock/RNG values, while the logger suppresses output
//!    already released; each worker goes live when its schedule runs out.
//!
//! Between processes, [`net::NetTransport`] (one per worker queue) and [`net::SnapshotLink`]
//! carry the same streams, plus each packet's input record ([`wire::LogMsg::Input`]) and the
//! snapshots, in sealed pliant-wire frames (unix socket or TCP, replica identities) to a
//! [`server::LoggerServer`] hosted by another replica, which hands a standby a
//! [`server::RecoveryBundle`] after a failure.

mod commit;
pub mod input;
pub mod logger;
pub mod master;
pub mod net;
pub mod server;
pub mod transport;
pub mod wire;

pub use input::{InputError, InputLogger, InputStats};
pub use logger::{
    AuditEvent, LoggerConfig, LoggerError, LoggerStats, OutputLogger, Recovery, Released,
};
pub use master::{
    Determinants, FtmbError, Master, MasterConfig, SharedVar, UnlockEvent, UnlockProbe, Worker,
    WorkerStats,
};
pub use net::{
    HeldOutputs, LoggerAddr, NetError, NetOptions, NetStats, NetTransport, ReleaseSink,
    SnapshotLink,
};
pub use server::{LoggerServer, RecoveryBundle, ReleaseFn, ServerOptions, ServerStats};
pub use transport::{spawn_logger, ChannelTransport, LogTransport, LoggerHandle, TransportError};
pub use wire::{
    Feedback, LogBatch, LogMsg, NetMsg, OutputId, PacketId, Pal, PalKind, QueueId, RecordDelta,
    Snapshot, SnapshotMsg, StreamKind, VarId,
};
