"""The collective workload kind: config checks, one worker per rank with its peers and
ports, and results the way nccl-tests reports them (rows, its table, its -J JSON)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agents.collectives.ops import bus_factor, count_of
from testbed.config import ConfigError, load_config_text
from testbed.plan import compile_plan
from testbed.run.workload import expand_context, expand_workload, run_view, workload_span_ns
from testbed.workloads.base import AgentFiles
from testbed.workloads.collective import KIND, CollectiveTraffic, InaSettings
from testbed.workloads.collective_nccl import iteration_stats, percentile_index

FABRIC = """\
name: coll
dilation: 1000
topology:
  kind: single_switch
  hosts: 5
  host_link: {{port: 100GBASE-CR1, length: 2m}}
workload:
  traffic:
{traffic}
"""
AR = ("    - {name: ar, kind: allreduce, ranks: [h1, h2, h3], "
      "sizes: {min: 4KiB, max: 64KiB, factor: 4}, iterations: 3}")


def _load(traffic: str):
    loaded = load_config_text(FABRIC.format(traffic=traffic), "coll.yaml")
    return loaded, compile_plan(loaded)


def _problems(traffic: str) -> str:
    with pytest.raises(ConfigError) as err:
        _load(traffic)
    return str(err.value)


def test_one_worker_per_rank_with_every_peers_address_and_ports() -> None:
    loaded, plan = _load(AR + "\n    - {name: a2a, kind: alltoall, ranks: [h3, h1], "
                              "sizes: {min: 8KiB, max: 8KiB}}")
    specs = expand_workload(loaded.fabric, plan)
    assert [(s.name, s.node, s.role) for s in specs] == [
        ("ar-r0", "h1", "sender"), ("ar-r1", "h2", "sender"), ("ar-r2", "h3", "sender"),
        ("a2a-r0", "h3", "sender"), ("a2a-r1", "h1", "sender")]
    argv = specs[0].argv
    peers = argv[argv.index("--peers") + 1].split(",")
    addr = {h.name: h.interfaces[0].address.split("/")[0] for h in plan.hosts()}
    assert peers == [f"{addr['h1']}:12000:10000", f"{addr['h2']}:12000:10000",
                     f"{addr['h3']}:12000:10000"]
    # the second entry's ranks take the next ports on hosts that already have one
    second = specs[3].argv[specs[3].argv.index("--peers") + 1].split(",")
    assert second == [f"{addr['h3']}:12001:10001", f"{addr['h1']}:12001:10001"]
    assert argv[argv.index("--algorithm") + 1] == "ring"          # allreduce's default
    assert specs[3].argv[specs[3].argv.index("--algorithm") + 1] == "pairwise"
    assert {s.module for s in specs} == {"agents.collectives"}
    assert workload_span_ns(loaded.fabric, plan) > 0


def test_ranks_write_phase_events_and_aggregators_do_not(tmp_path: Path) -> None:
    loaded, plan = _load("    - {name: ina, kind: allreduce, algorithm: ina, ranks: [h1, h2], "
                         "sizes: {min: 64KiB, max: 64KiB}}")
    specs = expand_workload(loaded.fabric, plan)
    for spec in specs:
        files = AgentFiles(ready=tmp_path / f"{spec.name}.ready",
                           out=tmp_path / f"{spec.name}.json",
                           events=tmp_path / f"{spec.name}.events.jsonl")
        argv = KIND.files_argv(spec, files)
        assert argv[argv.index("--out") + 1] == str(files.out)
        if spec.module == "agents.collectives":
            assert argv[argv.index("--events") + 1] == str(files.events)
        else:                                   # the aggregator takes no --events
            assert spec.module == "agents.aggregator" and "--events" not in argv
    assert {s.module for s in specs} == {"agents.collectives", "agents.aggregator"}


def test_bad_collective_entries_are_named() -> None:
    text = _problems("    - {name: b, kind: broadcast, algorithm: tree, root: 3, redop: max, "
                     "ranks: [h1, h1, h9]}")
    assert "traffic[0].algorithm: 'tree' is not a broadcast algorithm; use ring" in text
    assert "traffic[0].ranks[1]: 'h1' is already rank 0" in text
    assert "traffic[0].ranks[2]: 'h9' is not a host of this fabric" in text
    assert "traffic[0].root: root 3 is not a rank (ranks 0..2)" in text
    assert "traffic[0].redop: broadcast reduces nothing" in text
    text = _problems("    - {name: r, kind: reducescatter, ranks: [h1, h2, h3], "
                     "sizes: {min: 8, max: 4KiB}}")
    assert "sizes.min: 8 B holds no element per rank" in text
    assert "unknown field 'senders'" in _problems(
        "    - {name: r, kind: allreduce, ranks: [h1, h2], senders: [h1]}")


def test_nccl_tests_counts_and_bus_factors() -> None:
    assert count_of("allreduce", 1 << 20, 8, "float32") == 1 << 18
    assert count_of("allgather", 1 << 20, 8, "float32") == 1 << 15      # per rank
    assert count_of("alltoall", 1 << 20, 8, "float16") == 1 << 16       # per peer
    assert bus_factor("allreduce", 8) == pytest.approx(1.75)
    assert bus_factor("allgather", 8) == bus_factor("alltoall", 8) == pytest.approx(0.875)
    assert bus_factor("broadcast", 8) == 1.0
    assert percentile_index(20, 99) == 19 and percentile_index(100, 99) == 98
    stats = iteration_stats([3.0, 1.0, 2.0, 10.0])
    assert (stats["min_us"], stats["max_us"], stats["p50_us"], stats["avg_us"]) == (
        1.0, 10.0, 3.0, 4.0)


def _rank_result(rank: int, slow: float) -> dict:
    return {"rank": rank, "op": "allreduce", "algorithm": "ring", "dtype": "float32",
            "redop": "sum", "root": 0, "error": None,
            "results": [{"bytes": size, "count": size // 4, "wrong": 1 if rank == 2 else 0,
                         "iterations_us": [10.0 * slow, 12.0 * slow, 11.0 * slow],
                         "avg_us": 11.0 * slow, "phases_us": {"reduce_scatter": 5.0 * slow}}
                        for size in (4096, 16384, 65536)]}


def test_rows_take_the_slowest_rank_and_nccl_tests_bandwidths(tmp_path: Path) -> None:
    loaded, plan = _load(AR)
    specs = expand_workload(loaded.fabric, plan)
    results = {s.name: _rank_result(i, 1.0 + i) for i, s in enumerate(specs)}
    view = run_view(plan, tmp_path, 0)
    rows = KIND.result_rows(specs, results, view)
    assert [r.fields["bytes"] for r in rows] == [4096, 16384, 65536]
    row = rows[-1].fields
    assert row["time_us"] == 33.0                               # rank 2: 11 us x 3
    assert row["iterations_us"] == [30.0, 36.0, 33.0]           # per iteration, the max
    assert row["algbw_gbps"] == pytest.approx(65536 / 33e3, abs=1e-4)
    assert row["busbw_gbps"] == pytest.approx(65536 / 33e3 * 4 / 3, abs=1e-4)
    assert row["wrong"] == 1 and row["root"] == -1 and row["count"] == 16384
    assert row["phases_us"]["reduce_scatter"] == pytest.approx(10.0)
    notes = KIND.fidelity_notes(specs, results, view)
    assert notes == ["collective rank ar-r2 on h3: 3 elements outside the exact reference's "
                     "bound"]
    # a rank that reported nothing makes every row say so
    del results["ar-r1"]
    rows = KIND.result_rows(specs, results, view)
    assert all(r.fields["error"] == "1 of 3 ranks reported no result for "
               f"{r.fields['bytes']} B" for r in rows)
    assert all(r.fields["iterations_us"] == [] for r in rows)


def test_nccl_tests_table_and_json_files(tmp_path: Path) -> None:
    loaded, plan = _load(AR)
    specs = expand_workload(loaded.fabric, plan)
    results = {s.name: _rank_result(i, 1.0) for i, s in enumerate(specs)}
    view = run_view(plan, tmp_path, 0)
    files = KIND.output_files(KIND.result_rows(specs, results, view), specs, results, view)
    text = files["ar.nccl.txt"]
    assert "minBytes 4096 maxBytes 65536 step: 4(factor) warmup iters: 1 iters: 3" in text
    assert "busbw = algbw x 1.3333 (2(n-1)/n)" in text
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("65536"))
    assert line.split()[:5] == ["65536", "16384", "float", "sum", "-1"]
    assert "# Out of bounds values : 3 FAILED" in text
    assert "# Avg bus bandwidth    : " in text
    doc = json.loads(files["ar.nccl.json"])
    assert doc["version"] == 2 and doc["config"]["step_factor"] == 4
    first = doc["results"][0]
    assert set(first) == {"size", "count", "type", "redop", "root", "out_of_place",
                          "out_of_place_per_iter", "in_place", "actual_iterations",
                          "experiment_name"}
    assert set(first["out_of_place"]) == {"time", "alg_bw", "bus_bw", "nwrong"}
    assert first["root"] == "    -1" and first["actual_iterations"] == 3
    assert doc["out_of_bounds"] == {"count": 3, "okay": "false"}
    assert [d["hostname"] for d in doc["config"]["devices"]] == ["h1", "h2", "h3"]


def test_the_collectives_suite_compares_every_all_reduce_algorithm() -> None:
    from agents.collectives.ops import ALGORITHMS
    from testbed.cli.run import suite_runs
    from tests.conftest import REPO

    runs = suite_runs(str(REPO / "configs" / "suites" / "collectives.yaml"))
    assert runs is not None
    algorithms = []
    for path in runs:
        loaded = load_config_text(Path(path).read_text(), path)
        plan = compile_plan(loaded)
        (entry,) = loaded.fabric.workload.traffic
        assert entry.kind == "allreduce" and len(entry.ranks) == len(plan.hosts())
        algorithms.append(entry.op_algorithm)
        assert expand_workload(loaded.fabric, plan)
    assert sorted(algorithms) == sorted((*ALGORITHMS["allreduce"], "ina"))


def test_the_run_waits_long_enough_for_a_big_collective_and_its_checks() -> None:
    """The span is a bound (twice the line-rate time plus a step allowance), and the wall
    time a rank spends building and checking 64 MiB buffers is allowed on top of it."""
    loaded, plan = _load("    - {name: ar, kind: allreduce, ranks: [h1, h2, h3, h4, h5], "
                         "sizes: {min: 64MiB, max: 64MiB}, iterations: 1, warmup: 1}")
    entry = loaded.fabric.workload.traffic[0]
    line_rate_ns = 2 * 64 * 2**20 * bus_factor("allreduce", 5) * 8 / 100  # 2 runs, 100G
    assert workload_span_ns(loaded.fabric, plan) > 2 * line_rate_ns
    # 16 Mi elements, 6 inputs recomputed per rank, 5 ranks on 2 cores: tens of seconds
    assert 20 < KIND.work_wall_s(entry) < 300
    small, _ = _load(AR)
    assert KIND.work_wall_s(small.fabric.workload.traffic[0]) < 1


def test_aggregators_get_a_receive_buffer_for_every_contributors_window() -> None:
    loaded, plan = _load("    - {name: ar, kind: allreduce, algorithm: ina, "
                         "ranks: [h1, h2, h3, h4, h5], ina: {slots: 512}}")
    [agg] = [s for s in expand_workload(loaded.fabric, plan) if s.role == "receiver"]
    rcvbuf = int(agg.argv[agg.argv.index("--rcvbuf-bytes") + 1])
    assert rcvbuf >= 2 * 5 * 512 * (2048 * 4 + 32)


def test_phase_events_beyond_the_cap_are_a_fidelity_note() -> None:
    loaded, plan = _load(AR)
    specs = expand_workload(loaded.fabric, plan)
    results = {s.name: {"results": [], "events_written": 10000, "events_dropped": 0}
               for s in specs}
    results["ar-r1"]["events_dropped"] = 42
    [note] = KIND.fidelity_notes(specs, results, run_view(plan, Path("/nonexistent"), 0))
    assert "ar-r1" in note and "42 phase events" in note


LEAF_SPINE = """\
name: inatree
dilation: 1000
topology:
  kind: leaf_spine
  spines: 2
  leaves: 2
  hosts_per_leaf: 3
  host_link: {{port: 100GBASE-CR1, length: 2m}}
  fabric_link: {{port: 400GBASE-DR4, length: 100m}}
