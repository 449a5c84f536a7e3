//! Does a TX-ring slot get reused while a frame sent from it still sits, unread, in a local
//! socket's receive queue? (The kernel attaches ring pages to the skb instead of copying, and the
//! IP stack orphans the skb, which hands the slot back early.) Needs root.

use std::net::UdpSocket;
use std::os::fd::AsRawFd;
use std::time::Duration;

use pliant_io::testlab::Lab;
use pliant_io::{FramePort, PacketPort, PortOptions, TxMode};

const PAYLOAD: usize = 1400;

fn ipv4_udp(src_mac: [u8; 6], dst_mac: [u8; 6], seq: u32) -> Vec<u8> {
    let mut f = Vec::with_capacity(14 + 28 + PAYLOAD);
    f.extend_from_slice(&dst_mac);
    f.extend_from_slice(&src_mac);
    f.extend_from_slice(&[0x08, 0x00]);
    let total = (20 + 8 + PAYLOAD) as u16;
    let mut ip = [
        0x45, 0, 0, 0, 0, 0, 0x40, 0, 64, 17, 0, 0, 10, 78, 0, 1, 10, 78, 0, 2,
    ];
    ip[2..4].copy_from_slice(&total.to_be_bytes());
    let mut sum = 0u32;
    for c in ip.chunks(2) {
        sum += u32::from(u16::from_be_bytes([c[0], c[1]]));
    }
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    ip[10..12].copy_from_slice(&(!(sum as u16)).to_be_bytes());
    f.extend_from_slice(&ip);
    f.extend_from_slice(&9000u16.to_be_bytes());
    f.extend_from_slice(&9000u16.to_be_bytes());
    f.extend_from_slice(&((8 + PAYLOAD) as u16).to_be_bytes());
    f.extend_from_slice(&[0, 0]); // no UDP checksum
    for i in 0..PAYLOAD {
        f.push((seq as usize * 7 + i) as u8);
    }
    f
}

fn run(mode: TxMode) -> (usize, usize) {
    let mut lab = Lab::new();
    let ns_a = lab.add_ns("ra").unwrap();
    let ns_b = lab.add_ns("rb").unwrap();
    let (if_a, if_b) = (format!("pra{}", lab.tag()), format!("prb{}", lab.tag()));
    lab.add_veth(&ns_a, &if_a, &ns_b, &if_b).unwrap();
    lab.exec(&ns_b, &["ip", "addr", "add", "10.78.0.2/24", "dev", &if_b])
        .unwrap();
    let sock = lab
        .in_ns(&ns_b, || UdpSocket::bind("10.78.0.2:9000"))
        .unwrap()
        .unwrap();
    let big: i32 = 256 << 20;
    // SAFETY: plain setsockopt with a valid int.
    unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVBUFFORCE,
            (&big as *const i32).cast(),
            4,
        );
    }
    let dst_mac = lab
        .in_ns(&ns_b, || {
            PacketPort::open(&if_b, &PortOptions::default()).map(|p| p.mac())
        })
        .unwrap()
        .unwrap();
    let opts = PortOptions {
        tx_frame_count: 64,
        tx_mode: mode,
        ..PortOptions::default()
    };
    let mut tx = lab
        .in_ns(&ns_a, || PacketPort::open(&if_a, &opts))
        .unwrap()
        .unwrap();
    let n = 1024u32;
    for seq in 0..n {
        let f = ipv4_udp(tx.mac(), dst_mac, seq);
        let mut tries = 0;
        while tx.send(&f).is_err() && tries < 100_000 {
            tx.flush().unwrap();
            std::thread::yield_now();
            tries += 1;
        }
        if seq % 16 == 15 {
            tx.flush().unwrap();
        }
    }
    tx.flush().unwrap();
    std::thread::sleep(Duration::from_millis(100));
    sock.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let mut buf = vec![0u8; 2048];
    let (mut got, mut corrupt) = (0, 0);
    while let Ok(len) = sock.recv(&mut buf) {
        got += 1;
        // Which datagram is it? Recover seq from the first byte is ambiguous; compare against
        // every plausible seq with the same first byte.
        let ok = (0..n).any(|s| {
            len == PAYLOAD
                && buf[..PAYLOAD]
                    .iter()
                    .enumerate()
                    .all(|(i, b)| *b == (s as usize * 7 + i) as u8)
        });
        if !ok {
            corrupt += 1;
        }
    }
    (got, corrupt)
}

#[test]
fn frames_delivered_to_local_sockets_stay_intact() {
    if !pliant_testkit::require_root() {
        return;
    }
    for mode in [TxMode::Ring, TxMode::Sendmmsg] {
        let (got, corrupt) = run(mode);
        eprintln!("{mode:?}: {got} datagrams queued unread, {corrupt} corrupted");
        assert_eq!(got, 1024, "{mode:?}: datagrams lost");
        assert_eq!(corrupt, 0, "{mode:?}: datagrams corrupted by TX slot reuse");
    }
}
