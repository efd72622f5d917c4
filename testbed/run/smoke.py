"""Checks that a built fabric forwards: reachability, line rate, ECMP spread.

`testbed smoke` runs them and prints what it saw; the integration tests call
the same functions and assert on what they return. Durations are chosen in
wall seconds (what a person waits) and handed to agents in fabric units.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from agents.timebase import wall_timeout_s
from testbed.net.counters import read_counters
from testbed.plan.model import Plan
from testbed.plan.paths import host_address
from testbed.run.procs import AgentProcess, forget_exited, start_agent

ECHO_PORT = 7000
STREAM_PORT = 5001

def _ready(path: str, timeout_s: float = 10.0) -> None:
    import os

    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise RuntimeError(f"agent did not become ready ({path})")
        time.sleep(0.01)


def reachability(plan: Plan, tmpdir: str, count: int = 2,
                 timeout_wall_s: float = 1.0) -> dict[tuple[str, str], dict]:
    """UDP echo between every ordered pair of hosts; result per (src, dst)."""
    d = plan.timebase
    hosts = [h.name for h in plan.hosts()]
    echoes: list[AgentProcess] = []
    results: dict[tuple[str, str], dict] = {}
    try:
        for h in hosts:
            ready = f"{tmpdir}/echo-{h}.ready"
            echoes.append(start_agent(plan.lab, plan.node(h).netns, "agents.udp",
                                      ["echo", "--port", str(ECHO_PORT), "--ready-file", ready,
                                       "--dilation", str(d.factor)], f"echo-{h}"))
        for h in hosts:
            _ready(f"{tmpdir}/echo-{h}.ready")
        # One batch of pings per destination offset, so at most len(hosts) run at once.
        for offset in range(1, len(hosts)):
            batch = []
            for i, src in enumerate(hosts):
                dst = hosts[(i + offset) % len(hosts)]
                timeout_ns = round(d.to_fabric_ns_from_wall_s(timeout_wall_s))
                batch.append(((src, dst), start_agent(
                    plan.lab, plan.node(src).netns, "agents.udp",
                    ["ping", "--dst", host_address(plan, dst), "--dport", str(ECHO_PORT),
                     "--count", str(count), "--timeout-ns", str(timeout_ns),
                     "--dilation", str(d.factor)], f"ping-{src}-{dst}")))
            for pair, proc in batch:
                results[pair] = proc.result(timeout_s=timeout_wall_s * count + 10)
    finally:
        for echo in echoes:
            echo.stop()
        forget_exited(plan.lab)
    return results


@dataclass
class StreamResult:
    src: str
    dst: str
    expected_wall_bps: int
    expected_fabric_bps: int
    sender: dict
    receiver: dict

    @property
    def ratio(self) -> float:
        return self.receiver.get("wall_bps", 0) / self.expected_wall_bps


def stream(plan: Plan, src: str, dst: str, tmpdir: str, wall_seconds: float = 3.0,
           overdrive: float = 1.1, flows: int = 1, payload_bytes: int | None = None,
           dscp: int = 0) -> StreamResult:
    """Send at `overdrive` x the source NIC's line rate; measure what arrives."""
    d = plan.timebase
    nic = plan.node(src).interfaces[0]
    line_bps = nic.egress.rate_bps
    size = payload_bytes or plan.mtu_bytes - 28
    duration_ns = round(d.to_fabric_ns_from_wall_s(wall_seconds))
    ready = f"{tmpdir}/recv-{dst}.ready"
    receiver = start_agent(plan.lab, plan.node(dst).netns, "agents.udp",
                           ["recv", "--port", str(STREAM_PORT), "--ready-file", ready,
                            "--idle-exit-ns", str(round(d.to_fabric_ns_from_wall_s(1.0))),
                            "--dilation", str(d.factor)], f"recv-{dst}")
    try:
        _ready(ready)
        sender = start_agent(plan.lab, plan.node(src).netns, "agents.udp",
                             ["send", "--dst", host_address(plan, dst),
                              "--dport", str(STREAM_PORT), "--sport", "40000",
                              "--flows", str(flows),
                              "--rate-bps", str(round(line_bps * overdrive)),
                              "--size", str(size), "--duration-ns", str(duration_ns),
                              "--dscp", str(dscp), "--dilation", str(d.factor)],
                             f"send-{src}")
        sent = sender.result(timeout_s=wall_seconds * 3 + 10)
        received = receiver.result(timeout_s=wall_timeout_s(15))
    finally:
        receiver.stop()
        forget_exited(plan.lab)
    return StreamResult(src, dst, nic.egress.wall_rate_bps, line_bps, sent, received)


