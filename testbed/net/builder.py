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
  7. link delay, where the kernel has sch_netem and IFB devices (tried first in the
     first node's namespace, netem.preflight): per link direction an IFB in the
     receiving namespace with a netem root (the link's dilated delay and PHY loss),
     fed by a redirect at the receiving port's clsact ingress after the departure
     program (netem.py says why there). Without them the links carry no delay and
     the port programs apply the PHY loss (the report says so).
  8. rxe endpoints: the Soft-RoCE device of every `endpoint: rxe` host on its NIC (rxe.py
     says where, by kernel; a placement this machine refuses stops `apply_plan` before
     anything is made).
One VM's part of a fabric spread over several VMs (`apply_plan(plan, part=...)`, for
`testbed up FILE --vms VMS.yaml --vm NAME`) goes through the same steps for its own
nodes and the links between them; each link that crosses to another VM is a veth pair
too, its far end in the part's tunnel namespace, joined to a VXLAN device there (step
2c, tunnel.py), and its port's departures are counted at that far end.
Each namespace's requests go out in batches over its own socket, every ack checked
(testbed/net/batch.py says why and what it saved). Any failure tears down what was
made and raises BuildError naming the node, the request and the kernel's reason.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from testbed.net import datapath, namespaces, netem, portprog, rxe, steering, tunnel
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
from testbed.plan.model import LinkPlan, NodePlan, Plan
from testbed.plan.part import PartPlan, local_plan


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
    tunnels: int = 0       # a part's VXLAN tunnels to other VMs
    ordering: str = ""     # "rps cpus 0-1 (how)", or "none: why" (flows may be reordered)
    delay: str = ""        # "netem", or "none: why" (links carry no propagation/FEC delay)


def plan_digest(plan: Plan, part: PartPlan | None = None,
                underlay_netns: str | None = None) -> str:
    text = plan.to_json() if part is None else part.model_dump_json() + f"|{underlay_netns}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Scope:
    """What one build makes: every node and link of the plan, or one VM's part (its
    nodes, the links between them, and a tunnel end for each link to another VM)."""
    nodes: list[NodePlan]
    links: list[LinkPlan]
    part: PartPlan | None = None
    tunnel_netns: str | None = None
    underlay_netns: str | None = None

    @classmethod
    def of(cls, plan: Plan, part: PartPlan | None = None,
           underlay_netns: str | None = None) -> Scope:
        if part is None:
            return cls(list(plan.nodes), list(plan.links))
        here = set(part.nodes)
        return cls([n for n in plan.nodes if n.name in here],
                   [plan.links[i] for i in part.local_links], part,
                   tunnel.tunnel_netns(plan, part.vm) if part.tunnels else None,
                   underlay_netns)

    @property
    def netns(self) -> list[str]:
        return [n.netns for n in self.nodes] + ([self.tunnel_netns] if self.tunnel_netns
                                                else [])

    def departure_hooks(self) -> dict[tuple[str, str], tuple[str, str]]:
        if self.part is None or self.tunnel_netns is None:
            return {}
        return tunnel.departure_hooks(self.part, self.tunnel_netns)


class _Timer:
    def __init__(self, report: BuildReport) -> None:
        self.report = report
        self.t = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.report.seconds[name] = round(now - self.t, 4)
        self.t = now


