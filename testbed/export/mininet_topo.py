"""Export a plan as a Mininet topology module (`testbed export mininet`).

The module written is plain Python for Debian's Mininet 2.3 (system Python): a
`Topo` subclass, a `topos` dict for `mn --custom FILE --topo NAME`, and a `tests`
dict with a host-to-host reachability check. Every node, switches included, is a
Mininet `Host` (a shell in its own namespace): switches are routers with forwarding
on and the plan's routes, so the fabric has no L2 loops and needs no OpenFlow switch
or controller. Links are `TCLink`s: HTB at the link's wall rate, and netem with the
dilated propagation + FEC delay, the PHY frame loss and a queue of the port's buffer,
where the kernel has sch_netem (the Topo's `netem=0` drops that part).

Mininet caps a TCLink's bw at 1000 Mbit/s, so the dilation D is the plan's if every
link fits under it at that D, else the smallest D that makes the fastest link fit.
"""

from __future__ import annotations

import math
import re

from testbed.plan.model import LinkPlan, NodePlan, Plan

MININET_MAX_BW_MBIT = 1000     # TCIntf.bwCmds ignores bw outside 0..1000 Mbit/s
NETEM_MIN_LOSS_PCT = 1e-5      # Mininet writes netem loss as '%.5f'%: smaller is 0


def mininet_dilation(plan: Plan) -> int:
    """The plan's D if every link's rate / D fits Mininet's cap, else the smallest D that
    fits the fastest link."""
    fastest = max((link.rate_bps for link in plan.links), default=0)
    need = math.ceil(fastest / (MININET_MAX_BW_MBIT * 1e6)) if fastest else 1
    return max(plan.dilation.factor, need)


def topo_name(plan: Plan) -> str:
    """The `--topo` name: the lab name (lower-case letters and digits)."""
    return plan.lab


def class_name(plan: Plan) -> str:
    parts = re.split(r"[^0-9A-Za-z]+", plan.lab)
    name = "".join(p[:1].upper() + p[1:] for p in parts if p) or "Fabric"
    return ("T" + name if name[0].isdigit() else name) + "Topo"


def _fmt_bw(bps: float) -> str:
    return f"{bps / 1e6:.6g}"


def _fmt_delay(ns: float) -> str:
    return f"{ns / 1000:.6g}us"


def _route(route) -> str:
    if len(route.nexthops) == 1:
        hop = route.nexthops[0]
        return f"{route.dst} via {hop.gateway} dev {hop.ifname}"
    return f"{route.dst} " + " ".join(f"nexthop via {h.gateway} dev {h.ifname}"
                                      for h in route.nexthops)


def _queue_packets(plan: Plan, node: NodePlan, ifname: str) -> int:
    intf = next(i for i in node.interfaces if i.ifname == ifname)
    buffer_bytes = sum(c.limit_bytes for c in intf.egress.classes)
    return max(1, math.ceil(buffer_bytes / intf.mtu_bytes))


def _link_lines(plan: Plan, link: LinkPlan, d: int, nodes: dict[str, NodePlan]) -> list[str]:
    a, b = nodes[link.a.node], nodes[link.b.node]
    ia = next(i for i in a.interfaces if i.ifname == link.a.ifname)
    ib = next(i for i in b.interfaces if i.ifname == link.b.ifname)
    loss_pct = link.frame_loss_ratio * 100
    queue = max(_queue_packets(plan, a, ia.ifname), _queue_packets(plan, b, ib.ifname))
    loss_note = (f"PHY loss {loss_pct:.3g} %" if loss_pct >= NETEM_MIN_LOSS_PCT else
                 f"PHY loss {loss_pct:.2g} %, below netem's 0.00001 %: left out")
    lines = [
        f"        # link {link.index}: {link.a.node}:{link.a.ifname} - "
        f"{link.b.node}:{link.b.ifname}, {link.port_type} {link.length_m:g} m",
        f"        # {link.rate_bps / 1e9:g} Gb/s, {link.delay_ns} ns one way; {loss_note}",
        f"        self.link({link.a.node!r}, {ia.ifname!r}, {ia.mac!r}, {ia.address!r},",
        f"                  {link.b.node!r}, {ib.ifname!r}, {ib.mac!r}, {ib.address!r},",
        f"                  mtu={ia.mtu_bytes}, bw={_fmt_bw(link.rate_bps / d)}, "
        f"delay={_fmt_delay(link.delay_ns * d)!r}, "
        f"loss={round(loss_pct, 5) if loss_pct >= NETEM_MIN_LOSS_PCT else 0}, "
        f"queue={queue})",
    ]
    return lines


