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
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal, Union

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializeAsAny,
    ValidationError,
    WithJsonSchema,
    field_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from testbed.config.ecn import EcnCurve, EcnMarkerName
from testbed.fields import (
    NAME_RE,
    DurationNs,
    LengthM,
    RateBps,
    SizeBytes,
    Strict,
)
from testbed.units import QUANTITY_PATTERN, parse_rate_bps
from testbed.workloads.base import TrafficEntry
from testbed.workloads.registry import REGISTRY

FORMAT_VERSION = 1


LAB_NAME_RE = r"^[a-z][a-z0-9]{0,15}$"


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
    trim: bool = Field(False, description="this class trims UET packets instead of dropping "
                                          "them: at switch ports, an Ultra Ethernet packet "
                                          "(UDP to port 4793) arriving to a queue above the "
                                          "port class's trim.threshold is cut to trim.size "
                                          "and sent in the trim.to class; lossy classes only")


def default_traffic_classes() -> list[TrafficClass]:
    # The usual RoCE class plan: RoCE data at DSCP 26 -> TC3, lossless (PFC) and
    # ECN-marked; CNPs at DSCP 48 -> TC6, strict priority (where NVIDIA NICs send
    # them: DSCP 48, priority 6); everything else TC0, lossy.
    return [
        TrafficClass(tc=3, name="roce", dscp=[26], lossless=True, ecn=True, weight=1),
        TrafficClass(tc=6, name="cnp", dscp=[48], strict=True),
        TrafficClass(tc=0, name="default", dscp=[], weight=1, default=True),
    ]


class EcnConfig(EcnCurve):
    """DCQCN CP marking curve of a port class, and what marks. A preset, or
    kmin/kmax/pmax, or a step at k."""

    marker: EcnMarkerName = Field(
        "bpf", description="what marks: bpf, the tc-BPF port program, at enqueue, with an "
                           "independent draw per packet (any kernel with clsact); red, the "
                           "kernel's sch_red in the class's queue, given the same curve "
                           "(kernels with sch_red; docs/datapath.md says how its count-based "
                           "marking is matched to the curve)")


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


#: the smallest trim.size: IP 20 + UDP 8 + the largest PDS request (RUD_CC_REQ, 16) + the
#: SES standard header (44), so a trimmed packet still says which message and offset it was
MIN_TRIM_BYTES = 20 + 8 + 16 + 44


class TrimConfig(Strict):
    """Packet trimming of the classes with trim: true, at switch ports (host NICs never trim).

    An Ultra Ethernet packet (IPv4 UDP to port 4793) that would take its class's queue
    above `threshold` is not admitted to it: it is cut to `size` bytes of IP (headers and
    a short payload) and sent in the `to` class, so the receiver learns at once what was
    lost. Other packets of the class are tail-dropped at the buffer as before.
    """

    threshold_bytes: SizeBytes | None = Field(
        None, alias="threshold",
        description="queue above which an arriving UET packet is trimmed (default: the "
                    "class's buffer, i.e. trim instead of tail drop); at most the buffer")
    size_bytes: SizeBytes = Field(
        128, alias="size", description=f"IP bytes a trimmed packet keeps (IP + UDP + PDS + "
                                       f"SES headers and the payload's start); at least "
                                       f"{MIN_TRIM_BYTES} = IP 20 + UDP 8 + PDS 16 + SES 44")
    to: str | int | None = Field(
        None, description="the class (name or tc number) trimmed packets are sent in, with "
                          "its first DSCP; strict, not lossless, not trimming; default: the "
                          "strict class, if there is exactly one")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


def trim_target(tclasses: list[TrafficClass], to: str | int | None) -> TrafficClass | None:
    """The class trimmed packets go to: the one `to` names (by name or tc number), or with
    `to` unset the only strict class that does not trim; None if there is no such class."""
    if to is None:
        strict = [t for t in tclasses if t.strict and not t.trim]
        return strict[0] if len(strict) == 1 else None
    for t in tclasses:
        if (isinstance(to, int) and t.tc == to) or (isinstance(to, str) and t.name == to):
            return t
    return None


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
        default_factory=lambda: EcnConfig.model_validate(
            {"kmin": "100KB", "kmax": "400KB", "pmax": 0.2}),
        description="ECN marking curve of the classes with ecn: true, at switch ports (host "
                    "NICs never mark); default: HPCC's ns-3 switch setting, unscaled")
    pfc: PfcConfig = Field(default_factory=PfcConfig,
                           description="priority flow control of the lossless classes")
    trim: TrimConfig = Field(default_factory=TrimConfig,
                             description="packet trimming of the classes with trim: true, at "
                                         "switch ports")


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


