//! End-to-end: the `pliant replica` binary running the NAT between real namespaces.
//!
//! client ns ──veth── replica ns (pliant replica, nat) ──veth── server ns
//!
//! Proves: ping and HTTP (curl -> python http.server) pass through the NAT; the server sees
//! only the NAT address (it has no route back to the client subnet, and its access log names
//! the external address); replies are restored; the replica namespace's kernel sends nothing
//! of its own (a SYN to the router's address times out instead of being refused, no RST seen);
//! start-up refuses an interface with an IP address; clean shutdown removes the tc filter and
//! the control socket. Needs root (`pliant_testkit::require_root`).
//!
//! Self-contained on purpose (small); the lab crate builds the full topology.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn sh(args: &[&str]) -> Result<String, String> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .map_err(|e| format!("{args:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{args:?} failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn must(args: &[&str]) -> String {
    sh(args).unwrap_or_else(|e| panic!("{e}"))
}

/// Namespaces, processes and files of one test run; everything removed on drop (also when the
/// test panics).
struct Topo {
    tag: String,
    client: String,
    replica: String,
    server: String,
    dir: PathBuf,
    children: Vec<Child>,
}

impl Topo {
    fn new(offloads: bool) -> Topo {
        // Two tests of this file run at once in one process: the counter keeps them apart.
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tag = format!(
            "{:x}{:x}{:03x}",
            std::process::id() & 0xfffff,
            n,
            rand16() & 0xfff
        );
        let dir = std::env::temp_dir().join(format!("pliant-e2e-nat-{tag}"));
        std::fs::create_dir_all(&dir).unwrap();
        let t = Topo {
            client: format!("pnc-{tag}"),
            replica: format!("pnr-{tag}"),
            server: format!("pns-{tag}"),
            tag,
            dir,
            children: Vec::new(),
        };
        for ns in [&t.client, &t.replica, &t.server] {
            must(&["ip", "netns", "add", ns]);
        }
        // Interface names are per-namespace; short fixed names keep them under IFNAMSIZ.
        must(&[
            "ip", "link", "add", "c0", "netns", &t.client, "type", "veth", "peer", "name", "rin",
            "netns", &t.replica,
        ]);
        must(&[
            "ip", "link", "add", "rout", "netns", &t.replica, "type", "veth", "peer", "name", "s0",
            "netns", &t.server,
        ]);
        t.ns(
            &t.client,
            &["ip", "addr", "add", "10.201.1.2/24", "dev", "c0"],
        );
        t.ns(
            &t.server,
            &["ip", "addr", "add", "10.201.2.2/24", "dev", "s0"],
        );
        for (ns, dev) in [
            (&t.client, "c0"),
            (&t.replica, "rin"),
            (&t.replica, "rout"),
            (&t.server, "s0"),
        ] {
            t.ns(ns, &["ip", "link", "set", dev, "up"]);
            t.ns(ns, &["ip", "link", "set", "lo", "up"]);
        }
        // Without vnet_hdr on the replica's ports every frame must fit the MTU: turn TSO/GSO
        // off on the neighbours. With it (the default) super-frames pass through as one unit.
        if !offloads {
            for (ns, dev) in [(&t.client, "c0"), (&t.server, "s0")] {
                let off = [
                    "ethtool", "-K", dev, "tso", "off", "gso", "off", "gro", "off",
                ];
                t.ns(ns, &off);
            }
        }
        // The client routes via the replica; the server has NO route to 10.201.1.0/24, so it
        // can only ever answer the NAT address.
        t.ns(
            &t.client,
            &["ip", "route", "add", "default", "via", "10.201.1.1"],
        );
        t
    }

    fn ns(&self, ns: &str, args: &[&str]) -> String {
        let mut full = vec!["ip", "netns", "exec", ns];
        full.extend_from_slice(args);
        must(&full)
    }

