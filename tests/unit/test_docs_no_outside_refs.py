"""No tracked file points at notes outside the repository (FACTS.md, STYLE.md, DESIGN.md,
../shared): a reader of this repository cannot follow such a pointer, so each fact is
stated where the code relies on it instead."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO

OUTSIDE_REF = re.compile(r"\bFACTS\b|\b(?:STYLE|DESIGN)\.md\b|\.\./shared\b"
                         r"|\bshared/(?:FACTS|STYLE|DESIGN)\b")
THIS_FILE = str(Path(__file__).resolve().relative_to(REPO))      # it names the patterns


def _tracked_text_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    return [f for f in out.decode().split("\0") if f and (REPO / f).is_file()]


def _hits(paths: list[str]) -> list[str]:
    found = []
    for path in paths:
        data = (REPO / path).read_bytes()
        if b"\0" in data:
            continue                       # binary
        for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            if OUTSIDE_REF.search(line):
                found.append(f"{path}:{number}: {line.strip()}")
    return found


def test_no_tracked_file_points_outside_the_repository() -> None:
    paths = [f for f in _tracked_text_files() if f != THIS_FILE]
    assert len(paths) > 50
    hits = _hits(paths)
    assert not hits, "state the fact instead of pointing at notes outside the repo:\n" + \
        "\n".join(hits)


def test_the_pattern_catches_each_kind_of_pointer() -> None:
    for text in ("see FACTS.md", "(FACTS: 100-120 ns)", "STYLE.md", "in DESIGN.md",
                 "../shared/x", "shared/FACTS.md"):
        assert OUTSIDE_REF.search(text), text
    for text in ("facts", "the shared pool", "shared_used_bytes", "DESIGN"):
        assert not OUTSIDE_REF.search(text), text
