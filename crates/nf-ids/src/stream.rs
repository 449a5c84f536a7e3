//! One direction of a TCP byte stream, reassembled in sequence order for the HTTP parser.
//!
//! The IDS is passive (it forwards every packet), so anything it does not keep is gone for it:
//! the receiver acknowledges it and the sender never retransmits it. Hence:
//! - in-order bytes are delivered at once (no copy);
//! - bytes already delivered (retransmissions, duplicates) are ignored by sequence number, and a
//!   segment overlapping delivered bytes contributes only its new tail;
//! - a segment ahead of the next expected byte is copied into a bounded out-of-order buffer and
//!   delivered when the hole fills;
//! - when that buffer's bound is hit, the hole is declared a gap: the stream skips to the
//!   earliest buffered byte and tells the parser how many bytes it lost.

use serde::{Deserialize, Serialize};

/// A copy of an out-of-order segment.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Segment {
    pub seq: u32,
    pub data: Vec<u8>,
}

#[derive(Clone, Copy, Debug)]
pub struct StreamLimits {
    pub max_ooo_segments: usize,
    pub max_ooo_bytes: usize,
    /// Segments further ahead than this are not plausible for this connection (garbage or an
    /// attack on the buffer) and are ignored, counted.
    pub max_ahead_bytes: u32,
}

/// What happened to one segment (feeds the NF counters).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StreamStats {
    /// Segments whose bytes were all delivered before.
    pub duplicates: u64,
    /// Segments buffered out of order.
    pub out_of_order: u64,
    /// Holes given up on.
    pub gaps: u64,
    /// Segments ignored as implausibly far ahead.
    pub out_of_window: u64,
}

