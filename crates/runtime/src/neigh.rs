//! Neighbour table of one port (the router role's ARP cache).
//!
//! Learned from ARP (requests and replies) and gleaned from IP frames whose source is in a
//! connected subnet. An unresolved next hop gets an entry in state `Incomplete` holding a
//! bounded queue of frames waiting for the answer; ARP requests for it are rate-limited.
//! Everything is bounded: entries (oldest evicted), frames per entry, requests per entry.
//!
//! IPv6 neighbours are only gleaned (no NDP yet): an IPv6 next hop is usable once a frame from
//! it has been seen; before that, IPv6 output to it is dropped as `neigh_v6_unknown`.

use pliant_net::Mac;
use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug)]
pub struct NeighLimits {
    pub max_entries: usize,
    /// Frames held per unresolved neighbour.
    pub max_queued: usize,
    /// A resolved entry not refreshed for this long is forgotten.
    pub reachable_for: Duration,
    /// Minimum gap between two ARP requests for the same neighbour.
    pub request_interval: Duration,
    /// Requests sent before an unresolved entry is given up (its queue dropped).
    pub max_requests: u32,
}

impl Default for NeighLimits {
    fn default() -> Self {
        NeighLimits {
            max_entries: 4096,
            max_queued: 64,
            reachable_for: Duration::from_secs(300),
            request_interval: Duration::from_millis(500),
            max_requests: 5,
        }
    }
}

#[derive(Debug)]
pub struct Entry<T> {
    pub mac: Option<Mac>,
    /// Last confirmation (resolved) or creation (incomplete).
    pub updated: Instant,
    pub last_request: Option<Instant>,
    pub requests: u32,
    /// Frames waiting for resolution (already routed: TTL done, only MACs missing).
    pub queue: VecDeque<T>,
}

/// What `resolve` decided for one frame.
#[derive(Debug, PartialEq, Eq)]
pub enum Resolve {
    /// Known: send with this destination MAC.
    Mac(Mac),
    /// Queued; send an ARP request now if `request` is true.
    Queued { request: bool },
    /// Not queued: the per-neighbour queue or the table is full (reason label).
    Dropped(&'static str),
}

#[derive(Default, Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct NeighStats {
    pub learned: u64,
    pub evicted: u64,
    pub expired: u64,
    pub requests_sent: u64,
    pub unresolved_dropped: u64,
    /// Part of `unresolved_dropped` not yet reported by [`NeighTable::take_dropped`].
    #[serde(skip)]
    pub unreported_drops: u64,
}

/// `T` is what waits for resolution: a frame (with its offload metadata in the engine).
pub struct NeighTable<T = Vec<u8>> {
    limits: NeighLimits,
    entries: HashMap<IpAddr, Entry<T>>,
    pub stats: NeighStats,
}

