"""Decoding one JSON control message from a peer, bounded: size, nesting depth, type.

Every agent channel that takes JSON from another process (the RoCE set-up
connection, the command sockets) decodes it here, so a hostile or broken peer
gets the same refusals everywhere: `BadMessage` with a short `reason` (the
counter key an agent reports; docs/roce.md "The set-up channel refuses garbage
and serves on", docs/pfc.md "Commands") and a human-readable detail. The depth
is checked by a linear scan BEFORE `json.loads`, so deep nesting can never reach
the parser's recursion limit.
"""

from __future__ import annotations

import json
from typing import Any

#: Bytes one control message may have (a RoCE hello for 64 QPs is ~8 KiB).
MAX_MESSAGE_BYTES = 64 * 1024
#: Arrays / objects one message may nest (a hello nests 3: object, list, object).
MAX_MESSAGE_DEPTH = 8

#: The refusal reasons `decode_message` gives (counter keys).
DECODE_REASONS = ("too_large", "too_deep", "not_json", "not_object")


class BadMessage(ValueError):
    """A peer's message refused; `reason` is a counter key, str(self) says why."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def nesting_depth(data: bytes) -> int:
    """The deepest nesting of [ and { in JSON text `data`, outside strings (linear)."""
    depth = deepest = 0
    in_string = escaped = False
    for b in data:
        if in_string:
            if escaped:
                escaped = False
            elif b == 0x5C:         # backslash
                escaped = True
            elif b == 0x22:         # quote
                in_string = False
        elif b == 0x22:
            in_string = True
        elif b in (0x5B, 0x7B):
            depth += 1
            deepest = max(deepest, depth)
        elif b in (0x5D, 0x7D):
            depth -= 1
    return deepest


def decode_message(line: bytes, max_bytes: int = MAX_MESSAGE_BYTES,
                   max_depth: int = MAX_MESSAGE_DEPTH) -> dict[str, Any]:
    """The JSON object in `line` (one message, no newline); BadMessage otherwise."""
    if len(line) > max_bytes:
        raise BadMessage("too_large", f"message of {len(line)} bytes (at most {max_bytes})")
    depth = nesting_depth(line)
    if depth > max_depth:
        raise BadMessage("too_deep", f"message nests {depth} deep (at most {max_depth})")
    try:
        msg = json.loads(line)
    except (ValueError, RecursionError) as e:
        raise BadMessage("not_json", f"not JSON: {str(e)[:80]}") from None
    if not isinstance(msg, dict):
        raise BadMessage("not_object", f"a JSON {type(msg).__name__}, not an object")
    return msg


def int_field(obj: dict[str, Any], key: str, lo: int | None = None, hi: int | None = None,
              where: str = "hello") -> int:
    """`obj[key]` as a whole number (not a bool) within [lo, hi] where given; BadMessage
    (`missing_field`, `wrong_type`, `out_of_range`) naming `where.key` otherwise. The
    field check every set-up hello shares."""
    if key not in obj:
        raise BadMessage("missing_field", f"{where} has no {key!r}")
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadMessage("wrong_type", f"{where}.{key} is {type(v).__name__} {str(v)[:40]}, "
                         "not an integer")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise BadMessage("out_of_range", f"{where}.{key} = {v} is outside {lo}..{hi}")
    return v
