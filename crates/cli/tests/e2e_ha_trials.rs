//! Repeated kill trials under mixed traffic (Pico failover acceptance; no protection may name a
//! dead replica, no flow may be reordered or lose a datagram it did not have inside the victim).
//! One HA lab (NAT, three replicas, the controller protecting each with chords at 1 kHz); per
//! trial, with a seeded generator (seed printed; `PLIANT_TRIAL_SEED=<seed>` repeats victims and
//! delays):
//! - a new traffic generation (`common::kill_trials`): sequence-numbered UDP flows (2 on every
//!   replica, placed by the controller's ring) and a byte-pattern TCP stream on every replica,
//!   each living through three kills; two rate-limited downloads through the victim A (source
//!   ports the ring maps to A), their state acknowledged by the backups;
//! - a cut: which replica lists which flow, and how far each UDP flow has counted; the
//!   replicas' `ha_status` shows no refused checkpoint;
//! - a random delay (150-1150 ms), SIGKILL of A by PID, the controller's failover, a new
//!   replica (`pliant scale out`), both downloads complete with the served sha256, every
//!   replica protected again, no refused checkpoint.
//!
//! Each generation, once through its three kills, is judged: no UDP datagram reordered or
//! duplicated on any flow, none lost on a flow outside the trials in which it was on the victim
//! (loss is attributed seq by seq to the trial it happened in), every TCP stream complete with
//! 0 resets and 0 corrupted bytes. At the end: no flow activated twice (failover records and
//! the `duplicate_activations` counter), the controller's `protects_naming_unlive` is 0 and,
//! independently, no protection sent after a death was detected (`sent_unix_ms` in every
//! protection answer: failover records, scale-out answers, the poll's `reprotect` events)
//! names the dead replica; the survivors' output audit shows no violation. Prints a line per
//! trial and a summary, with how much held output re-protections moved to a flow's new group
//! (`held_moved`: under SIGKILL the survivors' links to the victim die at once, so this path is
//! rarely if ever taken here; its unit test is
//! `held_output_follows_its_flow_to_the_new_group_in_order`).
//!
//! Needs root (`pliant_testkit::require_root`). Run in release:
//! `cargo test --release -p pliant-cli --test e2e_ha_trials -- --test-threads=1 --nocapture`.

mod common;
use common::ha::*;
use common::kill_trials::{
    OffVictimLoss, Protections, ReplicaSamples, Rng, Traffic, UDP_PER_MEMBER,
};
use pliant_lab::PliantNf;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

const TRIALS: usize = 30;

/// One trial's failover, as the controller recorded it (detect: kill to detection, wall clock).
struct Row {
    detect_ms: f64,
    activated: u64,
    activate_ms: f64,
    steer_ms: f64,
    failover_ms: f64,
}

