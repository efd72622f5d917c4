"""The base round trip between two hosts (testbed/plan/paths.py): what an ideal flow
completion time starts from, summed over the routed path and back (no root)."""

from __future__ import annotations

from fractions import Fraction

import pytest

from testbed.config import load_config_text
from testbed.plan import compile_plan
from testbed.plan.paths import (
    ROCE_ACK_WIRE_BYTES,
    ROCE_PACKET_OVERHEAD_BYTES,
    base_round_trip_ns,
    routed_path,
)

LEAF_SPINE = """\
name: rtt
dilation: 1000
topology:
  kind: leaf_spine
  spines: 2
  leaves: 2
  hosts_per_leaf: 2
  host_link: {port: 100GBASE-CR1, length: 2m}
  fabric_link: {port: 400GBASE-DR4, length: 100m}
"""


@pytest.fixture(scope="module")
def plan():
    return compile_plan(load_config_text(LEAF_SPINE, "rtt.yaml"),
                        max_wall_port_rate_bps=200_000_000)


def _expected(plan, hops: list[tuple[int, int]], data_bytes: int) -> int:
    """hops: (one-way delay ns, egress rate bit/s) per hop, the same both ways."""
    return round(sum(2 * d + Fraction((data_bytes + ROCE_ACK_WIRE_BYTES) * 8 * 10**9, r)
                     for d, r in hops))


def _hops(plan, src: str, dst: str) -> list[tuple[int, int]]:
    return [(plan.links[i.link].delay_ns, i.egress.rate_bps)
            for i in routed_path(plan, src, dst)]


def test_hosts_on_one_leaf_are_two_hops_apart_and_across_the_spines_four(plan) -> None:
    assert [i.peer.node for i in routed_path(plan, "h1", "h2")] == ["leaf1", "h2"]
    across = [i.peer.node for i in routed_path(plan, "h1", "h4")]
    assert len(across) == 4 and across[0] == "leaf1" and across[-1] == "h4"


def test_round_trip_is_each_hops_delay_both_ways_plus_a_data_packet_and_an_ack(plan) -> None:
    data = plan.roce_mtu_bytes + ROCE_PACKET_OVERHEAD_BYTES
    near = base_round_trip_ns(plan, "h1", "h2")
    far = base_round_trip_ns(plan, "h1", "h4")
    assert near == _expected(plan, _hops(plan, "h1", "h2"), data)
    assert far == _expected(plan, _hops(plan, "h1", "h4"), data)
    # 100G host links of 2 m, 400G fabric links of 100 m: the two fabric hops add their
    # fibre both ways (a few hundred ns each) and a 400G packet time each
    host_delay, fabric_delay = _hops(plan, "h1", "h4")[0][0], _hops(plan, "h1", "h4")[1][0]
    assert fabric_delay > host_delay
    assert far - near == round(4 * fabric_delay
                               + Fraction(2 * (data + ROCE_ACK_WIRE_BYTES) * 8, 400))
    assert base_round_trip_ns(plan, "h4", "h1") == far          # symmetric fabric


def test_round_trip_counts_the_packet_size_asked_for(plan) -> None:
    small = base_round_trip_ns(plan, "h1", "h2", payload_bytes=0)
    full = base_round_trip_ns(plan, "h1", "h2")
    # two 100G hops, each serialising the 4096 B payload more
    assert full - small == pytest.approx(2 * plan.roce_mtu_bytes * 8 / 100, abs=1)


def test_a_host_without_a_route_is_an_error(plan) -> None:
    with pytest.raises(KeyError):
        base_round_trip_ns(plan, "h1", "h9")
