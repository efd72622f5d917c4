"""SES messages: WRITE and SEND segmented at the initiator, reassembled at the target.

Pure logic, no sockets and no wire format: the NIC turns a `Segment` into a PDS request
with an SES standard header (`agents.wire.uet`) and hands the target's fields back in.

Initiator (`SesInitiator`, one per PDC):
  - `write(key, offset, data)`: the bytes go to the target's buffer registered under
    memory key `key`, at `offset`; every packet carries buffer_offset = `offset` and its
    own message offset, so the target places it at buffer_offset + message offset;
  - `send(match_bits, data)`: a message the target reassembles and hands over whole;
  - message ids are 16 bits per PDC, one sequence for WRITEs and SENDs;
  - every packet carries request_length (the message's length); the first (SOM) packet
    carries header_data instead of message offset and payload length (its offset is 0,
    its length `payload_bytes` unless it is also the last). For a SEND, header_data is
    the message's sequence number among the PDC's SENDs with the same match bits
    (a deviation: UEC leaves header_data to the application), which is what lets the
    target report messages of one (peer, match bits) in message-id order;
  - `acked(item)` counts a packet acknowledged; when every packet of a message is, the
    message's `on_done(message_id)` runs.

Target (`SesTarget`, one per PDC, sharing the NIC's registered buffers):
  - WRITE: each packet's bytes land at buffer_offset + message offset of the buffer
    registered under the memory key (bounds checked); the message is complete when
    request_length bytes have landed;
  - SEND: the message buffer is allocated when the first packet of the message arrives,
    whichever packet that is (every packet carries request_length), and complete when
    all its bytes are in;
  - out of order is normal; a packet whose offset already landed is ignored (counted),
    so each byte is placed once (the PDS already drops duplicate PSNs);
  - completed SENDs of one match bits value are released in sequence order: a later one
    that completes first waits until the earlier ones have.
Errors (unknown key, out of bounds, inconsistent lengths, a SEND above `max_send_bytes`,
1 GiB by default, since its buffer is allocated from request_length) fail the message:
counted,
described in `errors`, the rest of its packets ignored.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = [
    "OP_SEND",
    "OP_WRITE",
    "MessageDone",
    "OutMessage",
    "Segment",
    "SesInitiator",
    "SesTarget",
    "WriteDone",
    "expected_payload_bytes",
]

# SesOpcode values (agents.wire.uet.SesOpcode: WRITE 1, SEND 5)
OP_WRITE = 1
OP_SEND = 5
MESSAGE_ID_MASK = 0xFFFF
MAX_ERRORS_KEPT = 16
#: Largest SEND a target allocates a buffer for (request_length comes from the wire).
MAX_SEND_BYTES = 1 << 30


class Segment(NamedTuple):
    """One packet's SES fields and payload."""

    opcode: int
    som: bool
    eom: bool
    message_id: int
    request_length: int
    buffer_offset: int
    memory_key: int           # WRITE: memory key; SEND: match bits
    header_data: int          # SOM only
    message_offset: int       # 0 on SOM
    payload: memoryview


