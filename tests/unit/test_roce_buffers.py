"""RoCE buffers sized to what is in flight (testbed/workloads/roce.py roce_buffer_bytes),
and the server's write_bw check drawing the pattern chunk by chunk (agents/roce/perftest.py
_verify_writes): the same verdict and offset as against the whole pattern."""

from __future__ import annotations

import mmap

from agents.roce.perftest import PATTERN_CHUNK, _verify_writes, pattern, slots_for
from testbed.workloads.roce import (
    ROCE_BUFFER_BYTES,
    ROCE_SLOTS_PER_POSTED,
    roce_buffer_bytes,
)


def test_buffer_is_what_is_posted_twice_over():
    size, depth = 65_536, 3
    got = roce_buffer_bytes(size, depth)
    assert got == ROCE_SLOTS_PER_POSTED * depth * size
    # no two messages in flight share a slot
    assert slots_for(size, None, got) >= depth * ROCE_SLOTS_PER_POSTED


def test_buffer_capped_and_at_least_one_message():
    assert roce_buffer_bytes(1 << 20, 64) == ROCE_BUFFER_BYTES
    assert roce_buffer_bytes(16 << 20, 2) == 16 << 20


def region_with(data: bytes) -> mmap.mmap:
    mem = mmap.mmap(-1, len(data))
    mem[:] = data
    return mem


def test_streamed_check_matches_the_whole_pattern():
    slots, size, seed = 5, 40_000, 17           # 200 000 B: chunks of 64 KiB and a tail
    want = bytes(pattern(seed, slots * size))
    good = region_with(want)
    assert _verify_writes([good], [slots], slots, size, seed) == {
        "verified": True, "first_mismatch": None}
    for offset in (0, PATTERN_CHUNK - 1, PATTERN_CHUNK, 3 * size + 5, slots * size - 1):
        bad = bytearray(want)
        bad[offset] ^= 0xFF
        mem = region_with(bytes(bad))
        streamed = _verify_writes([mem], [slots], slots, size, seed)
        whole = _verify_writes([mem], [slots], slots, size, seed, [bytearray(want)])
        assert streamed == whole == {"verified": False,
                                     "first_mismatch": {"qp": 0, "offset": offset}}


def test_streamed_check_covers_only_the_slots_written():
    slots, size, seed = 4, 30_000, 3
    data = bytearray(pattern(seed, slots * size))
    data[3 * size + 10] ^= 1                    # slot 3 was never written: not checked
    mem = region_with(bytes(data))
    assert _verify_writes([mem], [3], slots, size, seed)["verified"] is True
    assert _verify_writes([mem], [4], slots, size, seed)["first_mismatch"] == {
        "qp": 0, "offset": 3 * size + 10}
