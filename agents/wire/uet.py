"""Ultra Ethernet Transport (UET) wire formats: PDS and SES headers, pack and parse.

The UET transport of this testbed (agents/uet) speaks a subset of UEC specification
1.0: RUD (reliable, unordered delivery) requests with the SES standard request header,
ACK / ACK_CC (SACK bitmap and NSCC or credit CC state), NACK and CONTROL packets. This
module is its per-packet hot path, so it uses only `struct` on precompiled layouts; scapy
layers for tests and pcaps live in `agents.wire.uet_scapy`, which the agents never import.

UET rides UDP, destination port `UET_UDP_PORT` (4793) in both directions; the UDP
source port is the entropy (it varies per packet when spraying). No ICRC or trailer (the
Ethernet FCS covers the frame); UDP checksum 0 (senders set SO_NO_CHECK) so a switch can
trim a packet without recomputing it. Big-endian throughout. Layouts (bytes)::

    prologue (every PDS header, 16 bits): type 15..11 | next_hdr (ctl_type) 10..7 | flags 6..0

    RUD_REQ     12  prologue{rsvd 6..5, retrans 4, ackreq 3, syn 2, rsvd 1..0}
                    | clear_psn_offset u16 | psn u32 | spdcid u16 | dpdcid u16
    RUD_CC_REQ  16  the 12 above | ccc_id u8 | credit_target u24
    ACK         12  prologue{rsvd 6, ecn_marked 5, retrans 4, probe 3, request 2..1, rsvd 0}
                    | ack_psn_offset u16 | cack_psn u32 | spdcid u16 | dpdcid u16
    ACK_CC      32  the ACK's 12 | cc_type 7..4, cc_flags 3..0 | mpr u8 | sack_psn_offset u16
                    | sack_bitmap u64 | CC state (8):
                      NSCC   service_time u16 | restore_cwnd 1b, rcv_cwnd_pend 7b
                             | rcvd_bytes u24 | ooo_count u16
                      CREDIT credit u24 | rsvd u8 | rsvd u16 | ooo_count u16
    NACK        16  prologue{rsvd 6, ecn_marked 5, retrans 4, nack_type 3, rsvd 2..0}
                    | nack_code u8 | vendor_code u8 | nack_psn u32 | spdcid u16 | dpdcid u16
                    | payload u32
    CONTROL     16  prologue{ctl_type in bits 10..7; rsvd 6, isrod 5, retrans 4, ackreq 3,
                    syn 2, rsvd 1..0} | probe_opaque u16 | psn u32 | spdcid u16 | dpdcid u16
                    | payload u32 (CREDIT: bytes granted; CREDIT_REQ: bytes wanted)
    SES std     44  rsvd 7..6, opcode 5..0 | version 7..6, delivery_complete 5,
                    initiator_error 4, relative_addressing 3, hdr_data_present 2, eom 1, som 0
                    | message_id u16 | ri_generation u8 | job_id u24 | rsvd 4, pid_on_fep 12
                    | rsvd 4, resource_index 12 | buffer_offset u64 | initiator u32
                    | memory_key (match_bits) u64
                    | header_data u64   or   rsvd u16, rsvd 2, payload_length 14, message_offset u32
                    | request_length u32

The ACK's `ack_psn_offset` is the PSN that triggered it minus `cack_psn`; every PSN up
to and including `cack_psn` was received. The SACK bitmap's base is
`cack_psn + sack_psn_offset`; bit i (LSB first) set means PSN base+i was received.

Deviations from UEC 1.0 (each one deliberate; docs/uet-wire.md says why):

- PDCs are pre-established from the run's schedule: both ends derive their PDC ids
  from it, so `dpdcid` is always a plain id. A SYN request's dpdcid in UEC carries
  use_rsv_pdc (bit 15) and the PSN offset (bits 11..0); we never encode those, and
  parse returns the 16 bits as they are.
- No TSS (encryption / authentication): type TSS is rejected as unsupported; no ICRC.
- Only RUD is spoken: ROD, RUDI, UUD, ACK_CCX and NACK_CCX packets are rejected as
  unsupported (MalformedUet reason "unsupported_type").
- ACKs carry no SES response header (next_hdr NONE). NACKs use `nack_type` 0 (a PDS
  NACK). Reserved bits, `cc_flags`, CONTROL's `isrod` and SES `initiator_error` /
  `relative_addressing` are sent 0 and ignored on read (the dataclasses do not model them).
- SES: a start-of-message packet without `hdr_data_present` carries the non-SOM layout
  (payload_length, message_offset 0) where UEC puts header_data, so every packet we send
  says how many payload bytes it carried; with `hdr_data_present`, header_data is carried
  as UEC has it (and payload_length cannot be).
- Trimmed packets: a switch cuts a UET packet to a fixed size (at least IP + UDP + PDS +
  SES header, 88 bytes) and rewrites its DSCP. The receiver recognises one by that DSCP or,
  here, by a payload shorter than the SES header's payload_length: `Parsed.trimmed`.
  A cut inside the SES header is MalformedUet("truncated_ses") with the PDS header
  already parsed in `.pds`, so the receiver can still NACK the PSN.

Typical use::

    pkt = pack_request(Request(psn=7, spdcid=1, dpdcid=2, ackreq=True),
                       SesRequest(SesOpcode.WRITE, som=False, eom=True, message_id=3,
                                  request_length=1 << 20, memory_key=key,
                                  message_offset=4096, payload_length=len(chunk)), chunk)
    sock.sendto(pkt, (peer_ip, UET_UDP_PORT))      # source port = the entropy

    try:
        p = parse(data)
    except MalformedUet as e:
        counters["malformed"] += 1                 # never any other exception
    if p.ses is not None:
        buf[data_offset(p.ses): ...] = p.payload   # offset of this payload in its message

For the sender's loop, `RequestPacker` writes the same bytes into one preallocated
buffer and returns a memoryview (valid until its next pack).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, fields
from enum import IntEnum
from typing import TypeVar

from agents.wire import BytesLike

_T = TypeVar("_T")

__all__ = [
    "ACK_BYTES",
    "ACK_CC_BYTES",
    "CONTROL_BYTES",
    "NACK_BYTES",
    "PDS_CC_REQUEST_BYTES",
    "PDS_REQUEST_BYTES",
    "SES_PAYLOAD_LENGTH_MAX",
    "SES_STD_BYTES",
    "UET_UDP_PORT",
    "Ack",
    "CcType",
    "Control",
    "CtlType",
    "MalformedUet",
    "Nack",
    "NackCode",
    "NextHdr",
    "Parsed",
    "PdsType",
    "Request",
    "RequestPacker",
    "SesOpcode",
    "SesRequest",
    "data_offset",
    "pack_ack",
    "pack_control",
    "pack_nack",
    "pack_request",
    "parse",
]

UET_UDP_PORT = 4793
PDS_REQUEST_BYTES, PDS_CC_REQUEST_BYTES, SES_STD_BYTES = 12, 16, 44
ACK_BYTES, ACK_CC_BYTES, NACK_BYTES, CONTROL_BYTES = 12, 32, 16, 16
SES_PAYLOAD_LENGTH_MAX = (1 << 14) - 1


class PdsType(IntEnum):
    """PDS header type, prologue bits 15..11."""

    TSS = 1
    RUD_REQ = 2
    ROD_REQ = 3
    RUDI_REQ = 4
    RUDI_RESP = 5
    UUD_REQ = 6
    ACK = 7
    ACK_CC = 8
    ACK_CCX = 9
    NACK = 10
    CONTROL = 11
    NACK_CCX = 12
    RUD_CC_REQ = 13
    ROD_CC_REQ = 14


class NextHdr(IntEnum):
    """What follows a PDS request or ACK, prologue bits 10..7."""

    NONE = 0
    REQUEST_SMALL = 1
    REQUEST_MEDIUM = 2
    REQUEST_STD = 3
    RESPONSE = 4
    RESPONSE_DATA = 5
    RESPONSE_DATA_SMALL = 6


class CtlType(IntEnum):
    """A CONTROL packet's type, in the prologue's next_hdr bits."""

    NOOP = 0
    ACK_REQ = 1
    CLEAR_CMD = 2
    CLEAR_REQ = 3
    CLOSE_CMD = 4
    CLOSE_REQ = 5
    PROBE = 6
    CREDIT = 7
    CREDIT_REQ = 8
    NEGOTIATION = 9


class NackCode(IntEnum):
    """PDS NACK codes (UEC 1.0; 0x0c is reserved)."""

    TRIMMED = 0x01
    TRIMMED_LASTHOP = 0x02
    TRIMMED_ACK = 0x03
    NO_PDC_AVAIL = 0x04
    NO_CCC_AVAIL = 0x05
    NO_BITMAP = 0x06
    NO_PKT_BUFFER = 0x07
    NO_GTD_DEL_AVAIL = 0x08
    NO_SES_MSG_AVAIL = 0x09
    NO_RESOURCE = 0x0A
    PSN_OOR_WINDOW = 0x0B
    ROD_OOO = 0x0D
    INV_DPDCID = 0x0E
    PDC_HDR_MISMATCH = 0x0F
    CLOSING = 0x10
    CLOSING_IN_ERR = 0x11
    PKT_NOT_RCVD = 0x12
    GTD_DEL_RESP_UNAVAIL = 0x13
    ACK_WITH_DATA = 0x14
    INVALID_SYN = 0x15
    PDC_MODE_MISMATCH = 0x16
    NEW_START_PSN = 0x17
    RCVD_SES_PROCG = 0x18
    UNEXP_EVENT = 0x19
    RCVR_INFER_LOSS = 0x1A


class CcType(IntEnum):
    """ACK_CC's cc_type: which CC state its last 8 bytes carry."""

    NSCC = 0
    CREDIT = 1


