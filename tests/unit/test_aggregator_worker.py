"""The worker side of the in-network all-reduce (agents.collectives.ina): quantisation and
its bound, the window of slots, retransmission over a lossy in-memory network, and the
UDP loop on loopback sockets."""

from __future__ import annotations

import math
import socket
import threading

import numpy as np
import pytest

from agents.aggregator.logic import Aggregator, Contributor, JobConfig
from agents.collectives.ina import (
    InaError,
    InaJob,
    InaWorker,
    allreduce_ina,
    dequantise,
    exponent_proposal,
    open_socket,
    quantisation_bound,
    quantise,
    result_bound,
    scale_exponent,
)
from agents.timebase import Dilation
from agents.wire.ina import AGGREGATOR, EXP_NONE, Header, PacketType, build
from tests.unit.ina_sim import Net

AGG = ("10.0.1.1", 48000)


def _addr(w: int) -> tuple[str, int]:
    return (f"10.0.0.{w + 10}", 47000 + w)


def _data(dtype, n: int, size: int, seed: int = 0, scale: float = 1.0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if np.dtype(dtype) == np.int32:
        return [rng.integers(-(1 << 31), 1 << 31, size=size).astype(np.int32)
                for _ in range(n)]
    return [(rng.standard_normal(size) * scale).astype(dtype) for _ in range(n)]


def _run(xs: list[np.ndarray], *, slots: int = 8, elements: int = 64, loss: float = 0.0,
         seed: int = 0, timeout_ns: float = 20_000, chunk_base: int = 0, agg=None,
         outs=None):
    n = len(xs)
    job = JobConfig(id=3, members=tuple(Contributor(w, *_addr(w)) for w in range(n)),
                    slots=slots, slot_elements=elements)
    agg = agg or Aggregator([job], lambda: 0.0)
    ina = InaJob(job_id=3, workers=n, slots=slots, slot_elements=elements)
    outs = outs or [np.full_like(x, 7) for x in xs]
    workers = {_addr(w): (InaWorker(ina, w, xs[w], outs[w], aggregator=AGG,
                                    timeout_ns=timeout_ns, chunk_base=chunk_base), AGG)
               for w in range(n)}
    net = Net({AGG: agg}, workers, loss=loss, seed=seed)
    net.run()
    return net, agg, outs, [workers[_addr(w)][0] for w in range(n)]


def _check_within_bound(xs, outs, ws, elements):
    """Every element of every worker's result within the stated bound of the exact sum."""
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    n = len(xs)
    worst = 0.0
    for out, w in zip(outs, ws, strict=True):
        assert np.array_equal(out, outs[0])                 # all workers: the same bits
        for d in range(w.K):
            sl = slice(d * elements, (d + 1) * elements)
            agreed = w.agreed[d]
            assert agreed == max(exponent_proposal(x[sl]) for x in xs)
            bound = result_bound(agreed, n, out[sl])
            err = np.abs(out[sl].astype(np.float64) - exact[sl])
            # the float64 reference itself may be off by n ulps of float64
            assert np.all(err <= bound + 1e-15 * np.abs(exact[sl])), (d, err.max())
            worst = max(worst, float(np.max(err / np.maximum(bound, 1e-300))))
    return worst


# --------------------------------------------------------------------------- quantisation


def test_exponent_proposal_brackets_the_max():
    for m in (1e-40, 0.3, 0.5, 1.0, 1.5, 65504.0, 3e38):
        e = exponent_proposal(np.array([0.0, -m, m / 3]))
        assert 2.0 ** (e - 1) <= m < 2.0 ** e
    assert exponent_proposal(np.zeros(5)) == EXP_NONE
    assert exponent_proposal(np.zeros(0)) == EXP_NONE


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 9, 16, 33, 64, 65, 1000])
def test_the_worst_case_sum_of_n_workers_never_leaves_int32(n):
    """Every worker at the largest value below 2^E: each q is 2^(31-c), and n of them
    stay below 2^31 because n < 2^c (c = n.bit_length())."""
    E = 5
    x = np.array([np.nextafter(2.0 ** E, 0), -np.nextafter(2.0 ** E, 0)])
    e = scale_exponent(E, n)
    q = quantise(x, e).astype(np.int64)
    assert q.tolist() == [2 ** (31 - n.bit_length()), -2 ** (31 - n.bit_length())]
    assert n * q[0] <= 2 ** 31 - 1 and n * q[1] >= -2 ** 31


