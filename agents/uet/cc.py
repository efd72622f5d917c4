"""Congestion control for the Ultra Ethernet transport, as pure state machines.

- `Nscc` / `NsccParams`: sender-based, window (cwnd) congestion control per PDC in the
  manner of UEC 1.0's NSCC (network-signalled CC): it reacts to the ECN echo of each
  ACK together with the RTT the ACK measured, in four cases (ECN x delay above target),
  plus a quick decrease on trimmed or lost packets and a reset on a timeout;
- `CreditSender` / `CreditReceiver` / `CreditParams`: receiver-driven credit in the
  manner of EQDS (and UEC 1.0's RCCC): a sender may send `unsolicited_bytes`
  speculatively, then only against credit its receiver granted; the receiver paces its
  grants so that the bytes it lets in equal its line rate, round robin among the PDCs
  that want to send;
- `NoCc`: the sender interface of `Nscc` with no limit (the PDS window is the only one).

Nothing here reads a clock, sleeps or touches a socket. Every time is FABRIC
nanoseconds passed in by the caller as `now_ns`; every rate is fabric bit/s; every size
is bytes. A `now_ns` earlier than one already seen is treated as the latest seen.

docs/uet-cc.md describes the algorithms, every parameter with its default and where it
comes from, and what we left out of NSCC and EQDS.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

NS_PER_S = 1_000_000_000
CREDIT_TARGET_MAX = (1 << 24) - 1   # RUD_CC_REQ carries credit_target in 24 bits


def _bdp_bytes(line_rate_bps: float, rtt_ns: float) -> float:
    """Bytes a link of `line_rate_bps` carries in `rtt_ns`."""
    return line_rate_bps * rtt_ns / 8 / NS_PER_S


def _tx_ns(nbytes: float, rate_bps: float) -> float:
    """Fabric ns it takes to put `nbytes` on a link of `rate_bps`."""
    return nbytes * 8 * NS_PER_S / rate_bps


def _check(problems: list[str]) -> None:
    if problems:
        raise ValueError("; ".join(problems))


# --- NSCC ----------------------------------------------------------------------------


@dataclass(frozen=True)
class NsccParams:
    """One NSCC parameter set. Times are fabric ns, sizes bytes, rates bit/s.

    Where UEC 1.0 / the public NSCC descriptions fix a value we say so; the public text
    gives the structure (four cases, quick adapt, bounds) but few of the constants, so
    most gains below are our choice, picked with the simulation in
    tests/unit/test_uet_cc.py (docs/uet-cc.md gives the measurements).
    """

    line_rate_bps: float
    """Rate of this sender's NIC (bit/s); with `base_rtt_ns` it gives the BDP."""
    base_rtt_ns: float
    """Round trip with empty queues (ns). NSCC measures delay against it."""
    mtu_bytes: int = 4152
    """Largest packet on the wire (bytes): 4096 payload + UET/UDP/IP/Ethernet headers.
    Our choice, matching the transport's default 4096-byte payload."""
    target_delay_ns: float | None = None
    """RTT above which NSCC calls the delay "high". None: `base_rtt_ns` +
    `target_margin` x `base_rtt_ns`. NSCC defines a target queueing delay on top of the
    base RTT; its value is a deployment choice."""
    target_margin: float = 0.5
    """Target queueing delay as a fraction of the base RTT, when `target_delay_ns` is
    None. Our choice (half a base RTT of queue keeps the link busy through a decrease)."""
    max_cwnd_bdp: float = 1.5
    """Largest window, in BDPs of line rate x base RTT. The public NSCC description
    bounds cwnd at about 1.5 BDP."""
    min_cwnd_bytes: float | None = None
    """Smallest window (bytes). None: one MTU. A timeout resets cwnd to it."""
    initial_cwnd_bdp: float = 1.0
    """Window a new PDC starts with, in BDPs. NSCC starts senders near line rate (one
    BDP in flight) instead of slow start; the exact value is our choice."""
    md_gain: float = 1.0
    """Multiplicative decrease on ECN + high delay: cwnd *= 1 - md_gain x
    (rtt - target) / rtt, capped by `max_md_fraction`. The proportional form is NSCC's;
    the gain is our choice."""
    max_md_fraction: float = 0.5
    """Largest fraction one multiplicative decrease removes. Our choice (TCP's halving)."""
    pi_bdp: float = 0.1
    """Proportional increase on no ECN + low delay, in BDPs per RTT at an empty queue:
    per ACK, cwnd += pi_bdp x BDP x (acked / cwnd) x (target - rtt) / (target - base),
    the last factor clamped to [0, 1]. So each PDC adds the same bytes per RTT whatever
    its window (additive, so windows converge to fair shares), more the further the
    delay is below target, nothing at the target. The form (increase proportional to
    the distance below the target) is NSCC's; the gain is our choice."""
    fi_bytes: float | None = None
    """Fair (additive) increase on no ECN + high delay: fi_bytes per RTT's worth of ACKs
    (cwnd += fi_bytes x acked / cwnd). None: one MTU. NSCC's fair increase is a small
    additive step; its size is our choice."""
    qa_decrease_fraction: float = 0.5
    """Quick adapt on a trim or a loss: cwnd = max(min, min(cwnd x (1 - this), bytes
    acked in the last RTT)). NSCC's quick adapt sets cwnd to what the last RTT
    delivered; the multiplicative cap is our choice so a trim always decreases."""
    delay_ewma_gain: float = 0.125
    """Gain of the smoothed RTT used for pacing and for the once-per-RTT spacing. Our
    choice (TCP's SRTT gain, RFC 6298)."""
    max_rtt_sample_ns: float | None = None
    """RTT samples above this are ignored as bogus (a stale or corrupt timestamp).
    None: 1000 x `base_rtt_ns`. Our choice."""
    pacing: bool = False
    """Pace sends at cwnd / smoothed RTT (`send_due_ns`). Off by default: the window
    alone clocks the sender, as NSCC is window-based."""

    @property
    def bdp_bytes(self) -> float:
        return _bdp_bytes(self.line_rate_bps, self.base_rtt_ns)

    @property
    def target_rtt_ns(self) -> float:
        if self.target_delay_ns is not None:
            return self.target_delay_ns
        return self.base_rtt_ns * (1 + self.target_margin)

    @property
    def rtt_sample_limit_ns(self) -> float:
        if self.max_rtt_sample_ns is not None:
            return self.max_rtt_sample_ns
        return 1000 * self.base_rtt_ns

    @property
    def max_cwnd(self) -> float:
        return max(self.min_cwnd, self.max_cwnd_bdp * self.bdp_bytes)

    @property
    def min_cwnd(self) -> float:
        return float(self.mtu_bytes if self.min_cwnd_bytes is None else self.min_cwnd_bytes)

    @property
    def fair_increase_bytes(self) -> float:
        return float(self.mtu_bytes if self.fi_bytes is None else self.fi_bytes)

    def __post_init__(self) -> None:
        p = []
        if not self.line_rate_bps > 0:
            p.append("line_rate_bps must be > 0")
        if not self.base_rtt_ns > 0:
            p.append("base_rtt_ns must be > 0")
        if not self.mtu_bytes > 0:
            p.append("mtu_bytes must be > 0")
        if self.target_delay_ns is not None and not self.target_delay_ns > self.base_rtt_ns:
            p.append("target_delay_ns must be > base_rtt_ns")
        if not self.target_margin > 0:
            p.append("target_margin must be > 0")
        if self.min_cwnd_bytes is not None and not self.min_cwnd_bytes > 0:
            p.append("min_cwnd_bytes must be > 0")
        for name in ("max_cwnd_bdp", "initial_cwnd_bdp", "md_gain", "pi_bdp"):
            if not getattr(self, name) > 0:
                p.append(f"{name} must be > 0")
        if self.max_rtt_sample_ns is not None and \
                not self.max_rtt_sample_ns > self.target_rtt_ns:
            p.append("max_rtt_sample_ns must be > the target RTT")
        if self.fi_bytes is not None and not self.fi_bytes >= 0:
            p.append("fi_bytes must be >= 0")
        for name in ("max_md_fraction", "qa_decrease_fraction", "delay_ewma_gain"):
            if not 0 < getattr(self, name) <= 1:
                p.append(f"{name} must be in (0, 1]")
        _check(p)


