"""The in-network all-reduce across a real emulated fabric.

One switch, three hosts on 100GBASE-CR1 (2 m), dilation 1000 (a 100 Gb/s port runs at
100 Mb/s of wall rate). The aggregator (`python -m agents.aggregator`) runs in the
switch's namespace on its swp1 address, standing in for the switch's ALU; a worker in
each host's namespace (tests/integration/ina_worker.py, i.e. allreduce_ina) sums 1 MiB
of float32 through it. Requests and results are DSCP 26, the lossless RoCE class.
Twice: on a clean fabric, and with 2 % loss both ways on h1's link (an impairment the
port program applies), which the workers repair by timeout and retransmission and the
aggregator by answering from its shadow copies.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest

from agents.collectives.ina import exponent_proposal, result_bound
from agents.runtime.control import read_snapshot
from agents.timebase import Dilation
from agents.wire.ina import DEFAULT_SLOT_ELEMENTS, DEFAULT_SLOTS
from testbed.config import load_config_text
from testbed.net import apply_plan, destroy_lab
from testbed.net.counters import read_counters
from testbed.net.namespaces import list_testbed_namespaces
from testbed.plan import Plan, compile_plan
from testbed.run.procs import AgentProcess, start_agent, start_process
from tests.conftest import REPO, unique_lab
from tests.integration.ina_worker import worker_data

pytestmark = [pytest.mark.root, pytest.mark.slow]

D = 1000
MIB = 1 << 20
N = 3
SLOTS = DEFAULT_SLOTS           # 32
ELEMENTS = DEFAULT_SLOT_ELEMENTS  # 2048: 8 KiB of payload + 32 header bytes, one jumbo frame
WORKER_PORT = 47000
AGG_PORT = 48000
ROCE_TC = 3

FABRIC_YAML = """\
name: {name}
dilation: {d}
topology: {{kind: single_switch, hosts: 3, host_link: {{port: 100GBASE-CR1, length: 2m}}}}
"""
LOSSY = "impairments: [{{link: [h1, sw1], direction: both, loss: {loss}}}]\n"
# 200 us of fabric time (0.2 s wall): a window's serialisation is ~21 us, and each loss
# costs one timeout
TIMEOUT_NS = 200_000


@pytest.fixture(scope="module", params=[0.0, 0.02], ids=["clean", "loss2pct"])
def fabric(request) -> Iterator[Plan]:
    lab = unique_lab("ina")
    text = FABRIC_YAML.format(name=lab, d=D)
    if request.param:
        text += LOSSY.format(loss=request.param)
    plan = compile_plan(load_config_text(text, "<test>"))
    try:
        apply_plan(plan)
        yield plan
    finally:
        destroy_lab(plan.lab)
    left = [n for n in list_testbed_namespaces() if n.startswith(f"tb-{lab}")]
    assert not left, f"namespaces left behind: {left}"


def _ip(plan: Plan, node: str, k: int = 0) -> str:
    return plan.node(node).interfaces[k].address.split("/")[0]


def plan_loss(plan: Plan) -> float:
    """The largest per-port drop probability beyond the PHY's (the impairment)."""
    return max(i.loss_probability for n in plan.nodes for i in n.interfaces
               if i.loss_probability > 1e-6) if any(
        i.loss_probability > 1e-6 for n in plan.nodes for i in n.interfaces) else 0.0


def _class_packets(plan: Plan) -> dict[tuple[str, str], int]:
    _, classes = read_counters(plan)
    return {(c.node, c.ifname): c.packets for c in classes if c.tc == ROCE_TC}


def _wait_ready(proc: AgentProcess, path, timeout_s: float = 30) -> dict:
    deadline = time.monotonic() + timeout_s
    while not path.exists() or not path.read_text().strip():
        if proc.popen.poll() is not None or time.monotonic() > deadline:
            proc.stop()
            raise AssertionError(f"aggregator not ready: {proc.popen.communicate()}")
        time.sleep(0.02)
    return json.loads(path.read_text())


