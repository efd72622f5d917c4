// SPDX-License-Identifier: GPL-2.0
/*
 * Port program: one instance per fabric egress port. Two entry points share
 * the instance's maps:
 *
 *   port_egress     at clsact egress of the port, in direct-action mode (it
 *                   runs in dev_queue_xmit, before the port's HTB root sees
 *                   the packet): admission, tail drop, ECN marking, counters;
 *   port_departure  at clsact INGRESS of the port's veth PEER, in the other
 *                   node's namespace: every IPv4 packet that arrives there
 *                   has left this port's queue.
 *
 * So the queue this program decides on is the real one:
 *     queue(class) = bytes admitted at egress - bytes departed at the peer
 * in frame bytes (skb->len, what the kernel's qdisc backlog counts), with no
 * fluid model, no drain rate and nothing for pauses to freeze. The program
 * owns tail drop (the leaf qdiscs are sized so they never drop on their own),
 * so every admitted byte is in the qdisc, on the veth, or at the peer.
 *
 * Buffer accounting happens per NODE, in maps every port instance of a node
 * shares (loaded with bpftool's map reuse): a switch's per-(ingress port,
 * priority) occupancy, and with a shared buffer the MMU of HPCC's ns-3
 * SwitchMmu (reserve, shared pool with a dynamic alpha threshold, headroom).
 * A packet's ingress port is not visible at the peer (veth clears the skb's
 * metadata), so each port keeps, per tracked (lossless) class, a FIFO ring
 * of (ingress slot, length) in admission order; a departure takes the
 * oldest entry, as a FIFO queue really drains. All node state is guarded by
 * one spin lock per node; helpers cannot be called under it, so the clock,
 * the random numbers and every map lookup come first, and CE marking and
 * event output after.
 *
 * Packet trimming (UET): on a class configured for it, an IPv4 UDP packet to
 * port 4793 that would take the queue above trim_threshold_bytes is not
 * admitted; after the lock it is cut to ETH + trim_len bytes, its headers fixed
 * and its DSCP rewritten, and redirected to this same port's egress: it enters
 * dev_queue_xmit afresh, so the qdisc accounts its new length (the kernel sets a
 * packet's qdisc length before the egress hook runs), and this program admits
 * it as an arrival of the trim class, whose departures it then matches.
 *
 * ECN marking is this program's (ECN_BPF: the curve, drawn per packet at enqueue)
 * or, with the RED marker (ECN_RED), the class's sch_red's: the kernel qdisc marks
 * after this hook, so here the class only counts, and its ce_marks are counted at the
 * peer, from the CE packets that depart (see port_departure).
 *
 * PFC decisions are taken here, at the packet that crosses a threshold, and
 * sent to the node's PFC agent through a ring buffer (`events`): the agent
 * sleeps on it and sends the frame at once instead of polling queues.
 *
 * Layouts below are mirrored in agents/portmaps.py; the sizes are asserted
 * on both sides and against the object's BTF in tests. See docs/datapath.md.
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#define NUM_TC 8
#define OTHER_SLOT NUM_TC              /* state slot of non-IPv4 frames */
#define NUM_SLOTS (NUM_TC + 1)
#define NUM_DSCP 64
#define MAX_SLOTS 512                  /* ingress slots per node (0: sent by the node itself) */
#define MAX_TRACKED 2                  /* lossless classes with per-ingress accounting */
#define RING 16384                     /* FIFO entries per (port, tracked class) */
#define NO_TRACK 0xff
#define ETH_HLEN_ 14
#define IP_HLEN_ 20                    /* trimming: IHL 5 only */
#define UDP_HLEN_ 8
#define UET_UDP_PORT 4793              /* Ultra Ethernet transport: the only packets trimmed */
#define ALPHA_SHIFT 16                 /* alpha_fp: units of 2^-16 */

#define MODE_NONE 0                    /* host NIC: per-port limits, no PFC sending */
#define MODE_STATIC 1                  /* per-port limits, static per-ingress XOFF/XON */
#define MODE_SHARED 2                  /* shared pool, reserve, headroom, dynamic XOFF */

#define EV_XOFF 1                      /* an ingress (slot, class) wants to pause */
#define EV_XON 2                       /* ... may resume */
#define EV_EGRESS_HOT 3                /* static: an egress queue reached its XOFF */
#define EV_EGRESS_COOL 4               /* ... fell to its XON */
#define EV_DROP 5                      /* a lossless (tracked) class refused a packet */

#define ECN_OFF 0                      /* class_cfg.ecn_enabled: no marking */
#define ECN_BPF 1                      /* this program marks with the curve */
#define ECN_RED 2                      /* the class's sch_red marks (the kernel qdisc, after
                                        * this hook); this program counts its marks when
                                        * the packets depart (ce_marks) */

#define F_WANT_PAUSE 1                 /* node ingress entry: XOFF state */
#define F_HOT 1                        /* class state: egress protection active */

/* Configuration of the port (pinned map `cfg`, one entry). */
struct port_cfg {
	__u32 default_tc;       /* class of a DSCP whose dscp_tc entry is >= NUM_TC */
	__u32 port_slot;        /* this port's ingress slot at its own node */
};