#[test]
fn thirty_random_kill_trials_keep_every_flow() {
    let Some(mut run) = ha_up("trials", PliantNf::nat(), &[("4M.bin", 4 << 20)]) else {
        return;
    };
    let f = run.lab().served_file("4M.bin").expect("file").clone();
    let mut rng = Rng::from_env_or_clock();
    eprintln!(
        "trial seed {} (PLIANT_TRIAL_SEED={} repeats the victims and delays)",
        rng.0, rng.0
    );
    let mut traffic = Traffic::new(&run, OffVictimLoss::Judged);
    let mut prot = Protections::default();
    let mut victims: BTreeMap<usize, u32> = BTreeMap::new();
    let mut next = 42_000u16;
    let mut rows = Vec::new();
    let mut duplicates = 0usize;
    let mut samples = ReplicaSamples::default();
    let t_all = Instant::now();
    for trial in 0..TRIALS {
        let members = run.members();
        assert_eq!(members.len(), 3, "trial {trial}: {members:?}");
        let a = members[(rng.next() % 3) as usize];
        traffic.start_gen(&run, trial);
        let ports = run.sports_for(a, 80, 2, &mut next);
        // ~2 s each.
        let rate = format!("{}", f.size_bytes / 2);
        let mut dls: Vec<Download> = ports
            .iter()
            .enumerate()
            .map(|(i, p)| run.curl(&f.url, *p, &rate, &format!("t{trial}-{i}")))
            .collect();
        // Their state acknowledged by the backups (older standby state does not count).
        wait_checkpointed(&run, a, &ports, Duration::from_secs(10));
        let cut = traffic.cut(&run, trial, a);
        for m in &members {
            assert!(
                cut.udp_per_member.get(m).copied().unwrap_or(0) >= UDP_PER_MEMBER,
                "trial {trial}: too few UDP flows on r{m}: {cut:?}"
            );
        }
        samples.sample(&run, &format!("trial {trial}, before"));
        prot.add_events(&run);
        // Into the transfers, at a random point.
        let delay = rng.kill_delay();
        std::thread::sleep(delay);
        let killed = run.kill(a);
        victims.insert(trial, a);
        let rec = run.wait_failover(a, killed.unix_ms, Duration::from_secs(5));
        let seen_ms = killed.at.elapsed().as_secs_f64() * 1e3;
        prot.failover(a, killed.unix_ms, &rec);
        let detect_ms = rec["detected_unix_ms"].as_f64().unwrap_or(f64::NAN) - killed.unix_ms;
        let added = prot.scale_out(&run);
        for d in dls.iter_mut() {
            d.finish(&f.sha256, &format!("trial {trial} (killed r{a})"));
        }
        let row = Row {
            detect_ms,
            activated: rec["activated"].as_u64().unwrap_or(0),
            activate_ms: rec["activate_ms"].as_f64().unwrap_or(f64::NAN),
            steer_ms: rec["steer_ms"].as_f64().unwrap_or(f64::NAN),
            failover_ms: rec["failover_ms"].as_f64().unwrap_or(f64::NAN),
        };
        eprintln!(
            "trial {trial:2}: killed r{a} after {} ms: {} of {} UDP flows and {} TCP streams \
             on it; detect {:.1} ms, {} flows activated, activate {:.2} ms, steer {:.2} ms, \
             failover {:.2} ms, kill->record seen {seen_ms:.0} ms; added r{}; by replica {}",
            delay.as_millis(),
            cut.udp_on_victim,
            cut.udp_flows,
            cut.tcp_on_victim,
            row.detect_ms,
            row.activated,
            row.activate_ms,
            row.steer_ms,
            row.failover_ms,
            added["replica"],
            rec["by_replica"]
        );
        if let Some(d) = rec["duplicates"].as_array().filter(|d| !d.is_empty()) {
            // Design invariant 1: a flow activated on two survivors would have two live copies
            // (a stale standby left on a backup the flow's group no longer uses).
            eprintln!("trial {trial}: flows activated twice: {d:?}");
            duplicates += d.len();
        }
        assert!(row.activated >= 2, "trial {trial}: {rec}");
        rows.push(row);
        // The new replica must be protected (and protect others) before the next kill.
        run.wait_protected(Duration::from_secs(15));
        prot.add_events(&run);
        samples.sample(&run, &format!("trial {trial}, after"));
        // Generations through their last kill are judged now.
        traffic.retire(trial, false, &victims);
    }
    traffic.retire(TRIALS, true, &victims);
    let t = traffic.totals.clone();
    let v = run.ha();
    let counters = &v["summary"]["counters"];
    eprintln!("{}", t.line());
    t.assert_clean_and_meaningful(TRIALS);
    // Each failover re-protects both survivors after its detection.
    prot.assert_none_named_the_dead(
        counters,
        2,
        &format!(
            "held output moved to a new group by re-protections: {}; refused-checkpoint \
             checks: {} replica statuses, 0 refused",
            samples.held_moved, samples.statuses
        ),
    );
    assert_eq!(
        duplicates, 0,
        "flows activated on two replicas (invariant 1)"
    );
    assert_eq!(counters["duplicate_activations"], 0, "{counters}");
    let (checked, violations, per) = run.audit();
    assert_eq!(violations, 0, "{per:?}");
    assert!(checked > 0, "{per:?}");
    let stat = |f: fn(&Row) -> f64| {
        let mut v: Vec<f64> = rows.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        (v[v.len() / 2], v[v.len() - 1])
    };
    let (d50, dmax) = stat(|r| r.detect_ms);
    let (a50, amax) = stat(|r| r.activate_ms);
    let (s50, smax) = stat(|r| r.steer_ms);
    let (f50, fmax) = stat(|r| r.failover_ms);
    eprintln!(
        "{TRIALS} trials in {:.0} s, zero resets, zero reordered, zero lost off the victims. \
         median/max: detect {d50:.1}/{dmax:.1} ms, activate {a50:.2}/{amax:.2} ms, steer \
         {s50:.2}/{smax:.2} ms, failover {f50:.2}/{fmax:.2} ms; output audit {checked} \
         checked, 0 violations",
        t_all.elapsed().as_secs_f64(),
    );
}
