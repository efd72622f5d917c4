"""Every workload kind writes exactly the result columns it declares, and docs/run-format.md
lists exactly those (its tables are generated from the kinds by `make docs`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from testbed.config import load_config_text
from testbed.plan import compile_plan
from testbed.run.workload import expand_workload, run_view
from testbed.workloads import docs
from testbed.workloads.base import WorkloadKind
from testbed.workloads.registry import REGISTRY
from tests.conftest import REPO

RUN_FORMAT = REPO / "docs" / "run-format.md"
FABRIC = """\
name: rows
dilation: 1000
topology:
  kind: single_switch
  hosts: 4
  host_link: {port: 100GBASE-CR1, length: 2m}
hosts: [{name: h1, endpoint: rxe}, {name: h2, endpoint: rxe}, {name: h3, endpoint: rxe},
        {name: h4, endpoint: rxe}]
"""


def _fabric_with(kind: WorkloadKind):
    text = FABRIC + yaml.safe_dump({"workload": {"traffic": [dict(kind.example)]}})
    loaded = load_config_text(text, f"{kind.family}.yaml")
    return loaded, compile_plan(loaded)


@pytest.mark.parametrize("kind", REGISTRY.kinds(), ids=lambda k: k.family)
def test_a_kinds_rows_have_exactly_its_declared_columns(kind: WorkloadKind) -> None:
    loaded, plan = _fabric_with(kind)
    specs = expand_workload(loaded.fabric, plan)
    assert specs and all(s.module == kind.agent_module for s in specs)
    # no results at all (agents that died): still rows, each with every column
    rows = kind.result_rows(specs, {}, run_view(plan, Path("/nonexistent"), 0))
    assert rows          # one per stream (UDP, RoCE) or per size (collectives)
    for row in rows:
        assert list(row.fields) == list(kind.result_fields), row.kind
        assert row.kind in kind.shapes


def test_run_format_md_lists_every_kinds_columns() -> None:
    text = RUN_FORMAT.read_text(encoding="utf-8")
    assert docs.render(text) == text, "run `make docs` and commit docs/run-format.md"
    for kind in REGISTRY.kinds():
        for column in kind.result_fields:
            assert f"| `{column}` |" in text
