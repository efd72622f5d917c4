"""`testbed compare`: runs side by side, from their run directories alone.

    comparison = load_comparison([run_a, run_b, ...])   # RunDirError naming a bad directory
    paths = write_comparison(comparison, out_dir)       # compare.html + compare.md

Any runs compare (RoCEv2 + DCQCN + PFC against Ultra Ethernet on lossy classes is what it
was widened for); what each shows depends on its workload. Per run: its label (the run
directory's name and each traffic entry's kind, transport and cc, from its config.yaml),
the workload's headline from summary.json's result rows (throughput: the bytes of every
row with start_us/end_us over the span they cover, or the udp rows' rx_fabric_bps summed;
algbw: the collective rows' algbw_gbps at their largest size; whether every row that
verified its data was right; retransmissions summed over the rows that count them), drops
(summary totals) and trims (trims summed over every port and class at the last sample);
for runs with flows, the FCT slowdown p50/p95/p99 over every finished flow and per bucket
by size (SCHEME_TEXT: HPCC's 5 % buckets when every run ran and finished the same flows;
HPCC's slices of all the flows when they ran the same flows but finished different
ones; else the fixed size ranges of slowdown_buckets' "sizes" scheme),
its unfinished flows, PFC pause frames sent and received (pause_tx and pause_rx summed
over every port and class at their last sample), the switch ports' queues (backlog_bytes
summed over classes per port, as HPCC's qlen monitor does, every sample of every switch
port pooled: p50, p99, max) and ECN marks (ecn_marks summed at the last sample). Where a
run has no counters database those come from summary.json's ports (no queue
percentiles then, only the peak).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from markupsafe import Markup

from testbed.report import plots
from testbed.report.content import Table, fmt_bytes, fmt_int
from testbed.report.fct import bucket_lines, bucket_name, fmt_slowdown, run_flows
from testbed.report.plots import XYLine
from testbed.report.rundir import RunData, RunDirError, load_run
from testbed.results.files import write_atomic
from testbed.results.flows import (
    Bucket,
    FlowSummary,
    edge_buckets,
    fct_cdf,
    flow_summary,
    hpcc_upper_bytes,
    pctl,
    slowdown_buckets,
)
from testbed.workloads.base import FlowRecord

FLOWS_KIND = "flows"
SCHEME_TEXT = {
    "hpcc": "Every run ran the same flows and finished the same ones, so each of HPCC's 20 "
            "buckets (5 % of the finished flows by size, analysis/fct_analysis.py) holds "
            "the same flows in every run.",
    "hpcc_edges": "Every run ran the same flows but not the same ones finished, so the "
                  "buckets are HPCC's 5 % slices of all the flows (finished or not), by "
                  "size up to each slice's largest; each run's percentiles are over its "
                  "finished flows in the bucket.",
    "sizes": "The runs ran different flows, so they are compared over fixed size ranges "
             "(<10KB, 10KB-100KB, 100KB-1MB, 1MB-10MB, >=10MB) instead of HPCC's buckets.",
    "none": "Not every run has flows, so there are no slowdowns by flow size.",
}


@dataclass
class Headline:
    """What a run's result rows say, whatever its workload (None: no row says it)."""

    throughput_gbps: float | None = None    # fabric Gb/s
    algbw_gbps: float | None = None         # fabric GB/s (nccl-tests' unit)
    retransmissions: int | None = None
    verified: bool | None = None            # every row that checked its data was right


@dataclass
class RunColumn:
    """One run of a comparison: what its column shows."""

    run_dir: Path
    label: str
    cc: str                             # the cc of its flows entries ('' if unknown)
    records: list[FlowRecord]
    summary: FlowSummary | None         # None: the run has no flows
    pause_tx: int
    pause_rx: int
    ecn_marks: int
    queue_p50_bytes: float | None       # switch ports, every sample pooled
    queue_p99_bytes: float | None
    queue_max_bytes: float | None
    buckets: list[Bucket] = field(default_factory=list)
    workload: str = ""                  # each entry's kind, transport and cc
    headline: Headline = field(default_factory=Headline)
    trims: int = 0
    drops: int | None = None


