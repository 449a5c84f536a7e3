//! Throughput of a replicated redis-server against the same redis-server alone, with
//! `redis-benchmark` (SET), and the durable log's bytes per request.
//!
//! `cargo run --release -p pliant-smr --example smr_bench -- [REQUESTS] [CLIENTS] [PIPELINE]
//! [REPLICAS]` (defaults 20000, 50, 1, 3). The replicas run in this process, peers over unix
//! sockets, every replica's server on this host: on a small machine the replicated run shares
//! the cores with REPLICAS servers, where the direct run has one. One replica separates the
//! cost of the proxy, the log and its fsync from that of replication.

use pliant_smr::child::{redis_argv, ServerChild};
use pliant_smr::group::{free_port, LocalGroup};
use pliant_smr::Limits;
use std::net::SocketAddr;
use std::process::Command;
use std::sync::atomic::Ordering;
use std::time::Duration;

fn arg(i: usize, default: u64) -> u64 {
    std::env::args()
        .nth(i)
        .and_then(|a| a.parse().ok())
        .unwrap_or(default)
}

/// Requests per second `redis-benchmark` reports for SET against `addr`.
fn benchmark(addr: &str, n: u64, clients: u64, pipeline: u64) -> Result<f64, String> {
    let (host, port) = addr.rsplit_once(':').ok_or("address without a port")?;
    let out = Command::new("redis-benchmark")
        .args(["-h", host, "-p", port, "-t", "set", "--csv"])
        .args(["-n", &n.to_string(), "-c", &clients.to_string()])
        .args(["-P", &pipeline.to_string(), "-r", "100000"])
        .output()
        .map_err(|e| format!("redis-benchmark: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    // --csv: a header line, then "SET","<rps>",...
    text.lines()
        .find(|l| l.starts_with("\"SET\""))
        .and_then(|l| l.split(',').nth(1))
        .and_then(|v| v.trim_matches('"').parse().ok())
        .ok_or_else(|| format!("no SET line in redis-benchmark output: {text:?}"))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (n, clients, pipeline, replicas) = (arg(1, 20_000), arg(2, 50), arg(3, 1), arg(4, 3));
    let port = free_port()?;
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let direct = ServerChild::spawn(
        &redis_argv("redis-server", port),
        addr,
        Duration::from_secs(10),
    )?;
    let direct_rps = benchmark(&addr.to_string(), n, clients, pipeline)?;
    drop(direct);

    let dir = std::env::temp_dir().join(format!("smr-bench-{}", std::process::id()));
    let argv = Box::new(|p| redis_argv("redis-server", p));
    let g = LocalGroup::start(dir, replicas, false, Limits::default(), argv)?;
    let leader = g.wait_leader(Duration::from_secs(10))?;
    let front = g.front_addr(leader).ok_or("leader without a front")?;
    let r = g.replica(leader).ok_or("leader gone")?;
    let log0 = r.status().log_bytes.load(Ordering::Relaxed);
    let smr_rps = benchmark(&front, n, clients, pipeline)?;
    let log1 = r.status().log_bytes.load(Ordering::Relaxed);
    let bytes_per_req = (log1 - log0) as f64 / n as f64;
    println!(
        "SET n={n} c={clients} P={pipeline}: direct {direct_rps:.0} req/s, through SMR \
         ({replicas} replicas) {smr_rps:.0} req/s ({:.2}x), log {bytes_per_req:.1} B/request",
        smr_rps / direct_rps
    );
    Ok(())
}