@pytest.mark.parametrize("n", [1, 2, 3, 8, 13])
def test_quantisation_error_is_within_n_times_half_a_step(n):
    rng = np.random.default_rng(n)
    xs = [rng.standard_normal(4096) * 10.0 ** rng.integers(-6, 6) for _ in range(n)]
    E = max(exponent_proposal(x) for x in xs)
    e = scale_exponent(E, n)
    qsum = np.sum([quantise(x, e).astype(np.int64) for x in xs], axis=0)
    assert np.all(np.abs(qsum) < 2 ** 31)
    err = np.abs(dequantise(qsum, e, np.dtype(np.float64)) - np.sum(xs, axis=0))
    bound = quantisation_bound(E, n)
    assert bound == n * 2.0 ** (E + n.bit_length() - 32) <= n * n * 2.0 ** (E - 31)
    assert np.all(err <= bound * (1 + 1e-12))
    assert err.max() > bound / 20                   # and the bound is not loose by orders


# --------------------------------------------------------------------------- state machine


@pytest.mark.parametrize("dtype, loss, seed", [
    (np.float32, 0.0, 0), (np.float32, 0.01, 1), (np.float32, 0.05, 2),
    (np.float16, 0.03, 3), (np.float64, 0.02, 4), (np.int32, 0.0, 5), (np.int32, 0.04, 6),
])
def test_three_workers_over_a_lossy_network(dtype, loss, seed):
    xs = _data(dtype, 3, 64 * 50 + 17, seed=seed)
    net, agg, outs, ws = _run(xs, slots=8, elements=64, loss=loss, seed=seed)
    if dtype == np.int32:
        expect = xs[0] + xs[1] + xs[2]
        assert all(np.array_equal(o, expect) for o in outs)    # exact, modulo 2^32
    else:
        _check_within_bound(xs, outs, ws, 64)
    retx = sum(w.c.retransmissions for w in ws)
    if loss:
        assert net.lost > 0 and retx > 0 and sum(w.c.timeouts for w in ws) > 0
        assert agg.counters()["shadow_answers"] > 0 or agg.counters()["duplicates"] > 0
    else:
        assert retx == 0 and agg.counters()["duplicates"] == 0
    chunks = 51 + (8 if dtype != np.int32 else 0)           # + one exponent-only window
    assert all(w.c.chunks == chunks and w.c.results == chunks for w in ws)
    c = agg.counters()
    assert c["completed"] == chunks
    if dtype != np.int32:
        assert c["overflow_elements"] == 0          # the quantisation leaves headroom
    # a late duplicate of a chunk whose copy moved on is the only drop loss can cause
    assert {k for k, v in c["drops"].items() if v} <= {"stale"}


def test_float16_with_large_magnitudes_and_subnormals_stays_within_the_bound():
    rng = np.random.default_rng(11)
    xs = [rng.standard_normal(2000).astype(np.float16) * 1000 for _ in range(3)]
    xs[1][:500] = (rng.standard_normal(500) * 1e-6).astype(np.float16)   # subnormal region
    xs[2][:64] = 0
    net, agg, outs, ws = _run(xs, slots=4, elements=100, loss=0.02, seed=11)
    _check_within_bound(xs, outs, ws, 100)


def test_mixed_magnitudes_and_all_zero_chunks():
    xs = _data(np.float32, 3, 640, seed=3)
    xs[0] *= 1e6
    xs[1] *= 1e-6
    for x in xs:
        x[64:192] = 0                                      # chunks 1 and 2 are all zero
    net, agg, outs, ws = _run(xs, slots=4, elements=64)
    _check_within_bound(xs, outs, ws, 64)
    assert ws[0].agreed[1] == EXP_NONE and np.all(outs[0][64:192] == 0)