class SesOpcode(IntEnum):
    """SES standard request opcodes (6 bits)."""

    NO_OP = 0x00
    WRITE = 0x01
    READ = 0x02
    ATOMIC = 0x03
    FETCHING_ATOMIC = 0x04
    SEND = 0x05
    RENDEZVOUS_SEND = 0x06
    DATAGRAM_SEND = 0x07
    DEFERRABLE_SEND = 0x08
    TAGGED_SEND = 0x09
    RENDEZVOUS_TSEND = 0x0A
    DEFERRABLE_TSEND = 0x0B
    DEFERRABLE_RTR = 0x0C
    TSEND_ATOMIC = 0x0D
    TSEND_FETCH_ATOMIC = 0x0E
    MSG_ERROR = 0x0F


class MalformedUet(ValueError):
    """A UDP payload `parse` rejects. `reason` is a short snake_case word, stable for
    counters: short, truncated, truncated_ses, unknown_type, unsupported_type,
    bad_next_hdr, bad_ctl_type, bad_cc_type, bad_ses_version, inconsistent_length,
    not_contiguous.
    `pds` is the PDS header when only the SES header was cut (truncated_ses)."""

    def __init__(self, reason: str, detail: str = "",
                 pds: Request | None = None) -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail
        self.pds = pds


