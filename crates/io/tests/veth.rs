//! PacketPort over a real veth pair between two namespaces this test creates (needs root).

use std::io::ErrorKind;
use std::time::{Duration, Instant};

use pliant_io::testlab::Lab;
use pliant_io::{FramePort, PacketPort, PortOptions, RxRing};

/// Local experimental ethertype: frames of this test are told apart from anything else.
const ETHERTYPE: u16 = 0x88b5;

struct Pair {
    lab: Lab,
    ns_b: String,
    if_b: String,
    tx: PacketPort,
    rx: PacketPort,
}

fn pair(opts: PortOptions) -> Pair {
    let mut lab = Lab::new();
    let ns_a = lab.add_ns("a").expect("netns a");
    let ns_b = lab.add_ns("b").expect("netns b");
    let (if_a, if_b) = (format!("pioa{}", lab.tag()), format!("piob{}", lab.tag()));
    lab.add_veth(&ns_a, &if_a, &ns_b, &if_b).expect("veth");
    let tx = lab
        .in_ns(&ns_a, || PacketPort::open(&if_a, &opts))
        .expect("enter ns a")
        .expect("open tx port");
    let rx = lab
        .in_ns(&ns_b, || PacketPort::open(&if_b, &opts))
        .expect("enter ns b")
        .expect("open rx port");
    Pair {
        lab,
        ns_b,
        if_b,
        tx,
        rx,
    }
}

/// Frame `seq` of length `len`: a unicast destination that is *not* the receiver's MAC (replicas
/// must see frames for other MACs), sender's MAC, our ethertype, seq, pattern.
fn frame(src: [u8; 6], seq: u32, len: usize) -> Vec<u8> {
    let mut f = Vec::with_capacity(len);
    f.extend_from_slice(&[0x02, 0xaa, 0xbb, 0xcc, 0xdd, 0xee]);
    f.extend_from_slice(&src);
    f.extend_from_slice(&ETHERTYPE.to_be_bytes());
    f.extend_from_slice(&seq.to_be_bytes());
    while f.len() < len {
        f.push((f.len() as u32).wrapping_mul(31).wrapping_add(seq) as u8);
    }
    f
}

fn send_all(port: &mut PacketPort, frames: &[Vec<u8>]) {
    for f in frames {
        let mut tries = 0;
        loop {
            match port.send(f) {
                Ok(()) => break,
                Err(e) if e.kind() == ErrorKind::WouldBlock && tries < 10_000 => {
                    // Ring full: push it out and let the kernel free slots.
                    port.flush().expect("flush");
                    std::thread::yield_now();
                    tries += 1;
                }
                Err(e) => panic!("send failed: {e}"),
            }
        }
    }
    port.flush().expect("flush");
    let deadline = Instant::now() + Duration::from_secs(5);
    while port.tx_unkicked() > 0 && Instant::now() < deadline {
        port.flush().expect("flush");
    }
}

