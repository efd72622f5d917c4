"""The YAML line loader: a line for every key and list item, and YAML a config never means."""

from __future__ import annotations

import textwrap

import pytest

from testbed.config import ConfigError, load_config, load_config_text
from testbed.config.errors import Problem, format_loc
from testbed.config.loader import LineMap, YamlProblem, parse_yaml_with_lines

NESTED = textwrap.dedent("""\
    # a comment first
    name: lab
    qos:
      default:
        buffer:
          3: 2MB
        pfc:
          xoff: 1MB
    nodes:
      - name: sw1
        role: switch
      - {name: h1, role: host}
    links:
      -
        a: h1
        b: sw1
    traffic_classes:
      - tc: 0
        dscp:
          - 10
          - 12
""")


def _lines(text: str) -> LineMap:
    return parse_yaml_with_lines(text)[1]


def _problem(text: str) -> YamlProblem:
    with pytest.raises(YamlProblem) as info:
        parse_yaml_with_lines(text)
    return info.value


# ---- line numbers ----------------------------------------------------------------

def test_data_is_plain_python() -> None:
    data, _ = parse_yaml_with_lines(NESTED)
    assert data["qos"]["default"]["buffer"] == {3: "2MB"}
    assert data["nodes"][1] == {"name": "h1", "role": "host"}
    assert data["traffic_classes"][0]["dscp"] == [10, 12]


@pytest.mark.parametrize(("loc", "line"), [
    (("name",), 2),
    (("qos",), 3),
    (("qos", "default"), 4),
    (("qos", "default", "buffer", 3), 6),
    (("qos", "default", "pfc", "xoff"), 8),
])
def test_nested_keys_have_the_line_of_the_key(loc: tuple, line: int) -> None:
    assert _lines(NESTED).line_for(loc) == line


@pytest.mark.parametrize(("loc", "line"), [
    (("nodes", 0), 10),            # block mapping item: the line of its '- '
    (("nodes", 0, "role"), 11),
    (("nodes", 1), 12),            # flow mapping item
    (("nodes", 1, "role"), 12),
    (("links", 0), 15),            # '-' alone on a line: the item starts on the next one
    (("links", 0, "b"), 16),
    (("traffic_classes", 0, "dscp", 1), 21),
])
def test_list_items_have_the_line_where_they_start(loc: tuple, line: int) -> None:
    assert _lines(NESTED).line_for(loc) == line


def test_a_location_the_file_does_not_spell_takes_its_nearest_ancestor() -> None:
    lines = _lines(NESTED)
    assert lines.line_for(("qos", "default", "ecn", "kmin")) == 4
    assert lines.line_for(("nodes", 0, "nosuchfield")) == 10
    assert lines.line_for(("topology", "kind")) == 2      # the top-level mapping's first line
    assert lines.line_for(()) == 2


def test_numeric_keys_are_found_whether_spelt_as_numbers_or_strings() -> None:
    # Plan-stage problems name fields by dotted paths ("buffer.3").
    lines = _lines(NESTED)
    assert lines.line_for(("qos", "default", "buffer", "3")) == 6
    assert lines.line_for(("qos", "default", "buffer", 3)) == 6


def test_an_empty_document_is_none() -> None:
    assert parse_yaml_with_lines("")[0] is None
    assert parse_yaml_with_lines("# only a comment\n")[0] is None


# ---- YAML a config never means ---------------------------------------------------------

def test_duplicate_top_level_key_names_both_lines() -> None:
    p = _problem("name: a\ndilation: 10\nname: b\n")
    assert p.line == 3
    assert p.loc == ("name",)
    assert "duplicate key 'name' (first at line 1)" in p.message


def test_duplicate_nested_key_has_its_full_path() -> None:
    p = _problem("qos:\n  default:\n    pfc: {xoff: 1MB}\n    pfc: {xon: 1KB}\n")
    assert (p.line, p.loc) == (4, ("qos", "default", "pfc"))


def test_duplicate_key_inside_a_list_item() -> None:
    p = _problem("nodes:\n  - {name: a, role: host, name: b}\n")
    assert (p.line, p.loc) == (2, ("nodes", 0, "name"))


def test_same_key_in_different_mappings_is_fine() -> None:
    data, _ = parse_yaml_with_lines("a: {x: 1}\nb: {x: 2}\n")
    assert data == {"a": {"x": 1}, "b": {"x": 2}}


def test_tags_are_refused() -> None:
    p = _problem("name: lab\ndilation: !fast 10\n")
    assert (p.line, p.loc) == (2, ("dilation",))
    assert "YAML tags" in p.message


def test_merge_keys_are_refused() -> None:
    p = _problem("base: &b {port: x}\nlink:\n  <<: *b\n")
    assert (p.line, p.loc) == (3, ("link",))
    assert "merge keys" in p.message


@pytest.mark.parametrize("text", ["? [a, b]\n: 1\n", "null: 1\n", "true: 1\n"])
def test_keys_must_be_plain_names(text: str) -> None:
    p = _problem(text)
    assert p.message.startswith("mapping keys must be plain names, got ")
    assert "Node(" not in p.message


def test_syntax_error_says_where_the_broken_construct_starts() -> None:
    p = _problem("name: lab\ntopology: {kind: ring\n")
    assert p.line == 3
    assert p.message.startswith("not valid YAML: ")
    assert "the end of the file" in p.message
    assert "starts at line 2" in p.message


def test_tab_indentation_says_to_use_spaces() -> None:
    p = _problem("name: lab\ntopology:\n\tkind: ring\n")
    assert p.line == 3
    assert "indent with spaces" in p.message


# ---- through load_config ------------------------------------------------------------------

def test_config_error_lists_problems_in_line_order() -> None:
    text = "name: lab\nmtu: 1\nzzz: 1\naaa: 2\n"
    with pytest.raises(ConfigError) as info:
        load_config_text(text, "f.yaml")
    assert [(p.line, format_loc(p.loc)) for p in info.value.problems] == [
        (2, "mtu"), (3, "zzz"), (4, "aaa")]
    assert info.value.lines()[0].startswith("f.yaml:2: mtu: ")


def test_yaml_problem_becomes_a_config_error_with_its_location() -> None:
    with pytest.raises(ConfigError) as info:
        load_config_text("name: a\nname: b\n", "f.yaml")
    assert info.value.lines() == [
        "f.yaml:2: name: duplicate key 'name' (first at line 1); remove one of them"]


def test_missing_file_is_a_config_error(tmp_path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "nope.yaml")
    assert "cannot read" in info.value.lines()[0]


def test_loaded_config_keeps_the_line_map(repo) -> None:
    loaded = load_config(repo / "configs" / "default.yaml")
    assert loaded.lines.line_for(("topology", "kind")) > 1
    assert loaded.fabric.name == "default"


@pytest.mark.parametrize(("loc", "text"), [
    (("links", 3, "port"), "links[3].port"),
    (("qos", "default", "buffer", 3), "qos.default.buffer[3]"),
    (("qos", "default", "buffer", "3"), "qos.default.buffer[3]"),
    ((), "(top level)"),
])
def test_format_loc(loc: tuple, text: str) -> None:
    assert format_loc(loc) == text
    assert Problem(7, loc, "m").format("f.yaml") == f"f.yaml:7: {text}: m"
