//! Abuse defences of the NAT (`Nat`): which mapping gives way when a pool runs dry, and how
//! many mappings one inside host holds.
//!
//! - Evictable mappings ([`Mapping::evictable`]: no confirmed two-way traffic) are queued per
//!   protocol in creation order. When a pool is empty the oldest one still evictable is
//!   removed and its port reused, so a SYN flood from one host churns through its own
//!   unanswered mappings instead of refusing everybody else's new flows (conntrack's early
//!   drop of unassured entries). Entries are checked lazily when popped (a mapping that got
//!   established or ended meanwhile is skipped), and the queue is compacted when it grows past
//!   twice the live mappings, so it is bounded by the flow table.
//! - Per-inside-host mapping counts for `max_mappings_per_host`, kept on create/expire/evict/
//!   import. Flows that leave the table without the NF seeing it (exported by a migration)
//!   make the sum disagree with the table's size; the counts are then rebuilt from the table
//!   (O(mappings), only after such a change).
//!
//! The FTMB NAT (`ftmb`) shares [`HostCounts`] and the eviction rule (`Mapping::evictable`)
//! but not the queue: its victim order must follow from the snapshot records alone.
//!
//! Both are soft state derived from the mappings (the replicated and migrated state): a
//! replica that imports mappings (migration, HA activation) rebuilds them in `on_import`.

use crate::Mapping;
use pliant_net::{proto, FlowKey};
use pliant_runtime::Ctx;
use std::collections::{HashMap, VecDeque};
use std::net::Ipv4Addr;

/// Live mappings per inside host, for `max_mappings_per_host`: the normal NAT keeps one per
/// replica (in [`Guard`]), each FTMB worker one for its own mappings.
#[derive(Debug, Default)]
pub(crate) struct HostCounts {
    map: HashMap<Ipv4Addr, u32>,
    /// Sum of the counts.
    total: usize,
}

impl HostCounts {
    pub fn add(&mut self, host: Ipv4Addr) {
        *self.map.entry(host).or_insert(0) += 1;
        self.total += 1;
    }

    pub fn remove(&mut self, host: Ipv4Addr) {
        if let Some(n) = self.map.get_mut(&host) {
            *n -= 1;
            self.total -= 1;
            if *n == 0 {
                self.map.remove(&host);
            }
        }
    }

    pub fn get(&self, host: Ipv4Addr) -> u32 {
        self.map.get(&host).copied().unwrap_or(0)
    }

    /// Sum of the counts.
    pub fn total(&self) -> usize {
        self.total
    }

    /// Hosts with at least one mapping.
    pub fn hosts(&self) -> usize {
        self.map.len()
    }

    pub fn clear(&mut self) {
        self.map.clear();
        self.total = 0;
    }

    /// The `n` hosts with the most mappings (ties by address), for queries.
    pub fn top(&self, n: usize) -> Vec<serde_json::Value> {
        let mut top: Vec<(&Ipv4Addr, &u32)> = self.map.iter().collect();
        top.sort_unstable_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
        top.into_iter()
            .take(n)
            .map(|(h, n)| serde_json::json!({"host": h.to_string(), "mappings": n}))
            .collect()
    }
}

#[derive(Debug, Default)]
pub(crate) struct Guard {
    /// Evictable candidates (primary keys), oldest first: TCP, UDP, ICMP.
    queues: [VecDeque<FlowKey>; 3],
    /// Its total is compared with the table's size to notice flows that left unseen.
    hosts: HostCounts,
    /// Times the host counts were rebuilt from the table.
    rebuilds: u64,
}

pub(crate) fn qi(p: u8) -> usize {
    match p {
        proto::TCP => 0,
        proto::UDP => 1,
        _ => 2,
    }
}

impl Guard {
    /// A mapping with primary `key` of protocol `p` for inside `host` was created or imported.
    pub fn created(&mut self, ctx: &Ctx<Mapping>, key: FlowKey, p: u8, host: Ipv4Addr) {
        self.hosts.add(host);
        if !ctx.flows.peek(&key).is_some_and(Mapping::evictable) {
            return;
        }
        let live = ctx.flows.len();
        let q = &mut self.queues[qi(p)];
        q.push_back(key);
        if q.len() > 2 * live + 64 {
            q.retain(|k| ctx.flows.peek(k).is_some_and(Mapping::evictable));
        }
    }

    /// A mapping of inside `host` was removed by the NF (expired or evicted).
    pub fn ended(&mut self, host: Ipv4Addr) {
        self.hosts.remove(host);
    }

    /// The oldest queued mapping of protocol `p` that is still evictable (removed from the
    /// queue), or None.
    pub fn pop_evictable(&mut self, ctx: &Ctx<Mapping>, p: u8) -> Option<FlowKey> {
        let q = &mut self.queues[qi(p)];
        while let Some(k) = q.pop_front() {
            if ctx
                .flows
                .peek(&k)
                .is_some_and(|m| m.proto == p && m.evictable())
            {
                return Some(k);
            }
        }
        None
    }

    /// Live mappings of inside `host` (counts rebuilt first if flows left the table unseen).
    pub fn host_count(&mut self, ctx: &Ctx<Mapping>, host: Ipv4Addr) -> u32 {
        if self.hosts.total() != ctx.flows.len() {
            self.rebuild(ctx);
        }
        self.hosts.get(host)
    }

    fn rebuild(&mut self, ctx: &Ctx<Mapping>) {
        self.hosts.clear();
        for k in ctx.flows.keys() {
            if let Some(m) = ctx.flows.peek(&k) {
                self.hosts.add(m.inside_addr);
            }
        }
        self.rebuilds += 1;
    }

    /// The `abuse` part of `pliant query`.
    pub fn query(&self, ctx: &Ctx<Mapping>, cfg: &crate::Config) -> serde_json::Value {
        serde_json::json!({
            "evicted_embryonic": ctx.nf_counters().get("nat_evicted_embryonic"),
            "host_quota_refused": ctx.drops().get("nat_host_quota"),
            "port_exhausted": ctx.drops().get("nat_port_exhausted"),
            "evictable_queued": self.queues.iter().map(VecDeque::len).sum::<usize>(),
            "tcp_embryonic_timeout_s": cfg.tcp_embryonic_timeout_s,
            "max_mappings_per_host": cfg.max_mappings_per_host,
            "hosts": self.hosts.hosts(),
            "host_counts_rebuilt": self.rebuilds,
            "top_hosts": self.hosts.top(5),
        })
    }
}
