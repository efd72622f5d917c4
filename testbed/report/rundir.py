"""Read a run directory: summary, plan, metadata and the counters database.

Every file is optional except that a run directory must hold a summary or a
counters database. A run killed before it wrote `summary.json` (SIGKILL, a
power cut) still has `counters.sqlite`, which is written sample by sample;
the summary is then rebuilt from it (and the plan) and marked incomplete.
Every reader checks `format_version` and refuses a newer one.
"""

from __future__ import annotations

import json
import re
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from testbed.plan import PLAN_FORMAT_VERSION, Plan
from testbed.results import files as results_files
from testbed.results.files import RUN_FORMAT_VERSION  # summary.json and metadata.json
from testbed.results.store import STORE_FORMAT_VERSION, Store, StoreVersionError
from testbed.results.tables import link_rows, link_totals, port_rows, totals, workload_rows

SUMMARY, PLAN, METADATA, COUNTERS = "summary.json", "plan.json", "metadata.json", "counters.sqlite"
_RUN_DIR_NAME_RE = re.compile(r"^(?P<ts>\d{8}T\d{6}Z)-(?P<name>.+)$")


class RunDirError(results_files.RunDirError):
    """The directory is not a run directory, or one of its files cannot be read."""


class RunFormatError(RunDirError):
    """A file of the run directory was written by a newer testbed."""


def _newer(path: Path, version: int, known: int) -> RunFormatError:
    return RunFormatError(f"{path}: run dir written by a newer testbed (format {version}); "
                          f"upgrade to read it (this testbed reads format {known})")


def _check_version(path: Path, data: dict, known: int) -> None:
    try:
        version = int(data.get("format_version", 0))
    except (TypeError, ValueError):
        raise RunDirError(f"{path}: format_version {data.get('format_version')!r} "
                          "is not a number") from None
    if version > known:
        raise _newer(path, version, known)


