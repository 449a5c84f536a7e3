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

/// `pliant lab up --mode pliant-firewall --nf-config FILE`, as a user would run it: the rules
/// of the file apply (outbound HTTP allowed, everything else outbound denied: ping fails), and
/// a section the lab writes itself is refused with a clear error.
#[test]
fn lab_up_runs_the_firewall_with_the_rules_of_an_nf_config_file() {
    if !pliant_testkit::require_root() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("pliant-e2e-fwlab-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("mkdir");
    let cfg = dir.join("fw.toml");
    std::fs::write(
        &cfg,
        "[firewall]\ndefault_outbound = \"deny\"\n\n[[firewall.rules]]\nname = \"web-out\"\n\
         action = \"allow\"\ndirection = \"outbound\"\nproto = \"tcp\"\ndst_ports = [80]\n",
    )
    .expect("write");
    let name = format!("fwl{:x}", std::process::id() & 0xffff);
    let run = |args: &[&str]| {
        std::process::Command::new(pliant())
            .args(args)
            .output()
            .expect("pliant")
    };
    /// Takes the lab down even when an assertion fails.
    struct Down<'a>(&'a str);
    impl Drop for Down<'_> {
        fn drop(&mut self) {
            let _ = std::process::Command::new(pliant())
                .args(["lab", "down", "--name", self.0])
                .output();
        }
    }
    let cfg_s = cfg.display().to_string();
    let lab_up = |extra: &[&str]| {
        let base = [
            "lab",
            "up",
            "--mode",
            "pliant-firewall",
            "--nf-config",
            &cfg_s,
        ];
        run(&[&base[..], extra].concat())
    };
    let up = lab_up(&["--name", &name]);
    let _down = Down(&name);
    assert!(
        up.status.success(),
        "lab up: {}",
        String::from_utf8_lossy(&up.stderr)
    );
    let ns = format!("{name}-client");
    let ok = |args: &[&str]| {
        std::process::Command::new("ip")
            .args(["netns", "exec", &ns])
            .args(args)
            .status()
            .expect("ip netns exec")
            .success()
    };
    assert!(
        ok(&[
            "curl",
            "-sf",
            "-o",
            "/dev/null",
            "--max-time",
            "5",
            "http://10.77.2.2/1M.bin"
        ]),
        "outbound HTTP is allowed by the file's rule"
    );
    assert!(
        !ok(&["ping", "-c", "1", "-W", "1", "10.77.2.2"]),
        "ping is denied by the file's default_outbound"
    );
    // A section the lab writes itself.
    std::fs::write(&cfg, "[replica]\nname = \"x\"\n").expect("write");
    let bad = lab_up(&[]);
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(
        !bad.status.success() && err.contains("[replica] is written by the lab"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
