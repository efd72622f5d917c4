"""The lossless datapath of a built lab: a port program on every egress port.

A build step after queues and routes: every port, host NICs included, gets
its own tc-BPF program instance configured from the plan (rate, classes,
ECN curve, the PHY's frame loss and impairments). Teardown removes
the lab's pins, also after a SIGKILL (it works from paths alone).
"""

from __future__ import annotations

import socket

from pyroute2 import IPRoute

from testbed.net import batch, namespaces, portprog
from testbed.plan.model import NodePlan, Plan


def _route_socket(netns: str) -> socket.socket:
    # Opened from inside the namespace by this thread: IPRoute(netns=...)
    # would fork a helper process per node.
    with namespaces.inside(netns):
        return socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, socket.NETLINK_ROUTE)


def attach_port_programs(plan: Plan, apply_phy_loss: bool,
                         ifindex: dict[str, dict[str, int]] | None = None,
                         nodes: list[NodePlan] | None = None,
                         departure_hooks: dict[tuple[str, str], tuple[str, str]] | None = None,
                         ) -> int:
    """Attach and configure the port program on every port; returns the number attached.

    Every instance is loaded first (one bpftool batch; the first port of each node
    makes the node's shared maps), then each node's buffer model is written, then
    per port the departure program goes on its peer's ingress and the egress program
    on the port. `apply_phy_loss`: drop with each link's PHY frame-loss ratio here; the
    builder asks for it only where it installs no netem stage (False leaves the PHY's
    share to netem at the peer's ingress, netem.py). `ifindex`: node -> ifname ->
    ifindex, if the caller has it (the builder dumped every node's links already).
    `nodes`: only these (one VM's part; default every node). `departure_hooks`: (node,
    ifname) -> (namespace, ifname) where that port's departures are counted instead of
    at its peer port (a port whose link crosses to another VM: its veth peer in the
    tunnel namespace, tunnel.py).
    """
    obj = portprog.ensure_object()
    nodes = list(plan.nodes) if nodes is None else nodes
    hooks = departure_hooks or {}
    portprog.load_programs([portprog.pin_dir_of(plan.lab, node.name, iface.ifname)
                            for node in nodes for iface in node.interfaces], obj)
    where = {node.name: node.netns for node in nodes}
    where.update({netns: netns for netns, _ifname in hooks.values()})
    sockets = {name: _route_socket(netns) for name, netns in where.items()}
    iprs = {name: IPRoute(use_socket=sock) for name, sock in sockets.items()}
    count = 0
    try:
        index = {name: (ifindex or {}).get(name)
                 or batch.dump_link_indexes(sockets[name], name) for name in where}
        for node in nodes:
            portprog.configure_node(plan.lab, node.name,
                                    portprog.node_params_from_plan(node, index[node.name]))
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
                    at, hook = peer.name, (peer.netns, iface.peer.ifname)
                else:
                    at = hook[0]
                handle = portprog.attach_port(
                    plan.lab, node.name, node.netns, iface.ifname,
                    portprog.params_from_egress(iface.egress, loss, port_slot=slot),
                    peer=hook, ipr=iprs[node.name],
                    peer_ipr=iprs[at], obj=obj, loaded=True,
                    ifindex=index[node.name].get(iface.ifname),
                    peer_ifindex=index[at].get(hook[1]))
                handle.close()
                count += 1
    finally:
        for ipr in iprs.values():
            ipr.close()
    return count


def detach_port_programs(lab: str) -> None:
    portprog.detach_lab(lab)


def detach_node_programs(lab: str, nodes: list[str]) -> None:
    """Unpin one VM's part of a lab: its nodes' programs and maps only."""
    portprog.detach_nodes(lab, nodes)


def leftover_pinned_labs() -> list[str]:
    return portprog.pinned_labs()
