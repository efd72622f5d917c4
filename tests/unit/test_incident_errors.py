"""`testbed incident validate` on bad incident files: every problem, one line each, on the
line of the incident file it is about, exit code 2.

Each case is tests/incident_errors/NAME.yaml beside NAME.expected, exactly what
`testbed incident validate tests/incident_errors/NAME.yaml` prints on stderr. After an
intended change to a message, regenerate with

    for f in tests/incident_errors/*.yaml; do
        .venv/bin/python -m testbed incident validate "$f" 2> "${f%.yaml}.expected"; done

and review the diff like code.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from testbed.cli import main
from tests.conftest import REPO
from tests.unit.test_config_errors import LINE_RE, _keys_to_find, _line_has_key, _loc_parts

CASES_DIR = Path("tests/incident_errors")
CASES = sorted(p.stem for p in (REPO / CASES_DIR).glob("*.yaml"))


@pytest.fixture(autouse=True)
def _at_repo_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)


def _expected(name: str) -> list[str]:
    return (REPO / CASES_DIR / f"{name}.expected").read_text(encoding="utf-8").splitlines()


@pytest.mark.parametrize("name", CASES)
def test_bad_incident_reports_every_problem_and_exits_2(
        name: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = f"{CASES_DIR}/{name}.yaml"
    code = main(["incident", "validate", path])
    out = capsys.readouterr()
    assert "Traceback" not in out.err + out.out
    assert code == 2
    assert out.err.splitlines() == _expected(name), (
        f"stderr of `testbed incident validate {path}` changed; if intended, regenerate "
        f"{CASES_DIR}/{name}.expected (see this module's docstring) and review it")


@pytest.mark.parametrize("name", CASES)
def test_each_problem_is_on_the_line_that_holds_its_key(name: str) -> None:
    source = (REPO / CASES_DIR / f"{name}.yaml").read_text(encoding="utf-8",
                                                           errors="replace").splitlines()
    *problems, summary = _expected(name)
    assert summary == f"{len(problems)} problem(s) in {CASES_DIR}/{name}.yaml"
    for line in problems:
        m = LINE_RE.match(line)
        assert m and m["file"] == f"{CASES_DIR}/{name}.yaml", line
        if m["loc"] == "(top level)":
            continue
        text = source[int(m["line"]) - 1]
        loc = m["loc"]
        if loc.startswith("control.set."):
            # the set entry's key is the whole dotted path
            assert text.strip().startswith(loc.removeprefix("control.set.") + ":"), (line, text)
            continue
        keys = _keys_to_find(loc, m["msg"])
        if not keys:
            continue    # a field missing from the top level: no key to point at
        entry = isinstance(_loc_parts(loc)[-1], int) and text.lstrip().startswith("- ")
        assert entry or any(_line_has_key(text, k) for k in keys), (line, text, keys)


def test_the_cases_cover_the_model_the_fabric_the_control_and_the_signature() -> None:
    text = "\n".join(line for name in CASES for line in _expected(name))
    for part in (": fabric.", ": control.set.", ": control.remove[", ": signature[",
                 "(in the control variant)", ": evidence."):
        assert part in text, part


def test_the_sample_incident_validates(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["incident", "validate", "tests/incidents/sample.yaml"]) == 0
    assert capsys.readouterr().out.startswith("tests/incidents/sample.yaml: ok: 3 predicate")
