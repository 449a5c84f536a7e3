//! The packet hold: a held connection's client segments are dropped, a released one's pass.

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
    let h = PacketHold::create("t").unwrap();
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
