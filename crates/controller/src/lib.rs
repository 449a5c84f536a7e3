//! pliant-controller: the elasticity controller (FreeFlow's orchestrator + SDN controller
//! roles for one host).
//!
//! - [`controller::Controller`]: membership by heartbeat (`stats` over each replica's control
//!   socket), load (flows, packets/s), migrations (replica protocol + steering exceptions for
//!   every key and alias), scale-out/in (agent + fabric + NAT port blocks + ring), policies.
//! - [`policy`]: pure, deterministic decisions over a load snapshot.
//! - [`store`]: the `pliant-store` crate: the [`store::Store`] trait (etcd-shaped), the embedded
//!   [`store::FileStore`] and [`store::EtcdStore`] (`[store] backend = "etcd"`).
//! - [`http`] + [`auth`] + [`api`]: the authenticated HTTP/JSON API (unix socket 0600,
//!   optional TCP), bearer token from a 0600 file.
//! - [`agent`]: starting/stopping replicas (`LabAgent`: namespaces of a running lab).
//! - [`steering`]: the fabric behind a trait (`FabricSteering`: pliant-steer's tc-BPF maps).
//! - [`ha`]: high availability (Pico replication): `[ha]` config, protection policies,
//!   liveness probe; failover and re-protection live in `controller/failover.rs`.
//! - [`protection`]: when a re-protection may start and which replicas it may name (pure,
//!   property-tested over random orders of kills, reports, probes and failovers).
//! - [`daemon`]: `pliant controller --config ctl.toml`.

pub mod agent;
pub mod api;
pub mod auth;
pub mod config;
pub mod controller;
pub mod daemon;
pub mod ha;
pub mod hosts;
pub mod http;
pub mod metrics;
pub mod migrator;
pub mod policy;
pub mod ports;
pub mod protection;
pub mod replica_client;
pub mod steering;
pub use pliant_store as store;

pub use controller::{Controller, ControllerError, Settings};
