"""The run's invariant checks on made-up samples, counters and agent results (no root).

Each invariant is broken on purpose and must be named with its place, time and size;
the same inputs without the fault must pass. The checks meet real runs in
tests/integration/test_invariants.py.
"""

from __future__ import annotations

import json
from pathlib import Path

from testbed.plan.model import Plan
from testbed.results.store import Sample
from testbed.run.invariants import INVARIANTS, InvariantMonitor
from testbed.run.workload import run_view
from testbed.run.workload import stream_accounts as _accounts
from testbed.workloads.base import AgentSpec
from tests.conftest import REPO

PLAN = Plan.model_validate_json((REPO / "tests/golden/default.plan.json").read_text())
HOT = ("leaf2", "swp4", 3)       # leaf2's port to h8


def _monitor() -> InvariantMonitor:
    return InvariantMonitor(PLAN)


def _finish(m: InvariantMonitor, snapshot=None, last=None, streams=(), errors=None) -> dict:
    return m.finish(snapshot if snapshot is not None else {"ports": [], "nodes": [],
                                                           "flow_drops": []},
                    last or {}, list(streams), errors or {})


def _names(verdict: dict) -> set[str]:
    return {v["invariant"] for v in verdict["violations"]}


def test_a_clean_input_holds_everything():
    m = _monitor()
    for i in range(5):
        m.observe(i * 1000, [Sample(*HOT, "backlog_bytes", 9014 * i),
                             Sample(*HOT, "vq_bytes", 9014 * i)],
                  {HOT: (9014 * i, 9014 * i)})
    verdict = _finish(m)
    assert not verdict["violations"] and not verdict["notes"]
    assert all(c["held"] for c in verdict["checks"].values())
    assert set(verdict["checks"]) == set(INVARIANTS)


def test_a_queue_off_its_bracket_by_more_than_two_frames_is_named_with_time_and_size():
    m = _monitor()
    m.observe(1000, [Sample(*HOT, "backlog_bytes", 100_000), Sample(*HOT, "vq_bytes", 100_000)],
              {HOT: (95_000, 105_000)})                  # inside the bracket: fine
    m.observe(2000, [Sample(*HOT, "backlog_bytes", 50_000), Sample(*HOT, "vq_bytes", 90_000)],
              {HOT: (88_000, 90_000)})                   # 38 KB below: beyond 2 x 9024
    m.observe(3000, [Sample(*HOT, "backlog_bytes", 0), Sample(*HOT, "vq_bytes", 9014)],
              {HOT: (9014, 9014)})                       # one frame in flight: fine
    verdict = _finish(m)
    [v] = verdict["violations"]
    assert (v["invariant"], v["where"], v["ts_fabric_ns"], v["amount"]) == (
        "queue", "leaf2:swp4 TC3", 2000, 38_000)
    assert verdict["checks"]["queue"]["max_abs_diff_bytes"] == 40_000
    assert verdict["checks"]["queue"]["max_abs_diff_at"] == "leaf2:swp4 TC3"
    assert "2000" not in verdict["notes"][0] and "2.0 us" in verdict["notes"][0]


def test_an_ingress_past_xoff_plus_headroom_is_named():
    iface = PLAN.node("leaf2").interfaces[0]
    pfc = next(c.pfc for c in iface.egress.classes if c.tc == 3)
    bound = pfc.xoff_bytes + pfc.headroom_bytes
    key = ("leaf2", iface.ifname, 3)
    m = _monitor()
    m.observe(500, [Sample(*key, "ingress_bytes", bound)], {})
    m.observe(700, [Sample(*key, "ingress_bytes", bound + 5000)], {})
    [v] = _finish(m)["violations"]
    assert (v["invariant"], v["ts_fabric_ns"], v["amount"]) == ("headroom", 700, 5000)
    assert v["where"] == f"leaf2 ingress {iface.ifname} TC3"
    # the same peak seen only in the final counters (between two samples)
    m = _monitor()
    snap = {"ports": [], "flow_drops": [], "nodes": [{"node": "leaf2", "ingress": [
        {"port": iface.ifname, "tclass": 3, "max_bytes": bound + 1, "max_hdrm_bytes": 0}]}]}
    [v] = _finish(m, snapshot=snap)["violations"]
    assert v["invariant"] == "headroom" and v["amount"] == 1 and v["ts_fabric_ns"] is None


def _port(node: str, port: str, tc: int, **counts) -> dict:
    row = {"node": node, "port": port, "tclass": tc, "enq_packets": 0, "dep_packets": 0,
           "tail_drops": 0, "mmu_drops": 0, "desc_drops": 0, "dep_unmatched": 0}
    row.update(counts)
    return row


