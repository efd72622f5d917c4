"""The report's FCT section (testbed/report/fct.py): present only for runs with flows,
its numbers HPCC's buckets of the run's flows, unfinished flows counted and listed
(no root)."""

from __future__ import annotations

from pathlib import Path

from testbed.report import build_report, load_run
from testbed.report.content import build_context
from testbed.report.fct import MAX_UNFINISHED_ROWS
from tests.unit.flow_runs import flow, make_flow_run


def _records(unfinished: int = 2) -> list:
    # 100 finished flows of 1..100 KB, flow k slowed down k-fold; then the unfinished
    done = [flow(k, 1000 * k, 1000 * k, 1000, start=k) for k in range(1, 101)]
    return done + [flow(200 + j, 5000, None, start=10_000 + j, dst="h3")
                   for j in range(unfinished)]


def test_fct_section_has_the_summary_hpcc_buckets_and_unfinished_flows(tmp_path: Path) -> None:
    run_dir = make_flow_run(tmp_path, "fct", _records())
    with load_run(run_dir) as run:
        fct = build_context(run)["fct"]
    assert fct["summary"] == ("102 flows: 100 finished, 2 unfinished; slowdown (FCT / ideal "
                              "FCT, at least 1) median 51.00, p99 100.00.")
    rows = fct["buckets"].rows
    # 20 buckets of 5 flows: the first holds 1..5 KB (p50 = a[2] = 3, p95 = p99 = a[4] = 5)
    assert len(rows) == 20
    assert rows[0] == ["5 KB", "5", "3.00", "5.00", "5.00"]
    assert rows[-1] == ["100 KB", "5", "98.00", "100.00", "100.00"]
    assert fct["unfinished_count"] == 2
    assert fct["unfinished"].rows == [["bg", "h1", "h3", "5 KB", "10 us"],
                                      ["bg", "h1", "h3", "5 KB", "10 us"]]
    assert len(fct["svgs"]) == 2 and all(s.startswith("<svg") for s in fct["svgs"])


def test_report_files_carry_the_fct_section(tmp_path: Path) -> None:
    paths = build_report(make_flow_run(tmp_path, "fct", _records()))
    md, html = paths.md.read_text(), paths.html.read_text()
    assert "## FCT" in md and "| 5 KB " in md and "Unfinished flows (2)" in md
    assert '<section id="fct">' in html and 'href="#fct"' in html
    assert 'aria-label="FCT CDF"' in html


def test_unfinished_flows_are_counted_in_full_and_listed_up_to_the_cap(tmp_path: Path) -> None:
    run_dir = make_flow_run(tmp_path, "many", _records(unfinished=MAX_UNFINISHED_ROWS + 7))
    with load_run(run_dir) as run:
        fct = build_context(run)["fct"]
    assert fct["unfinished_count"] == MAX_UNFINISHED_ROWS + 7
    assert len(fct["unfinished"].rows) == MAX_UNFINISHED_ROWS
    assert fct["unfinished"].note == "and 7 more"


def test_a_run_without_flows_has_no_fct_section(tmp_path: Path) -> None:
    paths = build_report(make_flow_run(tmp_path, "none", []))
    assert "## FCT" not in paths.md.read_text()
    assert 'id="fct"' not in paths.html.read_text()


def test_flows_csv_stands_in_for_a_database_without_flows(tmp_path: Path) -> None:
    run_dir = make_flow_run(tmp_path, "csv", _records(), store=False)
    with load_run(run_dir) as run:
        fct = build_context(run)["fct"]
    assert fct["source"] == "results/flows.csv"
    assert fct["summary"].startswith("102 flows: 100 finished, 2 unfinished")
    assert fct["unfinished"].rows[0][0] == "-"         # flows.csv has no workload column
