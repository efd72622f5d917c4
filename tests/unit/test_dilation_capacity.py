"""`dilation: auto` from measured capacity: the workload's packets over every hop it
crosses and at its agents, against what the machine carries (testbed/plan/capacity.py,
testbed/plan/compile.py)."""

from __future__ import annotations

import pytest

from testbed.config import load_config_text
from testbed.plan import compile_plan
from testbed.plan.capacity import (
    CLEAN_RUNS_TO_RECOVER,
    MARGIN,
    MIN_DERATING,
    AgentCost,
    Capacity,
    Derating,
    choose_factor,
    fair_rates_bps,
    learn,
    workload_need,
)
from testbed.plan.compile import nice_ceiling, plan_need
from testbed.workloads.base import StreamLoad

G = 10**9
# A machine where a hop costs 10 us and each agent packet 10 us sent, 10 us received.
CAP = Capacity(hop_pps_per_core=100_000, cores=2,
               agents={"udp": AgentCost(10e-6, 10e-6), "roce": AgentCost(20e-6, 20e-6)},
               source="test")


def _path(*ports: tuple[str, int]):
    return list(ports)


# --- the need, pure -------------------------------------------------------------------

def test_a_stream_costs_its_packets_once_per_hop_it_crosses():
    load = StreamLoad("a", "b", 8 * 1000 * 1000, 1000, "udp", lossless=False)   # 1000 pps
    short = workload_need([load], lambda s, d: [("a:e0", G), ("sw:p1", G)])
    long = workload_need([load], lambda s, d: [("a:e0", G), ("s1:p", G), ("s2:p", G),
                                               ("s3:p", G)])
    assert short.hop_pps == pytest.approx(2000)
    assert long.hop_pps == pytest.approx(4000)
    assert short.agent_send_pps == {"udp": pytest.approx(1000)}
    assert long.longest_path_hops == 4


def test_lossless_incast_moves_at_the_bottleneck_share_not_the_offered_rate():
    # Four senders at 100G into one 100G port: PFC holds each to 25G on every hop.
    loads = [StreamLoad(f"h{i}", "h8", 100 * G, 1000, "udp", lossless=True)
             for i in range(4)]
    need = workload_need(loads, lambda s, d: [(f"{s}:e0", 100 * G), ("leaf:p8", 100 * G)])
    assert need.fair_bps == [pytest.approx(25 * G)] * 4
    pps = 100 * G / 8000
    assert need.hop_pps == pytest.approx(2 * pps)
    assert need.agent_send_pps["udp"] == pytest.approx(pps)
    assert need.busiest_port == "leaf:p8"
    assert need.busiest_port_pps == pytest.approx(pps)


def test_a_lossy_stream_is_counted_at_its_offered_rate_on_every_hop():
    loads = [StreamLoad(f"h{i}", "h8", 100 * G, 1000, "udp", lossless=False)
             for i in range(4)]
    need = workload_need(loads, lambda s, d: [(f"{s}:e0", 100 * G), ("leaf:p8", 100 * G)])
    offered_pps = 4 * 100 * G / 8000
    assert need.hop_pps == pytest.approx(2 * offered_pps)
    assert need.agent_send_pps["udp"] == pytest.approx(offered_pps)
    # ... but its receiver only gets what the port delivers
    assert need.agent_recv_pps["udp"] == pytest.approx(offered_pps / 4)


def test_acks_cross_the_hops_back_and_cost_both_agents():
    load = StreamLoad("a", "b", 8 * 1000 * 1000, 1000, "roce", lossless=True,
                      reverse_per_packet=0.5)
    need = workload_need([load], lambda s, d: [("a:e0", G), ("sw:p1", G)])
    assert need.hop_pps == pytest.approx(2000 * 1.5)
    assert need.agent_send_pps["roce"] == pytest.approx(1500)
    assert need.agent_recv_pps["roce"] == pytest.approx(1500)


def test_fair_rates_give_the_unbottlenecked_stream_the_rest():
    # a and b share port x (10G); c alone on y asks 3G; b also crosses y (10G).
    paths = [[("x", 10 * G)], [("x", 10 * G), ("y", 10 * G)], [("y", 10 * G)]]
    rates = fair_rates_bps([20 * G, 20 * G, 3 * G], paths)
    assert rates == [pytest.approx(5 * G), pytest.approx(5 * G), pytest.approx(3 * G)]


def test_the_need_in_cores_weighs_hops_and_agents_by_their_costs():
    load = StreamLoad("a", "b", 8 * 1000 * 1000, 1000, "udp", lossless=False)
    need = workload_need([load], lambda s, d: [("a:e0", G), ("sw:p1", G)])
    # 2000 hop packets x 10 us + 1000 x (10 + 10) us of agents = 0.04 core-s/s
    assert need.core_s_per_s(CAP) == pytest.approx(0.04)


def test_an_unknown_agent_kind_costs_what_the_roce_agents_do():
    load = StreamLoad("a", "b", 8 * 1000 * 1000, 1000, "uet", lossless=False)
    need = workload_need([load], lambda s, d: [("a:e0", G)])
    assert need.core_s_per_s(CAP) == pytest.approx(1000 * 10e-6 + 1000 * 20e-6 * 2)


