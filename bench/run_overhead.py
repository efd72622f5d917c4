"""Fixed cost per run: where the wall time of `testbed run` goes besides the workload.

    sudo .venv/bin/python bench/run_overhead.py                    # configs/default.yaml, 3 runs
    sudo .venv/bin/python bench/run_overhead.py --repeat 5 configs/examples/incast-pfc.yaml
    sudo .venv/bin/python bench/run_overhead.py --keep-runs /tmp/runs   # keep run dirs

Runs `python -m testbed run CONFIG --quiet` as a child process N times per config (one
after the other), times the whole process, and reads the run's own `timings.json`
(docs/run-format.md): one CLOCK_MONOTONIC interval per stage, and the builder's steps of
`up`. Prints per stage the wall time (median, min, max over the runs), the builder's
steps, `process` (the child's whole wall time), `interpreter+cli` (process minus every
stage: Python start, imports, argument parsing, printing the result table), and
`fixed cost` = process - workload, the number issue 19 wants under 1 s for the default
fabric. `workload` is the dilated workload itself (t0 to the senders' end); `planned
workload` is its planned span x D, for comparison.

Needs root (it builds the fabric). Every run tears its fabric down itself; the bench
checks after each run that the lab is gone and stops if not. Run directories go to a
temporary directory removed at the end unless --keep-runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from testbed.net.state import LabState
from testbed.run.timings import FIXED_COST_PHASES, PHASES

REPO = Path(__file__).resolve().parent.parent


def run_once(config: str, runs_dir: Path) -> tuple[float, dict, Path]:
    """(process wall seconds, timings.json, run directory) of one `testbed run`."""
    argv = [sys.executable, "-m", "testbed", "run", config, "--runs-dir", str(runs_dir),
            "--quiet"]
    start = time.perf_counter()
    res = subprocess.run(argv, capture_output=True, text=True, cwd=REPO)
    wall = time.perf_counter() - start
    lines = res.stdout.strip().splitlines()
    if not lines or not Path(lines[-1]).is_dir():
        raise SystemExit(f"run_overhead: `{' '.join(argv)}` printed no run directory "
                         f"(exit {res.returncode}):\n{res.stderr.strip()[-2000:]}")
    run_dir = Path(lines[-1])
    timings_path = run_dir / "timings.json"
    if not timings_path.exists():
        raise SystemExit(f"run_overhead: {run_dir} has no timings.json (a testbed from "
                         "before timings.json?)")
    timings = json.loads(timings_path.read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    if LabState.load(summary["lab"]) is not None:
        raise SystemExit(f"run_overhead: lab {summary['lab']!r} is still up after the run; "
                         f"run `testbed down {summary['lab']}`")
    if res.returncode != 0:
        print(f"  note: the run exited {res.returncode} (its fidelity notes: "
              f"{summary.get('fidelity')}); its timings are counted all the same",
              file=sys.stderr)
    return wall, timings, run_dir


def stats(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def table(config: str, runs: list[tuple[float, dict]]) -> str:
    rows: list[tuple[str, list[float]]] = []
    for phase in PHASES:
        rows.append((phase, [t["seconds"].get(phase, 0.0) for _w, t in runs]))
    steps: list[str] = []
    for _w, t in runs:
        steps += [s for s in t["up_steps"] if s not in steps]
    for step in steps:
        rows.append((f"  up: {step}", [t["up_steps"].get(step, 0.0) for _w, t in runs]))
    process = [w for w, _t in runs]
    staged = [sum(t["seconds"].values()) for _w, t in runs]
    rows.append(("interpreter+cli", [p - s for p, s in zip(process, staged, strict=True)]))
    rows.append(("process", process))
    rows.append(("planned workload", [t["planned_workload_wall_s"] for _w, t in runs]))
    fixed = [w - t["seconds"].get("workload", 0.0) for w, t in runs]
    rows.append(("fixed cost", fixed))
    rows.append(("  of it in stages", [sum(v for k, v in t["seconds"].items()
                                           if k in FIXED_COST_PHASES) for _w, t in runs]))
    out = [f"{config}: {len(runs)} run(s), wall seconds",
           f"{'stage':<34} {'median':>8} {'min':>8} {'max':>8}"]
    for name, values in rows:
        med, lo, hi = stats(values)
        out.append(f"{name:<34} {med:8.3f} {lo:8.3f} {hi:8.3f}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("configs", nargs="*", default=["configs/default.yaml"])
    parser.add_argument("--repeat", type=int, default=3, help="runs per config (default 3)")
    parser.add_argument("--keep-runs", type=Path, metavar="DIR",
                        help="keep the run directories under DIR")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("run_overhead: needs root (it builds the fabric)", file=sys.stderr)
        return 2
    runs_dir = args.keep_runs or Path(tempfile.mkdtemp(prefix="tb-run-overhead-"))
    runs_dir.mkdir(parents=True, exist_ok=True)
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
          f"({os.cpu_count()} CPUs; other work on this machine skews wall times)")
    try:
        for config in args.configs:
            runs = []
            for k in range(args.repeat):
                wall, timings, run_dir = run_once(config, runs_dir)
                print(f"  {config} run {k + 1}: {wall:.2f} s, workload "
                      f"{timings['seconds'].get('workload', 0.0):.2f} s ({run_dir.name})",
                      flush=True)
                runs.append((wall, timings))
            print()
            print(table(config, runs))
            print()
    finally:
        if args.keep_runs is None:
            shutil.rmtree(runs_dir, ignore_errors=True)
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
