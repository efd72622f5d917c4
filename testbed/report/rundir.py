"""Read a run directory: summary, plan, metadata and the counters database.

Every file is optional except that a run directory must hold a summary or a
counters database. A run killed before it wrote `summary.json` (SIGKILL, a
power cut) still has `counters.sqlite`, which is written sample by sample;
the summary is then rebuilt from it (and the plan) and marked incomplete.
Every reader checks `format_version` and refuses a newer one.
"""

from __future__ import annotations

import json
import math
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
    except ValueError:
        raise RunDirError(f"{path}: meta format_version is not a number") from None


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
        # load_run leaves a checked factor >= 1 in the summary (check_summary)
        return int(self.summary["dilation"])


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
        else:
            check_store(store)
        rebuilt = summary is None
        if summary is None:
            summary = rebuild_summary(run_dir, plan, store, metadata)
        check_summary(run_dir / SUMMARY, summary, metadata, plan, store, notes)
    except BaseException:
        if store is not None:
            store.close()
        raise
    return RunData(run_dir, summary, metadata, plan, store, rebuilt, notes)


# --- consistency checks (docs/report.md, "Damaged run directories") ---------------------
#
# The rule: a file the report is built from that cannot be read as what it should be
# (not JSON / not SQLite, a table missing, a row that is not JSON, a value of the wrong
# type in the database) is refused: RunDirError naming the file, table and row, exit 2.
# A summary.json field that is missing, of the wrong type, not finite or negative is
# left out of the report (shown as "unknown", never as a made-up 0 or 1) and named
# in the report's notes; so is metadata that disagrees with the summary. Every output
# format reads through load_run, so one directory gives the same answer in each.

# table -> columns that must hold integers (or NULL where the schema allows it)
_INT_COLUMNS = {
    "events": ("ts_fabric_ns", "ts_wall_ns", "tclass"),
    "series": ("id", "tclass"),
    "sample_times": ("ts_fabric_ns", "ts_wall_ns"),
    "points": ("series_id", "ts_fabric_ns"),
    "flows": ("flow_id", "sport", "dport", "size_bytes", "start_ns", "fct_ns",
              "ideal_fct_ns", "tc"),
}
_TEXT_COLUMNS = {"events": ("node", "port", "kind"), "series": ("node", "port", "counter"),
                 "results": ("workload", "kind"), "flows": ("workload", "src", "dst")}
_JSON_COLUMNS = {"events": "detail", "results": "row", "flows": "extra"}


def check_store(store: Store) -> None:
    """Refuse a counters database a report cannot be built from (RunDirError)."""
    path = store.path
    try:
        with store.lock:
            db = store.db
            tables = {r[0] for r in db.execute(
                "SELECT name FROM sqlite_master WHERE type IN ('table', 'view')")}
            needed = ["meta", "events", "results"] + (
                ["samples"] if store.version < 2 else ["series", "sample_times", "points"])
            for table in needed:
                if table not in tables:
                    raise RunDirError(f"{path}: table {table} is missing; the database was "
                                      "damaged or written by another program")
            for table, columns in _INT_COLUMNS.items():
                if table not in tables:
                    continue
                for column in columns:
                    _check_column(db, path, table, column, "integer", ("integer", "null"))
            for table, columns in _TEXT_COLUMNS.items():
                for column in columns if table in tables else ():
                    _check_column(db, path, table, column, "text", ("text",))
            values = "points" if store.version >= 2 else "samples"
            _check_column(db, path, values, "value", "number", ("integer", "real", "null"))
            row = db.execute(f"SELECT * FROM {values} WHERE typeof(value) = 'real' "
                             "AND (value > 1e308 OR value < -1e308) LIMIT 1").fetchone()
            if row is not None:
                raise RunDirError(f"{path}: table {values} row {tuple(row)}: value is not a "
                                  "finite number")
            for table, column in _JSON_COLUMNS.items():
                if table not in tables:
                    continue
                # SQLite's own JSON check picks the suspects, so the report does not parse
                # every row twice; Python judges them (it also takes NaN, as the writers
                # may write it). n: the row's position in the table.
                rows = db.execute(
                    f"SELECT n, {column} FROM (SELECT row_number() OVER () AS n, {column} "
                    f"FROM {table}) WHERE CASE WHEN typeof({column}) != 'text' THEN 1 "
                    f"WHEN json_valid({column}) = 0 THEN 1 "
                    f"WHEN json_type({column}) != 'object' THEN 1 ELSE 0 END")
                for rowid, text in rows:
                    try:
                        value = json.loads(text) if isinstance(text, str) else None
                    except ValueError as exc:
                        raise RunDirError(f"{path}: table {table} row {rowid}: {column} is "
                                          f"not JSON ({exc})") from None
                    if not isinstance(value, dict):
                        raise RunDirError(f"{path}: table {table} row {rowid}: {column} is "
                                          "not a JSON object")
    except sqlite3.Error as exc:
        raise RunDirError(f"{path}: not a readable counters database: {exc}") from None


def _check_column(db: sqlite3.Connection, path: Path, table: str, column: str, what: str,
                  types: tuple[str, ...]) -> None:
    marks = ", ".join("?" * len(types))
    row = db.execute(f"SELECT {column}, * FROM {table} WHERE typeof({column}) NOT IN "
                     f"({marks}) LIMIT 1", types).fetchone()
    if row is not None:
        raise RunDirError(f"{path}: table {table} row {tuple(row[1:])}: {column} {row[0]!r} "
                          f"is not {'an' if what[0] in 'aeiou' else 'a'} {what}")


