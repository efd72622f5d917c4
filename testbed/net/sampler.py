"""Sample a lab's kernel counters cheaply, many times a second.

pyroute2 decodes every attribute of every message in Python, which costs
about 27 ms of CPU per sample of the default fabric - a quarter of a core at
a 100 ms period. Sampling needs two fixed structs, so this module speaks
rtnetlink directly: per namespace one raw socket, kept open for the run, and
two dumps per sample - RTM_GETSTATS (64-bit link counters only) and
RTM_GETQDISC (per-class counters from each class's leaf qdisc: bytes,
packets, drops, backlog; one dump covers every port, where a class dump
would need a request per port). The same dump carries each link direction's
netem stage (testbed/net/netem.py: the IFB in the receiving namespace), stored
under the sending port as `wire_*` (packets and bytes through it, its drops:
PHY loss and overflow, and its backlog: packets on the wire, not in a queue).
Building the fabric still goes through pyroute2; this is read-only.
"""

from __future__ import annotations

import socket
import struct

from pyroute2 import netns as _netns

from agents.wire.netlink import attrs
from testbed.net import netem, portprog, rxe
from testbed.net.batch import dump_link_indexes
from testbed.net.qdisc import parse_handle
from testbed.plan.model import Plan
from testbed.results.store import Sample

NETLINK_ROUTE = 0
NLMSG_HDR = struct.Struct("=IHHII")          # len, type, flags, seq, pid
NLMSG_DONE, NLMSG_ERROR = 3, 2
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
RTM_GETQDISC, RTM_NEWQDISC = 38, 36
RTM_GETSTATS, RTM_NEWSTATS = 94, 92
IF_STATS_MSG = struct.Struct("=BBHII")       # family, pad1, pad2, ifindex, filter_mask
TCMSG = struct.Struct("=BBHiIII")            # family, pad1, pad2, ifindex, handle, parent, info
IFLA_STATS_LINK_64 = 1
TCA_STATS2 = 7
TCA_STATS_BASIC, TCA_STATS_QUEUE = 1, 3
# rx/tx packets, rx/tx bytes, rx/tx errors, rx/tx dropped (first 8 of rtnl_link_stats64)
STATS64 = struct.Struct("=8Q")
BASIC = struct.Struct("=QI")                 # bytes, packets
QUEUE = struct.Struct("=5I")                 # qlen, backlog, drops, requeues, overlimits
DUMP_ATTEMPTS = 3

# (port, traffic class) -> (bytes admitted, bytes departed) by the port program
_Queues = dict[tuple[str, int], tuple[int, int]]


class _NetlinkDumper:
    def __init__(self, netns: str) -> None:
        _netns.pushns(netns)
        try:
            self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_ROUTE)
        finally:
            _netns.popns()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        self.sock.bind((0, 0))
        self.seq = 0
        self.buf = bytearray(1 << 16)

    def dump(self, msg_type: int, body: bytes):
        """Yield (type, memoryview, payload offset, message end) for every reply message."""
        self.seq += 1
        self.sock.send(NLMSG_HDR.pack(16 + len(body), msg_type, NLM_F_REQUEST | NLM_F_DUMP,
                                      self.seq, 0) + body)
        view = memoryview(self.buf)
        while True:
            n = self.sock.recv_into(self.buf)
            offset = 0
            while offset + 16 <= n:
                length, kind, _flags, seq, _pid = NLMSG_HDR.unpack_from(view, offset)
                if length < 16:
                    return
                if seq == self.seq:
                    if kind == NLMSG_DONE:
                        return
                    if kind == NLMSG_ERROR:
                        code = struct.unpack_from("=i", view, offset + 16)[0]
                        raise OSError(-code, f"netlink dump {msg_type} failed")
                    yield kind, view, offset + 16, offset + length
                offset += (length + 3) & ~3

    def close(self) -> None:
        self.sock.close()


