"""Stage 6: reports, from a run directory alone.

    build_report(run_dir)          -> ReportPaths   (report.html + report.md in run_dir)
    write_prometheus(run_dir, out) -> None          (final counters, Prometheus text format)

Inputs are the run directory's `summary.json`, `plan.json`, `metadata.json`
and `counters.sqlite` (docs/run-format.md). A run killed before it wrote its
summary still gets a report: the summary is rebuilt from the counters and
the report says so. A file written by a newer testbed raises RunFormatError;
a directory that is not a run directory raises RunDirError.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from testbed.report.rundir import (
    RUN_FORMAT_VERSION,
    RunData,
    RunDirError,
    RunFormatError,
    load_run,
    rebuild_summary,
)

__all__ = ["RUN_FORMAT_VERSION", "ReportPaths", "RunData", "RunDirError", "RunFormatError",
           "build_report", "load_run", "rebuild_summary", "write_prometheus"]


@dataclass(frozen=True)
class ReportPaths:
    html: Path
    md: Path


def build_report(run_dir: Path) -> ReportPaths:
    """Write report.html (self-contained, offline) and report.md into the run directory."""
    from testbed.report.content import build_context
    from testbed.report.render import render_html, render_md
    from testbed.results.files import write_atomic

    run_dir = Path(run_dir)
    with load_run(run_dir) as run:
        ctx = build_context(run)
    paths = ReportPaths(run_dir / "report.html", run_dir / "report.md")
    write_atomic(paths.html, render_html(ctx))
    write_atomic(paths.md, render_md(ctx))
    return paths


def write_prometheus(run_dir: Path, out: Path) -> None:
    """Final counters as Prometheus text, written to `out.tmp` and renamed to `out`.

    Inside the run directory the file is 0600 like every other file there;
    elsewhere (a node_exporter textfile directory) it is 0644 so the
    collector, which usually runs as another user, can read it.
    """
    from testbed.report.prometheus import prometheus_text, write_text_file

    run_dir, out = Path(run_dir), Path(out)
    with load_run(run_dir) as run:
        text = prometheus_text(run.summary, run.metadata, incomplete=run.rebuilt,
                               reader_notes=len(run.notes))
    inside = out.resolve().parent == run_dir.resolve()
    write_text_file(out, text, 0o600 if inside else 0o644)
