"""A RoCE server fed garbage on its set-up channel keeps serving a real client afterwards.

Two hosts on one switch (own namespaces, torn down after): from h1's namespace
every malformed set-up connection of tests/roce_garbage.py is sent to a server
on h2, which must answer each with ok false, stay up, count each under its
reason in `setup_refused` (its --out file), and then serve a real client from
h1 to a verified end. A second server with --peer-subnet set to another subnet
refuses that same real client and counts it as `peer`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator

import pytest

from testbed.plan import Plan
from testbed.plan.paths import host_address
from tests.conftest import REPO
from tests.integration.conftest import built_lab
from tests.roce_garbage import CASES

pytestmark = pytest.mark.root

D = 1000
TIMEOUT = ["--timeout-ns", "300000"]
FABRIC_YAML = """\
name: {name}
dilation: {d}
topology: {{kind: single_switch, hosts: 2, host_link: {{port: 100GBASE-CR1, length: 2m}}}}
"""


@pytest.fixture(scope="module")
def fabric() -> Iterator[Plan]:
    with built_lab(FABRIC_YAML, "rocegarb", d=D) as plan:
        yield plan


def _in(plan: Plan, host: str, *argv: str) -> list[str]:
    return ["ip", "netns", "exec", plan.node(host).netns, sys.executable, *argv]


def _server(plan: Plan, tmp_path, port: int, *args: str) -> subprocess.Popen:
    ready = tmp_path / f"ready-{port}"
    server = subprocess.Popen(
        _in(plan, "h2", "-m", "agents.roce", "server", "write_bw", "--bind",
            host_address(plan, "h2"), "--port", str(port), "--roce-port", str(port + 1),
            "--dilation", str(D), "--out", str(tmp_path / f"server-{port}.json"),
            "--connect-timeout-s", "5", "--ready-file", str(ready), *TIMEOUT, *args),
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not ready.exists():
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            raise AssertionError(f"server not ready: {server.communicate()}")
        time.sleep(0.02)
    return server


def _client(plan: Plan, port: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        _in(plan, "h1", "-m", "agents.roce", "client", "write_bw", "--server",
            host_address(plan, "h2"), "--port", str(port), "--size", "65536", "--iters", "32",
            "--verify", "--dilation", str(D), *TIMEOUT),
        cwd=REPO, capture_output=True, text=True, timeout=180)


def _stop(server: subprocess.Popen, done_within_s: float = 0.0) -> tuple[str, str]:
    """Stop the server; one that served its client ends by itself, so wait `done_within_s`
    for that first (a SIGTERM while it writes its counters and exits, on a loaded CI
    machine, ended it by the signal: exit -15 after a clean, verified run)."""
    if done_within_s:
        try:
            return server.communicate(timeout=done_within_s)
        except subprocess.TimeoutExpired:
            pass
    if server.poll() is None:
        server.terminate()
    try:
        return server.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        return server.communicate()


def test_garbage_then_a_real_client(fabric, tmp_path):
    server = _server(fabric, tmp_path, 18600)
    try:
        fed = subprocess.run(
            _in(fabric, "h1", "-m", "tests.roce_garbage", host_address(fabric, "h2"), "18600"),
            cwd=REPO, capture_output=True, text=True, timeout=120)
        assert fed.returncode == 0, fed.stderr
        answers = json.loads(fed.stdout.strip().splitlines()[-1])
        for (name, _, _), answer in zip(CASES, answers, strict=True):
            assert answer is None or answer["ok"] is False, (name, answer)
        assert server.poll() is None, f"the server died: {server.communicate()}"
        client = _client(fabric, 18600)
        assert client.returncode == 0, client.stderr
    finally:
        out, err = _stop(server, done_within_s=30)
    assert server.returncode == 0, (server.returncode, err)
    s = json.loads((tmp_path / "server-18600.json").read_text())
    assert s["verified"] is True and s["error"] is None
    assert s["client"] == host_address(fabric, "h1")
    assert s["setup_refused"] == dict(Counter(reason for _, _, reason in CASES))
    assert s["setup_refused_total"] == len(CASES)


def test_a_client_outside_the_peer_subnets_is_refused(fabric, tmp_path):
    server = _server(fabric, tmp_path, 18610, "--peer-subnet", "192.0.2.0/24")
    try:
        client = _client(fabric, 18610)
        assert client.returncode == 1
        assert "outside --peer-subnet" in client.stderr
        assert server.poll() is None
    finally:
        _stop(server)
    s = json.loads((tmp_path / "server-18610.json").read_text())
    assert s["setup_refused"] == {"peer": 1}
