"""Paths through a planned fabric: where a node sends a packet for an address, and the
longest round trip a traffic class can see between two hosts. Pure, over a Plan."""

from __future__ import annotations

import ipaddress
from fractions import Fraction

from testbed.plan.model import InterfacePlan, Plan


def host_address(plan: Plan, host: str) -> str:
    """A host's first NIC address (what agents bind to and send to)."""
    return plan.node(host).interfaces[0].address.split("/")[0]


def host_addresses(plan: Plan, host: str) -> set[str]:
    """Every address of a host: a multi-homed sender's datagrams leave with the address of
    the NIC its route picked."""
    return {i.address.split("/")[0] for i in plan.node(host).interfaces}


def link_address(plan: Plan, node: str, peer: str) -> str | None:
    """`node`'s address on its (first) link to `peer`, or None if they are not linked."""
    for iface in plan.node(node).interfaces:
        if iface.peer.node == peer:
            return iface.address.split("/")[0]
    return None


def neighbours(plan: Plan, node: str) -> list[str]:
    """The nodes `node` has a link to, in interface order, each once."""
    return list(dict.fromkeys(i.peer.node for i in plan.node(node).interfaces))


def line_rate_bps(plan: Plan, host: str) -> int:
    """A host's first NIC's egress rate (what its agents pace against), fabric bit/s."""
    return plan.node(host).interfaces[0].egress.rate_bps


class Routes:
    """The plan's forwarding, for walking paths: nodes by name, each node's routes as one
    {network: next-hop interfaces} table per prefix length, longest first."""

    def __init__(self, plan: Plan) -> None:
        self.nodes = {n.name: n for n in plan.nodes}
        self._peers = {n.name: {i.peer.address: i for i in n.interfaces} for n in plan.nodes}
        self._tables: dict[str, list[tuple[int, dict[int, list[InterfacePlan]]]]] = {}
        for n in plan.nodes:
            by_name = {i.ifname: i for i in n.interfaces}
            lengths: dict[int, dict[int, list[InterfacePlan]]] = {}
            for r in n.routes:
                net = ipaddress.IPv4Network(r.dst)
                lengths.setdefault(net.prefixlen, {})[int(net.network_address)] = [
                    by_name[h.ifname] for h in r.nexthops if h.ifname in by_name]
            self._tables[n.name] = sorted(lengths.items(), reverse=True)

    def egress_toward(self, node: str, address: str) -> list[InterfacePlan]:
        """The interfaces `node` sends a packet for `address` out of: the link to it, or
        the next hops of the longest matching route (several: ECMP)."""
        direct = self._peers[node].get(address)
        if direct is not None:
            return [direct]
        ip = int(ipaddress.IPv4Address(address))
        for length, table in self._tables[node]:
            hops = table.get(ip & ((0xFFFFFFFF << (32 - length)) & 0xFFFFFFFF))
            if hops is not None:
                return hops
        return []


def _port_time_ns(plan: Plan, iface: InterfacePlan, tc: int) -> Fraction:
    """One egress port's share of a round trip: its link's delay there and back, plus the
    time to drain what class `tc` can hold there at the port's rate (XOFF + headroom where
    PFC protects the class, else its byte limit)."""
    held = 0
    for c in iface.egress.classes:
        if c.tc == tc:
            held = c.limit_bytes if c.pfc is None else min(
                c.limit_bytes, c.pfc.xoff_bytes + c.pfc.headroom_bytes)
    return 2 * plan.links[iface.link].delay_ns + Fraction(held * 8 * 10**9,
                                                          iface.egress.rate_bps)


def _longest_to(plan: Plan, routes: Routes, dst: str, address: str, node: str, tc: int,
                memo: dict[str, Fraction | None],
                port_ns: dict[tuple[str, str], Fraction]) -> Fraction | None:
    """Longest time from `node` to host `dst` along the routes (None: no way there);
    `memo` holds the nodes already done for this destination."""
    if node in memo:
        return memo[node]
    memo[node] = None                       # a routing loop reads as no way
    best = None
    for iface in routes.egress_toward(node, address):
        nxt = iface.peer.node
        rest: Fraction | None
        if nxt == dst:
            rest = Fraction(0)
        elif routes.nodes[nxt].role == "switch":  # hosts do not forward
            rest = _longest_to(plan, routes, dst, address, nxt, tc, memo, port_ns)
        else:
            rest = None
        if rest is None:
            continue
        key = (node, iface.ifname)
        if key not in port_ns:
            port_ns[key] = _port_time_ns(plan, iface, tc)
        if best is None or port_ns[key] + rest > best:
            best = port_ns[key] + rest
    memo[node] = best
    return best


def longest_round_trip_ns(plan: Plan, tc: int) -> Fraction:
    """The longest round trip class `tc` can see between two hosts: over every host pair
    and every ECMP path between them, the base RTT (each link's delay,
    there and back) plus the time to drain every egress port's buffer of the class on the
    way. One pass per destination with each node's longest remaining time memoised, so
    the cost grows with hosts x nodes, not with the number of paths (the unit tests
    check it against every path enumerated)."""
    hosts = [h.name for h in plan.hosts()]
    routes = Routes(plan)
    port_ns: dict[tuple[str, str], Fraction] = {}
    worst = Fraction(0)
    for dst in hosts:
        address = host_address(plan, dst)
        memo: dict[str, Fraction | None] = {}
        for src in hosts:
            if src != dst:
                found = _longest_to(plan, routes, dst, address, src, tc, memo, port_ns)
                worst = max(worst, found or Fraction(0))
    return worst


