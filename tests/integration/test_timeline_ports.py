"""loss / rate / ecn events: each one's effect shows in the kernel counters from its time.

One run on a 7-host switch (traffic from 3 to 7 ms), PFC off (no PFC agent: the
timeline changes the port's HTB and TBF itself), three independent streams, one per
event kind:
- h1 -> h2 (lossy, 60 Gb/s): link sw1-h2 gets 10 % loss at 4.5 ms;
- h5 -> h4 (lossy, 60 Gb/s): link sw1-h4 drops to 25 Gb/s at 4.5 ms;
- h3, h6 -> h7 (RoCE class, ECT(0), 2 x 75 Gb/s into 100 Gb/s): a standing queue at
  sw1's port to h7, whose ECN curve is set out of reach at 0 and lowered at 2 ms.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from testbed.config import load_config_text
from testbed.plan import compile_plan
from testbed.plan.model import EcnPlan, EgressPlan, EventPlan, EventPortPlan, Plan
from testbed.results.store import Store
from tests.conftest import unique_lab
from tests.integration.timeline_helpers import (
    PERIOD_NS,
    before_one_sample,
    counter_between,
    fault_events,
    rate_bps_between,
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
  hosts: 7
  host_link: {{port: 100GBASE-CR1, length: 2m}}
qos:
  default:
    pfc: {{enabled: false}}
workload:
  sample_period: 100us
  traffic:
    - {{name: lossy, kind: udp_pairs, pairs: [[h1, h2]], rate: 60Gbps, start: 3ms,
       duration: 4ms}}
    - {{name: slowed, kind: udp_pairs, pairs: [[h5, h4]], rate: 60Gbps, start: 3ms,
       duration: 4ms}}
    - {{name: queue, kind: udp_incast, senders: [h3, h6], receiver: h7, tclass: roce,
       ecn: ect0, rate: 75Gbps, start: 3ms, duration: 4ms}}
"""
END_NS = 7_000_000
# Traffic starts at 3 ms: a sender whose process is ready only after its start time
# starts late (seen 1-2.5 ms fabric after t0 at load 6 on 2 cores, D = 1000), and the
# events must find the streams flowing.
LOSS_AT_NS, RATE_AT_NS, ECN_AT_NS = 4_500_000, 4_500_000, 5_500_000
LOSS = 0.1
NEW_RATE_BPS = 25_000_000_000
ROCE_TC = 3


def _link_ports(plan: Plan, host: str) -> list[EventPortPlan]:
    iface = plan.node(host).interfaces[0]
    return [EventPortPlan(node=iface.peer.node, ifname=iface.peer.ifname),
            EventPortPlan(node=host, ifname=iface.ifname)]


def _iface(plan: Plan, node: str, ifname: str):
    return next(i for i in plan.node(node).interfaces if i.ifname == ifname)