workload:
  traffic:
{traffic}
"""


def _ina(traffic: str):
    loaded = load_config_text(LEAF_SPINE.format(traffic=traffic), "ina.yaml")
    plan = compile_plan(loaded)
    return plan, expand_workload(loaded.fabric, plan)


def _ip(plan, node: str, peer: str) -> str:
    return next(i.address.split("/")[0] for i in plan.node(node).interfaces
                if i.peer.node == peer)


def _aggregators(specs) -> dict[str, tuple[int, list[dict], str | None]]:
    """switch -> (port, jobs, parent) of each aggregator among `specs`."""
    out = {}
    for s in specs:
        if s.module == "agents.aggregator":
            argv = s.argv
            parent = argv[argv.index("--parent") + 1] if "--parent" in argv else None
            out[s.node] = (int(argv[argv.index("--port") + 1]),
                           json.loads(argv[argv.index("--jobs") + 1]), parent)
    return out


def _worker_ina(spec) -> tuple[str, str, str, str]:
    argv = spec.argv
    return tuple(argv[argv.index(f) + 1] for f in ("--aggregator", "--job-id", "--worker-id",
                                                     "--ina-port"))


def test_ina_places_leaf_aggregators_under_a_spine_linked_to_every_leaf() -> None:
    plan, specs = _ina("    - {name: ar, kind: allreduce, algorithm: ina, "
                       "ranks: [h1, h2, h4, h5]}")
    host = {h.name: h.interfaces[0].address.split("/")[0] for h in plan.hosts()}
    aggs = _aggregators(specs)
    assert [s.name for s in specs[:3]] == ["ar-agg-leaf1", "ar-agg-leaf2", "ar-agg-spine1"]
    assert aggs["leaf1"] == (11000, [{"id": 1, "members": [[0, host["h1"], 11500],
                                                           [1, host["h2"], 11500]],
                                      "slots": 128, "slot_elements": 2048, "uplink_id": 0}],
                             f"{_ip(plan, 'spine1', 'leaf1')}:11000")
    assert aggs["leaf2"][1][0]["members"] == [[2, host["h4"], 11500], [3, host["h5"], 11500]]
    assert aggs["leaf2"][1][0]["uplink_id"] == 1
    assert aggs["leaf2"][2] == f"{_ip(plan, 'spine1', 'leaf2')}:11000"
    assert aggs["spine1"] == (11000, [{"id": 1, "members": [], "children": [
        [0, _ip(plan, "leaf1", "spine1"), 11000], [1, _ip(plan, "leaf2", "spine1"), 11000]],
        "slots": 128, "slot_elements": 2048}], None)
    workers = [s for s in specs if s.module == "agents.collectives"]
    assert [_worker_ina(s) for s in workers] == [
        (f"{_ip(plan, 'leaf1', 'h1')}:11000", "1", "0", "11500"),
        (f"{_ip(plan, 'leaf1', 'h2')}:11000", "1", "1", "11500"),
        (f"{_ip(plan, 'leaf2', 'h4')}:11000", "1", "2", "11500"),
        (f"{_ip(plan, 'leaf2', 'h5')}:11000", "1", "3", "11500")]


def test_ina_ranks_on_one_switch_need_one_aggregator_as_leaf_and_root() -> None:
    plan, specs = _ina("    - {name: ar, kind: allreduce, algorithm: ina, ranks: [h1, h3]}")
    aggs = _aggregators(specs)
    assert list(aggs) == ["leaf1"]
    port, (job,), parent = aggs["leaf1"]
    assert parent is None and "uplink_id" not in job and len(job["members"]) == 2


def test_two_ina_entries_on_shared_switches_get_their_own_job_ports_and_aggregators() -> None:
    plan, specs = _ina(
        "    - {name: a, kind: allreduce, algorithm: ina, ranks: [h1, h4]}\n"
        "    - {name: b, kind: allreduce, algorithm: ina, ranks: [h2, h5]}\n"
        "    - {name: c, kind: allreduce, algorithm: ina, ranks: [h1, h2, h4]}")
    by_entry: dict[str, dict] = {}
    for s in specs:
        if s.module == "agents.aggregator":
            by_entry.setdefault(s.traffic, {})[s.node] = _aggregators([s])[s.node]
    assert {e: {sw: a[0] for sw, a in aggs.items()} for e, aggs in by_entry.items()} == {
        "a": {"leaf1": 11000, "leaf2": 11000, "spine1": 11000},
        "b": {"leaf1": 11001, "leaf2": 11001, "spine1": 11001},
        "c": {"leaf1": 11002, "leaf2": 11002, "spine1": 11002}}
    assert {e: {a[1][0]["id"] for a in aggs.values()} for e, aggs in by_entry.items()} == {
        "a": {1}, "b": {2}, "c": {3}}
    # every leaf names its own entry's root port as its parent
    for aggs in by_entry.values():
        root_port = aggs["spine1"][0]
        assert all(a[2].endswith(f":{root_port}") for sw, a in aggs.items() if sw != "spine1")
    # h1 holds a rank of a and of c: each has its own aggregation socket port
    workers = {s.name: _worker_ina(s) for s in specs if s.module == "agents.collectives"}
    assert workers["a-r0"][3] == "11500" and workers["c-r0"][3] == "11501"
    assert workers["c-r0"][0].endswith(":11002") and workers["c-r0"][1] == "3"


# h7 has a NIC on each leaf; sx is a switch linked to leaf1 only
EXTRA = """\
nodes:
  - {name: h7, role: host}
  - {name: sx, role: switch}
