"""summary.json's tables from a run's counters: per-port rows, workload entries and the
totals. Pure over a Store; the run builds its summary with them and the report rebuilds
a lost summary with the same functions."""

from __future__ import annotations

from testbed.plan.model import Plan
from testbed.results.store import Store

#: what drops a packet at a port: the port program's refusals (tail: the port's buffer;
#: mmu: the switch's shared buffer; desc: the packet descriptors) and PHY/impairment loss
#: (bpf_drops), and the kernel's qdisc (class_drops, which the program's tail drop leaves
#: at 0 unless something is wrong)
QUEUE_DROP_COUNTERS = ("tail_drops", "mmu_drops", "desc_drops", "class_drops")
PHY_DROP_COUNTERS = ("bpf_drops",)
DROP_COUNTERS = (*QUEUE_DROP_COUNTERS, *PHY_DROP_COUNTERS)
#: packets cut at a port instead of dropped (UET trimming): the class counts `trims` (not
#: drops: the short packet goes on, in the trim class); `trim_errors` are trims that
#: could not be cut and were dropped (counted here in `drops`, as queue drops)
TRIM_COUNTERS = ("trims", "trim_errors")


def port_rows(plan: Plan | None, store: Store) -> list[dict]:
    """One row per egress port and class: totals over the run, zero where a feature is off.

    `drops` counts every packet dropped at the port: `queue_drops` (tail, shared buffer,
    descriptors, qdisc) plus `phy_drops` (PHY frame loss, impairments). `max_queue_bytes`
    is the largest real queue: the port program's exact peak (`max_vq_bytes`) where it
    ran, else the largest sampled qdisc backlog. `trims`: UET packets this class cut and
    sent on in its trim class instead of queueing them (0 where it does not trim); they are
    not drops. Without a plan (a rebuilt report of a
    run whose plan is lost), the ports are the ones the store has samples of.
    """
    counters = ("class_bytes", "class_packets", "ecn_marks", "pause_tx", "pause_rx",
                "paused_ns", "max_vq_bytes", *DROP_COUNTERS, *TRIM_COUNTERS)
    last = {c: store.last_values(c) for c in counters}
    max_backlog: dict[tuple[str, str, int], float] = {}
    for key, series in store.series("backlog_bytes").items():
        max_backlog[key] = max(v for _, v in series)
    keys: set[tuple[str, str, int]]
    if plan is not None:
        keys = {(node.name, iface.ifname, cls.tc) for node in plan.nodes
                for iface in node.interfaces for cls in iface.egress.classes}
    else:
        keys = set(max_backlog) | {k for values in last.values() for k in values if k[2] >= 0}
    rows = []
    for key in keys:
        v = {c: int(last[c].get(key, 0)) for c in counters}
        queue_drops = sum(v[c] for c in QUEUE_DROP_COUNTERS) + v["trim_errors"]
        phy_drops = sum(v[c] for c in PHY_DROP_COUNTERS)
        rows.append({
            "node": key[0], "port": key[1], "tclass": key[2],
            "tx_bytes": v["class_bytes"],
            "tx_packets": v["class_packets"],
            "drops": queue_drops + phy_drops,
            "queue_drops": queue_drops,
            "phy_drops": phy_drops,
            "ecn_marks": v["ecn_marks"],
            "trims": v["trims"],
            "pause_tx": v["pause_tx"],
            "pause_rx": v["pause_rx"],
            "paused_ns": v["paused_ns"],
            "max_queue_bytes": max(v["max_vq_bytes"], int(max_backlog.get(key, 0))),
        })
    rows.sort(key=lambda r: (r["node"], r["port"], r["tclass"]))
    return rows


def workload_rows(results: list[dict]) -> list[dict]:
    """Group the store's result rows into `workloads` entries, in first-seen order."""
    out: dict[str, dict] = {}
    for row in results:
        entry = out.setdefault(row["workload"], {"name": row["workload"], "kind": row["kind"],
                                                 "results": []})
        entry["results"].append({k: v for k, v in row.items() if k not in ("workload", "kind")})
    return list(out.values())


def totals(ports: list[dict], delivered_bytes: int) -> dict:
    """summary.json's `totals`: sums over every port row, and what receivers got."""
    return {
        "tx_bytes": sum(r["tx_bytes"] for r in ports),
        "drops": sum(r["drops"] for r in ports),
        "queue_drops": sum(r.get("queue_drops", r["drops"]) for r in ports),
        "phy_drops": sum(r.get("phy_drops", 0) for r in ports),
        "ecn_marks": sum(r["ecn_marks"] for r in ports),
        "trims": sum(r.get("trims", 0) for r in ports),
        "pause_frames": sum(r["pause_tx"] for r in ports),
        "delivered_bytes": delivered_bytes,
    }


def link_rows(plan: Plan | None, ports: list[dict]) -> list[dict]:
    """What each link carried, per direction, from the egress ports' byte counters (every
    class): the bytes a collective or a flow really put on host links and on switch-to-
    switch links, whatever its bus-bandwidth figure says. `kind` is `host` for a link
    with a host end, else `fabric`."""
    if plan is None:
        return []
    sent: dict[tuple[str, str], int] = {}
    for p in ports:
        key = (p["node"], p["port"])
        sent[key] = sent.get(key, 0) + int(p.get("tx_bytes") or 0)
    roles = {n.name: n.role for n in plan.nodes}
    out = []
    for link in plan.links:
        a, b = link.a, link.b
        out.append({
            "a": f"{a.node}:{a.ifname}", "b": f"{b.node}:{b.ifname}",
            "kind": "host" if "host" in (roles.get(a.node), roles.get(b.node)) else "fabric",
            "rate_bps": link.rate_bps,
            "a_to_b_bytes": sent.get((a.node, a.ifname), 0),
            "b_to_a_bytes": sent.get((b.node, b.ifname), 0),
        })
    return out


def link_totals(links: list[dict]) -> dict:
    """Bytes carried by host links and by fabric (switch-to-switch) links, both ways."""
    out = {"host_link_bytes": 0, "fabric_link_bytes": 0}
    for link in links:
        out[f"{link['kind']}_link_bytes"] += link["a_to_b_bytes"] + link["b_to_a_bytes"]
    return out
