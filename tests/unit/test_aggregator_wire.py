"""The in-network aggregation header (agents.wire.ina): round trips, every malformed
reason, and the scapy layer (tests/ina_scapy.py) reading what build() writes."""

from __future__ import annotations

import re
import struct

import numpy as np
import pytest
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import raw

from agents.wire import ina
from agents.wire.ina import (
    AGGREGATOR,
    EXP_NONE,
    HEADER,
    HEADER_BYTES,
    INA_UDP_PORT,
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
from tests.conftest import REPO
from tests.ina_scapy import INA, bind_port

REQ = Header(PacketType.REQUEST, job=7, chunk=70001, slot=17, gen=1, sender=3, exponent=-29,
             next_exp=4)
RES = Header(PacketType.RESULT, job=0xFFFFFFFF, chunk=5, slot=5, gen=0, sender=AGGREGATOR,
             exponent=32767, next_exp=-32767, bitmap=(1 << 64) - 1)
PAR = Header(PacketType.PARTIAL, job=1, chunk=0, slot=0, gen=0, sender=0xFFFE, bitmap=0b11)


def _values(n: int, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    v = rng.integers(-(1 << 31), 1 << 31, size=n, dtype=np.int64).astype(np.int32)
    if n >= 2:
        v[:2] = [-(1 << 31), (1 << 31) - 1]       # the extremes survive the trip
    return v


def test_header_is_32_bytes_and_big_endian():
    assert HEADER_BYTES == 32
    b = build(REQ, np.array([1, -1], dtype=np.int32))
    assert b[:4] == b"IN\x01\x01"
    assert struct.unpack_from("!IIHBBHHhhQ", b, 4) == (7, 70001, 17, 1, 0, 3, 2, -29, 4, 0)
    assert b[32:] == b"\x00\x00\x00\x01\xff\xff\xff\xff"


@pytest.mark.parametrize("header", [REQ, RES, PAR], ids=["request", "result", "partial"])
@pytest.mark.parametrize("n", [0, 1, 1024, MAX_ELEMENTS])
def test_round_trip(header, n):
    values = _values(n)
    pkt = parse(build(header, values))
    assert pkt.header == header._replace(elements=n)
    assert np.array_equal(pkt.values.astype(np.int32), values)


def test_payload_may_be_any_int32_byte_order_or_wire_bytes():
    v = _values(9)
    wire = build(REQ, v)
    assert build(REQ, v.astype("<i4")) == wire
    assert build(REQ, v.astype(">i4").tobytes()) == wire
    assert build(REQ, memoryview(v.astype(">i4").tobytes())) == wire


def test_parse_reads_a_memoryview_of_a_larger_buffer():
    buf = bytearray(9000)
    wire = build(RES, _values(5))
    buf[:len(wire)] = wire
    pkt = parse(memoryview(buf)[:len(wire)])
    assert pkt.header.elements == 5 and np.array_equal(pkt.values, _values(5))


def test_slot_and_generation_of_a_chunk():
    assert [(slot_of(c, 4), gen_of(c, 4)) for c in range(10)] == [
        (0, 0), (1, 0), (2, 0), (3, 0), (0, 1), (1, 1), (2, 1), (3, 1), (0, 0), (1, 0)]


@pytest.mark.parametrize("header, values, match", [
    (REQ._replace(bitmap=1), b"", "bitmap"),
    (RES._replace(bitmap=0), b"", "bitmap"),
    (REQ._replace(sender=AGGREGATOR), b"", "sender"),
    (RES._replace(sender=0), b"", "sender"),
    (REQ._replace(gen=2), b"", "gen"),
    (REQ._replace(slot=1 << 16), b"", "slot"),
    (REQ._replace(chunk=1 << 32), b"", "u32"),
    (REQ._replace(exponent=1 << 15), b"", "i16"),
    (REQ, np.zeros(3, dtype=np.int64), "int32"),
    (REQ, np.zeros(3, dtype=np.float32), "int32"),
    (REQ, b"\x00" * 5, "whole int32"),
    (REQ, np.zeros(MAX_ELEMENTS + 1, dtype=np.int32), "fit one datagram"),
])
def test_build_refuses_what_no_receiver_accepts(header, values, match):
    with pytest.raises(ValueError, match=match):
        build(header, values)


def _patched(offset: int, fmt: str, value: int, base: bytes | None = None) -> bytes:
    b = bytearray(base if base is not None else build(REQ, _values(4)))
    struct.pack_into(fmt, b, offset, value)
    return bytes(b)


GOOD = build(REQ, _values(4))


MALFORMED = [
    (b"", MalformedReason.TOO_SHORT),
    (GOOD[:31], MalformedReason.TOO_SHORT),
    (_patched(0, "!H", 0x4E49), MalformedReason.BAD_MAGIC),
    (_patched(2, "!B", 2), MalformedReason.BAD_VERSION),
    (_patched(2, "!B", 0), MalformedReason.BAD_VERSION),
    (_patched(3, "!B", 0), MalformedReason.UNKNOWN_TYPE),
    (_patched(3, "!B", 4), MalformedReason.UNKNOWN_TYPE),
    (_patched(14, "!B", 0x03), MalformedReason.RESERVED_BITS),
    (_patched(14, "!B", 0x80), MalformedReason.RESERVED_BITS),
    (_patched(15, "!B", 1), MalformedReason.RESERVED_BITS),
    (GOOD[:-1], MalformedReason.BAD_LENGTH),
    (GOOD + b"\x00" * 4, MalformedReason.BAD_LENGTH),
    (_patched(18, "!H", 5), MalformedReason.BAD_LENGTH),
    (_patched(16, "!H", AGGREGATOR), MalformedReason.BAD_SENDER),
    (_patched(16, "!H", 0, build(RES, b"")), MalformedReason.BAD_SENDER),
    (_patched(24, "!Q", 1), MalformedReason.BAD_BITMAP),
    (_patched(24, "!Q", 0, build(PAR, b"")), MalformedReason.BAD_BITMAP),
    (_patched(24, "!Q", 0, build(RES, b"")), MalformedReason.BAD_BITMAP),
]


@pytest.mark.parametrize("data, reason", MALFORMED)
def test_every_malformed_reason(data, reason):
    with pytest.raises(MalformedPacket) as e:
        parse(data)
    assert e.value.reason is reason


def test_every_reason_is_tested():
    tested = {r for _, r in MALFORMED}
    assert tested == set(MalformedReason)


def test_random_garbage_raises_only_malformed_packet():
    rng = np.random.default_rng(3)
    for _ in range(3000):
        n = int(rng.integers(0, 80))
        data = bytearray(rng.integers(0, 256, size=n, dtype=np.uint8).tobytes())
        if n >= 4 and rng.random() < 0.7:
            data[:4] = GOOD[:4]                  # get past the magic and version sometimes
        try:
            parse(bytes(data))
        except MalformedPacket:
            pass


# --------------------------------------------------------------------------- scapy


def test_scapy_decodes_what_build_writes():
    v = _values(6)
    for header in (REQ, RES, PAR):
        s = INA(build(header, v))
        assert (s.magic, s.version, s.type) == (0x494E, 1, int(header.type))
        assert (s.job, s.chunk, s.slot, s.gen, s.sender) == (
            header.job, header.chunk, header.slot, header.gen, header.sender)
        assert (s.elements, s.exponent, s.next_exp, s.bitmap) == (
            6, header.exponent, header.next_exp, header.bitmap)
        assert s.values == v.tolist()


def test_scapy_builds_what_parse_reads():
    s = INA(type="PARTIAL", job=9, chunk=12, slot=4, gen=1, sender=2, exponent=-3, next_exp=1,
            bitmap=0b110, values=[5, -6, 7])
    pkt = parse(raw(s))
    assert pkt.header == Header(PacketType.PARTIAL, 9, 12, 4, 1, 2, -3, 1, 0b110, 3)
    assert pkt.values.tolist() == [5, -6, 7]
    assert raw(INA()) == build(Header(PacketType.REQUEST, 0, 0, 0, 0, 0, 0, EXP_NONE))


def test_scapy_finds_the_layer_on_the_aggregator_port_both_ways():
    payload = build(RES, _values(3))
    to_agg = Ether(raw(Ether() / IP(dst="198.18.0.0") / UDP(sport=47001, dport=INA_UDP_PORT)
                       / payload))
    from_agg = Ether(raw(Ether() / IP(src="198.18.0.0") / UDP(sport=INA_UDP_PORT, dport=47001)
                         / payload))
    assert to_agg.haslayer(INA) and from_agg.haslayer(INA)
    assert to_agg[INA].values == _values(3).tolist()
    other = Ether(raw(Ether() / IP() / UDP(sport=1, dport=49001) / payload))
    assert not other.haslayer(INA)
    bind_port(49001)
    assert Ether(raw(Ether() / IP() / UDP(sport=1, dport=49001) / payload)).haslayer(INA)


# --------------------------------------------------------------------------- docs


def _doc_rows() -> list[tuple[int, int, str]]:
    """(offset, size, field) of docs/ina.md's packet table, payload excluded."""
    text = (REPO / "docs" / "ina.md").read_text()
    section = text[text.index("## The packet"):text.index("## The aggregator")]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("|") and cells[0].isdigit() and cells[2] != "payload":
            rows.append((int(cells[0]), int(cells[1]), cells[2]))
    return rows


def test_docs_packet_table_is_the_struct():
    sizes = [struct.calcsize("!" + f) for f in HEADER.format.lstrip("!")]
    rows = _doc_rows()
    assert [size for _, size, _ in rows] == sizes
    assert [off for off, _, _ in rows] == [sum(sizes[:i]) for i in range(len(sizes))]
    names = [name for _, _, name in rows]
    assert names == ["magic", "version", "type", "job", "chunk", "slot", "flags", "reserved",
                     "sender", "elements", "exponent", "next_exp", "bitmap"]
    doc = ina.__doc__ or ""
    for off, size, name in rows:        # the module docstring's table says the same
        assert re.search(rf"^\s+{off}\s+{size}\s+{name}\s", doc, re.M), name


def test_docs_name_every_reason():
    from agents.aggregator.logic import DropReason

    text = (REPO / "docs" / "ina.md").read_text()
    for r in MalformedReason:
        assert f"`{r.name}`" in text, r.name
    for d in DropReason:
        assert f"`{d.value}`" in text, d.value
