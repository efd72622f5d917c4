"""The RED marker: sch_red parameters that mark a class's queue with a configured curve.

Pure. The curve is the port program's (testbed/net/bpf/port.bpf.c): a packet arriving
to a queue of q bytes is marked with probability

    p(q) = 0                                    q <= kmin
    p(q) = pmax (q - kmin) / (kmax - kmin)      kmin < q <= kmax
    p(q) = 1                                    q > kmax          (kmin = kmax: a step)

each packet drawn independently. Linux's RED (include/net/red.h, `red_action`) decides
differently, and this module chooses its parameters so that the fraction of packets it
marks follows the same curve:

- Queue. RED compares an EWMA of its child's backlog; with Wlog 0 the average IS the
  backlog ahead of the arriving packet (qavg + backlog - qavg), the instantaneous
  queue the port program uses. After an idle period RED decays the average by a table
  (Stab) instead: every entry 31 makes it 0, which is what the queue was (empty).
- Thresholds. RED marks nothing when qavg < qth_min, everything when qavg >= qth_max
  ("hard mark"), so qth_max = kmax + 1 marks exactly q > kmax, and a step (kmin = kmax)
  is qth_min = qth_max = k + 1.
- Between them RED does not draw per packet: after each mark it draws one uniform
  qR in [0, (qth_max - qth_min) / max_p) and marks the n-th packet after it once
  (q - qth_min) x n >= qR. At a standing queue with pb = max_p (q - qth_min) /
  (qth_max - qth_min) the gap between marks is uniform on 1..1/pb (Floyd and
  Jacobson's "uniform" spacing), so the fraction marked is 1 / E[gap] ~ 2 pb / (1 + pb),
  about twice pb for small pb, and not linear in q. A linear pb cannot make that
  fraction exactly pmax (q - kmin) / (kmax - kmin); `fit` chooses max_p and a start
  of the ramp a little above kmin (qth_min) that minimise the largest difference
  between RED's fraction at a standing queue and the curve over (kmin, kmax]
  (`FitQuality` says how large it is left: 0.0005 at pmax 0.1, 0.003 at 0.2, 0.017 at
  0.5, 0.07 at 1). Marks are also spaced more evenly than independent draws: over n
  packets their count varies less than a binomial's.
- ECN. Flags ecn (mark ECT packets instead of dropping them) and nodrop (a non-ECT
  packet RED picks is queued, not dropped, as the port program leaves it alone); no
  harddrop, so above qth_max RED marks, as the curve does. The limit is the class's
  buffer; the port program still owns tail drop (it refuses what would pass it), so
  RED never drops.
- Units. RED's max_p is a u32 in units of 2^-32 that the kernel divides by
  (qth_max - qth_min) in integers; `red_params` keeps the rounding below
  MAX_P_ROUNDING or `red_problems` refuses the curve.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

# <linux/pkt_sched.h>
TC_RED_ECN = 1
TC_RED_HARDDROP = 2
TC_RED_ADAPTATIVE = 4
TC_RED_NODROP = 8
TC_RED_HISTORIC_FLAGS = TC_RED_ECN | TC_RED_HARDDROP | TC_RED_ADAPTATIVE
RED_FLAGS = TC_RED_ECN | TC_RED_NODROP
RED_STAB_SIZE = 256
IDLE_SHIFT = 31             # every Stab entry: an idle queue's average decays to 0
U32 = 1 << 32
MAX_P_ROUNDING = 0.01       # the largest relative error of max_p the kernel's division may add
#: Linux RED: fls(qth) + Wlog < 32
MAX_THRESHOLD_BYTES = (1 << 31) - 1


@dataclass(frozen=True)
class FitQuality:
    max_p_ratio: float      # RED's max_p / the curve's pmax
    start: float            # qth_min, as a fraction of the way from kmin to kmax
    max_error: float        # largest |RED's standing fraction - p(q)| over (kmin, kmax]


@dataclass(frozen=True)
class RedParams:
    """What the sch_red qdisc of one class is given (tc_red_qopt, TCA_RED_MAX_P,
    TCA_RED_FLAGS, TCA_RED_STAB)."""

    limit_bytes: int
    qth_min_bytes: int
    qth_max_bytes: int
    max_p_fp: int           # TCA_RED_MAX_P: probability at qth_max, units of 2^-32
    plog: int               # tc_red_qopt.Plog (only shown by dumps: max_p is given)
    wlog: int = 0           # instantaneous queue
    scell_log: int = 0
    flags: int = RED_FLAGS

    @property
    def max_p(self) -> float:
        return self.max_p_fp / U32

    @property
    def stab(self) -> bytes:
        return bytes([IDLE_SHIFT]) * RED_STAB_SIZE


def standing_fraction(pb: np.ndarray | float) -> np.ndarray:
    """The fraction of packets Linux RED marks at a constant queue where its base
    probability is `pb`: 1 / E[gap], the gap N = max(1, ceil(U / pb)) packets (U uniform
    on [0, 1)), E[N] = sum over n >= 1 of P(N >= n) = M - pb M (M - 1) / 2, M = ceil(1/pb)."""
    p = np.clip(np.asarray(pb, dtype=float), 0.0, 1.0)
    out = np.zeros_like(p)
    on = p > 0
    m = np.ceil(1.0 / p[on])
    out[on] = 1.0 / (m - p[on] * m * (m - 1) / 2)
    return out


def _errors(pmax: float, ratios: np.ndarray, starts: np.ndarray, x: np.ndarray) -> np.ndarray:
    """max over x of |RED's standing fraction - pmax x|, for every (start, ratio)."""
    y = np.clip((x[None, None, :] - starts[:, None, None]) / (1.0 - starts[:, None, None]),
                0.0, None)
    pb = np.minimum(1.0, ratios[None, :, None] * pmax) * y
    return np.max(np.abs(standing_fraction(pb) - pmax * x[None, None, :]), axis=2)


