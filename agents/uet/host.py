"""One host's UET streams over one UET NIC: post each initiated stream's messages from its
start, check every byte of each targeted stream, and know when both are done.

The schedule (testbed/workloads/uet.py writes it) gives every stream of the host:
`out` rows the host initiates, `in` rows it is the target of. Both ends read the same
numbers, so they agree without a set-up exchange:

- stream s WRITEs into the target's region registered under memory key
  KEY_BASE + s, `slots` message slots of `size` bytes: message k goes to slot
  k mod slots. The initiator keeps at most `depth` <= `slots` messages outstanding and
  posts message k + slots only after message k was acknowledged (messages complete in
  any order: RUD is unordered), so a slot's messages complete at the target one after
  another: the n-th completion in slot j is message j + n x slots, and the target
  checks it before the slot can be written again;
- stream s SENDs with match bits s << 32 | k; the target reassembles and checks each;
- message k's bytes are `pattern(seed, k, size)`;
- after its last data message the initiator SENDs match bits s << 32 | DONE_INDEX with
  the number of data messages it sent (8 bytes, big-endian): the target is done when it
  has checked that many. With `messages` the number is known in advance; with a
  `duration` only the initiator knows it.

Times are fabric ns after the run's common start t0 (`--start-at-mono-ns`, on this
agent's fabric clock). A stream's time runs from its first post to the acknowledgement
of its last data message, stamped in the callback of the NIC step that took it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agents.runtime.framing import WIRE_OVERHEAD_BYTES
from agents.runtime.lifecycle import Lifecycle
from agents.timebase import Dilation, FabricClock

KEY_BASE = 0x1000
DONE_INDEX = 0xFFFFFFFF
MAX_STREAM = (1 << 31) - 1
# After its own streams are done, an agent keeps answering for this many retransmission
# timeouts: its last ACK may have been lost, and the peer's retransmission needs one.
LINGER_RTOS = 4
# Longest wall sleep of the loop: a stop request is seen within it.
MAX_SLEEP_WALL_NS = 20_000_000


def udp_rcvbuf_errors(path: str = "/proc/net/snmp") -> int | None:
    """The network namespace's UDP RcvbufErrors: datagrams dropped because a socket's
    receive buffer was full (None where the file cannot say)."""
    try:
        with open(path) as f:
            rows = [line.split() for line in f if line.startswith("Udp:")]
        return int(rows[1][rows[0].index("RcvbufErrors")])
    except (OSError, IndexError, ValueError):
        return None


def pattern(seed: int, index: int, size: int) -> bytes:
    """Message `index`'s bytes of a stream seeded `seed` (both ends compute it)."""
    return np.random.default_rng([seed, index]).bytes(size)


def done_payload(count: int) -> bytes:
    return count.to_bytes(8, "big")


@dataclass(frozen=True)
class StreamSpec:
    """One row of the schedule."""

    stream: int
    peer: str                 # the other end's IP
    peer_host: str
    test: str                 # write_bw | send_bw
    size: int
    messages: int | None
    slots: int
    seed: int
    verify: bool
    start_ns: int = 0
    duration_ns: int | None = None
    depth: int = 1

    @property
    def key(self) -> int:
        return KEY_BASE + self.stream

    def match_bits(self, index: int) -> int:
        return self.stream << 32 | index


def _row(r: dict, out: bool) -> StreamSpec:
    s = StreamSpec(stream=int(r["stream"]), peer=str(r["peer"]),
                   peer_host=str(r.get("peer_host", "")), test=str(r["test"]),
                   size=int(r["size"]),
                   messages=None if r.get("messages") is None else int(r["messages"]),
                   slots=int(r["slots"]), seed=int(r["seed"]), verify=bool(r["verify"]),
                   start_ns=int(r.get("start_ns") or 0),
                   duration_ns=None if r.get("duration_ns") is None else int(r["duration_ns"]),
                   depth=int(r.get("depth") or 1))
    if not 0 <= s.stream <= MAX_STREAM or s.size < 1 or s.slots < 1:
        raise ValueError(f"stream {s.stream}: number, size or slots out of range")
    if s.test not in ("write_bw", "send_bw"):
        raise ValueError(f"stream {s.stream}: unknown test {s.test!r}")
    if out and s.messages is None and s.duration_ns is None:
        raise ValueError(f"stream {s.stream}: neither messages nor duration_ns")
    if out and not 1 <= s.depth <= s.slots:
        raise ValueError(f"stream {s.stream}: depth {s.depth} outside 1..slots {s.slots}")
    return s