/* Configuration of one class (pinned map `class_cfg`, NUM_TC entries). */
struct class_cfg {
	__u64 kmin_bytes;
	__u64 kmax_bytes;       /* kmin == kmax: step, mark iff queue > kmin */
	__u64 pmax_fp;          /* probability in units of 2^-32: 1.0 == 1 << 32 */
	__u64 drop_fp;          /* drop probability (PHY loss, impairment), same encoding */
	__u64 limit_bytes;      /* this port's buffer for the class (tail drop); 0: none
	                         * (a shared-pool class: the node's MMU admits) */
	__u64 egress_xoff_bytes; /* static mode: queue that pauses every contributor; 0: off */
	__u64 egress_xon_bytes;
	__u32 ecn_enabled;      /* ECN_OFF, ECN_BPF or ECN_RED */
	__u32 trim_len;         /* trimming on: IP bytes a trimmed UET packet keeps; 0: off */
	__u64 trim_threshold_bytes; /* a UET packet that would take the queue above this is
	                         * trimmed instead of admitted */
	__u32 trim_tc;          /* class the trimmed packet is sent in (strict, not tracked) */
	__u32 trim_dscp;        /* DSCP written into it (ECN bits kept): trim_tc's first */
};

/* State and counters of one class of this port (pinned map `state`, NUM_SLOTS
 * entries, mmap-able; written under the node lock, read by user space
 * without it: every field is a naturally aligned u64). */
struct class_state {
	__u64 enq_bytes;        /* admitted: queue = enq_bytes - dep_bytes */
	__u64 enq_packets;
	__u64 dep_bytes;        /* departed (seen at the peer's ingress) */
	__u64 dep_packets;
	__u64 packets;          /* arrivals, drops included */
	__u64 bytes;            /* skb->len of arrivals, drops included */
	__u64 ect_packets;      /* arrivals with ECT(0) or ECT(1) */
	__u64 ce_arrivals;      /* arrivals already CE */
	__u64 ce_marks;         /* ECT -> CE done here (ECN_RED: by the class's sch_red, counted
	                         * at departure: exact once the CE arrivals queued ahead have
	                         * left, never above the true count) */
	__u64 would_mark;       /* non-ECT arrivals the curve picked (not changed) */
	__u64 drops;            /* TC_ACT_SHOT by drop_fp (PHY loss, impairment) */
	__u64 tail_drops;       /* refused: the port's limit_bytes */
	__u64 mmu_drops;        /* refused: the node's shared buffer (headroom full) */
	__u64 desc_drops;       /* refused: the FIFO ring (packet descriptors) is full */
	__u64 max_queue_bytes;  /* largest queue right after an admission */
	__u64 mark_errors;      /* bpf_skb_ecn_set_ce refused an ECT packet */
	__u64 ring_head;        /* FIFO: next entry to take */
	__u64 ring_tail;        /* FIFO: next entry to fill */
	__u64 dep_mismatch;     /* a departure whose length is not its FIFO entry's */
	__u64 dep_unmatched;    /* a departure with nothing admitted (not counted) */
	__u64 flags;            /* F_HOT */
	__u64 trims;            /* UET arrivals over trim_threshold_bytes: cut and sent in
	                         * trim_tc instead of admitted here (not drops) */
	__u64 trim_errors;      /* of those, dropped because a helper failed to cut them */
	__u64 ce_queued;        /* ECN_RED: admitted CE arrivals not yet matched by a CE
	                         * departure (a CE departure takes one of these before it
	                         * counts as a mark of sch_red) */
};

/* Per-node, per-(tracked class, ingress slot) accounting. */
struct ingress_acct {
	__u64 bytes;            /* queued at the node from this ingress and class (HPCC's
	                         * ingress_bytes: reserve + shared part) */
	__u64 hdrm_bytes;       /* shared mode: of this ingress's bytes, those in headroom */
	__u64 max_bytes;        /* largest bytes + hdrm_bytes seen */
	__u64 max_hdrm_bytes;
	__u64 drops;            /* arrivals refused (any reason) */
	__u64 xoff_events;
	__u64 xon_events;
	__u32 headroom_bytes;   /* cfg, shared mode: headroom of this ingress port */
	__u32 xoff_bytes;       /* cfg: static XOFF (bytes held; shared mode: of the shared
	                         * part); 0 in shared mode: the dynamic alpha threshold */
	__u32 xon_bytes;        /* cfg: static XON */
	__u32 alpha_fp;         /* cfg, shared mode: this ingress's alpha (2^-16 units) */
	__u32 flags;            /* F_WANT_PAUSE */
	__u32 pad;
};

/* The node's buffer model (pinned map `node`, one entry, mmap-able). */
struct node_acct {
	__u32 mode;             /* MODE_* */
	__u32 alpha_fp;         /* shared: XOFF above (alpha_fp >> 16) x free shared bytes */
	__u64 buffer_bytes;     /* shared: the pool */
	__u64 reserve_bytes;    /* shared: per (ingress port, class) minimum */
	__u64 resume_offset_bytes;
	__u64 total_hdrm_bytes; /* shared: headroom of every ingress port, set aside */
	__u64 total_rsrv_bytes; /* shared: reserve of every ingress port, set aside */
	__u8 tracked[NUM_TC];   /* class -> tracked index, NO_TRACK if none */
	__u64 shared_used_bytes;
	__u64 max_shared_used_bytes;
	__u64 events_lost;      /* ring buffer full: the agent rescans flags */
	__u64 pad;
	struct ingress_acct in[MAX_TRACKED][MAX_SLOTS];
};

