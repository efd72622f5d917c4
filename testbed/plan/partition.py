"""Spread one plan over several VMs: which VM runs each node, and the VXLAN tunnels of the
links that cross VMs. Pure and deterministic (the same plan and VMs file give the same
placement, byte for byte); golden-tested in tests/golden/partition/.

Load. A node's load is the sum of its egress ports' dilated wall rates (the HTB rates of
the plan). That is the most a node can have to forward, and it does not depend on the
workload, so one placement serves every workload a suite runs over the fabric (the
fabric is built once). A link that crosses VMs costs each VM once more its end's wall
rate: the VXLAN device and the underlay interface send that traffic again. A VM's load
is its nodes' load plus its tunnel ends'; its share of the whole is meant to follow its
`wall_rate_budget` (the VMs file), so a VM measured twice as fast gets twice the load.

Cost. Placements are compared on, in this order:
  1. nodes above the VMs' room (cores x nodes_per_core), summed;
  2. load above (1 + imbalance) x the VM's share, summed over VMs (bit/s);
  3. links cut (each one a tunnel: fewer is better);
  4. wall rate of the cut links, both directions (cut the slow host links, not the
     fabric links, when the count ties);
  5. the busiest VM's load over its budget;
and at a full tie, the placement whose VMs come first in the VMs file's order wins; VMs
the cost cannot tell apart (equal budget and room) are finally renamed so that nodes, in
plan order, meet them in the file's order, whichever search found the placement.

Algorithm. Nodes move in groups: a switch with the hosts all of whose links go to it (a
leaf with its hosts, in a leaf-spine); every other node is a group of one. Keeping a leaf
with its hosts cuts no host link, and the groups are few. With few groups (VMs ^ groups <=
EXHAUSTIVE_LIMIT) every assignment is tried, so small fabrics get the best placement of
their groups by the cost above. Otherwise three starts - a greedy (the groups, heaviest
first, each on the VM where the cost so far is lowest), graph growing (breadth first over
the links, filling one VM to its target before the next) and longest processing time first
(balance alone) - are each refined by Kernighan-Lin style passes (Fiduccia-Mattheyses
moves: the best single move of an unmoved group, even when it makes things worse, each
group moving once per pass; the pass keeps its best prefix), alternating with the best
exchange of two groups (it keeps a tight balance that single moves must break first),
until neither gains; the best result is kept. On the sweep of small leaf-spine fabrics
in tests/unit/test_partition.py (81 cases, where every assignment can be tried) it was
worse than the exhaustive search in one. Only when groups cannot be balanced (a single
switch with all the hosts, or a group larger than a VM's room) does a second search
move single nodes, and its result is kept only if it is better.

Tunnels. Each cut link becomes a VXLAN tunnel (UDP 4789) between the two VMs' underlay
addresses with VNI = vni_base + the plan's link index: deterministic, unique within the
lab, and stable when the placement changes. The underlay needs the fabric's MTU + 50
bytes (testbed.config.vms.VXLAN_OVERHEAD_BYTES); the VMs file is checked against it
before anything is placed. docs/scale-out.md says all of this for users.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from testbed.config.vms import (
    VXLAN_OVERHEAD_BYTES,
    VXLAN_UDP_PORT,
    VmsFile,
    underlay_mtu_bytes,
    vms_fabric_problems,
)
from testbed.plan.model import Plan, PlanModel
from testbed.units import format_rate

PLACEMENT_FORMAT_VERSION = 1
EXHAUSTIVE_LIMIT = 4096     # try every assignment of groups when there are at most this many
MAX_PASSES = 50             # refinement passes (each gains, so a few suffice in practice)
SWAP_LIMIT = 64             # exchanges of two groups are tried up to this many groups

Cost = tuple[int, int, int, int, int]


class PartitionError(ValueError):
    """VMs that cannot carry this plan (the same words as check_vms_for_fabric)."""


class VmShare(PlanModel):
    name: str
    underlay: str
    cores: int
    nodes: list[str]                # in plan order
    node_room: int                  # cores x nodes_per_core
    node_wall_bps: int              # its nodes' egress ports, summed
    tunnel_wall_bps: int            # its tunnels' ends (what its underlay interface sends)
    load_wall_bps: int              # the two together
    target_wall_bps: int            # its share of the total load, by budget
    budget_wall_bps: int
    share: float                    # load / total load
    utilisation: float              # load / budget


class TunnelEnd(PlanModel):
    node: str
    ifname: str
    vm: str
    underlay: str
    wall_rate_bps: int              # what this end sends into the tunnel (its egress)


class TunnelPlan(PlanModel):
    link: int                       # index into Plan.links
    vni: int
    udp_port: int
    a: TunnelEnd
    b: TunnelEnd


class Placement(PlanModel):
    format_version: int = PLACEMENT_FORMAT_VERSION
    lab: str
    algorithm: str                  # "exhaustive" or "greedy+kl", and "+nodes" if refined
    groups: list[list[str]]         # the node groups that moved together
    nodes: dict[str, str]           # node -> VM, in plan order
    vms: list[VmShare]
    tunnels: list[TunnelPlan]       # by link index
    cut_links: int
    cut_wall_bps: int               # both directions
    total_load_wall_bps: int
    fabric_mtu_bytes: int
    vxlan_overhead_bytes: int
    underlay_mtu_bytes: int         # what every VM with a tunnel needs
    vni_base: int
    imbalance: float
    balanced: bool                  # every VM within (1 + imbalance) x its share
    warnings: list[str]

    def to_json(self) -> str:
        return self.model_dump_json(indent=2) + "\n"


@dataclass(frozen=True)
class _Graph:
    names: list[str]
    load: list[int]                                 # per node: egress wall bps, summed
    edges: list[tuple[int, int, int, int, int]]     # (link, a, b, a's egress, b's egress)


def _graph(plan: Plan) -> _Graph:
    names = [n.name for n in plan.nodes]
    index = {name: i for i, name in enumerate(names)}
    egress = {(n.name, i.ifname): i.egress.wall_rate_bps for n in plan.nodes
              for i in n.interfaces}
    load = [sum(i.egress.wall_rate_bps for i in n.interfaces) for n in plan.nodes]
    edges = [(link.index, index[link.a.node], index[link.b.node],
              egress.get((link.a.node, link.a.ifname), link.wall_rate_bps),
              egress.get((link.b.node, link.b.ifname), link.wall_rate_bps))
             for link in plan.links]
    return _Graph(names, load, edges)


def node_groups(plan: Plan) -> list[list[str]]:
    """Nodes that move together: each switch with the hosts whose every link goes to it,
    then every other node alone; in plan order."""
    neighbours: dict[str, set[str]] = {n.name: set() for n in plan.nodes}
    for link in plan.links:
        neighbours[link.a.node].add(link.b.node)
        neighbours[link.b.node].add(link.a.node)
    roles = {n.name: n.role for n in plan.nodes}
    owner = {n.name: next(iter(neighbours[n.name])) for n in plan.hosts()
             if len(neighbours[n.name]) == 1
             and roles[next(iter(neighbours[n.name]))] == "switch"}
    groups: list[list[str]] = []
    for node in plan.nodes:
        if node.role == "switch":
            groups.append([node.name] + [h.name for h in plan.hosts()
                                         if owner.get(h.name) == node.name])
        elif node.name not in owner:
            groups.append([node.name])
    return groups


class _Problem:
    """The cost of assignments of nodes to VMs (an index per node, -1: not placed yet)."""

    def __init__(self, graph: _Graph, vms_file: VmsFile) -> None:
        self.graph = graph
        self.budgets = [vm.wall_rate_budget_bps for vm in vms_file.vms]
        self.rooms = [vm.cores * vms_file.nodes_per_core for vm in vms_file.vms]
        self.imbalance = vms_file.imbalance
        self.node_total = sum(graph.load)

    def loads(self, assign: list[int]) -> tuple[list[int], list[int], list[int], int, int]:
        """Per VM: nodes, node load, tunnel load; and links cut, their wall rate."""
        k = len(self.budgets)
        count, node_load, tunnel_load = [0] * k, [0] * k, [0] * k
        for n, v in enumerate(assign):
            if v >= 0:
                count[v] += 1
                node_load[v] += self.graph.load[n]
        cut = cut_bps = 0
        for _, a, b, rate_a, rate_b in self.graph.edges:
            va, vb = assign[a], assign[b]
            if va >= 0 and vb >= 0 and va != vb:
                cut += 1
                cut_bps += rate_a + rate_b
                tunnel_load[va] += rate_a
                tunnel_load[vb] += rate_b
        return count, node_load, tunnel_load, cut, cut_bps

    def targets(self, total: int) -> list[float]:
        budget = sum(self.budgets)
        return [total * b / budget for b in self.budgets]

    def cost(self, assign: list[int]) -> Cost:
        count, node_load, tunnel_load, cut, cut_bps = self.loads(assign)
        load = [a + b for a, b in zip(node_load, tunnel_load, strict=True)]
        # unplaced nodes (greedy) still count in the total, so early VMs do not overfill
        targets = self.targets(self.node_total + sum(tunnel_load))
        over_room = sum(max(0, c - r) for c, r in zip(count, self.rooms, strict=True))
        over_share = sum(max(0.0, x - (1 + self.imbalance) * t)
                         for x, t in zip(load, targets, strict=True))
        peak = max(x * 10**6 // b for x, b in zip(load, self.budgets, strict=True))
        return over_room, round(over_share), cut, cut_bps, peak


def _expand(groups: list[list[int]], vector: tuple[int, ...] | list[int], n: int) -> list[int]:
    assign = [-1] * n
    for group, v in zip(groups, vector, strict=True):
        for node in group:
            assign[node] = v
    return assign


def _exhaustive(problem: _Problem, groups: list[list[int]], k: int) -> list[int]:
    n = len(problem.graph.names)
    best: tuple[Cost, list[int]] | None = None
    for vector in itertools.product(range(k), repeat=len(groups)):   # lexicographic order
        assign = _expand(groups, vector, n)
        cost = problem.cost(assign)
        if best is None or cost < best[0]:
            best = (cost, assign)
    assert best is not None
    return best[1]


def _greedy(problem: _Problem, groups: list[list[int]], k: int) -> list[int]:
    n = len(problem.graph.names)
    assign = [-1] * n
    weight = [sum(problem.graph.load[m] for m in g) for g in groups]
    for gi in sorted(range(len(groups)), key=lambda i: (-weight[i], i)):
        choices = []
        for v in range(k):
            for m in groups[gi]:
                assign[m] = v
            choices.append((problem.cost(assign), v))
        chosen = min(choices)[1]
        for m in groups[gi]:
            assign[m] = chosen
    return assign


def _refine(problem: _Problem, groups: list[list[int]], k: int, assign: list[int]) -> list[int]:
    """Move passes, then exchanges of two groups (which keep a tight balance that single
    moves must break first), again and again until neither gains."""
    best = _passes(problem, groups, k, assign)
    while len(groups) <= SWAP_LIMIT:
        swapped = _swaps(problem, groups, best)
        if swapped is None:
            break
        best = _passes(problem, groups, k, swapped)
    return best


def _swaps(problem: _Problem, groups: list[list[int]], assign: list[int]) -> list[int] | None:
    """The best exchange of two groups on different VMs, if it lowers the cost."""
    base = problem.cost(assign)
    found: tuple[Cost, int, int, list[int]] | None = None
    for gi, gj in itertools.combinations(range(len(groups)), 2):
        vi, vj = assign[groups[gi][0]], assign[groups[gj][0]]
        if vi == vj:
            continue
        trial = list(assign)
        for m in groups[gi]:
            trial[m] = vj
        for m in groups[gj]:
            trial[m] = vi
        cost = problem.cost(trial)
        if cost < base and (found is None or cost < found[0]):
            found = (cost, gi, gj, trial)
    return found[3] if found else None


def _passes(problem: _Problem, groups: list[list[int]], k: int, assign: list[int]) -> list[int]:
    """Kernighan-Lin / Fiduccia-Mattheyses passes over group moves; the best found."""
    best, best_cost = list(assign), problem.cost(assign)
    for _ in range(MAX_PASSES):
        current = list(best)
        moved: set[int] = set()
        pass_best, pass_cost = None, best_cost
        for _step in range(len(groups)):
            candidates = []
            for gi, group in enumerate(groups):
                if gi in moved:
                    continue
                here = current[group[0]]
                for v in range(k):
                    if v == here:
                        continue
                    trial = list(current)
                    for m in group:
                        trial[m] = v
                    candidates.append((problem.cost(trial), gi, v, trial))
            if not candidates:
                break
            cost, gi, _v, trial = min(candidates, key=lambda c: (c[0], c[1], c[2]))
            current = trial
            moved.add(gi)
            if cost < pass_cost:
                pass_best, pass_cost = list(current), cost
        if pass_best is None:
            break
        best, best_cost = pass_best, pass_cost
    return best


def _grown(problem: _Problem, groups: list[list[int]], k: int) -> list[int]:
    """Graph growing: walk the groups breadth first from the first one (neighbours by
    link), filling each VM up to its target before the next; few links cross."""
    n = len(problem.graph.names)
    group_of = {m: gi for gi, g in enumerate(groups) for m in g}
    near: list[list[int]] = [[] for _ in groups]
    for _, a, b, _ra, _rb in problem.graph.edges:
        ga, gb = group_of[a], group_of[b]
        if ga != gb:
            near[ga].append(gb)
            near[gb].append(ga)
    order: list[int] = []
    seen: set[int] = set()
    for root in range(len(groups)):
        queue = [root] if root not in seen else []
        seen.add(root)
        while queue:
            gi = queue.pop(0)
            order.append(gi)
            for other in sorted(set(near[gi])):
                if other not in seen:
                    seen.add(other)
                    queue.append(other)
    targets = problem.targets(problem.node_total)
    assign, v, filled = [-1] * n, 0, 0
    for gi in order:
        weight = sum(problem.graph.load[m] for m in groups[gi])
        if v < k - 1 and filled and filled + weight / 2 > targets[v]:
            v, filled = v + 1, 0
        for m in groups[gi]:
            assign[m] = v
        filled += weight
    return assign


def _spread(problem: _Problem, groups: list[list[int]], k: int) -> list[int]:
    """Longest processing time first: each group, heaviest first, to the VM whose load
    over budget stays lowest (balance only; the refinement then mends the cut)."""
    assign = [-1] * len(problem.graph.names)
    filled = [0] * k
    weight = [sum(problem.graph.load[m] for m in g) for g in groups]
    for gi in sorted(range(len(groups)), key=lambda i: (-weight[i], i)):
        v = min(range(k), key=lambda u: ((filled[u] + weight[gi]) / problem.budgets[u], u))
        filled[v] += weight[gi]
        for m in groups[gi]:
            assign[m] = v
    return assign


def _search(problem: _Problem, groups: list[list[int]], k: int,
            start: list[int] | None, exhaustive_limit: int) -> tuple[list[int], str]:
    """Every assignment when there are few; else the best of refining a few starts (the
    given one, the greedy, graph growing, longest processing time first)."""
    if k ** len(groups) <= exhaustive_limit:
        return _exhaustive(problem, groups, k), "exhaustive"
    starts = [start] if start is not None else []
    starts += [_greedy(problem, groups, k), _grown(problem, groups, k),
               _spread(problem, groups, k)]
    refined = [_refine(problem, groups, k, s) for s in starts]
    return min(refined, key=lambda a: (problem.cost(a), a)), "greedy+kl"


def _canonical(problem: _Problem, assign: list[int]) -> list[int]:
    """The same placement with interchangeable VMs (equal budget and room: the cost cannot
    tell them apart) renamed so that, in plan order, nodes meet them in the file's order."""
    kinds = list(zip(problem.budgets, problem.rooms, strict=True))
    rename: dict[int, int] = {}
    for v in assign:
        if v not in rename:
            rename[v] = next(u for u in range(len(kinds))
                             if kinds[u] == kinds[v] and u not in rename.values())
    return [rename[v] for v in assign]