def apply_plan(plan: Plan, progress: Callable[[str], None] | None = None, *,
               keep_order: bool = True, part: PartPlan | None = None,
               underlay_netns: str | None = None) -> BuildReport:
    """Build the lab described by `plan`. Idempotent: an identical lab already up is left as is.

    `keep_order=False` builds without what keeps a flow in order (RPS, steering.py;
    static neighbours, step 4), as the builder did before them, so that
    bench/ordering.py can measure the reordering they prevent; never otherwise.
    `part`: build only this VM's part (testbed/plan/part.py), its tunnels' UDP sockets
    in `underlay_netns` (None: the namespace this process runs in). The lab's state then
    records the part's VM and nodes, and its plan file holds the part's nodes only.
    """
    say = progress or (lambda _msg: None)
    report = BuildReport(lab=plan.lab)
    scope = Scope.of(plan, part, underlay_netns)
    digest = plan_digest(plan, part, underlay_netns)
    existing = LabState.load(plan.lab)
    if existing is not None:
        if (existing.status == "up" and existing.plan_digest == digest
                and all(namespaces.exists(ns) for ns in existing.netns)):
            report.already_up = True
            return report
        if existing.status == "up" and existing.plan_digest != digest:
            what = "a different plan" if existing.vm == (part.vm if part else None) else (
                f"VM {existing.vm}'s part" if existing.vm else "the whole fabric")
            raise BuildError(f"lab {plan.lab!r} is up here with {what}; "
                             f"run `testbed down {plan.lab}` first")
        say(f"lab {plan.lab!r} was left half-built ({existing.status}); removing it first")
        destroy_lab(plan.lab)
    local = local_plan(plan, part) if part is not None else plan
    try:
        report.rxe_mode = rxe.placement_mode(local)
    except rxe.RxeRefused as exc:
        raise BuildError(str(exc)) from None
    clashes = [ns for ns in scope.netns if namespaces.exists(ns)]
    if clashes:
        raise BuildError(f"namespaces {clashes[:3]} exist but no lab state owns them; "
                         "run `testbed down --all` to clear leftovers")

    state = LabState(lab=plan.lab, netns=scope.netns, status="building",
                     plan_digest=digest, builder_pid=os.getpid(),
                     vm=part.vm if part else None,
                     nodes=[n.name for n in scope.nodes] if part else None)
    state.save()
    state.plan_path.write_text(local.to_json())
    os.chmod(state.plan_path, 0o600)
    try:
        _build(plan, scope, report, say, keep_order)
        if report.rxe_mode is not None:
            say("rxe endpoints")
            t = time.perf_counter()
            rxe.build(local, report.rxe_mode, say)
            report.seconds["rxe"] = round(time.perf_counter() - t, 4)
    except BaseException as exc:
        say(f"build failed ({exc}); removing what was made")
        state.status = "failed"
        state.save()
        destroy_lab(plan.lab)
        if isinstance(exc, RequestError):
            raise BuildError(f"kernel refused a request while building {plan.lab!r}: "
                             f"{exc}") from exc
        if isinstance(exc, BatchError | rxe.RxeError | tunnel.TunnelError):
            raise BuildError(f"building {plan.lab!r}: {exc}") from exc
        raise
    state.status = "up"
    state.save()
    return report


