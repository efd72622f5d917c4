"""Collectives (`python -m agents.collectives`): all-reduce, reduce-scatter, all-gather,
broadcast and all-to-all over a communicator of hosts, one rank per host, data moved as
RDMA WRITEs with immediate on the user-space RoCE transport (so DCQCN, ECN and PFC act
on it as on any RoCE traffic), measured the way nccl-tests measures.

An entry becomes one worker per rank, all started together at the common start t0; rank
i runs on `ranks[i]`. Each worker listens for its peers' set-up on a TCP port and takes
RDMA traffic on a UDP port of its host, numbered per host over every communicator
(rdma_group.py), and gets every rank's address and ports in `--peers`. It sweeps message
sizes from `sizes.min` to `sizes.max` by `sizes.factor` (nccl-tests' -b -e -f), each
with `warmup` untimed and `iterations` timed runs, checks the last result of every size
against an exact reference (`#wrong`, never assumed 0) and reports per-iteration fabric
times.

Results (one row per size) follow nccl-tests: time is the slowest rank's mean over the
iterations (nccl-tests reduces the time over processes with max), algbw = size / time,
busbw = algbw x the operation's bus factor (all-reduce 2(n-1)/n; reduce-scatter,
all-gather, all-to-all (n-1)/n; broadcast 1); sizes are nccl-tests' (the bytes of the
larger buffer: count x n elements for reduce-scatter's input, all-gather's output and
all-to-all). results/<entry>.nccl.txt and .nccl.json hold its table and -J JSON.

With `transport: uet` the same workers move the data as UET SENDs over each host's
Ultra Ethernet NIC (UDP 4793, one per host; agents/collectives/uet.py) instead, and
`cc` takes UET's congestion controls and `entropy`, `entropies` apply (rdma_group.py).
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from pydantic import ConfigDict, Field, model_validator

from agents.collectives.ops import ALGORITHMS, BUS_FACTOR_FORMULA, ITEMSIZE, bus_factor, count_of
from agents.runtime.framing import WIRE_OVERHEAD_BYTES
from agents.wire.ina import HEADER_BYTES as INA_HEADER_BYTES
from agents.wire.ina import MAX_CONTRIBUTORS
from testbed.fields import NAME_RE, SizeBytes, Strict
from testbed.workloads.base import (
    AgentFiles,
    AgentSpec,
    CheckContext,
    ExpandContext,
    Problem,
    ResultRow,
    Results,
    RunView,
    Shape,
    TrafficEntry,
    WorkloadKind,
    arg_of,
)
from testbed.workloads.collective_accounts import ina_accounts, roce_accounts, uet_accounts
from testbed.workloads.collective_nccl import iteration_stats, json_report, table
from testbed.workloads.rdma_group import (
    GROUP_PORTS,
    INA_WORKER_PORT,
    PORT_OWNER,
    GroupTransportEntry,
    peers_arg,
    rank_ports,
    transport_argv,
    transport_problems,
    uet_host_ports,
)

CollectiveKindName = Literal["allreduce", "reducescatter", "allgather", "broadcast",
                             "alltoall"]
REDUCING = ("allreduce", "reducescatter")
AGGREGATOR_PORT = 11000                       # UDP of a switch's first aggregator
MAX_AGGREGATORS_PER_SWITCH = INA_WORKER_PORT - AGGREGATOR_PORT   # one per entry that uses it
# A worker imports numpy, connects to every peer and builds its buffers before t0.
STARTUP_PER_RANK_S = 0.3
# Waiting bounds (span_ns, work_wall_s), generous on purpose: fabric time per algorithm
# step (a step's latency on the default fabric is a few us), the CPU a rank's data
# generator spends per element (about 40 ns on this project's 2-core VMs), the cores a
# communicator may share, and the margin over that estimate.
STEP_ALLOWANCE_NS = 100_000
# The double binary tree ran at 1/4.4 of its alpha-beta model at 16 MiB (bench/collectives.py):
# a bound of 2x line rate stopped its 64 MiB size before the check.
SPAN_SLACK = 8
FILL_CPU_NS_PER_ELEMENT = 40
CPU_CORES_ASSUMED = 2
WORK_MARGIN = 3.0
# A 16-byte chunk header per message piece, BTH 12 + ICRC 4 per packet (besides
# WIRE_OVERHEAD_BYTES).
RETH_BYTES, BTH_ICRC_BYTES = 16, 12 + 4


class Sizes(Strict):
    """The message sizes a collective entry sweeps: min, min x factor, ... up to max."""

    min_bytes: SizeBytes = Field(1 << 20, alias="min", description="smallest message "
                                 "(nccl-tests -b); bytes of the larger buffer")
    max_bytes: SizeBytes = Field(1 << 20, alias="max", description="largest message "
                                 "(nccl-tests -e)")
    factor: int = Field(2, ge=2, le=1024, description="each size is the last x factor "
                                                       "(nccl-tests -f)")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @model_validator(mode="after")
    def _ordered(self) -> Sizes:
        if self.min_bytes > self.max_bytes:
            raise ValueError(f"min {self.min_bytes} B is above max {self.max_bytes} B")
        return self

    def each(self) -> list[int]:
        out, size = [], self.min_bytes
        while size <= self.max_bytes:
            out.append(size)
            size *= self.factor
        return out


class InaSettings(Strict):
    """The in-network all-reduce's switch resources and tree (algorithm: ina)."""

    slots: int = Field(128, ge=1, le=4096, description="aggregation slots per job and "
                       "switch (SwitchML's pool): chunks in flight per worker. A chunk's "
                       "slot stays busy for a round trip through the tree, so the pool must "
                       "cover the bandwidth-delay product: 128 x 8 KiB = 1 MiB is 84 us at "
                       "100 Gb/s")
    slot_elements: int = Field(2048, ge=1, le=16384, description="int32 elements per slot "
                               "(one packet's payload; 2048 = 8 KiB)")
    leaves: dict[str, list[str]] | None = Field(
        None, description="the tree's leaves, given: leaf switch -> the hosts of the ranks "
                          "whose aggregator it is (each host linked to its switch, every rank "
                          "under exactly one); leaf ids follow this order. Default: each "
                          "rank's first switch, leaves in rank order")
    root: str | None = Field(
        None, description="the switch of the tree's root aggregator, linked to every leaf "
                          "switch (a leaf itself only when there is one leaf). Default: the "
                          "first switch linked to every leaf; with one leaf, the leaf")

    model_config = ConfigDict(extra="forbid", frozen=True)


