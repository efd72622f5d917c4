"""Agents that are part of the fabric itself, not of a workload: PFC on every node.

They start right after the fabric is built and before any traffic, and stop
after the workload; their control sockets and event files live in the
directory given (a run directory's agents/, or the lab's state directory
for `testbed up`). Each PFC agent also takes commands (the fault timeline's pfc,
rate and drain: testbed/run/timeline.py) on `pfc_command_socket(directory, node)`.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from agents.timebase import wall_timeout_s
from testbed.plan.model import Plan
from testbed.run.collector import AgentEndpoint
from testbed.run.procs import AgentProcess, socket_path, start_process

READY_TIMEOUT_S = 20.0
# SCHED_FIFO priority of the PFC agents (agents/pfc: their reaction time is headroom)
PFC_RT_PRIORITY = 10


def has_pfc(plan: Plan) -> bool:
    return any(c.pfc for n in plan.nodes for i in n.interfaces for c in i.egress.classes)


def watchdog_ns(plan: Plan) -> int:
    values = [c.pfc.watchdog_ns for n in plan.nodes for i in n.interfaces
              for c in i.egress.classes if c.pfc and c.pfc.watchdog_ns]
    return min(values) if values else 0


def pfc_command_socket(directory: Path, node: str, lab: str) -> str:
    """Where the PFC agent of `node` takes commands: `<directory>/<node>-pfc.cmd.sock`
    (in the lab's state directory when that path is too long for a UNIX socket)."""
    return socket_path(directory, f"{node}-pfc.cmd", lab)


def start_pfc_agents(plan: Plan, plan_path: Path, directory: Path,
                     parent_watch: bool = True) -> list[tuple[AgentProcess, AgentEndpoint]]:
    """One PFC agent per node; returns once every agent is listening."""
    out = []
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    for node in plan.nodes:
        sock = socket_path(directory, f"{node.name}-pfc", plan.lab)
        events = directory / f"{node.name}-pfc.events.jsonl"
        ready = directory / f"{node.name}-pfc.ready"
        ready.unlink(missing_ok=True)
        # Real-time priority is given below once every agent is listening: an agent that
        # is FIFO while the others still import can starve them on a slow 2-CPU machine.
        argv = [sys.executable, "-m", "agents.pfc", "--plan", str(plan_path), "--node",
                node.name, "--rt-priority", "0",
                "--control-sock", str(sock), "--events", str(events),
                "--ready-file", str(ready), "--watchdog-ns", str(watchdog_ns(plan)),
                "--command-sock", pfc_command_socket(directory, node.name, plan.lab)]
        if not parent_watch:
            argv.append("--no-parent-watch")
        proc = start_process(plan.lab, node.netns, argv, f"pfc-{node.name}", keep_mounts=True)
        out.append((proc, AgentEndpoint(f"pfc-{node.name}", node.name, sock,
                                        events_path=str(events))))
    deadline = time.monotonic() + wall_timeout_s(READY_TIMEOUT_S)
    for proc, endpoint in out:
        ready = directory / f"{endpoint.node}-pfc.ready"
        while not ready.exists():
            if proc.popen.poll() is not None:
                _out, err = proc.popen.communicate()
                raise RuntimeError(f"PFC agent on {endpoint.node} exited: {err.strip()[-400:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"PFC agent on {endpoint.node} did not start in "
                                   f"{wall_timeout_s(READY_TIMEOUT_S):.0f} s")
            time.sleep(0.01)
    for proc, _endpoint in out:
        try:
            # nsenter execs the agent: its pid is the agent's
            os.sched_setscheduler(proc.popen.pid, os.SCHED_FIFO,
                                  os.sched_param(PFC_RT_PRIORITY))
        except OSError:
            pass    # RT not allowed here: normal priority (nice -10), the run still works
    return out
