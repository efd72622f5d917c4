"""PFC decisions without sockets: reasons to pause, XOFF/XON, refresh, pause timers, storms."""

from __future__ import annotations

import pytest

from agents.pfc.logic import INGRESS, PauseRequests, PauseTimer, RxBuffer, egress_reason


def test_first_reason_sends_xoff_last_reason_gone_sends_xon():
    r = PauseRequests(refresh_ns={"swp1": 100.0})
    a = r.set("swp1", 3, INGRESS, True, now_ns=0)
    assert (a.ingress, a.priority, a.xoff, a.reason) == ("swp1", 3, True, INGRESS)
    assert r.set("swp1", 3, INGRESS, True, now_ns=10) is None        # already paused
    assert r.set("swp1", 3, egress_reason("swp4"), True, now_ns=20) is None
    assert r.set("swp1", 3, INGRESS, False, now_ns=30) is None       # egress still holds it
    xon = r.set("swp1", 3, egress_reason("swp4"), False, now_ns=40)
    assert xon.xoff is False and not r.paused("swp1", 3)
    req = r.requests[("swp1", 3)]
    assert (req.xoff_sent, req.xon_sent) == (1, 1)
    assert r.set("swp1", 3, INGRESS, False, now_ns=50) is None       # nothing to resume


def test_a_paused_ingress_is_refreshed_before_its_pause_expires():
    r = PauseRequests(refresh_ns={"swp1": 100.0, "swp2": 1000.0})
    r.set("swp1", 3, INGRESS, True, now_ns=0)
    r.set("swp2", 3, INGRESS, True, now_ns=0)
    assert r.next_refresh_ns() == 100.0
    assert r.refresh(now_ns=50) == []
    again = r.refresh(now_ns=120)
    assert [(a.ingress, a.xoff, a.reason) for a in again] == [("swp1", True, "refresh")]
    assert r.next_refresh_ns() == 220.0
    r.set("swp1", 3, INGRESS, False, now_ns=130)
    assert r.next_refresh_ns() == 1000.0
    assert r.requests[("swp1", 3)].refreshes == 1


def test_replace_makes_a_reason_held_by_exactly_the_given_ingresses():
    r = PauseRequests(refresh_ns={})
    hot = egress_reason("swp9")
    paused = r.replace(hot, 3, {"swp1", "swp2", "swp3"}, now_ns=0)
    assert sorted(a.ingress for a in paused if a.xoff) == ["swp1", "swp2", "swp3"]
    r.set("swp2", 3, INGRESS, True, now_ns=1)        # swp2 also over its own XOFF
    changed = r.replace(hot, 3, {"swp1", "swp4"}, now_ns=2)
    assert sorted((a.ingress, a.xoff) for a in changed) == [("swp3", False), ("swp4", True)]
    assert r.paused("swp2", 3)                        # held by its own reason
    cooled = r.replace(hot, 3, set(), now_ns=3)
    assert sorted(a.ingress for a in cooled if not a.xoff) == ["swp1", "swp4"]
    assert r.paused("swp2", 3) and not r.paused("swp1", 3)


def test_priorities_are_independent():
    r = PauseRequests(refresh_ns={})
    r.set("swp1", 3, INGRESS, True, now_ns=0)
    assert r.set("swp1", 4, INGRESS, True, now_ns=0).xoff
    assert r.set("swp1", 3, INGRESS, False, now_ns=1).priority == 3
    assert r.paused("swp1", 4)


def test_pause_timer_expiry_xon_and_paused_time():
    t = PauseTimer()
    assert t.on_frame("swp1", 3, 335.0, now_ns=1000) is True
    assert t.is_paused("swp1", 3, 1200)
    assert t.next_deadline_ns() == pytest.approx(1335.0)
    assert t.expire(1400) == [("swp1", 3, "expired")]
    assert not t.is_paused("swp1", 3, 1400)
    assert t.paused_ns("swp1", 3, 1400) == pytest.approx(400.0)
    t.on_frame("swp1", 3, 1000.0, now_ns=2000)
    t.on_frame("swp1", 3, 0.0, now_ns=2100)             # XON resumes at once
    assert not t.is_paused("swp1", 3, 2100)
    assert t.paused_ns("swp1", 3, 2100) == pytest.approx(500.0)
    assert t.classes[("swp1", 3)].frames_rx == 3


def test_watchdog_declares_a_storm_and_stops_honouring_pauses():
    t = PauseTimer(watchdog_ns=500.0)
    t.on_frame("swp2", 3, 300.0, now_ns=0)
    for now in (250.0, 450.0):                          # refreshed before expiry: a storm
        t.on_frame("swp2", 3, 300.0, now_ns=now)
    assert t.expire(600.0) == [("swp2", 3, "storm")]
    assert not t.is_paused("swp2", 3, 600.0)
    assert t.classes[("swp2", 3)].storms == 1


# -- PFC off / on for a (port, priority) (the `pfc` command) -------------------------------


def test_disabling_releases_a_held_pause_and_enabling_restores_it():
    r = PauseRequests(refresh_ns={"swp1": 100.0})
    assert r.set("swp1", 3, INGRESS, True, now_ns=0).xoff
    off = r.set_enabled("swp1", 3, False, now_ns=10)
    assert off is not None and off.xoff is False and off.reason == "disabled"
    assert not r.paused("swp1", 3) and not r.enabled("swp1", 3)
    assert r.refresh(now_ns=500) == [] and r.next_refresh_ns() is None
    # The decision is still tracked while off: a reason held when PFC comes back pauses.
    assert r.set("swp1", 3, egress_reason("swp4"), True, now_ns=20) is None
    on = r.set_enabled("swp1", 3, True, now_ns=30)
    assert on is not None and on.xoff and r.paused("swp1", 3)


