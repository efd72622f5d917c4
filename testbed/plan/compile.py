"""Stage 3: compile a validated config and its PHY into a plan. Pure.

Address plan: the host links of each switch share one aligned block, so
every other switch needs one route per switch (to the block), not one per
host; multi-homed hosts get per-link /31 routes. Switch-to-switch links take
/31s after the blocks. Switches route with ECMP over every equal-cost
neighbour (shortest paths over the switch graph) and hash on L4 ports.
"""

from __future__ import annotations

import ipaddress
import math
from collections import defaultdict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from agents.timebase import Dilation
from testbed.config import LoadedConfig
from testbed.config.errors import ConfigError, Problem
from testbed.config.models import Fabric, Link, Node, SwitchBuffer
from testbed.phy import PhyResult, evaluate
from testbed.plan.capacity import (
    DEFAULT_CAPACITY,
    MARGIN,
    Capacity,
    Choice,
    Need,
    choose_factor,
    workload_need,
)
from testbed.plan.events import compile_events
from testbed.plan.model import (
    CapacityPlan,
    ClassPlan,
    DilationPlan,
    EcnPlan,
    EgressPlan,
    InterfacePlan,
    LinkEndPlan,
    LinkPlan,
    NextHopPlan,
    NodeBufferPlan,
    NodePlan,
    PeerPlan,
    PfcPlan,
    Plan,
    RedPlan,
    RoutePlan,
    TrafficClassPlan,
    TrimPlan,
)
from testbed.plan.paths import Routes, routed_path, unreachable_host_pairs
from testbed.plan.qos import (
    DEFAULT_BUFFER_BYTES,
    ECN_ABOVE_XOFF,
    ETH_WIRE_OVERHEAD_BYTES,
    headroom_bytes,
    resolve_port_qos,
)
from testbed.plan.red import red_params
from testbed.units import format_size
from testbed.workloads.base import LoadContext
from testbed.workloads.registry import REGISTRY

# A conservative wall-rate budget per port for `dilation: auto` when the
# config says none and `testbed calibrate` has not measured this machine.
DEFAULT_MAX_WALL_PORT_RATE_BPS = 200_000_000
NETNS_PREFIX = "tb-"
# HTB sees skb->len, which includes the 14-byte Ethernet header but not the
# FCS (4), preamble (8) and inter-frame gap (12) that occupy the wire.
HTB_OVERHEAD_BYTES = 4 + 8 + 12
# Floor of a strict class's guaranteed share; it borrows the rest first (prio 0).
STRICT_SHARE = 0.01

# ECMP's L4 hash over the 5-tuple (policy 3 with fields 0x37: addresses, protocol,
# ports), so flows spread by port and a route lookup given the ports (`ip route get ...
# ipproto udp sport S dport D`) predicts the path a forwarded packet takes. Policy 1
# would reuse the skb hash RPS already computed at the first ingress, which a route
# lookup never sees (testbed/net/paths.py; docs/roce.md, "Pinning a QP to a path").
MULTIPATH_SYSCTLS = {
    "net.ipv4.fib_multipath_hash_policy": "3",
    # 0x37: source and destination address, protocol, source and destination port;
    # written in decimal, as the kernel reads it back
    "net.ipv4.fib_multipath_hash_fields": "55",
}
SWITCH_SYSCTLS = {
    "net.ipv4.ip_forward": "1",
    **MULTIPATH_SYSCTLS,
    "net.ipv4.conf.all.rp_filter": "0",            # ECMP paths are asymmetric
    "net.ipv4.conf.default.rp_filter": "0",
    "net.ipv6.conf.all.disable_ipv6": "1",        # no ND/MLD chatter in counters
    "net.ipv6.conf.default.disable_ipv6": "1",
}
HOST_SYSCTLS = {
    **MULTIPATH_SYSCTLS,
    "net.ipv4.conf.all.rp_filter": "0",
    "net.ipv4.conf.default.rp_filter": "0",
    "net.ipv6.conf.all.disable_ipv6": "1",
    "net.ipv6.conf.default.disable_ipv6": "1",
}


def netns_name(lab: str, node: str) -> str:
    return f"{NETNS_PREFIX}{lab}-{node}"


def nice_ceiling(value: float) -> int:
    """Smallest of 1, 2, 5 x 10^k that is >= value (dilation factors people can read)."""
    if value <= 1:
        return 1
    exp = 10 ** math.floor(math.log10(value))
    for step in (1, 2, 5, 10):
        if step * exp >= value - 1e-9:
            return int(step * exp)
    raise AssertionError("unreachable")


def choose_dilation(configured: int | str, busiest_bps: int, budget_bps: int) -> DilationPlan:
    if configured == "auto":
        factor = nice_ceiling(busiest_bps / budget_bps)
        mode = "auto"
    else:
        factor = int(configured)
        mode = "fixed"
    d = Dilation(factor)
    return DilationPlan(factor=factor, mode=mode, max_wall_port_rate_bps=budget_bps,
                        busiest_port_bps=busiest_bps,
                        busiest_wall_port_bps=d.to_wall_bps(busiest_bps))


def mac_for(link_index: int, end: int) -> str:
    # Locally administered, deterministic: pcaps and neighbour tables repeat run to run.
    b = link_index.to_bytes(3, "big")
    return f"02:54:{b[0]:02x}:{b[1]:02x}:{b[2]:02x}:{end:02x}"


@dataclass
class _End:
    node: str
    ifname: str
    address: ipaddress.IPv4Address


