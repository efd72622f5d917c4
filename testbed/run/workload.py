"""Expand a config's `workload:` into the agents a run starts. Pure.

Each traffic entry becomes one receiver per destination host and one sender
per (source, destination) stream; argv is in fabric units (agents convert
with the dilation they are given). Receivers of entry k listen on
BASE_PORT + k, so entries never share a socket.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from testbed.config.models import Fabric, UdpTraffic
from testbed.plan.model import Plan

BASE_PORT = 20000
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


def streams(traffic: UdpTraffic, hosts: list[str]) -> list[tuple[str, str]]:
    if traffic.kind == "udp_incast":
        return [(s, traffic.receiver) for s in traffic.senders or []]
    if traffic.kind == "udp_all_to_all":
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
    for k, t in enumerate(fabric.workload.traffic):
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


def workload_span_ns(fabric: Fabric) -> int:
    """Fabric time from t0 until the last sender is scheduled to stop."""
    if fabric.workload is None:
        return 0
    return max((t.start_ns + t.duration_ns for t in fabric.workload.traffic), default=0)
