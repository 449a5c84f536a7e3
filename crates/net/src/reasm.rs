//! IPv4 reassembly with bounded memory and time (RFC 791 §3.2, RFC 815 style bookkeeping), so a
//! stateful NF (NAT) sees whole datagrams: the ports of a fragmented UDP/TCP datagram are only
//! in its first fragment. Like Linux conntrack's defragmentation: the router reassembles, the NF
//! translates the whole datagram, output fragments it again to the port MTU (`frag.rs`).
//!
//! Datagrams are keyed by (source, destination, protocol, identification). Bounds: at most
//! `max_datagrams` under reassembly and `max_bytes` of buffered payload (beyond either, the
//! oldest datagram is dropped: `evicted`), each completes within `timeout` or is dropped
//! (`timed_out`), and no datagram grows past 65535 bytes of IP packet (`too_big`). Fragments
//! that disagree about where the datagram ends are dropped with their datagram (`invalid`).
//! Overlaps are accepted, the later bytes win (IPv4 allows overlap; the datagram stays
//! consistent because the result is one buffer).

use crate::checksum::set_ipv4_header_checksum;
use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReasmLimits {
    pub max_datagrams: usize,
    pub max_bytes: usize,
    pub timeout: Duration,
}

impl Default for ReasmLimits {
    fn default() -> Self {
        // Linux: 30 s timeout, 4 MiB high threshold per netns.
        ReasmLimits {
            max_datagrams: 256,
            max_bytes: 4 << 20,
            timeout: Duration::from_secs(30),
        }
    }
}

/// Counters (cumulative).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReasmStats {
    pub fragments: u64,
    pub reassembled: u64,
    pub timed_out: u64,
    pub evicted: u64,
    pub too_big: u64,
    pub invalid: u64,
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
struct Key {
    src: Ipv4Addr,
    dst: Ipv4Addr,
    proto: u8,
    id: u16,
}

struct Partial {
    started: Instant,
    /// Link-layer + IP header of the first fragment (offset 0), once seen, and where its IP
    /// header starts.
    head: Option<(Vec<u8>, usize)>,
    data: Vec<u8>,
    /// Received byte ranges of `data`, unsorted (a datagram has few fragments).
    have: Vec<(usize, usize)>,
    /// Payload length, known from the fragment without MF.
    total: Option<usize>,
}

impl Partial {
    fn complete(&mut self) -> bool {
        let (Some(total), Some(_)) = (self.total, &self.head) else {
            return false;
        };
        self.have.sort_unstable();
        let mut reach = 0;
        for &(a, b) in &self.have {
            if a > reach {
                return false;
            }
            reach = reach.max(b);
        }
        reach >= total
    }
}

/// What one fragment led to.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Not a fragment: process the frame as it is.
    NotFragment,
    /// Kept; the datagram is not complete yet.
    Held,
    /// The last missing piece: the whole datagram as one frame (the first fragment's link
    /// and IP header, MF and offset cleared, total length and header checksum recomputed).
    Complete(Vec<u8>),
    /// Dropped (the label of the counter it went to).
    Dropped(&'static str),
}

pub struct Reassembler {
    limits: ReasmLimits,
    parts: HashMap<Key, Partial>,
    bytes: usize,
    pub stats: ReasmStats,
}

const MAX_IP_LEN: usize = 65535;

impl Reassembler {
    pub fn new(limits: ReasmLimits) -> Self {
        Reassembler {
            limits,
            parts: HashMap::new(),
            bytes: 0,
            stats: ReasmStats::default(),
        }
    }

    /// Datagrams under reassembly and their buffered bytes.
    pub fn pending(&self) -> (usize, usize) {
        (self.parts.len(), self.bytes)
    }

