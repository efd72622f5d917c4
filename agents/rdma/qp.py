"""RC queue pairs of the user-space RoCEv2 transport: pure protocol logic.

No sockets and no clock of its own: every time is FABRIC nanoseconds, read from
an injected clock (anything with `now_ns()`, normally
`agents.timebase.FabricClock`) or passed as `now_ns=`. Packets go out through
two doors:

- data packets are PULLED by the transport: `RcRequester.poll_send(now)` returns
  the next paced, windowed packet (a memoryview of a per-QP buffer, valid until
  the next call) or None;
- ACK / NAK / CNP packets are PUSHED through the `tx(view, kind)` callback the
  moment the responder decides to send them (`kind` is PKT_ACK or PKT_CNP, so
  the transport can pick the IP TOS). The view is only valid during the call.

Received packets are handed in already parsed and ICRC-checked
(`agents.wire.roce.parse_packet`): `RcQp.on_packet(parsed, ce, now)`.

Requester (one per QP, the DCQCN reaction point):
  RDMA WRITE, RDMA WRITE with immediate and SEND messages segmented at the path MTU
  (FIRST / MIDDLE / LAST, or ONLY; a WRITE with immediate ends in LAST / ONLY WITH
  IMMEDIATE, which carry the 32-bit ImmDt), 24-bit PSNs with wrap, at most
  `window_packets` unacknowledged packets, AckReq on the last packet of every
  message and on every PSN that is a multiple of `ack_req_every`, a local ACK
  timeout and a retry limit (fabric time), go-back-N: an ACK acknowledges every PSN
  up to its own, a NAK(PSN sequence error) acknowledges every PSN before its own and
  the requester resends from it. Pacing: the rate is the congestion controller's
  (`cc.rate_bps`, fabric bit/s); every packet costs `len(datagram) +
  wire_overhead_bytes` wire bytes, which is also what `cc.on_bytes_sent` is told.

Responder (one per QP, the DCQCN notification point):
  expected PSN; PSN > expected: one NAK(PSN sequence error) carrying the
  expected PSN, then silent drops (counted as out-of-order drops) until the
  expected PSN arrives; PSN < expected: duplicate, re-ACKed (the first of a run,
  and every one with AckReq); in order: RDMA WRITE into a registered
  `MemoryRegion` (R_Key, bounds and length checked -> NAK remote access error /
  invalid request, after which the responder is in the error state, as an RC QP
  is), SEND into posted receive buffers (none posted -> RNR NAK). ACKs are
  coalesced: one per `ack_every` packets, and at AckReq or the end of a message.
  Every data packet is shown to the `DcqcnNp`, which decides whether a CE mark
  earns a CNP.

RDMA WRITE with immediate (what NCCL's IB transport moves its data with): the bytes
  land in the memory region exactly as a WRITE's (same R_Key and bounds checks), and
  the message consumes one posted receive WQE, completed as WC_RECV_RDMA_WITH_IMM
  with the immediate and the message's byte length (the WQE's own buffer is not
  touched, so a zero-length WQE will do: `post_recv(wr_id)`). With no WQE posted the
  responder RNR-NAKs, and no byte of the packet lands. Where it checks:
  - the LAST / ONLY WITH IMMEDIATE packet always needs one (that is where the
    message's WQE is consumed; rxe checks there and only there);
  - a multi-packet WRITE with immediate starts with a plain RDMA_WRITE_FIRST, so a
    responder cannot tell from its first packet that a WQE will be needed, and a real
    RNIC (rxe: the RWR mask is on LAST / ONLY WITH IMMEDIATE alone) may land the
    FIRST and MIDDLE bytes with no WQE posted and RNR-NAK only the LAST. Here a
    region registered with `writes_need_recv=True` asks more: the FIRST (or ONLY)
    packet of any WRITE into it is RNR-NAKed while the receive queue is empty, so no
    byte lands there before a WQE for its message exists. That is what makes a
    landing ring safe to reuse: a receiver that posts a WQE only once the slot it
    stands for is free can never have a slot overwritten before it was consumed
    (agents.collectives.roce argues it in full). Between the FIRST and its LAST
    nothing else can take the WQE (RC messages are processed one at a time, in
    order), so the check at the FIRST holds at the LAST.

Not implemented: RDMA READ, atomics, SEND with immediate / invalidate, UD/UC, SRQ,
credits (ACKs carry "unlimited"), path migration. See docs/roce.md.
"""

from __future__ import annotations

import struct
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import NamedTuple, Protocol

from agents.rdma.cc import DcqcnNp, RateController
from agents.runtime.framing import WIRE_OVERHEAD_BYTES
from agents.wire import BytesLike
from agents.wire.roce import (
    AETH_BYTES,
    BTH_BYTES,
    CNP_OPCODES,
    DEFAULT_P_KEY,
    ICRC_BYTES,
    IMMDT_BYTES,
    PSN_HALF,
    PSN_MASK,
    QPN_MASK,
    RETH_BYTES,
    Aeth,
    Bth,
    IcrcContext,
    NakCode,
    Opcode,
    Parsed,
    build_cnp,
    build_packet,
    parse_packet,
)

__all__ = [
    "IB_MTUS",
    "MAX_WINDOW_PACKETS",
    "PKT_ACK",
    "PKT_CNP",
    "PKT_DATA",
    "RNR_TIMER_NS",
    "WC_RECV",
    "WC_RECV_RDMA_WITH_IMM",
    "WC_SEND",
    "WC_WRITE",
    "Completion",
    "MemoryRegion",
    "QpAttrs",
    "QpState",
    "RatePacer",
    "RcQp",
    "RcRequester",
    "RcResponder",
    "WcStatus",
    "build_data_packet",
    "packets_for",
    "wire_bytes",
]

PKT_DATA = 0
PKT_ACK = 1     # ACK and NAK (AETH): same traffic class as the data
PKT_CNP = 2

IB_MTUS = (256, 512, 1024, 2048, 4096)

#: Most unacknowledged packets a QP may have: 2^22, half of the 2^23 half-space 24-bit PSNs
#: are compared in, so an ACK, a NAK or a duplicate is never mistaken for the other side of
#: the window (a packet ahead of the expected PSN by up to 2^22, behind by up to 2^22).
MAX_WINDOW_PACKETS = 1 << 22

#: IBTA RNR NAK timer field (5 bits) -> the wait it asks for, in ns (code 0 is the longest).
RNR_TIMER_NS = (
    655_360_000, 10_000, 20_000, 30_000, 40_000, 60_000, 80_000, 120_000, 160_000, 240_000,
    320_000, 480_000, 640_000, 960_000, 1_280_000, 1_920_000, 2_560_000, 3_840_000,
    5_120_000, 7_680_000, 10_240_000, 15_360_000, 20_480_000, 30_720_000, 40_960_000,
    61_440_000, 81_920_000, 122_880_000, 163_840_000, 245_760_000, 327_680_000, 491_520_000,
)

_PAD_ICRC = 3 + ICRC_BYTES

