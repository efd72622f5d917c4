"""One VM's part of a placed plan (testbed/plan/part.py): its nodes and its tunnel ends."""

from __future__ import annotations

import pytest

from testbed.config import load_config
from testbed.config.vms import load_vms
from testbed.plan import compile_plan
from testbed.plan.part import part_plan
from testbed.plan.partition import partition
from tests.conftest import REPO

BUDGET_BPS = 200_000_000


def _placed():
    plan = compile_plan(load_config(REPO / "tests/golden/default.yaml"),
                        max_wall_port_rate_bps=BUDGET_BPS)
    vms = load_vms(REPO / "configs/examples/vms-two.yaml").vms_file
    return plan, partition(plan, vms)


def test_parts_cover_every_node_once_and_each_cut_link_from_both_sides() -> None:
    plan, placement = _placed()
    parts = [part_plan(plan, placement, vm.name) for vm in placement.vms]
    nodes = [n for p in parts for n in p.nodes]
    assert sorted(nodes) == sorted(n.name for n in plan.nodes)
    ends = sorted((t.link, t.local.node) for p in parts for t in p.tunnels)
    want = sorted((t.link, e.node) for t in placement.tunnels for e in (t.a, t.b))
    assert ends == want and ends
    for p in parts:
        for t in p.tunnels:
            assert t.local.node in p.nodes and t.remote.node not in p.nodes
            assert t.vni == placement.vni_base + t.link
            assert t.local.underlay != t.remote.underlay
        local = set(p.local_links)
        tunnel = {t.link for t in p.tunnels}
        touching = {li.index for li in plan.links if li.a.node in p.nodes or li.b.node in p.nodes}
        assert local | tunnel == touching and not local & tunnel


def test_unknown_vm_is_refused_naming_the_known_ones() -> None:
    plan, placement = _placed()
    with pytest.raises(ValueError, match="vm1"):
        part_plan(plan, placement, "vm9")
