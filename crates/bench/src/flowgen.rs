//! Traffic with sequence numbers, for counting loss and reordering at the receiver across
//! migrations (`bench migrate`, `bench scale-in`).
//!
//! Generators and receivers are threads of the bench process moved into the lab's namespaces
//! with `setns(CLONE_NEWNET)` (it changes only the calling thread): no helper programs, and the
//! counters are plain atomics the bench reads directly.
//!
//! - [`UdpFlows`]: `n` UDP flows from the client (one connected socket per source port) to one
//!   server port, paced round-robin; every datagram carries `(magic, flow id, seq)`. The server
//!   thread keeps a [`SeqTracker`] per flow (which seqs arrived: lost, reordered and duplicated
//!   datagrams, see there) and the largest inter-arrival gap since the last
//!   [`UdpFlows::take_max_gap_us`] (flow 0: the pause a migration caused, seen on the wire). It also records the source port each flow arrives from
//!   (the NAT's external port: the flow's alias at the replica). Flows can be ended one by one
//!   ([`UdpFlows::end_flow`]); an ended flow sends nothing more.
//! - [`TcpStream`]: one TCP connection from a fixed client port, the client writing a known
//!   byte pattern at a paced rate, the server verifying every byte. A reset or a corrupted byte
//!   is counted, never hidden.

use crate::BenchError;
use std::fs::File;
use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::os::fd::{AsRawFd, FromRawFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// First 4 bytes of every generated datagram (anything else reaching the port is ignored).
pub const MAGIC: u32 = 0x706c_6e74;
/// Bytes of the (magic, flow, seq) header.
const HDR: usize = 16;
/// Bound on flows per generator (one socket each).
pub const MAX_FLOWS: usize = 20_000;

/// Spawns a thread that enters network namespace `ns` (a name under /run/netns) and runs `f`.
pub fn spawn_in_netns<T: Send + 'static>(
    ns: &str,
    name: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<JoinHandle<Result<T, BenchError>>, BenchError> {
    if ns.is_empty() || ns.contains('/') {
        return Err(BenchError::Lab(format!("bad namespace name {ns:?}")));
    }
    let path = Path::new("/run/netns").join(ns);
    let file = File::open(&path).map_err(|e| BenchError::Io(path.clone(), e))?;
    std::thread::Builder::new()
        .name(name.to_string())
        .spawn(move || {
            // SAFETY: `file` is an open netns fd; setns(CLONE_NEWNET) changes only this thread.
            let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
            if rc != 0 {
                return Err(BenchError::Io(path, std::io::Error::last_os_error()));
            }
            Ok(f())
        })
        .map_err(|e| BenchError::Io("thread".into(), e))
}

/// A seq this far above the highest one seen is not from this flow's generator, which numbers
/// its datagrams 0, 1, 2, ...: it is ignored instead of growing the bitmap up to it (a stray
/// datagram with our magic could otherwise allocate gigabytes).
pub const MAX_SEQ_JUMP: u64 = 1 << 20;

/// How [`SeqTracker::record`] classified one arrival.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arrival {
    /// Above every seq seen so far (gaps before it may still be filled by late arrivals).
    InOrder,
    /// First arrival of a seq below the highest one seen: it was overtaken.
    Reordered,
    /// A seq that had already arrived.
    Duplicate,
    /// More than [`MAX_SEQ_JUMP`] above the highest seq seen: not counted at all.
    Ignored,
}

/// Which sequence numbers of one flow arrived, and in what order. Pure (no sockets, no clock),
/// so every fault can be injected in a unit test.
///
/// A bitmap of the seqs seen is what tells the three faults apart: counting only "not above
/// the highest seen" calls a repeat of the latest datagram reordered, and `sent - received`
/// lets a duplicate hide a loss (one of each nets to zero).
#[derive(Clone, Debug, Default)]
pub struct SeqTracker {
    /// Bit `seq` set: seq arrived at least once.
    seen: Vec<u64>,
    received: u64,
    reordered: u64,
    duplicated: u64,
    ignored: u64,
    /// Highest seq seen + 1 (0: nothing yet).
    next_expected: u64,
}

impl SeqTracker {
    /// Counts one arrival of `seq`.
    pub fn record(&mut self, seq: u64) -> Arrival {
        if seq >= self.next_expected.saturating_add(MAX_SEQ_JUMP) {
            self.ignored += 1;
            return Arrival::Ignored;
        }
        self.received += 1;
        // seq < next_expected + MAX_SEQ_JUMP, and next_expected only grows in such steps as
        // datagrams arrive: the bitmap stays as large as the traffic.
        let (word, bit) = ((seq / 64) as usize, 1u64 << (seq % 64));
        if word >= self.seen.len() {
            self.seen.resize(word + 1, 0);
        }
        if self.seen[word] & bit != 0 {
            self.duplicated += 1;
            return Arrival::Duplicate;
        }
        self.seen[word] |= bit;
        if seq < self.next_expected {
            self.reordered += 1;
            Arrival::Reordered
        } else {
            self.next_expected = seq + 1;
            Arrival::InOrder
        }
    }

    /// Datagrams that arrived (duplicates included, ignored ones not).
    pub fn received(&self) -> u64 {
        self.received
    }

    pub fn reordered(&self) -> u64 {
        self.reordered
    }

    pub fn duplicated(&self) -> u64 {
        self.duplicated
    }

    pub fn ignored(&self) -> u64 {
        self.ignored
    }

    /// Seqs in `0..sent` that never arrived (the generator numbers its `sent` datagrams
    /// `0..sent`): loss at the start, in the middle and at the end alike.
    pub fn lost(&self, sent: u64) -> u64 {
        sent - self.arrived_below(sent)
    }

