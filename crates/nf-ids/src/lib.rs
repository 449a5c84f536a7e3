//! pliant-nf-ids: the seed's Bro port — per-flow HTTP request reassembly and SQL-injection
//! counting on the Split/Merge API.
//!
//! Packet path (`Ids::process`), Click-style, one module per element:
//! 1. non-TCP traffic and fragments are forwarded untouched (no state depends on them);
//! 2. the flow's state ([`IdsFlow`]) is fetched or created;
//! 3. client bytes (inside -> outside) go through [`stream::Reassembler`] (sequence order,
//!    duplicates dropped, bounded out-of-order buffer, counted gaps) into
//!    [`http::HttpParser`] (request boundaries, target and body), which scans each complete
//!    request with [`scan::Scanner`];
//! 4. the per-flow counts and the "alert raised" flag are updated *in flow state*, so they move
//!    with the flow on migration and are replicated by Pico: an alert is raised exactly once
//!    per flow, on whichever replica the threshold is reached;
//! 5. the packet is forwarded with `pkt_write` (the IDS observes, never blocks).
//!
//! NF-local memory holds only the alert log, summaries of expired flows and totals of expired
//! flows (for `pliant query`); all are bounded.

pub mod config;
pub mod http;
pub mod scan;
pub mod stream;

pub use config::Config;

use http::{Env, HttpParser, Limits, Tally};
use pliant_net::{proto, FlowKey};
use pliant_runtime::{Ctx, NetworkFunction, Packet, Side};
use pliant_state::{StateError, TimerId};
use scan::Scanner;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::time::Duration;
use stream::{Piece, Reassembler, StreamLimits, StreamStats};

/// The one timer kind: flow expiry (idle, or shortly after the connection closed).
pub const TIMER_EXPIRE: TimerId = 0;
const BUSY_RETRY: Duration = Duration::from_secs(1);
/// Bound on live flows listed by `query` (the totals always cover all of them).
pub const MAX_QUERY_FLOWS: usize = 10_000;
/// Segments further ahead of the expected byte than this are ignored as implausible.
const MAX_AHEAD_BYTES: u32 = 1 << 28;

const TCP_FIN: u8 = 0x01;
const TCP_SYN: u8 = 0x02;
const TCP_RST: u8 = 0x04;
const TCP_ACK: u8 = 0x10;

pub const DROP_MIGRATED: &str = "flow_migrated";

/// Per-flow state: reassembly + parser + counts. Exported on migration.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdsFlow {
    /// Client -> server byte stream.
    pub stream: Reassembler,
    pub http: HttpParser,
    /// Complete client requests seen.
    pub requests: u64,
    /// Requests that matched an injection pattern.
    pub injections: u64,
    /// The alert for this flow was raised (never twice, wherever the flow moves).
    pub alerted: bool,
    /// Holes in the client stream that were given up on.
    pub gaps: u64,
    /// Bit 0: FIN from the client (inside); bit 1: from the server.
    pub fins: u8,
    pub reset: bool,
}

impl IdsFlow {
    fn closed(&self) -> bool {
        self.reset || self.fins == 3
    }
}

/// One raised alert (the NF-local, bounded alert log).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Alert {
    pub flow: String,
    pub client: String,
    pub server: String,
    pub injections: u64,
    pub requests: u64,
    /// Wall-clock time of the alert, for operators (not used by any logic).
    pub unix_ms: u64,
}

/// Counts of one flow as reported by `query`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FlowSummary {
    pub flow: String,
    pub requests: u64,
    pub injections: u64,
    pub alerted: bool,
    pub gaps: u64,
}

impl FlowSummary {
    fn of(key: &FlowKey, f: &IdsFlow) -> FlowSummary {
        FlowSummary {
            flow: key.to_string(),
            requests: f.requests,
            injections: f.injections,
            alerted: f.alerted,
            gaps: f.gaps,
        }
    }
}

/// A bounded log: the oldest entry is evicted (and counted) when full.
#[derive(Debug)]
struct BoundedLog<T> {
    items: VecDeque<T>,
    max: usize,
    evicted: u64,
}

