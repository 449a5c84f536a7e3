//! `pliant replica` refuses a bad config file with the file, line and reason, before starting
//! anything (no root needed: validation happens before any interface is touched).

use std::process::Command;

fn run(cfg: &str) -> (bool, String) {
    let dir = std::env::temp_dir().join(format!("pliant-cfg-{}-{}", std::process::id(), cfg.len()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("bad.toml");
    std::fs::write(&path, cfg).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_pliant"))
        .args(["replica", "--check", "--config", path.to_str().unwrap()])
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout),
    )
}

const GOOD: &str = r#"[replica]
name = "r1"
control_socket = "/run/pliant/r1.sock"

[inside]
ifname = "r1in"
addresses = ["10.77.1.1/24"]

[outside]
ifname = "r1out"
addresses = ["10.77.2.1/24"]

[nf]
kind = "nat"

[nat]
external_ip = "10.77.2.1"
"#;

#[test]
fn good_config_passes_check() {
    let (ok, out) = run(GOOD);
    assert!(ok, "{out}");
    assert!(out.contains("config ok"), "{out}");
}

#[test]
fn syntax_error_names_file_and_line() {
    let (ok, out) = run(&GOOD.replace("kind = \"nat\"", "kind = nat"));
    assert!(!ok);
    assert!(out.contains("bad.toml:14:"), "{out}");
}

#[test]
fn bad_nf_section_names_its_line() {
    let (ok, out) = run(&GOOD.replace("10.77.2.1\"\n", "10.77.2.1\"\nport_mni = 3\n"));
    assert!(!ok);
    assert!(
        out.contains("bad.toml:18:") && out.contains("port_mni"),
        "{out}"
    );
    let (ok, out) = run(&GOOD.replace(
        "external_ip = \"10.77.2.1\"",
        "external_ip = \"10.77.2.1\"\nport_min = 5\nport_max = 4",
    ));
    assert!(!ok);
    assert!(out.contains("port range"), "{out}");
}

#[test]
fn bad_cidr_is_refused() {
    let (ok, out) = run(&GOOD.replace("10.77.1.1/24", "10.77.1.300/24"));
    assert!(!ok);
    assert!(
        out.contains("bad.toml:7:") && out.contains("bad address"),
        "{out}"
    );
}

#[test]
fn shared_hub_needs_an_identity_and_takes_no_secret() {
    let sec = "\n[security]\nidentity = \"/run/pliant/id/r1\"\n";
    let (ok, out) = run(&format!("{GOOD}{sec}\n[shared]\nhub = \"10.0.0.5:7400\"\n"));
    assert!(ok, "a TCP hub endpoint with an identity: {out}");
    let (ok, out) = run(&format!(
        "{GOOD}\n[shared]\nhub = \"/run/pliant/hub.sock\"\n"
    ));
    assert!(!ok);
    assert!(
        out.contains("[shared] needs a [security] identity"),
        "{out}"
    );
    let (ok, out) = run(&format!(
        "{GOOD}{sec}\n[shared]\nhub = \"/run/pliant/hub.sock\"\nsecret = \"/run/pliant/hub.secret\"\n"
    ));
    assert!(!ok);
    assert!(out.contains("[shared] secret is no longer used"), "{out}");
}
