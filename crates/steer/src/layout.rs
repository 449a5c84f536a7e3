//! The map layout shared with `bpf/steer.bpf.c`: value structs, constants, stat indexes and the
//! ring hash. Any change here or there must bump [`LAYOUT_VERSION`] in both files; the loader
//! refuses an object whose embedded `steer_layout_version` differs, and the program drops
//! (counted as `drop_layout`) every packet while the config map holds another version.
//!
//! | map          | type            | key             | value                     |
//! |--------------|-----------------|-----------------|---------------------------|
//! | `config`     | ARRAY[1]        | u32 0           | [`Config`]                |
//! | `ports`      | HASH[256]       | u32 ifindex     | [`PortInfo`]              |
//! | `exceptions` | HASH[65536]*    | FlowKey (38 B)  | u32 replica               |
//! | `conn`       | LRU_HASH[262144]*| FlowKey        | u32 replica               |
//! | `port_owner` | ARRAY[65536]    | u32 port        | u32 replica + 1 (0: none) |
//! | `nat_addrs`  | HASH[64]        | [u8; 16]        | u32 (1)                   |
//! | `ring`       | ARRAY[2*65537]  | u32 half*65537+slot | u32 replica (NO_REPLICA) |
//! | `ring_size`  | ARRAY[2]        | u32 half        | u32 slots (0: empty)      |
//! | `replicas`   | ARRAY[64]       | u32 replica     | [`ReplicaSlot`]           |
//! | `stats`      | PERCPU_ARRAY    | u32 [`Stat`]    | u64                       |
//! | `debug_key`  | ARRAY[1]        | u32 0           | FlowKey (tests only)      |
//!
//! `*` = size adjustable at load ([`crate::SteerOptions`]).

use pliant_state::FlowKey;

/// Version of the map layout; equal to `STEER_LAYOUT_VERSION` in `bpf/steer.bpf.c`.
pub const LAYOUT_VERSION: u32 = 3;
/// Replica indexes are `0..MAX_REPLICAS`.
pub const MAX_REPLICAS: u32 = 64;
/// Largest ring (slots per half).
pub const RING_MAX: u32 = 65537;
/// Ring slot value meaning "no replica" (packets hashed there are dropped and counted).
pub const NO_REPLICA: u32 = u32::MAX;

pub const ROLE_CLIENT: u32 = 1;
pub const ROLE_SERVER: u32 = 2;
pub const ROLE_REPLICA_IN: u32 = 3;
pub const ROLE_REPLICA_OUT: u32 = 4;

pub const REPLICA_LIVE: u32 = 1;
/// Replica slot flag: the replica is fenced (design invariant 7). Frames entering the fabric
/// from its ports are dropped (counted `drop_fenced`) and nothing is steered to it, so a
/// partitioned or revived old owner cannot emit output for flows that failed over elsewhere.
pub const REPLICA_FENCED: u32 = 2;
pub const CFG_DEBUG_KEY: u32 = 1;

/// `config` map value.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Config {
    pub layout_version: u32,
    pub flags: u32,
    pub client_ifindex: u32,
    pub server_ifindex: u32,
    /// 0 or 1: which half of the `ring` map is in use.
    pub ring_active: u32,
    pub pad: u32,
}

/// `ports` map value: what a fabric port is.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PortInfo {
    pub role: u32,
    pub replica: u32,
}

/// `replicas` map value.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReplicaSlot {
    pub in_ifindex: u32,
    pub out_ifindex: u32,
    pub flags: u32,
    pub pad: u32,
}

/// `FlowKey` as a map key (the orphan rule keeps us from implementing `aya::Pod` on it).
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KeyPod(pub FlowKey);

// SAFETY: all four are #[repr(C)] (or transparent over one) plain integers/byte arrays with no
// padding bytes and no invalid bit patterns.
unsafe impl aya::Pod for Config {}
unsafe impl aya::Pod for PortInfo {}
unsafe impl aya::Pod for ReplicaSlot {}
unsafe impl aya::Pod for KeyPod {}

/// Size of the key in bytes: the C side's `struct flow_key`.
pub const KEY_SIZE: usize = 38;
const _: () = assert!(std::mem::size_of::<FlowKey>() == KEY_SIZE);
const _: () = assert!(std::mem::align_of::<FlowKey>() == 2);
const _: () = assert!(std::mem::size_of::<Config>() == 24);
const _: () = assert!(std::mem::size_of::<ReplicaSlot>() == 16);

/// Counters in the `stats` map, by index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum Stat {
    RxOuter = 0,
    Exception,
    Conn,
    Port,
    Ring,
    NonIpCloned,
    CloneCopies,
    ReplicaOut,
    DropDead,
    DropNoRing,
    DropParse,
    ConnMiss,
    ConnInsertFail,
    ConnMissNonSyn,
    UnknownPort,
    DropLayout,
    DropBadReplica,
    IcmpInner,
    DropFenced,
    /// First fragments of IP datagrams (their choice recorded for the later fragments).
    FragFirst,
    /// Later fragments steered where their datagram's first fragment went.
    FragTracked,
    /// Later fragments whose first fragment was not seen (steered by the ports-less key).
    FragUntracked,
}

/// Number of counters (`ST_MAX` in C).
pub const STAT_COUNT: u32 = 22;

