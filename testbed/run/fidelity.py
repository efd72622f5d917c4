"""The fidelity watchdog: did each port deliver its configured rate when it had work?

A port is backlogged over an interval when its class queues held more than
one HTB burst at both ends of the interval (a packet or two can be a sender's
own pacing: a host NIC behind a small socket buffer holds two packets while
its sender waits for ACKs, and is idle in between). Over such an interval an
HTB port that keeps up sends at its wall rate; the watchdog measures the wire
bytes it sent (link tx bytes plus the per-packet overhead HTB charges) and
reports ports whose delivered rate fell below `MIN_RATIO` of the plan. Agents'
late timers and missing kernel features are added by the runner.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from agents.timebase import Dilation
from testbed.plan.model import Plan
from testbed.results.store import Sample

MIN_RATIO = 0.95
MIN_INTERVALS = 3      # fewer backlogged intervals say too little to judge


@dataclass
class PortRecord:
    node: str
    port: str
    wall_rate_bps: int
    overhead_bytes: int
    burst_bytes: int = 0
    # Once a PFC agent has reported the port's paused time, the port is judged only where
    # it did: a sample the agent did not answer (or after it stopped) says nothing about
    # a port that may have been paused all along (a deadlocked cycle is not a slow VM).
    paused_seen: bool = False
    intervals: int = 0
    bits: float = 0.0
    seconds: float = 0.0
    worst_ratio: float = 1.0
    prev: tuple[int, float, float, float, float | None] | None = None
    # (mono_ns, tx_bytes, tx_packets, backlog, paused fabric ns or None: not reported)
    ratios: list[float] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        if self.seconds <= 0:
            return 1.0
        return self.bits / self.seconds / self.wall_rate_bps


class PortWatchdog:
    def __init__(self, plan: Plan) -> None:
        self.dilation = plan.timebase
        self.ports: dict[tuple[str, str], PortRecord] = {}
        for node in plan.nodes:
            for iface in node.interfaces:
                self.ports[(node.name, iface.ifname)] = PortRecord(
                    node.name, iface.ifname, iface.egress.wall_rate_bps,
                    iface.egress.overhead_bytes, iface.egress.burst_bytes)

    def observe(self, mono_ns: int, samples: list[Sample]) -> None:
        now: dict[tuple[str, str], list] = {}
        for s in samples:
            key = (s.node, s.port)
            if key not in self.ports:
                continue
            entry = now.setdefault(key, [0, 0, 0, None])
            if s.counter == "tx_bytes":
                entry[0] = s.value
            elif s.counter == "tx_packets":
                entry[1] = s.value
            elif s.counter == "backlog_bytes":
                entry[2] += s.value
            elif s.counter == "paused_ns":
                # A paused class is meant to be silent (PFC): its paused time is
                # not time the port failed to send.
                entry[3] = s.value if entry[3] is None else max(entry[3], s.value)
        for key, (tx_bytes, tx_packets, backlog, paused_ns) in now.items():
            rec = self.ports[key]
            rec.paused_seen = rec.paused_seen or paused_ns is not None
            if rec.prev is not None:
                p_mono, p_bytes, p_packets, p_backlog, p_paused = rec.prev
                dt = (mono_ns - p_mono) / 1e9
                if paused_ns is None or p_paused is None:
                    if rec.paused_seen:
                        dt = 0.0   # how long it was paused is unknown: not judged
                else:
                    paused_wall_s = self.dilation.to_wall_s(max(0.0, paused_ns - p_paused))
                    if paused_wall_s > 0.1 * dt:
                        dt = 0.0   # paused for a real part of the interval: not judged
                if min(p_backlog, backlog) > rec.burst_bytes and dt > 0:
                    wire = (tx_bytes - p_bytes) + rec.overhead_bytes * (tx_packets - p_packets)
                    rec.intervals += 1
                    rec.bits += wire * 8
                    rec.seconds += dt
                    ratio = wire * 8 / dt / rec.wall_rate_bps
                    rec.worst_ratio = min(rec.worst_ratio, ratio)
            rec.prev = (mono_ns, tx_bytes, tx_packets, backlog, paused_ns)

    def notes(self, dilation: Dilation) -> list[str]:
        out = []
        for rec in self.ports.values():
            if rec.intervals >= MIN_INTERVALS and rec.ratio < MIN_RATIO:
                got_gbps = dilation.to_fabric_bps(rec.bits / rec.seconds) / 1e9
                out.append(
                    f"port {rec.node}:{rec.port} delivered {100 * rec.ratio:.1f} % of its rate "
                    f"while backlogged ({got_gbps:.2f} of "
                    f"{dilation.to_fabric_bps(rec.wall_rate_bps) / 1e9:g} Gb/s fabric, over "
                    f"{rec.intervals} sample intervals; worst interval "
                    f"{100 * rec.worst_ratio:.0f} %): the machine did not keep up; raise D")
        return out

    def table(self) -> list[dict]:
        return [{"node": r.node, "port": r.port, "backlogged_intervals": r.intervals,
                 "delivered_ratio": round(r.ratio, 4), "worst_ratio": round(r.worst_ratio, 4)}
                for r in self.ports.values() if r.intervals]


def base_rtt_shortfall_ns(plan: Plan) -> int:
    """Round-trip delay the PHY model gives the longest host-to-host shortest path.

    This is what a run without netem leaves out: every link's propagation and
    FEC delay, there and back.
    """
    import heapq

    adj: dict[str, list[tuple[str, int]]] = {}
    for link in plan.links:
        adj.setdefault(link.a.node, []).append((link.b.node, link.delay_ns))
        adj.setdefault(link.b.node, []).append((link.a.node, link.delay_ns))
    roles = {n.name: n.role for n in plan.nodes}
    worst = 0
    for host in (n.name for n in plan.nodes if n.role == "host"):
        dist = {host: 0}
        heap = [(0, host)]
        while heap:
            d, cur = heapq.heappop(heap)
            if d > dist.get(cur, d):
                continue
            # Hosts do not forward: only the source may be a host on the way.
            if cur != host and roles[cur] == "host":
                continue
            for nbr, delay in adj.get(cur, []):
                if d + delay < dist.get(nbr, 1 << 62):
                    dist[nbr] = d + delay
                    heapq.heappush(heap, (d + delay, nbr))
        worst = max([worst] + [v for k, v in dist.items() if roles[k] == "host" and k != host])
    return 2 * worst
