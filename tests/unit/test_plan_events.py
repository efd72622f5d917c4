"""The plan of a fault timeline (Plan.events), static routes, DSCP remaps and allow:.

Each test compiles a small leaf-spine from YAML and checks one behaviour of the plan:
routes recomputed around a dead link (and restored exactly), the numbers a loss, rate,
PFC, ECN or host-drain event carries, and what routes:/dscp_remap:/allow: compile into.
"""

from __future__ import annotations

import ipaddress
import json

import pytest

from testbed.config import ConfigError, load_config_text
from testbed.plan import compile_plan
from testbed.plan.model import Plan, RoutePlan

BUDGET_BPS = 200_000_000
FABRIC = """\
name: ev
dilation: {dilation}
topology:
  kind: leaf_spine
  spines: 2
  leaves: 3
  hosts_per_leaf: 2
  host_link: {{port: 100GBASE-CR1, length: 2m}}
  fabric_link: {{port: 400GBASE-DR4, length: 100m}}
"""


def _plan(extra: str = "", dilation: str = "auto") -> Plan:
    text = FABRIC.format(dilation=dilation) + extra
    return compile_plan(load_config_text(text, "ev.yaml"), max_wall_port_rate_bps=BUDGET_BPS)


def _tables(routes: dict[str, list[RoutePlan]]) -> dict[str, dict[str, list[str]]]:
    return {node: {r.dst: [h.ifname for h in r.nexthops] for r in table}
            for node, table in routes.items()}


def _base_tables(plan: Plan) -> dict[str, dict[str, list[str]]]:
    return _tables({n.name: n.routes for n in plan.nodes})


def _ifname(plan: Plan, node: str, peer: str) -> str:
    return next(i.ifname for i in plan.node(node).interfaces if i.peer.node == peer)


def _block(plan: Plan, leaf: str) -> str:
    """The routed block of a leaf's hosts (what the other switches route to it)."""
    host = next(i.peer.node for i in plan.node(leaf).interfaces
                if plan.node(i.peer.node).role == "host")
    address = ipaddress.IPv4Address(plan.node(host).interfaces[0].address.split("/")[0])
    return next(r.dst for r in plan.node("spine1").routes
                if address in ipaddress.IPv4Network(r.dst))


FLAP = """\
events:
  - {at: 4ms, kind: link_up, link: [leaf1, spine1]}
  - {at: 2ms, kind: link_down, link: [leaf1, spine1], converge: 50us}
"""


def test_plan_without_events_has_no_events_key() -> None:
    plan = _plan()
    assert plan.events == []
    assert "events" not in json.loads(plan.to_json())


def test_events_are_sorted_by_time_and_keep_their_config_index() -> None:
    plan = _plan(FLAP)
    assert [(e.index, e.at_ns, e.kind) for e in plan.events] == [
        (1, 2_000_000, "link_down"), (0, 4_000_000, "link_up")]
    down = plan.events[0]
    assert down.target == "leaf1-spine1" and down.converge_ns == 50_000
    assert {(p.node, p.ifname, p.up) for p in down.ports} == {
        ("leaf1", _ifname(plan, "leaf1", "spine1"), False),
        ("spine1", _ifname(plan, "spine1", "leaf1"), False)}
    assert Plan.model_validate_json(plan.to_json()) == plan


