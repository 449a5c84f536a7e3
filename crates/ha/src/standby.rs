//! Standby state on a backup. CONTRACT (implemented by the ha-link helper):
//!
//! `StandbyStore` holds, per primary replica name and group, the latest applied checkpoint:
//! `key -> (version, full export record bytes)` plus the optional `shared` blob. It is fed by the
//! replication server thread ([`crate::transport::ReplServer`]) and is never handed to the NF
//! until activation (Pico's SMM standby state).
//!
//! ```ignore
//! pub struct StandbyStore { .. }  // bounded: max_flows total (over the bound: checkpoint Refused, counted)
//! impl StandbyStore {
//!     pub fn new(max_flows: usize) -> StandbyStore;
//!     /// Applies one checkpoint atomically (all of it or none: a delta whose base version is not
//!     /// held makes the whole checkpoint fail with an error, nothing applied). Returns the seq.
//!     pub fn apply(&mut self, primary: &str, token: u64, cp: &Checkpoint) -> Result<u64, StandbyError>;
//!     /// Highest applied seq per group for `primary` (for `Welcome`).
//!     pub fn held(&self, primary: &str) -> Vec<(GroupId, u64)>;
//!     /// Fencing: after activation under `token`, checkpoints from `primary` with a token
//!     /// < `token` are refused (StandbyError::Fenced).
//!     /// Takes every flow record of `primary` (all groups) for import into the live table and
//!     /// forgets them; also returns the newest `shared` blob.
//!     pub fn activate(&mut self, primary: &str, token: u64) -> Result<Activated, StandbyError>;
//!     /// Forgets a primary's standby state (it was re-protected elsewhere / scaled in).
//!     pub fn drop_primary(&mut self, primary: &str) -> usize;
//!     pub fn stats(&self) -> StandbyStats; // per primary: flows, groups, last seq, bytes, checkpoints applied, refused
//! }
//! pub struct Activated { pub records: Vec<Vec<u8>>, pub shared: Option<Vec<u8>>, pub last_seq: Vec<(GroupId, u64)> }
//! ```
