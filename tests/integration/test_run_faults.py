"""Faults during a run (issue 18, item 4): each test breaks a real run mid-workload and
checks that the run names the fault, ends or goes on as docs/run-format.md ("Faults
during a run") says, leaves nothing behind, and that its database opens with every
sample taken before the fault.

A single switch with 4 hosts at D = 1000, a 2:1 UDP incast into h4 on the lossless
class for 3 ms fabric (3 s wall), run with `testbed run`'s own runner. The fault comes
from the collector's on_sample callback once 1 ms fabric has been sampled: SIGKILL (or
SIGSTOP) by pid to one agent, `ip netns del` of a host's namespace, a tmpfs runs root
filled to the last byte, a collector made to fail or to fall behind. The machine's
clock is never stepped here: tests/unit/test_run_watch.py injects one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from testbed.config import load_config_text
from testbed.net import datapath
from testbed.net.namespaces import list_testbed_namespaces
from testbed.net.state import LabState, process_start_time
from testbed.plan import compile_plan
from testbed.results.store import Store
from testbed.run import collector as collector_mod
from testbed.run.runner import RunOptions, RunResult, run_config
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
    pfc: {{enabled: true, xoff: 100KB}}
workload:
  drain: 100us
  traffic:
{traffic}
"""
UDP = """\
    - {name: incast, kind: udp_incast, senders: [h1, h2], receiver: h4, tclass: roce,
       duration: 3ms}"""
ROCE = """\
    - {name: pair, kind: roce_pairs, pairs: [[h1, h3]], duration: 3ms}"""
FAULT_AT_FABRIC_NS = 1_000_000


class Fault:
    """Calls `act(lab)` once from on_sample, after FAULT_AT_FABRIC_NS of the workload;
    remembers what was sampled by then and every process the lab had."""

    def __init__(self, lab: str, act: Callable[[str], None]) -> None:
        self.lab, self.act = lab, act
        self.done = False
        self.samples = 0
        self.last_ts_ns = 0
        self.at_mono_ns = 0
        self.pids: list[tuple[int, float | None]] = []

    def __call__(self, phase: str, totals, _t: float) -> None:
        if self.done or phase != "workload" or totals.last_sample_fabric_ns < FAULT_AT_FABRIC_NS:
            return
        self.done = True
        state = LabState.load(self.lab)
        assert state is not None
        self.pids = [(p.pid, p.start_time) for p in state.processes]
        self.samples, self.last_ts_ns = totals.samples, totals.last_sample_fabric_ns
        self.at_mono_ns = time.monotonic_ns()
        self.act(self.lab)


def signal_agent(name: str, sig: int) -> Callable[[str], None]:
    def act(lab: str) -> None:
        state = LabState.load(lab)
        assert state is not None
        # a PFC agent serving several nodes is recorded as pfc-<node>+<node>...
        proc = next(p for p in state.processes
                    if p.name == name or p.name.startswith(f"{name}+"))
        os.kill(proc.pid, sig)
    return act


def _run(tmp_path: Path, act: Callable[[str], None], traffic: str = UDP,
         runs_root: Path | None = None, pfc_nodes_per_process: int | None = None
         ) -> tuple[RunResult, Fault, list[str]]:
    lab = unique_lab("flt")
    loaded = load_config_text(FABRIC.format(lab=lab, traffic=traffic), "faults.yaml")
    plan = compile_plan(loaded)
    fault = Fault(lab, act)
    said: list[str] = []
    options = RunOptions(runs_root=runs_root or tmp_path, say=said.append, on_sample=fault,
                         pfc_nodes_per_process=pfc_nodes_per_process)
    try:
        result = run_config(loaded, plan, options)
    finally:
        # whatever the run did, no process of it may be left running
        for pid, start in fault.pids:
            if start is not None and process_start_time(pid) == start:
                os.kill(pid, signal.SIGKILL)
    assert fault.done, said
    return result, fault, said


def _nothing_left(result: RunResult, fault: Fault) -> None:
    lab = fault.lab
    assert not [n for n in list_testbed_namespaces() if n.startswith(f"tb-{lab}")]
    alive = [pid for pid, start in fault.pids
             if start is not None and process_start_time(pid) == start]
    assert not alive, f"processes left running: {alive}"
    assert LabState.load(lab) is None
    assert lab not in datapath.leftover_pinned_labs()
    mounts = Path("/proc/self/mounts").read_text()
    assert lab not in mounts


