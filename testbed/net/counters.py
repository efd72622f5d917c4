"""Read kernel counters of a lab: per interface, and per HTB class of each port."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pyroute2 import IPRoute

from testbed.net import namespaces
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


class QueueProbe:
    """Bytes still queued anywhere in the fabric, from the port programs' maps (kept
    open: a read is a few us per port). A run drains until this is 0."""

    def __init__(self, plan: Plan) -> None:
        from testbed.net import portprog

        self.ports = []
        for node in plan.nodes:
            classes = {i.ifname: [c.tc for c in i.egress.classes] for i in node.interfaces}
            self.ports += [(maps, classes[ifname])
                           for ifname, maps in portprog.open_node_ports(plan.lab, node)]

    def queued_bytes(self) -> int:
        return sum(maps.vq_bytes(tc) for maps, tcs in self.ports for tc in tcs)

    def close(self) -> None:
        for maps, _tcs in self.ports:
            maps.close()
        self.ports.clear()


UDP_ERRORS = ("RcvbufErrors", "InErrors", "NoPorts")


def udp_errors(plan: Plan) -> dict[str, dict[str, int]]:
    """Per host: the namespace's UDP receive errors (/proc/net/snmp `Udp:` line):
    RcvbufErrors (a socket's receive buffer was full: the packet was dropped at the
    host, not by the fabric), InErrors, and NoPorts (nobody listened: a datagram that
    arrived after its receiver stopped). Read from a thread inside each namespace
    (/proc/thread-self/net is the thread's namespace's)."""
    out: dict[str, dict[str, int]] = {}
    for host in plan.hosts():
        try:
            with namespaces.inside(host.netns):
                with open("/proc/thread-self/net/snmp") as fh:
                    lines = [line.split() for line in fh if line.startswith("Udp:")]
        except (OSError, ValueError):
            continue
        if len(lines) >= 2:
            values = dict(zip(lines[0][1:], lines[1][1:], strict=False))
            out[host.name] = {k: int(values.get(k, 0)) for k in UDP_ERRORS}
    return out


def datapath_snapshot(plan: Plan) -> dict:
    """Everything the port programs counted, at one moment (the end of a run), as JSON data:
    per port and class their counters; per node the buffer model's state, per (lossless
    class, ingress port) the accounting and its peaks; drops by flow."""
    from testbed.net import portprog

    ports: list[dict] = []
    nodes: list[dict] = []
    flows: list[dict] = []
    for node in plan.nodes:
        classes = {i.ifname: [c.tc for c in i.egress.classes] for i in node.interfaces}
        for ifname, maps in portprog.open_node_ports(plan.lab, node):
            try:
                counters = maps.read()
            finally:
                maps.close()
            ports += [{"node": node.name, "port": ifname, "tclass": tc,
                       **counters[tc]._asdict()} for tc in classes[ifname]]
        try:
            nm = portprog.open_node(plan.lab, node.name)
        except (OSError, portprog.PortProgError):
            continue
        try:
            if node.buffer.tracked:
                head = nm.head()
                ingress = []
                for t, tc in enumerate(node.buffer.tracked):
                    for slot, iface in enumerate(node.interfaces, start=1):
                        a = nm.acct(t, slot)
                        ingress.append({"port": iface.ifname, "tclass": tc, **a._asdict()})
                nodes.append({"node": node.name, **head._asdict(), "ingress": ingress})
            # every node's drops by flow: a switch's, and a host NIC's (PHY loss, tail drop)
            for key, (phy, tail, mmu, desc) in nm.flow_drops().items():
                saddr, daddr, sport, dport, proto, tc = key
                flows.append({"node": node.name, "saddr": saddr, "daddr": daddr,
                              "sport": sport, "dport": dport, "proto": proto, "tclass": tc,
                              "phy": phy, "tail": tail, "mmu": mmu, "desc": desc})
        finally:
            nm.close()
    return {"ports": ports, "nodes": nodes, "flow_drops": flows}
