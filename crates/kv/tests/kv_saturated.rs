//! End to end: a saturated cluster — an offered write load above what its hosts' CPU quotas
//! serve — scaled out serves the offered load again, and the throughput dip while partitions
//! move lasts seconds (the seed's experiment: 15k -> 20k TPS after adding hosts).
//!
//! The offered load is open loop (each partition's writer is due a number of writes per
//! second whether or not the cluster keeps up; a writer more than a second behind drops the
//! backlog, so what was not served is not made up later). It is set from the cluster's own
//! measured capacity at 2 hosts (closed loop: as fast as it takes them), so the test does not
//! depend on this machine's speed: 1.4 x that capacity is above 2 hosts' quotas and below 4
//! hosts' (measured here: 4 hosts served 1.46 x 2 hosts' capacity; the machine's two cores
//! run the writers too).

mod common;

use pliant_kv::cluster::{self, Kv, UpOpts};
use pliant_kv::invariant;
use pliant_kv::scale::{self, ScaleOpts};
use pliant_kv::state::KvState;
use pliant_kv::Planner;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const PARTITIONS: usize = 8;
/// Offered load over the capacity measured at 2 hosts.
const OVERLOAD: f64 = 1.4;
/// 2 hosts are saturated when they serve less than this share of the offered load.
const SATURATED: f64 = 0.8;
/// The offered load counts as served again at this share.
const RESTORED: f64 = 0.9;
/// Acknowledged writes per second over `d`.
fn rate_over(ops: &AtomicU64, d: Duration) -> f64 {
    let a = ops.load(Ordering::Relaxed);
    std::thread::sleep(d);
    (ops.load(Ordering::Relaxed) - a) as f64 / d.as_secs_f64()
}

#[test]
fn a_saturated_cluster_scaled_out_serves_the_offered_load_again() {
    let Some(dir) = common::cluster_dir("sat") else {
        return;
    };
    let _guard = cluster::DownOnDrop(dir.clone());
    let mut kv = Kv::up(&UpOpts {
        hosts: 2,
        partitions: PARTITIONS,
        k: 1,
        cpu_quota_pct: 10,
        dir: dir.clone(),
        planner: Planner::Online { time_limit_s: 15.0 },
    })
    .expect("up");
    let t0 = Instant::now();

    let stop = Arc::new(AtomicBool::new(false));
    let ops = Arc::new(AtomicU64::new(0));
    let rates: Vec<Arc<AtomicU64>> = (0..PARTITIONS)
        .map(|_| Arc::new(AtomicU64::new(common::CLOSED)))
        .collect();
    let writers: Vec<_> = (0..PARTITIONS)
        .map(|p| {
            let (dir, stop, rate, ops) = (dir.clone(), stop.clone(), rates[p].clone(), ops.clone());
            std::thread::spawn(move || common::writer(dir, p, PARTITIONS, stop, rate, ops))
        })
        .collect();
    // Achieved writes/s every half second, for the timeline and the dip.
    let timeline: Arc<Mutex<Vec<(f64, f64)>>> = Arc::default();
    let sampler = {
        let (stop, ops, timeline) = (stop.clone(), ops.clone(), timeline.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let r = rate_over(&ops, Duration::from_millis(500));
                timeline
                    .lock()
                    .unwrap()
                    .push((t0.elapsed().as_secs_f64(), r));
            }
        })
    };

    // Capacity at 2 hosts: as fast as it takes them (after a second to warm up).
    std::thread::sleep(Duration::from_secs(1));
    let capacity = rate_over(&ops, Duration::from_secs(4));
    assert!(capacity > 1000.0, "2 hosts served {capacity:.0} writes/s");
    // Offered: above what 2 hosts serve, evenly over the partitions. A closed loop can fall
    // short of the servers' capacity (each writer waits for its batch; the CPU quotas run in
    // bursts), so an offer that 2 hosts still serve (SATURATED) is raised until they do not:
    // to what they served over SATURATED less a margin, not further (4 hosts must serve it).
    let mut offered = capacity * OVERLOAD;
    let mut before;
    let mut tries = 0;
    loop {
        for r in &rates {
            r.store((offered / PARTITIONS as f64) as u64, Ordering::Relaxed);
        }
        std::thread::sleep(Duration::from_secs(1));
        before = rate_over(&ops, Duration::from_secs(4));
        eprintln!(
            "2 hosts: capacity {capacity:.0} writes/s (closed loop); offered {offered:.0}, \
             achieved {before:.0}"
        );
        tries += 1;
        if before < SATURATED * offered {
            break;
        }
        assert!(
            tries < 4,
            "not saturated: {before:.0} of {offered:.0} writes/s offered at 2 hosts"
        );
        offered = (offered * 1.1).max(before / (SATURATED - 0.05));
    }

    // Out to 4 under the offered load.
    let t_scale = t0.elapsed().as_secs_f64();
    let done = scale::scale(
        &mut kv,
        &ScaleOpts {
            target: 4,
            planner: Planner::Online { time_limit_s: 15.0 },
            window: Duration::from_secs(1),
            parallel: pliant_kv::moves::PARALLEL,
        },
        &mut |l| eprintln!("[{:>5.1} s] {l}", t0.elapsed().as_secs_f64()),
    )
    .expect("scale out to 4");
    let t_scaled = t0.elapsed().as_secs_f64();
    assert_eq!(kv.state.hosts.len(), 4);
    assert!(!done.is_empty(), "scaled out without a move");
    std::thread::sleep(Duration::from_secs(2));
    let after = rate_over(&ops, Duration::from_secs(5));
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.join().unwrap();
    }
    sampler.join().unwrap();

    // The dip: from the start of the scale-out until a sample serves what was offered (90 %),
    // and the lowest sample in between.
    let tl = timeline.lock().unwrap().clone();
    let during: Vec<(f64, f64)> = tl.iter().copied().filter(|(t, _)| *t > t_scale).collect();
    let restored_at = during
        .iter()
        .find(|(_, r)| *r >= RESTORED * offered)
        .map(|(t, _)| t - t_scale);
    let lowest = during
        .iter()
        .filter(|(t, _)| *t <= t_scaled)
        .map(|(_, r)| *r)
        .fold(f64::INFINITY, f64::min);
    let report = serde_json::json!({
        "capacity_2_hosts": capacity.round(), "offered": offered.round(),
        "achieved_2_hosts": before.round(), "achieved_4_hosts": after.round(),
        "scale_out_s": t_scaled - t_scale, "moves": done.len(),
        "restored_after_s": restored_at, "lowest_during_scale": lowest.round(),
        "timeline": tl.iter().map(|(t, r)| [(t * 10.0).round() / 10.0, r.round()]).collect::<Vec<_>>(),
    });
    eprintln!("{report}");
    assert!(
        after >= RESTORED * offered,
        "4 hosts served {after:.0} of {offered:.0} writes/s offered: {report}"
    );
    // Follows from the two bounds (2 hosts served < SATURATED, 4 hosts >= RESTORED of the
    // same offer); checked on its own so a report names it.
    assert!(
        after >= RESTORED / SATURATED * before,
        "scaling out did not raise throughput ({before:.0} -> {after:.0}): {report}"
    );
    assert!(restored_at.is_some(), "{report}");
    let st = KvState::load(&dir).unwrap();
    let counts: Vec<usize> = st.placement().iter().map(Vec::len).collect();
    assert!(
        invariant::below_k_plus_one(&counts, st.k).is_empty(),
        "copies per partition {counts:?}"
    );
}
