// SPDX-License-Identifier: Apache-2.0
//
// pliant fabric steering: a tc (clsact ingress, direct-action) program for every port of the
// fabric namespace. Small and dumb on purpose: policy lives in the controller (crates/steer),
// this program only reads maps. The map layout is versioned (STEER_LAYOUT_VERSION); the Rust
// loader refuses an object whose version differs from its own, and the program drops (and
// counts) every packet if the controller wrote a config of another version.
//
// Per ingress port (map `ports`, keyed by ifindex):
//   ROLE_CLIENT / ROLE_SERVER (outer ports): IP packets are keyed by the direction-normalised
//     flow key (identical to pliant_state::FlowKey) and steered by, in order,
//       exceptions -> conn (learned pins) -> port_owner (NAT return) -> ring (consistent hash),
//     to the chosen replica's in-port (from the client side) or out-port (from the server side).
//     Non-IP frames (ARP, ...) are cloned to that port of every live replica.
//   ROLE_REPLICA_IN / ROLE_REPLICA_OUT: redirected to the client / server outer port, unless the
//     replica is fenced (REPLICA_FENCED: its flows were failed over): then dropped, counted.
//
// Built without libbpf headers (Debian's libbpf-dev is not needed): the few helper prototypes
// and the BTF map-definition macros are declared below.

#include <linux/types.h>
#include <linux/bpf.h>
#include <linux/pkt_cls.h>

#define SEC(name) __attribute__((section(name), used))
#undef __always_inline
#define __always_inline inline __attribute__((always_inline))
#define __uint(name, val) int (*name)[val]
#define __type(name, val) typeof(val) *name

static void *(*bpf_map_lookup_elem)(void *map, const void *key) = (void *)BPF_FUNC_map_lookup_elem;
static long (*bpf_map_update_elem)(void *map, const void *key, const void *value,
                                   __u64 flags) = (void *)BPF_FUNC_map_update_elem;
static long (*bpf_redirect)(__u32 ifindex, __u64 flags) = (void *)BPF_FUNC_redirect;
static long (*bpf_skb_pull_data)(struct __sk_buff *skb, __u32 len) = (void *)BPF_FUNC_skb_pull_data;
static long (*bpf_clone_redirect)(struct __sk_buff *skb, __u32 ifindex,
                                  __u64 flags) = (void *)BPF_FUNC_clone_redirect;

// ---- layout (keep in sync with crates/steer/src/layout.rs; bump the version on any change) ----
#define STEER_LAYOUT_VERSION 3

// Read by the Rust loader from the ELF symbol table before loading.
const volatile __u32 steer_layout_version SEC(".rodata") = STEER_LAYOUT_VERSION;

#define MAX_REPLICAS 64
#define RING_MAX 65537
#define NO_REPLICA 0xffffffffu

#define ROLE_CLIENT 1
#define ROLE_SERVER 2
#define ROLE_REPLICA_IN 3
#define ROLE_REPLICA_OUT 4

#define REPLICA_LIVE 1u
// Fencing (DESIGN invariant 7): a replica whose flows were failed over to others may still be
// running (partitioned, or revived): every frame it emits is dropped here, so it cannot act on
// ownership it no longer has. Set by the controller before it activates the standby copies.
#define REPLICA_FENCED 2u

#define CFG_DEBUG_KEY 1u

enum stat {
	ST_RX_OUTER = 0,
	ST_EXCEPTION,
	ST_CONN,
	ST_PORT,
	ST_RING,
	ST_NONIP_CLONED,
	ST_CLONE_COPIES,
	ST_REPLICA_OUT,
	ST_DROP_DEAD,
	ST_DROP_NO_RING,
	ST_DROP_PARSE,
	ST_CONN_MISS,
	ST_CONN_INSERT_FAIL,
	ST_CONN_MISS_NONSYN,
	ST_UNKNOWN_PORT,
	ST_DROP_LAYOUT,
	ST_DROP_BAD_REPLICA,
	ST_ICMP_INNER,
	ST_DROP_FENCED,
	ST_FRAG_FIRST,
	ST_FRAG_TRACKED,
	ST_FRAG_UNTRACKED,
	ST_MAX,
};

