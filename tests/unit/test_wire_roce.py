"""RoCEv2 wire formats (agents.wire.roce / agents.wire.icrc), cross-checked against scapy.

scapy.contrib.roce is the reference for BTH, AETH, CNP and the ICRC; it has no
RETH class, so RETH bytes are checked by hand. No root needed.
"""

from __future__ import annotations

import os
import random
import struct
import time
import zlib
from collections import Counter

import pytest
from scapy.contrib.roce import AETH as ScapyAETH
from scapy.contrib.roce import BTH as ScapyBTH
from scapy.contrib.roce import CNPPadding
from scapy.contrib.roce import _bth_opcodes as scapy_opcode_names
from scapy.contrib.roce import cnp as scapy_cnp
from scapy.layers.inet import IP, UDP
from scapy.layers.inet6 import IPv6
from scapy.packet import Raw, raw

from agents.wire.icrc import (
    IcrcContext,
    icrc_bytes,
    icrc_for_udp_payload,
    icrc_of_ip_packet,
    ipv4_header_for_icrc,
    ipv6_header_for_icrc,
)
from agents.wire.roce import (
    AETH_BYTES,
    BTH_BYTES,
    CNP_OPCODE,
    CNP_RESERVED_BYTES,
    IMMDT_BYTES,
    OPCODES,
    PSN_MASK,
    RETH_BYTES,
    ROCE_UDP_PORT,
    UC_OFFSET,
    UNLIMITED_CREDITS,
    Aeth,
    AethKind,
    Bth,
    MalformedPacket,
    MalformedReason,
    NakCode,
    Opcode,
    Reth,
    ack_syndrome,
    aeth_ack,
    aeth_nak,
    aeth_rnr_nak,
    build_cnp,
    build_packet,
    decode_syndrome,
    encode_packet,
    nak_syndrome,
    opcode_info,
    pack_aeth,
    pack_bth,
    pack_reth,
    parse_datagram,
    parse_packet,
    psn_add,
    psn_diff,
    psn_ge,
    psn_gt,
    psn_le,
    psn_lt,
    psn_sub,
    rnr_nak_syndrome,
    unpack_aeth,
    unpack_bth,
    unpack_reth,
)

SRC, DST = "198.18.255.0", "198.18.255.1"
SRC6, DST6 = "2001:db8::1", "2001:db8::2"
SPORT = 0xC0DE
CTX = IcrcContext(SRC, DST, SPORT)
CTX6 = IcrcContext(SRC6, DST6, SPORT)

RC_PAYLOAD_OPS = [o for o in Opcode if OPCODES[o].payload]
ALL_OPS = list(Opcode)


# ------------------------------------------------------------------ helpers

def scapy_datagram(bth: Bth, ext: bytes = b"", payload: bytes = b"", *, ipv6: bool = False,
                   aeth: Aeth | None = None, tos: int = 0) -> bytes:
    """The whole IP packet built by scapy (ICRC computed by scapy), pad appended."""
    pad = -len(payload) & 3
    ip = (IPv6(src=SRC6, dst=DST6, tc=tos) if ipv6
          else IP(src=SRC, dst=DST, id=0, flags="DF", tos=tos))
    sb = ScapyBTH(opcode=bth.opcode, solicited=int(bth.se), migreq=int(bth.m), padcount=pad,
                  version=bth.tver, pkey=bth.p_key, fecn=int(bth.fecn), becn=int(bth.becn),
                  dqpn=bth.dest_qp, ackreq=int(bth.ack_req), psn=bth.psn)
    pkt = ip / UDP(sport=SPORT, dport=ROCE_UDP_PORT) / sb
    if aeth is not None:
        pkt = pkt / ScapyAETH(syndrome=aeth.syndrome, msn=aeth.msn)
    body = ext + payload + bytes(pad)
    if body:
        pkt = pkt / Raw(body)
    return raw(pkt)


def udp_payload(ip_packet: bytes) -> bytes:
    return ip_packet[(40 if ip_packet[0] >> 4 == 6 else 20) + 8:]


def with_icrc(body: bytes, ctx: IcrcContext = CTX) -> bytes:
    """Arbitrary BTH+... bytes with a correct ICRC appended (to reach the checks after it)."""
    return body + icrc_bytes(ctx.icrc(body))


def raw_bth(opcode: int, flags: int = 0, qp: int = 1, psn: int = 0) -> bytes:
    return struct.pack("!BBHII", opcode, flags, 0xFFFF, qp, psn)


def example_packets() -> list[bytes]:
    return [
        encode_packet(CTX, Bth(Opcode.RC_SEND_ONLY, dest_qp=3, psn=9), payload=b"abcde"),
        encode_packet(CTX, Bth(Opcode.RC_RDMA_WRITE_FIRST, dest_qp=3, psn=10),
                      reth=Reth(0x1122334455667788, 0xAABBCCDD, 8192), payload=bytes(64)),
        encode_packet(CTX, Bth(Opcode.RC_ACKNOWLEDGE, dest_qp=3, psn=10), aeth=aeth_ack(4)),
        encode_packet(CTX, Bth(Opcode.RC_SEND_MIDDLE, dest_qp=3, psn=11), payload=bytes(16)),
        bytes(build_cnp(bytearray(64), CTX, 3)),
        encode_packet(CTX, Bth(Opcode.RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE, dest_qp=3, psn=12),
                      reth=Reth(0x1000, 7, 3), payload=b"xyz", imm=0xCAFE0001),
        encode_packet(CTX, Bth(Opcode.RC_RDMA_WRITE_LAST_WITH_IMMEDIATE, dest_qp=3, psn=13),
                      payload=bytes(8), imm=5),
    ]


