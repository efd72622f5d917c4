"""The training kind: config checks that name the field and the fix, one worker per rank
sharing the collectives' per-host port numbering, its argv, and the entry's row from the
ranks' results (slowest rank per iteration, exposed communication, the line-rate
schedule, congestion counters)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import pytest

from agents.collectives.schedule import ideal_allreduce_ns, step_schedule
from testbed.config import ConfigError, load_config_text
from testbed.plan import compile_plan
from testbed.run.workload import expand_workload, run_view, workload_span_ns
from testbed.workloads.base import arg_of
from testbed.workloads.collective import CollectiveTraffic
from testbed.workloads.rdma_group import GROUP_PORTS, GroupTransportEntry
from testbed.workloads.registry import REGISTRY, Registry
from testbed.workloads.training import KIND, TrainingKind, TrainingTraffic
from tests.conftest import REPO

FABRIC = """\
name: train
dilation: 1000
topology:
  kind: single_switch
  hosts: 5
  host_link: {{port: 100GBASE-CR1, length: 2m}}
workload:
  traffic:
{traffic}
"""
STEP = ("    - {name: step, kind: training, ranks: [h1, h2, h3, h4], buckets: [1MiB, 3MiB], "
        "compute: {forward: 100us, backward: 400us}, iterations: 3}")


def _load(traffic: str):
    loaded = load_config_text(FABRIC.format(traffic=traffic), "train.yaml")
    return loaded, compile_plan(loaded)


def _problems(traffic: str) -> str:
    with pytest.raises(ConfigError) as err:
        _load(traffic)
    return str(err.value)


def test_bad_training_entries_name_the_field_and_the_fix() -> None:
    text = _problems("    - {name: s, kind: training, ranks: [h1, h2], algorithm: pairwise, "
                     "buckets: {count: 0, size: 1MiB}, compute: {forward: 1ms, backwards: 1ms},"
                     " window: 0}")
    assert ("train.yaml:9: workload.traffic[0].algorithm: must be 'ring', 'rhd' or 'tree', "
            "got 'pairwise'") in text
    assert "traffic[0].buckets: count: expected 1..256 buckets, got 0" in text
    assert "traffic[0].compute.backwards: unknown field 'backwards'" in text
    assert "traffic[0].window: expected 1..2^22 packets or auto, got 0" in text
    assert "traffic[0].buckets: expected a list of sizes ([25MiB, 25MiB]) or {count: N, " \
           "size: S}, got 5" in _problems("    - {name: s, kind: training, ranks: [h1, h2], "
                                          "buckets: 5}")
    text = _problems("    - {name: s, kind: training, ranks: [h1, h1, h9], tclass: default, "
                     "cc_preset: rfc8257, buckets: [1MiB, 6, 0], chunk: 16}")
    assert "traffic[0].ranks[1]: 'h1' is already rank 0" in text
    assert "traffic[0].ranks[2]: 'h9' is not a host of this fabric" in text
    assert ("traffic[0].buckets[1]: 6 B is not a whole number of float32 elements; use a "
            "positive multiple of 4 B") in text
    assert "traffic[0].buckets[2]: 0 B is not a whole number" in text
    assert "traffic[0].cc_preset: 'rfc8257' is not a DCQCN preset (it is DCTCP's)" in text
    assert "traffic[0].tclass: class 'default' (TC0) does not mark ECN" in text
    assert "traffic[0].chunk: 16 B leaves nothing after the 16-byte chunk header" in text
    text = _problems("    - {name: s, kind: training, ranks: [h1], "
                     "buckets: {count: 3, size: 100MiB}}")
    assert "traffic[0].ranks: a training step needs at least two ranks" in text
    assert ("traffic[0].buckets: 300 MiB of buckets in all is above the 256 MiB a rank may "
            "hold") in text


def test_the_shared_transport_fields_mean_what_the_collectives_do() -> None:
    """Same names, aliases, defaults and descriptions as the collective kind's."""
    for name in GroupTransportEntry.model_fields:
        if name in ("name", "kind", "duration_ns"):
            continue
        ours, theirs = (TrainingTraffic.model_fields[name],
                        CollectiveTraffic.model_fields[name])
        assert (ours.alias, ours.default, ours.description) == (
            theirs.alias, theirs.default, theirs.description), name
    for model, entry in ((TrainingTraffic, {"kind": "training", "buckets": [4]}),
                         (CollectiveTraffic, {"kind": "allreduce"})):
        with pytest.raises(ValueError, match=r"expected 1..2\^22 packets or auto, got 0"):
            model.model_validate({"name": "x", "ranks": ["h1"], "window": 0, **entry})


