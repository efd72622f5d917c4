"""Entropy choice per packet: which UDP source port (entropy) the next packet of a PDC uses.

Switches hash the 5-tuple to pick among equal-cost paths, so the UDP source port picks
the path. Three modes, pure logic, clock injected:

- `spray`: round robin over every source port, one after the other (start at a
  seeded offset so PDCs do not move in lockstep);
- `oblivious`: one source port for the PDC's whole life (seeded choice), as a flow
  with a fixed 5-tuple gets, the ECMP baseline;
- `reps`: recycled entropies, after REPS (Bonato et al., "REPS: Recycled Entropy Packet
  Spraying", 2024): an entropy whose packet was ACKed clean (no ECN, no trim, no loss)
  goes into a FIFO and is used again; one that came back ECN-marked, trimmed or lost
  is not recycled and is marked bad; with nothing to recycle the picker explores:
  the next port of a seeded round robin that is not marked bad (a clean ACK clears the
  mark; when every port is bad the marks are forgotten). The FIFO holds at most
  `recycle_limit` entries (default 4 x the number of ports) so it cannot grow without
  bound when ACKs outpace sends.

`counters()` gives packets per source port and, for reps, how often a pick reused,
explored, or a feedback abandoned an entropy.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from typing import Literal

__all__ = ["ENTROPY_MODES", "EntropyMode", "EntropyPicker"]

EntropyMode = Literal["spray", "oblivious", "reps"]
ENTROPY_MODES: tuple[str, ...] = ("spray", "oblivious", "reps")


class EntropyPicker:
    """Picks the source port of each packet of one PDC."""

    def __init__(self, mode: str, sports: Sequence[int], seed: int = 1, *,
                 recycle_limit: int | None = None) -> None:
        if mode not in ENTROPY_MODES:
            raise ValueError(f"entropy mode must be one of {', '.join(ENTROPY_MODES)}, "
                             f"got {mode!r}")
        if not sports:
            raise ValueError("an entropy picker needs at least one source port")
        self.mode = mode
        self.sports = tuple(int(p) for p in sports)
        rng = random.Random(seed)
        self._rr = rng.randrange(len(self.sports))
        self._fixed = self.sports[self._rr]
        self._recycle: deque[int] = deque()
        self._recycle_limit = recycle_limit if recycle_limit is not None else 4 * len(self.sports)
        self._bad: set[int] = set()
        self._known = frozenset(self.sports)
        self.packets = dict.fromkeys(self.sports, 0)
        self.reused = 0
        self.explored = 0
        self.abandoned = 0

    def pick(self, now_ns: float = 0.0) -> int:
        """The source port of the next packet (counted as sent from it)."""
        mode = self.mode
        if mode == "spray":
            i = self._rr
            port = self.sports[i]
            i += 1
            self._rr = 0 if i == len(self.sports) else i
        elif mode == "oblivious":
            port = self._fixed
        elif self._recycle:
            port = self._recycle.popleft()
            self.reused += 1
        else:
            port = self._explore()
            self.explored += 1
        self.packets[port] += 1
        return port

    def _explore(self) -> int:
        n = len(self.sports)
        if len(self._bad) >= n:
            self._bad.clear()
        for _ in range(n):
            port = self.sports[self._rr]
            self._rr = (self._rr + 1) % n
            if port not in self._bad:
                return port
        return self.sports[self._rr]       # unreachable: _bad was cleared above

    def feedback(self, sport: int, ecn: bool, trimmed: bool, lost: bool) -> None:
        """What became of a packet sent from `sport`: its ACK came back ECN-marked, it was
        trimmed (a NACK), it was lost (SACK hole or timeout), or none of these (clean)."""
        if self.mode != "reps" or sport not in self._known:
            return
        if ecn or trimmed or lost:
            self._bad.add(sport)
            self.abandoned += 1
            return
        self._bad.discard(sport)
        if len(self._recycle) < self._recycle_limit:
            self._recycle.append(sport)

    def counters(self) -> dict:
        out: dict = {"mode": self.mode, "sports": {p: n for p, n in self.packets.items() if n}}
        if self.mode == "reps":
            out.update(reused=self.reused, explored=self.explored, abandoned=self.abandoned,
                       bad=len(self._bad), recycle_queue=len(self._recycle))
        return out