    fn ns_try(&self, ns: &str, args: &[&str]) -> Result<String, String> {
        let mut full = vec!["ip", "netns", "exec", ns];
        full.extend_from_slice(args);
        sh(&full)
    }

    fn spawn(&mut self, ns: &str, args: &[&str], log: &str) -> usize {
        let f = std::fs::File::create(self.dir.join(log)).unwrap();
        let child = Command::new("ip")
            .args(["netns", "exec", ns])
            .args(args)
            .stdout(Stdio::from(f.try_clone().unwrap()))
            .stderr(Stdio::from(f))
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {args:?}: {e}"));
        self.children.push(child);
        self.children.len() - 1
    }

    /// Starts `pliant replica` with `vnet` (`PLIANT_VNET_HDR=0|1`) and waits for its control
    /// socket; returns the child's index.
    fn start_replica(&mut self, vnet: &str, cfg: &std::path::Path, sock: &str) -> usize {
        let ns = self.replica.clone();
        let cfg = cfg.to_str().unwrap();
        let i = self.spawn(
            &ns,
            &["env", vnet, pliant(), "replica", "--config", cfg],
            "replica.log",
        );
        wait_for("control socket", Duration::from_secs(10), || {
            std::path::Path::new(sock).exists()
        });
        i
    }

    fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.join(name)).unwrap_or_default()
    }

    fn config(&self, sock: &str) -> String {
        format!(
            r#"[replica]
name = "e2e-{tag}"
control_socket = "{sock}"

[inside]
ifname = "rin"
addresses = ["10.201.1.1/24"]

[outside]
ifname = "rout"
addresses = ["10.201.2.1/24"]

[nf]
kind = "nat"

[nat]
external_ip = "10.201.2.1"
port_min = 30000
port_max = 30999
udp_timeout_s = 15
icmp_timeout_s = 2
"#,
            tag = self.tag
        )
    }
}

