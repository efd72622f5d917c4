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

argv is in fabric units (agents convert with the dilation they are given).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

from testbed.config.models import Fabric, RoceTraffic, UdpTraffic
from testbed.plan.model import Plan

BASE_PORT = 20000
ROCE_SETUP_PORT = 18515     # TCP, perftest's default port
ROCE_UDP_PORT = 4791        # RoCEv2
ROCE_MAX_STREAMS_PER_HOST = BASE_PORT - ROCE_SETUP_PORT
# A client keeps about this many message bytes posted per QP (at least two
# messages): more than the window (128 x 4 KB) so the pipe never empties between
# messages, little enough that the tail after `duration` is short.
ROCE_POSTED_BYTES = 1 << 20
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


def dscp_of(fabric: Fabric, tclass: str | int) -> int:
    for t in fabric.traffic_classes:
        if tclass in (t.name, t.tc):
            return t.dscp[0] if t.dscp else 0
    raise KeyError(f"unknown traffic class {tclass!r}")


def address_of(plan: Plan, host: str) -> str:
    return plan.node(host).interfaces[0].address.split("/")[0]


def expand_workload(fabric: Fabric, plan: Plan) -> list[AgentSpec]:
    if fabric.workload is None:
        return []
    d = str(plan.dilation.factor)
    hosts = [h.name for h in plan.hosts()]
    specs: list[AgentSpec] = []
    roce_streams: dict[str, int] = {}      # destination host -> RoCE streams into it so far
    for k, t in enumerate(fabric.workload.traffic):
        if isinstance(t, RoceTraffic):
            specs += _roce_specs(fabric, plan, t, streams(t, hosts), roce_streams)
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


def _roce_specs(fabric: Fabric, plan: Plan, t: RoceTraffic, pairs: list[tuple[str, str]],
                per_host: dict[str, int]) -> list[AgentSpec]:
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
    depth = min(128, max(2, -(-ROCE_POSTED_BYTES // t.size_bytes)))
    servers: list[AgentSpec] = []
    clients: list[AgentSpec] = []
    for j, (src, dst) in enumerate(pairs):
        n = per_host.get(dst, 0)
        per_host[dst] = n + 1
        tcp_port, udp_port = roce_ports(n)
        name = f"{t.name}-{src}-{dst}"
        servers.append(AgentSpec(
            name=f"{name}-srv", node=dst, role="receiver", traffic=t.name, kind=t.kind,
            src=src, dst=dst, module="agents.roce",
            argv=["server", t.test, "--bind", address_of(plan, dst), "--port", str(tcp_port),
                  "--roce-port", str(udp_port), *verify, *cnp_interval, "--line-rate-bps",
                  str(plan.node(dst).interfaces[0].egress.rate_bps), *common]))
        clients.append(AgentSpec(
            name=name, node=src, role="sender", traffic=t.name, kind=t.kind,
            start_ns=t.start_ns, duration_ns=t.duration_ns, src=src, dst=dst,
            module="agents.roce",
            argv=["client", t.test, "--server", address_of(plan, dst), "--port", str(tcp_port),
                  "--bind", address_of(plan, src), "--size", str(t.size_bytes),
                  "--qps", str(t.qps), "--duration-ns", str(t.duration_ns),
                  "--tx-depth", str(depth), "--buffer-bytes", str(buffer_bytes),
                  "--seed", str(1 + 16 * j), *verify, "--line-rate-bps",
                  str(plan.node(src).interfaces[0].egress.rate_bps), *common]))
    return servers + clients


def workload_span_ns(fabric: Fabric) -> int:
    """Fabric time from t0 until the last sender is scheduled to stop."""
    if fabric.workload is None:
        return 0
    return max((t.start_ns + t.duration_ns for t in fabric.workload.traffic), default=0)
