"""The path a flow takes through a built lab, asked of the kernel that forwards it.

Switches (and multi-homed hosts) route with ECMP and an L4 hash: which equal-cost
next hop a UDP flow takes depends on its 5-tuple and on a hash seed the kernel draws
at boot (`fib_multipath_hash_seed` 0, the default, means that random one), so no plan
can say which spine a source port reaches. This module asks each node's kernel, hop
by hop, with the route lookup forwarding itself uses: RTM_GETROUTE with the flow's
protocol and ports (RTA_IP_PROTO, RTA_SPORT, RTA_DPORT; pyroute2 0.9 does not know
these attributes, so the request is encoded here). At the source host it is an output
lookup (what a socket's send does); at each switch an input lookup with RTA_IIF the
port the packet came in on, so the kernel builds a packet with those headers and
hashes it as it hashes a forwarded one.

`pick_sports` finds the lowest source ports of a range whose path crosses given
nodes, deterministically for a given kernel (docs/roce.md, "Pinning a QP to a path").
Everything here reads; nothing is changed in any namespace.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from collections.abc import Iterable, Sequence

from agents.wire.netlink import attrs
from testbed.net import batch, namespaces
from testbed.plan.model import InterfacePlan, Plan
from testbed.plan.paths import Routes, host_address

# <linux/rtnetlink.h>
RTM_NEWROUTE = 24
RTM_GETROUTE = 26
RTA_DST, RTA_SRC, RTA_IIF, RTA_OIF = 1, 2, 3, 4
RTA_IP_PROTO, RTA_SPORT, RTA_DPORT = 27, 28, 29
RTN_LOCAL = 2
NLMSG_ERROR = 2
NLM_F_REQUEST = 1
IPPROTO_UDP = 17

# RoCEv2 source ports: rxe uses 0xC000 | a 14-bit hash of the QPN.
ROCE_SPORT_RANGE = range(0xC000, 0x10000)

_NLMSG = struct.Struct("=IHHII")
_RTMSG = struct.Struct("=BBBBBBBBI")
_NLA = struct.Struct("=HH")

Hop = tuple[str, str]          # (node, egress ifname)


class PathError(RuntimeError):
    """A flow's path could not be found, or no port of a range crosses the nodes asked."""


def _attr(kind: int, payload: bytes) -> bytes:
    raw = _NLA.pack(_NLA.size + len(payload), kind) + payload
    return raw + b"\0" * (-len(raw) % 4)


def route_get_message(seq: int, dst: str, src: str, proto: int, sport: int, dport: int,
                      iif: int | None = None) -> bytes:
    """RTM_GETROUTE for one IPv4 flow: an output lookup, or with `iif` (an ifindex) the
    input lookup of a packet arriving there."""
    body = _RTMSG.pack(socket.AF_INET, 32, 32, 0, 0, 0, 0, 0, 0)
    body += _attr(RTA_DST, ipaddress.IPv4Address(dst).packed)
    body += _attr(RTA_SRC, ipaddress.IPv4Address(src).packed)
    if iif is not None:
        body += _attr(RTA_IIF, struct.pack("=I", iif))
    body += _attr(RTA_IP_PROTO, struct.pack("=B", proto))
    body += _attr(RTA_SPORT, struct.pack("!H", sport))    # big-endian, as on the wire
    body += _attr(RTA_DPORT, struct.pack("!H", dport))
    return _NLMSG.pack(_NLMSG.size + len(body), RTM_GETROUTE, NLM_F_REQUEST, seq, 0) + body


def parse_route_reply(data: bytes, seq: int) -> tuple[int | None, int]:
    """(RTA_OIF or None, route type) of the RTM_NEWROUTE answering `seq`; OSError for
    the kernel's refusal."""
    off = 0
    while off + _NLMSG.size <= len(data):
        length, mtype, _flags, mseq, _pid = _NLMSG.unpack_from(data, off)
        if length < _NLMSG.size:
            break
        if mseq == seq:
            if mtype == NLMSG_ERROR:
                (code,) = struct.unpack_from("=i", data, off + _NLMSG.size)
                if code:
                    raise OSError(-code, f"route get: {os.strerror(-code)}")
            elif mtype == RTM_NEWROUTE:
                rtm_type = data[off + _NLMSG.size + 7]
                oif = None
                for kind, start, stop in attrs(data, off + _NLMSG.size + _RTMSG.size,
                                                     off + length):
                    if kind == RTA_OIF and stop - start >= 4:
                        (oif,) = struct.unpack_from("=I", data, start)
                return oif, rtm_type
        off += (length + 3) & ~3
    raise OSError(0, "route get: no answer")