def reason_of(data: bytes, ctx: IcrcContext = CTX) -> MalformedReason | None:
    try:
        parse_packet(data, ctx)
    except MalformedPacket as exc:
        return exc.reason
    return None


# ------------------------------------------------------------------ opcodes

def test_opcode_values_and_names_match_the_spec_and_scapy():
    assert Opcode.RC_SEND_FIRST == 0x00 and Opcode.RC_SEND_MIDDLE == 0x01
    assert Opcode.RC_SEND_LAST == 0x02 and Opcode.RC_SEND_ONLY == 0x04
    assert Opcode.RC_RDMA_WRITE_FIRST == 0x06 and Opcode.RC_RDMA_WRITE_MIDDLE == 0x07
    assert Opcode.RC_RDMA_WRITE_LAST == 0x08 and Opcode.RC_RDMA_WRITE_ONLY == 0x0A
    assert Opcode.RC_RDMA_WRITE_LAST_WITH_IMMEDIATE == 0x09
    assert Opcode.RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE == 0x0B
    assert Opcode.RC_ACKNOWLEDGE == 0x11 and Opcode.CNP == CNP_OPCODE == 0x81
    for op in Opcode:
        assert scapy_opcode_names[int(op)] == op.name
        if op.name.startswith("UC_"):
            assert op == Opcode["RC_" + op.name[3:]] + UC_OFFSET


def test_each_opcode_declares_the_headers_that_follow_the_bth():
    with_reth = {o for o in Opcode if OPCODES[o].reth}
    with_imm = {o for o in Opcode if OPCODES[o].imm}
    with_aeth = {o for o in Opcode if OPCODES[o].aeth}
    assert with_reth == {Opcode.RC_RDMA_WRITE_FIRST, Opcode.RC_RDMA_WRITE_ONLY,
                         Opcode.RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE,
                         Opcode.UC_RDMA_WRITE_FIRST, Opcode.UC_RDMA_WRITE_ONLY,
                         Opcode.UC_RDMA_WRITE_ONLY_WITH_IMMEDIATE}
    assert with_imm == {Opcode.RC_RDMA_WRITE_LAST_WITH_IMMEDIATE,
                        Opcode.RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE,
                        Opcode.UC_RDMA_WRITE_LAST_WITH_IMMEDIATE,
                        Opcode.UC_RDMA_WRITE_ONLY_WITH_IMMEDIATE}
    assert with_aeth == {Opcode.RC_ACKNOWLEDGE}
    assert OPCODES[Opcode.CNP].cnp and not OPCODES[Opcode.CNP].payload
    assert OPCODES[0x80].cnp                       # the kernel's name for a CNP also parses
    for op in Opcode:
        info = OPCODES[op]
        assert info.header_bytes == BTH_BYTES + RETH_BYTES * info.reth + IMMDT_BYTES * info.imm \
            + AETH_BYTES * info.aeth + CNP_RESERVED_BYTES * info.cnp
        is_end = op.name.endswith(("_ONLY", "_LAST", "_ONLY_WITH_IMMEDIATE",
                                   "_LAST_WITH_IMMEDIATE"))
        assert info.pad == is_end
    assert opcode_info(0x31) is None             # UC has no ACKNOWLEDGE
    assert opcode_info(0x64) is None and opcode_info(-1) is None and opcode_info(256) is None


# ------------------------------------------------------------------ headers

BTH_CASES = [
    Bth(Opcode.RC_SEND_ONLY),
    Bth(Opcode.RC_SEND_ONLY, se=True, m=True, p_key=0x8001, fecn=True, becn=True,
        dest_qp=0xFFFFFF, ack_req=True, psn=0xFFFFFF),
    Bth(Opcode.UC_RDMA_WRITE_MIDDLE, p_key=0, dest_qp=0x000001, psn=0x800000),
    Bth(Opcode.RC_ACKNOWLEDGE, pad_count=3, tver=15, dest_qp=0x123456, psn=0x654321),
]


@pytest.mark.parametrize("bth", BTH_CASES)
def test_bth_round_trips_and_matches_scapy_bytes(bth):
    data = pack_bth(bth)
    assert len(data) == BTH_BYTES
    assert unpack_bth(data) == bth
    sb = ScapyBTH(opcode=bth.opcode, solicited=int(bth.se), migreq=int(bth.m),
                  padcount=bth.pad_count, version=bth.tver, pkey=bth.p_key, fecn=int(bth.fecn),
                  becn=int(bth.becn), dqpn=bth.dest_qp, ackreq=int(bth.ack_req), psn=bth.psn,
                  icrc=0)
    assert raw(sb)[:BTH_BYTES] == data


