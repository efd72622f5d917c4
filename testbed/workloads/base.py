"""What a workload kind is: the contract every kind module fulfils, and the views of the
fabric and of a finished run that kinds are given.

A kind (UDP streams, RoCE streams, ...) is one module that declares everything the
testbed needs to know about it:

- its config model (a `TrafficEntry`) and the kind names it answers to, each with a
  stream `Shape` (incast, all-to-all, explicit pairs);
- its whole-fabric config checks (`check`), beyond what the model validates;
- how an entry expands into agents (`expand`: one `AgentSpec` per process, argv in
  fabric units; `combine`, once all entries are expanded, for a process that serves
  several entries' streams), how long its schedule is (`span_ns`), how long its senders
  may take to set up before the run gives the common start without them
  (`startup_wall_s`) and which of them the run waits for (`waits_ready`, `files_argv`);
- how its agents' results become result rows (`result_rows`, with `result_fields`
  documenting every column), per-stream packet accounts for the conservation invariant
  (`stream_accounts`), and its own fidelity notes (`fidelity_notes`).

Kinds see the fabric through `ExpandContext` and a finished run through `RunView`, so a
kind never imports the plan, the kernel or the run: they sit below the config in the
layering (the config validates entries with the kinds' models), and adding one is a
module plus one line in testbed/workloads/registry.py.
"""

from __future__ import annotations

import enum
import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, ClassVar, Protocol

from agents.timebase import Dilation
from testbed.fields import Strict

#: A config problem: (location under the config's root, message).
Problem = tuple[tuple, str]


class Shape(enum.Enum):
    """Which hosts an entry's streams join, and the fields that say so."""

    INCAST = "incast"            # senders: [...] -> receiver:
    ALL_TO_ALL = "all_to_all"    # every ordered pair of hosts: (default: all hosts)
    PAIRS = "pairs"              # pairs: [[src, dst], ...]
    GROUP = "group"              # ranks: [...], a communicator (every rank talks to all)

    @property
    def fields(self) -> tuple[str, ...]:
        return _SHAPE_FIELDS[self]


_SHAPE_FIELDS = {Shape.INCAST: ("senders", "receiver"), Shape.ALL_TO_ALL: ("hosts",),
                 Shape.PAIRS: ("pairs",), Shape.GROUP: ("ranks",)}
SHAPE_FIELD_NAMES = ("senders", "receiver", "hosts", "pairs", "ranks")


class TrafficEntry(Strict):
    """What every traffic entry has, whatever its kind: a name, a kind, a traffic class
    and a schedule. A kind's model derives from this, gives each field its own default
    and description, and adds the fields of its shapes (Shape.fields: senders, receiver,
    hosts, pairs, ranks), which only the kinds of that shape accept."""

    name: str
    kind: str
    tclass: str | int = "default"
    start_ns: int = 0
    duration_ns: int | None = None


def shape_field(entry: TrafficEntry, field: str) -> Any:
    """A shape field of an entry (None where its kind has no such field)."""
    return getattr(entry, field, None)


def streams(entry: TrafficEntry, shape: Shape, hosts: Sequence[str]) -> list[tuple[str, str]]:
    """The (source, destination) streams of an entry of `shape`, in config order."""
    if shape is Shape.INCAST:
        receiver = shape_field(entry, "receiver")
        return [(s, receiver) for s in shape_field(entry, "senders") or [] if receiver]
    if shape is Shape.ALL_TO_ALL:
        return list(itertools.permutations(shape_field(entry, "hosts") or hosts, 2))
    if shape is Shape.GROUP:
        return list(itertools.permutations(shape_field(entry, "ranks") or [], 2))
    return [(src, dst) for src, dst in shape_field(entry, "pairs") or []]


@dataclass(frozen=True)
class AgentSpec:
    """One agent process a run starts: `python -m MODULE ARGV` in `node`'s namespace."""

    name: str            # unique in the run, e.g. "incast-h1-h8"
    node: str
    role: str            # "sender" or "receiver"
    traffic: str         # traffic entry name
    kind: str
    argv: list[str]      # after `python -m MODULE`, fabric units
    module: str          # e.g. "agents.udp"
    start_ns: int = 0    # fabric time after t0 at which a sender starts
    duration_ns: int = 0
    src: str = ""
    dst: str = ""
    via: tuple[str, ...] = ()   # a sender: switches its flows must cross (see PathPin)
    inputs: tuple[tuple[str, str], ...] = ()   # (file name, text): files the run writes
    #                             for it before it starts (AgentFiles.inputs has their paths)


