"""An in-process `Transport` for tests: n ranks as threads of one process.

`LoopbackWorld(n)` holds one message queue per (src, dst, tag); `world.run(fn)` calls
`fn(transport)` on n threads, one per rank, and returns their results (or raises the
first failure, with the rank noted). It is strict where a real transport would
misbehave silently, so a wrong schedule fails fast and clearly instead of hanging or
passing by luck:

- deadlock: a `recv` that cannot be satisfied raises `DeadlockError` at once when every
  unfinished rank is blocked in `recv` (or the awaited peer has returned) and nothing is
  in flight, and in any case after `timeout` seconds; the message says who waits for
  whom. The other ranks then stop with `PeerFailed`.
- send-buffer reuse: `send` copies the data (that copy is what is delivered) and
  `wait_sends` checks that the caller's buffer still holds it, raising
  `BufferReuseError` if it was written before `wait_sends` (a zero-copy transport such
  as the RoCE one would have sent the new contents). A rank returning with sends not
  waited for is an error too.
- a message whose length differs from the `out` buffer, and messages left undelivered
  when every rank has returned, are errors (`LoopbackError`).
- `reorder=seed` holds sent messages back and releases them in a random order across
  tags (same (src, dst, tag) stays FIFO, as the Transport promises); everything a rank
  holds is released before it blocks, so holding never invents a deadlock. Since `recv`
  names its tag, a correct algorithm cannot tell; the mode checks that none relies on
  arrival order across tags. `arrivals[dst]` logs (src, tag) in arrival order.

`bytes_sent[r]`, `bytes_received[r]` and `messages_sent[r]` count each rank's traffic,
so tests can check an algorithm's volume against its analysis.
"""

from __future__ import annotations

import random
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

R = TypeVar("R")


class LoopbackError(RuntimeError):
    """A schedule broke one of the Transport's rules."""


class DeadlockError(LoopbackError):
    """A recv can never (or did not in time) get its message."""


class BufferReuseError(LoopbackError):
    """A buffer handed to send() was written before wait_sends()."""


class PeerFailed(LoopbackError):
    """Another rank failed; this one stopped waiting."""


@dataclass
class _Sent:
    buf: np.ndarray
    payload: bytes
    peer: int
    tag: int


class LoopbackTransport:
    """One rank's view of a LoopbackWorld; satisfies `Transport`."""

    def __init__(self, world: LoopbackWorld, rank: int) -> None:
        self._world, self._rank = world, rank

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._world.size

    def send(self, peer: int, tag: int, data: np.ndarray) -> None:
        self._world._send(self._rank, peer, tag, data)

    def recv(self, peer: int, tag: int, out: np.ndarray) -> None:
        self._world._recv(self._rank, peer, tag, out)

    def wait_sends(self) -> None:
        self._world._wait_sends(self._rank)


