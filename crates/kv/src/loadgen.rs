//! Open-loop load for benchmarks: writer threads offer `SET` of unique keys at a rate that follows
//! a schedule ([`Sine`]), each write acknowledged only after `WAIT k` on the master that took it;
//! afterwards every master's keys are scanned and each acknowledged id must be present exactly
//! once ([`check_acks`]).
//!
//! The writers route by slot themselves (a slot map from `CLUSTER NODES`, fixed by `MOVED`, `ASK`
//! followed with `ASKING`), so the same writer drives a cluster whose masters move (pliant) and
//! one whose slots move (`redis-cli --cluster rebalance`). A batch per master per tick is one
//! pipeline: the `SET`s, then `WAIT k 1000`; the `SET`s that returned OK are acknowledged when
//! `WAIT` reports `k` replicas. Anything else (a redirect, an error, a short `WAIT`, a broken
//! connection) sends the same key with the same value again. A key is sent to a slot's migration
//! target (`ASKING`) only after its source said `ASK` (the key is not there), so a retry never
//! leaves a key on both sides of a migration.

use crate::node;
use crate::parse;
use crate::slots;
use crate::state::{KvState, PASSWORD_FILE};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Offered load: `low` ops/s at t = 0, `high` half a period later, back to `low` after a period
/// (`low + (high - low) (1 - cos(2πt/period)) / 2`): the seed's daily sine, compressed.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Sine {
    pub low: f64,
    pub high: f64,
    pub period_s: f64,
}

impl Sine {
    /// A constant rate.
    pub fn flat(rate: f64) -> Sine {
        Sine {
            low: rate,
            high: rate,
            period_s: 1.0,
        }
    }

    fn w(&self) -> f64 {
        2.0 * std::f64::consts::PI / self.period_s
    }

    /// Offered ops/s at `t` seconds.
    pub fn rate(&self, t: f64) -> f64 {
        self.low + (self.high - self.low) * (1.0 - (self.w() * t).cos()) / 2.0
    }

    /// Ops offered from 0 to `t` (the integral of [`Sine::rate`]).
    pub fn offered(&self, t: f64) -> f64 {
        self.low * t + (self.high - self.low) / 2.0 * (t - (self.w() * t).sin() / self.w())
    }

    /// The highest rate in `[a, b]`: at an end, or at a peak inside.
    pub fn peak(&self, a: f64, b: f64) -> f64 {
        let mut best = self.rate(a).max(self.rate(b));
        // Peaks at t = period (n + 1/2).
        let mut n = (a / self.period_s - 0.5).ceil();
        while self.period_s * (n + 0.5) <= b {
            best = best.max(self.rate(self.period_s * (n + 0.5)));
            n += 1.0;
        }
        best
    }
}

/// How the offered load is spread over the partitions.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Spread {
    /// Every partition gets the same share.
    Even,
    /// The seed's temporally skewed normal load ("TNORM", its Table 5.2): partition `i` gets a
    /// share proportional to `exp(-d² / 2σ²)`, `d` its distance (around the ring of partitions)
    /// to a centre that slides once over every partition in `sweep_s` seconds, so every
    /// partition is hot once and cold most of the time.
    SlidingNormal { sigma: f64, sweep_s: f64 },
}

impl Spread {
    /// The share of each of `partitions` partitions at `t` seconds (they add up to 1).
    pub fn shares(&self, partitions: usize, t: f64) -> Vec<f64> {
        let p = partitions.max(1);
        match *self {
            Spread::Even => vec![1.0 / p as f64; p],
            Spread::SlidingNormal { sigma, sweep_s } => {
                let n = p as f64;
                let centre = (n * t / sweep_s.max(1e-9)).rem_euclid(n);
                let w: Vec<f64> = (0..p)
                    .map(|i| {
                        let d = (i as f64 - centre).abs();
                        let d = d.min(n - d);
                        (-d * d / (2.0 * sigma * sigma).max(1e-9)).exp()
                    })
                    .collect();
                let sum: f64 = w.iter().sum();
                w.into_iter().map(|x| x / sum).collect()
            }
        }
    }
}

/// Picks partitions so that the counts follow changing shares closely: each pick adds every
/// partition's share to its credit and takes the partition with the most credit (which pays
/// one). Deterministic; over any window the counts differ from the shares by less than one per
/// partition.
#[derive(Clone, Debug, Default)]
struct Picker {
    credit: Vec<f64>,
}

