"""The field tables of docs/config.md, generated from the config models.

The tables cannot drift from what `testbed validate` accepts because they are
rendered from the pydantic models themselves: every field's YAML key (its alias),
a human type, its default, its unit and its description. The walk starts at the
root model (`Fabric`) and follows nested models, unions, the discriminated
topology kinds, lists and mappings; the traffic entries of `workload.traffic`
come from `traffic_models()`, one model per workload `kind`.

docs/config.md keeps its hand-written prose; each table lives in a region

    <!-- generated:fields:KEY:BEGIN -->
    ...
    <!-- generated:fields:KEY:END -->

(KEY: the model's class name, or `traffic:<family>` for a traffic model), which
this module rewrites and nothing else. Regenerate with `make docs`, or

    python -m testbed.config.docs --write docs/config.md
    python -m testbed.config.docs --check docs/config.md   # exit 1 and a diff if stale

tests/unit/test_docs_config.py fails when the committed file is stale.
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import ipaddress
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import NoneType, UnionType
from typing import Annotated, Literal, NamedTuple, TypeGuard, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel, BeforeValidator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from testbed.config.models import Fabric
from testbed.units import (
    format_duration,
    format_rate,
    parse_duration_ns,
    parse_length_m,
    parse_rate_bps,
    parse_size_bytes,
)
from testbed.workloads.registry import REGISTRY

# The field whose list holds one traffic model per `kind`; its models come from
# traffic_models(), not from its annotation (they are registered per workload kind).
TRAFFIC_PATH = "workload.traffic"

BEGIN = "<!-- generated:fields:{key}:BEGIN -->"
END = "<!-- generated:fields:{key}:END -->"
_REGION_RE = re.compile(
    r"<!-- generated:fields:(?P<key>[^:>]+(?::[^:>]+)?):(?P<edge>BEGIN|END) -->")

_TAG_START = re.compile(r"<(?=[A-Za-z/!])")

# What a quantity parser reads, and the unit its integer is in.
_QUANTITIES: dict[Callable[..., object], tuple[str, str]] = {
    parse_duration_ns: ("duration", "ns"),
    parse_rate_bps: ("rate", "bit/s"),
    parse_size_bytes: ("size", "bytes"),
    parse_length_m: ("length", "m"),
}
# Field-name suffixes that carry a unit (models.py's convention: `kmin_bytes`, `delay_ns`).
_SUFFIX_UNITS = {"_ns": "ns", "_bps": "bit/s", "_bytes": "bytes", "_m": "m",
                 "_packets": "packets"}


def traffic_models() -> dict[str, type[BaseModel]]:
    """Each workload `kind` of `workload.traffic` entries, and the model of its entries:
    the registered kinds (testbed/workloads/registry.py)."""
    return dict(REGISTRY.models())


@dataclass
class Row:
    key: str
    type: str
    default: str
    unit: str
    description: str


@dataclass
class Table:
    """One model's fields, and where in a config the model is found."""

    key: str                                  # the region of docs/config.md
    model: type[BaseModel]
    paths: list[str] = field(default_factory=list)
    kinds: tuple[str, ...] = ()               # the `kind` values it is chosen by
    variant_of: int = 0                       # members of the union it is one of (0: none)
    rows: list[Row] = field(default_factory=list)


# ---- types -----------------------------------------------------------------------------

def _strip(annotation: object) -> tuple[object, list[object]]:
    """(the type under any Annotated layers, their metadata)."""
    metadata: list[object] = []
    while get_origin(annotation) is Annotated:
        annotation, *extra = get_args(annotation)
        for item in extra:
            if isinstance(item, FieldInfo):
                metadata += item.metadata
                if item.annotation not in (None, NoneType):
                    annotation = item.annotation
            else:
                metadata.append(item)
    return annotation, metadata


def _members(annotation: object) -> list[object]:
    """The members of a union (a non-union is its own only member)."""
    if get_origin(annotation) in (Union, UnionType):
        return list(get_args(annotation))
    return [annotation]


def _parser(metadata: list[object]) -> tuple[Callable[..., object], str | None] | None:
    """The quantity parser a BeforeValidator applies, and the word it also takes (`none`,
    `line`), if any."""
    for item in metadata:
        if not isinstance(item, BeforeValidator):
            continue
        func = item.func
        if func in _QUANTITIES:
            return func, None
        # rdma_params._none_or, models._rate_or_line: a parser and a word in a closure
        closure = inspect.getclosurevars(func).nonlocals
        inner = closure.get("parse")
        if inner in _QUANTITIES:
            return inner, str(closure.get("word", "none"))
    return None


