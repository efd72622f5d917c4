"""Property-based and fuzz tests of every wire format in agents/wire.

Round trips: BTH, RETH, AETH, whole RoCE packets through `encode_packet` /
`parse_packet` (ICRC included), CNPs, PFC frames, INA headers, and UET packets
(every packet `parse` accepts re-packs to the same bytes' meaning). Fuzz: random
and mutated bytes into every public parser, which may raise only its documented
exception. Bounded (max_examples, no deadline; FUZZ_CASES seeded inputs per parser) so
`make test` runs them in seconds.
"""

from __future__ import annotations

import dataclasses
import random
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agents.wire import icrc, ina, pfc, uet
from agents.wire import roce as r

FAST = settings(max_examples=100, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])
#: Seeded fuzz inputs per parser: random bytes plus mutations (byte edits, cuts,
#: appended junk) of real packets; plain `random`, so thousands take milliseconds.
FUZZ_CASES = 3000

CTX = icrc.icrc_context("10.0.0.1", "10.0.0.2", 49152)

u8, u16, u24, u32, u64 = (st.integers(0, (1 << b) - 1) for b in (8, 16, 24, 32, 64))

bths = st.builds(r.Bth, opcode=u8, se=st.booleans(), m=st.booleans(),
                 pad_count=st.integers(0, 3), tver=st.integers(0, 15), p_key=u16,
                 fecn=st.booleans(), becn=st.booleans(), dest_qp=u24,
                 ack_req=st.booleans(), psn=u24)


# --------------------------------------------------------------------------- RoCE

@FAST
@given(bths)
def test_bth_round_trip(bth):
    data = r.pack_bth(bth)
    assert len(data) == r.BTH_BYTES
    assert r.unpack_bth(data) == bth


@FAST
@given(u64, u32, u32)
def test_reth_round_trip(va, key, length):
    reth = r.Reth(va, key, length)
    assert r.unpack_reth(r.pack_reth(reth), 0) == reth


@FAST
@given(u8, u24)
def test_aeth_round_trip(syndrome, msn):
    aeth = r.Aeth(syndrome, msn)
    assert r.unpack_aeth(r.pack_aeth(aeth), 0) == aeth


@FAST
@given(st.one_of(st.integers(max_value=-1), st.integers(min_value=1 << 24)))
def test_out_of_range_fields_raise_value_error(bad):
    with pytest.raises(ValueError):
        r.pack_bth(r.Bth(0, psn=bad))
    with pytest.raises(ValueError):
        r.pack_aeth(r.Aeth(0, bad))
    with pytest.raises(ValueError):
        r.pack_reth(r.Reth(0, 0, bad if bad < 0 else bad << 40))


_WRITE = (r.Opcode.RC_RDMA_WRITE_ONLY, r.Opcode.RC_RDMA_WRITE_FIRST,
          r.Opcode.UC_RDMA_WRITE_ONLY)
_SEND = (r.Opcode.RC_SEND_ONLY, r.Opcode.RC_SEND_LAST, r.Opcode.UC_SEND_ONLY)


@FAST
@given(st.sampled_from(_WRITE + _SEND), u24, u24, st.booleans(), st.booleans(),
       st.binary(max_size=300), u64, u32, u32)
def test_roce_packet_round_trip(opcode, qpn, psn, ack_req, fecn, payload, va, key, length):
    info = r.opcode_info(opcode)
    assert info is not None
    if opcode in (r.Opcode.RC_RDMA_WRITE_FIRST,) and len(payload) % 4:
        payload = payload[: len(payload) - len(payload) % 4]   # FIRST carries no pad
    reth = r.Reth(va, key, length) if opcode in _WRITE else None
    bth = r.Bth(opcode, dest_qp=qpn, psn=psn, ack_req=ack_req, fecn=fecn)
    data = r.encode_packet(CTX, bth, reth, payload=payload)
    assert len(data) % 4 == 0
    p = r.parse_packet(data, CTX)
    assert p.bth._replace(pad_count=0) == bth
    assert p.reth == reth
    assert bytes(p.payload) == payload
    # every byte the ICRC covers, flipped, is caught (FECN/BECN and the ICRC's own
    # bytes excepted: the ICRC does not cover the former)
    i = len(data) // 2
    bad = bytearray(data)
    bad[i] ^= 0x01
    if i != 4:
        with pytest.raises(r.MalformedPacket):
            r.parse_packet(bytes(bad), CTX)


@FAST
@given(u24, u24, st.sampled_from([0, 1, 2, 3, 4, 5]))
def test_ack_round_trip(qpn, psn, credits):
    aeth = r.aeth_ack(psn, credits)
    data = r.encode_packet(CTX, r.Bth(r.Opcode.RC_ACKNOWLEDGE, dest_qp=qpn, psn=psn), aeth=aeth)
    p = r.parse_packet(data, CTX)
    assert p.aeth == aeth and p.aeth.kind == r.AethKind.ACK
    assert p.bth.dest_qp == qpn and p.bth.psn == psn