impl Picker {
    fn pick(&mut self, shares: &[f64]) -> usize {
        self.credit.resize(shares.len(), 0.0);
        for (c, s) in self.credit.iter_mut().zip(shares) {
            *c += s;
        }
        let best = (0..shares.len())
            .max_by(|&a, &b| self.credit[a].total_cmp(&self.credit[b]))
            .unwrap_or(0);
        if let Some(c) = self.credit.get_mut(best) {
            *c -= 1.0;
        }
        best
    }
}

/// The next id of the sequence `id(0), id(1), ...` whose key lands in partition `p`, from
/// `cursors[p]` on (advanced past it). Every `n` belongs to one partition, so ids handed out
/// for different partitions never repeat.
fn next_in_partition(
    cursors: &mut Vec<u64>,
    partitions: usize,
    p: usize,
    id: impl Fn(u64) -> u64,
) -> u64 {
    cursors.resize(partitions, 0);
    let mut n = cursors[p];
    while slots::partition_of(slots::key_slot(key(id(n)).as_bytes()), partitions) != p {
        n += 1;
    }
    cursors[p] = n + 1;
    id(n)
}

/// The key of id `n` (no hash tag: ids spread over every slot).
pub fn key(n: u64) -> String {
    format!("b:{n:010}")
}

/// The id of a key written by [`key`].
pub fn id_of(key: &str) -> Option<u64> {
    key.strip_prefix("b:")?.parse().ok()
}

/// Acknowledged ids against the ids found on the masters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct AckCheck {
    pub acked: u64,
    /// Keys found on all masters together (acknowledged or not: a write whose `WAIT` fell short
    /// may be stored).
    pub found: u64,
    /// Acknowledged ids found nowhere.
    pub lost: u64,
    /// Ids found on more than one master.
    pub duplicated: u64,
}

/// Every acknowledged id must be found exactly once (`found` lists one entry per key per master).
pub fn check_acks(acked: &[u64], found: &[u64]) -> AckCheck {
    let mut seen: HashMap<u64, u32> = HashMap::with_capacity(found.len());
    for &id in found {
        *seen.entry(id).or_default() += 1;
    }
    let mut acked_set: Vec<u64> = acked.to_vec();
    acked_set.sort_unstable();
    acked_set.dedup();
    AckCheck {
        acked: acked_set.len() as u64,
        found: seen.len() as u64,
        lost: acked_set.iter().filter(|id| !seen.contains_key(id)).count() as u64,
        duplicated: seen.values().filter(|&&n| n > 1).count() as u64,
    }
}

/// Counters shared by the writers.
#[derive(Default)]
pub struct Counters {
    pub acked: AtomicU64,
    /// Ops the schedule offered that were never sent: a writer more than a second behind
    /// drops the excess (open loop: a slow cluster does not get the load later).
    pub dropped: AtomicU64,
    /// Keys sent again (redirect, error, short `WAIT`).
    pub retries: AtomicU64,
}

/// Running writers; [`Load::finish`] stops them and returns the acknowledged ids.
pub struct Load {
    stop: Arc<AtomicBool>,
    pub counters: Arc<Counters>,
    handles: Vec<JoinHandle<Vec<u64>>>,
}

/// Options of the writers.
#[derive(Clone, Debug)]
pub struct LoadOpts {
    pub sine: Sine,
    pub writers: usize,
    pub value_bytes: usize,
    pub k: usize,
    /// Ids are `id_base + writer + writers × n`: distinct bases keep phases apart.
    pub id_base: u64,
    /// How the writes are spread over the partitions (`Even`: whatever slot each id hashes to).
    pub spread: Spread,
}

