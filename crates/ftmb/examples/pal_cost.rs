//! Per-packet cost of FTMB ordered logging with 2 worker threads contending on shared state.
//!
//! `cargo run --release -p pliant-ftmb --example pal_cost [packets_per_worker]`
//!
//! The NF: every packet bumps a shared packet counter; every 8th packet is a new flow that also
//! takes a port from a shared pool and bumps a shared flow counter, reading the clock and the
//! RNG (so 1.375 shared accesses and 0.25 value reads per packet on average). Three modes:
//! - `plain`: the same NF on plain `Mutex`es, output discarded (the NF alone);
//! - `pal`: `SharedVar` + PALs + VORs, the stream handed to a transport that discards it
//!   (`pal_added` = the cost of PAL logging itself);
//! - `plain_chan`: `plain` with output sent to a consumer thread (no HA, one hop);
//! - `ftmb`: the full path: channel transport -> output logger thread (parallel release) ->
//!   released-output consumer thread; the stream handed over after every packet, and
//!   (`ftmb_batch32`) after every 32 packets.
//!
//! Prints one JSON object: ns per packet (wall clock over all packets of both workers, so
//! it is a throughput figure; median of 5 runs) for each mode; `ftmb_added` and the
//! throughput ratios compare against `plain_chan`. Then a paced run (10k packets/s per
//! worker) measures latency from taking the input packet to releasing its output, p50/p99,
//! for `plain_chan` and `ftmb`.

use pliant_ftmb::*;
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

const WORKERS: usize = 2;

struct Discard;
impl LogTransport for Discard {
    fn send(&mut self, batch: LogBatch) -> Result<(), TransportError> {
        std::hint::black_box(batch);
        Ok(())
    }
    fn poll_feedback(&mut self) -> Option<Feedback> {
        None
    }
}

static EPOCH: OnceLock<Instant> = OnceLock::new();

fn now_ns() -> u64 {
    EPOCH.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// Output payload; the last 8 bytes are the time the input packet was taken (latency probe).
fn payload(flow: u64, port: u16, serial: u64, taken_ns: u64) -> Vec<u8> {
    let mut v = Vec::with_capacity(26);
    v.extend_from_slice(&flow.to_le_bytes());
    v.extend_from_slice(&port.to_le_bytes());
    v.extend_from_slice(&serial.to_le_bytes());
    v.extend_from_slice(&taken_ns.to_le_bytes());
    v
}

fn latency_of(p: &[u8]) -> u64 {
    let t = u64::from_le_bytes(p[18..26].try_into().unwrap_or([0; 8]));
    now_ns().saturating_sub(t)
}

/// Paced input: packet `i` of a worker is due at `i * pace_ns` after the start (sleeping,
/// not spinning, so the logger thread gets the CPU on this 2-core machine).
fn pace(start: Instant, i: u64, pace_ns: u64) {
    if pace_ns == 0 {
        return;
    }
    let due = start + std::time::Duration::from_nanos(i * pace_ns);
    let now = Instant::now();
    if due > now {
        std::thread::sleep(due - now);
    }
}

fn plain(n: u64, chan: bool, pace_ns: u64) -> (f64, Vec<u64>) {
    let pool = Arc::new(Mutex::new((0..u16::MAX).collect::<Vec<u16>>()));
    let counters = Arc::new(Mutex::new((0u64, 0u64)));
    let (tx, rx) = mpsc::sync_channel::<Vec<Vec<u8>>>(1024);
    let consumer = std::thread::spawn(move || {
        let mut lat = Vec::new();
        for b in rx.iter() {
            lat.extend(b.iter().map(|p| latency_of(p)));
        }
        lat
    });
    let start = Instant::now();
    std::thread::scope(|s| {
        for q in 0..WORKERS as u64 {
            let (pool, counters, tx) = (pool.clone(), counters.clone(), tx.clone());
            s.spawn(move || {
                let mut rng = q + 1;
                for i in 0..n {
                    pace(start, i, pace_ns);
                    let taken = now_ns();
                    let flow = q + WORKERS as u64 * (i / 8);
                    let mut port = 0;
                    if i % 8 == 0 {
                        let _t = std::time::SystemTime::now();
                        rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1);
                        let mut p = pool.lock().unwrap();
                        let k = (rng % p.len().max(1) as u64) as usize;
                        port = if p.is_empty() { 0 } else { p.swap_remove(k) };
                        drop(p);
                        counters.lock().unwrap().0 += 1;
                        if port == 0 {
                            pool.lock().unwrap().push(1);
                        }
                    }
                    let serial = {
                        let mut c = counters.lock().unwrap();
                        c.1 += 1;
                        c.1
                    };
                    let out = vec![payload(flow, port, serial, taken)];
                    if chan {
                        tx.send(out).unwrap();
                    } else {
                        std::hint::black_box(out);
                    }
                }
            });
        }
    });
    drop(tx);
    let lat = consumer.join().unwrap();
    assert_eq!(lat.len() as u64, if chan { n * WORKERS as u64 } else { 0 });
    (
        start.elapsed().as_nanos() as f64 / (n * WORKERS as u64) as f64,
        lat,
    )
}