class HostOptions(Strict):
    """Per-host options of a host node (generated or given by hand), by name."""

    name: str = Field(description="the host node these options apply to, e.g. h1")
    endpoint: Literal["transport", "rxe"] = Field(
        "transport", description="transport: RoCE and UET endpoints are the testbed's "
        "user-space agents (agents/rdma); rxe: the host also gets a kernel Soft-RoCE device "
        "(rdma_rxe) rxe_<lab>_<host> on its NIC, which `kind: perftest` traffic uses "
        "(docs/rxe.md)")


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


def _kind_error(i: int, item: dict, kinds: Mapping[str, type[BaseModel]],
                what: str = "workload") -> InitErrorDetails:
    """An entry whose kind is missing or names no registered kind: one error at its
    `kind`, with the kinds there are (and the one meant, for a typo)."""
    known = ", ".join(kinds)
    if "kind" not in item:
        text = f"required field is missing; add kind: with one of {known}"
        return InitErrorDetails(type=PydanticCustomError("missing_kind", text), loc=(i, "kind"),
                                input=item)
    kind = item["kind"]
    close = difflib.get_close_matches(str(kind), list(kinds), n=1)
    text = (f"unknown {what} kind {kind!r}; did you mean {close[0]!r}?" if close
            else f"unknown {what} kind {kind!r}; use one of {known}")
    return InitErrorDetails(type=PydanticCustomError("unknown_kind", text), loc=(i, "kind"),
                            input=kind)


def _entry_errors(i: int, model: type[BaseModel], kinds: Mapping[str, type[BaseModel]],
                  exc: ValidationError, what: str = "traffic has it",
                  ) -> list[InitErrorDetails]:
    """One traffic entry's errors, located under its index; unknown fields say which
    fields this kind has (the loader cannot tell which member of the union applies)."""
    fields = sorted(f.alias or n for n, f in model.model_fields.items())
    other_fields: dict[str, list[str]] = {}      # field -> every other kind that has it
    for k, m in kinds.items():
        if m is not model:
            for n, f in m.model_fields.items():
                if (f.alias or n) not in fields:
                    other_fields.setdefault(f.alias or n, []).append(k)
    out: list[InitErrorDetails] = []
    meant: set[str] = set()
    for e in exc.errors():
        loc = (i, *e["loc"])
        if e["type"] == "extra_forbidden" and len(e["loc"]) == 1:
            name = str(e["loc"][0])
            close = difflib.get_close_matches(name, fields, n=1)
            if name in other_fields:
                text = (f"unknown field {name!r}: only {', '.join(other_fields[name])} "
                        f"{what}; fields here: {', '.join(fields)}")
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


# ---- the fault timeline (events:), static routes, DSCP remaps, allowances ---------------

_AT = ("fabric time after the workload's t0 (the moment its traffic starts) at which the "
       "event applies")
_LINK = ("the two nodes at the ends of the link, [a, b]; every parallel link between them "
         "is changed")
_EVENT_NODE = "the node whose egress ports change"
_EVENT_PORT = ("the neighbour node whose link's port on `node` changes (the port toward "
               "it); unset: every port of `node`")
_EVENT_TCLASS = "the traffic class, by name or tc number (traffic_classes)"


def _at() -> Any:
    """The `at:` field every event has (a field per model, not a base model: every model
    here gets a table in docs/config.md)."""
    return Field(alias="at", description=_AT)


_EVENT_CONFIG = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class LinkStateEvent(Strict):
    """A layer-1 flap: the link goes down (or comes back up) in both directions, and
    routes reconverge around it the way the fabric's shortest-path ECMP would."""

    model_config = _EVENT_CONFIG

    at_ns: DurationNs = _at()
    kind: Literal["link_down", "link_up"] = Field(description="link_down or link_up")
    link: tuple[str, str] = Field(description=_LINK)
    converge_ns: DurationNs = Field(
        0, alias="converge",
        description="fabric time after the event before every other node's routes change "
                    "(the two ends' kernels drop or regain the link's next hops at once); "
                    "0: all at once")


class LossEvent(Strict):
    """A new extra drop probability on a link (a degrading optic, a corrupting cable)."""

    model_config = _EVENT_CONFIG

    at_ns: DurationNs = _at()
    kind: Literal["loss"] = Field(description="loss")
    link: tuple[str, str] = Field(description=_LINK)
    direction: Literal["both", "forward", "reverse"] = Field(
        "both", description="forward: from link[0] to link[1]; reverse: the other way")
    loss: float = Field(ge=0, le=1, description="the new extra drop probability per packet "
                        "(0.01 = 1 %), replacing any impairment of the link in that "
                        "direction; combined with the PHY's frame loss")
    cause: Literal["loss", "corruption"] = Field(
        "loss", description="what the drops stand for: loss, or corruption (a frame with a "
                            "bad FCS, which the receiving MAC discards); emulated the same "
                            "way (dropped at that egress), recorded as given")