def _every_sample_before(run_dir: Path, fault: Fault) -> Store:
    store = Store(run_dir / "counters.sqlite")
    times = store.sample_times()
    assert fault.last_ts_ns in times
    assert len([t for t in times if t <= fault.last_ts_ns]) == fault.samples
    return store


def _drained(run_dir: Path) -> bool:
    """Whether the run reached its drain: a run a fault ended stops before it."""
    with Store(run_dir / "counters.sqlite") as store:
        return any(e["phase"] == "drain" for e in store.events("phase"))


def _faults(result: RunResult) -> list[dict]:
    return json.loads((result.run_dir / "summary.json").read_text())["run_faults"]


def _detection_ms(result: RunResult, fault: Fault, kind: str) -> float:
    with Store(result.run_dir / "counters.sqlite") as store:
        events = [e for e in store.events("run_fault") if e["fault"] == kind]
    assert events, kind
    ms = (events[0]["ts_wall_ns"] - fault.at_mono_ns) / 1e6
    print(f"{kind}: detected {ms:.0f} ms wall after the fault")
    return ms


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
@pytest.mark.parametrize("grouped", [False, True], ids=["one-per-node", "sw1-h2-h4"])
def test_a_dead_pfc_agent_ends_the_run(tmp_path, sig, grouped):
    # grouped: sw1, h2 and h4 in one process (switches dealt first, round-robin over
    # two processes): one fault, naming the other two nodes it took down
    result, fault, said = _run(tmp_path, signal_agent("pfc-sw1", sig),
                               pfc_nodes_per_process=3 if grouped else 1)
    faults = _faults(result)
    kind = "agent_exited" if sig == signal.SIGKILL else "agent_hung"
    assert [(f["fault"], f["who"], f["action"]) for f in faults] == [
        (kind, "pfc-sw1", "ended the run")]
    summary = result.summary
    note = next(n for n in summary["fidelity"] if "PFC agent pfc-sw1" in n)
    assert "no longer lossless" in note
    assert ("its process also served h2, h4" in note) == grouped
    assert ("SIGKILL" if sig == signal.SIGKILL else "stopped by a signal") in note
    assert result.fault == note
    # ended there: found before the 3 ms schedule's end, and never drained
    assert faults[0]["ts_fabric_ns"] < 3_000_000
    assert not _drained(result.run_dir)
    _detection_ms(result, fault, kind)
    _every_sample_before(result.run_dir, fault).close()
    _nothing_left(result, fault)


@pytest.mark.parametrize("who", ["incast-h1-h4", "incast-recv-h4"], ids=["sender", "receiver"])
def test_a_killed_traffic_agent_is_named_and_the_run_goes_on(tmp_path, who):
    result, fault, _said = _run(tmp_path, signal_agent(who, signal.SIGKILL))
    faults = _faults(result)
    assert [(f["fault"], f["who"], f["action"]) for f in faults] == [
        ("agent_exited", who, "continued")]
    assert result.fault == ""
    assert any(who in n and "SIGKILL" in n for n in result.summary["fidelity"])
    assert _drained(result.run_dir)      # the schedule ran out, and the fabric drained
    _detection_ms(result, fault, "agent_exited")
    _every_sample_before(result.run_dir, fault).close()
    _nothing_left(result, fault)


def test_a_killed_roce_agent_is_named(tmp_path):
    result, fault, _said = _run(tmp_path, signal_agent("roce-responder-h3", signal.SIGKILL), ROCE)
    faults = _faults(result)
    assert ("agent_exited", "continued") in [(f["fault"], f["action"]) for f in faults]
    assert any(f["who"] == "roce-responder-h3" for f in faults)
    _detection_ms(result, fault, "agent_exited")
    _every_sample_before(result.run_dir, fault).close()
    _nothing_left(result, fault)


def test_a_removed_namespace_ends_the_run(tmp_path):
    def delete(lab: str) -> None:
        state = LabState.load(lab)
        assert state is not None
        ns = next(n for n in state.netns if n.endswith("-h2"))
        subprocess.run(["ip", "netns", "del", ns], check=True)

    result, fault, _said = _run(tmp_path, delete)
    faults = _faults(result)
    assert [(f["fault"], f["node"], f["action"]) for f in faults][:1] == [
        ("netns_removed", "h2", "ended the run")]
    assert result.fault.startswith("the namespace ")
    assert not _drained(result.run_dir)
    _detection_ms(result, fault, "netns_removed")
    _every_sample_before(result.run_dir, fault).close()
    _nothing_left(result, fault)


