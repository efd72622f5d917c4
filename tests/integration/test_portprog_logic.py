"""The port program's decisions, packet by packet, on synthetic frames (BPF_PROG_TEST_RUN).

No namespaces and no timing: one node "sw" with three port instances loaded
as the builder loads them (the first makes the node's shared maps, the others
reuse them), configured as a switch, and driven with exact sequences of
arrivals (port_egress, with the ingress ifindex a switch port would see) and
departures (port_departure, what the peer's ingress runs). Checked against
plain Python models: the queue is admitted - departed; marks follow the curve
at the exact depth; tail drop at the port's limit; per-ingress occupancy with
static XOFF/XON and egress protection; and, packet for packet, HPCC ns-3's
SwitchMmu (shared pool, reserve, alpha threshold, headroom, pause/resume).
"""

from __future__ import annotations

import os
import random
import struct
from dataclasses import dataclass, field

import pytest

from agents import portmaps
from testbed.net import portprog
from tests.integration.bpfrun import TC_ACT_OK, TC_ACT_SHOT, TC_ACT_UNSPEC, Program, frame

pytestmark = pytest.mark.root

TC = 3
FRAME = 1042                        # skb->len of the frames sent
IFINDEX = {1: 11, 2: 12, 3: 13}     # slot -> ifindex the egress program is told


@dataclass
class Port:
    slot: int
    pin: object
    egress: Program
    departure: Program
    maps: portmaps.PortMaps

    def arrive(self, from_slot: int, length: int = FRAME, **kw) -> int:
        verdict, _ = self.egress.run(frame(length, **kw), IFINDEX.get(from_slot, 0))
        return verdict

    def depart(self, length: int = FRAME, **kw) -> None:
        verdict, _ = self.departure.run(frame(length, **kw))
        # the departure program only counts: the peer's next ingress filter decides
        assert verdict == TC_ACT_UNSPEC

    def queue(self) -> int:
        return self.maps.vq_bytes(TC)

    def counters(self) -> portmaps.ClassCounters:
        return self.maps.read()[TC]


@dataclass
class Node:
    lab: str
    ports: dict[int, Port] = field(default_factory=dict)
    maps: portmaps.NodeMaps | None = None

    def configure(self, node: portmaps.NodeParams,
                  classes: dict[int, portmaps.ClassParams] | None = None) -> None:
        for port in self.ports.values():
            port.maps.write_params(portmaps.PortParams(
                dscp_to_tc={26: TC}, default_tc=0, port_slot=port.slot,
                classes=classes or {TC: portmaps.ClassParams()}))
            port.maps.reset()
        self.maps.write_params(node)
        self.maps.reset()
        self.maps.events()                    # drop what earlier tests left

    def acct(self, slot: int) -> portmaps.IngressAcct:
        return self.maps.acct(0, slot)


@pytest.fixture(scope="module")
def node():
    lab = f"bpflogic{os.getpid()}"
    dirs = [portprog.pin_dir_of(lab, "sw", f"swp{slot}") for slot in IFINDEX]
    portprog.load_programs(dirs)
    n = Node(lab)
    try:
        for slot, d in zip(IFINDEX, dirs, strict=True):
            n.ports[slot] = Port(slot, d, Program(d / "progs" / "port_egress"),
                                 Program(d / "progs" / "port_departure"), portmaps.PortMaps(d))
        n.maps = portmaps.NodeMaps(portprog.node_dir_of(lab, "sw"), events=True)
        yield n
    finally:
        for p in n.ports.values():
            p.egress.close()
            p.departure.close()
            p.maps.close()
        if n.maps is not None:
            n.maps.close()
        portprog.detach_lab(lab)


def static_node(xoff: int = 10 * FRAME, xon: int = 6 * FRAME) -> portmaps.NodeParams:
    return portmaps.NodeParams(
        mode="static", tracked=(TC,), slots={v: k for k, v in IFINDEX.items()},
        ingress={(TC, s): portmaps.IngressParams(xoff_bytes=xoff, xon_bytes=xon)
                 for s in IFINDEX})


def test_the_node_shares_one_set_of_maps(node):
    ids = set()
    for port in node.ports.values():
        fd = portmaps.obj_get(port.pin / "maps" / "node")
        try:
            ids.add(portmaps.map_info(fd))
        finally:
            os.close(fd)
    assert len(ids) == 1
    own = {portmaps.obj_get(p.pin / "maps" / "state") for p in node.ports.values()}
    try:
        assert len({portmaps.map_info(fd)[4] for fd in own}) == 1   # same name ...
    finally:
        for fd in own:
            os.close(fd)
    # ... but each port's queue is its own
    node.configure(static_node())
    node.ports[1].arrive(2)
    assert [p.queue() for p in node.ports.values()] == [FRAME, 0, 0]


