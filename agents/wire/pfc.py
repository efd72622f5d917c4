"""IEEE 802.1Qbb priority flow control frames (PFC, MAC control opcode 0x0101).

Layout (IEEE 802.1Qbb; the frame is a MAC Control frame, IEEE 802.3 Annex 31D):
dst 01:80:C2:00:00:01, src, EtherType 0x8808, opcode 0x0101, a 2-octet
priority-enable vector (bit n of the low octet = priority n), eight 16-bit
pause times (priority 0..7) in quanta, zero padding to the 60-byte minimum (64
with the FCS the NIC adds). A time of 0 means resume (XON). One quantum is 512
bit times at the port's rate, as for 802.3x PAUSE.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

PFC_DST_MAC = bytes.fromhex("0180c2000001")
ETH_P_PAUSE = 0x8808
PFC_OPCODE = 0x0101
MIN_FRAME_BYTES = 60          # without FCS
MAX_QUANTA = 0xFFFF
_HDR = struct.Struct("!6s6sHHH8H")


class MalformedPfc(ValueError):
    """Not a PFC frame (too short, other EtherType or opcode)."""


@dataclass(frozen=True)
class PfcFrame:
    src_mac: bytes
    times: tuple[int, ...]          # pause quanta per priority 0..7
    enabled: int                    # priority-enable vector, bit n = priority n

    def paused(self) -> dict[int, int]:
        """{priority: quanta} for every enabled priority (0 quanta = resume)."""
        return {p: self.times[p] for p in range(8) if self.enabled >> p & 1}


def quantum_ns(rate_bps: int) -> float:
    """Duration of one pause quantum (512 bit times) at `rate_bps`, in the same time base."""
    return 512 * 1e9 / rate_bps


def quanta_for_ns(duration_ns: float, rate_bps: int) -> int:
    return max(0, min(MAX_QUANTA, round(duration_ns / quantum_ns(rate_bps))))


def encode(src_mac: bytes, pauses: dict[int, int]) -> bytes:
    """A PFC frame pausing (quanta > 0) or resuming (0) the given priorities."""
    times = [0] * 8
    enabled = 0
    for prio, quanta in pauses.items():
        if not 0 <= prio <= 7:
            raise ValueError(f"priority {prio} is not 0..7")
        if not 0 <= quanta <= MAX_QUANTA:
            raise ValueError(f"pause time {quanta} is not 0..65535 quanta")
        times[prio] = quanta
        enabled |= 1 << prio
    frame = _HDR.pack(PFC_DST_MAC, src_mac, ETH_P_PAUSE, PFC_OPCODE, enabled, *times)
    return frame + bytes(MIN_FRAME_BYTES - len(frame))


def decode(frame: bytes | memoryview) -> PfcFrame:
    if len(frame) < _HDR.size:
        raise MalformedPfc(f"{len(frame)} bytes is shorter than a PFC frame")
    dst, src, ethertype, opcode, enabled, *times = _HDR.unpack_from(frame)
    if ethertype != ETH_P_PAUSE or opcode != PFC_OPCODE:
        raise MalformedPfc(f"EtherType 0x{ethertype:04x} opcode 0x{opcode:04x} is not PFC")
    return PfcFrame(bytes(src), tuple(times), enabled & 0xFF)


def mac_bytes(mac: str) -> bytes:
    return bytes.fromhex(mac.replace(":", ""))
