"""RoCEv2 wire formats: BTH, RETH, AETH, CNP, PSN arithmetic, packet build and parse.

Layout (InfiniBand Architecture Specification Vol. 1, chapter 9: BTH, RETH,
AETH; IBTA Annex A17, RoCEv2: the IB transport over UDP destination port 4791,
and the CNP), all big-endian except the ICRC::

    UDP payload = BTH (12) [+ RETH (16)] [+ ImmDt (4)] [| AETH (4) | CNP reserved (16)]
                  + payload + pad + ICRC (4)

    BTH   opcode(8) | SE(1) M(1) PadCnt(2) TVer(4) | P_Key(16)
          | FECN(1) BECN(1) resv(6) DestQP(24) | AckReq(1) resv(7) PSN(24)
    RETH  VA(64) R_Key(32) DMA length(32)          on RDMA_WRITE_FIRST / _ONLY / _ONLY_WITH_IMM.
    ImmDt immediate data(32)                       on RDMA_WRITE_LAST_WITH_IMMEDIATE (0x09) and
                                                   _ONLY_WITH_IMMEDIATE (0x0B), after the RETH
    AETH  syndrome(8) MSN(24)                      on ACKNOWLEDGE
    CNP   opcode 0x81, BECN=1, 16 reserved zero bytes

A WRITE with immediate of more than one packet is RDMA_WRITE_FIRST (RETH), _MIDDLE...,
then RDMA_WRITE_LAST_WITH_IMMEDIATE (ImmDt): its first packets are those of a plain
WRITE. The immediate is 32 bits, carried big-endian (verbs hand it over as a __be32);
here it is an unsigned int.

This module is the per-packet hot path of the user-space RoCE transport, so it
uses only `struct` and `zlib` on preallocated buffers; scapy appears in the
tests alone. Typical use::

    ctx = icrc_context(my_ip, peer_ip, my_sport, ROCE_UDP_PORT)   # once per QP
    buf = bytearray(9000)                                         # once per QP
    pkt = build_packet(buf, ctx, Bth(Opcode.RC_SEND_ONLY, dest_qp=qpn, psn=psn,
                                     ack_req=True), payload=data)
    sock.sendto(pkt, (peer_ip, ROCE_UDP_PORT))   # unconnected socket, DF set

    data, (src, sport) = sock.recvfrom(65535)
    try:
        p = parse_packet(data, icrc_context(src, my_ip, sport, ROCE_UDP_PORT))
    except MalformedPacket as e:
        counters[e.reason] += 1                  # never any other exception

The payload is padded to a multiple of 4 bytes and PadCnt set by the builder;
`Parsed.payload` excludes the pad. The sending socket must be UNCONNECTED with
IP_MTU_DISCOVER = IP_PMTUDISC_DO so Linux sends IPv4 ID 0, which the ICRC
covers (see `agents.wire.icrc`).
"""

from __future__ import annotations

import struct
from enum import IntEnum
from typing import NamedTuple

from agents.wire import BytesLike
from agents.wire.icrc import (
    ICRC_BYTES,
    IP_MTU_DISCOVER,
    IP_PMTUDISC_DO,
    ROCE_UDP_PORT,
    IcrcContext,
    icrc_bytes,
    icrc_context,
    icrc_for_udp_payload,
)