class RouteLookup:
    """One route socket per node, opened inside its namespace, and its ifindex maps;
    the kernel's route lookups for flows. Close it (or use it as a context manager)."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self._socks: dict[str, socket.socket] = {}
        self._index: dict[str, dict[str, int]] = {}
        self._names: dict[str, dict[int, str]] = {}
        self._seq = 1

    def __enter__(self) -> RouteLookup:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close()
        self._socks.clear()

    def _sock(self, node: str) -> socket.socket:
        sock = self._socks.get(node)
        if sock is None:
            with namespaces.inside(self.plan.node(node).netns):
                sock = batch.open_route_socket()
            self._socks[node] = sock
            self._index[node] = batch.dump_link_indexes(sock, node)
            self._names[node] = {i: n for n, i in self._index[node].items()}
        return sock

    def egress(self, node: str, src: str, dst: str, proto: int, sport: int, dport: int,
               iif: str | None = None) -> str | None:
        """The ifname `node` sends the flow out of (None: it is for `node` itself).
        `iif`: the port it arrives on (an input lookup, as forwarding does)."""
        sock = self._sock(node)
        self._seq = (self._seq + 1) & 0x7FFFFFFF or 1
        ifindex = None
        if iif is not None:
            ifindex = self._index[node].get(iif)
            if ifindex is None:
                raise PathError(f"node {node} has no port {iif}")
        sock.send(route_get_message(self._seq, dst, src, proto, sport, dport, ifindex))
        try:
            while True:
                try:
                    oif, rtm_type = parse_route_reply(sock.recv(1 << 16), self._seq)
                    break
                except OSError as exc:
                    if exc.errno == 0 and str(exc).endswith("no answer"):
                        continue            # a stale answer to an earlier request
                    raise
        except OSError as exc:
            raise PathError(f"node {node}: route get {src}:{sport} -> {dst}:{dport}"
                            f"{' in on ' + iif if iif else ''}: {exc.strerror}") from exc
        if rtm_type == RTN_LOCAL:
            return None
        if oif is None:
            raise PathError(f"node {node}: no route for {dst}")
        name = self._names[node].get(oif)
        if name is None:
            raise PathError(f"node {node}: route to {dst} leaves by unknown ifindex {oif}")
        return name


def _ports_of(plan: Plan, node: str) -> dict[str, InterfacePlan]:
    return {i.ifname: i for i in plan.node(node).interfaces}


def flow_path(plan: Plan, src_host: str, dst_address: str, sport: int, dport: int,
              proto: int = IPPROTO_UDP, *, src_address: str | None = None,
              lookup: RouteLookup | None = None,
              stop_unless: Iterable[str] | None = None) -> list[Hop]:
    """The (node, egress ifname) hops a flow from `src_host` (its first NIC's address,
    or `src_address`) to `dst_address` takes, from the source host to the last switch,
    as each node's kernel routes it. `stop_unless`: nodes the caller needs the path to
    cross; the walk stops early (a shorter path is returned) once the plan's routes say
    the rest of the way cannot reach one of them not yet crossed."""
    own = lookup or RouteLookup(plan)
    src_ip = src_address or host_address(plan, src_host)
    wanted = set(stop_unless or ())
    routes = _reach(plan, dst_address) if wanted else None
    try:
        hops: list[Hop] = []
        node, iif = src_host, None
        for _ in range(len(plan.nodes) + 1):
            wanted.discard(node)
            if routes is not None and wanted and not wanted <= routes.get(node, set()):
                return hops
            out = own.egress(node, src_ip, dst_address, proto, sport, dport, iif)
            if out is None:            # delivered here
                return hops
            hops.append((node, out))
            iface = _ports_of(plan, node)[out]
            peer = plan.node(iface.peer.node)
            if peer.role != "switch":
                return hops            # the host the address belongs to
            node, iif = peer.name, iface.peer.ifname
        raise PathError(f"flow {src_ip}:{sport} -> {dst_address}:{dport} loops: "
                        + " -> ".join(f"{n}:{i}" for n, i in hops))
    finally:
        if lookup is None:
            own.close()


def _reach(plan: Plan, address: str) -> dict[str, set[str]]:
    """node -> the switches some equal-cost path from it toward `address` crosses
    (the plan's routes)."""
    routes = Routes(plan)
    memo: dict[str, set[str]] = {}

    def walk(node: str) -> set[str]:
        if node in memo:
            return memo[node]
        memo[node] = set()          # a loop reads as nothing more
        found: set[str] = set()
        for iface in routes.egress_toward(node, address):
            nxt = iface.peer.node
            if routes.nodes[nxt].role == "switch":
                found |= {nxt} | walk(nxt)
        memo[node] = found
        return found

    for n in plan.nodes:
        walk(n.name)
    return memo


def switches_between(plan: Plan, src_host: str, dst_host: str) -> set[str]:
    """Every switch on some equal-cost path from `src_host` to `dst_host` by the plan."""
    return _reach(plan, host_address(plan, dst_host)).get(src_host, set())


def crosses(path: Sequence[Hop], via: Iterable[str]) -> bool:
    nodes = {n for n, _ in path}
    return all(v in nodes for v in via)


def describe_path(path: Sequence[Hop]) -> str:
    return " -> ".join(f"{n}:{i}" for n, i in path) or "(no hop)"


def pick_sports(plan: Plan, src: str, dst: str, via: Sequence[str], *, dport: int,
                count: int = 1, proto: int = IPPROTO_UDP,
                ports: range = ROCE_SPORT_RANGE, exclude: Iterable[int] = (),
                entry: str = "", lookup: RouteLookup | None = None
                ) -> list[tuple[int, list[Hop]]]:
    """The `count` lowest source ports in `ports` (not in `exclude`) whose path from host
    `src` to host `dst`'s port `dport` crosses every node of `via`, each with its path.
    PathError, naming `entry` and a path tried, when the range holds fewer."""
    own = lookup or RouteLookup(plan)
    skip = set(exclude)
    dst_ip = host_address(plan, dst)
    who = f"{entry}: " if entry else ""
    unreachable = set(via) - switches_between(plan, src, dst)
    if unreachable:
        raise PathError(f"{who}no equal-cost path from {src} to {dst} crosses "
                        f"{', '.join(sorted(unreachable))}")
    found: list[tuple[int, list[Hop]]] = []
    tried: tuple[int, list[Hop]] | None = None
    try:
        for sport in ports:
            if sport in skip:
                continue
            path = flow_path(plan, src, dst_ip, sport, dport, proto, lookup=own,
                             stop_unless=via)
            if crosses(path, via):
                found.append((sport, path))
                if len(found) == count:
                    return found
            elif tried is None:
                tried = (sport, flow_path(plan, src, dst_ip, sport, dport, proto, lookup=own))
    finally:
        if lookup is None:
            own.close()
    example = (f"; port {tried[0]} goes {describe_path(tried[1])}" if tried else "")
    raise PathError(
        f"{who}only {len(found)} of {count} source port(s) in {ports.start}..{ports.stop - 1} "
        f"take {src} -> {dst} (UDP {dport}) through {', '.join(via)}{example}")


def pick_sport(plan: Plan, src: str, dst: str, via: Sequence[str], *, dport: int,
               proto: int = IPPROTO_UDP, ports: range = ROCE_SPORT_RANGE,
               exclude: Iterable[int] = (), entry: str = "",
               lookup: RouteLookup | None = None) -> int:
    """The lowest source port in `ports` whose path from `src` to `dst` crosses `via`."""
    return pick_sports(plan, src, dst, via, dport=dport, proto=proto, ports=ports,
                       exclude=exclude, entry=entry, lookup=lookup)[0][0]
