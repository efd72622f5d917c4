"""Fabric and wall time are converted in one place: agents/timebase.Dilation (the plan
hands out one, `Plan.timebase`). A module that multiplies or divides by the dilation
factor itself is a second conversion that can drift from the first; this reads every
module of testbed/ and agents/ and names any."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

# Names a dilation factor goes by; `.factor` of anything is the Dilation's own.
FACTOR_NAMES = {"dilation", "D", "factor", "dilation_factor"}


def _by_hand(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Div,
                                                                ast.FloorDiv)):
            for side in (node.left, node.right):
                if ((isinstance(side, ast.Attribute) and side.attr in ("factor", "dilation"))
                        or (isinstance(side, ast.Name) and side.id in FACTOR_NAMES)):
                    out.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_only_the_timebase_converts_fabric_and_wall_time() -> None:
    found = [hit for root in ("testbed", "agents") for path in sorted((REPO / root).rglob("*.py"))
             if path != REPO / "agents" / "timebase.py" for hit in _by_hand(path)]
    assert found == [], "convert through Dilation (Plan.timebase) instead"


def test_a_conversion_by_hand_is_found(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr("tests.unit.test_one_timebase.REPO", tmp_path)
    bad = tmp_path / "x.py"
    bad.write_text("def f(plan, ns):\n    return ns * plan.dilation.factor\n")
    assert _by_hand(bad) == ["x.py:2: ns * plan.dilation.factor"]