links:
  - {a: h7, b: leaf1, port: 100GBASE-CR1, length: 2m}
  - {a: h7, b: leaf2, port: 100GBASE-CR1, length: 2m}
  - {a: sx, b: leaf1, port: 400GBASE-DR4, length: 100m}
"""


def _ina_entry(ranks: str, ina: str = "", algorithm: str = "ina") -> str:
    return (f"    - {{name: ar, kind: allreduce, algorithm: {algorithm}, ranks: [{ranks}]"
            + (f", ina: {{{ina}}}" if ina else "") + "}")


def _tree_problems(ranks: str, ina: str, algorithm: str = "ina") -> set[str]:
    """The entry's problems (all on its line), without the file, line and entry."""
    text = LEAF_SPINE.format(traffic=_ina_entry(ranks, ina, algorithm)) + EXTRA
    try:
        load_config_text(text, "ina.yaml")
    except ConfigError as err:
        return {p.split("workload.traffic[0].", 1)[1] for p in str(err).splitlines()}
    return set()


def test_an_explicit_tree_sets_each_aggregators_parent_members_and_leaf_ids() -> None:
    loaded = load_config_text(LEAF_SPINE.format(traffic=_ina_entry(
        "h1, h2, h4, h7", "root: spine2, leaves: {leaf2: [h4, h7], leaf1: [h2, h1]}"))
        + EXTRA, "ina.yaml")
    plan = compile_plan(loaded)
    specs = expand_workload(loaded.fabric, plan)
    host = {h.name: h.interfaces[0].address.split("/")[0] for h in plan.hosts()}
    aggs = _aggregators(specs)
    assert [s.node for s in specs[:3]] == ["leaf2", "leaf1", "spine2"]
    # leaf ids in the given order; members in rank order; h7 under its second switch
    assert aggs["leaf2"] == (11000, [{"id": 1, "members": [[2, host["h4"], 11500],
                                                           [3, host["h7"], 11500]],
                                      "slots": 128, "slot_elements": 2048, "uplink_id": 0}],
                             f"{_ip(plan, 'spine2', 'leaf2')}:11000")
    assert aggs["leaf1"][1][0]["members"] == [[0, host["h1"], 11500], [1, host["h2"], 11500]]
    assert aggs["leaf1"][1][0]["uplink_id"] == 1
    assert aggs["leaf1"][2] == f"{_ip(plan, 'spine2', 'leaf1')}:11000"
    assert aggs["spine2"][1][0]["children"] == [[0, _ip(plan, "leaf2", "spine2"), 11000],
                                                [1, _ip(plan, "leaf1", "spine2"), 11000]]
    assert aggs["spine2"][2] is None
    workers = [_worker_ina(s) for s in specs if s.module == "agents.collectives"]
    assert [w[0] for w in workers] == [f"{_ip(plan, 'leaf1', 'h1')}:11000",
                                       f"{_ip(plan, 'leaf1', 'h2')}:11000",
                                       f"{_ip(plan, 'leaf2', 'h4')}:11000",
                                       f"{_ip(plan, 'leaf2', 'h7')}:11000"]