// Same bytes as Rust's #[repr(C)] pliant_state::FlowKey: 38 bytes, 2-byte aligned, ports in
// host byte order, IPv4 as IPv4-mapped IPv6.
struct flow_key {
	__u8 family;
	__u8 proto;
	__u16 port_lo;
	__u16 port_hi;
	__u8 addr_lo[16];
	__u8 addr_hi[16];
};

// One fragmented datagram: its (direction-normalised) addresses, protocol and IP id. The first
// fragment carries the ports and is steered like its flow; the later ones carry none, so they
// follow the first one's choice through `frags` (as conntrack tracks fragments by IP id) and
// every fragment reaches the one replica that reassembles the datagram.
struct frag_key {
	__u8 addr_lo[16];
	__u8 addr_hi[16];
	__u32 id;
	__u32 proto;
};

struct port_info {
	__u32 role;
	__u32 replica; // informational for replica ports
};

struct replica {
	__u32 in_ifindex;
	__u32 out_ifindex;
	__u32 flags;
	__u32 pad;
};

struct config {
	__u32 layout_version;
	__u32 flags;
	__u32 client_ifindex;
	__u32 server_ifindex;
	__u32 ring_active; // 0 or 1: which half of `ring` is in use
	__u32 pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct config);
} config SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 256);
	__type(key, __u32);
	__type(value, struct port_info);
} ports SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, struct flow_key);
	__type(value, __u32);
} exceptions SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 262144);
	__type(key, struct flow_key);
	__type(value, __u32);
} conn SEC(".maps");

// Fragmented datagrams in flight -> the replica their first fragment went to.
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, struct frag_key);
	__type(value, __u32);
} frags SEC(".maps");

// port -> replica + 1 (0 = no owner), so the zero-initialised array means "unassigned".
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 65536);
	__type(key, __u32);
	__type(value, __u32);
} port_owner SEC(".maps");

// NAT addresses (IPv4-mapped for IPv4) whose return traffic is steered by port_owner.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 64);
	__type(key, __u8[16]);
	__type(value, __u32);
} nat_addrs SEC(".maps");

// Two halves of RING_MAX slots; config.ring_active picks one so that a new table is written
// into the idle half and switched in with one config update.
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 2 * RING_MAX);
	__type(key, __u32);
	__type(value, __u32);
} ring SEC(".maps");

// Slot count of each half (0 = empty ring: steering by hash drops, counted).
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 2);
	__type(key, __u32);
	__type(value, __u32);
} ring_size SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_REPLICAS);
	__type(key, __u32);
	__type(value, struct replica);
} replicas SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, ST_MAX);
	__type(key, __u32);
	__type(value, __u64);
} stats SEC(".maps");

// Last computed key, written only when config.flags has CFG_DEBUG_KEY (tests).
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct flow_key);
} debug_key SEC(".maps");

static __always_inline void count_n(__u32 idx, __u64 n)
{
	__u64 *c = bpf_map_lookup_elem(&stats, &idx);
	if (c)
		*c += n;
}

static __always_inline void count(__u32 idx)
{
	count_n(idx, 1);
}

// ---- parsing ----

#define ETH_HLEN_ 14
#define ETH_P_IP_ 0x0800
#define ETH_P_IPV6_ 0x86DD
#define ETH_P_8021Q_ 0x8100
#define ETH_P_8021AD_ 0x88A8
#define IPPROTO_ICMP_ 1
#define IPPROTO_TCP_ 6
#define IPPROTO_UDP_ 17
#define IPPROTO_ICMPV6_ 58

#define PARSE_OK 0
#define PARSE_NONIP 1
#define PARSE_BAD 2

