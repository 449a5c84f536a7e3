//! A TPC-C-like transaction mix as Redis Functions keyed by warehouse hash tags (VoltDB's
//! stored procedures, one partition per transaction): the library ([`LIBRARY`], `tpcc.lua`),
//! installing and populating it, client threads running the mix, and the consistency check.
//!
//! Every writing transaction is acknowledged only after `WAIT k` on the master that ran it
//! reports `k` replicas, like the key-value writes. It carries a unique id that the function
//! records with its effects: a client that cannot tell whether a call was applied (a master
//! moved, a reply lost) sends the same id again, and a transaction already applied is not
//! applied twice. [`check`] then proves, per warehouse, that every acknowledged id is recorded
//! (none lost) and that the warehouse satisfies TPC-C's consistency conditions that this schema
//! has (year-to-date totals of warehouse and districts agree with each other and with the
//! recorded payments; orders 1 .. next_o_id - 1 exist with all their lines; the undelivered
//! orders are the newest, contiguous; every balance is what was delivered minus what was paid).

use crate::cluster::Kv;
use crate::slots;
use pliant_placement::instances::Rng;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The function library (`FUNCTION LOAD`), `#!lua name=pliant_tpcc`.
pub const LIBRARY: &str = include_str!("tpcc.lua");

/// A call that fails for another reason than a rollback is retried (same id) this long.
const RETRY_FOR: Duration = Duration::from_secs(30);

#[derive(Clone, Debug)]
pub struct TpccOpts {
    /// Warehouse `w` lives on partition `w % partitions`.
    pub warehouses: usize,
    pub districts: usize,
    pub customers: usize,
    pub items: usize,
    /// Client threads.
    pub clients: usize,
}

impl Default for TpccOpts {
    fn default() -> Self {
        TpccOpts {
            warehouses: 8,
            districts: 10,
            customers: 30,
            items: 100,
            clients: 4,
        }
    }
}

/// The key of warehouse `w` (its partition's hash tag): every key of the warehouse derives
/// from it.
pub fn warehouse_key(w: usize, partitions: usize) -> String {
    format!("{{{}}}:w{w}", slots::tag_for(w % partitions, partitions))
}

/// Loads the library on every partition's master (`FUNCTION LOAD REPLACE`); replicas get it by
/// replication, copies that moves add get it with their sync.
pub fn install(kv: &Kv) -> Result<(), String> {
    for p in 0..kv.state.partitions {
        let m = kv.master_of(p)?;
        let mut c = kv.connect(&m)?;
        redis::cmd("FUNCTION")
            .arg("LOAD")
            .arg("REPLACE")
            .arg(LIBRARY)
            .query::<String>(&mut c)
            .map_err(|e| format!("partition {p}: FUNCTION LOAD: {e}"))?;
    }
    Ok(())
}

/// Creates every warehouse (districts, customers, stock) that does not exist yet, acknowledged by
/// `WAIT k`. Returns how many it created.
pub fn populate(kv: &Kv, o: &TpccOpts) -> Result<usize, String> {
    let mut created = 0;
    let parts = kv.state.partitions;
    for w in 0..o.warehouses {
        let m = kv.master_of(w % parts)?;
        let mut c = kv.connect(&m)?;
        let r = redis::cmd("FCALL")
            .arg("tpcc_load")
            .arg(1)
            .arg(warehouse_key(w, parts))
            .arg(o.districts)
            .arg(o.customers)
            .arg(o.items)
            .query::<String>(&mut c)
            .map_err(|e| format!("warehouse {w}: tpcc_load: {e}"))?;
        created += usize::from(r == "OK");
        let n: usize = redis::cmd("WAIT")
            .arg(kv.state.k)
            .arg(5000)
            .query(&mut c)
            .map_err(|e| format!("warehouse {w}: WAIT: {e}"))?;
        if n < kv.state.k {
            return Err(format!("warehouse {w}: {n} of {} replicas", kv.state.k));
        }
    }
    Ok(created)
}

/// The transactions, in TPC-C's mix (45 % new order, 43 % payment, 4 % each of the others).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    NewOrder,
    Payment,
    OrderStatus,
    Delivery,
    StockLevel,
}