class Nscc:
    """NSCC-style sender window for one PDC.

    Each ACK carries `ecn` (the echo of a CE mark) and, usually, an RTT sample. The
    sample is compared with the target RTT and the pair picks one of four reactions:

    | ECN | RTT vs target | reaction                                                |
    |-----|---------------|---------------------------------------------------------|
    | yes | above         | multiplicative decrease proportional to the excess,     |
    |     |               | at most once per RTT                                    |
    | no  | below         | proportional increase (the further below, the faster)   |
    | yes | below         | hold: with spraying, one marked path is likely a        |
    |     |               | transient elsewhere, not this PDC's bottleneck          |
    | no  | above         | small additive ("fair") increase: the delay is shared,  |
    |     |               | nobody marked us, so converge towards fairness          |

    An ACK without an RTT sample (or with one that is not in (0, max_rtt_sample_ns])
    uses the last sample (the base RTT before any).
    A trim or a loss triggers quick adapt (at most once per RTT); a timeout resets the
    window to the minimum. The window stays within [min_cwnd, max_cwnd].
    """

    def __init__(self, p: NsccParams, now_ns: float = 0.0) -> None:
        self.p = p
        self._now_ns = now_ns
        self.cwnd_bytes: float = min(p.max_cwnd, max(p.min_cwnd, p.initial_cwnd_bdp
                                                     * p.bdp_bytes))
        self.srtt_ns: float = p.base_rtt_ns
        self._last_rtt_ns: float = p.base_rtt_ns
        self._last_md_ns: float = -math.inf
        self._last_qa_ns: float = -math.inf
        # bytes acked per RTT-long window, for quick adapt's "what the last RTT delivered"
        self._win_start_ns = now_ns
        self._win_acked = 0
        self._prev_win_acked: int | None = None
        self._next_send_ns = now_ns
        self._c = {"acks": 0, "acked_bytes": 0, "ecn_acks": 0, "decreases": 0,
                   "increases": 0, "fair_increases": 0, "holds": 0,
                   "suppressed_decreases": 0, "trims": 0, "losses": 0, "quick_adapts": 0,
                   "timeouts": 0}

    # -- helpers --

    def _clock(self, now_ns: float) -> float:
        if now_ns > self._now_ns:
            self._now_ns = now_ns
        return self._now_ns

    def _rtt_guard_ns(self) -> float:
        """Spacing of decreases: one RTT, the larger of the last sample and the base."""
        return max(self.p.base_rtt_ns, self._last_rtt_ns)

    def _bound(self) -> None:
        self.cwnd_bytes = min(self.p.max_cwnd, max(self.p.min_cwnd, self.cwnd_bytes))

    def _roll_window(self, now: float) -> None:
        if now - self._win_start_ns >= self._rtt_guard_ns():
            self._prev_win_acked = self._win_acked
            self._win_acked = 0
            self._win_start_ns = now

    # -- sender interface --

    def can_send(self, inflight_bytes: int, nbytes: int) -> bool:
        """True if a packet of `nbytes` fits the window with `inflight_bytes` unacked.
        With nothing in flight one packet always may go, so a window below one packet
        cannot stall the PDC."""
        return inflight_bytes <= 0 or inflight_bytes + nbytes <= self.cwnd_bytes

    def on_sent(self, now_ns: float, nbytes: int) -> None:
        """A packet of `nbytes` left (only pacing needs to know)."""
        now = self._clock(now_ns)
        if self.p.pacing:
            rate_bps = self.cwnd_bytes * 8 * NS_PER_S / self.srtt_ns
            self._next_send_ns = max(self._next_send_ns, now) + _tx_ns(nbytes, rate_bps)

    def send_due_ns(self, now_ns: float) -> float | None:
        """Pacing: the earliest time the next packet may go (>= now), or None when
        pacing is off."""
        now = self._clock(now_ns)
        if not self.p.pacing:
            return None
        return max(now, self._next_send_ns)

    def on_ack(self, now_ns: float, acked_bytes: int, rtt_ns: float | None,
               ecn: bool) -> None:
        """An ACK for `acked_bytes` newly acknowledged bytes, with the RTT it measured
        (None if it measured none) and whether it echoed a CE mark."""
        now = self._clock(now_ns)
        p = self.p
        c = self._c
        c["acks"] += 1
        c["acked_bytes"] += max(0, acked_bytes)
        if ecn:
            c["ecn_acks"] += 1
        if rtt_ns is not None and 0 < rtt_ns <= p.rtt_sample_limit_ns:
            self._last_rtt_ns = rtt_ns
            self.srtt_ns += p.delay_ewma_gain * (rtt_ns - self.srtt_ns)
        self._roll_window(now)
        self._win_acked += max(0, acked_bytes)
        rtt = self._last_rtt_ns
        target = p.target_rtt_ns
        high = rtt > target
        if ecn and high:
            if now - self._last_md_ns >= self._rtt_guard_ns():
                cut = min(p.max_md_fraction, p.md_gain * (rtt - target) / rtt)
                self.cwnd_bytes *= 1 - cut
                self._last_md_ns = now
                c["decreases"] += 1
            else:
                c["suppressed_decreases"] += 1
        elif not ecn and not high:
            below = min(1.0, (target - rtt) / (target - p.base_rtt_ns))
            self.cwnd_bytes += p.pi_bdp * p.bdp_bytes * max(0, acked_bytes) \
                / self.cwnd_bytes * below
            c["increases"] += 1
        elif ecn:
            c["holds"] += 1
        else:
            self.cwnd_bytes += p.fair_increase_bytes * max(0, acked_bytes) / self.cwnd_bytes
            c["fair_increases"] += 1
        self._bound()

    def _quick_adapt(self, now: float) -> None:
        if now - self._last_qa_ns < self._rtt_guard_ns():
            return
        new = self.cwnd_bytes * (1 - self.p.qa_decrease_fraction)
        delivered = max(self._prev_win_acked or 0, self._win_acked)
        if delivered > 0:
            new = min(new, delivered)
        self.cwnd_bytes = new
        self._last_qa_ns = now
        # a quick adapt is the decrease for this RTT: no multiplicative one on top
        self._last_md_ns = now
        self._c["quick_adapts"] += 1
        self._bound()

    def on_trim(self, now_ns: float, nbytes: int) -> None:
        """A NACK(TRIMMED) for a packet of `nbytes`: a switch queue overflowed."""
        now = self._clock(now_ns)
        self._c["trims"] += 1
        self._roll_window(now)
        self._quick_adapt(now)

    def on_loss(self, now_ns: float, nbytes: int) -> None:
        """A packet of `nbytes` inferred lost from the SACK bitmap."""
        now = self._clock(now_ns)
        self._c["losses"] += 1
        self._roll_window(now)
        self._quick_adapt(now)

    def on_timeout(self, now_ns: float) -> None:
        """A retransmission timeout: nothing came back for an RTO; start over small."""
        now = self._clock(now_ns)
        self._c["timeouts"] += 1
        self.cwnd_bytes = self.p.min_cwnd
        self._last_md_ns = now
        self._last_qa_ns = now

    def counters(self) -> dict[str, Any]:
        return {"cwnd_bytes": self.cwnd_bytes, "srtt_ns": self.srtt_ns, **self._c}


