"""`testbed run` of in-network all-reduces sharing switches, and of one that strangers
write to: jobs are isolated from each other and from non-members.

- Two INA entries in one run, started together on a 2 x 2 leaf-spine (2 hosts a leaf):
  their ranks on the same two leaves (disjoint hosts, or sharing one), so both jobs have
  aggregators on leaf1, leaf2 and spine1, on ports and job ids of their own. Both are
  exact, each aggregator saw its own members' (or leaves') packets only, nothing is
  dropped, and the stream accounts of both jobs hold.
- One INA job on four of six hosts, its tree given in config (the root on spine2, leaf
  ids in the order given); from an idle host's namespace a test sender
  (tests/integration/ina_inject.py) writes REQUESTs of the live job (a member's worker
  id, a full slot of large values) and of a job id nobody has to the leaf aggregator
  the members use. They are dropped and counted (not_member, unknown_job), the run's
  fidelity notes say so, and the job's result is still exact.

D = 1000, 256 KiB float32 per rank: each run takes some 20-40 s wall, most of it the
fabric's bring-up and the ranks' start.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from testbed.config import load_config_text
from testbed.net import destroy_lab
from testbed.net.namespaces import list_testbed_namespaces
from testbed.plan import Plan, compile_plan
from testbed.run.procs import AgentProcess, start_process
from testbed.run.runner import RunOptions, RunResult, run_config
from tests.conftest import unique_lab

pytestmark = [pytest.mark.root, pytest.mark.slow]

FABRIC = """\
name: {lab}
dilation: 1000
topology:
  kind: leaf_spine
  spines: 2
  leaves: 2
  hosts_per_leaf: {per_leaf}
  host_link: {{port: 100GBASE-CR1, length: 2m}}
  fabric_link: {{port: 400GBASE-DR4, length: 100m}}