impl Load {
    /// Starts `o.writers` threads on the cluster in `dir`; the schedule's t = 0 is `t0`.
    pub fn start(dir: &Path, o: &LoadOpts, t0: Instant) -> Result<Load, String> {
        let st = KvState::load(dir)?;
        let password = std::fs::read_to_string(dir.join(PASSWORD_FILE))
            .map_err(|e| format!("{}: {e}", dir.join(PASSWORD_FILE).display()))?
            .trim()
            .to_string();
        let stop = Arc::new(AtomicBool::new(false));
        let counters = Arc::new(Counters::default());
        let handles = (0..o.writers)
            .map(|w| {
                let mut wr = Writer {
                    dir: dir.to_path_buf(),
                    password: password.clone(),
                    fabric: st.fabric_ns.clone(),
                    o: o.clone(),
                    me: w as u64,
                    map: vec![None; slots::SLOTS as usize],
                    partitions: st.partitions,
                    cursors: Vec::new(),
                    picker: Picker::default(),
                    conns: HashMap::new(),
                    acked: Vec::new(),
                };
                let (stop, c) = (stop.clone(), counters.clone());
                std::thread::Builder::new()
                    .name(format!("kv-load-{w}"))
                    .spawn(move || wr.run(t0, &stop, &c))
                    .map_err(|e| e.to_string())
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Load {
            stop,
            counters,
            handles,
        })
    }

    /// Stops the writers (each finishes its batch) and returns every acknowledged id.
    pub fn finish(self) -> Vec<u64> {
        self.stop.store(true, Ordering::Relaxed);
        self.handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_default())
            .collect()
    }
}

/// A key waiting to be sent; `ask` is a migration target named by `ASK`.
#[derive(Clone, Debug)]
struct Item {
    id: u64,
    ask: Option<String>,
}

struct Writer {
    dir: PathBuf,
    password: String,
    fabric: String,
    o: LoadOpts,
    me: u64,
    /// Slot → master address (`ip:port`).
    map: Vec<Option<String>>,
    partitions: usize,
    /// Per partition, the next `n` of this writer's id sequence to look at for a key of that
    /// partition (skewed spreads only; see [`next_in_partition`]).
    cursors: Vec<u64>,
    picker: Picker,
    conns: HashMap<String, redis::Connection>,
    acked: Vec<u64>,
}

const TICK: Duration = Duration::from_millis(20);
/// Keys per pipeline: every pipeline (with its `WAIT`) carries this many, a shorter one only at a
/// flush, so the servers' CPU follows the rate (a pipeline per tick and master, whatever the
/// rate, made the CPU per op fall sevenfold between 5,000 and 70,000 ops/s).
const BATCH: usize = 32;
const FLUSH_EVERY: Duration = Duration::from_millis(200);

impl Writer {
    fn run(&mut self, t0: Instant, stop: &AtomicBool, c: &Counters) -> Vec<u64> {
        if crate::host::enter(&self.fabric).is_err() {
            return Vec::new();
        }
        self.refresh();
        let share = 1.0 / self.o.writers as f64;
        let mut issued: u64 = 0;
        let mut queue: Vec<Item> = Vec::new();
        let value = "v".repeat(self.o.value_bytes);
        let mut flushed = Instant::now();
        while !stop.load(Ordering::Relaxed) {
            let tick = Instant::now();
            let flush = flushed.elapsed() >= FLUSH_EVERY;
            if flush {
                flushed = tick;
            }
            let t = t0.elapsed().as_secs_f64();
            let due = (self.o.sine.offered(t) * share) as u64;
            // Open loop: at most a second of backlog; the rest is dropped, not sent later.
            let cap = (self.o.sine.rate(t) * share).ceil() as u64 + 1;
            let backlog = due.saturating_sub(issued) + queue.len() as u64;
            if backlog > cap {
                let drop = (backlog - cap).min(due.saturating_sub(issued));
                issued += drop;
                c.dropped.fetch_add(drop, Ordering::Relaxed);
            }
            // The shares change with time, not per write: once per tick.
            let shares = match self.o.spread {
                Spread::Even => Vec::new(),
                sk => sk.shares(self.partitions, t),
            };
            while issued < due {
                let id = self.next_id(&shares, issued);
                queue.push(Item { id, ask: None });
                issued += 1;
            }
            if !queue.is_empty() {
                let work = std::mem::take(&mut queue);
                queue = self.send(work, &value, flush, c);
            }
            if let Some(rest) = TICK.checked_sub(tick.elapsed()) {
                std::thread::sleep(rest);
            }
        }
        std::mem::take(&mut self.acked)
    }

    /// The id of this writer's `issued`-th write: the `issued`-th of its sequence when the
    /// spread is even, else the next unused one of its sequence whose key lands in the
    /// partition the spread picks now.
    fn id(&self, n: u64) -> u64 {
        self.o.id_base + self.me + self.o.writers as u64 * n
    }

