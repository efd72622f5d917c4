"""One VM's part of a plan spread over several VMs (`testbed up FILE --vms V --vm NAME`).

Pure: the plan and its placement (testbed/plan/partition.py) -> only the nodes placed on
one VM, with the same namespace and interface names as a single-VM build, plus every
link that crosses to another VM marked as a tunnel end (the local node and port, the
link's VNI, the local and remote underlay addresses). The builder makes the local end of
each tunnel; the other VM's part makes the other end.
"""

from __future__ import annotations

from testbed.plan.model import Plan, PlanModel
from testbed.plan.partition import Placement, TunnelEnd


class PartTunnelEnd(PlanModel):
    """A cut link seen from one VM: the partition's tunnel with its ends put in order."""
    link: int               # index into Plan.links
    vni: int                # vni_base + link
    udp_port: int           # 4789
    local: TunnelEnd        # the end on this VM (node, port, underlay address)
    remote: TunnelEnd       # the end on the other VM


class PartPlan(PlanModel):
    vm: str
    plan: Plan                        # the whole fabric's plan (addresses, routes, MACs)
    nodes: list[str]                  # this VM's nodes, in plan order
    local_links: list[int]            # links with both ends on this VM
    tunnels: list[PartTunnelEnd]      # links with one end here, by link index
    underlay_mtu_bytes: int           # fabric MTU + 50 (VXLAN over IPv4)


def part_plan(plan: Plan, placement: Placement, vm_name: str) -> PartPlan:
    """VM `vm_name`'s share of `plan` under `placement`; ValueError for an unknown VM."""
    vms = [v.name for v in placement.vms]
    if vm_name not in vms:
        raise ValueError(f"no VM {vm_name!r} in the VMs file (VMs: {', '.join(vms)})")
    here = {n for n, vm in placement.nodes.items() if vm == vm_name}
    tunnels = []
    for t in placement.tunnels:
        for local, remote in ((t.a, t.b), (t.b, t.a)):
            if local.vm == vm_name:
                tunnels.append(PartTunnelEnd(link=t.link, vni=t.vni, udp_port=t.udp_port,
                                             local=local, remote=remote))
    return PartPlan(vm=vm_name, plan=plan,
                    nodes=[n.name for n in plan.nodes if n.name in here],
                    local_links=[li.index for li in plan.links
                                 if li.a.node in here and li.b.node in here],
                    tunnels=tunnels, underlay_mtu_bytes=placement.underlay_mtu_bytes)


def local_plan(plan: Plan, part: PartPlan) -> Plan:
    """The plan as one VM's part sees it: its own nodes only. The links, addresses and
    MACs of the whole fabric stay (link indexes and routes refer to them), so what
    iterates a plan's nodes (sampling counters, starting PFC agents, the lab's recorded
    plan) covers this VM's nodes."""
    here = set(part.nodes)
    return plan.model_copy(update={"nodes": [n for n in plan.nodes if n.name in here]})