class RateEvent(Strict):
    """A link renegotiates to a lower rate (auto-negotiated down, or lanes lost on a
    multi-lane port), in both directions. Buffers and PFC/ECN thresholds stay as they were."""

    model_config = _EVENT_CONFIG

    at_ns: DurationNs = _at()
    kind: Literal["rate"] = Field(description="rate")
    link: tuple[str, str] = Field(description=_LINK)
    rate_bps: RateBps | None = Field(
        None, alias="rate", description="the link's new MAC rate, at most the port type's; "
                                        "not with lanes")
    lanes: int | None = Field(
        None, ge=1, description="lanes still working, of the port type's lanes (PHY "
                                "catalogue): the rate becomes that share of the port's; not "
                                "with rate")


class PfcEvent(Strict):
    """PFC turned on or off for one lossless class on a switch's ports (or a host NIC's)."""

    model_config = _EVENT_CONFIG

    at_ns: DurationNs = _at()
    kind: Literal["pfc"] = Field(description="pfc")
    node: str = Field(description=_EVENT_NODE)
    port: str | None = Field(None, description=_EVENT_PORT)
    tclass: str | int = Field(description=_EVENT_TCLASS + "; a lossless class")
    enabled: bool = Field(description="false: the port neither sends nor obeys pauses of the "
                                      "class (a held pause is released); true: restored")


class EcnEvent(EcnCurve):
    """A new ECN marking curve for one ECN class on a node's ports: one of preset,
    kmin/kmax/pmax or k, as in qos.<class>.ecn (the BPF marker's curve: a port whose
    class marks with red is refused)."""

    model_config = _EVENT_CONFIG

    at_ns: DurationNs = _at()
    kind: Literal["ecn"] = Field(description="ecn")
    node: str = Field(description=_EVENT_NODE)
    port: str | None = Field(None, description=_EVENT_PORT)
    tclass: str | int = Field(description=_EVENT_TCLASS + "; a class with ecn: true")


LINE_RATE = "line"


def _rate_or_line() -> Callable[[object], object]:
    """parse_rate_bps, but the word `line` means the NIC's line rate (None). (docs.py
    reads `parse` and `word` from the closure.)"""
    parse, word = parse_rate_bps, LINE_RATE

    def parse_or_word(value: object) -> object:
        if isinstance(value, str) and value.strip().lower() == word:
            return None
        return parse(value)  # type: ignore[arg-type]  # the parser reports bad values
    return parse_or_word


DrainRate = Annotated[Annotated[int, Field(ge=0)] | None, BeforeValidator(_rate_or_line()),
                      WithJsonSchema({
                          "anyOf": [{"type": "string", "pattern": QUANTITY_PATTERN},
                                    {"type": "integer", "minimum": 0}, {"const": LINE_RATE}],
                          "description": "a rate (bare number: bit/s), or line",
                          "examples": ["0bps", "10Gbps", "line"]})]


class HostDrainEvent(Strict):
    """A receiver that drains its NIC's receive buffer slowly or not at all (a slow or
    stuck receiver, a PCIe-stalled NIC). Its lossless classes' receive buffer fills from
    the wire; above the port's XOFF the NIC sends PFC to its switch, as an RNIC does."""

    model_config = _EVENT_CONFIG

    at_ns: DurationNs = _at()
    kind: Literal["host_drain"] = Field(description="host_drain")
    host: str = Field(description="the host whose NIC (every port toward a switch) drains "
                                  "slowly")
    drain_rate_bps: DrainRate = Field(
        alias="rate", description="the rate the NIC drains its receive buffer at (0bps: "
                                  "stuck), or line: drains at line rate again (restores)")


Event = Annotated[Union[LinkStateEvent, LossEvent, RateEvent, PfcEvent,  # noqa: UP007
                        EcnEvent, HostDrainEvent], Field(discriminator="kind")]

# kind -> its model; the one place an event kind is listed.
EVENT_KINDS: dict[str, type[BaseModel]] = {
    "link_down": LinkStateEvent, "link_up": LinkStateEvent, "loss": LossEvent,
    "rate": RateEvent, "pfc": PfcEvent, "ecn": EcnEvent, "host_drain": HostDrainEvent,
}