def test_the_window_never_holds_more_chunks_than_slots():
    xs = _data(np.float32, 3, 64 * 30, seed=1)
    S = 5
    n = len(xs)
    job = JobConfig(id=3, members=tuple(Contributor(w, *_addr(w)) for w in range(n)),
                    slots=S, slot_elements=64)
    agg = Aggregator([job], lambda: 0.0)
    ina = InaJob(job_id=3, workers=n, slots=S, slot_elements=64)
    outs = [np.zeros_like(x) for x in xs]
    ws = [InaWorker(ina, w, xs[w], outs[w], aggregator=AGG) for w in range(n)]
    first = ws[0].poll(0.0)
    assert len(first) == S                              # the exponent-only window
    peak = 0
    pending = [(w, d) for d in first for w in (0,)] + [(w, d) for w in (1, 2)
                                                       for d in ws[w].poll(0.0)]
    while pending:
        w, data = pending.pop(0)
        for out, to in agg.handle(data, _addr(w)):
            v = next(i for i in range(n) if _addr(i) == to)
            ws[v].on_datagram(out, AGG)
            pending += [(v, d) for d in ws[v].poll(0.0)]
            peak = max(peak, *(len(x.outstanding) for x in ws))
    assert all(x.done for x in ws) and peak <= S
    _check_within_bound(xs, outs, ws, 64)


def test_consecutive_all_reduces_continue_the_chunk_numbers():
    xs = _data(np.float32, 3, 64 * 3 + 5, seed=4)          # 4 chunks < 8 slots
    net, agg, outs, ws = _run(xs, slots=8, elements=64)
    base = ws[0].c.next_chunk_base
    assert base == 8 + 4 and all(w.c.next_chunk_base == base for w in ws)
    ys = _data(np.float32, 3, 64 * 20, seed=5)
    net2, _, outs2, ws2 = _run(ys, slots=8, elements=64, chunk_base=base, agg=agg, loss=0.03,
                               seed=9)
    _check_within_bound(ys, outs2, ws2, 64)
    c = agg.counters()
    # 4 exponent-only + 4 data chunks, then 8 + 20
    assert c["completed"] == 8 + 28 and c["drops"]["slot_busy"] == 0


def test_a_worker_counts_what_is_not_its_result():
    xs = _data(np.float32, 1, 64)
    out = np.zeros_like(xs[0])
    ina = InaJob(job_id=3, workers=1, slots=2, slot_elements=64)
    w = InaWorker(ina, 0, xs[0], out, aggregator=AGG, chunk_base=100)
    (first,) = w.poll(0.0)                         # one data chunk: one exponent-only first
    assert w.on_datagram(b"junk", AGG) is False
    res = build(Header(PacketType.RESULT, 3, 100, 0, 0, AGGREGATOR, next_exp=1, bitmap=1), b"")
    assert w.on_datagram(res, ("10.9.9.9", 48000)) is False           # not the aggregator
    assert w.on_datagram(first, AGG) is False                         # a REQUEST
    old = build(Header(PacketType.RESULT, 3, 99, 1, 1, AGGREGATOR, bitmap=1), b"")
    assert w.on_datagram(old, AGG) is False                           # an older call's
    wrong = build(Header(PacketType.RESULT, 3, 100, 0, 0, AGGREGATOR, bitmap=1),
                  np.zeros(3, np.int32))
    assert w.on_datagram(wrong, AGG) is False                         # not the chunk's size
    assert w.on_datagram(res, AGG) is True
    assert w.on_datagram(res, AGG) is False
    c = w.c
    assert (c.malformed["TOO_SHORT"], c.foreign, c.stale_results, c.bad_results,
            c.duplicate_results, c.results) == (1, 2, 1, 1, 1, 1)


def test_an_unanswered_chunk_gives_up_after_its_retries():
    ina = InaJob(job_id=3, workers=2, slots=2, slot_elements=4)
    x = np.ones(8, np.int32)
    w = InaWorker(ina, 0, x, np.zeros_like(x), timeout_ns=100, max_retries=3)
    assert len(w.poll(0)) == 2
    assert w.poll(99) == []
    t = 100.0
    with pytest.raises(InaError, match="unanswered after 3"):
        for _ in range(10):
            w.poll(t)
            t += 100
    assert w.c.retransmissions == 6 and w.c.timeouts == 3


@pytest.mark.parametrize("kwargs, match", [
    ({"sendbuf": np.array([1.0, np.nan], np.float32)}, "NaN"),
    ({"sendbuf": np.array([1.0, np.inf], np.float32)}, "NaN"),
    ({"sendbuf": np.zeros(2, np.int64), "recvbuf": np.zeros(2, np.int64)}, "int32"),
    ({"recvbuf": np.zeros(3, np.float32)}, "one dtype and length"),
    ({"recvbuf": np.zeros(2, np.float64)}, "one dtype and length"),
    ({"worker_id": 0xFFFF}, "worker id"),
])
def test_the_worker_refuses_what_it_cannot_sum(kwargs, match):
    args = {"sendbuf": np.zeros(2, np.float32), "recvbuf": np.zeros(2, np.float32),
            "worker_id": 0, **kwargs}
    with pytest.raises(ValueError, match=match):
        InaWorker(InaJob(1, 2, 2, 2), args["worker_id"], args["sendbuf"], args["recvbuf"])


