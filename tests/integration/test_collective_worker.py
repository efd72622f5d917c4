"""Collective workers (`python -m agents.collectives`) across a real emulated fabric.

One switch, three hosts on 100GBASE-CR1 (2 m), dilation 1000 (a 100 Gb/s port is
100 Mb/s of wall rate), built by the project's own builder. One worker per host,
started with testbed.run.procs.start_agent (recorded in the lab state, so the lab's
teardown ends any that are left), each binding its host's address: TCP set-up port
18600, UDP RoCE port 4791. They all-reduce over RC QPs: the real algorithms and data
modules when they are on this branch, else the test stand-ins of
tests/collective_stub.py. The results must be right (#wrong 0), timed (> 0), and
every byte a rank sent must be a byte its peer received; the data crossed the hosts'
lossless class (DSCP 26 -> TC3), as perftest's does.
"""

from __future__ import annotations

import importlib.util
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from testbed.net.counters import read_counters
from testbed.plan import Plan
from testbed.plan.paths import host_address
from testbed.run.procs import AgentProcess, start_agent
from tests.integration.conftest import built_lab

pytestmark = pytest.mark.root

D = 1000
HOSTS = ("h1", "h2", "h3")
SETUP_PORT = 18600
ROCE_PORT = 4791
MIB = 1 << 20

FABRIC_YAML = """\
name: {name}
dilation: {d}
topology: {{kind: single_switch, hosts: 3, host_link: {{port: 100GBASE-CR1, length: 2m}}}}
"""


def _modules() -> list[str]:
    """The real algorithms / data modules if they are here, else the test stand-ins."""
    real = all(importlib.util.find_spec(f"agents.collectives.{m}") is not None
               for m in ("algorithms", "data"))
    if real:
        return []
    return ["--algorithms-module", "tests.collective_stub", "--data-module",
            "tests.collective_stub"]


@pytest.fixture(scope="module")
def fabric() -> Iterator[Plan]:
    with built_lab(FABRIC_YAML, "coll", d=D) as plan:
        yield plan


def _ip(plan: Plan, host: str) -> str:
    return host_address(plan, host)


def _class_packets(plan: Plan, host: str, tc: int) -> int:
    _, classes = read_counters(plan)
    return sum(c.packets for c in classes if c.node == host and c.tc == tc)


def _run(plan: Plan, tmp: Path, tag: str, *args: str, timeout_s: float = 300) -> list[dict]:
    """One worker per host with `args`; their final JSONs, in rank order."""
    peers = ",".join(f"{_ip(plan, h)}:{SETUP_PORT}:{ROCE_PORT}" for h in HOSTS)
    procs: list[AgentProcess] = []
    try:
        for rank, host in enumerate(HOSTS):
            argv = ["--rank", str(rank), "--peers", peers, "--dilation", str(D),
                    "--spin-ns", "0", "--ready-file", str(tmp / f"{tag}-ready{rank}"),
                    "--out", str(tmp / f"{tag}-{rank}.json"), "--connect-timeout-s", "60",
                    *_modules(), *args]
            procs.append(start_agent(plan.lab, plan.node(host).netns, "agents.collectives",
                                     argv, f"coll-{tag}-{rank}"))
        deadline = time.monotonic() + timeout_s
        outs = []
        for p in procs:
            out, err = p.popen.communicate(timeout=max(1.0, deadline - time.monotonic()))
            assert p.popen.returncode == 0, err[-3000:] + out[-3000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
        return outs
    finally:
        for p in procs:
            p.stop()


def _check(outs: list[dict], sizes: list[int]) -> None:
    for rank, o in enumerate(outs):
        assert o["rank"] == rank and o["size"] == 3, o
        assert o["error"] is None and o["stopped_by"] == "done", o
        assert [r["bytes"] for r in o["results"]] == sizes
        for r in o["results"]:
            assert r["wrong"] == 0, r
            assert r["min_us"] > 0 and r["avg_us"] >= r["min_us"]
            assert all(t > 0 for t in r["iterations_us"])
        c = o["counters"]
        assert c["bytes_sent"] == c["bytes_posted"] > 0
        assert c["endpoint"]["wrong_peer"] == 0 and sum(c["endpoint"]["malformed"].values()) == 0
    assert (sum(o["counters"]["bytes_sent"] for o in outs)
            == sum(o["counters"]["bytes_received"] for o in outs))
    for rank, o in enumerate(outs):
        for peer, pc in o["counters"]["per_peer"].items():
            theirs = outs[int(peer)]["counters"]["per_peer"][str(rank)]
            assert pc["bytes_sent"] == theirs["bytes_received"]
            assert pc["messages_sent"] == theirs["messages_received"]


def test_three_ranks_all_reduce_odd_sizes_over_two_qps(fabric, tmp_path):
    # 1000 B and 100000 B: neither a multiple of the 16368 data bytes of a 16 KiB chunk,
    # nor of 3 ranks' blocks; 2 QPs per pair of ranks
    tc3_before = [_class_packets(fabric, h, 3) for h in HOSTS]
    outs = _run(fabric, tmp_path, "odd", "--op", "allreduce", "--algorithm", "ring",
                "--min-bytes", "1000", "--max-bytes", "100000", "--factor", "100",
                "--warmup", "1", "--iterations", "3", "--qps", "2", "--chunk-bytes", "16384")
    _check(outs, [1000, 100000])
    for rank, o in enumerate(outs):
        qps = [q for pc in o["counters"]["per_peer"].values() for q in pc["qps"].values()]
        assert len(qps) == 4
        # data and ACKs went out DSCP 26, the hosts' lossless class TC3
        sent = o["counters"]["packets_sent"]
        assert _class_packets(fabric, HOSTS[rank], 3) - tc3_before[rank] >= sent


# the stand-ins have a ring only
ALGORITHMS = ["ring"] if _modules() else ["ring", "rhd", "tree"]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_three_ranks_1mib_all_reduce_at_line_rate(fabric, tmp_path, algorithm):
    outs = _run(fabric, tmp_path, f"mib-{algorithm}", "--op", "allreduce", "--algorithm",
                algorithm,
                "--min-bytes", str(MIB), "--max-bytes", str(MIB), "--warmup", "1",
                "--iterations", "3")
    _check(outs, [MIB])
    n = 3
    for o in outs:
        r = o["results"][0]
        algbw = r["bytes"] * 8 / (r["avg_us"] * 1e3)        # Gb/s, fabric
        busbw = algbw * 2 * (n - 1) / n
        c = o["counters"]
        print(f"\nfabric D={D}: rank {o['rank']} 1 MiB {algorithm} all-reduce over 3 ranks: "
              f"avg {r['avg_us']:.1f} us, min {r['min_us']:.1f} us, p99 {r['p99_us']:.1f} us "
              f"(fabric), algbw {algbw:.2f} Gb/s, busbw {busbw:.2f} Gb/s; phases "
              f"{ {k: round(v, 1) for k, v in r['phases_us'].items()} }; "
              f"{c['packets_sent']} packets, {c['retransmissions']} retransmitted, "
              f"{c['timeouts']} timeouts, {c['cnps_received']} CNPs")
        # a 100 Gb/s host port moves at most 100 Gb/s of wire bytes: busbw stays below it
        assert 0 < busbw < 100