@dataclass
class Comparison:
    runs: list[RunColumn]
    scheme: str                         # SCHEME_TEXT's keys

    def table(self) -> Table:
        """The headline table, one column per run (the console prints it too)."""
        runs = self.runs
        rows: list[list[str]] = [["workload", *(r.workload or "-" for r in runs)]]

        def add(name: str, cells: list[str]) -> None:
            if any(c != "-" for c in cells):       # a row no run has says nothing
                rows.append([name, *cells])

        add("throughput (Gb/s)", [_num(r.headline.throughput_gbps, 2) for r in runs])
        add("algbw (GB/s)", [_num(r.headline.algbw_gbps, 3) for r in runs])
        add("data verified", ["-" if r.headline.verified is None
                              else "yes" if r.headline.verified else "NO" for r in runs])
        if any(r.summary is not None for r in runs):
            add("flows", ["-" if r.summary is None else fmt_int(r.summary.flows)
                          for r in runs])
            add("unfinished", ["-" if r.summary is None else fmt_int(r.summary.unfinished)
                               for r in runs])
            for name in ("p50", "p95", "p99"):
                add(f"slowdown {name}", ["-" if r.summary is None
                                         else fmt_slowdown(getattr(r.summary, name))
                                         for r in runs])
        add("retransmissions", ["-" if r.headline.retransmissions is None
                                else fmt_int(r.headline.retransmissions) for r in runs])
        add("drops", ["-" if r.drops is None else fmt_int(r.drops) for r in runs])
        rows += [["trims", *(fmt_int(r.trims) for r in runs)],
                 ["PFC XOFF frames sent", *(fmt_int(r.pause_tx) for r in self.runs)],
                 ["PFC frames received (XOFF + XON)", *(fmt_int(r.pause_rx) for r in self.runs)],
                 ["ECN marks", *(fmt_int(r.ecn_marks) for r in self.runs)]]
        for name in ("p50", "p99", "max"):
            rows.append([f"switch queue {name}",
                         *("-" if getattr(r, f"queue_{name}_bytes") is None
                           else fmt_bytes(getattr(r, f"queue_{name}_bytes"))
                           for r in self.runs)])
        return Table(["", *(r.label for r in self.runs)], rows,
                     [False] + [True] * len(self.runs))

    def bucket_table(self) -> Table | None:
        """Per bucket: its size, then p50/p95/p99 of each run. HPCC's buckets line up
        because every run ran the same flows; size ranges line up by definition."""
        kind = "sizes" if self.scheme == "sizes" else "hpcc"
        names: list[str] = []
        for r in self.runs:
            for b in r.buckets:
                name = bucket_name(b, kind)
                if name not in names:
                    names.append(name)
        if not names:
            return None
        by_run = [{bucket_name(b, kind): b for b in r.buckets} for r in self.runs]
        rows = []
        for name in names:
            row = [name]
            for buckets in by_run:
                found = buckets.get(name)
                row += ["-", "-", "-"] if found is None else [
                    fmt_slowdown(found.p50), fmt_slowdown(found.p95), fmt_slowdown(found.p99)]
            rows.append(row)
        columns = ["sizes" if self.scheme == "sizes" else "size up to"]
        for i in range(len(self.runs)):      # runs by letter: labels are long
            columns += [f"{run_key(i)} p50", f"{run_key(i)} p95", f"{run_key(i)} p99"]
        return Table(columns, rows, [False] + [True] * (len(columns) - 1))


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def run_key(i: int) -> str:
    """A, B, ..., Z, then R27, R28, ...: a run's short name in the bucket table."""
    return chr(ord("A") + i) if i < 26 else f"R{i + 1}"


def _flows_cc(run_dir: Path) -> str:
    """The cc (and cc_preset) of the run's flows entries, from its config.yaml."""
    try:
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return ""
    traffic = ((config or {}).get("workload") or {}).get("traffic") if isinstance(
        config, dict) else None
    found: list[str] = []
    for entry in traffic if isinstance(traffic, list) else []:
        if isinstance(entry, dict) and entry.get("kind") == FLOWS_KIND:
            cc = str(entry.get("cc", "dcqcn"))
            if entry.get("cc_preset"):
                cc += f"/{entry['cc_preset']}"
            if cc not in found:
                found.append(cc)
    return "+".join(found)


