"""The kernel side of the fault timeline: apply one change of a built lab's ports or routes.

testbed/run/timeline.py decides when; this module does it, from plan objects:

- `set_links(plan, ends, up)`: a layer-1 flap. Both veth ends are set admin down (or
  up) in their namespaces, so both directions stop at once. What the kernel does on
  admin down, and what is done here about it:
  - every route through the port loses it: a single-next-hop route is deleted, a
    multipath route keeps its other next hops (the dead one is flagged and skipped);
    the connected /31 goes. On admin up the connected route comes back and dead hops
    of surviving multipath routes revive, but deleted routes do not: the timeline
    replaces every node's table once the fabric has converged (`replace_routes`);
  - the permanent neighbour entries of both ends are flushed; they are put back on up
    (the builder's reason for them: no ARP on the fabric);
  - the packets queued in the port's HTB classes are freed (qdisc reset) without
    being counted as drops anywhere. The port program admitted them and never sees
    them depart, so its queue, its FIFO ring and the node's per-ingress buffer
    accounting would keep them for good (stuck PFC pauses, a drain that never ends).
    `flush_port_queues` counts them (what each class admitted and never delivered,
    read once both ends are down) and retires them through the program's own
    departure path, under the node's lock (BPF_PROG_TEST_RUN of `port_departure`
    with a stand-in packet per lost frame), so every count stays consistent and the
    run can name the link-down as the place those packets were lost.
- `replace_routes(plan, node, routes)`: a node's whole static table becomes `routes`:
  what is not in it is deleted, the rest replaced (multipath as the builder makes it).
- `set_port_rate(plan, node, ifname, egress, gates)`: the port's HTB root and classes
  at the new rate; the TBF gates of PFC classes too when `gates` (no PFC agent runs to
  do it: the agent owns them, and is told by command otherwise).
- `set_port_params(plan, node, ifname, egress, loss)`: the port program's drop
  probability and ECN curves (`portprog.update_params`); queues and counters stay.
- `ip_drops(plan)`: per node, IPv4 packets its stack dropped (no route: the black
  hole before routes converge; a discard: a frame in the backlog of a port that went
  down).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import struct
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from pyroute2 import IPRoute
from pyroute2.netlink import NLM_F_ACK, NLM_F_CREATE, NLM_F_REPLACE, NLM_F_REQUEST
from pyroute2.netlink.rtnl import RTM_DELROUTE, RTM_NEWLINK
from pyroute2.netlink.rtnl.ifinfmsg import IFF_UP, ifinfmsg
from pyroute2.netlink.rtnl.rtmsg import rtmsg

from agents.portmaps import NUM_TC, STATE, _Bpf, obj_get
from testbed.net import namespaces, portprog
from testbed.net.batch import (
    RT_TABLE_MAIN,
    RTPROT_STATIC,
    BatchedTc,
    NetlinkBatch,
    TcTemplates,
    dump_link_indexes,
    neighbour_message,
    open_route_socket,
    route_message,
)
from testbed.net.qdisc import HTB_PORT_CLASS, HTB_ROOT, parse_handle, tbf_gate
from testbed.plan.model import EgressPlan, NodePlan, Plan, RoutePlan

# Wall time left after both ends are down before their queues are counted: a frame
# that left the HTB just before is in the peer CPU's backlog and still reaches the
# departure hook (the kernel processes a backlog entry of a device that went down).
SETTLE_WALL_S = 0.01
BPF_PROG_TEST_RUN = 10
RT_SCOPE_NOWHERE = 255
NLM_F_REPLACE_ROUTE = NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE
# class_state fields (agents/portmaps.STATE): what a flush reads and writes
_ENQ_BYTES, _ENQ_PACKETS, _DEP_BYTES, _DEP_PACKETS = 0, 1, 2, 3
_RING_HEAD, _RING_TAIL, _DEP_MISMATCH = 16, 17, 18


class EventError(RuntimeError):
    """Applying an event to the kernel failed; the message says where and why."""


@dataclass(frozen=True)
class LostClass:
    """Packets of one port class lost when its link went down (queued, then freed)."""

    node: str
    port: str
    tclass: int
    packets: int
    bytes: int

    def as_dict(self) -> dict:
        return {"node": self.node, "port": self.port, "tclass": self.tclass,
                "packets": self.packets, "bytes": self.bytes}


@contextlib.contextmanager
def _route_socket(node: NodePlan) -> Iterator[socket.socket]:
    # Opened from inside the namespace by this thread; it stays bound to it after.
    with namespaces.inside(node.netns):
        sock = open_route_socket()
    try:
        yield sock
    finally:
        sock.close()


def _ifindex(sock: socket.socket, node: NodePlan, ifname: str) -> int:
    index = dump_link_indexes(sock, node.name).get(ifname)
    if index is None:
        raise EventError(f"node {node.name}: no interface {ifname}")
    return index


def _link_message(ifindex: int, up: bool) -> bytes:
    msg = ifinfmsg()
    msg["index"], msg["flags"], msg["change"] = ifindex, IFF_UP if up else 0, IFF_UP
    msg["header"]["type"] = RTM_NEWLINK
    msg["header"]["flags"] = NLM_F_REQUEST | NLM_F_ACK
    msg.encode()
    return bytes(msg.data)


# --- links -------------------------------------------------------------------------------

def set_links(plan: Plan, ends: Iterable[tuple[str, str]], up: bool) -> list[LostClass]:
    """Set every (node, ifname) in `ends` admin up or down, one netlink request each.

    Down: once all are down (and SETTLE_WALL_S has passed), each port's queued packets
    are counted and retired from its port program (`flush_port_queues`); returns them.
    Up: the ends' permanent neighbour entries come back (the down flushed them).
    """
    ends = list(ends)
    for node_name, ifname in ends:
        node = plan.node(node_name)
        with _route_socket(node) as sock:
            batch = NetlinkBatch(sock, node.name)
            batch.add(_link_message(_ifindex(sock, node, ifname), up),
                      f"link set {ifname} {'up' if up else 'down'}")
            batch.flush()
    if up:
        for node_name, ifname in ends:
            _restore_neighbour(plan, node_name, ifname)
        time.sleep(SETTLE_WALL_S)       # carrier on at both ends (linkwatch)
        return []
    time.sleep(SETTLE_WALL_S)
    lost: list[LostClass] = []
    for node_name, ifname in ends:
        lost += flush_port_queues(plan, node_name, ifname)
    return lost


def _restore_neighbour(plan: Plan, node_name: str, ifname: str) -> None:
    node = plan.node(node_name)
    iface = next(i for i in node.interfaces if i.ifname == ifname)
    peer = plan.node(iface.peer.node)
    peer_mac = next(i.mac for i in peer.interfaces if i.ifname == iface.peer.ifname)
    peer_ip = iface.peer.address.split("/")[0]
    with _route_socket(node) as sock:
        batch = NetlinkBatch(sock, node.name)
        message = bytearray(neighbour_message(_ifindex(sock, node, ifname), peer_ip, peer_mac))
        struct.pack_into("=H", message, 6, NLM_F_REPLACE_ROUTE)   # replace, not exclusive
        batch.add(message, f"neigh replace {peer_ip} lladdr {peer_mac} dev {ifname} "
                           "nud permanent")
        batch.flush()


def _test_packet(tos: int) -> bytes:
    """A minimal IPv4 frame with this TOS: all the departure program reads of it."""
    eth = bytes(6) + bytes(6) + struct.pack("!H", 0x0800)
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, tos, 46, 0, 0, 64, 17, 0, bytes(4), bytes(4))
    return eth + ip + bytes(64 - len(eth) - len(ip))


_SKB_SIZE = 192                 # sizeof(struct __sk_buff) on 6.x kernels
_SKB_IFINDEX = 40               # __u32 ifindex in struct __sk_buff


def _run_departure(prog_fd: int, packet: bytes, ifindex: int = 0) -> None:
    """One BPF_PROG_TEST_RUN of `port_departure` on `packet` (nothing is sent).
    `ifindex`: the device the run pretends the packet arrived on (the lab instance finds
    the port by it; it must exist in this thread's namespace), 0: none (per-port build)."""
    bpf = _Bpf()
    data = ctypes.create_string_buffer(packet, len(packet))
    ctx = ctypes.create_string_buffer(_SKB_SIZE)
    struct.pack_into("=I", ctx, _SKB_IFINDEX, ifindex)
    # union bpf_attr.test: prog_fd, retval, data_size_in, data_size_out, data_in,
    # data_out, repeat, duration, ctx_size_in, ctx_size_out, ctx_in, ctx_out
    struct.pack_into("=IIIIQQIIIIQQ", bpf.attr, 0, prog_fd, 0, len(packet), 0,
                     ctypes.addressof(data), 0, 1, 0, _SKB_SIZE if ifindex else 0, 0,
                     ctypes.addressof(ctx) if ifindex else 0, 0)
    bpf.call(BPF_PROG_TEST_RUN, "PROG_TEST_RUN port_departure")


def flush_port_queues(plan: Plan, node_name: str, ifname: str) -> list[LostClass]:
    """Count and retire what a downed port's program still holds, class by class.

    Only while the port and its peer are down (no packet touches this port's own
    state then; the node's shared accounting is changed by the program itself under
    its lock). Classes accounted per ingress (a FIFO ring) retire each entry through
    `port_departure`, which releases the node's buffer and raises XON as a real
    departure would; the stand-in packet's length is not the entry's, so the
    mismatch counter that bumps is put back. Other classes' departed counters are set
    to what was admitted. A port without a program (no datapath) loses nothing known.
    """
    node = plan.node(node_name)
    iface = next(i for i in node.interfaces if i.ifname == ifname)
    pin_dir = portprog.pin_dir_of(plan.lab, node.name, ifname)
    if not (pin_dir / "progs" / "port_departure").exists():
        return []
    dscp = {c.tc: (c.dscp[0] if c.dscp else 0) for c in iface.egress.classes}
    # the lab instance counts a port's departures by the peer's ifindex: run it there
    hook = portprog.departure_hook(plan, node.name, ifname)
    maps = portprog.open_port(pin_dir)
    lost: list[LostClass] = []
    try:
        state = maps._state      # the mmap'd class states (a PortMaps internal)
        prog_fd: int | None = None
        try:
            for tc in range(NUM_TC):
                row = maps.row(tc)
                packets, nbytes = row[_ENQ_PACKETS] - row[_DEP_PACKETS], \
                    row[_ENQ_BYTES] - row[_DEP_BYTES]
                if packets <= 0 and nbytes <= 0:
                    continue
                lost.append(LostClass(node.name, ifname, tc, packets, nbytes))
                pending = row[_RING_TAIL] - row[_RING_HEAD]
                if pending:
                    if prog_fd is None:
                        prog_fd = obj_get(pin_dir / "progs" / "port_departure")
                    packet = _test_packet(dscp.get(tc, 0) << 2)
                    with (namespaces.inside(hook[0]) if hook else contextlib.nullcontext()):
                        for _ in range(pending):
                            _run_departure(prog_fd, packet, hook[1] if hook else 0)
                    _write_field(state, tc, _DEP_MISMATCH, row[_DEP_MISMATCH])
                row = maps.row(tc)
                if row[_ENQ_BYTES] != row[_DEP_BYTES] or row[_ENQ_PACKETS] != row[_DEP_PACKETS]:
                    _write_field(state, tc, _DEP_BYTES, row[_ENQ_BYTES])
                    _write_field(state, tc, _DEP_PACKETS, row[_ENQ_PACKETS])
        finally:
            if prog_fd is not None:
                os.close(prog_fd)
    finally:
        maps.close()
    return lost


def _write_field(state, tc: int, field_index: int, value: int) -> None:
    """One u64 of a class's state row (agents/portmaps.STATE: every field is a u64)."""
    assert STATE.size >= (field_index + 1) * 8
    struct.pack_into("=Q", state.view, tc * state.stride + field_index * 8, value)


# --- routes ------------------------------------------------------------------------------

def _static_routes(sock: socket.socket) -> set[str]:
    """Destinations of the main table's static routes (the builder's), "a.b.c.d/n"."""
    ipr = IPRoute(use_socket=sock)
    out = set()
    for msg in ipr.get_routes(family=socket.AF_INET, table=RT_TABLE_MAIN):
        if msg["proto"] != RTPROT_STATIC:
            continue
        out.add(f"{msg.get_attr('RTA_DST') or '0.0.0.0'}/{msg['dst_len']}")
    return out


def _delete_route_message(dst: str) -> bytes:
    """`ip route del DST proto static` in the main table (any next hops, any scope)."""
    address, prefixlen = dst.split("/")
    msg = rtmsg()
    msg["family"], msg["dst_len"], msg["table"] = socket.AF_INET, int(prefixlen), RT_TABLE_MAIN
    msg["proto"], msg["scope"] = RTPROT_STATIC, RT_SCOPE_NOWHERE
    msg["attrs"] = [("RTA_DST", address)]
    msg["header"]["type"] = RTM_DELROUTE
    msg["header"]["flags"] = NLM_F_REQUEST | NLM_F_ACK
    msg.encode()
    return bytes(msg.data)


def replace_routes(plan: Plan, node_name: str, routes: list[RoutePlan]) -> dict[str, int]:
    """Make `routes` the node's whole static table; {"deleted": n, "replaced": m}."""
    node = plan.node(node_name)
    with _route_socket(node) as sock:
        index = dump_link_indexes(sock, node.name)
        # a dump on its own socket: IPRoute reads what it likes from the one it is given
        with namespaces.inside(node.netns):
            dump_sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM,
                                      socket.NETLINK_ROUTE)
        try:
            present = _static_routes(dump_sock)
        finally:
            dump_sock.close()
        wanted = {r.dst for r in routes}
        batch = NetlinkBatch(sock, node.name)
        for dst in sorted(present - wanted):
            batch.add(_delete_route_message(dst), f"route del {dst}")
        for route in routes:
            try:
                hops = [(h.gateway, index[h.ifname]) for h in route.nexthops]
            except KeyError as exc:
                raise EventError(f"node {node.name}: route {route.dst}: no interface "
                                 f"{exc.args[0]}") from None
            message = bytearray(route_message(route.dst, hops))
            struct.pack_into("=H", message, 6, NLM_F_REPLACE_ROUTE)
            via = " ".join(f"via {h.gateway} dev {h.ifname}" for h in route.nexthops)
            batch.add(message, f"route replace {route.dst} {via}")
        batch.flush()
    return {"deleted": len(present - wanted), "replaced": len(routes)}


