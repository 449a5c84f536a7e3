// SPDX-License-Identifier: Apache-2.0
//
// pliant slice: the queueing packet hold (crates/slice/src/hold/queue.rs). A tc program on the
// clsact ingress of loopback and of the namespace's other interfaces. A TCP segment whose 4-tuple (client -> instance) is in `held` is
// redirected to the egress of the instance's hold veth, where the instance's packet socket
// reads it (taps run before the device transmits) and keeps it until the move is over; then
// the instance writes it back through a raw IP socket, marked `reinject_mark`, which this
// program lets through. Everything else goes on to the next filter (TC_ACT_UNSPEC), so the holds of several
// instances on one interface do not hide each other's segments.
//
// Bounded per held 4-tuple (config max_packets / max_bytes): beyond the bound the segment is
// dropped and counted (`over` in its entry), and the client retransmits it as it would have
// with the dropping hold.
//
// Built without libbpf headers, like bpf/steer.bpf.c.

#include <linux/types.h>
#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include <linux/if_ether.h>

#define SEC(name) __attribute__((section(name), used))
#define __uint(name, val) int (*name)[val]
#define __type(name, val) typeof(val) *name

static void *(*bpf_map_lookup_elem)(void *map, const void *key) = (void *)BPF_FUNC_map_lookup_elem;
static long (*bpf_redirect)(__u32 ifindex, __u64 flags) = (void *)BPF_FUNC_redirect;
static long (*bpf_skb_load_bytes)(const struct __sk_buff *skb, __u32 offset, void *to,
                                  __u32 len) = (void *)BPF_FUNC_skb_load_bytes;
static struct bpf_sock *(*bpf_skc_lookup_tcp)(void *ctx, struct bpf_sock_tuple *tuple,
                                              __u32 tuple_size, __u64 netns, __u64 flags) =
	(void *)BPF_FUNC_skc_lookup_tcp;
static long (*bpf_sk_release)(void *sock) = (void *)BPF_FUNC_sk_release;
static long (*bpf_clone_redirect)(struct __sk_buff *skb, __u32 ifindex, __u64 flags) =
	(void *)BPF_FUNC_clone_redirect;

// ---- layout (keep in sync with crates/slice/src/hold/queue.rs) ----
#define HOLD_LAYOUT_VERSION 2
const volatile __u32 hold_layout_version SEC(".rodata") = HOLD_LAYOUT_VERSION;

// Client -> instance, addresses as 16 bytes (IPv4 in the first 4, the rest zero), ports in
// network order.
struct hold_key {
	__u8 saddr[16];
	__u8 daddr[16];
	__u16 sport;
	__u16 dport;
	__u8 family; // 4 or 6
	__u8 pad[3];
};

struct hold_val {
	__u32 packets; // redirected to the queue
	__u32 bytes;
	__u32 over;    // dropped beyond the bound
	__u32 pad;
};

struct hold_config {
	__u32 queue_ifindex;
	__u32 max_packets;
	__u32 max_bytes;
	__u32 reinject_mark;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, struct hold_key);
	__type(value, struct hold_val);
} held SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct hold_config);
} config SEC(".maps");

// Output commit of replicated sessions (crates/slice/src/replicate.rs): a server -> client
// 4-tuple in `commit` is a session whose output may leave only once the backup holds what it
// depends on. A segment passes when every byte it carries is below `covered_seq` (the backup
// holds that output and can send it again), what it acknowledges is below `covered_ack` (the
// backup holds that input, in the application's state), and no earlier segment of the
// connection is still queued (order); otherwise it is queued like a held segment and written
// back by the backup once a checkpoint covers it. A RST never leaves: the one a dying primary's
// kernel sends for a protected session must not reach the client, which the backup's restored
// socket carries on with.
struct commit_val { // written by the backup only
	__u32 covered_seq;
	__u32 covered_ack;
	__u32 released; // frames of the connection written back so far
	__u32 flags;    // COMMIT_GUARDED: nothing covered yet (a session being set up)
};

#define COMMIT_GUARDED 1

struct commit_cnt { // written by this program only
	__u32 queued;   // frames diverted to the queue
	__u32 passed;   // frames let through at once
	__u32 resets;   // RSTs dropped
	__u32 over;     // dropped beyond the bound (the server's kernel retransmits them)
	// The audit: the highest data end and acknowledgment let through at once (the backup
	// compares them with what it held when the primary died). Not atomic: a lost race
	// can only make them lower.
	__u32 left_end;
	__u32 left_ack;
	__u32 left_flags; // 1: left_end is set, 2: left_ack is set
	__u32 orphans;    // client segments queued while no socket owned the connection
	__u32 mirrored;   // client segments copied to the backup's queue
	__u32 pad[3];
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, struct hold_key);
	__type(value, struct commit_val);
} commit SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, struct hold_key);
	__type(value, struct commit_cnt);
} commit_cnt SEC(".maps");