# --------------------------------------------------------------------------- headers

@dataclass(frozen=True, slots=True)
class Request:
    """A RUD request (RUD_REQ, 12 bytes) or, with ccc_id and credit_target both set,
    a RUD_CC_REQ (16 bytes). `credit_target`: bytes the sender still wants."""

    psn: int
    spdcid: int
    dpdcid: int
    clear_psn_offset: int = 0
    retrans: bool = False
    ackreq: bool = False
    syn: bool = False
    next_hdr: int = NextHdr.REQUEST_STD
    ccc_id: int | None = None
    credit_target: int | None = None


@dataclass(frozen=True, slots=True)
class SesRequest:
    """The SES standard request header (44 bytes). `memory_key` is the match bits of a
    SEND. `header_data` is carried on SOM packets with hdr_data_present only;
    `payload_length` on every other packet, `message_offset` on non-SOM ones."""

    opcode: int
    som: bool
    eom: bool
    message_id: int
    request_length: int
    buffer_offset: int = 0
    memory_key: int = 0
    header_data: int = 0
    message_offset: int = 0
    payload_length: int = 0
    job_id: int = 0
    pid_on_fep: int = 0
    resource_index: int = 0
    initiator: int = 0
    ri_generation: int = 0
    hdr_data_present: bool = False
    delivery_complete: bool = False


@dataclass(frozen=True, slots=True)
class Ack:
    """An ACK (12 bytes) or, with cc_type set, an ACK_CC (32 bytes). NSCC state:
    service_time (ns of receiver delay, fabric, saturating at 65535), restore_cwnd,
    rcv_cwnd_pend, rcvd_bytes; CREDIT state: credit (bytes granted); both: ooo_count."""

    cack_psn: int
    ack_psn_offset: int
    spdcid: int
    dpdcid: int
    ecn_marked: bool = False
    retrans: bool = False
    probe: bool = False
    request: int = 0
    cc_type: int | None = None
    mpr: int = 0
    sack_psn_offset: int = 0
    sack_bitmap: int = 0
    service_time: int = 0
    restore_cwnd: bool = False
    rcv_cwnd_pend: int = 0
    rcvd_bytes: int = 0
    ooo_count: int = 0
    credit: int = 0


@dataclass(frozen=True, slots=True)
class Nack:
    """A NACK (16 bytes); `payload` is the code-specific 32-bit word."""

    nack_code: int
    nack_psn: int
    spdcid: int
    dpdcid: int
    ecn_marked: bool = False
    retrans: bool = False
    nack_type: int = 0
    vendor_code: int = 0
    payload: int = 0


@dataclass(frozen=True, slots=True)
class Control:
    """A CONTROL packet (16 bytes); `payload`: CREDIT bytes granted, CREDIT_REQ bytes
    wanted, otherwise as the ctl_type defines it."""

    ctl_type: int
    psn: int
    spdcid: int
    dpdcid: int
    payload: int = 0
    probe_opaque: int = 0
    retrans: bool = False
    ackreq: bool = False
    syn: bool = False