# IPv4 drop counters of a node's stack (/proc/net/snmp "Ip:", netstat "IpExt:"): no
# route (forwarded / own), a discard (an input port gone down under a packet in its
# backlog), a bad destination. The fabric's own drops are the port programs' and qdiscs';
# these move only around a link event.
IP_DROP_COUNTERS = (("IpExt:", "InNoRoutes"), ("Ip:", "OutNoRoutes"), ("Ip:", "InDiscards"),
                    ("Ip:", "OutDiscards"), ("Ip:", "InAddrErrors"))


def ip_drops(plan: Plan) -> dict[str, int]:
    """Per node, IPv4 packets its stack has dropped so far (IP_DROP_COUNTERS), read in
    its namespace."""
    out = {}
    for node in plan.nodes:
        with namespaces.inside(node.netns):
            # thread-self: /proc/net is the main thread's namespace, not this thread's
            tables = {"Ip:": Path("/proc/thread-self/net/snmp").read_text(),
                      "IpExt:": Path("/proc/thread-self/net/netstat").read_text()}
        out[node.name] = sum(_proc_counter(tables[prefix], prefix, name)
                             for prefix, name in IP_DROP_COUNTERS)
    return out


def _proc_counter(text: str, prefix: str, name: str) -> int:
    """One counter of a /proc/net/{snmp,netstat} table (a header line, then values)."""
    lines = [line.split() for line in text.splitlines() if line.startswith(prefix)]
    if len(lines) < 2:
        return 0
    values = dict(zip(lines[0][1:], lines[1][1:], strict=False))
    return int(values.get(name, 0))