_OP_ACK = int(Opcode.RC_ACKNOWLEDGE)
_OP_SEND_FIRST = int(Opcode.RC_SEND_FIRST)
_OP_SEND_MIDDLE = int(Opcode.RC_SEND_MIDDLE)
_OP_SEND_LAST = int(Opcode.RC_SEND_LAST)
_OP_SEND_ONLY = int(Opcode.RC_SEND_ONLY)
_OP_WRITE_FIRST = int(Opcode.RC_RDMA_WRITE_FIRST)
_OP_WRITE_MIDDLE = int(Opcode.RC_RDMA_WRITE_MIDDLE)
_OP_WRITE_LAST = int(Opcode.RC_RDMA_WRITE_LAST)
_OP_WRITE_ONLY = int(Opcode.RC_RDMA_WRITE_ONLY)
_OP_WRITE_LAST_IMM = int(Opcode.RC_RDMA_WRITE_LAST_WITH_IMMEDIATE)
_OP_WRITE_ONLY_IMM = int(Opcode.RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE)
# (first, middle, last, only) per message kind
_WRITE_OPS = (_OP_WRITE_FIRST, _OP_WRITE_MIDDLE, _OP_WRITE_LAST, _OP_WRITE_ONLY)
_WRITE_IMM_OPS = (_OP_WRITE_FIRST, _OP_WRITE_MIDDLE, _OP_WRITE_LAST_IMM, _OP_WRITE_ONLY_IMM)
_SEND_OPS = (_OP_SEND_FIRST, _OP_SEND_MIDDLE, _OP_SEND_LAST, _OP_SEND_ONLY)
_WRITE_END = frozenset({_OP_WRITE_LAST, _OP_WRITE_ONLY, _OP_WRITE_LAST_IMM, _OP_WRITE_ONLY_IMM})
_MESSAGE_END = frozenset({_OP_SEND_LAST, _OP_SEND_ONLY}) | _WRITE_END

_SYN_ACK = 0x1F                                     # ACK, unlimited credits
_SYN_NAK_SEQ = 0x60 | NakCode.PSN_SEQUENCE_ERROR
_SYN_NAK_INVALID = 0x60 | NakCode.INVALID_REQUEST
_SYN_NAK_ACCESS = 0x60 | NakCode.REMOTE_ACCESS_ERROR


_BTH = struct.Struct("!BBHII")
_RETH = struct.Struct("!QII")
_IMMDT = struct.Struct("!I")
_ICRC = struct.Struct("<I")
_ZPAD = bytes(4)


def build_data_packet(buf: bytearray, view: memoryview, ctx: IcrcContext, opcode: int,
                      p_key: int, dest_qp: int, ack_req: bool, psn: int,
                      reth: tuple[int, int, int] | None, payload: BytesLike,
                      imm: int | None = None) -> memoryview:
    """The requester's fast path: BTH [+ RETH] [+ ImmDt] + payload + pad + ICRC into `buf`.

    Byte for byte what `agents.wire.roce.build_packet` makes for the same fields (a unit
    test holds them equal), without its argument checks: the requester only passes
    opcodes, PSNs, QPNs and immediates it made or checked itself. `view` is memoryview(buf).
    """
    n = len(payload)
    pad = -n & 3
    hdr = 28 if reth is not None else 12
    # BTH byte 4 (FECN | BECN | resv) is 0xFF while the ICRC runs, then 0
    _BTH.pack_into(buf, 0, opcode, pad << 4, p_key, 0xFF000000 | dest_qp,
                   0x80000000 | psn if ack_req else psn)
    if reth is not None:
        _RETH.pack_into(buf, 12, *reth)
    if imm is not None:
        _IMMDT.pack_into(buf, hdr, imm)
        hdr += 4
    end = hdr + n
    if n:
        buf[hdr:end] = payload
    if pad:
        buf[end:end + pad] = _ZPAD[:pad]
        end += pad
    crc = zlib.crc32(view[:end], ctx.seed(end + ICRC_BYTES))
    buf[4] = 0
    _ICRC.pack_into(buf, end, crc)
    return view[:end + ICRC_BYTES]


