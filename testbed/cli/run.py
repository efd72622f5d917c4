"""`testbed run [FILE]`: run a fabric's workload (or a suite of runs) and write a run directory.

A suite with `incidents:` (configs/suites/incidents.yaml) runs as `testbed incident run
--suite FILE` does. A suite with `runs:` runs each config in turn; with `compare: true`
it then puts every run that finished side by side in one `testbed compare` report,
runs/<UTC time>-<suite>-compare/ (configs/suites/uet-vs-roce.yaml)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import yaml
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from agents.runtime.argtypes import nonneg_int
from testbed.cli.common import (
    EXIT_FAIL,
    EXIT_OK,
    CliError,
    add_pfc_grouping_flag,
    load_and_plan,
    require_root,
    wide_console,
)
from testbed.cli.vmmode import add_vm_part_flags, require_kernel_features
from testbed.units import format_rate, format_size
from testbed.workloads.registry import REGISTRY

DEFAULT_CONFIG = "configs/default.yaml"


def add_parser(sub):
    p = sub.add_parser("run", help="up, workload, sample, down, report; prints the run directory")
    p.add_argument("file", nargs="?",
                   help=f"fabric with a workload, or a suite: runs: or incidents: (default "
                        f"{DEFAULT_CONFIG})")
    p.add_argument("--runs-dir", default="runs", help="where run directories go (default runs/)")
    p.add_argument("--capture", action="store_true", help="write pcap files of every host NIC")
    p.add_argument("--capture-snaplen", type=nonneg_int, default=0, metavar="BYTES",
                   help="with --capture: keep the first BYTES of each frame (default 0: whole "
                        "frames, so RoCE packets keep their ICRC; 128 keeps the headers of "
                        "the longest RoCE packet and makes the files ~30x smaller)")
    p.add_argument("--keep", action="store_true", help="leave the fabric up afterwards")
    p.add_argument("--quiet", action="store_true", help="print only the run directory")
    add_pfc_grouping_flag(p)
    add_vm_part_flags(p, default_file=DEFAULT_CONFIG)
    p.add_argument("--start-at-unix-ns", type=nonneg_int, metavar="NS",
                   help="with --vms: the common start instant of every VM's part, "
                        "CLOCK_REALTIME in ns (the controller picks it a few seconds ahead)")
    p.add_argument("--stop-file", metavar="PATH",
                   help="with --vms: once this VM's own senders are done, keep serving the "
                        "other VMs' senders until PATH exists (the controller writes it when "
                        "every VM's run directory has its senders-done marker)")
    return p


def suite_runs(path: str) -> list[str] | None:
    """A suite is a YAML mapping with `runs:` (config paths, relative to the suite file)."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return None
    if isinstance(data, dict) and "runs" in data and "topology" not in data:
        base = Path(path).parent
        return [str((base / r).resolve()) if not Path(r).is_absolute() else r
                for r in data["runs"]]
    return None


def suite_compares(path: str) -> bool:
    """Whether a `runs:` suite asks for one comparison of its runs (`compare: true`)."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(data, dict) and data.get("compare") is True


def compare_suite(path: str, run_dirs: list[Path], args) -> int:
    """The suite's runs side by side: compare.html + compare.md in a new run directory."""
    from testbed.report import RunDirError
    from testbed.report.compare import load_comparison, write_comparison
    from testbed.run.rundir import create_run_dir

    if len(run_dirs) < 2:
        print(f"run: {path}: fewer than two runs finished, so there is nothing to compare",
              file=sys.stderr)
        return EXIT_OK
    try:
        comparison = load_comparison(run_dirs)
        out = create_run_dir(Path(args.runs_dir), f"{Path(path).stem}-compare")
        paths = write_comparison(comparison, out)
    except (RunDirError, OSError) as exc:
        print(f"run: {path}: cannot compare its runs: {exc}", file=sys.stderr)
        return 1
    if not args.quiet:
        print(f"comparison: {paths.html}  (and compare.md)")
    print(out)
    return EXIT_OK


