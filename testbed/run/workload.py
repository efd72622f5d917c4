"""Expand a config's `workload:` into the agents a run starts. Pure.

UDP entries (`python -m agents.udp`) become one receiver per destination host
and one sender per (source, destination) stream; receivers of entry k listen
on BASE_PORT + k, so entries never share a socket.

RoCE entries (`python -m agents.roce`) become one server on the destination
and one client on the source per stream, because a perftest-style server
serves exactly one client. The streams into one host are numbered n = 0, 1,
... over all RoCE entries in config order; server n of a host listens for
set-up on TCP ROCE_SETUP_PORT + n (18515, perftest's, for the first) and takes
RDMA traffic on UDP ROCE_UDP_PORT + n (4791, RoCEv2's, for the first). The
clients' QPs send from rxe-style source ports 0xC000 | hash(QPN). Below
BASE_PORT, so RoCE and UDP agents never collide.

A RoCE entry's in-flight window (`window: auto`, the default) is computed from
the plan by `roce_window_packets`; docs/roce.md, "In-flight window", gives the
formula and a worked example.

argv is in fabric units (agents convert with the dilation they are given).
"""

from __future__ import annotations

import ipaddress
import itertools
import json
from dataclasses import dataclass
from fractions import Fraction

from testbed.config.models import (
    MAX_ROCE_WINDOW_PACKETS,
    Fabric,
    RoceTraffic,
    TrafficClass,
    UdpTraffic,
)
from testbed.plan.model import InterfacePlan, Plan

BASE_PORT = 20000
ROCE_SETUP_PORT = 18515     # TCP, perftest's default port
ROCE_UDP_PORT = 4791        # RoCEv2
ROCE_MAX_STREAMS_PER_HOST = BASE_PORT - ROCE_SETUP_PORT
# The auto window is never below rxe's RXE_MAX_UNACKED_PSNS (what the transport had
# before the window was sized to the fabric) and never above what the transport allows.
ROCE_MIN_WINDOW_PACKETS = 128
ROCE_MAX_WINDOW_PACKETS = MAX_ROCE_WINDOW_PACKETS      # 2^22
# Bytes of message slots per QP (at least one message): what a server verifies.
ROCE_BUFFER_BYTES = 8 << 20
# Wall seconds either side may wait for the other during set-up and tear-down.
ROCE_CONNECT_TIMEOUT_S = 30
# The agents' event loops sleep until each event instead of busy-polling the last
# 150 us: a run has a dozen or more agents on a few cores, where spinning clients
# starve the PFC agents (drops in the lossless class were seen), and at run
# dilations select's wake-up error is a few fabric ns.
ROCE_SPIN_NS = 0
WIRE_OVERHEAD_BYTES = 66     # UDP 8 + IPv4 20 + Ethernet 14 + FCS/preamble/IFG 24
# Default sample period in wall time: what a person watching progress expects,
# and cheap for the collector (well under 1 ms per sample on the default fabric).
DEFAULT_SAMPLE_PERIOD_WALL_NS = 100_000_000
DEFAULT_DRAIN_WALL_NS = 1_000_000_000


@dataclass(frozen=True)
class AgentSpec:
    name: str            # unique in the run, e.g. "incast-h1-h8"
    node: str
    role: str            # "sender" or "receiver"
    traffic: str         # traffic entry name
    kind: str
    argv: list[str]      # after `python -m agents.udp`
    start_ns: int = 0    # fabric time after t0 at which a sender starts
    duration_ns: int = 0
    src: str = ""
    dst: str = ""
    module: str = "agents.udp"   # python -m MODULE argv


def streams(traffic: UdpTraffic | RoceTraffic, hosts: list[str]) -> list[tuple[str, str]]:
    if traffic.kind.endswith("_incast"):
        return [(s, traffic.receiver) for s in traffic.senders or []]
    if traffic.kind.endswith("_all_to_all"):
        return list(itertools.permutations(traffic.hosts or hosts, 2))
    return [tuple(p) for p in traffic.pairs or []]


def _traffic_class(fabric: Fabric, tclass: str | int) -> TrafficClass:
    for t in fabric.traffic_classes:
        if tclass in (t.name, t.tc):
            return t
    raise KeyError(f"unknown traffic class {tclass!r}")


def dscp_of(fabric: Fabric, tclass: str | int) -> int:
    t = _traffic_class(fabric, tclass)
    return t.dscp[0] if t.dscp else 0


def tc_of(fabric: Fabric, tclass: str | int) -> int:
    return _traffic_class(fabric, tclass).tc


def address_of(plan: Plan, host: str) -> str:
    return plan.node(host).interfaces[0].address.split("/")[0]