def test_a_lossless_queue_drop_is_a_violation_a_lossy_one_is_not():
    m = _monitor()
    m.observe(100, [Sample(*HOT, "tail_drops", 0)], {})
    m.observe(200, [Sample(*HOT, "tail_drops", 7)], {})
    snap = {"ports": [_port(*HOT, tail_drops=7, mmu_drops=2, enq_packets=5, dep_packets=5),
                      _port("leaf2", "swp4", 0, tail_drops=50)],
            "nodes": [], "flow_drops": []}
    verdict = _finish(m, snapshot=snap)
    [v] = verdict["violations"]
    assert (v["invariant"], v["where"], v["amount"], v["ts_fabric_ns"]) == (
        "lossless_drop", "leaf2:swp4 TC3", 9, 200)
    assert "7 tail" in v["detail"] and "2 mmu" in v["detail"]


def test_a_lossless_class_without_pfc_on_its_port_is_reported_not_violated():
    plan = PLAN.model_copy(deep=True)
    node = next(n for n in plan.nodes if n.name == "leaf2")
    iface = next(i for i in node.interfaces if i.ifname == "swp4")
    cls = next(c for c in iface.egress.classes if c.tc == 3)
    object.__setattr__(cls, "pfc", None)
    m = InvariantMonitor(plan)
    snap = {"ports": [_port(*HOT, tail_drops=7)], "nodes": [], "flow_drops": []}
    verdict = _finish(m, snapshot=snap)
    assert not verdict["violations"]
    assert verdict["checks"]["lossless_drop"]["unprotected_drops"] == {"leaf2:swp4 TC3": 7}


def stream_accounts(plan, agents, results, flow_drops):
    """The run's accounts of these (spec, process) pairs, as the runner takes them."""
    return _accounts([s for s, _ in agents], results, flow_drops,
                     run_view(plan, Path("/nonexistent"), 0))


def _udp_agents():
    recv = AgentSpec(name="incast-recv-h8", node="h8", role="receiver", traffic="incast",
                     kind="udp_incast", module="agents.udp", argv=["recv", "--port", "20000"],
                     dst="h8")
    send = AgentSpec(name="incast-h1-h8", node="h1", role="sender", traffic="incast",
                     kind="udp_incast", module="agents.udp", argv=["send", "--dport", "20000"],
                     src="h1", dst="h8")
    return [(recv, None), (send, None)]


def _udp_results(sent: int, received: int, reordered: int = 0) -> dict:
    h1 = PLAN.node("h1").interfaces[0].address.split("/")[0]
    return {"incast-h1-h8": {"flows": {"0": {"sport": 40000, "packets": sent}}},
            "incast-recv-h8": {"flows": {f"{h1}:40000/0": {"received": received,
                                                           "reordered": reordered}}}}


def _flow_drop(n: int, kind: str = "tail") -> list[dict]:
    h1 = PLAN.node("h1").interfaces[0].address.split("/")[0]
    h8 = PLAN.node("h8").interfaces[0].address.split("/")[0]
    row = {"node": "leaf2", "saddr": h1, "daddr": h8, "sport": 40000, "dport": 20000,
           "proto": 17, "tclass": 3, "phy": 0, "tail": 0, "mmu": 0, "desc": 0}
    row[kind] = n
    return [row]


def test_a_reordered_flow_is_named():
    streams = stream_accounts(PLAN, _udp_agents(), _udp_results(100, 100, reordered=3), [])
    verdict = _finish(_monitor(), streams=streams)
    [v] = verdict["violations"]
    assert (v["invariant"], v["where"], v["amount"]) == ("reorder", "stream incast-h1-h8", 3)


def test_conservation_counts_fabric_and_socket_losses_and_names_the_rest():
    agents = _udp_agents()
    # 100 sent, 90 received: 6 dropped by the fabric for this flow, 4 at h8's sockets
    streams = stream_accounts(PLAN, agents, _udp_results(100, 90), _flow_drop(6))
    assert streams[0]["fabric_drops"] == 6 and streams[0]["drops"]["tail"] == 6
    assert not _finish(_monitor(), streams=streams, errors={"h8": 4})["violations"]
    # without the socket drops, 4 packets have no place
    [v] = _finish(_monitor(), streams=streams)["violations"]
    assert (v["invariant"], v["where"], v["amount"]) == ("conservation",
                                                         "stream incast-h1-h8", 4)
    assert "no counted place" in v["detail"]
    # a drop of another flow is not this flow's
    other = _flow_drop(6)
    other[0]["sport"] = 40001
    streams = stream_accounts(PLAN, agents, _udp_results(100, 90), other)
    assert streams[0]["fabric_drops"] == 0


