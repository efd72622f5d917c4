"""`testbed calibrate`: what this machine carries, for `dilation: auto`.

Two measurements (docs/dilation.md):

1. Capacity (`measure_capacity`), what the capacity rule uses: the CPU time of a hop and
   of each agent kind per packet. Each trial is a whole run (up, agents, sampling, down)
   at a moderate packet rate (about TRIAL_WALL_PPS, far from saturation), while a thread
   samples the machine's busy CPU time from /proc/stat; the run's `workload` and `drain`
   phase events bound the window. A trial with a trickle of traffic on the same fabric
   gives the base (collector, PFC agents, idle agents), which is taken off. Then:
   UDP over one switch (2 hops: host NIC, switch port) and across a ring of 12
   switches (8 hops) give per packet a + 2h and a + 8h: the hop cost h and the UDP
   agents' cost a; RoCE over one switch gives its agents' cost given h (its ACKs, one
   per 16 packets, cross the hops too). An agent kind's cost is split evenly between its sender and
   receiver (the trials measure their sum).
2. The per-port budget (`calibrate`), kept for configs that pin `max_wall_port_rate`
   and for the Ansible run.yml, which pins it on every VM. Each trial builds a small
   single-switch fabric whose 100G ports run at a candidate wall rate W (D = 100G / W),
   drives every port in both directions at line rate (a UDP sender may not be set above
   it), and passes when every stream arrived at >= 95 % of the line rate, no port fell
   short while backlogged and no sender fell behind its schedule. W rises through 1-2-5
   steps until a trial fails; the last passing W is the budget.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from agents.timebase import Dilation
from testbed.config import load_config_text
from testbed.plan import compile_plan
from testbed.plan.capacity import DEFAULT_CAPACITY
from testbed.results.store import Store
from testbed.run.runner import RunOptions, RunResult, run_config
from testbed.workloads.base import ROCE_ACKS_PER_PACKET

PORT_BPS = 100_000_000_000
CANDIDATE_WALL_BPS = [50_000_000, 100_000_000, 200_000_000, 500_000_000, 1_000_000_000,
                      2_000_000_000]
PASS_RATIO = 0.95

TRIAL = """\
name: calib{n}
dilation: {dilation}
max_wall_port_rate: {wall}
topology:
  kind: single_switch
  hosts: {hosts}
  host_link: {{port: 100GBASE-CR1, length: 2m}}
workload:
  traffic:
    - name: load
      kind: udp_pairs
      pairs: {pairs}
      duration: {duration_ns}ns
