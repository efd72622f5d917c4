"""An in-memory, discrete-event "network" for the in-network aggregation tests: pure
aggregators (agents.aggregator.logic) and pure workers (agents.collectives.ina) exchange
datagrams with a random delay (so they reorder) and a seeded loss in both directions.
No sockets, no threads: simulated fabric nanoseconds throughout."""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field

from agents.aggregator.logic import Aggregator
from agents.collectives.ina import InaWorker

Addr = tuple[str, int]


@dataclass
class Net:
    aggregators: dict[Addr, Aggregator]
    workers: dict[Addr, tuple[InaWorker, Addr]]        # worker -> (state machine, its aggregator)
    loss: float = 0.0
    seed: int = 0
    delay_ns: tuple[float, float] = (500.0, 1500.0)
    now: float = 0.0
    sent: int = 0
    lost: int = 0
    lost_to: dict[str, int] = field(default_factory=lambda: {"up": 0, "down": 0})
    _q: list = field(default_factory=list)
    _seq: int = 0

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def _send(self, data: bytes, src: Addr, dst: Addr) -> None:
        self.sent += 1
        if self.loss and self._rng.random() < self.loss:
            self.lost += 1
            self.lost_to["down" if dst in self.workers else "up"] += 1
            return
        self._seq += 1
        heapq.heappush(self._q, (self.now + self._rng.uniform(*self.delay_ns), self._seq,
                                 dst, data, src))

    def _poll(self, addr: Addr) -> None:
        w, agg = self.workers[addr]
        for data in w.poll(self.now):
            self._send(data, addr, agg)

    def run(self, max_events: int = 5_000_000) -> None:
        for addr in self.workers:
            self._poll(addr)
        for _ in range(max_events):
            if all(w.done for w, _ in self.workers.values()):
                return
            deadlines = [(d, a) for a, (w, _) in self.workers.items()
                         if (d := w.next_deadline_ns()) is not None]
            timer = min(deadlines) if deadlines else None
            if self._q and (timer is None or self._q[0][0] <= timer[0]):
                t, _, dst, data, src = heapq.heappop(self._q)
                self.now = max(self.now, t)
                if dst in self.aggregators:
                    for out, to in self.aggregators[dst].handle(data, src):
                        self._send(out, dst, to)
                else:
                    self.workers[dst][0].on_datagram(data, src)
                    self._poll(dst)
            elif timer is not None:
                self.now = max(self.now, timer[0])
                self._poll(timer[1])
            else:
                raise AssertionError("deadlock: nothing in flight, no timer, not done")
        raise AssertionError("simulation did not finish")
