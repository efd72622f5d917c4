"""Flow generators for `kind: flows` entries: flow-size distributions (CDF files), a
load-exact Poisson generator over a set of hosts, and incast bursts.

A flow-size distribution is a piecewise-linear CDF given by points (size in bytes,
cumulative probability), the form HPCC's traffic_gen ships its distributions in. Between
two points the size is linearly interpolated (as HPCC's traffic_gen/custom_rand.py does);
a first point with probability above 0, or two points at one size, is an atom (that size
with that much probability). Samples are rounded up to whole bytes (at least 1), so at
every whole byte `Cdf.cdf` is exactly the probability that a sample is at most that size.

The built-in distributions live in configs/distributions/NAME.cdf, each naming its source
in its header. docs/flows-distributions.md lists them and explains the generator.
"""

from __future__ import annotations

import bisect
import difflib
import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from testbed.workloads.base import FlowSpec

REPO_ROOT = Path(__file__).resolve().parents[2]
DISTRIBUTIONS_DIR = REPO_ROOT / "configs" / "distributions"

#: built-in distribution name -> its CDF file
BUILTIN_DISTRIBUTIONS: dict[str, Path] = {
    name: DISTRIBUTIONS_DIR / f"{name}.cdf"
    for name in ("web_search", "hadoop", "alibaba_storage", "google_rpc")
}

_ROW_FIX = "write one 'SIZE_BYTES CUMULATIVE_PROBABILITY' pair per line"
# A sample that interpolates to a whole byte must not be rounded up past it by the last
# bits of floating-point error (1e-6 byte changes no size's probability).
_CEIL_SLACK = 1e-6
#: how far from its target load a generated host may end (a fraction of the target)
LOAD_TOLERANCE = 0.02
# bounds the redraws of a crossing flow when no size fits what is left of the budget
_MAX_REDRAWS = 10_000


