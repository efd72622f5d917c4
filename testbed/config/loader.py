"""Load YAML while remembering the line of every mapping key and list item.

Validation errors come back from pydantic as a location tuple
(`links`, 3, `port`); `LineMap.line_for` turns that into the line a user
can open in an editor. The loader refuses what YAML allows but a fabric
config never means: duplicate keys (the later one would silently win),
tags, and non-string keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


@dataclass
class LineMap:
    """Maps a location path (tuple of keys and indices) to a 1-based line."""

    lines: dict[tuple, int] = field(default_factory=dict)

    def line_for(self, loc: tuple) -> int:
        loc = tuple(loc)
        while loc:
            if loc in self.lines:
                return self.lines[loc]
            loc = loc[:-1]
        return self.lines.get((), 1)


class YamlProblem(Exception):
    """YAML that cannot be read as a config; carries the line of the problem."""

    def __init__(self, line: int, message: str) -> None:
        super().__init__(message)
        self.line = line
        self.message = message


def _scalar(node: yaml.ScalarNode) -> Any:
    return yaml.constructor.SafeConstructor().construct_object(node)


def _to_python(node: yaml.Node, path: tuple, lines: LineMap) -> Any:
    lines.lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise YamlProblem(key_node.start_mark.line + 1,
                                  "YAML merge keys (<<) are not supported; write the fields out")
            key = _scalar(key_node) if isinstance(key_node, yaml.ScalarNode) else None
            if not isinstance(key, str | int) or isinstance(key, bool):
                raise YamlProblem(key_node.start_mark.line + 1,
                                  f"mapping keys must be names, got {key_node.value!r}")
            if key in out:
                raise YamlProblem(key_node.start_mark.line + 1,
                                  f"duplicate key {key!r} (first at line "
                                  f"{lines.lines[path + (key,)]}); remove one of them")
            lines.lines[path + (key,)] = key_node.start_mark.line + 1
            out[key] = _to_python(value_node, path + (key,), lines)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_to_python(item, path + (i,), lines) for i, item in enumerate(node.value)]
    if isinstance(node, yaml.ScalarNode):
        if node.tag.startswith("!"):
            raise YamlProblem(node.start_mark.line + 1,
                              f"YAML tags such as {node.tag} are not allowed in configs")
        return _scalar(node)
    raise YamlProblem(node.start_mark.line + 1, "unsupported YAML node")


def load_yaml_with_lines(path: Path) -> tuple[Any, LineMap]:
    """Read `path`; return plain Python data and the line of every location."""
    text = path.read_text(encoding="utf-8")
    return parse_yaml_with_lines(text)


def parse_yaml_with_lines(text: str) -> tuple[Any, LineMap]:
    lines = LineMap()
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else 1
        raise YamlProblem(line, f"not valid YAML: {exc.problem or exc}") from None
    if node is None:
        return {}, lines
    return _to_python(node, (), lines), lines
