"""`cc_params`: per-workload DCQCN / DCTCP parameters of a RoCE entry.

Keys are the agents' parameter names (agents.rdma.cc.DcqcnParams / DctcpParams fields)
without their unit suffix, the way every quantity of a config is named; values are
absolute for the sender's link (a per-25G preset is scaled first, then overridden).
tests/unit/test_workload_roce.py keeps the field names equal to the agent's tunables.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Annotated, Literal

from pydantic import (
    BeforeValidator,
    Field,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
)
from pydantic_core import InitErrorDetails

from testbed.fields import DurationNs, RateBps, SizeBytes, Strict, quantity_schema
from testbed.units import (
    QUANTITY_PATTERN,
    format_rate,
    parse_duration_ns,
    parse_rate_bps,
    parse_size_bytes,
)
from testbed.workloads.base import TrafficEntry
from testbed.workloads.rdma import DEFAULT_CC_PRESETS, parse_cc_preset


def _none_or(parse: Callable[[object], object]) -> Callable[[object], object]:
    """`parse`, but None and 'none' mean none (a parameter the agents take as None)."""
    def parse_or_none(value: object) -> object:
        if value is None or (isinstance(value, str) and value.strip().lower() == "none"):
            return None
        return parse(value)
    return parse_or_none


def _quantity_or_none_schema(number: dict, what: str, examples: list[str]) -> WithJsonSchema:
    return WithJsonSchema({
        "anyOf": [{"type": "string", "pattern": QUANTITY_PATTERN}, number,
                  {"const": "none"}, {"type": "null"}],
        "description": f"{what}, or none, e.g. {', '.join(examples)}",
        "examples": examples,
    })


PositiveDurationNs = Annotated[int, BeforeValidator(parse_duration_ns), Field(gt=0),
                               quantity_schema({"type": "integer", "exclusiveMinimum": 0},
                                                "a duration above 0 (bare number: ns)",
                                                ["55us", "4us", "1ms"])]
_Positive = Annotated[int, Field(gt=0)]
DurationOrNone = Annotated[_Positive | None, BeforeValidator(_none_or(parse_duration_ns)),
                           _quantity_or_none_schema(
                               {"type": "integer", "exclusiveMinimum": 0},
                               "a duration above 0 (bare number: ns)", ["50us", "none"])]
SizeOrNone = Annotated[_Positive | None, BeforeValidator(_none_or(parse_size_bytes)),
                       _quantity_or_none_schema({"type": "integer", "exclusiveMinimum": 0},
                                                "a size above 0 (bare number: bytes)",
                                                ["10MB", "300KB", "none"])]
RateOrNone = Annotated[_Positive | None, BeforeValidator(_none_or(parse_rate_bps)),
                       _quantity_or_none_schema({"type": "integer", "exclusiveMinimum": 0},
                                                "a rate above 0 (bare number: bit/s)",
                                                ["615Mbps", "none"])]
Gain = Annotated[float, Field(gt=0, le=1)]
Fraction = Annotated[float, Field(ge=0, le=1)]


class DcqcnCcParams(Strict):
    """DCQCN parameters of one workload, on top of its preset (docs/dcqcn.md)."""

    alpha_timer_ns: PositiveDurationNs | None = Field(
        None, alias="alpha_timer", description="alpha update period (HPCC ALPHA_RESUME_INTERVAL)")
    increase_timer_ns: PositiveDurationNs | None = Field(
        None, alias="increase_timer", description="rate-increase timer T (HPCC RP_TIMER)")
    rate_decrease_interval_ns: DurationOrNone = Field(
        None, alias="rate_decrease_interval",
        description="one cut per this tick (HPCC RATE_DECREASE_INTERVAL); none: cut on each CNP")
    byte_counter_bytes: SizeOrNone = Field(
        None, alias="byte_counter", description="byte counter BC; none: no byte counter")
    g: Gain | None = Field(None, description="alpha gain (HPCC EWMA_GAIN), e.g. 0.00390625")
    fast_recovery_steps: Annotated[int, Field(ge=1)] | None = Field(
        None, description="F: increase events before additive increase (FAST_RECOVERY_TIMES)")
    rai_bps: RateBps | None = Field(None, alias="rai", description="additive increase R_AI")
    rhai_bps: RateBps | None = Field(None, alias="rhai", description="hyper increase R_HAI")
    min_rate_bps: RateBps | None = Field(None, alias="min_rate", description="lowest rate")
    initial_alpha: Fraction | None = Field(None, description="alpha before the first CNP")
    cnp_interval_ns: DurationNs | None = Field(
        None, alias="cnp_interval",
        description="receiver: at most one CNP per QP per this time (0: every CE packet)")
    np_mode: Literal["interval", "timer"] | None = Field(
        None, description="receiver: interval since the last CNP, or free-running slots")
    alpha_update: Literal["on_cnp", "periodic"] | None = Field(
        None, description="alpha on each CNP (paper), or once per alpha period (HPCC)")
    cut_with_updated_alpha: bool | None = Field(
        None, description="update alpha before the cut it causes (ns3-rdma)")
    target_clamp: Literal["always", "after_increase"] | None = Field(
        None, description="Rt = Rc on every cut, or only after an increase (CLAMP_TARGET_RATE 0)")
    increase_rule: Literal["qcn", "mlx"] | None = Field(
        None, description="phase rule: QCN's two counters, or HPCC's event count")
    hyper_scaled: bool | None = Field(None, description="hyper step i x R_HAI instead of R_HAI")
    hyper_halves_periods: bool | None = Field(
        None, description="in hyper increase, T and BC run at half period (ns3-rdma)")
    rt_shrink_quirk: bool | None = Field(None, description="ns3-rdma's Rt /= 8 quirk")


class DctcpCcParams(Strict):
    """DCTCP parameters of one workload, on top of its preset (docs/dcqcn.md)."""

    window_ns: PositiveDurationNs | None = Field(
        None, alias="window", description="one DCTCP window (an RTT estimate)")
    g: Gain | None = Field(None, description="alpha gain, e.g. 0.0625")
    rai_bps: RateOrNone = Field(
        None, alias="rai", description="increase per clean window; none: one MSS per window")
    mss_bytes: SizeBytes | None = Field(None, alias="mss", description="segment size")
    min_rate_bps: RateBps | None = Field(None, alias="min_rate", description="lowest rate")
    initial_alpha: Fraction | None = Field(None, description="alpha before the first window")
    cnp_marked_bytes: SizeOrNone = Field(
        None, alias="cnp_marked", description="marked bytes one CNP stands for; none: one MSS")


CC_PARAMS_MODELS: dict[str, type[Strict]] = {"dcqcn": DcqcnCcParams, "dctcp": DctcpCcParams}
# Keys that are the switch's ECN marking (the CP): set on the port class, not per workload.
_SWITCH_KEYS = ("kmin", "kmax", "pmax", "k")


def cc_param_keys(cc: str) -> list[str]:
    """The keys `cc_params` takes for congestion control `cc`, as written in a config."""
    model = CC_PARAMS_MODELS[cc]
    return [f.alias or n for n, f in model.model_fields.items()]


def _nullable(model: type[Strict], key: str) -> bool:
    """Whether `key` takes none (its type parses 'none': byte_counter, rai, ...)."""
    field = next(f for n, f in model.model_fields.items() if (f.alias or n) == key)
    return any(isinstance(m, BeforeValidator) and m.func.__name__ == "parse_or_none"
               for m in field.metadata)


def validate_cc_params(value: object, cc: str) -> Strict:
    """`cc_params` of an entry whose `cc` is `cc`, validated key by key: every problem at
    once, each at cc_params.<key>, unknown keys with a did-you-mean and the valid keys."""
    if cc == "none":
        raise ValueError("cc: none has no parameters; remove cc_params or pick cc: dcqcn "
                         "or dctcp")
    if not isinstance(value, dict):
        raise ValueError("expected a mapping of parameter: value (e.g. {alpha_timer: 1us, "
                         f"g: 0.0625}}), got {type(value).__name__}")
    kind = cc.upper()
    other = next(k for k in CC_PARAMS_MODELS if k != cc)
    model = CC_PARAMS_MODELS[cc]
    keys = cc_param_keys(cc)
    listed = f"{kind} parameters: {', '.join(keys)}"
    errors: list[InitErrorDetails] = []
    known: dict[str, object] = {}

    def problem(key: str, text: str) -> None:
        errors.append(InitErrorDetails(type="value_error", loc=(key,), input=value[key],
                                       ctx={"error": ValueError(text)}))

    for key, item in value.items():
        name = str(key)
        if name in keys:
            if item is None and not _nullable(model, name):
                problem(key, f"{name} needs a value; only "
                        f"{', '.join(k for k in keys if _nullable(model, k))} may be none")
            else:
                known[name] = item
        elif name in _SWITCH_KEYS:
            problem(key, f"{name} is the switch's ECN marking, not a {kind} parameter; set it "
                         f"on the port class (qos.<class>.ecn.{name})")
        elif name in cc_param_keys(other):
            problem(key, f"{name} is a {other.upper()} parameter, but this entry has cc: {cc}; "
                         f"{listed}")
        else:
            close = difflib.get_close_matches(name, keys, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            problem(key, f"unknown {kind} parameter {name!r}{hint} ({listed})")
    try:
        params = model.model_validate(known)
    except ValidationError as exc:
        for e in exc.errors():
            detail = InitErrorDetails(type=e["type"], loc=e["loc"], input=e["input"])
            if "ctx" in e:
                detail["ctx"] = e["ctx"]
            errors.append(detail)
    if errors:
        raise ValidationError.from_exception_data("cc_params", errors)
    return params


class RdmaCcEntry(TrafficEntry):
    """What every traffic entry over the user-space RoCE transport shares beyond its
    fields: how its `cc_preset` and `cc_params` are read and what the agents are given.
    A kind's model derives from this and declares `cc`, `cc_preset` and `cc_params`
    itself (with its own descriptions and defaults)."""

    @field_validator("cc_preset", mode="before", check_fields=False)
    @classmethod
    def _cc_preset(cls, value: object) -> object:
        return parse_cc_preset(value)

    @field_validator("cc_params", mode="before", check_fields=False)
    @classmethod
    def _cc_params(cls, value: object, info: ValidationInfo) -> object:
        cc = info.data.get("cc")
        if value is None or cc is None:      # no cc_params, or a bad cc (reported there)
            return None
        return validate_cc_params(value, cc)

    @property
    def preset(self) -> str | None:
        """The parameter set the agents get: cc_preset, or the default of `cc`."""
        return getattr(self, "cc_preset", None) or DEFAULT_CC_PRESETS.get(
            getattr(self, "cc", ""))

    def cc_overrides(self) -> dict[str, object]:
        """The parameters `cc_params` sets, by the agents' names (DcqcnParams fields)."""
        params = getattr(self, "cc_params", None)
        if params is None:
            return {}
        return params.model_dump(include=params.model_fields_set)


def cc_params_problems(t: RdmaCcEntry, loc: tuple, senders: Sequence[str],
                       nic_bps: Mapping[str, int]) -> Iterator[tuple[tuple, str]]:
    """What cc_params' own validation cannot see: the entry's other fields, the NICs of
    its senders."""
    params = getattr(t, "cc_params", None)
    if params is None:
        return
    given = params.model_fields_set
    if "cnp_interval_ns" in given and getattr(t, "cnp_interval_ns", None) is not None:
        yield (loc + ("cc_params", "cnp_interval"), "cnp_interval is given twice, here and "
               "as the entry's cnp_interval; keep one of them")
    min_rate = params.min_rate_bps if "min_rate_bps" in given else None
    slow = sorted((nic_bps[s], s) for s in set(senders) if s in nic_bps)
    if min_rate is not None and slow and min_rate > slow[0][0]:
        yield (loc + ("cc_params", "min_rate"), f"{format_rate(min_rate)} is above the line "
               f"rate of sender {slow[0][1]} ({format_rate(slow[0][0])}); the minimum rate "
               "must not exceed any sender's NIC rate")