@dataclass(frozen=True)
class PathPin:
    """A sender whose flows must cross given switches: `count` UDP source ports from
    host `src` to host `dst`'s port `dport`, each on a path through every node of `via`.
    The run resolves them once the fabric is up (testbed/net/paths.py) and gives them
    back to the kind (`WorkloadKind.pinned`)."""

    sender: str          # the AgentSpec's name
    traffic: str
    src: str
    dst: str
    dport: int
    count: int
    via: tuple[str, ...]


@dataclass(frozen=True)
class AgentFiles:
    """Files of the run directory an agent may be pointed at."""

    ready: Path          # the agent creates it once it can serve (a server listening)
    out: Path            # its final JSON counters, kept in the run directory
    events: Path         # JSON lines of events it appends; the collector imports them
    inputs: Mapping[str, Path] = field(default_factory=dict)   # AgentSpec.inputs, written


class ClassView(Protocol):
    """A traffic class as kinds read it (testbed.config.models.TrafficClass)."""

    @property
    def name(self) -> str: ...
    @property
    def tc(self) -> int: ...
    @property
    def ecn(self) -> bool: ...
    @property
    def lossless(self) -> bool: ...


@dataclass(frozen=True)
class CheckContext:
    """The fabric as a kind's config checks see it."""

    hosts: Sequence[str]
    classes: Mapping[str | int, ClassView]       # by name and by number
    nic_bps: Mapping[str, int]                   # each host's first NIC's MAC rate
    roles: Mapping[str, str] = field(default_factory=dict)   # node -> "host" or "switch"
    neighbours: Callable[[str], list[str]] = lambda node: []  # nodes linked to a node, in
    #                                              link order, each once
    endpoints: Mapping[str, str] = field(default_factory=dict)   # host -> "transport" | "rxe"


@dataclass
class ExpandContext:
    """The planned fabric as kinds expand entries over it (built by testbed.run.workload).

    `state(owner)` is a scratch dict that lives for one expansion, for numbering that
    runs across a kind's entries (ports, servers per host)."""

    hosts: Sequence[str]
    dilation: int
    mtu_bytes: int
    roce_mtu_bytes: int
    address: Callable[[str], str]                # a host's first NIC address
    line_rate_bps: Callable[[str], int]          # a host's first NIC's egress rate
    dscp: Callable[[str | int], int]             # a class's first DSCP (0: none)
    tc: Callable[[str | int], int]
    cnp_dscp: int | None                         # the `cnp` class's DSCP, if any
    round_trip_ns: Callable[[int], Fraction]     # longest host-to-host RTT of a class,
    #                                              every queue on the way full
    neighbours: Callable[[str], list[str]] = lambda node: []   # nodes linked to a node
    link_address: Callable[[str, str], str | None] = lambda node, peer: None  # node's
    #                                              address on its link to peer
    role: Callable[[str], str] = lambda node: "host"           # "host" or "switch"
    classes: Mapping[str | int, ClassView] = field(default_factory=dict)   # by name and
    #                                              number (a kind's default class)
    # host to host and back through empty queues, fabric ns (plan/paths.base_round_trip_ns)
    base_rtt_ns: Callable[[str, str], int] = lambda src, dst: 0
    # the DSCP switch ports write into a trimmed packet of a class (by tc), None: no trim
    trim_dscp: Callable[[int], int | None] = lambda tc: None
    lab: str = ""                                # the lab's name (names its rxe devices)
    _state: dict[str, dict] = field(default_factory=dict)

    def state(self, owner: str) -> dict:
        return self._state.setdefault(owner, {})


@dataclass(frozen=True)
class StreamLoad:
    """One stream an entry offers, for `dilation: auto` (testbed/plan/capacity.py):
    `rate_bps` (fabric, on the wire) from host `src` to host `dst` in packets of
    `wire_bytes`, carried by agents of kind `agent` ("udp", "roce", ...), in a lossless
    class or not; `reverse_per_packet` packets come back per data packet (ACKs)."""

    src: str
    dst: str
    rate_bps: float
    wire_bytes: int
    agent: str
    lossless: bool
    reverse_per_packet: float = 0.0


