"""PFC decisions as plain classes with an injected fabric clock: no sockets, no kernel.

Sending side (a switch pausing its upstream). The port program accounts the
switch's buffer per (ingress port, priority) at every packet and says when an
ingress must pause or may resume (docs/datapath.md, "Buffer accounting");
`PauseRequests` turns those decisions into frames:
- an ingress is paused while it has at least one reason: "ingress" (its own
  accounting crossed XOFF) or "egress:<port>" (static mode's egress protection:
  a queue it feeds reached that queue's XOFF);
- the first reason sends XOFF, the last one going sends XON, and while paused
  the XOFF is re-sent before it expires (refresh).

A (port, priority) with PFC disabled (`PauseRequests.set_enabled`, the `pfc`
command) keeps its reasons up to date but sends nothing: a held pause is
released with XON, and enabling it again sends XOFF if a reason is still held.

Host NIC (`RxBuffer`): a receive buffer that fills with what the switch
delivers and drains at a set rate; above XOFF the host pauses its switch.

Receiving side (a port told to stop): `PauseTimer` tracks, per (port,
priority), until when the class is paused, from quanta at the port's rate,
and the storm watchdog declares a queue stormed when paused too long.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

INGRESS = "ingress"
RX_BUFFER = "rx_buffer"      # a host's NIC receive buffer above its XOFF


def egress_reason(port: str) -> str:
    return f"egress:{port}"


@dataclass
class Request:
    """One (ingress port, priority): why it is paused, and what was sent."""

    reasons: set[str] = field(default_factory=set)
    paused: bool = False
    last_xoff_ns: float = float("-inf")
    xoff_sent: int = 0
    xon_sent: int = 0
    refreshes: int = 0
    enabled: bool = True      # PFC on for this (port, priority): frames may be sent


@dataclass(frozen=True)
class Action:
    ingress: str
    priority: int
    xoff: bool           # True: send XOFF (pause), False: send XON (resume)
    reason: str          # the reason that caused it ("refresh" for a re-sent XOFF)


class PauseRequests:
    """Reasons to pause each (ingress, priority), and the frames they call for."""

    def __init__(self, refresh_ns: dict[str, float]) -> None:
        self.refresh_ns = refresh_ns              # per ingress: re-send XOFF this often
        self.requests: dict[tuple[str, int], Request] = {}

    def set(self, ingress: str, priority: int, reason: str, on: bool,
            now_ns: float) -> Action | None:
        """Add (on) or remove a reason; the frame to send, if the pause state changes."""
        req = self.requests.setdefault((ingress, priority), Request())
        if on:
            req.reasons.add(reason)
        else:
            req.reasons.discard(reason)
        return self._settle(ingress, priority, req, reason, now_ns)

    def replace(self, reason: str, priority: int, holders: AbstractSet[str],
                now_ns: float) -> list[Action]:
        """Make `reason` held by exactly the ingresses in `holders` (for one priority)."""
        out = []
        for (ingress, prio), req in list(self.requests.items()):
            if prio == priority and reason in req.reasons and ingress not in holders:
                req.reasons.discard(reason)
                action = self._settle(ingress, prio, req, reason, now_ns)
                if action:
                    out.append(action)
        for ingress in sorted(holders):
            action = self.set(ingress, priority, reason, True, now_ns)
            if action:
                out.append(action)
        return out

    def set_enabled(self, ingress: str, priority: int, enabled: bool,
                    now_ns: float) -> Action | None:
        """PFC on or off for (ingress, priority): off releases a held pause (XON), on
        pauses again if a reason is still held (XOFF)."""
        req = self.requests.setdefault((ingress, priority), Request())
        req.enabled = enabled
        return self._settle(ingress, priority, req, "enabled" if enabled else "disabled",
                            now_ns)

    def enabled(self, ingress: str, priority: int) -> bool:
        req = self.requests.get((ingress, priority))
        return req is None or req.enabled

    def _settle(self, ingress: str, priority: int, req: Request, reason: str,
                now_ns: float) -> Action | None:
        want = bool(req.reasons) and req.enabled
        if want and not req.paused:
            req.paused, req.last_xoff_ns = True, now_ns
            req.xoff_sent += 1
            return Action(ingress, priority, True, reason)
        if not want and req.paused:
            req.paused = False
            req.xon_sent += 1
            return Action(ingress, priority, False, reason)
        return None

    def refresh(self, now_ns: float) -> list[Action]:
        """XOFFs to re-send now: paused ingresses whose last XOFF is half a lifetime old."""
        out = []
        for (ingress, prio), req in self.requests.items():
            every = self.refresh_ns.get(ingress, float("inf"))
            if req.paused and now_ns - req.last_xoff_ns >= every:
                req.last_xoff_ns = now_ns
                req.xoff_sent += 1
                req.refreshes += 1
                out.append(Action(ingress, prio, True, "refresh"))
        return out

    def next_refresh_ns(self) -> float | None:
        due = [req.last_xoff_ns + self.refresh_ns.get(ingress, float("inf"))
               for (ingress, _p), req in self.requests.items() if req.paused]
        due = [d for d in due if d != float("inf")]
        return min(due) if due else None

    def paused(self, ingress: str, priority: int) -> bool:
        req = self.requests.get((ingress, priority))
        return bool(req and req.paused)


@dataclass
class RxBuffer:
    """A host NIC's receive buffer for one class, as a fluid queue on sampled arrivals.

    `arrived_bytes` is a running counter (the switch port's departures toward this
    host); between two polls the buffer gains what arrived and loses rate x elapsed
    fabric time, floored at 0 (an empty buffer stores no drain credit). It holds
    at most `capacity_bytes` (XOFF + headroom): arrivals beyond that are what a real
    NIC would drop, counted in `overflow_bytes`. Above `xoff_bytes` the host must
    pause its switch, until the level is back at `xon_bytes` (`want_pause`).
    `rate_bps` None is line rate: the model is done once the buffer is empty.
    """

    xoff_bytes: int
    xon_bytes: int
    capacity_bytes: int
    rate_bps: float | None          # fabric drain rate; None: line rate
    line_rate_bps: float
    last_arrived: int = 0
    last_ns: float = 0.0
    level_bytes: float = 0.0
    peak_bytes: float = 0.0
    overflow_bytes: float = 0.0
    want_pause: bool = False
    # "Empty" for `finished`: arrivals are added at the poll that sees them, so at line
    # rate under a steady stream the sampled level is the last poll's frame or two,
    # never 0. The agent sets one full frame.
    empty_bytes: float = 0.0
    # The last poll's arrivals and what the drain could take in its interval: a poll
    # that came late (a loaded machine) adds a whole late interval's arrivals at once,
    # which a buffer draining faster than they came never held.
    last_new_bytes: float = 0.0
    last_drainable_bytes: float = 0.0

    @classmethod
    def start(cls, arrived_bytes: int, now_ns: float, xoff_bytes: int, xon_bytes: int,
              headroom_bytes: int, rate_bps: float | None, line_rate_bps: float) -> RxBuffer:
        """An empty buffer counting arrivals from now on."""
        return cls(xoff_bytes, min(xon_bytes, xoff_bytes), xoff_bytes + max(0, headroom_bytes),
                   rate_bps, line_rate_bps, last_arrived=arrived_bytes, last_ns=now_ns)

    @property
    def drain_bps(self) -> float:
        return self.line_rate_bps if self.rate_bps is None else max(0.0, self.rate_bps)

    def advance(self, arrived_bytes: int, now_ns: float) -> bool | None:
        """Account arrivals and drain up to now; True / False when the pause state
        changes (send XOFF / XON), None when it does not."""
        new = max(0, arrived_bytes - self.last_arrived)   # a counter reset adds nothing
        dt = max(0.0, now_ns - self.last_ns)
        self.last_arrived, self.last_ns = arrived_bytes, now_ns
        drainable = self.drain_bps * dt / 8e9
        self.last_new_bytes, self.last_drainable_bytes = new, drainable
        level = max(0.0, self.level_bytes - drainable) + new
        if level > self.capacity_bytes:
            self.overflow_bytes += level - self.capacity_bytes
            level = float(self.capacity_bytes)
        self.level_bytes = level
        self.peak_bytes = max(self.peak_bytes, level)
        if not self.want_pause and level >= self.xoff_bytes:
            self.want_pause = True
            return True
        if self.want_pause and level <= self.xon_bytes:
            self.want_pause = False
            return False
        return None

    def set_rate(self, rate_bps: float | None, arrived_bytes: int, now_ns: float) -> bool | None:
        """A new drain rate from now on (the time so far drains at the old one)."""
        change = self.advance(arrived_bytes, now_ns)
        self.rate_bps = rate_bps
        return change

    @property
    def finished(self) -> bool:
        """Line rate again and empty (up to `empty_bytes`): the model can stop. Empty
        also when all but the last poll's arrivals had drained and those came no faster
        than the drain takes them: however late that poll was, they never built up."""
        if self.rate_bps is not None or self.want_pause:
            return False
        if self.level_bytes <= self.empty_bytes:
            return True
        return (self.level_bytes - self.last_new_bytes <= self.empty_bytes
                and self.last_new_bytes <= self.last_drainable_bytes)

    def next_poll_ns(self, now_ns: float, min_ns: float, max_ns: float) -> float:
        """When the next threshold crossing could happen at the earliest, clamped to
        [min_ns, max_ns] from now: arrivals come at most at line rate, so the level
        cannot reach XOFF sooner than (XOFF - level) / line rate; draining, it cannot
        reach XON sooner than (level - XON) / drain rate."""
        if self.want_pause:
            gap_bytes, bps = self.level_bytes - self.xon_bytes, self.drain_bps
        else:
            gap_bytes, bps = self.xoff_bytes - self.level_bytes, self.line_rate_bps
        wait = max_ns if bps <= 0 else gap_bytes * 8e9 / bps
        return now_ns + min(max_ns, max(min_ns, wait))


@dataclass
class PausedClass:
    until_ns: float = 0.0
    since_ns: float | None = None
    paused_total_ns: float = 0.0
    frames_rx: int = 0
    stormed: bool = False
    storms: int = 0


@dataclass
class PauseTimer:
    """Receiving side: which of this node's egress classes are paused, and for how long."""

    watchdog_ns: float | None = None      # declare a storm after this long paused
    classes: dict[tuple[str, int], PausedClass] = field(default_factory=dict)

    def on_frame(self, port: str, priority: int, pause_ns: float, now_ns: float) -> bool:
        """Apply a received pause (0 = resume). Returns the class's new paused state."""
        c = self.classes.setdefault((port, priority), PausedClass())
        c.frames_rx += 1
        if pause_ns > 0:
            c.until_ns = now_ns + pause_ns
            if c.since_ns is None:
                c.since_ns = now_ns
        else:
            self._resume(c, now_ns)
        return self.is_paused(port, priority, now_ns)

    def _resume(self, c: PausedClass, now_ns: float) -> None:
        if c.since_ns is not None:
            c.paused_total_ns += now_ns - c.since_ns
        c.since_ns = None
        c.until_ns = 0.0
        c.stormed = False

    def is_paused(self, port: str, priority: int, now_ns: float) -> bool:
        c = self.classes.get((port, priority))
        return bool(c and c.since_ns is not None and not c.stormed and now_ns < c.until_ns)

    def expire(self, now_ns: float) -> list[tuple[str, int, str]]:
        """Pauses that ended by timeout, and new storms: (port, priority, 'expired'|'storm')."""
        out = []
        for (port, prio), c in self.classes.items():
            if c.since_ns is None:
                continue
            if now_ns >= c.until_ns:
                self._resume(c, now_ns)
                out.append((port, prio, "expired"))
            elif (self.watchdog_ns is not None and not c.stormed
                  and now_ns - c.since_ns >= self.watchdog_ns):
                c.stormed = True
                c.storms += 1
                out.append((port, prio, "storm"))
        return out

    def next_deadline_ns(self) -> float | None:
        deadlines = [c.until_ns for c in self.classes.values() if c.since_ns is not None]
        if self.watchdog_ns is not None:
            deadlines += [c.since_ns + self.watchdog_ns for c in self.classes.values()
                          if c.since_ns is not None and not c.stormed]
        return min(deadlines) if deadlines else None

    def paused_ns(self, port: str, priority: int, now_ns: float) -> float:
        c = self.classes.get((port, priority))
        if c is None:
            return 0.0
        live = now_ns - c.since_ns if c.since_ns is not None else 0.0
        return c.paused_total_ns + live
