"""Shared test set-up: the `root` marker skips without root; labs get unique names."""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
_counter = itertools.count()

# The suite neither reads nor writes this machine's calibration: every `testbed run` a test
# makes teaches the machine's derating (testbed/run/calibration.py record_run), and a test
# run that fell behind on a loaded machine would raise D for the user's later runs, and for
# the rest of the suite. Each session gets a file of its own, absent at the start (the
# default capacity); a test that needs one sets TESTBED_CALIBRATION itself.
_CALIBRATION_DIR = tempfile.mkdtemp(prefix="tb-test-calibration-")
os.environ.setdefault("TESTBED_CALIBRATION", os.path.join(_CALIBRATION_DIR, "calibration.json"))


def pytest_unconfigure(config):
    shutil.rmtree(_CALIBRATION_DIR, ignore_errors=True)


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