class NoCc:
    """No congestion control: the sender interface of `Nscc`, never limiting (the PDS
    window is the only limit). Counts the events it is told about."""

    cwnd_bytes: float = math.inf

    def __init__(self, p: NsccParams | None = None, now_ns: float = 0.0) -> None:
        self._c = {"acks": 0, "acked_bytes": 0, "ecn_acks": 0, "trims": 0, "losses": 0,
                   "timeouts": 0}

    def can_send(self, inflight_bytes: int, nbytes: int) -> bool:
        return True

    def on_sent(self, now_ns: float, nbytes: int) -> None:
        pass

    def send_due_ns(self, now_ns: float) -> float | None:
        return None

    def on_ack(self, now_ns: float, acked_bytes: int, rtt_ns: float | None,
               ecn: bool) -> None:
        self._c["acks"] += 1
        self._c["acked_bytes"] += max(0, acked_bytes)
        self._c["ecn_acks"] += int(ecn)

    def on_trim(self, now_ns: float, nbytes: int) -> None:
        self._c["trims"] += 1

    def on_loss(self, now_ns: float, nbytes: int) -> None:
        self._c["losses"] += 1

    def on_timeout(self, now_ns: float) -> None:
        self._c["timeouts"] += 1

    def counters(self) -> dict[str, Any]:
        return {"cwnd_bytes": None, **self._c}


