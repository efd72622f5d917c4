"""The collectives' RoCE transport (agents.collectives.roce) and worker, without root.

Framing, matching and QP spreading are pure (`Messages`, wired back to back here);
then two ranks in threads over real QPs on 127.0.0.1 (the data as RDMA WRITEs with
immediate into landing rings: the packets on the wire, ring reuse, RNR under a slow
receiver, loss), and three worker processes (`python -m agents.collectives`) on
127.0.0.1 running the test stand-in algorithms (tests/collective_stub.py), as a fabric
run would but without namespaces.
"""

from __future__ import annotations

import json
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import numpy as np
import pytest
from scapy.contrib.roce import BTH as ScapyBTH
from scapy.contrib.roce import _bth_opcodes as scapy_opcode_names

from agents.collectives import sweep
from agents.collectives.__main__ import (
    build_parser,
    check_algorithm,
    check_args,
    module_op,
)
from agents.collectives.roce import (
    HEADER,
    HEADER_BYTES,
    MAX_SLOTS,
    PROTOCOL_VERSION,
    Messages,
    PeerAddress,
    RoceConfig,
    RoceTransport,
    SetupError,
    TransportError,
    chunk_spans,
    connect,
    parse_peers,
    recv_depth,
    slot_imm,
)
from agents.rdma.qp import WC_RECV, WC_RECV_RDMA_WITH_IMM, Completion, QpAttrs, WcStatus
from agents.runtime.control import read_snapshot
from agents.wire.roce import Opcode, icrc_context, parse_packet
from tests import collective_stub
from tests.conftest import REPO

LOOPBACK = "127.0.0.1"


# --------------------------------------------------------------------------- pure parts


def test_chunk_spans_cover_the_message_and_an_empty_message_is_one_chunk():
    assert chunk_spans(0, 10) == [(0, 0)]
    assert chunk_spans(10, 10) == [(0, 10)]
    assert chunk_spans(25, 10) == [(0, 10), (10, 10), (20, 5)]
    for n in (1, 9, 11, 1000, 65521):
        spans = chunk_spans(n, 7)
        assert sum(ln for _, ln in spans) == n
        assert all(off == i * 7 for i, (off, _) in enumerate(spans))
    with pytest.raises(ValueError):
        chunk_spans(5, 0)


def test_parse_peers():
    peers = parse_peers("10.0.0.1:18600:4791, 10.0.0.2:18601:4792")
    assert peers == [PeerAddress("10.0.0.1", 18600, 4791), PeerAddress("10.0.0.2", 18601, 4792)]
    for bad in ("10.0.0.1:18600", "host:1:2", "10.0.0.1:0:4791", "10.0.0.1:1:2,10.0.0.1:1:2"):
        with pytest.raises(ValueError):
            parse_peers(bad)


def test_recv_depth_covers_what_one_engine_step_can_land_and_is_bounded():
    # 64 datagrams a step: 4 chunks of 16 packets, + the one in progress, + 1
    assert recv_depth(QpAttrs(), 65536) == 6
    assert recv_depth(QpAttrs(mtu=1024), 1024) == 64 + 2
    assert recv_depth(QpAttrs(), 1 << 20) == 4
    assert recv_depth(QpAttrs(), 32 << 20) * (32 << 20) <= 64 << 20
    assert recv_depth(QpAttrs(mtu=256), HEADER_BYTES + 1) <= MAX_SLOTS


def test_the_immediate_names_the_chunk_and_its_slot():
    assert slot_imm(0, 6) == 0 and slot_imm(5, 6) == 5 << 16 | 5
    assert slot_imm(6, 6) == 6 << 16 | 0 and slot_imm(13, 6) == 13 << 16 | 1
    assert slot_imm(0x10000 + 7, 4) == 7 << 16 | 3       # the chunk number wraps at 2^16
    assert all(slot_imm(n, 66) >> 16 == n & 0xFFFF and slot_imm(n, 66) & 0xFFFF == n % 66
               for n in range(0, 300_000, 997))


def _pair(qps: int = 3, chunk_bytes: int = HEADER_BYTES + 7) -> tuple[Messages, Messages]:
    return Messages(0, 2, qps, chunk_bytes), Messages(1, 2, qps, chunk_bytes)


def _frames(m: Messages, peer: int, tag: int, data: np.ndarray) -> list[tuple[int, np.ndarray]]:
    return list(m.frame(peer, tag, data))


def _interleave(per_qp: dict[int, list[np.ndarray]], rng: random.Random) -> list[np.ndarray]:
    """Every QP's chunks in their own order, the QPs interleaved at random (as they land)."""
    queues = {q: list(c) for q, c in per_qp.items() if c}
    out = []
    while queues:
        q = rng.choice(sorted(queues))
        out.append(queues[q].pop(0))
        if not queues[q]:
            del queues[q]
    return out