/* The node's lock (pinned map `node_lock`): a map of its own because
 * mmap-able maps cannot hold a bpf_spin_lock. */
struct node_lock {
	struct bpf_spin_lock lock;
	__u32 pad;
};

/* One PFC-relevant transition, for the node's PFC agent (map `events`). */
struct event {
	__u64 ts_ns;            /* CLOCK_MONOTONIC of the packet that caused it */
	__u32 kind;             /* EV_* */
	__u32 tc;
	__u32 slot;             /* ingress slot (XOFF/XON/DROP) */
	__u32 port_slot;        /* the egress port (EGRESS_*, DROP) */
	__u64 bytes;            /* occupancy that decided */
};

struct ring {
	__u32 e[MAX_TRACKED][RING];     /* (slot << 16) | frame length */
};

struct port_ingress {
	__u64 adm[MAX_TRACKED][MAX_SLOTS];
	__u64 dep[MAX_TRACKED][MAX_SLOTS];
};

/* A drop, by flow (map `flow_drops`): conservation checks per stream. */
struct flow_key {
	__u32 saddr;
	__u32 daddr;
	__u16 sport;
	__u16 dport;
	__u8 proto;
	__u8 tc;
	__u16 pad;
};

struct flow_drops {
	__u64 phy;              /* drop_fp */
	__u64 tail;             /* port limit */
	__u64 mmu;              /* shared buffer */
	__u64 desc;             /* FIFO ring */
};

_Static_assert(sizeof(struct port_cfg) == 8, "PORTPROG_PORT_CFG_SIZE");
_Static_assert(sizeof(struct class_cfg) == 80, "PORTPROG_CLASS_CFG_SIZE");
_Static_assert(sizeof(struct class_state) == 192, "PORTPROG_STATE_SIZE");
_Static_assert(sizeof(struct ingress_acct) == 80, "PORTPROG_INGRESS_ACCT_SIZE");
_Static_assert(sizeof(struct node_acct) == 82008, "PORTPROG_NODE_SIZE");
_Static_assert(sizeof(struct event) == 32, "PORTPROG_EVENT_SIZE");
_Static_assert(sizeof(struct flow_key) == 16, "PORTPROG_FLOW_KEY_SIZE");
_Static_assert(sizeof(struct flow_drops) == 32, "PORTPROG_FLOW_DROPS_SIZE");

/* The maps. Two builds of this source (testbed/net/portprog.py):
 *
 * - per port (the default): every port loads its own instance, and the names below are
 *   the instance's maps (a node's first port makes the node's maps, the others reuse
 *   them through bpftool's map reuse);
 * - LAB_INSTANCE: ONE instance serves every port of a lab, so the verifier runs twice
 *   per lab instead of twice per port. Each name below is then an ARRAY_OF_MAPS keyed
 *   by PORT_KEY(skb->ifindex, direction): the builder gives every fabric interface a
 *   lab-unique ifindex, so the interface a program runs on names the port it serves.
 *   Egress at the port (key ifindex << 1) and the departure at its peer (key
 *   peer_ifindex << 1 | 1) both find the same inner maps: that port's maps (and its
 *   node's), made by user space with the per-port build's types, sizes and flags and
 *   pinned at the same paths, so readers do not change. The node's lock cannot be an
 *   inner map (Linux < 6.2 refuses a bpf_spin_lock there): it is an element of the
 *   lab's `node_lock` array, at the index `port_node` gives the key.
 */
#ifdef LAB_INSTANCE
#define MAX_IFINDEX 8192               /* lab-unique ifindexes of fabric interfaces: 2..8191 */
#define MAX_PORT_KEYS (2 * MAX_IFINDEX)
#define MAX_NODES 4096
#define PORT_KEY(ifindex, dir) (((ifindex) << 1) | (dir))
/* Inner map templates carry sizes, not types: clang emits a struct reached only
 * through the outer map's pointers as a forward declaration, whose size libbpf
 * cannot tell. */
#define DEFINE_MAP(name, type_, entries, flags, key_t, value_t)  \
	struct name##_inner {                                   \
		__uint(type, type_);                            \
		__uint(max_entries, entries);                   \
		__uint(map_flags, flags);                       \
		__uint(key_size, sizeof(key_t));                \
		__uint(value_size, sizeof(value_t));            \
	};                                                      \
	DEFINE_OUTER(name)
#define DEFINE_RINGBUF(name, bytes)                             \
	struct name##_inner {                                   \
		__uint(type, BPF_MAP_TYPE_RINGBUF);             \
		__uint(max_entries, bytes);                     \
	};                                                      \
	DEFINE_OUTER(name)