# --- receiver credit (EQDS-style) ----------------------------------------------------


@dataclass(frozen=True)
class CreditParams:
    """One receiver-credit parameter set. All sizes are WIRE bytes (the caller passes a
    packet's wire size everywhere), so credit paced at line rate fills the link exactly.
    """

    line_rate_bps: float
    """Rate of the receiving NIC (bit/s): the rate at which the receiver grants."""
    mtu_bytes: int = 4152
    """Largest packet on the wire (bytes). Our choice (4096 payload + headers)."""
    base_rtt_ns: float = 10_000.0
    """Round trip with empty queues (ns), for the BDP defaults below. Default: the
    transport's default base RTT (10 us)."""
    unsolicited_bytes: int | None = None
    """Bytes a PDC may send speculatively before its first credit. None: one BDP
    (line rate x base RTT), so a lone sender loses nothing while its first request
    travels; EQDS lets a sender start at line rate for one RTT the same way. 0: a
    sender waits for credit before its first byte (then it asks with a CREDIT_REQ)."""
    grant_bytes: int | None = None
    """Credit per grant. None: one MTU (one packet), EQDS's pull quantum."""
    max_outstanding_bytes: int | None = None
    """Most credit one PDC may hold unused or in flight (granted, its data not yet
    arrived). None: one BDP, enough for one sender to fill the link alone. Bounds what a
    silent sender hoards. Our choice."""
    credit_timeout_ns: float | None = None
    """A PDC that received credit and sent nothing for this long loses its outstanding
    credit at the receiver (it is written off and may be granted to others). None: 4 x
    base RTT. Our choice."""

    @property
    def bdp_bytes(self) -> int:
        return int(_bdp_bytes(self.line_rate_bps, self.base_rtt_ns))

    @property
    def unsolicited(self) -> int:
        return self.bdp_bytes if self.unsolicited_bytes is None else self.unsolicited_bytes

    @property
    def grant(self) -> int:
        return self.mtu_bytes if self.grant_bytes is None else self.grant_bytes

    @property
    def max_outstanding(self) -> int:
        if self.max_outstanding_bytes is not None:
            return self.max_outstanding_bytes
        return max(self.bdp_bytes, 2 * self.grant)

    @property
    def timeout_ns(self) -> float:
        return 4 * self.base_rtt_ns if self.credit_timeout_ns is None \
            else self.credit_timeout_ns

    def __post_init__(self) -> None:
        p = []
        if not self.line_rate_bps > 0:
            p.append("line_rate_bps must be > 0")
        if not self.mtu_bytes > 0:
            p.append("mtu_bytes must be > 0")
        if not self.base_rtt_ns > 0:
            p.append("base_rtt_ns must be > 0")
        if self.unsolicited_bytes is not None and self.unsolicited_bytes < 0:
            p.append("unsolicited_bytes must be >= 0")
        if self.grant_bytes is not None and self.grant_bytes <= 0:
            p.append("grant_bytes must be > 0")
        if self.max_outstanding_bytes is not None and self.max_outstanding_bytes < self.grant:
            p.append("max_outstanding_bytes must be >= grant_bytes")
        if self.credit_timeout_ns is not None and self.credit_timeout_ns <= 0:
            p.append("credit_timeout_ns must be > 0")
        _check(p)


