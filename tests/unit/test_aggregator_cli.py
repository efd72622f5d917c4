"""`python -m agents.aggregator` on loopback (no root): readiness, live and final counters,
DSCP / ECN of what it sends, a two-level tree of three processes, argument errors."""

from __future__ import annotations

import json
import math
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from agents.collectives.ina import InaJob, allreduce_ina, open_socket
from agents.runtime.control import read_snapshot
from agents.timebase import Dilation
from agents.wire.ina import AGGREGATOR, Header, PacketType, build, parse
from tests.conftest import REPO

LO = "127.0.0.1"


def _start(tmp_path: Path, name: str, jobs: list, port: int = 0,
           *extra: str) -> tuple[subprocess.Popen, dict]:
    ready = tmp_path / f"{name}.ready"
    proc = subprocess.Popen(
        [sys.executable, "-m", "agents.aggregator", "--bind", LO, "--port", str(port),
         "--jobs", json.dumps(jobs), "--ready-file", str(ready),
         "--control-sock", str(tmp_path / f"{name}.sock"),
         "--out", str(tmp_path / f"{name}.json"), *extra],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while not ready.exists() or not ready.read_text().strip():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"aggregator not ready: {proc.communicate()}")
        time.sleep(0.01)
    return proc, json.loads(ready.read_text())


def _stop(proc: subprocess.Popen) -> dict:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err + out
    return json.loads(out.strip().splitlines()[-1])


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((LO, 0))
        return s.getsockname()[1]