def packets_for(length: int, mtu: int) -> int:
    """Packets of a message of `length` bytes at path MTU `mtu` (a 0-byte message is one)."""
    return max(1, -(-length // mtu))


def wire_bytes(udp_payload_bytes: int, overhead: int = WIRE_OVERHEAD_BYTES) -> int:
    """Bytes on the Ethernet wire for a RoCEv2 datagram of `udp_payload_bytes`."""
    return udp_payload_bytes + overhead


class Clock(Protocol):
    def now_ns(self) -> float: ...


class TxBatchLike(Protocol):
    """What `RcRequester.build_batch` needs of agents.fast's TxBatch (see its `build`)."""

    def build(self, data: memoryview, first_idx: int, npkts: int, mtu: int,
              ops: tuple[int, int, int, int], dest_qp: int, p_key: int, psn: int,
              ack_req_every: int, reth: tuple[int, int, int] | None, imm: int | None,
              pseudo: bytes, overhead: int, due_ns: float, rate_bps: float,
              burst_bits: float, now_ns: float, max_packets: int,
              budget_bytes: float) -> tuple[int, float, int, int]: ...


class QpState:
    RTS = "rts"
    ERROR = "error"


class WcStatus:
    """Work-completion status, after ibv_wc_status."""

    SUCCESS = "success"
    RETRY_EXCEEDED = "retry_exceeded"               # IBV_WC_RETRY_EXC_ERR
    RNR_RETRY_EXCEEDED = "rnr_retry_exceeded"       # IBV_WC_RNR_RETRY_EXC_ERR
    REMOTE_ACCESS_ERROR = "remote_access_error"     # IBV_WC_REM_ACCESS_ERR
    REMOTE_INVALID_REQUEST = "remote_invalid_request"  # IBV_WC_REM_INV_REQ_ERR
    REMOTE_OPERATIONAL_ERROR = "remote_operational_error"
    LOCAL_LENGTH_ERROR = "local_length_error"       # a SEND larger than the receive buffer
    FLUSHED = "flushed"                             # IBV_WC_WR_FLUSH_ERR


_NAK_STATUS: dict[int, str] = {
    NakCode.INVALID_REQUEST: WcStatus.REMOTE_INVALID_REQUEST,
    NakCode.REMOTE_ACCESS_ERROR: WcStatus.REMOTE_ACCESS_ERROR,
    NakCode.REMOTE_OPERATIONAL_ERROR: WcStatus.REMOTE_OPERATIONAL_ERROR,
}


#: Work-completion opcodes, after ibv_wc_opcode: a requester completes WRITEs (with or
#: without immediate, as IBV_WC_RDMA_WRITE) and SENDs; a responder completes a receive
#: WQE for a SEND (IBV_WC_RECV) or for a WRITE with immediate (IBV_WC_RECV_RDMA_WITH_IMM).
WC_WRITE = "write"
WC_SEND = "send"
WC_RECV = "recv"
WC_RECV_RDMA_WITH_IMM = "recv_rdma_with_imm"


class Completion(NamedTuple):
    """A work completion: `opcode` is one of the WC_* names. `byte_len` is the message's
    length (for a WRITE with immediate, the bytes written into the region); `imm` is the
    immediate data of a WC_RECV_RDMA_WITH_IMM, None otherwise."""

    wr_id: int
    status: str
    opcode: str
    byte_len: int
    imm: int | None = None


@dataclass(frozen=True)
class QpAttrs:
    """QP attributes. Times are fabric ns; the defaults are documented in docs/roce.md."""

    mtu: int = 4096                  # path MTU (IB MTU: payload bytes per packet)
    window_packets: int = 128        # most unacknowledged packets (rxe: RXE_MAX_UNACKED_PSNS)
    #                                  at most MAX_WINDOW_PACKETS
    ack_req_every: int = 64          # AckReq on PSNs that are multiples of this (rxe: 64)
    ack_every: int = 16              # responder: at most this many packets per ACK
    timeout_ns: float = 1_000_000    # local ACK timeout (fabric ns)
    retry_cnt: int = 7               # retries after a timeout / a NAK that acked nothing
    rnr_retry: int = 7               # RNR retries; 7 = infinite (IB)
    min_rnr_timer: int = 1           # RNR NAK timer code the responder sends (1 = 10 us)
    max_burst_bytes: int = 16384     # pacing: most wire bytes sent back to back to catch up
    wire_overhead_bytes: int = WIRE_OVERHEAD_BYTES
    p_key: int = DEFAULT_P_KEY

    def __post_init__(self) -> None:
        problems = []
        if self.mtu not in IB_MTUS:
            problems.append(f"mtu must be one of {IB_MTUS}, got {self.mtu!r}")
        if not 1 <= self.window_packets <= MAX_WINDOW_PACKETS:
            problems.append(f"window_packets must be 1..2^22, got {self.window_packets!r}")
        for name in ("ack_req_every", "ack_every"):
            if not getattr(self, name) >= 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if not self.timeout_ns > 0:
            problems.append(f"timeout_ns must be > 0, got {self.timeout_ns!r}")
        for name in ("retry_cnt", "rnr_retry"):
            if not 0 <= getattr(self, name) <= 7:
                problems.append(f"{name} must be 0..7, got {getattr(self, name)!r}")
        if not 0 <= self.min_rnr_timer <= 31:
            problems.append(f"min_rnr_timer must be 0..31, got {self.min_rnr_timer!r}")
        if not self.max_burst_bytes >= 0:
            problems.append(f"max_burst_bytes must be >= 0, got {self.max_burst_bytes!r}")
        if not self.wire_overhead_bytes >= 0:
            problems.append("wire_overhead_bytes must be >= 0, "
                            f"got {self.wire_overhead_bytes!r}")
        if not 0 <= self.p_key <= 0xFFFF:
            problems.append(f"p_key must be 16 bits, got {self.p_key!r}")
        if problems:
            raise ValueError("QP attributes: " + "; ".join(problems))

    def to_dict(self) -> dict:
        return asdict(self)


class MemoryRegion:
    """A registered buffer: remote writes to [va, va + length) with `rkey` land in `buf`.

    `buf` is anything with a writable contiguous buffer (bytearray, numpy array).
    `writes_need_recv`: the first packet of a WRITE into this region is RNR-NAKed while
    the responder has no receive WQE posted, so nothing lands before the WQE its message
    will consume exists (a landing ring for WRITEs with immediate; see the module
    docstring). Off, only the packet that consumes the WQE needs one, as on an RNIC.
    """

    __slots__ = ("va", "rkey", "length", "view", "remote_write", "writes_need_recv")

    def __init__(self, buf: BytesLike, va: int, rkey: int, *, remote_write: bool = True,
                 writes_need_recv: bool = False) -> None:
        view = memoryview(buf)
        if view.readonly:
            raise ValueError("a memory region needs a writable buffer")
        self.view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        self.length = self.view.nbytes
        if not 0 <= va and va + self.length <= 1 << 64:
            raise ValueError(f"VA range {va:#x}+{self.length} does not fit 64 bits")
        if not 0 <= rkey <= 0xFFFFFFFF:
            raise ValueError(f"rkey {rkey} is not 32 bits")
        self.va = va
        self.rkey = rkey
        self.remote_write = remote_write
        self.writes_need_recv = writes_need_recv

    def __repr__(self) -> str:
        return f"MemoryRegion(va={self.va:#x}, length={self.length}, rkey={self.rkey:#x})"

    @classmethod
    def sink(cls, length: int, va: int, rkey: int) -> MemoryRegion:
        """A region of `length` bytes that takes remote writes and keeps none of them:
        a flow's receiver checks each WRITE against the region as an RNIC does, but a
        1 GB flow must not need 1 GB of memory (agents.flows measures time, not bytes)."""
        mr = cls(bytearray(0), va, rkey)
        mr.view = _Sink(length)            # type: ignore[assignment]
        mr.length = length
        if va + length > 1 << 64:
            raise ValueError(f"VA range {va:#x}+{length} does not fit 64 bits")
        return mr


class _Sink:
    """Slice assignment that discards: the memory of a `MemoryRegion.sink`."""

    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def __setitem__(self, key: slice, value: object) -> None:
        pass


class RatePacer:
    """When the next packet may go, at a rate that may change from packet to packet.

    A packet of `wire_bytes` sent at `rate_bps` occupies wire_bytes * 8 / rate on the
    wire; the next one is due that long after the previous one was due (an absolute
    schedule, so pacing does not drift with loop latency). A sender that fell behind
    may catch up back to back by at most `max_burst_bytes` (at the current rate);
    time owed beyond that is forgiven. Times in fabric ns, rates in fabric bit/s.
    """

    __slots__ = ("_due", "_burst_bits")

    def __init__(self, max_burst_bytes: int) -> None:
        self._due = float("-inf")
        self._burst_bits = max_burst_bytes * 8

    def due_ns(self) -> float:
        return self._due

    def sent(self, wire_bytes: int, rate_bps: float, now_ns: float) -> None:
        base = self._due
        floor = now_ns - self._burst_bits * 1e9 / rate_bps
        if base < floor:
            base = floor
        self._due = base + wire_bytes * 8e9 / rate_bps


#: What a finished WQE holds instead of its message: the caller's buffer is let go.
_RELEASED = memoryview(b"")
#: The buffer of a receive WQE posted without one (for WRITEs with immediate, which do
#: not touch it; a SEND with any payload into it is a local length error).
_NO_BUFFER = memoryview(bytearray(0))


class _Wqe:
    """One posted send-queue work request."""

    __slots__ = ("wr_id", "ops", "kind", "data", "length", "va", "rkey", "first_psn", "npkts",
                 "imm")

    def __init__(self, wr_id: int, ops: tuple[int, int, int, int], kind: str,
                 data: memoryview, length: int, va: int, rkey: int, first_psn: int,
                 npkts: int, imm: int | None) -> None:
        self.wr_id = wr_id
        self.ops = ops
        self.kind = kind
        self.data = data
        self.length = length
        self.va = va
        self.rkey = rkey
        self.first_psn = first_psn
        self.npkts = npkts
        self.imm = imm          # the immediate data, on the last packet; None: no immediate


def _now(clock: Clock | None, now_ns: float | None) -> float:
    if now_ns is not None:
        return now_ns
    if clock is None:
        raise ValueError("no clock injected: pass now_ns")
    return clock.now_ns()


def _as_bytes_view(data) -> memoryview:
    view = memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


# --------------------------------------------------------------------------- requester

class RcRequester:
    """Send side of an RC QP: segmentation, PSNs, window, pacing, ACK/NAK/timeout, DCQCN RP."""

    def __init__(self, qpn: int, dest_qpn: int, ctx: IcrcContext, attrs: QpAttrs,
                 cc: RateController, *, psn: int = 0, clock: Clock | None = None) -> None:
        if not (0 <= qpn <= QPN_MASK and 0 <= dest_qpn <= QPN_MASK):
            raise ValueError(f"QPNs must be 24 bits: {qpn}, {dest_qpn}")
        if not 0 <= psn <= PSN_MASK:
            raise ValueError(f"PSN {psn} is not 24 bits")
        self.qpn = qpn
        self.dest_qpn = dest_qpn
        self.ctx = ctx
        self.attrs = attrs
        self.cc = cc
        self.clock = clock
        self.state = QpState.RTS
        self.error: str | None = None
        self._mtu = attrs.mtu
        self._buf = bytearray(BTH_BYTES + RETH_BYTES + IMMDT_BYTES + attrs.mtu + _PAD_ICRC)
        self._view = memoryview(self._buf)
        self._p_key = attrs.p_key
        self._window = attrs.window_packets
        self._ack_req_every = attrs.ack_req_every
        self._overhead = attrs.wire_overhead_bytes
        self._pacer = RatePacer(attrs.max_burst_bytes)
        self._timeout = attrs.timeout_ns
        self._pseudo: bytes | None = None   # ctx.pseudo_header(0), for build_batch
        self._sq: list[_Wqe] = []
        self._head = 0           # oldest incomplete WQE
        self._cur = 0            # WQE holding _snd
        self._cur_idx = 0        # packet index of _snd within it
        self._post_psn = psn     # first PSN of the next posted message
        self._snd = psn          # next PSN to transmit
        self._una = psn          # oldest unacknowledged PSN
        self._hi = psn           # one past the highest PSN ever transmitted
        self._rto_deadline: float | None = None
        self._rnr_until: float | None = None
        self._retries = 0
        self._rnr_retries = 0
        self.completions: deque[Completion] = deque()
        self.last_was_retransmission = False   # of the packet poll_send returned last
        # counters
        self.packets_sent = 0
        self.bytes_sent = 0           # UDP payload bytes (BTH .. ICRC)
        self.wire_bytes_sent = 0
        self.payload_bytes_sent = 0   # message bytes carried (retransmissions included)
        self.retransmissions = 0      # packets sent with a PSN sent before
        self.acks_received = 0
        self.duplicate_acks = 0       # ACKs that acknowledged nothing new
        self.stale_acks = 0        # ACKs / NAKs outside [una - 1, highest sent]
        self.naks_received = 0        # NAK(PSN sequence error)
        self.fatal_naks_received = 0  # NAK(invalid request / remote access / remote op)
        self.rnr_naks_received = 0
        self.timeouts = 0
        self.cnps_received = 0
        self.messages_posted = 0
        self.messages_completed = 0
        self.bytes_completed = 0
        self.unsent_at_stop = 0       # built, never sent: a stop ended their blocked send

    # -- posting

    def post_write(self, wr_id: int, local: BytesLike, remote_va: int, rkey: int) -> None:
        """Post an RDMA WRITE of the whole of `local` to `remote_va` under `rkey`."""
        self._post(wr_id, _WRITE_OPS, WC_WRITE, local, remote_va, rkey, None)

    def post_write_imm(self, wr_id: int, local: BytesLike, remote_va: int, rkey: int,
                       imm: int) -> None:
        """Post an RDMA WRITE with immediate: `local` to `remote_va` under `rkey`, and the
        32-bit `imm` to the peer's next receive WQE, which the message consumes (segmented
        as a WRITE; the last packet is LAST / ONLY WITH IMMEDIATE). Completes as a WRITE."""
        if not 0 <= imm <= 0xFFFFFFFF:
            raise ValueError(f"immediate data {imm} is not 32 bits")
        self._post(wr_id, _WRITE_IMM_OPS, WC_WRITE, local, remote_va, rkey, imm)

    def post_send(self, wr_id: int, local: BytesLike) -> None:
        """Post a SEND of the whole of `local` (lands in the peer's next receive buffer)."""
        self._post(wr_id, _SEND_OPS, WC_SEND, local, 0, 0, None)

    def _post(self, wr_id: int, ops: tuple[int, int, int, int], kind: str, local: BytesLike,
              va: int, rkey: int, imm: int | None) -> None:
        data = _as_bytes_view(local)
        n = data.nbytes
        if n >= 1 << 31:
            raise ValueError(f"message of {n} bytes exceeds 2^31 - 1")
        if kind == WC_WRITE and not (0 <= va and va + n <= 1 << 64 and 0 <= rkey <= 0xFFFFFFFF):
            raise ValueError(f"bad remote address {va:#x}+{n} / rkey {rkey}")
        if self.state != QpState.RTS:
            self.completions.append(Completion(wr_id, WcStatus.FLUSHED, kind, 0))
            return
        npkts = packets_for(n, self._mtu)
        self._sq.append(_Wqe(wr_id, ops, kind, data, n, va, rkey, self._post_psn, npkts, imm))
        self._post_psn = (self._post_psn + npkts) & PSN_MASK
        self.messages_posted += 1

    @property
    def outstanding_messages(self) -> int:
        """Posted messages not yet completed."""
        return len(self._sq) - self._head

    @property
    def outstanding_packets(self) -> int:
        """Packets sent and not yet acknowledged (as far as the window is concerned)."""
        return (self._snd - self._una) & PSN_MASK

    @property
    def idle(self) -> bool:
        return self._head == len(self._sq)

    @property
    def una_psn(self) -> int:
        return self._una

    @property
    def next_psn(self) -> int:
        return self._snd

    # -- sending

    def send_due_ns(self) -> float | None:
        """Fabric time the next packet may go (pacer), or None if none can go now
        (nothing posted, window full, waiting out an RNR NAK, or in error)."""
        if self.state != QpState.RTS or self._snd == self._post_psn:
            return None
        if ((self._snd - self._una) & PSN_MASK) >= self._window:
            return None
        if self._rnr_until is not None:
            return max(self._rnr_until, self._pacer.due_ns())
        return self._pacer.due_ns()

    def poll_send(self, now_ns: float | None = None) -> memoryview | None:
        """The next data packet if one may go at `now_ns`, else None.

        The returned view is a per-QP buffer, valid until the next call.
        """
        snd = self._snd
        if self.state != QpState.RTS or snd == self._post_psn:
            return None
        if ((snd - self._una) & PSN_MASK) >= self._window:
            return None
        now = now_ns if now_ns is not None else _now(self.clock, None)
        if self._rnr_until is not None:
            if now < self._rnr_until:
                return None
            self._rnr_until = None
        pacer = self._pacer
        if now < pacer._due:
            return None
        w = self._sq[self._cur]
        i = self._cur_idx
        last = i == w.npkts - 1
        ops = w.ops
        if i == 0:
            opcode = ops[3] if last else ops[0]
        else:
            opcode = ops[2] if last else ops[1]
        off = i * self._mtu
        payload = w.data[off:off + self._mtu]
        ack_req = last or snd % self._ack_req_every == 0
        reth = (w.va, w.rkey, w.length) if (i == 0 and w.kind == WC_WRITE) else None
        view = build_data_packet(self._buf, self._view, self.ctx, opcode, self._p_key,
                                 self.dest_qpn, ack_req, snd, reth, payload,
                                 w.imm if last else None)
        # advance the cursor
        if last:
            self._cur += 1
            self._cur_idx = 0
        else:
            self._cur_idx = i + 1
        self._snd = (snd + 1) & PSN_MASK
        if snd == self._hi:
            self._hi = self._snd
            self.last_was_retransmission = False
        else:
            self.retransmissions += 1
            self.last_was_retransmission = True
        if self._rto_deadline is None:
            self._rto_deadline = now + self._timeout
        n = len(view)
        wire = n + self._overhead
        self.packets_sent += 1
        self.bytes_sent += n
        self.wire_bytes_sent += wire
        self.payload_bytes_sent += len(payload)
        # pace: this packet occupies wire * 8 / rate; bounded catch-up after a stall
        pacer.sent(wire, self.cc.on_bytes_sent(wire, now), now)
        return view

    def paced_out(self, now_ns: float) -> bool:
        """True when `poll_send(now_ns)` would return None for the pacer alone and change
        nothing (no RNR wait to clear first): the fast path's round stops here without
        another call."""
        return self._rnr_until is None and now_ns < self._pacer._due

    def build_batch(self, now_ns: float, batch: TxBatchLike, max_packets: int) -> int:
        """The fast path's `poll_send`: build into `batch` (an agents.fast TxBatch) the
        packets successive `poll_send(now_ns)` calls would return, at most `max_packets`,
        and leave this requester, its pacer and its rate controller as those calls would.

        Returns how many were built: 0 when `poll_send` would return None; -1 when the
        next packet must take the per-packet path (the rate controller cannot promise its
        rate for it: a timer due, a byte-counter event, or no `bulk_bytes_budget`). A
        batch never crosses a message boundary, nor changes the rate: the C side stops
        where the pacer says wait and before the wire bytes reach the controller's budget.
        """
        snd = self._snd
        if self.state != QpState.RTS or snd == self._post_psn:
            return 0
        room = self._window - ((snd - self._una) & PSN_MASK)
        if room <= 0:
            return 0
        now = now_ns
        if self._rnr_until is not None:
            if now < self._rnr_until:
                return 0
            self._rnr_until = None
        pacer = self._pacer
        if now < pacer._due:
            return 0
        cc = self.cc
        budget_fn = getattr(cc, "bulk_bytes_budget", None)
        if budget_fn is None:
            return -1
        budget = budget_fn(now)
        if not budget > 0:
            return -1
        w = self._sq[self._cur]
        i = self._cur_idx
        pseudo = self._pseudo
        if pseudo is None:
            pseudo = self._pseudo = self.ctx.pseudo_header(0)
        rate = cc.rate_bps
        n, due, nbytes, payload = batch.build(
            w.data, i, w.npkts, self._mtu, w.ops, self.dest_qpn, self._p_key, snd,
            self._ack_req_every, (w.va, w.rkey, w.length) if w.kind == WC_WRITE else None,
            w.imm, pseudo, self._overhead, pacer._due, rate, pacer._burst_bits, now,
            min(max_packets, room), budget)
        if n == 0:
            return -1           # the first packet alone reaches the budget
        # what n poll_send calls do, in bulk
        if i + n == w.npkts:
            self._cur += 1
            self._cur_idx = 0
        else:
            self._cur_idx = i + n
        self._snd = (snd + n) & PSN_MASK
        behind = (self._hi - snd) & PSN_MASK    # packets from snd that were sent before
        if n > behind:
            self.retransmissions += behind
            self._hi = self._snd
            self.last_was_retransmission = False
        else:
            self.retransmissions += n
            self.last_was_retransmission = True
        if self._rto_deadline is None:
            self._rto_deadline = now + self._timeout
        wire = nbytes + n * self._overhead
        self.packets_sent += n
        self.bytes_sent += nbytes
        self.wire_bytes_sent += wire
        self.payload_bytes_sent += payload
        cc.on_bytes_sent(wire, now)             # within the budget: one call is n calls
        pacer._due = due
        return n

    # -- feedback

    def on_ack(self, bth: Bth, aeth: Aeth, now_ns: float | None = None) -> None:
        """An ACKNOWLEDGE packet for this QP: ACK, NAK or RNR NAK."""
        if self.state != QpState.RTS:
            return
        now = _now(self.clock, now_ns)
        psn = bth.psn
        syndrome = aeth.syndrome
        kind = syndrome >> 5
        una = self._una
        if kind == 0:                                   # ACK: acknowledges PSNs <= psn
            new = (psn + 1) & PSN_MASK
            ahead = (new - una) & PSN_MASK
            if ahead == 0:
                self.duplicate_acks += 1
                return
            if ahead > ((self._hi - una) & PSN_MASK):   # before una, or never sent
                self.stale_acks += 1
                return
            self.acks_received += 1
            self._advance_una(new, now)
            return
        # NAKs carry the PSN they are about: everything before it is acknowledged
        if ((psn - una) & PSN_MASK) > ((self._hi - una) & PSN_MASK):
            self.stale_acks += 1
            return
        if kind == 3:
            code = syndrome & 0x1F
            if code == NakCode.PSN_SEQUENCE_ERROR:
                self.naks_received += 1
                if psn != una:
                    self._advance_una(psn, now)
                elif not self._retry(now, WcStatus.RETRY_EXCEEDED):
                    return
                self._rewind(psn)
                self._rto_deadline = now + self._timeout
                return
            self.fatal_naks_received += 1
            if psn != una:
                self._advance_una(psn, now)
            self._to_error(_NAK_STATUS.get(code, WcStatus.REMOTE_OPERATIONAL_ERROR))
            return
        if kind == 1:                                   # RNR NAK
            self.rnr_naks_received += 1
            if psn != una:
                self._advance_una(psn, now)
            self._rnr_retries += 1
            if self.attrs.rnr_retry != 7 and self._rnr_retries > self.attrs.rnr_retry:
                self._to_error(WcStatus.RNR_RETRY_EXCEEDED)
                return
            self._rewind(psn)
            self._rnr_until = now + RNR_TIMER_NS[syndrome & 0x1F]
            self._rto_deadline = None   # re-armed by the resend
            return
        self.stale_acks += 1   # reserved syndrome (the parser rejects these already)

    def on_cnp(self, now_ns: float | None = None) -> None:
        """A CNP for this QP: the reaction point cuts its rate."""
        self.cnps_received += 1
        self.cc.on_cnp(_now(self.clock, now_ns))

    def next_timer_ns(self) -> float | None:
        """Earliest of the retransmit deadline and the congestion controller's next timer."""
        t = self._rto_deadline
        c = self.cc.next_event_ns()
        if c is not None and (t is None or c < t):
            t = c
        return t

    def on_timer(self, now_ns: float | None = None) -> None:
        """Fire what is due: the local ACK timeout (go back to the oldest unacked PSN) and
        the congestion controller's timers."""
        now = _now(self.clock, now_ns)
        self.cc.advance(now)
        d = self._rto_deadline
        if d is None or now < d or self.state != QpState.RTS:
            return
        if self._una == self._hi:
            self._rto_deadline = None
            return
        self.timeouts += 1
        if not self._retry(now, WcStatus.RETRY_EXCEEDED):
            return
        self._rewind(self._una)
        self._rto_deadline = now + self._timeout

    # -- internals

    def _retry(self, now: float, status: str) -> bool:
        self._retries += 1
        if self._retries > self.attrs.retry_cnt:
            self._to_error(status)
            return False
        return True

    def _advance_una(self, new: int, now: float) -> None:
        """Everything before PSN `new` is acknowledged: complete the messages it covers."""
        self._una = new
        self._retries = 0
        self._rnr_retries = 0
        sq = self._sq
        head = self._head
        end = len(sq)
        while head < end:
            w = sq[head]
            # WQEs are contiguous in PSN and w.first_psn <= new, so this is w's progress
            if ((new - w.first_psn) & PSN_MASK) < w.npkts:
                break
            self.completions.append(Completion(w.wr_id, WcStatus.SUCCESS, w.kind, w.length))
            self.messages_completed += 1
            self.bytes_completed += w.length
            w.data = _RELEASED
            head += 1
        self._head = head
        ahead = (new - self._snd) & PSN_MASK
        if 0 < ahead < PSN_HALF:            # acked beyond what we were about to resend
            self._rewind(new)
        self._rto_deadline = None if new == self._hi else now + self._timeout
        if head > 4096 and head * 2 > end:
            del sq[:head]
            self._cur -= head
            self._head = 0

    def _rewind(self, psn: int) -> None:
        """Make `psn` the next PSN to transmit (go-back-N), moving the send cursor."""
        self._snd = psn
        sq = self._sq
        for j in range(self._head, len(sq)):
            w = sq[j]
            d = (psn - w.first_psn) & PSN_MASK
            if d < w.npkts:
                self._cur = j
                self._cur_idx = d
                return
        self._cur = len(sq)
        self._cur_idx = 0

    def _to_error(self, status: str) -> None:
        """Move to the error state: the first incomplete WQE gets `status`, the rest flush."""
        self.state = QpState.ERROR
        self.error = status
        first = True
        for w in self._sq[self._head:]:
            self.completions.append(Completion(w.wr_id, status if first else WcStatus.FLUSHED,
                                               w.kind, 0))
            first = False
            w.data = _RELEASED
        self._head = len(self._sq)
        self._cur = self._head
        self._cur_idx = 0
        self._rto_deadline = None
        self._rnr_until = None

    def unsend(self, packets: list[BytesLike]) -> None:
        """Take back packets this requester built and counted as sent that never left: a
        stop ended the blocked send that held them (a paused NIC queue at the end of a
        run). The send counters then say what reached the socket, which the run's packet
        conservation compares with what arrived; `unsent_at_stop` counts them. The QP is
        stopping: its PSNs and the controller's byte count are not rewound."""
        for data in packets:
            parsed = parse_packet(data, None, check_icrc=False)
            n = memoryview(data).nbytes
            self.packets_sent -= 1
            self.bytes_sent -= n
            self.wire_bytes_sent -= n + self._overhead
            self.payload_bytes_sent -= parsed.payload.nbytes
            self.unsent_at_stop += 1

    def counters(self) -> dict:
        return {
            "state": self.state,
            "error": self.error,
            "packets_sent": self.packets_sent,
            "bytes_sent": self.bytes_sent,
            "wire_bytes_sent": self.wire_bytes_sent,
            "payload_bytes_sent": self.payload_bytes_sent,
            "retransmissions": self.retransmissions,
            "acks_received": self.acks_received,
            "duplicate_acks": self.duplicate_acks,
            "stale_acks": self.stale_acks,
            "naks_received": self.naks_received,
            "fatal_naks_received": self.fatal_naks_received,
            "rnr_naks_received": self.rnr_naks_received,
            "timeouts": self.timeouts,
            "cnps_received": self.cnps_received,
            "messages_posted": self.messages_posted,
            "messages_completed": self.messages_completed,
            "bytes_completed": self.bytes_completed,
            "next_psn": self._snd,
            "una_psn": self._una,
            "unsent_at_stop": self.unsent_at_stop,
        }


# --------------------------------------------------------------------------- responder

class RcResponder:
    """Receive side of an RC QP: expected PSN, NAK + silent drop, duplicates, ACK coalescing,
    RDMA WRITE (with or without immediate) into memory regions, SEND into posted receive
    buffers, DCQCN NP."""

    def __init__(self, qpn: int, dest_qpn: int, ctx: IcrcContext, attrs: QpAttrs, *,
                 psn: int = 0, np: DcqcnNp | None = None,
                 mrs: dict[int, MemoryRegion] | None = None,
                 tx: Callable[[memoryview, int], None] | None = None,
                 clock: Clock | None = None) -> None:
        if not 0 <= psn <= PSN_MASK:
            raise ValueError(f"PSN {psn} is not 24 bits")
        self.qpn = qpn
        self.dest_qpn = dest_qpn
        self.ctx = ctx
        self.attrs = attrs
        self.np = np
        self.mrs = {} if mrs is None else mrs
        self.tx = tx
        self.clock = clock
        self.state = QpState.RTS
        self.error: str | None = None
        self._mtu = attrs.mtu
        self._ack_every = attrs.ack_every
        self._epsn = psn
        self._nak_sent = False
        self._dup_run = False       # the previous packet was a duplicate already re-ACKed
        self._since_ack = 0
        self._last_acked: int | None = None
        self.msn = 0
        self._ctl = bytearray(BTH_BYTES + max(AETH_BYTES, 16) + ICRC_BYTES)
        # current RDMA WRITE
        self._wr_view: memoryview | None = None
        self._wr_off = 0
        self._wr_left = 0
        self._wr_len = 0          # its DMA length (a WRITE with immediate completes with it)
        # receive queue and the SEND being received
        self._rq: deque[tuple[int, memoryview]] = deque()
        self._rv: tuple[int, memoryview] | None = None
        self._rv_off = 0
        self.completions: deque[Completion] = deque()
        # the placer of each request opcode the responder accepts (bound once: per packet)
        self._placers: dict[int, Callable[[int, Parsed], bool]] = {
            _OP_WRITE_FIRST: self._write_start, _OP_WRITE_ONLY: self._write_start,
            _OP_WRITE_ONLY_IMM: self._write_start,
            _OP_WRITE_MIDDLE: self._write_continue, _OP_WRITE_LAST: self._write_continue,
            _OP_WRITE_LAST_IMM: self._write_continue,
            _OP_SEND_FIRST: self._send_start, _OP_SEND_ONLY: self._send_start,
            _OP_SEND_MIDDLE: self._send_continue, _OP_SEND_LAST: self._send_continue,
        }
        # counters
        self.packets_received = 0     # data packets for this QP, any PSN
        self.payload_bytes_received = 0   # message bytes accepted in order
        self.duplicates = 0
        self.ooo_drops = 0            # PSN > expected: dropped (the first one is NAKed)
        self.seq_naks_sent = 0
        self.fatal_naks_sent = 0
        self.rnr_naks_sent = 0
        self.acks_sent = 0
        self.error_drops = 0          # packets dropped in the error state
        self.ce_packets_received = 0
        self.cnps_sent = 0
        self.write_messages = 0       # RDMA WRITEs, with immediate or not
        self.write_imm_messages = 0   # of which WRITEs with immediate (each took a WQE)
        self.send_messages = 0

    @property
    def expected_psn(self) -> int:
        return self._epsn

    def post_recv(self, wr_id: int, buf: BytesLike | None = None) -> None:
        """Post a receive WQE for one incoming SEND (into `buf`) or WRITE with immediate
        (which leaves `buf` alone: post it without one)."""
        if buf is None:
            view = _NO_BUFFER
        else:
            view = _as_bytes_view(buf)
            if view.readonly:
                raise ValueError("a receive buffer must be writable")
        self._rq.append((wr_id, view))

    @property
    def posted_receives(self) -> int:
        return len(self._rq)

    def on_request(self, p: Parsed, ce: bool, now_ns: float | None = None) -> None:
        """A data packet (SEND / RDMA WRITE) for this QP."""
        self._count_arrival(ce, now_ns)
        if self.state != QpState.RTS:
            self.error_drops += 1
            return
        bth = p.bth
        psn = bth.psn
        if psn != self._epsn:
            self._out_of_sequence(psn, bth.ack_req)
            return
        self._nak_sent = False
        self._dup_run = False
        op = bth.opcode
        place = self._placers.get(op)
        if place is None or len(p.payload) > self._mtu:
            self._fatal(psn, _SYN_NAK_INVALID, "invalid_request")
            return
        if place(op, p):
            self._accept(op, psn, len(p.payload), bth.ack_req)

    def fast_hint(self, peer: tuple[str, int]) -> tuple | None:
        """What the fast path's receive (agents.fast RxBatch.recv `hot`) needs to take this
        responder's in-order WRITE MIDDLE packets from `peer` itself, or None when it may
        not: not in RTS, no WRITE in progress, a region that keeps no bytes (a sink), or a
        notification point other than DcqcnNp (its per-packet call is not known to be a
        count). `on_fast_run` then applies what C did."""
        view = self._wr_view
        np_ = self.np
        if (self.state != QpState.RTS or view is None or type(view) is not memoryview
                or not (np_ is None or type(np_) is DcqcnNp)):
            return None
        return (self.qpn, peer[0], peer[1], self._epsn, self._mtu, self._ack_every,
                self._since_ack, view, self._wr_off, self._wr_left)

    def on_fast_run(self, count: int, payload_bytes: int, ack: bool = False) -> None:
        """`count` in-order WRITE MIDDLE packets of `payload_bytes` in all, placed by the
        fast path (see `fast_hint`): the state and counters `on_request` would leave. None
        was CE-marked; only the last may be due an ACK (`ack`: AckReq, or `ack_every`
        packets since the last ACK; C checked), which is sent here as `_accept` would."""
        self.packets_received += count
        if self.np is not None:
            self.np.on_unmarked_packets(count)
        self._nak_sent = False
        self._dup_run = False
        self._wr_off += payload_bytes
        self._wr_left -= payload_bytes
        self.payload_bytes_received += payload_bytes
        self._epsn = (self._epsn + count) & PSN_MASK
        self._since_ack += count
        if ack:
            self._send_ack()

    # -- receiving, step by step

    def _count_arrival(self, ce: bool, now_ns: float | None) -> None:
        """Every data packet counts, and is shown to the notification point (in any state:
        a CE mark is congestion whatever becomes of the packet)."""
        self.packets_received += 1
        if ce:
            self.ce_packets_received += 1
        np_ = self.np
        if np_ is not None and np_.on_packet(ce, _now(self.clock, now_ns) if ce else 0.0):
            self._send_cnp()

    def _out_of_sequence(self, psn: int, ack_req: bool) -> None:
        """A PSN other than the expected one: NAK the first packet ahead of it (then drop
        silently until it comes), re-ACK a duplicate (the first of a run, and any AckReq)."""
        if ((psn - self._epsn) & PSN_MASK) < PSN_HALF:      # ahead of the expected PSN
            self.ooo_drops += 1
            if not self._nak_sent:
                self._nak_sent = True
                self.seq_naks_sent += 1
                self._send_aeth(self._epsn, _SYN_NAK_SEQ)
            return
        self.duplicates += 1                                # behind: already done
        if ack_req or not self._dup_run:
            self._dup_run = True
            self._send_ack()

    # Placers: put an in-order packet's payload where its message goes. Each returns True
    # when it did, False when it answered the packet instead (fatal NAK, RNR NAK).

    def _write_start(self, op: int, p: Parsed) -> bool:
        """RDMA WRITE FIRST / ONLY [WITH IMMEDIATE]: check the RETH against the memory
        region (and, where the message needs one, for a receive WQE), write."""
        reth = p.reth
        if self._wr_view is not None or self._rv is not None or reth is None:
            self._fatal(p.bth.psn, _SYN_NAK_INVALID, "invalid_request")
            return False
        payload = p.payload
        n = len(payload)
        va, rkey, dma_len = reth
        if (n != self._mtu or dma_len <= n) if op == _OP_WRITE_FIRST else n != dma_len:
            self._fatal(p.bth.psn, _SYN_NAK_INVALID, "invalid_request")
            return False
        with_imm = op == _OP_WRITE_ONLY_IMM
        if dma_len:
            mr = self.mrs.get(rkey)
            if (mr is None or not mr.remote_write or va < mr.va
                    or va + dma_len > mr.va + mr.length):
                self._fatal(p.bth.psn, _SYN_NAK_ACCESS, "remote_access_error")
                return False
            if (with_imm or mr.writes_need_recv) and not self._rq:
                self._rnr(p.bth.psn)            # before a byte of it lands
                return False
            off = va - mr.va
            mr.view[off:off + n] = payload
            if op == _OP_WRITE_FIRST:
                self._wr_view = mr.view
                self._wr_off = off + n
                self._wr_left = dma_len - n
                self._wr_len = dma_len
                return True
        elif with_imm and not self._rq:
            self._rnr(p.bth.psn)
            return False
        if with_imm:
            self._complete_imm(p.imm, n)
        return True

    def _write_continue(self, op: int, p: Parsed) -> bool:
        """RDMA WRITE MIDDLE / LAST [WITH IMMEDIATE]: the next bytes of the WRITE in
        progress (a LAST WITH IMMEDIATE first needs a receive WQE: RNR NAK without)."""
        payload = p.payload
        n = len(payload)
        view = self._wr_view
        left = self._wr_left
        # a MIDDLE carries exactly the MTU and leaves some; a LAST carries what is left
        if view is None or ((n != self._mtu or n >= left) if op == _OP_WRITE_MIDDLE
                            else n != left):
            self._fatal(p.bth.psn, _SYN_NAK_INVALID, "invalid_request")
            return False
        if op == _OP_WRITE_LAST_IMM and not self._rq:
            self._rnr(p.bth.psn)            # the WRITE stays in progress, this PSN expected
            return False
        off = self._wr_off
        view[off:off + n] = payload
        if op == _OP_WRITE_MIDDLE:
            self._wr_off = off + n
            self._wr_left = left - n
            return True
        self._wr_view = None
        self._wr_left = 0
        if op == _OP_WRITE_LAST_IMM:
            self._complete_imm(p.imm, self._wr_len)
        return True

    def _complete_imm(self, imm: int | None, byte_len: int) -> None:
        """A WRITE with immediate has landed: it consumes the next receive WQE."""
        wr_id, _buf = self._rq.popleft()
        self.completions.append(Completion(wr_id, WcStatus.SUCCESS, WC_RECV_RDMA_WITH_IMM,
                                           byte_len, imm))
        self.write_imm_messages += 1

    def _send_start(self, op: int, p: Parsed) -> bool:
        """SEND FIRST / ONLY: into the next posted receive buffer (none: RNR NAK)."""
        payload = p.payload
        n = len(payload)
        psn = p.bth.psn
        if self._wr_view is not None or self._rv is not None or (
                op == _OP_SEND_FIRST and n != self._mtu):
            self._fatal(psn, _SYN_NAK_INVALID, "invalid_request")
            return False
        if not self._rq:
            self._rnr(psn)
            return False
        wr_id, buf = self._rq[0]
        if n > buf.nbytes:
            self._fatal(psn, _SYN_NAK_INVALID, "local_length_error")
            return False
        self._rq.popleft()
        buf[:n] = payload
        if op == _OP_SEND_FIRST:
            self._rv = (wr_id, buf)
            self._rv_off = n
        else:
            self.completions.append(Completion(wr_id, WcStatus.SUCCESS, WC_RECV, n))
            self.send_messages += 1
        return True

    def _send_continue(self, op: int, p: Parsed) -> bool:
        """SEND MIDDLE / LAST: the next bytes of the SEND in progress."""
        payload = p.payload
        n = len(payload)
        psn = p.bth.psn
        if self._rv is None or (op == _OP_SEND_MIDDLE and n != self._mtu):
            self._fatal(psn, _SYN_NAK_INVALID, "invalid_request")
            return False
        wr_id, buf = self._rv
        off = self._rv_off
        if off + n > buf.nbytes:
            self._fatal(psn, _SYN_NAK_INVALID, "local_length_error")
            return False
        buf[off:off + n] = payload
        self._rv_off = off + n
        if op == _OP_SEND_LAST:
            self.completions.append(Completion(wr_id, WcStatus.SUCCESS, WC_RECV, off + n))
            self.send_messages += 1
            self._rv = None
        return True

    def _accept(self, op: int, psn: int, n: int, ack_req: bool) -> None:
        """The packet is placed: expect the next PSN, end the message, ACK when due."""
        self.payload_bytes_received += n
        self._epsn = (psn + 1) & PSN_MASK
        self._since_ack += 1
        end = op in _MESSAGE_END
        if end:
            self.msn = (self.msn + 1) & 0xFFFFFF
            if op in _WRITE_END:
                self.write_messages += 1
        if end or ack_req or self._since_ack >= self._ack_every:
            self._send_ack()

    # -- output

    def _send_ack(self) -> None:
        self._since_ack = 0
        self.acks_sent += 1
        self._send_aeth((self._epsn - 1) & PSN_MASK, _SYN_ACK)

    def _send_aeth(self, psn: int, syndrome: int) -> None:
        view = build_packet(self._ctl, self.ctx,
                            Bth(_OP_ACK, False, False, 0, 0, self.attrs.p_key, False, False,
                                self.dest_qpn, False, psn),
                            None, Aeth(syndrome, self.msn))
        if self.tx is not None:
            self.tx(view, PKT_ACK)

    def _rnr(self, psn: int) -> None:
        """Receiver not ready (no receive WQE): RNR NAK this PSN, which stays the expected
        one; later packets are dropped silently until it comes again."""
        self.rnr_naks_sent += 1
        self._nak_sent = True
        self._send_aeth(psn, 0x20 | self.attrs.min_rnr_timer)

    def _send_cnp(self) -> None:
        self.cnps_sent += 1
        view = build_cnp(self._ctl, self.ctx, self.dest_qpn, p_key=self.attrs.p_key)
        if self.tx is not None:
            self.tx(view, PKT_CNP)

    def _fatal(self, psn: int, syndrome: int, error: str) -> None:
        """NAK a request that can never succeed; an RC responder then enters the error state."""
        self.fatal_naks_sent += 1
        self._send_aeth(psn, syndrome)
        self.state = QpState.ERROR
        self.error = error

    def counters(self) -> dict:
        return {
            "state": self.state,
            "error": self.error,
            "packets_received": self.packets_received,
            "payload_bytes_received": self.payload_bytes_received,
            "duplicates": self.duplicates,
            "ooo_drops": self.ooo_drops,
            "naks_sent": self.seq_naks_sent,
            "fatal_naks_sent": self.fatal_naks_sent,
            "rnr_naks_sent": self.rnr_naks_sent,
            "acks_sent": self.acks_sent,
            "error_drops": self.error_drops,
            "ce_packets_received": self.ce_packets_received,
            "cnps_sent": self.cnps_sent,
            "write_messages": self.write_messages,
            "write_imm_messages": self.write_imm_messages,
            "send_messages": self.send_messages,
            "expected_psn": self._epsn,
            "msn": self.msn,
        }


# --------------------------------------------------------------------------- the QP

class RcQp:
    """An RC queue pair: a requester and a responder sharing a QPN and a peer.

    `ctx` is the ICRC context of the datagrams this QP SENDS (local -> peer); the
    caller checks received packets with the reverse one. `sq_psn` is the first PSN
    this side sends, `rq_psn` the first PSN it expects (the peer's sq_psn).
    """

    def __init__(self, qpn: int, dest_qpn: int, ctx: IcrcContext, attrs: QpAttrs,
                 cc: RateController, *, np: DcqcnNp | None = None,
                 mrs: dict[int, MemoryRegion] | None = None,
                 tx: Callable[[memoryview, int], None] | None = None,
                 clock: Clock | None = None, sq_psn: int = 0, rq_psn: int = 0) -> None:
        self.qpn = qpn
        self.dest_qpn = dest_qpn
        self.attrs = attrs
        self.clock = clock
        self.requester = RcRequester(qpn, dest_qpn, ctx, attrs, cc, psn=sq_psn, clock=clock)
        self.responder = RcResponder(qpn, dest_qpn, ctx, attrs, psn=rq_psn, np=np, mrs=mrs,
                                     tx=tx, clock=clock)
        self.packets_received = 0
        self.bytes_received = 0
        self.ce_packets_received = 0

    @property
    def tx(self) -> Callable[[memoryview, int], None] | None:
        """Where the responder pushes ACK / NAK / CNP packets: fn(view, kind)."""
        return self.responder.tx

    @tx.setter
    def tx(self, fn: Callable[[memoryview, int], None] | None) -> None:
        self.responder.tx = fn

    @property
    def cc(self) -> RateController:
        return self.requester.cc

    def on_packet(self, p: Parsed, ce: bool = False, now_ns: float | None = None,
                  nbytes: int | None = None) -> None:
        """Dispatch a parsed packet addressed to this QP (`nbytes`: its UDP payload size)."""
        self.packets_received += 1
        self.bytes_received += nbytes if nbytes is not None else (
            p.payload.nbytes + BTH_BYTES + ICRC_BYTES)
        if ce:
            self.ce_packets_received += 1
        op = p.bth.opcode
        if op == _OP_ACK:
            if p.aeth is not None:          # parse_packet gives every ACKNOWLEDGE its AETH
                self.requester.on_ack(p.bth, p.aeth, now_ns)
        elif op in CNP_OPCODES:
            self.requester.on_cnp(now_ns)
        else:
            self.responder.on_request(p, ce, now_ns)

    def on_fast_run(self, count: int, udp_bytes: int, payload_bytes: int,
                    ack: bool = False) -> None:
        """`count` data packets (`udp_bytes` of UDP payload) the fast path placed for the
        responder (RcResponder.fast_hint): what `on_packet` counts, then the responder."""
        self.packets_received += count
        self.bytes_received += udp_bytes
        self.responder.on_fast_run(count, payload_bytes, ack)

    def counters(self) -> dict:
        """Requester and responder counters, plus the rate controller's Rc / Rt."""
        cc = self.requester.cc
        snap = cc.snapshot()
        rq = self.requester.counters()
        rs = self.responder.counters()
        return {
            "qpn": self.qpn,
            "dest_qpn": self.dest_qpn,
            "state": QpState.ERROR if QpState.ERROR in (rq["state"], rs["state"]) else
            QpState.RTS,
            "requester": rq,
            "responder": rs,
            "packets_sent": rq["packets_sent"] + rs["acks_sent"] + rs["naks_sent"]
            + rs["fatal_naks_sent"] + rs["rnr_naks_sent"] + rs["cnps_sent"],
            "packets_received": self.packets_received,
            "bytes_received": self.bytes_received,
            "ce_packets_received": self.ce_packets_received,
            "cc": snap.get("kind"),
            "rc_bps": snap.get("rc_bps", snap.get("rate_bps")),
            "rt_bps": snap.get("rt_bps", snap.get("rate_bps")),
            "alpha": snap.get("alpha"),
        }