    /// Seqs in `lo..hi` that never arrived: the loss within one stretch of the stream (a test
    /// that knows which seqs were sent while something happened attributes loss to it
    /// exactly, seq by seq). Seqs not sent yet have not arrived either: pass `hi <= sent`.
    pub fn lost_in(&self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            return 0;
        }
        let arrived = |upto: u64| self.arrived_below(upto);
        (hi - lo) - (arrived(hi) - arrived(lo))
    }

    /// How many seqs below `upto` arrived.
    fn arrived_below(&self, upto: u64) -> u64 {
        let full = usize::try_from(upto / 64).unwrap_or(usize::MAX);
        let mut n: u64 = self
            .seen
            .iter()
            .take(full)
            .map(|w| u64::from(w.count_ones()))
            .sum();
        let rest = upto % 64;
        if rest > 0 {
            if let Some(w) = self.seen.get(full) {
                n += u64::from((w & ((1u64 << rest) - 1)).count_ones());
            }
        }
        n
    }
}

/// Receiver-side counters of one flow.
#[derive(Default)]
pub struct FlowCounters {
    pub sent: AtomicU64,
    pub send_errors: AtomicU64,
    /// Written by the receiver thread; locked once per datagram (uncontended) and by readers.
    seq: Mutex<SeqTracker>,
    /// Source port at the server (the NAT's external port); 0 until the first datagram.
    pub seen_sport: AtomicU16,
    pub active: AtomicBool,
    /// Largest inter-arrival gap (µs) since it was last taken.
    pub max_gap_us: AtomicU64,
    last_arrival_us: AtomicU64,
    /// Gaps of at least [`GAP_LOG_MIN_US`]: (end, length) in µs since the flows' epoch, the
    /// latest [`GAP_LOG_LEN`] (to find the gaps overlapping a given interval, e.g. a failover).
    gap_log: Mutex<std::collections::VecDeque<(u64, u64)>>,
}

/// The largest of `gaps` ((end, length) in µs) that overlaps `[from, to]`; 0 if none.
fn max_gap_overlapping(gaps: impl Iterator<Item = (u64, u64)>, from: u64, to: u64) -> u64 {
    gaps.filter(|&(end, gap)| end > from && end.saturating_sub(gap) < to)
        .map(|(_, gap)| gap)
        .max()
        .unwrap_or(0)
}

/// Gaps shorter than this are not logged (a flow at 500 datagrams/s has 2 ms between two).
const GAP_LOG_MIN_US: u64 = 2_500;
const GAP_LOG_LEN: usize = 4096;

/// Totals over flows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct UdpTotals {
    pub flows: u64,
    pub sent: u64,
    /// Arrivals, duplicates included.
    pub received: u64,
    /// Seqs sent that never arrived, summed over flows.
    pub lost: u64,
    /// Arrivals of a new seq below the highest one already seen (overtaken datagrams).
    pub reordered: u64,
    /// Datagrams the client's kernel refused (ENOBUFS...): not sent, so not lost.
    pub send_errors: u64,
    /// Arrivals of a seq that had already arrived, summed over flows.
    pub duplicated: u64,
}

impl UdpTotals {
    /// Adds one flow that sent `sent` datagrams (seqs `0..sent`) and whose arrivals `seq` saw.
    pub fn add_flow(&mut self, sent: u64, send_errors: u64, seq: &SeqTracker) {
        self.flows += 1;
        self.sent += sent;
        self.received += seq.received();
        self.lost += seq.lost(sent);
        self.reordered += seq.reordered();
        self.duplicated += seq.duplicated();
        self.send_errors += send_errors;
    }
}

struct Shared {
    stop: AtomicBool,
    flows: Vec<FlowCounters>,
    epoch: Instant,
}

/// `n` sequence-numbered UDP flows (see the module docs).
pub struct UdpFlows {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<Result<Result<(), String>, BenchError>>>,
    pub sport_base: u16,
    pub dport: u16,
}

#[derive(Clone, Debug)]
pub struct UdpSpec {
    pub client_ns: String,
    pub server_ns: String,
    pub client_ip: Ipv4Addr,
    pub server_ip: Ipv4Addr,
    pub sport_base: u16,
    pub dport: u16,
    pub flows: usize,
    /// Datagrams per second per flow.
    pub pps_per_flow: f64,
    pub payload: usize,
}