static __always_inline __u16 be16(const __u8 *p)
{
	return ((__u16)p[0] << 8) | p[1];
}

static __always_inline __u32 be32(const __u8 *p)
{
	return ((__u32)be16(p) << 16) | be16(p + 2);
}

// Fills the 4 port bytes (sport, dport) from the L4 header at `l4`, or leaves them 0.
// Returns PARSE_BAD if the header the key needs is truncated.
static __always_inline int l4_ports(void *l4, void *end, __u8 proto, int v4, __u16 *sport,
                                    __u16 *dport, int *syn)
{
	__u8 *p = l4;
	if (proto == IPPROTO_TCP_) {
		if ((void *)(p + 14) > end)
			return PARSE_BAD;
		*sport = be16(p);
		*dport = be16(p + 2);
		*syn = (p[13] & 0x02) != 0;
	} else if (proto == IPPROTO_UDP_) {
		if ((void *)(p + 4) > end)
			return PARSE_BAD;
		*sport = be16(p);
		*dport = be16(p + 2);
	} else if ((proto == IPPROTO_ICMP_ && v4) || (proto == IPPROTO_ICMPV6_ && !v4)) {
		if ((void *)(p + 1) > end)
			return PARSE_BAD;
		__u8 t = p[0];
		int echo = v4 ? (t == 8 || t == 0) : (t == 128 || t == 129);
		if (echo) {
			if ((void *)(p + 6) > end)
				return PARSE_BAD;
			*sport = be16(p + 4);
			*dport = *sport;
		}
	}
	return PARSE_OK;
}

// Lexicographic (addr bytes, then port) comparison: returns 1 if a > b. Compares two
// big-endian 64-bit words instead of 16 bytes to keep the verifier's path count small.
static __always_inline __u64 word_be(const __u8 *p)
{
	__u64 w;
	__builtin_memcpy(&w, p, 8);
	return __builtin_bswap64(w);
}

static __always_inline int endpoint_gt(const __u8 *a, __u16 ap, const __u8 *b, __u16 bp)
{
	__u64 a0 = word_be(a), b0 = word_be(b);
	__u64 a1 = word_be(a + 8), b1 = word_be(b + 8);
	if (a0 != b0)
		return a0 > b0;
	if (a1 != b1)
		return a1 > b1;
	return ap > bp;
}

// ICMP error types that embed the offending packet (pliant_net::icmp_error::is_error).
static __always_inline int icmp_is_error(__u8 t, int v4)
{
	if (v4)
		return t == 3 || t == 4 || t == 5 || t == 11 || t == 12;
	return t >= 1 && t <= 4;
}

// Replaces the tuple with that of the packet embedded in an ICMP error at `l4`, so the error
// reaches the replica owning the flow (keys are direction-normalised, so the embedded packet's
// key is the flow's key). Returns 0 (keep the outer tuple) if the embedded IP header is not all
// there, or if an embedded IPv6 header is followed by extension headers (rare; not walked).
// Missing embedded ports leave ports 0, as pliant_net does.
static __always_inline int icmp_inner(__u8 *l4, void *end, int v4, __u8 *src, __u8 *dst,
                                      __u8 *proto, __u16 *sport, __u16 *dport)
{
	__u8 *ip = l4 + 8;
	__u8 *il4;
	__u8 nh;
	int frag = 0;
	if (v4) {
		if ((void *)(ip + 20) > end)
			return 0;
		if ((ip[0] >> 4) != 4)
			return 0;
		__u32 ihl = (ip[0] & 0x0f) * 4;
		if (ihl < 20)
			return 0;
		il4 = ip + ihl;
		if ((void *)il4 > end)
			return 0;
		nh = ip[9];
		frag = (be16(ip + 6) & 0x1fff) != 0;
		__builtin_memcpy(src + 12, ip + 12, 4);
		__builtin_memcpy(dst + 12, ip + 16, 4);
	} else {
		if ((void *)(ip + 40) > end)
			return 0;
		if ((ip[0] >> 4) != 6)
			return 0;
		nh = ip[6];
		if (nh == 0 || nh == 43 || nh == 44 || nh == 60)
			return 0;
		__builtin_memcpy(src, ip + 8, 16);
		__builtin_memcpy(dst, ip + 24, 16);
		il4 = ip + 40;
	}
	*proto = nh;
	*sport = 0;
	*dport = 0;
	if (frag)
		return 1;
	// Errors carry only the first 8 bytes of the embedded L4 header: read ports (or the echo
	// id) only, never TCP flags.
	if (nh == IPPROTO_TCP_ || nh == IPPROTO_UDP_) {
		if ((void *)(il4 + 4) <= end) {
			*sport = be16(il4);
			*dport = be16(il4 + 2);
		}
	} else if ((nh == IPPROTO_ICMP_ && v4) || (nh == IPPROTO_ICMPV6_ && !v4)) {
		if ((void *)(il4 + 6) <= end) {
			__u8 t = il4[0];
			if (v4 ? (t == 8 || t == 0) : (t == 128 || t == 129)) {
				*sport = be16(il4 + 4);
				*dport = *sport;
			}
		}
	}
	return 1;
}

