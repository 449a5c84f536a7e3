//! End to end: the TPC-C-like mix (Redis Functions keyed by warehouse hash tags) runs while
//! the cluster scales out and back in; afterwards every acknowledged transaction is recorded,
//! every warehouse meets the consistency conditions, a retried transaction is not applied twice,
//! and the check does catch a corrupted total.

mod common;

use pliant_kv::cluster::{self, Kv, UpOpts};
use pliant_kv::invariant;
use pliant_kv::redis_bench;
use pliant_kv::scale::{self, ScaleOpts};
use pliant_kv::state::KvState;
use pliant_kv::tpcc::{self, Mix, TpccOpts};
use pliant_kv::Planner;
use std::time::{Duration, Instant};

#[test]
fn the_tpcc_mix_stays_consistent_across_scale_out_and_in() {
    let Some(dir) = common::cluster_dir("tpcc") else {
        return;
    };
    let _guard = cluster::DownOnDrop(dir.clone());
    let t0 = Instant::now();
    let mut kv = Kv::up(&UpOpts {
        hosts: 3,
        partitions: 8,
        k: 1,
        cpu_quota_pct: 50,
        dir: dir.clone(),
        planner: Planner::Online { time_limit_s: 15.0 },
    })
    .expect("up");
    let o = TpccOpts::default();
    tpcc::install(&kv).expect("install the library");
    tpcc::populate(&kv, &o).expect("populate");
    eprintln!(
        "[{:>5.1} s] {} warehouses loaded",
        t0.elapsed().as_secs_f64(),
        o.warehouses
    );

    let mix = Mix::start(&dir, &o, 0x7ecc);
    std::thread::sleep(Duration::from_secs(3));
    let before = mix.committed();
    assert!(before > 0, "no transaction committed in 3 s");
    for target in [4, 3] {
        scale::scale(
            &mut kv,
            &ScaleOpts {
                target,
                planner: Planner::Online { time_limit_s: 15.0 },
                window: Duration::from_millis(500),
                parallel: pliant_kv::moves::PARALLEL,
            },
            &mut |l| eprintln!("[{:>5.1} s] {l}", t0.elapsed().as_secs_f64()),
        )
        .unwrap_or_else(|e| panic!("scale to {target}: {e}"));
        assert_eq!(kv.state.hosts.len(), target);
    }
    std::thread::sleep(Duration::from_secs(2));
    let (report, acked) = mix.finish();
    eprintln!("mix: {}", serde_json::to_string(&report).unwrap());
    for kind in [
        "new_order",
        "payment",
        "delivery",
        "order_status",
        "stock_level",
    ] {
        assert!(
            report.committed.get(kind).copied().unwrap_or(0) > 0,
            "no {kind} committed: {report:?}"
        );
    }
    assert_eq!(report.unknown, 0, "transactions given up: {report:?}");

    let kv = Kv::open(&dir).expect("open");
    let c = tpcc::check(&kv, &o, &acked).expect("check");
    eprintln!("check: {}", serde_json::to_string(&c).unwrap());
    assert_eq!(c.lost, 0, "acknowledged transactions lost: {c:?}");
    assert!(c.violations.is_empty(), "{:?}", c.violations);
    assert!(c.recorded >= acked.len() as u64, "{c:?}");

    // A retried payment (an id already applied) is not applied again.
    let (w, id) = acked
        .iter()
        .find(|(_, id)| id.starts_with("p:"))
        .expect("an acknowledged payment");
    let key = tpcc::warehouse_key(*w, kv.state.partitions);
    let mut con = kv
        .connect(&kv.master_of(w % kv.state.partitions).unwrap())
        .unwrap();
    let again: String = redis::cmd("FCALL")
        .arg("payment")
        .arg(1)
        .arg(&key)
        .arg(id)
        .arg(1)
        .arg(1)
        .query(&mut con)
        .expect("retried payment");
    assert_eq!(again, "DUP");
    let c2 = tpcc::check(&kv, &o, &acked).expect("check");
    assert!(c2.violations.is_empty(), "{:?}", c2.violations);
    assert_eq!(c2.recorded, c.recorded);

    // The check can fail: one district's year-to-date off by one cent.
    let _: i64 = redis::cmd("HINCRBY")
        .arg(format!("{key}:d1"))
        .arg("ytd")
        .arg(1)
        .query(&mut con)
        .unwrap();
    let c3 = tpcc::check(&kv, &o, &acked).expect("check");
    assert_eq!(c3.violations.len(), 1, "{:?}", c3.violations);
    assert!(
        c3.violations[0].contains("sum of D_YTD"),
        "{:?}",
        c3.violations
    );

    let st = KvState::load(&dir).unwrap();
    let counts: Vec<usize> = st.placement().iter().map(Vec::len).collect();
    assert!(
        invariant::below_k_plus_one(&counts, st.k).is_empty(),
        "copies per partition {counts:?}"
    );

    // redis-benchmark, the workload people measure Redis with, on the cluster at rest. It runs
    // as a temporary user without a password that may not read the configuration (which holds
    // the password) nor any key but the benchmark's; the user is gone afterwards.
    let m = kv.master_of(0).expect("master");
    let addr = format!("{}:{}", kv.state.host_ip(m.host), m.port);
    redis_bench::with_user(&kv, |user| {
        let url = format!("redis://{user}:any@{addr}/");
        let mut c = redis::Client::open(url.as_str())
            .and_then(|c| c.get_connection())
            .expect("connect as the benchmark user");
        let own: String = redis::cmd("SET")
            .arg(format!("key:{{{}}}:1", pliant_kv::slots::tag_for(0, 8)))
            .arg("x")
            .query(&mut c)
            .expect("the benchmark's own key");
        assert_eq!(own, "OK");
        let config = redis::cmd("CONFIG")
            .arg("GET")
            .arg("requirepass")
            .query::<Vec<String>>(&mut c);
        assert!(
            config
                .as_ref()
                .is_err_and(|e| e.to_string().to_lowercase().contains("noperm")),
            "{config:?}"
        );
        let other = redis::cmd("HGET")
            .arg(&key)
            .arg("ytd")
            .query::<String>(&mut c);
        assert!(
            other
                .as_ref()
                .is_err_and(|e| e.to_string().to_lowercase().contains("noperm")),
            "{other:?}"
        );
        Ok(())
    })
    .expect("temporary user");
    let rows = redis_bench::run(
        &kv,
        &redis_bench::Opts {
            requests: 20_000,
            tests: "set,get,incr".into(),
            ..Default::default()
        },
    )
    .expect("redis-benchmark");
    eprintln!("redis-benchmark: {rows:?}");
    let names: Vec<&str> = rows.iter().map(|r| r.test.as_str()).collect();
    assert_eq!(names, ["SET", "GET", "INCR"]);
    assert!(
        rows.iter().all(|r| r.rps > 0.0 && r.p99_ms >= r.p50_ms),
        "{rows:?}"
    );
    for n in &kv.state.nodes {
        let users: Vec<String> = redis::cmd("ACL")
            .arg("USERS")
            .query(&mut kv.connect(n).expect("connect"))
            .expect("ACL USERS");
        assert_eq!(users, ["default"], "node {}:{}", n.host, n.port);
    }
}
