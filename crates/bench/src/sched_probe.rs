//! The machine's own scheduling latency, measured beside a benchmark (a small `cyclictest`).
//!
//! One thread per CPU (pinned) sleeps for a fixed interval over and over and records how late
//! it woke up. On the
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
/// Lateness from which a wake-up is kept as an event with its time, so that a benchmark can
/// tell whether one of its slow operations overlapped it.
const STALL_EVENT: Duration = Duration::from_micros(500);
/// Probe threads at most (one per CPU).
const MAX_CPUS: usize = 16;
/// Stall events kept per thread at most.
const MAX_EVENTS: usize = 100_000;

#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct SchedProbeReport {
    /// The probe's sleep interval, microseconds.
    pub interval_us: u64,
    /// SCHED_FIFO priority of the probe threads (`None`: the normal scheduler).
    pub realtime_priority: Option<u8>,
    /// Probe threads, each pinned to one CPU.
    pub cpus: usize,
    pub samples: u64,
    /// How late the probe woke up, microseconds.
    pub late_us_p50: u64,
    pub late_us_p99: u64,
    pub late_us_max: u64,
    /// Wake-ups at least 1 ms late (all probe threads together), and their rate.
    pub stalls_over_1ms: u64,
    pub stalls_per_s: f64,
    pub seconds: f64,
}

/// When a probe thread should have woken up and when it did (lateness >= 500 us).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Stall {
    pub from: Instant,
    pub to: Instant,
}

/// What the probe threads saw: the summary and the stall events, ordered by start.
pub struct SchedProbeResult {
    pub report: SchedProbeReport,
    pub stalls: Vec<Stall>,
}

impl SchedProbeResult {
    /// True when a stall overlapped `[from, to]`.
    pub fn stalled_during(&self, from: Instant, to: Instant) -> bool {
        self.stalls.iter().any(|s| s.from < to && s.to > from)
    }
}

type Samples = (Vec<u64>, Vec<Stall>);

/// A running probe; [`SchedProbe::stop`] returns what it saw.
pub struct SchedProbe {
    stop: Arc<AtomicBool>,
    handles: Vec<JoinHandle<Result<Samples, String>>>,
    interval: Duration,
    prio: Option<u8>,
    started: Instant,
}

/// Pins the calling thread to `cpu`.
fn pin_to(cpu: usize) -> Result<(), String> {
    // SAFETY: cpu_set_t is plain data; CPU_SET stays within it for cpu < CPU_SETSIZE (checked
    // by the caller's MAX_CPUS bound); pid 0 names the calling thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(format!(
                "pin probe to CPU {cpu}: {}",
                std::io::Error::last_os_error()
            ));
        }
    }
    Ok(())
}

impl SchedProbe {
    /// Starts one probe thread per online CPU, pinned to it (under SCHED_FIFO `prio` if
    /// given): a stall of either virtual CPU can delay a migration, whose threads run on both.
    pub fn start(interval: Duration, prio: Option<u8>) -> Result<SchedProbe, String> {
        let cpus = std::thread::available_parallelism()
            .map_or(1, usize::from)
            .min(MAX_CPUS);
        let stop = Arc::new(AtomicBool::new(false));
        let mut handles = Vec::with_capacity(cpus);
        for cpu in 0..cpus {
            let flag = stop.clone();
            let h = std::thread::Builder::new()
                .name(format!("sched-probe-{cpu}"))
                .spawn(move || -> Result<Samples, String> {
                    pin_to(cpu)?;
                    if let Some(p) = prio {
                        pliant_runtime::sched::set_realtime(p)?;
                    }
                    // Lateness in microseconds; ~5000 per second at 200 us, bounded.
                    let mut late = Vec::with_capacity(1 << 16);
                    let mut stalls = Vec::new();
                    while !flag.load(Ordering::Relaxed) {
                        let t = Instant::now();
                        std::thread::sleep(interval);
                        let woke = Instant::now();
                        let over = woke.saturating_duration_since(t).saturating_sub(interval);
                        if late.len() < 10_000_000 {
                            late.push(over.as_micros() as u64);
                        }
                        if over >= STALL_EVENT && stalls.len() < MAX_EVENTS {
                            stalls.push(Stall {
                                from: t + interval,
                                to: woke,
                            });
                        }
                    }
                    Ok((late, stalls))
                });
            match h {
                Ok(h) => handles.push(h),
                Err(e) => {
                    stop.store(true, Ordering::Relaxed);
                    return Err(format!("spawn probe thread: {e}"));
                }
            }
        }
        Ok(SchedProbe {
            stop,
            handles,
            interval,
            prio,
            started: Instant::now(),
        })
    }

    pub fn stop(mut self) -> Result<SchedProbeResult, String> {
        self.stop.store(true, Ordering::Relaxed);
        let seconds = self.started.elapsed().as_secs_f64();
        let cpus = self.handles.len();
        let mut late = Vec::new();
        let mut stalls = Vec::new();
        for h in self.handles.drain(..) {
            let (l, s) = h
                .join()
                .map_err(|_| "probe thread panicked".to_string())??;
            late.extend(l);
            stalls.extend(s);
        }
        stalls.sort_by_key(|s| s.from);
        let mut report = summarize(late, self.interval, self.prio, seconds);
        report.cpus = cpus;
        Ok(SchedProbeResult { report, stalls })
    }
}

impl Drop for SchedProbe {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for h in self.handles.drain(..) {
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
        cpus: 1,
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
        let res = p.stop().unwrap();
        let r = &res.report;
        assert!(r.samples > 10, "{r:?}");
        assert!(r.cpus >= 1);
        // Every recorded stall is an interval that overlaps itself and nothing far away.
        for s in &res.stalls {
            assert!(s.to >= s.from);
            assert!(res.stalled_during(s.from, s.to + Duration::from_micros(1)));
        }
        let later = Instant::now() + Duration::from_secs(3600);
        assert!(!res.stalled_during(later, later + Duration::from_secs(1)));
        assert!(r.late_us_max >= r.late_us_p99 && r.late_us_p99 >= r.late_us_p50);
    }
}
