"""The fabric config as validated pydantic models.

Every model forbids unknown fields, so a typo is an error rather than a
silently ignored setting. Quantities are written as strings with units
(`100Gbps`, `2us`, `512KB`) and parsed once, here, into integers whose field
names carry the unit. Cross-field checks that need the whole fabric (names
that links refer to, thresholds against buffers) live in `checks.py` so each
problem is reported with its own location.
"""

from __future__ import annotations

import difflib
import ipaddress
from collections.abc import Callable
from typing import Annotated, Literal, get_args

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
)
from pydantic_core import PydanticCustomError

from testbed.units import (
    QUANTITY_PATTERN,
    parse_duration_ns,
    parse_length_m,
    parse_rate_bps,
    parse_size_bytes,
)

FORMAT_VERSION = 1


def _quantity_schema(number: dict, what: str, examples: list[str]) -> WithJsonSchema:
    # What the YAML may hold, not what the parser returns: a string with a unit,
    # or a bare number in the base unit. The units themselves are checked on load.
    return WithJsonSchema({
        "anyOf": [{"type": "string", "pattern": QUANTITY_PATTERN}, number],
        "description": f"{what}, e.g. {', '.join(examples)}",
        "examples": examples,
    })


RateBps = Annotated[int, BeforeValidator(parse_rate_bps), Field(gt=0), _quantity_schema(
    {"type": "integer", "exclusiveMinimum": 0},
    "a rate in bits per second (bare number: bit/s)", ["100Gbps", "25Gb/s", "400Mbps"])]
SizeBytes = Annotated[int, BeforeValidator(parse_size_bytes), Field(ge=0), _quantity_schema(
    {"type": "integer", "minimum": 0},
    "a size in bytes, KB = 1000 B, KiB = 1024 B (bare number: bytes)", ["9000", "512KB", "4MiB"])]
DurationNs = Annotated[int, BeforeValidator(parse_duration_ns), Field(ge=0), _quantity_schema(
    {"type": "integer", "minimum": 0},
    "a duration (bare number: nanoseconds)", ["500ns", "2us", "1.5ms"])]
LengthM = Annotated[float, BeforeValidator(parse_length_m), Field(gt=0), _quantity_schema(
    {"type": "number", "exclusiveMinimum": 0},
    "a cable length (bare number: metres)", ["2m", "100m", "2km"])]

NAME_RE = r"^[a-z][a-z0-9_]*$"
LAB_NAME_RE = r"^[a-z][a-z0-9]{0,15}$"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TrafficClass(Strict):
    """One of the eight 802.1p priorities, selected by DSCP."""

    tc: int = Field(ge=0, le=7, description="traffic class = 802.1p priority (0..7); one "
                                            "class per value")
    name: str = Field(pattern=NAME_RE, description="the class's name, unique; traffic entries "
                                                    "(tclass:) and reports use it")
    dscp: list[Annotated[int, Field(ge=0, le=63)]] = Field(
        default_factory=list, description="DSCP values (0..63) that select this class, each in "
                                          "one class only; the agents send the first")
    lossless: bool = Field(False, description="PFC protects this class")
    ecn: bool = Field(False, description="ECN marking (DCQCN CP) on this class")
    strict: bool = Field(False, description="strict priority: served before the weighted "
                                            "classes (HTB prio 0, 1 % guaranteed, borrows first)")
    weight: int = Field(1, ge=1, le=100, description="ETS weight among the non-strict classes: "
                                                     "their guaranteed share of the port")
    default: bool = Field(False, description="the class of packets whose DSCP no class names; "
                                             "exactly one class has it")


def default_traffic_classes() -> list[TrafficClass]:
    # The usual RoCE class plan: RoCE data at DSCP 26 -> TC3, lossless (PFC) and
    # ECN-marked; CNPs at DSCP 48 -> TC6, strict priority (where NVIDIA NICs send
    # them: DSCP 48, priority 6); everything else TC0, lossy.
    return [
        TrafficClass(tc=3, name="roce", dscp=[26], lossless=True, ecn=True, weight=1),
        TrafficClass(tc=6, name="cnp", dscp=[48], strict=True),
        TrafficClass(tc=0, name="default", dscp=[], weight=1, default=True),
    ]


