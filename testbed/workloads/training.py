"""The training step (`python -m agents.collectives.training`): data-parallel iterations
of compute and gradient all-reduces over a communicator of hosts, one rank per host, as
PyTorch DDP runs them, and the communication time congestion leaves exposed.

An entry becomes one worker per rank, all started together at the common start t0 (rank
i on `ranks[i]`), on the same user-space RoCE transport as the collective kind (so DCQCN,
ECN and PFC act on it), with its ranks numbered per host together with the collective
kind's (testbed/workloads/rdma_group.py). Each iteration: a barrier, `compute.forward`
of compute (fabric time), `compute.backward` split over the buckets in proportion to
their size, bucket 0 (the last layers') ready first; each bucket is all-reduced with
`algorithm`, in order, as soon as it is ready and the one before it is done (`overlap`),
or all after backward (`overlap: false`). The last iteration is checked against the
exact sum (`wrong`).

Results (one row per entry): per iteration the slowest rank's step time, as nccl-tests
reduces times over processes with max; the compute, the communication, and the part of
it compute did not hide (exposed = iteration - compute); the same schedule with every
all-reduce at line rate (`agents/collectives/schedule.py`), so a congested run can be
read against what the fabric alone would allow; and the transport's congestion counters
over the timed iterations, summed over the ranks.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Annotated, ClassVar, Literal

from pydantic import BeforeValidator, ConfigDict, Field, WithJsonSchema

from agents.collectives.ops import ITEMSIZE
from agents.collectives.schedule import ideal_allreduce_ns, step_schedule
from agents.collectives.sweep import summary
from testbed.fields import NAME_RE, DurationNs, SizeBytes, Strict
from testbed.units import QUANTITY_PATTERN
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
from testbed.workloads.rdma_group import (
    GROUP_PORTS,
    PORT_OWNER,
    GroupTransportEntry,
    peers_arg,
    rank_ports,
    transport_argv,
    transport_problems,
)

MAX_BUCKETS = 256
# Each rank holds every bucket's input and result, and the algorithm two working copies
# of the bucket under way; eight ranks on one VM of 24 GiB must fit.
MAX_TOTAL_BUCKET_BYTES = 256 << 20
# A worker imports numpy, connects to every peer and builds its buffers before t0.
STARTUP_PER_RANK_S = 0.3
CHUNK_HEADER_BYTES = 16
# The transport counters a row sums over the ranks and timed iterations.
CONGESTION_FIELDS = ("cnps", "rate_cuts", "retransmissions", "rnr_naks", "timeouts",
                     "ecn_marked")


def _bucket_list(value: object) -> object:
    """`{count: N, size: S}` as the list of N sizes S it stands for; a list as it is."""
    if not isinstance(value, dict):
        if isinstance(value, list | tuple):
            return value
        raise ValueError(f"expected a list of sizes ([25MiB, 25MiB]) or {{count: N, size: S}}"
                         f", got {value!r}")
    unknown = sorted(str(k) for k in value if k not in ("count", "size"))
    if unknown or "count" not in value or "size" not in value:
        raise ValueError(f"{{count: N, size: S}} needs exactly count and size"
                         f"{'; remove ' + ', '.join(unknown) if unknown else ''}")
    count = value["count"]
    if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= MAX_BUCKETS:
        raise ValueError(f"count: expected 1..{MAX_BUCKETS} buckets, got {count!r}")
    return [value["size"]] * count


_SIZE_SCHEMA = {"anyOf": [{"type": "string", "pattern": QUANTITY_PATTERN},
                          {"type": "integer", "minimum": 0}]}
BucketList = Annotated[list[SizeBytes], BeforeValidator(_bucket_list), WithJsonSchema({
    "anyOf": [{"type": "array", "items": _SIZE_SCHEMA, "minItems": 1,
               "maxItems": MAX_BUCKETS},
              {"type": "object", "additionalProperties": False, "required": ["count", "size"],
               "properties": {"count": {"type": "integer", "minimum": 1,
                                        "maximum": MAX_BUCKETS},
                              "size": _SIZE_SCHEMA}}],
    "description": "gradient bucket sizes, e.g. [25MiB, 25MiB], or {count: 4, size: 25MiB}"})]


class Compute(Strict):
    """The compute of one training step, fabric time."""

    forward_ns: DurationNs = Field(1_000_000, alias="forward",
                                   description="forward pass, before any gradient is ready")
    backward_ns: DurationNs = Field(
        3_000_000, alias="backward", description="backward pass, split over the buckets in "
        "proportion to their size; bucket 0 (the last layers') is ready first")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class TrainingTraffic(GroupTransportEntry):
    """Data-parallel training steps: compute, then gradient buckets all-reduced in order,
    optionally overlapped with the rest of backward (as PyTorch DDP does)."""

    name: str = Field(pattern=NAME_RE, description="the entry's name: lower-case letters, "
                      "digits and _, unique in the workload; agents and results carry it")
    kind: Literal["training"] = Field(description="training: data-parallel training steps")
    algorithm: Literal["ring", "rhd", "tree"] = Field(
        "ring", description="the all-reduce of every bucket: ring (reduce-scatter + "
                            "all-gather), rhd (recursive halving-doubling) or tree (double "
                            "binary tree)")
    buckets: BucketList = Field(
        min_length=1, max_length=MAX_BUCKETS,
        description="the gradient buckets, in the order they are ready and all-reduced "
                    "(bucket 0 holds the last layers' gradients): a list of sizes, or "
                    "{count: N, size: S} for N of size S (DDP's bucket_cap_mb is 25 MiB)")
    compute: Compute = Field(default_factory=Compute, description="compute per step")
    overlap: bool = Field(True, description="all-reduce each bucket once it is ready, "
                                            "during the rest of backward (DDP); false: all "
                                            "buckets after backward")
    warmup: int = Field(1, ge=0, le=1000, description="untimed steps first")
    iterations: int = Field(10, ge=1, le=10000, description="timed steps")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @property
    def bucket_sizes(self) -> list[int]:
        return list(self.buckets)


class TrainingKind(WorkloadKind):
    shapes: ClassVar = {"training": Shape.GROUP}
    model: ClassVar = TrainingTraffic
    agent_module: ClassVar = "agents.collectives.training"
    doc: ClassVar = (
        "Training steps (agents/collectives/training.py): one worker per rank; each step "
        "is forward compute, backward compute over the gradient buckets, and each bucket "
        "all-reduced in order (ring, rhd or tree, RDMA WRITEs with immediate over the "
        "user-space RoCE transport), overlapped with the rest of backward as DDP does "
        "unless `overlap: false`. One row per entry: the slowest rank's step time per "
        "iteration, the communication compute did not hide (exposed = step - compute), "
        "the same at line rate, and the congestion counters of the timed steps.")
    ports: ClassVar = GROUP_PORTS
    port_owner: ClassVar = PORT_OWNER
    example: ClassVar = {"name": "step", "kind": "training", "ranks": ["h1", "h2", "h3", "h4"],
                         "algorithm": "ring", "buckets": ["256KiB", "256KiB"],
                         "compute": {"forward": "20us", "backward": "60us"},
                         "iterations": 2}
    console_columns: ClassVar = (
        ("algorithm", "algorithm"), ("ranks", "ranks"), ("buckets", "buckets"),
        ("overlap", "overlap"), ("step (us)", "iteration_us"),
        ("p99 (us)", "iteration_p99_us"), ("compute (us)", "compute_us"),
        ("exposed (us)", "exposed_us"), ("at line rate (us)", "exposed_ideal_us"),
        ("overlap eff.", "overlap_efficiency"), ("CNPs", "cnps"),
        ("rate cuts", "rate_cuts"), ("#wrong", "wrong"))
    result_fields: ClassVar = {
        "algorithm": "the all-reduce algorithm (ring, rhd, tree)",
        "ranks": "ranks in the communicator",
        "buckets": "gradient buckets per step",
        "bucket_bytes": "bytes of all buckets (the gradients a step all-reduces)",
        "dtype": "element type",
        "overlap": "whether each bucket's all-reduce overlapped the rest of backward",
        "iterations": "timed steps every rank completed",
        "iteration_us": "step time: per iteration the slowest rank's, mean over the "
                        "iterations, fabric us",
        "iteration_p50_us": "median step time (slowest rank per iteration)",
        "iteration_p99_us": "99th-percentile step time (nearest rank)",
        "compute_us": "forward + backward compute per step, fabric us",
        "comm_us": "the bucket all-reduce times of a step summed, per iteration the "
                   "slowest rank's, mean, fabric us",
        "exposed_us": "exposed communication: iteration_us - compute_us, the "
                      "communication compute did not hide (mean)",
        "exposed_p99_us": "99th percentile of the exposed communication",
        "overlap_efficiency": "1 - exposed_us / comm_us: the share of the communication "
                              "hidden behind compute (about 0 without overlap)",
        "comm_ideal_us": "the all-reduce times at line rate summed: per bucket the "
                         "busiest rank's bytes for the algorithm (ring: 2(n-1)/n x size) "
                         "/ the slowest rank's NIC rate, payload only",
        "exposed_ideal_us": "the exposed communication of the same schedule with every "
                            "all-reduce at line rate (what overlap leaves with no "
                            "congestion)",
        "iteration_ideal_us": "the step time of that schedule",
        "exposed_excess_us": "exposed_us - exposed_ideal_us: exposed communication beyond "
                             "line rate's (congestion, loss, and the software transport's "
                             "own shortfall)",
        "bucket_us": "per bucket, its all-reduce time (slowest rank per iteration, mean), "
                     "fabric us",
        "iterations_us": "per iteration, the slowest rank's step time, fabric us",
        "exposed_iterations_us": "per iteration, its exposed communication, fabric us",
        "cnps": "CNPs the ranks' QPs received over the timed steps, all ranks",
        "rate_cuts": "rate decreases of the ranks' DCQCN / DCTCP rate controllers",
        "retransmissions": "packets the ranks' QPs sent again (NAK go-back-N, timeouts)",
        "rnr_naks": "receiver-not-ready NAKs the ranks' QPs received",
        "timeouts": "retransmission timeouts of the ranks' QPs",
        "ecn_marked": "CE-marked packets the ranks received",
        "min_rate_bps": "the lowest sending rate any rank's QP had in a timed step "
                        "(sampled), fabric bit/s",
        "wrong": "elements of the checked (last) step outside the exact reference's "
                 "bound, over every rank",
        "error": "the first error a rank reported (null: none)",
    }

    def check(self, entry: TrafficEntry, loc: tuple, ctx: CheckContext) -> Iterator[Problem]:
        assert isinstance(entry, TrainingTraffic)
        t = entry
        if t.transport == "uet":
            # the step worker samples its QPs' rates and CNPs (agents/collectives/training.py)
            yield (loc + ("transport",), "the training step runs over RoCE only (its "
                   "congestion counters are its queue pairs'); use transport: roce, or a "
                   "collective entry (kind: allreduce) for transport: uet")
            return
        yield from transport_problems(t, loc, ctx)
        if len(t.ranks) == 1:
            yield loc + ("ranks",), "a training step needs at least two ranks to all-reduce"
        unit = ITEMSIZE[t.dtype]
        for k, size in enumerate(t.bucket_sizes):
            if size < unit or size % unit:
                yield (loc + ("buckets", k), f"{size} B is not a whole number of "
                       f"{t.dtype} elements; use a positive multiple of {unit} B")
        total = sum(t.bucket_sizes)
        if total > MAX_TOTAL_BUCKET_BYTES:
            yield (loc + ("buckets",), f"{total / 2**20:g} MiB of buckets in all is above "
                   f"the {MAX_TOTAL_BUCKET_BYTES >> 20} MiB a rank may hold (each rank keeps "
                   "every bucket's input and result); use fewer or smaller buckets")
        if t.chunk_bytes <= CHUNK_HEADER_BYTES:
            yield (loc + ("chunk",), f"{t.chunk_bytes} B leaves nothing after the "
                   f"{CHUNK_HEADER_BYTES}-byte chunk header; use a multiple of the RoCE MTU")

    def expand(self, entry: TrafficEntry, index: int, ctx: ExpandContext) -> list[AgentSpec]:
        assert isinstance(entry, TrainingTraffic)
        t = entry
        ports = rank_ports(ctx, t.ranks)
        peers = peers_arg(ctx, t.ranks, ports)
        specs = []
        for rank, host in enumerate(t.ranks):
            argv = ["--rank", str(rank), "--peers", peers, "--algorithm", t.algorithm,
                    "--dtype", t.dtype,
                    "--buckets-bytes", ",".join(str(b) for b in t.bucket_sizes),
                    "--forward-ns", str(t.compute.forward_ns),
                    "--backward-ns", str(t.compute.backward_ns),
                    "--overlap" if t.overlap else "--no-overlap",
                    "--warmup", str(t.warmup), "--iterations", str(t.iterations),
                    *transport_argv(t, ctx, host)]
            specs.append(AgentSpec(name=f"{t.name}-r{rank}", node=host, role="sender",
                                   traffic=t.name, kind=t.kind, argv=argv,
                                   module=self.agent_module, start_ns=t.start_ns,
                                   src=host, dst=host))
        return specs

    def span_ns(self, entry: TrafficEntry, ctx: ExpandContext | None) -> int:
        """No schedule of its own: every step's compute plus its all-reduces at line rate,
        one after the other (a floor: the run waits for the ranks to exit, this only
        bounds how long it waits)."""
        assert isinstance(entry, TrainingTraffic)
        t = entry
        if ctx is None:
            return t.start_ns
        line = min(ctx.line_rate_bps(h) for h in t.ranks)
        comm = sum(ideal_allreduce_ns(t.algorithm, len(t.ranks), b, line)
                   for b in t.bucket_sizes)
        step = t.compute.forward_ns + t.compute.backward_ns + comm
        return t.start_ns + int(step * (t.warmup + t.iterations))

    def startup_wall_s(self, spec: AgentSpec) -> float:
        return STARTUP_PER_RANK_S

    def files_argv(self, spec: AgentSpec, files: AgentFiles) -> list[str]:
        return ["--ready-file", str(files.ready), "--out", str(files.out)]

    def result_rows(self, specs: Sequence[AgentSpec], results: Results,
                    view: RunView) -> list[ResultRow]:
        rows = []
        for traffic, kind, ranks in _entries(specs):
            per_rank = [results.get(s.name) or {} for s in ranks]
            rows.append(ResultRow(traffic, kind, training_row(step_config(ranks), per_rank)))
        return rows

    def stream_accounts(self, specs: Sequence[AgentSpec], results: Results,
                        flow_drops: Sequence[dict], view: RunView) -> list[dict]:
        # As the collective kind's: the ranks' QPs are accounted by the transport's own
        # retransmission counters; no per-flow conservation account yet.
        return []

    def fidelity_notes(self, specs: Sequence[AgentSpec], results: Results,
                       view: RunView) -> list[str]:
        notes = []
        for spec in specs:
            res = results.get(spec.name) or {}
            if res.get("error"):
                notes.append(f"training rank {spec.name} on {spec.node}: {res['error']}")
            if res.get("wrong"):
                notes.append(f"training rank {spec.name} on {spec.node}: {res['wrong']} "
                             "gradient elements outside the exact reference's bound")
        return notes


def _arg(argv: Sequence[str], flag: str) -> str:
    """A flag's value in an argv this kind wrote (so it is there)."""
    value = arg_of(argv, flag)
    assert value is not None, flag
    return value


