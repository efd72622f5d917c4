"""RoCE streams (`python -m agents.roce`): perftest-style RDMA WRITE or SEND over the
user-space RoCEv2 RC transport, with DCQCN or DCTCP.

Each stream is one client on its source; every stream into a host, over all RoCE
entries, is served by ONE responder process on that host (`python -m agents.roce server
--streams FILE`, agents/roce/responder.py), as an RNIC serves every QP of its host: a
perftest-style server per stream put 127 processes on the receiving host of a 127:1
incast. `expand` gives a per-stream server stub (`-srv` name, its options); `combine`
folds a host's stubs into its responder, whose streams file lists them by those names.
The responder listens for set-up on TCP ROCE_SETUP_PORT (18515, perftest's) and each
client names its stream there (--stream). Streams whose data and CNPs carry the same
DSCPs share one UDP socket, on ROCE_UDP_PORT (4791, RoCEv2's); a socket has one TOS, so
the n-th other DSCP pair on a host gets UDP 4791 + n, skipping 4793, Ultra Ethernet's
port, which the uet kind owns. The clients' QPs send from rxe-style source ports
0xC000 | hash(QPN). The kind's listening ports are `ports` below, which the registry
keeps apart from every other kind's.

Results stay one row per stream: the responder's JSON holds each stream's counters
under `streams`, by its stub's name (`stream_results`).

A RoCE entry's in-flight window (`window: auto`, the default) is computed from the
fabric by `roce_window_packets`; docs/roce.md, "In-flight window", gives the formula and
a worked example. argv is in fabric units (agents convert with the dilation they get).
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import json
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Annotated, ClassVar, Literal

from pydantic import ConfigDict, Field, field_validator

from agents.runtime.framing import WIRE_OVERHEAD_BYTES
from testbed.fields import NAME_RE, DurationNs, SizeBytes
from testbed.workloads.base import (
    AgentFiles,
    AgentSpec,
    CheckContext,
    ClassView,
    ExpandContext,
    PathPin,
    Problem,
    ResultRow,
    Results,
    RunView,
    Shape,
    TrafficEntry,
    WorkloadKind,
    arg_of,
    flow_drops_of,
    stream_account,
    streams,
)
from testbed.workloads.rdma import (
    CC_PRESET_DESCRIPTION,
    MAX_ROCE_WINDOW_PACKETS,
    ROCE_CONNECT_TIMEOUT_S,
    ROCE_SPIN_NS,
    CcPresetName,
    preset_problem,
    roce_window_packets,
)
from testbed.workloads.rdma_params import (
    DcqcnCcParams,
    DctcpCcParams,
    RdmaCcEntry,
    cc_params_problems,
)

RoceKindName = Literal["roce_incast", "roce_all_to_all", "roce_pairs"]
ROCE_SETUP_PORT = 18515     # TCP, perftest's default port
ROCE_UDP_PORT = 4791        # RoCEv2
UET_UDP_PORT = 4793         # Ultra Ethernet's: RoCE servers skip it (the uet kind's)
# UDP sockets per host (one per DSCP pair): RoCE ports 4791, 4792, 4794 .. 6276.
ROCE_MAX_STREAMS_PER_HOST = 1485
# The file a host's responder reads its streams from (AgentSpec.inputs).
ROCE_STREAMS_FILE = "streams.json"

# Bytes of message slots per QP at most (at least one message): what a server verifies.
# A stream gets what it can have in flight twice over (ROCE_SLOTS_PER_POSTED slots per
# message it keeps posted: roce_buffer_bytes), up to this.
ROCE_BUFFER_BYTES = 8 << 20
ROCE_SLOTS_PER_POSTED = 2
# A RoCE client imports numpy, connects, and both sides build their data patterns
# before the start time: about 0.25 s of CPU each, on a VM of two cores.
ROCE_STARTUP_PER_CLIENT_S = 0.25
# A client set up later than this after its start time is reported (wall ns).
ROCE_LATE_TOLERANCE_NS = 20_000_000
ROCE_MAX_MESSAGE_BYTES = (1 << 31) - 1
# RETH 16 B once per message; BTH 12 + ICRC 4 B per packet, besides the UDP/IP/Ethernet
# wire overhead.
RETH_BYTES, BTH_ICRC_BYTES = 16, 12 + 4


class RoceTraffic(RdmaCcEntry):
    """RDMA WRITE or SEND streams over the user-space RoCEv2 RC transport (agents/roce).

    Each (source, destination) stream is one perftest-style client on the source,
    served by the destination's one RoCE responder process; `qps` queue pairs per
    stream. Start
    and duration are fabric time: a client posts messages for `duration`, then
    waits for the outstanding ones; or it posts exactly `messages` per QP. `cc`
    is the sender's rate controller and the receiver's CNP policy (DCQCN by
    default, with HPCC's ns-3 "dcqcn_paper" parameter set, whose switch half is
    the default port class's ECN curve).
    """

    name: str = Field(pattern=NAME_RE, description="the entry's name: lower-case letters, "
                      "digits and _, unique in the workload; agents and results carry it")
    kind: RoceKindName = Field(
        description="roce_incast: senders to one receiver; roce_all_to_all: every ordered pair "
                    "of hosts; roce_pairs: the pairs listed; one client per stream, one "
                    "responder per receiving host")
    senders: list[str] | None = Field(None, description="roce_incast: sending hosts")
    receiver: str | None = Field(None, description="roce_incast: the receiving host")
    hosts: list[str] | None = Field(None, description="roce_all_to_all: hosts (default all)")
    pairs: list[tuple[str, str]] | None = Field(None, description="roce_pairs: [src, dst] lists")
    test: Literal["write_bw", "send_bw"] = Field(
        "write_bw", description="RDMA WRITE or SEND bandwidth test (as perftest's ib_*_bw)")
    size_bytes: SizeBytes = Field(65536, alias="size",
                                  description="message bytes, 1 B .. 2 GiB - 1 (a 31-bit length)")
    qps: int = Field(1, ge=1, le=16, description="queue pairs per sender->receiver stream")
    window_packets: Annotated[int, Field(ge=1, le=MAX_ROCE_WINDOW_PACKETS)] | Literal[
        "auto"] = Field(
        "auto", alias="window",
        description="most unacknowledged packets per QP, 1..2^22, or auto: enough not to bind "
                    "at line rate over the fabric's longest round trip with every queue of "
                    "the class on it full (docs/roce.md, 'In-flight window')")
    start_ns: DurationNs = Field(0, alias="start", description="when the clients start posting, "
                                 "fabric time after the run's common start t0")
    duration_ns: DurationNs | None = Field(
        None, alias="duration",
        description="post messages for this fabric time, then wait for the outstanding ones "
                    "(give this or messages)")
    messages: int | None = Field(
        None, ge=1, description="post exactly this many messages per QP, then wait for them "
                                "(give this or duration)")
    cc: Literal["dcqcn", "dctcp", "none"] = Field(
        "dcqcn", description="congestion control: sender rate control and receiver CNPs")
    cc_preset: CcPresetName | None = Field(
        None, description=CC_PRESET_DESCRIPTION)
    cnp_interval_ns: DurationNs | None = Field(
        None, alias="cnp_interval",
        description="receiver: at most one CNP per QP per this fabric time (default: the "
                    "preset's; DCTCP: every CE packet)")
    cc_params: DcqcnCcParams | DctcpCcParams | None = Field(
        None, description="DCQCN or DCTCP parameters (as `cc`) in place of the preset's: "
                          "absolute values for the sender's link (docs/dcqcn.md)")
    tclass: str | int = Field(
        "roce", description="traffic class name or number of the data and ACKs (CNPs go in the "
                            "class named cnp, if there is one); with cc, a class that marks ECN")
    verify: bool = Field(True, description="the receiver checks every byte written or sent")
    via: list[str] | None = Field(
        None, description="switches every QP of every stream must cross: the run picks each "
                          "QP's UDP source port, once the fabric is up, as the lowest in "
                          "49152..65535 whose ECMP path crosses them all (docs/roce.md, "
                          "'Pinning a QP to a path')")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @field_validator("window_packets", mode="before")
    @classmethod
    def _window(cls, value: object) -> object:
        # One clear message instead of one per member of the int | 'auto' union.
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool)
                               and 1 <= value <= MAX_ROCE_WINDOW_PACKETS):
            return value
        hint = (" (DCTCP's window, a time, is cc_params.window)"
                if isinstance(value, str) and value != "auto" else "")
        raise ValueError(f"expected a whole number of packets, 1..2^22 ({MAX_ROCE_WINDOW_PACKETS}),"
                         f" or auto, got {value!r}{hint}")


def roce_buffer_bytes(size_bytes: int, tx_depth: int) -> int:
    """Bytes of message slots per QP: room for the messages a client keeps posted
    (`tx_depth`: its window and one message more) ROCE_SLOTS_PER_POSTED times over, at
    least one message, at most ROCE_BUFFER_BYTES (or one message, if larger).

    No two messages in flight share a slot, so the server's final check (each slot holds
    the last message written there) holds as it did with 8 MiB; what a client holds
    (its pattern) and a server writes (its region) is what is in flight, not 8 MiB a
    stream (bench/agent_memory.py). The results' `slots` is this over the size."""
    want = ROCE_SLOTS_PER_POSTED * max(1, tx_depth) * size_bytes
    return max(size_bytes, min(want, ROCE_BUFFER_BYTES))