def test_a_root_alone_keeps_the_topologys_leaves() -> None:
    plan, specs = _ina(_ina_entry("h1, h4", "root: spine2"))
    aggs = _aggregators(specs)
    assert list(aggs) == ["leaf1", "leaf2", "spine2"]
    assert aggs["leaf1"][2] == f"{_ip(plan, 'spine2', 'leaf1')}:11000"
    # one leaf: the root may be the leaf (one aggregator) or a switch above it
    _, specs = _ina(_ina_entry("h1, h2", "root: leaf1"))
    assert [(s.node, "--parent" in s.argv) for s in specs[:1]] == [("leaf1", False)]
    plan, specs = _ina(_ina_entry("h1, h2", "root: spine1"))
    aggs = _aggregators(specs)
    assert list(aggs) == ["leaf1", "spine1"] and aggs["leaf1"][1][0]["uplink_id"] == 0
    assert aggs["spine1"][1][0]["children"] == [[0, _ip(plan, "leaf1", "spine1"), 11000]]


def test_a_leaf_that_is_no_switch_is_named() -> None:
    assert _tree_problems("h1, h4", "leaves: {leaf3: [h1], h2: [h4]}") == {
        "ina.leaves.leaf3: 'leaf3' is not a node of this fabric; an aggregator runs on a "
        "switch (did you mean 'leaf2'? switches: spine1, spine2, leaf1, leaf2, sx)",
        "ina.leaves.h2: 'h2' is a host; an aggregator runs on a switch (switches: spine1, "
        "spine2, leaf1, leaf2, sx)"}


