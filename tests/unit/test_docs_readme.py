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
