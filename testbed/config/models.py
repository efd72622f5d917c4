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
from typing import Annotated, Literal

from pydantic import (
    ConfigDict,
    Field,
    SerializeAsAny,
    ValidationError,
    field_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from testbed.fields import NAME_RE, DurationNs, LengthM, RateBps, SizeBytes, Strict
from testbed.workloads.base import TrafficEntry
from testbed.workloads.registry import REGISTRY

FORMAT_VERSION = 1


LAB_NAME_RE = r"^[a-z][a-z0-9]{0,15}$"


class TrafficClass(Strict):
    """One of the eight 802.1p priorities, selected by DSCP."""

    tc: int = Field(ge=0, le=7, description="traffic class = 802.1p priority (0..7)")
    name: str = Field(pattern=NAME_RE)
    dscp: list[Annotated[int, Field(ge=0, le=63)]] = Field(default_factory=list)
    lossless: bool = Field(False, description="PFC protects this class")
    ecn: bool = Field(False, description="ECN marking (DCQCN CP) on this class")
    strict: bool = Field(False, description="strict priority over the weighted classes")
    weight: int = Field(1, ge=1, le=100, description="ETS weight among non-strict classes")
    default: bool = Field(False, description="class for packets whose DSCP no class names")


def default_traffic_classes() -> list[TrafficClass]:
    # The usual RoCE class plan (FACTS.md): data DSCP 26 -> TC3 lossless + ECN,
    # CNP DSCP 48 -> TC6 strict, everything else TC0 lossy.
    return [
        TrafficClass(tc=3, name="roce", dscp=[26], lossless=True, ecn=True, weight=1),
        TrafficClass(tc=6, name="cnp", dscp=[48], strict=True),
        TrafficClass(tc=0, name="default", dscp=[], weight=1, default=True),
    ]


EcnPresetName = Literal["hpcc-ns3", "dcqcn-paper", "ns3-rdma"]


class EcnConfig(Strict):
    """DCQCN CP marking curve. A preset, or kmin/kmax/pmax, or a step at k."""

    preset: EcnPresetName | None = None
    kmin_bytes: SizeBytes | None = Field(None, alias="kmin")
    kmax_bytes: SizeBytes | None = Field(None, alias="kmax")
    pmax: float | None = Field(None, gt=0, le=1)
    k_bytes: SizeBytes | None = Field(None, alias="k", description="step marking at K")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class PfcConfig(Strict):
    """802.1Qbb priority flow control on a port class."""

    enabled: bool = True
    priorities: list[Annotated[int, Field(ge=0, le=7)]] | None = Field(
        None, description="paused priorities; default: every lossless class")
    xoff_bytes: SizeBytes | None = Field(None, alias="xoff")
    xon_bytes: SizeBytes | None = Field(None, alias="xon")
    headroom_bytes: SizeBytes | None = Field(None, alias="headroom")
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
        default_factory=dict, description="per traffic class byte limit; missing ones default",
        json_schema_extra={"propertyNames": {"pattern": "^[0-7]$"}})
    # HPCC's ns-3 figures for 25G, unscaled: marks start well below the
    # default PFC XOFF at every port speed, so DCQCN acts before PFC.
    ecn: EcnConfig = Field(
        default_factory=lambda: EcnConfig.model_validate(
            {"kmin": "100KB", "kmax": "400KB", "pmax": 0.2}))
    pfc: PfcConfig = Field(default_factory=PfcConfig)


class LinkSpec(Strict):
    """The physical layer of a link: a port type from the PHY catalogue and a length."""

    port: str = Field(description="IEEE 802.3 port type, e.g. 400GBASE-DR4")
    length_m: LengthM = Field(alias="length")
    qos: str = Field("default", description="port class (key of `qos`) for both ends")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class LeafSpine(Strict):
    kind: Literal["leaf_spine"]
    spines: int = Field(ge=1, le=64)
    leaves: int = Field(ge=1, le=128)
    hosts_per_leaf: int = Field(ge=1, le=64)
    host_link: LinkSpec
    fabric_link: LinkSpec


class SingleSwitch(Strict):
    kind: Literal["single_switch"]
    hosts: int = Field(ge=1, le=256)
    host_link: LinkSpec


class Ring(Strict):
    kind: Literal["ring"]
    switches: int = Field(ge=3, le=64)
    hosts_per_switch: int = Field(ge=1, le=64)
    host_link: LinkSpec
    fabric_link: LinkSpec


Topology = Annotated[LeafSpine | SingleSwitch | Ring, Field(discriminator="kind")]


class Node(Strict):
    name: str = Field(pattern=NAME_RE, max_length=15)
    role: Literal["host", "switch"]


