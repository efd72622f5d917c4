"""docs/run-format.md lists exactly the event kinds the code writes, with their fields.

The kinds are read from the source with `ast`, not from a list kept beside the docs:

- testbed/: every `add_event(ts_fabric, ts_wall, KIND, ..., **fields)` call and every
  `Event(ts_fabric, ts_wall, KIND, ...)`; KIND must be a string literal (or an
  `a if c else b` of literals), a parameter named `kind` passed on (the store's own
  add_event), or the collector's pass-through of an agent event's kind
  (`event.pop("kind", ...)`), which brings in every kind the agents write;
- agents/: an event writer is a function with a `kind` parameter in a class (or a
  module) that `json.dumps` a dict with a "kind" key (the PFC agent's `log`, which
  flush_log writes as JSON lines). Each call of a writer gives a kind, and its
  keyword arguments beyond the writer's own parameters are the event's fields.

A kind or field that cannot be read statically is a failure that names the line, so
a new way of writing events cannot slip past the check.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import REPO

RUN_FORMAT = REPO / "docs" / "run-format.md"
# the columns of the events table that are not detail fields
STORE_COLUMNS = {"ts_fabric_ns", "ts_wall_ns", "kind", "node", "port", "tclass"}


@dataclass
class Kinds:
    fields: dict[str, set[str]] = field(default_factory=dict)     # kind -> detail fields
    where: dict[str, str] = field(default_factory=dict)           # kind -> file:line
    unreadable: list[str] = field(default_factory=list)           # file:line: why
    passes_agent_kinds: bool = False                              # the collector's import

    def add(self, kind: str, fields: set[str], where: str) -> None:
        self.fields.setdefault(kind, set()).update(fields)
        self.where.setdefault(kind, where)


def _sources(top: str) -> Iterator[tuple[str, ast.Module]]:
    for path in sorted((REPO / top).rglob("*.py")):
        rel = str(path.relative_to(REPO))
        yield rel, ast.parse(path.read_text(encoding="utf-8"), rel)


def _callee(call: ast.Call) -> str | None:
    if isinstance(call.func, ast.Attribute):
        return call.func.attr
    if isinstance(call.func, ast.Name):
        return call.func.id
    return None


def _arg(call: ast.Call, index: int, name: str) -> ast.expr | None:
    if len(call.args) > index and not any(isinstance(a, ast.Starred) for a in call.args):
        return call.args[index]
    return next((k.value for k in call.keywords if k.arg == name), None)


def _literals(node: ast.expr) -> list[str] | None:
    """The strings `node` can be, if it is a literal or a conditional of literals."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.IfExp):
        a, b = _literals(node.body), _literals(node.orelse)
        return None if a is None or b is None else a + b
    return None


def _detail_fields(call: ast.Call, params: set[str]) -> set[str] | None:
    """Keyword arguments beyond the writer's own parameters; None if `**` hides them."""
    if any(k.arg is None for k in call.keywords):
        return None
    return {k.arg for k in call.keywords if k.arg not in params}


def _functions(tree: ast.AST) -> Iterator[tuple[ast.FunctionDef, list[ast.AST]]]:
    """Every function with the chain of nodes enclosing it (classes, functions)."""
    def walk(node: ast.AST, chain: list[ast.AST]) -> Iterator:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                yield child, chain
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                yield from walk(child, [*chain, child])
            else:
                yield from walk(child, chain)
    yield from walk(tree, [])


def _params(func: ast.FunctionDef) -> list[str]:
    return [a.arg for a in (*func.args.posonlyargs, *func.args.args, *func.args.kwonlyargs)]


def _calls_in(node: ast.AST) -> Iterator[tuple[ast.Call, ast.FunctionDef | None]]:
    """Each call under `node`, with the innermost function it is in."""
    stack: list[tuple[ast.AST, ast.FunctionDef | None]] = [(node, None)]
    while stack:
        cur, owner = stack.pop()
        for child in ast.iter_child_nodes(cur):
            inner = child if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else owner
            if isinstance(child, ast.Call):
                yield child, owner
            stack.append((child, inner))


def _store() -> tuple[str, set[str]]:
    """The module that defines the store's add_event (as `testbed.x.y`), and add_event's own
    parameters: the rest of its keywords are an event's detail fields."""
    for rel, tree in _sources("testbed"):
        for func, chain in _functions(tree):
            if func.name == "add_event" and any(isinstance(c, ast.ClassDef) for c in chain):
                return rel.removesuffix(".py").replace("/", "."), set(_params(func)) - {"self"}
    raise AssertionError("no Store.add_event found in testbed/")


