"""`testbed run` of collectives end to end: four ranks on a leaf-spine fabric all-reduce
with ring and double binary tree, every result checked against its exact reference, and
nccl-tests' table and JSON written; the bytes the links carried are in the summary. The
in-network run also leaves the ranks' phase events and the aggregators' slot occupancy
in counters.sqlite, and the report's Collectives section."""

from __future__ import annotations

import json

import pytest

from testbed.config import load_config_text
from testbed.net.namespaces import list_testbed_namespaces
from testbed.plan import compile_plan
from testbed.results.store import Store
from testbed.run.runner import RunOptions, run_config
from testbed.workloads.collective import InaSettings
from tests.conftest import unique_lab

pytestmark = pytest.mark.root

FABRIC = """\
name: {lab}
dilation: 1000
topology:
  kind: leaf_spine
  spines: 2
  leaves: 2
  hosts_per_leaf: 2
  host_link: {{port: 100GBASE-CR1, length: 2m}}
  fabric_link: {{port: 400GBASE-DR4, length: 100m}}
workload:
  traffic:
    - {{name: ring, kind: allreduce, algorithm: ring, ranks: [h1, h2, h3, h4],
       sizes: {{min: 60KiB, max: 240KiB, factor: 4}}, iterations: 2, qps: 2, chunk: 16KiB}}
    - {{name: tree, kind: allreduce, algorithm: tree, dtype: bfloat16, ranks: [h1, h2, h3, h4],
       sizes: {{min: 64KiB, max: 64KiB}}, iterations: 2}}
"""


def test_ring_and_tree_all_reduce_exactly_and_report_as_nccl_tests(tmp_path) -> None:
    lab = unique_lab("col")
    loaded = load_config_text(FABRIC.format(lab=lab), "collectives.yaml")
    result = run_config(loaded, compile_plan(loaded),
                        RunOptions(runs_root=tmp_path, say=lambda _m: None))
    assert not [ns for ns in list_testbed_namespaces() if ns.startswith(f"tb-{lab}-")]
    summary = result.summary
    by_name = {w["name"]: w for w in summary["workloads"]}
    ring, tree = by_name["ring"]["results"], by_name["tree"]["results"]
    assert [r["bytes"] for r in ring] == [61440, 245760] and [r["bytes"] for r in tree] == [65536]
    for row in ring + tree:
        assert row["error"] is None, row
        assert row["wrong"] == 0 and row["time_us"] > 0 and len(row["iterations_us"]) == 2
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * 1.5, rel=1e-3)
    assert not [n for n in summary["fidelity"] if "collective rank" in n]
    doc = json.loads((result.run_dir / "results" / "ring.nccl.json").read_text())
    assert [r["size"] for r in doc["results"]] == [61440, 245760]
    assert doc["out_of_bounds"]["count"] == 0
    text = (result.run_dir / "results" / "tree.nccl.txt").read_text()
    assert "bfloat16" in text and "# Out of bounds values : 0 OK" in text
    # ring all-reduce puts traffic on every host link and, across leaves, on the spines
    totals = summary["totals"]
    assert totals["host_link_bytes"] > 0 and totals["fabric_link_bytes"] > 0
    assert summary["invariants"]["checks"]["lossless_drop"]["held"] is not False


INA = """\
name: {lab}
dilation: 1000
topology:
  kind: leaf_spine
  spines: 2
  leaves: 2
  hosts_per_leaf: 2
  host_link: {{port: 100GBASE-CR1, length: 2m}}
  fabric_link: {{port: 400GBASE-DR4, length: 100m}}
impairments:
  - {{link: [leaf1, spine1], loss: 0.01}}
  - {{link: [leaf1, spine2], loss: 0.01}}
workload:
  traffic:
    - {{name: ina, kind: allreduce, algorithm: ina, ranks: [h1, h2, h3, h4],
       sizes: {{min: 1MiB, max: 1MiB}}, iterations: 2, warmup: 0}}
"""


def test_in_network_all_reduce_through_a_tree_survives_loss(tmp_path) -> None:
    """Leaf aggregators on leaf1 and leaf2 under one on a spine; 1 % loss on leaf1's
    uplinks: the result is exact within the quantisation bound, and the losses show as
    retransmissions."""
    lab = unique_lab("ina")
    loaded = load_config_text(INA.format(lab=lab), "ina.yaml")
    result = run_config(loaded, compile_plan(loaded),
                        RunOptions(runs_root=tmp_path, say=lambda _m: None))
    (row,) = result.summary["workloads"][0]["results"]
    assert row["error"] is None and row["wrong"] == 0 and row["algorithm"] == "ina"
    agents = result.run_dir / "agents"
    ranks = [json.loads((agents / f"ina-r{r}.json").read_text()) for r in range(4)]
    drops = result.summary["totals"]["phy_drops"]
    assert drops > 0
    # a lost request or result is resent by its worker (a lost barrier packet, by RoCE)
    resent = sum(r["counters"]["ina"]["retransmissions"] + r["counters"].get(
        "retransmissions", 0) for r in ranks)
    assert resent > 0
    names = {p.stem for p in agents.glob("ina-agg-*.json")}
    assert names == {"ina-agg-leaf1", "ina-agg-leaf2", "ina-agg-spine1"}
    root = json.loads((agents / "ina-agg-spine1.json").read_text())
    assert root["jobs"]["1"]["partials_received"] >= 2 * 256      # 2 leaves x 256 chunks
    # what the collector sampled and imported: a collective_phase event per rank and
    # iteration (warmup 0, so both are timed), each aggregator's occupancy and pool
    with Store(result.run_dir / "counters.sqlite") as store:
        phases = store.events("collective_phase")
        slots = store.series("aggregator.slots_in_use")
        pools = store.last_values("aggregator.slots")
    assert sorted((e["port"], e["rank"], e["iteration"]) for e in phases) == [
        (f"ina-r{r}", r, i) for r in range(4) for i in range(2)]
    assert all(e["phase"] == "in_network" and e["bytes"] == 1 << 20 and not e["warmup"]
               and e["duration_ns"] > 0 for e in phases)
    assert {e["node"] for e in phases} == {"h1", "h2", "h3", "h4"}
    assert {k[1] for k in slots} == names and set(pools.values()) == {InaSettings().slots}
    print(f"peak slots in use: {max(v for pts in slots.values() for _, v in pts)}")
    html = (result.run_dir / "report.html").read_text()
    section = html[html.index('<section id="collectives">'):]
    section = section[:section.index("</section>")]
    assert "collective phases per rank" in section and "aggregator slot occupancy" in section
    assert "ina-r3" in section and "ina-agg-spine1" in section
