"""`testbed compare` (testbed/report/compare.py, testbed/cli/compare.py): runs of sized
flows side by side from their run directories alone (no root)."""

from __future__ import annotations

from pathlib import Path

import pytest

from testbed.cli import main
from testbed.report import RunDirError
from testbed.report.compare import load_comparison, write_comparison
from tests.unit.flow_runs import flow, make_flow_run


def _flows(slow: int, unfinished: int = 0, sizes: range = range(1, 41)) -> list:
    """40 flows of 1..40 KB; flow k takes slow x k x its ideal; the last `unfinished`
    never finish."""
    out = [flow(k, 1000 * k, 1000 * k * slow, 1000, start=10 * k) for k in sizes]
    return [r if i < len(out) - unfinished else flow(r.flow_id, r.size_bytes, None,
                                                       start=r.start_ns)
            for i, r in enumerate(out)]


@pytest.fixture
def runs(tmp_path: Path) -> list[Path]:
    return [make_flow_run(tmp_path, "dcqcn", _flows(1), cc="dcqcn", pause_tx=12, pause_rx=3,
                          ecn_marks=40, backlog_bytes=[0, 0, 10_000, 50_000, 0]),
            make_flow_run(tmp_path, "none", _flows(2, unfinished=2), cc="none",
                          pause_tx=900, pause_rx=800, backlog_bytes=[0, 100_000, 200_000])]


def _row(table, name: str) -> list[str]:
    return next(r[1:] for r in table.rows if r[0] == name)


def test_runs_of_the_same_flows_compare_by_hpcc_bucket(runs: list[Path]) -> None:
    comparison = load_comparison(runs)
    # the same flows, but two of them did not finish in the second run: HPCC's slices of
    # every flow, so each bucket holds the same flows in both
    assert comparison.scheme == "hpcc_edges"
    table = comparison.table()
    assert table.columns[1:] == ["20261129T120501Z-dcqcn (dcqcn)",
                                 "20261129T120501Z-none (none)"]
    assert _row(table, "flows") == ["40", "40"]
    assert _row(table, "unfinished") == ["0", "2"]
    # run 1: slowdowns 1..40, a[int(40 p)]: a[20] = 21, a[38] = 39, a[39] = 40;
    # run 2: 2, 4, .., 76 (38 finished): a[19] = 40, a[36] = 74, a[37] = 76
    assert _row(table, "slowdown p50") == ["21.00", "40.00"]
    assert _row(table, "slowdown p95") == ["39.00", "74.00"]
    assert _row(table, "slowdown p99") == ["40.00", "76.00"]
    assert _row(table, "PFC XOFF frames sent") == ["12", "900"]
    assert _row(table, "PFC frames received (XOFF + XON)") == ["3", "800"]
    assert _row(table, "ECN marks") == ["40", "0"]
    # sw1:swp4 at every sample (h4's NIC queue is not a switch's): run 1 held 0, 0, 10 KB,
    # 50 KB, 0 (a[2] = 0), run 2 0, 100 KB, 200 KB (a[1] = 100 KB)
    assert _row(table, "switch queue max") == ["50 KB", "200 KB"]
    assert _row(table, "switch queue p50") == ["0 B", "100 KB"]
    assert _row(table, "switch queue p99") == ["50 KB", "200 KB"]
    buckets = comparison.bucket_table()
    assert buckets is not None and len(buckets.rows) == 20
    # the first bucket (flows of 1 and 2 KB): p50 = a[1]
    assert buckets.rows[0] == ["2 KB", "2.00", "2.00", "2.00", "4.00", "4.00", "4.00"]
    assert buckets.rows[-1] == ["40 KB", "40.00", "40.00", "40.00", "-", "-", "-"]


def test_runs_that_finished_the_same_flows_use_hpccs_own_buckets(tmp_path: Path) -> None:
    a = make_flow_run(tmp_path, "a", _flows(1))
    b = make_flow_run(tmp_path, "b", _flows(5))
    comparison = load_comparison([a, b])
    assert comparison.scheme == "hpcc"
    buckets = comparison.bucket_table()
    assert buckets is not None and len(buckets.rows) == 20
    assert buckets.rows[-1] == ["40 KB", "40.00", "40.00", "40.00", "200.00", "200.00",
                                "200.00"]


def test_runs_of_different_flows_compare_by_size_range(tmp_path: Path) -> None:
    a = make_flow_run(tmp_path, "a", _flows(1))
    b = make_flow_run(tmp_path, "b", _flows(1, sizes=range(5, 60)))
    comparison = load_comparison([a, b])
    assert comparison.scheme == "sizes"
    buckets = comparison.bucket_table()
    assert buckets is not None
    assert [r[0] for r in buckets.rows] == ["<10KB", "10KB-100KB"]


def test_compare_writes_both_reports_and_prints_the_table(runs: list[Path], tmp_path: Path,
                                                          capsys) -> None:
    out = tmp_path / "cmp"
    assert main(["compare", *map(str, runs), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "slowdown p99" in printed and "PFC XOFF frames sent" in printed
    html, md = (out / "compare.html").read_text(), (out / "compare.md").read_text()
    assert "20261129T120501Z-none (none)" in md and "| slowdown p50" in md
    assert 'aria-label="FCT CDF"' in html and "http" not in html


def test_compare_without_o_makes_a_compare_run_dir(runs: list[Path], tmp_path: Path,
                                                   capsys) -> None:
    assert main(["compare", *map(str, runs), "--runs-dir", str(tmp_path / "runs")]) == 0
    [made] = (tmp_path / "runs").iterdir()
    assert made.name.endswith("-compare") and (made / "compare.md").exists()


def test_a_directory_that_is_not_a_run_is_named_and_exit_2(runs: list[Path], tmp_path: Path,
                                                           capsys) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["compare", str(runs[0]), str(empty), "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"testbed compare: {empty}: not a run directory" in err
    assert not (tmp_path / "o").exists()


def test_a_run_without_flows_is_named_and_exit_2(runs: list[Path], tmp_path: Path,
                                                 capsys) -> None:
    bare = make_flow_run(tmp_path, "bare", [])
    assert main(["compare", str(runs[0]), str(bare), "-o", str(tmp_path / "o")]) == 2
    assert f"{bare}: the run has no flows" in capsys.readouterr().err
    with pytest.raises(RunDirError, match="no flows"):
        load_comparison([bare])


def test_a_run_with_flows_csv_alone_compares_from_it(tmp_path: Path) -> None:
    a = make_flow_run(tmp_path, "db", _flows(1))
    b = make_flow_run(tmp_path, "csv", _flows(3), store=False)
    comparison = load_comparison([a, b])
    assert comparison.scheme == "hpcc"
    assert _row(comparison.table(), "slowdown p50") == ["21.00", "63.00"]
    paths = write_comparison(comparison, tmp_path / "out")
    assert paths.md.exists()