def test_leaf_spine_link_down_moves_that_leafs_traffic_off_the_spine() -> None:
    plan = _plan(FLAP)
    base = _base_tables(plan)
    after = _tables(plan.events[0].routes or {})
    leaf1_block = _block(plan, "leaf1")
    via_spine1 = {leaf: _ifname(plan, leaf, "spine1") for leaf in ("leaf1", "leaf2", "leaf3")}
    via_spine2 = {leaf: _ifname(plan, leaf, "spine2") for leaf in ("leaf1", "leaf2", "leaf3")}
    # before: ECMP over both spines everywhere
    for leaf in ("leaf2", "leaf3"):
        assert sorted(base[leaf][leaf1_block]) == sorted([via_spine1[leaf], via_spine2[leaf]])
    # after: the other leaves reach leaf1's hosts over spine2 only ...
    for leaf in ("leaf2", "leaf3"):
        assert after[leaf][leaf1_block] == [via_spine2[leaf]]
        # ... and keep both spines for each other's hosts
        other = _block(plan, "leaf3" if leaf == "leaf2" else "leaf2")
        assert after[leaf][other] == base[leaf][other]
    # leaf1 sends everything over spine2
    for dst, hops in after["leaf1"].items():
        if dst in base["leaf1"] and via_spine1["leaf1"] in base["leaf1"][dst]:
            assert hops == [via_spine2["leaf1"]], dst
    # spine1 reaches leaf1's hosts the long way round, never over the dead link
    assert _ifname(plan, "spine1", "leaf1") not in after["spine1"][leaf1_block]
    assert after["spine1"][leaf1_block]
    # every node has a table in the event, hosts unchanged
    assert set(after) == set(base)
    assert after["h1"] == base["h1"]


def test_link_up_restores_the_original_tables_exactly() -> None:
    plan = _plan(FLAP)
    assert plan.events[1].routes == {n.name: n.routes for n in plan.nodes}


def test_link_downs_add_up_until_each_comes_back() -> None:
    plan = _plan("""\
events:
  - {at: 1ms, kind: link_down, link: [leaf1, spine1]}
  - {at: 2ms, kind: link_down, link: [leaf2, spine2]}
  - {at: 3ms, kind: link_up, link: [leaf1, spine1]}
""")
    second = _tables(plan.events[1].routes or {})
    # both down: leaf1 (spine2 only) and leaf2 (spine1 only) meet through leaf3
    assert second["leaf1"][_block(plan, "leaf2")] == [_ifname(plan, "leaf1", "spine2")]
    third = _tables(plan.events[2].routes or {})
    alone = _tables(_plan("""\
events:
  - {at: 2ms, kind: link_down, link: [leaf2, spine2]}
""").events[0].routes or {})
    assert third == alone


def test_loss_event_combines_phy_loss_with_the_new_loss_in_its_direction() -> None:
    plan = _plan("""\
events:
  - {at: 1ms, kind: loss, link: [leaf1, spine1], direction: forward, loss: 0.01, cause: corruption}
""")
    ev = plan.events[0]
    phy = next(link for link in plan.links
               if {link.a.node, link.b.node} == {"leaf1", "spine1"}).frame_loss_ratio
    assert [(p.node, p.ifname) for p in ev.ports] == [("leaf1", _ifname(plan, "leaf1", "spine1"))]
    assert ev.ports[0].loss_probability == pytest.approx(1 - (1 - phy) * (1 - 0.01))
    assert "corruption" in ev.description


def test_rate_event_by_lanes_recomputes_the_egress_and_keeps_thresholds() -> None:
    plan = _plan("""\
events:
  - {at: 1ms, kind: rate, link: [leaf1, spine1], lanes: 3}
""")
    ev = plan.events[0]
    assert len(ev.ports) == 2
    for port in ev.ports:
        before = next(i.egress for i in plan.node(port.node).interfaces
                      if i.ifname == port.ifname)
        after = port.egress
        assert after is not None
        assert after.rate_bps == 300_000_000_000            # 3 of 400GBASE-DR4's 4 lanes
        assert after.wall_rate_bps == plan.timebase.to_wall_bps(300_000_000_000)
        assert after.wall_rate_bps < before.wall_rate_bps
        for old, new in zip(before.classes, after.classes, strict=True):
            assert (new.ecn, new.pfc, new.limit_bytes, new.dscp) == (
                old.ecn, old.pfc, old.limit_bytes, old.dscp)
            assert new.wall_ceil_bps == after.wall_rate_bps
            assert new.wall_rate_bps <= old.wall_rate_bps


