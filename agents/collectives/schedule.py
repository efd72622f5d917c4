"""The timeline of one data-parallel training step: when each gradient bucket is ready,
when its all-reduce may start, and how much communication is left exposed.

Pure functions of fabric times, shared by the training-step worker (which waits for a
bucket's ready time before it all-reduces it) and the control plane (which computes the
same schedule with line-rate all-reduce times: the ideal the run is compared with).

One step, as PyTorch DDP runs it: `forward_ns` of forward compute, then `backward_ns`
of backward compute, split over the buckets in proportion to their bytes. DDP fills its
buckets in reverse parameter order, so bucket 0 holds the last layers' gradients and is
ready first: bucket k is ready at

    ready_k = forward + backward * (bytes_0 + ... + bytes_k) / (bytes_0 + ... + bytes_last)

With overlap, bucket k's all-reduce starts at max(ready_k, end_{k-1}) (one communicator,
so buckets go in order, each after the one before); without it, bucket 0 starts when the
whole backward pass is done and the others follow back to back. The step ends at
max(compute end, last all-reduce end), and

    exposed = iteration - compute          (compute = forward + backward)

is the communication the compute did not hide: 0 <= exposed <= comm (the sum of the
all-reduce times), exposed = comm without overlap, and overlap never exposes more than
no overlap does for the same all-reduce times.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agents.collectives.ops import bus_factor


@dataclass(frozen=True)
class StepSchedule:
    """One step's timeline, fabric ns from the step's start."""

    ready_ns: list[float]          # bucket k's gradients are complete
    start_ns: list[float]          # bucket k's all-reduce starts
    end_ns: list[float]            # ... and ends
    allreduce_ns: list[float]      # ... so it takes this long
    compute_ns: float              # forward + backward
    iteration_ns: float            # max(compute end, last all-reduce end)

    @property
    def comm_ns(self) -> float:
        """The all-reduce times, summed (what the step would take with no compute)."""
        return sum(self.allreduce_ns)

    @property
    def exposed_ns(self) -> float:
        """Communication the compute did not hide: iteration - compute."""
        return self.iteration_ns - self.compute_ns


def ready_times_ns(bucket_bytes: Sequence[int], forward_ns: float,
                   backward_ns: float) -> list[float]:
    """When each bucket's gradients are complete: forward, then each bucket's share of
    backward in proportion to its bytes, bucket 0 (the last layers) first. The last
    bucket is ready exactly when backward ends."""
    if not bucket_bytes or any(b <= 0 for b in bucket_bytes):
        raise ValueError(f"buckets must be a non-empty list of positive sizes, got "
                         f"{list(bucket_bytes)}")
    total = sum(bucket_bytes)
    out, done = [], 0
    for b in bucket_bytes:
        done += b
        # integer bytes first, so the last bucket lands on forward + backward exactly
        out.append(forward_ns + backward_ns * done / total)
    return out


def step_schedule(bucket_bytes: Sequence[int], forward_ns: float, backward_ns: float,
                  allreduce_ns: Sequence[float], overlap: bool) -> StepSchedule:
    """The step's timeline given each bucket's all-reduce time (see the module docstring)."""
    if len(allreduce_ns) != len(bucket_bytes):
        raise ValueError(f"{len(bucket_bytes)} buckets but {len(allreduce_ns)} all-reduce "
                         "times")
    if forward_ns < 0 or backward_ns < 0 or any(d < 0 for d in allreduce_ns):
        raise ValueError("compute and all-reduce times must be >= 0")
    ready = ready_times_ns(bucket_bytes, forward_ns, backward_ns)
    compute = forward_ns + backward_ns
    starts, ends = [], []
    prev_end = 0.0
    for k, d in enumerate(allreduce_ns):
        start = max(ready[k] if overlap else compute, prev_end)
        starts.append(start)
        prev_end = start + d
        ends.append(prev_end)
    return StepSchedule(ready, starts, ends, list(allreduce_ns), compute,
                        max(compute, prev_end))


def busiest_rank_bytes(algorithm: str, n: int, nbytes: int) -> float:
    """Bytes the busiest rank's NIC must move, one way, for an all-reduce of `nbytes`
    with `algorithm` over n ranks (agents.collectives.algorithms), phase after phase:

    - ring: 2(n-1)/n x nbytes (nccl-tests' bus bytes);
    - rhd: 2(p-1)/p x nbytes over the p = 2^floor(log2 n) ranks that halve and double,
      plus, when n is not a power of two, the fold before (a rank receives the whole
      vector) and the hand-back after (it sends the whole result): + 2 x nbytes;
    - tree: the up and down phases are not overlapped here; in each an inner node of
      one tree moves the half that tree carries to or from two children, nbytes in all:
      2 x nbytes (n >= 3; n = 2 is one exchange each way, nbytes).
    """
    if n <= 1:
        return 0.0
    if algorithm == "ring":
        return bus_factor("allreduce", n) * nbytes
    if algorithm == "rhd":
        p = 1 << (n.bit_length() - 1)
        return (2 * (p - 1) / p + (2 if p != n else 0)) * nbytes
    if algorithm == "tree":
        return float(nbytes if n == 2 else 2 * nbytes)
    raise ValueError(f"unknown all-reduce algorithm {algorithm!r}")


def ideal_allreduce_ns(algorithm: str, n: int, nbytes: int, line_rate_bps: float) -> float:
    """An all-reduce's time at line rate: the busiest rank's bytes / the NIC's rate
    (payload only; no headers, no latency), fabric ns."""
    if line_rate_bps <= 0:
        raise ValueError(f"line rate must be positive, got {line_rate_bps}")
    return busiest_rank_bytes(algorithm, n, nbytes) * 8 * 1e9 / line_rate_bps