    /// `shares`: the spread's shares now (empty for an even spread).
    fn next_id(&mut self, shares: &[f64], issued: u64) -> u64 {
        if shares.is_empty() || self.partitions == 0 {
            return self.id(issued);
        }
        let p = self.picker.pick(shares);
        let (base, w) = (self.o.id_base + self.me, self.o.writers as u64);
        next_in_partition(&mut self.cursors, self.partitions, p, |n| base + w * n)
    }

    /// Sends pipelines of [`BATCH`] keys per master (a shorter last one only on `flush`); returns
    /// the items to send (again) later.
    fn send(&mut self, work: Vec<Item>, value: &str, flush: bool, c: &Counters) -> Vec<Item> {
        let mut groups: BTreeMap<String, Vec<Item>> = BTreeMap::new();
        let mut again = Vec::new();
        let mut refresh = false;
        let mut later = Vec::new();
        for it in work {
            let addr = it
                .ask
                .clone()
                .or_else(|| self.map[slots::key_slot(key(it.id).as_bytes()) as usize].clone());
            match addr {
                Some(a) => groups.entry(a).or_default().push(it),
                None => {
                    refresh = true;
                    again.push(Item { ask: None, ..it })
                }
            }
        }
        for (addr, items) in groups {
            let mut chunks = items.chunks(BATCH);
            for chunk in chunks.by_ref() {
                if chunk.len() < BATCH && !flush {
                    later.extend_from_slice(chunk);
                    continue;
                }
                let Ok(replies) = self.pipeline(&addr, chunk, value) else {
                    self.conns.remove(&addr);
                    refresh = true;
                    again.extend(chunk.iter().map(|i| Item {
                        ask: None,
                        ..i.clone()
                    }));
                    break;
                };
                let (ok, retry, moved) = self.sort_replies(chunk, &replies);
                refresh |= moved;
                let waited = replies.last().and_then(|v| match v {
                    redis::Value::Int(n) => Some(*n),
                    _ => None,
                });
                if waited.is_some_and(|n| n >= self.o.k as i64) {
                    c.acked.fetch_add(ok.len() as u64, Ordering::Relaxed);
                    self.acked.extend(ok.iter().map(|i| i.id));
                } else {
                    again.extend(ok.into_iter().map(|i| Item { ask: None, ..i }));
                }
                again.extend(retry);
            }
            // After a broken connection: the rest of this master's keys, after a refresh.
            for chunk in chunks {
                again.extend(chunk.iter().map(|i| Item {
                    ask: None,
                    ..i.clone()
                }));
            }
        }
        c.retries.fetch_add(again.len() as u64, Ordering::Relaxed);
        if refresh {
            self.refresh();
        }
        again.extend(later);
        again
    }

    fn pipeline(
        &mut self,
        addr: &str,
        items: &[Item],
        value: &str,
    ) -> Result<Vec<redis::Value>, String> {
        if !self.conns.contains_key(addr) {
            let con = node::connect_addr(addr, &self.password)?;
            self.conns.insert(addr.to_string(), con);
        }
        let con = self.conns.get_mut(addr).expect("inserted above");
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        for it in items {
            if it.ask.is_some() {
                pipe.cmd("ASKING");
            }
            pipe.cmd("SET").arg(key(it.id)).arg(value);
        }
        pipe.cmd("WAIT").arg(self.o.k).arg(1000);
        pipe.query::<Vec<redis::Value>>(con)
            .map_err(|e| e.to_string())
    }

    /// Splits a pipeline's replies into the keys stored, the keys to send again, and whether the
    /// slot map needs a refresh.
    fn sort_replies(
        &mut self,
        items: &[Item],
        replies: &[redis::Value],
    ) -> (Vec<Item>, Vec<Item>, bool) {
        let (mut ok, mut retry, mut moved) = (Vec::new(), Vec::new(), false);
        let mut r = replies.iter();
        for it in items {
            if it.ask.is_some() {
                r.next(); // ASKING
            }
            match r.next() {
                Some(redis::Value::Okay) => ok.push(it.clone()),
                Some(redis::Value::ServerError(e)) => {
                    let target = e
                        .details()
                        .and_then(|d| d.split_whitespace().nth(1))
                        .map(str::to_string);
                    match (e.code(), target) {
                        ("MOVED", Some(t)) => {
                            let slot = slots::key_slot(key(it.id).as_bytes()) as usize;
                            self.map[slot] = Some(t);
                            retry.push(Item {
                                ask: None,
                                ..it.clone()
                            });
                        }
                        ("ASK", Some(t)) => retry.push(Item {
                            ask: Some(t),
                            ..it.clone()
                        }),
                        _ => {
                            moved = true;
                            retry.push(Item {
                                ask: None,
                                ..it.clone()
                            });
                        }
                    }
                }
                _ => retry.push(Item {
                    ask: None,
                    ..it.clone()
                }),
            }
        }
        (ok, retry, moved)
    }