def _build(plan: Plan, scope: Scope, report: BuildReport, say: Callable[[str], None],
           keep_order: bool) -> None:
    timer = _Timer(report)
    steer = steering.choose(keep_order)
    report.ordering = steer.describe()
    # The port programs' instances load (bpftool, the verifier: CPU-bound) while the
    # steps below run, on the other CPUs; step 6 waits for them.
    loading, why_no_bpf, lab_index = _start_loading(plan, scope)
    timer.lap("bpf load start")
    try:
        say(f"creating {len(scope.netns)} namespaces")
        sockets = _create_namespaces(plan, scope, steer.namespace_sysctls())
    except BaseException:
        if loading is not None:
            loading.wait(check=False)
        raise
    report.namespaces = len(scope.netns)
    timer.lap("namespaces")
    try:
        batches = {n.name: NetlinkBatch(sockets[n.name], n.name) for n in scope.nodes}

        say(f"creating {len(scope.links)} veth pairs")
        _create_veth_pairs(plan, scope.links, batches,
                           lab_index)
        report.veth_pairs = len(scope.links)
        timer.lap("veth")

        if scope.part is not None and scope.tunnel_netns is not None:
            ends = scope.part.tunnels
            say(f"{len(ends)} VXLAN tunnel(s) to other VMs (underlay namespace: "
                f"{scope.underlay_netns or 'this one'})")
            tunnel.add_port_veths(scope.part, batches, scope.tunnel_netns)
            tunnel.add_vxlans(scope.part, scope.tunnel_netns, scope.underlay_netns)
            report.tc_requests += tunnel.join(scope.part, scope.tunnel_netns,
                                              sockets[scope.tunnel_netns])
            report.tunnels = len(ends)
            timer.lap("tunnels")

        if steer.method == steering.RPS_CPUS:
            say("flow steering (rps_cpus of every port)")
            _steer_ports(plan.lab, scope, steer)
            timer.lap("flow steering")

        say("addresses, queues and links up")
        ifindex = {n.name: dump_link_indexes(sockets[n.name], n.name) for n in scope.nodes}
        report.tc_requests += _configure_ports(scope, batches, ifindex)
        timer.lap("addresses+queues")

        if keep_order:
            say("neighbours")
            _add_neighbours(plan, scope, batches, ifindex)
            timer.lap("neighbours")

        say("routes")
        report.routes = _add_routes(scope, batches, ifindex)
        timer.lap("routes")

        first = scope.nodes[0].name if scope.nodes else None
        why_no_delay = netem.preflight(sockets[first], first) if first else "no nodes"
        say("port programs (queue accounting, ECN marking, PFC decisions"
            + (", PHY loss)" if why_no_delay else ")"))
        report.datapath = _attach_datapath(plan, scope, ifindex, loading, why_no_bpf,
                                           apply_phy_loss=bool(why_no_delay))
        timer.lap("port programs")

        if why_no_delay is None:
            say("link delay (netem at each port's peer ingress)")
            report.tc_requests += _add_wire_stages(plan, scope, batches, sockets,
                                                   clsact=report.datapath != "bpf")
            report.delay = "netem"
            timer.lap("link delay")
        else:
            report.delay = f"none: {why_no_delay}"
    finally:
        if loading is not None and not loading.done:
            loading.wait(check=False)     # a failed build: no bpftool pins after the teardown
        for sock in sockets.values():
            sock.close()


def _start_loading(plan: Plan, scope: Scope) -> tuple[
        portprog.Loading | portprog.LabLoading | None, str, dict[tuple[str, str], int]]:
    """Start loading the port programs (step 6 attaches them): (loading, "", the ifindex
    step 2 gives each interface, empty if any), or (None, why, {}) where this machine
    cannot build the port program.

    The whole fabric on one machine: ONE instance for the lab (two verifier runs), its
    ports keyed by lab-unique ifindexes (portprog.lab_ifindexes). A VM's part, a lab
    with more interfaces than the lab build keys, or TESTBED_PORTPROG=per-port: one
    instance per port (two verifier runs each, ~4 ms; bench/README.md)."""
    lab_index: dict[tuple[str, str], int] = {}
    if scope.part is None and os.environ.get("TESTBED_PORTPROG") != "per-port":
        with contextlib.suppress(portprog.PortProgError):      # too many: per port
            lab_index = portprog.lab_ifindexes(list(plan.nodes))
    try:
        obj = portprog.ensure_object(defines=portprog.LAB_DEFINES if lab_index else ())
    except portprog.PortProgError as exc:
        return None, str(exc), {}
    if not lab_index:
        return portprog.start_loading(datapath.pin_dirs_of(plan, scope.nodes), obj), "", {}
    ports = [portprog.LabPort(node.name, iface.ifname, lab_index[(node.name, iface.ifname)],
                              lab_index[(iface.peer.node, iface.peer.ifname)])
             for node in scope.nodes for iface in node.interfaces]
    return portprog.start_lab_loading(plan.lab, ports, obj), "", lab_index


def _attach_datapath(plan: Plan, scope: Scope, ifindex: dict[str, dict[str, int]],
                     loading: portprog.Loading | portprog.LabLoading | None, why_no_bpf: str,
                     apply_phy_loss: bool = True) -> str:
    """Step 6: the tc-BPF port program on every port, where this machine can load it
    (`loading`: its instances, being loaded since the build began).

    Without clang or bpftool the fabric still forwards and shapes, but has
    no ECN marking, queue accounting or PFC; the report says so. `apply_phy_loss`:
    False when step 7's netem applies the PHY's frame loss.
    """
    if loading is None:
        return f"none: {why_no_bpf}"
    datapath.attach_port_programs(plan, apply_phy_loss=apply_phy_loss, ifindex=ifindex,
                                  nodes=scope.nodes, departure_hooks=scope.departure_hooks(),
                                  loading=loading)
    return "bpf"


