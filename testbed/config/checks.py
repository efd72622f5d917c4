"""Whole-fabric checks that a single field's validator cannot make.

Each check yields (location, message); the caller turns the location into
a line. All problems are collected, none stops the others.
"""

from __future__ import annotations

import difflib
import ipaddress
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping

from testbed.config.errors import format_loc
from testbed.config.models import (
    MIN_TRIM_BYTES,
    EcnCurve,
    EcnEvent,
    Fabric,
    HostDrainEvent,
    LinkStateEvent,
    LossEvent,
    PfcEvent,
    PortClass,
    RateEvent,
    TrafficClass,
    trim_target,
)
from testbed.config.topology import Expanded
from testbed.units import format_duration, format_rate, format_size
from testbed.workloads.base import (
    SHAPE_FIELD_NAMES,
    CheckContext,
    Problem,
    Shape,
    TrafficEntry,
    shape_field,
)
from testbed.workloads.registry import REGISTRY

# agents.portmaps.MAX_TRACKED: lossless classes the port program accounts per ingress port.
MAX_LOSSLESS_CLASSES = 2


def _suggest(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _tc_list(tcs: Iterable[int]) -> str:
    return ", ".join(str(tc) for tc in sorted(tcs))


def check_traffic_classes(fabric: Fabric) -> Iterator[tuple[tuple, str]]:
    seen_tc: dict[int, int] = {}
    seen_name: dict[str, int] = {}
    seen_dscp: dict[int, int] = {}
    defaults = []
    for i, tclass in enumerate(fabric.traffic_classes):
        loc = ("traffic_classes", i)
        if tclass.tc in seen_tc:
            yield (loc + ("tc",), f"TC{tclass.tc} is defined twice "
                   f"(also traffic_classes[{seen_tc[tclass.tc]}]); give each class its own tc")
        seen_tc.setdefault(tclass.tc, i)
        if tclass.name in seen_name:
            yield (loc + ("name",), f"class name {tclass.name!r} is used twice (also "
                   f"traffic_classes[{seen_name[tclass.name]}]); give each class its own name")
        seen_name.setdefault(tclass.name, i)
        for dscp in tclass.dscp:
            if dscp in seen_dscp:
                yield (loc + ("dscp",), f"DSCP {dscp} already selects "
                       f"traffic_classes[{seen_dscp[dscp]}]; a DSCP maps to one class, "
                       "remove it from one of them")
            seen_dscp.setdefault(dscp, i)
        if tclass.default:
            defaults.append(i)
        if tclass.strict and tclass.lossless:
            yield (loc + ("strict",), "a strict-priority class cannot also be lossless here; "
                   "remove strict: true (lossless traffic uses a weighted class) or lossless: true")
        if tclass.trim and tclass.lossless:
            yield (loc + ("trim",), "a lossless class cannot trim: PFC keeps its queue from "
                   "overflowing, so there is nothing to trim; remove trim: true, or "
                   "lossless: true to trim instead of pausing")
    if not defaults and fabric.traffic_classes:
        yield (("traffic_classes",), "no class has default: true; mark exactly one (usually "
               "TC0), it takes the packets whose DSCP no class names")
    for i in defaults[1:]:
        yield (("traffic_classes", i, "default"), f"traffic_classes[{defaults[0]}] is already "
               "the default class; exactly one class may have default: true")


def ecn_curve_problems(ecn: EcnCurve, loc: tuple,
                       required: bool = False) -> Iterator[tuple[tuple, str]]:
    """One ECN curve's form: one of preset, kmin/kmax(/pmax) or k (`required`: one must be
    given; a port class's ecn without any is the dcqcn-paper preset)."""
    kmin, kmax = ecn.kmin_bytes, ecn.kmax_bytes
    forms = [ecn.preset is not None, kmin is not None or kmax is not None,
             ecn.k_bytes is not None]
    if sum(forms) > 1:
        given = " and ".join(form for form, on in zip(("preset", "kmin/kmax", "k"), forms,
                                                      strict=True) if on)
        yield (loc, f"{given} are given together; give only one of preset, "
               "kmin/kmax/pmax, or k (step marking)")
    elif forms[1] and (kmin is None or kmax is None):
        missing = "kmax" if kmax is None else "kmin"
        yield (loc, f"{missing} is missing: kmin and kmax go together "
               "(write k: for step marking)")
    elif kmin is not None and kmax is not None and kmin > kmax:
        yield (loc + ("kmin",),
               f"{format_size(kmin)} is above kmax {format_size(kmax)}; "
               "kmin must be <= kmax (equal values mark as a step)")
    elif ecn.pmax is not None and not forms[1]:
        yield loc + ("pmax",), "pmax goes with kmin/kmax; add them or remove pmax"
    elif required and not any(forms):
        yield (loc, "no curve given: give preset:, kmin: and kmax: (and pmax:), or k: "
               "(step marking)")


def check_qos(fabric: Fabric) -> Iterator[tuple[tuple, str]]:
    tcs = {t.tc: t for t in fabric.traffic_classes}
    for name, port_class in fabric.qos.items():
        loc = ("qos", name)
        for tc in port_class.buffer:
            if tc not in tcs:
                yield (loc + ("buffer", tc), f"TC{tc} is not a defined traffic class "
                       f"(defined: {_tc_list(tcs)}); remove it or define the class")
        yield from ecn_curve_problems(port_class.ecn, loc + ("ecn",))
        pfc = port_class.pfc
        for i, prio in enumerate(pfc.priorities or []):
            if prio not in tcs:
                yield (loc + ("pfc", "priorities", i), f"priority {prio} is not a defined "
                       f"traffic class (defined: {_tc_list(tcs)})")
            elif not tcs[prio].lossless:
                yield (loc + ("pfc", "priorities", i), f"TC{prio} ({tcs[prio].name}) is not "
                       "lossless; mark the class lossless: true or drop it from priorities")
        if (pfc.xoff_bytes is not None and pfc.xon_bytes is not None
                and pfc.xon_bytes > pfc.xoff_bytes):
            yield (loc + ("pfc", "xon"),
                   f"{format_size(pfc.xon_bytes)} is above xoff {format_size(pfc.xoff_bytes)}; "
                   "set xon below xoff")
        implicit = [n for n, pc in fabric.qos.items() if "trim" not in pc.model_fields_set]
        yield from check_trim(fabric, name, port_class,
                              report_implicit=bool(implicit) and implicit[0] == name)
    lossless = [t.tc for t in fabric.traffic_classes if t.lossless]
    if len(lossless) > MAX_LOSSLESS_CLASSES:
        i = next(i for i, t in enumerate(fabric.traffic_classes)
                 if t.tc == lossless[MAX_LOSSLESS_CLASSES])
        yield (("traffic_classes", i, "lossless"), f"at most {MAX_LOSSLESS_CLASSES} lossless "
               "classes are accounted per ingress port ("
               + ", ".join(f"TC{tc}" for tc in sorted(lossless)) + " are lossless); make this "
               "one lossy")
    buf = fabric.switch_buffer
    if buf is not None and buf.size_bytes <= 0:
        yield (("switch_buffer", "size"), "the shared pool must be larger than 0")


def check_trim(fabric: Fabric, name: str, port_class: PortClass,
               report_implicit: bool = True) -> Iterator[tuple[tuple, str]]:
    """A port class's trim settings against the classes that trim (qos.<name>.trim). A
    port class without trim: has the defaults; what is wrong with them is reported once
    (`report_implicit`), at the first trimming class's trim field."""
    loc: tuple = ("qos", name, "trim")
    trim = port_class.trim
    tclasses = list(fabric.traffic_classes)
    trimming = [t for t in tclasses if t.trim and not t.lossless]
    if not trimming:
        if "trim" in port_class.model_fields_set:
            yield (loc, "no lossy class has trim: true, so this does nothing; mark the "
                   "classes that trim (traffic_classes[].trim) or remove it")
        return
    if "trim" not in port_class.model_fields_set:
        if not report_implicit:
            return
        first = next(i for i, t in enumerate(tclasses) if t.trim and not t.lossless)
        loc = ("traffic_classes", first, "trim")
    if trim.size_bytes < MIN_TRIM_BYTES:
        yield (loc + ("size",), f"{trim.size_bytes} B is below {MIN_TRIM_BYTES} B (IP 20 + "
               "UDP 8 + PDS 16 + SES 44): a trimmed packet must keep its headers; raise it")
    elif trim.size_bytes >= fabric.mtu_bytes:
        yield (loc + ("size",), f"{trim.size_bytes} B is not below the MTU {fabric.mtu_bytes}: "
               "no packet would be shorter after trimming; lower it")
    for t in trimming:
        buffer = port_class.buffer.get(t.tc)
        if trim.threshold_bytes is not None and buffer is not None and \
                trim.threshold_bytes > buffer:
            yield (loc + ("threshold",), f"{format_size(trim.threshold_bytes)} is above the "
                   f"TC{t.tc} ({t.name}) buffer {format_size(buffer)}, so the class tail-"
                   f"drops before it trims; lower it or raise buffer.{t.tc}")
    yield from _trim_target_problems(tclasses, name, trim.to, loc)


def _trim_target_problems(tclasses: list[TrafficClass], name: str, to: str | int | None,
                          loc: tuple) -> Iterator[tuple[tuple, str]]:
    """Is there a class for port class `name`'s trimmed packets, and may they go there?"""
    target = trim_target(tclasses, to)
    if to is None and target is None:
        strict = [f"TC{t.tc} ({t.name})" for t in tclasses if t.strict and not t.trim]
        yield (loc, f"port class {name} has no class to send trimmed packets in: " + (
            f"{', '.join(strict)} are strict, set qos.{name}.trim.to to one of them" if strict else
            f"none is strict; add a class with strict: true, or set qos.{name}.trim.to"))
        return
    if target is None:
        names = ", ".join(f"{t.name} ({t.tc})" for t in tclasses)
        hint = _suggest(to, [t.name for t in tclasses]) if isinstance(to, str) else ""
        yield (loc + ("to",), f"unknown traffic class {to!r}" + (
            hint or f"; use a class name or number from traffic_classes: {names}"))
        return
    what = f"TC{target.tc} ({target.name})"
    if target.trim:
        yield (loc + ("to",), f"{what} trims itself; send trimmed packets to a class that "
               "does not trim")
    elif target.lossless:
        yield (loc + ("to",), f"{what} is lossless; trimmed packets go to a strict lossy "
               "class (they must overtake the queue they left, and never pause it)")
    elif not target.strict:
        yield (loc + ("to",), f"{what} is not strict; trimmed packets must overtake the queue "
               "they left: name a class with strict: true")
    elif not target.dscp:
        yield (loc + ("to",), f"{what} has no dscp, and a trimmed packet is steered by its "
               "DSCP; give the class a dscp")


def check_topology(fabric: Fabric, expanded: Expanded,
                   known_ports: list[str]) -> Iterator[tuple[tuple, str]]:
    names: dict[str, tuple] = {}
    for node, loc in zip(expanded.nodes, expanded.node_locs, strict=True):
        if node.name in names:
            first = names[node.name]
            where = "made by topology:" if first == ("topology",) else format_loc(first)
            yield loc + ("name",) if loc != ("topology",) else loc, (
                f"node {node.name!r} is defined twice (also {where}); rename one of them")
        names.setdefault(node.name, loc)
    if not expanded.nodes:
        yield (), "the fabric has no nodes: give topology: or nodes: and links:"
    pair_seen: set[frozenset] = set()
    linked: set[str] = set()
    for link, loc in zip(expanded.links, expanded.link_locs, strict=True):
        for end in ("a", "b"):
            name = getattr(link, end)
            if name not in names:
                hint = _suggest(name, list(names)) or "; define it under nodes:"
                yield loc + (end,), f"unknown node {name!r}{hint}"
            linked.add(name)
        if link.a == link.b:
            yield loc + ("b",), f"a link from {link.a!r} to itself; connect two different nodes"
        pair = frozenset((link.a, link.b))
        if pair in pair_seen and loc[0] == "links":
            yield loc, (f"a second link between {link.a!r} and {link.b!r}; parallel links "
                        "are not supported yet")
        pair_seen.add(pair)
        if link.port not in known_ports:
            yield (loc + ("port",), f"unknown port type {link.port!r}"
                   f"{_suggest(link.port, known_ports)} (list them: testbed phy --list)")
        if link.qos not in fabric.qos:
            hint = _suggest(link.qos, list(fabric.qos)) or (
                f"; define it under qos: (defined: {', '.join(sorted(fabric.qos))})")
            yield loc + ("qos",), f"unknown port class {link.qos!r}{hint}"
    for node, loc in zip(expanded.nodes, expanded.node_locs, strict=True):
        if node.name not in linked and node.name in names:
            at = loc if loc == ("topology",) else loc + ("name",)
            yield at, f"node {node.name!r} has no link; link it or remove it"


def check_fabric(fabric: Fabric) -> Iterator[tuple[tuple, str]]:
    if fabric.roce_mtu_bytes + 80 > fabric.mtu_bytes:
        yield (("roce_mtu",), f"RoCE MTU {fabric.roce_mtu_bytes} needs an interface MTU of at "
               f"least {fabric.roce_mtu_bytes + 80} (headers take 80 B) but mtu is "
               f"{fabric.mtu_bytes}; raise mtu or lower roce_mtu")
    if fabric.address_pool.prefixlen > 30:
        yield (("address_pool",), f"{fabric.address_pool} is too small for a fabric; "
               "use /30 or larger (default 198.18.0.0/15)")


def check_workload(fabric: Fabric, expanded: Expanded) -> Iterator[tuple[tuple, str]]:
    """What every traffic entry needs of the fabric (a unique name, a known class, hosts
    of its shape), then what its kind checks (testbed/workloads)."""
    if fabric.workload is None:
        return
    hosts = [n.name for n in expanded.nodes if n.role == "host"]
    classes: dict[str | int, TrafficClass] = {t.name: t for t in fabric.traffic_classes}
    classes |= {t.tc: t for t in fabric.traffic_classes}
    linked: dict[str, list[str]] = {}
    for link in expanded.links:
        linked.setdefault(link.a, []).append(link.b)
        linked.setdefault(link.b, []).append(link.a)
    ctx = CheckContext(hosts=hosts, classes=classes, nic_bps=_host_nic_rates(expanded),
                       roles={n.name: n.role for n in expanded.nodes},
                       neighbours=lambda node: list(dict.fromkeys(linked.get(node, []))),
                       endpoints={h.name: h.endpoint for h in fabric.hosts})
    names: set[str] = set()
    bound: dict[tuple[str, str, int], tuple[str, str]] = {}   # host, proto, port -> claim
    for i, t in enumerate(fabric.workload.traffic):
        loc = ("workload", "traffic", i)
        if t.name in names:
            yield loc + ("name",), f"traffic name {t.name!r} is used twice"
        names.add(t.name)
        if t.tclass is not None and t.tclass not in classes:   # None: the kind's default
            yield (loc + ("tclass",), f"unknown traffic class {t.tclass!r}; use a class name or "
                   f"number from traffic_classes: "
                   f"{', '.join(f'{c.name} ({c.tc})' for c in fabric.traffic_classes)}")
        if t.duration_ns is not None and t.duration_ns <= 0:
            yield loc + ("duration",), "duration must be above 0"
        kind = REGISTRY.of(t.kind)
        yield from kind.check(t, loc, ctx)
        yield from _check_shape(t, kind.shape(t), loc, hosts)
        for host, claims in kind.host_ports(t, ctx).items():
            for proto, port, what in claims:
                first = bound.setdefault((host, proto, port), (t.name, what))
                if first[0] != t.name:
                    yield loc, (f"{what} on {host} binds {proto} {port}, which {first[1]} of "
                                f"entry {first[0]!r} binds there already; one of them "
                                "must move to other hosts")


HostCheck = Callable[[tuple, str], Iterator[tuple[tuple, str]]]


def _check_shape(t: TrafficEntry, shape: Shape, loc: tuple,
                 hosts: list[str]) -> Iterator[tuple[tuple, str]]:
    """The hosts an entry names exist and fit its shape; other shapes' fields are absent."""
    def host_ok(at: tuple, name: str) -> Iterator[tuple[tuple, str]]:
        if name not in hosts:
            yield at, (f"{name!r} is not a host of this fabric{_suggest(name, hosts)}; "
                       f"hosts are {', '.join(hosts[:8])}{' ...' if len(hosts) > 8 else ''}")

    complete = yield from _SHAPE_CHECKS[shape](t, loc, host_ok)
    if not complete:
        return
    for field in SHAPE_FIELD_NAMES:
        if shape_field(t, field) is not None and field not in shape.fields:
            yield loc + (field,), f"{field} does not apply to {t.kind}"


def _incast(t: TrafficEntry, loc: tuple, host_ok: HostCheck) -> Generator[Problem, None, bool]:
    senders, receiver = shape_field(t, "senders"), shape_field(t, "receiver")
    if not senders or not receiver:
        yield loc, f"{t.kind} needs senders: [...] and receiver:"
        return False
    for j, s in enumerate(senders):
        yield from host_ok(loc + ("senders", j), s)
        if s == receiver:
            yield loc + ("senders", j), f"{s!r} is also the receiver"
    yield from host_ok(loc + ("receiver",), receiver)
    return True


def _all_to_all(t: TrafficEntry, loc: tuple,
                host_ok: HostCheck) -> Generator[Problem, None, bool]:
    hosts = shape_field(t, "hosts")
    for j, h in enumerate(hosts or []):
        yield from host_ok(loc + ("hosts", j), h)
    if hosts is not None and len(hosts) < 2:
        yield loc + ("hosts",), "all-to-all needs at least two hosts"
    return True


def _pairs(t: TrafficEntry, loc: tuple, host_ok: HostCheck) -> Generator[Problem, None, bool]:
    pairs = shape_field(t, "pairs")
    if not pairs:
        yield loc, f"{t.kind} needs pairs: [[src, dst], ...]"
        return False
    for j, (src, dst) in enumerate(pairs):
        yield from host_ok(loc + ("pairs", j), src)
        yield from host_ok(loc + ("pairs", j), dst)
        if src == dst:
            yield loc + ("pairs", j), f"a pair from {src!r} to itself"
    return True


def _group(t: TrafficEntry, loc: tuple, host_ok: HostCheck) -> Generator[Problem, None, bool]:
    ranks = shape_field(t, "ranks")
    if not ranks:
        yield loc, f"{t.kind} needs ranks: [host, ...], the hosts of its communicator"
        return False
    seen: dict[str, int] = {}
    for j, h in enumerate(ranks):
        yield from host_ok(loc + ("ranks", j), h)
        if h in seen:
            yield (loc + ("ranks", j), f"{h!r} is already rank {seen[h]}; a host is one "
                   "accelerator and its NIC, so it holds one rank of a communicator")
        seen.setdefault(h, j)
    return True


_SHAPE_CHECKS = {Shape.INCAST: _incast, Shape.ALL_TO_ALL: _all_to_all, Shape.PAIRS: _pairs,
                 Shape.GROUP: _group}


def _host_nic_rates(expanded: Expanded) -> dict[str, int]:
    """Each host's first NIC's MAC rate (the line rate its RoCE agents pace at)."""
    from testbed.phy import PORT_TYPES

    roles = {n.name: n.role for n in expanded.nodes}
    out: dict[str, int] = {}
    for link in expanded.links:
        port = PORT_TYPES.get(link.port)
        for end in (link.a, link.b):
            if port is not None and roles.get(end) == "host":
                out.setdefault(end, port.mac_rate_gbps * 10**9)
    return out


def check_impairments(fabric: Fabric, expanded: Expanded) -> Iterator[tuple[tuple, str]]:
    pairs = {frozenset((link.a, link.b)) for link in expanded.links}
    names = sorted({n.name for n in expanded.nodes})
    for i, imp in enumerate(fabric.impairments):
        loc = ("impairments", i, "link")
        for j, end in enumerate(imp.link):
            if end not in names:
                yield loc + (j,), f"unknown node {end!r}{_suggest(end, names)}"
        if all(end in names for end in imp.link) and frozenset(imp.link) not in pairs:
            yield loc, (f"there is no link between {imp.link[0]!r} and {imp.link[1]!r}; "
                        "name the two ends of an existing link")


# ---- events, static routes, DSCP remaps --------------------------------------------------

class _FabricIndex:
    """Names, roles, links and classes of the expanded fabric, for the checks below."""

    def __init__(self, fabric: Fabric, expanded: Expanded) -> None:
        self.roles = {n.name: n.role for n in expanded.nodes}
        self.names = sorted(self.roles)
        self.hosts = [n.name for n in expanded.nodes if n.role == "host"]
        self.links: dict[frozenset, list] = {}
        self.neighbours: dict[str, list[str]] = {}
        for link in expanded.links:
            self.links.setdefault(frozenset((link.a, link.b)), []).append(link)
            self.neighbours.setdefault(link.a, []).append(link.b)
            self.neighbours.setdefault(link.b, []).append(link.a)
        self.classes: dict[str | int, TrafficClass] = {t.name: t for t in fabric.traffic_classes}
        self.classes |= {t.tc: t for t in fabric.traffic_classes}
        self.class_names = ", ".join(f"{c.name} ({c.tc})" for c in fabric.traffic_classes)
        self.fabric = fabric

    def node(self, loc: tuple, name: str) -> Iterator[tuple[tuple, str]]:
        if name not in self.roles:
            yield loc, f"unknown node {name!r}{_suggest(name, self.names)}"

    def link(self, loc: tuple, ends: tuple[str, str]) -> Iterator[tuple[tuple, str]]:
        found = False
        for j, end in enumerate(ends):
            if end not in self.roles:
                found = True
                yield loc + (j,), f"unknown node {end!r}{_suggest(end, self.names)}"
        if not found and frozenset(ends) not in self.links:
            yield loc, (f"there is no link between {ends[0]!r} and {ends[1]!r}; name the two "
                        "ends of an existing link")

    def tclass(self, tclass: str | int) -> TrafficClass | None:
        return self.classes.get(tclass)

    def unknown_tclass(self, tclass: str | int) -> str:
        hint = _suggest(tclass, [str(k) for k in self.classes]) if isinstance(tclass, str) else ""
        return f"unknown traffic class {tclass!r}" + (hint or (
            f"; use a class name or number from traffic_classes: {self.class_names}"))

    def port(self, loc: tuple, node: str, peer: str | None,
             what: str = "port: names the node at the other end of the port's link",
             ) -> Iterator[tuple[tuple, str]]:
        if peer is None or node not in self.roles:
            return
        nbrs = list(dict.fromkeys(self.neighbours.get(node, [])))
        if peer not in nbrs:
            yield loc, (f"{peer!r} is not a neighbour of {node!r}" + (_suggest(peer, nbrs) or (
                f"; {what} (neighbours: {', '.join(nbrs[:8])}"
                f"{' ...' if len(nbrs) > 8 else ''})")))


def _event_target(ev: object) -> tuple:
    """What an event changes, for finding two events that change it at the same time:
    (family, target); pfc/ecn ports None mean every port of the node."""
    if isinstance(ev, LinkStateEvent):
        return ("link", frozenset(ev.link))
    if isinstance(ev, LossEvent):
        return ("loss", frozenset(ev.link))
    if isinstance(ev, RateEvent):
        return ("rate", frozenset(ev.link))
    if isinstance(ev, PfcEvent | EcnEvent):
        return (ev.kind, ev.node, str(ev.tclass))
    if isinstance(ev, HostDrainEvent):
        return ("host_drain", ev.host)
    raise TypeError(f"no target for {ev!r}")


def _overlap(a: object, b: object) -> bool:
    """Two events of the same family on the same target: do they touch the same port?"""
    if isinstance(a, LossEvent) and isinstance(b, LossEvent):
        def dirs(e: LossEvent) -> set[tuple[str, str]]:
            fwd, rev = (e.link[0], e.link[1]), (e.link[1], e.link[0])
            return {"both": {fwd, rev}, "forward": {fwd}, "reverse": {rev}}[e.direction]
        return bool(dirs(a) & dirs(b))
    if isinstance(a, PfcEvent | EcnEvent) and isinstance(b, PfcEvent | EcnEvent):
        return a.port is None or b.port is None or a.port == b.port
    return True


def check_events(fabric: Fabric, expanded: Expanded) -> Iterator[tuple[tuple, str]]:
    """Every event names things that exist and fit its kind; link_up finds its link down
    (and link_down up) at that time; no two events change one target at the same time."""
    from testbed.phy import PORT_TYPES

    idx = _FabricIndex(fabric, expanded)
    for i, ev in enumerate(fabric.events):
        loc = ("events", i)
        if isinstance(ev, LinkStateEvent | LossEvent | RateEvent):
            yield from idx.link(loc + ("link",), ev.link)
        if isinstance(ev, RateEvent):
            yield from _check_rate(ev, loc, idx, PORT_TYPES)
        elif isinstance(ev, PfcEvent | EcnEvent):
            yield from _check_port_class_event(ev, loc, idx)
        elif isinstance(ev, HostDrainEvent):
            yield from _check_host_drain(ev, loc, idx)
    yield from _check_timeline(fabric, idx)


def _check_rate(ev: RateEvent, loc: tuple, idx: _FabricIndex,
                port_types: Mapping[str, object]) -> Iterator[tuple[tuple, str]]:
    if (ev.rate_bps is None) == (ev.lanes is None):
        yield loc, ("a rate event takes exactly one of rate: (the new rate) and lanes: "
                    "(lanes still working)")
        return
    for link in idx.links.get(frozenset(ev.link), []):
        port = port_types.get(link.port)
        if port is None:
            continue        # check_topology reports the port type
        mac_bps = port.mac_rate_gbps * 10**9   # type: ignore[attr-defined]
        lanes = port.lanes                      # type: ignore[attr-defined]
        if ev.rate_bps is not None and ev.rate_bps > mac_bps:
            yield (loc + ("rate",), f"{format_rate(ev.rate_bps)} is above the "
                   f"{link.port} port's {format_rate(mac_bps)}; a link renegotiates down, "
                   "never above its port type")
        if ev.lanes is not None and ev.lanes > lanes:
            yield (loc + ("lanes",), f"{ev.lanes} lanes, but a {link.port} port has "
                   f"{lanes}; give the lanes still working, 1..{lanes}")
        break


def _check_port_class_event(ev: PfcEvent | EcnEvent, loc: tuple,
                            idx: _FabricIndex) -> Iterator[tuple[tuple, str]]:
    yield from idx.node(loc + ("node",), ev.node)
    yield from idx.port(loc + ("port",), ev.node, ev.port)
    tclass = idx.tclass(ev.tclass)
    if tclass is None:
        yield loc + ("tclass",), idx.unknown_tclass(ev.tclass)
    elif isinstance(ev, PfcEvent) and not tclass.lossless:
        yield (loc + ("tclass",), f"TC{tclass.tc} ({tclass.name}) is not lossless, so PFC "
               "does not protect it; name a class with lossless: true")
    elif isinstance(ev, EcnEvent) and not tclass.ecn:
        yield (loc + ("tclass",), f"TC{tclass.tc} ({tclass.name}) has no ECN marking; name "
               "a class with ecn: true")
    if isinstance(ev, EcnEvent):
        yield from ecn_curve_problems(ev, loc, required=True)
        if idx.roles.get(ev.node) == "host":
            yield (loc + ("node",), f"{ev.node!r} is a host; host NICs never mark ECN, name "
                   "a switch")
        red = sorted({link.qos for links in idx.links.values() for link in links
                      if ev.node in (link.a, link.b)
                      and (ev.port is None or ev.port in (link.a, link.b))
                      and idx.fabric.qos[link.qos].ecn.marker == "red"}
                     if link_qos_known(idx) else set())
        if red:
            yield (loc + ("kind",), f"{ev.node!r} marks with sch_red on the ports of port "
                   f"class {', '.join(red)} (qos.{red[0]}.ecn.marker: red), and an ecn event "
                   "changes only the port program's curve; use marker: bpf there, or "
                   "name a port of another class")


def link_qos_known(idx: _FabricIndex) -> bool:
    """Every link names a port class the fabric has (else the qos checks report it)."""
    return all(link.qos in idx.fabric.qos for links in idx.links.values() for link in links)


def _check_host_drain(ev: HostDrainEvent, loc: tuple,
                      idx: _FabricIndex) -> Iterator[tuple[tuple, str]]:
    if ev.host not in idx.roles:
        yield loc + ("host",), (f"{ev.host!r} is not a host of this fabric"
                                + (_suggest(ev.host, idx.hosts) or
                                   f"; hosts are {', '.join(idx.hosts[:8])}"
                                   + (" ..." if len(idx.hosts) > 8 else "")))
        return
    if idx.roles[ev.host] != "host":
        yield loc + ("host",), f"{ev.host!r} is a switch; host_drain names a host"
        return
    if not any(t.lossless for t in idx.fabric.traffic_classes):
        yield (loc + ("kind",), "host_drain needs a lossless class (the NIC sends PFC for "
               "it); mark a class lossless: true")
        return
    switch_links = [link for peer in idx.neighbours.get(ev.host, [])
                    if idx.roles.get(peer) == "switch"
                    for link in idx.links.get(frozenset((ev.host, peer)), [])]
    if switch_links and not any(idx.fabric.qos[link.qos].pfc.enabled
                                for link in switch_links if link.qos in idx.fabric.qos):
        yield (loc + ("host",), f"PFC is off on {ev.host}'s ports (qos pfc.enabled: false), "
               "so its NIC could not send pauses; enable it on the host link's port class")


def _check_timeline(fabric: Fabric, idx: _FabricIndex) -> Iterator[tuple[tuple, str]]:
    """Events in time order: the links each link_down/up finds, and conflicts at one time."""
    order = sorted(range(len(fabric.events)), key=lambda i: fabric.events[i].at_ns)
    down: set[frozenset] = set()
    seen: dict[tuple, list[int]] = {}
    for i in order:
        ev = fabric.events[i]
        loc = ("events", i)
        if isinstance(ev, LinkStateEvent) and frozenset(ev.link) in idx.links:
            pair = frozenset(ev.link)
            name = f"{ev.link[0]}-{ev.link[1]}"
            if ev.kind == "link_up" and pair not in down:
                yield (loc + ("kind",), f"link {name} is not down at {format_duration(ev.at_ns)}"
                       "; a link_up needs an earlier link_down of the same link")
            elif ev.kind == "link_down" and pair in down:
                yield (loc + ("kind",), f"link {name} is already down at "
                       f"{format_duration(ev.at_ns)}; bring it up first (link_up)")
            (down.add if ev.kind == "link_down" else down.discard)(pair)
        key = (ev.at_ns, *_event_target(ev))
        for j in seen.get(key, []):
            other = fabric.events[j]
            if _overlap(ev, other) and ev != other:
                yield (loc + ("at",), f"events[{j}] changes the same target at the same time "
                       f"({format_duration(ev.at_ns)}); give them different at: values or "
                       "remove one")
                break
        seen.setdefault(key, []).append(i)


def check_routes(fabric: Fabric, expanded: Expanded) -> Iterator[tuple[tuple, str]]:
    """Static routes: the node exists, dst is a host or a prefix inside the address pool,
    each via is a neighbour of the node; one route per (node, dst)."""
    idx = _FabricIndex(fabric, expanded)
    seen: dict[tuple[str, str], int] = {}
    for i, route in enumerate(fabric.routes):
        loc = ("routes", i)
        yield from idx.node(loc + ("node",), route.node)
        if route.dst in idx.roles:
            if idx.roles[route.dst] != "host":
                yield (loc + ("dst",), f"{route.dst!r} is a switch; dst is a host or an IPv4 "
                       "prefix")
            elif route.dst == route.node:
                yield loc + ("dst",), f"a route on {route.node!r} to itself"
        else:
            try:
                net = ipaddress.IPv4Network(route.dst)
            except ValueError:
                yield (loc + ("dst",), f"{route.dst!r} is neither a host nor an IPv4 prefix"
                       + (_suggest(route.dst, idx.hosts) or "; write a host name or a prefix "
                          "like 198.18.0.0/24 (host bits zero)"))
            else:
                if not net.subnet_of(fabric.address_pool):
                    yield (loc + ("dst",), f"{net} is outside address_pool "
                           f"{fabric.address_pool}; fabric addresses all come from it")
        if route.node in idx.roles:
            for j, via in enumerate(route.via):
                yield from idx.port(loc + ("via", j), route.node, via,
                                    "a next hop is a node linked to it")
        key = (route.node, route.dst)
        if key in seen:
            yield (loc + ("dst",), f"routes[{seen[key]}] already routes {route.dst} on "
                   f"{route.node}; one static route per destination and node")
        seen.setdefault(key, i)


def check_hosts(fabric: Fabric, expanded: Expanded) -> Iterator[tuple[tuple, str]]:
    """Per-host options: each names a host node, once."""
    idx = _FabricIndex(fabric, expanded)
    seen: dict[str, int] = {}
    for i, opts in enumerate(fabric.hosts):
        loc = ("hosts", i, "name")
        if opts.name not in idx.roles:
            more = " ..." if len(idx.hosts) > 8 else ""
            yield loc, (f"unknown host {opts.name!r}" + (_suggest(opts.name, idx.hosts) or
                        f"; hosts: {', '.join(idx.hosts[:8])}{more}"))
        elif idx.roles[opts.name] != "host":
            yield loc, f"{opts.name!r} is a switch; host options apply to hosts"
        if opts.name in seen:
            yield loc, f"hosts[{seen[opts.name]}] already sets the options of {opts.name!r}"
        seen.setdefault(opts.name, i)


def check_dscp_remap(fabric: Fabric, expanded: Expanded) -> Iterator[tuple[tuple, str]]:
    """DSCP remaps: on a switch, to a known class, one class per (switch, DSCP)."""
    idx = _FabricIndex(fabric, expanded)
    seen: dict[tuple[str, int], int] = {}
    for i, remap in enumerate(fabric.dscp_remap):
        loc = ("dscp_remap", i)
        yield from idx.node(loc + ("node",), remap.node)
        if idx.roles.get(remap.node) == "host":
            yield (loc + ("node",), f"{remap.node!r} is a host; a DSCP map is a switch's "
                   "classifier, name a switch")
        if idx.tclass(remap.tclass) is None:
            yield loc + ("tclass",), idx.unknown_tclass(remap.tclass)
        key = (remap.node, remap.dscp)
        if key in seen:
            yield (loc + ("dscp",), f"dscp_remap[{seen[key]}] already maps DSCP {remap.dscp} "
                   f"on {remap.node}; one class per DSCP")
        seen.setdefault(key, i)