def _progress_table(name: str, phase: str, totals, elapsed_wall_s: float) -> Table:
    table = Table(title=f"run {name}", show_header=False)
    starting = totals.last_sample_fabric_ns < 0
    table.add_row("phase", "starting agents" if starting else phase)
    table.add_row("elapsed", f"{max(0, totals.last_sample_fabric_ns) / 1e3:,.1f} us fabric, "
                  f"{elapsed_wall_s:.1f} s wall")
    table.add_row("delivered", f"{format_size(totals.delivered_bytes)} "
                  f"({format_rate(totals.delivered_fabric_bps)} fabric now)")
    table.add_row("drops", str(totals.drops))
    table.add_row("max queue", format_size(totals.max_backlog_bytes))
    return table


def run_one(path: str, args, done: list[Path] | None = None) -> int:
    from testbed.run.calibration import load_budget_bps
    from testbed.run.runner import RunOptions, run_config

    console = wide_console()
    budget, _ = load_budget_bps()
    try:
        compile_start = time.monotonic_ns()
        loaded, plan = load_and_plan(path)
        compiled = (compile_start, time.monotonic_ns())
        require_kernel_features(plan, "run", path)
        if loaded.fabric.workload is None or not loaded.fabric.workload.traffic:
            raise CliError(f"run: {path} has no workload: section with traffic; add one "
                           "(see configs/examples/) or use `testbed smoke` to check the "
                           "fabric", 2)
        part = part_run_of(path, args, loaded, plan) if getattr(args, "vms", None) else None
    except CliError as exc:
        print(exc, file=sys.stderr)
        return exc.code
    quiet = args.quiet
    live_ui = console.is_terminal and not quiet
    last_line = [0.0]

    def say(msg: str) -> None:
        if not quiet:
            console.print(msg)

    def on_sample(phase, totals, elapsed):
        if live is not None:
            live.update(_progress_table(loaded.fabric.name, phase, totals, elapsed))
        elif not quiet and time.monotonic() - last_line[0] >= 2.0:
            last_line[0] = time.monotonic()
            shown = "starting agents" if totals.last_sample_fabric_ns < 0 else phase
            print(f"run: {shown} t={max(0, totals.last_sample_fabric_ns) / 1e3:,.0f}us fabric "
                  f"({elapsed:.1f}s wall) delivered={format_size(totals.delivered_bytes)} "
                  f"drops={totals.drops} max_queue={format_size(totals.max_backlog_bytes)}",
                  flush=True)

    options = RunOptions(runs_root=Path(args.runs_dir), capture=args.capture,
                         capture_snaplen=args.capture_snaplen, keep_up=args.keep,
                         budget_bps=budget, say=say, on_sample=on_sample, part=part,
                         compile_mono_ns=compiled,
                         pfc_nodes_per_process=args.pfc_nodes_per_process)
    live = Live(console=console, auto_refresh=False, transient=True) if live_ui else None
    if live is not None:
        live.start()
    try:
        result = run_config(loaded, plan, options)
    finally:
        if live is not None:
            live.stop()
    summary = result.summary
    if not result.interrupted and not result.failed and part is None:
        _learn(result.summary, plan, console, quiet)
    if not quiet:
        _print_summary(console, summary)
        report = result.run_dir / "report.html"
        if report.exists():
            console.print(f"report: {report}  (and report.md, summary.json, counters.sqlite)")
    print(result.run_dir)
    if done is not None and not result.interrupted:
        done.append(result.run_dir)
    if result.interrupted:
        return 130
    # a stage failed (an agent did not start...) or a fault ended the run (an agent died,
    # the disk filled): its data is kept, but it is not the run asked for
    # (docs/run-format.md, summary.json `failed` and Faults during a run)
    return EXIT_FAIL if result.failed or result.fault else EXIT_OK


def _learn(summary: dict, plan, console, quiet: bool) -> None:
    """The run's outcome teaches this machine's derating (testbed/run/calibration.py)."""
    from testbed.run.calibration import record_run

    learned = record_run(summary, plan.dilation.model_dump())
    if learned and not quiet:
        console.print(f"calibration: {learned}")


