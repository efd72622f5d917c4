"""In-network aggregation (INA) packets: the header workers and aggregators speak over UDP.

One datagram carries one chunk of one job's all-reduce: a fixed 32-byte header, then
`elements` int32 elements, all in network byte order (big-endian)::

    offset size  field      meaning
    0      2     magic      0x494E ("IN"); anything else is not an INA packet
    2      1     version    1
    3      1     type       1 REQUEST (worker -> aggregator: a contribution)
                            2 RESULT  (aggregator -> worker, or parent -> child: the sum)
                            3 PARTIAL (leaf aggregator -> its parent: a partial sum)
    4      4     job        job id (u32): which job's pool the chunk belongs to
    8      4     chunk      chunk number (u32) in the job's stream, counting up for the
                            job's lifetime; slot == chunk % slots, gen == (chunk // slots) & 1
    12     2     slot       slot (u16) of the job's pool the chunk aggregates in
    14     1     flags      bit 0: gen, the shadow-copy generation of the slot (SwitchML's
                            pool version: even / odd copy); bits 1..7 must be 0
    15     1     reserved   must be 0
    16     2     sender     u16: REQUEST the worker id, PARTIAL the sending aggregator's id
                            in its parent's children; RESULT always 0xFFFF (AGGREGATOR)
    18     2     elements   int32 elements that follow (u16); 0 is allowed (an
                            exponent-only chunk); the aggregator bounds it by the job's
                            slot_elements
    20     2     exponent   i16: element i stands for value[i] * 2**exponent; every
                            contributor of a chunk uses the same one (int32 data: 0)
    22     2     next_exp   i16: REQUEST the worker's exponent proposal for a later chunk,
                            PARTIAL / RESULT the maximum over the contributors
                            (EXP_NONE = -32768: no proposal, e.g. an all-zero chunk)
    24     8     bitmap     u64 contributor bitmap: REQUEST 0; PARTIAL / RESULT bit i set
                            when contributor i (members first, then children, in the
                            order of the sender's job config) is in the sum; never 0
    32     4*n   payload    n = elements int32 values, two's complement, big-endian

`build` and `parse` are pure functions. `parse` never raises anything but
`MalformedPacket`, whose `reason` (a `MalformedReason`) is what a receiver counts;
checks that need a job's configuration (unknown job, slot out of range, more elements
than slot_elements, a non-member sender) are the receiver's. The protocol around the header
(who sends what when, the shadow copies, the exponents) is docs/ina.md's.
"""

from __future__ import annotations

import struct
from enum import IntEnum
from typing import NamedTuple

import numpy as np

from agents.wire import BytesLike

__all__ = [
    "AGGREGATOR",
    "DEFAULT_SLOTS",
    "DEFAULT_SLOT_ELEMENTS",
    "EXP_NONE",
    "HEADER",
    "HEADER_BYTES",
    "INA_UDP_PORT",
    "MAGIC",
    "MAX_CONTRIBUTORS",
    "MAX_ELEMENTS",
    "VERSION",
    "Header",
    "MalformedPacket",
    "MalformedReason",
    "Packet",
    "PacketType",
    "build",
    "gen_of",
    "parse",
    "slot_of",
]

#: The aggregator's default UDP port: outside the UDP workload's 20000-29999 and RoCE's
#: 4791 + n / 18515 + n.
INA_UDP_PORT = 48000
#: A job's pool when nothing else is said: 32 slots x 2048 elements (8 KiB + 32 bytes of
#: header, one jumbo frame) keeps 256 KiB per worker in flight, more than a 100 Gb/s
#: link's round trip holds. Workers and the aggregator's --jobs must agree.
DEFAULT_SLOTS = 32
DEFAULT_SLOT_ELEMENTS = 2048
MAGIC = 0x494E
VERSION = 1
HEADER = struct.Struct("!HBBIIHBBHHhhQ")
HEADER_BYTES = HEADER.size                      # 32
#: The `sender` of every RESULT; REQUEST and PARTIAL senders are 0 .. 0xFFFE.
AGGREGATOR = 0xFFFF
#: `next_exp` when a contributor has nothing to propose (its chunk is all zero, or there
#: is no later chunk): the maximum over contributors ignores it.
EXP_NONE = -32768
#: Bits of the contributor bitmap: one aggregator sums at most this many contributors.
MAX_CONTRIBUTORS = 64
#: Most elements one datagram can carry (IPv4 UDP payload 65507 bytes).
MAX_ELEMENTS = (65507 - HEADER_BYTES) // 4
_BE_INT32 = np.dtype(">i4")
_GEN_BIT = 0x01


class PacketType(IntEnum):
    REQUEST = 1     # worker -> aggregator: its contribution to a chunk
    RESULT = 2      # aggregator -> worker (or parent -> child): the chunk's sum
    PARTIAL = 3     # leaf aggregator -> parent: the sum over its own contributors


class MalformedReason(IntEnum):
    """Why `parse` rejects a datagram; a receiver keeps one counter per reason."""

    TOO_SHORT = 1       # shorter than the 32-byte header
    BAD_MAGIC = 2       # not 0x494E: not an INA packet at all
    BAD_VERSION = 3     # a version this code does not speak
    UNKNOWN_TYPE = 4    # type is not REQUEST, RESULT or PARTIAL
    RESERVED_BITS = 5   # flags bits 1..7 or the reserved byte are not zero
    BAD_LENGTH = 6      # the payload is not exactly elements * 4 bytes
    BAD_SENDER = 7      # a RESULT whose sender is not 0xFFFF, or another type's that is
    BAD_BITMAP = 8      # a REQUEST with a bitmap, or a PARTIAL / RESULT without one