def roce_udp_port(n: int) -> int:
    """The UDP port of the n-th RoCE socket on a host (one per DSCP pair its streams use)."""
    if not 0 <= n < ROCE_MAX_STREAMS_PER_HOST:
        raise ValueError(f"RoCE socket {n} on one host: at most {ROCE_MAX_STREAMS_PER_HOST}")
    udp = ROCE_UDP_PORT + n
    return udp + 1 if udp >= UET_UDP_PORT else udp


def responder_name(host: str) -> str:
    """The agent name of `host`'s RoCE responder."""
    return f"roce-responder-{host}"


def is_responder(spec: AgentSpec) -> bool:
    """A host's RoCE responder (after `combine`), not a per-stream stub."""
    return spec.role == "receiver" and any(n == ROCE_STREAMS_FILE for n, _ in spec.inputs)


def responder_streams(spec: AgentSpec) -> list[dict]:
    """The streams a responder serves: [{"name", "argv"}] as its streams file lists them."""
    text = next(t for n, t in spec.inputs if n == ROCE_STREAMS_FILE)
    return list(json.loads(text)["streams"])


def stream_results(specs: Sequence[AgentSpec], results: Results) -> dict[str, dict]:
    """Each stream's server-side result, by stream (its stub's name, f"{client}-srv"):
    the part of its host responder's JSON under `streams` ({} where it has none)."""
    out: dict[str, dict] = {}
    for spec in specs:
        if is_responder(spec):
            res = (results.get(spec.name) or {}).get("streams") or {}
            for st in responder_streams(spec):
                out[st["name"]] = res.get(st["name"]) or {}
    return out