#define DEFINE_OUTER(name)                                      \
	struct {                                                \
		__uint(type, BPF_MAP_TYPE_ARRAY_OF_MAPS);       \
		__uint(max_entries, MAX_PORT_KEYS);             \
		__type(key, __u32);                             \
		__array(values, struct name##_inner);           \
	} name SEC(".maps")
#else
#define DEFINE_MAP(name, type_, entries, flags, key_t, value_t)  \
	struct {                                                \
		__uint(type, type_);                            \
		__uint(max_entries, entries);                   \
		__uint(map_flags, flags);                       \
		__type(key, key_t);                             \
		__type(value, value_t);                         \
	} name SEC(".maps")
#define DEFINE_RINGBUF(name, bytes)                             \
	struct {                                                \
		__uint(type, BPF_MAP_TYPE_RINGBUF);             \
		__uint(max_entries, bytes);                     \
	} name SEC(".maps")
#endif

DEFINE_MAP(cfg, BPF_MAP_TYPE_ARRAY, 1, 0, __u32, struct port_cfg);
DEFINE_MAP(dscp_tc, BPF_MAP_TYPE_ARRAY, NUM_DSCP, 0, __u32, __u32);
DEFINE_MAP(class_cfg, BPF_MAP_TYPE_ARRAY, NUM_TC, 0, __u32, struct class_cfg);
DEFINE_MAP(state, BPF_MAP_TYPE_ARRAY, NUM_SLOTS, BPF_F_MMAPABLE, __u32, struct class_state);
DEFINE_MAP(ring, BPF_MAP_TYPE_ARRAY, 1, 0, __u32, struct ring);
DEFINE_MAP(port_ingress, BPF_MAP_TYPE_ARRAY, 1, BPF_F_MMAPABLE, __u32, struct port_ingress);

/* Node-level maps: the first port of a node creates them, the others reuse them. */
DEFINE_MAP(node, BPF_MAP_TYPE_ARRAY, 1, BPF_F_MMAPABLE, __u32, struct node_acct);

#ifdef LAB_INSTANCE
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_NODES);
	__type(key, __u32);
	__type(value, struct node_lock);
} node_lock SEC(".maps");

/* port key -> index of the port's node in node_lock */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_PORT_KEYS);
	__type(key, __u32);
	__type(value, __u32);
} port_node SEC(".maps");
#else
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct node_lock);
} node_lock SEC(".maps");
#endif

/* ingress ifindex -> slot of the node's ports */
DEFINE_MAP(ifslot, BPF_MAP_TYPE_HASH, MAX_SLOTS, 0, __u32, __u32);
DEFINE_RINGBUF(events, 1 << 16);
DEFINE_MAP(flow_drops, BPF_MAP_TYPE_LRU_HASH, 4096, 0, struct flow_key, struct flow_drops);

/* The map a name stands for at this port: itself (per port), or the inner map the
 * outer map holds for the port's key (LAB_INSTANCE; NULL if the port has none). */
#ifdef LAB_INSTANCE
#define PORT_MAP(name, key) bpf_map_lookup_elem(&(name), &(key))
#else
#define PORT_MAP(name, key) ((void *)&(name))
#endif

/* An index into a map value, bounded where it is used: `v & mask` (mask = 2^k - 1)
 * after a barrier, so the compiler cannot drop the AND as redundant with an earlier
 * one, and the verifier sees the bound in the register that forms the address.
 * Older verifiers (Linux 6.1) forget the bounds of a value kept on the stack (as a
 * 32-bit field of a struct, or spilled), so every array index goes through this
 * right before its use. Behaviour is unchanged: every index is already in range. */
static __always_inline __u64 bound(__u64 v, __u64 mask)
{
	barrier_var(v);
	return v & mask;
}

/* The port's key in the outer maps (LAB_INSTANCE; the per-port build has no use for it):
 * DIR_EGRESS at the port itself, DIR_DEPARTURE at its veth peer's ingress. */
#define DIR_EGRESS 0
#define DIR_DEPARTURE 1

static __always_inline __u32 port_key(struct __sk_buff *skb, __u32 dir)
{
#ifdef LAB_INSTANCE
	return PORT_KEY(skb->ifindex, dir);   /* >= MAX_PORT_KEYS: no inner map */
#else
	return 0;
#endif
}

static __always_inline void count_other(struct __sk_buff *skb, __u32 pkey)
{
	__u32 key = OTHER_SLOT;
	void *states = PORT_MAP(state, pkey);
	struct class_state *st = states ? bpf_map_lookup_elem(states, &key) : 0;

	if (st) {
		__sync_fetch_and_add(&st->packets, 1);
		__sync_fetch_and_add(&st->bytes, skb->len);
	}
}

/* Class of an IPv4 packet, and its TOS byte; -1 if not IPv4. */
static __always_inline int classify(struct __sk_buff *skb, __u32 pkey, __u32 default_tc,
				    __u8 *tos)
{
	__u8 hdr[2];                /* version/IHL, TOS */

	if (skb->protocol != bpf_htons(ETH_P_IP) ||
	    bpf_skb_load_bytes(skb, ETH_HLEN_, hdr, sizeof(hdr)) < 0 || (hdr[0] >> 4) != 4)
		return -1;
	*tos = hdr[1];
	__u32 dscp = hdr[1] >> 2;
	void *table = PORT_MAP(dscp_tc, pkey);
	__u32 *mapped = table ? bpf_map_lookup_elem(table, &dscp) : 0;
	__u32 tc = mapped ? *mapped : NUM_TC;
	if (tc >= NUM_TC)
		tc = default_tc;
	if (tc >= NUM_TC)
		tc = 0;
	return tc;
}

/* What a packet of this port touches: its class and the maps of its class and node. */
struct port_ctx {
	struct port_cfg *pc;
	struct class_cfg *cc;
	struct class_state *st;
	struct node_acct *n;
	struct node_lock *nl;
	struct ring *rg;
	struct port_ingress *pin;
	__u32 tc;
	__u32 key;              /* the port's key (port_key) */
	__u8 tos;
};

