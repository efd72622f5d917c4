"""`RoceTransport`: the collectives' `Transport` over the user-space RoCEv2 RC transport.

One rank of a communicator talks to every other rank over RC queue pairs
(`agents.rdma`): one UDP socket (`Endpoint`) per rank on its RoCE port, `qps` QPs
(1..8) per pair of ranks, all driven by one `Engine` from the caller's thread.

Data moves as RDMA WRITEs with immediate into a landing ring per QP, as NCCL's IB
transport moves its data:

- on the wire these are RDMA_WRITE_FIRST / _MIDDLE / _LAST_WITH_IMMEDIATE, or one
  RDMA_WRITE_ONLY_WITH_IMMEDIATE: RoCEv2 packets with the QP's DSCP and ECT(0),
  paced by its rate controller, answered by CNPs on the CNP DSCP, so DCQCN, ECN and
  PFC act on them as on perftest's write_bw;
- the immediate gives the receiver one completion per chunk, in order, with its
  length, on each QP (a WRITE without it would give the target nothing: a flag in
  memory to poll, and a credit protocol back to the sender before a slot is reused).

The landing ring. For each QP, the receiver registers one `MemoryRegion` of `depth` =
`recv_depth(...)` slots of `chunk_bytes` and tells the sender its VA, R_Key and slot
count in the set-up hello. It posts `depth` zero-length receive WQEs, one per free
slot. The sender writes the n-th chunk it sends on a QP (n from 0) into slot
n mod depth, with the immediate `(n mod 2^16) << 16 | slot`. RC delivers a QP's
messages in order, so the receiver's n-th receive completion on that QP is chunk n,
in slot n mod depth: the receiver checks the immediate against that, and a mismatch
(a lost or doubled completion, a confused peer) is a TransportError, never bytes
taken from the wrong slot. Once a chunk has been consumed (copied into its message's
buffer by `Messages.deliver`), its slot's WQE is posted again; completions are taken
in order, so WQEs are re-posted in slot order.

Why slot n mod depth is free when the WRITE of chunk n + depth is accepted: the WQEs
are posted `depth` at set-up and one more each time a chunk has been consumed, so the
WQE numbered n + depth in posting order exists only after chunk n, the one in slot
n mod depth = (n + depth) mod depth, was consumed. The responder takes a QP's
messages one at a time in PSN order, and each WRITE with immediate consumes one WQE,
the oldest: when the first packet of chunk n + depth is the expected one, chunks
0 .. n + depth - 1 have consumed WQEs 0 .. n + depth - 1, so a WQE is posted only if
WQE n + depth is. The ring's region is registered `writes_need_recv`, which makes the
responder RNR-NAK the first packet of a WRITE into it while no WQE is posted
(agents.rdma.qp): no byte of chunk n + depth lands before slot n mod depth is free.
A go-back-N resend changes nothing: a packet once accepted is never applied again,
and resent later packets continue the same chunk in the same slot. A responder that
looked for the WQE only at the LAST packet (as an RNIC may: a multi-packet WRITE with
immediate begins as a plain WRITE FIRST) would let the FIRST and MIDDLE bytes of chunk
n + depth overwrite slot n mod depth while chunk n still waits to be read.

So RC's RNR NAK is the flow control, as it was for SENDs: a chunk that finds no WQE
is NAKed and resent after the RNR timer, and no application credits are needed.
Slots are freed after every engine step, so with `recv_depth` covering what one step
can land this stays rare (counted: `rnr_naks_*`).

Framing: a message is split into chunks of at most `chunk_bytes - 16` data bytes;
each chunk is one WRITE with immediate of a 16-byte header (tag, per-(peer, tag)
message number, offset, total length; little-endian u32s) followed by its data, so a
chunk of `chunk_bytes` (an MTU multiple) fills whole packets and one ring slot. Chunks
go to the peer's QPs in turn (one counter per peer, across messages), so a large
message is pipelined over all QPs and small ones spread too. The receiver matches a
chunk to (peer, tag, message number): the n-th message sent to a peer with a tag is the
n-th one received with it, however its chunks interleave across QPs. A chunk of a
message nobody waits for yet is kept in a buffer of its own (copied once more on
`recv`).

Set-up (`connect`): each rank listens on its TCP set-up port; rank i connects to every
rank j > i and accepts one connection from each j < i. Over each connection the two
sides exchange one JSON line each (protocol version, rank, communicator size, QP count,
chunk size, MTU, and per QP its QPN, first PSN and landing ring: VA, R_Key, slots); the
side that accepted attaches its QPs before it answers, the side that connected attaches
them and then says so, so no data packet ever reaches a QP that is not there yet.
Connecting retries until the set-up deadline.
No rank waits for a lower one before answering a higher one, so there is no cycle.
The set-up connections then stay open, idle: a rank that leaves says why (`leave`),
and one that leaves other than by finishing ('done'), or dies (the connection closes),
fails its peers' `recv` / `wait_sends` with a TransportError within LINK_CHECK_S,
instead of leaving them waiting for data that will never come.

Everything is fabric time (`agents.timebase.FabricClock`); the engine's waits are
the only wall-clock conversion.
"""

from __future__ import annotations

