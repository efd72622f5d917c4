"""Whole-fabric checks that a single field's validator cannot make.

Each check yields (location, message); the caller turns the location into
a line. All problems are collected, none stops the others.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Generator, Iterable, Iterator

from testbed.config.errors import format_loc
from testbed.config.models import Fabric, TrafficClass
from testbed.config.topology import Expanded
from testbed.units import format_size
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
    if not defaults and fabric.traffic_classes:
        yield (("traffic_classes",), "no class has default: true; mark exactly one (usually "
               "TC0), it takes the packets whose DSCP no class names")
    for i in defaults[1:]:
        yield (("traffic_classes", i, "default"), f"traffic_classes[{defaults[0]}] is already "
               "the default class; exactly one class may have default: true")


def check_qos(fabric: Fabric) -> Iterator[tuple[tuple, str]]:
    tcs = {t.tc: t for t in fabric.traffic_classes}
    for name, port_class in fabric.qos.items():
        loc = ("qos", name)
        for tc in port_class.buffer:
            if tc not in tcs:
                yield (loc + ("buffer", tc), f"TC{tc} is not a defined traffic class "
                       f"(defined: {_tc_list(tcs)}); remove it or define the class")
        ecn = port_class.ecn
        kmin, kmax = ecn.kmin_bytes, ecn.kmax_bytes
        forms = [ecn.preset is not None, kmin is not None or kmax is not None,
                 ecn.k_bytes is not None]
        if sum(forms) > 1:
            given = " and ".join(form for form, on in zip(("preset", "kmin/kmax", "k"), forms,
                                                          strict=True) if on)
            yield (loc + ("ecn",), f"{given} are given together; give only one of preset, "
                   "kmin/kmax/pmax, or k (step marking)")
        elif forms[1] and (kmin is None or kmax is None):
            missing = "kmax" if kmax is None else "kmin"
            yield (loc + ("ecn",), f"{missing} is missing: kmin and kmax go together "
                   "(write k: for step marking)")
        elif kmin is not None and kmax is not None and kmin > kmax:
            yield (loc + ("ecn", "kmin"),
                   f"{format_size(kmin)} is above kmax {format_size(kmax)}; "
                   "kmin must be <= kmax (equal values mark as a step)")
        elif ecn.pmax is not None and not forms[1]:
            yield loc + ("ecn", "pmax"), "pmax goes with kmin/kmax; add them or remove pmax"
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
                       neighbours=lambda node: list(dict.fromkeys(linked.get(node, []))))
    names: set[str] = set()
    for i, t in enumerate(fabric.workload.traffic):
        loc = ("workload", "traffic", i)
        if t.name in names:
            yield loc + ("name",), f"traffic name {t.name!r} is used twice"
        names.add(t.name)
        if t.tclass not in classes:
            yield (loc + ("tclass",), f"unknown traffic class {t.tclass!r}; use a class name or "
                   f"number from traffic_classes: "
                   f"{', '.join(f'{c.name} ({c.tc})' for c in fabric.traffic_classes)}")
        if t.duration_ns is not None and t.duration_ns <= 0:
            yield loc + ("duration",), "duration must be above 0"
        kind = REGISTRY.of(t.kind)
        yield from kind.check(t, loc, ctx)
        yield from _check_shape(t, kind.shape(t), loc, hosts)


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
