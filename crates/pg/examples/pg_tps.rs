//! TPS-only comparison (no failover trials): one cluster, then `PG_ROUNDS` rounds of pgbench
//! TPC-B and select-only against synchronous replication directly and through the proxy
//! (the order reversed every other round, every TPC-B run from the same database), printing
//! each round's same-run ratios. Env: PG_SCALE, PG_SECS, PG_CLIENTS, PG_ROUNDS, PG_TLS.
//! With `PG_RATE=N` pgbench runs at a fixed N transactions/s and each run also prints the
//! CPU time of the whole machine per transaction (from /proc/stat): on a noisy machine that
//! compares the systems' cost better than saturated TPS does. Used to profile the proxy
//! (`perf record -p <pid>` during a round).
use pliant_pg::bench::{pgbench, proxy_config, reset_tpcb, BenchOpts, Run};
use pliant_pg::cluster::{Cluster, ClusterConfig};
use pliant_pg::proxy::Proxy;

fn env(k: &str, d: u32) -> u32 {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

/// Busy and total jiffies of all CPUs (the first line of /proc/stat).
fn cpu_jiffies() -> (u64, u64) {
    let s = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let v: Vec<u64> = s
        .lines()
        .next()
        .unwrap_or("")
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    let total: u64 = v.iter().sum();
    // idle + iowait are not busy.
    let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
    (total - idle, total)
}

fn main() -> Result<(), String> {
    let rate = env("PG_RATE", 0);
    let o = BenchOpts {
        scale: env("PG_SCALE", 10),
        duration_s: env("PG_SECS", 10),
        clients: env("PG_CLIENTS", 8),
        rate: (rate > 0).then_some(rate),
        tls: std::env::var_os("PG_TLS").is_some(),
        ..BenchOpts::default()
    };
    let mut cl = Cluster::create(ClusterConfig {
        fsync: true,
        shared_buffers_mb: 128,
        ..Default::default()
    })?;
    let pki = if o.tls {
        let d = cl.dir.join("pki");
        std::fs::create_dir_all(&d).map_err(|e| format!("mkdir {}: {e}", d.display()))?;
        Some(pliant_pg::bench::cluster_tls(&mut cl, &d)?)
    } else {
        None
    };
    let (u, pw) = (cl.cfg.user.clone(), cl.cfg.password.clone());
    cl.init_primary()?;
    pliant_pg::bench::pgbench_init(&cl, o.scale)?;
    cl.add_standby(1, 0)?;
    cl.protect(0, 1)?;
    // A longer probe timeout than the bench's: a saturated 2-core machine must not fail over
    // in the middle of a measurement.
    let mut pc = proxy_config(&cl, 0);
    pc.probe_timeout_ms = 2000;
    if let Some(p) = &pki {
        pliant_pg::bench::require_tls(&mut pc, p);
    }
    let proxy = Proxy::start(pc, true, None)?;
    let direct = cl.nodes[0].addr();
    eprintln!("pid {}", std::process::id());
    let failovers = || {
        proxy
            .shared
            .stats
            .failovers
            .load(std::sync::atomic::Ordering::SeqCst)
    };
    let hz = 100.0; // USER_HZ: /proc/stat counts in 1/100 s on Linux.
    let measure = |addr: std::net::SocketAddr, sel: bool| -> Result<(Run, f64), String> {
        if !sel {
            reset_tpcb(&cl, 0)?;
        }
        eprintln!(
            "{} run starts",
            if addr == direct { "direct" } else { "proxy" }
        );
        let (b0, _) = cpu_jiffies();
        let r = pgbench(addr, &u, &pw, &o, sel, &cl.dir)?;
        let (b1, _) = cpu_jiffies();
        let us_per_tx = (b1 - b0) as f64 / hz * 1e6 / r.transactions.max(1) as f64;
        Ok((r, us_per_tx))
    };
    for round in 0..env("PG_ROUNDS", 3) {
        if failovers() > 0 {
            eprintln!("the proxy failed over: stopping");
            break;
        }
        for sel in [false, true] {
            let (a, b) = if round % 2 == 0 {
                let a = measure(direct, sel)?;
                (a, measure(proxy.addr, sel)?)
            } else {
                let b = measure(proxy.addr, sel)?;
                (measure(direct, sel)?, b)
            };
            println!(
                "round {round} {}: syncrep {:.0} pliant {:.0} ratio {:.3} (p50 {:.2}/{:.2} ms; \
                 machine CPU per transaction {:.0}/{:.0} us, ratio {:.3})",
                if sel { "select" } else { "tpcb" },
                a.0.tps,
                b.0.tps,
                b.0.tps / a.0.tps.max(1e-9),
                a.0.p50_ms,
                b.0.p50_ms,
                a.1,
                b.1,
                a.1 / b.1.max(1e-9),
            );
        }
    }
    proxy.stop();
    cl.teardown();
    Ok(())
}
