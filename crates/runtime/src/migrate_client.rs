//! Orchestration of one migration from the outside (controller, tests, benches): the order of
//! the three steps is what makes the move loss-free, so it lives in one reusable function.

use crate::control::client_request_json;
use pliant_state::FlowKey;
use serde_json::{json, Value};
use std::collections::HashMap;

/// Primary keys and aliases of the flows on a replica, from its `flows` answer (bounded by the
/// replica's listing limit).
pub fn flow_aliases(socket: &str) -> Result<HashMap<FlowKey, Vec<FlowKey>>, String> {
    listed_aliases(socket).map(|(m, _)| m)
}

/// [`flow_aliases`], and whether the listing held every flow (`listed == total`).
fn listed_aliases(socket: &str) -> Result<(HashMap<FlowKey, Vec<FlowKey>>, bool), String> {
    let v = client_request_json(socket, &json!({"cmd": "flows"}))?;
    if v["ok"] != true {
        return Err(format!("flows on {socket}: {}", v["error"]));
    }
    let mut out = HashMap::new();
    let listed = v["flows"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    for f in listed {
        let Some(k) = f["key"].as_str().and_then(|s| s.parse::<FlowKey>().ok()) else {
            continue;
        };
        out.insert(k, aliases_of(f));
    }
    let complete = v["total"]
        .as_u64()
        .is_some_and(|t| t <= listed.len() as u64);
    Ok((out, complete))
}

fn aliases_of(f: &Value) -> Vec<FlowKey> {
    f["aliases"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[])
        .iter()
        .filter_map(|a| a.as_str()?.parse().ok())
        .collect()
}

/// The aliases of flow `key` on the replica at `socket`, by the `flow` lookup (any table
/// size); `None` if it does not hold the flow or did not answer.
fn aliases_by_key(socket: &str, key: &FlowKey) -> Option<Vec<FlowKey>> {
    let v = client_request_json(socket, &json!({"cmd": "flow", "key": key.to_string()})).ok()?;
    (v["ok"] == true && v["found"] == true).then(|| aliases_of(&v))
}

/// Moves `keys` (primary keys) from the replica at `src_socket` to the one at `dst_socket`,
/// whose peer socket is `dst_peer_path`:
/// 1. `migrate_in` at the destination with every key and alias (it starts holding them);
/// 2. `steer_update(all keys)`: the caller points the fabric at the destination;
/// 3. `migrate_out` at the source: drain, export at refcount 0, ship, forward late packets,
///    Done; it answers after the destination released the holds.
///
/// Returns the source's answer (`moved`, `failed`, `pause`, ...). Flows listed in `failed`
/// stayed at the source: the caller must steer them back there.
pub fn migrate(
    src_socket: &str,
    dst_socket: &str,
    dst_peer_path: &str,
    keys: &[FlowKey],
    steer_update: impl FnOnce(&[FlowKey]),
) -> Result<Value, String> {
    let (aliases, complete) = listed_aliases(src_socket).unwrap_or_default();
    let mut all: Vec<FlowKey> = Vec::with_capacity(keys.len() * 2);
    for k in keys {
        all.push(*k);
        if let Some(a) = aliases.get(k) {
            all.extend(a.iter().copied());
        } else if !complete {
            // Past the listing's bound: without its aliases the destination would not hold
            // the packets arriving on them (a NAT's return traffic) until the state is there.
            if let Some(a) = aliases_by_key(src_socket, k) {
                all.extend(a);
            }
        }
    }
    let strs = |ks: &[FlowKey]| ks.iter().map(|k| k.to_string()).collect::<Vec<_>>();
    let src_name = client_request_json(src_socket, &json!({"cmd": "stats"}))
        .ok()
        .and_then(|v| v["replica"].as_str().map(str::to_string))
        .unwrap_or_default();
    let r = client_request_json(
        dst_socket,
        &json!({"cmd": "migrate_in", "from": src_name, "keys": strs(&all)}),
    )?;
    if r["ok"] != true {
        return Err(format!("migrate_in at {dst_socket}: {}", r["error"]));
    }
    steer_update(&all);
    let r = client_request_json(
        src_socket,
        &json!({"cmd": "migrate_out", "to": dst_peer_path, "keys": strs(keys)}),
    )?;
    if r["ok"] != true {
        return Err(format!("migrate_out at {src_socket}: {}", r["error"]));
    }
    Ok(r)
}
