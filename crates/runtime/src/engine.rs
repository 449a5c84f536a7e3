//! The packet thread: polls both ports, runs the NF, routes its output, fires timers, answers
//! control requests. Generic over the NF and the port type, so the per-packet path has no
//! dynamic dispatch; tests drive it with in-memory ports (`pliant_io::MemPort`).
//!
//! One round (`poll_once`):
//! 1. receive up to `batch` frames per port (copied into recycled buffers);
//! 2. for each: parse (malformed: counted by `ParseError::reason()`, dropped); ARP goes to the
//!    router role (answer for our addresses, learn neighbours); non-IP is counted and dropped;
//!    IP frames glean the neighbour table and go to `NetworkFunction::process`;
//! 3. dispatch expired flow timers to `on_timer`;
//! 4. route the NF's output to its egress port (see [`crate::output`]);
//! 5. answer queued control requests; age the neighbour tables; flush the ports.
//!
//! `run` repeats rounds, blocking in poll(2) on the two port fds and the control wake-up fd
//! with the next timer deadline as timeout, until asked to stop.

use crate::control::{Cmd, ControlHandle};
use crate::metrics::{self, EngineStats, SideStats, Snapshot};
use crate::migrate::Migration;
use crate::neigh::{NeighLimits, NeighTable};
use crate::nf::{Ctx, NetworkFunction, Output, Packet, Side};
use crate::peer::PeerLink;
use crate::route::SideNet;
use pliant_io::{CsumPartial, FramePort, Offload};
use pliant_net::{arp, proto, ArpInfo, Frame};
use pliant_state::{FlowKey, FlowTable, SharedStore, TableConfig, TimerId};
use serde_json::{json, Value};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// Frames taken from each port per round.
    pub batch: usize,
    pub neigh: NeighLimits,
    pub table: TableConfig,
    /// Bound on packets the NF may write per round (beyond: `output_queue_full` drops).
    pub max_output: usize,
    /// Longest poll(2) sleep, so a stop request (signal) is noticed promptly.
    pub max_sleep: Duration,
    /// Flows listed by the `flows` control request at most.
    pub max_listed_flows: usize,
    /// Packets held for incoming flows at most (beyond: dropped, `hold_overflow`).
    pub max_held_packets: usize,
    /// The router's own ICMP errors (time exceeded, fragmentation needed): a token bucket of
    /// this many a second with this burst (RFC 1812 §4.3.2.8; the kernel's global default).
    pub icmp_errors_per_s: u32,
    pub icmp_errors_burst: u32,
    /// IPv4 reassembly before the NF (datagrams, bytes, time).
    pub reasm: pliant_net::reasm::ReasmLimits,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            batch: 64,
            neigh: NeighLimits::default(),
            table: TableConfig::default(),
            max_output: 4096,
            max_sleep: Duration::from_millis(100),
            max_listed_flows: 1000,
            max_held_packets: crate::migrate::MAX_HELD_PACKETS,
            icmp_errors_per_s: 1000,
            icmp_errors_burst: 50,
            reasm: pliant_net::reasm::ReasmLimits::default(),
        }
    }
}

fn idx(s: Side) -> usize {
    match s {
        Side::Inside => 0,
        Side::Outside => 1,
    }
}

const SIDES: [Side; 2] = [Side::Inside, Side::Outside];

/// Control requests served per round at most.
const CONTROL_PER_ROUND: usize = 4;

/// A received frame waiting for processing in this round.
struct Rx {
    side: Side,
    buf: Vec<u8>,
    /// CHECKSUM_PARTIAL reported without vnet_hdr (no offload metadata to carry it on).
    csum_not_ready: bool,
    truncated: bool,
    offload: Offload,
    /// Forwarded by a peer replica (a late packet of a flow that moved here): never held
    /// behind packets that arrived later, never forwarded again.
    forwarded: bool,
}

pub struct Engine<N: NetworkFunction, P: FramePort> {
    name: String,
    nf: N,
    pub ctx: Ctx<N::Flow>,
    ports: [P; 2],
    nets: [SideNet; 2],
    neigh: [NeighTable<(Vec<u8>, Offload)>; 2],
    stats: EngineStats,
    opts: EngineOptions,
    control: Option<ControlHandle>,
    rx: Vec<Rx>,
    out: Vec<Output>,
    timers: Vec<(FlowKey, TimerId)>,
    arp_due: Vec<IpAddr>,
    started: Instant,
    last_housekeeping: Instant,
    stop_requested: bool,
    /// Live migration state (holds, forwards, outgoing migrations).
    pub(crate) mig: Migration,
    peer: Option<PeerLink>,
    /// The last round slept: look at the peer sockets at once (not paced).
    peer_pump_due: bool,
    /// The ports' TX marks at the start of this round (kept while migrations go out).
    round_start_marks: [u64; 2],
    /// Whether this round's receive emptied both RX rings (fewer than `batch` frames each).
    rings_drained: bool,
    /// Per RX ring, a `CLOCK_REALTIME` instant (ns) such that every frame the ring held
    /// before it has been read: the start of the last receive that emptied the ring, or the
    /// ring stamp of the last frame read (frames are read in ring order). A busy ring that
    /// never runs empty still proves this way that the frames queued before a request were
    /// read (migration, "has every frame steered here before the switch been processed").
    rings_read_to_ns: [u64; 2],
    /// Pico replication / Remus mode, when a policy is set (`protect`).
    pub(crate) ha: Option<Box<crate::ha::HaPrimary>>,
    pub(crate) ha_side: ha::HaSide,
    /// FTMB mode (`[ha] mode = "ftmb"`): IP packets go to its worker threads (engine/ftmb.rs).
    pub(crate) ftmb: Option<Box<dyn crate::ftmb::FtmbMode>>,
    /// poll(2) sets of `sleep`, kept between calls so an idle replica does not allocate on
    /// every wake-up (capacity only; cleared and refilled each time).
    sleep_wake_fds: Vec<std::os::fd::RawFd>,
    sleep_pollfds: Vec<libc::pollfd>,
    /// Rate limit of the router's own ICMP errors.
    icmp_limit: crate::ratelimit::TokenBucket,
    /// IPv4 fragments waiting for the rest of their datagram.
    reasm: pliant_net::reasm::Reassembler,
}