class CollectiveTraffic(GroupTransportEntry):
    """A collective over a communicator: one rank per host, swept over message sizes.

    Its RoCE transport fields are the training step's too (rdma_group.GroupTransportEntry).
    Data moves as RDMA WRITEs with immediate on the user-space RoCE transport, chunked
    and spread over `qps` queue pairs per pair of ranks, so DCQCN, ECN and PFC act on it.
    """

    name: str = Field(pattern=NAME_RE, description="the entry's name: lower-case letters, "
                      "digits and _, unique in the workload; agents and results carry it")
    kind: CollectiveKindName = Field(
        description="the collective operation: allreduce, reducescatter, allgather, "
                    "broadcast or alltoall (the MoE / expert-parallel exchange)")
    algorithm: str | None = Field(
        None, description="allreduce: ring (reduce-scatter + all-gather), rhd (recursive "
                          "halving-doubling), tree (double binary tree) or ina (in-network: "
                          "switch aggregators, a SHARP-like tree); the other operations "
                          "have one each (default: the operation's first)")
    sizes: Sizes = Field(default_factory=Sizes, description="the message sizes swept")
    redop: Literal["sum", "max"] = Field("sum", description="reduction (allreduce, "
                                                            "reducescatter)")
    root: int = Field(0, ge=0, description="broadcast: the rank whose data is sent")
    warmup: int = Field(1, ge=0, le=1000, description="untimed runs per size first")
    iterations: int = Field(5, ge=1, le=10000, description="timed runs per size")
    ina: InaSettings = Field(default_factory=InaSettings, description="algorithm ina: the "
                             "aggregators' slot pools and tree (an aggregator runs on each "
                             "rank's leaf switch, and on a switch joined to every leaf as the "
                             "root; ina.leaves and ina.root choose them)")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @property
    def op_algorithm(self) -> str:
        return self.algorithm or ALGORITHMS[self.kind][0]


