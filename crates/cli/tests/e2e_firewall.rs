//! End-to-end: the stateful firewall (`nf.kind = "firewall"`) in the namespace lab.
//!
//! Proves the acceptance criterion "the firewall test shows unsolicited inbound dropped":
//! - client -> server (outbound) HTTP and ping work, so replies of established flows pass
//!   although inbound traffic is denied by default;
//! - server -> client (unsolicited inbound) TCP to a port no rule allows times out (curl exit
//!   28: the SYN was dropped; a refusal would mean the client's kernel saw it) and ping fails;
//! - server -> client TCP to the port an inbound rule allows reaches the client (curl exit 7:
//!   refused by the client's kernel, which has no listener there);
//! - `fw_denied` drops, per-rule hits and the default-policy hits are reported.
//!
//! Needs root (`pliant_testkit::require_root`).

mod common;
use common::*;
use pliant_lab::{Lab, Role, CLIENT_IP, SERVER_IP};

fn curl_exit(lab: &Lab, role: Role, url: &str) -> Option<i32> {
    lab.exec(
        role,
        &["curl", "-s", "-o", "/dev/null", "--max-time", "2", url],
    )
    .unwrap_or_else(|e| panic!("curl {url}: {e}"))
    .code
}

#[test]
fn firewall_allows_replies_and_drops_unsolicited_inbound() {
    if !pliant_testkit::require_root() {
        return;
    }
    let lab = lab_up(nf(
        "firewall",
        r#"[firewall]
default_inbound = "deny"
default_outbound = "allow"

[[firewall.rules]]
name = "inbound-7777"
action = "allow"
direction = "inbound"
proto = "tcp"
dst = "10.77.1.0/24"
dst_ports = [7777]
"#,
    ));

    // Outbound: HTTP and ping, replies allowed by flow state.
    let f = lab.served_file("1M.bin").expect("served file").clone();
    let out = lab
        .exec_ok(
            Role::Client,
            &[
                "curl",
                "-sS",
                "--max-time",
                "20",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code} %{size_download}",
                &f.url,
            ],
        )
        .unwrap_or_else(|e| panic!("curl: {e}"));
    assert_eq!(out.stdout.trim(), format!("200 {}", f.size_bytes));
    let ping = lab
        .exec(
            Role::Client,
            &["ping", "-c", "3", "-i", "0.2", "-W", "2", SERVER_IP],
        )
        .unwrap();
    assert!(ping.stdout.contains("3 received"), "{}", ping.stdout);

    // Unsolicited inbound: dropped (timeout), not refused.
    assert_eq!(
        curl_exit(&lab, Role::Server, &format!("http://{CLIENT_IP}:9/")),
        Some(28)
    );
    let ping = lab
        .exec(
            Role::Server,
            &["ping", "-c", "2", "-i", "0.2", "-W", "1", CLIENT_IP],
        )
        .unwrap();
    assert!(ping.stdout.contains(" 0 received"), "{}", ping.stdout);
    // Inbound allowed by the rule: reaches the client, whose kernel refuses it (no listener).
    assert_eq!(
        curl_exit(&lab, Role::Server, &format!("http://{CLIENT_IP}:7777/")),
        Some(7)
    );

    let st = ask(&lab, &["stats", "--json"]);
    let denied = st["drops"]["fw_denied"].as_u64().unwrap_or(0);
    // At least the SYN to port 9 and the two echo requests (SYN retransmissions add more).
    assert!(denied >= 3, "{st:#}");
    let q = ask(&lab, &["query"]);
    assert!(q["rules"][0]["hits"].as_u64().unwrap_or(0) >= 1, "{q:#}");
    assert!(
        q["default_inbound"]["hits"].as_u64().unwrap_or(0) >= 3,
        "{q:#}"
    );
    assert!(
        q["default_outbound"]["hits"].as_u64().unwrap_or(0) >= 2,
        "{q:#}"
    );
}