def test_the_queue_is_admitted_minus_departed_in_frame_bytes(node):
    node.configure(static_node(xoff=0, xon=0))
    p = node.ports[1]
    sizes = [100, 1500, 3000, 64, 2500]  # test_run frames must fit a page
    for s in sizes:
        assert p.arrive(2, s) == TC_ACT_OK
    assert p.queue() == sum(sizes)
    for k, s in enumerate(sizes[:3]):
        p.depart(s)
        assert p.queue() == sum(sizes[k + 1:])
    c = p.counters()
    assert (c.enq_packets, c.dep_packets, c.max_vq_bytes) == (5, 3, sum(sizes))
    assert c.dep_mismatch == 0
    # departures are taken in admission order (FIFO): a length that is not the next
    # entry's is counted, the entry's own length is what leaves
    p.depart(2500)
    assert p.queue() == 2500 and p.counters().dep_mismatch == 1
    p.depart(2500)
    p.depart(2500)          # nothing admitted: not counted, the queue cannot go negative
    c = p.counters()
    assert p.queue() == 0 and c.dep_unmatched == 1 and c.dep_packets == 5


def test_departure_passes_every_frame_on_to_the_next_filter(node):
    """TC_ACT_UNSPEC, not OK: a later clsact-ingress filter of the peer (netem's
    redirect) must still run, for IPv4 and for other frames alike."""
    node.configure(static_node(xoff=0, xon=0))
    p = node.ports[1]
    arp = bytes(12) + b"\x08\x06" + bytes(46)
    assert p.departure.run(arp)[0] == TC_ACT_UNSPEC
    p.arrive(2)
    assert p.departure.run(frame(FRAME))[0] == TC_ACT_UNSPEC
    assert p.queue() == 0


def test_marks_follow_the_curve_at_the_exact_depth(node):
    kmin, kmax, pmax = 20 * FRAME, 60 * FRAME, 1.0
    node.configure(static_node(xoff=0, xon=0), {TC: portmaps.ClassParams(
        kmin_bytes=kmin, kmax_bytes=kmax, pmax=pmax)})
    p = node.ports[1]
    marked_at: dict[int, list[bool]] = {}
    for _round in range(40):
        for k in range(80):                    # packet k finds k frames queued
            _v, out = p.egress.run(frame(FRAME, ecn=2), IFINDEX[2])
            marked_at.setdefault(k * FRAME, []).append(out[15] & 3 == 3)
        for _ in range(80):
            p.depart()
    for q, marks in marked_at.items():
        prob = portmaps.mark_probability(q, kmin, kmax, pmax)
        if prob in (0.0, 1.0):
            assert all(m == (prob == 1.0) for m in marks), q
    # in the ramp, the fraction tracks the curve (binomial, 4 sigma)
    ramp = [(q, m) for q, ms in marked_at.items() for m in ms if kmin < q <= kmax]
    expected = sum(portmaps.mark_probability(q, kmin, kmax, pmax) for q, _ in ramp)
    var = sum(portmaps.mark_probability(q, kmin, kmax, pmax) * (1 - portmaps.mark_probability(
        q, kmin, kmax, pmax)) for q, _ in ramp)
    assert abs(sum(m for _q, m in ramp) - expected) <= 4 * var ** 0.5 + 1
    assert p.counters().ce_marks == sum(m for ms in marked_at.values() for m in ms)


@pytest.mark.parametrize("tracked", [True, False])
def test_red_marker_the_program_never_marks_and_counts_sch_reds_marks_at_departure(
        node, tracked):
    """marker red: sch_red (after this hook) marks; the program passes ECT packets on
    unmarked however deep the queue, and counts a CE departure as a mark unless a CE
    arrival may be it. Here the departures carry the CE bits sch_red would have set."""
    node.configure(static_node(xoff=0, xon=0) if tracked else portmaps.NodeParams(
        mode="static", tracked=(), slots={v: k for k, v in IFINDEX.items()}),
        {TC: portmaps.ClassParams(kmin_bytes=0, kmax_bytes=0, pmax=1.0, marker="red")})
    p = node.ports[1]
    arrivals = [2, 3, 2, 2, 1]      # ECN bits: ECT(0), CE, ECT(0), ECT(0), ECT(1)
    for ecn in arrivals:
        verdict, out = p.egress.run(frame(FRAME, ecn=ecn), IFINDEX[2])
        assert verdict == TC_ACT_OK and out[15] & 3 == ecn     # a step at 0: BPF would mark
    c = p.counters()
    assert (c.ce_marks, c.would_mark, c.ce_arrivals, c.ect_packets) == (0, 0, 1, 4)
    # sch_red marked the 1st and 4th; in FIFO order they depart as CE, CE, ECT, CE, ECT
    departing = [3, 3, 2, 3, 1]
    seen = []
    for ecn in departing:
        p.depart(ecn=ecn)
        seen.append(p.counters().ce_marks)
    # the 1st may have been the CE arrival: not counted until the 2nd shows it was not
    assert seen == [0, 1, 1, 2, 2]
    assert p.queue() == 0