@FAST
@given(u24, u16, st.booleans())
def test_cnp_round_trip(qpn, p_key, fecn):
    buf = bytearray(64)
    data = bytes(r.build_cnp(buf, CTX, qpn, p_key=p_key, fecn=fecn))
    p = r.parse_packet(data, CTX)
    assert p.bth.opcode == r.CNP_OPCODE and p.bth.becn and p.bth.dest_qp == qpn
    assert p.bth.p_key == p_key and p.bth.fecn == fecn


def _ipv4_roce(payload: bytes, sport: int = 49152) -> bytes:
    udp_len = 8 + len(payload)
    ip = icrc.ipv4_header_for_icrc("10.0.0.1", "10.0.0.2", 20 + udp_len)
    udp = struct.pack("!HHHH", sport, r.ROCE_UDP_PORT, udp_len, 0)
    return ip + udp + payload


@FAST
@given(st.sampled_from(_SEND), u24, st.binary(max_size=200))
def test_icrc_of_a_whole_ip_packet_matches_the_stored_one(opcode, psn, payload):
    data = r.encode_packet(CTX, r.Bth(opcode, dest_qp=5, psn=psn), payload=payload)
    stored, computed = icrc.icrc_of_ip_packet(_ipv4_roce(data))
    assert stored == computed


# the parsers: random bytes and mutations of real packets; only the documented exception
_SEED_PACKETS = [
    r.encode_packet(CTX, r.Bth(r.Opcode.RC_RDMA_WRITE_ONLY, dest_qp=3, psn=9),
                    r.Reth(4096, 7, 64), payload=bytes(64)),
    r.encode_packet(CTX, r.Bth(r.Opcode.RC_ACKNOWLEDGE, dest_qp=3, psn=9), aeth=r.aeth_ack(9)),
    bytes(r.build_cnp(bytearray(64), CTX, 3)),
]