def _node_lines(node: NodePlan) -> list[str]:
    kind = "router" if node.role == "switch" else "host"
    sysctls = "ROUTER_SYSCTLS" if node.role == "switch" else "HOST_SYSCTLS"
    lines = [f"        self.node({node.name!r}, {sysctls}, [   # {kind}"]
    lines += [f"            {_route(r)!r}," for r in node.routes]
    lines.append("        ])")
    return lines


def _dict_lines(name: str, values: dict[str, str], comment: str) -> list[str]:
    return ([f"{name} = {{   # {comment}"] + [f"    {k!r}: {v!r}," for k, v in values.items()]
            + ["}"])


def _sysctls(plan: Plan, role: str) -> dict[str, str]:
    found = [n.sysctls for n in plan.nodes if n.role == role]
    return dict(sorted(found[0].items())) if found else {}


def export_mininet(plan: Plan, source: str = "") -> str:
    """The Mininet topology module for `plan`, as Python source text (deterministic)."""
    d = mininet_dilation(plan)
    fastest = max((link.rate_bps for link in plan.links), default=0)
    name, cls = topo_name(plan), class_name(plan)
    nodes = {n.name: n for n in plan.nodes}
    hosts = [n.name for n in plan.nodes if n.role != "switch"]
    if d == plan.dilation.factor:
        d_note = (f"D={d}, the plan's ({plan.dilation.mode}): the fastest link, "
                  f"{fastest / 1e9:g} Gb/s, is {fastest / d / 1e6:g} Mbit/s")
    else:
        d_note = (f"D={d}, not the plan's {plan.dilation.factor}: Mininet caps a TCLink at "
                  f"{MININET_MAX_BW_MBIT} Mbit/s and the fastest link, {fastest / 1e9:g} Gb/s, "
                  f"needs D >= {d}")
    for node in plan.nodes:     # a role's sysctls are one dict in the file: check that holds
        if node.sysctls != _sysctls(plan, node.role):
            raise ValueError(f"node {node.name}: sysctls differ from other {node.role}s'")
    out = [
        f'"""Mininet topology of fabric {plan.lab!r}, exported by `testbed export mininet`'
        + (f" from {source}" if source else "") + ".",
        "",
        f"{len(hosts)} hosts, {len(plan.nodes) - len(hosts)} switches as routers, "
        f"{len(plan.links)} links. Every node is a Mininet Host",
        "(a shell in its own network namespace); switches are routers (ip_forward on, the",
        "plan's routes, ECMP as multipath routes), so there are no L2 loops and no OpenFlow",
        "switch or controller is needed.",
        "",
        "Run with Debian's Mininet (2.3, /usr/bin/python3):",
        "",
        f"    sudo mn --custom THIS_FILE --topo {name} --controller none --test fabricping",
        f"    sudo mn --custom THIS_FILE --topo {name},netem=0 --controller none"
        "   # kernel without sch_netem",
        "",
        "(drop `--test fabricping` for Mininet's CLI), or `sudo testbed mininet FABRIC.yaml`,",
        "which also leaves the initial namespace's sysctls alone (mn raises some, fixLimits).",
        "",
        f"Time dilation: {d_note}.",
        "Every link is a TCLink: bw = rate / D (Mbit/s, HTB); delay = the PHY's propagation",
        "+ FEC delay x D, loss = the PHY frame loss, queue = the port's buffer in MTU-sized",
        "packets (netem; netem=0 leaves these out).",
        "",
        "Kept: topology, interface names, MACs, addresses, routes, MTU, rates, delays.",
        "Dropped: PFC, BPF ECN marking, per-class queues, agents, counters; run the fabric",
        "with `testbed up` for those.",
        '"""',
        "",
        "from mininet.link import TCLink",
        "from mininet.node import Host",
        "from mininet.topo import Topo",
        "",
        f"D = {d}    # time dilation: wall time runs D times slower than fabric time",
        # (not HOSTS: mn copies every top-level name of a custom file into its own
        # globals, and its HOSTS is the dict of host classes `--host` picks from)
        f"FABRIC_HOSTS = {hosts!r}",
        *_dict_lines("HOST_SYSCTLS", _sysctls(plan, "host"), "hosts: the plan's sysctls"),
        *_dict_lines("ROUTER_SYSCTLS", _sysctls(plan, "switch"),
                     "switches as routers: the plan's sysctls, ip_forward on"),
        "",
        "",
        "class FabricNode(Host):",
        '    """A fabric node: the plan\'s sysctls and routes, once its links are up."""',
        "",
        "    def config(self, sysctls=None, routes=(), **params):",
        "        result = super().config(**params)",
        "        for key, value in (sysctls or {}).items():",
        "            self.cmd(f'sysctl -q -w {key}={value}')",
        "        for route in routes:",
        "            self.cmd('ip route replace ' + route)",
        "        return result",
        "",
        "",
        f"class {cls}(Topo):",
        f'    """Fabric {plan.lab!r}: netem=0 drops delay, loss and queue (no sch_netem);',
        '    routes=0 leaves the routes out."""',
        "",
        "    def build(self, netem=1, routes=1):",
        "        self.netem, self.routes = bool(netem), bool(routes)",
    ]
    for node in plan.nodes:
        out += _node_lines(node)
    for link in plan.links:
        out += _link_lines(plan, link, d, nodes)
    out += [
        "",
        "    def node(self, name, sysctls, routes):",
        "        self.addHost(name, cls=FabricNode, ip=None, sysctls=sysctls,",
        "                     routes=routes if self.routes else ())",
        "",
        "    def link(self, a, a_if, a_mac, a_ip, b, b_if, b_mac, b_ip, mtu, bw, delay, loss,",
        "             queue):",
        "        shape = {'bw': bw}",
        "        if self.netem:",
        "            shape.update(delay=delay, max_queue_size=queue)",
        "            if loss:",
        "                shape['loss'] = loss",
        "        self.addLink(a, b, cls=TCLink, intfName1=a_if, intfName2=b_if, addr1=a_mac,",
        "                     addr2=b_mac, params1={'ip': a_ip, 'ifconfig': f'mtu {mtu}'},",
        "                     params2={'ip': b_ip, 'ifconfig': f'mtu {mtu}'}, **shape)",
        "",
        "",
        "def fabricping(net, tries=3):",
        '    """Every host pings every other host\'s first address; returns the pairs that',
        '    failed (each pair gets `tries` single pings: the first may wait for ARP)."""',
        "    failed = []",
        "    for src in FABRIC_HOSTS:",
        "        for dst in FABRIC_HOSTS:",
        "            if src == dst:",
        "                continue",
        "            ip = net[dst].IP()",
        "            ok = any(' 0% packet loss' in net[src].cmd(f'ping -c1 -W2 {ip}')",
        "                     for _ in range(tries))",
        "            if not ok:",
        "                failed.append((src, dst))",
        "    pairs = len(FABRIC_HOSTS) * (len(FABRIC_HOSTS) - 1)",
        "    print(f'fabricping: {pairs - len(failed)}/{pairs} host pairs reach each other')",
        "    return failed",
        "",
        "",
        f"topos = {{{name!r}: {cls}}}",
        "tests = {'fabricping': fabricping}",
        "",
    ]
    return "\n".join(out)
