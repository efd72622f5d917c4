"""The RoCE server's set-up channel refuses malformed hellos, counts them and serves on.

Pure checks of `check_hello` / `decode_message`, then the real program on
127.0.0.1 (no root): every kind of garbage in tests/roce_garbage.py is fed to
one server, which must answer each with ok false, count it under its reason in
`setup_refused`, and then run a real client's test to a verified end.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter

import pytest

from agents.roce.hello import HELLO_REASONS, check_hello
from agents.roce.perftest import PROTOCOL_VERSION, peer_allowed
from agents.runtime.messages import DECODE_REASONS, BadMessage, decode_message
from tests.conftest import REPO
from tests.roce_garbage import CASES, feed, hello

LOOPBACK = "127.0.0.1"
TIMEOUT = ["--timeout-ns", "1000000000"]


def test_a_real_hello_passes():
    check_hello(decode_message(json.dumps(hello()).encode()), "write_bw", PROTOCOL_VERSION)


@pytest.mark.parametrize("name,data,reason", [c for c in CASES if c[2] != "closed"],
                         ids=[c[0] for c in CASES if c[2] != "closed"])
def test_each_garbage_is_refused_with_its_reason(name, data, reason):
    with pytest.raises(BadMessage) as e:
        check_hello(decode_message(data.rstrip(b"\n")), "write_bw", PROTOCOL_VERSION)
    assert e.value.reason == reason, str(e.value)
    assert e.value.reason in DECODE_REASONS + HELLO_REASONS
    assert str(e.value)


def test_a_refusal_names_the_field():
    with pytest.raises(BadMessage, match=r"hello.qps\[0\].sport = 70000 is outside 1..65535"):
        check_hello(hello(qps=[dict(hello()["qps"][0], sport=70000)]), "write_bw", 1)


def test_peer_subnets():
    assert peer_allowed("10.0.1.2", None)
    assert peer_allowed("10.0.1.2", ["10.0.0.0/16"])
    assert not peer_allowed("10.1.1.2", ["10.0.0.0/16", "192.168.0.0/24"])
    assert not peer_allowed("not-an-ip", ["10.0.0.0/16"])


def _start_server(tmp_path, *args: str) -> tuple[subprocess.Popen, int]:
    ready = tmp_path / "ready"
    server = subprocess.Popen(
        [sys.executable, "-m", "agents.roce", "server", "write_bw", "--bind", LOOPBACK,
         "--port", "0", "--roce-port", "0", "--ready-file", str(ready),
         "--out", str(tmp_path / "server.json"), *TIMEOUT, *args],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while not ready.exists():
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            raise AssertionError(f"server never became ready: {server.communicate()}")
        time.sleep(0.02)
    return server, json.loads(ready.read_text())["port"]


def test_garbage_then_a_real_client_on_loopback(tmp_path):
    server, port = _start_server(tmp_path, "--connect-timeout-s", "1")
    try:
        for name, data, _ in CASES:
            answer = feed(LOOPBACK, port, data)
            assert answer is None or answer["ok"] is False, (name, answer)
            assert server.poll() is None, f"server died on {name}: {server.communicate()}"
        # a peer that connects and closes without a word
        answer = feed(LOOPBACK, port, b"", timeout_s=5)
        assert answer is None or answer["ok"] is False
        client = subprocess.run(
            [sys.executable, "-m", "agents.roce", "client", "write_bw", "--server", LOOPBACK,
             "--port", str(port), "--size", "65536", "--iters", "16", "--verify", *TIMEOUT],
            cwd=REPO, capture_output=True, text=True, timeout=120)
        out, err = server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert client.returncode == 0, client.stderr
    assert server.returncode == 0, err
    s = json.loads((tmp_path / "server.json").read_text())
    assert s["verified"] is True
    want = Counter(reason for _, _, reason in CASES)
    want["closed"] += 1                         # the one that said nothing
    assert s["setup_refused"] == dict(want)
    assert s["setup_refused_total"] == len(CASES) + 1
    assert "refused set-up from 127.0.0.1 (too_deep)" in err


def test_a_peer_outside_the_subnets_is_refused(tmp_path):
    server, port = _start_server(tmp_path, "--peer-subnet", "10.99.0.0/16")
    try:
        answer = feed(LOOPBACK, port, json.dumps(hello()).encode() + b"\n")
        assert answer is not None and answer["ok"] is False
        assert "outside --peer-subnet" in answer["error"]
        assert server.poll() is None
    finally:
        server.terminate()
        server.communicate(timeout=30)
    s = json.loads((tmp_path / "server.json").read_text())
    assert s["setup_refused"] == {"peer": 1}