struct parsed {
	struct flow_key key;
	__u8 dst[16];
	__u16 dport;
	int syn;
	int icmp_inner;
	// IP fragments: the first one (offset 0, more fragments), a later one (offset > 0), and
	// the datagram's IP id.
	int frag_first;
	int frag_later;
	__u32 frag_id;
};

// Longest header stretch parse() reads: Ethernet + 2 VLAN tags + IPv6 + extension headers + an
// ICMP error's inner IPv6 header and ports, with room to spare.
#define PULL_LEN 192

static __always_inline int parse(struct __sk_buff *skb, struct parsed *out)
{
	// Frames built in user-space TX rings (trafgen, AF_PACKET senders) can arrive with only a
	// short linear part and the headers in a page fragment; direct access would then see a
	// truncated frame (counted as drop_parse). Pull the headers into the linear area first;
	// the pull invalidates packet pointers, so they are loaded after it.
	__u32 want = skb->len < PULL_LEN ? skb->len : PULL_LEN;
	if ((long)skb->data_end - (long)skb->data < (long)want)
		bpf_skb_pull_data(skb, want);
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	__u8 *p = data;
	if ((void *)(p + ETH_HLEN_) > end)
		return PARSE_BAD;
	__u16 et = be16(p + 12);
	__u32 off = ETH_HLEN_;
#pragma unroll
	for (int i = 0; i < 2; i++) {
		if (et != ETH_P_8021Q_ && et != ETH_P_8021AD_)
			break;
		if ((void *)(p + off + 4) > end)
			return PARSE_BAD;
		et = be16(p + off + 2);
		off += 4;
	}
	// A VLAN tag the kernel already stripped lives in skb->vlan_tci; the ethertype here is
	// then the inner one, which is what we want.
	__u8 src[16] = {}, dst[16] = {};
	__u8 proto;
	__u16 sport = 0, dport = 0;
	int v4;
	void *l4;
	int frag = 0;
	if (et == ETH_P_IP_) {
		__u8 *ip = p + off;
		if ((void *)(ip + 20) > end)
			return PARSE_BAD;
		if ((ip[0] >> 4) != 4)
			return PARSE_BAD;
		__u32 ihl = (ip[0] & 0x0f) * 4;
		if (ihl < 20)
			return PARSE_BAD;
		proto = ip[9];
		__u16 fo = be16(ip + 6) & 0x1fff;
		frag = fo != 0;
		out->frag_first = fo == 0 && (be16(ip + 6) & 0x2000);
		out->frag_id = be16(ip + 4);
		src[10] = 0xff;
		src[11] = 0xff;
		dst[10] = 0xff;
		dst[11] = 0xff;
		src[12] = ip[12];
		src[13] = ip[13];
		src[14] = ip[14];
		src[15] = ip[15];
		dst[12] = ip[16];
		dst[13] = ip[17];
		dst[14] = ip[18];
		dst[15] = ip[19];
		v4 = 1;
		l4 = ip + ihl;
	} else if (et == ETH_P_IPV6_) {
		__u8 *ip = p + off;
		if ((void *)(ip + 40) > end)
			return PARSE_BAD;
		if ((ip[0] >> 4) != 6)
			return PARSE_BAD;
		__builtin_memcpy(src, ip + 8, 16);
		__builtin_memcpy(dst, ip + 24, 16);
		__u8 nh = ip[6];
		__u8 *h = ip + 40;
		v4 = 0;
		// Extension headers pliant_net understands: hop-by-hop (0), routing (43),
		// fragment (44), destination options (60). Bounded to 4 like any sane packet.
#pragma unroll
		for (int i = 0; i < 4; i++) {
			if (nh != 0 && nh != 43 && nh != 44 && nh != 60)
				break;
			if ((void *)(h + 8) > end)
				return PARSE_BAD;
			if (nh == 44) {
				__u16 fo = be16(h + 2) >> 3;
				if (fo != 0)
					frag = 1;
				out->frag_first = fo == 0 && (be16(h + 2) & 1);
				out->frag_id = be32(h + 4);
				nh = h[0];
				h += 8;
			} else {
				__u8 next = h[0];
				__u32 len = ((__u32)h[1] + 1) * 8;
				nh = next;
				h += len;
			}
			if (frag)
				break;
		}
		proto = nh;
		l4 = h;
	} else {
		return PARSE_NONIP;
	}
	out->syn = 0;
	out->icmp_inner = 0;
	out->frag_later = frag;
	if (!frag) {
		if (l4_ports(l4, end, proto, v4, &sport, &dport, &out->syn) != PARSE_OK)
			return PARSE_BAD;
		__u8 *ic = l4;
		if (((proto == IPPROTO_ICMP_ && v4) || (proto == IPPROTO_ICMPV6_ && !v4)) &&
		    (void *)(ic + 1) <= end && icmp_is_error(ic[0], v4)) {
			if (icmp_inner(ic, end, v4, src, dst, &proto, &sport, &dport)) {
				// The error travels back to the embedded packet's sender: that endpoint
				// (e.g. the NAT address and its port) is the "destination" for port steering.
				out->icmp_inner = 1;
				__builtin_memcpy(out->dst, src, 16);
				out->dport = sport;
			}
		}
	}
	out->key.family = v4 ? 4 : 6;
	out->key.proto = proto;
	if (endpoint_gt(src, sport, dst, dport)) {
		out->key.port_lo = dport;
		out->key.port_hi = sport;
		__builtin_memcpy(out->key.addr_lo, dst, 16);
		__builtin_memcpy(out->key.addr_hi, src, 16);
	} else {
		out->key.port_lo = sport;
		out->key.port_hi = dport;
		__builtin_memcpy(out->key.addr_lo, src, 16);
		__builtin_memcpy(out->key.addr_hi, dst, 16);
	}
	if (!out->icmp_inner) {
		__builtin_memcpy(out->dst, dst, 16);
		out->dport = dport;
	}
	return PARSE_OK;
}

