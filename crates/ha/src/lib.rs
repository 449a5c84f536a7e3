//! pliant-ha: the pieces of Pico replication (and its Remus-mode baseline) that do not depend on
//! the packet thread, so they can be tested deterministically and reused by the runtime.
//!
//! Where a checkpoint goes:
//! 1. [`policy`] assigns each flow to a replication group (backup target + frequency);
//! 2. the runtime snapshots a group's modified flows at epoch end and encodes them as a
//!    [`wire::Checkpoint`] (modified flows only, [`delta`] against the last shipped bytes);
//! 3. [`transport`] ships it over an authenticated pliant-wire session (unix or TCP) to the
//!    backup, where
//!    [`standby::StandbyStore`] keeps it (never handed to the NF) and the backup acknowledges;
//! 4. the ack comes back to the primary, where [`gate::OutputGate`] releases the output that
//!    depended on that checkpoint (design invariant 3); [`audit::ExitAudit`] checks every
//!    packet that leaves against the acks themselves, independently of the gate.
//!
//! On failover the controller asks the backup to *activate*: the standby records are imported
//! into the live flow table and steering moves the flows there.

pub mod audit;
pub mod delta;
pub mod gate;
pub mod policy;
pub mod standby;
pub mod transport;
pub mod wire;

pub use standby::{Activated, StandbyError, StandbyStats, StandbyStore};
pub use transport::{
    LinkState, ReplSender, ReplServer, SendError, SenderOptions, SenderStats, ServerStats,
    TransportError,
};
pub use wire::{Ack, Checkpoint, FlowUpdate, GroupId, ReplMsg, UpdateBody};
