"""Pydantic field types for the quantities a config writes with units, and the strict base
model every config model derives from.

Quantities are written as strings with units (`100Gbps`, `2us`, `512KB`) or bare numbers
in the base unit, and parsed once (testbed.units) into integers whose field names carry
the unit (`rate_bps`, `duration_ns`, `size_bytes`). Shared by the fabric config
(testbed.config) and the workload kinds (testbed.workloads), below both in the layering.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema

from testbed.units import (
    QUANTITY_PATTERN,
    parse_duration_ns,
    parse_length_m,
    parse_rate_bps,
    parse_size_bytes,
)

NAME_RE = r"^[a-z][a-z0-9_]*$"


class Strict(BaseModel):
    """Unknown fields are errors (a typo must not be a silently ignored setting)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def quantity_schema(number: dict, what: str, examples: list[str]) -> WithJsonSchema:
    """The JSON schema of a quantity field: what the YAML may hold, not what the parser
    returns (a string with a unit, or a bare number in the base unit). The units
    themselves are checked on load."""
    return WithJsonSchema({
        "anyOf": [{"type": "string", "pattern": QUANTITY_PATTERN}, number],
        "description": f"{what}, e.g. {', '.join(examples)}",
        "examples": examples,
    })


RateBps = Annotated[int, BeforeValidator(parse_rate_bps), Field(gt=0), quantity_schema(
    {"type": "integer", "exclusiveMinimum": 0},
    "a rate in bits per second (bare number: bit/s)", ["100Gbps", "25Gb/s", "400Mbps"])]
SizeBytes = Annotated[int, BeforeValidator(parse_size_bytes), Field(ge=0), quantity_schema(
    {"type": "integer", "minimum": 0},
    "a size in bytes, KB = 1000 B, KiB = 1024 B (bare number: bytes)", ["9000", "512KB", "4MiB"])]
DurationNs = Annotated[int, BeforeValidator(parse_duration_ns), Field(ge=0), quantity_schema(
    {"type": "integer", "minimum": 0},
    "a duration (bare number: nanoseconds)", ["500ns", "2us", "1.5ms"])]
LengthM = Annotated[float, BeforeValidator(parse_length_m), Field(gt=0), quantity_schema(
    {"type": "number", "exclusiveMinimum": 0},
    "a cable length (bare number: metres)", ["2m", "100m", "2km"])]