def expand_workload(fabric: Fabric, plan: Plan) -> list[AgentSpec]:
    if fabric.workload is None:
        return []
    d = str(plan.dilation.factor)
    hosts = [h.name for h in plan.hosts()]
    specs: list[AgentSpec] = []
    roce_streams: dict[str, int] = {}      # destination host -> RoCE streams into it so far
    round_trips: dict[int, Fraction] = {}  # traffic class -> roce_round_trip_ns
    for k, t in enumerate(fabric.workload.traffic):
        if isinstance(t, RoceTraffic):
            specs += _roce_specs(fabric, plan, t, streams(t, hosts), roce_streams, round_trips)
            continue
        port = BASE_PORT + k
        pairs = streams(t, hosts)
        size = t.size_bytes or plan.mtu_bytes - 28
        for dst in sorted({dst for _, dst in pairs}, key=hosts.index):
            specs.append(AgentSpec(
                name=f"{t.name}-recv-{dst}", node=dst, role="receiver", traffic=t.name,
                kind=t.kind, argv=["recv", "--port", str(port), "--dilation", d], dst=dst))
        fanout: dict[str, int] = {}
        for src, _ in pairs:
            fanout[src] = fanout.get(src, 0) + 1
        for src, dst in pairs:
            line_bps = plan.node(src).interfaces[0].egress.rate_bps
            rate = t.rate_bps or line_bps // fanout[src]
            specs.append(AgentSpec(
                name=f"{t.name}-{src}-{dst}", node=src, role="sender", traffic=t.name,
                kind=t.kind, start_ns=t.start_ns, duration_ns=t.duration_ns, src=src, dst=dst,
                argv=["send", "--dst", address_of(plan, dst), "--dport", str(port),
                      "--rate-bps", str(rate), "--size", str(size),
                      "--duration-ns", str(t.duration_ns), "--dscp",
                      str(dscp_of(fabric, t.tclass)), "--ecn", t.ecn, "--flows", str(t.flows),
                      "--dilation", d]))
    return specs


def cnp_dscp_of(fabric: Fabric) -> int | None:
    """DSCP of the class named `cnp` (strict priority for CNPs), if the fabric has one."""
    for t in fabric.traffic_classes:
        if t.name == "cnp" and t.dscp:
            return t.dscp[0]
    return None


def roce_ports(n: int) -> tuple[int, int]:
    """(TCP set-up port, UDP RoCE port) of the n-th RoCE server on a host."""
    if not 0 <= n < ROCE_MAX_STREAMS_PER_HOST:
        raise ValueError(f"RoCE stream {n} into one host: at most {ROCE_MAX_STREAMS_PER_HOST}")
    return ROCE_SETUP_PORT + n, ROCE_UDP_PORT + n


class _Routes:
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


