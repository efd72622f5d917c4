"""Load an incident file into its two validated fabric variants, or report every problem.

`load_incident(path)` returns a `LoadedIncident`: the `Incident` model and, per variant
(`incident`, `control`), a `LoadedConfig` from the project's own config validation, so a
fabric problem reads like any config problem, with the incident file's real line:
`configs/incidents/NAME.yaml:LINE: fabric.path: message`. The control variant is the
fabric with `control.set` and `control.remove` applied (testbed/incident/paths.py); a
problem its edits cause points at the `set:` entry (`control.set.<path>`).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from types import UnionType
from typing import Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from testbed.config import (
    ConfigError,
    LoadedConfig,
    Problem,
    describe_input,
    read_config_file,
    validate_data,
)
from testbed.config.loader import LineMap, YamlProblem, parse_yaml_with_lines
from testbed.incident.model import Evidence, Incident, Metric, Predicate
from testbed.incident.paths import (
    Lined,
    PathError,
    from_lined,
    remove_path,
    set_path,
    show_path,
    to_lined,
)

INCIDENTS_DIR = Path("configs/incidents")
VARIANTS = ("incident", "control")


@dataclass(frozen=True)
class LoadedIncident:
    name: str                              # the file's stem: incast-hol
    path: str
    text: str
    incident: Incident
    variants: dict[str, LoadedConfig] = field(default_factory=dict)


def incident_files(directory: Path = INCIDENTS_DIR) -> list[Path]:
    return sorted(Path(directory).glob("*.yaml"))


def incident_path(name_or_file: str, directory: Path = INCIDENTS_DIR) -> Path:
    """A file path as given, or NAME looked up in configs/incidents/."""
    given = Path(name_or_file)
    if given.suffix in (".yaml", ".yml") or given.exists():
        return given
    return Path(directory) / f"{name_or_file}.yaml"


def sub_lines(lines: LineMap, prefix: tuple) -> LineMap:
    """The LineMap of the sub-document at `prefix`, its locations relative to it."""
    n = len(prefix)
    out = LineMap({loc[n:]: line for loc, line in lines.lines.items() if loc[:n] == prefix})
    out.lines.setdefault((), lines.line_for(prefix))
    return out


def load_incident(path: str | Path) -> LoadedIncident:
    """Load, validate the incident model and both fabric variants; ConfigError lists every
    problem found (the fabric's only once the incident's own fields are sound)."""
    file = str(path)
    # the same refusals as a fabric config: unreadable, too big, not UTF-8, then YAML's
    text = read_config_file(path)
    try:
        data, lines = parse_yaml_with_lines(text)
    except YamlProblem as exc:
        raise ConfigError(file, [Problem(exc.line, exc.loc, exc.message)]) from None
    if not isinstance(data, dict):
        shown = "nothing" if data is None else "a list" if isinstance(data, list) else repr(data)
        raise ConfigError(file, [Problem(1, (), f"the file holds {shown}, but an incident is a "
                                                "mapping of fields (title:, fabric:, control:, "
                                                "signature: ...)")])
    try:
        incident = Incident.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(file, model_problems(exc, data, lines)) from None
    problems = signature_problems(incident, lines)
    fabric_lines = sub_lines(lines, ("fabric",))
    variants: dict[str, LoadedConfig] = {}
    try:
        variants["incident"] = validate_data(
            incident.fabric, fabric_lines, file, variant_text(file, "incident", incident.fabric))
    except ConfigError as exc:
        problems += [Problem(p.line, ("fabric", *p.loc), p.message) for p in exc.problems]
    control, edit_problems = control_variant(incident, lines)
    problems += edit_problems
    if control is not None and "incident" in variants:
        try:
            variants["control"] = validate_data(
                control.data, control.lines, file, variant_text(file, "control", control.data))
        except ConfigError as exc:
            problems += [_control_problem(p, control.origins) for p in exc.problems]
    if "incident" in variants:
        problems += class_problems(incident, variants["incident"], lines)
    if problems:
        raise ConfigError(file, problems)
    return LoadedIncident(name=Path(path).stem, path=file, text=text, incident=incident,
                          variants=variants)


def variant_text(file: str, variant: str, data: dict) -> str:
    """The variant's fabric as a config file: what its run directory's config.yaml holds."""
    return (f"# The {variant} variant of the incident {file}, as `testbed incident run` ran "
            "it.\n" + yaml.safe_dump(data, sort_keys=False, default_flow_style=None))


def control_variant(incident: Incident, lines: LineMap) -> tuple[Any, list[Problem]]:
    """The fabric with control.set then control.remove applied (an Unlined), or None and
    the problems of paths that lead nowhere."""
    root = to_lined(incident.fabric, sub_lines(lines, ("fabric",)))
    problems: list[Problem] = []
    control = incident.control
    if not control.set and not control.remove:
        problems.append(Problem(lines.line_for(("control",)), ("control",),
                                "the control changes nothing; give set: (path: value) or "
                                "remove: (paths) to make it the fix or the fault's absence"))
    for key, value in control.set.items():
        loc: tuple = ("control", "set", key)
        node: Lined = to_lined(value, sub_lines(lines, loc))
        node.origin = key
        try:
            set_path(root, key, node, "fabric")
        except PathError as exc:
            problems.append(Problem(lines.line_for(loc), loc, str(exc)))
    for i, key in enumerate(control.remove):
        loc = ("control", "remove", i)
        try:
            remove_path(root, key, "fabric")
        except PathError as exc:
            problems.append(Problem(lines.line_for(loc), loc, f"{key}: {exc}"))
    return (None if problems else from_lined(root)), problems


def _control_problem(p: Problem, origins: dict[tuple, str]) -> Problem:
    """A problem of the control variant: on the `set:` entry that put the value there, else
    on the fabric field, saying it is the control's."""
    for n in range(len(p.loc), -1, -1):
        origin = origins.get(tuple(p.loc[:n]))
        if origin is not None:
            rest = show_path(p.loc[n:]) if p.loc[n:] else ""
            where = f" (at {rest} of the value)" if rest else ""
            return Problem(p.line, ("control", "set", origin), p.message + where)
    return Problem(p.line, ("fabric", *p.loc), p.message + " (in the control variant)")


