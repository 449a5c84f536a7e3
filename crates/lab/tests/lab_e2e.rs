//! End-to-end tests of the lab itself: real namespaces, nginx, iperf3 and curl.
//! Need root and the Debian packages listed in the crate README.

use pliant_lab::{
    down_by_name, state, status, Lab, LabSpec, ReplicaMode, Role, CLIENT_IP, OUTSIDE_GW_IP,
};
use std::path::PathBuf;
use std::sync::Mutex;

/// What a test saw of a lab, to check afterwards that none of it is left.
#[derive(Clone, Debug, Default)]
struct Footprint {
    namespaces: Vec<String>,
    pids: Vec<state::ProcRecord>,
    run_dir: PathBuf,
}

fn footprint(lab: &Lab) -> Footprint {
    Footprint {
        namespaces: lab.state().namespaces.clone(),
        pids: lab.state().procs.clone(),
        run_dir: lab.run_dir().to_path_buf(),
    }
}

fn assert_present(fp: &Footprint) {
    assert_eq!(fp.namespaces.len(), 4, "client, fabric, server, r1: {fp:?}");
    for ns in &fp.namespaces {
        assert!(state::netns_exists(ns), "namespace {ns} missing while up");
    }
    assert!(fp.pids.iter().any(|p| p.role == "nginx"), "{fp:?}");
    assert!(fp.pids.iter().any(|p| p.role == "iperf3"), "{fp:?}");
    for p in &fp.pids {
        assert!(state::proc_matches(p), "process {p:?} not running while up");
    }
    assert!(fp.run_dir.join("state.json").exists());
}

fn assert_gone(fp: &Footprint) {
    assert!(
        !fp.namespaces.is_empty() && !fp.pids.is_empty(),
        "empty footprint: {fp:?}"
    );
    for ns in &fp.namespaces {
        assert!(!state::netns_exists(ns), "namespace {ns} left behind");
    }
    for p in &fp.pids {
        // Alive-with-our-marker is what matters: a recycled PID running something else is fine.
        assert!(!state::proc_matches(p), "process {p:?} left behind");
    }
    assert!(
        !fp.run_dir.exists(),
        "run dir {} left behind",
        fp.run_dir.display()
    );
}

fn spec(mode: ReplicaMode) -> LabSpec {
    let mut s = LabSpec::new(mode);
    s.progress = false;
    s
}

#[test]
fn up_then_down_leaves_nothing_behind() {
    if !pliant_testkit::require_root() {
        return;
    }
    let lab = Lab::up(spec(ReplicaMode::KernelForward)).expect("lab up");
    let fp = footprint(&lab);
    assert_present(&fp);
    // The client reaches the server through the fabric and the kernel router.
    let out = lab
        .exec(
            Role::Client,
            &["curl", "-sS", "--max-time", "10", "http://10.77.2.2/"],
        )
        .expect("curl runs");
    assert!(out.success(), "curl failed: {}", out.stderr);
    assert!(
        out.stdout.contains(lab.name()),
        "index names the lab: {}",
        out.stdout
    );
    lab.down().expect("clean down");
    assert_gone(&fp);
}

#[test]
fn panic_mid_test_still_cleans_up() {
    if !pliant_testkit::require_root() {
        return;
    }
    let seen: Mutex<Footprint> = Mutex::new(Footprint::default());
    let r = std::panic::catch_unwind(|| {
        let lab = Lab::up(spec(ReplicaMode::KernelForward)).expect("lab up");
        *seen.lock().expect("lock") = footprint(&lab);
        assert_present(&footprint(&lab));
        panic!("simulated test failure while the lab is up");
    });
    assert!(r.is_err(), "the closure must have panicked");
    let fp = seen
        .lock()
        .map(|g| g.clone())
        .unwrap_or_else(|p| p.into_inner().clone());
    assert_gone(&fp);
}

