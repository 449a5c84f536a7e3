//! `GET /metrics` on the controller's API (same bearer token): its status as Prometheus text,
//! so the conditions an operator must be told about — an unprotected replica while HA is on, a
//! store that does not answer, a replica down — are alerts, not only lines in `pliant status`.
//! Rendered from the status JSON, so the two never disagree.

use serde_json::Value;
use std::fmt::Write;

fn line(o: &mut String, name: &str, kind: &str, help: &str, v: u64) {
    let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}");
}

/// Metric names from counter keys: only `[a-z0-9_]`.
fn sane(k: &str) -> String {
    k.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .collect()
}

/// The exposition of `status` (`Controller::status`).
pub fn render(status: &Value) -> String {
    let mut o = String::new();
    let n = |v: &Value| v.as_u64().unwrap_or(0);
    let replicas = status["replicas"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[]);
    let alive = replicas.iter().filter(|r| r["alive"] == true).count() as u64;
    line(
        &mut o,
        "pliant_controller_replicas",
        "gauge",
        "Replicas known",
        replicas.len() as u64,
    );
    line(
        &mut o,
        "pliant_controller_replicas_alive",
        "gauge",
        "Replicas answering",
        alive,
    );
    let ha = &status["ha"];
    line(
        &mut o,
        "pliant_controller_unprotected_replicas",
        "gauge",
        "Replicas without a live backup or logger while HA is on (alert on > 0)",
        n(&ha["unprotected_replicas"]),
    );
    let store_ok = u64::from(status["store"]["ok"] == true);
    line(
        &mut o,
        "pliant_controller_store_ok",
        "gauge",
        "1 if the store answers (0: no placement change is possible)",
        store_ok,
    );
    line(
        &mut o,
        "pliant_controller_term",
        "gauge",
        "Leadership term this controller acts under (0: no elections)",
        n(&status["controller"]["term"]),
    );
    line(
        &mut o,
        "pliant_controller_epoch",
        "gauge",
        "Placement epoch",
        n(&status["epoch"]),
    );
    if let Some(hosts) = status["hosts"].as_array() {
        // Hosts of `[hosts]`: how many are in each state (alert on dead > 0 or unreachable).
        for state in ["up", "agent_down", "unreachable", "dead"] {
            let k = hosts.iter().filter(|h| h["state"] == state).count() as u64;
            line(
                &mut o,
                &format!("pliant_controller_hosts_{state}"),
                "gauge",
                &format!("Hosts whose agent the controller sees {state}"),
                k,
            );
        }
    }
    for (section, prefix) in [
        (&status["counters"], "pliant_controller"),
        (&ha["counters"], "pliant_controller_ha"),
    ] {
        if let Some(m) = section.as_object() {
            for (k, v) in m {
                if let Some(x) = v.as_u64() {
                    let name = format!("{prefix}_{}_total", sane(k));
                    line(&mut o, &name, "counter", k, x);
                }
            }
        }
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn status_becomes_gauges_and_counters() {
        let st = json!({
            "epoch": 4,
            "replicas": [{"alive": true}, {"alive": false}, {"alive": true}],
            "store": {"ok": false},
            "controller": {"role": "leader", "term": 17},
            "counters": {"heartbeats": 9, "store_refusals": 2},
            "ha": {"unprotected_replicas": 1, "counters": {"failovers": 3}},
            "hosts": [{"state": "up"}, {"state": "dead"}, {"state": "up"}],
        });
        let t = render(&st);
        for want in [
            "pliant_controller_replicas 3\n",
            "pliant_controller_replicas_alive 2\n",
            "pliant_controller_unprotected_replicas 1\n",
            "pliant_controller_store_ok 0\n",
            "pliant_controller_term 17\n",
            "pliant_controller_epoch 4\n",
            "pliant_controller_store_refusals_total 2\n",
            "pliant_controller_ha_failovers_total 3\n",
            "# TYPE pliant_controller_unprotected_replicas gauge\n",
            "pliant_controller_hosts_up 2\n",
            "pliant_controller_hosts_dead 1\n",
            "pliant_controller_hosts_unreachable 0\n",
        ] {
            assert!(t.contains(want), "{want:?} missing from:\n{t}");
        }
    }
}