class CreditSender:
    """The sender side of one PDC under receiver credit.

    Before its first credit arrives the PDC may send up to `unsolicited_bytes`
    speculatively; from the first credit on it sends only against credit (what is left
    of the speculative allowance is forfeited, so the speculative burst happens once per
    PDC). The engine calls `can_send(n)` before a packet of n wire bytes, `on_sent(n)`
    after it, `credit_target(backlog)` for the RUD_CC_REQ field (backlog = wire bytes
    still queued after this packet), and `on_credit(n)` for each grant.
    """

    def __init__(self, p: CreditParams) -> None:
        self.p = p
        self.credit_bytes = 0
        self.unsolicited_left = p.unsolicited
        self._granted_once = False
        self._c = {"credits_received": 0, "credit_bytes_received": 0,
                   "unsolicited_sent_bytes": 0, "credited_sent_bytes": 0,
                   "credit_dropped_bytes": 0, "overdraft_bytes": 0}

    def can_send(self, nbytes: int) -> bool:
        if self.credit_bytes >= nbytes:
            return True
        return not self._granted_once and self.unsolicited_left >= nbytes

    def on_sent(self, nbytes: int) -> None:
        c = self._c
        if self.credit_bytes >= nbytes:
            self.credit_bytes -= nbytes
            c["credited_sent_bytes"] += nbytes
        elif not self._granted_once and self.unsolicited_left >= nbytes:
            self.unsolicited_left -= nbytes
            c["unsolicited_sent_bytes"] += nbytes
        else:                          # sent without cover (the engine ignored can_send):
            # the debt is paid from the next credit
            c["overdraft_bytes"] += nbytes - max(0, self.credit_bytes)
            c["credited_sent_bytes"] += nbytes
            self.credit_bytes -= nbytes

    def on_credit(self, nbytes: int) -> None:
        if nbytes <= 0:
            return
        if not self._granted_once:
            self._granted_once = True
            self.unsolicited_left = 0
        self.credit_bytes += nbytes
        self._c["credits_received"] += 1
        self._c["credit_bytes_received"] += nbytes

    def credit_target(self, backlog_bytes: int) -> int:
        """Bytes still wanted beyond the cover this PDC holds, for RUD_CC_REQ (24 bits,
        saturating). Credit held beyond the backlog is dropped here: the sender has no
        use for it, and the receiver writes it off after `credit_timeout_ns`."""
        backlog = max(0, backlog_bytes)
        if self.credit_bytes > backlog:
            self._c["credit_dropped_bytes"] += self.credit_bytes - backlog
            self.credit_bytes = backlog
        cover = max(0, self.credit_bytes) + (0 if self._granted_once
                                             else self.unsolicited_left)
        return min(CREDIT_TARGET_MAX, max(0, backlog - cover))

    def counters(self) -> dict[str, Any]:
        return {"credit_held_bytes": self.credit_bytes,
                "unsolicited_left_bytes": self.unsolicited_left, **self._c}