#[test]
fn two_labs_at_once_do_not_collide() {
    if !pliant_testkit::require_root() {
        return;
    }
    let a = Lab::up(spec(ReplicaMode::KernelForward)).expect("lab a");
    let b = Lab::up(spec(ReplicaMode::KernelNat)).expect("lab b");
    assert_ne!(a.name(), b.name());
    for lab in [&a, &b] {
        let out = lab
            .exec(
                Role::Client,
                &["curl", "-sS", "--max-time", "10", "http://10.77.2.2/"],
            )
            .expect("curl");
        assert!(out.success(), "{}: {}", lab.name(), out.stderr);
        // Each client reaches its own lab's server (the index page names the lab).
        assert!(
            out.stdout.contains(lab.name()),
            "{} got {}",
            lab.name(),
            out.stdout
        );
    }
    let (fa, fb) = (footprint(&a), footprint(&b));
    a.down().expect("down a");
    // b is untouched by a's teardown.
    assert_present(&fb);
    b.down().expect("down b");
    assert_gone(&fa);
    assert_gone(&fb);
}

#[test]
fn curl_through_kernel_nat_verifies_checksum_and_server_sees_nat_address() {
    if !pliant_testkit::require_root() {
        return;
    }
    let lab = Lab::up(spec(ReplicaMode::KernelNat).with_file("8M.bin", 8 << 20)).expect("lab up");
    for f in lab.served_files().to_vec() {
        let dst = lab.run_dir().join(format!("got-{}", f.name));
        let d = dst.display().to_string();
        let out = lab
            .exec(
                Role::Client,
                &["curl", "-sS", "--max-time", "30", "-o", &d, &f.url],
            )
            .expect("curl");
        assert!(out.success(), "curl {}: {}", f.url, out.stderr);
        let sum = lab
            .exec_ok(Role::Client, &["sha256sum", &d])
            .expect("sha256sum");
        assert_eq!(
            sum.stdout.split_whitespace().next(),
            Some(f.sha256.as_str()),
            "{}",
            f.name
        );
        assert_eq!(std::fs::metadata(&dst).expect("file").len(), f.size_bytes);
    }
    let log = lab.access_log().expect("access log");
    assert_eq!(log.len(), lab.served_files().len(), "{log:?}");
    for e in &log {
        assert_eq!(
            e.remote_addr, OUTSIDE_GW_IP,
            "server must see only the NAT address"
        );
        assert_ne!(e.remote_addr, CLIENT_IP);
        assert_eq!(e.status, 200);
    }
    lab.down().expect("down");
}

#[test]
fn status_lists_a_live_lab_and_down_by_name_removes_a_detached_one() {
    if !pliant_testkit::require_root() {
        return;
    }
    let mut s = spec(ReplicaMode::KernelNat);
    s.detached = true;
    let lab = Lab::up(s).expect("lab up");
    let name = lab.name().to_string();
    let root = lab.run_dir().parent().expect("run root").to_path_buf();
    let fp = footprint(&lab);
    // Simulate the creator going away without Drop (as after `pliant lab up` or a crash).
    let st = lab.detach();
    assert_eq!(st.name, name);
    assert_present(&fp);
    let all = status(&root);
    let mine = all
        .iter()
        .filter_map(|r| r.as_ref().ok())
        .find(|s| s.state.name == name)
        .expect("lab listed by status");
    assert!(!mine.stale, "a detached lab is not stale");
    assert!(
        mine.namespaces.iter().all(|(_, up)| *up),
        "{:?}",
        mine.namespaces
    );
    assert!(
        mine.procs.iter().all(|(_, alive)| *alive),
        "{:?}",
        mine.procs
    );
    assert_eq!(mine.state.mode, "kernel-nat");

    let problems = down_by_name(&root, &name).expect("down by name");
    assert!(problems.is_empty(), "{problems:?}");
    assert_gone(&fp);
    assert!(status(&root)
        .iter()
        .filter_map(|r| r.as_ref().ok())
        .all(|s| s.state.name != name));
    assert!(matches!(
        down_by_name(&root, &name),
        Err(pliant_lab::LabError::NotFound(_))
    ));
}

