//! End to end, with real redis-servers in real namespaces: a writer acknowledges ids only after
//! `WAIT k`, a sampler checks k+1 copies of every partition at every sample, and the cluster
//! is scaled out and in 100 times (3 -> 4 -> 3 -> 4 -> 3 -> 5 -> 3 hosts, over and over); at the end every
//! acknowledged id is present exactly once with its value.

mod common;

use pliant_kv::cluster::{self, Kv, UpOpts};
use pliant_kv::invariant;
use pliant_kv::scale::{self, ScaleOpts};
use pliant_kv::slots;
use pliant_kv::state::KvState;
use pliant_kv::Planner;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use std::collections::HashSet;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const HOSTS: usize = 3;
const PARTITIONS: usize = 12;
const K: usize = 1;
/// Scale operations (each one plan, its moves, the hosts it adds or removes).
const OPS: usize = 100;
/// Host counts the operations cycle through, from `HOSTS`: one host added and removed, twice,
/// then two.
const TARGETS: [usize; 6] = [HOSTS + 1, HOSTS, HOSTS + 1, HOSTS, HOSTS + 2, HOSTS];
/// A write is retried (same id, same value) for this long before the test fails.
const WRITE_PATIENCE: Duration = Duration::from_secs(30);

fn key(n: u64, tags: &[String]) -> String {
    format!("id:{{{}}}:{n}", tags[n as usize % tags.len()])
}

