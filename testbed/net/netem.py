"""Link delay and PHY loss: a netem stage on the receiving end of every link.

Where the running kernel has sch_netem (and IFB devices), each link direction
carries its PHY's propagation + FEC delay, dilated (the plan's timebase turns
the link's fabric `delay_ns` into wall time), and loses the PHY's frame-loss
share. For the port P at one end of a link, whose veth peer is Q in the other
node's namespace:

    P: HTB tree, port_egress ──veth──> Q: clsact ingress
                                          prio FILTER_PRIO    port_departure (counts the
                                                              packet as departed from P)
                                          prio FILTER_PRIO+1  u32 match-all, mirred egress
                                                              redirect to the IFB of Q
                                       IFB (in Q's namespace): root qdisc netem
                                          delay = the link's dilated delay, no jitter,
                                          loss = the PHY frame-loss share
                                       -> back into Q's receive path (tc skipped)

Why there and not on P's egress tree. The class queues, the port program's
queue (admitted at P - departed at Q's ingress, exact) and PFC all see the
egress port exactly as without netem: a netem leaf under HTB would hold every
packet for the delay inside the port's queue, so the backlog, the decision
queue and the PFC thresholds would include bytes that are on the wire. Here a
packet is "on the wire" between its departure and its arrival, and the bytes a
netem holds are counted as such (`wire_backlog_*`), never as queue. PFC frames
crossing the link in the other direction are delayed too, as on a real link:
the PFC agent's socket binds ETH_P_8808, which is delivered after tc ingress
and so after the delay. Packet taps (captures, any ETH_P_ALL socket) on Q are
delivered before tc ingress: they see a packet when it departs P, before the
delay. An IFB hands the packet back to Q's receive path with tc classification
skipped (`skb->tc_skip_classify`), so neither the departure program nor the
redirect runs twice, and taps do not see it a second time.

The departure program must return TC_ACT_UNSPEC for the chain to go on to the
redirect (port.bpf.c). Drops by netem (PHY loss, or its packet limit) are
sampled per port as `wire_drops` and are a counted place of lost packets in the
run's conservation check (testbed/run/invariants.py).

Precision: netem's delay is given in ns (TCA_NETEM_LATENCY64; the tick field
beside it, for kernels before 4.15, is whole us); its loss in steps of 2^-32.
Each IFB is named after the interface it serves (`ifb_name`), unique in that
namespace and within IFNAMSIZ. Messages are built by pyroute2 (its netem, u32
and mirred plugins); no tc strings.
"""

from __future__ import annotations

import errno
import hashlib
import math
import types
from dataclasses import dataclass

from pyroute2.netlink.rtnl import RTM_DELLINK, RTM_NEWLINK
from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg
from pyroute2.netlink.rtnl.tcmsg import plugins as _tc_plugins
from pyroute2.netlink.rtnl.tcmsg import sched_netem as _sched_netem
from pyroute2.netlink.rtnl.tcmsg.common import tick_in_usec

from testbed.net.batch import (
    CREATE,
    NLM_F_ACK,
    NLM_F_REQUEST,
    BatchedTc,
    NetlinkBatch,
    RequestError,
    TcTemplates,
    _encode,
    dump_link_indexes,
)
from testbed.net.portprog import CLSACT_INGRESS, ETH_P_ALL, FILTER_PRIO
from testbed.plan.model import Plan

IFNAMSIZ = 16                 # including the terminating NUL: names of at most 15
IFB_PREFIX = "ifb"            # "ifb" + the interface's name, when that fits
IFB_HASH_PREFIX = "ifh"       # "ifh" + 12 hex digits of its hash, when it does not
NETEM_HANDLE = 0x10000        # "1:", the IFB's root
NETEM_FILTER_PRIO = FILTER_PRIO + 1
NETEM_FILTER_HANDLE = 1
MIN_FRAME_BYTES = 64          # the smallest Ethernet frame: most packets in flight
LIMIT_MARGIN = 4              # x the packets a link can have in flight
MIN_LIMIT_PACKETS = 1000      # netem's own default
MATCH_ALL = "0x0/0x0+0"       # a u32 key every packet matches
PROBE_IFB = "tbprobeifb0"


