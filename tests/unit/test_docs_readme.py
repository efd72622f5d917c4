"""README.md's claims that code can check: they are checked, so they cannot go stale."""

from __future__ import annotations

import re

import pytest

from testbed.cli import main
from tests.conftest import REPO

README = (REPO / "README.md").read_text(encoding="utf-8")


def _block_after(marker: str) -> list[str]:
    """The lines of the fenced code block that starts with the line `marker`."""
    m = re.search(rf"```\n{re.escape(marker)}\n(?P<body>.*?)\n```", README, re.S)
    assert m, f"README.md has no code block starting with {marker!r}"
    return m["body"].splitlines()


def test_readme_sample_error_is_what_validate_prints(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    path = "tests/config_errors/readme_example.yaml"
    shown = _block_after(f"$ testbed validate {path}")
    monkeypatch.chdir(REPO)            # messages name the file as given
    assert main(["validate", path]) == 2
    assert shown == capsys.readouterr().err.splitlines(), (
        f"README.md's sample error differs from `testbed validate {path}`; paste the real one")
    assert len(shown) >= 3, "the sample should show several problems at once"


def _table_after(heading: str) -> list[list[str]]:
    """The body rows of the first markdown table under `heading`, as lists of cells."""
    section = README[README.index(f"\n{heading}\n"):]
    section = section[:section.index("\n## ", 1)]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return [[c.strip() for c in row.strip("|").split(" | ")] for row in rows[2:]]


def test_readme_kernel_features_are_what_probe_says() -> None:
    from testbed.net.probe import IMPACT

    rows = _table_after("## Kernel features and what needs them")
    assert rows == [[f"`{name}`", text] for name, text in IMPACT.items()], (
        "README.md's kernel feature table must be testbed/net/probe.py's IMPACT, in order, "
        "word for word")


def test_probe_claims_nothing_the_code_does_not_do() -> None:
    from testbed.net.probe import IMPACT

    # the findings: no pfifo fallback, no RED marker, no Soft-RoCE endpoints
    text = " ".join(IMPACT.values()).lower()
    assert "pfifo" not in text
    assert IMPACT["red"].startswith("nothing") and IMPACT["rdma_rxe"].startswith("nothing")
    assert "not emulated" in IMPACT["netem"]
