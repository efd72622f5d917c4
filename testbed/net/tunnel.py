"""The links that cross VMs: one VXLAN tunnel per cut link, built by each VM's part.

A fabric spread over several VMs (`testbed up FILE --vms VMS.yaml --vm NAME`,
docs/scale-out.md) keeps every node's namespace, port names, MACs, addresses, queues,
port programs and PFC agent exactly as a single-VM build has them. Only what is on the
other side of a cut link changes. For the local end P of cut link i:

    node namespace              tunnel namespace (tb-<lab>-vx-<vm>)          underlay
    P: HTB, port_egress ──veth──> vxp<i>: clsact ingress                     namespace
       (the port as ever)           prio 2  port_departure (P's departures)
                                    prio 3  u32 match-all, mirred redirect ─> vxlan<i> ~~~ UDP 4789
    P <──veth── vxp<i> egress <──── mirred redirect, u32 match-all ──────── vxlan<i>    to/from
                                                                                      the other VM

- P is one end of a veth pair, like every other port, so the queue the port program
  decides on stays exact: P's departures are counted where they arrive, at the peer
  end's clsact ingress (here vxp<i>, not a port on the other VM, whose maps are not
  this VM's), and queue = admitted - departed as on a local link.
- The VXLAN device is created from a socket in the underlay namespace and put straight
  into the tunnel namespace: the kernel keeps a VXLAN device's UDP socket in the
  namespace that created it, so the encapsulated packets use the underlay's address
  and routes while no device is added there (`--underlay-netns`; default: the
  namespace `testbed` runs in, which on a VM is the VM's own).
- The two are joined by tc mirred redirects, not a bridge: a Linux bridge never
  forwards 01:80:c2:00:00:01 (PFC's destination), a redirect forwards every frame. So
  PFC frames cross the tunnel and pause the other VM's port as on a local link.
- VXLAN's outer TOS is 0 (not inherited): the underlay never sees the fabric's ECN
  bits, so it cannot mark or drop by them, and the inner header (DSCP, ECN, CE marks
  made by the fabric's ports) arrives unchanged.
- The underlay must carry the fabric MTU + 50 bytes (checked when the VMs file is
  read, testbed/plan/partition.py).

Names: the tunnel namespace is tb-<lab>-vx-<vm> (node names have no '-', so it never
meets a node's), and in it vxp<i> and vxlan<i> (link index i, unique in the lab).
"""

from __future__ import annotations

import os
import socket

from testbed.net import namespaces
from testbed.net.batch import (
    BatchedTc,
    NetlinkBatch,
    TcTemplates,
    dump_link_indexes,
    link_up_message,
    open_route_socket,
    veth_message,
    vxlan_message,
)
from testbed.net.netem import redirect_filter_kwargs
from testbed.plan.model import Plan
from testbed.plan.part import PartPlan, PartTunnelEnd


class TunnelError(RuntimeError):
    """Building a tunnel end failed; the message names the link and the kernel's reason."""


def tunnel_netns(plan: Plan, vm: str) -> str:
    return f"{plan.netns_prefix}vx-{vm}"


def port_peer_ifname(end: PartTunnelEnd) -> str:
    """The veth peer of the tunnel's local port, in the tunnel namespace."""
    return f"vxp{end.link}"


def vxlan_ifname(end: PartTunnelEnd) -> str:
    return f"vxlan{end.link}"


def peer_mac(end: PartTunnelEnd) -> str:
    """A locally administered MAC for vxp<i> (nothing addresses it: frames pass by
    redirect), from the link index so a rebuild is the same."""
    i = end.link
    return f"02:76:78:{(i >> 16) & 0xFF:02x}:{(i >> 8) & 0xFF:02x}:{i & 0xFF:02x}"


def departure_hooks(part: PartPlan, netns: str) -> dict[tuple[str, str], tuple[str, str]]:
    return {(t.local.node, t.local.ifname): (netns, port_peer_ifname(t)) for t in part.tunnels}