class OutMessage:
    """A message being sent: what it is, how far it is segmented and acknowledged."""

    __slots__ = ("opcode", "message_id", "key", "buffer_offset", "data", "on_done",
                 "header_data", "npackets", "next_offset", "acked_packets", "done")

    def __init__(self, opcode: int, message_id: int, key: int, buffer_offset: int,
                 data: memoryview, on_done: Callable[[int], None] | None, header_data: int,
                 payload_bytes: int) -> None:
        self.opcode = opcode
        self.message_id = message_id
        self.key = key
        self.buffer_offset = buffer_offset
        self.data = data
        self.on_done = on_done
        self.header_data = header_data
        n = len(data)
        self.npackets = max(1, -(-n // payload_bytes))
        self.next_offset = 0
        self.acked_packets = 0
        self.done = False

    @property
    def length(self) -> int:
        return len(self.data)


def _bytes_view(data: Any) -> memoryview:
    mv = memoryview(data)
    if mv.ndim != 1 or mv.itemsize != 1 or not mv.c_contiguous:
        mv = mv.cast("B") if mv.c_contiguous else memoryview(mv.tobytes())
    return mv


class SesInitiator:
    """The messages one PDC sends, segmented at `payload_bytes`, packet by packet in turn:
    each unsegmented message gives one packet, then the next message does (round robin),
    as an RNIC's queue pairs share its port. So a small message posted behind a large one
    to the same peer is not held until the large one is sent (sized flows' FCTs over one
    PDC per pair of hosts depend on it); a lone message goes out as before."""

    def __init__(self, payload_bytes: int) -> None:
        if payload_bytes < 1 or payload_bytes > 0x3FFF:
            raise ValueError(f"payload_bytes must be 1..16383 (14-bit payload_length), "
                             f"got {payload_bytes}")
        self.payload_bytes = payload_bytes
        self.queue: deque[OutMessage] = deque()
        self._next_id = 0
        self._tag_seq: dict[int, int] = {}
        self.backlog_bytes = 0          # bytes posted and not yet segmented
        self.messages_posted = 0
        self.messages_done = 0
        self.bytes_done = 0
        self.unfinished = 0             # posted, not every packet acknowledged

    def _post(self, opcode: int, key: int, offset: int, data: Any,
              on_done: Callable[[int], None] | None, header_data: int) -> OutMessage:
        mv = _bytes_view(data)
        if len(mv) >= 1 << 32:
            raise ValueError("a message is at most 2^32 - 1 bytes (request_length is 32 bits)")
        msg = OutMessage(opcode, self._next_id, key, offset, mv, on_done, header_data,
                         self.payload_bytes)
        self._next_id = (self._next_id + 1) & MESSAGE_ID_MASK
        self.queue.append(msg)
        self.backlog_bytes += len(mv)
        self.messages_posted += 1
        self.unfinished += 1
        return msg

    def write(self, key: int, offset: int, data: Any,
              on_done: Callable[[int], None] | None = None) -> OutMessage:
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        return self._post(OP_WRITE, key, offset, data, on_done, 0)

    def send(self, match_bits: int, data: Any,
             on_done: Callable[[int], None] | None = None) -> OutMessage:
        seq = self._tag_seq.get(match_bits, 0)
        self._tag_seq[match_bits] = seq + 1
        return self._post(OP_SEND, match_bits, 0, data, on_done, seq)

    def has_data(self) -> bool:
        return bool(self.queue)

    def next_segment(self) -> tuple[Segment, OutMessage] | None:
        """The next packet of the message whose turn it is (and its message), or None."""
        if not self.queue:
            return None
        msg = self.queue[0]
        off = msg.next_offset
        n = len(msg.data)
        end = min(n, off + self.payload_bytes)
        seg = Segment(msg.opcode, off == 0, end == n, msg.message_id, n, msg.buffer_offset,
                      msg.key, msg.header_data if off == 0 else 0, off, msg.data[off:end])
        msg.next_offset = end
        self.backlog_bytes -= end - off
        if end == n:
            self.queue.popleft()
        elif len(self.queue) > 1:
            self.queue.rotate(-1)           # its next packet after the others' next
        return seg, msg

    def acked(self, msg: OutMessage) -> bool:
        """One packet of `msg` is acknowledged; True when that completes the message."""
        msg.acked_packets += 1
        if msg.acked_packets < msg.npackets or msg.done:
            return False
        msg.done = True
        self.messages_done += 1
        self.bytes_done += len(msg.data)
        self.unfinished -= 1
        if msg.on_done is not None:
            msg.on_done(msg.message_id)
        return True

    def counters(self) -> dict:
        return {"messages_posted": self.messages_posted, "messages_done": self.messages_done,
                "bytes_done": self.bytes_done, "backlog_bytes": self.backlog_bytes}


def expected_payload_bytes(som: bool, eom: bool, request_length: int, message_offset: int,
                           payload_length: int, payload_bytes: int) -> int:
    """Payload bytes a whole (untrimmed) packet with these SES fields carries.

    Non-SOM packets say it (payload_length); a SOM packet that is also the EOM carries the
    whole message; any other SOM packet carries `payload_bytes` (the sender's segment
    size, which both ends are configured with: a deviation, see docs/uet-transport.md)."""
    if not som:
        return payload_length
    if eom:
        return request_length
    return min(payload_bytes, request_length)


class WriteDone(NamedTuple):
    key: int
    offset: int
    length: int
    message_id: int


class MessageDone(NamedTuple):
    match_bits: int
    message_id: int
    data: memoryview


class _InMessage:
    __slots__ = ("opcode", "key", "buffer_offset", "length", "received", "offsets", "buf",
                 "seq", "failed")

    def __init__(self, opcode: int, key: int, buffer_offset: int, length: int) -> None:
        self.opcode = opcode
        self.key = key
        self.buffer_offset = buffer_offset
        self.length = length
        self.received = 0
        self.offsets: set[int] = set()
        self.buf: bytearray | None = None
        self.seq: int | None = None
        self.failed = False


class SesTarget:
    """Reassembles the messages of one PDC; `regions` are the NIC's WRITE targets by key."""

    def __init__(self, regions: dict[int, memoryview],
                 max_send_bytes: int = MAX_SEND_BYTES) -> None:
        self.regions = regions
        self.max_send_bytes = max_send_bytes
        self._msgs: dict[int, _InMessage] = {}
        self._failed_ids: set[int] = set()
        self._next_seq: dict[int, int] = {}
        self._held: dict[int, dict[int, MessageDone]] = {}
        self.writes_done = 0
        self.messages_done = 0
        self.bytes_placed = 0
        self.overlaps = 0
        self.held_messages = 0        # completed SENDs waiting for an earlier one now
        self.errors = 0
        self.error_log: list[str] = []

    def _fail(self, message_id: int, m: _InMessage | None, why: str) -> list:
        self.errors += 1
        if len(self.error_log) < MAX_ERRORS_KEPT:
            self.error_log.append(f"message {message_id}: {why}")
        if m is not None:
            m.failed = True
            m.buf = None
        return []

    def _start(self, m: _InMessage) -> str | None:
        """A message's first packet (whichever): allocate or check where it goes; why not."""
        if m.opcode == OP_SEND:
            if m.length > self.max_send_bytes:
                return (f"SEND of {m.length} B is above the target's limit of "
                        f"{self.max_send_bytes} B")
            m.buf = bytearray(m.length)
            return None
        region = self.regions.get(m.key)
        if region is None:
            return f"WRITE to unknown memory key {m.key:#x}"
        if m.buffer_offset + m.length > len(region):
            return (f"WRITE of {m.length} B at offset {m.buffer_offset} overruns memory key "
                    f"{m.key:#x} ({len(region)} B)")
        return None

    def on_packet(self, opcode: int, som: bool, eom: bool, message_id: int,
                  request_length: int, buffer_offset: int, memory_key: int, header_data: int,
                  message_offset: int, payload: memoryview) -> list[WriteDone | MessageDone]:
        """One packet's SES fields and payload (delivered once by the PDS); the messages it
        completed (a SEND may release held later ones of the same match bits too)."""
        m = self._msgs.get(message_id)
        if m is None:
            if opcode not in (OP_WRITE, OP_SEND):
                return self._fail(message_id, None, f"opcode {opcode} is not WRITE or SEND")
            m = _InMessage(opcode, memory_key, buffer_offset, request_length)
            self._msgs[message_id] = m
            why = self._start(m)
            if why is not None:
                return self._fail(message_id, m, why)
        if m.failed:
            return []
        if (opcode != m.opcode or request_length != m.length or memory_key != m.key
                or buffer_offset != m.buffer_offset):
            return self._fail(message_id, m, "packets of the message disagree on its opcode, "
                                             "length, key or offset")
        n = len(payload)
        end = message_offset + n
        if end > m.length:
            return self._fail(message_id, m, f"{n} B at message offset {message_offset} "
                                             f"pass request_length {m.length}")
        if message_offset in m.offsets:
            self.overlaps += 1
            return []
        m.offsets.add(message_offset)
        if som:
            m.seq = header_data
        if n:
            if m.opcode == OP_WRITE:
                at = m.buffer_offset + message_offset
                self.regions[m.key][at:at + n] = payload
            else:
                assert m.buf is not None
                m.buf[message_offset:end] = payload
        m.received += n
        self.bytes_placed += n
        if m.received < m.length or m.seq is None:
            return []
        del self._msgs[message_id]
        if m.opcode == OP_WRITE:
            self.writes_done += 1
            return [WriteDone(m.key, m.buffer_offset, m.length, message_id)]
        assert m.buf is not None
        return self._release(m.key, m.seq, MessageDone(m.key, message_id, memoryview(m.buf)))

    def _release(self, tag: int, seq: int, done: MessageDone) -> list:
        nxt = self._next_seq.get(tag, 0)
        if seq != nxt:
            self._held.setdefault(tag, {})[seq] = done
            self.held_messages += 1
            return []
        out: list = [done]
        nxt += 1
        held = self._held.get(tag)
        if held:
            while nxt in held:
                out.append(held.pop(nxt))
                self.held_messages -= 1
                nxt += 1
            if not held:
                del self._held[tag]
        self._next_seq[tag] = nxt
        self.messages_done += len(out)
        return out

    def in_progress(self) -> int:
        return len(self._msgs)

    def counters(self) -> dict:
        return {"writes_done": self.writes_done, "messages_done": self.messages_done,
                "bytes_placed": self.bytes_placed, "overlaps": self.overlaps,
                "held_messages": self.held_messages, "in_progress": len(self._msgs),
                "ses_errors": self.errors, "ses_error_log": list(self.error_log)}