class _Pdc:
    __slots__ = ("wanted", "outstanding", "last_grant_ns", "last_data_ns", "granted",
                 "received")

    def __init__(self) -> None:
        self.wanted = 0            # bytes the PDC still wants (its last credit_target
        #                            minus what we granted since)
        self.outstanding = 0       # granted and not yet seen arrive as data
        self.last_grant_ns = -math.inf
        self.last_data_ns = -math.inf
        self.granted = 0
        self.received = 0


class CreditReceiver:
    """The receiving NIC's credit pacer, shared by every PDC that sends to it.

    Pacing: a grant of g bytes moves the pacer's clock on by g x 8 / line rate, so the
    credit issued over any interval is line rate x interval (+ one grant). Bytes that
    arrive without cover (speculative data) move the clock on too, as if granted: the
    receiver lets in line rate in total, speculative bytes included. While nobody wants
    credit the clock does not run ahead (no burst of saved-up grants).

    Fairness: grants go round robin, one grant at a time, among PDCs that still want
    bytes and hold less than `max_outstanding_bytes`; a PDC is never granted more than
    it still wants (its latest credit_target minus what it was granted since).

    Stale credit: a PDC's outstanding credit falls as its data arrives (`on_data`). If
    it holds credit and sends nothing for `credit_timeout_ns` after its last grant or
    its last data, the receiver writes the credit off (`reclaimed_bytes`) and forgets
    its demand until it asks again; the sender drops credit beyond its backlog in
    `CreditSender.credit_target`, so the two sides agree that such credit is gone.
    The write-off is checked in `grants()`, so it happens when some PDC can be granted.
    """

    def __init__(self, p: CreditParams, now_ns: float = 0.0) -> None:
        self.p = p
        self._now_ns = now_ns
        self._next_ns = now_ns           # the pacer's clock: when the next grant may go
        self._pdcs: dict[Hashable, _Pdc] = {}
        self._order: list[Hashable] = []  # round robin order (first seen first)
        self._rr = 0
        self._c = {"grants": 0, "credit_bytes": 0, "demands": 0, "data_bytes": 0,
                   "uncovered_bytes": 0, "reclaimed_bytes": 0, "reclaims": 0}

    def _clock(self, now_ns: float) -> float:
        if now_ns > self._now_ns:
            self._now_ns = now_ns
        return self._now_ns

    def _pdc(self, pdc: Hashable) -> _Pdc:
        st = self._pdcs.get(pdc)
        if st is None:
            st = self._pdcs[pdc] = _Pdc()
            self._order.append(pdc)
        return st

    def _eligible(self, st: _Pdc) -> bool:
        return st.wanted > 0 and st.outstanding + min(self.p.grant, st.wanted) \
            <= self.p.max_outstanding

    def _any_eligible(self) -> bool:
        return any(self._eligible(st) for st in self._pdcs.values())

    def _wake(self, now: float, was_idle: bool) -> None:
        """Demand appeared where there was none: grant from now, not from the past."""
        if was_idle and self._next_ns < now:
            self._next_ns = now

    def _reclaim(self, now: float) -> None:
        for st in self._pdcs.values():
            if st.outstanding > 0 and \
                    now - max(st.last_grant_ns, st.last_data_ns) >= self.p.timeout_ns:
                self._c["reclaimed_bytes"] += st.outstanding
                self._c["reclaims"] += 1
                st.outstanding = 0
                st.wanted = 0

    def on_demand(self, now_ns: float, pdc: Hashable, wanted_bytes: int) -> None:
        """A request (RUD_CC_REQ credit_target, or a CREDIT_REQ) says `pdc` still wants
        `wanted_bytes` beyond the cover it holds."""
        now = self._clock(now_ns)
        idle = not self._any_eligible()
        st = self._pdc(pdc)
        st.wanted = max(0, int(wanted_bytes))
        self._c["demands"] += 1
        self._wake(now, idle)

    def on_data(self, now_ns: float, pdc: Hashable, nbytes: int) -> None:
        """A data packet of `nbytes` wire bytes arrived from `pdc`. Bytes beyond the
        credit outstanding for it were speculative: they take their share of the line
        rate as if granted."""
        now = self._clock(now_ns)
        idle = not self._any_eligible()
        st = self._pdc(pdc)
        st.last_data_ns = now
        st.received += nbytes
        covered = min(st.outstanding, nbytes)
        st.outstanding -= covered
        uncovered = nbytes - covered
        self._c["data_bytes"] += nbytes
        if uncovered > 0:
            self._c["uncovered_bytes"] += uncovered
            self._next_ns = max(self._next_ns, now) + _tx_ns(uncovered, self.p.line_rate_bps)
        self._wake(now, idle)

    def next_grant_ns(self) -> float | None:
        """When the next grant is due, or None while no PDC can be granted."""
        if not self._any_eligible():
            return None
        return max(self._next_ns, self._now_ns)

    def grants(self, now_ns: float) -> list[tuple[Hashable, int]]:
        """Every grant due at or before `now_ns`, as (pdc, bytes), round robin."""
        now = self._clock(now_ns)
        self._reclaim(now)
        # an engine that comes back late catches up at most one base RTT of grants, so a
        # stall of the caller does not turn into a burst of credit
        self._next_ns = max(self._next_ns, now - self.p.base_rtt_ns)
        out: list[tuple[Hashable, int]] = []
        n = len(self._order)
        while self._next_ns <= now and n:
            chosen = None
            for i in range(n):
                key = self._order[(self._rr + i) % n]
                if self._eligible(self._pdcs[key]):
                    chosen = key
                    self._rr = (self._rr + i + 1) % n
                    break
            if chosen is None:
                break
            st = self._pdcs[chosen]
            g = min(self.p.grant, st.wanted)
            st.wanted -= g
            st.outstanding += g
            st.granted += g
            st.last_grant_ns = now
            self._next_ns += _tx_ns(g, self.p.line_rate_bps)
            self._c["grants"] += 1
            self._c["credit_bytes"] += g
            out.append((chosen, g))
        return out

    def counters(self) -> dict[str, Any]:
        pdcs = {str(k): {"wanted_bytes": st.wanted, "outstanding_bytes": st.outstanding,
                         "granted_bytes": st.granted, "received_bytes": st.received}
                for k, st in self._pdcs.items()}
        return {**self._c, "outstanding_bytes": sum(s.outstanding for s in
                                                    self._pdcs.values()),
                "pdcs": pdcs}
