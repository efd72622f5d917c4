"""`testbed run` of a ring all-reduce with `transport: uet`: the collectives suite's ring
(configs/collectives/allreduce-ring.yaml) on its fabric, the default leaf-spine, over each
host's Ultra Ethernet NIC in a lossy class that marks ECN and trims (into the strict cnp
class). Every size is checked against the exact sum, algbw is reported, the data went as
UET packets sprayed over several source ports, 1 % loss on one of leaf1's uplinks was
made good by selective retransmission with every lost packet accounted for, and, the
class being lossy, no PFC pause was sent anywhere."""

from __future__ import annotations

import json

import pytest

from testbed.config import load_config_text
from testbed.net.namespaces import list_testbed_namespaces
from testbed.plan import compile_plan
from testbed.run.runner import RunOptions, run_config
from tests.conftest import unique_lab

pytestmark = pytest.mark.root

# allreduce-ring.yaml's fabric and dilation (plus 1 % loss on leaf1-spine1); smaller sizes
# and fewer iterations, so the eight Python ranks finish well inside the test's minute on
# a shared 2-core VM.
FABRIC = """\
name: {lab}
dilation: 4000
topology:
  kind: leaf_spine
  spines: 2
  leaves: 2
  hosts_per_leaf: 4
  host_link: {{port: 100GBASE-CR1, length: 2m}}
  fabric_link: {{port: 400GBASE-DR4, length: 100m}}
impairments:
  - {{link: [leaf1, spine1], loss: 0.01}}
traffic_classes:
  - {{tc: 3, name: roce, dscp: [26], lossless: true, ecn: true, weight: 1}}
  - {{tc: 2, name: lossy, dscp: [10], ecn: true, trim: true, weight: 1}}
  - {{tc: 6, name: cnp, dscp: [48], strict: true}}
  - {{tc: 0, name: default, dscp: [], weight: 1, default: true}}
workload:
  traffic:
    - {{name: allreduce, kind: allreduce, algorithm: ring,
       ranks: [h1, h2, h3, h4, h5, h6, h7, h8], transport: uet, tclass: lossy,
       cc: nscc, entropy: spray, entropies: 16,
       sizes: {{min: {min}, max: {max}, factor: 4}}, chunk: 256KiB, warmup: 1,
       iterations: 2}}
"""


def test_ring_all_reduce_over_uet_on_a_lossy_ecn_class_is_exact_under_loss(tmp_path) -> None:
    lab = unique_lab("coluet")
    loaded = load_config_text(FABRIC.format(lab=lab, min="256KiB", max="1MiB"),
                              "collectives-uet.yaml")
    result = run_config(loaded, compile_plan(loaded),
                        RunOptions(runs_root=tmp_path, say=lambda _m: None))
    assert not [ns for ns in list_testbed_namespaces() if ns.startswith(f"tb-{lab}-")]
    summary = result.summary
    (entry,) = summary["workloads"]
    rows = entry["results"]
    assert [r["bytes"] for r in rows] == [256 << 10, 1 << 20]
    for row in rows:
        assert row["error"] is None, row
        assert row["wrong"] == 0 and row["time_us"] > 0 and len(row["iterations_us"]) == 2
        assert row["algbw_gbps"] > 0
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * 2 * 7 / 8, rel=1e-3)
        print(f"uet ring {row['bytes']} B: {row['time_us']} us, algbw "
              f"{row['algbw_gbps']} GB/s, busbw {row['busbw_gbps']} GB/s")
    assert not [n for n in summary["fidelity"] if "collective rank" in n], summary["fidelity"]
    doc = json.loads((result.run_dir / "results" / "allreduce.nccl.json").read_text())
    assert doc["out_of_bounds"]["count"] == 0
    agents = result.run_dir / "agents"
    ranks = [json.loads((agents / f"allreduce-r{r}.json").read_text()) for r in range(8)]
    for rank in ranks:
        c = rank["counters"]
        assert c["transport"] == "uet" and rank["error"] is None
        assert c["tx_packets"] > 0 and c["bytes_sent"] == c["bytes_posted"] > 0
        assert c["settings"]["options"]["trim_dscp"] == 48     # cnp's: trims go there
        sports = (c["uet"].get("totals") or {}).get("sports") or {}
        assert len(sports) > 1, sports          # sprayed over several entropies
    retx = sum(r["counters"]["retransmissions"] for r in ranks)
    print("retransmissions", retx, "ecn", sum(r["counters"].get("ecn_received", 0)
                                             for r in ranks),
          "phy drops", summary["totals"]["phy_drops"],
          "trims", sum(r["counters"].get("trims_received", 0) for r in ranks))
    # the ring's h4 -> h5 and h8 -> h1 are sprayed over both spines: spine1's loss hits them
    assert summary["totals"]["phy_drops"] > 0 and retx > 0
    assert all(isinstance(row["retransmissions"], int) for row in rows)   # timed runs' share
    # ring neighbours h4 -> h5 and h8 -> h1 cross the spines; a lossy class pauses nothing
    totals = summary["totals"]
    assert totals["host_link_bytes"] > 0 and totals["fabric_link_bytes"] > 0
    checks = summary["invariants"]["checks"]
    assert checks["lossless_drop"]["held"] is not False
    # every datagram between two ranks' NICs sent, received or dropped in the fabric
    assert checks["conservation"]["held"] is True, summary["invariants"]
    streams = summary["invariants"]["streams"]
    assert len(streams) == 8 * 7 and all(s["complete"] for s in streams)
    assert sum(s["sent"] for s in streams) > 0
    assert not totals.get("pause_frames"), totals