@dataclass(frozen=True, slots=True)
class Parsed:
    """A parsed UET packet. `payload` is a view into the datagram: the request's data
    after the SES header, or whatever follows another header (normally nothing)."""

    pds: Request | Ack | Nack | Control
    ses: SesRequest | None
    payload: memoryview

    @property
    def trimmed(self) -> bool:
        """The packet carried fewer payload bytes than its SES header says it was sent
        with: a switch cut it. A payload_length of 0 states nothing (never trimmed), so
        senders set it to the payload's length on every packet."""
        ses = self.ses
        return ses is not None and len(self.payload) < ses.payload_length


def data_offset(ses: SesRequest) -> int:
    """Byte offset of this packet's payload in its message (0 on the SOM packet)."""
    return 0 if ses.som else ses.message_offset


# --------------------------------------------------------------------------- layouts

def _builder(cls: type[_T]) -> Callable[..., _T]:
    """A constructor for the frozen dataclass `cls` taking every field positionally, for
    parse's per-packet path. It sets the slots through their descriptors, one straight
    line per field (generated, as dataclasses generates __init__), which costs about a
    third of the generated __init__'s object.__setattr__ calls. The classes have no
    __post_init__, so the object is the one __init__ makes."""
    names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    env: dict[str, object] = {"_new": object.__new__, "_cls": cls}
    env.update({f"_set_{n}": getattr(cls, n).__set__ for n in names})
    body = "".join(f"    _set_{n}(o, {n})\n" for n in names)
    exec(f"def build({', '.join(names)}):\n    o = _new(_cls)\n{body}    return o\n", env)
    return env["build"]  # type: ignore[return-value]


_request = _builder(Request)
_ses_request = _builder(SesRequest)
_ack = _builder(Ack)
_nack = _builder(Nack)
_control = _builder(Control)
_parsed = _builder(Parsed)


_REQ = struct.Struct("!HHIHH")                  # prologue, clear_psn_offset, psn, spdcid, dpdcid
_CC_REQ = struct.Struct("!HHIHHI")              # + ccc_id << 24 | credit_target
_ACK = struct.Struct("!HHIHH")                  # prologue, ack_psn_offset, cack_psn, s/dpdcid
_ACK_CC_NSCC = struct.Struct("!HHIHHBBHQHIH")   # + cc, mpr, sack off, bitmap, svc, r|p|bytes, ooo
_ACK_CC_CREDIT = struct.Struct("!HHIHHBBHQIHH")  # + cc, mpr, sack off, bitmap, credit|r, r, ooo
_NACK = struct.Struct("!HBBIHHI")
_CONTROL = struct.Struct("!HHIHHI")
_SES = struct.Struct("!BBHIHHQIQQI")            # 44 bytes; the Q before request_length is
#                                                 header_data or payload_length|message_offset
assert _REQ.size == PDS_REQUEST_BYTES and _CC_REQ.size == PDS_CC_REQUEST_BYTES
assert _ACK.size == ACK_BYTES and _ACK_CC_NSCC.size == _ACK_CC_CREDIT.size == ACK_CC_BYTES
assert _NACK.size == NACK_BYTES and _CONTROL.size == CONTROL_BYTES and _SES.size == SES_STD_BYTES

# Flag bits in the prologue's low 7 bits.
_F_ECN, _F_RETRANS, _F_ACKREQ, _F_PROBE, _F_SYN = 0x20, 0x10, 0x08, 0x08, 0x04
_F_NACK_TYPE = 0x08
# SES flags byte.
_S_DC, _S_HDR_DATA, _S_EOM, _S_SOM = 0x20, 0x04, 0x02, 0x01

_U8, _U16, _U24, _U32, _U64 = 0xFF, 0xFFFF, 0xFFFFFF, 0xFFFFFFFF, (1 << 64) - 1
# Plain ints for the per-packet code: IntEnum arithmetic and max(Enum) cost microseconds.
_NEXT_HDR_MAX, _STD = int(max(NextHdr)), int(NextHdr.REQUEST_STD)
_P_RUD, _P_RUD_CC = int(PdsType.RUD_REQ) << 11, int(PdsType.RUD_CC_REQ) << 11
_P_ACK, _P_ACK_CC = int(PdsType.ACK) << 11, int(PdsType.ACK_CC) << 11
_P_NACK, _P_CONTROL = int(PdsType.NACK) << 11, int(PdsType.CONTROL) << 11
_NSCC, _CREDIT, _CC_TYPE_MAX = int(CcType.NSCC), int(CcType.CREDIT), int(max(CcType))


def _check(name: str, value: int, top: int) -> None:
    if not 0 <= value <= top:
        raise ValueError(f"{name}={value} is out of range 0..{top}")


