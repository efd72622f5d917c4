"""Where a run's wall time goes: one CLOCK_MONOTONIC interval per stage, kept as
`timings.json` in the run directory (docs/run-format.md, "timings.json").

The run itself records them (not a profiler around it), so bench/run_overhead.py can
say how much of a run is the dilated workload and how much is fixed cost: compile, up
(with the builder's own steps), the fabric agents' start-up, the workload agents'
start-up, the common start margin, the drain, results, down, summary and report.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from testbed.results.files import write_json

TIMINGS_FORMAT_VERSION = 1

# The stages of a run, in the order they happen (a run that fails or is interrupted
# skips some). `workload` is the dilated workload itself: t0 to the senders' end.
PHASES = ("compile", "prepare", "up", "fabric_agents", "workload_agents", "start_margin",
          "workload", "drain", "stop_agents", "results", "down", "summary", "report")
# The part of a run that is not the workload (what issue 19 wants under a second).
FIXED_COST_PHASES = tuple(p for p in PHASES if p != "workload")


@dataclass
class Interval:
    phase: str
    start_mono_ns: int
    end_mono_ns: int

    @property
    def wall_s(self) -> float:
        return (self.end_mono_ns - self.start_mono_ns) / 1e9

    def to_dict(self) -> dict:
        return {"phase": self.phase, "start_mono_ns": self.start_mono_ns,
                "end_mono_ns": self.end_mono_ns, "wall_s": round(self.wall_s, 6)}


@dataclass
class RunTimings:
    """The stages of one run as they happened; `up_steps` the builder's own split of
    `up` (BuildReport.seconds)."""

    intervals: list[Interval] = field(default_factory=list)
    up_steps: dict[str, float] = field(default_factory=dict)
    planned_workload_wall_s: float = 0.0      # the span from t0 to the senders' end, x D
    # how the `python -m` agents were started (testbed/run/zygote.py agent_start_record)
    agent_start: dict = field(default_factory=dict)

    def add(self, phase: str, start_mono_ns: int, end_mono_ns: int) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown run phase {phase!r}; known: {', '.join(PHASES)}")
        self.intervals.append(Interval(phase, start_mono_ns, end_mono_ns))

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as stage `name` (recorded even when the block raises)."""
        start = time.monotonic_ns()
        try:
            yield
        finally:
            self.add(name, start, time.monotonic_ns())

    def seconds(self) -> dict[str, float]:
        """Wall seconds per stage (a stage entered twice is summed)."""
        out: dict[str, float] = {}
        for i in self.intervals:
            out[i.phase] = out.get(i.phase, 0.0) + i.wall_s
        return out

    def to_dict(self) -> dict:
        secs = self.seconds()
        return {"format_version": TIMINGS_FORMAT_VERSION, "clock": "CLOCK_MONOTONIC",
                "phases": [i.to_dict() for i in self.intervals],
                "seconds": {k: round(v, 6) for k, v in secs.items()},
                "up_steps": self.up_steps,
                "planned_workload_wall_s": round(self.planned_workload_wall_s, 6),
                "agent_start": self.agent_start,
                "fixed_cost_s": round(sum(v for k, v in secs.items()
                                          if k in FIXED_COST_PHASES), 6)}

    def write(self, run_dir: Path) -> None:
        write_json(run_dir / "timings.json", self.to_dict())