impl<T> NeighTable<T> {
    pub fn new(limits: NeighLimits) -> Self {
        NeighTable {
            limits,
            entries: HashMap::new(),
            stats: NeighStats::default(),
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn lookup(&self, ip: IpAddr) -> Option<Mac> {
        self.entries.get(&ip).and_then(|e| e.mac)
    }

    /// Records `ip` at `mac`; returns the frames that were waiting for it (to send now).
    pub fn learn(&mut self, ip: IpAddr, mac: Mac, now: Instant) -> VecDeque<T> {
        if let Some(e) = self.entries.get_mut(&ip) {
            if e.mac != Some(mac) {
                self.stats.learned += 1;
            }
            e.mac = Some(mac);
            e.updated = now;
            e.requests = 0;
            return std::mem::take(&mut e.queue);
        }
        self.make_room(now);
        self.stats.learned += 1;
        self.entries.insert(
            ip,
            Entry {
                mac: Some(mac),
                updated: now,
                last_request: None,
                requests: 0,
                queue: VecDeque::new(),
            },
        );
        VecDeque::new()
    }

    /// Only refreshes an entry that exists (gleaning must not let any sender fill the table,
    /// but keeping a known neighbour fresh is free).
    pub fn refresh(&mut self, ip: IpAddr, mac: Mac, now: Instant) -> Option<VecDeque<T>> {
        self.entries
            .contains_key(&ip)
            .then(|| self.learn(ip, mac, now))
    }

    /// Looks up the MAC of next hop `ip`, else queues `frame` (bounded) for when it resolves.
    pub fn resolve(&mut self, ip: IpAddr, frame: &mut Option<T>, now: Instant) -> Resolve {
        if let Some(e) = self.entries.get(&ip) {
            if let Some(mac) = e.mac {
                return Resolve::Mac(mac);
            }
        } else {
            if !self.make_room(now) {
                return Resolve::Dropped("neigh_table_full");
            }
            self.entries.insert(
                ip,
                Entry {
                    mac: None,
                    updated: now,
                    last_request: None,
                    requests: 0,
                    queue: VecDeque::new(),
                },
            );
        }
        let limits = self.limits;
        let Some(e) = self.entries.get_mut(&ip) else {
            return Resolve::Dropped("neigh_table_full");
        };
        if e.queue.len() >= limits.max_queued {
            return Resolve::Dropped("neigh_queue_full");
        }
        if let Some(f) = frame.take() {
            e.queue.push_back(f);
        }
        let due = e
            .last_request
            .is_none_or(|t| now.saturating_duration_since(t) >= limits.request_interval);
        let request = due && e.requests < limits.max_requests;
        if request {
            e.last_request = Some(now);
            e.requests += 1;
            self.stats.requests_sent += 1;
        }
        Resolve::Queued { request }
    }

    /// Makes room for one entry if the table is full: drops an expired entry or else the oldest.
    /// Returns false if nothing could be evicted.
    fn make_room(&mut self, now: Instant) -> bool {
        if self.entries.len() < self.limits.max_entries {
            return true;
        }
        self.age(now);
        if self.entries.len() < self.limits.max_entries {
            return true;
        }
        // O(n), only when the table is full of live entries (bounded n).
        let oldest = self
            .entries
            .iter()
            .min_by_key(|(_, e)| e.updated)
            .map(|(ip, _)| *ip);
        match oldest {
            Some(ip) => {
                if let Some(e) = self.entries.remove(&ip) {
                    self.stats.unresolved_dropped += e.queue.len() as u64;
                    self.stats.unreported_drops += e.queue.len() as u64;
                }
                self.stats.evicted += 1;
                true
            }
            None => false,
        }
    }

    /// Forgets stale resolved entries and gives up on unresolved ones that used all their
    /// requests. Returns how many queued frames were dropped (to count as drops).
    pub fn age(&mut self, now: Instant) -> u64 {
        let l = self.limits;
        let mut dropped = 0u64;
        let mut expired = 0u64;
        self.entries.retain(|_, e| {
            let keep = match e.mac {
                Some(_) => now.saturating_duration_since(e.updated) < l.reachable_for,
                None => {
                    e.requests < l.max_requests
                        || e.last_request
                            .is_none_or(|t| now.saturating_duration_since(t) < l.request_interval)
                }
            };
            if !keep {
                dropped += e.queue.len() as u64;
                expired += 1;
            }
            keep
        });
        self.stats.expired += expired;
        self.stats.unresolved_dropped += dropped;
        self.stats.unreported_drops += dropped;
        dropped
    }

    /// Drops every frame waiting for a resolution (entries stay) and returns how many.
    pub fn drop_queued(&mut self) -> u64 {
        let mut n = 0u64;
        for e in self.entries.values_mut() {
            n += e.queue.len() as u64;
            e.queue.clear();
        }
        n
    }

    /// Frames dropped (aged out or evicted while waiting) since the last call, for the
    /// engine's drop counters.
    pub fn take_dropped(&mut self) -> u64 {
        std::mem::take(&mut self.stats.unreported_drops)
    }

    /// Unresolved neighbours whose next request is due (for retries without new traffic).
    pub fn due_requests(&mut self, now: Instant, out: &mut Vec<IpAddr>) {
        let l = self.limits;
        for (ip, e) in self.entries.iter_mut() {
            if e.mac.is_none()
                && e.requests < l.max_requests
                && e.last_request
                    .is_none_or(|t| now.saturating_duration_since(t) >= l.request_interval)
            {
                e.last_request = Some(now);
                e.requests += 1;
                self.stats.requests_sent += 1;
                out.push(*ip);
            }
        }
    }

    /// `(ip, mac or None, queued frames)` for stats.
    pub fn snapshot(&self) -> Vec<(IpAddr, Option<Mac>, usize)> {
        let mut v: Vec<_> = self
            .entries
            .iter()
            .map(|(ip, e)| (*ip, e.mac, e.queue.len()))
            .collect();
        v.sort_by_key(|e| e.0);
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn queues_until_learned_then_releases_in_order() {
        let t0 = Instant::now();
        let mut n = NeighTable::new(NeighLimits::default());
        let mut f = Some(vec![1]);
        assert_eq!(
            n.resolve(ip("10.0.0.2"), &mut f, t0),
            Resolve::Queued { request: true }
        );
        let mut f = Some(vec![2]);
        // Rate limited: no second request at the same instant.
        assert_eq!(
            n.resolve(ip("10.0.0.2"), &mut f, t0),
            Resolve::Queued { request: false }
        );
        let q = n.learn(ip("10.0.0.2"), [1; 6], t0);
        assert_eq!(q.into_iter().collect::<Vec<_>>(), vec![vec![1], vec![2]]);
        assert_eq!(
            n.resolve(ip("10.0.0.2"), &mut Some(vec![3]), t0),
            Resolve::Mac([1; 6])
        );
    }

    #[test]
    fn bounds_are_counted() {
        let t0 = Instant::now();
        let limits = NeighLimits {
            max_entries: 2,
            max_queued: 1,
            ..NeighLimits::default()
        };
        let mut n = NeighTable::new(limits);
        assert!(matches!(
            n.resolve(ip("10.0.0.2"), &mut Some(vec![1]), t0),
            Resolve::Queued { .. }
        ));
        assert_eq!(
            n.resolve(ip("10.0.0.2"), &mut Some(vec![2]), t0),
            Resolve::Dropped("neigh_queue_full")
        );
        // Strictly newer than the incomplete entry, so the eviction victim is determined.
        n.learn(ip("10.0.0.3"), [3; 6], t0 + Duration::from_millis(1));
        n.learn(ip("10.0.0.4"), [4; 6], t0 + Duration::from_secs(1));
        assert_eq!(n.len(), 2);
        assert_eq!(n.stats.evicted, 1);
        assert_eq!(
            n.stats.unresolved_dropped, 1,
            "the evicted incomplete entry held one frame"
        );
    }

    #[test]
    fn entries_age_out_and_unresolved_give_up() {
        let t0 = Instant::now();
        let limits = NeighLimits {
            max_requests: 1,
            ..NeighLimits::default()
        };
        let mut n = NeighTable::new(limits);
        n.learn(ip("10.0.0.3"), [3; 6], t0);
        assert!(matches!(
            n.resolve(ip("10.0.0.9"), &mut Some(vec![1]), t0),
            Resolve::Queued { request: true }
        ));
        let dropped = n.age(t0 + Duration::from_secs(1));
        assert_eq!(dropped, 1);
        assert_eq!(n.lookup(ip("10.0.0.3")), Some([3; 6]));
        n.age(t0 + Duration::from_secs(301));
        assert!(n.is_empty());
    }
}
