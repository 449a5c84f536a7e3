//! pliant-pg: RemusDB's guarantees for PostgreSQL at the service boundary.
//!
//! - [`cluster`]: a primary and a synchronous hot standby in network namespaces (2-safe
//!   commit protection: only commits wait for the standby), fencing, pg_rewind re-protection.
//! - [`proxy`]: a PostgreSQL-protocol proxy that owns client sessions and moves them at
//!   failover (idle sessions replayed, open transactions aborted with an error, in-flight
//!   COMMITs resolved with `txid_status`).
//! - [`session`]: the per-session state machine behind the proxy (pure, unit-tested).
//! - [`proto`], [`client`]: a small v3 protocol codec and blocking client; [`scram`]:
//!   SCRAM-SHA-256 both sides.
//! - [`health`]: when the primary counts as dead (pure failure detector);
//!   [`secrets`]: randomness, constant-time comparison, private files.
//! - [`bench`]: `pliant bench pg`; [`patroni`]: its Patroni + etcd peer.

pub mod bank;
pub mod bench;
pub mod client;
pub mod cluster;
pub mod cmd;
pub mod health;
pub mod patroni;
pub mod proto;
pub mod proxy;
pub mod scram;
pub mod secrets;
pub mod session;
pub mod startup;
pub mod tls;
