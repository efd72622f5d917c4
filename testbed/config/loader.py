"""Load YAML while remembering the line of every mapping key and list item.

Validation errors come back from pydantic as a location tuple
(`links`, 3, `port`); `LineMap.line_for` turns that into the line a user
can open in an editor. The loader refuses what YAML allows but a fabric
config never means: duplicate keys (the later one would silently win),
tags other than the standard scalar and collection ones (`!!python/...`,
`!custom`), non-string keys, several documents in one file. It also
refuses what would otherwise crash or stall it: bytes that are not UTF-8,
control characters, nesting deeper than `MAX_DEPTH`, files larger than
`MAX_BYTES`, and aliases that expand to more than `MAX_ALIAS_VALUES`.

Parsing walks libyaml's event stream with an explicit stack (no recursion,
so deep nesting is a message, not a RecursionError) and is linear in the
file's size.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

MAX_BYTES = 10_000_000
MAX_DEPTH = 64
MAX_ALIAS_VALUES = 100_000

_YAML = "tag:yaml.org,2002:"
_SCALAR_TAGS = {f"{_YAML}{t}" for t in ("str", "int", "float", "bool", "null")}
# What plain (untagged) scalars resolve to; timestamps are left for validation to refuse.
_IMPLICIT_TAGS = _SCALAR_TAGS | {f"{_YAML}timestamp", f"{_YAML}merge", f"{_YAML}value"}
_MAP_TAG, _SEQ_TAG = f"{_YAML}map", f"{_YAML}seq"
# Everything YAML 1.1 calls printable, plus tab, LF and CR (PyYAML's reader's set).
_CONTROL_RE = re.compile("[^\x09\x0a\x0d\x20-\x7e\x85\xa0-\ud7ff\ue000-\ufffd"
                         "\U00010000-\U0010ffff]")
_Parser: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)   # libyaml if built with it


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


def _shown_tag(tag: str) -> str:
    return "!!" + tag[len(_YAML):] if tag.startswith(_YAML) else tag


def _tag_problem(line: int, tag: str, path: tuple) -> YamlProblem:
    return YamlProblem(line, f"YAML tags such as {_shown_tag(tag)} are not allowed in configs; "
                             "remove the tag and write the plain value (only !!str, !!int, "
                             "!!float, !!bool, !!null, !!map and !!seq are accepted)", path)


_CONSTRUCTOR = yaml.constructor.SafeConstructor()


def _scalar(event: Any, path: tuple, resolver: yaml.resolver.Resolver) -> Any:
    line = event.start_mark.line + 1
    tag = event.tag
    if tag is None or tag == "!":
        tag = resolver.resolve(yaml.ScalarNode, event.value, event.implicit)
        if tag not in _IMPLICIT_TAGS:
            raise _tag_problem(line, tag, path)
    elif tag not in _SCALAR_TAGS:
        raise _tag_problem(line, tag, path)
    if tag == f"{_YAML}merge":
        raise YamlProblem(line, "YAML merge keys (<<) are not supported; write the fields out",
                          path)
    if tag == f"{_YAML}value":     # a lone '=' (YAML 1.1's value key): just text
        return event.value
    node = yaml.ScalarNode(tag, event.value, event.start_mark, event.end_mark, event.style)
    try:
        return _CONSTRUCTOR.yaml_constructors[tag](_CONSTRUCTOR, node)
    except (yaml.YAMLError, ValueError) as exc:   # '!!int abc', '!!float x'
        raise YamlProblem(line, f"cannot read {event.value!r} as {_shown_tag(tag)}; "
                                f"fix the value or remove the tag ({exc})", path) from None


@dataclass
class _Frame:
    """A mapping or list being built, with the key its parent holds it under."""

    value: dict | list
    path: tuple
    anchor: str | None
    key: Any = None            # mapping: the key whose value comes next
    has_key: bool = False
    values: int = 1            # values inside, counting alias expansions


def _key_problem(line: int, what: str, path: tuple) -> YamlProblem:
    return YamlProblem(line, f"mapping keys must be plain names, got {what}", path)


class _Builder:
    """Plain Python data from a YAML event stream, iteratively, recording lines."""

    def __init__(self, lines: LineMap) -> None:
        self.lines = lines
        self.resolver = yaml.resolver.Resolver()
        self.stack: list[_Frame] = []
        self.anchors: dict[str, tuple[Any, int]] = {}    # anchor -> (value, values inside)
        self.alias_values = 0
        self.documents = 0
        self.result: Any = None

    def run(self, events: Any) -> Any:
        handlers = {yaml.DocumentStartEvent: self._document, yaml.ScalarEvent: self._scalar,
                    yaml.MappingStartEvent: self._start, yaml.SequenceStartEvent: self._start,
                    yaml.MappingEndEvent: self._end, yaml.SequenceEndEvent: self._end,
                    yaml.AliasEvent: self._alias}
        for event in events:
            handler = handlers.get(type(event))
            if handler is not None:
                handler(event, event.start_mark.line + 1 if event.start_mark else 1)
        return self.result

    def _child_path(self) -> tuple:
        if not self.stack:
            return ()
        top = self.stack[-1]
        return top.path + ((len(top.value),) if isinstance(top.value, list) else (top.key,))

    def _expects_key(self) -> bool:
        return bool(self.stack) and isinstance(self.stack[-1].value, dict) \
            and not self.stack[-1].has_key

    def _place(self, value: Any, line: int, count: int, shown: str) -> None:
        if not self.stack:
            self.lines.lines.setdefault((), line)
            self.result = value
            return
        top = self.stack[-1]
        top.values += count
        if isinstance(top.value, list):
            self.lines.lines.setdefault(top.path + (len(top.value),), line)
            top.value.append(value)
        elif not top.has_key:
            self._key(top, value, line, shown)
        else:
            self.lines.lines.setdefault(top.path + (top.key,), line)
            top.value[top.key] = value
            top.has_key = False

    def _key(self, top: _Frame, key: Any, line: int, shown: str) -> None:
        if not isinstance(key, str | int) or isinstance(key, bool):
            raise _key_problem(line, shown, top.path)
        if key in top.value:
            raise YamlProblem(line, f"duplicate key {key!r} (first at line "
                                    f"{self.lines.lines[top.path + (key,)]}); remove one of "
                                    "them", top.path + (key,))
        self.lines.lines[top.path + (key,)] = line
        top.key, top.has_key = key, True

    def _document(self, event: Any, line: int) -> None:
        self.documents += 1
        if self.documents > 1:
            raise YamlProblem(line, "the file holds more than one YAML document (---); "
                                    "keep one fabric per file")

    def _scalar(self, event: Any, line: int) -> None:
        path = self.stack[-1].path if self._expects_key() else self._child_path()
        value = _scalar(event, path, self.resolver)
        if event.anchor:
            self.anchors[event.anchor] = (value, 1)
        self._place(value, line, 1, repr(event.value))

    def _start(self, event: Any, line: int) -> None:
        is_map = isinstance(event, yaml.MappingStartEvent)
        path = self._child_path()
        if self._expects_key():
            raise _key_problem(line, "a mapping" if is_map else "a list", self.stack[-1].path)
        if event.tag not in (None, "!", _MAP_TAG if is_map else _SEQ_TAG):
            raise _tag_problem(line, event.tag, path)
        if len(self.stack) >= MAX_DEPTH:
            raise YamlProblem(line, f"nesting is deeper than {MAX_DEPTH} levels; a fabric "
                                    "config needs only a few, so flatten this value", path[:4])
        self.lines.lines.setdefault(path, line)
        self.stack.append(_Frame({} if is_map else [], path, event.anchor))

    def _end(self, event: Any, line: int) -> None:
        done = self.stack.pop()
        if done.anchor:
            self.anchors[done.anchor] = (done.value, done.values)
        self._place(done.value, line, done.values, describe(done.value))

    def _alias(self, event: Any, line: int) -> None:
        if event.anchor not in self.anchors:
            raise YamlProblem(line, f"alias *{event.anchor} names no anchor "
                                    f"(&{event.anchor}) above it; define the anchor first",
                              self._child_path())
        value, count = self.anchors[event.anchor]
        self.alias_values += count
        if self.alias_values > MAX_ALIAS_VALUES:
            raise YamlProblem(line, f"aliases (*name) expand to more than {MAX_ALIAS_VALUES} "
                                    "values; write the values out or use fewer aliases",
                              self._child_path())
        self._place(value, line, count, describe(value))


def _build(events: Any, lines: LineMap) -> Any:
    return _Builder(lines).run(events)


def describe(value: Any) -> str:
    return "a mapping" if isinstance(value, dict) else "a list" if isinstance(value, list) \
        else repr(value)


def decode_config_bytes(data: bytes) -> str:
    """UTF-8 text of a config file, or YamlProblem naming the line and byte offset."""
    if len(data) > MAX_BYTES:
        raise YamlProblem(1, too_big(len(data)))
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise YamlProblem(1, "the file is UTF-16 text; save it as UTF-8")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise YamlProblem(line, f"not UTF-8 text: byte 0x{data[exc.start]:02x} at offset "
                                f"{exc.start} (column {column}) cannot be decoded; save the "
                                "file as UTF-8") from None


def too_big(n_bytes: int) -> str:
    return (f"the file is {n_bytes / 1e6:.1f} MB, more than the {MAX_BYTES // 1_000_000} MB "
            "a config may be; describe large fabrics with topology: (leaf_spine, ring) "
            "instead of listing every node")


def load_yaml_with_lines(path: Path) -> tuple[Any, LineMap]:
    """Read `path`; return plain Python data (None if empty) and the line of every location."""
    return parse_yaml_with_lines(decode_config_bytes(path.read_bytes()))


def parse_yaml_with_lines(text: str) -> tuple[Any, LineMap]:
    """Plain Python data (None if empty) and the line of every location; YamlProblem if bad."""
    if len(text) > MAX_BYTES:
        raise YamlProblem(1, too_big(len(text.encode("utf-8", "surrogatepass"))))
    bad = _CONTROL_RE.search(text)
    if bad:
        pos = bad.start()
        line = text.count("\n", 0, pos) + 1
        column = pos - (text.rfind("\n", 0, pos) + 1) + 1
        raise YamlProblem(line, f"control character U+{ord(bad.group()):04X} at column "
                                f"{column}; remove it (only tab, newline and carriage "
                                "return may appear in a config)")
    lines = LineMap()
    try:
        return _build(yaml.parse(text, Loader=_Parser), lines), lines
    except yaml.YAMLError as exc:
        first = exc
    # libyaml's syntax messages are terser than PyYAML's, which the messages above were
    # worded for: on a syntax error only, parse again with the pure-Python parser.
    try:
        _build(yaml.parse(text, Loader=yaml.SafeLoader), LineMap())
    except yaml.YAMLError as exc:
        first = exc
    if isinstance(first, yaml.MarkedYAMLError):
        raise YamlProblem(*_syntax_problem(first)) from None
    raise YamlProblem(1, f"not valid YAML: {first}") from None


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
