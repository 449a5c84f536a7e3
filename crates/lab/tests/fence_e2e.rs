//! The lab-only fencing fallback (design invariant 7 without BPF steering): on a 1-replica lab
//! (tc mirred patch panel) `ha::fence_by_name` takes the replica's fabric-side veths down, so
//! nothing reaches it and nothing it emits leaves the fabric; unfencing restores the path.
//! Needs root (`pliant_testkit::require_root`).

use pliant_lab::{ha, Lab, LabSpec, ReplicaMode, Role};

fn curl_ok(lab: &Lab) -> bool {
    lab.exec(
        Role::Client,
        &[
            "curl",
            "-sS",
            "--max-time",
            "2",
            "-o",
            "/dev/null",
            "http://10.77.2.2/",
        ],
    )
    .map(|o| o.success())
    .unwrap_or(false)
}

#[test]
fn fenced_replica_links_carry_nothing_until_unfenced() {
    if !pliant_testkit::require_root() {
        return;
    }
    let mut spec = LabSpec::new(ReplicaMode::KernelForward);
    spec.progress = false;
    let lab = Lab::up(spec).expect("lab up");
    assert!(curl_ok(&lab), "path works before fencing");
    let root = lab.run_dir().parent().expect("run root").to_path_buf();
    ha::fence_by_name(&root, lab.name(), 1, true).expect("fence");
    let fab = lab.netns(Role::Fabric);
    for dev in ["fabr1in", "fabr1out"] {
        let out = lab
            .exec_ok(Role::Fabric, &["ip", "-j", "link", "show", "dev", dev])
            .expect("ip link");
        assert!(
            out.stdout.contains("\"operstate\":\"DOWN\""),
            "{fab}/{dev} not down: {}",
            out.stdout
        );
    }
    assert!(!curl_ok(&lab), "a fenced replica must not forward");
    ha::fence_by_name(&root, lab.name(), 1, false).expect("unfence");
    // veth carrier comes back within milliseconds; curl's own retry covers ARP.
    let mut ok = false;
    for _ in 0..20 {
        if curl_ok(&lab) {
            ok = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert!(ok, "path works again after unfencing");
    assert!(ha::fence_by_name(&root, "no-such-lab", 1, true).is_err());
    lab.down().expect("down");
}
