//! The kernel HA peer for `bench ha`: two Linux NAT routers in their own namespaces sharing
//! VRRP virtual addresses (keepalived, VRRP v3, 100 ms adverts), with conntrackd (FTFW over UDP
//! on a dedicated sync veth) replicating the conntrack/NAT table, and keepalived notify scripts
//! doing the stock conntrackd primary-backup actions (commit, flush, resync, bulk send on
//! becoming master; shorten timers and request a resync on becoming backup).
//!
//! ```text
//!                  ┌─ ra: c0 10.78.1.2 ─ nft snat → 10.78.2.1 ─ s0 10.78.2.2 ─┐
//! client ns br0 ───┤   (VIPs 10.78.1.1 / 10.78.2.1 on the VRRP master)         ├─── br0 server ns
//! 10.78.1.10       └─ rb: c0 10.78.1.3 ─ nft snat → 10.78.2.1 ─ s0 10.78.2.3 ─┘     10.78.2.10
//!                      ra sync0 10.78.3.1 ────── conntrackd FTFW ────── rb sync0 10.78.3.2
//! ```
//! The client's default route is the inside VIP; the routers source-NAT the client subnet (only
//! it: their own VRRP adverts must not be translated) to the outside VIP, so the server answers
//! to whichever router holds it. keepalived runs without systemd with per-instance pid files,
//! conntrackd with per-instance lock/socket/log paths, all under one run directory; every
//! namespace name carries a unique id and [`KernelPeer`]'s `Drop` removes everything.
//!
//! Failover ([`KernelPeer::kill_master`]): delete the master's three veths (the link cut), then
//! SIGKILL its keepalived (parent and VRRP child) and conntrackd. The backup notices the missing
//! adverts (~3 advert intervals plus skew), takes the VIPs, sends gratuitous ARPs and runs the
//! notify script that commits the replicated conntrack entries into its kernel table.

use crate::txload::Marker;
use crate::BenchError;
use pliant_lab::cmd;
use std::net::Ipv4Addr;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(10, 78, 1, 10);
pub const SERVER_IP: Ipv4Addr = Ipv4Addr::new(10, 78, 2, 10);
pub const INSIDE_VIP: &str = "10.78.1.1";
pub const OUTSIDE_VIP: &str = "10.78.2.1";
const CLIENT_NET: &str = "10.78.1.0/24";
/// VRRP advertisement interval (VRRP v3 allows sub-second adverts).
pub const ADVERT_INT_S: f64 = 0.1;
/// How long both routers may take to settle into master/backup after start.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(15);
const STOP_GRACE: Duration = Duration::from_secs(3);

/// One router of the pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Router {
    A,
    B,
}

impl Router {
    fn tag(self) -> &'static str {
        match self {
            Router::A => "ra",
            Router::B => "rb",
        }
    }
    fn host(self) -> u8 {
        match self {
            Router::A => 2,
            Router::B => 3,
        }
    }
    fn sync_ip(self) -> String {
        format!("10.78.3.{}", self.host() - 1)
    }
    fn peer(self) -> Router {
        match self {
            Router::A => Router::B,
            Router::B => Router::A,
        }
    }
    /// Initial VRRP priority: A starts as master.
    fn priority(self) -> u8 {
        match self {
            Router::A => 150,
            Router::B => 100,
        }
    }
}