def parse_schedule(doc: dict) -> tuple[list[StreamSpec], list[StreamSpec]]:
    """(initiated, targeted) streams of {"out": [...], "in": [...]}; ValueError naming
    what is wrong."""
    try:
        out = [_row(r, True) for r in doc.get("out", [])]
        inc = [_row(r, False) for r in doc.get("in", [])]
    except (TypeError, KeyError, ValueError) as e:
        raise ValueError(f"schedule: a malformed stream ({e})") from None
    ids = [s.stream for s in out] + [s.stream for s in inc]
    if len(set(ids)) != len(ids):
        raise ValueError("schedule: a stream number appears twice")
    return out, inc


@dataclass
class OutStream:
    """The initiator's side of a stream."""

    spec: StreamSpec
    posted: int = 0                 # data messages posted
    acked: int = 0                  # ... acknowledged
    outstanding: int = 0
    bytes_acked: int = 0
    first_post_ns: float | None = None
    last_done_ns: float | None = None
    done_posted: bool = False       # the last SEND (its count) is posted
    done_acked: bool = False
    error: str | None = None
    data: dict[int, bytes] = field(default_factory=dict)   # outstanding messages' bytes
    busy_slots: set[int] = field(default_factory=set)   # slots of unacknowledged messages

    def posting(self, rel_ns: float) -> bool:
        """Whether it may post another data message now (schedule permitting)."""
        s = self.spec
        if self.done_posted or rel_ns < s.start_ns:
            return False
        if s.messages is not None:
            return self.posted < s.messages
        return rel_ns < s.start_ns + (s.duration_ns or 0)

    @property
    def done(self) -> bool:
        return self.done_acked and self.outstanding == 0


@dataclass
class InStream:
    """The target's side of a stream."""

    spec: StreamSpec
    region: np.ndarray | None = None            # WRITE: slots x size bytes
    slot_count: list[int] = field(default_factory=list)   # completions per slot so far
    received: int = 0               # data messages complete
    bytes_received: int = 0
    expected: int | None = None     # from the schedule (messages) or the last SEND
    verified_ok: int = 0
    mismatch: dict | None = None
    duplicates: int = 0
    wrong_peer: int = 0
    first_ns: float | None = None
    last_ns: float | None = None
    seen: set[int] = field(default_factory=set)   # SEND: message indices received

    @property
    def done(self) -> bool:
        return self.expected is not None and self.received >= self.expected

    def verified(self) -> bool | None:
        """False on a mismatch; True once done with none; None: not checked or not done."""
        if not self.spec.verify:
            return None
        if self.mismatch is not None:
            return False
        return True if self.done else None


