"""The TCP set-up connections of a communicator whose data transport needs no exchange
of its own (the UET one: its PDCs are made on first use), and what they say afterwards.

Each rank listens on its TCP set-up port; rank i connects to every rank j > i and
accepts one connection from each j < i (as `agents.collectives.roce.connect` does, with
its line framing and retries). Over each connection both sides send one JSON hello (the
transport's protocol version and settings, rank, communicator size) and check the
other's: a rank with other settings is a SetupError on both sides, before any data.

The connections then stay open, idle, as the RoCE transport keeps its own: `leave(reason)`
tells every peer why this rank goes; a peer that leaves other than by finishing
('done'), or dies (its connection closes), fails `check()` with a TransportError, so a
rank waiting for that peer's data learns it instead of waiting for ever.
"""

from __future__ import annotations

import json
import select
import socket
import time
from collections.abc import Callable

# One framing and dialling for both transports' set-up: the RoCE module's helpers.
from agents.collectives.roce import (
    PeerAddress,
    SetupError,
    Stopped,
    TransportError,
    _accept,
    _dial,
    _Line,
    listen,
)

#: Wall seconds between two looks at the set-up connections (has a peer left?).
LINK_CHECK_S = 0.1


class PeerLinks:
    """A rank's open set-up connections: who left, and why."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank = rank
        self.size = size
        self._links: dict[int, socket.socket] = {}
        self._said: dict[int, str] = {}            # peer -> the reason it gave for leaving
        self._left: str | None = None              # the reason we gave
        self.next_check = 0.0                      # time.monotonic() of the next look

    def add(self, peer: int, sock: socket.socket) -> None:
        sock.setblocking(False)
        self._links[peer] = sock

    def due(self) -> bool:
        return time.monotonic() >= self.next_check

    def check(self) -> None:
        """Raise TransportError if a peer went away other than by finishing ('done')."""
        self.next_check = time.monotonic() + LINK_CHECK_S
        if not self._links:
            return
        ready, _, _ = select.select(list(self._links.values()), [], [], 0)
        for peer, sock in list(self._links.items()):
            if sock not in ready:
                continue
            try:
                data = sock.recv(4096)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                data = b""
            for line in data.splitlines():
                try:
                    self._said[peer] = str(json.loads(line)["bye"])
                except (ValueError, KeyError, TypeError):
                    pass
            if not data:                                # the connection closed
                sock.close()
                del self._links[peer]
            reason = self._said.get(peer)
            if reason == "done" or (data and reason is None):
                continue
            raise TransportError(f"rank {self.rank}: rank {peer} left "
                                 f"({reason or 'connection lost'})")

    def leave(self, reason: str) -> None:
        """Tell every peer why we go ('done' is no error to them); said once."""
        if self._left is not None:
            return
        self._left = reason
        msg = json.dumps({"bye": reason}).encode() + b"\n"
        for sock in self._links.values():
            try:
                sock.send(msg)
            except OSError:
                pass

    def peers_done(self) -> bool:
        return all(self._said.get(p) == "done" for p in range(self.size) if p != self.rank)

    def close(self) -> None:
        for sock in self._links.values():
            sock.close()
        self._links.clear()


def _check_hello(mine: dict, msg: dict, rank: int, size: int, peer: int | None) -> int:
    """The peer's rank, if its hello has our settings (every key of `mine`)."""
    bad = {k: msg.get(k) for k, v in mine.items() if msg.get(k) != v}
    if bad:
        raise SetupError(f"rank {msg.get('rank')} differs from rank {rank}: {bad} "
                         f"(ours: { {k: mine[k] for k in bad} })")
    theirs = msg.get("rank")
    if (not isinstance(theirs, int) or isinstance(theirs, bool)
            or (peer is not None and theirs != peer) or not 0 <= theirs < size
            or theirs == rank):
        raise SetupError(f"rank {rank}: a set-up hello from rank {theirs!r}, expected "
                         f"{peer if peer is not None else 'a lower rank'}")
    return theirs


def connect_links(rank: int, peers: list[PeerAddress], settings: dict, *,
                  timeout_s: float, should_stop: Callable[[], bool] | None = None,
                  on_listening: Callable[[], None] | None = None) -> PeerLinks:
    """Connect rank `rank` to every other rank of `peers`, each side checking the other
    has `settings` (a JSON-able dict: version, transport, chunking ...), within
    `timeout_s` wall seconds; `on_listening()` once the set-up port listens."""
    stop = should_stop or (lambda: False)
    size = len(peers)
    mine = {**settings, "size": size}
    links = PeerLinks(rank, size)
    lsock: socket.socket | None = None
    try:
        lsock = listen(peers[rank])
        if on_listening is not None:
            on_listening()
        deadline = time.monotonic() + timeout_s
        for peer in range(rank + 1, size):
            sock = _dial(peers[peer], peers[rank].ip, deadline, stop)
            try:
                line = _Line(sock, f"rank {peer}")
                line.send({**mine, "rank": rank})
                reply = line.recv(deadline, stop)
                if reply.get("error"):
                    raise SetupError(f"rank {peer} refused: {reply['error']}")
                _check_hello(mine, reply, rank, size, peer)
            except BaseException:
                sock.close()
                raise
            links.add(peer, sock)
        for _ in range(rank):
            sock = _accept(lsock, deadline, stop)
            try:
                line = _Line(sock, "a lower rank")
                msg = line.recv(deadline, stop)
                try:
                    peer = _check_hello(mine, msg, rank, size, None)
                    if peer > rank:
                        raise SetupError(f"rank {peer} connected to rank {rank}; higher "
                                         "ranks are connected to, not accepted")
                except SetupError as e:
                    line.send({"error": str(e)})
                    raise
                line.send({**mine, "rank": rank})
            except BaseException:
                sock.close()
                raise
            links.add(peer, sock)
    except BaseException:
        links.close()
        raise
    finally:
        if lsock is not None:
            lsock.close()
    return links


__all__ = ["LINK_CHECK_S", "PeerLinks", "SetupError", "Stopped", "TransportError",
           "connect_links"]