def _arg(spec, flag: str) -> str:
    value = arg_of(spec.argv, flag)
    assert value is not None, flag
    return value


def test_one_worker_per_rank_on_the_collectives_port_numbering() -> None:
    loaded, plan = _load(
        "    - {name: ar, kind: allreduce, ranks: [h1, h2], sizes: {min: 4KiB, max: 4KiB}}\n"
        + STEP + "\n    - {name: quiet, kind: training, ranks: [h2, h5], overlap: false, "
        "algorithm: tree, buckets: {count: 3, size: 64KiB}, compute: {backward: 0}}")
    specs = expand_workload(loaded.fabric, plan)
    steps = [s for s in specs if s.kind == "training"]
    assert [(s.name, s.node, s.module) for s in steps] == [
        ("step-r0", "h1", "agents.collectives.training"),
        ("step-r1", "h2", "agents.collectives.training"),
        ("step-r2", "h3", "agents.collectives.training"),
        ("step-r3", "h4", "agents.collectives.training"),
        ("quiet-r0", "h2", "agents.collectives.training"),
        ("quiet-r1", "h5", "agents.collectives.training")]
    addr = {h.name: h.interfaces[0].address.split("/")[0] for h in plan.hosts()}
    # h1 and h2 hold the all-reduce's rank first, so the step's ranks there take port + 1
    assert _arg(steps[0], "--peers").split(",") == [
        f"{addr['h1']}:12001:10001", f"{addr['h2']}:12001:10001",
        f"{addr['h3']}:12000:10000", f"{addr['h4']}:12000:10000"]
    assert _arg(steps[4], "--peers").split(",") == [
        f"{addr['h2']}:12002:10002", f"{addr['h5']}:12000:10000"]
    first = steps[0]
    assert (_arg(first, "--buckets-bytes"), _arg(first, "--forward-ns"),
            _arg(first, "--backward-ns"), _arg(first, "--algorithm")) == (
        "1048576,3145728", "100000", "400000", "ring")
    assert "--overlap" in first.argv and "--no-overlap" not in first.argv
    assert (_arg(first, "--iterations"), _arg(first, "--warmup"), _arg(first, "--qps"),
            _arg(first, "--cc"), _arg(first, "--dscp")) == ("3", "1", "2", "dcqcn", "26")
    assert _arg(first, "--line-rate-bps") == str(100 * 10**9)
    quiet = steps[4]
    assert "--no-overlap" in quiet.argv and _arg(quiet, "--buckets-bytes") == \
        "65536,65536,65536"
    assert _arg(quiet, "--algorithm") == "tree" and _arg(quiet, "--backward-ns") == "0"
    # the span covers every step's compute and its all-reduces at line rate
    loaded, plan = _load(STEP)
    ideal = sum(ideal_allreduce_ns("ring", 4, b, 100e9) for b in (1 << 20, 3 << 20))
    assert workload_span_ns(loaded.fabric, plan) == pytest.approx(4 * (500_000 + ideal),
                                                                  abs=4)


def test_the_worker_accepts_what_the_kind_writes_and_refuses_bad_buckets() -> None:
    from agents.collectives.training import build_parser, check_args

    loaded, plan = _load(STEP)
    spec = expand_workload(loaded.fabric, plan)[0]
    args = build_parser().parse_args(spec.argv)
    assert check_args(args) is None
    assert args.bucket_list == [1 << 20, 3 << 20] and args.overlap is True
    args = build_parser().parse_args([*spec.argv, "--buckets-bytes", "4,6"])
    assert check_args(args) == "--buckets-bytes: 6 is not a positive multiple of float32's 4 bytes"