// FNV-1a over the 38 key bytes, then the murmur3 finaliser for avalanche. Mirrored exactly by
// `layout::ring_hash` in Rust so the controller can predict the default owner of a flow.
static __always_inline __u32 key_hash(const struct flow_key *k)
{
	const __u8 *b = (const __u8 *)k;
	__u32 h = 2166136261u;
#pragma unroll
	for (int i = 0; i < (int)sizeof(struct flow_key); i++) {
		h ^= b[i];
		h *= 16777619u;
	}
	h ^= h >> 16;
	h *= 0x85ebca6bu;
	h ^= h >> 13;
	h *= 0xc2b2ae35u;
	h ^= h >> 16;
	return h;
}

static __always_inline struct replica *live_replica(__u32 idx)
{
	if (idx >= MAX_REPLICAS) {
		count(ST_DROP_BAD_REPLICA);
		return 0;
	}
	struct replica *r = bpf_map_lookup_elem(&replicas, &idx);
	if (!r || !(r->flags & REPLICA_LIVE) || r->in_ifindex == 0 || r->out_ifindex == 0) {
		count(ST_DROP_DEAD);
		return 0;
	}
	if (r->flags & REPLICA_FENCED) {
		count(ST_DROP_FENCED);
		return 0;
	}
	return r;
}

