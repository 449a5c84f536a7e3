//! TPS-only comparison (no failover trials): one cluster, then `PG_ROUNDS` rounds of pgbench
//! TPC-B and select-only against synchronous replication directly and through the proxy,
//! alternating, printing each round's same-run ratios. Env: PG_SCALE, PG_SECS, PG_CLIENTS,
//! PG_ROUNDS. Used to profile the proxy (`perf record -p <pid>` during a round).
use pliant_pg::bench::{pgbench, proxy_config, BenchOpts};
use pliant_pg::cluster::{Cluster, ClusterConfig};
use pliant_pg::proxy::Proxy;

fn env(k: &str, d: u32) -> u32 {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

fn main() -> Result<(), String> {
    let o = BenchOpts {
        scale: env("PG_SCALE", 10),
        duration_s: env("PG_SECS", 10),
        clients: env("PG_CLIENTS", 8),
        ..BenchOpts::default()
    };
    let cl = Cluster::create(ClusterConfig {
        fsync: true,
        shared_buffers_mb: 128,
        ..Default::default()
    })?;
    let (u, pw) = (cl.cfg.user.clone(), cl.cfg.password.clone());
    cl.init_primary()?;
    pliant_pg::bench::pgbench_init(&cl, o.scale)?;
    cl.add_standby(1, 0)?;
    cl.protect(0, 1)?;
    // A longer probe timeout than the bench's: a saturated 2-core machine must not fail over
    // in the middle of a measurement.
    let mut pc = proxy_config(&cl, 0);
    pc.probe_timeout_ms = 2000;
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
    for round in 0..env("PG_ROUNDS", 3) {
        if failovers() > 0 {
            eprintln!("the proxy failed over: stopping");
            break;
        }
        for sel in [false, true] {
            let a = pgbench(direct, &u, &pw, &o, sel, &cl.dir)?;
            eprintln!("proxy run starts");
            let b = pgbench(proxy.addr, &u, &pw, &o, sel, &cl.dir)?;
            println!(
                "round {round} {}: syncrep {:.0} pliant {:.0} ratio {:.3} (p50 {:.2}/{:.2} ms)",
                if sel { "select" } else { "tpcb" },
                a.tps,
                b.tps,
                b.tps / a.tps.max(1e-9),
                a.p50_ms,
                b.p50_ms
            );
        }
    }
    proxy.stop();
    cl.teardown();
    Ok(())
}