impl UdpFlows {
    /// Starts the receiver, then the sender (so the first datagrams are counted).
    pub fn start(spec: &UdpSpec) -> Result<UdpFlows, BenchError> {
        if spec.flows == 0 || spec.flows > MAX_FLOWS {
            return Err(BenchError::Tool {
                tool: "udp generator",
                reason: format!("flows must be 1..={MAX_FLOWS}, got {}", spec.flows),
            });
        }
        if usize::from(spec.sport_base) + spec.flows > 65_535 {
            return Err(BenchError::Tool {
                tool: "udp generator",
                reason: "source ports run past 65535".into(),
            });
        }
        if !(spec.pps_per_flow > 0.0 && spec.pps_per_flow.is_finite()) {
            return Err(BenchError::Tool {
                tool: "udp generator",
                reason: format!("bad rate {}", spec.pps_per_flow),
            });
        }
        let shared = Arc::new(Shared {
            stop: AtomicBool::new(false),
            flows: (0..spec.flows)
                .map(|_| FlowCounters {
                    active: AtomicBool::new(true),
                    ..Default::default()
                })
                .collect(),
            epoch: Instant::now(),
        });
        let mut threads = Vec::new();
        let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel::<Result<(), String>>(1);
        {
            let sh = shared.clone();
            let bind = SocketAddrV4::new(spec.server_ip, spec.dport);
            threads.push(spawn_in_netns(&spec.server_ns, "udp-recv", move || {
                receive_loop(&sh, bind, ready_tx)
            })?);
        }
        match ready_rx.recv_timeout(Duration::from_secs(5)) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                shared.stop.store(true, Ordering::SeqCst);
                return Err(BenchError::Tool {
                    tool: "udp receiver",
                    reason: e,
                });
            }
            Err(_) => {
                shared.stop.store(true, Ordering::SeqCst);
                return Err(BenchError::Tool {
                    tool: "udp receiver",
                    reason: "did not start".into(),
                });
            }
        }
        {
            let sh = shared.clone();
            let s = spec.clone();
            threads.push(spawn_in_netns(&spec.client_ns, "udp-send", move || {
                send_loop(&sh, &s)
            })?);
        }
        Ok(UdpFlows {
            shared,
            threads,
            sport_base: spec.sport_base,
            dport: spec.dport,
        })
    }

    pub fn flows(&self) -> &[FlowCounters] {
        &self.shared.flows
    }

    /// The flow's source port at the server (NAT external port), once seen.
    pub fn seen_sport(&self, i: usize) -> Option<u16> {
        let p = self.shared.flows.get(i)?.seen_sport.load(Ordering::Relaxed);
        (p != 0).then_some(p)
    }

    /// Stops flow `i` for good (it sends nothing more).
    pub fn end_flow(&self, i: usize) {
        if let Some(f) = self.shared.flows.get(i) {
            f.active.store(false, Ordering::SeqCst);
        }
    }

    /// The largest logged gap of flow `i` that overlaps `[from, to]` (µs; 0: none of at least
    /// [`GAP_LOG_MIN_US`]). A gap still open at `to` (no arrival since) counts up to now.
    pub fn max_gap_overlapping_us(&self, i: usize, from: Instant, to: Instant) -> u64 {
        let Some(f) = self.shared.flows.get(i) else {
            return 0;
        };
        let us = |t: Instant| t.saturating_duration_since(self.shared.epoch).as_micros() as u64;
        let (from, to) = (us(from), us(to));
        let logged = max_gap_overlapping(lock(&f.gap_log).iter().copied(), from, to);
        let last = f.last_arrival_us.load(Ordering::Relaxed);
        let open = if last != 0 && last < to {
            us(Instant::now()).saturating_sub(last)
        } else {
            0
        };
        logged.max(open)
    }

    /// The largest inter-arrival gap of flow `i` since the last call, in µs.
    pub fn take_max_gap_us(&self, i: usize) -> u64 {
        self.shared
            .flows
            .get(i)
            .map_or(0, |f| f.max_gap_us.swap(0, Ordering::Relaxed))
    }

    /// Totals over flows `range` (all: `0..n`).
    pub fn totals(&self, range: std::ops::Range<usize>) -> UdpTotals {
        let mut t = UdpTotals::default();
        for f in self.shared.flows.get(range).unwrap_or(&[]) {
            let sent = f.sent.load(Ordering::Relaxed);
            t.add_flow(sent, f.send_errors.load(Ordering::Relaxed), &lock(&f.seq));
        }
        t
    }

    /// Datagrams flow `i` sent so far (its seqs `0..sent`).
    pub fn sent(&self, i: usize) -> u64 {
        self.shared
            .flows
            .get(i)
            .map_or(0, |f| f.sent.load(Ordering::Relaxed))
    }

    /// Seqs in `lo..hi` of flow `i` that have not arrived ([`SeqTracker::lost_in`]).
    pub fn lost_in(&self, i: usize, lo: u64, hi: u64) -> u64 {
        self.shared
            .flows
            .get(i)
            .map_or(hi.saturating_sub(lo), |f| lock(&f.seq).lost_in(lo, hi))
    }

    /// Ends every flow, waits `settle` for datagrams in flight, stops the threads.
    pub fn stop(mut self, settle: Duration) -> (UdpTotals, Vec<String>) {
        let errors = self.halt(settle);
        let n = self.shared.flows.len();
        (self.totals(0..n), errors)
    }

    /// [`UdpFlows::stop`] keeping the counters readable afterwards (per flow: [`Self::sent`],
    /// [`Self::lost_in`], [`Self::totals`]). Returns the threads' errors.
    pub fn halt(&mut self, settle: Duration) -> Vec<String> {
        for f in &self.shared.flows {
            f.active.store(false, Ordering::SeqCst);
        }
        std::thread::sleep(settle);
        self.shared.stop.store(true, Ordering::SeqCst);
        let mut errors = Vec::new();
        for t in self.threads.drain(..) {
            match t.join() {
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(e))) => errors.push(e),
                Ok(Err(e)) => errors.push(e.to_string()),
                Err(_) => errors.push("generator thread panicked".into()),
            }
        }
        errors
    }
}

impl Drop for UdpFlows {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
    }
}

fn receive_loop(
    sh: &Shared,
    bind: SocketAddrV4,
    ready: std::sync::mpsc::SyncSender<Result<(), String>>,
) -> Result<(), String> {
    let sock = match UdpSocket::bind(bind) {
        Ok(s) => s,
        Err(e) => {
            let _ = ready.send(Err(format!("bind {bind}: {e}")));
            return Err(format!("bind {bind}: {e}"));
        }
    };
    let _ = sock.set_read_timeout(Some(Duration::from_millis(50)));
    set_rcvbuf(&sock, 32 << 20);
    let _ = ready.send(Ok(()));
    let mut buf = [0u8; 2048];
    while !sh.stop.load(Ordering::Relaxed) {
        let (n, from) = match sock.recv_from(&mut buf) {
            Ok(x) => x,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => continue,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(format!("recv: {e}")),
        };
        let Some((flow, seq)) = parse_datagram(&buf[..n]) else {
            continue;
        };
        let Some(f) = sh.flows.get(flow as usize) else {
            continue;
        };
        let now_us = sh.epoch.elapsed().as_micros() as u64 + 1;
        if lock(&f.seq).record(seq) == Arrival::Ignored {
            continue;
        }
        let last = f.last_arrival_us.swap(now_us, Ordering::Relaxed);
        if last != 0 {
            let gap = now_us.saturating_sub(last);
            f.max_gap_us.fetch_max(gap, Ordering::Relaxed);
            if gap >= GAP_LOG_MIN_US {
                let mut log = lock(&f.gap_log);
                if log.len() == GAP_LOG_LEN {
                    log.pop_front();
                }
                log.push_back((now_us, gap));
            }
        }
        if f.seen_sport.load(Ordering::Relaxed) == 0 {
            f.seen_sport.store(from.port(), Ordering::Relaxed);
        }
    }
    Ok(())
}