def test_every_rank_is_placed_once_under_a_switch_it_is_linked_to() -> None:
    assert _tree_problems("h1, h2, h4, h5", "leaves: {leaf1: [h1], leaf2: [h4, h1, h3]}") == {
        "ina.leaves.leaf2[1]: h1 is already under leaf1; a rank has one leaf aggregator, "
        "remove it from one of them",
        "ina.leaves.leaf2[2]: 'h3' is not a rank of 'ar' (ranks: h1, h2, h4, h5); remove it",
        "ina.leaves: 2 rank(s) under no leaf: rank 1 (h2) is linked to leaf1; rank 3 (h5) is "
        "linked to leaf2; add each host under one of its switches"}
    assert _tree_problems("h1, h4", "leaves: {leaf1: [h1, h4], leaf2: []}") == {
        "ina.leaves.leaf1[1]: h4 is not linked to leaf1, so leaf1's aggregator cannot be its "
        "first hop; put it under a switch it is linked to (leaf2)",
        "ina.leaves.leaf2: leaf2 holds no rank; list the hosts of its ranks or remove it"}
    assert _tree_problems("h1", "leaves: {}") == {
        "ina.leaves: no leaf switch is given; map each leaf switch to its ranks' hosts, or "
        "remove leaves to place every rank under its own switch",
        "ina.leaves: 1 rank(s) under no leaf: rank 0 (h1) is linked to leaf1; add each host "
        "under one of its switches"}


