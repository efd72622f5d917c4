"""README.md's claims that code can check: they are checked, so they cannot go stale."""

from __future__ import annotations

import re
import subprocess

import pytest

from testbed.cli import main
from tests.conftest import REPO

README = (REPO / "README.md").read_text(encoding="utf-8")


def _block_after(marker: str) -> list[str]:
    """The lines of the fenced code block that starts with the line `marker`."""
    m = re.search(rf"```\n{re.escape(marker)}\n(?P<body>.*?)\n```", README, re.S)
    assert m, f"README.md has no code block starting with {marker!r}"
    return m["body"].splitlines()


def test_readme_sample_error_is_what_validate_prints(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    path = "tests/config_errors/readme_example.yaml"
    shown = _block_after(f"$ testbed validate {path}")
    monkeypatch.chdir(REPO)            # messages name the file as given
    assert main(["validate", path]) == 2
    assert shown == capsys.readouterr().err.splitlines(), (
        f"README.md's sample error differs from `testbed validate {path}`; paste the real one")
    assert len(shown) >= 3, "the sample should show several problems at once"


def _table_after(heading: str) -> list[list[str]]:
    """The body rows of the first markdown table under `heading`, as lists of cells."""
    section = README[README.index(f"\n{heading}\n"):]
    section = section[:section.index("\n## ", 1)]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return [[c.strip() for c in row.strip("|").split(" | ")] for row in rows[2:]]


def test_readme_kernel_features_are_what_probe_says() -> None:
    from testbed.net.probe import IMPACT

    rows = _table_after("## Kernel features and what needs them")
    assert rows == [[f"`{name}`", text] for name, text in IMPACT.items()], (
        "README.md's kernel feature table must be testbed/net/probe.py's IMPACT, in order, "
        "word for word")


def test_probe_claims_nothing_the_code_does_not_do() -> None:
    from testbed.net.probe import IMPACT

    # the findings: no pfifo fallback, no RED marker, no Soft-RoCE endpoints
    text = " ".join(IMPACT.values()).lower()
    assert "pfifo" not in text
    # the delay stage exists where the probe says netem is for
    assert "testbed/net/netem.py" in IMPACT["netem"]
    assert (REPO / "testbed/net/netem.py").exists()
    # rxe endpoints exist now: the text names the config field that asks for them
    from testbed.config.models import EcnConfig, HostOptions
    assert "endpoint: rxe" in IMPACT["rdma_rxe"] and "rxe" in str(
        HostOptions.model_fields["endpoint"].annotation)
    # the RED marker it names exists: the config field, and the qdisc the builder adds
    from testbed.net.qdisc import _tc_plugins
    assert "ecn.marker: red" in IMPACT["red"]
    assert "red" in EcnConfig.model_fields["marker"].annotation.__args__
    assert "red" in _tc_plugins


PLANNED_RE = re.compile(r"\s\(planned: [^)]*\)\s*$")


def _layout() -> dict[str, bool]:
    """Path -> planned, for each line of the code block of README's Layout section."""
    section = README[README.index("\n## Layout\n"):]
    section = section[:section.index("\n## ", 1)]
    block = re.search(r"```\n(?P<body>.*?)\n```", section, re.S)
    assert block, "README.md's Layout section has no code block"
    out: dict[str, bool] = {}
    for line in block["body"].splitlines():
        path = line.split()[0]
        assert path.endswith("/"), f"Layout: {path!r} is not a directory (write it with a /)"
        assert path not in out, f"Layout names {path} twice"
        out[path.rstrip("/")] = PLANNED_RE.search(line) is not None
    return out


def _tracked_top_level_dirs() -> set[str]:
    try:
        files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                               check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked directories are unknown")
    return {f.split("/")[0] for f in files if "/" in f and not f.startswith(".")}


def _packages(top: str) -> set[str]:
    return {str(p.parent.relative_to(REPO)) for p in (REPO / top).rglob("__init__.py")}


def test_readme_layout_names_only_directories_that_exist() -> None:
    layout = _layout()
    missing = [p for p, planned in layout.items() if not planned and not (REPO / p).is_dir()]
    landed = [p for p, planned in layout.items() if planned and (REPO / p).exists()]
    assert not missing, f"README.md's Layout names {missing}, which do not exist"
    assert not landed, (f"{landed} exist now: remove their '(planned: ...)' mark in "
                        "README.md's Layout and check their line")


def test_readme_layout_names_every_top_level_directory_and_package() -> None:
    layout = _layout()
    wanted = _tracked_top_level_dirs() | _packages("testbed") | _packages("agents")
    unnamed = sorted(wanted - set(layout))
    assert not unnamed, f"add {unnamed} to README.md's Layout, one line each"
    assert {"testbed/config", "agents/pfc", "tests"} <= set(layout)
