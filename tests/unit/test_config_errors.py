"""`testbed validate` on bad configs: every problem, one line each, exit code 2.

Each case is tests/config_errors/NAME.yaml beside NAME.expected, which holds
exactly what `testbed validate tests/config_errors/NAME.yaml` prints on stderr:
one `FILE:LINE: path.to.field: message` line per problem, in line order, then
the summary line. After an intended change to a message, regenerate with

    for f in tests/config_errors/*.yaml; do
        .venv/bin/python -m testbed validate "$f" 2> "${f%.yaml}.expected"; done

and review the diff like code: a message must name the field and say how to fix it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from testbed.cli import main
from tests.conftest import REPO

CASES_DIR = Path("tests/config_errors")           # relative: messages name files as given
CASES = sorted(p.stem for p in (REPO / CASES_DIR).glob("*.yaml"))
LINE_RE = re.compile(r"^(?P<file>[^:]+):(?P<line>\d+): (?P<loc>\(top level\)|\S+): (?P<msg>.+)$")
SUMMARY_RE = re.compile(r"^\d+ problem\(s\) in \S+$")


@pytest.fixture(autouse=True)
def _at_repo_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)


def _expected(name: str) -> list[str]:
    return (REPO / CASES_DIR / f"{name}.expected").read_text(encoding="utf-8").splitlines()


def _validate(path: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str], str]:
    code = main(["validate", path])
    out = capsys.readouterr()
    return code, out.err.splitlines(), out.out


@pytest.mark.parametrize("name", CASES)
def test_bad_config_reports_every_problem_and_exits_2(
        name: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = f"{CASES_DIR}/{name}.yaml"
    code, err, out = _validate(path, capsys)
    assert "Traceback" not in "\n".join(err) + out
    assert code == 2, f"{path}: expected exit code 2, got {code}"
    assert err == _expected(name), (
        f"stderr of `testbed validate {path}` changed; if intended, regenerate "
        f"{CASES_DIR}/{name}.expected (see this module's docstring) and review it")


@pytest.mark.parametrize("name", CASES)
def test_expected_file_is_well_formed(name: str) -> None:
    lines = _expected(name)
    assert lines, f"{name}.expected is empty"
    *problems, summary = lines
    assert problems, f"{name}.expected names no problem"
    assert summary == f"{len(problems)} problem(s) in {CASES_DIR}/{name}.yaml"
    for line in problems:
        m = LINE_RE.match(line)
        assert m, f"{name}.expected: not FILE:LINE: field: message: {line!r}"
        assert m["file"] == f"{CASES_DIR}/{name}.yaml"
    numbers = [int(LINE_RE.match(line)["line"]) for line in problems]
    assert numbers == sorted(numbers), f"{name}.expected: problems are not in line order"


def test_every_case_has_an_expected_file_and_vice_versa() -> None:
    folder = REPO / CASES_DIR
    yamls = {p.stem for p in folder.glob("*.yaml")}
    expected = {p.stem for p in folder.glob("*.expected")}
    assert yamls == expected, f"unpaired: {sorted(yamls ^ expected)}"


def test_the_error_folder_covers_many_cases() -> None:
    assert len(CASES) >= 20


def test_a_file_with_several_problems_reports_them_all_in_line_order() -> None:
    for name in ("many_field_problems", "many_fabric_problems"):
        *problems, _ = _expected(name)
        assert len(problems) >= 5
        assert len({LINE_RE.match(line)["line"] for line in problems}) >= 5


# ---- the line of each problem is where its key is --------------------------------

def _loc_parts(loc: str) -> list[str | int]:
    """'qos.default.buffer[3]' -> ['qos', 'default', 'buffer', 3]."""
    parts: list[str | int] = []
    for name, index in re.findall(r"([^.\[\]]+)|\[(\d+)\]", loc):
        parts.append(int(index) if index else name)
    return parts


def _keys_to_find(loc: str, message: str) -> list[str]:
    """Keys one of which the problem's line must spell: the field, or for a
    missing field the mapping it is missing from."""
    parts = _loc_parts(loc)
    if message.startswith("required field is missing"):
        parts = parts[:-1]
    keys = [str(parts[-1])] if parts and isinstance(parts[-1], int) else []
    keys += [str(p) for p in reversed(parts) if isinstance(p, str)][:1]
    return keys


def _line_has_key(text: str, key: str) -> bool:
    return re.search(rf"(^|[\s{{,]){re.escape(key)}\s*:", text) is not None


@pytest.mark.parametrize("name", CASES)
def test_problem_lines_point_at_the_offending_key(name: str) -> None:
    source = (REPO / CASES_DIR / f"{name}.yaml").read_text(
        encoding="utf-8", errors="replace").splitlines()    # yaml_not_utf8 is not UTF-8
    for line in _expected(name)[:-1]:
        m = LINE_RE.match(line)
        assert m, line
        if m["loc"] == "(top level)":
            continue    # the file as a whole, or YAML syntax: no key to point at
        number = int(m["line"])
        assert 1 <= number <= len(source), f"{line!r}: line {number} is outside the file"
        text = source[number - 1]
        keys = _keys_to_find(m["loc"], m["msg"])
        # a problem with a whole list entry (workload.traffic[0]), or a field missing from
        # one (events[3].at), is on the entry's first line
        parts = _loc_parts(m["loc"])
        of_entry = isinstance(parts[-1], int) or (
            m["msg"].startswith("required field is missing") and len(parts) > 1
            and isinstance(parts[-2], int))
        entry = of_entry and text.lstrip().startswith("- ")
        assert entry or any(_line_has_key(text, key) for key in keys), (
            f"{line!r}: line {number} is {text!r}, which holds none of {keys}")


# ---- good configs -------------------------------------------------------------------

def fabric_configs() -> list[str]:
    """configs/default.yaml and the examples that declare the fabric schema."""
    from tests.unit.test_schema import SCHEMA_PATH, example_configs, schema_of

    return [str(p.relative_to(REPO)) for p in example_configs()
            if schema_of(p) == SCHEMA_PATH]


def test_default_config_is_a_fabric_config() -> None:
    assert "configs/default.yaml" in fabric_configs()


@pytest.mark.parametrize("path", fabric_configs())
def test_good_config_validates(path: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, err, out = _validate(path, capsys)
    assert err == [], f"{path}: {err}"
    assert code == 0
    assert out.startswith(f"{path}: ok:")
