"""Clock offsets between the VMs of a scale-out run, so their samples merge on one time axis.

Every VM of a run starts at one common CLOCK_REALTIME instant and stamps its samples with its
own clock, so merging their run directories needs each VM's offset to a reference VM. This
module measures it the way NTP does: the reference runs a `ClockServer` on UDP `CLOCK_PORT` of
the underlay; every other VM `measure`s a few request/reply exchanges against it, each giving
four timestamps

    t1  client sent        (client clock)
    t2  server received    (server clock)
    t3  server replied     (server clock)
    t4  client received    (client clock)

from which offset = -((t2 - t1) + (t3 - t4)) / 2 (the client's clock minus the server's) and
round trip = (t4 - t1) - (t3 - t2) (the server's processing excluded). The offset assumes the
two directions take equally long; however unequal they are, the true offset is within
+- rtt/2 of it. `estimate` therefore keeps the exchange with the smallest round trip: the one
least delayed by queueing, whose bound is tightest.

Wire format (all integers big-endian, network order; timestamps are signed ns since the epoch):

    request, 24 bytes:  magic b"TBCK" | version 1 (1 byte) | type 0 (1 byte) | 2 zero bytes
                        | sequence (8 bytes, unsigned) | t1 (8 bytes)
    reply, 40 bytes:    magic b"TBCK" | version 1 | type 1 | 2 zero bytes
                        | the request's sequence | t1 echoed | t2 | t3

The server replies to the request's source address. Any datagram that is not exactly a
request (another length, magic, version or type, non-zero padding; a reply) is malformed: the
server counts it and does not answer, so two servers cannot ping-pong. The client accepts a
reply only from the server's address and with the sequence and t1 of its outstanding
request, so a late reply to an earlier request, or a datagram from anyone else, is ignored.
"""

from __future__ import annotations

import dataclasses
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

CLOCK_PORT = 7199  # UDP port of the reference's clock server on the underlay

MAGIC = b"TBCK"
VERSION = 1
TYPE_REQUEST = 0
TYPE_REPLY = 1

_REQUEST = struct.Struct("!4sBBHQq")  # magic, version, type, padding, sequence, t1
_REPLY = struct.Struct("!4sBBHQqqq")  # magic, version, type, padding, sequence, t1, t2, t3
_RECV_SIZE = 512  # larger than any valid datagram, so an oversized one arrives as too long
_POLL_S = 0.1  # how long stop() may wait for the server thread to notice


@dataclass(frozen=True)
class Exchange:
    """One request/reply; all CLOCK_REALTIME ns."""

    t1_ns: int  # client sent (client clock)
    t2_ns: int  # server received (server clock)
    t3_ns: int  # server replied (server clock)
    t4_ns: int  # client received (client clock)

    @property
    def rtt_ns(self) -> int:
        """The time on the wire both ways: the client's wait less the server's processing."""
        return (self.t4_ns - self.t1_ns) - (self.t3_ns - self.t2_ns)

    @property
    def offset_ns(self) -> int:
        """This client's clock minus the server's (half a ns truncated toward zero)."""
        twice = (self.t2_ns - self.t1_ns) + (self.t3_ns - self.t4_ns)
        # Integer arithmetic, not float: timestamps near 2**61 lose ns in a double.
        half = abs(twice) // 2
        return -half if twice > 0 else half