    /// Feeds one frame whose IPv4 header starts at `l3` (header already validated: version,
    /// IHL, total length, checksum).
    pub fn push(&mut self, frame: &[u8], l3: usize, now: Instant) -> Outcome {
        let Some(h) = frame.get(l3..l3 + 20) else {
            return Outcome::NotFragment;
        };
        if h[0] >> 4 != 4 {
            return Outcome::NotFragment;
        }
        let word = u16::from_be_bytes([h[6], h[7]]);
        let (more, off) = (word & 0x2000 != 0, usize::from(word & 0x1fff) * 8);
        if !more && off == 0 {
            return Outcome::NotFragment;
        }
        self.stats.fragments += 1;
        let hl = usize::from(h[0] & 0x0f) * 4;
        let tot = usize::from(u16::from_be_bytes([h[2], h[3]]));
        let Some(payload) = frame.get(l3 + hl..l3 + tot) else {
            return self.drop_frag("frag_invalid");
        };
        let key = Key {
            src: Ipv4Addr::new(h[12], h[13], h[14], h[15]),
            dst: Ipv4Addr::new(h[16], h[17], h[18], h[19]),
            proto: h[9],
            id: u16::from_be_bytes([h[4], h[5]]),
        };
        let end = off + payload.len();
        if hl + end > MAX_IP_LEN {
            self.forget(&key);
            self.stats.too_big += 1;
            return Outcome::Dropped("frag_too_big");
        }
        if (more && payload.len() % 8 != 0) || payload.is_empty() {
            return self.drop_frag("frag_invalid");
        }
        self.expire(now);
        if !self.parts.contains_key(&key) {
            while self.parts.len() >= self.limits.max_datagrams {
                self.evict_oldest();
            }
            self.parts.insert(
                key,
                Partial {
                    started: now,
                    head: None,
                    data: Vec::new(),
                    have: Vec::new(),
                    total: None,
                },
            );
        }
        let p = self.parts.get_mut(&key).expect("inserted above");
        let beyond_end = p.total.is_some_and(|t| end > t || (!more && end != t));
        let end_moved = !more && p.have.iter().any(|&(_, b)| b > end);
        if beyond_end || end_moved {
            self.forget(&key);
            self.stats.invalid += 1;
            return Outcome::Dropped("frag_invalid");
        }
        if !more {
            p.total = Some(end);
        }
        if off == 0 {
            p.head = Some((frame[..l3 + hl].to_vec(), l3));
        }
        let grown = end.saturating_sub(p.data.len());
        if p.data.len() < end {
            p.data.resize(end, 0);
        }
        p.data[off..end].copy_from_slice(payload);
        p.have.push((off, end));
        self.bytes += grown;
        if p.complete() {
            let p = self.parts.remove(&key).expect("present");
            self.bytes -= p.data.len();
            self.stats.reassembled += 1;
            return Outcome::Complete(assemble(p));
        }
        while self.bytes > self.limits.max_bytes && !self.parts.is_empty() {
            let was_ours = self.oldest() == Some(key);
            self.evict_oldest();
            if was_ours {
                return Outcome::Dropped("frag_evicted");
            }
        }
        Outcome::Held
    }

    /// Drops the datagrams older than the timeout; returns how many.
    pub fn expire(&mut self, now: Instant) -> u64 {
        let t = self.limits.timeout;
        let before = self.parts.len();
        let mut freed = 0;
        self.parts.retain(|_, p| {
            let keep = now.saturating_duration_since(p.started) < t;
            if !keep {
                freed += p.data.len();
            }
            keep
        });
        self.bytes -= freed;
        let n = (before - self.parts.len()) as u64;
        self.stats.timed_out += n;
        n
    }

    fn drop_frag(&mut self, reason: &'static str) -> Outcome {
        self.stats.invalid += 1;
        Outcome::Dropped(reason)
    }

    fn forget(&mut self, key: &Key) {
        if let Some(p) = self.parts.remove(key) {
            self.bytes -= p.data.len();
        }
    }

    fn oldest(&self) -> Option<Key> {
        self.parts
            .iter()
            .min_by_key(|(_, p)| p.started)
            .map(|(k, _)| *k)
    }

    fn evict_oldest(&mut self) {
        if let Some(k) = self.oldest() {
            self.forget(&k);
            self.stats.evicted += 1;
        }
    }
}