EcnPresetName = Literal["hpcc-ns3", "dcqcn-paper", "ns3-rdma"]


class EcnConfig(Strict):
    """DCQCN CP marking curve. A preset, or kmin/kmax/pmax, or a step at k."""

    preset: EcnPresetName | None = Field(
        None, description="a named curve (kmin / kmax / pmax): hpcc-ns3 (100 KB / 400 KB per "
                          "25 Gb/s of port rate / 0.2), dcqcn-paper (5 KB / 200 KB / 0.01), "
                          "ns3-rdma (40 KB / 1000 KB / 1); not with kmin/kmax or k. An ecn "
                          "mapping with none of them is dcqcn-paper")
    kmin_bytes: SizeBytes | None = Field(
        None, alias="kmin", description="queue at which marking starts (no marks at or below "
                                        "it); goes with kmax")
    kmax_bytes: SizeBytes | None = Field(
        None, alias="kmax", description="queue at which the mark probability reaches pmax; "
                                        "every packet is marked above it")
    pmax: float | None = Field(None, gt=0, le=1, description="mark probability at kmax, rising "
                                                             "linearly from kmin (unset: 1)")
    k_bytes: SizeBytes | None = Field(None, alias="k", description="step marking (DCTCP style): "
                                      "every packet is marked above this queue")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class PfcConfig(Strict):
    """802.1Qbb priority flow control on a port class."""

    enabled: bool = Field(True, description="PFC on the class's ports; false: lossless "
                                            "classes are not protected (they can drop)")
    priorities: list[Annotated[int, Field(ge=0, le=7)]] | None = Field(
        None, description="paused priorities, each a lossless class; default: every lossless "
                          "class")
    xoff_bytes: SizeBytes | None = Field(
        None, alias="xoff", description="static mode: an ingress port holding this much of the "
                                        "priority sends XOFF (default: half the class buffer)")
    xon_bytes: SizeBytes | None = Field(
        None, alias="xon", description="static mode: XON when the ingress falls to this "
                                       "(default: xoff - 2 frames of MTU)")
    headroom_bytes: SizeBytes | None = Field(
        None, alias="headroom",
        description="what a port must still absorb after its XOFF (default: Cisco's formula, "
                    "MTU + 2 x delay x rate + response + MTU, with the emulated PFC loop's "
                    "response as far as the buffer has room; docs/config.md, Port classes)")
    watchdog_ns: DurationNs | None = Field(
        None, alias="watchdog",
        description="PFC watchdog: a class paused this long (fabric time) is declared stormed "
                    "and forwarded regardless until the pauses stop; off by default")
    mode: Literal["static", "dynamic"] = Field(
        "static", description="static: XOFF when an ingress port holds xoff bytes of the "
                              "priority (of the shared pool's part with switch_buffer), XON at "
                              "xon; dynamic: XOFF when an ingress's use of the shared pool "
                              "passes alpha x the pool's free space (HPCC's ns-3 SwitchMmu); "
                              "without a switch_buffer the pool is the switch's port buffers "
                              "summed; default: dynamic with a switch_buffer, else static")
    alpha: float = Field(0.125, gt=0, le=8,
                         description="dynamic mode: XOFF above alpha x the free shared buffer "
                                     "(HPCC: 1/8, pfc_a_shift 3)")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class PortClass(Strict):
    """Queueing settings shared by every port that names this class."""

    buffer: dict[Annotated[int, Field(ge=0, le=7)], SizeBytes] = Field(
        default_factory=dict,
        description="byte limit of each traffic class's queue at a port, by tc; a class not "
                    "named gets 2MB if lossless, 256KB if strict, else 1MB",
        json_schema_extra={"propertyNames": {"pattern": "^[0-7]$"}})
    # HPCC's ns-3 figures for 25G, unscaled: marks start well below the
    # default PFC XOFF at every port speed, so DCQCN acts before PFC.
    ecn: EcnConfig = Field(
        default_factory=lambda: EcnConfig(kmin="100KB", kmax="400KB", pmax=0.2),
        description="ECN marking curve of the classes with ecn: true, at switch ports (host "
                    "NICs never mark); default: HPCC's ns-3 switch setting, unscaled")
    pfc: PfcConfig = Field(default_factory=PfcConfig,
                           description="priority flow control of the lossless classes")


