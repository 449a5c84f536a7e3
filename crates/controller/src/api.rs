//! The HTTP/JSON API over a [`Controller`] (authentication happens before this, in `http`).
//!
//! | method | path | body | does |
//! |---|---|---|---|
//! | GET | /v1/status | | replicas, load, counters, policy, recent events |
//! | GET | /v1/flows[?replica=rN] | | flows per replica (bounded listings) |
//! | POST | /v1/migrate | `{"flow":KEY,"to":"r2"}` or `{"from":"r1","to":"r2","count":N}` | moves flows |
//! | POST | /v1/scale/out | | starts a replica |
//! | POST | /v1/scale/in | `{"replica":"r2"}` (optional) | merges a replica away |
//! | GET | /v1/policy | | the policy |
//! | POST | /v1/policy | `{"set":{"k":"v",...}}` | changes it (all or nothing) |
//! | POST | /v1/policy/evaluate | | runs the policy once now |
//! | GET | /v1/ha | | HA view: config, token, failovers (timings), each replica's `ha_status` |
//! | POST | /v1/ha/protect | `{"policy":"chords","hz":1000,"replica":"r1"}` (all optional) | (re-)protects now |

use crate::controller::{Controller, ControllerError};
use crate::http::{Request, Response};
use serde_json::{json, Value};
use std::sync::Arc;

/// `"r2"`, `"2"` or `2` -> 2.
pub fn parse_replica(v: &Value) -> Option<u32> {
    match v {
        Value::Number(n) => n.as_u64().and_then(|x| u32::try_from(x).ok()),
        Value::String(s) => s.strip_prefix('r').unwrap_or(s).parse().ok(),
        _ => None,
    }
}

fn err(e: ControllerError) -> Response {
    Response::error(e.status(), &e.to_string())
}

fn body_json(r: &Request) -> Result<Value, Response> {
    if r.body.is_empty() {
        return Ok(json!({}));
    }
    serde_json::from_slice(&r.body)
        .map_err(|e| Response::error(400, &format!("body is not JSON: {e}")))
}

fn field_replica(b: &Value, name: &str) -> Result<Option<u32>, Response> {
    match b.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => parse_replica(v).map(Some).ok_or_else(|| {
            Response::error(400, &format!("{name}: expected a replica like \"r2\""))
        }),
    }
}

pub fn handle(c: &Arc<Controller>, r: &Request) -> Response {
    if (r.method.as_str(), r.path.as_str()) == ("GET", "/metrics") {
        return Response::metrics(crate::metrics::render(&c.status()));
    }
    let res = route(c, r);
    match res {
        Ok(v) => Response::json(200, &v),
        Err(resp) => resp,
    }
}

fn route(c: &Arc<Controller>, r: &Request) -> Result<Value, Response> {
    match (r.method.as_str(), r.path.as_str()) {
        ("GET", "/v1/status") => Ok(c.status()),
        ("GET", "/v1/flows") => {
            let only = match r.query_param("replica") {
                None => None,
                Some(s) => Some(
                    parse_replica(&json!(s))
                        .ok_or_else(|| Response::error(400, "replica: expected rN"))?,
                ),
            };
            c.flows(only).map_err(err)
        }
        ("POST", "/v1/migrate") => {
            let b = body_json(r)?;
            let to =
                field_replica(&b, "to")?.ok_or_else(|| Response::error(400, "missing \"to\""))?;
            if let Some(flow) = b.get("flow") {
                let key = flow
                    .as_str()
                    .ok_or_else(|| Response::error(400, "flow: expected a string key"))?;
                return c.migrate_key(key, to).map_err(err);
            }
            let from = field_replica(&b, "from")?
                .ok_or_else(|| Response::error(400, "give \"flow\", or \"from\" with \"count\""))?;
            let count = b
                .get("count")
                .and_then(Value::as_u64)
                .ok_or_else(|| Response::error(400, "count: expected a non-negative integer"))?;
            c.migrate_count(from, to, count).map_err(err)
        }
        ("POST", "/v1/scale/out") => c.scale_out().map_err(err),
        ("POST", "/v1/scale/in") => {
            let b = body_json(r)?;
            c.scale_in(field_replica(&b, "replica")?).map_err(err)
        }
        ("GET", "/v1/policy") => Ok(json!({"ok": true, "policy": c.policy()})),
        ("POST", "/v1/policy") => {
            let b = body_json(r)?;
            let set = b
                .get("set")
                .and_then(Value::as_object)
                .ok_or_else(|| Response::error(400, "expected {\"set\": {\"key\": \"value\"}}"))?;
            let pairs: Vec<(String, String)> = set
                .iter()
                .map(|(k, v)| {
                    let s = match v {
                        Value::String(s) => s.clone(),
                        other => other.to_string(),
                    };
                    (k.clone(), s)
                })
                .collect();
            c.set_policy(&pairs)
                .map(|p| json!({"ok": true, "policy": p}))
                .map_err(err)
        }
        ("POST", "/v1/policy/evaluate") => c.policy_tick(true).map_err(err),
        ("GET", "/v1/ha") => Ok(c.ha_view()),
        ("POST", "/v1/ha/protect") => {
            let b = body_json(r)?;
            let policy = match b.get("policy") {
                None | Some(Value::Null) => None,
                Some(Value::String(s)) => Some(s.as_str()),
                Some(_) => return Err(Response::error(400, "policy: expected a string")),
            };
            let hz = match b.get("hz") {
                None | Some(Value::Null) => None,
                Some(v) => Some(
                    v.as_u64()
                        .and_then(|x| u32::try_from(x).ok())
                        .ok_or_else(|| Response::error(400, "hz: expected a positive integer"))?,
                ),
            };
            c.ha_protect(policy, hz, field_replica(&b, "replica")?)
                .map_err(err)
        }
        (
            _,
            "/v1/status"
            | "/v1/flows"
            | "/v1/migrate"
            | "/v1/scale/out"
            | "/v1/scale/in"
            | "/v1/policy"
            | "/v1/policy/evaluate"
            | "/v1/ha"
            | "/v1/ha/protect",
        ) => Err(Response::error(405, "method not allowed")),
        _ => Err(Response::error(
            404,
            "no such endpoint (see `pliant status --help`)",
        )),
    }
}