def test_the_root_is_a_switch_linked_to_every_leaf_and_a_leaf_only_alone() -> None:
    assert _tree_problems("h1, h4", "root: sx") == {
        "ina.root: sx is not linked to leaf leaf2; the root must be linked to every leaf "
        "switch (linked to all of them: spine1, spine2)"}
    assert _tree_problems("h1, h4", "root: leaf1, leaves: {leaf1: [h1], leaf2: [h4]}") == {
        "ina.root: leaf1 is also a leaf; with 2 leaves the root is another switch, linked to "
        "each of them (spine1, spine2)"}
    assert _tree_problems("h1, h4", "root: h2") == {
        "ina.root: 'h2' is a host; an aggregator runs on a switch (switches: spine1, spine2, "
        "leaf1, leaf2, sx)"}
    assert _tree_problems("h1, h2", "root: sx, leaves: {leaf1: [h1, h2]}") == set()  # linked


def test_ina_settings_apply_to_algorithm_ina_only() -> None:
    assert _tree_problems("h1, h4", "root: spine1", algorithm="ring") == {
        "ina: ina applies to algorithm: ina, not ring; remove it or set algorithm: ina"}


RING = """\
name: inaring
topology:
  kind: ring
  switches: 6
  hosts_per_switch: 1
  host_link: {{port: 100GBASE-CR1, length: 2m}}
  fabric_link: {{port: 400GBASE-DR4, length: 100m}}
workload:
  traffic:
{traffic}
"""


def test_ranks_whose_leaves_no_switch_joins_have_no_root() -> None:
    with pytest.raises(ConfigError) as err:
        load_config_text(RING.format(traffic=_ina_entry("h1, h4")), "ring.yaml")
    assert str(err.value).splitlines() == [
        "ring.yaml:10: workload.traffic[0].ranks: no switch is linked to every leaf of the "
        "ranks (sw1, sw4), so the aggregation tree has no root; place the ranks under leaves "
        "one switch links to (ina.leaves)"]
    # sw2 joins sw1 and sw3: the root of their ranks
    loaded = load_config_text(RING.format(traffic=_ina_entry("h1, h3")), "r.yaml")
    specs = expand_workload(loaded.fabric, compile_plan(loaded))
    assert [s.node for s in specs if s.module == "agents.aggregator"] == ["sw1", "sw3", "sw2"]


# --------------------------------------------------------------------------- accounts


def _verdict(plan, streams: list[dict]) -> dict:
    from testbed.run.invariants import InvariantMonitor
    return InvariantMonitor(plan).finish(None, {}, streams, {})


def _flow(saddr: str, sport: int, daddr: str, dport: int, phy: int = 0, tail: int = 0) -> dict:
    return {"node": "x", "saddr": saddr, "daddr": daddr, "sport": sport, "dport": dport,
            "proto": 17, "tclass": 3, "phy": phy, "tail": tail, "mmu": 0, "desc": 0}


def _rank_counters(peers: dict[int, tuple[int, int, int]], endpoint_drops: int = 0,
                   sport: int = 10000, ina: dict | None = None) -> dict:
    """A rank's result: per peer (packets its QP sent, packets its QP received, out of
    order drops), split over two QPs as the transport reports them."""
    per_peer = {}
    for peer, (sent, received, ooo) in peers.items():
        qps = {str(100 + 2 * peer + k): {"packets_sent": sent // 2 + (sent % 2) * k,
                                         "packets_received": received // 2
                                         + (received % 2) * k,
                                         "responder": {"ooo_drops": ooo if k else 0},
                                         "sport": sport, "injected_drops": 0}
               for k in (0, 1)}
        per_peer[str(peer)] = {"qps": qps}
    return {"results": [], "counters": {
        "per_peer": per_peer, "ina": ina or {},
        "endpoint": {"malformed": {"BAD_ICRC": 0}, "unknown_qp": endpoint_drops,
                     "wrong_peer": 0}}}


