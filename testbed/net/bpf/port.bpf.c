// SPDX-License-Identifier: GPL-2.0
/*
 * Port program: one instance per fabric egress port, attached at clsact
 * egress in direct-action mode (so it runs in dev_queue_xmit, before the
 * port's HTB root sees the packet).
 *
 * Per traffic class it keeps a VIRTUAL QUEUE in bytes: every packet handed
 * to the qdisc adds skb->len + overhead_bytes; the queue drains at the port's
 * wall rate, except while the class is paused (user space sets that in the
 * `pause` map). On that queue it
 *   - marks CE on ECT packets with the DCQCN/RED curve (instantaneous queue,
 *     decided at ENQUEUE on the backlog the packet finds ahead of it, itself
 *     excluded - what sch_red does),
 *   - drops with a configured probability (PHY frame loss / impairment),
 *   - counts packets, bytes, marks, drops and the largest queue seen.
 * Non-IPv4 frames (ARP, PFC 0x8808, IPv6) pass untouched and are counted in
 * the OTHER slot only.
 *
 * The virtual-queue state is shared by all CPUs and guarded by a
 * bpf_spin_lock in the map value; helpers cannot be called under the lock,
 * so the clock and the random numbers are drawn before taking it and CE is
 * written to the packet after releasing it. See docs/datapath.md.
 *
 * Layouts below are mirrored in testbed/net/portprog.py; the sizes are
 * asserted on both sides (PORTPROG_* constants).
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#define NUM_TC 8
#define OTHER_SLOT NUM_TC              /* state slot of non-IPv4 frames */
#define NUM_SLOTS (NUM_TC + 1)
#define NUM_DSCP 64
#define FP_SHIFT 32                    /* vq and rate: 32.32 fixed point */
#define VQ_MAX_BYTES (1ULL << 31)      /* saturation of a class without a limit */
#define ETH_HLEN_ 14
#define MAX_INGRESS 64                 /* ingress_ifindex slots per class (0: local/unknown) */

/* Configuration of the port (pinned map `cfg`, one entry). */
struct port_cfg {
	__u64 rate_fp;          /* drain rate: wall bytes per ns, 32.32 fixed point */
	__u32 overhead_bytes;   /* added to skb->len per packet (HTB's `overhead`) */
	__u32 default_tc;       /* class of a DSCP whose dscp_tc entry is >= NUM_TC */
};

/* Configuration of one class (pinned map `class_cfg`, NUM_TC entries). */
struct class_cfg {
	__u64 kmin_bytes;
	__u64 kmax_bytes;       /* kmin == kmax: step, mark iff vq > kmin */
	__u64 pmax_fp;          /* probability in units of 2^-32: 1.0 == 1 << 32 */
	__u64 drop_fp;          /* drop probability, same encoding */
	__u64 limit_bytes;      /* leaf buffer; an arrival that would overflow it is
	                         * tail-dropped by the leaf and does not enter the vq.
	                         * 0: no limit */
	__u32 ecn_enabled;
	__u32 pad;
};

/* Pause state of one class (pinned map `pause`, NUM_TC entries), written by
 * user space with BPF_F_LOCK. Cumulative paused time at instant t:
 *   P(t) = paused_total_ns + (paused ? t - since_ns : 0)
 * so the program can drain exactly over the un-paused part of any interval,
 * however many pause/resume pairs happened between two packets.
 * credit_bytes: cumulative bytes the class's gate let out at once when it was
 * closed or opened (a TBF change refills its bucket), which a fluid queue
 * drained at the port rate does not see; the program takes what it has not
 * seen yet off the vq. Without it a port paused thousands of times ran its vq
 * up to the class limit while a few KB were really queued. */
struct pause_state {
	struct bpf_spin_lock lock;
	__u32 paused;
	__u64 since_ns;         /* CLOCK_MONOTONIC of the last change */
	__u64 paused_total_ns;  /* paused time accumulated before since_ns */
	__u64 credit_bytes;     /* cumulative; written by user space only */
};

