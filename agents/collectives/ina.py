"""The worker side of the in-network all-reduce: quantise, stream through a pool of
slots, retransmit, dequantise (SwitchML style; the aggregator is `python -m
agents.aggregator`, the packets `agents.wire.ina`).

`InaWorker` is the pure state machine (no sockets; the caller passes fabric-ns times);
`allreduce_ina` is the thin UDP loop around it, which the collective worker calls for
`--algorithm ina --aggregator IP:PORT --job-id J --worker-id W`.

Chunks and slots. The buffer is cut into K data chunks of `slot_elements` elements (the
last may be shorter). Protocol chunk numbers count up for the job's lifetime (u32):
this call uses `chunk_base + j`, which aggregates in slot (chunk % slots) and shadow
copy ((chunk // slots) & 1). Chunk j + slots is sent only once the result of chunk j
is in, so at most `slots` chunks are in flight and a slot is reused only when every
worker holds the result it kept (the aggregator's shadow-copy rule, agents/aggregator).
A chunk without its result `timeout_ns` (fabric time) after it was sent is sent again,
the same bytes; the aggregator answers a retransmission of a completed chunk from the
kept copy, and ignores a duplicate of one still summing.

The shared exponent (float data). All workers must quantise chunk d with the same
scale, and it must be known before chunk d is sent. Each worker proposes E_i, the
exponent of its own max |x| over chunk d (math.frexp: 2^(E_i - 1) <= max|x| < 2^E_i;
EXP_NONE for an all-zero chunk); the aggregator sums with an int ALU but takes the
max of the proposals (`next_exp`), so every worker learns E = max_i E_i. The
proposal for data chunk d rides on protocol chunk j = d, whose result arrives just
before the slot is reused, by protocol chunk j + slots, which carries data chunk d.
So the first `slots` protocol chunks carry no data, only proposals (one extra round
trip per call), and protocol chunk j >= slots carries data chunk j - slots and the
proposal for data chunk j. This is SwitchML's idea of agreeing the scale per block
by piggybacking it on the aggregation itself, with the agreement made exact: every
worker's max is known, rather than a conservative exponent from the dtype's range
(which would waste all but a few bits of float32 on typical gradients).

Quantisation and its bound. With n workers and c = n.bit_length() (so n < 2^c),
chunk d uses the scale exponent e = E + c - 31 and q = rint(x * 2^-e) (round half to
even). Since |x| < 2^E, |x * 2^-e| < 2^(31-c), so |q| <= 2^(31-c) (an integer bound),
and any partial sum of n such values is below n * 2^(31-c) < 2^31: the int32 sum
never wraps, whatever the tree. Each q is within 1/2 of x * 2^-e, so per element

    |sum_i q_i * 2^e - sum_i x_i| <= n * 2^(e-1) = n * 2^(E + c - 32) < n^2 * 2^(E - 31)

before the result is rounded to the output dtype (float64 holds sum q * 2^e exactly),
which adds at most u * |result| (u = 2^-11 float16, 2^-24 float32, 2^-53 float64)
plus half the dtype's smallest subnormal. `quantisation_bound` is this bound.
int32 data is sent as is (exponent 0, no proposals, no extra round trip): the result
is the exact sum modulo 2^32, the same bits numpy's int32 addition gives.
Non-finite floats cannot be quantised and are refused before anything is sent.
"""

from __future__ import annotations

import math
import socket
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from agents.runtime.lifecycle import PARENT_CHECK_NS, Lifecycle
from agents.runtime.sockets import (
    SendErrors,
    set_recv_buffer,
    set_recv_timeout,
    set_send_timeout,
    tos_byte,
)
from agents.timebase import Dilation, FabricClock
from agents.wire import BytesLike
from agents.wire.ina import (
    AGGREGATOR,
    EXP_NONE,
    MAX_ELEMENTS,
    Header,
    MalformedPacket,
    MalformedReason,
    PacketType,
    build,
    gen_of,
    parse,
    slot_of,
)

Addr = tuple[str, int]

#: Float dtypes the worker quantises, with u, their unit roundoff (2^-(mantissa bits+1)).
FLOAT_ROUNDOFF = {np.dtype(np.float16): 2.0 ** -11, np.dtype(np.float32): 2.0 ** -24,
                  np.dtype(np.float64): 2.0 ** -53}
