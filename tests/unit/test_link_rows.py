"""summary.json's `links`: what each link carried each way, from the egress ports' byte
counters, so the bytes a collective put on host and leaf-spine links can be compared
across algorithms (busbw cannot do that for tree and in-network ones)."""

from __future__ import annotations

from testbed.config import load_config
from testbed.plan import compile_plan
from testbed.results.tables import link_rows, link_totals
from tests.conftest import REPO


def test_each_link_carries_what_its_two_egress_ports_sent() -> None:
    plan = compile_plan(load_config(REPO / "configs" / "default.yaml"))
    h1 = plan.node("h1").interfaces[0]
    leaf_up = next(i for i in plan.node("leaf1").interfaces if i.peer.node == "spine1")
    ports = [{"node": "h1", "port": h1.ifname, "tclass": 3, "tx_bytes": 1000},
             {"node": "h1", "port": h1.ifname, "tclass": 0, "tx_bytes": 24},
             {"node": h1.peer.node, "port": h1.peer.ifname, "tclass": 3, "tx_bytes": 500},
             {"node": "leaf1", "port": leaf_up.ifname, "tclass": 3, "tx_bytes": 7000}]
    links = link_rows(plan, ports)
    assert len(links) == len(plan.links)
    host = next(lk for lk in links if lk["a"].startswith("h1:") or lk["b"].startswith("h1:"))
    out_of_h1 = host["a_to_b_bytes"] if host["a"].startswith("h1:") else host["b_to_a_bytes"]
    into_h1 = host["b_to_a_bytes"] if host["a"].startswith("h1:") else host["a_to_b_bytes"]
    assert (host["kind"], out_of_h1, into_h1) == ("host", 1024, 500)
    assert link_totals(links) == {"host_link_bytes": 1524, "fabric_link_bytes": 7000}
    assert {lk["kind"] for lk in links} == {"host", "fabric"}
    assert link_rows(None, ports) == []