def test_bth_default_p_key_is_ffff_and_fields_are_range_checked():
    assert pack_bth(Bth(0))[2:4] == b"\xff\xff"
    for bad in (Bth(0, dest_qp=1 << 24), Bth(0, psn=1 << 24), Bth(0, tver=16), Bth(0, psn=-1),
                Bth(0, p_key=0x10000), Bth(0, pad_count=4), Bth(256)):
        with pytest.raises(ValueError):
            pack_bth(bad)


def test_reth_bytes_by_hand():
    reth = Reth(va=0x0102030405060708, r_key=0x090A0B0C, dma_length=0x0D0E0F10)
    data = pack_reth(reth)
    assert data == bytes(range(1, 17))
    assert unpack_reth(b"\0" * BTH_BYTES + data) == reth
    with pytest.raises(ValueError):
        pack_reth(Reth(1 << 64, 0, 0))


def test_aeth_round_trips_and_matches_scapy():
    for aeth in (aeth_ack(0), aeth_ack(0xFFFFFF, credits=3),
                 aeth_nak(7, NakCode.REMOTE_ACCESS_ERROR), aeth_rnr_nak(1, 0x1F)):
        data = pack_aeth(aeth)
        assert data == raw(ScapyAETH(syndrome=aeth.syndrome, msn=aeth.msn))
        assert unpack_aeth(b"\0" * BTH_BYTES + data) == aeth
    with pytest.raises(ValueError):
        pack_aeth(Aeth(0, 1 << 24))


def test_ack_rnr_and_nak_syndromes():
    assert ack_syndrome() == UNLIMITED_CREDITS == 0x1F
    assert aeth_ack(5) == Aeth(0x1F, 5)
    assert [nak_syndrome(c) for c in NakCode] == [0x60, 0x61, 0x62, 0x63]
    assert aeth_nak(9).syndrome == 0x60                      # default: PSN sequence error
    assert aeth_nak(9, NakCode.INVALID_REQUEST).syndrome == 0x61
    assert aeth_nak(9, NakCode.REMOTE_ACCESS_ERROR).syndrome == 0x62
    assert aeth_nak(9, NakCode.REMOTE_OPERATIONAL_ERROR).syndrome == 0x63
    assert rnr_nak_syndrome(0x0E) == 0x2E
    assert decode_syndrome(0x1F) == (AethKind.ACK, 0x1F)
    assert decode_syndrome(0x00) == (AethKind.ACK, 0)
    assert decode_syndrome(0x2E) == (AethKind.RNR_NAK, 0x0E)
    assert decode_syndrome(0x60) == (AethKind.NAK, NakCode.PSN_SEQUENCE_ERROR)
    assert decode_syndrome(0x63) == (AethKind.NAK, NakCode.REMOTE_OPERATIONAL_ERROR)
    assert decode_syndrome(0x45) == (AethKind.RESERVED, 0x45)
    assert decode_syndrome(0x9F) == (AethKind.RESERVED, 0x9F)
    assert aeth_nak(1, NakCode.INVALID_REQUEST).kind == AethKind.NAK
    assert aeth_nak(1, NakCode.INVALID_REQUEST).value == NakCode.INVALID_REQUEST
    for bad in (-1, 0x20):
        for helper in (ack_syndrome, rnr_nak_syndrome, nak_syndrome):
            with pytest.raises(ValueError):
                helper(bad)


# ------------------------------------------------------------------ whole packets vs scapy

def _packet_args(op: Opcode, payload_len: int):
    info = OPCODES[op]
    reth = Reth(0xDEADBEEF00001000 + payload_len, 0x1234ABCD, 65536) if info.reth else None
    aeth = aeth_nak(0xABCDEF, NakCode.PSN_SEQUENCE_ERROR) if info.aeth else None
    imm = 0x89ABCDEF - payload_len if info.imm else None
    if not info.payload:
        payload_len = 0
    elif not info.pad:
        payload_len -= payload_len % 4
    payload = bytes((i * 7 + 3) & 0xFF for i in range(payload_len))
    return reth, aeth, imm, payload


def _ext_bytes(op: Opcode, reth: Reth | None, imm: int | None) -> bytes:
    """What follows the BTH before the payload, by hand (scapy has no RETH or ImmDt)."""
    if op == Opcode.CNP:
        return bytes(16)
    return (pack_reth(reth) if reth else b"") + (struct.pack("!I", imm) if imm is not None
                                                 else b"")


