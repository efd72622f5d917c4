"""The pieces of a run over several VMs that need no root: `--vm NAME` against VM mode on
the command line, one store imported into another on a moved time axis, the checks that
part run directories are of one run, and the merged invariants' verdicts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from testbed.cli import build_parser
from testbed.results.store import Sample, Store
from testbed.run.invariants import INVARIANTS, merge_part_invariants
from testbed.run.merge import MergeError, check_parts, expected_vms, read_part


def _args(argv: list[str]):
    parser = build_parser()
    args = parser.parse_args(argv)
    args._normalize(parser, args)
    return args


def test_vm_alone_is_still_vm_mode_with_the_file_after_it() -> None:
    args = _args(["up", "--vm", "configs/default.yaml"])
    assert args.vm is True and args.file == "configs/default.yaml"
    args = _args(["run", "--vm"])
    assert args.vm is True and args.file == "configs/default.yaml"


def test_vm_name_goes_with_vms() -> None:
    args = _args(["up", "f.yaml", "--vms", "v.yaml", "--vm", "vm1"])
    assert (args.file, args.vms, args.vm) == ("f.yaml", "v.yaml", "vm1")


@pytest.mark.parametrize("argv", [
    ["up", "f.yaml", "--vm", "vm1"],                        # a name without --vms
    ["up", "f.yaml", "--vms", "v.yaml"],                    # --vms without a name
    ["run", "f.yaml", "--vms", "v.yaml", "--vm"],           # ... or with VM mode
    ["up", "f.yaml", "--underlay-netns", "ns"],             # an underlay without --vms
])
def test_vm_and_vms_that_do_not_fit_are_usage_errors(argv, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        _args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--vm" in err or "--underlay-netns" in err, err


def _store(path: Path, node: str, ticks: list[tuple[int, float]]) -> Path:
    with Store(path, create=True) as s:
        for ts, value in ticks:
            s.add_samples(ts, ts + 7, [Sample(node, "swp1", 3, "backlog_bytes", value)])
        s.add_event(ticks[0][0], 5, "phase", phase="workload")
    return path


def test_a_store_imported_into_another_keeps_every_point_on_the_moved_axis(tmp_path) -> None:
    a = _store(tmp_path / "a.sqlite", "leaf1", [(0, 1.0), (100, 2.0), (200, 3.0)])
    b = _store(tmp_path / "b.sqlite", "leaf2", [(0, 10.0), (100, 20.0)])
    with Store(tmp_path / "m.sqlite", create=True) as m:
        assert m.import_store(a, 0, 0) > 0
        m.import_store(b, -30, 1000)              # b's clock ran 30 ns (fabric) ahead
    with Store(tmp_path / "m.sqlite") as m:
        assert m.series("backlog_bytes", "leaf1") and m.series("backlog_bytes", "leaf2")
        assert [t for t, _v in m.series("backlog_bytes", "leaf2")[("leaf2", "swp1", 3)]][:2] \
            == [-30, 70]
        assert sorted(m.sample_times()) == [-30, 0, 70, 100, 200]
        assert len(m.events("phase")) == 2
        assert m.last_values("backlog_bytes") == {("leaf1", "swp1", 3): 3.0,
                                                  ("leaf2", "swp1", 3): 20.0}


def test_a_port_in_two_stores_is_refused(tmp_path) -> None:
    a = _store(tmp_path / "a.sqlite", "leaf1", [(0, 1.0)])
    b = _store(tmp_path / "b.sqlite", "leaf1", [(0, 2.0)])
    with Store(tmp_path / "m.sqlite", create=True) as m:
        m.import_store(a, 0, 0)
        with pytest.raises(ValueError, match="both stores"):
            m.import_store(b, 0, 0)


def _part(root: Path, vm: str, nodes: list[str], *, start: int = 1, plan: str = "{}",
          remote: str = "vm2") -> Path:
    d = root / vm
    d.mkdir(parents=True)
    (d / "config.yaml").write_text("name: x\n")
    (d / "plan.json").write_text(plan)
    (d / "part.json").write_text(json.dumps({
        "vm": vm, "nodes": nodes, "start_at_unix_ns": start,
        "tunnels": [{"link": 9, "remote": {"vm": remote}}]}))
    return d


def test_parts_of_one_run_pass_and_name_the_vms_they_expect(tmp_path) -> None:
    parts = [read_part(_part(tmp_path, "vm1", ["leaf1"]))]
    check_parts(parts)
    assert expected_vms(parts) == ["vm1", "vm2"]       # vm1's tunnel goes to vm2


@pytest.mark.parametrize("second, message", [
    ({"vm": "vm1", "nodes": ["leaf2"]}, "both VM vm1's part"),
    ({"vm": "vm2", "nodes": ["leaf1"]}, "node leaf1 is in VM vm1's part and VM vm2's"),
    ({"vm": "vm2", "nodes": ["leaf2"], "start": 2}, "not parts of the same run"),
    ({"vm": "vm2", "nodes": ["leaf2"], "plan": '{"other": 1}'}, "plan.json differs"),
])
def test_parts_that_are_not_of_one_run_are_refused(tmp_path, second, message) -> None:
    a = read_part(_part(tmp_path / "a", "vm1", ["leaf1"]))
    b = read_part(_part(tmp_path / "b", second.pop("vm"), second.pop("nodes"), **second))
    with pytest.raises(MergeError, match=message):
        check_parts([a, b])


def test_a_directory_that_is_not_a_part_is_named(tmp_path) -> None:
    with pytest.raises(MergeError, match="not a part run directory"):
        read_part(tmp_path)


def _inv(**held) -> dict:
    return {"checks": {name: {"held": held.get(name, True)} for name in INVARIANTS},
            "violations": [{"invariant": n, "where": "leaf2:swp4 TC3"} for n, h in
                           held.items() if h is False]}


def test_merged_invariants_hold_only_where_every_vm_and_every_stream_held() -> None:
    stream = {"name": "incast-h1-h8", "dst": "h8", "sent": 10, "received": 10,
              "fabric_drops": 0, "reordered": 0}
    out = merge_part_invariants({"vm1": _inv(), "vm2": _inv()}, [stream], {}, {})
    assert all(c["held"] is True for c in out["checks"].values())
    out = merge_part_invariants({"vm1": _inv(), "vm2": _inv(queue=False)}, [stream], {}, {})
    assert out["checks"]["queue"]["held"] is False
    assert out["violations"] == [{"invariant": "queue", "where": "leaf2:swp4 TC3",
                                  "vm": "vm2"}]
    # a VM that left no invariants: nothing can be said to hold
    out = merge_part_invariants({"vm1": _inv(), "vm2": None}, [stream], {}, {})
    assert out["checks"]["headroom"]["held"] is None
    # a stream that lost packets with no counted place breaks conservation, found here
    lost = dict(stream, received=7)
    out = merge_part_invariants({"vm1": _inv(), "vm2": _inv()}, [lost], {}, {})
    assert out["checks"]["conservation"]["held"] is False and out["notes"]


def test_a_machine_dependent_plan_is_refused_over_vms(tmp_path, capsys) -> None:
    """`dilation: auto` without `max_wall_port_rate:` would let each VM's calibration pick
    its own D: refused before anything is built, naming both fixes (`run --vms` goes
    through the same check, after its root check)."""
    from testbed.cli import main

    (tmp_path / "vms.yaml").write_text(
        "vms:\n  - {name: vm1, underlay: 192.0.2.11, cores: 2, wall_rate_budget: 2Gbps}\n"
        "  - {name: vm2, underlay: 192.0.2.12, cores: 2, wall_rate_budget: 2Gbps}\n")
    fabric = tmp_path / "f.yaml"
    fabric.write_text((Path(__file__).parents[2] / "configs" / "default.yaml").read_text())
    code = main(["up", str(fabric), "--vms", str(tmp_path / "vms.yaml"), "--vm", "vm1"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "dilation: auto" in err and "max_wall_port_rate" in err and "fixed" in err