/* State and counters of one class (pinned map `state`, NUM_SLOTS entries). */
struct class_state {
	struct bpf_spin_lock lock;
	__u32 pad;
	__u64 vq_fp;            /* virtual queue after the last update, bytes 32.32 */
	__u64 last_ns;          /* CLOCK_MONOTONIC of the last update */
	__u64 paused_seen_ns;   /* P(last_ns) */
	__u64 packets;          /* arrivals, drops included */
	__u64 bytes;            /* skb->len of arrivals, drops included */
	__u64 ect_packets;      /* arrivals with ECT(0) or ECT(1) */
	__u64 ce_arrivals;      /* arrivals already CE */
	__u64 ce_marks;         /* ECT -> CE done here */
	__u64 would_mark;       /* non-ECT arrivals the curve picked (not changed) */
	__u64 drops;            /* TC_ACT_SHOT by drop_fp */
	__u64 vq_overflows;     /* arrivals the leaf limit keeps out of the vq */
	__u64 max_vq_bytes;     /* largest vq right after an arrival */
	__u64 mark_errors;      /* bpf_skb_ecn_set_ce refused an ECT packet */
	__u64 credit_seen;      /* pause.credit_bytes already taken off the vq */
};

_Static_assert(sizeof(struct port_cfg) == 16, "PORTPROG_PORT_CFG_SIZE");
_Static_assert(sizeof(struct class_cfg) == 48, "PORTPROG_CLASS_CFG_SIZE");
_Static_assert(sizeof(struct pause_state) == 32, "PORTPROG_PAUSE_SIZE");
_Static_assert(sizeof(struct class_state) == 120, "PORTPROG_STATE_SIZE");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct port_cfg);
} cfg SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, NUM_DSCP);
	__type(key, __u32);
	__type(value, __u32);
} dscp_tc SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, NUM_TC);
	__type(key, __u32);
	__type(value, struct class_cfg);
} class_cfg SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, NUM_TC);
	__type(key, __u32);
	__type(value, struct pause_state);
} pause SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, NUM_SLOTS);
	__type(key, __u32);
	__type(value, struct class_state);
} state SEC(".maps");

