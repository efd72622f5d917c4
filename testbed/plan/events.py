"""Compile the config's fault timeline (`events:`) into EventPlans. Pure.

Each event becomes the egress ports it changes and what each becomes, computed the way
the rest of the plan is: a loss event's new total drop probability combines the PHY's
frame loss with the new loss (as compile._egress_loss does), a rate event's egress is the
port's egress renegotiated (compile.egress_at_rate), a link_down/link_up carries every
node's route table with the links down at that moment. Events apply in time order
(config order at a tie) and their effects add up: a later rate event starts from the
port's rate after the earlier ones, a link_up finds the links still down.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from agents.timebase import Dilation
from testbed.config.models import (
    EcnEvent,
    Fabric,
    HostDrainEvent,
    LinkStateEvent,
    LossEvent,
    PfcEvent,
    RateEvent,
    TrafficClass,
)
from testbed.phy import PORT_TYPES
from testbed.plan.model import (
    EcnPlan,
    EgressPlan,
    EventPlan,
    EventPortPlan,
    InterfacePlan,
    LinkPlan,
    NodePlan,
    RoutePlan,
)
from testbed.plan.qos import ECN_ABOVE_XOFF, resolve_ecn_curve
from testbed.units import format_rate, format_size

# Every node's routes with the given links (Plan.links indices) down.
RoutesWithDown = Callable[[frozenset[int]], dict[str, list[RoutePlan]]]
# Rate of an egress renegotiated: (egress, new fabric rate) -> egress.
Renegotiate = Callable[[EgressPlan, int], EgressPlan]


@dataclass
class CompiledEvents:
    events: list[EventPlan] = field(default_factory=list)
    problems: list[tuple[tuple, str]] = field(default_factory=list)    # (config loc, message)
    allowed: list[str] = field(default_factory=list)    # ecn-above-xoff let through by allow:


class _State:
    """The fabric as the timeline has left it so far: each port's egress, links down."""

    def __init__(self, nodes: list[NodePlan]) -> None:
        self.nodes = {n.name: n for n in nodes}
        self.egress: dict[tuple[str, str], EgressPlan] = {
            (n.name, i.ifname): i.egress for n in nodes for i in n.interfaces}
        self.down: set[int] = set()

    def ports(self, node: str, peer: str | None = None) -> list[InterfacePlan]:
        return [i for i in self.nodes[node].interfaces if peer is None or i.peer.node == peer]


def compile_events(fabric: Fabric, nodes: list[NodePlan], links: list[LinkPlan],
                   dilation: Dilation, routes_with_down: RoutesWithDown,
                   renegotiate: Renegotiate) -> CompiledEvents:
    """The timeline's EventPlans sorted by at_ns (stable), and what only the plan finds."""
    out = CompiledEvents()
    if not fabric.events:
        return out
    classes: dict[str | int, TrafficClass] = {t.name: t for t in fabric.traffic_classes}
    classes |= {t.tc: t for t in fabric.traffic_classes}
    state = _State(nodes)
    order = sorted(range(len(fabric.events)), key=lambda i: fabric.events[i].at_ns)
    for index in order:
        ev = fabric.events[index]
        loc = ("events", index)
        if isinstance(ev, LinkStateEvent):
            plan = _link_state(index, ev, links, state, routes_with_down)
        elif isinstance(ev, LossEvent):
            plan = _loss(index, ev, links, state)
        elif isinstance(ev, RateEvent):
            plan = _rate(index, ev, links, state, dilation, renegotiate)
        elif isinstance(ev, PfcEvent):
            plan = _pfc(index, ev, classes[ev.tclass], state)
            if not plan.ports:
                out.problems.append((loc + ("tclass",), f"no port of {plan.target} has PFC "
                                     f"for {classes[ev.tclass].name}; its port class has "
                                     "pfc.enabled: false or leaves the class out of "
                                     "pfc.priorities"))
        elif isinstance(ev, EcnEvent):
            plan = _ecn(index, ev, classes[ev.tclass], state)
            for msg in _ecn_above_xoff(ev, plan, state):
                if ECN_ABOVE_XOFF in fabric.allow:
                    out.allowed.append(f"events[{index}]: {msg}")
                else:
                    out.problems.append((loc + ("kmin",), f"{msg}; lower kmin or allow it "
                                         f"on purpose (allow: [{ECN_ABOVE_XOFF}])"))
                    break
        else:
            plan = _host_drain(index, ev, state, dilation)
            if not plan.ports:
                out.problems.append((loc + ("host",), f"{ev.host}'s ports toward its switch "
                                     "have no lossless class with PFC, so its NIC could not "
                                     "send pauses"))
        out.events.append(plan)
    return out


