"""PFC decisions as plain classes with an injected fabric clock: no sockets, no kernel.

Sending side (a switch deciding to pause its upstream):
- Each egress queue (port, priority) is a fluid FIFO: it holds the most
  recent `depth` bytes that arrived. `FifoAttribution` keeps the arrivals of
  each poll interval by ingress port and trims the oldest, so at any moment
  it knows how many bytes of the queue each ingress port put there. Summed
  over a node's egress queues this is the per-(ingress port, priority)
  occupancy real switches account PFC on.
- `PauseDecider` compares that occupancy with XOFF/XON (static bytes, or a
  dynamic threshold alpha x free shared buffer as in HPCC's ns-3 switch),
  and also protects each egress queue: when one reaches its own XOFF, every
  ingress port holding bytes in it is paused. It says when to send XOFF
  (and to refresh it before the pause expires) and XON.

Receiving side (a port told to stop): `PauseTimer` tracks, per (port,
priority), until when the class is paused, from quanta at the port's rate,
and the storm watchdog declares a queue stormed when paused too long.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


class FifoAttribution:
    """Which ingress ports the bytes in one egress FIFO came from."""

    def __init__(self) -> None:
        self._chunks: deque[list] = deque()      # [ingress, bytes], oldest first
        self.by_ingress: dict[str, int] = {}

    def update(self, arrivals: dict[str, int], depth_bytes: int) -> None:
        """Add this interval's arrivals per ingress, then keep only the newest `depth` bytes."""
        for ingress, nbytes in arrivals.items():
            if nbytes > 0:
                self._chunks.append([ingress, nbytes])
                self.by_ingress[ingress] = self.by_ingress.get(ingress, 0) + nbytes
        excess = sum(self.by_ingress.values()) - max(0, depth_bytes)
        while excess > 0 and self._chunks:
            chunk = self._chunks[0]
            take = min(excess, chunk[1])
            chunk[1] -= take
            self.by_ingress[chunk[0]] -= take
            excess -= take
            if chunk[1] == 0:
                self._chunks.popleft()
        self.by_ingress = {k: v for k, v in self.by_ingress.items() if v > 0}


@dataclass(frozen=True)
class Thresholds:
    xoff_bytes: int
    xon_bytes: int
    headroom_bytes: int
    egress_xoff_bytes: int          # an egress queue this deep pauses all its contributors
    egress_xon_bytes: int
    mode: str = "static"            # or "dynamic"
    alpha: float = 0.125            # dynamic: threshold = alpha * free shared buffer
    shared_buffer_bytes: int = 0    # dynamic: the node's shared buffer for the priority


@dataclass
class IngressState:
    paused: bool = False
    last_xoff_ns: float = -1.0
    xoff_sent: int = 0
    xon_sent: int = 0
    reason: str = ""


@dataclass
class Action:
    ingress: str
    priority: int
    xoff: bool           # True: send XOFF (pause), False: send XON (resume)
    occupancy_bytes: int
    reason: str


class PauseDecider:
    """Decide XOFF/XON per (ingress port, priority) from the queues of one node."""

    def __init__(self, thresholds: dict[int, Thresholds], refresh_ns: dict[str, float]) -> None:
        self.thresholds = thresholds              # per priority
        self.refresh_ns = refresh_ns              # per ingress: re-send XOFF this often
        self.fifos: dict[tuple[str, int], FifoAttribution] = {}
        self.depth: dict[tuple[str, int], int] = {}
        self.state: dict[tuple[str, int], IngressState] = {}

    def observe(self, egress: str, priority: int, depth_bytes: int,
                arrivals: dict[str, int]) -> None:
        fifo = self.fifos.setdefault((egress, priority), FifoAttribution())
        fifo.update(arrivals, depth_bytes)
        self.depth[(egress, priority)] = depth_bytes

    def occupancy(self, priority: int) -> dict[str, int]:
        out: dict[str, int] = {}
        for (_egress, prio), fifo in self.fifos.items():
            if prio != priority:
                continue
            for ingress, nbytes in fifo.by_ingress.items():
                out[ingress] = out.get(ingress, 0) + nbytes
        return out

    def _xoff_threshold(self, th: Thresholds, total_used: int) -> float:
        if th.mode == "dynamic":
            return th.alpha * max(0, th.shared_buffer_bytes - total_used)
        return th.xoff_bytes

    def decide(self, now_ns: float) -> list[Action]:
        actions: list[Action] = []
        for priority, th in self.thresholds.items():
            occ = self.occupancy(priority)
            total = sum(occ.values())
            xoff_at = self._xoff_threshold(th, total)
            # Egress protection: contributors of a queue at its own XOFF.
            hot: set[str] = set()
            cool: set[str] = set()
            for (egress, prio), fifo in self.fifos.items():
                if prio != priority:
                    continue
                depth = self.depth.get((egress, prio), 0)
                if depth >= th.egress_xoff_bytes:
                    hot.update(fifo.by_ingress)
                elif depth > th.egress_xon_bytes:
                    cool.update(fifo.by_ingress)     # between XON and XOFF: hold state
            ingresses = set(occ) | {i for (i, p) in self.state if p == priority}
            for ingress in sorted(ingresses):
                st = self.state.setdefault((ingress, priority), IngressState())
                used = occ.get(ingress, 0)
                over = used >= xoff_at or ingress in hot
                if th.mode == "dynamic":
                    under = used + 3_000 <= self._xoff_threshold(th, total)
                else:
                    under = used <= th.xon_bytes
                under = under and ingress not in hot and ingress not in cool
                if over:
                    due = (not st.paused or now_ns - st.last_xoff_ns
                           >= self.refresh_ns.get(ingress, float("inf")))
                    if due:
                        reason = "egress queue" if ingress in hot and used < xoff_at else "ingress"
                        st.paused, st.last_xoff_ns, st.reason = True, now_ns, reason
                        st.xoff_sent += 1
                        actions.append(Action(ingress, priority, True, used, reason))
                elif st.paused and under:
                    st.paused = False
                    st.xon_sent += 1
                    actions.append(Action(ingress, priority, False, used, "below XON"))
        return actions


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


def safe_poll_interval_ns(depth_bytes: int, xoff_bytes: int, fill_bps: float,
                          floor_ns: float, ceiling_ns: float) -> float:
    """How long a queue at `depth` certainly stays below XOFF when filling at most `fill_bps`.

    Polling no later than this never misses a crossing by more than one poll,
    while an idle fabric is polled rarely.
    """
    if fill_bps <= 0:
        return ceiling_ns
    room = max(0, xoff_bytes - depth_bytes)
    return max(floor_ns, min(ceiling_ns, room * 8 / fill_bps * 1e9))