def _bounds(metadata: list[object]) -> str:
    low = high = ""
    for item in metadata:
        if isinstance(item, annotated_types.Ge):
            low = f">= {item.ge}"
        elif isinstance(item, annotated_types.Gt):
            low = f"> {item.gt}"
        elif isinstance(item, annotated_types.Le):
            high = f"<= {item.le}"
        elif isinstance(item, annotated_types.Lt):
            high = f"< {item.lt}"
    if low.startswith(">=") and high.startswith("<="):
        return f"{low[3:]}..{high[3:]}"
    return " and ".join(b for b in (low, high) if b)


def _string(metadata: list[object]) -> str:
    text = "string"
    for item in metadata:
        pattern = getattr(item, "pattern", None)
        if pattern:
            text = f"name: `{pattern.removeprefix('^').removesuffix('$')}`"
    for item in metadata:
        if isinstance(item, annotated_types.MaxLen):
            text += f", at most {item.max_length} characters"
    return text


@dataclass
class _Found:
    """What a walk through one annotation found: nested models, and the parser's unit."""

    models: list[tuple[type[BaseModel], str]] = field(default_factory=list)   # (model, path)
    units: list[str] = field(default_factory=list)


def _type(annotation: object, metadata: list[object], path: str, found: _Found) -> str:
    """A human name for `annotation`; nested models are recorded in `found` under `path`."""
    annotation, more = _strip(annotation)
    metadata = [*metadata, *more]
    members = [m for m in _members(annotation) if m is not NoneType]
    if len(members) > 1:
        return _union(members, path, found)
    if members[0] is not annotation:            # X | None: X, with the field's metadata
        return _type(members[0], metadata, path, found)
    parser = _parser(metadata)
    if parser is not None:
        what, unit = _QUANTITIES[parser[0]]
        found.units.append(unit)
        return what + (f" or `{parser[1]}`" if parser[1] else "")
    if _is_model(annotation):
        found.models.append((annotation, path))
        return f"mapping: `{path}`"
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return ", ".join(f"`{_scalar(a)}`" for a in args)
    if origin is list:
        return "list of " + _plural(_type(args[0], [], f"{path}[]", found))
    if origin is tuple:
        return "[" + ", ".join(_type(a, [], path, found) for a in args) + "]"
    if origin is dict:
        return _mapping(args[0], args[1], path, found)
    return _plain(annotation, metadata, path)


def _union(members: list[object], path: str, found: _Found) -> str:
    """`a or b`; a union of models is one mapping, chosen by its `kind` if they have one."""
    models = [m for m in (_strip(m)[0] for m in members) if _is_model(m)]
    if len(models) < len(members):
        return " or ".join(_type(m, [], path, found) for m in members)
    found.models += [(m, path) for m in models]
    kinds = [k for m in models for k in _kind_values(m)]
    if all(_kind_values(m) for m in models):
        return f"mapping by `kind` ({', '.join(f'`{k}`' for k in kinds)}): `{path}`"
    return f"mapping, one of {len(models)} forms: `{path}`"


def _mapping(key: object, value: object, path: str, found: _Found) -> str:
    key_type, _ = _strip(key)
    keys = "names" if key_type is str else _plural(_type(key, [], path, found))
    values = _type(value, [], f"{path}.{'<name>' if key_type is str else '<n>'}", found)
    return f"mapping from {keys} to {_plural(values)}"


def _plain(annotation: object, metadata: list[object], path: str) -> str:
    if annotation is bool:
        return "true or false"
    if annotation in (int, float):
        bounds = _bounds(metadata)
        name = "integer" if annotation is int else "number"
        return f"{name} {bounds}" if bounds else name
    if annotation is str:
        return _string(metadata)
    if annotation is ipaddress.IPv4Network:
        return "IPv4 network (address/prefix length)"
    raise TypeError(f"{path}: no human name for the type {annotation!r}; teach "
                    "testbed/config/docs.py's _type about it")


def _plural(text: str) -> str:
    """'string' -> 'strings', 'mapping: `x`' -> 'mappings: `x`', 'size' -> 'sizes'."""
    for word in ("string", "mapping", "size", "duration", "rate", "length", "integer", "name"):
        if text == word or text.startswith((word + " ", word + ":")):
            return word + "s" + text[len(word):]
    return text


def _is_model(annotation: object) -> TypeGuard[type[BaseModel]]:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


# ---- defaults --------------------------------------------------------------------------

def _scalar(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _format_bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def _value(value: object, unit: str | None) -> str:
    """A value as the YAML would spell it; quantities in the units a config writes."""
    if isinstance(value, BaseModel):
        return _model_value(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_value(v, unit) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_scalar(k)}: {_value(v, unit)}" for k, v in value.items()) + "}"
    if isinstance(value, int) and not isinstance(value, bool) and unit is not None:
        return {"ns": format_duration, "bit/s": format_rate,
                "bytes": _format_bytes}.get(unit, _scalar)(value)
    return _scalar(value)