#define CTX_OK 0
#define CTX_NOT_IPV4 1
#define CTX_NO_MAP 2

/* Look `k` up in the map `name` stands for at this port (NULL if the port has none). */
#define PORT_LOOKUP(name, pkey, k) ({                                   \
	void *m_ = PORT_MAP(name, pkey);                                \
	m_ ? bpf_map_lookup_elem(m_, (k)) : 0;                          \
})

static __always_inline int port_ctx(struct __sk_buff *skb, struct port_ctx *c, __u32 dir)
{
	__u32 zero = 0;

	c->key = port_key(skb, dir);
	c->pc = PORT_LOOKUP(cfg, c->key, &zero);
	if (!c->pc)
		return CTX_NO_MAP;
	int tci = classify(skb, c->key, c->pc->default_tc, &c->tos);
	if (tci < 0)
		return CTX_NOT_IPV4;
	c->tc = tci & (NUM_TC - 1);
	c->cc = PORT_LOOKUP(class_cfg, c->key, &c->tc);
	c->st = PORT_LOOKUP(state, c->key, &c->tc);
	c->n = PORT_LOOKUP(node, c->key, &zero);
#ifdef LAB_INSTANCE
	__u32 *ni = bpf_map_lookup_elem(&port_node, &c->key);
	c->nl = ni ? bpf_map_lookup_elem(&node_lock, ni) : 0;
#else
	c->nl = bpf_map_lookup_elem(&node_lock, &zero);
#endif
	c->rg = PORT_LOOKUP(ring, c->key, &zero);
	c->pin = PORT_LOOKUP(port_ingress, c->key, &zero);
	if (!c->cc || !c->st || !c->n || !c->nl || !c->rg || !c->pin)
		return CTX_NO_MAP;
	return CTX_OK;
}

/* HPCC's GetPfcThreshold for one ingress: alpha x the free part of the shared
 * pool, or the ingress's static XOFF. */
static __always_inline __u64 shared_threshold(struct node_acct *n, struct ingress_acct *a)
{
	if (a->xoff_bytes)
		return a->xoff_bytes;
	__u64 set_aside = n->total_hdrm_bytes + n->total_rsrv_bytes + n->shared_used_bytes;
	__u64 free = n->buffer_bytes > set_aside ? n->buffer_bytes - set_aside : 0;
	__u64 alpha = a->alpha_fp ? a->alpha_fp : n->alpha_fp;
	return (free * alpha) >> ALPHA_SHIFT;
}

static __always_inline __u64 shared_part(struct node_acct *n, struct ingress_acct *a)
{
	return a->bytes > n->reserve_bytes ? a->bytes - n->reserve_bytes : 0;
}

static __always_inline void emit(__u32 kind, __u64 now, __u32 tc, __u32 slot, __u32 port_slot,
				 __u64 bytes, struct node_acct *n, __u32 pkey)
{
	struct event ev = {.ts_ns = now, .kind = kind, .tc = tc, .slot = slot,
			   .port_slot = port_slot, .bytes = bytes};
	void *ring_buf = PORT_MAP(events, pkey);

	if (!ring_buf || bpf_ringbuf_output(ring_buf, &ev, sizeof(ev), 0))
		__sync_fetch_and_add(&n->events_lost, 1);
}

/* The header words trimming rewrites, as on the wire (big endian). */
struct uet_hdr {
	__u16 w0;               /* version/IHL, TOS */
	__u16 tot_len;
};

/* Is this an IPv4 UDP packet to UET_UDP_PORT with a 20-byte IP header and not a
 * fragment (the only packets trimming may cut)? Fills `h` if so. */
static __always_inline int uet_packet(struct __sk_buff *skb, struct uet_hdr *h)
{
	__u8 b[IP_HLEN_ + 4];       /* IP header, UDP ports */

	if (bpf_skb_load_bytes(skb, ETH_HLEN_, b, sizeof(b)) < 0)
		return 0;
	if (b[0] != 0x45 || b[9] != IPPROTO_UDP || (b[6] & 0x3f) || b[7])
		return 0;
	if (((__u32)b[IP_HLEN_ + 2] << 8 | b[IP_HLEN_ + 3]) != UET_UDP_PORT)
		return 0;
	__builtin_memcpy(&h->w0, &b[0], 2);
	__builtin_memcpy(&h->tot_len, &b[2], 2);
	return 1;
}

/* Cut the packet to its Ethernet header + trim_len bytes of IP and make what is left a
 * valid IPv4/UDP packet: total length and header checksum, UDP length, UDP checksum 0
 * (UET senders send 0: nothing to recompute), DSCP trim_dscp with the ECN bits kept.
 * 0 on success; a helper's failure leaves the packet to be dropped. */
static __always_inline int trim_packet(struct __sk_buff *skb, struct class_cfg *cc,
				       struct uet_hdr *h)
{
	__u32 keep = cc->trim_len;
	__u16 tot = bpf_htons((__u16)keep);
	__u16 w0 = h->w0;
	__u8 *b = (__u8 *)&w0;
	__u16 udp[2] = {bpf_htons((__u16)(keep - IP_HLEN_)), 0};    /* length, checksum */

