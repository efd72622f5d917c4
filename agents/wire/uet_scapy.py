"""Scapy layers for the UET packets of `agents.wire.uet`, for tests and for reading pcaps.

The agents never import this module (they pack and parse with `agents.wire.uet`, which
needs only `struct`); importing it binds the layers to UDP destination port 4793, so
`Ether(raw_frame)` or `rdpcap(path)` decodes UET packets::

    from scapy.all import rdpcap
    import agents.wire.uet_scapy as uet      # binds UDP dport 4793
    for pkt in rdpcap("run/capture/leaf1-eth1.pcap"):
        if uet.UETSESStd in pkt:
            print(pkt[uet.UETPDSRequest].psn, pkt[uet.UETSESStd].message_offset)

Every PDS packet starts with the same 16-bit prologue (type, next_hdr / ctl_type,
flags); the class is chosen from the type by `dispatch_hook`, whichever UET class the
UDP binding names (the dport 4793 bindings are put before scapy's own, so a source
port scapy knows, 53 say, does not make a UET packet look like DNS).
A request with next_hdr REQUEST_STD is followed by `UETSESStd`.
Field names follow `agents.wire.uet`, except the 32-bit payload words of NACK and
CONTROL (`nack_payload`, `ctl_payload`: scapy's Packet owns the name `payload`).
"""

from __future__ import annotations

from typing import Any

from scapy.fields import (
    BitEnumField,
    BitField,
    ByteEnumField,
    ByteField,
    ConditionalField,
    IntField,
    LongField,
    ShortField,
    StrFixedLenField,
    ThreeBytesField,
)
from scapy.layers.inet import UDP
from scapy.packet import Packet, Raw, bind_layers

from agents.wire.uet import (
    UET_UDP_PORT,
    CcType,
    CtlType,
    NackCode,
    NextHdr,
    PdsType,
    SesOpcode,
)

__all__ = ["UETPDSAck", "UETPDSControl", "UETPDSNack", "UETPDSRequest", "UETSESStd"]

_PDS_TYPES = {int(t): t.name for t in PdsType}
_NEXT_HDRS = {int(h): h.name for h in NextHdr}
_CTL_TYPES = {int(t): t.name for t in CtlType}
_NACK_CODES = {int(c): c.name for c in NackCode}
_CC_TYPES = {int(c): c.name for c in CcType}
_SES_OPCODES = {int(o): o.name for o in SesOpcode}


class _UETPDS(Packet):
    """Shared by the PDS classes: pick the class from the prologue's type bits."""

    @classmethod
    def dispatch_hook(cls, _pkt: bytes | None = None, *args: Any, **kargs: Any) -> type[Packet]:
        if _pkt and len(_pkt) >= 1:
            return _BY_TYPE.get(_pkt[0] >> 3, Raw)
        return cls


def _is_cc_req(pkt: Packet) -> bool:
    return bool(pkt.type == PdsType.RUD_CC_REQ)


def _is_ack_cc(pkt: Packet) -> bool:
    return bool(pkt.type == PdsType.ACK_CC)


def _nscc(pkt: Packet) -> bool:
    return _is_ack_cc(pkt) and pkt.cc_type == CcType.NSCC


def _credit(pkt: Packet) -> bool:
    return _is_ack_cc(pkt) and pkt.cc_type == CcType.CREDIT


def _other_cc(pkt: Packet) -> bool:
    return _is_ack_cc(pkt) and pkt.cc_type not in (CcType.NSCC, CcType.CREDIT)


class UETPDSRequest(_UETPDS):
    """RUD_REQ (12 bytes) and RUD_CC_REQ (16: + ccc_id, credit_target)."""

    name = "UET PDS Request"
    fields_desc = [
        BitEnumField("type", PdsType.RUD_REQ, 5, _PDS_TYPES),
        BitEnumField("next_hdr", NextHdr.REQUEST_STD, 4, _NEXT_HDRS),
        BitField("rsvd_6_5", 0, 2),
        BitField("retrans", 0, 1),
        BitField("ackreq", 0, 1),
        BitField("syn", 0, 1),
        BitField("rsvd_1_0", 0, 2),
        ShortField("clear_psn_offset", 0),
        IntField("psn", 0),
        ShortField("spdcid", 0),
        ShortField("dpdcid", 0),
        ConditionalField(ByteField("ccc_id", 0), _is_cc_req),
        ConditionalField(ThreeBytesField("credit_target", 0), _is_cc_req),
    ]

    def guess_payload_class(self, payload: bytes) -> type[Packet]:
        if self.next_hdr == NextHdr.REQUEST_STD:
            return UETSESStd
        return Raw


