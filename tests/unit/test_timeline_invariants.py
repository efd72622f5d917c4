"""The run's invariants with a fault timeline: what a link-down lost is a counted place."""

from __future__ import annotations

from testbed.results.store import Sample
from testbed.run.invariants import InvariantMonitor
from tests.unit.test_invariants import (
    HOT,
    PLAN,
    _port,
    _udp_agents,
    _udp_results,
    stream_accounts,
)

EMPTY = {"ports": [], "nodes": [], "flow_drops": []}


def _flap(packets: int, ports: dict | None = None) -> list[dict]:
    return [{"where": "link leaf2-spine1 down (both directions) at 2000 us",
             "packets": packets, "ports": ports or {}}]


def test_packets_a_link_down_lost_explain_a_streams_missing_packets():
    streams = stream_accounts(PLAN, _udp_agents(), _udp_results(100, 90), [])
    verdict = InvariantMonitor(PLAN).finish(EMPTY, {}, streams, {}, _flap(10))
    assert not verdict["violations"]
    assert verdict["checks"]["conservation"]["link_losses"] == [
        {"where": "link leaf2-spine1 down (both directions) at 2000 us", "packets": 10}]


def test_what_the_link_down_did_not_lose_is_still_named_with_it():
    streams = stream_accounts(PLAN, _udp_agents(), _udp_results(100, 90), [])
    [v] = InvariantMonitor(PLAN).finish(EMPTY, {}, streams, {}, _flap(6))["violations"]
    assert (v["invariant"], v["amount"]) == ("conservation", 4)
    assert "6 lost where a link went down (link leaf2-spine1 down" in v["detail"]


def test_a_ports_freed_queue_is_its_admitted_packets_that_were_never_sent():
    snap = {**EMPTY, "ports": [_port(*HOT, enq_packets=100, dep_packets=100)]}
    last = {"class_packets": {HOT: 97}, "backlog_packets": {HOT: 0}, "class_drops": {}}
    verdict = InvariantMonitor(PLAN).finish(snap, last, [], {}, _flap(3, {HOT: 3}))
    assert not verdict["violations"]
    [v] = InvariantMonitor(PLAN).finish(snap, last, [], {}, _flap(1, {HOT: 1}))["violations"]
    assert v["amount"] == 2 and "1 were freed when its link went down" in v["detail"]
    # one of the freed was sent into the veth as it went down: the qdisc counted it
    last["class_packets"][HOT] = 98
    assert not InvariantMonitor(PLAN).finish(snap, last, [], {}, _flap(3, {HOT: 3}))[
        "violations"]


def test_reordering_in_a_run_whose_routes_changed_is_reported_beside_the_invariant():
    streams = stream_accounts(PLAN, _udp_agents(), _udp_results(100, 100, reordered=2), [])
    verdict = InvariantMonitor(PLAN).finish(EMPTY, {}, streams, {}, _flap(0))
    assert not verdict["violations"]
    assert verdict["checks"]["reorder"]["after_route_changes"] == {"stream incast-h1-h8": 2}
    assert any("routes changed at link events" in n for n in verdict["notes"])


def test_the_queue_check_skips_a_port_while_its_link_goes_down():
    m = InvariantMonitor(PLAN)
    m.quiet_ports([HOT[:2]], 1_000)
    # the kernel freed the queue; the program still counts it until it is told
    m.observe(1_500, [Sample(*HOT, "backlog_bytes", 0), Sample(*HOT, "vq_bytes", 90_000)],
              {HOT: (90_000, 90_000)})
    m.quiet_ports([HOT[:2]], 1_000, 2_000)
    m.observe(2_500, [Sample(*HOT, "backlog_bytes", 0), Sample(*HOT, "vq_bytes", 90_000)],
              {HOT: (90_000, 90_000)})
    [v] = m.finish(EMPTY, {}, [], {})["violations"]
    assert (v["invariant"], v["ts_fabric_ns"]) == ("queue", 2_500)


def test_drops_after_a_pfc_off_event_at_the_node_are_unprotected_not_violations():
    def run(off_at: int) -> dict:
        m = InvariantMonitor(PLAN)
        m.observe(4_000, [Sample(*HOT, "tail_drops", 0)], {})
        m.observe(5_000, [Sample(*HOT, "tail_drops", 3)], {})
        snap = {**EMPTY, "ports": [_port(*HOT, tail_drops=3)]}
        return m.finish(snap, {}, [], {}, pfc_off={("leaf2", 3): off_at})

    after = run(4_500)
    assert not after["violations"]
    assert after["checks"]["lossless_drop"]["unprotected_drops"] == {"leaf2:swp4 TC3": 3}
    assert after["checks"]["lossless_drop"]["pfc_off_by_events"] == {"leaf2 TC3": 4_500}
    [v] = run(6_000)["violations"]              # dropped while PFC was still on
    assert v["invariant"] == "lossless_drop"
