"""The fault timeline, static routes, DSCP remaps and allow: as config models.

Validation messages live in tests/config_errors/event_*.yaml, static_route*.yaml and
dscp_remap*.yaml; these tests check what valid entries parse into.
"""

from __future__ import annotations

from testbed.config import load_config_text
from testbed.config.models import (
    EVENT_KINDS,
    EcnEvent,
    HostDrainEvent,
    LinkStateEvent,
    LossEvent,
    PfcEvent,
    RateEvent,
)

FABRIC = """\
name: ev
topology:
  kind: leaf_spine
  spines: 2
  leaves: 2
  hosts_per_leaf: 2
  host_link: {port: 100GBASE-CR1, length: 2m}
  fabric_link: {port: 400GBASE-DR4, length: 100m}
"""


def test_the_contract_kinds_are_the_event_kinds() -> None:
    assert list(EVENT_KINDS) == ["link_down", "link_up", "loss", "rate", "pfc", "ecn",
                                 "host_drain"]


def test_each_event_parses_into_its_kinds_model_in_fabric_units() -> None:
    fabric = load_config_text(FABRIC + """\
events:
  - {at: 2ms, kind: link_down, link: [leaf1, spine1], converge: 10us}
  - {at: 4ms, kind: link_up, link: [leaf1, spine1]}
  - {at: 1ms, kind: loss, link: [leaf1, spine1], loss: 0.01, cause: corruption}
  - {at: 1ms, kind: rate, link: [leaf2, spine1], rate: 200Gbps}
  - {at: 1500us, kind: rate, link: [leaf2, spine2], lanes: 3}
  - {at: 1ms, kind: pfc, node: leaf1, port: spine1, tclass: roce, enabled: false}
  - {at: 1ms, kind: ecn, node: leaf2, tclass: 3, preset: dcqcn-paper}
  - {at: 1ms, kind: host_drain, host: h4, rate: 0bps}
  - {at: 2ms, kind: host_drain, host: h4, rate: line}
""").fabric
    ev = fabric.events
    assert [type(e) for e in ev] == [LinkStateEvent, LinkStateEvent, LossEvent, RateEvent,
                                     RateEvent, PfcEvent, EcnEvent, HostDrainEvent,
                                     HostDrainEvent]
    assert (ev[0].at_ns, ev[0].converge_ns, ev[1].converge_ns) == (2_000_000, 10_000, 0)
    assert isinstance(ev[2], LossEvent) and (ev[2].direction, ev[2].cause) == ("both",
                                                                             "corruption")
    assert isinstance(ev[3], RateEvent) and (ev[3].rate_bps, ev[3].lanes) == (200 * 10**9, None)
    assert isinstance(ev[4], RateEvent) and (ev[4].at_ns, ev[4].lanes) == (1_500_000, 3)
    assert isinstance(ev[5], PfcEvent) and ev[5].port == "spine1" and ev[5].enabled is False
    assert isinstance(ev[6], EcnEvent) and ev[6].preset == "dcqcn-paper" and ev[6].port is None
    assert isinstance(ev[7], HostDrainEvent) and ev[7].drain_rate_bps == 0
    assert isinstance(ev[8], HostDrainEvent) and ev[8].drain_rate_bps is None


def test_routes_dscp_remap_and_allow_parse() -> None:
    fabric = load_config_text(FABRIC + """\
routes:
  - {node: leaf1, dst: h3, via: [spine1, spine2]}
  - {node: spine1, dst: 198.18.0.0/30, via: [leaf1]}
dscp_remap:
  - {node: leaf2, dscp: 26, tclass: default}
allow: [ecn-above-xoff]
""").fabric
    assert [(r.node, r.dst, r.via) for r in fabric.routes] == [
        ("leaf1", "h3", ["spine1", "spine2"]), ("spine1", "198.18.0.0/30", ["leaf1"])]
    assert [(d.node, d.dscp, d.tclass) for d in fabric.dscp_remap] == [("leaf2", 26, "default")]
    assert fabric.allow == ["ecn-above-xoff"]


def test_a_link_can_flap_twice_and_events_at_one_time_on_different_targets_are_fine() -> None:
    load_config_text(FABRIC + """\
events:
  - {at: 1ms, kind: link_down, link: [leaf1, spine1]}
  - {at: 1ms, kind: link_down, link: [leaf2, spine1]}
  - {at: 1ms, kind: loss, link: [leaf1, spine2], direction: forward, loss: 0.1}
  - {at: 1ms, kind: loss, link: [leaf1, spine2], direction: reverse, loss: 0.2}
  - {at: 2ms, kind: link_up, link: [spine1, leaf1]}
  - {at: 3ms, kind: link_down, link: [leaf1, spine1]}
  - {at: 4ms, kind: link_up, link: [leaf1, spine1]}
""")
