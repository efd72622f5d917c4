"""Apply a plan to the kernel, and take a lab down again.

Order: record state (every namespace the lab will own), create namespaces,
set their sysctls, create veth pairs straight into their namespaces (the
initial namespace never sees them), addresses and MACs, queues, links up,
routes. Any failure tears down what was made and re-raises.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from testbed.net import namespaces
from testbed.net.qdisc import install_port_queues
from testbed.net.state import LabState, list_states, process_start_time
from testbed.plan.model import Plan


class BuildError(RuntimeError):
    """Bringing a lab up failed; the message says which step and what the kernel said."""


@dataclass
class BuildReport:
    lab: str
    already_up: bool = False
    namespaces: int = 0
    veth_pairs: int = 0
    tc_requests: int = 0
    routes: int = 0
    seconds: dict[str, float] = field(default_factory=dict)


def plan_digest(plan: Plan) -> str:
    return hashlib.sha256(plan.to_json().encode()).hexdigest()[:16]


class _Timer:
    def __init__(self, report: BuildReport) -> None:
        self.report = report
        self.t = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.report.seconds[name] = round(now - self.t, 4)
        self.t = now


def apply_plan(plan: Plan, progress: Callable[[str], None] | None = None) -> BuildReport:
    """Build the lab described by `plan`. Idempotent: an identical lab already up is left as is."""
    say = progress or (lambda _msg: None)
    report = BuildReport(lab=plan.lab)
    digest = plan_digest(plan)
    existing = LabState.load(plan.lab)
    if existing is not None:
        if (existing.status == "up" and existing.plan_digest == digest
                and all(namespaces.exists(ns) for ns in existing.netns)):
            report.already_up = True
            return report
        if existing.status == "up" and existing.plan_digest != digest:
            raise BuildError(f"lab {plan.lab!r} is up with a different plan; "
                             f"run `testbed down {plan.lab}` first")
        say(f"lab {plan.lab!r} was left half-built ({existing.status}); removing it first")
        destroy_lab(plan.lab)
    clashes = [n.netns for n in plan.nodes if namespaces.exists(n.netns)]
    if clashes:
        raise BuildError(f"namespaces {clashes[:3]} exist but no lab state owns them; "
                         "run `testbed down --all` to clear leftovers")

    state = LabState(lab=plan.lab, netns=[n.netns for n in plan.nodes], status="building",
                     plan_digest=digest, builder_pid=os.getpid())
    state.save()
    state.plan_path.write_text(plan.to_json())
    os.chmod(state.plan_path, 0o600)
    try:
        _build(plan, report, say)
    except BaseException as exc:
        say(f"build failed ({exc}); removing what was made")
        state.status = "failed"
        state.save()
        destroy_lab(plan.lab)
        if isinstance(exc, NetlinkError):
            raise BuildError(f"kernel refused a request while building {plan.lab!r}: "
                             f"{exc}") from exc
        raise
    state.status = "up"
    state.save()
    return report


def _build(plan: Plan, report: BuildReport, say: Callable[[str], None]) -> None:
    timer = _Timer(report)
    say(f"creating {len(plan.nodes)} namespaces")
    for node in plan.nodes:
        namespaces.create(node.netns)
        namespaces.write_sysctls(node.netns, node.sysctls)
    report.namespaces = len(plan.nodes)
    timer.lap("namespaces")

    iprs: dict[str, IPRoute] = {}
    try:
        for node in plan.nodes:
            iprs[node.name] = IPRoute(netns=node.netns)
        timer.lap("netlink sockets")
        by_name = {n.name: n for n in plan.nodes}
        say(f"creating {len(plan.links)} veth pairs")
        for link in plan.links:
            a_node, b_node = by_name[link.a.node], by_name[link.b.node]
            iprs[a_node.name].link("add", ifname=link.a.ifname, kind="veth",
                                   peer={"ifname": link.b.ifname, "net_ns_fd": b_node.netns})
        report.veth_pairs = len(plan.links)
        timer.lap("veth")

        say("addresses, queues and links up")
        for node in plan.nodes:
            ipr = iprs[node.name]
            lo = ipr.link_lookup(ifname="lo")[0]
            ipr.link("set", index=lo, state="up")
            for iface in node.interfaces:
                idx = ipr.link_lookup(ifname=iface.ifname)[0]
                ipr.link("set", index=idx, address=iface.mac, mtu=iface.mtu_bytes)
                addr, prefixlen = iface.address.split("/")
                ipr.addr("add", index=idx, address=addr, prefixlen=int(prefixlen))
                report.tc_requests += install_port_queues(ipr, idx, iface.egress)
                ipr.link("set", index=idx, state="up")
        timer.lap("addresses+queues")

        say("routes")
        for node in plan.nodes:
            ipr = iprs[node.name]
            index_of = {i.ifname: ipr.link_lookup(ifname=i.ifname)[0] for i in node.interfaces}
            for route in node.routes:
                if len(route.nexthops) == 1:
                    hop = route.nexthops[0]
                    ipr.route("add", dst=route.dst, gateway=hop.gateway, oif=index_of[hop.ifname])
                else:
                    ipr.route("add", dst=route.dst, multipath=[
                        {"gateway": hop.gateway, "oif": index_of[hop.ifname]}
                        for hop in route.nexthops])
                report.routes += 1
        timer.lap("routes")
    finally:
        for ipr in iprs.values():
            ipr.close()


def _stop_processes(state: LabState) -> None:
    inodes = {namespaces.inode(ns) for ns in state.netns} - {None}
    for proc in state.processes:
        # Only a pid that is still the process we started, in one of our namespaces.
        if (process_start_time(proc.pid) == proc.start_time
                and namespaces.pid_netns_inode(proc.pid) in inodes):
            try:
                os.kill(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 3
    for proc in state.processes:
        while (process_start_time(proc.pid) == proc.start_time
               and time.monotonic() < deadline):
            time.sleep(0.02)
        if process_start_time(proc.pid) == proc.start_time:
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def destroy_lab(lab: str) -> list[str]:
    """Remove every namespace (and process) the lab's state lists; returns what was removed."""
    state = LabState.load(lab)
    if state is None:
        return []
    state.status = "destroying"
    state.save()
    _stop_processes(state)
    removed = []
    for ns in state.netns:
        if namespaces.exists(ns):
            namespaces.remove(ns)   # its veth ends go with it, and so do their peers
            removed.append(ns)
    state.remove()
    return removed


def load_lab_plan(lab: str) -> Plan | None:
    """The plan a lab was built from, as recorded at `up`."""
    state = LabState.load(lab)
    if state is None or not state.plan_path.exists():
        return None
    return Plan.model_validate_json(state.plan_path.read_text())


def destroy_all() -> tuple[list[str], list[str]]:
    """Tear down every recorded lab, then any namespace left with the testbed prefix.

    Returns (labs torn down, orphan namespaces removed).
    """
    labs = []
    for state in list_states():
        destroy_lab(state.lab)
        labs.append(state.lab)
    orphans = []
    for ns in namespaces.list_testbed_namespaces():
        namespaces.remove(ns)
        orphans.append(ns)
    return labs, orphans