INT32 = np.dtype(np.int32)
#: Default retransmission timeout (fabric ns): well above a window's serialisation at
#: 100 Gb/s (64 slots x 4 KiB ~ 21 us) plus the stalls of Python agents on a busy
#: machine (tens of wall ms, i.e. tens of fabric us at D = 1000).
DEFAULT_TIMEOUT_NS = 1_000_000
DEFAULT_MAX_RETRIES = 100
#: DSCP of the lossless RoCE data class, as RoCE data (the aggregator's default too).
DEFAULT_DSCP = 26


class InaError(RuntimeError):
    """The all-reduce cannot finish: a chunk went unanswered, or the caller stopped it."""


@dataclass(frozen=True)
class InaJob:
    """What every worker of a job agrees on (the aggregator's job config, seen from a
    worker): `workers` is n, every worker contributing to the sum, across a tree."""

    job_id: int
    workers: int
    slots: int
    slot_elements: int

    def __post_init__(self) -> None:
        if not 0 <= self.job_id <= 0xFFFFFFFF:
            raise ValueError(f"job id {self.job_id} is not a u32")
        if not 1 <= self.workers <= 1 << 16:
            raise ValueError(f"workers {self.workers} is not 1..65536")
        if not 1 <= self.slots <= 1 << 16:
            raise ValueError(f"slots {self.slots} is not 1..65536")
        if not 1 <= self.slot_elements <= MAX_ELEMENTS:
            raise ValueError(f"slot_elements {self.slot_elements} is not 1..{MAX_ELEMENTS}")


# --------------------------------------------------------------------------- quantisation


def exponent_proposal(x: np.ndarray) -> int:
    """E with 2^(E-1) <= max|x| < 2^E (math.frexp's exponent), EXP_NONE for all zero."""
    if x.size == 0:
        return EXP_NONE
    m = float(np.max(np.abs(x)))
    return EXP_NONE if m == 0.0 else math.frexp(m)[1]


def scale_exponent(agreed: int, workers: int) -> int:
    """The exponent e a chunk is quantised with: q = rint(x * 2^-e)."""
    return 0 if agreed == EXP_NONE else agreed + workers.bit_length() - 31


def quantise(x: np.ndarray, e: int) -> np.ndarray:
    """int32 q = rint(x * 2^-e); |q| <= 2^(31-c) when e = scale_exponent(E, n)."""
    return np.rint(np.ldexp(x.astype(np.float64), -e)).astype(np.int32)


def dequantise(q: np.ndarray, e: int, dtype: np.dtype) -> np.ndarray:
    """sum q * 2^e (exact in float64), rounded once to `dtype`."""
    return np.ldexp(q.astype(np.float64), e).astype(dtype)


def quantisation_bound(agreed: int, workers: int) -> float:
    """Largest |sum q_i 2^e - sum x_i| per element of a chunk with agreed exponent E
    (before rounding to the output dtype): n * 2^(E + c - 32)."""
    if agreed == EXP_NONE:
        return 0.0
    return workers * math.ldexp(1.0, scale_exponent(agreed, workers) - 1)


def result_bound(agreed: int, workers: int, result: np.ndarray) -> np.ndarray:
    """Per element, the largest |result - exact sum| of a float chunk: the quantisation
    bound plus the output dtype's rounding (u |result| + half its smallest subnormal)."""
    u = FLOAT_ROUNDOFF[result.dtype]
    tiny = float(np.finfo(result.dtype).smallest_subnormal) / 2
    q = quantisation_bound(agreed, workers)
    return q + u * (np.abs(result.astype(np.float64)) + q) + tiny


# --------------------------------------------------------------------------- state machine


