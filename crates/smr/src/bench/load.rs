//! The load `redis-benchmark` cannot make: writes each followed by `WAIT 1 0`, and the
//! failover trial's unique writes across a kill. Clients are the `redis` crate's synchronous
//! connections, one thread per client.

use super::report::{percentile, Failover, Measure};
use redis::{Connection, RedisResult};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A connection to `addr` (`host:port`) with bounded connect, read and write times.
pub fn connect(addr: &str, timeout: Duration) -> RedisResult<Connection> {
    let c =
        redis::Client::open(format!("redis://{addr}/"))?.get_connection_with_timeout(timeout)?;
    c.set_read_timeout(Some(Duration::from_secs(10)))?;
    c.set_write_timeout(Some(Duration::from_secs(10)))?;
    Ok(c)
}

/// `INFO replication`'s text.
pub fn info(addr: &str) -> Result<String, String> {
    let mut c = connect(addr, Duration::from_secs(2)).map_err(|e| format!("{addr}: {e}"))?;
    redis::cmd("INFO")
        .arg("replication")
        .query(&mut c)
        .map_err(|e| format!("{addr} INFO: {e}"))
}

/// Keys the write load uses, like `redis-benchmark -r 100000`.
const KEYSPACE: u64 = 100_000;

/// A small xorshift per client for key choice (no shared generator, no lock).
fn next(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// `clients` connections to `addr`: for the first half of `duration` each sends `SET key xxx`
/// and `WAIT 1 0` together (one write, both replies read: a write acknowledged only once one
/// replica has it), for the second half `GET key`. The latency is that of SET + WAIT.
pub fn wait1(addr: &str, clients: u32, duration: Duration) -> Result<Measure, String> {
    let half = duration / 2;
    let t0 = Instant::now();
    let threads: Vec<_> = (0..clients)
        .map(|i| {
            let addr = addr.to_string();
            std::thread::spawn(move || -> Result<(Vec<u64>, u64, f64), String> {
                let mut c = connect(&addr, Duration::from_secs(2)).map_err(|e| e.to_string())?;
                let mut rng = 0x9e37_79b9_7f4a_7c15 ^ (u64::from(i) + 1);
                let mut lat = Vec::new();
                let t = Instant::now();
                while t.elapsed() < half {
                    let key = format!("key:{:012}", next(&mut rng) % KEYSPACE);
                    let s = Instant::now();
                    let (_, acks): ((), i64) = redis::pipe()
                        .cmd("SET")
                        .arg(&key)
                        .arg("xxx")
                        .cmd("WAIT")
                        .arg(1)
                        .arg(0)
                        .query(&mut c)
                        .map_err(|e| format!("SET + WAIT: {e}"))?;
                    if acks < 1 {
                        return Err(format!("WAIT 1 0 answered {acks}"));
                    }
                    lat.push(s.elapsed().as_micros() as u64);
                }
                let set_secs = t.elapsed().as_secs_f64();
                let (mut gets, t) = (0u64, Instant::now());
                while t.elapsed() < half {
                    let key = format!("key:{:012}", next(&mut rng) % KEYSPACE);
                    let _: Option<String> = redis::cmd("GET")
                        .arg(&key)
                        .query(&mut c)
                        .map_err(|e| format!("GET: {e}"))?;
                    gets += 1;
                }
                Ok((lat, gets, set_secs))
            })
        })
        .collect();
    let mut lat = Vec::new();
    let (mut gets, mut set_secs) = (0u64, 0f64);
    for t in threads {
        let (l, g, s) = t.join().map_err(|_| "a load thread panicked")??;
        lat.extend(l);
        gets += g;
        set_secs = set_secs.max(s);
    }
    let secs = t0.elapsed().as_secs_f64();
    lat.sort_unstable();
    let sets = lat.len() as u64;
    let p = |q| percentile(&lat, q).unwrap_or(0) as f64;
    let get_secs = (secs - set_secs).max(f64::MIN_POSITIVE);
    Ok(Measure {
        clients,
        ops: sets + gets,
        secs,
        p50_us: p(50.0),
        p99_us: p(99.0),
        replicated: None,
        by_test: vec![
            ("SET+WAIT".into(), sets as f64 / set_secs, p(50.0), p(99.0)),
            ("GET".into(), gets as f64 / get_secs, f64::NAN, f64::NAN),
        ],
    })
}

/// What one failover client saw.
#[derive(Default)]
struct Seen {
    acked: Vec<String>,
    /// The first write acknowledged on a connection opened after the kill, and where.
    first_after: Option<(Instant, String)>,
    /// The original connection served a write sent after the kill had finished.
    kept: bool,
}

/// `conns` clients write unique keys (`fo:<client>:<seq>`) through the first of `candidates`
/// that takes them; after `warm`, `kill` runs (SIGKILL of the leader/primary); a client whose
/// write fails tries every candidate in turn until one acknowledges. After every client has
/// written again (or `within`), the acknowledged keys are looked up on the address that took
/// the first write after the kill.
pub fn failover(
    candidates: &[String],
    conns: u32,
    warm: Duration,
    within: Duration,
    kill: impl FnOnce(),
) -> Failover {
    let stop = Arc::new(AtomicBool::new(false));
    let killed: Arc<Mutex<Option<(Instant, Instant)>>> = Arc::default();
    let again = Arc::new(AtomicU32::new(0));
    let threads: Vec<_> = (0..conns)
        .map(|i| {
            let (stop, killed, again) = (stop.clone(), killed.clone(), again.clone());
            let cands = candidates.to_vec();
            std::thread::spawn(move || client(i, &cands, &stop, &killed, &again))
        })
        .collect();
    std::thread::sleep(warm);
    let t_kill = Instant::now();
    kill();
    *killed.lock().unwrap_or_else(|e| e.into_inner()) = Some((t_kill, Instant::now()));
    let deadline = Instant::now() + within;
    while again.load(Ordering::SeqCst) < conns && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    // A little more load on the new leader/primary before the count.
    std::thread::sleep(Duration::from_millis(200));
    stop.store(true, Ordering::SeqCst);
    let seen: Vec<Seen> = threads
        .into_iter()
        .map(|t| t.join().unwrap_or_default())
        .collect();
    summarize(&seen, t_kill, conns)
}

fn summarize(seen: &[Seen], t_kill: Instant, conns: u32) -> Failover {
    let mut f = Failover {
        connections_total: conns,
        connections_kept: seen.iter().filter(|s| s.kept).count() as u32,
        acked_writes: seen.iter().map(|s| s.acked.len() as u64).sum(),
        ..Failover::default()
    };
    let first = seen
        .iter()
        .filter_map(|s| s.first_after.clone())
        .min_by_key(|(t, _)| *t);
    let Some((t, addr)) = first else {
        f.error = Some("no write was acknowledged after the kill".into());
        return f;
    };
    f.failover_ms = Some(t.duration_since(t_kill).as_secs_f64() * 1e3);
    match missing(&addr, seen.iter().flat_map(|s| s.acked.iter())) {
        Ok(n) => f.acked_writes_lost = n,
        Err(e) => f.error = Some(format!("looking up the acknowledged writes: {e}")),
    }
    f
}

/// Acknowledged keys that `addr` does not have (pipelined `EXISTS`, 500 at a time).
fn missing<'a>(addr: &str, keys: impl Iterator<Item = &'a String>) -> Result<u64, String> {
    let mut c = connect(addr, Duration::from_secs(2)).map_err(|e| e.to_string())?;
    let keys: Vec<&String> = keys.collect();
    let mut lost = 0u64;
    for chunk in keys.chunks(500) {
        let mut p = redis::pipe();
        for k in chunk {
            p.cmd("EXISTS").arg(k.as_str());
        }
        let found: Vec<i64> = p.query(&mut c).map_err(|e| e.to_string())?;
        lost += found.iter().filter(|&&n| n == 0).count() as u64;
    }
    Ok(lost)
}

