"""The run's watch (testbed/run/watch.py) with injected clocks, processes and file
systems: which fault it names, once, and whether that fault ends the run. The machine's
clock is never stepped: a step is an injected CLOCK_REALTIME."""

from __future__ import annotations

import errno
import signal
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass, field

import pytest

from testbed.run import watch as watch_mod
from testbed.run.collector import AgentEndpoint, Collector, LiveTotals
from testbed.run.procs import AgentProcess
from testbed.run.watch import RunWatch, WatchedAgent, exit_words, is_disk_full, process_state


class FakePopen:
    def __init__(self, code: int | None = None, pid: int = 999_999_999) -> None:
        self.code, self.pid = code, pid

    def poll(self) -> int | None:
        return self.code


@dataclass
class FakeCollector:
    error: BaseException | None = None
    last_sample_mono_ns: int = 0
    period_wall_ns: int = 100_000_000
    totals: LiveTotals = field(default_factory=LiveTotals)


class Clocks:
    """CLOCK_MONOTONIC and CLOCK_REALTIME, moved by the test."""

    def __init__(self) -> None:
        self.mono = 1_000_000_000_000
        self.real = 1_800_000_000_000_000_000

    def advance(self, ns: int) -> None:
        self.mono += ns
        self.real += ns


def _agent(name: str, role: str, code: int | None = None, lossless: bool = False,
           endpoint: AgentEndpoint | None = None) -> WatchedAgent:
    proc = AgentProcess(name, "ns", FakePopen(code))  # type: ignore[arg-type]
    return WatchedAgent(name, "sw1", role, proc, endpoint, lossless)


def _watch(agents=(), collector=None, clocks=None, netns=None, exists=lambda _ns: True,
           free=lambda _p: 1 << 30, run_dir="") -> RunWatch:
    clocks = clocks or Clocks()
    return RunWatch(list(agents), netns or {}, lambda mono: mono // 1000, collector,
                    run_dir=run_dir, mono_ns=lambda: clocks.mono, real_ns=lambda: clocks.real,
                    netns_exists=exists, disk_free=free)


def test_a_killed_pfc_agent_ends_the_run_and_is_named_once():
    w = _watch([_agent("pfc-sw1", "pfc", code=-signal.SIGKILL, lossless=True)])
    (fault,) = w.check()
    assert (fault.kind, fault.who, fault.ends_run) == ("agent_exited", "pfc-sw1", True)
    assert "SIGKILL" in fault.message and "no longer lossless" in fault.message
    assert w.check() == [] and w.ends_run()


@pytest.mark.parametrize("role,code,found", [
    ("sender", 0, False),          # finished its schedule
    ("sender", 1, True),
    ("receiver", 0, False),        # a RoCE server whose client is done
    ("pfc", 0, True),              # the fabric's agents run until stopped
    ("receiver", -signal.SIGKILL, True),
])
def test_workload_agent_exits_are_faults_except_a_finished_sender(role, code, found):
    w = _watch([_agent("a", role, code=code, lossless=role == "pfc")])
    faults = w.check()
    assert bool(faults) is found
    assert w.ends_run() is (found and role == "pfc")    # only a PFC agent's death ends it


def test_a_dcqcn_agent_death_is_noted_and_the_run_goes_on():
    (fault,) = _watch([_agent("rxe-cc-h1", "rxe_cc", code=-9)]).check()
    assert not fault.ends_run and "DCQCN agent" in fault.message


