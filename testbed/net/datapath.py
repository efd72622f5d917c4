"""The lossless datapath of a built lab: a port program on every egress port.

A build step after queues and routes: every port, host NICs included, gets
its own tc-BPF program instance configured from the plan (rate, classes,
ECN curve, the PHY's frame loss and impairments). Teardown removes
the lab's pins, also after a SIGKILL (it works from paths alone).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from testbed.net import batch, namespaces, portprog
from testbed.plan.model import NodePlan, Plan


def pin_dirs_of(plan: Plan, nodes: list[NodePlan]) -> list:
    """Every port's pin directory, node by node (the order `start_loading` takes)."""
    return [portprog.pin_dir_of(plan.lab, node.name, iface.ifname)
            for node in nodes for iface in node.interfaces]


def attach_port_programs(plan: Plan, apply_phy_loss: bool,
                         ifindex: dict[str, dict[str, int]] | None = None,
                         nodes: list[NodePlan] | None = None,
                         departure_hooks: dict[tuple[str, str], tuple[str, str]] | None = None,
                         loading: portprog.Loading | portprog.LabLoading | None = None
                         ) -> int:
    """Attach and configure the port program on every port; returns the number attached.

    Every instance is loaded first (`bpftool batch`, one per CPU; the first port of each
    node makes the node's shared maps; `loading`: the builder started that already, in
    the background), then each node's buffer model is written, then each port's
    parameters. Then, in each namespace's netlink batch (testbed/net/batch.py), a clsact
    qdisc on every device that gets a program and every departure program at its peer's
    ingress, and only once every namespace has acked those, every egress program
    (departures first: nothing admitted goes unseen). `apply_phy_loss`: drop with each
    link's PHY frame-loss ratio here; the builder asks for it only where it installs no
    netem stage (False leaves the PHY's share to netem at the peer's ingress, netem.py).
    `ifindex`: node -> ifname -> ifindex, if the caller has it (the builder dumped every
    node's links already). `nodes`: only these (one VM's part; default every node).
    `departure_hooks`: (node, ifname) -> (namespace, ifname) where that port's
    departures are counted instead of at its peer port (a port whose link crosses to
    another VM: its veth peer in the tunnel namespace, tunnel.py).
    """
    nodes = list(plan.nodes) if nodes is None else nodes
    hooks = departure_hooks or {}
    if loading is None:
        loading = portprog.start_loading(pin_dirs_of(plan, nodes), portprog.ensure_object())
    loading.wait()
    where = {node.name: node.netns for node in nodes}
    where.update({netns: netns for netns, _ifname in hooks.values()})
    sockets: dict[str, socket.socket] = {}
    try:
        for name, netns in where.items():
            with namespaces.inside(netns):
                sockets[name] = batch.open_route_socket()
        index = {name: (ifindex or {}).get(name)
                 or batch.dump_link_indexes(sockets[name], name) for name in where}
        if isinstance(loading, portprog.LabLoading):
            loading.check_ifindexes(index, where)
        for node in nodes:
            portprog.configure_node(plan.lab, node.name,
                                    portprog.node_params_from_plan(node, index[node.name]))
        # (namespace key, ifname, pin of the program, clsact parent) per attachment
        departures: list[tuple[str, str, Path]] = []
        egresses: list[tuple[str, str, Path]] = []
        for node in nodes:
            for slot, iface in enumerate(node.interfaces, start=1):
                loss = iface.loss_probability
                if not apply_phy_loss:
                    # netem applies the PHY's share; the port program keeps the rest
                    phy = plan.links[iface.link].frame_loss_ratio
                    loss = 1 - (1 - loss) / (1 - phy) if phy < 1 else loss
                hook = hooks.get((node.name, iface.ifname))
                if hook is None:
                    peer = plan.node(iface.peer.node)
                    at, hook_ifname = peer.name, iface.peer.ifname
                else:
                    at, hook_ifname = hook[0], hook[1]
                pin_dir = portprog.pin_dir_of(plan.lab, node.name, iface.ifname)
                maps = portprog.PortMaps(pin_dir)
                try:
                    maps.write_params(portprog.params_from_egress(iface.egress, loss,
                                                                  port_slot=slot))
                finally:
                    maps.close()
                departures.append((at, hook_ifname, pin_dir / "progs" / "port_departure"))
                egresses.append((node.name, iface.ifname, pin_dir / "progs" / "port_egress"))
        # A clsact on every device that gets a program, but for the departure hooks in a
        # part's tunnel namespace: tunnel.join gave those theirs (for the redirect).
        devices = ({(at, ifname) for at, ifname, _pin in departures + egresses}
                   - set(hooks.values()))
        _attach_batched(sockets, index, departures, portprog.CLSACT_INGRESS,
                        clsact=devices)
        _attach_batched(sockets, index, egresses, portprog.CLSACT_EGRESS, clsact=set())
    finally:
        for sock in sockets.values():
            sock.close()
    return len(egresses)


def _attach_batched(sockets: dict[str, socket.socket], index: dict[str, dict[str, int]],
                    attachments: list[tuple[str, str, Path]], parent: int,
                    clsact: set[tuple[str, str]]) -> None:
    """Per namespace one netlink batch: a clsact qdisc on each of its `clsact` devices,
    then the filters, each program by a fd opened from its pin and kept open until the
    kernel has acked the batch."""
    by_ns: dict[str, list[tuple[str, Path]]] = {}
    for at, ifname, pin in attachments:
        by_ns.setdefault(at, []).append((ifname, pin))
    for at in sorted({a for a, _i in clsact} | set(by_ns)):
        nl = batch.NetlinkBatch(sockets[at], at)
        fds: list[int] = []
        try:
            for dev in sorted(i for a, i in clsact if a == at):
                nl.add(portprog.clsact_message(_ifindex(index, at, dev)),
                       f"tc qdisc add dev {dev} clsact")
            for ifname, pin in by_ns.get(at, []):
                fds.append(portprog.obj_get(pin))
                nl.add(portprog.bpf_filter_message(_ifindex(index, at, ifname), parent,
                                                   fds[-1], pin.name),
                       f"tc filter replace dev {ifname} "
                       f"{'ingress' if parent == portprog.CLSACT_INGRESS else 'egress'} "
                       f"prio {portprog.FILTER_PRIO} bpf da pinned {pin}")
            nl.flush()
        except batch.RequestError as exc:
            raise portprog.PortProgError(f"attaching the port programs: {exc}") from exc
        finally:
            for fd in fds:
                os.close(fd)


def _ifindex(index: dict[str, dict[str, int]], at: str, ifname: str) -> int:
    try:
        return index[at][ifname]
    except KeyError:
        raise portprog.PortProgError(f"no interface {ifname!r} in {at!r} to attach the "
                                     "port program to") from None


def detach_port_programs(lab: str) -> None:
    portprog.detach_lab(lab)


def detach_node_programs(lab: str, nodes: list[str]) -> None:
    """Unpin one VM's part of a lab: its nodes' programs and maps only."""
    portprog.detach_nodes(lab, nodes)


def leftover_pinned_labs() -> list[str]:
    return portprog.pinned_labs()