class LinkSpec(Strict):
    """The physical layer of a link: a port type from the PHY catalogue and a length."""

    port: str = Field(description="IEEE 802.3 port type from the PHY catalogue, e.g. "
                                  "400GBASE-DR4 (testbed phy --list)")
    length_m: LengthM = Field(alias="length", description="cable length; the PHY model "
                              "derives the link's delay and bit error ratio from it")
    qos: str = Field("default", description="port class (key of `qos`) for both ends")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


_HOST_LINK = "every host's link to its switch"


class LeafSpine(Strict):
    """A two-tier Clos: every leaf linked to every spine, hosts on the leaves."""

    kind: Literal["leaf_spine"] = Field(description="the topology's kind")
    spines: int = Field(ge=1, le=64, description="spine switches, spine1..")
    leaves: int = Field(ge=1, le=128, description="leaf switches, leaf1..")
    hosts_per_leaf: int = Field(ge=1, le=64, description="hosts on each leaf; h1.. numbered "
                                                         "across the fabric")
    host_link: LinkSpec = Field(description=_HOST_LINK)
    fabric_link: LinkSpec = Field(description="every leaf-spine link")


class SingleSwitch(Strict):
    """One switch, sw1, with every host on it."""

    kind: Literal["single_switch"] = Field(description="the topology's kind")
    hosts: int = Field(ge=1, le=256, description="hosts, h1..")
    host_link: LinkSpec = Field(description=_HOST_LINK)


class Ring(Strict):
    """Switches sw1.. in a ring, each linked to its two neighbours, hosts on every switch."""

    kind: Literal["ring"] = Field(description="the topology's kind")
    switches: int = Field(ge=3, le=64, description="switches in the ring, sw1..")
    hosts_per_switch: int = Field(ge=1, le=64, description="hosts on each switch; h1.. "
                                                           "numbered across the fabric")
    host_link: LinkSpec = Field(description=_HOST_LINK)
    fabric_link: LinkSpec = Field(description="every switch-switch link of the ring")


Topology = Annotated[LeafSpine | SingleSwitch | Ring, Field(discriminator="kind")]


class Node(Strict):
    """A node given by hand; it may add to a generated topology."""

    name: str = Field(pattern=NAME_RE, max_length=15,
                      description="unique node name; its namespace is tb-<lab>-<name>")
    role: Literal["host", "switch"] = Field(
        description="host: runs traffic agents, NICs eth0..; switch: routes (ECMP), ports swp1..")


class Link(Strict):
    """A link given by hand between two nodes, as LinkSpec with its two ends."""

    a: str = Field(description="node name of one end")
    b: str = Field(description="node name of the other end")
    port: str = Field(description="IEEE 802.3 port type from the PHY catalogue, e.g. "
                                  "100GBASE-CR1 (testbed phy --list)")
    length_m: LengthM = Field(alias="length", description="cable length; the PHY model "
                              "derives the link's delay and bit error ratio from it")
    qos: str = Field("default", description="port class (key of `qos`) for both ends")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


EcnCodepoint = Literal["notect", "ect0", "ect1", "ce"]


class UdpTraffic(Strict):
    """Paced UDP flows: N:1 incast, all-to-all among hosts, or explicit pairs.

    Rates, start times and durations are fabric units. A flow's rate defaults
    to the sender's NIC line rate shared by the sender's flows of this entry.
    """

    name: str = Field(pattern=NAME_RE)
    kind: Literal["udp_incast", "udp_all_to_all", "udp_pairs"]
    senders: list[str] | None = Field(None, description="udp_incast: sending hosts")
    receiver: str | None = Field(None, description="udp_incast: the receiving host")
    hosts: list[str] | None = Field(None, description="udp_all_to_all: hosts (default all)")
    pairs: list[tuple[str, str]] | None = Field(None, description="udp_pairs: [src, dst] lists")
    rate_bps: RateBps | None = Field(
        None, alias="rate",
        description="per sender->receiver stream, fabric (default: line rate over its streams)")
    size_bytes: SizeBytes | None = Field(None, alias="size",
                                         description="UDP payload (default: MTU - 28)")
    start_ns: DurationNs = Field(0, alias="start")
    duration_ns: DurationNs = Field(alias="duration")
    tclass: str | int = Field("default", description="traffic class name or number")
    ecn: EcnCodepoint = "notect"
    flows: int = Field(1, ge=1, le=64, description="flows (source ports) per sender-receiver pair")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


RoceKind = Literal["roce_incast", "roce_all_to_all", "roce_pairs"]
# agents.roce.qp.MAX_WINDOW_PACKETS: the most unacknowledged packets a QP may have.
MAX_ROCE_WINDOW_PACKETS = 1 << 22