def _wire_rows(view, off: int, end: int, node: str, port: str) -> list[Sample]:
    """The `wire_*` counters of one netem stage's RTM_NEWQDISC message, under the
    sending port (tclass -1: the stage takes every class)."""
    out = []
    for attr, start, stop in attrs(view, off + TCMSG.size, end):
        if attr != TCA_STATS2:
            continue
        for sub, s0, _s1 in attrs(view, start, stop):
            if sub == TCA_STATS_BASIC:
                nbytes, packets = BASIC.unpack_from(view, s0)
                out.append(Sample(node, port, -1, "wire_bytes", nbytes))
                out.append(Sample(node, port, -1, "wire_packets", packets))
            elif sub == TCA_STATS_QUEUE:
                qlen, backlog, drops, _rq, _ol = QUEUE.unpack_from(view, s0)
                out.append(Sample(node, port, -1, "wire_drops", drops))
                out.append(Sample(node, port, -1, "wire_backlog_bytes", backlog))
                out.append(Sample(node, port, -1, "wire_backlog_packets", qlen))
    return out


class KernelSampler:
    """Per-interface and per-class counters of every fabric port of a lab."""

    def __init__(self, plan: Plan, whole_plan: Plan | None = None) -> None:
        """`whole_plan`: the fabric `plan`'s nodes are part of, if more (one VM's part):
        the link stages into its nodes are those of the whole fabric's links."""
        self.plan = plan
        self._dumpers: dict[str, _NetlinkDumper] = {}
        self._ifname: dict[str, dict[int, str]] = {}
        self._leaf: dict[str, dict[tuple[int, int], tuple[str, int]]] = {}
        #: per receiving node: (IFB ifindex, netem handle) -> the sending (node, port)
        self._wire: dict[str, dict[tuple[int, int], tuple[str, str]]] = {}
        stages = netem.stages_by_rx_node(netem.wire_stages(whole_plan or plan))
        for node in plan.nodes:
            dumper = _NetlinkDumper(node.netns)
            self._dumpers[node.name] = dumper
            index = dump_link_indexes(dumper.sock, node.name)
            wanted = {i.ifname for i in node.interfaces}
            self._ifname[node.name] = {index[n]: n for n in wanted if n in index}
            self._leaf[node.name] = {
                (index[i.ifname], parse_handle(c.leaf_handle)): (i.ifname, c.tc)
                for i in node.interfaces if i.ifname in index for c in i.egress.classes}
            # only where the lab has them (a kernel without netem has no IFBs)
            self._wire[node.name] = {(index[st.ifb], netem.NETEM_HANDLE): (st.node, st.port)
                                     for st in stages.get(node.name, ()) if st.ifb in index}
        # Port programs' maps, where the lab has them: the queue the datapath decides on
        # (admitted - departed), ECN marks, trims, drops by cause (a few us per port: mmap).
        self._bpf: dict[str, list[tuple[str, portprog.PortMaps, list[int]]]] = {}
        self._nodes: dict[str, tuple[portprog.NodeMaps, list[int], list[str]]] = {}
        #: (node, port) -> the classes that trim there: their `trims` are sampled (other
        #: classes never trim, and a run without trimming stores no trim samples)
        self._trimming: dict[tuple[str, str], list[int]] = {
            (node.name, i.ifname): [c.tc for c in i.egress.classes if c.trim is not None]
            for node in plan.nodes for i in node.interfaces
            if any(c.trim is not None for c in i.egress.classes)}
        for node in plan.nodes:
            classes = {i.ifname: [c.tc for c in i.egress.classes] for i in node.interfaces}
            self._bpf[node.name] = [(ifname, maps, classes[ifname]) for ifname, maps
                                    in portprog.open_node_ports(plan.lab, node)]
            if node.buffer.tracked:
                try:
                    nm = portprog.open_node(plan.lab, node.name)
                except (OSError, portprog.PortProgError):
                    continue
                self._nodes[node.name] = (nm, list(node.buffer.tracked),
                                          [i.ifname for i in node.interfaces])
        #: rxe hosts: (host, its NIC, the device's hw_counters directory); their counters are
        #: stored as node=host, port=NIC, counter rxe_<name> (testbed/net/rxe.py)
        self._rxe = [(p.host, p.nic, rxe.hw_counters_dir(p.device))
                     for p in rxe.lab_placements(plan.lab)]
        #: (node, port, tclass) -> (lowest, highest) queue the port program can have had
        #: while the last sample's qdisc dump ran (admitted and departed read before and
        #: after it): the kernel's backlog must lie in between
        self.brackets: dict[tuple[str, str, int], tuple[int, int]] = {}
        #: a bracket wider than this (bytes that moved during the dump) is read again
        self.bracket_tolerance_bytes = plan.mtu_bytes + 24

    def close(self) -> None:
        for dumper in self._dumpers.values():
            dumper.close()
        self._dumpers.clear()
        for ports in self._bpf.values():
            for _ifname, maps, _tcs in ports:
                maps.close()
        self._bpf.clear()
        for nm, _t, _p in self._nodes.values():
            nm.close()
        self._nodes.clear()

    def _queues(self, node: str) -> _Queues:
        """(port, class) -> (admitted, departed) bytes now, from the mmap-ed state."""
        out: _Queues = {}
        for ifname, maps, tcs in self._bpf.get(node, ()):
            for tc in tcs:
                row = maps.row(tc)
                out[(ifname, tc)] = (row[0], row[2])
        return out

    def sample(self) -> list[Sample]:
        out: list[Sample] = []
        append = out.append
        brackets: dict[tuple[str, str, int], tuple[int, int]] = {}
        for node, dumper in self._dumpers.items():
            names = self._ifname[node]
            body = IF_STATS_MSG.pack(socket.AF_UNSPEC, 0, 0, 0, 1 << (IFLA_STATS_LINK_64 - 1))
            for kind, view, off, end in dumper.dump(RTM_GETSTATS, body):
                if kind != RTM_NEWSTATS:
                    continue
                ifindex = IF_STATS_MSG.unpack_from(view, off)[3]
                name = names.get(ifindex)
                if name is None:
                    continue
                for attr, start, stop in attrs(view, off + IF_STATS_MSG.size, end):
                    if attr == IFLA_STATS_LINK_64 and stop - start >= STATS64.size:
                        rxp, txp, rxb, txb, _rxe, _txe, rxd, txd = STATS64.unpack_from(view, start)
                        append(Sample(node, name, -1, "tx_bytes", txb))
                        append(Sample(node, name, -1, "tx_packets", txp))
                        append(Sample(node, name, -1, "rx_bytes", rxb))
                        append(Sample(node, name, -1, "rx_packets", rxp))
                        append(Sample(node, name, -1, "tx_dropped", txd))
                        append(Sample(node, name, -1, "rx_dropped", rxd))
            # The kernel's backlog and the program's queue are read as close together as
            # possible: admitted and departed just before and just after the qdisc dump.
            # A thread preempted in between (2 cores, a loaded run) leaves a wide bracket;
            # then the node is read again, at most DUMP_ATTEMPTS times, keeping the
            # tightest, so a stored vq_bytes and backlog_bytes describe one instant.
            best: tuple[int, _Queues, list[Sample], _Queues] | None = None
            for _attempt in range(DUMP_ATTEMPTS):
                before = self._queues(node)
                rows = self._qdisc_rows(node, dumper)
                after = self._queues(node)
                width = max((e1 - e0 + d1 - d0 for (e0, d0), (e1, d1) in
                             zip(before.values(), after.values(), strict=True)), default=0)
                if best is None or width < best[0]:
                    best = (width, before, rows, after)
                if width <= self.bracket_tolerance_bytes:
                    break
            assert best is not None     # DUMP_ATTEMPTS >= 1
            width, before, rows, after = best
            out.extend(rows)
            for (ifname, tc), (enq1, dep1) in after.items():
                enq0, dep0 = before[(ifname, tc)]
                brackets[(node, ifname, tc)] = (max(0, enq0 - dep1), max(0, enq1 - dep0))
                append(Sample(node, ifname, tc, "vq_bytes", max(0, enq1 - dep1)))
            for ifname, maps, tcs in self._bpf.get(node, ()):
                counters = maps.read()
                for tc in tcs:
                    c = counters[tc]
                    append(Sample(node, ifname, tc, "max_vq_bytes", c.max_vq_bytes))
                    append(Sample(node, ifname, tc, "ecn_marks", c.ce_marks))
                    append(Sample(node, ifname, tc, "bpf_drops", c.drops))
                    append(Sample(node, ifname, tc, "tail_drops", c.tail_drops))
                    append(Sample(node, ifname, tc, "mmu_drops", c.mmu_drops))
                    append(Sample(node, ifname, tc, "desc_drops", c.desc_drops))
                    append(Sample(node, ifname, tc, "enq_packets", c.enq_packets))
                    append(Sample(node, ifname, tc, "dep_packets", c.dep_packets))
                for tc in self._trimming.get((node, ifname), ()):
                    c = counters[tc]
                    append(Sample(node, ifname, tc, "trims", c.trims))
                    append(Sample(node, ifname, tc, "trim_errors", c.trim_errors))
            if node in self._nodes:
                out += self._node_samples(node)
        out += self._rxe_samples()
        self.brackets = brackets
        return out

    def _rxe_samples(self) -> list[Sample]:
        """rxe's hw_counters of every rxe host, as node=host, port=its NIC, rxe_<name>."""
        return [Sample(host, nic, -1, f"rxe_{name}", value) for host, nic, directory
                in self._rxe for name, value in rxe.read_hw_counters(directory).items()]

    def _qdisc_rows(self, node: str, dumper: _NetlinkDumper) -> list[Sample]:
        """Per-class counters of the node's leaf qdiscs, from one RTM_GETQDISC dump."""
        out: list[Sample] = []
        append = out.append
        leaf = self._leaf[node]
        wire = self._wire[node]
        for kind, view, off, end in dumper.dump(RTM_GETQDISC, TCMSG.pack(0, 0, 0, 0, 0, 0, 0)):
            if kind != RTM_NEWQDISC:
                continue
            _f, _p1, _p2, ifindex, handle, _parent, _info = TCMSG.unpack_from(view, off)
            where = leaf.get((ifindex, handle))
            if where is None:
                sender = wire.get((ifindex, handle))
                if sender is not None:
                    out += _wire_rows(view, off, end, *sender)
                continue
            name, tc = where
            for attr, start, stop in attrs(view, off + TCMSG.size, end):
                if attr != TCA_STATS2:
                    continue
                for sub, s0, _s1 in attrs(view, start, stop):
                    if sub == TCA_STATS_BASIC:
                        nbytes, packets = BASIC.unpack_from(view, s0)
                        append(Sample(node, name, tc, "class_bytes", nbytes))
                        append(Sample(node, name, tc, "class_packets", packets))
                    elif sub == TCA_STATS_QUEUE:
                        qlen, backlog, drops, _rq, _ol = QUEUE.unpack_from(view, s0)
                        append(Sample(node, name, tc, "class_drops", drops))
                        append(Sample(node, name, tc, "backlog_bytes", backlog))
                        append(Sample(node, name, tc, "backlog_packets", qlen))
        return out

    def _node_samples(self, node: str) -> list[Sample]:
        """The node's buffer accounting: shared pool use and, per (ingress port, lossless
        class), the bytes it holds at the node and in headroom."""
        nm, tracked, ifnames = self._nodes[node]
        head = nm.head()
        out = []
        if head.mode == "shared":
            out.append(Sample(node, "", -1, "shared_used_bytes", head.shared_used_bytes))
            out.append(Sample(node, "", -1, "shared_threshold_bytes", head.threshold_bytes()))
        for t, tc in enumerate(tracked):
            for slot, ifname in enumerate(ifnames, start=1):
                a = nm.acct(t, slot)
                out.append(Sample(node, ifname, tc, "ingress_bytes", a.bytes + a.hdrm_bytes))
                if head.mode == "shared":
                    out.append(Sample(node, ifname, tc, "headroom_used_bytes", a.hdrm_bytes))
                out.append(Sample(node, ifname, tc, "ingress_drops", a.drops))
        return out