def test_chunks_are_spread_over_the_qps_in_turn_across_messages():
    a, _ = _pair(qps=3)
    qs = [q for q, _ in _frames(a, 1, 0, np.arange(20, dtype=np.uint8))]    # 3 chunks of 7
    qs += [q for q, _ in _frames(a, 1, 5, np.zeros(0, dtype=np.uint8))]     # 1 empty chunk
    qs += [q for q, _ in _frames(a, 1, 0, np.arange(8, dtype=np.uint8))]    # 2 chunks
    assert qs == [0, 1, 2, 0, 1, 2]
    c = a.peers[1]
    assert (c.messages_sent, c.chunks_posted, c.bytes_posted) == (3, 6, 28)


def test_same_tag_messages_keep_their_order_across_qps_and_tags_are_apart():
    rng = random.Random(3)
    a, b = _pair(qps=3)
    sent = {}
    per_qp: dict[int, list[np.ndarray]] = {0: [], 1: [], 2: []}
    for i, (tag, n) in enumerate([(1, 30), (1, 5), (2, 17), (1, 0), (2, 40), (1, 22)]):
        data = np.arange(i * 100, i * 100 + n, dtype=np.int32).astype(np.uint8)
        sent.setdefault(tag, []).append(data.copy())
        for q, chunk in _frames(a, 1, tag, data):
            per_qp[q].append(chunk)
            data[:] = 0          # the buffer may be reused at once: chunks are copies
    landed = _interleave(per_qp, rng)
    # tag 2's first message is waited for before anything lands, the rest come first
    first2 = np.empty(17, dtype=np.uint8)
    key = b.expect(0, 2, first2)
    half = len(landed) // 2
    for chunk in landed[:half]:
        b.deliver(0, chunk)
    got: dict[int, list[np.ndarray]] = {1: [], 2: []}
    for chunk in landed[half:]:
        b.deliver(0, chunk)
    assert b.complete(key)
    b.take(key)
    got[2].append(first2)
    for tag, msgs in sent.items():
        for want in msgs[len(got[tag]):]:
            out = np.full(want.size, 0xEE, dtype=np.uint8)
            k = b.expect(0, tag, out)
            assert b.complete(k)
            b.take(k)
            got[tag].append(out)
    for tag, msgs in sent.items():
        assert [m.tolist() for m in got[tag]] == [m.tolist() for m in msgs]
    assert b.pending == 0
    c = b.peers[0]
    assert c.messages_received == 6 and c.bytes_received == 30 + 5 + 17 + 0 + 40 + 22
    assert c.unexpected_chunks > 0


def test_a_message_received_into_a_typed_buffer_is_its_bytes():
    a, b = _pair(qps=2, chunk_bytes=HEADER_BYTES + 64)
    data = np.linspace(-1, 1, 1001, dtype=np.float32)
    for _, chunk in _frames(a, 1, 9, data):
        b.deliver(0, chunk)
    out = np.empty_like(data)
    k = b.expect(0, 9, out)
    assert b.complete(k)
    assert np.array_equal(out, data)


def test_length_mismatch_and_a_headerless_chunk_are_transport_errors():
    a, b = _pair()
    for _, chunk in _frames(a, 1, 0, np.zeros(10, dtype=np.uint8)):
        b.deliver(0, chunk)
    with pytest.raises(TransportError, match="recv of 11 bytes"):
        b.expect(0, 0, np.zeros(11, dtype=np.uint8))
    with pytest.raises(TransportError, match="no header"):
        b.deliver(0, np.zeros(HEADER_BYTES - 1, dtype=np.uint8))
    out = np.zeros(4, dtype=np.uint8)
    b.expect(0, 3, out)
    (_, chunk), = _frames(a, 1, 3, np.zeros(5, dtype=np.uint8))
    with pytest.raises(TransportError, match="5-byte message"):
        b.deliver(0, chunk)


def test_bad_peers_tags_and_buffers_are_refused():
    a, _ = _pair()
    with pytest.raises(ValueError):
        _frames(a, 0, 0, np.zeros(1, dtype=np.uint8))     # to itself
    with pytest.raises(ValueError):
        _frames(a, 2, 0, np.zeros(1, dtype=np.uint8))     # no such rank
    with pytest.raises(ValueError):
        _frames(a, 1, -1, np.zeros(1, dtype=np.uint8))
    with pytest.raises(ValueError):
        _frames(a, 1, 0, np.zeros((4, 4), dtype=np.uint8)[:, 1])   # not contiguous
    with pytest.raises(ValueError):
        Messages(0, 2, 9, 1024)
    with pytest.raises(ValueError):
        Messages(0, 2, 1, HEADER_BYTES)