/// conntrackd.conf for one router: FTFW over UDP on sync0, TCP and UDP entries, local and sync
/// addresses ignored (only forwarded client flows are replicated).
pub fn conntrackd_conf(r: Router, dir: &Path) -> String {
    let p = |s: &str| dir.join(format!("{}-{s}", r.tag())).display().to_string();
    let (me, peer) = (r.sync_ip(), r.peer().sync_ip());
    let mut ignore = String::new();
    for a in [
        "127.0.0.1".to_string(),
        me.clone(),
        peer.clone(),
        format!("10.78.1.{}", Router::A.host()),
        format!("10.78.1.{}", Router::B.host()),
        format!("10.78.2.{}", Router::A.host()),
        format!("10.78.2.{}", Router::B.host()),
    ] {
        ignore.push_str(&format!("\t\t\tIPv4_address {a}\n"));
    }
    format!(
        "Sync {{\n\
         \tMode FTFW {{\n\
         \t\tDisableExternalCache off\n\
         \t\tCommitTimeout 1800\n\
         \t\tPurgeTimeout 5\n\
         \t}}\n\
         \tUDP {{\n\
         \t\tIPv4_address {me}\n\
         \t\tIPv4_Destination_Address {peer}\n\
         \t\tPort 3780\n\
         \t\tInterface sync0\n\
         \t\tSndSocketBuffer 1249280\n\
         \t\tRcvSocketBuffer 1249280\n\
         \t\tChecksum on\n\
         \t}}\n\
         }}\n\
         General {{\n\
         \tSystemd off\n\
         \tHashSize 32768\n\
         \tHashLimit 131072\n\
         \tLogFile {log}\n\
         \tSyslog off\n\
         \tLockFile {lock}\n\
         \tUNIX {{\n\
         \t\tPath {ctl}\n\
         \t}}\n\
         \tNetlinkBufferSize 2097152\n\
         \tNetlinkBufferSizeMaxGrowth 8388608\n\
         \tFilter From Userspace {{\n\
         \t\tProtocol Accept {{\n\
         \t\t\tTCP\n\
         \t\t\tUDP\n\
         \t\t}}\n\
         \t\tAddress Ignore {{\n\
         {ignore}\
         \t\t}}\n\
         \t}}\n\
         }}\n",
        log = p("conntrackd.log"),
        lock = p("conntrackd.lock"),
        ctl = p("conntrackd.ctl"),
    )
}

/// The notify script: the stock primary-backup.sh actions for this router's conntrackd.
pub fn notify_script(r: Router, dir: &Path) -> String {
    let conf = dir.join(format!("{}-conntrackd.conf", r.tag()));
    let log = dir.join(format!("{}-notify.log", r.tag()));
    format!(
        "#!/bin/sh\n\
         # keepalived notify for {tag}: conntrackd primary-backup actions.\n\
         C=\"conntrackd -C {conf}\"\n\
         echo \"$(date +%s.%N) $1\" >> {log}\n\
         case \"$1\" in\n\
         primary)\n\
         \t$C -c\n\
         \t$C -f\n\
         \t$C -R\n\
         \t$C -B\n\
         \t;;\n\
         backup)\n\
         \t$C -t\n\
         \t$C -n\n\
         \t;;\n\
         fault)\n\
         \t$C -t\n\
         \t;;\n\
         esac\n\
         echo \"$(date +%s.%N) $1 done\" >> {log}\n\
         exit 0\n",
        tag = r.tag(),
        conf = conf.display(),
        log = log.display(),
    )
}

/// keepalived.conf: a sync group of the inside and outside VRRP instances so both VIPs move
/// together, notify scripts on the group.
pub fn keepalived_conf(r: Router, dir: &Path, vrid_base: u8) -> String {
    let script = dir
        .join(format!("{}-notify.sh", r.tag()))
        .display()
        .to_string();
    let inst = |name: &str, ifname: &str, vrid: u8, vip: &str| {
        format!(
            "vrrp_instance {name} {{\n\
             \tstate BACKUP\n\
             \tinterface {ifname}\n\
             \tvirtual_router_id {vrid}\n\
             \tpriority {prio}\n\
             \tadvert_int {ADVERT_INT_S}\n\
             \tvirtual_ipaddress {{\n\
             \t\t{vip}/24 dev {ifname}\n\
             \t}}\n\
             }}\n",
            prio = r.priority()
        )
    };
    format!(
        "global_defs {{\n\
         \trouter_id pliant_{tag}\n\
         \tvrrp_version 3\n\
         \tscript_user root\n\
         \tenable_script_security\n\
         \tvrrp_garp_master_delay 1\n\
         \tvrrp_garp_master_repeat 3\n\
         }}\n\
         vrrp_sync_group PLIANT {{\n\
         \tgroup {{\n\
         \t\tVI_IN\n\
         \t\tVI_OUT\n\
         \t}}\n\
         \tnotify_master \"{script} primary\"\n\
         \tnotify_backup \"{script} backup\"\n\
         \tnotify_fault \"{script} fault\"\n\
         }}\n\
         {a}{b}",
        tag = r.tag(),
        a = inst("VI_IN", "c0", vrid_base, INSIDE_VIP),
        b = inst("VI_OUT", "s0", vrid_base.wrapping_add(1), OUTSIDE_VIP),
    )
}