def _check_request(req: Request, ses: SesRequest | None) -> None:
    _check("psn", req.psn, _U32)
    _check("spdcid", req.spdcid, _U16)
    _check("dpdcid", req.dpdcid, _U16)
    _check("clear_psn_offset", req.clear_psn_offset, _U16)
    _check("next_hdr", req.next_hdr, _NEXT_HDR_MAX)
    if (req.ccc_id is None) != (req.credit_target is None):
        raise ValueError("ccc_id and credit_target: set both (RUD_CC_REQ) or neither")
    if req.ccc_id is not None and req.credit_target is not None:
        _check("ccc_id", req.ccc_id, _U8)
        _check("credit_target", req.credit_target, _U24)
    if (ses is not None) != (req.next_hdr == _STD):
        raise ValueError(f"next_hdr={req.next_hdr}: an SES standard header goes with "
                         "next_hdr REQUEST_STD and only with it")
    if ses is not None:
        _check_ses(ses)


def _check_ses(ses: SesRequest) -> None:
    _check("opcode", ses.opcode, 0x3F)
    _check("message_id", ses.message_id, _U16)
    _check("request_length", ses.request_length, _U32)
    _check("buffer_offset", ses.buffer_offset, _U64)
    _check("memory_key", ses.memory_key, _U64)
    _check("header_data", ses.header_data, _U64)
    _check("message_offset", ses.message_offset, _U32)
    _check("payload_length", ses.payload_length, SES_PAYLOAD_LENGTH_MAX)
    _check("job_id", ses.job_id, _U24)
    _check("pid_on_fep", ses.pid_on_fep, 0xFFF)
    _check("resource_index", ses.resource_index, 0xFFF)
    _check("initiator", ses.initiator, _U32)
    _check("ri_generation", ses.ri_generation, _U8)
    carries_header_data = ses.som and ses.hdr_data_present
    if ses.header_data and not carries_header_data:
        raise ValueError("header_data is carried on a SOM packet with hdr_data_present only")
    if carries_header_data and ses.payload_length:
        raise ValueError("payload_length cannot be carried beside header_data (SOM packet "
                         "with hdr_data_present)")
    if ses.som and ses.message_offset:
        raise ValueError("message_offset must be 0 on the SOM packet")


def _request_prologue(req: Request, cc: bool) -> int:
    return ((_P_RUD_CC if cc else _P_RUD) | (req.next_hdr << 7)
            | (_F_RETRANS if req.retrans else 0) | (_F_ACKREQ if req.ackreq else 0)
            | (_F_SYN if req.syn else 0))


def _ses_words(ses: SesRequest) -> tuple[int, int, int, int, int, int, int, int, int, int, int]:
    flags = ((_S_DC if ses.delivery_complete else 0) | (_S_HDR_DATA if ses.hdr_data_present
             else 0) | (_S_EOM if ses.eom else 0) | (_S_SOM if ses.som else 0))
    if ses.som and ses.hdr_data_present:
        tail = ses.header_data
    else:
        tail = (ses.payload_length << 32) | ses.message_offset
    return (ses.opcode, flags, ses.message_id, (ses.ri_generation << 24) | ses.job_id,
            ses.pid_on_fep, ses.resource_index, ses.buffer_offset, ses.initiator,
            ses.memory_key, tail, ses.request_length)


def _pds_size(req: Request) -> int:
    return PDS_REQUEST_BYTES if req.ccc_id is None else PDS_CC_REQUEST_BYTES


def _write_request(buf: bytearray | memoryview, req: Request, ses: SesRequest | None) -> int:
    """Write the PDS (+ SES) header at the start of `buf`; returns the header length."""
    if req.ccc_id is None or req.credit_target is None:
        _REQ.pack_into(buf, 0, _request_prologue(req, False), req.clear_psn_offset, req.psn,
                       req.spdcid, req.dpdcid)
        off = PDS_REQUEST_BYTES
    else:
        _CC_REQ.pack_into(buf, 0, _request_prologue(req, True), req.clear_psn_offset, req.psn,
                          req.spdcid, req.dpdcid, (req.ccc_id << 24) | req.credit_target)
        off = PDS_CC_REQUEST_BYTES
    if ses is None:
        return off
    _SES.pack_into(buf, off, *_ses_words(ses))
    return off + SES_STD_BYTES


# --------------------------------------------------------------------------- pack

def pack_request(req: Request, ses: SesRequest | None, payload: BytesLike = b"") -> bytes:
    """A request's UDP payload: PDS header [+ SES standard header] + payload. Raises
    ValueError naming the field that is out of range or inconsistent."""
    _check_request(req, ses)
    head = bytearray(_pds_size(req) + (SES_STD_BYTES if ses is not None else 0))
    _write_request(head, req, ses)
    return bytes(head) + bytes(payload)