impl Kind {
    /// The transaction for a uniform draw in 0..100.
    pub fn from_draw(d: u64) -> Kind {
        match d % 100 {
            0..=44 => Kind::NewOrder,
            45..=87 => Kind::Payment,
            88..=91 => Kind::OrderStatus,
            92..=95 => Kind::Delivery,
            _ => Kind::StockLevel,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Kind::NewOrder => "new_order",
            Kind::Payment => "payment",
            Kind::OrderStatus => "order_status",
            Kind::Delivery => "delivery",
            Kind::StockLevel => "stock_level",
        }
    }

    fn writes(self) -> bool {
        matches!(self, Kind::NewOrder | Kind::Payment | Kind::Delivery)
    }

    /// The id prefix the library recognises (`p:` for payments).
    fn letter(self) -> char {
        match self {
            Kind::NewOrder => 'n',
            Kind::Payment => 'p',
            _ => 'd',
        }
    }
}

/// Uniform in `1..=n` (districts, customers, items and quantities count from 1).
fn pick(r: &mut Rng, n: usize) -> usize {
    1 + r.below(n.max(1))
}

/// The arguments of one transaction after the warehouse key (the id first for writing ones).
fn args(kind: Kind, txn: &str, o: &TpccOpts, r: &mut Rng) -> Vec<String> {
    let d = pick(r, o.districts).to_string();
    let c = pick(r, o.customers).to_string();
    match kind {
        Kind::NewOrder => {
            let n = 5 + r.next_u64() % 11;
            // 1 % of orders name an invalid item last: refused before any write.
            let rollback = r.next_u64().is_multiple_of(100);
            let mut v = vec![txn.to_string(), d, c, n.to_string()];
            for k in 0..n {
                let item = if rollback && k + 1 == n {
                    0
                } else {
                    pick(r, o.items)
                };
                v.push(item.to_string());
                v.push(pick(r, 10).to_string());
            }
            v
        }
        Kind::Payment => vec![txn.to_string(), d, c],
        Kind::Delivery => vec![txn.to_string(), pick(r, 10).to_string()],
        Kind::OrderStatus => vec![d, c],
        Kind::StockLevel => vec![d, (10 + r.next_u64() % 11).to_string()],
    }
}

/// What the clients did.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct MixReport {
    /// Transactions completed per kind (writing ones: acknowledged by `WAIT k`).
    pub committed: BTreeMap<&'static str, u64>,
    /// New orders refused for an invalid item (TPC-C's rollbacks).
    pub rollbacks: u64,
    /// Calls sent again (an error, a redirect, a short `WAIT`).
    pub retries: u64,
    /// Writing transactions given up after `RETRY_FOR` of errors: applied or not, unknown;
    /// never acknowledged.
    pub unknown: u64,
    pub seconds: f64,
    /// Acknowledged writing transactions per second.
    pub acked_per_s: f64,
    /// New orders per minute (TPC-C's tpmC, of this scaled-down schema).
    pub new_orders_per_min: f64,
    /// The first and the last few errors seen, with when (seconds into the run), for the record.
    pub errors: Vec<String>,
}

struct Shared {
    t0: Instant,
    committed: Mutex<BTreeMap<&'static str, u64>>,
    rollbacks: AtomicU64,
    retries: AtomicU64,
    unknown: AtomicU64,
    /// (warehouse, id) of every acknowledged writing transaction.
    acked: Mutex<Vec<(usize, String)>>,
    errors: Mutex<Vec<String>>,
}

/// Client threads running the mix until [`Mix::finish`].
pub struct Mix {
    stop: Arc<AtomicBool>,
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    t0: Instant,
}

impl Mix {
    /// Starts `o.clients` threads on the cluster at `dir` (each opens it: `Kv::open` moves its
    /// thread into the cluster's namespace). `seed` makes the draws reproducible and the ids
    /// unique per run.
    pub fn start(dir: &Path, o: &TpccOpts, seed: u64) -> Mix {
        let stop = Arc::new(AtomicBool::new(false));
        let shared = Arc::new(Shared {
            t0: Instant::now(),
            committed: Mutex::default(),
            rollbacks: AtomicU64::default(),
            retries: AtomicU64::default(),
            unknown: AtomicU64::default(),
            acked: Mutex::default(),
            errors: Mutex::default(),
        });
        let threads = (0..o.clients)
            .map(|t| {
                let (dir, o, stop, sh) =
                    (dir.to_path_buf(), o.clone(), stop.clone(), shared.clone());
                std::thread::spawn(move || client(&dir, &o, seed, t, &stop, &sh))
            })
            .collect();
        Mix {
            stop,
            shared,
            threads,
            t0: Instant::now(),
        }
    }

