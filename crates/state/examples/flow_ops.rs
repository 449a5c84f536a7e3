//! Rough cost of the per-packet state calls (not a test: no thresholds). Prints one JSON line.
//! Run: `cargo run --release -p pliant-state --example flow_ops [flows] [ops]`.

use pliant_state::key::proto;
use pliant_state::{FlowKey, FlowTable, TableConfig};
use std::hint::black_box;
use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

#[derive(serde::Serialize, serde::Deserialize, Default)]
struct Nat {
    port: u16,
    packets: u64,
    bytes: u64,
}

fn key(i: u32) -> FlowKey {
    let c = Ipv4Addr::from(0x0a00_0000 | (i >> 16));
    FlowKey::v4(proto::UDP, c, i as u16, Ipv4Addr::new(10, 9, 0, 1), 53).0
}

fn main() {
    let mut args = std::env::args().skip(1);
    let flows: u32 = args.next().and_then(|a| a.parse().ok()).unwrap_or(100_000);
    let ops: u32 = args
        .next()
        .and_then(|a| a.parse().ok())
        .unwrap_or(5_000_000);
    let mut t: FlowTable<Nat> = FlowTable::new(TableConfig::default());
    let now = Instant::now();
    let start = Instant::now();
    for i in 0..flows {
        t.create_flow(key(i), Nat::default()).expect("create");
        t.flow_timer(&key(i), Duration::from_secs(30), 0, now)
            .expect("timer");
    }
    let create_ns = start.elapsed().as_nanos() as f64 / flows as f64;

    // Walk the flows with a stride so consecutive lookups do not share cache lines.
    let keys: Vec<FlowKey> = (0..flows).map(key).collect();
    let start = Instant::now();
    let mut j = 0usize;
    for _ in 0..ops {
        j = (j + 7919) % keys.len();
        let r = t.get_flow(&keys[j]).expect("get");
        let s = t.state_mut(&r);
        s.packets += 1;
        s.bytes += 64;
        t.put_flow(r, true);
    }
    let get_put_ns = start.elapsed().as_nanos() as f64 / ops as f64;

    let start = Instant::now();
    for _ in 0..ops / 10 {
        j = (j + 7919) % keys.len();
        t.flow_timer(&keys[j], Duration::from_secs(30), 0, now)
            .expect("rearm");
    }
    let rearm_ns = start.elapsed().as_nanos() as f64 / (ops / 10) as f64;

    let start = Instant::now();
    let mut out = Vec::new();
    t.expired_timers(now + Duration::from_secs(31), &mut out);
    let expire_ns = start.elapsed().as_nanos() as f64 / out.len().max(1) as f64;

    let mut dst: FlowTable<Nat> = FlowTable::new(TableConfig::default());
    let n = flows.min(10_000);
    let start = Instant::now();
    for k in keys.iter().take(n as usize) {
        let b = t.export_flow(k, now).expect("export");
        dst.import_flow(&b, now).expect("import");
    }
    let migrate_ns = start.elapsed().as_nanos() as f64 / n as f64;
    black_box(&dst);
    println!(
        "{{\"flows\":{flows},\"create_ns\":{create_ns:.1},\"get_put_ns\":{get_put_ns:.1},\
\"rearm_ns\":{rearm_ns:.1},\"expire_ns_per_timer\":{expire_ns:.1},\"export_import_ns\":{migrate_ns:.1}}}"
    );
}