# --- the choice of D ------------------------------------------------------------------

def test_d_is_the_smallest_readable_factor_that_fits_the_margin():
    load = StreamLoad("a", "b", 8 * 1000 * 1000 * 1000, 1000, "udp", lossless=False)
    need = workload_need([load], lambda s, d: [("a:e0", 100 * G), ("sw:p1", 100 * G)])
    at_1 = need.core_s_per_s(CAP)                   # 40 core-s/s
    choice = choose_factor(need, CAP, nice_ceiling)
    assert at_1 / choice.factor <= CAP.cores * MARGIN
    smaller = [d for d in (1, 2, 5, 10, 20, 50, 100) if d < choice.factor]
    assert all(at_1 / d > CAP.cores * MARGIN for d in smaller)
    assert choice.factor == 50                     # 40 / (2 x 0.5) = 40 -> 50


def test_a_derating_raises_d():
    load = StreamLoad("a", "b", 8 * 1000 * 1000 * 1000, 1000, "udp", lossless=False)
    need = workload_need([load], lambda s, d: [("a:e0", 100 * G), ("sw:p1", 100 * G)])
    derated = Capacity(CAP.hop_pps_per_core, CAP.cores, CAP.agents, "test", derating=0.5)
    assert choose_factor(need, derated, nice_ceiling).factor == 100


def test_one_busy_port_needs_its_packets_on_one_core():
    # Tiny agent and hop costs overall, but 1M packets/s through one port: a port's queue
    # is served on one CPU, 100k packets/s per core at margin 0.5 -> D >= 20.
    load = StreamLoad("a", "b", 8 * 1000 * 1_000_000, 1000, "udp", lossless=False)
    need = workload_need([load], lambda s, d: [("a:e0", 100 * G)])
    big = Capacity(100_000, 1000, {"udp": AgentCost(0, 0), "roce": AgentCost(0, 0)}, "t")
    choice = choose_factor(need, big, nice_ceiling)
    assert choice.port_factor == 20
    assert choice.factor == 20


def test_no_port_runs_faster_than_the_pause_gate_allows():
    need = workload_need([], lambda s, d: [])
    assert choose_factor(need, CAP, nice_ceiling, 400 * G).factor == 20   # 400G / 25G


# --- the derating ---------------------------------------------------------------------

def test_a_run_that_fell_behind_halves_the_capacity_down_to_a_floor():
    state = Derating()
    for _ in range(10):
        state = learn(state, fell_behind=True)
    assert state.scale == MIN_DERATING
    assert learn(Derating(), fell_behind=True).scale == 0.5


def test_clean_runs_recover_slowly_and_never_above_the_measurement():
    state = learn(Derating(), fell_behind=True)            # 0.5
    for _ in range(CLEAN_RUNS_TO_RECOVER - 1):
        state = learn(state, fell_behind=False)
        assert state.scale == 0.5
    state = learn(state, fell_behind=False)
    assert 0.5 < state.scale < 1.0
    for _ in range(100):
        state = learn(state, fell_behind=False)
    assert state.scale == 1.0


def test_a_fall_behind_resets_the_clean_streak():
    state = learn(learn(Derating(0.5), fell_behind=False), fell_behind=True)
    assert state.clean_runs == 0
    assert state.scale == 0.25


# --- the compile ----------------------------------------------------------------------

FABRIC = """\
name: cap
dilation: {dilation}
topology:
  kind: leaf_spine
  spines: 2
  leaves: 2
  hosts_per_leaf: 4
  host_link: {{port: 100GBASE-CR1, length: 2m}}
  fabric_link: {{port: 400GBASE-DR4, length: 100m}}
workload:
  traffic:
{traffic}
"""
INCAST = """\
    - name: incast
      kind: udp_incast
      senders: [h1, h2, h5, h6]
      receiver: h8
      tclass: roce
      duration: 1ms
"""


def _loaded(traffic: str = INCAST, dilation: str = "auto", extra: str = ""):
    return load_config_text(FABRIC.format(dilation=dilation, traffic=traffic) + extra,
                            "cap.yaml")


def test_the_default_fabrics_incast_gets_a_d_from_its_need_not_its_fastest_port():
    plan = compile_plan(_loaded(), capacity=CAP)
    c = plan.dilation.capacity
    assert plan.dilation.rule == "capacity"
    assert plan.dilation.factor == max(c.need_factor, c.port_factor, c.rate_factor,
                                       c.pfc_factor)
    assert c.need_cores <= c.usable_cores
    # The per-port rule gave 2000 (400G spine ports at 200 Mb/s wall).
    assert plan.dilation.factor < 2000
    assert c.busiest_port == "leaf2:" + plan.node("leaf2").interfaces[3].ifname


