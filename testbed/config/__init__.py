"""Stage 1: load a fabric YAML file into validated models, or report every problem.

`load_config(path)` returns a `LoadedConfig` (the `Fabric` model, its
expanded nodes and links, and the line map) or raises `ConfigError`
listing every problem as `FILE:LINE: path.to.field: message`.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from testbed.config.checks import (
    check_dscp_remap,
    check_events,
    check_fabric,
    check_hosts,
    check_impairments,
    check_qos,
    check_routes,
    check_topology,
    check_traffic_classes,
    check_workload,
)
from testbed.config.errors import ConfigError, Problem, format_loc
from testbed.config.loader import (
    MAX_BYTES,
    LineMap,
    YamlProblem,
    decode_config_bytes,
    parse_yaml_with_lines,
    too_big,
)
from testbed.config.models import FORMAT_VERSION, LAB_NAME_RE, NAME_RE, Fabric
from testbed.config.topology import Expanded, expand

__all__ = ["ConfigError", "Fabric", "LoadedConfig", "Problem", "describe_input", "format_loc",
           "load_config", "load_config_text", "FORMAT_VERSION"]

_TOPOLOGY_KINDS = ("leaf_spine", "single_switch", "ring")


@dataclass(frozen=True)
class LoadedConfig:
    path: str
    text: str
    fabric: Fabric
    expanded: Expanded
    lines: LineMap


def _all_field_names() -> list[str]:
    import testbed.config.models as models

    names: set[str] = set()
    for obj in vars(models).values():
        if isinstance(obj, type) and issubclass(obj, BaseModel) and obj is not BaseModel:
            for fname, finfo in obj.model_fields.items():
                names.add(finfo.alias or fname)
    return sorted(names)


def _models_in(annotation: object, value: object) -> list[type[BaseModel]]:
    """The model classes `annotation` stands for; `value` picks a tagged-union member."""
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if get_origin(annotation) in (Union, UnionType):
        found = [m for arg in get_args(annotation) for m in _models_in(arg, value)]
        kind = value.get("kind") if isinstance(value, dict) else None
        tagged = [m for m in found if "kind" in m.model_fields
                  and get_args(m.model_fields["kind"].annotation) == (kind,)]
        return tagged or found
    return []


def _fields_of_parent(loc: tuple, data: object,
                      root: type[BaseModel] = Fabric) -> list[str] | None:
    """Field names allowed beside `loc[-1]`, by walking the models along `loc` from `root`;
    None if unsure."""
    annotation: object = root
    value: Any = data    # parsed YAML of any shape: a failed lookup is caught below
    for part in loc[:-1]:
        models = _models_in(annotation, value)
        if len(models) == 1:
            fields = {f.alias or n: f for n, f in models[0].model_fields.items()}
            if part not in fields:
                return None
            annotation = fields[part].annotation
        else:
            while get_origin(annotation) in (Annotated, Union, UnionType):
                args = [a for a in get_args(annotation) if a is not type(None)]
                annotation = args[0]
            if get_origin(annotation) is list:
                annotation = get_args(annotation)[0]
            elif get_origin(annotation) is dict:
                annotation = get_args(annotation)[1]
            else:
                return None
        try:
            value = value[part]
        except (KeyError, IndexError, TypeError):
            value = None
    models = _models_in(annotation, value)
    if len(models) != 1:
        return None
    return sorted(f.alias or n for n, f in models[0].model_fields.items())


def _did_you_mean(word: str, choices: list[str]) -> str | None:
    close = difflib.get_close_matches(word, choices, n=1)
    return close[0] if close else None


def _unknown_field(loc: tuple, data: object,
                   root: type[BaseModel] = Fabric) -> tuple[str, str | None]:
    """Message for a field no model knows, and the field it most likely meant."""
    field = str(loc[-1])
    allowed = _fields_of_parent(loc, data, root)
    guess = _did_you_mean(field, allowed if allowed is not None else _all_field_names())
    if guess:
        return f"unknown field {field!r}; did you mean {guess!r}?", guess
    if allowed:
        return f"unknown field {field!r}; fields here: {', '.join(allowed)}", None
    return f"unknown field {field!r}; remove it", None


def describe_input(value: object) -> str:
    """What a user wrote where something else was expected, in words: 'a mapping'."""
    if value is None:
        return "nothing"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return repr(value)


# Error types whose message needs only the input and pydantic's context, as
# str.format templates over `got` (the input, described) and `ctx`.
_TEMPLATES: dict[str, str] = {
    "missing": "required field is missing; add it",
    "int_parsing": "expected a whole number, got {got}",
    "int_type": "expected a whole number, got {got}",
    "int_from_float": "expected a whole number, got {got}",
    "float_parsing": "expected a number, got {got}",
    "float_type": "expected a number, got {got}",
    "bool_parsing": "expected true or false, got {got}",
    "bool_type": "expected true or false, got {got}",
    "string_type": "expected a text value, got {got}",
    "string_too_long": "{got} is too long: use at most {ctx[max_length]} characters",
    "list_type": "expected a list (lines starting with '- ', or [a, b]), got {got}",
    "dict_type": "expected a mapping (key: value lines, or {{key: value}}), got {got}",
    "model_type": "expected a mapping (key: value lines, or {{key: value}}), got {got}",
    "model_attributes_type": "expected a mapping (key: value lines, or {{key: value}}), "
                             "got {got}",
    "greater_than_equal": "{got} is too small; use a value >= {ctx[ge]}",
    "greater_than": "{got} is too small; use a value > {ctx[gt]}",
    "less_than_equal": "{got} is too large; use a value <= {ctx[le]}",
    "less_than": "{got} is too large; use a value < {ctx[lt]}",
    "too_short": "give at least {ctx[min_length]} item(s), got {ctx[actual_length]}",
    "ip_v4_network": "{got} is not an IPv4 network; write it like 198.18.0.0/15, "
                     "with the host bits zero",
}


def _pattern_message(err: ErrorDetails, got: str, ctx: dict[str, Any]) -> str | None:
    """Names: say what a valid one looks like; None for patterns with no better words."""
    pattern = ctx.get("pattern")
    if pattern == LAB_NAME_RE:
        return (f"{got} is not a valid lab name: use lower-case letters and "
                "digits, starting with a letter, at most 16 characters")
    if pattern == NAME_RE:
        return (f"{got} is not a valid name: use lower-case letters, digits "
                "and _, starting with a letter")
    return None


def _literal_message(err: ErrorDetails, got: str, ctx: dict[str, Any]) -> str:
    allowed = re.findall(r"'([^']*)'", ctx.get("expected", ""))
    guess = _did_you_mean(str(err.get("input")), allowed) if allowed else None
    hint = f"; did you mean {guess!r}?" if guess else ""
    return f"must be {ctx.get('expected', 'one of the listed values')}, got {got}{hint}"


def _union_tag_message(err: ErrorDetails, got: str, ctx: dict[str, Any]) -> str:
    """The topology's `kind:` missing or unknown (the only tagged union a user writes)."""
    kinds = re.findall(r"'([^']*)'", ctx.get("expected_tags", "")) or list(_TOPOLOGY_KINDS)
    if err["type"] == "union_tag_not_found":
        return f"required field is missing; add kind: with one of {', '.join(kinds)}"
    guess = _did_you_mean(str(ctx.get("tag")), kinds)
    if guess:
        return f"unknown topology kind {ctx.get('tag')!r}; did you mean {guess!r}?"
    return f"unknown topology kind {ctx.get('tag')!r}; use one of {', '.join(kinds)}"