def partition(plan: Plan, vms_file: VmsFile, *, fabric_file: str = "the fabric config",
              exhaustive_limit: int = EXHAUSTIVE_LIMIT) -> Placement:
    """Place every node of `plan` on one of `vms_file`'s VMs; the tunnels of the cut links.

    PartitionError if the VMs cannot carry the plan (run check_vms_for_fabric first for
    the same words at the VMs file's lines). `exhaustive_limit` 0 forces the heuristic."""
    problems = vms_fabric_problems(vms_file, fabric_file=fabric_file,
                                   fabric_mtu_bytes=plan.mtu_bytes,
                                   roce_mtu_bytes=plan.roce_mtu_bytes,
                                   n_links=len(plan.links), n_nodes=len(plan.nodes))
    if problems:
        raise PartitionError("; ".join(message for _, message in problems))
    graph = _graph(plan)
    problem = _Problem(graph, vms_file)
    k = len(vms_file.vms)
    index = {name: i for i, name in enumerate(graph.names)}
    named_groups = node_groups(plan)
    room = max(problem.rooms)
    if any(len(g) > room for g in named_groups):     # a group no VM can hold: split it
        named_groups = [[name] for g in named_groups for name in g]
    groups = [[index[name] for name in g] for g in named_groups]
    assign, algorithm = _search(problem, groups, k, None, exhaustive_limit)
    cost = problem.cost(assign)
    singles = [[i] for i in range(len(graph.names))]
    if (cost[0] or cost[1]) and len(groups) < len(singles):
        finer, _ = _search(problem, singles, k, assign, exhaustive_limit)
        if problem.cost(finer) < cost:
            assign, algorithm, cost = finer, algorithm + "+nodes", problem.cost(finer)
    assign = _canonical(problem, assign)
    return _placement(plan, vms_file, graph, problem, named_groups, assign, algorithm, cost)