import json
import math
import random
import select
import socket
import struct
import sys
import time
from argparse import Namespace
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from agents.rdma import options
from agents.rdma.qp import (
    WC_RECV_RDMA_WITH_IMM,
    Completion,
    MemoryRegion,
    QpAttrs,
    RcQp,
    WcStatus,
)
from agents.rdma.transport import Binding, Endpoint, Engine, Stopped
from agents.runtime.messages import MAX_MESSAGE_BYTES as MAX_SETUP_LINE_BYTES
from agents.runtime.messages import BadMessage, decode_message, int_field
from agents.runtime.sockets import dial_tcp
from agents.timebase import Dilation, FabricClock
from agents.wire.roce import PSN_MASK, icrc_context

__all__ = ["HEADER_BYTES", "MAX_QPS", "MAX_SLOTS", "PROTOCOL_VERSION", "Messages",
           "PeerAddress", "RoceConfig", "RoceTransport", "SetupError", "Stopped",
           "TransportError", "chunk_spans", "connect", "parse_peers", "recv_depth", "slot_imm"]

HEADER = struct.Struct("<IIII")      # tag, message number, offset, total length
HEADER_BYTES = HEADER.size
MAX_QPS = 8
MAX_TAG = 0xFFFFFFFF
MAX_MESSAGE_BYTES = 0xFFFFFFFF
#: 2: data as RDMA WRITE with immediate into landing rings (their VA / R_Key / slots in
#: the hello); 1 was SENDs into posted receive buffers.
PROTOCOL_VERSION = 2
#: Most bytes of landing ring per QP: a huge window must not pin gigabytes.
MAX_RECV_BYTES_PER_QP = 64 << 20
#: Most slots of a landing ring: the immediate carries the slot index in 16 bits.
MAX_SLOTS = 0xFFFF
#: Wall seconds between two looks at the set-up connections (has a peer left?).
LINK_CHECK_S = 0.1
#: Datagrams an engine step drains per endpoint (agents.rdma.transport.RECV_BATCH): the
#: most chunks that can land between two reaps, which free their slots.
_LANDING_PER_STEP = 64


class TransportError(Exception):
    """The transport cannot deliver: a QP failed, or a peer sent something malformed."""


class SetupError(Exception):
    """The ranks could not connect (timeout, refused, or mismatched settings)."""


class SetupRefused(SetupError):
    """An accepted set-up connection that is not a peer's well-formed hello; `reason` is
    its counter key in `setup_refused`. A dialled peer's is raised as a SetupError."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


# --------------------------------------------------------------------------- addresses


@dataclass(frozen=True)
class PeerAddress:
    """Where a rank is: its IP, its TCP set-up port and its UDP RoCE port."""

    ip: str
    tcp_port: int
    udp_port: int

    def __str__(self) -> str:
        return f"{self.ip}:{self.tcp_port}:{self.udp_port}"


def parse_peers(text: str) -> list[PeerAddress]:
    """`IP:TCPPORT:UDPPORT,...` (entry i is rank i) -> addresses; ValueError if malformed."""
    out = []
    for i, entry in enumerate(text.split(",")):
        parts = entry.strip().split(":")
        if len(parts) != 3:
            raise ValueError(f"peer {i} {entry!r}: want IP:TCPPORT:UDPPORT")
        ip, tcp, udp = parts
        try:
            socket.inet_aton(ip)
            tcp_port, udp_port = int(tcp), int(udp)
        except (OSError, ValueError):
            raise ValueError(f"peer {i} {entry!r}: want IPv4:TCPPORT:UDPPORT") from None
        if not (1 <= tcp_port <= 65535 and 1 <= udp_port <= 65535):
            raise ValueError(f"peer {i} {entry!r}: ports must be 1..65535")
        out.append(PeerAddress(ip, tcp_port, udp_port))
    if len(set(out)) != len(out):
        raise ValueError("two ranks have the same address and ports")
    return out


# --------------------------------------------------------------------------- framing


def chunk_spans(nbytes: int, chunk_data: int) -> list[tuple[int, int]]:
    """(offset, length) of each chunk of an `nbytes` message; a 0-byte message is one
    empty chunk (the receiver must still learn that it was sent)."""
    if chunk_data < 1:
        raise ValueError(f"chunk data size must be >= 1, got {chunk_data}")
    if nbytes == 0:
        return [(0, 0)]
    return [(off, min(chunk_data, nbytes - off)) for off in range(0, nbytes, chunk_data)]


def as_bytes(array: np.ndarray) -> np.ndarray:
    """A contiguous array's bytes as a flat uint8 view (any dtype, bfloat16 as uint16)."""
    if not array.flags.c_contiguous:
        raise ValueError("the transport moves contiguous buffers only")
    return array.reshape(-1).view(np.uint8)


class _Incoming:
    """One message being received: where its bytes go, and how many have come."""

    __slots__ = ("total", "buf", "got", "chunks", "bound")

    def __init__(self, total: int, buf: np.ndarray, bound: bool) -> None:
        self.total = total
        self.buf = buf          # the caller's buffer (bound) or one of our own (unexpected)
        self.got = 0
        self.chunks = 0
        self.bound = bound

    @property
    def complete(self) -> bool:
        return self.chunks > 0 and self.got == self.total


@dataclass
class PeerCounters:
    """What crossed between this rank and one peer, in message terms (payload only)."""

    messages_sent: int = 0
    chunks_posted: int = 0
    bytes_posted: int = 0          # payload handed to the QPs
    bytes_sent: int = 0            # payload of chunks the peer acknowledged
    chunks_sent: int = 0
    messages_received: int = 0
    chunks_received: int = 0
    bytes_received: int = 0        # payload that landed
    unexpected_chunks: int = 0     # landed before anyone waited for their message