_RENDERERS: dict[str, Callable[[ErrorDetails, str, dict[str, Any]], str | None]] = {
    "string_pattern_mismatch": _pattern_message,
    "literal_error": _literal_message,
    "union_tag_invalid": _union_tag_message,
    "union_tag_not_found": _union_tag_message,
}


def _message(err: ErrorDetails) -> str:
    """pydantic's error in the user's terms; pydantic's own text where we have nothing better."""
    msg = err["msg"]
    if msg.startswith("Value error, "):     # our validators' messages are already worded
        return msg[len("Value error, "):]
    got = describe_input(err.get("input"))
    ctx = err.get("ctx", {})
    if "[key]" in err["loc"] and "buffer" in err["loc"]:
        return f"buffer keys are traffic classes 0..7, got {got}"
    kind = err["type"]
    render = _RENDERERS.get(kind)
    if render is not None:
        text = render(err, got, ctx)
        return msg if text is None else text
    template = _TEMPLATES.get(kind)
    return msg if template is None else template.format(got=got, ctx=ctx)


def _clean_loc(err: ErrorDetails) -> tuple[int | str, ...]:
    """The location a user wrote: no union tags, no '[key]' marker; tag errors on `kind`."""
    loc = tuple(err["loc"])
    out: list[int | str] = []
    for i, part in enumerate(loc):
        if i > 0 and loc[i - 1] == "topology" and part in _TOPOLOGY_KINDS:
            continue
        if part == "[key]":
            continue
        out.append(part)
    if err["type"] in ("union_tag_invalid", "union_tag_not_found"):
        out.append("kind")
    return tuple(out)


