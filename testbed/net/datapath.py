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
from testbed.plan.model import Plan


def _route_socket(netns: str) -> socket.socket:
    # Opened from inside the namespace by this thread: IPRoute(netns=...)
    # would fork a helper process per node.
    with namespaces.inside(netns):
        return socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, socket.NETLINK_ROUTE)


def attach_port_programs(plan: Plan, apply_phy_loss: bool,
                         ifindex: dict[str, dict[str, int]] | None = None) -> int:
    """Attach and configure the port program on every port; returns the number attached.

    Every instance is loaded first (one bpftool batch; the first port of each node
    makes the node's shared maps), then each node's buffer model is written, then
    per port the departure program goes on its peer's ingress and the egress program
    on the port. `apply_phy_loss`: drop with each link's PHY frame-loss ratio here; the
    builder asks for it only where it installs no netem stage (False leaves the PHY's
    share to netem at the peer's ingress, netem.py). `ifindex`: node -> ifname ->
    ifindex, if the caller has it (the builder dumped every node's links already).
    """
    obj = portprog.ensure_object()
    portprog.load_programs([portprog.pin_dir_of(plan.lab, node.name, iface.ifname)
                            for node in plan.nodes for iface in node.interfaces], obj)
    sockets = {node.name: _route_socket(node.netns) for node in plan.nodes}
    iprs = {name: IPRoute(use_socket=sock) for name, sock in sockets.items()}
    count = 0
    try:
        index = {node.name: (ifindex or {}).get(node.name)
                 or batch.dump_link_indexes(sockets[node.name], node.name)
                 for node in plan.nodes}
        for node in plan.nodes:
            portprog.configure_node(plan.lab, node.name,
                                    portprog.node_params_from_plan(node, index[node.name]))
        for node in plan.nodes:
            for slot, iface in enumerate(node.interfaces, start=1):
                loss = iface.loss_probability
                if not apply_phy_loss:
                    # netem applies the PHY's share; the port program keeps the rest
                    phy = plan.links[iface.link].frame_loss_ratio
                    loss = 1 - (1 - loss) / (1 - phy) if phy < 1 else loss
                peer = plan.node(iface.peer.node)
                handle = portprog.attach_port(
                    plan.lab, node.name, node.netns, iface.ifname,
                    portprog.params_from_egress(iface.egress, loss, port_slot=slot),
                    peer=(peer.netns, iface.peer.ifname), ipr=iprs[node.name],
                    peer_ipr=iprs[peer.name], obj=obj, loaded=True,
                    ifindex=index[node.name].get(iface.ifname),
                    peer_ifindex=index[peer.name].get(iface.peer.ifname))
                handle.close()
                count += 1
    finally:
        for ipr in iprs.values():
            ipr.close()
    return count


def detach_port_programs(lab: str) -> None:
    portprog.detach_lab(lab)


def leftover_pinned_labs() -> list[str]:
    return portprog.pinned_labs()
