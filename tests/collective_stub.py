"""A stand-in for agents.collectives.algorithms and .data in the transport's tests.

Just enough to drive `python -m agents.collectives` over a real transport: a ring
all-reduce (reduce-scatter, then all-gather; tags = step; algorithm "tree" is the
same without the all-gather, a broken result to count) and a pairwise all-to-all,
on float32 / int32 inputs whose sums are exact, with the data module's call
signatures (make_sendbuf, make_recvbuf, reference, wrong). The worker takes it
through its hidden --algorithms-module / --data-module flags.
"""

from __future__ import annotations

import numpy as np

ALGORITHMS = {"allreduce": ("ring", "tree"), "alltoall": ("pairwise",)}


def _blocks(n_elems: int, n: int) -> list[tuple[int, int]]:
    return [(n_elems * i // n, n_elems * (i + 1) // n) for i in range(n)]


def ring_allreduce(t, send: np.ndarray, recv: np.ndarray, redop: str = "sum",
                   on_phase=None, gather: bool = True) -> None:
    n, r = t.size, t.rank
    recv[...] = send
    blocks = _blocks(recv.size, n)
    tmp = np.empty_like(recv)
    right, left = (r + 1) % n, (r - 1) % n
    combine = np.add if redop == "sum" else np.maximum
    if on_phase:
        on_phase("reduce_scatter")
    for s in range(n - 1):
        lo, hi = blocks[(r - s) % n]
        t.send(right, s, recv[lo:hi])
        lo, hi = blocks[(r - s - 1) % n]
        t.recv(left, s, tmp[:hi - lo])
        combine(recv[lo:hi], tmp[:hi - lo], out=recv[lo:hi])
    if on_phase:
        on_phase("all_gather")
    for s in range(n - 1 if gather else 0):
        lo, hi = blocks[(r - s + 1) % n]
        t.send(right, n - 1 + s, recv[lo:hi])
        lo, hi = blocks[(r - s) % n]
        t.recv(left, n - 1 + s, recv[lo:hi])
    t.wait_sends()


def pairwise_alltoall(t, send: np.ndarray, recv: np.ndarray) -> None:
    n, r = t.size, t.rank
    per = send.size // n
    recv[r * per:(r + 1) * per] = send[r * per:(r + 1) * per]
    for peer in range(n):
        if peer != r:
            t.send(peer, 7, send[peer * per:(peer + 1) * per])
    for peer in range(n):
        if peer != r:
            t.recv(peer, 7, recv[peer * per:(peer + 1) * per])
    t.wait_sends()


def run(op, algorithm, transport, sendbuf, recvbuf, *, redop="sum", root=0, chunks=1,
        dtype=None, on_phase=None) -> None:
    if op == "allreduce":
        # "tree" is a broken all-reduce here (no all-gather), to see #wrong count
        ring_allreduce(transport, sendbuf, recvbuf, redop, on_phase, gather=algorithm != "tree")
    elif op == "alltoall":
        pairwise_alltoall(transport, sendbuf, recvbuf)
    else:
        raise NotImplementedError(f"the test stand-in has no {op}")


# --- data: the data module's signatures, exact values only

_DTYPES = {"float32": np.float32, "int32": np.int32}


def _counts(op: str, count: int, n: int) -> tuple[int, int]:
    return (count * n, count * n) if op == "alltoall" else (count, count)


def fill(rank: int, count: int, dtype: str, seed: int = 0, *, start: int = 0) -> np.ndarray:
    i = np.arange(start, start + count, dtype=np.int64)
    # small integers: float32 sums of a few ranks are exact
    return ((i * 7 + rank * 1000 + seed) % 4093 - 2000).astype(_DTYPES[dtype])


def make_sendbuf(op, rank, size, count, dtype, seed=0) -> np.ndarray:
    return fill(rank, _counts(op, count, size)[0], dtype, seed)


def make_recvbuf(op, size, count, dtype) -> np.ndarray:
    return np.full(_counts(op, count, size)[1], -12345, dtype=_DTYPES[dtype])


def reference(op, redop, size, count, dtype, *, rank=0, root=0, seed=0) -> np.ndarray:
    if op == "alltoall":
        return np.concatenate([fill(r, count, dtype, seed, start=rank * count)
                               for r in range(size)])
    inputs = np.stack([fill(r, count, dtype, seed) for r in range(size)])
    return inputs.sum(axis=0) if redop == "sum" else inputs.max(axis=0)


def wrong(result, ref, dtype, n_ranks, algorithm) -> int:
    return int(np.count_nonzero(np.asarray(result) != ref))


def count_wrong(result, op, redop, size, count, dtype, algorithm, *, rank=0, root=0, seed=0,
                tolerance=None, block=None, between=None) -> int:
    return wrong(result, reference(op, redop, size, count, dtype, rank=rank, root=root,
                                   seed=seed), dtype, size, algorithm)
