"""Every incident of configs/incidents reproduces on this machine and its control does not.

Each incident runs as `testbed incident run NAME` does (the control first, the baseline of
its `of: control` predicates, then the incident) under a lab name of its own, and the
test checks both verdicts from their summary.json, that every predicate was decided from
data the run really has, that the report opens with the verdict, and that nothing of the
lab is left behind. Each incident prints its wall time: the whole library must stay
within the issue's 15 minutes (scale the workloads, not the fidelity).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from testbed.incident.load import incident_files, load_incident
from testbed.incident.run import run_incident
from testbed.net.namespaces import list_testbed_namespaces
from testbed.run.runner import RunOptions
from tests.conftest import unique_lab

pytestmark = pytest.mark.root

INCIDENTS = incident_files()


def _with_lab(path: Path, tmp_path: Path) -> tuple[Path, str]:
    """The incident file with a lab name no other test uses (the fabric's `name:` line)."""
    text = path.read_text()
    name = yaml.safe_load(text)["fabric"]["name"]
    lab = unique_lab(name)
    line = f"\n  name: {name}\n"
    assert text.count(line) == 1, f"{path}: one fabric `name: {name}` line expected"
    copy = tmp_path / path.name
    copy.write_text(text.replace(line, f"\n  name: {lab}\n"))
    return copy, lab


def test_the_library_has_the_incidents_the_issue_names():
    names = {p.stem for p in INCIDENTS}
    assert {"incast-hol", "pfc-storm", "pfc-deadlock", "ecn-after-pfc", "marginal-dac",
            "ecmp-collision", "dscp-mismatch", "link-flap"} <= names
    assert len(names) >= 9


@pytest.mark.parametrize("path", INCIDENTS, ids=[p.stem for p in INCIDENTS])
def test_incident_reproduces_and_its_control_does_not(path: Path, tmp_path: Path) -> None:
    copy, lab = _with_lab(path, tmp_path)
    incident = load_incident(copy)
    started = time.monotonic()
    try:
        outcome = run_incident(incident, RunOptions(runs_root=tmp_path / "runs",
                                                    say=lambda _m: None))
    finally:
        left = [n for n in list_testbed_namespaces() if n.startswith(f"tb-{lab}-")]
    wall_s = time.monotonic() - started
    print(f"\n{path.stem}: control and incident in {wall_s:.0f} s wall")
    assert not left, f"namespaces left behind: {left}"
    verdicts = {}
    for variant, o in outcome.variants.items():
        assert o.run_dir is not None, f"{variant}: {o.error}"
        summary = json.loads((Path(o.run_dir) / "summary.json").read_text())
        verdict = summary["verdict"]
        verdicts[variant] = verdict
        table = "\n".join(f"  {p['name']}: {p['value']} {p['op']} {p['threshold']} "
                          f"held={p['held']} ({p['detail']})" for p in verdict["predicates"])
        print(f"{variant}: reproduced={verdict['reproduced']}\n{table}")
        assert all(p["held"] is not None for p in verdict["predicates"]), (
            f"{variant}: a predicate had no data\n{table}")
        html = (Path(o.run_dir) / "report.html").read_text()
        assert 'id="verdict"' in html and verdict["title"] in html
    assert verdicts["incident"]["reproduced"], "the incident did not reproduce"
    assert verdicts["incident"]["as_expected"]
    assert not verdicts["control"]["reproduced"], "the control reproduced the incident"
    assert verdicts["control"]["as_expected"]