@pytest.mark.parametrize("ipv6", [False, True], ids=["ipv4", "ipv6"])
@pytest.mark.parametrize("payload_len", [0, 1, 2, 3, 4, 1023, 4096])
@pytest.mark.parametrize("op", ALL_OPS, ids=lambda o: o.name)
def test_every_opcode_matches_scapy_bytes_and_icrc(op, payload_len, ipv6):
    ctx = CTX6 if ipv6 else CTX
    reth, aeth, imm, payload = _packet_args(op, payload_len)
    bth = Bth(op, se=payload_len % 2 == 1, p_key=0xFFFF, fecn=payload_len == 3,
              becn=op == Opcode.CNP, dest_qp=0x00ABCD + payload_len, ack_req=True,
              psn=(0xFFFFF0 + payload_len) & PSN_MASK)
    if op == Opcode.CNP:
        bth = bth._replace(ack_req=False, psn=0)
    ours = encode_packet(ctx, bth, reth=reth, aeth=aeth, payload=payload, imm=imm)
    theirs = scapy_datagram(bth, _ext_bytes(op, reth, imm), payload, ipv6=ipv6, aeth=aeth)
    assert ours == udp_payload(theirs)          # every header byte, pad and the ICRC

    parsed = parse_packet(ours, ctx)
    assert parsed.bth == bth._replace(pad_count=-len(payload) & 3)
    assert (parsed.reth, parsed.aeth, parsed.imm, bytes(parsed.payload)) == (reth, aeth, imm,
                                                                             payload)
    assert icrc_bytes(parsed.icrc) == ours[-4:]


@pytest.mark.parametrize("op", ALL_OPS, ids=lambda o: o.name)
def test_scapy_dissects_our_packets_field_by_field(op):
    reth, aeth, imm, payload = _packet_args(op, 37)
    bth = Bth(op, se=True, m=True, p_key=0x7FFF, fecn=True, becn=True, dest_qp=0xFEDCBA,
              ack_req=True, psn=0x00000F)
    ours = encode_packet(CTX, bth, reth=reth, aeth=aeth, payload=payload, imm=imm)
    header = ipv4_header_for_icrc(SRC, DST, 28 + len(ours))
    udp = struct.pack("!HHHH", SPORT, ROCE_UDP_PORT, 8 + len(ours), 0)
    pkt = IP(header + udp + ours)
    b = pkt[ScapyBTH]
    assert (b.opcode, b.solicited, b.migreq, b.padcount, b.version, b.pkey) == \
        (op, 1, 1, -len(payload) & 3, 0, 0x7FFF)
    assert (b.fecn, b.becn, b.resv6, b.dqpn, b.ackreq, b.resv7, b.psn) == \
        (1, 1, 0, 0xFEDCBA, 1, 0, 0x00000F)
    assert struct.pack("!I", b.icrc) == ours[-4:]
    if aeth is not None:
        assert (pkt[ScapyAETH].syndrome, pkt[ScapyAETH].msn) == aeth
    if op == Opcode.CNP:
        assert pkt.haslayer(CNPPadding)
    # scapy recomputes the ICRC from the header it sees: the same four bytes.
    b.icrc = None
    assert raw(pkt)[-4:] == ours[-4:]
    assert icrc_of_ip_packet(header + udp + ours) == (CTX.icrc(ours[:-4]),) * 2


def test_write_with_immediate_is_bth_reth_immdt_payload_pad_icrc_byte_by_byte():
    # ONLY WITH IMMEDIATE: BTH, RETH, ImmDt, payload, pad, ICRC
    reth = Reth(0x0102030405060708, 0x0A0B0C0D, 5)
    bth = Bth(Opcode.RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE, dest_qp=0x123456, ack_req=True,
              psn=0xABCDEF)
    only = encode_packet(CTX, bth, reth=reth, payload=b"hello", imm=0xDEADBEEF)
    assert len(only) == 12 + 16 + 4 + 5 + 3 + 4
    assert only[:12] == bytes([0x0B, 0x30, 0xFF, 0xFF, 0x00, 0x12, 0x34, 0x56,
                               0x80, 0xAB, 0xCD, 0xEF])          # PadCnt 3, AckReq
    assert only[12:28] == bytes(range(1, 9)) + bytes([0x0A, 0x0B, 0x0C, 0x0D, 0, 0, 0, 5])
    assert only[28:32] == bytes([0xDE, 0xAD, 0xBE, 0xEF])           # ImmDt, big-endian
    assert only[32:37] == b"hello" and only[37:40] == bytes(3)
    assert only[40:] == icrc_bytes(CTX.icrc(only[:40]))
    # LAST WITH IMMEDIATE: BTH, ImmDt, payload, ICRC (no RETH)
    last = encode_packet(CTX, Bth(Opcode.RC_RDMA_WRITE_LAST_WITH_IMMEDIATE, dest_qp=0x123456,
                                  psn=1), payload=b"12345678", imm=0x00000102)
    assert len(last) == 12 + 4 + 8 + 4
    assert last[0] == 0x09 and last[1] == 0x00
    assert last[12:16] == bytes([0, 0, 1, 2]) and last[16:24] == b"12345678"
    # a zero-length WRITE with immediate: one ONLY packet, DMA length 0, no payload
    empty = encode_packet(CTX, Bth(Opcode.RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE, dest_qp=1),
                          reth=Reth(0, 0, 0), imm=7)
    assert len(empty) == 12 + 16 + 4 + 4 and empty[24:28] == bytes(4)
    assert empty[28:32] == bytes([0, 0, 0, 7])
    # scapy names the opcodes, dissects the BTH and recomputes the same ICRC
    for pkt, name in ((only, "RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE"),
                      (last, "RC_RDMA_WRITE_LAST_WITH_IMMEDIATE"),
                      (empty, "RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE")):
        header = ipv4_header_for_icrc(SRC, DST, 28 + len(pkt))
        udp = struct.pack("!HHHH", SPORT, ROCE_UDP_PORT, 8 + len(pkt), 0)
        sp = IP(header + udp + pkt)
        b = sp[ScapyBTH]
        assert scapy_opcode_names[b.opcode] == name
        assert (b.dqpn, b.padcount) == (unpack_bth(pkt).dest_qp, unpack_bth(pkt).pad_count)
        assert raw(b.payload) == pkt[12:-4]          # RETH / ImmDt / payload / pad, as is
        b.icrc = None
        assert raw(sp)[-4:] == pkt[-4:]
    # and parse_packet takes each apart
    p = parse_packet(only, CTX)
    assert (p.reth, p.imm, bytes(p.payload)) == (reth, 0xDEADBEEF, b"hello")
    p = parse_packet(last, CTX)
    assert (p.reth, p.imm, bytes(p.payload)) == (None, 0x102, b"12345678")
    p = parse_packet(empty, CTX)
    assert (p.reth, p.imm, bytes(p.payload)) == (Reth(0, 0, 0), 7, b"")
    assert parse_packet(example_packets()[0], CTX).imm is None
    # one byte short of the ImmDt: too short for the opcode
    assert reason_of(with_icrc(last[:15])) == MalformedReason.TOO_SHORT