def _link_name(ev: LinkStateEvent | LossEvent | RateEvent) -> str:
    return f"{ev.link[0]}-{ev.link[1]}"


def _links_between(links: list[LinkPlan], a: str, b: str) -> list[LinkPlan]:
    return [link for link in links if {link.a.node, link.b.node} == {a, b}]


def _link_state(index: int, ev: LinkStateEvent, links: list[LinkPlan], state: _State,
                routes_with_down: RoutesWithDown) -> EventPlan:
    up = ev.kind == "link_up"
    ports = []
    for link in _links_between(links, *ev.link):
        (state.down.discard if up else state.down.add)(link.index)
        ports += [EventPortPlan(node=end.node, ifname=end.ifname, up=up)
                  for end in (link.a, link.b)]
    tables = routes_with_down(frozenset(state.down))
    routes = {name: tables.get(name, []) for name in state.nodes}
    return EventPlan(index=index, at_ns=ev.at_ns, kind=ev.kind, target=_link_name(ev),
                     description=f"link {_link_name(ev)} {'up' if up else 'down'} (both "
                                 "directions)", ports=ports, converge_ns=ev.converge_ns,
                     routes=routes)


def _loss(index: int, ev: LossEvent, links: list[LinkPlan], state: _State) -> EventPlan:
    """The new loss replaces the link's impairment in that direction; the PHY's frame loss
    stays (a lossy cable does not get better because an optic degrades)."""
    senders = {"both": set(ev.link), "forward": {ev.link[0]}, "reverse": {ev.link[1]}}
    ports = []
    for link in _links_between(links, *ev.link):
        for end in (link.a, link.b):
            if end.node in senders[ev.direction]:
                total = 1.0 - (1.0 - link.frame_loss_ratio) * (1.0 - ev.loss)
                ports.append(EventPortPlan(node=end.node, ifname=end.ifname,
                                           loss_probability=total))
    where = {"both": "both directions", "forward": f"{ev.link[0]} to {ev.link[1]}",
             "reverse": f"{ev.link[1]} to {ev.link[0]}"}[ev.direction]
    return EventPlan(index=index, at_ns=ev.at_ns, kind=ev.kind, target=_link_name(ev),
                     description=f"{ev.cause} {ev.loss:.4g} on link {_link_name(ev)} "
                                 f"({where})", ports=ports)


def _rate(index: int, ev: RateEvent, links: list[LinkPlan], state: _State,
          dilation: Dilation, renegotiate: Renegotiate) -> EventPlan:
    ports = []
    rate_bps = 0
    for link in _links_between(links, *ev.link):
        if ev.rate_bps is not None:
            rate_bps = ev.rate_bps
        else:
            port = PORT_TYPES[link.port_type]
            rate_bps = link.rate_bps * (ev.lanes or 0) // port.lanes
        for end in (link.a, link.b):
            key = (end.node, end.ifname)
            state.egress[key] = renegotiate(state.egress[key], rate_bps)
            ports.append(EventPortPlan(node=end.node, ifname=end.ifname,
                                       egress=state.egress[key]))
    lanes = f" ({ev.lanes} lanes up)" if ev.lanes is not None else ""
    return EventPlan(index=index, at_ns=ev.at_ns, kind=ev.kind, target=_link_name(ev),
                     description=f"link {_link_name(ev)} at {format_rate(rate_bps)}{lanes}"
                                 f" ({format_rate(dilation.to_wall_bps(rate_bps))} wall)",
                     ports=ports)


def _port_target(node: str, ports: list[InterfacePlan], peer: str | None) -> str:
    if peer is None:
        return node
    return ",".join(f"{node}:{i.ifname}" for i in ports) or f"{node}:{peer}"