impl<N: NetworkFunction, P: FramePort> Engine<N, P> {
    pub fn new(
        name: &str,
        nf: N,
        ports: [P; 2],
        nets: [SideNet; 2],
        opts: EngineOptions,
        now: Instant,
    ) -> Self {
        let mut ctx = Ctx::new(
            FlowTable::new(opts.table.clone()),
            SharedStore::default(),
            now,
        );
        ctx.max_output = opts.max_output;
        let icmp_limit =
            crate::ratelimit::TokenBucket::new(opts.icmp_errors_per_s, opts.icmp_errors_burst);
        Engine {
            icmp_limit,
            reasm: pliant_net::reasm::Reassembler::new(opts.reasm),
            name: name.to_string(),
            nf,
            ctx,
            ports,
            nets,
            neigh: [NeighTable::new(opts.neigh), NeighTable::new(opts.neigh)],
            stats: EngineStats::default(),
            opts,
            control: None,
            rx: Vec::new(),
            out: Vec::new(),
            timers: Vec::new(),
            arp_due: Vec::new(),
            started: now,
            last_housekeeping: now,
            stop_requested: false,
            mig: Migration::default(),
            peer: None,
            peer_pump_due: false,
            round_start_marks: [0; 2],
            rings_drained: false,
            rings_read_to_ns: [0; 2],
            ha: None,
            ha_side: ha::HaSide::default(),
            ftmb: None,
            sleep_wake_fds: Vec::new(),
            sleep_pollfds: Vec::new(),
        }
    }

    pub fn set_control(&mut self, c: ControlHandle) {
        self.control = Some(c);
    }

    /// Connects the engine to the replica-to-replica peer channel (migration).
    pub fn set_peer(&mut self, p: PeerLink) {
        self.peer = Some(p);
    }

    /// Migration counters.
    pub fn migrate_stats(&self) -> &crate::migrate::MigrateStats {
        &self.mig.stats
    }

    /// Packets currently held for incoming flows.
    pub fn held_packets(&self) -> usize {
        self.mig.held.len()
    }

    pub fn port_mut(&mut self, side: Side) -> &mut P {
        &mut self.ports[idx(side)]
    }

    pub fn nf(&self) -> &N {
        &self.nf
    }

    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    pub fn neighbours(&self, side: Side) -> &NeighTable<(Vec<u8>, Offload)> {
        &self.neigh[idx(side)]
    }

    /// True once a `shutdown` control request was served.
    pub fn stop_requested(&self) -> bool {
        self.stop_requested
    }

    fn side_stats(&mut self, s: Side) -> &mut SideStats {
        match s {
            Side::Inside => &mut self.stats.inside,
            Side::Outside => &mut self.stats.outside,
        }
    }

    /// Runs rounds until `stop` is set (by a signal handler) or a `shutdown` request.
    pub fn run(&mut self, stop: &AtomicBool) -> std::io::Result<()> {
        while !stop.load(Ordering::SeqCst) && !self.stop_requested {
            let now = Instant::now();
            if self.poll_once(now) == 0 {
                self.sleep(now)?;
            }
        }
        Ok(())
    }

