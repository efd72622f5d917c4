"""Start data-plane agents inside a lab's namespaces and stop them by pid.

An agent runs as `ip netns exec NS python -m agents.NAME ...` from an argv
list (no shell). `ip netns exec` execs the command, so the pid we hold is
the agent's own; it is recorded in the lab state with its start time, so
`testbed down` can end it even if this process dies, and never ends a
stranger that reused the pid.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from testbed.net.state import LabState, ProcessRecord, process_start_time


@dataclass
class AgentProcess:
    name: str
    netns: str
    popen: subprocess.Popen

    @property
    def pid(self) -> int:
        return self.popen.pid

    def request_stop(self) -> None:
        """SIGTERM, without waiting: agents stopped together wind down in parallel."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            self.popen.send_signal(signal.SIGCONT)

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            # A stopped (SIGSTOP: hung) agent acts on the SIGTERM only once continued,
            # and then winds down as usual (a PFC agent opens its gates).
            self.popen.send_signal(signal.SIGCONT)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()

    def result(self, timeout_s: float | None = None) -> dict:
        """Wait for exit and return the JSON counters the agent printed last."""
        try:
            out, err = self.popen.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            out, err = self.popen.communicate()
        for line in reversed(out.splitlines()):
            line = line.strip()
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"agent {self.name} in {self.netns} exited {self.popen.returncode} "
                           f"without counters: {err.strip()[-500:]}")


MAX_UNIX_PATH = 100    # sun_path holds 108 bytes


def socket_path(directory: Path, name: str, lab: str) -> str:
    """Where agent `name` serves its control socket: in `directory` (the run's
    agents/), or, when that path is too long for a UNIX socket, in the lab's
    private state directory."""
    path = directory / f"{name}.sock"
    if len(str(path)) <= MAX_UNIX_PATH:
        return str(path)
    state = LabState.load(lab)
    return str((state.directory if state else Path("/run/testbed")) / f"{name}.sock")


def start_agent(lab: str, netns: str, module: str, argv: list[str], name: str) -> AgentProcess:
    """Start `python -m MODULE ARGV` inside `netns`, recorded in the lab's state."""
    return start_process(lab, netns, [sys.executable, "-m", module, *argv], name)


def start_process(lab: str, netns: str, argv: list[str], name: str,
                  stdout=subprocess.PIPE, keep_mounts: bool = False) -> AgentProcess:
    """Start ARGV inside `netns` (no shell), recorded in the lab's state by pid.

    `ip netns exec` remounts /sys for the namespace, which hides the pinned
    BPF maps under /sys/fs/bpf; agents that need them (`keep_mounts`) enter
    only the network namespace with nsenter.
    """
    if keep_mounts:
        cmd = ["nsenter", f"--net=/var/run/netns/{netns}", *argv]
    else:
        cmd = ["ip", "netns", "exec", netns, *argv]
    popen = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.PIPE, text=True,
                             stdin=subprocess.DEVNULL)
    # Record it at once: a run killed right now must still be able to end it.
    start = None
    for _ in range(50):
        start = process_start_time(popen.pid)
        if start is not None:
            break
        time.sleep(0.001)
    state = LabState.load(lab)
    if state is not None and start is not None:
        state.processes.append(ProcessRecord(pid=popen.pid, netns=netns, name=name,
                                             start_time=start))
        state.save()
    return AgentProcess(name=name, netns=netns, popen=popen)


def forget_exited(lab: str) -> None:
    """Drop records of agents that have exited, so the state stays short."""
    state = LabState.load(lab)
    if state is None:
        return
    state.processes = [p for p in state.processes
                       if process_start_time(p.pid) == p.start_time]
    state.save()