/// The tracker even if a thread panicked while holding it (its counts are still the best
/// there are; the panic itself is reported by the join).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// `(flow, seq)` of a generated datagram, or None for anything else.
pub fn parse_datagram(b: &[u8]) -> Option<(u32, u64)> {
    if b.len() < HDR || u32::from_be_bytes(b[0..4].try_into().ok()?) != MAGIC {
        return None;
    }
    let flow = u32::from_be_bytes(b[4..8].try_into().ok()?);
    let seq = u64::from_be_bytes(b[8..16].try_into().ok()?);
    Some((flow, seq))
}

fn datagram(buf: &mut [u8], flow: u32, seq: u64) {
    buf[0..4].copy_from_slice(&MAGIC.to_be_bytes());
    buf[4..8].copy_from_slice(&flow.to_be_bytes());
    buf[8..16].copy_from_slice(&seq.to_be_bytes());
}

/// A large receive buffer: the receiver thread can be descheduled for tens of milliseconds on
/// a loaded machine, and a default-sized buffer (rmem_max, ~200 KiB = a few hundred small
/// datagrams) would then overflow and count as loss. SO_RCVBUFFORCE (root) passes rmem_max;
/// SO_RCVBUF is the fallback. Overflows that still happen show as `UdpRcvbufErrors`.
fn set_rcvbuf(s: &impl AsRawFd, bytes: i32) {
    for opt in [libc::SO_RCVBUFFORCE, libc::SO_RCVBUF] {
        // SAFETY: setsockopt on a socket we own with a valid int option.
        let rc = unsafe {
            libc::setsockopt(
                s.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                (&bytes as *const i32).cast(),
                std::mem::size_of::<i32>() as libc::socklen_t,
            )
        };
        if rc == 0 {
            return;
        }
    }
}

