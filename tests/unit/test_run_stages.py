"""The run's stages that need no fabric, each on its own: notes are recorded as they are
noted, the kernel note says what is not emulated, and the wait for ready agents names
the ones that never got ready or exited first."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

from testbed.config import load_config
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
    loaded = load_config(REPO / "configs" / "examples" / "dcqcn-on.yaml")
    plan = compile_plan(loaded)
    specs = expand_workload(loaded.fabric, plan)
    servers = [s for s in specs if s.role == "receiver"][:3]
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


def test_agents_are_stopped_together_so_each_has_the_whole_grace_period(
        tmp_path: Path) -> None:
    """Three agents that each need 2 s after SIGTERM to write their counters: stopped one
    after the other with a 5 s grace each, the last would be asked only after the others
    had gone; asked together, all three finish and report."""
    loaded = load_config(REPO / "configs" / "examples" / "dcqcn-on.yaml")
    plan = compile_plan(loaded)
    specs = expand_workload(loaded.fabric, plan)[:3]
    (tmp_path / "agents").mkdir()
    store = Store(tmp_path / "c.sqlite", create=True)
    run = Run(loaded=loaded, plan=plan, options=RunOptions(say=lambda _m: None),
              run_dir=tmp_path, store=store, notes=Notes(store, lambda: 0), probe={},
              specs=specs, period_ns=1, drain_ns=1, span_ns=1)
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