fn ftmb(n: u64, full: bool, batch_packets: u32, pace_ns: u64) -> (f64, u64, Vec<u64>) {
    let mut cfg = MasterConfig::new(WORKERS);
    cfg.batch_packets = batch_packets;
    let m = Master::new(cfg).unwrap();
    let pool = m
        .shared_var(1, (0..u16::MAX).collect::<Vec<u16>>())
        .unwrap();
    let counters = m.shared_var(2, (0u64, 0u64)).unwrap();
    let (sink, released) = mpsc::channel();
    let consumer = std::thread::spawn(move || {
        released
            .iter()
            .map(|r: Released| latency_of(&r.payload))
            .collect::<Vec<u64>>()
    });
    // Held outputs can pile up while one worker is descheduled holding a partly filled batch
    // that others' VORs point into; the bound is raised so the run measures cost, not drops.
    let mut lcfg = LoggerConfig::new(WORKERS);
    lcfg.max_held_outputs = 1 << 22;
    let logger = spawn_logger(OutputLogger::new(lcfg).unwrap(), 1024, sink).unwrap();
    let mut ws: Vec<Worker> = (0..WORKERS)
        .map(|q| {
            let t: Box<dyn LogTransport> = if full {
                Box::new(logger.transport(q as QueueId).unwrap())
            } else {
                Box::new(Discard)
            };
            m.worker(q as QueueId, t).unwrap()
        })
        .collect();
    let start = Instant::now();
    std::thread::scope(|s| {
        for w in ws.iter_mut() {
            let (pool, counters) = (&pool, &counters);
            s.spawn(move || {
                let q = w.queue() as u64;
                for i in 0..n {
                    pace(start, i, pace_ns);
                    let taken = now_ns();
                    let flow = q + WORKERS as u64 * (i / 8);
                    w.begin(PacketId {
                        queue: q as QueueId,
                        seq: i,
                    })
                    .unwrap();
                    let mut port = 0;
                    if i % 8 == 0 {
                        let _t = w.now().unwrap();
                        let r = w.random().unwrap();
                        port = w
                            .access(pool, |p| {
                                let k = (r % p.len().max(1) as u64) as usize;
                                if p.is_empty() {
                                    0
                                } else {
                                    p.swap_remove(k)
                                }
                            })
                            .unwrap();
                        w.access(counters, |c| c.0 += 1).unwrap();
                        if port == 0 {
                            w.access(pool, |p| p.push(1)).unwrap();
                        }
                    }
                    let serial = w
                        .access(counters, |c| {
                            c.1 += 1;
                            c.1
                        })
                        .unwrap();
                    w.output(payload(flow, port, serial, taken)).unwrap();
                    w.end().unwrap();
                }
                w.flush().unwrap();
            });
        }
    });
    let pals: u64 = ws.iter().map(|w| w.stats.pals + w.stats.value_pals).sum();
    drop(ws);
    let l = logger.join().unwrap();
    let lat = consumer.join().unwrap();
    if full {
        assert_eq!(
            lat.len() as u64,
            n * WORKERS as u64,
            "every packet released ({:?})",
            l.stats
        );
        assert_eq!(l.stats.audit_violations, 0);
    }
    let ns = start.elapsed().as_nanos() as f64 / (n * WORKERS as u64) as f64;
    (ns, pals, lat)
}