static __always_inline int forward(struct replica *r, __u32 role)
{
	return bpf_redirect(role == ROLE_CLIENT ? r->in_ifindex : r->out_ifindex, 0);
}

// Non-IP frames (ARP above all): every replica shares the addresses, so each must see the
// neighbour traffic; duplicate answers are harmless.
static __always_inline int clone_to_all(struct __sk_buff *skb, __u32 role)
{
	count(ST_NONIP_CLONED);
	for (__u32 i = 0; i < MAX_REPLICAS; i++) {
		__u32 idx = i;
		struct replica *r = bpf_map_lookup_elem(&replicas, &idx);
		if (!r || !(r->flags & REPLICA_LIVE) || (r->flags & REPLICA_FENCED))
			continue;
		__u32 ifi = role == ROLE_CLIENT ? r->in_ifindex : r->out_ifindex;
		if (ifi != 0 && bpf_clone_redirect(skb, ifi, 0) == 0)
			count(ST_CLONE_COPIES);
	}
	return TC_ACT_SHOT;
}

// The replica a frame goes to by the steering tables (exception, connection pin, NAT port
// owner, ring), or NO_REPLICA when it must be dropped (counted).
static __always_inline __u32 choose(struct parsed *pk, struct config *cfg, __u32 role)
{
	__u32 *owner = bpf_map_lookup_elem(&exceptions, &pk->key);
	if (owner) {
		count(ST_EXCEPTION);
		return *owner;
	}
	owner = bpf_map_lookup_elem(&conn, &pk->key);
	if (owner) {
		count(ST_CONN);
		return *owner;
	}
	count(ST_CONN_MISS);
	if (pk->key.proto == IPPROTO_TCP_ && !pk->syn)
		count(ST_CONN_MISS_NONSYN);

	int pin = 1;
	if (role == ROLE_SERVER && bpf_map_lookup_elem(&nat_addrs, pk->dst)) {
		__u32 port = pk->dport;
		__u32 *po = bpf_map_lookup_elem(&port_owner, &port);
		if (po && *po != 0) {
			count(ST_PORT);
			return *po - 1;
		}
		// Unowned port: nobody allocated it; fall through to the ring (which is as good a
		// place as any to reject it), without a pin: the block may be given to a replica
		// later (a reused index), and that replica's connections with this port and peer
		// must reach it by port_owner, not follow a pin a stray packet left (a late
		// retransmission to a retired replica's port).
		pin = 0;
	}

	__u32 half = cfg->ring_active & 1;
	__u32 *size = bpf_map_lookup_elem(&ring_size, &half);
	if (!size || *size == 0 || *size > RING_MAX) {
		count(ST_DROP_NO_RING);
		return NO_REPLICA;
	}
	__u32 slot = half * RING_MAX + key_hash(&pk->key) % *size;
	__u32 *ro = bpf_map_lookup_elem(&ring, &slot);
	if (!ro || *ro == NO_REPLICA) {
		count(ST_DROP_NO_RING);
		return NO_REPLICA;
	}
	__u32 idx = *ro;
	if (!live_replica(idx))
		return NO_REPLICA;
	// Pin the flow so later ring changes cannot re-home it (Katran-style connection table).
	if (pin && bpf_map_update_elem(&conn, &pk->key, &idx, BPF_NOEXIST) != 0)
		count(ST_CONN_INSERT_FAIL);
	count(ST_RING);
	return idx;
}

