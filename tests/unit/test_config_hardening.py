"""Config loading refuses hostile input with a message, and stays linear in the file's size.

Properties (hypothesis, bounded) for unit parsing and for load/dump round trips; the
refusals of odd bytes, tags, depth and size; CLI arguments checked as strictly as the
same config field.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.cli import main
from testbed.config import ConfigError, load_config, load_config_text
from testbed.config import loader as loader_module
from testbed.config.loader import MAX_DEPTH, parse_yaml_with_lines
from testbed.units import (
    UnitError,
    format_duration,
    format_rate,
    format_size,
    parse_duration_ns,
    parse_length_m,
    parse_rate_bps,
    parse_size_bytes,
)

BOUNDED = settings(max_examples=200, deadline=None)
GOOD = ("name: t\ntopology:\n  kind: single_switch\n  hosts: 2\n"
        "  host_link: {port: 100GBASE-CR1, length: 2m}\n")


# ---- units -------------------------------------------------------------------------

@BOUNDED
@given(st.integers(min_value=1, max_value=10**15))
def test_rate_format_parse_round_trip(bps: int) -> None:
    # format_rate prints %g (6 significant digits): the round trip is exact to that
    back = parse_rate_bps(format_rate(bps))
    assert abs(back - bps) <= bps * 1e-5


@BOUNDED
@given(st.integers(min_value=1, max_value=10**13))
def test_size_and_duration_round_trip(n: int) -> None:
    assert abs(parse_size_bytes(format_size(n)) - n) <= n * 1e-5
    assert abs(parse_duration_ns(format_duration(n)) - n) <= n * 1e-5


@BOUNDED
@given(st.floats(min_value=0, max_value=1e6, allow_nan=False),
       st.floats(min_value=0, max_value=1e6, allow_nan=False),
       st.sampled_from(["bps", "kbps", "Mbps", "Gbps", "Tbps"]))
def test_rate_parse_is_monotonic(a: float, b: float, unit: str) -> None:
    lo, hi = sorted((a, b))
    assert parse_rate_bps(f"{lo!r}{unit}") <= parse_rate_bps(f"{hi!r}{unit}")


@BOUNDED
@given(st.sampled_from(["ns", "us", "ms", "s"]), st.sampled_from(["ns", "us", "ms", "s"]))
def test_larger_time_unit_is_larger(u1: str, u2: str) -> None:
    order = ["ns", "us", "ms", "s"]
    if order.index(u1) < order.index(u2):
        assert parse_duration_ns(f"1{u1}") < parse_duration_ns(f"1{u2}")


@BOUNDED
@given(st.text(max_size=20))
def test_garbage_is_refused_with_unit_error_only(text: str) -> None:
    for parse in (parse_rate_bps, parse_duration_ns, parse_size_bytes, parse_length_m):
        try:
            value = parse(text)
        except UnitError as exc:
            assert str(exc)     # a message, never an empty one
        else:
            assert value >= 0


# ---- load / dump round trip --------------------------------------------------------

@settings(max_examples=25, deadline=None)
@given(hosts=st.integers(min_value=2, max_value=6), mtu=st.integers(min_value=4176,
                                                                     max_value=9216),
       length=st.sampled_from(["1m", "2m", "3.5m"]))
def test_config_dump_and_load_gives_the_same_model(hosts: int, mtu: int, length: str) -> None:
    text = (f"name: t\nmtu: {mtu}\ntopology:\n  kind: single_switch\n  hosts: {hosts}\n"
            f"  host_link: {{port: 100GBASE-CR1, length: {length}}}\n")
    first = load_config_text(text).fabric
    dumped = yaml.safe_dump(first.model_dump(mode="json", by_alias=True, exclude_unset=True))
    again = load_config_text(dumped).fabric
    assert again == first


# ---- refusals ----------------------------------------------------------------------

@pytest.mark.parametrize("tagged", [
    "description: !!python/object/apply:os.system [echo]",
    "description: !!python/name:os.system",
    "description: !!python/str x",
    "description: !!binary aGk=",
    "description: !custom x",
    "description: !custom {a: 1}",
    "description: !!set {a: null}",
    "description: !!python/tuple [1]",
])
def test_every_non_standard_tag_is_refused_never_dropped(tagged: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config_text(GOOD + tagged + "\n")
    (problem,) = info.value.problems
    assert problem.line == 6 and "YAML tags" in problem.message


def test_standard_tags_are_accepted() -> None:
    text = "name: !!str t\nmtu: !!int 9000\n" + GOOD.split("\n", 1)[1]
    assert load_config_text(text).fabric.mtu_bytes == 9000


@BOUNDED
@given(st.binary(max_size=200))
def test_arbitrary_bytes_never_crash(data: bytes) -> None:
    try:
        loader_module.parse_yaml_with_lines(loader_module.decode_config_bytes(data))
    except loader_module.YamlProblem as exc:
        assert exc.line >= 1 and exc.message


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 5000])
def test_deep_nesting_is_a_message(depth: int) -> None:
    with pytest.raises(loader_module.YamlProblem, match=f"deeper than {MAX_DEPTH}"):
        parse_yaml_with_lines("a: " + "[" * depth + "]" * depth)


def test_alias_bomb_is_refused() -> None:
    text = "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
    for i in range(1, 8):
        text += f"{chr(97 + i)}: &{chr(97 + i)} [{', '.join(['*' + chr(96 + i)] * 10)}]\n"
    with pytest.raises(loader_module.YamlProblem, match="aliases"):
        parse_yaml_with_lines(text)


def test_file_over_the_size_limit_is_refused(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("testbed.config.MAX_BYTES", 100)
    path = tmp_path / "big.yaml"
    path.write_text(GOOD + "#" * 200 + "\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "MB" in info.value.problems[0].message


def test_build_work_is_linear_in_the_number_of_entries() -> None:
    # the line map holds one entry per key and list item: no quadratic bookkeeping
    counts = []
    for n in (100, 1000):
        _, lines = parse_yaml_with_lines("l:\n" + "".join(f"  - {{a: {i}, b: x}}\n"
                                                          for i in range(n)))
        counts.append(len(lines.lines))
    assert counts[1] - 2 == 10 * (counts[0] - 2)


# ---- CLI arguments as strict as the config -----------------------------------------

@pytest.mark.parametrize("args", [["--length", "0"], ["--length", "0m"],
                                  ["--length", "2m", "--mtu", "100"],
                                  ["--length", "2m", "--mtu", "99999"]])
def test_phy_refuses_what_a_config_refuses(args: list[str],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["phy", "100GBASE-CR1", *args]) == 2
    err = capsys.readouterr().err
    assert "same check as" in err and "Traceback" not in err


@pytest.mark.parametrize("argv", [["down", "../etc"], ["down", "Lab"], ["status", "a b"],
                                  ["status", "x" * 40]])
def test_lab_names_on_the_command_line_are_checked_as_name_is(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    # before root or any file: a name like ../etc never reaches a path under /run/testbed
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "same check as `name:`" in err and "Traceback" not in err


@pytest.mark.parametrize("argv", [["calibrate", "--hosts", "3"], ["calibrate", "--hosts", "0"],
                                  ["calibrate", "--seconds", "0"],
                                  ["calibrate", "--seconds", "inf"],
                                  ["smoke", "--seconds", "nan"], ["smoke", "--seconds", "-1"]])
def test_counts_and_seconds_are_refused_before_anything_runs(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "error: argument" in capsys.readouterr().err