# --- cc_params: per-workload DCQCN / DCTCP parameters ----------------------------------
#
# Keys are the agents' parameter names (agents.roce.cc.DcqcnParams / DctcpParams fields)
# without their unit suffix, the way every quantity of this config is named; values are
# absolute for the sender's link (a per-25G preset is scaled first, then overridden).
# tests/unit/test_workload_roce.py keeps the field names equal to the agent's tunables.

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
                               _quantity_schema({"type": "integer", "exclusiveMinimum": 0},
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


def _cc_params(value: object, cc: str) -> Strict:
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
    errors: list[dict] = []
    known: dict[str, object] = {}

    def problem(key: object, text: str) -> None:
        errors.append({"type": "value_error", "loc": (key,), "input": value[key],
                       "ctx": {"error": ValueError(text)}})

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
        errors += [{"type": e["type"], "loc": e["loc"], "input": e["input"],
                    **({"ctx": e["ctx"]} if "ctx" in e else {})} for e in exc.errors()]
    if errors:
        raise ValidationError.from_exception_data("cc_params", errors)
    return params
# agents.roce.cc's PRESETS (DCQCN) and DCTCP_PRESETS; check_workload pairs them with `cc`
# and tests/unit/test_workload_roce.py keeps this list equal to the agent's.
CcPresetName = Literal["hpcc-ns3-paper", "hpcc-ns3", "hpcc-ns3-config", "paper", "ns3-rdma",
                       "rfc8257"]
# hpcc-ns3-paper (HPCC run.py's dcqcn_paper) is the half of the setting whose switch marking
# the default port class uses; docs/config.md says why it, not run.py's dcqcn, is the default.
DEFAULT_CC_PRESETS = {"dcqcn": "hpcc-ns3-paper", "dctcp": "rfc8257"}


class RoceTraffic(Strict):
    """RDMA WRITE or SEND streams over the user-space RoCEv2 RC transport (agents/roce).

    Each (source, destination) stream is one perftest-style client on the source
    and its own server on the destination; `qps` queue pairs per stream. Start
    and duration are fabric time: a client posts messages for `duration`, then
    waits for the outstanding ones; or it posts exactly `messages` per QP. `cc`
    is the sender's rate controller and the receiver's CNP policy (DCQCN by
    default, with HPCC's ns-3 "dcqcn_paper" parameter set, whose switch half is
    the default port class's ECN curve).
    """

    name: str = Field(pattern=NAME_RE)
    kind: RoceKind
    senders: list[str] | None = Field(None, description="roce_incast: sending hosts")
    receiver: str | None = Field(None, description="roce_incast: the receiving host")
    hosts: list[str] | None = Field(None, description="roce_all_to_all: hosts (default all)")
    pairs: list[tuple[str, str]] | None = Field(None, description="roce_pairs: [src, dst] lists")
    test: Literal["write_bw", "send_bw"] = Field(
        "write_bw", description="RDMA WRITE or SEND bandwidth test (as perftest's ib_*_bw)")
    size_bytes: SizeBytes = Field(65536, alias="size", description="message bytes")
    qps: int = Field(1, ge=1, le=16, description="queue pairs per sender->receiver stream")
    window_packets: Annotated[int, Field(ge=1, le=MAX_ROCE_WINDOW_PACKETS)] | Literal[
        "auto"] = Field(
        "auto", alias="window",
        description="most unacknowledged packets per QP, 1..2^22, or auto: enough not to bind "
                    "at line rate over the fabric's longest round trip with every queue of "
                    "the class on it full (docs/roce.md, 'In-flight window')")
    start_ns: DurationNs = Field(0, alias="start")
    duration_ns: DurationNs | None = Field(
        None, alias="duration",
        description="post messages for this fabric time, then wait for the outstanding ones "
                    "(give this or messages)")
    messages: int | None = Field(
        None, ge=1, description="post exactly this many messages per QP, then wait for them "
                                "(give this or duration)")
    cc: Literal["dcqcn", "dctcp", "none"] = Field(
        "dcqcn", description="congestion control: sender rate control and receiver CNPs")
    cc_preset: CcPresetName | None = Field(
        None, description="parameter set: DCQCN hpcc-ns3-paper (default), hpcc-ns3, "
                          "hpcc-ns3-config, paper, ns3-rdma; DCTCP rfc8257 (default), hpcc-ns3")
    cnp_interval_ns: DurationNs | None = Field(
        None, alias="cnp_interval",
        description="receiver: at most one CNP per QP per this fabric time (default: the "
                    "preset's; DCTCP: every CE packet)")
    cc_params: DcqcnCcParams | DctcpCcParams | None = Field(
        None, description="DCQCN or DCTCP parameters (as `cc`) in place of the preset's: "
                          "absolute values for the sender's link (docs/dcqcn.md)")
    tclass: str | int = Field("roce", description="traffic class name or number")
    verify: bool = Field(True, description="the receiver checks every byte written or sent")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @field_validator("window_packets", mode="before")
    @classmethod
    def _window(cls, value: object) -> object:
        # One clear message instead of one per member of the int | 'auto' union.
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool)
                               and 1 <= value <= MAX_ROCE_WINDOW_PACKETS):
            return value
        hint = (" (DCTCP's window, a time, is cc_params.window)"
                if isinstance(value, str) and value != "auto" else "")
        raise ValueError(f"expected a whole number of packets, 1..2^22 ({MAX_ROCE_WINDOW_PACKETS}),"
                         f" or auto, got {value!r}{hint}")

    @field_validator("cc_params", mode="before")
    @classmethod
    def _cc_params(cls, value: object, info: ValidationInfo) -> object:
        cc = info.data.get("cc")
        if value is None or cc is None:      # no cc_params, or a bad cc (reported there)
            return None
        return _cc_params(value, cc)

    @property
    def preset(self) -> str | None:
        """The parameter set the agents get: cc_preset, or the default of `cc`."""
        return self.cc_preset or DEFAULT_CC_PRESETS.get(self.cc)

    def cc_overrides(self) -> dict[str, object]:
        """The parameters `cc_params` sets, by the agents' names (DcqcnParams fields)."""
        if self.cc_params is None:
            return {}
        return self.cc_params.model_dump(include=self.cc_params.model_fields_set)


Traffic = UdpTraffic | RoceTraffic


