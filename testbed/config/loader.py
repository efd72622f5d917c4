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
        """Line of `loc`, or of its nearest ancestor the file spells out.

        A mapping key written as a number (`buffer: {3: 1MB}`) may come back
        as the string '3' from dotted paths; both spellings find it.
        """
        loc = tuple(loc)
        while loc:
            for candidate in (loc, _other_key_spelling(loc)):
                if candidate in self.lines:
                    return self.lines[candidate]
            loc = loc[:-1]
        return self.lines.get((), 1)


def _other_key_spelling(loc: tuple) -> tuple:
    last = loc[-1]
    if isinstance(last, str) and last.isdigit():
        return (*loc[:-1], int(last))
    if isinstance(last, int) and not isinstance(last, bool):
        return (*loc[:-1], str(last))
    return loc


class YamlProblem(Exception):
    """YAML that cannot be read as a config; carries the line of the problem."""

    def __init__(self, line: int, message: str, loc: tuple = ()) -> None:
        super().__init__(message)
        self.line = line
        self.message = message
        self.loc = loc


def _scalar(node: yaml.ScalarNode) -> Any:
    return yaml.constructor.SafeConstructor().construct_object(node)


def _to_python(node: yaml.Node, path: tuple, lines: LineMap) -> Any:
    lines.lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        out: dict[str | int, Any] = {}   # int keys: qos buffers by traffic class
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise YamlProblem(key_node.start_mark.line + 1,
                                  "YAML merge keys (<<) are not supported; write the fields out",
                                  path)
            key = _scalar(key_node) if isinstance(key_node, yaml.ScalarNode) else None
            if not isinstance(key, str | int) or isinstance(key, bool):
                shown = (repr(key_node.value) if isinstance(key_node, yaml.ScalarNode)
                         else "a list" if isinstance(key_node, yaml.SequenceNode)
                         else "a mapping")
                raise YamlProblem(key_node.start_mark.line + 1,
                                  f"mapping keys must be plain names, got {shown}", path)
            if key in out:
                raise YamlProblem(key_node.start_mark.line + 1,
                                  f"duplicate key {key!r} (first at line "
                                  f"{lines.lines[path + (key,)]}); remove one of them",
                                  path + (key,))
            lines.lines[path + (key,)] = key_node.start_mark.line + 1
            out[key] = _to_python(value_node, path + (key,), lines)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_to_python(item, path + (i,), lines) for i, item in enumerate(node.value)]
    if isinstance(node, yaml.ScalarNode):
        if node.tag.startswith("!"):
            raise YamlProblem(node.start_mark.line + 1,
                              f"YAML tags such as {node.tag} are not allowed in configs; "
                              "write the plain value", path)
        return _scalar(node)
    raise YamlProblem(node.start_mark.line + 1, "unsupported YAML node", path)


def load_yaml_with_lines(path: Path) -> tuple[Any, LineMap]:
    """Read `path`; return plain Python data (None if empty) and the line of every location."""
    text = path.read_text(encoding="utf-8")
    return parse_yaml_with_lines(text)


def parse_yaml_with_lines(text: str) -> tuple[Any, LineMap]:
    lines = LineMap()
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        raise YamlProblem(*_syntax_problem(exc)) from None
    if node is None:
        return None, lines
    return _to_python(node, (), lines), lines


def _syntax_problem(exc: yaml.MarkedYAMLError) -> tuple[int, str]:
    """Line and message for a YAML syntax error, saying where the broken construct began."""
    mark = exc.problem_mark or exc.context_mark
    line = mark.line + 1 if mark else 1
    problem = exc.problem or str(exc)
    for token, words in _TOKEN_WORDS.items():
        problem = problem.replace(token, words)
    if "'\\t'" in problem:   # PyYAML: "found character '\\t' that cannot start any token"
        problem += "; indent with spaces, not tabs"
    if exc.context and exc.context_mark and exc.context_mark.line + 1 != line:
        problem += f" ({exc.context} that starts at line {exc.context_mark.line + 1})"
    return line, f"not valid YAML: {problem}"


# PyYAML's token names, in words a config author knows.
_TOKEN_WORDS = {
    "'<stream end>'": "the end of the file",
    "'<scalar>'": "a value",
    "'<block end>'": "the end of an indented block",
    "'<block mapping start>'": "an indented mapping",
}
