"""Synthetic run directories of sized flows (kind: flows), as `testbed run` leaves them
(docs/run-format.md): plan, config, summary and a counters database holding the flows
and a few port counters. Shared by the FCT report and `testbed compare` tests."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from testbed.config import load_config_text
from testbed.plan import compile_plan
from testbed.results.store import Sample, Store
from testbed.workloads.base import FlowRecord

CONFIG = """\
name: flows
dilation: 1000
topology: {kind: single_switch, hosts: 4, host_link: {port: 100GBASE-CR1, length: 2m}}
"""
PERIOD_NS = 10_000


def flow(flow_id: int, size: int, fct: int | None, ideal: int = 1000, *, start: int = 0,
         src: str = "h1", dst: str = "h4", workload: str = "bg") -> FlowRecord:
    return FlowRecord(workload=workload, flow_id=flow_id, src=src, dst=dst,
                      src_ip="198.18.0.1", dst_ip="198.18.0.7", sport=10000 + flow_id,
                      dport=4791, size_bytes=size, start_ns=start, fct_ns=fct,
                      ideal_fct_ns=ideal, tc=3)


def make_flow_run(root: Path, name: str, records: Sequence[FlowRecord], *, cc: str = "dcqcn",
                  pause_tx: int = 0, pause_rx: int = 0, ecn_marks: int = 0,
                  backlog_bytes: Sequence[int] = (0,), store: bool = True) -> Path:
    """A run directory named <time>-<name>: sw1:swp4 (to h4, class 3) held `backlog_bytes`
    over successive samples, sent `pause_tx` pause frames and marked `ecn_marks`; h4 sent
    none and received `pause_rx`. `store`=False: no database, results/flows.csv only."""
    plan = compile_plan(load_config_text(CONFIG, "flows.yaml"),
                        max_wall_port_rate_bps=200_000_000)
    run_dir = root / f"20261129T120501Z-{name}"
    run_dir.mkdir(mode=0o700)
    (run_dir / "plan.json").write_text(plan.to_json())
    (run_dir / "config.yaml").write_text(
        CONFIG + "workload:\n  traffic:\n"
        f"    - {{name: bg, kind: flows, cc: {cc}, generate: {{distribution: web_search, "
        "load: 0.3, duration: 1ms}}\n")
    hot, h4 = ("sw1", "swp4", 3), ("h4", "eth0", 3)
    if store:
        with Store(run_dir / "counters.sqlite", create=True) as db:
            db.set_meta("lab", plan.lab)
            for i, q in enumerate(backlog_bytes):
                last = i == len(backlog_bytes) - 1
                db.add_samples(i * PERIOD_NS, i * PERIOD_NS * 1000, [
                    Sample(*hot, "backlog_bytes", q), Sample(*h4, "backlog_bytes", 0),
                    Sample(*hot, "pause_tx", pause_tx if last else 0),
                    Sample(*h4, "pause_rx", pause_rx if last else 0),
                    Sample(*hot, "ecn_marks", ecn_marks if last else 0)], final=last)
            db.add_flows(records)
    else:
        from testbed.results.flows import write_flow_files

        write_flow_files(run_dir, records)
    ports = [{"node": "sw1", "port": "swp4", "tclass": 3, "tx_bytes": 1, "pause_tx": pause_tx,
              "pause_rx": 0, "ecn_marks": ecn_marks, "max_queue_bytes": max(backlog_bytes)},
             {"node": "h4", "port": "eth0", "tclass": 3, "tx_bytes": 1, "pause_tx": 0,
              "pause_rx": pause_rx, "ecn_marks": 0, "max_queue_bytes": 0}]
    (run_dir / "summary.json").write_text(json.dumps({
        "format_version": 1, "name": name, "lab": plan.lab, "run_dir": f"runs/{run_dir.name}",
        "dilation": 1000, "duration_fabric_ns": PERIOD_NS * (len(backlog_bytes) - 1),
        "duration_wall_s": 1.0, "interrupted": False, "ports": ports,
        "workloads": [{"name": "bg", "kind": "flows", "results": []}],
        "totals": {}, "fidelity": [], "verdict": None}))
    return run_dir
