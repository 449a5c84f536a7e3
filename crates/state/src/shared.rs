//! Coherent shared state (SKELETON: the contract; bodies are being written).
//!
//! With a combiner: eventually consistent. LOCAL reads/writes the local copy; PULL first fetches
//! the other replicas' copies through the [`Coherence`] transport and combines them; PUSH publishes
//! after writing. Without a combiner: strongly consistent — SYNCH takes the lock service's lock
//! and fetches the newest copy on get, publishes and unlocks on put.

use crate::error::StateError;

/// Merges `other` into `acc` (like a MapReduce combiner). Must be associative and commutative.
pub type Combiner = fn(acc: &mut Vec<u8>, other: &[u8]);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GetFlags {
    Local,
    Pull,
    Synch,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PutFlags {
    Local,
    Push,
    Synch,
}

#[must_use = "a SharedRef holds a transaction on shared state until put_shared"]
#[derive(Debug)]
pub struct SharedRef {
    pub key: String,
}

pub struct SharedStore {}
