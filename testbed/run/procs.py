"""Start data-plane agents inside a lab's namespaces and stop them by pid.

An agent runs as `ip netns exec NS python -m agents.NAME ...` from an argv
list (no shell). `ip netns exec` execs the command, so the pid we hold is
the agent's own; it is recorded in the lab state with its start time, so
`testbed down` can end it even if this process dies, and never ends a
stranger that reused the pid.

While a run has a zygote for its lab (`use_zygote`; testbed/run/zygote.py), a
`python -m MODULE` is forked from it instead, into the same namespace, and handed
back behind the same AgentProcess (its `popen` a Popen-like ZygoteProcess): same pid
semantics, same lab-state record. If the zygote fails, that agent and the ones after
it are started by exec and the run is told once (`on_fallback`).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from testbed.net.state import LabState, ProcessRecord, process_start_time
from testbed.run.zygote import Zygote, ZygoteError, ZygoteProcess, module_of


@dataclass
class AgentProcess:
    name: str
    netns: str
    popen: subprocess.Popen | ZygoteProcess

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


@dataclass
class _LabZygote:
    zygote: Zygote
    on_fallback: Callable[[str], None]
    forked: int = 0                 # agents forked from it
    executed: int = 0               # `python -m` agents started by exec after it failed
    fallback: str = ""              # why it failed ("" while it serves)


_ZYGOTES: dict[str, _LabZygote] = {}
_ZYGOTES_LOCK = threading.Lock()


def use_zygote(lab: str, zygote: Zygote | None,
               on_fallback: Callable[[str], None] = lambda _note: None) -> None:
    """Start `python -m` agents of `lab` from `zygote` from now on (None: by exec again).
    `on_fallback(note)` is called once if the zygote fails and agents go back to exec."""
    with _ZYGOTES_LOCK:
        if zygote is None:
            _ZYGOTES.pop(lab, None)
        else:
            _ZYGOTES[lab] = _LabZygote(zygote, on_fallback)


def zygote_counts(lab: str) -> dict:
    """How `lab`'s agents were started so far: {forked, executed, fallback}."""
    with _ZYGOTES_LOCK:
        z = _ZYGOTES.get(lab)
    if z is None:
        return {"forked": 0, "executed": 0, "fallback": ""}
    return {"forked": z.forked, "executed": z.executed, "fallback": z.fallback}


def fallback_note(why: str, name: str) -> str:
    """The run's note when agents go back to exec (a start-up mechanism, not the fabric)."""
    return (f"agent start-up: {why}; {name} and the agents after it were started with exec "
            "(`python -m` in the namespace, as with TESTBED_ZYGOTE=0) - a start-up "
            "mechanism only: the fabric and what the agents do are the same")


def _from_zygote(lab: str, netns: str, argv: list[str], name: str, stdout: Any,
                 keep_mounts: bool) -> ZygoteProcess | None:
    """`argv` forked from the lab's zygote, or None (no zygote, not `python -m`, or the
    zygote failed: then the run is told, once)."""
    with _ZYGOTES_LOCK:
        z = _ZYGOTES.get(lab)
    target = module_of(argv)
    if z is None or target is None:
        return None
    if z.zygote.modules is not None and target[0] not in z.zygote.modules:
        # not one of the run's agents (a helper a test or hook starts during the run):
        # exec, so that it does not end with the zygote when the run's agents are done
        return None
    if z.fallback:
        z.executed += 1
        return None
    try:
        popen = z.zygote.spawn(target[0], target[1], netns, keep_mounts, stdout=stdout)
    except ZygoteError as exc:
        z.fallback = str(exc)
        z.executed += 1
        z.zygote.fail(str(exc))
        z.on_fallback(fallback_note(str(exc), name))
        return None
    z.forked += 1
    if not z.zygote.recorded:
        # the zygote too, so `testbed down` can end it (by pid and start time)
        start = process_start_time(z.zygote.pid)
        state = LabState.load(lab)
        if state is not None and start is not None:
            state.processes.append(ProcessRecord(pid=z.zygote.pid, netns="", name="zygote",
                                                 start_time=start))
            state.save()
            z.zygote.recorded = True
    return popen


def start_process(lab: str, netns: str, argv: list[str], name: str,
                  stdout: Any = subprocess.PIPE, keep_mounts: bool = False) -> AgentProcess:
    """Start ARGV inside `netns` (no shell), recorded in the lab's state by pid.

    `ip netns exec` remounts /sys for the namespace, which hides the pinned
    BPF maps under /sys/fs/bpf; agents that need them (`keep_mounts`) enter
    only the network namespace with nsenter. A `python -m` of a lab with a zygote
    (`use_zygote`) is forked from it, which does the same (agents/runtime/zygote.py).
    """
    popen: subprocess.Popen | ZygoteProcess | None = _from_zygote(
        lab, netns, argv, name, stdout, keep_mounts)
    start = popen.start_time if isinstance(popen, ZygoteProcess) else None
    if popen is None:
        if keep_mounts:
            cmd = ["nsenter", f"--net=/var/run/netns/{netns}", *argv]
        else:
            cmd = ["ip", "netns", "exec", netns, *argv]
        popen = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.PIPE, text=True,
                                 stdin=subprocess.DEVNULL)
    # Record it at once: a run killed right now must still be able to end it.
    for _ in range(50):
        if start is not None:
            break
        start = process_start_time(popen.pid)
        if start is None:
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