def test_cnp_layout_opcode_0x81_becn_and_16_zero_bytes():
    buf = bytearray(b"\xee" * 64)
    pkt = bytes(build_cnp(buf, CTX, dest_qp=0x0A0B0C))
    assert len(pkt) == BTH_BYTES + CNP_RESERVED_BYTES + 4 == 32
    assert pkt[0] == 0x81
    assert pkt[4] == 0x40                                     # BECN=1, FECN=0, resv 0
    assert pkt[5:8] == b"\x0a\x0b\x0c"
    assert pkt[8:12] == bytes(4)                              # AckReq 0, PSN 0
    assert pkt[12:28] == bytes(16)
    assert pkt == udp_payload(raw(IP(src=SRC, dst=DST, id=0, flags="DF")
                                  / UDP(sport=SPORT, dport=ROCE_UDP_PORT) / scapy_cnp(0x0A0B0C)))
    p = parse_packet(pkt, CTX)
    assert p.bth.opcode == Opcode.CNP and p.bth.becn and p.bth.dest_qp == 0x0A0B0C
    assert len(p.payload) == 0
    assert parse_packet(bytes(build_cnp(buf, CTX, 5, opcode=0x80)), CTX).bth.opcode == 0x80
    with pytest.raises(ValueError):
        build_cnp(buf, CTX, 5, opcode=0x82)


# ------------------------------------------------------------------ ICRC

def test_icrc_is_zlib_crc32_over_the_masked_pseudo_header_sent_little_endian():
    body = pack_bth(Bth(Opcode.RC_SEND_ONLY, becn=True, dest_qp=17, psn=1)) + b"data"
    total = 20 + 8 + len(body) + 4
    masked_ip = bytearray(ipv4_header_for_icrc(SRC, DST, total))
    masked_ip[1] = masked_ip[8] = 0xFF
    masked_ip[10:12] = b"\xff\xff"
    masked_udp = struct.pack("!HHHH", SPORT, ROCE_UDP_PORT, total - 20, 0xFFFF)
    masked_bth = body[:4] + b"\xff" + body[5:]
    expected = zlib.crc32(b"\xff" * 8 + bytes(masked_ip) + masked_udp + masked_bth)
    assert icrc_for_udp_payload(SRC, DST, SPORT, ROCE_UDP_PORT, body) == expected
    scapy_icrc = scapy_datagram(unpack_bth(body), payload=b"data")[-4:]
    assert scapy_icrc == expected.to_bytes(4, "little") == icrc_bytes(expected)
    # zlib.crc32 already applies the final inversion; inverting again is wrong.
    assert (~expected & 0xFFFFFFFF).to_bytes(4, "little") != scapy_icrc


def test_predicted_ipv4_header_is_what_scapy_builds_for_id0_df():
    for total in (48, 1052, 4124):
        ours = ipv4_header_for_icrc(SRC, DST, total, tos=0x6B, ttl=64)
        theirs = raw(IP(src=SRC, dst=DST, id=0, flags="DF", tos=0x6B, ttl=64, len=total,
                        proto=17))[:20]
        assert ours == theirs
    assert ipv4_header_for_icrc(SRC, DST, 48)[6:8] == b"\x40\x00"
    assert ipv4_header_for_icrc(SRC, DST, 48, df=False, ip_id=7)[4:8] == b"\x00\x07\x00\x00"
    v6 = ipv6_header_for_icrc(SRC6, DST6, 100, traffic_class=0x6B, flow_label=0x12345)
    assert v6 == raw(IPv6(src=SRC6, dst=DST6, tc=0x6B, fl=0x12345, plen=100, nh=17, hlim=64))