def test_rank_to_rank_accounts_take_every_packet_of_the_flow_and_its_counted_drops(
        tmp_path: Path) -> None:
    loaded, plan = _load(AR)
    specs = expand_workload(loaded.fabric, plan)
    addr = {h.name: h.interfaces[0].address.split("/")[0] for h in plan.hosts()}
    # r0 -> r1: 120 packets (data, and ACKs for r1's data), 3 lost in the fabric;
    # r2 -> r0: one datagram r0's endpoint gave to no QP; r1 -> r2: reordered, no loss
    results = {"ar-r0": _rank_counters({1: (120, 80, 0), 2: (60, 58, 0)}, endpoint_drops=1),
               "ar-r1": _rank_counters({0: (80, 117, 0), 2: (40, 40, 0)}),
               "ar-r2": _rank_counters({0: (59, 58, 0), 1: (40, 40, 2)})}
    flows = [_flow(addr["h1"], 10000, addr["h2"], 10000, phy=2, tail=1),
             _flow(addr["h2"], 10000, addr["h1"], 10000),         # a flow with no drops
             _flow(addr["h1"], 10000, addr["h3"], 10000, phy=2)]
    streams = KIND.stream_accounts(specs, results, flows, run_view(plan, tmp_path, 0))
    by_name = {s["name"]: s for s in streams}
    assert sorted(by_name) == ["ar r0->r1", "ar r0->r2", "ar r1->r0", "ar r1->r2",
                               "ar r2->r0", "ar r2->r1"]
    a = by_name["ar r0->r1"]
    assert (a["src"], a["dst"], a["sent"], a["received"], a["fabric_drops"]) == (
        "h1", "h2", 120, 117, 3)
    assert a["drops"] == {"phy": 2, "tail": 1, "mmu": 0, "desc": 0, "injected": 0}
    assert a["lost_counted"] and a["complete"] and a["kind"] == "allreduce"
    assert by_name["ar r2->r0"]["socket_drops"] == 1
    assert by_name["ar r1->r2"]["reordered"] == 2
    verdict = _verdict(plan, streams)
    assert [(v["invariant"], v["where"]) for v in verdict["violations"]] == [
        ("reorder", "stream ar r1->r2")]
    # one more packet missing on r0 -> r2 has no counted place
    results["ar-r2"] = _rank_counters({0: (59, 57, 0), 1: (40, 40, 0)})
    streams = KIND.stream_accounts(specs, results, flows, run_view(plan, tmp_path, 0))
    [v] = _verdict(plan, streams)["violations"]
    assert (v["invariant"], v["where"], v["amount"]) == ("conservation", "stream ar r0->r2", 1)


def test_in_network_accounts_cover_ranks_leaves_and_root_both_ways(tmp_path: Path) -> None:
    plan, specs = _ina("    - {name: ar, kind: allreduce, algorithm: ina, "
                       "ranks: [h1, h2, h4, h5]}")
    host = {h.name: h.interfaces[0].address.split("/")[0] for h in plan.hosts()}
    aggs = _aggregators(specs)
    ranks = {s.node: s for s in specs if s.module == "agents.collectives"}
    up_ip = {leaf: _ip(plan, leaf, "spine1") for leaf in ("leaf1", "leaf2")}

    def peers(members: list[str]) -> dict:
        return {f"{host[h]}:11500": {"received": 40, "discarded": 1 if h == "h2" else 0,
                                     "sent": 40} for h in members}
    results = {
        "ar-agg-leaf1": {"peers": {**peers(["h1", "h2"]), f"{aggs['leaf1'][2]}": {
            "received": 32, "discarded": 0, "sent": 33}}},
        "ar-agg-leaf2": {"peers": {**peers(["h4", "h5"]), f"{aggs['leaf2'][2]}": {
            "received": 32, "discarded": 0, "sent": 32}}},
        "ar-agg-spine1": {"peers": {f"{up_ip['leaf1']}:11000": {"received": 32, "discarded": 0,
                                                                "sent": 32},
                                    f"{up_ip['leaf2']}:11000": {"received": 32, "discarded": 0,
                                                                "sent": 32}}}}
    for spec in ranks.values():
        results[spec.name] = _rank_counters({}, ina={"packets_sent": 40,
                                                     "packets_received": 40, "foreign": 0,
                                                     "bad_results": 0, "stale_results": 0})
    # leaf1 sent 33 PARTIALs to the root, which took 32: one was lost on leaf1's uplink
    flows = [_flow(up_ip["leaf1"], 11000, _ip(plan, "spine1", "leaf1"), 11000, phy=1)]
    streams = KIND.stream_accounts(specs, results, flows, run_view(plan, tmp_path, 0))
    ina = {s["name"]: s for s in streams if "agg@" in s["name"]}
    assert sorted(ina) == sorted(
        [f"ar r{r}->agg@{leaf}" for r, leaf in enumerate(["leaf1"] * 2 + ["leaf2"] * 2)]
        + [f"ar agg@{leaf}->r{r}" for r, leaf in enumerate(["leaf1"] * 2 + ["leaf2"] * 2)]
        + ["ar agg@leaf1->agg@spine1", "ar agg@spine1->agg@leaf1",
           "ar agg@leaf2->agg@spine1", "ar agg@spine1->agg@leaf2"])
    up = ina["ar agg@leaf1->agg@spine1"]
    assert (up["src"], up["dst"], up["sent"], up["received"], up["fabric_drops"]) == (
        "leaf1", "spine1", 33, 32, 1)
    assert ina["ar r1->agg@leaf1"]["discarded"] == 1 and ina["ar r1->agg@leaf1"]["src"] == "h2"
    assert ina["ar agg@leaf2->r3"]["dst"] == "h5" and ina["ar agg@leaf2->r3"]["sent"] == 40
    assert _verdict(plan, streams)["violations"] == []
    # a RESULT that never reached h4 and that no port dropped is named
    results["ar-r2"]["counters"]["ina"]["packets_received"] = 39
    streams = KIND.stream_accounts(specs, results, flows, run_view(plan, tmp_path, 0))
    [v] = _verdict(plan, streams)["violations"]
    assert (v["where"], v["amount"]) == ("stream ar agg@leaf2->r2", 1)