class MalformedPacket(Exception):
    """A datagram `parse` rejects; `reason` is a MalformedReason."""

    def __init__(self, reason: MalformedReason, detail: str = "") -> None:
        super().__init__(f"{reason.name}: {detail}" if detail else reason.name)
        self.reason = reason
        self.detail = detail


class Header(NamedTuple):
    """An INA header; `elements` is implied by the payload when building."""

    type: PacketType
    job: int
    chunk: int
    slot: int
    gen: int                # 0 or 1
    sender: int
    exponent: int = 0
    next_exp: int = EXP_NONE
    bitmap: int = 0
    elements: int = 0


class Packet(NamedTuple):
    """A parsed packet: the header and its elements, a big-endian int32 view into the
    datagram (no copy: consume it before a receive buffer it views is reused)."""

    header: Header
    values: np.ndarray


def slot_of(chunk: int, slots: int) -> int:
    """The slot chunk number `chunk` aggregates in, in a pool of `slots`."""
    return chunk % slots


def gen_of(chunk: int, slots: int) -> int:
    """The shadow-copy generation of chunk number `chunk`: even / odd pass over the pool."""
    return (chunk // slots) & 1


def _check_header(h: Header, count: int) -> None:
    if not 0 <= h.job <= 0xFFFFFFFF or not 0 <= h.chunk <= 0xFFFFFFFF:
        raise ValueError(f"job {h.job} / chunk {h.chunk} is not a u32")
    if not 0 <= h.slot <= 0xFFFF:
        raise ValueError(f"slot {h.slot} is not a u16")
    if h.gen not in (0, 1):
        raise ValueError(f"gen must be 0 or 1, got {h.gen}")
    if (h.sender == AGGREGATOR) != (h.type == PacketType.RESULT) or not 0 <= h.sender <= 0xFFFF:
        raise ValueError(f"sender {h.sender:#x} does not fit a {PacketType(h.type).name}")
    if not -32768 <= h.exponent <= 32767 or not -32768 <= h.next_exp <= 32767:
        raise ValueError(f"exponents {h.exponent} / {h.next_exp} are not i16")
    if not 0 <= h.bitmap < 1 << MAX_CONTRIBUTORS:
        raise ValueError(f"bitmap {h.bitmap:#x} is not a u64")
    if (h.bitmap == 0) != (h.type == PacketType.REQUEST):
        raise ValueError(f"a {PacketType(h.type).name} "
                         f"{'carries no' if h.type == PacketType.REQUEST else 'needs a'} bitmap")
    if not 0 <= count <= MAX_ELEMENTS:
        raise ValueError(f"{count} elements do not fit one datagram (<= {MAX_ELEMENTS})")


def build(h: Header, values: np.ndarray | BytesLike = b"") -> bytes:
    """The datagram for header `h` and `values`: int32 elements as a numpy array (any
    byte order; written big-endian), or bytes already in wire order (big-endian int32).

    `h.elements` is ignored: the element count is the payload's. Raises ValueError for a
    header no receiver would accept (a sender's bug, not a network event).
    """
    if isinstance(values, np.ndarray):
        if values.dtype.kind != "i" or values.dtype.itemsize != 4:
            raise ValueError(f"payload must be int32, got {values.dtype}")
        payload = values.astype(_BE_INT32, copy=False).tobytes()
    else:
        payload = bytes(values)
        if len(payload) % 4:
            raise ValueError(f"a {len(payload)}-byte payload is not whole int32 elements")
    count = len(payload) // 4
    _check_header(h, count)
    head = HEADER.pack(MAGIC, VERSION, int(h.type), h.job, h.chunk, h.slot,
                       _GEN_BIT if h.gen else 0, 0, h.sender, count, h.exponent, h.next_exp,
                       h.bitmap)
    return head + payload


def parse(data: BytesLike) -> Packet:
    """Parse one datagram; every defect is a MalformedPacket with its reason."""
    if len(data) < HEADER_BYTES:
        raise MalformedPacket(MalformedReason.TOO_SHORT, f"{len(data)} bytes")
    (magic, version, ptype, job, chunk, slot, flags, reserved, sender, count, exponent,
     next_exp, bitmap) = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise MalformedPacket(MalformedReason.BAD_MAGIC, f"{magic:#06x}")
    if version != VERSION:
        raise MalformedPacket(MalformedReason.BAD_VERSION, str(version))
    if ptype not in _TYPES:
        raise MalformedPacket(MalformedReason.UNKNOWN_TYPE, str(ptype))
    if flags & ~_GEN_BIT or reserved:
        raise MalformedPacket(MalformedReason.RESERVED_BITS, f"flags {flags:#04x}, "
                                                             f"reserved {reserved:#04x}")
    if len(data) != HEADER_BYTES + 4 * count:
        raise MalformedPacket(MalformedReason.BAD_LENGTH,
                              f"{len(data) - HEADER_BYTES} payload bytes for {count} elements")
    kind = _TYPES[ptype]
    if (sender == AGGREGATOR) != (kind == PacketType.RESULT):
        raise MalformedPacket(MalformedReason.BAD_SENDER, f"{kind.name} from {sender:#x}")
    if (bitmap == 0) != (kind == PacketType.REQUEST):
        raise MalformedPacket(MalformedReason.BAD_BITMAP, f"{kind.name} bitmap {bitmap:#x}")
    values = np.frombuffer(data, dtype=_BE_INT32, count=count, offset=HEADER_BYTES)
    return Packet(Header(kind, job, chunk, slot, flags & _GEN_BIT, sender, exponent, next_exp,
                         bitmap, count), values)


_TYPES = {int(t): t for t in PacketType}
