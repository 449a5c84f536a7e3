//! TCP_REPAIR capture and restore of live loopback connections, each test in its own network
//! namespace (its counters count only its own segments).

mod common;

use common::{private_netns, tcp_counter, wait_until};
use pliant_slice::repair::{self, RepairError};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

fn pair() -> (TcpListener, TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (s, _) = l.accept().unwrap();
    (l, c, s)
}

fn round_trip(c: &mut TcpStream, s: &mut TcpStream, msg: &[u8]) {
    c.write_all(msg).unwrap();
    let mut got = vec![0; msg.len()];
    s.read_exact(&mut got).unwrap();
    assert_eq!(got, msg);
    s.write_all(&got).unwrap();
    let mut back = vec![0; msg.len()];
    c.read_exact(&mut back).unwrap();
    assert_eq!(back, msg);
}

fn quiescent(c: &TcpStream, s: &TcpStream) {
    assert!(wait_until(Duration::from_secs(5), || {
        repair::unacked_segments(c).unwrap() == 0 && repair::unacked_segments(s).unwrap() == 0
    }));
}

#[test]
fn closing_in_repair_mode_sends_nothing_and_the_restored_socket_carries_on() {
    if !private_netns() {
        return;
    }
    let (_l, mut c, mut s) = pair();
    round_trip(&mut c, &mut s, b"before");
    quiescent(&c, &s);

    let mss = repair::send_mss(&s).unwrap();
    let segs = tcp_counter("OutSegs");
    repair::enter_repair(&s).unwrap();
    let cap = repair::capture(&s).unwrap();
    repair::close_in_repair(s).unwrap();
    // Not one segment left this namespace for the close: no FIN, no RST.
    assert_eq!(
        tcp_counter("OutSegs"),
        segs,
        "closing in repair mode sent a segment"
    );

    let mut r = repair::restore(&cap).unwrap();
    repair::leave_repair(&r).unwrap();
    // Segments as large as before the move (not the 536-byte default), up to what TCP_MAXSEG
    // can ask for (loopback's MSS is above it; less the 12 bytes of the timestamp option).
    assert_eq!(
        repair::send_mss(&r).unwrap(),
        mss.min(repair::MAX_USER_MSS - 12)
    );
    // The client never saw an end: its next exchange goes to the restored socket.
    round_trip(&mut c, &mut r, b"after the move");
    assert_eq!(tcp_counter("OutRsts"), 0);
    // EstabResets counts the source socket's silent disconnect (ESTABLISHED -> CLOSE in the
    // kernel's books, no segment): exactly one, and the client's socket is not among them.
    assert_eq!(tcp_counter("EstabResets"), 1);
}

#[test]
fn unread_and_unacknowledged_bytes_move_with_the_capsule() {
    if !private_netns() {
        return;
    }
    let (_l, mut c, mut s) = pair();
    // The server does not read: these stay in its receive queue.
    let up: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    c.write_all(&up).unwrap();
    // The client does not read: the server's writes fill the client's window, then its own
    // send queue (sent-unacknowledged and never-sent bytes).
    s.set_nonblocking(true).unwrap();
    let mut down_len = 0usize;
    loop {
        let chunk: Vec<u8> = (down_len..down_len + 16384)
            .map(|i| (i % 241) as u8)
            .collect();
        match s.write(&chunk) {
            Ok(n) => down_len += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(e) => panic!("{e}"),
        }
    }
    assert!(wait_until(Duration::from_secs(5), || {
        let mut n = 0i32;
        // SAFETY: FIONREAD writes one int.
        unsafe { libc::ioctl(std::os::fd::AsRawFd::as_raw_fd(&s), libc::FIONREAD, &mut n) };
        n as usize == up.len()
    }));

    repair::enter_repair(&s).unwrap();
    let cap = repair::capture(&s).unwrap();
    assert_eq!(cap.recv_queue, up);
    assert!(!cap.send_queue.is_empty(), "nothing left in the send queue");
    assert!(cap.options.sack && cap.options.timestamps && cap.options.wscale.is_some());
    repair::close_in_repair(s).unwrap();

    let mut r = repair::restore(&cap).unwrap();
    repair::leave_repair(&r).unwrap();
    let mut down = vec![0; down_len + 4];
    std::thread::scope(|t| {
        // The client reads while the restored server writes what was never sent (the client's
        // window is full until it reads).
        t.spawn(|| c.read_exact(&mut down).unwrap());
        r.write_all(cap.unsent_part()).unwrap();
        r.write_all(b"tail").unwrap();
    });
    let mut got = vec![0; up.len()];
    r.read_exact(&mut got).unwrap();
    assert_eq!(got, up);
    let want: Vec<u8> = (0..down_len)
        .map(|i| (i % 241) as u8)
        .chain(*b"tail")
        .collect();
    assert!(
        down == want,
        "server -> client stream differs after the move"
    );
    assert_eq!(tcp_counter("OutRsts"), 0);
}

#[test]
fn two_sockets_cannot_hold_one_4_tuple_and_the_source_lives_on() {
    if !private_netns() {
        return;
    }
    let (_l, mut c, mut s) = pair();
    round_trip(&mut c, &mut s, b"one");
    repair::enter_repair(&s).unwrap();
    let cap = repair::capture(&s).unwrap();
    // The source is still open: the kernel refuses a second socket with its 4-tuple, even in
    // repair mode (connect checks the established table).
    match repair::restore(&cap) {
        Err(RepairError::TupleInUse { local, remote }) => {
            assert_eq!((local, remote), (cap.local, cap.remote));
        }
        other => panic!("expected TupleInUse, got {other:?}"),
    }
    repair::leave_repair(&s).unwrap();
    round_trip(&mut c, &mut s, b"still here");
    assert_eq!(tcp_counter("OutRsts"), 0);
}