def test_the_port_limit_tail_drops_and_counts_by_flow(node):
    node.configure(static_node(xoff=0, xon=0), {TC: portmaps.ClassParams(
        limit_bytes=5 * FRAME + 10)})
    p = node.ports[1]
    verdicts = [p.arrive(2, sport=7000 + k % 2) for k in range(9)]
    assert verdicts == [TC_ACT_OK] * 5 + [TC_ACT_SHOT] * 4
    c = p.counters()
    assert c.vq_bytes == 5 * FRAME and c.tail_drops == 4 and c.enq_packets == 5
    drops = node.maps.flow_drops()
    got = {k[2]: v for k, v in drops.items() if k[5] == TC and k[3] == 6000}
    assert got == {7001: (0, 2, 0, 0), 7000: (0, 2, 0, 0)}
    assert node.acct(2).drops == 4
    assert [e.kind for e in node.maps.events()] == ["drop"] * 4


def test_static_xoff_xon_per_ingress_summed_over_the_nodes_queues(node):
    node.configure(static_node(xoff=10 * FRAME, xon=6 * FRAME))
    a, b = node.ports[1], node.ports[2]
    for _ in range(5):                         # ingress 3 feeds two egress queues
        a.arrive(3)
        b.arrive(3)
    assert node.acct(3).bytes == 10 * FRAME and node.acct(3).want_pause
    events = node.maps.events()
    assert [(e.kind, e.slot, e.bytes) for e in events] == [("xoff", 3, 10 * FRAME)]
    assert events[0].port_slot == 2            # the packet that crossed went to swp2
    for _ in range(3):
        a.depart()
    assert node.acct(3).want_pause and not node.maps.events()   # 7 frames > XON
    b.depart()
    assert not node.acct(3).want_pause
    assert [(e.kind, e.slot) for e in node.maps.events()] == [("xon", 3)]
    assert node.acct(3).max_bytes == 10 * FRAME


def test_egress_protection_reports_a_hot_queue_and_its_contributors(node):
    node.configure(static_node(xoff=100 * FRAME, xon=90 * FRAME), {TC: portmaps.ClassParams(
        egress_xoff_bytes=6 * FRAME, egress_xon_bytes=2 * FRAME)})
    p = node.ports[1]
    for k in range(6):
        p.arrive(2 if k % 3 else 3)
    assert p.maps.hot(TC)
    assert [(e.kind, e.port_slot) for e in node.maps.events()] == [("egress_hot", 1)]
    assert p.maps.ingress_queued(0) == {2: 4 * FRAME, 3: 2 * FRAME}
    for _ in range(4):
        p.depart()
    assert [(e.kind, e.port_slot) for e in node.maps.events()] == [("egress_cool", 1)]
    assert not p.maps.hot(TC)
    assert p.maps.ingress_queued(0) == {2: 2 * FRAME}      # FIFO: the oldest left first