def port_streams(plan: Plan, ports: list[tuple[str, str]], tmpdir: str,
                 wall_seconds: float = 3.0, overdrive: float = 1.1,
                 dscp: int = 0) -> list[StreamResult]:
    """Saturate each port (node, ifname), all at once: a sender in the node's namespace
    at `overdrive` x the port's rate to the address of the port's /31 peer, a receiver
    there (each on a port of its own). What arrives measures the link in that direction
    alone, whatever the hosts' NICs could send (a switch-to-switch link, a link that
    crosses to another VM)."""
    d = plan.timebase
    duration_ns = round(d.to_fabric_ns_from_wall_s(wall_seconds))
    size = plan.mtu_bytes - 28
    receivers, senders, specs = [], [], []
    try:
        for k, (node, ifname) in enumerate(ports):
            iface = next(i for i in plan.node(node).interfaces if i.ifname == ifname)
            peer = iface.peer
            ready = f"{tmpdir}/recv-{node}-{ifname}.ready"
            receivers.append(start_agent(
                plan.lab, plan.node(peer.node).netns, "agents.udp",
                ["recv", "--port", str(STREAM_PORT + k), "--ready-file", ready,
                 "--idle-exit-ns", str(round(d.to_fabric_ns_from_wall_s(1.0))),
                 "--dilation", str(d.factor)], f"recv-{peer.node}-{k}"))
            specs.append((node, peer.node, iface, ready, k))
        for node, _peer, iface, ready, k in specs:
            _ready(ready)
            senders.append(start_agent(
                plan.lab, plan.node(node).netns, "agents.udp",
                ["send", "--dst", iface.peer.address.split("/")[0],
                 "--dport", str(STREAM_PORT + k), "--sport", str(40000 + k),
                 "--rate-bps", str(round(iface.egress.rate_bps * overdrive)),
                 "--size", str(size), "--duration-ns", str(duration_ns),
                 "--dscp", str(dscp), "--dilation", str(d.factor)], f"send-{node}-{k}"))
        sent = [p.result(timeout_s=wall_seconds * 3 + 10) for p in senders]
        received = [p.result(timeout_s=wall_timeout_s(15)) for p in receivers]
    finally:
        for p in receivers + senders:
            p.stop()
        forget_exited(plan.lab)
    return [StreamResult(node, peer, iface.egress.wall_rate_bps, iface.egress.rate_bps,
                         sent[i], received[i])
            for i, (node, peer, iface, _ready_file, _k) in enumerate(specs)]


def link_tx_bytes(plan: Plan) -> dict[tuple[str, str], int]:
    ifaces, _ = read_counters(plan)
    return {(c.node, c.ifname): c.tx_bytes for c in ifaces}


def uplink_spread(plan: Plan, before: dict, after: dict, switch: str) -> dict[str, int]:
    """Bytes each switch-facing port of `switch` sent between two snapshots."""
    node = plan.node(switch)
    roles = {n.name: n.role for n in plan.nodes}
    return {i.ifname: after[(switch, i.ifname)] - before[(switch, i.ifname)]
            for i in node.interfaces if roles[i.peer.node] == "switch"}


def all_pairs(hosts: list[str]) -> list[tuple[str, str]]:
    return list(itertools.permutations(hosts, 2))