# What one RoCEv2 packet costs on the wire beyond its payload: BTH 12 + ICRC 4, plus
# UDP 8 + IPv4 20 + Ethernet 14 + FCS 4 + preamble/SFD 8 + IFG 12 (the agents'
# WIRE_OVERHEAD_BYTES, agents/runtime/framing.py). An ACK adds its AETH 4 to no payload.
ROCE_PACKET_OVERHEAD_BYTES = 12 + 4 + 8 + 20 + 14 + 4 + 8 + 12
ROCE_ACK_WIRE_BYTES = ROCE_PACKET_OVERHEAD_BYTES + 4


def routed_path(plan: Plan, src: str, dst: str, routes: Routes | None = None
                ) -> list[InterfacePlan]:
    """The egress interfaces a packet from host `src` to host `dst` leaves through, in
    order: at each node the first of its equal-cost next hops (the routes are shortest
    paths, so this is one of the shortest). ValueError if the routes do not get there."""
    routes = routes or Routes(plan)
    address = host_address(plan, dst)
    path: list[InterfacePlan] = []
    node, seen = src, {src}
    while node != dst:
        hops = routes.egress_toward(node, address)
        if not hops:
            raise ValueError(f"no route from {node} toward {dst} ({address})")
        iface = hops[0]
        path.append(iface)
        node = iface.peer.node
        if node in seen:
            raise ValueError(f"routing loop from {src} to {dst} at {node}")
        seen.add(node)
    return path


def base_round_trip_ns(plan: Plan, src: str, dst: str, *,
                       payload_bytes: int | None = None) -> int:
    """Host `src` to host `dst` and back through empty queues, fabric ns: along the
    routed path there (routed_path) each egress port's link delay plus the serialisation
    of one full data packet (`payload_bytes`, default the plan's RoCE MTU, plus
    ROCE_PACKET_OVERHEAD_BYTES) at that port's rate, and along the routed path back each
    port's link delay plus one ACK's (ROCE_ACK_WIRE_BYTES). On a symmetric path that is
    per hop 2 x delay + data + ACK serialisation. HPCC's third.cc (pairRtt) takes
    2 x delay plus each hop's serialisation of one payload (packet_payload_size, no
    headers) and none for the ACK, so ours is a little longer: by the headers and the
    ACK's time on every hop. Rounded to the nearest ns."""
    routes = Routes(plan)
    data_bytes = (plan.roce_mtu_bytes if payload_bytes is None else payload_bytes) \
        + ROCE_PACKET_OVERHEAD_BYTES
    total = Fraction(0)
    for path, wire_bytes in ((routed_path(plan, src, dst, routes), data_bytes),
                             (routed_path(plan, dst, src, routes), ROCE_ACK_WIRE_BYTES)):
        for iface in path:
            total += plan.links[iface.link].delay_ns + Fraction(
                wire_bytes * 8 * 10**9, iface.egress.rate_bps)
    return round(total)


def unreachable_host_pairs(plan: Plan, routes: Routes | None = None
                           ) -> list[tuple[str, str, str]]:
    """Every (src, dst, why) of hosts whose packets the plan's routes do not all deliver:
    walked hop by hop over every equal-cost next hop, so a dead end on one ECMP branch
    counts too. A host other than the destination does not forward. Pure; per destination
    each node is judged once (memoized), so the cost is hosts x nodes x fan-out."""
    routes = routes or Routes(plan)
    hosts = [n.name for n in plan.nodes if n.role == "host"]
    out: list[tuple[str, str, str]] = []
    for dst in hosts:
        if not plan.node(dst).interfaces:
            continue
        address = host_address(plan, dst)
        verdict: dict[str, str | None] = {dst: None}      # None: delivers
        for src in hosts:
            if src != dst and not plan.node(src).interfaces:
                out.append((src, dst, f"{src} has no interface"))
                continue
            stack, on_path = [src], set()
            while stack:
                node = stack[-1]
                if node in verdict:
                    stack.pop()
                    on_path.discard(node)
                    continue
                if node != src and routes.nodes[node].role == "host":
                    verdict[node] = f"the route reaches host {node}, which does not forward"
                    continue
                hops = routes.egress_toward(node, address)
                if not hops:
                    verdict[node] = f"{node} has no route toward {dst} ({address})"
                    continue
                on_path.add(node)
                peers = [h.peer.node for h in hops]
                looped = [p for p in peers if p in on_path and p not in verdict]
                if looped:
                    verdict[node] = f"routing loop through {node} and {looped[0]}"
                    continue
                pending = [p for p in dict.fromkeys(peers) if p not in verdict]
                if pending:
                    stack.extend(pending)
                    continue
                verdict[node] = next((verdict[p] for p in peers if verdict[p]), None)
            why = verdict[src]
            if src != dst and why is not None:
                out.append((src, dst, why))
    return out
