//! Talking to a replica's control socket: one JSON object per line, one answer line back
//! (`{"ok":true,...}` or `{"ok":false,"error":"..."}`), as served by `pliant_runtime::control`.

use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

/// Largest answer accepted (a `flows` listing of 1000 keys with aliases is well below).
pub const MAX_ANSWER_BYTES: u64 = 16 << 20;

#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum ReplicaError {
    #[error("replica socket {path}: {reason}")]
    Io { path: String, reason: String },
    #[error("replica {path} refused {cmd}: {error}")]
    Refused {
        path: String,
        cmd: String,
        error: String,
    },
}

/// Sends `req` and returns the answer if it says `ok`.
pub fn call(path: &Path, req: &Value, timeout: Duration) -> Result<Value, ReplicaError> {
    let p = path.display().to_string();
    let ioerr = |reason: String| ReplicaError::Io {
        path: p.clone(),
        reason,
    };
    let mut s = UnixStream::connect(path).map_err(|e| ioerr(format!("connect: {e}")))?;
    s.set_read_timeout(Some(timeout))
        .and_then(|_| s.set_write_timeout(Some(timeout)))
        .map_err(|e| ioerr(e.to_string()))?;
    writeln!(s, "{req}").map_err(|e| ioerr(format!("write: {e}")))?;
    let mut line = String::new();
    BufReader::new(s)
        .take(MAX_ANSWER_BYTES)
        .read_line(&mut line)
        .map_err(|e| ioerr(format!("read: {e}")))?;
    let v: Value = serde_json::from_str(&line).map_err(|e| ioerr(format!("bad answer: {e}")))?;
    if v.get("ok").and_then(Value::as_bool) == Some(true) {
        Ok(v)
    } else {
        Err(ReplicaError::Refused {
            path: p,
            cmd: req
                .get("cmd")
                .and_then(Value::as_str)
                .unwrap_or("?")
                .to_string(),
            error: v
                .get("error")
                .and_then(Value::as_str)
                .unwrap_or("no error text")
                .to_string(),
        })
    }
}

/// What a heartbeat learns from `stats`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Beat {
    pub flows: u64,
    /// Frames received on both ports since start (for packet rates).
    pub rx_frames: u64,
}

/// Extracts a [`Beat`] from a `stats` answer; missing fields count as 0 (older replicas).
pub fn parse_beat(v: &Value) -> Beat {
    let u = |p: &str| v.pointer(p).and_then(Value::as_u64).unwrap_or(0);
    Beat {
        flows: u("/table/flows"),
        rx_frames: u("/ports/inside/rx_frames").saturating_add(u("/ports/outside/rx_frames")),
    }
}

pub fn heartbeat(path: &Path, timeout: Duration) -> Result<Beat, ReplicaError> {
    call(path, &serde_json::json!({"cmd": "stats"}), timeout).map(|v| parse_beat(&v))
}

/// One flow as a replica lists it: its key and its aliases (textual FlowKey form).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FlowEntry {
    pub key: String,
    #[serde(default)]
    pub aliases: Vec<String>,
}

/// Parses a `flows` answer. Accepts both shapes: `"flows": ["key", ...]` (foundation) and
/// `"flows": [{"key": "...", "aliases": [...]}, ...]` (with aliases, for migration).
pub fn parse_flows(v: &Value) -> (u64, Vec<FlowEntry>) {
    let mut out = Vec::new();
    if let Some(arr) = v.get("flows").and_then(Value::as_array) {
        for f in arr {
            match f {
                Value::String(s) => out.push(FlowEntry {
                    key: s.clone(),
                    aliases: Vec::new(),
                }),
                Value::Object(_) => {
                    if let Ok(e) = serde_json::from_value::<FlowEntry>(f.clone()) {
                        out.push(e);
                    }
                }
                _ => {}
            }
        }
    }
    let total = v
        .get("total")
        .and_then(Value::as_u64)
        .unwrap_or(out.len() as u64);
    (total, out)
}

