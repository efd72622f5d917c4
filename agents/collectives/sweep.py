"""What the collective worker sweeps and how it sums up: sizes, counts, statistics, phases.

Pure helpers of `python -m agents.collectives`:

- `sizes(min, max, factor)`: the message sizes of a sweep, as nccl-tests' -b / -e / -f;
- `param_count(op, nbytes, n, itemsize)`: the one place where a size in bytes becomes an
  element count, nccl-tests' way (getCollByteCount): `nbytes` is the larger of a rank's
  send and receive buffers. all-reduce and broadcast: count = nbytes / itemsize elements
  in and out; reduce-scatter, all-gather, all-to-all: count = nbytes / itemsize / n, the
  count per rank (reduce-scatter sends count*n and receives count, all-gather the other
  way round, all-to-all count*n both ways). The buffers themselves come from the data
  module (`buffer_counts`), which uses the same semantics for `count`;
- `reported_bytes`: the "size" column (max of send and receive bytes), and
  `bus_factor`: algbw -> busbw, both as nccl-tests (docs/PERFORMANCE.md there);
- `summary(samples_us)`: min / avg / p50 / p99 (nearest rank);
- `PhaseClock`: fabric time per named phase of one operation, from the algorithm's
  `on_phase(name)` calls;
- `PhaseLog`: what the phases of a whole sweep cost one rank: the fabric ns spent in
  each phase so far (the live snapshot's `phase_<name>_ns`) and one `collective_phase`
  event per phase in the rank's events file (docs/run-format.md, "Events").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

from agents.runtime.events import EventLog

#: Operation names on the command line (nccl-tests' binaries without _perf, as the
#: control plane's collective kinds), and the same with underscores, which a data or
#: algorithms module may use instead (`__main__.module_op` follows its table).
OPS = ("allreduce", "reducescatter", "allgather", "broadcast", "alltoall")
SNAKE_OP = {"allreduce": "all_reduce", "reducescatter": "reduce_scatter",
            "allgather": "all_gather", "broadcast": "broadcast", "alltoall": "all_to_all"}
ALGORITHMS = ("ring", "rhd", "tree", "pairwise", "ina")
#: The algorithm an op runs when --algorithm is not given.
DEFAULT_ALGORITHM = {"allreduce": "ring", "reducescatter": "ring", "allgather": "ring",
                     "broadcast": "ring", "alltoall": "pairwise"}
DTYPES = ("float32", "float16", "bfloat16", "int32")
REDOPS = ("sum", "max")
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int32": 4}


def sizes(min_bytes: int, max_bytes: int, factor: float) -> list[int]:
    """min_bytes, min_bytes * factor, ... up to max_bytes (each rounded down to a byte)."""
    if min_bytes < 0 or max_bytes < min_bytes:
        raise ValueError(f"need 0 <= min-bytes <= max-bytes, got {min_bytes}, {max_bytes}")
    if min_bytes == max_bytes:
        return [min_bytes]
    if not factor > 1:
        raise ValueError(f"--factor must be > 1 to sweep {min_bytes}..{max_bytes}")
    if min_bytes == 0:
        raise ValueError("a sweep by a factor cannot start at 0 bytes")
    out: list[int] = []
    s = float(min_bytes)
    while int(s) <= max_bytes:
        if not out or int(s) != out[-1]:
            out.append(int(s))
        s *= factor
    return out


def param_count(op: str, nbytes: int, n: int, itemsize: int) -> int:
    """nccl-tests' count for a size of `nbytes` (see the module docstring)."""
    count = nbytes // itemsize
    if op in ("allreduce", "broadcast"):
        return count
    if op in ("reducescatter", "allgather", "alltoall"):
        return count // n
    raise ValueError(f"unknown op {op!r}")


def reported_bytes(send_count: int, recv_count: int, itemsize: int) -> int:
    return max(send_count, recv_count) * itemsize


def bus_factor(op: str, n: int) -> float:
    """busbw = algbw * this (nccl-tests): the share of the data each link carries."""
    if op == "allreduce":
        return 2 * (n - 1) / n
    if op in ("reducescatter", "allgather", "alltoall"):
        return (n - 1) / n
    return 1.0


