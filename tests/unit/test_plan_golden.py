"""Golden tests: config in tests/golden/NAME.yaml -> plan tests/golden/NAME.plan.json.

Regenerate after an intended change with `UPDATE_GOLDEN=1 pytest tests/unit/test_plan_golden.py`
and review the diff like code.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from testbed.config import load_config
from testbed.plan import compile_plan

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
CASES = sorted(p.stem for p in GOLDEN.glob("*.yaml"))
# The budget is an input of the pure compile; pin it so a calibrated machine
# does not change the goldens.
BUDGET_BPS = 200_000_000


def _compile(name: str):
    return compile_plan(load_config(GOLDEN / f"{name}.yaml"), max_wall_port_rate_bps=BUDGET_BPS)


@pytest.mark.parametrize("name", CASES)
def test_plan_matches_golden(name: str) -> None:
    got = _compile(name).to_json()
    path = GOLDEN / f"{name}.plan.json"
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(got)
    assert path.exists(), f"no golden for {name}; run with UPDATE_GOLDEN=1 and review it"
    assert json.loads(got) == json.loads(path.read_text()), (
        f"plan for {name} changed; if intended: UPDATE_GOLDEN=1 pytest {__file__}")


def test_golden_cases_exist() -> None:
    assert len(CASES) >= 4


@pytest.mark.parametrize("name", CASES)
def test_plan_is_deterministic(name: str) -> None:
    assert _compile(name).to_json() == _compile(name).to_json()