def test_icrc_ignores_exactly_the_masked_fields():
    pkt = encode_packet(CTX, Bth(Opcode.RC_SEND_ONLY, dest_qp=1, psn=2), payload=b"xyzw")
    ip = ipv4_header_for_icrc(SRC, DST, 28 + len(pkt)) + \
        struct.pack("!HHHH", SPORT, ROCE_UDP_PORT, 8 + len(pkt), 0x1234) + pkt
    stored, computed = icrc_of_ip_packet(ip)
    assert stored == computed

    def changed(offset: int, value: int) -> bytes:
        b = bytearray(ip)
        b[offset] = value
        return bytes(b)

    masked = {1: 0x03, 8: 0x01, 10: 0x00, 11: 0x99, 26: 0x00, 27: 0x01, 28 + 4: 0xC0}
    for offset, value in masked.items():                  # TOS, TTL, checksum, UDP csum, byte 4
        assert icrc_of_ip_packet(changed(offset, value))[1] == computed, offset
    # ID, flags/fragment, addresses, ports, UDP length, BTH bytes 0-3 and 5-11, payload
    for offset in (4, 5, 6, 7, 12, 15, 16, 19, 20, 21, 22, 23, 25, 28, 29, 31, 33, 39, 40):
        assert icrc_of_ip_packet(changed(offset, ip[offset] ^ 0x10))[1] != computed, offset
    # The same datagram with a connected socket's IP ID would not verify.
    other = IcrcContext(SRC, DST, SPORT, ip_id=0x1234)
    assert other.icrc(pkt[:-4]) != CTX.icrc(pkt[:-4])


def test_icrc_context_caches_agree_with_the_one_shot_function():
    rng = random.Random(5)
    for _ in range(300):
        body = bytes(rng.randrange(256) for _ in range(rng.randrange(5, 200)))
        ref = zlib.crc32(CTX.pseudo_header(len(body) + 4) + body[:4] + b"\xff" + body[5:])
        assert CTX.icrc(body) == ref
        assert icrc_for_udp_payload(SRC, DST, SPORT, ROCE_UDP_PORT, body) == ref
        assert CTX.icrc_premasked(body[:4] + b"\xff" + body[5:]) == ref
    with pytest.raises(ValueError):
        IcrcContext(SRC, DST6, 1)
    with pytest.raises(ValueError):
        IcrcContext(SRC, DST, 70000)


# ------------------------------------------------------------------ builder

def test_builder_writes_into_the_preallocated_buffer_and_pads():
    buf = bytearray(b"\xaa" * 256)
    view = build_packet(buf, CTX, Bth(Opcode.RC_SEND_LAST, dest_qp=1, psn=2), payload=b"12345")
    assert isinstance(view, memoryview) and view.obj is buf
    assert len(view) == 12 + 5 + 3 + 4
    assert (buf[1] >> 4) & 3 == 3 and bytes(buf[17:20]) == b"\0\0\0"
    assert buf[len(view)] == 0xAA                          # nothing written past the end
    # numpy-style and memoryview payloads are taken as bytes
    words = memoryview(bytearray(16)).cast("I")
    view = build_packet(buf, CTX, Bth(Opcode.RC_SEND_ONLY), payload=words)
    assert len(view) == 12 + 16 + 4


@pytest.mark.parametrize("kwargs", [
    dict(bth=Bth(Opcode.RC_RDMA_WRITE_FIRST)),                                  # no RETH
    dict(bth=Bth(Opcode.RC_SEND_ONLY), reth=Reth(0, 0, 0)),                     # RETH not allowed
    dict(bth=Bth(Opcode.RC_ACKNOWLEDGE)),                                       # no AETH
    dict(bth=Bth(Opcode.RC_SEND_ONLY), aeth=aeth_ack(0)),
    dict(bth=Bth(Opcode.RC_ACKNOWLEDGE), aeth=aeth_ack(0), payload=b"x"),       # payload on ACK
    dict(bth=Bth(Opcode.CNP), payload=b"abcd"),
    dict(bth=Bth(Opcode.RC_SEND_MIDDLE), payload=b"abc"),                       # pad on MIDDLE
    dict(bth=Bth(Opcode.RC_SEND_ONLY, pad_count=2), payload=b"abc"),            # wrong PadCnt
    dict(bth=Bth(Opcode.RC_SEND_ONLY, dest_qp=1 << 24)),
    dict(bth=Bth(Opcode.RC_SEND_ONLY, psn=1 << 24)),
    dict(bth=Bth(Opcode.RC_SEND_ONLY, p_key=-1)),
    dict(bth=Bth(0x64)),                                                        # unknown opcode
    dict(bth=Bth(Opcode.RC_ACKNOWLEDGE), aeth=Aeth(0x100, 0)),
    dict(bth=Bth(Opcode.RC_RDMA_WRITE_ONLY), reth=Reth(-1, 0, 0)),
    dict(bth=Bth(Opcode.RC_SEND_ONLY), payload=bytes(300)),                     # buffer too small
    dict(bth=Bth(Opcode.RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE), reth=Reth(0, 0, 0)),  # no ImmDt
    dict(bth=Bth(Opcode.RC_RDMA_WRITE_LAST_WITH_IMMEDIATE)),
    dict(bth=Bth(Opcode.RC_RDMA_WRITE_ONLY), reth=Reth(0, 0, 0), imm=1),       # ImmDt not allowed
    dict(bth=Bth(Opcode.RC_RDMA_WRITE_LAST), imm=1),
    dict(bth=Bth(Opcode.RC_RDMA_WRITE_LAST_WITH_IMMEDIATE), imm=1 << 32),       # not 32 bits
    dict(bth=Bth(Opcode.RC_RDMA_WRITE_LAST_WITH_IMMEDIATE), imm=-1),
])
def test_builder_rejects_inconsistent_headers_with_value_error(kwargs):
    with pytest.raises(ValueError):
        build_packet(bytearray(256), CTX, **kwargs)