class _Allocator:
    def __init__(self, pool: ipaddress.IPv4Network) -> None:
        self.pool = pool
        self.cursor = int(pool.network_address)
        self.end = int(pool.broadcast_address) + 1

    def block(self, n_addresses: int) -> ipaddress.IPv4Network:
        size = 1 << max(1, math.ceil(math.log2(n_addresses)))
        start = -(-self.cursor // size) * size
        if start + size > self.end:
            raise OverflowError(f"address pool {self.pool} is exhausted")
        self.cursor = start + size
        return ipaddress.IPv4Network((start, 32 - int(math.log2(size))))


@dataclass(frozen=True)
class _EndRole:
    """What an egress port's node changes in its classes."""

    host: bool              # a host NIC: no ECN marking (RNICs do not mark their own packets)
    pool_bytes: int = 0     # > 0: lossless PFC classes draw from the switch's shared pool
    fan_in: int = 0         # other ports of the node that can fill this port (static mode)


def _egress(rate_bps: int, dilation: Dilation, classes_qos, tclasses, mtu_bytes: int,
            end: _EndRole) -> EgressPlan:
    wall = dilation.to_wall_bps(rate_bps)
    frame = mtu_bytes + ETH_WIRE_OVERHEAD_BYTES
    shares = _class_shares(wall, tclasses)
    by_tc = {q.tc: q for q in classes_qos}
    classes = []
    default_classid = ""
    for tclass in sorted(tclasses, key=lambda t: t.tc):
        q = by_tc[tclass.tc]
        classid = f"1:{0x10 + tclass.tc:x}"
        if tclass.default:
            default_classid = classid
        share = shares[tclass.tc]
        shared = bool(end.pool_bytes and q.pfc and not end.host)
        pfc = None
        if q.pfc:
            egress_xoff = egress_xon = 0
            if not end.host and not shared:
                # Egress protection: a queue at egress_xoff pauses every ingress holding
                # bytes in it; each may then still put its headroom in, so the buffer must
                # hold egress_xoff + fan-in x headroom.
                egress_xoff = max(0, min(q.pfc.xoff_bytes,
                                         q.limit_bytes - end.fan_in * q.pfc.headroom_bytes))
                egress_xon = max(0, egress_xoff - 2 * frame) if egress_xoff else 0
            pfc = PfcPlan(**vars(q.pfc), egress_xoff_bytes=egress_xoff,
                          egress_xon_bytes=egress_xon)
        leaf_handle = f"{0x100 + tclass.tc:x}:"
        limit = end.pool_bytes if shared else q.limit_bytes
        ecn = EcnPlan(**vars(q.ecn)) if q.ecn and not end.host else None
        red = _red_plan(tclass.tc, classid, leaf_handle, bool(q.pfc), ecn, limit)
        classes.append(ClassPlan(
            tc=tclass.tc, name=tclass.name, dscp=sorted(tclass.dscp), classid=classid,
            leaf_handle=leaf_handle, prio=0 if tclass.strict else 1,
            # A PFC class gets a TBF leaf: the pause gate (testbed/net/qdisc.py); a class
            # marked by sch_red has it under the gate, or as its leaf.
            leaf_kind="tbf" if q.pfc else ("red" if red else "bfifo"),
            wall_rate_bps=share, wall_ceil_bps=wall,
            limit_bytes=limit, shared=shared,
            lossless=tclass.lossless,
            ecn=ecn,
            pfc=pfc,
            # host NICs never trim (a NIC does not cut its own packets)
            trim=TrimPlan(**vars(q.trim)) if q.trim and not end.host else None,
            red=red,
        ))
    return EgressPlan(rate_bps=rate_bps, wall_rate_bps=wall, overhead_bytes=HTB_OVERHEAD_BYTES,
                      burst_bytes=_burst_bytes(wall, frame), quantum_bytes=frame,
                      default_classid=default_classid, classes=classes)


def _red_plan(tc: int, classid: str, leaf_handle: str, gated: bool, ecn: EcnPlan | None,
              limit_bytes: int) -> RedPlan | None:
    """The sch_red of a class marked by it: under the PFC gate (the TBF's class, so the
    gate still stops the class and RED's queue is the class's), else the class's leaf."""
    if ecn is None or ecn.marker != "red":
        return None
    params = red_params(ecn.kmin_bytes, ecn.kmax_bytes, ecn.pmax, limit_bytes)
    return RedPlan(handle=f"{0x200 + tc:x}:" if gated else leaf_handle,
                   parent=f"{leaf_handle}1" if gated else classid,
                   limit_bytes=params.limit_bytes, qth_min_bytes=params.qth_min_bytes,
                   qth_max_bytes=params.qth_max_bytes, max_p_fp=params.max_p_fp,
                   plog=params.plog)


def _class_shares(wall_bps: int, tclasses) -> dict[int, int]:
    """Each class's guaranteed wall rate at a port of `wall_bps`: strict classes a floor,
    the weighted classes the rest by weight."""
    strict = [t for t in tclasses if t.strict]
    weighted = [t for t in tclasses if not t.strict]
    strict_wall = max(8_000, int(wall_bps * STRICT_SHARE))
    left = max(8_000, wall_bps - strict_wall * len(strict))
    total_weight = sum(t.weight for t in weighted) or 1
    return {t.tc: strict_wall if t.strict else max(8_000, left * t.weight // total_weight)
            for t in tclasses}


def _burst_bytes(wall_bps: int, frame_bytes: int) -> int:
    # A burst of two frames, or 100 us of wall time at low rates' timer granularity.
    return max(2 * frame_bytes, wall_bps // 8 // 10_000)


def egress_at_rate(egress: EgressPlan, rate_bps: int, dilation: Dilation,
                   tclasses) -> EgressPlan:
    """`egress` renegotiated to `rate_bps` (fabric): wall rate, burst and class rates
    recomputed as _egress computes them; buffers, ECN and PFC thresholds unchanged (a
    switch keeps its port config when the port's speed changes)."""
    wall = dilation.to_wall_bps(rate_bps)
    shares = _class_shares(wall, tclasses)
    classes = [c.model_copy(update={"wall_rate_bps": shares[c.tc], "wall_ceil_bps": wall})
               for c in egress.classes]
    return egress.model_copy(update={
        "rate_bps": rate_bps, "wall_rate_bps": wall, "classes": classes,
        "burst_bytes": _burst_bytes(wall, egress.quantum_bytes)})


def compile_plan(loaded: LoadedConfig, max_wall_port_rate_bps: int | None = None,
                 capacity: Capacity | None = None) -> Plan:
    """Config + PHY + dilation -> plan. Raises ConfigError for problems only the plan finds.

    `dilation: auto` takes D from `capacity` (what this machine carries, default
    DEFAULT_CAPACITY: testbed/plan/capacity.py), unless the config pins
    `max_wall_port_rate`: then from that per-port budget alone, a rule that needs no
    machine's figures (every VM of a --vms run builds the same plan). A fixed D is
    checked against the capacity and warned about when the workload would not fit.
    `max_wall_port_rate_bps` is the machine's calibrated per-port budget: it only says
    which budget a plan shows when the config pins none."""
    fabric = loaded.fabric
    cap = capacity or DEFAULT_CAPACITY
    pinned = fabric.max_wall_port_rate_bps
    budget = pinned or max_wall_port_rate_bps or DEFAULT_MAX_WALL_PORT_RATE_BPS
    busiest = max((evaluate(link.port, link.length_m, fabric.mtu_bytes).mac_rate_bps
                   for link in loaded.expanded.links), default=1)
    by_port = choose_dilation(fabric.dilation, busiest, budget)
    # Routes and paths do not depend on D: the plan at the per-port rule's D gives them.
    plan, risks = _compile(loaded, by_port)
    need = plan_need(loaded, plan)
    choice = choose_factor(need, cap, nice_ceiling, busiest)
    if fabric.dilation == "auto" and pinned is None and need.streams:
        factor = choice.factor
        if factor < by_port.factor:
            # The PFC floor: below some D the emulated PFC loop (~2 ms of wall time to
            # answer an XOFF) takes more fabric time than the lossless queues' headroom
            # covers. Never put more queues at that risk than the per-port rule's D did.
            plan, at_risk = _compile(loaded, _at(by_port, factor, busiest))
            while at_risk > risks and factor < by_port.factor:
                factor = min(nice_ceiling(factor + 1), by_port.factor)
                plan, at_risk = _compile(loaded, _at(by_port, factor, busiest))
        else:
            factor = by_port.factor
        dplan = _at(by_port, factor, busiest).model_copy(update={
            "rule": "capacity",
            "capacity": _capacity_plan("capacity", need, cap, choice, factor, pfc_factor=factor)})
        warnings = []
    else:
        # A fixed D, a per-port budget the config pins, or no workload to size D from
        # (`testbed up` for traffic of the user's own): the per-port rule, checked.
        dplan = by_port.model_copy(update={
            "capacity": _capacity_plan("check", need, cap, choice, by_port.factor)})
        # The config's own per-port budget is the rule it asked for; otherwise a fixed D
        # is checked against the capacity (the per-port budget alone is too coarse).
        warnings = (_budget_warnings(dplan, budget) if pinned is not None
                    else _capacity_warnings(dplan, choice))
    return plan.model_copy(update={"dilation": dplan, "warnings": warnings + plan.warnings})


def _at(by_port: DilationPlan, factor: int, busiest_bps: int) -> DilationPlan:
    return by_port.model_copy(update={
        "factor": factor, "busiest_wall_port_bps": Dilation(factor).to_wall_bps(busiest_bps)})


def plan_need(loaded: LoadedConfig, plan: Plan) -> Need:
    """The packet rates the config's workload puts through `plan`'s fabric at D = 1: each
    kind's offered streams (testbed/workloads: `offered_load`) along the plan's routed
    paths (testbed/plan/paths.routed_path)."""
    fabric = loaded.fabric
    traffic = fabric.workload.traffic if fabric.workload is not None else []
    hosts = [h.name for h in plan.hosts()]
    classes: dict[str | int, object] = {t.name: t for t in fabric.traffic_classes}
    classes |= {t.tc: t for t in fabric.traffic_classes}
    ctx = LoadContext(hosts=hosts, classes=classes,  # type: ignore[arg-type]
                      nic_bps={h.name: h.interfaces[0].egress.rate_bps
                               for h in plan.hosts() if h.interfaces},
                      mtu_bytes=plan.mtu_bytes, roce_mtu_bytes=plan.roce_mtu_bytes)
    loads = [load for entry in traffic for load in REGISTRY.of(entry.kind).offered_load(
        entry, ctx)]
    routes = Routes(plan)

    def path_of(src: str, dst: str) -> list[tuple[str, int]]:
        try:
            hops = routed_path(plan, src, dst, routes)
        except (ValueError, KeyError, IndexError):
            return []          # the compile refuses unreachable pairs; a host to itself
        out, node = [], src
        for iface in hops:
            out.append((f"{node}:{iface.ifname}", iface.egress.rate_bps))
            node = iface.peer.node
        return out

    return workload_need(loads, path_of)


def _capacity_plan(rule: str, need: Need, cap: Capacity, choice: Choice,
                   factor: int, pfc_factor: int = 1) -> CapacityPlan:
    def r(x: float) -> float:
        return float(f"{x:.6g}")

    at_1 = need.core_s_per_s(cap)
    # core-seconds per fabric second at D = 1 -> per wall second at D
    fabric_s_per_wall_s = Dilation(factor).to_fabric_ns(10**9) / 10**9
    return CapacityPlan(
        rule=rule, streams=need.streams, longest_path_hops=need.longest_path_hops,
        hop_pps=r(need.hop_pps),
        agent_send_pps={k: r(v) for k, v in sorted(need.agent_send_pps.items())},
        agent_recv_pps={k: r(v) for k, v in sorted(need.agent_recv_pps.items())},
        busiest_port=need.busiest_port, busiest_port_pps=r(need.busiest_port_pps),
        need_cores_at_1=r(at_1), need_cores=r(at_1 * fabric_s_per_wall_s),
        hop_pps_per_core=r(cap.hop_pps_per_core),
        agent_core_s_per_packet={k: {"send": r(a.send_core_s), "recv": r(a.recv_core_s)}
                                 for k, a in sorted(cap.agents.items())},
        cores=cap.cores, margin=MARGIN, derating=r(cap.derating),
        derating_note=cap.derating_note, usable_cores=r(cap.usable_cores),
        need_factor=choice.need_factor, port_factor=choice.port_factor,
        rate_factor=choice.rate_factor, least_factor=r(choice.least), pfc_factor=pfc_factor,
        source=cap.source)


def _capacity_warnings(dplan: DilationPlan, choice: Choice) -> list[str]:
    """A fixed D below what the capacity rule would pick: the machine may not keep up."""
    c = dplan.capacity
    if c is None or choice.fits(dplan.factor):
        return []
    return [f"dilation D={dplan.factor} needs {c.need_cores:.2f} cores of packet work "
            # a packet rate converts as a bit rate does: fabric -> wall divides by D
            f"(workload {Dilation(dplan.factor).to_wall_bps(c.hop_pps):,} hop packets/s "
            "wall), above the "
            f"{c.usable_cores:.2f} this machine gives a plan ({c.source}): ports and "
            f"agents may fall behind; dilation: auto would pick D={choice.factor}"]


def _compile(loaded: LoadedConfig, dplan: DilationPlan) -> tuple[Plan, int]:
    """The plan at the dilation `dplan` (without the dilation's own warnings), and how many
    lossless queues the emulated PFC loop may overflow at that D (_Ports.pfc_loop_risks)."""
    fabric = loaded.fabric
    nodes = loaded.expanded.nodes
    links = loaded.expanded.links
    role = {n.name: n.role for n in nodes}

    phys: list[PhyResult] = [evaluate(link.port, link.length_m, fabric.mtu_bytes)
                             for link in links]
    warnings: list[str] = []

    ifnames = _interface_names(links, role)
    aggregated = _aggregated_host_links(links, role)
    subnets, blocks = _address_plan(loaded, aggregated)
    ends = _link_ends(links, role, ifnames, subnets)

    pools = _pools(fabric, links, role)
    warnings += pools.warnings()
    ports = _port_plans(loaded, phys, role, ifnames, subnets, Dilation(dplan.factor), pools,
                        dplan.pfc_loop_wall_ns)
    warnings += ports.warnings
    if ports.problems:
        raise ConfigError(loaded.path, ports.problems)

    static = _static_routes(fabric, links, ends)

    def routes_with_down(down: frozenset[int]) -> dict[str, list[RoutePlan]]:
        # Static routes stay as configured whatever is down: they do not reconverge.
        return _with_static(_routes(nodes, links, role, ends, subnets, blocks, aggregated,
                                    fabric.address_pool, down), static)

    routes = routes_with_down(frozenset())
    egress = _remap_dscp(fabric, ports.egress, ends)
    node_plans = [_node_plan(fabric, node, links, phys, ends, egress, routes, pools)
                  for node in nodes]
    problems = _pool_problems(loaded, node_plans)
    if problems:
        raise ConfigError(loaded.path, problems)
    warnings += [f"link {link.index} {link.a.node}-{link.b.node}: {w}"
                 for link in ports.links for w in link.phy_warnings]
    dilation = Dilation(dplan.factor)
    timeline = compile_events(
        fabric, node_plans, ports.links, dilation, routes_with_down,
        lambda e, rate_bps: egress_at_rate(e, rate_bps, dilation, fabric.traffic_classes))
    if timeline.problems:
        raise ConfigError(loaded.path, [Problem(loaded.lines.line_for(loc), loc, msg)
                                        for loc, msg in timeline.problems])
    if timeline.allowed:
        warnings.append(allowance_warning(ECN_ABOVE_XOFF, timeline.allowed))
    plan = Plan(
        lab=fabric.name, netns_prefix=netns_name(fabric.name, ""),
        address_pool=str(fabric.address_pool), mtu_bytes=fabric.mtu_bytes,
        roce_mtu_bytes=fabric.roce_mtu_bytes, dilation=dplan,
        traffic_classes=[TrafficClassPlan(**t.model_dump()) for t in fabric.traffic_classes],
        nodes=node_plans, links=ports.links, warnings=warnings, events=timeline.events)
    unreachable = unreachable_host_pairs(plan)
    if unreachable:
        raise ConfigError(loaded.path, [_unreachable_problem(loaded, unreachable)])
    return plan, ports.pfc_loop_risks


MAX_PAIRS_SHOWN = 5
# What the two warnings of a lossless queue at risk from the emulated PFC loop say
# (_Ports.pfc_loop_risks counts them).
FAN_IN_OVERFLOW = "cannot absorb"
EMULATED_LOOP_SHORT = "the emulated PFC loop answers in"
EARLY_EGRESS_PAUSE = "egress protection pauses the upstream ports at"


def _unreachable_problem(loaded: LoadedConfig, pairs: list[tuple[str, str, str]]) -> Problem:
    """One problem for every host pair the routes do not deliver, at the links (or the
    static routes, when a route is what breaks the path)."""
    fabric = loaded.fabric
    loc: tuple = ("routes",) if fabric.routes else ("links",) if fabric.links else ("topology",)
    shown = "; ".join(f"{s} -> {d}: {why}" for s, d, why in pairs[:MAX_PAIRS_SHOWN])
    extra = len(pairs) - MAX_PAIRS_SHOWN
    more = f" (and {extra} more pairs)" if extra > 0 else ""
    return Problem(loaded.lines.line_for(loc), loc,
                   f"{len(pairs)} host pairs cannot reach each other on the plan's routes: "
                   f"{shown}{more}; connect the fabric (every switch must reach every other) "
                   "or fix the static routes")


def _static_routes(fabric: Fabric, links: list[Link],
                   ends: Mapping[tuple[int, str], _End]) -> dict[str, list[RoutePlan]]:
    """The config's static routes, per node: a host dst is a /32 per address of the host,
    a prefix dst itself; the next hops are every link from the node to each via."""
    out: dict[str, list[RoutePlan]] = defaultdict(list)
    for route in fabric.routes:
        hops = [NextHopPlan(gateway=str(ends[(i, other)].address), ifname=ends[(i, end)].ifname)
                for via in route.via for i, link in enumerate(links)
                for end, other in (("a", "b"), ("b", "a"))
                if getattr(link, end) == route.node and getattr(link, other) == via]
        dsts = [f"{ends[(i, end)].address}/32" for i, link in enumerate(links)
                for end in ("a", "b") if getattr(link, end) == route.dst]
        if not dsts:
            dsts = [str(ipaddress.IPv4Network(route.dst))]
        out[route.node] += [RoutePlan(dst=dst, nexthops=hops) for dst in dsts]
    return out


def _with_static(routes: Mapping[str, list[RoutePlan]],
                 static: Mapping[str, list[RoutePlan]]) -> dict[str, list[RoutePlan]]:
    """`routes` with each node's static routes added, replacing a route of the same prefix;
    sorted by destination as _routes sorts them."""
    out = {name: list(table) for name, table in routes.items()}
    for name, extra in static.items():
        table = {r.dst: r for r in out.get(name, [])}
        table |= {r.dst: r for r in extra}
        out[name] = sorted(table.values(), key=lambda r: ipaddress.IPv4Network(r.dst))
    return out


def _remap_dscp(fabric: Fabric, egress: Mapping[tuple[int, str], EgressPlan],
                ends: Mapping[tuple[int, str], _End]) -> dict[tuple[int, str], EgressPlan]:
    """Each dscp_remap moves its DSCP into the named class's dscp list at every egress
    port of its switch (and out of the class that had it), so the port's classifier
    follows the switch's own map."""
    tcs: dict[str | int, int] = {t.name: t.tc for t in fabric.traffic_classes}
    tcs |= {t.tc: t.tc for t in fabric.traffic_classes}
    remaps: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for remap in fabric.dscp_remap:
        remaps[remap.node].append((remap.dscp, tcs[remap.tclass]))
    out = dict(egress)
    for key, plan in egress.items():
        moves = remaps.get(ends[key].node)
        if not moves:
            continue
        classes = list(plan.classes)
        for dscp, tc in moves:
            classes = [c.model_copy(update={"dscp": sorted(
                (set(c.dscp) - {dscp}) | ({dscp} if c.tc == tc else set()))})
                for c in classes]
        out[key] = plan.model_copy(update={"classes": _retarget_trims(classes)})
    return out


def _retarget_trims(classes: list[ClassPlan]) -> list[ClassPlan]:
    """After a DSCP remap a trimmed packet must still be steered into its trim class at
    this port: its DSCP becomes the class's first one here (no trimming if it has none)."""
    dscps = {c.tc: c.dscp for c in classes}
    out = []
    for c in classes:
        if c.trim is not None and c.trim.dscp not in dscps.get(c.trim.tc, []):
            left = dscps.get(c.trim.tc) or []
            trim = c.trim.model_copy(update={"dscp": left[0]}) if left else None
            c = c.model_copy(update={"trim": trim})
        out.append(c)
    return out


def _budget_warnings(dplan: DilationPlan, budget_bps: int) -> list[str]:
    """A fixed D that leaves the busiest port above the machine's wall-rate budget."""
    if dplan.busiest_wall_port_bps <= budget_bps:
        return []
    return [f"dilation D={dplan.factor} puts the busiest port at "
            f"{dplan.busiest_wall_port_bps / 1e6:g} Mb/s wall, above this machine's "
            f"{budget_bps / 1e6:g} Mb/s budget: ports may fall behind their rate; "
            "raise D or use dilation: auto"]


def _interface_names(links: list[Link], role: Mapping[str, str]) -> dict[tuple[int, str], str]:
    """Each (link, end)'s interface name: hosts eth0.., switches swp1.., in link order."""
    ifnames: dict[tuple[int, str], str] = {}
    count: dict[str, int] = defaultdict(int)
    for i, link in enumerate(links):
        for end in ("a", "b"):
            node = getattr(link, end)
            n = count[node]
            count[node] += 1
            ifnames[(i, end)] = f"eth{n}" if role[node] == "host" else f"swp{n + 1}"
    return ifnames


def _aggregated_host_links(links: list[Link], role: Mapping[str, str]) -> dict[str, list[int]]:
    """Switch -> the links of its single-homed hosts, whose /31s share one routed block."""
    host_links_of_host: dict[str, list[int]] = defaultdict(list)
    for i, link in enumerate(links):
        for end, other in (("a", "b"), ("b", "a")):
            if role[getattr(link, end)] == "host" and role[getattr(link, other)] == "switch":
                host_links_of_host[getattr(link, end)].append(i)
    aggregated: dict[str, list[int]] = defaultdict(list)
    for idxs in host_links_of_host.values():
        if len(idxs) == 1:
            link = links[idxs[0]]
            switch = link.b if role[link.b] == "switch" else link.a
            aggregated[switch].append(idxs[0])
    return aggregated


def _address_plan(loaded: LoadedConfig, aggregated: Mapping[str, list[int]],
                  ) -> tuple[dict[int, ipaddress.IPv4Network], dict[str, ipaddress.IPv4Network]]:
    """Each link's /31 and each switch's host block, from the address pool in node order
    (blocks first, then the other links); ConfigError with the size needed if it is full."""
    fabric = loaded.fabric
    links = loaded.expanded.links
    alloc = _Allocator(fabric.address_pool)
    subnets: dict[int, ipaddress.IPv4Network] = {}
    blocks: dict[str, ipaddress.IPv4Network] = {}
    try:
        for switch in [n.name for n in loaded.expanded.nodes if n.name in aggregated]:
            idxs = aggregated[switch]
            block = alloc.block(2 * len(idxs))
            blocks[switch] = block
            base = int(block.network_address)
            for k, i in enumerate(idxs):
                subnets[i] = ipaddress.IPv4Network((base + 2 * k, 31))
        for i in range(len(links)):
            if i not in subnets:
                subnets[i] = alloc.block(2)
    except OverflowError as exc:
        # Each switch's host block is rounded up to a power of two; this is
        # the smallest pool that holds every block and /31.
        need = sum(1 << max(1, math.ceil(math.log2(2 * len(v)))) for v in aggregated.values())
        need += 2 * (len(links) - sum(len(v) for v in aggregated.values()))
        prefix = 32 - math.ceil(math.log2(need))
        raise ConfigError(loaded.path, [Problem(
            loaded.lines.line_for(("address_pool",)), ("address_pool",),
            f"{exc}: {len(links)} links need at least {need} addresses; "
            f"use a /{prefix} or larger (default 198.18.0.0/15)")]) from None
    return subnets, blocks


def _link_ends(links: list[Link], role: Mapping[str, str],
               ifnames: Mapping[tuple[int, str], str],
               subnets: Mapping[int, ipaddress.IPv4Network]) -> dict[tuple[int, str], _End]:
    """Both ends of every link; the switch end is the lower (gateway) address, else the a end."""
    ends: dict[tuple[int, str], _End] = {}
    for i, link in enumerate(links):
        low, high = subnets[i].network_address, subnets[i].network_address + 1
        a_low = not (role[link.a] == "host" and role[link.b] == "switch")
        ends[(i, "a")] = _End(link.a, ifnames[(i, "a")], low if a_low else high)
        ends[(i, "b")] = _End(link.b, ifnames[(i, "b")], high if a_low else low)
    return ends


@dataclass(frozen=True)
class _Pools:
    """Each switch's shared buffer pool: the switch_buffer's size for all, or, without one,
    the pool dynamic PFC implies for some (`implied`); 0 means per-port buffers."""

    configured: int
    implied: dict[str, int]

    def of(self, node: str) -> int:
        return self.configured or self.implied.get(node, 0)

    def warnings(self) -> list[str]:
        return [f"{node}: PFC mode dynamic without a switch_buffer: its lossless classes "
                f"share one pool of their ports' buffers ({format_size(size)}); set "
                "switch_buffer: {size: ...} to size the pool"
                for node, size in sorted(self.implied.items())]


def _pools(fabric: Fabric, links: list[Link], role: Mapping[str, str]) -> _Pools:
    configured = fabric.switch_buffer.size_bytes if fabric.switch_buffer else 0
    return _Pools(configured, {} if configured else _implied_pools(fabric, links, role))


@dataclass
class _Ports:
    """Every link's plan and each end's egress, with what the per-port QoS checks found."""

    links: list[LinkPlan] = field(default_factory=list)
    egress: dict[tuple[int, str], EgressPlan] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)

    @property
    def pfc_loop_risks(self) -> int:
        """Lossless queues the emulated PFC loop puts at risk: a fan-in whose headroom the
        buffer cannot absorb, a headroom below what the loop needs at this D, or egress
        protection that must pause below the configured XOFF to leave room for the
        headroom (the PFC fires earlier than configured): the three warnings of
        _fan_in_warnings and _headroom_warnings that say so."""
        return sum(1 for w in self.warnings
                   if any(mark in w for mark in (FAN_IN_OVERFLOW, EMULATED_LOOP_SHORT,
                                                 EARLY_EGRESS_PAUSE)))


def _port_plans(loaded: LoadedConfig, phys: list[PhyResult], role: Mapping[str, str],
                ifnames: Mapping[tuple[int, str], str],
                subnets: Mapping[int, ipaddress.IPv4Network], dilation: Dilation,
                pools: _Pools, loop_wall_ns: int) -> _Ports:
    """Per-port QoS at both ends of every link, and each link's plan."""
    fabric = loaded.fabric
    links = loaded.expanded.links
    tclasses = list(fabric.traffic_classes)
    ports_of: dict[str, int] = defaultdict(int)
    for link in links:
        ports_of[link.a] += 1
        ports_of[link.b] += 1
    # Fan-in warnings are about per-port buffers: nodes with a pool are not asked.
    per_port_role = {n: r for n, r in role.items() if not pools.of(n)}
    response_ns = round(dilation.to_fabric_ns(loop_wall_ns))
    headroom_room = _pool_headroom_room(fabric, links, role, pools.of)
    headroom_seen: list[tuple] = []
    allowed: dict[str, list[str]] = {}      # allow: name -> the problems it let through
    out = _Ports()
    for i, (link, phy) in enumerate(zip(links, phys, strict=True)):
        port_class = fabric.qos[link.qos]
        classes_qos, qos_problems = resolve_port_qos(
            port_class, tclasses, phy.mac_rate_bps, round(phy.delay_ns), fabric.mtu_bytes,
            shared_pool=bool(pools.of(link.a) or pools.of(link.b)), response_ns=response_ns,
            pool_headroom_room_bytes=min(
                (headroom_room[n] for n in (link.a, link.b) if n in headroom_room),
                default=None))
        for qp in qos_problems:
            loc = ("qos", link.qos, *qp.field.split("."))
            msg = f"{qp.message} (link {link.a}-{link.b}, {link.port})"
            if qp.allowance and qp.allowance in fabric.allow:
                allowed.setdefault(qp.allowance, []).append(f"qos.{link.qos}.{qp.field}: {msg}")
                continue
            if not any(p.loc == loc for p in out.problems):
                out.problems.append(Problem(loaded.lines.line_for(loc), loc, msg))
        for end in ("a", "b"):
            name = getattr(link, end)
            out.egress[(i, end)] = _egress(phy.mac_rate_bps, dilation, classes_qos, tclasses,
                                           fabric.mtu_bytes, _EndRole(
                                               host=role[name] == "host",
                                               pool_bytes=pools.of(name),
                                               fan_in=ports_of[name] - 1))
        out.warnings += _fan_in_warnings(link, classes_qos, ports_of, per_port_role,
                                         fabric.mtu_bytes)
        headroom_seen.append((link, port_class, classes_qos, phy))
        out.links.append(LinkPlan(
            index=i, a=LinkEndPlan(node=link.a, ifname=ifnames[(i, "a")]),
            b=LinkEndPlan(node=link.b, ifname=ifnames[(i, "b")]), subnet=str(subnets[i]),
            port_type=link.port, length_m=link.length_m, qos=link.qos,
            rate_bps=phy.mac_rate_bps, wall_rate_bps=dilation.to_wall_bps(phy.mac_rate_bps),
            delay_ns=round(phy.delay_ns), wall_delay_ns=dilation.to_wall_ns(round(phy.delay_ns)),
            frame_loss_ratio=phy.frame_loss_ratio, phy_warnings=list(phy.warnings)))
    out.warnings += _headroom_warnings(headroom_seen, fabric.mtu_bytes, response_ns, loop_wall_ns,
                                       dilation.factor)
    out.warnings += [allowance_warning(name, found) for name, found in allowed.items()]
    return out


def allowance_warning(name: str, found: list[str]) -> str:
    """The one plan warning of an `allow:` item that let problems through: the first, and
    how many more (the run's fidelity notes and the report show it)."""
    first = found[0].split("; lower ")[0]
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    return (f"allowed on purpose (allow: [{name}]): {first}{more}; the config asks for it, "
            "so this is not an error")


def _node_plan(fabric: Fabric, node: Node, links: list[Link], phys: list[PhyResult],
               ends: Mapping[tuple[int, str], _End],
               egress: Mapping[tuple[int, str], EgressPlan],
               routes: Mapping[str, list[RoutePlan]], pools: _Pools) -> NodePlan:
    """One node: its namespace, buffer, sysctls, an interface per link end it holds, routes."""
    interfaces = []
    for i in range(len(links)):
        for end, other in (("a", "b"), ("b", "a")):
            if ends[(i, end)].node != node.name:
                continue
            me, peer = ends[(i, end)], ends[(i, other)]
            interfaces.append(InterfacePlan(
                ifname=me.ifname, loss_probability=_egress_loss(
                    fabric, links[i], me.node, phys[i].frame_loss_ratio),
                mac=mac_for(i, 0 if end == "a" else 1),
                address=f"{me.address}/31", mtu_bytes=fabric.mtu_bytes, link=i,
                peer=PeerPlan(node=peer.node, ifname=peer.ifname, address=str(peer.address)),
                egress=egress[(i, end)]))
    pool_bytes = pools.of(node.name)
    return NodePlan(
        name=node.name, role=node.role, netns=netns_name(fabric.name, node.name),
        buffer=_node_buffer(node.role, interfaces, pool_bytes,
                            fabric.switch_buffer or SwitchBuffer(size_bytes=pool_bytes)),
        sysctls=dict(SWITCH_SYSCTLS if node.role == "switch" else HOST_SYSCTLS),
        interfaces=interfaces, routes=routes.get(node.name, []),
        endpoint=next((h.endpoint for h in fabric.hosts if h.name == node.name), "transport"))


def _implied_pools(fabric: Fabric, links: list[Link],
                   role: Mapping[str, str]) -> dict[str, int]:
    """Switches whose lossless classes ask for dynamic PFC with no switch_buffer given: a
    pool of those classes' port buffers each (what they hold together)."""
    lossless = [t for t in fabric.traffic_classes if t.lossless]
    out: dict[str, int] = defaultdict(int)
    dynamic: set[str] = set()
    for link in links:
        pfc = fabric.qos[link.qos].pfc
        buffers = fabric.qos[link.qos].buffer
        for node in (link.a, link.b):
            if role[node] != "switch" or not pfc.enabled:
                continue
            tcs = [t for t in lossless if pfc.priorities is None or t.tc in pfc.priorities]
            out[node] += sum(buffers.get(t.tc, DEFAULT_BUFFER_BYTES["lossless"]) for t in tcs)
            if pfc.mode == "dynamic" and "mode" in pfc.model_fields_set:
                dynamic.add(node)
    return {node: size for node, size in out.items() if node in dynamic and size}


def _pool_headroom_room(fabric: Fabric, links: list[Link], role: Mapping[str, str],
                        pool_of: Callable[[str], int]) -> dict[str, int]:
    """For each switch with a shared pool, the most auto headroom one (port, lossless
    class) may set aside: together at most half of what the pool keeps after its
    reserves, so the emulator's allowance (auto_headroom_bytes) leaves the pool room
    to share."""
    reserve = (fabric.switch_buffer or SwitchBuffer(size_bytes=0)).reserve_bytes
    lossless = {t.tc for t in fabric.traffic_classes if t.lossless}
    entries: dict[str, int] = defaultdict(int)
    for link in links:
        pfc = fabric.qos[link.qos].pfc
        if not pfc.enabled:
            continue
        n = len(lossless if pfc.priorities is None else lossless & set(pfc.priorities))
        for node in (link.a, link.b):
            if role[node] == "switch" and pool_of(node):
                entries[node] += n
    return {node: max(0, pool_of(node) - reserve * n) // (2 * n)
            for node, n in entries.items() if n}


def _node_buffer(role: str, interfaces: list[InterfacePlan], pool_bytes: int,
                 switch_buffer: SwitchBuffer) -> NodeBufferPlan:
    """A host NIC accounts nothing per ingress; a switch accounts its lossless PFC classes
    per ingress port, in per-port buffers or in a shared pool of `pool_bytes`."""
    if role == "host":
        return NodeBufferPlan(mode="none", tracked=[])
    tracked = sorted({c.tc for i in interfaces for c in i.egress.classes
                      if c.lossless and c.pfc is not None})
    if not pool_bytes:
        return NodeBufferPlan(mode="static", tracked=tracked)
    entries = [c.pfc for i in interfaces for c in i.egress.classes
               if c.tc in tracked and c.pfc is not None]
    alphas = sorted({p.alpha for p in entries}) or [0.125]
    return NodeBufferPlan(
        mode="shared", tracked=tracked, pool_bytes=pool_bytes,
        reserve_bytes=switch_buffer.reserve_bytes,
        resume_offset_bytes=switch_buffer.resume_offset_bytes,
        total_headroom_bytes=sum(p.headroom_bytes for p in entries),
        total_reserve_bytes=switch_buffer.reserve_bytes * len(entries), alpha=alphas[0])


def _pool_problems(loaded: LoadedConfig, nodes: list[NodePlan]) -> list[Problem]:
    """A shared pool must leave room to share once every headroom and reserve is set aside."""
    out = []
    loc = ("switch_buffer", "size")
    for node in nodes:
        b = node.buffer
        if b.mode != "shared":
            continue
        set_aside = b.total_headroom_bytes + b.total_reserve_bytes
        if b.pool_bytes <= set_aside:
            out.append(Problem(loaded.lines.line_for(loc), loc, (
                f"{format_size(b.pool_bytes)} leaves nothing to share on {node.name}: its "
                f"{len(node.interfaces)} ports set aside {format_size(b.total_headroom_bytes)} "
                f"of headroom and {format_size(b.total_reserve_bytes)} of reserve; raise it "
                f"above {format_size(set_aside)} or lower pfc.headroom / switch_buffer.reserve")))
            break
    return out


def _fan_in_warnings(link, classes_qos, ports_of: dict[str, int], role: dict[str, str],
                     mtu_bytes: int) -> list[str]:
    """Per-port buffers: can a switch port's buffer take what its fan-in puts in after the
    egress queue pauses them all? (Each paused ingress still sends its headroom.)"""
    out = []
    frame = mtu_bytes + ETH_WIRE_OVERHEAD_BYTES
    for name in (link.a, link.b):
        if role.get(name) != "switch":
            continue
        fan_in = ports_of[name] - 1
        for q in classes_qos:
            if q.pfc is None:
                continue
            room = q.limit_bytes - fan_in * q.pfc.headroom_bytes
            if room < frame:
                out.append(
                    f"qos.{link.qos}: TC{q.tc} buffer {format_size(q.limit_bytes)} on "
                    f"{name} {FAN_IN_OVERFLOW} its {fan_in} upstream ports' PFC headroom "
                    f"({fan_in} x {format_size(q.pfc.headroom_bytes)}): a fan-in can overflow "
                    "this lossless queue; raise the buffer or use a shared switch_buffer")
            elif room < q.pfc.xoff_bytes:
                out.append(
                    f"qos.{link.qos}: TC{q.tc} on {name}: {EARLY_EGRESS_PAUSE} "
                    f"{format_size(room)}, below pfc.xoff "
                    f"{format_size(q.pfc.xoff_bytes)}, so that {fan_in} ports' headroom "
                    f"({format_size(q.pfc.headroom_bytes)} each) fits the "
                    f"{format_size(q.limit_bytes)} buffer")
    return out


def _headroom_warnings(seen: list[tuple], mtu_bytes: int, response_ns: int, loop_wall_ns: int,
                       dilation: int) -> list[str]:
    """Headroom below what a link can put in flight after XOFF: an explicit one below the
    hardware's figure (Cisco's formula) or the emulated PFC loop's at this dilation, or
    an auto one the buffer had no room to size for the emulated loop. One warning per
    kind of port, naming how many links it covers."""
    found: dict[tuple, list[str]] = defaultdict(list)
    for link, port_class, classes_qos, phy in seen:
        pfcs = [q.pfc for q in classes_qos if q.pfc is not None]
        if not pfcs:
            continue
        given = min(p.headroom_bytes for p in pfcs)
        hardware = headroom_bytes(phy.mac_rate_bps, round(phy.delay_ns), mtu_bytes)
        emulated = headroom_bytes(phy.mac_rate_bps, round(phy.delay_ns), mtu_bytes, response_ns)
        explicit = port_class.pfc.headroom_bytes is not None
        if given < hardware:
            kind = "hardware"
        elif given < emulated:
            kind = "explicit" if explicit else "no_room"
        else:
            continue
        key = (kind, link.qos, phy.mac_rate_bps, given, hardware, emulated)
        found[key].append(f"{link.a}-{link.b}")
    out = []
    for (kind, qos, rate_bps, given, hardware, emulated), where in found.items():
        links = (f"link {where[0]}" if len(where) == 1
                 else f"{len(where)} links (first {where[0]})")
        rate = f"{rate_bps / 1e9:g} Gb/s"
        loop = (f"{EMULATED_LOOP_SHORT} ~{loop_wall_ns / 1e6:.2g} ms "
                f"of wall time, {response_ns / 1e3:.2f} us of fabric time at D = {dilation}, "
                f"and needs {format_size(emulated)}")
        if kind == "hardware":
            out.append(f"qos.{qos}: pfc.headroom {format_size(given)} is below what {links} "
                       f"({rate}) can put in flight after an XOFF ({format_size(hardware)}: two "
                       "frames, the round trip and the 802.1Qbb response time): the lossless "
                       "class may drop")
        elif kind == "explicit":
            out.append(f"qos.{qos}: pfc.headroom {format_size(given)} covers {links} ({rate}) "
                       f"in hardware, but {loop}: the lossless class may drop; raise the "
                       "headroom or D (the run's invariants will say whether it did)")
        else:
            out.append(f"qos.{qos}: the auto PFC headroom on {links} ({rate}) is "
                       f"{format_size(given)}, all the buffer has room for (hardware needs "
                       f"{format_size(hardware)}), but {loop}: the lossless class may drop; "
                       "raise the buffer or D (the run's invariants will say whether it did)")
    return out


def _egress_loss(fabric, link, sender: str, phy_loss: float) -> float:
    """Drop probability of packets `sender` puts on `link`: PHY frame loss, then impairments."""
    keep = 1.0 - phy_loss
    for imp in fabric.impairments:
        if {imp.link[0], imp.link[1]} != {link.a, link.b}:
            continue
        forward = sender == imp.link[0]
        if (imp.direction == "both" or (imp.direction == "forward") == forward):
            keep *= 1.0 - imp.loss
    return 1.0 - keep


def _routes(nodes: list[Node], links: list[Link], role: Mapping[str, str],
            ends: Mapping[tuple[int, str], _End], subnets: Mapping[int, ipaddress.IPv4Network],
            blocks: Mapping[str, ipaddress.IPv4Network], aggregated: Mapping[str, list[int]],
            pool: ipaddress.IPv4Network, down: frozenset[int] = frozenset(),
            ) -> dict[str, list[RoutePlan]]:
    """Every node's routes, by destination: a switch reaches each host prefix over all of
    its equal-cost next hops; a host sends the whole pool to the switches it is linked to.
    `down`: links that are down (a fault timeline's link_down), routed around."""
    switches = [n.name for n in nodes if n.role == "switch"]
    adj = _switch_adjacency(links, role, down)
    out: dict[str, list[RoutePlan]] = defaultdict(list)
    for prefix, owner in _destinations(switches, links, role, subnets, blocks, aggregated,
                                       down):
        for sw, hops in _ecmp_next_hops(owner, switches, adj, ends):
            out[sw].append(RoutePlan(dst=str(prefix), nexthops=hops))
    for node in nodes:
        if node.role != "host":
            continue
        hops = _host_next_hops(node.name, links, role, ends, down)
        if hops:
            out[node.name].append(RoutePlan(dst=str(pool), nexthops=hops))
    for name in out:
        out[name].sort(key=lambda r: ipaddress.IPv4Network(r.dst))
    return out


# Switch -> (neighbour switch, link index, this switch's end) for each hop, in link order.
_Adjacency = dict[str, list[tuple[str, int, str]]]


def _switch_adjacency(links: list[Link], role: Mapping[str, str],
                      down: frozenset[int] = frozenset()) -> _Adjacency:
    adj: _Adjacency = defaultdict(list)
    for i, link in enumerate(links):
        if i in down:
            continue
        if role[link.a] == "switch" and role[link.b] == "switch":
            adj[link.a].append((link.b, i, "a"))
            adj[link.b].append((link.a, i, "b"))
    return adj


def _hop_distances(adj: _Adjacency, target: str) -> dict[str, int]:
    """Switch hops from each switch that can reach `target` (breadth-first)."""
    dist = {target: 0}
    queue = deque([target])
    while queue:
        cur = queue.popleft()
        for nbr, _, _ in adj[cur]:
            if nbr not in dist:
                dist[nbr] = dist[cur] + 1
                queue.append(nbr)
    return dist


def _destinations(switches: list[str], links: list[Link], role: Mapping[str, str],
                  subnets: Mapping[int, ipaddress.IPv4Network],
                  blocks: Mapping[str, ipaddress.IPv4Network],
                  aggregated: Mapping[str, list[int]], down: frozenset[int] = frozenset(),
                  ) -> list[tuple[ipaddress.IPv4Network, str]]:
    """(prefix, switch that owns it): each switch's host block, then the /31 of every
    host link outside a block (multi-homed hosts) that is up."""
    dests = [(blocks[s], s) for s in switches if s in blocks]
    aggregated_links = {i for idxs in aggregated.values() for i in idxs}
    for i, link in enumerate(links):
        if i in aggregated_links or i in down:
            continue
        is_host_link = (role[link.a] == "host") != (role[link.b] == "host")
        if is_host_link:
            switch = link.a if role[link.a] == "switch" else link.b
            dests.append((subnets[i], switch))
    return dests


def _ecmp_next_hops(owner: str, switches: list[str], adj: _Adjacency,
                    ends: Mapping[tuple[int, str], _End]) -> list[tuple[str, list[NextHopPlan]]]:
    """For each other switch that can reach `owner`: its neighbours one hop closer."""
    dist = _hop_distances(adj, owner)
    out = []
    for sw in switches:
        if sw == owner or sw not in dist:
            continue
        hops = [NextHopPlan(gateway=str(ends[(i, "b" if end == "a" else "a")].address),
                            ifname=ends[(i, end)].ifname)
                for nbr, i, end in adj[sw] if dist.get(nbr, math.inf) == dist[sw] - 1]
        out.append((sw, hops))
    return out


def _host_next_hops(host: str, links: list[Link], role: Mapping[str, str],
                    ends: Mapping[tuple[int, str], _End],
                    down: frozenset[int] = frozenset()) -> list[NextHopPlan]:
    """A host's gateways: the switch end of each of its links that is up, in link order."""
    hops = []
    for i, link in enumerate(links):
        if i in down:
            continue
        for end, other in (("a", "b"), ("b", "a")):
            if getattr(link, end) == host and role[getattr(link, other)] == "switch":
                hops.append(NextHopPlan(gateway=str(ends[(i, other)].address),
                                        ifname=ends[(i, end)].ifname))
    return hops