@dataclass
class Mmu:
    """HPCC ns-3's SwitchMmu (switch-mmu.cc), one lossless queue per ingress port."""

    buffer: int
    reserve: int
    resume_offset: int
    headroom: dict[int, int]
    alpha_fp: int
    ingress: dict[int, int] = field(default_factory=dict)
    hdrm: dict[int, int] = field(default_factory=dict)
    paused: dict[int, bool] = field(default_factory=dict)
    shared_used: int = 0

    def __post_init__(self) -> None:
        self.total_hdrm = sum(self.headroom.values())
        self.total_rsrv = self.reserve * len(self.headroom)

    def threshold(self) -> int:
        free = max(0, self.buffer - self.total_hdrm - self.total_rsrv - self.shared_used)
        return free * self.alpha_fp >> 16

    def shared(self, port: int) -> int:
        return max(0, self.ingress.get(port, 0) - self.reserve)

    def admit(self, port: int, size: int) -> bool:
        return not (size + self.hdrm.get(port, 0) > self.headroom[port]
                    and size + self.shared(port) > self.threshold())

    def update(self, port: int, size: int) -> None:
        new = self.ingress.get(port, 0) + size
        if new <= self.reserve:
            self.ingress[port] = new
        elif new - self.reserve > self.threshold():
            self.hdrm[port] = self.hdrm.get(port, 0) + size
        else:
            self.ingress[port] = new
            self.shared_used += min(size, new - self.reserve)

    def remove(self, port: int, size: int) -> None:
        from_hdrm = min(self.hdrm.get(port, 0), size)
        from_shared = min(size - from_hdrm, self.shared(port))
        self.hdrm[port] = self.hdrm.get(port, 0) - from_hdrm
        self.ingress[port] = self.ingress.get(port, 0) - (size - from_hdrm)
        self.shared_used -= from_shared

    def should_pause(self, port: int) -> bool:
        return not self.paused.get(port) and (self.hdrm.get(port, 0) > 0
                                              or self.shared(port) >= self.threshold())

    def should_resume(self, port: int) -> bool:
        if not self.paused.get(port):
            return False
        s = self.shared(port)
        return self.hdrm.get(port, 0) == 0 and (s == 0 or s + self.resume_offset
                                                <= self.threshold())


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_shared_buffer_is_hpccs_switch_mmu_packet_for_packet(node, seed):
    rng = random.Random(seed)
    buffer, reserve, resume = 200 * FRAME, 4 * FRAME, 3 * FRAME
    headroom = {1: 6 * FRAME, 2: 5 * FRAME, 3: 4 * FRAME}
    alpha = 0.125
    node.configure(portmaps.NodeParams(
        mode="shared", tracked=(TC,), slots={v: k for k, v in IFINDEX.items()},
        ingress={(TC, s): portmaps.IngressParams(headroom_bytes=h) for s, h in headroom.items()},
        buffer_bytes=buffer, reserve_bytes=reserve, alpha=alpha, resume_offset_bytes=resume,
        total_hdrm_bytes=sum(headroom.values()), total_rsrv_bytes=reserve * 3))
    model = Mmu(buffer, reserve, resume, headroom, portmaps.alpha_fp(alpha))
    fifo: dict[int, list[int]] = {1: [], 2: [], 3: []}    # egress port -> ingress slots
    pauses = drops = 0
    for step in range(3000):
        egress = rng.choice((1, 2))
        if rng.random() < 0.55 or not fifo[egress]:
            src = rng.choice([s for s in (1, 2, 3) if s != egress])
            want = model.admit(src, FRAME)
            got = node.ports[egress].arrive(src) == TC_ACT_OK
            assert got == want, f"step {step}: admission of ingress {src}"
            if want:
                model.update(src, FRAME)
                fifo[egress].append(src)
                if model.should_pause(src):
                    model.paused[src] = True
                    pauses += 1
            else:
                drops += 1
        else:
            src = fifo[egress].pop(0)
            node.ports[egress].depart()
            model.remove(src, FRAME)
            if model.should_resume(src):
                model.paused[src] = False
        head = node.maps.head()
        assert head.shared_used_bytes == model.shared_used, f"step {step}"
        for s in (1, 2, 3):
            a = node.acct(s)
            assert (a.bytes, a.hdrm_bytes, a.want_pause) == (
                model.ingress.get(s, 0), model.hdrm.get(s, 0), bool(model.paused.get(s))), \
                f"step {step}, ingress {s}"
    assert pauses > 5 and drops > 0, "the sequence must exercise XOFF and headroom drops"
    kinds = [e.kind for e in node.maps.events()]
    assert kinds.count("xoff") == pauses and kinds.count("drop") == drops


def test_a_full_descriptor_ring_refuses_and_counts(node):
    node.configure(static_node(xoff=0, xon=0))
    p = node.ports[1]
    for _ in range(portmaps.RING):
        assert p.arrive(2, 64) == TC_ACT_OK
    assert p.arrive(2, 64) == TC_ACT_SHOT
    c = p.counters()
    assert c.desc_drops == 1 and c.vq_packets == portmaps.RING
    p.depart(64)
    assert p.arrive(2, 64) == TC_ACT_OK


def test_phy_loss_is_its_own_count_and_never_queued(node):
    node.configure(static_node(xoff=0, xon=0), {TC: portmaps.ClassParams(drop_probability=1.0)})
    p = node.ports[1]
    assert all(p.arrive(2) == TC_ACT_SHOT for _ in range(10))
    c = p.counters()
    assert (c.drops, c.tail_drops, c.vq_bytes) == (10, 0, 0)
    assert not node.acct(2).drops               # not a refusal of the lossless buffer
    phy = {k: v for k, v in node.maps.flow_drops().items() if k[5] == TC}
    assert sum(v[0] for v in phy.values()) >= 10


def test_non_ipv4_frames_are_counted_apart(node):
    node.configure(static_node(xoff=0, xon=0))
    p = node.ports[1]
    arp = bytes(12) + struct.pack("!H", 0x0806) + bytes(46)
    verdict, _ = p.egress.run(arp)
    assert verdict == TC_ACT_OK
    counters = p.maps.read()
    assert counters[portmaps.OTHER].packets == 1 and counters[TC].packets == 0
