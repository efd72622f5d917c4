"""The data a collective moves: dtypes, reduction operators, test data and `#wrong`.

Dtypes are float32, float16, bfloat16, int32 (the control plane's names; nccl-tests
prints float, half, bfloat16, int32). numpy has no bfloat16, so a bfloat16 buffer is
stored as uint16 (the high 16 bits of a float32); `bf16_from_f32` rounds a float32 to
the nearest bfloat16, ties to even (the rounding of Kalamkar et al. 2019, "A Study of
BFLOAT16 for Deep Learning Training", and of CUDA's `__float2bfloat16`); `bf16_to_f32`
widens exactly.

Reductions (`reduce_into`) are sum and max. float16 and bfloat16 are reduced the way
NCCL reduces them: both operands are widened to float32, combined, and the result is
rounded back to the storage type at every step. So a step rounds twice, to float32
(exact unless the operands' exponents are far apart) and to the 16-bit type, and the
error bound allows both. int32 sums wrap around (two's complement), as on a GPU.

`fill` gives every (seed, rank, element) a fixed value from a counter-based hash
(SplitMix64), independent of the buffer's length, so any rank or any process can
recompute any other rank's input. Floats are magnitudes in [0.5, 2) rounded to the
dtype, negative with probability 1/4: full mantissas (so summation really rounds and the
error bound below is exercised) yet well conditioned (the mean is half the mean
magnitude, so cancellation is rare; the bound is relative to sum |x_i| anyway). int32
values span the whole range, so sums wrap.

`reference` computes what every rank must hold from every rank's input, in float64
(int64 reduced modulo 2**32 for int32). `wrong` counts the elements of a result that
fall outside the stated bound; it never assumes a result is right.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from agents.collectives.ops import DTYPES, REDOPS, buffer_counts

_STORAGE: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(np.uint16),
    "int32": np.dtype(np.int32),
}
# Machine epsilon (the gap between 1 and the next value); the unit roundoff of
# round-to-nearest is half of it. 0 for int32, whose reductions are exact.
_EPS = {"float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7, "int32": 0.0}
_U32 = 2.0**-24  # float32 unit roundoff: the accumulation type of float16/bfloat16
_U64 = 2.0**-53  # float64 unit roundoff: the reference's own rounding


def _check(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {name} {value!r}: one of {', '.join(allowed)}")


def storage(dtype: str) -> np.dtype:
    """The numpy dtype a buffer of `dtype` is held in (uint16 for bfloat16)."""
    _check("dtype", dtype, DTYPES)
    return _STORAGE[dtype]


def itemsize(dtype: str) -> int:
    return storage(dtype).itemsize


def eps(dtype: str) -> float:
    """Machine epsilon of `dtype` (2**-23, 2**-10, 2**-7; 0 for int32)."""
    _check("dtype", dtype, DTYPES)
    return _EPS[dtype]


def dtype_of(array: np.ndarray) -> str:
    """The dtype name of a buffer; a uint16 buffer is taken to hold bfloat16."""
    for name, st in _STORAGE.items():
        if array.dtype == st:
            return name
    raise ValueError(f"no collective dtype is stored as {array.dtype}")


def bf16_from_f32(x: np.ndarray) -> np.ndarray:
    """Round float32 values to bfloat16 (uint16 bit patterns), to nearest, ties to even.

    Adding 0x7FFF plus the lowest kept bit before dropping the low 16 bits rounds up
    exactly when the dropped half is above one half, or exactly one half with an odd
    kept part. Overflow goes to infinity as IEEE rounding does; a NaN stays a (quiet)
    NaN, which the addition alone could carry into the sign bit or to infinity.
    """
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded[nan] = ((bits[nan] >> 16) | np.uint32(0x0040)).astype(np.uint16)
    return rounded


def bf16_to_f32(b: np.ndarray) -> np.ndarray:
    """Widen bfloat16 bit patterns to float32 (exact)."""
    return (np.ascontiguousarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def _to_f32(dtype: str, a: np.ndarray) -> np.ndarray:
    return bf16_to_f32(a) if dtype == "bfloat16" else a.astype(np.float32)


def _from_f32(dtype: str, a: np.ndarray) -> np.ndarray:
    return bf16_from_f32(a) if dtype == "bfloat16" else a.astype(storage(dtype))


def widen(dtype: str, a: np.ndarray) -> np.ndarray:
    """The exact values of a buffer: float64 for the floats, int64 for int32."""
    if dtype == "int32":
        return a.astype(np.int64)
    return _to_f32(dtype, a).astype(np.float64) if dtype == "bfloat16" else a.astype(np.float64)


def _f32_round_to_odd(values: np.ndarray) -> np.ndarray:
    """float64 -> float32 by truncation toward zero with the last bit set when inexact
    ("round to odd"): rounding that again to bfloat16 (16 fewer bits) is then the same
    as rounding the float64 once (Boldo & Melquiond 2008), with no double rounding."""
    x = np.asarray(values, dtype=np.float64)
    f = x.astype(np.float32)
    over = np.abs(f.astype(np.float64)) > np.abs(x)
    f[over] = np.nextafter(f[over], np.float32(0))
    inexact = f.astype(np.float64) != x
    bits = f.view(np.uint32)
    bits[inexact & np.isfinite(x)] |= np.uint32(1)
    return f


def narrow(dtype: str, values: np.ndarray) -> np.ndarray:
    """float64/int64 values as a `dtype` buffer, rounded once to nearest (int32 wraps)."""
    if dtype == "int32":
        return _wrap32(np.asarray(values, dtype=np.int64)).astype(np.int32)
    if dtype == "bfloat16":
        return bf16_from_f32(_f32_round_to_odd(values))
    return np.asarray(values, dtype=np.float64).astype(storage(dtype))


_BINARY: dict[str, Callable[..., np.ndarray]] = {"sum": np.add, "max": np.maximum}


def reduce_into(redop: str, dtype: str, acc: np.ndarray, incoming: np.ndarray) -> None:
    """acc <- acc (redop) incoming, element-wise, in place, in `dtype` arithmetic.

    float16 and bfloat16 are widened to float32, combined and rounded back once per call
    (NCCL's per-step behaviour); int32 sums wrap.
    """
    _check("redop", redop, REDOPS)
    op = _BINARY[redop]
    if dtype in ("float32", "int32"):
        op(acc, incoming, out=acc)
        return
    acc[...] = _from_f32(dtype, op(_to_f32(dtype, acc), _to_f32(dtype, incoming)))


_M64 = (1 << 64) - 1


_GAMMA = 0x9E3779B97F4A7C15       # SplitMix64's increment (the golden ratio, odd)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser (Steele, Lea & Flood 2014), a bijective 64-bit mix, applied
    to `x` in place (and returned): the inputs of a 256 MiB buffer are recomputed by
    every rank's check, so temporaries are kept to one."""
    t = np.empty_like(x)
    for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB), (31, None)):
        np.right_shift(x, np.uint64(shift), out=t)
        np.bitwise_xor(x, t, out=x)
        if mult is not None:
            np.multiply(x, np.uint64(mult), out=x)
    return x


