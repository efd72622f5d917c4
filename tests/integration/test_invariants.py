"""A run names every invariant it breaks: each test breaks one on purpose and reads the verdict.

Small single-switch fabrics at D = 1000 (a 3:1 UDP incast into h4 on the lossless
class, 1 ms; 600 KB of buffer a port, XOFF 100 KB an ingress), run with `testbed
run`'s own runner. Each test breaks the emulated fabric in one way, right after it
is up (RunOptions.on_up) or by its config, and checks that summary.json's
`invariants` and `fidelity` name that invariant, the place and a size, and that a
clean run of the same fabric names none:

- (a) queue: the departure hook of one port is taken off its peer, so the port
  program never sees that port's packets leave;
- (b) + (c) headroom and lossless drops: the PFC agents are not started, so no
  pause ever comes while the switch's static thresholds are passed;
- (c) lossless drops are not charged to a class whose port has PFC off;
- (e) conservation: a blackhole route in the switch drops the packets to h4
  where no counter of the testbed sees them; and a deliberately slow receiver
  (its agent stopped for half a second) loses datagrams in its own socket
  buffer, which the run counts and names, so conservation holds.
(d) reordering has no reliable way to be provoked here; tests/unit/test_invariants.py
feeds the checker a receiver's reordered flow, and tests/integration/test_ordering.py
sends one flow across CPUs.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading

import pytest

from testbed.config import load_config_text
from testbed.net.portprog import FILTER_PRIO
from testbed.plan import compile_plan
from testbed.run import runner
from testbed.run.runner import RunOptions, run_config
from tests.conftest import unique_lab

pytestmark = [pytest.mark.root, pytest.mark.slow]

FABRIC = """\
name: {lab}
dilation: 1000
topology: {{kind: single_switch, hosts: 4, host_link: {{port: 100GBASE-CR1, length: 2m}}}}
qos:
  default:
    buffer: {{3: 600KB}}
    ecn: {{kmin: 20KB, kmax: 80KB}}
    pfc: {{enabled: {pfc}, xoff: 100KB}}
workload:
  drain: 100us
  traffic:
    - {{name: incast, kind: udp_incast, senders: [h1, h2, h3], receiver: h4, tclass: roce,
       duration: 1ms}}