fn send_loop(sh: &Shared, spec: &UdpSpec) -> Result<(), String> {
    let mut socks = Vec::with_capacity(spec.flows);
    for i in 0..spec.flows {
        let sport = spec.sport_base + i as u16;
        let s = UdpSocket::bind(SocketAddrV4::new(spec.client_ip, sport))
            .map_err(|e| format!("bind {}:{sport}: {e}", spec.client_ip))?;
        s.connect(SocketAddrV4::new(spec.server_ip, spec.dport))
            .map_err(|e| format!("connect: {e}"))?;
        s.set_nonblocking(true)
            .map_err(|e| format!("nonblocking: {e}"))?;
        socks.push(s);
    }
    let mut buf = vec![0u8; spec.payload.max(HDR)];
    let mut seqs = vec![0u64; spec.flows];
    // One datagram per tick, flows round-robin: the aggregate rate is flows * pps_per_flow.
    let tick = Duration::from_secs_f64(1.0 / (spec.pps_per_flow * spec.flows as f64));
    let mut next = Instant::now();
    let mut i = 0usize;
    while !sh.stop.load(Ordering::Relaxed) {
        let f = &sh.flows[i];
        if f.active.load(Ordering::Relaxed) {
            datagram(&mut buf, i as u32, seqs[i]);
            match socks[i].send(&buf) {
                Ok(_) => {
                    seqs[i] += 1;
                    f.sent.store(seqs[i], Ordering::Relaxed);
                }
                Err(_) => {
                    // Not on the wire, so not a loss: the seq is reused for the next datagram.
                    f.send_errors.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        i = (i + 1) % spec.flows;
        next += tick;
        let now = Instant::now();
        if next > now {
            let d = next - now;
            if d > Duration::from_micros(200) {
                std::thread::sleep(d - Duration::from_micros(100));
            }
            while Instant::now() < next {
                std::hint::spin_loop();
            }
        } else if now - next > Duration::from_millis(50) {
            // Fell far behind (descheduled): do not burst to catch up.
            next = now;
        }
    }
    Ok(())
}

/// The controller's Maglev ring over a member list, as the fabric installs it (default ring
/// size): which replica a new flow from the lab's client to its server lands on, so a
/// generator can place flows on chosen replicas before their first packet.
pub struct Ring {
    table: Vec<u32>,
    size: u32,
}

impl Ring {
    pub fn of(members: &[u32]) -> Result<Ring, BenchError> {
        let size = pliant_steer::maglev::DEFAULT_RING_SIZE;
        let table =
            pliant_steer::maglev::maglev_table(members, size).map_err(|e| BenchError::Tool {
                tool: "maglev ring",
                reason: format!("{members:?}: {e}"),
            })?;
        Ok(Ring { table, size })
    }

    /// The replica the ring sends the flow `proto` CLIENT_IP:`sport` -> SERVER_IP:`dport` to.
    pub fn owner(&self, proto: u8, sport: u16, dport: u16) -> u32 {
        let c: Ipv4Addr = pliant_lab::CLIENT_IP
            .parse()
            .unwrap_or(Ipv4Addr::UNSPECIFIED);
        let s: Ipv4Addr = pliant_lab::SERVER_IP
            .parse()
            .unwrap_or(Ipv4Addr::UNSPECIFIED);
        let (k, _) = pliant_state::FlowKey::v4(proto, c, sport, s, dport);
        let slot = pliant_steer::layout::ring_slot(&k, self.size) as usize;
        self.table.get(slot).copied().unwrap_or(0)
    }

    /// The first source port `>= from` that starts a block of `per_member * members` consecutive
    /// ports whose `proto` flows to `dport` the ring spreads exactly `per_member` to each member
    /// (a [`UdpFlows`] generator numbers its flows' ports consecutively). None if there is none
    /// below `limit`.
    pub fn spread_block(
        &self,
        members: &[u32],
        proto: u8,
        dport: u16,
        per_member: usize,
        from: u16,
        limit: u16,
    ) -> Option<u16> {
        let n = per_member * members.len();
        (from..limit.saturating_sub(n as u16)).find(|b| {
            let owners: Vec<u32> = (0..n as u16)
                .map(|i| self.owner(proto, b + i, dport))
                .collect();
            members
                .iter()
                .all(|m| owners.iter().filter(|o| *o == m).count() == per_member)
        })
    }
}

// ------------------------------------------------------------------------------------ TCP

/// Counters of the TCP stream.
#[derive(Default)]
pub struct TcpCounters {
    pub bytes_sent: AtomicU64,
    pub bytes_received: AtomicU64,
    /// Bytes that did not match the pattern at the receiver.
    pub corrupted: AtomicU64,
    /// ECONNRESET/EPIPE seen by either end.
    pub resets: AtomicU64,
    pub other_errors: AtomicU64,
    /// The client's port as the server sees it (the NAT's external port).
    pub seen_sport: AtomicU16,
    pub connected: AtomicBool,
    stop: AtomicBool,
}

/// Summary of the stream after [`TcpStream::stop`].
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct TcpSummary {
    pub bytes_sent: u64,
    pub bytes_received: u64,
    pub corrupted_bytes: u64,
    pub resets_seen: u64,
    /// The server read to EOF and got exactly what the client wrote.
    pub complete: bool,
    pub errors: Vec<String>,
}

pub struct TcpStream {
    c: Arc<TcpCounters>,
    client: Option<JoinHandle<Result<Result<(), String>, BenchError>>>,
    server: Option<JoinHandle<Result<Result<(), String>, BenchError>>>,
}

/// Byte `i` of the stream.
#[inline]
pub fn pattern_byte(i: u64) -> u8 {
    (i % 251) as u8
}

fn is_reset(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        ErrorKind::ConnectionReset | ErrorKind::BrokenPipe | ErrorKind::ConnectionAborted
    )
}

impl TcpStream {
    /// Server listens on `server`, the client connects from `client` (a fixed port, so the
    /// flow key is known before the first packet) and writes `chunk` bytes every `every`.
    pub fn start(
        client_ns: &str,
        server_ns: &str,
        client: SocketAddrV4,
        server: SocketAddrV4,
        chunk: usize,
        every: Duration,
    ) -> Result<TcpStream, BenchError> {
        let c = Arc::new(TcpCounters::default());
        let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel::<Result<(), String>>(1);
        let cs = c.clone();
        let srv = spawn_in_netns(server_ns, "tcp-server", move || {
            tcp_server(&cs, server, ready_tx)
        })?;
        match ready_rx.recv_timeout(Duration::from_secs(5)) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                return Err(BenchError::Tool {
                    tool: "tcp server",
                    reason: e,
                })
            }
            Err(_) => {
                return Err(BenchError::Tool {
                    tool: "tcp server",
                    reason: "did not start".into(),
                })
            }
        }
        let cc = c.clone();
        let cli = spawn_in_netns(client_ns, "tcp-client", move || {
            tcp_client(&cc, client, server, chunk, every)
        })?;
        Ok(TcpStream {
            c,
            client: Some(cli),
            server: Some(srv),
        })
    }

    pub fn counters(&self) -> &TcpCounters {
        &self.c
    }

    /// Closes the client's side, waits for the server to read to EOF (bounded), joins both.
    pub fn stop(mut self, timeout: Duration) -> TcpSummary {
        self.c.stop.store(true, Ordering::SeqCst);
        let mut errors = Vec::new();
        let end = Instant::now() + timeout;
        for h in [self.client.take(), self.server.take()]
            .into_iter()
            .flatten()
        {
            while !h.is_finished() && Instant::now() < end {
                std::thread::sleep(Duration::from_millis(20));
            }
            if !h.is_finished() {
                errors.push("tcp thread did not finish in time".into());
                continue;
            }
            match h.join() {
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(e))) => errors.push(e),
                Ok(Err(e)) => errors.push(e.to_string()),
                Err(_) => errors.push("tcp thread panicked".into()),
            }
        }
        let c = &self.c;
        let (s, r) = (
            c.bytes_sent.load(Ordering::SeqCst),
            c.bytes_received.load(Ordering::SeqCst),
        );
        let corrupted = c.corrupted.load(Ordering::SeqCst);
        TcpSummary {
            bytes_sent: s,
            bytes_received: r,
            corrupted_bytes: corrupted,
            resets_seen: c.resets.load(Ordering::SeqCst),
            complete: errors.is_empty() && s == r && corrupted == 0 && s > 0,
            errors,
        }
    }
}

fn tcp_server(
    c: &TcpCounters,
    addr: SocketAddrV4,
    ready: std::sync::mpsc::SyncSender<Result<(), String>>,
) -> Result<(), String> {
    let l = match std::net::TcpListener::bind(addr) {
        Ok(l) => l,
        Err(e) => {
            let _ = ready.send(Err(format!("listen {addr}: {e}")));
            return Err(format!("listen {addr}: {e}"));
        }
    };
    let _ = ready.send(Ok(()));
    l.set_nonblocking(true).map_err(|e| e.to_string())?;
    let deadline = Instant::now() + Duration::from_secs(30);
    let (mut s, from) = loop {
        match l.accept() {
            Ok(x) => break x,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if c.stop.load(Ordering::Relaxed) || Instant::now() > deadline {
                    return Err("no connection accepted".into());
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(format!("accept: {e}")),
        }
    };
    c.seen_sport.store(from.port(), Ordering::SeqCst);
    s.set_nonblocking(false).map_err(|e| e.to_string())?;
    let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
    let mut buf = vec![0u8; 64 << 10];
    let mut pos = 0u64;
    loop {
        match s.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(n) => {
                let bad = buf[..n]
                    .iter()
                    .enumerate()
                    .filter(|(i, b)| **b != pattern_byte(pos + *i as u64))
                    .count();
                c.corrupted.fetch_add(bad as u64, Ordering::Relaxed);
                pos += n as u64;
                c.bytes_received.store(pos, Ordering::Relaxed);
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) if is_reset(&e) => {
                c.resets.fetch_add(1, Ordering::SeqCst);
                return Err(format!("server read: {e}"));
            }
            Err(e) => {
                c.other_errors.fetch_add(1, Ordering::SeqCst);
                return Err(format!("server read: {e}"));
            }
        }
    }
}