def _placement(plan: Plan, vms_file: VmsFile, graph: _Graph, problem: _Problem,
               groups: list[list[str]], assign: list[int], algorithm: str,
               cost: Cost) -> Placement:
    _count, node_load, tunnel_load, cut, cut_bps = problem.loads(assign)
    load = [a + b for a, b in zip(node_load, tunnel_load, strict=True)]
    total = sum(load)
    targets = problem.targets(total)
    vms = vms_file.vms
    shares = [VmShare(name=vm.name, underlay=str(vm.underlay), cores=vm.cores,
                      nodes=[graph.names[n] for n, v in enumerate(assign) if v == i],
                      node_room=problem.rooms[i], node_wall_bps=node_load[i],
                      tunnel_wall_bps=tunnel_load[i], load_wall_bps=load[i],
                      target_wall_bps=round(targets[i]),
                      budget_wall_bps=vm.wall_rate_budget_bps,
                      share=round(load[i] / total, 6) if total else 0.0,
                      utilisation=round(load[i] / vm.wall_rate_budget_bps, 6))
              for i, vm in enumerate(vms)]
    tunnels = []
    for link in plan.links:
        a, b = graph.names.index(link.a.node), graph.names.index(link.b.node)
        va, vb = assign[a], assign[b]
        if va == vb:
            continue
        rates = next((ra, rb) for li, _, _, ra, rb in graph.edges if li == link.index)
        tunnels.append(TunnelPlan(
            link=link.index, vni=vms_file.vni_base + link.index, udp_port=VXLAN_UDP_PORT,
            a=TunnelEnd(node=link.a.node, ifname=link.a.ifname, vm=vms[va].name,
                        underlay=str(vms[va].underlay), wall_rate_bps=rates[0]),
            b=TunnelEnd(node=link.b.node, ifname=link.b.ifname, vm=vms[vb].name,
                        underlay=str(vms[vb].underlay), wall_rate_bps=rates[1])))
    need = underlay_mtu_bytes(plan.mtu_bytes)
    warnings = []
    if cost[1]:
        warnings.append(f"no placement found keeps every VM within {vms_file.imbalance:.0%} "
                        "of its share of the load (see each VM's load and target); add VMs, "
                        "or raise imbalance: to accept it")
    for share in shares:
        if share.utilisation > 1:
            warnings.append(f"{share.name} carries {format_rate(share.load_wall_bps)} of wall "
                            f"rate, {share.utilisation:.0%} of its budget "
                            f"{format_rate(share.budget_wall_bps)}: add a VM, or raise the "
                            "dilation (dilation:) so every port's wall rate falls")
        if not share.nodes:
            warnings.append(f"{share.name} gets no node")
    with_tunnels = {t.a.vm for t in tunnels} | {t.b.vm for t in tunnels}
    for vm in vms:
        if vm.name in with_tunnels and vm.mtu_bytes is None:
            warnings.append(f"{vm.name}'s underlay MTU is not given (mtu:): its tunnels need "
                            f"{need}; check it before up (Ansible's facts give it)")
    return Placement(
        lab=plan.lab, algorithm=algorithm, groups=groups,
        nodes={graph.names[n]: vms[v].name for n, v in enumerate(assign)}, vms=shares,
        tunnels=tunnels, cut_links=cut, cut_wall_bps=cut_bps, total_load_wall_bps=total,
        fabric_mtu_bytes=plan.mtu_bytes, vxlan_overhead_bytes=VXLAN_OVERHEAD_BYTES,
        underlay_mtu_bytes=need, vni_base=vms_file.vni_base, imbalance=vms_file.imbalance,
        balanced=cost[1] == 0, warnings=warnings)