class RequestPacker:
    """Writes requests into one preallocated buffer for the sender's loop.

    `pack` gives the same bytes as `pack_request` as a memoryview into the buffer, valid
    until the next `pack` (socket.sendto copies it). `check=False` skips the range checks
    for fields the caller already knows are in range (a PSN kept mod 2**32, ids from the
    schedule); out-of-range values then raise struct.error or corrupt a neighbouring
    field."""

    __slots__ = ("_buf", "_view", "max_payload_bytes")

    def __init__(self, max_payload_bytes: int = SES_PAYLOAD_LENGTH_MAX) -> None:
        self.max_payload_bytes = max_payload_bytes
        self._buf = bytearray(PDS_CC_REQUEST_BYTES + SES_STD_BYTES + max_payload_bytes)
        self._view = memoryview(self._buf)

    def pack(self, req: Request, ses: SesRequest | None, payload: BytesLike = b"", *,
             check: bool = True) -> memoryview:
        if check:
            _check_request(req, ses)
        n = len(payload) if not isinstance(payload, memoryview) else payload.nbytes
        if n > self.max_payload_bytes:
            raise ValueError(f"payload of {n} bytes is above this packer's "
                             f"max_payload_bytes={self.max_payload_bytes}")
        off = _write_request(self._buf, req, ses)
        self._view[off:off + n] = payload
        return self._view[:off + n]


def pack_ack(a: Ack) -> bytes:
    """An ACK (cc_type None, 12 bytes) or ACK_CC (32 bytes). Raises ValueError naming a
    field out of range, or a CC field set that the cc_type does not carry."""
    _check_ack(a)
    flags = ((_F_ECN if a.ecn_marked else 0) | (_F_RETRANS if a.retrans else 0)
             | (_F_PROBE if a.probe else 0) | (a.request << 1))
    if a.cc_type is None:
        return _ACK.pack(_P_ACK | flags, a.ack_psn_offset, a.cack_psn,
                         a.spdcid, a.dpdcid)
    prologue = _P_ACK_CC | flags
    if a.cc_type == _NSCC:
        return _ACK_CC_NSCC.pack(
            prologue, a.ack_psn_offset, a.cack_psn, a.spdcid, a.dpdcid, _NSCC << 4,
            a.mpr, a.sack_psn_offset, a.sack_bitmap, a.service_time,
            ((1 << 31) if a.restore_cwnd else 0) | (a.rcv_cwnd_pend << 24) | a.rcvd_bytes,
            a.ooo_count)
    return _ACK_CC_CREDIT.pack(
        prologue, a.ack_psn_offset, a.cack_psn, a.spdcid, a.dpdcid, _CREDIT << 4,
        a.mpr, a.sack_psn_offset, a.sack_bitmap, a.credit << 8, 0, a.ooo_count)


_NSCC_ONLY = ("service_time", "restore_cwnd", "rcv_cwnd_pend", "rcvd_bytes")
_CC_ONLY = ("mpr", "sack_psn_offset", "sack_bitmap", "ooo_count", "credit", *_NSCC_ONLY)


def _check_ack(a: Ack) -> None:
    _check("cack_psn", a.cack_psn, _U32)
    _check("ack_psn_offset", a.ack_psn_offset, _U16)
    _check("spdcid", a.spdcid, _U16)
    _check("dpdcid", a.dpdcid, _U16)
    _check("request", a.request, 3)
    if a.cc_type is None:
        stray = [f for f in _CC_ONLY if getattr(a, f)]
        if stray:
            raise ValueError(f"{stray[0]} is carried by an ACK_CC only; set cc_type")
        return
    _check("cc_type", a.cc_type, _CC_TYPE_MAX)
    _check("mpr", a.mpr, _U8)
    _check("sack_psn_offset", a.sack_psn_offset, _U16)
    _check("sack_bitmap", a.sack_bitmap, _U64)
    _check("ooo_count", a.ooo_count, _U16)
    if a.cc_type == _NSCC:
        _check("service_time", a.service_time, _U16)
        _check("rcv_cwnd_pend", a.rcv_cwnd_pend, 0x7F)
        _check("rcvd_bytes", a.rcvd_bytes, _U24)
        if a.credit:
            raise ValueError("credit is carried with cc_type CREDIT only")
    else:
        _check("credit", a.credit, _U24)
        stray = [f for f in _NSCC_ONLY if getattr(a, f)]
        if stray:
            raise ValueError(f"{stray[0]} is carried with cc_type NSCC only")