def test_communicator_kinds_share_their_ports_and_other_kinds_still_may_not() -> None:
    registry = Registry()
    registry.add(REGISTRY.of("allreduce"))
    registry.add(TrainingKind())         # the same ranges, the same owner: allowed

    class Squatter(TrainingKind):
        shapes: ClassVar = {"squat": TrainingKind.shapes["training"]}
        port_owner: ClassVar = None

    with pytest.raises(ValueError, match="tcp ports 12000..12499 overlap"):
        registry.add(Squatter())
    assert KIND.ports == GROUP_PORTS


def _step(iteration_ns: float, comm: list[float], **counters: int) -> dict:
    return {"iteration_ns": iteration_ns, "compute_ns": 500_000, "comm_ns": sum(comm),
            "exposed_ns": iteration_ns - 500_000,
            "buckets": [{"ready_ns": 0, "start_ns": 0, "allreduce_ns": c} for c in comm],
            "cnps": counters.get("cnps", 0), "rate_cuts": counters.get("rate_cuts", 0),
            "retransmissions": 0, "rnr_naks": counters.get("rnr_naks", 0), "timeouts": 0,
            "ecn_marked": counters.get("cnps", 0) * 3,
            "min_rate_bps": counters.get("low", 100e9)}


def _rank(rank: int, steps: list[dict], wrong: int | None = 0) -> dict:
    return {"rank": rank, "size": 4, "algorithm": "ring", "iterations": steps,
            "wrong": wrong, "error": None}


def test_the_row_takes_the_slowest_rank_per_iteration_and_sets_it_beside_line_rate(
        tmp_path: Path) -> None:
    loaded, plan = _load(STEP)
    specs = expand_workload(loaded.fabric, plan)
    fast = [_step(600_000, [20_000, 100_000]), _step(620_000, [20_000, 120_000])]
    slow = [_step(700_000, [30_000, 200_000], cnps=5, rate_cuts=2, low=20e9),
            _step(610_000, [25_000, 110_000], cnps=1, rnr_naks=4)]
    results = {s.name: _rank(i, slow if i == 2 else fast) for i, s in enumerate(specs)}
    results["step-r3"]["wrong"] = 7
    (row,) = KIND.result_rows(specs, results, run_view(plan, tmp_path, 0))
    f = row.fields
    assert list(f) == list(KIND.result_fields)
    assert (f["algorithm"], f["ranks"], f["buckets"], f["bucket_bytes"], f["overlap"]) == (
        "ring", 4, 2, 4 << 20, True)
    assert f["iterations_us"] == [700.0, 620.0]          # per iteration, the slowest rank
    assert f["iteration_us"] == 660.0 and f["iteration_p99_us"] == 700.0
    assert f["compute_us"] == 500.0
    assert f["exposed_iterations_us"] == [200.0, 120.0] and f["exposed_us"] == 160.0
    assert f["exposed_p99_us"] == 200.0
    assert f["comm_us"] == pytest.approx((230 + 140) / 2)
    assert f["overlap_efficiency"] == pytest.approx(1 - 160 / 185, abs=1e-4)
    assert f["bucket_us"] == [pytest.approx(27.5), pytest.approx(160.0)]
    ideal = [ideal_allreduce_ns("ring", 4, b, 100e9) for b in (1 << 20, 3 << 20)]
    best = step_schedule([1 << 20, 3 << 20], 100_000, 400_000, ideal, overlap=True)
    assert f["comm_ideal_us"] == pytest.approx(sum(ideal) / 1e3, abs=1e-3)
    assert f["exposed_ideal_us"] == pytest.approx(best.exposed_ns / 1e3, abs=1e-3)
    assert f["exposed_ideal_us"] == pytest.approx(ideal[1] / 1e3, abs=1e-3)  # the last one
    assert f["exposed_excess_us"] == pytest.approx(160 - best.exposed_ns / 1e3, abs=1e-3)
    assert (f["cnps"], f["rate_cuts"], f["rnr_naks"], f["ecn_marked"]) == (6, 2, 4, 18)
    assert f["min_rate_bps"] == 20e9
    assert f["wrong"] == 7 and f["error"] is None
    notes = KIND.fidelity_notes(specs, results, run_view(plan, tmp_path, 0))
    assert notes == ["training rank step-r3 on h4: 7 gradient elements outside the exact "
                     "reference's bound"]


