//! The machine's own scheduling latency, measured beside a benchmark (a small `cyclictest`).
//!
//! A thread sleeps for a fixed interval over and over and records how late it woke up. On the
//! 2-core virtual benchmark machine even a SCHED_FIFO thread at priority 80 on an otherwise
//! idle machine wakes 2-3 ms late a few times per second (the virtual CPU itself was not
//! running). Any pause the benchmark reports sits on top of that floor, so the report carries
//! it, measured in the same run under the same load, instead of a figure from another day.

use serde::Serialize;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Lateness above which a wake-up counts as a stall.
const STALL: Duration = Duration::from_millis(1);

#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct SchedProbeReport {
    /// The probe's sleep interval, microseconds.
    pub interval_us: u64,
    /// SCHED_FIFO priority of the probe thread (`None`: the normal scheduler).
    pub realtime_priority: Option<u8>,
    pub samples: u64,
    /// How late the probe woke up, microseconds.
    pub late_us_p50: u64,
    pub late_us_p99: u64,
    pub late_us_max: u64,
    /// Wake-ups at least 1 ms late, and their rate.
    pub stalls_over_1ms: u64,
    pub stalls_per_s: f64,
    pub seconds: f64,
}

/// A running probe; [`SchedProbe::stop`] returns what it saw.
pub struct SchedProbe {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<Result<Vec<u64>, String>>>,
    interval: Duration,
    prio: Option<u8>,
    started: Instant,
}

impl SchedProbe {
    /// Starts the probe thread (under SCHED_FIFO `prio` if given).
    pub fn start(interval: Duration, prio: Option<u8>) -> Result<SchedProbe, String> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let handle = std::thread::Builder::new()
            .name("sched-probe".into())
            .spawn(move || -> Result<Vec<u64>, String> {
                if let Some(p) = prio {
                    pliant_runtime::sched::set_realtime(p)?;
                }
                // Lateness in microseconds; ~5000 per second at 200 us, bounded by the run.
                let mut late = Vec::with_capacity(1 << 16);
                while !flag.load(Ordering::Relaxed) {
                    let t = Instant::now();
                    std::thread::sleep(interval);
                    let over = t.elapsed().saturating_sub(interval);
                    if late.len() < 10_000_000 {
                        late.push(over.as_micros() as u64);
                    }
                }
                Ok(late)
            })
            .map_err(|e| format!("spawn probe thread: {e}"))?;
        Ok(SchedProbe {
            stop,
            handle: Some(handle),
            interval,
            prio,
            started: Instant::now(),
        })
    }

    pub fn stop(mut self) -> Result<SchedProbeReport, String> {
        self.stop.store(true, Ordering::Relaxed);
        let seconds = self.started.elapsed().as_secs_f64();
        let late = self
            .handle
            .take()
            .ok_or("probe already stopped")?
            .join()
            .map_err(|_| "probe thread panicked".to_string())??;
        Ok(summarize(late, self.interval, self.prio, seconds))
    }
}

impl Drop for SchedProbe {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

fn summarize(
    mut late: Vec<u64>,
    interval: Duration,
    prio: Option<u8>,
    seconds: f64,
) -> SchedProbeReport {
    late.sort_unstable();
    let pick = |q: f64| -> u64 {
        if late.is_empty() {
            return 0;
        }
        let i = ((late.len() - 1) as f64 * q).round() as usize;
        late[i.min(late.len() - 1)]
    };
    let stalls = late
        .iter()
        .filter(|&&us| us >= STALL.as_micros() as u64)
        .count() as u64;
    SchedProbeReport {
        interval_us: interval.as_micros() as u64,
        realtime_priority: prio,
        samples: late.len() as u64,
        late_us_p50: pick(0.5),
        late_us_p99: pick(0.99),
        late_us_max: late.last().copied().unwrap_or(0),
        stalls_over_1ms: stalls,
        stalls_per_s: if seconds > 0.0 {
            stalls as f64 / seconds
        } else {
            0.0
        },
        seconds,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_counts_stalls_and_quantiles() {
        let mut late: Vec<u64> = vec![10; 98];
        late.push(1500);
        late.push(3000);
        let r = summarize(late, Duration::from_micros(200), None, 2.0);
        assert_eq!(r.samples, 100);
        assert_eq!(r.late_us_p50, 10);
        assert_eq!(r.late_us_p99, 1500);
        assert_eq!(r.late_us_max, 3000);
        assert_eq!(r.stalls_over_1ms, 2);
        assert_eq!(r.stalls_per_s, 1.0);
        let empty = summarize(Vec::new(), Duration::from_micros(200), Some(5), 0.0);
        assert_eq!(
            (empty.samples, empty.late_us_max, empty.stalls_per_s),
            (0, 0, 0.0)
        );
    }

    #[test]
    fn probe_runs_and_reports_samples() {
        let p = SchedProbe::start(Duration::from_micros(500), None).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        let r = p.stop().unwrap();
        assert!(r.samples > 10, "{r:?}");
        assert!(r.late_us_max >= r.late_us_p99 && r.late_us_p99 >= r.late_us_p50);
    }
}
