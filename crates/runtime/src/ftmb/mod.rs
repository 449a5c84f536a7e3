//! FTMB runtime mode (issue 6): the replica's IP packets are processed by N worker threads
//! running an [`nf::FtmbNf`], with ordered logging to a logger hosted by another replica.

pub mod nf;

pub use nf::{FlowDelta, FlowRecord, FtmbNf};
