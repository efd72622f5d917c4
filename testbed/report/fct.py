"""The report's FCT section: sized flows' completion times against their ideal
(testbed/results/flows.py), for runs with flows (kind: flows).

- a summary line: flows, finished, unfinished, median and p99 slowdown;
- HPCC's slowdown table (analysis/fct_analysis.py's 5 % buckets by size: size up to,
  flows, p50/p95/p99 slowdown) and its plot on a log size axis;
- the FCT CDF of the finished flows;
- the flows that did not finish (src, dst, size, start), the first MAX_UNFINISHED_ROWS.

The flows come from the counters database's `flows` table, or from results/flows.csv
where the database has none (run_flows). `testbed compare` reads them the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

from testbed.report import plots
from testbed.report.content import Table, fmt_bytes, fmt_duration, fmt_int
from testbed.report.plots import XYLine
from testbed.report.rundir import RunData
from testbed.results.flows import (
    FLOWS_CSV,
    Bucket,
    fct_cdf,
    flow_summary,
    read_flows_csv,
    slowdown_buckets,
    unfinished,
)
from testbed.workloads.base import FlowRecord

MAX_UNFINISHED_ROWS = 50
PERCENTILE_STYLES = (("p50", "-"), ("p95", "--"), ("p99", ":"))


def run_flows(run: RunData) -> tuple[list[FlowRecord], str]:
    """The run's flow records and where they were read from ('' when it has none)."""
    if run.store is not None:
        records = run.store.flows()
        if records:
            return records, "counters.sqlite (flows table)"
    path = run.run_dir / "results" / FLOWS_CSV
    if path.exists():
        try:
            records = read_flows_csv(path)
        except (OSError, ValueError):
            return [], ""
        if records:
            return records, f"results/{FLOWS_CSV}"
    return [], ""


def fmt_slowdown(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def bucket_name(b: Bucket, scheme: str = "hpcc") -> str:
    """HPCC's buckets by their largest size; fixed ranges by their range."""
    return fmt_bytes(b.size_max_bytes) if scheme == "hpcc" and b.size_max_bytes else b.label


def bucket_table(buckets: Sequence[Bucket], scheme: str = "hpcc", note: str = "") -> Table:
    return Table(["size up to" if scheme == "hpcc" else "sizes", "flows", "p50 slowdown",
                  "p95 slowdown", "p99 slowdown"],
                 [[bucket_name(b, scheme), fmt_int(b.count), fmt_slowdown(b.p50),
                   fmt_slowdown(b.p95), fmt_slowdown(b.p99)] for b in buckets],
                 [False, True, True, True, True], note)


def bucket_lines(buckets: Sequence[Bucket], label: str = "", color: int = 0) -> list[XYLine]:
    """p50/p95/p99 slowdown per bucket against its largest size (dashes tell them apart)."""
    prefix = f"{label} " if label else ""
    return [XYLine(f"{prefix}{name}", [(float(b.size_max_bytes or b.size_min_bytes),
                                        getattr(b, name)) for b in buckets],
                   color if label else i, dash, "o")
            for i, (name, dash) in enumerate(PERCENTILE_STYLES)]


def summary_text(records: Sequence[FlowRecord]) -> str:
    s = flow_summary(records)
    text = (f"{fmt_int(s.flows)} flows: {fmt_int(s.finished)} finished, "
            f"{fmt_int(s.unfinished)} unfinished")
    if s.finished:
        text += (f"; slowdown (FCT / ideal FCT, at least 1) median {fmt_slowdown(s.p50)}, "
                 f"p99 {fmt_slowdown(s.p99)}")
    return text + "."


def unfinished_table(records: Sequence[FlowRecord]) -> tuple[Table | None, int]:
    """The first MAX_UNFINISHED_ROWS unfinished flows by start, and how many there are."""
    left = unfinished(records)
    if not left:
        return None, 0
    shown = left[:MAX_UNFINISHED_ROWS]
    note = (f"and {fmt_int(len(left) - len(shown))} more" if len(left) > len(shown) else "")
    return Table(["workload", "src", "dst", "size", "start (fabric)"],
                 [[r.workload or "-", r.src, r.dst, fmt_bytes(r.size_bytes),
                   fmt_duration(r.start_ns)] for r in shown],
                 [False, False, False, True, True], note), len(left)


def fct_section(run: RunData) -> dict | None:
    """The FCT section's data, or None when the run has no flows."""
    records, source = run_flows(run)
    if not records:
        return None
    buckets = slowdown_buckets(records)
    svgs = []
    if buckets:
        svgs.append(plots.xy_plot(bucket_lines(buckets), "fct-buckets",
                                  "slowdown by flow size (HPCC's 5 % buckets)",
                                  "flow size up to (bytes, log)", "slowdown (FCT / ideal)",
                                  log_x=True))
    cdf = fct_cdf(records)
    if cdf:
        svgs.append(plots.xy_plot([XYLine("finished flows", cdf)], "fct-cdf",
                                  "FCT CDF", "flow completion time (fabric us, log)",
                                  "fraction of finished flows", log_x=True, steps=True,
                                  x_divisor=1e3))
    table, left = unfinished_table(records)
    return {"summary": summary_text(records), "source": source,
            "buckets": bucket_table(buckets) if buckets else None, "svgs": svgs,
            "unfinished": table, "unfinished_count": left}
