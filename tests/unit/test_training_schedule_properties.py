"""Properties of the training step's timeline over any buckets, compute and all-reduce
times: exposed communication is never negative nor more than the communication, it is
all of it without overlap, and overlap never exposes more than no overlap."""

from __future__ import annotations

import hypothesis
import pytest
from hypothesis import strategies as st

from agents.collectives.schedule import step_schedule

times = st.integers(min_value=0, max_value=10**9)
steps = st.integers(min_value=1, max_value=32).flatmap(lambda n: st.tuples(
    st.lists(st.integers(min_value=1, max_value=1 << 30), min_size=n, max_size=n),
    times, times,
    st.lists(st.integers(min_value=0, max_value=10**9), min_size=n, max_size=n)))


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(steps)
def test_exposed_communication_is_bounded_and_overlap_never_hurts(step) -> None:
    sizes, forward, backward, durations = step
    on = step_schedule(sizes, forward, backward, durations, overlap=True)
    off = step_schedule(sizes, forward, backward, durations, overlap=False)
    eps = 1e-6 * (forward + backward + sum(durations) + 1)      # float sums of ready times
    assert on.comm_ns == off.comm_ns == sum(durations)
    assert off.exposed_ns == pytest.approx(off.comm_ns, abs=eps)
    assert -eps <= on.exposed_ns <= on.comm_ns + eps
    assert on.exposed_ns <= off.exposed_ns + eps
    # the last bucket is ready only when backward ends: its all-reduce is never hidden
    assert on.exposed_ns >= durations[-1] - eps
    # buckets go in order, none before it is ready, the last after backward
    assert all(s >= r - eps for s, r in zip(on.start_ns, on.ready_ns, strict=True))
    assert all(b >= a for a, b in zip(on.end_ns, on.start_ns[1:], strict=False))
    assert on.start_ns[-1] >= forward + backward - eps