/// nftables rules of a router: source NAT of the client subnet to the outside VIP, and drop
/// of packets conntrack calls invalid. With `nf_conntrack_tcp_loose=0` (set by [`KernelPeer`])
/// a mid-stream TCP segment without an entry is invalid: a router that just took the VIPs
/// drops the server's retransmissions until its notify script has committed the replicated
/// entries, instead of answering them with a RST from its own stack (it owns the VIP) — the
/// conntrack-tools manual's advice for FTFW set-ups; without it connections die at random in
/// that race. One statement per line: nft 1.0.6 rejects one-line table definitions.
pub fn nat_rules() -> String {
    format!(
        "table ip pliantha {{\n\
         \tchain postrouting {{\n\
         \t\ttype nat hook postrouting priority 100; policy accept;\n\
         \t\tip saddr {CLIENT_NET} oifname \"s0\" snat to {OUTSIDE_VIP}\n\
         \t}}\n\
         \tchain forward {{\n\
         \t\ttype filter hook forward priority 0; policy accept;\n\
         \t\tct state invalid counter drop\n\
         \t}}\n\
         \tchain input {{\n\
         \t\ttype filter hook input priority 0; policy accept;\n\
         \t\tct state invalid counter drop\n\
         \t}}\n\
         }}\n"
    )
}

/// A process we started (process-group leader), stopped by PID at teardown.
struct Proc {
    what: String,
    child: Child,
}

/// The running peer. Dropping it kills every process it started and deletes its namespaces.
pub struct KernelPeer {
    id: String,
    dir: PathBuf,
    namespaces: Vec<String>,
    procs: Vec<Proc>,
    /// Routers whose links were cut (their namespaces stay until teardown).
    cut: Vec<Router>,
}

fn tool(tool: &'static str) -> impl Fn(pliant_lab::LabError) -> BenchError {
    move |e| BenchError::Tool {
        tool,
        reason: e.to_string(),
    }
}