class CdfError(ValueError):
    """A CDF file that cannot be used: one line per problem, each `FILE:LINE: what; fix`."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


@dataclass(frozen=True)
class Cdf:
    """A flow-size distribution: points (size_bytes, cumulative probability as a fraction),
    sizes and probabilities non-decreasing, the last probability 1."""

    points: tuple[tuple[int, float], ...]
    source: str

    def __post_init__(self) -> None:
        problems = _point_problems(self.points)
        if problems:
            raise ValueError(f"{self.source}: " + "; ".join(problems))

    @property
    def sizes(self) -> npt.NDArray[np.float64]:
        return np.array([s for s, _ in self.points], dtype=np.float64)

    @property
    def probabilities(self) -> npt.NDArray[np.float64]:
        return np.array([p for _, p in self.points], dtype=np.float64)

    @property
    def mean_bytes(self) -> float:
        """The mean of the piecewise-linear distribution, exactly: the atom at the first
        point plus, per segment, its probability times its midpoint (HPCC's getAvg sums
        the same trapezoids). Samples, rounded up to whole bytes, average at most 1 byte
        more."""
        s0, p0 = self.points[0]
        total = s0 * p0
        for (sa, pa), (sb, pb) in zip(self.points, self.points[1:], strict=False):
            total += (sa + sb) / 2 * (pb - pa)
        return total

    @property
    def max_bytes(self) -> int:
        return self.points[-1][0]

    @property
    def median_bytes(self) -> int:
        return self.quantile(0.5)

    def quantile(self, u: float) -> int:
        """The smallest whole size whose cdf is at least u (the inverse CDF, linearly
        interpolated between points, rounded up), at least 1 byte."""
        if not 0.0 <= u <= 1.0:
            raise ValueError(f"a quantile needs 0 <= u <= 1, got {u}")
        return int(self._quantiles(np.array([u], dtype=np.float64))[0])

    def cdf(self, size: float) -> float:
        """P(size of a flow <= size): 0 below the first point, linear between points, the
        upper value at an atom, 1 from the last point on."""
        sizes = [s for s, _ in self.points]
        i = bisect.bisect_right(sizes, size) - 1
        if i < 0:
            return 0.0
        if i == len(self.points) - 1:
            return 1.0
        (sa, pa), (sb, pb) = self.points[i], self.points[i + 1]
        return pa + (pb - pa) * (size - sa) / (sb - sa)   # sb > size >= sa

    def sample(self, rng: np.random.Generator, n: int) -> npt.NDArray[np.int64]:
        """n independent flow sizes in bytes."""
        return self._quantiles(rng.random(n))

    def _quantiles(self, u: npt.NDArray[np.float64]) -> npt.NDArray[np.int64]:
        sizes, probs = self.sizes, self.probabilities
        if len(probs) == 1:
            x = np.full(u.shape, sizes[0])
        else:
            # the segment ending at the first point whose probability reaches u; u at or
            # below the first probability is the first size (its atom, or u = 0)
            i = np.clip(np.searchsorted(probs, u, side="left"), 1, len(probs) - 1)
            lo_s, hi_s, lo_p, hi_p = sizes[i - 1], sizes[i], probs[i - 1], probs[i]
            span = np.where(hi_p > lo_p, hi_p - lo_p, 1.0)
            frac = np.clip((u - lo_p) / span, 0.0, 1.0)
            x = np.where(u <= probs[0], sizes[0], lo_s + (hi_s - lo_s) * frac)
        return np.maximum(np.ceil(x - _CEIL_SLACK), 1).astype(np.int64)


def _point_problems(points: Sequence[tuple[int, float]]) -> list[str]:
    if not points:
        return ["no points"]
    out = []
    for (sa, pa), (sb, pb) in zip(points, points[1:], strict=False):
        if sb < sa:
            out.append(f"sizes decrease ({sb} after {sa})")
        if pb < pa:
            out.append(f"probabilities decrease ({pb} after {pa})")
    if any(s < 0 for s, _ in points) or any(not 0.0 <= p <= 1.0 for _, p in points):
        out.append("sizes must be >= 0 and probabilities in [0, 1]")
    if points[-1][1] != 1.0:
        out.append(f"the last probability is {points[-1][1]}, not 1")
    return out


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _fmt(value: float) -> str:
    return f"{value:g}"


def parse_cdf(text: str, source: str) -> Cdf:
    """A Cdf from the text of a CDF file named `source` in messages: per line a size in
    bytes and a cumulative probability, either as fractions (the last row 1) or as
    percent (the last row 100), the last row deciding; blank lines and `#` comments are
    ignored. Raises CdfError naming every problem, `source:line: what; fix`."""
    rows: list[tuple[int, float, float]] = []        # (line, size, probability as given)
    problems: list[str] = []
    last_line = 1
    for number, raw in enumerate(text.splitlines(), 1):
        last_line = number
        fields = raw.split("#", 1)[0].split()
        if not fields:
            continue
        where = f"{source}:{number}"
        if len(fields) != 2:
            extra = (" (an ns-2 empirical CDF has a middle column: keep the first and the "
                     "last, the first in bytes)" if len(fields) == 3 else "")
            problems.append(f"{where}: expected 2 columns, got {len(fields)}{extra}; {_ROW_FIX}")
            continue
        size, prob = _number(fields[0]), _number(fields[1])
        if size is None or size < 0 or size != int(size):
            problems.append(f"{where}: size {fields[0]!r} is not a whole number of bytes >= 0; "
                            "write the size in bytes, e.g. 10000")
            continue
        if prob is None or prob < 0:
            problems.append(f"{where}: probability {fields[1]!r} is not a number >= 0; write "
                            "the cumulative probability as a fraction (0..1) or in percent "
                            "(0..100)")
            continue
        rows.append((number, size, prob))
    if not rows:
        raise CdfError(problems or [f"{source}:{last_line}: no rows; {_ROW_FIX}"])
    problems += _order_problems(rows, source)
    line, _, last = rows[-1]
    if last == 1.0:
        scale = 1.0
    elif last == 100.0:
        scale = 100.0
    else:
        problems.append(f"{source}:{line}: the last cumulative probability is {_fmt(last)}; it "
                        "must be 1 (fractions) or 100 (percent): end with the largest size at "
                        "1 or 100")
        scale = 1.0
    if problems:
        raise CdfError(problems)
    return Cdf(tuple((int(size), min(1.0, prob / scale)) for _, size, prob in rows), source)


def _order_problems(rows: Sequence[tuple[int, float, float]], source: str) -> list[str]:
    out = []
    for (_, sa, pa), (number, sb, pb) in zip(rows, rows[1:], strict=False):
        if sb < sa:
            out.append(f"{source}:{number}: sizes must not decrease ({_fmt(sb)} after "
                       f"{_fmt(sa)}); sort the rows by size")
        if pb < pa:
            out.append(f"{source}:{number}: cumulative probabilities must not decrease "
                       f"({_fmt(pb)} after {_fmt(pa)}); each row gives the probability of a "
                       "size at most that row's, so it only grows with the size")
    return out


def load_cdf(name_or_path: str, base_dir: Path | None = None) -> Cdf:
    """A built-in distribution by name (BUILTIN_DISTRIBUTIONS), else the CDF file at that
    path (relative to base_dir, if given). Raises CdfError for an unknown name, a missing
    file or a bad one."""
    if name_or_path in BUILTIN_DISTRIBUTIONS:
        path = BUILTIN_DISTRIBUTIONS[name_or_path]
        return parse_cdf(path.read_text(encoding="utf-8"), name_or_path)
    given = Path(name_or_path)
    path = given if given.is_absolute() or base_dir is None else base_dir / given
    if path.is_file():
        return parse_cdf(path.read_text(encoding="utf-8"), str(path))
    builtins = ", ".join(BUILTIN_DISTRIBUTIONS)
    if "/" not in name_or_path and not given.suffix:
        close = difflib.get_close_matches(name_or_path, list(BUILTIN_DISTRIBUTIONS), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise CdfError([f"unknown distribution {name_or_path!r}; {hint}use one of {builtins}, "
                        "or a file path"])
    raise CdfError([f"{path}: no such distribution file; give a CDF file's path (relative "
                    f"to the directory testbed runs in) or one of {builtins}"])


def _host_rng(seed: int, host: str, stream: int) -> np.random.Generator:
    """A generator of its own for one host and purpose, from the entry's seed and the
    host's name: adding a host to the set changes no other host's sizes or times."""
    digest = hashlib.sha256(host.encode()).digest()
    key = tuple(int.from_bytes(digest[i:i + 4], "little") for i in range(0, 16, 4))
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(*key, stream)))


def _sizes_to_target(cdf: Cdf, rng: np.random.Generator, target_bytes: float,
                     tolerance: float = LOAD_TOLERANCE) -> tuple[list[int], int]:
    """Sizes drawn in order until their sum reaches target_bytes, and how many draws were
    redrawn. The flow that crosses the target is kept or dropped, whichever leaves the
    sum closer to it; when even that is off by more than `tolerance` of the target (a
    flow far larger than what is left of the budget), the crossing flow is redrawn."""
    chunk = max(64, int(1.25 * target_bytes / max(cdf.mean_bytes, 1.0)) + 16)
    slack = tolerance * target_bytes
    drawn: list[int] = []
    total, redrawn = 0, 0
    pending = cdf.sample(rng, chunk)
    while True:
        ends = total + np.cumsum(pending)
        cross = int(np.searchsorted(ends, target_bytes, side="left"))
        if cross == len(pending):
            drawn += pending.tolist()
            total = int(ends[-1]) if len(pending) else total
            pending = cdf.sample(rng, chunk)
            continue
        before = int(ends[cross - 1]) if cross > 0 else total
        over, under = int(ends[cross]) - target_bytes, target_bytes - before
        drawn += pending[:cross].tolist()
        if min(over, under) <= slack or redrawn >= _MAX_REDRAWS:
            if over <= under:
                drawn.append(int(pending[cross]))
            return drawn, redrawn
        redrawn += 1                       # too large for what is left: draw it again
        total, pending = before, pending[cross + 1:]


def poisson_flows(hosts: Sequence[str], line_rate_bps: Mapping[str, int], cdf: Cdf,
                  load: float, duration_ns: int, start_ns: int, seed: int) -> list[FlowSpec]:
    """Flows from every host of `hosts` at `load` of its line rate (payload bytes) over
    [start_ns, start_ns + duration_ns), sizes from `cdf`, each to a destination drawn
    uniformly among the other hosts of the set; sorted by (start_ns, src).

    Each host's flows are a Poisson process conditioned on the bytes it offers: sizes
    are drawn in order until their sum reaches load * rate * duration / 8 (the flow that
    crosses it is kept or dropped, whichever ends closer, and drawn again if even that
    ends more than LOAD_TOLERANCE (2 %) from the target), then that many start times
    are placed as sorted independent uniforms over the window, which is exactly a
    Poisson process given its count, and the sizes are shuffled onto them (so the
    crossing flow, size-biased, is not always the last). An unconditioned Poisson
    process, as HPCC's traffic_gen.py draws, offers the target load only on average:
    with a heavy tail (web search: 3 % of flows over 10 MB carry most bytes) a few
    milliseconds miss it by 10 % and more; here every host is within 2 % of it. The
    cost: a short run holds more, smaller flows than target / mean, since the mean is
    carried by rare large flows it cannot fit (docs/flows-distributions.md).

    Reproducible from `seed`: each host has its own random streams (from the seed and
    its name) for sizes, times and destinations, so adding a host changes no other
    host's sizes or times (its destinations are drawn among the other hosts)."""
    if len(hosts) < 2:
        raise ValueError(f"flow generation needs at least 2 hosts, got {len(hosts)}")
    if len(set(hosts)) != len(hosts):
        raise ValueError(f"flow generation hosts repeat: {list(hosts)}")
    if not 0.0 < load <= 1.0:
        raise ValueError(f"load must be above 0 and at most 1 (a fraction of each host's "
                         f"line rate), got {load}")
    if duration_ns <= 0:
        raise ValueError(f"duration must be above 0, got {duration_ns} ns")
    if start_ns < 0:
        raise ValueError(f"start must be at or after 0, got {start_ns} ns")
    missing = [h for h in hosts if line_rate_bps.get(h, 0) <= 0]
    if missing:
        raise ValueError(f"no line rate for host(s) {', '.join(missing)}")
    flows: list[FlowSpec] = []
    for src in hosts:
        target_bytes = load * line_rate_bps[src] * duration_ns / 8e9
        sizes, _ = _sizes_to_target(cdf, _host_rng(seed, src, 0), target_bytes)
        times_rng = _host_rng(seed, src, 1)
        starts = np.sort(start_ns + np.floor(times_rng.random(len(sizes)) * duration_ns)
                         .astype(np.int64))
        order = times_rng.permutation(len(sizes))
        others = [h for h in hosts if h != src]
        dsts = _host_rng(seed, src, 2).integers(0, len(others), len(sizes))
        flows += [FlowSpec(src, others[int(d)], int(sizes[int(k)]), int(t))
                  for t, k, d in zip(starts, order, dsts, strict=True)]
    flows.sort(key=lambda f: (f.start_ns, f.src))
    return flows