def _read_json(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RunDirError(f"{path}: cannot read: {exc}") from None
    if not isinstance(data, dict):
        raise RunDirError(f"{path}: expected a JSON object")
    return data


def _open_store(path: Path) -> Store | None:
    if not path.exists():
        return None
    try:
        return Store(path)
    except StoreVersionError:
        try:
            with sqlite3.connect(path) as db:
                row = db.execute("SELECT value FROM meta WHERE key = 'format_version'").fetchone()
            version = int(row[0])
        except (sqlite3.Error, TypeError, ValueError):
            version = STORE_FORMAT_VERSION + 1
        raise _newer(path, version, STORE_FORMAT_VERSION) from None
    except sqlite3.Error as exc:
        raise RunDirError(f"{path}: not a readable counters database: {exc}") from None


@dataclass
class RunData:
    """Everything a report is made from. `store` is None when counters.sqlite is absent."""

    run_dir: Path
    summary: dict
    metadata: dict
    plan: Plan | None
    store: Store | None
    rebuilt: bool                  # summary.json was missing; summary rebuilt from counters
    notes: list[str] = field(default_factory=list)   # files that were missing, and so on

    def close(self) -> None:
        if self.store is not None:
            self.store.close()

    def __enter__(self) -> RunData:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def dilation(self) -> int:
        return int(self.summary.get("dilation") or 1)


def load_run(run_dir: Path) -> RunData:
    """Open a run directory; raises RunDirError (RunFormatError for a newer format)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunDirError(f"{run_dir}: not a directory")
    if not (run_dir / SUMMARY).exists() and not (run_dir / COUNTERS).exists():
        raise RunDirError(f"{run_dir}: not a run directory (no {SUMMARY} and no {COUNTERS})")
    notes: list[str] = []
    summary = _read_json(run_dir / SUMMARY)
    if summary is not None:
        _check_version(run_dir / SUMMARY, summary, RUN_FORMAT_VERSION)
    metadata = _read_json(run_dir / METADATA)
    if metadata is None:
        notes.append(f"{METADATA} is missing: kernel and versions unknown")
        metadata = {}
    else:
        _check_version(run_dir / METADATA, metadata, RUN_FORMAT_VERSION)
    plan = _load_plan(run_dir / PLAN, notes)
    store = _open_store(run_dir / COUNTERS)
    try:
        if store is None:
            notes.append(f"{COUNTERS} is missing: no time series")
        rebuilt = summary is None
        if summary is None:
            summary = rebuild_summary(run_dir, plan, store, metadata)
    except BaseException:
        if store is not None:
            store.close()
        raise
    _check_ports(summary, notes)
    return RunData(run_dir, summary, metadata, plan, store, rebuilt, notes)


def _check_ports(summary: dict, notes: list[str]) -> None:
    """Keep the port entries a report can place (node, port and tclass present)."""
    ports = summary.get("ports")
    if not isinstance(ports, list):
        summary["ports"] = []
        return
    good = [p for p in ports if isinstance(p, dict) and {"node", "port", "tclass"} <= p.keys()]
    if len(good) != len(ports):
        notes.append(f"{SUMMARY}: {len(ports) - len(good)} port entries without node, port "
                     "and tclass were left out")
    summary["ports"] = good


def _load_plan(path: Path, notes: list[str]) -> Plan | None:
    data = _read_json(path)
    if data is None:
        notes.append(f"{PLAN} is missing: no fabric drawing")
        return None
    _check_version(path, data, PLAN_FORMAT_VERSION)
    try:
        return Plan.model_validate(data)
    except ValidationError as exc:
        raise RunDirError(f"{path}: not a valid plan: {exc.error_count()} problem(s), first: "
                          f"{exc.errors()[0]['msg']}") from None


def metadata_dilation(metadata: dict) -> int | None:
    """`dilation` in metadata.json: a factor, or an object with `factor`."""
    value = metadata.get("dilation")
    if isinstance(value, dict):
        value = value.get("factor")
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def run_name_and_time(run_dir: Path) -> tuple[str, str | None]:
    """('default', '20261129T120501Z') from runs/20261129T120501Z-default."""
    m = _RUN_DIR_NAME_RE.match(run_dir.name)
    if m:
        return m.group("name"), m.group("ts")
    return run_dir.name, None


def rebuild_summary(run_dir: Path, plan: Plan | None, store: Store | None,
                    metadata: dict) -> dict:
    """A summary.json built from the counters database, for a run that did not write one.

    Ports are built as a finished run builds them (testbed/run/summary.port_rows):
    every egress port and class of the plan, zero where nothing was sampled. A run
    that did not write its summary did not finish, so it counts as interrupted.
    """
    meta = store.meta() if store is not None else {}
    name, _ = run_name_and_time(run_dir)
    dilation = (_int(meta.get("dilation")) or metadata_dilation(metadata)
                or (plan.dilation.factor if plan else None) or 1)
    lab = meta.get("lab") or (plan.lab if plan else "") or name

    def last(counter: str) -> dict[tuple[str, str, int], float]:
        return store.last_values(counter) if store is not None else {}

    ports = port_rows(plan, store) if store is not None else []

    workloads = workload_rows(store.results()) if store is not None else []
    rows = [r for w in workloads for r in w["results"]]
    if any("rx_bytes" in r for r in rows):
        delivered = sum(int(r.get("rx_bytes") or 0) for r in rows)
    else:
        delivered = int(sum(v for k, v in last("recv.bytes").items()))

    duration_fabric_ns, duration_wall_s = 0, 0.0
    fidelity: list[str] = []
    if store is not None:
        span = store.sample_span()       # every sample taken, changed or not
        if span is not None:
            _lo_fabric, hi_fabric, lo_wall, hi_wall = span
            duration_fabric_ns = max(0, int(hi_fabric))
            duration_wall_s = (hi_wall - lo_wall) / 1e9
        fidelity = [str(e.get("message", e)) for e in store.events("fidelity")]
    links = link_rows(plan, ports)
    return {
        "format_version": RUN_FORMAT_VERSION,
        "name": name,
        "lab": lab,
        "run_dir": str(run_dir),
        "dilation": dilation,
        "duration_fabric_ns": duration_fabric_ns,
        "duration_wall_s": round(duration_wall_s, 3),
        "interrupted": True,
        "ports": ports,
        "workloads": workloads,
        "links": links,
        "totals": {**totals(ports, delivered), **link_totals(links)},
        "fidelity": fidelity,
        "verdict": None,
        "rebuilt_from_counters": True,
    }


def _int(value: str | None) -> int | None:
    """A counters-database meta value as a whole number; None if absent or not a number."""
    try:
        return int(float(value)) if value not in (None, "") else None
    except (TypeError, ValueError):
        return None

