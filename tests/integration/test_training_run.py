"""`testbed run` of a training step end to end, without and with a competing incast: four
ranks on a leaf-spine fabric all-reduce two gradient buckets per step, overlapped with
backward; a line-rate UDP incast from the two other hosts into rank 0's host (on the
lossless RoCE class, PFC on) congests the ring's hop into that host. The gradients stay
exact, and the communication the compute cannot hide grows, with CNPs to show it was the
fabric."""

from __future__ import annotations

import time

import pytest

from testbed.config import load_config_text
from testbed.net.namespaces import list_testbed_namespaces
from testbed.plan import compile_plan
from testbed.run.runner import RunOptions, run_config
from tests.conftest import unique_lab

pytestmark = pytest.mark.root

# leaf1: h1 h2 h3, leaf2: h4 h5 h6; the ring h1 -> h2 -> h4 -> h5 -> h1 crosses the
# spines twice, and its last hop ends on h1's port, where the incast converges.
FABRIC = """\
name: {lab}
dilation: 1000
topology:
  kind: leaf_spine
  spines: 2
  leaves: 2
  hosts_per_leaf: 3
  host_link: {{port: 100GBASE-CR1, length: 2m}}
  fabric_link: {{port: 400GBASE-DR4, length: 100m}}
qos:
  default:
    pfc: {{enabled: true}}
workload:
  traffic:
    - {{name: step, kind: training, algorithm: ring, ranks: [h1, h2, h4, h5],
       buckets: [256KiB, 256KiB], compute: {{forward: 20us, backward: 60us}},
       overlap: true, warmup: 1, iterations: 2, qps: 1, chunk: 64KiB}}
{incast}"""
# 2 x 100G of UDP into h1's 100G port through every step (the three steps take about
# 0.4 ms of fabric time without it, 3.5 ms with it), ECN-capable so the switches mark it.
INCAST = """\
    - {name: incast, kind: udp_incast, senders: [h3, h6], receiver: h1, tclass: roce,
       ecn: ect0, duration: 6ms}
"""


def _run(tmp_path, stem: str, incast: str) -> dict:
    lab = unique_lab(stem)
    loaded = load_config_text(FABRIC.format(lab=lab, incast=incast), f"{stem}.yaml")
    result = run_config(loaded, compile_plan(loaded),
                        RunOptions(runs_root=tmp_path / stem, say=lambda _m: None))
    assert not [ns for ns in list_testbed_namespaces() if ns.startswith(f"tb-{lab}-")]
    (row,) = [r for w in result.summary["workloads"] if w["name"] == "step"
              for r in w["results"]]
    return row


def test_a_competing_incast_leaves_more_of_the_training_steps_communication_exposed(
        tmp_path) -> None:
    began = time.monotonic()
    quiet = _run(tmp_path, "trq", "")
    loud = _run(tmp_path, "trl", INCAST)
    for row in (quiet, loud):
        assert row["error"] is None, row
        assert row["wrong"] == 0 and row["iterations"] == 2, row
        assert row["compute_us"] == 80.0 and len(row["bucket_us"]) == 2
        # overlap leaves at least the last bucket's all-reduce exposed
        assert row["exposed_us"] > 0 and row["exposed_ideal_us"] > 0
        assert row["iteration_us"] == pytest.approx(row["compute_us"] + row["exposed_us"],
                                                    abs=0.01)
    assert loud["exposed_us"] > quiet["exposed_us"], (quiet, loud)
    assert loud["cnps"] > 0 and loud["ecn_marked"] > 0, loud
    print(f"\ntraining step without / with incast: step {quiet['iteration_us']} / "
          f"{loud['iteration_us']} us, exposed {quiet['exposed_us']} / {loud['exposed_us']} "
          f"us (line rate {quiet['exposed_ideal_us']}), CNPs {quiet['cnps']} / "
          f"{loud['cnps']}, rate cuts {quiet['rate_cuts']} / {loud['rate_cuts']}; "
          f"{time.monotonic() - began:.0f} s wall")