def test_a_port_whose_qdisc_lost_packets_the_program_admitted_is_named():
    m = _monitor()
    snap = {"ports": [_port(*HOT, enq_packets=100, dep_packets=97)], "nodes": [],
            "flow_drops": []}
    last = {"class_packets": {HOT: 97}, "backlog_packets": {HOT: 0}, "class_drops": {}}
    [v] = _finish(m, snapshot=snap, last=last)["violations"]
    assert (v["invariant"], v["where"], v["amount"]) == ("conservation", "leaf2:swp4 TC3", 3)
    last["class_packets"][HOT] = 100                     # sent all, 3 lost on the veth
    [v] = _finish(_monitor(), snapshot=snap, last=last)["violations"]
    assert "vanished between them" in v["detail"] and v["amount"] == 3


def test_trimmed_packets_are_neither_lost_nor_dropped_and_the_trim_class_balances():
    data, trim = ("leaf2", "swp4", 2), ("leaf2", "swp4", 6)     # HOT's port: a UET class
    # 100 UET arrivals: 60 admitted, 40 trimmed; their 40 short copies admitted to TC6
    snap = {"ports": [_port(*data, packets=100, enq_packets=60, dep_packets=60, trims=40),
                      _port(*trim, packets=45, enq_packets=45, dep_packets=45)],
            "nodes": [], "flow_drops": []}
    last = {"class_packets": {data: 60, trim: 45}, "backlog_packets": {}, "class_drops": {}}
    verdict = _finish(_monitor(), snapshot=snap, last=last)
    assert not verdict["violations"], verdict["violations"]
    # a trim the program did not count is an arrival with no place
    snap["ports"][0]["trims"] = 39
    [v] = _finish(_monitor(), snapshot=snap, last=last)["violations"]
    assert (v["invariant"], v["where"], v["amount"]) == ("conservation", "leaf2:swp4 TC2", 1)
    assert "admitted, dropped, refused or trimmed" in v["detail"]


def test_a_multi_homed_senders_datagrams_count_from_any_of_its_addresses():
    plan = Plan.model_validate_json((REPO / "tests/golden/explicit.plan.json").read_text())
    c = plan.node("c")
    assert len(c.interfaces) == 2
    second = c.interfaces[1].address.split("/")[0]       # its route may pick either NIC
    recv = AgentSpec(name="x-recv-b", node="b", role="receiver", traffic="x",
                     kind="udp_pairs", module="agents.udp", argv=["recv", "--port", "20000"],
                     dst="b")
    send = AgentSpec(name="x-c-b", node="c", role="sender", traffic="x", kind="udp_pairs",
                     module="agents.udp", argv=["send", "--dport", "20000"], src="c", dst="b")
    results = {"x-c-b": {"flows": {"0": {"sport": 40000, "packets": 50}}},
               "x-recv-b": {"flows": {f"{second}:40000/0": {"received": 50}}}}
    [account] = stream_accounts(plan, [(recv, None), (send, None)], results, [])
    assert (account["sent"], account["received"]) == (50, 50)
    assert not InvariantMonitor(plan).finish({"ports": [], "nodes": [], "flow_drops": []},
                                             {}, [account], {})["violations"]


def _roce_agents():
    # h8's one responder, serving stream w-h1-h8 (testbed/workloads/roce.py combine)
    streams = {"streams": [{"name": "w-h1-h8-srv", "argv": ["write_bw", "--roce-port", "4791"]}]}
    srv = AgentSpec(name="roce-responder-h8", node="h8", role="receiver", traffic="w",
                    kind="roce_incast", module="agents.roce", dst="h8",
                    argv=["server", "--port", "18515"],
                    inputs=(("streams.json", json.dumps(streams)),))
    cli = AgentSpec(name="w-h1-h8", node="h1", role="sender", traffic="w",
                    kind="roce_incast", module="agents.roce", src="h1", dst="h8",
                    argv=["client", "write_bw"])
    return [(srv, None), (cli, None)]


def _roce_results(sent: int, received: int, ooo: int, socket_drops: int = 0) -> dict:
    return {"w-h1-h8": {"qps": {"17": {"sport": 49170, "requester": {"packets_sent": sent}}}},
            "roce-responder-h8": {"rx_socket_drops": socket_drops, "streams": {
                "w-h1-h8-srv": {"qps": {"18": {"responder": {"packets_received": received,
                                                             "ooo_drops": ooo}}}}}}}


