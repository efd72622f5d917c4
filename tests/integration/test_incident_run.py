"""`testbed run <incident suite>` end to end on the sample incident: the control and the
incident run, each summary.json gets its verdict, the report shows it, the index links
both, and nothing is left behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from testbed.cli import main
from testbed.net.namespaces import list_testbed_namespaces
from tests.conftest import REPO, unique_lab

pytestmark = pytest.mark.root


def test_the_sample_incident_reproduces_and_its_control_does_not(tmp_path: Path,
                                                                  capsys) -> None:
    lab = unique_lab("smp")
    text = (REPO / "tests/incidents/sample.yaml").read_text().replace("name: sample",
                                                                      f"name: {lab}")
    incident = tmp_path / "sample.yaml"
    incident.write_text(text)
    suite = tmp_path / "suite.yaml"
    suite.write_text("incidents: [sample.yaml]\n")
    try:
        code = main(["run", str(suite), "--runs-dir", str(tmp_path / "runs"), "--quiet"])
    finally:
        left = [n for n in list_testbed_namespaces() if n.startswith(f"tb-{lab}-")]
    out = capsys.readouterr().out
    assert code == 0, out
    assert not left
    index = next((tmp_path / "runs").glob("*-incidents"))
    entry = json.loads((index / "index.json").read_text())["incidents"][0]
    verdicts = {}
    for variant, run_dir in entry["runs"].items():
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
        verdicts[variant] = summary["verdict"]
        assert "sample" in (Path(run_dir) / "report.html").read_text()
    assert verdicts["incident"]["reproduced"] and verdicts["incident"]["as_expected"]
    assert not verdicts["control"]["reproduced"] and verdicts["control"]["as_expected"]
    assert verdicts["incident"]["baseline_run"] == entry["runs"]["control"]
    assert all(p["held"] is not None for v in verdicts.values() for p in v["predicates"])
    assert "1 of 1 incidents reproduced" in (index / "index.html").read_text()