def fuzz_inputs(seeds: list[bytes], n: int = FUZZ_CASES, seed: int = 18,
                max_random: int = 200) -> list[bytes]:
    """`n` inputs: a quarter random bytes, the rest real packets with 1-4 bytes changed,
    cut short or with junk appended. Seeded: the same inputs on every run."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 4 == 0:
            out.append(rng.randbytes(rng.randrange(max_random + 1)))
            continue
        b = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        what = rng.randrange(3)
        if what == 0:
            b = b[:rng.randrange(len(b) + 1)]
        elif what == 1:
            b += rng.randbytes(rng.randrange(1, 16))
        out.append(bytes(b))
    return out


def test_parse_packet_raises_only_malformed():
    accepted = 0
    for i, data in enumerate(fuzz_inputs(_SEED_PACKETS)):
        try:
            r.parse_packet(data, CTX, check_icrc=i % 2 == 0)
            accepted += 1
        except r.MalformedPacket as e:
            assert isinstance(e.reason, r.MalformedReason)
    assert accepted > 0             # the mutations reach past the first checks


def test_icrc_of_ip_packet_raises_only_value_error():
    accepted = 0
    for data in fuzz_inputs([_ipv4_roce(p) for p in _SEED_PACKETS]):
        try:
            icrc.icrc_of_ip_packet(data)
            accepted += 1
        except ValueError:
            pass
    assert accepted > 0


def test_masked_pseudo_header_raises_only_value_error():
    good = _ipv4_roce(_SEED_PACKETS[0])
    for data in fuzz_inputs([good[:28]], max_random=80):
        cut = len(data) // 2 if data[:1] == b"\x00" else min(len(data), 20)
        ip, udp = data[:cut], data[cut:]
        try:
            out = icrc.masked_pseudo_header(ip, udp)
        except ValueError:
            continue
        assert len(out) == 8 + len(ip) + len(udp)


def test_icrc_helpers_refuse_short_and_bad_ihl_input_with_value_error():
    good = _ipv4_roce(_SEED_PACKETS[0])
    for bad in (good[:1], good[:10], bytes([0x41]) + good[1:], bytes([0x4F]) + good[1:30],
                bytes([0x60]) + good[1:20]):
        with pytest.raises(ValueError):
            icrc.icrc_of_ip_packet(bad)
    for ip, udp in ((b"", good[20:28]), (b"\x45", good[20:28]), (good[:20], b"\x00"),
                    (bytes([0x46]) + good[1:20], good[20:28]), (b"\x60" + bytes(10), bytes(8))):
        with pytest.raises(ValueError):
            icrc.masked_pseudo_header(ip, udp)


# --------------------------------------------------------------------------- PFC

MAC = bytes.fromhex("02aabbccddee")


@FAST
@given(st.dictionaries(st.integers(0, 7), u16, max_size=8))
def test_pfc_round_trip(pauses):
    frame = pfc.encode(MAC, pauses)
    assert len(frame) >= pfc.MIN_FRAME_BYTES
    got = pfc.decode(frame)
    assert got.src_mac == MAC
    assert got.paused() == pauses
    assert all(t >= 0 for t in got.times)


def test_pfc_decode_raises_only_malformed():
    for data in fuzz_inputs([pfc.encode(MAC, {3: 100, 5: 0})], max_random=80):
        try:
            f = pfc.decode(data)
        except pfc.MalformedPfc:
            continue
        assert all(0 <= t <= pfc.MAX_QUANTA for t in f.times) and 0 <= f.enabled <= 0xFF


@FAST
@given(st.floats(0, 1e9, allow_nan=False), st.sampled_from([10**9, 25 * 10**9, 100 * 10**9]))
def test_pfc_quanta_are_in_range(duration_ns, rate_bps):
    assert 0 <= pfc.quanta_for_ns(duration_ns, rate_bps) <= pfc.MAX_QUANTA


# --------------------------------------------------------------------------- INA

ina_headers = st.one_of(
    st.builds(lambda job, chunk, slot, gen, sender, e, n: ina.Header(
        ina.PacketType.REQUEST, job, chunk, slot, gen, sender, e, n, 0),
        u32, u32, u16, st.integers(0, 1), st.integers(0, ina.AGGREGATOR - 1),
        st.integers(-32768, 32767), st.integers(-32768, 32767)),
    st.builds(lambda job, chunk, slot, gen, bm, e: ina.Header(
        ina.PacketType.RESULT, job, chunk, slot, gen, ina.AGGREGATOR, e, ina.EXP_NONE, bm),
        u32, u32, u16, st.integers(0, 1), st.integers(1, (1 << ina.MAX_CONTRIBUTORS) - 1),
        st.integers(-32768, 32767)))


@FAST
@given(ina_headers, st.lists(st.integers(-(1 << 31), (1 << 31) - 1), max_size=64))
def test_ina_round_trip(h, values):
    data = ina.build(h, np.array(values, dtype=np.int32))
    p = ina.parse(data)
    assert p.header == h._replace(elements=len(values))
    assert p.values.tolist() == values


_INA_SEEDS = [ina.build(ina.Header(ina.PacketType.REQUEST, 1, 2, 3, 0, 4),
                        np.arange(8, dtype=np.int32))]


def test_ina_parse_raises_only_malformed():
    for data in fuzz_inputs(_INA_SEEDS):
        try:
            ina.parse(data)
        except ina.MalformedPacket as e:
            assert isinstance(e.reason, ina.MalformedReason)


# --------------------------------------------------------------------------- UET

_UET_SEEDS = [
    uet.pack_request(uet.Request(psn=7, spdcid=1, dpdcid=2, ackreq=True),
                     uet.SesRequest(uet.SesOpcode.WRITE, som=False, eom=True, message_id=3,
                                    request_length=1 << 20, memory_key=9,
                                    message_offset=4096, payload_length=16), bytes(16)),
    uet.pack_request(uet.Request(psn=8, spdcid=1, dpdcid=2),
                     uet.SesRequest(uet.SesOpcode.WRITE, som=True, eom=False, message_id=4,
                                    request_length=64, memory_key=9, payload_length=8),
                     bytes(8)),
    uet.pack_ack(uet.Ack(cack_psn=100, ack_psn_offset=2, spdcid=2, dpdcid=1)),
    uet.pack_nack(uet.Nack(nack_code=next(iter(uet.NackCode)), nack_psn=5, spdcid=2,
                           dpdcid=1)),
    uet.pack_control(uet.Control(ctl_type=next(iter(uet.CtlType)), psn=3, spdcid=1,
                                 dpdcid=2)),
]


def _repack(p: uet.Parsed) -> bytes:
    pds = p.pds
    if isinstance(pds, uet.Request):
        return uet.pack_request(pds, p.ses, bytes(p.payload))
    if isinstance(pds, uet.Ack):
        return uet.pack_ack(pds) + bytes(p.payload)
    if isinstance(pds, uet.Nack):
        return uet.pack_nack(pds) + bytes(p.payload)
    return uet.pack_control(pds) + bytes(p.payload)


def test_uet_parse_raises_only_malformed_and_what_it_accepts_round_trips():
    accepted = 0
    for data in fuzz_inputs(_UET_SEEDS):
        try:
            p = uet.parse(data)
        except uet.MalformedUet:
            continue
        accepted += 1
        again = uet.parse(_repack(p))
        assert dataclasses.astuple(again.pds) == dataclasses.astuple(p.pds)
        assert again.ses == p.ses
        assert bytes(again.payload) == bytes(p.payload)
    assert accepted > 0


def test_the_uet_seeds_parse_and_round_trip():
    for data in _UET_SEEDS:
        p = uet.parse(data)
        assert _repack(p) == data
