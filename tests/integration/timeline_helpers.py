"""Shared by the fault-timeline integration tests: running a plan with its events, and
reading the run's counters at times."""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from testbed.config import LoadedConfig
from testbed.net.namespaces import list_testbed_namespaces
from testbed.plan.model import Plan
from testbed.results.store import Store
from testbed.run.runner import RunOptions, run_config

PERIOD_NS = 100_000          # the runs' sample period (fabric): "within one sample"
DOWN_NS = 3_000_000


def assert_no_lab_left(lab: str) -> None:
    left = [ns for ns in list_testbed_namespaces() if ns.startswith(f"tb-{lab}-")]
    assert not left, f"namespaces left behind: {left}"


@contextmanager
def timeline_run(loaded: LoadedConfig, plan: Plan, root: Path) -> Iterator[tuple[Store, dict]]:
    """Run `plan` (with the events a test gave it) under `root`, check nothing of its lab
    is left even if the run failed, and give its store (closed after) and summary."""
    try:
        result = run_config(loaded, plan, RunOptions(runs_root=root, say=lambda _m: None))
    finally:
        assert_no_lab_left(plan.lab)
    store = Store(result.run_dir / "counters.sqlite")
    try:
        yield store, json.loads((result.run_dir / "summary.json").read_text())
    finally:
        store.close()


def fault_events(store: Store) -> list[dict]:
    return store.events("fault")


def value_at(points: list[tuple[int, float]], t_ns: int) -> float:
    """A step series' value at fabric time t (its last point at or before t; 0 before)."""
    times = [p[0] for p in points]
    i = bisect.bisect_right(times, t_ns) - 1
    return points[i][1] if i >= 0 else 0.0


def counter_between(store: Store, counter: str, node: str, port: str, tclass: int,
                    t0_ns: int, t1_ns: int) -> float:
    """How much a cumulative counter rose between two fabric times."""
    series = store.series(counter, node=node, port=port, tclass=tclass)
    points = series.get((node, port, tclass), [])
    return value_at(points, t1_ns) - value_at(points, t0_ns)


def rate_bps_between(store: Store, node: str, port: str, t0_ns: int, t1_ns: int,
                     counter: str = "tx_bytes", tclass: int = -1) -> float:
    """Fabric bit rate of a byte counter between two fabric times."""
    return counter_between(store, counter, node, port, tclass, t0_ns, t1_ns) * 8 \
        / (t1_ns - t0_ns) * 1e9


def within_one_sample(store: Store, t_ns: int) -> int:
    """The time of the first sample whose whole interval follows fabric time t: the one
    after the sample that follows t. A change at t shows in the counters by then (what
    "within one sample" can mean for a counter read at sample times)."""
    times = store.sample_times()
    i = bisect.bisect_right(times, t_ns) + 1
    return times[min(i, len(times) - 1)]


def before_one_sample(store: Store, t_ns: int) -> int:
    """The time of the last sample whose whole interval precedes fabric time t: the one
    before the last sample at or before t. Counters read there cannot show a change made
    at t yet, even when the sample stamped just before t was read a little after it (a
    busy collector reads a sample's counters over part of its period)."""
    times = store.sample_times()
    i = bisect.bisect_right(times, t_ns) - 2
    return times[max(i, 0)]