__all__ = [
    "AETH_BYTES",
    "BTH_BYTES",
    "CNP_OPCODE",
    "CNP_OPCODES",
    "CNP_RESERVED_BYTES",
    "DEFAULT_P_KEY",
    "ICRC_BYTES",
    "IMMDT_BYTES",
    "IP_MTU_DISCOVER",
    "IP_PMTUDISC_DO",
    "MIN_PACKET_BYTES",
    "OPCODES",
    "PSN_HALF",
    "PSN_MASK",
    "QPN_MASK",
    "RETH_BYTES",
    "ROCE_UDP_PORT",
    "UC_OFFSET",
    "UNLIMITED_CREDITS",
    "Aeth",
    "AethKind",
    "Bth",
    "IcrcContext",
    "MalformedPacket",
    "MalformedReason",
    "NakCode",
    "Opcode",
    "OpcodeInfo",
    "Parsed",
    "Reth",
    "ack_syndrome",
    "aeth_ack",
    "aeth_nak",
    "aeth_rnr_nak",
    "build_cnp",
    "build_packet",
    "decode_syndrome",
    "encode_packet",
    "icrc_bytes",
    "icrc_context",
    "icrc_for_udp_payload",
    "nak_syndrome",
    "opcode_info",
    "pack_aeth",
    "pack_bth",
    "pack_reth",
    "parse_datagram",
    "parse_packet",
    "psn_add",
    "psn_diff",
    "psn_ge",
    "psn_gt",
    "psn_le",
    "psn_lt",
    "psn_sub",
    "rnr_nak_syndrome",
    "unpack_aeth",
    "unpack_bth",
    "unpack_reth",
]

BTH_BYTES = 12
RETH_BYTES = 16
IMMDT_BYTES = 4
AETH_BYTES = 4
CNP_RESERVED_BYTES = 16
MIN_PACKET_BYTES = BTH_BYTES + ICRC_BYTES
DEFAULT_P_KEY = 0xFFFF
QPN_MASK = 0xFFFFFF
PSN_MASK = 0xFFFFFF
PSN_HALF = 1 << 23
UNLIMITED_CREDITS = 0x1F
UC_OFFSET = 0x20
# CNP: 0x81 per IBTA annex A17, scapy and NICs (the default for building);
# Linux's ib_pack.h names 0x80 for the same thing. Both parse as a CNP.
CNP_OPCODE = 0x81
CNP_OPCODES = frozenset({0x80, 0x81})

_BTH = struct.Struct("!BBHII")      # opcode, SE|M|PadCnt|TVer, P_Key, FECN|BECN|DestQP, AckReq|PSN
_RETH = struct.Struct("!QII")
_AETH = struct.Struct("!I")
_IMMDT = struct.Struct("!I")
_ICRC = struct.Struct("<I")
_ZEROS = bytes(CNP_RESERVED_BYTES)
_tuple_new = tuple.__new__


# --------------------------------------------------------------------------- opcodes

class Opcode(IntEnum):
    """BTH opcodes the transport speaks. Names match scapy.contrib.roce's."""

    RC_SEND_FIRST = 0x00
    RC_SEND_MIDDLE = 0x01
    RC_SEND_LAST = 0x02
    RC_SEND_ONLY = 0x04
    RC_RDMA_WRITE_FIRST = 0x06
    RC_RDMA_WRITE_MIDDLE = 0x07
    RC_RDMA_WRITE_LAST = 0x08
    RC_RDMA_WRITE_LAST_WITH_IMMEDIATE = 0x09
    RC_RDMA_WRITE_ONLY = 0x0A
    RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE = 0x0B
    RC_ACKNOWLEDGE = 0x11
    UC_SEND_FIRST = 0x20
    UC_SEND_MIDDLE = 0x21
    UC_SEND_LAST = 0x22
    UC_SEND_ONLY = 0x24
    UC_RDMA_WRITE_FIRST = 0x26
    UC_RDMA_WRITE_MIDDLE = 0x27
    UC_RDMA_WRITE_LAST = 0x28
    UC_RDMA_WRITE_LAST_WITH_IMMEDIATE = 0x29
    UC_RDMA_WRITE_ONLY = 0x2A
    UC_RDMA_WRITE_ONLY_WITH_IMMEDIATE = 0x2B
    CNP = 0x81


class OpcodeInfo(NamedTuple):
    """What follows the BTH for one opcode."""

    opcode: int
    name: str
    reth: bool              # RETH follows the BTH (RDMA WRITE FIRST / ONLY [WITH IMMEDIATE])
    imm: bool               # ImmDt follows the BTH [+ RETH] (WRITE LAST / ONLY WITH IMMEDIATE)
    aeth: bool              # AETH follows the BTH (ACKNOWLEDGE)
    cnp: bool               # 16 reserved bytes follow the BTH, nothing else
    payload: bool           # carries a payload (possibly empty on ONLY / LAST)
    pad: bool               # PadCnt may be non-zero (ONLY / LAST: the end of a message)
    header_bytes: int       # BTH + extension headers (+ CNP reserved bytes)


