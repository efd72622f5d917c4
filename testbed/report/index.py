"""The incident suite's index: one page over many runs, the verdict table at the top.

    write_index(out_dir, entries) -> IndexPaths   (index.html, index.md, index.json)

Each entry names an incident and the run directories of its variants (`control`,
`incident`); everything else (verdicts, predicate values, wall times) is read from those
runs' summary.json, so an index can be rebuilt from the run directories alone. The page
is static and self-contained: no scripts, no external resources; each run links to its
own report.html by a path relative to the index.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import jinja2

import testbed
from testbed.report.content import Table
from testbed.report.render import md_table
from testbed.results.files import write_atomic

VARIANTS = ("incident", "control")


@dataclass
class IndexEntry:
    incident: str
    title: str = ""
    runs: dict[str, str | None] = field(default_factory=dict)   # variant -> run directory
    error: str | None = None            # why the incident did not run (a bad file ...)


@dataclass(frozen=True)
class IndexPaths:
    html: Path
    md: Path
    json: Path


def _summary(run_dir: str | None) -> dict | None:
    if not run_dir:
        return None
    try:
        data = json.loads((Path(run_dir) / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _num(value: object) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "-" if value is None else str(value)
    return f"{value:,.4g}" if abs(value) < 1e6 else f"{value:,.0f}"


def _held(held: object) -> str:
    if held is None:
        return "no data"
    return "holds" if held else "does not hold"


def predicate_cells(verdict: dict | None) -> list[str]:
    """`name: value op threshold unit (holds)` for each predicate of one verdict."""
    if not verdict:
        return []
    out = []
    for p in verdict.get("predicates") or []:
        unit = f" {p.get('unit')}" if p.get("unit") else ""
        out.append(f"{p.get('name')}: {_num(p.get('value'))} {p.get('op')} "
                   f"{_num(p.get('threshold'))}{unit} ({_held(p.get('held'))})")
    return out


def _yes_no(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "no")


def index_rows(entries: list[IndexEntry], out_dir: Path) -> list[dict]:
    """One row per incident: what the table shows, plus the links."""
    rows = []
    for e in entries:
        summaries = {v: _summary(e.runs.get(v)) for v in VARIANTS}
        verdicts = {v: (s or {}).get("verdict") for v, s in summaries.items()}
        inc, ctl = verdicts["incident"], verdicts["control"]
        reproduced = inc.get("reproduced") if inc else None
        clean = (not ctl.get("reproduced") and ctl.get("as_expected", False)) if ctl else None
        wall = sum(float(s.get("duration_wall_s") or 0) for s in summaries.values() if s)
        links = {}
        for v in VARIANTS:
            run_dir = e.runs.get(v)
            if run_dir and (Path(run_dir) / "report.html").exists():
                links[v] = os.path.relpath(Path(run_dir) / "report.html", out_dir)
        ok = bool(inc and ctl and inc.get("as_expected") and ctl.get("as_expected"))
        notes = [e.error] if e.error else []
        notes += [f"{v}: {d['reason']}" for v, d in verdicts.items()
                  if d and d.get("reason") and not d.get("as_expected")]
        rows.append({
            "incident": e.incident, "title": e.title or (inc or ctl or {}).get("title", ""),
            "reproduced": _yes_no(reproduced), "control_clean": _yes_no(clean),
            "ok": ok, "incident_predicates": predicate_cells(inc),
            "control_predicates": predicate_cells(ctl), "wall_s": round(wall, 1),
            "links": links, "notes": notes})
    return rows


def _html(rows: list[dict], title: str) -> str:
    env = jinja2.Environment(loader=jinja2.PackageLoader("testbed.report", "templates"),
                             autoescape=True, undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True)
    return env.get_template("index.html.j2").render(rows=rows, title=title,
                                                    version=testbed.__version__)


def _md(rows: list[dict], title: str) -> str:
    table = Table(["incident", "reproduced", "control clean", "predicates (incident; control)",
                   "wall s", "reports"],
                  [[r["incident"], r["reproduced"], r["control_clean"],
                    "; ".join(r["incident_predicates"]) + (
                        " || control: " + "; ".join(r["control_predicates"])
                        if r["control_predicates"] else ""),
                    f"{r['wall_s']:.1f}",
                    " ".join(f"[{v}]({link})" for v, link in r["links"].items())]
                   for r in rows],
                  [False, False, False, False, True, False])
    passed = sum(r["ok"] for r in rows)
    lines = [f"# {title}", "", f"{passed} of {len(rows)} incidents reproduced with a clean "
             "control.", "", md_table(table), ""]
    for r in rows:
        for note in r["notes"]:
            lines.append(f"- {r['incident']}: {note}")
    return "\n".join(lines).rstrip("\n") + "\n"


def write_index(out_dir: Path, entries: list[IndexEntry],
                title: str = "Incident suite") -> IndexPaths:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = index_rows(entries, out_dir)
    paths = IndexPaths(out_dir / "index.html", out_dir / "index.md", out_dir / "index.json")
    write_atomic(paths.html, _html(rows, title))
    write_atomic(paths.md, _md(rows, title))
    write_atomic(paths.json, json.dumps(
        {"title": title, "incidents": [
            {"incident": e.incident, "runs": e.runs, "error": e.error} for e in entries]},
        indent=2, sort_keys=True) + "\n")
    return paths