# ------------------------------------------------------------------ PSN

def test_psn_arithmetic_wraps_at_24_bits():
    assert psn_add(0xFFFFFF, 1) == 0
    assert psn_add(0xFFFFFE, 5) == 3
    assert psn_add(3, -5) == 0xFFFFFE
    assert psn_sub(0, 1) == 0xFFFFFF
    assert psn_sub(2, 0xFFFFFF) == 3
    assert psn_diff(0, 0xFFFFFF) == 1
    assert psn_diff(0xFFFFFF, 0) == -1
    assert psn_diff(5, 5) == 0
    assert psn_diff(0x7FFFFF, 0) == (1 << 23) - 1
    assert psn_diff(0x800000, 0) == -(1 << 23)               # exactly half: "before", as rxe
    assert psn_diff(0, 0x800000) == -(1 << 23)
    assert psn_lt(0xFFFFF0, 0x000010) and psn_gt(0x000010, 0xFFFFF0)
    assert psn_le(7, 7) and psn_ge(7, 7) and not psn_lt(7, 7) and not psn_gt(7, 7)
    assert psn_lt(0, 0x7FFFFF) and not psn_lt(0, 0x800001)
    rng = random.Random(1)
    for _ in range(1000):
        a, n = rng.randrange(1 << 24), rng.randrange(-(1 << 23) + 1, 1 << 23)
        assert psn_diff(psn_add(a, n), a) == n
        assert psn_sub(psn_add(a, n), n) == a


# ------------------------------------------------------------------ malformed input

def test_specific_defects_are_named():
    ack = raw_bth(Opcode.RC_ACKNOWLEDGE) + pack_aeth(aeth_ack(1))
    cases = {
        MalformedReason.TOO_SHORT: [b"", bytes(15), with_icrc(raw_bth(Opcode.RC_ACKNOWLEDGE)),
                                    with_icrc(raw_bth(Opcode.RC_RDMA_WRITE_ONLY) + bytes(12))],
        MalformedReason.BAD_TVER: [with_icrc(raw_bth(Opcode.RC_SEND_ONLY, flags=0x01))],
        MalformedReason.UNKNOWN_OPCODE: [with_icrc(raw_bth(op)) for op in (0x03, 0x31, 0x64, 0xFF)],
        MalformedReason.BAD_LENGTH: [with_icrc(raw_bth(Opcode.RC_SEND_ONLY) + b"abc"),
                                     with_icrc(ack + bytes(4)),
                                     with_icrc(raw_bth(0x81) + bytes(20))],
        MalformedReason.BAD_PAD_COUNT: [
            with_icrc(raw_bth(Opcode.RC_SEND_ONLY, flags=0x10)),            # pad > payload
            with_icrc(raw_bth(Opcode.RC_SEND_MIDDLE, flags=0x20) + bytes(8)),
            with_icrc(raw_bth(Opcode.RC_RDMA_WRITE_FIRST, flags=0x30) + bytes(20)),
            with_icrc(raw_bth(Opcode.RC_ACKNOWLEDGE, flags=0x10) + pack_aeth(aeth_ack(1))),
            with_icrc(raw_bth(0x81, flags=0x10) + bytes(16))],
        MalformedReason.RESERVED_SYNDROME: [
            with_icrc(raw_bth(Opcode.RC_ACKNOWLEDGE) + pack_aeth(Aeth(s, 1)))
            for s in (0x40, 0x5F, 0x80, 0xE0)],
        MalformedReason.BAD_ICRC: [bytes(16), ack + b"\0\0\0\0",
                                   with_icrc(ack, IcrcContext(SRC, DST, SPORT + 1))],
    }
    for reason, datagrams in cases.items():
        for data in datagrams:
            with pytest.raises(MalformedPacket) as info:
                parse_packet(data, CTX)
            assert info.value.reason == reason, (data.hex(), info.value)
    assert reason_of(with_icrc(raw_bth(Opcode.RC_SEND_ONLY, flags=0x30) + b"a\0\0\0")) is None
    assert reason_of(with_icrc(raw_bth(Opcode.RC_SEND_ONLY))) is None       # empty SEND
    assert reason_of(bytes(16) + bytes(1 << 16)) == MalformedReason.BAD_LENGTH  # > any datagram