pub fn flows(path: &Path, timeout: Duration) -> Result<(u64, Vec<FlowEntry>), ReplicaError> {
    call(path, &serde_json::json!({"cmd": "flows"}), timeout).map(|v| parse_flows(&v))
}

/// Asks the replica whether its flow table holds `key` (a primary key or an alias): `Some`
/// with the flow's primary key and aliases if so. One index lookup on the replica, so unlike
/// scanning [`flows`] (bounded at `max_listed_flows`) it finds any flow at any table size.
pub fn flow(
    path: &Path,
    key: &pliant_state::FlowKey,
    timeout: Duration,
) -> Result<Option<FlowEntry>, ReplicaError> {
    let v = call(
        path,
        &serde_json::json!({"cmd": "flow", "key": key.to_string()}),
        timeout,
    )?;
    parse_flow(&v).map_err(|reason| ReplicaError::Io {
        path: path.display().to_string(),
        reason,
    })
}

/// Parses a `flow` answer (`{"ok":true,"found":false}` or `{"ok":true,"found":true,"key":…,
/// "aliases":[…]}`); a missing `found` or a found flow without a key is a malformed answer.
pub fn parse_flow(v: &Value) -> Result<Option<FlowEntry>, String> {
    match v.get("found").and_then(Value::as_bool) {
        Some(false) => Ok(None),
        Some(true) => serde_json::from_value::<FlowEntry>(v.clone())
            .map(Some)
            .map_err(|e| format!("bad flow answer: {e}")),
        None => Err("bad flow answer: missing boolean field \"found\"".into()),
    }
}

/// Waits until the replica answers `stats`, returning how long that took.
pub fn wait_serving(path: &Path, limit: Duration) -> Result<Duration, ReplicaError> {
    let start = Instant::now();
    loop {
        match heartbeat(path, Duration::from_millis(500)) {
            Ok(_) => return Ok(start.elapsed()),
            Err(e) if start.elapsed() >= limit => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn beats_parse_from_stats_and_tolerate_missing_fields() {
        let v = json!({"ok": true, "table": {"flows": 7},
            "ports": {"inside": {"rx_frames": 10}, "outside": {"rx_frames": 5}}});
        assert_eq!(
            parse_beat(&v),
            Beat {
                flows: 7,
                rx_frames: 15
            }
        );
        assert_eq!(parse_beat(&json!({"ok": true})), Beat::default());
    }

    #[test]
    fn flows_parse_in_both_shapes() {
        let (t, f) = parse_flows(&json!({"total": 3, "flows": ["a", "b"]}));
        assert_eq!(t, 3);
        assert_eq!(f.len(), 2);
        assert!(f[0].aliases.is_empty());
        let (_, f) =
            parse_flows(&json!({"flows": [{"key": "k", "aliases": ["x"]}, 5, {"nokey": 1}]}));
        assert_eq!(
            f,
            vec![FlowEntry {
                key: "k".into(),
                aliases: vec!["x".into()]
            }]
        );
    }

    #[test]
    fn flow_answers_parse_and_malformed_ones_are_errors() {
        assert_eq!(parse_flow(&json!({"ok": true, "found": false})), Ok(None));
        assert_eq!(
            parse_flow(
                &json!({"ok": true, "found": true, "key": "k", "aliases": ["a"],
                "version": 3})
            ),
            Ok(Some(FlowEntry {
                key: "k".into(),
                aliases: vec!["a".into()]
            }))
        );
        assert!(parse_flow(&json!({"ok": true, "found": true})).is_err());
        assert!(parse_flow(&json!({"ok": true})).is_err());
    }

    #[test]
    fn unreachable_socket_is_an_io_error() {
        let e = heartbeat(
            Path::new("/nonexistent/pliant.sock"),
            Duration::from_millis(100),
        );
        assert!(matches!(e, Err(ReplicaError::Io { .. })));
    }
}