"""


@dataclass
class Trial:
    wall_port_bps: int
    dilation: int
    worst_ratio: float
    fidelity: list[str]
    passed: bool


def run_trial(n: int, wall_bps: int, hosts: int, seconds: float) -> Trial:
    dilation = PORT_BPS // wall_bps
    half = hosts // 2
    pairs = [[f"h{i}", f"h{i + half}"] for i in range(1, half + 1)]
    pairs += [[b, a] for a, b in pairs]
    text = TRIAL.format(n=n, dilation=dilation, wall=wall_bps, hosts=hosts, pairs=pairs,
                        duration_ns=int(Dilation(dilation).to_fabric_ns_from_wall_s(seconds)))
    loaded = load_config_text(text, "<calibrate>")
    plan = compile_plan(loaded)
    with tempfile.TemporaryDirectory(prefix="tb-calibrate-") as tmp:
        result = run_config(loaded, plan, RunOptions(runs_root=Path(tmp), say=lambda _m: None))
    rows = [r for w in result.summary["workloads"] for r in w["results"]]
    worst = min((r["rx_fabric_bps"] / PORT_BPS for r in rows), default=0.0)
    notes = [f for f in result.summary["fidelity"]
             if "netem" not in f and "budget" not in f]
    return Trial(wall_bps, dilation, worst, notes, worst >= PASS_RATIO and not notes)


def calibrate(hosts: int = 4, seconds: float = 2.0,
              say: Callable[[str], None] = print) -> tuple[int, list[Trial]]:
    trials: list[Trial] = []
    budget = CANDIDATE_WALL_BPS[0]
    for n, wall in enumerate(CANDIDATE_WALL_BPS):
        trial = run_trial(n, wall, hosts, seconds)
        trials.append(trial)
        say(f"calibrate: {wall / 1e6:g} Mb/s per port (D={trial.dilation}): worst stream "
            f"{100 * trial.worst_ratio:.1f} % of line rate"
            + ("" if trial.passed else f" - FAIL {'; '.join(trial.fidelity)[:200]}"))
        if not trial.passed:
            break
        budget = wall
    return budget, trials


# --- capacity ------------------------------------------------------------------------

#: The packet rate each capacity trial aims at, wall: well below what 2 cores carry, so
#: the trial measures cost, not saturation.
TRIAL_WALL_PPS = 10_000
#: A base trial's stream: a trickle that keeps its agents as they are in a loaded trial.
TRICKLE_BPS = 1_000_000
#: A hop must cost at least this (core-seconds): a noisy difference can come out at or
#: below zero, and a zero hop cost would let D fall without bound.
MIN_HOP_CORE_S = 0.5e-6

SINGLE = "kind: single_switch\n  hosts: 2\n  host_link: {port: 100GBASE-CR1, length: 2m}"
# Twelve switches in a ring, one host each: h1 -> h7 crosses h1's NIC, six switch-to-
# switch ports and s7's port to h7 (8 hops, either way round), 6 more than one switch:
# enough hops that their cost stands out of the agents' (tens of us per packet).
LONG = ("kind: ring\n  switches: 12\n  hosts_per_switch: 1\n"
        "  host_link: {port: 100GBASE-CR1, length: 2m}\n"
        "  fabric_link: {port: 100GBASE-CR1, length: 2m}")
LONG_DST, LONG_HOPS = "h7", 8

CAPACITY_TRIAL = """\
name: cap{n}
dilation: {dilation}
topology:
  {topology}