"""


def _run(tmp_path, pfc: bool = True, on_up=None, on_sample=None) -> dict:
    loaded = load_config_text(FABRIC.format(lab=unique_lab("inv"), pfc=str(pfc).lower()),
                              "invariants.yaml")
    plan = compile_plan(loaded)
    options = RunOptions(runs_root=tmp_path, say=lambda _m: None, on_up=on_up)
    if on_sample is not None:
        options.on_sample = lambda phase, totals, _t: on_sample(plan, phase, totals)
    result = run_config(loaded, plan, options)
    return json.loads((result.run_dir / "summary.json").read_text())


def _pids_in(netns: str, *words: str) -> list[int]:
    """Processes inside a lab namespace whose command line has every word, or whose name
    does (an agent forked from the run's zygote keeps the zygote's command line and is
    named `udp recv` for `python -m agents.udp recv`: agents/runtime/zygote.py)."""
    ino = os.stat(f"/var/run/netns/{netns}").st_ino
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}/ns/net").st_ino != ino:
                continue
            argv = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
            name = open(f"/proc/{entry}/comm", "rb").read().split()
        except OSError:
            continue
        if (all(w.encode() in argv for w in words)
                or all(w.removeprefix("agents.").encode() in name for w in words)):
            out.append(int(entry))
    return out


def _held(summary: dict) -> dict[str, bool]:
    return {name: c["held"] for name, c in summary["invariants"]["checks"].items()}


def _violations(summary: dict, name: str) -> list[dict]:
    return [v for v in summary["invariants"]["violations"] if v["invariant"] == name]


def test_a_clean_run_holds_every_invariant(tmp_path):
    summary = _run(tmp_path)
    assert _held(summary) == dict.fromkeys(_held(summary), True), summary["fidelity"]
    assert not [n for n in summary["fidelity"] if n.startswith("invariant")]
    queue = summary["invariants"]["checks"]["queue"]
    assert queue["max_abs_diff_bytes"] <= queue["tolerance_bytes"]
    streams = summary["invariants"]["streams"]
    assert len(streams) == 3 and all(s["sent"] == s["received"] > 0 for s in streams)


def test_a_lost_departure_hook_breaks_the_queue_invariant(tmp_path):
    def unhook(plan) -> None:
        sw = plan.node("sw1")
        port = next(i for i in sw.interfaces if i.peer.node == "h4")
        peer = plan.node("h4")
        subprocess.run(["nsenter", f"--net=/var/run/netns/{peer.netns}", "tc", "filter",
                        "del", "dev", port.peer.ifname, "ingress", "prio", str(FILTER_PRIO)],
                       check=True)

    summary = _run(tmp_path, on_up=unhook)
    assert _held(summary)["queue"] is False
    bad = _violations(summary, "queue")
    assert [v["where"] for v in bad] == [f"sw1:{_port_to(summary, 'h4')} TC3"]
    assert bad[0]["amount"] > 100_000 and bad[0]["ts_fabric_ns"] is not None
    notes = [n for n in summary["fidelity"] if "(a) the queue ECN and PFC decide on" in n]
    assert notes and "sw1:" in notes[0]
    # the fabric looked full to the drain, which gave up and said so
    assert any("still held" in n for n in summary["fidelity"])


def test_no_pfc_agents_break_headroom_and_lossless_drops(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "start_pfc_agents", lambda *a, **k: [])
    summary = _run(tmp_path)
    held = _held(summary)
    assert held["headroom"] is False and held["lossless_drop"] is False
    head = _violations(summary, "headroom")
    assert {v["where"].split()[0] for v in head} == {"sw1"}
    assert all(v["amount"] > 0 and v["unit"] == "B" for v in head)
    drops = _violations(summary, "lossless_drop")
    assert drops and drops[0]["where"].startswith("sw1:") and drops[0]["amount"] > 0
    assert "tail" in drops[0]["detail"]
    # the drops have a counted place: conservation still holds
    assert held["conservation"] is True
    lost = sum(s["sent"] - s["received"] for s in summary["invariants"]["streams"])
    assert lost == sum(s["fabric_drops"] for s in summary["invariants"]["streams"]) > 0


def test_drops_where_pfc_is_off_are_reported_not_charged(tmp_path):
    summary = _run(tmp_path, pfc=False)
    held = _held(summary)
    assert held["lossless_drop"] is True and held["conservation"] is True
    unprotected = summary["invariants"]["checks"]["lossless_drop"]["unprotected_drops"]
    assert unprotected and sum(unprotected.values()) == summary["totals"]["queue_drops"] > 0


def test_an_uncounted_loss_breaks_conservation(tmp_path):
    def blackhole(plan) -> None:
        h4 = plan.node("h4").interfaces[0].address.split("/")[0]
        subprocess.run(["ip", "-n", plan.node("sw1").netns, "route", "add", "blackhole",
                        f"{h4}/32"], check=True)

    summary = _run(tmp_path, on_up=blackhole)
    assert _held(summary)["conservation"] is False
    bad = _violations(summary, "conservation")
    assert {v["where"] for v in bad} == {f"stream incast-h{i}-h4" for i in (1, 2, 3)}
    for v in bad:
        assert v["amount"] > 0 and "no counted place" in v["detail"]
    assert _held(summary)["queue"] is True


def _cont(pids: list[int]) -> None:
    # the run may be over by now (its stop continued and ended the receiver)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def test_a_slow_receivers_socket_drops_are_counted_and_named(tmp_path):
    stopped: list[int] = []

    def stall(plan, phase: str, totals) -> None:
        # once data flows, stop h4's receiver for 2 s of wall time: the incast (1 s of
        # wall time at line rate) outruns its 4 MB socket buffer (8 MB as the kernel counts)
        if phase != "workload" or stopped or not totals.delivered_bytes:
            return
        pids = _pids_in(plan.node("h4").netns, "agents.udp", "recv")
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        stopped.extend(pids or [0])
        threading.Timer(2.0, lambda: _cont(pids)).start()

    summary = _run(tmp_path, on_sample=stall)
    assert stopped and stopped[0], "the receiver was found and stopped"
    inv = summary["invariants"]
    lost = sum(s["sent"] - s["received"] for s in inv["streams"])
    assert lost > 0 and sum(s["fabric_drops"] for s in inv["streams"]) == 0
    assert inv["host_socket_drops"]["h4"] >= lost
    assert inv["checks"]["conservation"]["held"] is True
    notes = [n for n in summary["fidelity"] if "own socket buffer" in n]
    assert notes and "incast-recv-h4" in notes[0]


def _port_to(summary: dict, host: str) -> str:
    """sw1's port toward `host`: single_switch numbers swpN for hN."""
    return f"swp{host[1:]}"