def pydantic_problems(exc: ValidationError, data: object, lines: LineMap,
                      root: type[BaseModel] = Fabric) -> list[Problem]:
    """pydantic's errors as problems at their lines, in the user's words; `root` is the
    model the file validates as (the fabric, or another file such as the VMs file)."""
    problems: list[tuple[tuple, str]] = []
    meant: set[tuple] = set()    # fields an unknown field probably was a typo of
    for err in exc.errors():
        loc = _clean_loc(err)
        if err["type"] in ("extra_forbidden", "invalid_key"):   # invalid_key: `5: x`
            message, guess = _unknown_field(loc, data, root)
            if guess:
                meant.add((*loc[:-1], guess))
        else:
            message = _message(err)
        problems.append((loc, message))
    # A misspelt required field also shows up as missing; the did-you-mean says it all.
    return [Problem(lines.line_for(loc), loc, message) for loc, message in problems
            if not (message.startswith("required field is missing") and loc in meant)]


def validate_data(data: object, lines: LineMap, file: str, text: str = "") -> LoadedConfig:
    """Validate already-parsed YAML data; raises ConfigError with every problem."""
    from testbed.phy import PORT_TYPES

    if data is None:
        raise ConfigError(file, [Problem(1, (), "the file is empty; a fabric config needs at "
                                                "least name: and topology: (see configs/)")])
    if not isinstance(data, dict):
        what = describe_input(data)
        raise ConfigError(file, [Problem(1, (), f"the file holds {what}, but a fabric "
                                                "config is a mapping of fields (name:, "
                                                "topology: ...)")])
    try:
        fabric = Fabric.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(file, pydantic_problems(exc, data, lines)) from None
    expanded = expand(fabric)
    found = [*check_fabric(fabric), *check_traffic_classes(fabric), *check_qos(fabric),
             *check_topology(fabric, expanded, sorted(PORT_TYPES)),
             *check_workload(fabric, expanded), *check_impairments(fabric, expanded),
             *check_events(fabric, expanded), *check_routes(fabric, expanded),
             *check_dscp_remap(fabric, expanded), *check_hosts(fabric, expanded)]
    if found:
        raise ConfigError(file, [Problem(lines.line_for(loc), loc, msg) for loc, msg in found])
    return LoadedConfig(path=file, text=text, fabric=fabric, expanded=expanded, lines=lines)


def load_config_text(text: str, file: str = "<string>") -> LoadedConfig:
    try:
        data, lines = parse_yaml_with_lines(text)
    except YamlProblem as exc:
        raise ConfigError(file, [Problem(exc.line, exc.loc, exc.message)]) from None
    return validate_data(data, lines, file, text)


def read_config_file(path: str | Path) -> str:
    """The UTF-8 text of a config-like file (fabric, VMs, incident); ConfigError for a file
    that cannot be read, is too big or is not UTF-8 text."""
    path = Path(path)
    try:
        if path.stat().st_size > MAX_BYTES:    # refuse before reading a huge file into memory
            raise YamlProblem(1, too_big(path.stat().st_size))
        return decode_config_bytes(path.read_bytes())
    except OSError as exc:
        raise ConfigError(str(path), [Problem(0, (), f"cannot read: {exc.strerror}")]) from None
    except YamlProblem as exc:
        raise ConfigError(str(path), [Problem(exc.line, exc.loc, exc.message)]) from None


def load_config(path: str | Path) -> LoadedConfig:
    """Load and validate a fabric config file."""
    return load_config_text(read_config_file(path), str(path))