    /// The slot map from the first node (in state.json) that answers `CLUSTER NODES`.
    fn refresh(&mut self) {
        let Ok(st) = KvState::load(&self.dir) else {
            return;
        };
        for n in &st.nodes {
            let view =
                node::connect(&st, n, &self.password).and_then(|mut c| node::cluster_nodes(&mut c));
            let Ok(view) = view else { continue };
            for l in view.iter().filter(|l| l.is_master() && !l.has_flag("fail")) {
                for &(a, b) in &l.slots {
                    for s in a..=b {
                        self.map[s as usize] = Some(format!("{}:{}", l.ip, l.port));
                    }
                }
            }
            return;
        }
    }
}

/// Ids of every key matching [`key`] on every node that reports `role:master`, one entry per key
/// per master (the calling thread must be in the fabric namespace).
pub fn scan_masters(st: &KvState, password: &str) -> Result<Vec<u64>, String> {
    let mut ids = Vec::new();
    for n in &st.nodes {
        let mut c = node::connect(st, n, password)?;
        if node::info(&mut c, "replication")?
            .get("role")
            .map(String::as_str)
            != Some("master")
        {
            continue;
        }
        let mut cursor: u64 = 0;
        loop {
            let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg("b:*")
                .arg("COUNT")
                .arg(5000)
                .query(&mut c)
                .map_err(|e| format!("SCAN on {}:{}: {e}", n.host, n.port))?;
            ids.extend(keys.iter().filter_map(|k| id_of(k)));
            if next == 0 {
                break;
            }
            cursor = next;
        }
    }
    Ok(ids)
}

