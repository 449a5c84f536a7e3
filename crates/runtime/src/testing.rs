//! Test harness for network functions: a [`Ctx`] without any I/O and a fake clock.
//!
//! STATUS: usable. `Harness::new(nf)` / `Harness::with_table(nf, TableConfig)`, then
//! `inject(Side, &frame)`, `advance(Duration)`, `take_output()`, `drops()` / `drop_count(reason)`,
//! `counter(name)`, `query()`, direct access to `harness.nf` and `harness.ctx` (e.g. `ctx.flows`).
//!
//! ```ignore
//! let mut h = Harness::new(MyNf::new(cfg)?);
//! h.inject(Side::Inside, &frame)?;          // parses with pliant_net::parse, calls process
//! let out = h.take_output();                // Vec<(egress Side, frame bytes)>
//! h.advance(Duration::from_secs(31));       // fires due flow timers through on_timer
//! assert_eq!(h.drop_count("nat_no_mapping"), 1);
//! ```
//!
//! The harness hands frames to the NF exactly as the engine does after parsing, but does no
//! routing: outputs are the bytes the NF wrote (no MAC rewrite, no TTL decrement), so NF tests
//! check the NF alone.

use crate::nf::{Ctx, NetworkFunction, Output, OutputKind, Packet, Side};
use pliant_net::{Frame, ParseError};
use pliant_state::{FlowKey, FlowTable, SharedStore, TableConfig, TimerId};
use std::time::{Duration, Instant};

/// Why `inject` did not hand a frame to the NF.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InjectError {
    /// The frame did not parse (counted under `ParseError::reason()`, as the engine does).
    #[error("frame refused by the parser: {0}")]
    Parse(ParseError),
    /// ARP or another non-IP frame: the engine never hands these to the NF.
    #[error("not an IP frame ({0})")]
    NotIp(&'static str),
}

/// A packet written by the NF, with how it was written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WrittenFrame {
    pub egress: Side,
    pub ingress: Side,
    pub kind: OutputKind,
    pub frame: Vec<u8>,
}

pub struct Harness<N: NetworkFunction> {
    pub nf: N,
    pub ctx: Ctx<N::Flow>,
    written: Vec<WrittenFrame>,
    scratch_out: Vec<Output>,
    scratch_timers: Vec<(FlowKey, TimerId)>,
    start: Instant,
    /// Timer callbacks dispatched so far.
    pub timers_fired: u64,
}

impl<N: NetworkFunction> Harness<N> {
    /// Bound on timer rounds in one `advance`, so an NF that re-arms a zero-length timer from
    /// `on_timer` fails the test instead of hanging it.
    const MAX_TIMER_ROUNDS: usize = 1_000_000;

    pub fn new(nf: N) -> Self {
        Self::with_table(nf, TableConfig::default())
    }

    pub fn with_table(nf: N, table: TableConfig) -> Self {
        let start = Instant::now();
        Harness {
            nf,
            ctx: Ctx::new(FlowTable::new(table), SharedStore::default(), start),
            written: Vec::new(),
            scratch_out: Vec::new(),
            scratch_timers: Vec::new(),
            start,
            timers_fired: 0,
        }
    }

    /// Current fake time.
    pub fn now(&self) -> Instant {
        self.ctx.now()
    }

    /// Fake time elapsed since the harness was built.
    pub fn elapsed(&self) -> Duration {
        self.ctx.now().saturating_duration_since(self.start)
    }

    /// Parses `frame` and hands it to the NF as if it arrived on `side`.
    pub fn inject(&mut self, side: Side, frame: &[u8]) -> Result<(), InjectError> {
        let parsed = match pliant_net::parse(frame) {
            Ok(Frame::Ip(p)) => p,
            Ok(Frame::Arp(_)) => return Err(InjectError::NotIp("arp")),
            Ok(Frame::Other { .. }) => {
                self.ctx.count_drop("not_ip", 1);
                return Err(InjectError::NotIp("other ethertype"));
            }
            Err(e) => {
                self.ctx.count_drop(e.reason(), 1);
                return Err(InjectError::Parse(e));
            }
        };
        let mut buf = self.ctx.take_buf();
        buf.extend_from_slice(frame);
        let pkt = Packet::new(buf, side, parsed);
        self.nf.process(&mut self.ctx, pkt);
        self.collect();
        Ok(())
    }

