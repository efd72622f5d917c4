"""Apply a plan to the kernel, and take a lab down again.

Order: record state (every namespace the lab will own), then the build in steps,
each over the whole plan:
  1. namespaces: create each one with its sysctls and a netlink socket opened
     inside it (no fork: see namespaces.create_many); the sysctls include the
     RPS map that keeps each flow on one CPU per port (steering.py: without it
     the fabric reorders flows whose packets are handled on two CPUs);
  2. veth: create each pair straight into its two namespaces, both ends with
     their MAC and MTU (the initial namespace never sees them); on kernels without
     a per-namespace RPS default, every port's rps_cpus next ("flow steering");
  3. addresses+queues: per namespace one link dump, then lo up and per port its
     address, its queues (qdisc.install_port_queues, each distinct tc request
     encoded once) and link up;
  4. neighbours: per port a permanent neighbour entry for its /31 peer (the plan
     has both MACs), so no ARP runs on the fabric: a flow's first packets would
     otherwise wait in a neighbour queue while a later one overtakes them, and
     pay an ARP round trip;
  5. routes: /31-reachable next hops and ECMP routes;
  6. port programs: the tc-BPF program on every port (datapath.py);
  7. rxe endpoints: the Soft-RoCE device of every `endpoint: rxe` host on its NIC (rxe.py
     says where, by kernel; a placement this machine refuses stops `apply_plan` before
     anything is made).
Each namespace's requests go out in batches over its own socket, every ack checked
(testbed/net/batch.py says why and what it saved). Any failure tears down what was
made and raises BuildError naming the node, the request and the kernel's reason.
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from testbed.net import datapath, namespaces, portprog, rxe, steering
from testbed.net.batch import (
    LOOPBACK_IFINDEX,
    BatchedTc,
    BatchError,
    NetlinkBatch,
    RequestError,
    TcTemplates,
    address_message,
    dump_link_indexes,
    link_up_message,
    neighbour_message,
    open_route_socket,
    route_message,
    veth_message,
)
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
    datapath: str = ""     # "bpf", or "none: why" (no ECN marking, queue accounting or PFC)
    rxe_mode: str | None = None   # rxe.NETNS_AWARE / rxe.INITIAL_NS; None: no rxe hosts
    ordering: str = ""     # "rps cpus 0-1 (how)", or "none: why" (flows may be reordered)


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


def apply_plan(plan: Plan, progress: Callable[[str], None] | None = None, *,
               keep_order: bool = True) -> BuildReport:
    """Build the lab described by `plan`. Idempotent: an identical lab already up is left as is.

    `keep_order=False` builds without what keeps a flow in order (RPS, steering.py;
    static neighbours, step 4), as the builder did before them, so that
    bench/ordering.py can measure the reordering they prevent; never otherwise.
    """
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
    try:
        report.rxe_mode = rxe.placement_mode(plan)
    except rxe.RxeRefused as exc:
        raise BuildError(str(exc)) from None
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
        _build(plan, report, say, keep_order)
        if report.rxe_mode is not None:
            say("rxe endpoints")
            t = time.perf_counter()
            rxe.build(plan, report.rxe_mode, say)
            report.seconds["rxe"] = round(time.perf_counter() - t, 4)
    except BaseException as exc:
        say(f"build failed ({exc}); removing what was made")
        state.status = "failed"
        state.save()
        destroy_lab(plan.lab)
        if isinstance(exc, RequestError):
            raise BuildError(f"kernel refused a request while building {plan.lab!r}: "
                             f"{exc}") from exc
        if isinstance(exc, BatchError | rxe.RxeError):
            raise BuildError(f"building {plan.lab!r}: {exc}") from exc
        raise
    state.status = "up"
    state.save()
    return report


def _build(plan: Plan, report: BuildReport, say: Callable[[str], None],
           keep_order: bool) -> None:
    timer = _Timer(report)
    steer = steering.choose(keep_order)
    report.ordering = steer.describe()
    say(f"creating {len(plan.nodes)} namespaces")
    sockets = _create_namespaces(plan, steer.namespace_sysctls())
    report.namespaces = len(plan.nodes)
    timer.lap("namespaces")
    try:
        batches = {n.name: NetlinkBatch(sockets[n.name], n.name) for n in plan.nodes}

        say(f"creating {len(plan.links)} veth pairs")
        _create_veth_pairs(plan, batches)
        report.veth_pairs = len(plan.links)
        timer.lap("veth")

        if steer.method == steering.RPS_CPUS:
            say("flow steering (rps_cpus of every port)")
            _steer_ports(plan, steer)
            timer.lap("flow steering")

        say("addresses, queues and links up")
        ifindex = {n.name: dump_link_indexes(sockets[n.name], n.name) for n in plan.nodes}
        report.tc_requests = _configure_ports(plan, batches, ifindex)
        timer.lap("addresses+queues")

        if keep_order:
            say("neighbours")
            _add_neighbours(plan, batches, ifindex)
            timer.lap("neighbours")

        say("routes")
        report.routes = _add_routes(plan, batches, ifindex)
        timer.lap("routes")

        say("port programs (queue accounting, ECN marking, PHY loss, PFC decisions)")
        report.datapath = _attach_datapath(plan, ifindex)
        timer.lap("port programs")
    finally:
        for sock in sockets.values():
            sock.close()


def _attach_datapath(plan: Plan, ifindex: dict[str, dict[str, int]]) -> str:
    """Step 6: the tc-BPF port program on every port, where this machine can load it.

    Without clang or bpftool the fabric still forwards and shapes, but has
    no ECN marking, queue accounting or PFC; the report says so.
    """
    try:
        portprog.ensure_object()
    except portprog.PortProgError as exc:
        return f"none: {exc}"
    datapath.attach_port_programs(plan, apply_phy_loss=True, ifindex=ifindex)
    return "bpf"


def _create_namespaces(plan: Plan, extra_sysctls: dict[str, str]) -> dict[str, socket.socket]:
    """Step 1: every node's namespace with its sysctls (the plan's, then `extra_sysctls`,
    the same on every node); a netlink socket in each, by node."""
    node_of = {n.netns: n.name for n in plan.nodes}
    try:
        sockets = namespaces.create_many([(n.netns, {**n.sysctls, **extra_sysctls})
                                          for n in plan.nodes],
                                         open_socket=open_route_socket)
    except namespaces.NamespaceError as exc:
        raise BuildError(f"building {plan.lab!r}: node {node_of[exc.name]}: {exc}") from exc
    return {node_of[ns]: sock for ns, sock in sockets.items()}


def _create_veth_pairs(plan: Plan, batches: dict[str, NetlinkBatch]) -> None:
    """Step 2: each link's veth pair, from the `a` node's namespace, the peer put in
    the `b` node's. Sent in plan order, so interface indexes come out as numbered."""
    iface = {(n.name, i.ifname): i for n in plan.nodes for i in n.interfaces}
    netns_of = {n.name: n.netns for n in plan.nodes}
    fds: dict[str, int] = {}
    try:
        sender = None
        for link in plan.links:
            if sender is not None and sender != link.a.node:
                batches[sender].flush()
            sender = link.a.node
            a = iface[(link.a.node, link.a.ifname)]
            b = iface[(link.b.node, link.b.ifname)]
            if link.b.node not in fds:
                fds[link.b.node] = os.open(os.path.join(namespaces.NETNS_RUN_DIR,
                                                        netns_of[link.b.node]),
                                           os.O_RDONLY | os.O_CLOEXEC)
            batches[sender].add(
                veth_message(a.ifname, a.mac, a.mtu_bytes, b.ifname, b.mac, b.mtu_bytes,
                             fds[link.b.node]),
                f"veth pair {a.ifname} <-> {link.b.node}:{b.ifname} (link {link.index})")
        if sender is not None:
            batches[sender].flush()
    finally:
        for fd in fds.values():
            os.close(fd)