def test_a_rank_that_reported_nothing_leaves_a_row_that_says_so(tmp_path: Path) -> None:
    loaded, plan = _load(STEP)
    specs = expand_workload(loaded.fabric, plan)
    results = {s.name: _rank(i, [_step(600_000, [1, 2])]) for i, s in enumerate(specs)}
    del results["step-r1"]
    (row,) = KIND.result_rows(specs, results, run_view(plan, tmp_path, 0))
    f = row.fields
    assert f["iterations"] == 0 and f["iteration_us"] is None and f["exposed_us"] is None
    assert f["error"] == "1 of 4 ranks reported no checked step"
    assert f["exposed_ideal_us"] > 0                 # the config alone gives the ideal
    results["step-r1"] = {**_rank(1, []), "wrong": None, "error": "TransportError: gone"}
    (row,) = KIND.result_rows(specs, results, run_view(plan, tmp_path, 0))
    assert row.fields["error"] == "TransportError: gone"


def test_two_workers_run_overlapped_steps_on_loopback(tmp_path: Path) -> None:
    """The worker itself, over real QPs on 127.0.0.1: buckets start no earlier than they
    are ready, in order, the step ends after both compute and communication, and the
    checked step is exact."""
    import socket

    def free(kind: int) -> list[int]:
        socks = [socket.socket(socket.AF_INET, kind) for _ in range(2)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        ports = [s.getsockname()[1] for s in socks]
        for s in socks:
            s.close()
        return ports

    tcp, udp = free(socket.SOCK_STREAM), free(socket.SOCK_DGRAM)
    peers = ",".join(f"127.0.0.1:{t}:{u}" for t, u in zip(tcp, udp, strict=True))
    procs = [subprocess.Popen(
        [sys.executable, "-m", "agents.collectives.training", "--rank", str(r),
         "--peers", peers, "--buckets-bytes", "65536,8192,131072", "--forward-ns", "20000",
         "--backward-ns", "60000", "--warmup", "1", "--iterations", "2", "--dtype", "int32",
         "--chunk-bytes", "16384", "--mtu", "1024", "--line-rate-bps", "2e9",
         "--dilation", "10", "--spin-ns", "0", "--timeout-ns", "1e9",
         "--out", str(tmp_path / f"r{r}.json")],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err + out
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for o in outs:
        assert o["error"] is None and o["wrong"] == 0 and o["stopped_by"] == "done"
        assert o["buckets_bytes"] == [65536, 8192, 131072] and len(o["iterations"]) == 2
        for it in o["iterations"]:
            b = it["buckets"]
            assert [x["ready_ns"] for x in b] == [39200, 41600, 80000]
            assert all(x["start_ns"] >= x["ready_ns"] for x in b)
            assert all(b[k + 1]["start_ns"] >= b[k]["start_ns"] + b[k]["allreduce_ns"] - 1
                       for k in range(2))
            assert it["comm_ns"] == sum(x["allreduce_ns"] for x in b)
            assert it["iteration_ns"] >= max(80000, b[-1]["start_ns"] + b[-1]["allreduce_ns"])
            assert it["exposed_ns"] == it["iteration_ns"] - 80000 >= b[-1]["allreduce_ns"] - 1
            assert it["cnps"] == 0 and it["ecn_marked"] == 0          # nothing marks here


def test_the_training_suite_runs_the_same_step_without_and_with_an_incast() -> None:
    from testbed.cli.run import suite_runs

    runs = suite_runs(str(REPO / "configs" / "suites" / "training.yaml"))
    assert runs is not None and len(runs) == 2
    steps, others = [], []
    for path in runs:
        loaded = load_config_text(Path(path).read_text(), path)
        plan = compile_plan(loaded)
        assert plan.timebase.factor == 4000 and len(plan.hosts()) == 8   # the default fabric
        step, *rest = loaded.fabric.workload.traffic
        assert step.kind == "training" and len(step.ranks) == 8
        steps.append(step.model_dump(exclude={"name"}))
        others.append([t.kind for t in rest])
        assert expand_workload(loaded.fabric, plan)
    assert steps[0] == steps[1] and others == [[], ["roce_incast"]]