fn client(
    i: u32,
    candidates: &[String],
    stop: &AtomicBool,
    killed: &Mutex<Option<(Instant, Instant)>>,
    again: &AtomicU32,
) -> Seen {
    let mut seen = Seen::default();
    let kill_times = || *killed.lock().unwrap_or_else(|e| e.into_inner());
    let Some(mut c) = candidates
        .iter()
        .find_map(|a| connect(a, Duration::from_secs(1)).ok())
    else {
        return seen;
    };
    let mut original = true;
    let mut seq = 0u64;
    while !stop.load(Ordering::SeqCst) {
        seq += 1;
        let key = format!("fo:{i}:{seq}");
        let sent_at = Instant::now();
        let r: RedisResult<()> = redis::cmd("SET").arg(&key).arg(seq).query(&mut c);
        if r.is_ok() {
            seen.acked.push(key);
            if original {
                if let Some((_, done)) = kill_times() {
                    if sent_at > done && !seen.kept {
                        seen.kept = true;
                        again.fetch_add(1, Ordering::SeqCst);
                    }
                }
            }
            continue;
        }
        // The connection failed: find whoever takes writes now.
        original = false;
        'find: while !stop.load(Ordering::SeqCst) {
            for a in candidates {
                let Ok(mut n) = connect(a, Duration::from_millis(200)) else {
                    continue;
                };
                let r: RedisResult<()> = redis::cmd("SET").arg(&key).arg(seq).query(&mut n);
                if r.is_ok() {
                    let now = Instant::now();
                    seen.acked.push(key.clone());
                    if kill_times().is_some() && seen.first_after.is_none() {
                        seen.first_after = Some((now, a.clone()));
                        again.fetch_add(1, Ordering::SeqCst);
                    }
                    c = n;
                    // A connection found before the kill is the one the kill meets.
                    original = kill_times().is_none();
                    break 'find;
                }
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    seen
}