impl Drop for Topo {
    fn drop(&mut self) {
        for c in &mut self.children {
            // Our own children only, by PID: SIGTERM first so the replica cleans up.
            // SAFETY: kill(2) on a PID we spawned.
            unsafe { libc_kill(c.id() as i32, 15) };
        }
        let deadline = Instant::now() + Duration::from_secs(3);
        for c in &mut self.children {
            while Instant::now() < deadline {
                if let Ok(Some(_)) = c.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        for ns in [&self.client, &self.replica, &self.server] {
            let _ = sh(&["ip", "netns", "del", ns]);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}

fn rand16() -> u16 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    (t.subsec_nanos() ^ (t.as_secs() as u32)) as u16
}

fn wait_for(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + timeout;
    while Instant::now() < end {
        if f() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("timed out waiting for {what}");
}

/// UDP echo server: echoes every datagram, records the sources; "DONE" makes it write
/// `{"addrs": [...], "ports": [...], "distinct_ports": n}` to argv[1] and exit.
const UDP_SERVER: &str = r#"
import json, socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
s.bind(("10.201.2.2", 9999))
print("ready", flush=True)
addrs, ports = set(), set()
while True:
    data, peer = s.recvfrom(2048)
    if data == b"DONE":
        break
    addrs.add(peer[0]); ports.add(peer[1])
    s.sendto(data, peer)
tmp = sys.argv[1] + ".tmp"
with open(tmp, "w") as f:
    json.dump({"addrs": sorted(addrs), "ports": sorted(ports), "distinct_ports": len(ports)}, f)
import os; os.rename(tmp, sys.argv[1])
"#;

/// UDP client: N sockets (N source ports) each send one datagram and must get their own
/// payload back (retrying a few times: UDP may drop under load, that is not the NAT's fault).
const UDP_CLIENT: &str = r#"
import resource, select, socket, sys, time
n = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_NOFILE, (n + 64, n + 64))
socks = []
for i in range(n):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("10.201.1.2", 0))
    s.setblocking(False)
    socks.append(s)
pending = {s.fileno(): (s, b"flow-%d" % i) for i, s in enumerate(socks)}
ep = select.epoll()
for s in socks:
    ep.register(s.fileno(), select.EPOLLIN)
bad = 0
for attempt in range(5):
    for s, msg in list(pending.values()):
        s.sendto(msg, ("10.201.2.2", 9999))
    deadline = time.time() + 2
    while pending and time.time() < deadline:
        for fd, _ in ep.poll(0.2):
            if fd in pending:
                s, msg = pending[fd]
                data = s.recv(2048)
                if data != msg:
                    bad += 1
                del pending[fd]
    if not pending:
        break
# From an existing flow: the pool (1000 ports) is full, a new one would be refused.
socks[0].sendto(b"DONE", ("10.201.2.2", 9999))
if pending or bad:
    print("missing %d, wrong payload %d" % (len(pending), bad))
else:
    print("%d echoes ok" % n)
"#;

/// A counter from /proc/net/snmp: a header line and a value line share the prefix.
fn snmp_field(snmp: &str, prefix: &str, name: &str) -> Option<u64> {
    let mut lines = snmp.lines().filter(|l| l.starts_with(prefix));
    let head: Vec<&str> = lines.next()?.split_whitespace().collect();
    let vals: Vec<&str> = lines.next()?.split_whitespace().collect();
    let i = head.iter().position(|h| *h == name)?;
    vals.get(i)?.parse().ok()
}

fn pliant() -> &'static str {
    env!("CARGO_BIN_EXE_pliant")
}

#[test]
fn nat_passes_ping_and_http_with_offloads() {
    nat_e2e(true);
}

#[test]
fn nat_passes_ping_and_http_without_offloads() {
    nat_e2e(false);
}

fn nat_e2e(offloads: bool) {
    if !pliant_testkit::require_root() {
        return;
    }
    let mut t = Topo::new(offloads);
    let sock = t.dir.join("r.sock").to_str().unwrap().to_string();
    let cfg = t.dir.join("replica.toml");
    std::fs::write(&cfg, t.config(&sock)).unwrap();

    // An interface with an IP address is refused before anything is changed.
    t.ns(
        &t.replica,
        &["ip", "addr", "add", "10.201.2.1/24", "dev", "rout"],
    );
    let r = t.ns_try(
        &t.replica,
        &[pliant(), "replica", "--config", cfg.to_str().unwrap()],
    );
    let err = r.expect_err("must refuse an interface with addresses");
    assert!(err.contains("has IP addresses"), "{err}");
    t.ns(&t.replica, &["ip", "addr", "flush", "dev", "rout"]);

    let vnet = if offloads {
        "PLIANT_VNET_HDR=1"
    } else {
        "PLIANT_VNET_HDR=0"
    };
    let replica = t.start_replica(vnet, &cfg, &sock);
    let filters = t.ns(
        &t.replica,
        &["tc", "filter", "show", "dev", "rin", "ingress"],
    );
    assert!(
        filters.contains("pliant_drop"),
        "tc drop filter missing: {filters}"
    );
    let v6 = t.ns(
        &t.replica,
        &["cat", "/proc/sys/net/ipv6/conf/rout/disable_ipv6"],
    );
    assert_eq!(v6.trim(), "1");

    let srv = t.server.clone();
    t.spawn(
        &srv,
        &[
            "/usr/bin/python3",
            "-m",
            "http.server",
            "8080",
            "--bind",
            "10.201.2.2",
            "--directory",
            "/usr/share",
        ],
        "http.log",
    );
    wait_for("http server", Duration::from_secs(10), || {
        t.ns_try(
            &t.server,
            &["bash", "-c", "exec 3<>/dev/tcp/10.201.2.2/8080"],
        )
        .is_ok()
    });

    // Ping through the NAT (the first may wait for ARP).
    let ping = t.ns(
        &t.client,
        &["ping", "-c", "3", "-i", "0.2", "-W", "2", "10.201.2.2"],
    );
    assert!(ping.contains("3 received"), "{ping}");

    // HTTP through the NAT; the server logs the peer address of each request.
    let body = t.ns(
        &t.client,
        &["curl", "-sS", "--max-time", "10", "http://10.201.2.2:8080/"],
    );
    assert!(
        body.contains("Directory listing"),
        "unexpected body: {body:.200}"
    );
    // A bigger transfer (many segments both ways).
    let big = t.ns(&t.client, &["bash", "-c", "curl -sS --max-time 20 http://10.201.2.2:8080/ -o /dev/null -w '%{http_code} %{size_download}'; for i in 1 2 3 4 5; do curl -sS --max-time 10 -o /dev/null http://10.201.2.2:8080/; done"]);
    assert!(big.starts_with("200 "), "{big}");
    wait_for("access log", Duration::from_secs(5), || {
        t.log("http.log").contains("GET / ")
    });
    let log = t.log("http.log");
    assert!(
        log.contains("10.201.2.1 - -"),
        "server must see the NAT address:\n{log}"
    );
    assert!(
        !log.contains("10.201.1.2"),
        "server saw the client address:\n{log}"
    );

    // The router role answers pings of its inside address.
    let ping = t.ns(&t.client, &["ping", "-c", "1", "-W", "2", "10.201.1.1"]);
    assert!(ping.contains("1 received"), "{ping}");

    // The replica namespace's kernel answers nothing: a SYN to the router address is neither
    // answered nor refused (curl exit 28 = timeout; a kernel RST would give 7 = refused).
    let out = Command::new("ip")
        .args([
            "netns",
            "exec",
            &t.client,
            "curl",
            "-s",
            "--max-time",
            "2",
            "http://10.201.1.1:9/",
        ])
        .status()
        .unwrap();
    assert_eq!(out.code(), Some(28), "expected a timeout, got {out}");
    // And the tc drop filter kept every frame from the replica namespace's IP stack: it has
    // not received a single IP packet (without the filter, each frame addressed to the port's
    // MAC would count here), so it cannot have answered one either.
    let snmp = t.ns(&t.replica, &["cat", "/proc/net/snmp"]);
    assert_eq!(snmp_field(&snmp, "Ip:", "InReceives"), Some(0), "{snmp}");
    assert_eq!(snmp_field(&snmp, "Ip:", "OutRequests"), Some(0), "{snmp}");

    // Counters over the control socket.
    let stats = t.ns(
        &t.replica,
        &[pliant(), "stats", "--socket", &sock, "--json"],
    );
    let v: serde_json::Value = serde_json::from_str(stats.trim()).expect("stats JSON");
    eprintln!("replica stats: {v}");
    let gso_in = v["ports"]["outside"]["rx_gso_frames"].as_u64().unwrap_or(0);
    if offloads {
        assert_eq!(v["ports"]["inside"]["offloads"], true, "{v}");
        assert!(
            gso_in > 0,
            "the server's TSO super-frames should arrive whole: {v}"
        );
    } else {
        assert_eq!(gso_in, 0, "{v}");
    }
    assert!(
        v["nf_counters"]["nat_mappings_created"]
            .as_u64()
            .unwrap_or(0)
            >= 2,
        "{v}"
    );
    assert!(v["drops"]["to_router"].as_u64().unwrap_or(0) >= 1, "{v}");
    let q = t.ns(&t.replica, &[pliant(), "query", "--socket", &sock]);
    let q: serde_json::Value = serde_json::from_str(&q).expect("query JSON");
    assert!(q["mappings"].as_u64().unwrap_or(0) >= 1, "{q}");
    let m = t.ns(
        &t.replica,
        &[pliant(), "stats", "--socket", &sock, "--metrics"],
    );
    assert!(m.contains("pliant_frames_in_total{"), "{m}");

    // 1000 concurrent UDP flows: each gets its own external port, every echo comes back to
    // the right socket, and the server sees only the NAT address.
    let udp_server = t.dir.join("udp_server.py");
    std::fs::write(&udp_server, UDP_SERVER).unwrap();
    let udp_client = t.dir.join("udp_client.py");
    std::fs::write(&udp_client, UDP_CLIENT).unwrap();
    let seen = t.dir.join("seen.json");
    let srv = t.server.clone();
    t.spawn(
        &srv,
        &[
            "/usr/bin/python3",
            udp_server.to_str().unwrap(),
            seen.to_str().unwrap(),
        ],
        "udp_server.log",
    );
    wait_for("udp server", Duration::from_secs(10), || {
        t.log("udp_server.log").contains("ready")
    });
    let got = t.ns(
        &t.client,
        &["/usr/bin/python3", udp_client.to_str().unwrap(), "1000"],
    );
    assert_eq!(got.trim(), "1000 echoes ok", "client: {got}");
    let q = t.ns(&t.replica, &[pliant(), "query", "--socket", &sock]);
    let q: serde_json::Value = serde_json::from_str(&q).expect("query JSON");
    assert!(
        q["pools"]["udp"]["in_use"].as_u64().unwrap_or(0) >= 1000,
        "{q}"
    );
    // The pool (1000 ports) is full now (for the 15 s UDP timeout: long enough that a loaded
    // machine finishes the 1000 echoes before the first mapping expires), every port with a
    // mapping to 10.201.2.2:9999: one more flow there is a counted refusal, and the replica
    // keeps running.
    let stats = || {
        let v = t.ns(
            &t.replica,
            &[pliant(), "stats", "--socket", &sock, "--json"],
        );
        serde_json::from_str::<serde_json::Value>(v.trim()).unwrap_or_default()
    };
    // Each probe is re-sent every second until counted (a datagram may be lost at a ring on
    // a loaded machine; every copy is a new flow from a new source port, which only adds to
    // the counts).
    let probe = |what: &str, cmd: &str, counted: &dyn Fn(&serde_json::Value) -> bool| {
        let mut tries = 0;
        wait_for(what, Duration::from_secs(10), || {
            if tries % 20 == 0 {
                t.ns(&t.client, &["bash", "-c", cmd]);
            }
            tries += 1;
            counted(&stats())
        });
    };
    probe(
        "exhaustion counted",
        "echo extra > /dev/udp/10.201.2.2/9999",
        &|v| v["drops"]["nat_port_exhausted"].as_u64().unwrap_or(0) >= 1,
    );
    // Another destination is another tuple: it shares a port in use.
    probe(
        "port shared",
        "echo other > /dev/udp/10.201.2.2/9998",
        &|v| v["nf_counters"]["nat_port_shared"].as_u64().unwrap_or(0) >= 1,
    );
    wait_for("udp server report", Duration::from_secs(10), || {
        seen.exists()
    });
    let seen: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&seen).unwrap()).expect("seen JSON");
    assert_eq!(seen["addrs"], serde_json::json!(["10.201.2.1"]), "{seen}");
    assert_eq!(seen["distinct_ports"], 1000, "{seen}");
    for p in seen["ports"].as_array().unwrap() {
        let p = p.as_u64().unwrap();
        assert!(
            (30000..=30999).contains(&p),
            "port {p} outside the configured pool"
        );
    }

    // Mappings expire (15 s UDP / 2 s ICMP timeouts in this config) and return their ports.
    wait_for("udp/icmp mapping expiry", Duration::from_secs(45), || {
        let q = t.ns(&t.replica, &[pliant(), "query", "--socket", &sock]);
        let q: serde_json::Value = serde_json::from_str(&q).unwrap_or_default();
        q["pools"]["icmp"]["in_use"] == 0 && q["pools"]["udp"]["in_use"] == 0
    });

    // Clean shutdown: SIGTERM removes the filter and the socket.
    // SAFETY: kill(2) on our own child.
    unsafe { libc_kill(t.children[replica].id() as i32, 15) };
    let status = t.children[replica].wait().unwrap();
    assert!(
        status.success(),
        "replica exit: {status}\n{}",
        t.log("replica.log")
    );
    assert!(!std::path::Path::new(&sock).exists(), "socket left behind");
    let filters = t.ns(
        &t.replica,
        &["tc", "filter", "show", "dev", "rin", "ingress"],
    );
    assert!(
        !filters.contains("pliant_drop"),
        "tc filter left behind: {filters}"
    );
}

