"""Stage 1: load a fabric YAML file into validated models, or report every problem.

`load_config(path)` returns a `LoadedConfig` (the `Fabric` model, its
expanded nodes and links, and the line map) or raises `ConfigError`
listing every problem as `FILE:LINE: path.to.field: message`.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from testbed.config.checks import check_fabric, check_qos, check_topology, check_traffic_classes
from testbed.config.errors import ConfigError, Problem, format_loc
from testbed.config.loader import LineMap, YamlProblem, parse_yaml_with_lines
from testbed.config.models import FORMAT_VERSION, LAB_NAME_RE, NAME_RE, Fabric
from testbed.config.topology import Expanded, expand

__all__ = ["ConfigError", "Fabric", "LoadedConfig", "Problem", "format_loc", "load_config",
           "load_config_text", "FORMAT_VERSION"]

_TOPOLOGY_KINDS = {"leaf_spine", "single_switch", "ring"}


@dataclass(frozen=True)
class LoadedConfig:
    path: str
    text: str
    fabric: Fabric
    expanded: Expanded
    lines: LineMap


def _all_field_names() -> list[str]:
    from pydantic import BaseModel

    import testbed.config.models as models

    names: set[str] = set()
    for obj in vars(models).values():
        if isinstance(obj, type) and issubclass(obj, BaseModel) and obj is not BaseModel:
            for fname, finfo in obj.model_fields.items():
                names.add(finfo.alias or fname)
    return sorted(names)


def _message(err: dict) -> str:
    msg = err["msg"]
    kind = err["type"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if kind == "extra_forbidden":
        field = err["loc"][-1]
        close = difflib.get_close_matches(str(field), _all_field_names(), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return f"unknown field {field!r}{hint}"
    if kind == "string_pattern_mismatch":
        pattern = err.get("ctx", {}).get("pattern")
        if pattern == LAB_NAME_RE:
            return (f"{err['input']!r} is not a valid lab name: use lower-case letters and "
                    "digits, starting with a letter, at most 16 characters")
        if pattern == NAME_RE:
            return (f"{err['input']!r} is not a valid name: use lower-case letters, digits "
                    "and _, starting with a letter")
    if kind == "missing":
        return "required field is missing"
    return msg


def _clean_loc(loc: tuple) -> tuple:
    # Drop the discriminator tag pydantic inserts for tagged unions.
    out = []
    for i, part in enumerate(loc):
        if i > 0 and loc[i - 1] == "topology" and part in _TOPOLOGY_KINDS:
            continue
        out.append(part)
    return tuple(out)


def validate_data(data: object, lines: LineMap, file: str, text: str = "") -> LoadedConfig:
    """Validate already-parsed YAML data; raises ConfigError with every problem."""
    from testbed.phy import PORT_TYPES

    if not isinstance(data, dict):
        raise ConfigError(file, [Problem(1, (), "a fabric config is a mapping of fields "
                                               "(name:, topology: ...)")])
    try:
        fabric = Fabric.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = _clean_loc(tuple(err["loc"]))
            problems.append(Problem(lines.line_for(loc), loc, _message(err)))
        raise ConfigError(file, problems) from None
    expanded = expand(fabric)
    found = [*check_fabric(fabric), *check_traffic_classes(fabric), *check_qos(fabric),
             *check_topology(fabric, expanded, sorted(PORT_TYPES))]
    if found:
        raise ConfigError(file, [Problem(lines.line_for(loc), loc, msg) for loc, msg in found])
    return LoadedConfig(path=file, text=text, fabric=fabric, expanded=expanded, lines=lines)


def load_config_text(text: str, file: str = "<string>") -> LoadedConfig:
    try:
        data, lines = parse_yaml_with_lines(text)
    except YamlProblem as exc:
        raise ConfigError(file, [Problem(exc.line, (), exc.message)]) from None
    return validate_data(data, lines, file, text)


def load_config(path: str | Path) -> LoadedConfig:
    """Load and validate a fabric config file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(str(path), [Problem(0, (), f"cannot read: {exc.strerror}")]) from None
    return load_config_text(text, str(path))
