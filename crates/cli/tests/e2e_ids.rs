//! End-to-end: the IDS (`nf.kind = "ids"`) in the namespace lab, with real curl -> nginx traffic.
//!
//! Proves the acceptance criterion "the IDS test sends a known number of injection requests
//! (mixed with clean ones) and checks the exact count and the alert":
//! - one persistent curl connection carries clean and injection GETs and POSTs (curl `--next`
//!   keeps the connection), crossing the alert threshold: exactly one alert, for that flow;
//! - a second connection pipelines requests (several in one write, a POST body, a chunked POST)
//!   from a small Python client, below the threshold: counted, no alert;
//! - the totals in `pliant query` and the NF counters equal what the clients sent, and nginx
//!   saw every request (the IDS forwards everything).
//!
//! Needs root (`pliant_testkit::require_root`).

mod common;
use common::*;
use pliant_lab::{Role, SERVER_IP};
use std::time::Duration;

const THRESHOLD: u64 = 4;

#[test]
fn ids_counts_injections_exactly_and_alerts_once() {
    if !pliant_testkit::require_root() {
        return;
    }
    let lab = lab_up(nf(
        "ids",
        &format!("[ids]\nalert_threshold = {THRESHOLD}\n"),
    ));
    let base = format!("http://{SERVER_IP}");

    // Connection 1: curl, persistent, 18 requests of which 7 are injections (>= threshold).
    let mut args: Vec<String> = vec!["curl".into()];
    let mut injections_1 = 0u64;
    let mut requests_1 = 0u64;
    for i in 0..18 {
        if i > 0 {
            args.push("--next".into());
        }
        args.extend([
            "-sS".into(),
            "--max-time".into(),
            "20".into(),
            "-o".into(),
            "/dev/null".into(),
        ]);
        match i % 6 {
            0 => {
                args.push(format!("{base}/item?id=1%27%20OR%201%3D1"));
                injections_1 += 1;
            }
            2 => {
                args.extend(["-d".into(), "user=admin%27--&pw=x".into()]);
                args.push(format!("{base}/login"));
                injections_1 += 1;
            }
            4 => {
                args.extend(["-d".into(), "q=union+station&sort=asc".into()]);
                args.push(format!("{base}/search"));
            }
            5 if i == 5 => {
                args.push(format!("{base}/q?x=1+UNION+SELECT+password+FROM+users"));
                injections_1 += 1;
            }
            _ => args.push(format!("{base}/1M.bin?page={i}")),
        }
        requests_1 += 1;
    }
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    lab.exec_ok(Role::Client, &argv)
        .unwrap_or_else(|e| panic!("curl: {e}"));
    assert!(injections_1 >= THRESHOLD);

    // Connection 2: pipelined requests in one write (GET, POST with a body, chunked POST),
    // below the threshold.
    let py = r#"
import socket
s = socket.create_connection(("10.77.2.2", 80), timeout=10)
body = b"name=x%27%20or%201%3D1"
reqs = (b"GET /a?x=1 HTTP/1.1\r\nHost: s\r\n\r\n"
        b"POST /b HTTP/1.1\r\nHost: s\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body +
        b"POST /c HTTP/1.1\r\nHost: s\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nq=ok\r\n0\r\n\r\n"
        b"GET /d?id=5%3B%20DROP%20TABLE%20t HTTP/1.1\r\nHost: s\r\nConnection: close\r\n\r\n")
s.sendall(reqs)
while s.recv(65536):
    pass
"#;
    lab.exec_ok(Role::Client, &["/usr/bin/python3", "-c", py])
        .unwrap_or_else(|e| panic!("pipelined client: {e}"));
    let (requests_2, injections_2) = (4u64, 2u64);
    assert!(injections_2 < THRESHOLD);

    let want_requests = requests_1 + requests_2;
    let want_injections = injections_1 + injections_2;
    wait_for("ids totals", Duration::from_secs(10), || {
        ask(&lab, &["query"])["totals"]["requests"] == want_requests
    });
    let q = ask(&lab, &["query"]);
    assert_eq!(q["totals"]["injections"], want_injections, "{q:#}");
    let alerts = q["alerts"].as_array().expect("alerts");
    assert_eq!(
        alerts.len(),
        1,
        "exactly one flow crossed the threshold: {q:#}"
    );
    assert_eq!(alerts[0]["injections"], THRESHOLD);
    assert!(
        alerts[0]["client"]
            .as_str()
            .unwrap_or("")
            .starts_with("10.77.1.2:"),
        "{q:#}"
    );

    let st = ask(&lab, &["stats", "--json"]);
    assert_eq!(
        st["nf_counters"]["ids_injections"], want_injections,
        "{st:#}"
    );
    assert_eq!(st["nf_counters"]["ids_requests"], want_requests, "{st:#}");
    assert_eq!(st["nf_counters"]["ids_alerts"], 1, "{st:#}");
    assert!(
        st["nf_counters"]["ids_gaps"].is_null() || st["nf_counters"]["ids_gaps"] == 0,
        "{st:#}"
    );

    // The alert is also a log line of the replica.
    wait_for("alert log line", Duration::from_secs(5), || {
        std::fs::read_to_string(lab.replica_log(1))
            .map(|l| l.contains("SQL-injection threshold reached"))
            .unwrap_or(false)
    });

    // Everything was forwarded: nginx logged every request.
    wait_for("nginx access log", Duration::from_secs(5), || {
        lab.access_log()
            .map(|l| l.len() as u64 >= want_requests)
            .unwrap_or(false)
    });
    // ... over exactly two (persistent) connections.
    let log = lab.access_log().expect("access log");
    let mut ports: Vec<u16> = log.iter().map(|e| e.remote_port).collect();
    ports.sort_unstable();
    ports.dedup();
    assert_eq!(ports.len(), 2, "expected two client connections: {log:?}");
}
