//! Runs the forward benchmark for real on the kernel NAT peer (short window) and checks the
//! report is made of measured numbers; the pliant system without a binary must report an error
//! instead of numbers. Needs root, iperf3, trafgen (netsniff-ng), nftables, iputils-ping.

use pliant_bench::{run_forward, ForwardOpts};

#[test]
fn kernel_nat_is_measured_and_a_missing_pliant_is_reported_not_invented() {
    if !pliant_testkit::require_root()
        || !pliant_testkit::require_tool("iperf3", "iperf3")
        || !pliant_testkit::require_tool("trafgen", "netsniff-ng")
        || !pliant_testkit::require_tool("nft", "nftables")
    {
        return;
    }
    let opts = ForwardOpts {
        duration_s: 1,
        flows: 64,
        pliant_bin: None,
        only: vec!["kernel_nat".into(), "pliant_nat".into()],
        disable_offloads: false,
    };
    let r = run_forward(&opts);
    let kn = &r.kernel_nat;
    assert!(kn.error.is_none(), "{:?}", kn.error);
    assert!(kn.errors.is_empty(), "{:?}", kn.errors);
    assert!(kn.gbps_1stream.is_some_and(|g| g > 0.0), "{kn:?}");
    assert!(kn.gbps_4streams.is_some_and(|g| g > 0.0), "{kn:?}");
    assert!(kn.pps_64b.is_some_and(|p| p > 0.0), "{kn:?}");
    assert!(kn.pps_64b_sent.is_some_and(|p| p > 0.0), "{kn:?}");
    let (p50, p99) = (kn.rtt_us_p50.expect("p50"), kn.rtt_us_p99.expect("p99"));
    assert!(p50 > 0.0 && p99 >= p50, "p50 {p50} p99 {p99}");
    assert_eq!(kn.rtt_samples, Some(500));

    // Not selected: an explanation, no numbers.
    assert!(
        r.kernel_forward
            .error
            .as_deref()
            .is_some_and(|e| e.contains("not selected")),
        "{:?}",
        r.kernel_forward.error
    );
    assert!(r.kernel_forward.gbps_1stream.is_none());
    // No binary: an error naming the cause, no numbers, no ratios.
    let pl = &r.pliant_nat;
    assert!(
        pl.error
            .as_deref()
            .is_some_and(|e| e.contains("pliant binary")),
        "{pl:?}"
    );
    assert!(pl.pps_64b.is_none() && pl.gbps_1stream.is_none());
    assert!(r.ratio_pps_vs_kernel_nat.is_none() && r.added_rtt_us_p50.is_none());

    let line = serde_json::to_string(&r).expect("json");
    let v: serde_json::Value = serde_json::from_str(&line).expect("reparse");
    assert!(v["kernel_nat"]["pps_64b"].as_f64().is_some_and(|p| p > 0.0));
}