@dataclass(frozen=True)
class LoadContext:
    """The fabric as kinds state their offered load (before D is chosen)."""

    hosts: Sequence[str]
    classes: Mapping[str | int, ClassView]       # by name and by number
    nic_bps: Mapping[str, int]                   # each host's first NIC's MAC rate
    mtu_bytes: int
    roce_mtu_bytes: int


# RoCEv2 on the wire beyond its payload: BTH 12 + ICRC 4 + UDP 8 + IPv4 20 + Ethernet 14
# + FCS 4 + preamble 8 + IFG 12 (testbed/plan/paths.py's ROCE_PACKET_OVERHEAD_BYTES).
ROCE_WIRE_OVERHEAD_BYTES = 82
# The RoCE agents' responder ACKs one in this many packets (agents/rdma/qp.py ack_every).
ROCE_ACKS_PER_PACKET = 1 / 16


@dataclass(frozen=True)
class RunView:
    """A finished run as kinds read it for result rows, accounts and fidelity notes."""

    dilation: Dilation
    t0_realtime_ns: int                          # the common start, CLOCK_REALTIME
    address: Callable[[str], str]
    addresses: Callable[[str], set[str]]         # every NIC address of a host
    line_rate_bps: Callable[[str], int]
    ready_mtime_ns: Callable[[AgentSpec], int | None]   # when its ready file appeared
    paused_nodes: frozenset[str] = frozenset()   # nodes whose ports received a pause
    lossless_drops: int = 0                      # drops in lossless classes, all ports
    base_rtt_ns: Callable[[str, str], int] = lambda src, dst: 0   # host to host, queues
    #                                              empty (testbed/plan/paths.py)
    roce_mtu_bytes: int = 4096


Results = Mapping[str, dict]                     # agent name -> its final JSON


@dataclass(frozen=True)
class FlowSpec:
    """One planned flow, as the flow generators give them (testbed/workloads/flows_gen.py):
    one message of `size_bytes` from host `src` to host `dst` at fabric time `start_ns`
    after the workload's t0, in class `tclass` (None: its entry's)."""

    src: str
    dst: str
    size_bytes: int
    start_ns: int
    tclass: str | int | None = None


@dataclass(frozen=True)
class FlowRecord:
    """One flow's result, as a kind gives it to the run (`WorkloadKind.flow_records`);
    the run writes them to the database's `flows` table, results/flows.csv and HPCC's
    results/fct.txt (testbed/results/flows.py)."""

    workload: str            # the traffic entry's name
    flow_id: int             # unique in the run
    src: str
    dst: str
    src_ip: str
    dst_ip: str
    sport: int
    dport: int
    size_bytes: int
    start_ns: int            # its scheduled start, fabric ns after t0
    fct_ns: int | None       # start to the sender's completion (the last ACK); None: unfinished
    ideal_fct_ns: int        # standalone: the base RTT plus its wire bytes at line rate
    tc: int                  # its traffic class number
    time_offset_ns: int = 0  # added to start_ns in fct.txt (an imported flow file's clock)
    extra: Mapping[str, int | float | str | None] = field(default_factory=dict)

    @property
    def slowdown(self) -> float | None:
        """fct / ideal, floored at 1 (HPCC's fct_analysis floors it too); None unfinished."""
        if self.fct_ns is None:
            return None
        return max(1.0, self.fct_ns / self.ideal_fct_ns) if self.ideal_fct_ns > 0 else 1.0


@dataclass(frozen=True)
class ResultRow:
    traffic: str
    kind: str
    fields: dict[str, Any]


