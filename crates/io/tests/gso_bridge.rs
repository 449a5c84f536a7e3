//! Experiment and regression test: TCP through a user-space bridge made of two PacketPorts
//! (client ns -- veth -- bridge ns -- veth -- server ns). Needs root.
//!
//! With `vnet_hdr`, GSO super-frames and partial checksums must pass through as one unit and the
//! transfer must complete intact. Without it, the bridge must see frames above the MTU (and
//! partial checksums) that it cannot forward: this documents why the runtime needs vnet_hdr (or
//! offloads disabled) for Gbps.

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pliant_io::testlab::Lab;
use pliant_io::{FramePort, Offload, PacketPort, PortOptions, PortStats, RxRing};

struct Net {
    lab: Lab,
    ns_c: String,
    ns_s: String,
}

/// Measurement knob: PLIANT_IO_RX=v2 selects the low-latency V2 ring; PLIANT_IO_TMO_MS sets the
/// V3 block timeout.
fn rx_ring_from_env() -> RxRing {
    if std::env::var("PLIANT_IO_RX").as_deref() == Ok("v2") {
        // 64 KiB slots so GSO super-frames fit.
        return RxRing::V2 {
            frame_bytes: 65_536 + 256,
            frame_count: 256,
        };
    }
    let tmo = std::env::var("PLIANT_IO_TMO_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    RxRing::V3 {
        block_bytes: 1 << 20,
        block_count: 16,
        block_timeout_ms: tmo,
    }
}

fn topo(vnet_hdr: bool) -> (Net, PacketPort, PacketPort) {
    let mut lab = Lab::new();
    let ns_c = lab.add_ns("c").unwrap();
    let ns_m = lab.add_ns("m").unwrap();
    let ns_s = lab.add_ns("s").unwrap();
    let t = lab.tag().to_string();
    let (c0, mi, mo, s0) = (
        format!("pc{t}"),
        format!("pmi{t}"),
        format!("pmo{t}"),
        format!("ps{t}"),
    );
    lab.add_veth(&ns_c, &c0, &ns_m, &mi).unwrap();
    lab.add_veth(&ns_m, &mo, &ns_s, &s0).unwrap();
    lab.exec(&ns_c, &["ip", "addr", "add", "10.77.0.1/24", "dev", &c0])
        .unwrap();
    lab.exec(&ns_s, &["ip", "addr", "add", "10.77.0.2/24", "dev", &s0])
        .unwrap();
    let opts = PortOptions {
        vnet_hdr,
        rx: rx_ring_from_env(),
        // Measurement knob: PLIANT_IO_TX_SLOT=65664 puts GSO frames through the TX ring too.
        tx_frame_bytes: std::env::var("PLIANT_IO_TX_SLOT")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(2048),
        tx_frame_count: 1024,
        ..PortOptions::default()
    };
    let inside = lab
        .in_ns(&ns_m, || PacketPort::open(&mi, &opts))
        .unwrap()
        .unwrap();
    let outside = lab
        .in_ns(&ns_m, || PacketPort::open(&mo, &opts))
        .unwrap()
        .unwrap();
    (Net { lab, ns_c, ns_s }, inside, outside)
}

fn forward(from: &mut PacketPort, to: &mut PacketPort, buf: &mut Vec<(Vec<u8>, Offload)>) -> usize {
    buf.clear();
    let offloads = from.offloads_enabled();
    from.recv_batch_meta(64, &mut |f, m| {
        if let Some(c) = m.offload.csum_partial {
            check_partial_convention(f, c.start.into(), c.offset.into(), m.offload.gso.is_some());
        }
        let mut f = f.to_vec();
        if !offloads && m.csum_not_ready {
            // Without vnet_hdr the port cannot hand the partial checksum on: finish it here.
            complete_l4_csum_ipv4(&mut f);
        }
        buf.push((f, m.offload))
    })
    .unwrap();
    for (f, o) in buf.iter() {
        // Errors are counted in the port's stats; the test inspects them.
        let _ = to.send_offload(f, o);
    }
    to.flush().unwrap();
    buf.len()
}

static PARTIAL_OK: AtomicUsize = AtomicUsize::new(0);
static PARTIAL_GSO_OK: AtomicUsize = AtomicUsize::new(0);
static PARTIAL_BAD: AtomicUsize = AtomicUsize::new(0);