/// SET then `WAIT k 1000` on the same connection (both routed to the slot's master); the write
/// is acknowledged only when WAIT reports k replicas. Retried on any error or a short WAIT.
fn write_acked(
    con: &mut redis::cluster::ClusterConnection,
    reconnect: &dyn Fn() -> Result<redis::cluster::ClusterConnection, String>,
    key: &str,
    value: &str,
) -> Result<u32, String> {
    let route = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(Route::new(
        slots::key_slot(key.as_bytes()),
        SlotAddr::Master,
    )));
    let t0 = Instant::now();
    let mut retries = 0;
    loop {
        let r = redis::cmd("SET")
            .arg(key)
            .arg(value)
            .query::<()>(con)
            .map_err(|e| e.to_string())
            .and_then(|()| {
                let mut w = redis::cmd("WAIT");
                w.arg(K).arg(1000);
                con.route_command(&w, route.clone())
                    .map_err(|e| e.to_string())
            });
        match r {
            Ok(redis::Value::Int(n)) if n >= K as i64 => return Ok(retries),
            other if t0.elapsed() > WRITE_PATIENCE => {
                return Err(format!(
                    "{key}: not acknowledged after {WRITE_PATIENCE:?}: {other:?}"
                ))
            }
            Ok(_) => retries += 1,
            Err(e) => {
                retries += 1;
                if retries % 25 == 1 {
                    eprintln!("writer: {key}: retry {retries}: {e}");
                }
                // The client's slot map may still name a host a scale-in removed (its address no
                // longer routes), which redis-rs keeps retrying: start again from the hosts that
                // exist now.
                match reconnect() {
                    Ok(c) => *con = c,
                    Err(e) if retries % 25 == 1 => eprintln!("writer: reconnect: {e}"),
                    Err(_) => {}
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

/// Live copies per partition, from every copy's own `INFO replication`: the master, and each
/// replica whose link to a master is up. Gossip views (`CLUSTER NODES` of one node) trail a
/// failover by seconds, so they are not used. Also returns what each copy said (for a report).
fn copies_now(st: &KvState, password: &str) -> (Vec<usize>, Vec<Vec<String>>) {
    let mut counts = vec![0; st.partitions];
    let mut said = vec![Vec::new(); st.partitions];
    for n in &st.nodes {
        let info = pliant_kv::node::connect(st, n, password)
            .and_then(|mut c| pliant_kv::node::info(&mut c, "replication"));
        let (live, what) = match info {
            Ok(i) => {
                let role = i.get("role").cloned().unwrap_or_default();
                let link = i.get("master_link_status").cloned().unwrap_or_default();
                (
                    role == "master" || (role == "slave" && link == "up"),
                    format!("{role} {link}"),
                )
            }
            Err(e) => (false, e),
        };
        counts[n.partition] += usize::from(live);
        said[n.partition].push(format!("h{}: {what}", n.host));
    }
    (counts, said)
}

#[test]
fn acknowledged_writes_survive_repeated_scale_out_and_in() {
    let Some(dir) = common::cluster_dir("e2e") else {
        return;
    };
    let t_start = Instant::now();
    let _guard = cluster::DownOnDrop(dir.clone());
    let mut kv = Kv::up(&UpOpts {
        hosts: HOSTS,
        partitions: PARTITIONS,
        k: K,
        cpu_quota_pct: 50,
        dir: dir.clone(),
        planner: Planner::Online { time_limit_s: 15.0 },
    })
    .expect("up");
    let t_up = t_start.elapsed();
    // This thread is in the fabric namespace now; threads spawned below inherit it.
    let password = kv.password().to_string();
    let stop = Arc::new(AtomicBool::new(false));

    // The writer.
    let tags: Vec<String> = (0..PARTITIONS)
        .map(|p| slots::tag_for(p, PARTITIONS))
        .collect();
    let client = cluster_client(&kv.seed_urls(), &password);
    let acked = Arc::new(Mutex::new(Vec::<u64>::new()));
    let retries = Arc::new(AtomicU64::new(0));
    let writer = {
        let (stop, acked, retries, tags) =
            (stop.clone(), acked.clone(), retries.clone(), tags.clone());
        let (dir, password) = (dir.clone(), password.clone());
        std::thread::spawn(move || -> Result<u64, String> {
            let mut con = client.get_connection().map_err(|e| e.to_string())?;
            let reconnect = || {
                let st = KvState::load(&dir)?;
                cluster_client(&st.seed_urls(), &password)
                    .get_connection()
                    .map_err(|e| e.to_string())
            };
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let r = write_acked(&mut con, &reconnect, &key(n, &tags), &format!("v{n}"))?;
                retries.fetch_add(r as u64, Ordering::Relaxed);
                acked.lock().unwrap().push(n);
                n += 1;
            }
            Ok(n)
        })
    };

    // The sampler: k+1 copies of every partition at every sample.
    let sampler = {
        let (stop, dir, password) = (stop.clone(), dir.clone(), password.clone());
        std::thread::spawn(move || {
            let (mut samples, mut stale, mut violations) = (0u64, 0u64, Vec::new());
            while !stop.load(Ordering::Relaxed) {
                let st = KvState::load(&dir).expect("state");
                let (c, said) = copies_now(&st, &password);
                // A sample counts only if the copies it asked are still the cluster's copies when
                // it ends: a sample slowed down (by a connect to a host removed meanwhile) would
                // otherwise miss a copy added after its list was read and count one dropped since.
                if KvState::load(&dir).expect("state").nodes != st.nodes {
                    stale += 1;
                    continue;
                }
                samples += 1;
                let low = invariant::below_k_plus_one(&c, K);
                if !low.is_empty() {
                    let detail: Vec<_> = low.iter().map(|&(p, _)| said[p].clone()).collect();
                    violations.push((t_start.elapsed().as_secs_f64(), low, detail));
                }
                std::thread::sleep(Duration::from_millis(200));
            }
            (samples, stale, violations)
        })
    };

    // Out and in, OPS times.
    let t_scale = Instant::now();
    let (mut ops, mut moves, mut failovers) = (0, 0, 0);
    let mut op_times = Vec::new();
    for op in 0..OPS {
        let target = TARGETS[op % TARGETS.len()];
        let t = Instant::now();
        let done = scale::scale(
            &mut kv,
            &ScaleOpts {
                target,
                planner: Planner::Online { time_limit_s: 15.0 },
                window: Duration::from_millis(500),
                parallel: pliant_kv::moves::PARALLEL,
            },
            &mut |l| eprintln!("[{:>5.1} s] {l}", t_start.elapsed().as_secs_f64()),
        )
        .unwrap_or_else(|e| panic!("operation {}: scale to {target}: {e}", op + 1));
        assert_eq!(kv.state.hosts.len(), target);
        op_times.push(t.elapsed().as_secs_f64());
        ops += 1;
        moves += done.len();
        failovers += done.iter().filter(|m| m.was_master).count();
    }
    let t_scaling = t_scale.elapsed();
    stop.store(true, Ordering::Relaxed);
    let written = writer.join().expect("writer thread").expect("writer");
    let (samples, stale, violations) = sampler.join().expect("sampler thread");

    // Every acknowledged id is there exactly once, with its value.
    let acked = acked.lock().unwrap().clone();
    let mut con = cluster_client(&kv.seed_urls(), kv.password())
        .get_connection()
        .expect("check connection");
    let mut missing = Vec::new();
    for &n in &acked {
        let v: Option<String> = redis::cmd("GET")
            .arg(key(n, &tags))
            .query(&mut con)
            .expect("GET");
        if v.as_deref() != Some(format!("v{n}").as_str()) {
            missing.push((n, v));
        }
    }
    let mut all_keys = Vec::new();
    for p in 0..PARTITIONS {
        let m = kv.master_of(p).expect("master");
        let mut c = kv.connect(&m).expect("connect master");
        let keys: Vec<String> = redis::cmd("KEYS").arg("id:*").query(&mut c).expect("KEYS");
        for k in &keys {
            assert_eq!(
                slots::partition_of(slots::key_slot(k.as_bytes()), PARTITIONS),
                p,
                "{k} on the master of partition {p}"
            );
        }
        all_keys.extend(keys);
    }
    let distinct: HashSet<&String> = all_keys.iter().collect();
    eprintln!(
        "kv e2e: up {:.1} s; {ops} scale operations, {moves} moves ({failovers} with a failover) in \
         {:.1} s (per operation {:?} s); {} ids acknowledged ({} written, {} retries), {} keys \
         stored; {samples} copy samples ({stale} more discarded: the copies changed during the sample), {} below k+1; total {:.1} s",
        t_up.as_secs_f64(),
        t_scaling.as_secs_f64(),
        op_times.iter().map(|t| (t * 10.0).round() / 10.0).collect::<Vec<_>>(),
        acked.len(),
        written,
        retries.load(Ordering::Relaxed),
        all_keys.len(),
        violations.len(),
        t_start.elapsed().as_secs_f64()
    );
    assert!(
        missing.is_empty(),
        "acknowledged ids lost or wrong: {:?}",
        &missing[..missing.len().min(20)]
    );
    assert_eq!(
        distinct.len(),
        all_keys.len(),
        "a key stored on two partitions"
    );
    // The writer finishes the write in flight before it stops: every id written was acknowledged.
    assert_eq!(acked.len() as u64, written);
    assert_eq!(
        all_keys.len(),
        acked.len(),
        "keys stored vs ids acknowledged"
    );
    assert!(
        violations.is_empty(),
        "partitions below k+1 copies: {violations:?}"
    );
    assert!(samples > 0, "no copy samples");
    assert_eq!(ops, OPS);
    assert!(moves >= OPS, "{ops} operations, only {moves} moves");
    assert!(!acked.is_empty());
    // Every node knows exactly the cluster's nodes: no copy dropped by a move lingers (as
    // `fail`) in a view, to be spread again. A handshake with a stopped copy still pending
    // (a random name at its address) ends within the node timeout (5 s): views get 15 s.
    let ids: HashSet<&str> = kv.state.nodes.iter().map(|n| n.id.as_str()).collect();
    let strangers = || -> Vec<String> {
        let mut out = Vec::new();
        for n in &kv.state.nodes {
            let view = pliant_kv::node::cluster_nodes(&mut kv.connect(n).expect("connect"))
                .expect("CLUSTER NODES");
            for l in view.iter().filter(|l| !ids.contains(l.id.as_str())) {
                out.push(format!(
                    "{}:{} knows {} {:?}",
                    n.host, n.port, l.id, l.flags
                ));
            }
            if view.len() - view.iter().filter(|l| !ids.contains(l.id.as_str())).count()
                != ids.len()
            {
                out.push(format!("{}:{} misses a node", n.host, n.port));
            }
        }
        out
    };
    let t_views = Instant::now();
    let mut left = strangers();
    while !left.is_empty() && t_views.elapsed() < Duration::from_secs(15) {
        std::thread::sleep(Duration::from_millis(500));
        left = strangers();
    }
    assert!(
        left.is_empty(),
        "views that are not the cluster's: {left:?}"
    );
    check_down(&dir, &kv.state);
}

/// The redis crate's cluster client (follows MOVED and ASK, refreshes its slot map on MOVED).
/// Few retries of its own: on a connection error it only reconnects to the same address, which
/// for the address of a host a scale-in removed (a master moved away, then its host deleted: no
/// MOVED ever comes from there) times out every time; one call spent 16 retries × the connect
/// timeout there. The writer rebuilds the client instead.
fn cluster_client(seeds: &[String], password: &str) -> redis::cluster::ClusterClient {
    redis::cluster::ClusterClient::builder(seeds.to_vec())
        .password(password)
        .retries(3)
        .connection_timeout(Duration::from_secs(1))
        .response_timeout(Duration::from_secs(3))
        .build()
        .expect("cluster client")
}

/// `down` stops every server it started and removes every namespace and cgroup.
fn check_down(dir: &Path, st: &KvState) {
    let left = cluster::teardown(st);
    assert!(left.is_empty(), "down left: {left:?}");
    for n in &st.nodes {
        assert!(
            !Path::new(&format!("/proc/{}", n.pid)).exists()
                || std::fs::read_to_string(format!("/proc/{}/stat", n.pid))
                    .is_ok_and(|s| s.contains(") Z")),
            "redis-server {} still running",
            n.pid
        );
    }
    for h in &st.hosts {
        assert!(
            !Path::new("/run/netns").join(&h.ns).exists(),
            "{} left",
            h.ns
        );
        assert!(!h.cgroup.exists(), "{} left", h.cgroup.display());
    }
    assert!(!Path::new("/run/netns").join(&st.fabric_ns).exists());
    assert!(!dir.join("state.json").exists());
}