class WorkloadKind(ABC):
    """A family of workload kinds that share a config model and an agent."""

    #: kind name -> stream shape, e.g. {"udp_incast": Shape.INCAST, ...}
    shapes: ClassVar[Mapping[str, Shape]]
    #: the config model of an entry (its `kind` field is a Literal of `shapes`' keys)
    model: ClassVar[type[TrafficEntry]]
    #: `python -m` module of its agents
    agent_module: ClassVar[str]
    #: one paragraph for the docs: what it runs and how
    doc: ClassVar[str]
    #: result row column -> what it holds (docs/run-format.md lists them)
    result_fields: ClassVar[Mapping[str, str]]
    #: the console's summary of a run: (column header, result field) per column
    console_columns: ClassVar[tuple[tuple[str, str], ...]] = (
        ("src", "src"), ("dst", "dst"), ("sent", "tx_packets"), ("received", "rx_packets"),
        ("lost", "lost"), ("rx rate (fabric)", "rx_fabric_bps"))
    #: the host ports its agents listen on, by protocol ("tcp", "udp"): a range, or a
    #: tuple of ranges for a kind that skips a port another kind owns; the registry
    #: refuses a kind whose ranges overlap another's, so kinds never share a socket
    ports: ClassVar[Mapping[str, range | tuple[range, ...]]]
    #: the shared module that numbers these ports, if the kind does not itself: kinds
    #: with the same owner may declare the same ranges (the owner never hands one port to
    #: two agents), e.g. the communicator kinds' testbed/workloads/rdma_group.py
    port_owner: ClassVar[str | None] = None
    #: one entry of this kind on any fabric with hosts h1..h4, as a config would hold it
    #: (the docs show it; tests expand it and check the rows it writes)
    example: ClassVar[Mapping[str, object]]

    @property
    def family(self) -> str:
        """The name kinds are listed under in messages, e.g. 'udp'."""
        return type(self).__name__.removesuffix("Kind").lower()

    def describe(self, spec: AgentSpec) -> str:
        """How notes name one of its agents, e.g. 'udp receiver incast-recv-h8'."""
        return f"{self.family} {spec.role} {spec.name}"

    def shape(self, entry: TrafficEntry) -> Shape:
        return self.shapes[entry.kind]

    def check(self, entry: TrafficEntry, loc: tuple,
              ctx: CheckContext) -> Iterator[Problem]:
        """Problems the model cannot see alone (the fabric's classes, its NICs)."""
        return iter(())

    def host_ports(self, entry: TrafficEntry,
                   ctx: CheckContext) -> Mapping[str, Sequence[tuple[str, int, str]]]:
        """Fixed ports the entry's agents bind on each host beyond the kind's own numbered
        `ports`, as (protocol, port, what binds it), e.g. the Ultra Ethernet NIC's UDP
        4793, which every UET user on a host would bind: the config check refuses two
        entries that claim the same port on one host, naming both."""
        return {}

    @abstractmethod
    def expand(self, entry: TrafficEntry, index: int, ctx: ExpandContext) -> list[AgentSpec]:
        """The agents of entry number `index` of the workload (receivers first)."""

    def combine(self, specs: list[AgentSpec], ctx: ExpandContext) -> list[AgentSpec]:
        """The run's agents once every entry is expanded, with this kind's own recast where
        one process serves several entries' streams (the RoCE kind's one responder per
        receiving host); other kinds' agents stay as and where they are. Default: as is."""
        return specs

    def offered_load(self, entry: TrafficEntry, ctx: LoadContext) -> list[StreamLoad]:
        """The streams the entry offers the fabric, for `dilation: auto`. By default
        what a RoCE-transport kind offers: every stream of its shape, each sender's
        NIC line rate shared by its streams, full RoCE-MTU packets with one ACK per
        ROCE_ACKS_PER_PACKET. A kind that knows better (a configured rate, another
        packet size or agent) overrides it."""
        pairs = streams(entry, self.shape(entry), ctx.hosts)
        fanout: dict[str, int] = {}
        for src, _ in pairs:
            fanout[src] = fanout.get(src, 0) + 1
        tclass = ctx.classes.get(entry.tclass) if entry.tclass is not None else None
        lossless = bool(tclass is not None and tclass.lossless)
        return [StreamLoad(src, dst, ctx.nic_bps.get(src, 0) / fanout[src],
                           ctx.roce_mtu_bytes + ROCE_WIRE_OVERHEAD_BYTES, "roce", lossless,
                           ROCE_ACKS_PER_PACKET)
                for src, dst in pairs]

    def span_ns(self, entry: TrafficEntry, ctx: ExpandContext | None) -> int:
        """Fabric time from t0 until the entry's senders are scheduled to stop."""
        return entry.start_ns + (entry.duration_ns or 0)

    def startup_wall_s(self, spec: AgentSpec) -> float:
        """Wall time the agent may need between its start and arming (set up, waiting
        for the common start): the run waits this, beyond a 20 s floor, before it gives
        the start without it (runner.wait_armed). The start itself follows the last
        sender that armed, so this bounds a wait; it does not add to one."""
        return 0.03

    def work_wall_s(self, entry: TrafficEntry) -> float:
        """Wall time the entry's agents spend outside their fabric schedule once started
        (a collective builds and checks its buffers between timed runs): the run waits
        this much longer for its senders before it stops them."""
        return 0.0

    def path_pins(self, specs: Sequence[AgentSpec]) -> list[PathPin]:
        """Senders among this kind's agents whose flows must take a given path."""
        return []

    def pinned(self, spec: AgentSpec, sports: Sequence[int]) -> AgentSpec:
        """The sender `spec` with the source ports its PathPin was given."""
        raise NotImplementedError(f"{self.family} pins no paths")

    def waits_ready(self, spec: AgentSpec) -> bool:
        """Whether the run waits for this agent's ready file before starting senders."""
        return False

    def files_argv(self, spec: AgentSpec, files: AgentFiles) -> list[str]:
        """Arguments that point the agent at its files in the run directory."""
        return []

    @abstractmethod
    def result_rows(self, specs: Sequence[AgentSpec], results: Results,
                    view: RunView) -> list[ResultRow]:
        """One row per stream, from this kind's agents' results."""

    @abstractmethod
    def stream_accounts(self, specs: Sequence[AgentSpec], results: Results,
                        flow_drops: Sequence[dict], view: RunView) -> list[dict]:
        """Per stream: name, kind, src, dst, sent, received, fabric_drops, drops (by
        cause), reordered, lost_counted, complete (testbed/run/invariants.py)."""

    def fidelity_notes(self, specs: Sequence[AgentSpec], results: Results,
                       view: RunView) -> list[str]:
        """Where this kind's agents did not run as configured."""
        return []

    def flow_records(self, specs: Sequence[AgentSpec], results: Results,
                     view: RunView) -> list[FlowRecord]:
        """One record per flow, for kinds whose traffic is sized flows (kind: flows):
        the run keeps them in the database and writes flows.csv and fct.txt."""
        return []

    def output_files(self, rows: Sequence[ResultRow], specs: Sequence[AgentSpec],
                     results: Results, view: RunView) -> dict[str, str]:
        """Extra result files in the formats this kind's users already parse (nccl-tests'
        table and JSON, HPCC's fct.txt), by name under the run's `results/`."""
        return {}