def _info(opcode: int, name: str) -> OpcodeInfo:
    op = opcode & 0x1F
    reth = op in (0x06, 0x0A, 0x0B)
    imm = op in (0x09, 0x0B)
    aeth = op == 0x11
    cnp = opcode in CNP_OPCODES
    payload = not (aeth or cnp)
    pad = payload and op in (0x02, 0x04, 0x08, 0x09, 0x0A, 0x0B)
    ext = (RETH_BYTES if reth else 0) + (IMMDT_BYTES if imm else 0) + (
        AETH_BYTES if aeth else CNP_RESERVED_BYTES if cnp else 0)
    return OpcodeInfo(opcode, name, reth, imm, aeth, cnp, payload, pad, BTH_BYTES + ext)


OPCODES: dict[int, OpcodeInfo] = {int(o): _info(int(o), o.name) for o in Opcode}
OPCODES[0x80] = _info(0x80, "CNP")
_INFO: list[OpcodeInfo | None] = [OPCODES.get(i) for i in range(256)]


def opcode_info(opcode: int) -> OpcodeInfo | None:
    """Layout of `opcode`, or None for an opcode this transport does not speak."""
    return _INFO[opcode] if 0 <= opcode <= 0xFF else None


# --------------------------------------------------------------------------- headers

class Bth(NamedTuple):
    """Base Transport Header. Flags are bools; PadCnt is set by the builder."""

    opcode: int
    se: bool = False
    m: bool = False
    pad_count: int = 0
    tver: int = 0
    p_key: int = DEFAULT_P_KEY
    fecn: bool = False
    becn: bool = False
    dest_qp: int = 0
    ack_req: bool = False
    psn: int = 0


class Reth(NamedTuple):
    """RDMA Extended Transport Header."""

    va: int
    r_key: int
    dma_length: int


class AethKind(IntEnum):
    """Syndrome bits 6..5 (bit 7 set, or 0b10, is reserved)."""

    ACK = 0
    RNR_NAK = 1
    RESERVED = 2
    NAK = 3


class NakCode(IntEnum):
    """Low 5 bits of a NAK syndrome (syndrome = 0x60 | code)."""

    PSN_SEQUENCE_ERROR = 0x00
    INVALID_REQUEST = 0x01
    REMOTE_ACCESS_ERROR = 0x02
    REMOTE_OPERATIONAL_ERROR = 0x03


def ack_syndrome(credits: int = UNLIMITED_CREDITS) -> int:
    """ACK syndrome: 0b000 + 5-bit credit count (0x1F = unlimited / invalid credits)."""
    if not 0 <= credits <= 0x1F:
        raise ValueError(f"credit count {credits} is not 5 bits")
    return credits


def rnr_nak_syndrome(timer: int) -> int:
    """RNR NAK syndrome: 0b001 + 5-bit RNR timer code."""
    if not 0 <= timer <= 0x1F:
        raise ValueError(f"RNR timer code {timer} is not 5 bits")
    return 0x20 | timer


def nak_syndrome(code: int) -> int:
    """NAK syndrome: 0b011 + code; 0x60 PSN seq error, 0x61 invalid request,
    0x62 remote access error, 0x63 remote operational error."""
    if not 0 <= code <= 0x1F:
        raise ValueError(f"NAK code {code} is not 5 bits")
    return 0x60 | code


def decode_syndrome(syndrome: int) -> tuple[AethKind, int]:
    """(kind, value): credits for ACK, timer code for RNR NAK, NAK code for NAK.

    A reserved syndrome (bit 7 set or type 0b10) gives (RESERVED, syndrome).
    """
    if syndrome & 0x80 or (syndrome >> 5) == 2:
        return AethKind.RESERVED, syndrome
    return AethKind(syndrome >> 5), syndrome & 0x1F


