"""Shared test set-up: the `root` marker skips without root; labs get unique names."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
_counter = itertools.count()


def pytest_collection_modifyitems(config, items):
    if os.geteuid() == 0:
        return
    skip = pytest.mark.skip(reason="needs root: builds network namespaces")
    for item in items:
        if "root" in item.keywords:
            item.add_marker(skip)


def unique_lab(stem: str) -> str:
    """A lab name no other test (or a parallel run) uses: <= 16 chars, [a-z0-9]."""
    return f"{stem[:6]}{os.getpid() % 100000}{next(_counter)}"[:16]


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO
