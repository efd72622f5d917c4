"""No agent imports another agent's module.

The agents (agents/udp, agents/pfc, agents/roce, agents/aggregator,
agents/collectives) share code only through the shared packages (agents.runtime,
agents.rdma, agents.wire, agents.timebase, agents.portmaps), so each can change without
breaking the others: the in-network aggregator and its workers share agents.wire.ina,
not each other's modules. Imports are read with `ast` (module level and inside
functions, absolute and relative), nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO

AGENTS = frozenset({"udp", "pfc", "roce", "aggregator", "collectives", "rxe_cc"})
AGENTS_DIR = REPO / "agents"


def _owner(rel: Path) -> str | None:
    """The top-level name under agents/ a file belongs to: 'roce' for agents/roce/perftest.py,
    'timebase' for agents/timebase.py, None for agents/__init__.py."""
    parts = rel.parts
    if len(parts) == 1:
        return None if parts[0] == "__init__.py" else Path(parts[0]).stem
    return parts[0]


def _module_parts(rel: Path) -> list[str]:
    """Dotted name of the file's package, as parts: agents/roce/perftest.py -> agents.roce."""
    return ["agents", *rel.parts[:-1]]


def imported_modules(rel: Path, source: str) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in `source`, relative ones resolved.

    `from agents import roce` yields agents.roce: the name imported may be a module.
    """
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, filename=str(rel))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = _module_parts(rel)
                base = package[:len(package) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            out.append((node.lineno, module))
            out += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return out


def agent_of(module: str) -> str | None:
    """The agent a dotted module belongs to (agents.roce.perftest -> roce), or None."""
    parts = module.split(".")
    if len(parts) >= 2 and parts[0] == "agents" and parts[1] in AGENTS:
        return parts[1]
    return None


def violations(rel: Path, source: str) -> list[str]:
    """Imports of another agent's modules from the file agents/`rel`."""
    owner = _owner(rel)
    bad = []
    for line, module in imported_modules(rel, source):
        other = agent_of(module)
        if other is not None and other != owner:
            bad.append(f"agents/{rel}:{line} imports {module}")
    return sorted(set(bad))


def _sources() -> list[tuple[Path, str]]:
    return [(p.relative_to(AGENTS_DIR), p.read_text()) for p in sorted(AGENTS_DIR.rglob("*.py"))]


def test_every_agent_is_found():
    owners = {_owner(rel) for rel, _ in _sources()}
    assert AGENTS <= owners, f"agent packages missing under agents/: {AGENTS - owners}"


def test_no_agent_imports_another_agent():
    bad = [v for rel, src in _sources() if _owner(rel) in AGENTS for v in violations(rel, src)]
    assert not bad, ("agents share code through agents.runtime / agents.rdma / agents.wire / "
                     "agents.timebase / agents.portmaps, not by importing each other:\n"
                     + "\n".join(bad))


def test_shared_packages_import_no_agent():
    bad = [v for rel, src in _sources() if _owner(rel) not in AGENTS
           for v in violations(rel, src)]
    assert not bad, "shared agent code must not depend on an agent:\n" + "\n".join(bad)


@pytest.mark.parametrize("rel, source", [
    ("roce/perftest.py", "from agents.udp import Lifecycle\n"),
    ("roce/perftest.py", "import agents.pfc.logic\n"),
    ("pfc/__main__.py", "def f():\n    from agents import roce\n"),
    ("pfc/__main__.py", "from ..udp.logic import pause_step\n"),
    ("udp/__main__.py", "from agents.roce import perftest\n"),
    ("collectives/roce.py", "from agents.roce.perftest import ControlChannel\n"),
    ("runtime/lifecycle.py", "from agents.udp.logic import Pacer\n"),
    ("collectives/ina.py", "from agents.aggregator.logic import Aggregator\n"),
    ("aggregator/__main__.py", "from agents.collectives import ina\n"),
    ("wire/ina.py", "import agents.aggregator\n"),
])
def test_a_cross_agent_import_is_caught(rel, source):
    assert violations(Path(rel), source)


@pytest.mark.parametrize("rel, source", [
    ("roce/perftest.py", "from agents.runtime.lifecycle import Lifecycle\n"),
    ("roce/__main__.py", "from agents.rdma.cc import PRESETS\nfrom . import perftest\n"),
    ("roce/perftest.py", "from agents.rdma.qp import RcQp\nfrom agents.rdma import transport\n"),
    ("pfc/__main__.py", "from agents import portmaps, timebase\nfrom agents.wire import pfc\n"),
    ("udp/__main__.py", "from .logic import Pacer\nimport agents.udp.logic\n"),
    ("collectives/ina.py", "from agents.wire.ina import build\nfrom agents.runtime import x\n"),
    ("collectives/__main__.py", "from agents.rdma import options\nfrom .roce import connect\n"),
])
def test_allowed_imports_pass(rel, source):
    assert violations(Path(rel), source) == []