@dataclass(frozen=True)
class ClockOffset:
    reference: str  # the reference VM's name
    offset_ns: int  # this VM's CLOCK_REALTIME minus the reference's (positive: this VM is ahead)
    rtt_ns: int  # the round trip of the exchange it came from
    uncertainty_ns: int  # rtt / 2: the offset is within +- this (NTP's bound)
    exchanges: int  # how many replies were received

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def estimate(exchanges: Sequence[Exchange], reference: str) -> ClockOffset:
    """The offset of the exchange with the smallest round trip (its queueing delay is least,
    so its path asymmetry bound rtt/2 is tightest); ValueError for no exchanges."""
    if not exchanges:
        raise ValueError("no clock exchanges to estimate an offset from")
    best = min(exchanges, key=lambda e: e.rtt_ns)  # first of equals: deterministic
    return ClockOffset(
        reference=reference,
        offset_ns=best.offset_ns,
        rtt_ns=best.rtt_ns,
        # Rounded up, so that an odd rtt still gives a true bound.
        uncertainty_ns=-(-best.rtt_ns // 2),
        exchanges=len(exchanges),
    )


def encode_request(sequence: int, t1_ns: int) -> bytes:
    return _REQUEST.pack(MAGIC, VERSION, TYPE_REQUEST, 0, sequence, t1_ns)


def decode_request(data: bytes) -> tuple[int, int] | None:
    """(sequence, t1) of a well-formed request, else None."""
    if len(data) != _REQUEST.size:
        return None
    magic, version, kind, pad, sequence, t1 = _REQUEST.unpack(data)
    if magic != MAGIC or version != VERSION or kind != TYPE_REQUEST or pad != 0:
        return None
    return sequence, t1


def encode_reply(sequence: int, t1_ns: int, t2_ns: int, t3_ns: int) -> bytes:
    return _REPLY.pack(MAGIC, VERSION, TYPE_REPLY, 0, sequence, t1_ns, t2_ns, t3_ns)


def decode_reply(data: bytes) -> tuple[int, int, int, int] | None:
    """(sequence, t1, t2, t3) of a well-formed reply, else None."""
    if len(data) != _REPLY.size:
        return None
    magic, version, kind, pad, sequence, t1, t2, t3 = _REPLY.unpack(data)
    if magic != MAGIC or version != VERSION or kind != TYPE_REPLY or pad != 0:
        return None
    return sequence, t1, t2, t3


class ClockServer:
    """Answers clock requests on a bound UDP socket from a thread until stop().

    The socket stays the caller's: stop() does not close it. `requests` and `malformed` are
    written by the server thread only.
    """

    def __init__(self, sock: socket.socket, clock: Callable[[], int] = time.time_ns) -> None:
        self.sock = sock
        self.clock = clock
        self.requests = 0  # answered so far
        self.malformed = 0  # datagrams that were not a request (ignored, counted)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("clock server already started")
        self._stop.clear()
        # Daemon: a server never stopped must not keep the process alive.
        self._thread = threading.Thread(target=self._serve, name="clock-server", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Returns once the thread has ended (within about 0.1 s)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _serve(self) -> None:
        # select with a timeout rather than a blocking recv, so stop() needs no datagram and
        # the caller's socket keeps its own blocking mode.
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([self.sock], [], [], _POLL_S)
            except (OSError, ValueError):
                return  # the socket was closed under us: nothing left to serve
            if not ready:
                continue
            try:
                data, peer = self.sock.recvfrom(_RECV_SIZE)
            except OSError:
                continue  # e.g. a queued ICMP error: not a request, and nothing to answer
            t2 = self.clock()
            request = decode_request(data)
            if request is None:
                self.malformed += 1
                continue
            sequence, t1 = request
            # Counted before sending, so a client that has its reply sees it counted.
            self.requests += 1
            try:
                self.sock.sendto(encode_reply(sequence, t1, t2, self.clock()), peer)
            except OSError:
                self.requests -= 1  # not answered after all; the client will time out


def measure(sock: socket.socket, server: tuple[str, int], reference: str, *, count: int = 16,
            timeout_s: float = 0.2,
            clock: Callable[[], int] = time.time_ns) -> ClockOffset | None:
    """`count` exchanges with `server` over `sock` (a UDP socket, bound or not); None when
    no reply came at all. Replies that do not match the outstanding request (a stale one,
    another sender's) are ignored.

    Each request waits at most `timeout_s` for its reply; one that is lost is not resent. An
    exchange whose round trip comes out negative (a clock stepped during it) is dropped, as
    is a request the socket fails to send.
    """
    if count < 1:
        raise ValueError(f"count must be at least 1, not {count}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, not {timeout_s}")
    # Resolved once, so that replies can be matched against the address they must come from.
    address = socket.getaddrinfo(server[0], server[1], sock.family, socket.SOCK_DGRAM)[0][4]
    # A random first sequence: a reply to an earlier measure() on this socket cannot match.
    base = secrets.randbits(64)
    done: list[Exchange] = []
    for i in range(count):
        sequence = (base + i) % 2**64
        t1 = clock()
        try:
            sock.sendto(encode_request(sequence, t1), address)
        except OSError:
            continue
        exchange = _await_reply(sock, address, sequence, t1, timeout_s, clock)
        if exchange is not None and exchange.rtt_ns >= 0:
            done.append(exchange)
    return estimate(done, reference) if done else None


def _await_reply(sock: socket.socket, address: tuple, sequence: int, t1: int,
                 timeout_s: float, clock: Callable[[], int]) -> Exchange | None:
    # The deadline is on the monotonic clock: `clock` may step, or be a test's fake.
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            ready, _, _ = select.select([sock], [], [], left)
        except InterruptedError:
            continue
        if not ready:
            return None
        try:
            data, peer = sock.recvfrom(_RECV_SIZE)
        except (BlockingIOError, InterruptedError):
            continue
        except OSError:
            return None  # e.g. ECONNREFUSED on a connected socket: no server there
        t4 = clock()
        reply = decode_reply(data)
        if reply is None or tuple(peer[:2]) != tuple(address[:2]):
            continue
        r_sequence, r_t1, t2, t3 = reply
        if r_sequence != sequence or r_t1 != t1:
            continue  # stale: the reply to a request that already timed out
        return Exchange(t1_ns=t1, t2_ns=t2, t3_ns=t3, t4_ns=t4)
    return None
