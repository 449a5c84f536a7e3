//! pliant-state: the Split/Merge state API (seed 000, ch. 3, Fig 3.5; Pico ch. 4 adds `modified`).
//!
//! The library is the only allocator of *external* NF state:
//! - partitioned per-flow state ([`FlowTable`]) with refcount transactions and per-flow timers,
//!   exportable as bytes and importable on another instance ([`FlowTable::export_flow`]);
//! - coherent shared state ([`SharedStore`]) with combiners (eventual consistency) or SYNCH
//!   (strong consistency through a lock service).
//!
//! Time is always passed in (`now: Instant`) so that tests and simulations are deterministic.

pub mod error;
pub mod flow;
pub mod key;
pub mod shared;

pub use error::StateError;
pub use flow::{
    FlowRef, FlowState, FlowTable, TableConfig, TableStats, TimerId, EXPORT_FORMAT_VERSION,
    MAX_ALIASES_PER_FLOW,
};
pub use key::{Dir, FlowKey, ParseFlowKeyError};
pub use shared::{
    combiner_max_u64, combiner_sum_u64, decode_u64, Coherence, Combiner, GetFlags, HubConfig,
    LocalCoherence, LockService, LockToken, MergeReport, PutFlags, ReplicaId, SharedConfig,
    SharedExport, SharedRef, SharedStats, SharedStore,
};