def pack_nack(n: Nack) -> bytes:
    """A NACK (16 bytes). Raises ValueError naming a field out of range."""
    _check("nack_code", n.nack_code, _U8)
    _check("nack_psn", n.nack_psn, _U32)
    _check("spdcid", n.spdcid, _U16)
    _check("dpdcid", n.dpdcid, _U16)
    _check("nack_type", n.nack_type, 1)
    _check("vendor_code", n.vendor_code, _U8)
    _check("payload", n.payload, _U32)
    flags = ((_F_ECN if n.ecn_marked else 0) | (_F_RETRANS if n.retrans else 0)
             | (_F_NACK_TYPE if n.nack_type else 0))
    return _NACK.pack(_P_NACK | flags, n.nack_code, n.vendor_code, n.nack_psn,
                      n.spdcid, n.dpdcid, n.payload)


def pack_control(c: Control) -> bytes:
    """A CONTROL packet (16 bytes). Raises ValueError naming a field out of range."""
    _check("ctl_type", c.ctl_type, 0xF)
    _check("psn", c.psn, _U32)
    _check("spdcid", c.spdcid, _U16)
    _check("dpdcid", c.dpdcid, _U16)
    _check("payload", c.payload, _U32)
    _check("probe_opaque", c.probe_opaque, _U16)
    flags = ((_F_RETRANS if c.retrans else 0) | (_F_ACKREQ if c.ackreq else 0)
             | (_F_SYN if c.syn else 0))
    return _CONTROL.pack(_P_CONTROL | (c.ctl_type << 7) | flags, c.probe_opaque,
                         c.psn, c.spdcid, c.dpdcid, c.payload)


# --------------------------------------------------------------------------- parse

_SUPPORTED_NEXT_HDR = frozenset(int(h) for h in NextHdr)
_CTL_TYPES = frozenset(int(t) for t in CtlType)


def _parse_request(view: memoryview, p: int, cc: bool) -> Parsed:
    n = len(view)
    next_hdr = (p >> 7) & 0xF
    if next_hdr not in _SUPPORTED_NEXT_HDR:
        raise MalformedUet("bad_next_hdr", f"next_hdr {next_hdr}")
    if cc:
        if n < PDS_CC_REQUEST_BYTES:
            raise MalformedUet("truncated", f"RUD_CC_REQ needs 16 bytes, got {n}")
        _, clear, psn, spdcid, dpdcid, word = _CC_REQ.unpack_from(view)
        req = _request(psn, spdcid, dpdcid, clear, bool(p & _F_RETRANS), bool(p & _F_ACKREQ),
                       bool(p & _F_SYN), next_hdr, word >> 24, word & _U24)
        off = PDS_CC_REQUEST_BYTES
    else:
        if n < PDS_REQUEST_BYTES:
            raise MalformedUet("truncated", f"RUD_REQ needs 12 bytes, got {n}")
        _, clear, psn, spdcid, dpdcid = _REQ.unpack_from(view)
        req = _request(psn, spdcid, dpdcid, clear, bool(p & _F_RETRANS), bool(p & _F_ACKREQ),
                       bool(p & _F_SYN), next_hdr, None, None)
        off = PDS_REQUEST_BYTES
    if next_hdr != _STD:
        return _parsed(req, None, view[off:])
    if n < off + SES_STD_BYTES:
        raise MalformedUet("truncated_ses", f"SES standard header needs {SES_STD_BYTES} "
                           f"bytes, got {n - off}", req)
    ses = _parse_ses(view, off, req)
    payload = view[off + SES_STD_BYTES:]
    if ses.payload_length and len(payload) > ses.payload_length:
        raise MalformedUet("inconsistent_length", f"{len(payload)} payload bytes, SES "
                           f"payload_length {ses.payload_length}", req)
    return _parsed(req, ses, payload)


def _parse_ses(view: memoryview, off: int, req: Request) -> SesRequest:
    (opcode, flags, message_id, ri_job, pid, ri, buffer_offset, initiator, memory_key, tail,
     request_length) = _SES.unpack_from(view, off)
    if flags >> 6:
        raise MalformedUet("bad_ses_version", f"SES version {flags >> 6}", req)
    som = bool(flags & _S_SOM)
    hdr_data = bool(flags & _S_HDR_DATA)
    if som and hdr_data:
        header_data, message_offset, payload_length = tail, 0, 0
    else:
        header_data = 0
        message_offset = 0 if som else tail & _U32
        payload_length = (tail >> 32) & SES_PAYLOAD_LENGTH_MAX
    return _ses_request(opcode & 0x3F, som, bool(flags & _S_EOM), message_id, request_length,
                        buffer_offset, memory_key, header_data, message_offset, payload_length,
                        ri_job & _U24, pid & 0xFFF, ri & 0xFFF, initiator, ri_job >> 24,
                        hdr_data, bool(flags & _S_DC))