def test_three_workers_all_reduce_1mib_float32_through_the_switch(fabric, tmp_path,
                                                                   monkeypatch):
    monkeypatch.chdir(REPO)            # agents and the worker run as `python -m` from here
    plan = fabric
    sw = plan.switches()[0]
    hosts = [h.name for h in plan.hosts()]
    agg_ip = _ip(plan, sw.name)
    elements = MIB // 4
    jobs = [{"id": 1, "members": [[w, _ip(plan, h), WORKER_PORT] for w, h in enumerate(hosts)],
             "slots": SLOTS, "slot_elements": ELEMENTS}]
    before = _class_packets(plan)
    procs: list[AgentProcess] = []
    try:
        agg = start_agent(plan.lab, sw.netns, "agents.aggregator",
                          ["--bind", agg_ip, "--port", str(AGG_PORT), "--jobs", json.dumps(jobs),
                           "--dilation", str(D), "--control-sock", str(tmp_path / "agg.sock"),
                           "--ready-file", str(tmp_path / "agg.ready"),
                           "--out", str(tmp_path / "agg.json")], "ina-aggregator")
        procs.append(agg)
        assert _wait_ready(agg, tmp_path / "agg.ready") == {"bind": agg_ip, "port": AGG_PORT}
        start = time.monotonic_ns() + 2_000_000_000    # released together
        for w, h in enumerate(hosts):
            procs.append(start_process(plan.lab, plan.node(h).netns, [
                sys.executable, "-m", "tests.integration.ina_worker", "--bind", _ip(plan, h),
                "--port", str(WORKER_PORT), "--aggregator", f"{agg_ip}:{AGG_PORT}",
                "--job-id", "1", "--worker-id", str(w), "--workers", str(N),
                "--slots", str(SLOTS), "--slot-elements", str(ELEMENTS),
                "--elements", str(elements), "--dilation", str(D),
                "--timeout-ns", str(TIMEOUT_NS), "--start-at-mono-ns", str(start),
                "--out-npy", str(tmp_path / f"w{w}.npy")],
                f"ina-worker-{h}"))
        workers = [p.result(timeout_s=180) for p in procs[1:]]
        live = read_snapshot(str(tmp_path / "agg.sock"))
        agg.stop()
        a = agg.result(timeout_s=30)
    finally:
        for p in procs:
            p.stop()
    after = _class_packets(plan)
    assert all("error" not in w for w in workers), workers

    # correct: every worker holds the same bits, within the stated bound of the exact sum
    xs = [worker_data(w, elements, "float32") for w in range(N)]
    outs = [np.load(tmp_path / f"w{w}.npy") for w in range(N)]
    assert all(np.array_equal(o, outs[0]) for o in outs)
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    worst_err = worst_ratio = 0.0
    for d in range(elements // ELEMENTS):
        sl = slice(d * ELEMENTS, (d + 1) * ELEMENTS)
        agreed = max(exponent_proposal(x[sl]) for x in xs)
        err = np.abs(outs[0][sl].astype(np.float64) - exact[sl])
        bound = result_bound(agreed, N, outs[0][sl])
        assert np.all(err <= bound), d
        worst_err = max(worst_err, float(err.max()))
        worst_ratio = max(worst_ratio, float((err / bound).max()))

    # consistent: the aggregator saw what the workers sent and sent what they took
    chunks = elements // ELEMENTS + SLOTS          # data chunks + one exponent-only window
    lossy = bool(plan_loss(plan))
    assert live["completed"] == chunks
    assert a["completed"] == chunks and a["slots_in_use"] == 0
    assert a["aggregated"] == N * chunks
    assert a["results_sent"] == N * chunks + a["shadow_answers"]
    sent = sum(w["packets_sent"] for w in workers)
    taken = sum(w["packets_received"] for w in workers)
    retx = sum(w["retransmissions"] for w in workers)
    assert sent == N * chunks + retx
    assert a["requests"] == a["aggregated"] + a["duplicates"] + a["shadow_answers"]
    if lossy:
        # every loss is repaired: h1 retransmits, the aggregator answers from its copies
        assert a["packets_received"] <= sent and taken <= a["packets_sent"]
        assert (sent - a["packets_received"]) + (a["packets_sent"] - taken) > 0
        assert workers[0]["retransmissions"] > 0 and workers[0]["timeouts"] > 0
        assert a["shadow_answers"] + a["duplicates"] > 0
    else:
        assert retx == 0 and a["duplicates"] == 0 and a["shadow_answers"] == 0
        assert a["packets_received"] == sent and a["packets_sent"] == taken
        assert a["bytes_received"] == sum(w["bytes_sent"] for w in workers)
    assert a["overflow_elements"] == 0 and sum(a["malformed"].values()) == 0
    assert {k for k, v in a["drops"].items() if v} <= {"stale"}
    assert a["stopped_by"] == "signal:SIGTERM"
    for w in workers:
        assert w["results"] == chunks and w["bytes_sent"] >= MIB
    # lossless class both ways: every host sent its requests, and every switch port to a
    # host its results, in TC 3
    for h in hosts:
        port = next(i.ifname for i in sw.interfaces if i.peer.node == h)
        assert after[(h, "eth0")] - before.get((h, "eth0"), 0) >= chunks
        assert after[(sw.name, port)] - before.get((sw.name, port), 0) >= chunks

    dil = Dilation(D)
    elapsed = max(w["elapsed_fabric_ns"] for w in workers)
    print(f"\nINA all-reduce, {N} workers x 1 MiB float32, {SLOTS} slots x {ELEMENTS} "
          f"elements, D={D}, loss {plan_loss(plan):.0%} on h1's link: "
          f"{elapsed / 1e3:.1f} us fabric "
          f"({dil.to_wall_s(elapsed):.2f} s wall), algorithm bandwidth "
          f"{MIB * 8 / elapsed:.1f} Gb/s fabric; {retx} retransmissions, "
          f"{sum(w['timeouts'] for w in workers)} timeouts; aggregator: {a['completed']} chunks, "
          f"{a['aggregated']} contributions, {a['duplicates']} duplicates, "
          f"{a['shadow_answers']} shadow answers, slots in use max {a['slots_in_use_max']}, "
          f"chunk open time avg {a['open_fabric_ns']['avg']} / max "
          f"{a['open_fabric_ns']['max']} ns fabric; max |error| {worst_err:.3g} "
          f"({worst_ratio:.2f} of the bound)")