def _add_wire_stages(plan: Plan, scope: Scope, batches: dict[str, NetlinkBatch],
                     sockets: dict[str, socket.socket], clsact: bool) -> int:
    """Step 7: per receiving node its IFBs (one batch), one link dump, then per IFB its
    netem and the redirect on the port it serves (a second batch). `clsact`: the ports
    have no clsact yet (no port programs). Returns the tc requests. A part makes the
    stages whose receiving port is its own: a tunnel's incoming direction included,
    the other VM's part makes the outgoing one."""
    requests = 0
    here = {n.name for n in scope.nodes}
    stages_all = [s for s in netem.wire_stages(plan) if s.rx_node in here]
    with TcTemplates() as templates:
        for rx_node, stages in netem.stages_by_rx_node(stages_all).items():
            batch = batches[rx_node]
            for s in stages:
                batch.add(netem.ifb_message(s.ifb), f"link add {s.ifb} type ifb up")
            batch.flush()
            index = dump_link_indexes(sockets[rx_node], rx_node)
            for s in stages:
                requests += netem.install_stage(
                    BatchedTc(batch, templates, f"{s.ifb} / {s.rx_ifname}"),
                    s, _index({rx_node: index}, rx_node, s.rx_ifname),
                    _index({rx_node: index}, rx_node, s.ifb), clsact=clsact)
            batch.flush()
    return requests


# The tunnel namespace carries no IP traffic of its own: with IPv6 on, its devices would
# send router solicitations and MLD reports out of vxp<i>, into the fabric's ports.
TUNNEL_NETNS_SYSCTLS = {"net.ipv6.conf.all.disable_ipv6": "1",
                        "net.ipv6.conf.default.disable_ipv6": "1"}


def _create_namespaces(plan: Plan, scope: Scope,
                       extra_sysctls: dict[str, str]) -> dict[str, socket.socket]:
    """Step 1: every node's namespace with its sysctls (the plan's, then `extra_sysctls`,
    the same on every node), and a part's tunnel namespace; a netlink socket in each,
    by node (the tunnel namespace's by its own name)."""
    node_of = {n.netns: n.name for n in scope.nodes}
    specs = [(n.netns, {**n.sysctls, **extra_sysctls}) for n in scope.nodes]
    if scope.tunnel_netns is not None:
        node_of[scope.tunnel_netns] = scope.tunnel_netns
        specs.append((scope.tunnel_netns, {**TUNNEL_NETNS_SYSCTLS, **extra_sysctls}))
    try:
        sockets = namespaces.create_many(specs, open_socket=open_route_socket)
    except namespaces.NamespaceError as exc:
        raise BuildError(f"building {plan.lab!r}: node {node_of[exc.name]}: {exc}") from exc
    return {node_of[ns]: sock for ns, sock in sockets.items()}


def _create_veth_pairs(plan: Plan, links: list[LinkPlan],
                       batches: dict[str, NetlinkBatch],
                       lab_index: dict[tuple[str, str], int] | None = None) -> None:
    """Step 2: each link's veth pair, from the `a` node's namespace, the peer put in
    the `b` node's. Sent in plan order, so interface indexes come out as numbered.
    `lab_index`: (node, ifname) -> the ifindex each end gets (the lab's port program
    instance keys ports by them), else the kernel picks."""
    at = lab_index or {}
    iface = {(n.name, i.ifname): i for n in plan.nodes for i in n.interfaces}
    netns_of = {n.name: n.netns for n in plan.nodes}
    fds: dict[str, int] = {}
    try:
        sender = None
        for link in links:
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
                             fds[link.b.node], at.get((link.a.node, a.ifname), 0),
                             at.get((link.b.node, b.ifname), 0)),
                f"veth pair {a.ifname} <-> {link.b.node}:{b.ifname} (link {link.index})")
        if sender is not None:
            batches[sender].flush()
    finally:
        for fd in fds.values():
            os.close(fd)


