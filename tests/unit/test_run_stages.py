"""The run's stages that need no fabric, each on its own: notes are recorded as they are
noted, the kernel note says what is not emulated, and the wait for ready agents names
the ones that never got ready or exited first."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from testbed.config import load_config, load_config_text
from testbed.plan import compile_plan
from testbed.results.store import Store
from testbed.run.procs import AgentProcess
from testbed.run.runner import Notes, Run, RunOptions, kernel_notes, stop_agents, wait_ready
from testbed.run.workload import expand_workload, ready_file
from tests.conftest import REPO


def test_a_note_is_in_the_store_as_soon_as_it_is_noted(tmp_path: Path) -> None:
    store = Store(tmp_path / "c.sqlite", create=True)
    clock = iter([5, 7])
    notes = Notes(store, lambda: next(clock))
    notes.add("first")
    # a run killed here still has the first note in its database
    assert [(e["ts_fabric_ns"], e["message"]) for e in store.events("fidelity")] == [
        (5, "first")]
    notes.extend(["second"])
    assert notes.items == ["first", "second"]
    assert [e["ts_fabric_ns"] for e in store.events("fidelity")] == [5, 7]
    store.close()


def test_the_kernel_note_names_the_missing_delay_and_why() -> None:
    plan = compile_plan(load_config(REPO / "configs" / "default.yaml"))
    [note] = kernel_notes(plan, {"missing": ["netem"], "kernel": "6.1-min"})
    assert "not emulated (kernel 6.1-min has no sch_netem)" in note
    assert "short by 2.88 us fabric" in note
    [note] = kernel_notes(plan, {"missing": ["netem", "ifb"], "kernel": "6.1-min"})
    assert "(kernel 6.1-min has no sch_netem and no IFB devices)" in note


def test_a_kernel_with_netem_gets_no_missing_delay_note() -> None:
    # the builder puts the links' delay on the wire there (testbed/net/netem.py)
    plan = compile_plan(load_config(REPO / "configs" / "default.yaml"))
    assert kernel_notes(plan, {"missing": ["red"], "kernel": "6.1.0-stock"}) == []


def _proc(name: str, code: str) -> AgentProcess:
    return AgentProcess(name, "none", subprocess.Popen([sys.executable, "-c", code],
                                                       stdout=subprocess.PIPE,
                                                       stderr=subprocess.PIPE, text=True))


def test_waiting_for_ready_agents_names_those_that_exit_or_never_get_ready(
        tmp_path: Path, monkeypatch) -> None:
    # RoCE into three hosts: three responders (one per receiving host) the run waits for
    text = (REPO / "configs" / "examples" / "dcqcn-on.yaml").read_text()
    loaded = load_config_text(text.split("workload:")[0] + (
        "workload:\n  traffic:\n    - {name: all, kind: roce_all_to_all, hosts: [h1, h2, h3], "
        "duration: 1ms}\n"), "three.yaml")
    plan = compile_plan(loaded)
    specs = expand_workload(loaded.fabric, plan)
    servers = [s for s in specs if s.role == "receiver"]
    assert len(servers) == 3
    (tmp_path / "agents").mkdir()
    store = Store(tmp_path / "c.sqlite", create=True)
    run = Run(loaded=loaded, plan=plan, options=RunOptions(say=lambda _m: None),
              run_dir=tmp_path, store=store, notes=Notes(store, lambda: 0), probe={},
              specs=specs, period_ns=1, drain_ns=1, span_ns=1)
    ready = ready_file(run.agents_dir, servers[0])
    run.agents = [
        (servers[0], _proc("ok", f"open({str(ready)!r}, 'w'); import time; time.sleep(5)")),
        (servers[1], _proc("dies", "raise SystemExit(3)")),
        (servers[2], _proc("slow", "import time; time.sleep(5)")),
    ]
    monkeypatch.setattr("testbed.run.runner.READY_TIMEOUT_S", 1.0)
    try:
        notes = wait_ready(run, threading.Event())
    finally:
        for _, proc in run.agents:
            proc.stop()
    store.close()
    assert len(notes) == 2
    assert f"RoCE server {servers[2].name} on {servers[2].node} was not ready 1 s" in notes[0]
    assert f"RoCE server {servers[1].name} on {servers[1].node} exited during set-up " \
           "(code 3)" in notes[1]



def _dcqcn_run(tmp_path: Path, agents: int) -> Run:
    """A Run of the dcqcn-on example with its first `agents` workload specs."""
    loaded = load_config(REPO / "configs" / "examples" / "dcqcn-on.yaml")
    plan = compile_plan(loaded)
    (tmp_path / "agents").mkdir()
    store = Store(tmp_path / "c.sqlite", create=True)
    return Run(loaded=loaded, plan=plan, options=RunOptions(say=lambda _m: None),
               run_dir=tmp_path, store=store, notes=Notes(store, lambda: 0), probe={},
               specs=expand_workload(loaded.fabric, plan)[:agents], period_ns=1, drain_ns=1,
               span_ns=1)

def test_agents_are_stopped_together_so_each_has_the_whole_grace_period(
        tmp_path: Path) -> None:
    """Three agents that each need 2 s after SIGTERM to write their counters: stopped one
    after the other with a 5 s grace each, the last would be asked only after the others
    had gone; asked together, all three finish and report."""
    run = _dcqcn_run(tmp_path, 3)
    specs, store = run.specs, run.store
    slow_exit = ("import json, signal, sys, time\n"
                 "def bye(*_):\n"
                 "    time.sleep(2); print(json.dumps({'t': time.monotonic()})); sys.exit(0)\n"
                 "signal.signal(signal.SIGTERM, bye)\n"
                 "print('up', flush=True)\n"
                 "time.sleep(60)\n")
    run.agents = [(s, _proc(s.name, slow_exit)) for s in specs]
    for _, proc in run.agents:
        assert proc.popen.stdout.readline().strip() == "up"
    t0 = time.monotonic()
    try:
        stop_agents(run)
    finally:
        for _, proc in run.agents:
            proc.stop()
    store.close()
    assert sorted(run.results) == sorted(s.name for s in specs)
    assert time.monotonic() - t0 < 5.5         # in parallel: ~2 s, not 3 x 2 s
    assert not [n for n in run.notes.items if "without counters" in n]


def test_an_agents_last_line_longer_than_a_pipe_still_arrives_whole(tmp_path: Path) -> None:
    """A RoCE responder serving 127 streams prints ~0.5 MB of counters as it stops: the
    run must read them while the agent writes, not wait for an exit that the full pipe
    blocks (the line came cut at 64 KiB, after the agent was killed)."""
    run = _dcqcn_run(tmp_path, 1)
    specs, store = run.specs, run.store
    big = ("import json, signal, sys, time\n"
           "def bye(*_):\n"
           "    print(json.dumps({'pad': 'x' * 500000})); sys.exit(0)\n"
           "signal.signal(signal.SIGTERM, bye)\n"
           "print('up', flush=True)\n"
           "time.sleep(60)\n")
    run.agents = [(s, _proc(s.name, big)) for s in specs]
    for _, proc in run.agents:
        assert proc.popen.stdout.readline().strip() == "up"
    t0 = time.monotonic()
    try:
        stop_agents(run)
    finally:
        for _, proc in run.agents:
            proc.stop()
    store.close()
    assert len(run.results[specs[0].name]["pad"]) == 500000
    assert time.monotonic() - t0 < 4          # not the 5 s grace, then a kill


# --- fixed cost: the start margin, late senders, the drain, stopping, timings ----------


def test_the_go_margin_covers_waking_every_sender_on_the_cpus() -> None:
    from testbed.run import runner

    one = runner.go_margin_s(1, cpus=2)
    assert one == pytest.approx(runner.GO_MARGIN_BASE_S + runner.GO_MARGIN_PER_ROUND_S)
    # four senders on two CPUs wake in two rounds; 127 in 64
    assert runner.go_margin_s(4, cpus=2) == pytest.approx(
        runner.GO_MARGIN_BASE_S + 2 * runner.GO_MARGIN_PER_ROUND_S)
    assert runner.go_margin_s(127, cpus=2) > runner.go_margin_s(4, cpus=2)
    assert runner.go_margin_s(127, cpus=128) == pytest.approx(one)


def _default_run(tmp_path: Path) -> Run:
    loaded = load_config(REPO / "configs" / "default.yaml")
    plan = compile_plan(loaded)
    specs = expand_workload(loaded.fabric, plan)
    (tmp_path / "agents").mkdir()
    store = Store(tmp_path / "c.sqlite", create=True)
    return Run(loaded=loaded, plan=plan, options=RunOptions(say=lambda _m: None),
               run_dir=tmp_path, store=store, notes=Notes(store, lambda: 0), probe={},
               specs=specs, period_ns=1, drain_ns=1, span_ns=1)


def test_a_sender_that_saw_the_common_start_late_is_named(tmp_path: Path) -> None:
    from agents.runtime.output import write_json_atomically
    from testbed.run.runner import late_senders
    from testbed.run.workload import armed_file

    run = _default_run(tmp_path)
    senders = [s for s in run.specs if s.role == "sender"]
    assert len(senders) == 4
    start = 5_000_000_000
    procs = []
    # seen 0 ms / 50 ms before / 30 ms after its start time; the last never armed
    for spec, late_ms, code in zip(senders, (0, -50, 30, None), ("0", "0", "0", "3"),
                                   strict=True):
        armed = armed_file(run.agents_dir, spec)
        if late_ms is not None:
            write_json_atomically(str(armed), {"armed_mono_ns": 1, "start_mono_ns": start,
                                               "go_seen_mono_ns": start + late_ms * 10**6})
        popen = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})",
                                  "--armed-file", str(armed)])
        popen.wait()
        procs.append(AgentProcess(spec.name, "none", popen))
    run.agents = list(zip(senders, procs, strict=True))
    # a receiver is never a late sender, armed file or not
    receiver = next(s for s in run.specs if s.role == "receiver")
    run.agents.append((receiver, procs[0]))
    notes = late_senders(run)
    assert len(notes) == 1, notes
    assert f"{senders[2].name} on {senders[2].node} saw the common start 30 ms (wall) " \
           "after its start time" in notes[0]
    assert f"{run.plan.timebase.to_fabric_ns(30e6) / 1e3:,.1f} us fabric late" in notes[0]
    # one that exited 0 without ever arming sent nothing from its start: named too
    armed_file(run.agents_dir, senders[0]).unlink()
    notes = late_senders(run)
    assert any(f"{senders[0].name} on {senders[0].node} never armed" in n for n in notes)
    # one that armed but never saw the start (stopped first) is named as such
    write_json_atomically(str(armed_file(run.agents_dir, senders[0])), {"armed_mono_ns": 1})
    notes = late_senders(run)
    assert any(f"{senders[0].name} on {senders[0].node} never saw the common start" in n
               for n in notes)
    # (the one that exited 3 is named by the run's watch, not here)
    assert not any(senders[3].name in n for n in notes)
    run.store.close()


def test_the_default_drain_is_round_trips_or_a_sample_period(monkeypatch) -> None:
    from testbed.run import runner
    from testbed.run.fidelity import base_rtt_shortfall_ns

    plan = compile_plan(load_config(REPO / "configs" / "default.yaml"))
    rtt_ns = base_rtt_shortfall_ns(plan)
    assert rtt_ns > 0
    floor_ns = round(plan.timebase.to_fabric_ns(runner.DEFAULT_DRAIN_MIN_WALL_NS))
    assert runner.default_drain_ns(plan) == max(floor_ns, runner.DEFAULT_DRAIN_RTTS * rtt_ns)
    monkeypatch.setattr(runner, "DEFAULT_DRAIN_MIN_WALL_NS", 0)
    assert runner.default_drain_ns(plan) == runner.DEFAULT_DRAIN_RTTS * rtt_ns


def test_a_workload_drain_is_kept_as_given(tmp_path: Path) -> None:
    from testbed.config import load_config_text
    from testbed.run.runner import prepare

    text = (REPO / "configs" / "default.yaml").read_text().replace(
        "  traffic:\n", "  drain: 700us\n  traffic:\n")
    loaded = load_config_text(text, "drain.yaml")
    run = prepare(loaded, compile_plan(loaded), RunOptions(runs_root=tmp_path,
                                                            say=lambda _m: None))
    run.store.close()
    assert run.drain_ns == 700_000


def test_fabric_agents_are_all_asked_to_stop_before_any_is_waited_for(
        tmp_path: Path) -> None:
    """Each fabric agent winds down only once every one of them has been asked to (it
    waits for the others' SIGTERM, as a PFC agent's neighbours go down around it):
    asked one after the other, the first would be waited for before the second was
    asked, time out and be killed."""
    run = _default_run(tmp_path)
    stamps = tmp_path / "stamps"
    # stop() may send a second SIGTERM to an agent still winding down: like a real
    # agent's (a flag), the handler acts once
    code = ("import signal, sys, time\n"
            "def bye(*_):\n"
            "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "    open(sys.argv[1], 'a').write('term\\n')\n"
            "    deadline = time.monotonic() + 8\n"
            "    while open(sys.argv[1]).read().count('term') < 3:\n"
            "        if time.monotonic() > deadline:\n"
            "            sys.exit(1)\n"
            "        time.sleep(0.01)\n"
            "    open(sys.argv[1], 'a').write('exit\\n')\n"
            "    sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, bye)\n"
            "print('up', flush=True)\n"
            "time.sleep(60)\n")
    run.fabric_procs = [
        AgentProcess(f"pfc-x{k}", "none", subprocess.Popen(
            [sys.executable, "-c", code, str(stamps)], stdout=subprocess.PIPE, text=True))
        for k in range(3)]
    for proc in run.fabric_procs:
        assert proc.popen.stdout.readline().strip() == "up"
    try:
        stop_agents(run)
    finally:
        for proc in run.fabric_procs:
            proc.stop()
    run.store.close()
    lines = stamps.read_text().split()
    assert lines.count("term") == 3
    assert lines.count("exit") == 3              # none was killed for want of the others
    assert [p.popen.returncode for p in run.fabric_procs] == [0, 0, 0]


def test_run_timings_sum_stages_and_leave_the_workload_out_of_the_fixed_cost() -> None:
    from testbed.run.timings import RunTimings

    t = RunTimings()
    t.add("up", 0, 200_000_000)
    t.add("workload", 200_000_000, 2_200_000_000)
    t.add("drain", 2_200_000_000, 2_300_000_000)
    t.add("drain", 2_400_000_000, 2_450_000_000)     # a stage entered twice is summed
    with t.phase("report"):
        pass
    out = t.to_dict()
    assert out["seconds"]["drain"] == pytest.approx(0.15)
    assert out["fixed_cost_s"] == pytest.approx(0.35, abs=1e-3)
    assert [p["phase"] for p in out["phases"]] == ["up", "workload", "drain", "drain",
                                                   "report"]
    with pytest.raises(ValueError, match="unknown run phase 'warmup'"):
        t.add("warmup", 0, 1)


def test_udp_receivers_are_waited_for_and_every_udp_agent_gets_its_ready_file(
        tmp_path: Path) -> None:
    from testbed.workloads.base import AgentFiles
    from testbed.workloads.registry import REGISTRY

    run = _default_run(tmp_path)
    run.store.close()
    for spec in run.specs:
        kind = REGISTRY.of(spec.kind)
        # receivers listen before any sender starts; senders are not waited for
        assert kind.waits_ready(spec) is (spec.role == "receiver"), spec.name
        files = AgentFiles(ready=ready_file(run.agents_dir, spec), out=tmp_path / "o",
                           events=tmp_path / "e")
        assert kind.files_argv(spec, files) == ["--ready-file", str(files.ready)]


def test_a_slow_pfc_loop_is_named_only_when_a_lossless_invariant_failed(tmp_path: Path) -> None:
    from testbed.run.runner import measure_pfc_loop

    run = _default_run(tmp_path)
    d = run.plan.timebase.factor
    slow_fabric_ns = run.plan.dilation.pfc_loop_wall_ns // d + 1_000   # p99 past the plan
    for i in range(10):
        t = i * 100_000
        run.store.add_event(t, 0, "pfc_xoff", node="leaf1", port="swp1", tclass=3,
                            peer_node="h1", peer_port="eth0", crossed_ns_ago=100,
                            reason="ingress")
        run.store.add_event(t + slow_fabric_ns, 0, "pfc_paused", node="h1", port="eth0",
                            tclass=3, quanta=65535)
    run.invariants = {"checks": {"headroom": {"held": True}, "lossless_drop": {"held": True}}}
    measure_pfc_loop(run)
    assert run.pfc_reaction is not None and run.pfc_reaction["pauses"] == 10
    assert run.pfc_reaction["p99_wall_ns"] == (slow_fabric_ns + 100) * d
    assert not [n for n in run.notes.items if "emulated PFC loop" in n]   # no harm done
    run.invariants["checks"]["headroom"]["held"] = False
    measure_pfc_loop(run)
    assert [n for n in run.notes.items if "emulated PFC loop answered XOFFs" in n]
    run.store.close()


def test_every_timings_json_key_is_documented_in_run_format() -> None:
    """docs/run-format.md's timings.json section names every top-level key and every
    `agent_start` field the run writes."""
    from testbed.run.timings import RunTimings
    from testbed.run.zygote import agent_start_record
    from tests.conftest import REPO

    doc = (REPO / "docs" / "run-format.md").read_text()
    section = doc.split("## timings.json", 1)[1].split("\n## ", 1)[0]
    timings = RunTimings(agent_start=agent_start_record(True, None, {}))
    out = timings.to_dict()
    for key in out:
        assert f'"{key}"' in section, f"timings.json key {key} missing from run-format.md"
    for key in out["agent_start"]:
        assert f"`{key}`" in section, f"agent_start.{key} missing from run-format.md"