# --- egress rate and port program parameters ---------------------------------------------

def set_port_rate(plan: Plan, node_name: str, ifname: str, egress: EgressPlan,
                  gates: bool) -> int:
    """The port's HTB root class and class rates as `egress` says (and, with `gates`, the
    TBF gates of its PFC classes: no agent owns them). Returns the requests sent."""
    node = plan.node(node_name)
    with _route_socket(node) as sock, TcTemplates() as templates:
        idx = _ifindex(sock, node, ifname)
        batch = NetlinkBatch(sock, node.name)
        tc = BatchedTc(batch, templates, ifname)
        common = {"burst": egress.burst_bytes, "cburst": egress.burst_bytes,
                  "overhead": egress.overhead_bytes, "quantum": egress.quantum_bytes}
        tc.tc("change-class", "htb", idx, HTB_PORT_CLASS, parent=HTB_ROOT,
              rate=egress.wall_rate_bps // 8, ceil=egress.wall_rate_bps // 8, **common)
        requests = 1
        for cls in egress.classes:
            tc.tc("change-class", "htb", idx, parse_handle(cls.classid), parent=HTB_PORT_CLASS,
                  rate=cls.wall_rate_bps // 8, ceil=cls.wall_ceil_bps // 8, prio=cls.prio,
                  **common)
            requests += 1
            if gates and cls.leaf_kind == "tbf":
                tc.tc("change", "tbf", idx, parse_handle(cls.leaf_handle),
                      parent=parse_handle(cls.classid), **tbf_gate(egress, cls.limit_bytes))
                requests += 1
        batch.flush()
    return requests


def has_port_program(plan: Plan, node_name: str, ifname: str) -> bool:
    """Whether the port has its program attached (a BPF datapath)."""
    return (portprog.pin_dir_of(plan.lab, node_name, ifname) / "progs" / "port_egress").exists()


def set_port_params(plan: Plan, node_name: str, ifname: str, egress: EgressPlan,
                    loss_probability: float) -> None:
    """Rewrite the port program's parameters from `egress` (ECN curves, limits) and the
    port's total drop probability; its queues and counters stay."""
    node = plan.node(node_name)
    slot = next(k for k, i in enumerate(node.interfaces, start=1) if i.ifname == ifname)
    pin_dir = portprog.pin_dir_of(plan.lab, node.name, ifname)
    if not pin_dir.exists():
        raise EventError(f"{node.name}:{ifname}: no port program attached (no BPF datapath)")
    portprog.update_params(pin_dir, portprog.params_from_egress(egress, loss_probability,
                                                                port_slot=slot))