/// What the stream hands to its consumer, in order.
#[derive(Debug, PartialEq, Eq)]
pub enum Piece<'a> {
    Data(&'a [u8]),
    /// Bytes lost: `Some(n)` when the amount is known, `None` when the stream was picked up
    /// mid-way (no SYN seen).
    Gap(Option<u64>),
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reassembler {
    /// Next expected sequence number; `None` until the SYN or the first data segment.
    next_seq: Option<u32>,
    ooo: Vec<Segment>,
    ooo_bytes: usize,
}

/// Signed distance from `base` to `seq` in sequence space (RFC 1982 style).
fn rel(seq: u32, base: u32) -> i64 {
    i64::from(seq.wrapping_sub(base) as i32)
}

impl Reassembler {
    pub fn next_seq(&self) -> Option<u32> {
        self.next_seq
    }

    /// Bytes held in the out-of-order buffer.
    pub fn buffered(&self) -> usize {
        self.ooo_bytes
    }

    /// Takes one segment: `seq` is the TCP sequence number of the packet, `syn` whether it
    /// carries SYN (which occupies one sequence number before the payload).
    pub fn push(
        &mut self,
        seq: u32,
        syn: bool,
        payload: &[u8],
        lim: &StreamLimits,
        stats: &mut StreamStats,
        sink: &mut impl FnMut(Piece<'_>),
    ) {
        let data_seq = if syn { seq.wrapping_add(1) } else { seq };
        if syn && self.next_seq.is_none() {
            self.next_seq = Some(data_seq);
        }
        if payload.is_empty() {
            return;
        }
        let next = match self.next_seq {
            Some(n) => n,
            None => {
                // Picked up mid-stream: start here, and tell the parser it missed the start.
                sink(Piece::Gap(None));
                self.next_seq = Some(data_seq);
                data_seq
            }
        };
        let d = rel(data_seq, next);
        if d <= 0 {
            let overlap = usize::try_from(-d).unwrap_or(usize::MAX);
            if overlap >= payload.len() {
                stats.duplicates += 1;
                return;
            }
            self.deliver(&payload[overlap..], sink);
            self.drain(sink);
            return;
        }
        if d > i64::from(lim.max_ahead_bytes) {
            stats.out_of_window += 1;
            return;
        }
        stats.out_of_order += 1;
        self.insert(data_seq, payload);
        // Bound hit: stop waiting for the oldest hole and move on.
        while self.ooo.len() > lim.max_ooo_segments || self.ooo_bytes > lim.max_ooo_bytes {
            let Some(next) = self.next_seq else { break };
            let Some(first) = self.ooo.iter().map(|s| s.seq).min_by_key(|&s| rel(s, next)) else {
                break;
            };
            let skipped = rel(first, next).max(0) as u64;
            stats.gaps += 1;
            sink(Piece::Gap(Some(skipped)));
            self.next_seq = Some(first);
            self.drain(sink);
        }
    }

    fn deliver(&mut self, data: &[u8], sink: &mut impl FnMut(Piece<'_>)) {
        if let Some(n) = self.next_seq.as_mut() {
            // Segment lengths fit u32 (at most 64 KiB).
            *n = n.wrapping_add(data.len() as u32);
        }
        sink(Piece::Data(data));
    }

    fn insert(&mut self, seq: u32, payload: &[u8]) {
        if let Some(existing) = self.ooo.iter_mut().find(|s| s.seq == seq) {
            // A retransmission of a buffered segment: keep the longer copy.
            if payload.len() > existing.data.len() {
                self.ooo_bytes += payload.len() - existing.data.len();
                existing.data.clear();
                existing.data.extend_from_slice(payload);
            }
            return;
        }
        self.ooo_bytes += payload.len();
        self.ooo.push(Segment {
            seq,
            data: payload.to_vec(),
        });
    }

    /// Delivers buffered segments that have become in-order.
    fn drain(&mut self, sink: &mut impl FnMut(Piece<'_>)) {
        while let Some(next) = self.next_seq {
            let Some(idx) = (0..self.ooo.len()).min_by_key(|&i| rel(self.ooo[i].seq, next)) else {
                return;
            };
            let d = rel(self.ooo[idx].seq, next);
            if d > 0 {
                return;
            }
            let seg = self.ooo.swap_remove(idx);
            self.ooo_bytes -= seg.data.len();
            let overlap = usize::try_from(-d).unwrap_or(usize::MAX);
            if overlap < seg.data.len() {
                self.deliver(&seg.data[overlap..], sink);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIM: StreamLimits = StreamLimits {
        max_ooo_segments: 4,
        max_ooo_bytes: 64,
        max_ahead_bytes: 1 << 20,
    };

    /// Pushes segments and returns the delivered text with gaps shown as `[gap n]`.
    fn run(r: &mut Reassembler, segs: &[(u32, bool, &str)], stats: &mut StreamStats) -> String {
        let mut out = String::new();
        for &(seq, syn, data) in segs {
            r.push(seq, syn, data.as_bytes(), &LIM, stats, &mut |p| match p {
                Piece::Data(d) => out.push_str(std::str::from_utf8(d).unwrap()),
                Piece::Gap(n) => out.push_str(&format!("[gap {n:?}]")),
            });
        }
        out
    }

    #[test]
    fn in_order_duplicate_overlap_and_reorder() {
        let mut r = Reassembler::default();
        let mut st = StreamStats::default();
        let isn = u32::MAX - 3; // exercise wrap-around
        let s = |off: u32| isn.wrapping_add(1).wrapping_add(off);
        let out = run(
            &mut r,
            &[
                (isn, true, ""),
                (s(0), false, "GET "),
                (s(0), false, "GET "),  // full duplicate
                (s(7), false, "HTTP"),  // ahead: buffered
                (s(2), false, "T /x "), // overlaps 2 delivered bytes, fills the hole
            ],
            &mut st,
        );
        assert_eq!(out, "GET /x HTTP");
        assert_eq!(st.duplicates, 1);
        assert_eq!(st.out_of_order, 1);
        assert_eq!(r.buffered(), 0);
        assert_eq!(r.next_seq(), Some(s(11)));
    }

    #[test]
    fn overflow_declares_a_gap_and_skips_ahead() {
        let mut r = Reassembler::default();
        let mut st = StreamStats::default();
        let mut segs = vec![(99u32, true, ""), (100, false, "ab")];
        // Hole at 102..104; then 5 segments ahead exceed the 4-segment bound.
        for k in 0..5u32 {
            segs.push((104 + 2 * k, false, "cd"));
        }
        let out = run(&mut r, &segs, &mut st);
        assert_eq!(out, "ab[gap Some(2)]cdcdcdcdcd");
        assert_eq!(st.gaps, 1);
        assert_eq!(r.buffered(), 0);
        // The lost bytes arriving late are old news now.
        assert_eq!(run(&mut r, &[(102, false, "xx")], &mut st), "");
        assert_eq!(st.duplicates, 1);
    }

    #[test]
    fn pickup_without_syn_and_implausible_segments() {
        let mut r = Reassembler::default();
        let mut st = StreamStats::default();
        let out = run(
            &mut r,
            &[
                (5000, false, "mid"),
                (5000u32.wrapping_add(1 << 30), false, "zz"),
            ],
            &mut st,
        );
        assert_eq!(out, "[gap None]mid");
        assert_eq!(st.out_of_window, 1);
        assert_eq!(r.buffered(), 0);
    }

    #[test]
    fn bytes_bound_is_respected() {
        let mut r = Reassembler::default();
        let mut st = StreamStats::default();
        let big = "x".repeat(40);
        run(
            &mut r,
            &[(0, true, ""), (10, false, &big), (60, false, &big)],
            &mut st,
        );
        assert!(r.buffered() <= LIM.max_ooo_bytes);
        assert_eq!(st.gaps, 1);
    }
}