    /// Advances the fake clock by `d`, firing due timers in deadline order (the clock stops at
    /// each deadline, as the engine's poll timeout would, so timers re-armed from `on_timer`
    /// fire at the right fake time).
    pub fn advance(&mut self, d: Duration) {
        let target = self.ctx.now() + d;
        for _ in 0..Self::MAX_TIMER_ROUNDS {
            match self.ctx.flows.next_deadline() {
                Some(dl) if dl <= target => {
                    if dl > self.ctx.now() {
                        self.ctx.set_now(dl);
                    }
                    self.fire_due();
                }
                _ => {
                    self.ctx.set_now(target);
                    return;
                }
            }
        }
        panic!(
            "timers kept re-arming within the same instant for {} rounds",
            Self::MAX_TIMER_ROUNDS
        );
    }

    fn fire_due(&mut self) {
        let now = self.ctx.now();
        self.scratch_timers.clear();
        self.ctx.flows.expired_timers(now, &mut self.scratch_timers);
        let due = std::mem::take(&mut self.scratch_timers);
        for (key, id) in &due {
            self.timers_fired += 1;
            self.nf.on_timer(&mut self.ctx, *key, *id);
        }
        self.scratch_timers = due;
        self.collect();
    }

    fn collect(&mut self) {
        self.ctx.drain_output(&mut self.scratch_out);
        for o in self.scratch_out.drain(..) {
            self.written.push(WrittenFrame {
                egress: o.pkt.egress,
                ingress: o.pkt.ingress,
                kind: o.kind,
                frame: o.pkt.buf,
            });
        }
    }

    /// Frames written since the last call, in write order, with their egress side.
    pub fn take_output(&mut self) -> Vec<(Side, Vec<u8>)> {
        self.written
            .drain(..)
            .map(|w| (w.egress, w.frame))
            .collect()
    }

    /// Like `take_output`, with ingress side and `pkt_write` vs `pkt_write_direct`.
    pub fn take_written(&mut self) -> Vec<WrittenFrame> {
        std::mem::take(&mut self.written)
    }

    /// All drops so far, `(reason, count)` sorted by reason.
    pub fn drops(&self) -> Vec<(&'static str, u64)> {
        self.ctx.drops().snapshot()
    }

    pub fn drop_count(&self, reason: &str) -> u64 {
        self.ctx.drops().get(reason)
    }

    /// An NF counter (`ctx.count(name, n)`).
    pub fn counter(&self, name: &str) -> u64 {
        self.ctx.nf_counters().get(name)
    }

    pub fn query(&self) -> serde_json::Value {
        self.nf.query(&self.ctx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::forward::Forward;

    fn udp_frame() -> Vec<u8> {
        // Ethernet + IPv4 + UDP, checksums not needed by the forward NF.
        let mut f = vec![0u8; 14 + 20 + 8 + 4];
        f[12] = 0x08;
        f[14] = 0x45;
        let total = (20 + 8 + 4) as u16;
        f[16..18].copy_from_slice(&total.to_be_bytes());
        f[22] = 64;
        f[23] = 17;
        f[26..30].copy_from_slice(&[10, 0, 1, 2]);
        f[30..34].copy_from_slice(&[10, 0, 2, 2]);
        f[34..36].copy_from_slice(&1234u16.to_be_bytes());
        f[36..38].copy_from_slice(&53u16.to_be_bytes());
        f[38..40].copy_from_slice(&12u16.to_be_bytes());
        let mut sum = 0u32;
        for w in f[14..34].chunks(2) {
            sum += u32::from(u16::from_be_bytes([w[0], w[1]]));
        }
        while sum > 0xffff {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        let c = !(sum as u16);
        f[24..26].copy_from_slice(&c.to_be_bytes());
        f
    }

    #[test]
    fn forward_passes_frames_to_the_opposite_side() {
        let mut h = Harness::new(Forward::default());
        let f = udp_frame();
        h.inject(Side::Inside, &f).expect("valid frame");
        h.inject(Side::Outside, &f).expect("valid frame");
        let out = h.take_output();
        assert_eq!(out, vec![(Side::Outside, f.clone()), (Side::Inside, f)]);
        assert!(h.take_output().is_empty());
    }

    #[test]
    fn malformed_frames_are_counted_not_processed() {
        let mut h = Harness::new(Forward::default());
        let e = h.inject(Side::Inside, &[0u8; 5]).unwrap_err();
        assert!(matches!(e, InjectError::Parse(_)));
        assert!(h.take_output().is_empty());
        assert_eq!(h.drops().iter().map(|d| d.1).sum::<u64>(), 1);
    }
}