def add_port_veths(part: PartPlan, batches: dict[str, NetlinkBatch], tunnel_ns: str) -> None:
    """Each tunnel port as one end of a veth pair made from its node's namespace (its
    MAC and MTU from the plan, as a local link's end), the peer put in `tunnel_ns`."""
    fd = os.open(os.path.join(namespaces.NETNS_RUN_DIR, tunnel_ns), os.O_RDONLY | os.O_CLOEXEC)
    try:
        iface = {(n.name, i.ifname): i for n in part.plan.nodes for i in n.interfaces}
        for end in part.tunnels:
            port = iface[(end.local.node, end.local.ifname)]
            batches[end.local.node].add(
                veth_message(port.ifname, port.mac, port.mtu_bytes, port_peer_ifname(end),
                             peer_mac(end), port.mtu_bytes, fd),
                f"veth pair {port.ifname} <-> {tunnel_ns}:{port_peer_ifname(end)} "
                f"(link {end.link}, tunnel to {end.remote.vm})")
        for end in part.tunnels:
            batches[end.local.node].flush()
    finally:
        os.close(fd)


def _underlay_socket(underlay_netns: str | None) -> socket.socket:
    """A route socket in the underlay namespace: the one this process runs in when
    None (a VM's own), else a named namespace entered by this thread for the moment it
    takes to open the socket (nothing is changed in it but the VXLAN sockets the kernel
    opens there)."""
    if underlay_netns is None:
        return open_route_socket()
    if not namespaces.exists(underlay_netns):
        raise TunnelError(f"underlay namespace {underlay_netns!r} does not exist "
                          f"(no {namespaces.NETNS_RUN_DIR}/{underlay_netns})")
    with namespaces.inside_any(underlay_netns):
        return open_route_socket()


def add_vxlans(part: PartPlan, tunnel_ns: str, underlay_netns: str | None) -> None:
    """Every tunnel's VXLAN device: created from the underlay namespace, put in the
    tunnel namespace."""
    sock = _underlay_socket(underlay_netns)
    fd = os.open(os.path.join(namespaces.NETNS_RUN_DIR, tunnel_ns), os.O_RDONLY | os.O_CLOEXEC)
    try:
        batch = NetlinkBatch(sock, underlay_netns or "the underlay namespace")
        mtu = {(n.name, i.ifname): i.mtu_bytes for n in part.plan.nodes for i in n.interfaces}
        for end in part.tunnels:
            batch.add(vxlan_message(vxlan_ifname(end), end.vni, end.local.underlay,
                                    end.remote.underlay, end.udp_port,
                                    mtu[(end.local.node, end.local.ifname)], fd),
                      f"vxlan {vxlan_ifname(end)} id {end.vni} local {end.local.underlay} "
                      f"remote {end.remote.underlay} dstport {end.udp_port} (link "
                      f"{end.link}, {end.local.node}:{end.local.ifname} <-> {end.remote.vm} "
                      f"{end.remote.node}:{end.remote.ifname})")
        batch.flush()
    finally:
        os.close(fd)
        sock.close()


def join(part: PartPlan, tunnel_ns: str, sock: socket.socket) -> int:
    """In the tunnel namespace: both devices of each tunnel up, a clsact on each and a
    redirect each way. Returns the tc requests made."""
    batch = NetlinkBatch(sock, tunnel_ns)
    index = dump_link_indexes(sock, tunnel_ns)
    pairs = []
    for end in part.tunnels:
        try:
            pairs.append((index[port_peer_ifname(end)], index[vxlan_ifname(end)]))
        except KeyError as exc:
            raise TunnelError(f"{tunnel_ns}: {exc.args[0]} missing after it was made "
                              f"(link {end.link})") from None
    for veth, vxlan in pairs:
        batch.add(link_up_message(veth), f"link set {veth} up")
        batch.add(link_up_message(vxlan), f"link set {vxlan} up")
    requests = 0
    with TcTemplates() as templates:
        for end, (veth, vxlan) in zip(part.tunnels, pairs, strict=True):
            for dev, other, name in ((veth, vxlan, port_peer_ifname(end)),
                                     (vxlan, veth, vxlan_ifname(end))):
                tc = BatchedTc(batch, templates, name)
                tc.tc("add", "clsact", dev)
                # after the departure program (on vxp<i>), which lets the chain go on
                tc.tc("add-filter", "u32", dev, **redirect_filter_kwargs(other))
                requests += 2
    batch.flush()
    return requests