def _workers(socks, aggs, job: InaJob, xs, outs) -> list:
    stats: list = [None] * len(socks)
    errors: list = []

    def work(w: int) -> None:
        try:
            stats[w] = allreduce_ina(socks[w], aggs[w], job, w, xs[w], outs[w],
                                     dilation=Dilation(1), timeout_ns=200_000_000)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))
    threads = [threading.Thread(target=work, args=(w,)) for w in range(len(socks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return stats


def test_three_workers_through_the_aggregator_process(tmp_path):
    n, size, S, E = 3, 50_000, 16, 1024
    socks = [open_socket(LO) for _ in range(n)]
    jobs = [{"id": 4, "members": [[w, LO, s.getsockname()[1]] for w, s in enumerate(socks)],
             "slots": S, "slot_elements": E}]
    proc, ready = _start(tmp_path, "agg", jobs)
    try:
        live = read_snapshot(str(tmp_path / "agg.sock"))
        assert live["completed"] == 0 and live["jobs"]["4"]["slots"] == S
        # flat, for the run's collector (aggregator.<key>)
        assert live["mode"] == "aggregator" and live["job4_slots"] == live["slots"] == S
        assert live["job4_slots_in_use"] == 0 and live["drops_not_member"] == 0
        rng = np.random.default_rng(0)
        xs = [rng.standard_normal(size).astype(np.float32) for _ in range(n)]
        outs = [np.zeros_like(x) for x in xs]
        stats = _workers(socks, [(LO, ready["port"])] * n, InaJob(4, n, S, E), xs, outs)
        live = read_snapshot(str(tmp_path / "agg.sock"))
    finally:
        for s in socks:
            s.close()
        c = _stop(proc)
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    assert np.max(np.abs(outs[0] - exact)) < 1e-5
    chunks = math.ceil(size / E) + S
    assert live["completed"] == chunks
    assert c["completed"] == chunks and c["aggregated"] == n * chunks
    assert c["results_sent"] == n * chunks + c["shadow_answers"]
    assert c["packets_received"] == sum(s.packets_sent for s in stats)
    assert c["packets_sent"] == sum(s.packets_received for s in stats)
    assert c["slots_in_use"] == 0 and c["overflow_elements"] == 0
    assert c["stopped_by"] == "signal:SIGTERM" and c["dscp"] == 26
    assert json.loads((tmp_path / "agg.json").read_text()) == c


def test_results_carry_dscp_26_and_ect0(tmp_path):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.IPPROTO_IP, socket.IP_RECVTOS, 1)
    s.bind((LO, 0))
    s.settimeout(10)
    jobs = [{"id": 1, "members": [[0, LO, s.getsockname()[1]]], "slots": 1,
             "slot_elements": 4}]
    proc, ready = _start(tmp_path, "tos", jobs)
    try:
        s.sendto(build(Header(PacketType.REQUEST, 1, 0, 0, 0, 0, next_exp=3),
                       np.arange(4, dtype=np.int32)), (LO, ready["port"]))
        data, anc, _, _ = s.recvmsg(65536, socket.CMSG_SPACE(1))
    finally:
        s.close()
        c = _stop(proc)
    tos = next(d[0] for level, kind, d in anc if level == socket.IPPROTO_IP
               and kind == socket.IP_TOS)
    assert tos == 26 << 2 | 0b10
    p = parse(data)
    assert p.header == Header(PacketType.RESULT, 1, 0, 0, 0, AGGREGATOR, 0, 3, 1, 4)
    assert c["results_sent"] == 1


def test_a_tree_of_three_aggregator_processes(tmp_path):
    S, E, size = 8, 512, 20_000
    socks = [open_socket(LO) for _ in range(4)]
    leaf_ports = [_free_port(), _free_port()]
    root_jobs = [{"id": 2, "members": [], "children": [[10 + k, LO, leaf_ports[k]]
                                                       for k in range(2)],
                  "slots": S, "slot_elements": E}]
    root, r = _start(tmp_path, "root", root_jobs)
    leaves = []
    try:
        for k in range(2):
            jobs = [{"id": 2, "members": [[w, LO, socks[w].getsockname()[1]]
                                          for w in (2 * k, 2 * k + 1)],
                     "slots": S, "slot_elements": E, "uplink_id": 10 + k}]
            leaves.append(_start(tmp_path, f"leaf{k}", jobs, leaf_ports[k],
                                 "--parent", f"{LO}:{r['port']}")[0])
        xs = [np.random.default_rng(w).integers(-1000, 1000, size).astype(np.int32)
              for w in range(4)]
        outs = [np.zeros_like(x) for x in xs]
        aggs = [(LO, leaf_ports[w // 2]) for w in range(4)]
        _workers(socks, aggs, InaJob(2, 4, S, E), xs, outs)
    finally:
        for s in socks:
            s.close()
        cs = [_stop(p) for p in leaves]
        rc = _stop(root)
    assert all(np.array_equal(o, sum(xs)) for o in outs)
    chunks = math.ceil(size / E)
    for c in cs:
        assert c["partials_forwarded"] == chunks and c["completed"] == chunks
        assert c["parent"] == f"{LO}:{r['port']}"
    assert rc["completed"] == chunks and rc["partials_received"] >= 2 * chunks


@pytest.mark.parametrize("argv, message", [
    (["--jobs", "[]"], "non-empty JSON list"),
    (["--jobs", "{"], "Expecting"),
    (["--jobs", '[{"id": 1, "members": [[0, "1.2.3.4", 5]], "slots": 1, "slot_elements": 1}]',
      "--parent", "1.2.3.4:9"], "need an uplink_id"),
    (["--jobs", '[{"id": 1, "members": [[0, "1.2.3.4", 5]], "slots": 1, "slot_elements": 1}]',
      "--parent", "nohost"], "IP:PORT"),
    (["--jobs", '[{"id": 1, "members": [[0, "1.2.3.4", 5]], "slots": 1, "slot_elements": 1}]',
      "--dscp", "64"], "DSCP"),
])
def test_bad_arguments_exit_2(argv, message):
    res = subprocess.run([sys.executable, "-m", "agents.aggregator", "--bind", LO, *argv],
                         cwd=REPO, capture_output=True, text=True, timeout=30)
    assert res.returncode == 2 and message in res.stderr, res.stderr


def test_an_address_it_cannot_bind_is_reported_on_both_channels(tmp_path):
    jobs = '[{"id": 1, "members": [[0, "1.2.3.4", 5]], "slots": 1, "slot_elements": 1}]'
    res = subprocess.run([sys.executable, "-m", "agents.aggregator", "--bind", "192.0.2.77",
                          "--jobs", jobs, "--out", str(tmp_path / "o.json")],
                         cwd=REPO, capture_output=True, text=True, timeout=30)
    assert res.returncode == 1 and "agents.aggregator" in res.stderr
    assert json.loads(res.stdout)["stopped_by"] == "error"
    assert json.loads((tmp_path / "o.json").read_text())["error"]