def _model_value(instance: BaseModel) -> str:
    """A model instance as a flow mapping of the fields it was given (the rest default)."""
    parts = []
    for name, info in type(instance).model_fields.items():
        if name in instance.model_fields_set:
            found = _Found()
            _type(info.annotation, list(info.metadata), name, found)
            unit = found.units[0] if found.units else None
            parts.append(f"{info.alias or name}: {_value(getattr(instance, name), unit)}")
    return "{" + ", ".join(parts) + "}"


def _default(info: FieldInfo, unit: str | None) -> str:
    if info.is_required():
        return "required"
    if info.default_factory is not None:
        value = info.default_factory()  # type: ignore[call-arg]  # ours take no argument
    else:
        value = info.default
    if value is None or value is PydanticUndefined:
        return "unset"
    return f"`{_value(value, unit)}`"


# ---- the walk --------------------------------------------------------------------------

def _unit(name: str, parser_units: list[str], path: str) -> str:
    """The field's unit: its name's suffix, which must agree with its parser's."""
    suffix = next((u for s, u in _SUFFIX_UNITS.items() if name.endswith(s)), None)
    parsed = parser_units[0] if parser_units else None
    if suffix and parsed and suffix != parsed:
        raise ValueError(f"{path}: the name says {suffix} but the value is parsed as {parsed}")
    unit = suffix or parsed or ""
    if unit == "ns":
        return "ns, fabric time"
    if unit == "bit/s":
        return "bit/s, wall" if "wall" in name else "bit/s, fabric"
    return unit


def _summary(model: type[BaseModel]) -> str:
    """The first paragraph of the model's docstring, on one line."""
    doc = inspect.getdoc(model) if model.__doc__ else ""
    return " ".join((doc or "").split("\n\n")[0].split())


def _cell(text: str) -> str:
    """`text` for a markdown table cell: pipes escaped, and outside code spans a `<` that
    starts a word, so that tb-<name>-<node> is not taken for an HTML tag."""
    parts = text.replace("|", "\\|").replace("\n", " ").split("`")
    for i in range(0, len(parts), 2):
        parts[i] = _TAG_START.sub("&lt;", parts[i])
    return "`".join(parts)


def _region_key(model: type[BaseModel], kinds: tuple[str, ...], is_traffic: bool) -> str:
    if is_traffic:
        families = {k.split("_")[0] for k in kinds}
        return "traffic:" + (families.pop() if len(families) == 1 else kinds[0])
    return model.__name__


class _Visit(NamedTuple):
    """A model the walk is to render, and how it was reached."""

    model: type[BaseModel]
    path: str
    kinds: tuple[str, ...] = ()       # the `kind` values that choose it
    variant_of: int = 0               # the size of the union it is a member of, if any
    is_traffic: bool = False


def collect_tables(root: type[BaseModel] = Fabric) -> list[Table]:
    """Every model reachable from `root`, in the order the walk meets them, with its rows."""
    tables: dict[type[BaseModel], Table] = {}
    queue = [_Visit(root, "")]
    while queue:
        visit = queue.pop(0)
        if visit.model in tables:
            if visit.path not in tables[visit.model].paths:
                tables[visit.model].paths.append(visit.path)
            continue
        table = tables[visit.model] = Table(
            _region_key(visit.model, visit.kinds, visit.is_traffic), visit.model,
            [visit.path], visit.kinds, visit.variant_of)
        for name, info in visit.model.model_fields.items():
            row, nested = _field_row(name, info, visit.path)
            table.rows.append(row)
            queue += nested
    return list(tables.values())


def _field_row(name: str, info: FieldInfo, parent: str) -> tuple[Row, list[_Visit]]:
    """One field's row, and the models its value holds (to be rendered next)."""
    key = info.alias or name
    path = f"{parent}.{key}" if parent else key
    found = _Found()
    if path == TRAFFIC_PATH:
        by_model: dict[type[BaseModel], list[str]] = {}
        for kind, traffic in traffic_models().items():
            by_model.setdefault(traffic, []).append(kind)
        type_text = "list of mappings, one per `kind`: `workload.traffic[]`"
        nested = [_Visit(m, f"{path}[]", tuple(ks), is_traffic=True)
                  for m, ks in by_model.items()]
    else:
        type_text = _type(info.annotation, list(info.metadata), path, found)
        nested = []
        for model, mpath in found.models:
            share = sum(1 for _, p in found.models if p == mpath)
            nested.append(_Visit(model, mpath, _kind_values(model), share if share > 1 else 0))
    base_unit = found.units[0] if found.units else None
    return Row(key, type_text, _default(info, base_unit), _unit(name, found.units, path),
               info.description or ""), nested


