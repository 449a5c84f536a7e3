//! Helpers shared by the namespace e2e tests (each test file includes this module; not every
//! file uses every helper).
#![allow(dead_code)]

/// The HA harness (3-replica HA lab + controller), used by the `e2e_ha_*` tests.
pub mod ha;
/// Long-lived UDP/TCP generations and controller checks for the kill-trial tests.
pub mod kill_trials;
/// Server and client scripts in a lab (UDP echo round trips through its NAT, ...).
pub mod lab_scripts;
/// Loss-free migration checks (sequence-numbered UDP stream, whole drops map).
pub mod migration;

use pliant_lab::{Lab, LabSpec, PliantNf, ReplicaMode};
use pliant_runtime::config::ReplicaConfig;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

pub fn pliant() -> &'static str {
    env!("CARGO_BIN_EXE_pliant")
}

/// The NF sections, parsed exactly as the replica will parse them.
pub fn nf(kind: &str, section: &str) -> PliantNf {
    let text = format!(
        "[replica]\nname = \"e2e\"\ncontrol_socket = \"/e2e.sock\"\n\
         [inside]\nifname = \"in0\"\naddresses = []\n\
         [outside]\nifname = \"out0\"\naddresses = []\n\
         [nf]\nkind = \"{kind}\"\n{section}\n"
    );
    let cfg = ReplicaConfig::parse(&text, "e2e").unwrap_or_else(|e| panic!("{e}"));
    PliantNf::new(kind, cfg.nf_sections)
}

pub fn lab_up(config: PliantNf) -> Lab {
    let mut spec = LabSpec::new(ReplicaMode::Pliant { config });
    spec.pliant_bin = Some(PathBuf::from(pliant()));
    // MTU-sized frames with real checksums (no GSO super-frames) for the user-space path.
    spec.disable_offloads = true;
    Lab::up(spec).unwrap_or_else(|e| panic!("lab up: {e}"))
}

pub fn ask(lab: &Lab, args: &[&str]) -> serde_json::Value {
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

pub fn wait_for(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + timeout;
    while Instant::now() < end {
        if f() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("timed out waiting for {what}");
}
