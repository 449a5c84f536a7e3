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
//! Needs root (`pliant_testkit::require_root`).

mod common;
use common::*;
use pliant_lab::Role;
use std::time::Duration;

#[test]
fn mbserv_forwards_known_flows_and_drops_unknown_mid_stream_packets() {
    if !pliant_testkit::require_root() {
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