impl Stat {
    pub const ALL: [Stat; STAT_COUNT as usize] = [
        Stat::RxOuter,
        Stat::Exception,
        Stat::Conn,
        Stat::Port,
        Stat::Ring,
        Stat::NonIpCloned,
        Stat::CloneCopies,
        Stat::ReplicaOut,
        Stat::DropDead,
        Stat::DropNoRing,
        Stat::DropParse,
        Stat::ConnMiss,
        Stat::ConnInsertFail,
        Stat::ConnMissNonSyn,
        Stat::UnknownPort,
        Stat::DropLayout,
        Stat::DropBadReplica,
        Stat::IcmpInner,
        Stat::DropFenced,
        Stat::FragFirst,
        Stat::FragTracked,
        Stat::FragUntracked,
    ];

    /// Stable snake_case name (used in JSON output).
    pub fn name(self) -> &'static str {
        match self {
            Stat::RxOuter => "rx_outer",
            Stat::Exception => "exception",
            Stat::Conn => "conn",
            Stat::Port => "port",
            Stat::Ring => "ring",
            Stat::NonIpCloned => "nonip_cloned",
            Stat::CloneCopies => "clone_copies",
            Stat::ReplicaOut => "replica_out",
            Stat::DropDead => "drop_dead",
            Stat::DropNoRing => "drop_no_ring",
            Stat::DropParse => "drop_parse",
            Stat::ConnMiss => "conn_miss",
            Stat::ConnInsertFail => "conn_insert_fail",
            Stat::ConnMissNonSyn => "conn_miss_nonsyn",
            Stat::UnknownPort => "unknown_port",
            Stat::DropLayout => "drop_layout",
            Stat::DropBadReplica => "drop_bad_replica",
            Stat::IcmpInner => "icmp_inner",
            Stat::DropFenced => "drop_fenced",
            Stat::FragFirst => "frag_first",
            Stat::FragTracked => "frag_tracked",
            Stat::FragUntracked => "frag_untracked",
        }
    }
}

/// The key's bytes exactly as the BPF program sees them (little-endian ports: host order).
pub fn key_bytes(k: &FlowKey) -> [u8; KEY_SIZE] {
    let mut b = [0u8; KEY_SIZE];
    b[0] = k.family;
    b[1] = k.proto;
    b[2..4].copy_from_slice(&k.port_lo.to_ne_bytes());
    b[4..6].copy_from_slice(&k.port_hi.to_ne_bytes());
    b[6..22].copy_from_slice(&k.addr_lo);
    b[22..38].copy_from_slice(&k.addr_hi);
    b
}

/// Inverse of [`key_bytes`].
pub fn key_from_bytes(b: &[u8; KEY_SIZE]) -> FlowKey {
    let mut k = FlowKey {
        family: b[0],
        proto: b[1],
        port_lo: u16::from_ne_bytes([b[2], b[3]]),
        port_hi: u16::from_ne_bytes([b[4], b[5]]),
        ..FlowKey::default()
    };
    k.addr_lo.copy_from_slice(&b[6..22]);
    k.addr_hi.copy_from_slice(&b[22..38]);
    k
}

/// The hash the BPF program uses to pick a ring slot (`key_hash` in C): FNV-1a over the key
/// bytes, then the murmur3 finaliser.
pub fn ring_hash(k: &FlowKey) -> u32 {
    let mut h: u32 = 2_166_136_261;
    for b in key_bytes(k) {
        h ^= u32::from(b);
        h = h.wrapping_mul(16_777_619);
    }
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^= h >> 16;
    h
}

/// Ring slot of `k` in a ring of `size` slots.
pub fn ring_slot(k: &FlowKey, size: u32) -> u32 {
    if size == 0 {
        0
    } else {
        ring_hash(k) % size
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pliant_state::key::proto;
    use std::net::Ipv4Addr;

    #[test]
    fn key_bytes_round_trip_and_match_the_in_memory_layout() {
        let (k, _) = FlowKey::v4(
            proto::TCP,
            Ipv4Addr::new(10, 0, 0, 1),
            40000,
            Ipv4Addr::new(10, 0, 0, 2),
            80,
        );
        let b = key_bytes(&k);
        assert_eq!(key_from_bytes(&b), k);
        // SAFETY: FlowKey is repr(C), 38 bytes with no padding (asserted above).
        let raw: [u8; KEY_SIZE] = unsafe { std::mem::transmute(k) };
        assert_eq!(raw, b, "BPF reads the Rust struct's bytes directly");
    }

    #[test]
    fn stat_indexes_are_dense_and_named_uniquely() {
        for (i, s) in Stat::ALL.iter().enumerate() {
            assert_eq!(*s as usize, i);
        }
        let mut names: Vec<_> = Stat::ALL.iter().map(|s| s.name()).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), STAT_COUNT as usize);
    }

    #[test]
    fn ring_hash_is_deterministic_and_spreads() {
        let mut buckets = [0u32; 8];
        for p in 0..8000u16 {
            let (k, _) = FlowKey::v4(
                proto::UDP,
                Ipv4Addr::new(10, 0, 0, 1),
                p,
                Ipv4Addr::new(10, 0, 0, 2),
                53,
            );
            buckets[ring_slot(&k, 8) as usize] += 1;
        }
        assert!(buckets.iter().all(|&b| b > 800 && b < 1200), "{buckets:?}");
    }
}