def _entries(specs: Sequence[AgentSpec]) -> list[tuple[str, str, list[AgentSpec]]]:
    """(traffic, kind, its ranks in rank order) for each entry among `specs`."""
    out: dict[str, tuple[str, list[AgentSpec]]] = {}
    for s in specs:
        out.setdefault(s.traffic, (s.kind, []))[1].append(s)
    return [(t, kind, sorted(ranks, key=lambda s: int(_arg(s.argv, "--rank"))))
            for t, (kind, ranks) in out.items()]


def step_config(ranks: Sequence[AgentSpec]) -> dict:
    """What the kind asked of an entry's ranks, read back from their argv (so a row can
    be written when no rank reported anything)."""
    argv = ranks[0].argv
    return {"algorithm": _arg(argv, "--algorithm"), "ranks": len(ranks),
            "dtype": _arg(argv, "--dtype"),
            "buckets_bytes": [int(b) for b in _arg(argv, "--buckets-bytes").split(",")],
            "forward_ns": int(_arg(argv, "--forward-ns")),
            "backward_ns": int(_arg(argv, "--backward-ns")),
            "overlap": "--overlap" in argv,
            "line_rate_bps": min(float(_arg(s.argv, "--line-rate-bps")) for s in ranks)}


def _us(ns: float | None) -> float | None:
    return None if ns is None else round(ns / 1e3, 3)


