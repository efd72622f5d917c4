"""PFC decisions without sockets: reasons to pause, XOFF/XON, refresh, pause timers, storms."""

from __future__ import annotations

import pytest

from agents.pfc.logic import INGRESS, PauseRequests, PauseTimer, egress_reason


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