/* Bytes each ingress port put into each class's queue (pinned map `ingress`,
 * key tc * MAX_INGRESS + ingress_ifindex): the PFC agent attributes the
 * queue to the ports that fed it. Slot 0 takes locally sent packets. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, NUM_TC * MAX_INGRESS);
	__type(key, __u32);
	__type(value, __u64);
} ingress SEC(".maps");

static __always_inline void count_other(struct __sk_buff *skb)
{
	__u32 key = OTHER_SLOT;
	struct class_state *st = bpf_map_lookup_elem(&state, &key);

	if (st) {
		__sync_fetch_and_add(&st->packets, 1);
		__sync_fetch_and_add(&st->bytes, skb->len);
	}
}

SEC("tc")
int port_egress(struct __sk_buff *skb)
{
	__u32 zero = 0, tc;
	__u8 hdr[2];                /* version/IHL, TOS */

	if (skb->protocol != bpf_htons(ETH_P_IP) ||
	    bpf_skb_load_bytes(skb, ETH_HLEN_, hdr, sizeof(hdr)) < 0 ||
	    (hdr[0] >> 4) != 4) {
		count_other(skb);
		return TC_ACT_OK;
	}

	struct port_cfg *pc = bpf_map_lookup_elem(&cfg, &zero);
	if (!pc)
		return TC_ACT_OK;
	__u32 dscp = hdr[1] >> 2;
	__u32 ecn = hdr[1] & 3;
	__u32 *mapped = bpf_map_lookup_elem(&dscp_tc, &dscp);
	tc = mapped ? *mapped : NUM_TC;
	if (tc >= NUM_TC)
		tc = pc->default_tc;
	if (tc >= NUM_TC)
		tc = 0;

	struct class_cfg *cc = bpf_map_lookup_elem(&class_cfg, &tc);
	struct pause_state *ps = bpf_map_lookup_elem(&pause, &tc);
	struct class_state *st = bpf_map_lookup_elem(&state, &tc);
	if (!cc || !ps || !st)
		return TC_ACT_OK;

	/* Everything that needs a helper happens before the lock. */
	__u64 now = bpf_ktime_get_ns();
	__u32 r_drop = cc->drop_fp ? bpf_get_prandom_u32() : 0;
	__u32 r_mark = cc->ecn_enabled ? bpf_get_prandom_u32() : 0;
	__u64 rate_fp = pc->rate_fp;
	__u64 wire = (__u64)skb->len + pc->overhead_bytes;
	__u64 kmin = cc->kmin_bytes, kmax = cc->kmax_bytes, pmax_fp = cc->pmax_fp;
	__u64 drop_fp = cc->drop_fp, limit = cc->limit_bytes;
	__u32 ecn_enabled = cc->ecn_enabled;

	bpf_spin_lock(&ps->lock);
	__u64 paused_now = ps->paused_total_ns;
	if (ps->paused && now > ps->since_ns)
		paused_now += now - ps->since_ns;
	__u64 credit = ps->credit_bytes;
	bpf_spin_unlock(&ps->lock);

	int mark = 0, shot = 0, queued = 0;

	bpf_spin_lock(&st->lock);
	/* Drain over the un-paused part of (last_ns, now]. Another CPU may have
	 * updated with a later timestamp than ours: never go back in time. */
	__u64 elapsed = now > st->last_ns ? now - st->last_ns : 0;
	__u64 dpaused = paused_now > st->paused_seen_ns ? paused_now - st->paused_seen_ns : 0;
	__u64 active = elapsed > dpaused ? elapsed - dpaused : 0;
	if (active && rate_fp) {
		if (active >= ~0ULL / rate_fp || active * rate_fp >= st->vq_fp)
			st->vq_fp = 0;
		else
			st->vq_fp -= active * rate_fp;
	}
	if (now > st->last_ns)
		st->last_ns = now;
	if (paused_now > st->paused_seen_ns)
		st->paused_seen_ns = paused_now;
	if (credit > st->credit_seen) {
		__u64 dcredit = credit - st->credit_seen;
		if (dcredit >= (st->vq_fp >> FP_SHIFT))
			st->vq_fp = 0;
		else
			st->vq_fp -= dcredit << FP_SHIFT;
		st->credit_seen = credit;
	}

	st->packets += 1;
	st->bytes += skb->len;
	if ((__u64)r_drop < drop_fp) {
		st->drops += 1;
		shot = 1;
	} else {
		__u64 vq = st->vq_fp >> FP_SHIFT;      /* backlog ahead of this packet */
		if (ecn_enabled) {
			if (vq > kmax)
				mark = 1;
			else if (vq > kmin)            /* here kmin < vq <= kmax */
				/* r / 2^32 < pmax (vq - kmin) / (kmax - kmin), in integers;
				 * kmax - kmin < 2^31 and pmax_fp <= 2^32 keep it in 64 bits */
				mark = (__u64)r_mark * (kmax - kmin) < pmax_fp * (vq - kmin);
		}
		if (limit && vq + wire > limit) {
			st->vq_overflows += 1;
		} else {
			queued = 1;
			if (vq + wire > VQ_MAX_BYTES)
				st->vq_fp = VQ_MAX_BYTES << FP_SHIFT;
			else
				st->vq_fp += wire << FP_SHIFT;
		}
		vq = st->vq_fp >> FP_SHIFT;
		if (vq > st->max_vq_bytes)
			st->max_vq_bytes = vq;
		if (ecn == 1 || ecn == 2) {
			st->ect_packets += 1;
		} else {
			if (ecn == 3)
				st->ce_arrivals += 1;
			else if (mark)
				st->would_mark += 1;
			mark = 0;
		}
	}
	bpf_spin_unlock(&st->lock);

	if (shot)
		return TC_ACT_SHOT;
	if (queued) {
		__u32 in = skb->ingress_ifindex;
		__u32 key = tc * MAX_INGRESS + (in < MAX_INGRESS ? in : 0);
		__u64 *cnt = bpf_map_lookup_elem(&ingress, &key);
		if (cnt)
			__sync_fetch_and_add(cnt, wire);
	}
	if (mark) {
		if (bpf_skb_ecn_set_ce(skb))
			__sync_fetch_and_add(&st->ce_marks, 1);
		else
			__sync_fetch_and_add(&st->mark_errors, 1);
	}
	return TC_ACT_OK;
}

char LICENSE[] SEC("license") = "GPL";
