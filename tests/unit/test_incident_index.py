"""The incident runner's pieces that need no fabric: judging a finished run directory, the
suite file, `testbed incident list`, and the suite's static index page."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from testbed.cli import main
from testbed.incident.load import load_incident
from testbed.incident.run import judge_run
from testbed.incident.suite import SuiteError, suite_incidents
from testbed.report.index import IndexEntry, write_index
from testbed.results.files import write_json
from tests.conftest import REPO
from tests.unit.test_incident_evaluate import SUMMARY, _write

SAMPLE = REPO / "tests/incidents/sample.yaml"


def _run_dir(root: Path, name: str, drops: int, lost: float) -> Path:
    run_dir = root / name
    run_dir.mkdir()
    store = _write(run_dir / "counters.sqlite", 1e9, (1e9, 1e9))
    store.add_result("incast", "udp_incast", {"src": "h3", "dst": "h4", "lost": lost})
    store.close()
    write_json(run_dir / "summary.json", {**SUMMARY, "totals": {"drops": drops},
                                          "duration_wall_s": 12.5})
    write_json(run_dir / "plan.json", {"traffic_classes": [{"name": "roce", "tc": 3}]})
    return run_dir


def test_judge_writes_each_variants_verdict_into_its_summary(tmp_path: Path) -> None:
    loaded = load_incident(SAMPLE)
    control = _run_dir(tmp_path, "control", drops=0, lost=0)
    incident = _run_dir(tmp_path, "incident", drops=300, lost=300)
    c = judge_run(loaded, "control", control, None)
    v = judge_run(loaded, "incident", incident, control)
    assert json.loads((incident / "summary.json").read_text())["verdict"] == v
    assert json.loads((control / "summary.json").read_text())["verdict"] == c
    assert (v["variant"], v["baseline_run"], c["variant"], c["baseline_run"]) == (
        "incident", str(control), "control", None)
    by_name = {p["name"]: p for p in v["predicates"]}
    assert by_name["drops"]["held"] is True and by_name["drops"]["value"] == 300
    assert by_name["datagrams lost"]["held"] is True
    assert by_name["datagrams lost"]["threshold"] == 0          # 2 x the control's 0
    # the hand-made database has no tail_drops series: not decided, so not reproduced
    assert by_name["tail drops at the leaf"]["held"] is None
    assert v["reproduced"] is False and "tail drops at the leaf" in v["reason"]
    assert c["reproduced"] is False and c["as_expected"] is False   # undecided, not clean


def test_a_suite_names_incidents_or_all(tmp_path: Path) -> None:
    incidents = tmp_path / "incidents"
    incidents.mkdir()
    for name in ("b", "a"):
        (incidents / f"{name}.yaml").write_text("title: x\n")
    suite = tmp_path / "suite.yaml"
    suite.write_text("incidents: all\n")
    assert suite_incidents(suite, incidents) == [incidents / "a.yaml", incidents / "b.yaml"]
    suite.write_text("incidents: [b, ../x/c.yaml]\n")
    assert suite_incidents(suite, incidents) == [incidents / "b.yaml",
                                                 (tmp_path / "../x/c.yaml").resolve()]
    suite.write_text("runs: [a.yaml]\n")
    assert suite_incidents(suite, incidents) is None             # a runs: suite
    suite.write_text("incidents: 3\n")
    with pytest.raises(SuiteError, match="must be `all` or a list"):
        suite_incidents(suite, incidents)
    suite.write_text("incidents: all\n")
    with pytest.raises(SuiteError, match="holds no incident"):
        suite_incidents(suite, tmp_path / "empty")


def test_the_shipped_suite_runs_every_incident() -> None:
    text = (REPO / "configs/suites/incidents.yaml").read_text()
    assert "incidents: all" in text


def test_list_prints_name_title_source_fault_and_control(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["incident", "list", "--dir", str(SAMPLE.parent), "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows == [{"name": "sample", "title": "Tail drops in an incast without PFC",
                     "source": "Guo et al., RDMA over Commodity Ethernet at Scale, SIGCOMM "
                               "2016, section 2",
                     "fault": "PFC disabled on the lossless class",
                     "control": "PFC on; the class is lossless again"}]


def test_the_index_puts_the_verdict_table_first_and_links_every_report(
        tmp_path: Path) -> None:
    loaded = load_incident(SAMPLE)
    runs = tmp_path / "runs"
    runs.mkdir()
    control = _run_dir(runs, "control", drops=0, lost=0)
    incident = _run_dir(runs, "incident", drops=300, lost=300)
    judge_run(loaded, "control", control, None)
    judge_run(loaded, "incident", incident, control)
    for d in (control, incident):
        (d / "report.html").write_text("<html></html>")
    paths = write_index(runs / "index", [
        IndexEntry("sample", "Tail drops", {"control": str(control), "incident": str(incident)}),
        IndexEntry("broken", error="not run: broken.yaml:3: title: required field is missing")])
    html = paths.html.read_text()
    assert html.index('id="verdicts"') < html.index("sample") < html.index("broken")
    assert 'href="../incident/report.html"' in html and 'href="../control/report.html"' in html
    assert "drops: 300 &gt; 0 (holds)" in html
    assert "tail drops at the leaf: - &gt; - (no data)" in html
    assert "not run: broken.yaml:3" in html
    assert "0 of 2 incidents reproduced" in html
    # static and self-contained: no scripts, nothing fetched from elsewhere
    assert "<script" not in html and "http" not in html.replace("http-equiv", "")
    assert "src=" not in html
    md = paths.md.read_text()
    assert md.startswith("# Incident suite\n")
    assert "| sample" in md and "[incident](../incident/report.html)" in md
    assert "25.0" in md                                      # both runs' wall seconds
    assert json.loads(paths.json.read_text())["incidents"][0]["runs"]["control"] == str(control)
