"""A fault timeline from the config's `events:`, end to end: compiled by the plan,
applied by the run at its times, every event a `fault` record, nothing unexplained.

A flap of leaf1-spine1 (the plan's own converged tables) and, with PFC on, a rate
change of the same link, whose PFC gates the PFC agent re-opens at the new rate.
Skipped where the config has no `events:` yet, or the PFC agent takes no commands.
"""

from __future__ import annotations

import json

import pytest

from testbed.config import load_config_text
from testbed.plan import compile_plan
from testbed.results.store import Store
from testbed.run.runner import RunOptions, run_config
from tests.conftest import unique_lab
from tests.integration.timeline_helpers import (
    PERIOD_NS,
    assert_no_lab_left,
    fault_events,
    rate_bps_between,
)

pytestmark = [pytest.mark.root, pytest.mark.slow]

CONFIG = """\
name: {lab}
dilation: 1000
topology:
  kind: leaf_spine
  spines: 2
  leaves: 2
  hosts_per_leaf: 1
  host_link: {{port: 100GBASE-CR1, length: 2m}}
  fabric_link: {{port: 100GBASE-CR1, length: 2m}}
events:
  - {{at: 3ms, kind: link_down, link: [leaf1, spine1], converge: 200us}}
  - {{at: 4ms, kind: link_up, link: [leaf1, spine1]}}
  - {{at: 5ms, kind: rate, link: [leaf2, spine2], rate: 25Gbps}}
workload:
  sample_period: 100us
  traffic:
    - {{name: flows, kind: udp_pairs, pairs: [[h1, h2], [h2, h1]], tclass: roce,
       rate: 40Gbps, flows: 8, start: 1ms, duration: 6ms}}
"""


def test_a_configured_timeline_is_applied_recorded_and_accounted(tmp_path):
    loaded = load_config_text(CONFIG.format(lab=unique_lab("tlcfg")), "timeline.yaml")
    plan = compile_plan(loaded)
    assert [e.kind for e in plan.events] == ["link_down", "link_up", "rate"]
    try:
        result = run_config(loaded, plan, RunOptions(runs_root=tmp_path, say=lambda _m: None))
    finally:
        assert_no_lab_left(plan.lab)
    summary = json.loads((result.run_dir / "summary.json").read_text())
    with Store(result.run_dir / "counters.sqlite") as store:
        faults = fault_events(store)
        assert [(f["event_kind"], f["phase"]) for f in faults] == [
            ("link_down", "applied"), ("link_down", "converged"), ("link_up", "applied"),
            ("link_up", "converged"), ("rate", "applied")]
        rate = faults[-1]
        assert all(c["gates_by_agent"] for c in rate["changes"])
        port = next(i.ifname for i in plan.node("leaf2").interfaces if i.peer.node == "spine2")
        t = rate["ts_fabric_ns"] + rate["took_ns"] + PERIOD_NS
        # whatever leaf2 sends to spine2 from then on stays within the new 25 Gb/s
        assert rate_bps_between(store, "leaf2", port, t, 7_000_000) < 25e9 * 1.1
    assert not [n for n in summary["fidelity"] if "could not be" in n]
    bad = [v for v in summary["invariants"]["violations"]
           if v["invariant"] in ("conservation", "lossless_drop", "reorder")]
    assert not bad, bad