@lru_cache(maxsize=64)
def fit(pmax: float) -> FitQuality:
    """max_p / pmax and qth_min's place on the ramp that make RED's fraction at a standing
    queue closest (minimax) to the curve's p(q); the curve is scale-free in (q - kmin) /
    (kmax - kmin), so only pmax matters. Deterministic: a grid, then a finer grid around
    its best point."""
    if not 0 < pmax <= 1:
        raise ValueError(f"pmax {pmax} outside (0, 1]")
    x = np.linspace(0.0, 1.0, 101)[1:]
    starts = np.linspace(0.0, 0.2, 41)
    ratios = np.linspace(0.25, min(2.0, 1.0 / pmax), 64)      # max_p <= 1
    for _ in range(3):
        err = _errors(pmax, ratios, starts, x)
        i, j = np.unravel_index(int(np.argmin(err)), err.shape)
        best = FitQuality(float(ratios[j]), float(starts[i]), float(err[i, j]))
        ds, dr = starts[1] - starts[0], ratios[1] - ratios[0]
        starts = np.linspace(max(0.0, best.start - ds), best.start + ds, 9)
        ratios = np.linspace(max(0.25, best.max_p_ratio - dr),
                             min(1.0 / pmax, best.max_p_ratio + dr), 17)
    return best


def _plog(delta_bytes: int, max_p: float) -> int:
    """iproute2's tc_red_eval_P: the smallest i with max_p / delta x 2^i > 1 (Plog)."""
    prob = max_p / max(1, delta_bytes)
    for i in range(32):
        if prob > 1.0:
            return i
        prob *= 2
    return 31


