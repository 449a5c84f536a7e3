//! Checkpoint -> ack round trip over the replication channel (unix socket, or loopback TCP
//! with `tcp` as second argument; both ends in this process, each on its own threads as in
//! the runtime; frames authenticated, and encrypted over TCP). This is the latency every held packet
//! of a protected group pays at least once (output commit), so it must stay far below the
//! checkpoint period at 10 kHz (100 us).
//!
//! Each iteration modifies every flow of the checkpoint in a real `FlowTable`, snapshots it,
//! encodes an XOR+RLE delta against the last shipped record (as the runtime does), then times
//! `send` -> ack seen through the wake fd + `poll`, the way the packet thread sees it.
//!
//! Run: `cargo run --release -p pliant-ha --example repl_rtt [iterations] [unix|tcp]`
//! Prints one JSON object per checkpoint size.

use pliant_ha::delta;
use pliant_ha::{
    Ack, Checkpoint, FlowUpdate, LinkState, ReplSender, ReplServer, SenderOptions, StandbyStore,
    UpdateBody,
};
use pliant_state::{FlowKey, FlowTable, TableConfig};
use serde::{Deserialize, Serialize};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Serialize, Deserialize)]
struct NatLike {
    packets: u64,
    bytes: u64,
    tcp_seq: u32,
    ext_port: u16,
    state: u8,
}

fn key(i: u16) -> FlowKey {
    FlowKey::v4(6, [10, 0, 0, 1].into(), 1024 + i, [10, 0, 1, 1].into(), 80).0
}

