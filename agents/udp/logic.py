"""Pure logic of the UDP traffic agent (`agents.udp`): no sockets, injected clocks.

- the probe header every datagram starts with (`pack_header_into`, `unpack_header`);
- `Pacer`: an absolute send schedule at a fixed wire rate with a bounded catch-up;
- `SeqTracker`: loss / reorder / duplicate accounting of one flow's sequence numbers;
- `interval_rate_bps`, `RunningStats`: the arithmetic behind the counters.

Everything here is in wall units (nanoseconds, bits per second of the real
machine); the agent converts from and to fabric units through
`agents.timebase.Dilation` and nowhere else.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

# --- wire format -------------------------------------------------------------------------

#: Header at the start of every datagram the agent sends (network byte order):
#: magic u32, flow u16, seq u64, sender CLOCK_REALTIME ns u64. The rest of the
#: payload is zero-filled.
HEADER = struct.Struct("!IHQQ")
HEADER_BYTES = HEADER.size  # 22
MAGIC = 0x46425544  # b"FBUD"

def pack_header_into(buf: bytearray, flow: int, seq: int, send_ns: int) -> None:
    HEADER.pack_into(buf, 0, MAGIC, flow, seq, send_ns)


def unpack_header(buf: bytes | bytearray | memoryview,
                  nbytes: int) -> tuple[int, int, int] | None:
    """(flow, seq, send_ns) of a datagram this agent sent, or None for anything else."""
    if nbytes < HEADER_BYTES:
        return None
    magic, flow, seq, send_ns = HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        return None
    return flow, seq, send_ns


# --- rates -------------------------------------------------------------------------------


def interval_rate_bps(total_bytes: int, first_bytes: int, first_ns: int, last_ns: int) -> float:
    """Rate of a packet train measured from its first to its last packet.

    The first packet only opens the interval, so its bytes are left out: N
    packets paced at an interval T span (N - 1) * T and carry (N - 1) packets'
    worth of bytes after the first. This makes a perfectly paced train measure
    exactly its set rate, however short it is. 0.0 when there is no interval.
    """
    span_ns = last_ns - first_ns
    if span_ns <= 0:
        return 0.0
    return (total_bytes - first_bytes) * 8 * 1e9 / span_ns


@dataclass
class RunningStats:
    """Count, min, mean and max of a stream of numbers, in constant memory."""

    count: int = 0
    total: float = 0.0
    min: float | None = None
    max: float | None = None

    def add(self, value: float) -> None:
        self.count += 1
        self.total += value
        if self.min is None or value < self.min:
            self.min = value
        if self.max is None or value > self.max:
            self.max = value

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None

    def as_dict(self, scale: Callable[[float], float] = float) -> dict:
        def conv(v: float | None) -> float | None:
            return None if v is None else round(scale(v), 1)

        return {"count": self.count, "min": conv(self.min), "avg": conv(self.mean),
                "max": conv(self.max)}


# --- pacing ------------------------------------------------------------------------------

#: Default bound on the catch-up burst, in wire bytes (at least one packet).
DEFAULT_MAX_BURST_BYTES = 64 * 1024


class Pacer:
    """Absolute send schedule: packet i is due at start + i * interval.

    The interval is the wire time of one whole frame (payload + overhead) at
    `wall_bps`. Due times are computed from the packet index with integer
    arithmetic, so they never drift however long the run.

    Bounded catch-up: a sender that fell behind (descheduled, blocked in
    sendto) may send back-to-back until it is on schedule again, but it is never
    allowed to be more than `max_burst_packets` (= max_burst_bytes // frame,
    at least 1) behind. Time owed beyond that is forgiven: the schedule's
    origin moves forward by the excess, which is added to `forgiven_ns` (and
    `rebases` counts how often). A long stall therefore costs average rate
    (visible in the counters) instead of turning into a line-rate burst that
    would fill the fabric's queues.
    """

    def __init__(self, wall_bps: int, frame_bytes: int, start_ns: int,
                 max_burst_bytes: int = DEFAULT_MAX_BURST_BYTES) -> None:
        if wall_bps <= 0:
            raise ValueError(f"wall_bps must be > 0, got {wall_bps}")
        if frame_bytes <= 0:
            raise ValueError(f"frame_bytes must be > 0, got {frame_bytes}")
        self.wall_bps = int(wall_bps)
        self.frame_bytes = int(frame_bytes)
        self.max_burst_packets = max(1, int(max_burst_bytes) // self.frame_bytes)
        self._bit_ns = self.frame_bytes * 8 * 1_000_000_000  # numerator of one interval
        self._origin_ns = int(start_ns)
        self.index = 0  # next packet to send
        self.forgiven_ns = 0
        self.rebases = 0
        self.max_late_ns = 0  # worst lag behind schedule seen by poll(), before forgiveness

    @property
    def interval_ns(self) -> float:
        return self._bit_ns / self.wall_bps

    def _offset_ns(self, k: int) -> int:
        return k * self._bit_ns // self.wall_bps

    def due_ns(self) -> int:
        """Wall ns at which the next packet (number `index`) is due."""
        return self._origin_ns + self._offset_ns(self.index)

    def poll(self, now_ns: int) -> int:
        """Ns until the next packet is due; <= 0 means send it now.

        Applies the catch-up bound first, so the answer is never further in
        the past than max_burst_packets - 1 intervals.
        """
        due = self.due_ns()
        late = now_ns - due
        if late > 0:
            if late > self.max_late_ns:
                self.max_late_ns = late
            limit = self._offset_ns(self.max_burst_packets - 1)
            if late > limit:
                shift = late - limit
                self._origin_ns += shift
                self.forgiven_ns += shift
                self.rebases += 1
                due += shift
        return due - now_ns

    def sent(self) -> None:
        self.index += 1


# --- sequence accounting -----------------------------------------------------------------


class SeqTracker:
    """Loss, reorder and duplicate accounting for one flow's sequence numbers.

    Senders number each flow from 0. A gap (a sequence number above the
    highest seen + 1) marks the skipped numbers missing; a later arrival of a
    missing number is `reordered` and no longer missing; an arrival at or below
    the highest seen that was not missing is a `duplicate` (or older than the
    tracked window). `lost` = missing now. The receiver cannot see losses at
    the tail of a flow (after its last arrival): compare with the sender's
    packet count for those. At most `max_missing` numbers are remembered
    individually; older ones are still counted lost (`forgotten`), but a late
    arrival of one of them then counts as a duplicate.
    """

    def __init__(self, max_missing: int = 65536) -> None:
        self.max_missing = max_missing
        self.received = 0
        self.highest = -1
        self.reordered = 0
        self.duplicates = 0
        self.forgotten = 0
        self._missing: set[int] = set()

    @property
    def lost(self) -> int:
        return len(self._missing) + self.forgotten

    @property
    def expected(self) -> int:
        return self.highest + 1

    def observe(self, seq: int) -> str:
        """Account one arrival; returns 'in_order', 'gap', 'reordered' or 'duplicate'."""
        self.received += 1
        if seq == self.highest + 1:
            self.highest = seq
            return "in_order"
        if seq > self.highest:
            gap = seq - self.highest - 1
            if gap >= self.max_missing:
                # too many to remember one by one: keep the newest, count the rest
                self._forget(len(self._missing))
                self.forgotten += gap - self.max_missing
                self._missing.update(range(seq - self.max_missing, seq))
            else:
                self._missing.update(range(self.highest + 1, seq))
                if len(self._missing) > self.max_missing:
                    self._forget(len(self._missing) - self.max_missing)
            self.highest = seq
            return "gap"
        if seq in self._missing:
            self._missing.discard(seq)
            self.reordered += 1
            return "reordered"
        self.duplicates += 1
        return "duplicate"

    def _forget(self, n: int) -> None:
        if n <= 0:
            return
        for seq in sorted(self._missing)[:n]:
            self._missing.discard(seq)
        self.forgotten += n

    def as_dict(self) -> dict:
        return {"received": self.received, "highest_seq": self.highest, "lost": self.lost,
                "reordered": self.reordered, "duplicates": self.duplicates}
