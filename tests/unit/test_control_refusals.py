"""Control sockets refuse bad peers and bad messages, count them per reason, serve on.

The command socket (agents.runtime.control): deep nesting, size, non-objects,
missing ops, handler errors, each counted in `refused` under its reason;
`decode_message` and `check_hello` fuzzed with random JSON-ish bytes (only
BadMessage); peers of another uid are refused by SO_PEERCRED (root only: it
forks a process of another uid).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agents.roce.hello import check_hello
from agents.runtime.control import (
    command_refusals,
    peer_uid,
    send_command,
    serve_commands,
    serve_snapshots,
)
from agents.runtime.messages import (
    MAX_MESSAGE_DEPTH,
    BadMessage,
    decode_message,
    nesting_depth,
)
from tests.roce_garbage import hello


def _raw(path: str, payload: bytes) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(path)
        try:
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return json.loads(data.split(b"\n")[0])


def test_the_command_socket_counts_each_refusal_and_serves_on(tmp_path):
    path = str(tmp_path / "cmd.sock")

    def handler(req: dict) -> dict:
        if req["op"] == "boom":
            raise RuntimeError("boom")
        return {"echo": req["op"]}

    server = serve_commands(path, handler)
    assert server is not None
    try:
        for payload in (b"[" * 10000 + b"]" * 10000 + b"\n", b'{"op": [[[[[[[[[[1]]]]]]]]]]}\n',
                        b"[1]\n", b"\xff\n", b'{"x": 1}\n', b'{"op": "boom"}\n',
                        b"x" * 70000 + b"\n"):
            assert _raw(path, payload)["ok"] is False
        assert send_command(path, {"op": "ping"}) == {"ok": True, "echo": "ping"}
        assert server.refused == {"too_deep": 2, "not_object": 1, "not_json": 1, "no_op": 1,
                                  "handler_error": 1, "too_large": 1}
        assert command_refusals(server)["command_refused_total"] == 7
    finally:
        server.close()
    assert command_refusals(None) == {"command_refused": {}, "command_refused_total": 0}


def test_peer_uid_is_ours(tmp_path):
    path = str(tmp_path / "snap.sock")
    server = serve_snapshots(path, lambda: {"x": 1})
    assert server is not None
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(path)
            assert peer_uid(s) == os.geteuid()
    finally:
        server.close()


@pytest.mark.root
def test_a_process_of_another_uid_is_refused():
    # pytest's tmp_path is 0700 under root's: the other uid needs a directory it can enter
    where = tempfile.mkdtemp(prefix="tb-peercred-", dir="/tmp")
    os.chmod(where, 0o755)
    path = os.path.join(where, "cmd.sock")
    server = serve_commands(path, lambda req: {})
    assert server is not None
    os.chmod(path, 0o666)       # let the other uid reach the socket: SO_PEERCRED must stop it
    try:
        pid = os.fork()
        if pid == 0:            # the child: another uid, one request, exit 0 if unanswered
            try:
                os.setuid(65534)
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.settimeout(5)
                    s.connect(path)
                    try:
                        s.sendall(b'{"op": "x"}\n')
                        answer = s.recv(100)
                    except OSError:         # reset or broken pipe: closed on us
                        answer = b""
                    os._exit(0 if answer == b"" else 3)
            except BaseException:   # noqa: BLE001 - a child must never return into pytest
                os._exit(4)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert server.refused == {"peer": 1}
        assert send_command(path, {"op": "x"})["ok"] is True
    finally:
        server.close()
        shutil.rmtree(where, ignore_errors=True)


def test_nesting_depth_ignores_brackets_in_strings():
    assert nesting_depth(b'{"a": "[[[[{{{{"}') == 1
    assert nesting_depth(b'["\\"[[[[", [1]]') == 2
    deep = b"[" * (MAX_MESSAGE_DEPTH + 1) + b"]" * (MAX_MESSAGE_DEPTH + 1)
    with pytest.raises(BadMessage) as e:
        decode_message(deep)
    assert e.value.reason == "too_deep"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=4),
    max_leaves=10)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(json_values)
def test_decode_and_check_hello_raise_only_bad_message(value):
    line = json.dumps(value).encode()
    try:
        check_hello(decode_message(line), "write_bw", 1)
    except BadMessage as e:
        assert e.reason and str(e)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(sorted(hello())), json_values, max_size=4),
       st.dictionaries(st.sampled_from(sorted(hello()["qps"][0])), json_values, max_size=3))
def test_a_hello_with_fields_replaced_is_accepted_or_refused(changes, qp_changes):
    h = hello(**changes)
    if isinstance(h.get("qps"), list) and h["qps"] and isinstance(h["qps"][0], dict):
        h["qps"][0].update(qp_changes)
    try:
        check_hello(decode_message(json.dumps(h).encode()), "write_bw", 1)
    except BadMessage as e:
        assert e.reason in ("missing_field", "wrong_type", "out_of_range", "version", "test",
                            "too_deep")


def test_decode_message_fuzz():
    rng = random.Random(18)
    base = json.dumps(hello()).encode()
    for _ in range(3000):
        b = bytearray(base if rng.random() < 0.7 else rng.randbytes(rng.randrange(200)))
        for _ in range(rng.randint(1, 4)):
            if b:
                b[rng.randrange(len(b))] = rng.choice(b'{}[]",:0\\ x\xff')
        try:
            check_hello(decode_message(bytes(b)), "write_bw", 1)
        except BadMessage:
            pass


def test_a_snapshot_says_whom_its_socket_refused_once_it_has(tmp_path):
    from agents.runtime.control import read_snapshot

    path = str(tmp_path / "snap.sock")
    server = serve_snapshots(path, lambda: {"packets": 7})
    assert server is not None
    try:
        assert read_snapshot(path, timeout_s=5) == {"packets": 7}     # clean: no new keys
        server.refuse("peer", "uid 65534")          # what SO_PEERCRED does to a stranger
        got = read_snapshot(path, timeout_s=5)
        assert got["packets"] == 7 and got["snapshot_refused"] == {"peer": 1}
        assert got["snapshot_refused_total"] == 1
    finally:
        server.close()
