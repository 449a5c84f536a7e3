//! What the kv end-to-end tests share.

// Each test binary uses its own part of it.
#![allow(dead_code)]

use pliant_kv::cluster::Kv;
use pliant_kv::slots;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A fresh state directory for a cluster named after `tag`, this process and the clock; `None`
/// when the test cannot run here (not root, or no redis-server: skipped, as the suite reports).
pub fn cluster_dir(tag: &str) -> Option<PathBuf> {
    if !pliant_testkit::require_root()
        || !pliant_testkit::require_tool("redis-server", "redis-server")
    {
        return None;
    }
    Some(std::env::temp_dir().join(format!(
        "pliant-kv-{tag}-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos()
    )))
}

const PIPELINE: u64 = 64;
/// A writer's rate meaning "as fast as the cluster takes them".
pub const CLOSED: u64 = u64::MAX;
/// Pipelined SETs to one partition's master at `rate` writes/s (read on every batch; `CLOSED`:
/// no pacing). On any error (a master that moved, a host removed) it re-reads the state and
/// connects to the new master. `ops` counts acknowledged writes.
pub fn writer(
    dir: PathBuf,
    p: usize,
    partitions: usize,
    stop: Arc<AtomicBool>,
    rate: Arc<AtomicU64>,
    ops: Arc<AtomicU64>,
) {
    let tag = slots::tag_for(p, partitions);
    let value = "x".repeat(64);
    let mut n = 0u64;
    // The pacing schedule: since when, at which rate, how many sent since.
    let mut sched = (Instant::now(), CLOSED, 0u64);
    while !stop.load(Ordering::Relaxed) {
        let con = Kv::open(&dir).and_then(|kv| kv.connect(&kv.master_of(p)?));
        let Ok(mut con) = con else {
            std::thread::sleep(Duration::from_millis(50));
            continue;
        };
        while !stop.load(Ordering::Relaxed) {
            let r = rate.load(Ordering::Relaxed);
            if r != sched.1 {
                sched = (Instant::now(), r, 0);
            }
            if r != CLOSED {
                let due = (sched.0.elapsed().as_secs_f64() * r as f64) as u64;
                if due > sched.2 + r {
                    // More than a second behind: that load was offered and not served.
                    sched.2 = due - r;
                }
                if sched.2 + PIPELINE > due {
                    std::thread::sleep(Duration::from_millis(1));
                    continue;
                }
            }
            let mut pipe = redis::pipe();
            for _ in 0..PIPELINE {
                pipe.cmd("SET")
                    .arg(format!("sat:{{{tag}}}:{}", n % 5_000))
                    .arg(&value)
                    .ignore();
                n += 1;
            }
            if let Err(e) = pipe.query::<redis::Value>(&mut con) {
                let e = e.to_string();
                eprintln!("writer {p}: {}", &e[..e.len().min(100)]);
                std::thread::sleep(Duration::from_millis(20));
                break;
            }
            sched.2 += PIPELINE;
            ops.fetch_add(PIPELINE, Ordering::Relaxed);
        }
    }
}
