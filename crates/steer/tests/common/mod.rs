//! Namespace fixture for the steering tests: client, fabric, server and N replica namespaces
//! wired like pliant-lab (port names from `pliant_steer::lab::lab_ports`), no IP addresses:
//! tests inject hand-built frames with AF_PACKET and watch where they arrive. Everything is
//! removed on drop, also when a test fails.
#![allow(dead_code)]

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

static SEQ: AtomicU32 = AtomicU32::new(0);

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("run ip");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

pub struct Fixture {
    pub prefix: String,
    pub replicas: u8,
}

impl Fixture {
    pub fn client(&self) -> String {
        format!("{}-c", self.prefix)
    }
    pub fn server(&self) -> String {
        format!("{}-s", self.prefix)
    }
    pub fn fabric(&self) -> String {
        format!("{}-f", self.prefix)
    }
    pub fn replica(&self, n: u8) -> String {
        format!("{}-r{n}", self.prefix)
    }

    pub fn new(replicas: u8) -> Fixture {
        let seq = SEQ.fetch_add(1, Ordering::Relaxed);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let prefix = format!("stt{}x{}x{}", std::process::id(), seq, nanos % 10_000);
        let f = Fixture { prefix, replicas };
        let mut all = vec![f.client(), f.server(), f.fabric()];
        all.extend((1..=replicas).map(|n| f.replica(n)));
        for ns in &all {
            ip(&["netns", "add", ns]);
            // No IPv6 autoconf chatter (DAD, MLD) that would muddy the counters.
            for k in ["all", "default"] {
                let _ = Command::new("ip")
                    .args(["netns", "exec", ns, "sysctl", "-qw"])
                    .arg(format!("net.ipv6.conf.{k}.disable_ipv6=1"))
                    .status();
            }
        }
        let veth = |a: &str, ans: &str, b: &str, bns: &str| {
            ip(&[
                "link", "add", a, "netns", ans, "type", "veth", "peer", "name", b, "netns", bns,
            ]);
            ip(&["-n", ans, "link", "set", a, "up"]);
            ip(&["-n", bns, "link", "set", b, "up"]);
        };
        veth("client0", &f.client(), "fabclient", &f.fabric());
        veth("server0", &f.server(), "fabserver", &f.fabric());
        for n in 1..=replicas {
            veth(
                &format!("r{n}in"),
                &f.replica(n),
                &format!("fabr{n}in"),
                &f.fabric(),
            );
            veth(
                &format!("r{n}out"),
                &f.replica(n),
                &format!("fabr{n}out"),
                &f.fabric(),
            );
        }
        f
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let mut all = vec![self.client(), self.server(), self.fabric()];
        all.extend((1..=self.replicas).map(|n| self.replica(n)));
        for ns in all {
            let _ = Command::new("ip").args(["netns", "del", &ns]).status();
        }
    }
}

/// Runs `f` on a thread inside namespace `ns`.
pub fn in_ns<T: Send>(ns: &str, f: impl FnOnce() -> T + Send) -> T {
    let file = std::fs::File::open(format!("/run/netns/{ns}")).expect("open netns");
    std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: valid netns fd; affects this thread only.
            let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(rc, 0, "setns {ns}");
            f()
        })
        .join()
        .expect("ns thread")
    })
}

/// An AF_PACKET socket bound to one interface of one namespace.
pub struct Port {
    fd: OwnedFd,
    ifindex: i32,
}

impl Port {
    pub fn open(ns: &str, ifname: &str) -> Port {
        let ifname = ifname.to_string();
        in_ns(ns, move || {
            let proto = (libc::ETH_P_ALL as u16).to_be();
            // SAFETY: plain socket/bind/setsockopt calls on a fresh fd we own.
            unsafe {
                let fd = libc::socket(libc::AF_PACKET, libc::SOCK_RAW, i32::from(proto));
                assert!(fd >= 0, "AF_PACKET socket");
                let fd = OwnedFd::from_raw_fd(fd);
                let c = std::ffi::CString::new(ifname.clone()).expect("name");
                let ifindex = libc::if_nametoindex(c.as_ptr()) as i32;
                assert!(ifindex > 0, "no interface {ifname}");
                let mut sll: libc::sockaddr_ll = std::mem::zeroed();
                sll.sll_family = libc::AF_PACKET as u16;
                sll.sll_protocol = proto;
                sll.sll_ifindex = ifindex;
                let rc = libc::bind(
                    fd.as_raw_fd(),
                    &sll as *const _ as *const libc::sockaddr,
                    std::mem::size_of::<libc::sockaddr_ll>() as u32,
                );
                assert_eq!(rc, 0, "bind {ifname}");
                let tv = libc::timeval {
                    tv_sec: 0,
                    tv_usec: 50_000,
                };
                libc::setsockopt(
                    fd.as_raw_fd(),
                    libc::SOL_SOCKET,
                    libc::SO_RCVTIMEO,
                    &tv as *const _ as *const libc::c_void,
                    std::mem::size_of::<libc::timeval>() as u32,
                );
                Port { fd, ifindex }
            }
        })
    }

    pub fn send(&self, frame: &[u8]) {
        // SAFETY: frame is a valid buffer; the socket is bound.
        let n = unsafe {
            libc::send(
                self.fd.as_raw_fd(),
                frame.as_ptr() as *const libc::c_void,
                frame.len(),
                0,
            )
        };
        assert_eq!(n, frame.len() as isize, "send");
    }

    /// Incoming (not locally sent) frames received within `wait`.
    pub fn recv_for(&self, wait: Duration) -> Vec<Vec<u8>> {
        let end = Instant::now() + wait;
        let mut out = Vec::new();
        let mut buf = vec![0u8; 65536];
        while Instant::now() < end {
            // SAFETY: buf and sll are owned buffers of the given sizes.
            unsafe {
                let mut sll: libc::sockaddr_ll = std::mem::zeroed();
                let mut len = std::mem::size_of::<libc::sockaddr_ll>() as u32;
                let n = libc::recvfrom(
                    self.fd.as_raw_fd(),
                    buf.as_mut_ptr() as *mut libc::c_void,
                    buf.len(),
                    0,
                    &mut sll as *mut _ as *mut libc::sockaddr,
                    &mut len,
                );
                if n > 0 && sll.sll_pkttype != libc::PACKET_OUTGOING {
                    out.push(buf[..n as usize].to_vec());
                }
            }
        }
        out
    }

    pub fn ifindex(&self) -> i32 {
        self.ifindex
    }
}

/// Counts frames in `frames` that contain `marker`.
pub fn count_marked(frames: &[Vec<u8>], marker: &[u8]) -> usize {
    frames
        .iter()
        .filter(|f| f.windows(marker.len()).any(|w| w == marker))
        .count()
}

/// Small deterministic PRNG (xorshift64*), so failures reproduce from the seed.
pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}