    /// Transactions acknowledged so far (all kinds), for progress.
    pub fn committed(&self) -> u64 {
        self.shared
            .committed
            .lock()
            .map(|m| m.values().sum())
            .unwrap_or(0)
    }

    /// Stops the clients (each finishes its transaction) and returns the report and the
    /// acknowledged ids.
    pub fn finish(self) -> (MixReport, Vec<(usize, String)>) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads {
            let _ = t.join();
        }
        let secs = self.t0.elapsed().as_secs_f64().max(1e-3);
        let sh = &self.shared;
        let committed = sh.committed.lock().map(|m| m.clone()).unwrap_or_default();
        let acked = sh.acked.lock().map(|a| a.clone()).unwrap_or_default();
        let new_orders = committed.get("new_order").copied().unwrap_or(0);
        let report = MixReport {
            acked_per_s: acked.len() as f64 / secs,
            new_orders_per_min: new_orders as f64 * 60.0 / secs,
            committed,
            rollbacks: sh.rollbacks.load(Ordering::Relaxed),
            retries: sh.retries.load(Ordering::Relaxed),
            unknown: sh.unknown.load(Ordering::Relaxed),
            seconds: secs,
            errors: sh.errors.lock().map(|e| e.clone()).unwrap_or_default(),
        };
        (report, acked)
    }
}

