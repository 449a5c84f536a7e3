//! The contract between the FTMB runtime mode and a network function run on FTMB workers.
//!
//! A pico/remus NF (`NetworkFunction`) runs on the engine's single thread and keeps its flows in
//! the engine's `FlowTable`. An FTMB NF runs on N worker threads: flows are pinned to one worker
//! (`queue_of`), each worker owns its flows' records (`Local`, partitioned state, no lock), and
//! state shared between workers lives in `pliant_ftmb::SharedVar`s declared on the master
//! (`Shared`): every access goes through `Worker::access`, so it leaves a PAL, and clock/random
//! reads go through `Determinants` on the worker, so a standby can replay the run exactly.
//!
//! Rule for implementors: `process` must be deterministic given the packet, `Local`, and what
//! `Worker::access`/`now`/`random` return. No other clock, RNG, thread-local or global state.

use crate::nf::Packet;
use pliant_ftmb::{FtmbError, Master, QueueId, Worker};
use pliant_net::FlowKey;

/// One flow's partitioned record as a snapshot carries it: `key` and `record` are the NF's own
/// encoding (opaque to the runtime and the logger).
pub type FlowRecord = (Vec<u8>, Vec<u8>);

/// A change to a worker's partitioned state since the previous snapshot: `None` = deleted.
pub type FlowDelta = (Vec<u8>, Option<Vec<u8>>);

pub trait FtmbNf: Send + Sync + 'static {
    /// Name in logs and status (`"nat"`).
    const NAME: &'static str;
    /// Handles to the shared variables (built by `declare`, shared by all workers).
    type Shared: Send + Sync + 'static;
    /// One worker's partitioned state.
    type Local: Send + 'static;

    /// Declares the NF's shared variables on `master`: with `image == None` fresh initial
    /// values, else the values `save_shared` produced at a snapshot (recovery). Variable ids
    /// must be the same every time (the log refers to them).
    fn declare(&self, master: &Master, image: Option<&[u8]>) -> Result<Self::Shared, String>;

    /// Worker `queue`'s state: empty, or rebuilt from the records of a snapshot.
    fn new_local(&self, queue: QueueId, records: &[FlowRecord]) -> Result<Self::Local, String>;

    /// Which worker queue processes `pkt` (called on the I/O thread, must depend only on the
    /// packet headers): both directions of a flow must map to the same queue.
    fn queue_of(&self, pkt: &Packet, workers: usize) -> usize;

    /// Processes one packet on worker `w` (between the runtime's `w.begin` and `w.end`).
    /// Output goes to `out` (the runtime logs it with `w.output` and routes it after release);
    /// a dropped packet is simply not pushed (count the reason in `Local`).
    fn process(
        &self,
        sh: &Self::Shared,
        local: &mut Self::Local,
        w: &mut Worker,
        pkt: Packet,
        out: &mut Vec<Packet>,
    ) -> Result<(), FtmbError>;

    /// The shared variables' values, at a quiescent point (all workers parked); use
    /// `SharedVar::read_quiesced`.
    fn save_shared(&self, sh: &Self::Shared) -> Result<Vec<u8>, String>;

    /// Records of flows created, changed or deleted on this worker since the previous call
    /// (`full`: every live record, and forget the change tracking). Called on the worker's own
    /// thread at the snapshot barrier.
    fn take_delta(&self, local: &mut Self::Local, full: bool) -> Vec<FlowDelta>;

    /// Steering keys of a record (as the controller steers them after a failover): the flow's
    /// key as it arrives on the inside and the aliases under which its other direction arrives.
    fn steering_keys(&self, record: &FlowRecord) -> Option<(FlowKey, Vec<FlowKey>)>;

    /// The worker queue that owns `record` among `workers` (the queue `queue_of` gives its
    /// packets), for records imported from another primary.
    fn record_queue(&self, record: &FlowRecord, workers: usize) -> Option<usize>;

    /// Adds already-encoded records (recovered from another primary) to worker `queue`'s state
    /// at a quiescent point. The records' external ports belong to the dead primary's port
    /// block (quarantined by the controller), so they never collide with this NF's pool.
    fn import(&self, local: &mut Self::Local, records: Vec<FlowRecord>) -> Result<usize, String>;

    /// Counters and gauges for `ftmb_status` (flows, drops by reason, ...).
    fn local_stats(&self, local: &Self::Local) -> serde_json::Value;
}
