"""SES messages (agents.uet.ses): segmentation at the initiator, byte-exact reassembly at
the target from packets in any order, per-(peer, match bits) order of SENDs, on_done."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from agents.uet.ses import (
    OP_SEND,
    OP_WRITE,
    MessageDone,
    SesInitiator,
    SesTarget,
    WriteDone,
    expected_payload_bytes,
)


def _segments(ini: SesInitiator) -> list:
    out = []
    while (x := ini.next_segment()) is not None:
        out.append(x)
    return out


def _deliver(tgt: SesTarget, seg) -> list:
    return tgt.on_packet(seg.opcode, seg.som, seg.eom, seg.message_id, seg.request_length,
                         seg.buffer_offset, seg.memory_key, seg.header_data,
                         seg.message_offset, seg.payload)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), sizes=st.lists(st.integers(0, 20_000), min_size=1,
                                                      max_size=6),
       payload=st.sampled_from([1, 100, 4096]))
def test_writes_from_shuffled_packets_land_byte_exact(seed, sizes, payload):
    rng = np.random.default_rng(seed)
    total = sum(sizes) + 64
    region = bytearray(total)
    tgt = SesTarget({7: memoryview(region)})
    ini = SesInitiator(payload)
    want = bytearray(total)
    off = 3
    for n in sizes:
        data = rng.integers(0, 256, n, dtype=np.uint8)
        ini.write(7, off, data)
        want[off:off + n] = data.tobytes()
        off += n
    segs = _segments(ini)
    random.Random(seed).shuffle(segs)
    done = [e for seg, _msg in segs for e in _deliver(tgt, seg)]
    assert region == want
    assert sorted(d.message_id for d in done) == list(range(len(sizes)))
    assert all(isinstance(d, WriteDone) for d in done)
    assert tgt.bytes_placed == sum(sizes) and tgt.errors == 0


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), sizes=st.lists(st.integers(0, 20_000), min_size=1,
                                                      max_size=8))
def test_sends_from_shuffled_packets_arrive_whole_and_in_order_per_match_bits(seed, sizes):
    rng = random.Random(seed)
    ini = SesInitiator(4096)
    tgt = SesTarget({})
    sent: dict[int, list[bytes]] = {}
    for n in sizes:
        tag = rng.choice([1, 2])
        data = rng.randbytes(n)
        ini.send(tag, data)
        sent.setdefault(tag, []).append(data)
    segs = _segments(ini)
    rng.shuffle(segs)
    got: dict[int, list[tuple[int, bytes]]] = {}
    for seg, _msg in segs:
        for d in _deliver(tgt, seg):
            assert isinstance(d, MessageDone)
            got.setdefault(d.match_bits, []).append((d.message_id, bytes(d.data)))
    assert {t: [b for _i, b in v] for t, v in got.items()} == sent
    for v in got.values():      # message-id order within each match bits value
        ids = [i for i, _b in v]
        assert ids == sorted(ids)
    assert tgt.held_messages == 0 and tgt.in_progress() == 0


def test_a_later_send_that_completes_first_waits_for_the_earlier_one():
    ini = SesInitiator(4)
    tgt = SesTarget({})
    ini.send(9, b"aaaaaaaa")      # two packets
    ini.send(9, b"bb")
    (a0, _), (b0, _), (a1, _) = _segments(ini)     # in turn: a's first, b, a's second
    assert _deliver(tgt, b0) == [] and tgt.held_messages == 1
    assert _deliver(tgt, a1) == []
    out = _deliver(tgt, a0)
    assert [(d.message_id, bytes(d.data)) for d in out] == [(0, b"aaaaaaaa"), (1, b"bb")]


def test_a_small_message_behind_a_large_one_is_not_held_until_the_large_one_is_sent():
    ini = SesInitiator(4)
    ini.write(1, 0, bytes(4 * 100))                # 100 packets
    ini.write(2, 0, b"xy")                         # one packet, posted after
    ini.write(3, 0, bytes(8))                      # two packets
    order = [m.key for _seg, m in _segments(ini)]
    assert order[:5] == [1, 2, 3, 1, 3]            # one packet each, in turn
    assert order.count(1) == 100 and order[5:] == [1] * 98


def test_on_done_runs_when_every_packet_of_the_message_is_acknowledged():
    ini = SesInitiator(10)
    done = []
    ini.write(1, 0, bytes(25), on_done=done.append)
    segs = _segments(ini)
    assert len(segs) == 3 and segs[0][0].som and segs[-1][0].eom
    assert [ini.acked(m) for _s, m in segs] == [False, False, True]
    assert done == [0] and ini.messages_done == 1


def test_a_zero_length_message_is_one_packet_and_completes():
    ini = SesInitiator(10)
    ini.send(3, b"")
    ((seg, _m),) = _segments(ini)
    assert seg.som and seg.eom and seg.request_length == 0
    (d,) = _deliver(SesTarget({}), seg)
    assert d.match_bits == 3 and bytes(d.data) == b""


def test_a_write_out_of_bounds_or_to_an_unknown_key_fails_the_message_not_the_target():
    tgt = SesTarget({1: memoryview(bytearray(8))})
    ini = SesInitiator(4)
    ini.write(1, 6, b"abcd")          # overruns
    ini.write(2, 0, b"ab")            # unknown key
    ini.write(1, 0, b"ok")
    out = [e for seg, _m in _segments(ini) for e in _deliver(tgt, seg)]
    assert out == [WriteDone(1, 0, 2, 2)]
    assert tgt.errors == 2 and "overruns" in tgt.error_log[0] and "unknown" in tgt.error_log[1]


def test_a_repeated_packet_places_nothing_twice():
    tgt = SesTarget({})
    ini = SesInitiator(4)
    ini.send(1, b"abcdef")
    (s0, _), (s1, _) = _segments(ini)
    assert _deliver(tgt, s1) == [] and _deliver(tgt, s1) == [] and tgt.overlaps == 1
    assert bytes(_deliver(tgt, s0)[0].data) == b"abcdef"


def test_expected_payload_says_what_a_whole_packet_carries():
    assert expected_payload_bytes(False, False, 10_000, 4096, 4096, 4096) == 4096
    assert expected_payload_bytes(True, True, 77, 0, 0, 4096) == 77
    assert expected_payload_bytes(True, False, 10_000, 0, 0, 4096) == 4096


def test_opcodes_are_uec_values():
    assert (OP_WRITE, OP_SEND) == (1, 5)


def test_a_send_above_the_targets_limit_fails_without_allocating_it():
    tgt = SesTarget({}, max_send_bytes=100)
    ini = SesInitiator(64)
    ini.send(1, bytes(101))
    ini.send(1, bytes(10))
    out = [e for seg, _m in _segments(ini) for e in _deliver(tgt, seg)]
    assert out == [] and tgt.errors == 1 and "above the target's limit" in tgt.error_log[0]
