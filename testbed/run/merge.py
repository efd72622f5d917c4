"""One run directory from the part run directories of a run spread over several VMs.

Each VM ran its part of one run (`testbed run FILE --vms V --vm NAME --start-at-unix-ns
T`, runner.py): its nodes' counters, its agents' raw results, its ports' invariants, all
timed from the common start T as its own clock read it. `merge_parts` puts them together
as if one machine had run the whole fabric:

- counters.sqlite: every VM's series, sample times and events, each VM's fabric time
  moved by its clock offset to the reference VM (clocksync.py measured it before the
  start; a VM whose offset was not measured counts as 0 and the fidelity notes say so).
  Wall times become CLOCK_REALTIME ns of the reference VM's clock.
- agents/: every VM's agent files; result rows, flow records, result files and each
  kind's fidelity notes are made here from every VM's raw results, since a stream's two
  ends may be on two VMs.
- the invariants: each VM's own (its ports), and reordering and conservation per stream,
  judged here over both ends (invariants.merge_part_invariants).
- summary.json and the report cover the whole fabric; `parts` says which VM ran which
  nodes, its clock offset and its run directory. A VM with no part run directory (it
  died, or it was not fetched) is named in the fidelity notes with the nodes whose data
  is missing; the others' data is kept.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from testbed.config import load_config_text
from testbed.plan.model import Plan
from testbed.report import build_report
from testbed.results.files import write_json, write_private
from testbed.results.flows import write_flow_files
from testbed.results.store import Store
from testbed.results.tables import DROP_COUNTERS
from testbed.run.invariants import merge_part_invariants
from testbed.run.rundir import create_run_dir
from testbed.run.summary import build_summary
from testbed.run.workload import by_kind, expand_workload, run_view, stream_accounts
from testbed.workloads.base import FlowRecord

MERGE_FORMAT_VERSION = 1


class MergeError(RuntimeError):
    """The part run directories cannot be merged; the message names the directory and why."""


@dataclass
class Part:
    """One VM's part run directory, as read."""
    path: Path
    vm: str
    nodes: list[str]
    meta: dict                    # part.json
    summary: dict | None          # None: the part run died before writing it
    results: dict[str, dict]      # agent name -> its raw result
    host_udp_errors: dict[str, int]
    snapshot: dict | None         # datapath.json

    @property
    def offset_ns(self) -> int:
        """This VM's clock minus the reference's (0 when not measured)."""
        clock = self.meta.get("clock") or {}
        return int(clock.get("offset_ns") or 0)


def _json(path: Path, what: str, required: bool = True) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        if required:
            raise MergeError(f"{path.parent}: no {path.name}: not a part run directory "
                             f"({what})") from None
        return None
    except (OSError, json.JSONDecodeError) as exc:
        raise MergeError(f"{path}: unreadable ({exc})") from None
    if not isinstance(data, dict):
        raise MergeError(f"{path}: {what} is not a JSON object")
    return data


def read_part(path: Path) -> Part:
    meta = _json(path / "part.json", "written by `testbed run --vms --vm`")
    assert meta is not None
    if not isinstance(meta.get("vm"), str) or not isinstance(meta.get("nodes"), list):
        raise MergeError(f"{path / 'part.json'}: needs `vm` and `nodes`")
    return Part(path=path, vm=meta["vm"], nodes=[str(n) for n in meta["nodes"]], meta=meta,
                summary=_json(path / "summary.json", "", required=False),
                results=_json(path / "agents" / "results.json", "", required=False) or {},
                host_udp_errors={k: int(v) for k, v in (_json(
                    path / "agents" / "host_udp_errors.json", "", required=False) or {}).items()},
                snapshot=_json(path / "datapath.json", "", required=False))