@dataclass
class WorkerCounters:
    """What one all-reduce cost; bytes are UDP payload bytes."""

    chunks: int = 0                 # protocol chunks of this call (data + exponent-only)
    data_chunks: int = 0
    packets_sent: int = 0
    bytes_sent: int = 0
    packets_received: int = 0
    bytes_received: int = 0
    retransmissions: int = 0        # chunks sent again
    timeouts: int = 0               # polls at which at least one chunk's timer had expired
    results: int = 0                # results taken (one per chunk)
    duplicate_results: int = 0      # results for a chunk already done (answers to a retry)
    stale_results: int = 0          # results for no chunk of this call (an older call's)
    foreign: int = 0                # not a RESULT of this job from the aggregator
    bad_results: int = 0            # a result whose length or exponent is not the chunk's
    malformed: dict[str, int] = field(default_factory=lambda: {r.name: 0
                                                               for r in MalformedReason})
    max_error_bound: float = 0.0    # largest quantisation_bound over the data chunks
    elapsed_fabric_ns: float = 0.0
    next_chunk_base: int = 0        # chunk_base for this job's next all-reduce

    def as_dict(self) -> dict:
        return {k: (dict(v) if isinstance(v, dict) else v) for k, v in self.__dict__.items()}


class _InFlight:
    __slots__ = ("data", "elements", "exponent", "sent_ns", "tries")

    def __init__(self, data: bytes, sent_ns: float, elements: int, exponent: int) -> None:
        self.data, self.sent_ns, self.tries = data, sent_ns, 0
        self.elements, self.exponent = elements, exponent