def fill(rank: int, count: int, dtype: str, seed: int = 0, *, start: int = 0) -> np.ndarray:
    """Elements start..start+count-1 of `rank`'s test input, as a `dtype` buffer.

    Element i's value depends only on (seed, rank, i): fill(r, 10)[4:] == fill(r, 6,
    start=4). It is SplitMix64's output for state key + (i + 1) x gamma, the key mixed
    from (seed, rank). Floats: +-[0.5, 2) rounded to the dtype, negative with probability
    1/4; int32: uniform over the whole range.
    """
    _check("dtype", dtype, DTYPES)
    # The key is mixed in Python integers (mod 2**64), so numpy scalar overflow warnings
    # never fire; the array arithmetic below wraps silently, as intended.
    key = ((seed * _GAMMA) ^ (rank * 0xD1B54A32D192ED03) ^ 0x632BE59BD9B4E019) & _M64
    key = int(_splitmix64(np.array([key], dtype=np.uint64))[0])
    h = np.arange(start + 1, start + count + 1, dtype=np.uint64)
    np.multiply(h, np.uint64(_GAMMA), out=h)
    np.add(h, np.uint64(key), out=h)
    _splitmix64(h)
    if dtype == "int32":
        return (h >> np.uint64(32)).astype(np.uint32).view(np.int32)
    unit = (h >> np.uint64(11)).astype(np.float64)
    unit *= 1.5 * 2.0**-53
    unit += 0.5
    unit[(h & np.uint64(3)) == 0] *= -1.0
    return narrow(dtype, unit)


def make_sendbuf(op: str, rank: int, size: int, count: int, dtype: str,
                 seed: int = 0) -> np.ndarray:
    """`rank`'s send buffer for `op` (nccl-tests' count semantics), from `fill`."""
    return fill(rank, buffer_counts(op, count, size)[0], dtype, seed)