class Aeth(NamedTuple):
    """ACK Extended Transport Header."""

    syndrome: int
    msn: int

    @property
    def kind(self) -> AethKind:
        return decode_syndrome(self.syndrome)[0]

    @property
    def value(self) -> int:
        return decode_syndrome(self.syndrome)[1]


def aeth_ack(msn: int, credits: int = UNLIMITED_CREDITS) -> Aeth:
    return Aeth(ack_syndrome(credits), msn)


def aeth_rnr_nak(msn: int, timer: int) -> Aeth:
    return Aeth(rnr_nak_syndrome(timer), msn)


def aeth_nak(msn: int, code: int = NakCode.PSN_SEQUENCE_ERROR) -> Aeth:
    return Aeth(nak_syndrome(code), msn)


def _check_bth(bth: Bth) -> None:
    if not 0 <= bth.opcode <= 0xFF:
        raise ValueError(f"opcode {bth.opcode} is not 8 bits")
    if not 0 <= bth.pad_count <= 3:
        raise ValueError(f"PadCnt {bth.pad_count} is not 2 bits")
    if not 0 <= bth.tver <= 0xF:
        raise ValueError(f"TVer {bth.tver} is not 4 bits")
    if not 0 <= bth.p_key <= 0xFFFF:
        raise ValueError(f"P_Key {bth.p_key} is not 16 bits")
    if not 0 <= bth.dest_qp <= QPN_MASK:
        raise ValueError(f"DestQP {bth.dest_qp} is not 24 bits")
    if not 0 <= bth.psn <= PSN_MASK:
        raise ValueError(f"PSN {bth.psn} is not 24 bits")


def pack_bth(bth: Bth) -> bytes:
    """12 bytes of BTH exactly as given (PadCnt and TVer included, FECN/BECN unmasked)."""
    _check_bth(bth)
    flags = bool(bth.se) << 7 | bool(bth.m) << 6 | bth.pad_count << 4 | bth.tver
    w1 = bool(bth.fecn) << 31 | bool(bth.becn) << 30 | bth.dest_qp
    return _BTH.pack(bth.opcode, flags, bth.p_key, w1, bool(bth.ack_req) << 31 | bth.psn)


def unpack_bth(data: BytesLike, offset: int = 0) -> Bth:
    """The BTH at `offset` (reserved bits ignored); struct.error if fewer than 12 bytes."""
    opcode, flags, p_key, w1, w2 = _BTH.unpack_from(data, offset)
    return _tuple_new(Bth, (opcode, (flags & 0x80) != 0, (flags & 0x40) != 0, (flags >> 4) & 3,
                            flags & 0x0F, p_key, (w1 & 0x80000000) != 0, (w1 & 0x40000000) != 0,
                            w1 & QPN_MASK, (w2 & 0x80000000) != 0, w2 & PSN_MASK))


def pack_reth(reth: Reth) -> bytes:
    try:
        return _RETH.pack(*reth)
    except struct.error as exc:
        raise ValueError(f"RETH field out of range: {reth}: {exc}") from None


def unpack_reth(data: BytesLike, offset: int = BTH_BYTES) -> Reth:
    return _tuple_new(Reth, _RETH.unpack_from(data, offset))


def _aeth_word(aeth: Aeth) -> int:
    syndrome, msn = aeth
    if not (0 <= syndrome <= 0xFF and 0 <= msn <= 0xFFFFFF):
        raise ValueError(f"AETH field out of range: {aeth}")
    return syndrome << 24 | msn


def pack_aeth(aeth: Aeth) -> bytes:
    return _AETH.pack(_aeth_word(aeth))


def unpack_aeth(data: BytesLike, offset: int = BTH_BYTES) -> Aeth:
    (word,) = _AETH.unpack_from(data, offset)
    return _tuple_new(Aeth, (word >> 24, word & 0xFFFFFF))


# --------------------------------------------------------------------------- PSN

def psn_add(psn: int, n: int) -> int:
    """psn + n modulo 2^24 (n may be negative)."""
    return (psn + n) & PSN_MASK


def psn_sub(psn: int, n: int) -> int:
    """psn - n modulo 2^24."""
    return (psn - n) & PSN_MASK