def training_row(cfg: dict, per_rank: Sequence[dict]) -> dict:
    """One entry's row (TrainingKind.result_fields) from its step config (`step_config`)
    and every rank's final JSON, in rank order ({} for a rank that reported nothing)."""
    n, sizes = cfg["ranks"], cfg["buckets_bytes"]
    compute_ns = cfg["forward_ns"] + cfg["backward_ns"]
    ideal = [ideal_allreduce_ns(cfg["algorithm"], n, b, cfg["line_rate_bps"]) for b in sizes]
    best = step_schedule(sizes, cfg["forward_ns"], cfg["backward_ns"], ideal, cfg["overlap"])
    steps = [r.get("iterations") or [] for r in per_rank]
    done = min((len(s) for s in steps), default=0) if len(steps) == n else 0
    # per iteration, the slowest rank (nccl-tests reduces times over processes with max)
    iteration = [max(s[i]["iteration_ns"] for s in steps) for i in range(done)]
    comm = [max(s[i]["comm_ns"] for s in steps) for i in range(done)]
    exposed = [max(0.0, x - compute_ns) for x in iteration]
    per_bucket = [sum(max(s[i]["buckets"][k]["allreduce_ns"] for s in steps)
                      for i in range(done)) / done if done else None
                  for k in range(len(sizes))]
    it_stats, ex_stats = summary(iteration), summary(exposed)
    comm_mean = sum(comm) / done if done else None
    exposed_mean = ex_stats["avg_us"]
    counted = [x for s in steps for x in s[:done]]
    lows = [x["min_rate_bps"] for x in counted if x.get("min_rate_bps") is not None]
    checked = [r["wrong"] for r in per_rank if r.get("wrong") is not None]
    errors = [str(r["error"]) for r in per_rank if r.get("error")]
    if not errors and len(checked) < n:
        errors = [f"{n - len(checked)} of {n} ranks reported no checked step"]
    return {
        "algorithm": cfg["algorithm"], "ranks": n, "buckets": len(sizes),
        "bucket_bytes": sum(sizes), "dtype": cfg["dtype"], "overlap": cfg["overlap"],
        "iterations": done,
        "iteration_us": _us(it_stats["avg_us"]), "iteration_p50_us": _us(it_stats["p50_us"]),
        "iteration_p99_us": _us(it_stats["p99_us"]), "compute_us": _us(compute_ns),
        "comm_us": _us(comm_mean), "exposed_us": _us(exposed_mean),
        "exposed_p99_us": _us(ex_stats["p99_us"]),
        "overlap_efficiency": (round(1 - exposed_mean / comm_mean, 4)
                               if comm_mean and exposed_mean is not None else None),
        "comm_ideal_us": _us(sum(ideal)), "exposed_ideal_us": _us(best.exposed_ns),
        "iteration_ideal_us": _us(best.iteration_ns),
        "exposed_excess_us": (_us(exposed_mean - best.exposed_ns)
                              if exposed_mean is not None else None),
        "bucket_us": [_us(b) for b in per_bucket],
        "iterations_us": [_us(x) for x in iteration],
        "exposed_iterations_us": [_us(x) for x in exposed],
        **{f: sum(int(x.get(f) or 0) for x in counted) for f in CONGESTION_FIELDS},
        "min_rate_bps": min(lows) if lows else None,
        "wrong": sum(int(w) for w in checked),
        "error": errors[0] if errors else None,
    }


KIND = TrainingKind()
