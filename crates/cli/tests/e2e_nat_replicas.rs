//! End-to-end: `pliant lab up --mode pliant-nat --replicas 3` without a controller. The
//! replicas share the NAT address, so the lab gives each its own port block (`[nat]
//! port_blocks`, replica n: 20000 + (n-1)*1000 ..= +999) and points the fabric's `port_owner`
//! at it; replies to the NAT address then reach the replica that holds the mapping. Proves:
//! the blocks in each replica's NAT and in the steering map, and that 16 TCP downloads and 16
//! UDP echo flows from distinct client ports, spread over the replicas by the ring, all get
//! their answers (with every replica allocating from the whole range, replies went by the ring
//! to whichever replica, about two thirds of them to one without the mapping). Needs root.

mod common;
use pliant_lab::{Lab, LabSpec, PliantNf, ReplicaMode, Role};
use std::path::PathBuf;
use std::time::Duration;

/// 16 HTTP downloads of /1M.bin, each on a new connection (Python, appending failures to
/// `bad` as `common::lab_scripts` expects).
const DOWNLOADS: &str = "for i in range(16):\n\
\x20   try:\n\
\x20       c = http.client.HTTPConnection(sys.argv[1], 80, timeout=5)\n\
\x20       c.request('GET', '/1M.bin')\n\
\x20       n = len(c.getresponse().read())\n\
\x20       if n != 1 << 20:\n\
\x20           bad.append('tcp %d: %d bytes' % (i, n))\n\
\x20   except Exception as e:\n\
\x20       bad.append('tcp %d: %s' % (i, e))\n";

fn ask(sock: &std::path::Path, r: pliant_proto::Request) -> serde_json::Value {
    pliant_lab::ha::control_client(sock)
        .call(&r)
        .expect("control request")
}

#[test]
fn replicas_without_a_controller_get_disjoint_port_blocks_steered_back_to_them() {
    if !pliant_testkit::require_root() || !pliant_testkit::require_tool("python3", "python3") {
        return;
    }
    let mut spec = LabSpec::new(ReplicaMode::Pliant {
        config: PliantNf::nat(),
    });
    spec.progress = false;
    spec.replicas = 3;
    spec.pliant_bin = Some(PathBuf::from(env!("CARGO_BIN_EXE_pliant")));
    let lab = Lab::up(spec).unwrap_or_else(|e| panic!("lab up: {e}"));

    let maps =
        pliant_steer::SteerMaps::open_pinned(&pliant_steer::lab::pin_dir(&lab.netns(Role::Fabric)))
            .expect("open the fabric's pinned steering maps");
    let owner = |p: u16| maps.port_owner(p).expect("port_owner");
    assert_eq!(
        [20000, 20999, 21000, 22999, 23000].map(owner),
        [Some(1), Some(1), Some(2), Some(3), None]
    );
    for n in 1..=3u8 {
        let q = ask(lab.replica_socket(n).unwrap(), pliant_proto::Request::Query);
        let (lo, hi) = pliant_lab::ha::nat_port_block(n).unwrap();
        let blocks = &q["query"]["pools"]["tcp"]["blocks"];
        assert_eq!(blocks, &serde_json::json!([[lo, hi]]), "r{n}: {q}");
    }

    let checks = format!(
        "{DOWNLOADS}{}",
        common::lab_scripts::udp_round_trips("udp", 16, 64, 6)
    );
    let verdict = common::lab_scripts::run_client(&lab, &checks, Duration::from_secs(120));
    let mut busy = 0;
    for n in 1..=3u8 {
        let st = ask(lab.replica_socket(n).unwrap(), pliant_proto::Request::Stats);
        let created = st["nf_counters"]["nat_mappings_created"]
            .as_u64()
            .unwrap_or(0);
        eprintln!("r{n}: {created} mappings, drops {}", st["drops"]);
        busy += u32::from(created > 0);
    }
    lab.down().ok();
    assert_eq!(verdict, "ok");
    assert!(busy >= 2, "the flows never spread over the replicas");
}
