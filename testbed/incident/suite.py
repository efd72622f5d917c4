"""The incident suite: a YAML file naming incidents, run one after another into one index.

    incidents: [incast-hol, pfc-storm]     # names in configs/incidents/, or paths
    incidents: all                         # every file in configs/incidents/

`run_suite` runs each incident and its control (testbed/incident/run.py) and writes
`<runs>/<UTC time>-incidents/` with index.html, index.md and index.json
(testbed/report/index.py): the verdict table at the top, a link to each run's report.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from testbed.config import ConfigError
from testbed.incident.load import INCIDENTS_DIR, incident_files, incident_path, load_incident
from testbed.incident.run import IncidentOutcome, run_incident
from testbed.report.index import IndexEntry, IndexPaths, write_index
from testbed.run.rundir import create_run_dir
from testbed.run.runner import RunOptions


class SuiteError(ValueError):
    """A suite file that does not say which incidents to run."""


def suite_incidents(path: str | Path, directory: Path = INCIDENTS_DIR) -> list[Path] | None:
    """The incident files a suite names; None if `path` is not an incident suite (a
    mapping with `incidents:` and no fabric of its own)."""
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None
    if not isinstance(data, dict) or "incidents" not in data or "topology" in data:
        return None
    names = data["incidents"]
    if names == "all":
        files = incident_files(directory)
        if not files:
            raise SuiteError(f"{path}: incidents: all, but {directory} holds no incident")
        return files
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or not names:
        raise SuiteError(f"{path}: incidents: must be `all` or a list of incident names "
                         f"(files in {directory}) or paths, got {names!r}")
    base = Path(path).parent
    out = []
    for name in names:
        # a name is looked up in configs/incidents/; a path is relative to the suite file
        is_path = "/" in name or name.endswith((".yaml", ".yml"))
        out.append((base / name).resolve() if is_path and not Path(name).is_absolute()
                   else incident_path(name, directory))
    return out


@dataclass
class SuiteOutcome:
    index: IndexPaths | None
    outcomes: list[IncidentOutcome] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)       # files that did not load
    interrupted: bool = False

    @property
    def ok(self) -> bool:
        return not self.errors and all(o.ok for o in self.outcomes) and not self.interrupted


def run_suite(files: list[Path], options: RunOptions,
              on_outcome: Callable[[IncidentOutcome], None] | None = None) -> SuiteOutcome:
    """Every incident (control, then incident), then the index; a bad file is an entry
    saying so and the rest still run; an interrupted run stops the suite."""
    entries: list[IndexEntry] = []
    result = SuiteOutcome(None)
    for path in files:
        try:
            loaded = load_incident(path)
        except ConfigError as exc:
            message = "\n".join(exc.lines())
            result.errors.append(message)
            entries.append(IndexEntry(Path(path).stem, error=f"not run: {exc.lines()[0]}"))
            continue
        outcome = run_incident(loaded, options)
        result.outcomes.append(outcome)
        errors = [v.error for v in outcome.variants.values() if v.error]
        entries.append(IndexEntry(
            loaded.name, loaded.incident.title,
            {v: str(o.run_dir) if o.run_dir else None for v, o in outcome.variants.items()},
            "; ".join(errors) or None))
        if on_outcome is not None:
            on_outcome(outcome)
        if outcome.interrupted:
            result.interrupted = True
            break
    out_dir = create_run_dir(options.runs_root, "incidents")
    result.index = write_index(out_dir, entries, "Incident suite"
                               + (" (interrupted)" if result.interrupted else ""))
    return result