def _number(value: object) -> bool:
    """A finite, non-negative JSON number (bool is not one)."""
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value) and value >= 0)


def _factor(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if not math.isfinite(value) or value < 1 or value != int(value):
        return None
    return int(value)


_PORT_FIELDS = ("tx_bytes", "tx_packets", "drops", "ecn_marks", "trims", "max_queue_bytes",
                "pause_tx", "pause_rx", "paused_ns")
_LIST_FIELDS = ("ports", "workloads", "links", "fidelity")


def check_summary(path: Path, summary: dict, metadata: dict, plan: Plan | None,
                  store: Store | None, notes: list[str]) -> None:
    """Leave in `summary` only what a report may print, naming in `notes` what was not.

    Durations that are missing or bad become None ("unknown" in the report); the
    dilation factor is taken from the first of summary, counters meta, metadata and
    plan that holds one, with a note when they disagree; no factor at all is refused.
    """
    name = path.name
    for key in _LIST_FIELDS:
        value = summary.get(key)
        if key not in summary:
            if key == "ports":
                notes.append(f"{name}: ports is missing: no port, queue, ECN, trim or PFC "
                             "figures")
            summary[key] = []
        elif not isinstance(value, list):
            notes.append(f"{name}: {key} is {type(value).__name__}, not a list: left out")
            summary[key] = []
    for key in ("totals", "collector", "verdict"):
        value = summary.get(key)
        if value is not None and not isinstance(value, dict):
            notes.append(f"{name}: {key} is {type(value).__name__}, not an object: left out")
            summary[key] = {} if key != "verdict" else None
    totals_ = summary.get("totals") or {}
    for key, value in list(totals_.items()):
        if not _number(value):
            notes.append(f"{name}: totals.{key} {value!r} is not a number >= 0: left out")
            del totals_[key]
    summary["totals"] = totals_
    _check_summary_ports(name, summary, notes)
    _check_summary_workloads(name, summary, notes)
    summary["fidelity"] = [str(n) for n in summary["fidelity"]]
    for key in ("duration_fabric_ns", "duration_wall_s"):
        value = summary.get(key)
        if key not in summary:
            notes.append(f"{name}: {key} is missing: duration unknown")
            summary[key] = None
        elif not _number(value):
            notes.append(f"{name}: {key} {value!r} is not a number >= 0: duration unknown")
            summary[key] = None
    _check_dilation(name, summary, metadata, plan, store, notes)


def _check_summary_ports(name: str, summary: dict, notes: list[str]) -> None:
    """Keep the port entries a report can place (node, port and tclass present, counts
    numbers >= 0)."""
    ports = summary["ports"]
    good, unplaced = [], 0
    for p in ports:
        if not (isinstance(p, dict) and {"node", "port", "tclass"} <= p.keys()):
            unplaced += 1
            continue
        bad = [f for f in _PORT_FIELDS if f in p and p[f] is not None and not _number(p[f])]
        if bad:
            notes.append(f"{name}: port {p['node']}:{p['port']} class {p['tclass']}: "
                         + ", ".join(f"{f} {p[f]!r}" for f in bad)
                         + " not a number >= 0: port left out")
            continue
        good.append(p)
    if unplaced:
        notes.append(f"{name}: {unplaced} port entries without node, port and tclass were "
                     "left out")
    summary["ports"] = good


def _check_summary_workloads(name: str, summary: dict, notes: list[str]) -> None:
    good = []
    for w in summary["workloads"]:
        if not isinstance(w, dict):
            notes.append(f"{name}: a workload entry is {type(w).__name__}, not an object: "
                         "left out")
            continue
        rows = w.get("results", [])
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            notes.append(f"{name}: workload {w.get('name', '?')}: results is not a list of "
                         "objects: its rows were left out")
            w = {**w, "results": []}
        good.append(w)
    summary["workloads"] = good
    summary["links"] = [link for link in summary["links"] if isinstance(link, dict)]


def _check_dilation(name: str, summary: dict, metadata: dict, plan: Plan | None,
                    store: Store | None, notes: list[str]) -> None:
    meta_store = _int(store.meta().get("dilation")) if store is not None else None
    sources = [(name, summary.get("dilation")), (COUNTERS, meta_store),
               (METADATA, metadata_dilation(metadata)),
               (PLAN, plan.dilation.factor if plan is not None else None)]
    factors = [(src, _factor(v)) for src, v in sources]
    found = [(src, f) for src, f in factors if f is not None]
    if "dilation" in summary and factors[0][1] is None:
        notes.append(f"{name}: dilation {summary['dilation']!r} is not a factor >= 1"
                     + (f"; {found[0][0]}'s {found[0][1]} was used" if found else ""))
    if not found:
        raise RunDirError(f"{name}: no dilation factor >= 1 in {SUMMARY}, {COUNTERS}, "
                          f"{METADATA} or {PLAN}: the report cannot convert wall to fabric "
                          "time")
    src, factor = found[0]
    others = sorted({f"{s} says {f}" for s, f in found[1:] if f != factor})
    if others:
        notes.append(f"inconsistent dilation: {src} says {factor}, " + ", ".join(others)
                     + f"; the report uses {factor}")
    summary["dilation"] = factor


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
    return _factor(value)


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