workload:
  traffic:
{traffic}
"""
ENTRY = ("    - {{name: {name}, kind: allreduce, algorithm: ina, ranks: [{ranks}], "
         "sizes: {{min: 256KiB, max: 256KiB}}, iterations: 2, warmup: 0{extra}}}")


def _run(tmp_path: Path, per_leaf: int, entries: dict[str, str], on_up=None, extra: str = ""
         ) -> tuple[Plan, RunResult]:
    lab = unique_lab("inaiso")
    traffic = "\n".join(ENTRY.format(name=n, ranks=r, extra=extra) for n, r in entries.items())
    loaded = load_config_text(FABRIC.format(lab=lab, per_leaf=per_leaf, traffic=traffic),
                              "ina-isolation.yaml")
    plan = compile_plan(loaded)
    try:
        result = run_config(loaded, plan, RunOptions(runs_root=tmp_path, say=lambda _m: None,
                                                     on_up=on_up))
    finally:
        left = [ns for ns in list_testbed_namespaces() if ns.startswith(f"tb-{lab}-")]
        if left:                # the runner failed to take it down: do it, then say so
            destroy_lab(plan.lab)
    assert not left, f"namespaces left behind: {left}"
    return plan, result


def _agents(result: RunResult, prefix: str) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text())
            for p in sorted((result.run_dir / "agents").glob(f"{prefix}*.json"))}


def _address(plan: Plan, node: str, peer: str) -> str:
    return next(i.address.split("/")[0] for i in plan.node(node).interfaces
                if i.peer.node == peer)


def _host(plan: Plan, host: str) -> str:
    return plan.node(host).interfaces[0].address.split("/")[0]


def _conservation(summary: dict) -> tuple[dict, list[dict]]:
    inv = summary["invariants"]
    return inv["checks"]["conservation"], inv["streams"]


@pytest.mark.parametrize("ranks", [{"a": "h1, h3", "b": "h2, h4"},
                                   {"a": "h1, h3", "b": "h1, h4"}],
                         ids=["disjoint", "sharing_h1"])
def test_two_jobs_on_the_same_switches_are_exact_and_never_see_each_other(
        tmp_path, ranks: dict[str, str]) -> None:
    plan, result = _run(tmp_path, 2, ranks)
    summary = result.summary
    rows = {w["name"]: w["results"] for w in summary["workloads"]}
    for name in ranks:
        (row,) = rows[name]
        assert row["error"] is None and row["wrong"] == 0 and row["algorithm"] == "ina", row
    aggs = _agents(result, "")
    members = {name: {h.strip() for h in r.split(",")} for name, r in ranks.items()}
    for job_id, name in enumerate(ranks, start=1):
        mine = {k: v for k, v in aggs.items() if k.startswith(f"{name}-agg-")}
        assert set(mine) == {f"{name}-agg-leaf1", f"{name}-agg-leaf2", f"{name}-agg-spine1"}
        for agent, a in mine.items():
            assert a["port"] == 11000 + job_id - 1, agent        # own port on a shared switch
            assert list(a["jobs"]) == [str(job_id)], agent
            assert a["received_from_others"] == 0, agent
            assert not any(a["drops"].values()) and not any(a["malformed"].values()), agent
            assert all(p["discarded"] == 0 for p in a["peers"].values()), agent
            assert a["jobs"][str(job_id)]["completed"] > 0
        # the leaves heard their own members only: one address each, every packet counted
        for leaf in ("leaf1", "leaf2"):
            a = mine[f"{name}-agg-{leaf}"]
            hosts = {h for h in members[name] if plan.node(h).interfaces[0].peer.node == leaf}
            got = {addr.rsplit(":", 1)[0] for addr, p in a["peers"].items() if p["received"]}
            assert got == {_host(plan, h) for h in hosts} | {_address(plan, "spine1", leaf)}
            assert a["packets_received"] == sum(p["received"] for p in a["peers"].values())
    check, streams = _conservation(summary)
    assert check["held"] is True, summary["invariants"]["violations"]
    ina = [s for s in streams if "agg@" in s["name"]]
    assert len(ina) == 2 * (2 * 2 + 2 * 2)          # per job: 2 ranks, 2 leaves, both ways
    assert all(s["sent"] > 0 and s["sent"] == s["received"] + s["fabric_drops"] for s in ina)
    assert not [n for n in summary["fidelity"] if "aggregator" in n or "collective" in n]
    times = {name: rows[name][0]["time_us"] for name in ranks}
    print(f"\ntwo INA jobs {ranks}: time {times} us fabric; "
          f"{sum(1 for s in streams if s['kind'] == 'allreduce')} streams accounted, "
          f"{sum(s['sent'] for s in ina)} INA packets, "
          f"{sum(s['fabric_drops'] for s in streams)} dropped in the fabric")


def test_a_non_members_packets_and_an_unknown_job_are_dropped_and_counted(tmp_path) -> None:
    """h3 (on leaf1) and h6 (on leaf2) hold no rank; h3 writes to leaf1's aggregator."""
    injector: list[AgentProcess] = []
    forged, unknown = 6, 4

    def inject(plan: Plan) -> None:
        (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
        to = f"{_address(plan, 'leaf1', 'h1')}:11000"     # where the members send
        # spread over 0.2 s: all of it lands while the job runs (the run starts its
        # senders as soon as they are armed, so the whole job takes well under 1 s)
        injector.append(start_process(plan.lab, plan.node("h3").netns, [
            sys.executable, "-m", "tests.integration.ina_inject",
            "--wait-file", str(run_dir / "agents" / "ina-agg-leaf1.ready"), "--to", to,
            "--job", "1", "--unknown-job", "99", "--sender", "0", "--count", str(forged),
            "--unknown-count", str(unknown), "--spread-s", "0.2"], "ina-inject"))

    try:
        # the tree as given in config, its root on the spine the topology would not pick
        plan, result = _run(tmp_path, 3, {"ina": "h1, h2, h4, h5"}, on_up=inject, extra=(
            ", ina: {root: spine2, leaves: {leaf2: [h4, h5], leaf1: [h1, h2]}}"))
        (sent,) = [p.result(timeout_s=30) for p in injector]
    finally:
        for p in injector:
            p.stop()
    assert sent == {"sent": forged + unknown, "live_job": forged, "unknown_job": unknown}
    summary = result.summary
    (row,) = summary["workloads"][0]["results"]
    assert row["error"] is None and row["wrong"] == 0, row
    leaf1 = _agents(result, "ina-agg-leaf1")["ina-agg-leaf1"]
    assert leaf1["jobs"]["1"]["drops"]["not_member"] == forged
    assert leaf1["drops"]["unknown_job"] == unknown
    assert {k for k, v in leaf1["drops"].items() if v} == {"not_member", "unknown_job"}
    assert leaf1["received_from_others"] == forged + unknown
    assert all(p["discarded"] == 0 for p in leaf1["peers"].values())
    notes = [n for n in summary["fidelity"] if n.startswith("aggregator ina-agg-leaf1")]
    assert notes == [f"aggregator ina-agg-leaf1 on leaf1 dropped {forged} not_member, "
                     f"{unknown} unknown_job; {forged + unknown} datagrams came from "
                     "addresses that are not its job's members, children or parent"]
    others = [n for n in summary["fidelity"] if "aggregator" in n and n not in notes]
    assert not others, others
    # the members' streams still balance: a stranger's datagrams are in none of them
    check, streams = _conservation(summary)
    assert check["held"] is True, summary["invariants"]["violations"]
    up = next(s for s in streams if s["name"] == "ina r0->agg@leaf1")
    assert up["sent"] == up["received"] and up["discarded"] == 0
    assert {s["name"] for s in streams if "agg@spine" in s["name"]} == {
        "ina agg@leaf1->agg@spine2", "ina agg@spine2->agg@leaf1", "ina agg@leaf2->agg@spine2",
        "ina agg@spine2->agg@leaf2"}
    root = _agents(result, "ina-agg-spine2")["ina-agg-spine2"]
    assert root["jobs"]["1"]["partials_received"] >= root["jobs"]["1"]["completed"] * 2 > 0
    print(f"\nnon-member: {forged} forged REQUESTs of job 1 and {unknown} of job 99 from h3: "
          f"leaf1 dropped {leaf1['jobs']['1']['drops']['not_member']} not_member, "
          f"{leaf1['drops']['unknown_job']} unknown_job; result wrong {row['wrong']}, "
          f"time {row['time_us']} us fabric")
