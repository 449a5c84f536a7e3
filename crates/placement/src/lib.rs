//! Partition placement for an elastic partitioned in-memory database: which hosts hold the copies
//! of every partition, now (online) or over a predicted horizon (offline), at the least cost.
//! Pure planning: no I/O, time is only measured around the solver.
//!
//! - [`model`]: the problem and its validation;
//! - [`milp`]: the offline and online MILPs, solved by CBC;
//! - [`greedy`]: greedy first-fit, the baseline;
//! - [`brute`]: exhaustive search for small instances, the tests' reference;
//! - [`plan`]: the answer, its objectives, the validator [`plan::check`] and the copy-before-drop
//!   order [`plan::moves`];
//! - [`instances`]: seeded random instances for tests and the solve-time example.

pub mod brute;
pub mod greedy;
pub mod instances;
pub mod milp;
pub mod model;
pub mod plan;

pub use model::{Costs, HostId, HostSpec, ModelError, Partition, Placement, Problem};
pub use plan::{check, moves, order, Move, Op, Plan, PlanError, SolveStatus, Violation};