def red_params(kmin_bytes: int, kmax_bytes: int, pmax: float, limit_bytes: int) -> RedParams:
    """The sch_red parameters that mark with the curve (kmin, kmax, pmax) (module doc)."""
    if kmin_bytes > kmax_bytes:
        raise ValueError(f"kmin {kmin_bytes} above kmax {kmax_bytes}")
    qth_max = kmax_bytes + 1
    if kmin_bytes == kmax_bytes:
        return RedParams(limit_bytes, qth_max, qth_max, U32 - 1, 0)
    quality = fit(pmax)
    span = kmax_bytes - kmin_bytes
    # + 1: qth_min is the first queue RED may mark at; the curve marks from kmin + 1 on
    qth_min = min(qth_max - 1, kmin_bytes + 1 + round(quality.start * span))
    max_p = min(1.0, quality.max_p_ratio * pmax)
    max_p_fp = min(U32 - 1, round(max_p * U32))
    return RedParams(limit_bytes, qth_min, qth_max, max_p_fp, _plog(qth_max - qth_min, max_p))


def kernel_max_p(params: RedParams) -> float:
    """The max_p the kernel really uses: it keeps max_p / (qth_max - qth_min) as an
    integer (red_set_parms: max_P_reciprocal), at least 1."""
    delta = max(1, params.qth_max_bytes - params.qth_min_bytes)
    return max(1, params.max_p_fp // delta) * delta / U32


def red_problems(kmin_bytes: int, kmax_bytes: int, pmax: float,
                 limit_bytes: int) -> list[tuple[str, str]]:
    """What sch_red cannot do with this curve and buffer: [(field below the port class,
    message)], e.g. ("ecn.pmax", ...)."""
    out: list[tuple[str, str]] = []
    if kmax_bytes + 1 > MAX_THRESHOLD_BYTES:
        out.append(("ecn.kmax", f"{kmax_bytes} B is above what sch_red's thresholds hold "
                    f"({MAX_THRESHOLD_BYTES} B); lower ecn.kmax or use marker: bpf"))
        return out
    if limit_bytes >= U32:
        out.append(("ecn.marker", f"the class buffer ({limit_bytes} B) is above sch_red's "
                    f"32-bit limit; lower the buffer or use marker: bpf"))
    if kmin_bytes < kmax_bytes:
        params = red_params(kmin_bytes, kmax_bytes, pmax, min(limit_bytes, U32 - 1))
        wanted = params.max_p
        got = kernel_max_p(params)
        if abs(got - wanted) > MAX_P_ROUNDING * wanted:
            out.append(("ecn.pmax", f"sch_red keeps max_p / (kmax - kmin) as an integer in "
                        f"units of 2^-32: pmax {pmax:g} over a {kmax_bytes - kmin_bytes} B "
                        f"ramp would mark with {got / wanted:.3f} x the curve; raise pmax, "
                        "narrow kmin..kmax, or use marker: bpf"))
    return out


def simulate(params: RedParams, queue_bytes: list[int], rng: np.random.Generator) -> list[bool]:
    """Linux's red_action for packets arriving to the queues `queue_bytes` (Wlog 0, no idle
    period), in the kernel's integer arithmetic: which are marked (hard or probabilistic).
    For tests and for measuring the fit against the real algorithm."""
    delta = max(1, params.qth_max_bytes - params.qth_min_bytes)
    max_p_delta = max(1, params.max_p_fp // delta)
    qcount, qr = -1, 0
    out = []
    draws = rng.integers(0, U32, size=len(queue_bytes), dtype=np.uint64)
    for k, q in enumerate(queue_bytes):
        if q < params.qth_min_bytes:
            qcount = -1
            out.append(False)
        elif q >= params.qth_max_bytes:
            qcount = -1
            out.append(True)
        else:
            qcount += 1
            if qcount:
                if (q - params.qth_min_bytes) * qcount >= qr:
                    qcount = 0
                    qr = int(draws[k]) // max_p_delta
                    out.append(True)
                    continue
            else:
                qr = int(draws[k]) // max_p_delta
            out.append(False)
    return out