impl<T> BoundedLog<T> {
    fn new(max: usize) -> Self {
        BoundedLog {
            items: VecDeque::new(),
            max,
            evicted: 0,
        }
    }
    /// Returns whether an old entry was evicted.
    fn push(&mut self, item: T) -> bool {
        if self.max == 0 {
            self.evicted += 1;
            return true;
        }
        let evict = self.items.len() >= self.max;
        if evict {
            self.items.pop_front();
            self.evicted += 1;
        }
        self.items.push_back(item);
        evict
    }
}

pub struct Ids {
    scanner: Scanner,
    http_limits: Limits,
    stream_limits: StreamLimits,
    threshold: u64,
    idle_timeout: Duration,
    closed_timeout: Duration,
    alerts: BoundedLog<Alert>,
    finished: BoundedLog<FlowSummary>,
    /// Sums over every flow that ended here (including evicted summaries).
    finished_requests: u64,
    finished_injections: u64,
    /// Normalisation buffer reused across requests.
    scratch: Vec<u8>,
}

impl Ids {
    pub fn new(cfg: Config) -> Result<Self, String> {
        cfg.validate()?;
        let scanner = Scanner::new(&cfg.patterns)?;
        Ok(Ids {
            scanner,
            http_limits: Limits {
                max_head_bytes: cfg.max_head_bytes,
                max_body_scan_bytes: cfg.max_body_scan_bytes,
            },
            stream_limits: StreamLimits {
                max_ooo_segments: cfg.max_ooo_segments,
                max_ooo_bytes: cfg.max_ooo_bytes,
                max_ahead_bytes: MAX_AHEAD_BYTES,
            },
            threshold: cfg.alert_threshold,
            idle_timeout: Duration::from_secs(cfg.idle_timeout_s),
            closed_timeout: Duration::from_secs(cfg.closed_timeout_s),
            alerts: BoundedLog::new(cfg.max_alerts),
            finished: BoundedLog::new(cfg.max_finished_flows),
            finished_requests: 0,
            finished_injections: 0,
            scratch: Vec::new(),
        })
    }

    /// The alert log, oldest first.
    pub fn alerts(&self) -> impl Iterator<Item = &Alert> {
        self.alerts.items.iter()
    }

    fn remember_finished(&mut self, ctx: &mut Ctx<IdsFlow>, key: &FlowKey, f: &IdsFlow) {
        self.finished_requests += f.requests;
        self.finished_injections += f.injections;
        if f.requests > 0 && self.finished.push(FlowSummary::of(key, f)) {
            ctx.count("ids_finished_evicted", 1);
        }
    }

    fn raise_alert(&mut self, ctx: &mut Ctx<IdsFlow>, key: &FlowKey, pkt: &Packet, f: (u64, u64)) {
        let (injections, requests) = f;
        let client = endpoint(pkt.meta.src, pkt.meta.sport);
        let server = endpoint(pkt.meta.dst, pkt.meta.dport);
        tracing::warn!(
            flow = %key, %client, %server, injections, requests, threshold = self.threshold,
            "ids: SQL-injection threshold reached"
        );
        ctx.count("ids_alerts", 1);
        let unix_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let alert = Alert {
            flow: key.to_string(),
            client,
            server,
            injections,
            requests,
            unix_ms,
        };
        if self.alerts.push(alert) {
            ctx.count("ids_alerts_evicted", 1);
        }
    }

    fn arm(ctx: &mut Ctx<IdsFlow>, key: &FlowKey, after: Duration) {
        let now = ctx.now();
        if ctx.flows.flow_timer(key, after, TIMER_EXPIRE, now).is_err() {
            ctx.count("ids_timer_errors", 1);
        }
    }

    /// Forwards a packet the IDS cannot inspect (no state available) — an IDS must not break
    /// traffic because its table is full.
    fn uninspected(ctx: &mut Ctx<IdsFlow>, pkt: Packet) {
        ctx.count("ids_uninspected", 1);
        ctx.pkt_write_direct(pkt);
    }
}

