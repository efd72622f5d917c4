"""PFC decisions without sockets: FIFO attribution, XOFF/XON, refresh, pause timers, storms."""

from __future__ import annotations

import pytest

from agents.pfc.logic import (
    FifoAttribution,
    PauseDecider,
    PauseTimer,
    Thresholds,
    safe_poll_interval_ns,
)


def test_fifo_attribution_keeps_the_newest_bytes():
    fifo = FifoAttribution()
    fifo.update({"swp1": 100, "swp2": 50}, depth_bytes=150)
    assert fifo.by_ingress == {"swp1": 100, "swp2": 50}
    # 30 bytes left the queue: the oldest (swp1's) go first.
    fifo.update({}, depth_bytes=120)
    assert fifo.by_ingress == {"swp1": 70, "swp2": 50}
    fifo.update({"swp3": 40}, depth_bytes=60)
    assert fifo.by_ingress == {"swp2": 20, "swp3": 40}
    fifo.update({}, depth_bytes=0)
    assert fifo.by_ingress == {}


TH = Thresholds(xoff_bytes=1000, xon_bytes=600, headroom_bytes=200,
                egress_xoff_bytes=5000, egress_xon_bytes=4000)


def test_ingress_over_xoff_is_paused_refreshed_then_resumed():
    d = PauseDecider({3: TH}, refresh_ns={"swp1": 100.0, "swp2": 100.0})
    d.observe("swp4", 3, 1500, {"swp1": 1200, "swp2": 300})
    actions = d.decide(now_ns=0)
    assert [(a.ingress, a.xoff) for a in actions] == [("swp1", True)]
    assert d.decide(now_ns=50) == []                      # paused, refresh not yet due
    again = d.decide(now_ns=120)
    assert [(a.ingress, a.xoff) for a in again] == [("swp1", True)]   # re-sent before expiry
    d.observe("swp4", 3, 500, {})                         # drained: swp1 holds 200 B
    resumed = d.decide(now_ns=130)
    assert [(a.ingress, a.xoff) for a in resumed] == [("swp1", False)]
    assert d.state[("swp1", 3)].xoff_sent == 2 and d.state[("swp1", 3)].xon_sent == 1


def test_occupancy_sums_over_egress_queues():
    d = PauseDecider({3: TH}, refresh_ns={})
    d.observe("swp4", 3, 600, {"swp1": 600})
    d.observe("swp5", 3, 600, {"swp1": 600})
    assert d.occupancy(3) == {"swp1": 1200}
    assert [a.ingress for a in d.decide(0) if a.xoff] == ["swp1"]


def test_a_full_egress_queue_pauses_every_contributor():
    d = PauseDecider({3: TH}, refresh_ns={})
    d.observe("swp9", 3, 5000, {f"swp{i}": 700 for i in range(1, 8)} | {"swp8": 100})
    paused = sorted(a.ingress for a in d.decide(0) if a.xoff)
    assert paused == [f"swp{i}" for i in range(1, 9)]
    assert {d.state[(f"swp{i}", 3)].reason for i in range(1, 8)} == {"egress queue"}
    # Between egress XON and XOFF the pause holds even though each ingress is low.
    d.observe("swp9", 3, 4500, {})
    assert d.decide(1) == []
    # Below egress XON, each ingress resumes once its own bytes are below XON:
    # at 3000 B the newest 700 B of swp4..swp7 each still exceed XON (600 B).
    d.observe("swp9", 3, 3000, {})
    assert sorted(a.ingress for a in d.decide(2) if not a.xoff) == ["swp1", "swp2", "swp3",
                                                                    "swp8"]
    d.observe("swp9", 3, 500, {})
    assert sorted(a.ingress for a in d.decide(3) if not a.xoff) == [f"swp{i}"
                                                                    for i in range(4, 8)]


def test_dynamic_threshold_shrinks_as_the_shared_buffer_fills():
    th = Thresholds(xoff_bytes=0, xon_bytes=0, headroom_bytes=0, egress_xoff_bytes=10**9,
                    egress_xon_bytes=10**9, mode="dynamic", alpha=0.125,
                    shared_buffer_bytes=8_000_000)
    d = PauseDecider({3: th}, refresh_ns={})
    d.observe("swp4", 3, 800_000, {"swp1": 800_000})
    # threshold = (8 MB - 0.8 MB) / 8 = 900 KB > 800 KB: no pause yet
    assert d.decide(0) == []
    d.observe("swp4", 3, 900_000, {"swp1": 100_000})
    # threshold = (8 MB - 0.9 MB) / 8 = 887.5 KB <= 900 KB: pause
    assert [a.xoff for a in d.decide(1)] == [True]


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


def test_safe_poll_interval_never_lets_a_queue_cross_unseen():
    # 1 MB of room filling at 700 Gb/s: 11.43 us until XOFF at the earliest.
    ns = safe_poll_interval_ns(0, 1_000_000, 700e9, floor_ns=100, ceiling_ns=1e9)
    assert ns == pytest.approx(1_000_000 * 8 / 700e9 * 1e9)
    assert safe_poll_interval_ns(2_000_000, 1_000_000, 700e9, 100, 1e9) == 100
    assert safe_poll_interval_ns(0, 1_000_000, 0, 100, 5e4) == 5e4
