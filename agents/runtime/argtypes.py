"""argparse types shared by the agents' command lines: bad values fail with exit code 2."""

from __future__ import annotations

import argparse
import ipaddress
import json


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def nonneg_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be 0..65535, got {value}")
    return value


def dscp(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 63:
        raise argparse.ArgumentTypeError(f"DSCP must be 0..63, got {value}")
    return value


def probability(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


def json_object(text: str) -> dict:
    """A JSON object (`{"g": 0.0625}`); anything else is an argument error."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def ip_network(text: str) -> str:
    """An IP subnet in CIDR form (`10.0.0.0/16`; host bits allowed), kept as text."""
    try:
        ipaddress.ip_network(text, strict=False)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an IP subnet (CIDR, e.g. 10.0.0.0/16): "
                                         f"{text!r}") from None
    return text