def signature_problems(incident: Incident, lines: LineMap) -> list[Problem]:
    problems = []
    seen: dict[str, int] = {}
    for i, pred in enumerate(incident.signature):
        if pred.name in seen:
            loc = ("signature", i, "name")
            problems.append(Problem(lines.line_for(loc), loc,
                                    f"{pred.name!r} is also the name of "
                                    f"signature[{seen[pred.name]}]; predicate names are "
                                    "unique"))
        seen.setdefault(pred.name, i)
    return problems


def class_problems(incident: Incident, loaded: LoadedConfig, lines: LineMap) -> list[Problem]:
    """Traffic classes named in predicates and evidence must be the fabric's."""
    names = {c.name for c in loaded.fabric.traffic_classes}
    problems = []

    def check(value: object, loc: tuple) -> None:
        if isinstance(value, str) and value != "*" and value not in names:
            close = difflib.get_close_matches(value, sorted(names), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            problems.append(Problem(lines.line_for(loc), loc,
                                    f"no traffic class {value!r} in the fabric; {hint}use a "
                                    f"class number, '*' or one of {', '.join(sorted(names))}"))

    for i, pred in enumerate(incident.signature):
        for where, metric in ((("signature", i), pred),
                              (("signature", i, "of"), pred.of)):
            if isinstance(metric, Metric) and metric.counter is not None:
                check(metric.counter.tclass, (*where, "counter", "tclass"))
    if incident.evidence is not None:
        check(incident.evidence.tclass, ("evidence", "tclass"))
    return problems


# ---- the incident model's own errors ----------------------------------------------------

def _models_of(annotation: object) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if get_origin(annotation) in (Union, UnionType, list, dict):
        return [m for a in get_args(annotation) for m in _models_of(a)]
    return []


def _fields_at(loc: tuple) -> list[str] | None:
    """Field names allowed beside loc[-1], walking the incident models; None if unsure."""
    models: list[type[BaseModel]] = [Incident]
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        found = [m.model_fields[n] for m in models for n, f in m.model_fields.items()
                 if (f.alias or n) == part]
        if not found:
            return None
        models = _models_of(found[0].annotation)
        if part == "fabric":
            return None
    if len(models) != 1:
        return None
    return sorted(f.alias or n for n, f in models[0].model_fields.items())


def _clean_loc(loc: tuple, data: object, kind: str) -> tuple:
    """The location as written: pydantic's union member tags (`float`, `Metric`) dropped."""
    out: list[Any] = []
    here: Any = data
    for i, part in enumerate(loc):
        last = i == len(loc) - 1
        if isinstance(here, dict) and part in here:
            here = here[part]
        elif isinstance(here, list) and isinstance(part, int) and part < len(here):
            here = here[part]
        elif last and kind in ("missing", "extra_forbidden"):
            pass
        else:
            continue
        out.append(part)
    return tuple(out)


def _message(err: Any, loc: tuple) -> str:
    kind, msg = err["type"], err["msg"]
    if msg.startswith("Value error, "):
        return msg[len("Value error, "):]
    if kind == "missing":
        return "required field is missing; add it"
    if kind == "extra_forbidden":
        allowed = _fields_at(loc) or []
        close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        if close:
            return f"unknown field {loc[-1]!r}; did you mean {close[0]!r}?"
        return f"unknown field {loc[-1]!r}; fields here: {', '.join(allowed) or 'none'}"
    if kind == "literal_error":
        expected = err.get("ctx", {}).get("expected", "?")
        return f"must be {expected}, got {describe_input(err.get('input'))}"
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        return f"expected a mapping (key: value lines), got {describe_input(err.get('input'))}"
    if kind == "list_type":
        return f"expected a list (lines starting with '- '), got {describe_input(err.get('input'))}"
    if kind == "string_type":
        return f"expected a text value, got {describe_input(err.get('input'))}"
    if kind == "too_short":
        return "needs at least one entry"
    return f"{msg}, got {describe_input(err.get('input'))}"


def model_problems(exc: ValidationError, data: object, lines: LineMap) -> list[Problem]:
    out: dict[tuple, Problem] = {}
    for err in exc.errors():
        loc = _clean_loc(tuple(err["loc"]), data, err["type"])
        if loc in out:          # a union's members each complain; the first says it
            continue
        out[loc] = Problem(lines.line_for(loc), loc, _message(err, loc))
    return list(out.values())


__all__ = ["INCIDENTS_DIR", "VARIANTS", "Evidence", "LoadedIncident", "Predicate",
           "incident_files", "incident_path", "load_incident"]
