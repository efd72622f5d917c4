"""Fabric time versus wall time: the one place that converts between them.

The testbed runs the whole fabric D times slower than real time (time
dilation): every rate is divided by D, every delay and timer multiplied by D,
and every byte count stays as it is, so the bandwidth-delay product in bytes
is unchanged. Config, plans, counters and reports speak fabric units; the
builder and the agents ask a `Dilation` for wall units. Nothing else
multiplies or divides by D.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Dilation:
    """A time-dilation factor D >= 1 (fabric runs D times slower than real time)."""

    factor: int

    def __post_init__(self) -> None:
        if not isinstance(self.factor, int) or self.factor < 1:
            raise ValueError(f"dilation factor must be an integer >= 1, got {self.factor!r}")

    # rates: fabric -> wall divides by D
    def to_wall_bps(self, fabric_bps: int | float) -> int:
        return max(1, round(fabric_bps / self.factor))

    def to_fabric_bps(self, wall_bps: int | float) -> float:
        return wall_bps * self.factor

    # durations: fabric -> wall multiplies by D
    def to_wall_ns(self, fabric_ns: int | float) -> int:
        return round(fabric_ns * self.factor)

    def to_fabric_ns(self, wall_ns: int | float) -> float:
        return wall_ns / self.factor

    def to_wall_s(self, fabric_ns: int | float) -> float:
        return fabric_ns * self.factor / 1e9

    def to_fabric_ns_from_wall_s(self, wall_s: float) -> float:
        return wall_s * 1e9 / self.factor


class FabricClock:
    """Monotonic clock that reads fabric nanoseconds since it was made.

    Agents inject one of these (or a fake with the same `now_ns`) into their
    pure state machines, so timers are written in fabric time.
    """

    def __init__(self, dilation: Dilation,
                 wall_ns: Callable[[], int] = time.monotonic_ns) -> None:
        self._dilation = dilation
        self._wall_ns = wall_ns
        self._origin_wall_ns = wall_ns()

    def now_ns(self) -> float:
        return self._dilation.to_fabric_ns(self._wall_ns() - self._origin_wall_ns)

    def at_wall_clock_ns(self, wall_ns: int) -> float:
        """What this clock reads (or read, or will read) when the wall clock
        (CLOCK_MONOTONIC ns by default) reads `wall_ns`: an agent's common start t0, given
        as a monotonic instant, in its own fabric time."""
        return self._dilation.to_fabric_ns(wall_ns - self._origin_wall_ns)

    def to_wall_clock_ns(self, fabric_ns: float) -> int:
        """The reading of the wall clock (CLOCK_MONOTONIC ns by default) at which this
        clock read `fabric_ns`: how an agent stamps an event it timed in fabric time."""
        return self._origin_wall_ns + self._dilation.to_wall_ns(fabric_ns)


SLOWDOWN_ENV = "TESTBED_MACHINE_SLOWDOWN"


def machine_slowdown() -> float:
    """How many times slower than an ordinary machine this one does wall-clock work
    (process start-up, imports, netlink round trips): $TESTBED_MACHINE_SLOWDOWN, else 1.

    VM mode sets it in a TCG guest, where Python runs about 20 times slower (a pure
    Python loop: 5.8 s in the guest against 0.30 s on its 2-core host). Only timeouts
    that wait for such work scale by it (an agent to start, a result to arrive, a
    snapshot to be answered); fabric timers never do: they follow the dilation.
    """
    try:
        value = float(os.environ.get(SLOWDOWN_ENV, "1"))
    except ValueError:
        return 1.0
    return value if value >= 1.0 else 1.0


def wall_timeout_s(seconds: float) -> float:
    """A wall-clock timeout for work of `seconds` on an ordinary machine, on this one."""
    return seconds * machine_slowdown()