def test_a_rate_event_lowering_a_rate_does_not_change_auto_dilation() -> None:
    without = _plan()
    with_rate = _plan("""\
events:
  - {at: 1ms, kind: rate, link: [leaf1, spine1], rate: 100Gbps}
""")
    assert with_rate.dilation == without.dilation


def test_pfc_event_without_port_covers_every_port_of_the_node() -> None:
    plan = _plan("""\
events:
  - {at: 1ms, kind: pfc, node: leaf1, tclass: roce, enabled: false}
  - {at: 2ms, kind: pfc, node: leaf1, port: spine2, tclass: 3, enabled: true}
""")
    everywhere, one = plan.events
    assert {p.ifname for p in everywhere.ports} == {i.ifname
                                                    for i in plan.node("leaf1").interfaces}
    assert all(p.tc == 3 and p.pfc_enabled is False for p in everywhere.ports)
    assert [(p.ifname, p.pfc_enabled) for p in one.ports] == [
        (_ifname(plan, "leaf1", "spine2"), True)]
    assert one.target == f"leaf1:{_ifname(plan, 'leaf1', 'spine2')}"


def test_ecn_event_preset_scales_with_the_ports_rate_after_a_rate_event() -> None:
    plan = _plan("""\
events:
  - {at: 1ms, kind: rate, link: [leaf1, spine1], lanes: 2}
  - {at: 2ms, kind: ecn, node: leaf1, port: spine1, tclass: roce, preset: hpcc-ns3}
  - {at: 2ms, kind: ecn, node: leaf1, port: h1, tclass: roce, k: 30KB}
""")
    scaled, step = plan.events[1], plan.events[2]
    assert scaled.ports[0].ecn is not None and step.ports[0].ecn is not None
    # hpcc-ns3: 100 KB / 400 KB per 25 Gb/s, at 200 Gb/s (2 of 4 lanes)
    assert (scaled.ports[0].ecn.kmin_bytes, scaled.ports[0].ecn.kmax_bytes) == (800_000,
                                                                                3_200_000)
    assert (step.ports[0].ecn.kmin_bytes, step.ports[0].ecn.kmax_bytes,
            step.ports[0].ecn.pmax) == (30_000, 30_000, 1.0)


def test_host_drain_event_names_the_nic_port_and_its_lossless_thresholds() -> None:
    plan = _plan("""\
events:
  - {at: 1ms, kind: host_drain, host: h2, rate: 0bps}
  - {at: 2ms, kind: host_drain, host: h2, rate: 10Gbps}
  - {at: 3ms, kind: host_drain, host: h2, rate: line}
""", dilation="1000")
    nic = plan.node("h2").interfaces[0]
    roce = next(c for c in nic.egress.classes if c.lossless)
    assert roce.pfc is not None
    stuck, slow, line = plan.events
    for ev in plan.events:
        assert [(p.node, p.ifname, p.tc, p.xoff_bytes, p.xon_bytes) for p in ev.ports] == [
            ("h2", nic.ifname, roce.tc, roce.pfc.xoff_bytes, roce.pfc.xon_bytes)]
    assert (stuck.ports[0].drain_rate_bps, stuck.ports[0].drain_wall_rate_bps) == (0, 0)
    assert (slow.ports[0].drain_rate_bps, slow.ports[0].drain_wall_rate_bps) == (
        10_000_000_000, 10_000_000)
    assert (line.ports[0].drain_rate_bps, line.ports[0].drain_wall_rate_bps) == (None, None)


STATIC = """\
routes:
  - {node: leaf1, dst: h3, via: [spine2]}
  - {node: leaf2, dst: 198.18.0.0/30, via: [spine1]}
  - {node: leaf3, dst: 198.18.0.0/31, via: [spine1, spine2]}
"""


