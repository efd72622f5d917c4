"""Per-port queues: HTB root at the port rate, one class per traffic class
selected by DSCP, a byte-limited FIFO leaf holding each class's buffer.

A class marked by sch_red (ecn marker red) has a RED qdisc hold its buffer instead:
as the class's leaf, or, for a PFC class, as the child of its TBF gate (HTB class ->
TBF -> RED -> RED's own bfifo), so the gate still stops the whole class and RED sees
the class's real queue, paused or not. A TBF change (the PFC agent's open and close)
leaves a non-fifo child alone (fifo_set_limit only touches fifos).

Messages are built from plan objects through pyroute2 (no tc strings).
pyroute2 has no bfifo plugin; bfifo's options are the same `tc_fifo_qopt`
as pfifo's (a 32-bit limit, in bytes instead of packets), so the pfifo
plugin is registered under the bfifo name. It has no red plugin either:
testbed/net/sched_red.py is one, registered as "red".
"""

from __future__ import annotations

from pyroute2.netlink.rtnl.tcmsg import plugins as _tc_plugins
from pyroute2.netlink.rtnl.tcmsg import sched_pfifo as _sched_pfifo

from testbed.net import sched_red as _sched_red
from testbed.plan.model import EgressPlan, RedPlan
from testbed.plan.red import IDLE_SHIFT, RED_FLAGS, RED_STAB_SIZE

_tc_plugins.setdefault("bfifo", _sched_pfifo)
_tc_plugins.setdefault("red", _sched_red)

ETH_P_IP = 0x0800
HTB_ROOT = 0x10000          # "1:"
HTB_PORT_CLASS = 0x10001    # "1:1"
# u32 filter priority for DSCP matches; one filter per DSCP value.
DSCP_FILTER_PRIO = 10


def parse_handle(text: str) -> int:
    """'1:13' -> 0x10013, '113:' -> 0x1130000."""
    major, _, minor = text.partition(":")
    return (int(major, 16) << 16) | (int(minor, 16) if minor else 0)


def dscp_key(dscp: int) -> str:
    # First 32-bit word of the IPv4 header: version/IHL, TOS, total length.
    # DSCP is the top six bits of TOS; ECN bits are masked out.
    return f"0x{dscp << 18:08x}/0x00fc0000+0"


def tbf_gate(egress: EgressPlan, limit_bytes: int) -> dict:
    """TBF parameters of an open class gate: the port rate and burst.

    The PFC agent closes and reopens it (agents/pfc/gate.py says how and why).
    The limit is the class's buffer: the port program refuses what would pass it
    (it owns tail drop), so the leaf never drops on its own.
    """
    return {"rate": f"{egress.wall_rate_bps}bit", "burst": egress.burst_bytes,
            "limit": limit_bytes}


def red_options(red: RedPlan) -> dict:
    """The red plugin's arguments for a planned RED marker (testbed/plan/red.py)."""
    return {"parent": parse_handle(red.parent), "limit": red.limit_bytes,
            "qth_min": red.qth_min_bytes, "qth_max": red.qth_max_bytes,
            "max_p": red.max_p_fp, "plog": red.plog, "wlog": 0, "scell_log": 0,
            "red_stab": bytes([IDLE_SHIFT]) * RED_STAB_SIZE, "flags": RED_FLAGS}


def install_port_queues(ipr, ifindex: int, egress: EgressPlan) -> int:
    """Build the HTB tree of one port; returns the number of netlink requests sent."""
    requests = 0
    ipr.tc("add", "htb", ifindex, HTB_ROOT, default=parse_handle(egress.default_classid) & 0xFFFF,
           r2q=10)
    requests += 1
    ipr.tc("add-class", "htb", ifindex, HTB_PORT_CLASS, parent=HTB_ROOT,
           rate=egress.wall_rate_bps // 8, ceil=egress.wall_rate_bps // 8,
           burst=egress.burst_bytes, cburst=egress.burst_bytes,
           overhead=egress.overhead_bytes, quantum=egress.quantum_bytes)
    requests += 1
    for cls in egress.classes:
        classid = parse_handle(cls.classid)
        ipr.tc("add-class", "htb", ifindex, classid, parent=HTB_PORT_CLASS,
               rate=cls.wall_rate_bps // 8, ceil=cls.wall_ceil_bps // 8, prio=cls.prio,
               burst=egress.burst_bytes, cburst=egress.burst_bytes,
               overhead=egress.overhead_bytes, quantum=egress.quantum_bytes)
        if cls.leaf_kind == "tbf":
            ipr.tc("add", "tbf", ifindex, parse_handle(cls.leaf_handle), parent=classid,
                   **tbf_gate(egress, cls.limit_bytes))
        elif cls.leaf_kind != "red":
            ipr.tc("add", "bfifo", ifindex, parse_handle(cls.leaf_handle), parent=classid,
                   limit=cls.limit_bytes)
        requests += 1 if cls.leaf_kind == "red" else 2
        if cls.red is not None:
            ipr.tc("add", "red", ifindex, parse_handle(cls.red.handle), **red_options(cls.red))
            requests += 1
        for dscp in cls.dscp:
            ipr.tc("add-filter", "u32", ifindex, parent=HTB_ROOT, prio=DSCP_FILTER_PRIO,
                   protocol=ETH_P_IP, target=classid, keys=[dscp_key(dscp)])
            requests += 1
    return requests