#define IPPROTO_TCP_ 6
#define TCP_FIN_ 0x01
#define TCP_RST_ 0x04
#define TCP_ACK_ 0x10

static __always_inline __u32 be32(const __u8 *b)
{
	return ((__u32)b[0] << 24) | ((__u32)b[1] << 16) | ((__u32)b[2] << 8) | b[3];
}

// The output-commit decision for a protected server -> client segment (see above). `iplen` is
// the IP packet's length (header included), `l4` the TCP header's offset in it, both in
// `lens` (iplen << 8 | l4: BPF functions take five arguments).
static __always_inline int commit_output(struct __sk_buff *skb, struct hold_config *cfg,
					 struct commit_val *c, struct commit_cnt *n, __u32 lens)
{
	__u32 l4 = lens & 0xff, iplen = lens >> 8;
	__u8 th[14];
	if (bpf_skb_load_bytes(skb, ETH_HLEN + (l4 & 0x7f), th, sizeof(th)) < 0)
		return TC_ACT_SHOT;
	__u8 flags = th[13];
	if (flags & TCP_RST_) {
		__sync_fetch_and_add(&n->resets, 1);
		return TC_ACT_SHOT;
	}
	__u32 seq = be32(&th[4]);
	__u32 ack = be32(&th[8]);
	__u32 hdrs = (l4 & 0x7f) + (th[12] >> 4) * 4;
	__u32 payload = iplen > hdrs ? iplen - hdrs : 0;
	__u32 end = seq + payload;
	int covered = !(c->flags & COMMIT_GUARDED) && (__s32)(c->covered_seq - end) >= 0 &&
		      (!(flags & TCP_ACK_) || (__s32)(c->covered_ack - ack) >= 0);
	if (covered && n->queued == c->released) {
		__sync_fetch_and_add(&n->passed, 1);
		if (!(n->left_flags & 1) || (__s32)(end - n->left_end) > 0)
			n->left_end = end;
		if ((flags & TCP_ACK_) && (!(n->left_flags & 2) || (__s32)(ack - n->left_ack) > 0))
			n->left_ack = ack;
		n->left_flags |= 1 | ((flags & TCP_ACK_) ? 2 : 0);
		return TC_ACT_UNSPEC;
	}
	if (n->queued - c->released >= cfg->max_packets) {
		__sync_fetch_and_add(&n->over, 1);
		return TC_ACT_SHOT;
	}
	__sync_fetch_and_add(&n->queued, 1);
	return bpf_redirect(cfg->queue_ifindex, 0);
}

#define TCP_LISTEN_ 10

// A client's segment of a protected connection. A copy goes to the backup's queue (it keeps
// the input its checkpoints do not cover yet, and writes it to the restored socket if the
// primary dies: the client then has nothing to retransmit, which could cost it a
// retransmission timeout). One that no socket owns is queued instead of left to the stack,
// which would answer it with a RST (dropped, above) and lose it: the primary died and the
// backup has not restored the connection yet. `k` is client -> instance.
static __always_inline int protected_input(struct __sk_buff *skb, struct hold_config *cfg,
					   struct hold_key *k, __u32 lens)
{
	struct hold_key r = {};
	__builtin_memcpy(r.saddr, k->daddr, 16);
	__builtin_memcpy(r.daddr, k->saddr, 16);
	r.sport = k->dport;
	r.dport = k->sport;
	r.family = k->family;
	struct commit_cnt *n = bpf_map_lookup_elem(&commit_cnt, &r);
	if (!n)
		return TC_ACT_UNSPEC;
	struct bpf_sock_tuple t = {};
	struct bpf_sock *sk;
	if (k->family == 4) {
		__builtin_memcpy(&t.ipv4.saddr, k->saddr, 4);
		__builtin_memcpy(&t.ipv4.daddr, k->daddr, 4);
		t.ipv4.sport = k->sport;
		t.ipv4.dport = k->dport;
		sk = bpf_skc_lookup_tcp(skb, &t, sizeof(t.ipv4), BPF_F_CURRENT_NETNS, 0);
	} else {
		__builtin_memcpy(t.ipv6.saddr, k->saddr, 16);
		__builtin_memcpy(t.ipv6.daddr, k->daddr, 16);
		t.ipv6.sport = k->sport;
		t.ipv6.dport = k->dport;
		sk = bpf_skc_lookup_tcp(skb, &t, sizeof(t.ipv6), BPF_F_CURRENT_NETNS, 0);
	}
	if (sk) {
		__u32 state = sk->state;
		bpf_sk_release(sk);
		if (state != TCP_LISTEN_) {
			// Only what carries input: data, or the client's FIN.
			__u32 l4 = lens & 0xff, iplen = lens >> 8;
			__u8 th[2];
			if (bpf_skb_load_bytes(skb, ETH_HLEN + (l4 & 0x7f) + 12, th, 2) < 0)
				return TC_ACT_UNSPEC;
			__u32 hdrs = (l4 & 0x7f) + (th[0] >> 4) * 4;
			if (iplen > hdrs || (th[1] & TCP_FIN_)) {
				__sync_fetch_and_add(&n->mirrored, 1);
				bpf_clone_redirect(skb, cfg->queue_ifindex, 0);
			}
			return TC_ACT_UNSPEC;
		}
	}
	__sync_fetch_and_add(&n->orphans, 1);
	return bpf_redirect(cfg->queue_ifindex, 0);
}

