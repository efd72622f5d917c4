"""Sample kernel counters and agent snapshots into the run's store, at a period.

Runs in a thread of the run process. Each tick reads every namespace's link
and class counters (testbed/net/sampler) and every live agent's snapshot,
writes them as one transaction (the store keeps what changed; the last
sample, from stop(), is marked final so the end state is written in full),
and feeds the fidelity watchdog. Its own CPU time is measured (CPU clocks of
its sampling and snapshot threads) so the run can state what sampling cost.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from agents.runtime.control import read_snapshot
from agents.timebase import wall_timeout_s
from testbed.net.sampler import KernelSampler
from testbed.plan.model import Plan
from testbed.results.store import Event, Sample, Store
from testbed.results.tables import DROP_COUNTERS
from testbed.run.fidelity import PortWatchdog
from testbed.run.invariants import InvariantMonitor

SNAPSHOT_WORKERS = 8
SNAPSHOT_TIMEOUT_S = 0.2      # wall: a slower agent's sample is skipped (and counted)
STOP_WAIT_S = 10.0            # wall: how long stop() waits for the sampling thread


@dataclass
class AgentEndpoint:
    name: str
    node: str
    sock_path: str
    events_path: str | None = None     # JSON lines the agent appends (PFC, collective phases)
    events_offset: int = 0
    reads: int = 0                     # snapshot requests while its socket existed
    failed_reads: int = 0              # ... that timed out or returned garbage
    failed_in_row: int = 0             # failed reads since the last good one (hang check)
    first_read_mono_ns: int = 0        # CLOCK_MONOTONIC of the first request
    last_ok_mono_ns: int = 0           # ... and of the last answered one


def read_agent_samples(agent: AgentEndpoint,
                       timeout_s: float | None = None) -> list[Sample]:
    """One agent's live snapshot as samples; [] (and a failed read counted) if it does not
    answer in time. An agent without a socket (not started yet, or gone) is not asked."""
    if not os.path.exists(agent.sock_path):
        return []
    agent.reads += 1
    if not agent.first_read_mono_ns:
        agent.first_read_mono_ns = time.monotonic_ns()
    try:
        snap = read_snapshot(agent.sock_path, timeout_s=wall_timeout_s(SNAPSHOT_TIMEOUT_S)
                             if timeout_s is None else timeout_s)
    except FileNotFoundError:
        agent.reads -= 1                # it exited between the check and the connect
        return []
    except (OSError, ValueError):
        agent.failed_reads += 1
        agent.failed_in_row += 1
        return []
    agent.failed_in_row = 0
    agent.last_ok_mono_ns = time.monotonic_ns()
    mode = snap.get("mode", "agent")
    out = [Sample(agent.node, agent.name, -1, f"{mode}.{k}", float(v))
           for k, v in snap.items() if isinstance(v, int | float) and not isinstance(v, bool)]
    # One process serving several streams (a host's RoCE responder): each stream's
    # counters under the stream's own name, as if it were an agent of its own.
    for sub in snap.get("streams", []):
        if isinstance(sub, dict) and isinstance(sub.get("name"), str):
            sub_mode = sub.get("mode", mode)
            out += [Sample(agent.node, sub["name"], -1, f"{sub_mode}.{k}", float(v))
                    for k, v in sub.items()
                    if isinstance(v, int | float) and not isinstance(v, bool)]
    # Per (port, class) rows: counters of the node's own ports (PFC), stored
    # under the same (node, port, tclass) as the kernel's class counters.
    for row in snap.get("ports", []):
        port, tc = row.get("port", ""), int(row.get("tclass", -1))
        out += [Sample(agent.node, port, tc, k, float(v)) for k, v in row.items()
                if k not in ("port", "tclass") and isinstance(v, int | float)]
    return out


def agent_read_notes(agents: list[AgentEndpoint]) -> list[str]:
    """A fidelity note when agents did not answer some snapshot requests: their time
    series have gaps there (a busy agent, or a machine too loaded for this dilation)."""
    failed = sorted((a for a in agents if a.failed_reads), key=lambda a: -a.failed_reads)
    if not failed:
        return []
    shown = ", ".join(f"{a.name} {a.failed_reads}/{a.reads}" for a in failed[:5])
    more = f" and {len(failed) - 5} more" if len(failed) > 5 else ""
    return [f"{len(failed)} agent(s) did not answer the collector within "
            f"{wall_timeout_s(SNAPSHOT_TIMEOUT_S):g} s wall for some samples ({shown}{more}): "
            "their time series have gaps there"]


@dataclass
class LiveTotals:
    """What the progress display shows; updated every sample."""

    samples: int = 0
    delivered_bytes: int = 0
    delivered_fabric_bps: float = 0.0
    drops: int = 0
    max_backlog_bytes: int = 0
    last_sample_fabric_ns: int = 0
    extra: dict = field(default_factory=dict)


class Collector:
    def __init__(self, plan: Plan, store: Store, period_wall_ns: int, t0_mono_ns: int,
                 agents: list[AgentEndpoint] | None = None,
                 whole_plan: Plan | None = None) -> None:
        """`plan`: the nodes sampled (one VM's part: its own, testbed.plan.part.local_plan);
        `whole_plan`: the fabric they belong to, when that is more (a link's other end,
        on another VM, sends into this VM's nodes)."""
        self.plan = plan
        self.store = store
        self.period_wall_ns = period_wall_ns
        self.t0_mono_ns = t0_mono_ns
        self.dilation = plan.timebase
        self.agents = list(agents or [])
        self.sampler = KernelSampler(plan, whole_plan)
        self.watchdog = PortWatchdog(plan)
        self.invariants = InvariantMonitor(plan)
        self.totals = LiveTotals()
        self.cpu_ns = 0
        self.wall_active_ns = 0
        self.late_ticks = 0
        # fabric time of the first and last late tick, and the longest tick's wall time
        self.late_span_fabric_ns: tuple[int, int] | None = None
        self.longest_tick_wall_ns = 0
        # the exception that ended the sampling thread (the disk full, ...), and when the
        # last sample was taken: the run's watch (testbed/run/watch.py) reads both
        self.error: BaseException | None = None
        self.last_sample_mono_ns = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._prev_delivered: tuple[int, int] | None = None
        self.on_sample: Callable[[LiveTotals], None] | None = None
        self._cpu_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=SNAPSHOT_WORKERS,
                                        thread_name_prefix="snapshot")

    def fabric_now_ns(self, mono_ns: int | None = None) -> int:
        mono = time.monotonic_ns() if mono_ns is None else mono_ns
        return round(self.dilation.to_fabric_ns(mono - self.t0_mono_ns))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="collector", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            # A collector stuck in a read (the watch named it stalled) must not hold the
            # run: after STOP_WAIT_S its sockets are closed under it and it is left.
            self._thread.join(wall_timeout_s(STOP_WAIT_S))
            if self._thread.is_alive() and self.error is None:
                self.error = RuntimeError(f"the collector thread did not stop within "
                                          f"{wall_timeout_s(STOP_WAIT_S):g} s wall")
        try:
            if self.error is None:
                self.sample_once(final=True)    # the final state, after everything stopped
        except Exception as exc:   # the disk full: what was written stays readable
            self.error = exc
        finally:
            self.sampler.close()
            self._pool.shutdown(wait=self.error is None)

    def _loop(self) -> None:
        started = time.monotonic_ns()
        next_tick = started
        while not self._stop.is_set():
            tick = time.monotonic_ns()
            try:
                self.sample_once()
            except Exception as exc:
                # The watch names it and ends the run; the store's failed transaction was
                # rolled back, so every sample before stays readable.
                self.error = exc
                break
            next_tick += self.period_wall_ns
            now = time.monotonic_ns()
            if now > next_tick:
                # Fell behind: skip missed ticks rather than sampling back to back. Only
                # ticks of the workload's time count (from t0 on): before it the agents are
                # starting (a burst of CPU) and no measurement is being taken.
                if now >= self.t0_mono_ns:
                    self.late_ticks += 1
                    at = self.fabric_now_ns(tick)
                    if self.late_ticks == 1:
                        self._late_event(at, tick, now - tick)
                    first = self.late_span_fabric_ns[0] if self.late_span_fabric_ns else at
                    self.late_span_fabric_ns = (first, at)
                    self.longest_tick_wall_ns = max(self.longest_tick_wall_ns, now - tick)
                next_tick = now
            self._stop.wait(max(0.0, (next_tick - now) / 1e9))
        self.wall_active_ns = time.monotonic_ns() - started

    def _late_event(self, at_ns: int, tick_mono_ns: int, took_wall_ns: int) -> None:
        """A `collector_late` event at the first tick that missed its period."""
        try:
            self.store.add_event(at_ns, tick_mono_ns, "collector_late", port="collector",
                                 took_wall_ns=took_wall_ns, period_wall_ns=self.period_wall_ns)
        except Exception as exc:   # the next sample fails the same way and is named
            self.error = exc

    def late_notes(self) -> list[str]:
        """A fidelity note if the collector missed its period during the workload."""
        if not self.late_ticks or self.late_span_fabric_ns is None:
            return []
        first, last = self.late_span_fabric_ns
        return [f"the collector fell behind its period {self.late_ticks} times, between "
                f"{first / 1e3:.0f} and {last / 1e3:.0f} us fabric (its slowest sample took "
                f"{self.longest_tick_wall_ns / self.period_wall_ns:.1f} periods): samples are "
                "sparser there"]

    def sample_once(self, final: bool = False) -> None:
        """Take one sample; `final` (the last one, from stop()) writes the end state."""
        with self._lock:
            cpu0 = time.thread_time_ns()
            mono = time.monotonic_ns()
            samples = self.sampler.sample()
            # Agents answer in parallel: one at a time, 26 agents on a loaded
            # 2-core VM stretched a sample to seconds.
            for rows in self._pool.map(self._agent_samples, self.agents):
                samples.extend(rows)
            ts_fabric = self.fabric_now_ns(mono)
            self.store.add_samples(ts_fabric, mono, samples, final=final)
            events: list[Event] = []
            for agent in self.agents:
                events += self._read_events(agent)
            self.store.add_events(events)
            self.watchdog.observe(mono, samples)
            self.invariants.observe(ts_fabric, samples, getattr(self.sampler, "brackets", {}))
            self._update_totals(ts_fabric, samples)
            self.cpu_ns += time.thread_time_ns() - cpu0
            self.last_sample_mono_ns = mono
        if self.on_sample is not None:
            self.on_sample(self.totals)

    def _agent_samples(self, agent: AgentEndpoint) -> list[Sample]:
        """One agent's snapshot as samples (runs on a snapshot thread; its CPU is counted)."""
        cpu0 = time.thread_time_ns()
        try:
            return read_agent_samples(agent)
        finally:
            with self._cpu_lock:
                self.cpu_ns += time.thread_time_ns() - cpu0

    def _read_events(self, agent: AgentEndpoint) -> list[Event]:
        """The new complete lines of the agent's event file, as events for the store. An
        event that names no port gets the agent's name there, as its samples have."""
        if not agent.events_path:
            return []
        try:
            with open(agent.events_path, "rb") as fh:
                fh.seek(agent.events_offset)
                data = fh.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        agent.events_offset += end
        out = []
        for line in data[:end].splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            mono = int(event.pop("mono_ns", time.monotonic_ns()))
            out.append(Event(self.fabric_now_ns(mono), mono, event.pop("kind", "agent"),
                             node=event.pop("node", agent.node), port=event.pop("port", agent.name),
                             tclass=int(event.pop("tclass", -1)), detail=event))
        return out

    def _update_totals(self, ts_fabric: int, samples: list[Sample]) -> None:
        t = self.totals
        t.samples += 1
        t.last_sample_fabric_ns = ts_fabric
        delivered = sum(int(s.value) for s in samples if s.counter == "recv.bytes")
        t.drops = sum(int(s.value) for s in samples if s.counter in DROP_COUNTERS)
        backlog = max((int(s.value) for s in samples if s.counter in ("backlog_bytes",
                                                                       "max_vq_bytes")),
                      default=0)
        t.max_backlog_bytes = max(t.max_backlog_bytes, backlog)
        if self._prev_delivered is not None and ts_fabric > self._prev_delivered[0]:
            dt = ts_fabric - self._prev_delivered[0]
            t.delivered_fabric_bps = (delivered - self._prev_delivered[1]) * 8 / dt * 1e9
        self._prev_delivered = (ts_fabric, delivered)
        t.delivered_bytes = delivered

    def overhead_fraction(self) -> float:
        """Collector CPU time over its active wall time (fraction of one core)."""
        return self.cpu_ns / self.wall_active_ns if self.wall_active_ns else 0.0
