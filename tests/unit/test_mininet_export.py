"""The Mininet export: golden files for the default and the explicit fabric
(tests/golden/NAME.mininet.golden; regenerate with `UPDATE_GOLDEN=1 pytest
tests/unit/test_mininet_export.py` and review the diff), and what the text must hold."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from testbed.config import load_config
from testbed.export.mininet_topo import MININET_MAX_BW_MBIT, export_mininet, mininet_dilation
from testbed.plan import compile_plan

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
BUDGET_BPS = 200_000_000    # as tests/unit/test_plan_golden.py: a calibration changes nothing


def _plan(name: str):
    return compile_plan(load_config(GOLDEN / f"{name}.yaml"), max_wall_port_rate_bps=BUDGET_BPS)


@pytest.mark.parametrize("name", ["default", "explicit"])
def test_export_matches_golden(name: str) -> None:
    got = export_mininet(_plan(name), source=f"{name}.yaml")
    path = GOLDEN / f"{name}.mininet.golden"
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(got)
    assert path.exists(), f"no golden for {name}; run with UPDATE_GOLDEN=1 and review it"
    assert got == path.read_text(), f"export of {name} changed; if intended: UPDATE_GOLDEN=1"
    assert got == export_mininet(_plan(name), source=f"{name}.yaml")   # deterministic


@pytest.mark.parametrize("name", ["default", "explicit"])
def test_export_is_python_with_every_node_link_and_route(name: str) -> None:
    plan = _plan(name)
    text = export_mininet(plan)
    ast.parse(text)
    for node in plan.nodes:
        assert f"self.node({node.name!r}," in text
        for iface in node.interfaces:
            assert repr(iface.address) in text and repr(iface.mac) in text
    for link in plan.links:
        assert f"# link {link.index}: " in text
    multipath = [r for n in plan.nodes for r in n.routes if len(r.nexthops) > 1]
    assert multipath, "these fabrics have ECMP routes"
    for route in multipath:
        assert all(f"nexthop via {h.gateway} dev {h.ifname}" in text for h in route.nexthops)


def test_dilation_is_raised_until_every_link_fits_mininet() -> None:
    plan = _plan("explicit")
    plan = plan.model_copy(update={"dilation": plan.dilation.model_copy(update={"factor": 10})})
    d = mininet_dilation(plan)
    fastest = max(link.rate_bps for link in plan.links)
    assert fastest / d <= MININET_MAX_BW_MBIT * 1e6 < fastest / (d - 1)
    text = export_mininet(plan)
    assert f"D={d}, not the plan's 10" in text
    bws = [float(part.split("=")[1]) for part in text.replace(",", " ").split()
           if part.startswith("bw=") and part[3:4].isdigit()]
    assert bws and max(bws) <= MININET_MAX_BW_MBIT


def test_plan_dilation_kept_when_it_fits() -> None:
    plan = _plan("default")
    assert mininet_dilation(plan) == plan.dilation.factor


def test_cli_export_writes_the_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    from testbed.cli import main

    monkeypatch.setattr("testbed.run.calibration.load_budget_bps", lambda: (BUDGET_BPS, "test"))
    out = tmp_path / "topo.py"
    assert main(["export", "mininet", str(GOLDEN / "explicit.yaml"), "-o", str(out)]) == 0
    assert out.read_text() == export_mininet(_plan("explicit"), source="explicit.yaml")
    assert "--topo explicit --controller none" in capsys.readouterr().out


def test_cli_export_bad_config_is_a_usage_error(tmp_path: Path) -> None:
    from testbed.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntopology: {kind: nonsense}\n")
    assert main(["export", "mininet", str(bad), "-o", str(tmp_path / "t.py")]) == 2
    assert not (tmp_path / "t.py").exists()


# mn 2.3's own module-level names: `mn --custom FILE` copies every top-level name of FILE
# into mn's globals, so a custom file must not rebind one to something else (an exported
# HOSTS list replaced mn's HOSTS dict and `mn` failed: 'list' object has no attribute 'get')
MN_GLOBALS = {"TOPOS", "SWITCHES", "HOSTS", "CONTROLLERS", "LINKS", "TESTS", "CLI",
              "ALTSPELLING", "MininetRunner", "runTests", "addDictOption", "version",
              "custom", "buildTopo", "Mininet", "MininetWithControlNet", "TESTNAMES"}


def _top_level_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
    return names


@pytest.mark.parametrize("name", ["default", "explicit"])
def test_export_rebinds_none_of_mns_globals(name: str) -> None:
    mn_names = set(MN_GLOBALS)
    mn = Path("/usr/bin/mn")
    if mn.exists():             # the installed mn's own names too, where Mininet is there
        mn_names |= _top_level_names(ast.parse(mn.read_text()))
    exported = _top_level_names(ast.parse(export_mininet(_plan(name), f"{name}.yaml")))
    # topos and tests are the names mn reads on purpose
    assert not (exported - {"topos", "tests"}) & mn_names
