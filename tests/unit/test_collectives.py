"""The collective algorithms, their data and their test transport.

Every result is judged by `data.wrong` against `data.reference` (exact, from every
rank's input); nothing is assumed correct. The loopback transport runs n ranks as
threads and fails fast on deadlocks, send-buffer reuse and stray messages, so the
deliberately broken schedules below must be caught, not hang.
"""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest

from agents.collectives import algorithms, data, ops
from agents.collectives.algorithms import ALGORITHMS, btree, dtree
from agents.collectives.loopback import (
    BufferReuseError,
    DeadlockError,
    LoopbackError,
    LoopbackTransport,
    LoopbackWorld,
)

PAIRS = [(op, alg) for op, algs in ALGORITHMS.items() for alg in algs]
REDUCING = ("allreduce", "reducescatter")


def _cases(op: str, n: int, dtype: str) -> list[tuple[str, int, int, int]]:
    """(redop, count, chunks, root): counts 0, 1, below n and not a multiple of n or of
    the 3 chunks; max for the reductions; several roots for broadcast."""
    counts = (0, 1, n - 1, 3 * n + 2) if dtype in ("float32", "int32") else (1, 3 * n + 2)
    redops = data.REDOPS if op in REDUCING else ("sum",)
    roots = sorted({0, n // 2, n - 1}) if op == "broadcast" else [0]
    return [(redop, count, chunks, root) for redop in redops for count in counts
            for chunks in (1, 3) for root in roots]


def _run_cases(op: str, alg: str, n: int, dtype: str, cases: list[tuple[str, int, int, int]],
               *, reorder: int | None = None, seed: int = 3) -> list[list[tuple[int, bytes]]]:
    """Run every case on one world; per rank, per case: (#wrong, result bytes). Also
    checks that sendbuf is left untouched."""
    world = LoopbackWorld(n, timeout=10, reorder=reorder)

    def fn(t: LoopbackTransport) -> list[tuple[int, bytes]]:
        out = []
        for redop, count, chunks, root in cases:
            send = data.make_sendbuf(op, t.rank, n, count, dtype, seed)
            before = send.copy()
            recv = data.make_recvbuf(op, n, count, dtype)
            algorithms.run(op, alg, t, send, recv, redop=redop, root=root, chunks=chunks,
                           dtype=dtype)
            assert np.array_equal(send, before), "sendbuf was written"
            ref = data.reference(op, redop, n, count, dtype, rank=t.rank, root=root, seed=seed)
            out.append((data.wrong(recv, ref, dtype, n, alg), recv.tobytes()))
        return out

    return world.run(fn)


def _assert_all_right(op: str, results: list[list[tuple[int, bytes]]], cases: list) -> None:
    wrong = {(rank, cases[i]): w for rank, per in enumerate(results)
             for i, (w, _) in enumerate(per) if w}
    assert not wrong, f"#wrong > 0 for (rank, (redop, count, chunks, root)): {wrong}"
    if op == "allreduce":  # every rank must hold the very same bits, not just close ones
        for i in range(len(cases)):
            assert len({per[i][1] for per in results}) == 1, f"ranks differ in case {cases[i]}"


# -- correctness ---------------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 3, 5, 8])
@pytest.mark.parametrize("dtype", data.DTYPES)
@pytest.mark.parametrize(("op", "alg"), PAIRS)
def test_every_algorithm_dtype_and_op_is_right(op: str, alg: str, dtype: str, n: int) -> None:
    cases = _cases(op, n, dtype)
    _assert_all_right(op, _run_cases(op, alg, n, dtype, cases), cases)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32"])
@pytest.mark.parametrize(("op", "alg"), PAIRS)
def test_one_rank_is_a_local_copy(op: str, alg: str, dtype: str) -> None:
    cases = _cases(op, 1, dtype)
    world = LoopbackWorld(1)

    def fn(t: LoopbackTransport) -> None:
        for redop, count, chunks, root in cases:
            send = data.make_sendbuf(op, 0, 1, count, dtype)
            recv = data.make_recvbuf(op, 1, count, dtype)
            algorithms.run(op, alg, t, send, recv, redop=redop, root=root, chunks=chunks)
            assert np.array_equal(recv, send)

    world.run(fn)
    assert world.messages_sent == [0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("op", "alg"), PAIRS)
def test_sixteen_ranks(op: str, alg: str, dtype: str) -> None:
    cases = [(redop, count, 2, 5 if op == "broadcast" else 0)
             for redop in (data.REDOPS if op in REDUCING else ("sum",)) for count in (7, 37)]
    _assert_all_right(op, _run_cases(op, alg, 16, dtype, cases), cases)


@pytest.mark.parametrize(("op", "alg"), PAIRS)
def test_right_when_messages_arrive_out_of_order_across_tags(op: str, alg: str) -> None:
    cases = _cases(op, 5, "float32")
    for seed in (1, 2):
        _assert_all_right(op, _run_cases(op, alg, 5, "float32", cases, reorder=seed), cases)


@pytest.mark.parametrize(("op", "alg"), PAIRS)
def test_in_place(op: str, alg: str) -> None:
    """NCCL's in-place conventions: recvbuf is sendbuf for allreduce, broadcast and
    alltoall; sendbuf is recvbuf's own block for allgather and reducescatter's
    recvbuf is sendbuf's own block."""
    n, count, dtype = 5, 13, "float32"
    world = LoopbackWorld(n)

    def fn(t: LoopbackTransport) -> int:
        r = t.rank
        if op == "allgather":
            big = data.make_recvbuf(op, n, count, dtype)
            big[r * count:(r + 1) * count] = data.make_sendbuf(op, r, n, count, dtype)
            send, recv = big[r * count:(r + 1) * count], big
        elif op == "reducescatter":
            send = data.make_sendbuf(op, r, n, count, dtype)
            recv = send[r * count:(r + 1) * count]
        else:
            send = recv = data.make_sendbuf(op, r, n, count, dtype)
        algorithms.run(op, alg, t, send, recv, chunks=2, root=1)
        return data.wrong(recv, data.reference(op, "sum", n, count, dtype, rank=r, root=1),
                          dtype, n, alg)

    assert world.run(fn) == [0] * n


# -- traffic volume ------------------------------------------------------------------

COUNT = 1680  # divisible by 2, 3, 4, 5, 8 and 16: the volume formulas hold exactly


def _traffic(op: str, alg: str, n: int, chunks: int) -> LoopbackWorld:
    world = LoopbackWorld(n)

    def fn(t: LoopbackTransport) -> None:
        send = data.make_sendbuf(op, t.rank, n, COUNT, "float32")
        recv = data.make_recvbuf(op, n, COUNT, "float32")
        algorithms.run(op, alg, t, send, recv, chunks=chunks, root=1 % n)

    world.run(fn)
    assert sum(world.bytes_sent) == sum(world.bytes_received)
    return world


@pytest.mark.parametrize("chunks", [1, 4])
@pytest.mark.parametrize("n", [2, 3, 5, 8, 16])
def test_ring_all_reduce_sends_2_n_minus_1_over_n_of_the_buffer(n: int, chunks: int) -> None:
    world = _traffic("allreduce", "ring", n, chunks)
    size = COUNT * 4
    assert world.bytes_sent == [2 * (n - 1) * size // n] * n
    assert world.bytes_received == [2 * (n - 1) * size // n] * n
    # chunks pieces per step, 2(n-1) steps: the pipelining granularity is what was asked
    assert world.messages_sent == [2 * (n - 1) * chunks] * n


@pytest.mark.parametrize("n", [2, 3, 5, 8, 16])
def test_rhd_traffic(n: int) -> None:
    """2(p-1)/p of the buffer per rank among the p = 2**floor(log2 n) participants (the
    same as the ring when n is a power of two); the fold adds one whole buffer to each
    of the first 2r ranks: the even ones send it in, the odd ones send the result out."""
    world = _traffic("allreduce", "rhd", n, 2)
    size, p = COUNT * 4, 1 << (n.bit_length() - 1)
    rem, core = n - p, 2 * (p - 1) * size // p
    want = [size if r < 2 * rem and r % 2 == 0 else core + (size if r < 2 * rem else 0)
            for r in range(n)]
    assert world.bytes_sent == want
    if rem == 0:
        assert want == [2 * (n - 1) * size // n] * n


@pytest.mark.parametrize("n", [2, 3, 5, 8, 16])
def test_tree_sends_at_most_twice_the_buffer(n: int) -> None:
    """Each tree carries half the buffer over its n-1 edges, up and down: 2(n-1) buffers
    in all; a rank internal in one tree (two children) and a leaf in the other sends
    1/2 + 2/2 + 1/2 = 2 buffers, the most any rank sends."""
    world = _traffic("allreduce", "tree", n, 3)
    size = COUNT * 4
    assert max(world.bytes_sent) <= 2 * size
    assert sum(world.bytes_sent) == 2 * (n - 1) * size
    for r in range(n):
        links = dtree(n, r)
        assert world.bytes_sent[r] == sum(size // 2 * ((t.parent >= 0) + len(t.children))
                                          for t in links)


@pytest.mark.parametrize("n", [2, 3, 5, 8, 16])
@pytest.mark.parametrize(("op", "alg"), [("reducescatter", "ring"), ("allgather", "ring"),
                                         ("alltoall", "pairwise"), ("broadcast", "ring")])
def test_other_ops_send_what_their_bus_factor_says(op: str, alg: str, n: int) -> None:
    """Every rank moves bus_factor * size bytes, except broadcast's chain, whose last
    rank sends nothing (the n-1 links carry the buffer once each)."""
    world = _traffic(op, alg, n, 2)
    size = ops.size_bytes(op, COUNT, n, "float32")
    if op == "broadcast":
        last = (1 % n - 1) % n
        assert world.bytes_sent == [0 if r == last else size for r in range(n)]
    else:
        assert world.bytes_sent == [round(ops.bus_factor(op, n) * size)] * n


# -- broken schedules are caught -----------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "int32"])
@pytest.mark.parametrize(("op", "alg"), [p for p in PAIRS if p[0] in REDUCING])
def test_a_dropped_reduction_step_counts_as_wrong(monkeypatch: pytest.MonkeyPatch, op: str,
                                                  alg: str, dtype: str) -> None:
    """Rank 1 skips its first reduction (keeps its partial, drops what it received): the
    elements of that piece miss contributions, and #wrong must say so on every rank that
    ends up with them."""
    real, dropped = data.reduce_into, list[int]()

    def lossy(redop: str, dt: str, acc: np.ndarray, incoming: np.ndarray) -> None:
        if threading.current_thread().name == "loopback-rank1" and not dropped:
            dropped.append(acc.size)
            return
        real(redop, dt, acc, incoming)

    monkeypatch.setattr(data, "reduce_into", lossy)
    n, count = 5, 23
    results = _run_cases(op, alg, n, dtype, [("sum", count, 2, 0)])
    assert dropped and dropped[0] > 0
    wrong = [per[0][0] for per in results]
    if op == "allreduce":
        assert wrong == [dropped[0]] * n
    else:  # only the rank whose block it was holds the damage
        assert sum(wrong) == dropped[0]


def test_a_reversed_ring_on_one_rank_is_a_deadlock_found_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    real = algorithms._ring_neighbours

    def twisted(rank: int, n: int) -> tuple[int, int]:
        left, right = real(rank, n)
        return (right, left) if rank == 2 else (left, right)

    monkeypatch.setattr(algorithms, "_ring_neighbours", twisted)
    world = LoopbackWorld(5, timeout=30)

    def fn(t: LoopbackTransport) -> None:
        send = data.make_sendbuf("allreduce", t.rank, 5, 20, "float32")
        algorithms.run("allreduce", "ring", t, send, np.empty_like(send))

    start = time.monotonic()
    with pytest.raises(DeadlockError, match="blocked in recv|has returned"):
        world.run(fn)
    assert time.monotonic() - start < 5  # found by the wait-for check, not the 30 s timeout


def test_a_tree_that_forgets_a_child_is_a_deadlock(monkeypatch: pytest.MonkeyPatch) -> None:
    real = algorithms.dtree

    def forgetful(n: int, rank: int) -> tuple[algorithms.TreeLinks, algorithms.TreeLinks]:
        first, second = real(n, rank)
        if rank == 2:  # in tree 1 on 8 ranks, 2 has children 1 and 3
            first = algorithms.TreeLinks(first.parent, first.children[:1])
        return first, second

    monkeypatch.setattr(algorithms, "dtree", forgetful)
    world = LoopbackWorld(8, timeout=30)

    def fn(t: LoopbackTransport) -> None:
        send = data.make_sendbuf("allreduce", t.rank, 8, 20, "float32")
        algorithms.run("allreduce", "tree", t, send, np.empty_like(send))

    # rank 3 waits forever for its share of tree 1 from rank 2; the others wait on it
    with pytest.raises(DeadlockError, match="rank 3 <- rank 2 tag"):
        world.run(fn)


def test_gathering_over_the_buffer_just_sent_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tempting ring all-reduce that all-gathers in the reduce-scatter buffer gives
    the right numbers on a copying transport but overwrites blocks a zero-copy one may
    still be sending: the loopback must refuse it."""
    def in_place_ring(ctx: algorithms._Ctx, send: np.ndarray, recv: np.ndarray,
                      root: int) -> None:
        blocks = algorithms._split(0, recv.size, ctx.n)
        acc, inbox = send.copy(), np.empty_like(send)
        algorithms._ring_reduce_scatter(ctx, acc, inbox, blocks)
        algorithms._ring_all_gather(ctx, acc, blocks)
        recv[:] = acc

    monkeypatch.setitem(algorithms._IMPLS, ("allreduce", "ring"), in_place_ring)
    world = LoopbackWorld(4)

    def fn(t: LoopbackTransport) -> None:
        send = data.make_sendbuf("allreduce", t.rank, 4, 20, "float32")
        algorithms.run("allreduce", "ring", t, send, np.empty_like(send))

    with pytest.raises(BufferReuseError, match="before wait_sends"):
        world.run(fn)


# -- the loopback transport itself ---------------------------------------------------

def test_recv_with_no_sender_left_is_a_deadlock_at_once() -> None:
    world = LoopbackWorld(2, timeout=30)

    def fn(t: LoopbackTransport) -> None:
        if t.rank == 0:
            t.recv(1, 7, np.empty(3, np.int32))

    start = time.monotonic()
    with pytest.raises(DeadlockError, match="rank 0 waits for tag 7 from rank 1, which has"):
        world.run(fn)
    assert time.monotonic() - start < 5


def test_recv_times_out_while_the_peer_is_busy() -> None:
    world = LoopbackWorld(2, timeout=0.2)

    def fn(t: LoopbackTransport) -> None:
        if t.rank == 0:
            t.recv(1, 0, np.empty(1, np.int32))
        else:
            time.sleep(0.6)  # busy, not blocked in recv: only the timeout can tell

    with pytest.raises(DeadlockError, match="waited 0.2 s for tag 0 from rank 1"):
        world.run(fn)


def test_length_mismatch_unwaited_sends_and_stray_messages_are_errors() -> None:
    def short(t: LoopbackTransport) -> None:
        if t.rank == 0:
            t.send(1, 0, np.zeros(4, np.int32))
            t.wait_sends()
        else:
            t.recv(0, 0, np.empty(3, np.int32))

    with pytest.raises(LoopbackError, match="has 16 bytes, the receive buffer 12"):
        LoopbackWorld(2).run(short)

    def unwaited(t: LoopbackTransport) -> None:
        if t.rank == 0:
            t.send(1, 0, np.zeros(1, np.int32))
        else:
            t.recv(0, 0, np.empty(1, np.int32))

    with pytest.raises(LoopbackError, match="never waited for"):
        LoopbackWorld(2).run(unwaited)

    def stray(t: LoopbackTransport) -> None:
        if t.rank == 0:
            t.send(1, 5, np.zeros(1, np.int32))
            t.wait_sends()

    with pytest.raises(LoopbackError, match=r"never received.*\(0, 1, 5\): 1"):
        LoopbackWorld(2).run(stray)


def test_reorder_shuffles_tags_but_keeps_each_tag_in_order() -> None:
    world = LoopbackWorld(2, reorder=11)

    def fn(t: LoopbackTransport) -> list[int]:
        if t.rank == 0:
            for tag in range(40):
                t.send(1, tag, np.array([tag], np.int32))
            for i in range(10):
                t.send(1, 99, np.array([i], np.int32))
            t.wait_sends()
            return []
        got = []
        for tag in range(40):
            out = np.empty(1, np.int32)
            t.recv(0, tag, out)
            assert out[0] == tag
        for _ in range(10):
            out = np.empty(1, np.int32)
            t.recv(0, 99, out)
            got.append(int(out[0]))
        return got

    assert world.run(fn)[1] == list(range(10))  # same tag: FIFO
    order = [tag for _, tag in world.arrivals[1] if tag != 99]
    assert sorted(order) == list(range(40)) and order != list(range(40))


# -- data: bfloat16, fill, reference, the bound --------------------------------------

def test_bf16_round_trips_every_pattern() -> None:
    bits = np.arange(1 << 16, dtype=np.uint16)
    f = data.bf16_to_f32(bits)
    ok = ~np.isnan(f)
    assert np.array_equal(data.bf16_from_f32(f)[ok], bits[ok])
    assert np.isnan(data.bf16_to_f32(data.bf16_from_f32(f[~ok]))).all()  # NaN stays NaN


def test_bf16_rounds_to_nearest_even() -> None:
    def bf(*patterns: int) -> list[int]:
        return data.bf16_from_f32(np.array(patterns, np.uint32).view(np.float32)).tolist()

    # exactly halfway: to the even neighbour, up or down; off halfway: to the nearer
    assert bf(0x3F808000, 0x3F818000, 0xBF818000) == [0x3F80, 0x3F82, 0xBF82]
    assert bf(0x3F808001, 0x3F807FFF) == [0x3F81, 0x3F80]
    assert bf(0x7F7FFFFF, 0x7F800000, 0xFF800000, 0x80000000) == [0x7F80, 0x7F80, 0xFF80, 0x8000]


def test_bf16_rounding_matches_an_independent_nearest_even() -> None:
    rng = np.random.default_rng(5)
    bits = rng.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32)
    bits = bits[((bits >> 23) & 0xFF) < 0xFE]  # finite, away from overflow
    x = bits.view(np.float32).astype(np.float64)
    lo = bits & np.uint32(0xFFFF0000)  # truncated toward zero
    hi = lo + np.uint32(0x10000)  # next one away from zero
    dlo = np.abs(x - lo.view(np.float32).astype(np.float64))
    dhi = np.abs(x - hi.view(np.float32).astype(np.float64))
    even_is_hi = (hi >> 16) % 2 == 0
    want = np.where((dhi < dlo) | ((dhi == dlo) & even_is_hi), hi >> 16, lo >> 16)
    assert np.array_equal(data.bf16_from_f32(bits.view(np.float32)), want.astype(np.uint16))


def test_fill_is_a_function_of_seed_rank_and_position() -> None:
    for dtype in data.DTYPES:
        a = data.fill(3, 50, dtype, 9)
        assert a.dtype == data.storage(dtype)
        assert np.array_equal(a[20:], data.fill(3, 30, dtype, 9, start=20))
        assert np.array_equal(a, data.fill(3, 50, dtype, 9))
        assert not np.array_equal(a, data.fill(4, 50, dtype, 9))
        assert not np.array_equal(a, data.fill(3, 50, dtype, 10))
    x = data.widen("float32", data.fill(0, 10_000, "float32"))
    assert (np.abs(x) >= 0.5).all() and (np.abs(x) <= 2).all()
    assert 0.2 < (x < 0).mean() < 0.3
    i = data.fill(0, 10_000, "int32")
    assert i.min() < -(1 << 30) and i.max() > (1 << 30)  # the full range: sums wrap


def test_reference_matches_an_independent_computation() -> None:
    n, count = 3, 11
    ins = [data.fill(r, count * n, "float32") for r in range(n)]
    ref = data.reference("allreduce", "sum", n, count * n, "float32")
    assert ref.values.tolist() == [math.fsum(float(v[i]) for v in ins) for i in range(count * n)]
    # int32: numpy's own int32 addition wraps; the reference must agree
    ints = [data.fill(r, count, "int32") for r in range(n)]
    total = ints[0].copy()
    for v in ints[1:]:
        total += v
    ref = data.reference("allreduce", "sum", n, count, "int32")
    assert np.array_equal(ref.values, total.astype(np.int64)) and ref.abs_sum is None
    rs = data.reference("reducescatter", "max", n, count, "float32", rank=2)
    assert np.array_equal(rs.values, np.max(np.stack(ins), axis=0)[2 * count:3 * count])
    a2a = data.reference("alltoall", "sum", n, count, "float32", rank=1)
    assert np.array_equal(a2a.values, np.concatenate([v[count:2 * count] for v in ins]))
    ag = data.reference("allgather", "sum", n, count, "float32")
    assert np.array_equal(ag.values, np.concatenate([v[:count] for v in ins]))


@pytest.mark.parametrize("dtype", data.DTYPES)
def test_the_bound_admits_the_rounded_sum_and_is_not_vacuous(dtype: str) -> None:
    n, count = 8, 500
    ref = data.reference("allreduce", "sum", n, count, dtype)
    best = data.narrow(dtype, ref.values)  # the correctly rounded exact sum
    assert data.wrong(best, ref, dtype, n, "ring") == 0
    bumped = data.widen(dtype, best)
    if ref.abs_sum is None:  # int32: exact, off by one is wrong
        bumped[::7] += 1
    else:
        bound = data.error_bound(dtype, n, "tree") * ref.abs_sum
        bumped[::7] = ref.values[::7] + 3 * bound[::7]
    result = data.narrow(dtype, bumped)
    assert data.wrong(result, ref, dtype, n, "tree") == len(range(0, count, 7))
    if dtype != "int32":  # NaN is never within a bound
        nan = data.narrow(dtype, np.full(count, np.nan))
        assert data.wrong(nan, ref, dtype, n, "ring") == count


def test_bound_is_the_textbook_one() -> None:
    """gamma_k(u) -> k*u; the 16-bit types add float32's rounding per step."""
    assert data.error_bound("float32", 8, "ring") == pytest.approx(7 * 2**-24, rel=1e-6)
    assert data.error_bound("float32", 8, "rhd") == pytest.approx(3 * 2**-24, rel=1e-6)
    assert data.error_bound("bfloat16", 16, "ring") == pytest.approx(15 * (2**-8 + 2**-24),
                                                                      rel=1e-1)
    assert data.error_bound("int32", 16, "ring") == 0
    assert data.error_bound("float16", 1, "ring") == 0  # one rank: an exact copy


def test_max_is_exact() -> None:
    ref = data.reference("allreduce", "max", 4, 100, "bfloat16")
    assert ref.abs_sum is None
    res = data.narrow("bfloat16", ref.values)
    assert data.wrong(res, ref, "bfloat16", 4, "ring") == 0
    res[3] += 1  # one bf16 ulp
    assert data.wrong(res, ref, "bfloat16", 4, "ring") == 1


@pytest.mark.parametrize("alg", ALGORITHMS["allreduce"])
def test_reduction_depth_is_what_the_algorithms_do(monkeypatch: pytest.MonkeyPatch,
                                                   alg: str) -> None:
    """Count roundings: with a 'reduction' that returns max(depths) + 1 on zeros, every
    element ends holding the longest chain of reductions it went through, which the
    error bound's k must cover (ring and rhd exactly)."""
    def deepest(redop: str, dtype: str, acc: np.ndarray, incoming: np.ndarray) -> None:
        np.maximum(acc, incoming, out=acc)
        acc += 1

    monkeypatch.setattr(data, "reduce_into", deepest)
    for n in (1, 2, 3, 5, 6, 7, 8, 12, 16):
        world = LoopbackWorld(n)

        def fn(t: LoopbackTransport) -> int:
            count = 2 * t.size + 1
            recv = np.empty(count, np.int32)
            algorithms.run("allreduce", alg, t, np.zeros(count, np.int32), recv)
            return int(recv.max())

        depth, bound = max(world.run(fn)), data.reduction_depth(alg, n)
        assert depth <= bound, (n, depth, bound)
        if alg != "tree":
            assert depth == bound


# -- trees, sizes, phases, arguments -------------------------------------------------

def test_nccl_btree_picture() -> None:
    """The 14-rank tree drawn in NCCL's trees.cc."""
    want = {0: (-1, (8,)), 8: (0, (4, 12)), 4: (8, (2, 6)), 12: (8, (10, 13)),
            2: (4, (1, 3)), 6: (4, (5, 7)), 10: (12, (9, 11)), 13: (12, ())}
    for rank, (parent, children) in want.items():
        assert btree(14, rank) == algorithms.TreeLinks(parent, children)


@pytest.mark.parametrize("n", range(1, 34))
def test_double_binary_tree_shape(n: int) -> None:
    for t in (0, 1):
        links = [dtree(n, r)[t] for r in range(n)]
        roots = [r for r in range(n) if links[r].parent < 0]
        assert roots == [0 if t == 0 else (1 if n % 2 and n > 1 else n - 1)]
        for r in range(n):
            for c in links[r].children:
                assert links[c].parent == r
            assert len(links[r].children) <= 2
        seen, todo = set(), [roots[0]]
        while todo:  # connected: every rank reached from the root
            r = todo.pop()
            seen.add(r)
            todo += links[r].children
        assert seen == set(range(n))
        depth = max(_height(links, r) for r in range(n))
        assert depth <= max((n - 1).bit_length(), 0)
    leaves = [r for r in range(n) if not dtree(n, r)[0].children or not dtree(n, r)[1].children]
    assert set(leaves) == (set(range(n)) - {0} if n % 2 and n > 1 else set(range(n)))


def _height(links: list[algorithms.TreeLinks], r: int) -> int:
    h = 0
    while links[r].parent >= 0:
        r, h = links[r].parent, h + 1
    return h


def test_sizes_and_bandwidths_follow_nccl_tests() -> None:
    assert ops.size_bytes("allreduce", 1000, 8, "float32") == 4000
    assert ops.size_bytes("broadcast", 1000, 8, "bfloat16") == 2000
    for op in ("reducescatter", "allgather", "alltoall"):
        assert ops.size_bytes(op, 1000, 8, "float32") == 32000
    assert ops.bus_factor("allreduce", 8) == 2 * 7 / 8
    assert ops.bus_factor("broadcast", 8) == 1
    assert ops.bus_factor("allgather", 8) == 7 / 8
    assert ops.algbw("allgather", 1000, 8, "float32", 2.0) == 16000
    assert ops.busbw("allgather", 1000, 8, "float32", 2.0) == 14000
    with pytest.raises(ValueError):
        ops.algbw("allreduce", 1, 2, "float32", 0)


@pytest.mark.parametrize(("op", "alg", "n", "phases"), [
    ("allreduce", "ring", 4, ["reduce_scatter", "all_gather"]),
    ("allreduce", "rhd", 4, ["reduce_scatter", "all_gather"]),
    ("allreduce", "rhd", 5, ["pre_reduce", "reduce_scatter", "all_gather", "post_distribute"]),
    ("allreduce", "tree", 5, ["tree_up", "tree_down"]),
    ("reducescatter", "ring", 3, ["reduce_scatter"]),
    ("allgather", "ring", 3, ["all_gather"]),
    ("broadcast", "ring", 3, ["broadcast"]),
    ("alltoall", "pairwise", 3, ["all_to_all"]),
])
def test_phase_hooks(op: str, alg: str, n: int, phases: list[str]) -> None:
    def fn(t: LoopbackTransport) -> list[str]:
        seen: list[str] = []
        send = data.make_sendbuf(op, t.rank, n, 9, "float32")
        algorithms.run(op, alg, t, send, data.make_recvbuf(op, n, 9, "float32"),
                       on_phase=seen.append)
        return seen

    assert LoopbackWorld(n).run(fn) == [phases] * n


def test_bad_arguments_are_refused() -> None:
    t = LoopbackWorld(2).transport(0)
    f = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="no algorithm 'tree' for 'allgather'"):
        algorithms.run("allgather", "tree", t, f, np.zeros(8, np.float32))
    with pytest.raises(ValueError, match="must be 4 and 8"):
        algorithms.run("allgather", "ring", t, f, np.zeros(7, np.float32))
    with pytest.raises(ValueError, match="must be 8 and 4"):
        algorithms.run("reducescatter", "ring", t, f, f)
    with pytest.raises(ValueError, match="C-contiguous"):
        algorithms.run("allreduce", "ring", t, np.zeros(8, np.float32)[::2], f)
    with pytest.raises(ValueError, match="bfloat16 buffers are uint16"):
        algorithms.run("allreduce", "ring", t, f, f, dtype="bfloat16")
    with pytest.raises(ValueError, match="unknown redop"):
        algorithms.run("allreduce", "ring", t, f, f, redop="prod")
    with pytest.raises(ValueError, match="chunks 0"):
        algorithms.run("allreduce", "ring", t, f, f, chunks=0)


@pytest.mark.parametrize("op", ["allreduce", "reducescatter", "broadcast", "allgather",
                                "alltoall"])
def test_a_reference_block_is_that_slice_of_the_whole(op: str) -> None:
    n, count = 3, 10
    whole = data.reference(op, "sum", n, count, "float32", rank=1, root=2, seed=5)
    for a, b in ((0, 1), (3, 17), (9, 11), (0, whole.values.size)):
        if b > whole.values.size:
            continue
        part = data.reference(op, "sum", n, count, "float32", rank=1, root=2, seed=5,
                              start=a, stop=b)
        assert np.array_equal(part.values, whole.values[a:b])
        if whole.abs_sum is not None:
            assert np.array_equal(part.abs_sum, whole.abs_sum[a:b])


def test_count_wrong_in_blocks_agrees_with_wrong_and_sees_every_block() -> None:
    n, count, dtype = 4, 1000, "float32"
    ref = data.reference("allreduce", "sum", n, count, dtype)
    result = data.narrow(dtype, ref.values)
    result[[0, 499, 500, 999]] += 1.0           # one in each of the first and last block
    calls = []
    got = data.count_wrong(result, "allreduce", "sum", n, count, dtype, "ring", block=500,
                           between=lambda: calls.append(1))
    assert got == data.wrong(result, ref, dtype, n, "ring") == 4
    assert len(calls) == 2
    # a tolerance of its own (the in-network bound) replaces the algorithm's
    assert data.count_wrong(result, "allreduce", "sum", n, count, dtype, "ina", block=300,
                            tolerance=lambda r: 2.0) == 0