def psn_diff(a: int, b: int) -> int:
    """a - b as a signed distance in [-2^23, 2^23): positive when a is after b.

    Exactly half the space apart counts as "before" (-2^23), as rxe's
    psn_compare does with its 32-bit shift.
    """
    d = (a - b) & PSN_MASK
    return d - (1 << 24) if d >= PSN_HALF else d


def psn_lt(a: int, b: int) -> bool:
    return psn_diff(a, b) < 0


def psn_le(a: int, b: int) -> bool:
    return psn_diff(a, b) <= 0


def psn_gt(a: int, b: int) -> bool:
    return psn_diff(a, b) > 0


def psn_ge(a: int, b: int) -> bool:
    return psn_diff(a, b) >= 0


# --------------------------------------------------------------------------- build

def build_packet(buf: bytearray, ctx: IcrcContext, bth: Bth, reth: Reth | None = None,
                 aeth: Aeth | None = None, payload: BytesLike = b"", *,
                 imm: int | None = None) -> memoryview:
    """Write BTH [+ RETH] [+ ImmDt] [| AETH | CNP zeros] + payload + pad + ICRC into `buf`.

    Returns a memoryview of `buf` holding the whole UDP payload, ready for
    sendto(). PadCnt is derived from len(payload) (bth.pad_count must be 0 or
    that value); the ICRC is computed for the datagram `ctx` describes.
    `imm` (32 bits) is the immediate data of a WRITE LAST / ONLY WITH IMMEDIATE.
    Raises ValueError for a header that does not fit the opcode or a field out
    of range, and for a buffer too small.
    """
    opcode, se, m, pad_count, tver, p_key, fecn, becn, dest_qp, ack_req, psn = bth
    info = _layout_for(opcode, reth, aeth, imm)
    if imm is not None and not 0 <= imm <= 0xFFFFFFFF:
        raise ValueError(f"immediate data {imm} is not 32 bits")
    if type(payload) is not bytes:
        payload = memoryview(payload).cast("B")
    n = len(payload)
    pad = -n & 3
    if n and not info.payload:
        raise ValueError(f"{info.name} carries no payload")
    if pad and not info.pad:
        raise ValueError(f"{info.name} payload must be a multiple of 4 bytes, got {n}")
    if pad_count and pad_count != pad:
        raise ValueError(f"PadCnt {pad_count} does not match a {n}-byte payload")
    if dest_qp >> 24 or psn >> 24 or tver >> 4 or p_key >> 16 or dest_qp < 0 or psn < 0 \
            or p_key < 0:
        _check_bth(bth)
    hdr = info.header_bytes
    end = hdr + n + pad
    if end + ICRC_BYTES > len(buf):
        raise ValueError(f"buffer of {len(buf)} bytes is too small for {end + ICRC_BYTES}")
    # BTH byte 4 (FECN|BECN|resv) is 0xFF while the ICRC runs over the buffer.
    _BTH.pack_into(buf, 0, opcode, bool(se) << 7 | bool(m) << 6 | pad << 4 | tver, p_key,
                   0xFF000000 | dest_qp, bool(ack_req) << 31 | psn)
    if reth is not None:
        try:
            _RETH.pack_into(buf, BTH_BYTES, *reth)
        except struct.error as exc:
            raise ValueError(f"RETH field out of range: {reth}: {exc}") from None
    if imm is not None:
        _IMMDT.pack_into(buf, hdr - IMMDT_BYTES, imm)
    elif aeth is not None:
        _AETH.pack_into(buf, BTH_BYTES, _aeth_word(aeth))
    elif info.cnp:
        buf[BTH_BYTES:hdr] = _ZEROS
    if n:
        buf[hdr:hdr + n] = payload
    if pad:
        buf[hdr + n:end] = _ZEROS[:pad]
    view = memoryview(buf)
    crc = ctx.icrc_premasked(view[:end])
    buf[4] = bool(fecn) << 7 | bool(becn) << 6
    _ICRC.pack_into(buf, end, crc)
    return view[:end + ICRC_BYTES]