def test_in_place_all_reduce():
    xs = _data(np.float32, 3, 64 * 9, seed=8)
    copies = [x.copy() for x in xs]
    net, agg, outs, ws = _run(copies, slots=4, elements=64, outs=copies, loss=0.02, seed=8)
    assert all(o is c for o, c in zip(outs, copies, strict=True))
    _check_within_bound(xs, outs, ws, 64)


# --------------------------------------------------------------------------- the UDP loop


def _serve(agg: Aggregator, sock: socket.socket, stop: threading.Event, drop_every: int = 0):
    n = 0
    sock.settimeout(0.05)
    while not stop.is_set():
        try:
            data, src = sock.recvfrom(65536)
        except TimeoutError:
            continue
        for out, to in agg.handle(data, src):
            n += 1
            if drop_every and n % drop_every == 0:
                continue                                   # lose every k-th datagram sent
            sock.sendto(out, to)


@pytest.mark.parametrize("drop_every", [0, 37])
def test_allreduce_ina_over_loopback_udp(drop_every):
    n, size, S, E = 3, 10_000, 8, 256
    socks = [open_socket("127.0.0.1") for _ in range(n)]
    agg_sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    agg_sock.bind(("127.0.0.1", 0))
    agg_addr = agg_sock.getsockname()
    job = JobConfig(id=9, members=tuple(Contributor(w, *s.getsockname())
                                        for w, s in enumerate(socks)),
                    slots=S, slot_elements=E)
    agg = Aggregator([job], lambda: 0.0)
    stop = threading.Event()
    server = threading.Thread(target=_serve, args=(agg, agg_sock, stop, drop_every))
    server.start()
    xs = _data(np.float32, n, size, seed=2)
    outs = [np.zeros_like(x) for x in xs]
    stats: list = [None] * n
    errors: list = []

    def work(w: int) -> None:
        try:
            stats[w] = allreduce_ina(socks[w], agg_addr, InaJob(9, n, S, E), w, xs[w], outs[w],
                                     dilation=Dilation(1), timeout_ns=20_000_000)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=work, args=(w,)) for w in range(n)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        stop.set()
        server.join()
        for s in (*socks, agg_sock):
            s.close()
    assert not errors and all(s is not None for s in stats)
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    assert np.max(np.abs(outs[0] - exact)) < 1e-5 * math.sqrt(n)
    assert all(np.array_equal(o, outs[0]) for o in outs)
    chunks = math.ceil(size / E) + S
    assert all(s.results == chunks and s.packets_sent >= chunks for s in stats)
    assert all(s.bytes_sent >= 4 * size for s in stats)
    if drop_every:
        assert sum(s.retransmissions for s in stats) > 0
    assert all(s.next_chunk_base == chunks for s in stats)


def test_the_aggregation_socket_serves_the_roce_engine_at_most_every_millisecond() -> None:
    """Between results the rank's RoCE engine is stepped (a peer's retransmitted barrier
    message still gets its ACK), but not per datagram: once per SERVICE_WALL_NS."""
    import socket as socketlib
    from types import SimpleNamespace

    from agents.collectives.__main__ import SERVICE_WALL_NS, ServicedPort
    from agents.runtime.lifecycle import Lifecycle

    steps = []
    engine = SimpleNamespace(step=lambda: steps.append(1) and False)
    t = SimpleNamespace(engine=engine, reap=lambda: False)
    now = [10**9]
    sock = socketlib.socket(socketlib.AF_INET, socketlib.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sender = socketlib.socket(socketlib.AF_INET, socketlib.SOCK_DGRAM)
    try:
        port = ServicedPort(sock, Lifecycle(), t, wall_ns=lambda: now[0])
        for _ in range(50):
            sender.sendto(b"x", sock.getsockname())
            assert port.recv(10**8) is not None
        assert len(steps) == 1
        now[0] += SERVICE_WALL_NS
        sender.sendto(b"x", sock.getsockname())
        port.recv(10**8)
        assert len(steps) == 2 and port.services == 2
    finally:
        sock.close()
        sender.close()
