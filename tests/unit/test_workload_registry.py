"""The workload-kind seam is real: a kind defined here, in a test module, and added to the
registry alone, is validated by the config loader, expanded into agents, and has its
results written and summarised by the run's own stages, with no core file knowing it.
And a kind nobody registered is an error everywhere, never a fallback."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import ClassVar, Literal

import pytest
from pydantic import Field

from testbed.config import ConfigError, load_config_text
from testbed.fields import DurationNs
from testbed.plan import compile_plan
from testbed.results.store import Store
from testbed.run.runner import Notes, Run, RunOptions, write_results, write_summary
from testbed.run.workload import expand_workload, workload_span_ns
from testbed.workloads.base import (
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
    streams,
)
from testbed.workloads.registry import REGISTRY, UnknownKind


class EchoTraffic(TrafficEntry):
    """Echo probes between pairs of hosts (a toy kind)."""

    name: str
    kind: Literal["echo_pairs"]
    pairs: list[tuple[str, str]] | None = Field(None, description="[src, dst] lists")
    duration_ns: DurationNs = Field(alias="duration")
    probes: int = Field(10, ge=1, description="probes per pair")


class EchoKind(WorkloadKind):
    shapes: ClassVar = {"echo_pairs": Shape.PAIRS}
    model: ClassVar = EchoTraffic
    agent_module: ClassVar = "tests.no_such_agent"
    doc: ClassVar = "A toy: echo probes between pairs."
    result_fields: ClassVar = {"src": "sender", "dst": "echoer", "echoed": "probes back"}
    ports: ClassVar = {"udp": range(30000, 31000)}
    example: ClassVar = {"name": "e", "kind": "echo_pairs", "pairs": [["h1", "h2"]],
                         "duration": "1ms"}

    def check(self, entry: TrafficEntry, loc: tuple, ctx: CheckContext) -> Iterator[Problem]:
        assert isinstance(entry, EchoTraffic)
        if entry.probes > 1000:
            yield loc + ("probes",), "at most 1000 probes"

    def expand(self, entry: TrafficEntry, index: int, ctx: ExpandContext) -> list[AgentSpec]:
        assert isinstance(entry, EchoTraffic)
        out = []
        for src, dst in streams(entry, self.shape(entry), ctx.hosts):
            out.append(AgentSpec(name=f"{entry.name}-{dst}-echo", node=dst, role="receiver",
                                 traffic=entry.name, kind=entry.kind, module=self.agent_module,
                                 argv=["echo", "--port", str(30000 + index)], src=src, dst=dst))
            out.append(AgentSpec(name=f"{entry.name}-{src}-{dst}", node=src, role="sender",
                                 traffic=entry.name, kind=entry.kind, module=self.agent_module,
                                 argv=["probe", "--dst", ctx.address(dst), "--count",
                                       str(entry.probes)], src=src, dst=dst,
                                 duration_ns=entry.duration_ns))
        return out

    def result_rows(self, specs: Sequence[AgentSpec], results: Results,
                    view: RunView) -> list[ResultRow]:
        return [ResultRow(s.traffic, s.kind, {"src": s.src, "dst": s.dst,
                                              "echoed": results.get(s.name, {}).get("echoed", 0)})
                for s in specs if s.role == "sender"]

    def stream_accounts(self, specs: Sequence[AgentSpec], results: Results,
                        flow_drops: Sequence[dict], view: RunView) -> list[dict]:
        return []


FABRIC = """\
name: echo
dilation: 100
topology:
  kind: single_switch
  hosts: 3
  host_link: {port: 100GBASE-CR1, length: 2m}
workload:
  traffic:
    - {name: e, kind: echo_pairs, pairs: [[h1, h2], [h3, h2]], duration: 1ms, probes: 5}
