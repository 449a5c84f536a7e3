//! Orchestration of one migration from the outside (controller, tests, benches): the order of
//! the three steps is what makes the move loss-free, so it lives in one reusable function.

use pliant_proto::reply::{self, FlowEntry};
use pliant_proto::{Client, Request};
use pliant_state::FlowKey;
use serde_json::Value;
use std::collections::HashMap;

/// Primary keys and aliases of the flows on a replica, from its `flows` answer (bounded by the
/// replica's listing limit).
pub fn flow_aliases(replica: &Client) -> Result<HashMap<FlowKey, Vec<FlowKey>>, String> {
    listed_aliases(replica).map(|(m, _)| m)
}

/// [`flow_aliases`], and whether the listing held every flow (`listed == total`).
fn listed_aliases(replica: &Client) -> Result<(HashMap<FlowKey, Vec<FlowKey>>, bool), String> {
    let l = replica.flows().map_err(|e| e.to_string())?;
    let mut out = HashMap::new();
    for f in &l.flows {
        let Ok(k) = f.key.parse::<FlowKey>() else {
            continue;
        };
        out.insert(k, aliases_of(f));
    }
    Ok((out, l.total <= l.flows.len() as u64))
}

fn aliases_of(f: &FlowEntry) -> Vec<FlowKey> {
    f.aliases.iter().filter_map(|a| a.parse().ok()).collect()
}

/// Has the source `src` open (or confirm) its authenticated peer connection to `dst_peer`
/// before a move: a move's source connects lazily, and the first move to a destination would
/// otherwise connect and run the handshake while the destination holds the flows' packets.
/// An unreachable destination fails here, before anything is held.
pub fn peer_connect(src: &Client, dst_peer: &str) -> Result<reply::PeerConnect, String> {
    src.ask(&Request::PeerConnect {
        to: dst_peer.to_string(),
    })
    .map_err(|e| e.to_string())
}

/// Moves `keys` (primary keys) from the replica `src` to the replica `dst`, whose peer
/// endpoint is `dst_peer`:
/// 0. `peer_connect` at the source (see [`peer_connect`]);
/// 1. `migrate_in` at the destination with every key and alias (it starts holding them);
/// 2. `steer_update(all keys)`: the caller points the fabric at the destination;
/// 3. `migrate_out` at the source: drain, export at refcount 0, ship, forward late packets,
///    Done; it answers after the destination released the holds.
///
/// Returns the source's answer (`moved`, `failed`, `pause`, ...). Flows listed in `failed`
/// stayed at the source: the caller must steer them back there.
pub fn migrate(
    src: &Client,
    dst: &Client,
    dst_peer: &str,
    keys: &[FlowKey],
    steer_update: impl FnOnce(&[FlowKey]),
) -> Result<Value, String> {
    let (aliases, complete) = listed_aliases(src).unwrap_or_default();
    let mut all: Vec<FlowKey> = Vec::with_capacity(keys.len() * 2);
    for k in keys {
        all.push(*k);
        if let Some(a) = aliases.get(k) {
            all.extend(a.iter().copied());
        } else if !complete {
            // Past the listing's bound: without its aliases the destination would not hold
            // the packets arriving on them (a NAT's return traffic) until the state is there;
            // the `flow` lookup finds them at any table size.
            if let Ok(Some(f)) = src.flow(k) {
                all.extend(aliases_of(&f));
            }
        }
    }
    let from = src.stats().map_err(|e| e.to_string())?.replica;
    peer_connect(src, dst_peer)?;
    // Connected (and authenticated) to the source before the switch: from the switch on the
    // destination holds the flows' packets until their state arrives, so the handshake must
    // not be part of that pause.
    let t = std::time::Instant::now();
    let src_link = src.connect().map_err(|e| e.to_string())?;
    dst.call(&Request::MigrateIn {
        from,
        keys: all.clone(),
    })
    .map_err(|e| e.to_string())?;
    steer_update(&all);
    src.call_on(
        src_link,
        &Request::MigrateOut {
            to: dst_peer.to_string(),
            keys: keys.to_vec(),
        },
        t,
    )
    .map_err(|e| e.to_string())
}
