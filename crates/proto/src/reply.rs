//! Answers of a replica's control channel: `{"ok":true, …}` or `{"ok":false,"error":"…"}`.
//!
//! The types here are what programs read from answers; the replica builds those parts from the
//! same types ([`ok`]) and adds free-form detail for people around them. Decoding
//! ([`decode`]) is strict: every field of a type must be present with its type, so a renamed
//! or dropped field is an error that names it — a count of audit violations can never read
//! as 0 because the field moved.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// `{"ok":true}` merged with the fields of `body` (an object).
pub fn ok<T: Serialize>(body: &T) -> Value {
    let mut v =
        serde_json::to_value(body).unwrap_or_else(|e| json!({"encode_error": e.to_string()}));
    match v.as_object_mut() {
        Some(m) => {
            m.insert("ok".into(), Value::Bool(true));
            v
        }
        None => json!({"ok": true, "value": v}),
    }
}

/// `{"ok":false,"error":msg}`.
pub fn error(msg: impl std::fmt::Display) -> Value {
    json!({"ok": false, "error": msg.to_string()})
}

/// Whether an answer says `ok` (anything else, a missing field included, is a refusal).
pub fn is_ok(v: &Value) -> bool {
    v.get("ok").and_then(Value::as_bool) == Some(true)
}

/// The error text of a refusal.
pub fn error_text(v: &Value) -> String {
    match v.get("error") {
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
        None => "no error text".into(),
    }
}

/// Decodes the typed part of an `ok` answer; a missing or mistyped field is an error naming it.
pub fn decode<T: DeserializeOwned>(v: &Value) -> Result<T, String> {
    T::deserialize(v).map_err(|e| format!("malformed answer: {e}"))
}

/// `stats`: what a heartbeat reads (the answer carries much more for people).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stats {
    /// The replica's name.
    pub replica: String,
    pub table: TableBrief,
    pub ports: Ports,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TableBrief {
    pub flows: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ports {
    pub inside: PortBrief,
    pub outside: PortBrief,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PortBrief {
    pub rx_frames: u64,
}

impl Stats {
    /// Frames received on both ports since start (for packet rates).
    pub fn rx_frames(&self) -> u64 {
        self.ports
            .inside
            .rx_frames
            .saturating_add(self.ports.outside.rx_frames)
    }
}

/// One flow: its primary key and its aliases (textual `FlowKey` form).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlowEntry {
    pub key: String,
    pub aliases: Vec<String>,
}

/// `flows`: the first `listed` of `total` flows.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlowList {
    pub total: u64,
    pub listed: u64,
    pub flows: Vec<FlowEntry>,
}

/// `flow`: the flow holding a key, if this replica has it. `found: false` is an answer, not an
/// error (most replicas do not hold a given flow).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlowLookup {
    pub found: bool,
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub flow: Option<FlowEntry>,
}

impl FlowLookup {
    /// The flow if found; a found flow without its key is malformed.
    pub fn entry(self) -> Result<Option<FlowEntry>, String> {
        match (self.found, self.flow) {
            (false, _) => Ok(None),
            (true, Some(f)) => Ok(Some(f)),
            (true, None) => Err("malformed answer: found flow without key and aliases".into()),
        }
    }
}

/// `shared_export`: this replica's combiner contributions (retired), for `shared_merge`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SharedExport {
    #[serde(with = "crate::request::hex")]
    pub bytes: Vec<u8>,
}

/// `migrate_in`: keys now held at the destination until their state arrives.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigrateIn {
    pub holding: u64,
}

/// `migrate_out`: flows moved, and keys that could not be, with why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigrateOut {
    pub moved: u64,
    pub failed: Vec<FailedKey>,
}

/// `peer_connect`: the connection to the destination is up; `reused` when it already was
/// (nothing to do), else how long the connect and the handshake took.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerConnect {
    pub reused: bool,
    pub wait_us: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailedKey {
    pub key: String,
    pub error: String,
}

/// One replication group in a `protect` answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupBrief {
    pub id: u32,
    pub name: String,
    pub backup: String,
    pub hz: u32,
}

/// `protect`: the groups now active.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Protect {
    pub groups: Vec<GroupBrief>,
}

impl Protect {
    /// The backups the groups replicate to, sorted and without repeats.
    pub fn backups(&self) -> Vec<String> {
        let mut v: Vec<String> = self.groups.iter().map(|g| g.backup.clone()).collect();
        v.sort();
        v.dedup();
        v
    }
}

/// One group of an `ha_status` answer (the answer has more per group for people).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupStatus {
    pub backup: String,
    /// `connecting`, `up`, `retiring`, `dead`, `unprotected`.
    pub state: String,
    /// It lost its backup and runs unprotected: the controller must send `protect`.
    pub needs_backup: bool,
}

/// Standby state held for a primary.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StandbyBrief {
    pub primary: String,
    pub flows: u64,
}

/// The output-commit audit: outputs checked as they were released, and of those, released
/// before the state they depend on was safe.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Audit {
    pub audit_checked: u64,
    pub audit_violations: u64,
}

/// `ha_status`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HaStatus {
    pub token: u64,
    pub groups: Vec<GroupStatus>,
    pub standby: Vec<StandbyBrief>,
    pub output: Audit,
}

impl HaStatus {
    /// Backups that groups lost their link to (suspects until probed), sorted, no repeats.
    pub fn dead_backups(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .groups
            .iter()
            .filter(|g| g.needs_backup)
            .map(|g| g.backup.clone())
            .collect();
        v.sort();
        v.dedup();
        v
    }
}

