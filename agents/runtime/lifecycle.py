"""When an agent stops: SIGTERM / SIGINT, the death of its parent, or its own decision.

Every agent polls one `Lifecycle` from its main loop and, once `should_stop()`
is true, winds down the way it would at a normal end (counters written, gates
reopened, sockets closed); `stop_reason` says why ('signal:SIGTERM', 'parent',
or what the agent passed to `stop`, e.g. 'count', 'duration', 'idle').

The parent check compares os.getppid() with its value at start, at most every
PARENT_CHECK_NS of wall time, so an agent whose control plane died (and who
was reparented) exits by itself. prctl(PR_SET_PDEATHSIG) is deliberately not
used: it fires when the parent *thread* that forked the agent exits, so a
control plane that starts agents from a worker thread would kill them
spuriously. A parent that dies before the agent has started Python is not
noticed; bound such agents by duration or count.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from types import FrameType

#: Longest time between two parent checks (wall ns). Agents also use it as the longest
#: blocking socket call, so that a stop request is seen within one check.
PARENT_CHECK_NS = 100_000_000


class Lifecycle:
    """Stop requests: SIGTERM/SIGINT, death of the parent process, or the agent itself.

    `watch_parent=False` keeps the agent running after its parent exits (an agent
    started by `testbed up` outlives the command). `getppid` and `clock_ns` are
    injectable for tests.
    """

    def __init__(self, getppid: Callable[[], int] = os.getppid,
                 clock_ns: Callable[[], int] = time.monotonic_ns, *,
                 watch_parent: bool = True) -> None:
        self._getppid = getppid
        self._clock_ns = clock_ns
        self._watch_parent = watch_parent
        self._ppid = getppid()
        self._next_check_ns = 0
        self.stop_reason: str | None = None

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT request a stop instead of killing the process."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if self.stop_reason is None:
            self.stop_reason = f"signal:{signal.Signals(signum).name}"

    def stop(self, reason: str) -> None:
        """Request a stop; the first reason given is the one kept."""
        if self.stop_reason is None:
            self.stop_reason = reason

    def should_stop(self, now_ns: int | None = None) -> bool:
        """True once a stop was requested; checks the parent at most every PARENT_CHECK_NS."""
        if self.stop_reason is not None:
            return True
        if not self._watch_parent:
            return False
        now = self._clock_ns() if now_ns is None else now_ns
        if now >= self._next_check_ns:
            self._next_check_ns = now + PARENT_CHECK_NS
            if self._getppid() != self._ppid:
                self.stop_reason = "parent"
                return True
        return False