/// Counts the bytes of one TCP connection on 10.201.2.2:9000 and prints the total.
const SINK: &str = r#"
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("10.201.2.2", 9000))
s.listen(1)
print("ready", flush=True)
c, _ = s.accept()
n = 0
while True:
    b = c.recv(65536)
    if not b:
        break
    n += len(b)
print("got", n, flush=True)
"#;

/// Sends N UDP frames whose IPv4 header checksum is wrong (everything else valid) on an
/// interface, to a MAC: `badsum.py IFACE DST_MAC SRC_IP DST_IP PORT N`.
const BAD_CHECKSUM: &str = r#"
import socket, struct, sys
ifname, dst_mac, src, dst, port, n = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
s.bind((ifname, 0))
src_mac = open("/sys/class/net/%s/address" % ifname).read().strip()
mac = lambda m: bytes(int(x, 16) for x in m.split(":"))
payload = b"bad header checksum"
udp = struct.pack("!HHHH", port, port, 8 + len(payload), 0) + payload
def csum(b):
    t = sum(struct.unpack("!%dH" % (len(b) // 2), b))
    while t >> 16:
        t = (t & 0xffff) + (t >> 16)
    return ~t & 0xffff
hdr = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 1, 0, 64, 17, 0,
                  socket.inet_aton(src), socket.inet_aton(dst))
good = csum(hdr)
hdr = hdr[:10] + struct.pack("!H", good ^ 0x5a5a) + hdr[12:]
frame = mac(dst_mac) + mac(src_mac) + b"\x08\x00" + hdr + udp
for _ in range(n):
    s.send(frame)
print("sent", n)
"#;

/// The router role against what the kernel router does: traceroute (ICMP-free UDP probes and
/// `-T` TCP SYN probes) sees the NAT hop (time exceeded from the inside address), a 1 MB upload
/// with DF completes over an outside link of MTU 1280 (fragmentation needed teaches the client
/// the path MTU, which its route cache then shows), and unicast frames for another MAC or with
/// a bad IPv4 header checksum create no mapping and are counted.
#[test]
fn nat_router_ttl_mtu_and_foreign_mac() {
    if !pliant_testkit::require_root() {
        return;
    }
    let mut t = Topo::new(true);
    // Only the replica's side of the outside link: the server announces an MSS for 1500, so
    // TCP's MSS negotiation alone does not avoid oversized segments.
    t.ns(&t.replica, &["ip", "link", "set", "rout", "mtu", "1280"]);
    let sock = t.dir.join("r.sock").to_str().unwrap().to_string();
    let cfg = t.dir.join("replica.toml");
    std::fs::write(&cfg, t.config(&sock)).unwrap();
    t.start_replica("PLIANT_VNET_HDR=1", &cfg, &sock);
    let sink = t.dir.join("sink.py");
    std::fs::write(&sink, SINK).unwrap();
    let srv = t.server.clone();
    t.spawn(
        &srv,
        &["/usr/bin/python3", sink.to_str().unwrap()],
        "sink.log",
    );
    wait_for("sink", Duration::from_secs(10), || {
        t.log("sink.log").contains("ready")
    });

    // traceroute -n (UDP probes), then -T (TCP SYN probes to the sink's port): hop 1 is the
    // NAT's inside address, hop 2 the server. The TTL check runs before the NAT, so a TTL-1
    // SYN makes no mapping and is answered from the inside address.
    for probes in [&[][..], &["-T", "-p", "9000"][..]] {
        let mut args = vec!["traceroute", "-n"];
        args.extend_from_slice(probes);
        args.extend_from_slice(&["-q", "1", "-w", "2", "-m", "3", "10.201.2.2"]);
        let tr = t.ns(&t.client, &args);
        eprintln!("{tr}");
        assert!(
            tr.lines()
                .any(|l| l.trim_start().starts_with("1 ") && l.contains("10.201.1.1")),
            "the NAT hop is missing ({probes:?}):\n{tr}"
        );
        assert!(
            tr.lines()
                .any(|l| l.contains("10.201.2.2 ") && !l.starts_with("traceroute")),
            "{tr}"
        );
    }

    // 1 MB upload with DF (Linux TCP sets it) through the MTU-1280 outside link.
    let up = t.ns(
        &t.client,
        &[
            "timeout",
            "20",
            "bash",
            "-c",
            "head -c 1000000 /dev/zero > /dev/tcp/10.201.2.2/9000",
        ],
    );
    eprintln!("{up}");
    wait_for("upload received", Duration::from_secs(10), || {
        t.log("sink.log").contains("got")
    });
    assert!(
        t.log("sink.log").contains("got 1000000"),
        "{}",
        t.log("sink.log")
    );
    // The client learned the path MTU from the NAT's "fragmentation needed".
    let route = t.ns(&t.client, &["ip", "route", "get", "10.201.2.2"]);
    assert!(
        route.contains("mtu 1280"),
        "the client did not learn the path MTU: {route}"
    );

    // Frames with a bad IPv4 header checksum, to the replica's own MAC: dropped before the
    // NAT, counted, no mapping.
    let rin_mac = t.ns(&t.replica, &["cat", "/sys/class/net/rin/address"]);
    let badsum = t.dir.join("badsum.py");
    std::fs::write(&badsum, BAD_CHECKSUM).unwrap();
    t.ns(
        &t.client,
        &[
            "/usr/bin/python3",
            badsum.to_str().unwrap(),
            "c0",
            rin_mac.trim(),
            "10.201.1.2",
            "10.201.2.2",
            "7778",
            "5",
        ],
    );

    // Frames for another MAC: dropped before the NAT, counted, no mapping.
    t.ns(
        &t.client,
        &[
            "mausezahn",
            "c0",
            "-q",
            "-c",
            "5",
            "-a",
            "02:00:00:00:00:77",
            "-b",
            "02:00:00:00:00:99",
            "-A",
            "10.201.1.2",
            "-B",
            "10.201.2.2",
            "-t",
            "udp",
            "sp=7777,dp=7777",
        ],
    );
    let v: serde_json::Value = serde_json::from_str(
        t.ns(
            &t.replica,
            &[pliant(), "stats", "--socket", &sock, "--json"],
        )
        .trim(),
    )
    .expect("stats JSON");
    eprintln!("replica stats: {v}");
    assert!(
        v["drops"]["l2_foreign_dst"].as_u64().unwrap_or(0) >= 5,
        "{v}"
    );
    assert!(
        v["drops"]["bad_ipv4_checksum"].as_u64().unwrap_or(0) >= 5,
        "{v}"
    );
    assert!(v["drops"]["frag_needed"].as_u64().unwrap_or(0) >= 1, "{v}");
    assert!(v["drops"]["ttl_exceeded"].as_u64().unwrap_or(0) >= 1, "{v}");
    assert!(
        v["engine"]["inside"]["icmp_errors_sent"]
            .as_u64()
            .unwrap_or(0)
            >= 2,
        "{v}"
    );
    let q = t.ns(&t.replica, &[pliant(), "query", "--socket", &sock]);
    assert!(
        !q.contains(":7777"),
        "a foreign-MAC frame made a mapping: {q}"
    );
    assert!(
        !q.contains(":7778"),
        "a frame with a bad header checksum made a mapping: {q}"
    );
}
