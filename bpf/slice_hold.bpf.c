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

// ---- layout (keep in sync with crates/slice/src/hold/queue.rs) ----
#define HOLD_LAYOUT_VERSION 1
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

#define IPPROTO_TCP_ 6

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
	__u32 l4;
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
	} else {
		return TC_ACT_UNSPEC;
	}
	__u16 ports[2];
	if (bpf_skb_load_bytes(skb, ETH_HLEN + (l4 & 0x7f), ports, sizeof(ports)) < 0)
		return TC_ACT_UNSPEC;
	k.sport = ports[0];
	k.dport = ports[1];

	struct hold_val *v = bpf_map_lookup_elem(&held, &k);
	if (!v)
		return TC_ACT_UNSPEC;
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
