"""The control variant's `set:` and `remove:` paths: keys, list items by index or by name,
new keys in a mapping, what an unknown path says, and the lines the variant keeps."""

from __future__ import annotations

import pytest

from testbed.config.loader import parse_yaml_with_lines
from testbed.incident.paths import (
    PathError,
    from_lined,
    lookup,
    remove_path,
    set_path,
    split_path,
    to_lined,
)

DOC = """\
workload:
  traffic:
    - name: incast
      kind: udp_incast
    - name: victim
      kind: udp_pairs
qos:
  default:
    buffer: {3: 1MB}
"""


def _tree():
    data, lines = parse_yaml_with_lines(DOC)
    return to_lined(data, lines)


def _value(path: str, value: object, line: int = 99):
    root = _tree()
    node = to_lined(value, parse_yaml_with_lines("x: 1")[1])
    node.line, node.origin = line, path
    loc = set_path(root, path, node)
    return from_lined(root), loc


@pytest.mark.parametrize(("path", "parts"), [
    ("workload.traffic.incast.cc", ["workload", "traffic", "incast", "cc"]),
    ("links[0].length", ["links", 0, "length"]),
    ("links.0.length", ["links", "0", "length"]),
    ("events", ["events"]),
])
def test_paths_split_on_dots_and_brackets(path: str, parts: list) -> None:
    assert split_path(path) == parts


def test_a_list_item_is_found_by_its_name_or_its_index() -> None:
    out, loc = _value("workload.traffic.victim.kind", "roce_pairs")
    assert loc == ("workload", "traffic", 1, "kind")
    assert out.data["workload"]["traffic"][1]["kind"] == "roce_pairs"
    out, loc = _value("workload.traffic.0.cc", "dcqcn")
    assert loc == ("workload", "traffic", 0, "cc") and out.data["workload"]["traffic"][0]["cc"]


def test_a_set_value_carries_the_line_of_its_set_entry_and_the_rest_keep_theirs() -> None:
    out, _ = _value("workload.traffic.incast.cc", "dcqcn", line=42)
    assert out.lines.line_for(("workload", "traffic", 0, "cc")) == 42
    assert out.origins == {("workload", "traffic", 0, "cc"): "workload.traffic.incast.cc"}
    assert out.lines.line_for(("workload", "traffic", 1, "kind")) == 6
    assert out.lines.line_for(("qos", "default", "buffer", 3)) == 9


def test_a_mapping_may_get_a_new_key_and_a_whole_value_may_be_replaced() -> None:
    out, _ = _value("events", [])
    assert out.data["events"] == []
    out, _ = _value("qos.default.buffer.3", "2MB")       # a numeric key, spelt with dots
    assert out.data["qos"]["default"]["buffer"] == {3: "2MB"}


def test_remove_deletes_a_key_or_a_list_item_and_later_lines_follow_the_item() -> None:
    root = _tree()
    remove_path(root, "workload.traffic.incast")
    out = from_lined(root)
    assert [t["name"] for t in out.data["workload"]["traffic"]] == ["victim"]
    # the victim is now item 0, and its line is still the one it has in the file
    assert out.lines.line_for(("workload", "traffic", 0, "kind")) == 6
    remove_path(root, "qos")
    assert "qos" not in from_lined(root).data


@pytest.mark.parametrize(("path", "message"), [
    ("workload.trafic.incast.cc", "workload has no 'trafic'; did you mean 'traffic'? it has: "
                                  "traffic"),
    ("workload.traffic.incats.cc", "workload.traffic has no item named 'incats'; did you mean "
                                   "'incast'? its items: incast, victim"),
    ("workload.traffic.7.cc", "workload.traffic has 2 item(s); index 7 is past the end"),
    ("workload.traffic.incast.kind.x", "workload.traffic[0].kind is a value ('udp_incast'), "
                                       "not a mapping or a list; it has no 'x'"),
    ("workload.traffic.nobody", "workload.traffic has no item named 'nobody'"),
    ("", "is not a dotted path"),
    ("a..b", "empty or malformed part"),
])
def test_a_path_that_leads_nowhere_says_what_is_there(path: str, message: str) -> None:
    with pytest.raises(PathError, match=message.replace("?", r"\?").replace("(", r"\(")
                       .replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
        set_path(_tree(), path, to_lined(1, parse_yaml_with_lines("x: 1")[1]))


def test_remove_needs_the_path_to_exist() -> None:
    with pytest.raises(PathError, match="qos.default has no 'pfc'"):
        remove_path(_tree(), "qos.default.pfc")


def test_lookup_reads_plain_data_the_same_way() -> None:
    data = {"workloads": [{"name": "incast", "results": [{"gbps": 3.5}]}]}
    assert lookup(data, "workloads.incast.results.0.gbps") == (
        3.5, ("workloads", 0, "results", 0, "gbps"))
    with pytest.raises(PathError, match="summary.workloads has no item named 'x'"):
        lookup(data, "workloads.x", "summary")
