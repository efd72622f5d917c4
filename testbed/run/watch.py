"""Faults during a run, detected while it runs and named (docs/run-format.md, "Faults
during a run").

The runner calls `RunWatch.check()` every tick of its wait loops (50 ms wall). Each
check looks at:

- every agent's process (a poll of its exit status, and /proc/PID/stat for a stopped
  one) and its liveness: an agent whose snapshot requests have all failed for
  HUNG_WALL_S (wall) is hung (the collector asks every agent each sample, so this is a
  heartbeat that costs nothing extra);
- the collector thread: an exception (the disk full under counters.sqlite among them)
  or no sample for STALL_PERIODS periods;
- each of the lab's named namespaces (a stat of /var/run/netns/NAME);
- the free space of the run directory's file system (statvfs): below DISK_FULL_BYTES
  the disk counts as full before SQLite's next write fails (agents writing their event
  files may fail first; either way the disk is named);
- CLOCK_REALTIME against CLOCK_MONOTONIC: a step of the machine's clock.

Each fault is found once and says whether it ends the run (`ends_run`). Fabric time is
CLOCK_MONOTONIC throughout (Collector.fabric_now_ns), so a clock step never moves it.
"""

from __future__ import annotations

import errno
import os
import signal
import sqlite3
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from agents.timebase import wall_timeout_s
from testbed.run.collector import AgentEndpoint, Collector
from testbed.run.procs import AgentProcess

# Wall seconds of failed snapshot requests after which an agent counts as hung.
HUNG_WALL_S = 1.0
# Failed requests in a row needed too (one slow sample on a loaded machine is not a hang).
HUNG_READS = 3
# Periods without a sample after which the collector counts as stalled (and at least
# HUNG_WALL_S wall).
STALL_PERIODS = 20
# A change of CLOCK_REALTIME - CLOCK_MONOTONIC beyond this is a clock step (NTP slews
# far slower; ntpd steps only beyond 128 ms).
CLOCK_STEP_NS = 100_000_000
NETNS_DIR = "/var/run/netns"
# Free bytes of the run directory's file system below which the disk counts as full.
DISK_FULL_BYTES = 256 * 1024


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still use on the file system holding `path`."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


@dataclass(frozen=True)
class RunFault:
    """One fault found during a run."""

    kind: str           # agent_exited, agent_hung, collector_failed, collector_stalled,
    #                     disk_full, netns_removed, clock_step
    who: str            # the agent, "collector", the namespace or "clock"
    node: str           # its node ('' where none)
    role: str           # pfc, rxe_cc, sender, receiver, server, collector, fabric, clock
    ts_fabric_ns: int   # fabric time it was detected at
    detected_mono_ns: int
    ends_run: bool
    message: str        # the fidelity note

    def detail(self) -> dict:
        return {"fault": self.kind, "who": self.who, "role": self.role,
                "action": "ended the run" if self.ends_run else "continued",
                "message": self.message}


@dataclass
class WatchedAgent:
    name: str
    node: str
    role: str           # pfc, rxe_cc, or a workload agent's role (sender, receiver, ...)
    proc: AgentProcess
    endpoint: AgentEndpoint | None = None
    lossless: bool = False     # a PFC agent: its death makes lossless classes lossy
    # other nodes the same process serves (a PFC agent serving a group of nodes,
    # docs/pfc.md): they die or hang with it, and its fault names them
    also_nodes: tuple[str, ...] = ()


def is_disk_full(exc: BaseException) -> bool:
    """Whether `exc` is a write that failed for want of space (SQLite or the OS)."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return isinstance(exc, sqlite3.Error) and "full" in str(exc).lower()


def process_state(pid: int) -> str:
    """The state letter of /proc/PID/stat ('R', 'S', 'T' stopped ...); '' if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return ""
    # comm may hold spaces and parentheses: the state follows the last ')'
    rest = data[data.rfind(b")") + 1:].split()
    return rest[0].decode() if rest else ""