def _pfc(index: int, ev: PfcEvent, tclass: TrafficClass, state: _State) -> EventPlan:
    ifaces = state.ports(ev.node, ev.port)
    ports = [EventPortPlan(node=ev.node, ifname=i.ifname, tc=tclass.tc,
                           pfc_enabled=ev.enabled)
             for i in ifaces if any(c.tc == tclass.tc and c.pfc is not None
                                    for c in state.egress[(ev.node, i.ifname)].classes)]
    target = _port_target(ev.node, ifaces, ev.port)
    return EventPlan(index=index, at_ns=ev.at_ns, kind=ev.kind, target=target,
                     description=f"PFC {'on' if ev.enabled else 'off'} for TC{tclass.tc} "
                                 f"({tclass.name}) at {target}", ports=ports)


def _ecn(index: int, ev: EcnEvent, tclass: TrafficClass, state: _State) -> EventPlan:
    """The new curve at each port, at the port's rate then (per-25G presets scale); it
    becomes the class's ECN in the port's egress for the events after it."""
    ifaces = state.ports(ev.node, ev.port)
    ports = []
    curve = ""
    for i in ifaces:
        key = (ev.node, i.ifname)
        egress = state.egress[key]
        s = resolve_ecn_curve(ev, egress.rate_bps)
        ecn = EcnPlan(kmin_bytes=s.kmin_bytes, kmax_bytes=s.kmax_bytes, pmax=s.pmax)
        curve = (f"kmin {format_size(s.kmin_bytes)} kmax {format_size(s.kmax_bytes)} pmax "
                 f"{s.pmax:g}")
        state.egress[key] = egress.model_copy(update={"classes": [
            c.model_copy(update={"ecn": ecn}) if c.tc == tclass.tc else c
            for c in egress.classes]})
        ports.append(EventPortPlan(node=ev.node, ifname=i.ifname, tc=tclass.tc, ecn=ecn))
    target = _port_target(ev.node, ifaces, ev.port)
    return EventPlan(index=index, at_ns=ev.at_ns, kind=ev.kind, target=target,
                     description=f"ECN for TC{tclass.tc} ({tclass.name}) at {target}: "
                                 f"{curve}", ports=ports)


def _ecn_above_xoff(ev: EcnEvent, plan: EventPlan, state: _State) -> list[str]:
    """The qos check (ecn.kmin below a static pfc.xoff), for the ports the event changes."""
    out = []
    for p in plan.ports:
        for c in state.egress[(p.node, p.ifname)].classes:
            if (c.tc == p.tc and p.ecn is not None and c.pfc is not None
                    and c.pfc.mode == "static" and p.ecn.kmin_bytes >= c.pfc.xoff_bytes):
                out.append(f"kmin {format_size(p.ecn.kmin_bytes)} is not below pfc.xoff "
                           f"{format_size(c.pfc.xoff_bytes)} on TC{c.tc} at "
                           f"{p.node}:{p.ifname}, so PFC will fire before ECN marks")
    return out


def _host_drain(index: int, ev: HostDrainEvent, state: _State,
                dilation: Dilation) -> EventPlan:
    """The host's NIC ports toward a switch, one per lossless class with PFC there."""
    ports = []
    for i in state.ports(ev.host):
        if state.nodes[i.peer.node].role != "switch":
            continue
        for c in state.egress[(ev.host, i.ifname)].classes:
            if c.lossless and c.pfc is not None:
                ports.append(EventPortPlan(
                    node=ev.host, ifname=i.ifname, tc=c.tc, drain_rate_bps=ev.drain_rate_bps,
                    # 0 stays 0: a stuck NIC (to_wall_bps keeps a rate above 0)
                    drain_wall_rate_bps=(None if ev.drain_rate_bps is None
                                         else dilation.to_wall_bps(ev.drain_rate_bps)
                                         if ev.drain_rate_bps else 0),
                    xoff_bytes=c.pfc.xoff_bytes, xon_bytes=c.pfc.xon_bytes))
    what = ("drains at line rate again" if ev.drain_rate_bps is None
            else "stops draining" if ev.drain_rate_bps == 0
            else f"drains at {format_rate(ev.drain_rate_bps)}")
    return EventPlan(index=index, at_ns=ev.at_ns, kind=ev.kind, target=ev.host,
                     description=f"{ev.host}'s NIC {what} (its receive buffer sends PFC above "
                                 "XOFF)", ports=ports)
