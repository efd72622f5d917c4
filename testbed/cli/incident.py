"""`testbed incident list|validate|run|judge`: the incident library (docs/incidents.md)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from rich.markup import escape
from rich.table import Table

from agents.runtime.argtypes import nonneg_int
from testbed.cli.common import (
    EXIT_FAIL,
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    print_json,
    require_root,
    wide_console,
)
from testbed.config import ConfigError
from testbed.units import format_size

DEFAULT_SUITE = "configs/suites/incidents.yaml"


def add_parser(sub):
    p = sub.add_parser("incident", help="reproduce known RoCE fabric failures: list, run, "
                                        "judge")
    verbs = p.add_subparsers(dest="incident_verb", metavar="ACTION", required=True)
    ls = verbs.add_parser("list", help="every incident in configs/incidents/")
    ls.add_argument("--dir", default="configs/incidents", help="where incidents are")
    ls.add_argument("--format", choices=("table", "json"), default="table")
    val = verbs.add_parser("validate", help="check incident files (both variants) without "
                                            "running them")
    val.add_argument("incidents", nargs="+", metavar="NAME|FILE")
    val.add_argument("--dir", default="configs/incidents", help="where names are looked up")
    run = verbs.add_parser("run", help="run the control, then the incident; exit 0 iff it "
                                       "reproduced and its control did not")
    run.add_argument("incident", nargs="?", metavar="NAME|FILE")
    run.add_argument("--control", action="store_true", help="run only the control variant")
    run.add_argument("--suite", metavar="FILE", help=f"run every incident a suite names "
                     f"(e.g. {DEFAULT_SUITE}) and write an index")
    run.add_argument("--dir", default="configs/incidents", help="where names are looked up")
    run.add_argument("--runs-dir", default="runs", help="where run directories go (default "
                                                        "runs/)")
    run.add_argument("--capture", action="store_true", help="write pcap files of every host "
                                                            "NIC")
    run.add_argument("--capture-snaplen", type=nonneg_int, default=0, metavar="BYTES",
                     help="with --capture: keep the first BYTES of each frame")
    run.add_argument("--quiet", action="store_true", help="print only the verdicts and run "
                                                          "directories")
    judge = verbs.add_parser("judge", help="evaluate an incident's signature on a finished "
                                           "run directory and write its verdict")
    judge.add_argument("incident", metavar="NAME|FILE")
    judge.add_argument("run_dir", metavar="RUN_DIR")
    judge.add_argument("--variant", choices=("incident", "control"), default="incident")
    judge.add_argument("--baseline", metavar="RUN_DIR", help="the control run (for of: "
                                                             "control)")
    judge.add_argument("--dir", default="configs/incidents", help="where names are looked up")
    return p


def _load(name: str, directory: str):
    from testbed.incident.load import incident_path, load_incident

    path = incident_path(name, Path(directory))
    try:
        return load_incident(path)
    except ConfigError as exc:
        for line in exc.lines():
            print(line, file=sys.stderr)
        raise CliError(f"{len(exc.problems)} problem(s) in {path}", EXIT_USAGE) from None


def _list(args) -> int:
    from testbed.incident.load import incident_files

    rows, bad = [], 0
    for path in incident_files(Path(args.dir)):
        try:
            loaded = _load(str(path), args.dir)
        except CliError as exc:
            print(exc, file=sys.stderr)
            bad += 1
            continue
        inc = loaded.incident
        rows.append({"name": loaded.name, "title": inc.title, "source": inc.source,
                     "fault": inc.fault, "control": inc.control.description})
    if args.format == "json":
        print_json(rows)
    else:
        table = Table(title=f"incidents in {args.dir}")
        for column in ("name", "title", "source", "fault", "control"):
            table.add_column(column, overflow="fold")
        for r in rows:
            table.add_row(*(r[c] for c in ("name", "title", "source", "fault", "control")))
        wide_console().print(table)
    return EXIT_USAGE if bad else EXIT_OK


def _validate(args) -> int:
    worst = EXIT_OK
    for name in args.incidents:
        try:
            loaded = _load(name, args.dir)
        except CliError as exc:
            print(exc, file=sys.stderr)
            worst = exc.code
            continue
        print(f"{loaded.path}: ok: {len(loaded.incident.signature)} predicate(s), "
              f"control: {loaded.incident.control.description}")
    return worst


def _mark(held: object) -> str:
    if held is None:
        return "[yellow]no data[/]"
    return "[green]holds[/]" if held else "[red]no[/]"


def _shown(value: object, unit: str) -> str:
    if value is None:
        return "-"
    return f"{value:,.4g} {unit}".rstrip() if isinstance(value, int | float) else str(value)


def print_verdicts(console, outcome) -> None:
    """One table per incident: each predicate's measured value beside its threshold, per
    variant run."""
    table = Table(title=f"incident {outcome.name}: {outcome.title}")
    for column in ("predicate", "variant", "measured", "op", "threshold", "held", "detail"):
        table.add_column(column, overflow="fold",
                         justify="right" if column in ("measured", "threshold") else "left")
    verdicts = {v: o.verdict for v, o in outcome.variants.items() if o.verdict}
    names = [p["name"] for v in verdicts.values() for p in v["predicates"]]
    for name in dict.fromkeys(names):
        for variant in ("incident", "control"):
            verdict = verdicts.get(variant)
            if verdict is None:
                continue
            p = next(p for p in verdict["predicates"] if p["name"] == name)
            first = variant == "incident" or "incident" not in verdicts
            what = p["name"] if p["text"] == p["name"] else f"{p['name']}: {p['text']}"
            table.add_row(escape(what) if first else "", variant, _shown(p["value"], p["unit"]),
                          p["op"], _shown(p["threshold"], p["unit"]), _mark(p["held"]),
                          escape(str(p["detail"] or "")))
    console.print(table)
    for variant, o in outcome.variants.items():
        v = o.verdict
        if o.error:
            console.print(f"[red]{variant}[/]: {escape(str(o.error))}")
        if v is None:
            continue
        word = "REPRODUCED" if v["reproduced"] else "not reproduced"
        expect = "as expected" if o.as_expected else "[red]NOT as expected[/]"
        reason = f" ({escape(v['reason'])})" if v.get("reason") else ""
        console.print(f"{variant}: {word}, {expect}{reason}  {o.run_dir}/report.html")


def run_options(args):
    from testbed.run.calibration import load_budget_bps
    from testbed.run.runner import RunOptions

    quiet = getattr(args, "quiet", False)
    last = [0.0]

    def say(msg: str) -> None:
        if not quiet:
            print(msg, flush=True)

    def on_sample(phase, totals, elapsed) -> None:
        if quiet or time.monotonic() - last[0] < 2.0:
            return
        last[0] = time.monotonic()
        print(f"run: {phase} t={max(0, totals.last_sample_fabric_ns) / 1e3:,.0f}us fabric "
              f"({elapsed:.1f}s wall) drops={totals.drops} "
              f"max_queue={format_size(totals.max_backlog_bytes)}", flush=True)

    budget, _ = load_budget_bps()
    return RunOptions(runs_root=Path(getattr(args, "runs_dir", "runs")),
                      capture=getattr(args, "capture", False),
                      capture_snaplen=getattr(args, "capture_snaplen", 0),
                      budget_bps=budget, say=say, on_sample=on_sample)


def is_incident_suite(path: str, directory: str = "configs/incidents") -> bool:
    """Whether `path` is an incident suite (one with `incidents:`); a broken one counts."""
    from testbed.incident.suite import SuiteError, suite_incidents

    try:
        return suite_incidents(path, Path(directory)) is not None
    except SuiteError:
        return True


def run_incident_suite(path: str, args, directory: str = "configs/incidents") -> int | None:
    """Run an incident suite file; None if `path` is not one (`testbed run` asks too)."""
    from testbed.incident.suite import SuiteError, run_suite, suite_incidents

    try:
        files = suite_incidents(path, Path(directory))
    except SuiteError as exc:
        print(exc, file=sys.stderr)
        return EXIT_USAGE
    if files is None:
        return None
    console = wide_console()
    result = run_suite(files, run_options(args),
                       on_outcome=lambda o: print_verdicts(console, o))
    for error in result.errors:
        print(error, file=sys.stderr)
    assert result.index is not None
    passed = sum(o.ok for o in result.outcomes)
    console.print(f"{passed} of {len(files)} incidents reproduced with a clean control; "
                  f"index: {result.index.html}")
    print(result.index.html.parent)
    if result.interrupted:
        return 130
    return EXIT_OK if result.ok else EXIT_FAIL


def _run(args) -> int:
    if bool(args.suite) == bool(args.incident):
        raise CliError("give an incident (NAME or FILE) or --suite FILE, not both",
                       EXIT_USAGE)
    if args.suite:
        require_root("incident run")
        code = run_incident_suite(args.suite, args, args.dir)
        if code is None:
            raise CliError(f"{args.suite} is not an incident suite (a mapping with "
                           "incidents: [names] or incidents: all)", EXIT_USAGE)
        return code
    from testbed.incident.run import run_incident

    loaded = _load(args.incident, args.dir)
    require_root("incident run")
    outcome = run_incident(loaded, run_options(args), control_only=args.control)
    print_verdicts(wide_console(), outcome)
    for o in outcome.variants.values():
        if o.run_dir:
            print(o.run_dir)
    if outcome.interrupted:
        return 130
    return EXIT_OK if outcome.ok else EXIT_FAIL


def _judge(args) -> int:
    from testbed.incident.run import IncidentOutcome, VariantOutcome, judge_run
    from testbed.report import build_report

    loaded = _load(args.incident, args.dir)
    run_dir = Path(args.run_dir)
    baseline = Path(args.baseline) if args.baseline else None
    try:
        verdict = judge_run(loaded, args.variant, run_dir, baseline)
    except (OSError, ValueError) as exc:
        raise CliError(f"{run_dir}: cannot judge: {exc}") from None
    build_report(run_dir)
    outcome = IncidentOutcome(loaded.name, loaded.incident.title,
                              {args.variant: VariantOutcome(args.variant, run_dir, verdict)})
    print_verdicts(wide_console(), outcome)
    return EXIT_OK if verdict["as_expected"] else EXIT_FAIL


def run(args) -> int:
    actions = {"list": _list, "validate": _validate, "run": _run, "judge": _judge}
    try:
        return actions[args.incident_verb](args)
    except CliError as exc:
        print(exc, file=sys.stderr)
        return exc.code