class LoopbackWorld:
    def __init__(self, size: int, *, timeout: float = 5.0, reorder: int | None = None) -> None:
        if size < 1:
            raise ValueError(f"a world needs at least one rank, not {size}")
        self.size, self.timeout = size, timeout
        self._lock = threading.Lock()
        # One condition per receiver, sharing the lock: a send wakes only its target.
        self._wake = [threading.Condition(self._lock) for _ in range(size)]
        self._queues: defaultdict[tuple[int, int, int], deque[bytes]] = defaultdict(deque)
        self._rng = random.Random(reorder) if reorder is not None else None
        self._held: list[list[tuple[int, int, bytes]]] = [[] for _ in range(size)]
        self._unwaited: list[list[_Sent]] = [[] for _ in range(size)]
        self._waiting: dict[int, tuple[int, int]] = {}
        self._finished: set[int] = set()
        self._failure: BaseException | None = None
        self.bytes_sent = [0] * size
        self.bytes_received = [0] * size
        self.messages_sent = [0] * size
        self.arrivals: list[list[tuple[int, int]]] = [[] for _ in range(size)]

    def transport(self, rank: int) -> LoopbackTransport:
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} outside 0..{self.size - 1}")
        return LoopbackTransport(self, rank)

    # -- sending ---------------------------------------------------------------------

    def _deliver(self, src: int, dst: int, tag: int, payload: bytes) -> None:
        self._queues[src, dst, tag].append(payload)
        self.arrivals[dst].append((src, tag))
        self._wake[dst].notify()

    def _release_one(self, src: int) -> None:
        """Deliver a random held message of `src` that is the oldest of its (dst, tag)."""
        held, seen, eligible = self._held[src], set(), []
        for i, (dst, tag, _) in enumerate(held):
            if (dst, tag) not in seen:
                seen.add((dst, tag))
                eligible.append(i)
        assert self._rng is not None
        dst, tag, payload = held.pop(self._rng.choice(eligible))
        self._deliver(src, dst, tag, payload)

    def _flush(self, src: int) -> None:
        while self._held[src]:
            self._release_one(src)

    def _send(self, rank: int, peer: int, tag: int, data: np.ndarray) -> None:
        if not isinstance(data, np.ndarray) or not data.flags.c_contiguous:
            raise LoopbackError(f"rank {rank}: send of a non-contiguous buffer (tag {tag})")
        if not 0 <= peer < self.size or peer == rank or tag < 0:
            raise LoopbackError(f"rank {rank}: send to peer {peer} with tag {tag}")
        payload = data.tobytes()
        with self._lock:
            self._raise_if_failed(rank)
            self.bytes_sent[rank] += len(payload)
            self.messages_sent[rank] += 1
            self._unwaited[rank].append(_Sent(data, payload, peer, tag))
            if self._rng is None:
                self._deliver(rank, peer, tag, payload)
                return
            self._held[rank].append((peer, tag, payload))
            if self._rng.random() < 0.5:
                self._release_one(rank)

    def _wait_sends(self, rank: int) -> None:
        with self._lock:
            self._raise_if_failed(rank)
            self._flush(rank)
            sent, self._unwaited[rank] = self._unwaited[rank], []
        for s in sent:
            if s.buf.tobytes() != s.payload:
                with self._lock:
                    raise self._record(BufferReuseError(
                        f"rank {rank} wrote into the buffer it sent to rank {s.peer} with tag "
                        f"{s.tag} before wait_sends(); a zero-copy transport would send the "
                        f"new contents"))

    # -- receiving -------------------------------------------------------------------

    def _raise_if_failed(self, rank: int) -> None:
        if self._failure is not None:
            raise PeerFailed(f"rank {rank} stopped: another rank failed ({self._failure!r})")

    def _record(self, error: BaseException) -> BaseException:
        """Under the lock: keep the first failure and wake every rank so it stops."""
        if self._failure is None:
            self._failure = error
        for c in self._wake:
            c.notify_all()
        return error

    def _stuck(self) -> str | None:
        """Why the waiting ranks can never proceed, or None. Called under the lock,
        after the caller registered its own wait and flushed its held messages."""
        # A rank that was just sent its message but has not woken yet is still listed
        # as waiting: its queue is non-empty, so it never counts as stuck.
        stuck = {r: (peer, tag) for r, (peer, tag) in self._waiting.items()
                 if not self._queues.get((peer, r, tag))}
        for r, (peer, tag) in sorted(stuck.items()):
            if peer in self._finished:
                return f"rank {r} waits for tag {tag} from rank {peer}, which has returned"
        live = self.size - len(self._finished)
        in_flight = any(self._held)
        if len(stuck) == live and not in_flight:
            return "every rank is blocked in recv: " + ", ".join(
                f"rank {r} <- rank {p} tag {t}" for r, (p, t) in sorted(stuck.items()))
        return None

    def _take(self, rank: int, peer: int, tag: int) -> bytes:
        deadline = time.monotonic() + self.timeout
        with self._lock:
            while True:
                self._raise_if_failed(rank)
                q = self._queues.get((peer, rank, tag))
                if q:
                    if len(q) == 1:
                        del self._queues[peer, rank, tag]
                    return q.popleft()
                self._flush(rank)  # a rank releases what it holds before it blocks
                self._waiting[rank] = (peer, tag)
                try:
                    why = self._stuck()
                    remaining = deadline - time.monotonic()
                    if why is None and remaining <= 0:
                        why = (f"rank {rank} waited {self.timeout} s for tag {tag} from rank "
                               f"{peer}; waiting: {self._waiting}")
                    if why is not None:
                        raise self._record(DeadlockError(f"deadlock: {why}"))
                    self._wake[rank].wait(remaining)
                finally:
                    del self._waiting[rank]

    def _recv(self, rank: int, peer: int, tag: int, out: np.ndarray) -> None:
        if not isinstance(out, np.ndarray) or not out.flags.c_contiguous or not out.flags.writeable:
            raise LoopbackError(f"rank {rank}: recv into a non-contiguous or read-only buffer")
        if not 0 <= peer < self.size or peer == rank or tag < 0:
            raise LoopbackError(f"rank {rank}: recv from peer {peer} with tag {tag}")
        payload = self._take(rank, peer, tag)
        with self._lock:
            if len(payload) != out.nbytes:
                raise self._record(LoopbackError(
                    f"rank {rank}: message tag {tag} from rank {peer} has {len(payload)} "
                    f"bytes, the receive buffer {out.nbytes}"))
            self.bytes_received[rank] += len(payload)
        out.reshape(-1).view(np.uint8)[:] = np.frombuffer(payload, dtype=np.uint8)

    # -- running ---------------------------------------------------------------------

    def _body(self, rank: int, fn: Callable[[LoopbackTransport], R],
              results: list[R | None], errors: list[BaseException | None]) -> None:
        try:
            results[rank] = fn(self.transport(rank))
            if self._unwaited[rank]:
                raise LoopbackError(f"rank {rank} returned with sends it never waited for "
                                    "(wait_sends)")
        except BaseException as e:  # every failure, assertions too, is re-raised by run()
            errors[rank] = e
            with self._lock:
                self._record(e)
        finally:
            with self._lock:
                self._flush(rank)
                self._finished.add(rank)
                for c in self._wake:
                    c.notify_all()

    def run(self, fn: Callable[[LoopbackTransport], R]) -> list[R]:
        """fn(transport) on one thread per rank; their results in rank order. The
        counters keep adding up over runs (`reset_counters`); messages do not: each run
        starts with empty queues, even after a failed one."""
        self._finished, self._failure = set(), None
        self._queues.clear()
        self._held = [[] for _ in range(self.size)]
        self._unwaited = [[] for _ in range(self.size)]
        results: list[R | None] = [None] * self.size
        errors: list[BaseException | None] = [None] * self.size
        threads = [threading.Thread(target=self._body, args=(r, fn, results, errors),
                                    name=f"loopback-rank{r}", daemon=True)
                   for r in range(self.size)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if self._failure is not None:
            first = self._failure
            first.add_note(f"(loopback world of {self.size} ranks; first failure, on rank "
                           f"{errors.index(first) if first in errors else '?'})")
            raise first
        left = {k: len(q) for k, q in self._queues.items() if q}
        if left:
            raise LoopbackError("messages never received, (src, dst, tag): count: "
                                + ", ".join(f"{k}: {v}" for k, v in sorted(left.items())))
        return results  # type: ignore[return-value]  # every slot set: no rank failed

    def reset_counters(self) -> None:
        self.bytes_sent = [0] * self.size
        self.bytes_received = [0] * self.size
        self.messages_sent = [0] * self.size
        self.arrivals = [[] for _ in range(self.size)]