SEC("classifier")
int pliant_slice_hold(struct __sk_buff *skb)
{
	__u32 zero = 0;
	struct hold_config *cfg = bpf_map_lookup_elem(&config, &zero);
	if (!cfg || cfg->queue_ifindex == 0)
		return TC_ACT_UNSPEC;
	if (skb->mark == cfg->reinject_mark)
		return TC_ACT_UNSPEC;

	// At tc ingress the program sees the frame from its Ethernet header (loopback has one).
	struct hold_key k = {};
	__u32 l4, iplen;
	if (skb->protocol == __builtin_bswap16(ETH_P_IP)) {
		__u8 ip[20];
		if (bpf_skb_load_bytes(skb, ETH_HLEN, ip, sizeof(ip)) < 0)
			return TC_ACT_UNSPEC;
		if ((ip[0] >> 4) != 4 || ip[9] != IPPROTO_TCP_)
			return TC_ACT_UNSPEC;
		// A fragment other than the first carries no ports; loopback TCP is never fragmented.
		if ((ip[6] & 0x1f) | ip[7])
			return TC_ACT_UNSPEC;
		__builtin_memcpy(k.saddr, &ip[12], 4);
		__builtin_memcpy(k.daddr, &ip[16], 4);
		k.family = 4;
		l4 = (ip[0] & 0x0f) * 4;
		iplen = ((__u32)ip[2] << 8) | ip[3];
	} else if (skb->protocol == __builtin_bswap16(ETH_P_IPV6)) {
		__u8 ip[40];
		if (bpf_skb_load_bytes(skb, ETH_HLEN, ip, sizeof(ip)) < 0)
			return TC_ACT_UNSPEC;
		if (ip[6] != IPPROTO_TCP_) // extension headers are not looked through
			return TC_ACT_UNSPEC;
		__builtin_memcpy(k.saddr, &ip[8], 16);
		__builtin_memcpy(k.daddr, &ip[24], 16);
		k.family = 6;
		l4 = 40;
		iplen = 40 + (((__u32)ip[4] << 8) | ip[5]);
	} else {
		return TC_ACT_UNSPEC;
	}
	__u16 ports[2];
	if (bpf_skb_load_bytes(skb, ETH_HLEN + (l4 & 0x7f), ports, sizeof(ports)) < 0)
		return TC_ACT_UNSPEC;
	k.sport = ports[0];
	k.dport = ports[1];

	struct hold_val *v = bpf_map_lookup_elem(&held, &k);
	if (!v) {
		// A GSO packet may carry 0 as its length (BIG TCP): then the frame's length counts.
		if (iplen == 0)
			iplen = skb->len - ETH_HLEN;
		struct commit_val *c = bpf_map_lookup_elem(&commit, &k);
		if (c) {
			struct commit_cnt *n = bpf_map_lookup_elem(&commit_cnt, &k);
			if (!n)
				return TC_ACT_SHOT; // never let a protected segment out unchecked
			return commit_output(skb, cfg, c, n, (iplen << 8) | (l4 & 0xff));
		}
		return protected_input(skb, cfg, &k, (iplen << 8) | (l4 & 0xff));
	}
	if (v->packets >= cfg->max_packets || v->bytes + skb->len > cfg->max_bytes) {
		__sync_fetch_and_add(&v->over, 1);
		return TC_ACT_SHOT;
	}
	__sync_fetch_and_add(&v->packets, 1);
	__sync_fetch_and_add(&v->bytes, skb->len);
	return bpf_redirect(cfg->queue_ifindex, 0);
}

// On the far end of the hold veth: what the packet socket has seen goes no further (the
// kernel would otherwise route loopback-addressed packets arriving on a veth, as martians).
SEC("classifier")
int pliant_slice_hold_sink(struct __sk_buff *skb)
{
	return TC_ACT_SHOT;
}

char _license[] SEC("license") = "GPL";