workload:
  traffic:
    - name: load
      kind: {kind}
      pairs: [[h1, {dst}]]
{extra}      duration: {duration_ns}ns
"""


class BusySampler:
    """CPU time of this process and every process below it (the run, its agents; the
    kernel's forwarding of their packets is charged to them, as softirq work runs in the
    sending task's context, or in ksoftirqd when it defers: counted too), sampled every
    `period_s` with its CLOCK_MONOTONIC time, so a window the run names later can be cut
    out. Other processes' load does not count (their packets' deferred softirq work
    would). The sampler's own thread is left out."""

    def __init__(self, period_s: float = 0.02) -> None:
        self.period_s = period_s
        self.samples: list[tuple[int, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._hz = os.sysconf("SC_CLK_TCK")
        self._own_s = 0.0         # this thread's CPU time, not the run's
        # What the kernel defers to ksoftirqd under load is packet work too; on a quiet
        # machine it is the run's (another load's network work would count as ours).
        self._softirq_pids = self._ksoftirqd()

    def _descendants(self) -> list[int]:
        out, todo = [], [os.getpid()]
        while todo:
            pid = todo.pop()
            try:
                tasks = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tasks:
                try:
                    with open(f"/proc/{pid}/task/{tid}/children") as f:
                        kids = [int(k) for k in f.read().split()]
                except OSError:
                    continue
                out += kids
                todo += kids
        return out

    def _ksoftirqd(self) -> list[int]:
        out = []
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    with open(f"/proc/{pid}/comm") as f:
                        if f.read().startswith("ksoftirqd/"):
                            out.append(int(pid))
                except OSError:
                    continue
        return out

    def _read(self) -> float:
        t = os.times()
        total = t.user + t.system + t.children_user + t.children_system
        for pid in self._descendants() + self._softirq_pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += (int(fields[11]) + int(fields[12])) / self._hz   # utime, stime
        return total - self._own_s

    def _loop(self) -> None:
        while not self._stop.is_set():
            before = time.thread_time()
            self.samples.append((time.monotonic_ns(), self._read()))
            self._own_s += time.thread_time() - before
            self._stop.wait(self.period_s)

    def __enter__(self) -> BusySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append((time.monotonic_ns(), self._read()))

    def busy_s(self, start_ns: int, end_ns: int) -> float:
        """Busy core-seconds between two monotonic instants (interpolated)."""
        return self._at(end_ns) - self._at(start_ns)

    def _at(self, t_ns: int) -> float:
        s = self.samples
        if not s:
            return 0.0
        if t_ns <= s[0][0]:
            return s[0][1]
        for (t0, v0), (t1, v1) in zip(s, s[1:], strict=False):
            if t0 <= t_ns <= t1:
                return v0 + (v1 - v0) * (t_ns - t0) / max(1, t1 - t0)
        return s[-1][1]


@dataclass
class LoadTrial:
    """One capacity trial: packets it moved in its window and the busy CPU time there."""

    name: str
    hops: int
    dilation: int
    packets: float
    window_s: float
    busy_core_s: float
    fidelity: list[str] = field(default_factory=list)

    @property
    def busy_cores(self) -> float:
        return self.busy_core_s / self.window_s if self.window_s > 0 else 0.0


class TrialFailed(RuntimeError):
    """A capacity trial's run did not get through its workload."""


def _window_ns(result: RunResult) -> tuple[int, int]:
    """The run's workload phase, CLOCK_MONOTONIC ns (its phase events' wall stamps)."""
    with Store(result.run_dir / "counters.sqlite") as store:
        phases = {e.get("phase"): e["ts_wall_ns"] for e in store.events("phase")}
    if result.failed or result.fault or "workload" not in phases or "drain" not in phases:
        raise TrialFailed(result.failed or result.fault or "the run has no workload phase")
    return int(phases["workload"]), int(phases["drain"])


def _load_trial(name: str, n: int, topology: str, hops: int, kind: str, extra: str,
                wire_bytes: int, seconds: float, dst: str = "h2") -> LoadTrial:
    """A run of one stream h1 -> `dst` at the host's line rate, D chosen so that is about
    TRIAL_WALL_PPS of wall packets (or a trickle: `extra` sets its rate)."""
    line_bps = 100_000_000_000
    dilation = max(1, round(line_bps / (TRIAL_WALL_PPS * wire_bytes * 8)))
    text = CAPACITY_TRIAL.format(
        n=n, dilation=dilation, topology=topology, kind=kind, extra=extra, dst=dst,
        duration_ns=int(Dilation(dilation).to_fabric_ns_from_wall_s(seconds)))
    loaded = load_config_text(text, "<calibrate>")
    plan = compile_plan(loaded)
    with tempfile.TemporaryDirectory(prefix="tb-calibrate-") as tmp:
        with BusySampler() as sampler:
            result = run_config(loaded, plan, RunOptions(runs_root=Path(tmp),
                                                         say=lambda _m: None))
        start, end = _window_ns(result)
        rows = [r for w in result.summary["workloads"] for r in w["results"]]
        packets = sum((r.get("tx_packets") or 0) + (r.get("rx_packets") or 0)
                      for r in rows) / 2
        notes = [f for f in result.summary["fidelity"] if "netem" not in f
                 and not f.startswith("dilation D=")]     # the plan's capacity check
        return LoadTrial(name, hops, dilation, packets, (end - start) / 1e9,
                         sampler.busy_s(start, end), notes)


@dataclass
class CapacityResult:
    hop_core_s: float
    agent_core_s: dict[str, float]        # per packet, sender + receiver
    cores: int
    trials: list[LoadTrial]
    notes: list[str]

    @property
    def hop_pps_per_core(self) -> float:
        return 1.0 / self.hop_core_s


ROUND = ("base-1switch", "udp-1switch", "base-ring", "udp-ring", "roce-1switch")


def fit_capacity(trials: list[LoadTrial], cores: int) -> CapacityResult:
    """Hop and agent costs from rounds of the trials (ROUND's five, in order; see the
    module's doc): each round's per-packet costs, their medians over the rounds, then
    the fit. Pure."""
    notes: list[str] = []

    def per_packet(t: LoadTrial, base: LoadTrial) -> float:
        net = t.busy_core_s - base.busy_cores * t.window_s
        return max(0.0, net) / t.packets if t.packets > 0 else 0.0

    rounds = [trials[k:k + len(ROUND)] for k in range(0, len(trials), len(ROUND))]
    if not rounds or any(len(r) != len(ROUND) for r in rounds):
        raise ValueError(f"capacity trials come in rounds of {len(ROUND)}")
    u2 = statistics.median(per_packet(r[1], r[0]) for r in rounds)
    u4 = statistics.median(per_packet(r[3], r[2]) for r in rounds)
    r2 = statistics.median(per_packet(r[4], r[0]) for r in rounds)
    hops2, hops4 = rounds[0][1].hops, rounds[0][3].hops
    hop = (u4 - u2) / (hops4 - hops2)
    if hop < MIN_HOP_CORE_S:
        hop = DEFAULT_CAPACITY.hop_core_s
        notes.append(f"the {hops4}-hop trials cost {u4 * 1e6:.2f} us per packet against the "
                     f"{hops2}-hop trials' {u2 * 1e6:.2f}: too close to tell a hop (other load "
                     f"on the machine?); a hop is taken at the default {hop * 1e6:.2f} us")
    udp = max(0.0, u2 - hops2 * hop)
    # RoCE's agents cost at least what the UDP agents do: a noisy round cannot make them
    # look cheaper than the simpler agent.
    roce = max(udp, r2 - hops2 * hop * (1 + ROCE_ACKS_PER_PACKET))
    for t in trials:
        if t.fidelity:
            notes.append(f"trial {t.name} had fidelity notes: {'; '.join(t.fidelity)[:300]}")
    return CapacityResult(hop, {"udp": udp, "roce": roce}, cores, trials, notes)


def measure_capacity(seconds: float = 2.0, rounds: int = 3,
                     say: Callable[[str], None] = print) -> CapacityResult:
    """Run `rounds` rounds of the capacity trials and fit the costs (root: each trial
    builds a fabric). The rounds interleave, so a burst of other load on the machine
    falls on one round, and the medians drop it."""
    from testbed.workloads.base import ROCE_WIRE_OVERHEAD_BYTES

    udp_wire = 9000 - 28 + 66                 # default MTU 9000: a full datagram
    roce_wire = 4096 + ROCE_WIRE_OVERHEAD_BYTES
    trickle = f"      rate: {TRICKLE_BPS}bps\n"
    shapes = {"base-1switch": (SINGLE, 2, "udp_pairs", trickle, udp_wire),
              "udp-1switch": (SINGLE, 2, "udp_pairs", "", udp_wire),
              "base-ring": (LONG, LONG_HOPS, "udp_pairs", trickle, udp_wire),
              "udp-ring": (LONG, LONG_HOPS, "udp_pairs", "", udp_wire),
              "roce-1switch": (SINGLE, 2, "roce_pairs", "      cc: none\n", roce_wire)}
    trials: list[LoadTrial] = []
    for k in range(rounds):
        done: list[LoadTrial] = []
        for name in ROUND:
            topo, hops, kind, extra, wire = shapes[name]
            try:
                t = _load_trial(name, len(trials) + len(done), topo, hops, kind, extra, wire,
                                seconds, LONG_DST if topo is LONG else "h2")
            except TrialFailed as exc:
                say(f"calibrate: round {k + 1}/{rounds} {name} failed ({exc}); the round is "
                    "dropped")
                break
            done.append(t)
            say(f"calibrate: round {k + 1}/{rounds} {name} (D={t.dilation}): "
                f"{t.packets / max(t.window_s, 1e-9):,.0f} packets/s wall over "
                f"{t.window_s:.2f} s, {t.busy_cores:.2f} cores busy")
        else:
            trials += done
    if not trials:
        raise TrialFailed(f"every round of the capacity trials failed ({rounds})")
    return fit_capacity(trials, cores=os.cpu_count() or 1)
