"""`testbed compare RUN_A RUN_B [...] [-o DIR]`: runs side by side (throughput, algbw,
data verified, FCT slowdowns overall and by flow size for runs with flows, unfinished
flows, retransmissions, drops, trims, PFC pauses, queues, ECN marks) in one report,
compare.html + compare.md, and the headline table on the console."""

from __future__ import annotations

import sys
from pathlib import Path

from testbed.cli.common import EXIT_FAIL, EXIT_OK, EXIT_USAGE, wide_console


def add_parser(sub):
    p = sub.add_parser(
        "compare", help="put runs side by side (throughput, FCT, algbw, retransmissions, "
                        "trims, PFC, queues, ECN)",
        description="Compare runs from their run directories alone (e.g. RoCEv2 + DCQCN + "
                    "PFC against UET on lossy classes): compare.html + compare.md in DIR "
                    "(no root needed). FCT slowdowns by flow size when every run has flows.")
    p.add_argument("run_dirs", metavar="RUN_DIR", nargs="+",
                   help="run directories, runs/<UTC time>-<name>/ (two or more)")
    p.add_argument("-o", "--out", metavar="DIR",
                   help="where the report goes (default RUNS_DIR/<UTC time>-compare/)")
    p.add_argument("--runs-dir", default="runs",
                   help="where the default output directory is made (default runs/)")
    return p


def run(args) -> int:
    from rich.markup import escape
    from rich.table import Table as RichTable

    from testbed.report import RunDirError
    from testbed.report.compare import load_comparison, write_comparison
    from testbed.run.rundir import create_run_dir

    if len(args.run_dirs) < 2:
        print("testbed compare: give two or more run directories", file=sys.stderr)
        return EXIT_USAGE
    try:
        comparison = load_comparison([Path(d) for d in args.run_dirs])
    except RunDirError as exc:
        print(f"testbed compare: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:          # noqa: BLE001 - never a traceback on a damaged run dir
        print(f"testbed compare: cannot read the runs: {type(exc).__name__}: {exc} (a damaged "
              "file the reader does not check yet; please report it)", file=sys.stderr)
        return EXIT_USAGE
    try:
        out = Path(args.out) if args.out else create_run_dir(Path(args.runs_dir), "compare")
        paths = write_comparison(comparison, out)
    except OSError as exc:
        print(f"testbed compare: cannot write: {exc}", file=sys.stderr)
        return EXIT_FAIL
    table = comparison.table()
    shown = RichTable(title="testbed compare")
    for i, column in enumerate(table.columns):
        shown.add_column(escape(column), justify="right" if table.numeric[i] else "left")
    for row in table.rows:
        shown.add_row(*(escape(c) for c in row))
    console = wide_console()
    console.print(shown)
    print(paths.html)
    print(paths.md)
    return EXIT_OK
