"""PDS reliable unordered delivery (RUD) per PDC: pure state machines, fabric time injected.

One `RudSender` (the initiator half) and one `RudReceiver` (the target half) per PDC.
No sockets, no clock of their own: every time is a `now_ns: float` argument (fabric ns).
The NIC (`agents.uet.nic`) carries what they decide onto the wire.

PSNs are 32 bits on the wire (`PSN_MASK`); inside these classes they are unbounded
integers that start at the PDC's initial PSN and only grow, so comparisons never wrap.
`unwrap(wire, ref)` turns a 32-bit PSN from the wire back into the integer nearest to
`ref` (a signed half-space of 2^31 around it).

Sender (`RudSender`):
  - a send window of `window_packets` PSNs: PSN `base + window` may not go before `base`
    (the lowest unacknowledged PSN) is acknowledged;
  - per PSN: the caller's item (what to rebuild the packet from), its size, the time and
    entropy of its last transmission, how often it went out and how many of those were
    retransmissions on timeout;
  - an ACK acknowledges every PSN up to its cumulative PSN (`cack_psn`) and every PSN
    whose bit is set in its 64-bit SACK bitmap (bit i: PSN `sack_base + i`); a zero bit
    says nothing (the receiver may have the PSN outside the 64 it reports);
  - selective retransmission, each PSN queued at most once at a time:
      NACK(TRIMMED) -> that PSN, at the head of the queue (at once);
      SACK hole: an unacknowledged PSN for which >= `sack_threshold` packets SENT AFTER
        its last transmission have been acknowledged -> that PSN (RACK-style reading of
        "3 later PSNs acknowledged": a reordered packet is not declared lost by ACKs of
        packets sent before it, and a retransmitted PSN is declared lost again only when
        3 packets sent after the retransmission are acknowledged, i.e. at most once per
        round trip), and only once its last transmission is `reorder_rtts` (1.25)
        smoothed RTTs old, as RACK waits
        a reordering window: a packet its path merely delayed (spraying; a sender that
        moved between CPUs on a veth) is not resent. A SACK resend acknowledged sooner
        than the shortest RTT seen was spurious (the first copy arrived): the window
        doubles, up to MAX_REORDER_RTTS, and stays wide for the PDC's life;
      RTO: the oldest unacknowledged transmission whose last send is `rto_ns` old -> that
        PSN; after `max_retries` timeouts of one PSN the sender fails (`failed` says why)
        and sends nothing more;
  - RTT samples (Karn): only from a PSN sent once, when an ACK names it as its trigger
    (`ack_psn_offset`) or acknowledges it cumulatively for the first time.

Receiver (`RudReceiver`):
  - cumulative PSN `cack` (every PSN <= it received) and the set of PSNs received above
    it (out of order is normal: packets are sprayed over paths);
  - a PSN <= cack or already in the set is a duplicate: counted, not delivered, ACKed at
    once (the sender evidently missed an ACK);
  - a PSN more than `max_ahead` above cack is out of window: dropped, NACKed;
  - ACK coalescing: one ACK per `ack_every` new packets, and at once for a packet that
    is out of order (or arrives while PSNs above cack are held, e.g. fills a hole),
    carries ackreq, is ECN-marked, or is a duplicate. A trimmed packet
    is not received (`on_trimmed` only counts it): it becomes a NACK(TRIMMED) at once.
  - the SACK bitmap covers 64 PSNs from cack + 1, or, when the triggering PSN is beyond
    that, the 64 PSNs ending at it, so the packet that caused the ACK is always reported.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = [
    "PSN_MASK",
    "SACK_BITS",
    "AckInfo",
    "AckResult",
    "RudReceiver",
    "RudSender",
    "RxVerdict",
    "TxRecord",
    "sack_decode",
    "sack_encode",
    "unwrap",
]

PSN_MASK = 0xFFFFFFFF
_PSN_MOD = 1 << 32
_PSN_HALF = 1 << 31
SACK_BITS = 64
#: The widest a PDC's reordering window grows (in smoothed RTTs) after spurious resends.
MAX_REORDER_RTTS = 16.0
_SACK_MASK = (1 << SACK_BITS) - 1
#: Most PSNs a receiver accepts above its cumulative PSN: sack_psn_offset is 16 bits.
MAX_AHEAD = 0xFFFF


def unwrap(wire_psn: int, ref: int) -> int:
    """The integer PSN nearest to `ref` whose low 32 bits are `wire_psn`."""
    return ref + ((wire_psn - ref + _PSN_HALF) % _PSN_MOD) - _PSN_HALF


def sack_encode(received: Iterable[int], base: int) -> int:
    """The 64-bit SACK bitmap of `received` PSNs: bit i set <=> base + i received."""
    bits = 0
    for psn in received:
        i = psn - base
        if 0 <= i < SACK_BITS:
            bits |= 1 << i
    return bits


def sack_decode(base: int, bitmap: int) -> list[int]:
    """The PSNs a SACK bitmap reports received, lowest first."""
    out = []
    bitmap &= _SACK_MASK
    i = 0
    while bitmap:
        if bitmap & 1:
            out.append(base + i)
        bitmap >>= 1
        i += 1
    return out


class TxRecord:
    """One unacknowledged PSN at the sender."""

    __slots__ = ("item", "nbytes", "sent_ns", "entropy", "tx", "rto_retries", "seq",
                 "sack_rtx")

    def __init__(self, item: Any, nbytes: int, now_ns: float, entropy: int, seq: int) -> None:
        self.item = item              # what the NIC rebuilds the packet from
        self.nbytes = nbytes          # bytes the CC is charged for it
        self.sent_ns = now_ns         # last transmission
        self.entropy = entropy        # entropy (UDP source port) of the last transmission
        self.tx = 1                   # transmissions so far
        self.rto_retries = 0          # retransmissions on timeout
        self.seq = seq                # transmission sequence number of the last transmission
        self.sack_rtx = False         # the last transmission was a SACK-hole retransmission


@dataclass
class AckResult:
    """What one ACK did at the sender."""

    acked: list[tuple[int, TxRecord]] = field(default_factory=list)   # newly acknowledged
    rtt_ns: float | None = None            # an RTT sample (Karn), if the ACK gave one
    lost: list[tuple[int, TxRecord]] = field(default_factory=list)    # SACK holes queued
    stale: bool = False                    # acknowledged nothing new
    trigger: int | None = None             # the PSN whose arrival sent the ACK


class RudSender:
    """The initiator half of a RUD PDC: PSNs, window, SACK, selective retransmission."""

    def __init__(self, *, start_psn: int = 0, window_packets: int = 256,
                 rto_ns: float = 1_000_000.0, max_retries: int = 7, sack_threshold: int = 3,
                 rtt_ns: float = 10_000.0, reorder_rtts: float = 1.25) -> None:
        if window_packets < 1:
            raise ValueError(f"window_packets must be >= 1, got {window_packets}")
        if not rto_ns > 0:
            raise ValueError(f"rto_ns must be > 0, got {rto_ns}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self.window_packets = window_packets
        self.rto_ns = float(rto_ns)
        self.max_retries = max_retries
        self.sack_threshold = sack_threshold
        self.reorder_rtts = reorder_rtts      # a hole is lost no sooner than this many RTTs
        self.rtt_ns = float(rtt_ns)           # before the first sample
        self.srtt_ns: float | None = None
        self.min_rtt_ns = float("inf")        # the shortest RTT sample so far
        self.spurious_retransmissions = 0     # SACK resends whose first copy arrived
        self.next_psn = start_psn & PSN_MASK
        self.base = self.next_psn             # lowest unacknowledged PSN (or next_psn)
        self.unacked: dict[int, TxRecord] = {}
        self.inflight_bytes = 0
        self._highest_acked = self.base - 1   # highest PSN any ACK acknowledged
        self._seq = 0                         # transmissions so far (first and re-)
        self._top = [-1] * sack_threshold     # highest tx sequence numbers acknowledged
        self._rtx: deque[int] = deque()
        self._rtx_set: dict[int, str] = {}    # queued PSN -> why ("nack", "sack", "rto")
        # (deadline, psn, tx) in non-decreasing deadline order (rto is constant and `now`
        # never goes back), so the head is the next timeout; entries for PSNs acknowledged
        # or sent again since are skipped when they reach the head.
        self._timers: deque[tuple[float, int, int]] = deque()
        self._popped_why = "rto"
        self.failed: str | None = None
        self.packets_sent = 0
        self.retransmissions = 0
        self.nack_retransmissions = 0
        self.sack_retransmissions = 0
        self.rto_retransmissions = 0
        self.timeouts = 0
        self.acks_received = 0
        self.stale_acks = 0
        self.nacks_received = 0
        self.stale_nacks = 0

    # -- sending

    def window_open(self) -> bool:
        """A new PSN may go (window not full, not failed)."""
        return self.failed is None and self.next_psn - self.base < self.window_packets

    @property
    def inflight_packets(self) -> int:
        return len(self.unacked)

    def idle(self) -> bool:
        return not self.unacked

    def send_new(self, now_ns: float, item: Any, nbytes: int, entropy: int) -> int:
        """Give the next PSN to a first transmission; returns it (unbounded integer)."""
        psn = self.next_psn
        self.next_psn = psn + 1
        self._seq += 1
        self.unacked[psn] = TxRecord(item, nbytes, now_ns, entropy, self._seq)
        self.inflight_bytes += nbytes
        self._timers.append((now_ns + self.rto_ns, psn, 1))
        self.packets_sent += 1
        return psn

    def has_retransmit(self) -> bool:
        return bool(self._rtx) and self.failed is None

    def pop_retransmit(self) -> int | None:
        """The next PSN queued for retransmission that is still unacknowledged, or None."""
        while self._rtx and self.failed is None:
            psn = self._rtx.popleft()
            why = self._rtx_set.pop(psn, "rto")
            if psn in self.unacked:
                self._popped_why = why
                return psn
        return None

    def resent(self, psn: int, now_ns: float, entropy: int) -> TxRecord:
        """Record a retransmission of `psn` (from `pop_retransmit`) that just went out."""
        rec = self.unacked[psn]
        rec.tx += 1
        rec.sent_ns = now_ns
        rec.entropy = entropy
        self._seq += 1
        rec.seq = self._seq
        self._timers.append((now_ns + self.rto_ns, psn, rec.tx))
        self.retransmissions += 1
        why = self._popped_why
        rec.sack_rtx = why == "sack"
        if why == "nack":
            self.nack_retransmissions += 1
        elif why == "sack":
            self.sack_retransmissions += 1
        else:
            self.rto_retransmissions += 1
        return rec

    def _queue(self, psn: int, why: str, front: bool = False) -> bool:
        if psn in self._rtx_set or psn not in self.unacked:
            return False
        self._rtx_set[psn] = why
        if front:
            self._rtx.appendleft(psn)
        else:
            self._rtx.append(psn)
        return True

    # -- feedback

    def on_ack(self, now_ns: float, cack_wire: int, ack_psn_offset: int = 0,
               sack_base_wire: int | None = None, sack_bitmap: int = 0) -> AckResult:
        """An ACK: cumulative PSN, the trigger's offset from it, and a SACK bitmap."""
        self.acks_received += 1
        res = AckResult()
        unacked = self.unacked
        cack = unwrap(cack_wire, self.base)
        if cack >= self.next_psn:        # acknowledges PSNs never sent: ignore it
            self.stale_acks += 1
            res.stale = True
            return res
        trigger = cack + ack_psn_offset
        res.trigger = trigger
        acked = res.acked
        if cack >= self.base:
            for psn in range(self.base, cack + 1):
                rec = unacked.pop(psn, None)
                if rec is not None:
                    acked.append((psn, rec))
            self.base = cack + 1
        if sack_bitmap and sack_base_wire is not None:
            sbase = unwrap(sack_base_wire, cack + 1)
            for psn in sack_decode(sbase, sack_bitmap):
                rec = unacked.pop(psn, None)
                if rec is not None:
                    acked.append((psn, rec))
        if not acked:
            self.stale_acks += 1
            res.stale = True
        else:
            self._account(res, now_ns, trigger)
        # advance base past PSNs the SACK acknowledged
        base = self.base
        nxt = self.next_psn
        while base < nxt and base not in unacked:
            base += 1
        self.base = base
        if unacked and self._highest_acked > base:     # holes below a SACKed PSN
            res.lost = self._sack_holes(now_ns)
        return res

    def _account(self, res: AckResult, now_ns: float, trigger: int) -> None:
        """Bytes in flight, the highest acknowledged PSN and transmissions, an RTT sample."""
        top = self._top
        for psn, rec in res.acked:
            self.inflight_bytes -= rec.nbytes
            if psn > self._highest_acked:
                self._highest_acked = psn
            if top and rec.seq > top[0]:      # top: ascending, the k highest seqs acked
                top[0] = rec.seq
                top.sort()
            if rec.tx == 1 and psn == trigger:
                res.rtt_ns = now_ns - rec.sent_ns
            elif rec.sack_rtx and now_ns - rec.sent_ns < self.min_rtt_ns:
                # acknowledged sooner than any round trip took: the ACK was for the
                # first copy, which reordering had only delayed (a spurious resend, as
                # RACK detects them): widen this PDC's reordering window
                self.spurious_retransmissions += 1
                self.reorder_rtts = min(self.reorder_rtts * 2, MAX_REORDER_RTTS)
        if res.rtt_ns is None:      # the trigger was a duplicate or retransmitted: another
            for _psn, rec in res.acked:
                if rec.tx == 1:
                    res.rtt_ns = now_ns - rec.sent_ns
                    break
        if res.rtt_ns is not None:
            s = self.srtt_ns
            self.srtt_ns = res.rtt_ns if s is None else s + (res.rtt_ns - s) / 8
            self.min_rtt_ns = min(self.min_rtt_ns, res.rtt_ns)

    def _sack_holes(self, now_ns: float) -> list[tuple[int, TxRecord]]:
        """Unacknowledged PSNs below the highest acknowledged one whose last transmission
        is older than the `sack_threshold` newest acknowledged transmissions and than the
        reordering window: queued for retransmission (at most once until sent again), and
        returned."""
        if self.sack_threshold < 1:
            return []
        third = self._top[0]           # the k-th highest acknowledged transmission
        hi = self._highest_acked
        rtx = self._rtx_set
        rtt = self.srtt_ns if self.srtt_ns is not None else self.rtt_ns
        sent_before = now_ns - rtt * self.reorder_rtts
        out = []
        for psn, rec in self.unacked.items():   # insertion (= PSN) order
            if psn > hi:
                break
            if rec.seq >= third:
                # First transmissions go out in PSN order, so every later first
                # transmission is newer still, and a later PSN's retransmission is newer
                # than this one's first transmission: nothing further can be a hole.
                if rec.tx == 1:
                    break
                continue
            if psn not in rtx and rec.sent_ns <= sent_before:
                self._queue(psn, "sack")
                out.append((psn, rec))
        return out

    def on_nack_trimmed(self, psn_wire: int) -> TxRecord | None:
        """NACK(TRIMMED): retransmit that PSN at once. Its record, or None if stale."""
        self.nacks_received += 1
        psn = unwrap(psn_wire, self.base)
        rec = self.unacked.get(psn)
        if rec is None:             # acknowledged already (another copy of it arrived)
            self.stale_nacks += 1
            return None
        if not self._queue(psn, "nack", front=True):   # queued already: move it to the head
            try:
                self._rtx.remove(psn)
            except ValueError:
                pass
            self._rtx.appendleft(psn)
            self._rtx_set[psn] = "nack"
        return rec

    def on_nack_other(self) -> None:
        """A NACK with another code: counted; the RTO recovers what it stands for."""
        self.nacks_received += 1

    # -- timer

    def next_timer_ns(self) -> float | None:
        """Fabric time of the next retransmission timeout, or None."""
        timers = self._timers
        unacked = self.unacked
        while timers:
            _t, psn, tx = timers[0]
            rec = unacked.get(psn)
            if rec is None or rec.tx != tx:
                timers.popleft()
                continue
            return None if self.failed else _t
        return None

    def on_timer(self, now_ns: float) -> tuple[int, TxRecord] | None:
        """Fire a due RTO: the oldest expired transmission is queued for retransmission
        (returned), or the sender fails after `max_retries` timeouts of that PSN."""
        t = self.next_timer_ns()
        if t is None or t > now_ns:
            return None
        _t, psn, _tx = self._timers.popleft()
        rec = self.unacked[psn]
        self.timeouts += 1
        if rec.rto_retries >= self.max_retries:
            self.failed = (f"PSN {psn & PSN_MASK} unacknowledged after {rec.rto_retries} "
                           f"retransmissions on timeout (rto {self.rto_ns:g} fabric ns)")
            return None
        rec.rto_retries += 1
        if not self._queue(psn, "rto", front=True):
            self._rtx_set[psn] = "rto"
        return psn, rec

    def counters(self) -> dict:
        return {"packets_sent": self.packets_sent, "retransmissions": self.retransmissions,
                "nack_retransmissions": self.nack_retransmissions,
                "sack_retransmissions": self.sack_retransmissions,
                "rto_retransmissions": self.rto_retransmissions, "timeouts": self.timeouts,
                "acks_received": self.acks_received, "stale_acks": self.stale_acks,
                "nacks_received": self.nacks_received, "stale_nacks": self.stale_nacks,
                "inflight_packets": len(self.unacked), "inflight_bytes": self.inflight_bytes,
                "next_psn": self.next_psn & PSN_MASK,
                "srtt_ns": self.srtt_ns, "failed": self.failed,
                "spurious_retransmissions": self.spurious_retransmissions,
                "reorder_rtts": self.reorder_rtts}


