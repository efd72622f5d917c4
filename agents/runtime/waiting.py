"""How agents wait for a wall-clock moment: coarse sleeps, then a short spin.

time.sleep overshoots by tens of microseconds, which at a high time dilation
is a visible share of a fabric microsecond; a pure spin would burn a core the
other agents of a 2-core machine need. So an agent sleeps until it is
`spin_ns` short of the moment, in slices of at most `max_sleep_ns` (so stop
requests stay prompt), and busy-waits the rest.

- `pause_step`: one step of that, for loops that re-check their own schedule
  after every step (the UDP sender's pacer);
- `wait_until_mono`: the whole wait for a CLOCK_MONOTONIC instant (a workload's
  agreed start), unless the agent is told to stop first.

Everything here is wall time: the agents convert fabric time through
`agents.timebase.Dilation` before they wait.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from agents.runtime.lifecycle import Lifecycle

#: Sleep until this close to a due time, then busy-wait.
DEFAULT_SPIN_NS = 200_000
#: Longest single sleep, so stop flags and the parent check stay responsive.
MAX_SLEEP_NS = 50_000_000


def pause_step(wait_ns: int, now_ns: int, clock_ns: Callable[[], int],
               sleep_s: Callable[[float], None], spin_ns: int = DEFAULT_SPIN_NS,
               max_sleep_ns: int = MAX_SLEEP_NS) -> None:
    """One step of waiting `wait_ns` from `now_ns`.

    Far from the deadline: one coarse sleep that stops `spin_ns` short of it
    (time.sleep overshoots by tens of microseconds) and at most `max_sleep_ns`
    long; the caller polls again afterwards. Within `spin_ns`: busy-wait on
    `clock_ns` until the deadline.
    """
    if wait_ns <= 0:
        return
    if wait_ns > spin_ns:
        sleep_s(min(wait_ns - spin_ns, max_sleep_ns) / 1e9)
        return
    deadline = now_ns + wait_ns
    while clock_ns() < deadline:
        pass


def wait_until_mono(target_ns: int, life: Lifecycle,
                    clock_ns: Callable[[], int] = time.monotonic_ns,
                    sleep_s: Callable[[float], None] = time.sleep) -> None:
    """Return once CLOCK_MONOTONIC reaches `target_ns` (0: at once) or a stop is requested."""
    while target_ns:
        now = clock_ns()
        if now >= target_ns or life.should_stop(now):
            return
        pause_step(target_ns - now, now, clock_ns, sleep_s)