def _store_add_event_params() -> set[str]:
    return _store()[1]


def _imports_event_from(tree: ast.Module, module: str) -> bool:
    return any(isinstance(n, ast.ImportFrom) and n.module == module
               and any(a.name == "Event" and a.asname is None for a in n.names)
               for n in ast.walk(tree))


def _testbed_kinds(kinds: Kinds) -> None:
    store_module, add_event_params = _store()
    assert {"kind", "node", "port", "tclass"} <= add_event_params
    for rel, tree in _sources("testbed"):
        # the store's Event, not threading.Event: a bare name defined or imported here
        event_here = (rel.removesuffix(".py").replace("/", ".") == store_module
                      or _imports_event_from(tree, store_module))
        for call, owner in _calls_in(tree):
            name = _callee(call)
            is_event = (event_here and isinstance(call.func, ast.Name)
                        and call.func.id == "Event")
            if name != "add_event" and not is_event:
                continue
            where = f"{rel}:{call.lineno}"
            node = _arg(call, 2, "kind")
            if node is None:
                kinds.unreadable.append(f"{where}: {name}() without a kind argument")
                continue
            literal = _literals(node)
            if literal is not None:
                if name == "add_event":
                    detail = _detail_fields(call, add_event_params)
                else:
                    d = _arg(call, 6, "detail")
                    detail = ({k.value for k in d.keys if isinstance(k, ast.Constant)}
                              if isinstance(d, ast.Dict) and None not in d.keys
                              else set() if d is None else None)
                if detail is None:
                    kinds.unreadable.append(f"{where}: the fields of {literal} are hidden")
                    continue
                for kind in literal:
                    kinds.add(kind, detail, where)
            elif (isinstance(node, ast.Name) and node.id == "kind" and owner is not None
                  and "kind" in _params(owner)):
                continue                     # a writer passing its own `kind` on
            elif (isinstance(node, ast.Call) and _callee(node) in ("pop", "get") and node.args
                  and _literals(node.args[0]) == ["kind"]):
                kinds.passes_agent_kinds = True
            else:
                kinds.unreadable.append(f"{where}: the kind {ast.unparse(node)!r} of {name}() "
                                        "cannot be read statically")


def _writes_kind_json(scope: ast.AST) -> bool:
    """Whether `scope` json.dumps a dict literal that has a "kind" key."""
    for call, _ in _calls_in(scope):
        if _callee(call) == "dumps" and call.args and isinstance(call.args[0], ast.Dict):
            if any(isinstance(k, ast.Constant) and k.value == "kind" for k in call.args[0].keys):
                return True
    return False


def _agent_kinds(kinds: Kinds) -> int:
    """Add the agents' event kinds; returns how many writers were found."""
    writers: dict[str, tuple[int, set[str], ast.AST]] = {}   # name -> (kind index, params, scope)
    trees = list(_sources("agents"))
    for _rel, tree in trees:
        for func, chain in _functions(tree):
            params = _params(func)
            if "kind" not in params:
                continue
            cls = next((c for c in reversed(chain) if isinstance(c, ast.ClassDef)), None)
            scope = cls if cls is not None else tree
            if not _writes_kind_json(scope):
                continue
            bound = cls is not None and params[:1] in (["self"], ["cls"])
            positional = params[1:] if bound else params
            writers[func.name] = (positional.index("kind"), set(positional), scope)
    for rel, tree in trees:
        for call, owner in _calls_in(tree):
            name = _callee(call)
            if name not in writers:
                continue
            index, params, scope = writers[name]
            node = _arg(call, index, "kind")
            literal = None if node is None else _literals(node)
            where = f"{rel}:{call.lineno}"
            if literal is None:
                forwarded = (isinstance(node, ast.Name) and node.id == "kind"
                             and owner is not None and "kind" in _params(owner))
                on_self = (isinstance(call.func, ast.Attribute)
                           and isinstance(call.func.value, ast.Name)
                           and call.func.value.id == "self")
                if not forwarded and on_self:
                    kinds.unreadable.append(f"{where}: the event kind of {name}() cannot be "
                                            "read statically")
                continue     # another object's same-named method, or a forwarding writer
            detail = _detail_fields(call, params)
            if detail is None:
                kinds.unreadable.append(f"{where}: the fields of {literal} are hidden")
                continue
            for kind in literal:
                kinds.add(kind, detail, where)
    return len(writers)