def _longest_to(plan: Plan, routes: _Routes, dst: str, address: str, node: str, tc: int,
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


def roce_round_trip_ns(plan: Plan, tc: int) -> Fraction:
    """The longest round trip class `tc` can see between two hosts: over every host pair
    and every ECMP path between them (`egress_paths`), the base RTT (each link's delay,
    there and back) plus the time to drain every egress port's buffer of the class on the
    way. One pass per destination with each node's longest remaining time memoised, so
    the cost grows with hosts x nodes, not with the number of paths (the unit tests
    check it against every path enumerated)."""
    hosts = [h.name for h in plan.hosts()]
    routes = _Routes(plan)
    port_ns: dict[tuple[str, str], Fraction] = {}
    worst = Fraction(0)
    for dst in hosts:
        address = address_of(plan, dst)
        memo: dict[str, Fraction | None] = {}
        for src in hosts:
            if src != dst:
                found = _longest_to(plan, routes, dst, address, src, tc, memo, port_ns)
                worst = max(worst, found or Fraction(0))
    return worst


def roce_window_packets(line_rate_bps: int, round_trip_ns: Fraction, mtu_bytes: int) -> int:
    """The default in-flight window: RoCE MTU packets that a sender at `line_rate_bps` puts
    on the wire in `round_trip_ns` (roce_round_trip_ns), rounded up, within
    [ROCE_MIN_WINDOW_PACKETS, ROCE_MAX_WINDOW_PACKETS]."""
    bits = line_rate_bps * round_trip_ns / 10**9
    packets = -(-bits // (8 * mtu_bytes))
    return int(min(ROCE_MAX_WINDOW_PACKETS, max(ROCE_MIN_WINDOW_PACKETS, packets)))


def _roce_specs(fabric: Fabric, plan: Plan, t: RoceTraffic, pairs: list[tuple[str, str]],
                per_host: dict[str, int], round_trips: dict[int, Fraction]) -> list[AgentSpec]:
    """A server (receiver) and a client (sender) per stream; servers come first."""
    d = str(plan.dilation.factor)
    dscp = str(dscp_of(fabric, t.tclass))
    cnp = cnp_dscp_of(fabric)
    cc = ["--cc", t.cc] + (["--cc-preset", t.preset] if t.preset else [])
    overrides = t.cc_overrides()       # DcqcnParams / DctcpParams names, absolute values
    if overrides:
        cc += ["--cc-params", json.dumps(overrides, sort_keys=True, separators=(",", ":"))]
    common = ["--mtu", str(fabric.roce_mtu_bytes), "--dscp", dscp, *cc,
              *(["--cnp-dscp", str(cnp)] if cnp is not None else []),
              "--dilation", d, "--connect-timeout-s", str(ROCE_CONNECT_TIMEOUT_S),
              "--spin-ns", str(ROCE_SPIN_NS)]
    verify = ["--verify"] if t.verify else []
    cnp_interval = ([] if t.cnp_interval_ns is None or t.cc == "none"
                    else ["--cnp-interval-ns", str(t.cnp_interval_ns)])
    buffer_bytes = max(t.size_bytes, ROCE_BUFFER_BYTES)
    mtu = fabric.roce_mtu_bytes
    per_message = -(-t.size_bytes // mtu)             # packets of one message
    rtt_ns = None
    if t.window_packets == "auto":
        tc = tc_of(fabric, t.tclass)
        if tc not in round_trips:
            round_trips[tc] = roce_round_trip_ns(plan, tc)
        rtt_ns = round_trips[tc]
    servers: list[AgentSpec] = []
    clients: list[AgentSpec] = []
    for j, (src, dst) in enumerate(pairs):
        line_bps = plan.node(src).interfaces[0].egress.rate_bps
        window = (t.window_packets if rtt_ns is None
                  else roce_window_packets(line_bps, rtt_ns, mtu))
        # Messages a client keeps posted per QP: a full window and one message more, so
        # the window, not the posting, bounds what is in flight and the pipe never empties
        # between messages; no more, so the tail after `duration` stays short.
        depth = max(2, -(-window // per_message) + 1)
        n = per_host.get(dst, 0)
        per_host[dst] = n + 1
        tcp_port, udp_port = roce_ports(n)
        name = f"{t.name}-{src}-{dst}"
        servers.append(AgentSpec(
            name=f"{name}-srv", node=dst, role="receiver", traffic=t.name, kind=t.kind,
            src=src, dst=dst, module="agents.roce",
            argv=["server", t.test, "--bind", address_of(plan, dst), "--port", str(tcp_port),
                  "--roce-port", str(udp_port), *verify, *cnp_interval, "--line-rate-bps",
                  str(plan.node(dst).interfaces[0].egress.rate_bps),
                  "--window-packets", str(window), *common]))
        stop = (["--iters", str(t.messages)] if t.messages is not None
                else ["--duration-ns", str(t.duration_ns)])
        clients.append(AgentSpec(
            name=name, node=src, role="sender", traffic=t.name, kind=t.kind,
            start_ns=t.start_ns, duration_ns=t.duration_ns or 0, src=src, dst=dst,
            module="agents.roce",
            argv=["client", t.test, "--server", address_of(plan, dst), "--port", str(tcp_port),
                  "--bind", address_of(plan, src), "--size", str(t.size_bytes),
                  "--qps", str(t.qps), *stop,
                  "--tx-depth", str(depth), "--buffer-bytes", str(buffer_bytes),
                  "--seed", str(1 + 16 * j), *verify, "--line-rate-bps", str(line_bps),
                  "--window-packets", str(window), *common]))
    return servers + clients


def workload_span_ns(fabric: Fabric, plan: Plan | None = None) -> int:
    """Fabric time from t0 until the last sender is scheduled to stop. An entry that
    posts a number of messages has no schedule: it counts from its start for as long as
    its busiest host takes to move its bytes at line rate (with a plan; 0 without)."""
    if fabric.workload is None:
        return 0
    hosts = [h.name for h in plan.hosts()] if plan is not None else []
    ends = []
    for t in fabric.workload.traffic:
        if t.duration_ns is not None:
            ends.append(t.start_ns + t.duration_ns)
        else:
            ends.append(t.start_ns + (_line_rate_time_ns(plan, t, streams(t, hosts))
                                      if plan is not None else 0))
    return max(ends, default=0)


def _line_rate_time_ns(plan: Plan, t: RoceTraffic, pairs: list[tuple[str, str]]) -> int:
    """Fabric time the busiest host of a `messages` entry needs at its NIC's line rate."""
    mtu = plan.roce_mtu_bytes
    per_message = t.size_bytes + 16 + -(-t.size_bytes // mtu) * (12 + 4 + WIRE_OVERHEAD_BYTES)
    wire_bytes = per_message * t.messages * t.qps      # RETH 16, BTH 12, ICRC 4, headers
    load: dict[str, int] = {}
    for src, dst in pairs:
        load[src] = load.get(src, 0) + wire_bytes
        load[dst] = load.get(dst, 0) + wire_bytes
    return max((-(-n * 8 * 10**9 // plan.node(h).interfaces[0].egress.rate_bps)
                for h, n in load.items()), default=0)