def _layout_for(opcode: int, reth: Reth | None, aeth: Aeth | None,
                imm: int | None = None) -> OpcodeInfo:
    """The layout of `opcode`, which the extension headers given must fit."""
    info = _INFO[opcode] if 0 <= opcode <= 0xFF else None
    if info is None:
        raise ValueError(f"opcode {opcode:#x} is not one this transport speaks")
    if (reth is not None) != info.reth:
        raise ValueError(f"{info.name} {'needs' if info.reth else 'takes no'} RETH")
    if (imm is not None) != info.imm:
        raise ValueError(f"{info.name} {'needs' if info.imm else 'takes no'} immediate data")
    if (aeth is not None) != info.aeth:
        raise ValueError(f"{info.name} {'needs' if info.aeth else 'takes no'} AETH")
    return info


def encode_packet(ctx: IcrcContext, bth: Bth, reth: Reth | None = None,
                  aeth: Aeth | None = None, payload: BytesLike = b"", *,
                  imm: int | None = None) -> bytes:
    """`build_packet` into a fresh buffer; for tests and cold paths."""
    size = BTH_BYTES + RETH_BYTES + IMMDT_BYTES + memoryview(payload).nbytes + 3 + ICRC_BYTES
    return bytes(build_packet(bytearray(size), ctx, bth, reth, aeth, payload, imm=imm))


def build_cnp(buf: bytearray, ctx: IcrcContext, dest_qp: int, *, opcode: int = CNP_OPCODE,
              p_key: int = DEFAULT_P_KEY, fecn: bool = False) -> memoryview:
    """A CNP to the QP `dest_qp`: opcode 0x81, BECN=1, PSN 0, 16 zero bytes, ICRC."""
    if opcode not in CNP_OPCODES:
        raise ValueError(f"CNP opcode {opcode:#x} is not one of {sorted(CNP_OPCODES)}")
    return build_packet(buf, ctx, Bth(opcode, p_key=p_key, fecn=fecn, becn=True, dest_qp=dest_qp))


# --------------------------------------------------------------------------- parse

class MalformedReason(IntEnum):
    """Why a datagram is not a RoCE packet this transport accepts; one counter each."""

    TOO_SHORT = 1           # shorter than BTH + ICRC, or than the opcode's headers + ICRC
    BAD_ICRC = 2            # ICRC does not match (corruption, or the IP header was not predicted)
    BAD_TVER = 3            # transport header version is not 0
    UNKNOWN_OPCODE = 4      # an opcode not in OPCODES
    BAD_LENGTH = 5          # not a multiple of 4 bytes, or extra bytes after an ACK / CNP
    BAD_PAD_COUNT = 6       # PadCnt on a FIRST/MIDDLE/ACK/CNP, or more pad than payload
    RESERVED_SYNDROME = 7   # AETH syndrome with bit 7 set or type 0b10


class MalformedPacket(Exception):
    """A datagram parse_packet rejects; `reason` is a MalformedReason."""

    def __init__(self, reason: MalformedReason, detail: str = "") -> None:
        super().__init__(f"{reason.name}: {detail}" if detail else reason.name)
        self.reason = reason
        self.detail = detail


class Parsed(NamedTuple):
    """A parsed RoCE packet; `payload` is a view into the datagram, pad excluded.
    `imm` is the ImmDt of a WRITE LAST / ONLY WITH IMMEDIATE, else None."""

    bth: Bth
    reth: Reth | None
    aeth: Aeth | None
    payload: memoryview
    icrc: int
    imm: int | None = None


