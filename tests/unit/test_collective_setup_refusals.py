"""A collective rank's set-up listener refuses garbage and a stranger (a hello from
another address than the rank it names), counts them (`setup_refused`) and still
connects its real lower rank afterwards (loopback)."""

from __future__ import annotations

import json
import socket
import threading
import time

from agents.collectives.roce import PeerAddress, RoceConfig, connect
from tests.roce_garbage import feed
from tests.unit.test_collective_transport import _peers, _rdma_args

LOOPBACK = "127.0.0.1"


def _listening(port: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((LOOPBACK, port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.02)
    raise AssertionError("rank 1 never listened")


def test_garbage_then_the_real_rank():
    # rank 0 lives on 127.0.0.2: a well-formed hello naming rank 0 from 127.0.0.1 is a
    # stranger's
    p0, p1 = _peers(2)
    peers = [PeerAddress("127.0.0.2", p0.tcp_port, p0.udp_port), p1]
    config = RoceConfig(args=_rdma_args("--timeout-ns", "1e9"), qps=1, chunk_bytes=4096,
                        connect_timeout_s=30)
    out: dict[int, object] = {}
    started = threading.Event()

    def rank(r: int) -> None:
        try:
            out[r] = connect(r, peers, config, on_listening=started.set)
        except BaseException as e:   # noqa: BLE001 - checked below
            out[r] = e

    one = threading.Thread(target=rank, args=(1,))
    one.start()
    try:
        assert started.wait(20)
        _listening(peers[1].tcp_port)       # that probe is the first refusal: "closed"
        hello = {"version": 2, "rank": 0, "size": 2, "qps": 1, "chunk_bytes": 4096,
                 "mtu": 4096, "qp": []}
        garbage = [b"[" * 4000 + b"]" * 4000 + b"\n", b"[1, 2]\n", b"\xff\n",
                   json.dumps({k: v for k, v in hello.items() if k != "rank"}).encode() + b"\n",
                   json.dumps(dict(hello, rank="0")).encode() + b"\n",
                   json.dumps(dict(hello, rank=7)).encode() + b"\n",
                   json.dumps(dict(hello, qp={})).encode() + b"\n",
                   b"x" * 70000,
                   json.dumps(hello).encode() + b"\n"]
        for data in garbage:
            answer = feed(LOOPBACK, peers[1].tcp_port, data)
            assert answer is None or "error" in answer
            assert one.is_alive()
        zero = threading.Thread(target=rank, args=(0,))
        zero.start()
        zero.join(60)
        one.join(60)
    finally:
        one.join(60)
    for r in (0, 1):
        assert not isinstance(out.get(r), BaseException), out.get(r)
    t1 = out[1]
    counters = t1.counters()            # type: ignore[union-attr]
    assert counters["setup_refused"] == {"closed": 1, "too_deep": 1, "not_object": 1,
                                         "not_json": 1, "missing_field": 1, "wrong_type": 2,
                                         "out_of_range": 1, "too_large": 1, "peer": 1}
    assert counters["setup_refused_total"] == 10
    for r in (0, 1):
        out[r].close()                  # type: ignore[union-attr]
