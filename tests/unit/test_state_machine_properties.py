"""Invariants of the pure protocol state machines under random event sequences.

PFC (agents/pfc/logic.py): a received pause never makes paused time negative or
shrink, a paused class resumes (by a 0-quanta frame or at its deadline), and a
host RX buffer's XOFF/XON decisions keep their hysteresis with the level within
[0, capacity]. DCQCN (agents/rdma/cc.py): the rate stays within [min, line],
alpha within [0, 1], a CNP never raises the rate; the NP never sends two CNPs
closer than its interval. Bounded (max_examples, no deadline).
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agents.pfc.logic import PauseTimer, RxBuffer
from agents.rdma.cc import DCQCN_PRESET_NAMES, DcqcnNp, DcqcnRp, preset

SETTINGS = settings(max_examples=100, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

# (port, priority, pause ns (0 = resume), ns until the next event)
pfc_events = st.lists(st.tuples(st.sampled_from(["p0", "p1"]), st.integers(0, 7),
                                st.one_of(st.just(0.0), st.floats(1, 1e6)),
                                st.floats(0, 2e6)), max_size=60)


@SETTINGS
@given(pfc_events, st.one_of(st.none(), st.floats(1e3, 1e6)))
def test_pause_timer_invariants(events, watchdog_ns):
    t = PauseTimer(watchdog_ns=watchdog_ns)
    now = 0.0
    seen: dict[tuple[str, int], float] = {}
    for port, prio, pause_ns, gap in events:
        paused = t.on_frame(port, prio, pause_ns, now)
        if pause_ns == 0:
            assert not paused and not t.is_paused(port, prio, now)   # XON resumes at once
        now += gap
        for key, _ in t.classes.items():
            p = t.paused_ns(*key, now)
            assert p >= 0
            assert p >= seen.get(key, 0.0) - 1e-6                    # never shrinks
            seen[key] = p
        for port_, prio_, why in t.expire(now):
            assert why in ("expired", "storm")
            if why == "expired":
                assert not t.is_paused(port_, prio_, now)
    # every pause ends: past every deadline nothing is paused
    deadline = t.next_deadline_ns()
    end = now + 2e6 + (watchdog_ns or 0)
    t.expire(end)
    t.expire(end + 1)
    assert deadline is None or all(not t.is_paused(*k, end + 1) for k in t.classes)


@SETTINGS
@given(st.integers(2_000, 200_000), st.integers(0, 200_000), st.integers(0, 50_000),
       st.one_of(st.none(), st.floats(0, 1e11)),
       st.lists(st.tuples(st.integers(0, 100_000), st.floats(0, 1e5)), max_size=80))
def test_rx_buffer_hysteresis(xoff, xon, headroom, rate_bps, steps):
    buf = RxBuffer.start(0, 0.0, xoff, xon, headroom, rate_bps, 1e11)
    arrived, now, overflow = 0, 0.0, 0.0
    for new, dt in steps:
        arrived += new
        now += dt
        before = buf.want_pause
        change = buf.advance(arrived, now)
        assert 0 <= buf.level_bytes <= buf.capacity_bytes
        assert buf.overflow_bytes >= overflow
        overflow = buf.overflow_bytes
        if change is True:
            assert not before and buf.level_bytes >= buf.xoff_bytes
        elif change is False:
            assert before and buf.level_bytes <= buf.xon_bytes
        else:
            assert buf.want_pause == before
            if before:
                assert buf.level_bytes > buf.xon_bytes
            else:
                assert buf.level_bytes < buf.xoff_bytes
    # a paused class resumes once the buffer drains (any positive drain rate)
    if buf.drain_bps > 0:
        buf.advance(arrived, now + buf.capacity_bytes * 8e9 / buf.drain_bps + 1)
        assert not buf.want_pause


dcqcn_events = st.lists(st.tuples(st.sampled_from(["cnp", "bytes", "echo", "advance"]),
                                  st.floats(0, 2e5), st.integers(0, 1 << 20)), max_size=80)


@SETTINGS
@given(st.sampled_from(sorted(DCQCN_PRESET_NAMES)),
       st.sampled_from([10e9, 25e9, 100e9]), dcqcn_events)
def test_dcqcn_rate_and_alpha_stay_in_bounds_and_a_cnp_never_raises_the_rate(
        name, line_bps, events):
    params = preset(name, line_bps)
    rp = DcqcnRp(params, line_bps, 0.0)
    now = 0.0
    lo = params.min_rate_bps * (1 - 1e-9)
    for kind, gap, nbytes in events:
        now += gap
        rp.advance(now)
        before = rp.rate_bps
        if kind == "cnp":
            rp.on_cnp(now)
            assert rp.rate_bps <= before
        elif kind == "bytes":
            rp.on_bytes_sent(nbytes, now)
        elif kind == "echo":
            rp.on_ecn_echo(nbytes // 2, nbytes, now)
            if nbytes // 2 > 0:
                assert rp.rate_bps <= before
        assert lo <= rp.rate_bps <= line_bps * (1 + 1e-9)
        assert lo <= rp.target_rate_bps <= line_bps * (1 + 1e-9)
        assert 0.0 <= rp.alpha <= 1.0
        nxt = rp.next_event_ns()
        assert nxt is None or nxt >= now - 1e-6


@SETTINGS
@given(st.floats(1, 1e6), st.lists(st.tuples(st.booleans(), st.floats(0, 2e6)), max_size=80))
def test_dcqcn_np_interval_mode_spaces_cnps(interval, packets):
    np_ = DcqcnNp(interval, "interval")
    now, last = 0.0, None
    for ce, gap in packets:
        now += gap
        if np_.on_packet(ce, now):
            assert ce
            assert last is None or now - last >= interval
            last = now