def test_an_agent_that_stops_answering_is_hung_after_the_limit():
    clocks = Clocks()
    ep = AgentEndpoint("pfc-sw1", "sw1", "/nonexistent")
    ep.first_read_mono_ns = ep.last_ok_mono_ns = clocks.mono
    w = _watch([_agent("pfc-sw1", "pfc", lossless=True, endpoint=ep)], clocks=clocks)
    ep.failed_in_row = watch_mod.HUNG_READS
    clocks.advance(int(watch_mod.HUNG_WALL_S * 1e9) // 2)
    assert w.check() == []          # too soon
    clocks.advance(int(watch_mod.HUNG_WALL_S * 1e9))
    (fault,) = w.check()
    assert fault.kind == "agent_hung" and fault.ends_run
    assert "no answer to 3 snapshot requests" in fault.message


def test_a_slow_answer_or_two_is_not_a_hang():
    clocks = Clocks()
    ep = AgentEndpoint("x", "h1", "/nonexistent", failed_in_row=watch_mod.HUNG_READS - 1,
                       last_ok_mono_ns=clocks.mono)
    w = _watch([_agent("x", "receiver", endpoint=ep)], clocks=clocks)
    clocks.advance(10 * 10**9)
    assert w.check() == []


def test_a_stopped_process_is_hung_at_once():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        proc.send_signal(signal.SIGSTOP)
        for _ in range(200):
            if process_state(proc.pid) in ("T", "t"):
                break
            time.sleep(0.01)
        a = WatchedAgent("pfc-h1", "h1", "pfc", AgentProcess("pfc-h1", "ns", proc), None, True)
        (fault,) = _watch([a]).check()
        assert fault.kind == "agent_hung" and "stopped by a signal" in fault.message
    finally:
        proc.kill()
        proc.wait()
    assert process_state(proc.pid) == ""


def test_exits_are_stopped_being_faults_once_the_run_stops_its_agents():
    w = _watch([_agent("pfc-sw1", "pfc", code=-15, lossless=True)])
    w.stopping = True
    assert w.check() == []


def test_a_removed_namespace_ends_the_run():
    gone = {"tb-x-h2"}
    w = _watch(netns={"tb-x-h1": "h1", "tb-x-h2": "h2"}, exists=lambda ns: ns not in gone)
    (fault,) = w.check()
    assert (fault.kind, fault.node, fault.ends_run) == ("netns_removed", "h2", True)


def test_the_disk_full_is_named_from_free_space_and_from_the_store():
    w = _watch(free=lambda _p: 4096, run_dir="/runs/x")
    (fault,) = w.check()
    assert fault.kind == "disk_full" and "4096 bytes free" in fault.message
    assert fault.ends_run
    c = FakeCollector(error=sqlite3.OperationalError("database or disk is full"))
    w = _watch(collector=c)
    (fault,) = w.check()
    assert fault.kind == "disk_full" and "counters.sqlite" in fault.message


def test_a_failed_collector_and_a_stalled_one_end_the_run():
    (fault,) = _watch(collector=FakeCollector(error=RuntimeError("dump"))).check()
    assert fault.kind == "collector_failed" and fault.ends_run
    clocks = Clocks()
    c = FakeCollector(last_sample_mono_ns=clocks.mono)
    w = _watch(collector=c, clocks=clocks)
    clocks.advance(watch_mod.STALL_PERIODS * c.period_wall_ns - 1)
    assert w.check() == []
    clocks.advance(2)
    (fault,) = w.check()
    assert fault.kind == "collector_stalled" and fault.ends_run


@pytest.mark.parametrize("step_s", [-3600.0, -0.5, 0.2, 86400.0])
def test_a_clock_step_is_noted_each_time_and_the_run_goes_on(step_s):
    clocks = Clocks()
    w = _watch(clocks=clocks)
    clocks.advance(50_000_000)
    assert w.check() == []
    clocks.real += int(step_s * 1e9)
    (fault,) = w.check()
    assert fault.kind == "clock_step" and not fault.ends_run
    assert f"{step_s:+.3f} s" in fault.message
    assert w.check() == []           # the new offset is the baseline
    clocks.real -= int(step_s * 1e9)
    assert [f.kind for f in w.check()] == ["clock_step"]


def test_slew_below_the_threshold_is_not_a_step():
    clocks = Clocks()
    w = _watch(clocks=clocks)
    clocks.real += watch_mod.CLOCK_STEP_NS - 1
    assert w.check() == []


def test_fabric_time_ignores_the_wall_clock(monkeypatch):
    """Fabric time is CLOCK_MONOTONIC: CLOCK_REALTIME jumping an hour moves it not at all."""
    c = Collector.__new__(Collector)

    class D:
        @staticmethod
        def to_fabric_ns(wall_ns: float) -> float:
            return wall_ns / 1000

    c.dilation, c.t0_mono_ns = D(), 0     # type: ignore[assignment]
    mono = time.monotonic_ns()
    before = c.fabric_now_ns(mono)
    monkeypatch.setattr(time, "time_ns", lambda: 3600 * 10**9 + mono)
    monkeypatch.setattr(time, "time", lambda: 3600.0 + mono / 1e9)
    assert c.fabric_now_ns(mono) == before
    monkeypatch.setattr(time, "monotonic_ns", lambda: mono)
    assert c.fabric_now_ns() == before


def test_disk_full_and_exit_words():
    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert is_disk_full(sqlite3.OperationalError("database or disk is full"))
    assert not is_disk_full(sqlite3.OperationalError("database is locked"))
    assert not is_disk_full(OSError(errno.EIO, "I/O error"))
    assert exit_words(-9) == "was killed by SIGKILL"
    assert exit_words(3) == "exited with code 3"
