"""`testbed report RUN_DIR`: rebuild a run's report from its run directory alone."""

from __future__ import annotations

import sys
from pathlib import Path

from testbed.cli.common import EXIT_FAIL, EXIT_OK, EXIT_USAGE


def add_parser(sub):
    p = sub.add_parser(
        "report", help="write report.html + report.md (or Prometheus metrics) for a run directory",
        description="Rebuild the report of a run from its run directory alone (no root needed).")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory, runs/<UTC time>-<name>/")
    p.add_argument("--format", choices=("html", "prometheus"), default="html",
                   help="html: report.html + report.md in RUN_DIR (default); prometheus: final "
                        "counters in Prometheus text format")
    p.add_argument("--out", metavar="FILE",
                   help="where --format prometheus writes (default RUN_DIR/metrics.prom)")
    return p


def run(args) -> int:
    from testbed.report import RunDirError, build_report, write_prometheus

    run_dir = Path(args.run_dir)
    try:
        if args.format == "prometheus":
            out = Path(args.out) if args.out else run_dir / "metrics.prom"
            write_prometheus(run_dir, out)
            print(out)
        else:
            if args.out:
                print("testbed report: --out applies to --format prometheus only",
                      file=sys.stderr)
                return EXIT_USAGE
            paths = build_report(run_dir)
            print(paths.html)
            print(paths.md)
    except RunDirError as exc:
        print(f"testbed report: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:
        print(f"testbed report: cannot write: {exc}", file=sys.stderr)
        return EXIT_FAIL
    except Exception as exc:          # noqa: BLE001 - never a traceback on a damaged run dir
        # load_run checks every file; damage it does not know reaches here. Name the
        # directory and the error rather than print a traceback (docs/report.md).
        print(f"testbed report: {run_dir}: cannot make a report: {type(exc).__name__}: {exc} "
              "(a damaged file the reader does not check yet; please report it)",
              file=sys.stderr)
        return EXIT_USAGE
    return EXIT_OK