def _steer_ports(plan: Plan, steer: steering.Steering) -> None:
    """Step 2b, only where the kernel has no per-namespace RPS default: the RPS map on
    every port, before any port is up (so no packet is received without it)."""
    ports = {n.netns: [i.ifname for i in n.interfaces] for n in plan.nodes if n.interfaces}
    try:
        steering.write_rps_cpus(ports, steer.mask)
    except OSError as exc:
        raise BuildError(f"building {plan.lab!r}: writing rps_cpus {steer.mask}: {exc}") from exc


def _index(ifindex: dict[str, dict[str, int]], node: str, ifname: str) -> int:
    try:
        return ifindex[node][ifname]
    except KeyError:
        raise BuildError(f"node {node}: interface {ifname} missing after the veth pairs "
                         "were made") from None


def _configure_ports(plan: Plan, batches: dict[str, NetlinkBatch],
                     ifindex: dict[str, dict[str, int]]) -> int:
    """Step 3: lo up; per port its address, its queues, link up. Returns tc requests."""
    tc_requests = 0
    with TcTemplates() as templates:
        for node in plan.nodes:
            batch = batches[node.name]
            batch.add(link_up_message(LOOPBACK_IFINDEX), "link set lo up")
            for iface in node.interfaces:
                idx = _index(ifindex, node.name, iface.ifname)
                batch.add(address_message(idx, iface.address),
                          f"address add {iface.address} dev {iface.ifname}")
                tc_requests += install_port_queues(BatchedTc(batch, templates, iface.ifname),
                                                   idx, iface.egress)
                batch.add(link_up_message(idx), f"link set {iface.ifname} up")
            batch.flush()
    return tc_requests


