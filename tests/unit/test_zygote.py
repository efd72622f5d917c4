"""The zygote's protocol (agents/runtime/zygote.py, testbed/run/zygote.py), without
namespaces: children spawned with netns "" stay in this one. What a namespace adds (the
child sees its interfaces, a /sys of its own) is tests/integration/test_zygote_netns.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agents.runtime.zygote import main_imports
from testbed.run import procs
from testbed.run.zygote import (
    ZYGOTE_LOST_RETURNCODE,
    Zygote,
    ZygoteError,
    agent_start_record,
    module_of,
    zygote_enabled,
)
from tests.conftest import REPO

CHILD = "tests.zygote_child"


@pytest.fixture
def zygote() -> Iterator[Zygote]:
    z = Zygote.start("unit", [CHILD])
    try:
        z.wait_ready(30)
        yield z
    finally:
        z.close()


def _gone(pid: int, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:    # a zombie still answers kill(0): gone for our purpose
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.02)
    return False


def test_child_runs_the_module_as_main_with_its_argv_and_exit_code(zygote):
    proc = zygote.spawn(CHILD, ["echo", "7", "a b", "--flag"], "")
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == 7
    got = json.loads(out)
    assert got["argv"][1:] == ["echo", "7", "a b", "--flag"]
    assert got["argv"][0].endswith("zygote_child.py")      # as `python -m` sets it
    assert got["pid"] == proc.pid and got["ppid"] == zygote.pid
    assert err.strip() == "to stderr"
    assert proc.args == [sys.executable, "-m", CHILD, "echo", "7", "a b", "--flag"]
    assert proc.poll() == 7 and proc.wait() == 7


def test_each_child_draws_its_own_random_numbers(zygote):
    outs = [zygote.spawn(CHILD, ["echo", "0"], "").communicate(timeout=10)[0]
            for _ in range(2)]
    assert json.loads(outs[0])["rand"] != json.loads(outs[1])["rand"]


def test_sigterm_stops_the_child_through_its_lifecycle(zygote):
    proc = zygote.spawn(CHILD, ["wait"], "")
    with pytest.raises(subprocess.TimeoutExpired):
        proc.communicate(timeout=0.3)           # still running: what it said is kept
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    out, _err = proc.communicate(timeout=10)
    assert out.splitlines()[0] == "ready"
    assert json.loads(out.splitlines()[-1]) == {"stopped": "signal:SIGTERM"}
    assert proc.returncode == 0


def test_a_killed_child_reports_the_signal_as_popen_does(zygote):
    proc = zygote.spawn(CHILD, ["wait"], "")
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.2)
    proc.kill()
    assert proc.wait(10) == -signal.SIGKILL
    proc.send_signal(signal.SIGTERM)            # after the exit: nothing, no error


def test_output_larger_than_a_pipe_is_read_whole(zygote):
    proc = zygote.spawn(CHILD, ["big", "300000"], "")
    out, _err = proc.communicate(timeout=10)
    assert out == "x" * 300000 and proc.returncode == 0


def test_stdout_to_devnull_and_readline_from_a_pipe(zygote):
    quiet = zygote.spawn(CHILD, ["echo", "0"], "", stdout=subprocess.DEVNULL)
    assert quiet.stdout is None
    assert quiet.communicate(timeout=10)[0] is None and quiet.returncode == 0
    proc = zygote.spawn(CHILD, ["wait"], "")
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    proc.terminate()
    assert proc.wait(10) == 0


def test_children_stop_when_the_zygote_dies_and_spawns_then_fail(zygote):
    proc = zygote.spawn(CHILD, ["wait"], "")
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    os.kill(zygote.pid, signal.SIGKILL)
    # PR_SET_PDEATHSIG: SIGTERM, so the agent winds down as it would for the runner
    assert proc.wait(10) == ZYGOTE_LOST_RETURNCODE
    assert json.loads(proc.stdout.read().splitlines()[-1])["stopped"] == "signal:SIGTERM"
    with pytest.raises(ZygoteError, match="exited"):
        zygote.spawn(CHILD, ["echo", "0"], "")


RUNNER = """
import sys, time
sys.path.insert(0, {repo!r})
from testbed.run.zygote import Zygote
z = Zygote.start("unit", [{child!r}])
z.wait_ready(30)
p = z.spawn({child!r}, ["wait"], "")
assert p.stdout.readline().strip() == "ready"
print(z.pid, p.pid, flush=True)
time.sleep(60)
"""


def test_zygote_and_children_end_when_the_runner_is_killed():
    runner = subprocess.Popen([sys.executable, "-c", RUNNER.format(repo=str(REPO), child=CHILD)],
                              stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert runner.stdout is not None
        line = runner.stdout.readline()
        zpid, cpid = (int(x) for x in line.split())
        runner.kill()
        runner.wait()
        assert _gone(zpid), "the zygote outlived its runner"
        assert _gone(cpid), "the agent outlived its runner's zygote"
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()


def test_preload_reads_main_imports_without_running_main():
    names = main_imports(CHILD)
    assert CHILD not in names                   # a plain module is its own __main__
    assert "agents.runtime.lifecycle" in names
    pkg = main_imports("agents.udp")
    assert "agents.udp" in pkg and "agents.runtime.lifecycle" in pkg


def test_the_switch_and_what_is_forked():
    assert zygote_enabled({}) is True
    assert zygote_enabled({"TESTBED_ZYGOTE": "0"}) is False
    assert zygote_enabled({"TESTBED_ZYGOTE": "1"}) is True
    with pytest.raises(ValueError, match="TESTBED_ZYGOTE"):
        zygote_enabled({"TESTBED_ZYGOTE": "maybe"})
    assert module_of([sys.executable, "-m", "agents.udp", "recv"]) == ("agents.udp", ["recv"])
    assert module_of(["tcpdump", "-i", "eth0"]) is None


def test_agent_start_record_says_which_path():
    assert agent_start_record(False, None, {})["path"] == "exec"
    assert agent_start_record(True, None, {"fallback": "x"}) == {
        "requested": "zygote", "path": "exec", "forked": 0, "executed": 0,
        "fallback": "x", "zygote_ready_s": None}


def test_start_process_falls_back_to_exec_once_with_a_note(zygote, monkeypatch, tmp_path):
    monkeypatch.setenv("TESTBED_STATE_DIR", str(tmp_path))
    real_popen = subprocess.Popen

    def no_netns(cmd, **kw):                    # `ip netns exec NS ARGV` -> ARGV here
        return real_popen(cmd[4:], **kw)

    monkeypatch.setattr(procs.subprocess, "Popen", no_netns)
    notes: list[str] = []
    procs.use_zygote("unit", zygote, notes.append)
    try:
        argv = [sys.executable, "-m", CHILD, "echo", "0"]
        first = procs.start_process("unit", "", argv, "a")
        assert first.popen.communicate(timeout=10)[0] and first.popen.returncode == 0
        assert first.popen.args == argv          # forked: a ZygoteProcess
        os.kill(zygote.pid, signal.SIGKILL)
        zygote.popen.wait()
        for name in ("b", "c"):
            proc = procs.start_process("unit", "", argv, name)
            assert isinstance(proc.popen, real_popen)
            assert proc.popen.communicate(timeout=30)[0] and proc.popen.returncode == 0
        assert len(notes) == 1 and "b and the agents after it were started with exec" in notes[0]
        assert procs.zygote_counts("unit") == {"forked": 1, "executed": 2,
                                               "fallback": procs.zygote_counts("unit")["fallback"]}
        assert procs.zygote_counts("unit")["fallback"]
    finally:
        procs.use_zygote("unit", None)
