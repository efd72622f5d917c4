"""Parse the unit strings users write in configs and on the command line.

Every quantity is parsed once, at load time, into an integer in a base unit
named by the caller's field: bits per second, nanoseconds, bytes, metres (as
float). Sizes follow SI (KB = 1000 B) with the binary forms spelled out
(KiB = 1024 B), because vendor datasheets disagree and a config must say
which one it means.
"""

from __future__ import annotations

import math
import re

_NUMBER_RE = r"[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?"
_UNIT_RE = r"[A-Za-z\u00b5\u03bc/]*"   # letters, '/', and the micro sign (both code points)
_RE = re.compile(rf"^\s*(?P<num>{_NUMBER_RE})\s*(?P<unit>{_UNIT_RE})\s*$")
# The same shape as a plain (ECMA-262 compatible) pattern, for the JSON Schema.
QUANTITY_PATTERN = rf"^\s*{_NUMBER_RE}\s*{_UNIT_RE}\s*$"

RATE_UNITS_BPS = {
    "bps": 1, "b/s": 1,
    "kbps": 10**3, "kb/s": 10**3,
    "mbps": 10**6, "mb/s": 10**6,
    "gbps": 10**9, "gb/s": 10**9, "g": 10**9,
    "tbps": 10**12, "tb/s": 10**12, "t": 10**12,
}
TIME_UNITS_NS = {"ns": 1, "us": 10**3, "\u00b5s": 10**3, "\u03bcs": 10**3, "ms": 10**6, "s": 10**9}
SIZE_UNITS_BYTES = {
    "b": 1, "": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9,
    "kib": 2**10, "mib": 2**20, "gib": 2**30,
}
LENGTH_UNITS_M = {"m": 1.0, "cm": 0.01, "mm": 0.001, "km": 1000.0}


class UnitError(ValueError):
    """A quantity string that cannot be parsed; the message says what is accepted."""


def _split(text: str | int | float, what: str, examples: str) -> tuple[float, str]:
    if isinstance(text, bool):
        raise UnitError(f"expected a {what} such as {examples}, got {text!r}")
    if isinstance(text, int | float):
        num, unit = float(text), ""
    else:
        m = _RE.match(str(text))
        if not m:
            raise UnitError(f"cannot read {text!r} as a {what}; write it like {examples}")
        num, unit = float(m.group("num")), m.group("unit")
    if not math.isfinite(num):
        raise UnitError(f"{text!r} is not a finite {what}; write it like {examples}")
    return num, unit


def _lookup(unit: str, table: dict, text: object, what: str, examples: str,
            case_sensitive: bool = False) -> float:
    key = unit if case_sensitive else unit.lower()
    if key not in table:
        raise UnitError(f"unknown unit {unit!r} in {text!r} for a {what}; write it like {examples}")
    return table[key]


def parse_rate_bps(text: str | int | float) -> int:
    """'100Gbps' -> 100_000_000_000. A bare number is bits per second."""
    examples = "'100Gbps', '25Gb/s', '400Mbps'"
    num, unit = _split(text, "rate", examples)
    if unit == "":
        return int(round(num))
    # 'GB/s' and 'Bps' would be bytes; refuse them rather than guess.
    if "B" in unit:
        raise UnitError(f"{text!r} looks like bytes per second; "
                        f"write rates in bits, e.g. {examples}")
    return int(round(num * _lookup(unit, RATE_UNITS_BPS, text, "rate", examples)))


def parse_duration_ns(text: str | int | float) -> int:
    """'2us' -> 2000. A bare number is nanoseconds."""
    examples = "'500ns', '2us', '1.5ms'"
    num, unit = _split(text, "duration", examples)
    if unit == "":
        return int(round(num))
    return int(round(num * _lookup(unit, TIME_UNITS_NS, text, "duration", examples)))


def parse_size_bytes(text: str | int | float) -> int:
    """'512KB' -> 512_000, '512KiB' -> 524_288. A bare number is bytes."""
    examples = "'9000', '512KB', '4MiB'"
    num, unit = _split(text, "size", examples)
    if unit.lower() in ("kb", "mb", "gb", "kib", "mib", "gib", "b"):
        if unit[-1] == "b":
            raise UnitError(f"{text!r}: lower-case 'b' means bits; "
                            f"sizes are bytes, e.g. {examples}")
    return int(round(num * _lookup(unit, SIZE_UNITS_BYTES, text, "size", examples)))


def parse_length_m(text: str | int | float) -> float:
    """'100m' -> 100.0, '2km' -> 2000.0. A bare number is metres."""
    examples = "'2m', '100m', '2km'"
    num, unit = _split(text, "length", examples)
    if unit == "":
        return num
    return num * _lookup(unit, LENGTH_UNITS_M, text, "length", examples)


def format_rate(bps: float) -> str:
    for unit, scale in (("Tbps", 1e12), ("Gbps", 1e9), ("Mbps", 1e6), ("kbps", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g}{unit}"
    return f"{bps:g}bps"


def format_size(n_bytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:g}{unit}"
    return f"{n_bytes:g}B"


def format_duration(ns: float) -> str:
    for unit, scale in (("s", 1e9), ("ms", 1e6), ("us", 1e3)):
        if ns >= scale:
            return f"{ns / scale:g}{unit}"
    return f"{ns:g}ns"