/// Blocks on the wake fd until `group` is acked at `seq` (or 2 s pass).
fn wait_ack(s: &ReplSender, group: u32, seq: u64, acks: &mut Vec<Ack>) -> Result<(), String> {
    let end = Instant::now() + Duration::from_secs(2);
    loop {
        s.drain_wake();
        acks.clear();
        let st = s.poll(acks);
        if acks.iter().any(|a| a.group == group && a.seq >= seq) {
            return Ok(());
        }
        if let LinkState::Dead { reason } = st {
            return Err(reason);
        }
        if Instant::now() > end {
            return Err(format!("no ack for ({group}, {seq}) within 2 s"));
        }
        let mut p = libc::pollfd {
            fd: s.wake_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        unsafe { libc::poll(&mut p, 1, 100) };
    }
}

fn pct(sorted: &[u64], p: f64) -> u64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn run(sender: &ReplSender, group: u32, flows: u16, iters: usize) -> Result<String, String> {
    let now = Instant::now();
    let mut t: FlowTable<NatLike> = FlowTable::new(TableConfig::default());
    let mut last: Vec<(u64, Vec<u8>)> = Vec::new();
    let mut first = Vec::new();
    for i in 0..flows {
        let st = NatLike {
            packets: 0,
            bytes: 0,
            tcp_seq: 1000,
            ext_port: 40000 + i,
            state: 1,
        };
        t.create_flow(key(i), st).map_err(|e| e.to_string())?;
        t.flow_timer(&key(i), Duration::from_secs(60), 0, now)
            .map_err(|e| e.to_string())?;
        let rec = t.snapshot_flow(&key(i), now).map_err(|e| e.to_string())?;
        first.push(FlowUpdate {
            key: key(i),
            version: 0,
            body: UpdateBody::Full(rec.clone()),
        });
        last.push((0, rec));
    }
    let mut acks = Vec::new();
    let send = |cp: Checkpoint| sender.send(cp).map_err(|e| e.to_string());
    send(Checkpoint {
        group,
        seq: 1,
        full: true,
        flows: first,
        shared: None,
    })?;
    wait_ack(sender, group, 1, &mut acks)?;
    let warmup = iters / 10;
    let mut rtt_us = Vec::with_capacity(iters);
    let mut cp_bytes = 0usize;
    for n in 0..(warmup + iters) {
        let seq = 2 + n as u64;
        let mut updates = Vec::with_capacity(usize::from(flows));
        for i in 0..flows {
            let r = t.get_flow(&key(i)).map_err(|e| e.to_string())?;
            let s = t.state_mut(&r);
            s.packets += 1;
            s.bytes += 1448;
            s.tcp_seq = s.tcp_seq.wrapping_add(1448);
            t.put_flow(r, true);
            let v = t.version(&key(i)).unwrap_or(0);
            let rec = t.snapshot_flow(&key(i), now).map_err(|e| e.to_string())?;
            let (base_v, base) = &last[usize::from(i)];
            let d = delta::encode(base, &rec);
            cp_bytes += d.len();
            updates.push(FlowUpdate {
                key: key(i),
                version: v,
                body: UpdateBody::Delta {
                    base_version: *base_v,
                    bytes: d,
                },
            });
            last[usize::from(i)] = (v, rec);
        }
        let cp = Checkpoint {
            group,
            seq,
            full: false,
            flows: updates,
            shared: None,
        };
        let t0 = Instant::now();
        send(cp)?;
        wait_ack(sender, group, seq, &mut acks)?;
        let us = t0.elapsed().as_micros() as u64;
        if n >= warmup {
            rtt_us.push(us);
        }
    }
    rtt_us.sort_unstable();
    let total = warmup + iters;
    Ok(format!(
        "{{\"flows\":{flows},\"iterations\":{iters},\"rtt_us_p50\":{},\"rtt_us_p90\":{},\
         \"rtt_us_p99\":{},\"rtt_us_max\":{},\"delta_bytes_per_checkpoint\":{}}}",
        pct(&rtt_us, 0.5),
        pct(&rtt_us, 0.9),
        pct(&rtt_us, 0.99),
        rtt_us.last().copied().unwrap_or(0),
        cp_bytes / total,
    ))
}

fn main() {
    let iters: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(5000)
        .max(10);
    let dir = std::env::temp_dir().join(format!("pliant-repl-rtt-{}", std::process::id()));
    if let Err(e) = std::fs::create_dir(&dir) {
        eprintln!("cannot create {}: {e}", dir.display());
        std::process::exit(1);
    }
    let code = (|| -> Result<(), String> {
        let ca = pliant_wire::Ca::generate(None).map_err(|e| e.to_string())?;
        let id = |n: &str| -> Result<pliant_wire::Security, String> {
            let i = ca
                .issue(n, pliant_wire::role::REPLICA, 3600)
                .map_err(|e| e.to_string())?;
            Ok(pliant_wire::Security::new(i))
        };
        let store = Arc::new(Mutex::new(StandbyStore::new(1 << 20)));
        let ep = if std::env::args().nth(2).as_deref() == Some("tcp") {
            "127.0.0.1:0".parse().map_err(|e| format!("{e}"))?
        } else {
            pliant_wire::Endpoint::Unix(dir.join("backup.repl.sock"))
        };
        let server = ReplServer::start(&ep, id("b")?, store).map_err(|e| e.to_string())?;
        let path = server.endpoint().clone();
        let opts = SenderOptions {
            // Generous, so a descheduled thread on a busy machine is measured, not fatal.
            dead_after: Duration::from_secs(1),
            ..SenderOptions::default()
        };
        let sender = ReplSender::start(&path, id("r1")?, "b", "r1", 1, opts);
        for (group, flows) in [(1u32, 1u16), (2, 100)] {
            println!("{}", run(&sender, group, flows, iters)?);
        }
        let st = sender.stats();
        eprintln!(
            "sender: {} checkpoints ({} written by the caller, {} of them in part), {} bytes, \
             {} heartbeats, rtt_us_max {}",
            st.checkpoints,
            st.checkpoints_direct,
            st.direct_backlogged,
            st.bytes_sent,
            st.heartbeats,
            st.rtt_us_max
        );
        Ok(())
    })();
    let _ = std::fs::remove_dir_all(&dir);
    if let Err(e) = code {
        eprintln!("repl_rtt: {e}");
        std::process::exit(1);
    }
}
