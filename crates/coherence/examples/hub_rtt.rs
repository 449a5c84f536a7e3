//! Round-trip latency of the coherence hub over a real socket, as the packet thread sees it.
//!
//! `cargo run --release -p pliant-coherence --example hub_rtt [iterations] [unix|tcp]`
//!
//! Every frame is sealed (pliant-wire session: authenticated on a unix socket, encrypted over
//! TCP), so the numbers include that cost. Identities come from a CA made in memory.
//!
//! Runs a hub in this process (its own threads, a real socket) and one client, and times each
//! call end to end: `publish` (PUSH of an 8-byte counter), `fetch_others` (PULL with two other
//! contributors), `lock`+`unlock`, and whole `SharedStore` transactions (a PULL read, and a
//! SYNCH get+put = lock, fetch_latest, publish_latest, unlock). Prints one JSON object per line.

use pliant_coherence::{ClientOptions, HubClient, HubConfig, HubServer};
use pliant_state::{Coherence, GetFlags, LockService, PutFlags, SharedConfig, SharedStore};
use pliant_wire::{role, Ca, Endpoint, Security};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn percentile(sorted: &[u64], p: f64) -> u64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn report(name: &str, mut ns: Vec<u64>) {
    ns.sort_unstable();
    println!(
        "{{\"op\":\"{name}\",\"n\":{},\"p50_us\":{:.1},\"p99_us\":{:.1},\"max_us\":{:.1}}}",
        ns.len(),
        percentile(&ns, 0.50) as f64 / 1000.0,
        percentile(&ns, 0.99) as f64 / 1000.0,
        ns[ns.len() - 1] as f64 / 1000.0,
    );
}

fn time<F: FnMut()>(n: usize, mut f: F) -> Vec<u64> {
    // Warm-up: connection, allocator, caches.
    for _ in 0..n / 10 {
        f();
    }
    (0..n)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_nanos() as u64
        })
        .collect()
}

fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(20_000);
    let tcp = std::env::args().nth(2).as_deref() == Some("tcp");
    let dir = std::env::temp_dir().join(format!("pliant-hub-rtt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let ep = if tcp {
        "127.0.0.1:0".parse().expect("endpoint")
    } else {
        Endpoint::Unix(dir.join("hub.sock"))
    };
    let ca = Ca::generate(None).expect("CA");
    let sec = |name: &str, roles| Security::new(ca.issue(name, roles, 3600).expect("identity"));
    let srv = HubServer::start(&ep, sec("hub", role::SERVICE), HubConfig::default()).expect("hub");
    let ep = srv.endpoint().clone();
    // Decimal names: replica "1" is id 1.
    let client = |r: u32| {
        Arc::new(HubClient::new(
            &ep,
            sec(&r.to_string(), role::REPLICA),
            ClientOptions::default(),
        ))
    };
    let c = client(1);
    for other in [2, 3] {
        client(other)
            .publish("pkts", other, &5u64.to_le_bytes())
            .expect("publish");
    }
    let v = 42u64.to_le_bytes();
    report(
        "publish",
        time(n, || c.publish("pkts", 1, &v).expect("publish")),
    );
    let mut out = Vec::with_capacity(4);
    report(
        "fetch_others",
        time(n, || {
            out.clear();
            c.fetch_others("pkts", 1, &mut out).expect("fetch");
        }),
    );
    report(
        "lock_unlock",
        time(n, || {
            let t = c
                .lock("cfg", 1, Duration::from_secs(1), Instant::now())
                .expect("lock");
            c.unlock("cfg", &t).expect("unlock");
        }),
    );
    let mut s = SharedStore::new(1, SharedConfig::default(), c.clone(), c.clone());
    s.create_counter("pkts").expect("create");
    s.create_shared("cfg", vec![0; 8], None).expect("create");
    report(
        "store_pull_read",
        time(n, || {
            s.counter_read("pkts", GetFlags::Pull).expect("pull");
        }),
    );
    report(
        "store_synch_get_put",
        time(n, || {
            s.set_now(Instant::now());
            let r = s.get_shared("cfg", GetFlags::Synch).expect("synch get");
            s.add_u64(&r, 1);
            s.put_shared(r, PutFlags::Synch).expect("synch put");
        }),
    );
    eprintln!("client: {:?}", c.stats());
    eprintln!("hub: {:?}", srv.stats());
    drop(srv);
    let _ = std::fs::remove_dir_all(&dir);
}