class RxVerdict(NamedTuple):       # a tuple: made once per packet, cheaper than a dataclass
    """What the receiver made of one request packet."""

    psn: int              # unbounded integer PSN
    new: bool             # first arrival: deliver it
    ack_now: bool         # send an ACK now (else coalesce)
    out_of_window: bool = False   # dropped: too far above the cumulative PSN (NACK it)


class AckInfo(NamedTuple):
    """The PDS fields of an ACK the receiver sends."""

    cack_psn: int          # 32-bit, as on the wire
    ack_psn_offset: int    # trigger PSN - cack, clamped to 0..0xFFFF
    sack_psn_offset: int   # bitmap base - cack
    sack_bitmap: int


class RudReceiver:
    """The target half of a RUD PDC: cumulative PSN, received set, ACK coalescing."""

    def __init__(self, *, start_psn: int = 0, ack_every: int = 4,
                 max_ahead: int = MAX_AHEAD) -> None:
        if ack_every < 1:
            raise ValueError(f"ack_every must be >= 1, got {ack_every}")
        self.ack_every = ack_every
        self.max_ahead = max_ahead
        self.cack = (start_psn & PSN_MASK) - 1
        self.above: set[int] = set()       # received PSNs > cack
        self._pending = 0                   # new packets since the last ACK
        self.packets = 0
        self.duplicates = 0
        self.out_of_order = 0
        self.out_of_window = 0
        self.trims = 0
        self.acks = 0

    def on_packet(self, psn_wire: int, *, ackreq: bool = False, ecn: bool = False) -> RxVerdict:
        """A request packet that arrived whole (not trimmed)."""
        cack = self.cack
        psn = unwrap(psn_wire, cack + 1)
        if psn <= cack or psn in self.above:
            self.duplicates += 1
            return RxVerdict(psn, False, True)
        if psn - cack > self.max_ahead:
            self.out_of_window += 1
            return RxVerdict(psn, False, False, True)
        self.packets += 1
        self._pending += 1
        if psn == cack + 1:
            above = self.above
            cack = psn
            ooo = False
            if above:       # a hole filled (or not yet): tell the sender at once
                ooo = True
                while cack + 1 in above:
                    cack += 1
                    above.discard(cack)
            self.cack = cack
        else:
            self.above.add(psn)
            self.out_of_order += 1
            ooo = True
        return RxVerdict(psn, True, ooo or ackreq or ecn or self._pending >= self.ack_every)

    def on_trimmed(self, psn_wire: int) -> int:
        """A trimmed packet: not received. Its integer PSN, for the NACK."""
        self.trims += 1
        return unwrap(psn_wire, self.cack + 1)

    def ack_info(self, trigger_psn: int) -> AckInfo:
        """The fields of the ACK to send now (triggered by `trigger_psn`); resets coalescing."""
        self.acks += 1
        self._pending = 0
        cack = self.cack
        base = cack + 1
        bitmap = 0
        if self.above:
            if trigger_psn >= base + SACK_BITS:
                base = trigger_psn - SACK_BITS + 1
            bitmap = sack_encode(self.above, base)
        off = trigger_psn - cack
        return AckInfo(cack & PSN_MASK, off if 0 <= off <= 0xFFFF else 0, base - cack, bitmap)

    def ack_pending(self) -> bool:
        return self._pending > 0

    def counters(self) -> dict:
        return {"packets": self.packets, "duplicates": self.duplicates,
                "out_of_order": self.out_of_order, "out_of_window": self.out_of_window,
                "trims": self.trims, "acks": self.acks, "cack_psn": self.cack & PSN_MASK,
                "held_above_cack": len(self.above)}
