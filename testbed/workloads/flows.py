"""Sized flows (`kind: flows`, `python -m agents.flows`): explicit flows, flows generated
from a published flow-size distribution at a target load with Poisson arrivals, and
incast bursts, each flow one RDMA WRITE on a QP of its own, timed from start to the
sender's completion, as HPCC's ns-3 times its flows (fct.txt).

An entry becomes one agent per host that sends or receives any of its flows; each agent
reads its host's part of the entry's schedule from a file the run writes
(`AgentSpec.inputs`). Flow ids are numbered over every flows entry of the workload in
config order, and a flow's QPN is its id + 1 at both ends, so the agents need no set-up
exchange (agents/flows/host.py). The agents of the n-th flows entry take flows on UDP
port FLOWS_UDP_PORT + n. The flow results go to the run through `flow_records`: the run
writes them to the database's `flows` table, results/flows.csv and results/fct.txt.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterator, Sequence
from typing import Annotated, ClassVar, Literal

from pydantic import ConfigDict, Field, WithJsonSchema, field_validator, model_validator

from agents.runtime.framing import WIRE_OVERHEAD_BYTES
from testbed.fields import NAME_RE, DurationNs, SizeBytes, Strict
from testbed.workloads.base import (
    AgentFiles,
    AgentSpec,
    CheckContext,
    ExpandContext,
    FlowRecord,
    FlowSpec,
    Problem,
    ResultRow,
    Results,
    RunView,
    Shape,
    TrafficEntry,
    WorkloadKind,
    account,
    arg_of,
    flow_drops_of,
)
from testbed.workloads.rdma import (
    CC_PRESET_DESCRIPTION,
    MAX_ROCE_WINDOW_PACKETS,
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

FLOWS_UDP_PORT = 6400           # the first flows entry's; the n-th takes 6400 + n
FLOWS_MAX_ENTRIES = 64
FLOWS_MAX_FLOWS = 0xFFFFFD      # QPN = id + 1 in 24 bits (agents.flows.host.MAX_FLOW_ID + 1)
# An agent loads its schedule and binds its port before the common start.
FLOWS_STARTUP_S = 0.3
# A flow posted later than this after its start (fabric ns) is counted in the notes.
FLOWS_LATE_NS = 5_000
RETH_BYTES, BTH_ICRC_BYTES = 16, 12 + 4
SPAN_SLACK = 4


class ExplicitFlow(Strict):
    """One flow: `size` bytes from `src` to `dst` at `start`."""

    src: str = Field(description="sending host")
    dst: str = Field(description="receiving host")
    size_bytes: SizeBytes = Field(alias="size", description="message bytes, 1 B .. 2 GiB - 1")
    start_ns: DurationNs = Field(0, alias="start",
                                 description="fabric time after the run's common start t0")
    tclass: str | int | None = Field(None, description="its traffic class (default: the "
                                                       "entry's)")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class GeneratedFlows(Strict):
    """Flows drawn from a flow-size distribution at a target load (docs/flows.md)."""

    distribution: str = Field(description="web_search, hadoop, alibaba_storage, google_rpc "
                              "(configs/distributions/), or a CDF file: two columns, size "
                              "bytes and cumulative probability (fraction or percent), a "
                              "relative path from the directory testbed runs in")
    load: Annotated[float, WithJsonSchema({"anyOf": [
        {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        {"type": "string", "pattern": r"^\s*[0-9]+(\.[0-9]*)?\s*%\s*$"}]})] = Field(
        gt=0, le=1, description="each host sends this fraction of its line "
                        "rate (payload bytes), 0 < load <= 1, or a percent: 30%")
    duration_ns: DurationNs = Field(alias="duration", description="flows start within this "
                                    "fabric time")
    start_ns: DurationNs = Field(0, alias="start", description="when the first may start, "
                                 "fabric time after t0")
    seed: int = Field(1, ge=0, description="the generator's seed: the same seed, the same "
                      "flows")
    hosts: list[str] | None = Field(None, description="the hosts it draws sources and "
                                    "destinations from (or the entry's hosts; default all)")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @field_validator("load", mode="before")
    @classmethod
    def _percent(cls, value: object) -> object:
        if isinstance(value, str) and value.strip().endswith("%"):
            try:
                return float(value.strip()[:-1]) / 100
            except ValueError:
                raise ValueError(f"expected a fraction such as 0.3 or a percent such as "
                                 f"30%, got {value!r}") from None
        return value

    @field_validator("distribution")
    @classmethod
    def _distribution(cls, value: str) -> str:
        from testbed.workloads.flows_gen import CdfError, load_cdf
        try:
            load_cdf(value)
        except CdfError as e:
            raise ValueError(str(e)) from None
        return value


class IncastBursts(Strict):
    """Every `period`, one flow of `size` from each sender to the receiver at once."""

    senders: list[str] = Field(description="sending hosts")
    receiver: str = Field(description="the receiving host")
    size_bytes: SizeBytes = Field(alias="size", description="each sender's flow, bytes")
    period_ns: DurationNs | None = Field(None, alias="period", description="fabric time "
                                         "between bursts (needed with more than one)")
    bursts: int = Field(1, ge=1, le=1_000_000, description="how many bursts")
    start_ns: DurationNs = Field(0, alias="start", description="the first burst, fabric time "
                                 "after t0")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class FlowsTraffic(RdmaCcEntry):
    """Sized flows over the user-space RoCEv2 RC transport (agents/flows): explicit
    `flows:`, `generate:`d from a flow-size distribution with Poisson arrivals at a
    target load, and `incast:` bursts, in any mix. Each flow is one RDMA WRITE on a QP
    of its own (its own UDP source port, its congestion control starting at line rate,
    as HPCC's ns-3 makes a QP per flow), timed from its start to the sender's completion.
    With `transport: uet` each flow is one WRITE over the host's Ultra Ethernet NIC
    instead (one PDC per peer host, every packet sprayed, NSCC or receiver credit).
    """

    name: str = Field(pattern=NAME_RE, description="the entry's name: lower-case letters, "
                      "digits and _, unique in the workload; agents and results carry it")
    kind: Literal["flows"] = Field(description="flows: sized flows, each one RDMA WRITE")
    hosts: list[str] | None = Field(None, description="the hosts `generate` draws sources "
                                    "and destinations from (default all)")
    flows: list[ExplicitFlow] = Field(default_factory=list, description="explicit flows")
    generate: GeneratedFlows | None = Field(None, description="generated flows")
    incast: list[IncastBursts] = Field(default_factory=list, description="incast bursts")
    time_offset_ns: DurationNs = Field(
        0, alias="time_offset", description="added to every start in fct.txt, so a flow file "
        "imported from HPCC keeps its absolute times there")
    fct_dport: int | None = Field(
        None, ge=0, le=65535, description="the destination port fct.txt shows for these "
        "flows in place of their real one: HPCC's analysis/fct_analysis.py picks flows by it "
        "(100 normal, 200 incast)")
    window_packets: Annotated[int, Field(ge=1, le=MAX_ROCE_WINDOW_PACKETS)] | Literal[
        "auto"] = Field("auto", alias="window", description="most unacknowledged packets per "
                        "QP, or auto (as roce entries: docs/roce.md, 'In-flight window')")
    transport: Literal["roce", "uet"] = Field(
        "roce", description="roce: each flow one RDMA WRITE on a QP of its own (RoCEv2 RC); "
        "uet: each flow one WRITE over the host's Ultra Ethernet NIC (UDP 4793, one PDC "
        "per peer host, packets sprayed over `entropies` source ports; docs/uet.md)")
    cc: Literal["dcqcn", "dctcp", "none", "nscc", "credit"] = Field(
        "dcqcn", description="congestion control: roce: dcqcn, dctcp or none (sender rate "
        "control and receiver CNPs); uet: nscc (sender window on ECN and delay), credit "
        "(receiver-paced credit) or none; default dcqcn, nscc with transport: uet")
    entropy: Literal["spray", "oblivious", "reps"] | None = Field(
        None, description="uet: how each packet's UDP source port is picked: spray (round "
        "robin over the entropies, the default), oblivious (one per PDC, like RoCE), reps "
        "(keep the ports whose ACKs came back unmarked)")
    entropies: int | None = Field(None, ge=1, le=4096, description="uet: UDP source ports "
                                  "a NIC sprays over (default 16)")
    cc_preset: CcPresetName | None = Field(None, description=CC_PRESET_DESCRIPTION)
    cnp_interval_ns: DurationNs | None = Field(
        None, alias="cnp_interval", description="receiver: at most one CNP per QP per this "
        "fabric time (default: the preset's)")
    cc_params: DcqcnCcParams | DctcpCcParams | None = Field(
        None, description="DCQCN or DCTCP parameters (as `cc`) in place of the preset's")
    tclass: str | int = Field("roce", description="traffic class of its flows (a flow may "
                              "name its own); with cc, a class that marks ECN")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _uet_cc(cls, data: object) -> object:
        # The default cc follows the transport: DCQCN for RoCE, NSCC for UET.
        if isinstance(data, dict) and data.get("transport") == "uet" and "cc" not in data:
            return {**data, "cc": "nscc"}
        return data


UET_CCS = ("nscc", "credit", "none")
UET_UDP_PORT = 4793                 # Ultra Ethernet's: one NIC per host binds it
UET_ENTROPIES = 16                  # source ports a UET NIC sprays over by default
UET_BASE_RTT_NS = 10_000            # NSCC's base RTT where the plan gives none
UET_HEADER_BYTES = 20 + 8 + 16 + 44   # IPv4, UDP, PDS (credit: 16), SES standard


def uet_payload_bytes(ctx: ExpandContext) -> int:
    """A UET packet's payload: the RoCE MTU (4096 by default), less where the fabric MTU
    cannot take it with UET's headers."""
    return max(256, min(ctx.roce_mtu_bytes, ctx.mtu_bytes - UET_HEADER_BYTES))
ROCE_CCS = ("dcqcn", "dctcp", "none")


def planned_flows(t: FlowsTraffic, hosts: Sequence[str], line_rate_bps: dict[str, int],
                  generated: list[FlowSpec] | None = None) -> list[FlowSpec]:
    """Every flow of the entry, in start order (explicit, generated and incast merged);
    `generated`: the entry's generated flows if they were drawn already."""
    out = [FlowSpec(f.src, f.dst, f.size_bytes, f.start_ns, f.tclass) for f in t.flows]
    if t.generate is not None:
        out += generated if generated is not None else generated_flows(t, hosts,
                                                                       line_rate_bps)
    if t.incast:
        from testbed.workloads.flows_gen import incast_flows

        for b in t.incast:
            out += incast_flows(b.senders, b.receiver, b.size_bytes, b.period_ns or 0,
                                b.bursts, b.start_ns)
    return sorted(out, key=lambda f: f.start_ns)     # stable: config order within a time


def generated_flows(t: FlowsTraffic, hosts: Sequence[str],
                    line_rate_bps: dict[str, int]) -> list[FlowSpec]:
    """The entry's `generate:` flows (none without it)."""
    if t.generate is None:
        return []
    from testbed.workloads.flows_gen import load_cdf, poisson_flows

    g = t.generate
    return poisson_flows(_generate_hosts(t, hosts), line_rate_bps, load_cdf(g.distribution),
                         g.load, g.duration_ns, g.start_ns, g.seed)


def _span_ns(flows: Sequence[FlowSpec], rates: dict[str, int], mtu_bytes: int) -> int:
    """FlowsKind.span_ns of planned flows."""
    load: dict[str, int] = {}
    for f in flows:
        w = message_wire_bytes(f.size_bytes, mtu_bytes)
        load[f.src] = load.get(f.src, 0) + w
        load[f.dst] = load.get(f.dst, 0) + w
    busiest = max((math.ceil(n * 8 * 10**9 / rates[h]) for h, n in load.items()), default=0)
    return max((f.start_ns for f in flows), default=0) + SPAN_SLACK * busiest


def message_wire_bytes(size_bytes: int, mtu_bytes: int) -> int:
    """What a message of `size_bytes` costs on the wire as one RDMA WRITE of
    ceil(size / mtu) packets: the payload, per packet BTH + ICRC and the UDP/IPv4/Ethernet
    framing (66 B with FCS, preamble and inter-frame gap), and the RETH once."""
    packets = max(1, -(-size_bytes // mtu_bytes))
    return size_bytes + packets * (BTH_ICRC_BYTES + WIRE_OVERHEAD_BYTES) + RETH_BYTES


@functools.lru_cache(maxsize=256)
def _parsed(text: str) -> dict:
    return json.loads(text)


def _generate_hosts(t: FlowsTraffic, hosts: Sequence[str]) -> list[str]:
    """The hosts generated flows run among: generate.hosts, the entry's hosts, or all."""
    g = t.generate
    return list((g.hosts if g is not None else None) or t.hosts or hosts)


def _generated_stats(t: FlowsTraffic, hosts: Sequence[str], rates: dict[str, int],
                     flows: Sequence[FlowSpec]) -> dict | None:
    """How the generated `flows` came out: their count against what the load and the
    distribution's mean make, and the KS distance of their sizes from its CDF."""
    if t.generate is None:
        return None
    from testbed.workloads.flows_gen import ks_bound, ks_distance, load_cdf

    g = t.generate
    cdf = load_cdf(g.distribution)
    members = _generate_hosts(t, hosts)
    expected = sum(g.load * rates[h] * g.duration_ns / 8e9 for h in members) / cdf.mean_bytes
    return {"distribution": g.distribution, "flows": len(flows),
            "expected_flows": round(expected, 1),
            "ks": round(ks_distance(cdf, [f.size_bytes for f in flows]), 4),
            "ks_bound": round(ks_bound(len(flows)), 4)}


def ideal_fct_ns(size_bytes: int, mtu_bytes: int, line_rate_bps: int, base_rtt_ns: int) -> int:
    """A flow's completion time alone on an idle fabric, fabric ns: the base round trip
    of its path (testbed/plan/paths.base_round_trip_ns) plus its wire bytes
    (message_wire_bytes) at the sender's line rate, rounded up to a whole ns.

    HPCC's third.cc (qp_finish) does the same: base_rtt (pairRtt) + total_bytes x 8 / the
    path's bottleneck rate, total_bytes = size + packets x its header size (ppp + IPv4 +
    UDP + its sequence header, the INT header left out); it counts no Ethernet framing,
    preamble or inter-frame gap and no RETH, and rounds down. The ImmDt (4 B) of our
    WRITE with immediate and the last packet's pad (< 4 B) are left out here too."""
    if size_bytes < 1 or mtu_bytes < 1 or line_rate_bps < 1:
        raise ValueError(f"ideal_fct_ns: size {size_bytes}, mtu {mtu_bytes} and rate "
                         f"{line_rate_bps} must be positive")
    bits_ns = message_wire_bytes(size_bytes, mtu_bytes) * 8 * 10**9
    return base_rtt_ns + -(-bits_ns // line_rate_bps)


def _schedule_rows(doc: dict) -> list[list]:
    return doc.get("out", [])


class FlowsKind(WorkloadKind):
    shapes: ClassVar = {"flows": Shape.ALL_TO_ALL}
    model: ClassVar = FlowsTraffic
    agent_module: ClassVar = "agents.flows"
    doc: ClassVar = ("sized flows (explicit, generated from a flow-size distribution at a "
                     "target load, incast bursts), each one RDMA WRITE on a QP of its own, "
                     "timed to completion like HPCC's fct.txt (agents/flows): one agent per "
                     "host that sends or receives a flow.")
    ports: ClassVar = {"udp": range(FLOWS_UDP_PORT, FLOWS_UDP_PORT + FLOWS_MAX_ENTRIES)}
    example: ClassVar = {"name": "fct", "kind": "flows", "flows": [
        {"src": "h1", "dst": "h4", "size": "1MB", "start": "10us"},
        {"src": "h2", "dst": "h4", "size": "64KB", "start": "20us"}]}
    console_columns: ClassVar = (
        ("flows", "flows"), ("finished", "finished"), ("p50 slowdown", "slowdown_p50"),
        ("p99 slowdown", "slowdown_p99"), ("max FCT us", "fct_max_us"),
        ("retrans", "retransmissions"))
    result_fields: ClassVar = {
        "flows": "flows the entry planned",
        "finished": "flows that completed (the sender got the last ACK)",
        "unfinished": "flows that did not (still running when the run stopped, or failed)",
        "failed": "flows whose QP went to the error state",
        "bytes": "message bytes of the finished flows",
        "rx_bytes": "message bytes the receivers took in order, every flow (what the run's "
                    "delivered total counts)",
        "cc": "congestion control and preset, e.g. dcqcn/hpcc-ns3-paper",
        "slowdown_p50": "median FCT slowdown (fct / ideal, floored at 1) of finished flows",
        "slowdown_p99": "99th percentile slowdown",
        "fct_p50_us": "median FCT, fabric us", "fct_max_us": "longest FCT, fabric us",
        "posted_late_max_us": "the latest a flow was posted after its start (the agent was "
                              "busy), fabric us; FCTs count from the post",
        "retransmissions": "packets sent again, all flows (uet: every PDC of the entry's "
                           "NICs: NACK, SACK and timeout resends)",
        "timeouts": "ACK timeouts, all flows (uet: retransmission timeouts of the PDCs)",
        "cnps_received": "CNPs the senders got (uet: none, it has no CNP)",
        "ce_received": "CE-marked packets the receivers got",
        "transport": "roce or uet (the entry's transport)",
        "entropy": "uet: how the NICs picked source ports (spray, oblivious, reps); null "
                   "for roce",
        "trims": "uet: trimmed packets the entry's receiving NICs got (each one NACKed and "
                 "resent at once); null for roce",
    }

    def describe(self, spec: AgentSpec) -> str:
        return f"flows agent {spec.name}"

    def check(self, entry: TrafficEntry, loc: tuple, ctx: CheckContext) -> Iterator[Problem]:
        assert isinstance(entry, FlowsTraffic)
        t = entry
        if not (t.flows or t.generate or t.incast):
            yield loc, ("a flows entry needs flows: (explicit), generate: (from a "
                        "distribution) or incast: (bursts), or a mix")
        yield from _check_class(t, loc + ("tclass",), t.tclass, ctx)
        yield from _check_transport(t, loc, ctx)
        for i, f in enumerate(t.flows):
            yield from _check_flow(t, loc + ("flows", i), f, ctx)
        for i, b in enumerate(t.incast):
            yield from _check_incast(loc + ("incast", i), b, ctx)
        if t.generate is not None:
            if t.generate.hosts is not None and t.hosts is not None:
                yield loc + ("generate", "hosts"), ("hosts is given twice, here and as the "
                                                    "entry's hosts; keep one of them")
            where = loc + (("generate", "hosts") if t.generate.hosts is not None
                           else ("hosts",))
            for j, h in enumerate(t.generate.hosts or []):
                yield from _check_host(where + (j,), h, ctx)
            if len(_generate_hosts(t, ctx.hosts)) < 2:
                yield where, "generated flows need at least two hosts"
        bad = preset_problem(t.cc, t.cc_preset) if t.transport == "roce" else None
        if bad is not None:
            yield loc + (bad[0],), bad[1]
        senders = ([f.src for f in t.flows] + [s for b in t.incast for s in b.senders]
                   + (_generate_hosts(t, ctx.hosts) if t.generate is not None else []))
        yield from cc_params_problems(t, loc, senders, ctx.nic_bps)

    def host_ports(self, entry: TrafficEntry,
                   ctx: CheckContext) -> dict[str, list[tuple[str, int, str]]]:
        """With transport: uet, each of the entry's hosts runs a UET NIC on UDP 4793."""
        assert isinstance(entry, FlowsTraffic)
        t = entry
        if t.transport != "uet":
            return {}
        hosts = ({f.src for f in t.flows} | {f.dst for f in t.flows}
                 | {h for b in t.incast for h in (*b.senders, b.receiver)}
                 | (set(_generate_hosts(t, ctx.hosts)) if t.generate is not None else set()))
        return {h: [("udp", UET_UDP_PORT, "the UET NIC of this flows entry")]
                for h in sorted(hosts)}

    # -- expansion

    def expand(self, entry: TrafficEntry, index: int, ctx: ExpandContext) -> list[AgentSpec]:
        """One agent per host that sends or receives any of the entry's flows."""
        assert isinstance(entry, FlowsTraffic)
        t = entry
        state = ctx.state("flows")
        n = state.get("entries", 0)
        state["entries"] = n + 1
        if n >= FLOWS_MAX_ENTRIES:
            raise ValueError(f"at most {FLOWS_MAX_ENTRIES} flows entries in one workload")
        first_id = state.get("next_id", 0)
        port = FLOWS_UDP_PORT + n
        rates = {h: ctx.line_rate_bps(h) for h in ctx.hosts}
        generated = generated_flows(t, ctx.hosts, rates)
        flows = planned_flows(t, ctx.hosts, rates, generated)
        if first_id + len(flows) > FLOWS_MAX_FLOWS:
            raise ValueError(f"more than {FLOWS_MAX_FLOWS} flows in one run")
        state["next_id"] = first_id + len(flows)
        mtu = ctx.roce_mtu_bytes
        tc_of = {c: ctx.tc(c) for c in {f.tclass or t.tclass for f in flows} | {t.tclass}}
        dscp_of = {c: ctx.dscp(c) for c in tc_of}
        out: dict[str, list] = {}
        inc: dict[str, list] = {}
        for k, f in enumerate(flows):
            fid = first_id + k
            c = f.tclass or t.tclass
            out.setdefault(f.src, []).append(
                [fid, ctx.address(f.dst), port, f.size_bytes, f.start_ns, dscp_of[c], f.dst,
                 tc_of[c]])
            inc.setdefault(f.dst, []).append([fid, ctx.address(f.src), f.size_bytes])
        cc = ["--cc", t.cc] + (["--cc-preset", t.preset] if t.preset else [])
        overrides = t.cc_overrides()
        if overrides:
            cc += ["--cc-params", json.dumps(overrides, sort_keys=True, separators=(",", ":"))]
        cnp = ctx.cnp_dscp
        cnp_interval = ([] if t.cnp_interval_ns is None or t.cc == "none"
                        else ["--cnp-interval-ns", str(t.cnp_interval_ns)])
        rtt_ns = ctx.round_trip_ns(ctx.tc(t.tclass)) if t.window_packets == "auto" else None
        stats = _generated_stats(t, ctx.hosts, rates, generated)
        span_ns = _span_ns(flows, rates, mtu)
        specs: list[AgentSpec] = []
        for h in [h for h in ctx.hosts if h in out or h in inc]:
            line_bps = ctx.line_rate_bps(h)
            window = (roce_window_packets(line_bps, rtt_ns, mtu) if rtt_ns is not None
                      else int(t.window_packets))
            if t.transport == "uet":
                peers = {row[6] for row in out.get(h, [])} | {
                    f.src for f in flows if f.dst == h}
                specs.append(AgentSpec(
                    name=f"{t.name}-{h}", node=h, role="sender", traffic=t.name,
                    kind=t.kind, module=self.agent_module, src=h, dst="",
                    duration_ns=span_ns,
                    argv=["--bind", ctx.address(h), "--port", str(port),
                          "--transport", "uet", "--uet-cc", t.cc,
                          "--entropy", t.entropy or "spray",
                          "--entropies", str(t.entropies or UET_ENTROPIES),
                          "--payload-bytes", str(uet_payload_bytes(ctx)),
                          "--base-rtt-ns", str(max((ctx.base_rtt_ns(h, p) for p in peers),
                                                   default=0) or UET_BASE_RTT_NS),
                          "--dscp", str(ctx.dscp(t.tclass)),
                          "--line-rate-bps", str(line_bps), "--window-packets", str(window),
                          "--dilation", str(ctx.dilation), "--spin-ns", str(ROCE_SPIN_NS),
                          "--seed", str(first_id + 1)],
                    inputs=(("schedule.json", json.dumps(
                        {"out": out.get(h, []), "in": inc.get(h, []),
                         "time_offset_ns": t.time_offset_ns, "fct_dport": t.fct_dport,
                         **({"generated": stats} if stats and not specs else {})},
                        separators=(",", ":"))),)))
                continue
            doc = {"out": out.get(h, []), "in": inc.get(h, []),
                   "time_offset_ns": t.time_offset_ns, "fct_dport": t.fct_dport}
            if stats and not specs:              # the entry's first agent carries them
                doc["generated"] = stats
            specs.append(AgentSpec(
                name=f"{t.name}-{h}", node=h, role="sender", traffic=t.name, kind=t.kind,
                module=self.agent_module, src=h, dst="",
                duration_ns=span_ns,
                argv=["--bind", ctx.address(h), "--port", str(port), "--mtu", str(mtu),
                      "--dscp", str(ctx.dscp(t.tclass)), *cc,
                      *(["--cnp-dscp", str(cnp)] if cnp is not None else []), *cnp_interval,
                      "--line-rate-bps", str(line_bps), "--window-packets", str(window),
                      "--dilation", str(ctx.dilation), "--spin-ns", str(ROCE_SPIN_NS)],
                inputs=(("schedule.json", json.dumps(doc, separators=(",", ":"))),)))
        return specs

    def span_ns(self, entry: TrafficEntry, ctx: ExpandContext | None) -> int:
        """The last flow's start plus SPAN_SLACK times what the busiest host takes to
        move all of its bytes at line rate. Flows have no scheduled end: the agents exit
        when their flows are done, and the run waits for them. This only bounds how long
        it waits before stopping agents that never finish (beyond its 30 s of wall time),
        so it allows a fabric, or an agent short of CPU, four times slower than line rate
        before it cuts flows short (they are listed unfinished then)."""
        assert isinstance(entry, FlowsTraffic)
        if ctx is None:
            starts = [f.start_ns for f in entry.flows] + [
                b.start_ns + (b.bursts - 1) * (b.period_ns or 0) for b in entry.incast]
            if entry.generate is not None:
                starts.append(entry.generate.start_ns + entry.generate.duration_ns)
            return max(starts, default=0)
        rates = {h: ctx.line_rate_bps(h) for h in ctx.hosts}
        return _span_ns(planned_flows(entry, ctx.hosts, rates), rates, ctx.roce_mtu_bytes)

    def startup_wall_s(self, spec: AgentSpec) -> float:
        return FLOWS_STARTUP_S

    def files_argv(self, spec: AgentSpec, files: AgentFiles) -> list[str]:
        return ["--schedule", str(files.inputs["schedule.json"]),
                "--ready-file", str(files.ready), "--out", str(files.out)]

    # -- results

    @staticmethod
    def _schedule(spec: AgentSpec) -> dict:
        """The agent's schedule (parsed once: results, accounts and notes all read it)."""
        return _parsed(dict(spec.inputs).get("schedule.json", "{}"))

    def _finished(self, specs: Sequence[AgentSpec], results: Results
                  ) -> tuple[dict[int, dict], dict[int, dict]]:
        """Per flow id: the sender's columns and the receiver's, as dicts."""
        sent: dict[int, dict] = {}
        received: dict[int, dict] = {}
        for spec in specs:
            res = results.get(spec.name) or {}
            for side, into in (("sent", sent), ("received", received)):
                cols = res.get(side) or {}
                ids = cols.get("flow_id") or []
                for i, fid in enumerate(ids):
                    into[int(fid)] = {k: v[i] for k, v in cols.items() if i < len(v)}
        return sent, received

    def flow_records(self, specs: Sequence[AgentSpec], results: Results,
                     view: RunView) -> list[FlowRecord]:
        sent, received = self._finished(specs, results)
        records = []
        for spec in specs:
            doc = self._schedule(spec)
            offset = int(doc.get("time_offset_ns", 0))
            src_ip = view.address(spec.node)
            rate = view.line_rate_bps(spec.node)
            for fid, dst_ip, dport, size, start, _dscp, dst, tc in _schedule_rows(doc):
                s = sent.get(fid, {})
                done, posted = s.get("done_ns"), s.get("posted_ns")
                fct = (int(done) - int(posted)) if done is not None and posted is not None \
                    else None
                r = received.get(fid, {})
                records.append(FlowRecord(
                    workload=spec.traffic, flow_id=fid, src=spec.node, dst=dst,
                    src_ip=src_ip, dst_ip=dst_ip, sport=int(s.get("sport") or 0),
                    dport=dport, size_bytes=size, start_ns=start, fct_ns=fct,
                    ideal_fct_ns=ideal_fct_ns(size, view.roce_mtu_bytes, rate,
                                              view.base_rtt_ns(spec.node, dst)),
                    tc=tc, time_offset_ns=offset,
                    extra={"posted_late_ns": (int(posted) - start) if posted is not None
                           else None,
                           "retransmissions": s.get("retransmissions"),
                           "timeouts": s.get("timeouts"),
                           "cnps_received": s.get("cnps_received"),
                           "ce_received": r.get("ce_packets"),
                           "rx_done_ns": r.get("done_ns"),
                           "error": s.get("error"),
                           **({"fct_dport": doc["fct_dport"]} if doc.get("fct_dport")
                              is not None else {})}))
        records.sort(key=lambda r: r.flow_id)
        return records

    def result_rows(self, specs: Sequence[AgentSpec], results: Results,
                    view: RunView) -> list[ResultRow]:
        """One row per entry: its flows and their FCT slowdowns."""
        by_entry: dict[str, list[FlowRecord]] = {}
        for rec in self.flow_records(specs, results, view):
            by_entry.setdefault(rec.workload, []).append(rec)
        rows: list[ResultRow] = []
        for traffic in dict.fromkeys(s.traffic for s in specs):
            spec = next(s for s in specs if s.traffic == traffic)
            recs = by_entry.get(spec.traffic, [])
            done = [r for r in recs if r.fct_ns is not None]
            slow = sorted(float(r.slowdown or 1.0) for r in done)
            fcts = sorted(int(r.fct_ns or 0) for r in done)
            late = [int(r.extra.get("posted_late_ns") or 0) for r in recs
                    if r.extra.get("posted_late_ns") is not None]
            res = next((results.get(s.name) for s in specs if s.traffic == spec.traffic
                        and results.get(s.name)), None) or {}

            def total(key: str, recs: list[FlowRecord] = recs) -> int:
                return sum(int(r.extra.get(key) or 0) for r in recs)

            uet = arg_of(spec.argv, "--transport") == "uet"

            def agents_total(key: str, traffic: str = spec.traffic) -> int:
                return sum(int((results.get(s.name) or {}).get(key) or 0) for s in specs
                           if s.traffic == traffic)
            rows.append(ResultRow(spec.traffic, spec.kind, {
                "flows": len(recs), "finished": len(done), "unfinished": len(recs) - len(done),
                "failed": sum(1 for r in recs if r.extra.get("error") not in (None,
                                                                              "unfinished")),
                "bytes": sum(r.size_bytes for r in done),
                "rx_bytes": sum(int((results.get(s.name) or {}).get("rx_bytes") or 0)
                                for s in specs if s.traffic == spec.traffic),
                "cc": "/".join(str(x) for x in (res.get("cc"), res.get("cc_preset")) if x),
                "slowdown_p50": _pct(slow, 0.5), "slowdown_p99": _pct(slow, 0.99),
                "fct_p50_us": _us(_pct(fcts, 0.5)), "fct_max_us": _us(fcts[-1] if fcts
                                                                      else None),
                "posted_late_max_us": _us(max(late, default=None)),
                "retransmissions": (agents_total("retransmissions") if uet
                                    else total("retransmissions")),
                "timeouts": agents_total("timeouts") if uet else total("timeouts"),
                "cnps_received": total("cnps_received"), "ce_received": total("ce_received"),
                "transport": "uet" if uet else "roce",
                "entropy": res.get("entropy") if uet else None,
                "trims": agents_total("trims_received") if uet else None,
            }))
        return rows

    def stream_accounts(self, specs: Sequence[AgentSpec], results: Results,
                        flow_drops: Sequence[dict], view: RunView) -> list[dict]:
        """One account per (entry, source, destination) pair of hosts: the data packets
        its flows sent and the receiver took, and the fabric's drops of them."""
        uet = [s for s in specs if arg_of(s.argv, "--transport") == "uet"]
        accounts = _uet_accounts(uet, results, flow_drops, view) if uet else []
        specs = [s for s in specs if s not in uet]
        sent, received = self._finished(specs, results)
        pairs: dict[tuple[str, str, str], dict] = {}
        for spec in specs:
            doc = self._schedule(spec)
            for fid, _dst_ip, dport, _size, _start, _dscp, dst, _tc in _schedule_rows(doc):
                key = (spec.traffic, spec.node, dst)
                p = pairs.setdefault(key, {"sent": 0, "received": 0, "ooo": 0,
                                           "sports": set(), "dport": dport,
                                           "complete": True})
                s, r = sent.get(fid), received.get(fid)
                p["sent"] += int((s or {}).get("packets") or 0)
                p["received"] += int((r or {}).get("packets") or 0)
                p["ooo"] += int((r or {}).get("ooo_drops") or 0)
                if s and s.get("sport"):
                    p["sports"].add(int(s["sport"]))
        have = {s.node for s in specs if results.get(s.name)}
        # what each receiving agent's socket dropped (SO_RXQ_OVFL), shared out over the
        # streams into it that miss packets: one socket takes every flow into a host
        budget = {(s.traffic, s.node): int((results.get(s.name) or {}).get(
            "rx_socket_drops") or 0) for s in specs}
        out = []
        for (traffic, src, dst), p in pairs.items():
            drops = flow_drops_of(flow_drops, view.addresses(src), view.address(dst),
                                  p["dport"], p["sports"] or None)
            a = account(f"{traffic}-{src}-{dst}", "flows", src, dst, sent=p["sent"],
                        received=p["received"], drops=drops, reordered=0,
                        complete=src in have and dst in have)
            short = max(0, p["sent"] - p["received"] - a["fabric_drops"])
            a["socket_drops"] = min(budget.get((traffic, dst), 0), short)
            budget[traffic, dst] = budget.get((traffic, dst), 0) - a["socket_drops"]
            # out-of-order arrivals follow every loss until go-back-N resends
            a["lost_counted"] = a["lost_counted"] or a["socket_drops"] > 0
            a["reordered"] = 0 if a["lost_counted"] else p["ooo"]
            out.append(a)
        return accounts + out

    def fidelity_notes(self, specs: Sequence[AgentSpec], results: Results,
                       view: RunView) -> list[str]:
        notes = []
        fast = [r for r in self.flow_records(specs, results, view)
                if r.fct_ns is not None and r.fct_ns < FAST_SHARE * r.ideal_fct_ns]
        if fast:
            worst = min(fast, key=lambda r: (r.fct_ns or 0) / r.ideal_fct_ns)
            notes.append(f"{len(fast)} flows finished faster than their ideal FCT, at most "
                         f"{1 - (worst.fct_ns or 0) / worst.ideal_fct_ns:.0%} faster (flow "
                         f"{worst.flow_id}, {worst.size_bytes} B): the ideal counts the plan's "
                         "link delay, which this fabric does not emulate where the kernel has "
                         "no sch_netem (the propagation note), and each port's token bucket "
                         "lets a burst of two frames out back to back after an idle spell; "
                         "their slowdown reads 1")
        for spec in specs:
            res = results.get(spec.name) or {}
            who = self.describe(spec)
            if not res:
                notes.append(f"{who} on {spec.node} left no results")
                continue
            if res.get("error"):
                notes.append(f"{who} on {spec.node}: {res['error']}")
            ready = view.ready_mtime_ns(spec)
            if ready is not None and ready > view.t0_realtime_ns:
                notes.append(f"{who} on {spec.node} bound its port "
                             f"{(ready - view.t0_realtime_ns) / 1e6:.0f} ms (wall) after the "
                             "common start: flows to it before then were resent after an "
                             "ACK timeout")
            if res.get("rx_socket_drops"):
                notes.append(f"{who}: its receive socket dropped {res['rx_socket_drops']} "
                             "datagrams (the agent fell behind, not the fabric: a NIC would "
                             "have taken them); go-back-N resent them, so the FCTs of flows "
                             f"into {spec.node} include those resends")
            cols = res.get("sent") or {}
            errors = [e for e in cols.get("error") or [] if e not in (None, "unfinished")]
            if errors:
                notes.append(f"{who}: {len(errors)} flows failed ({errors[0]})")
            unfinished = sum(1 for e in cols.get("error") or [] if e == "unfinished")
            unfinished += int(res.get("flows_out", 0)) - len(cols.get("flow_id") or [])
            if unfinished:
                notes.append(f"{who}: {unfinished} flows had not finished when the run "
                             "stopped them (fct_ns empty in flows.csv)")
            doc = self._schedule(spec)
            gen = doc.get("generated")
            if gen and gen["ks"] > gen["ks_bound"]:
                notes.append(
                    f"{spec.traffic}: the {gen['flows']} generated flows' sizes depart from "
                    f"{gen['distribution']}'s CDF (KS distance {gen['ks']} > {gen['ks_bound']}"
                    f"): the window holds about {gen['expected_flows']:g} flows of its mean "
                    "size, and offering the load exactly took smaller ones where a large one "
                    "did not fit; lengthen generate.duration for the sizes to follow the CDF")
            totals = (res.get("uet") or {}).get("totals") or {}
            # a UET sender slowed by its congestion control saw marked ACKs or trims
            slow = None if any(totals.get(k) for k in ("ecn_echoes", "nacks_received",
                                                        "credits_received")) \
                else _cpu_bound(spec, doc, cols, view)
            if slow is not None:
                notes.append(f"{who}: while it had flows running it sent at {slow:.0%} of its "
                             "line rate with no CNP and no pause to slow it: the agent was "
                             "short of CPU for this packet rate (MTU and dilation), so its "
                             "FCTs measure the emulator; raise the dilation")
            starts = {row[0]: row[4] for row in _schedule_rows(doc)}
            late = [p - starts.get(f, p) for f, p in zip(cols.get("flow_id") or [],
                                                          cols.get("posted_ns") or [],
                                                          strict=False)]
            n_late = sum(1 for x in late if x > FLOWS_LATE_NS)
            blocked = int((res.get("tx_sockets") or {}).get("send_eagain") or 0)
            if n_late:
                why = ("the agent was short of CPU" if not blocked else
                       f"the agent was short of CPU, or blocked: {blocked} of its sends "
                       "waited out the send timeout on a full NIC queue (a paused port), "
                       "which holds back the posts of its next flows")
                notes.append(f"{who}: {n_late} of {len(late)} flows were posted more than "
                             f"{FLOWS_LATE_NS / 1e3:g} us (fabric) after their start, at most "
                             f"{max(late) / 1e3:.1f} us: {why}; their FCTs count from the "
                             "post")
        return notes


def _uet_accounts(specs: Sequence[AgentSpec], results: Results, flow_drops: Sequence[dict],
                  view: RunView) -> list[dict]:
    """Over UET every flow between two hosts rides one PDC, so a pair's packets are its
    PDC's: the source NIC's data packets to the destination (retransmissions and the
    packets a switch then trimmed included) and the destination NIC's from the source
    (trimmed ones included: they arrived, short). Packets of a PDC arrive out of order by
    design (sprayed over paths), so no reordering is counted against the emulator."""
    by_host = {s.node: s for s in specs}
    out = []
    for spec in specs:
        traffic = spec.traffic
        res = results.get(spec.name) or {}
        pdcs = (res.get("uet") or {}).get("pdcs") or {}
        dsts = sorted({row[6] for row in _schedule_rows(FlowsKind._schedule(spec))})
        for dst in dsts:
            dst_ip = view.address(dst)
            peer_spec = by_host.get(dst)
            peer = (results.get(peer_spec.name) or {}) if peer_spec else {}
            src_ips = view.addresses(spec.node)
            rx = next(((peer.get("uet") or {}).get("pdcs") or {}).get(ip) for ip in src_ips
                      if ((peer.get("uet") or {}).get("pdcs") or {}).get(ip)) if peer else None
            sports = set((res.get("uet") or {}).get("sockets", {}).get("sports") or []) or None
            drops = flow_drops_of(flow_drops, src_ips, dst_ip, UET_UDP_PORT, sports)
            a = account(f"{traffic}-{spec.node}-{dst}", "flows", spec.node, dst,
                        sent=int((pdcs.get(dst_ip) or {}).get("tx_packets") or 0),
                        received=int((rx or {}).get("rx_packets") or 0), drops=drops,
                        reordered=0, complete=bool(res) and bool(peer))
            a["socket_drops"] = 0
            out.append(a)
    return out


def _check_transport(t: FlowsTraffic, loc: tuple, ctx: CheckContext) -> Iterator[Problem]:
    """cc values of the other transport, RoCE-only and UET-only fields, UET's class."""
    if t.transport == "roce":
        if t.cc not in ROCE_CCS:
            yield loc + ("cc",), (f"cc {t.cc} is Ultra Ethernet's; with transport: roce use "
                                  f"{', '.join(ROCE_CCS)}, or set transport: uet")
        for name in ("entropy", "entropies"):
            if getattr(t, name) is not None:
                yield loc + (name,), (f"{name} is for transport: uet (RoCE picks one UDP "
                                      "source port per QP); drop it or set transport: uet")
        return
    if t.cc not in UET_CCS:
        yield loc + ("cc",), (f"cc {t.cc} is RoCE's; with transport: uet use "
                              f"{', '.join(UET_CCS)}")
    for name, alias in (("cc_preset", "cc_preset"), ("cc_params", "cc_params"),
                        ("cnp_interval_ns", "cnp_interval")):
        if getattr(t, name) is not None:
            yield loc + (alias,), (f"{alias} is RoCE's DCQCN/DCTCP setting; transport: uet "
                                   "has none (docs/uet-cc.md); drop it")
    if "tclass" not in t.model_fields_set:
        yield loc + ("tclass",), ("transport: uet needs its traffic class named: a lossy "
                                  "class (with trim: true to trim instead of drop), not the "
                                  "lossless roce class PFC protects")
    for i, f in enumerate(t.flows):
        if f.tclass is not None and f.tclass != t.tclass:
            yield loc + ("flows", i, "tclass"), ("a UET NIC sends every flow in its entry's "
                                                 "class; drop this flow's tclass")


def _check_host(where: tuple, name: str, ctx: CheckContext) -> Iterator[Problem]:
    if name not in ctx.hosts:
        yield where, f"unknown host {name!r}; hosts are {', '.join(ctx.hosts)}"


def _check_class(t: FlowsTraffic, where: tuple, name: str | int,
                 ctx: CheckContext) -> Iterator[Problem]:
    c = ctx.classes.get(name)
    if c is None:
        yield where, f"unknown traffic class {name!r}"
    elif t.cc == "nscc" and not c.ecn:
        yield where, (f"class {c.name!r} (TC{c.tc}) does not mark ECN, so NSCC never sees "
                      "a marked ACK; use a class with ecn: true, or cc: credit or none")
    elif t.cc not in ("none", "credit", "nscc") and not c.ecn:
        yield where, (f"class {c.name!r} (TC{c.tc}) does not mark ECN, so {t.cc.upper()} "
                      "never gets a CNP; use an ECN class (roce) or cc: none")


def _check_flow(t: FlowsTraffic, at: tuple, f: ExplicitFlow,
                ctx: CheckContext) -> Iterator[Problem]:
    yield from _check_host(at + ("src",), f.src, ctx)
    yield from _check_host(at + ("dst",), f.dst, ctx)
    if f.src == f.dst:
        yield at, f"a flow from {f.src!r} to itself"
    if f.tclass is not None and f.tclass != t.tclass:
        yield from _check_class(t, at + ("tclass",), f.tclass, ctx)
    if f.size_bytes >= 1 << 31:
        yield at + ("size",), "a flow is one RDMA message: at most 2 GiB - 1"


def _check_incast(at: tuple, b: IncastBursts, ctx: CheckContext) -> Iterator[Problem]:
    yield from _check_host(at + ("receiver",), b.receiver, ctx)
    if not b.senders:
        yield at + ("senders",), "an incast burst needs senders"
    for j, s in enumerate(b.senders):
        yield from _check_host(at + ("senders", j), s, ctx)
        if s == b.receiver:
            yield at + ("senders", j), f"{s!r} is the burst's receiver too"
    if b.size_bytes >= 1 << 31:
        yield at + ("size",), "a flow is one RDMA message: at most 2 GiB - 1"
    if b.bursts > 1 and not b.period_ns:
        yield at + ("bursts",), (f"{b.bursts} bursts need a period: the fabric time from "
                                 "one burst to the next")


# An agent that kept below this share of its line rate while it had flows to send, with
# nothing in the fabric telling it to slow down, was held back by its CPU.
CPU_BOUND_SHARE = 0.8
# A flow done in less than this share of its ideal FCT is named (the ideal's delay).
FAST_SHARE = 0.95
LONG_FLOW_NS = 50_000


def _cpu_bound(spec: AgentSpec, doc: dict, cols: dict, view: RunView) -> float | None:
    """The share of line rate an agent's flows went out at while any was running, if it
    is below CPU_BOUND_SHARE and no CNP reached it and no pause its host (else None)."""
    if spec.node in view.paused_nodes or any(cols.get("cnps_received") or []):
        return None
    rate = view.line_rate_bps(spec.node)
    # only flows long enough for the rate, not the round trip, to set their time
    size = {row[0]: row[3] for row in _schedule_rows(doc)
            if message_wire_bytes(row[3], view.roce_mtu_bytes) * 8e9 / rate
            >= max(LONG_FLOW_NS, 10 * view.base_rtt_ns(spec.node, row[6]))}
    spans = sorted((p, d, f) for f, p, d in zip(cols.get("flow_id") or [],
                                                 cols.get("posted_ns") or [],
                                                 cols.get("done_ns") or [], strict=False)
                   if p is not None and d is not None and f in size)
    if not spans:
        return None
    busy_ns, end = 0, None
    for p, d, _f in spans:
        start = p if end is None else max(p, end)
        if d > start:
            busy_ns += d - start
        end = d if end is None else max(end, d)
    wire = sum(message_wire_bytes(size[f], view.roce_mtu_bytes) for _p, _d, f in spans)
    share = wire * 8 * 1e9 / busy_ns / rate
    return share if share < CPU_BOUND_SHARE else None


def _pct(values: Sequence[float], p: float) -> float | None:
    """HPCC's get_pctl: the element at int(len * p) of the sorted values."""
    if not values:
        return None
    return round(float(values[min(len(values) - 1, int(len(values) * p))]), 4)


def _us(ns: float | None) -> float | None:
    return None if ns is None else round(ns / 1e3, 3)


KIND = FlowsKind()
