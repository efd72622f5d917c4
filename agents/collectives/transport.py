"""What a collective algorithm needs of the network: tagged point-to-point messages.

A `Transport` connects one rank to every other rank of its communicator. `send` hands
a buffer to the network and returns at once (the transport may pipeline it over
several QPs in chunks); `recv` returns the message `peer` sent with `tag`, waiting for
it (and driving the network while it waits). Messages between two ranks with the same
tag arrive in the order they were sent; different tags may be received in any order.
`wait_sends` returns once every buffer handed to `send` may be reused.

Tags are small non-negative integers an algorithm chooses (e.g. step * chunks + chunk);
a transport must keep messages of different tags apart.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from agents.timebase import FabricClock


class Transport(Protocol):
    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def send(self, peer: int, tag: int, data: np.ndarray) -> None:
        """Send the bytes of `data` (a contiguous array) to `peer`; returns at once."""

    def recv(self, peer: int, tag: int, out: np.ndarray) -> None:
        """Fill `out` (contiguous, the sender's byte length) with `peer`'s message `tag`."""

    def wait_sends(self) -> None:
        """Block until every buffer given to send() may be reused."""


class RankTransport(Transport, Protocol):
    """What a worker (`python -m agents.collectives`, the training step) needs of its
    rank's transport beyond the algorithms' `Transport`: its fabric clock, driving it
    until a condition holds, leaving together (agents.collectives.sync), counters.
    `RoceTransport` and `UetTransport` are both one."""

    clock: FabricClock

    def drive(self, done: Callable[[], bool]) -> None:
        """Serve the network until `done()`."""

    def leave(self, reason: str) -> None:
        """Tell every peer why this rank goes ('done': no error to them)."""

    def peers_done(self) -> bool:
        """Every peer has said 'done'."""

    def counters(self) -> dict:
        """The transport's counters: flat totals at the top level, details below."""

    def close(self) -> None:
        """Release the sockets."""
