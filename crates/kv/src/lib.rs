//! pliant-kv: an elastic partitioned in-memory database on Redis Cluster. Lab hosts are network
//! namespaces with CPU quotas (cgroup v1); each partition is a fixed slot range with a master
//! and `k` replicas on distinct hosts; pliant-placement decides where copies live, and moves
//! keep `k + 1` caught-up copies of every partition at every instant.
//!
//! - [`slots`]: slot ranges and the key → slot hash;
//! - [`parse`]: `INFO` and `CLUSTER NODES`;
//! - [`invariant`]: the k+1 rule;
//! - [`planning`]: the placement problem from measurements, planner runs, plan → steps;
//! - [`state`]: `state.json`; [`host`]: namespaces, veths, cgroups; [`node`]: one redis-server;
//! - [`cluster`]: up, open, down; [`moves`]: one move; [`scale`]: plan and execute;
//! - [`monitor`]: the sampler; [`autoscale`]: the automatic loop (a pure decision per round);
//! - [`loadgen`]: open-loop acknowledged writers; [`peer`]: `redis-cli --cluster rebalance` as
//!   the scaler; [`bench`]: `pliant bench kv`;
//! - [`tpcc`]: a TPC-C-like transaction mix as Redis Functions, its clients and its check.

pub mod autoscale;
pub mod bench;
pub mod cluster;
pub mod host;
pub mod invariant;
pub mod loadgen;
pub mod monitor;
pub mod moves;
pub mod node;
pub mod parse;
pub mod peer;
pub mod planning;
pub mod redis_bench;
pub mod scale;
pub mod slots;
pub mod state;
pub mod tpcc;

pub use cluster::{Kv, UpOpts};
pub use monitor::{Monitor, Snapshot};
pub use planning::Planner;
pub use scale::{ScaleOpts, ScalePlan};
