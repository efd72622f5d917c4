"""Dotted paths into YAML-shaped data, with the line every part came from.

A path is keys separated by dots; a list item is addressed by its index or by the value
of its `name` field (`workload.traffic.incast.cc`, `links.0.length`, `links[0].length`).
The control variant of an incident is its fabric with `set:` and `remove:` applied to
such paths. The edits are made on a tree whose every node carries its source line
(`Lined`), so the variant's LineMap is real: an unchanged field keeps the line it has in
the incident file, a value `set:` put there gets the line of its `set:` entry.
"""

from __future__ import annotations

import copy
import difflib
import re
from dataclasses import dataclass
from typing import Any

from testbed.config.loader import LineMap

_SEGMENT_RE = re.compile(r"^(?P<key>[^\[\]]*)(?P<indices>(?:\[\d+\])*)$")


class PathError(ValueError):
    """A path that does not lead anywhere; the message says what exists there."""


def split_path(path: str) -> list[str | int]:
    """'workload.traffic[0].cc' -> ['workload', 'traffic', 0, 'cc']; numbers stay strings
    when written with dots ('links.0'), since a mapping may have a key '0'."""
    if not isinstance(path, str) or not path.strip():
        raise PathError(f"{path!r} is not a dotted path (e.g. workload.traffic.incast.cc)")
    parts: list[str | int] = []
    for segment in path.split("."):
        m = _SEGMENT_RE.match(segment)
        if m is None or (not m["key"] and not m["indices"]):
            raise PathError(f"{path!r}: empty or malformed part {segment!r}")
        if m["key"]:
            parts.append(m["key"])
        parts += [int(i) for i in re.findall(r"\d+", m["indices"])]
    return parts


def show_path(parts: list[str | int] | tuple) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(top level)"


def _names(items: list[Any]) -> list[str]:
    return [str(n) for n in map(_item_name, items) if n is not None]


def _plain(node: Any) -> Any:
    """The value of a Lined node one level down (children stay as they are)."""
    return node.value if isinstance(node, Lined) else node


def _item_name(item: Any) -> Any:
    value = _plain(item)
    if isinstance(value, dict) and "name" in value:
        return _plain(value["name"])
    return None


def child_key(container: Any, part: str | int, where: list[str | int], root: str = ""
              ) -> str | int:
    """The key (mapping) or index (list) `part` names in `container`; PathError if none.
    `where` is the container's location, named from `root` in messages."""
    value = _plain(container)
    here = show_path([root, *where] if root else where)
    if isinstance(value, dict):
        for key in (part, str(part)) + ((int(part),) if str(part).isdigit() else ()):
            if key in value:
                return key
        keys = [str(k) for k in value]
        close = difflib.get_close_matches(str(part), keys, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise PathError(f"{here} has no {part!r}; {hint}it has: "
                        f"{', '.join(keys) if keys else 'nothing'}")
    if isinstance(value, list):
        if isinstance(part, int) or part.isdigit():
            index = int(part)
            if index < len(value):
                return index
            raise PathError(f"{here} has {len(value)} item(s); index {index} is past the end")
        for i, item in enumerate(value):
            if _item_name(item) == part:
                return i
        names = _names(value)
        close = difflib.get_close_matches(part, names, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        shown = ", ".join(names) if names else f"none named; index 0..{len(value) - 1}"
        raise PathError(f"{here} has no item named {part!r}; {hint}its items: {shown}")
    raise PathError(f"{here} is a value ({_plain(container)!r}), not a mapping or a list; "
                    f"it has no {part!r}")


def lookup(data: Any, path: str | list[str | int], root: str = "") -> tuple[Any, tuple]:
    """The value at `path` in plain data, and its location (indices resolved)."""
    parts = split_path(path) if isinstance(path, str) else path
    loc: list[str | int] = []
    for part in parts:
        key = child_key(data, part, loc, root)
        data = data[key]
        loc.append(key)
    return data, tuple(loc)


@dataclass
class Lined:
    """A YAML value with the line it came from; containers hold Lined children."""

    line: int
    value: Any
    origin: str | None = None     # the `set:` key that put it there, if one did


def to_lined(data: Any, lines: LineMap, loc: tuple = ()) -> Lined:
    if isinstance(data, dict):
        return Lined(lines.line_for(loc),
                     {k: to_lined(v, lines, (*loc, k)) for k, v in data.items()})
    if isinstance(data, list):
        return Lined(lines.line_for(loc),
                     [to_lined(v, lines, (*loc, i)) for i, v in enumerate(data)])
    return Lined(lines.line_for(loc), copy.deepcopy(data))


@dataclass
class Unlined:
    data: Any
    lines: LineMap
    origins: dict[tuple, str]     # location -> the `set:` key whose value is there


def from_lined(root: Lined) -> Unlined:
    """Plain data, the LineMap of every location in it and where `set:` put values."""
    out = Unlined(None, LineMap(), {})

    def walk(node: Lined, loc: tuple) -> Any:
        out.lines.lines[loc] = node.line
        if node.origin is not None:
            out.origins[loc] = node.origin
        if isinstance(node.value, dict):
            return {k: walk(v, (*loc, k)) for k, v in node.value.items()}
        if isinstance(node.value, list):
            return [walk(v, (*loc, i)) for i, v in enumerate(node.value)]
        return node.value

    out.data = walk(root, ())
    return out


def _walk_to_parent(root: Lined, parts: list[str | int], name: str
                    ) -> tuple[Lined, list[str | int]]:
    node, loc = root, list[str | int]()
    for part in parts[:-1]:
        key = child_key(node, part, loc, name)
        node = node.value[key]
        loc.append(key)
    return node, loc


def set_path(root: Lined, path: str, value: Lined, name: str = "") -> tuple:
    """Put `value` at `path`; every part but the last must exist, and the last must exist
    in a list (a mapping may get a new key: the config's own validation names a wrong
    one). Returns the location set."""
    parts = split_path(path)
    parent, loc = _walk_to_parent(root, parts, name)
    last = parts[-1]
    if isinstance(parent.value, dict):
        try:
            key = child_key(parent, last, loc, name)
        except PathError:
            key = last
        parent.value[key] = value
        return (*loc, key)
    key = child_key(parent, last, loc, name)
    parent.value[key] = value
    return (*loc, key)


def remove_path(root: Lined, path: str, name: str = "") -> tuple:
    """Delete the key or list item at `path`, which must exist. Returns its location."""
    parts = split_path(path)
    parent, loc = _walk_to_parent(root, parts, name)
    key = child_key(parent, parts[-1], loc, name)
    del parent.value[key]
    return (*loc, key)