class UetHost:
    """A host's initiators and targets, driven from one thread over one NIC.

    `nic` is an agents.uet.nic.UetNic (or a fake with its interface: register, write,
    send, on_message, on_write, step, next_event_ns, wait, idle, counters)."""

    def __init__(self, nic: Any, out: list[StreamSpec], inc: list[StreamSpec],
                 clock: FabricClock, dilation: Dilation, life: Lifecycle,
                 rto_ns: float = 1_000_000.0) -> None:
        self.nic = nic
        self.clock = clock
        self.dilation = dilation
        self.life = life
        self.rto_ns = rto_ns
        self.out = [OutStream(s) for s in out]
        self.inc = {s.stream: InStream(s) for s in inc}
        self.by_key = {s.key: s.stream for s in inc}
        self.t0_ns = 0.0
        self.phase = "setup"
        self.unexpected = 0          # messages for no stream of this host
        self.done_at_ns: float | None = None
        self.failed_peers: set[str] = set()
        for st in self.inc.values():
            s = st.spec
            if s.messages is not None:
                st.expected = s.messages
            if s.test == "write_bw":
                st.region = np.zeros(s.slots * s.size, dtype=np.uint8)
                st.slot_count = [0] * s.slots
                nic.register(s.key, st.region)
        nic.on_message = self._on_message
        nic.on_write = self._on_write
        nic.on_error = self._on_error
        # the first messages' bytes are made before the start, not at the first post
        for o in self.out:
            s = o.spec
            first = s.messages if s.messages is not None else s.depth
            for k in range(min(s.depth, first)):
                o.data[k] = pattern(s.seed, k, s.size)

    # -- time

    def start(self, start_at_mono_ns: int | None) -> None:
        """Fix t0: the common start, on this agent's fabric clock."""
        self.t0_ns = (self.clock.at_wall_clock_ns(start_at_mono_ns) if start_at_mono_ns
                      else self.clock.now_ns())
        self.phase = "running"

    def rel_ns(self) -> float:
        return self.clock.now_ns() - self.t0_ns

    # -- the loop

    def streams_done(self) -> bool:
        """Every stream done, a stream to a peer whose PDC failed counting as done (it
        never will be; its record says why)."""
        return (all(o.done or o.spec.peer in self.failed_peers for o in self.out)
                and all(i.done for i in self.inc.values()))

    def poll(self) -> bool:
        """One turn of the loop: post what is due, one NIC step; whether it did work."""
        self._post()
        busy = bool(self.nic.step())
        if self.done_at_ns is None and self.streams_done():
            self.done_at_ns = self.rel_ns()
            self.phase = "lingering"
        return busy

    def finished(self, linger: bool = True) -> bool:
        """Every stream done and (with `linger`) LINGER_RTOS timeouts since; never for a
        host that initiates nothing (it answers until it is stopped)."""
        if self.done_at_ns is None or not self.out:
            return False
        return not linger or self.rel_ns() >= self.done_at_ns + LINGER_RTOS * self.rto_ns

    def run(self, linger: bool = True) -> None:
        """Until `finished`, or a stop."""
        while not self.life.should_stop():
            busy = self.poll()
            if self.finished(linger):
                break
            if not busy:
                self.nic.wait(self._sleep_wall_ns())
        self.phase = "done"

    def _sleep_wall_ns(self) -> int:
        """Wall ns until the next thing this host schedules (a stream's start or the end
        of its duration), at most MAX_SLEEP_WALL_NS; the NIC's own timers it knows."""
        rel = self.rel_ns()
        wall = MAX_SLEEP_WALL_NS
        for o in self.out:
            s = o.spec
            if o.done_posted:
                continue
            for at in (s.start_ns, s.start_ns + (s.duration_ns or 0) if s.duration_ns
                       is not None else None):
                if at is not None and at > rel:
                    wall = min(wall, self.dilation.to_wall_ns(at - rel))
        if self.done_at_ns is not None:
            end = self.done_at_ns + LINGER_RTOS * self.rto_ns
            wall = min(wall, max(0, self.dilation.to_wall_ns(end - rel)))
        return max(1, wall)

    # -- initiator

    def _post(self) -> None:
        rel = self.rel_ns()
        for o in self.out:
            s = o.spec
            while (o.outstanding < s.depth and o.posting(rel)
                   and o.posted % s.slots not in o.busy_slots):
                self._post_message(o, o.posted, rel)
            if not o.done_posted and not o.posting(rel) and rel >= s.start_ns:
                o.done_posted = True
                self.nic.send(s.peer, s.match_bits(DONE_INDEX), done_payload(o.posted),
                              on_done=lambda _m, o=o: self._done_acked(o))

    def _post_message(self, o: OutStream, k: int, rel: float) -> None:
        s = o.spec
        data = o.data.get(k)
        if data is None:
            data = o.data[k] = pattern(s.seed, k, s.size)
        if o.first_post_ns is None:
            o.first_post_ns = rel
        if s.test == "write_bw":
            self.nic.write(s.peer, s.key, (k % s.slots) * s.size, data,
                           on_done=lambda _m, o=o, k=k: self._acked(o, k))
        else:
            self.nic.send(s.peer, s.match_bits(k), data,
                          on_done=lambda _m, o=o, k=k: self._acked(o, k))
        o.busy_slots.add(k % s.slots)
        o.posted += 1
        o.outstanding += 1

    def _acked(self, o: OutStream, k: int) -> None:
        o.outstanding -= 1
        o.acked += 1
        o.bytes_acked += o.spec.size
        o.last_done_ns = self.rel_ns()
        o.data.pop(k, None)
        o.busy_slots.discard(k % o.spec.slots)

    def _done_acked(self, o: OutStream) -> None:
        o.done_acked = True

    def _on_error(self, peer: str, reason: str) -> None:
        """The NIC gave up on its PDC with `peer` (retries exhausted): the streams to it
        cannot finish."""
        for o in self.out:
            if o.spec.peer == peer and o.error is None:
                o.error = f"PDC to {peer} failed: {reason}"
        self.failed_peers.add(peer)

    # -- target

    def _stream_of(self, sid: int, peer: str) -> InStream | None:
        st = self.inc.get(sid)
        if st is None:
            self.unexpected += 1
            return None
        if peer != st.spec.peer:
            st.wrong_peer += 1
            return None
        return st

    def _mark(self, st: InStream, nbytes: int) -> None:
        now = self.rel_ns()
        if st.first_ns is None:
            st.first_ns = now
        st.last_ns = now
        st.received += 1
        st.bytes_received += nbytes

    def _check(self, st: InStream, k: int, got: memoryview | np.ndarray) -> None:
        s = st.spec
        if not s.verify:
            return
        want = np.frombuffer(pattern(s.seed, k, s.size), dtype=np.uint8)
        have = np.frombuffer(got, dtype=np.uint8) if not isinstance(got, np.ndarray) else got
        if len(have) == len(want) and np.array_equal(have, want):
            st.verified_ok += 1
            return
        if st.mismatch is None:
            n = min(len(have), len(want))
            diff = np.flatnonzero(have[:n] != want[:n])
            st.mismatch = {"message": k, "offset": int(diff[0]) if len(diff) else n,
                           "length": int(len(have)), "expected_length": s.size}

    def _on_write(self, peer: str, key: int, offset: int, length: int) -> None:
        sid = self.by_key.get(key)
        st = self._stream_of(sid if sid is not None else -1, peer)
        if st is None or st.region is None:
            return
        s = st.spec
        slot = offset // s.size
        if offset % s.size or not 0 <= slot < s.slots:
            st.mismatch = st.mismatch or {"message": None, "offset": offset, "length": length,
                                          "expected_length": s.size}
            return
        k = slot + st.slot_count[slot] * s.slots
        st.slot_count[slot] += 1
        self._mark(st, length)
        self._check(st, k, st.region[offset:offset + length])

    def _on_message(self, peer: str, match_bits: int, _msg_id: int, data: memoryview) -> None:
        st = self._stream_of(match_bits >> 32, peer)
        if st is None:
            return
        k = match_bits & 0xFFFFFFFF
        if k == DONE_INDEX:
            st.expected = int.from_bytes(bytes(data[:8]), "big")
            return
        if st.spec.test != "send_bw":
            self.unexpected += 1
            return
        if k in st.seen:
            st.duplicates += 1
            return
        st.seen.add(k)
        self._mark(st, len(data))
        self._check(st, k, data)

    # -- results

    def records(self, pdcs: dict) -> tuple[list[dict], list[dict]]:
        """Per stream, the initiator's and the target's records, with the NIC's counters
        of the stream's PDC (one PDC per peer, and one stream per peer)."""
        outs = []
        for o in self.out:
            s = o.spec
            p = pdcs.get(s.peer) or {}
            sports = {str(k): int(v) for k, v in (p.get("sports") or {}).items() if v}
            outs.append({
                "stream": s.stream, "dst": s.peer_host, "peer": s.peer, "test": s.test,
                "size": s.size, "posted": o.posted, "messages": o.acked,
                "bytes": o.bytes_acked,
                "first_post_ns": None if o.first_post_ns is None else round(o.first_post_ns),
                "last_done_ns": None if o.last_done_ns is None else round(o.last_done_ns),
                "start_late_ns": (None if o.first_post_ns is None
                                  else round(o.first_post_ns - s.start_ns)),
                "done": o.done, "error": o.error if o.done else (o.error or "unfinished"),
                "tx_packets": int(p.get("tx_packets") or 0),
                "tx_bytes": int(p.get("tx_bytes") or 0),
                "retransmissions": int(p.get("retransmissions") or 0),
                "sack_retransmissions": int(p.get("sack_retransmissions") or 0),
                "nacks": int(p.get("nacks_received") or 0),
                "timeouts": int(p.get("timeouts") or 0),
                "acks_received": int(p.get("acks_received") or 0),
                "ecn_acks": int(p.get("ecn_acks", p.get("ecn_echoes", 0)) or 0),
                "credits_received": int(p.get("credits_received") or 0),
                "injected_drops": int(p.get("injected_drops") or 0),
                # what else this host sent the peer on the same 5-tuples: credit requests,
                # and ACKs, NACKs and credit grants of the peer's streams to this host
                "control_sent": sum(int(p.get(k) or 0) for k in (
                    "credit_reqs_sent", "acks_sent", "nacks_sent", "credits_granted")),
                "srtt_ns": (p.get("cc") or {}).get("srtt_ns"),
                "cwnd_bytes": p.get("cwnd_bytes"),
                "sports": sports})
        ins = []
        for st in self.inc.values():
            s = st.spec
            p = pdcs.get(s.peer) or {}
            ins.append({
                "stream": s.stream, "src": s.peer_host, "peer": s.peer, "test": s.test,
                "size": s.size, "messages": st.received, "bytes": st.bytes_received,
                "expected": st.expected, "done": st.done, "verified": st.verified(),
                "verified_messages": st.verified_ok, "first_mismatch": st.mismatch,
                "duplicates": st.duplicates, "wrong_peer": st.wrong_peer,
                "first_ns": None if st.first_ns is None else round(st.first_ns),
                "last_ns": None if st.last_ns is None else round(st.last_ns),
                "rx_packets": int(p.get("rx_packets") or 0),
                "rx_bytes": int(p.get("rx_bytes") or 0),
                "trims": int(p.get("trims_received") or 0),
                "nacks_sent": int(p.get("nacks_sent") or 0),
                "acks_sent": int(p.get("acks_sent") or 0),
                "ecn_received": int(p.get("ecn_received") or 0),
                "out_of_order": int(p.get("out_of_order") or 0),
                "pds_duplicates": int(p.get("duplicates") or 0),
                "credits_granted": int(p.get("credits_granted") or 0),
                "error": None if st.done else "unfinished"})
        return outs, ins

    def verified(self) -> bool | None:
        """Every targeted stream that verifies matched (None: none verifies)."""
        checks = [st.verified() for st in self.inc.values() if st.spec.verify]
        if not checks:
            return None
        if any(c is False for c in checks):
            return False
        return all(c is True for c in checks) or None

    def snapshot(self, totals: Callable[[], dict]) -> dict:
        """Numbers for the run's time series `recv.<field>` (the run's delivered bytes
        and receive-rate plot read recv.bytes: here UET payload bytes received)."""
        t = totals()
        rx_bytes = int(t.get("rx_bytes") or 0)
        rx_packets = int(t.get("rx_packets") or 0)
        return {"mode": "recv", "phase": self.phase, "bytes": rx_bytes,
                "packets": rx_packets, "wire_bytes": rx_bytes + rx_packets * WIRE_OVERHEAD_BYTES,
                "tx_packets": int(t.get("tx_packets") or 0),
                "retransmissions": int(t.get("retransmissions") or 0),
                "trims_received": int(t.get("trims_received") or 0),
                "nacks_received": int(t.get("nacks_received") or 0),
                "timeouts": int(t.get("timeouts") or 0),
                "streams_done": sum(1 for o in self.out if o.done),
                "messages_acked": sum(o.acked for o in self.out),
                "messages_received": sum(i.received for i in self.inc.values())}
