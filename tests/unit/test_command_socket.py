"""The agents' command socket (agents.runtime.control): one JSON line each way, 0600,
and no request, however bad, stops the server."""

from __future__ import annotations

import json
import os
import socket
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from agents.runtime import control
from agents.runtime.control import CommandInbox, send_command, serve_commands


@pytest.fixture
def sock_path(tmp_path):
    return str(tmp_path / "agent.cmd.sock")


def _raw(path: str, payload: bytes, timeout_s: float = 5.0) -> dict:
    """Send raw bytes (not necessarily JSON), return the parsed reply line."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        s.connect(path)
        try:
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass          # the server may answer and close before a huge payload is in
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    return json.loads(data.split(b"\n")[0])


def test_good_request_is_answered_ok_with_the_handlers_fields(sock_path):
    seen = []
    server = serve_commands(sock_path, lambda r: (seen.append(r), {"applied": r["op"]})[1])
    try:
        assert stat.S_IMODE(os.stat(sock_path).st_mode) == 0o600
        reply = send_command(sock_path, {"op": "pfc", "port": "swp1", "tc": 3,
                                         "enabled": False})
        assert reply == {"ok": True, "applied": "pfc"}
        assert seen == [{"op": "pfc", "port": "swp1", "tc": 3, "enabled": False}]
    finally:
        server.close()
    assert not os.path.exists(sock_path)


def test_no_path_no_server():
    assert serve_commands(None, lambda r: {}) is None


@pytest.mark.parametrize("payload, error", [
    (b"not json\n", "not JSON"),
    (b"[1, 2]\n", "JSON object"),
    (b'{"port": "swp1"}\n', "op"),
    (b'{"op": 7}\n', "op"),
    (b"\xff\xfe\n", "not JSON"),
    (b"", "not JSON"),                      # connected, closed, said nothing
])
def test_malformed_requests_get_ok_false_and_the_server_lives_on(sock_path, payload, error):
    server = serve_commands(sock_path, lambda r: {"fine": True})
    try:
        reply = _raw(sock_path, payload)
        assert reply["ok"] is False and error in reply["error"]
        assert send_command(sock_path, {"op": "x"}) == {"ok": True, "fine": True}
    finally:
        server.close()


def test_handler_errors_are_answered_not_raised(sock_path):
    def handler(request: dict) -> dict:
        if request["op"] == "boom":
            raise ValueError("no port 'swp9'")
        return {}
    server = serve_commands(sock_path, handler)
    try:
        assert send_command(sock_path, {"op": "boom"}) == {
            "ok": False, "error": "ValueError: no port 'swp9'"}
        assert send_command(sock_path, {"op": "fine"}) == {"ok": True}
    finally:
        server.close()


def test_a_handler_may_answer_ok_false_itself(sock_path):
    server = serve_commands(sock_path, lambda r: {"ok": False, "error": "refused"})
    try:
        assert send_command(sock_path, {"op": "x"}) == {"ok": False, "error": "refused"}
    finally:
        server.close()


def test_huge_request_is_refused(sock_path):
    server = serve_commands(sock_path, lambda r: {})
    try:
        big = b'{"op": "pfc", "pad": "' + b"x" * (4 * control.MAX_REQUEST_BYTES) + b'"}\n'
        reply = _raw(sock_path, big)
        assert reply["ok"] is False and "larger than" in reply["error"]
        assert send_command(sock_path, {"op": "x"})["ok"] is True
    finally:
        server.close()


def test_a_silent_client_is_dropped_and_does_not_block_others(sock_path, monkeypatch):
    monkeypatch.setattr(control, "REQUEST_TIMEOUT_S", 0.3)
    server = serve_commands(sock_path, lambda r: {})
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
            silent.connect(sock_path)
            t0 = time.monotonic()
            assert send_command(sock_path, {"op": "x"})["ok"] is True
            assert time.monotonic() - t0 < 0.3              # not queued behind it
            silent.settimeout(2)
            reply = json.loads(silent.recv(65536).split(b"\n")[0])
            assert reply["ok"] is False and "no request line" in reply["error"]
    finally:
        server.close()


def test_concurrent_clients_each_get_their_own_answer(sock_path):
    lock = threading.Lock()
    count = [0]

    def handler(request: dict) -> dict:
        time.sleep(0.01)
        with lock:
            count[0] += 1
        return {"echo": request["n"]}
    server = serve_commands(sock_path, handler)
    try:
        with ThreadPoolExecutor(max_workers=12) as pool:
            replies = list(pool.map(lambda n: send_command(sock_path, {"op": "x", "n": n}),
                                    range(60)))
        assert all(r["ok"] for r in replies), [r for r in replies if not r["ok"]][:3]
        assert [r["echo"] for r in replies] == list(range(60)) and count[0] == 60
    finally:
        server.close()


def test_send_command_never_raises_for_transport_failures(tmp_path):
    reply = send_command(str(tmp_path / "nobody.sock"), {"op": "x"}, timeout_s=0.2)
    assert reply["ok"] is False and "nobody.sock" in reply["error"]
    reply = send_command(str(tmp_path / "x"), {"op": object()})
    assert reply["ok"] is False and "serialisable" in reply["error"]


def test_send_command_times_out_on_a_stuck_agent(sock_path):
    release = threading.Event()
    server = serve_commands(sock_path, lambda r: (release.wait(5), {})[1])
    try:
        t0 = time.monotonic()
        reply = send_command(sock_path, {"op": "x"}, timeout_s=0.2)
        assert reply["ok"] is False and time.monotonic() - t0 < 1.0
    finally:
        release.set()
        server.close()


def test_inbox_runs_requests_in_the_loops_thread(sock_path):
    inbox = CommandInbox(timeout_s=2.0)
    server = serve_commands(sock_path, inbox.submit)
    threads = []
    stop = threading.Event()

    def handler(request: dict) -> dict:
        threads.append(threading.get_ident())
        if request["op"] == "bad":
            raise KeyError("tc")
        return {"n": request["n"]}

    def loop() -> None:
        import select
        while not stop.is_set():
            ready, _, _ = select.select([inbox.fileno()], [], [], 0.05)
            if ready:
                inbox.run(handler)
    loop_thread = threading.Thread(target=loop)
    loop_thread.start()
    try:
        assert send_command(sock_path, {"op": "x", "n": 1}) == {"ok": True, "n": 1}
        assert send_command(sock_path, {"op": "bad"})["ok"] is False
        assert set(threads) == {loop_thread.ident}
    finally:
        stop.set()
        loop_thread.join()
        server.close()
        inbox.close()


def test_inbox_answers_ok_false_when_the_loop_does_not_take_it(sock_path):
    inbox = CommandInbox(timeout_s=0.2)
    server = serve_commands(sock_path, inbox.submit)
    try:
        reply = send_command(sock_path, {"op": "x"})
        assert reply["ok"] is False and "did not take" in reply["error"]
    finally:
        server.close()
        inbox.close()
