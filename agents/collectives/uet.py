"""`UetTransport`: the collectives' `Transport` over the Ultra Ethernet transport.

One rank owns one `agents.uet.nic.UetNic` (UDP port 4793 on its host, so one UET rank
per host) and reaches every other rank's NIC by IP. A message is one or more UET SENDs
(SES opcode SEND, reliable unordered delivery: sprayed over the configured entropies,
selectively retransmitted, under NSCC, receiver credit or no congestion control as the
NIC is set up); nothing is exchanged to open a connection, since the NIC makes its PDC
to a peer on first use.

Framing is the RoCE transport's (`agents.collectives.roce.Messages`): a message is split
into chunks of at most `chunk_bytes - 16` data bytes, each prefixed with the 16-byte
header (tag, per-(peer, tag) message number, offset, total length), and each chunk is
one SEND. The receiver places a chunk by its header, so it needs nothing of the NIC's
delivery order; the NIC's order (message id per (peer, match bits)) is a bonus, not a
dependency. Chunks bound what one SEND asks of the target's reassembly, and let the
sender's NIC start on the first while the rest are framed.

Match bits: `MATCH_SPACE << 32 | tag`. The high half says "a collective chunk", so SENDs
of another UET user on the host are not taken for ours; the low half repeats the
header's tag, checked on arrival. A SEND with other match bits, or from an address that
is no rank, is a TransportError (counted first, in `stray_messages`).

`send` frames and posts at once (the chunks are copies: the caller's buffer is free when
it returns; the chunk arrays stay referenced until the NIC calls their `on_done`, as the
NIC may send from them). `wait_sends` drives the NIC until every SEND's `on_done` came,
that is until the target acknowledged every packet of it. `recv` binds its buffer to the
next message of (peer, tag) and drives the NIC until it is whole. Driving is
`nic.step()` until nothing is due, then `nic.wait()`. A PDC the NIC gives up on (its
`on_error`: a packet unacknowledged after its retries), an exception it raises while
stepping, or a message that is not ours fails the call with a TransportError; the NIC's
own Stopped (a blocked send saw the stop request) is the transport's Stopped. The set-up
connections (`agents.collectives.links`) say when a peer leaves.

Everything is fabric time (`agents.timebase.FabricClock`, the NIC's clock).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from agents.collectives.links import PeerLinks, connect_links
from agents.collectives.roce import (
    HEADER,
    HEADER_BYTES,
    Messages,
    PeerAddress,
    SetupError,
    Stopped,
    TransportError,
)
from agents.runtime.framing import WIRE_OVERHEAD_BYTES
from agents.timebase import Dilation, FabricClock
from agents.uet.nic import Stopped as NicStopped
from agents.uet.nic import UetNic, UetOptions

__all__ = ["MATCH_SPACE", "PROTOCOL_VERSION", "NicLike", "UetConfig",
           "UetTransport", "connect", "match_bits"]

#: 1: chunks with the RoCE framing header as UET SENDs, match bits MATCH_SPACE:tag.
PROTOCOL_VERSION = 1
#: The high 32 match bits of every collective chunk ("C011").
MATCH_SPACE = 0xC011
MAX_TAG = 0xFFFFFFFF


def match_bits(tag: int) -> int:
    """The match bits of a chunk of a message with `tag`."""
    if not 0 <= tag <= MAX_TAG:
        raise ValueError(f"tag {tag} is not a u32")
    return MATCH_SPACE << 32 | tag


class NicLike(Protocol):
    """What the transport needs of `agents.uet.nic.UetNic` (the tests' fake has it too)."""

    on_message: Callable[[str, int, int, memoryview], None] | None
    on_error: Callable[[str, str], None] | None

    def send(self, peer_ip: str, match_bits: int, data: Any, *,
             on_done: Callable[[int], None] | None = None) -> int: ...

    def step(self) -> bool: ...

    def wait(self, max_wall_ns: int = ...) -> None: ...

    def idle(self) -> bool: ...

    def counters(self) -> dict: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class UetConfig:
    """How a rank's UET transport is set up: the NIC's options and the framing."""

    options: UetOptions
    chunk_bytes: int = 1 << 20
    dilation: int = 1
    connect_timeout_s: float = 10.0
    udp_port: int = 4793             # every rank's NIC port (peers are told apart by IP)

    def settings(self) -> dict:
        """What every rank of a communicator must agree on (checked in the set-up hello)."""
        o = self.options
        return {"version": PROTOCOL_VERSION, "transport": "uet",
                "chunk_bytes": self.chunk_bytes, "udp_port": self.udp_port,
                "cc": o.cc, "payload_bytes": o.payload_bytes}

    def record(self) -> dict:
        """The settings a rank reports: the agreed ones, the NIC's options, the dilation."""
        return {**self.settings(), "options": dataclasses.asdict(self.options),
                "dilation": self.dilation}


class UetTransport:
    """A rank's `Transport` over one UET NIC: see the module docstring.

    `peers[i]` is rank i's IP. Made by `connect` over a real `UetNic`; the tests make
    it over fakes. `send` posts and returns, `recv` and `wait_sends` drive the NIC until
    their condition holds, raising `Stopped` once `should_stop()` is true.
    """

    def __init__(self, rank: int, peers: list[str], nic: NicLike, clock: FabricClock, *,
                 chunk_bytes: int = 1 << 20, links: PeerLinks | None = None,
                 should_stop: Callable[[], bool] | None = None,
                 settings: dict | None = None) -> None:
        if not 0 <= rank < len(peers):
            raise ValueError(f"rank {rank} is not in 0..{len(peers) - 1}")
        if len(set(peers)) != len(peers):
            raise ValueError("two UET ranks share an IP: one UET NIC (UDP 4793) per host")
        self._rank = rank
        self.peers = peers
        self.nic = nic
        self.clock = clock
        self.chunk_bytes = chunk_bytes
        self.links = links or PeerLinks(rank, len(peers))
        self._should_stop = should_stop or (lambda: False)
        self._settings = settings or {}
        self.messages = Messages(rank, len(peers), 1, chunk_bytes)
        self._rank_of = {ip: r for r, ip in enumerate(peers)}
        # send number -> (peer, chunk): referenced until the NIC says it is delivered. Our
        # own numbers, not the NIC's message ids: those are per PDC (two peers' SENDs may
        # share one) and wrap at 2^16.
        self._unacked: dict[int, tuple[int, np.ndarray]] = {}
        self._sends = 0
        self._error: TransportError | None = None
        self.stray_messages = 0
        self.steps = 0
        self.waits = 0
        nic.on_message = self._on_message
        nic.on_error = self._on_error

    # -- the Transport protocol

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return len(self.peers)

    def send(self, peer: int, tag: int, data: np.ndarray) -> None:
        bits = match_bits(tag)
        ip = self.peers[peer] if 0 <= peer < self.size else ""
        for _q, chunk in self.messages.frame(peer, tag, data):
            n = self._sends
            self._sends = n + 1
            self._unacked[n] = (peer, chunk)     # before send: on_done may come inside it
            try:
                self.nic.send(ip, bits, chunk.data, on_done=functools.partial(self._on_done, n))
            except NicStopped:
                raise Stopped() from None
            except (OSError, ValueError, RuntimeError) as e:
                self._unacked.pop(n, None)
                raise TransportError(f"rank {self._rank}: the UET NIC refused a "
                                     f"{chunk.nbytes}-byte SEND to rank {peer}: {e}") from e

    def recv(self, peer: int, tag: int, out: np.ndarray) -> None:
        key = self.messages.expect(peer, tag, out)
        self.drive(lambda: self.messages.complete(key))
        self.messages.take(key)

    def wait_sends(self) -> None:
        self.drive(self.sends_done)

    # -- the NIC's callbacks (from inside nic.step: they never raise into the NIC)

    def _on_done(self, n: int, _message_id: int) -> None:
        entry = self._unacked.pop(n, None)
        if entry is not None:              # the NIC says each message is done once
            peer, chunk = entry
            self.messages.sent(peer, chunk.nbytes)

    def _on_error(self, peer_ip: str, reason: str) -> None:
        """The NIC gave up on its PDC to `peer_ip` (a packet unacknowledged after its
        retries): what was sent to that peer will never be acknowledged."""
        if self._error is None:
            peer = self._rank_of.get(peer_ip)
            who = f"rank {peer}" if peer is not None else peer_ip
            self._error = TransportError(f"rank {self._rank}: the UET NIC's PDC to {who} "
                                         f"failed: {reason}")

    def _on_message(self, peer_ip: str, bits: int, message_id: int, data: memoryview) -> None:
        if self._error is not None:
            return
        peer = self._rank_of.get(peer_ip)
        try:
            if peer is None or peer == self._rank:
                raise TransportError(f"rank {self._rank}: a UET SEND from {peer_ip}, which "
                                     "is no rank of this communicator")
            if bits >> 32 != MATCH_SPACE:
                raise TransportError(f"rank {self._rank}: a UET SEND from rank {peer} with "
                                     f"match bits {bits:#x}, not a collective chunk's")
            chunk = np.frombuffer(data, dtype=np.uint8)
            if chunk.nbytes >= HEADER_BYTES:
                tag = HEADER.unpack_from(chunk.data, 0)[0]
                if tag != bits & MAX_TAG:
                    raise TransportError(f"rank {self._rank}: a chunk from rank {peer} says "
                                         f"tag {tag} in match bits {bits:#x}")
            # deliver copies the bytes out: `data` may be the NIC's buffer
            self.messages.deliver(peer, chunk)
        except TransportError as e:
            self.stray_messages += 1
            self._error = e

    # -- driving

    def sends_done(self) -> bool:
        return not self._unacked

    def drive(self, done: Callable[[], bool]) -> None:
        """Step the NIC until `done()`; Stopped on a stop request, TransportError if a
        message could not be delivered or the NIC failed, or a peer left."""
        nic, links = self.nic, self.links
        while True:
            if self._error is not None:
                raise self._error
            if done():
                return
            if self._should_stop():
                raise Stopped()
            if links.due():
                links.check()
            try:
                busy = nic.step()
                self.steps += 1
                if not busy and not done() and self._error is None:
                    self.waits += 1
                    nic.wait()
            except (TransportError, Stopped):
                raise
            except NicStopped:                  # a blocked send saw the stop request
                raise Stopped() from None
            except (OSError, ValueError, RuntimeError) as e:
                raise TransportError(f"rank {self._rank}: the UET NIC failed: "
                                     f"{type(e).__name__}: {e}") from e

    # -- leaving (the set-up connections)

    def leave(self, reason: str) -> None:
        self.links.leave(reason)

    def peers_done(self) -> bool:
        return self.links.peers_done()

    def check_links(self) -> None:
        self.links.check()

    def close(self) -> None:
        self.links.close()
        self.nic.close()

    # -- counters

    def counters(self) -> dict:
        """Per peer (payload, messages, chunks; the NIC's PDC to it) and summed; the NIC's
        integer totals flat, `wire_bytes_sent` (UDP payload of every packet the NIC
        sent plus agents.runtime.framing's per-packet overhead), and the NIC's own."""
        nic = self.nic.counters()
        pdcs = nic.get("pdcs") or {}
        per_peer: dict[str, dict] = {}
        totals: dict[str, int] = {}
        for peer in range(self.size):
            if peer == self._rank:
                continue
            pc = self.messages.peers[peer]
            c = {"bytes_sent": pc.bytes_sent, "bytes_posted": pc.bytes_posted,
                 "bytes_received": pc.bytes_received, "messages_sent": pc.messages_sent,
                 "messages_received": pc.messages_received, "chunks_sent": pc.chunks_sent,
                 "chunks_posted": pc.chunks_posted, "chunks_received": pc.chunks_received,
                 "unexpected_chunks": pc.unexpected_chunks}
            for k, v in c.items():
                totals[k] = totals.get(k, 0) + v
            per_peer[str(peer)] = {**c, "pdc": pdcs.get(self.peers[peer], {})}
        # every integer total of the NIC (tx_packets, retransmissions, trims_received, ...;
        # docs/uet-transport.md), flat, so the live snapshot samples it
        nic_totals = nic.get("totals") or {}
        flat = {k: v for k, v in nic_totals.items()
                if isinstance(v, int) and not isinstance(v, bool)}
        tx_packets, tx_bytes = flat.get("tx_packets", 0), flat.get("tx_bytes", 0)
        return {**totals, **flat,
                "wire_bytes_sent": tx_bytes + tx_packets * WIRE_OVERHEAD_BYTES,
                "stray_messages": self.stray_messages, "per_peer": per_peer, "uet": nic,
                "setup_refused": dict(self.links.setup_refused),
                "setup_refused_total": sum(self.links.setup_refused.values()),
                "transport": "uet", "chunk_bytes": self.chunk_bytes,
                "engine": {"steps": self.steps, "waits": self.waits},
                "settings": self._settings}


# --------------------------------------------------------------------------- set-up


def connect(rank: int, peers: list[PeerAddress], config: UetConfig, *,
            should_stop: Callable[[], bool] | None = None,
            on_listening: Callable[[], None] | None = None) -> UetTransport:
    """Make rank `rank`'s UET NIC on its IP, then the set-up connections to every other
    rank (`agents.collectives.links`), and return its transport. The NIC is bound before
    the set-up port listens, so a peer that has our hello can send to us at once."""

    stop = should_stop or (lambda: False)
    ips = [p.ip for p in peers]
    if len(set(ips)) != len(ips):
        raise SetupError("two UET ranks share an IP: one UET NIC (UDP 4793) per host")
    dilation = Dilation(config.dilation)
    clock = FabricClock(dilation)
    nic = UetNic(ips[rank], clock, dilation, config.options, port=config.udp_port,
                 should_stop=stop)
    try:
        links = connect_links(rank, peers, config.settings(),
                              timeout_s=config.connect_timeout_s, should_stop=stop,
                              on_listening=on_listening)
    except BaseException:
        nic.close()
        raise
    return UetTransport(rank, ips, nic, clock, chunk_bytes=config.chunk_bytes, links=links,
                        should_stop=stop, settings=config.record())