def _parse_ack(view: memoryview, p: int, cc: bool) -> Parsed:
    n = len(view)
    if (p >> 7) & 0xF:
        raise MalformedUet("bad_next_hdr", f"ACK with next_hdr {(p >> 7) & 0xF} (an SES "
                           "response header is not supported)")
    ecn, retrans, probe, request = (bool(p & _F_ECN), bool(p & _F_RETRANS),
                                    bool(p & _F_PROBE), (p >> 1) & 3)
    if not cc:
        if n < ACK_BYTES:
            raise MalformedUet("truncated", f"ACK needs 12 bytes, got {n}")
        _, offset, cack, spdcid, dpdcid = _ACK.unpack_from(view)
        return _parsed(_ack(cack, offset, spdcid, dpdcid, ecn, retrans, probe, request, None,
                            0, 0, 0, 0, False, 0, 0, 0, 0), None, view[ACK_BYTES:])
    if n < ACK_CC_BYTES:
        raise MalformedUet("truncated", f"ACK_CC needs 32 bytes, got {n}")
    cc_type = view[12] >> 4
    if cc_type == _NSCC:
        (_, offset, cack, spdcid, dpdcid, _, mpr, sack_off, bitmap, svc, word,
         ooo) = _ACK_CC_NSCC.unpack_from(view)
        ack = _ack(cack, offset, spdcid, dpdcid, ecn, retrans, probe, request, CcType.NSCC,
                   mpr, sack_off, bitmap, svc, bool(word >> 31), (word >> 24) & 0x7F,
                   word & _U24, ooo, 0)
    elif cc_type == _CREDIT:
        (_, offset, cack, spdcid, dpdcid, _, mpr, sack_off, bitmap, word, _,
         ooo) = _ACK_CC_CREDIT.unpack_from(view)
        ack = _ack(cack, offset, spdcid, dpdcid, ecn, retrans, probe, request, CcType.CREDIT,
                   mpr, sack_off, bitmap, 0, False, 0, 0, ooo, word >> 8)
    else:
        raise MalformedUet("bad_cc_type", f"cc_type {cc_type}")
    return _parsed(ack, None, view[ACK_CC_BYTES:])


def _parse_nack(view: memoryview, p: int, cc: bool) -> Parsed:
    if len(view) < NACK_BYTES:
        raise MalformedUet("truncated", f"NACK needs 16 bytes, got {len(view)}")
    _, code, vendor, psn, spdcid, dpdcid, payload = _NACK.unpack_from(view)
    return _parsed(_nack(code, psn, spdcid, dpdcid, bool(p & _F_ECN), bool(p & _F_RETRANS),
                         1 if p & _F_NACK_TYPE else 0, vendor, payload), None, view[NACK_BYTES:])


def _parse_control(view: memoryview, p: int, cc: bool) -> Parsed:
    ctl_type = (p >> 7) & 0xF
    if ctl_type not in _CTL_TYPES:
        raise MalformedUet("bad_ctl_type", f"ctl_type {ctl_type}")
    if len(view) < CONTROL_BYTES:
        raise MalformedUet("truncated", f"CONTROL needs 16 bytes, got {len(view)}")
    _, opaque, psn, spdcid, dpdcid, payload = _CONTROL.unpack_from(view)
    return _parsed(_control(ctl_type, psn, spdcid, dpdcid, payload, opaque,
                            bool(p & _F_RETRANS), bool(p & _F_ACKREQ), bool(p & _F_SYN)),
                   None, view[CONTROL_BYTES:])


_Parser = Callable[[memoryview, int, bool], Parsed]
_DISPATCH: dict[int, tuple[_Parser, bool]] = {
    int(PdsType.RUD_REQ): (_parse_request, False),
    int(PdsType.RUD_CC_REQ): (_parse_request, True),
    int(PdsType.ACK): (_parse_ack, False),
    int(PdsType.ACK_CC): (_parse_ack, True),
    int(PdsType.NACK): (_parse_nack, False),
    int(PdsType.CONTROL): (_parse_control, False),
}
_KNOWN_TYPES = frozenset(int(t) for t in PdsType)


def parse(data: BytesLike) -> Parsed:
    """Parse one UDP payload (PDS header [+ SES header] + payload). Raises only
    MalformedUet, whose `reason` names the first problem found."""
    view = data if isinstance(data, memoryview) else memoryview(data)
    if view.format != "B" or view.ndim != 1:
        try:
            view = view.cast("B")
        except TypeError as e:                  # not C-contiguous: no datagram looks so
            raise MalformedUet("not_contiguous", str(e)) from None
    if len(view) < 2:
        raise MalformedUet("short", f"{len(view)} bytes, not even a PDS prologue")
    p = (view[0] << 8) | view[1]
    entry = _DISPATCH.get(p >> 11)
    if entry is None:
        if p >> 11 in _KNOWN_TYPES:
            raise MalformedUet("unsupported_type", f"PDS type {PdsType(p >> 11).name}")
        raise MalformedUet("unknown_type", f"PDS type {p >> 11}")
    fn, cc = entry
    return fn(view, p, cc)