def test_static_route_to_a_host_is_a_slash_32_per_address_over_the_via() -> None:
    plan = _plan(STATIC)
    h3 = plan.node("h3").interfaces[0].address.split("/")[0]
    route = next(r for r in plan.node("leaf1").routes if r.dst == f"{h3}/32")
    spine2 = next(i for i in plan.node("leaf1").interfaces if i.peer.node == "spine2")
    assert [(h.gateway, h.ifname) for h in route.nexthops] == [(spine2.peer.address,
                                                                spine2.ifname)]
    dsts = [ipaddress.IPv4Network(r.dst) for r in plan.node("leaf1").routes]
    assert dsts == sorted(dsts)


def test_static_prefix_route_replaces_the_computed_one_or_is_added() -> None:
    base = _plan()
    plan = _plan(STATIC)
    leaf1_block = _block(base, "leaf1")
    assert leaf1_block == "198.18.0.0/30"       # leaf2's static route replaces it
    leaf2 = {r.dst: [h.ifname for h in r.nexthops] for r in plan.node("leaf2").routes}
    assert leaf2[leaf1_block] == [_ifname(plan, "leaf2", "spine1")]
    assert len(plan.node("leaf2").routes) == len(base.node("leaf2").routes)
    # leaf3's /31 is inside the block: added beside it, in order
    leaf3 = {r.dst: [h.ifname for h in r.nexthops] for r in plan.node("leaf3").routes}
    assert leaf3["198.18.0.0/31"] == [_ifname(plan, "leaf3", "spine1"),
                                      _ifname(plan, "leaf3", "spine2")]
    assert leaf3[leaf1_block] == _base_tables(base)["leaf3"][leaf1_block]
    assert len(plan.node("leaf3").routes) == len(base.node("leaf3").routes) + 1
    assert list(leaf3) == sorted(leaf3, key=ipaddress.IPv4Network)


def test_static_routes_do_not_reconverge_when_their_link_goes_down() -> None:
    plan = _plan(STATIC + """\
events:
  - {at: 1ms, kind: link_down, link: [leaf2, spine1]}
""")
    after = _tables(plan.events[0].routes or {})
    assert after["leaf2"]["198.18.0.0/30"] == [_ifname(plan, "leaf2", "spine1")]


def test_dscp_remap_moves_the_dscp_into_the_class_on_that_switch_only() -> None:
    plan = _plan("""\
dscp_remap:
  - {node: leaf2, dscp: 26, tclass: default}
""")
    for iface in plan.node("leaf2").interfaces:
        by_name = {c.name: c.dscp for c in iface.egress.classes}
        assert 26 in by_name["default"] and 26 not in by_name["roce"]
    for node in ("leaf1", "spine1", "h3"):
        for iface in plan.node(node).interfaces:
            assert {c.name: c.dscp for c in iface.egress.classes}["roce"] == [26]


KMIN_ABOVE_XOFF = """\
qos:
  default:
    buffer: {3: 2MB}
    ecn: {kmin: 1MB, kmax: 1.5MB}
    pfc: {xoff: 800KB}
"""


def test_ecn_above_xoff_is_refused_unless_allowed_then_a_warning() -> None:
    with pytest.raises(ConfigError) as refused:
        _plan(KMIN_ABOVE_XOFF)
    assert "PFC will fire before ECN marks" in str(refused.value)
    plan = _plan(KMIN_ABOVE_XOFF + "allow: [ecn-above-xoff]\n")
    allowed = [w for w in plan.warnings if "allow: [ecn-above-xoff]" in w]
    assert len(allowed) == 1 and "PFC will fire before ECN marks" in allowed[0]
    assert "on purpose" in allowed[0]


def test_an_ecn_event_above_xoff_follows_the_same_allowance() -> None:
    event = """\
events:
  - {at: 1ms, kind: ecn, node: leaf1, port: h1, tclass: roce, kmin: 1.5MB, kmax: 1.8MB}
"""
    with pytest.raises(ConfigError) as refused:
        _plan(event)
    assert "events[0].kmin" in str(refused.value)
    plan = _plan(event + "allow: [ecn-above-xoff]\n")
    assert any("events[0]" in w and "allow: [ecn-above-xoff]" in w for w in plan.warnings)
