// SPDX-License-Identifier: GPL-2.0
/*
 * rxe congestion counters: one instance per rxe host NIC, at the clsact
 * INGRESS of the host's NIC (prio FILTER_PRIO - 1, before the port program's
 * departure filter). Kernel Soft-RoCE (rdma_rxe) ignores ECN and CNPs, so
 * DCQCN around it is emulated by agents (agents/rxe_cc); this program is
 * their eyes. For every IPv4 UDP packet to port 4791 (RoCEv2) it counts, per
 * BTH DestQP (the QP of THIS host the packet is for):
 *
 *   packets      every RoCEv2 packet;
 *   ce_packets   those that arrive CE-marked (ECN bits 0b11): the NP's input;
 *   cnps         CNPs (BTH opcode 0x81, or 0x80 as Linux's ib_pack.h names
 *                it): the RP's input;
 *
 * and remembers the source address and UDP source port of the last packet,
 * so the NP knows where its CNP goes. It never changes or drops a packet and
 * always returns TC_ACT_UNSPEC: the next filter (the departure program)
 * runs as if this one were absent.
 *
 * Written for old verifiers (Debian's 6.1): bpf_skb_load_bytes with
 * constant sizes, the IP header length bounded before use, no spin lock,
 * no indexing with packet data. Layout mirrored in agents/rxe_cc/maps.py.
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#define ETH_HLEN_ 14
#define ROCE_UDP_PORT 4791
#define QPN_MASK 0xffffff
#define MAX_QPS 4096

struct qp_key {
	__u32 dest_qp;          /* BTH DestQP (24 bits) */
};

struct qp_counts {
	__u64 packets;          /* RoCEv2 packets to this QP */
	__u64 ce_packets;       /* ... that arrived CE-marked */
	__u64 cnps;             /* CNPs to this QP */
	__u64 bytes;            /* skb->len of the packets */
	__u32 saddr;            /* source address of the last packet (network order) */
	__u32 daddr;            /* its destination address (network order) */
	__u16 sport;            /* its UDP source port (host order) */
	__u16 pad0;
	__u32 pad1;
};

struct totals {
	__u64 roce_packets;     /* every RoCEv2 packet seen */
	__u64 ce_packets;
	__u64 cnps;
	__u64 untracked;        /* packets whose QP found no room in the table */
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_QPS);
	__type(key, struct qp_key);
	__type(value, struct qp_counts);
} qp_counts SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct totals);
} totals SEC(".maps");

SEC("tc")
int rxe_cc_ingress(struct __sk_buff *skb)
{
	__u8 ip[20];
	__u8 udp[8];
	__u8 bth[8];            /* opcode, flags, P_Key, FECN|BECN|resv, DestQP */

	if (skb->protocol != bpf_htons(ETH_P_IP))
		return TC_ACT_UNSPEC;
	if (bpf_skb_load_bytes(skb, ETH_HLEN_, ip, sizeof(ip)) < 0)
		return TC_ACT_UNSPEC;
	if ((ip[0] >> 4) != 4 || ip[9] != IPPROTO_UDP)
		return TC_ACT_UNSPEC;
	if ((ip[6] & 0x3f) || ip[7])        /* a fragment (offset or MF): no UDP header */
		return TC_ACT_UNSPEC;
	__u32 ihl = (ip[0] & 0x0f) * 4;
	if (ihl < 20 || ihl > 60)
		return TC_ACT_UNSPEC;
	__u32 l4 = ETH_HLEN_ + ihl;
	if (bpf_skb_load_bytes(skb, l4, udp, sizeof(udp)) < 0)
		return TC_ACT_UNSPEC;
	if (((__u32)udp[2] << 8 | udp[3]) != ROCE_UDP_PORT)
		return TC_ACT_UNSPEC;
	if (bpf_skb_load_bytes(skb, l4 + 8, bth, sizeof(bth)) < 0)
		return TC_ACT_UNSPEC;

	__u32 zero = 0;
	struct totals *t = bpf_map_lookup_elem(&totals, &zero);
	int ce = (ip[1] & 3) == 3;
	int cnp = bth[0] == 0x81 || bth[0] == 0x80;
	struct qp_key key = { .dest_qp = ((__u32)bth[5] << 16 | (__u32)bth[6] << 8 | bth[7]) &
				       QPN_MASK };
	struct qp_counts *q = bpf_map_lookup_elem(&qp_counts, &key);

	if (!q) {
		struct qp_counts fresh = {};

		bpf_map_update_elem(&qp_counts, &key, &fresh, BPF_NOEXIST);
		q = bpf_map_lookup_elem(&qp_counts, &key);
	}
	if (t) {
		__sync_fetch_and_add(&t->roce_packets, 1);
		if (ce)
			__sync_fetch_and_add(&t->ce_packets, 1);
		if (cnp)
			__sync_fetch_and_add(&t->cnps, 1);
		if (!q)
			__sync_fetch_and_add(&t->untracked, 1);
	}
	if (!q)
		return TC_ACT_UNSPEC;
	__sync_fetch_and_add(&q->packets, 1);
	__sync_fetch_and_add(&q->bytes, skb->len);
	if (ce)
		__sync_fetch_and_add(&q->ce_packets, 1);
	if (cnp)
		__sync_fetch_and_add(&q->cnps, 1);
	__builtin_memcpy(&q->saddr, &ip[12], 4);
	__builtin_memcpy(&q->daddr, &ip[16], 4);
	q->sport = (__u16)udp[0] << 8 | udp[1];
	return TC_ACT_UNSPEC;
}

char LICENSE[] SEC("license") = "GPL";