	b[1] = (__u8)(cc->trim_dscp << 2) | (b[1] & 3);
	if (bpf_skb_change_tail(skb, ETH_HLEN_ + keep, 0))
		return -1;
	if (bpf_l3_csum_replace(skb, ETH_HLEN_ + 10, h->tot_len, tot, 2) ||
	    bpf_skb_store_bytes(skb, ETH_HLEN_ + 2, &tot, 2, 0))
		return -1;
	if (bpf_l3_csum_replace(skb, ETH_HLEN_ + 10, h->w0, w0, 2) ||
	    bpf_skb_store_bytes(skb, ETH_HLEN_, &w0, 2, 0))
		return -1;
	if (bpf_skb_store_bytes(skb, ETH_HLEN_ + IP_HLEN_ + 4, udp, sizeof(udp), 0))
		return -1;
	return 0;
}

/* Which counter of `flow_drops` a refused or dropped packet goes to. */
#define DROP_PHY 1
#define DROP_TAIL 2
#define DROP_MMU 3
#define DROP_DESC 4

static __always_inline void count_flow_drop(struct __sk_buff *skb, __u32 tc, int why,
					    __u32 pkey)
{
	__u8 ip[20];
	__u16 ports[2] = {0, 0};
	struct flow_key key = {};
	struct flow_drops zero = {}, *d;

	if (bpf_skb_load_bytes(skb, ETH_HLEN_, ip, sizeof(ip)) < 0)
		return;
	__u32 ihl = (ip[0] & 0xf) * 4;
	key.proto = ip[9];
	__builtin_memcpy(&key.saddr, &ip[12], 4);
	__builtin_memcpy(&key.daddr, &ip[16], 4);
	if ((key.proto == IPPROTO_UDP || key.proto == IPPROTO_TCP) && ihl >= 20 && ihl <= 60 &&
	    bpf_skb_load_bytes(skb, ETH_HLEN_ + ihl, ports, sizeof(ports)) == 0) {
		key.sport = bpf_ntohs(ports[0]);
		key.dport = bpf_ntohs(ports[1]);
	}
	key.tc = tc;
	void *drops = PORT_MAP(flow_drops, pkey);
	if (!drops)
		return;
	d = bpf_map_lookup_elem(drops, &key);
	if (!d) {
		bpf_map_update_elem(drops, &key, &zero, BPF_NOEXIST);
		d = bpf_map_lookup_elem(drops, &key);
		if (!d)
			return;
	}
	if (why == DROP_PHY)
		__sync_fetch_and_add(&d->phy, 1);
	else if (why == DROP_TAIL)
		__sync_fetch_and_add(&d->tail, 1);
	else if (why == DROP_MMU)
		__sync_fetch_and_add(&d->mmu, 1);
	else
		__sync_fetch_and_add(&d->desc, 1);
}