def part_run_of(path: str, args, loaded, plan):
    """One VM's part of a run over several VMs, or CliError (exit 2) for what a part run
    cannot do yet (each refusal says so before anything is built)."""
    from testbed.cli.plan import part_of, same_plan_everywhere
    from testbed.run.pinning import pinned_senders
    from testbed.run.runner import PartRun
    from testbed.run.workload import expand_workload

    if args.start_at_unix_ns is None:
        raise CliError("run: --vms needs --start-at-unix-ns: the common start instant "
                       "every VM's part is given", 2)
    same_plan_everywhere(path, loaded)
    placement, part = part_of(args.vms, args.vm, path, plan)
    problems = []
    if loaded.fabric.events:
        problems.append("a fault timeline (events:) is not applied across VMs yet")
    rxe = [n.name for n in plan.hosts() if n.endpoint == "rxe"]
    if rxe:
        problems.append(f"rxe hosts ({', '.join(rxe)}) are not built across VMs yet")
    pinned = pinned_senders(expand_workload(loaded.fabric, plan))
    if pinned:
        problems.append(f"paths pinned with via: ({', '.join(pinned)}) are looked up "
                        "hop by hop, which a VM cannot do for another VM's nodes")
    if problems:
        raise CliError(f"run: {path} over VMs ({args.vms}): " + "; ".join(problems), 2)
    first = placement.vms[0]          # the clock reference: the VMs file's first VM
    mine = next(v for v in placement.vms if v.name == args.vm)
    return PartRun(part=part, start_at_unix_ns=args.start_at_unix_ns,
                   underlay_netns=args.underlay_netns,
                   stop_file=Path(args.stop_file) if args.stop_file else None,
                   reference=(first.name, first.underlay), local_underlay=mine.underlay)


def _cell(field: str, value: object) -> str:
    """A result value for the console: rates with units, counts with separators."""
    if value is None:
        return "-"
    if field.endswith("_bps") and isinstance(value, int | float):
        return format_rate(value)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    # 3 significant digits, but never an exponent: 6,340 us, not 6.34e+03
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:,.3g}"


def _print_summary(console, summary: dict) -> None:
    table = Table(title=f"{summary['name']}: D={summary['dilation']}, "
                  f"{summary['duration_fabric_ns'] / 1e3:,.0f} us fabric, "
                  f"{summary['duration_wall_s']:.1f} s wall"
                  + (" [INTERRUPTED]" if summary["interrupted"] else ""))
    by_columns: dict[tuple, list[tuple[str, dict]]] = {}
    for w in summary["workloads"]:
        columns = REGISTRY.of(w["kind"]).console_columns
        by_columns.setdefault(columns, []).extend((w["name"], r) for r in w["results"])
    for i, (columns, rows) in enumerate(by_columns.items()):
        if i:       # one table per kind of result row; the first carries the run's title
            table = Table()
        table.add_column("workload")
        for header, _field in columns:
            table.add_column(header, justify="right" if header not in ("src", "dst") else
                             "left")
        for name, r in rows:
            table.add_row(name, *(_cell(field, r.get(field)) for _h, field in columns))
        console.print(table)
    worst = sorted(summary["ports"], key=lambda p: -p["max_queue_bytes"])[:5]
    if worst and worst[0]["max_queue_bytes"]:
        console.print("deepest queues: " + ", ".join(
            f"{p['node']}:{p['port']} TC{p['tclass']} {format_size(p['max_queue_bytes'])}"
            for p in worst if p["max_queue_bytes"]))
    t = summary["totals"]
    trimmed = f"trims {t['trims']:,}, " if t.get("trims") else ""
    console.print(f"drops {t['drops']:,}, ECN marks {t['ecn_marks']:,}, {trimmed}"
                  f"pause frames {t['pause_frames']:,}")
    for note in summary["fidelity"]:
        console.print(f"[yellow]fidelity[/]: {escape(note)}")


def run(args) -> int:
    try:
        require_root("run")
    except CliError as exc:
        print(exc, file=sys.stderr)
        return exc.code
    from testbed.cli.incident import is_incident_suite, run_incident_suite

    if args.vms and (suite_runs(args.file) is not None or is_incident_suite(args.file)):
        print(f"run: {args.file} is a suite; over VMs (--vms) run one config at a time",
              file=sys.stderr)
        return 2
    code = run_incident_suite(args.file, args)     # None: not an incident suite
    if code is not None:
        return code
    runs = suite_runs(args.file)
    if runs is None:
        return run_one(args.file, args)
    worst = EXIT_OK
    finished: list[Path] = []
    for path in runs:
        code = run_one(path, args, finished)
        worst = max(worst, code)
        if code == 130:
            return worst
    if suite_compares(args.file):
        worst = max(worst, compare_suite(args.file, finished, args))
    return worst