@pytest.fixture(scope="module")
def emitted() -> Kinds:
    kinds = Kinds()
    _testbed_kinds(kinds)
    agent = Kinds()
    writers = _agent_kinds(agent)
    assert writers, "no agent event writer found: teach this test how agents write events"
    assert agent.fields, "the agents' event writers are never called with a kind"
    assert kinds.passes_agent_kinds, ("the collector no longer imports the agents' event "
                                      "kinds; say where agent events go, and fix this test")
    for kind, fields in agent.fields.items():
        kinds.add(kind, fields, agent.where[kind])
    kinds.unreadable += agent.unreadable
    return kinds


def _documented() -> dict[str, set[str]]:
    """kind -> fields, from the table under '### Events' in docs/run-format.md."""
    text = RUN_FORMAT.read_text(encoding="utf-8")
    section = text[text.index("\n### Events\n"):]
    section = section[:section.index("\n### ", 1)]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    out: dict[str, set[str]] = {}
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        (kind,) = re.findall(r"`([^`]+)`", cells[0])
        assert kind not in out, f"run-format.md lists {kind!r} twice"
        out[kind] = set(re.findall(r"`([^`]+)`", cells[1]))
    return out


def test_every_event_kind_is_read_statically(emitted: Kinds) -> None:
    assert not emitted.unreadable, "\n".join(emitted.unreadable)


def test_the_known_writers_are_found(emitted: Kinds) -> None:
    # the extraction finds what it must: the run's own kinds and the PFC agent's
    assert {"phase", "fidelity", "interrupted"} <= set(emitted.fields)
    assert {"pfc_xoff", "pfc_paused", "pfc_storm"} <= set(emitted.fields)
    assert emitted.fields["phase"] >= {"phase"}


def test_run_format_lists_every_emitted_kind_and_no_other(emitted: Kinds) -> None:
    documented = set(_documented())
    missing = sorted(set(emitted.fields) - documented)
    extra = sorted(documented - set(emitted.fields))
    assert not missing, ("docs/run-format.md, Events: add "
                         + ", ".join(f"{k} ({emitted.where[k]})" for k in missing))
    assert not extra, f"docs/run-format.md, Events: nothing writes {extra}; remove them"


def test_run_format_lists_each_kinds_fields(emitted: Kinds) -> None:
    documented = _documented()
    wrong = {k: (sorted(emitted.fields[k] - f), sorted(f - emitted.fields[k]))
             for k, f in documented.items() if k in emitted.fields and f != emitted.fields[k]}
    assert not wrong, "\n".join(
        f"{k} ({emitted.where[k]}): undocumented fields {miss}, documented but not written "
        f"{extra}" for k, (miss, extra) in wrong.items())


def test_run_format_names_every_phase() -> None:
    phases = set()
    for _rel, tree in _sources("testbed"):
        for call, _ in _calls_in(tree):
            if _callee(call) == "add_event" and _literals(_arg(call, 2, "kind")
                                                          or ast.Constant(None)) == ["phase"]:
                value = next(k.value for k in call.keywords if k.arg == "phase")
                phases.update(_literals(value) or [])
    assert phases >= {"up", "workload", "down"}
    text = RUN_FORMAT.read_text(encoding="utf-8")
    row = next(line for line in text.splitlines() if line.startswith("| `phase` |"))
    assert all(f"`{p}`" in row for p in phases), f"document every phase {sorted(phases)}"


def test_run_format_defines_t0_once() -> None:
    text = RUN_FORMAT.read_text(encoding="utf-8")
    assert text.count("## Time: t0 and fabric time") == 1
    # the old second definition: t = 0 at the start of the workload phase
    assert "start of the workload phase" not in text


def test_the_extraction_sees_a_new_kind(tmp_path: Path) -> None:
    tree = ast.parse("def f(store):\n    store.add_event(0, 0, 'brand_new', node='x', a=1)\n")
    call = next(c for c, _ in _calls_in(tree))
    assert _literals(_arg(call, 2, "kind")) == ["brand_new"]
    assert _detail_fields(call, _store_add_event_params()) == {"a"}