def _workload_label(run_dir: Path) -> str:
    """Each traffic entry's kind, transport (collectives) and cc, e.g. 'uet_incast nscc'."""
    try:
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return ""
    traffic = ((config or {}).get("workload") or {}).get("traffic") if isinstance(
        config, dict) else None
    found: list[str] = []
    for entry in traffic if isinstance(traffic, list) else []:
        if not isinstance(entry, dict) or not entry.get("kind"):
            continue
        words = [str(entry["kind"])]
        for key in ("transport", "cc", "entropy"):
            if entry.get(key) is not None:
                words.append(str(entry[key]))
        text = " ".join(words)
        if text not in found:
            found.append(text)
    return ", ".join(found)


def headline(summary: dict) -> Headline:
    """The throughput, algbw, verification and retransmissions of a run's result rows."""
    rows = [row for w in summary.get("workloads") or [] if isinstance(w, dict)
            for row in w.get("results") or [] if isinstance(row, dict)]
    out = Headline()
    spans = [(row["bytes"], row["start_us"], row["end_us"]) for row in rows
             if all(isinstance(row.get(k), (int, float)) for k in ("bytes", "start_us",
                                                                      "end_us"))]
    if spans:
        first, last = min(s for _b, s, _e in spans), max(e for _b, _s, e in spans)
        if last > first:
            out.throughput_gbps = sum(b for b, _s, _e in spans) * 8 / ((last - first) * 1e3)
    else:
        rx = [row["rx_fabric_bps"] for row in rows
              if isinstance(row.get("rx_fabric_bps"), (int, float))]
        if rx:
            out.throughput_gbps = sum(rx) / 1e9
    coll = [row for row in rows if isinstance(row.get("algbw_gbps"), (int, float))]
    if coll:
        largest = max(row.get("bytes") or 0 for row in coll)
        out.algbw_gbps = max(row["algbw_gbps"] for row in coll
                             if (row.get("bytes") or 0) == largest)
    checked = [row["verified"] for row in rows if isinstance(row.get("verified"), bool)]
    wrong = [row["wrong"] for row in rows if isinstance(row.get("wrong"), int)]
    if checked or wrong:
        out.verified = all(checked) and not any(wrong)
    retx = [row["retransmissions"] for row in rows
            if isinstance(row.get("retransmissions"), int)]
    if retx:
        out.retransmissions = sum(retx)
    return out


def _last_sum(run: RunData, counter: str) -> int | None:
    """`counter` summed over every series at its last sample; None without a database or
    when it holds no such series (then summary.json's port rows say)."""
    if run.store is None:
        return None
    values = run.store.last_values(counter)
    return int(sum(values.values())) if values else None


def _ports_sum(run: RunData, key: str) -> int:
    return int(sum(p.get(key) or 0 for p in run.summary.get("ports") or []))


def _queue_percentiles(run: RunData) -> tuple[float | None, float | None, float | None]:
    """p50, p99 and max of the switch ports' backlog (summed over classes), every sample."""
    if run.store is None:
        peak = max((p.get("max_queue_bytes") or 0 for p in run.summary.get("ports") or []),
                   default=None)
        return None, None, peak
    switches = {n.name for n in run.plan.switches()} if run.plan else None
    per_port: dict[tuple[str, str], dict[int, float]] = {}
    for (node, port, tc), pts in run.store.aligned("backlog_bytes").items():
        if tc < 0 or (switches is not None and node not in switches):
            continue
        sums = per_port.setdefault((node, port), {})
        for t, v in pts:
            sums[t] = sums.get(t, 0.0) + v
    values = sorted(v for sums in per_port.values() for v in sums.values())
    if not values:
        return None, None, None
    return pctl(values, 0.5), pctl(values, 0.99), values[-1]


def _flow_set(records: Sequence[FlowRecord]) -> list[tuple[str, str, int, int]]:
    return sorted((r.src, r.dst, r.size_bytes, r.start_ns) for r in records)