/// `activate` (Pico standby state made live) and `ftmb_activate` (a primary recovered by
/// replay) alike: flows now live here, for steering.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Activate {
    pub activated: u64,
    pub failed: u64,
    /// The first few failures.
    pub errors: Vec<String>,
    pub flows: Vec<FlowEntry>,
}

/// `rejoin`: what the replica dropped to become an empty member again.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rejoin {
    /// Flows dropped from the table (they failed over and live on elsewhere).
    pub flows_dropped: u64,
    /// Packets dropped that were held for a backup's acknowledgement, a migration or a
    /// neighbour's answer: output of flows that failed over must never leave.
    pub packets_dropped: u64,
    /// HA groups closed (this replica as a primary).
    pub groups_closed: u64,
    /// Standby flows dropped (this replica as a backup of others).
    pub standby_dropped: u64,
    /// Outgoing and incoming migrations ended.
    pub migrations_ended: u64,
    /// The replica's fencing token now.
    pub token: u64,
}

/// `ftmb_status`: what the controller reads (the answer has the workers', the release's and
/// the hosted loggers' detail).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FtmbStatus {
    /// The logger endpoint the workers log to, if any.
    pub logger: Option<String>,
    /// Connected to the logger with a full snapshot acknowledged.
    pub protected: bool,
    pub snapshots: u64,
    pub last_snapshot_acked: Option<u64>,
    pub last_error: Option<String>,
    /// The audit of output released by this replica's in-process loggers.
    pub local_audit: Audit,
    /// The status of the logger this replica hosts for others (shape of pliant-ftmb's
    /// `LoggerServer::status`), `null` if none.
    pub hosting: Value,
}

impl FtmbStatus {
    /// Primaries whose logs this replica hosts.
    pub fn hosted(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .hosting
            .get("masters")
            .and_then(Value::as_object)
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default();
        v.sort();
        v
    }

    /// The audit over this replica's in-process loggers and every hosted logger: a recovered
    /// primary's hosted logger leaves the status with it, so sample before recoveries.
    pub fn audit(&self) -> Audit {
        let mut a = self.local_audit.clone();
        if let Some(masters) = self.hosting.get("masters").and_then(Value::as_object) {
            for m in masters.values() {
                if let Ok(h) = decode::<Audit>(&m["logger"]) {
                    a.audit_checked = a.audit_checked.saturating_add(h.audit_checked);
                    a.audit_violations = a.audit_violations.saturating_add(h.audit_violations);
                }
            }
        }
        a
    }
}

/// `ftmb_activate`'s replay figures (besides its [`Activate`] part).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FtmbActivate {
    pub replay_ms: f64,
    pub total_ms: f64,
    pub replayed_packets: u64,
    pub suppressed: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_field_is_an_error_naming_it_never_zero() {
        let v = json!({"ok": true, "token": 3, "groups": [], "standby": [],
            "output": {"audit_checked": 10}});
        let e = decode::<HaStatus>(&v).unwrap_err();
        assert!(e.contains("audit_violations"), "{e}");
        let v = json!({"ok": true, "token": 3, "groups": [], "standby": [],
            "output": {"audit_checked": 10, "audit_violations": 1}, "extra": "ignored"});
        assert_eq!(decode::<HaStatus>(&v).unwrap().output.audit_violations, 1);
        assert!(decode::<Stats>(&json!({"ok": true, "replica": "r1"})).is_err());
    }

    #[test]
    fn ok_answers_carry_the_typed_fields_and_decode_back() {
        let f = FlowList {
            total: 3,
            listed: 1,
            flows: vec![FlowEntry {
                key: "k".into(),
                aliases: vec!["a".into()],
            }],
        };
        let v = ok(&f);
        assert!(is_ok(&v));
        assert_eq!(decode::<FlowList>(&v).unwrap(), f);
        let none = ok(&FlowLookup {
            found: false,
            flow: None,
        });
        assert_eq!(none, json!({"ok": true, "found": false}));
        assert_eq!(decode::<FlowLookup>(&none).unwrap().entry(), Ok(None));
        let found = json!({"ok": true, "found": true, "key": "k", "aliases": [], "version": 2});
        assert_eq!(
            decode::<FlowLookup>(&found)
                .unwrap()
                .entry()
                .unwrap()
                .unwrap()
                .key,
            "k"
        );
        let broken = json!({"ok": true, "found": true});
        assert!(decode::<FlowLookup>(&broken).unwrap().entry().is_err());
        let e = error("nope");
        assert!(!is_ok(&e));
        assert_eq!(error_text(&e), "nope");
    }

    #[test]
    fn ftmb_audit_sums_local_and_hosted_loggers() {
        let v = json!({"ok": true, "logger": null, "protected": false, "snapshots": 0,
            "last_snapshot_acked": null, "last_error": null,
            "local_audit": {"audit_checked": 5, "audit_violations": 0},
            "hosting": {"masters": {"r1": {"logger": {"audit_checked": 7, "audit_violations": 1}},
                                     "r3": {"logger": {"audit_checked": 1, "audit_violations": 0}}}}});
        let s = decode::<FtmbStatus>(&v).unwrap();
        assert_eq!(s.hosted(), vec!["r1".to_string(), "r3".to_string()]);
        assert_eq!(
            s.audit(),
            Audit {
                audit_checked: 13,
                audit_violations: 1
            }
        );
    }
}
