//! End-to-end: a network function written in C (examples/c/flowquota, linked against
//! libpliant.so) running as the replica of the namespace lab.
//!
//! Proves the C ABI works on real interfaces: HTTP and ping pass through the C NF; a ping
//! flow beyond its per-flow packet quota is cut off, with the drops counted in the replica's
//! stats (served by the runtime's control socket from inside the C program's `pkt_read`);
//! idle flows expire through flow timers in live time. Needs root (`pliant_testkit::require_root`).

use pliant_lab::{Lab, LabSpec, PliantNf, ReplicaMode, Role, SERVER_IP};
use pliant_runtime::config::ReplicaConfig;
use std::path::{Path, PathBuf};
use std::process::Command;

const QUOTA_PACKETS: i64 = 50;
const IDLE_MS: i64 = 1000;

fn pliant() -> &'static str {
    env!("CARGO_BIN_EXE_pliant")
}

/// Builds flowquota into `dir` against the libpliant.so beside the `pliant` binary (same
/// cargo profile). The library is not built from here: a nested cargo would wait on the lock
/// of the build that runs this test.
fn build_flowquota(dir: &Path) -> PathBuf {
    let libdir = Path::new(pliant()).parent().expect("binary dir");
    assert!(
        libdir.join("libpliant.so").exists(),
        "{}/libpliant.so missing: build it first (cargo build -p pliant-ffi, same profile)",
        libdir.display()
    );
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let bin = dir.join("flowquota");
    let out = Command::new("make")
        .arg("-s")
        .arg("-C")
        .arg(root.join("examples/c"))
        .arg(format!("BUILD={}", dir.display()))
        .arg(format!("LIBDIR={}", libdir.display()))
        .arg(&bin)
        .output()
        .expect("run make");
    assert!(
        out.status.success(),
        "building flowquota: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    bin
}

fn stats(lab: &Lab) -> serde_json::Value {
    let sock = lab.replica_socket(1).expect("replica socket");
    let out = Command::new(pliant())
        .args(["stats", "--json", "--socket"])
        .arg(sock)
        .output()
        .expect("run pliant stats");
    assert!(
        out.status.success(),
        "pliant stats: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("stats JSON")
}

#[test]
fn c_flowquota_forwards_enforces_quota_and_expires_flows() {
    if !pliant_testkit::require_root() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("pliant-e2e-c-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bin = build_flowquota(&dir);

    // The [c] section, parsed exactly as the replica will parse it.
    let text = format!(
        "[replica]\nname = \"e2e\"\ncontrol_socket = \"/e2e.sock\"\n\
         [inside]\nifname = \"in0\"\naddresses = []\n\
         [outside]\nifname = \"out0\"\naddresses = []\n\
         [nf]\nkind = \"c\"\n[c]\nquota_packets = {QUOTA_PACKETS}\nidle_ms = {IDLE_MS}\n"
    );
    let sections = ReplicaConfig::parse(&text, "e2e")
        .unwrap_or_else(|e| panic!("{e}"))
        .nf_sections;
    let mut spec = LabSpec::new(ReplicaMode::Pliant {
        config: PliantNf::new("c", sections),
    });
    spec.replica_command = Some(vec![bin.display().to_string()]);
    // MTU-sized frames with real checksums for the user-space path.
    spec.disable_offloads = true;
    let lab = Lab::up(spec).unwrap_or_else(|e| panic!("lab up: {e}"));

    // HTTP through the C NF (a small page: well under the per-flow quota).
    let out = lab
        .exec_ok(
            Role::Client,
            &[
                "curl",
                "-sS",
                "--max-time",
                "10",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                &format!("http://{SERVER_IP}/"),
            ],
        )
        .unwrap_or_else(|e| panic!("curl: {e}"));
    assert_eq!(out.stdout.trim(), "200");

    // One ping session is one flow (the echo identifier is its "port"): 40 requests, a quota
    // of 50 packets = 25 request/reply pairs, then every request is dropped.
    let ping = lab
        .exec(
            Role::Client,
            &["ping", "-c", "40", "-i", "0.05", "-W", "1", SERVER_IP],
        )
        .unwrap();
    assert!(ping.stdout.contains(" 25 received"), "{}", ping.stdout);
    let st = stats(&lab);
    assert_eq!(st["nf"], "c", "{st:#}");
    assert_eq!(st["drops"]["fq_over_quota"].as_u64(), Some(15), "{st:#}");

    // Both flows go idle and expire through their timers.
    std::thread::sleep(std::time::Duration::from_millis(3 * IDLE_MS as u64));
    let st = stats(&lab);
    assert!(
        st["nf_counters"]["fq_expired"].as_u64().unwrap_or(0) >= 2,
        "{st:#}"
    );
    assert_eq!(st["table"]["flows"].as_u64(), Some(0), "{st:#}");

    // A new ping session is a new flow with a fresh quota.
    let ping = lab
        .exec(
            Role::Client,
            &["ping", "-c", "3", "-i", "0.2", "-W", "1", SERVER_IP],
        )
        .unwrap();
    assert!(ping.stdout.contains(" 3 received"), "{}", ping.stdout);

    // SIGTERM makes pkt_read return PLIANT_ESTOPPED: the program leaves its loop, reports and
    // closes the context (ports, control socket, kernel guard released).
    let pids = Command::new("pgrep")
        .arg("-f")
        .arg(&bin)
        .output()
        .expect("pgrep");
    let pids = String::from_utf8_lossy(&pids.stdout).into_owned();
    let pid: i32 = pids
        .split_whitespace()
        .next()
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("flowquota not running: {pids:?}"));
    let kill = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .expect("kill");
    assert!(kill.success());
    // Exited: gone, or a zombie until the lab reaps its child.
    let exited = || {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| s.rsplit(") ").next().is_some_and(|r| r.starts_with('Z')))
            .unwrap_or(true)
    };
    let start = std::time::Instant::now();
    while !exited() {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(5),
            "flowquota ignored SIGTERM"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let log = std::fs::read_to_string(lab.replica_log(1)).unwrap_or_default();
    assert!(log.contains("flowquota: stopping; forwarded"), "{log}");
    assert!(
        !Path::new(lab.replica_socket(1).expect("socket")).exists(),
        "control socket removed on close"
    );
    drop(lab);
    let _ = std::fs::remove_dir_all(&dir);
}