def test_truncation_at_every_length_raises_only_malformed():
    for pkt in example_packets():
        assert reason_of(pkt) is None
        for cut in range(len(pkt)):
            reason = reason_of(pkt[:cut])
            assert reason in (MalformedReason.TOO_SHORT, MalformedReason.BAD_ICRC), (cut, reason)
            # without the ICRC check, the structural checks alone must still hold
            try:
                parse_packet(pkt[:cut], None, check_icrc=False)
            except MalformedPacket:
                pass


def test_every_single_bit_flip_is_caught_by_the_icrc_except_in_fecn_becn_byte():
    for pkt in example_packets():
        for bit in range(len(pkt) * 8):
            data = bytearray(pkt)
            data[bit // 8] ^= 0x80 >> (bit % 8)
            reason = reason_of(bytes(data))
            if bit // 8 == 4:                       # FECN / BECN / resv6: not covered
                assert reason is None
                p = parse_packet(bytes(data), CTX)
                assert (p.bth.fecn, p.bth.becn) == ((data[4] & 0x80) != 0, (data[4] & 0x40) != 0)
            else:
                assert reason == MalformedReason.BAD_ICRC, bit


def test_random_garbage_raises_only_malformed_and_is_countable():
    rng = random.Random(2024)
    counts: Counter[MalformedReason] = Counter()
    for i in range(20000):
        if i % 2:
            # half with a valid ICRC, mostly known opcodes, TVer 0 and lengths near the
            # opcode's layout, so the checks behind the ICRC are reached too
            info = OPCODES[rng.choice(list(OPCODES))]
            size = info.header_bytes + rng.choice((0, 0, 4, 8, rng.randrange(-12, 1500)))
            b = bytearray(rng.getrandbits(8) for _ in range(max(size, 12)))
            b[0] = info.opcode if rng.random() < 0.9 else rng.randrange(256)
            b[1] &= rng.choice((0xF0, 0xF0, 0xFF))
            data = with_icrc(bytes(b))
        else:
            size = rng.choice((rng.randrange(0, 40), rng.randrange(0, 2000)))
            data = bytes(rng.getrandbits(8) for _ in range(size))
        for check in (True, False):
            try:
                p = parse_packet(data, CTX, check_icrc=check)
            except MalformedPacket as exc:
                assert isinstance(exc.reason, MalformedReason)
                counts[exc.reason] += 1
            else:
                assert p.bth.tver == 0 and opcode_info(p.bth.opcode) is not None
                info = opcode_info(p.bth.opcode)
                assert len(p.payload) + p.bth.pad_count + info.header_bytes + 4 == len(data)
    assert set(counts) == set(MalformedReason)               # every kind was reached


def test_parse_datagram_uses_addresses_and_ports():
    pkt = encode_packet(CTX, Bth(Opcode.RC_SEND_ONLY, dest_qp=1), payload=b"abcd")
    assert bytes(parse_datagram(pkt, SRC, DST, SPORT).payload) == b"abcd"
    assert bytes(parse_datagram(bytearray(pkt), SRC, DST, SPORT, ROCE_UDP_PORT).payload) == b"abcd"
    for args in ((DST, SRC, SPORT), (SRC, DST, SPORT + 1), (SRC, "198.18.255.3", SPORT)):
        with pytest.raises(MalformedPacket) as info:
            parse_datagram(pkt, *args)
        assert info.value.reason == MalformedReason.BAD_ICRC
    assert parse_datagram(pkt, DST, SRC, 1, check_icrc=False).bth.dest_qp == 1


# ------------------------------------------------------------------ speed (printed only)

def test_benchmark_encode_and_parse_4096_byte_payload(capsys):
    buf = bytearray(8192)
    payload = os.urandom(4096)
    bth = Bth(Opcode.RC_SEND_ONLY, dest_qp=0x11, psn=0x22, ack_req=True)
    pkt = bytes(build_packet(buf, CTX, bth, payload=payload))

    def per_packet_ns(fn, n=3000, rounds=5) -> float:
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter_ns()
            for _ in range(n):
                fn()
            best = min(best, (time.perf_counter_ns() - t0) / n)
        return best

    rows = {
        "zlib.crc32 over 4112 B (floor)": per_packet_ns(lambda: zlib.crc32(pkt)),
        "build_packet + ICRC, 4096 B": per_packet_ns(
            lambda: build_packet(buf, CTX, bth, payload=payload)),
        "parse_packet + ICRC check, 4096 B": per_packet_ns(lambda: parse_packet(pkt, CTX)),
        "parse_packet, no ICRC check": per_packet_ns(
            lambda: parse_packet(pkt, None, check_icrc=False)),
        "parse_datagram (cached ctx lookup)": per_packet_ns(
            lambda: parse_datagram(pkt, SRC, DST, SPORT)),
    }
    with capsys.disabled():
        print()
        for name, ns in rows.items():
            print(f"  {name:38s} {ns / 1000:6.2f} us/packet  ({1e9 / ns:9,.0f} packets/s)")
