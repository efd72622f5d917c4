"""Malformed set-up connections for a RoCE server, and a way to feed them to one.

Shared by the loopback test (tests/unit/test_roce_setup_channel.py) and the
namespace one (tests/integration/test_roce_setup_garbage.py): each case is
(name, bytes sent, the `setup_refused` reason the server must count).
"""

from __future__ import annotations

import copy
import json
import socket
import time


def hello(test: str = "write_bw", **changes: object) -> dict:
    """A well-formed protocol-1 hello (the shape agents.roce's client sends)."""
    h: dict = {"version": 1, "test": test, "size": 4096, "iters": 4, "slots": 4, "seed": 1,
               "mtu": 1024, "verify": False,
               "qps": [{"qpn": 0x100, "psn": 5, "sport": 50000, "rkey": 7, "va": 4096,
                        "length": 4096}]}
    h.update(changes)
    return h


def _without(key: str) -> dict:
    h = hello()
    del h[key]
    return h


def _qp(**changes: object) -> dict:
    h = hello()
    h["qps"] = [dict(copy.deepcopy(h["qps"][0]), **changes)]
    return h


def _line(obj: object) -> bytes:
    return json.dumps(obj).encode() + b"\n"


#: (name, bytes, reason counted in setup_refused)
CASES: list[tuple[str, bytes, str]] = [
    ("deep list nesting", b"[" * 5000 + b"]" * 5000 + b"\n", "too_deep"),
    ("deep object nesting", b'{"a":' * 3000 + b"1" + b"}" * 3000 + b"\n", "too_deep"),
    ("deep nesting inside a field", _line(hello(seed=[[[[[[[[[[1]]]]]]]]]])), "too_deep"),
    ("a list", _line([hello()]), "not_object"),
    ("a number", b"42\n", "not_object"),
    ("not JSON", b"hello server\n", "not_json"),
    ("not UTF-8", b"\xff\xfe\x00{\n", "not_json"),
    ("a line over the size limit", b'{"pad":"' + b"x" * 70000 + b'"}\n', "too_large"),
    ("missing field mtu", _line(_without("mtu")), "missing_field"),
    ("missing field qps", _line(_without("qps")), "missing_field"),
    ("QP psn null", _line(_qp(psn=None)), "wrong_type"),
    ("MTU 1500", _line(hello(mtu=1500)), "out_of_range"),
    ("MTU huge", _line(hello(mtu=10**30)), "out_of_range"),
    ("UDP port 70000", _line(_qp(sport=70000)), "out_of_range"),
    ("UDP port 0", _line(_qp(sport=0)), "out_of_range"),
    ("PSN 2^24", _line(_qp(psn=1 << 24)), "out_of_range"),
    ("negative PSN", _line(_qp(psn=-1)), "out_of_range"),
    ("QPN 2^24", _line(_qp(qpn=1 << 24)), "out_of_range"),
    ("1 GiB x 64 slots", _line(hello(size=1 << 30, slots=64)), "out_of_range"),
    ("no QPs", _line(hello(qps=[])), "out_of_range"),
    ("size as text", _line(hello(size="big")), "wrong_type"),
    ("size as float", _line(hello(size=4096.5)), "wrong_type"),
    ("mtu as bool", _line(hello(mtu=True)), "wrong_type"),
    ("qps an object", _line(hello(qps={"qpn": 1})), "wrong_type"),
    ("a QP that is a number", _line(hello(qps=[5])), "wrong_type"),
    ("verify as text", _line(hello(verify="yes")), "wrong_type"),
    ("protocol version 99", _line(hello(version=99)), "version"),
    ("another test", _line(hello(test="send_bw")), "test"),
    ("half a line, then close", b'{"version": 1, "te', "closed"),
]


def feed(host: str, port: int, data: bytes, timeout_s: float = 10.0) -> dict | None:
    """Send `data` on a new set-up connection and return the server's JSON answer
    (None if it closed without one, as it may for a line over the size limit)."""
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        chunks = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except OSError:
                break
            if not chunk:
                break
            chunks.append(chunk)
    text = b"".join(chunks).decode(errors="replace").strip()
    return json.loads(text.splitlines()[0]) if text else None


def main(argv: list[str]) -> int:
    """`python -m tests.roce_garbage HOST PORT`: feed every case (run inside a namespace);
    prints one JSON line: the answers in CASES order."""
    host, port = argv[0], int(argv[1])
    print(json.dumps([feed(host, port, data) for _, data, _ in CASES]))
    return 0


if __name__ == "__main__":
    import sys
    sys.exit(main(sys.argv[1:]))