"""


@pytest.fixture
def echo():
    with REGISTRY.registered(EchoKind()) as kind:
        yield kind


def test_a_kind_registered_from_a_test_module_is_validated_and_expanded(echo) -> None:
    loaded = load_config_text(FABRIC, "echo.yaml")
    (entry,) = loaded.fabric.workload.traffic
    assert isinstance(entry, EchoTraffic) and entry.probes == 5
    plan = compile_plan(loaded)
    specs = expand_workload(loaded.fabric, plan)
    assert [(s.node, s.role, s.argv[0]) for s in specs] == [
        ("h2", "receiver", "echo"), ("h1", "sender", "probe"),
        ("h2", "receiver", "echo"), ("h3", "sender", "probe")]
    assert {s.module for s in specs} == {"tests.no_such_agent"}
    assert workload_span_ns(loaded.fabric, plan) == 1_000_000


def test_a_registered_kinds_own_checks_and_fields_are_enforced(echo) -> None:
    bad = FABRIC.replace("probes: 5", "probes: 5000").replace("[h3, h2]", "[h3, h9]")
    with pytest.raises(ConfigError) as err:
        load_config_text(bad, "echo.yaml")
    text = str(err.value)
    assert "workload.traffic[0].probes: at most 1000 probes" in text
    assert "'h9' is not a host of this fabric" in text
    with pytest.raises(ConfigError, match=r"traffic\[0\]\.rate: unknown field 'rate'"):
        load_config_text(FABRIC.replace("probes: 5", "rate: 1Gbps"), "echo.yaml")


def test_a_registered_kinds_results_are_written_and_summarised(echo, tmp_path: Path) -> None:
    loaded = load_config_text(FABRIC, "echo.yaml")
    plan = compile_plan(loaded)
    specs = expand_workload(loaded.fabric, plan)
    store = Store(tmp_path / "counters.sqlite", create=True)
    run = Run(loaded=loaded, plan=plan, options=RunOptions(say=lambda _m: None),
              run_dir=tmp_path, store=store, notes=Notes(store, lambda: 0), probe={},
              specs=specs, period_ns=1000, drain_ns=1000, span_ns=1_000_000,
              t0_realtime_ns=time.time_ns())
    run.agents = [(s, None) for s in specs]   # type: ignore[misc]  # never started
    run.results = {"e-h1-h2": {"echoed": 5}, "e-h3-h2": {"echoed": 4}}
    write_results(run)
    assert run.results_written
    summary = write_summary(run)
    (workload,) = summary["workloads"]
    assert workload["kind"] == "echo_pairs"
    assert [(r["src"], r["dst"], r["echoed"]) for r in workload["results"]] == [
        ("h1", "h2", 5), ("h3", "h2", 4)]


def test_an_unknown_kind_is_an_error_not_a_fallback() -> None:
    with pytest.raises(ConfigError) as err:
        load_config_text(FABRIC.replace("echo_pairs", "gossip"), "echo.yaml")
    assert ("workload.traffic[0].kind: unknown workload kind 'gossip'; use one of "
            "udp_incast, udp_all_to_all, udp_pairs, roce_incast") in str(err.value)
    with pytest.raises(ConfigError, match="unknown workload kind 'echo_pairs'"):
        load_config_text(FABRIC, "echo.yaml")
    with pytest.raises(ConfigError, match=r"unknown workload kind 'udp_incats'; did you mean "
                                          r"'udp_incast'\?"):
        load_config_text(FABRIC.replace("echo_pairs", "udp_incats"), "echo.yaml")
    with pytest.raises(ConfigError, match=r"traffic\[0\]\.kind: required field is missing; add "
                                          r"kind: with one of udp_incast"):
        load_config_text(FABRIC.replace("kind: echo_pairs, ", ""), "echo.yaml")
    with pytest.raises(UnknownKind, match="unknown workload kind 'echo_pairs'"):
        REGISTRY.of("echo_pairs")


def test_a_kind_name_is_registered_once(echo) -> None:
    with pytest.raises(ValueError, match="already registered"):
        REGISTRY.add(EchoKind())
    assert "echo_pairs" in REGISTRY and REGISTRY.of("echo_pairs") is echo


def test_a_kind_whose_ports_overlap_another_kinds_is_refused() -> None:
    class Clash(EchoKind):
        shapes: ClassVar = {"clash_pairs": Shape.PAIRS}
        ports: ClassVar = {"udp": range(29990, 30010)}

    with pytest.raises(ValueError, match=r"udp ports 29990..30009 overlap UdpKind's "
                                         r"20000..29999"):
        REGISTRY.add(Clash())
    assert "clash_pairs" not in REGISTRY