def scaled_egress(plan: Plan, egress: EgressPlan, rate_bps: int) -> EgressPlan:
    """The egress at another rate, as the plan would make it (shares scale, ceilings are
    the port rate, the burst two frames or 100 us of wall time)."""
    wall = plan.timebase.to_wall_bps(rate_bps)
    classes = [c.model_copy(update={
        "wall_rate_bps": max(8_000, c.wall_rate_bps * wall // egress.wall_rate_bps),
        "wall_ceil_bps": wall}) for c in egress.classes]
    return egress.model_copy(update={
        "rate_bps": rate_bps, "wall_rate_bps": wall, "classes": classes,
        "burst_bytes": max(2 * egress.quantum_bytes, wall // 8 // 10_000)})


@pytest.fixture(scope="module")
def ports_run(tmp_path_factory) -> Iterator[tuple[Plan, Store, dict]]:
    lab = unique_lab("tlport")
    loaded = load_config_text(CONFIG.format(lab=lab), "ports.yaml")
    plan = compile_plan(loaded)
    to_h7 = _link_ports(plan, "h7")[0]
    far = EcnPlan(kmin_bytes=1 << 30, kmax_bytes=1 << 30, pmax=1.0)
    near = EcnPlan(kmin_bytes=10_000, kmax_bytes=100_000, pmax=1.0)
    events = [
        EventPlan(index=0, at_ns=0, kind="ecn", target=f"sw1:{to_h7.ifname}",
                  description="ECN out of reach on sw1's port to h7",
                  ports=[to_h7.model_copy(update={"tc": ROCE_TC, "ecn": far})]),
        EventPlan(index=1, at_ns=LOSS_AT_NS, kind="loss", target="sw1-h2",
                  description="link sw1-h2 loses 10 % (both directions)",
                  ports=[p.model_copy(update={"loss_probability": LOSS})
                         for p in _link_ports(plan, "h2")]),
        EventPlan(index=2, at_ns=RATE_AT_NS, kind="rate", target="sw1-h4",
                  description="link sw1-h4 at 25 Gb/s",
                  ports=[p.model_copy(update={"egress": scaled_egress(
                      plan, _iface(plan, p.node, p.ifname).egress, NEW_RATE_BPS)})
                      for p in _link_ports(plan, "h4")]),
        EventPlan(index=3, at_ns=ECN_AT_NS, kind="ecn", target=f"sw1:{to_h7.ifname}",
                  description="ECN Kmin 10 KB on sw1's port to h7",
                  ports=[to_h7.model_copy(update={"tc": ROCE_TC, "ecn": near})]),
    ]
    plan = plan.model_copy(update={"events": events})
    with timeline_run(loaded, plan, tmp_path_factory.mktemp("ports")) as (store, summary):
        yield plan, store, summary


def _started_ns(store: Store, node: str, port: str) -> int:
    """When a port's tx counter first moved (its traffic started)."""
    points = store.series("tx_packets", node=node, port=port, tclass=-1)[(node, port, -1)]
    return next(ts for ts, v in points if v > 0)


def _fault(store: Store, index: int) -> dict:
    faults = [f for f in fault_events(store) if f["index"] == index]
    assert len(faults) == 1, faults
    return faults[0]


def test_every_port_event_is_applied_and_recorded(ports_run):
    _plan, store, summary = ports_run
    faults = fault_events(store)
    assert sorted(f["index"] for f in faults) == [0, 1, 2, 3]
    assert all(f["phase"] == "applied" for f in faults)
    assert not [n for n in summary["fidelity"] if "could not be applied" in n]
    for f in faults:
        assert f["ts_fabric_ns"] == f["at_ns"] + f["late_ns"]
    rate = _fault(store, 2)
    assert rate["changes"][0]["to_bps"] == NEW_RATE_BPS
    assert rate["changes"][0]["gates_by_agent"] is False


def test_loss_drops_are_counted_after_at_only(ports_run):
    plan, store, _summary = ports_run
    fault = _fault(store, 1)
    port = _link_ports(plan, "h2")[0].ifname
    tc = next(c.tc for c in _iface(plan, "sw1", port).egress.classes
              if c.classid == _iface(plan, "sw1", port).egress.default_classid)
    drops = store.series("bpf_drops", node="sw1", port=port, tclass=tc)[("sw1", port, tc)]
    assert _started_ns(store, "sw1", port) < fault["ts_fabric_ns"] - PERIOD_NS, \
        "the sender started after the event (a loaded machine: see the run's notes)"
    assert value_at(drops, before_one_sample(store, fault["ts_fabric_ns"])) == 0
    t = fault["ts_fabric_ns"] + fault["took_ns"]
    assert value_at(drops, within_one_sample(store, t)) > 0          # within one sample
    dropped = counter_between(store, "bpf_drops", "sw1", port, tc, t, END_NS)
    arrived = counter_between(store, "enq_packets", "sw1", port, tc, t, END_NS) + dropped
    assert arrived > 500
    assert dropped / arrived == pytest.approx(LOSS, rel=0.5)


def test_rate_change_shows_in_the_ports_delivered_rate(ports_run):
    plan, store, _summary = ports_run
    fault = _fault(store, 2)
    port = _link_ports(plan, "h4")[0].ifname
    start = _started_ns(store, "sw1", port)
    assert start + 3 * PERIOD_NS < fault["ts_fabric_ns"], "the sender started too late"
    before = rate_bps_between(store, "sw1", port, start + PERIOD_NS, fault["ts_fabric_ns"])
    t = fault["ts_fabric_ns"] + fault["took_ns"]
    after = rate_bps_between(store, "sw1", port, t + PERIOD_NS, END_NS)
    assert before > 35e9         # what the sender managed of its 60 Gb/s (loaded machine)
    assert after == pytest.approx(NEW_RATE_BPS, rel=0.12)


def test_ecn_marks_start_when_kmin_drops_under_a_standing_queue(ports_run):
    plan, store, _summary = ports_run
    fault = _fault(store, 3)
    port = _link_ports(plan, "h7")[0].ifname
    # the queue stood above the new Kmin before the change (the reason marks start)
    vq = store.series("vq_bytes", node="sw1", port=port, tclass=ROCE_TC)[("sw1", port, ROCE_TC)]
    start = _started_ns(store, "sw1", port)
    assert max(v for ts, v in vq if start < ts < fault["ts_fabric_ns"]) > 10_000, \
        "no standing queue: the senders fell short of overloading the port"
    marks = store.series("ecn_marks", node="sw1", port=port, tclass=ROCE_TC)
    points = marks.get(("sw1", port, ROCE_TC), [])
    assert value_at(points, before_one_sample(store, fault["ts_fabric_ns"])) == 0
    t = fault["ts_fabric_ns"] + fault["took_ns"]
    assert value_at(points, within_one_sample(store, t)) > 0