def test_below_the_pfc_floor_the_emulated_loop_would_overflow_lossless_queues():
    # The CPU allows D = 100 here; at 100 and 200 the emulated PFC loop (~2 ms of wall
    # time) needs more headroom than leaf buffers hold, at 500 egress protection must
    # pause below the configured XOFF to make room for it, at 1000 neither.
    plan = compile_plan(_loaded(), capacity=CAP)
    c = plan.dilation.capacity
    assert max(c.need_factor, c.port_factor, c.rate_factor) == 100
    assert plan.dilation.factor == c.pfc_factor == 1000
    assert not any("cannot absorb" in w or "emulated PFC loop answers" in w
                   or "egress protection pauses" in w for w in plan.warnings)
    assert any("cannot absorb" in w
               for w in compile_plan(_loaded(dilation="200"), capacity=CAP).warnings)
    assert any("egress protection pauses" in w
               for w in compile_plan(_loaded(dilation="500"), capacity=CAP).warnings)
    assert "emulated PFC loop" in plan.dilation.why()


def test_without_pfc_the_floor_does_not_hold_d_up():
    plan = compile_plan(_loaded(extra="qos:\n  default:\n    pfc: {enabled: false}\n"),
                        capacity=CAP)
    c = plan.dilation.capacity
    assert plan.dilation.factor == max(c.need_factor, c.port_factor, c.rate_factor) == 100


def test_paths_count_ecmp_hops_once_whichever_way_they_go():
    # h1 -> h8 crosses leaf1, a spine and leaf2: 4 egress ports whichever spine ECMP picks;
    # h5 -> h8 stays on leaf2: 2.
    loaded = _loaded()
    need = plan_need(loaded, compile_plan(loaded, capacity=CAP))
    assert need.longest_path_hops == 4
    share_pps = 25 * G / (8 * (9000 - 28 + 66))
    assert need.hop_pps == pytest.approx(share_pps * (4 + 4 + 2 + 2))


def test_a_roce_workload_counts_its_acks_and_its_mtu():
    traffic = """\
    - name: incast
      kind: roce_incast
      senders: [h1]
      receiver: h8
      duration: 1ms
"""
    loaded = _loaded(traffic)
    need = plan_need(loaded, compile_plan(loaded, capacity=CAP))
    data_pps = 100 * G / (8 * (4096 + 82))
    assert need.agent_send_pps["roce"] == pytest.approx(data_pps * (1 + 1 / 16))
    assert need.hop_pps == pytest.approx(data_pps * 4 * (1 + 1 / 16))


def test_a_configured_udp_rate_is_what_the_stream_offers():
    traffic = """\
    - name: pair
      kind: udp_pairs
      pairs: [[h1, h2]]
      rate: 10Gbps
      size: 1000
      duration: 1ms
"""
    loaded = _loaded(traffic)
    need = plan_need(loaded, compile_plan(loaded, capacity=CAP))
    assert need.agent_send_pps["udp"] == pytest.approx(10 * G / (8 * 1066))
    assert need.longest_path_hops == 2


def test_a_fabric_without_workload_keeps_the_per_port_rule():
    bare = FABRIC.split("workload:")[0].format(dilation="auto")
    plan = compile_plan(load_config_text(bare, "cap.yaml"), capacity=CAP)
    assert plan.dilation.rule == "port budget"
    assert plan.dilation.factor == 2000          # 400G spine ports at 200 Mb/s wall
    assert "no workload" in plan.dilation.why()


def test_a_pinned_per_port_budget_keeps_the_per_port_rule_on_every_machine():
    loaded = _loaded(extra="max_wall_port_rate: 400Mbps\n")
    for cap in (CAP, Capacity(1e9, 64, CAP.agents, "fast")):
        plan = compile_plan(loaded, capacity=cap)
        assert plan.dilation.rule == "port budget"
        assert plan.dilation.factor == 1000


def test_a_fixed_d_below_the_capacity_is_warned_about():
    plan = compile_plan(_loaded(dilation="10"), capacity=CAP)
    assert plan.dilation.factor == 10
    assert any("dilation D=10 needs" in w and "auto would pick" in w for w in plan.warnings)
    fine = compile_plan(_loaded(dilation="5000"), capacity=CAP)
    assert not any("dilation D=" in w for w in fine.warnings)
    # A D that is no 1-2-5 step is judged by the unrounded need: 80 fits a need of 50.
    least = compile_plan(_loaded(), capacity=CAP).dilation.capacity.least_factor
    assert 50 < least <= 80
    odd = compile_plan(_loaded(dilation="80"), capacity=CAP)
    assert not any("dilation D=" in w for w in odd.warnings)


def test_the_plan_says_why_it_chose_d():
    plan = compile_plan(_loaded(), capacity=CAP)
    why = plan.dilation.why()
    assert f"D={plan.dilation.factor} (auto, capacity rule" in why
    assert "margin 0.5" in why and "test" in why
    derated = compile_plan(_loaded(), capacity=Capacity(
        CAP.hop_pps_per_core, CAP.cores, CAP.agents, "test", 0.5, "derated to 0.5 ..."))
    assert "derated to 0.5" in derated.dilation.why()
    assert derated.dilation.factor >= plan.dilation.factor


def test_the_compile_is_pure_same_inputs_same_plan():
    a = compile_plan(_loaded(), capacity=CAP).to_json()
    b = compile_plan(_loaded(), capacity=CAP).to_json()
    assert a == b