def test_enabling_with_no_reason_left_sends_nothing():
    r = PauseRequests(refresh_ns={})
    r.set("swp1", 3, INGRESS, True, now_ns=0)
    r.set_enabled("swp1", 3, False, now_ns=1)
    r.set("swp1", 3, INGRESS, False, now_ns=2)          # the ingress drained meanwhile
    assert r.set_enabled("swp1", 3, True, now_ns=3) is None
    assert r.enabled("swp9", 3)                          # never touched: on


# -- the host NIC's receive buffer ---------------------------------------------------------

LINE = 100e9          # 100 Gb/s: 12.5 bytes per ns


def _buf(rate_bps: float | None = 0.0, headroom: int = 10_000) -> RxBuffer:
    return RxBuffer.start(arrived_bytes=1_000_000, now_ns=0.0, xoff_bytes=50_000,
                          xon_bytes=20_000, headroom_bytes=headroom, rate_bps=rate_bps,
                          line_rate_bps=LINE)


def test_rx_buffer_xoff_at_xoff_and_xon_at_xon():
    b = _buf(rate_bps=50e9)                  # drains 6.25 B/ns
    assert b.advance(1_000_000 + 40_000, 1000.0) is None
    assert b.level_bytes == pytest.approx(40_000)   # the first poll: nothing drained yet
    assert b.advance(1_050_000, 1000.0) is True            # +10 KB at once: 50 KB = XOFF
    assert b.level_bytes == pytest.approx(50_000) and b.want_pause
    assert b.advance(1_050_000, 5000.0) is None            # 25 KB drained: 25 KB > XON
    assert b.level_bytes == pytest.approx(25_000)
    assert b.advance(1_050_000, 5800.0) is False           # 5 KB more: 20 KB = XON
    assert not b.want_pause
    assert b.advance(1_050_000, 10_000.0) is None and b.level_bytes == 0   # floored


def test_rx_buffer_stores_no_drain_credit_while_empty():
    b = _buf(rate_bps=50e9)
    b.advance(1_000_000, 1e6)                # idle for 1 ms: empty, not negative
    assert b.level_bytes == 0
    b.advance(1_030_000, 1e6)
    assert b.level_bytes == pytest.approx(30_000)


def test_rx_buffer_at_rate_zero_never_xons_and_counts_overflow():
    b = _buf(rate_bps=0.0, headroom=10_000)
    assert b.advance(1_055_000, 100.0) is True
    for t in range(1, 100):
        assert b.advance(1_055_000, 100.0 + t * 1e6) is None     # nothing drains
    assert b.want_pause and b.level_bytes == pytest.approx(55_000)
    assert b.overflow_bytes == 0
    b.advance(1_075_000, 2e8)               # 20 KB more: capacity 60 KB, 15 KB overflow
    assert b.level_bytes == pytest.approx(60_000)
    assert b.overflow_bytes == pytest.approx(15_000) and b.peak_bytes == 60_000


def test_rx_buffer_line_rate_again_finishes_once_empty():
    b = _buf(rate_bps=0.0)
    assert b.advance(1_060_000, 0.0) is True
    assert b.set_rate(None, 1_060_000, 100.0) is None and not b.finished
    assert b.advance(1_060_000, 100.0 + 40_000 / 12.5) is False   # 40 KB at line rate
    assert not b.finished                                        # 20 KB still in it
    b.advance(1_060_000, 1e6)
    assert b.finished


def test_rx_buffer_polls_no_later_than_the_earliest_crossing():
    b = _buf(rate_bps=0.0)
    b.advance(1_000_000 + 25_000, 0.0)
    # 25 KB below XOFF at 12.5 B/ns: 2000 ns at the earliest
    assert b.next_poll_ns(0.0, min_ns=250, max_ns=1e6) == pytest.approx(2000)
    b.advance(1_000_000 + 49_990, 0.0)
    assert b.next_poll_ns(0.0, min_ns=250, max_ns=1e6) == 250    # clamped to the floor
    b.advance(1_000_000 + 60_000, 0.0)                           # paused, rate 0: no XON
    assert b.next_poll_ns(10.0, min_ns=250, max_ns=1e6) == pytest.approx(10.0 + 1e6)


def test_rx_buffer_counter_reset_adds_nothing():
    b = _buf()
    assert b.advance(10, 5.0) is None and b.level_bytes == 0


def test_rx_buffer_at_line_rate_under_a_stream_counts_a_frame_as_empty():
    b = _buf(rate_bps=None)
    b.empty_bytes = 9038
    for t in range(1, 10):                       # 1000 B per 1000 ns: 8 Gb/s < line rate
        b.advance(1_000_000 + 1000 * t, 1000.0 * t)
    assert b.level_bytes == pytest.approx(1000) and b.finished


def test_rx_buffer_finishes_under_a_stream_even_when_its_polls_come_late():
    """A loaded machine polls the model every 10 us of fabric instead of every 1 us: each
    poll adds 10 KB at once, more than a frame, but an 8 Gb/s stream into a 100 Gb/s
    drain never builds up; the model still stops. A stream faster than the drain does
    not let it stop."""
    b = _buf(rate_bps=None)
    b.empty_bytes = 9038
    for t in range(1, 10):
        b.advance(1_000_000 + 10_000 * t, 10_000.0 * t)
    assert b.level_bytes == pytest.approx(10_000) and b.finished
    fast = _buf(rate_bps=None)
    fast.empty_bytes = 9038
    for t in range(1, 10):                       # 26 KB per 2 us: 104 Gb/s > line rate
        fast.advance(1_000_000 + 26_000 * t, 2_000.0 * t)
    assert not fast.want_pause and fast.level_bytes < fast.xoff_bytes
    assert not fast.finished