def parse_packet(data: BytesLike, ctx: IcrcContext | None, *, check_icrc: bool = True) -> Parsed:
    """Parse one UDP payload (BTH ... ICRC). Raises only MalformedPacket.

    Checks, first failure named: TOO_SHORT, BAD_ICRC (when `check_icrc`;
    `ctx` describes the datagram: src, dst, sport, dport), BAD_TVER,
    UNKNOWN_OPCODE, TOO_SHORT / BAD_LENGTH / BAD_PAD_COUNT against the
    opcode's layout, RESERVED_SYNDROME. FECN/BECN are not covered by the ICRC.
    """
    view = memoryview(data)
    n = view.nbytes
    if n < MIN_PACKET_BYTES:
        raise MalformedPacket(MalformedReason.TOO_SHORT, f"{n} bytes")
    end = n - ICRC_BYTES
    (stored,) = _ICRC.unpack_from(view, end)
    if check_icrc:
        if ctx is None:
            raise ValueError("check_icrc needs the datagram's IcrcContext")
        try:
            crc = ctx.icrc(view[:end])
        except ValueError as exc:   # longer than any IP datagram can be
            raise MalformedPacket(MalformedReason.BAD_LENGTH, str(exc)) from None
        if crc != stored:
            raise MalformedPacket(MalformedReason.BAD_ICRC,
                                  f"carried {stored:#010x}, computed {crc:#010x}")
    opcode, flags, p_key, w1, w2 = _BTH.unpack_from(view, 0)
    if flags & 0x0F:
        raise MalformedPacket(MalformedReason.BAD_TVER, f"TVer {flags & 0x0F}")
    info = _INFO[opcode]
    if info is None:
        raise MalformedPacket(MalformedReason.UNKNOWN_OPCODE, f"opcode {opcode:#04x}")
    pad = (flags >> 4) & 3
    size = _payload_bytes(info, n, end, pad)
    hdr = info.header_bytes
    reth = aeth = imm = None
    if hdr != BTH_BYTES:        # extension headers; most packets (MIDDLE) have none
        if info.reth:
            reth = _tuple_new(Reth, _RETH.unpack_from(view, BTH_BYTES))
        if info.imm:
            (imm,) = _IMMDT.unpack_from(view, hdr - IMMDT_BYTES)
        elif info.aeth:
            (word,) = _AETH.unpack_from(view, BTH_BYTES)
            syndrome = word >> 24
            if syndrome & 0x80 or (syndrome >> 5) == 2:
                raise MalformedPacket(MalformedReason.RESERVED_SYNDROME,
                                      f"syndrome {syndrome:#04x}")
            aeth = _tuple_new(Aeth, (syndrome, word & 0xFFFFFF))
    bth = _tuple_new(Bth, (opcode, (flags & 0x80) != 0, (flags & 0x40) != 0, pad, 0, p_key,
                           (w1 & 0x80000000) != 0, (w1 & 0x40000000) != 0, w1 & QPN_MASK,
                           (w2 & 0x80000000) != 0, w2 & PSN_MASK))
    return _tuple_new(Parsed, (bth, reth, aeth, view[hdr:hdr + size], stored, imm))


def _payload_bytes(info: OpcodeInfo, n: int, end: int, pad: int) -> int:
    """Payload bytes of an `n`-byte datagram whose ICRC starts at `end`, PadCnt `pad`,
    checked against the opcode's layout (TOO_SHORT, BAD_LENGTH, BAD_PAD_COUNT)."""
    hdr = info.header_bytes
    if end < hdr:
        raise MalformedPacket(MalformedReason.TOO_SHORT, f"{n} bytes for {info.name}")
    if n & 3:
        raise MalformedPacket(MalformedReason.BAD_LENGTH, f"{n} bytes is not a multiple of 4")
    if info.payload:
        size = end - hdr - pad
        if pad and (size < 0 or not info.pad):
            raise MalformedPacket(MalformedReason.BAD_PAD_COUNT,
                                  f"PadCnt {pad} on {info.name} with {end - hdr} payload bytes")
        return size
    if end != hdr:
        raise MalformedPacket(MalformedReason.BAD_LENGTH,
                              f"{end - hdr} bytes after the {info.name} headers")
    if pad:
        raise MalformedPacket(MalformedReason.BAD_PAD_COUNT, f"PadCnt {pad} on {info.name}")
    return 0


def parse_datagram(data: BytesLike, src_ip: str, dst_ip: str, sport: int,
                   dport: int = ROCE_UDP_PORT, *, check_icrc: bool = True) -> Parsed:
    """`parse_packet` for a datagram src_ip:sport -> dst_ip:dport (context cached)."""
    return parse_packet(data, icrc_context(src_ip, dst_ip, sport, dport), check_icrc=check_icrc)