class _NetemOptions(_sched_netem.options):
    """pyroute2's netem options, with the attributes it does not list (up to
    TCA_NETEM_LATENCY64, the delay in ns)."""

    nla_map = (
        ('TCA_NETEM_UNSPEC', 'none'),
        ('TCA_NETEM_CORR', 'netem_corr'),
        ('TCA_NETEM_DELAY_DIST', 'none'),
        ('TCA_NETEM_REORDER', 'netem_reorder'),
        ('TCA_NETEM_CORRUPT', 'netem_corrupt'),
        ('TCA_NETEM_LOSS', 'none'),
        ('TCA_NETEM_RATE', 'netem_rate'),
        ('TCA_NETEM_ECN', 'uint32'),
        ('TCA_NETEM_RATE64', 'uint64'),
        ('TCA_NETEM_PAD', 'none'),
        ('TCA_NETEM_LATENCY64', 'int64'),
        ('TCA_NETEM_JITTER64', 'int64'),
    )


def _netem_parameters(kwarg: dict) -> dict:
    """pyroute2's netem parameters, plus `delay_ns` as TCA_NETEM_LATENCY64 (pyroute2's
    `delay` is whole us and its tick conversion yields a float the struct refuses)."""
    delay_ns = int(kwarg.pop("delay_ns", 0))
    opts = _sched_netem.get_parameters({**kwarg, "delay": 0})
    opts["delay"] = int(delay_ns // 1000 * tick_in_usec)
    opts["jitter"] = 0
    opts["attrs"].append(["TCA_NETEM_LATENCY64", delay_ns])
    return opts


# Registered under netem's own name: the kind is what the kernel reads. Only this
# module (and the probe) sends netem requests.
_tc_plugins["netem"] = types.SimpleNamespace(parent=_sched_netem.parent,
                                             get_parameters=_netem_parameters,
                                             options=_NetemOptions)


@dataclass(frozen=True)
class WireStage:
    """One link direction's delay stage: what the port `node`:`port` sends is delayed
    and may be lost by a netem on the IFB `ifb` in `rx_node`'s namespace, which
    `rx_ifname` (the port's veth peer) redirects its arrivals to."""

    node: str
    port: str
    rx_node: str
    rx_netns: str
    rx_ifname: str
    ifb: str
    wall_delay_ns: int
    loss_ratio: float
    limit_packets: int

    def netem_kwargs(self) -> dict:
        """`IPRoute.tc("add", "netem", ifb_index, NETEM_HANDLE, **kwargs)`."""
        return {"delay_ns": self.wall_delay_ns, "limit": self.limit_packets,
                "loss": self.loss_ratio * 100}


def ifb_name(ifname: str) -> str:
    """The IFB serving `ifname`'s arrivals: "ifb" + ifname if that fits IFNAMSIZ,
    else "ifh" + 12 hex digits of ifname's hash (a different prefix, so a short
    name and a hashed one never meet)."""
    name = IFB_PREFIX + ifname
    if len(name) < IFNAMSIZ:
        return name
    return IFB_HASH_PREFIX + hashlib.sha256(ifname.encode()).hexdigest()[:IFNAMSIZ - 4]


def limit_packets(wall_rate_bps: int, wall_delay_ns: int, burst_bytes: int = 0) -> int:
    """netem's packet limit for one link direction: what the port can have in flight
    (its wall rate x the delay, plus a burst), counted in the smallest frames, times
    LIMIT_MARGIN; at least MIN_LIMIT_PACKETS."""
    in_flight_bytes = wall_rate_bps * wall_delay_ns / 8e9 + burst_bytes
    return max(MIN_LIMIT_PACKETS, math.ceil(LIMIT_MARGIN * in_flight_bytes / MIN_FRAME_BYTES))


def wire_stages(plan: Plan) -> list[WireStage]:
    """Every link direction's stage, by sending port, in plan order. The delay is the
    link's fabric delay through the plan's timebase; the loss its PHY frame-loss ratio
    (impairments stay with the port program)."""
    timebase = plan.timebase
    netns = {n.name: n.netns for n in plan.nodes}
    out = []
    for node in plan.nodes:
        for iface in node.interfaces:
            link = plan.links[iface.link]
            wall_delay_ns = timebase.to_wall_ns(link.delay_ns)
            out.append(WireStage(
                node=node.name, port=iface.ifname, rx_node=iface.peer.node,
                rx_netns=netns[iface.peer.node], rx_ifname=iface.peer.ifname,
                ifb=ifb_name(iface.peer.ifname), wall_delay_ns=wall_delay_ns,
                loss_ratio=link.frame_loss_ratio,
                limit_packets=limit_packets(iface.egress.wall_rate_bps, wall_delay_ns,
                                            iface.egress.burst_bytes)))
    check_names(plan, out)
    return out


def check_names(plan: Plan, stages: list[WireStage]) -> None:
    """Each IFB name is unique in its namespace, fits IFNAMSIZ and is no port's name."""
    ports = {(n.name, i.ifname) for n in plan.nodes for i in n.interfaces}
    seen: dict[tuple[str, str], str] = {}
    for s in stages:
        key = (s.rx_node, s.ifb)
        if len(s.ifb) >= IFNAMSIZ:
            raise ValueError(f"{s.rx_node}: IFB name {s.ifb!r} is longer than IFNAMSIZ allows")
        if key in ports:
            raise ValueError(f"{s.rx_node}: IFB name {s.ifb!r} is also a port's name")
        if key in seen:
            raise ValueError(f"{s.rx_node}: IFB name {s.ifb!r} serves both {seen[key]} and "
                             f"{s.rx_ifname}")
        seen[key] = s.rx_ifname


def stages_by_rx_node(stages: list[WireStage]) -> dict[str, list[WireStage]]:
    out: dict[str, list[WireStage]] = {}
    for s in stages:
        out.setdefault(s.rx_node, []).append(s)
    return out


# --- messages ----------------------------------------------------------------------------


def ifb_message(ifname: str) -> bytes:
    """Create an IFB device (`ip link add NAME type ifb`), up from the start (it only
    ever carries what a redirect hands it)."""
    msg = ifinfmsg()
    msg["flags"], msg["change"] = 1, 1      # IFF_UP
    msg["attrs"] = [("IFLA_IFNAME", ifname),
                    ("IFLA_LINKINFO", {"attrs": [("IFLA_INFO_KIND", "ifb")]})]
    return _encode(msg, RTM_NEWLINK, CREATE)


def delete_link_message(ifname: str) -> bytes:
    msg = ifinfmsg()
    msg["attrs"] = [("IFLA_IFNAME", ifname)]
    return _encode(msg, RTM_DELLINK, NLM_F_REQUEST | NLM_F_ACK)


def redirect_filter_kwargs(to_ifindex: int) -> dict:
    """`IPRoute.tc("add-filter", "u32", rx_index, **kwargs)`: every frame arriving at the
    interface, after the departure program, leaves by `to_ifindex`'s egress (its IFB's
    here; the other device of a VM's tunnel end in tunnel.py)."""
    return {"parent": CLSACT_INGRESS, "prio": NETEM_FILTER_PRIO, "protocol": ETH_P_ALL,
            "target": 0, "keys": [MATCH_ALL],
            "action": {"kind": "mirred", "direction": "egress", "action": "redirect",
                       "ifindex": to_ifindex}}


def install_stage(ipr, stage: WireStage, rx_index: int, ifb_index: int,
                  clsact: bool = False) -> int:
    """Queue one stage's tc requests on `ipr` (an IPRoute or a batch.BatchedTc): the
    netem on the IFB, the clsact on the receiving interface if `clsact` (none there:
    no port programs), the redirect. Returns the number of requests."""
    ipr.tc("add", "netem", ifb_index, NETEM_HANDLE, **stage.netem_kwargs())
    if clsact:
        ipr.tc("add", "clsact", rx_index)
    ipr.tc("add-filter", "u32", rx_index, **redirect_filter_kwargs(ifb_index))
    return 3 if clsact else 2


def unsupported(exc: BaseException) -> bool:
    """Is this kernel refusal a missing feature (no ifb, no sch_netem), not a fault?"""
    return getattr(exc, "code", None) in (errno.EOPNOTSUPP, errno.ENOENT, errno.EINVAL,
                                          errno.ENODEV)


def preflight(sock, node: str) -> str | None:
    """Can this kernel build the stage? Tried for real in a fabric namespace (`sock`,
    a route socket in `node`'s): an IFB with a netem root, removed again. None if it
    can, else why not (the kernel's words)."""
    batch = NetlinkBatch(sock, node)
    batch.add(ifb_message(PROBE_IFB), f"link add {PROBE_IFB} type ifb")
    try:
        batch.flush()
    except RequestError as exc:
        return f"no IFB devices ({exc.kernel_message or exc})"
    try:
        index = dump_link_indexes(sock, node)[PROBE_IFB]
        with TcTemplates() as templates:
            BatchedTc(batch, templates, PROBE_IFB).tc(
                "add", "netem", index, NETEM_HANDLE, delay_ns=1000, limit=MIN_LIMIT_PACKETS,
                loss=0.0)
            try:
                batch.flush()
            except RequestError as exc:
                return f"no sch_netem ({exc.kernel_message or exc})"
    finally:
        batch.add(delete_link_message(PROBE_IFB), f"link del {PROBE_IFB}")
        batch.flush()
    return None