class UETPDSAck(_UETPDS):
    """ACK (12 bytes) and ACK_CC (32: + SACK and the NSCC or credit CC state)."""

    name = "UET PDS ACK"
    fields_desc = [
        BitEnumField("type", PdsType.ACK, 5, _PDS_TYPES),
        BitEnumField("next_hdr", NextHdr.NONE, 4, _NEXT_HDRS),
        BitField("rsvd_6", 0, 1),
        BitField("ecn_marked", 0, 1),
        BitField("retrans", 0, 1),
        BitField("probe", 0, 1),
        BitField("request", 0, 2),
        BitField("rsvd_0", 0, 1),
        ShortField("ack_psn_offset", 0),
        IntField("cack_psn", 0),
        ShortField("spdcid", 0),
        ShortField("dpdcid", 0),
        ConditionalField(BitEnumField("cc_type", CcType.NSCC, 4, _CC_TYPES), _is_ack_cc),
        ConditionalField(BitField("cc_flags", 0, 4), _is_ack_cc),
        ConditionalField(ByteField("mpr", 0), _is_ack_cc),
        ConditionalField(ShortField("sack_psn_offset", 0), _is_ack_cc),
        ConditionalField(LongField("sack_bitmap", 0), _is_ack_cc),
        ConditionalField(ShortField("service_time", 0), _nscc),
        ConditionalField(BitField("restore_cwnd", 0, 1), _nscc),
        ConditionalField(BitField("rcv_cwnd_pend", 0, 7), _nscc),
        ConditionalField(ThreeBytesField("rcvd_bytes", 0), _nscc),
        ConditionalField(ThreeBytesField("credit", 0), _credit),
        ConditionalField(ByteField("credit_rsvd8", 0), _credit),
        ConditionalField(ShortField("credit_rsvd16", 0), _credit),
        ConditionalField(StrFixedLenField("cc_state", b"\0" * 6, 6), _other_cc),
        ConditionalField(ShortField("ooo_count", 0), _is_ack_cc),
    ]


class UETPDSNack(_UETPDS):
    """NACK (16 bytes)."""

    name = "UET PDS NACK"
    fields_desc = [
        BitEnumField("type", PdsType.NACK, 5, _PDS_TYPES),
        BitEnumField("next_hdr", NextHdr.NONE, 4, _NEXT_HDRS),
        BitField("rsvd_6", 0, 1),
        BitField("ecn_marked", 0, 1),
        BitField("retrans", 0, 1),
        BitField("nack_type", 0, 1),
        BitField("rsvd_2_0", 0, 3),
        ByteEnumField("nack_code", NackCode.TRIMMED, _NACK_CODES),
        ByteField("vendor_code", 0),
        IntField("nack_psn", 0),
        ShortField("spdcid", 0),
        ShortField("dpdcid", 0),
        IntField("nack_payload", 0),
    ]


class UETPDSControl(_UETPDS):
    """CONTROL (16 bytes); ctl_type sits where other PDS headers have next_hdr."""

    name = "UET PDS Control"
    fields_desc = [
        BitEnumField("type", PdsType.CONTROL, 5, _PDS_TYPES),
        BitEnumField("ctl_type", CtlType.NOOP, 4, _CTL_TYPES),
        BitField("rsvd_6", 0, 1),
        BitField("isrod", 0, 1),
        BitField("retrans", 0, 1),
        BitField("ackreq", 0, 1),
        BitField("syn", 0, 1),
        BitField("rsvd_1_0", 0, 2),
        ShortField("probe_opaque", 0),
        IntField("psn", 0),
        ShortField("spdcid", 0),
        ShortField("dpdcid", 0),
        IntField("ctl_payload", 0),
    ]


def _header_data(pkt: Packet) -> bool:
    return bool(pkt.som and pkt.hdr_data_present)


def _no_header_data(pkt: Packet) -> bool:
    return not _header_data(pkt)


class UETSESStd(Packet):
    """SES standard request header (44 bytes). header_data is there on a SOM packet with
    hdr_data_present; otherwise payload_length and message_offset (this testbed's
    layout on SOM packets too; see agents.wire.uet)."""

    name = "UET SES Standard Request"
    fields_desc = [
        BitField("rsvd_7_6", 0, 2),
        BitEnumField("opcode", SesOpcode.WRITE, 6, _SES_OPCODES),
        BitField("version", 0, 2),
        BitField("delivery_complete", 0, 1),
        BitField("initiator_error", 0, 1),
        BitField("relative_addressing", 0, 1),
        BitField("hdr_data_present", 0, 1),
        BitField("eom", 0, 1),
        BitField("som", 0, 1),
        ShortField("message_id", 0),
        ByteField("ri_generation", 0),
        ThreeBytesField("job_id", 0),
        BitField("rsvd_pid", 0, 4),
        BitField("pid_on_fep", 0, 12),
        BitField("rsvd_ri", 0, 4),
        BitField("resource_index", 0, 12),
        LongField("buffer_offset", 0),
        IntField("initiator", 0),
        LongField("memory_key", 0),
        ConditionalField(LongField("header_data", 0), _header_data),
        ConditionalField(ShortField("rsvd_tail", 0), _no_header_data),
        ConditionalField(BitField("rsvd_len", 0, 2), _no_header_data),
        ConditionalField(BitField("payload_length", 0, 14), _no_header_data),
        ConditionalField(IntField("message_offset", 0), _no_header_data),
        IntField("request_length", 0),
    ]


_BY_TYPE: dict[int, type[Packet]] = {
    PdsType.RUD_REQ: UETPDSRequest,
    PdsType.RUD_CC_REQ: UETPDSRequest,
    PdsType.ACK: UETPDSAck,
    PdsType.ACK_CC: UETPDSAck,
    PdsType.NACK: UETPDSNack,
    PdsType.CONTROL: UETPDSControl,
}

for _cls in (UETPDSRequest, UETPDSAck, UETPDSNack, UETPDSControl):
    # scapy consults dispatch_hook only where a class defines it itself, not inherited
    _cls.dispatch_hook = _UETPDS.__dict__["dispatch_hook"]  # type: ignore[method-assign]
    bind_layers(UDP, _cls, dport=UET_UDP_PORT)
# The source port is the entropy and may be any port, some of which scapy binds to other
# protocols (53 to DNS, ...); the destination port 4793 decides, so its bindings go first.
UDP.payload_guess.sort(key=lambda guess: guess[1] not in _BY_TYPE.values())
bind_layers(UETPDSRequest, UETSESStd, next_hdr=NextHdr.REQUEST_STD)
