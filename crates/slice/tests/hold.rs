//! The packet holds: the queueing one keeps a held connection's client segments and writes
//! them back on release; the dropping one drops them and lets the retransmissions pass.

mod common;

use common::{private_netns, wait_until};
use pliant_slice::hold::PacketHold;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::Command;
use std::time::Duration;

fn elements(table: &str) -> String {
    let o = Command::new("nft")
        .args(["list", "set", "inet", table, "held4"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Packets the hold's IPv4 rule dropped.
fn dropped(table: &str) -> u64 {
    let o = Command::new("nft")
        .args(["list", "chain", "inet", table, "hold"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    let line = text
        .lines()
        .find(|l| l.contains("@held4"))
        .expect("the rule");
    let mut w = line.split_whitespace();
    w.find(|x| *x == "packets").expect("a counter");
    w.next().unwrap().parse().unwrap()
}

#[test]
fn held_segments_are_dropped_and_flow_again_once_released() {
    if !private_netns() {
        return;
    }
    let h = PacketHold::dropping("t").unwrap();
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (mut s, remote) = l.accept().unwrap();
    let local = s.local_addr().unwrap();

    h.hold(&local, &remote).unwrap();
    let listed = elements(h.table());
    assert!(listed.contains(&remote.port().to_string()), "{listed}");
    // Holding twice is refused (one move per connection at a time).
    assert!(h.hold(&local, &remote).is_err());
    c.write_all(b"held").unwrap();
    // The hold's rule counted the segment as it dropped it, and nothing reached the socket.
    assert!(wait_until(Duration::from_secs(5), || dropped(h.table()) > 0));
    let mut buf = [0u8; 4];
    let mut n = 0i32;
    // SAFETY: FIONREAD writes one int.
    unsafe { libc::ioctl(std::os::fd::AsRawFd::as_raw_fd(&s), libc::FIONREAD, &mut n) };
    assert_eq!(n, 0);

    h.release(&local, &remote).unwrap();
    assert!(!elements(h.table()).contains(&remote.port().to_string()));
    s.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"held");
    assert!(h.release(&local, &remote).is_err());
    let table = h.table().to_string();
    drop(h);
    let o = Command::new("nft")
        .args(["list", "tables"])
        .output()
        .unwrap();
    assert!(!String::from_utf8_lossy(&o.stdout).contains(&table));
}

fn unread(s: &TcpStream) -> i32 {
    let mut n = 0i32;
    // SAFETY: FIONREAD writes one int.
    unsafe { libc::ioctl(std::os::fd::AsRawFd::as_raw_fd(s), libc::FIONREAD, &mut n) };
    n
}

fn run(cmd: &[&str]) -> String {
    let o = Command::new(cmd[0]).args(&cmd[1..]).output().unwrap();
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn queued_segments_are_written_back_in_order_on_release() {
    if !private_netns() {
        return;
    }
    let h = PacketHold::create("t").unwrap();
    assert_eq!(
        h.mode(),
        pliant_slice::hold::HoldMode::Queue,
        "fell back: {:?}",
        h.fallback_reason()
    );
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (mut s, remote) = l.accept().unwrap();
    let local = s.local_addr().unwrap();
    // Another connection, not held, goes on meanwhile.
    let mut c2 = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (mut s2, _) = l.accept().unwrap();

    h.hold(&local, &remote).unwrap();
    assert!(matches!(
        h.hold(&local, &remote),
        Err(pliant_slice::hold::HoldError::AlreadyHeld(_))
    ));
    // Several segments (nodelay: one per write), each of them queued.
    c.set_nodelay(true).unwrap();
    for i in 0..5u8 {
        c.write_all(&[b'a' + i; 100]).unwrap();
    }
    c2.write_all(b"free").unwrap();
    let mut buf = [0u8; 4];
    s2.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"free");
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(unread(&s), 0, "a held segment reached the socket");

    h.release(&local, &remote).unwrap();
    let mut got = vec![0u8; 500];
    s.read_exact(&mut got).unwrap();
    let want: Vec<u8> = (0..5u8).flat_map(|i| [b'a' + i; 100]).collect();
    assert_eq!(got, want);
    let st = h.queue_stats().unwrap();
    assert!(st.reinjected >= 5, "{st:?}");
    assert_eq!((st.over_limit, st.missing, st.socket_drops), (0, 0, 0));
    // Nothing queued was lost: the client retransmitted at most a tail-loss probe of its last
    // segment (sent while held, after about 2 round trips), never all five.
    assert!(common::tcp_counter("RetransSegs") <= 1);
    assert!(matches!(
        h.release(&local, &remote),
        Err(pliant_slice::hold::HoldError::NotHeld(_))
    ));
    // Big segments (loopback's are up to 64 KB) too.
    h.hold(&local, &remote).unwrap();
    let big: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
    c.write_all(&big).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    h.release(&local, &remote).unwrap();
    let mut got = vec![0u8; big.len()];
    s.read_exact(&mut got).unwrap();
    assert!(got == big);
    // Every segment written back was taken as it was (a wrong checksum would be counted here
    // and the client would have to retransmit).
    assert_eq!(common::tcp_counter("InCsumErrors"), 0);
    // After the release the connection is an ordinary one.
    c.write_all(b"more").unwrap();
    s.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"more");

    let veth = format!("{}a", h.table());
    assert!(run(&["ip", "link", "show"]).contains(&veth));
    assert_eq!(common::hold_programs("lo"), 1);
    // TCX links need no qdisc; classic filters share one on lo, which outlives the first
    // hold out.
    let tcx = !run(&["tc", "qdisc", "show", "dev", "lo"]).contains("clsact");
    let h2 = PacketHold::create("t2").unwrap();
    assert_eq!(common::hold_programs("lo"), 2);
    drop(h);
    assert!(!run(&["ip", "link", "show"]).contains(&veth));
    assert_eq!(common::hold_programs("lo"), 1);
    assert_eq!(
        run(&["tc", "qdisc", "show", "dev", "lo"]).contains("clsact"),
        !tcx
    );
    // The last one out leaves the interface as it found it.
    drop(h2);
    assert_eq!(common::hold_programs("lo"), 0);
    assert!(!run(&["tc", "qdisc", "show", "dev", "lo"]).contains("clsact"));
}

#[test]
fn beyond_its_bound_the_queue_drops_and_counts_and_the_client_retransmits() {
    if !private_netns() {
        return;
    }
    let bounds = pliant_slice::hold::QueueBounds {
        packets: 3,
        bytes: 1 << 20,
    };
    let h = PacketHold::queueing_bounded("t", bounds).unwrap();
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (mut s, remote) = l.accept().unwrap();
    let local = s.local_addr().unwrap();
    h.hold(&local, &remote).unwrap();
    c.set_nodelay(true).unwrap();
    for i in 0..5u8 {
        c.write_all(&[b'a' + i; 100]).unwrap();
    }
    // Loopback delivers a segment within microseconds of its write; the counters are read
    // at the release.
    std::thread::sleep(Duration::from_millis(50));
    h.release(&local, &remote).unwrap();
    let st = h.queue_stats().unwrap();
    assert_eq!(st.reinjected, 3, "{st:?}");
    assert!(st.over_limit >= 2, "{st:?}");
    // The stream is whole all the same: what was dropped the client sent again.
    let mut got = vec![0u8; 500];
    s.read_exact(&mut got).unwrap();
    let want: Vec<u8> = (0..5u8).flat_map(|i| [b'a' + i; 100]).collect();
    assert_eq!(got, want);
    assert!(common::tcp_counter("RetransSegs") >= 1);
}

#[test]
fn segments_arriving_on_another_interface_are_queued_too() {
    if !private_netns() {
        return;
    }
    // The client in a namespace of its own behind a veth pair: its segments reach this
    // namespace on slsrv0, not on loopback.
    let ip = |args: &[&str]| {
        let st = Command::new("ip").args(args).status().unwrap();
        assert!(st.success(), "ip {args:?}");
    };
    ip(&[
        "link", "add", "slsrv0", "type", "veth", "peer", "name", "slcli0",
    ]);
    ip(&["addr", "add", "10.9.0.1/24", "dev", "slsrv0"]);
    ip(&["link", "set", "slsrv0", "up"]);
    let l = TcpListener::bind("10.9.0.1:0").unwrap();
    let server = l.local_addr().unwrap();
    let (tid_tx, tid_rx) = std::sync::mpsc::channel();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let client = std::thread::spawn(move || {
        // SAFETY: unshare(CLONE_NEWNET) affects only this thread.
        assert_eq!(unsafe { libc::unshare(libc::CLONE_NEWNET) }, 0);
        // SAFETY: gettid has no preconditions.
        tid_tx.send(unsafe { libc::gettid() }).unwrap();
        go_rx.recv().unwrap();
        for args in [
            &["addr", "add", "10.9.0.2/24", "dev", "slcli0"][..],
            &["link", "set", "slcli0", "up"],
        ] {
            assert!(Command::new("ip").args(args).status().unwrap().success());
        }
        // The socket keeps its namespace after this thread ends.
        TcpStream::connect(server).unwrap()
    });
    let tid = tid_rx.recv().unwrap().to_string();
    ip(&["link", "set", "slcli0", "netns", &tid]);
    go_tx.send(()).unwrap();
    let mut c = client.join().unwrap();
    let (mut s, remote) = l.accept().unwrap();
    let local = s.local_addr().unwrap();

    // Created with slsrv0 present: its filter is on it too.
    let h = PacketHold::create("t").unwrap();
    assert_eq!(h.mode(), pliant_slice::hold::HoldMode::Queue);
    assert_eq!(common::hold_programs("slsrv0"), 1);
    h.hold(&local, &remote).unwrap();
    c.set_nodelay(true).unwrap();
    for i in 0..5u8 {
        c.write_all(&[b'a' + i; 100]).unwrap();
    }
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(unread(&s), 0, "a held segment reached the socket");
    h.release(&local, &remote).unwrap();
    let mut got = vec![0u8; 500];
    s.read_exact(&mut got).unwrap();
    let want: Vec<u8> = (0..5u8).flat_map(|i| [b'a' + i; 100]).collect();
    assert_eq!(got, want);
    let st = h.queue_stats().unwrap();
    assert!(st.reinjected >= 5, "{st:?}");
    // The client retransmitted at most its tail-loss probe.
    assert!(pliant_slice::load::retrans(&c).unwrap().total_retrans <= 1);
    c.write_all(b"more").unwrap();
    let mut buf = [0u8; 4];
    s.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"more");
    drop(h);
    assert_eq!(common::hold_programs("slsrv0"), 0);
}