class Link(Strict):
    a: str = Field(description="node name of one end")
    b: str = Field(description="node name of the other end")
    port: str
    length_m: LengthM = Field(alias="length")
    qos: str = "default"

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


def _traffic_items(value: object) -> object:
    """Validate each traffic entry against the model its `kind` names.

    A plain union would report every problem once per member (and a tagged one
    puts the tag into the location); this reports each entry's problems at
    `workload.traffic[i].field`, as the user wrote them.
    """
    if not isinstance(value, list):
        return value        # the list type reports it
    kinds = REGISTRY.models()
    out: list[object] = []
    errors: list[InitErrorDetails] = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            out.append(item)
            continue
        kind = item.get("kind")
        model = kinds.get(kind) if isinstance(kind, str) else None
        if model is None:
            errors.append(_kind_error(i, item, kinds))
            continue
        try:
            out.append(model.model_validate(item))
        except ValidationError as exc:
            errors += _entry_errors(i, model, kinds, exc)
    if errors:
        raise ValidationError.from_exception_data("traffic", errors)
    return out


def _kind_error(i: int, item: dict, kinds: dict[str, type[TrafficEntry]]) -> InitErrorDetails:
    """An entry whose kind is missing or names no registered kind: one error at its
    `kind`, with the kinds there are (and the one meant, for a typo)."""
    known = ", ".join(kinds)
    if "kind" not in item:
        text = f"required field is missing; add kind: with one of {known}"
        return InitErrorDetails(type=PydanticCustomError("missing_kind", text), loc=(i, "kind"),
                                input=item)
    kind = item["kind"]
    close = difflib.get_close_matches(str(kind), list(kinds), n=1)
    text = (f"unknown workload kind {kind!r}; did you mean {close[0]!r}?" if close
            else f"unknown workload kind {kind!r}; use one of {known}")
    return InitErrorDetails(type=PydanticCustomError("unknown_kind", text), loc=(i, "kind"),
                            input=kind)


def _entry_errors(i: int, model: type[TrafficEntry], kinds: dict[str, type[TrafficEntry]],
                  exc: ValidationError) -> list[InitErrorDetails]:
    """One traffic entry's errors, located under its index; unknown fields say which
    fields this kind has (the loader cannot tell which member of the union applies)."""
    fields = sorted(f.alias or n for n, f in model.model_fields.items())
    other_fields = {(f.alias or n): [k for k, m2 in kinds.items() if m2 is m]
                    for m in set(kinds.values()) - {model}
                    for n, f in m.model_fields.items() if (f.alias or n) not in fields}
    out: list[InitErrorDetails] = []
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
            out.append(InitErrorDetails(type=PydanticCustomError("unknown_field", text),
                                        loc=loc, input=e["input"]))
        else:
            detail = InitErrorDetails(type=e["type"], loc=loc, input=e["input"])
            if "ctx" in e:
                detail["ctx"] = e["ctx"]
            out.append(detail)
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
    traffic: list[SerializeAsAny[TrafficEntry]] = Field(
        default_factory=list, description="the traffic entries, each of one registered kind "
        "(testbed/workloads)")

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

    name: str = Field(pattern=LAB_NAME_RE, description="lab name: lower-case, <= 16 characters")
    dilation: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto", description="time dilation D (the fabric runs D times slower), or auto")
    max_wall_port_rate_bps: RateBps | None = Field(
        None, alias="max_wall_port_rate",
        description="wall-rate budget per port for dilation: auto (default: calibrated or 200Mbps)")
    address_pool: ipaddress.IPv4Network = ipaddress.IPv4Network("198.18.0.0/15")
    mtu_bytes: int = Field(9000, alias="mtu", ge=1280, le=9216)
    roce_mtu_bytes: Literal[256, 512, 1024, 2048, 4096] = Field(4096, alias="roce_mtu")
    traffic_classes: list[TrafficClass] = Field(default_factory=default_traffic_classes)
    qos: dict[Annotated[str, Field(pattern=NAME_RE)], PortClass] = Field(
        default_factory=lambda: {"default": PortClass()},
        description="port classes by name; links pick one with qos:, `default` always exists",
        json_schema_extra={"propertyNames": {"pattern": NAME_RE}})
    topology: Topology | None = None
    nodes: list[Node] = Field(default_factory=list)
    links: list[Link] = Field(default_factory=list)
    impairments: list[Impairment] = Field(default_factory=list)
    switch_buffer: SwitchBuffer | None = Field(
        None, description="a shared buffer per switch for the lossless classes (absent: every "
                          "port keeps its own buffer per class, qos.<class>.buffer)")
    workload: Workload | None = None

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
