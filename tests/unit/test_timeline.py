"""The fault timeline's scheduler: order, lateness, convergence and stop, on a fake clock."""

from __future__ import annotations

import time

from agents.timebase import Dilation
from testbed.plan.model import EventPlan, EventPortPlan, NextHopPlan, RoutePlan
from testbed.run.timeline import APPLIED, CONVERGED, Timeline, steps_of

D = Dilation(1000)
T0 = 5_000_000_000


def _event(index: int, at_ns: int, kind: str = "loss", converge_ns: int = 0,
           routes: bool = False) -> EventPlan:
    table = {"leaf1": [RoutePlan(dst="198.18.0.0/31",
                                 nexthops=[NextHopPlan(gateway="198.18.0.5", ifname="swp2")])]}
    return EventPlan(index=index, at_ns=at_ns, kind=kind, target="leaf1-spine1",
                     description=f"event {index}", converge_ns=converge_ns,
                     ports=[EventPortPlan(node="leaf1", ifname="swp1", tc=3)],
                     routes=table if routes else None)


class FakeClock:
    """Monotonic ns that moves only when the timeline waits (or a test says so)."""

    def __init__(self, now: int = T0) -> None:
        self.now = now
        self.waits: list[float] = []

    def __call__(self) -> int:
        return self.now

    def wait(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.now += round(seconds * 1e9)


def _timeline(events, clock, apply=None, lag_ns: int = 0):
    applied: list[tuple[int, str, int]] = []   # (index, phase, wall ns after t0)
    records: list[dict] = []
    notes: list[str] = []

    def _apply(ev, phase):
        applied.append((ev.index, phase, clock.now - T0))
        clock.now += lag_ns            # applying takes wall time
        return (apply or (lambda _e, _p: {"done": True}))(ev, phase)

    def _record(step, ts, mono, late, facts):
        records.append({"index": step.event.index, "phase": step.phase, "ts": ts,
                        "mono": mono, "late": late, **facts})

    tl = Timeline(events, T0, D, _apply, _record, notes.append, clock=clock, wait=clock.wait)
    return tl, applied, records, notes


def test_events_are_applied_in_time_order_at_t0_plus_their_wall_time():
    events = [_event(0, 1_000), _event(1, 3_000), _event(2, 2_000)]
    clock = FakeClock()
    tl, applied, records, notes = _timeline(sorted(events, key=lambda e: e.at_ns), clock)
    tl.run()
    assert [a[0] for a in applied] == [0, 2, 1]
    # fabric 1 us at D = 1000 is 1 ms of wall time after t0
    assert [a[2] for a in applied] == [1_000_000, 2_000_000, 3_000_000]
    assert [r["late"] for r in records] == [0, 0, 0]
    assert [r["ts"] for r in records] == [1_000, 2_000, 3_000]
    assert not notes


def test_ties_keep_plan_order():
    events = [_event(0, 1_000), _event(1, 1_000), _event(2, 1_000)]
    clock = FakeClock()
    tl, applied, _records, _notes = _timeline(events, clock)
    tl.run()
    assert [a[0] for a in applied] == [0, 1, 2]


def test_a_late_event_records_how_late_in_fabric_time():
    # the first event takes 2.5 ms of wall time to apply: the second, due 1 us fabric
    # (1 ms wall) after it, starts 1.5 ms wall = 1.5 us fabric late
    clock = FakeClock()
    tl, applied, records, _notes = _timeline([_event(0, 1_000), _event(1, 2_000)], clock,
                                             lag_ns=2_500_000)
    tl.run()
    assert records[0]["late"] == 0
    assert records[1]["late"] == 1_500
    assert records[1]["ts"] == 3_500
    assert applied[1][2] == 3_500_000
    assert records[0]["took_ns"] == 2_500


def test_an_event_already_due_at_start_is_applied_at_once_and_late():
    clock = FakeClock(T0 + 4_000_000)        # the timeline starts 4 ms wall after t0
    tl, applied, records, _notes = _timeline([_event(0, 1_000)], clock)
    tl.run()
    assert applied == [(0, APPLIED, 4_000_000)]
    assert records[0]["late"] == 3_000
    assert not clock.waits


def test_link_events_converge_converge_ns_after_they_are_applied():
    events = [_event(0, 1_000, "link_down", converge_ns=500, routes=True),
              _event(1, 1_200, "loss"),
              _event(2, 2_000, "link_up", converge_ns=0, routes=True)]
    clock = FakeClock()
    tl, applied, records, _notes = _timeline(events, clock)
    tl.run()
    assert [(a[0], a[1]) for a in applied] == [
        (0, APPLIED), (1, APPLIED), (0, CONVERGED), (2, APPLIED), (2, CONVERGED)]
    assert [r["ts"] for r in records] == [1_000, 1_200, 1_500, 2_000, 2_000]
    assert [s.due_ns for s in steps_of(events)] == [1_000, 1_200, 1_500, 2_000, 2_000]


def test_an_event_without_routes_has_no_converged_step():
    assert [s.phase for s in steps_of([_event(0, 10, "link_down", converge_ns=5)])] == [APPLIED]


def test_a_failure_is_a_note_naming_the_event_and_the_rest_still_run():
    def apply(ev, _phase):
        if ev.index == 1:
            raise RuntimeError("kernel said no")
        return {}

    clock = FakeClock()
    tl, applied, records, notes = _timeline([_event(0, 1_000), _event(1, 2_000),
                                             _event(2, 3_000)], clock, apply=apply)
    tl.run()
    assert [r["index"] for r in records] == [0, 2]
    assert len(notes) == 1
    assert "event 1 (event 1, at 2 us)" in notes[0] and "kernel said no" in notes[0]
    assert [s.event.index for s in tl.failed] == [1]


def test_facts_of_the_applier_are_recorded():
    clock = FakeClock()
    tl, _applied, records, _notes = _timeline(
        [_event(0, 1_000)], clock, apply=lambda _e, _p: {"lost_packets": 7})
    tl.run()
    assert records[0]["lost_packets"] == 7 and records[0]["phase"] == APPLIED


def test_stop_ends_the_thread_promptly_before_later_events():
    applied: list[int] = []
    now = time.monotonic_ns()
    events = [_event(0, 0), _event(1, 60_000_000)]     # the second due 60 s of wall later
    tl = Timeline(events, now, D, lambda ev, _p: applied.append(ev.index) or {},
                  lambda *_a: None, lambda _n: None)
    tl.start()
    deadline = time.monotonic() + 5
    while not applied and time.monotonic() < deadline:
        time.sleep(0.005)
    started = time.monotonic()
    tl.stop()
    assert time.monotonic() - started < 1.0
    assert applied == [0]
    assert tl._thread is not None and not tl._thread.is_alive()


def test_stop_before_start_applies_nothing():
    applied: list[int] = []
    tl = Timeline([_event(0, 0)], time.monotonic_ns(), D,
                  lambda ev, _p: applied.append(ev.index) or {}, lambda *_a: None,
                  lambda _n: None)
    tl.stop()
    tl.run()
    assert applied == []


def test_an_event_later_than_the_tolerance_is_a_fidelity_note():
    clock = FakeClock(T0 + 4_000_000)        # 3 us fabric late for an event at 1 us
    notes: list[str] = []
    tl = Timeline([_event(0, 1_000)], T0, D, lambda _e, _p: {}, lambda *_a: None,
                  notes.append, clock=clock, wait=clock.wait, late_tolerance_ns=2_000)
    tl.run()
    assert len(notes) == 1 and "event 0 (event 0) was applied 3.0 us fabric after" in notes[0]
    fresh = FakeClock()
    Timeline([_event(0, 1_000)], T0, D, lambda _e, _p: {}, lambda *_a: None, notes.append,
             clock=fresh, wait=fresh.wait, late_tolerance_ns=2_000).run()
    assert len(notes) == 1           # on time: no note