fn endpoint(ip: std::net::IpAddr, port: u16) -> String {
    std::net::SocketAddr::new(ip, port).to_string()
}

impl NetworkFunction for Ids {
    type Flow = IdsFlow;
    const NAME: &'static str = "ids";

    fn process(&mut self, ctx: &mut Ctx<IdsFlow>, pkt: Packet) {
        let m = pkt.meta;
        if m.proto != proto::TCP || m.fragment {
            // Nothing here depends on flow state: direct output by design.
            ctx.pkt_write_direct(pkt);
            return;
        }
        let key = pkt.key();
        let r = match ctx.flows.get_flow(&key) {
            Ok(r) => r,
            Err(StateError::NotFound(_)) => match ctx.flows.create_flow(key, IdsFlow::default()) {
                Ok(()) => match ctx.flows.get_flow(&key) {
                    Ok(r) => r,
                    Err(_) => return Self::uninspected(ctx, pkt),
                },
                Err(StateError::Migrated { .. }) => return ctx.pkt_drop(pkt, DROP_MIGRATED),
                Err(_) => return Self::uninspected(ctx, pkt),
            },
            // The flow's state lives on another replica now. Dropping (as the seed does) rather
            // than forwarding uninspected keeps the counts exact: the sender retransmits, and
            // the retransmission reaches the owner.
            Err(StateError::Migrated { .. }) => return ctx.pkt_drop(pkt, DROP_MIGRATED),
            Err(_) => return Self::uninspected(ctx, pkt),
        };
        let flags = m.tcp_flags;
        let from_client = pkt.ingress == Side::Inside;
        let st = ctx.flows.state_mut(&r);
        let mut ended: Option<IdsFlow> = None;
        let pure_syn = flags & (TCP_SYN | TCP_ACK | TCP_RST) == TCP_SYN;
        // A retransmitted SYN carries the same initial sequence number; a different one (or
        // any SYN after the close) means the 5-tuple is reused by a new connection and the
        // old one is finished.
        let new_isn = st
            .stream
            .next_seq()
            .is_some_and(|n| n != m.tcp_seq.wrapping_add(1));
        if from_client && pure_syn && (st.closed() || new_isn) {
            ended = Some(std::mem::take(st));
        }
        let mut modified = ended.is_some();
        let mut tally = Tally::default();
        let mut sstats = StreamStats::default();
        if from_client {
            let payload = pkt.payload();
            let syn = flags & TCP_SYN != 0;
            if !payload.is_empty() || syn {
                modified = true;
                let IdsFlow { stream, http, .. } = &mut *st;
                let mut env = Env {
                    limits: &self.http_limits,
                    scanner: &self.scanner,
                    scratch: &mut self.scratch,
                };
                stream.push(
                    m.tcp_seq,
                    syn,
                    payload,
                    &self.stream_limits,
                    &mut sstats,
                    &mut |p| match p {
                        Piece::Data(d) => http.feed(d, &mut env, &mut tally),
                        Piece::Gap(n) => http.gap(n),
                    },
                );
            }
        }
        if flags & TCP_RST != 0 && !st.reset {
            st.reset = true;
            modified = true;
        }
        if flags & TCP_FIN != 0 {
            let bit = if from_client { 1 } else { 2 };
            if st.fins & bit == 0 {
                st.fins |= bit;
                modified = true;
            }
        }
        st.requests += tally.requests;
        st.injections += tally.injections;
        st.gaps += sstats.gaps;
        let alert = if !st.alerted && st.injections >= self.threshold {
            st.alerted = true;
            Some((st.injections, st.requests))
        } else {
            None
        };
        let timeout = if st.closed() {
            self.closed_timeout
        } else {
            self.idle_timeout
        };
        ctx.flows.put_flow(r, modified);

        for (name, n) in [
            ("ids_requests", tally.requests),
            ("ids_injections", tally.injections),
            ("ids_desyncs", tally.desyncs),
            ("ids_bodies_truncated", tally.bodies_truncated),
            ("ids_not_http", u64::from(tally.not_http)),
            ("ids_duplicate_segments", sstats.duplicates),
            ("ids_out_of_order_segments", sstats.out_of_order),
            ("ids_gaps", sstats.gaps),
            ("ids_out_of_window_segments", sstats.out_of_window),
        ] {
            if n > 0 {
                ctx.count(name, n);
            }
        }
        if let Some(old) = ended {
            self.remember_finished(ctx, &key, &old);
        }
        if let Some(a) = alert {
            self.raise_alert(ctx, &key, &pkt, a);
        }
        Self::arm(ctx, &key, timeout);
        ctx.pkt_write(&key, pkt);
    }

