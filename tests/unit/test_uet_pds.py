"""PDS RUD (agents.uet.pds): exactly-once delivery under loss, reordering and duplication,
selective retransmission of only what is missing, SACK bitmaps, RTO and the retry limit.

The network is simulated: a forward channel that loses, trims, duplicates and reorders
request packets, a reverse channel for ACKs and NACKs, a fake fabric clock."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agents.uet.pds import PSN_MASK, RudReceiver, RudSender, sack_decode, sack_encode, unwrap

RTT_NS = 1_000.0
STEP_NS = 10.0


class Net:
    """A sender and a receiver joined by a lossy, reordering, duplicating pair of channels."""

    def __init__(self, seed: int, *, n: int, start_psn: int = 0, loss: float = 0.0,
                 trim: float = 0.0, dup: float = 0.0, ack_loss: float = 0.0,
                 reorder: float = 0.0, ack_reorder: float = 0.0, window: int = 32,
                 rto_ns: float = 50_000.0,
                 ack_every: int = 4, max_retries: int = 50) -> None:
        self.rng = random.Random(seed)
        self.s = RudSender(start_psn=start_psn, window_packets=window, rto_ns=rto_ns,
                           max_retries=max_retries, rtt_ns=RTT_NS)
        self.r = RudReceiver(start_psn=start_psn, ack_every=ack_every)
        self.n, self.loss, self.trim, self.dup, self.ack_loss = n, loss, trim, dup, ack_loss
        # each packet is delayed by 1 step plus up to `reorder` (`ack_reorder`) steps of
        # jitter, so a packet is overtaken by at most the packets sent within that jitter
        self.reorder, self.ack_reorder = reorder, ack_reorder
        self.fwd: list[tuple] = []     # (arrival, n, (wire psn, trimmed, ackreq))
        self.rev: list[tuple] = []     # (arrival, n, (kind, what))
        self._n = 0
        self.now = 0.0
        self.sent_new = 0
        self.losses = 0          # transmissions that never arrived whole (lost or trimmed)
        self.trims = 0
        self.delivered: dict[int, int] = {}
        self.rx_duplicates_expected = 0
        self._arrived: set[int] = set()
        self.last_psn = start_psn + n - 1

    def _transmit(self, psn: int, retrans: bool) -> None:
        ackreq = retrans or psn == self.last_psn
        if self.rng.random() < self.loss:
            self.losses += 1
            return
        trimmed = self.rng.random() < self.trim
        if trimmed:
            self.losses += 1
            self.trims += 1
        # a switch trims a packet, it does not copy it: only whole packets are duplicated
        copies = 2 if not trimmed and self.rng.random() < self.dup else 1
        for _ in range(copies):
            self._put(self.fwd, self.reorder, (psn & PSN_MASK, trimmed, ackreq))

    def _put(self, chan: list, jitter: float, what: tuple) -> None:
        self._n += 1
        chan.append((self.now + STEP_NS * (1 + self.rng.random() * jitter), self._n, what))

    def _due(self, chan: list) -> list[tuple]:
        due = sorted(x for x in chan if x[0] <= self.now)
        if due:
            chan[:] = [x for x in chan if x[0] > self.now]
        return [x[2] for x in due]

    def step(self) -> None:
        s, r = self.s, self.r
        self.now += STEP_NS
        t = s.next_timer_ns()
        if t is not None and t <= self.now:
            s.on_timer(self.now)
        psn = s.pop_retransmit()
        if psn is not None:
            s.resent(psn, self.now, entropy=0)
            self._transmit(psn, True)
        elif self.sent_new < self.n and s.window_open():
            psn = s.send_new(self.now, item=self.sent_new, nbytes=100, entropy=0)
            self.sent_new += 1
            self._transmit(psn, False)
        for wire, trimmed, ackreq in self._due(self.fwd):
            if trimmed:
                self._put(self.rev, self.ack_reorder, ("nack", r.on_trimmed(wire)))
            else:
                v = r.on_packet(wire, ackreq=ackreq)
                if v.new:
                    self.delivered[v.psn] = self.delivered.get(v.psn, 0) + 1
                if v.ack_now:
                    self._put(self.rev, self.ack_reorder, ("ack", r.ack_info(v.psn)))
        for kind, what in self._due(self.rev):
            if self.rng.random() < self.ack_loss:
                continue
            if kind == "nack":
                s.on_nack_trimmed(what & PSN_MASK)
            else:
                s.on_ack(self.now, what.cack_psn, what.ack_psn_offset,
                         (what.cack_psn + what.sack_psn_offset) & PSN_MASK, what.sack_bitmap)

    def idle(self) -> bool:
        return not self.fwd and not self.rev

    def run(self, max_steps: int = 2_000_000) -> None:
        for _ in range(max_steps):
            if self.sent_new == self.n and self.s.idle() or self.s.failed:
                return
            self.step()
            blocked = self.sent_new == self.n or not self.s.window_open()
            if self.idle() and blocked and not self.s.has_retransmit():
                t = self.s.next_timer_ns()      # nothing in flight: jump to the timeout
                if t is not None and t > self.now:
                    self.now = t
        raise AssertionError("simulation did not finish")


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), loss=st.floats(0, 0.3), trim=st.floats(0, 0.3),
       dup=st.floats(0, 0.3), ack_loss=st.floats(0, 0.3), reorder=st.floats(0, 20),
       ack_reorder=st.floats(0, 20),
       start=st.sampled_from([0, PSN_MASK - 40, 12345]))
def test_every_psn_is_delivered_exactly_once_under_loss_reordering_and_duplication(
        seed, loss, trim, dup, ack_loss, reorder, ack_reorder, start):
    net = Net(seed, n=300, start_psn=start, loss=loss, trim=trim, dup=dup,
              ack_loss=ack_loss, reorder=reorder, ack_reorder=ack_reorder)
    net.run()
    assert net.s.failed is None
    assert sorted(net.delivered) == list(range(start, start + 300))
    assert set(net.delivered.values()) == {1}
    assert net.r.cack == start + 299
    assert net.s.inflight_bytes == 0


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), trim=st.floats(0.01, 0.4), dup=st.floats(0, 0.3),
       reorder=st.floats(0, 2.9))
def test_with_nack_only_loss_exactly_the_trimmed_packets_are_retransmitted(
        seed, trim, dup, reorder):
    # Reordering by at most 2 places never looks like loss to the 3-packet SACK rule,
    # ACKs and NACKs stay in order, and the RTO is far away: every retransmission
    # answers one trimmed transmission.
    net = Net(seed, n=200, trim=trim, dup=dup, reorder=reorder, rto_ns=1e12)
    net.run()
    assert sorted(net.delivered) == list(range(200))
    assert net.s.retransmissions == net.trims
    assert net.s.nack_retransmissions == net.trims
    assert net.s.sack_retransmissions == net.s.timeouts == 0
    assert net.r.trims == net.trims


def test_lost_packets_are_found_by_sack_and_only_they_are_resent():
    net = Net(7, n=500, loss=0.05, reorder=0, rto_ns=1e12)
    net.run()
    assert sorted(net.delivered) == list(range(500))
    # every retransmission answers a loss; only a lost tail (no 3 later packets to
    # acknowledge) needs the timeout
    assert net.s.retransmissions == net.losses
    assert net.s.sack_retransmissions >= net.losses - 3
    assert net.s.timeouts == net.s.rto_retransmissions <= 3


def test_a_lost_tail_is_recovered_by_the_rto_of_the_oldest_unacked():
    s = RudSender(window_packets=8, rto_ns=5_000, rtt_ns=RTT_NS)
    r = RudReceiver(ack_every=1)
    for i in range(4):
        s.send_new(float(i), item=i, nbytes=10, entropy=0)
    for psn in (0, 1):               # 2 and 3 are lost
        a = r.ack_info(r.on_packet(psn).psn)
        s.on_ack(100.0, a.cack_psn, a.ack_psn_offset, a.cack_psn + a.sack_psn_offset,
                 a.sack_bitmap)
    assert s.next_timer_ns() == 2 + 5_000
    assert s.on_timer(4_000.0) is None            # not yet
    psn, _rec = s.on_timer(5_002.0)
    assert psn == 2 and s.timeouts == 1
    assert s.pop_retransmit() == 2
    s.resent(2, 5_002.0, entropy=0)
    assert s.next_timer_ns() == 3 + 5_000          # PSN 3 is the oldest transmission now
    assert s.on_timer(5_003.0)[0] == 3


def test_the_retry_limit_fails_the_pdc_with_a_reason():
    s = RudSender(window_packets=4, rto_ns=1_000, max_retries=3)
    s.send_new(0.0, item=None, nbytes=10, entropy=0)
    now = 0.0
    for _ in range(3):
        now = s.next_timer_ns()
        assert s.on_timer(now) is not None
        s.resent(s.pop_retransmit(), now, entropy=0)
    assert s.on_timer(s.next_timer_ns()) is None
    assert s.failed and "after 3 retransmissions on timeout" in s.failed
    assert not s.window_open() and s.pop_retransmit() is None and s.next_timer_ns() is None


def test_the_window_holds_new_psns_until_the_base_is_acknowledged():
    s = RudSender(window_packets=3)
    for i in range(3):
        s.send_new(0.0, item=i, nbytes=1, entropy=0)
    assert not s.window_open()
    s.on_ack(1.0, 1, 0, 2, 0b1)     # 2 acked by SACK, 0 and 1 cumulatively
    assert s.idle() and s.window_open()
    assert s.base == 3


def test_sack_bitmap_round_trips_and_is_lsb_first():
    assert sack_encode([10, 11, 75], 10) == 0b11     # 75 is bit 65: outside
    assert sack_encode([10, 12, 73], 10) == 1 | 1 << 2 | 1 << 63
    assert sack_encode([9, 74], 10) == 0            # outside the 64 bits
    rng = random.Random(3)
    for _ in range(200):
        base = rng.randrange(1 << 32)
        psns = sorted(rng.sample(range(base, base + 64), rng.randrange(0, 64)))
        assert sack_decode(base, sack_encode(psns, base)) == psns


def test_the_receiver_reports_the_trigger_when_it_is_beyond_64_psns():
    r = RudReceiver(ack_every=100)
    v = r.on_packet(100)                 # 0..99 missing
    a = r.ack_info(v.psn)
    assert a.cack_psn == PSN_MASK        # nothing cumulative yet (start 0 -> cack -1)
    base = (a.cack_psn + a.sack_psn_offset) & PSN_MASK
    assert sack_decode(base, a.sack_bitmap) == [100]


def test_ack_coalescing_waits_for_ack_every_unless_something_needs_an_answer():
    r = RudReceiver(ack_every=4)
    assert [r.on_packet(p).ack_now for p in range(4)] == [False, False, False, True]
    r.ack_info(3)
    assert r.on_packet(4, ackreq=True).ack_now
    r.ack_info(4)
    assert r.on_packet(5, ecn=True).ack_now
    r.ack_info(5)
    assert r.on_packet(7).ack_now                 # out of order
    r.ack_info(7)
    v = r.on_packet(7)                            # duplicate: re-ACKed, not delivered
    assert v.ack_now and not v.new and r.duplicates == 1
    assert r.on_packet(6).ack_now and r.cack == 7    # filled the hole: at once
    assert not r.on_packet(8).ack_now             # in order again: coalesced


def test_a_psn_far_beyond_the_window_is_dropped_not_accepted():
    r = RudReceiver()
    v = r.on_packet(0x10000 + 5)
    assert v.out_of_window and not v.new and r.out_of_window == 1


@pytest.mark.parametrize("wire,ref,want", [(5, PSN_MASK - 2, (1 << 32) + 5),
                                           (PSN_MASK, 3, -1), (7, 7, 7)])
def test_unwrap_finds_the_nearest_psn_across_the_32_bit_wrap(wire, ref, want):
    assert unwrap(wire, ref) == want


def test_a_hole_is_resent_only_after_the_reordering_window():
    s = RudSender(window_packets=16, rto_ns=1e9, rtt_ns=1_000.0)
    r = RudReceiver(ack_every=1)
    for i in range(6):
        s.send_new(float(i), item=i, nbytes=1, entropy=0)

    def ack(psn: int, now: float):
        a = r.ack_info(r.on_packet(psn).psn)
        return s.on_ack(now, a.cack_psn, a.ack_psn_offset, a.cack_psn + a.sack_psn_offset,
                        a.sack_bitmap)

    for psn in (1, 2, 3):                  # 0 overtaken by three packets sent after it
        res = ack(psn, 500.0)
    assert res.lost == [] and not s.has_retransmit()       # 500 ns < 1.25 RTT: reordered?
    res = ack(4, 1_300.0)                  # past 1.25 smoothed RTTs since PSN 0 went: lost
    assert [psn for psn, _rec in res.lost] == [0] and s.pop_retransmit() == 0


def test_a_sack_resend_whose_first_copy_arrives_widens_the_reordering_window():
    """RACK's answer to spraying's reordering: a hole resent on SACK evidence whose first
    copy is then acknowledged sooner than any round trip took was not lost; the window
    doubles, so the same delay does not cause another spurious resend."""
    s = RudSender(window_packets=16, rto_ns=1e9, rtt_ns=100.0)
    r = RudReceiver(ack_every=1)
    now = 0.0
    for i in range(5):
        s.send_new(now + i, item=i, nbytes=10, entropy=0)

    def deliver(psn: int, t: float):
        a = r.ack_info(r.on_packet(psn).psn)
        return s.on_ack(t, a.cack_psn, a.ack_psn_offset, a.cack_psn + a.sack_psn_offset,
                        a.sack_bitmap)

    deliver(s.base, 100.0)                    # PSN 0 after one RTT: srtt = min RTT = 100
    first = s.base                            # PSN 1 is delayed by its path
    for k in (1, 2, 3):
        res = deliver(first + k, 200.0)       # three later PSNs acknowledged: a hole
    assert [psn for psn, _ in res.lost] == [first]
    assert s.pop_retransmit() == first
    s.resent(first, 300.0, entropy=1)
    deliver(first, 310.0)                     # 10 ns after the resend: the first copy
    assert s.spurious_retransmissions == 1 and s.reorder_rtts == 2.5
    assert s.counters()["spurious_retransmissions"] == 1