def test_roce_out_of_order_arrivals_are_reordering_only_with_nothing_lost():
    drop = _flow_drop(3)
    drop[0].update(sport=49170, dport=4791)
    # out of order with nothing lost on the flow: the emulator reordered it
    streams = stream_accounts(PLAN, _roce_agents(), _roce_results(100, 100, ooo=4), [])
    [v] = _finish(_monitor(), streams=streams)["violations"]
    assert (v["invariant"], v["amount"]) == ("reorder", 4)
    # after a loss the responder drops what follows until go-back-N resends: not reordering
    streams = stream_accounts(PLAN, _roce_agents(), _roce_results(103, 100, ooo=12), drop)
    assert streams[0]["fabric_drops"] == 3 and streams[0]["reordered"] == 0
    assert not _finish(_monitor(), streams=streams)["violations"]


def test_a_roce_responders_socket_drops_are_the_counted_place_of_what_it_missed():
    # the responder fell behind: its socket dropped 5 datagrams full (SO_RXQ_OVFL)
    streams = stream_accounts(PLAN, _roce_agents(), _roce_results(105, 100, ooo=9, socket_drops=5),
                              [])
    assert (streams[0]["socket_drops"], streams[0]["reordered"]) == (5, 0)
    assert not _finish(_monitor(), streams=streams)["violations"]
    # fewer than it missed: the rest has no counted place
    streams = stream_accounts(PLAN, _roce_agents(), _roce_results(105, 100, ooo=9, socket_drops=2),
                              [])
    [v] = _finish(_monitor(), streams=streams)["violations"]
    assert (v["invariant"], v["amount"]) == ("conservation", 3)


def test_what_the_fabric_agents_do_as_they_stop_is_not_judged():
    """Each PFC agent opens its gates as it stops: a paused upstream then floods a
    neighbour whose agent has gone (seen after a PFC storm). The runner freezes the
    monitor before that and hands over the peaks read before it."""
    iface = PLAN.node("leaf2").interfaces[0]
    pfc = next(c.pfc for c in iface.egress.classes if c.tc == 3)
    bound = pfc.xoff_bytes + pfc.headroom_bytes
    key = ("leaf2", iface.ifname, 3)
    m = _monitor()
    m.observe(500, [Sample(*key, "ingress_bytes", bound)], {})
    m.freeze()
    m.observe(700, [Sample(*key, "ingress_bytes", bound + 625_000)], {})
    before = {"ports": [], "flow_drops": [], "nodes": [{"node": "leaf2", "ingress": [
        {"port": iface.ifname, "tclass": 3, "max_bytes": bound, "max_hdrm_bytes": 0}]}]}
    after = {"ports": [], "flow_drops": [], "nodes": [{"node": "leaf2", "ingress": [
        {"port": iface.ifname, "tclass": 3, "max_bytes": bound + 625_000,
         "max_hdrm_bytes": 0}]}]}
    verdict = m.finish(after, {}, [], {}, peaks_snapshot=before)
    assert "headroom" not in _names(verdict)


def test_packets_a_links_netem_dropped_or_holds_are_a_counted_place():
    # 100 sent, 90 received, nothing dropped by flow: 7 lost on a lossy link's wire
    # (netem's PHY loss) and 3 still on the wire at the end explain all 10
    streams = stream_accounts(PLAN, _udp_agents(), _udp_results(100, 90), [])
    last = {"wire_drops": {("leaf2", "swp4", -1): 7.0},
            "wire_backlog_packets": {("leaf2", "swp4", -1): 3.0}}
    verdict = _finish(_monitor(), last=last, streams=streams)
    assert not verdict["violations"]
    assert verdict["checks"]["conservation"]["wire_losses"] == {"leaf2:swp4": 10}
    # one fewer on the wire: one packet has no counted place, and the note says where
    # the others went
    last["wire_backlog_packets"] = {("leaf2", "swp4", -1): 2.0}
    [v] = _finish(_monitor(), last=last, streams=streams)["violations"]
    assert (v["invariant"], v["amount"]) == ("conservation", 1)
    assert "on the wire from leaf2:swp4" in v["detail"]


def test_a_roce_stream_short_of_packets_is_not_judged_for_reordering():
    # its losses were in the receiving host's socket, counted for the host (RcvbufErrors)
    # but not for this stream: the out-of-order arrivals that follow are go-back-N's
    streams = stream_accounts(PLAN, _roce_agents(), _roce_results(105, 100, ooo=9), [])
    assert (streams[0]["socket_drops"], streams[0]["reordered"]) == (0, 0)