def _digest(path: Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as exc:
        raise MergeError(f"{path}: {exc}") from None


def check_parts(parts: list[Part]) -> None:
    """The same run: one config, one plan, one start, each VM once, no node twice."""
    if not parts:
        raise MergeError("no part run directories given")
    first = parts[0]
    for p in parts[1:]:
        for name in ("config.yaml", "plan.json"):
            if _digest(p.path / name) != _digest(first.path / name):
                raise MergeError(f"{p.path}: its {name} differs from {first.path}'s: not "
                                 "parts of the same run")
        if p.meta.get("start_at_unix_ns") != first.meta.get("start_at_unix_ns"):
            raise MergeError(f"{p.path}: started at {p.meta.get('start_at_unix_ns')}, "
                             f"{first.path} at {first.meta.get('start_at_unix_ns')}: not "
                             "parts of the same run")
    seen: dict[str, Path] = {}
    owner: dict[str, str] = {}
    for p in parts:
        if p.vm in seen:
            raise MergeError(f"{p.path} and {seen[p.vm]} are both VM {p.vm}'s part")
        seen[p.vm] = p.path
        for node in p.nodes:
            if node in owner:
                raise MergeError(f"node {node} is in VM {owner[node]}'s part and VM {p.vm}'s")
            owner[node] = p.vm


def expected_vms(parts: list[Part]) -> list[str]:
    """Every VM the parts name: their own and the far ends of their tunnels."""
    names = {p.vm for p in parts}
    for p in parts:
        names.update(t["remote"]["vm"] for t in p.meta.get("tunnels", []))
    return sorted(names)


@dataclass
class Merged:
    run_dir: Path
    summary: dict


def merge_parts(paths: list[Path], runs_root: Path, report: bool = True) -> Merged:
    """The run directory of the whole fabric from its VMs' part run directories."""
    parts = [read_part(Path(p)) for p in paths]
    check_parts(parts)
    first = parts[0]
    text = (first.path / "config.yaml").read_text()
    loaded = load_config_text(text, str(first.path / "config.yaml"))
    plan = Plan.model_validate_json((first.path / "plan.json").read_text())
    # the VM every other VM's clock was measured against (the first of the VMs file)
    named = first.meta.get("reference")
    reference = next((p for p in parts if p.vm == named), parts[0])
    notes: list[str] = []
    missing = [vm for vm in expected_vms(parts) if vm not in {p.vm for p in parts}]
    placed = {n for p in parts for n in p.nodes}
    absent_nodes = [n.name for n in plan.nodes if n.name not in placed]
    if missing or absent_nodes:
        notes.append(f"VM(s) {', '.join(missing) or '?'} left no part run directory (died "
                     f"during the run, or its directory was not fetched): the counters and "
                     f"agents of {', '.join(absent_nodes)} are missing; the other VMs' data "
                     "is kept, and streams with an end there have no result")

    run_dir = create_run_dir(runs_root, loaded.fabric.name)
    (run_dir / "agents").mkdir(mode=0o700)
    write_private(run_dir / "config.yaml", text)
    write_private(run_dir / "plan.json", (first.path / "plan.json").read_text())
    dilation = plan.timebase
    part_rows = []
    store = Store(run_dir / "counters.sqlite", create=True)
    try:
        for key, value in _store_meta(first.path).items():
            if key not in ("format_version", "part_vm"):
                store.set_meta(key, value)
        for p in parts:
            part_rows.append(_import_part(store, p, reference, dilation, run_dir, notes))
        results: dict[str, dict] = {}
        for p in parts:
            results.update(p.results)
        specs, view = _results(store, loaded, plan, parts, results, run_dir, notes)
        snapshot = _merged_snapshot(parts)
        if snapshot is not None:
            write_json(run_dir / "datapath.json", snapshot)
        streams = stream_accounts(specs, results, snapshot["flow_drops"] if snapshot else [],
                                  view)
        last = {name: store.last_values(name) for name in
                ("class_drops", "class_packets", "backlog_packets", "tx_dropped",
                 "wire_drops", "wire_backlog_packets")}
        host_errors: dict[str, int] = {}
        for p in parts:
            host_errors.update(p.host_udp_errors)
        invariants = merge_part_invariants(
            {p.vm: (p.summary or {}).get("invariants") for p in parts}, streams, host_errors,
            last)
        notes += invariants.pop("notes")
        invariants["streams"] = streams
        metadata = _json(first.path / "metadata.json", "", required=False) or {}
        metadata["merged"] = {"format_version": MERGE_FORMAT_VERSION, "reference": reference.vm,
                              "parts": part_rows}
        write_json(run_dir / "metadata.json", metadata)
        durations = [(p.summary or {}).get("duration_fabric_ns", 0) for p in parts]
        walls = [(p.summary or {}).get("duration_wall_s", 0.0) for p in parts]
        # the ports of a VM that left nothing are not shown as idle ones
        shown = plan if not absent_nodes else plan.model_copy(
            update={"nodes": [n for n in plan.nodes if n.name in placed]})
        summary = build_summary(
            name=loaded.fabric.name, plan=shown, store=store, run_dir=str(run_dir),
            duration_fabric_ns=max(durations, default=0),
            duration_wall_s=max(walls, default=0.0),
            interrupted=any((p.summary or {}).get("interrupted") for p in parts),
            fidelity=notes,
            extra={"results_complete": not missing and all(p.summary for p in parts),
                   "failed": "; ".join(f"{p.vm}: {p.summary['failed']}" for p in parts
                                       if p.summary and p.summary.get("failed")) or None,
                   "run_faults": [dict(f, vm=p.vm) for p in parts
                                  for f in (p.summary or {}).get("run_faults", [])],
                   "parts": [{k: v for k, v in r.items() if k != "metadata"}
                             for r in part_rows],
                   "missing_vms": missing,
                   "invariants": invariants})
        write_json(run_dir / "summary.json", summary)
    finally:
        try:
            store.close()
        except sqlite3.Error:
            pass
    if report:
        build_report(run_dir)
    return Merged(run_dir, summary)


def _results(store: Store, loaded, plan: Plan, parts: list[Part], results: dict,
             run_dir: Path, notes: list[str]):
    """Result rows, flow records, result files and each kind's notes, from every VM's raw
    results, as runner.write_results makes them for a run on one machine."""
    present = {n for p in parts for n in p.nodes}
    specs = [s for s in expand_workload(loaded.fabric, plan) if s.node in present]
    paused = frozenset(n for (n, _p, _t), v in store.last_values("pause_rx").items() if v)
    lossless = {t.tc for t in plan.traffic_classes if t.lossless}
    drops = sum(v for counter in DROP_COUNTERS
                for (_n, _p, tc), v in store.last_values(counter).items() if tc in lossless)
    view = run_view(plan, run_dir / "agents", int(parts[0].meta["start_at_unix_ns"]), paused,
                    int(drops))
    flows: list[FlowRecord] = []
    for kind, group in by_kind(specs).items():
        rows = kind.result_rows(group, results, view)
        for row in rows:
            store.add_result(row.traffic, row.kind, row.fields)
        for name, body in kind.output_files(rows, group, results, view).items():
            out = run_dir / "results" / name
            out.parent.mkdir(mode=0o700, exist_ok=True)
            write_private(out, body)
        flows += kind.flow_records(group, results, view)
        notes += kind.fidelity_notes(group, results, view)
    if flows:
        store.add_flows(flows)
        write_flow_files(run_dir, flows)
    return specs, view


def _import_part(store: Store, p: Part, reference: Part, dilation, run_dir: Path,
                 notes: list[str]) -> dict:
    """One VM's counters (on the reference's time axis), agent files and notes; its row of
    summary.json `parts`."""
    offset = p.offset_ns - (reference.offset_ns if p is not reference else 0)
    shift_fabric = -round(dilation.to_fabric_ns(offset)) if offset else 0
    t0_mono = ((p.summary or {}).get("part") or {}).get("t0_mono_ns")
    start = int(p.meta["start_at_unix_ns"])
    # a VM's wall times are its CLOCK_MONOTONIC: make them the reference's CLOCK_REALTIME
    shift_wall = (start - offset - int(t0_mono)) if t0_mono is not None else 0
    db = p.path / "counters.sqlite"
    points = store.import_store(db, shift_fabric, shift_wall) if db.exists() else 0
    if not db.exists():
        notes.append(f"VM {p.vm}'s part has no counters.sqlite: its ports were not sampled")
    if p.summary is None:
        notes.append(f"VM {p.vm}'s part run did not finish (no summary.json): its samples "
                     "and results are what it had written before it stopped")
    if not (p.meta.get("clock") or {}) and p is not reference:
        notes.append(f"VM {p.vm}'s clock offset to {reference.vm} was not measured: its "
                     "samples are taken as on the same clock")
    _copy_agents(p.path / "agents", run_dir / "agents")
    notes += [f"{p.vm}: {n}" for n in (p.summary or {}).get("fidelity", [])]
    return {"vm": p.vm, "nodes": p.nodes, "run_dir": str(p.path),
            "clock": p.meta.get("clock"), "shift_fabric_ns": shift_fabric, "points": points,
            "failed": (p.summary or {}).get("failed"),
            "interrupted": (p.summary or {}).get("interrupted"),
            "metadata": _json(p.path / "metadata.json", "", required=False)}


def _store_meta(run_dir: Path) -> dict[str, str]:
    db = run_dir / "counters.sqlite"
    if not db.exists():
        return {}
    with Store(db) as store:
        return store.meta()


def _copy_agents(src: Path, dst: Path) -> None:
    """A part's agent files (its results.json and host errors are read, not copied: the
    merged directory's raw results are every VM's)."""
    if not src.is_dir():
        return
    for f in src.iterdir():
        if f.is_file() and not f.is_symlink() and f.name not in ("results.json",
                                                                   "host_udp_errors.json"):
            shutil.copy2(f, dst / f.name)


def _merged_snapshot(parts: list[Part]) -> dict | None:
    """Every VM's datapath.json in one: its lists concatenated (their nodes differ)."""
    snaps = [p.snapshot for p in parts if p.snapshot is not None]
    if not snaps:
        return None
    out: dict = {}
    for snap in snaps:
        for key, value in snap.items():
            if isinstance(value, list):
                out.setdefault(key, []).extend(value)
            else:
                out.setdefault(key, value)
    return out
