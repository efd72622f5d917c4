"""pfc and host_drain events: they go through the node's PFC agent (its command
socket), so they need agents that take commands (skipped where they do not).

One run on a 5-host switch, PFC on, traffic from 3 to 7 ms:
- h1, h2 -> h3 on the lossless class (2 x 60 Gb/s into 100 Gb/s): sw1 keeps pausing
  h1 and h2. At 4.5 ms PFC goes off on every port of sw1 for that class (the config's
  `pfc` event without `port`): sw1 sends no more pauses, and the 20 % excess is
  dropped at sw1. (Off on one sender's port only, the other sender is paused for both,
  and one 60 Gb/s sender alone never overflows the 100 Gb/s port.)
- h4 -> h5 on the lossless class at 30 Gb/s: at 4.5 ms h5 stops draining its receive
  buffer (host_drain, rate 0), so its NIC sends PFC to sw1 once the buffer passes XOFF.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from testbed.config import load_config_text
from testbed.plan import compile_plan
from testbed.plan.model import EventPlan, EventPortPlan, Plan
from testbed.results.store import Store
from testbed.results.tables import DROP_COUNTERS
from tests.conftest import unique_lab
from tests.integration.timeline_helpers import (
    before_one_sample,
    fault_events,
    timeline_run,
    value_at,
    within_one_sample,
)

pytestmark = [pytest.mark.root, pytest.mark.slow]

CONFIG = """\
name: {lab}
dilation: 1000
topology:
  kind: single_switch
  hosts: 5
  host_link: {{port: 100GBASE-CR1, length: 2m}}
workload:
  sample_period: 100us
  traffic:
    - {{name: incast, kind: udp_incast, senders: [h1, h2], receiver: h3, tclass: roce,
       rate: 60Gbps, start: 3ms, duration: 4ms}}
    - {{name: drained, kind: udp_pairs, pairs: [[h4, h5]], tclass: roce, rate: 30Gbps,
       start: 3ms, duration: 4ms}}
"""
AT_NS = 4_500_000
END_NS = 7_000_000
ROCE_TC = 3


def _switch_port_to(plan: Plan, host: str) -> str:
    return plan.node(host).interfaces[0].peer.ifname


@pytest.fixture(scope="module")
def pfc_run(tmp_path_factory) -> Iterator[tuple[Plan, Store, dict]]:
    loaded = load_config_text(CONFIG.format(lab=unique_lab("tlpfc")), "pfc.yaml")
    plan = compile_plan(loaded)
    nic = plan.node("h5").interfaces[0]
    pfc = next(c.pfc for c in nic.egress.classes if c.tc == ROCE_TC)
    assert pfc is not None
    events = [
        EventPlan(index=0, at_ns=AT_NS, kind="pfc", target="sw1",
                  description="PFC off on every port of sw1 (class roce)",
                  ports=[EventPortPlan(node="sw1", ifname=i.ifname, tc=ROCE_TC,
                                       pfc_enabled=False)
                         for i in plan.node("sw1").interfaces]),
        EventPlan(index=1, at_ns=AT_NS, kind="host_drain", target="h5",
                  description="h5 stops draining its receive buffer",
                  ports=[EventPortPlan(node="h5", ifname=nic.ifname, tc=ROCE_TC,
                                       drain_rate_bps=0, drain_wall_rate_bps=0,
                                       xoff_bytes=pfc.xoff_bytes, xon_bytes=pfc.xon_bytes)]),
    ]
    plan = plan.model_copy(update={"events": events})
    with timeline_run(loaded, plan, tmp_path_factory.mktemp("pfc")) as (store, summary):
        yield plan, store, summary


def _applied(store: Store, index: int) -> tuple[dict, int]:
    fault = next(f for f in fault_events(store) if f["index"] == index)
    return fault, fault["ts_fabric_ns"] + fault["took_ns"]


def test_pfc_off_stops_the_pauses_and_drops_appear(pfc_run):
    plan, store, summary = pfc_run
    fault, t = _applied(store, 0)
    assert fault["changes"][0]["enabled"] is False
    for host in ("h1", "h2"):
        port = _switch_port_to(plan, host)
        pauses = store.series("pause_tx", node="sw1", port=port, tclass=ROCE_TC)[
            ("sw1", port, ROCE_TC)]
        assert value_at(pauses, fault["ts_fabric_ns"]) > 0      # congested: pausing it
        assert value_at(pauses, within_one_sample(store, t)) == value_at(pauses, END_NS)
    drops_before = drops_after = 0.0
    for counter in DROP_COUNTERS:
        for _key, points in store.series(counter, node="sw1", tclass=ROCE_TC).items():
            drops_before += value_at(points, fault["ts_fabric_ns"])
            drops_after += value_at(points, END_NS)
    assert drops_before == 0
    assert drops_after > 0
    # PFC was turned off on purpose: its drops are unprotected, not invariant violations
    assert not [v for v in summary["invariants"]["violations"]
                if v["invariant"] in ("lossless_drop", "headroom")]
    assert summary["invariants"]["checks"]["lossless_drop"]["unprotected_drops"]


def test_host_drain_makes_the_host_pause_its_switch_port(pfc_run):
    plan, store, _summary = pfc_run
    fault, t = _applied(store, 1)
    port = _switch_port_to(plan, "h5")
    rx = store.series("pause_rx", node="sw1", port=port, tclass=ROCE_TC).get(
        ("sw1", port, ROCE_TC), [])
    # hosts never paused before
    assert value_at(rx, before_one_sample(store, fault["ts_fabric_ns"])) == 0
    # the NIC's buffer fills to XOFF at 30 Gb/s, then h5 pauses sw1 within a sample
    xoff = plan.events[1].ports[0].xoff_bytes
    assert xoff is not None
    fill_ns = round(xoff * 8 / 30e9 * 1e9)
    assert value_at(rx, within_one_sample(store, t + fill_ns)) > 0