def stream_dports(specs: Sequence[AgentSpec]) -> dict[str, int]:
    """Each stream's UDP destination port (its responder socket's), by stream name."""
    return {st["name"]: int(arg_of(st["argv"], "--roce-port") or ROCE_UDP_PORT)
            for spec in specs if is_responder(spec) for st in responder_streams(spec)}


def _qp_sum(res: dict, side: str, key: str) -> int:
    return sum(int(q.get(side, {}).get(key, 0)) for q in (res.get("qps") or {}).values())


class RoceKind(WorkloadKind):
    shapes: ClassVar = {"roce_incast": Shape.INCAST, "roce_all_to_all": Shape.ALL_TO_ALL,
                        "roce_pairs": Shape.PAIRS}
    model: ClassVar = RoceTraffic
    agent_module: ClassVar = "agents.roce"
    doc: ClassVar = ("perftest-style RDMA WRITE or SEND streams over the user-space RoCEv2 "
                     "RC transport (agents/roce), with DCQCN or DCTCP: one client per "
                     "stream, `qps` queue pairs each, and one responder process per "
                     "receiving host serving all its streams.")
    ports: ClassVar = {
        "tcp": range(ROCE_SETUP_PORT, ROCE_SETUP_PORT + 1),
        "udp": (range(ROCE_UDP_PORT, UET_UDP_PORT),
                range(UET_UDP_PORT + 1, ROCE_UDP_PORT + ROCE_MAX_STREAMS_PER_HOST + 1))}
    example: ClassVar = {"name": "writes", "kind": "roce_pairs", "pairs": [["h1", "h4"]],
                         "size": "1MB", "messages": 8}
    result_fields: ClassVar = {
        "src": "client (requester) host", "dst": "server (responder) host",
        "cc": "congestion control and preset, e.g. dcqcn/hpcc-ns3-paper",
        "cc_overrides": "the cc_params the entry set (null: none)",
        "window_packets": "the in-flight window per QP, packets",
        "qps": "queue pairs of the stream",
        "bytes": "message bytes completed (acknowledged)",
        "messages": "messages completed",
        "time_us": "first post to last completion, fabric us (one message: its completion "
                   "time as the sender sees it, last byte delivered plus the ACK's way back)",
        "start_us": "the first post, fabric us after the run's common start (the entry's "
                    "start plus how late the client began)",
        "end_us": "start_us + time_us: when the last message completed",
        "gbps": "bytes over time_us, fabric Gb/s",
        "tx_packets": "data packets the requester sent, retransmissions included",
        "tx_bytes": "their UDP payload bytes",
        "rx_packets": "data packets the responder received",
        "rx_bytes": "their UDP payload bytes",
        "lost": "tx_packets - rx_packets (at least 0)",
        "rx_fabric_bps": "wire rate received (UDP payload + 66 B per packet) over time_us, "
                         "fabric bit/s",
        "retransmissions": "packets the requester sent again",
        "naks": "NAKs the requester received (sequence, RNR and fatal)",
        "timeouts": "ACK timeouts at the requester",
        "cnps_sent": "CNPs the responder sent", "cnps_received": "CNPs the requester got",
        "ce_received": "CE-marked packets the responder received",
        "sports": "each QP's UDP source port, in QP order",
        "via": "the switches the entry pinned its QPs to (null: not pinned; the paths are "
               "in the run's path_pinned events)",
        "verified": "the responder checked every byte (null: not checked)",
        "packet_path": "which packet path client and server ran: fast (the compiled one, "
                       "agents.fast), python (the reference), or each side's; "
                       "docs/fast-path.md",
        "error": "the first error either side reported (null: none)",
    }

    def describe(self, spec: AgentSpec) -> str:
        return f"RoCE {'client' if spec.role == 'sender' else 'server'} {spec.name}"

    def check(self, entry: TrafficEntry, loc: tuple, ctx: CheckContext) -> Iterator[Problem]:
        assert isinstance(entry, RoceTraffic)
        yield from _check_schedule_and_cc(entry, loc, ctx.classes.get(entry.tclass))
        pairs = streams(entry, self.shape(entry), ctx.hosts)
        yield from cc_params_problems(entry, loc, [s for s, _ in pairs], ctx.nic_bps)
        yield from _check_via(entry, loc, pairs, ctx)

    def expand(self, entry: TrafficEntry, index: int, ctx: ExpandContext) -> list[AgentSpec]:
        """A server stub (receiver) and a client (sender) per stream; stubs come first.
        A stub's argv is its stream's server options (test first); `combine` folds each
        host's stubs into its one responder."""
        assert isinstance(entry, RoceTraffic)
        t = entry
        cc = ["--cc", t.cc] + (["--cc-preset", t.preset] if t.preset else [])
        overrides = t.cc_overrides()       # DcqcnParams / DctcpParams names, absolute values
        if overrides:
            cc += ["--cc-params", json.dumps(overrides, sort_keys=True, separators=(",", ":"))]
        cnp = ctx.cnp_dscp
        common = ["--mtu", str(ctx.roce_mtu_bytes), "--dscp", str(ctx.dscp(t.tclass)), *cc,
                  *(["--cnp-dscp", str(cnp)] if cnp is not None else [])]
        process = _process_argv(ctx)
        verify = ["--verify"] if t.verify else []
        cnp_interval = ([] if t.cnp_interval_ns is None or t.cc == "none"
                        else ["--cnp-interval-ns", str(t.cnp_interval_ns)])
        mtu = ctx.roce_mtu_bytes
        per_message = -(-t.size_bytes // mtu)             # packets of one message
        rtt_ns = ctx.round_trip_ns(ctx.tc(t.tclass)) if t.window_packets == "auto" else None
        servers: list[AgentSpec] = []
        clients: list[AgentSpec] = []
        for j, (src, dst) in enumerate(streams(t, self.shape(t), ctx.hosts)):
            line_bps = ctx.line_rate_bps(src)
            window = (roce_window_packets(line_bps, rtt_ns, mtu) if rtt_ns is not None
                      else int(t.window_packets))
            # Messages a client keeps posted per QP: a full window and one message more,
            # so the window, not the posting, bounds what is in flight and the pipe never
            # empties between messages; no more, so the tail after `duration` stays short.
            depth = max(2, -(-window // per_message) + 1)
            buffer_bytes = roce_buffer_bytes(t.size_bytes, depth)
            name = f"{t.name}-{src}-{dst}"
            servers.append(AgentSpec(
                name=f"{name}-srv", node=dst, role="receiver", traffic=t.name, kind=t.kind,
                src=src, dst=dst, module=self.agent_module,
                # only its own client may set up (the client binds its NIC's address)
                argv=[t.test, "--peer-subnet", str(ipaddress.ip_network(ctx.address(src))),
                      *verify, *cnp_interval, "--line-rate-bps",
                      str(ctx.line_rate_bps(dst)), "--window-packets", str(window), *common]))
            stop = (["--iters", str(t.messages)] if t.messages is not None
                    else ["--duration-ns", str(t.duration_ns)])
            clients.append(AgentSpec(
                name=name, node=src, role="sender", traffic=t.name, kind=t.kind,
                start_ns=t.start_ns, duration_ns=t.duration_ns or 0, src=src, dst=dst,
                module=self.agent_module,
                argv=["client", t.test, "--server", ctx.address(dst),
                      "--port", str(ROCE_SETUP_PORT), "--stream", f"{name}-srv",
                      "--bind", ctx.address(src), "--size", str(t.size_bytes),
                      "--qps", str(t.qps), *stop,
                      "--tx-depth", str(depth), "--buffer-bytes", str(buffer_bytes),
                      "--seed", str(1 + 16 * j), *verify, "--line-rate-bps", str(line_bps),
                      "--window-packets", str(window), *common, *process],
                via=tuple(t.via or ())))
        return servers + clients

    def combine(self, specs: list[AgentSpec], ctx: ExpandContext) -> list[AgentSpec]:
        """One responder per receiving host, in place of its streams' server stubs (over
        every RoCE entry), at the first stub's place. Its streams file lists each stub's
        name and options, with the UDP port of its socket: one per DSCP pair on the host,
        in order of first use (a socket sends with one TOS)."""
        stubs = [s for s in specs if s.role == "receiver" and s.kind in self.shapes
                 and not is_responder(s)]
        by_host: dict[str, list[AgentSpec]] = {}
        for s in stubs:
            by_host.setdefault(s.node, []).append(s)
        responders = {}
        for host, group in by_host.items():
            sockets: dict[tuple, int] = {}
            listed = []
            for s in group:
                key = (arg_of(s.argv, "--dscp"), arg_of(s.argv, "--cnp-dscp"))
                n = sockets.setdefault(key, len(sockets))
                listed.append({"name": s.name, "argv": [*s.argv, "--roce-port",
                                                        str(roce_udp_port(n))]})
            responders[host] = AgentSpec(
                name=responder_name(host), node=host, role="receiver",
                traffic=group[0].traffic, kind=group[0].kind, dst=host,
                module=self.agent_module,
                argv=["server", "--bind", ctx.address(host), "--port", str(ROCE_SETUP_PORT),
                      *_process_argv(ctx)],
                inputs=((ROCE_STREAMS_FILE,
                         json.dumps({"streams": listed}, indent=1) + "\n"),))
        out: list[AgentSpec] = []
        for s in specs:
            if s.role == "receiver" and s.node in responders and s in stubs:
                if s is by_host[s.node][0]:
                    out.append(responders[s.node])
            else:
                out.append(s)
        return out

    def span_ns(self, entry: TrafficEntry, ctx: ExpandContext | None) -> int:
        """An entry that posts a number of messages has no schedule: it counts from its
        start for as long as its busiest host takes to move its bytes at line rate (0
        without a fabric to tell)."""
        assert isinstance(entry, RoceTraffic)
        if entry.duration_ns is not None:
            return entry.start_ns + entry.duration_ns
        if ctx is None or entry.messages is None:
            return entry.start_ns
        mtu = ctx.roce_mtu_bytes
        per_message = (entry.size_bytes + RETH_BYTES + -(-entry.size_bytes // mtu)
                       * (BTH_ICRC_BYTES + WIRE_OVERHEAD_BYTES))
        wire_bytes = per_message * entry.messages * entry.qps
        load: dict[str, int] = {}
        for src, dst in streams(entry, self.shape(entry), ctx.hosts):
            load[src] = load.get(src, 0) + wire_bytes
            load[dst] = load.get(dst, 0) + wire_bytes
        return entry.start_ns + max((-(-n * 8 * 10**9 // ctx.line_rate_bps(h))
                                     for h, n in load.items()), default=0)

    def path_pins(self, specs: Sequence[AgentSpec]) -> list[PathPin]:
        """A pin per client of an entry with `via`: one source port per QP (each QP has
        a UDP socket of its own), to its stream's RoCE port on the responder."""
        dports = stream_dports(specs)
        pins = []
        for spec in specs:
            if spec.role != "sender" or not spec.via:
                continue
            dport = dports.get(f"{spec.name}-srv", ROCE_UDP_PORT)
            pins.append(PathPin(sender=spec.name, traffic=spec.traffic, src=spec.src,
                                dst=spec.dst, dport=dport,
                                count=int(arg_of(spec.argv, "--qps") or 1), via=spec.via))
        return pins

    def pinned(self, spec: AgentSpec, sports: Sequence[int]) -> AgentSpec:
        return dataclasses.replace(spec, argv=[*spec.argv, *(a for p in sports
                                                             for a in ("--sport", str(p)))])

    def startup_wall_s(self, spec: AgentSpec) -> float:
        return ROCE_STARTUP_PER_CLIENT_S if spec.role == "sender" else super().startup_wall_s(
            spec)

    def waits_ready(self, spec: AgentSpec) -> bool:
        return spec.role == "receiver"     # a server must listen before its client sets up

    def files_argv(self, spec: AgentSpec, files: AgentFiles) -> list[str]:
        streams = files.inputs.get(ROCE_STREAMS_FILE)
        return (["--ready-file", str(files.ready), "--out", str(files.out)]
                + (["--streams", str(streams)] if streams is not None else []))

    def result_rows(self, specs: Sequence[AgentSpec], results: Results,
                    view: RunView) -> list[ResultRow]:
        """One row per stream (client + its server), in fabric units (result_fields)."""
        servers = stream_results(specs, results)
        via_of = {p.traffic: list(p.via) for p in self.path_pins(specs)}
        rows = []
        for spec in specs:
            if spec.role != "sender":
                continue
            c = results.get(spec.name) or {}
            srv = servers.get(f"{spec.name}-srv") or {}
            fabric_ns = float(c.get("elapsed_fabric_ns") or 0)
            start_us = (spec.start_ns + (c.get("start_late_fabric_ns") or 0)) / 1e3
            tx_packets = _qp_sum(c, "requester", "packets_sent")
            rx_packets = _qp_sum(srv, "responder", "packets_received")
            rx_bytes = sum(int(q.get("bytes_received", 0))
                           for q in (srv.get("qps") or {}).values())
            rx_wire_bits = (rx_bytes + rx_packets * WIRE_OVERHEAD_BYTES) * 8
            verified = c.get("verified")
            if verified is None:
                verified = srv.get("verified")
            rows.append(ResultRow(spec.traffic, spec.kind, {
                "src": spec.src, "dst": spec.dst,
                "cc": "/".join(str(x) for x in (c.get("cc"), c.get("cc_preset")) if x),
                "cc_overrides": c.get("cc_overrides") or None,
                "window_packets": c.get("window_packets"),
                "qps": c.get("qp_count", 0),
                "bytes": int(c.get("bytes", 0)), "messages": int(c.get("messages", 0)),
                "time_us": round(fabric_ns / 1e3, 3),
                "start_us": round(start_us, 3),
                "end_us": (round(start_us + fabric_ns / 1e3, 3)
                           if "elapsed_fabric_ns" in c else None),
                "gbps": round(float(c.get("bw_fabric_bps", 0)) / 1e9, 3),
                "tx_packets": tx_packets, "tx_bytes": _qp_sum(c, "requester", "bytes_sent"),
                "rx_packets": rx_packets, "rx_bytes": rx_bytes,
                "lost": max(0, tx_packets - rx_packets),
                "rx_fabric_bps": round(rx_wire_bits / fabric_ns * 1e9) if fabric_ns else 0,
                "retransmissions": _qp_sum(c, "requester", "retransmissions"),
                "naks": sum(_qp_sum(c, "requester", k) for k in (
                    "naks_received", "rnr_naks_received", "fatal_naks_received")),
                "timeouts": _qp_sum(c, "requester", "timeouts"),
                "cnps_sent": _qp_sum(srv, "responder", "cnps_sent"),
                "cnps_received": _qp_sum(c, "requester", "cnps_received"),
                "ce_received": _qp_sum(srv, "responder", "ce_packets_received"),
                "sports": [int(q["sport"]) for q in (c.get("qps") or {}).values()
                           if "sport" in q],
                "via": via_of.get(spec.traffic),
                "verified": verified,
                "packet_path": packet_path(c, srv),
                "error": c.get("error") or srv.get("error"),
            }))
        return rows

    def stream_accounts(self, specs: Sequence[AgentSpec], results: Results,
                        flow_drops: Sequence[dict], view: RunView) -> list[dict]:
        servers = stream_results(specs, results)
        dports = stream_dports(specs)
        # what each responder's sockets dropped full (SO_RXQ_OVFL) is not known by
        # stream: it is shared out over the streams into the host that miss packets
        budget = {s.node: int((results.get(s.name) or {}).get("rx_socket_drops") or 0)
                  for s in specs if is_responder(s)}
        out = []
        for spec in specs:
            if spec.role != "sender":
                continue
            res = results.get(spec.name) or {}
            srv_res = servers.get(f"{spec.name}-srv") or {}
            dport = dports.get(f"{spec.name}-srv", ROCE_UDP_PORT)
            qps = (res.get("qps") or {}).values()
            sent = sum(int(q.get("requester", {}).get("packets_sent", 0)) for q in qps)
            sports = {int(q["sport"]) for q in qps if "sport" in q}
            injected = sum(int(q.get("injected_drops", 0)) for q in qps)
            srv_qps = (srv_res.get("qps") or {}).values()
            received = sum(int(q.get("responder", {}).get("packets_received", 0))
                           for q in srv_qps)
            ooo = sum(int(q.get("responder", {}).get("ooo_drops", 0)) for q in srv_qps)
            drops = flow_drops_of(flow_drops, view.addresses(spec.src), view.address(spec.dst),
                                  dport, sports or None)
            drops["injected"] = injected
            short = max(0, sent - received - sum(drops.values()))
            socket_drops = min(budget.get(spec.dst, 0), short)
            budget[spec.dst] = budget.get(spec.dst, 0) - socket_drops
            # out-of-order arrivals follow every loss until go-back-N resends: only with
            # nothing lost on the flow are they the emulator reordering (a loss in the
            # host's socket, whose count is not per stream, is a loss too)
            reordered = 0 if any(drops.values()) or short else ooo
            a = stream_account(spec, sent=sent, received=received, drops=drops,
                               reordered=reordered, complete=bool(res and srv_res))
            a["socket_drops"] = socket_drops
            a["lost_counted"] = a["lost_counted"] or socket_drops > 0
            out.append(a)
        return out

    def fidelity_notes(self, specs: Sequence[AgentSpec], results: Results,
                       view: RunView) -> list[str]:
        """Where RoCE streams did not run as configured: a client set up after the common
        start, an error, data that did not verify, ACK timeouts without a drop."""
        notes = []
        servers = stream_results(specs, results)
        for spec in specs:
            res = results.get(spec.name) or {}
            who = self.describe(spec)
            if is_responder(spec):
                notes += _responder_notes(spec, res, servers)
                continue
            if res.get("error"):
                notes.append(f"{who} on {spec.node}: {res['error']}")
            if spec.role != "sender":
                continue
            ready_ns = view.ready_mtime_ns(spec)
            late = None if ready_ns is None else (
                ready_ns - view.t0_realtime_ns - view.dilation.to_wall_ns(spec.start_ns))
            if late is None:
                notes.append(f"{who} on {spec.node} never finished set-up")
            elif late > ROCE_LATE_TOLERANCE_NS:
                notes.append(f"{who} on {spec.node} finished set-up {late / 1e6:.0f} ms (wall) "
                             f"after its start time, so it started "
                             f"{view.dilation.to_fabric_ns(late) / 1e3:.1f} us fabric late")
            for side, r in (("client", res), ("server", servers.get(f"{spec.name}-srv") or {})):
                fp = r.get("fast_path") or {}
                if fp.get("on") is False and not _chose_python(fp):
                    notes.append(f"{who}: the {side} ran the pure-Python packet path, not the "
                                 f"compiled one: {fp.get('reason')} (same packets, fewer per "
                                 "second of CPU)")
            if res.get("verified") is False:
                notes.append(f"{who}: the data did not arrive byte-exact (first mismatch "
                             f"{res.get('first_mismatch')})")
            timeouts = _qp_sum(res, "requester", "timeouts")
            if timeouts and not view.lossless_drops:
                notes.append(f"{who}: {timeouts} ACK timeouts although no lossless queue "
                             "dropped: ACKs came later than the QP timeout (long pauses, or an "
                             "agent short of CPU)")
        return notes


def packet_path(client: dict, server: dict) -> str | None:
    """"fast", "python", or "client X, server Y": the packet path each side's agent ran
    (its results' `fast_path`, agents.fast); None when neither said (an older agent)."""
    sides = {name: ("fast" if fp.get("on") else "python")
             for name, fp in (("client", client.get("fast_path")),
                              ("server", server.get("fast_path"))) if fp}
    if not sides:
        return None
    if len(set(sides.values())) == 1 and len(sides) == 2:
        return next(iter(sides.values()))
    return ", ".join(f"{k} {v}" for k, v in sides.items())


def _chose_python(fast_path: dict) -> bool:
    """The Python path was asked for (TESTBED_FASTPATH=0, an agent option), not forced by
    a missing or stale extension."""
    reason = str(fast_path.get("reason") or "")
    return reason.startswith("turned off")


def _process_argv(ctx: ExpandContext) -> list[str]:
    """The options every RoCE agent process takes alike (the responder's are its own)."""
    return ["--dilation", str(ctx.dilation), "--connect-timeout-s",
            str(ROCE_CONNECT_TIMEOUT_S), "--spin-ns", str(ROCE_SPIN_NS)]


def _responder_notes(spec: AgentSpec, res: dict, servers: Mapping[str, dict]) -> list[str]:
    """A responder's error, each of its streams' errors (named as the stream's server),
    and datagrams its sockets dropped because it fell behind."""
    notes = []
    if res.get("error") and not res.get("streams"):
        notes.append(f"RoCE server {spec.name} on {spec.node}: {res['error']}")
    for st in responder_streams(spec):
        err = (servers.get(st["name"]) or {}).get("error")
        if err:
            notes.append(f"RoCE server {st['name']} on {spec.node}: {err}")
    dropped = int(res.get("rx_socket_drops") or 0)
    if dropped:
        notes.append(f"RoCE server {spec.name} on {spec.node}: its receive socket dropped "
                     f"{dropped} datagrams, full (SO_RXQ_OVFL): the responder fell behind "
                     "its streams; go-back-N resent them")
    return notes


def _check_schedule_and_cc(t: RoceTraffic, loc: tuple,
                           tclass: ClassView | None) -> Iterator[Problem]:
    if t.duration_ns is None and t.messages is None:
        yield (loc, f"{t.kind} needs duration: (post messages for that long) or messages: "
               "(post exactly that many per QP)")
    elif t.duration_ns is not None and t.messages is not None:
        yield (loc + ("messages",), "duration and messages are both given; give one: "
               "duration posts messages for that long, messages exactly that many per QP")
    bad_preset = preset_problem(t.cc, t.cc_preset)
    if bad_preset is not None:
        yield loc + (bad_preset[0],), bad_preset[1]
    if t.cc != "none" and tclass is not None and not tclass.ecn:
        yield (loc + ("tclass",), f"class {tclass.name!r} (TC{tclass.tc}) does not mark ECN, so "
               f"{t.cc.upper()} never gets a CNP; use an ECN class (roce) or cc: none")
    if not 0 < t.size_bytes <= ROCE_MAX_MESSAGE_BYTES:
        yield (loc + ("size",), f"message size {t.size_bytes} B is outside 1 B .. 2 GiB - 1; "
               "RDMA messages carry a 31-bit length here")


def _check_via(t: RoceTraffic, loc: tuple, pairs: Sequence[tuple[str, str]],
               ctx: CheckContext) -> Iterator[Problem]:
    """via names switches, and each stream has an equal-cost path through all of them."""
    if t.via is None:
        return
    if not t.via:
        yield loc + ("via",), "via is empty; list switches, or leave via out"
        return
    bad = False
    for i, node in enumerate(t.via):
        role = ctx.roles.get(node)
        if role is None:
            guess = difflib.get_close_matches(node, sorted(ctx.roles), n=1)
            hint = f"; did you mean {guess[0]!r}?" if guess else ""
            yield loc + ("via", i), f"unknown node {node!r}{hint}"
            bad = True
        elif role != "switch":
            yield loc + ("via", i), (f"{node!r} is a {role}; via lists the switches a QP "
                                     "must cross")
            bad = True
        elif node in t.via[:i]:
            yield loc + ("via", i), f"{node!r} is listed twice"
            bad = True
    if bad or not ctx.roles:
        return
    for src, dst in pairs:
        on_path = switches_between(ctx.roles, ctx.neighbours, src, dst)
        missing = [v for v in t.via if v not in on_path]
        if missing:
            yield loc + ("via",), (
                f"no equal-cost path from {src} to {dst} crosses {', '.join(missing)}: its "
                f"paths cross {', '.join(sorted(on_path)) or 'no switch'}")


def switches_between(roles: Mapping[str, str], neighbours: Callable[[str], list[str]],
                     src: str, dst: str) -> set[str]:
    """The switches on some equal-cost path from host `src` to host `dst`, as the plan
    routes (testbed/plan/compile.py): the host sends to every switch it is linked to;
    switches forward along shortest paths over switches to the switch on `dst`'s first
    link (hosts never forward)."""
    def is_switch(n: str) -> bool:
        return roles.get(n) == "switch"

    owner = next((n for n in neighbours(dst) if is_switch(n)), None)
    if owner is None:
        return set()

    def distances(start: str) -> dict[str, int]:
        dist, queue = {start: 0}, deque([start])
        while queue:
            cur = queue.popleft()
            for nbr in neighbours(cur):
                if is_switch(nbr) and nbr not in dist:
                    dist[nbr] = dist[cur] + 1
                    queue.append(nbr)
        return dist

    to_owner = distances(owner)
    out: set[str] = set()
    for first in (n for n in neighbours(src) if is_switch(n) and n in to_owner):
        from_first = distances(first)
        out |= {v for v, d in from_first.items()
                if v in to_owner and d + to_owner[v] == to_owner[first]}
    return out


KIND = RoceKind()