    fn on_timer(&mut self, ctx: &mut Ctx<IdsFlow>, key: FlowKey, timer: TimerId) {
        if timer != TIMER_EXPIRE {
            return;
        }
        match ctx.flows.delete_flow(&key) {
            Ok(f) => {
                ctx.count("ids_expired", 1);
                self.remember_finished(ctx, &key, &f);
            }
            Err(StateError::Busy { .. }) => {
                ctx.count("ids_expire_busy", 1);
                Self::arm(ctx, &key, BUSY_RETRY);
            }
            Err(_) => {}
        }
    }

    fn query(&self, ctx: &Ctx<IdsFlow>) -> serde_json::Value {
        let mut keys = ctx.flows.keys();
        keys.sort_unstable();
        let (mut live_requests, mut live_injections) = (0u64, 0u64);
        let mut flows = Vec::new();
        let mut truncated = false;
        for k in &keys {
            let Some(f) = ctx.flows.peek(k) else { continue };
            live_requests += f.requests;
            live_injections += f.injections;
            // Only flows that carried HTTP are interesting to list.
            if f.requests == 0 && f.injections == 0 {
                continue;
            }
            if flows.len() >= MAX_QUERY_FLOWS {
                truncated = true;
                continue;
            }
            flows.push(FlowSummary::of(k, f));
        }
        serde_json::json!({
            "alert_threshold": self.threshold,
            "totals": {
                "requests": live_requests + self.finished_requests,
                "injections": live_injections + self.finished_injections,
                "alerts": self.alerts.items.len() as u64 + self.alerts.evicted,
            },
            "live_flows": keys.len(),
            "flows": flows,
            "flows_truncated": truncated,
            "finished": self.finished.items,
            "finished_evicted": self.finished.evicted,
            "alerts": self.alerts.items,
            "alerts_evicted": self.alerts.evicted,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pliant_net::build::{self, tcp_flags::*};
    use pliant_runtime::testing::Harness;
    use pliant_runtime::OutputKind;
    use std::net::IpAddr;

    const CLIENT: &str = "10.0.1.2";
    const SERVER: &str = "10.0.2.2";

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    /// One client connection; tracks both sides' next sequence numbers.
    struct Tcp {
        cport: u16,
        cseq: u32,
        sseq: u32,
    }

    impl Tcp {
        fn key(&self) -> FlowKey {
            FlowKey::v4(
                proto::TCP,
                CLIENT.parse().unwrap(),
                self.cport,
                SERVER.parse().unwrap(),
                80,
            )
            .0
        }
        fn client_frame(&self, flags: u8, seq: u32, payload: &[u8]) -> Vec<u8> {
            build::tcp(
                build::MAC_A,
                build::MAC_B,
                ip(CLIENT),
                self.cport,
                ip(SERVER),
                80,
                flags,
                seq,
                self.sseq,
                payload,
            )
        }
        fn server_frame(&self, flags: u8, payload: &[u8]) -> Vec<u8> {
            build::tcp(
                build::MAC_B,
                build::MAC_A,
                ip(SERVER),
                80,
                ip(CLIENT),
                self.cport,
                flags,
                self.sseq,
                self.cseq,
                payload,
            )
        }
        /// Three-way handshake; the initial sequence numbers are near the wrap-around point.
        fn open(h: &mut Harness<Ids>, cport: u16) -> Tcp {
            let mut t = Tcp {
                cport,
                cseq: u32::MAX - 100,
                sseq: 7,
            };
            inject(h, Side::Inside, &t.client_frame(SYN, t.cseq, b""));
            t.cseq = t.cseq.wrapping_add(1);
            inject(h, Side::Outside, &t.server_frame(SYN | ACK, b""));
            t.sseq += 1;
            inject(h, Side::Inside, &t.client_frame(ACK, t.cseq, b""));
            t
        }
        /// Sends `data` from the client as segments of `seg` bytes, in order.
        fn send(&mut self, h: &mut Harness<Ids>, data: &[u8], seg: usize) {
            for c in data.chunks(seg) {
                inject(h, Side::Inside, &self.client_frame(ACK | PSH, self.cseq, c));
                self.cseq = self.cseq.wrapping_add(c.len() as u32);
            }
        }
    }

    fn inject(h: &mut Harness<Ids>, side: Side, frame: &[u8]) {
        h.inject(side, frame).expect("frame parses");
    }

    const CLEAN: &str = "GET /index.html?page=2 HTTP/1.1\r\nHost: web\r\n\r\n";
    const SQLI: &str = "GET /item?id=1%27%20OR%201%3D1 HTTP/1.1\r\nHost: web\r\n\r\n";

    fn post(body: &str) -> String {
        format!(
            "POST /login HTTP/1.1\r\nHost: web\r\nContent-Length: {}\r\n\r\n{}",
            body.len(),
            body
        )
    }

    fn ids(threshold: u64) -> Harness<Ids> {
        Harness::new(
            Ids::new(Config {
                alert_threshold: threshold,
                ..Config::default()
            })
            .unwrap(),
        )
    }

    fn flow(h: &Harness<Ids>, t: &Tcp) -> IdsFlow {
        h.ctx.flows.peek(&t.key()).expect("flow state").clone()
    }

    /// The mixed workload: `n` requests, every third one an injection (URI or body).
    fn workload(n: usize) -> (Vec<u8>, u64) {
        let mut s = String::new();
        let mut bad = 0;
        for i in 0..n {
            match i % 6 {
                0 => {
                    s += SQLI;
                    bad += 1;
                }
                3 => {
                    s += &post("user=admin'--&pw=x");
                    bad += 1;
                }
                4 => s += &post("user=bob&pw=hunter2"),
                _ => s += CLEAN,
            }
        }
        (s.into_bytes(), bad)
    }

    #[test]
    fn exact_counts_over_segmented_persistent_connection() {
        let mut h = ids(1000);
        let mut t = Tcp::open(&mut h, 40000);
        let (data, bad) = workload(60);
        t.send(&mut h, &data, 7);
        let f = flow(&h, &t);
        assert_eq!((f.requests, f.injections), (60, bad));
        assert_eq!(bad, 20);
        assert_eq!(h.counter("ids_injections"), bad);
        assert_eq!(h.counter("ids_desyncs"), 0);
    }

    #[test]
    fn retransmissions_and_reordering_do_not_change_counts() {
        let mut h = ids(1000);
        let mut t = Tcp::open(&mut h, 40001);
        let (data, bad) = workload(30);
        // Segments of 11 bytes; each pair is sent swapped, then the first one again
        // (a retransmission), and every fifth segment is duplicated with a larger overlap.
        let segs: Vec<(u32, &[u8])> = data
            .chunks(11)
            .scan(t.cseq, |seq, c| {
                let s = *seq;
                *seq = seq.wrapping_add(c.len() as u32);
                Some((s, c))
            })
            .collect();
        for (i, pair) in segs.chunks(2).enumerate() {
            for &(seq, c) in pair.iter().rev() {
                inject(&mut h, Side::Inside, &t.client_frame(ACK, seq, c));
            }
            let (seq, c) = pair[0];
            inject(&mut h, Side::Inside, &t.client_frame(ACK, seq, c));
            if i % 5 == 0 {
                // A resegmented retransmission: starts inside bytes already seen and runs 8
                // bytes into the next pair (which then arrives partly overlapping, too).
                let start = (seq.wrapping_sub(t.cseq)) as usize + 5;
                let end = (start + 25).min(data.len());
                if start < end {
                    let s = seq.wrapping_add(5);
                    inject(
                        &mut h,
                        Side::Inside,
                        &t.client_frame(ACK, s, &data[start..end]),
                    );
                }
            }
        }
        t.cseq = t.cseq.wrapping_add(data.len() as u32);
        let f = flow(&h, &t);
        assert_eq!((f.requests, f.injections, f.gaps), (30, bad, 0));
        assert!(h.counter("ids_duplicate_segments") > 0);
        assert!(h.counter("ids_out_of_order_segments") > 0);
        // Every packet was forwarded, as stateful output of its flow.
        let written = h.take_written();
        assert!(written
            .iter()
            .all(|w| w.kind == OutputKind::Stateful(t.key())));
    }

    #[test]
    fn alert_raised_once_when_threshold_reached() {
        let mut h = ids(3);
        let mut t = Tcp::open(&mut h, 40002);
        t.send(&mut h, CLEAN.as_bytes(), 1400);
        t.send(&mut h, SQLI.as_bytes(), 1400);
        t.send(&mut h, SQLI.as_bytes(), 1400);
        assert_eq!(h.counter("ids_alerts"), 0, "2 < threshold 3");
        t.send(&mut h, SQLI.as_bytes(), 1400);
        assert_eq!(h.counter("ids_alerts"), 1);
        for _ in 0..5 {
            t.send(&mut h, SQLI.as_bytes(), 1400);
        }
        assert_eq!(h.counter("ids_alerts"), 1, "once per flow");
        let q = h.query();
        assert_eq!(q["alerts"].as_array().unwrap().len(), 1);
        assert_eq!(q["alerts"][0]["client"], "10.0.1.2:40002");
        assert_eq!(q["alerts"][0]["injections"], 3);
        assert_eq!(q["flows"][0]["injections"], 8);
        assert_eq!(q["flows"][0]["requests"], 9);
        assert_eq!(q["totals"]["injections"], 8);
        // A second flow gets its own alert.
        let mut t2 = Tcp::open(&mut h, 40003);
        for _ in 0..3 {
            t2.send(&mut h, SQLI.as_bytes(), 5);
        }
        assert_eq!(h.counter("ids_alerts"), 2);
    }

    #[test]
    fn clean_traffic_is_never_counted_and_responses_are_ignored() {
        let mut h = ids(1);
        let mut t = Tcp::open(&mut h, 40004);
        for _ in 0..10 {
            t.send(&mut h, CLEAN.as_bytes(), 16);
            t.send(&mut h, post("q=union+station&sort=asc").as_bytes(), 1400);
            // The server's response mentions an injection: responses are not requests.
            let resp = b"HTTP/1.1 200 OK\r\nContent-Length: 24\r\n\r\n' or 1=1 union select x";
            inject(&mut h, Side::Outside, &t.server_frame(ACK, resp));
            t.sseq += resp.len() as u32;
        }
        let f = flow(&h, &t);
        assert_eq!((f.requests, f.injections, f.alerted), (20, 0, false));
        assert_eq!(h.counter("ids_alerts"), 0);
    }

    #[test]
    fn counts_and_alert_flag_survive_migration() {
        let mut a = ids(4);
        let mut t = Tcp::open(&mut a, 40005);
        let (data, bad) = workload(24);
        // Cut the stream in the middle of a request, then move the flow to another replica.
        let cut = data.len() / 2 + 3;
        t.send(&mut a, &data[..cut], 100);
        assert_eq!(
            a.counter("ids_alerts"),
            1,
            "threshold 4 reached in the first half"
        );
        let now = a.now();
        let bytes = a.ctx.flows.export_flow(&t.key(), now).expect("export");
        let mut b = ids(4);
        let now_b = b.now();
        b.ctx.flows.import_flow(&bytes, now_b).expect("import");
        t.send(&mut b, &data[cut..], 100);
        let f = flow(&b, &t);
        assert_eq!((f.requests, f.injections), (24, bad));
        assert!(f.alerted);
        assert_eq!(
            b.counter("ids_alerts"),
            0,
            "the alert is not raised twice after migration"
        );
        assert_eq!(
            a.counter("ids_injections") + b.counter("ids_injections"),
            bad
        );
        // A late packet at the old replica is dropped (its retransmission reaches the owner).
        inject(&mut a, Side::Inside, &t.client_frame(ACK, t.cseq, b"x"));
        assert_eq!(a.drop_count(DROP_MIGRATED), 1);
    }

    #[test]
    fn expired_flows_are_summarised_and_totals_stay_exact() {
        let mut h = ids(100);
        let mut t = Tcp::open(&mut h, 40006);
        t.send(&mut h, SQLI.as_bytes(), 1400);
        t.send(&mut h, CLEAN.as_bytes(), 1400);
        inject(
            &mut h,
            Side::Inside,
            &t.client_frame(FIN | ACK, t.cseq, b""),
        );
        inject(&mut h, Side::Outside, &t.server_frame(FIN | ACK, b""));
        h.advance(Duration::from_secs(11));
        assert!(
            h.ctx.flows.is_empty(),
            "closed flows expire after closed_timeout_s"
        );
        let q = h.query();
        assert_eq!(q["finished"][0]["requests"], 2);
        assert_eq!(q["finished"][0]["injections"], 1);
        assert_eq!(q["totals"]["requests"], 2);
        assert_eq!(q["totals"]["injections"], 1);
        // Idle flows expire too.
        let mut t2 = Tcp::open(&mut h, 40007);
        t2.send(&mut h, SQLI.as_bytes(), 1400);
        h.advance(Duration::from_secs(301));
        assert_eq!(h.query()["totals"]["injections"], 2);
        assert_eq!(h.counter("ids_expired"), 2);
    }

    #[test]
    fn lost_segment_is_a_counted_gap_and_parsing_recovers() {
        let mut h = Harness::new(
            Ids::new(Config {
                max_ooo_segments: 2,
                alert_threshold: 100,
                ..Config::default()
            })
            .unwrap(),
        );
        let mut t = Tcp::open(&mut h, 40008);
        // Request 1 loses its middle segment for good (e.g. captured elsewhere).
        let r1 = SQLI.as_bytes();
        inject(
            &mut h,
            Side::Inside,
            &t.client_frame(ACK, t.cseq, &r1[..10]),
        );
        t.cseq = t.cseq.wrapping_add(r1.len() as u32);
        // Then three whole requests, each one segment, arrive out of order behind the hole.
        let mut seq = t.cseq;
        for _ in 0..3 {
            inject(
                &mut h,
                Side::Inside,
                &t.client_frame(ACK, seq, SQLI.as_bytes()),
            );
            seq = seq.wrapping_add(SQLI.len() as u32);
        }
        t.cseq = seq;
        t.send(&mut h, CLEAN.as_bytes(), 1400);
        let f = flow(&h, &t);
        assert_eq!(f.gaps, 1);
        assert_eq!(h.counter("ids_gaps"), 1);
        assert_eq!(
            (f.requests, f.injections),
            (4, 3),
            "the damaged request is lost, not guessed"
        );
        assert!(f.stream.buffered() == 0);
    }

    #[test]
    fn hostile_input_never_panics_and_stays_bounded() {
        let cfg = Config {
            max_head_bytes: 1024,
            max_ooo_bytes: 4096,
            ..Config::default()
        };
        let mut h = Harness::new(Ids::new(cfg.clone()).unwrap());
        let mut x: u64 = 0x9e3779b97f4a7c15;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut t = Tcp::open(&mut h, 40009);
        for i in 0..3000 {
            let r = rnd();
            let len = (r % 200) as usize;
            let mut payload: Vec<u8> = (0..len).map(|_| rnd() as u8).collect();
            if i % 7 == 0 {
                // Sprinkle HTTP-looking fragments so the parser gets past the first bytes.
                payload.splice(
                    0..0,
                    b"GET /?a=' or 1=1 HTTP/1.1\r\nContent-Length: 99999\r\n"
                        .iter()
                        .copied(),
                );
            }
            let seq = match r % 4 {
                0 => t.cseq.wrapping_add((rnd() % 10_000) as u32),
                1 => t.cseq.wrapping_sub((rnd() % 100) as u32),
                2 => rnd() as u32,
                _ => t.cseq,
            };
            if seq == t.cseq {
                t.cseq = t.cseq.wrapping_add(payload.len() as u32);
            }
            let flags = (rnd() as u8) & (FIN | SYN | RST | PSH | ACK);
            inject(&mut h, Side::Inside, &t.client_frame(flags, seq, &payload));
            let f = flow(&h, &t);
            assert!(f.stream.buffered() <= cfg.max_ooo_bytes + 200);
            assert!(f.http.buffered() <= cfg.max_head_bytes + cfg.max_body_scan_bytes + 2048);
        }
        // Everything was forwarded.
        assert_eq!(h.take_output().len(), 3000 + 3);
    }

    #[test]
    fn idle_flow_state_is_small_between_requests() {
        let mut h = ids(100);
        let mut t = Tcp::open(&mut h, 40011);
        let (data, _) = workload(12);
        t.send(&mut h, &data, 1400);
        let now = h.now();
        let bytes = h.ctx.flows.export_flow(&t.key(), now).unwrap();
        // Between requests no bytes are buffered: the flow costs little to move.
        assert!(bytes.len() <= 128, "{} bytes", bytes.len());
    }

    #[test]
    fn reused_tuple_starts_a_new_count() {
        let mut h = ids(100);
        let mut t = Tcp::open(&mut h, 40010);
        t.send(&mut h, SQLI.as_bytes(), 1400);
        // The client reuses the port with a new initial sequence number (the old connection's
        // end was never seen): the new connection must be parsed from its start.
        let mut t2 = Tcp {
            cport: 40010,
            cseq: 5_000_000,
            sseq: 99,
        };
        inject(&mut h, Side::Inside, &t2.client_frame(SYN, t2.cseq, b""));
        t2.cseq += 1;
        t2.send(&mut h, CLEAN.as_bytes(), 20);
        t2.send(&mut h, SQLI.as_bytes(), 20);
        let f = flow(&h, &t2);
        assert_eq!((f.requests, f.injections, f.gaps), (2, 1, 0));
        let q = h.query();
        assert_eq!(q["finished"][0]["injections"], 1);
        assert_eq!(q["totals"]["injections"], 2);
        assert_eq!(q["totals"]["requests"], 3);
    }

    #[test]
    fn non_tcp_is_forwarded_directly() {
        let mut h = ids(1);
        let f = build::udp(
            build::MAC_A,
            build::MAC_B,
            ip(CLIENT),
            5000,
            ip(SERVER),
            53,
            b"' or 1=1",
        );
        inject(&mut h, Side::Inside, &f);
        let w = h.take_written();
        assert_eq!(w.len(), 1);
        assert_eq!(w[0].kind, OutputKind::Direct);
        assert!(h.ctx.flows.is_empty());
    }

    #[test]
    fn bad_config_is_refused() {
        #[derive(Deserialize)]
        struct File {
            ids: Config,
        }
        let parse = |s: &str| {
            toml::from_str::<File>(s)
                .map(|f| f.ids)
                .map_err(|e| e.to_string())
        };
        let cfg = parse("[ids]\nalert_threshold = 2\npatterns = [\"evil\"]\n").unwrap();
        assert!(Ids::new(cfg).is_ok());
        assert!(parse("[ids]\nthreshold = 2\n")
            .unwrap_err()
            .contains("unknown field"));
        let e = Ids::new(parse("[ids]\nalert_threshold = 0\n").unwrap())
            .err()
            .unwrap();
        assert!(e.contains("alert_threshold"), "{e}");
        let e = Ids::new(parse("[ids]\npatterns = []\n").unwrap())
            .err()
            .unwrap();
        assert!(e.contains("patterns is empty"), "{e}");
        let e = Ids::new(parse("[ids]\nmax_head_bytes = 10\n").unwrap())
            .err()
            .unwrap();
        assert!(e.contains("max_head_bytes"), "{e}");
    }
}