SEC("tc")
int port_egress(struct __sk_buff *skb)
{
	struct port_ctx c;
	int got = port_ctx(skb, &c, DIR_EGRESS);

	if (got == CTX_NOT_IPV4)
		count_other(skb, c.key);
	if (got != CTX_OK)
		return TC_ACT_OK;

	/* Everything that needs a helper happens before the lock. */
	__u64 now = bpf_ktime_get_ns();
	__u32 r_drop = c.cc->drop_fp ? bpf_get_prandom_u32() : 0;
	__u32 r_mark = c.cc->ecn_enabled == ECN_BPF ? bpf_get_prandom_u32() : 0;
	__u32 in = skb->ingress_ifindex, slot = 0;
	if (in) {
		__u32 *s = PORT_LOOKUP(ifslot, c.key, &in);
		if (s)
			slot = *s & (MAX_SLOTS - 1);
	}
	__u64 len = skb->len;
	__u32 ecn = c.tos & 3;
	/* Trimming: is this a packet the class may trim (read outside the lock)? */
	struct uet_hdr uh = {};
	int can_trim = c.cc->trim_len && uet_packet(skb, &uh) &&
		       bpf_ntohs(uh.tot_len) > c.cc->trim_len;

	int mark = 0, dropped = 0, ev = 0, ev2 = 0, trim = 0;
	__u64 ev_bytes = 0, ev2_bytes = 0;

	bpf_spin_lock(&c.nl->lock);
	__u32 tr = c.n->tracked[bound(c.tc, NUM_TC - 1)];
	c.st->packets += 1;
	c.st->bytes += len;
	__u64 q = c.st->enq_bytes - c.st->dep_bytes;   /* real queue ahead of this packet */
	if (can_trim && q + len > c.cc->trim_threshold_bytes) {
		/* not admitted here: cut after the lock and sent in trim_tc; the short
		 * packet takes the PHY loss draw there, as it crosses the wire once */
		c.st->trims += 1;
		trim = 1;
		goto unlock;
	}
	if ((__u64)r_drop < c.cc->drop_fp) {
		c.st->drops += 1;
		dropped = DROP_PHY;
		goto unlock;
	}
	struct ingress_acct *a = 0;
	__u64 thresh = 0;
	if (tr < MAX_TRACKED) {
		a = &c.n->in[bound(tr, MAX_TRACKED - 1)][bound(slot, MAX_SLOTS - 1)];
		if (c.st->ring_tail - c.st->ring_head >= RING) {
			c.st->desc_drops += 1;
			dropped = DROP_DESC;
		} else if (c.n->mode == MODE_SHARED && !c.cc->limit_bytes) {
			/* HPCC CheckIngressAdmission: refuse when the headroom cannot take
			 * it and the shared pool is over this ingress's threshold. */
			thresh = shared_threshold(c.n, a);
			if (len + a->hdrm_bytes > a->headroom_bytes &&
			    len + shared_part(c.n, a) > thresh) {
				c.st->mmu_drops += 1;
				dropped = DROP_MMU;
			}
		}
		if (dropped) {
			a->drops += 1;
			ev = EV_DROP;
			ev_bytes = a->bytes + a->hdrm_bytes;
			goto unlock;
		}
	}
	if (c.cc->limit_bytes && q + len > c.cc->limit_bytes) {
		c.st->tail_drops += 1;
		dropped = DROP_TAIL;
		if (a) {
			a->drops += 1;
			ev = EV_DROP;
			ev_bytes = q;
		}
		goto unlock;
	}

	if (c.cc->ecn_enabled == ECN_BPF) {
		__u64 kmin = c.cc->kmin_bytes, kmax = c.cc->kmax_bytes;
		if (q > kmax)
			mark = 1;
		else if (q > kmin)            /* here kmin < q <= kmax */
			/* r / 2^32 < pmax (q - kmin) / (kmax - kmin), in integers;
			 * kmax - kmin < 2^31 and pmax_fp <= 2^32 keep it in 64 bits */
			mark = (__u64)r_mark * (kmax - kmin) < c.cc->pmax_fp * (q - kmin);
	}
	c.st->enq_bytes += len;
	c.st->enq_packets += 1;
	q += len;
	if (q > c.st->max_queue_bytes)
		c.st->max_queue_bytes = q;
	if (ecn == 1 || ecn == 2) {
		c.st->ect_packets += 1;
	} else {
		if (ecn == 3) {
			c.st->ce_arrivals += 1;
			if (c.cc->ecn_enabled == ECN_RED)
				c.st->ce_queued += 1;
		} else if (mark)
			c.st->would_mark += 1;
		mark = 0;
	}

	if (a) {
		__u32 t = tr & (MAX_TRACKED - 1);
		c.rg->e[bound(t, MAX_TRACKED - 1)][bound(c.st->ring_tail, RING - 1)] =
			(slot << 16) | (__u32)(len & 0xffff);
		c.st->ring_tail += 1;
		c.pin->adm[bound(t, MAX_TRACKED - 1)][bound(slot, MAX_SLOTS - 1)] += len;
		int want;
		if (c.n->mode == MODE_SHARED && !c.cc->limit_bytes) {
			/* HPCC UpdateIngressAdmission, then CheckShouldPause */
			__u64 nb = a->bytes + len;
			if (nb <= c.n->reserve_bytes) {
				a->bytes += len;
			} else if (nb - c.n->reserve_bytes > thresh) {
				a->hdrm_bytes += len;
			} else {
				__u64 over = nb - c.n->reserve_bytes;
				a->bytes += len;
				c.n->shared_used_bytes += over < len ? over : len;
			}
			if (c.n->shared_used_bytes > c.n->max_shared_used_bytes)
				c.n->max_shared_used_bytes = c.n->shared_used_bytes;
			want = a->hdrm_bytes > 0 || shared_part(c.n, a) >= shared_threshold(c.n, a);
		} else {
			a->bytes += len;
			want = a->xoff_bytes && a->bytes >= a->xoff_bytes;
		}
		__u64 held = a->bytes + a->hdrm_bytes;
		if (held > a->max_bytes)
			a->max_bytes = held;
		if (a->hdrm_bytes > a->max_hdrm_bytes)
			a->max_hdrm_bytes = a->hdrm_bytes;
		if (want && !(a->flags & F_WANT_PAUSE)) {
			a->flags |= F_WANT_PAUSE;
			a->xoff_events += 1;
			ev = EV_XOFF;
			ev_bytes = held;
		}
		if (c.cc->egress_xoff_bytes && q >= c.cc->egress_xoff_bytes &&
		    !(c.st->flags & F_HOT)) {
			c.st->flags |= F_HOT;
			ev2 = EV_EGRESS_HOT;
			ev2_bytes = q;
		}
	}
unlock:
	bpf_spin_unlock(&c.nl->lock);

	if (ev)
		emit(ev, now, c.tc, slot, c.pc->port_slot, ev_bytes, c.n, c.key);
	if (ev2)
		emit(ev2, now, c.tc, slot, c.pc->port_slot, ev2_bytes, c.n, c.key);
	if (dropped) {
		count_flow_drop(skb, c.tc, dropped, c.key);
		return TC_ACT_SHOT;
	}
	if (trim) {
		if (trim_packet(skb, c.cc, &uh)) {
			__sync_fetch_and_add(&c.st->trim_errors, 1);
			count_flow_drop(skb, c.tc, DROP_TAIL, c.key);
			return TC_ACT_SHOT;
		}
		/* Send the short packet through this port's egress again. The kernel took
		 * its qdisc length (what HTB charges and the leaf's limit counts) before
		 * this hook ran, so passing it on as it is would make HTB charge the full
		 * length; dev_queue_xmit afresh takes the new one. Its second pass through
		 * this program is an arrival of trim_tc (its DSCP says so), admitted by that
		 * class's rules, so the departure the peer sees matches; trim_tc is strict,
		 * lossy and does not trim (the config checks it). No ECN marking here. */
		return bpf_redirect(skb->ifindex, 0);
	}
	if (mark) {
		if (bpf_skb_ecn_set_ce(skb))
			__sync_fetch_and_add(&c.st->ce_marks, 1);
		else
			__sync_fetch_and_add(&c.st->mark_errors, 1);
	}
	return TC_ACT_OK;
}

