"""The PFC agent's commands on a real lab: a host NIC that stops draining pauses its
switch, `pfc` off stops a switch port's pauses, `rate` changes what a port delivers,
and a port whose link is down costs send errors, not the agent.

The smallest fabric that shows it: one switch, two hosts, a UDP stream h1 -> h2 on
the lossless class (DSCP 26 -> TC3). The agents are started here with
--command-sock (a copy of testbed/run/fabric_agents.py's start, plus the flag).
What the fabric delivered to h2 is read straight from the switch port's pinned
maps: `dep_bytes` of sw1:swp2 TC3 counts every frame that reached h2's NIC.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from agents.portmaps import STATE_FIELDS, PortMaps
from agents.runtime.control import read_snapshot, send_command
from testbed.plan import Plan
from testbed.run.procs import AgentProcess, socket_path, start_agent, start_process
from tests.integration.conftest import built_lab

pytestmark = [pytest.mark.root, pytest.mark.slow]

TC = 3
D = 1000                   # 1 ms of wall time is 1 us of fabric time
CONFIG = """\
name: {name}
dilation: 1000
topology:
  kind: single_switch
  hosts: 2
  host_link: {{port: 100GBASE-CR1, length: 2m}}
"""
XOFF, XON = 200_000, 100_000          # the NIC buffer the drain command models


class Agents:
    """One PFC agent per node with a command socket; stopped by pid at the end."""

    def __init__(self, plan: Plan, directory: Path) -> None:
        self.plan, self.dir = plan, directory
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        (directory / "plan.json").write_text(plan.to_json())
        self.procs: dict[str, AgentProcess] = {}
        self.snap: dict[str, str] = {}
        self.cmd: dict[str, str] = {}
        for node in plan.nodes:
            self.snap[node.name] = socket_path(directory, f"{node.name}-pfc", plan.lab)
            self.cmd[node.name] = socket_path(directory, f"{node.name}-pfc.cmd", plan.lab)
            ready = directory / f"{node.name}-pfc.ready"
            argv = [sys.executable, "-m", "agents.pfc", "--plan", str(directory / "plan.json"),
                    "--node", node.name, "--control-sock", self.snap[node.name],
                    "--command-sock", self.cmd[node.name],
                    "--events", str(self.events_path(node.name)), "--ready-file", str(ready)]
            self.procs[node.name] = start_process(plan.lab, node.netns, argv,
                                                  f"pfc-{node.name}", keep_mounts=True)
        deadline = time.monotonic() + 20
        for name, proc in self.procs.items():
            while not (directory / f"{name}-pfc.ready").exists():
                assert proc.popen.poll() is None, proc.popen.communicate()[1][-800:]
                assert time.monotonic() < deadline, f"PFC agent on {name} did not start"
                time.sleep(0.01)

    def events_path(self, node: str) -> Path:
        return self.dir / f"{node}-pfc.events.jsonl"

    def events(self, node: str, kind: str | None = None) -> list[dict]:
        path = self.events_path(node)
        if not path.exists():
            return []
        out = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [e for e in out if kind is None or e["kind"] == kind]

    def row(self, node: str, port: str) -> dict:
        snap = read_snapshot(self.snap[node], timeout_s=2.0)
        return next(r for r in snap["ports"] if r["port"] == port and r["tclass"] == TC)

    def send(self, node: str, request: dict) -> dict:
        reply = send_command(self.cmd[node], request)
        assert reply["ok"], reply
        return reply

    def alive(self) -> None:
        for name, proc in self.procs.items():
            assert proc.popen.poll() is None, (name, proc.popen.communicate()[1][-800:])

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.stop()


def _wait(cond: Callable[[], object], timeout_s: float, what: str) -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def _stream(plan: Plan, rate_bps: int, size: int, seconds: float) -> AgentProcess:
    """h1 -> h2 on the lossless class for `seconds` of wall time."""
    dst = plan.node("h2").interfaces[0].address.split("/")[0]
    return start_agent(plan.lab, plan.node("h1").netns, "agents.udp",
                       ["send", "--dst", dst, "--dport", "5000", "--rate-bps", str(rate_bps),
                        "--size", str(size), "--duration-ns", str(int(seconds * 1e9 / D)),
                        "--dscp", "26", "--dilation", str(D)], "send")


def _delivered(maps: PortMaps) -> int:
    return int(maps.row(TC)[STATE_FIELDS.index("dep_bytes")])


def _rate_bps(maps: PortMaps, wall_s: float) -> float:
    """Fabric rate of what sw1:swp2 delivered to h2 over `wall_s` of wall time."""
    b0, t0 = _delivered(maps), time.monotonic()
    time.sleep(wall_s)
    b1, t1 = _delivered(maps), time.monotonic()
    return (b1 - b0) * 8 / ((t1 - t0) / D)


def _links(plan: Plan, up: bool) -> None:
    """Both ends of sw1-h2 admin down / up (what a link_down event does)."""
    state = "up" if up else "down"
    for node, ifname in (("sw1", "swp2"), ("h2", "eth0")):
        subprocess.run(["ip", "-n", plan.node(node).netns, "link", "set", ifname, state],
                       check=True)


def test_a_host_that_stops_draining_pauses_its_switch(tmp_path):
    with built_lab(CONFIG, "hpfc") as plan:
        agents = Agents(plan, tmp_path / "agents")
        maps = PortMaps(Path("/sys/fs/bpf/tb") / plan.lab / "sw1" / "swp2")
        send = None
        try:
            send = _stream(plan, rate_bps=20_000_000_000, size=1000, seconds=9.0)
            _wait(lambda: _delivered(maps) > 100_000, 5, "the stream to reach h2")
            flowing = _rate_bps(maps, 0.3)

            # 1. h2 stops draining: its buffer fills to XOFF, it pauses sw1:swp2.
            agents.send("h2", {"op": "drain", "port": "eth0", "tc": TC, "rate_bps": 0,
                               "wall_rate_bps": 0, "xoff_bytes": XOFF, "xon_bytes": XON})
            xoff = _wait(lambda: agents.events("h2", "pfc_xoff"), 3, "h2's XOFF")[0]
            paused = _wait(lambda: agents.events("sw1", "pfc_paused"), 3, "sw1 paused")[0]
            time.sleep(0.3)
            assert agents.row("sw1", "swp2")["paused"] == 1
            stalled = _rate_bps(maps, 0.4)
            h2 = agents.row("h2", "eth0")
            # sw1's queue to h2 fills and sw1 pauses h1 in turn (ingress XOFF at 1 MB).
            _wait(lambda: agents.row("sw1", "swp1")["pause_tx"] > 0, 3, "sw1 to pause h1")

            # 2. PFC off on sw1:swp1: sw1 releases h1 and stops pausing it.
            agents.send("sw1", {"op": "pfc", "port": "swp1", "tc": TC, "enabled": False})
            off = agents.row("sw1", "swp1")
            time.sleep(0.5)          # > a refresh period (168 us fabric)
            after_off = agents.row("sw1", "swp1")
            h1_paused_off = agents.row("h1", "eth0")["paused"]
            # 3. ... and on again: the decision still held (the queue is full) pauses h1.
            agents.send("sw1", {"op": "pfc", "port": "swp1", "tc": TC, "enabled": True})
            on = agents.row("sw1", "swp1")

            # 4. h2 drains at line rate again: XON, and h2 receives again.
            agents.send("h2", {"op": "drain", "port": "eth0", "tc": TC, "rate_bps": None,
                               "wall_rate_bps": None, "xoff_bytes": XOFF, "xon_bytes": XON})
            _wait(lambda: agents.events("h2", "pfc_xon"), 3, "h2's XON")
            time.sleep(0.2)
            resumed = _rate_bps(maps, 0.4)
            # the model turns itself off once the buffer has drained (within a few polls;
            # a loaded machine can take longer than the 0.6 s above)
            off_events = _wait(lambda: agents.events("h2", "rx_buffer_off"), 3,
                               "h2's receive-buffer model to turn off")

            # 5. The link to h2 down while h2 holds a pause: sends fail, the agent lives.
            agents.send("h2", {"op": "drain", "port": "eth0", "tc": TC, "rate_bps": 0,
                               "wall_rate_bps": 0, "xoff_bytes": XOFF, "xon_bytes": XON})
            _wait(lambda: len([e for e in agents.events("h2", "pfc_xoff")
                               if e["reason"] == "rx_buffer"]) > 1, 3, "h2's second XOFF")
            before_down = agents.row("h2", "eth0")
            _links(plan, up=False)
            time.sleep(0.6)          # three refreshes of h2's XOFF fall on a dead link
            down = agents.row("h2", "eth0")
            _links(plan, up=True)
            time.sleep(0.5)
            up = agents.row("h2", "eth0")
            agents.alive()
        finally:
            if send is not None:
                send.stop()
            agents.stop()
            maps.close()
        commands = agents.events("h2", "agent_command") + agents.events("sw1", "agent_command")

    reaction_ns = xoff["crossed_ns_ago"] + (paused["mono_ns"] - xoff["mono_ns"]) / D
    print(f"\nstream {flowing / 1e9:.1f} Gb/s; XOFF at {xoff['occupancy_bytes']} B "
          f"(xoff {XOFF}), detect {xoff['crossed_ns_ago']:.0f} ns, crossing to sw1's gate "
          f"closed {reaction_ns:.0f} ns fabric; stalled {stalled / 1e9:.3f} Gb/s; "
          f"resumed {resumed / 1e9:.1f} Gb/s; overflow {h2['rx_buffer_overflow_bytes']} B; "
          f"send_errors {down['send_errors']}")
    assert flowing > 15e9
    assert xoff["reason"] == "rx_buffer" and xoff["port"] == "eth0" and xoff["quanta"] == 65535
    assert XOFF <= xoff["occupancy_bytes"] < XOFF + 5_000
    assert paused["port"] == "swp2" and paused["tclass"] == TC
    assert reaction_ns < 1_500          # ~1 us of fabric time from crossing to gate closed
    assert stalled < 0.5e9              # throughput to h2 stopped (a frame may leak)
    assert h2["pause_tx"] >= 1 and h2["rx_buffer_bytes"] >= XOFF
    # What arrived after the XOFF (in flight, the agent's reaction) fits the headroom.
    assert h2["rx_buffer_overflow_bytes"] == 0
    # PFC off: XON to h1 at once, no more pauses, h1's gate open.
    assert off["xon_tx"] >= 1 and off["pfc_enabled"] == 0
    assert after_off["pause_tx"] == off["pause_tx"] and h1_paused_off == 0
    assert on["pause_tx"] > after_off["pause_tx"] and on["pfc_enabled"] == 1
    assert resumed > 15e9
    assert off_events and off_events[0]["peak_bytes"] >= XOFF
    # Link down: failed sends counted, the agent kept going, sends work again after.
    assert down["send_errors"] > before_down["send_errors"]
    assert up["pause_tx"] > down["pause_tx"]
    assert {c["op"] for c in commands} == {"drain", "pfc"}
    assert any(c["op"] == "pfc" and c["enabled"] is False and c["port"] == "swp1"
               for c in commands)


def test_a_rate_command_halves_what_a_port_delivers(tmp_path):
    with built_lab(CONFIG, "hrate") as plan:
        agents = Agents(plan, tmp_path / "agents")
        maps = PortMaps(Path("/sys/fs/bpf/tb") / plan.lab / "sw1" / "swp2")
        send = None
        egress = plan.node("sw1").interfaces[1].egress
        try:
            # h1 sends faster than line rate: sw1:swp2 is the bottleneck (PFC holds h1).
            send = _stream(plan, rate_bps=200_000_000_000, size=8000, seconds=5.0)
            _wait(lambda: _delivered(maps) > 1_000_000, 5, "the stream to reach h2")
            time.sleep(0.3)
            before = _rate_bps(maps, 0.8)
            reply = agents.send("sw1", {"op": "rate", "port": "swp2",
                                        "rate_bps": egress.rate_bps // 2,
                                        "wall_rate_bps": egress.wall_rate_bps // 2,
                                        "burst_bytes": egress.burst_bytes})
            time.sleep(0.2)
            after = _rate_bps(maps, 0.8)
            tbf = subprocess.run(["ip", "netns", "exec", plan.node("sw1").netns, "tc", "-j",
                                  "qdisc", "show", "dev", "swp2"],
                                 capture_output=True, text=True, check=True).stdout
            agents.alive()
        finally:
            if send is not None:
                send.stop()
            agents.stop()
            maps.close()
        command = agents.events("sw1", "agent_command")
    print(f"\nsw1:swp2 delivered {before / 1e9:.1f} Gb/s, {after / 1e9:.1f} Gb/s after "
          f"the rate command ({reply})")
    # The kernel's gate of the lossless class runs at the new wall rate ...
    gate = next(q for q in json.loads(tbf) if q["kind"] == "tbf"
                and q["parent"] == next(c.classid for c in egress.classes if c.tc == TC))
    assert gate["options"]["rate"] == egress.wall_rate_bps // 2 // 8, gate      # bytes/s
    # ... and bounds what the port delivers.
    assert after < 0.55 * egress.rate_bps
    if before > 0.8 * egress.rate_bps:
        assert after == pytest.approx(before / 2, rel=0.15)
    else:        # a loaded machine: the sender, not the port, set the first rate
        assert after < before
    assert reply["gates_set"] == [TC]
    assert command[0]["op"] == "rate" and command[0]["rate_bps"] == egress.rate_bps // 2
