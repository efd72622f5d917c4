"""Checking a RoCE client's hello on the server's set-up connection, field by field.

The set-up channel is the one place a RoCE server takes structure from another
process, so every field it uses is checked here for presence, type and range
before any of it sizes a buffer or a QP: `check_hello` raises `BadMessage`
with a counter key (`missing_field`, `wrong_type`, `out_of_range`, `version`,
`test`) and a message naming the field. docs/roce.md ("The set-up channel")
lists them.
"""

from __future__ import annotations

from typing import Any

from agents.rdma.qp import IB_MTUS
from agents.runtime.messages import BadMessage
from agents.runtime.messages import int_field as _int
from agents.wire.roce import PSN_MASK

#: QPs one hello may ask for.
MAX_HELLO_QPS = 1024
#: Bytes of one QP's memory region a hello may make the server allocate (slots x size),
#: beyond one message.
MAX_REGION_BYTES = 1 << 30
#: Largest message size (the client refuses --size at or above 2^31 too).
MAX_SIZE_BYTES = (1 << 31) - 1

#: The refusal reasons `check_hello` gives (counter keys).
HELLO_REASONS = ("missing_field", "wrong_type", "out_of_range", "version", "test")


def check_hello(hello: dict[str, Any], test: str, version: int) -> None:
    """Raise BadMessage unless `hello` is a well-formed hello for `test` at `version`."""
    if hello.get("version") != version:
        raise BadMessage("version", f"protocol version {hello.get('version')!r} "
                         f"(server speaks {version})")
    if hello.get("test") != test:
        raise BadMessage("test", f"client runs {hello.get('test')!r}, this server {test}")
    size = _int(hello, "size", 0, MAX_SIZE_BYTES)
    slots = _int(hello, "slots", 1, MAX_REGION_BYTES)
    if size > 0 and slots > 1 and slots * size > MAX_REGION_BYTES:
        raise BadMessage("out_of_range", f"hello.slots x hello.size = {slots * size} bytes "
                         f"(at most {MAX_REGION_BYTES} beyond one message)")
    _int(hello, "seed", 0, (1 << 63) - 1)
    mtu = _int(hello, "mtu", min(IB_MTUS), max(IB_MTUS))
    if mtu not in IB_MTUS:
        raise BadMessage("out_of_range", f"hello.mtu = {mtu} is not one of {IB_MTUS}")
    if "verify" in hello and not isinstance(hello["verify"], bool):
        raise BadMessage("wrong_type", "hello.verify is not true or false")
    qps = hello.get("qps")
    if qps is None:
        raise BadMessage("missing_field", "hello has no 'qps'")
    if not isinstance(qps, list):
        raise BadMessage("wrong_type", f"hello.qps is {type(qps).__name__}, not a list")
    if not 1 <= len(qps) <= MAX_HELLO_QPS:
        raise BadMessage("out_of_range", f"hello.qps has {len(qps)} QPs "
                         f"(1..{MAX_HELLO_QPS})")
    if test == "write_lat" and len(qps) != 1:
        raise BadMessage("out_of_range", "write_lat runs one QP")
    for i, c in enumerate(qps):
        where = f"hello.qps[{i}]"
        if not isinstance(c, dict):
            raise BadMessage("wrong_type", f"{where} is {type(c).__name__}, not an object")
        _int(c, "qpn", 0, (1 << 24) - 1, where)
        _int(c, "psn", 0, PSN_MASK, where)
        _int(c, "sport", 1, 65535, where)
        if test == "write_lat":
            _int(c, "va", 0, (1 << 64) - 1, where)
            _int(c, "rkey", 0, (1 << 32) - 1, where)