class InaWorker:
    """One worker's in-network all-reduce of `sendbuf` into `recvbuf` (1-D, same dtype
    and length; they may be the same array). Times are fabric ns; drive it with
    `poll(now)` (what to send now) and `on_datagram(data, src, now)`; `done` when
    every chunk's result is in."""

    def __init__(self, job: InaJob, worker_id: int, sendbuf: np.ndarray, recvbuf: np.ndarray,
                 *, aggregator: Addr | None = None, timeout_ns: float = DEFAULT_TIMEOUT_NS,
                 chunk_base: int = 0, max_retries: int = DEFAULT_MAX_RETRIES) -> None:
        dtype = sendbuf.dtype
        if dtype != recvbuf.dtype or sendbuf.shape != recvbuf.shape or sendbuf.ndim != 1:
            raise ValueError("sendbuf and recvbuf must be 1-D arrays of one dtype and length")
        if not recvbuf.flags.writeable:
            raise ValueError("recvbuf is read-only")
        if dtype != INT32 and dtype not in FLOAT_ROUNDOFF:
            raise ValueError(f"in-network all-reduce sums float16/32/64 or int32, not {dtype}")
        if not 0 <= worker_id < AGGREGATOR:
            raise ValueError(f"worker id {worker_id} is not 0..{AGGREGATOR - 1}")
        self.floats = dtype != INT32
        if self.floats and not np.all(np.isfinite(sendbuf)):
            raise ValueError("sendbuf holds NaN or infinity: it cannot be quantised")
        self.job, self.worker_id, self.aggregator = job, worker_id, aggregator
        self.send, self.recv = sendbuf, recvbuf
        self.timeout_ns, self.max_retries = timeout_ns, max_retries
        self.base = chunk_base
        E = job.slot_elements
        self.K = -(-sendbuf.size // E)                  # data chunks
        S = job.slots
        self.shift = S if self.floats else 0            # protocol chunk of data chunk 0
        # protocol chunks in send order: exponent-only ones, then data ones
        self.order = [j for j in range(min(S, self.K))] if self.floats else []
        self.order += [self.shift + d for d in range(self.K)]
        if chunk_base + (self.order[-1] if self.order else 0) > 0xFFFFFFFF:
            raise ValueError("the job's chunk numbers are exhausted (u32)")
        self.proposals = ([exponent_proposal(sendbuf[d * E:(d + 1) * E]) for d in range(self.K)]
                          if self.floats else [])
        self.agreed: list[int | None] = [None] * self.K
        self.results_in: set[int] = set()
        # protocol chunk -> what was sent, ordered by (re)send time: the first one is the
        # first to time out
        self.outstanding: OrderedDict[int, _InFlight] = OrderedDict()
        self.next_index = 0                             # into self.order
        self.c = WorkerCounters(chunks=len(self.order), data_chunks=self.K)
        self.c.next_chunk_base = chunk_base + (self.order[-1] + 1 if self.order else 0)

    @property
    def done(self) -> bool:
        return len(self.results_in) == len(self.order)

    def _elements(self, j: int) -> int:
        """Elements protocol chunk j carries."""
        d = j - self.shift
        if d < 0:
            return 0
        E = self.job.slot_elements
        return min(E, self.send.size - d * E)

    def _in_flight(self, j: int, now_ns: float) -> _InFlight:
        """Protocol chunk j's REQUEST, built once: a retransmission sends the same bytes."""
        S, E = self.job.slots, self.job.slot_elements
        chunk = self.base + j
        d = j - self.shift
        values: np.ndarray | bytes = b""
        exponent = 0
        if d >= 0:
            x = self.send[d * E:(d + 1) * E]
            if self.floats:
                agreed = self.agreed[d]
                assert agreed is not None           # its result came before this chunk
                exponent = scale_exponent(agreed, self.job.workers)
                values = quantise(x, exponent)
                self.c.max_error_bound = max(self.c.max_error_bound,
                                             quantisation_bound(agreed, self.job.workers))
            else:
                values = x
        next_exp = self.proposals[j] if self.floats and j < self.K else EXP_NONE
        data = build(Header(PacketType.REQUEST, self.job.job_id, chunk, slot_of(chunk, S),
                            gen_of(chunk, S), self.worker_id, exponent, next_exp), values)
        return _InFlight(data, now_ns, self._elements(j), exponent)

    def _sendable(self, j: int) -> bool:
        return j < self.job.slots or (j - self.job.slots) in self.results_in

    def _emit(self, out: list[bytes], data: bytes) -> None:
        out.append(data)
        self.c.packets_sent += 1
        self.c.bytes_sent += len(data)

    def poll(self, now_ns: float) -> list[bytes]:
        """Datagrams to send to the aggregator now: chunks whose timer expired, then new
        chunks the window allows. Raises InaError when a chunk ran out of retries."""
        out: list[bytes] = []
        expired = False
        while self.outstanding:
            j, f = next(iter(self.outstanding.items()))
            # the same sum as next_deadline_ns: a caller woken at the deadline sees it expired
            if now_ns < f.sent_ns + self.timeout_ns:
                break                            # ordered by send time: none later expired
            if f.tries >= self.max_retries:
                raise InaError(f"job {self.job.job_id}: chunk {self.base + j} unanswered "
                               f"after {f.tries} retransmissions")
            expired = True
            self.outstanding.move_to_end(j)
            f.sent_ns = now_ns
            f.tries += 1
            self.c.retransmissions += 1
            self._emit(out, f.data)
        if expired:
            self.c.timeouts += 1
        while self.next_index < len(self.order) and self._sendable(self.order[self.next_index]):
            j = self.order[self.next_index]
            f = self._in_flight(j, now_ns)
            self.outstanding[j] = f
            self.next_index += 1
            self._emit(out, f.data)
        return out

    def next_deadline_ns(self) -> float | None:
        """When the oldest outstanding chunk times out (fabric ns), None if none is."""
        if not self.outstanding:
            return None
        return next(iter(self.outstanding.values())).sent_ns + self.timeout_ns

    def on_datagram(self, data: BytesLike, src: Addr | None = None) -> bool:
        """Take one datagram; True if it completed a chunk. Never raises for a packet."""
        self.c.packets_received += 1
        self.c.bytes_received += len(data)
        try:
            pkt = parse(data)
        except MalformedPacket as e:
            self.c.malformed[e.reason.name] += 1
            return False
        h = pkt.header
        if (h.type != PacketType.RESULT or h.job != self.job.job_id
                or (self.aggregator is not None and src != self.aggregator)):
            self.c.foreign += 1
            return False
        j = h.chunk - self.base
        f = self.outstanding.get(j)
        if f is None:
            if j in self.results_in:
                self.c.duplicate_results += 1
            else:
                self.c.stale_results += 1
            return False
        if h.elements != f.elements or h.exponent != f.exponent:
            self.c.bad_results += 1
            return False
        d = j - self.shift
        if d >= 0:
            E = self.job.slot_elements
            dst = self.recv[d * E:d * E + h.elements]
            if self.floats:
                dst[:] = dequantise(pkt.values, h.exponent, self.recv.dtype)
            else:
                dst[:] = pkt.values
        if self.floats and j < self.K:
            self.agreed[j] = h.next_exp
        del self.outstanding[j]
        self.results_in.add(j)
        self.c.results += 1
        return True


# --------------------------------------------------------------------------- the UDP loop


class DatagramPort(Protocol):
    """What allreduce_ina needs of the network (a UDP socket, or a test's fake)."""

    def send(self, data: bytes, addr: Addr) -> None: ...

    def recv(self, timeout_wall_ns: int) -> tuple[BytesLike, Addr] | None:
        """One datagram and its source, or None after `timeout_wall_ns` without one."""


class UdpPort:
    """A DatagramPort on a blocking UDP socket: sends retried until they are out
    (a paused port pushes back), receives bounded by SO_RCVTIMEO."""

    def __init__(self, sock: socket.socket, life: Lifecycle | None = None) -> None:
        self.sock = sock
        self.life = life
        self.errors = SendErrors()
        self._buf = bytearray(65536)
        self._timeout_ns = -1
        set_send_timeout(sock, PARENT_CHECK_NS)

    def send(self, data: bytes, addr: Addr) -> None:
        while True:
            try:
                self.sock.sendto(data, addr)
                return
            except OSError as e:
                self.errors.absorb(e)
            if self.life is not None and self.life.should_stop():
                raise InaError(f"stopped while sending: {self.life.stop_reason}")

    def recv(self, timeout_wall_ns: int) -> tuple[BytesLike, Addr] | None:
        timeout = max(1_000, min(timeout_wall_ns, PARENT_CHECK_NS))
        if timeout != self._timeout_ns:
            set_recv_timeout(self.sock, timeout)
            self._timeout_ns = timeout
        try:
            n, addr = self.sock.recvfrom_into(self._buf)
        except (BlockingIOError, TimeoutError, InterruptedError):
            return None
        return memoryview(self._buf)[:n], addr


def open_socket(bind_ip: str, port: int = 0, dscp: int = DEFAULT_DSCP, ecn: str = "ect0",
                rcvbuf_bytes: int = 4 << 20) -> socket.socket:
    """A worker's UDP socket: bound, its packets marked DSCP `dscp` / ECT(0) so they ride
    the lossless class, a receive buffer for a window of results."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos_byte(dscp, ecn))
        set_recv_buffer(sock, rcvbuf_bytes)
        sock.bind((bind_ip, port))
    except BaseException:
        sock.close()
        raise
    return sock


def allreduce_ina(sock: socket.socket | DatagramPort, aggregator_addr: Addr, job: InaJob,
                  worker_id: int, sendbuf: np.ndarray, recvbuf: np.ndarray, *,
                  dilation: Dilation, timeout_ns: float = DEFAULT_TIMEOUT_NS,
                  chunk_base: int = 0, max_retries: int = DEFAULT_MAX_RETRIES,
                  life: Lifecycle | None = None,
                  wall_ns: Callable[[], int] = time.monotonic_ns) -> WorkerCounters:
    """Sum `sendbuf` over the job's workers into `recvbuf` through the aggregator at
    `aggregator_addr`; returns the counters (`next_chunk_base` is the next call's
    `chunk_base`). `sock` is a bound UDP socket (its timeouts are set here; see
    `open_socket`) or any DatagramPort. `timeout_ns` is fabric time; `dilation` turns
    it into wall time. Raises InaError when a chunk stays unanswered or `life` asks to
    stop."""
    io: DatagramPort = UdpPort(sock, life) if isinstance(sock, socket.socket) else sock
    clock = FabricClock(dilation, wall_ns)
    if not (sendbuf.flags.c_contiguous and recvbuf.flags.c_contiguous):
        raise ValueError("sendbuf and recvbuf must be contiguous")
    w = InaWorker(job, worker_id, sendbuf.reshape(-1), recvbuf.reshape(-1),
                  aggregator=aggregator_addr, timeout_ns=timeout_ns, chunk_base=chunk_base,
                  max_retries=max_retries)
    while not w.done:
        if life is not None and life.should_stop():
            raise InaError(f"stopped: {life.stop_reason}")
        now = clock.now_ns()
        for data in w.poll(now):
            io.send(data, aggregator_addr)
        deadline = w.next_deadline_ns()
        wait = PARENT_CHECK_NS if deadline is None else dilation.to_wall_ns(
            max(0.0, deadline - clock.now_ns()))
        got = io.recv(wait)
        if got is not None:
            w.on_datagram(got[0], got[1])
    w.c.elapsed_fabric_ns = clock.now_ns()
    return w.c