def test_sweep_sizes_counts_and_statistics():
    assert sweep.sizes(1024, 1024, 2) == [1024]
    assert sweep.sizes(1000, 1 << 20, 32) == [1000, 32000, 1024000]
    assert sweep.sizes(8, 64, 2) == [8, 16, 32, 64]
    with pytest.raises(ValueError):
        sweep.sizes(8, 64, 1)
    assert sweep.param_count("allreduce", 1 << 20, 3, 4) == 1 << 18
    assert sweep.param_count("allgather", 1 << 20, 4, 4) == 1 << 16
    assert sweep.param_count("alltoall", 1000, 3, 4) == 83
    assert sweep.bus_factor("allreduce", 4) == 1.5
    s = sweep.summary([5.0, 1.0, 3.0, 2.0])
    assert s == {"min_us": 1.0, "avg_us": 2.75, "p50_us": 2.0, "p99_us": 5.0}
    assert sweep.summary([])["avg_us"] is None


def test_phase_clock_splits_an_operation_by_the_algorithms_marks():
    now = [0.0]
    clock = sweep.PhaseClock(lambda: now[0])
    now[0] = 100.0
    clock.mark("reduce_scatter")
    now[0] = 400.0
    clock.mark("all_gather", "extra", "args")
    now[0] = 450.0
    clock.mark("reduce_scatter")
    now[0] = 500.0
    clock.end()
    assert clock.ns == {"reduce_scatter": 350.0, "all_gather": 50.0}
    assert sweep.mean_phases_us([clock.ns, {"all_gather": 150.0}]) == {
        "reduce_scatter": 0.175, "all_gather": 0.1}


