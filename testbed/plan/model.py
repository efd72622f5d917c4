"""The plan: everything `testbed/net` needs to build a fabric, as plain data.

Wall units appear here for the first time (rates the kernel is told, delays
netem would apply); fabric units are kept beside them so reports can speak
fabric. The plan serialises to deterministic JSON and is golden-tested.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

from pydantic import BaseModel, ConfigDict, SerializerFunctionWrapHandler, model_serializer

from agents.timebase import Dilation

PLAN_FORMAT_VERSION = 2


class PlanModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EcnPlan(PlanModel):
    kmin_bytes: int
    kmax_bytes: int
    pmax: float
    marker: str = "bpf"     # "bpf": the port program marks; "red": the class's sch_red

    @model_serializer(mode="wrap")
    def _without_bpf_marker(self, handler: SerializerFunctionWrapHandler) -> Any:
        # The BPF marker serialises as before the RED marker existed (same plan hash).
        data = handler(self)
        if self.marker == "bpf" and isinstance(data, dict):
            data.pop("marker", None)
        return data


class RedPlan(PlanModel):
    """The sch_red qdisc that holds a class's buffer and marks it (ecn marker red;
    testbed/plan/red.py says how the curve becomes these)."""

    handle: str             # its qdisc handle, "213:"
    parent: str             # the HTB class ("1:13") or, under a PFC gate, the TBF's class
    limit_bytes: int        # the class's buffer (its bfifo child's limit)
    qth_min_bytes: int      # no mark below
    qth_max_bytes: int      # every packet marked at or above
    max_p_fp: int           # mark probability at qth_max, units of 2^-32 (TCA_RED_MAX_P)
    plog: int


class PfcPlan(PlanModel):
    priority: int
    xoff_bytes: int             # static: bytes an ingress port may hold (with a shared
    xon_bytes: int              #   buffer: of the pool's shared part) before XOFF / at XON
    headroom_bytes: int         # what the ingress may still put in after its XOFF
    watchdog_ns: int | None     # fabric time paused before a storm is declared; None: off
    mode: str                   # "static" or "dynamic"
    alpha: float                # dynamic: XOFF above alpha x free shared buffer
    egress_xoff_bytes: int = 0  # per-port buffers: a queue this deep pauses every ingress
    egress_xon_bytes: int = 0   #   holding bytes in it (egress protection); 0: off


class TrimPlan(PlanModel):
    """Packet trimming of a class at a switch port (the port program's trim_* settings)."""

    threshold_bytes: int        # a UET packet that would take the queue above it is trimmed
    size_bytes: int             # IP bytes the trimmed packet keeps
    tc: int                     # the class it is sent in
    dscp: int                   # the DSCP written into it (that class's first)


class ClassPlan(PlanModel):
    tc: int
    name: str
    dscp: list[int]
    classid: str          # HTB class, "1:13"
    leaf_handle: str      # leaf qdisc handle, "113:"
    leaf_kind: str        # "tbf": a pausable gate (PFC classes); "bfifo": a plain buffer;
                          # "red": sch_red holding the buffer and marking (ecn marker red)
    prio: int             # HTB priority: strict classes 0, weighted classes 1
    wall_rate_bps: int    # guaranteed share
    wall_ceil_bps: int    # may borrow up to the port rate
    limit_bytes: int      # buffer of this class on this port (shared: the node's pool)
    shared: bool = False  # draws from the switch's shared pool (switch_buffer)
    lossless: bool
    ecn: EcnPlan | None
    pfc: PfcPlan | None
    trim: TrimPlan | None = None    # switch ports of a class with trim: true
    red: RedPlan | None = None      # ecn marker red: the class's sch_red (switch ports)

    @model_serializer(mode="wrap")
    def _without_no_trim(self, handler: SerializerFunctionWrapHandler) -> Any:
        # A class that does not trim (or mark with red) serialises as before trimming
        # (and the RED marker) existed (same bytes, same plan hash).
        data = handler(self)
        if isinstance(data, dict):
            if self.trim is None:
                data.pop("trim", None)
            if self.red is None:
                data.pop("red", None)
        return data


class EgressPlan(PlanModel):
    rate_bps: int              # fabric MAC rate
    wall_rate_bps: int
    overhead_bytes: int        # per-packet bytes HTB adds to skb length (FCS, preamble, IFG)
    burst_bytes: int
    quantum_bytes: int
    default_classid: str
    classes: list[ClassPlan]


class PeerPlan(PlanModel):
    node: str
    ifname: str
    address: str


class InterfacePlan(PlanModel):
    ifname: str
    loss_probability: float     # drop probability at this egress: PHY frame loss + impairments
    mac: str
    address: str          # "198.18.0.1/31"
    mtu_bytes: int
    link: int             # index into Plan.links
    peer: PeerPlan
    egress: EgressPlan


class NextHopPlan(PlanModel):
    gateway: str
    ifname: str


class RoutePlan(PlanModel):
    dst: str
    nexthops: list[NextHopPlan]


class NodeBufferPlan(PlanModel):
    """How a node accounts its buffer (the port program's node maps)."""

    mode: str                   # "none" (a host NIC), "static" (per-port buffers, static
                                # per-ingress XOFF), "shared" (switch_buffer's pool)
    tracked: list[int]          # lossless PFC classes accounted per ingress port
    pool_bytes: int = 0         # shared: the pool
    reserve_bytes: int = 0      # shared: per (ingress port, tracked class)
    resume_offset_bytes: int = 0
    total_headroom_bytes: int = 0   # shared: set aside for every ingress port's headroom
    total_reserve_bytes: int = 0    # shared: set aside for every ingress port's reserve
    alpha: float = 0.125        # shared: default alpha (ports may set their own)


class NodePlan(PlanModel):
    name: str
    role: str
    netns: str
    # (plans of format 1, before buffers were accounted per node, read as "none")
    buffer: NodeBufferPlan = NodeBufferPlan(mode="none", tracked=[])
    sysctls: dict[str, str]
    interfaces: list[InterfacePlan]
    routes: list[RoutePlan]
    # A host's RoCE endpoint: "transport" (the user-space agents) or "rxe" (a kernel
    # Soft-RoCE device on its NIC, testbed/net/rxe.py). Omitted from the JSON when
    # "transport", so plans without rxe hosts keep their bytes and hash.
    endpoint: str = "transport"

    @model_serializer(mode="wrap")
    def _without_default_endpoint(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        if self.endpoint == "transport" and isinstance(data, dict):
            data.pop("endpoint", None)
        return data


class LinkEndPlan(PlanModel):
    node: str
    ifname: str


class LinkPlan(PlanModel):
    index: int
    a: LinkEndPlan
    b: LinkEndPlan
    subnet: str
    port_type: str
    length_m: float
    qos: str
    rate_bps: int
    wall_rate_bps: int
    delay_ns: int          # one way: propagation + FEC/DSP, fabric time
    wall_delay_ns: int
    frame_loss_ratio: float
    phy_warnings: list[str]


class CapacityPlan(PlanModel):
    """Why the capacity rule chose D (testbed/plan/capacity.py, docs/dilation.md): the
    workload's packet rates at D = 1 (fabric), what it needs at D, what the machine
    carries and where that figure came from."""

    rule: str                       # "capacity" (chose D) or "check" (a fixed D, checked)
    streams: int
    longest_path_hops: int
    hop_pps: float                  # packets x hops per second the workload needs at D = 1
    agent_send_pps: dict[str, float]
    agent_recv_pps: dict[str, float]
    busiest_port: str               # "node:ifname"
    busiest_port_pps: float         # at D = 1
    need_cores_at_1: float          # core-seconds per wall second at D = 1
    need_cores: float               # ... at the plan's D
    hop_pps_per_core: float
    agent_core_s_per_packet: dict[str, dict[str, float]]   # kind -> send/recv
    cores: int
    margin: float
    derating: float
    derating_note: str
    usable_cores: float             # cores x margin x derating
    need_factor: int                # smallest D the machine's cores allow
    port_factor: int                # smallest D the busiest port on one core allows
    rate_factor: int                # smallest D that keeps every port within 25 Gb/s wall
    least_factor: float = 1.0       # the smallest D, not rounded, that fits all three
    pfc_factor: int = 1             # auto: smallest D >= the others at which the emulated
    #                                 PFC loop puts no more lossless queues at risk than the
    #                                 per-port rule's D (1: not searched)
    source: str                     # the calibration file, or the default


# The emulated PFC loop's response, in WALL time: from the packet that crosses XOFF to
# the upstream gate closed, through the port program's event, the switch's agent, the
# frame and the upstream agent's gate. bench/pfc.py on a 2-core VM, the incast-pfc
# example: median 0.55-0.66 ms, p99 1.6-1.9 ms of wall time at D = 2000; at D = 1000
# with other load 0.62 / 2.98 ms; at D = 500 0.85 / 7.9 ms (the busier the machine, the
# later the agents wake). Hardware answers in ~60 quanta; the emulator's answer lasts
# this long in wall time whatever D, so 1/D of it in fabric time, and the auto headroom
# takes whichever is longer, or a lossless class drops what an upstream port sends
# meanwhile (seen: 23 drops at D = 500 with Cisco's headroom). Each run measures what
# its loop took (testbed/run/pfc_reaction.py).
PFC_EMULATED_RESPONSE_WALL_NS = 2_000_000


class DilationPlan(PlanModel):
    factor: int
    mode: str                       # "fixed" or "auto"
    max_wall_port_rate_bps: int     # per-port budget: the rule when the config pins it
    busiest_port_bps: int           # fabric rate of the fastest port
    busiest_wall_port_bps: int
    rule: str = "port budget"       # what chose an auto D: "capacity" or "port budget"
    capacity: CapacityPlan | None = None
    # what the emulated PFC loop takes to answer an XOFF, wall ns (p99): the plan sizes
    # lossless headroom for it; the run measures what it took (summary pfc_reaction)
    pfc_loop_wall_ns: int = PFC_EMULATED_RESPONSE_WALL_NS

    def why(self) -> str:
        """One paragraph: how D was chosen, from what, and any derating in force."""
        c = self.capacity
        budget = (f"the busiest port {self.busiest_port_bps / 1e9:g} Gb/s fabric within "
                  f"{self.max_wall_port_rate_bps / 1e6:g} Mb/s of wall rate per port")
        if c is None:
            return f"D={self.factor} ({self.mode}): {budget}"
        fits = (f"the workload needs {c.need_cores_at_1:.3g} core-seconds per second of "
                f"packet work at D=1 ({c.hop_pps:,.0f} hop packets/s and "
                f"{sum(c.agent_send_pps.values()):,.0f} sent + "
                f"{sum(c.agent_recv_pps.values()):,.0f} received agent packets/s, fabric; "
                f"{c.streams} streams, up to {c.longest_path_hops} hops), "
                f"{c.need_cores:.3g} at D={self.factor}; this machine gives a plan "
                f"{c.usable_cores:.3g} cores ({c.cores} x margin {c.margin:g} x derating "
                f"{c.derating:g}; a hop costs 1/{c.hop_pps_per_core:,.0f} core-s; "
                f"{c.source}); the busiest port {c.busiest_port} needs D >= {c.port_factor}")
        cpu = max(c.need_factor, c.port_factor, c.rate_factor)
        if c.pfc_factor > cpu:
            fits += (f"; the CPU allows D={cpu}, but below D={c.pfc_factor} the emulated PFC "
                     f"loop (~{self.pfc_loop_wall_ns / 1e6:.2g} ms of wall time to answer an XOFF) "
                     "outruns the lossless "
                     "queues' headroom (the plan's qos warnings)")
        derated = f". {c.derating_note}" if c.derating_note else ""
        if self.mode == "auto" and self.rule == "capacity":
            return (f"D={self.factor} (auto, capacity rule: the smallest 1-2-5 factor that "
                    f"fits): {fits}{derated}")
        if self.mode == "auto" and not c.streams:
            return f"D={self.factor} (auto, per-port rule: no workload to size D from): {budget}"
        if self.mode == "auto":
            return f"D={self.factor} (auto, per-port rule pinned by the config): {budget}; {fits}"
        least = max(c.need_factor, c.port_factor, c.rate_factor)
        verdict = ("fits" if self.factor >= c.least_factor * (1 - 1e-9)
                   else f"does NOT fit; auto would pick D={least}")
        return f"D={self.factor} (fixed, {verdict}): {fits}{derated}"


class TrafficClassPlan(PlanModel):
    tc: int
    name: str
    dscp: list[int]
    lossless: bool
    ecn: bool
    strict: bool
    weight: int
    default: bool
    trim: bool = False

    @model_serializer(mode="wrap")
    def _without_no_trim(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        if not self.trim and isinstance(data, dict):
            data.pop("trim", None)
        return data


class EventPortPlan(PlanModel):
    """One egress port an event changes, and what it becomes."""

    node: str
    ifname: str
    up: bool | None = None                  # link_down / link_up
    loss_probability: float | None = None   # loss: the port's new total drop probability
                                            #   (PHY frame loss + the event's loss)
    egress: EgressPlan | None = None        # rate: the port's whole new egress (rates,
                                            #   burst, class rates; thresholds unchanged)
    tc: int | None = None                   # pfc / ecn / host_drain: the class
    pfc_enabled: bool | None = None         # pfc
    ecn: EcnPlan | None = None              # ecn: the class's new curve at this port
    drain_rate_bps: int | None = None       # host_drain: fabric rate the NIC drains its
    drain_wall_rate_bps: int | None = None  #   receive buffer at (None: line rate)
    xoff_bytes: int | None = None           # host_drain: the receive buffer's XOFF / XON
    xon_bytes: int | None = None            #   (the host port's lossless class pfc plan)


class EventPlan(PlanModel):
    """One entry of the config's fault timeline, compiled: the ports it changes."""

    index: int                  # position in the config's `events`
    at_ns: int                  # fabric ns after the workload's t0
    kind: str                   # link_down|link_up|loss|rate|pfc|ecn|host_drain
    target: str                 # "leaf1-spine1", "h8", "leaf1", "leaf1:swp3"
    description: str            # "link leaf1-spine1 down (both directions)"
    ports: list[EventPortPlan]
    converge_ns: int = 0        # link_down / link_up: fabric ns until `routes` apply everywhere
    # link_down / link_up: every node's whole route table once converged (the links down
    # at that moment, cumulative over the timeline; static routes as configured)
    routes: dict[str, list[RoutePlan]] | None = None


class Plan(PlanModel):
    format_version: int = PLAN_FORMAT_VERSION
    lab: str
    netns_prefix: str
    address_pool: str
    mtu_bytes: int
    roce_mtu_bytes: int
    dilation: DilationPlan
    traffic_classes: list[TrafficClassPlan]
    nodes: list[NodePlan]
    links: list[LinkPlan]
    warnings: list[str]     # fidelity risks known before anything runs
    events: list[EventPlan] = []    # the fault timeline, by at_ns (config order at a tie)

    @model_serializer(mode="wrap")
    def _without_empty_events(self, handler: SerializerFunctionWrapHandler) -> Any:
        # A plan without a timeline serialises as before events existed (same bytes,
        # same hash), so format-2 readers keep reading it.
        data = handler(self)
        if not self.events and isinstance(data, dict):
            data.pop("events", None)
        return data

    @cached_property
    def timebase(self) -> Dilation:
        """The one converter between this plan's fabric and wall time."""
        return Dilation(self.dilation.factor)

    def node(self, name: str) -> NodePlan:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(f"no node {name!r} in plan of lab {self.lab!r}")

    def hosts(self) -> list[NodePlan]:
        return [n for n in self.nodes if n.role == "host"]

    def switches(self) -> list[NodePlan]:
        return [n for n in self.nodes if n.role == "switch"]

    def trim_dscp(self, tc: int) -> int | None:
        """The DSCP switch ports write into a trimmed packet of class `tc` (what a UET
        receiver recognises a trim by), or None if no switch port trims the class. A
        dscp_remap can make switches differ; then the lowest (a receiver also knows a trim
        by its short payload)."""
        dscps = {c.trim.dscp for n in self.switches() for i in n.interfaces
                 for c in i.egress.classes if c.tc == tc and c.trim is not None}
        return min(dscps) if dscps else None

    def to_json(self) -> str:
        return self.model_dump_json(indent=2) + "\n"