def _add_neighbours(plan: Plan, batches: dict[str, NetlinkBatch],
                    ifindex: dict[str, dict[str, int]]) -> None:
    """Step 4: each port's /31 peer as a permanent neighbour (after link up: taking a
    link down flushes even permanent entries)."""
    mac = {(n.name, i.ifname): i.mac for n in plan.nodes for i in n.interfaces}
    for node in plan.nodes:
        batch = batches[node.name]
        for iface in node.interfaces:
            peer_ip = iface.peer.address.split("/")[0]
            peer_mac = mac[(iface.peer.node, iface.peer.ifname)]
            batch.add(neighbour_message(_index(ifindex, node.name, iface.ifname), peer_ip,
                                        peer_mac),
                      f"neigh add {peer_ip} lladdr {peer_mac} dev {iface.ifname} nud permanent")
        batch.flush()


def _add_routes(plan: Plan, batches: dict[str, NetlinkBatch],
                ifindex: dict[str, dict[str, int]]) -> int:
    """Step 5: every node's routes (after every port is up: a gateway must be on a
    connected /31). Returns how many."""
    routes = 0
    for node in plan.nodes:
        batch = batches[node.name]
        for route in node.routes:
            hops = [(h.gateway, _index(ifindex, node.name, h.ifname)) for h in route.nexthops]
            via = [f"via {h.gateway} dev {h.ifname}" for h in route.nexthops]
            if len(via) > 1:
                via = [f"nexthop {v}" for v in via]
            batch.add(route_message(route.dst, hops), f"route add {route.dst} {' '.join(via)}")
            routes += 1
        batch.flush()
    return routes


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
    rxe.destroy(lab)     # what it made in the initial namespace, before the NICs go
    removed = []
    for ns in state.netns:
        if namespaces.exists(ns):
            namespaces.remove(ns)   # its veth ends go with it, and so do their peers
            removed.append(ns)
    datapath.detach_port_programs(lab)
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
    for lab in datapath.leftover_pinned_labs():
        datapath.detach_port_programs(lab)
    orphans += rxe.destroy_orphans()
    return labs, orphans