/// A TCP socket bound to `local` and connected to `remote` (std cannot bind before connect).
fn connect_from(local: SocketAddrV4, remote: SocketAddrV4) -> std::io::Result<std::net::TcpStream> {
    fn sa(a: SocketAddrV4) -> libc::sockaddr_in {
        libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: a.port().to_be(),
            sin_addr: libc::in_addr {
                s_addr: u32::from(*a.ip()).to_be(),
            },
            sin_zero: [0; 8],
        }
    }
    // SAFETY: plain socket syscalls on an fd we own; the sockaddr structs live across the calls.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let s = std::net::TcpStream::from_raw_fd(fd);
        let one: libc::c_int = 1;
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_REUSEADDR,
            (&one as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
        let l = sa(local);
        let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        if libc::bind(fd, (&l as *const libc::sockaddr_in).cast(), len) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let r = sa(remote);
        if libc::connect(fd, (&r as *const libc::sockaddr_in).cast(), len) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(s)
    }
}

fn tcp_client(
    c: &TcpCounters,
    local: SocketAddrV4,
    remote: SocketAddrV4,
    chunk: usize,
    every: Duration,
) -> Result<(), String> {
    let mut s = connect_from(local, remote).map_err(|e| format!("connect {remote}: {e}"))?;
    c.connected.store(true, Ordering::SeqCst);
    let _ = s.set_write_timeout(Some(Duration::from_secs(10)));
    let mut pos = 0u64;
    let mut buf = vec![0u8; chunk.max(1)];
    let mut next = Instant::now();
    while !c.stop.load(Ordering::Relaxed) {
        for (i, b) in buf.iter_mut().enumerate() {
            *b = pattern_byte(pos + i as u64);
        }
        match s.write_all(&buf) {
            Ok(()) => {
                pos += buf.len() as u64;
                c.bytes_sent.store(pos, Ordering::Relaxed);
            }
            Err(e) if is_reset(&e) => {
                c.resets.fetch_add(1, Ordering::SeqCst);
                return Err(format!("client write: {e}"));
            }
            Err(e) => {
                c.other_errors.fetch_add(1, Ordering::SeqCst);
                return Err(format!("client write: {e}"));
            }
        }
        next += every;
        let now = Instant::now();
        if next > now {
            std::thread::sleep(next - now);
        } else {
            next = now;
        }
    }
    s.shutdown(std::net::Shutdown::Write)
        .map_err(|e| format!("shutdown: {e}"))?;
    // Wait for the server's FIN so the connection ends cleanly (no RST from unread data).
    let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
    let mut b = [0u8; 64];
    loop {
        match s.read(&mut b) {
            Ok(0) => return Ok(()),
            Ok(_) => continue,
            Err(e) if is_reset(&e) => {
                c.resets.fetch_add(1, Ordering::SeqCst);
                return Err(format!("client read: {e}"));
            }
            Err(e) => return Err(format!("client read: {e}")),
        }
    }
}