fn assemble(p: Partial) -> Vec<u8> {
    let (head, l3) = p.head.expect("complete datagrams have a head");
    let hl = head.len() - l3;
    let mut f = head;
    f.extend_from_slice(&p.data);
    let h = &mut f[l3..l3 + hl];
    h[2..4].copy_from_slice(&((hl + p.data.len()) as u16).to_be_bytes());
    // Keep DF, clear MF and the offset.
    h[6] &= 0x40;
    h[7] = 0;
    set_ipv4_header_checksum(h);
    f
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::build::{self, MAC_A, MAC_B};
    use crate::frag::fragment_v4;
    use crate::testutil::parsed;

    fn datagram(id: u16, len: usize) -> Vec<u8> {
        let payload: Vec<u8> = (0..len).map(|i| (i * 7 + usize::from(id)) as u8).collect();
        let mut f = build::udp(
            MAC_A,
            MAC_B,
            "10.0.0.1".parse().unwrap(),
            5000,
            "10.0.0.2".parse().unwrap(),
            7,
            &payload,
        );
        let l3 = 14;
        f[l3 + 4..l3 + 6].copy_from_slice(&id.to_be_bytes());
        f[l3 + 6] &= !0x40;
        set_ipv4_header_checksum(&mut f[l3..l3 + 20]);
        f
    }

    fn frags(f: &[u8], mtu: usize) -> Vec<Vec<u8>> {
        fragment_v4(f, &parsed(f), mtu).unwrap()
    }

    #[test]
    fn fragments_in_any_order_give_back_the_datagram() {
        let f = datagram(1, 2972);
        let now = Instant::now();
        for order in [[0usize, 1, 2], [2, 0, 1], [1, 2, 0]] {
            let fs = frags(&f, 1280);
            let mut r = Reassembler::new(ReasmLimits::default());
            let mut out = Vec::new();
            for i in order {
                out.push(r.push(&fs[i], 14, now));
            }
            assert_eq!(out[0], Outcome::Held);
            assert_eq!(out[1], Outcome::Held);
            assert_eq!(out[2], Outcome::Complete(f.clone()), "order {order:?}");
            assert_eq!(r.pending(), (0, 0));
            assert_eq!(r.stats.reassembled, 1);
            let p = parsed(&f);
            assert!(crate::ipv4_header_ok(&f, &p) && !p.fragment);
        }
    }

    #[test]
    fn whole_datagrams_pass_untouched() {
        let f = datagram(2, 100);
        let mut r = Reassembler::new(ReasmLimits::default());
        assert_eq!(r.push(&f, 14, Instant::now()), Outcome::NotFragment);
        assert_eq!(r.stats.fragments, 0);
    }

    #[test]
    fn an_incomplete_datagram_times_out() {
        let limits = ReasmLimits {
            timeout: Duration::from_secs(5),
            ..Default::default()
        };
        let mut r = Reassembler::new(limits);
        let t0 = Instant::now();
        let fs = frags(&datagram(3, 2972), 1280);
        assert_eq!(r.push(&fs[0], 14, t0), Outcome::Held);
        assert_eq!(r.expire(t0 + Duration::from_secs(4)), 0);
        assert_eq!(r.expire(t0 + Duration::from_secs(5)), 1);
        assert_eq!(r.pending(), (0, 0));
        // The rest arriving late starts over and never completes.
        assert_eq!(
            r.push(&fs[1], 14, t0 + Duration::from_secs(6)),
            Outcome::Held
        );
        assert_eq!(
            r.push(&fs[2], 14, t0 + Duration::from_secs(6)),
            Outcome::Held
        );
        assert_eq!(r.stats.timed_out, 1);
    }

    #[test]
    fn memory_is_bounded_by_datagrams_and_bytes() {
        let limits = ReasmLimits {
            max_datagrams: 4,
            max_bytes: 3000,
            timeout: Duration::from_secs(30),
        };
        let mut r = Reassembler::new(limits);
        let t0 = Instant::now();
        // First fragments only (never complete): a fragment flood.
        for id in 0..100u16 {
            let fs = frags(&datagram(id, 2972), 1280);
            let _ = r.push(&fs[0], 14, t0 + Duration::from_millis(u64::from(id)));
            let (n, b) = r.pending();
            assert!(n <= 4 && b <= 3000, "{n} datagrams, {b} bytes");
        }
        assert!(r.stats.evicted >= 96, "{:?}", r.stats);
        // A datagram arriving whole afterwards still completes.
        let f = datagram(500, 2000);
        let fs = frags(&f, 1280);
        assert_eq!(
            r.push(&fs[0], 14, t0 + Duration::from_secs(1)),
            Outcome::Held
        );
        assert_eq!(
            r.push(&fs[1], 14, t0 + Duration::from_secs(1)),
            Outcome::Complete(f)
        );
    }

    #[test]
    fn inconsistent_ends_and_oversize_are_dropped() {
        let t0 = Instant::now();
        let mut r = Reassembler::new(ReasmLimits::default());
        let a = frags(&datagram(7, 2972), 1280);
        let b = frags(&datagram(7, 1500), 1280);
        assert_eq!(r.push(&a[1], 14, t0), Outcome::Held);
        // b's last fragment says the datagram ends inside what a already sent.
        assert_eq!(r.push(&b[1], 14, t0), Outcome::Dropped("frag_invalid"));
        assert_eq!(r.pending(), (0, 0));
        // An offset that would make the IP packet exceed 65535 bytes.
        let mut big = a[2].clone();
        big[14 + 6..14 + 8].copy_from_slice(&0x1fffu16.to_be_bytes());
        assert_eq!(r.push(&big, 14, t0), Outcome::Dropped("frag_too_big"));
    }
}
