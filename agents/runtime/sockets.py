"""Socket settings and send-error handling every agent's datagram sockets share.

- `tos_byte`: the IPv4 TOS byte from a DSCP and an ECN codepoint (RFC 3168);
- `set_send_timeout` / `set_recv_timeout`: SO_SNDTIMEO / SO_RCVTIMEO from ns;
- `set_send_buffer` / `set_recv_buffer`: SO_SNDBUF / SO_RCVBUF, past the sysctl
  cap when the process may;
- `SendErrors`: what a sender that retries until its datagram is out does with
  each failed send (count it, back off, or give up).

Agents send with BLOCKING sockets and a bounded SO_SNDTIMEO: a send blocked by
a full queue (a PFC-paused port) pushes back on the sender, yet returns often
enough for the agent to see a stop request (`agents.runtime.lifecycle`).
"""

from __future__ import annotations

import errno
import socket
import struct
import time
from collections.abc import Callable

# Linux values Python's socket module does not export (asm-generic, as on x86 and arm).
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)
# the datagrams a socket dropped, full, as a control message (Linux's value if absent)
SO_RXQ_OVFL = getattr(socket, "SO_RXQ_OVFL", 40)
SO_NO_CHECK = 11           # send UDP checksum 0 (Linux; the socket module lacks it)

#: ECN codepoints (the two low bits of the IPv4 TOS byte), RFC 3168.
ECN_CODEPOINTS = {"notect": 0b00, "ect1": 0b01, "ect0": 0b10, "ce": 0b11}
ECT0 = ECN_CODEPOINTS["ect0"]
CE = ECN_CODEPOINTS["ce"]

#: Wait after ENOBUFS (the local qdisc or device queue refused the packet) before retrying.
ENOBUFS_BACKOFF_S = 50e-6
#: errnos a send on an unconnected UDP socket reports when an earlier datagram drew an
#: ICMP error (IP_RECVERR queues those on the socket); the datagram did not go out.
ICMP_SEND_ERRNOS = frozenset({errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH,
                              errno.EHOSTDOWN})

_TIMEVAL = struct.Struct("@ll")


def tos_byte(dscp: int, ecn: str | int = "notect") -> int:
    """The IPv4 TOS byte: DSCP (0..63) in the upper six bits, ECN in the lower two.

    `ecn` is a codepoint's name (a key of ECN_CODEPOINTS) or its 2-bit value.
    """
    if not 0 <= dscp <= 63:
        raise ValueError(f"dscp must be 0..63, got {dscp}")
    if isinstance(ecn, str):
        try:
            bits = ECN_CODEPOINTS[ecn]
        except KeyError:
            raise ValueError(f"ecn must be one of {sorted(ECN_CODEPOINTS)}, "
                             f"got {ecn!r}") from None
    elif 0 <= ecn <= 3:
        bits = ecn
    else:
        raise ValueError(f"ecn must be a 2-bit codepoint, got {ecn!r}")
    return dscp << 2 | bits


def timeval(ns: int) -> bytes:
    """A struct timeval for SO_SNDTIMEO / SO_RCVTIMEO; at least 1 us, since 0 means
    "block forever"."""
    ns = max(ns, 1_000)
    return _TIMEVAL.pack(ns // 1_000_000_000, (ns % 1_000_000_000) // 1_000)


def set_send_timeout(sock: socket.socket, ns: int) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval(ns))


def set_recv_timeout(sock: socket.socket, ns: int) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval(ns))


def _set_buffer(sock: socket.socket, force_opt: int, opt: int, nbytes: int | None) -> None:
    if not nbytes:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, force_opt, nbytes)  # needs CAP_NET_ADMIN
    except OSError:
        sock.setsockopt(socket.SOL_SOCKET, opt, nbytes)  # capped at net.core.[rw]mem_max


def set_send_buffer(sock: socket.socket, nbytes: int | None) -> None:
    """SO_SNDBUF = `nbytes` (the kernel doubles it); None or 0 keeps the default."""
    _set_buffer(sock, SO_SNDBUFFORCE, socket.SO_SNDBUF, nbytes)


def set_recv_buffer(sock: socket.socket, nbytes: int | None) -> None:
    """SO_RCVBUF = `nbytes` (the kernel doubles it); None or 0 keeps the default."""
    _set_buffer(sock, SO_RCVBUFFORCE, socket.SO_RCVBUF, nbytes)


class SendErrors:
    """Failed sends of a sender that retries each datagram until it is out."""

    __slots__ = ("eagain", "enobufs", "icmp_errors")

    def __init__(self) -> None:
        self.eagain = 0         # SO_SNDTIMEO expired: the queue stayed full (a paused port)
        self.enobufs = 0        # the local qdisc refused the packet
        self.icmp_errors = 0    # an earlier datagram's ICMP error, reported on this send

    def absorb(self, e: OSError) -> str:
        """Account one failed send before it is retried: 'eagain', 'enobufs' (after
        backing off ENOBUFS_BACKOFF_S) or 'icmp'. Re-raises what a retry cannot fix."""
        if isinstance(e, BlockingIOError):
            self.eagain += 1
            return "eagain"
        if e.errno == errno.ENOBUFS:
            self.enobufs += 1
            time.sleep(ENOBUFS_BACKOFF_S)
            return "enobufs"
        if e.errno in ICMP_SEND_ERRNOS:
            self.icmp_errors += 1
            return "icmp"
        raise e


def dial_tcp(addr: tuple[str, int], bind: str | None, deadline: float,
             should_stop: Callable[[], bool], attempt_s: float) -> socket.socket | None:
    """Connect to a TCP set-up port, retrying until CLOCK_MONOTONIC `deadline` (the peer
    may not listen yet): the connected socket (TCP_NODELAY, blocking), None if
    `should_stop()` turned true first, TimeoutError naming the last failure at the
    deadline. Each attempt waits at most `attempt_s`."""
    last: OSError | None = None
    while time.monotonic() < deadline:
        if should_stop():
            return None
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            if bind:
                s.bind((bind, 0))
            s.settimeout(max(0.1, min(attempt_s, deadline - time.monotonic())))
            s.connect(addr)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.settimeout(None)
            return s
        except OSError as e:
            last = e
            s.close()
            time.sleep(0.05)
    raise TimeoutError(str(last or "timed out"))
