//! End-to-end: MBServ (`nf.kind = "mbserv"`), the Pico test NF, in the namespace lab.
//!
//! Proves the acceptance criterion "the mbserv test shows an unknown mid-stream packet
//! dropped":
//! - HTTP downloads through MBServ work (the handshake creates flow state; every later packet
//!   fits it) and the configured strings in the requests are counted exactly;
//! - TCP segments of a connection MBServ never saw (crafted with a raw socket in the client
//!   namespace, no SYN) are dropped and counted as `mbserv_no_state`;
//! - flows are reported by state in `pliant query`.
//!
//! Needs root (skips otherwise).

use pliant_lab::{Lab, LabSpec, PliantNf, ReplicaMode, Role};
use pliant_runtime::config::ReplicaConfig;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .map(|s| {
            s.lines()
                .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false)
}

fn pliant() -> &'static str {
    env!("CARGO_BIN_EXE_pliant")
}

/// The NF sections, parsed exactly as the replica will parse them.
fn nf(kind: &str, section: &str) -> PliantNf {
    let text = format!(
        "[replica]\nname = \"e2e\"\ncontrol_socket = \"/e2e.sock\"\n\
         [inside]\nifname = \"in0\"\naddresses = []\n\
         [outside]\nifname = \"out0\"\naddresses = []\n\
         [nf]\nkind = \"{kind}\"\n{section}\n"
    );
    let cfg = ReplicaConfig::parse(&text, "e2e").unwrap_or_else(|e| panic!("{e}"));
    PliantNf::new(kind, cfg.nf_sections)
}

fn lab_up(config: PliantNf) -> Lab {
    let mut spec = LabSpec::new(ReplicaMode::Pliant { config });
    spec.pliant_bin = Some(PathBuf::from(pliant()));
    // MTU-sized frames with real checksums (no GSO super-frames) for the user-space path.
    spec.disable_offloads = true;
    Lab::up(spec).unwrap_or_else(|e| panic!("lab up: {e}"))
}

fn ask(lab: &Lab, args: &[&str]) -> serde_json::Value {
    let sock = lab.replica_socket(1).expect("pliant replica socket");
    let out = Command::new(pliant())
        .args(args)
        .arg("--socket")
        .arg(sock)
        .output()
        .expect("run pliant");
    assert!(
        out.status.success(),
        "pliant {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "pliant {args:?} JSON: {e}: {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

fn wait_for(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + timeout;
    while Instant::now() < end {
        if f() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("timed out waiting for {what}");
}

#[test]
fn mbserv_forwards_known_flows_and_drops_unknown_mid_stream_packets() {
    if !is_root() {
        eprintln!("skipping: needs root for network namespaces");
        return;
    }
    let lab = lab_up(nf(
        "mbserv",
        "[mbserv]\npatterns = [\"malicious\", \"attack\"]\n",
    ));
    let f = lab.served_file("1M.bin").expect("served file").clone();

    // Three downloads whose request line carries one pattern each (the served content is
    // pseudo-random: a 6+ byte pattern in it is vanishingly unlikely).
    for q in ["malicious=1", "attack=2", "x=malicious"] {
        let url = format!("{}?{q}", f.url);
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
                    &url,
                ],
            )
            .unwrap_or_else(|e| panic!("curl: {e}"));
        assert_eq!(
            out.stdout.trim(),
            format!("200 {}", f.size_bytes),
            "through mbserv"
        );
    }
    wait_for("match count", Duration::from_secs(5), || {
        ask(&lab, &["query"])["matches"] == 3
    });
    let st = ask(&lab, &["stats", "--json"]);
    assert_eq!(st["nf_counters"]["mbserv_matches"], 3, "{st:#}");
    assert!(
        st["drops"]["mbserv_no_state"].is_null(),
        "no drops for known flows: {st:#}"
    );

    // Mid-stream segments (ACK + data, no SYN) of an unknown connection.
    let py = r#"
import socket, struct
def csum(b):
    if len(b) % 2:
        b += b"\0"
    s = sum(struct.unpack("!%dH" % (len(b) // 2), b))
    s = (s >> 16) + (s & 0xffff)
    s += s >> 16
    return (~s) & 0xffff
src, dst = "10.77.1.2", "10.77.2.2"
payload = b"mid-stream data of a flow nobody knows"
tcp = struct.pack("!HHIIBBHHH", 45678, 80, 123456, 654321, 5 << 4, 0x18, 65535, 0, 0) + payload
pseudo = socket.inet_aton(src) + socket.inet_aton(dst) + struct.pack("!BBH", 0, 6, len(tcp))
c = csum(pseudo + tcp)
tcp = tcp[:16] + struct.pack("!H", c) + tcp[18:]
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP)
for _ in range(3):
    s.sendto(tcp, (dst, 0))
"#;
    lab.exec_ok(Role::Client, &["/usr/bin/python3", "-c", py])
        .unwrap_or_else(|e| panic!("raw sender: {e}"));
    wait_for("mbserv_no_state drops", Duration::from_secs(5), || {
        ask(&lab, &["stats", "--json"])["drops"]["mbserv_no_state"]
            .as_u64()
            .unwrap_or(0)
            >= 3
    });
    let q = ask(&lab, &["query"]);
    assert_eq!(
        q["matches"], 3,
        "the dropped segments were not scanned: {q:#}"
    );
    assert!(q["flows"].as_u64().unwrap_or(0) >= 1, "{q:#}");
}