def _event_items(value: object) -> object:
    """Validate each event against the model its `kind` names, reporting problems at
    `events[i].field` (as _traffic_items does for traffic entries)."""
    if not isinstance(value, list):
        return value
    out: list[object] = []
    errors: list[InitErrorDetails] = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            text = ("expected a mapping (at:, kind: and the kind's fields), got "
                    f"{item!r}")
            errors.append(InitErrorDetails(type=PydanticCustomError("event_type", text),
                                           loc=(i,), input=item))
            continue
        kind = item.get("kind")
        model = EVENT_KINDS.get(kind) if isinstance(kind, str) else None
        if model is None:
            errors.append(_kind_error(i, item, EVENT_KINDS, "event"))
            continue
        try:
            out.append(model.model_validate(item))
        except ValidationError as exc:
            errors += _entry_errors(i, model, EVENT_KINDS, exc, "events have it")
    if errors:
        raise ValidationError.from_exception_data("events", errors)
    return out


class StaticRoute(Strict):
    """A route given by hand on one node. It is added to the node's computed routes, or
    replaces the computed route of the same prefix; static routes never reconverge."""

    node: str = Field(description="the node (host or switch) that holds the route")
    dst: str = Field(description="a host name (a /32 for each of its addresses) or an IPv4 "
                                 "prefix inside address_pool, e.g. 198.18.0.0/26")
    via: list[str] = Field(min_length=1, description="next hops: neighbour nodes of `node` "
                           "(several: ECMP over them, every link to each)")


class DscpRemap(Strict):
    """One DSCP value that a switch classifies into another class than the fabric's class
    plan says (a trust or DSCP-map misconfiguration)."""

    node: str = Field(description="the switch whose classifier differs")
    dscp: int = Field(ge=0, le=63, description="the DSCP value (0..63)")
    tclass: str | int = Field(description="the class it selects on every egress port of "
                                          "`node`, by name or tc number")


# Checks a config may turn into plan warnings on purpose (allow:), each with what it allows.
ALLOWANCES = {
    "ecn-above-xoff": "ecn.kmin at or above a static pfc.xoff, so PFC fires before ECN marks",
}
Allowance = Literal["ecn-above-xoff"]


class Fabric(Strict):
    """A whole fabric: what `testbed validate/plan/up` read."""

    name: str = Field(pattern=LAB_NAME_RE, description="lab name, at most 16 characters; the "
                                                        "nodes' namespaces are tb-<name>-<node>")
    dilation: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto", description="time dilation D (the fabric runs D times slower), or auto: the "
                            "smallest of 1, 2, 5 x 10^k at which the workload's packets, "
                            "summed over every hop they cross and at their agents, fit this "
                            "machine's measured capacity with a margin (docs/dilation.md); "
                            "with max_wall_port_rate, or no workload: the smallest that keeps "
                            "the busiest port's wall rate within the per-port budget")
    max_wall_port_rate_bps: RateBps | None = Field(
        None, alias="max_wall_port_rate",
        description="wall-rate budget per port: given, dilation: auto takes D from it alone "
                    "(the same plan on every machine; --vms runs need it) and a fixed D above "
                    "it is a plan warning (default: unset; auto then uses the calibrated "
                    "capacity)")
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
    hosts: list[HostOptions] = Field(
        default_factory=list, description="per-host options (endpoint: rxe), by host name; "
                                          "a host not listed keeps the defaults")
    impairments: list[Impairment] = Field(default_factory=list,
                                          description="extra packet loss on links")
    switch_buffer: SwitchBuffer | None = Field(
        None, description="a shared buffer per switch for the lossless classes (absent: every "
                          "port keeps its own buffer per class, qos.<class>.buffer)")
    workload: Workload | None = Field(None, description="what `testbed run` drives")
    events: list[Event] = Field(
        default_factory=list, description="the fault timeline: link flaps, loss, rate, PFC, "
        "ECN and host-drain changes, each at a fabric time after the workload's t0; one per "
        "`kind`")
    routes: list[StaticRoute] = Field(
        default_factory=list, description="static routes, added to the computed ones (or "
                                          "replacing the same prefix); they do not reconverge")
    dscp_remap: list[DscpRemap] = Field(
        default_factory=list, description="DSCP values that one switch classifies into "
                                          "another class than traffic_classes says")
    allow: list[Allowance] = Field(
        default_factory=list, description="checks turned into plan warnings on purpose (the "
        "run's fidelity notes say so): " + "; ".join(f"{k}: {v}" for k, v in ALLOWANCES.items()))

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

    @field_validator("events", mode="before")
    @classmethod
    def _events(cls, value: object) -> object:
        return _event_items(value)

    @field_validator("qos")
    @classmethod
    def _qos_default(cls, value: dict[str, PortClass]) -> dict[str, PortClass]:
        if "default" not in value:
            value = {"default": PortClass(), **value}
        return value
