//! pliant-slice: a client session's state across layers, moved live as one unit.
//!
//! A [`Slice`] is one client session: its kernel capsule (the socket's TCP state, captured and
//! restored with TCP_REPAIR: [`repair`]), the output the server had produced and not yet
//! written, and its application capsule (bytes the application serialises), under one session
//! id, in one versioned format ([`format`]). [`migrate`] moves a session between two running
//! instances on one host over an authenticated pliant-wire channel, with its packets held
//! ([`hold`]) while no socket owns the connection, so the live TCP connection survives the move
//! without a reset. [`instance`] is a session server built on it; [`demo`] is its example
//! application. [`replicate`] keeps a backup instance's copy of every session, with output
//! commit, so the sessions of a primary that dies continue there.

pub mod batch;
pub mod bench;
pub mod capsule;
pub mod control;
pub mod demo;
pub mod format;
pub mod hold;
pub mod instance;
pub mod load;
pub mod migrate;
pub mod nfnl;
pub mod repair;
pub mod replicate;

pub use capsule::{Slice, TcpCapsule, TcpOptions, TcpWindow};
pub use format::{decode, encode, FormatError, FORMAT_VERSION};
pub use repair::RepairError;