    /// Blocks in poll(2) until a port or the control socket is readable or the next timer is due.
    fn sleep(&mut self, now: Instant) -> std::io::Result<()> {
        let mut timeout = self.opts.max_sleep;
        if let Some(dl) = self.ctx.flows.next_deadline() {
            timeout = timeout.min(dl.saturating_duration_since(now));
        }
        let mut ha_fds = std::mem::take(&mut self.sleep_wake_fds);
        ha_fds.clear();
        if let Some(f) = &self.ftmb {
            ha_fds.push(f.wake_fd()); // released FTMB output (drained with the HA fds)
        }
        if self.ha.is_some() {
            // The next epoch deadline, and acks / link state changes.
            if let Some(dl) = self.ha_sleep_params(now, &mut ha_fds) {
                timeout = timeout.min(dl.saturating_duration_since(now));
            }
        }
        let idle = libc::pollfd {
            fd: -1,
            events: 0,
            revents: 0,
        };
        let mut fds = std::mem::take(&mut self.sleep_pollfds);
        fds.clear();
        fds.resize(4 + ha_fds.len(), idle);
        let mut n = 0;
        for p in &self.ports {
            if let Some(fd) = p.poll_fd() {
                fds[n] = libc::pollfd {
                    fd,
                    events: libc::POLLIN,
                    revents: 0,
                };
                n += 1;
            }
        }
        let wake = n;
        if let Some(c) = &self.control {
            fds[n] = libc::pollfd {
                fd: c.wake_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            n += 1;
        }
        // The epoll set of every peer socket: readable when any of them needs attention.
        if let Some(fd) = self.peer.as_ref().and_then(PeerLink::poll_fd) {
            fds[n] = libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            };
            n += 1;
        }
        if self.peer.as_ref().is_some_and(PeerLink::has_pending) {
            // Frames already read wait for the engine: do not sleep on them.
            timeout = Duration::ZERO;
        }
        let ha_first = n;
        for fd in &ha_fds {
            fds[n] = libc::pollfd {
                fd: *fd,
                events: libc::POLLIN,
                revents: 0,
            };
            n += 1;
        }
        if let Some(w) = self.mig.round_wait() {
            // An outgoing migration advances on quiet rounds: do not sleep through them.
            timeout = timeout.min(w);
        }
        if n == 0 || timeout.is_zero() {
            self.sleep_wake_fds = ha_fds;
            self.sleep_pollfds = fds;
            return Ok(());
        }
        // Round up so a deadline 0.4 ms away does not turn into a busy loop of 0 ms polls.
        let ms = i32::try_from(timeout.as_micros().div_ceil(1000)).unwrap_or(i32::MAX);
        // SAFETY: `fds` holds at least `n` valid pollfd structs.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), n as libc::nfds_t, ms) };
        if rc < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                self.sleep_wake_fds = ha_fds;
                self.sleep_pollfds = fds;
                return Err(e);
            }
        }
        // Drain wake-ups here, not every round: a byte left unread would make every later
        // poll return at once (a busy loop); the requests themselves are taken by
        // `serve_control` in the next round.
        if let Some(c) = &self.control {
            if wake < n && fds[wake].revents & libc::POLLIN != 0 {
                c.drain_wake();
            }
        }
        self.peer_pump_due = true;
        if fds[ha_first..n]
            .iter()
            .any(|f| f.revents & libc::POLLIN != 0)
        {
            self.ha_drain_wakes();
            self.ftmb_drain_wake();
        }
        self.sleep_wake_fds = ha_fds;
        self.sleep_pollfds = fds;
        Ok(())
    }

    /// One round at time `now`. Returns the number of frames received.
    pub fn poll_once(&mut self, now: Instant) -> usize {
        self.ctx.set_now(now);
        self.stats.rounds += 1;
        // Flows worked on from here on are stamped with this round (migration's output marks).
        self.ctx.flows.set_epoch(self.stats.rounds);
        if !self.mig.out.is_empty() {
            self.round_start_marks = [0, 1].map(|i| self.ports[i].tx_mark());
        }
        // Peer messages first: forwarded late packets and batches are older than what the
        // fabric delivers now.
        if self.peer.is_some() {
            self.poll_peer(now);
        }
        // Acks first: output they release leaves before this round's, and this round's
        // verdicts see them.
        if self.ha.is_some() {
            self.ha_poll(now);
        }
        self.receive();
        let received = self.rx.len();
        let mut rx = std::mem::take(&mut self.rx);
        for f in rx.drain(..) {
            self.handle_frame(f, now);
        }
        self.rx = rx;
        self.fire_timers(now);
        self.route_output(now);
        self.serve_control(now);
        if self.ha.is_some() {
            // Between batches: the NF is not running while flows are copied.
            self.ha_step(now);
        }
        if now.saturating_duration_since(self.last_housekeeping) >= Duration::from_millis(100) {
            self.housekeeping(now);
        }
        for s in SIDES {
            // A failed flush leaves frames queued in the port; it retries next round.
            let _ = self.ports[idx(s)].flush();
        }
        // After the flush: the output of every frame processed so far is on the wire before
        // a batch can let the destination emit frames of the same flows.
        if !self.mig.out.is_empty() {
            self.step_out_migrations(now);
        }
        if !self.mig.connecting.is_empty() {
            self.step_peer_connects(now);
        }
        received
    }

    fn receive(&mut self) {
        let batch = self.opts.batch;
        self.rings_drained = true;
        let started_ns = realtime_ns();
        for s in SIDES {
            let before = self.rx.len();
            let Engine {
                ports,
                rx,
                ctx,
                rings_read_to_ns,
                ..
            } = self;
            let port = &mut ports[idx(s)];
            let read_to = &mut rings_read_to_ns[idx(s)];
            let res = port.recv_batch_meta(batch, &mut |frame, meta| {
                *read_to = (*read_to).max(meta.rx_ns);
                let mut buf = ctx.take_buf();
                buf.extend_from_slice(frame);
                rx.push(Rx {
                    side: s,
                    buf,
                    csum_not_ready: meta.csum_not_ready,
                    truncated: meta.truncated,
                    offload: meta.offload,
                    forwarded: false,
                });
            });
            if res.is_err() {
                self.ctx.count_drop("rx_error", 1);
            }
            if self.rx.len() - before >= batch {
                self.rings_drained = false;
            } else {
                let read_to = &mut self.rings_read_to_ns[idx(s)];
                *read_to = (*read_to).max(started_ns);
            }
        }
    }

    /// True when every frame that entered either RX ring before `t_ns` (`CLOCK_REALTIME`)
    /// has been read (see `rings_read_to_ns`). A clock stepped back only delays this answer
    /// (callers also accept a drained round); one stepped forward can make it early, which
    /// costs a migration only its ordering guarantee for frames still in flight (counted as
    /// `late_after_release`), as a slow fabric would.
    pub(crate) fn rings_read_past(&self, t_ns: u64) -> bool {
        self.rings_read_to_ns.iter().all(|&r| r >= t_ns)
    }

    fn handle_frame(&mut self, f: Rx, now: Instant) {
        let side = f.side;
        let st = self.side_stats(side);
        st.frames_in += 1;
        st.bytes_in += f.buf.len() as u64;
        if f.truncated {
            self.ctx.count_drop("rx_truncated", 1);
            return self.ctx.recycle(f.buf);
        }
        let parsed = match pliant_net::parse(&f.buf) {
            Ok(Frame::Ip(p)) => p,
            Ok(Frame::Arp(a)) => {
                self.handle_arp(side, &a, now);
                return self.ctx.recycle(f.buf);
            }
            Ok(Frame::Other { .. }) => {
                self.ctx.count_drop("not_ip", 1);
                return self.ctx.recycle(f.buf);
            }
            Err(e) => {
                self.ctx.count_drop(e.reason(), 1);
                return self.ctx.recycle(f.buf);
            }
        };
        if parsed.dst_mac[0] & 1 != 0 {
            // Broadcast/multicast IP (IPv6 ND, mDNS, ...) is link-local traffic, not for an NF.
            self.ctx.count_drop("l2_multicast", 1);
            return self.ctx.recycle(f.buf);
        }
        // Router checks before the NF sees anything (RFC 1812 §5.2.2, §5.3.1), so a frame
        // that is dropped anyway never creates NF state (a NAT mapping).
        if let Err(reason) = self.router_check(side, &f.buf, &parsed, f.forwarded) {
            self.ctx.count_drop(reason, 1);
            return self.ctx.recycle(f.buf);
        }
        // IPv4 fragments are reassembled before anything else looks at them: the NF needs the
        // ports of the whole datagram (output fragments it again to the port's MTU).
        let Some((mut buf, parsed, mut offload)) = self.reassemble(f.buf, parsed, f.offload, now)
        else {
            return;
        };
        offload.csum_valid = false;
        let l4_partial_ok = matches!(parsed.proto, proto::TCP | proto::UDP) && !parsed.fragment;
        if offload.csum_partial.is_some() && l4_partial_ok {
            // Carried through: the field is rewritten from the final headers on output
            // (`finish_offload`), so the NF's incremental updates of it do not matter and the
            // payload is never summed here.
        } else if offload.csum_partial.is_some() || f.csum_not_ready {
            // CHECKSUM_PARTIAL (locally generated traffic over veth) that cannot be carried:
            // the L4 field holds only the pseudo-header sum; complete it in software.
            if offload.gso.is_some() || !pliant_net::recompute_checksums(&mut buf, &parsed) {
                self.ctx.count_drop("csum_completion_failed", 1);
                return self.ctx.recycle(buf);
            }
            offload.csum_partial = None;
            self.side_stats(side).csum_completed += 1;
        } else if offload.gso.is_some() {
            // A super-frame with a complete checksum: segmentation needs a partial one.
            offload.csum_partial = Some(CsumPartial {
                start: 0,
                offset: 0,
            });
            if !l4_partial_ok {
                self.ctx.count_drop("gso_unsupported", 1);
                return self.ctx.recycle(buf);
            }
        }
        // Glean: a frame from a connected-subnet host tells us its MAC.
        if self.nets[idx(side)].is_connected(parsed.src) && parsed.src_mac[0] & 1 == 0 {
            let released = self.neigh[idx(side)].learn(parsed.src, parsed.src_mac, now);
            self.send_released(side, released, parsed.src_mac);
        }
        // The router's own inside addresses host no service (pings to the gateway address are
        // dropped, counted). Outside addresses are not filtered here: a NAT's external address
        // is usually the outside address, and replies to it are for the NF.
        if side == Side::Inside && self.nets[idx(side)].is_own(parsed.dst) {
            // Except echo requests: answering pings of the gateway address is how hosts and
            // health checks see that the router is alive.
            if !self.answer_ping(side, &buf, &parsed) {
                self.ctx.count_drop("to_router", 1);
            }
            return self.ctx.recycle(buf);
        }
        // TTL before the NF: a packet that expires here is answered (time exceeded, from our
        // address on this side) and never becomes NF state. `route_one` decrements it.
        if parsed.ttl <= 1 {
            self.ctx.count_drop("ttl_exceeded", 1);
            self.send_icmp_error(side, &buf, &parsed, 11, 0, [0, 0], now);
            return self.ctx.recycle(buf);
        }
        // Path MTU (RFC 1191) before the NF too: the frame is answered with "fragmentation
        // needed" from the addresses it carries now (an outbound packet after SNAT would name
        // the NAT itself) and never becomes NF state. Oversized packets without DF pass and
        // are fragmented on output.
        if let Err(reason) = self.mtu_check(side, &buf, &parsed, &offload, now) {
            self.ctx.count_drop(reason, 1);
            return self.ctx.recycle(buf);
        }
        let mut pkt = Packet::new(buf, side, parsed);
        pkt.offload = offload;
        // The only per-packet cost of migration when nothing moves: one check.
        if self.mig.active() {
            match self.divert(pkt, f.forwarded, now) {
                Some(p) => pkt = p,
                None => return,
            }
        }
        if self.ftmb.is_some() {
            return self.ftmb_dispatch(pkt);
        }
        if let Some(ha) = self.ha.as_deref_mut() {
            ha.touch(pkt.meta.key);
        }
        self.nf.process(&mut self.ctx, pkt);
    }

    /// Feeds an IPv4 fragment to the reassembler: `None` while its datagram is incomplete (or
    /// when it was dropped, counted), else the frame to process — the whole datagram when this
    /// was its last missing piece (a fresh frame: no offload metadata, checksums complete).
    fn reassemble(
        &mut self,
        buf: Vec<u8>,
        parsed: pliant_net::Parsed,
        offload: Offload,
        now: Instant,
    ) -> Option<(Vec<u8>, pliant_net::Parsed, Offload)> {
        use pliant_net::reasm::Outcome;
        if !parsed.src.is_ipv4() {
            return Some((buf, parsed, offload));
        }
        let evicted = self.reasm.stats.evicted;
        let out = self.reasm.push(&buf, usize::from(parsed.l3_off), now);
        let evicted = self.reasm.stats.evicted - evicted;
        if evicted > 0 {
            self.ctx.count_drop("frag_evicted", evicted);
        }
        let whole = match out {
            Outcome::NotFragment => return Some((buf, parsed, offload)),
            Outcome::Held | Outcome::Dropped("frag_evicted") => None,
            Outcome::Dropped(reason) => {
                self.ctx.count_drop(reason, 1);
                None
            }
            Outcome::Complete(whole) => Some(whole),
        };
        self.ctx.recycle(buf);
        let whole = whole?;
        match pliant_net::parse(&whole) {
            Ok(Frame::Ip(p)) => Some((whole, p, Offload::default())),
            _ => {
                self.ctx.count_drop("frag_invalid", 1);
                None
            }
        }
    }

    /// Header checks of a received IP frame: the destination MAC is ours (broadcast and
    /// multicast are dropped before this; frames a peer replica forwarded carry the MAC of the
    /// replica the fabric sent them to), the IPv4 header checksum verifies (the parser has
    /// already refused bad versions, IHL and total lengths), the source is a unicast address.
    fn router_check(
        &self,
        side: Side,
        frame: &[u8],
        p: &pliant_net::Parsed,
        forwarded: bool,
    ) -> Result<(), &'static str> {
        if !forwarded && p.dst_mac != self.ports[idx(side)].mac() {
            return Err("l2_foreign_dst");
        }
        if let IpAddr::V4(src) = p.src {
            if !pliant_net::ipv4_header_ok(frame, p) {
                return Err("bad_ipv4_checksum");
            }
            if src.is_multicast() || src.is_broadcast() || src.is_loopback() {
                return Err("bad_src_addr");
            }
        }
        Ok(())
    }

    /// Refuses a packet that does not fit the MTU of the port opposite `side` (where the NF
    /// sends it by default) and may not be fragmented: DF set (answered with ICMP
    /// "fragmentation needed" carrying that MTU, rate-limited) or IPv6 (no ICMPv6 here:
    /// counted only). For a GSO super-frame the segments must fit.
    fn mtu_check(
        &mut self,
        side: Side,
        frame: &[u8],
        p: &pliant_net::Parsed,
        offload: &Offload,
        now: Instant,
    ) -> Result<(), &'static str> {
        let mtu = self.ports[idx(side.opposite())].mtu();
        let wire = match offload.gso {
            Some(g) => usize::from(p.payload_off - p.l3_off) + usize::from(g.segment_size),
            None => pliant_net::frag::ip_len(p),
        };
        if wire <= mtu {
            return Ok(());
        }
        if !p.src.is_ipv4() {
            return Err(pliant_net::frag::ERR_NOT_V4);
        }
        if pliant_net::frag::dont_fragment(frame, p) {
            let next_hop_mtu = u16::try_from(mtu).unwrap_or(u16::MAX);
            self.send_icmp_error(side, frame, p, 3, 4, [0, next_hop_mtu], now);
            return Err(pliant_net::frag::ERR_DF);
        }
        // IPv4 without DF (a GSO super-frame too: segmented, then fragmented, on output).
        Ok(())
    }

    /// Sends the router's ICMP error about `frame` (received on `side`) back out of `side`,
    /// from our address there, subject to the rate limit. Nothing for packets RFC 1812 says
    /// must not be answered (errors, fragments, non-unicast sources) or without an address.
    #[allow(clippy::too_many_arguments)]
    fn send_icmp_error(
        &mut self,
        side: Side,
        frame: &[u8],
        p: &pliant_net::Parsed,
        icmp_type: u8,
        code: u8,
        rest: [u16; 2],
        now: Instant,
    ) {
        let IpAddr::V4(src) = p.src else { return };
        if !pliant_net::icmp_error::may_answer(p) || p.vlan.is_some() {
            return;
        }
        let i = idx(side);
        let Some(router) = self.nets[i].source_or_any(src) else {
            return;
        };
        if !self.icmp_limit.take(now) {
            self.side_stats(side).icmp_errors_rate_limited += 1;
            return;
        }
        let mac = self.ports[i].mac();
        if let Some(e) =
            pliant_net::icmp_error::build_v4(frame, p, mac, router, icmp_type, code, rest)
        {
            self.send_frame(side, &e);
            self.side_stats(side).icmp_errors_sent += 1;
        }
    }

    /// Answers an ICMP echo request addressed to the router; false if `p` is not one.
    fn answer_ping(&mut self, side: Side, frame: &[u8], p: &pliant_net::Parsed) -> bool {
        if p.proto != proto::ICMP || p.icmp_type != 8 || p.fragment || p.vlan.is_some() {
            return false;
        }
        let l4 = usize::from(p.l4_off);
        let (Some(seq), Some(payload)) = (
            frame
                .get(l4 + 6..l4 + 8)
                .map(|b| u16::from_be_bytes([b[0], b[1]])),
            frame.get(l4 + 8..p.l4_end()),
        ) else {
            return false;
        };
        let mac = self.ports[idx(side)].mac();
        let reply = pliant_net::build::icmp_echo(
            mac, p.src_mac, p.dst, p.src, p.sport, seq, false, payload,
        );
        self.send_frame(side, &reply);
        self.side_stats(side).echo_replies_sent += 1;
        true
    }

    fn handle_arp(&mut self, side: Side, a: &ArpInfo, now: Instant) {
        self.side_stats(side).arp_in += 1;
        let i = idx(side);
        let sender = IpAddr::V4(a.sender_ip);
        if !a.sender_ip.is_unspecified()
            && self.nets[i].is_connected(sender)
            && a.sender_mac[0] & 1 == 0
        {
            let released = self.neigh[i].learn(sender, a.sender_mac, now);
            self.send_released(side, released, a.sender_mac);
        }
        if a.op == 1 && self.nets[i].is_own(IpAddr::V4(a.target_ip)) {
            let mac = self.ports[i].mac();
            if let Some(reply) = arp::reply_to(a, mac) {
                self.send_frame(side, &reply);
                self.side_stats(side).arp_replies_sent += 1;
            }
        }
    }

    /// Sends frames that were waiting for `mac` (they are routed already; only the MAC).
    fn send_released(
        &mut self,
        side: Side,
        frames: std::collections::VecDeque<(Vec<u8>, Offload)>,
        mac: [u8; 6],
    ) {
        for (mut f, off) in frames {
            if f.len() >= 6 {
                f[..6].copy_from_slice(&mac);
            }
            self.send_frame_offload(side, &f, &off);
            self.ctx.recycle(f);
        }
    }

    fn send_frame(&mut self, side: Side, frame: &[u8]) {
        self.send_frame_offload(side, frame, &Offload::NONE);
    }

    fn send_frame_offload(&mut self, side: Side, frame: &[u8], offload: &Offload) {
        let port = &mut self.ports[idx(side)];
        let res = if offload.is_none() {
            port.send(frame)
        } else {
            port.send_offload(frame, offload)
        };
        match res {
            Ok(()) => {
                let st = self.side_stats(side);
                st.frames_out += 1;
                st.bytes_out += frame.len() as u64;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                self.ctx.count_drop("tx_full", 1)
            }
            Err(_) => self.ctx.count_drop("tx_error", 1),
        }
    }

    fn fire_timers(&mut self, now: Instant) {
        self.timers.clear();
        self.ctx.flows.expired_timers(now, &mut self.timers);
        let timers = std::mem::take(&mut self.timers);
        if let Some(ha) = self.ha.as_deref_mut() {
            for (key, _) in &timers {
                ha.touch(*key);
            }
        }
        for (key, id) in &timers {
            self.stats.timers_fired += 1;
            self.nf.on_timer(&mut self.ctx, *key, *id);
        }
        self.timers = timers;
    }

    fn route_output(&mut self, now: Instant) {
        let mut out = std::mem::take(&mut self.out);
        self.ctx.drain_output(&mut out);
        if self.ftmb.is_some() {
            self.ftmb_poll(&mut out);
        }
        if self.ha.is_some() {
            // Pico/Remus: the output rule decides what leaves now and what waits for a
            // checkpoint's ack (crates/runtime/README.md, "Output commit").
            self.route_output_ha(&mut out, now);
        } else {
            for o in out.drain(..) {
                self.route_one(o.pkt, now);
            }
        }
        self.out = out;
    }

    fn route_one(&mut self, mut pkt: Packet, now: Instant) {
        let side = pkt.egress;
        let i = idx(side);
        let dst = pkt.meta.dst;
        if self.nets[i].is_own(dst) || self.nets[idx(side.opposite())].is_own(dst) {
            return self.ctx.pkt_drop(pkt, "local_destination");
        }
        let Some(nh) = self.nets[i].next_hop(dst) else {
            return self.ctx.pkt_drop(pkt, "no_route");
        };
        if !pliant_net::rewrite::dec_ttl(&mut pkt.buf, &mut pkt.meta) {
            return self.ctx.pkt_drop(pkt, "ttl_exceeded");
        }
        let our_mac = self.ports[i].mac();
        if pliant_net::rewrite::set_src_mac(&mut pkt.buf, &mut pkt.meta, our_mac).is_err() {
            return self.ctx.pkt_drop(pkt, "rewrite_failed");
        }
        if let Some(g) = pkt.offload.gso {
            let seg_len =
                usize::from(pkt.meta.payload_off - pkt.meta.l3_off) + usize::from(g.segment_size);
            if seg_len > self.ports[i].mtu() || !self.ports[i].offloads_enabled() {
                return self.route_segments(pkt, g, nh, now);
            }
        } else if pliant_net::frag::ip_len(&pkt.meta) > self.ports[i].mtu() {
            return self.route_fragments(pkt, nh, now);
        }
        if !pkt.offload.is_none() {
            if let Err(reason) = self.finish_offload(&mut pkt, i) {
                return self.ctx.pkt_drop(pkt, reason);
            }
        }
        self.transmit(side, nh, pkt.buf, pkt.offload, now);
    }

    /// An IPv4 packet larger than the egress MTU, without DF (refused before the NF when DF
    /// is set): sent as fragments (`fragmented`, `fragments_sent`). The L4 checksum is
    /// completed in software first (fragments carry no offload metadata).
    fn route_fragments(&mut self, mut pkt: Packet, nh: IpAddr, now: Instant) {
        let side = pkt.egress;
        if pkt.offload.csum_partial.is_some() {
            if !pliant_net::recompute_checksums(&mut pkt.buf, &pkt.meta) {
                return self.ctx.pkt_drop(pkt, "csum_completion_failed");
            }
            pkt.offload = Offload::NONE;
        }
        let mtu = self.ports[idx(side)].mtu();
        match pliant_net::frag::fragment_v4(&pkt.buf, &pkt.meta, mtu) {
            Ok(frags) => {
                self.side_stats(side).fragmented += 1;
                self.side_stats(side).fragments_sent += frags.len() as u64;
                self.ctx.recycle(pkt.buf);
                for f in frags {
                    self.transmit(side, nh, f, Offload::NONE, now);
                }
            }
            Err(reason) => self.ctx.pkt_drop(pkt, reason),
        }
    }

    /// A GSO super-frame the egress port cannot take as one: its segments exceed the port's
    /// MTU (DF clear, else refused before the NF) or the port has no offloads. Segmented in
    /// software as the kernel does (`pliant_net::gso`: `gso_segmented`, `gso_segments_sent`),
    /// each segment fragmented if it still exceeds the MTU. Legacy UFO is one UDP datagram the
    /// kernel would fragment: its checksum is completed and it is routed whole (fragmented if
    /// needed). `gso_too_big`: more segments than `pliant_net::gso::MAX_SEGMENTS`.
    fn route_segments(&mut self, mut pkt: Packet, g: pliant_io::Gso, nh: IpAddr, now: Instant) {
        use pliant_io::GsoKind;
        use pliant_net::gso::{segment, Kind};
        let side = pkt.egress;
        let kind = match g.kind {
            GsoKind::TcpV4 | GsoKind::TcpV6 => Kind::Tcp,
            GsoKind::UdpL4 => Kind::Udp,
            GsoKind::Udp => {
                if !pliant_net::recompute_checksums(&mut pkt.buf, &pkt.meta) {
                    return self.ctx.pkt_drop(pkt, "csum_completion_failed");
                }
                pkt.offload = Offload::NONE;
                return self.route_segment(side, nh, pkt.buf, now);
            }
        };
        match segment(&pkt.buf, &pkt.meta, kind, usize::from(g.segment_size)) {
            Ok(segs) => {
                self.side_stats(side).gso_segmented += 1;
                self.side_stats(side).gso_segments_sent += segs.len() as u64;
                self.ctx.recycle(pkt.buf);
                for s in segs {
                    self.route_segment(side, nh, s, now);
                }
            }
            Err(reason) => self.ctx.pkt_drop(pkt, reason),
        }
    }

    /// One complete frame (checksums final, no offload metadata) out of `side`: fragmented
    /// when it exceeds the port's MTU.
    fn route_segment(&mut self, side: Side, nh: IpAddr, buf: Vec<u8>, now: Instant) {
        let meta = match pliant_net::parse(&buf) {
            Ok(pliant_net::Frame::Ip(p)) => p,
            _ => {
                self.ctx.count_drop("gso_malformed", 1);
                return self.ctx.recycle(buf);
            }
        };
        if pliant_net::frag::ip_len(&meta) > self.ports[idx(side)].mtu() {
            let mut pkt = Packet::new(buf, side.opposite(), meta);
            pkt.egress = side;
            return self.route_fragments(pkt, nh, now);
        }
        self.transmit(side, nh, buf, Offload::NONE, now);
    }

    /// Sends a routed frame (source MAC set) to next hop `nh` on `side`: at once when its MAC
    /// is known, else queued behind ARP resolution.
    fn transmit(
        &mut self,
        side: Side,
        nh: IpAddr,
        mut pkt_buf: Vec<u8>,
        pkt_offload: Offload,
        now: Instant,
    ) {
        let i = idx(side);
        if let Some(mac) = self.neigh[i].lookup(nh) {
            if let Some(d) = pkt_buf.get_mut(..6) {
                d.copy_from_slice(&mac);
            }
            self.send_frame_offload(side, &pkt_buf, &pkt_offload);
            return self.ctx.recycle(pkt_buf);
        }
        let IpAddr::V4(nh4) = nh else {
            // No NDP yet: IPv6 next hops are usable only once gleaned.
            self.ctx.count_drop("neigh_v6_unknown", 1);
            return self.ctx.recycle(pkt_buf);
        };
        let mut frame = Some((pkt_buf, pkt_offload));
        match self.neigh[i].resolve(nh, &mut frame, now) {
            crate::neigh::Resolve::Mac(mac) => {
                // Raced with a learn in this round: send directly.
                if let Some((mut f, off)) = frame {
                    f[..6].copy_from_slice(&mac);
                    self.send_frame_offload(side, &f, &off);
                    self.ctx.recycle(f);
                }
            }
            crate::neigh::Resolve::Queued { request } => {
                if request {
                    self.send_arp_request(side, nh4);
                }
            }
            crate::neigh::Resolve::Dropped(reason) => {
                self.ctx.count_drop(reason, 1);
                if let Some((f, _)) = frame {
                    self.ctx.recycle(f);
                }
            }
        }
    }

    /// Makes a frame that carries offload state sendable on port `i`: a partial checksum is
    /// rewritten from the final headers (the pseudo-header sum the peer completes), so what the
    /// NF changed is covered without summing the payload. Ports without offloads get a
    /// software-completed checksum instead (super-frames are segmented before, in
    /// `route_segments`).
    fn finish_offload(&mut self, pkt: &mut Packet, i: usize) -> Result<(), &'static str> {
        let m = &pkt.meta;
        let field = match m.proto {
            proto::TCP => 16,
            proto::UDP => 6,
            _ => return Err("offload_unsupported_proto"),
        };
        if !self.ports[i].offloads_enabled() {
            if pkt.offload.gso.is_some() {
                return Err("gso_unsupported");
            }
            if !pliant_net::recompute_checksums(&mut pkt.buf, m) {
                return Err("csum_completion_failed");
            }
            pkt.offload = Offload::NONE;
            return Ok(());
        }
        let l4 = usize::from(m.l4_off);
        let l4_len = m.l4_end().saturating_sub(l4);
        let off = l4 + field;
        if off + 2 > pkt.buf.len() || l4_len < field + 2 {
            return Err("offload_bad_offsets");
        }
        let sum = pliant_net::checksum::pseudo_header_sum(m.src, m.dst, m.proto, l4_len as u32);
        let partial = pliant_net::checksum::fold(sum);
        pkt.buf[off..off + 2].copy_from_slice(&partial.to_be_bytes());
        pkt.offload.csum_partial = Some(CsumPartial {
            start: m.l4_off,
            offset: field as u16,
        });
        Ok(())
    }

    fn send_arp_request(&mut self, side: Side, target: std::net::Ipv4Addr) {
        let i = idx(side);
        // A gateway outside our subnets cannot happen (config validation); be safe anyway.
        let Some(src) = self.nets[i].source_or_any(target) else {
            self.ctx.count_drop("arp_no_source_address", 1);
            return;
        };
        let req = arp::request(self.ports[i].mac(), src, target, None);
        self.send_frame(side, &req);
        self.side_stats(side).arp_requests_sent += 1;
    }

    fn housekeeping(&mut self, now: Instant) {
        self.last_housekeeping = now;
        let timed_out = self.reasm.expire(now);
        if timed_out > 0 {
            self.ctx.count_drop("frag_timeout", timed_out);
        }
        for s in SIDES {
            let i = idx(s);
            self.neigh[i].age(now);
            let dropped = self.neigh[i].take_dropped();
            if dropped > 0 {
                self.ctx.count_drop("neigh_unresolved", dropped);
            }
            let mut due = std::mem::take(&mut self.arp_due);
            due.clear();
            self.neigh[i].due_requests(now, &mut due);
            for ip in &due {
                if let IpAddr::V4(v4) = ip {
                    self.send_arp_request(s, *v4);
                }
            }
            self.arp_due = due;
        }
    }

    fn serve_control(&mut self, now: Instant) {
        let Some(c) = &self.control else { return };
        // Bounded per round so a flood of requests cannot starve the packet path.
        let mut reqs = Vec::new();
        while reqs.len() < CONTROL_PER_ROUND {
            match c.requests.try_recv() {
                Ok(r) => reqs.push(r),
                Err(_) => break,
            }
        }
        for r in reqs {
            self.stats.control_requests += 1;
            self.submit(r.cmd, r.reply, now);
        }
    }

    /// Serves one control request; `migrate_out` answers on `reply` later (after the
    /// destination's Ack), everything else at once. Tests call it without a socket.
    pub fn submit(&mut self, cmd: Cmd, reply: std::sync::mpsc::SyncSender<Value>, now: Instant) {
        let Some((cmd, reply)) = self.ftmb_submit(cmd, reply) else {
            return; // an FTMB command, or one refused in ftmb mode: answered
        };
        match cmd {
            Cmd::MigrateOut { to, keys } => self.start_migrate_out(to, keys, reply, now),
            Cmd::PeerConnect { to } => self.start_peer_connect(to, reply, now),
            other => {
                let answer = self.answer(other, now);
                let _ = reply.try_send(answer);
            }
        }
    }

    /// The answer to one control request (also used by tests without a socket).
    pub fn answer(&mut self, cmd: Cmd, now: Instant) -> Value {
        if let Some(refused) = self.ftmb_refusal(&cmd) {
            return refused;
        }
        match cmd {
            Cmd::Stats => {
                let mut v = self.stats_json(now);
                v["ok"] = json!(true);
                v
            }
            Cmd::Metrics => json!({"ok": true, "metrics": self.metrics(now)}),
            Cmd::Query => json!({"ok": true, "nf": N::NAME, "query": self.nf.query(&self.ctx)}),
            Cmd::Flows if self.is_ftmb() => self.ftmb_answer(cmd),
            Cmd::Flows => {
                let keys = self.ctx.flows.keys();
                let listed: Vec<Value> = keys
                    .iter()
                    .take(self.opts.max_listed_flows)
                    .map(|k| {
                        let aliases: Vec<String> = self
                            .ctx
                            .flows
                            .keys_of(k)
                            .unwrap_or_default()
                            .iter()
                            .filter(|a| *a != k)
                            .map(|a| a.to_string())
                            .collect();
                        json!({
                            "key": k.to_string(),
                            "aliases": aliases,
                            "version": self.ctx.flows.version(k),
                        })
                    })
                    .collect();
                json!({"ok": true, "total": keys.len(), "listed": listed.len(), "flows": listed})
            }
            Cmd::Flow { key } => self.flow_json(&key),
            Cmd::MigrateIn { from, keys } => self.migrate_in(&from, &keys, now),
            Cmd::MigrateAbort { keys } => self.migrate_abort(&keys),
            Cmd::MigrateOut { .. } | Cmd::PeerConnect { .. } => {
                json!({"ok": false, "error": "answered asynchronously: use submit"})
            }
            Cmd::SetPortBlocks { blocks } => {
                match self.nf.set_port_blocks(&mut self.ctx, &blocks) {
                    Ok(v) => json!({"ok": true, "port_blocks": v}),
                    Err(e) => json!({"ok": false, "error": e}),
                }
            }
            Cmd::SharedExport => match self.ctx.shared.retire().and_then(|x| x.to_bytes()) {
                Ok(b) => json!({"ok": true, "bytes": pliant_proto::request::to_hex(&b)}),
                Err(e) => json!({"ok": false, "error": e.to_string()}),
            },
            Cmd::SharedMerge { bytes } => {
                match pliant_state::SharedExport::from_bytes(&bytes)
                    .and_then(|x| self.ctx.shared.merge_from(&x))
                {
                    Ok(r) => json!({"ok": true, "report": format!("{r:?}")}),
                    Err(e) => json!({"ok": false, "error": e.to_string()}),
                }
            }
            Cmd::Protect { token, policy } => self.protect(token, *policy, now),
            Cmd::HaStatus => self.ha_status_any(),
            Cmd::Activate { primary, token } => self.activate(&primary, token, now),
            Cmd::DropStandby { primary } => self.drop_standby(&primary),
            Cmd::Rejoin { token } => self.rejoin(token),
            Cmd::FtmbProtect { .. }
            | Cmd::FtmbStatus
            | Cmd::FtmbActivate { .. }
            | Cmd::FtmbHold { .. } => self.ftmb_answer(cmd),
            Cmd::Shutdown => {
                self.stop_requested = true;
                json!({"ok": true, "shutting_down": true})
            }
        }
    }

    /// The `flow` answer: an index lookup of `key` (a primary key or an alias), never a walk of
    /// the table, so it costs the packet thread the same at any table size. `found: false` is an
    /// answer, not an error: the controller asks every replica and most do not hold the flow.
    fn flow_json(&self, key: &FlowKey) -> Value {
        let Some(keys) = self.ctx.flows.keys_of(key) else {
            return json!({"ok": true, "found": false});
        };
        let primary = keys[0];
        let aliases: Vec<String> = keys[1..]
            .iter()
            .filter(|a| **a != primary)
            .map(|a| a.to_string())
            .collect();
        json!({
            "ok": true,
            "found": true,
            "key": primary.to_string(),
            "aliases": aliases,
            "version": self.ctx.flows.version(&primary),
        })
    }

    fn control_errors(&self) -> u64 {
        self.control
            .as_ref()
            .map_or(0, |c| c.errors.load(Ordering::Relaxed))
    }

    fn control_conns_refused(&self) -> u64 {
        self.control
            .as_ref()
            .map_or(0, |c| c.conns_refused.load(Ordering::Relaxed))
    }

    fn control_fence(&self) -> (u64, u64) {
        self.control.as_ref().map_or((0, 0), |c| {
            (
                c.fence.term.load(Ordering::Relaxed),
                c.fence.refused.load(Ordering::Relaxed),
            )
        })
    }

    fn control_handshakes_aborted(&self) -> u64 {
        self.control
            .as_ref()
            .map_or(0, |c| c.handshakes_aborted.load(Ordering::Relaxed))
    }

    pub fn stats_json(&self, now: Instant) -> Value {
        let port = |s: Side| {
            let p = self.ports[idx(s)].stats();
            json!({
                "ifname": self.nets[idx(s)].ifname,
                "rx_frames": p.rx_frames, "rx_bytes": p.rx_bytes, "rx_kernel_drops": p.rx_kernel_drops,
                "rx_truncated": p.rx_truncated, "tx_frames": p.tx_frames, "tx_bytes": p.tx_bytes,
                "tx_dropped_full": p.tx_dropped_full,
                "rx_gso_frames": p.rx_gso_frames, "tx_gso_frames": p.tx_gso_frames,
                "rx_csum_partial": p.rx_csum_partial, "rx_oversize": p.rx_oversize,
                "tx_direct": p.tx_direct, "offloads": self.ports[idx(s)].offloads_enabled(), "tx_errors": p.tx_errors,
            })
        };
        let neigh = |s: Side| {
            let t = &self.neigh[idx(s)];
            let entries: Vec<Value> = t
                .snapshot()
                .into_iter()
                .take(64)
                .map(|(ip, mac, q)| {
                    json!({"ip": ip.to_string(), "mac": mac.map(fmt_mac), "queued": q})
                })
                .collect();
            json!({"entries": t.len(), "stats": t.stats, "sample": entries})
        };
        let mut engine = serde_json::to_value(&self.stats).unwrap_or(Value::Null);
        engine["control_errors"] = json!(self.stats.control_errors + self.control_errors());
        engine["control_conns_refused"] = json!(self.control_conns_refused());
        engine["control_handshakes_aborted"] = json!(self.control_handshakes_aborted());
        let (term, deposed) = self.control_fence();
        engine["control_term"] = json!(term);
        engine["control_deposed_refused"] = json!(deposed);
        // Called on the packet thread: the policy it actually runs under (`realtime_priority`).
        let (policy, priority) = crate::sched::current();
        engine["sched"] = json!({"policy": policy, "priority": priority});
        json!({
            "replica": self.name,
            "nf": N::NAME,
            "uptime_s": now.saturating_duration_since(self.started).as_secs_f64(),
            "engine": engine,
            "ports": {"inside": port(Side::Inside), "outside": port(Side::Outside)},
            "drops": self.ctx.drops().snapshot().into_iter().collect::<std::collections::BTreeMap<_, _>>(),
            "nf_counters": self.ctx.nf_counters().snapshot().into_iter().collect::<std::collections::BTreeMap<_, _>>(),
            "table": self.ctx.flows.stats(),
            "migration": self.migration_json(),
            "neighbours": {"inside": neigh(Side::Inside), "outside": neigh(Side::Outside)},
            "reassembly": self.reasm_json(),
        })
    }

    fn reasm_json(&self) -> Value {
        let s = &self.reasm.stats;
        let (datagrams, bytes) = self.reasm.pending();
        json!({
            "fragments": s.fragments, "reassembled": s.reassembled, "timed_out": s.timed_out,
            "evicted": s.evicted, "too_big": s.too_big, "invalid": s.invalid,
            "pending_datagrams": datagrams, "pending_bytes": bytes,
        })
    }

    pub fn metrics(&self, now: Instant) -> String {
        let table = self.ctx.flows.stats();
        let mut engine = self.stats.clone();
        engine.control_errors += self.control_errors();
        engine.control_conns_refused = self.control_conns_refused();
        engine.control_handshakes_aborted = self.control_handshakes_aborted();
        (engine.control_term, engine.control_deposed_refused) = self.control_fence();
        let mut text = metrics::render(&Snapshot {
            replica: &self.name,
            nf: N::NAME,
            engine: &engine,
            ports: [
                ("inside", self.ports[0].stats()),
                ("outside", self.ports[1].stats()),
            ],
            drops: self.ctx.drops(),
            nf_counters: self.ctx.nf_counters(),
            table: &table,
            neighbours: [
                ("inside", self.neigh[0].len()),
                ("outside", self.neigh[1].len()),
            ],
            uptime_s: now.saturating_duration_since(self.started).as_secs_f64(),
        });
        self.migration_metrics(&mut text);
        self.ha_metrics(&mut text);
        self.ftmb_metrics(&mut text);
        text
    }
}

mod ftmb;
mod ha;
pub(crate) mod io_loop;
mod migration;
mod rejoin;

pub use ha::HaBackend;

pub fn fmt_mac(m: [u8; 6]) -> String {
    format!(
        "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
        m[0], m[1], m[2], m[3], m[4], m[5]
    )
}

/// `CLOCK_REALTIME` in nanoseconds: the clock the kernel stamps ring frames with.
pub(crate) fn realtime_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_ftmb;
#[cfg(test)]
mod tests_ha;
#[cfg(test)]
mod tests_migrate;
