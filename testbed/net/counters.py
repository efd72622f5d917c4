"""Read kernel counters of a lab: per interface, and per HTB class of each port."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pyroute2 import IPRoute

from testbed.plan.model import Plan


@dataclass(frozen=True)
class InterfaceCounters:
    node: str
    ifname: str
    tx_bytes: int
    tx_packets: int
    rx_bytes: int
    rx_packets: int
    tx_dropped: int
    rx_dropped: int


@dataclass(frozen=True)
class ClassCounters:
    node: str
    ifname: str
    tc: int
    classid: str
    bytes: int
    packets: int
    drops: int
    backlog_bytes: int
    backlog_packets: int


def _handle_str(handle: int) -> str:
    return f"{handle >> 16:x}:{handle & 0xFFFF:x}"


def read_counters(plan: Plan) -> tuple[list[InterfaceCounters], list[ClassCounters]]:
    """One snapshot of every fabric interface and traffic class of the lab."""
    ifaces: list[InterfaceCounters] = []
    classes: list[ClassCounters] = []
    for node in plan.nodes:
        tc_of = {}
        for iface in node.interfaces:
            for cls in iface.egress.classes:
                tc_of[(iface.ifname, cls.classid)] = cls.tc
        with IPRoute(netns=node.netns) as ipr:
            wanted = {i.ifname for i in node.interfaces}
            for link in ipr.get_links():
                name = link.get_attr("IFLA_IFNAME")
                if name not in wanted:
                    continue
                st = link.get_attr("IFLA_STATS64") or {}
                ifaces.append(InterfaceCounters(
                    node.name, name, st.get("tx_bytes", 0), st.get("tx_packets", 0),
                    st.get("rx_bytes", 0), st.get("rx_packets", 0),
                    st.get("tx_dropped", 0), st.get("rx_dropped", 0)))
                for msg in ipr.get_classes(link["index"]):
                    classid = _handle_str(msg["handle"])
                    if (name, classid) not in tc_of:
                        continue
                    stats2 = msg.get_attr("TCA_STATS2")
                    basic = stats2.get_attr("TCA_STATS_BASIC") if stats2 else None
                    queue = stats2.get_attr("TCA_STATS_QUEUE") if stats2 else None
                    classes.append(ClassCounters(
                        node.name, name, tc_of[(name, classid)], classid,
                        basic["bytes"] if basic else 0, basic["packets"] if basic else 0,
                        queue["drops"] if queue else 0, queue["backlog"] if queue else 0,
                        queue["qlen"] if queue else 0))
    ifaces.sort(key=lambda c: (c.node, c.ifname))
    classes.sort(key=lambda c: (c.node, c.ifname, c.tc))
    return ifaces, classes


def counters_as_dicts(plan: Plan) -> dict:
    ifaces, classes = read_counters(plan)
    return {"interfaces": [asdict(c) for c in ifaces], "classes": [asdict(c) for c in classes]}