#[test]
fn pliant_mode_without_binary_is_refused_before_anything_is_created() {
    let s = spec(ReplicaMode::Pliant {
        config: pliant_lab::PliantNf::nat(),
    });
    assert!(matches!(
        Lab::up(s),
        Err(pliant_lab::LabError::NoPliantBinary)
    ));
}

#[test]
fn a_lab_whose_owner_died_is_removed_by_down_stale() {
    if !pliant_testkit::require_root() {
        return;
    }
    let lab = Lab::up(spec(ReplicaMode::KernelForward)).expect("lab up");
    let name = lab.name().to_string();
    let root = lab.run_dir().parent().expect("run root").to_path_buf();
    let fp = footprint(&lab);
    // Simulate a crashed owner: forget the handle (no Drop) and make the recorded owner's
    // start time disagree with the live process, exactly what a dead, recycled PID looks like.
    let mut st = lab.detach();
    assert!(!st.is_stale(), "detach keeps the recorded owner");
    if let Some(o) = st.owner.as_mut() {
        o.start_ticks += 1;
    }
    st.save().expect("rewrite state");
    assert!(st.is_stale());
    assert_present(&fp);
    let removed = pliant_lab::down_stale(&root);
    let mine = removed
        .iter()
        .find(|(n, _)| *n == name)
        .expect("stale lab removed");
    assert!(mine.1.is_empty(), "{:?}", mine.1);
    assert_gone(&fp);
}

#[test]
fn two_replicas_are_steered_by_bpf_and_flows_spread_over_both() {
    if !pliant_testkit::require_root() {
        return;
    }
    let mut s = spec(ReplicaMode::KernelForward);
    s.replicas = 2;
    let lab = Lab::up(s).expect("lab up");
    let filters = lab
        .exec_ok(
            Role::Fabric,
            &["tc", "filter", "show", "dev", "fabclient", "ingress"],
        )
        .expect("tc");
    assert!(
        filters.stdout.contains("pliant_steer"),
        "{}",
        filters.stdout
    );
    for i in 0..20 {
        let out = lab
            .exec(
                Role::Client,
                &["curl", "-sS", "--max-time", "10", "http://10.77.2.2/"],
            )
            .expect("curl");
        assert!(out.success(), "curl {i}: {}", out.stderr);
        assert!(out.stdout.contains(lab.name()), "curl {i}: {}", out.stdout);
    }
    // The controller's view: every TCP connection pinned, both replicas used (a 20-flow
    // all-on-one split has probability 2^-19).
    let maps =
        pliant_steer::SteerMaps::open_pinned(&pliant_steer::lab::pin_dir(&lab.netns(Role::Fabric)))
            .expect("open pinned maps");
    let owners: std::collections::BTreeSet<u32> = maps
        .conn_entries()
        .expect("conn")
        .into_iter()
        .filter(|(k, _)| k.proto == 6)
        .map(|(_, r)| r)
        .collect();
    assert_eq!(owners, [1u32, 2].into_iter().collect(), "{owners:?}");
    let st = maps.stats().expect("stats");
    assert_eq!(st.get(pliant_steer::layout::Stat::DropDead), 0);
    let pins = pliant_steer::lab::pin_dir(&lab.netns(Role::Fabric));
    drop(maps);
    lab.down().expect("down");
    assert!(!pins.exists(), "pins left at {}", pins.display());
}

#[test]
fn unsupported_replica_counts_are_refused_with_a_typed_error() {
    for n in [0u8, pliant_lab::MAX_REPLICAS + 1] {
        let mut s = spec(ReplicaMode::KernelForward);
        s.replicas = n;
        assert!(
            matches!(Lab::up(s), Err(pliant_lab::LabError::Replicas { asked, .. }) if asked == n),
            "{n} replicas"
        );
    }
}