/// Receives our frames until `n` arrived or a deadline passes (then a little longer, so
/// duplicates would be seen).
fn recv_ours(port: &mut PacketPort, n: usize) -> Vec<Vec<u8>> {
    let mut got = Vec::new();
    let mut deadline = Instant::now() + Duration::from_secs(10);
    let mut extra_wait = false;
    while Instant::now() < deadline {
        port.recv_batch(256, &mut |f| {
            if f.len() >= 14 && f[12..14] == ETHERTYPE.to_be_bytes() {
                got.push(f.to_vec());
            }
        })
        .expect("recv");
        if got.len() >= n && !extra_wait {
            // Wait past a block timeout for any duplicate or extra frame.
            deadline = Instant::now() + Duration::from_millis(50);
            extra_wait = true;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    got
}

fn exact_delivery(opts: PortOptions) {
    if !pliant_testkit::require_root() {
        return;
    }
    let mut p = pair(opts);
    // Promiscuity taken by a socket shows as a counter in `ip -d link`, not as a flag.
    let link = p
        .lab
        .exec(&p.ns_b, &["ip", "-d", "link", "show", &p.if_b])
        .unwrap();
    assert!(
        link.contains("promiscuity 1"),
        "port did not make the interface promiscuous: {link}"
    );
    let src = p.tx.mac();
    for len in [60usize, 1514] {
        let n = 3000u32;
        let frames: Vec<Vec<u8>> = (0..n).map(|s| frame(src, s, len)).collect();
        send_all(&mut p.tx, &frames);
        let got = recv_ours(&mut p.rx, n as usize);
        assert_eq!(
            got.len(),
            n as usize,
            "len {len}: wrong number of frames received"
        );
        for (i, g) in got.iter().enumerate() {
            assert_eq!(
                g, &frames[i],
                "len {len}: frame {i} differs or is out of order"
            );
        }
        // The sender must not see its own transmissions on its RX ring.
        let own = recv_ours(&mut p.tx, 0);
        assert!(own.is_empty(), "sender saw {} of its own frames", own.len());
    }
    let (ts, rs) = (p.tx.stats(), p.rx.stats());
    assert_eq!(ts.tx_frames, 6000);
    assert_eq!(ts.tx_bytes, 3000 * (60 + 1514));
    assert_eq!((ts.tx_errors, ts.tx_dropped_full), (0, 0));
    assert!(rs.rx_frames >= 6000);
    assert_eq!(rs.rx_kernel_drops, 0);
    assert_eq!(rs.rx_truncated, 0);
}

#[test]
fn v3_ring_delivers_small_and_full_size_frames_exactly() {
    exact_delivery(PortOptions::default());
}

#[test]
fn v2_ring_delivers_small_and_full_size_frames_exactly() {
    exact_delivery(PortOptions {
        rx: RxRing::V2 {
            frame_bytes: 2048,
            frame_count: 8192,
        },
        // Through the qdisc, transmitted frames pass the taps: this makes the "sender does not
        // see its own frames" check depend on PACKET_IGNORE_OUTGOING.
        qdisc_bypass: false,
        ..PortOptions::default()
    });
}

#[test]
fn sendmmsg_tx_delivers_small_and_full_size_frames_exactly() {
    exact_delivery(PortOptions {
        tx_mode: pliant_io::TxMode::Sendmmsg,
        ..PortOptions::default()
    });
}

#[test]
fn small_tx_ring_reports_full_and_recovers() {
    if !pliant_testkit::require_root() {
        return;
    }
    let mut p = pair(PortOptions {
        tx_frame_count: 64,
        ..PortOptions::default()
    });
    let src = p.tx.mac();
    // Fill without flushing: the 65th frame finds no free slot.
    let mut refused = 0;
    for s in 0..100 {
        match p.tx.send(&frame(src, s, 60)) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::WouldBlock => refused += 1,
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(refused, 100 - 64);
    assert_eq!(p.tx.stats().tx_dropped_full, 36);
    p.tx.flush().unwrap();
    let got = recv_ours(&mut p.rx, 64);
    assert_eq!(got.len(), 64);
    // Slots are free again.
    send_all(&mut p.tx, &[frame(src, 1000, 60)]);
    assert_eq!(recv_ours(&mut p.rx, 1).len(), 1);
}

#[test]
fn oversize_and_runt_frames_are_refused_without_offloads() {
    if !pliant_testkit::require_root() {
        return;
    }
    let mut p = pair(PortOptions::default());
    let src = p.tx.mac();
    let e = p.tx.send(&frame(src, 0, 1600)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
    // MTU + 14 is the limit for untagged frames (the kernel says EMSGSIZE for 1518, or silently
    // skips the slot with PACKET_LOSS): refused up front.
    let e = p.tx.send(&frame(src, 0, 1518)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
    // A VLAN-tagged frame may use the 4 extra bytes.
    let mut tagged = frame(src, 0, 1518);
    tagged[12..14].copy_from_slice(&0x8100u16.to_be_bytes());
    p.tx.send(&tagged).unwrap();
    let e = p.tx.send(&[0u8; 10]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
    let gso = pliant_io::Offload {
        gso: Some(pliant_io::Gso {
            kind: pliant_io::GsoKind::TcpV4,
            segment_size: 1448,
            header_len: 66,
            ecn: false,
        }),
        ..pliant_io::Offload::NONE
    };
    let e = p.tx.send_offload(&frame(src, 0, 3000), &gso).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unsupported);
    assert_eq!(p.tx.stats().tx_errors, 4);
}

#[test]
fn vlan_tagged_frames_arrive_with_their_tag() {
    if !pliant_testkit::require_root() {
        return;
    }
    let mut p = pair(PortOptions::default());
    let src = p.tx.mac();
    // 802.1Q tag, VID 42 PCP 3, then our ethertype.
    let mut f = frame(src, 7, 100);
    f.splice(12..12, [0x81, 0x00, 0x60, 0x2a]);
    send_all(&mut p.tx, &[f.clone()]);
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    while got.is_empty() && Instant::now() < deadline {
        p.rx.recv_batch_meta(64, &mut |fr, m| {
            if fr.len() >= 18 && fr[16..18] == ETHERTYPE.to_be_bytes() {
                got.push((fr.to_vec(), *m));
            }
        })
        .unwrap();
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(got.len(), 1, "tagged frame not received");
    // The kernel moves the tag into metadata on receive; the port puts it back.
    assert!(got[0].1.vlan_reinserted);
    assert_eq!(got[0].0, f);
}

fn realtime_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock after 1970")
        .as_nanos() as u64
}

/// Receives `n` of our frames' ring stamps (10 s bound).
fn stamps_of_ours(port: &mut PacketPort, n: usize) -> Vec<u64> {
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while got.len() < n && Instant::now() < deadline {
        port.recv_batch_meta(256, &mut |f, meta| {
            if f.len() >= 14 && f[12..14] == ETHERTYPE.to_be_bytes() {
                got.push(meta.rx_ns);
            }
        })
        .expect("recv");
    }
    got
}

/// Every frame carries the `CLOCK_REALTIME` instant it entered the ring: after what the
/// sender saw before sending it, before the reader got it, and a burst sent after another
/// was read is stamped after that. (Migration relies on it to prove that the frames queued
/// before a request have been read.)
fn ring_stamps(opts: PortOptions) {
    if !pliant_testkit::require_root() {
        return;
    }
    let mut p = pair(opts);
    let src = p.tx.mac();
    let mut seq = 0;
    let mut burst = |p: &mut Pair| {
        let frames: Vec<Vec<u8>> = (0..200)
            .map(|_| {
                seq += 1;
                frame(src, seq, 60)
            })
            .collect();
        let before = realtime_ns();
        send_all(&mut p.tx, &frames);
        let stamps = stamps_of_ours(&mut p.rx, frames.len());
        let after = realtime_ns();
        assert_eq!(stamps.len(), frames.len());
        for s in &stamps {
            assert!(
                (before..=after).contains(s),
                "stamp {s} outside [{before}, {after}]"
            );
        }
        (before, after)
    };
    let (_, first_read) = burst(&mut p);
    let (second_sent, _) = burst(&mut p);
    assert!(second_sent >= first_read);
}

#[test]
fn v2_ring_stamps_each_frame_when_it_entered_the_ring() {
    ring_stamps(PortOptions::low_latency());
}

#[test]
fn v3_ring_stamps_each_frame_when_it_entered_the_ring() {
    ring_stamps(PortOptions::default());
}