/* Returns TC_ACT_UNSPEC (direct-action: go on with the next filter of the peer's
 * clsact ingress, e.g. a netem redirect at a higher prio number; at the end of the
 * chain the same as TC_ACT_OK): this program only counts, it never decides. */
SEC("tc")
int port_departure(struct __sk_buff *skb)
{
	struct port_ctx c;

	if (port_ctx(skb, &c, DIR_DEPARTURE) != CTX_OK)
		return TC_ACT_UNSPEC;
	__u64 now = bpf_ktime_get_ns();
	__u64 len = skb->len;
	int ev = 0, ev2 = 0;
	__u32 slot = 0;
	__u64 ev_bytes = 0, ev2_bytes = 0;

	bpf_spin_lock(&c.nl->lock);
	__u32 tr = c.n->tracked[bound(c.tc, NUM_TC - 1)];
	if (tr < MAX_TRACKED) {
		__u32 t = tr & (MAX_TRACKED - 1);
		if (c.st->ring_head == c.st->ring_tail) {
			c.st->dep_unmatched += 1;
			goto unlock;
		}
		__u32 e = c.rg->e[bound(t, MAX_TRACKED - 1)][bound(c.st->ring_head, RING - 1)];
		c.st->ring_head += 1;
		slot = (e >> 16) & (MAX_SLOTS - 1);
		__u64 plen = e & 0xffff;
		if (plen != len)
			c.st->dep_mismatch += 1;
		c.st->dep_bytes += plen;
		c.st->dep_packets += 1;
		c.pin->dep[bound(t, MAX_TRACKED - 1)][bound(slot, MAX_SLOTS - 1)] += plen;
		struct ingress_acct *a = &c.n->in[bound(t, MAX_TRACKED - 1)]
						[bound(slot, MAX_SLOTS - 1)];
		int resume;
		if (c.n->mode == MODE_SHARED && !c.cc->limit_bytes) {
			/* HPCC RemoveFromIngressAdmission, then CheckShouldResume */
			__u64 from_hdrm = a->hdrm_bytes < plen ? a->hdrm_bytes : plen;
			__u64 rest = plen - from_hdrm;
			__u64 sh = shared_part(c.n, a);
			__u64 from_shared = sh < rest ? sh : rest;
			a->hdrm_bytes -= from_hdrm;
			a->bytes = a->bytes > rest ? a->bytes - rest : 0;
			c.n->shared_used_bytes = c.n->shared_used_bytes > from_shared ?
				c.n->shared_used_bytes - from_shared : 0;
			sh = shared_part(c.n, a);
			if (a->xoff_bytes)
				resume = a->hdrm_bytes == 0 && sh <= a->xon_bytes;
			else
				resume = a->hdrm_bytes == 0 &&
					 (sh == 0 || sh + c.n->resume_offset_bytes <=
					  shared_threshold(c.n, a));
		} else {
			a->bytes = a->bytes > plen ? a->bytes - plen : 0;
			resume = a->bytes <= a->xon_bytes;
		}
		if (resume && (a->flags & F_WANT_PAUSE)) {
			a->flags &= ~F_WANT_PAUSE;
			a->xon_events += 1;
			ev = EV_XON;
			ev_bytes = a->bytes + a->hdrm_bytes;
		}
		__u64 q = c.st->enq_bytes - c.st->dep_bytes;
		if ((c.st->flags & F_HOT) && q <= c.cc->egress_xon_bytes) {
			c.st->flags &= ~F_HOT;
			ev2 = EV_EGRESS_COOL;
			ev2_bytes = q;
		}
	} else {
		if (c.st->enq_bytes - c.st->dep_bytes < len) {
			c.st->dep_unmatched += 1;
			goto unlock;
		}
		c.st->dep_bytes += len;
		c.st->dep_packets += 1;
	}
	/* ECN_RED: a CE departure is a mark of the class's sch_red unless a CE arrival is
	 * still unmatched (it may be that one). So ce_marks never exceeds sch_red's ECT -> CE
	 * marks that have departed, and equals them once the CE arrivals ahead have left:
	 * unmatched CE arrivals never outnumber the CE arrivals in the queue. */
	if (c.cc->ecn_enabled == ECN_RED && (c.tos & 3) == 3) {
		if (c.st->ce_queued)
			c.st->ce_queued -= 1;
		else
			c.st->ce_marks += 1;
	}
unlock:
	bpf_spin_unlock(&c.nl->lock);
	if (ev)
		emit(ev, now, c.tc, slot, c.pc->port_slot, ev_bytes, c.n, c.key);
	if (ev2)
		emit(ev2, now, c.tc, slot, c.pc->port_slot, ev2_bytes, c.n, c.key);
	return TC_ACT_UNSPEC;
}

char LICENSE[] SEC("license") = "GPL";
