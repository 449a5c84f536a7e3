//! Runs `pliant_pg::bench::run` directly (what `pliant bench pg` calls), with optional
//! environment overrides: PG_SCALE, PG_SECS, PG_TRIALS, PG_CLIENTS, PG_PATRONI_TRIALS,
//! PG_ROUNDS.
//! With PG_ONLY_PATRONI=1 only the Patroni peer runs.
fn env(k: &str, d: u32) -> u32 {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

fn main() {
    let o = pliant_pg::bench::BenchOpts {
        scale: env("PG_SCALE", 10),
        duration_s: env("PG_SECS", 10),
        trials: env("PG_TRIALS", 5),
        clients: env("PG_CLIENTS", 8),
        fsync: true,
        patroni_trials: env("PG_PATRONI_TRIALS", 3),
        rounds: env("PG_ROUNDS", 2),
        tls: std::env::var_os("PG_TLS").is_some(),
        rate: None,
    };
    let r = if std::env::var_os("PG_ONLY_PATRONI").is_some() {
        pliant_pg::patroni::run(&pliant_pg::patroni::PatroniOpts {
            clients: o.clients,
            trials: o.patroni_trials,
            ..Default::default()
        })
    } else {
        pliant_pg::bench::run(o)
    };
    match r {
        Ok(v) => println!("{v}"),
        Err(e) => {
            eprintln!("bench pg: {e}");
            std::process::exit(1);
        }
    }
}