def exit_words(code: int) -> str:
    """How a process ended, from its Popen return code."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


@dataclass
class RunWatch:
    agents: list[WatchedAgent]
    netns: dict[str, str]                        # namespace -> its node
    fabric_now_ns: Callable[[int], int]          # monotonic ns -> fabric ns
    collector: Collector | None = None
    run_dir: str = ""                            # its file system is watched for space
    mono_ns: Callable[[], int] = time.monotonic_ns
    real_ns: Callable[[], int] = time.time_ns
    netns_exists: Callable[[str], bool] = field(
        default=lambda ns: os.path.exists(os.path.join(NETNS_DIR, ns)))
    disk_free: Callable[[str], int] = free_bytes
    faults: list[RunFault] = field(default_factory=list)
    stopping: bool = False       # set once the runner stops agents: exits are expected
    _seen: set[tuple[str, str]] = field(default_factory=set)
    _clock_offset_ns: int | None = None

    def __post_init__(self) -> None:
        self._clock_offset_ns = self.real_ns() - self.mono_ns()

    def check(self) -> list[RunFault]:
        """The faults found since the last check (each fault once)."""
        now = self.mono_ns()
        found: list[RunFault] = []
        found += self._check_disk(now)
        if not self.stopping:
            found += self._check_agents(now)
            found += self._check_netns(now)
        found += self._check_collector(now)
        found += self._check_clock(now)
        self.faults += found
        return found

    def ends_run(self) -> bool:
        return any(f.ends_run for f in self.faults)

    def _new(self, key: tuple[str, str]) -> bool:
        if key in self._seen:
            return False
        self._seen.add(key)
        return True

    def _fault(self, now: int, kind: str, who: str, node: str, role: str, ends: bool,
               message: str) -> RunFault:
        return RunFault(kind, who, node, role, self.fabric_now_ns(now), now, ends, message)

    def _at(self, now: int) -> str:
        """Where in fabric time a fault was found (formatted only for one: checks run
        every tick)."""
        return f"{self.fabric_now_ns(now) / 1e3:.0f} us fabric"

    def _check_agents(self, now: int) -> Iterable[RunFault]:
        for a in self.agents:
            code = a.proc.popen.poll()
            if code is not None:
                # A workload agent that exits 0 ended as its kind has it (a sender at the
                # end of its schedule, a RoCE server once its client is done): no fault.
                # The fabric's agents run until they are stopped.
                if code == 0 and a.role not in ("pfc", "rxe_cc"):
                    continue
                if self._new((a.name, "exited")):
                    yield self._fault(now, "agent_exited", a.name, a.node, a.role, a.lossless,
                                      self._dead_note(a, f"{exit_words(code)} at {self._at(now)}"))
                continue
            hung = self._hung_for(a, now)
            if hung is not None and self._new((a.name, "hung")):
                yield self._fault(now, "agent_hung", a.name, a.node, a.role, a.lossless,
                                  self._dead_note(a, f"hung ({hung}) at {self._at(now)}"))

    def _hung_for(self, a: WatchedAgent, now: int) -> str | None:
        state = process_state(a.proc.pid)
        if state in ("T", "t"):
            return "stopped by a signal"
        e = a.endpoint
        if e is None or e.failed_in_row < HUNG_READS:
            return None
        since = e.last_ok_mono_ns or e.first_read_mono_ns
        limit_ns = wall_timeout_s(HUNG_WALL_S) * 1e9
        if since and now - since >= limit_ns:
            return (f"no answer to {e.failed_in_row} snapshot requests in "
                    f"{(now - since) / 1e9:.1f} s wall")
        return None

    @staticmethod
    def _dead_note(a: WatchedAgent, what: str) -> str:
        if a.lossless:
            also = (f" (its process also served {', '.join(a.also_nodes)}: their PFC "
                    "went with it)" if a.also_nodes else "")
            return (f"the PFC agent {a.name} on {a.node}{also} {what}: its ports sent and "
                    "obeyed no more pauses, so the lossless classes were no longer lossless; "
                    "the run was ended there, and only what was measured before is valid")
        if a.role == "rxe_cc":
            return (f"the DCQCN agent {a.name} on {a.node} {what}: that host's rate was no "
                    "longer controlled from then on; the run went on")
        return (f"the {a.role} agent {a.name} on {a.node} {what}: its results are missing "
                "or partial and its peers' may be short; the run went on")

    def _check_netns(self, now: int) -> Iterable[RunFault]:
        for ns, node in self.netns.items():
            if not self.netns_exists(ns) and self._new((ns, "netns")):
                yield self._fault(now, "netns_removed", ns, node, "fabric", True,
                                  f"the namespace {ns} of node {node} was removed during the "
                                  f"run, at {self.fabric_now_ns(now) / 1e3:.0f} us fabric: "
                                  "the run was ended there")

    def _check_disk(self, now: int) -> Iterable[RunFault]:
        if not self.run_dir or ("disk", "full") in self._seen:
            return
        try:
            free = self.disk_free(self.run_dir)
        except OSError:
            return
        if free < DISK_FULL_BYTES:
            self._seen.add(("disk", "full"))
            yield self._disk_full(now, f"{free} bytes free")

    def _disk_full(self, now: int, why: str) -> RunFault:
        self._seen.add(("disk", "full"))
        c = self.collector
        upto = (f"{c.totals.last_sample_fabric_ns / 1e3:.0f} us fabric" if c is not None
                else "the fault")
        return self._fault(now, "disk_full", "disk", "", "fabric", True,
                           f"the disk holding the run directory is full ({why}), at "
                           f"{self.fabric_now_ns(now) / 1e3:.0f} us fabric: the run was "
                           f"ended; counters.sqlite holds every sample up to {upto}")

    def _check_collector(self, now: int) -> Iterable[RunFault]:
        c = self.collector
        if c is None:
            return
        if c.error is not None and self._new(("collector", "error")):
            if is_disk_full(c.error):
                if ("disk", "full") not in self._seen:
                    yield self._disk_full(now, f"counters.sqlite: {c.error}")
            else:
                yield self._fault(now, "collector_failed", "collector", "", "collector", True,
                                  f"the collector failed ({c.error!r}) at {self._at(now)}: "
                                  "the run was ended; counters.sqlite holds every sample up to "
                                  f"{c.totals.last_sample_fabric_ns / 1e3:.0f} us fabric")
            return
        if self.stopping or not c.last_sample_mono_ns:
            return
        stall_ns = max(STALL_PERIODS * c.period_wall_ns, wall_timeout_s(HUNG_WALL_S) * 1e9)
        if now - c.last_sample_mono_ns > stall_ns and self._new(("collector", "stall")):
            yield self._fault(now, "collector_stalled", "collector", "", "collector", True,
                              f"the collector took no sample for "
                              f"{(now - c.last_sample_mono_ns) / 1e9:.1f} s wall (its period is "
                              f"{c.period_wall_ns / 1e6:.1f} ms), at {self._at(now)}: the run "
                              "was ended")

    def _check_clock(self, now: int) -> Iterable[RunFault]:
        # both clocks read back to back: `now` is from before the other checks
        mono = self.mono_ns()
        offset = self.real_ns() - mono
        assert self._clock_offset_ns is not None
        step = offset - self._clock_offset_ns
        if abs(step) < CLOCK_STEP_NS:
            return
        self._clock_offset_ns = offset
        self._seen.add(("clock", str(len(self.faults))))
        yield self._fault(now, "clock_step", "clock", "", "clock", False,
                          f"the machine's clock (CLOCK_REALTIME) stepped by {step / 1e9:+.3f} s "
                          f"at {self.fabric_now_ns(now) / 1e3:.0f} us fabric: fabric time "
                          "(CLOCK_MONOTONIC) is unaffected; one-way latencies of datagrams in "
                          "flight across the step are off by the step; the run went on")