def _traffic_items(value: object) -> object:
    """Validate each traffic entry against the model its `kind` names.

    A plain union would report every problem once per member (and a tagged one
    puts the tag into the location); this reports each entry's problems at
    `workload.traffic[i].field`, as the user wrote them.
    """
    if not isinstance(value, list):
        return value        # the list type reports it
    kinds: dict[str, type[Strict]] = {
        k: model for model in (UdpTraffic, RoceTraffic)
        for k in get_args(model.model_fields["kind"].annotation)}
    out: list[object] = []
    errors: list[dict] = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            out.append(item)
            continue
        kind = item.get("kind")
        model = kinds.get(kind) if isinstance(kind, str) else None
        if model is None and "kind" in item:
            errors.append({"type": "literal_error", "loc": (i, "kind"), "input": kind,
                           "ctx": {"expected": ", ".join(repr(k) for k in kinds)}})
            continue
        model = model or UdpTraffic
        try:
            out.append(model.model_validate(item))
        except ValidationError as exc:
            errors += _entry_errors(i, model, kinds, exc)
    if errors:
        raise ValidationError.from_exception_data("traffic", errors)
    return out


def _entry_errors(i: int, model: type[Strict], kinds: dict[str, type[Strict]],
                  exc: ValidationError) -> list[dict]:
    """One traffic entry's errors, located under its index; unknown fields say which
    fields this kind has (the loader cannot tell which member of the union applies)."""
    fields = sorted(f.alias or n for n, f in model.model_fields.items())
    other_fields = {(f.alias or n): [k for k, m2 in kinds.items() if m2 is m]
                    for m in set(kinds.values()) - {model}
                    for n, f in m.model_fields.items() if (f.alias or n) not in fields}
    out: list[dict] = []
    meant: set[str] = set()
    for e in exc.errors():
        loc = (i, *e["loc"])
        if e["type"] == "extra_forbidden" and len(e["loc"]) == 1:
            name = str(e["loc"][0])
            close = difflib.get_close_matches(name, fields, n=1)
            if name in other_fields:
                text = (f"unknown field {name!r}: only {', '.join(other_fields[name])} "
                        f"traffic has it; fields here: {', '.join(fields)}")
            elif close:
                meant.add(close[0])
                text = f"unknown field {name!r}; did you mean {close[0]!r}?"
            else:
                text = f"unknown field {name!r}; fields here: {', '.join(fields)}"
            out.append({"type": PydanticCustomError("unknown_field", text), "loc": loc,
                        "input": e["input"]})
        else:
            out.append({"type": e["type"], "loc": loc, "input": e["input"],
                        **({"ctx": e["ctx"]} if "ctx" in e else {})})
    # a misspelt required field is also missing; the did-you-mean says it all
    return [e for e in out if not (e["type"] == "missing" and len(e["loc"]) == 2
                                   and e["loc"][1] in meant)]


class Workload(Strict):
    """What `testbed run` drives on the fabric, and how it samples."""

    sample_period_ns: DurationNs | None = Field(
        None, alias="sample_period",
        description="fabric time between counter samples (default: 100 ms of wall time)")
    drain_ns: DurationNs | None = Field(
        None, alias="drain", description="fabric time to let queues drain after traffic stops")
    traffic: list[Traffic] = Field(default_factory=list)

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @field_validator("traffic", mode="before")
    @classmethod
    def _traffic(cls, value: object) -> object:
        return _traffic_items(value)


class Impairment(Strict):
    """Extra packet loss on one link, in one or both directions (a bad cable, a bad optic)."""

    link: tuple[str, str] = Field(description="the link's two ends, [a, b]")
    direction: Literal["both", "forward", "reverse"] = Field(
        "both", description="forward: from link[0] to link[1]; reverse: the other way")
    loss: float = Field(ge=0, le=1, description="drop probability per packet (0.01 = 1 %)")

    model_config = ConfigDict(extra="forbid", frozen=True)


