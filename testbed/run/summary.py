"""Build summary.json (docs/run-format.md) from a run's store and agent results."""

from __future__ import annotations

from testbed.plan.model import Plan
from testbed.run.rundir import RUN_FORMAT_VERSION
from testbed.run.store import Store


def port_rows(plan: Plan, store: Store) -> list[dict]:
    """One row per egress port and class: totals over the run, zero where a feature is off."""
    last = {c: store.last_values(c) for c in
            ("class_bytes", "class_packets", "class_drops", "ecn_marks", "pause_tx",
             "pause_rx", "paused_ns")}
    max_backlog: dict[tuple[str, str, int], float] = {}
    for key, series in store.series("backlog_bytes").items():
        max_backlog[key] = max(v for _, v in series)
    rows = []
    for node in plan.nodes:
        for iface in node.interfaces:
            for cls in iface.egress.classes:
                key = (node.name, iface.ifname, cls.tc)
                rows.append({
                    "node": node.name, "port": iface.ifname, "tclass": cls.tc,
                    "tx_bytes": int(last["class_bytes"].get(key, 0)),
                    "tx_packets": int(last["class_packets"].get(key, 0)),
                    "drops": int(last["class_drops"].get(key, 0)),
                    "ecn_marks": int(last["ecn_marks"].get(key, 0)),
                    "pause_tx": int(last["pause_tx"].get(key, 0)),
                    "pause_rx": int(last["pause_rx"].get(key, 0)),
                    "paused_ns": int(last["paused_ns"].get(key, 0)),
                    "max_queue_bytes": int(max_backlog.get(key, 0)),
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
        "ecn_marks": sum(r["ecn_marks"] for r in ports),
        "pause_frames": sum(r["pause_tx"] for r in ports),
        "delivered_bytes": delivered_bytes,
    }


def build_summary(*, name: str, plan: Plan, store: Store, run_dir: str, duration_fabric_ns: int,
                  duration_wall_s: float, interrupted: bool, fidelity: list[str],
                  verdict: dict | None = None, extra: dict | None = None) -> dict:
    ports = port_rows(plan, store)
    workloads = workload_rows(store.results())
    delivered = sum(r.get("rx_bytes", 0) for w in workloads for r in w["results"])
    return {
        "format_version": RUN_FORMAT_VERSION,
        "name": name,
        "lab": plan.lab,
        "run_dir": run_dir,
        "dilation": plan.dilation.factor,
        "duration_fabric_ns": int(duration_fabric_ns),
        "duration_wall_s": round(duration_wall_s, 3),
        "interrupted": interrupted,
        "ports": ports,
        "workloads": workloads,
        "totals": totals(ports, delivered),
        "fidelity": fidelity,
        "verdict": verdict,
        **(extra or {}),
    }
