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

import socket
import time
from collections.abc import Callable

# One framing and dialling for both transports' set-up: the RoCE module's helpers.
from agents.collectives.roce import (
    LINK_CHECK_S,
    PeerAddress,
    PeerLinks,
    SetupError,
    Stopped,
    TransportError,
    _dial,
    _Line,
    _take_hello,
    listen,
)


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
            sock, line, msg = _take_hello(rank, peers, links.setup_refused, lsock, deadline,
                                          stop, int_keys=("rank",), qp_list=False)
            try:
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
