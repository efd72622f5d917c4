"""PFC frames: our encoder against scapy's 802.1Qbb model, and the quanta arithmetic."""

from __future__ import annotations

import pytest
from scapy.contrib.mac_control import MACControlClassBasedFlowControl
from scapy.layers.l2 import Ether

from agents.wire import pfc


def test_frame_layout_matches_scapy_and_the_standard():
    frame = pfc.encode(pfc.mac_bytes("02:54:00:00:01:00"), {3: 0xFFFF, 6: 100})
    assert len(frame) == 60                       # 64 on the wire with the FCS
    assert frame[:6] == bytes.fromhex("0180c2000001")
    pkt = Ether(frame)
    assert pkt.type == 0x8808
    ctl = pkt[MACControlClassBasedFlowControl]
    assert ctl._op_code == 0x0101
    assert ctl.c3_enabled == 1 and ctl.c6_enabled == 1 and ctl.c0_enabled == 0
    assert ctl.c3_pause_time == 0xFFFF and ctl.c6_pause_time == 100
    assert ctl.c0_pause_time == 0


def test_decode_round_trip_and_resume():
    src = pfc.mac_bytes("02:54:00:00:0a:01")
    parsed = pfc.decode(pfc.encode(src, {3: 0}))
    assert parsed.src_mac == src
    assert parsed.paused() == {3: 0}              # XON: time 0 on an enabled priority
    assert parsed.enabled == 0b1000


def test_decode_refuses_other_frames():
    with pytest.raises(pfc.MalformedPfc):
        pfc.decode(b"\x00" * 10)
    other = bytearray(pfc.encode(b"\x02" * 6, {3: 1}))
    other[12:14] = b"\x08\x00"
    with pytest.raises(pfc.MalformedPfc):
        pfc.decode(bytes(other))


def test_quantum_is_512_bit_times():
    assert pfc.quantum_ns(100_000_000_000) == pytest.approx(5.12)
    # the longest pause, 65535 quanta of 512 bit times, is 335.5 us at 100 Gb/s
    assert 0xFFFF * pfc.quantum_ns(100_000_000_000) == pytest.approx(335_539.2)
    assert pfc.quanta_for_ns(5.12 * 1000, 100_000_000_000) == 1000
    assert pfc.quanta_for_ns(1e12, 100_000_000_000) == 0xFFFF


def test_bad_priorities_and_times_are_refused():
    with pytest.raises(ValueError):
        pfc.encode(b"\x02" * 6, {8: 1})
    with pytest.raises(ValueError):
        pfc.encode(b"\x02" * 6, {3: 70000})
