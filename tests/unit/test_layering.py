"""The control plane's imports run one way:

    cli -> incident -> run -> report | net -> results -> plan -> config -> workloads -> phy
    -> fields -> units

`report` and `net` are siblings that do not import each other;
`export` (a plan as another tool's files) sits just above `plan`. `results` holds the run
directory's formats, which the run writes and the report reads. The config validates
traffic entries with the workload kinds' models, so the kinds sit below it and see the
plan and the run only through the views they are handed. `incident` drives whole
runs (a control and an incident) and judges them, so it sits above `run`. The data plane
(`agents`) never imports the control plane.

Read from the source with `ast` (imports inside functions count: a lazy import that
runs back up is still a cycle waiting to happen), so a new module is checked the day it
is added."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Higher imports lower; equal ranks are siblings, which may not import each other.
LAYERS = {"cli": 10, "incident": 9, "vm": 9, "run": 8, "report": 7, "net": 7, "results": 6,
          "plan": 5, "export": 6, "interop": 4,
          "config": 4, "workloads": 3, "phy": 2, "fields": 1, "units": 0}
# The package root and `python -m testbed` only wire the CLI together.
ENTRY_POINTS = {"testbed/__init__.py", "testbed/__main__.py"}


def _imports(path: Path, root: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.append((node.lineno, name))
    return out


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "testbed" else None


def layering_violations(root: Path = ROOT) -> list[str]:
    problems = []
    for path in sorted((root / "testbed").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel in ENTRY_POINTS:
            continue
        mine = _layer(".".join(path.relative_to(root).with_suffix("").parts))
        if mine not in LAYERS:
            problems.append(f"{rel}: testbed.{mine} has no place in LAYERS; give it one")
            continue
        for line, name in _imports(path, root):
            theirs = _layer(name)
            if theirs is None or theirs == mine:
                continue
            if theirs not in LAYERS or LAYERS[theirs] >= LAYERS[mine]:
                problems.append(f"{rel}:{line}: testbed.{mine} imports {name}, which is not "
                                "below it")
    for path in sorted((root / "agents").rglob("*.py")):
        for line, name in _imports(path, root):
            if name == "testbed" or name.startswith("testbed."):
                problems.append(f"{path.relative_to(root)}:{line}: an agent imports {name}")
    return problems


def test_imports_run_one_way() -> None:
    assert layering_violations() == []


def test_every_testbed_package_has_a_layer() -> None:
    packages = {p.name for p in (ROOT / "testbed").iterdir()
                if p.is_dir() and (p / "__init__.py").exists()}
    assert packages <= set(LAYERS), packages - set(LAYERS)


@pytest.mark.parametrize(("where", "source", "expected"), [
    ("testbed/report/x.py", "from testbed.run.store import Store\n", "testbed.report imports"),
    ("testbed/net/x.py", "def f():\n    from testbed.report import build_report\n",
     "testbed.net imports"),
    ("testbed/plan/x.py", "from ..net import apply_plan\n", "testbed.plan imports testbed.net"),
    ("agents/x.py", "import testbed.units\n", "an agent imports testbed.units"),
])
def test_an_import_running_back_up_is_named(tmp_path: Path, where: str, source: str,
                                            expected: str) -> None:
    for pkg in ("testbed", "agents"):
        (tmp_path / pkg).mkdir()
    target = tmp_path / where
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(source)
    problems = layering_violations(tmp_path)
    assert any(expected in p for p in problems), problems


# Modules of testbed/workloads that are not a kind: the contract, the registry, the docs.
WORKLOAD_CORE = {"__init__", "base", "registry", "docs"}
# Shared libraries of several kinds (a family prefix no kind has): any kind may import them.
SHARED_FAMILIES = {"rdma"}


def kind_import_violations(root: Path = ROOT) -> list[str]:
    """A workload kind (testbed/workloads/<family>[_part].py) imports the kinds' contract
    and its own family's modules, never another kind: like agents, kinds share through
    base.py and the shared libraries (SHARED_FAMILIES), so removing one never breaks
    another."""
    problems = []
    for path in sorted((root / "testbed" / "workloads").glob("*.py")):
        if path.stem in WORKLOAD_CORE:
            continue
        family = path.stem.split("_")[0]
        for line, name in _imports(path, root):
            if not name.startswith("testbed.workloads."):
                continue
            other = name.split(".")[2]
            theirs = other.split("_")[0]
            if (other not in WORKLOAD_CORE - {"registry", "docs"} and theirs != family
                    and theirs not in SHARED_FAMILIES):
                problems.append(f"{path.relative_to(root)}:{line}: the {family} kind imports "
                                f"{name}, another kind's module")
    return problems


def test_workload_kinds_do_not_import_each_other(tmp_path: Path) -> None:
    assert kind_import_violations() == []
    kinds = tmp_path / "testbed" / "workloads"
    kinds.mkdir(parents=True)
    (kinds / "flows.py").write_text("from testbed.workloads.udp import BASE_PORT\n"
                                    "from testbed.workloads.base import Shape\n")
    assert kind_import_violations(tmp_path) == [
        "testbed/workloads/flows.py:1: the flows kind imports testbed.workloads.udp, another "
        "kind's module"]