def _column(run_dir: Path) -> RunColumn:
    try:
        run = load_run(run_dir)
    except RunDirError as exc:
        raise RunDirError(f"{run_dir}: not a run directory ({exc})") from None
    with run:
        records, _source = run_flows(run)
        head = headline(run.summary)
        if not records and head == Headline():
            raise RunDirError(f"{run_dir}: the run has no results to compare (no result "
                              "rows in summary.json, no flows table in counters.sqlite and "
                              "no results/flows.csv)")
        cc = _flows_cc(run_dir)
        trims = _last_sum(run, "trims")
        drops = (run.summary.get("totals") or {}).get("drops")
        pause_tx = _last_sum(run, "pause_tx")
        pause_rx = _last_sum(run, "pause_rx")
        ecn_marks = _last_sum(run, "ecn_marks")
        q50, q99, qmax = _queue_percentiles(run)
        return RunColumn(
            run_dir=run_dir, label=run_dir.name + (f" ({cc})" if cc else ""), cc=cc,
            records=records, summary=flow_summary(records) if records else None,
            workload=_workload_label(run_dir), headline=head,
            trims=_ports_sum(run, "trims") if trims is None else trims,
            drops=drops if isinstance(drops, int) else None,
            pause_tx=_ports_sum(run, "pause_tx") if pause_tx is None else pause_tx,
            pause_rx=_ports_sum(run, "pause_rx") if pause_rx is None else pause_rx,
            ecn_marks=_ports_sum(run, "ecn_marks") if ecn_marks is None else ecn_marks,
            queue_p50_bytes=q50, queue_p99_bytes=q99, queue_max_bytes=qmax)


def load_comparison(run_dirs: Sequence[Path]) -> Comparison:
    """Read every run; RunDirError naming the directory for one that is not a run
    directory or has nothing to compare. FCT buckets only when every run has flows."""
    runs = [_column(Path(d)) for d in run_dirs]
    if not all(r.records for r in runs):
        return Comparison(runs, "none")
    same_flows = len({tuple(_flow_set(r.records)) for r in runs}) == 1
    same_finished = len({tuple(_flow_set([f for f in r.records if f.fct_ns is not None]))
                         for r in runs}) == 1
    if same_flows and same_finished:
        scheme = "hpcc"
        for r in runs:
            r.buckets = slowdown_buckets(r.records, "hpcc")
    elif same_flows:
        # HPCC slices the finished flows: where different flows finished, its slices
        # would hold different flows in each run, so slice every flow instead
        scheme = "hpcc_edges"
        edges = hpcc_upper_bytes(runs[0].records)
        for r in runs:
            r.buckets = edge_buckets(r.records, edges)
    else:
        scheme = "sizes"
        for r in runs:
            r.buckets = slowdown_buckets(r.records, "sizes")
    return Comparison(runs, scheme)


def context(comparison: Comparison) -> dict:
    """What compare.html.j2 and compare.md.j2 render."""
    runs = comparison.runs
    svgs = []
    lines = [line for i, r in enumerate(runs) for line in bucket_lines(r.buckets, r.label, i)]
    if any(line.points for line in lines):
        svgs.append(plots.xy_plot(
            lines, "cmp-buckets", "slowdown by flow size" + (
                " (size ranges)" if comparison.scheme == "sizes" else " (HPCC's 5 % buckets)"),
            "flow size up to (bytes, log)", "slowdown (FCT / ideal)", log_x=True))
    cdfs = [XYLine(r.label, fct_cdf(r.records), i) for i, r in enumerate(runs)]
    if any(c.points for c in cdfs):
        svgs.append(plots.xy_plot(cdfs, "cmp-cdf", "FCT CDF",
                                  "flow completion time (fabric us, log)",
                                  "fraction of finished flows", log_x=True, steps=True,
                                  x_divisor=1e3))
    scheme_text = SCHEME_TEXT[comparison.scheme]
    return {"runs": [{"key": run_key(i), "label": r.label, "dir": str(r.run_dir),
                      "cc": r.cc or "unknown", "workload": r.workload or "unknown"}
                     for i, r in enumerate(runs)],
            "side_by_side": comparison.table(), "buckets": comparison.bucket_table(),
            "scheme_text": scheme_text, "scheme": comparison.scheme, "svgs": svgs}


@dataclass(frozen=True)
class ComparePaths:
    html: Path
    md: Path


def write_comparison(comparison: Comparison, out_dir: Path) -> ComparePaths:
    """compare.html (self-contained) and compare.md in `out_dir` (made if missing)."""
    from testbed.report.render import render_template

    out_dir = Path(out_dir)
    out_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    ctx = context(comparison)
    paths = ComparePaths(out_dir / "compare.html", out_dir / "compare.md")
    write_atomic(paths.html, render_template(
        "compare.html.j2", {**ctx, "svgs": [Markup(s) for s in ctx["svgs"]]}, html=True))
    write_atomic(paths.md, render_template("compare.md.j2", ctx, html=False))
    return paths
