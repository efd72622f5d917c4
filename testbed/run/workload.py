"""Expand a config's `workload:` into the agents a run starts, through the workload kinds
(testbed/workloads). Pure: the plan is read, never changed.

This module is the kinds' window on the plan: it builds the `ExpandContext` (host
addresses and rates, class DSCPs, the longest round trip per class) and the `RunView`
they read results through, so that no kind imports the plan.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from fractions import Fraction
from pathlib import Path

from testbed.config.models import Fabric, TrafficClass
from testbed.plan.model import Plan
from testbed.plan.paths import (
    base_round_trip_ns,
    host_address,
    host_addresses,
    line_rate_bps,
    link_address,
    longest_round_trip_ns,
    neighbours,
)
from testbed.workloads.base import AgentSpec, ExpandContext, Results, RunView, WorkloadKind
from testbed.workloads.registry import REGISTRY

# Default sample period in wall time: what a person watching progress expects,
# and cheap for the collector (well under 1 ms per sample on the default fabric).
DEFAULT_SAMPLE_PERIOD_WALL_NS = 100_000_000


def traffic_class(fabric: Fabric, tclass: str | int) -> TrafficClass:
    for t in fabric.traffic_classes:
        if tclass in (t.name, t.tc):
            return t
    raise KeyError(f"unknown traffic class {tclass!r}")


def dscp_of(fabric: Fabric, tclass: str | int) -> int:
    t = traffic_class(fabric, tclass)
    return t.dscp[0] if t.dscp else 0


def cnp_dscp_of(fabric: Fabric) -> int | None:
    """DSCP of the class named `cnp` (strict priority for CNPs), if the fabric has one."""
    for t in fabric.traffic_classes:
        if t.name == "cnp" and t.dscp:
            return t.dscp[0]
    return None


def _memo(f: Callable[[int], Fraction]) -> Callable[[int], Fraction]:
    done: dict[int, Fraction] = {}

    def once(tc: int) -> Fraction:
        if tc not in done:
            done[tc] = f(tc)
        return done[tc]
    return once


def expand_context(fabric: Fabric, plan: Plan) -> ExpandContext:
    """The plan as the kinds see it for one expansion."""
    return ExpandContext(
        hosts=[h.name for h in plan.hosts()], dilation=plan.dilation.factor,
        mtu_bytes=plan.mtu_bytes, roce_mtu_bytes=fabric.roce_mtu_bytes,
        address=lambda host: host_address(plan, host),
        line_rate_bps=lambda host: line_rate_bps(plan, host),
        dscp=lambda tclass: dscp_of(fabric, tclass),
        tc=lambda tclass: traffic_class(fabric, tclass).tc,
        cnp_dscp=cnp_dscp_of(fabric),
        round_trip_ns=_memo(lambda tc: longest_round_trip_ns(plan, tc)),
        neighbours=lambda node: neighbours(plan, node),
        link_address=lambda node, peer: link_address(plan, node, peer),
        role=lambda node: plan.node(node).role,
        classes={k: c for c in fabric.traffic_classes for k in (c.name, c.tc)},
        base_rtt_ns=_pair_memo(lambda src, dst: base_round_trip_ns(plan, src, dst)),
        trim_dscp=plan.trim_dscp, lab=plan.lab)


def _pair_memo(f: Callable[[str, str], int]) -> Callable[[str, str], int]:
    done: dict[tuple[str, str], int] = {}

    def once(src: str, dst: str) -> int:
        if (src, dst) not in done:
            done[(src, dst)] = f(src, dst)
        return done[(src, dst)]
    return once


def expand_workload(fabric: Fabric, plan: Plan) -> list[AgentSpec]:
    """Every agent of the workload, entry by entry in config order (receivers of an entry
    before its senders)."""
    if fabric.workload is None:
        return []
    ctx = expand_context(fabric, plan)
    specs: list[AgentSpec] = []
    for k, entry in enumerate(fabric.workload.traffic):
        specs += REGISTRY.of(entry.kind).expand(entry, k, ctx)
    for kind in dict.fromkeys(REGISTRY.of(e.kind) for e in fabric.workload.traffic):
        specs = kind.combine(specs, ctx)
    return specs


def workload_work_wall_s(fabric: Fabric) -> float:
    """The most wall time any entry's agents spend outside their fabric schedule
    (WorkloadKind.work_wall_s): entries run at once, so the largest counts."""
    if fabric.workload is None:
        return 0.0
    return max((REGISTRY.of(t.kind).work_wall_s(t) for t in fabric.workload.traffic),
               default=0.0)


def workload_span_ns(fabric: Fabric, plan: Plan | None = None) -> int:
    """Fabric time from t0 until the last sender is scheduled to stop (an entry without a
    schedule counts as its kind says: RoCE `messages` at line rate, with a plan)."""
    if fabric.workload is None:
        return 0
    ctx = expand_context(fabric, plan) if plan is not None else None
    return max((REGISTRY.of(t.kind).span_ns(t, ctx) for t in fabric.workload.traffic),
               default=0)


def run_view(plan: Plan, agents_dir: Path, t0_realtime_ns: int,
             paused_nodes: frozenset[str] = frozenset(), lossless_drops: int = 0) -> RunView:
    """A finished run as the kinds read it."""
    def ready_mtime_ns(spec: AgentSpec) -> int | None:
        try:
            return ready_file(agents_dir, spec).stat().st_mtime_ns
        except FileNotFoundError:
            return None

    rtts: dict[tuple[str, str], int] = {}

    def base_rtt_ns(src: str, dst: str) -> int:
        if (src, dst) not in rtts:
            rtts[src, dst] = base_round_trip_ns(plan, src, dst)
        return rtts[src, dst]

    return RunView(
        dilation=plan.timebase, t0_realtime_ns=t0_realtime_ns,
        address=lambda host: host_address(plan, host),
        addresses=lambda host: host_addresses(plan, host),
        line_rate_bps=lambda host: line_rate_bps(plan, host),
        ready_mtime_ns=ready_mtime_ns, paused_nodes=paused_nodes,
        lossless_drops=lossless_drops, base_rtt_ns=base_rtt_ns,
        roce_mtu_bytes=plan.roce_mtu_bytes)


def by_kind(specs: Iterable[AgentSpec]) -> dict[WorkloadKind, list[AgentSpec]]:
    """Agents grouped by the kind module that owns them, in order."""
    out: dict[WorkloadKind, list[AgentSpec]] = {}
    for spec in specs:
        out.setdefault(REGISTRY.of(spec.kind), []).append(spec)
    return out


def stream_accounts(specs: Iterable[AgentSpec], results: Results, flow_drops: Sequence[dict],
                    view: RunView) -> list[dict]:
    """Every stream's packet account (WorkloadKind.stream_accounts), kind by kind."""
    return [a for kind, group in by_kind(specs).items()
            for a in kind.stream_accounts(group, results, flow_drops, view)]


def ready_file(agents_dir: Path, spec: AgentSpec) -> Path:
    return agents_dir / f"{spec.name}.ready"


def armed_file(agents_dir: Path, spec: AgentSpec) -> Path:
    """Where a sender says it is set up and waiting for the start (agents.runtime.start)."""
    return agents_dir / f"{spec.name}.armed"


def start_file(agents_dir: Path) -> Path:
    """The run's start file, alone in its directory (agents.runtime.start says why)."""
    return agents_dir / "start" / "t0.json"


def out_file(agents_dir: Path, spec: AgentSpec) -> Path:
    return agents_dir / f"{spec.name}.json"


def events_file(agents_dir: Path, spec: AgentSpec) -> Path:
    return agents_dir / f"{spec.name}.events.jsonl"
