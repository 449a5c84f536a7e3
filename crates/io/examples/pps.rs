//! pktgen-like packets-per-second probe for PacketPort (needs root).
//!
//! Creates two throw-away namespaces joined by a veth pair; one thread blasts fixed-size frames
//! through a PacketPort TX ring on one end, another counts them with a PacketPort RX ring on the
//! other end. Prints a human summary and, as the last line, one JSON object.
//!
//! ```text
//! cargo run --release -p pliant-io --example pps -- [--secs 5] [--size 64] [--rx v3|v2]
//!     [--batch 256] [--block-kb 1024] [--blocks 16] [--tmo-ms 1] [--tx-slots 4096]
//!     [--tx-batch 256] [--slot-bytes 2048 (v2)] [--tx ring|mmsg] [--no-bypass] [--drain FRAMES]
//! ```
//! On veth the sender's kick runs the receive path too (veth delivers in the sender's context),
//! so the sender core carries most of the kernel work; the receiver core only drains the ring.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pliant_io::testlab::Lab;
use pliant_io::{FramePort, PacketPort, PortOptions, RxRing, TxMode};

struct Args {
    secs: f64,
    size: usize,
    rx_v2: bool,
    batch: usize,
    block_kb: u32,
    blocks: u32,
    tmo_ms: u32,
    tx_slots: u32,
    tx_batch: usize,
    bypass: bool,
    mmsg: bool,
    slot_bytes: u32,
    /// Drain mode: send this many frames first, then time only the receiver emptying its ring.
    drain: u64,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        secs: 5.0,
        size: 64,
        rx_v2: false,
        batch: 256,
        block_kb: 1024,
        blocks: 16,
        tmo_ms: 1,
        tx_slots: 4096,
        tx_batch: 256,
        bypass: true,
        mmsg: false,
        slot_bytes: 2048,
        drain: 0,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut val = || it.next().ok_or(format!("{k} needs a value"));
        let num = |v: String| v.parse::<f64>().map_err(|e| format!("{k}: {e}"));
        match k.as_str() {
            "--secs" => a.secs = num(val()?)?,
            "--size" => a.size = num(val()?)? as usize,
            "--rx" => a.rx_v2 = val()? == "v2",
            "--batch" => a.batch = num(val()?)? as usize,
            "--block-kb" => a.block_kb = num(val()?)? as u32,
            "--blocks" => a.blocks = num(val()?)? as u32,
            "--tmo-ms" => a.tmo_ms = num(val()?)? as u32,
            "--tx-slots" => a.tx_slots = num(val()?)? as u32,
            "--tx-batch" => a.tx_batch = num(val()?)? as usize,
            "--no-bypass" => a.bypass = false,
            "--slot-bytes" => a.slot_bytes = num(val()?)? as u32,
            "--tx" => a.mmsg = val()? == "mmsg",
            "--drain" => a.drain = num(val()?)? as u64,
            "-h" | "--help" => return Err("see the doc comment of examples/pps.rs".into()),
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if !(14..=1514).contains(&a.size) {
        return Err("--size must be 14..=1514".into());
    }
    Ok(a)
}

fn pin(cpu: usize) {
    // SAFETY: cpu_set_t is plain data; sched_setaffinity(0) affects the calling thread only.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

fn thread_cpu_secs() -> f64 {
    // SAFETY: timespec is plain data.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointer; the per-thread CPU clock is precise (unlike getrusage ticks).
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

fn main() {
    let a = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("pps: {e}");
            std::process::exit(2);
        }
    };
    if !pliant_testkit::is_root() {
        eprintln!("pps: needs root (creates network namespaces)");
        std::process::exit(2);
    }
    let ncpu = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut lab = Lab::new();
    let ns_a = lab.add_ns("ppsa").expect("netns");
    let ns_b = lab.add_ns("ppsb").expect("netns");
    let (if_a, if_b) = (format!("ppa{}", lab.tag()), format!("ppb{}", lab.tag()));
    lab.add_veth(&ns_a, &if_a, &ns_b, &if_b).expect("veth");
    let rx = if a.rx_v2 {
        RxRing::V2 {
            frame_bytes: a.slot_bytes,
            frame_count: (u64::from(a.blocks) * u64::from(a.block_kb) * 1024
                / u64::from(a.slot_bytes.max(1))) as u32,
        }
    } else {
        RxRing::V3 {
            block_bytes: a.block_kb * 1024,
            block_count: a.blocks,
            block_timeout_ms: a.tmo_ms,
        }
    };
    let opts = PortOptions {
        rx,
        tx_frame_count: a.tx_slots,
        qdisc_bypass: a.bypass,
        tx_mode: if a.mmsg {
            TxMode::Sendmmsg
        } else {
            TxMode::Ring
        },
        ..PortOptions::default()
    };
    let mut txp = lab
        .in_ns(&ns_a, || PacketPort::open(&if_a, &opts))
        .expect("ns")
        .expect("open tx");
    let mut rxp = lab
        .in_ns(&ns_b, || PacketPort::open(&if_b, &opts))
        .expect("ns")
        .expect("open rx");

    if a.drain > 0 {
        drain_mode(&a, txp, rxp);
        return;
    }
    let stop = Arc::new(AtomicBool::new(false));
    let stop_rx = stop.clone();
    let batch = a.batch;
    let receiver = std::thread::spawn(move || {
        pin(1 % ncpu);
        let mut count = 0u64;
        let mut bytes = 0u64;
        let start = Instant::now();
        let mut last = start;
        let mut empty_polls = 0u64;
        while !stop_rx.load(Ordering::Relaxed) {
            let n = rxp
                .recv_batch(batch, &mut |f| {
                    count += 1;
                    bytes += f.len() as u64;
                })
                .expect("recv");
            if n == 0 {
                empty_polls += 1;
            } else {
                last = Instant::now();
            }
        }
        // Drain what is left (blocks retire within the timeout).
        let drain_until = Instant::now() + Duration::from_millis(50);
        while Instant::now() < drain_until {
            rxp.recv_batch(batch, &mut |_| count += 1).expect("recv");
        }
        let active = last.duration_since(start).as_secs_f64();
        (
            count,
            bytes,
            active,
            empty_polls,
            thread_cpu_secs(),
            rxp.stats(),
        )
    });
    let size = a.size;
    let tx_batch = a.tx_batch;
    let secs = a.secs;
    let sender = std::thread::spawn(move || {
        pin(0);
        let mut f = vec![0u8; size];
        f[..6].copy_from_slice(&[0xff; 6]);
        f[6..12].copy_from_slice(&txp.mac());
        f[12..14].copy_from_slice(&0x88b5u16.to_be_bytes());
        let start = Instant::now();
        let mut sent = 0u64;
        let mut seq = 0u32;
        while start.elapsed().as_secs_f64() < secs {
            for _ in 0..tx_batch {
                if size >= 18 {
                    f[14..18].copy_from_slice(&seq.to_be_bytes());
                }
                match txp.send(&f) {
                    Ok(()) => {
                        sent += 1;
                        seq = seq.wrapping_add(1);
                    }
                    Err(_) => break,
                }
            }
            txp.flush().expect("flush");
        }
        let el = start.elapsed().as_secs_f64();
        (sent, el, thread_cpu_secs(), txp.stats())
    });
    let (sent, tx_secs, tx_cpu, tx_stats) = sender.join().expect("sender");
    stop.store(true, Ordering::Relaxed);
    let (rcvd, _bytes, rx_active, empty, rx_cpu, rx_stats) = receiver.join().expect("receiver");
    let tx_mpps = sent as f64 / tx_secs / 1e6;
    let rx_mpps = rcvd as f64 / tx_secs / 1e6;
    println!(
        "size {}B rx {:?} batch {}: sent {} ({:.3} Mpps, sender cpu {:.2}s), received {} ({:.3} Mpps, \
         receiver cpu {:.2}s, last frame at {:.2}s, {} empty polls), kernel rx drops {}, \
         tx ring full {}, kick retries {}",
        size,
        if a.rx_v2 { "v2" } else { "v3" },
        batch,
        sent,
        tx_mpps,
        tx_cpu,
        rcvd,
        rx_mpps,
        rx_cpu,
        rx_active,
        empty,
        rx_stats.rx_kernel_drops,
        tx_stats.tx_dropped_full,
        tx_stats.tx_kick_retries
    );
    println!(
        "{{\"frame_bytes\":{},\"tx\":\"{}\",\"rx_ring\":\"{}\",\"seconds\":{:.3},\"tx_frames\":{},\"rx_frames\":{},\
         \"tx_mpps\":{:.4},\"rx_mpps\":{:.4},\"rx_kernel_drops\":{},\"tx_ring_full\":{},\
         \"sender_cpu_s\":{:.3},\"receiver_cpu_s\":{:.3}}}",
        size,
        if a.mmsg { "mmsg" } else { "ring" },
        if a.rx_v2 { "v2" } else { "v3" },
        tx_secs,
        sent,
        rcvd,
        tx_mpps,
        rx_mpps,
        rx_stats.rx_kernel_drops,
        tx_stats.tx_dropped_full,
        tx_cpu,
        rx_cpu
    );
}

/// Sends `a.drain` frames while nobody reads, then measures how fast one core empties the ring:
/// the user-space cost per received frame, free of the sender's and the kernel's share.
fn drain_mode(a: &Args, mut txp: PacketPort, mut rxp: PacketPort) {
    let mut f = vec![0u8; a.size];
    f[..6].copy_from_slice(&[0xff; 6]);
    f[6..12].copy_from_slice(&txp.mac());
    f[12..14].copy_from_slice(&0x88b5u16.to_be_bytes());
    let mut sent = 0u64;
    while sent < a.drain {
        match txp.send(&f) {
            Ok(()) => sent += 1,
            Err(_) => txp.flush().expect("flush"),
        }
    }
    txp.flush().expect("flush");
    // Let the last V3 block retire.
    std::thread::sleep(Duration::from_millis(20));
    pin(1 % std::thread::available_parallelism().map_or(1, |n| n.get()));
    let cpu0 = thread_cpu_secs();
    let start = Instant::now();
    let mut count = 0u64;
    let mut sum = 0u64;
    loop {
        let n = rxp
            .recv_batch(a.batch, &mut |fr| {
                count += 1;
                // Touch the frame like a parser would (first cache line).
                sum = sum.wrapping_add(u64::from(fr[13]) + u64::from(fr[fr.len() - 1]));
            })
            .expect("recv");
        if n == 0 {
            break;
        }
    }
    let el = start.elapsed().as_secs_f64();
    let cpu = thread_cpu_secs() - cpu0;
    let st = rxp.stats();
    println!(
        "drain: {} of {} frames read in {:.4}s wall / {:.4}s cpu = {:.2} Mpps per core (ring reading only), kernel drops {} (checksum {})",
        count, sent, el, cpu, count as f64 / cpu.max(1e-9) / 1e6, st.rx_kernel_drops, sum
    );
    println!(
        "{{\"mode\":\"drain\",\"frame_bytes\":{},\"rx_ring\":\"{}\",\"frames\":{},\"wall_s\":{:.5},\"cpu_s\":{:.5},\"rx_mpps_per_core\":{:.3},\"rx_kernel_drops\":{}}}",
        a.size,
        if a.rx_v2 { "v2" } else { "v3" },
        count,
        el,
        cpu,
        count as f64 / cpu.max(1e-9) / 1e6,
        st.rx_kernel_drops
    );
}