def incast_flows(senders: Sequence[str], receiver: str, size_bytes: int, period_ns: int,
                 bursts: int, start_ns: int) -> list[FlowSpec]:
    """`bursts` bursts, one every `period_ns` from `start_ns`; in each, one flow of
    `size_bytes` from every sender (in the order given) to `receiver`, all at the
    burst's start."""
    if not senders:
        raise ValueError("an incast needs at least one sender")
    if receiver in senders:
        raise ValueError(f"incast receiver {receiver} is also a sender")
    if size_bytes < 1:
        raise ValueError(f"incast size must be at least 1 byte, got {size_bytes}")
    if bursts < 1:
        raise ValueError(f"incast bursts must be at least 1, got {bursts}")
    if period_ns <= 0 and bursts > 1:
        raise ValueError(f"incast period must be above 0 for {bursts} bursts, got {period_ns}")
    if start_ns < 0:
        raise ValueError(f"incast start must be at or after 0, got {start_ns} ns")
    return [FlowSpec(src, receiver, size_bytes, start_ns + burst * period_ns)
            for burst in range(bursts) for src in senders]


def ks_distance(cdf: Cdf, sizes: Sequence[int] | npt.NDArray[np.int64]) -> float:
    """The Kolmogorov-Smirnov distance of whole-byte sizes from `cdf`: sup |empirical
    CDF - CDF|. Both are step functions between whole bytes, so it is reached at a
    sample value v, from the right (P(X <= v) = cdf(v)) or from the left
    (P(X < v) = cdf(v - 1); no size is below 1 byte). 0 for no sizes."""
    sample = np.asarray(sizes)
    if not len(sample):
        return 0.0
    values, counts = np.unique(sample, return_counts=True)
    right = np.cumsum(counts) / len(sample)
    left = right - counts / len(sample)
    law_right = np.array([cdf.cdf(float(v)) for v in values])
    law_left = np.array([cdf.cdf(float(v) - 1) if v > 1 else 0.0 for v in values])
    return float(max(np.max(np.abs(right - law_right)), np.max(np.abs(left - law_left))))


def ks_bound(n: int) -> float:
    """The KS distance n samples of the law itself stay below with 95 % probability
    (Smirnov's asymptotic 1.36 / sqrt(n))."""
    return 1.36 / math.sqrt(n) if n else 1.0


def realised_load(flows: Sequence[FlowSpec], line_rate_bps: Mapping[str, int],
                  duration_ns: int) -> dict[str, float]:
    """Per sending host, the bytes its flows offer as a fraction of what its line rate
    carries in duration_ns."""
    sent: dict[str, int] = {}
    for f in flows:
        sent[f.src] = sent.get(f.src, 0) + f.size_bytes
    return {src: total * 8e9 / (line_rate_bps[src] * duration_ns)
            for src, total in sent.items()}
