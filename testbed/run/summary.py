"""Build summary.json (docs/run-format.md) from a run's store and agent results."""

from __future__ import annotations

from testbed.plan.model import Plan
from testbed.results.files import RUN_FORMAT_VERSION
from testbed.results.store import Store
from testbed.results.tables import link_rows, link_totals, port_rows, totals, workload_rows


def build_summary(*, name: str, plan: Plan, store: Store, run_dir: str, duration_fabric_ns: int,
                  duration_wall_s: float, interrupted: bool, fidelity: list[str],
                  verdict: dict | None = None, extra: dict | None = None) -> dict:
    ports = port_rows(plan, store)
    links = link_rows(plan, ports)
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
        "links": links,
        "totals": {**totals(ports, delivered), **link_totals(links)},
        "fidelity": fidelity,
        "verdict": verdict,
        **(extra or {}),
    }