class SwitchBuffer(Strict):
    """The shared buffer of every switch: a Broadcom-style MMU, as HPCC's ns-3 SwitchMmu.

    Lossless (PFC) classes at switches draw from one pool per switch. Each ingress
    port and lossless priority has a reserved minimum and a headroom (the port
    class's pfc.headroom) set aside; the rest is shared. An ingress is paused when
    its use of the shared part passes its threshold (pfc.mode dynamic: alpha x the
    free shared space; static: pfc.xoff) and resumed when it falls resume_offset
    below it. What the headroom cannot take is dropped, and counted.
    Lossy classes keep their per-port buffers (qos.<class>.buffer).
    """

    size_bytes: SizeBytes = Field(alias="size", description="the pool, per switch "
                                  "(HPCC's BUFFER_SIZE, in MiB there: 2 is 2MiB)")
    reserve_bytes: SizeBytes = Field(
        4096, alias="reserve", description="reserved minimum per ingress port and lossless "
                                           "priority (HPCC: 4 KiB)")
    resume_offset_bytes: SizeBytes = Field(
        3072, alias="resume_offset",
        description="dynamic mode: XON when the ingress's shared use is this far below the "
                    "threshold (HPCC: 3 KiB)")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class Fabric(Strict):
    """A whole fabric: what `testbed validate/plan/up` read."""

    name: str = Field(pattern=LAB_NAME_RE, description="lab name, at most 16 characters; the "
                                                        "nodes' namespaces are tb-<name>-<node>")
    dilation: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto", description="time dilation D (the fabric runs D times slower), or auto: the "
                            "smallest of 1, 2, 5 x 10^k that keeps the busiest port's wall rate "
                            "within max_wall_port_rate")
    max_wall_port_rate_bps: RateBps | None = Field(
        None, alias="max_wall_port_rate",
        description="wall-rate budget per port for dilation: auto (default: calibrated or "
                    "200Mbps); a fixed D above it is a plan warning")
    address_pool: ipaddress.IPv4Network = Field(
        ipaddress.IPv4Network("198.18.0.0/15"),
        description="IPv4 pool the links' /31s come from (default: the benchmarking range)")
    mtu_bytes: int = Field(9000, alias="mtu", ge=1280, le=9216,
                           description="interface MTU of every port (a bare number)")
    roce_mtu_bytes: Literal[256, 512, 1024, 2048, 4096] = Field(
        4096, alias="roce_mtu", description="RoCE path MTU; needs mtu >= roce_mtu + 80")
    traffic_classes: list[TrafficClass] = Field(
        default_factory=default_traffic_classes,
        description="the class plan (default: RoCE TC3 lossless + ECN, CNP TC6 strict, the "
                    "rest TC0)")
    qos: dict[Annotated[str, Field(pattern=NAME_RE)], PortClass] = Field(
        default_factory=lambda: {"default": PortClass()},
        description="port classes by name; links pick one with qos:, `default` always exists",
        json_schema_extra={"propertyNames": {"pattern": NAME_RE}})
    topology: Topology | None = Field(None, description="a generated topology, chosen by kind")
    nodes: list[Node] = Field(default_factory=list,
                              description="nodes given by hand (may add to a topology)")
    links: list[Link] = Field(default_factory=list,
                              description="links given by hand (may add to a topology)")
    impairments: list[Impairment] = Field(default_factory=list,
                                          description="extra packet loss on links")
    switch_buffer: SwitchBuffer | None = Field(
        None, description="a shared buffer per switch for the lossless classes (absent: every "
                          "port keeps its own buffer per class, qos.<class>.buffer)")
    workload: Workload | None = Field(None, description="what `testbed run` drives")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @field_validator("dilation", mode="before")
    @classmethod
    def _dilation(cls, value: object) -> object:
        # One clear message instead of one per member of the int | 'auto' union.
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool)
                               and value >= 1):
            return value
        raise ValueError(f"expected a whole number >= 1 (the fabric runs that many times "
                         f"slower than real time) or 'auto', got {value!r}")

    @field_validator("qos")
    @classmethod
    def _qos_default(cls, value: dict[str, PortClass]) -> dict[str, PortClass]:
        if "default" not in value:
            value = {"default": PortClass(), **value}
        return value