/// `TcpEstabResets`, `TcpOutRsts`, `TcpExtTCPAbortOn*` (resets, aborts) and `UdpRcvbufErrors`,
/// `UdpInErrors` (datagrams a receiving socket dropped) of a namespace, from `nstat -asz`.
pub fn parse_nstat_resets(text: &str) -> Vec<(String, u64)> {
    text.lines()
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            let name = it.next()?;
            let v: u64 = it.next()?.parse().ok()?;
            let wanted = name == "TcpEstabResets"
                || name == "TcpOutRsts"
                || name.starts_with("TcpExtTCPAbortOn")
                || name == "UdpRcvbufErrors"
                || name == "UdpInErrors";
            wanted.then(|| (name.to_string(), v))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn datagrams_round_trip_and_foreign_ones_are_ignored() {
        let mut b = [0u8; 32];
        datagram(&mut b, 7, 123_456_789_012);
        assert_eq!(parse_datagram(&b), Some((7, 123_456_789_012)));
        assert_eq!(parse_datagram(&b[..15]), None);
        b[0] ^= 1;
        assert_eq!(parse_datagram(&b), None);
    }

    #[test]
    fn gaps_overlapping_an_interval() {
        // (end, length): [90, 100], [195, 205], [300, 340], [1000, 1010]
        let log = [(100, 10), (205, 10), (340, 40), (1010, 10)];
        let m = |from, to| max_gap_overlapping(log.iter().copied(), from, to);
        assert_eq!(m(200, 320), 40, "overlapping either end counts");
        assert_eq!(m(100, 195), 0, "touching is not overlapping");
        assert_eq!(m(0, 2000), 40);
        assert_eq!(m(95, 96), 10, "an interval inside a gap");
        assert_eq!(m(2000, 3000), 0);
    }

    #[test]
    fn pattern_is_not_constant() {
        assert_ne!(pattern_byte(0), pattern_byte(1));
        assert_eq!(pattern_byte(0), pattern_byte(251));
    }

    #[test]
    fn nstat_reset_counters_are_picked() {
        let t = "#kernel\nTcpActiveOpens 3 0.0\nTcpEstabResets 1 0.0\nTcpOutRsts 2 0.0\n\
                 TcpExtTCPAbortOnData 4 0.0\nTcpExtTCPAbortOnClose 0 0.0\nIpInReceives 9 0.0\n";
        let v = parse_nstat_resets(t);
        assert_eq!(
            v,
            vec![
                ("TcpEstabResets".into(), 1),
                ("TcpOutRsts".into(), 2),
                ("TcpExtTCPAbortOnData".into(), 4),
                ("TcpExtTCPAbortOnClose".into(), 0)
            ]
        );
    }

    /// Feeds `arrivals` to a fresh tracker; returns (lost of `sent`, reordered, duplicated).
    fn track(arrivals: &[u64], sent: u64) -> (u64, u64, u64) {
        let mut t = SeqTracker::default();
        for s in arrivals {
            t.record(*s);
        }
        assert_eq!(t.received(), arrivals.len() as u64);
        (t.lost(sent), t.reordered(), t.duplicated())
    }

    #[test]
    fn an_intact_stream_counts_no_fault() {
        let all: Vec<u64> = (0..200).collect();
        assert_eq!(track(&all, 200), (0, 0, 0));
        assert_eq!(track(&[], 0), (0, 0, 0));
    }

    #[test]
    fn each_dropped_seq_is_lost_wherever_it_is() {
        let without =
            |gone: &[u64], n: u64| -> Vec<u64> { (0..n).filter(|s| !gone.contains(s)).collect() };
        // Middle, start (nothing arrives below it), end (nothing arrives after it: only the
        // sender's count shows it), and several across bitmap words.
        assert_eq!(track(&without(&[57], 100), 100), (1, 0, 0));
        assert_eq!(track(&without(&[0], 100), 100), (1, 0, 0));
        assert_eq!(track(&without(&[0, 1, 2], 100), 100), (3, 0, 0));
        assert_eq!(track(&without(&[99], 100), 100), (1, 0, 0));
        assert_eq!(track(&without(&[63, 64, 127, 128], 130), 130), (4, 0, 0));
        // Nothing arrived at all.
        assert_eq!(track(&[], 5), (5, 0, 0));
    }

    #[test]
    fn a_swap_is_one_reordered_arrival_and_no_loss() {
        assert_eq!(track(&[0, 1, 3, 2, 4], 5), (0, 1, 0));
        // The first datagram overtaken by the second.
        assert_eq!(track(&[1, 0, 2], 3), (0, 1, 0));
        // One datagram overtaken by three: one late arrival, not three.
        assert_eq!(track(&[0, 2, 3, 4, 1, 5], 6), (0, 1, 0));
        // Across a bitmap word boundary.
        let mut s: Vec<u64> = (0..130).collect();
        s.swap(63, 64);
        assert_eq!(track(&s, 130), (0, 1, 0));
    }

    #[test]
    fn a_repeat_is_a_duplicate_not_a_reordering() {
        // The latest seq again (it is below the highest seen + 1, which the old count took for
        // reordering).
        assert_eq!(track(&[0, 1, 2, 2, 3], 4), (0, 0, 1));
        // An old one again, and the first one three times.
        assert_eq!(track(&[0, 1, 2, 3, 1], 4), (0, 0, 1));
        assert_eq!(track(&[0, 0, 0, 1], 2), (0, 0, 2));
        // A reordered datagram that then arrives once more.
        assert_eq!(track(&[0, 2, 1, 1], 3), (0, 1, 1));
    }

    #[test]
    fn a_duplicate_does_not_hide_a_loss() {
        // Seq 2 lost, seq 1 duplicated: as many arrivals as datagrams sent.
        assert_eq!(track(&[0, 1, 1, 3], 4), (1, 0, 1));
        // The same at the start and at the end of the stream.
        assert_eq!(track(&[1, 1, 2, 3], 4), (1, 0, 1));
        assert_eq!(track(&[0, 0, 1, 2], 4), (1, 0, 1));
    }

    #[test]
    fn loss_is_attributed_to_the_stretch_of_seqs_it_happened_in() {
        let mut t = SeqTracker::default();
        // 200 sent: 5 lost early, 63..=65 lost across a bitmap word boundary, 199 lost last.
        for s in (0..200).filter(|s| ![5, 63, 64, 65, 199].contains(s)) {
            t.record(s);
        }
        assert_eq!(t.lost(200), 5);
        assert_eq!(t.lost_in(0, 5), 0);
        assert_eq!(t.lost_in(0, 6), 1);
        assert_eq!(t.lost_in(6, 63), 0);
        assert_eq!(t.lost_in(63, 64), 1);
        assert_eq!(t.lost_in(60, 70), 3);
        assert_eq!(t.lost_in(66, 199), 0);
        assert_eq!(t.lost_in(66, 200), 1);
        // The stretches partition the stream: their losses add up to the whole.
        let cuts = [0, 5, 40, 64, 65, 128, 200];
        let sum: u64 = cuts.windows(2).map(|w| t.lost_in(w[0], w[1])).sum();
        assert_eq!(sum, t.lost(200));
        // Empty and reversed stretches lose nothing; seqs never sent did not arrive.
        assert_eq!((t.lost_in(7, 7), t.lost_in(9, 3)), (0, 0));
        assert_eq!(t.lost_in(200, 210), 10);
    }

    #[test]
    fn seqs_beyond_the_sent_count_are_not_counted_as_arrived_below_it() {
        // The receiver read while seq 3 was sent but `sent` not yet updated: seqs 0..3 arrived.
        assert_eq!(track(&[0, 1, 2, 3], 3), (0, 0, 0));
        // 2 lost, and the arrival of 3 must not make up for it.
        assert_eq!(track(&[0, 1, 3], 3), (1, 0, 0));
    }

    #[test]
    fn foreign_seqs_far_ahead_are_ignored_without_growing_the_bitmap() {
        // Sequence numbers are u64 counted from 0 and never wrap in practice (2^64 datagrams);
        // a huge one is someone else's datagram with our magic.
        let mut t = SeqTracker::default();
        assert_eq!(t.record(0), Arrival::InOrder);
        assert_eq!(t.record(u64::MAX), Arrival::Ignored);
        assert_eq!(t.record(1 + MAX_SEQ_JUMP), Arrival::Ignored);
        assert_eq!(t.record(MAX_SEQ_JUMP), Arrival::InOrder);
        assert_eq!(t.record(1), Arrival::Reordered);
        assert_eq!(t.record(1), Arrival::Duplicate);
        assert_eq!(
            (t.received(), t.ignored(), t.reordered(), t.duplicated()),
            (4, 2, 1, 1)
        );
        assert_eq!(t.lost(MAX_SEQ_JUMP + 1), MAX_SEQ_JUMP + 1 - 3);
        assert!(t.seen.len() as u64 <= MAX_SEQ_JUMP / 64 + 1);
    }

    #[test]
    fn totals_sum_each_fault_per_flow() {
        let mut a = SeqTracker::default();
        for s in [0, 2, 1, 3, 3] {
            a.record(s);
        }
        let mut b = SeqTracker::default();
        for s in [1, 2] {
            b.record(s);
        }
        let mut t = UdpTotals::default();
        t.add_flow(5, 1, &a);
        t.add_flow(4, 0, &b);
        assert_eq!(
            t,
            UdpTotals {
                flows: 2,
                sent: 9,
                received: 7,
                lost: 1 + 2,
                reordered: 1,
                send_errors: 1,
                duplicated: 1,
            }
        );
    }

    /// The receiver thread over a real socket: datagrams with injected faults in, the counts
    /// `totals` reports out (the path `bench migrate` and the migration e2e tests read).
    #[test]
    fn the_receiver_counts_injected_faults_from_real_datagrams() {
        let probe = UdpSocket::bind("127.0.0.1:0").expect("bind");
        let addr = match probe.local_addr().expect("addr") {
            std::net::SocketAddr::V4(a) => a,
            a => panic!("not v4: {a}"),
        };
        drop(probe);
        let shared = Arc::new(Shared {
            stop: AtomicBool::new(false),
            flows: (0..2).map(|_| FlowCounters::default()).collect(),
            epoch: Instant::now(),
        });
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let sh = shared.clone();
        let h = std::thread::spawn(move || receive_loop(&sh, addr, tx));
        rx.recv_timeout(Duration::from_secs(5))
            .expect("receiver started")
            .expect("receiver bound");
        let send = UdpSocket::bind("127.0.0.1:0").expect("bind");
        let mut b = [0u8; 64];
        // Flow 0 sent seqs 0..8: 4 and 7 lost, 3 overtaken by 5, 2 twice.
        // Flow 1 sent 0..3 intact. Plus one foreign datagram and one seq a whole
        // MAX_SEQ_JUMP past flow 0's next expected seq (7).
        let arrivals: [(u32, u64); 11] = [
            (0, 0),
            (0, 1),
            (1, 0),
            (0, 2),
            (0, 5),
            (0, 3),
            (0, 2),
            (1, 1),
            (0, 6),
            (1, 2),
            (0, 7 + MAX_SEQ_JUMP),
        ];
        for (flow, seq) in arrivals {
            datagram(&mut b, flow, seq);
            send.send_to(&b, addr).expect("send");
        }
        send.send_to(b"not ours", addr).expect("send");
        shared.flows[0].sent.store(8, Ordering::Relaxed);
        shared.flows[1].sent.store(3, Ordering::Relaxed);
        let wait = Instant::now();
        let want = |t: &UdpTotals| t.received == 10;
        let totals = |sh: &Shared| {
            let mut t = UdpTotals::default();
            for f in &sh.flows {
                t.add_flow(f.sent.load(Ordering::Relaxed), 0, &lock(&f.seq));
            }
            t
        };
        while !want(&totals(&shared)) {
            assert!(
                wait.elapsed() < Duration::from_secs(10),
                "receiver saw {:?}",
                totals(&shared)
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        shared.stop.store(true, Ordering::SeqCst);
        h.join().expect("receiver thread").expect("receiver");
        let t = totals(&shared);
        assert_eq!(
            (t.sent, t.received, t.lost, t.reordered, t.duplicated),
            (11, 10, 2, 1, 1),
            "{t:?}"
        );
        assert_eq!(lock(&shared.flows[0].seq).ignored(), 1);
    }

    #[test]
    fn a_spread_block_gives_each_member_its_share_of_the_ring() {
        let members = [1, 2, 3];
        let ring = Ring::of(&members).expect("ring");
        let udp = pliant_state::key::proto::UDP;
        let b = ring
            .spread_block(&members, udp, 7000, 2, 20_000, 30_000)
            .expect("a block");
        assert!(b >= 20_000);
        let mut per = [0usize; 4];
        for p in b..b + 6 {
            per[ring.owner(udp, p, 7000) as usize] += 1;
        }
        assert_eq!(per, [0, 2, 2, 2]);
        // The ring itself spreads ports over every member, and only over members.
        let owners: std::collections::BTreeSet<u32> =
            (1000..1200).map(|p| ring.owner(udp, p, 7000)).collect();
        assert_eq!(owners.into_iter().collect::<Vec<_>>(), members);
        assert_eq!(ring.spread_block(&members, udp, 7000, 2, 100, 104), None);
    }

    #[test]
    fn generator_refuses_bad_specs() {
        let spec = UdpSpec {
            client_ns: "x".into(),
            server_ns: "y".into(),
            client_ip: Ipv4Addr::LOCALHOST,
            server_ip: Ipv4Addr::LOCALHOST,
            sport_base: 65_000,
            dport: 9,
            flows: 1000,
            pps_per_flow: 1.0,
            payload: 64,
        };
        assert!(UdpFlows::start(&spec).is_err());
        let zero = UdpSpec {
            flows: 0,
            ..spec.clone()
        };
        assert!(UdpFlows::start(&zero).is_err());
        let rate = UdpSpec {
            sport_base: 1000,
            pps_per_flow: 0.0,
            ..spec
        };
        assert!(UdpFlows::start(&rate).is_err());
    }
}