def make_recvbuf(op: str, size: int, count: int, dtype: str) -> np.ndarray:
    """A receive buffer for `op`, pre-filled with a sentinel (NaN for the floats,
    int32's minimum) so an element the collective never wrote shows up as wrong."""
    n = buffer_counts(op, count, size)[1]
    if dtype == "bfloat16":
        return np.full(n, 0x7FC1, dtype=np.uint16)  # a quiet NaN
    if dtype == "int32":
        return np.full(n, np.iinfo(np.int32).min, dtype=np.int32)
    return np.full(n, np.nan, dtype=storage(dtype))


@dataclass(frozen=True)
class Reference:
    """What one rank's receive buffer must hold.

    `values` are exact (float64, or int64 already wrapped to int32's range); `abs_sum`
    is sum_i |x_i| over the reduced inputs of each element, None where the result must
    be bit-exact (no reduction, max, or int32).
    """

    op: str
    redop: str
    values: np.ndarray
    abs_sum: np.ndarray | None


def _wrap32(v: np.ndarray) -> np.ndarray:
    return ((v + (1 << 31)) % (1 << 32)) - (1 << 31)


def _reduced(redop: str, dtype: str, size: int, count: int, seed: int,
             start: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Exact reduction over every rank of elements start..start+count-1, and sum|x|."""
    acc: np.ndarray | None = None
    abs_sum = np.zeros(count, dtype=np.float64)
    for r in range(size):  # rank by rank: O(count) memory however many ranks
        x = widen(dtype, fill(r, count, dtype, seed, start=start))
        abs_sum += np.abs(x)
        acc = x if acc is None else (acc + x if redop == "sum" else np.maximum(acc, x))
    assert acc is not None  # size >= 1
    if dtype == "int32":
        return (_wrap32(acc) if redop == "sum" else acc), None
    return acc, (abs_sum if redop == "sum" else None)


def reference(op: str, redop: str, size: int, count: int, dtype: str, *, rank: int = 0,
              root: int = 0, seed: int = 0, start: int = 0,
              stop: int | None = None) -> Reference:
    """The exact expected receive buffer of `rank` for `op` over `size` ranks whose
    inputs are `make_sendbuf(op, r, size, count, dtype, seed)`; `root` for broadcast.

    `start`/`stop` select elements start..stop-1 of the receive buffer (default: all),
    so a large result can be checked block by block (`count_wrong`) in bounded memory:
    each element's value depends only on (seed, rank, index), see `fill`."""
    _check("redop", redop, REDOPS)
    n_out = buffer_counts(op, count, size)[1]  # validates op, count, size
    if not 0 <= rank < size or not 0 <= root < size:
        raise ValueError(f"rank {rank} / root {root} outside 0..{size - 1}")
    stop = n_out if stop is None else stop
    if not 0 <= start <= stop <= n_out:
        raise ValueError(f"elements {start}..{stop} outside the {n_out}-element buffer")
    if op in ("allreduce", "reducescatter"):
        first = (rank * count if op == "reducescatter" else 0) + start
        values, abs_sum = _reduced(redop, dtype, size, stop - start, seed, first)
        return Reference(op, redop, values, abs_sum)
    if op == "broadcast":
        return Reference(op, redop, widen(dtype, fill(root, stop - start, dtype, seed,
                                                      start=start)), None)
    # allgather: block j of the receive buffer is rank j's send buffer; alltoall: block j
    # is block `rank` of rank j's send buffer. Either way piece by piece, block by block.
    base = rank * count if op == "alltoall" else 0
    pieces = []
    for j in range(start // count, -(-stop // count)) if count else ():
        a, b = max(start, j * count), min(stop, (j + 1) * count)
        pieces.append(widen(dtype, fill(j, b - a, dtype, seed, start=base + a - j * count)))
    values = np.concatenate(pieces) if pieces else np.empty(0, dtype=np.float64)
    return Reference(op, redop, values, None)


#: Elements checked at a time by `count_wrong` (a few tens of MB of temporaries).
CHECK_BLOCK_ELEMENTS = 1 << 20


def count_wrong(result: np.ndarray, op: str, redop: str, size: int, count: int, dtype: str,
                algorithm: str, *, rank: int = 0, root: int = 0, seed: int = 0,
                tolerance: Callable[[Reference], np.ndarray | float] | None = None,
                block: int = CHECK_BLOCK_ELEMENTS,
                between: Callable[[], None] | None = None) -> int:
    """`wrong` over the whole of `result` against `reference`, one block at a time, so
    checking a 256 MiB result never holds its float64 reference whole (the reference of
    a block costs ~10 float64 temporaries per element). `tolerance(ref_block)` replaces
    the algorithm's bound (the in-network path's quantisation bound); `between()` runs
    between blocks (a stop check)."""
    flat = np.asarray(result).reshape(-1)
    if flat.size != buffer_counts(op, count, size)[1]:
        raise ValueError(f"result has {flat.size} elements, the receive buffer "
                         f"{buffer_counts(op, count, size)[1]}")
    bad = 0
    for a in range(0, flat.size, block):
        b = min(a + block, flat.size)
        ref = reference(op, redop, size, count, dtype, rank=rank, root=root, seed=seed,
                        start=a, stop=b)
        if tolerance is None:
            bad += wrong(flat[a:b], ref, dtype, size, algorithm)
        else:
            got = widen(dtype, flat[a:b])
            bad += int(np.count_nonzero(~(np.abs(got - ref.values) <= tolerance(ref))))
        if between is not None:
            between()
    return bad


def reduction_depth(algorithm: str, n: int) -> int:
    """The most reduction steps (roundings) any input element passes through.

    ring: n-1 (a block travels the whole ring); rhd: ceil(log2 n) (log2 of the power
    of two, plus the fold of the first 2r ranks); tree: 2*ceil(log2 n) - 1 (at most two
    additions at each of the ceil(log2 n) - 1 non-root ancestors, own+child0 then
    +child1, and one at the root, which has a single child), capped at n-1. Any other
    name (e.g. an in-network aggregator) gets n-1, which holds for every order of
    pairwise combination of n terms.
    """
    if n <= 1:
        return 0
    log2n = (n - 1).bit_length()  # ceil(log2 n)
    if algorithm == "rhd":
        return log2n
    if algorithm == "tree":
        return min(n - 1, 2 * log2n - 1)
    return n - 1


def _gamma(k: int, u: float) -> float:
    """Higham's gamma_k = k u / (1 - k u)."""
    return k * u / (1.0 - k * u)


def error_bound(dtype: str, n_ranks: int, algorithm: str) -> float:
    """c such that |result - reference| <= c * sum_i |x_i| for a sum, elementwise.

    Each reduction step computes fl(a + b) = (a + b)(1 + d) with |d| <= u, the unit
    roundoff (eps/2). An element that went through k steps therefore carries at most
    gamma_k = k u / (1 - k u) relative error on each input it summed, whatever the
    order (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., 2002,
    sec. 4.2, for recursive and tree summation alike): |s^ - s| <= gamma_k sum|x_i|, with
    k = reduction_depth(algorithm, n) <= n-1 (the textbook (n-1) u sum|x_i| bound, to
    first order). For float16 and bfloat16 each step rounds twice, to float32 and back
    to the 16-bit type, so u = (1 + u_f32)(1 + u_16) - 1; the last step's rounding to
    the storage type is the final rounding, so it is included. The float64 reference's
    own error, gamma_{n-1}(2**-53) sum|x_i|, is added so the bound is rigorous (it is
    ~1e-9 of the float32 term). int32 and max are exact: 0.
    """
    if dtype == "int32":
        return 0.0
    u = eps(dtype) / 2
    if dtype != "float32":
        u = (1 + _U32) * (1 + u) - 1
    return _gamma(reduction_depth(algorithm, n_ranks), u) + _gamma(max(n_ranks - 1, 0), _U64)


def wrong(result: np.ndarray, reference: Reference, dtype: str, n_ranks: int,
          algorithm: str) -> int:
    """The number of elements of `result` (a `dtype` buffer) outside the bound.

    Bit-exact comparison (as values, so +0 == -0) where `reference.abs_sum` is None;
    otherwise |x - ref| <= error_bound(dtype, n_ranks, algorithm) * sum|x_i|. A NaN, or a
    missing or wrong contribution larger than the bound, counts.
    """
    got = widen(dtype, np.asarray(result).reshape(-1))
    if got.shape != reference.values.shape:
        raise ValueError(f"result has {got.size} elements, reference {reference.values.size}")
    if reference.abs_sum is None:
        return int(np.count_nonzero(got != reference.values))
    bound = error_bound(dtype, n_ranks, algorithm) * reference.abs_sum
    # `not <=` rather than `>`, so NaN counts as wrong.
    return int(np.count_nonzero(~(np.abs(got - reference.values) <= bound)))