def test_a_full_disk_ends_the_run_and_keeps_the_database(tmp_path):
    root = tmp_path / "runs"
    root.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(root)],
                   check=True)
    try:
        def fill(_lab: str) -> None:
            with open(root / "filler", "wb") as fh:
                try:
                    while True:
                        fh.write(b"\0" * 65536)
                        fh.flush()
                except OSError:
                    pass

        result, fault, said = _run(tmp_path, fill, runs_root=root)
        # named first (statvfs) or after an agent that failed to write its events died
        assert "disk_full" in [f["fault"] for f in result.summary["run_faults"]], said
        assert result.fault, said
        # the store may have had no room for the run_fault event: time it by fabric time
        full = next(f for f in result.summary["run_faults"] if f["fault"] == "disk_full")
        print(f"disk_full: detected <= {(full['ts_fabric_ns'] - fault.last_ts_ns) / 1e3:.0f} "
              "ms wall after the last sample before the disk was filled")
        assert any("disk holding the run directory is full" in m for m in said)
        # the database is read on the full disk, as a user would find it
        store = _every_sample_before(result.run_dir, fault)
        assert store.meta()["lab"] == fault.lab
        store.close()
        _nothing_left(result, fault)
    finally:
        subprocess.run(["umount", str(root)], check=True)
    assert str(root) not in Path("/proc/self/mounts").read_text()


def test_a_failing_collector_ends_the_run(tmp_path, monkeypatch):
    original = collector_mod.KernelSampler.sample
    broken = {"on": False}

    def sample(self):
        if broken["on"]:
            raise RuntimeError("netlink dump failed")
        return original(self)

    monkeypatch.setattr(collector_mod.KernelSampler, "sample", sample)
    result, fault, _said = _run(tmp_path, lambda _lab: broken.update(on=True))
    assert [(f["fault"], f["action"]) for f in _faults(result)] == [
        ("collector_failed", "ended the run")]
    assert "netlink dump failed" in result.fault
    assert not _drained(result.run_dir)
    _detection_ms(result, fault, "collector_failed")
    _every_sample_before(result.run_dir, fault).close()
    _nothing_left(result, fault)


def test_a_slow_collector_is_noted_and_the_run_goes_on(tmp_path, monkeypatch):
    original = collector_mod.KernelSampler.sample
    slow = {"on": 0}

    def sample(self):
        if 0 < slow["on"] <= 3:
            slow["on"] += 1
            time.sleep(0.35)     # 3.5 sample periods of 100 ms wall
        return original(self)

    monkeypatch.setattr(collector_mod.KernelSampler, "sample", sample)
    result, fault, _said = _run(tmp_path, lambda _lab: slow.update(on=1))
    assert _faults(result) == [] and result.fault == ""
    note = next(n for n in result.summary["fidelity"]
                if n.startswith("the collector fell behind its period"))
    assert int(note.split(" times,")[0].split()[-1]) >= 3     # the 3 slow samples at least
    with Store(result.run_dir / "counters.sqlite") as store:
        late = store.events("collector_late")
    assert len(late) == 1 and late[0]["ts_fabric_ns"] <= fault.last_ts_ns + 400_000
    assert _drained(result.run_dir)
    _every_sample_before(result.run_dir, fault).close()
    _nothing_left(result, fault)


def test_pfc_agents_that_do_not_start_fail_the_run_and_testbed_run_says_so(
        tmp_path, monkeypatch, capsys):
    # runs/20261202T065245Z-default: a PFC agent that did not start in its time made a
    # run that wrote an empty report and exited 0. Here no agent can be ready in 1 ms.
    from testbed.cli import main
    from testbed.run import fabric_agents

    monkeypatch.setattr(fabric_agents, "READY_TIMEOUT_S", 0.001)
    lab = unique_lab("flt")
    config = tmp_path / "faults.yaml"
    config.write_text(FABRIC.format(lab=lab, traffic=UDP))
    runs = tmp_path / "runs"
    assert main(["run", str(config), "--runs-dir", str(runs), "--quiet"]) == 1
    [run_dir] = runs.iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["failed"].startswith("RuntimeError: PFC agent on ")
    assert "did not start" in summary["failed"]
    assert any(n.startswith("run failed:") for n in summary["fidelity"])
    assert "**FAILED**" in (run_dir / "report.md").read_text()
    assert "<strong>failed</strong>" in (run_dir / "report.html").read_text()
    # taken down all the same
    assert not [n for n in list_testbed_namespaces() if n.startswith(f"tb-{lab}")]
    assert LabState.load(lab) is None
    capsys.readouterr()
