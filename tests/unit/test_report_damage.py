"""`testbed report` and `testbed compare` on damaged run directories (issue 18, item 3).

Every damage of tests/unit/run_damage.DAMAGES is applied in turn to a copy of a
synthetic run directory (the one test_report builds the way `testbed run` writes
one). The rule (docs/report.md, "Damaged run directories"): exit 2 naming the file,
or a report whose notes name the damage; never a traceback, and every format gives
the same answer. Hypothesis then feeds random bytes and random JSON to each file.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import testbed.cli
from tests.unit.run_damage import DAMAGES, FILES
from tests.unit.test_report import make_run_dir

# what a damage must leave visible: a word of the refusal or of the report's note
NAMED = {
    "summary-no-ports": "ports is missing",
    "summary-dilation-zero": "dilation 0 is not a factor",
    "summary-dilation-disagrees": "inconsistent dilation",
    "summary-duration-nan": "duration_wall_s nan",
    "summary-port-text-value": "'lots'",
    "counters-events-bad-json": "table events row",
    "counters-results-bad-json": "table results row",
    "counters-points-text-value": "table points row",
    "counters-drop-events": "table events is missing",
}


@pytest.fixture(scope="module")
def template_run(tmp_path_factory) -> Path:
    return make_run_dir(tmp_path_factory.mktemp("runs"), name="damage")


def _copy(template: Path, root: Path) -> Path:
    return Path(shutil.copytree(template, root / template.name))


def _report(run_dir: Path, fmt: str, capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = testbed.cli.main(["report", str(run_dir), "--format", fmt])
    err = capsys.readouterr().err
    return code, err


def _outcome(run_dir: Path, fmt: str, capsys) -> tuple[int, str]:
    """(exit code, what the user is told: stderr on exit 2, the report's text on exit 0)."""
    code, err = _report(run_dir, fmt, capsys)
    if code == 0:
        text = (run_dir / ("report.md" if fmt == "html" else "metrics.prom")).read_text()
        return code, text
    return code, err


@pytest.mark.parametrize("name,apply", DAMAGES, ids=[n for n, _ in DAMAGES])
def test_damaged_run_dir_is_refused_or_noted_alike_in_every_format(
        name, apply, template_run: Path, tmp_path: Path, capsys) -> None:
    outcomes = {}
    for fmt in ("html", "prometheus"):
        run_dir = _copy(template_run, tmp_path / fmt)
        apply(run_dir)
        outcomes[fmt] = _outcome(run_dir, fmt, capsys)
        code, text = outcomes[fmt]
        assert code in (0, 2), f"{name} --format {fmt}: exit {code}: {text}"
        assert "Traceback" not in text
        if code == 2:
            assert "please report it" not in text, f"{name}: not checked by the reader: {text}"
            assert str(run_dir) in text
        if fmt == "html" and code == 0:
            assert "nan s" not in text and "inf s" not in text
    assert outcomes["html"][0] == outcomes["prometheus"][0], (name, outcomes)
    if name in NAMED:
        assert NAMED[name] in outcomes["html"][1], (name, outcomes["html"][1])
        if outcomes["html"][0] == 2:
            assert NAMED[name] in outcomes["prometheus"][1]
        else:
            notes = [line for line in outcomes["prometheus"][1].splitlines()
                     if line.startswith("testbed_run_reader_notes{")]
            assert notes and not notes[0].endswith(" 0"), (name, notes)


def test_report_prints_the_summary_dilation_unchanged_and_no_note_when_it_agrees(
        template_run: Path, tmp_path: Path, capsys) -> None:
    run_dir = _copy(template_run, tmp_path)
    assert _report(run_dir, "html", capsys)[0] == 0
    md = (run_dir / "report.md").read_text()
    assert "inconsistent dilation" not in md and "run directory:" not in md
    d = json.loads((run_dir / "summary.json").read_text())["dilation"]
    assert f"{d} (the fabric ran" in md


def test_dilation_zero_uses_the_recorded_factor_and_says_so(
        template_run: Path, tmp_path: Path, capsys) -> None:
    run_dir = _copy(template_run, tmp_path)
    path = run_dir / "summary.json"
    summary = json.loads(path.read_text())
    good = summary["dilation"]
    path.write_text(json.dumps({**summary, "dilation": 0}))
    assert _report(run_dir, "html", capsys)[0] == 0
    md = (run_dir / "report.md").read_text()
    assert f"{good} (the fabric ran" in md and "1 (the fabric ran" not in md
    assert f"dilation 0 is not a factor >= 1; counters.sqlite's {good} was used" in md


def test_nan_duration_is_unknown_not_nan(template_run: Path, tmp_path: Path, capsys) -> None:
    run_dir = _copy(template_run, tmp_path)
    path = run_dir / "summary.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "duration_wall_s": float("nan")}))
    assert _report(run_dir, "html", capsys)[0] == 0
    md = (run_dir / "report.md").read_text()
    assert "nan s" not in md and "unknown" in md
    assert _report(run_dir, "prometheus", capsys)[0] == 0
    assert "testbed_run_duration_wall_seconds" not in (run_dir / "metrics.prom").read_text()


def test_compare_refuses_a_damaged_run_with_exit_2(template_run: Path, tmp_path: Path,
                                                   capsys) -> None:
    good = _copy(template_run, tmp_path / "a")
    bad = _copy(template_run, tmp_path / "b")
    dict(DAMAGES)["counters-results-bad-json"](bad)
    code = testbed.cli.main(["compare", str(good), str(bad), "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "table results row" in err and "Traceback" not in err


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12)


def _fuzz_once(template: Path, root: Path, name: str, content: bytes, capsys) -> None:
    shutil.rmtree(root, ignore_errors=True)
    run_dir = _copy(template, root)
    (run_dir / name).write_bytes(content)
    codes = set()
    for fmt in ("html", "prometheus"):
        code, text = _report(run_dir, fmt, capsys)
        assert code in (0, 2), (name, content[:80], fmt, text)
        assert "please report it" not in text, (name, content[:80], text)
        codes.add(code)
    assert len(codes) == 1


@settings(max_examples=10, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(name=st.sampled_from(FILES), content=st.binary(max_size=200))
def test_fuzz_random_bytes_in_each_file(name, content, template_run: Path, tmp_path: Path,
                                        capsys) -> None:
    _fuzz_once(template_run, tmp_path / "fuzz", name, content, capsys)


@settings(max_examples=10, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(name=st.sampled_from([f for f in FILES if f.endswith(".json")]), data=_json)
def test_fuzz_random_json_in_each_file(name, data, template_run: Path, tmp_path: Path,
                                       capsys) -> None:
    _fuzz_once(template_run, tmp_path / "fuzz", name, json.dumps(data).encode(), capsys)


@settings(max_examples=10, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(key=st.sampled_from(["dilation", "duration_fabric_ns", "duration_wall_s", "ports",
                            "workloads", "links", "totals", "fidelity", "verdict",
                            "collector", "interrupted", "name", "lab"]), value=_json)
def test_fuzz_random_values_in_summary_fields(key, value, template_run: Path, tmp_path: Path,
                                              capsys) -> None:
    summary = json.loads((template_run / "summary.json").read_text())
    summary[key] = value
    _fuzz_once(template_run, tmp_path / "fuzz", "summary.json", json.dumps(summary).encode(),
               capsys)
