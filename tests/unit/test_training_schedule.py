"""The training step's timeline (agents/collectives/schedule.py): when buckets are ready,
when their all-reduces start, how much communication stays exposed, and the line-rate
all-reduce time the rows compare with."""

from __future__ import annotations

import pytest

from agents.collectives.schedule import (
    busiest_rank_bytes,
    ideal_allreduce_ns,
    ready_times_ns,
    step_schedule,
)


def test_backward_is_split_over_the_buckets_by_size_and_the_last_is_ready_at_its_end() -> None:
    assert ready_times_ns([1, 3], 10, 40) == [20.0, 50.0]
    assert ready_times_ns([5, 5, 5], 0, 3_000_000)[-1] == 3_000_000
    with pytest.raises(ValueError, match="positive sizes"):
        ready_times_ns([4, 0], 10, 40)


def test_overlap_hides_all_reduces_that_finish_before_the_next_bucket_is_ready() -> None:
    s = step_schedule([1, 3], 10, 40, [5, 5], overlap=True)
    assert (s.ready_ns, s.start_ns, s.end_ns) == ([20.0, 50.0], [20.0, 50.0], [25.0, 55.0])
    assert (s.compute_ns, s.iteration_ns, s.comm_ns, s.exposed_ns) == (50, 55, 10, 5)


def test_without_overlap_every_all_reduce_is_exposed() -> None:
    s = step_schedule([1, 3], 10, 40, [5, 5], overlap=False)
    assert (s.start_ns, s.end_ns) == ([50.0, 55.0], [55.0, 60.0])
    assert s.exposed_ns == s.comm_ns == 10


def test_a_slow_bucket_delays_the_buckets_after_it() -> None:
    # bucket 0's all-reduce overruns bucket 1's ready time: bucket 1 waits for it
    s = step_schedule([1, 3], 10, 40, [40, 5], overlap=True)
    assert (s.start_ns, s.end_ns) == ([20.0, 60.0], [60.0, 65.0])
    assert s.exposed_ns == 15


def test_bad_schedules_are_refused() -> None:
    with pytest.raises(ValueError, match="2 buckets but 1"):
        step_schedule([1, 2], 0, 0, [1], overlap=True)
    with pytest.raises(ValueError, match=">= 0"):
        step_schedule([1], 0, -1, [1], overlap=True)


def test_the_busiest_ranks_bytes_per_algorithm() -> None:
    assert busiest_rank_bytes("ring", 4, 1000) == 1500          # 2(n-1)/n
    assert busiest_rank_bytes("rhd", 8, 1000) == 1750           # a power of two: as ring
    assert busiest_rank_bytes("rhd", 3, 1000) == 3000           # fold + 2(p-1)/p + hand-back
    assert busiest_rank_bytes("tree", 8, 1000) == 2000
    assert busiest_rank_bytes("tree", 2, 1000) == 1000
    assert busiest_rank_bytes("ring", 1, 1000) == 0
    # 4 MiB ring over 8 ranks at 100 Gb/s: 1.75 x 4 MiB x 8 / 100e9 s
    assert ideal_allreduce_ns("ring", 8, 4 << 20, 100e9) == pytest.approx(587_202.6, abs=0.1)
    with pytest.raises(ValueError, match="unknown all-reduce algorithm"):
        busiest_rank_bytes("ina", 4, 1000)
