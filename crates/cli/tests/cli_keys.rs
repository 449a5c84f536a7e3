//! `pliant keys`: a CA, identities issued from it that pliant-wire loads, and refusals that
//! never overwrite key material.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

fn pliant(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_pliant"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout),
    )
}

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o777
}

struct Dir(PathBuf);

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `pliant keys issue --ca CA --name NAME --role R... --out OUT [extra...]`.
fn issue(ca: &Path, name: &str, roles: &[&str], out: &Path, extra: &[&str]) -> (bool, String) {
    let (ca, out) = (ca.to_str().unwrap(), out.to_str().unwrap());
    let mut args = vec!["keys", "issue", "--ca", ca, "--name", name, "--out", out];
    for r in roles {
        args.extend(["--role", r]);
    }
    args.extend(extra);
    pliant(&args)
}

#[test]
fn a_ca_issues_identities_that_load_and_nothing_is_overwritten() {
    let d = Dir(std::env::temp_dir().join(format!("pliant-keys-{}", std::process::id())));
    let ca = d.0.join("ca");
    let ca_dir = ca.to_str().unwrap();
    let (ok, out) = pliant(&["keys", "ca", "--dir", ca_dir]);
    assert!(ok, "{out}");
    assert_eq!(mode(&ca.join("ca.key")), 0o600);
    assert!(ca.join("ca.pub").exists());
    let key_before = std::fs::read(ca.join("ca.key")).unwrap();
    let (ok, out) = pliant(&["keys", "ca", "--dir", ca_dir]);
    assert!(!ok && out.contains("already holds a CA"), "{out}");
    assert_eq!(std::fs::read(ca.join("ca.key")).unwrap(), key_before);

    let hub = d.0.join("hub");
    let (ok, out) = issue(&ca, "hub", &["service"], &hub, &[]);
    assert!(ok, "{out}");
    let r1 = d.0.join("r1");
    let (ok, out) = issue(&ca, "r1", &["replica", "admin"], &r1, &["--days", "2"]);
    assert!(ok, "{out}");
    assert_eq!(mode(&r1.join("node.key")), 0o600);
    let id = pliant_wire::Identity::load(&r1).unwrap();
    assert_eq!(id.name(), "r1");
    assert_eq!(
        id.cert.roles,
        pliant_wire::role::REPLICA | pliant_wire::role::ADMIN
    );
    let days = (id.cert.not_after - pliant_wire::identity::now_unix()) / 86_400;
    assert!(days == 1 || days == 2, "{days}");
    let hub_id = pliant_wire::Identity::load(&hub).unwrap();
    assert_eq!(hub_id.cert.roles, pliant_wire::role::SERVICE);
    assert_eq!(hub_id.ca_pub, id.ca_pub);

    // Refusals: an existing identity, no CA, a bad name, a bad role, bad days.
    let (ok, out) = issue(&ca, "r1", &["replica"], &r1, &[]);
    assert!(!ok && out.contains("already holds an identity"), "{out}");
    assert_eq!(pliant_wire::Identity::load(&r1).unwrap().cert, id.cert);
    let r2 = d.0.join("r2");
    let (ok, out) = issue(&d.0.join("nowhere"), "r2", &["replica"], &r2, &[]);
    assert!(!ok && out.contains("holds no ca.key"), "{out}");
    let (ok, out) = issue(&ca, "r 2", &["replica"], &r2, &[]);
    assert!(!ok && out.contains("not printable"), "{out}");
    assert!(!r2.exists(), "a refused name leaves no directory behind");
    let (ok, out) = issue(&ca, "r2", &["root"], &r2, &[]);
    assert!(!ok && out.contains("possible values"), "{out}");
    let (ok, out) = issue(&ca, "r2", &["replica"], &r2, &["--days", "0"]);
    assert!(!ok && out.contains("--days 0"), "{out}");
}