def summary(samples_us: list[float]) -> dict:
    """min_us / avg_us / p50_us / p99_us of the timed iterations (None without any)."""
    if not samples_us:
        return {"min_us": None, "avg_us": None, "p50_us": None, "p99_us": None}
    s = sorted(samples_us)
    n = len(s)

    def pct(q: float) -> float:
        return s[min(n - 1, max(0, math.ceil(q * n) - 1))]

    return {"min_us": s[0], "avg_us": sum(s) / n, "p50_us": pct(0.50), "p99_us": pct(0.99)}


class PhaseClock:
    """Fabric time spent in each named phase of one operation.

    The algorithm calls `mark(name)` as a phase begins (its `on_phase` callback; extra
    arguments are ignored); a phase lasts until the next mark or `end()`. Time before
    the first mark goes to no phase. A name marked more than once adds up. `on_close`,
    if given, is told of every phase as it ends: (name, start, end) in the clock's units.
    """

    def __init__(self, now_ns: Callable[[], float],
                 on_close: Callable[[str, float, float], None] | None = None) -> None:
        self._now = now_ns
        self._on_close = on_close
        self._current: str | None = None
        self._since = 0.0
        self.ns: dict[str, float] = {}

    def mark(self, name: object, *_rest: object) -> None:
        now = self._now()
        self._close(now)
        self._current = str(name)
        self._since = now

    def end(self) -> None:
        self._close(self._now())
        self._current = None

    def _close(self, now: float) -> None:
        if self._current is not None:
            self.ns[self._current] = self.ns.get(self._current, 0.0) + now - self._since
            if self._on_close is not None:
                self._on_close(self._current, self._since, now)


def mean_phases_us(per_iteration_ns: list[dict[str, float]]) -> dict[str, float]:
    """Each phase's mean fabric time over the timed iterations, in microseconds (a phase
    an iteration did not enter counts 0 for it)."""
    if not per_iteration_ns:
        return {}
    names: list[str] = []
    for it in per_iteration_ns:
        names += [k for k in it if k not in names]
    n = len(per_iteration_ns)
    return {k: sum(it.get(k, 0.0) for it in per_iteration_ns) / n / 1e3 for k in names}


class WallStamps(Protocol):
    """A fabric clock that can say when, on the wall clock, it read a value
    (agents.timebase.FabricClock)."""

    def to_wall_clock_ns(self, fabric_ns: float) -> int: ...


class PhaseLog:
    """One rank's phases over a sweep: cumulative fabric ns per phase (warm-up iterations
    included: it is time the rank spent there), and a `collective_phase` event for each
    phase as it ends (a PhaseClock's `on_close`).

    `iteration(...)` says which size and iteration the next phases belong to. The
    event is stamped with the phase's start (`mono_ns`, the wall clock of `clock`) and
    carries its end (`end_mono_ns`) and its length in fabric ns (`duration_ns`, the
    PhaseClock's own measure, so events, counters and `phases_us` agree)."""

    def __init__(self, rank: int, clock: WallStamps, events: EventLog | None) -> None:
        self.rank = rank
        self.clock = clock
        self.events = events
        self.total_ns: dict[str, float] = {}
        self._bytes = 0
        self._iteration = 0
        self._warmup = False

    def iteration(self, nbytes: int, index: int, warmup: bool) -> None:
        self._bytes, self._iteration, self._warmup = nbytes, index, warmup

    def close(self, name: str, start_ns: float, end_ns: float) -> None:
        self.total_ns[name] = self.total_ns.get(name, 0.0) + end_ns - start_ns
        if self.events is not None:
            self.events.emit("collective_phase", self.clock.to_wall_clock_ns(start_ns),
                             rank=self.rank, phase=name, bytes=self._bytes,
                             iteration=self._iteration, warmup=self._warmup,
                             end_mono_ns=self.clock.to_wall_clock_ns(end_ns),
                             duration_ns=round(end_ns - start_ns))

    def counters(self) -> dict[str, int]:
        """`phase_<name>_ns`: fabric ns this rank spent in each phase so far."""
        return {f"phase_{k}_ns": round(v) for k, v in dict(self.total_ns).items()}