def _kind_values(model: type[BaseModel]) -> tuple[str, ...]:
    info = model.model_fields.get("kind")
    if info is None or get_origin(info.annotation) is not Literal:
        return ()
    return tuple(str(a) for a in get_args(info.annotation))


def undocumented(tables: list[Table] | None = None) -> list[str]:
    """`Model.key` of every field without a description."""
    return [f"{t.model.__name__}.{r.key}" for t in tables or collect_tables()
            for r in t.rows if not r.description]


# ---- rendering -------------------------------------------------------------------------

def _caption(table: Table) -> str:
    paths = ", ".join(f"`{p}`" if p else "Top level" for p in table.paths)
    if table.kinds:
        kinds = ", ".join(f"`{k}`" for k in table.kinds)
        where = f"{paths} with `kind:` {kinds}"
    elif table.variant_of:
        where = f"{paths} (one of {table.variant_of} forms)"
    else:
        where = paths
    summary = _summary(table.model)
    return f"**{where}**" + (f": {summary}" if summary else "")


def render_table(table: Table) -> str:
    lines = [_caption(table), "",
             "| key | type | default | unit | description |",
             "|---|---|---|---|---|"]
    lines += [f"| `{r.key}` | {_cell(r.type)} | {_cell(r.default)} | {_cell(r.unit)} | "
              f"{_cell(r.description)} |" for r in table.rows]
    return "\n".join(lines)


def render_regions(root: type[BaseModel] = Fabric) -> dict[str, str]:
    """Region key -> the markdown that belongs between its markers."""
    regions: dict[str, str] = {}
    for table in collect_tables(root):
        if table.key in regions:
            raise ValueError(f"two models render into the region {table.key!r}; rename one")
        regions[table.key] = render_table(table)
    return regions


def _spans(text: str) -> Iterator[tuple[str, int, int]]:
    """(key, end of its BEGIN marker, start of its END marker) of each region in `text`."""
    open_key: str | None = None
    start = 0
    for m in _REGION_RE.finditer(text):
        key, edge = m["key"], m["edge"]
        if edge == "BEGIN":
            if open_key is not None:
                raise ValueError(f"region {open_key!r} is not closed before {key!r} begins")
            open_key, start = key, m.end()
        else:
            if key != open_key:
                raise ValueError(f"END of region {key!r} without its BEGIN")
            yield key, start, m.start()
            open_key = None
    if open_key is not None:
        raise ValueError(f"region {open_key!r} has no END marker")


def apply_regions(text: str, regions: dict[str, str]) -> str:
    """`text` with every region's content replaced; the prose between regions is kept.

    Every rendered table must have exactly one region, and every region a table:
    a model added or renamed is an error that says where to put its markers."""
    spans = list(_spans(text))
    keys = [k for k, _, _ in spans]
    missing = [k for k in regions if k not in keys]
    unknown = [k for k in keys if k not in regions]
    doubled = sorted({k for k in keys if keys.count(k) > 1})
    problems = []
    if missing:
        problems.append("no region for " + ", ".join(missing) + "; add "
                        + " ".join(f"{BEGIN.format(key=k)} {END.format(key=k)}" for k in missing)
                        + " where each table belongs")
    if unknown:
        problems.append("regions without a model: " + ", ".join(unknown) + "; remove them")
    if doubled:
        problems.append("regions given twice: " + ", ".join(doubled))
    if problems:
        raise ValueError("; ".join(problems))
    out, pos = [], 0
    for key, start, end in spans:
        out += [text[pos:start], "\n", regions[key], "\n"]
        pos = end
    out.append(text[pos:])
    return "".join(out)


def generate(text: str) -> str:
    """docs/config.md's text with its field tables regenerated."""
    return apply_regions(text, render_regions())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m testbed.config.docs",
        description="Regenerate the field tables of docs/config.md from the config models.")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", metavar="FILE", type=Path, help="rewrite FILE's tables")
    mode.add_argument("--check", metavar="FILE", type=Path,
                      help="exit 1 with a diff if FILE's tables are stale")
    mode.add_argument("--undocumented", action="store_true",
                      help="list the fields that have no description")
    args = parser.parse_args(argv)
    if args.undocumented:
        for name in undocumented():
            print(name)
        return 0
    path: Path = args.write or args.check
    text = path.read_text(encoding="utf-8")
    try:
        new = generate(text)
    except ValueError as exc:
        print(f"{path}: {exc}", file=sys.stderr)
        return 2
    if args.write:
        if new != text:
            path.write_text(new, encoding="utf-8")
        return 0
    if new == text:
        return 0
    sys.stdout.writelines(difflib.unified_diff(
        text.splitlines(keepends=True), new.splitlines(keepends=True),
        f"{path} (committed)", f"{path} (generated)"))
    print(f"{path} is stale; regenerate it: make docs", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