/// One client thread: transactions one after the other, each on its warehouse's master.
fn client(dir: &Path, o: &TpccOpts, seed: u64, t: usize, stop: &AtomicBool, sh: &Shared) {
    let mut r = Rng::new(seed ^ (t as u64).wrapping_mul(0x2545_F491_4F6C_DD1D));
    let mut kv = None;
    let mut conns: HashMap<usize, redis::Connection> = HashMap::new();
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let kind = Kind::from_draw(r.next_u64());
        let w = (r.next_u64() % o.warehouses.max(1) as u64) as usize;
        n += 1;
        let txn = format!("{}:{seed:x}:{t}:{n}", kind.letter());
        let a = args(kind, &txn, o, &mut r);
        let started = Instant::now();
        loop {
            if kv.is_none() {
                kv = Kv::open(dir).ok();
            }
            let Some(k) = kv.as_ref() else {
                if started.elapsed() > RETRY_FOR || stop.load(Ordering::Relaxed) {
                    if kind.writes() {
                        sh.unknown.fetch_add(1, Ordering::Relaxed);
                    }
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
                continue;
            };
            let parts = k.state.partitions;
            match call(k, &mut conns, w % parts, kind, &warehouse_key(w, parts), &a) {
                Ok(()) => {
                    if let Ok(mut m) = sh.committed.lock() {
                        *m.entry(kind.name()).or_default() += 1;
                    }
                    if kind.writes() {
                        if let Ok(mut v) = sh.acked.lock() {
                            v.push((w, txn.clone()));
                        }
                    }
                    break;
                }
                Err(e) if e.starts_with("ROLLBACK") => {
                    sh.rollbacks.fetch_add(1, Ordering::Relaxed);
                    break;
                }
                Err(e) => {
                    // Re-read the placement (a move may have changed the master) and retry
                    // the same id.
                    conns.remove(&(w % parts));
                    kv = None;
                    if let Ok(mut v) = sh.errors.lock() {
                        // The first 4 and the last 4.
                        if v.len() == 8 {
                            v.remove(4);
                        }
                        let at = sh.t0.elapsed().as_secs_f64();
                        v.push(format!(
                            "{at:.1} s: {}",
                            e.chars().take(160).collect::<String>()
                        ));
                    }
                    if started.elapsed() > RETRY_FOR || stop.load(Ordering::Relaxed) {
                        if kind.writes() {
                            sh.unknown.fetch_add(1, Ordering::Relaxed);
                        }
                        break;
                    }
                    sh.retries.fetch_add(1, Ordering::Relaxed);
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
    }
}

/// One call on partition `p`'s master; writing transactions then `WAIT k`. `Err` with the
/// server's message (a rollback starts with `ROLLBACK`).
fn call(
    kv: &Kv,
    conns: &mut HashMap<usize, redis::Connection>,
    p: usize,
    kind: Kind,
    key: &str,
    args: &[String],
) -> Result<(), String> {
    let c = match conns.entry(p) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(e) => e.insert(kv.connect(&kv.master_of(p)?)?),
    };
    let fcall = if kind.writes() { "FCALL" } else { "FCALL_RO" };
    redis::cmd(fcall)
        .arg(kind.name())
        .arg(1)
        .arg(key)
        .arg(args)
        .query::<redis::Value>(c)
        .map_err(|e| match e.code() {
            // A server error: its code (the first word, `ROLLBACK` for a refused order), then
            // what it said.
            Some(code) => format!("{code} {}", e.detail().unwrap_or_default()),
            None => e.to_string(),
        })?;
    if kind.writes() {
        let n: usize = redis::cmd("WAIT")
            .arg(kv.state.k)
            .arg(1000)
            .query(c)
            .map_err(|e| e.to_string())?;
        if n < kv.state.k {
            return Err(format!("WAIT: {n} of {} replicas", kv.state.k));
        }
    }
    Ok(())
}

/// The consistency check of every warehouse (see the module doc).
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct CheckReport {
    pub warehouses: usize,
    /// Ids the functions recorded (every writing transaction applied, acknowledged or not).
    pub recorded: u64,
    /// Acknowledged ids not recorded.
    pub lost: u64,
    /// Consistency conditions violated, by warehouse.
    pub violations: Vec<String>,
}

pub fn check(kv: &Kv, o: &TpccOpts, acked: &[(usize, String)]) -> Result<CheckReport, String> {
    let parts = kv.state.partitions;
    let mut rep = CheckReport {
        warehouses: o.warehouses,
        ..Default::default()
    };
    let mut by_w: BTreeMap<usize, Vec<&str>> = BTreeMap::new();
    for (w, id) in acked {
        by_w.entry(*w).or_default().push(id);
    }
    for w in 0..o.warehouses {
        let key = warehouse_key(w, parts);
        let m = kv.master_of(w % parts)?;
        let mut c = kv.connect(&m)?;
        let (bad, _paid): (Vec<String>, i64) = redis::cmd("FCALL_RO")
            .arg("tpcc_check")
            .arg(1)
            .arg(&key)
            .query(&mut c)
            .map_err(|e| format!("warehouse {w}: tpcc_check: {e}"))?;
        rep.violations
            .extend(bad.into_iter().map(|b| format!("warehouse {w}: {b}")));
        let recorded: BTreeSet<String> = redis::cmd("SMEMBERS")
            .arg(format!("{key}:txns"))
            .query(&mut c)
            .map_err(|e| format!("warehouse {w}: SMEMBERS: {e}"))?;
        rep.recorded += recorded.len() as u64;
        for id in by_w.get(&w).map(Vec::as_slice).unwrap_or_default() {
            if !recorded.contains(*id) {
                rep.lost += 1;
            }
        }
    }
    Ok(rep)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mix_is_tpccs() {
        let mut n: BTreeMap<Kind, u64> = BTreeMap::new();
        for d in 0..100 {
            *n.entry(Kind::from_draw(d)).or_default() += 1;
        }
        assert_eq!(n[&Kind::NewOrder], 45);
        assert_eq!(n[&Kind::Payment], 43);
        assert_eq!(n[&Kind::OrderStatus], 4);
        assert_eq!(n[&Kind::Delivery], 4);
        assert_eq!(n[&Kind::StockLevel], 4);
    }

    #[test]
    fn warehouses_land_on_their_partition_and_orders_are_well_formed() {
        for w in 0..20 {
            let k = warehouse_key(w, 8);
            assert_eq!(slots::partition_of(slots::key_slot(k.as_bytes()), 8), w % 8);
        }
        let o = TpccOpts::default();
        let mut r = Rng::new(7);
        let mut rollbacks = 0;
        for _ in 0..2000 {
            let a = args(Kind::NewOrder, "n:1", &o, &mut r);
            let lines: usize = a[3].parse().unwrap();
            assert!((5..=15).contains(&lines));
            assert_eq!(a.len(), 4 + 2 * lines);
            let items: Vec<usize> = a[4..]
                .iter()
                .step_by(2)
                .map(|x| x.parse().unwrap())
                .collect();
            // Only the last item of an order can be the invalid 0.
            assert!(items[..lines - 1]
                .iter()
                .all(|&i| (1..=o.items).contains(&i)));
            rollbacks += usize::from(items[lines - 1] == 0);
        }
        assert!(
            (5..=40).contains(&rollbacks),
            "{rollbacks} rollbacks in 2000"
        );
        assert_eq!(args(Kind::Payment, "p:1", &o, &mut r)[0], "p:1");
        assert!(LIBRARY.starts_with("#!lua name=pliant_tpcc\n"));
    }
}