class CollectiveKind(WorkloadKind):
    shapes: ClassVar = {name: Shape.GROUP for name in ALGORITHMS}
    model: ClassVar = CollectiveTraffic
    agent_module: ClassVar = "agents.collectives"
    doc: ClassVar = ("Collectives (agents/collectives): one worker per rank, all-reduce "
                     "(ring, recursive halving-doubling, double binary tree), reduce-scatter,"
                     " all-gather, broadcast and all-to-all as RDMA WRITEs with immediate over the "
                     "user-space RoCE transport (or, transport: uet, as UET SENDs over each "
                     "host's Ultra Ethernet NIC), swept over sizes the way nccl-tests does; "
                     "one row per size, also written as results/<entry>.nccl.txt and "
                     "results/<entry>.nccl.json (nccl-tests' table and -J JSON).")
    # UDP: RoCE 10000.., aggregators 11000.., ranks' aggregation sockets 11500..
    ports: ClassVar = GROUP_PORTS
    port_owner: ClassVar = PORT_OWNER
    example: ClassVar = {"name": "ar", "kind": "allreduce", "algorithm": "ring",
                         "ranks": ["h1", "h2", "h3", "h4"],
                         "sizes": {"min": "64KiB", "max": "1MiB", "factor": 4}}
    console_columns: ClassVar = (
        ("algorithm", "algorithm"), ("transport", "transport"), ("ranks", "ranks"),
        ("size (B)", "bytes"), ("type", "dtype"), ("time (us)", "time_us"),
        ("algbw (GB/s)", "algbw_gbps"), ("busbw (GB/s)", "busbw_gbps"),
        ("link (GB/s)", "effective_link_gbps"), ("retx", "retransmissions"),
        ("#wrong", "wrong"))
    result_fields: ClassVar = {
        "operation": "allreduce, reducescatter, allgather, broadcast or alltoall",
        "algorithm": "the algorithm (ring, rhd, tree, pairwise)",
        "ranks": "ranks in the communicator",
        "bytes": "message size as nccl-tests counts it (bytes of the larger buffer)",
        "count": "elements, as nccl-tests counts them",
        "dtype": "element type", "redop": "reduction (none where the operation has none)",
        "root": "broadcast's root rank (-1 for the other operations, as nccl-tests)",
        "time_us": "the slowest rank's mean time over the iterations, fabric us",
        "algbw_gbps": "bytes / time_us, fabric GB/s (10^9 bytes/s)",
        "busbw_gbps": "algbw x the operation's bus factor (bus_factor), fabric GB/s",
        "bus_factor": "2(n-1)/n for allreduce; (n-1)/n for reducescatter, allgather, "
                      "alltoall; 1 for broadcast",
        "wrong": "elements outside the exact reference's bound, over every rank (null: "
                 "the size was stopped before its check)",
        "iterations_us": "per iteration, the slowest rank's time, fabric us",
        "min_us": "fastest iteration", "avg_us": "mean iteration", "p50_us": "median "
        "iteration", "p99_us": "99th-percentile iteration (nccl-tests' index rule)",
        "phases_us": "mean fabric time per phase over the ranks (reduce_scatter, "
                     "all_gather, tree_up, tree_down, ...)",
        "link_bytes": "wire bytes the busiest rank put on its host link per timed run "
                      "(data packets, headers and per-packet Ethernet overhead included)",
        "effective_link_gbps": "link_bytes / time_us, fabric GB/s: the load the algorithm "
                               "really placed on the busiest NIC (docs/collectives-roce.md); "
                               "unlike busbw it needs no per-algorithm factor, so it stays "
                               "meaningful for tree and in-network all-reduce",
        "transport": "roce (RDMA WRITEs with immediate over RC QPs) or uet (UET SENDs)",
        "retransmissions": "data packets sent again during the timed runs, over every rank "
                           "(RoCE: go-back-N resends; UET: selective ones)",
        "timeouts": "retransmission timer expiries during the timed runs, over every rank",
        "trims": "UET: trimmed packets that reached a rank during the timed runs, over every "
                 "rank (null over RoCE)",
        "error": "the first error a rank reported (null: none)",
    }

    def check(self, entry: TrafficEntry, loc: tuple, ctx: CheckContext) -> Iterator[Problem]:
        assert isinstance(entry, CollectiveTraffic)
        t = entry
        allowed = ALGORITHMS[t.kind] + (("ina",) if t.kind == "allreduce" else ())
        if t.algorithm is not None and t.algorithm not in allowed:
            yield (loc + ("algorithm",), f"{t.algorithm!r} is not a {t.kind} algorithm; use "
                   f"{' or '.join(allowed)}")
        if t.op_algorithm == "ina" and t.transport == "uet":
            yield (loc + ("transport",), "the in-network all-reduce runs its barriers and "
                   "set-up over RoCE; use transport: roce, or another algorithm over uet")
        if t.op_algorithm == "ina" and (t.dtype == "bfloat16" or t.redop != "sum"):
            yield (loc + ("dtype" if t.dtype == "bfloat16" else "redop",),
                   "the in-network all-reduce sums float32, float16 or int32 in int32 fixed "
                   "point; pick one of those and redop: sum")
        if t.op_algorithm == "ina":
            # a rank that is no host, or a host twice, is the shape check's to report
            if all(h in ctx.hosts for h in t.ranks) and len(set(t.ranks)) == len(t.ranks):
                switches = [n for n, r in ctx.roles.items() if r == "switch"]
                for at, message in ina_tree(t, ctx.neighbours, lambda n: ctx.roles.get(n, ""),
                                            switches)[1]:
                    yield loc + at, message
        elif "ina" in t.model_fields_set:
            yield (loc + ("ina",), f"ina applies to algorithm: ina, not {t.op_algorithm}; "
                   "remove it or set algorithm: ina")
        if t.kind == "broadcast" and t.root >= len(t.ranks):
            yield (loc + ("root",), f"root {t.root} is not a rank (ranks 0..{len(t.ranks) - 1})")
        if t.redop != "sum" and t.kind not in REDUCING:
            yield loc + ("redop",), f"{t.kind} reduces nothing; remove redop"
        yield from transport_problems(t, loc, ctx)
        n, unit = len(t.ranks), ITEMSIZE[t.dtype]
        step = unit * (n if t.kind in ("reducescatter", "allgather", "alltoall") else 1)
        if t.sizes.min_bytes < step:
            yield (loc + ("sizes", "min"), f"{t.sizes.min_bytes} B holds no element per rank: "
                   f"a {t.kind} of {t.dtype} over {n} ranks needs at least {step} B")

    def host_ports(self, entry: TrafficEntry,
                   ctx: CheckContext) -> dict[str, list[tuple[str, int, str]]]:
        """transport: uet: each rank's host runs a UET NIC on UDP 4793."""
        assert isinstance(entry, CollectiveTraffic)
        return uet_host_ports(entry)

    def expand(self, entry: TrafficEntry, index: int, ctx: ExpandContext) -> list[AgentSpec]:
        assert isinstance(entry, CollectiveTraffic)
        t = entry
        ports = rank_ports(ctx, t.ranks)         # (TCP set-up, UDP RoCE, UDP INA) per rank
        aggregators = (ina_plan(t, index, ctx, [p[2] for p in ports])
                       if t.op_algorithm == "ina" else None)
        peers = peers_arg(ctx, t.ranks, ports, t.transport)
        specs = []
        for rank, host in enumerate(t.ranks):
            argv = ["--rank", str(rank), "--peers", peers, "--op", t.kind,
                    "--algorithm", t.op_algorithm, "--dtype", t.dtype, "--redop", t.redop,
                    "--root", str(t.root), "--min-bytes", str(t.sizes.min_bytes),
                    "--max-bytes", str(t.sizes.max_bytes), "--factor", str(t.sizes.factor),
                    "--warmup", str(t.warmup), "--iterations", str(t.iterations),
                    *transport_argv(t, ctx, host)]
            if aggregators is not None:
                argv += aggregators.worker_argv(rank, host)
            specs.append(AgentSpec(name=f"{t.name}-r{rank}", node=host, role="sender",
                                   traffic=t.name, kind=t.kind, argv=argv,
                                   module=self.agent_module, start_ns=t.start_ns,
                                   src=host, dst=host))
        return (aggregators.specs if aggregators is not None else []) + specs

    def span_ns(self, entry: TrafficEntry, ctx: ExpandContext | None) -> int:
        """No schedule: a generous bound on the time the ranks need, not an estimate (the
        run waits for the ranks to exit; this only bounds how long it waits). Per size
        and run: the busiest rank's bus bytes (the operation's bus factor) at 1/SPAN_SLACK of the
        slowest NIC's rate, plus STEP_ALLOWANCE_NS for each of the 2n steps of the
        slowest algorithm and for the barrier before each run."""
        assert isinstance(entry, CollectiveTraffic)
        if ctx is None:
            return entry.start_ns
        n = len(entry.ranks)
        runs = entry.warmup + entry.iterations
        per_packet = BTH_ICRC_BYTES + WIRE_OVERHEAD_BYTES
        wire = sum(b * bus_factor(entry.kind, n) * (1 + per_packet / ctx.roce_mtu_bytes)
                   + RETH_BYTES for b in entry.sizes.each()) * runs
        slowest = min(ctx.line_rate_bps(h) for h in entry.ranks)
        steps = len(entry.sizes.each()) * runs * (2 * n + n.bit_length())
        return (entry.start_ns + int(SPAN_SLACK * wire * 8 * 10**9 / slowest)
                + steps * STEP_ALLOWANCE_NS)

    def work_wall_s(self, entry: TrafficEntry) -> float:
        """Building the buffers of every size and checking the last run's result: each
        rank recomputes n + 1 inputs per size (agents/collectives/data.py), at about
        FILL_CPU_NS_PER_ELEMENT each, and n ranks may share CPU_CORES_ASSUMED cores."""
        assert isinstance(entry, CollectiveTraffic)
        n = len(entry.ranks)
        elements = sum(b // ITEMSIZE[entry.dtype] for b in entry.sizes.each())
        cpu_s = elements * (n + 1) * FILL_CPU_NS_PER_ELEMENT * 1e-9
        return WORK_MARGIN * cpu_s * max(1.0, n / CPU_CORES_ASSUMED)

    def startup_wall_s(self, spec: AgentSpec) -> float:
        return STARTUP_PER_RANK_S

    def waits_ready(self, spec: AgentSpec) -> bool:
        return spec.module == AGGREGATOR_MODULE     # workers send to it from their start

    def files_argv(self, spec: AgentSpec, files: AgentFiles) -> list[str]:
        argv = ["--ready-file", str(files.ready), "--out", str(files.out)]
        if spec.module != AGGREGATOR_MODULE:      # a rank: a collective_phase per phase
            argv += ["--events", str(files.events)]
        return argv

    def result_rows(self, specs: Sequence[AgentSpec], results: Results,
                    view: RunView) -> list[ResultRow]:
        rows = []
        for traffic, kind, ranks in _entries(specs):
            per_rank = [results.get(s.name) or {} for s in ranks]
            by_size: dict[int, list[dict]] = {}
            for res in per_rank:
                for r in res.get("results") or []:
                    by_size.setdefault(int(r["bytes"]), []).append(r)
            first = next((r for r in per_rank if r), {})
            for size in sorted(by_size):
                rows.append(ResultRow(traffic, kind, _size_row(
                    kind, first, size, by_size[size], len(ranks), per_rank)))
            # A size stopped before its check (the run's bound, a signal): its timed
            # iterations are a row too, with wrong null, not silently left out.
            stopped: dict[int, list[dict]] = {}
            for res in per_rank:
                p = res.get("partial")
                if p and int(p.get("bytes") or 0) and int(p["bytes"]) not in by_size:
                    stopped.setdefault(int(p["bytes"]), []).append(p)
            for size in sorted(stopped):
                timed = [{**p, "wrong": 0} for p in stopped[size] if p.get("iterations_us")]
                row = _size_row(kind, first, size, timed, len(ranks), per_rank)
                done = max((len(p["iterations_us"]) for p in timed), default=0)
                row["wrong"] = None
                row["error"] = (f"stopped before its check: {len(stopped[size])} of "
                                f"{len(ranks)} ranks were in it, the furthest after {done} "
                                "timed iteration(s)")
                rows.append(ResultRow(traffic, kind, row))
            if not by_size and not stopped:  # no rank got as far as a result: one row says why
                rows.append(ResultRow(traffic, kind, _size_row(kind, first, 0, [], len(ranks),
                                                               per_rank)))
        return rows

    def stream_accounts(self, specs: Sequence[AgentSpec], results: Results,
                        flow_drops: Sequence[dict], view: RunView) -> list[dict]:
        """Rank to rank (RoCE, or UET) and rank / aggregator (INA) streams, both ways
        (testbed/workloads/collective_accounts.py)."""
        out = []
        for traffic, kind, ranks in _entries(specs):
            if ranks and arg_of(ranks[0].argv, "--transport") == "uet":
                out += uet_accounts(traffic, kind, ranks, results, flow_drops)
                continue
            out += roce_accounts(traffic, kind, ranks, results, flow_drops)
            aggregators = [s for s in specs
                           if s.module == AGGREGATOR_MODULE and s.traffic == traffic]
            out += ina_accounts(traffic, kind, ranks, aggregators, results, flow_drops, view)
        return out

    def fidelity_notes(self, specs: Sequence[AgentSpec], results: Results,
                       view: RunView) -> list[str]:
        notes = []
        for spec in specs:
            res = results.get(spec.name) or {}
            if spec.module == AGGREGATOR_MODULE:
                notes += _aggregator_notes(spec, res)
                continue
            if res.get("error"):
                notes.append(f"collective rank {spec.name} on {spec.node}: {res['error']}")
            if res.get("events_dropped"):
                notes.append(f"collective rank {spec.name} on {spec.node}: "
                             f"{res['events_dropped']} phase events beyond its cap of "
                             f"{res.get('events_written', 0)} were not written: the report's "
                             "phase timeline misses them (the results are whole)")
            notes += _uet_notes(spec, res)
            wrong = sum(int(r.get("wrong", 0)) for r in res.get("results") or [])
            if wrong:
                notes.append(f"collective rank {spec.name} on {spec.node}: {wrong} elements "
                             "outside the exact reference's bound")
        return notes

    def output_files(self, rows: Sequence[ResultRow], specs: Sequence[AgentSpec],
                     results: Results, view: RunView) -> dict[str, str]:
        out = {}
        for traffic, kind, ranks in _entries(specs):
            mine = [r.fields for r in rows if r.traffic == traffic and r.fields["bytes"]]
            argv = ranks[0].argv
            header = {
                "operation": kind, "algorithm": _arg(argv, "--algorithm"),
                "ranks": len(ranks), "min_bytes": int(_arg(argv, "--min-bytes")),
                "max_bytes": int(_arg(argv, "--max-bytes")),
                "factor": int(_arg(argv, "--factor")), "warmup": int(_arg(argv, "--warmup")),
                "iterations": int(_arg(argv, "--iterations")),
                "bus_factor": round(bus_factor(kind, len(ranks)), 4),
                "bus_factor_formula": BUS_FACTOR_FORMULA[kind],
                "devices": [{"rank": i, "group": 0, "pid": 0, "hostname": s.node,
                             "device": 0, "device_hex": "", "device_info": "emulated host"}
                            for i, s in enumerate(ranks)]}
            out[f"{traffic}.nccl.txt"] = table(traffic, mine, header)
            out[f"{traffic}.nccl.json"] = json.dumps(
                json_report(traffic, mine, header, argv), indent=2) + "\n"
        return out


AGGREGATOR_MODULE = "agents.aggregator"


def _uet_notes(spec: AgentSpec, res: dict) -> list[str]:
    """A UET rank's NIC that dropped datagrams: malformed, with PDC ids that are not its
    peers', or overflowing its receive socket (each is retransmitted by its sender, but
    is a packet the fabric delivered and the rank lost)."""
    uet = (res.get("counters") or {}).get("uet") or {}
    totals = uet.get("totals") or {}
    bad = {"malformed": int(totals.get("malformed") or 0),
           "with wrong PDC ids": int(totals.get("bad_pdcid") or 0),
           "in its full receive socket (the rank fell behind, not the fabric)":
               int((uet.get("sockets") or {}).get("overflow_drops") or 0)}
    bad = {k: v for k, v in bad.items() if v}
    if not bad:
        return []
    return [f"collective rank {spec.name} on {spec.node}: its UET NIC dropped "
            + ", ".join(f"{v} datagrams {k}" for k, v in bad.items())
            + " (counters.uet.sockets.malformed has the reasons)"]


def _aggregator_notes(spec: AgentSpec, res: dict) -> list[str]:
    """An aggregator that failed, or dropped packets it should have taken."""
    if not res:
        return [f"aggregator {spec.name} on {spec.node} reported nothing"]
    notes = [f"aggregator {spec.name} on {spec.node}: {res['error']}"] if res.get(
        "error") else []
    drops = {k: v for k, v in (res.get("drops") or {}).items() if v}
    drops |= {f"malformed {k}": v for k, v in (res.get("malformed") or {}).items() if v}
    strangers = int(res.get("received_from_others") or 0)
    parts = [f"dropped {', '.join(f'{v} {k}' for k, v in sorted(drops.items()))}"] if drops \
        else []
    if strangers:
        parts.append(f"{strangers} datagrams came from addresses that are not its job's "
                     "members, children or parent")
    if parts:
        notes.append(f"aggregator {spec.name} on {spec.node} " + "; ".join(parts))
    return notes


@dataclass
class InaPlan:
    """An in-network all-reduce's aggregators: one per leaf switch of the ranks' hosts,
    under a root on a switch linked to every leaf (one switch: it is leaf and root)."""

    job_id: int
    slots: int
    slot_elements: int
    leaf_of: dict[str, str]                 # host -> its leaf switch
    address: dict[tuple[str, str], str]     # (switch, host) -> the switch's address there
    port: dict[str, int]                    # switch -> its aggregator's UDP port
    worker_port: list[int]                  # rank -> its aggregation socket's UDP port
    specs: list[AgentSpec] = field(default_factory=list)

    def worker_argv(self, rank: int, host: str) -> list[str]:
        leaf = self.leaf_of[host]
        return ["--aggregator", f"{self.address[(leaf, host)]}:{self.port[leaf]}",
                "--job-id", str(self.job_id), "--worker-id", str(rank),
                "--ina-slots", str(self.slots), "--ina-slot-elements", str(self.slot_elements),
                "--ina-port", str(self.worker_port[rank])]


@dataclass(frozen=True)
class InaTree:
    """Where an entry's aggregators go: each rank's leaf, and the root over the leaves
    (one leaf and no other root: the leaf is the root, a single aggregator)."""

    leaf_of: dict[str, str]                 # host -> its leaf switch
    leaves: list[str]                       # leaf id i is leaves[i]
    root: str


def _names(items: Sequence[str]) -> str:
    return ", ".join(items) or "none"


def _not_a_switch(name: str, role: str, switches: list[str]) -> str:
    what = "a host" if role == "host" else "not a node of this fabric"
    close = difflib.get_close_matches(name, switches, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return (f"{name!r} is {what}; an aggregator runs on a switch ({hint}switches: "
            f"{_names(switches[:8])}{' ...' if len(switches) > 8 else ''})")


def _given_leaves(t: CollectiveTraffic, leaves: dict[str, list[str]],
                  neighbours: Callable[[str], list[str]], role: Callable[[str], str],
                  switches_of: Callable[[str], list[str]], switches: list[str]
                  ) -> tuple[dict[str, str], list[Problem]]:
    """Each rank's leaf as `ina.leaves` places it, and what is wrong with the placement."""
    problems: list[Problem] = []
    leaf_of: dict[str, str] = {}
    if not leaves:
        problems.append((("ina", "leaves"), "no leaf switch is given; map each leaf switch "
                         "to its ranks' hosts, or remove leaves to place every rank under "
                         "its own switch"))
    for switch, hosts in leaves.items():
        at = ("ina", "leaves", switch)
        is_switch = role(switch) == "switch"
        if not is_switch:
            problems.append((at, _not_a_switch(switch, role(switch), switches)))
        if not hosts:
            problems.append((at, f"{switch} holds no rank; list the hosts of its ranks or "
                             "remove it"))
        for j, host in enumerate(hosts):
            if host not in t.ranks:
                problems.append(((*at, j), f"{host!r} is not a rank of {t.name!r} (ranks: "
                                 f"{_names(t.ranks)}); remove it"))
            elif host in leaf_of:
                problems.append(((*at, j), f"{host} is already under {leaf_of[host]}; a rank "
                                 "has one leaf aggregator, remove it from one of them"))
            else:
                leaf_of[host] = switch
                if is_switch and switch not in neighbours(host):
                    problems.append(((*at, j), f"{host} is not linked to {switch}, so "
                                     f"{switch}'s aggregator cannot be its first hop; put it "
                                     "under a switch it is linked to "
                                     f"({_names(switches_of(host))})"))
    missing = [h for h in t.ranks if h not in leaf_of]
    if missing:
        where = "; ".join(f"rank {t.ranks.index(h)} ({h}) is linked to "
                          f"{_names(switches_of(h))}" for h in missing)
        problems.append((("ina", "leaves"), f"{len(missing)} rank(s) under no leaf: {where}; "
                         "add each host under one of its switches"))
    return leaf_of, problems


def ina_tree(t: CollectiveTraffic, neighbours: Callable[[str], list[str]],
             role: Callable[[str], str], switches: Sequence[str] | None = None
             ) -> tuple[InaTree | None, list[Problem]]:
    """The aggregation tree of entry `t` (ina.leaves and ina.root where given, else from
    the topology), or the problems that leave it without one, located under the entry.
    `role(node)` is "host", "switch", or "" for a name that is no node; `switches`, the
    names a misspelt switch is matched against (default: those near the ranks)."""
    def switches_of(node: str) -> list[str]:
        return [n for n in neighbours(node) if role(n) == "switch"]

    if switches is None:
        near = {s for h in t.ranks for s in switches_of(h)}
        switches = sorted(near | {s for n in near for s in switches_of(n)})
    switches = list(switches)
    problems: list[Problem] = []
    given = t.ina.leaves
    if given is None:
        leaf_of = {}
        for i, host in enumerate(t.ranks):
            first = switches_of(host)
            if first:
                leaf_of[host] = first[0]
            else:
                problems.append((("ranks", i), f"{host} is linked to no switch, so no "
                                 "aggregator can be its first hop; link it to a switch or "
                                 "pick another algorithm"))
        leaves = list(dict.fromkeys(leaf_of.values()))
    else:
        leaf_of, problems = _given_leaves(t, given, neighbours, role, switches_of, switches)
        leaves = list(given)
    if t.ina.root is not None and role(t.ina.root) != "switch":
        problems.append((("ina", "root"), _not_a_switch(t.ina.root, role(t.ina.root),
                                                        switches)))
    if problems:
        return None, problems
    # where a problem with the leaves as a whole is reported
    at = ("ina", "leaves") if given is not None else ("ranks",)
    for leaf in leaves:
        members = sum(1 for h in t.ranks if leaf_of[h] == leaf)
        if members > MAX_CONTRIBUTORS:
            problems.append((("ina", "leaves", leaf) if given is not None else at,
                             f"{members} ranks under {leaf}: an aggregator sums at most "
                             f"{MAX_CONTRIBUTORS} (its bitmap); spread them over more leaves"))
    if len(leaves) > MAX_CONTRIBUTORS:
        problems.append((at, f"{len(leaves)} leaves: a root sums at most {MAX_CONTRIBUTORS}"))
    root, root_problems = _root_of(t.ina.root, leaves, neighbours, switches_of, at)
    problems += root_problems
    if problems or root is None:
        return None, problems
    return InaTree(leaf_of=leaf_of, leaves=leaves, root=root), []


def _root_of(root: str | None, leaves: list[str], neighbours: Callable[[str], list[str]],
             switches_of: Callable[[str], list[str]], at: tuple
             ) -> tuple[str | None, list[Problem]]:
    """The root over `leaves`: `root` if it may be one, else the first switch linked to
    every leaf (with one leaf, the leaf); `at`: where a missing root is reported."""
    common = [s for s in switches_of(leaves[0])
              if all(s in neighbours(leaf) for leaf in leaves[1:])]
    if root is None:
        if len(leaves) == 1:
            return leaves[0], []
        if common:
            return common[0], []
        return None, [(at, f"no switch is linked to every leaf of the ranks "
                           f"({_names(leaves)}), so the aggregation tree has no root; place "
                           "the ranks under leaves one switch links to (ina.leaves)")]
    if root in leaves and len(leaves) > 1:
        return None, [(("ina", "root"), f"{root} is also a leaf; with {len(leaves)} leaves "
                       "the root is another switch, linked to each of them "
                       f"({_names(common)})")]
    unlinked = [leaf for leaf in leaves if leaf != root and leaf not in neighbours(root)]
    if unlinked:
        return None, [(("ina", "root"), f"{root} is not linked to leaf {_names(unlinked)}; "
                       "the root must be linked to every leaf switch (linked to all of them: "
                       f"{_names(common)})")]
    return root, []


def ina_plan(t: CollectiveTraffic, index: int, ctx: ExpandContext,
             worker_port: list[int]) -> InaPlan:
    """Place the aggregators of entry `index` (job id index + 1) and build their argv;
    `worker_port[rank]` is the UDP port of the rank's aggregation socket."""
    def role(node: str) -> str:
        try:
            return ctx.role(node)
        except KeyError:        # a name in ina.leaves / ina.root that is no node
            return ""

    tree, problems = ina_tree(t, ctx.neighbours, role)
    if tree is None:        # the config's checks report these first, located
        raise ValueError(f"in-network all-reduce {t.name!r}: "
                         + "; ".join(f"{'.'.join(map(str, at))}: {m}" for at, m in problems))
    leaf_of, leaves, root = tree.leaf_of, tree.leaves, tree.root
    per_switch = ctx.state("aggregators")
    port = {}
    for switch in dict.fromkeys([*leaves, root]):
        n = per_switch.get(switch, 0)
        if n >= MAX_AGGREGATORS_PER_SWITCH:
            raise ValueError(f"more than {MAX_AGGREGATORS_PER_SWITCH} in-network all-reduce "
                             f"aggregators on {switch}")
        per_switch[switch] = n + 1
        port[switch] = AGGREGATOR_PORT + n
    address = {(leaf_of[h], h): ctx.link_address(leaf_of[h], h) or "" for h in t.ranks}
    plan = InaPlan(job_id=index + 1, slots=t.ina.slots, slot_elements=t.ina.slot_elements,
                   leaf_of=leaf_of, address=address, port=port, worker_port=worker_port)
    for leaf_id, leaf in enumerate(leaves):
        members = [[r, ctx.address(h), worker_port[r]] for r, h in enumerate(t.ranks)
                   if leaf_of[h] == leaf]
        job: dict[str, object] = {"id": plan.job_id, "members": members, "slots": t.ina.slots,
                                  "slot_elements": t.ina.slot_elements}
        parent: list[str] = []
        if leaf != root:
            job["uplink_id"] = leaf_id
            parent = ["--parent", f"{ctx.link_address(root, leaf)}:{port[root]}"]
        plan.specs.append(_aggregator_spec(t, leaf, port[leaf], [job], parent, ctx,
                                           len(members)))
    if root not in leaves:
        children = [[i, ctx.link_address(leaf, root), port[leaf]]
                    for i, leaf in enumerate(leaves)]
        job = {"id": plan.job_id, "members": [], "children": children, "slots": t.ina.slots,
               "slot_elements": t.ina.slot_elements}
        plan.specs.append(_aggregator_spec(t, root, port[root], [job], [], ctx,
                                           len(children)))
    return plan


def _aggregator_spec(t: CollectiveTraffic, switch: str, port: int, jobs: list[dict],
                     parent: list[str], ctx: ExpandContext, contributors: int) -> AgentSpec:
    # Bound to every address of the switch: workers reach it on their own link's address
    # and a tree's leaves on theirs, and what it sends leaves with the address of the link
    # it goes out of, which is the one the receiver knows it by.
    return AgentSpec(name=f"{t.name}-agg-{switch}", node=switch, role="receiver",
                     traffic=t.name, kind=t.kind, module=AGGREGATOR_MODULE,
                     argv=["--bind", "0.0.0.0", "--port", str(port),
                           "--jobs", json.dumps(jobs, separators=(",", ":")),
                           "--dilation", str(ctx.dilation), "--dscp", str(ctx.dscp(t.tclass)),
                           "--rcvbuf-bytes", str(aggregator_rcvbuf_bytes(t, contributors)),
                           *parent])


# A datagram of a slot's payload costs about twice its bytes of socket buffer (the kernel
# charges the skb's truesize, a 9000-byte MTU page set for an 8 KiB payload).
AGGREGATOR_MIN_RCVBUF_BYTES = 8 << 20
TRUESIZE_FACTOR = 2


def aggregator_rcvbuf_bytes(t: CollectiveTraffic, contributors: int) -> int:
    """SO_RCVBUF for an aggregator: every contributor's whole window at once (the pool
    bounds what can be in flight), so the switch's socket never drops a contribution."""
    window = contributors * t.ina.slots * (t.ina.slot_elements * 4 + INA_HEADER_BYTES)
    return max(AGGREGATOR_MIN_RCVBUF_BYTES, TRUESIZE_FACTOR * window)


def _arg(argv: Sequence[str], flag: str) -> str:
    """A flag's value in an argv this kind wrote (so it is there)."""
    value = arg_of(argv, flag)
    assert value is not None, flag
    return value


def _entries(specs: Sequence[AgentSpec]) -> list[tuple[str, str, list[AgentSpec]]]:
    """(traffic, kind, its ranks in rank order) for each entry among `specs`."""
    out: dict[str, tuple[str, list[AgentSpec]]] = {}
    for s in specs:
        if s.module != AGGREGATOR_MODULE:
            out.setdefault(s.traffic, (s.kind, []))[1].append(s)
    return [(t, kind, sorted(ranks, key=lambda s: int(_arg(s.argv, "--rank"))))
            for t, (kind, ranks) in out.items()]


def _size_row(kind: str, first: dict, size: int, per_rank_rows: list[dict], n: int,
              per_rank: list[dict]) -> dict:
    """One nccl-tests row from every rank's result of one size."""
    complete = len(per_rank_rows) == n
    iters = [max(its) for its in zip(*(r.get("iterations_us") or [] for r in per_rank_rows),
                                     strict=False)] if complete else []
    time_us = max((float(r.get("avg_us") or 0) for r in per_rank_rows), default=0.0)
    algbw = size / (time_us * 1e3) if time_us > 0 else 0.0
    stats = iteration_stats(iters)
    phases: dict[str, float] = {}
    for r in per_rank_rows:
        for name, us in (r.get("phases_us") or {}).items():
            phases[name] = phases.get(name, 0.0) + float(us) / len(per_rank_rows)
    dtype = str(first.get("dtype") or "float32")
    link_bytes = max((int(r.get("wire_bytes_per_iteration") or 0) for r in per_rank_rows),
                     default=0)
    def summed(key: str) -> int | None:
        values = [r.get(key) for r in per_rank_rows]
        if not values or not all(isinstance(v, int) for v in values):
            return None
        return sum(int(v) for v in values if isinstance(v, int))

    errors = [str(r["error"]) for r in per_rank if r.get("error")]
    if not complete and not errors:
        errors = [f"{n - len(per_rank_rows)} of {n} ranks reported no result for {size} B"]
    return {
        "operation": kind, "algorithm": first.get("algorithm"), "ranks": n,
        "bytes": size, "count": count_of(kind, size, n, dtype), "dtype": dtype,
        "redop": first.get("redop", "sum") if kind in REDUCING else "none",
        "root": int(first.get("root", 0)) if kind == "broadcast" else -1,
        "time_us": round(time_us, 3), "algbw_gbps": round(algbw, 4),
        "busbw_gbps": round(algbw * bus_factor(kind, n), 4),
        "bus_factor": round(bus_factor(kind, n), 4),
        "wrong": sum(int(r.get("wrong", 0)) for r in per_rank_rows),
        "iterations_us": [round(x, 3) for x in iters],
        "min_us": round(float(stats.get("min_us", 0.0)), 3),
        "avg_us": round(float(stats.get("avg_us", 0.0)), 3),
        "p50_us": round(float(stats.get("p50_us", 0.0)), 3),
        "p99_us": round(float(stats.get("p99_us", 0.0)), 3),
        "phases_us": {k: round(v, 3) for k, v in phases.items()},
        "link_bytes": link_bytes,
        "effective_link_gbps": round(link_bytes / (time_us * 1e3), 4) if time_us > 0 else 0.0,
        "transport": str(first.get("transport") or "roce"),
        "retransmissions": summed("retransmissions"), "timeouts": summed("timeouts"),
        "trims": summed("trims"),
        "error": errors[0] if errors else None,
    }


KIND = CollectiveKind()