/// Slot → owning master's node id, from one node's `CLUSTER NODES`.
pub fn slot_owners(view: &[parse::NodeLine]) -> Vec<Option<String>> {
    let mut owners = vec![None; slots::SLOTS as usize];
    for l in view.iter().filter(|l| l.is_master()) {
        for &(a, b) in &l.slots {
            for s in a..=b {
                owners[s as usize] = Some(l.id.clone());
            }
        }
    }
    owners
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sine_starts_low_peaks_half_a_period_in_and_integrates() {
        let s = Sine {
            low: 100.0,
            high: 500.0,
            period_s: 60.0,
        };
        assert!((s.rate(0.0) - 100.0).abs() < 1e-9);
        assert!((s.rate(30.0) - 500.0).abs() < 1e-9);
        assert!((s.rate(60.0) - 100.0).abs() < 1e-9);
        // One period offers the mean rate × the period.
        assert!((s.offered(60.0) - 300.0 * 60.0).abs() < 1e-6);
        assert_eq!(s.offered(0.0), 0.0);
        // The integral against a Riemann sum.
        let n = 100_000;
        let dt = 17.0 / n as f64;
        let sum: f64 = (0..n).map(|i| s.rate((i as f64 + 0.5) * dt) * dt).sum();
        assert!((sum - s.offered(17.0)).abs() < 1e-3, "{sum}");
        // Peaks inside an interval, or its ends.
        assert!((s.peak(20.0, 40.0) - 500.0).abs() < 1e-9);
        assert!((s.peak(0.0, 10.0) - s.rate(10.0)).abs() < 1e-9);
        assert!((s.peak(45.0, 60.0) - s.rate(45.0)).abs() < 1e-9);
        assert!((s.peak(80.0, 100.0) - 500.0).abs() < 1e-9);
        let f = Sine::flat(7.0);
        assert!((f.rate(3.3) - 7.0).abs() < 1e-12 && (f.offered(2.0) - 14.0).abs() < 1e-9);
    }

    #[test]
    fn the_sliding_normal_is_hot_where_its_centre_is_and_visits_every_partition() {
        let even = Spread::Even.shares(8, 3.0);
        assert_eq!(even, vec![0.125; 8]);
        let sk = Spread::SlidingNormal {
            sigma: 2.0,
            sweep_s: 80.0,
        };
        let argmax = |v: &[f64]| (0..v.len()).max_by(|&a, &b| v[a].total_cmp(&v[b])).unwrap();
        let mut hottest = Vec::new();
        for step in 0..8 {
            let sh = sk.shares(8, step as f64 * 10.0);
            assert!((sh.iter().sum::<f64>() - 1.0).abs() < 1e-9);
            assert!(sh.iter().all(|&x| x > 0.0));
            hottest.push(argmax(&sh));
            // σ = P/4: the hottest partition several times the coldest, below a third.
            let (hi, lo) = (sh[argmax(&sh)], sh.iter().copied().fold(1.0, f64::min));
            assert!(hi > 5.0 * lo && hi < 0.34, "{sh:?}");
        }
        assert_eq!(
            hottest,
            (0..8).collect::<Vec<_>>(),
            "one partition after the other"
        );
        // Around the ring: at t = sweep the centre is back at partition 0.
        assert_eq!(argmax(&sk.shares(8, 80.0)), 0);
    }

    #[test]
    fn picks_follow_changing_shares_within_one_per_partition() {
        let mut p = Picker::default();
        let mut count = vec![0u32; 4];
        let shares = [0.5, 0.25, 0.125, 0.125];
        for i in 1..=400u32 {
            count[p.pick(&shares)] += 1;
            for (c, s) in count.iter().zip(shares) {
                assert!(
                    (f64::from(*c) - s * f64::from(i)).abs() < 1.0 + 1e-9,
                    "{count:?}"
                );
            }
        }
        // The shares change: the picks follow.
        let mut later = vec![0u32; 4];
        for _ in 0..100 {
            later[p.pick(&[0.0, 0.0, 0.0, 1.0])] += 1;
        }
        assert!(later[3] >= 99, "{later:?}");
    }

    #[test]
    fn ids_for_a_partition_land_in_it_and_never_repeat() {
        let mut cursors = Vec::new();
        let mut seen = std::collections::HashSet::new();
        let id = |n: u64| 7 + 3 * n;
        for i in 0..2000usize {
            let p = (i * 7919) % 8;
            let x = next_in_partition(&mut cursors, 8, p, id);
            assert_eq!(
                slots::partition_of(slots::key_slot(key(x).as_bytes()), 8),
                p
            );
            assert_eq!((x - 7) % 3, 0, "from the writer's own sequence");
            assert!(seen.insert(x), "id {x} handed out twice");
        }
    }

    #[test]
    fn keys_round_trip_and_spread_over_slots() {
        assert_eq!(id_of(&key(42)), Some(42));
        assert_eq!(id_of("load:{x}:1"), None);
        let slots: std::collections::HashSet<u16> = (0..1000)
            .map(|n| slots::key_slot(key(n).as_bytes()))
            .collect();
        assert!(slots.len() > 900, "{}", slots.len());
    }

    #[test]
    fn acks_are_checked_present_exactly_once() {
        let c = check_acks(&[1, 2, 3, 3], &[1, 2, 2, 3, 9]);
        assert_eq!(
            c,
            AckCheck {
                acked: 3,
                found: 4,
                lost: 0,
                duplicated: 1
            }
        );
        let c = check_acks(&[1, 2, 5], &[2]);
        assert_eq!((c.lost, c.duplicated, c.found), (2, 0, 1));
        assert_eq!(check_acks(&[], &[]), AckCheck::default());
    }

    #[test]
    fn slot_owners_cover_what_masters_claim() {
        let view = parse::cluster_nodes(
            "a 10.0.0.1:7000@17000 myself,master - 0 0 1 connected 0-99 200\n\
             b 10.0.0.2:7000@17000 slave a 0 0 1 connected\n",
        )
        .unwrap();
        let o = slot_owners(&view);
        assert_eq!(o[0].as_deref(), Some("a"));
        assert_eq!(o[99].as_deref(), Some("a"));
        assert_eq!(o[100], None);
        assert_eq!(o[200].as_deref(), Some("a"));
    }
}
