"""The zygote with real namespaces: a child is in its node's namespace (and, like `ip
netns exec`, sees a /sys of it unless keep_mounts), it ends when the runner side is
killed, and a run through the zygote gives the same results as one through exec."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from testbed.config import load_config_text
from testbed.net.namespaces import list_testbed_namespaces
from testbed.plan import compile_plan
from testbed.run.runner import RunOptions, run_config
from testbed.run.zygote import Zygote
from tests.conftest import REPO, unique_lab
from tests.unit.test_zygote import CHILD, _gone

pytestmark = pytest.mark.root


@contextmanager
def netns_with_link(stem: str) -> Iterator[str]:
    """A namespace of our own with a veth pair in it, removed even on failure."""
    name = f"tb-{unique_lab(stem)}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "add", "zya", "type", "veth", "peer",
                        "name", "zyb"], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def test_child_is_in_the_namespace_with_its_sys_unless_keep_mounts():
    with netns_with_link("zyns") as ns:
        z = Zygote.start("zyns", [CHILD])
        try:
            plain = json.loads(z.spawn(CHILD, ["netns"], ns).communicate(timeout=20)[0])
            kept = json.loads(z.spawn(CHILD, ["netns"], ns, keep_mounts=True)
                              .communicate(timeout=20)[0])
        finally:
            z.close()
    assert plain["ifaces"] == kept["ifaces"] == ["lo", "zya", "zyb"]
    # as `ip netns exec`: /sys describes the namespace (and hides what is mounted below)
    assert plain["sys"] == ["lo", "zya", "zyb"] and plain["bpffs"] is False
    # as `nsenter --net`: mounts left alone, so pinned BPF maps stay reachable
    assert kept["bpffs"] == os.path.ismount("/sys/fs/bpf")
    assert "zya" not in os.listdir("/sys/class/net")     # ours was never changed


RUNNER = """
import sys, time
sys.path.insert(0, {repo!r})
from testbed.run.zygote import Zygote
z = Zygote.start("zyns", [{child!r}])
p = z.spawn({child!r}, ["wait"], {ns!r})
assert p.stdout.readline().strip() == "ready"
print(z.pid, p.pid, flush=True)
time.sleep(60)
"""


def test_killing_the_runner_ends_the_agent_in_its_namespace():
    with netns_with_link("zykill") as ns:
        runner = subprocess.Popen(
            [sys.executable, "-c", RUNNER.format(repo=str(REPO), child=CHILD, ns=ns)],
            stdout=subprocess.PIPE, text=True, cwd=REPO)
        try:
            assert runner.stdout is not None
            zpid, cpid = (int(x) for x in runner.stdout.readline().split())
            os.kill(runner.pid, signal.SIGKILL)
            runner.wait()
            assert _gone(zpid) and _gone(cpid)
        finally:
            if runner.poll() is None:
                runner.kill()
                runner.wait()


INCAST = """\
name: {lab}
dilation: 1000
topology:
  kind: single_switch
  hosts: 4
  host_link: {{port: 100GBASE-CR1, length: 2m}}
workload:
  traffic:
    - name: incast
      kind: udp_incast
      senders: [h1, h2, h3]
      receiver: h4
      tclass: roce
      duration: 1ms
"""

# What exec and the zygote may differ in: the start-up, and timing (the machine's load)
TIMING_NOTES = ("was ready", "the collector fell behind", "lossless queues stay within")


def _run(tmp_path, monkeypatch, switch: str) -> tuple[dict, dict]:
    monkeypatch.setenv("TESTBED_ZYGOTE", switch)
    lab = unique_lab("zyrun")
    loaded = load_config_text(INCAST.format(lab=lab), "incast.yaml")
    plan = compile_plan(loaded)
    result = run_config(loaded, plan, RunOptions(runs_root=tmp_path / switch,
                                                 say=lambda _m: None))
    assert not [n for n in list_testbed_namespaces() if n.startswith(f"tb-{lab}-")]
    timings = json.loads((result.run_dir / "timings.json").read_text())
    return result.summary, timings


def test_a_run_through_the_zygote_gives_what_exec_gives(tmp_path, monkeypatch):
    runs = {switch: _run(tmp_path, monkeypatch, switch) for switch in ("1", "0")}
    (zs, zt), (es, et) = runs["1"], runs["0"]
    assert zt["agent_start"]["path"] == "zygote" and zt["agent_start"]["forked"] >= 4
    assert et["agent_start"]["path"] == "exec" and et["agent_start"]["forked"] == 0
    for summary in (zs, es):
        assert summary["failed"] is None and summary["results_complete"] is True
        bad = [n for n in summary["fidelity"] if not any(t in n for t in TIMING_NOTES)
               and "not emulated" not in n]
        assert not bad, bad
    rows = {k: sorted((r["src"], r["dst"], sorted(r)) for r in s["workloads"][0]["results"])
            for k, s in (("zygote", zs), ("exec", es))}
    assert rows["zygote"] == rows["exec"] and len(rows["zygote"]) == 3
    for summary in (zs, es):
        for r in summary["workloads"][0]["results"]:
            assert r["rx_packets"] == r["tx_packets"] > 0      # nothing lost either way
    # no process of either run is left: the zygote went with its run
    assert not [p for p in os.listdir("/proc") if p.isdigit() and _cmdline_is_zygote(p)]


def _cmdline_is_zygote(pid: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            argv = fh.read().split(b"\0")
    except OSError:
        return False
    return b"agents.runtime.zygote" in argv and any(a.startswith(b"--lab=zyrun") for a in argv)


def test_testbed_down_ends_a_recorded_zygote_and_its_agents(tmp_path, monkeypatch):
    """The zygote is in the lab state beside the agents it forked, and `down` ends it by
    pid (its command line names the lab: it lives in the initial namespace)."""
    from testbed.net import destroy_lab
    from testbed.net.state import LabState
    from testbed.run import procs

    monkeypatch.setenv("TESTBED_STATE_DIR", str(tmp_path))
    with netns_with_link("zydown") as ns:
        lab = ns.removeprefix("tb-")
        LabState(lab=lab, netns=[ns], status="up", plan_digest="", builder_pid=os.getpid()).save()
        z = Zygote.start(lab, [CHILD])
        procs.use_zygote(lab, z)
        try:
            agent = procs.start_agent(lab, ns, CHILD, ["wait"], "waiter")
            assert agent.popen.stdout is not None
            assert agent.popen.stdout.readline().strip() == "ready"
            state = LabState.load(lab)
            assert state is not None
            assert {p.name for p in state.processes} == {"waiter", "zygote"}
            destroy_lab(lab)
            assert _gone(z.pid) and _gone(agent.pid)
        finally:
            procs.use_zygote(lab, None)
            z.close()