def _steer_ports(lab: str, scope: Scope, steer: steering.Steering) -> None:
    """Step 2b, only where the kernel has no per-namespace RPS default: the RPS map on
    every port, before any port is up (so no packet is received without it); in a part,
    on its tunnel devices too (the tunnel namespace is a hop every crossing packet takes)."""
    ports = {n.netns: [i.ifname for i in n.interfaces] for n in scope.nodes if n.interfaces}
    if scope.part is not None and scope.tunnel_netns is not None:
        ports[scope.tunnel_netns] = [name for end in scope.part.tunnels for name in
                                     (tunnel.port_peer_ifname(end), tunnel.vxlan_ifname(end))]
    try:
        steering.write_rps_cpus(ports, steer.mask)
    except OSError as exc:
        raise BuildError(f"building {lab!r}: writing rps_cpus {steer.mask}: {exc}") from exc


def _index(ifindex: dict[str, dict[str, int]], node: str, ifname: str) -> int:
    try:
        return ifindex[node][ifname]
    except KeyError:
        raise BuildError(f"node {node}: interface {ifname} missing after the veth pairs "
                         "were made") from None


def _configure_ports(scope: Scope, batches: dict[str, NetlinkBatch],
                     ifindex: dict[str, dict[str, int]]) -> int:
    """Step 3: lo up; per port its address, its queues, link up. Returns tc requests."""
    tc_requests = 0
    with TcTemplates() as templates:
        for node in scope.nodes:
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


def _add_neighbours(plan: Plan, scope: Scope, batches: dict[str, NetlinkBatch],
                    ifindex: dict[str, dict[str, int]]) -> None:
    """Step 4: each port's /31 peer as a permanent neighbour (after link up: taking a
    link down flushes even permanent entries). A peer on another VM has its MAC in the
    plan as every other does."""
    mac = {(n.name, i.ifname): i.mac for n in plan.nodes for i in n.interfaces}
    for node in scope.nodes:
        batch = batches[node.name]
        for iface in node.interfaces:
            peer_ip = iface.peer.address.split("/")[0]
            peer_mac = mac[(iface.peer.node, iface.peer.ifname)]
            batch.add(neighbour_message(_index(ifindex, node.name, iface.ifname), peer_ip,
                                        peer_mac),
                      f"neigh add {peer_ip} lladdr {peer_mac} dev {iface.ifname} nud permanent")
        batch.flush()


def _add_routes(scope: Scope, batches: dict[str, NetlinkBatch],
                ifindex: dict[str, dict[str, int]]) -> int:
    """Step 5: every node's routes (after every port is up: a gateway must be on a
    connected /31). Returns how many."""
    routes = 0
    for node in scope.nodes:
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


def _is_lab_zygote(pid: int, lab: str) -> bool:
    """Whether `pid` runs the zygote of `lab` (agents/runtime/zygote.py): it lives in the
    initial namespace, so its command line, not its namespace, says it is ours."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"agents.runtime.zygote" in argv and f"--lab={lab}".encode() in argv


def _stop_processes(state: LabState) -> None:
    inodes = {namespaces.inode(ns) for ns in state.netns} - {None}
    for proc in state.processes:
        # Only a pid that is still the process we started, in one of our namespaces
        # (the run's zygote: in the initial one, known by its command line).
        if (process_start_time(proc.pid) == proc.start_time
                and (namespaces.pid_netns_inode(proc.pid) in inodes
                     or (proc.name == "zygote" and _is_lab_zygote(proc.pid, state.lab)))):
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
    if state.nodes is None:
        datapath.detach_port_programs(lab)
    else:       # one VM's part: another part of the lab may be pinned on this machine
        datapath.detach_node_programs(lab, state.nodes)
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