fn fold(mut sum: u32) -> u16 {
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    sum as u16
}

/// Checks the CHECKSUM_PARTIAL convention the README documents: for an IPv4 frame the L4
/// checksum field holds the folded, *not* complemented, pseudo-header sum (addresses, protocol,
/// L4 length — for a GSO super-frame the length of the whole super-frame's L4 part).
fn check_partial_convention(f: &[u8], start: usize, offset: usize, gso: bool) {
    if f.len() < 34 || f[12..14] != [0x08, 0x00] || start + offset + 2 > f.len() {
        return;
    }
    let total = usize::from(u16::from_be_bytes([f[16], f[17]]));
    let l4_len = (14 + total).saturating_sub(start) as u32;
    let mut sum = 0u32;
    for c in f[26..34].chunks(2) {
        sum += u32::from(u16::from_be_bytes([c[0], c[1]]));
    }
    sum += u32::from(f[23]) + l4_len;
    let field = u16::from_be_bytes([f[start + offset], f[start + offset + 1]]);
    if field == fold(sum) {
        if gso {
            PARTIAL_GSO_OK.fetch_add(1, Ordering::Relaxed);
        }
        PARTIAL_OK.fetch_add(1, Ordering::Relaxed);
    } else {
        PARTIAL_BAD.fetch_add(1, Ordering::Relaxed);
    }
}

/// Computes the full TCP/UDP checksum of an untagged Ethernet/IPv4 frame (test helper for the
/// no-offload bridge; the runtime has its own checksum code).
fn complete_l4_csum_ipv4(f: &mut [u8]) {
    if f.len() < 34 || f[12..14] != [0x08, 0x00] {
        return;
    }
    let ihl = usize::from(f[14] & 0x0f) * 4;
    let total = usize::from(u16::from_be_bytes([f[16], f[17]]));
    let l4 = 14 + ihl;
    let end = 14 + total;
    let field = match f[23] {
        6 => 16,
        17 => 6,
        _ => return,
    };
    if end > f.len() || l4 + field + 2 > end {
        return;
    }
    let mut sum: u32 = 0;
    let mut add = |b: &[u8]| {
        for c in b.chunks(2) {
            sum += u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]));
        }
    };
    add(&f[26..34]);
    add(&[0, f[23]]);
    add(&((end - l4) as u16).to_be_bytes());
    f[l4 + field] = 0;
    f[l4 + field + 1] = 0;
    add(&f[l4..end]);
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    let c = !(sum as u16);
    f[l4 + field..l4 + field + 2].copy_from_slice(&c.to_be_bytes());
}