def flow_drops_of(flow_drops: Sequence[dict], saddrs: set[str], daddr: str, dport: int,
                  sports: set[int] | None, proto: int = 17) -> dict[str, int]:
    """A stream's drops by cause from the port programs' drops by flow (phy, tail, mmu,
    desc), for flows from any of `saddrs` (and `sports`, if given) to daddr:dport."""
    out = {"phy": 0, "tail": 0, "mmu": 0, "desc": 0}
    for f in flow_drops:
        if (f["saddr"] not in saddrs or (f["daddr"], f["dport"], f["proto"])
                != (daddr, dport, proto)):
            continue
        if sports is not None and f["sport"] not in sports:
            continue
        for k in out:
            out[k] += f[k]
    return out


def stream_account(spec: AgentSpec, *, sent: int, received: int, drops: dict[str, int],
                   reordered: int, complete: bool) -> dict:
    """One stream's packet account, as testbed/run/invariants.py reads it: `drops` by
    cause (flow_drops_of, plus any the kind counts itself) are the fabric's losses."""
    return account(spec.name, spec.kind, spec.src, spec.dst, sent=sent, received=received,
                   drops=drops, reordered=reordered, complete=complete)


def account(name: str, kind: str, src: str, dst: str, *, sent: int, received: int,
            drops: dict[str, int], reordered: int, complete: bool) -> dict:
    """`stream_account` for a stream that is not one agent's (a collective's streams run
    between ranks, and between ranks and switch aggregators)."""
    lost = sum(drops.values())
    return {"name": name, "kind": kind, "src": src, "dst": dst,
            "sent": sent, "received": received, "fabric_drops": lost, "drops": drops,
            "reordered": reordered, "lost_counted": lost > 0, "complete": complete}


def arg_of(argv: Sequence[str], flag: str) -> str | None:
    """The value after `flag` in an agent's argv, if it is there."""
    return argv[argv.index(flag) + 1] if flag in argv[:-1] else None