static __always_inline int steer_outer(struct __sk_buff *skb, struct config *cfg, __u32 role)
{
	struct parsed pk = {};
	int rc = parse(skb, &pk);
	if (rc == PARSE_NONIP)
		return clone_to_all(skb, role);
	if (rc != PARSE_OK) {
		count(ST_DROP_PARSE);
		return TC_ACT_SHOT;
	}
	if (pk.icmp_inner)
		count(ST_ICMP_INNER);
	if (cfg->flags & CFG_DEBUG_KEY) {
		__u32 z = 0;
		bpf_map_update_elem(&debug_key, &z, &pk.key, BPF_ANY);
	}

	struct frag_key fk = {};
	__u32 idx = NO_REPLICA;
	if (pk.frag_first || pk.frag_later) {
		__builtin_memcpy(fk.addr_lo, pk.key.addr_lo, 16);
		__builtin_memcpy(fk.addr_hi, pk.key.addr_hi, 16);
		fk.id = pk.frag_id;
		fk.proto = pk.key.proto;
	}
	if (pk.frag_later) {
		__u32 *first = bpf_map_lookup_elem(&frags, &fk);
		if (first) {
			count(ST_FRAG_TRACKED);
			idx = *first;
		} else {
			// Its first fragment was not seen (lost, late, or before a fabric restart): the
			// ports-less key decides, and the replica's reassembly times the datagram out.
			count(ST_FRAG_UNTRACKED);
		}
	}
	if (idx == NO_REPLICA)
		idx = choose(&pk, cfg, role);
	if (idx == NO_REPLICA)
		return TC_ACT_SHOT;
	struct replica *r = live_replica(idx);
	if (!r)
		return TC_ACT_SHOT;
	if (pk.frag_first) {
		count(ST_FRAG_FIRST);
		bpf_map_update_elem(&frags, &fk, &idx, BPF_ANY);
	}
	return forward(r, role);
}

// A fenced replica's output (frames entering the fabric from its ports) is dropped.
static __always_inline int fenced(__u32 idx)
{
	if (idx >= MAX_REPLICAS)
		return 0;
	struct replica *r = bpf_map_lookup_elem(&replicas, &idx);
	return r && (r->flags & REPLICA_FENCED);
}

SEC("classifier")
int pliant_steer(struct __sk_buff *skb)
{
	__u32 z = 0;
	struct config *cfg = bpf_map_lookup_elem(&config, &z);
	if (!cfg || cfg->layout_version != STEER_LAYOUT_VERSION) {
		count(ST_DROP_LAYOUT);
		return TC_ACT_SHOT;
	}
	__u32 ifi = skb->ingress_ifindex;
	struct port_info *pi = bpf_map_lookup_elem(&ports, &ifi);
	if (!pi) {
		count(ST_UNKNOWN_PORT);
		return TC_ACT_OK;
	}
	switch (pi->role) {
	case ROLE_CLIENT:
	case ROLE_SERVER:
		count(ST_RX_OUTER);
		return steer_outer(skb, cfg, pi->role);
	case ROLE_REPLICA_IN:
	case ROLE_REPLICA_OUT:
		if (fenced(pi->replica)) {
			count(ST_DROP_FENCED);
			return TC_ACT_SHOT;
		}
		count(ST_REPLICA_OUT);
		if (pi->role == ROLE_REPLICA_IN)
			return cfg->client_ifindex ? bpf_redirect(cfg->client_ifindex, 0) : TC_ACT_SHOT;
		return cfg->server_ifindex ? bpf_redirect(cfg->server_ifindex, 0) : TC_ACT_SHOT;
	default:
		count(ST_UNKNOWN_PORT);
		return TC_ACT_OK;
	}
}

char _license[] SEC("license") = "GPL";