def test_an_aggregators_drops_and_strangers_are_noted(tmp_path: Path) -> None:
    plan, specs = _ina("    - {name: ar, kind: allreduce, algorithm: ina, ranks: [h1, h4]}")
    view = run_view(plan, tmp_path, 0)
    clean = {"drops": {"not_member": 0}, "malformed": {"TOO_SHORT": 0},
             "received_from_others": 0}
    results = {s.name: dict(clean) for s in specs if s.module == "agents.aggregator"}
    results["ar-agg-leaf1"] = {"drops": {"not_member": 6, "unknown_job": 4, "stale": 0},
                               "malformed": {"TOO_SHORT": 1}, "received_from_others": 11}
    results.update({s.name: {"results": []} for s in specs if s.module != "agents.aggregator"})
    assert KIND.fidelity_notes(specs, results, view) == [
        "aggregator ar-agg-leaf1 on leaf1 dropped 1 malformed TOO_SHORT, 6 not_member, "
        "4 unknown_job; 11 datagrams came from addresses that are not its job's members, "
        "children or parent"]
    del results["ar-agg-spine1"]
    assert KIND.fidelity_notes(specs, results, view)[-1] == (
        "aggregator ar-agg-spine1 on spine1 reported nothing")


def test_expanding_an_unchecked_tree_says_what_is_wrong() -> None:
    """The config's checks catch a bad tree first; an entry built in code is refused at
    expansion with the same words."""
    loaded, plan = _load(AR)
    entry = CollectiveTraffic(name="x", kind="allreduce", algorithm="ina",
                              ranks=["h1", "h2"], ina=InaSettings(leaves={"sw9": ["h1", "h2"]}))
    with pytest.raises(ValueError, match=r"in-network all-reduce 'x': ina\.leaves\.sw9: "
                                         r"'sw9' is not a node of this fabric"):
        KIND.expand(entry, 0, expand_context(loaded.fabric, plan))


def test_a_size_stopped_before_its_check_is_a_row_with_wrong_null(tmp_path: Path) -> None:
    """The run's wait bound (or a signal) stopped every rank in its 65536 B size: the
    iterations they timed are a row, its #wrong N/A, not a size silently missing."""
    loaded, plan = _load(AR)
    specs = expand_workload(loaded.fabric, plan)
    results = {}
    for i, s in enumerate(specs):
        res = _rank_result(i, 1.0)
        res["results"] = res["results"][:2]
        res["partial"] = {"bytes": 65536, "count": 16384, "wrong": None,
                          "iterations_us": [20.0, 21.0][:1 + (i > 0)], "avg_us": 20.5}
        results[s.name] = res
    view = run_view(plan, tmp_path, 0)
    rows = KIND.result_rows(specs, results, view)
    assert [r.fields["bytes"] for r in rows] == [4096, 16384, 65536]
    last = rows[-1].fields
    assert last["wrong"] is None and last["time_us"] == 20.5
    assert last["error"] == ("stopped before its check: 3 of 3 ranks were in it, the "
                             "furthest after 2 timed iteration(s)")
    files = KIND.output_files(rows, specs, results, view)
    table = files["ar.nccl.txt"]
    assert "N/A" in table and "1 size(s) stopped before their check" in table
    doc = json.loads(files["ar.nccl.json"])
    assert doc["results"][-1]["out_of_place"]["nwrong"] is None
    assert doc["out_of_bounds"]["count"] == 2                # ranks 2's 1 wrong per size