class Messages:
    """Framing and matching for one rank: pure (no sockets, no QPs).

    `frame` turns a message into (QP index, chunk) pairs to post; `deliver` takes a
    chunk that landed; `expect` binds a receive buffer to the next message of a (peer,
    tag), `take` ends it. RoceTransport wires these to the QPs; the unit tests wire two
    of them back to back.
    """

    def __init__(self, rank: int, size: int, qps: int, chunk_bytes: int) -> None:
        if not 1 <= qps <= MAX_QPS:
            raise ValueError(f"qps must be 1..{MAX_QPS}, got {qps}")
        if chunk_bytes <= HEADER_BYTES:
            raise ValueError(f"chunk_bytes must exceed the {HEADER_BYTES}-byte header, "
                             f"got {chunk_bytes}")
        self.rank = rank
        self.size = size
        self.qps = qps
        self.chunk_bytes = chunk_bytes
        self.chunk_data = chunk_bytes - HEADER_BYTES
        self._send_seq: dict[tuple[int, int], int] = {}
        self._recv_seq: dict[tuple[int, int], int] = {}
        self._incoming: dict[tuple[int, int, int], _Incoming] = {}
        self._next_qp = [0] * size
        self.peers = [PeerCounters() for _ in range(size)]

    def _check_peer(self, peer: int) -> None:
        if not 0 <= peer < self.size or peer == self.rank:
            raise ValueError(f"rank {self.rank}: no peer {peer} in a communicator of "
                             f"{self.size}")

    def frame(self, peer: int, tag: int, data: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
        """(QP index, header + data chunk) for every chunk of `data`, to post in order.

        The chunks are copies: the caller's buffer may be reused as soon as this is done.
        """
        self._check_peer(peer)
        if not 0 <= tag <= MAX_TAG:
            raise ValueError(f"tag {tag} is not a u32")
        src = as_bytes(data)
        total = src.nbytes
        if total > MAX_MESSAGE_BYTES:
            raise ValueError(f"message of {total} bytes exceeds {MAX_MESSAGE_BYTES}")
        key = (peer, tag)
        mseq = self._send_seq.get(key, 0)
        self._send_seq[key] = (mseq + 1) & 0xFFFFFFFF
        pc = self.peers[peer]
        pc.messages_sent += 1
        for off, n in chunk_spans(total, self.chunk_data):
            chunk = np.empty(HEADER_BYTES + n, dtype=np.uint8)
            HEADER.pack_into(chunk.data, 0, tag, mseq, off, total)
            chunk[HEADER_BYTES:] = src[off:off + n]
            q = self._next_qp[peer]
            self._next_qp[peer] = (q + 1) % self.qps
            pc.chunks_posted += 1
            pc.bytes_posted += n
            yield q, chunk

    def sent(self, peer: int, chunk_len: int) -> None:
        """The peer acknowledged a chunk of `chunk_len` bytes (header included)."""
        pc = self.peers[peer]
        pc.chunks_sent += 1
        pc.bytes_sent += chunk_len - HEADER_BYTES

    def deliver(self, peer: int, chunk: np.ndarray) -> None:
        """A chunk (header + data, uint8) from `peer` landed: put its data in place."""
        if chunk.nbytes < HEADER_BYTES:
            raise TransportError(f"rank {self.rank}: a {chunk.nbytes}-byte chunk from rank "
                                 f"{peer} has no header")
        tag, mseq, off, total = HEADER.unpack_from(chunk.data, 0)
        n = chunk.nbytes - HEADER_BYTES
        key = (peer, tag, mseq)
        inc = self._incoming.get(key)
        pc = self.peers[peer]
        if inc is None:
            inc = _Incoming(total, np.empty(total, dtype=np.uint8), bound=False)
            self._incoming[key] = inc
        if not inc.bound:
            pc.unexpected_chunks += 1
        if total != inc.total or off + n > total:
            raise TransportError(
                f"rank {self.rank}: chunk [{off}, {off + n}) of a {total}-byte message "
                f"(tag {tag}, #{mseq}) from rank {peer}, where a {inc.total}-byte one "
                "was expected")
        inc.buf[off:off + n] = chunk[HEADER_BYTES:]
        inc.got += n
        inc.chunks += 1
        pc.chunks_received += 1
        pc.bytes_received += n
        if inc.got > inc.total:
            raise TransportError(f"rank {self.rank}: more bytes than sent of message "
                                 f"(tag {tag}, #{mseq}) from rank {peer}")

    def expect(self, peer: int, tag: int, out: np.ndarray) -> tuple[int, int, int]:
        """Bind `out` to the next message `peer` sends with `tag`; returns its key."""
        self._check_peer(peer)
        dst = as_bytes(out)
        if not dst.flags.writeable:
            raise ValueError("recv needs a writable buffer")
        k = (peer, tag)
        mseq = self._recv_seq.get(k, 0)
        self._recv_seq[k] = (mseq + 1) & 0xFFFFFFFF
        key = (peer, tag, mseq)
        inc = self._incoming.get(key)
        if inc is None:
            self._incoming[key] = _Incoming(dst.nbytes, dst, bound=True)
            return key
        if inc.total != dst.nbytes:
            raise TransportError(f"rank {self.rank}: recv of {dst.nbytes} bytes, but rank "
                                 f"{peer} sent {inc.total} with tag {tag}")
        # Some (or all) of it came first: what landed so far moves over, the rest
        # lands in place.
        dst[:] = inc.buf
        inc.buf = dst
        inc.bound = True
        return key

    def complete(self, key: tuple[int, int, int]) -> bool:
        return self._incoming[key].complete

    def take(self, key: tuple[int, int, int]) -> None:
        """The message is in the caller's buffer: forget it."""
        del self._incoming[key]
        self.peers[key[0]].messages_received += 1

    @property
    def pending(self) -> int:
        """Messages begun (bound or landed) and not yet taken."""
        return len(self._incoming)


# --------------------------------------------------------------------------- the transport


@dataclass(frozen=True)
class RoceConfig:
    """How a rank's transport is set up: the RoCE flags (`agents.rdma.options`) and ours."""

    args: Namespace                  # parsed with agents.rdma.options.add_arguments
    qps: int = 1
    chunk_bytes: int = 65536
    dilation: int = 1
    connect_timeout_s: float = 10.0

    def attrs(self) -> QpAttrs:
        return options.qp_attrs(self.args, self.args.mtu)


def recv_depth(attrs: QpAttrs, chunk_bytes: int) -> int:
    """Slots of a QP's landing ring (and receive WQEs posted for them), so that a chunk
    rarely meets an empty receive queue (RNR NAK). A QP's messages land in order, so at
    most one chunk is in progress on it; the others hold their slot from their last
    packet until the end of the engine step that received it, when they are taken and
    their WQEs re-posted. One step receives at most _LANDING_PER_STEP datagrams, so
    that many packets' worth of chunks, plus the one in progress, plus one of margin;
    at most MAX_RECV_BYTES_PER_QP of ring (and MAX_SLOTS slots)."""
    packets_per_chunk = math.ceil(chunk_bytes / attrs.mtu)
    step_chunks = math.ceil(_LANDING_PER_STEP / packets_per_chunk)
    want = max(4, step_chunks + 2)
    return max(2, min(want, MAX_RECV_BYTES_PER_QP // chunk_bytes, MAX_SLOTS))


def slot_imm(n: int, slots: int) -> int:
    """The immediate of the n-th chunk written on a QP to a ring of `slots`:
    (n mod 2^16) << 16 | its slot, n mod slots."""
    return (n & 0xFFFF) << 16 | n % slots


class _Qp:
    """One of our QPs: its binding, its peer and QP index, our landing ring (where the
    peer writes to us) and where we write in the peer's, with a chunk count each way."""

    __slots__ = ("binding", "qp", "peer", "index", "ring", "slots", "recv_n", "remote_va",
                 "remote_rkey", "remote_slots", "send_n")

    def __init__(self, binding: Binding, peer: int, index: int, ring: np.ndarray, slots: int,
                 remote_va: int, remote_rkey: int, remote_slots: int) -> None:
        self.binding = binding
        self.qp: RcQp = binding.qp
        self.peer = peer
        self.index = index
        self.ring = ring                # slots x chunk_bytes, registered with the responder
        self.slots = slots
        self.recv_n = 0                 # chunks received on this QP: the next is in slot
        #                                 recv_n mod slots
        self.remote_va = remote_va
        self.remote_rkey = remote_rkey
        self.remote_slots = remote_slots
        self.send_n = 0                 # chunks posted on this QP: the next goes to slot
        #                                 send_n mod remote_slots



class PeerLinks:
    """A rank's open set-up connections: who left, and why."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank = rank
        self.size = size
        self._links: dict[int, socket.socket] = {}
        self._said: dict[int, str] = {}            # peer -> the reason it gave for leaving
        #: accepted set-up connections refused, per reason (docs/collectives-roce.md)
        self.setup_refused: dict[str, int] = {}
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


class RoceTransport:
    """A rank's `Transport` over RC QPs: see the module docstring.

    Made by `connect` (which sets the QPs up with every peer); `send` posts and returns,
    `recv` and `wait_sends` drive the engine until their condition holds, raising
    `Stopped` once `should_stop()` is true and `TransportError` if a QP fails.
    """

    def __init__(self, rank: int, peers: list[PeerAddress], config: RoceConfig, *,
                 should_stop: Callable[[], bool] | None = None,
                 clock: FabricClock | None = None) -> None:
        if not 0 <= rank < len(peers):
            raise ValueError(f"rank {rank} is not in 0..{len(peers) - 1}")
        self._rank = rank
        #: accepted set-up connections refused, per reason (docs/collectives-roce.md)
        self.setup_refused: dict[str, int] = {}
        self.peers = peers
        self.config = config
        self.dilation = Dilation(config.dilation)
        self.clock = clock or FabricClock(self.dilation)
        self._should_stop = should_stop or (lambda: False)
        args = config.args
        self.attrs = config.attrs()
        self.cc = options.cc_settings(args)
        self.cc_params = options.cc_params(args, self.cc)
        self.messages = Messages(rank, len(peers), config.qps, config.chunk_bytes)
        self.recv_depth = recv_depth(self.attrs, config.chunk_bytes)
        me = peers[rank]
        self.endpoint = Endpoint(me.ip, me.udp_port, dscp=args.dscp, cnp_dscp=args.cnp_dscp,
                                 should_stop=self._should_stop,
                                 sndbuf_bytes=args.sndbuf_bytes or None)
        self.engine = Engine(self.clock, self.dilation, spin_ns=args.spin_ns)
        self.engine.add(self.endpoint)
        # our QPNs: a random base, so a stray packet of an earlier run is not taken for ours
        self._qpn_base = random.Random().randrange(0x100, 0xF00000 - len(peers) * MAX_QPS)
        self._qps: list[_Qp] = []
        self._by_peer: list[list[_Qp]] = [[] for _ in peers]
        # landing rings made for a peer's hello, until its QPs are attached
        self._rings: dict[int, list[np.ndarray]] = {}
        self._wr = 0
        # the set-up connections stay open: a peer that goes away is seen (see check_links)
        self.links = PeerLinks(rank, len(peers))

    # -- the Transport protocol

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return len(self.peers)

    def send(self, peer: int, tag: int, data: np.ndarray) -> None:
        qps = self._by_peer[peer] if 0 <= peer < self.size else []
        if not qps:
            raise ValueError(f"rank {self._rank}: not connected to rank {peer}")
        chunk_bytes = self.config.chunk_bytes
        for q, chunk in self.messages.frame(peer, tag, data):
            e = qps[q]
            n = e.send_n
            e.send_n = n + 1
            slot = n % e.remote_slots
            self._wr += 1
            e.qp.requester.post_write_imm(self._wr, chunk.data,
                                          e.remote_va + slot * chunk_bytes, e.remote_rkey,
                                          slot_imm(n, e.remote_slots))

    def recv(self, peer: int, tag: int, out: np.ndarray) -> None:
        if not 0 <= peer < self.size or not self._by_peer[peer]:
            raise ValueError(f"rank {self._rank}: not connected to rank {peer}")
        key = self.messages.expect(peer, tag, out)
        self.drive(lambda: self.messages.complete(key))
        self.messages.take(key)

    def wait_sends(self) -> None:
        self.drive(self.sends_done)

    # -- driving

    def sends_done(self) -> bool:
        return all(q.qp.requester.idle for q in self._qps)

    def drive(self, done: Callable[[], bool]) -> None:
        """Run the engine until `done()`; Stopped on a stop request, TransportError if a
        QP fails on the way."""
        engine = self.engine
        self.reap()
        while not done():
            if self._should_stop():
                raise Stopped()
            if self.links.due():
                self.links.check()
            busy = engine.step()
            if self.reap():
                continue
            if not busy:
                engine.wait()

    def reap(self) -> bool:
        """Take completions: landed chunks into place (and their slots' WQEs re-posted),
        acknowledged chunks counted. True if there were any."""
        msgs = self.messages
        chunk_bytes = self.config.chunk_bytes
        any_ = False
        for q in self._qps:
            rs = q.qp.responder
            rcomps = rs.completions
            while rcomps:
                any_ = True
                c = rcomps.popleft()
                n = q.recv_n
                slot = n % q.slots
                if (c.imm != slot_imm(n, q.slots) or c.opcode != WC_RECV_RDMA_WITH_IMM
                        or c.status != WcStatus.SUCCESS or c.byte_len > chunk_bytes):
                    raise TransportError(self._landing_error(q, c, n, slot))
                off = slot * chunk_bytes
                msgs.deliver(q.peer, q.ring[off:off + c.byte_len])
                # the chunk is copied out: its slot is free for chunk n + slots
                q.recv_n = n + 1
                rs.post_recv(slot)
            rq = q.qp.requester
            scomps = rq.completions
            while scomps:
                any_ = True
                c = scomps.popleft()
                if c.status != WcStatus.SUCCESS:
                    raise TransportError(f"rank {self._rank}: QP {q.qp.qpn:#x} to rank "
                                         f"{q.peer}: send {c.status}")
                msgs.sent(q.peer, c.byte_len)
            if rs.error is not None or rq.error is not None:
                raise TransportError(f"rank {self._rank}: QP {q.qp.qpn:#x} to rank {q.peer} "
                                     f"failed: {rs.error or rq.error}")
        return any_

    def _landing_error(self, q: _Qp, c: Completion, n: int, slot: int) -> str:
        want = slot_imm(n, q.slots)
        imm = f"{c.imm:#010x}" if c.imm is not None else "none"
        return (f"rank {self._rank}: QP {q.qp.qpn:#x} from rank {q.peer}: completion "
                f"#{n} is {c.opcode} {c.status}, {c.byte_len} bytes, immediate {imm}; "
                f"expected a WRITE with immediate {want:#010x} (chunk {n & 0xFFFF}, slot "
                f"{slot} of {q.slots}) of at most {self.config.chunk_bytes} bytes")

    # -- set-up

    def local_qps(self, peer: int) -> list[dict]:
        """What `peer` must know of our QPs to it: QPN, first PSN and the landing ring
        (VA, R_Key, slots) of each. Makes the rings, which `attach` registers."""
        rng = random.Random()
        rings = [np.empty(self.recv_depth * self.config.chunk_bytes, dtype=np.uint8)
                 for _ in range(self.config.qps)]
        self._rings[peer] = rings
        return [{"qpn": self._qpn_base + peer * MAX_QPS + i,
                 "psn": rng.randrange(0, PSN_MASK + 1),
                 "va": ring.ctypes.data, "rkey": rng.randrange(1, 1 << 32),
                 "slots": self.recv_depth} for i, ring in enumerate(rings)]

    def attach(self, peer: int, local: list[dict], remote: list[dict]) -> None:
        """Make and attach our QPs to `peer` (from both sides' QP lists), with their
        landing rings registered and a receive WQE posted per slot, before the peer may
        send."""
        if self._by_peer[peer]:
            raise SetupError(f"rank {self._rank}: rank {peer} connected twice")
        if len(remote) != len(local):
            raise SetupError(f"rank {peer} has {len(remote)} QPs to us, we {len(local)}")
        rings = self._rings.pop(peer, None)
        if rings is None or len(rings) != len(local):
            raise SetupError(f"rank {self._rank}: no landing rings made for rank {peer}")
        theirs = [_remote_qp(q, peer, i, self.config.chunk_bytes) for i, q in enumerate(remote)]
        me, them = self.peers[self._rank], self.peers[peer]
        args = self.config.args
        for i, (mine, (qpn, psn, va, rkey, slots), ring) in enumerate(
                zip(local, theirs, rings, strict=True)):
            mr = MemoryRegion(ring.data, mine["va"], mine["rkey"], writes_need_recv=True)
            ctx = icrc_context(me.ip, them.ip, self.endpoint.port, them.udp_port)
            qp = RcQp(mine["qpn"], qpn, ctx, self.attrs,
                      options.make_rate_controller(args, self.cc, self.clock.now_ns()),
                      np=options.make_np(args, self.cc[0], self.cc_params),
                      mrs={mr.rkey: mr}, clock=self.clock, sq_psn=mine["psn"], rq_psn=psn)
            for slot in range(mine["slots"]):
                qp.responder.post_recv(slot)        # zero-length: the data goes to the ring
            binding = self.endpoint.attach(qp, (them.ip, them.udp_port))
            entry = _Qp(binding, peer, i, ring, mine["slots"], va, rkey, slots)
            self._qps.append(entry)
            self._by_peer[peer].append(entry)
        self.engine.refresh()

    def add_link(self, peer: int, sock: socket.socket) -> None:
        """Keep `peer`'s set-up connection: it says when the peer leaves."""
        self.links.add(peer, sock)

    def check_links(self) -> None:
        """Raise TransportError if a peer went away other than by finishing ('done');
        checked at most every LINK_CHECK_S of wall time while the engine runs."""
        self.links.check()

    def leave(self, reason: str) -> None:
        """Tell every peer why we go ('done' is the only reason that is no error to them);
        said once: a later call (the worker's last word) is a no-op."""
        self.links.leave(reason)

    def peers_done(self) -> bool:
        """Every peer has said 'done': its sends, ours to it included, are acknowledged."""
        return self.links.peers_done()

    def close(self) -> None:
        self.links.close()
        self.endpoint.close()

    # -- counters

    def counters(self) -> dict:
        """Per peer and summed: payload bytes, messages, packets, retransmissions,
        timeouts, NAKs, CNPs, ECN marks; and the endpoint's own counters."""
        per_peer = {}
        for peer in range(self.size):
            if peer != self._rank:
                per_peer[str(peer)] = self._peer_counters(peer)
        totals: dict[str, int] = {}
        for c in per_peer.values():
            for k, v in c.items():
                if isinstance(v, int):
                    totals[k] = totals.get(k, 0) + v
        args = self.config.args
        return {**totals, "per_peer": per_peer, "endpoint": self.endpoint.counters(),
                "fast_path": dict(self.endpoint.fast_path),   # agents.fast: which path ran
                "setup_refused": dict(self.setup_refused),
                "setup_refused_total": sum(self.setup_refused.values()),
                "qps_per_peer": self.config.qps, "chunk_bytes": self.config.chunk_bytes,
                "recv_depth": self.recv_depth, "engine": {"steps": self.engine.steps,
                                                          "waits": self.engine.waits},
                "settings": {**options.cc_record(args, self.cc, self.cc_params),
                             "line_rate_bps": args.line_rate_bps, "dscp": args.dscp,
                             "cnp_dscp": args.cnp_dscp, "dilation": self.dilation.factor,
                             "qp_attrs": self.attrs.to_dict()}}

    def _peer_counters(self, peer: int) -> dict:
        pc = self.messages.peers[peer]
        out: dict = {
            "bytes_sent": pc.bytes_sent, "bytes_posted": pc.bytes_posted,
            "bytes_received": pc.bytes_received, "messages_sent": pc.messages_sent,
            "messages_received": pc.messages_received, "chunks_sent": pc.chunks_sent,
            "chunks_posted": pc.chunks_posted, "chunks_received": pc.chunks_received,
            "unexpected_chunks": pc.unexpected_chunks,
        }
        sums = {"packets_sent": ("requester", "packets_sent"),
                "wire_bytes_sent": ("requester", "wire_bytes_sent"),
                "retransmissions": ("requester", "retransmissions"),
                "timeouts": ("requester", "timeouts"),
                "naks_received": ("requester", "naks_received"),
                "rnr_naks_received": ("requester", "rnr_naks_received"),
                "cnps_received": ("requester", "cnps_received"),
                "packets_received": ("responder", "packets_received"),
                "duplicates": ("responder", "duplicates"),
                "ooo_drops": ("responder", "ooo_drops"),
                "naks_sent": ("responder", "naks_sent"),
                "rnr_naks_sent": ("responder", "rnr_naks_sent"),
                "ce_packets_received": ("responder", "ce_packets_received"),
                "cnps_sent": ("responder", "cnps_sent")}
        qps = [q.binding.counters() for q in self._by_peer[peer]]
        for name, (side, key) in sums.items():
            out[name] = sum(c[side][key] for c in qps)
        out["qps"] = {str(c["qpn"]): c for c in qps}
        return out


# --------------------------------------------------------------------------- set-up


def _remote_qp(theirs: object, peer: int, i: int, chunk_bytes: int
               ) -> tuple[int, int, int, int, int]:
    """(QPN, first PSN, ring VA, R_Key, slots) of the peer's QP i, from its hello."""
    fields = ("qpn", "psn", "va", "rkey", "slots")
    values = [theirs.get(k) for k in fields] if isinstance(theirs, dict) else []
    ints = [v for v in values if type(v) is int]
    if len(ints) != len(fields):
        raise SetupError(f"rank {peer}: QP {i} of its hello is not "
                         f"{{qpn, psn, va, rkey, slots}} integers: {theirs!r}")
    qpn, psn, va, rkey, slots = ints
    if not (1 <= slots <= MAX_SLOTS and 0 <= rkey <= 0xFFFFFFFF and 0 <= psn <= PSN_MASK
            and 0 <= va and va + slots * chunk_bytes <= 1 << 64):
        raise SetupError(f"rank {peer}: QP {i} has a landing ring we cannot write: "
                         f"{theirs!r}")
    return qpn, psn, va, rkey, slots


class _Line:
    """JSON lines over a set-up connection, read against a deadline."""

    def __init__(self, sock: socket.socket, what: str) -> None:
        self.sock = sock
        self.what = what
        self._buf = b""

    def send(self, obj: dict) -> None:
        self.sock.sendall(json.dumps(obj, separators=(",", ":")).encode() + b"\n")

    def recv(self, deadline: float, should_stop: Callable[[], bool]) -> dict:
        while b"\n" not in self._buf:
            if should_stop():
                raise Stopped()
            left = deadline - time.monotonic()
            if left <= 0:
                raise SetupError(f"no answer from {self.what} in time")
            ready, _, _ = select.select([self.sock], [], [], min(left, 0.05))
            if not ready:
                continue
            try:
                data = self.sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                raise SetupRefused("closed", f"{self.what} closed the set-up connection")
            self._buf += data
            if b"\n" not in self._buf and len(self._buf) > MAX_SETUP_LINE_BYTES:
                raise SetupRefused("too_large", f"a set-up line from {self.what} over "
                                   f"{MAX_SETUP_LINE_BYTES} bytes")
        line, _, self._buf = self._buf.partition(b"\n")
        try:
            return decode_message(line)
        except BadMessage as e:
            raise SetupRefused(e.reason, f"bad set-up message from {self.what}: {e}") from None


def _hello(t: RoceTransport, peer: int) -> dict:
    return {"version": PROTOCOL_VERSION, "rank": t.rank, "size": t.size,
            "qps": t.config.qps, "chunk_bytes": t.config.chunk_bytes, "mtu": t.attrs.mtu,
            "qp": t.local_qps(peer)}


def _check_hello(t: RoceTransport, msg: dict, peer: int | None) -> int:
    """The peer's rank, if its hello matches our communicator and settings."""
    mine = {"version": PROTOCOL_VERSION, "size": t.size, "qps": t.config.qps,
            "chunk_bytes": t.config.chunk_bytes, "mtu": t.attrs.mtu}
    bad = {k: msg.get(k) for k, v in mine.items() if msg.get(k) != v}
    if bad:
        raise SetupError(f"rank {msg.get('rank')} differs from rank {t.rank}: {bad} "
                         f"(ours: { {k: mine[k] for k in bad} })")
    rank = msg.get("rank")
    if not isinstance(rank, int) or (peer is not None and rank != peer) or not (
            0 <= rank < t.size) or rank == t.rank:
        raise SetupError(f"rank {t.rank}: a set-up hello from rank {rank!r}, expected "
                         f"{peer if peer is not None else 'a lower rank'}")
    return rank


def _dial(addr: PeerAddress, local_ip: str, deadline: float,
          should_stop: Callable[[], bool]) -> socket.socket:
    """Connect to a rank's set-up port, retrying (it may not listen yet) until `deadline`."""
    try:
        s = dial_tcp((addr.ip, addr.tcp_port), local_ip, deadline, should_stop, attempt_s=1.0)
    except TimeoutError as e:
        raise SetupError(f"cannot connect to {addr.ip}:{addr.tcp_port}: {e}") from None
    if s is None:
        raise Stopped()
    return s


def _accept(lsock: socket.socket, deadline: float,
            should_stop: Callable[[], bool]) -> socket.socket:
    while True:
        if should_stop():
            raise Stopped()
        left = deadline - time.monotonic()
        if left <= 0:
            raise SetupError("not every lower rank connected in time")
        ready, _, _ = select.select([lsock], [], [], min(left, 0.05))
        if ready:
            conn, _ = lsock.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return conn


def listen(addr: PeerAddress) -> socket.socket:
    """The set-up listener on this rank's IP and TCP port."""
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lsock.bind((addr.ip, addr.tcp_port))
        lsock.listen(64)
    except BaseException:
        lsock.close()
        raise
    return lsock


def connect(rank: int, peers: list[PeerAddress], config: RoceConfig, *,
            should_stop: Callable[[], bool] | None = None,
            on_listening: Callable[[], None] | None = None) -> RoceTransport:
    """Set up rank `rank`'s QPs with every other rank and return its transport.

    Binds the UDP endpoint and the TCP listener first, then calls `on_listening()` (the
    ready file); then connects to the higher ranks and accepts the lower ones, each
    within `config.connect_timeout_s` of the start. The listener is closed afterwards.
    """
    stop = should_stop or (lambda: False)
    t = RoceTransport(rank, peers, config, should_stop=stop)
    lsock: socket.socket | None = None
    try:
        lsock = listen(peers[rank])
        if on_listening is not None:
            on_listening()
        deadline = time.monotonic() + config.connect_timeout_s
        for peer in range(rank + 1, len(peers)):
            _setup_dialled(t, peer, deadline, stop)
        for _ in range(rank):
            _setup_accepted(t, lsock, deadline, stop)
    except BaseException:
        t.close()
        raise
    finally:
        if lsock is not None:
            lsock.close()
    return t


def _setup_dialled(t: RoceTransport, peer: int, deadline: float,
                   stop: Callable[[], bool]) -> None:
    """We connect to a higher rank: hello, its hello, attach, then tell it we did."""
    sock = _dial(t.peers[peer], t.peers[t.rank].ip, deadline, stop)
    try:
        line = _Line(sock, f"rank {peer}")
        hello = _hello(t, peer)
        line.send(hello)
        try:
            reply = line.recv(deadline, stop)
        except SetupRefused as e:
            raise SetupError(str(e)) from None
        if reply.get("error"):
            raise SetupError(f"rank {peer} refused: {reply['error']}")
        _check_hello(t, reply, peer)
        t.attach(peer, hello["qp"], list(reply["qp"]))
        line.send({"attached": True})
        t.add_link(peer, sock)
    except BaseException:
        sock.close()
        raise


_HELLO_INTS = ("version", "rank", "size", "qps", "chunk_bytes", "mtu")


def _hello_shape(msg: dict, peers: list[PeerAddress], source_ip: str,
                 int_keys: tuple[str, ...] = _HELLO_INTS, qp_list: bool = True) -> None:
    """SetupRefused unless `msg` is shaped as a hello from the rank it names, sent from
    that rank's own address (a run's peers are its --peers list)."""
    try:
        for key in int_keys:
            int_field(msg, key)
        rank = int_field(msg, "rank", 0, len(peers) - 1)
    except BadMessage as e:
        raise SetupRefused(e.reason, str(e)) from None
    if qp_list and not isinstance(msg.get("qp"), list):
        raise SetupRefused("wrong_type", "hello.qp is not a list")
    if source_ip != peers[rank].ip:
        raise SetupRefused("peer", f"a hello naming rank {rank} from {source_ip}, not from "
                           f"rank {rank}'s address {peers[rank].ip}")


def _refuse(rank: int, refused: dict[str, int], sock: socket.socket, e: SetupRefused,
            source: str) -> None:
    refused[e.reason] = refused.get(e.reason, 0) + 1
    print(f"rank {rank}: refused set-up from {source} ({e.reason}): {e}", file=sys.stderr,
          flush=True)
    try:
        sock.sendall(json.dumps({"error": str(e)}).encode() + b"\n")
    except OSError:
        pass
    sock.close()


def _take_hello(rank: int, peers: list[PeerAddress], refused: dict[str, int],
                lsock: socket.socket, deadline: float, stop: Callable[[], bool],
                int_keys: tuple[str, ...] = _HELLO_INTS, qp_list: bool = True
                ) -> tuple[socket.socket, _Line, dict]:
    """The next accepted connection whose first line is a well-formed hello from the
    address of the rank it names; others are refused, counted in `refused` and closed."""
    while True:
        try:
            sock = _accept(lsock, deadline, stop)
        except SetupError as e:
            if refused:
                raise SetupError(f"{e} (refused set-up connections: {refused})") from None
            raise
        try:
            source = sock.getpeername()[0]
        except OSError:
            sock.close()
            continue
        line = _Line(sock, f"a lower rank ({source})")
        try:
            msg = line.recv(deadline, stop)
            _hello_shape(msg, peers, source, int_keys, qp_list)
        except SetupRefused as e:
            _refuse(rank, refused, sock, e, source)
            continue
        except BaseException:
            sock.close()
            raise
        return sock, line, msg


def _setup_accepted(t: RoceTransport, lsock: socket.socket, deadline: float,
                    stop: Callable[[], bool]) -> None:
    """A lower rank connected: its hello, attach, our hello, wait for its 'attached'."""
    sock, line, msg = _take_hello(t.rank, t.peers, t.setup_refused, lsock, deadline, stop)
    try:
        try:
            peer = _check_hello(t, msg, None)
            if peer > t.rank:
                raise SetupError(f"rank {peer} connected to rank {t.rank}; higher ranks "
                                 "are connected to, not accepted")
        except SetupError as e:
            line.send({"error": str(e)})
            raise
        line.what = f"rank {peer}"
        hello = _hello(t, peer)
        t.attach(peer, hello["qp"], list(msg["qp"]))
        line.send(hello)
        try:
            ack = line.recv(deadline, stop)
        except SetupRefused as e:
            raise SetupError(str(e)) from None
        if not ack.get("attached"):
            raise SetupError(f"rank {peer} did not attach its QPs: {ack}")
        t.add_link(peer, sock)
    except BaseException:
        sock.close()
        raise