fn pct(v: &mut [u64], p: f64) -> u64 {
    if v.is_empty() {
        return 0;
    }
    v.sort_unstable();
    v[((v.len() - 1) as f64 * p) as usize]
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let n: u64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(200_000);
    // A single mode, for profiling: `pal_cost N pal`.
    if let Some(mode) = std::env::args().nth(2) {
        let ns = match mode.as_str() {
            "plain" => plain(n, false, 0).0,
            "plain_chan" => plain(n, true, 0).0,
            "pal" => ftmb(n, false, 1, 0).0,
            "ftmb" => ftmb(n, true, 1, 0).0,
            _ => ftmb(n, true, 32, 0).0,
        };
        println!("{{\"mode\":\"{mode}\",\"ns_per_pkt\":{ns:.1}}}");
        return;
    }
    let runs = 5;
    let mut r: [Vec<f64>; 5] = Default::default();
    let mut pals = 0;
    for _ in 0..runs {
        r[0].push(plain(n, false, 0).0);
        r[1].push(ftmb(n, false, 1, 0).0);
        r[2].push(plain(n, true, 0).0);
        let (ns, np, _) = ftmb(n, true, 1, 0);
        r[3].push(ns);
        r[4].push(ftmb(n, true, 32, 0).0);
        pals = np;
    }
    let [p, l, pc, f, fb] = r.map(median);
    // Latency at a paced load (10k packets/s per worker): input taken -> output released.
    let (lat_n, pace_ns) = (10_000, 100_000);
    let mut lp = plain(lat_n, true, pace_ns).1;
    let mut lf = ftmb(lat_n, true, 1, pace_ns).2;
    let (lp50, lp99, lf50, lf99) = (
        pct(&mut lp, 0.5),
        pct(&mut lp, 0.99),
        pct(&mut lf, 0.5),
        pct(&mut lf, 0.99),
    );
    println!(
        "{{\"workers\":{WORKERS},\"packets_per_worker\":{n},\"runs\":{runs},\
         \"pals_per_packet\":{:.3},\"plain_ns_per_pkt\":{p:.1},\"pal_ns_per_pkt\":{l:.1},\
         \"pal_added_ns_per_pkt\":{:.1},\"plain_chan_ns_per_pkt\":{pc:.1},\
         \"ftmb_ns_per_pkt\":{f:.1},\"ftmb_added_ns_per_pkt\":{:.1},\
         \"ftmb_throughput_ratio\":{:.3},\"ftmb_batch32_ns_per_pkt\":{fb:.1},\
         \"ftmb_batch32_added_ns_per_pkt\":{:.1},\"ftmb_batch32_throughput_ratio\":{:.3},\
         \"paced_pps_per_worker\":10000,\"plain_chan_latency_ns_p50\":{lp50},\
         \"plain_chan_latency_ns_p99\":{lp99},\"ftmb_latency_ns_p50\":{lf50},\
         \"ftmb_latency_ns_p99\":{lf99}}}",
        pals as f64 / (n * WORKERS as u64) as f64,
        l - p,
        f - pc,
        pc / f,
        fb - pc,
        pc / fb
    );
}
