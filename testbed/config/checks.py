"""Whole-fabric checks that a single field's validator cannot make.

Each check yields (location, message); the caller turns the location into
a line. All problems are collected, none stops the others.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator

from testbed.config.models import Fabric
from testbed.config.topology import Expanded


def _suggest(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def check_traffic_classes(fabric: Fabric) -> Iterator[tuple[tuple, str]]:
    seen_tc: dict[int, int] = {}
    seen_name: dict[str, int] = {}
    seen_dscp: dict[int, int] = {}
    defaults = []
    for i, tclass in enumerate(fabric.traffic_classes):
        loc = ("traffic_classes", i)
        if tclass.tc in seen_tc:
            yield (loc + ("tc",), f"TC{tclass.tc} is defined twice "
                   f"(also traffic_classes[{seen_tc[tclass.tc]}])")
        seen_tc.setdefault(tclass.tc, i)
        if tclass.name in seen_name:
            yield loc + ("name",), f"class name {tclass.name!r} is used twice"
        seen_name.setdefault(tclass.name, i)
        for dscp in tclass.dscp:
            if dscp in seen_dscp:
                yield (loc + ("dscp",), f"DSCP {dscp} already selects "
                       f"traffic_classes[{seen_dscp[dscp]}]; a DSCP maps to one class")
            seen_dscp.setdefault(dscp, i)
        if tclass.default:
            defaults.append(i)
        if tclass.strict and tclass.lossless:
            yield (loc + ("strict",), "a strict-priority class cannot also be lossless here; "
                   "use a weighted class for lossless traffic")
    if len(defaults) != 1:
        yield (("traffic_classes",), f"exactly one class must have default: true "
               f"(found {len(defaults)}); it takes packets whose DSCP no class names")


def check_qos(fabric: Fabric) -> Iterator[tuple[tuple, str]]:
    tcs = {t.tc: t for t in fabric.traffic_classes}
    for name, port_class in fabric.qos.items():
        loc = ("qos", name)
        for tc in port_class.buffer:
            if tc not in tcs:
                yield (loc + ("buffer", tc), f"TC{tc} is not a defined traffic class "
                       f"(defined: {sorted(tcs)})")
        ecn = port_class.ecn
        forms = [ecn.preset is not None, ecn.kmin_bytes is not None or ecn.kmax_bytes is not None,
                 ecn.k_bytes is not None]
        if sum(forms) > 1:
            yield loc + ("ecn",), "give one of preset, kmin/kmax/pmax, or k (step marking)"
        elif forms[1] and (ecn.kmin_bytes is None or ecn.kmax_bytes is None):
            yield loc + ("ecn",), "kmin and kmax go together (write k: for step marking)"
        elif forms[1] and ecn.kmin_bytes > ecn.kmax_bytes:
            yield (loc + ("ecn", "kmin"),
                   f"{ecn.kmin_bytes} B is above kmax {ecn.kmax_bytes} B; kmin must be <= kmax")
        elif ecn.pmax is not None and not forms[1]:
            yield loc + ("ecn", "pmax"), "pmax goes with kmin/kmax"
        pfc = port_class.pfc
        for i, prio in enumerate(pfc.priorities or []):
            if prio not in tcs:
                yield (loc + ("pfc", "priorities", i),
                       f"priority {prio} is not a defined traffic class")
            elif not tcs[prio].lossless:
                yield (loc + ("pfc", "priorities", i), f"TC{prio} ({tcs[prio].name}) is not "
                       "lossless; mark the class lossless: true or drop it from priorities")
        if (pfc.xoff_bytes is not None and pfc.xon_bytes is not None
                and pfc.xon_bytes > pfc.xoff_bytes):
            yield (loc + ("pfc", "xon"),
                   f"{pfc.xon_bytes} B is above xoff {pfc.xoff_bytes} B; XON must be lower")


def check_topology(fabric: Fabric, expanded: Expanded,
                   known_ports: list[str]) -> Iterator[tuple[tuple, str]]:
    names: dict[str, tuple] = {}
    for node, loc in zip(expanded.nodes, expanded.node_locs, strict=True):
        if node.name in names:
            where = "the generated topology" if names[node.name] == ("topology",) else "earlier"
            yield loc + ("name",) if loc != ("topology",) else loc, (
                f"node {node.name!r} is defined twice (also {where})")
        names.setdefault(node.name, loc)
    if not expanded.nodes:
        yield (), "the fabric has no nodes: give topology: or nodes: and links:"
    pair_seen: set[frozenset] = set()
    linked: set[str] = set()
    for link, loc in zip(expanded.links, expanded.link_locs, strict=True):
        for end in ("a", "b"):
            name = getattr(link, end)
            if name not in names:
                yield loc + (end,), f"unknown node {name!r}{_suggest(name, list(names))}"
            linked.add(name)
        if link.a == link.b:
            yield loc + ("b",), f"a link from {link.a!r} to itself"
        pair = frozenset((link.a, link.b))
        if pair in pair_seen and loc[0] == "links":
            yield loc, (f"a second link between {link.a!r} and {link.b!r}; parallel links "
                        "are not supported yet")
        pair_seen.add(pair)
        if link.port not in known_ports:
            yield (loc + ("port",), f"unknown port type {link.port!r}"
                   f"{_suggest(link.port, known_ports)} (list them: testbed phy --list)")
        if link.qos not in fabric.qos:
            yield (loc + ("qos",), f"unknown port class {link.qos!r}; defined: "
                   f"{sorted(fabric.qos)}")
    for node, loc in zip(expanded.nodes, expanded.node_locs, strict=True):
        if node.name not in linked and node.name in names:
            where = loc if loc == ("topology",) else loc + ("name",)
            yield where, f"node {node.name!r} has no link"


def check_fabric(fabric: Fabric) -> Iterator[tuple[tuple, str]]:
    if fabric.roce_mtu_bytes + 80 > fabric.mtu_bytes:
        yield (("roce_mtu",), f"RoCE MTU {fabric.roce_mtu_bytes} needs an interface MTU of at "
               f"least {fabric.roce_mtu_bytes + 80} (headers take 80 B); mtu is {fabric.mtu_bytes}")
    if fabric.address_pool.prefixlen > 30:
        yield (("address_pool",), f"{fabric.address_pool} is too small for a fabric; "
               "use /30 or larger (default 198.18.0.0/15)")