/// Forwards frames both ways until `stop`; returns the two ports.
fn bridge(
    mut a: PacketPort,
    mut b: PacketPort,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<(PacketPort, PacketPort)> {
    std::thread::spawn(move || {
        let mut buf: Vec<(Vec<u8>, Offload)> = Vec::with_capacity(64);
        while !stop.load(Ordering::Relaxed) {
            let moved = forward(&mut a, &mut b, &mut buf) + forward(&mut b, &mut a, &mut buf);
            if moved == 0 {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        (a, b)
    })
}

/// Sends `total` bytes client -> server; returns (bytes received intact, seconds).
fn transfer(t: &Net, total: usize, limit: Duration) -> (usize, f64) {
    let listener = t
        .lab
        .in_ns(&t.ns_s, || TcpListener::bind("10.77.0.2:5201"))
        .unwrap()
        .unwrap();
    listener.set_nonblocking(true).unwrap();
    let pattern: Vec<u8> = (0..(1usize << 16) + 251).map(|i| (i % 251) as u8).collect();
    let server = std::thread::spawn(move || {
        // Bounded accept: without offloads the handshake itself may never get through.
        let deadline = Instant::now() + Duration::from_secs(8);
        let mut s = loop {
            match listener.accept() {
                Ok((s, _)) => break s,
                Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
                Err(_) => return (0, true),
            }
        };
        s.set_nonblocking(false).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let mut buf = vec![0u8; 1 << 16];
        let mut got = 0usize;
        let mut intact = true;
        loop {
            match s.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    let off = got % 251;
                    if buf[..n] != pattern[off..off + n] {
                        intact = false;
                    }
                    got += n;
                }
                Err(_) => break,
            }
        }
        (got, intact)
    });
    let start = Instant::now();
    let stream = t
        .lab
        .in_ns(&t.ns_c, || {
            TcpStream::connect_timeout(&"10.77.0.2:5201".parse().unwrap(), Duration::from_secs(5))
        })
        .unwrap();
    let mut sent = 0usize;
    if let Ok(mut c) = stream {
        c.set_write_timeout(Some(Duration::from_millis(500)))
            .unwrap();
        let chunk: Vec<u8> = (0..(1usize << 16) * 251).map(|i| (i % 251) as u8).collect();
        while sent < total && start.elapsed() < limit {
            let n = (total - sent).min(1 << 16);
            // Offsets in `chunk` keep the %251 pattern continuous.
            let off = sent % 251;
            match c.write(&chunk[off..off + n]) {
                Ok(w) => sent += w,
                Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::TimedOut => {}
                Err(_) => break,
            }
        }
        let _ = c.shutdown(std::net::Shutdown::Write);
    }
    let (got, intact) = server.join().unwrap();
    let secs = start.elapsed().as_secs_f64();
    assert!(intact, "payload corrupted through the bridge");
    (got, secs)
}

fn run(vnet_hdr: bool, total: usize, limit: Duration) -> (usize, f64, PortStats, PortStats) {
    let (net, inside, outside) = topo(vnet_hdr);
    let stop = Arc::new(AtomicBool::new(false));
    let h = bridge(inside, outside, stop.clone());
    // Round trip through the bridge (both directions cross two user-space hops).
    if let Ok(out) = net.lab.exec(
        &net.ns_c,
        &["ping", "-c", "20", "-i", "0.01", "-q", "10.77.0.2"],
    ) {
        eprintln!("ping through bridge: {}", out.lines().last().unwrap_or(""));
    }
    let (got, secs) = transfer(&net, total, limit);
    stop.store(true, Ordering::Relaxed);
    let (a, b) = h.join().unwrap();
    (got, secs, a.stats(), b.stats())
}

#[test]
fn tcp_passes_as_gso_superframes_with_vnet_hdr() {
    if !pliant_testkit::require_root() {
        return;
    }
    // Smaller in debug builds (the bridge copies every frame); release measures with 256 MiB.
    let total = if cfg!(debug_assertions) {
        64 << 20
    } else {
        256 << 20
    };
    let (got, secs, inside, outside) = run(true, total, Duration::from_secs(60));
    eprintln!(
        "vnet_hdr bridge: {} MiB in {:.2} s = {:.2} Gbit/s\ninside  {:?}\noutside {:?}",
        got >> 20,
        secs,
        got as f64 * 8.0 / secs / 1e9,
        inside,
        outside
    );
    assert_eq!(got, total, "transfer incomplete");
    let (ok, bad) = (
        PARTIAL_OK.load(Ordering::Relaxed),
        PARTIAL_BAD.load(Ordering::Relaxed),
    );
    let gso_ok = PARTIAL_GSO_OK.load(Ordering::Relaxed);
    eprintln!(
        "partial-checksum frames matching the documented convention: {ok} ({gso_ok} GSO), not: {bad}"
    );
    assert!(
        ok > 0 && gso_ok > 0 && bad == 0,
        "ok {ok} gso {gso_ok} bad {bad}"
    );
    assert!(inside.rx_gso_frames > 0, "no GSO frames seen: {inside:?}");
    assert!(outside.tx_gso_frames > 0, "no GSO frames sent: {outside:?}");
    assert_eq!(inside.tx_errors + outside.tx_errors, 0);
}

#[test]
fn without_vnet_hdr_superframes_cannot_be_forwarded() {
    if !pliant_testkit::require_root() {
        return;
    }
    let (got, secs, inside, outside) = run(false, 64 << 20, Duration::from_secs(3));
    eprintln!(
        "plain bridge: {} KiB in {:.2} s\ninside  {:?}\noutside {:?}",
        got >> 10,
        secs,
        inside,
        outside
    );
    // The client's TCP sends super-frames with partial checksums: the bridge receives frames
    // above the MTU that it must refuse to send.
    assert!(inside.rx_oversize > 0, "{inside:?}");
    assert!(inside.rx_csum_partial > 0, "{inside:?}");
    assert!(outside.tx_errors > 0, "{outside:?}");
    assert!(got < 64 << 20);
}