fn argv(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

fn unique_id() -> String {
    let mut b = [0u8; 2];
    let _ = std::fs::File::open("/dev/urandom").and_then(|mut f| {
        use std::io::Read;
        f.read_exact(&mut b)
    });
    format!(
        "kh{:x}{:02x}{:02x}",
        std::process::id() % 0xfffff,
        b[0],
        b[1]
    )
}

impl KernelPeer {
    /// Namespace of a role: `<id>-cl`, `<id>-ra`, `<id>-rb`, `<id>-sv`.
    pub fn ns(&self, role: &str) -> String {
        format!("{}-{role}", self.id)
    }
    pub fn client_ns(&self) -> String {
        self.ns("cl")
    }
    pub fn server_ns(&self) -> String {
        self.ns("sv")
    }
    pub fn router_ns(&self, r: Router) -> String {
        self.ns(r.tag())
    }
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn run(&self, ns: Option<&str>, args: &[&str]) -> Result<String, BenchError> {
        let a = match ns {
            Some(ns) => cmd::in_ns(ns, args),
            None => argv(args),
        };
        let out = cmd::run_ok(&a, cmd::SETUP_TIMEOUT).map_err(tool("setup"))?;
        Ok(out.stdout)
    }

    fn spawn(&mut self, ns: &str, args: &[&str], what: &str) -> Result<u32, BenchError> {
        let log = self.dir.join(format!("{what}.out"));
        let f = std::fs::File::create(&log).map_err(|e| BenchError::Io(log.clone(), e))?;
        let f2 = f.try_clone().map_err(|e| BenchError::Io(log.clone(), e))?;
        let child = Command::new("ip")
            .args(["netns", "exec", ns])
            .args(args)
            .stdin(Stdio::null())
            .stdout(f)
            .stderr(f2)
            .process_group(0)
            .spawn()
            .map_err(|e| BenchError::Tool {
                tool: "spawn",
                reason: format!("{what}: {e}"),
            })?;
        let pid = child.id();
        self.procs.push(Proc {
            what: what.to_string(),
            child,
        });
        Ok(pid)
    }

    /// Build the topology and start both routers' daemons; returns once A is master with both
    /// VIPs and B is backup.
    pub fn up(run_root: &Path) -> Result<KernelPeer, BenchError> {
        let id = unique_id();
        let dir = run_root.join(&id);
        std::fs::create_dir_all(&dir).map_err(|e| BenchError::Io(dir.clone(), e))?;
        let mut p = KernelPeer {
            id,
            dir,
            namespaces: Vec::new(),
            procs: Vec::new(),
            cut: Vec::new(),
        };
        // On error `p` is dropped here and removes what was made.
        p.build()?;
        Ok(p)
    }

    fn build(&mut self) -> Result<(), BenchError> {
        for role in ["cl", "sv", "ra", "rb"] {
            let ns = self.ns(role);
            self.run(None, &["ip", "netns", "add", &ns])?;
            self.namespaces.push(ns.clone());
            self.run(Some(&ns), &["ip", "link", "set", "lo", "up"])?;
        }
        let (cl, sv) = (self.client_ns(), self.server_ns());
        // Bridges in the client and server namespaces stand for the two LAN segments.
        for (ns, ip) in [(&cl, CLIENT_IP), (&sv, SERVER_IP)] {
            self.run(
                Some(ns),
                &[
                    "ip",
                    "link",
                    "add",
                    "br0",
                    "type",
                    "bridge",
                    "stp_state",
                    "0",
                ],
            )?;
            self.run(
                Some(ns),
                &["ip", "addr", "add", &format!("{ip}/24"), "dev", "br0"],
            )?;
            self.run(Some(ns), &["ip", "link", "set", "br0", "up"])?;
        }
        for r in [Router::A, Router::B] {
            let rns = self.router_ns(r);
            let t = r.tag();
            for (lan_ns, ifname, br_port, net) in [(&cl, "c0", "c", 1u8), (&sv, "s0", "s", 2u8)] {
                let port = format!("{br_port}{t}");
                self.run(
                    None,
                    &[
                        "ip", "link", "add", &port, "netns", lan_ns, "type", "veth", "peer",
                        "name", ifname, "netns", &rns,
                    ],
                )?;
                self.run(Some(lan_ns), &["ip", "link", "set", &port, "master", "br0"])?;
                self.run(Some(lan_ns), &["ip", "link", "set", &port, "up"])?;
                let addr = format!("10.78.{net}.{}/24", r.host());
                self.run(Some(&rns), &["ip", "addr", "add", &addr, "dev", ifname])?;
                self.run(Some(&rns), &["ip", "link", "set", ifname, "up"])?;
            }
            self.run(Some(&rns), &["sysctl", "-qw", "net.ipv4.ip_forward=1"])?;
            // See `nat_rules`: mid-stream segments must not create entries on the backup.
            self.run(
                Some(&rns),
                &["sysctl", "-qw", "net.netfilter.nf_conntrack_tcp_loose=0"],
            )?;
        }
        let (ra, rb) = (self.router_ns(Router::A), self.router_ns(Router::B));
        self.run(
            None,
            &[
                "ip", "link", "add", "sync0", "netns", &ra, "type", "veth", "peer", "name",
                "sync0", "netns", &rb,
            ],
        )?;
        for r in [Router::A, Router::B] {
            let rns = self.router_ns(r);
            let a = format!("{}/24", r.sync_ip());
            self.run(Some(&rns), &["ip", "addr", "add", &a, "dev", "sync0"])?;
            self.run(Some(&rns), &["ip", "link", "set", "sync0", "up"])?;
        }
        self.run(
            Some(&cl),
            &["ip", "route", "add", "default", "via", INSIDE_VIP],
        )?;
        // Write configs, then start conntrackd first (the notify script talks to it).
        let nat = self.dir.join("nat.nft");
        std::fs::write(&nat, nat_rules()).map_err(|e| BenchError::Io(nat.clone(), e))?;
        let nat_s = nat.display().to_string();
        // A VRID unique-ish per peer instance: VRRP adverts never leave our namespaces anyway.
        let vrid = 10 + (std::process::id() % 200) as u8;
        for r in [Router::A, Router::B] {
            let rns = self.router_ns(r);
            self.run(Some(&rns), &["nft", "-f", &nat_s])?;
            let t = r.tag();
            let write = |name: String, text: String| {
                let path = self.dir.join(name);
                std::fs::write(&path, text).map_err(|e| BenchError::Io(path.clone(), e))?;
                Ok::<PathBuf, BenchError>(path)
            };
            let ct = write(
                format!("{t}-conntrackd.conf"),
                conntrackd_conf(r, &self.dir),
            )?;
            let sh = write(format!("{t}-notify.sh"), notify_script(r, &self.dir))?;
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&sh, std::fs::Permissions::from_mode(0o755))
                .map_err(|e| BenchError::Io(sh.clone(), e))?;
            let ka = write(
                format!("{t}-keepalived.conf"),
                keepalived_conf(r, &self.dir, vrid),
            )?;
            let ct_s = ct.display().to_string();
            self.spawn(
                &rns,
                &["conntrackd", "-C", &ct_s],
                &format!("{t}-conntrackd"),
            )?;
            self.wait_file(
                &self.dir.join(format!("{t}-conntrackd.ctl")),
                &format!("{t} conntrackd control socket"),
            )?;
            let ka_s = ka.display().to_string();
            let pidf = self.dir.join(format!("{t}-keepalived.pid"));
            let vpidf = self.dir.join(format!("{t}-vrrp.pid"));
            let (pid_s, vpid_s) = (pidf.display().to_string(), vpidf.display().to_string());
            self.spawn(
                &rns,
                &[
                    "keepalived",
                    "-n",
                    "-l",
                    "-D",
                    "-P",
                    "-f",
                    &ka_s,
                    "-p",
                    &pid_s,
                    "-r",
                    &vpid_s,
                ],
                &format!("{t}-keepalived"),
            )?;
        }
        self.wait_roles()
    }

    fn wait_file(&mut self, path: &Path, what: &str) -> Result<(), BenchError> {
        let t = Instant::now();
        while !path.exists() {
            if let Some(dead) = self.dead_proc() {
                return Err(BenchError::Tool {
                    tool: "kernel peer",
                    reason: format!("{dead} exited while waiting for {what}"),
                });
            }
            if t.elapsed() > SETTLE_TIMEOUT {
                return Err(BenchError::Tool {
                    tool: "kernel peer",
                    reason: format!("timed out waiting for {what}"),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// The first started process that has exited, with the tail of its output.
    fn dead_proc(&mut self) -> Option<String> {
        for p in &mut self.procs {
            if let Ok(Some(st)) = p.child.try_wait() {
                let log = pliant_lab::log_tail(&self.dir.join(format!("{}.out", p.what)), 5);
                return Some(format!("{} ({st}): {log}", p.what));
            }
        }
        None
    }

    /// Does router `r` hold both VIPs?
    pub fn holds_vips(&self, r: Router) -> bool {
        let ns = self.router_ns(r);
        let out = cmd::run(
            &cmd::in_ns(&ns, &["ip", "-4", "-o", "addr", "show"]),
            cmd::SETUP_TIMEOUT,
        );
        out.map(|o| {
            o.stdout.contains(&format!("{INSIDE_VIP}/24"))
                && o.stdout.contains(&format!("{OUTSIDE_VIP}/24"))
        })
        .unwrap_or(false)
    }

    fn wait_roles(&mut self) -> Result<(), BenchError> {
        let t = Instant::now();
        loop {
            if let Some(dead) = self.dead_proc() {
                return Err(BenchError::Tool {
                    tool: "kernel peer",
                    reason: format!("{dead} exited during start-up"),
                });
            }
            if self.holds_vips(Router::A) && !self.holds_vips(Router::B) {
                // Wait for the master's notify script to finish (it resyncs conntrackd).
                let log = self.dir.join("ra-notify.log");
                let done = std::fs::read_to_string(&log)
                    .map(|s| s.contains("primary done"))
                    .unwrap_or(false);
                if done {
                    break;
                }
            }
            if t.elapsed() > SETTLE_TIMEOUT {
                return Err(BenchError::Tool {
                    tool: "keepalived",
                    reason: format!(
                        "router A did not become master within {SETTLE_TIMEOUT:?}: {}",
                        pliant_lab::log_tail(&self.dir.join("ra-keepalived.out"), 8)
                    ),
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        // Prime ARP both ways so the first measured transaction does not pay for it.
        let cl = self.client_ns();
        let sv = self.server_ns();
        let _ = self.run(
            Some(&cl),
            &["ping", "-c", "2", "-i", "0.05", "-W", "1", OUTSIDE_VIP],
        );
        let _ = self.run(
            Some(&cl),
            &[
                "ping",
                "-c",
                "2",
                "-i",
                "0.05",
                "-W",
                "1",
                &SERVER_IP.to_string(),
            ],
        );
        let _ = sv;
        Ok(())
    }

    /// Start `iperf3 -s` in the server namespace.
    pub fn start_iperf_server(&mut self) -> Result<(), BenchError> {
        let sv = self.server_ns();
        self.spawn(
            &sv,
            &["iperf3", "-s", "-B", &SERVER_IP.to_string()],
            "iperf3-server",
        )?;
        std::thread::sleep(Duration::from_millis(300));
        Ok(())
    }

    /// PIDs of the HA daemons (conntrackd and keepalived parents plus VRRP children) of the
    /// routers whose links are intact.
    pub fn ha_pids(&self) -> Vec<i32> {
        let mut v = Vec::new();
        for r in [Router::A, Router::B] {
            if self.cut.contains(&r) {
                continue;
            }
            let t = r.tag();
            for p in &self.procs {
                if p.what == format!("{t}-conntrackd") || p.what == format!("{t}-keepalived") {
                    v.push(p.child.id() as i32);
                }
            }
            if let Some(pid) = read_pid(&self.dir.join(format!("{t}-vrrp.pid"))) {
                v.push(pid);
            }
        }
        v
    }

    /// Bytes sent on the sync link by both routers (conntrackd's replication traffic).
    pub fn sync_tx_bytes(&self) -> Result<u64, BenchError> {
        let mut sum = 0;
        for r in [Router::A, Router::B] {
            if self.cut.contains(&r) {
                continue;
            }
            let out = self.run(
                None,
                &[
                    "ip",
                    "-n",
                    &self.router_ns(r),
                    "-s",
                    "-j",
                    "link",
                    "show",
                    "dev",
                    "sync0",
                ],
            )?;
            sum += parse_tx_bytes(&out).ok_or_else(|| BenchError::Parse {
                what: "ip -s -j link (sync0)",
                reason: out.chars().take(200).collect(),
            })?;
        }
        Ok(sum)
    }

    /// Number of conntrack entries in a router's kernel table.
    pub fn conntrack_count(&self, r: Router) -> Option<u64> {
        let out = self
            .run(
                Some(&self.router_ns(r)),
                &["cat", "/proc/sys/net/netfilter/nf_conntrack_count"],
            )
            .ok()?;
        out.trim().parse().ok()
    }

    /// Router holding the VIPs now (the master), if exactly one does.
    pub fn master(&self) -> Option<Router> {
        match (self.holds_vips(Router::A), self.holds_vips(Router::B)) {
            (true, false) => Some(Router::A),
            (false, true) => Some(Router::B),
            _ => None,
        }
    }

    /// The failure: cut the master's links (its three veths deleted by one `ip -batch`, within
    /// microseconds of each other), set `marker` (the failure instant: the kernel forwards until
    /// the links go, so an earlier mark would credit the peer with packets it still forwarded),
    /// then SIGKILL its keepalived (parent and VRRP child) and conntrackd. The backup's VRRP
    /// detection starts from the last advert it got before the cut. Returns the router.
    pub fn kill_master(&mut self, marker: &Marker) -> Result<Router, BenchError> {
        let m = self.master().ok_or_else(|| BenchError::Tool {
            tool: "kernel peer",
            reason: "no single master before the kill".into(),
        })?;
        let batch = self.dir.join("cut.batch");
        std::fs::write(&batch, "link del c0\nlink del s0\nlink del sync0\n")
            .map_err(|e| BenchError::Io(batch.clone(), e))?;
        let rns = self.router_ns(m);
        let b = batch.display().to_string();
        self.cut.push(m);
        self.run(None, &["ip", "-n", &rns, "-batch", &b])?;
        marker.set();
        let t = m.tag();
        let vrrp = read_pid(&self.dir.join(format!("{t}-vrrp.pid")));
        for p in &mut self.procs {
            if p.what == format!("{t}-conntrackd") || p.what == format!("{t}-keepalived") {
                let pg = p.child.id() as i32;
                // SAFETY: SIGKILL to the process group of a child we spawned and have not
                // reaped (its PID cannot have been reused).
                unsafe { libc::kill(-pg, libc::SIGKILL) };
            }
        }
        if let Some(v) = vrrp {
            if pid_is_keepalived(v) {
                // SAFETY: the VRRP child of the keepalived we started, checked by cmdline.
                unsafe { libc::kill(v, libc::SIGKILL) };
            }
        }
        Ok(m)
    }

    fn teardown(&mut self) {
        for p in &mut self.procs {
            cmd::stop_group(&mut p.child, libc::SIGTERM, STOP_GRACE);
        }
        // keepalived's VRRP child may have left the group; end it by its recorded PID.
        for r in [Router::A, Router::B] {
            if let Some(v) = read_pid(&self.dir.join(format!("{}-vrrp.pid", r.tag()))) {
                if pid_is_keepalived(v) {
                    // SAFETY: a keepalived we started (cmdline checked), by PID.
                    unsafe { libc::kill(v, libc::SIGKILL) };
                }
            }
        }
        self.procs.clear();
        for ns in self.namespaces.drain(..).rev() {
            let _ = cmd::run(&argv(&["ip", "netns", "del", &ns]), cmd::SETUP_TIMEOUT);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }

    /// Tail of a file in the run directory (for error messages).
    pub fn log_tail(&self, name: &str, n: usize) -> String {
        pliant_lab::log_tail(&self.dir.join(name), n)
    }
}

impl Drop for KernelPeer {
    fn drop(&mut self) {
        self.teardown();
    }
}

fn read_pid(p: &Path) -> Option<i32> {
    std::fs::read_to_string(p).ok()?.trim().parse().ok()
}

fn pid_is_keepalived(pid: i32) -> bool {
    pliant_lab::state::proc_cmdline(pid).is_some_and(|c| c.contains("keepalived"))
}

/// tx bytes from `ip -s -j link show dev X`.
pub fn parse_tx_bytes(json: &str) -> Option<u64> {
    let v: serde_json::Value = serde_json::from_str(json).ok()?;
    v.get(0)?.get("stats64")?.get("tx")?.get("bytes")?.as_u64()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conntrackd_conf_uses_per_instance_paths_and_the_sync_link() {
        let c = conntrackd_conf(Router::B, Path::new("/run/x"));
        assert!(c.contains("LockFile /run/x/rb-conntrackd.lock"), "{c}");
        assert!(c.contains("Path /run/x/rb-conntrackd.ctl"), "{c}");
        assert!(c.contains("IPv4_address 10.78.3.2\n"), "{c}");
        assert!(c.contains("IPv4_Destination_Address 10.78.3.1"), "{c}");
        assert!(c.contains("Interface sync0"));
        assert!(
            c.contains("\t\t\tUDP\n"),
            "UDP entries must be replicated: {c}"
        );
        // The outside VIP is the NAT address of every replicated flow: never ignored.
        assert!(!c.contains(OUTSIDE_VIP), "{c}");
    }

    #[test]
    fn notify_script_runs_the_primary_backup_actions() {
        let s = notify_script(Router::A, Path::new("/run/x"));
        assert!(s.starts_with("#!/bin/sh\n"));
        assert!(s.contains("conntrackd -C /run/x/ra-conntrackd.conf"));
        let primary = s.split("primary)").nth(1).expect("primary branch");
        let body = primary.split(";;").next().expect("body");
        let order: Vec<&str> = ["-c", "-f", "-R", "-B"]
            .iter()
            .copied()
            .filter(|f| body.contains(&format!("$C {f}")))
            .collect();
        assert_eq!(order, ["-c", "-f", "-R", "-B"], "{body}");
    }

    #[test]
    fn keepalived_conf_is_vrrp3_with_fast_adverts_and_a_sync_group() {
        let k = keepalived_conf(Router::A, Path::new("/run/x"), 42);
        assert!(k.contains("vrrp_version 3"));
        assert!(k.contains("advert_int 0.1"), "{k}");
        assert!(k.contains("virtual_router_id 42") && k.contains("virtual_router_id 43"));
        assert!(k.contains("priority 150"));
        assert!(k.contains("notify_master \"/run/x/ra-notify.sh primary\""));
        assert!(k.contains("10.78.1.1/24 dev c0") && k.contains("10.78.2.1/24 dev s0"));
        assert!(keepalived_conf(Router::B, Path::new("/r"), 1).contains("priority 100"));
    }

    #[test]
    fn nat_rule_is_restricted_to_the_client_subnet_one_statement_per_line() {
        let n = nat_rules();
        assert!(n.contains("\t\tip saddr 10.78.1.0/24 oifname \"s0\" snat to 10.78.2.1\n"));
        assert!(!n.contains("fwd"), "reserved word in nft 1.0.6");
        assert!(n.contains("\t\tct state invalid counter drop\n"), "{n}");
        assert!(n.lines().count() >= 6);
    }

    #[test]
    fn tx_bytes_parse() {
        let j =
            r#"[{"ifname":"sync0","stats64":{"rx":{"bytes":5},"tx":{"bytes":1234,"packets":3}}}]"#;
        assert_eq!(parse_tx_bytes(j), Some(1234));
        assert_eq!(parse_tx_bytes("[]"), None);
        assert_eq!(parse_tx_bytes("not json"), None);
    }
}