def test_worker_arguments():
    parser = build_parser()
    base = ["--peers", "10.0.0.1:1:2,10.0.0.2:1:2,10.0.0.3:1:2"]
    assert check_args(parser.parse_args(["--rank", "2", *base])) is None
    assert "not one of the 3" in check_args(parser.parse_args(["--rank", "3", *base]))
    assert "--root" in check_args(parser.parse_args(["--rank", "0", "--root", "5", *base]))
    assert "factor" in check_args(parser.parse_args(["--rank", "0", "--factor", "1", *base]))
    assert "header" in check_args(parser.parse_args(["--rank", "0", "--chunk-bytes", "16",
                                                     *base]))
    assert "DCQCN preset" in check_args(parser.parse_args(["--rank", "0", "--cc-preset", "x",
                                                           *base]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--rank", "0", "--qps", "9", *base])
    args = parser.parse_args(["--rank", "0", "--op", "alltoall", *base])
    assert check_args(args) is None and args.algorithm == "pairwise"
    args = parser.parse_args(["--rank", "0", *base])
    assert check_args(args) is None and args.algorithm == "ring"


def test_the_algorithms_modules_names_and_table_are_followed():
    assert module_op(collective_stub, "allreduce") == "allreduce"
    assert module_op(sweep, "allreduce") == "allreduce"      # a module with no table
    snake = types.SimpleNamespace(OPS=("all_reduce", "all_to_all"))
    assert module_op(snake, "alltoall") == "all_to_all"      # a module naming them so
    check_algorithm(collective_stub, "alltoall", "pairwise")
    with pytest.raises(SetupError, match="no algorithm 'rhd' for allreduce: ring, tree"):
        check_algorithm(collective_stub, "allreduce", "rhd")


# --------------------------------------------------------------------------- over loopback


def _free_ports(n: int, kind: int) -> list[int]:
    socks = [socket.socket(socket.AF_INET, kind) for _ in range(n)]
    try:
        for s in socks:
            s.bind((LOOPBACK, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _peers(n: int) -> list[PeerAddress]:
    tcp = _free_ports(n, socket.SOCK_STREAM)
    udp = _free_ports(n, socket.SOCK_DGRAM)
    return [PeerAddress(LOOPBACK, tcp[i], udp[i]) for i in range(n)]


def _rdma_args(*argv: str):
    return build_parser().parse_args(["--rank", "0", "--peers", "1.1.1.1:1:1", *argv])


def test_two_ranks_in_threads_over_real_qps_on_loopback():
    peers = _peers(2)
    args = _rdma_args("--line-rate-bps", "2e9", "--timeout-ns", "1e9", "--spin-ns", "0",
                      "--mtu", "1024")
    config = RoceConfig(args=args, qps=3, chunk_bytes=4096, connect_timeout_s=20)
    transports: list[RoceTransport | None] = [None, None]
    errors: list[BaseException] = []
    results: dict[int, list[np.ndarray]] = {}

    def rank(r: int) -> None:
        try:
            t = connect(r, peers, config)
            transports[r] = t
            other = 1 - r
            msgs = [np.arange(n, dtype=np.float32) + r for n in (0, 1, 1023, 50_000)]
            for i, m in enumerate(msgs):
                t.send(other, i % 2, m)        # two tags, two messages each
            got = []
            for i in (1, 3, 0, 2):             # a tag's messages in order, tags any order
                out = np.empty(msgs[i].size, dtype=np.float32)
                t.recv(other, i % 2, out)
                got.append(out)
            t.wait_sends()
            collective_stub.ring_allreduce(t, np.full(10_001, r + 1, dtype=np.int32),
                                           out := np.empty(10_001, dtype=np.int32))
            got.append(out)
            results[r] = got
        except BaseException as e:   # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
    finally:
        for t in transports:
            if t is not None:
                t.close()
    assert not errors, errors
    for r in (0, 1):
        other = 1 - r
        sizes = (1, 50_000, 0, 1023)
        for out, n in zip(results[r][:4], sizes, strict=True):
            assert np.array_equal(out, np.arange(n, dtype=np.float32) + other)
        assert np.array_equal(results[r][4], np.full(10_001, 3, dtype=np.int32))
    t0, t1 = transports
    assert t0 is not None and t1 is not None
    c0, c1 = t0.counters(), t1.counters()
    assert c0["bytes_sent"] == c1["bytes_received"] and c1["bytes_sent"] == c0["bytes_received"]
    assert c0["per_peer"]["1"]["messages_sent"] == 4 + 2   # + the ring's two steps
    assert len(c0["per_peer"]["1"]["qps"]) == 3
    # every QP carried some of it
    assert all(q["requester"]["packets_sent"] > 0 for q in c0["per_peer"]["1"]["qps"].values())


class _Tap:
    """Stands in for an endpoint's socket and keeps a copy of the first `keep` datagrams
    it receives, with their source address (a capture inside the process: no root)."""

    def __init__(self, sock: socket.socket, keep: int) -> None:
        self._sock = sock
        self.keep = keep
        self.got: list[tuple[bytes, tuple[str, int]]] = []

    def recvmsg_into(self, buffers, *args):
        res = self._sock.recvmsg_into(buffers, *args)
        if len(self.got) < self.keep:
            self.got.append((bytes(memoryview(buffers[0])[:res[0]]), res[3]))
        return res

    def __getattr__(self, name: str):
        return getattr(self._sock, name)


def _two_ranks(config: RoceConfig, body, timeout_s: float = 120):
    """Ranks 0 and 1 in threads: connect, then body(rank, transport) -> result.
    Returns (transports, results); the transports are closed, their counters kept."""
    peers = _peers(2)
    transports: list[RoceTransport | None] = [None, None]
    errors: list[BaseException] = []
    results: dict[int, object] = {}

    def rank(r: int) -> None:
        try:
            t = connect(r, peers, config)
            transports[r] = t
            results[r] = body(r, t)
        except BaseException as e:   # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout_s)
    finally:
        for t in transports:
            if t is not None:
                t.close()
    assert not errors, errors
    assert not any(th.is_alive() for th in threads)
    return transports, results


def _finish(t: RoceTransport, other: int) -> None:
    """Leave together: a last message each way, so the final ACKs have gone out."""
    t.wait_sends()
    t.send(other, 99, np.zeros(1, dtype=np.uint8))
    t.recv(other, 99, np.empty(1, dtype=np.uint8))
    t.wait_sends()


def _messages(r: int, sizes: list[int]) -> list[np.ndarray]:
    return [np.random.default_rng(r * 100 + i).integers(0, 256, n, dtype=np.uint8)
            for i, n in enumerate(sizes)]


def test_the_data_goes_on_the_wire_as_rdma_writes_with_immediate_into_the_ring():
    # chunks of 4 packets: FIRST, MIDDLE, MIDDLE, LAST WITH IMMEDIATE; a small message
    # is one ONLY WITH IMMEDIATE; no SEND opcode anywhere
    args = _rdma_args("--line-rate-bps", "2e9", "--timeout-ns", "1e9", "--spin-ns", "0",
                      "--mtu", "1024")
    config = RoceConfig(args=args, qps=2, chunk_bytes=4096, connect_timeout_s=20)
    sizes = [10_000, 100, 5000]
    taps: dict[int, _Tap] = {}

    def body(r: int, t: RoceTransport):
        tap = taps[r] = _Tap(t.endpoint.sock, keep=200)
        t.endpoint.sock = tap
        t.endpoint.disable_fast_path("the test taps recvmsg_into")   # C would read the fd
        if r == 0:
            for i, m in enumerate(_messages(0, sizes)):
                t.send(1, i, m)
        else:
            outs = [np.empty(n, dtype=np.uint8) for n in sizes]
            for i, out in enumerate(outs):
                t.recv(0, i, out)
            assert all(np.array_equal(o, m) for o, m in zip(outs, _messages(0, sizes),
                                                             strict=True))
        _finish(t, 1 - r)
        return None
    (t0, t1), _ = _two_ranks(config, body)
    assert t0 is not None and t1 is not None
    # what rank 1 received from rank 0: parse every datagram (ICRC checked) and dissect
    # it with scapy (the BTH as the UDP payload: the ports are not 4791 here)
    rings = {q.qp.qpn: q for q in t1._qps}
    ops = []
    chunks_per_qp: dict[int, int] = {}
    for data, (src, sport) in taps[1].got:
        p = parse_packet(data, icrc_context(src, LOOPBACK, sport, t1.endpoint.port))
        b = ScapyBTH(data)
        assert (b.opcode, b.dqpn, b.psn) == (p.bth.opcode, p.bth.dest_qp, p.bth.psn)
        if p.bth.opcode == Opcode.RC_ACKNOWLEDGE:
            continue
        ops.append(scapy_opcode_names[b.opcode])
        q = rings[p.bth.dest_qp]
        if p.reth is not None:            # FIRST / ONLY: into a slot of this QP's ring
            va, rkey, length = p.reth
            assert rkey == next(iter(q.qp.responder.mrs))
            off = va - q.ring.ctypes.data
            assert off % config.chunk_bytes == 0 and 0 <= off < q.slots * config.chunk_bytes
            assert length <= config.chunk_bytes
        if p.imm is not None:             # LAST / ONLY WITH IMMEDIATE: chunk n, slot n % slots
            n = chunks_per_qp.get(p.bth.dest_qp, 0)
            chunks_per_qp[p.bth.dest_qp] = n + 1
            assert p.imm == slot_imm(n, q.slots)
    assert set(ops) == {"RC_RDMA_WRITE_FIRST", "RC_RDMA_WRITE_MIDDLE",
                        "RC_RDMA_WRITE_LAST_WITH_IMMEDIATE",
                        "RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE"}, ops
    # 10 000 B is 3 chunks (4080 data bytes each), 100 B one, 5000 B two; + the farewell
    assert sum(chunks_per_qp.values()) == 3 + 1 + 2 + 1
    c0 = t0.counters()["per_peer"]["1"]
    assert all(q["responder"]["send_messages"] == 0 for q in c0["qps"].values())


def test_the_landing_ring_is_reused_over_many_more_chunks_than_slots():
    args = _rdma_args("--line-rate-bps", "2e9", "--timeout-ns", "1e9", "--spin-ns", "0",
                      "--mtu", "1024")
    config = RoceConfig(args=args, qps=2, chunk_bytes=4096, connect_timeout_s=20)
    sizes = [1_000_000, 4079, 1, 700_000]       # ~420 chunks over 2 QPs of 18 slots, both ways

    def body(r: int, t: RoceTransport):
        other = 1 - r
        for i, m in enumerate(_messages(r, sizes)):
            t.send(other, i, m)
        outs = [np.empty(n, dtype=np.uint8) for n in sizes]
        for i in (3, 1, 0, 2):
            t.recv(other, i, outs[i])
        _finish(t, other)
        return outs

    (t0, t1), results = _two_ranks(config, body)
    assert t0 is not None and t1 is not None
    for r in (0, 1):
        assert all(np.array_equal(o, m) for o, m in zip(results[r], _messages(1 - r, sizes),
                                                         strict=True))
    depth = t1.recv_depth
    for t in (t0, t1):
        c = t.counters()
        qps = c["per_peer"][str(1 - t.rank)]["qps"].values()
        # every QP's ring went round many times, one WQE per chunk
        assert all(q["responder"]["write_imm_messages"] > 10 * depth for q in qps), depth
        assert sum(q["responder"]["write_imm_messages"] for q in qps) == c["chunks_received"]
        assert c["bytes_received"] == sum(sizes) + 1


def test_a_slow_receiver_gets_rnr_naks_and_no_slot_is_overwritten_before_it_is_read():
    # rank 1 drives its engine (ACKs, RNR NAKs) but takes nothing for 0.3 s: its ring
    # fills, every chunk after that is RNR-NAKed at its FIRST packet and resent; had a
    # FIRST or MIDDLE landed in a slot still holding an untaken chunk, the bytes would
    # differ
    args = _rdma_args("--line-rate-bps", "2e9", "--timeout-ns", "1e9", "--spin-ns", "0",
                      "--mtu", "1024")
    config = RoceConfig(args=args, qps=1, chunk_bytes=4096, connect_timeout_s=20)
    depth = recv_depth(config.attrs(), config.chunk_bytes)
    sizes = [(3 * depth + 2) * (4096 - HEADER_BYTES), 20_000]

    def body(r: int, t: RoceTransport):
        if r == 0:
            for i, m in enumerate(_messages(0, sizes)):
                t.send(1, i, m)
            _finish(t, 1)
            return None
        end = time.monotonic() + 0.3
        while time.monotonic() < end:
            t.engine.step()
        landed = len(t._qps[0].qp.responder.completions)
        outs = [np.empty(n, dtype=np.uint8) for n in sizes]
        for i, out in enumerate(outs):
            t.recv(0, i, out)
        _finish(t, 0)
        return landed, outs

    (t0, t1), results = _two_ranks(config, body)
    assert t0 is not None and t1 is not None
    landed, outs = results[1]
    assert landed == depth                      # the ring full, nothing more landed
    assert all(np.array_equal(o, m) for o, m in zip(outs, _messages(0, sizes), strict=True))
    c0, c1 = t0.counters(), t1.counters()
    assert c1["rnr_naks_sent"] > 0 and c0["rnr_naks_received"] > 0
    assert c0["bytes_sent"] == c1["bytes_received"] == sum(sizes) + 1


def test_chunks_lost_on_the_wire_are_resent_and_land_once_each():
    args = _rdma_args("--line-rate-bps", "2e9", "--timeout-ns", "5e7", "--spin-ns", "0",
                      "--mtu", "1024")
    config = RoceConfig(args=args, qps=2, chunk_bytes=4096, connect_timeout_s=20)
    sizes = [200_000, 3, 60_000]

    def body(r: int, t: RoceTransport):
        for i, b in enumerate(t.endpoint.bindings):
            b.drop_prob = 0.03               # any data packet, resends too (ACKs are kept)
            b._rng.seed(10 * r + i)
        other = 1 - r
        for i, m in enumerate(_messages(r, sizes)):
            t.send(other, i, m)
        outs = [np.empty(n, dtype=np.uint8) for n in sizes]
        for i, out in enumerate(outs):
            t.recv(other, i, out)
        _finish(t, other)
        return outs

    (t0, t1), results = _two_ranks(config, body)
    assert t0 is not None and t1 is not None
    for r in (0, 1):
        assert all(np.array_equal(o, m) for o, m in zip(results[r], _messages(1 - r, sizes),
                                                         strict=True))
    for t in (t0, t1):
        c = t.counters()
        peer = c["per_peer"][str(1 - t.rank)]
        drops = sum(q["injected_drops"] for q in peer["qps"].values())
        assert drops > 0 and c["retransmissions"] >= drops
        # each chunk completed once: the immediates were checked in order on every QP
        assert c["chunks_received"] == c["chunks_sent"] == peer["chunks_posted"]
        assert c["bytes_received"] == sum(sizes) + 1


def _lone_transport(qps: int = 1) -> RoceTransport:
    args = _rdma_args("--mtu", "1024")
    peers = _peers(2)
    return RoceTransport(0, peers, RoceConfig(args=args, qps=qps, chunk_bytes=4096))


def test_the_hello_gives_each_qps_landing_ring_and_the_version():
    t = _lone_transport(qps=2)
    try:
        local = t.local_qps(1)
        assert [sorted(q) for q in local] == [["psn", "qpn", "rkey", "slots", "va"]] * 2
        assert all(q["slots"] == t.recv_depth and 0 < q["rkey"] < 1 << 32 for q in local)
        rings = t._rings[1]
        assert [q["va"] for q in local] == [r.ctypes.data for r in rings]
        assert all(r.nbytes == t.recv_depth * 4096 for r in rings)
        assert PROTOCOL_VERSION == 2
        from agents.collectives.roce import _check_hello, _hello
        hello = _hello(t, 1)
        assert hello["version"] == 2
        with pytest.raises(SetupError, match="'version': 1"):
            _check_hello(t, {**hello, "version": 1, "rank": 1}, 1)
    finally:
        t.close()


@pytest.mark.parametrize("change", [{"va": None}, {"slots": 0}, {"slots": MAX_SLOTS + 1},
                                    {"rkey": 1 << 32}, {"va": (1 << 64) - 4096}])
def test_a_peer_ring_we_cannot_write_fails_set_up(change):
    t = _lone_transport()
    try:
        local = t.local_qps(1)
        remote = [{**q, **change} for q in local]
        if change.get("va", 0) is None:
            del remote[0]["va"]
        with pytest.raises(SetupError, match="QP 0"):
            t.attach(1, local, remote)
    finally:
        t.close()


def test_a_completion_that_is_not_the_expected_chunk_and_slot_is_a_transport_error():
    t = _lone_transport()
    try:
        local = t.local_qps(1)
        t.attach(1, local, [dict(q) for q in local])
        q = t._qps[0]
        rs = q.qp.responder
        slots = t.recv_depth
        ok = [Completion(k % slots, WcStatus.SUCCESS, WC_RECV_RDMA_WITH_IMM, 20,
                         slot_imm(k, slots)) for k in range(2)]
        for c in ok:                      # chunks 0 and 1: headers of a 4-byte message
            q.ring[(c.wr_id) * 4096:(c.wr_id) * 4096 + 20] = np.frombuffer(
                HEADER.pack(0, 0, 4 * c.wr_id, 8) + bytes(4), dtype=np.uint8)
            rs.completions.append(c)
        posted = rs.posted_receives
        t.reap()
        assert q.recv_n == 2 and rs.posted_receives == posted + 2   # both slots re-posted
        for bad in (Completion(2, WcStatus.SUCCESS, WC_RECV_RDMA_WITH_IMM, 20,
                               slot_imm(3, slots)),              # chunk 3 where 2 is due
                    Completion(2, WcStatus.SUCCESS, WC_RECV_RDMA_WITH_IMM, 20,
                               slot_imm(2, slots) ^ 1),          # the wrong slot
                    Completion(2, WcStatus.SUCCESS, WC_RECV, 20, None),   # a SEND
                    Completion(2, WcStatus.SUCCESS, WC_RECV_RDMA_WITH_IMM, 4097,
                               slot_imm(2, slots))):             # longer than a slot
            rs.completions.append(bad)
            with pytest.raises(TransportError, match="completion #2"):
                t.reap()
            assert q.recv_n == 2
    finally:
        t.close()


def test_setup_refuses_a_rank_with_other_settings():
    peers = _peers(2)
    errors: list[BaseException] = []

    def rank(r: int, qps: int) -> None:
        try:
            connect(r, peers, RoceConfig(args=_rdma_args(), qps=qps, connect_timeout_s=10)).close()
        except BaseException as e:   # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(0, 1)), threading.Thread(target=rank,
                                                                            args=(1, 2))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert len(errors) == 2 and all(isinstance(e, SetupError) for e in errors), errors
    assert any("'qps'" in str(e) for e in errors)


def _worker(rank: int, peers: list[PeerAddress], tmp_path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "agents.collectives", "--rank", str(rank),
         "--peers", ",".join(str(p) for p in peers),
         "--algorithms-module", "tests.collective_stub", "--data-module", "tests.collective_stub",
         "--line-rate-bps", "2e9", "--timeout-ns", "1e9", "--spin-ns", "0",
         "--ready-file", str(tmp_path / f"ready{rank}"), "--out", str(tmp_path / f"r{rank}.json"),
         "--events", str(tmp_path / f"r{rank}.events.jsonl"), *args],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _run_workers(tmp_path, n: int, *args: str, returncode: int = 0) -> list[dict]:
    peers = _peers(n)
    procs = [_worker(r, peers, tmp_path, *args) for r in range(n)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == returncode, err + out
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r in range(n):
        assert json.loads((tmp_path / f"ready{r}").read_text())["rank"] == r
        assert json.loads((tmp_path / f"r{r}.json").read_text()) == outs[r]
    return outs


def test_three_workers_all_reduce_on_loopback(tmp_path):
    outs = _run_workers(tmp_path, 3, "--op", "allreduce", "--dtype", "int32",
                        "--min-bytes", "1000", "--max-bytes", "256000", "--factor", "16",
                        "--warmup", "1", "--iterations", "3", "--qps", "2",
                        "--chunk-bytes", "4096", "--mtu", "1024")
    for r, o in enumerate(outs):
        assert o["rank"] == r and o["size"] == 3 and o["error"] is None
        assert o["stopped_by"] == "done" and o["partial"] is None
        assert [x["bytes"] for x in o["results"]] == [1000, 16000, 256000]
        for x in o["results"]:
            assert x["wrong"] == 0 and x["count"] == x["bytes"] // 4
            assert len(x["iterations_us"]) == 3 and x["min_us"] > 0
            assert x["min_us"] <= x["p50_us"] <= x["p99_us"]
            assert set(x["phases_us"]) == {"reduce_scatter", "all_gather"}
            assert sum(x["phases_us"].values()) <= x["avg_us"]
        c = o["counters"]
        assert c["retransmissions"] == 0 and c["rnr_naks_received"] == 0
    sent = sum(o["counters"]["bytes_sent"] for o in outs)
    assert sent == sum(o["counters"]["bytes_received"] for o in outs) > 0
    # one collective_phase event per phase of every iteration, warm-ups flagged, whose
    # fabric lengths are what phases_us averages
    for r, o in enumerate(outs):
        events = [json.loads(line) for line in
                  (tmp_path / f"r{r}.events.jsonl").read_text().splitlines()]
        assert len(events) == 3 * 4 * 2 == o["events_written"] and o["events_dropped"] == 0
        assert {(e["kind"], e["rank"]) for e in events} == {("collective_phase", r)}
        assert [e["warmup"] for e in events[:2]] == [True, True]
        assert [(e["phase"], e["iteration"]) for e in events[:4]] == [
            ("reduce_scatter", 0), ("all_gather", 0), ("reduce_scatter", 1), ("all_gather", 1)]
        assert all(e["end_mono_ns"] >= e["mono_ns"] for e in events)
        for x in o["results"]:
            for phase, mean_us in x["phases_us"].items():
                timed = [e["duration_ns"] for e in events if e["bytes"] == x["bytes"]
                         and e["phase"] == phase and not e["warmup"]]
                assert len(timed) == 3
                assert sum(timed) / 3 / 1e3 == pytest.approx(mean_us, abs=1e-3)
    # what rank r sent to rank p is what p received from r
    for r, o in enumerate(outs):
        for p, pc in o["counters"]["per_peer"].items():
            assert pc["bytes_sent"] == outs[int(p)]["counters"]["per_peer"][str(r)][
                "bytes_received"]


def test_three_workers_all_to_all(tmp_path):
    outs = _run_workers(tmp_path, 3, "--op", "alltoall", "--min-bytes", "3000",
                        "--max-bytes", "3000", "--iterations", "2")
    assert all(o["results"][0]["wrong"] == 0 and o["results"][0]["count"] == 250
               for o in outs)


def test_a_wrong_result_is_counted_and_fails_the_run(tmp_path):
    # the stand-in's "tree" all-reduce leaves two thirds of the buffer unwritten
    outs = _run_workers(tmp_path, 3, "--algorithm", "tree", "--dtype", "int32",
                        "--min-bytes", "3000", "--max-bytes", "3000", "--iterations", "1",
                        returncode=1)
    assert all(o["results"][0]["wrong"] == 500 and o["error"] is None for o in outs)


def test_a_missing_algorithms_module_is_a_clear_error(tmp_path):
    peers = _peers(2)
    res = subprocess.run(
        [sys.executable, "-m", "agents.collectives", "--rank", "0", "--peers",
         ",".join(str(p) for p in peers), "--algorithms-module",
         "agents.collectives.no_such_algorithms"],
        cwd=REPO, capture_output=True, text=True, timeout=60)
    assert res.returncode == 1
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert "agents.collectives.no_such_algorithms is missing" in out["error"]
    assert out["results"] == [] and out["stopped_by"] == "error"


def test_sigterm_stops_a_rank_with_what_it_has_and_its_peers_learn_it(tmp_path):
    peers = _peers(3)
    procs = [_worker(r, peers, tmp_path, "--min-bytes", "4096", "--max-bytes", "4096",
                     "--iterations", "1000000", "--control-sock", str(tmp_path / f"s{r}"))
             for r in range(3)]
    try:
        deadline = time.monotonic() + 60
        while True:             # running, a few timed iterations in
            try:
                snap = read_snapshot(str(tmp_path / "s1"))
            except OSError:
                snap = {}
            if snap.get("phase") == "running" and (snap.get("iteration") or 0) > 3:
                break
            assert time.monotonic() < deadline, snap
            time.sleep(0.05)
        assert snap["current_bytes"] == 4096 and snap["bytes_sent"] > 0
        procs[1].send_signal(signal.SIGTERM)
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=30)
            outs.append((p.returncode, json.loads(out.strip().splitlines()[-1]), err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    rc, o, _ = outs[1]
    assert rc == 0 and o["stopped_by"] == "signal:SIGTERM" and o["error"] is None
    res = o["partial"]         # the size under way, unchecked; no size was checked
    assert o["results"] == [] and res["bytes"] == 4096
    assert res["wrong"] is None and len(res["iterations_us"]) >= 3 and res["avg_us"] > 0
    for r in (0, 2):
        rc, o, err = outs[r]
        assert rc == 1 and o["stopped_by"] == "error", err
        assert "rank 1 left (signal:SIGTERM)" in o["error"]


@pytest.mark.parametrize("rank, message", [(0, "cannot connect to 127.0.0.1"),
                                           (1, "not every lower rank connected in time")])
def test_a_rank_alone_gives_up_after_the_connect_timeout(tmp_path, rank, message):
    peers = _peers(2)
    p = _worker(rank, peers, tmp_path, "--connect-timeout-s", "1")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 1, err
    o = json.loads(out.strip().splitlines()[-1])
    assert o["error"].startswith("SetupError") and message in o["error"]
    assert (tmp_path / f"ready{rank}").exists()      # it was listening all along


def test_a_finished_rank_answers_until_every_peer_has_said_done():
    """A peer's last message may wait for an ACK of ours that was lost, and only we can
    answer its retransmission: `sync.finish` returns only once every peer has said
    'done' over the set-up connection (its sends all acknowledged), not after a fixed
    linger. Rank 1 says it 0.6 s late: rank 0 is still there then."""
    from agents.collectives.sync import finish

    args = _rdma_args("--line-rate-bps", "1e9", "--spin-ns", "0")
    config = RoceConfig(args=args, qps=1, chunk_bytes=4096, connect_timeout_s=20)
    said_at: dict[int, float] = {}
    returned_at: dict[int, float] = {}

    def body(r: int, t: RoceTransport):
        leave = t.leave

        def late_leave(reason: str) -> None:
            if r == 1:
                t.drive(lambda: False if time.monotonic() < said_at.get(-1, 0) else True)
            said_at.setdefault(r, time.monotonic())
            leave(reason)

        t.leave = late_leave                     # type: ignore[method-assign]
        said_at.setdefault(-1, time.monotonic() + 0.6)
        finish(t)
        returned_at[r] = time.monotonic()
        assert t.peers_done()

    _two_ranks(config, body)
    assert returned_at[0] >= said_at[1]
    assert said_at[1] - said_at[0] > 0.3          # rank 1 really was late
